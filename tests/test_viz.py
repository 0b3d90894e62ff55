"""The views of an alignment (the HTML view, with one `data-chunk` span per chunk and everything escaped; the
figure), the demo's learning curves, and the `align --html` command, on real tokenizer pairs."""
import csv, html, inspect, io, re, sys, warnings
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from tokenizer_support import BERT_MARKS, GOLDEN, no_network, tok
from tokenizer_texts import random_texts

from xtoken_dp.aligner import ChunkKind, TokenAligner
from xtoken_dp.cli import main as cli_main
from xtoken_dp.viz import alignment_html, plot_alignment, plot_learning_curves

PAIRS = [("mistral_spm", "qwen2"), ("qwen2", "mistral_tekken"), ("mistral_spm", "mistral_tekken"),
         ("qwen2", "bpe_bytelevel"), ("mistral_tekken", "unigram_metaspace"),
         pytest.param("qwen2", "bert_uncased", marks=BERT_MARKS)]
CHUNK_SPAN = re.compile(r'<span data-chunk="(\d+)"')
SCRIPT = 'a <script>alert("x")</script> & <b onmouseover="evil()">b</b> \'q\' "dq" </s> <|im_end|>'


def chunk_spans(view) -> list[int]: return [int(c) for c in CHUNK_SPAN.findall(view.html)]


@pytest.mark.parametrize("student,teacher", PAIRS)
def test_one_span_per_chunk_and_escaping(student, teacher):
    al = TokenAligner(tok(student), tok(teacher))
    texts = [GOLDEN, SCRIPT, "", "  \n\t ", "e\u0301t\u00e9 x 𝔘 \U0010FFFF 👍🏽"] + random_texts(12, seed=5)
    res = al.align_texts(texts, max_student_tokens=40)
    for b, text in enumerate(texts):
        for kw in ({}, {"aligner": al}):
            view = alignment_html(res, text, sample=b, **kw)
            assert chunk_spans(view) == list(range(res.samples[b].num_chunks)), (b, text)
            assert re.search(r"<\s*/?\s*(script|b)\b", view.html) is None  # every tag of the text is escaped
            assert "onmouseover=\"evil" not in view.html
            assert view._repr_html_() == view.html


def test_script_text_round_trips_through_the_escaping():
    al = TokenAligner(tok("qwen2"), tok("mistral_tekken"))
    view = alignment_html(al.align_texts([SCRIPT]), SCRIPT)
    text_part = view.html.split('<div class="xt-text">', 1)[1].split('<div class="xt-cols">', 1)[0]
    text_part = re.sub(r'<span class="xt-badge[^"]*">[^<]*</span>', "", text_part)  # tekken's BOS badge
    shown = html.unescape(re.sub(r"<[^>]+>", "", text_part))
    assert shown.replace("·", " ") == SCRIPT


def test_chunk_inside_a_character_shows_hex():
    al = TokenAligner(tok("mistral_spm"), tok("mistral_tekken"))
    text = "x 𝔘 \U0010FFFF"
    s = al.align_texts([text]).samples[0]
    tb = text.encode()
    partial = []
    for c in range(s.num_chunks):
        try: tb[s.chunk_start[c]:s.chunk_end[c]].decode()
        except UnicodeDecodeError: partial.append(c)
    assert partial
    view = alignment_html(s, text)
    for c in partial:
        body = re.search(rf'<span data-chunk="{c}"[^>]*>(.*?)</span>(?=<span data-chunk|</div>|<span class="xt-gap"|<s )',
                         view.html).group(1)
        assert 'class="xt-hex"' in body and re.search(r"[0-9A-F]{2}", body)


def test_marks_incorrect_one_sided_specials_dropped_and_whitespace():
    al = TokenAligner(tok("mistral_spm"), tok("qwen2"))
    text = "e\u0301t\u00e9 a\tb\nc " + "long tail " * 10
    res = al.align_texts([text], max_student_tokens=12)
    s = res.samples[0]
    view = alignment_html(res, text, aligner=al).html
    spans = dict(re.findall(r'<span data-chunk="(\d+)" class="([^"]+)"', view))
    for c in range(s.num_chunks):
        kind, classes = ChunkKind(int(s.chunk_kind[c])), spans[str(c)].split()
        if kind in (ChunkKind.STUDENT_ONLY, ChunkKind.TEACHER_ONLY, ChunkKind.STUDENT_SPECIAL, ChunkKind.TEACHER_SPECIAL):
            assert "xt-one" in classes
        elif not s.pair_is_correct[c]: assert "xt-bad" in classes
        else: assert "xt-bad" not in classes and "xt-one" not in classes
    assert s.chunk_kind[0] == ChunkKind.STUDENT_SPECIAL and "⟨bos⟩" in view
    assert any(not s.pair_is_correct[c] and s.chunk_kind[c] == ChunkKind.CONTENT for c in range(s.num_chunks))
    assert '<s class="xt-dropped"' in view and s.dropped_bytes > 0
    assert "→" in view and "↵" in view and "·" in view
    assert "bytes [0, " in view and "id 1" in view  # tooltips: byte ranges and ids


def test_view_checks_its_inputs(tmp_path):
    al = TokenAligner(tok("qwen2"), tok("mistral_tekken"))
    res = al.align_texts(["ab", "cd"])
    with pytest.raises(ValueError, match="expected 2 UTF-8 bytes, got 3"): alignment_html(res, "abc")
    with pytest.raises(IndexError, match=r"sample must be an int in \[0, 2\)"): alignment_html(res, "ab", sample=2)
    with pytest.raises(TypeError, match="AlignmentResult or a SampleAlignment"): alignment_html(["x"], "ab")
    with pytest.raises(TypeError, match=r"names must be a \(student, teacher\) pair of str"): alignment_html(res, "ab", names="st")
    with pytest.raises(TypeError, match="names must be"): plot_alignment(res, "ab", names=("a", "b", "c"))
    page = alignment_html(res, "cd", sample=1).save(tmp_path / "v.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and '<meta charset="utf-8">' in page


@pytest.mark.parametrize("student,teacher", PAIRS[:3])
def test_plot_alignment(student, teacher):
    from matplotlib.figure import Figure
    al = TokenAligner(tok(student), tok(teacher))
    text = GOLDEN + " x 𝔘 👍🏽"
    res = al.align_texts([text], max_student_tokens=30)
    for kw in ({}, {"aligner": al, "byte_range": (5, 40)}):
        fig = plot_alignment(res, text, **kw)
        assert isinstance(fig, Figure)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*[Gg]lyph.*")  # no glyph the font lacks is drawn
            fig.savefig(io.BytesIO(), format="png")
    with pytest.raises(ValueError, match="byte_range"): plot_alignment(res, text, byte_range=(0, 10_000))


# ---- learning curves ----

def curve_rows():
    rng = np.random.default_rng(1)
    return [dict(arm=arm, seed=seed, step=step, eval_bpb=3 + off + np.exp(-step / 100) + rng.normal(0, 0.01))
            for arm, off in (("ce", 0.2), ("kd", 0.0)) for seed in range(3) for step in range(0, 201, 50)]


def test_learning_curves_bands_and_paired_delta():
    rows = curve_rows()
    fig = plot_learning_curves(rows, teacher_bpb=2.9, baseline="ce")
    main, delta = fig.axes
    lines = {l.get_label().split(":")[0]: l for l in main.get_lines()}
    assert set(lines) == {"ce", "kd", "teacher"}
    kd = [r for r in rows if r["arm"] == "kd" and r["step"] == 200]
    assert np.isclose(lines["kd"].get_ydata()[-1], np.mean([r["eval_bpb"] for r in kd]))
    assert "(3 seeds)" in lines["kd"].get_label() and lines["teacher"].get_linestyle() == "--"
    paired = [next(r["eval_bpb"] for r in rows if r["arm"] == "kd" and r["seed"] == s and r["step"] == 200) -
              next(r["eval_bpb"] for r in rows if r["arm"] == "ce" and r["seed"] == s and r["step"] == 200) for s in range(3)]
    kd_delta = next(l for l in delta.get_lines() if l.get_label() == "kd")
    assert np.isclose(kd_delta.get_ydata()[-1], np.mean(paired)) and np.isclose(np.mean(paired), -0.2, atol=0.05)


def test_learning_curves_from_csv_and_errors():
    rows = curve_rows()
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=["arm", "seed", "step", "eval_bpb", "train_ce"]); w.writeheader()
    for r in rows: w.writerow({**r, "train_ce": 1.0})
    w.writerow({"arm": "kd", "seed": 0, "step": 250, "eval_bpb": "", "train_ce": 1.0})  # a missing point is skipped
    read = list(csv.DictReader(io.StringIO(buf.getvalue())))
    a, b = plot_learning_curves(rows), plot_learning_curves(read)
    for la, lb in zip(a.axes[0].get_lines(), b.axes[0].get_lines()):
        assert la.get_label() == lb.get_label() and np.allclose(la.get_ydata(), lb.get_ydata())
    assert len(plot_learning_curves(rows, arms=["kd"]).axes[0].get_lines()) == 1
    with pytest.raises(ValueError, match=r"rows\[0\] must have the keys"): plot_learning_curves([{"arm": "x"}])
    with pytest.raises(ValueError, match="must be a number"): plot_learning_curves([{**rows[0], "eval_bpb": "abc"}])
    with pytest.raises(ValueError, match="no eval_bpb point"): plot_learning_curves([{**rows[0], "eval_bpb": None}])
    with pytest.raises(ValueError, match=r"arms \['dpo'\] have no points"): plot_learning_curves(rows, arms=["dpo"])


def test_learning_curves_keep_the_demo_signature():
    "The distillation demo calls `plot_learning_curves(rows, teacher_bpb=..., title=..., baseline=...)` on curves.csv rows."
    params = inspect.signature(plot_learning_curves).parameters
    assert list(params) == ["rows", "teacher_bpb", "title", "baseline", "arms"]
    assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in list(params)[1:])
    rows = [{**r, "train_ce": 1.5, "train_kd": ""} for r in curve_rows()]  # the demo's CSV columns
    fig = plot_learning_curves(rows, teacher_bpb=2.9, title="t", baseline="ce")
    main, delta = fig.axes
    assert main.get_title() == "t" and "Paired difference to ce" in delta.get_title()
    teacher = next(l for l in main.get_lines() if l.get_label().startswith("teacher"))
    assert np.allclose(teacher.get_ydata(), 2.9)
    assert len(plot_learning_curves(rows, teacher_bpb=None, title=None).axes) == 1


# ---- the align command's --html ----

def test_align_html_command(tmp_path, capsys):
    out = tmp_path / "new" / "a.html"   # a missing folder is created
    assert cli_main(["align", GOLDEN, "--student", "mistral_spm", "--teacher", "qwen2", "--html", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "byte_coverage" in printed and f"wrote {out}" in printed
    page = out.read_text(encoding="utf-8")
    al = TokenAligner(tok("mistral_spm"), tok("qwen2"))
    assert len(CHUNK_SPAN.findall(page)) == al.align_texts([GOLDEN]).samples[0].num_chunks
    assert cli_main(["align", "-leading dash", "--student", "qwen2", "--teacher", "mistral_tekken",
                     "--no-special-tokens"]) == 0
    assert "wrote" not in capsys.readouterr().out


def test_align_html_command_usage_errors(tmp_path, capsys):
    assert cli_main(["align", "--help"]) == 0 and "--html FILE" in capsys.readouterr().out
    assert cli_main(["align", "text", "--student", "qwen2"]) == 2
    (tmp_path / "a_file").write_text("x")
    assert cli_main(["align", "text", "--student", "qwen2", "--teacher", "qwen2", "--html",
                     str(tmp_path / "a_file" / "a.html")]) == 2
    assert "--html: cannot write to the folder" in capsys.readouterr().err
    assert cli_main(["align", "text", "--student", "gpt9", "--teacher", "qwen2"]) == 2
    assert cli_main(["align", "text", "--student", "qwen2", "--teacher", "qwen2", "--html", str(tmp_path)]) == 2
    assert "--html: expected a file name, got the folder" in capsys.readouterr().err

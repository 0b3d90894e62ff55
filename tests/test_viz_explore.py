"""The ipywidgets explorers build without a network and re-render when driven."""
import re, sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from tokenizer_support import no_network, tok

from xtoken_dp.explore import alignment_explorer, padding_tax_explorer, tokenizer_choices

CHUNK_SPAN = re.compile(r'<span data-chunk="\d+"')


def test_alignment_explorer_rerenders_on_every_control():
    import ipywidgets as widgets
    app = alignment_explorer(["mistral_spm", "qwen2", "mistral_tekken"], text="Hello world")
    assert isinstance(app, widgets.VBox)
    assert len(CHUNK_SPAN.findall(app.view.value)) == app.result.samples[0].num_chunks
    before, stats_before = app.result.samples[0].num_chunks, app.stats.value
    app.text.value = "東京は晴れ 👍🏽 3.14159 <script>x</script>"
    after = app.result.samples[0].num_chunks
    assert after != before and len(CHUNK_SPAN.findall(app.view.value)) == after
    assert app.stats.value != stats_before and "<script>" not in app.view.value
    with_bos = app.result.samples[0].num_chunks
    app.special_tokens.value = False
    assert app.result.samples[0].num_chunks == with_bos - 1  # mistral_spm's BOS chunk is gone
    app.student.value = "mistral_tekken"
    assert "mistral_tekken" in app.view.value and app.error is None
    app.teacher.value = "mistral_tekken"  # a tokenizer against itself: every chunk 1:1 and correct
    s = app.result.samples[0]
    assert s.pair_is_correct.all() and (s.student_chunk_size == 1).all()


def test_alignment_explorer_shows_errors_in_place():
    def broken(): raise FileNotFoundError("no such tokenizer here")
    app = alignment_explorer({"qwen2": tok("qwen2"), "broken": broken}, text="x", student="qwen2", teacher="qwen2")
    assert app.error is None
    app.teacher.value = "broken"
    assert isinstance(app.error, FileNotFoundError) and "no such tokenizer here" in app.view.value and app.result is None
    app.teacher.value = "qwen2"
    assert app.error is None and app.result is not None


def test_default_choices_are_offline():
    choices = tokenizer_choices()
    assert {"qwen2", "mistral_spm", "mistral_tekken"} <= set(choices)
    assert {f"toy:{k}" for k in ("bpe_bytelevel", "unigram_metaspace")} <= set(choices)
    with pytest.raises(ValueError, match="student must be one of the choices"): alignment_explorer(["qwen2"], student="gpt9")
    with pytest.raises(TypeError, match="must be a list of names"): tokenizer_choices("qwen2")


def test_padding_tax_explorer_follows_its_sliders():
    import ipywidgets as widgets
    app = padding_tax_explorer(n=256, s=2048)
    assert isinstance(app, widgets.VBox)
    r0, table0, png0 = app.report, app.table.value, bytes(app.plot.value)
    assert r0["rows"] == 256 and r0["padded_bytes"] > 4 * r0["payload_bytes"]
    app.n.value = 512
    assert app.report["rows"] == 512 and app.table.value != table0 and bytes(app.plot.value) != png0
    app.s.value = 4096
    assert app.report["width"] == 4096
    app.distribution.value = "uniform"
    assert 1.3 < app.report["padded_over_payload"] < 2.0 and app.mean_fraction.disabled
    app.distribution.value = "full"
    assert app.report["tokens"] == 512 * 4096
    assert app.report["payload_bytes"] > app.report["padded_bytes"] * 0.99


def test_padding_tax_explorer_checks_and_never_clamps():
    app = padding_tax_explorer(n=1500, s=10000, mean_fraction=0.01)  # outside the default slider ranges
    assert (app.report["rows"], app.report["width"]) == (1500, 10000) and app.mean_fraction.value == 0.01
    with pytest.raises(ValueError, match="n: expected an int >= 1, got 0"): padding_tax_explorer(n=0)
    with pytest.raises(TypeError, match="s: expected an int >= 1, got float"): padding_tax_explorer(s=64.0)
    with pytest.raises(ValueError, match="distribution must be one of"): padding_tax_explorer(distribution="zipf")
    with pytest.raises(ValueError, match=r"mean_fraction must be a number in \(0, 1\]"): padding_tax_explorer(mean_fraction=2)

"""The builder's string rules on real tokenizers: identical tokenizers map every id to itself, byte twins keep their
own column, specials left unpaired by role pair by string, and the exact map keeps the canonical twin.

Real vocabularies come from the `mistral-common` wheel (mistral_spm: SentencePiece with byte fallback, so `(` and
`<0x28>` are twins; mistral_tekken: byte-level, one `(`); the Unigram tokenizer is trained locally (it declares `<pad>`,
`<unk>` and an end-of-text special).
"""
import pytest
import torch

from xtoken_dp.projection import (ProjectionFileError, build_projection, exact_token_map_from_topk,
                                  load_dense_projection, read_projection_metadata)
from xtoken_dp.tokenizers import load_tokenizer, special_token_roles, train_toy_tokenizer


@pytest.fixture(scope="module")
def spm():
    return load_tokenizer("mistral_spm")


@pytest.fixture(scope="module")
def spm_self(spm):
    return build_projection(spm, spm, progress=False)


@pytest.fixture(scope="module")
def spm_tekken(spm):
    tekken = load_tokenizer("mistral_tekken")
    return tekken, build_projection(spm, tekken, progress=False)


@pytest.fixture(scope="module")
def unigram():
    return train_toy_tokenizer("unigram_metaspace", vocab_size=700)


def exact_map(build, relaxed, teacher_vocab_size, canonical=True):
    "The strict or relaxed exact map of a build, with or without its canonical rows."
    return exact_token_map_from_topk(build.indices, build.likelihoods, xtoken_loss=relaxed,
                                     teacher_vocab_size=teacher_vocab_size, exact_student_ids=build.exact_student_ids,
                                     canonical_student_ids=build.canonical_student_ids if canonical else None)


def assert_identity(tok, build):
    "Every id maps to itself (one-hot, certified, canonical) and both exact maps are the identity."
    n = len(tok)
    assert build.indices[:, 0].tolist() == list(range(n))
    assert (build.indices[:, 1:] == -1).all() and (build.likelihoods[:, 0] == 1).all()
    assert build.exact_student_ids.tolist() == list(range(n)) == build.canonical_student_ids.tolist()
    for relaxed in (False, True):
        parts = exact_map(build, relaxed, n)
        assert parts["common_student"].tolist() == parts["common_teacher"].tolist() == list(range(n))
        assert parts["uncommon_student"].numel() == parts["uncommon_teacher"].numel() == 0


def test_identical_spm_maps_every_id_to_itself(spm, spm_self):
    assert_identity(spm, spm_self)
    # byte twins: `A` and `<0x41>` each keep their own column (the lowest-id rule sent both to `<0x41>`)
    a, twin = spm.convert_tokens_to_ids("A"), spm.convert_tokens_to_ids("<0x41>")
    assert a != twin and spm_self.indices[a, 0] == a and spm_self.indices[twin, 0] == twin
    assert spm_self.report.same_string_rows == 125
    assert spm_self.report.canonical_rows == len(spm)


def test_identical_unigram_pairs_its_pad_by_string(unigram):
    build = build_projection(unigram, unigram, progress=False)
    assert_identity(unigram, build)
    pads = [s for s, r in special_token_roles(unigram).items() if r[0] == "pad"]
    assert pads
    by = {p["student"]: p["by"] for p in build.report.special_pairs}
    assert all(by[s] == "string" for s in pads)
    assert build.report.unpaired_student_specials == [] and build.report.empty_rows == 0


def test_spm_to_tekken_keeps_the_canonical_paren(spm, spm_tekken):
    tekken, build = spm_tekken
    paren, twin = spm.convert_tokens_to_ids("("), spm.convert_tokens_to_ids("<0x28>")
    target = tekken.convert_tokens_to_ids("(")
    assert build.indices[paren, 0] == build.indices[twin, 0] == target   # one tekken `(` for both twins
    assert paren in build.canonical_student_ids.tolist() and twin not in build.canonical_student_ids.tolist()
    for relaxed in (False, True):
        common = dict(zip(*(exact_map(build, relaxed, len(tekken))[k].tolist() for k in ("common_teacher", "common_student"))))
        assert common[target] == paren
        today = dict(zip(*(exact_map(build, relaxed, len(tekken), canonical=False)[k].tolist()
                           for k in ("common_teacher", "common_student"))))
        assert today[target] == twin   # without the canonical rows: the lower id, the byte-fallback twin
        changed = [t for t in common if common[t] != today[t]]
        assert common.keys() == today.keys() and len(changed) == 94
    assert build.report.same_string_rows == 0   # tekken has one token per byte string: nothing to re-point


def test_the_file_carries_the_canonical_rows(tmp_path, spm, spm_tekken):
    tekken, build = spm_tekken
    dense = load_dense_projection(build.save(tmp_path / "p.pt"))
    assert torch.equal(dense.canonical_student_ids, build.canonical_student_ids)
    assert dense.metadata["format_version"] == 2
    assert dense.metadata["report"]["canonical_rows"] == build.canonical_student_ids.numel()
    from_file = exact_token_map_from_topk(dense.indices, dense.likelihoods, xtoken_loss=False,
                                          teacher_vocab_size=len(tekken), exact_student_ids=dense.exact_student_ids,
                                          canonical_student_ids=dense.canonical_student_ids)
    assert torch.equal(from_file["common_student"], exact_map(build, False, len(tekken))["common_student"])
    assert spm.convert_tokens_to_ids("(") in from_file["common_student"].tolist()


def test_a_file_without_canonical_rows_gives_todays_map(tmp_path, spm, spm_tekken):
    tekken, build = spm_tekken
    obj = build.to_file_dict()
    del obj["canonical_student_ids"]
    torch.save(obj, tmp_path / "old.pt")
    dense = load_dense_projection(tmp_path / "old.pt")
    assert dense.canonical_student_ids is None
    for relaxed in (False, True):
        got = exact_token_map_from_topk(dense.indices, dense.likelihoods, xtoken_loss=relaxed, teacher_vocab_size=len(tekken),
                                        exact_student_ids=dense.exact_student_ids,
                                        canonical_student_ids=dense.canonical_student_ids)
        today = exact_map(build, relaxed, len(tekken), canonical=False)
        assert all(torch.equal(got[k], today[k]) for k in today)
        assert spm.convert_tokens_to_ids("<0x28>") in got["common_student"].tolist()


@pytest.mark.parametrize("value, found", [
    (torch.tensor([32000]), "ids from 32000 to 32000"),
    (torch.tensor([[3]]), "a Tensor with 2 dimensions"),
    (torch.tensor([3.0]), "dtype torch.float32"),
    ("3", "a str"),
    (None, None),
])
def test_bad_canonical_rows_are_refused(tmp_path, spm_self, value, found):
    obj = spm_self.to_file_dict()
    path = tmp_path / "bad.pt"
    if value is None:   # canonical rows that are not certified exact rows
        obj["exact_student_ids"] = obj["exact_student_ids"][1:]
        obj["report"] = {k: v for k, v in obj["report"].items() if k != "exact_rows"}
        found = "expected rows also listed in 'exact_student_ids', found 1 other rows, e.g. [0]"
    else: obj["canonical_student_ids"] = value
    torch.save(obj, path)
    for reader in (load_dense_projection, read_projection_metadata):
        with pytest.raises(ProjectionFileError, match="canonical_student_ids") as info:
            reader(path)
        assert found in str(info.value) and str(path) in str(info.value)

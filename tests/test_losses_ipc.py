"""I11 (ipc_distill.md A7): the loss on teacher logits rebuilt through `xtoken_dp.ipc` equals the loss on the original
tensor, bit for bit; and the loss accepts the top-k record (`TopKTeacherLogits`), ALM reading its exact target log-probs,
the same whether the loss runs whole, in blocks (each densifying only its rows) or fused with the lm_head.
"""
import dataclasses

import pytest
import torch

from xtoken_dp import losses as L
from xtoken_dp.ipc import TeacherLogitsProducer, TopKTeacherLogits, rebuild_teacher_full_logits_from_ipc
from losses_helpers import V_S, V_T, W_S, W_T, make_batch, make_logits, write_projections


@pytest.fixture(scope="module")
def dense(tmp_path_factory): return write_projections(tmp_path_factory.mktemp("ipc_projections"))[0]


@pytest.fixture
def shm_dir(tmp_path): return tmp_path


def config_for(mode, dense, **kw):
    return L.XTokenLossConfig(V_S, [L.TeacherLossSpec(mode, dense if mode in L.PROJECTION_MODES else None, V_T)], **kw)


@pytest.mark.parametrize("mode", ["pkl", "gold", "hkl", "alm", "uld"])
def test_I11_loss_on_ipc_rebuilt_logits_is_bit_identical(dense, shm_dir, mode):
    batch = make_batch(201)
    student, teachers = make_logits(202, batch, dtype=torch.float32)
    config = config_for(mode, dense, vocab_topk=5)
    norms = L.compute_global_normalizers(batch, config)
    expected, expected_metrics = L.xtoken_kd_loss(student, batch, teachers, config=config, normalizers=norms)
    B, T, W = teachers[0].shape
    with TeacherLogitsProducer(max_batch=B + 2, max_seq_len=T + 3, vocab_width=W + 4, shm_dir=shm_dir) as producer:
        handles = producer.publish(teachers[0])
        view = rebuild_teacher_full_logits_from_ipc({"teacher_0_full_logits_ipc": handles}, key="teacher_0_full_logits_ipc")
        assert view.data_ptr() != teachers[0].data_ptr() and not view.is_contiguous()  # a zero-copy slice of the buffer
        assert torch.equal(view, teachers[0])
        got, got_metrics = L.xtoken_kd_loss(student, batch, {0: view}, config=config, normalizers=norms)
        assert torch.equal(got, expected), (got.item(), expected.item())
        for name, value in expected_metrics.items(): assert torch.equal(got_metrics[name], value), name
        half = rebuild_teacher_full_logits_from_ipc({"k": handles[2:]}, key="k")  # a later microbatch's slice
        norms_half = L.compute_global_normalizers({k: v[2:] for k, v in batch.items()}, config)
        mb = {k: v[2:] for k, v in batch.items()}
        assert torch.equal(L.xtoken_kd_loss(student[2:], mb, {0: half}, config=config, normalizers=norms_half)[0],
                           L.xtoken_kd_loss(student[2:], mb, {0: teachers[0][2:]}, config=config, normalizers=norms_half)[0])


def test_I11_topk_record_alm_uses_the_exact_target_logprob(dense, shm_dir):
    batch = make_batch(203)
    student, teachers = make_logits(204, batch, dtype=torch.float32)
    ids = batch["teacher_0_input_ids"]
    target_ids = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -1)], 1)  # the caller shifts
    with TeacherLogitsProducer(max_batch=4, max_seq_len=ids.shape[1], vocab_width=W_T, storage="topk", topk=3,
                               shm_dir=shm_dir) as producer:
        handles = producer.publish(teachers[0], vocab_size=V_T, target_ids=target_ids)
        record = rebuild_teacher_full_logits_from_ipc({"h": handles}, key="h")
        assert isinstance(record, TopKTeacherLogits)
        alm = config_for("alm", dense)
        norms = L.compute_global_normalizers(batch, alm)
        exact = L.xtoken_kd_loss(student, batch, teachers, config=alm, normalizers=norms)[0]
        via_record = L.xtoken_kd_loss(student, batch, {0: record}, config=alm, normalizers=norms)[0]
        torch.testing.assert_close(via_record, exact, atol=1e-5, rtol=1e-5)  # target_logprob is exact, not the top-3
        for mode in ("pkl", "gold", "uld"):  # every other mode densifies the record: approximate off the support
            config = config_for(mode, dense)
            loss, _ = L.xtoken_kd_loss(student, batch, {0: record}, config=config,
                                       normalizers=L.compute_global_normalizers(batch, config))
            assert torch.isfinite(loss)
        no_target = TopKTeacherLogits(record.values, record.indices, record.lse, None, record.vocab_size)
        with pytest.raises(ValueError, match="target_logprob"):
            L.xtoken_kd_loss(student, batch, {0: no_target}, config=alm, normalizers=norms)


@pytest.mark.parametrize("mode", ["pkl", "gold", "hkl", "alm", "uld"])
def test_blocks_and_the_fused_lm_head_read_a_topk_record_like_the_whole_microbatch(dense, shm_dir, mode):
    "A block densifies only its own rows of the record; the result equals densifying it whole (float64 student)."
    batch = make_batch(205)
    _, teachers = make_logits(206, batch, dtype=torch.float32)
    ids = batch["teacher_0_input_ids"]
    target_ids = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -1)], 1)
    g = torch.Generator().manual_seed(207)
    hidden = torch.randn(*batch["input_ids"].shape, 5, generator=g, dtype=torch.float64)
    weight = torch.randn(W_S, 5, generator=g, dtype=torch.float64)
    config = config_for(mode, dense, vocab_topk=4, block_size=None)
    norms = L.compute_global_normalizers(batch, config)
    with TeacherLogitsProducer(max_batch=4, max_seq_len=ids.shape[1], vocab_width=W_T, storage="topk", topk=3,
                               shm_dir=shm_dir) as producer:
        record = rebuild_teacher_full_logits_from_ipc(
            {"h": producer.publish(teachers[0], vocab_size=V_T, target_ids=target_ids)}, key="h")
        results = {}
        for form, size in (("whole", None), ("blocks", 2), ("fused", 2), ("fused", None)):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            sized = dataclasses.replace(config, block_size=size)
            if form == "fused": loss, _ = L.xtoken_kd_loss_fused(h, w, batch, {0: record}, config=sized, normalizers=norms)
            else: loss, _ = L.xtoken_kd_loss(h @ w.T, batch, {0: record}, config=sized, normalizers=norms)
            results[form, size] = (loss.detach(), *torch.autograd.grad(loss, (h, w)))
    expected = results["whole", None]
    assert expected[0].item() > 0
    for key, got in results.items():
        for a, b in zip(got, expected): torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13, msg=str(key))

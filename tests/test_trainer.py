"""XTokenDistillTrainer on CPU with tiny randomly initialised HF models (no weights are downloaded).

Two toy tokenizers (a Unigram student, a byte-level BPE teacher, 300 tokens each, cached), a Qwen2-architecture
student and a Llama-architecture teacher of one layer, hidden size 32. The data-parallel test spawns 2 gloo
processes that build the same trainer with `build_trainer` below (module level, so the children can import it).
"""
import copy
import dataclasses
import functools
import json
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from xtoken_dp.aligner import TokenAligner
from xtoken_dp.collate import CrossTokenizerCollator
from xtoken_dp.losses import TeacherLossSpec, XTokenLossConfig, compute_global_normalizers, xtoken_kd_loss
from xtoken_dp.tokenizers import toy_corpus, train_toy_tokenizer
from xtoken_dp.trainer import (LOSS_CONFIG_NAME, XTokenDistillTrainer, XTokenDistillTrainingArguments,
                               precompute_teacher_logits, train_data_parallel)

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            max_position_embeddings=128)


def _parts():
    "Tokenizers, collator, loss config, teacher, student and data: deterministic, so every process builds the same."
    student_tok = train_toy_tokenizer("unigram_metaspace", vocab_size=300)
    teacher_tok = train_toy_tokenizer("bpe_bytelevel", vocab_size=300)
    collator = CrossTokenizerCollator(student_tokenizer=student_tok, teacher_tokenizer=teacher_tok,
                                      aligner=TokenAligner(student_tok, teacher_tok), ctx_length_student=48,
                                      ctx_length_teacher=48)
    config = XTokenLossConfig(student_vocab_size=len(student_tok),
                              teachers=[TeacherLossSpec("alm", vocab_size=len(teacher_tok))])
    torch.manual_seed(1)
    teacher = LlamaForCausalLM(LlamaConfig(vocab_size=len(teacher_tok), **TINY))
    torch.manual_seed(0)
    student = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(student_tok), **TINY))
    data = [{"text": text[:100], "idx": k} for k, text in enumerate(toy_corpus(max_bytes=20_000)[:8])]
    return dict(student_tok=student_tok, teacher_tok=teacher_tok, collator=collator, config=config, teacher=teacher,
                student=student, data=data)


def build_trainer(output_dir, parts=None, *, data=None, teachers="live", **overrides):
    "The trainer of these tests; `overrides` go to the arguments (one SGD step of batch 2 by default)."
    parts = parts or _parts()
    kw = dict(output_dir=str(output_dir), loss_config=parts["config"], report_to=[], use_cpu=True,
              dataloader_num_workers=0, disable_tqdm=True, logging_steps=1, save_strategy="no", max_steps=1,
              per_device_train_batch_size=2, optim="sgd", learning_rate=0.5, ddp_find_unused_parameters=False)
    kw.update(overrides)
    teacher_kw = dict(teachers=[parts["teacher"]]) if teachers == "live" else dict(teachers=[None], teacher_logits=teachers)
    return XTokenDistillTrainer(model=copy.deepcopy(parts["student"]), args=XTokenDistillTrainingArguments(**kw),
                                data_collator=parts["collator"], train_dataset=parts["data"] if data is None else data,
                                **teacher_kw)


@pytest.fixture(scope="module")
def parts():
    return _parts()


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _flat_params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_a_few_steps_reduce_the_loss(parts, tmp_path):
    data = parts["data"][:4]
    trainer = build_trainer(tmp_path, parts, data=data, max_steps=8, per_device_train_batch_size=4, optim="adamw_torch",
                            learning_rate=1e-2)
    trainer.train()
    losses = _losses(trainer)
    ce = [h["ce_loss"] for h in trainer.state.log_history if "ce_loss" in h]
    # The KD term has a floor far above zero (the teacher is random), so the bars are on the drop, not a ratio:
    # 8 Adam steps take about 1.7 nats off the total and 1.3 off the CE term.
    assert len(losses) == 8 and losses[-1] < losses[0] - 1.0, losses
    assert ce[-1] < ce[0] - 0.8 and all(b < a for a, b in zip(losses, losses[1:])), (losses, ce)
    teacher = parts["teacher"]
    assert not teacher.training and all(not p.requires_grad and p.grad is None for p in teacher.parameters())


def test_trainer_loss_equals_xtoken_kd_loss_by_hand(parts, tmp_path):
    data, config = parts["data"][:4], parts["config"]
    batch = parts["collator"](data)
    with torch.no_grad():
        student_logits = parts["student"](input_ids=batch["input_ids"], attention_mask=batch["token_mask"]).logits
        teacher_logits = parts["teacher"](input_ids=batch["teacher_0_input_ids"],
                                          attention_mask=batch["teacher_0_token_mask"]).logits
        loss, metrics = xtoken_kd_loss(student_logits, batch, {0: teacher_logits}, config=config,
                                       normalizers=compute_global_normalizers(batch, config))
    trainer = build_trainer(tmp_path, parts, data=data, per_device_train_batch_size=4)
    trainer.train()
    logged = trainer.state.log_history[0]
    for name in ("loss", "ce_loss", "kl_loss", "accuracy", "num_valid_chunks_t0", "alm_gap_t0"):
        assert logged[name] == pytest.approx(float(metrics[name]), rel=1e-5, abs=1e-6), name
    assert logged["loss"] == pytest.approx(float(loss), rel=1e-5)


def test_gradient_accumulation_2x1_equals_1x2(parts, tmp_path):
    one_microbatch = build_trainer(tmp_path / "a", parts, data=parts["data"][:2], per_device_train_batch_size=2)
    two_microbatches = build_trainer(tmp_path / "b", parts, data=parts["data"][:2], per_device_train_batch_size=1,
                                     gradient_accumulation_steps=2)
    one_microbatch.train(); two_microbatches.train()
    start, a, b = _flat_params(parts["student"]), _flat_params(one_microbatch.model), _flat_params(two_microbatches.model)
    assert (a - start).abs().max() > 1e-3
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert _losses(one_microbatch)[0] == pytest.approx(_losses(two_microbatches)[0], rel=1e-6)


def test_overwriting_the_logits_gives_the_same_step(parts, tmp_path):
    "overwrite_logits in a real model: the lm_head reads the gradient written over its logits; HF's 1/2 loss scale applies in place."
    config = dataclasses.replace(parts["config"], block_size=3)
    steps = {}
    for overwrite in (False, True):
        trainer = build_trainer(tmp_path / str(overwrite), parts, data=parts["data"][:2], per_device_train_batch_size=1,
                                gradient_accumulation_steps=2, loss_config=dataclasses.replace(config, overwrite_logits=overwrite))
        trainer.train()
        steps[overwrite] = _flat_params(trainer.model), _losses(trainer)[0]
    assert (steps[True][0] - _flat_params(parts["student"])).abs().max() > 1e-3
    torch.testing.assert_close(steps[True][0], steps[False][0], rtol=0, atol=1e-6)
    assert steps[True][1] == pytest.approx(steps[False][1], rel=1e-6)


def test_resume_from_a_checkpoint_gives_the_same_next_step_loss(parts, tmp_path):
    kw = dict(max_steps=3, optim="adamw_torch", learning_rate=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = build_trainer(tmp_path / "whole", parts, save_strategy="steps", save_steps=2, **kw)
        whole.train()
        checkpoint = tmp_path / "whole" / "checkpoint-2"
        assert json.loads((checkpoint / LOSS_CONFIG_NAME).read_text())["teachers"][0]["mode"] == "alm"
        resumed = build_trainer(tmp_path / "resumed", parts, **kw)
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert _losses(resumed)[-1] == pytest.approx(_losses(whole)[-1], rel=1e-6)
    torch.testing.assert_close(_flat_params(resumed.model), _flat_params(whole.model), rtol=0, atol=1e-6)


def test_precomputed_topk_teacher_logits_give_the_live_alm_losses(parts, tmp_path):
    precomputed = precompute_teacher_logits({0: parts["teacher"]}, parts["data"], parts["collator"], topk=8,
                                            vocab_sizes={0: len(parts["teacher_tok"])}, batch_size=3)
    live = build_trainer(tmp_path / "live", parts, max_steps=2)
    served = build_trainer(tmp_path / "served", parts, max_steps=2, teachers=precomputed)
    live.train(); served.train()
    assert _losses(served) == pytest.approx(_losses(live), rel=1e-5)


def test_two_gloo_processes_equal_one_process(parts, tmp_path):
    data = parts["data"][:2]
    single = build_trainer(tmp_path / "single", parts, data=data, per_device_train_batch_size=2)
    single.train()
    ranks = train_data_parallel(functools.partial(build_trainer, str(tmp_path / "dp"), data=data,
                                                  per_device_train_batch_size=1), 2, out_dir=tmp_path / "ranks")
    expected = single.model.state_dict()
    for result in ranks:
        for name, value in result["state_dict"].items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=name)
        logged = result["log_history"][0]
        assert logged["loss"] == pytest.approx(_losses(single)[0], rel=1e-6)
        assert logged["num_valid_samples"] == 2.0  # the metrics are reduced over both ranks

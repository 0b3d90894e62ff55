"""XTokenDistillTrainer on CPU with tiny randomly initialised HF models (no weights are downloaded).

Two toy tokenizers (a Unigram student, a byte-level BPE teacher, 300 tokens each, cached), a Qwen2-architecture
student and a Llama-architecture teacher of one layer, hidden size 32. The data-parallel test spawns 2 gloo
processes that build the same trainer with `build_trainer` below (module level, so the children can import it).
"""
import copy
import dataclasses
import functools
import json
import math
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from xtoken_dp.aligner import TokenAligner
from xtoken_dp.collate import CrossTokenizerCollator
from xtoken_dp.losses import TeacherLossSpec, XTokenLossConfig, compute_global_normalizers, xtoken_kd_loss
from xtoken_dp.tokenizers import toy_corpus, train_toy_tokenizer
from xtoken_dp.trainer import (LOSS_CONFIG_NAME, DistillationSetupError, PrecomputedTeacherLogits, XTokenDistillTrainer,
                               XTokenDistillTrainingArguments,
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


# ---- mistakes refused when the trainer is built (each trained, or failed at the first step, before) ----

def _other_teacher_tok():
    return train_toy_tokenizer("bpe_bytelevel_digits", vocab_size=300)  # another teacher, with a vocabulary of the same size


@pytest.fixture(scope="module")
def projections(parts, tmp_path_factory):
    "Projection files: the pair's own, one built for another teacher of the same size, and the pair's built backwards."
    from xtoken_dp.projection import build_projection_file
    folder = tmp_path_factory.mktemp("projections")
    student, teacher = parts["student_tok"], parts["teacher_tok"]
    for name, pair in {"ours": (student, teacher), "other": (student, _other_teacher_tok()), "reversed": (teacher, student)}.items():
        build_projection_file(*pair, folder / f"{name}.pt", progress=False)
    return folder


def _config(parts, mode="alm", *, path=None, student_vocab_size=None, teacher_vocab_size=None):
    return XTokenLossConfig(student_vocab_size=student_vocab_size or len(parts["student_tok"]),
                            teachers=[TeacherLossSpec(mode, projection_path=path,
                                                      vocab_size=teacher_vocab_size or len(parts["teacher_tok"]))])


def _refused(build, *, match):
    "The construction-time refusal: a ValueError (a DistillationSetupError) whose message matches."
    with pytest.raises(ValueError, match=match) as refused:
        build()
    assert type(refused.value).__name__ == "DistillationSetupError"
    return str(refused.value)


def test_a_jagged_collator_is_refused_when_the_trainer_is_built(parts, tmp_path):
    # before: construction passed and step 1 failed inside transformers (TypeError: can only join an iterable)
    student, teacher = parts["student_tok"], parts["teacher_tok"]
    jagged = CrossTokenizerCollator(student_tokenizer=student, teacher_tokenizer=teacher, aligner=TokenAligner(student, teacher),
                                    ctx_length_student=48, ctx_length_teacher=48, output="jagged")
    message = _refused(lambda: build_trainer(tmp_path, dict(parts, collator=jagged)),
                       match=r"data_collator: expected output='padded' .*, got output='jagged'")
    assert "collator.materialize(batch) pads a jagged batch" in message


def test_an_embedding_smaller_than_its_tokenizer_is_refused(parts, tmp_path):
    # before: step 1 failed with a bare IndexError (index out of range in self) inside the embedding lookup
    small_teacher = LlamaForCausalLM(LlamaConfig(vocab_size=280, **TINY))
    message = _refused(lambda: build_trainer(tmp_path, dict(parts, teacher=small_teacher)),
                       match=r"teachers\[0\]: expected an input embedding of at least 300 rows \(len of teacher 0's tokenizer\), "
                             r"got 280 rows")
    assert "resize_token_embeddings(300)" in message
    small_student = Qwen2ForCausalLM(Qwen2Config(vocab_size=290, **TINY))
    _refused(lambda: build_trainer(tmp_path, dict(parts, student=small_student)),
             match=r"model: expected an input embedding of at least 300 rows \(len of the student's tokenizer\), got 290 rows")


def test_vocabulary_sizes_that_contradict_the_tokenizers_are_refused(parts, tmp_path):
    # before: both trained without a word, on a vocabulary that was not the tokenizer's
    message = _refused(lambda: build_trainer(tmp_path, parts, loss_config=_config(parts, student_vocab_size=290)),
                       match=r"loss_config.student_vocab_size: expected len\(collator.student_tokenizer\) = 300, got 290")
    assert "counts the padding as vocabulary" in message
    wide = LlamaForCausalLM(LlamaConfig(vocab_size=312, **TINY))
    _refused(lambda: build_trainer(tmp_path, dict(parts, teacher=wide), loss_config=_config(parts, teacher_vocab_size=312)),
             match=r"loss_config.teachers\[0\].vocab_size: expected len\(collator.teacher_tokenizers\[0\]\) = 300, got 312")


def test_logits_narrower_than_the_vocabulary_are_refused_and_padding_columns_are_allowed(parts, tmp_path):
    narrow = copy.deepcopy(parts["student"])
    narrow.lm_head = torch.nn.Linear(TINY["hidden_size"], 280, bias=False)
    _refused(lambda: build_trainer(tmp_path, dict(parts, student=narrow)),
             match=r"model: expected an output width of at least loss_config.student_vocab_size = 300 .*, got 280 logits")
    torch.manual_seed(0)
    padded = dict(parts, student=Qwen2ForCausalLM(Qwen2Config(vocab_size=320, **TINY)),
                  teacher=LlamaForCausalLM(LlamaConfig(vocab_size=336, **TINY)))  # lm_heads wider than the tokenizers
    trainer = build_trainer(tmp_path, padded)
    trainer.train()
    assert torch.isfinite(torch.tensor(_losses(trainer))).all()


@pytest.mark.parametrize("mode", ["gold", "hkl", "pkl"])
def test_a_projection_built_for_another_teacher_is_refused(parts, projections, tmp_path, mode):
    # before: gold and hkl read it and produced a loss (the sizes agree, only the teacher differs)
    message = _refused(lambda: build_trainer(tmp_path, parts, loss_config=_config(parts, mode, path=projections / "other.pt")),
                       match=r"loss_config.teachers\[0\].projection_path: expected a projection from the collator's student "
                             r"tokenizer to teacher_tokenizers\[0\]")
    assert str(projections / "other.pt") in message and "teacher_fingerprint" in message and "built for another pair" in message
    assert "xtoken-dp projection build" in message


def test_a_projection_built_backwards_is_refused(parts, projections, tmp_path):
    _refused(lambda: build_trainer(tmp_path, parts, loss_config=_config(parts, "gold", path=projections / "reversed.pt")),
             match=r"it was built in the other direction \(from this teacher to this student\)")
    build_trainer(tmp_path, parts, loss_config=_config(parts, "gold", path=projections / "ours.pt"))  # the pair's own passes


def test_a_mode_that_contradicts_the_collator_layout_is_refused(parts, tmp_path):
    # before: a cross-tokenizer teacher in the same-vocabulary mode trained silently on misaligned positions
    _refused(lambda: build_trainer(tmp_path, parts, loss_config=_config(parts, "topk_kl", teacher_vocab_size=300)),
             match=r"loss_config.teachers\[0\].mode: expected a cross-tokenizer mode .*, got 'topk_kl'")
    student = parts["student_tok"]
    same_vocab = CrossTokenizerCollator(student_tokenizer=student, teacher_tokenizers=[student], aligners=[None],
                                        ctx_length_student=48, ctx_length_teachers=[None])
    # before: step 1 failed with KeyError: missing key 'alignment_0_pair_valid'
    _refused(lambda: build_trainer(tmp_path, dict(parts, collator=same_vocab, teacher=copy.deepcopy(parts["student"]))),
             match=r"loss_config.teachers\[0\].mode: expected mode 'topk_kl', got 'alm'")


def test_check_distillation_setup_serves_a_loop_of_your_own(parts, projections):
    from xtoken_dp.trainer import DistillationSetupError, check_distillation_setup
    good = _config(parts, "gold", path=projections / "ours.pt")
    assert check_distillation_setup(good, parts["collator"], parts["student"], [parts["teacher"]]) is None
    with pytest.raises(DistillationSetupError) as refused:
        check_distillation_setup(_config(parts, "gold", path=projections / "other.pt"), parts["collator"])
    assert refused.value.argument == "loss_config.teachers[0].projection_path"
    assert refused.value.__cause__.reversed is False  # the projection module's ProjectionPairError, kept as the cause


# ---- evaluation ----

SHORT_TEXTS = ["naïve café", "def f(x):\n    return x + 1", "42 is the answer", "the quick brown fox"]


def _evaluator(parts, tmp_path, *, eval_batch, **kw):
    return XTokenDistillTrainer(model=copy.deepcopy(parts["student"]), teachers=[parts["teacher"]], data_collator=parts["collator"],
                                args=XTokenDistillTrainingArguments(output_dir=str(tmp_path), loss_config=parts["config"],
                                                                    report_to=[], use_cpu=True, disable_tqdm=True,
                                                                    per_device_eval_batch_size=eval_batch), **kw)


def test_bits_per_byte_equals_a_hand_computation(parts, tmp_path):
    tok, student = parts["student_tok"], parts["student"]
    metrics = _evaluator(parts, tmp_path, eval_batch=3).evaluate(eval_dataset=[{"text": t} for t in SHORT_TEXTS])
    nats = 0.0
    for text in SHORT_TEXTS:
        ids = tok(text, return_tensors="pt").input_ids
        assert tok.convert_ids_to_tokens(ids[0, :1].tolist()) == ["▁"]  # the dummy prefix: the unscored first token covers no byte
        with torch.no_grad():
            log_p = student(input_ids=ids).logits.double().log_softmax(-1)
        nats -= float(log_p[0, :-1].gather(-1, ids[0, 1:, None]).sum())
    total_bytes = sum(len(t.encode("utf-8")) for t in SHORT_TEXTS)
    assert metrics["eval_num_bytes"] == total_bytes
    assert metrics["eval_bits_per_byte"] == pytest.approx(nats / math.log(2) / total_bytes, rel=1e-5)


def test_eval_ce_and_kd_losses_match_xtoken_kd_loss_on_the_same_samples(parts, tmp_path):
    data = parts["data"][:5]
    metrics = _evaluator(parts, tmp_path, eval_batch=2).evaluate(eval_dataset=data)  # batches of 2, 2 and 1
    batch = parts["collator"](data)
    with torch.no_grad():
        logits = parts["student"](input_ids=batch["input_ids"], attention_mask=batch["token_mask"]).logits
        teacher = parts["teacher"](input_ids=batch["teacher_0_input_ids"], attention_mask=batch["teacher_0_token_mask"]).logits
        loss, at_once = xtoken_kd_loss(logits, batch, {0: teacher}, config=parts["config"],
                                       normalizers=compute_global_normalizers(batch, parts["config"]))
    assert metrics["eval_ce_loss"] == pytest.approx(float(at_once["ce_loss"]), rel=1e-5)
    assert metrics["eval_kd_loss_t0"] == pytest.approx(float(at_once["kl_loss_t0"]), rel=1e-5)
    assert metrics["eval_kd_loss"] == pytest.approx(float(at_once["kl_loss"]), rel=1e-5)
    assert metrics["eval_loss"] == pytest.approx(float(loss), rel=1e-5)
    assert metrics["eval_accuracy"] == pytest.approx(float(at_once["accuracy"]), rel=1e-5)
    assert metrics["eval_num_tokens"] == float(at_once["num_valid_tokens"])
    assert metrics["eval_num_chunks_t0"] == float(at_once["num_valid_chunks_t0"])


def test_compute_metrics_receives_per_batch_sums_that_give_the_same_metrics(parts, tmp_path):
    from xtoken_dp.trainer import eval_ratio_names, evaluation_metrics
    received = []
    def compute_metrics(prediction):
        received.append(prediction)
        return {"bpb_again": float(prediction.predictions[:, 1].sum() / prediction.label_ids[:, 1].sum())}
    trainer = _evaluator(parts, tmp_path, eval_batch=3, compute_metrics=compute_metrics)
    metrics = trainer.evaluate(eval_dataset=parts["data"][:7])
    (prediction,) = received
    names = eval_ratio_names(parts["config"])
    assert prediction.predictions.shape == prediction.label_ids.shape == (3, len(names))  # one row per batch, no logits
    again = evaluation_metrics(prediction.predictions.sum(0), prediction.label_ids.sum(0), parts["config"])
    for name, value in again.items():
        assert metrics[f"eval_{name}"] == pytest.approx(value, rel=1e-12), name
    assert metrics["eval_bpb_again"] == pytest.approx(metrics["eval_bits_per_byte"], rel=1e-12)


def test_a_saved_student_reloads_with_both_tokenizers_and_the_loss_config(parts, projections, tmp_path):
    from xtoken_dp.tokenizers import tokenizer_fingerprint
    from xtoken_dp.trainer import check_distillation_setup, load_loss_config, load_pair_tokenizers
    config = _config(parts, "gold", path=projections / "ours.pt")
    trainer = build_trainer(tmp_path / "run", parts, loss_config=config)
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    student_tok, (teacher_tok,) = load_pair_tokenizers(tmp_path / "saved")
    assert [tokenizer_fingerprint(t) for t in (student_tok, teacher_tok)] == \
        [tokenizer_fingerprint(t) for t in (parts["student_tok"], parts["teacher_tok"])]
    assert load_loss_config(tmp_path / "saved") == config
    reloaded = Qwen2ForCausalLM.from_pretrained(tmp_path / "saved")
    collator = CrossTokenizerCollator(student_tokenizer=student_tok, teacher_tokenizer=teacher_tok,
                                      aligner=TokenAligner(student_tok, teacher_tok), ctx_length_student=48, ctx_length_teacher=48)
    assert check_distillation_setup(load_loss_config(tmp_path / "saved"), collator, reloaded, [parts["teacher"]]) is None
    torch.testing.assert_close(_flat_params(reloaded), _flat_params(trainer.model), rtol=0, atol=0)


def test_byte_counts_of_truncated_samples_are_the_bytes_kept(parts):
    from xtoken_dp.trainer import ByteCountingCollator
    student, teacher = parts["student_tok"], parts["teacher_tok"]
    collator = CrossTokenizerCollator(student_tokenizer=student, teacher_tokenizer=teacher, aligner=TokenAligner(student, teacher),
                                      ctx_length_student=24, ctx_length_teacher=24, emit_dropped_bytes=True)
    data = parts["data"][:4]
    batch = ByteCountingCollator(collator)(data)
    kept = [len(d["text"].encode("utf-8")) - int(dropped) for d, dropped in zip(data, batch["dropped_bytes"])]
    assert int(batch["dropped_bytes"].min()) > 0  # every sample was cut
    assert batch["student_token_bytes"].sum(1).tolist() == kept


def _evaluate_on_rank(rank, world_size, port, out_dir):
    "One spawned rank of the data-parallel evaluation test: torchrun's environment, then `evaluate()` on 8 samples."
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    parts = _parts()
    metrics = build_trainer(f"{out_dir}/run{rank}", parts, per_device_eval_batch_size=2).evaluate(eval_dataset=parts["data"][:8])
    with open(f"{out_dir}/rank{rank}.json", "w") as f: json.dump(metrics, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_two_gloo_processes_evaluate_as_one(parts, tmp_path):
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as free:  # a port nobody listens on, for the ranks' rendezvous
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    single = build_trainer(tmp_path / "single", parts, per_device_eval_batch_size=2).evaluate(eval_dataset=parts["data"][:8])
    mp.start_processes(_evaluate_on_rank, args=(2, port, str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        metrics = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name in ("eval_loss", "eval_ce_loss", "eval_kd_loss_t0", "eval_bits_per_byte", "eval_num_tokens", "eval_num_bytes"):
            assert metrics[name] == pytest.approx(single[name], rel=1e-6), (rank, name)


def test_precomputed_records_of_another_vocabulary_are_refused_when_the_trainer_is_built(parts, tmp_path):
    right = precompute_teacher_logits({0: parts["teacher"]}, parts["data"], parts["collator"], topk=8,
                                      vocab_sizes={0: len(parts["teacher_tok"])}, batch_size=3)
    smaller = dataclasses.replace(right.records[0], vocab_size=len(parts["teacher_tok"]) - 7)  # a record of a smaller vocabulary
    wrong = PrecomputedTeacherLogits({0: smaller}, list(right.rows), right.teacher_layout)
    with pytest.raises(DistillationSetupError, match=r"teacher_logits.records\[0\].vocab_size: expected \d+ \(loss_config"):
        build_trainer(tmp_path / "wrong", parts, max_steps=1, teachers=wrong)
    stray = PrecomputedTeacherLogits({**wrong.records, 3: wrong.records[0]}, list(wrong.rows), wrong.teacher_layout)
    with pytest.raises(DistillationSetupError, match=r"teacher_logits.records: expected teacher indices in 0..0, got \[3\]"):
        build_trainer(tmp_path / "stray", parts, max_steps=1, teachers=stray)

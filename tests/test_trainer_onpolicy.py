"""XTokenDistillTrainer's on-policy knobs (TRL's lmbda, seq_kd, beta, temperature, max_new_tokens) on CPU.

Tiny randomly initialised HF models and the toy tokenizers of tests/test_trainer.py (trained locally, cached). Steps of
samples are short (6 new tokens) so the whole file runs in well under a minute.
"""
import copy
import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import xtoken_dp.trainer as trainer_module
from xtoken_dp.aligner import TokenAligner
from xtoken_dp.collate import CrossTokenizerCollator
from xtoken_dp.losses import TeacherLossSpec, XTokenLossConfig
from xtoken_dp.onpolicy.generate import completions_from_ids, generate_completions
from xtoken_dp.tokenizers import toy_corpus, train_toy_tokenizer
from xtoken_dp.trainer import (DistillationSetupError, XTokenDistillTrainer, XTokenDistillTrainingArguments, precompute_teacher_logits,
                               sampling_seed, step_kind, teacher_sample_batch)

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            max_position_embeddings=128)


def _pair(student_kind, teacher_kind):
    student_tok, teacher_tok = (train_toy_tokenizer(k, vocab_size=300) for k in (student_kind, teacher_kind))
    collator = CrossTokenizerCollator(student_tokenizer=student_tok, teacher_tokenizer=teacher_tok,
                                      aligner=TokenAligner(student_tok, teacher_tok), ctx_length_student=48, ctx_length_teacher=48)
    config = XTokenLossConfig(student_vocab_size=len(student_tok), teachers=[TeacherLossSpec("alm", vocab_size=len(teacher_tok))])
    torch.manual_seed(1)
    teacher = LlamaForCausalLM(LlamaConfig(vocab_size=len(teacher_tok), **TINY))
    torch.manual_seed(0)
    student = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(student_tok), **TINY))
    data = [{"text": text[:100], "prompt": text[:30], "idx": k} for k, text in enumerate(toy_corpus(max_bytes=20_000)[:8])]
    return dict(student_tok=student_tok, teacher_tok=teacher_tok, collator=collator, config=config, teacher=teacher,
                student=student, data=data)


@pytest.fixture(scope="module")
def parts():
    return _pair("unigram_metaspace", "bpe_bytelevel")


def build(tmp_path, parts, *, teachers=None, collator=None, data=None, teacher_logits=None, **overrides):
    kw = dict(output_dir=str(tmp_path), loss_config=parts["config"], report_to=[], use_cpu=True, dataloader_num_workers=0,
              disable_tqdm=True, logging_steps=1, save_strategy="no", max_steps=2, per_device_train_batch_size=2, optim="sgd",
              learning_rate=0.5, max_new_tokens=6, seed=7)
    kw.update(overrides)
    return XTokenDistillTrainer(model=copy.deepcopy(parts["student"]), args=XTokenDistillTrainingArguments(**kw),
                                teachers=[parts["teacher"]] if teachers is None else teachers, teacher_logits=teacher_logits,
                                data_collator=collator or parts["collator"], train_dataset=parts["data"] if data is None else data)


def _flat(model): return torch.cat([p.detach().flatten() for p in model.parameters()])


def _recording(trainer):
    "Keep every step's prompt batches and the microbatches the trainer builds from them."
    built, step = [], trainer.on_policy.step
    def recorded(model, lazy, *a, **kw):
        out = step(model, lazy, *a, **kw)
        built.append((lazy, out))
        return out
    trainer.on_policy.step = recorded
    return built


def test_lmbda_1_trains_on_the_students_samples(parts, tmp_path):
    trainer = build(tmp_path, parts, lmbda=1.0, max_steps=3)
    first_student = copy.deepcopy(trainer.model)
    built = _recording(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    assert len(logs) == 3 and all(torch.isfinite(torch.tensor(h["loss"])) and h["on_policy"] == 1.0 for h in logs)
    assert all(h["num_valid_tokens"] > 0 and h["num_valid_chunks_t0"] > 0 and h["generation_seconds"] > 0 for h in logs)
    assert (_flat(trainer.model) - _flat(parts["student"])).abs().max() > 1e-4
    # step 0's batch holds exactly what the untrained student samples from the first two prompts with the step's seed
    lazy, batches = built[0]
    sampled = generate_completions(first_student.eval(), parts["student_tok"], lazy[0]["prompts"], max_new_tokens=6,
                                   seed=sampling_seed(7, 0, 0, 0))
    batch = batches[0]
    for b, c in enumerate(sampled):
        completion = batch["input_ids"][b][batch["token_mask"][b]]
        assert completion.tolist() == c.completion_ids.tolist() and 1 <= len(c.completion_ids) <= 6
        assert batch["attention_mask"][b, :len(c.ids)].all() and batch["input_ids"][b, :len(c.ids)].tolist() == c.ids.tolist()


def test_lmbda_0_is_the_off_policy_trainer(parts, tmp_path):
    plain = build(tmp_path / "plain", parts, max_steps=2)
    zero = build(tmp_path / "zero", parts, max_steps=2, lmbda=0.0, seq_kd=False, temperature=0.5, max_new_tokens=3)
    assert plain.on_policy is None and zero.on_policy is None
    plain.train(); zero.train()
    assert torch.equal(_flat(plain.model), _flat(zero.model))
    assert [h.get("loss") for h in plain.state.log_history[:2]] == [h.get("loss") for h in zero.state.log_history[:2]]
    assert "on_policy" not in zero.state.log_history[0]
    texts_only = build(tmp_path / "texts", parts, data=[{"text": d["text"]} for d in parts["data"]])  # no prompts needed
    assert texts_only.on_policy is None


def test_lmbda_one_half_picks_the_same_steps_on_two_runs(parts, tmp_path):
    kinds = [step_kind(s, 0.5, False, 7) for s in range(200)]
    assert kinds == [step_kind(s, 0.5, False, 7) for s in range(200)] and 70 < kinds.count("on_policy") < 130
    assert [step_kind(s, 0.5, False, 8) for s in range(200)] != kinds   # another seed, other steps
    runs = []
    for run in range(2):
        trainer = build(tmp_path / str(run), parts, lmbda=0.5, max_steps=4, per_device_train_batch_size=1)
        trainer.train()
        logs = [h for h in trainer.state.log_history if "on_policy" in h]
        runs.append(([h["on_policy"] for h in logs], [h["loss"] for h in logs], _flat(trainer.model)))
    assert runs[0][0] == [float(k == "on_policy") for k in kinds[:4]] and 0 < sum(runs[0][0]) < 4
    assert runs[0][:2] == runs[1][:2] and torch.equal(runs[0][2], runs[1][2])


def test_seq_kd_with_a_same_vocabulary_teacher_trains_on_its_samples(parts, tmp_path):
    tok = parts["student_tok"]
    collator = CrossTokenizerCollator(student_tokenizer=tok, teacher_tokenizers=[tok], aligners=[None], ctx_length_student=48,
                                      ctx_length_teachers=[None])
    config = XTokenLossConfig(student_vocab_size=len(tok), teachers=[TeacherLossSpec("topk_kl", vocab_size=len(tok))])
    torch.manual_seed(3)
    teacher = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), **TINY))
    trainer = build(tmp_path, parts, teachers=[teacher], collator=collator, loss_config=config, seq_kd=True, max_steps=1)
    built = _recording(trainer)
    trainer.train()
    lazy, batches = built[0]
    sampled = generate_completions(teacher, tok, lazy[0]["prompts"], max_new_tokens=6, seed=sampling_seed(7, 0, 0, 0))
    batch = batches[0]
    assert [batch["input_ids"][b][batch["token_mask"][b]].tolist() for b in range(2)] == [c.completion_ids.tolist() for c in sampled]
    log = trainer.state.log_history[0]
    assert log["seq_kd"] == 1.0 and log["on_policy"] == 0.0 and log["num_valid_tokens"] > 0


def test_seq_kd_with_a_cross_tokenizer_teacher_trains_the_student_on_its_text(tmp_path):
    parts = _pair("bpe_bytelevel", "unigram_metaspace")   # the teacher's pieces are whole characters: its samples decode
    trainer = build(tmp_path, parts, seq_kd=True, max_steps=2)
    built = _recording(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "seq_kd" in h]
    assert [h["seq_kd"] for h in logs] == [1.0, 1.0] and all(h["num_valid_chunks_t0"] > 0 for h in logs)
    lazy, batches = built[0]
    batch = batches[0]
    teacher_side = generate_completions(parts["teacher"], parts["teacher_tok"], lazy[0]["prompts"],
                                        max_new_tokens=6, seed=sampling_seed(7, 0, 0, 0))
    for b, c in enumerate(teacher_side):   # teacher 0's keys hold its ids as sampled, the student's its tokenisation of the text
        assert batch["teacher_0_input_ids"][b][batch["teacher_0_token_mask"][b]].tolist() == c.completion_ids.tolist()
        student_ids = batch["input_ids"][b][batch["attention_mask"][b]].tolist()
        assert parts["student_tok"].decode(student_ids) == c.prompt + c.text


def test_a_cross_teachers_text_is_split_at_the_prompt_on_the_students_side(parts):
    s, t = parts["student_tok"], parts["teacher_tok"]
    rows = completions_from_ids(t, ["The answer is", "Hello"], [t.encode(" forty two", add_special_tokens=False),
                                                                 t.encode(" world", add_special_tokens=False)])
    batch = teacher_sample_batch(rows, parts["collator"], TokenAligner(t, s))
    for b, row in enumerate(rows):
        n = int(batch["input_lengths"][b])
        ids, mask = batch["input_ids"][b, :n].tolist(), batch["token_mask"][b, :n]
        assert ids == s(row.prompt + row.text)["input_ids"][:n]   # the student's own tokenisation of prompt + completion
        assert s.decode([i for i, m in zip(ids, mask) if m]).strip() == row.text.strip() and not mask[0]
    assert (batch["alignment_0_num_chunks"] > 0).all()


def test_temperature_and_max_new_tokens_reach_generation(parts, tmp_path, monkeypatch):
    seen = []
    def spy(*args, **kw):
        seen.append(kw)
        return generate_completions(*args, **kw)
    monkeypatch.setattr(trainer_module, "generate_completions", spy)
    build(tmp_path, parts, lmbda=1.0, max_steps=1, temperature=0.25, max_new_tokens=3).train()
    assert seen and all(kw["temperature"] == 0.25 and kw["max_new_tokens"] == 3 for kw in seen)


def test_beta_is_forwarded_to_the_loss_config(parts, tmp_path):
    config = XTokenLossConfig(student_vocab_size=len(parts["student_tok"]),
                              teachers=[TeacherLossSpec("topk_kl", vocab_size=len(parts["student_tok"]))])
    args = XTokenDistillTrainingArguments(output_dir=str(tmp_path), loss_config=config, report_to=[], use_cpu=True, beta=0.5)
    assert args.loss_config.beta == 0.5 and args.loss_config == dataclasses.replace(config, beta=0.5)
    kept = XTokenDistillTrainingArguments(output_dir=str(tmp_path), loss_config=dataclasses.replace(config, beta=1.0),
                                          report_to=[], use_cpu=True)
    assert kept.loss_config.beta == 1.0   # beta=None keeps the config's


@pytest.mark.parametrize("kw, match", [
    (dict(lmbda=1.5), "lmbda: expected a number in [0, 1], got 1.5"), (dict(lmbda=-0.1), "lmbda"),
    (dict(seq_kd="yes"), "seq_kd: expected a bool"), (dict(beta=2.0), "beta: expected None or a number in [0, 1]"),
    (dict(temperature=0.0), "temperature: expected a number > 0"), (dict(max_new_tokens=0), "max_new_tokens: expected an int >= 1"),
    (dict(max_new_tokens=2.5), "max_new_tokens")])
def test_bad_arguments_are_refused(parts, tmp_path, kw, match):
    with pytest.raises((ValueError, TypeError), match=match.replace("[", r"\[").replace("]", r"\]")):
        XTokenDistillTrainingArguments(output_dir=str(tmp_path), loss_config=parts["config"], report_to=[], use_cpu=True, **kw)


def test_runs_that_cannot_sample_are_refused_when_built(parts, tmp_path):
    with pytest.raises(DistillationSetupError, match="train_dataset: expected datums with a 'prompt'"):
        build(tmp_path, parts, lmbda=0.5, data=[{"text": d["text"]} for d in parts["data"]])
    with pytest.raises(DistillationSetupError, match="train_dataset: expected datums the data collator can build"):
        build(tmp_path, parts, lmbda=0.5, data=[{"prompt": d["prompt"]} for d in parts["data"]])
    build(tmp_path, parts, lmbda=1.0, data=[{"prompt": d["prompt"]} for d in parts["data"]])   # prompts alone: every step samples
    records = precompute_teacher_logits({0: parts["teacher"]}, parts["data"], parts["collator"], topk=8,
                                        vocab_sizes={0: len(parts["teacher_tok"])})
    with pytest.raises(DistillationSetupError, match="teacher_logits: expected a live model for every teacher"):
        build(tmp_path, parts, lmbda=1.0, teachers=[None], teacher_logits=records)
    other = train_toy_tokenizer("bpe_bytelevel_digits", vocab_size=300)
    two = CrossTokenizerCollator(student_tokenizer=parts["student_tok"], teacher_tokenizers=[parts["teacher_tok"], other],
                                 aligners=[TokenAligner(parts["student_tok"], parts["teacher_tok"]), TokenAligner(parts["student_tok"], other)],
                                 ctx_length_student=48, ctx_length_teachers=[48, 48])
    config = XTokenLossConfig(student_vocab_size=len(parts["student_tok"]),
                              teachers=[TeacherLossSpec("alm", vocab_size=len(parts["teacher_tok"])), TeacherLossSpec("uld", vocab_size=len(other))])
    torch.manual_seed(2)
    second = LlamaForCausalLM(LlamaConfig(vocab_size=len(other), **TINY))
    with pytest.raises(DistillationSetupError, match="seq_kd: expected one teacher"):
        build(tmp_path, parts, teachers=[parts["teacher"], second], collator=two, loss_config=config, seq_kd=True)
    two_teachers = build(tmp_path, parts, teachers=[parts["teacher"], second], collator=two, loss_config=config, lmbda=1.0, max_steps=1,
                         data=[{"prompt": d["prompt"], "messages": None} for d in parts["data"]])
    two_teachers.train()   # on-policy with two cross-tokenizer teachers (ALM and ULD): both losses see the samples
    log = two_teachers.state.log_history[0]
    assert log["num_valid_chunks_t0"] > 0 and log["num_valid_chunks_t1"] > 0 and log["on_policy"] == 1.0


def test_chat_prompts_from_messages(parts):
    from xtoken_dp.trainer import prompt_of, PromptCollator
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert prompt_of({"messages": convo}) == convo[:1] and prompt_of({"prompt": convo[:1]}) == convo[:1]
    assert prompt_of({"prompt": "Once"}) == "Once" and prompt_of({"text": "x"}) is None and prompt_of({"messages": convo[1:]}) is None
    with pytest.raises(ValueError, match="train_dataset: expected a 'prompt'"):
        PromptCollator()([{"prompt": "a"}, {"text": "b"}])

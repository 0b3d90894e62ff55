"""On-policy generation and the byte-exact prompt/completion boundary (`xtoken_dp.onpolicy.generate`).

Boundary tests build completions from ids spelled piece by piece (greedy longest match over the student's piece
bytes, or one byte per token), as a sampler could emit them, so a completion may start mid-word, mid-number, inside a
ZWJ sequence or with a lone byte of a character, and need not be how the student would tokenise its text. Pairs:
byte-level BPE (qwen2, tekken), SentencePiece (mistral_spm) and a Unigram trained here.
"""
import functools

import numpy as np
import pytest
import torch

from xtoken_dp.aligner import TokenAligner, shift_chunk_ids
from xtoken_dp.distill import GPTConfig, TinyGPT
from xtoken_dp.losses import chunk_buckets, valid_chunk_mask
from xtoken_dp.onpolicy.generate import (HFSampler, Sampler, SamplingParams, TorchSampler, align_completions,
                                         chat_prompt_spans, collate_completions, completions_from_ids,
                                         generate_completions)
from xtoken_dp.schema import AlignmentBatch
from xtoken_dp.tokenizers import load_tokenizer, piece_bytes_table, train_toy_tokenizer


@functools.cache
def tok(name):
    if name == "unigram": return train_toy_tokenizer("unigram_metaspace", vocab_size=700)
    return load_tokenizer(name)


@functools.cache
def _pieces(name):
    "Content piece bytes -> id (the shortest id wins ties), and the longest piece."
    t = tok(name)
    table, specials = piece_bytes_table(t), set(t.all_special_ids)
    out = {}
    for i in range(len(table)):
        p = table[i]
        if p and i not in specials and p not in out: out[p] = i
    return out, max(map(len, out))


def spell(name, data: bytes, *, one_byte=False):
    "Ids whose pieces concatenate to `data`: one byte per token (`one_byte`, where the vocabulary has it), else the fewest tokens."
    pieces, longest = _pieces(name)
    best = [(0, [])] + [None] * len(data)   # best[i]: the shortest spelling of data[:i]
    for i in range(len(data)):
        if best[i] is None: continue
        for n in range(1, min(longest, len(data) - i) + 1):
            piece = data[i:i + n]
            if piece not in pieces: continue
            cost = best[i][0] + (0 if one_byte and n == 1 else 1 if not one_byte else 1000)
            if best[i + n] is None or cost < best[i + n][0]: best[i + n] = (cost, best[i][1] + [pieces[piece]])
    if best[-1] is None: raise AssertionError(f"{name} cannot spell {data!r}")
    return best[-1][1]


PAIRS = [("qwen2", "mistral_spm"), ("mistral_spm", "unigram"), ("unigram", "qwen2"), ("mistral_spm", "mistral_tekken")]
CASES = {  # start class: (prompt, completion, one byte per token)
    "mid_word": ("The quick bro", "wn fox runs", False),
    "mid_number": ("Pi is 3.14", "159 and e is 2.718", False),
    "mid_zwj_sequence": ("Family: 👨\u200d", "👩\u200d👧 at home", False),
    "mid_emoji_modifier": ("Thumbs 👍", "🏽 up", False),
    "lone_bytes_of_a_character": ("Thumbs ", "👍🏽 up", True),
    "after_space": ("Hello ", "world and more", False),
    "after_newline": ("Line one\n", "Line two", False),
}


def _row(student, teacher, case, finished=True):
    prompt, completion, one_byte = CASES[case]
    s = tok(student)
    ids = spell(student, completion.encode(), one_byte=one_byte) + ([s.eos_token_id] if finished else [])
    c = completions_from_ids(s, [prompt], [ids])[0]
    return c, align_completions([c], TokenAligner(s, tok(teacher)))[0]


def _check_spans(c, student):
    "The student's spans are byte-exact: content tokens tile prompt + completion and each spells its bytes."
    full = c.prompt.encode() + c.completion_bytes
    sp = c.spans.validate()
    content = np.flatnonzero((sp.role == 0) & (sp.end > sp.start))
    assert sp.nbytes == len(full)
    assert b"".join(full[s:e] for s, e in zip(sp.start[content], sp.end[content])) == full
    table = piece_bytes_table(tok(student))
    for k in content[content >= len(c.prompt_ids)]:   # sampled tokens: their pieces, never re-tokenised
        assert table[int(sp.ids[k])].endswith(full[sp.start[k]:sp.end[k]])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("student,teacher", PAIRS, ids=lambda p: p if isinstance(p, str) else None)
def test_boundary_rule(student, teacher, case):
    c, row = _row(student, teacher, case)
    prompt, completion, _ = CASES[case]
    P, s = len(prompt.encode()), row.sample
    assert c.completion_bytes == completion.encode() and c.finished
    assert row.kept_nbytes == row.nbytes == P + len(completion.encode())
    _check_spans(c, student)
    # no loss chunk holds a prompt byte or a prompt token, on either side
    keep = row.loss_chunk
    assert (s.chunk_start[keep] >= P).all()
    assert not keep[s.student_chunk_id[row.student_prompt]].any()
    assert not keep[s.teacher_chunk_id[row.teacher_prompt]].any()
    for spans, chunk in ((s.student, s.student_chunk_id), (s.teacher, s.teacher_chunk_id)):
        assert (spans.start[np.isin(chunk, np.flatnonzero(keep))] >= P).all()
    # the rule: a teacher token across P <=> one excluded chunk holds P; otherwise the completion starts a chunk
    crosses = bool(((s.teacher.role == 0) & (s.teacher.start < P) & (s.teacher.end > P)).any())
    holding = np.flatnonzero((s.chunk_start < P) & (s.chunk_end > P))
    assert crosses == (len(holding) == 1)
    if crosses: assert not keep[holding[0]]
    else: assert P in s.chunk_start[keep]
    # every completion byte after the excluded chunk is in a loss chunk, exactly once
    first = int(s.chunk_end[holding[0]]) if crosses else P
    covered = np.zeros(row.nbytes, int)
    for a, z in zip(s.chunk_start[keep], s.chunk_end[keep]): covered[a:z] += 1
    assert (covered[first:] == 1).all() and (covered[:first] == 0).all()
    # the EOS sampled by the student pairs with the teacher's EOS, inside the loss
    assert s.student_chunk_id[-1] == s.teacher_chunk_id[-1] and keep[s.student_chunk_id[-1]]


@pytest.mark.parametrize("student,teacher", PAIRS, ids=lambda p: p if isinstance(p, str) else None)
def test_flat_batch_feeds_only_completion_chunks(student, teacher):
    s, t = tok(student), tok(teacher)
    names = list(CASES)
    rows = [completions_from_ids(s, [CASES[n][0]], [spell(student, CASES[n][1].encode(), one_byte=CASES[n][2])])[0]
            for n in names]
    aligned = align_completions(rows, TokenAligner(s, t))
    batch = collate_completions(rows, TokenAligner(s, t), make_seq_div_by_student=8)
    assert batch["input_ids"].shape[1] % 8 == 0
    alignment = AlignmentBatch.from_flat(batch, prefix="alignment_0_").validate()
    for b, (c, r) in enumerate(zip(rows, aligned)):
        n_p, n = len(c.prompt_ids), len(c.ids)
        assert batch["input_ids"][b, :n].tolist() == c.ids.tolist()          # the sampled ids, as sampled
        assert batch["token_mask"][b].tolist() == [False] * n_p + [True] * (n - n_p) + [False] * (batch["token_mask"].shape[1] - n)
        assert (alignment.student_chunk_id[b, :n_p] == -1).all()             # prompt tokens never feed a chunk
        assert int(alignment.num_chunks[b]) == int(r.loss_chunk.sum())
    # the losses' own gate: both shifted sizes > 0 and the slot exists; it never reaches past the loss chunks
    C = alignment.pair_valid.shape[1]
    s_sizes = chunk_buckets(shift_chunk_ids(alignment.student_chunk_id), C)[1]
    t_sizes = chunk_buckets(shift_chunk_ids(alignment.teacher_chunk_id), C)[1]
    valid = valid_chunk_mask(s_sizes, t_sizes, alignment.pair_valid)
    assert (valid.sum(1) <= alignment.num_chunks).all() and valid.sum() > 0


def test_a_completion_ending_inside_a_character_is_cut_for_the_teacher():
    s = tok("qwen2")
    data = "ok 👍".encode()[:-1]                       # max_new_tokens stopped inside the emoji
    c = completions_from_ids(s, ["Say "], [spell("qwen2", data, one_byte=True)])[0]
    assert c.completion_bytes == data and not c.finished
    row = align_completions([c], TokenAligner(s, tok("mistral_spm")))[0]
    assert row.nbytes == 4 + len(data) and row.kept_nbytes == 4 + 3   # the teacher sees "Say ok "
    assert tok("mistral_spm").decode(row.teacher_ids, skip_special_tokens=True) == "Say ok "
    s_chunk, _ = row.chunk_ids()
    assert (s_chunk[-3:] == -1).all()                 # the three lone bytes of the emoji feed no chunk
    batch = collate_completions([c], TokenAligner(s, tok("mistral_spm")))
    assert batch["token_mask"][0, -3:].all()          # but they stay sampled tokens (cross-entropy targets)
    bad = completions_from_ids(s, ["x "], [spell("qwen2", b"a\xffb c", one_byte=True)])[0]
    assert align_completions([bad], TokenAligner(s, tok("mistral_spm")))[0].kept_nbytes == 3   # up to "a"


def test_a_sampled_sequence_that_would_retokenise_differently_stays_as_sampled():
    s = tok("qwen2")
    ids = spell("qwen2", b" hello world", one_byte=True)   # 12 one-byte tokens; the tokenizer would use 2
    c = completions_from_ids(s, ["Say"], [ids])[0]
    assert c.completion_ids.tolist() == ids and len(s.encode(" hello world")) == 2
    batch = collate_completions([c], TokenAligner(s, tok("mistral_spm")))
    assert batch["input_ids"][0, 1:].tolist() == ids


# ---------------------------------------------------------------- generation

def _hf_model(t, seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=len(t), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).double().eval()


PROMPTS = ["The answer is", "Hello wor", "x", "A longer prompt than the others, with 12 numbers"]


@pytest.mark.parametrize("name", ["mistral_spm", "qwen2"])
def test_hf_left_padding_gives_each_row_its_own_greedy_completion(name):
    t = tok(name)
    model, pad_before = _hf_model(t), t.pad_token
    together = generate_completions(model, t, PROMPTS, max_new_tokens=6, seed=0, do_sample=False)
    alone = [generate_completions(model, t, [p], max_new_tokens=6, seed=0, do_sample=False)[0] for p in PROMPTS]
    assert [c.completion_ids.tolist() for c in together] == [c.completion_ids.tolist() for c in alone]
    assert t.pad_token == pad_before                  # mistral_spm has no pad token and keeps none
    assert all(len(c.completion_ids) == 6 for c in together)


def test_hf_sampling_repeats_with_its_seed_and_leaves_the_global_rng_alone():
    t = tok("mistral_spm")
    model = _hf_model(t)
    state = torch.get_rng_state()
    a = generate_completions(model, t, PROMPTS, max_new_tokens=6, seed=3, temperature=0.8, top_k=50)
    assert torch.equal(state, torch.get_rng_state())
    b = generate_completions(model, t, PROMPTS, max_new_tokens=6, seed=3, temperature=0.8, top_k=50)
    c = generate_completions(model, t, PROMPTS, max_new_tokens=6, seed=4, temperature=0.8, top_k=50)
    ids = lambda rows: [r.completion_ids.tolist() for r in rows]
    assert ids(a) == ids(b) and ids(a) != ids(c)


def test_hf_stops_each_row_at_its_eos():
    t = tok("mistral_spm")
    model = _hf_model(t)
    greedy = generate_completions(model, t, PROMPTS, max_new_tokens=6, seed=0, do_sample=False)
    stop = int(greedy[0].completion_ids[2])           # row 0's third token plays EOS
    rows = generate_completions(model, t, PROMPTS, max_new_tokens=6, seed=0, do_sample=False, eos_token_ids=[stop])
    for g, r in zip(greedy, rows):
        hits = np.flatnonzero(g.completion_ids == stop)
        expected = g.completion_ids[:hits[0] + 1] if len(hits) else g.completion_ids
        assert r.completion_ids.tolist() == expected.tolist() and r.finished == bool(len(hits))
    assert rows[0].finished and len(rows[0].completion_ids) <= 3


def test_tinygpt_batches_rows_as_if_alone_and_repeats_with_its_seed():
    t = tok("mistral_spm")
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(len(t), ctx_len=32, n_layer=1, d_model=32, n_head=4))
    together = generate_completions(model, t, PROMPTS, max_new_tokens=5, seed=0, do_sample=False)
    alone = [generate_completions(model, t, [p], max_new_tokens=5, seed=0, do_sample=False)[0] for p in PROMPTS]
    assert [c.completion_ids.tolist() for c in together] == [c.completion_ids.tolist() for c in alone]
    a, b = (generate_completions(model, t, PROMPTS, max_new_tokens=5, seed=9) for _ in range(2))
    assert [c.completion_ids.tolist() for c in a] == [c.completion_ids.tolist() for c in b]
    with pytest.raises(ValueError, match="must fit the model's context of 32"):
        generate_completions(model, t, PROMPTS, max_new_tokens=30, seed=0)


def test_any_sampler_plugs_in_and_its_rows_are_checked():
    t = tok("qwen2")
    calls = []
    def engine(prompt_ids, params):
        calls.append((prompt_ids, params))
        return [[40, 41, t.eos_token_id, 42] for _ in prompt_ids]
    assert isinstance(engine, Sampler)
    rows = generate_completions(None, t, ["Hi", "Yo"], max_new_tokens=4, seed=1, sampler=engine)
    assert [r.completion_ids.tolist() for r in rows] == [[40, 41, t.eos_token_id]] * 2 and rows[0].finished
    assert calls[0][0] == [t.encode("Hi"), t.encode("Yo")] and calls[0][1].pad_token_id == t.pad_token_id
    with pytest.raises(ValueError, match="expected 2 rows"):
        generate_completions(None, t, ["Hi", "Yo"], max_new_tokens=4, seed=1, sampler=lambda p, s: [[1]])
    assert isinstance(TorchSampler(torch.nn.Linear(2, 2), ctx_len=4), Sampler) and isinstance(HFSampler(None), Sampler)
    assert SamplingParams(max_new_tokens=1).top_k is None


# ---------------------------------------------------------------- chat mode

CONVERSATIONS = [[{"role": "user", "content": "What is 6 times 7?"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Wave at me 👋"}]]


@pytest.mark.parametrize("student,teacher", [(("qwen2", "chatml"), ("mistral_spm", "mistral_inst")),
                                             (("mistral_spm", "mistral_inst"), ("qwen2", "chatml"))], ids=["chatml-inst", "inst-chatml"])
def test_chat_mode_aligns_only_the_completion_and_pairs_the_closing_specials(student, teacher):
    s, t = load_tokenizer(student[0], chat_template=student[1]), load_tokenizer(teacher[0], chat_template=teacher[1])
    closing = s.convert_tokens_to_ids("<|im_end|>") if student[1] == "chatml" else s.eos_token_id
    answers = ["It is 42.", "👋 Hi!"]
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(len(s), ctx_len=64, n_layer=1, d_model=16, n_head=2))
    sampled = generate_completions(model, s, CONVERSATIONS, max_new_tokens=3, seed=0)
    for c, conv in zip(sampled, CONVERSATIONS):   # the prompt is the student's own rendering
        rendering = s.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert c.prompt_ids.tolist() == s(rendering, add_special_tokens=False)["input_ids"] and c.messages == conv
    texts, spans = chat_prompt_spans(s, CONVERSATIONS)
    rows = completions_from_ids(s, texts, [s.encode(a, add_special_tokens=False) + [closing] for a in answers],
                                spans=spans, messages=CONVERSATIONS)
    lead = " " if student[0] == "mistral_spm" else ""   # SentencePiece's "▁It": a word-initial piece
    assert [r.completion_bytes for r in rows] == [(lead + a).encode() for a in answers]
    aligned = align_completions(rows, TokenAligner(s, t))
    batch = collate_completions(rows, TokenAligner(s, t))
    alignment = AlignmentBatch.from_flat(batch, prefix="alignment_0_").validate()
    for b, (c, r, conv) in enumerate(zip(rows, aligned, CONVERSATIONS)):
        t_rendering = t(t.apply_chat_template(conv, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        assert r.teacher_ids[:r.teacher_offset].tolist() == t_rendering          # the teacher's own rendering
        s_chunk, t_chunk = r.chunk_ids()
        assert (s_chunk[:len(c.prompt_ids)] == -1).all() and (t_chunk[:r.teacher_offset] == -1).all()
        assert r.loss_chunk.all() and (s_chunk[len(c.prompt_ids):] >= 0).all() and (t_chunk[r.teacher_offset:] >= 0).all()
        assert s_chunk[-1] == t_chunk[-1] and r.sample.chunk_kind[-1] == 3    # the closing specials pair
        content = r.sample.teacher.role == 0                                  # the teacher spells the completion's bytes
        tail = c.completion_bytes
        assert b"".join(tail[a:z] for a, z in zip(r.sample.teacher.start[content], r.sample.teacher.end[content])) == tail
        assert batch["teacher_0_token_mask"][b].sum() == len(r.teacher_ids) - r.teacher_offset
        assert int(alignment.num_chunks[b]) == r.sample.num_chunks


def test_prompts_are_all_text_or_all_conversations():
    s = load_tokenizer("qwen2", chat_template="chatml")
    with pytest.raises(TypeError, match="a mix"):
        generate_completions(None, s, ["Hi", CONVERSATIONS[0]], max_new_tokens=2, seed=0, sampler=lambda p, q: [[1]] * 2)
    with pytest.raises(ValueError, match=r"prompts\[0\]\[0\]: expected a dict with str 'role' and 'content'"):
        generate_completions(None, s, [[{"role": "user"}]], max_new_tokens=2, seed=0, sampler=lambda p, q: [[1]])


def test_the_losses_train_only_where_the_next_token_was_sampled():
    from xtoken_dp.losses import TeacherLossSpec, XTokenLossConfig, compute_global_normalizers, xtoken_kd_loss
    s, t = tok("mistral_spm"), tok("qwen2")
    wer = s.convert_tokens_to_ids("wer")
    rows = completions_from_ids(s, ["The ans", "Hello"], [[wer, s.convert_tokens_to_ids("▁now"), s.eos_token_id],
                                                          s.encode("world", add_special_tokens=False)])
    batch = collate_completions(rows, TokenAligner(s, t))
    config = XTokenLossConfig(student_vocab_size=len(s), teachers=(TeacherLossSpec("uld", vocab_size=len(t)),),
                              block_size=None, uld_topk=64)
    normalizers = compute_global_normalizers(batch, config)
    assert normalizers.n_tok == 4 and normalizers.n_chunks[0] == 3   # 4 sampled tokens; " now" + EOS pair + " world"
    torch.manual_seed(0)
    student_logits = torch.randn(2, batch["input_ids"].shape[1], len(s), requires_grad=True)
    loss, _ = xtoken_kd_loss(student_logits, batch, {0: torch.randn(2, batch["teacher_0_input_ids"].shape[1], len(t))},
                             config=config, normalizers=normalizers)
    loss.backward()
    trained = student_logits.grad.abs().sum(-1) > 0
    assert trained.tolist() == [[False, False, True, True, True, False], [False, True, False, False, False, False]]

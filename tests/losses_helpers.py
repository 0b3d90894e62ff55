"""Shared by the loss tests: seeded fixtures, references computed by plain Python loops (float64), and the workers
that spawned gloo processes run (a spawned child imports this module by name, so it lives next to the tests).

The references never call the code under test: they shift chunk ids, collect chunk positions, take softmaxes, pick
top-k ids and sum divergences with lists and `math`, one chunk at a time.
"""
import dataclasses
import math
import os
import socket
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from xtoken_dp import losses as L
from xtoken_dp.schema import AlignmentBatch

V_S, W_S, V_T, W_T = 11, 13, 7, 9  # student / teacher vocabulary sizes and logit widths (lm_head padding 2)
TINY = 1e-30

# ----------------------------------------------------------------------------------------------------- fixtures


def _randint(g, lo, hi): return int(torch.randint(lo, hi + 1, (1,), generator=g))


def _sample_chunking(g, n_chunks):
    "One sample's unshifted chunk ids on both sides (BOS pair first, insertion-only chunks, -1 holes) and exactness."
    s, t, correct = [0], [0], [True]
    for c in range(1, n_chunks):
        kind = _randint(g, 0, 9)
        ns, nt = (0, _randint(g, 1, 2)) if kind == 0 else (_randint(g, 1, 2), 0) if kind == 1 else \
            (_randint(g, 1, 3), _randint(g, 1, 3))
        if _randint(g, 0, 9) == 0: s.append(-1)  # an unaligned student token (chat-mode hole)
        if _randint(g, 0, 9) == 0: t.append(-1)
        s += [c] * ns
        t += [c] * nt
        correct.append(ns == 1 and nt == 1 and _randint(g, 0, 4) > 0)
    return s, t, correct


def make_batch(seed, B=4, masked=(2,), chunks=(3, 7), T_s=None, T_t=None, teachers=1):
    "A flat padded batch: student ids/masks, `teachers` cross teachers sharing one tokenization, sample_mask."
    g = torch.Generator().manual_seed(seed)
    rows = [_sample_chunking(g, _randint(g, *chunks)) for _ in range(B)]
    T_s = T_s or max([len(s) for s, _, _ in rows] + [1]) + 2
    T_t = T_t or max([len(t) for _, t, _ in rows] + [1]) + 1
    P = max([len(c) for _, _, c in rows] + [1])
    s_ids = torch.full((B, T_s), -1, dtype=torch.int64)
    t_ids = torch.full((B, T_t), -1, dtype=torch.int64)
    correct = torch.zeros(B, P, dtype=torch.bool)
    num_chunks = torch.tensor([len(c) for _, _, c in rows], dtype=torch.int64)
    s_len, t_len = torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64)
    for b, (s, t, c) in enumerate(rows):
        s_ids[b, :len(s)], t_ids[b, :len(t)], correct[b, :len(c)] = torch.tensor(s), torch.tensor(t), torch.tensor(c)
        s_len[b], t_len[b] = len(s), len(t)
    real_s = torch.arange(T_s) < s_len[:, None]
    real_t = torch.arange(T_t) < t_len[:, None]
    exact = lambda ids: torch.where(ids >= 0, correct.gather(1, ids.clamp_min(0)), False)
    alignment = AlignmentBatch.from_padded(
        pair_valid=torch.arange(P) < num_chunks[:, None], pair_is_correct=correct,
        student_exact_partition_mask=exact(s_ids) & (s_ids >= 0), teacher_exact_partition_mask=exact(t_ids) & (t_ids >= 0),
        student_chunk_id=s_ids, teacher_chunk_id=t_ids, num_chunks=num_chunks, validate=True)
    sample_mask = torch.ones(B)
    for b in masked:
        if b < B: sample_mask[b] = 0.
    batch = {"input_ids": torch.where(real_s, torch.randint(0, V_S, (B, T_s), generator=g), 0),
             "input_lengths": s_len, "token_mask": real_s & (s_ids >= 0), "sample_mask": sample_mask}
    teacher_input_ids = torch.where(real_t, torch.randint(0, V_T, (B, T_t), generator=g), 0)
    for i in range(teachers):
        batch.update({f"teacher_{i}_input_ids": teacher_input_ids, f"teacher_{i}_input_lengths": t_len,
                      f"teacher_{i}_token_mask": real_t & (t_ids >= 0), **alignment.as_flat(f"alignment_{i}_")})
    return batch


def make_logits(seed, batch, dtype=torch.float64, scale=2.0, teachers=1, same_vocab=False):
    "Seeded student logits `[B, T_s, W_S]` and teacher logits `{i: [B, T_t, W_T]}` (same-vocab: `[B, T_s, W_S]`)."
    g = torch.Generator().manual_seed(seed)
    B, T_s = batch["input_ids"].shape
    student = (torch.randn(B, T_s, W_S, generator=g, dtype=torch.float64) * scale).to(dtype)
    out = {}
    for i in range(teachers):
        shape = (B, T_s, W_S) if same_vocab else (B, batch[f"teacher_{i}_input_ids"].shape[1], W_T)
        out[i] = (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    return student, out


def data_for(config, seed, dtype=torch.float64, **batch_kw):
    "`(batch, student logits, teacher logits)` for `config`'s teachers (same-vocab logits when teacher 0 is topk_kl)."
    n = len(config.teachers)
    batch = make_batch(seed, teachers=n, **batch_kw)
    student, teachers = make_logits(seed + 1, batch, dtype=dtype, teachers=n, same_vocab=config.teachers[0].mode == "topk_kl")
    return batch, student, teachers


def rows_of(batch, rows):
    "The flat batch restricted to `rows` (a slice or index list)."
    return {k: v[rows] for k, v in batch.items()}


def _save_atomically(obj, path):
    "torch.save through a temporary name: ranks that write the same file while others read it (a config reads it) never expose half a file."
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_projections(directory, seed=0):
    "A dense top-k file (one-hot, colliding, fuzzy and empty rows) and a sparse dict file; returns both paths."
    g = torch.Generator().manual_seed(seed)
    indices = torch.full((V_S, 3), -1, dtype=torch.int64)
    likelihoods = torch.zeros(V_S, 3)
    one_hot = {0: 0, 1: 1, 2: 3, 3: 5, 4: 3}  # row 4 collides with row 2 on teacher 3
    for s, t in one_hot.items(): indices[s, 0], likelihoods[s, 0] = t, 1.0
    for s in range(5, V_S - 1):  # fuzzy rows, some with a top weight >= 0.6
        ids = torch.randperm(V_T, generator=g)[:3]
        w = torch.rand(3, generator=g) ** 3 + 0.05
        w = (w / w.sum()).sort(descending=True).values
        indices[s], likelihoods[s] = ids, w
    # row V_S - 1 stays empty
    dense = Path(directory) / "dense_projection.pt"
    _save_atomically({"indices": indices, "likelihoods": likelihoods}, dense)
    sparse_dict = {}
    for s in range(V_S):
        for t in range(V_T):
            if torch.rand(1, generator=g).item() < 0.3: sparse_dict[(s, t)] = float(torch.randint(1, 5, (1,), generator=g))
    sparse_dict[(0, -1)] = 2.0  # a sentinel teacher id, dropped by the loader
    sparse = Path(directory) / "sparse_projection.pt"
    _save_atomically(sparse_dict, sparse)
    return dense, sparse


def config_names():
    "The names of `every_config`, for parametrising tests at import time (its configs read a real file, written here once)."
    global _NAMES
    if _NAMES is None: _NAMES = tuple(every_config(write_projections(tempfile.mkdtemp(prefix="xtoken_dp_config_names_"))[0]))
    return _NAMES


_NAMES = None


def dense_matrix(path, row_normalize):
    "The projection as a list of rows `[V_S][V_T]` (duplicates summed, -1 dropped), built from the file by loops."
    obj = torch.load(path, weights_only=True)
    M = [[0.0] * V_T for _ in range(V_S)]
    if "indices" in obj:
        for s, (ids, ws) in enumerate(zip(obj["indices"].tolist(), obj["likelihoods"].tolist())):
            for t, w in zip(ids, ws):
                if t >= 0: M[s][t] += float(torch.tensor(w, dtype=torch.float32))
    else:
        for (s, t), w in obj.items():
            if t >= 0: M[s][t] += float(torch.tensor(w, dtype=torch.float32))
    if row_normalize:  # the loader normalises the fp32 matrix in fp32: do the same, left to right
        for row in M:
            total = torch.zeros((), dtype=torch.float32)
            for w in row:
                if w: total += w
            if total > 0: row[:] = [float(torch.tensor(w, dtype=torch.float32) / total) for w in row]
    return M


def exact_map_loop(path, xtoken_loss, teacher_vocab_size=V_T, student_vocab_size=V_S):
    "(common_student, common_teacher, uncommon_student, uncommon_teacher) of a dense file, by a loop over rows."
    obj = torch.load(path, weights_only=True)
    ids, ws = obj["indices"].tolist(), obj["likelihoods"].tolist()
    best = {}  # teacher id -> (student, w1)
    for s, (row_ids, row_w) in enumerate(zip(ids, ws)):
        live = [(t, w) for t, w in zip(row_ids, row_w) if t >= 0]
        if not live: continue
        w1 = max(w for _, w in live)
        if w1 <= 0: continue
        j1 = next(j for j, (_, w) in enumerate(live) if w == w1)
        t1 = live[j1][0]
        if xtoken_loss: ok = w1 >= 0.6
        else: ok = w1 >= 1 - 1e-6 and all(w <= 1e-6 for j, (_, w) in enumerate(live) if j != j1)
        if not ok or not 0 <= t1 < teacher_vocab_size: continue
        if t1 not in best: best[t1] = (s, w1)
        elif xtoken_loss and w1 > best[t1][1]: best[t1] = (s, w1)
    pairs = sorted((s, t) for t, (s, _) in best.items())
    cs, ct = [s for s, _ in pairs], [t for _, t in pairs]
    us = [s for s in range(max(len(ids), student_vocab_size)) if s not in cs]
    ut = [t for t in range(teacher_vocab_size) if t not in ct]
    return cs, ct, us, ut

# ---------------------------------------------------------------------------------------------------- references


def softmax(xs, kappa=1.0):
    m = max(x / kappa for x in xs)
    e = [math.exp(x / kappa - m) for x in xs]
    total = sum(e)
    return [v / total for v in e]


def log_softmax(xs, kappa=1.0):
    m = max(x / kappa for x in xs)
    lse = m + math.log(sum(math.exp(x / kappa - m) for x in xs))
    return [x / kappa - lse for x in xs]


def kl(p, q): return sum(a * (math.log(max(a, TINY)) - math.log(max(b, TINY))) for a, b in zip(p, q))


def shift(row): return [row[p + 1] if p + 1 < len(row) else -1 for p in range(len(row))]


def mean_rows(rows): return [sum(col) / len(rows) for col in zip(*rows)]


def log1mexp(u): return math.log(-math.expm1(u))


class Sample:
    "One sample of a flat batch as Python lists."
    def __init__(self, batch, b, i=0, exact_only=False, one_to_one=False):
        get = lambda key: batch[key][b].tolist()
        self.on = get("sample_mask") == 1
        self.ids, self.mask = get("input_ids"), get("token_mask")
        self.sigma = shift(get(f"alignment_{i}_student_chunk_id"))
        self.tau = shift(get(f"alignment_{i}_teacher_chunk_id"))
        self.t_ids = get(f"teacher_{i}_input_ids") if f"teacher_{i}_input_ids" in batch else None
        self.t_mask = get(f"teacher_{i}_token_mask") if f"teacher_{i}_token_mask" in batch else None
        self.pair_valid, self.correct = get(f"alignment_{i}_pair_valid"), get(f"alignment_{i}_pair_is_correct")
        self.exact_only, self.one_to_one = exact_only, one_to_one

    def chunk(self, c):
        "(S_c, Q_c, valid)"
        S = [p for p, x in enumerate(self.sigma) if x == c]
        Q = [q for q, x in enumerate(self.tau) if x == c]
        ok = self.on and bool(S) and bool(Q) and self.pair_valid[c] and (not self.exact_only or self.correct[c])
        if self.one_to_one: ok = ok and len(S) == 1 and len(Q) == 1
        return S, Q, ok


def samples(batch, i=0, exact_only=False, one_to_one=False):
    return [Sample(batch, b, i, exact_only, one_to_one) for b in range(batch["input_ids"].shape[0])]


def ref_counts(batch, modes, pairs="one_to_one"):
    "(N_tok, [N_i]) of a list of batches, by loops."
    n_tok, n = 0, [0] * len(modes)
    for mb in batch:
        for b in range(mb["input_ids"].shape[0]):
            s = Sample(mb, b)
            n_tok += sum(1 for p in range(len(s.ids) - 1) if s.on and s.mask[p + 1])
        for i, mode in enumerate(modes):
            if mode == "topk_kl":
                n[i] += sum(1 for b in range(mb["input_ids"].shape[0]) for p in range(mb["input_ids"].shape[1] - 1)
                            if Sample(mb, b).on and Sample(mb, b).mask[p + 1])
                continue
            for s in samples(mb, i, one_to_one=pairs == "one_to_one" and mode in ("pkl", "gold", "hkl")):
                n[i] += sum(1 for c in range(len(s.pair_valid)) if s.chunk(c)[2])
    return max(n_tok, 1), [max(x, 1) for x in n]


def ref_ce(z, batch):
    "Σ over CE targets of −log p(x_{p+1}) at the full width."
    total = 0.0
    for b, s in enumerate(samples(batch)):
        for p in range(len(s.ids) - 1):
            if s.on and s.mask[p + 1]: total -= log_softmax(z[b][p])[s.ids[p + 1]]
    return total


def _topk_ids(g, k):
    order = sorted(range(len(g)), key=lambda v: (-g[v], v))
    return sorted(order[:k])


def _reduce(rows, how): return rows[0] if how == "first" else mean_rows(rows)


def ref_pkl(z, y, batch, M, *, kappa=1.0, topk=None, scope="sample", reverse=False, target="arithmetic",
            reduce="mean", exact_only=False, reference=False, eps=1e-10, pairs="one_to_one", unseen="bucket"):
    "Σ over valid chunks of κ²·KL_c for P-KL, and the per-chunk values {(b, c): KL_c}."
    V_s, V_t = len(M), len(M[0])
    k = min(topk or V_t, V_t)
    if scope == "microbatch":
        g_all = [max(y[b][q][v] for b in range(len(y)) for q in range(len(y[b]))) for v in range(V_t)]
    total, per = 0.0, {}
    for b, s in enumerate(samples(batch, exact_only=exact_only, one_to_one=pairs == "one_to_one" and not reference)):
        if scope == "microbatch": K = _topk_ids(g_all, k)
        else:
            voters = [q for q, x in enumerate(s.tau) if x >= 0]
            K = _topk_ids([max([y[b][q][v] for q in voters], default=-math.inf) for v in range(V_t)], k)
        for c in range(len(s.pair_valid)):
            S, Q, ok = s.chunk(c)
            if not ok: continue
            r = []
            for p in S:
                pi = softmax(z[b][p][:V_s], kappa)
                r.append([sum(pi[a] * M[a][v] for a in range(V_s)) for v in K])
            ell = [log_softmax([y[b][q][v] for v in K], kappa) for q in Q]
            R = _reduce(r, reduce)
            if unseen == "bucket" and not reference:  # whole-vocabulary teacher log-probs, one rest entry per side
                ell = [[row[v] for v in K] for row in (log_softmax(y[b][q][:V_t], kappa) for q in Q)]
                P = softmax(_reduce(ell, reduce)) if target == "geometric" else _reduce([[math.exp(v) for v in row] for row in ell], reduce)
                rest = [sum(pi[a] * (sum(M[a][v] for v in range(V_t) if v not in K) + (not any(M[a]))) for a in range(V_s))
                          for pi in (softmax(z[b][p][:V_s], kappa) for p in S)]
                P, Rr = P + [0.0 if k == V_t or target == "geometric" else max(0.0, 1 - sum(P))], R + [_reduce([[x] for x in rest], reduce)[0]]
                value = kl(Rr, P) if reverse else kl(P, Rr)
            elif reference:  # the reference loss implementation's formulas
                Lc = _reduce(ell, reduce)
                Rh = [x / (sum(R) + 1e-10) for x in R]
                if reverse: value = sum((x + 1e-10) * (math.log(x + 1e-10) - l) for x, l in zip(Rh, Lc))
                else: value = sum(math.exp(l) * (l - math.log(x + 1e-10)) for x, l in zip(Rh, Lc))
            else:
                Rh = [(x + eps / k) / (sum(R) + eps) for x in R]
                if target == "geometric": P = softmax(_reduce(ell, reduce))
                else: P = _reduce([[math.exp(v) for v in row] for row in ell], reduce)
                value = kl(Rh, P) if reverse else kl(P, Rh)
            per[b, c] = kappa ** 2 * value
            total += per[b, c]
    return total, per


def ref_gold(z, y, batch, token_map, *, kappa=1.0, reverse=False, target="arithmetic", reduce="mean",
             renormalize=False, uncommon_topk=8192, uncommon_weight=1.0, reference=False, exact_only=False, V_s=V_S,
             pairs="one_to_one"):
    "(Σ κ²·(kl_common + w·l1), Σ κ²·kl_common, Σ κ²·w·l1, per-chunk) for gold/H-KL."
    cs, ct, us, ut = token_map
    k_u = min(len(us), len(ut), uncommon_topk)
    total = common_total = tail_total = 0.0
    per = {}
    for b, s in enumerate(samples(batch, exact_only=exact_only, one_to_one=pairs == "one_to_one" and not reference)):
        for c in range(len(s.pair_valid)):
            S, Q, ok = s.chunk(c)
            if not ok: continue
            if reference:  # the reference loss implementation's formulas
                As = _reduce([log_softmax(z[b][p][:V_s], kappa) for p in S], reduce)
                At = _reduce([log_softmax(y[b][q][:V_T], kappa) for q in Q], reduce)
                a_s, a_t = [As[i] for i in cs], [At[i] for i in ct]
                if reverse: common = sum(math.exp(x) * (x - w) for x, w in zip(a_s, a_t))
                else: common = sum(math.exp(w) * (w - x) for x, w in zip(a_s, a_t))
                tail_s, tail_t = [math.exp(As[i]) for i in us], [math.exp(At[i]) for i in ut]
            else:
                if target == "geometric":
                    Ps = softmax(_reduce([log_softmax(z[b][p][:V_s], kappa) for p in S], reduce))
                    Pt = softmax(_reduce([log_softmax(y[b][q][:V_T], kappa) for q in Q], reduce))
                else:
                    Ps = _reduce([softmax(z[b][p][:V_s], kappa) for p in S], reduce)
                    Pt = _reduce([softmax(y[b][q][:V_T], kappa) for q in Q], reduce)
                a_s, a_t = [Ps[i] for i in cs], [Pt[i] for i in ct]
                if renormalize:
                    p = [x / max(sum(a_t), TINY) for x in a_t]
                    q = [x / max(sum(a_s), TINY) for x in a_s]
                else:
                    p, q = a_t + [max(0.0, 1 - sum(a_t))], a_s + [max(0.0, 1 - sum(a_s))]
                common = kl(q, p) if reverse else kl(p, q)
                tail_s, tail_t = [Ps[i] for i in us], [Pt[i] for i in ut]
            l1 = sum(abs(a - b_) for a, b_ in zip(sorted(tail_s, reverse=True)[:k_u], sorted(tail_t, reverse=True)[:k_u]))
            common_total += kappa ** 2 * common
            tail_total += kappa ** 2 * uncommon_weight * l1
            per[b, c] = kappa ** 2 * (common + uncommon_weight * l1)
            total += per[b, c]
    return total, common_total, tail_total, per


def ref_topk_kl(z, y, batch, *, kappa=1.0, topk=None, reverse=False, V=V_S):
    "Σ over CE positions of κ²·KL on the teacher's per-sample top-k ids (same vocabulary)."
    k, total = min(topk or V, V), 0.0
    for b, s in enumerate(samples(batch)):
        positions = [p for p in range(len(s.ids) - 1) if s.on and s.mask[p + 1]]
        K = _topk_ids([max([y[b][p][v] for p in positions], default=-math.inf) for v in range(V)], k)
        for p in positions:
            pt = softmax([y[b][p][v] for v in K], kappa)
            ps = softmax([z[b][p][v] for v in K], kappa)
            total += kappa ** 2 * (kl(ps, pt) if reverse else kl(pt, ps))
    return total


def ref_alm(z, y, batch, *, tau=100.0, divergence="binary_kl", i=0, V_s=V_S, V_t=V_T):
    "Σ over valid chunks of τ·D(e^ut, e^us), chunk log-likelihoods normalised over each side's vocabulary (no lm_head padding)."
    total = 0.0
    for b, s in enumerate(samples(batch, i)):
        for c in range(len(s.pair_valid)):
            S, Q, ok = s.chunk(c)
            if not ok: continue
            Ls = sum(log_softmax(z[b][p][:V_s])[s.ids[p + 1]] for p in S)
            Lt = sum(log_softmax(y[b][q][:V_t])[s.t_ids[q + 1]] for q in Q)
            us, ut = min(Ls / tau, -1e-7), min(Lt / tau, -1e-7)
            pt = math.exp(ut)
            if divergence == "binary_kl": D = pt * (ut - us) + (1 - pt) * (log1mexp(ut) - log1mexp(us))
            else: D = -(pt * us + (1 - pt) * log1mexp(us))
            total += tau * D
    return total


def ref_uld(z, y, batch, *, topk=None, kappa_s=1.0, kappa_t=1.0):
    "Σ over valid chunks of the sorted-probability L1 at the chunk's first positions."
    k = min(topk or math.inf, V_S, V_T)
    total = 0.0
    for b, s in enumerate(samples(batch)):
        for c in range(len(s.pair_valid)):
            S, Q, ok = s.chunk(c)
            if not ok: continue
            ps = sorted(softmax(z[b][min(S)][:V_S], kappa_s), reverse=True)[:k]
            pt = sorted(softmax(y[b][min(Q)][:V_T], kappa_t), reverse=True)[:k]
            total += sum(abs(a - b_) for a, b_ in zip(ps, pt))
    return total

# ------------------------------------------------------------------------------------- every mode and aggregation


def spec(mode, dense, **kw):
    return L.TeacherLossSpec(mode, dense if mode in L.PROJECTION_MODES else None, V_S if mode == "topk_kl" else V_T, **kw)


def every_config(dense):
    "Every mode, every aggregation and the switches that change how the blocks see the data."
    one = {mode: L.XTokenLossConfig(V_S, [spec(mode, dense)], vocab_topk=4)
           for mode in ("pkl", "gold", "hkl", "topk_kl", "alm", "uld")}
    two = lambda a, b, **kw: [spec(a, dense, weight=0.7), spec(b, dense, weight=1.3)]
    return {**one,
            "ce_only": L.XTokenLossConfig(V_S, [spec("alm", dense)], kl_loss_weight=0.0, ce_loss_scale=2.0),
            "sum_pkl_gold_kappa": L.XTokenLossConfig(V_S, two("pkl", "gold"), vocab_topk=4, temperature=1.5),
            "sum_dynamic_weights": L.XTokenLossConfig(V_S, two("hkl", "alm"), sum_weights_metric="entropy", alpha=3.0),
            "sum_ce_weights_by_vocab": L.XTokenLossConfig(V_S, two("uld", "pkl"), vocab_topk=4, sum_weights_metric="ce",
                                                          normalize_teacher_by_vocab=True),
            "dynamic_loss_scaling": L.XTokenLossConfig(V_S, two("pkl", "alm"), vocab_topk=4, dynamic_loss_scaling=True,
                                                       sum_weights_metric="max_prob"),
            "select_teacher": L.XTokenLossConfig(V_S, two("uld", "gold"), kd_loss_mode="select_teacher"),
            "averaged_logits": L.XTokenLossConfig(V_S, two("topk_kl", "topk_kl"), kd_loss_mode="averaged_logits", vocab_topk=5),
            "pkl_microbatch_scope_reverse": L.XTokenLossConfig(V_S, [spec("pkl", dense)], vocab_topk=3,
                                                               topk_scope="microbatch", reverse_kl=True),
            "pkl_geometric_exact_only": L.XTokenLossConfig(V_S, [spec("pkl", dense)], chunk_target="geometric",
                                                           exact_token_match_only=True),
            "gold_first_renormalized": L.XTokenLossConfig(V_S, [spec("gold", dense)], chunk_reduce="first",
                                                          common_renormalize=True, uncommon_topk=2),
            "hkl_reference_formulas": L.XTokenLossConfig(V_S, [spec("hkl", dense)], reference_formulas=True, reverse_kl=True),
            "pkl_reference_formulas": L.XTokenLossConfig(V_S, [spec("pkl", dense)], reference_formulas=True, vocab_topk=4),
            "alm_binary_ce": L.XTokenLossConfig(V_S, [spec("alm", dense)], alm_divergence="binary_ce", alm_tau=3.0),
            "uld_topk_temperatures": L.XTokenLossConfig(V_S, [spec("uld", dense)], uld_topk=3, uld_student_temperature=2.0),
            "topk_kl_reverse": L.XTokenLossConfig(V_S, [spec("topk_kl", dense)], vocab_topk=4, reverse_kl=True, temperature=2.0)}

# ------------------------------------------------------------------------------------------ spawned gloo workers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, name, args, out_dir):
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        result = globals()[name](rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        result = {"error": traceback.format_exc()}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def run_spawned(name, args=(), world=2, timeout=60.0):
    "Run worker `name(rank, world, *args)` in `world` spawned gloo processes; their results, or an error on a hang."
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="xtoken_dp_losses_") as out_dir:
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(r, world, port, name, args, out_dir)) for r in range(world)]
        for p in procs: p.start()
        deadline = timeout
        import time
        start = time.monotonic()
        for p in procs: p.join(max(0.1, deadline - (time.monotonic() - start)))
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in alive: procs[r].kill()
        for p in procs: p.join()
        if alive: raise TimeoutError(f"ranks {alive} of {name} did not finish within {timeout:.0f} s (deadlock?)")
        results = [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, res in enumerate(results):
        if "error" in res: raise RuntimeError(f"rank {r} of {name} failed:\n{res['error']}")
    return results


def primitives_worker(rank, world):
    "L4 and L16 on real gloo processes."
    out = {}
    local = torch.tensor(3 + rank, dtype=torch.int64)
    total = L.dp_all_reduce_sum(local)
    out["sum"], out["local_after"], out["dtype"] = total.item(), local.item(), str(total.dtype)
    groups = [dist.new_group([0]), dist.new_group([1])]  # every rank creates every group
    L.set_dp_group(groups[rank])
    out["own_group_sum"] = L.dp_all_reduce_sum(torch.tensor(3. + rank)).item()
    out["own_world_size"] = L.dp_world_size()
    L.set_dp_group(None)
    values = torch.tensor([1., 2.]) if rank == 0 else torch.tensor([10., 99.])
    mask = torch.tensor([1, 1]) if rank == 0 else torch.tensor([1, 0])
    out["masked_mean"] = L.dp_masked_mean(values, mask).item()
    out["world_size"] = L.dp_world_size()
    return out

# ------------------------------------------------------------------------------------------------ invariance


HIDDEN = 5


def invariance_setup(directory):
    "The data of the invariance tests: one batch of 4 (sample 2 masked), features, a head, teacher logits, configs."
    dense, _ = write_projections(directory)
    batch = make_batch(11, B=4, masked=(2,), teachers=2)
    g = torch.Generator().manual_seed(12)
    B, T_s = batch["input_ids"].shape
    T_t = batch["teacher_0_input_ids"].shape[1]
    features = torch.randn(B, T_s, HIDDEN, generator=g, dtype=torch.float64)
    head = torch.randn(HIDDEN, W_S, generator=g, dtype=torch.float64)
    teachers = {0: torch.randn(B, T_t, W_T, generator=g, dtype=torch.float64) * 2,
                1: torch.randn(B, T_t, W_T, generator=g, dtype=torch.float64) * 2}
    same_vocab = torch.randn(B, T_s, W_S, generator=g, dtype=torch.float64) * 2
    return batch, features, head, teachers, same_vocab, invariance_configs(dense)


def invariance_configs(dense):
    spec = lambda mode, **kw: L.TeacherLossSpec(mode, dense if mode in L.PROJECTION_MODES else None,
                                                V_S if mode == "topk_kl" else V_T, **kw)
    configs = {mode: L.XTokenLossConfig(V_S, [spec(mode)], vocab_topk=4) for mode in ("pkl", "gold", "hkl", "alm", "uld")}
    configs["topk_kl"] = L.XTokenLossConfig(V_S, [spec("topk_kl")], vocab_topk=5)
    configs["sum_pkl_alm"] = L.XTokenLossConfig(V_S, [spec("pkl", weight=0.7), spec("alm", weight=1.3)], vocab_topk=4,
                                                 temperature=1.5)
    return configs


def run_microbatches(config, batch, features, head, teachers, same_vocab, parts, *, group=None):
    "Loss total, per-sample logit gradients and the head gradient of one rank's microbatches (`parts`: row lists)."
    head = head.clone().requires_grad_()
    microbatches = [rows_of(batch, rows) for rows in parts]
    normalizers = L.compute_global_normalizers(microbatches, config, group=group)
    total, logit_grads = torch.zeros((), dtype=torch.float64), {}
    same = config.teachers[0].mode == "topk_kl"
    for rows, mb in zip(parts, microbatches):
        logits = features[rows] @ head
        logits.retain_grad()
        teacher_logits = {0: same_vocab[rows]} if same else {i: teachers[i][rows] for i in range(len(config.teachers))}
        loss, _ = L.xtoken_kd_loss(logits, mb, teacher_logits, config=config, normalizers=normalizers, group=group)
        loss.backward()
        total += loss.detach()
        for j, r in enumerate(rows): logit_grads[r] = logits.grad[j].clone()
    return total, logit_grads, head.grad.clone()


INVARIANCE_BLOCK_SIZES = (None, 2)  # the whole microbatch at once, and blocks of 2 positions


def invariance_worker(rank, world, directory):
    "L19 (c) 2 ranks x 2 samples and (d) 2 ranks x 2 microbatches of 1, whole and blockwise: totals and gradients, all-reduced with SUM."
    batch, features, head, teachers, same_vocab, configs = invariance_setup(directory)
    mine = [2 * rank, 2 * rank + 1]
    out = {"primitives": primitives_worker(rank, world)}  # L4 and L16 share this pair of processes
    for name, config in configs.items():
        for size in INVARIANCE_BLOCK_SIZES:
            sized = dataclasses.replace(config, block_size=size)
            for split, parts in (("c", [mine]), ("d", [[mine[0]], [mine[1]]])):
                total, logit_grads, head_grad = run_microbatches(sized, batch, features, head, teachers, same_vocab, parts)
                dist.all_reduce(total)
                dist.all_reduce(head_grad)
                out[name, split, size] = (total.item(), logit_grads, head_grad)
    return out


def deadlock_worker(rank, world, directory):
    "L20: rank 1 holds a fully masked microbatch and an empty one; every rank makes the same calls."
    batch, features, head, teachers, same_vocab, configs = invariance_setup(directory)
    parts = [[0, 1], [3]] if rank == 0 else [[2], []]
    masked = dict(batch, sample_mask=batch["sample_mask"].clone())
    masked["sample_mask"][2] = 0.
    out = {}
    for name in ("pkl", "alm", "sum_pkl_alm"):
        total, _, head_grad = run_microbatches(configs[name], masked, features, head, teachers, same_vocab, parts)
        dist.all_reduce(total)
        dist.all_reduce(head_grad)
        out[name] = (total.item(), head_grad)
    scored = L.XTokenLossConfig(V_S, configs["sum_pkl_alm"].teachers, vocab_topk=4, sum_weights_metric="entropy")
    selected = L.XTokenLossConfig(V_S, configs["sum_pkl_alm"].teachers, vocab_topk=4, kd_loss_mode="select_teacher")
    for name, config in (("scored", scored), ("selected", selected)):
        total, _, _ = run_microbatches(config, masked, features, head, teachers, same_vocab, parts)
        dist.all_reduce(total)
        out[name] = total.item()
    return out

# ------------------------------------------------------------------------------------- vocabulary-parallel logits

TP_WIDTH = W_S + 1  # an even logit width (one more lm_head padding column) splits into two equal shards


def tp_data(config, seed=71):
    "A batch, full-width student logits, teacher logits and a hidden/lm_head pair for the vocabulary-parallel tests."
    n = len(config.teachers)
    batch = make_batch(seed, teachers=n)
    student, teachers = make_logits(seed + 1, batch, teachers=n, same_vocab=config.teachers[0].mode == "topk_kl")
    g = torch.Generator().manual_seed(seed + 2)
    B, T = batch["input_ids"].shape
    student = torch.cat([student, torch.randn(B, T, TP_WIDTH - W_S, generator=g, dtype=torch.float64)], -1)
    hidden = torch.randn(B, T, HIDDEN, generator=g, dtype=torch.float64)
    weight, bias = torch.randn(TP_WIDTH, HIDDEN, generator=g, dtype=torch.float64), torch.randn(TP_WIDTH, generator=g, dtype=torch.float64)
    return batch, student, teachers, hidden, weight, bias


def tp_run(config, data, block_size, shard=(0, 1), dp_group=None, tp_group=None):
    "`(loss, logit gradient, metrics)` and `(loss, (hidden, weight, bias) gradients)` of the logits and fused forms on one shard."
    import dataclasses
    batch, student, teachers, hidden, weight, bias = data
    overwrite = block_size == "overwrite"  # blocks of 2, the gradient written over each rank's shard of the logits
    config = dataclasses.replace(config, block_size=2 if overwrite else block_size, overwrite_logits=overwrite)
    rank, size = shard
    cols = slice(rank * TP_WIDTH // size, (rank + 1) * TP_WIDTH // size)
    norms = L.compute_global_normalizers(batch, config, group=dp_group)
    logits = student[..., cols].clone().requires_grad_()
    loss, metrics = L.xtoken_kd_loss(logits, batch, teachers, config=config, normalizers=norms, group=dp_group, tp_group=tp_group)
    loss.backward()
    leaves = [hidden.clone().requires_grad_(), weight[cols].clone().requires_grad_(), bias[cols].clone().requires_grad_()]
    fused, _ = L.xtoken_kd_loss_fused(leaves[0], leaves[1], batch, teachers, config=config, normalizers=norms, bias=leaves[2],
                                      group=dp_group, tp_group=tp_group)
    fused.backward()
    metrics = {k: float(v) for k, v in metrics.items()}
    return (loss.item(), logits.grad, metrics), (fused.item(), tuple(t.grad for t in leaves))


def tp_worker(rank, world, directory, names, block_sizes):
    "Two ranks sharing one tensor-parallel group (tp = 2), each its own data-parallel group of one."
    dp_groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    tp_group = dist.new_group(list(range(world)))
    configs = every_config(Path(directory) / "dense_projection.pt")
    out = {}
    for name in names:
        data = tp_data(configs[name])
        for size in block_sizes:
            out[name, size] = tp_run(configs[name], data, size, (rank, world), dp_groups[rank], tp_group)
    return out


# ------------------------------------------------------------------------------------- one loss call per path


def fused_inputs(batch):
    g = torch.Generator().manual_seed(7)
    B, T = batch["input_ids"].shape
    return (torch.randn(B, T, HIDDEN, generator=g, dtype=torch.float64).requires_grad_(),
            torch.randn(W_S, HIDDEN, generator=g, dtype=torch.float64).requires_grad_())


def run_on_path(config, student, batch, teachers, path):
    """`(loss, gradients, metrics)` of one call on `path`: plain, blockwise, overwrite, fused (of the hidden states and the
    lm_head weight), or plain_of_fused (the plain loss of the fused path's logits)."""
    norms = L.compute_global_normalizers(batch, config)
    if path in ("fused", "plain_of_fused"):
        hidden, weight = fused_inputs(batch)
        if path == "fused":
            loss, metrics = L.xtoken_kd_loss_fused(hidden, weight, batch, teachers, config=dataclasses.replace(config, block_size=2),
                                                   normalizers=norms)
        else:  # the plain loss of the same logits, its gradient carried back through the lm_head by autograd
            loss, metrics = L.xtoken_kd_loss(hidden @ weight.T, batch, teachers, config=dataclasses.replace(config, block_size=None),
                                             normalizers=norms)
        return loss.detach(), torch.autograd.grad(loss, [hidden, weight]), metrics
    size, overwrite = {"plain": (None, False), "blockwise": (2, False), "overwrite": (3, True)}[path]
    x = student.detach().clone().requires_grad_()
    loss, metrics = L.xtoken_kd_loss(x, batch, teachers, config=dataclasses.replace(config, block_size=size, overwrite_logits=overwrite),
                                     normalizers=norms)
    return loss.detach(), torch.autograd.grad(loss, [x]), metrics


def assert_same(got, want, tol, what):
    (loss, grads, metrics), (loss_e, grads_e, metrics_e) = got, want
    assert abs(loss.item() - loss_e.item()) <= tol * max(1.0, abs(loss_e.item())), (what, loss.item(), loss_e.item())
    for g, e in zip(grads, grads_e):
        assert (g - e).abs().max().item() <= tol * max(1.0, e.abs().max().item()), what
    assert set(metrics) == set(metrics_e), what
    for key, value in metrics_e.items():
        assert abs(float(metrics[key]) - float(value)) <= tol * max(1.0, abs(float(value))), (what, key, float(metrics[key]), float(value))

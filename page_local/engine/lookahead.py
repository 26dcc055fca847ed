"""LORE-KV's lookahead: sample short continuations and score the prompt by deletion cost.

(arXiv 2610.07643; docs/algorithms.md §4.) After the prompt is in sequence `seq`, S futures are
copied from it as sequences 1..S that SHARE the prompt's cells (no copy), each samples tau tokens
from the model itself (temperature 0.7, top-p 0.95, seeded), all futures advance together in one
batch per step, and the deletion-cost probe (csrc/page-probe.cpp) scores every prompt position for
every fed token's query:

    c(l, s, t, p) = sum_h a/(1-a) * ||R_h (v_p - o)||          (summed over heads on the device)

The futures are removed afterwards; only the prompt's positions are scored, so they never count
against the budget. The logits buffer then holds the futures' outputs: callers re-decode the prompt's
last token before sampling from it (the engine always does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from page_local.evictors.lorekv import LookaheadSpec
from page_local.verify import log_softmax


@dataclass
class Lookahead:
    """What the futures measured. Arrays over futures are aligned; `positions` are the prompt's."""

    positions: np.ndarray  # i32 (T,) positions of the scored sequence, ascending
    cost: np.ndarray  # f64 (S, n_layer, T): mean over the future's fed tokens of the head-summed cost
    n_fed: np.ndarray  # i32 (S,) tokens each future fed (tau_s; < tau if it sampled end-of-generation)
    logprob: np.ndarray  # f64 (S,) mean log-prob (temperature 1) of the future's sampled tokens
    entropy: np.ndarray  # f64 (S,) mean entropy (nats) of the distributions they were sampled from
    tokens: list[list[int]] = field(default_factory=list)
    ms: float = 0.0
    note: str = ""  # how the run was shortened, if it was


def sample_token(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """Nucleus sampling at a temperature: the smallest set of top tokens whose probability reaches top_p."""
    lp = log_softmax(np.asarray(logits, dtype=np.float64) / temperature)
    p = np.exp(lp)
    order = np.argsort(-p, kind="stable")
    cum = np.cumsum(p[order])
    keep = order[: int(np.searchsorted(cum, top_p) + 1)]
    q = p[keep] / p[keep].sum()
    return int(keep[rng.choice(keep.size, p=q)])


def run_lookahead(ctx, seq: int, last_logits: np.ndarray, spec: LookaheadSpec, out_proj: np.ndarray,
                  is_eog) -> Lookahead:
    """Sample spec.futures continuations of `seq` (whose last decoded token produced last_logits) and
    measure the deletion cost of seq's positions under their queries. Leaves the cache as it found it."""
    t0 = time.perf_counter()
    page = ctx.page
    pos0 = ctx.seq_pos_max(seq) + 1
    free = ctx.n_ctx - ctx.cells_used(seq) - 1  # one cell stays free for the answer's first token
    S, tau, note = spec.futures, spec.tokens, ""
    if free < S * tau:
        S = max(1, min(S, free // tau))
        tau = min(tau, free // S)
        note = f"lookahead shortened to {S} futures x {tau} tokens (only {free} free cells)"
        if tau < 1:
            raise ValueError(f"the context has no free cells for LORE-KV's lookahead ({free} free); "
                             "use a larger n_ctx or another evictor")
    seqs = [seq + 1 + s for s in range(S)]
    page.set_out_proj(out_proj)
    rng = np.random.default_rng(spec.seed)

    n_layer = out_proj.shape[0]
    positions = page.positions(seq)
    cost = np.zeros((S, n_layer, positions.size), dtype=np.float64)
    n_fed = np.zeros(S, dtype=np.int32)
    lp_sum = np.zeros(S)
    ent_sum = np.zeros(S)
    n_sampled = np.zeros(S, dtype=np.int32)
    toks: list[list[int]] = [[] for _ in range(S)]

    def draw(s: int, logits: np.ndarray) -> int | None:
        lp = log_softmax(logits)
        y = sample_token(logits, spec.temperature, spec.top_p, rng)
        lp_sum[s] += lp[y]
        ent_sum[s] += float(-(np.exp(lp) * lp).sum())
        n_sampled[s] += 1
        return None if is_eog(y) else y

    try:
        for s in seqs:
            ctx.seq_rm(s, -1, -1)
            ctx.seq_cp(seq, s, -1, -1)
        nxt: list[int | None] = [draw(s, last_logits) for s in range(S)]
        for t in range(tau):
            active = [s for s in range(S) if nxt[s] is not None]
            if not active:
                break
            page.arm_cost_probe(seq, reuse_value_norms=t > 0)  # the prompt's cells do not change
            ctx.decode_step([nxt[s] for s in active], [pos0 + t] * len(active), [seqs[s] for s in active])
            got_pos, _, c = page.read_costs()  # (n_layer, n_active, n_pos)
            if not np.array_equal(got_pos, positions):
                raise RuntimeError("internal: the scored sequence changed during the lookahead")
            for i, s in enumerate(active):
                cost[s] += c[:, i, :]
                n_fed[s] += 1
                toks[s].append(nxt[s])
            for i, s in enumerate(active):
                nxt[s] = draw(s, ctx.logits(i)) if t + 1 < tau else None
    finally:
        page.disarm_probe()
        for s in seqs:
            ctx.seq_rm(s, -1, -1)

    fed = np.maximum(n_fed, 1)[:, None, None]
    return Lookahead(positions=positions, cost=cost / fed, n_fed=n_fed,
                     logprob=lp_sum / np.maximum(n_sampled, 1), entropy=ent_sum / np.maximum(n_sampled, 1),
                     tokens=toks, ms=(time.perf_counter() - t0) * 1e3, note=note)


def score_answer(ctx, seq: int, last_pos: int, answer, out_proj: np.ndarray, work: int) -> Lookahead:
    """LORE-KV's deletion cost under the queries of a known continuation: the full cache's own answer,
    which the verify and search gates decode before anything is evicted (evictor lorekv-answer).

    `work` becomes a copy of seq's positions up to last_pos (cells shared, nothing copied), the answer is
    decoded there in batches of at most n_ubatch tokens with the cost probe armed, and work is emptied
    again. One future, greedy and real, instead of S sampled ones: the check forces these very tokens
    on every candidate. Only positions <= last_pos (the prompt) are scored."""
    t0 = time.perf_counter()
    page = ctx.page
    answer = [int(t) for t in answer]
    if not answer:
        raise ValueError("internal: no answer tokens to score the prompt with")
    page.set_out_proj(out_proj)
    ctx.seq_rm(work, -1, -1)
    ctx.seq_cp(seq, work, -1, last_pos + 1)
    total, positions = None, None
    try:
        step = ctx.n_ubatch
        for s in range(0, len(answer), step):
            chunk = answer[s: s + step]
            page.arm_cost_probe(work)
            ctx.decode(chunk, last_pos + 1 + s, work, logits="none")
            got_pos, _, c = page.read_costs()  # (n_layer, n_chunk, n_pos) over work's positions
            keep = got_pos <= last_pos
            part = c[:, :, keep].astype(np.float64).sum(axis=1)
            if total is None:
                positions, total = got_pos[keep], part
            elif not np.array_equal(got_pos[keep], positions):
                raise RuntimeError("internal: the scored prompt changed while its answer was decoded")
            else:
                total += part
    finally:
        page.disarm_probe()
        ctx.seq_rm(work, -1, -1)
    m = len(answer)
    return Lookahead(positions=positions, cost=(total / m)[None], n_fed=np.array([m], dtype=np.int32),
                     logprob=np.zeros(1), entropy=np.zeros(1), tokens=[answer],
                     ms=(time.perf_counter() - t0) * 1e3, note="scored by the full cache's answer")

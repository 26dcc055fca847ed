"""The steps of a turn on a llama.cpp context, written once: Engine, the evaluation runner and the
benchmarks all run these (docs/design.md §5, "One turn through the engine").

    prefill   decode the prompt up to its last ubatch; arm the probe on that ubatch's last W queries (one
              batch fewer than a batch of its own, llama.cpp's split of the prompt); read the probe
    signal    D and per-layer agreement (signal.py) from the probe
    signals   what the evictor needs beyond the probe: the last token's query, key norms, the
              prefill's accumulated attention (H2O), LORE-KV's lookahead (sampled futures; or, for
              lorekv-answer, the full cache's answer itself, scored at the check)
    select    the evictor's keep set at budget B
    evict     in place (the sequence itself: evict, compact, re-decode the last prompt token) or into a
              candidate sequence that shares the prompt's cells (seq_cp, evict, decode from the last
              prompt token on), which self-verification and the evaluation score before anything is
              committed
    teacher_force / greedy / verify_span   the candidate's outputs on given tokens and the check
    check_ladder   the check over one candidate or a ladder of them: every rung's first chunk in one
              batch, then smallest first, in growing chunks that stop where a candidate fails

A Pipeline is bound to one Context and Model; it keeps nothing between turns but the output
projection factors LORE-KV reuses.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from page_local.evictors.base import EvictionInput
from page_local.probe import ProbeResult
from page_local.verify import VERIFY_RULE, logp, top_token, verify_score

W = 32  # the probe window: the probe reads the queries of the prompt's last W tokens
TOP_K = 32  # per-head top-k the probe keeps for every query


def armed_tail(n: int, n_ubatch: int) -> int:
    """How many of a prompt's n last tokens the armed batch holds: the prompt's last ubatch as llama.cpp splits
    it (n_ubatch each from the start), at least min(W, n); the probe reads the last W of them. So the probe
    rides on a batch the prompt needs anyway: no batch of its own (measured on AMD EPYC Zen 1, 2K tokens:
    a 2K prefill took 19.0 s with the 32-token batch apart, 17.9-18.6 s without:
    bench decode's ttft_s). $PAGE_LOCAL_PROBE_BATCH=apart: min(W, n), a batch of
    its own (as before; the committed evaluation rows were read so)."""
    w = min(W, n)
    if os.environ.get("PAGE_LOCAL_PROBE_BATCH") == "apart":
        return w
    return max(w, n - n_ubatch * ((n - 1) // n_ubatch))
# The check's first chunk of forced tokens; each later chunk doubles (Pipeline.check_ladder). A failing
# candidate stops at the chunk where it fails: on the committed search rows this forces 35-75 tokens per
# input over the whole ladder, against 160-260 for every rung in full (docs/results.md, "Budget search").
FIRST_CHUNK = 4
N_SINK = 4  # attention sinks every evictor keeps
# Signals Pipeline.signals provides (evictors.base.NEEDS lists every known one). An evictor needing
# anything else is refused when it is chosen, not mid-turn on the turns where the gate opens.
PROVIDED = frozenset({"probe", "last_query", "prefill_attention", "key_norms", "lookahead", "answer_lookahead",
                      "spans"})
# Signals that exist only once the full cache has answered: the keep set is chosen at the check (the
# verify and search gates), not after the prefill
AFTER_ANSWER = frozenset({"answer_lookahead"})


def supported(evictor):
    """The evictor, if the pipeline provides every signal it needs; else ValueError saying which."""
    missing = sorted(evictor.needs - PROVIDED)
    if missing:
        what = ", ".join("key norms (key_norms)" if m == "key_norms" else m for m in missing)
        raise ValueError(f"evictor {evictor.name!r} needs {what}, which the engine does not provide; "
                         "choose another evictor")
    return evictor


@dataclass
class Prefilled:
    """A prompt in a sequence, probed: what every later step of the turn reads."""

    probe: ProbeResult
    held: np.ndarray  # i32 (T,) positions the sequence holds after the prefill, ascending
    logits: np.ndarray  # f32 (n_vocab,) next-token logits after the prompt's last token
    prefill_attention: tuple[np.ndarray, np.ndarray] | None  # (positions, f32 (n_layer, n_pos)) or None
    D: float | None = None  # PAGE's drop (None when the probe saw fewer than 2 heads)
    agreement: list[float] = field(default_factory=list)  # per-layer head agreement
    prefill_ms: float = 0.0
    probe_ms: float = 0.0

    @property
    def T(self) -> int:
        return int(self.held.size)


class Pipeline:
    """The turn's steps on one context (ctx: native.runtime.Context, model: native.runtime.Model)."""

    def __init__(self, ctx, model):
        self.ctx, self.model = ctx, model
        self._out_proj: dict[str, np.ndarray] = {}
        self.cancel = None  # an object with is_set(): a prefill stops before its next batch once set (Cancelled)
        self.progress = None  # progress(n): called after each batch of n tokens a prefill decoded
        # spans(held) -> i64 (len(held),): the sentence of each held position (the engine sets it: it knows the
        # conversation's text; room.RoomMaker.spans)
        self.spans = None

    # --- prefill and probe -----------------------------------------------------------------------
    def prefill(self, toks: Sequence[int], pos0: int, seq: int = 0, track_attention: bool = False) -> Prefilled:
        """Decode toks at pos0.. in seq, the last min(W, n) as one batch with the probe armed; compute D.
        track_attention: also sum every prefill chunk's attention per position (H2O's input)."""
        ctx, page = self.ctx, self.ctx.page
        n = len(toks)
        w = min(W, n)
        m = w if track_attention else armed_tail(n, ctx.n_ubatch)  # H2O's tracking arms every chunk apart
        t0 = time.perf_counter()
        try:  # a cancelled prefill (Cancelled between batches) leaves no probe armed; its cells are the caller's
            attn = self._decode_tracked(toks[: n - m], pos0, seq, track_attention)
            page.arm_probe(seq, TOP_K, last=w if m > w else 0)
            ctx.decode(list(toks[n - m:]), pos0 + n - m, seq, cancel=self.cancel)
            if self.progress is not None:
                self.progress(m)
        except BaseException:
            page.disarm_probe()
            raise
        logits = ctx.logits()
        t1 = time.perf_counter()
        probe = page.read_probe()
        held = page.positions(seq)
        t2 = time.perf_counter()
        pre = Prefilled(probe=probe, held=held, logits=logits, prefill_attention=attn,
                        prefill_ms=(t1 - t0) * 1e3, probe_ms=(t2 - t1) * 1e3)
        pre.D, pre.agreement = drop(probe)
        return pre

    def _decode_tracked(self, toks, pos0: int, seq: int, track: bool):
        """Decode toks; with track, arm the probe on every ubatch-sized chunk and sum its column mass
        (H2O's accumulated attention). Returns (positions, f32 (n_layer, n_pos) sums) or None."""
        if not len(toks):
            return None
        if not track:
            step = self.ctx.n_batch if self.progress is not None else len(toks)  # batches the reader can count
            for s in range(0, len(toks), step):
                self.ctx.decode(list(toks[s: s + step]), pos0 + s, seq, logits="none", cancel=self.cancel)
                if self.progress is not None:
                    self.progress(min(step, len(toks) - s))
            return None
        acc: dict[int, np.ndarray] = {}
        step = self.ctx.n_ubatch
        for s in range(0, len(toks), step):
            chunk = list(toks[s: s + step])
            self.ctx.page.arm_probe(seq, 1)
            self.ctx.decode(chunk, pos0 + s, seq, logits="none", cancel=self.cancel)
            if self.progress is not None:
                self.progress(len(chunk))
            r = self.ctx.page.read_probe()
            mass = r.mean * r.n_query  # f32 (n_layer, n_pos): summed over this chunk's queries
            for i, p in enumerate(r.positions.tolist()):
                acc[p] = acc.get(p, 0) + mass[:, i]
        pos = np.array(sorted(acc), dtype=np.int32)
        return pos, np.stack([acc[p] for p in pos.tolist()], axis=1).astype(np.float32)

    # --- what the evictor needs ------------------------------------------------------------------
    def signals(self, needs: frozenset, pre: Prefilled, last_pos: int, last_tok: int, seq: int = 0,
                spec=None, cache: dict | None = None, restore_logits: bool = False) -> dict:
        """EvictionInput fields beyond the probe for an evictor needing `needs`. The last prompt token
        (last_pos, last_tok) is re-decoded with the probe armed for last_query. cache: shared by the
        evictors of one prefill (each signal is computed once). restore_logits: after a lookahead, decode
        the last prompt token again so that the context's logits are the prompt's (for sampling)."""
        ctx, page = self.ctx, self.ctx.page
        cache = {} if cache is None else cache
        out: dict = {}
        if "last_query" in needs:
            if "last_query" not in cache:
                ctx.seq_rm(seq, last_pos, last_pos + 1)
                page.arm_probe(seq, TOP_K)
                ctx.decode([last_tok], last_pos, seq)
                cache["last_query"] = page.read_probe()
            out["last_query"] = cache["last_query"]
        if "key_norms" in needs:  # f32 (n_layer, n_head_kv, T), columns aligned with pre.held
            if "key_norms" not in cache:
                cache["key_norms"] = page.key_norms(seq, self.model.n_layer, self.model.n_head_kv)
            out["key_norms"] = cache["key_norms"]
        if "prefill_attention" in needs and pre.prefill_attention is not None:
            out["prefill_attention"] = align(pre.prefill_attention, pre.probe, pre.held)
        if "spans" in needs:
            out["spans"] = self.sentences(pre.held)
        if "lookahead" in needs:  # LORE-KV: sampled futures score the prompt, then are removed
            key = ("lookahead", spec)
            if key not in cache:
                cache[key] = self.lookahead(pre.logits, spec, seq)
                if restore_logits:
                    ctx.seq_rm(seq, last_pos, last_pos + 1)
                    ctx.decode([last_tok], last_pos, seq)
            out["lookahead"] = cache[key]
        return out

    def sentences(self, held: np.ndarray) -> np.ndarray:
        """The sentence of each held position (the "spans" signal; cut over the whole conversation's text)."""
        if self.spans is None:
            raise ValueError("this evictor keeps whole sentences, and nothing told the pipeline where they are")
        return self.spans(held)

    def lookahead(self, last_logits: np.ndarray, spec, seq: int = 0):
        """LORE-KV's lookahead (engine/lookahead.py) on seq, whose newest token produced last_logits; the
        futures are gone afterwards (the context's logits are theirs: see signals(restore_logits))."""
        from page_local.engine.lookahead import run_lookahead

        return run_lookahead(self.ctx, seq, last_logits, spec, self._proj(spec.projection), self.model.is_eog)

    def answer_lookahead(self, spec, answer: Sequence[int], last_pos: int, seq: int = 0, work: int = 1):
        """The prompt of seq (positions <= last_pos) scored by the queries of `answer`, the full cache's own
        continuation (engine/lookahead.py score_answer); sequence `work` is used and emptied."""
        from page_local.engine.lookahead import score_answer

        return score_answer(self.ctx, seq, last_pos, answer, self._proj(spec.projection), work)

    def _proj(self, projection: str) -> np.ndarray:
        if projection not in self._out_proj:
            from page_local.engine.outproj import context_out_proj_factors

            m = self.model
            self._out_proj[projection] = context_out_proj_factors(
                self.ctx, m.n_layer, m.n_head, m.n_embd, projection, path=m.path)
        return self._out_proj[projection]

    @staticmethod
    def select(evictor, pre: Prefilled, B: int, signals: dict, seed: int) -> np.ndarray:
        """The evictor's keep set (i32 positions, a subset of pre.held with B entries)."""
        inp = EvictionInput(held=pre.held, budget=B, window=pre.probe.queries, n_sink=N_SINK, probe=pre.probe,
                            seed=seed, **signals)
        return evictor.select(inp)

    # --- eviction ----------------------------------------------------------------------------------
    def evict_in_place(self, seq: int, keep: np.ndarray, held: np.ndarray, last_pos: int, last_tok: int,
                       compact: bool = True, park: int | None = None, gap: int = 0) -> float:
        """Evict held \\ keep from seq and decode its last prompt token again, so that the next sampled
        token already sees the compressed cache. compact: move the cells down first (llama.cpp attends
        over every cell up to the highest used one: holes would decode as slowly as the full cache).
        park: park them under that sequence instead (they stay in memory, out of the attended range, with
        `gap` free cells after the held ones for the answer). Returns the compaction's (or parking's)
        milliseconds."""
        ctx = self.ctx
        drop = np.setdiff1d(held, keep, assume_unique=True)
        drop = drop[drop != last_pos]
        ctx.seq_rm(seq, last_pos, last_pos + 1)
        c0 = time.perf_counter()
        if park is not None:
            ctx.page.park(seq, park, drop, gap)
        else:
            ctx.page.evict(seq, drop)
            c0 = time.perf_counter()
            if compact:
                ctx.page.compact(seq)
        compact_ms = (time.perf_counter() - c0) * 1e3
        ctx.decode([last_tok], last_pos, seq)
        return compact_ms

    def candidate(self, keep: np.ndarray, held: np.ndarray, last_pos: int, tokens: Sequence[int],
                  src: int = 0, dst: int = 1, logits: str = "last") -> tuple[int, list[np.ndarray]]:
        """Build the evicted candidate in dst without touching src (evicted_copy); then tokens (the last
        prompt token first) are decoded at last_pos... Returns (positions dropped, the decoded tokens'
        logits when logits="all"). The caller removes dst afterwards."""
        dropped = self.evicted_copy(keep, held, last_pos, src, dst)
        return dropped, self.decode(tokens, last_pos, dst, logits=logits)

    def evicted_copy(self, keep: np.ndarray, held: np.ndarray, last_pos: int, src: int, dst: int) -> int:
        """dst = src's positions below last_pos (cells shared), minus those not in keep. Returns how many
        positions were dropped."""
        self.ctx.seq_cp(src, dst, -1, last_pos)  # the prompt minus its last token, cells shared
        drop = np.setdiff1d(held[held < last_pos], keep, assume_unique=True)
        if drop.size:
            self.ctx.page.evict(dst, drop)
        return int(drop.size)

    def check_ladder(self, keeps: Sequence[np.ndarray], held: np.ndarray, last_pos: int, tokens: Sequence[int],
                     full_logits: Sequence[np.ndarray], targets: Sequence[int], rule: str = VERIFY_RULE,
                     threshold: float | None = None, src: int = 0, first_chunk: int = FIRST_CHUNK,
                     batch_first: bool = True) -> tuple[int | None, list, int]:
        """Self-verification over candidates, smallest first (keeps[i]: candidate i's keep set, built by
        evicted_copy). tokens (the last prompt token, then the answer) are decoded on a candidate in chunks
        of first_chunk, twice that, four times...; after each chunk its new positions are scored (the
        candidate's log p of targets[j] and whether its top token differs from the full cache's, whose
        logits there are full_logits[j], as verify_span does) and the rule decides over the positions so
        far. The rules are monotone in the span, so a candidate that fails a prefix fails the whole: it
        stops there and is removed. The first candidate that passes every position is left in sequence 1.

        batch_first (with more than one candidate): every candidate's first chunk is decoded in one batch,
        candidate i in sequence 1 + i (most failing rungs fail there, and on CPU one decode of 4 x 4
        tokens costs what two of 4 do: docs/results.md, "What a forced token costs"); then the candidates
        that passed it go on one at a time, smallest first. The full cache's log-probs are computed only
        as far as a candidate gets. Returns (the index of the first candidate that passes or None, per
        candidate None (not tried further: a smaller one passed) or a Checked, the tokens decoded)."""
        ctx, k, is_eog = self.ctx, len(targets), self.model.is_eog
        lp_full: list[float] = []
        top_full: list[int] = []
        ends = chunk_ends(len(tokens), first_chunk)
        R = len(keeps)
        batch_first = batch_first and R > 1 and R * ends[0] <= ctx.n_batch and R < ctx.n_seq_max
        cands = [_Checking() for _ in keeps]

        def score(c: "_Checking", outs, s: int, e: int) -> None:
            for j in range(len(lp_full), min(e, k)):  # the full cache's side, once per position
                lp_full.append(logp(full_logits[j], targets[j]))
                top_full.append(top_token(full_logits[j], is_eog))
            for j, lg in enumerate(outs, start=s):
                if j < k:  # a position of the span (the last output is the next token's)
                    c.lp.append(logp(lg, targets[j]))
                    c.changed.append(top_token(lg, is_eog) != top_full[j])
                if j == 0:
                    c.first = lg
            c.s = e
            n = len(c.lp)
            c.v = verify_score(np.asarray(lp_full[:n]), np.asarray(c.lp), np.asarray(c.changed, dtype=bool),
                               rule=rule, threshold=threshold)

        decoded = 0
        seqs = [1 + i if batch_first else 1 for i in range(R)]
        if batch_first:
            e0 = ends[0]
            for i, keep in enumerate(keeps):
                self.evicted_copy(keep, held, last_pos, src, seqs[i])
            ctx.decode_step([t for _ in keeps for t in tokens[:e0]], [last_pos + j for _ in keeps for j in range(e0)],
                            [q for q in seqs for _ in range(e0)])
            for i, c in enumerate(cands):
                score(c, [ctx.logits(i * e0 + j) for j in range(e0)], 0, e0)
            decoded = R * e0
        tried: list = [None] * R
        for i, keep in enumerate(keeps):
            c, seq = cands[i], seqs[i]
            if not batch_first:
                self.evicted_copy(keep, held, last_pos, src, seq)
            for e in ends:
                if e <= c.s:
                    continue
                if c.v is not None and not c.v.passed:
                    break
                decoded += e - c.s
                score(c, self.decode(list(tokens[c.s:e]), last_pos + c.s, seq, logits="all"), c.s, e)
            tried[i] = Checked(c.v, np.asarray(c.lp), np.asarray(c.changed, dtype=bool), c.first, c.s)
            if c.v.passed:
                for q in seqs[i + 1:] if batch_first else ():  # the larger candidates' first chunks
                    ctx.seq_rm(q, -1, -1)
                if seq != 1:  # the chosen candidate becomes sequence 1 (the smaller ones are gone)
                    ctx.seq_cp(seq, 1)
                    ctx.seq_rm(seq, -1, -1)
                return i, tried, decoded
            ctx.seq_rm(seq, -1, -1)
        return None, tried, decoded

    def decode(self, tokens: Sequence[int], pos: int, seq: int, logits: str = "last") -> list[np.ndarray]:
        """Decode tokens at pos.. in seq in chunks of n_batch; with logits="all", every token's output
        logits (f32 (n_vocab,) each), else []."""
        ctx, out = self.ctx, []
        for s in range(0, len(tokens), ctx.n_batch):
            chunk = list(tokens[s: s + ctx.n_batch])
            ctx.decode(chunk, pos + s, seq, logits=logits)
            if logits == "all":
                out.extend(ctx.logits(i) for i in range(len(chunk)))
        return out

    # --- outputs of a cache ----------------------------------------------------------------------------
    def teacher_force(self, first_logits: np.ndarray, targets: Sequence[int], pos: int, seq: int) -> np.ndarray:
        """f64 log p of each target: the first from first_logits, the rest from one batch of targets[:-1]
        decoded at pos... The decoded tokens stay in seq (the caller removes them)."""
        lp = [logp(first_logits, targets[0])]
        if len(targets) > 1:
            outs = self.decode(targets[:-1], pos, seq, logits="all")
            lp += [logp(lg, t) for lg, t in zip(outs, targets[1:])]
        return np.asarray(lp, dtype=np.float64)

    def greedy(self, first_logits: np.ndarray, pos: int, seq: int, max_new: int,
               want_logp: bool = False) -> tuple[list[int], list[float], str, int | None]:
        """Greedy generation from first_logits; tokens are decoded at pos.. in seq.

        Returns (tokens without the end-of-generation token, log p of each of them, finish, the
        end-of-generation token or None); with want_logp and finish "stop", lps has one more entry: the
        end-of-generation token's."""
        ctx, model = self.ctx, self.model
        out: list[int] = []
        lps: list[float] = []
        logits = first_logits
        for _ in range(max_new):
            tok = int(np.argmax(logits))
            if model.is_eog(tok):
                if want_logp:
                    lps.append(logp(logits, tok))
                return out, lps, "stop", tok
            out.append(tok)
            if want_logp:
                lps.append(logp(logits, tok))
            if len(out) == max_new:
                break
            ctx.decode([tok], pos, seq)
            pos += 1
            logits = ctx.logits()
        return out, lps, "length", None

    def verify_span(self, lp_full: Sequence[float], ev_logits: Sequence[np.ndarray], targets: Sequence[int],
                    top_full: Sequence[int], rule: str = VERIFY_RULE, threshold: float | None = None):
        """Self-verification's score of one candidate (verify.verify_score). Per checked position i:
        lp_full[i] = log p_full(targets[i]); ev_logits[i] the candidate's logits there; top_full[i] the full
        cache's top token (verify.top_token: -1 for any end of generation). Returns (VerifyScore,
        f64 (k,) candidate log-probs, bool (k,) changed)."""
        lp_ev = np.asarray([logp(lg, t) for lg, t in zip(ev_logits, targets)], dtype=np.float64)
        changed = np.array([top_token(lg, self.model.is_eog) != t for lg, t in zip(ev_logits, top_full)], dtype=bool)
        v = verify_score(np.asarray(lp_full, dtype=np.float64), lp_ev, changed, rule=rule, threshold=threshold)
        return v, lp_ev, changed


@dataclass
class _Checking:
    """A candidate while check_ladder decodes it: its log-probs and changed top tokens so far, its first
    output's logits, where its next chunk starts, and the verdict over what it decoded."""

    lp: list = field(default_factory=list)
    changed: list = field(default_factory=list)
    first: np.ndarray | None = None
    s: int = 0
    v: object = None


@dataclass
class Checked:
    """One candidate's check (Pipeline.check_ladder): the verdict over the positions it decoded, their
    log-probs and changed top tokens, its first output's logits, and the tokens it decoded."""

    score: object  # verify.VerifyScore
    lp: np.ndarray  # f64 (j,)
    changed: np.ndarray  # bool (j,)
    first_logits: np.ndarray  # f32 (n_vocab,)
    forced: int


def chunk_ends(n: int, first: int = FIRST_CHUNK) -> list[int]:
    """Where the check's chunks of n forced tokens end: first, 3 first, 7 first, ... (each chunk twice the
    last), then n."""
    ends, size, e = [], first, 0
    while e < n:
        e = min(n, e + size)
        ends.append(e)
        size *= 2
    return ends


def forced_tokens(n: int, first_failed: int | None, first: int = FIRST_CHUNK) -> int:
    """Tokens check_ladder decodes on a candidate of n forced tokens whose first failing position (0-based,
    None: none) is first_failed: up to the end of the chunk that holds it."""
    if first_failed is None:
        return n
    return next(e for e in chunk_ends(n, first) if e > first_failed)


def search_tokens(n: int, first_failed: Sequence[int | None], first: int = FIRST_CHUNK) -> int:
    """Tokens check_ladder decodes over a ladder of candidates (smallest first) with n forced tokens each,
    whose first failing positions are first_failed (None: passes): with more than one, every first chunk
    in one batch, then each candidate up to the first that passes from its second chunk on."""
    if len(first_failed) == 1:
        return forced_tokens(n, first_failed[0], first)
    upto = next((i + 1 for i, f in enumerate(first_failed) if f is None), len(first_failed))
    e0 = chunk_ends(n, first)[0]
    return sum(forced_tokens(n, f, first) for f in first_failed[:upto]) + e0 * (len(first_failed) - upto)


def drop(probe: ProbeResult) -> tuple[float | None, list[float]]:
    """PAGE's D and the per-layer head agreement (signal.py); (None, []) with fewer than 2 heads."""
    if probe.n_head < 2:
        return None, []
    from page_local.signal import compute_signal

    sig = compute_signal(probe)
    return float(sig.D), [float(a) for a in sig.agreement]


def align(prefill: tuple[np.ndarray, np.ndarray], probe: ProbeResult, held: np.ndarray) -> np.ndarray:
    """H2O scores aligned with `held`: prefill column sums plus the window's own (probe) mass."""
    pos, sums = prefill
    out = np.zeros((sums.shape[0], held.size), dtype=np.float32)
    idx = np.searchsorted(held, pos)
    ok = (idx < held.size) & (held[np.minimum(idx, held.size - 1)] == pos)
    out[:, idx[ok]] += sums[:, ok]
    j = np.searchsorted(held, probe.positions)
    okp = (j < held.size) & (held[np.minimum(j, held.size - 1)] == probe.positions)
    out[:, j[okp]] += probe.mean[:, okp] * probe.n_query
    return out

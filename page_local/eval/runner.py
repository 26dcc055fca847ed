"""The evaluation runner: every evictor x budget x gate configuration of every sample, from ONE prefill.

Per sample (docs/design.md §9, "Evaluation in brief"; docs/algorithms.md §6.8):
  1. the prompt is the model's own chat template (GGUF metadata, llama-cpp-python's Jinja2 chat
     formatter): user = context + "\\n\\n" + question, and the task's answer prefix opens the
     assistant turn (otherwise small models restate the question);
  2. prefill once in sequence 0 (all but the last W = 32 tokens, then the last 32 with the probe
     armed, as the engine does); D and, with a calibration profile, z (gate.Gate.for_model);
  3. sequence 0 is never modified afterwards: every candidate cache is built in sequence 1, which
     shares sequence 0's cells (llama_memory_seq_cp), and is removed after use:
     * full cache: seq 1 = seq 0; the first token comes from the prefill's logits (exactly
       Engine(gate="never"));
     * evictor x budget: seq 1 = seq 0 minus the last prompt token; the complement of the
       evictor's keep set is evicted from seq 1 only; the last prompt token is decoded again at its
       position (llama.cpp accepts a batch only at the sequence's highest position + 1);
  4. on each candidate cache: the teacher-forced NLL of the first reference answer (" " + answer,
     appended after the prompt; total nats over its tokens), greedy generation up to the task's
     max_new_tokens (stop at end-of-generation), and, for evicted candidates, self-verification as
     the engine does it (turn.Pipeline.verify_span): the FULL cache's answer up to its end (its end-of-generation included)
     or the cap m (verify.VERIFY_CAP) is teacher-forced on the evicted cache in one batch, and
     verify.verify_score decides from the per-token losses log p_full - log p_evicted and the
     positions whose top token changed (both stored per row: verify_loss, verify_changed);
  5. gate configurations are then read off the candidates (greedy decoding is deterministic):
     always = the plain evictor; page = evicted iff PAGE's gate opens; verify = evicted iff the
     check passes (verify.VERIFY_RULE, the engine's default), and then the answer is the checked
     full-cache tokens followed, past the cap, by the evicted cache's continuation, as
     Engine(gate="verify") streams it; page+verify = both.

Rows (JSONL, one per (sample, configuration)) carry the candidate's own outcome next to the
configuration's (`*_candidate`, `*_committed`, `delta_self`, `D`), so any PAGE or verify threshold
can be evaluated post hoc (metrics.py; verify rules from verify_loss / verify_changed with
verify.verify_score). The run is resumable: rows already in the output file are
skipped, keyed by (model, source, task, index, length target, seed, query_agnostic, verify_m,
evictor, budget, gate).

Query-agnostic mode (query_agnostic=True): the probe window is the last 32 tokens of the context,
the keep set is chosen before the question is seen, and the question + answer prefix are decoded
after the eviction, on each candidate.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from page_local.tasks import scoring
from page_local.chat.prompts import ChatPrompter, Prompt
from page_local.engine.turn import AFTER_ANSWER, N_SINK, W, forced_tokens, search_tokens, supported
from page_local.eval.rows import FULL, KEY_FIELDS, _jkey, read_rows, row_key
from page_local.evictors.base import resolve_budget
from page_local.gate import BASE_MODE, GATE_MODES, SEARCH_MODES, VERIFY_MODES
from page_local.verify import RULES, VERIFY_CAP, VERIFY_RULE, kl
from page_local.tasks.readers import read_samples
from page_local.tasks.synthetic import Sample, generate, get_task

EVAL_GATES = tuple(g for g in GATE_MODES if g != "never")  # "never" is the full-cache row, always evaluated
DEFAULT_BUDGETS = (0.5, 0.25, 0.125, 0.0625)
CTX_MARGIN = 64

Progress = Callable[[int, int], None]


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 2)


# --- the per-sample evaluation ---------------------------------------------------------------

@dataclass
class Candidate:
    """The outcomes on one cache (full, or one evictor x budget)."""

    evicted: bool
    kept: int
    B: int | None = None
    nll: float | None = None
    tokens: list[int] = field(default_factory=list)
    finish: str = ""
    delta_self: float | None = None  # mean per-token loss over the checked span
    verify_m: int | None = None  # answer tokens checked
    verify_open: bool | None = None  # the check passed (verify.VERIFY_RULE)
    verify_score: float | None = None
    verify_end: bool | None = None  # the answer's end was checked too
    verify_loss: list[float] | None = None  # per checked position, log p_full - log p_evicted
    verify_changed: list[int] | None = None  # checked positions whose top token differs
    verify_top1: float | None = None
    verify_kl_first: float | None = None
    committed: list[int] | None = None  # verify's answer if it commits (full-cache m tokens + continuation)
    timings: dict = field(default_factory=dict)


class _Run:
    def __init__(self, eng, page_gate, evictors: dict, budgets: Sequence, gates: Sequence[str],
                 verify_m: int, seed: int):
        self.eng, self.ctx, self.model = eng, eng.ctx, eng.model
        self.pipe = eng.pipeline  # the engine's own turn steps (engine/turn.py)
        self.page_gate = page_gate
        self.evictors, self.budgets, self.gates = evictors, list(budgets), list(gates)
        self.ladder_key = _jkey(self.budgets)  # the search gates' "budget": the run's budgets are the ladder
        self.verify_m, self.seed = verify_m, seed
        self.need_commit = any(g in VERIFY_MODES for g in gates)
        self.last_full: Candidate | None = None  # the last sample's full-cache outcome (tests, debugging)

    def sample(self, p: Prompt, wanted: set) -> list[dict]:
        """The rows of one sample for the wanted (evictor, JSON budget, gate) configurations; the full
        cache is (None, None, "full"). The random evictor's seed is seed + sample index."""
        eng, ctx, pipe = self.eng, self.ctx, self.pipe
        t_sample = time.perf_counter()
        eng.reset()
        toks, s = p.tokens, p.split
        needs = set().union(*(e.needs for e in self.evictors.values())) if self.evictors else set()
        t0 = time.perf_counter()
        pre = pipe.prefill(toks[:s], 0, 0, track_attention="prefill_attention" in needs)
        logits0 = pre.logits  # the next-token logits after the compressible part
        prefill_ms = _ms(t0)
        t0 = time.perf_counter()
        D, agreement = pre.D, [round(a, 6) for a in pre.agreement]
        g = self.page_gate.decide(D) if D is not None else None
        page_open = bool(g.open) if g else False
        z = None if g is None or g.z is None else float(g.z)
        T = pre.T
        gate_ms = _ms(t0)
        suffix = toks[s:]
        try:
            full = self.last_full = self._full(p, logits0, suffix)
            cands: dict[tuple, Candidate] = {}
            cache: dict = {}  # evictor signals, computed once per sample
            for ename, ev in self.evictors.items():
                for b in self.budgets:
                    if not (any((ename, _jkey(b), gname) in wanted for gname in self.gates)
                            or any((ename, self.ladder_key, gname) in wanted for gname in SEARCH_MODES)):
                        continue
                    B = resolve_budget(b, T, W, N_SINK)
                    if T <= B:
                        c = Candidate(evicted=False, kept=T, B=B, nll=full.nll, tokens=full.tokens,
                                      finish=full.finish, delta_self=0.0, verify_m=0, verify_top1=1.0,
                                      verify_kl_first=0.0, committed=full.tokens, verify_open=True,
                                      verify_score=0.0, verify_end=False, verify_loss=[], verify_changed=[])
                        cands[(ename, _jkey(b))] = c
                        continue
                    # after the full-cache candidate: the signals may re-decode seq 0's last token
                    signals = pipe.signals(ev.needs, pre, s - 1, toks[s - 1], spec=getattr(ev, "spec", None),
                                           cache=cache)
                    if ev.needs & AFTER_ANSWER:  # scored by what the check forces: the full cache's answer
                        if ("answer", ename) not in cache:
                            cont = list(suffix) + list(full.tokens[: self.verify_m])
                            cont = cont or [int(np.argmax(self.full_first))]  # it ends at once: its first choice
                            cache[("answer", ename)] = pipe.answer_lookahead(ev.spec, cont, s - 1, seq=0, work=1)
                        signals = dict(signals, answer_lookahead=cache[("answer", ename)])
                    t0 = time.perf_counter()
                    keep = pipe.select(ev, pre, B, signals, self.seed + p.sample.index)
                    select_ms = _ms(t0)
                    c = self._evicted(p, keep, pre.held, full)
                    c.B = B
                    c.timings["select_ms"] = select_ms
                    for key in ("lookahead", "answer_lookahead"):  # one-time per sample, shared by every budget
                        if key in signals:
                            c.timings["lookahead_ms"] = round(signals[key].ms, 3)
                    cands[(ename, _jkey(b))] = c
        finally:
            ctx.seq_rm(1, -1, -1)
        sample_s = time.perf_counter() - t_sample
        return self._rows(p, T, D, z, page_open, g, agreement, full, cands, wanted,
                          dict(prefill_ms=prefill_ms, gate_ms=gate_ms, sample_s=round(sample_s, 3)))

    def _full(self, p: Prompt, logits0: np.ndarray, suffix: list[int]) -> Candidate:
        ctx = self.ctx
        c = Candidate(evicted=False, kept=p.split)
        t0 = time.perf_counter()
        ctx.seq_cp(0, 1)
        first = logits0
        if suffix:  # query-agnostic: the question and answer prefix follow the (full) context
            ctx.decode(suffix, p.split, 1)
            first = ctx.logits()
        c.timings["evict_ms"] = _ms(t0)
        self._outcomes(c, p, first, want_logp=True)
        self.full_first = first
        ctx.seq_rm(1, -1, -1)
        return c

    def _evicted(self, p: Prompt, keep: np.ndarray, held: np.ndarray, full: Candidate) -> Candidate:
        """Candidate on seq 1 = seq 0 minus the complement of keep; last probed token re-decoded."""
        s, toks = p.split, p.tokens
        t0 = time.perf_counter()
        dropped, _ = self.pipe.candidate(keep, held, s - 1, toks[s - 1:], src=0, dst=1)
        first = self.ctx.logits()
        c = Candidate(evicted=dropped > 0, kept=int(np.isin(held, keep).sum()))
        c.timings["evict_ms"] = _ms(t0)
        self._outcomes(c, p, first, want_logp=False)
        self._verify(c, p, full, first)
        self.ctx.seq_rm(1, -1, -1)
        return c

    def _outcomes(self, c: Candidate, p: Prompt, first: np.ndarray, want_logp: bool) -> None:
        """NLL of the reference and the greedy answer on the candidate held in seq 1 (up to p.n - 1)."""
        ctx, n = self.ctx, p.n
        t0 = time.perf_counter()
        c.nll = float(-self.pipe.teacher_force(first, p.reference, n, 1).sum())
        ctx.seq_rm(1, n, -1)
        c.timings["nll_ms"] = _ms(t0)
        t0 = time.perf_counter()
        c.tokens, lps, c.finish, eog = self.pipe.greedy(first, n, 1, p.sample.max_new_tokens, want_logp)
        ctx.seq_rm(1, n, -1)
        c.timings["gen_ms"] = _ms(t0)
        c.timings["gen_tokens"] = len(c.tokens)
        if want_logp:
            self.full_logp, self.full_eog = lps, eog

    def _verify(self, c: Candidate, p: Prompt, full: Candidate, first: np.ndarray) -> None:
        """Self-verification of the candidate, as the engine does it (Pipeline.verify_span): the full cache's answer up to its
        end or the cap m, teacher-forced on the candidate in one batch, scored by Pipeline.verify_span;
        and (when a verify gate is evaluated) the answer Engine(gate="verify") gives if it commits."""
        ctx, n, m = self.ctx, p.n, self.verify_m
        y = full.tokens[:m]
        k = len(y)
        if k == 0:  # the full cache ends the answer at once: nothing to verify (the engine keeps it)
            c.committed = list(full.tokens)
            return
        t0 = time.perf_counter()
        # the answer ended inside the span: its end-of-generation is one more checked position
        end = full.finish == "stop" and len(full.tokens) < m
        lp_full = np.asarray(self.full_logp[: k + int(end)], dtype=np.float64)
        outs = self.pipe.decode(y, n, 1, logits="all")  # outs[i] = distribution after y[:i+1]
        ev_logits = [first] + outs[: k - 1] + ([outs[k - 1]] if end else [])
        y_pos = list(y) + ([self.full_eog] if end else [])
        top_full = list(y) + ([-1] if end else [])  # greedy: the full cache's token is its top token
        v, lp_ev, changed = self.pipe.verify_span(lp_full, ev_logits, y_pos, top_full, VERIFY_RULE)
        c.delta_self, c.verify_score, c.verify_open = v.mean, v.score, v.passed
        c.verify_m, c.verify_end = k, bool(end)
        c.verify_loss = [round(float(x), 6) for x in lp_full - lp_ev]
        c.verify_changed = [int(i) for i in np.flatnonzero(changed)]
        c.verify_top1 = float(1.0 - changed.mean())
        c.verify_kl_first = kl(self.full_first, first)
        if self.need_commit:
            rest = p.sample.max_new_tokens - k
            if k < m or rest <= 0:  # the whole answer was checked: the committed answer is the full cache's
                c.committed = list(full.tokens)
            elif c.tokens[:m] == y:  # the evicted cache itself produced y: its continuation is the same
                c.committed = list(c.tokens)
            else:
                more = self.pipe.greedy(outs[k - 1], n + k, 1, rest)[0]
                c.committed = list(y) + more
        ctx.seq_rm(1, n, -1)
        c.timings["verify_ms"] = _ms(t0)

    def _rows(self, p, T, D, z, page_open, g, agreement, full: Candidate, cands, wanted, shared) -> list[dict]:
        sample = p.sample
        det = self.model.detokenize
        full_pred = det(full.tokens)
        full_score = scoring.score(sample, full_pred)
        full_correct = full_score == 1.0
        base = dict(task=sample.task, index=sample.index, length=sample.length, n_prompt=p.n, T=T,
                    D=D, z=z, page_open=page_open, rule=g.rule if g else "none",
                    nll_full=full.nll, score_full=full_score, correct_full=full_correct,
                    n_answer_tokens=len(p.reference))
        rows = []
        if (None, None, FULL) in wanted:
            rows.append(dict(base, evictor=None, budget=None, gate=FULL, B=None, open=False, evicted=False,
                             kept=T, compression=1.0, prediction=full_pred, finish=full.finish,
                             score=full_score, correct=full_correct, nll_evicted=full.nll, delta_nll=0.0,
                             delta_self=None, verify_open=None, verify_tokens=None, verify_top1=None,
                             verify_rule=None, verify_score=None, verify_threshold=None, verify_end=None,
                             verify_loss=None, verify_changed=None,
                             verify_kl_first=None, nll_candidate=None, delta_nll_candidate=None,
                             score_candidate=None, correct_candidate=None, score_committed=None,
                             correct_committed=None,
                             timings=dict(shared, **full.timings)))
        for (ename, bkey), c in cands.items():
            budget = json.loads(bkey)
            plain_pred = det(c.tokens)
            plain_score = scoring.score(sample, plain_pred)
            com_pred = det(c.committed) if c.committed is not None else None
            com_score = scoring.score(sample, com_pred) if com_pred is not None else None
            verify_open = bool(c.verify_open)  # False when nothing was checked (the engine keeps the full cache)
            can_evict = c.evicted
            for gname in self.gates:
                if (ename, bkey, gname) not in wanted:
                    continue
                if gname == "always":
                    is_open, pred, sc, fin = True, plain_pred, plain_score, c.finish
                else:
                    is_open = {"page": page_open, "verify": verify_open,
                               "page+verify": page_open and verify_open}[gname]
                    use = is_open and can_evict
                    if gname == "page":
                        pred, sc, fin = (plain_pred, plain_score, c.finish) if use else (full_pred, full_score, full.finish)
                    else:
                        pred, sc, fin = (com_pred, com_score, "") if use else (full_pred, full_score, full.finish)
                applied = is_open and can_evict
                kept = c.kept if applied else T
                nll_ev = c.nll if applied else full.nll
                timings = dict(shared, **c.timings)
                rows.append(dict(
                    base, evictor=ename, budget=budget, gate=gname, B=c.B, open=bool(is_open), evicted=applied,
                    kept=kept, compression=T / kept if kept else 1.0, prediction=pred, finish=fin,
                    score=sc, correct=sc == 1.0, nll_evicted=nll_ev, delta_nll=nll_ev - full.nll,
                    delta_self=c.delta_self, verify_open=verify_open, verify_tokens=c.verify_m,
                    verify_rule=VERIFY_RULE, verify_score=c.verify_score, verify_threshold=RULES[VERIFY_RULE][1],
                    verify_end=c.verify_end, verify_loss=c.verify_loss, verify_changed=c.verify_changed,
                    verify_forced=_forced(c),
                    verify_top1=c.verify_top1, verify_kl_first=c.verify_kl_first,
                    nll_candidate=c.nll, delta_nll_candidate=c.nll - full.nll,
                    score_candidate=plain_score, correct_candidate=plain_score == 1.0,
                    score_committed=com_score, correct_committed=None if com_score is None else com_score == 1.0,
                    timings=timings))
        rows += self._search_rows(p, T, page_open, base, full, full_pred, full_score, cands, wanted, shared)
        if agreement and rows and rows[0]["gate"] == FULL:
            rows[0]["agreement"] = agreement  # per-layer head agreement, on the full-cache row
        return rows

    def _search_rows(self, p, T, page_open, base, full, full_pred, full_score, cands, wanted, shared) -> list[dict]:
        """Gate "search" (and "page+search") read off the per-budget candidates, as the engine decides it:
        the run's budgets are the ladder; the smallest budget whose check passes is committed, and the
        answer is that candidate's verified answer; none passes: the full cache. Greedy decoding and one
        full-cache answer make every rung's check the one its own verify row records."""
        rows = []
        det = self.model.detokenize
        for ename in self.evictors:
            for gname in SEARCH_MODES:
                if (ename, self.ladder_key, gname) not in wanted:
                    continue
                rungs = sorted((c.B, b, c) for b in self.budgets if (c := cands.get((ename, _jkey(b)))) is not None)
                rungs = [r for r in rungs if r[2].evicted] or rungs[-1:]  # as the engine: rungs below T only
                tried = [dict(B=B, budget=b, passed=bool(c.verify_open)) for B, b, c in rungs]
                allowed = page_open or gname == "search"
                chosen = next((r for r in rungs if r[2].verify_open and r[2].evicted), None) if allowed else None
                # the engine checks every rung's first chunk in one batch, then the rungs smallest first,
                # and stops at the first that passes
                checked = [c for _, _, c in rungs if _forced(c) is not None]
                forced = search_tokens(checked[0].verify_m + 1, [c.verify_changed[0] if c.verify_changed else None
                                                                 for c in checked]) if allowed and checked else 0
                if chosen is not None:
                    B, b, c = chosen
                    pred = det(c.committed) if c.committed is not None else full_pred
                    sc = scoring.score(p.sample, pred)
                    kept, nll_ev = c.kept, c.nll
                else:
                    B, c, pred, sc, kept, nll_ev = None, None, full_pred, full_score, T, full.nll
                rows.append(dict(
                    base, evictor=ename, budget=list(self.budgets), gate=gname, B=B, open=chosen is not None,
                    evicted=chosen is not None, kept=kept, compression=T / kept if kept else 1.0, prediction=pred,
                    finish="" if chosen is not None else full.finish, score=sc, correct=sc == 1.0,
                    nll_evicted=nll_ev, delta_nll=nll_ev - full.nll, search=tried if allowed else [],
                    search_forced=forced,
                    delta_self=None if c is None else c.delta_self, verify_open=chosen is not None,
                    verify_tokens=None if c is None else c.verify_m, verify_rule=VERIFY_RULE,
                    verify_score=None if c is None else c.verify_score, verify_threshold=RULES[VERIFY_RULE][1],
                    timings=dict(shared)))
        return rows


# --- the public entry point ----------------------------------------------------------------------

def _forced(c: Candidate) -> int | None:
    """Tokens the engine decodes on this candidate to check it (Pipeline.check_ladder: the last prompt token
    and the m answer tokens, in growing chunks that stop at the first changed top token); None: no check."""
    if not c.evicted or not c.verify_m:
        return None
    return forced_tokens(c.verify_m + 1, c.verify_changed[0] if c.verify_changed else None)


def _check_budgets(budgets) -> list:
    from page_local.evictors.base import resolve_budget

    out = []
    for b in budgets:
        resolve_budget(b, 10_000)  # ValueError says what is wrong
        out.append(b)
    if not out:
        raise ValueError("give at least one budget")
    return out


def _round_ctx(n: int) -> int:
    return (n + 255) // 256 * 256


def load_samples(prompter: ChatPrompter | None, tasks: Sequence[str] | None, n: int | None, length: int | None,
                 seed: int, input: str | os.PathLike | None) -> list[Sample]:
    """Generated samples (tasks x n at `length` tokens) or the samples of a RULER/kvpress file
    (optionally only `tasks`, at most n per task)."""
    if input is not None:
        samples = read_samples(input)
        if tasks:
            want = set(tasks)
            samples = [s for s in samples if s.task in want]
        if n is not None:
            per: dict[str, int] = {}
            keep = []
            for s in samples:
                if per.get(s.task, 0) < n:
                    keep.append(s)
                    per[s.task] = per.get(s.task, 0) + 1
            samples = keep
        return samples
    if not tasks:
        raise ValueError("give at least one task")
    for t in tasks:
        spec = get_task(t)
        if not spec.labeled:
            raise ValueError(f"task {t!r} is unlabeled (a calibration pilot); it cannot be evaluated")
    if n is None or length is None:
        raise ValueError("generated tasks need n and length")
    # the template's fixed overhead comes off the target, so that prompt + answer budget <= length
    target = length - prompter.overhead
    return [s for t in tasks for s in generate(t, n, target, prompter.count_tokens, seed)]


def _check_same_rule(existing: list[dict], model_id: str, page_gate, out: Path) -> None:
    """Refuse to resume a results file whose PAGE rows were decided under another rule: a profile
    stored (or changed, or removed) since would silently mix raw and calibrated decisions."""
    from page_local.store.profiles import profile_path

    prof = page_gate.profile
    for r in existing:
        if r.get("model") != model_id or r.get("rule") not in ("raw", "calibrated") or r.get("D") is None:
            continue
        if prof is None and r["rule"] == "calibrated":
            why = "under a calibration profile that is no longer stored"
        elif prof is not None and r["rule"] == "raw":
            why = f"with the raw threshold, before the calibration profile {profile_path(model_id)} was stored"
        elif prof is not None and r.get("z") is not None and not math.isclose(
                page_gate.decide(float(r["D"])).z, float(r["z"]), rel_tol=1e-6, abs_tol=1e-9):
            why = f"under another calibration profile than {profile_path(model_id)}"
        else:
            continue
        raise ValueError(f"{out} holds PAGE decisions made {why}; resuming would mix two gate rules. "
                         "Write to another --out file (or restore the profile the file was made with).")


def run_eval(model=None, tasks: Sequence[str] | None = None, n: int | None = 10, length: int | None = 2048,
             budgets: Sequence = DEFAULT_BUDGETS, evictors: Sequence[str] = ("snapkv",),
             gates: Sequence[str] = ("always", "page"), out: str | os.PathLike = "results/eval.jsonl",
             seed: int = 42, threads: int = 2, n_ctx: int | None = None, query_agnostic: bool = False,
             verify_m: int = VERIFY_CAP, progress: Progress | None = None, input: str | os.PathLike | None = None,
             system: str | None = None, limit_s: float | None = None, plain: bool = False,
             n_gpu_layers: int | str | None = None, allow_long_context: bool = False, rpc=None,
             attention_settings=None) -> dict:
    """Evaluate every (sample, configuration); rows are appended to `out` (JSONL), resuming.

    model: a registered name (smollm2, qwen2.5-coder, gemma3-270m), a GGUF path, or None (default).
    tasks/n/length: generated RULER-style samples; or input=FILE (RULER or kvpress rows).
    gates: any of always, page, verify, page+verify, search, page+search (the budgets are search's
    ladder); the full cache is always evaluated.
    progress(done, total) counts rows (already present ones included; first call before any work).
    limit_s: stop after the sample during which this many seconds passed (the run stays resumable).
    n_gpu_layers, rpc, attention_settings, allow_long_context: as Engine's (allow_long_context also lifts the
    trained-context check).
    Returns {"out", "rows_written", "rows_present", "samples", "samples_run", "wall_s", "per_sample_s"}.
    """
    from page_local import gate as gate_mod
    from page_local.store.gguf import model_identity
    from page_local.store import models
    from page_local.engine.engine import Engine
    from page_local.evictors import get_evictor
    from page_local.native.runtime import Model

    path = models.resolve(model)
    gates = list(dict.fromkeys(gates))
    bad = [g for g in gates if g not in EVAL_GATES]
    if bad:
        raise ValueError(f"unknown gate mode(s) {bad}; choose from {', '.join(EVAL_GATES)} "
                         "(the full cache is always evaluated)")
    budgets = _check_budgets(list(dict.fromkeys(budgets)))
    evs = {name: supported(get_evictor(name)) for name in dict.fromkeys(evictors)}
    for name, ev in evs.items():
        if ev.needs & AFTER_ANSWER and (early := [g for g in gates if g not in VERIFY_MODES]):
            raise ValueError(f"evictor {name!r} scores the prompt by the full cache's answer, which only the verify "
                             f"and search gates have before evicting; drop gate(s) {', '.join(early)} or run "
                             f"{name} separately with --gates verify,search")
    if isinstance(verify_m, bool) or not isinstance(verify_m, int) or not 1 <= verify_m <= 256:
        raise ValueError(f"verify_m must be an int in [1, 256], got {verify_m!r}")
    if tasks:
        for t in tasks:
            if input is None:
                get_task(t)
    out = Path(out)
    if out.suffix == ".gz":
        raise ValueError(f"--out {out}: results are appended as plain JSONL; compressed .gz files are for "
                         "reading (eval report) only. Write to a .jsonl file.")
    model_id = model_identity(path)
    source = "generated" if input is None else str(input)

    with Model(path, n_gpu_layers=0) as tok_model:  # the tokenizer only
        prompter = ChatPrompter(tok_model, system, plain=plain)
        samples = load_samples(prompter, tasks, n, length, seed, input)
        if not samples:
            raise ValueError("no samples to evaluate")
        prompts = [prompter.prompt(s, query_agnostic) for s in samples]
        for p in prompts:
            if p.split < 2:
                raise ValueError(f"{p.sample.task}[{p.sample.index}]: the prompt is too short")
        n_ctx_train = tok_model.n_ctx_train
    # the verify span is at most the full cache's answer (max_new_tokens), so verify_m needs no room of its own
    need = max(p.n + max(p.sample.max_new_tokens, len(p.reference)) + 2 for p in prompts)
    if need > n_ctx_train and not allow_long_context:
        raise ValueError(f"the longest prompt needs {need} tokens of context, more than the model was trained "
                         f"on ({n_ctx_train}); use a smaller length (or --allow-long-context)")
    auto_ctx = n_ctx is None
    if n_ctx is None:
        n_ctx = _round_ctx(need + CTX_MARGIN)
        if n_ctx > n_ctx_train >= need + CTX_MARGIN:  # the rounding alone would pass the trained context
            n_ctx = n_ctx_train
    elif n_ctx < need:
        raise ValueError(f"n_ctx={n_ctx} is too small: the longest prompt needs {need} cells")

    configs = [(None, None, FULL)] + [(e, b, g) for e in evs for b in budgets for g in gates if g not in SEARCH_MODES]
    configs += [(e, list(budgets), g) for e in evs for g in gates if g in SEARCH_MODES]  # the budgets: the ladder
    length_target = None if input is not None else length

    def key_of(s: Sample, e, b, g) -> tuple:
        vals = dict(model=model_id, source=source, task=s.task, index=s.index, length_target=length_target,
                    seed=seed, query_agnostic=bool(query_agnostic), verify_m=verify_m, evictor=e, budget=b, gate=g)
        return tuple(_jkey(vals[k]) for k in KEY_FIELDS)

    out.parent.mkdir(parents=True, exist_ok=True)
    existing = read_rows(out, repair=True)
    present = {row_key(r) for r in existing}
    todo = []
    total = len(prompts) * len(configs)
    done = 0
    for p in prompts:
        wanted = {(e, None if b is None else _jkey(b), g) for e, b, g in configs
                  if key_of(p.sample, e, b, g) not in present}
        done += len(configs) - len(wanted)
        if wanted:
            todo.append((p, wanted))
    if progress:
        progress(done, total)
    result = dict(out=str(out), rows_written=0, rows_present=done, samples=len(prompts), samples_run=0,
                  wall_s=0.0, per_sample_s=None, n_ctx=n_ctx, model=model_id)
    if not todo:
        return result
    page_gate = gate_mod.Gate.for_model(model_id, "page")
    if any(BASE_MODE[g] == "page" for g in gates):
        _check_same_rule(existing, model_id, page_gate, out)

    t_start = time.perf_counter()
    # a computed n_ctx may pass the trained context by its margin only: positions stay <= need (checked above)
    with Engine(path, n_ctx=n_ctx, budget=0.5, evictor="snapkv", gate="never", threads=threads, seed=seed,
                n_gpu_layers=n_gpu_layers, rpc=rpc, attention_settings=attention_settings,
                allow_long_context=allow_long_context or auto_ctx) as eng:
        result["profile"] = None if page_gate.profile is None else dict(
            mu=page_gate.profile.mu, sigma=page_gate.profile.sigma, n_pilot=page_gate.profile.n_pilot)
        result["profile_warning"] = page_gate.warning
        run = _Run(eng, page_gate, evs, budgets, gates, verify_m, seed)
        with open(out, "a", encoding="utf-8") as f:
            for p, wanted in todo:
                rows = run.sample(p, wanted)
                for r in rows:
                    r.update(model=model_id, source=source, length_target=length_target, seed=seed,
                             query_agnostic=bool(query_agnostic), verify_m=verify_m)
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
                f.flush()
                result["rows_written"] += len(rows)
                result["samples_run"] += 1
                done += len(wanted)
                if progress:
                    progress(done, total)
                if limit_s is not None and time.perf_counter() - t_start > limit_s:
                    break
    result["wall_s"] = round(time.perf_counter() - t_start, 2)
    result["per_sample_s"] = round(result["wall_s"] / max(1, result["samples_run"]), 2)
    return result

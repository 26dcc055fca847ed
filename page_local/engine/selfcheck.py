"""Self-verified eviction, the answer's check (gate modes verify, page+verify, search, page+search).

The full cache answers; the evicted copies of the prompt's cache (one per budget tried, sharing the prompt's
cells in sequences 1..) are teacher-forced on that answer (turn.Pipeline.check_ladder), and the first copy
whose loss passes verify.verify_score becomes the sequence. The decode loop (generation.AnswerLoop) calls
SelfCheck once: at the answer's end, at the cap (`cap` tokens) or where the answer stopped.
"""

from __future__ import annotations

import time

import numpy as np

from page_local.engine.decision import Decision
from page_local.engine.turn import FIRST_CHUNK, N_SINK, W, Pipeline
from page_local.evictors.base import resolve_budget
from page_local.verify import kl


class SelfCheck:
    """The check of one turn: dec is the turn's Decision (updated with the verdict), plan the eviction plan
    the gate left ((keeps, held, last_pos, last_tok); keeps: [(B, keep)] smallest B first, or KeepSets, which
    selects them when the check runs); rule, threshold: verify.RULES; cap: the most answer tokens checked; ladder: the budgets as
    the user gave them (for the status line); compact: move the committed copy's cells together. park: None, or
    park(positions, answered) — a passed check parks the positions the copy dropped (engine/parking.py) instead of
    evicting them; the answer's cells of the full cache stay (they were computed with the whole conversation). With
    park, an answer that is over inside the span is not checked (Decision.check_unneeded): parking pays only for the
    tokens after the check, and the next message chooses again anyway."""

    def __init__(self, ctx, pipeline: Pipeline, dec: Decision, plan: tuple, rule: str, threshold: float, cap: int,
                 ladder, compact: bool, park=None):
        self.ctx, self.pipeline, self.dec, self.plan = ctx, pipeline, dec, plan
        self.rule, self.threshold, self.cap, self.ladder, self.compact = rule, threshold, cap, ladder, compact
        self.park = park

    def __call__(self, out: list[int], full_logits: list[np.ndarray], end: int | None = None,
                 until: str = "end") -> None:
        """Self-verified eviction: teacher-force the generated tokens on evicted copies of the sequence
        (sharing the prompt's cells; every rung's first chunk in one batch when the cache has room, then one
        at a time), smallest first and in growing chunks that stop where a copy fails (Pipeline.check_ladder);
        commit the first copy that passes
        (one copy under verify, one per ladder rung under search). end:
        the end-of-generation token the full cache chose after out (then full_logits has one more
        entry, and the candidate must end the answer there too). Updates dec."""
        ctx, pipe, dec = self.ctx, self.pipeline, self.dec
        keeps, held, last_pos, last_tok = self.plan  # keeps: [(B, keep)], smallest B first, or KeepSets
        m = len(out)
        if self.park is not None and until != "cap":
            # parking, and the answer is over inside the span (it ended, or max_tokens or the context stopped it):
            # no token is left for a parked cache to speed up, and the next message restores every cell and
            # chooses again, so a check (a third of a step per answer token) would buy nothing
            dec.check_unneeded = m
            dec.reason += (f"; no check: the answer was over within the check's {self.cap} tokens ({m}), so nothing "
                           "was left to speed up (the next message chooses again from every cell)")
            return
        t0 = time.perf_counter()
        dec.verify_threshold, dec.verify_rule = self.threshold, self.rule
        if ctx.cells_used(0) + m + 1 > ctx.n_ctx:  # one candidate at a time holds a copy of the answer
            dec.reason += "; self-verification skipped: no room in the cache for the evicted candidate"
            return
        if callable(keeps):  # the keep sets are selected now (KeepSets; lorekv-answer's scored by this answer)
            keeps, ms = keeps(out)
            if ms is not None:
                dec.lookahead_ms = ms
        y = list(out) + ([end] if end is not None else [])
        k = len(y)  # positions: m answer tokens (+ the answer's end)
        full_logits = full_logits[:k]
        # every rung's first chunk goes in one batch when the cache has room for those copies too
        batch_first = ctx.cells_used(0) + m + 1 + (len(keeps) - 1) * FIRST_CHUNK <= ctx.n_ctx
        chosen, tried, forced = pipe.check_ladder([keep for _, keep in keeps], held, last_pos, [last_tok] + out,
                                                  full_logits, y, self.rule, self.threshold,
                                                  batch_first=batch_first)
        if len(keeps) > 1:
            labels = plan_labels(keeps, self.ladder, dec.T)
            dec.search = [dict(B=B, label=label, score=None, passed=None) if t is None else
                          dict(B=B, label=label, score=t.score.score, passed=t.score.passed, forced=t.forced)
                          for (B, _), label, t in zip(keeps, labels, tried)]
        i = chosen if chosen is not None else len(keeps) - 1  # the verdict told: the chosen or the largest rung
        told = tried[i]
        v, changed = told.score, told.changed
        dec.verify_forced = forced
        dec.B = keeps[i][0]
        commit = chosen is not None
        if commit and self.park is not None:  # the copy's dropped positions are parked; seq 0 keeps its answer
            drop = np.setdiff1d(ctx.page.positions(0), ctx.page.positions(1), assume_unique=True)
            ctx.seq_rm(1, -1, -1)
            p = ctx.seq_pos_max(0)
            if end is None:  # the answer goes on: its newest token again, so that the next is sampled from this cache
                ctx.seq_rm(0, p, p + 1)
            self.park(drop, m)
            if end is None:  # (an answer that ended keeps every cell the full cache computed: restored, the
                ctx.decode([out[-1]], p, 0)  # conversation is the full cache's, bit for bit)
        elif commit:  # the candidate already holds the m tokens: it becomes the sequence
            ctx.seq_rm(0, -1, -1)
            ctx.seq_cp(1, 0)
            ctx.seq_rm(1, -1, -1)
            p = ctx.seq_pos_max(0)
            ctx.seq_rm(0, p, p + 1)  # the newest token again, so that the next one is sampled from this cache
            if self.compact:
                ctx.page.compact(0)
            ctx.decode([out[-1]], p, 0)
        else:  # every candidate is gone already (check_ladder removes those that fail)
            p = ctx.seq_pos_max(0)  # restore seq 0's next-token logits
            ctx.seq_rm(0, p, p + 1)
            ctx.decode([out[-1]], p, 0)
        dec.verify_m, dec.verify_until = m, until
        dec.verify_score, dec.verify_delta, dec.verify_max, dec.verify_changed = v.score, v.mean, v.max, v.changed
        dec.verify_top1, dec.verify_kl_first = float(1.0 - changed.mean()), kl(full_logits[0], told.first_logits)
        dec.verify_ms = (time.perf_counter() - t0) * 1e3
        dec.evicted = commit
        dec.kept = ctx.cells_used(0) - m  # prompt positions held after the decision
        dec.compression = dec.T / dec.kept if dec.kept else 1.0
        span = {"end": f"the whole answer ({m} tokens and its end)", "cap": f"the first {m} tokens (the cap)",
                "length": f"all {m} tokens generated"}[until]
        if dec.search:
            tried = ", ".join(f"{r['label']} " + {True: "passed", False: f"failed within {r.get('forced')} tokens",
                                                    None: "not needed"}[r["passed"]] for r in dec.search)
            dec.reason += (f"; budget search over {span}, smallest first ({tried}): "
                           + (f"committed the smallest that passed, B = {dec.B}" if commit else "kept the full cache"))
        else:
            stop = "" if commit or dec.verify_forced >= m + 1 else f" within the first {dec.verify_forced} tokens"
            dec.reason += (f"; self-verification over {span}: {v.describe()}{stop}, "
                           + ("eviction committed" if commit else "kept the full cache"))


class KeepSets:
    """The check's keep sets, one per budget (smallest first), selected when the check runs rather than when the
    message is read, and with them the conversation's sentences when the evictor keeps whole ones (snapkv-spans, the
    chat's; the sentences of the positions read before the answer do not change as it grows): an answer that is
    over inside the check's span runs no check under parking, and then never pays for them (the sentences: 30 ms
    at 7K cells, 87 ms at 17.8K on Qwen2.5-Coder, AMD Zen 1; a keep set a few ms). Called with the answer tokens:
    ([(B, keep)], None)."""

    def __init__(self, pipe: Pipeline, ev, pre, budgets: list[int], signals: dict, seed: int):
        self.pipe, self.ev, self.pre, self.budgets = pipe, ev, pre, budgets
        self.signals, self.seed = signals, seed

    def __call__(self, answer: list[int]) -> tuple[list, float | None]:
        sig = self.signals
        if "spans" in self.ev.needs and "spans" not in sig:  # the sentences too are cut only now (see Messages)
            sig = dict(sig, spans=self.pipe.sentences(self.pre.held))
        return [(b, self.pipe.select(self.ev, self.pre, b, sig, self.seed)) for b in self.budgets], None


class AfterAnswer(KeepSets):
    """The keep sets of an evictor that reads the full cache's answer (evictor lorekv-answer): called
    with the answer tokens at the check, it scores the prompt by their queries (one batch in sequence 1,
    emptied again) and selects one keep set per budget, smallest first."""

    def __init__(self, pipe: Pipeline, ev, pre, budgets: list[int], last_pos: int, signals: dict, seed: int):
        super().__init__(pipe, ev, pre, budgets, signals, seed)
        self.last_pos = last_pos

    def __call__(self, answer: list[int]) -> tuple[list, float]:
        """([(B, keep)] smallest first, the milliseconds the scoring took)."""
        la = self.pipe.answer_lookahead(self.ev.spec, answer, self.last_pos, seq=0, work=1)
        sig = dict(self.signals, answer_lookahead=la)
        return [(b, self.pipe.select(self.ev, self.pre, b, sig, self.seed)) for b in self.budgets], la.ms


def rung_name(r) -> str:
    """How a rung of the ladder is called: '1/8' for a ratio 0.125, 'all' for 1.0, '1024' for a count."""
    if isinstance(r, float) and r > 0 and abs(1 / r - round(1 / r)) < 1e-9:
        return f"1/{round(1 / r)}" if r < 1 else "all"
    return str(r)


def plan_labels(keeps, ladder, T: int) -> list[str]:
    """How each rung is called in the status line (rung_name), by the budget it resolved to."""
    names = {}
    for r in ladder:
        names.setdefault(resolve_budget(r, T, W, N_SINK), rung_name(r))
    return [names.get(b, str(b)) for b, _ in keeps]


def unpaid(dec: Decision, cap: int, expected: int, needed: int) -> None:
    """Record on dec that parking prepares no check this turn: about `expected` answer tokens are expected after
    the cap (Payback.expected), fewer than the `needed` (Payback.needed) for the parked cache to pay back the
    check's forced tokens; the full cache answers, unchecked."""
    dec.check_unpaid = expected
    need = f"the {needed}" if needed < 1 << 20 else "what"
    dec.reason += (f"; no check at the cap: about {expected} more answer tokens were expected (this request's "
                   f"max_tokens and this conversation's earlier answers), fewer than {need} a "
                   f"parked cache needs to pay back a check of {cap}")


class Payback:
    """Whether a check at the cap can pay for itself, for parking. A check costs its forced tokens (about FORCED_STEP
    of a full-cache decode step each, `bench forced`; 0.38 measured on Qwen2.5-Coder-0.5B at 8.6K cells) and buys,
    when it passes, a faster step for each answer token after the cap: parking.step_gain of a step, the cells' share
    of a step's cost (Qwen2.5-Coder at 13K cells, parked to a quarter: 0.47 s against 0.70 s per 16 tokens). So the
    check runs when p x after x gain >= forced x FORCED_STEP (`needed`): after, the tokens expected after the cap
    (`expected`); forced, what this conversation's checks forced (their median; none yet: the cap and the first chunk
    of every other rung); p, the share of its recent checks that passed (one pass assumed before the first). A check
    that cannot pay is not prepared (Decision.check_unpaid) and the full cache answers, as fast as the full cache.
    Before this rule a check ran whenever as many tokens followed the cap as it forced: on Qwen2.5-Coder at 8.6K cells a
    128-token answer then decoded at 0.74x the full cache (issue 54; docs/benchmarks.md, "The shapes people run").

    What the conversation's turns measured refines it (`record`): the forced tokens, what one cost in steps, and the gain
    a parked answer showed against the one step_gain predicted (their ratio multiplies the next predictions).
    gain None (park_from given by the user: parking pays from there, by the user's word): the check runs when as many
    tokens follow the cap as it forces (`tokens`).

    expected(max_tokens, cap): what the request allows after the cap (max_tokens - cap), and at most the median of
    the last RECENT answers of this conversation that reached the cap (their tokens after it); None of those yet:
    what the request allows."""

    RECENT = 3
    FORCED_STEP = 0.4
    MIN_TIMED = 8  # answer tokens on each side of the check that time a step

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.after: list[int] = []  # tokens after the cap of the conversation's recent answers that reached it
        self.passed: list[bool] = []  # the recent checks' verdicts
        self.forced: list[int] = []  # their forced tokens
        self.forced_step: list[float] = []  # what a forced token cost, in full-cache steps
        self.seen: list[float] = []  # a parked answer's gain over the gain step_gain predicted

    @staticmethod
    def tokens(cap: int) -> int:
        """The answer tokens after the cap that pay back a check of `cap` tokens, by the user's word (gain None)."""
        return cap

    def expected(self, max_tokens: int, cap: int) -> int:
        room = max(0, max_tokens - cap)
        if not self.after:
            return room
        return min(room, int(np.median(self.after[-self.RECENT:])))

    def needed(self, cap: int, rungs: int, gain: float | None) -> int:
        """The answer tokens after the cap a check must be followed by to pay (see the class); gain: the share of a
        step parking saves (Parking.gain), None to use `tokens`."""
        if gain is None:
            return self.tokens(cap)
        forced = float(np.median(self.forced)) if self.forced else cap + (rungs - 1) * FIRST_CHUNK
        step = float(np.median(self.forced_step)) if self.forced_step else self.FORCED_STEP
        p = (sum(self.passed) + 1) / (len(self.passed) + 1)
        g = gain * (float(np.median(self.seen)) if self.seen else 1.0)
        if g <= 0:
            return 1 << 30
        return int(np.ceil(forced * step / (p * g)))

    def record(self, answered: int, cap: int, dec: Decision | None = None, times: list[float] | None = None,
               gain: float | None = None) -> None:
        """An answer of `answered` tokens ended: remembered when it reached the cap. dec: its Decision, whose check
        (if it ran) is remembered; times: the answer's clock after each token decoded (generation.AnswerLoop.times),
        which times a full-cache step before the cap and a parked one after it; gain: what step_gain predicted."""
        if answered >= cap:
            self.after = (self.after + [answered - cap])[-self.RECENT:]
        if dec is None or dec.verify_forced is None:
            return
        keep = lambda xs, x: (xs + [x])[-self.RECENT:]  # noqa: E731
        self.passed = keep(self.passed, bool(dec.evicted))
        self.forced = keep(self.forced, int(dec.verify_forced))
        if not times or len(times) < cap or cap <= self.MIN_TIMED:
            return
        full = (times[cap - 1] - times[0]) / (cap - 1)  # a full-cache step (the check runs after token cap)
        if dec.verify_ms and dec.verify_forced and full > 0:
            self.forced_step = keep(self.forced_step, dec.verify_ms / 1e3 / dec.verify_forced / full)
        if dec.parked and gain and len(times) - cap - 1 >= self.MIN_TIMED:
            parked = (times[-1] - times[cap]) / (len(times) - cap - 1)
            self.seen = keep(self.seen, float(np.clip((1 - parked / full) / gain, 0.25, 4.0)))


class Backoff:
    """How often a conversation's check runs. After REFUSALS checks in a row refused, the next turns keep the full
    cache unchecked: 1 turn, then 2, 4, up to MAX_REST after each further refusal; a passed check starts over.

    A refused check costs its candidate's selection and forced tokens and buys nothing; where it keeps failing
    (free prose, which a quarter of the cache rarely reproduces token for token), it would be paid on every turn
    (bench chat: 0.85-0.95x the full cache's decode on such a chat). Resting keeps exactly what a refused check
    keeps, the full cache, without the cost; the conversation is checked again after the rest. The verdicts belong
    to the conversation they were made on: a rewind before the last checked message (a server slot taking another
    conversation, an edited message) starts over."""

    REFUSALS = 2
    MAX_REST = 8

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.refused = 0  # checks refused in a row
        self.rest = 0  # turns left to keep the full cache unchecked
        self._next_rest = 1
        self.at = 0  # where the last checked message began (history index): rewound before it, the verdicts go too

    def resting(self) -> bool:
        """True (and one turn of rest used) if this turn keeps the full cache without a check."""
        if self.rest <= 0:
            return False
        self.rest -= 1
        return True

    def record(self, passed: bool, at: int = 0) -> None:
        """A check's verdict on the message that began at history index `at`."""
        if passed:
            self.reset()
            return
        self.at = at
        self.refused += 1
        if self.refused >= self.REFUSALS:
            self.rest = self._next_rest
            self._next_rest = min(2 * self._next_rest, self.MAX_REST)

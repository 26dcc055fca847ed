"""One message through the engine, in order (docs/design.md §5, "One turn through the engine"):

  fit         parked cells come back (parking.py), room is made if the message and its answer's room do not fit
              (room.py: earlier turns evicted, a message longer than the context read in parts)
  gate        the message (its last part) is prefilled and probed (turn.Pipeline), the base gate decides, and
              when it opens over the budget the evictor's keep set is evicted now (page, always) or planned for
              the check (the verify and search modes), or the cells are parked instead (parking)
  answer      the decode loop (generation.AnswerLoop) with its hooks: the check at the cap (selfcheck.SelfCheck)
              and room for an answer that grows past its room (parked cells first, then earlier turns)

Messages does this for one Engine over the parts the Engine owns and hands it once (its context and model, the
Transcript, the turn's steps, room-making, parking, the check's backoff and payback, snapshots); everything that
changes from turn to turn comes in as arguments: the TurnSettings, the tokens, the sampling, the stream's record.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import numpy as np

from page_local.engine.decision import Decision, Result, Sampling
from page_local.engine.generation import AnswerLoop
from page_local.engine.parking import PARK_SEQ, Parking
from page_local.engine.room import RoomMaker, answer_room, reread_from
from page_local.engine.selfcheck import AfterAnswer, Backoff, KeepSets, Payback, SelfCheck, unpaid
from page_local.engine.settings import TurnSettings
from page_local.engine.snapshots import Snapshots
from page_local.engine.transcript import Transcript
from page_local.engine.turn import AFTER_ANSWER, N_SINK, W, Pipeline, Prefilled
from page_local.evictors.base import resolve_budget
from page_local.gate import SEARCH_MODES
from page_local.native.sampler import make_sampler


class Messages:
    """The messages of one engine's conversation: fit, gate and answer each (see the module's docstring).
    rewind(n): the Engine's own (the conversation after its first n tokens forgotten), for reading again."""

    def __init__(self, ctx, model, conv: Transcript, pipeline: Pipeline, room: RoomMaker, parking: Parking,
                 backoff: Backoff, payback: Payback, snapshots: Snapshots, rewind: Callable[[int], None]):
        self.ctx, self.model, self.conv, self.pipeline, self.room = ctx, model, conv, pipeline, room
        self.parking, self.backoff, self.payback, self.snapshots = parking, backoff, payback, snapshots
        self.rewind = rewind
        self.disk = None  # prefixes.PrefixDisk: the disk cache of prompt prefixes, when the engine has one
        self._save = False  # the message being read is written to the disk cache once read (prefixes.py)

    # --- a live turn -------------------------------------------------------------------------------
    def answer(self, t: TurnSettings, toks: list[int], max_tokens: int, sampling: Sampling, stream,
               progress: Callable[[int, int], None] | None = None) -> Iterator[str]:
        """Fit, gate and answer one message; a generator of text pieces. stream: what the caller reads as it goes
        (engine.Stream: .decision set before the first piece, .result when the answer ends however it ends,
        .logprobs grown per token; max_tokens checked: settings.check_max_tokens). progress(done, total): after
        each batch of the prefill."""
        ctx, conv = self.ctx, self.conv
        # room kept for the answer when room is made: a normal answer's, not max_tokens' (never upfront: an
        # answer that grows past it makes room from earlier turns then); the verify modes also need the
        # candidate's copy of it
        reserve = answer_room(max_tokens, ctx.n_ctx)
        if t.verifies:  # one copy of the answer (search batches first chunks if room is left)
            reserve += min(max_tokens, t.verify_tokens) + 1
        start = len(conv)  # where this message begins: an answer never evicts it to make room
        again = reread_from(conv) if t.reread != "never" and t.on_full == "evict" else None
        if again is not None and t.reread == "words" and not self.room.words_went(conv, toks):
            again = None  # what the message asks about is still held, or is not in the conversation
        if again is not None:  # read the conversation again from the first token room-making deleted
            toks = conv.history[again:] + toks
            self.rewind(again)
        n_msg, from_disk, disk_s = len(toks), 0, 0.0
        if self.disk is not None and again is None:  # a prefix read before comes from the disk (prefixes.py)
            # a message that can evict or park reads its probe's window again, as a fresh prefill does
            window = W if self.can_evict(t, len(conv) + len(toks)) else 1
            toks, from_disk, disk_s = self.disk.restore(ctx, conv, self.parking, self.snapshots, self.rewind, toks,
                                                        reserve, t.evictor.needs, window=window)
            self._save = self.disk.wants(ctx, conv, self.parking, len(toks))
        self.pipeline.progress = progress_of(progress, len(toks))
        try:
            dec, plan = self.fit(t, toks, reserve, evict_now=not t.verifies)
        finally:
            self.pipeline.progress, self._save = None, False
        dec.disk_tokens, dec.disk_ms = from_disk, disk_s * 1e3
        if again is not None:
            dec.reread = start - again
        stream.decision = dec

        # generation (generation.py), with the verify cap and room for a growing answer plugged in
        park = self.parking.parker(dec, reserve) if t.park else None  # a passed check parks instead of evicting
        gain = None
        if plan is not None and t.park and max_tokens >= t.verify_tokens:  # an answer that can reach the cap
            keeps = plan[0]  # KeepSets: the budgets are known now, the keep sets are selected at the check
            after = isinstance(keeps, AfterAnswer)
            kept = dec.B if after else min(keeps.budgets)
            gain = self.parking.gain(dec.T, kept + max_tokens)
            expected = self.payback.expected(max_tokens, t.verify_tokens)
            needed = self.payback.needed(t.verify_tokens, 1 if after else len(keeps.budgets), gain)
            if expected < needed:  # a check there could not pay back: none is prepared
                plan = None
                unpaid(dec, t.verify_tokens, expected, needed)
        check = None if plan is None else SelfCheck(ctx, self.pipeline, dec, plan, t.verify_rule, t.verify_threshold,
                                                    t.verify_tokens, t.ladder, t.compact, park=park)
        room = None if t.on_full != "evict" else (lambda: self._answer_room(dec, reserve, start, t))
        sampler = sampler_for(self.model, ctx.n_ctx, conv.history, sampling)
        loop = AnswerLoop(ctx, self.model, conv, sampler, max_tokens, self.room.pos_limit,
                          logprobs=sampling.logprobs, check=check, room=room, record=stream.logprobs,
                          parked=self.parking.count)
        try:
            yield from loop
            if check is not None and dec.verify_m is not None:  # the check ran: its verdict counts
                self.backoff.record(dec.evicted, start)
            if t.park and t.verifies and loop.finish != "interrupted":
                self.payback.record(len(loop.out), t.verify_tokens, dec, loop.times, gain)
        finally:
            ctx.seq_rm(1, -1, -1)  # an unfinished verification leaves nothing behind
            sampler.close()
            out = loop.out
            stream.result = Result(self.model.detokenize(out), out, dec, loop.finish, n_msg, loop.seconds,
                                   list(stream.logprobs) if sampling.logprobs is not None else None)

    def _answer_room(self, dec: Decision, reserve: int, start: int, t: TurnSettings) -> bool:
        """Room for a growing answer: parked cells go for good first (the lowest ranked), then earlier turns."""
        n = self.parking.answer_room(self.conv, reserve)
        if n is not None:
            dec.room_evicted += n
            return True
        return self.room.for_answer(self.conv, dec, reserve, start, t.room_rules)

    # --- fit and gate ------------------------------------------------------------------------------
    def fit(self, t: TurnSettings, toks: list[int], reserve: int, evict_now: bool,
            select: bool = True) -> tuple[Decision, tuple | None]:
        """The message's prefill through room-making (RoomMaker.fit), after parked cells came back (with park):
        the message's last part is prefilled, probed and gated by prefill_and_gate. reserve: the answer's room."""
        restored, dropped = self.parking.unpark(self.conv, len(toks) + reserve) if t.park else (0, 0)
        dec, plan = self.room.fit(self.conv, toks, reserve, t.room_rules,
                                  lambda part: self.prefill_and_gate(t, part, evict_now=evict_now, select=select,
                                                                     gap=reserve),
                                  self.snapshots.point, self.snapshots.back)
        dec.restored, dec.park_dropped = restored, dropped
        return dec, plan

    def prefill_and_gate(self, t: TurnSettings, toks: list[int], evict_now: bool = True,
                         select: bool = True, gap: int = 0) -> tuple[Decision, tuple | None]:
        """Prefill, probe, gate and (evict_now) evict. Returns the Decision and, when the gate opened
        and T > B but evict_now is False, the eviction plan (keep, held, last_pos, last_tok) for the
        verify modes. select=False: gate only (measure). gap: free cells left after the held ones when the
        cells are parked (the answer's room). An interrupted or failed prefill leaves nothing of the turn in
        the cache."""
        ctx = self.ctx
        pos0 = ctx.seq_pos_max(0) + 1
        n_hist = len(self.conv)
        try:
            return self._gate(t, toks, pos0, evict_now, select, gap)
        except BaseException:
            ctx.seq_rm(0, pos0, -1)
            ctx.page.disarm_probe()
            self.conv.truncate(n_hist)
            raise

    def can_evict(self, t: TurnSettings, T: int) -> bool:
        """Whether _gate would evict or park in a conversation of T cells once its gate opens: over the turn's
        budget, and at or over park_from under parking (below it the full cache is kept)."""
        return T > resolve_budget(t.budget, T, W, N_SINK) and not (t.park and not self.parking.pays(T, t.park_from))

    def _gate(self, t: TurnSettings, toks: list[int], pos0: int, evict_now: bool, select: bool,
              gap: int) -> tuple[Decision, tuple | None]:
        pipe, ev = self.pipeline, t.evictor
        t0 = time.perf_counter()
        pre = pipe.prefill(toks, pos0, 0, track_attention=select and "prefill_attention" in ev.needs)
        self.conv.extend(toks, pos0)
        save_ms = 0.0
        if (self._save and len(toks) >= self.disk.cache.min_tokens  # the whole message read in one part
                and self.disk.whole(self.ctx, self.conv, self.parking)):
            t_save = time.perf_counter()
            self.disk.save(self.snapshots)  # before the gate evicts or parks anything
            save_ms = (time.perf_counter() - t_save) * 1e3
        if t.park and pre.probe is not None:
            self.parking.ranked(pre.probe)  # every cell's score by this message: which parked ones go first
        # the speed budget is a share of the whole conversation, so a turn evicts only what brings the
        # cells back to it: earlier turns are not cut again by the same ratio on every turn
        T = len(self.conv)
        B = resolve_budget(t.budget, T, W, N_SINK)
        g = t.gate.decide(pre.D, n_tokens=T) if (pre.D is not None or t.gate.mode != "page") else None
        t3 = time.perf_counter()
        is_open = bool(g.open) if g else False
        would_evict = is_open and pre.T > B and select
        # parking: below park_from eviction does not pay, the full cache is kept
        short = would_evict and t.park and not self.parking.pays(pre.T, t.park_from)
        # a check refused turn after turn rests: the full cache, unchecked (selfcheck.Backoff)
        refused = self.backoff.refused
        rested = would_evict and not short and t.verifies and self.backoff.resting()
        evicted, plan, lookahead_ms = False, None, None
        if would_evict and not short and not rested:
            evicted, plan, lookahead_ms = self._evict_or_plan(t, pre, toks, pos0, T, B, evict_now, gap)
        t4 = time.perf_counter()
        reason = g.reason if g else "the probe saw fewer than 2 heads; keeping the full cache"
        verify = {}
        if t.verifies:
            if t.gate_mode == "verify":
                reason = "gate mode 'verify': the evicted cache is checked on the answer (up to its end or the cap)"
            elif t.gate_mode == "search":
                reason = ("gate mode 'search': one candidate per budget of the ladder is checked on the answer; "
                          "the smallest that passes is committed")
            if is_open and pre.T <= B:  # nothing to evict: the candidate is the full cache itself
                verify = dict(verify_m=0, verify_delta=0.0, verify_score=0.0, verify_rule=t.verify_rule,
                              verify_threshold=t.verify_threshold)
                reason += f"; {pre.T} cells <= B = {B}: nothing to evict"
        if short:
            reason += (f"; the conversation holds {pre.T} cells, fewer than {t.park_from}: eviction does not pay "
                       "there, the full cache is kept")
        if rested:
            reason += (f"; the last {refused} checks were refused, so this turn keeps the full cache without one "
                       f"(checking again in {self.backoff.rest + 1} turn{'s' if self.backoff.rest else ''})")
        kept = self.ctx.cells_used(0)
        return Decision(
            T=T, B=B, D=pre.D, z=g.z if g else None, open=is_open, evicted=evicted, kept=kept,
            compression=T / kept if kept else 1.0, gate_mode=t.gate_mode,
            rule=g.rule if g else "none", reason=reason,
            evictor=ev.name, prefill_ms=pre.prefill_ms, probe_ms=pre.probe_ms,
            gate_ms=(t3 - t0) * 1e3 - pre.prefill_ms - pre.probe_ms - save_ms, evict_ms=(t4 - t3) * 1e3,
            disk_save_ms=save_ms,
            agreement=pre.agreement, lookahead_ms=lookahead_ms, gate_note=g.note if g else None,
            parked=self.parking.count(), park_from=t.park_from if short else None,
            check_rested=refused if rested else None, **verify), plan

    def _evict_or_plan(self, t: TurnSettings, pre: Prefilled, toks: list[int], pos0: int, T: int, B: int,
                       evict_now: bool, gap: int) -> tuple[bool, tuple | None, float | None]:
        """The gate opened over the budget: the evictor's signals and keep set(s), evicted now (evict_now, one
        budget) or planned for the check ((keeps, held, last_pos, last_tok): keeps a selfcheck.KeepSets, one keep set per
        rung of the ladder under search, selected when the check runs; AfterAnswer's read the answer too). Returns
        (evicted, plan, lookahead ms)."""
        pipe, ev = self.pipeline, t.evictor
        last_pos, last_tok = pos0 + len(toks) - 1, toks[-1]
        later = (not evict_now or t.gate_mode in SEARCH_MODES) and not ev.needs & AFTER_ANSWER
        needs = ev.needs - {"spans"} if later else ev.needs  # KeepSets cuts the sentences at the check
        signals = pipe.signals(needs, pre, last_pos, last_tok, spec=getattr(ev, "spec", None),
                               restore_logits=not evict_now)
        lookahead_ms = signals["lookahead"].ms if "lookahead" in signals else None
        if t.gate_mode in SEARCH_MODES:  # one keep set per rung, smallest first, from one probe
            rungs = sorted({resolve_budget(r, T, W, N_SINK) for r in t.ladder})
            rungs = [b for b in rungs if b < pre.T] or [B]
        else:
            rungs = [B]
        if ev.needs & AFTER_ANSWER:  # the keep sets wait for the full cache's answer (SelfCheck)
            return False, (AfterAnswer(pipe, ev, pre, rungs, last_pos, signals, t.seed), pre.held, last_pos,
                           last_tok), lookahead_ms
        if later:  # the keep sets wait for the check (selfcheck.KeepSets)
            keeps = KeepSets(pipe, ev, pre, rungs, signals, t.seed)
            return False, (keeps, pre.held, last_pos, last_tok), lookahead_ms
        keep = pipe.select(ev, pre, B, signals, t.seed)
        pipe.evict_in_place(0, keep, pre.held, last_pos, last_tok, compact=t.compact,
                            park=PARK_SEQ if t.park else None, gap=gap)
        if t.park:  # what evict_in_place parked, scored by this message's ranking
            self.parking.note(np.setdiff1d(pre.held[pre.held != last_pos], keep))
        return True, None, lookahead_ms


def tokens_of(model, prompt: str | list[int], add_special: bool) -> list[int]:
    """A prompt's token ids: a string tokenized (add_special: the model's start tokens, for a conversation's
    first message), or token ids checked against the vocabulary. ValueError for an empty prompt."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("the prompt is empty")
        return model.tokenize(prompt, add_special=add_special)
    toks = [int(t) for t in prompt]
    if not toks:
        raise ValueError("the prompt is empty")
    bad = [t for t in toks if not 0 <= t < model.n_vocab]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0..{model.n_vocab - 1})")
    return toks


def sampler_for(model, n_ctx: int, history: list[int], s: Sampling):
    """llama.cpp's sampler chain for one answer (history: the conversation so far, for the penalties). Its grammar
    and penalties see the answer's tokens through llama_sampler_sample only: verification teacher-forces tokens
    already sampled (and accepted) and re-decodes the last one for its logits, which samples nothing; so a
    grammar sees each answer token once, in order, whatever the gate decides."""
    bad = [t for t in (s.logit_bias or {}) if not 0 <= t < model.n_vocab]
    if bad:
        raise ValueError(f"logit_bias: token ids {bad[:5]} are outside the vocabulary (0..{model.n_vocab - 1})")
    last_n = n_ctx if s.penalty_last_n == -1 else s.penalty_last_n
    return make_sampler(s.temperature, s.top_k, s.top_p, s.seed, min_p=s.min_p,
                        repeat_penalty=s.repeat_penalty, presence_penalty=s.presence_penalty,
                        frequency_penalty=s.frequency_penalty, penalty_last_n=last_n,
                        recent=history[-last_n:] if last_n > 0 else [], logit_bias=s.logit_bias,
                        grammar=s.grammar, model=model)


def progress_of(fn: Callable[[int, int], None] | None, total: int) -> Callable[[int], None] | None:
    """The prefill's per-batch callback (turn.Pipeline.progress: n tokens read) as fn(done, total), or None."""
    if fn is None:
        return None
    done = 0

    def step(n: int) -> None:
        nonlocal done
        done += n
        fn(min(done, total), total)
    return step

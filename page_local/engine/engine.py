"""The engine: one turn of PAGE-gated eviction on llama.cpp, and the API desktop apps embed.

A turn (docs/design.md §5, "One turn through the engine"; every step is a turn.Pipeline method):
  1. tokenize; prefill: decode prompt[:-W], then prompt[-W:] as one batch with the probe armed;
  2. D = signal.drop(probe); the base gate (gate.BASE_MODE) decides open or closed;
  3. open and T > B: keep = evictor.select(...). Gate modes page/always evict now (in place, the last
     prompt token re-decoded so the first sampled token sees the compressed cache); the verify modes
     build the evicted copy as a candidate and generate from the full cache until the answer ends or
     verify_tokens, then teacher-force those tokens on the candidate in one batch and commit it only
     if verify.verify_score passes;
  4. generate with our own sampler loop (llama-cpp-python's Llama.generate assumes contiguous
     positions, which an evicted sequence does not have).

    with Engine(budget=0.25) as eng:
        out = eng.generate("Summarise: ...", max_tokens=64)
        print(out.text, out.decision.evicted, out.decision.D)

        stream = eng.stream("And in one line?")   # continues the conversation
        for piece in stream:
            print(piece, end="")
        print(stream.result.finish_reason)
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from page_local import defaults
from page_local.engine import attention
from page_local.engine.decision import Decision, Result, Sampling
from page_local.engine.generation import AnswerLoop
from page_local.engine.parking import N_SEQ, PARK_SEQ, Parking, park_from_for
from page_local.engine.room import RoomMaker, answer_room, check_on_full, reread_from
from page_local.engine.selfcheck import AfterAnswer, Backoff, Payback, SelfCheck, unpaid
from page_local.engine.settings import SettingError, TurnSettings
from page_local.engine.transcript import Transcript
from page_local.engine.turn import AFTER_ANSWER, N_SINK, W, Pipeline, supported
from page_local.errors import ContextFull, EngineBusy, StateFileError
from page_local.evictors import get_evictor
from page_local.evictors.base import resolve_budget
from page_local.gate import BASE_MODE, SEARCH_MODES, VERIFY_MODES, Gate, check_gate_mode
from page_local.native.runtime import Context, ContextConfig, Model
from page_local.native.sampler import make_sampler
from page_local.store import models
from page_local.store.persist import Snapshot
from page_local.store.gguf import model_identity
from page_local.verify import VERIFY_CAP, VERIFY_RULE, check_rule

__all__ = ["Decision", "Engine", "Result", "Sampling", "SettingError", "Stream", "TurnSettings"]


class Stream:
    """One turn's answer as it is generated: iterate it for text pieces.

    .decision is set once the prompt is prefilled and gated (before the first piece); under the verify
    modes it is updated when the check decides. .result is set when the iteration ends, also when it is
    interrupted or closed early (finish_reason "interrupted")."""

    def __init__(self, run: Callable[[Stream], Iterator[str]] | None = None):
        self.decision: Decision | None = None
        self.result: Result | None = None
        self.logprobs: list = []  # Sampling.logprobs set: Result.logprobs so far, one entry per token yielded
        self._gen = run(self) if run is not None else iter(())

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> str:
        return next(self._gen)

    def close(self) -> None:
        """Stop generating: the tokens yielded so far stay in the conversation (finish "interrupted")."""
        self._gen.close()

    @property
    def running(self) -> bool:
        return bool(getattr(self._gen, "gi_running", False))


MIN_BATCH = 64  # Engine(n_batch=...): room for the probe's window (turn.W tokens) in one batch


class Engine:
    """A model, a context and the PAGE pipeline. Not thread-safe: use one engine per thread."""

    def __init__(self, model: str | os.PathLike | Model | None = None, n_ctx: int = defaults.N_CTX,
                 budget: float | int = defaults.BUDGET, evictor: str = defaults.EVICTOR, gate: str = defaults.GATE,
                 threads: int = defaults.THREADS, flash_attn: str | None = None,
                 cache_type: str | None = None, seed: int = 0, evictor_options: dict | None = None,
                 verify_tokens: int = VERIFY_CAP, verify_threshold: float | None = None,
                 verify_rule: str = VERIFY_RULE, compact: bool = True,
                 n_gpu_layers: int | str | None = None, allow_long_context: bool = False,
                 on_full: str = defaults.ON_FULL, ladder=defaults.LADDER, rpc=None, autotune: bool = True,
                 tune_progress=None, n_batch: int = 512,
                 attention_settings: attention.AttentionSettings | None = None, type_kv: str | None = None,
                 park: bool = False, park_from: int | None = None, reread: bool = False):
        """model: a GGUF path, None for the embedded default, or a loaded native Model that several engines
        share (a server's slots: one copy of the weights). A shared Model is borrowed: close() leaves it to
        its owner, who closes it after every engine on it; n_gpu_layers and rpc are then the Model's own.
        n_batch: the most prompt tokens decoded at once (llama.cpp's -b; a prefill's progress is reported and can be
        stopped between batches), at least 64 (the probe's window rides on one batch); the physical batch is
        min(n_batch, 512).
        flash_attn: auto (page-local's choice: engine/attention.py) | on | off; cache_type: f16 | q8_0 | q4_0
        (type_kv: its older name, still accepted); each None = $PAGE_LOCAL_FLASH_ATTN / $PAGE_LOCAL_CACHE_TYPE,
        else auto / f16. Or attention_settings: both as one attention.AttentionSettings, already resolved (the
        CLI's); the environment is then not read. rpc: HOST:PORT of ggml-rpc-servers whose devices take
        offloaded layers (None = $PAGE_LOCAL_RPC, () = none). park: evict for speed by parking (engine/parking.py:
        the cells stay in memory and each message chooses again), from park_from cells on (None: where it pays for
        this model and cache type, parking.park_from_for). reread: a message after one that room-making cut reads
        the conversation again from the first token it deleted, ranked by the new message (room.py, "Reading
        again"): what the cut deleted can come back for a later question, at the cost of reading it again."""
        if isinstance(n_batch, bool) or not isinstance(n_batch, int) or n_batch < MIN_BATCH:
            raise ValueError(f"n_batch must be an int of at least {MIN_BATCH}, got {n_batch!r}")
        shared = model if isinstance(model, Model) else None
        if shared is not None and shared.closed:
            raise ValueError("the shared Model is closed")
        path = shared.path if shared is not None else Path(model) if model is not None else models.default_model_path()
        self.set_verify(verify_tokens, verify_threshold, verify_rule)
        self.compact = bool(compact)
        # what a turn that does not fit does: "evict" earlier turns (room.py), or "refuse" (ContextFull)
        self.on_full = check_on_full(on_full)
        self.n_keep = 0  # positions below it are never evicted to make room (ChatSession: the system prompt)
        self.set_budget(budget)
        self.set_park(park, park_from)
        self.reread = bool(reread)
        self.set_ladder(ladder)
        self._evictor = supported(get_evictor(evictor, **(evictor_options or {})))
        self.gate_mode = check_gate_mode(gate)  # validates the mode before loading anything
        check_pair(self._evictor, self.gate_mode)
        # n_gpu_layers: a count, 'all', or None = $PAGE_LOCAL_N_GPU_LAYERS, else all on a GPU build, else 0
        # (Model validates it before loading anything)
        self.seed = seed
        self._lock = threading.Lock()
        self._active: Stream | None = None  # the stream holding the lock, if one is suspended mid-answer
        # the attention arguments as one value, the environment read once for what was not given; the pair is
        # checked before the model is loaded
        asked = attention.engine_settings(attention_settings, flash_attn, cache_type, type_kv)
        attention.resolve(asked.flash_attn, asked.cache_type, "CPU", n_ctx, None)
        # autotune: with no tuning stored for flash_attn auto, measure one now, once (attention.first_use; at most
        # $PAGE_LOCAL_AUTOTUNE seconds, default 30; off skips it); tune_progress(text, fraction) while it runs
        attention.autotune_budget()
        self._owns_model = shared is None
        self.model = shared if shared is not None else Model(path, n_gpu_layers=n_gpu_layers, rpc=rpc)
        try:
            self.attention, self.attention_warning = attention.choose(path, self.model, threads, n_ctx, asked,
                                                                      autotune, tune_progress)
            self.ctx = Context(self.model, ContextConfig(n_ctx=n_ctx, threads=threads, n_batch=n_batch,
                                                         n_ubatch=min(n_batch, ContextConfig.n_ubatch),
                                                         flash_attn=self.attention.flash_attn,
                                                         type_kv=self.attention.cache_type, n_seq_max=N_SEQ,
                                                         allow_long_context=allow_long_context))
        except Exception:
            if self._owns_model:
                self.model.close()
            raise
        try:
            self.ctx.cells_used(0)  # UnsupportedModel now (no KV cache: encoder-only...), not on the first turn
        except Exception:
            self.close()
            raise
        self.model_id = model_identity(path)
        self.gate = Gate.for_model(self.model_id, BASE_MODE[gate])
        self.profile_warning = self.gate.warning
        self.conv = Transcript()  # the conversation's tokens, their positions, what room-making evicted
        self.pipeline = Pipeline(self.ctx, self.model)  # the turn's steps (turn.py), shared with eval and bench
        self.room = RoomMaker(self.ctx, self.model, self.pipeline)  # room on demand (room.py)
        self.pipeline.spans = lambda held: self.room.spans(self.conv, held)  # sentences, for snapkv-spans
        self.parking = Parking(self.ctx)  # cells the speed budget parked (parking.py)
        if self.park_from is None:
            self.park_from = self.default_park_from()
        self.backoff = Backoff()  # a check refused turn after turn rests (selfcheck.py)
        self.payback = Payback()  # with parking: how long this conversation's answers go on after the check
        self._progress_fn = None  # set_progress

    # --- settings ----------------------------------------------------------------------------
    def set_budget(self, budget: float | int) -> None:
        resolve_budget(budget, 10_000, W, N_SINK)  # validates (ratio or absolute) before use
        self.budget = budget

    def set_park(self, park: bool, park_from: int | None = None) -> None:
        """park: the speed budget parks cells (they stay in memory, out of the attention, and each message chooses
        again) instead of evicting them for good; below park_from cells the full cache is kept (None: this model's
        default, default_park_from)."""
        if park_from is not None and (isinstance(park_from, bool) or not isinstance(park_from, int) or park_from < 0):
            raise ValueError(f"park_from must be an int >= 0, got {park_from!r}")
        if not park and getattr(self, "parking", None) is not None and self.parking.count():
            with self._busy():  # no message would bring them back any more: the conversation whole again, now
                self.parking.unpark(self.conv, 0)
        self.park = bool(park)
        self.park_from = park_from if park_from is not None or getattr(self, "ctx", None) is None \
            else self.default_park_from()

    def default_park_from(self) -> int:
        """Where parking starts to pay for this model and cache type (parking.park_from_for)."""
        from page_local.store.sizing import CACHE_BYTES

        m = self.model
        head = m.n_embd // m.n_head
        cell = m.n_layer * m.n_head_kv * 2 * head * CACHE_BYTES[self.attention.cache_type]
        return park_from_for(Path(m.path).stat().st_size, cell)

    def set_ladder(self, ladder) -> None:
        """The budgets gate mode 'search' tries (ratios of the conversation or cell counts), e.g. the
        default (1/16, 1/8, 1/4, 1/2). At most 4 rungs: each is one candidate sequence."""
        rungs = tuple(ladder)
        if not 1 <= len(rungs) <= 4:
            raise ValueError(f"the ladder must have 1 to 4 budgets, got {len(rungs)}")
        for r in rungs:
            resolve_budget(r, 10_000, W, N_SINK)  # validates each
        self.ladder = rungs

    def set_evictor(self, name: str, **options) -> None:
        ev = supported(get_evictor(name, **options))
        check_pair(ev, self.gate_mode)
        self._evictor = ev

    def set_gate(self, mode: str) -> None:
        """page | always | never | verify | page+verify | search | page+search (see GATE_MODES)."""
        self.set_gate_and_evictor(mode, self.evictor)

    def set_gate_and_evictor(self, mode: str, evictor: str) -> None:
        """Both at once, the pair checked as it will be (an evictor that reads the answer needs a verify
        gate): for callers that change both and must not fail on the order."""
        mode = check_gate_mode(mode)
        ev = self._evictor if evictor == self.evictor else supported(get_evictor(evictor))
        check_pair(ev, mode)
        self._evictor, self.gate_mode = ev, mode
        self.gate = Gate(BASE_MODE[mode], self.gate.profile)

    def set_verify(self, tokens: int = VERIFY_CAP, threshold: float | None = None, rule: str = VERIFY_RULE) -> None:
        """tokens: the most answer tokens checked (the check ends earlier with the answer); rule and
        threshold: verify.RULES (threshold None = the rule's default)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= 256:
            raise ValueError(f"verify_tokens must be an int in [1, 256], got {tokens!r}")
        rule, threshold = check_rule(rule, threshold)
        self.verify_tokens, self.verify_threshold, self.verify_rule = tokens, threshold, rule

    def set_progress(self, fn) -> None:
        """fn: None, or fn(done, total) called after each batch of a turn's prefill (room-making's parts
        included): `done` of the message's `total` tokens are read (done may pass total by the few tokens
        room-making reads twice). The REPL shows it; it runs on the thread that iterates the stream."""
        self._progress_fn = fn

    def _progress_of(self, total: int):
        fn = self._progress_fn
        if fn is None:
            return None
        done = 0

        def step(n: int) -> None:
            nonlocal done
            done += n
            fn(min(done, total), total)
        return step

    def set_cancel(self, flag) -> None:
        """flag: None, or an object with is_set() (a threading.Event) that another thread may set. Once it
        is set, a prefill (of a turn, of prefill(), of measure()) stops before its next batch of n_batch
        tokens (one ubatch) with Cancelled, and the conversation is as it was before the message (room
        made for it included). Generation is not affected: stop a Stream with close()."""
        self.pipeline.cancel = flag

    @property
    def evictor(self) -> str:
        return self._evictor.name

    @property
    def n_ctx(self) -> int:
        return self.ctx.n_ctx

    @property
    def placement(self) -> dict:
        """Which device holds the layers and the KV cache: {"layers", "kv_cache", "n_gpu_layers", ...}."""
        return self.ctx.placement()

    def rewind(self, n_tokens: int) -> None:
        """Forget the conversation after its first n_tokens tokens (history[n_tokens:] and their cells):
        what a client that resends a conversation with a different ending needs. Position i holds
        history[i], so the cells kept are those of the prefix, with whatever eviction left of it."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or not 0 <= n_tokens <= len(self.history):
            raise ValueError(f"n_tokens must be an int in [0, {len(self.history)}], got {n_tokens!r}")
        with self._busy():
            self._rewind(n_tokens)

    def _rewind(self, n_tokens: int) -> None:
        if n_tokens == 0:
            self.reset()
            return
        if n_tokens < len(self.history):
            self.parking.unpark(self.conv, 0)  # the tail's parked cells go with it, the others are held again
            self.ctx.seq_rm(0, self.conv.pos[n_tokens], -1)
            self.payback.reset()  # the answers it remembered may be gone
        self.conv.truncate(n_tokens)
        if n_tokens <= self.backoff.at:  # the message the refusals were counted on is gone
            self.backoff.reset()

    def snapshot(self) -> Snapshot:
        """The conversation's cache and token history, copied to host memory (see restore)."""
        parked = sorted(self.parking.scores)
        return Snapshot(model_id=self.model_id, n_ctx=self.n_ctx, history=tuple(self.history),
                        positions=tuple(int(p) for p in self.ctx.page.positions(0)), state=self.ctx.seq_state(0),
                        history_pos=None if self.conv.pos == list(range(len(self.conv.pos))) else tuple(self.conv.pos),
                        parked_state=self.ctx.seq_state(PARK_SEQ) if parked else b"", parked=tuple(parked),
                        parked_scores=tuple(self.parking.scores[p] for p in parked),
                        answers_after=tuple(self.payback.after))

    def restore(self, snap: Snapshot) -> None:
        """Replace the conversation with a snapshot (of this model, fitting this n_ctx). StateFileError if
        it cannot be restored; the conversation is then the one before the call, never half restored."""
        if snap.model_id != self.model_id:
            raise StateFileError(f"the cache was saved with another model ({snap.model_id}), not the loaded one "
                                 f"({self.model_id})")
        if len(snap.positions) + len(snap.parked) > self.n_ctx:
            raise StateFileError(f"the cache holds {len(snap.positions) + len(snap.parked)} cells; this engine's "
                                 f"n_ctx is {self.n_ctx}")
        with self._busy():
            self._restore(snap)

    def _restore(self, snap: Snapshot) -> None:
        before = self.snapshot() if self.history else None
        why = None
        self.reset()
        try:
            self.ctx.set_seq_state(snap.state, 0)
            if tuple(int(p) for p in self.ctx.page.positions(0)) != snap.positions:
                why = "the restored cache does not hold the saved positions"
            elif snap.parked:
                self.ctx.set_seq_state(snap.parked_state, PARK_SEQ)
                if tuple(int(p) for p in self.parking.positions()) != snap.parked:
                    why = "the restored cache does not hold the saved parked positions"
                else:
                    self.parking.scores = dict(zip(snap.parked, snap.parked_scores))
                    self.parking.lay_out(0)
        except Exception as e:  # noqa: BLE001 -- llama.cpp's refusal, told in the message
            a = self.attention
            why = (f"llama.cpp refused the cache: {e} (this engine runs flash attention {a.flash_attn} with "
                   f"cache type {a.cache_type}; a cache saved under another flash-attention setting or cache type "
                   "restores only under that one: --flash-attn / --cache-type)")
        if why is None:
            self.conv = Transcript(list(snap.history), _positions(snap),
                                   None if len(snap.positions) < len(snap.history) else set())
            self.payback.after = list(snap.answers_after)[-Payback.RECENT:]
            if not self.park and self.parking.count():  # set aside by a parking engine: no message here brings
                self.parking.unpark(self.conv, 0)  # them back, so they come back now
            return
        self.reset()
        if before is not None:  # put the conversation back as it was
            self.ctx.set_seq_state(before.state, 0)
            self.conv = Transcript(list(before.history), _positions(before))
            if before.parked:
                self.ctx.set_seq_state(before.parked_state, PARK_SEQ)
                self.parking.scores = dict(zip(before.parked, before.parked_scores))
                self.parking.lay_out(0)
        raise StateFileError(why)

    def cells_used(self) -> int:
        return self.ctx.cells_used(0)

    @property
    def history(self) -> list[int]:
        """The conversation's tokens in sequence 0, in order (evicted ones included)."""
        return self.conv.history

    # --- room on demand (room.py) ------------------------------------------------------------
    @property
    def room_ranking(self) -> str:
        return self.room.ranking

    def set_room_ranking(self, mode: str) -> None:
        """'question' (the default: the message's own last W tokens rank the cells room-making evicts),
        'question+generic' (a share ranked by a generic query, room.GENERIC_SHARE) or 'recent' (the conversation's
        newest queries, the earlier ranking, kept to compare): room.ROOM_RANKINGS."""
        self.room.set_ranking(mode)

    @property
    def room_evictor(self):
        return self.room.evictor

    def set_room_evictor(self, name: str, **options) -> None:
        """The evictor that ranks the cells room-making evicts; it may need nothing but the probe and the sentence
        spans room-making provides (room.ROOM_PROVIDES: snapkv-spans, the default, keeps whole sentences)."""
        self.room.set_evictor(name, **options)

    def turn_settings(self, gate: str | None = None, evictor: str | None = None, budget: float | int | None = None,
                      verify_tokens: int | None = None, on_full: str | None = None) -> TurnSettings:
        """The settings a turn runs with: the engine's, with these overrides (None: the engine's). Each is
        checked by the engine's own rule; SettingError (a ValueError) names the one refused. Pass the value to
        stream() or generate(): the engine's own settings are left as they are."""
        mode, ev = self.gate_mode, self._evictor
        try:
            if gate is not None:
                mode = check_gate_mode(gate)
        except ValueError as e:
            raise SettingError("gate", str(e)) from None
        try:
            if evictor is not None and evictor != ev.name:
                ev = supported(get_evictor(evictor))
        except ValueError as e:
            raise SettingError("evictor", str(e)) from None
        try:
            check_pair(ev, mode)
        except ValueError as e:
            raise SettingError("evictor" if evictor is not None else "gate", str(e)) from None
        try:
            if budget is not None:
                resolve_budget(budget, 10_000, W, N_SINK)
        except ValueError as e:
            raise SettingError("budget", str(e)) from None
        if verify_tokens is not None and (isinstance(verify_tokens, bool) or not isinstance(verify_tokens, int)
                                          or not 1 <= verify_tokens <= 256):
            raise SettingError("verify_tokens", f"verify_tokens must be an int in [1, 256], got {verify_tokens!r}")
        try:
            full = check_on_full(on_full) if on_full is not None else self.on_full
        except ValueError as e:
            raise SettingError("on_full", str(e)) from None
        # the engine's Gate (its calibration, a threshold set on it) unless the mode changes
        g = self.gate if mode == self.gate_mode else Gate(BASE_MODE[mode], self.gate.profile)
        return TurnSettings(gate_mode=mode, gate=g, evictor=ev, budget=self.budget if budget is None else budget,
                            ladder=self.ladder, verify_tokens=verify_tokens or self.verify_tokens,
                            verify_rule=self.verify_rule, verify_threshold=self.verify_threshold, on_full=full,
                            n_keep=self.n_keep, compact=self.compact, seed=self.seed, park=self.park,
                            park_from=self.park_from, reread=self.reread)

    def _fit_and_prefill(self, t: TurnSettings, toks: list[int], reserve: int, evict_now: bool,
                         select: bool = True) -> tuple[Decision, tuple | None]:
        """The turn's prefill through room-making (RoomMaker.fit): the message's last part is prefilled,
        probed and gated here."""
        def save():
            return (self.snapshot() if self.history else None,
                    None if self.conv.room_out is None else set(self.conv.room_out))

        def back(point) -> None:
            before, room_out = point
            self.reset()
            if before is not None:
                self._restore(before)
                self.conv.room_out = room_out

        restored, dropped = self.parking.unpark(self.conv, len(toks) + reserve) if t.park else (0, 0)
        dec, plan = self.room.fit(self.conv, toks, reserve, t.room_rules,
                                  lambda part: self._prefill_and_gate(t, part, evict_now=evict_now, select=select,
                                                                      gap=reserve),
                                  save, back)
        dec.restored, dec.park_dropped = restored, dropped
        return dec, plan

    def cache_map(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Which tokens of the conversation the cache holds now, and why the others went: (bool
        (len(history),) held, bool (len(history),) evicted to make room or None when that is not known: a
        conversation restored from a snapshot). A token neither held nor evicted for room was evicted by
        the speed budget (the gate's Decision)."""
        with self._busy():
            held = np.zeros(len(self.history), dtype=bool)
            held[self.conv.indices_of(self.ctx.page.positions(0))] = True
            if self.conv.room_out is None:
                return held, None
            room = np.zeros(len(self.history), dtype=bool)
            room[[i for i in self.conv.room_out if i < room.size]] = True
            return held, room & ~held

    def parked_map(self) -> np.ndarray:
        """bool (len(history),): the tokens of the conversation parked now (engine/parking.py: in memory, out of
        the attention, back before the next message)."""
        with self._busy():
            out = np.zeros(len(self.history), dtype=bool)
            parked = self.parking.positions()
            if parked.size:
                out[self.conv.indices_of(parked)] = True
            return out

    def reset(self) -> None:
        """Forget the conversation: the KV cache is cleared."""
        self.ctx.clear()
        self.conv.clear()
        self.parking.clear()
        self.backoff.reset()
        self.payback.reset()

    # --- one turn ----------------------------------------------------------------------------
    def stream(self, prompt: str | list[int], max_tokens: int = defaults.MAX_TOKENS, sampling: Sampling | None = None,
               add_special: bool = True, settings: TurnSettings | None = None) -> Stream:
        """Continue the conversation with `prompt`; returns a Stream of text pieces (see Stream). settings:
        what this turn runs with (turn_settings(...) with a request's overrides); None: the engine's."""
        def run(out: Stream) -> Iterator[str]:
            with self._busy():
                self._active = out
                try:
                    yield from self._turn(prompt, max_tokens, sampling or Sampling(), add_special, out,
                                          settings or self.turn_settings())
                finally:
                    self._active = None
        return Stream(run)

    def generate(self, prompt: str | list[int], max_tokens: int = defaults.MAX_TOKENS,
                 sampling: Sampling | None = None, on_text: Callable[[str], None] | None = None,
                 add_special: bool = True, settings: TurnSettings | None = None) -> Result:
        """Run one turn on a fresh cache (the conversation is reset first) and return the Result."""
        out = Stream()  # holds the decision and the result
        # Take the lock before reset(): a second thread must get EngineBusy, not clear the cache under
        # the turn that is running.
        with self._busy():
            self.reset()
            for piece in self._turn(prompt, max_tokens, sampling or Sampling(), add_special, out,
                                    settings or self.turn_settings()):
                if on_text:
                    on_text(piece)
        return out.result

    def measure(self, prompt: str | list[int], add_special: bool = True) -> Decision:
        """Prefill `prompt` on a fresh cache, probe and gate it, without evicting or generating
        (for calibration and inspection)."""
        with self._busy():
            self.reset()
            toks = self._tokens(prompt, add_special)
            if len(toks) + 1 > self.ctx.n_ctx:
                raise ContextFull(0, len(toks) + 1, self.ctx.n_ctx)
            dec, _ = self._prefill_and_gate(self.turn_settings(), toks, select=False)
            return dec

    def prefill(self, prompt: str | list[int], add_special: bool = True) -> Decision:
        """Append `prompt` to the conversation without generating (a replayed conversation, a system
        prompt). The gate runs as for a live turn under page/always; under the verify modes the speed
        budget evicts nothing (there is no answer to check the candidate on) and the Decision says so.
        A prompt that does not fit is handled by the context policy (on_full), as a live turn's."""
        with self._busy():
            toks = self._tokens(prompt, add_special)
            t = self.turn_settings()
            verify = t.verifies
            dec, _ = self._fit_and_prefill(t, toks, 1, evict_now=True, select=not verify)
            if verify:
                dec.reason = ("prefilled without an answer: self-verification has nothing to check, so the "
                              "speed budget evicted nothing")
            return dec

    @contextmanager
    def _busy(self):
        """One turn at a time: a second caller gets EngineBusy instead of waiting or corrupting the cache."""
        if not self._lock.acquire(blocking=False):
            raise EngineBusy("this Engine is already generating in another thread; use one Engine per thread")
        try:
            yield
        finally:
            self._lock.release()

    def _tokens(self, prompt: str | list[int], add_special: bool) -> list[int]:
        if self.ctx is None:
            raise ValueError("this Engine is closed")
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("the prompt is empty")
            toks = self.model.tokenize(prompt, add_special=add_special and not self.history)
        else:
            toks = [int(t) for t in prompt]
            if not toks:
                raise ValueError("the prompt is empty")
            bad = [t for t in toks if not 0 <= t < self.model.n_vocab]
            if bad:
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.model.n_vocab - 1})")
        return toks

    def _turn(self, prompt, max_tokens: int, sampling: Sampling, add_special: bool, stream: Stream,
              t: TurnSettings) -> Iterator[str]:
        sampling.validate()
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        toks = self._tokens(prompt, add_special)
        ctx = self.ctx
        # room kept for the answer when room is made: a normal answer's, not max_tokens' (never upfront: an
        # answer that grows past it makes room from earlier turns then); the verify modes also need the
        # candidate's copy of it
        reserve = answer_room(max_tokens, ctx.n_ctx)
        if t.verifies:  # one copy of the answer (search batches first chunks if room is left)
            reserve += min(max_tokens, t.verify_tokens) + 1
        start = len(self.history)  # where this message begins: an answer never evicts it to make room
        again = reread_from(self.conv) if t.reread and t.on_full == "evict" else None
        if again is not None:  # read the conversation again from the first token room-making deleted
            toks = self.history[again:] + toks
            self._rewind(again)
        self.pipeline.progress = self._progress_of(len(toks))
        try:
            dec, plan = self._fit_and_prefill(t, toks, reserve, evict_now=not t.verifies)
        finally:
            self.pipeline.progress = None
        if again is not None:
            dec.reread = start - again
        stream.decision = dec

        # generation (generation.py), with the verify cap and room for a growing answer plugged in
        park = None
        if t.park:
            def park(drop: np.ndarray, answered: int) -> None:  # a passed check parks instead of evicting
                self.parking.park(drop, max(0, reserve - answered))
                dec.parked = self.parking.count()
        if plan is not None and t.park and max_tokens >= t.verify_tokens:  # an answer that can reach the cap
            expected = self.payback.expected(max_tokens, t.verify_tokens)
            if expected < Payback.tokens(t.verify_tokens):  # a check there could not pay back: none is prepared
                plan = None
                unpaid(dec, t.verify_tokens, expected)
        check = None if plan is None else SelfCheck(ctx, self.pipeline, dec, plan, t.verify_rule, t.verify_threshold,
                                                    t.verify_tokens, t.ladder, t.compact, park=park)
        room = None if t.on_full != "evict" else (lambda: self._answer_room(dec, reserve, start, t))
        sampler = self._sampler(sampling)
        loop = AnswerLoop(ctx, self.model, self.conv, sampler, max_tokens, self.room.pos_limit,
                          logprobs=sampling.logprobs, check=check, room=room, record=stream.logprobs,
                          parked=self.parking.count)
        try:
            yield from loop
            if check is not None and dec.verify_m is not None:  # the check ran: its verdict counts
                self.backoff.record(dec.evicted, start)
            if t.park and t.verifies and loop.finish != "interrupted":
                self.payback.record(len(loop.out), t.verify_tokens)
        finally:
            ctx.seq_rm(1, -1, -1)  # an unfinished verification leaves nothing behind
            sampler.close()
            out = loop.out
            stream.result = Result(self.model.detokenize(out), out, dec, loop.finish, len(toks), loop.seconds,
                                   list(stream.logprobs) if sampling.logprobs is not None else None)

    def _answer_room(self, dec: Decision, reserve: int, start: int, t: TurnSettings) -> bool:
        """Room for a growing answer: parked cells go for good first (the lowest ranked), then earlier turns."""
        if self.parking.count():
            n = self.parking.drop(self.conv, max(1, reserve // 4))
            dec.room_evicted += n
            self.parking.lay_out(max(1, reserve // 4))
            return True
        return self.room.for_answer(self.conv, dec, reserve, start, t.room_rules)

    def _sampler(self, sampling: Sampling):
        """llama.cpp's sampler chain for this answer. Its grammar and penalties see the answer's tokens
        through llama_sampler_sample only: verification teacher-forces tokens already sampled (and
        accepted) and re-decodes the last one for its logits, which samples nothing; so a grammar sees
        each answer token once, in order, whatever the gate decides."""
        s = sampling
        bad = [t for t in (s.logit_bias or {}) if not 0 <= t < self.model.n_vocab]
        if bad:
            raise ValueError(f"logit_bias: token ids {bad[:5]} are outside the vocabulary "
                             f"(0..{self.model.n_vocab - 1})")
        last_n = self.ctx.n_ctx if s.penalty_last_n == -1 else s.penalty_last_n
        return make_sampler(s.temperature, s.top_k, s.top_p, s.seed, min_p=s.min_p,
                            repeat_penalty=s.repeat_penalty, presence_penalty=s.presence_penalty,
                            frequency_penalty=s.frequency_penalty, penalty_last_n=last_n,
                            recent=self.history[-last_n:] if last_n > 0 else [], logit_bias=s.logit_bias,
                            grammar=s.grammar,
                            model=self.model)

    def _prefill_and_gate(self, t: TurnSettings, toks: list[int], evict_now: bool = True,
                          select: bool = True, gap: int = 0) -> tuple[Decision, tuple | None]:
        """Prefill, probe, gate and (evict_now) evict. Returns the Decision and, when the gate opened
        and T > B but evict_now is False, the eviction plan (keep, held, last_pos, last_tok) for the
        verify modes. select=False: gate only (measure). An interrupted or failed prefill leaves
        nothing of the turn in the cache."""
        ctx = self.ctx
        pos0 = ctx.seq_pos_max(0) + 1
        n_hist = len(self.history)
        try:
            return self._prefill_and_gate_impl(t, toks, pos0, evict_now, select, gap)
        except BaseException:
            ctx.seq_rm(0, pos0, -1)
            ctx.page.disarm_probe()
            self.conv.truncate(n_hist)
            raise

    def _prefill_and_gate_impl(self, t: TurnSettings, toks, pos0, evict_now, select, gap):
        pipe, ev = self.pipeline, t.evictor
        t0 = time.perf_counter()
        pre = pipe.prefill(toks, pos0, 0, track_attention=select and "prefill_attention" in ev.needs)
        self.conv.extend(toks, pos0)
        if t.park and pre.probe is not None:
            self.parking.ranked(pre.probe)  # every cell's score by this message: which parked ones go first
        # the speed budget is a share of the whole conversation, so a turn evicts only what brings the
        # cells back to it: earlier turns are not cut again by the same ratio on every turn
        T = len(self.history)
        B = resolve_budget(t.budget, T, W, N_SINK)
        g = t.gate.decide(pre.D, n_tokens=T) if (pre.D is not None or t.gate.mode != "page") else None
        t3 = time.perf_counter()
        is_open = bool(g.open) if g else False
        evicted, plan, lookahead_ms = False, None, None
        would_evict = is_open and pre.T > B and select
        # parking: below park_from eviction does not pay, the full cache is kept
        short = would_evict and t.park and pre.T < t.park_from
        # a check refused turn after turn rests: the full cache, unchecked (selfcheck.Backoff)
        refused = self.backoff.refused
        rested = would_evict and not short and t.verifies and self.backoff.resting()
        if would_evict and not short and not rested:
            last_pos, last_tok = pos0 + len(toks) - 1, toks[-1]
            signals = pipe.signals(ev.needs, pre, last_pos, last_tok, spec=getattr(ev, "spec", None),
                                   restore_logits=not evict_now)
            if "lookahead" in signals:
                lookahead_ms = signals["lookahead"].ms
            if t.gate_mode in SEARCH_MODES:  # one keep set per rung, smallest first, from one probe
                rungs = sorted({resolve_budget(r, T, W, N_SINK) for r in t.ladder})
                rungs = [b for b in rungs if b < pre.T] or [B]
            else:
                rungs = [B]
            if ev.needs & AFTER_ANSWER:  # the keep sets wait for the full cache's answer (_verify)
                plan = (AfterAnswer(pipe, ev, pre, rungs, last_pos, signals, t.seed), pre.held, last_pos, last_tok)
            elif t.gate_mode in SEARCH_MODES:
                plan = ([(b, pipe.select(ev, pre, b, signals, t.seed)) for b in rungs], pre.held, last_pos, last_tok)
            else:
                keep = pipe.select(ev, pre, B, signals, t.seed)
                if evict_now:
                    pipe.evict_in_place(0, keep, pre.held, last_pos, last_tok, compact=t.compact,
                                        park=PARK_SEQ if t.park else None, gap=gap)
                    if t.park:
                        self.parking.note(np.setdiff1d(pre.held[pre.held != last_pos], keep))
                    evicted = True
                else:
                    plan = ([(B, keep)], pre.held, last_pos, last_tok)
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
        kept = self.cells_used()
        parked = self.parking.count()
        return Decision(
            T=T, B=B, D=pre.D, z=g.z if g else None, open=is_open, evicted=evicted, kept=kept,
            compression=T / kept if kept else 1.0, gate_mode=t.gate_mode,
            rule=g.rule if g else "none", reason=reason,
            evictor=ev.name, prefill_ms=pre.prefill_ms, probe_ms=pre.probe_ms,
            gate_ms=(t3 - t0) * 1e3 - pre.prefill_ms - pre.probe_ms, evict_ms=(t4 - t3) * 1e3,
            agreement=pre.agreement, lookahead_ms=lookahead_ms, gate_note=g.note if g else None, parked=parked,
            park_from=t.park_from if short else None, check_rested=refused if rested else None, **verify), plan

    # --- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Free the context and the model (a shared Model is left to its owner). Refused (EngineBusy) while a
        turn is running in another thread."""
        active = getattr(self, "_active", None)
        if active is not None and not active.running:  # a stream left suspended in this thread: end it
            active.close()
        if not self._lock.acquire(blocking=False):
            raise EngineBusy("this Engine is generating in another thread; stop that turn before closing the engine")
        try:
            if getattr(self, "ctx", None) is not None:
                self.ctx.close()
                self.ctx = None
            if getattr(self, "model", None) is not None:
                if getattr(self, "_owns_model", True):
                    self.model.close()
                self.model = None
        finally:
            self._lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def check_pair(evictor, gate_mode: str) -> None:
    """Refuse an evictor that reads the answer under a gate that evicts before there is one."""
    if evictor.needs & AFTER_ANSWER and gate_mode not in VERIFY_MODES:
        raise ValueError(f"evictor {evictor.name!r} scores the prompt by the full cache's answer, which only the "
                         f"verify and search gates decode before evicting (gate is {gate_mode!r}); use gate "
                         "verify, search, page+verify or page+search, or evictor lorekv")


def _positions(snap: Snapshot) -> list[int]:
    """The position of each history token of a snapshot (its index unless gaps were closed)."""
    return list(snap.history_pos) if snap.history_pos else list(range(len(snap.history)))

"""The engine: one turn of PAGE-gated eviction on llama.cpp, and the API desktop apps embed.

The Engine is wiring: it holds the settings and the parts a conversation runs on, and passes values down. A
turn (docs/design.md §5, "One turn through the engine"; message.Messages runs it, every step on the context is a
turn.Pipeline method):
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
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator

import numpy as np

from page_local import defaults
from page_local.engine import attention
from page_local.engine.decision import Decision, Result, Sampling
from page_local.engine.message import Messages, tokens_of
from page_local.engine.parking import N_SEQ, Parking, shape_of
from page_local.engine.room import RoomMaker, check_on_full, check_reread
from page_local.engine.selfcheck import Backoff, Payback
from page_local.engine.settings import (SettingError, TurnSettings, check_budget, check_ladder, check_max_tokens,
                                        check_pair, check_park_from, check_verify_tokens, overrides)
from page_local.engine.prefixes import PrefixDisk
from page_local.engine.snapshots import Snapshots
from page_local.engine.transcript import Transcript
from page_local.engine.turn import Pipeline, supported
from page_local.errors import ContextFull, EngineBusy
from page_local.evictors import get_evictor
from page_local.gate import BASE_MODE, Gate, check_gate_mode
from page_local.native.runtime import Context, ContextConfig, Model
from page_local.store import models
from page_local.store.gguf import model_identity
from page_local.store.persist import Snapshot
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
                 park: bool = False, park_from: int | None = None, reread: bool | str = False, disk_cache=None):
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
        this model and cache type, parking.park_from_for). reread: whether a message after one that room-making
        cut reads the conversation again from the first token it deleted, ranked by the new message (room.py,
        "Reading again"): "never" (False), "always" (True), or "words": when the sentence the message's question
        meets best by its words lost tokens to the cut. What the cut deleted comes back for a later question, at
        the cost of reading it again.
        disk_cache: True (the user's cache folder), a folder or a DiskCache: a long prompt once read is kept there and a
        later conversation starting with it restores it, not reads it (engine/prefixes.py); None/False: off."""
        if isinstance(n_batch, bool) or not isinstance(n_batch, int) or n_batch < MIN_BATCH:
            raise ValueError(f"n_batch must be an int of at least {MIN_BATCH}, got {n_batch!r}")
        shared = model if isinstance(model, Model) else None
        if shared is not None and shared.closed:
            raise ValueError("the shared Model is closed")
        # a path, a registered model's name, or None (the default): store.models.resolve
        path = shared.path if shared is not None else models.resolve(model)
        self.set_verify(verify_tokens, verify_threshold, verify_rule)
        self.compact = bool(compact)
        # what a turn that does not fit does: "evict" earlier turns (room.py), or "refuse" (ContextFull)
        self.on_full = check_on_full(on_full)
        self.n_keep = 0  # positions below it are never evicted to make room (ChatSession: the system prompt)
        self.set_budget(budget)
        park_from = check_park_from(park_from)  # None: the model's own, once it is loaded (default_park_from)
        self.set_reread(reread)
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
        # the parts a conversation runs on, each handed what it works on once (the Transcript is one object for
        # the engine's life: reset and restore change it in place)
        self.conv = Transcript()  # the conversation's tokens, their positions, what room-making evicted
        self.pipeline = Pipeline(self.ctx, self.model)  # the turn's steps (turn.py), shared with eval and bench
        self.room = RoomMaker(self.ctx, self.model, self.pipeline)  # room on demand (room.py)
        self.pipeline.spans = lambda held: self.room.spans(self.conv, held)  # sentences, for snapkv-spans
        # cells the speed budget parked, and whether it parks (parking.py)
        self.parking = Parking(self.ctx, park, park_from, shape_of(self.model, self.attention.cache_type))
        self.backoff = Backoff()  # a check refused turn after turn rests (selfcheck.py)
        self.payback = Payback()  # with parking: how long this conversation's answers go on after the check
        a = self.attention
        self.snapshots = Snapshots(self.ctx, self.conv, self.parking, self.payback, self.model_id, self.reset,
                                   f"this engine runs flash attention {a.flash_attn} with cache type {a.cache_type}")
        self.messages = Messages(self.ctx, self.model, self.conv, self.pipeline, self.room, self.parking,
                                 self.backoff, self.payback, self.snapshots, self._rewind)  # one turn (message.py)
        self.messages.disk = PrefixDisk.of(disk_cache, path, self.model_id, self.attention)  # prefixes.py
        self._progress_fn = None  # set_progress

    # --- settings (each checked by settings.py's rule) ---------------------------------------
    def set_budget(self, budget: float | int) -> None:
        self.budget = check_budget(budget)

    def set_park(self, park: bool, park_from: int | None = None) -> None:
        """park: the speed budget parks cells (kept in memory, out of the attention; each message chooses again)
        instead of evicting them; below park_from cells the full cache is kept (None: default_park_from)."""
        park_from = check_park_from(park_from)
        # switched off, the parked cells come back now (no message would any more): the conversation's to change
        with self._busy() if not park and self.parking.count() else nullcontext():
            self.parking.switch(park, park_from, self.conv)

    def set_reread(self, mode: bool | str) -> None:  # "never", "words", "always" (defaults.REREADS); True, False
        self.reread = check_reread(mode)

    @property
    def park(self) -> bool:
        return self.parking.on

    @property
    def park_from(self) -> int:
        return self.parking.park_from

    def default_park_from(self) -> int:
        """Where parking starts to pay for this model and cache type (parking.park_from_for)."""
        return self.parking.default_from()

    def set_ladder(self, ladder) -> None:
        """The budgets gate mode 'search' tries (ratios of the conversation or cell counts), e.g. the
        default (1/16, 1/8, 1/4, 1/2). At most 4 rungs: each is one candidate sequence."""
        self.ladder = check_ladder(ladder)

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
        check_verify_tokens(tokens)
        rule, threshold = check_rule(rule, threshold)
        self.verify_tokens, self.verify_threshold, self.verify_rule = tokens, threshold, rule

    def set_disk_namespace(self, namespace: str) -> None:
        """Whose saved prompts the next messages read and write in the disk cache (serve: one per API key)."""
        PrefixDisk.in_namespace(self.messages.disk, namespace)

    def set_progress(self, fn) -> None:
        """fn: None, or fn(done, total) called after each batch of a turn's prefill (room-making's parts
        included): `done` of the message's `total` tokens are read (done may pass total by the few tokens
        room-making reads twice). The REPL shows it; it runs on the thread that iterates the stream."""
        self._progress_fn = fn

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

    def turn_settings(self, gate: str | None = None, evictor: str | None = None, budget: float | int | None = None,
                      verify_tokens: int | None = None, on_full: str | None = None) -> TurnSettings:
        """The settings a turn runs with: the engine's, with these overrides (None: the engine's). Each is
        checked by the engine's own rule; SettingError (a ValueError) names the one refused. Pass the value to
        stream() or generate(): the engine's own settings are left as they are."""
        own = TurnSettings(gate_mode=self.gate_mode, gate=self.gate, evictor=self._evictor, budget=self.budget,
                           ladder=self.ladder, verify_tokens=self.verify_tokens, verify_rule=self.verify_rule,
                           verify_threshold=self.verify_threshold, on_full=self.on_full, n_keep=self.n_keep,
                           compact=self.compact, seed=self.seed, park=self.park, park_from=self.park_from,
                           reread=self.reread)
        return overrides(own, gate=gate, evictor=evictor, budget=budget, verify_tokens=verify_tokens, on_full=on_full)

    # --- room on demand (room.py) ------------------------------------------------------------
    @property
    def room_ranking(self) -> str:
        return self.room.ranking

    def set_room_ranking(self, mode: str) -> None:
        """'hybrid' (the default: the question's attention and its words rank the cells room-making evicts), 'bm25',
        'question' (the attention alone), 'question+generic' or 'recent' (kept to compare): room.ROOM_RANKINGS."""
        self.room.set_ranking(mode)

    @property
    def room_evictor(self):
        return self.room.evictor

    def set_room_evictor(self, name: str, **options) -> None:
        """The evictor that ranks the cells room-making evicts; it may need nothing but the probe and the sentence
        spans room-making provides (room.ROOM_PROVIDES: snapkv-spans, the default, keeps whole sentences)."""
        self.room.set_evictor(name, **options)

    # --- the conversation ----------------------------------------------------------------------
    @property
    def history(self) -> list[int]:
        """The conversation's tokens in sequence 0, in order (evicted ones included)."""
        return self.conv.history

    def cells_used(self) -> int:
        return self.ctx.cells_used(0)

    def reset(self) -> None:
        """Forget the conversation: the KV cache is cleared."""
        self.ctx.clear()
        self.conv.clear()
        self.parking.clear()
        self.backoff.reset()
        self.payback.reset()

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
        self._check_open()
        return self.snapshots.take()

    def restore(self, snap: Snapshot) -> None:
        """Replace the conversation with a snapshot (of this model, fitting this n_ctx). StateFileError if
        it cannot be restored; the conversation is then the one before the call, never half restored."""
        self._check_open()
        self.snapshots.check(snap)
        with self._busy():
            self.snapshots.restore(snap)

    def cache_map(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Which tokens of the conversation the cache holds now, and why the others went: (bool
        (len(history),) held, bool (len(history),) evicted to make room or None when that is not known: a
        conversation restored from a snapshot). A token neither held nor evicted for room was evicted by
        the speed budget (the gate's Decision)."""
        with self._busy():
            held, room = self.conv.marks(self.ctx.page.positions(0)), self.conv.room_marks()
            return held, None if room is None else room & ~held

    def parked_map(self) -> np.ndarray:
        """bool (len(history),): the tokens of the conversation parked now (engine/parking.py: in memory, out of
        the attention, back before the next message)."""
        with self._busy():
            return self.conv.marks(self.parking.positions())

    # --- one turn (message.py) -----------------------------------------------------------------
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
            dec, _ = self.messages.prefill_and_gate(self.turn_settings(), toks, select=False)
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
            dec, _ = self.messages.fit(t, toks, 1, evict_now=True, select=not verify)
            if verify:
                dec.reason = ("prefilled without an answer: self-verification has nothing to check, so the "
                              "speed budget evicted nothing")
            return dec

    def _turn(self, prompt, max_tokens: int, sampling: Sampling, add_special: bool, stream: Stream,
              t: TurnSettings) -> Iterator[str]:
        sampling.validate()
        check_max_tokens(max_tokens)
        toks = self._tokens(prompt, add_special)
        yield from self.messages.answer(t, toks, max_tokens, sampling, stream, self._progress_fn)

    @contextmanager
    def _busy(self):
        """One turn at a time: a second caller gets EngineBusy instead of waiting or corrupting the cache."""
        if not self._lock.acquire(blocking=False):
            raise EngineBusy("this Engine is already generating in another thread; use one Engine per thread")
        try:
            yield
        finally:
            self._lock.release()

    def _check_open(self) -> None:
        if self.ctx is None:  # the parts hold the freed context: nothing may reach it
            raise ValueError("this Engine is closed")

    def _tokens(self, prompt: str | list[int], add_special: bool) -> list[int]:
        self._check_open()
        return tokens_of(self.model, prompt, add_special and not self.history)

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
            PrefixDisk.flush(getattr(getattr(self, "messages", None), "disk", None))  # queued writes land first
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

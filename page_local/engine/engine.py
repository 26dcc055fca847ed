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

import codecs
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
from page_local.engine.room import ANSWER_ROOM, ContextPolicy, check_on_full
from page_local.engine.turn import AFTER_ANSWER, FIRST_CHUNK, N_SINK, W, Pipeline, supported
from page_local.errors import ContextFull, EngineBusy, StateFileError
from page_local.evictors import get_evictor
from page_local.evictors.base import resolve_budget
from page_local.evictors.lorekv import MAX_FUTURES
from page_local.gate import BASE_MODE, SEARCH_MODES, VERIFY_MODES, Gate, check_gate_mode
from page_local.native.runtime import Context, ContextConfig, Model
from page_local.native.sampler import make_sampler, sample
from page_local.store import models
from page_local.store.persist import Snapshot
from page_local.store.gguf import model_identity
from page_local.verify import VERIFY_CAP, VERIFY_RULE, check_rule, kl

__all__ = ["Decision", "Engine", "Result", "Sampling", "Stream"]


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


class Engine(ContextPolicy):
    """A model, a context and the PAGE pipeline. Not thread-safe: use one engine per thread."""

    def __init__(self, model: str | os.PathLike | Model | None = None, n_ctx: int = defaults.N_CTX,
                 budget: float | int = defaults.BUDGET, evictor: str = defaults.EVICTOR, gate: str = defaults.GATE,
                 threads: int = defaults.THREADS, flash_attn: str = "auto",
                 type_kv: str | None = None, seed: int = 0, evictor_options: dict | None = None,
                 verify_tokens: int = VERIFY_CAP, verify_threshold: float | None = None,
                 verify_rule: str = VERIFY_RULE, compact: bool = True,
                 n_gpu_layers: int | str | None = None, allow_long_context: bool = False,
                 on_full: str = defaults.ON_FULL, ladder=defaults.LADDER, rpc=None, autotune: bool = True,
                 tune_progress=None, n_batch: int = 512):
        """model: a GGUF path, None for the embedded default, or a loaded native Model that several engines
        share (a server's slots: one copy of the weights). A shared Model is borrowed: close() leaves it to
        its owner, who closes it after every engine on it; n_gpu_layers and rpc are then the Model's own.
        n_batch: the most prompt tokens decoded at once (llama.cpp's -b; a prefill's progress is reported and can be
        stopped between batches), at least 64 (the probe's window rides on one batch); the physical batch is
        min(n_batch, 512)."""
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
        self.set_ladder(ladder)
        self._evictor = supported(get_evictor(evictor, **(evictor_options or {})))
        self.gate_mode = check_gate_mode(gate)  # validates the mode before loading anything
        check_pair(self._evictor, self.gate_mode)
        # n_gpu_layers: a count, 'all', or None = $PAGE_LOCAL_N_GPU_LAYERS, else all on a GPU build, else 0
        # (Model validates it before loading anything)
        self.seed = seed
        self._lock = threading.Lock()
        self._active: Stream | None = None  # the stream holding the lock, if one is suspended mid-answer
        # rpc: HOST:PORT of ggml-rpc-servers whose devices take offloaded layers (None = $PAGE_LOCAL_RPC)
        # flash_attn: auto (page-local's choice: engine/attention.py) | on | off; type_kv: f16 | q8_0 | q4_0
        # (None: $PAGE_LOCAL_CACHE_TYPE, else f16). Both are checked before the model is loaded.
        attention.resolve(*attention.from_environment(flash_attn, type_kv), "CPU", n_ctx, None)
        # autotune: with no tuning stored for flash_attn auto, measure one now, once (attention.first_use; at most
        # $PAGE_LOCAL_AUTOTUNE seconds, default 30; off skips it); tune_progress(text, fraction) while it runs
        attention.autotune_budget()
        self._owns_model = shared is None
        self.model = shared if shared is not None else Model(path, n_gpu_layers=n_gpu_layers, rpc=rpc)
        try:
            self.attention, self.attention_warning = attention.choose(path, self.model, threads, n_ctx, flash_attn,
                                                                      type_kv, autotune, tune_progress)
            self.ctx = Context(self.model, ContextConfig(n_ctx=n_ctx, threads=threads, n_batch=n_batch,
                                                         n_ubatch=min(n_batch, ContextConfig.n_ubatch),
                                                         flash_attn=self.attention.flash_attn,
                                                         type_kv=self.attention.cache_type, n_seq_max=1 + MAX_FUTURES,
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
        self.history: list[int] = []  # tokens in seq 0, in order (evicted ones included)
        self._pos: list[int] = []  # the position of each history token (its index until gaps are closed)
        # history indices evicted to make room (room.py), as opposed to by the speed budget; None: not known
        # (a conversation restored from a snapshot, which does not record why its cells went)
        self._room_out: set[int] | None = set()
        self.pipeline = Pipeline(self.ctx, self.model)  # the turn's steps (turn.py), shared with eval and bench
        self._progress_fn = None  # set_progress

    # --- settings ----------------------------------------------------------------------------
    def set_budget(self, budget: float | int) -> None:
        resolve_budget(budget, 10_000, W, N_SINK)  # validates (ratio or absolute) before use
        self.budget = budget

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
            if n_tokens == 0:
                self.reset()
                return
            if n_tokens < len(self.history):
                self.ctx.seq_rm(0, self._pos[n_tokens], -1)
            del self.history[n_tokens:], self._pos[n_tokens:]
            if self._room_out:
                self._room_out = {i for i in self._room_out if i < n_tokens}

    def snapshot(self) -> Snapshot:
        """The conversation's cache and token history, copied to host memory (see restore)."""
        return Snapshot(model_id=self.model_id, n_ctx=self.n_ctx, history=tuple(self.history),
                        positions=tuple(int(p) for p in self.ctx.page.positions(0)), state=self.ctx.seq_state(0),
                        history_pos=None if self._pos == list(range(len(self._pos))) else tuple(self._pos))

    def restore(self, snap: Snapshot) -> None:
        """Replace the conversation with a snapshot (of this model, fitting this n_ctx). StateFileError if
        it cannot be restored; the conversation is then the one before the call, never half restored."""
        if snap.model_id != self.model_id:
            raise StateFileError(f"the cache was saved with another model ({snap.model_id}), not the loaded one "
                                 f"({self.model_id})")
        if len(snap.positions) > self.n_ctx:
            raise StateFileError(f"the cache holds {len(snap.positions)} cells; this engine's n_ctx is {self.n_ctx}")
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
        except Exception as e:  # noqa: BLE001 -- llama.cpp's refusal, told in the message
            a = self.attention
            why = (f"llama.cpp refused the cache: {e} (this engine runs flash attention {a.flash_attn} with "
                   f"cache type {a.cache_type}; a cache saved under another flash-attention setting or cache type "
                   "restores only under that one: --flash-attn / --cache-type)")
        if why is None:
            self.history = list(snap.history)
            self._pos = list(snap.history_pos) if snap.history_pos else list(range(len(snap.history)))
            self._room_out = None if len(snap.positions) < len(snap.history) else set()
            return
        self.reset()
        if before is not None:  # put the conversation back as it was
            self.ctx.set_seq_state(before.state, 0)
            self.history = list(before.history)
            self._pos = list(before.history_pos) if before.history_pos else list(range(len(before.history)))
        raise StateFileError(why)

    def cells_used(self) -> int:
        return self.ctx.cells_used(0)

    def cache_map(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Which tokens of the conversation the cache holds now, and why the others went: (bool
        (len(history),) held, bool (len(history),) evicted to make room or None when that is not known: a
        conversation restored from a snapshot). A token neither held nor evicted for room was evicted by
        the speed budget (the gate's Decision)."""
        with self._busy():
            held = np.zeros(len(self.history), dtype=bool)
            held[held_indices(self._pos, self.ctx.page.positions(0))] = True
            if self._room_out is None:
                return held, None
            room = np.zeros(len(self.history), dtype=bool)
            room[[i for i in self._room_out if i < room.size]] = True
            return held, room & ~held

    def reset(self) -> None:
        """Forget the conversation: the KV cache is cleared."""
        self.ctx.clear()
        self.history = []
        self._pos = []
        self._room_out = set()

    # --- one turn ----------------------------------------------------------------------------
    def stream(self, prompt: str | list[int], max_tokens: int = defaults.MAX_TOKENS, sampling: Sampling | None = None,
               add_special: bool = True) -> Stream:
        """Continue the conversation with `prompt`; returns a Stream of text pieces (see Stream)."""
        def run(out: Stream) -> Iterator[str]:
            with self._busy():
                self._active = out
                try:
                    yield from self._turn(prompt, max_tokens, sampling or Sampling(), add_special, out)
                finally:
                    self._active = None
        return Stream(run)

    def generate(self, prompt: str | list[int], max_tokens: int = defaults.MAX_TOKENS,
                 sampling: Sampling | None = None, on_text: Callable[[str], None] | None = None,
                 add_special: bool = True) -> Result:
        """Run one turn on a fresh cache (the conversation is reset first) and return the Result."""
        out = Stream()  # holds the decision and the result
        # Take the lock before reset(): a second thread must get EngineBusy, not clear the cache under
        # the turn that is running.
        with self._busy():
            self.reset()
            for piece in self._turn(prompt, max_tokens, sampling or Sampling(), add_special, out):
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
            dec, _ = self._prefill_and_gate(toks, select=False)
            return dec

    def prefill(self, prompt: str | list[int], add_special: bool = True) -> Decision:
        """Append `prompt` to the conversation without generating (a replayed conversation, a system
        prompt). The gate runs as for a live turn under page/always; under the verify modes the speed
        budget evicts nothing (there is no answer to check the candidate on) and the Decision says so.
        A prompt that does not fit is handled by the context policy (on_full), as a live turn's."""
        with self._busy():
            toks = self._tokens(prompt, add_special)
            verify = self.gate_mode in VERIFY_MODES
            dec, _ = self._fit_and_prefill(toks, 1, evict_now=True, select=not verify)
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

    def _turn(self, prompt, max_tokens: int, sampling: Sampling, add_special: bool, stream: Stream) -> Iterator[str]:
        sampling.validate()
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        toks = self._tokens(prompt, add_special)
        ctx = self.ctx
        # room kept for the answer when room is made: a normal answer's, not max_tokens' (never upfront: an
        # answer that grows past it makes room from earlier turns then); the verify modes also need the
        # candidate's copy of it
        reserve = min(max_tokens, max(1, ctx.n_ctx // 4), ANSWER_ROOM)
        if self.gate_mode in VERIFY_MODES:  # one copy of the answer (search batches first chunks if room is left)
            reserve += min(max_tokens, self.verify_tokens) + 1
        start = len(self.history)  # where this message begins: an answer never evicts it to make room
        self.pipeline.progress = self._progress_of(len(toks))
        try:
            dec, plan = self._fit_and_prefill(toks, reserve, evict_now=self.gate_mode not in VERIFY_MODES)
        finally:
            self.pipeline.progress = None
        stream.decision = dec

        # generation: sample, yield, then decode; what the caller has seen is in the cache once the stream
        # goes on or is closed
        sampler = self._sampler(sampling)
        want_lp = sampling.logprobs is not None
        out: list[int] = []
        full_logits: list[np.ndarray] = []  # f32 (n_vocab,) of the full cache at each step, while verifying
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        finish = "length"
        t0 = time.perf_counter()
        used = self.cells_used()  # kept up to date below: no native scan of the cells per token
        limit = self._pos_limit()
        pending = None  # (token, position) yielded but not decoded yet
        try:
            for _ in range(max_tokens):
                if plan is not None:
                    full_logits.append(ctx.logits())
                logits = (full_logits[-1] if plan is not None else ctx.logits()) if want_lp else None
                tok = sample(sampler, ctx)
                if self.model.is_eog(tok):
                    finish = "stop"
                    if plan is not None and out:  # the answer ended inside the span: check it, end included
                        self._verify(dec, plan, out, full_logits, end=tok)
                        plan = None
                    break
                pos = ctx.seq_pos_max(0) + 1
                if used + 1 > ctx.n_ctx or pos >= limit:
                    # the answer outgrew the context: make room from earlier turns, never from the
                    # message it answers (never while a verification is pending: its candidate shares
                    # these cells); when nothing else can go, the answer ends here
                    if plan is not None or self.on_full != "evict" or not self._room_for_answer(dec, reserve, start):
                        finish = "context"
                        break
                    used, pos = self.cells_used(), ctx.seq_pos_max(0) + 1
                if want_lp:
                    stream.logprobs.append(token_logprobs(logits, tok, sampling.logprobs))
                # the piece goes out before the token is decoded (as llama-server sends it): the first
                # token is not held back by a decode step; closed at the yield, the token is decoded then
                piece = decoder.decode(self.model.token_to_piece(tok))
                pending = (tok, pos)
                if piece:
                    yield piece
                pending = None
                ctx.decode([tok], pos, 0)
                used += 1
                self.history.append(tok)
                self._pos.append(pos)
                out.append(tok)
                if plan is not None and len(out) == self.verify_tokens:  # the cap: decide on what there is
                    self._verify(dec, plan, out, full_logits, until="cap")
                    plan = None
                    used = self.cells_used()
            if plan is not None and out:  # max_tokens or a full context before the cap: check what there is
                self._verify(dec, plan, out, full_logits[: len(out)], until="length")
                plan = None
            tail = decoder.decode(b"", final=True)
            if tail:
                yield tail
        except (GeneratorExit, KeyboardInterrupt):
            finish = "interrupted"
            if pending is not None:  # closed at a piece's yield: what the caller has seen goes in the cache
                tok, pos = pending
                ctx.decode([tok], pos, 0)
                self.history.append(tok)
                self._pos.append(pos)
                out.append(tok)
            raise
        finally:
            ctx.seq_rm(1, -1, -1)  # an unfinished verification leaves nothing behind
            sampler.close()
            gen_s = time.perf_counter() - t0
            stream.result = Result(self.model.detokenize(out), out, dec, finish, len(toks), gen_s,
                                   list(stream.logprobs) if want_lp else None)

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

    def _verify(self, dec: Decision, plan: tuple, out: list[int], full_logits: list[np.ndarray],
                end: int | None = None, until: str = "end") -> None:
        """Self-verified eviction: teacher-force the generated tokens on evicted copies of the sequence
        (sharing the prompt's cells; every rung's first chunk in one batch when the cache has room, then one
        at a time), smallest first and in growing chunks that stop where a copy fails (Pipeline.check_ladder);
        commit the first copy that passes
        (one copy under verify, one per ladder rung under search). end:
        the end-of-generation token the full cache chose after out (then full_logits has one more
        entry, and the candidate must end the answer there too). Updates dec."""
        ctx, pipe = self.ctx, self.pipeline
        keeps, held, last_pos, last_tok = plan  # keeps: [(B, keep)], smallest B first, or a function of the answer
        m = len(out)
        t0 = time.perf_counter()
        dec.verify_threshold, dec.verify_rule = self.verify_threshold, self.verify_rule
        if self.cells_used() + m + 1 > ctx.n_ctx:  # one candidate at a time holds a copy of the answer
            dec.reason += "; self-verification skipped: no room in the cache for the evicted candidate"
            return
        if callable(keeps):  # keep sets scored by this answer (lorekv-answer): chosen now
            keeps, dec.lookahead_ms = keeps(out)
        y = list(out) + ([end] if end is not None else [])
        k = len(y)  # positions: m answer tokens (+ the answer's end)
        full_logits = full_logits[:k]
        # every rung's first chunk goes in one batch when the cache has room for those copies too
        batch_first = self.cells_used() + m + 1 + (len(keeps) - 1) * FIRST_CHUNK <= ctx.n_ctx
        chosen, tried, forced = pipe.check_ladder([keep for _, keep in keeps], held, last_pos, [last_tok] + out,
                                                  full_logits, y, self.verify_rule, self.verify_threshold,
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
        if commit:  # the candidate already holds the m tokens: it becomes the sequence
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
        dec.kept = self.cells_used() - m  # prompt positions held after the decision
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

    def _prefill_and_gate(self, toks: list[int], evict_now: bool = True,
                          select: bool = True) -> tuple[Decision, tuple | None]:
        """Prefill, probe, gate and (evict_now) evict. Returns the Decision and, when the gate opened
        and T > B but evict_now is False, the eviction plan (keep, held, last_pos, last_tok) for the
        verify modes. select=False: gate only (measure). An interrupted or failed prefill leaves
        nothing of the turn in the cache."""
        ctx = self.ctx
        pos0 = ctx.seq_pos_max(0) + 1
        n_hist = len(self.history)
        try:
            return self._prefill_and_gate_impl(toks, pos0, evict_now, select)
        except BaseException:
            ctx.seq_rm(0, pos0, -1)
            ctx.page.disarm_probe()
            del self.history[n_hist:], self._pos[n_hist:]
            raise

    def _prefill_and_gate_impl(self, toks, pos0, evict_now, select):
        pipe, ev = self.pipeline, self._evictor
        t0 = time.perf_counter()
        pre = pipe.prefill(toks, pos0, 0, track_attention=select and "prefill_attention" in ev.needs)
        self.history.extend(toks)
        self._pos.extend(range(pos0, pos0 + len(toks)))
        # the speed budget is a share of the whole conversation, so a turn evicts only what brings the
        # cells back to it: earlier turns are not cut again by the same ratio on every turn
        T = len(self.history)
        B = resolve_budget(self.budget, T, W, N_SINK)
        g = self.gate.decide(pre.D, n_tokens=T) if (pre.D is not None or self.gate.mode != "page") else None
        t3 = time.perf_counter()
        is_open = bool(g.open) if g else False
        evicted, plan, lookahead_ms = False, None, None
        if is_open and pre.T > B and select:
            last_pos, last_tok = pos0 + len(toks) - 1, toks[-1]
            signals = pipe.signals(ev.needs, pre, last_pos, last_tok, spec=getattr(ev, "spec", None),
                                   restore_logits=not evict_now)
            if "lookahead" in signals:
                lookahead_ms = signals["lookahead"].ms
            if self.gate_mode in SEARCH_MODES:  # one keep set per rung, smallest first, from one probe
                rungs = sorted({resolve_budget(r, T, W, N_SINK) for r in self.ladder})
                rungs = [b for b in rungs if b < pre.T] or [B]
            else:
                rungs = [B]
            if ev.needs & AFTER_ANSWER:  # the keep sets wait for the full cache's answer (_verify)
                plan = (_AfterAnswer(pipe, ev, pre, rungs, last_pos, signals, self.seed), pre.held, last_pos, last_tok)
            elif self.gate_mode in SEARCH_MODES:
                plan = ([(b, pipe.select(ev, pre, b, signals, self.seed)) for b in rungs], pre.held, last_pos, last_tok)
            else:
                keep = pipe.select(ev, pre, B, signals, self.seed)
                if evict_now:
                    pipe.evict_in_place(0, keep, pre.held, last_pos, last_tok, compact=self.compact)
                    evicted = True
                else:
                    plan = ([(B, keep)], pre.held, last_pos, last_tok)
        t4 = time.perf_counter()
        reason = g.reason if g else "the probe saw fewer than 2 heads; keeping the full cache"
        verify = {}
        if self.gate_mode in VERIFY_MODES:
            if self.gate_mode == "verify":
                reason = "gate mode 'verify': the evicted cache is checked on the answer (up to its end or the cap)"
            elif self.gate_mode == "search":
                reason = ("gate mode 'search': one candidate per budget of the ladder is checked on the answer; "
                          "the smallest that passes is committed")
            if is_open and pre.T <= B:  # nothing to evict: the candidate is the full cache itself
                verify = dict(verify_m=0, verify_delta=0.0, verify_score=0.0, verify_rule=self.verify_rule,
                              verify_threshold=self.verify_threshold)
                reason += f"; {pre.T} cells <= B = {B}: nothing to evict"
        kept = self.cells_used()
        return Decision(
            T=T, B=B, D=pre.D, z=g.z if g else None, open=is_open, evicted=evicted, kept=kept,
            compression=T / kept if kept else 1.0, gate_mode=self.gate_mode,
            rule=g.rule if g else "none", reason=reason,
            evictor=ev.name, prefill_ms=pre.prefill_ms, probe_ms=pre.probe_ms,
            gate_ms=(t3 - t0) * 1e3 - pre.prefill_ms - pre.probe_ms, evict_ms=(t4 - t3) * 1e3,
            agreement=pre.agreement, lookahead_ms=lookahead_ms, gate_note=g.note if g else None, **verify), plan

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


class _AfterAnswer:
    """The keep sets of an evictor that reads the full cache's answer (evictor lorekv-answer): called
    with the answer tokens at the check, it scores the prompt by their queries (one batch in sequence 1,
    emptied again) and selects one keep set per budget, smallest first."""

    def __init__(self, pipe: Pipeline, ev, pre, budgets: list[int], last_pos: int, signals: dict, seed: int):
        self.pipe, self.ev, self.pre, self.budgets = pipe, ev, pre, budgets
        self.last_pos, self.signals, self.seed = last_pos, signals, seed

    def __call__(self, answer: list[int]) -> tuple[list, float]:
        """([(B, keep)] smallest first, the milliseconds the scoring took)."""
        la = self.pipe.answer_lookahead(self.ev.spec, answer, self.last_pos, seq=0, work=1)
        sig = dict(self.signals, answer_lookahead=la)
        return [(b, self.pipe.select(self.ev, self.pre, b, sig, self.seed)) for b in self.budgets], la.ms


def token_logprobs(logits: np.ndarray, tok: int, n: int) -> tuple[int, float, list[tuple[int, float]]]:
    """(tok, log p(tok), the n most likely tokens with theirs, most likely first) under f32 (n_vocab,)
    logits, in f64."""
    z = logits.astype(np.float64)
    z -= z.max()
    lp = z - np.log(np.exp(z).sum())
    top = np.argpartition(-lp, n)[:n] if 0 < n < lp.size else np.arange(lp.size if n else 0)
    top = top[np.argsort(-lp[top], kind="stable")]
    return int(tok), float(lp[tok]), [(int(t), float(lp[t])) for t in top]


def held_indices(pos_of, held) -> np.ndarray:
    """i64 (len(held),): the history index of each held position. After close_gaps an evicted token shares
    the position of the next held one (room.renumber) and comes before it: the last index with that
    position is the held token."""
    return np.searchsorted(np.asarray(pos_of, dtype=np.int64), np.asarray(held, dtype=np.int64),
                           side="right") - 1


def check_pair(evictor, gate_mode: str) -> None:
    """Refuse an evictor that reads the answer under a gate that evicts before there is one."""
    if evictor.needs & AFTER_ANSWER and gate_mode not in VERIFY_MODES:
        raise ValueError(f"evictor {evictor.name!r} scores the prompt by the full cache's answer, which only the "
                         f"verify and search gates decode before evicting (gate is {gate_mode!r}); use gate "
                         "verify, search, page+verify or page+search, or evictor lorekv")


def plan_labels(keeps, ladder, T: int) -> list[str]:
    """How each rung is called in the status line: '1/8' for a ratio 0.125, '1024' for a count."""
    names = {}
    for r in ladder:
        b = resolve_budget(r, T, W, N_SINK)
        if isinstance(r, float) and r > 0 and abs(1 / r - round(1 / r)) < 1e-9:
            names.setdefault(b, f"1/{round(1 / r)}" if r < 1 else "all")
        else:
            names.setdefault(b, str(r))
    return [names.get(b, str(b)) for b, _ in keeps]

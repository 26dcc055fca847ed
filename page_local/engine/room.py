"""Room on demand: what a conversation does when the next message does not fit the context.

The speed budget (Engine.budget) is verified eviction for speed. This module is the other kind:
eviction because the alternative is refusing the message. When the conversation's cells plus the
next message and room for its answer would pass n_ctx, the earlier conversation is evicted down to
a low-water mark (LOW_WATER of n_ctx) so that the next turns fit without evicting again, and a
message longer than the context is prefilled in chunks with this eviction between them (the last
chunk carries the question, so the turn's own eviction stays query-aware).

Why it is not self-verified: verification compares the evicted cache with the full one on the
answer, and here the full one cannot hold the message: there is no reference to check against.
It protects structure instead, as the measured failure of global caps asks (arXiv 2605.18053): the
sinks, the system prompt (Engine.n_keep), every control token (the chat template's turn
boundaries) and the latest RECENT of n_ctx; the rest is ranked by SnapKV's score under the
conversation's newest W queries (the engine's evictor when it needs nothing but the probe).

Positions: eviction leaves gaps, and every turn appends after the highest position, so a long chat
walks past the model's trained context while its cells still fit. close_gaps renumbers the held
cells 0..n-1 (llama_memory_seq_add; llama.cpp re-rotates the keys as its context shift does).
"""

from __future__ import annotations

import numpy as np

from page_local.engine.decision import Decision
from page_local.engine.turn import N_SINK, W, Prefilled
from page_local.errors import ContextFull
from page_local.evictors import get_evictor

LOW_WATER = 0.5  # after making room, the earlier conversation holds at most this fraction of n_ctx
RECENT = 0.125  # the conversation's latest tokens protected while making room, as a fraction of n_ctx
RECENT_MAX = 512
ON_FULL = ("evict", "refuse")


def check_on_full(mode: str) -> str:
    if mode not in ON_FULL:
        raise ValueError(f"on_full must be one of {', '.join(ON_FULL)}; got {mode!r}")
    return mode


def target_cells(n_ctx: int, need: int) -> int:
    """How many cells the earlier conversation may keep when `need` more must fit: at most the low-water
    mark, and never so many that the need does not fit."""
    return max(0, min(int(n_ctx * LOW_WATER), n_ctx - 1 - need))


def protected(held: np.ndarray, tokens: np.ndarray, n_keep: int, n_ctx: int, is_control) -> np.ndarray:
    """bool (T,): the held cells room-making must not evict. held: i32 (T,) positions, ascending;
    tokens: the token each of them holds; n_keep: positions below it are the system prompt."""
    keep = held < max(N_SINK, n_keep)
    keep |= np.fromiter((is_control(int(t)) for t in tokens), dtype=bool, count=tokens.size)
    recent = min(RECENT_MAX, int(n_ctx * RECENT))
    if recent and held.size:
        keep[max(0, held.size - recent):] = True
    return keep


def gap_runs(held: np.ndarray) -> list[tuple[int, int, int]]:
    """(p0, p1, delta) shifts that renumber the held positions 0..T-1, applied in order: each maximal
    run of consecutive positions [p0, p1) moves down by -delta. Empty when there are no gaps."""
    runs = []
    if held.size == 0:
        return runs
    breaks = np.flatnonzero(np.diff(held) != 1) + 1
    starts = np.r_[0, breaks]
    ends = np.r_[breaks, held.size]
    for s, e in zip(starts.tolist(), ends.tolist()):
        delta = s - int(held[s])  # the run's first cell goes to position s
        if delta:
            runs.append((int(held[s]), int(held[e - 1]) + 1, delta))
    return runs


def renumber(pos_of: np.ndarray, held: np.ndarray) -> np.ndarray:
    """The position of every history token after close_gaps: a held token's new position, and for an
    evicted one the position the next held token takes (monotone, so a prefix of the history is
    still a prefix of positions)."""
    return np.searchsorted(held, pos_of, side="left").astype(np.int64)


def window_of(held: np.ndarray) -> np.ndarray:
    """The conversation's newest contiguous positions, at most W: the queries that rank the rest."""
    if held.size == 0:
        return held
    breaks = np.flatnonzero(np.diff(held) != 1) + 1
    start = int(breaks[-1]) if breaks.size else 0
    return held[max(start, held.size - W):]


def _chunks(toks: list[int], size: int) -> list[list[int]]:
    """toks in pieces of at most `size`, the last one full (it carries the question)."""
    head = len(toks) - size
    return [toks[i: min(i + size, head)] for i in range(0, head, size)] + [toks[head:]]


class ContextPolicy:
    """The Engine's side of the policy above (Engine derives from it): fitting a turn that does not fit,
    making room, and closing gaps. It works on the Engine's own state (ctx, history, _pos, pipeline)."""

    def _fit_and_prefill(self, toks: list[int], reserve: int, evict_now: bool,
                         select: bool = True) -> tuple[Decision, tuple | None]:
        """Prefill a turn that may not fit: refuse (on_full "refuse"), or make room by evicting earlier
        turns, and prefill a message longer than the context in chunks with room made between them.
        Interrupted or failed, the conversation is left as it was before the message."""
        ctx, n_ctx = self.ctx, self.ctx.n_ctx
        used = self.cells_used()
        fits = used + len(toks) + reserve + 1 <= n_ctx
        if self.on_full == "refuse" or (fits and ctx.seq_pos_max(0) + len(toks) + reserve < self._pos_limit()):
            if used + len(toks) + 1 > n_ctx:
                raise ContextFull(used, len(toks) + 1, n_ctx)
            return self._prefill_and_gate(toks, evict_now=evict_now, select=select)
        before = self.snapshot() if self.history else None
        room = {"evicted": 0, "chunks": 1, "closed": 0, "from": None}
        try:
            cap = n_ctx - 1 - reserve  # cells for the conversation and this message before its answer
            held, tokens = self._held_tokens()
            # cells that can never go: sinks, the system prompt, turn boundaries (no "latest turns" share)
            hard = int(protected(held, tokens, self.n_keep, 0, self.model.is_control).sum())
            if hard + W + N_SINK + 4 > cap:
                raise ContextFull(used, len(toks) + 1, n_ctx)
            size = max(W + 1, (cap - hard) // 2)  # a chunk: half of what room-making can free
            parts = _chunks(toks, size) if used + len(toks) + reserve + 1 > n_ctx and len(toks) > size else [toks]
            probe = None
            for part in parts[:-1]:
                self._make_room(len(part), room, probe)
                self._close_gaps(len(part), room)
                pos0 = ctx.seq_pos_max(0) + 1
                probe = self.pipeline.prefill(part, pos0, 0).probe  # its newest queries rank the next room
                self.history.extend(part)
                self._pos.extend(range(pos0, pos0 + len(part)))
            room["chunks"] = len(parts)
            self._make_room(len(parts[-1]) + reserve, room, probe)
            self._close_gaps(len(parts[-1]) + reserve, room)
            dec, plan = self._prefill_and_gate(parts[-1], evict_now=evict_now, select=select)
        except BaseException:
            self.reset()
            if before is not None:  # the message never happened
                self._restore(before)
            raise
        prompt_pos = np.asarray(self._pos[len(self.history) - len(toks):], dtype=np.int64)
        dec.prompt_tokens, dec.prompt_held = len(toks), int(np.isin(prompt_pos, self.ctx.page.positions(0)).sum())
        dec.room_evicted, dec.chunks, dec.gaps_closed = room["evicted"], room["chunks"], room["closed"]
        dec.room_from = room["from"]
        return dec, plan

    def _pos_limit(self) -> int:
        """The first position past what the model was trained on (no limit when unknown)."""
        return self.model.n_ctx_train if self.model.n_ctx_train > 0 else 1 << 62

    def _held_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """(i32 positions held, the token at each)."""
        held = self.ctx.page.positions(0)
        idx = np.searchsorted(np.asarray(self._pos, dtype=np.int64), held)
        return held, np.asarray(self.history, dtype=np.int64)[idx] if held.size else np.zeros(0, np.int64)

    def _make_room(self, need: int, room: dict, probe=None) -> None:
        """Evict earlier cells (room.py) so that `need` more fit; ContextFull when the protected ones
        alone leave too little."""
        ctx, n_ctx = self.ctx, self.ctx.n_ctx
        held, tokens = self._held_tokens()
        if held.size + need + 1 <= n_ctx:
            return
        target = target_cells(n_ctx, need)
        prot = protected(held, tokens, self.n_keep, n_ctx, self.model.is_control)
        if prot.sum() > target:  # the latest turns are protected only as long as there is room for them
            prot = protected(held, tokens, self.n_keep, 0, self.model.is_control)
        if prot.sum() + 4 > target:
            raise ContextFull(int(held.size), need + 1, n_ctx)
        if probe is None or not np.isin(probe.queries, held).all():
            win = window_of(held)  # re-decode the newest queries with the probe armed
            ctx.seq_rm(0, int(win[0]), -1)
            probe = self.pipeline.prefill(tokens[-win.size:].tolist(), int(win[0]), 0).probe
        ev = self._evictor if self._evictor.needs <= {"probe"} else get_evictor("snapkv")
        pre = Prefilled(probe=probe, held=held, logits=np.zeros(0, np.float32), prefill_attention=None)
        # the evictor ranks the unprotected cells; what it keeps of the protected ones costs it nothing
        keep = np.union1d(self.pipeline.select(ev, pre, target - int(prot.sum()) + W + N_SINK, {}, self.seed),
                          held[prot])
        drop = np.setdiff1d(held, keep, assume_unique=True)
        if drop.size:
            ctx.page.evict(0, drop)
            if self.compact:
                ctx.page.compact(0)
            room["evicted"] += int(drop.size)
            lo, hi = int(drop.min()), int(drop.max())
            room["from"] = (lo, hi) if room["from"] is None else (min(lo, room["from"][0]), max(hi, room["from"][1]))
        if self.cells_used() + need + 1 > n_ctx:
            raise ContextFull(self.cells_used(), need + 1, n_ctx)

    def _room_for_answer(self, dec: Decision, reserve: int) -> bool:
        """Make room while the answer is generated; True when there is room for one more token."""
        room = {"evicted": 0, "chunks": 1, "closed": 0, "from": None}
        try:
            self._make_room(reserve, room)
        except ContextFull:
            return False
        self._close_gaps(reserve, room)
        dec.room_evicted += room["evicted"]
        dec.gaps_closed += room["closed"]
        return self.cells_used() + 1 <= self.ctx.n_ctx and self.ctx.seq_pos_max(0) + 1 < self._pos_limit()

    def _close_gaps(self, need: int, room: dict) -> None:
        """Renumber the held cells 0..n-1 when `need` more positions would pass the trained context."""
        ctx = self.ctx
        if ctx.seq_pos_max(0) + 1 + need < self._pos_limit() or not ctx.can_shift():
            return
        held = ctx.page.positions(0)
        for p0, p1, delta in gap_runs(held):
            ctx.seq_add(0, p0, p1, delta)
        room["closed"] += int(held[-1]) + 1 - int(held.size) if held.size else 0
        self._pos = renumber(np.asarray(self._pos, dtype=np.int64), held).tolist()

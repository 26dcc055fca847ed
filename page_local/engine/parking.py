"""Parking: eviction for speed that the next message can undo (Engine(park=True); chat and serve).

A committed eviction is permanent: the gate checks the current answer only, and a later turn that asks about
what went finds nothing. Parking keeps those cells in memory under a sequence of their own (PARK_SEQ) and out of
the attended range (llama_page_park: they sit past the cells a decode reads, so it costs them nothing). Each
message chooses again:

  1. before the message is read, every parked cell returns to the conversation (llama_page_restore), and the
     cells are put back in position order (llama_page_order: the next decode reads them as a never-parked cache
     does, so the message is read, and an answer within the check decoded, bit for bit as with the full cache)
     — unless the cache cannot hold the message and its answer beside them: then the parked
     cells go for good first, lowest ranked first (the wall: `unpark`), and only then does room-making (room.py)
     evict held ones;
  2. the message is read over the whole conversation, and its last tokens' probe ranks every cell;
  3. the gate decides as it does for a single prompt; when it evicts, the cells outside the budget are parked
     instead (the turn's step, turn.Pipeline.evict_in_place(park=...)), with the answer's room left right
     after the held cells.

Below `park_from` cells eviction does not pay for itself (attention is a small share of a step there, and the
check costs the turn more than the faster tokens give back), so a shorter conversation keeps the full cache. Its
default depends on the model and the device (park_from_for): the cells where parking three quarters of them
makes a decode step 1.3x faster — on SmolLM2 (98 MB, 23 KB a cell) at 2K cells (bench decode: parked 1.29x the
full cache at 2K, 1.59x at 4K). On the CPU that is where the K and V a step reads weigh about an eighth of the
weights (PAYS_SHARE), not half as the bytes alone would say: a CPU attends an f16 cell several times slower per
byte than it reads a Q4_K weight (issue 54, `bench decode --fill state` on the real shapes, AMD Zen 4: 1.3x is
reached at ~2.8K cells on Llama-3.2-1B, <= 2K on -3B, ~4.9K on Llama-3.1-8B, ~10K on Qwen2.5-7B, where the K/V
weigh 0.11-0.13 of the weights; docs/benchmarks.md, "The shapes people run"). On a GPU a step is bound by memory
traffic, and the share stays the bytes' half (not measured).
Memory: a parked cell costs what a held one does (--cache-type q8_0 halves both).

Parking is the one object the Engine asks about all of this: it holds whether the speed budget parks (`on`, set
by Engine.set_park) and from where (`park_from`), and the turn (engine/message.py) calls it before a message
(`unpark`), after the probe (`ranked`), when the gate decides (`pays`, `note`, `parker`) and when a growing answer
needs room (`answer_room`); a snapshot saves and loads its cells (`saved`, `load`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from page_local.engine.decision import Decision
from page_local.engine.transcript import Transcript
from page_local.evictors.lorekv import MAX_FUTURES

PARK_SEQ = 1 + MAX_FUTURES  # the sequence parked cells belong to (1..MAX_FUTURES: verify and lookahead)
N_SEQ = PARK_SEQ + 1  # the engine context's sequences
# Below this many cells the policy keeps the full cache, at least (docs/benchmarks.md, "Parking": where eviction
# pays on SmolLM2); a model's own default is park_from_for's
PARK_FROM = 2048


# The share of the weights the K and V of park_from cells weigh, per device kind (see the module docstring)
PAYS_SHARE = {"cpu": 0.12, "gpu": 0.5}


# A decode step costs about weights + ATTEND x the K/V it reads, in bytes; ATTEND follows from PAYS_SHARE: at park_from
# cells parking three quarters of them makes a step PAYS x faster (CPU: 3.7, a CPU attends a cell's byte several times
# slower than it reads a weight's; GPU: 0.9, the bytes alone). What parking saves of a step (step_gain) is what the
# check's payback weighs against the check's forced tokens (selfcheck.Payback).
PAYS = 1.3


def _device_kind(device: str) -> str:
    return "cpu" if device.upper().startswith("CPU") or not device else "gpu"


def attend_weight(device: str = "CPU") -> float:
    share = PAYS_SHARE[_device_kind(device)]
    return (PAYS - 1) / (share * (1 - PAYS / 4))


def step_gain(weight_bytes: int, cell_bytes: float, cells: int, kept: int, device: str = "CPU") -> float:
    """The share of a full-cache decode step over `cells` cells that a step over `kept` of them saves (0 when the
    sizes are unknown): 1 - (weights + ATTEND x kept's K/V) / (weights + ATTEND x cells' K/V)."""
    if weight_bytes <= 0 or cell_bytes <= 0 or cells <= 0:
        return 0.0
    a = attend_weight(device) * cell_bytes
    return max(0.0, 1.0 - (weight_bytes + a * min(kept, cells)) / (weight_bytes + a * cells))


def park_from_for(weight_bytes: int, cell_bytes: float, device: str = "CPU") -> int:
    """The default park_from for a model: the cells whose K and V weigh PAYS_SHARE of its weights on `device`
    (weight_bytes: the model file's size; cell_bytes: one cell's K and V in every layer; device: where the layers
    run, "CPU" or a GPU's name), to the nearest 256, at least PARK_FROM."""
    if weight_bytes <= 0 or cell_bytes <= 0:
        return PARK_FROM
    share = PAYS_SHARE[_device_kind(device)]
    return max(PARK_FROM, int(round(share * weight_bytes / cell_bytes / 256)) * 256)


def shape_of(model, cache_type: str) -> tuple[int, float, str]:
    """(weight bytes: the model file's size, one cell's K and V in every layer, the device of its layers) of a loaded
    model (native.runtime.Model) under a KV cache type (f16, q8_0, q4_0: store.sizing.CACHE_BYTES)."""
    from page_local.store.sizing import CACHE_BYTES

    head = model.n_embd // model.n_head
    cell = model.n_layer * model.n_head_kv * 2 * head * CACHE_BYTES[cache_type]
    return Path(model.path).stat().st_size, cell, str(model.layers_device)


class Parking:
    """The parked cells of one conversation (sequence 0 of ctx), how the last ranking scored them, and the policy
    over them: on (the speed budget parks instead of evicting for good) and park_from (below it the full cache is
    kept)."""

    def __init__(self, ctx, on: bool = False, park_from: int | None = None,
                 shape: tuple[int, float, str] | None = None):
        self.ctx = ctx
        self.shape = shape  # shape_of the model: what park_from_for and step_gain weigh
        self.on = bool(on)
        self.park_from, self.told = self._from(park_from)
        self.scores: dict[int, float] = {}  # parked position -> its score when it was parked (lowest goes first)
        self._ranked: tuple[np.ndarray, np.ndarray] | None = None  # (positions, scores) of the last ranking

    def positions(self) -> np.ndarray:
        return self.ctx.page.parked(PARK_SEQ)

    def count(self) -> int:
        return len(self.scores)

    def clear(self) -> None:
        self.scores, self._ranked = {}, None

    def default_from(self) -> int:
        """Where parking starts to pay for this model and cache type (park_from_for of its shape)."""
        return park_from_for(*self.shape) if self.shape is not None else PARK_FROM

    def _from(self, park_from: int | None) -> tuple[int, bool]:
        """(park_from, told): the one given (the user's word that parking pays from there), else the model's own."""
        return (park_from, True) if park_from is not None else (self.default_from(), False)

    def switch(self, on: bool, park_from: int | None, conv: Transcript) -> None:
        """Park from now on or not, from park_from cells (None: the model's own, default_from). Switched off, the
        cells parked come back at once: no message would bring them back any more (the caller holds the
        conversation: Engine.set_park)."""
        if not on and self.scores:
            self.unpark(conv, 0)
        self.on = bool(on)
        self.park_from, self.told = self._from(park_from)

    def gain(self, cells: int, kept: int) -> float | None:
        """What parking all but `kept` of `cells` cells saves of a decode step (step_gain), for the check's payback;
        None when park_from was told (parking pays from there, by the user's word) or the model's shape is unknown."""
        if self.told or self.shape is None:
            return None
        return step_gain(self.shape[0], self.shape[1], cells, kept, self.shape[2])

    def pays(self, cells: int, park_from: int) -> bool:
        """Whether evicting for speed pays on a conversation of `cells` cells (below park_from it does not: the
        full cache is kept)."""
        return cells >= park_from

    def ranked(self, probe) -> None:
        """The scores a message's probe gave every cell (head- and layer-mean attention of its last tokens): what
        decides which parked cells go first at the wall."""
        self._ranked = (probe.positions.astype(np.int64), probe.mean.mean(axis=0).astype(np.float64))

    def park(self, positions: np.ndarray, gap: int, seq: int = 0) -> None:
        """Park `positions` of seq (the gate's eviction), `gap` free cells left after the held ones."""
        self.ctx.page.park(seq, PARK_SEQ, positions, gap)
        self.note(positions)

    def note(self, positions: np.ndarray) -> None:
        """Record positions parked (by park, or by turn.Pipeline.evict_in_place) with their last ranking's score."""
        pos = np.asarray(positions, dtype=np.int64)
        if self._ranked is None:
            sc = np.zeros(pos.size)
        else:
            where, score = self._ranked
            i = np.clip(np.searchsorted(where, pos), 0, max(0, where.size - 1))
            sc = np.where(where[i] == pos, score[i], 0.0) if where.size else np.zeros(pos.size)
        self.scores.update(zip(pos.tolist(), sc.tolist()))

    def lay_out(self, gap: int, seq: int = 0) -> None:
        """Lay the cells out again (held ones packed, `gap` free cells, then the parked ones): after the
        sequence's cells changed without parking (a committed check, room made for an answer)."""
        if self.scores:
            self.ctx.page.park(seq, PARK_SEQ, np.zeros(0, np.int32), gap)

    def drop(self, conv: Transcript, n: int) -> int:
        """Let the n lowest-ranked parked cells go for good (recorded in conv.room_out: evicted to make room).
        Returns how many went."""
        if n <= 0 or not self.scores:
            return 0
        order = sorted(self.scores, key=lambda p: (self.scores[p], p))[:n]
        self.ctx.page.evict(PARK_SEQ, np.asarray(order, dtype=np.int32))
        for p in order:
            del self.scores[p]
        if conv.room_out is not None:
            conv.room_out.update(int(i) for i in conv.indices_of(np.asarray(order)))
        return len(order)

    def unpark(self, conv: Transcript, need: int) -> tuple[int, int]:
        """Before a message: every parked cell back to the conversation, after the lowest-ranked ones went for good
        when the cache could not hold them beside `need` more cells. Returns (restored, dropped)."""
        if not self.scores:
            return 0, 0
        ctx = self.ctx
        over = ctx.cells_used(0) + len(self.scores) + need + 1 - ctx.n_ctx
        dropped = self.drop(conv, over)
        restored = len(self.scores)
        if restored:
            ctx.page.restore(0, PARK_SEQ)
            if not dropped:  # the conversation whole again: its cells in position order, as if never parked
                ctx.page.order(0)
        self.scores = {}
        return restored, dropped

    def parker(self, dec: Decision, reserve: int) -> Callable[[np.ndarray, int], None]:
        """What a passed check calls to park what its copy dropped (selfcheck.SelfCheck(park=...)) instead of
        evicting it: the answer's room (reserve, less what is answered) is left after the held cells, and dec
        says how many are parked."""
        def park(drop: np.ndarray, answered: int) -> None:
            self.park(drop, max(0, reserve - answered))
            dec.parked = self.count()
        return park

    def answer_room(self, conv: Transcript, reserve: int) -> int | None:
        """Room for a growing answer from the parked cells, which go for good before any held one (the lowest
        ranked first), a quarter of the answer's room at a time; the cells are laid out again after. Returns how
        many went, None when none is parked (room-making then takes earlier turns: room.RoomMaker.for_answer)."""
        if not self.scores:
            return None
        n = self.drop(conv, max(1, reserve // 4))
        self.lay_out(max(1, reserve // 4))
        return n

    def saved(self) -> tuple[tuple[int, ...], tuple[float, ...], bytes]:
        """(parked positions ascending, each one's score, llama.cpp's state of PARK_SEQ) for a snapshot; the
        state is empty when nothing is parked."""
        parked = sorted(self.scores)
        return (tuple(parked), tuple(self.scores[p] for p in parked),
                self.ctx.seq_state(PARK_SEQ) if parked else b"")

    def load(self, positions: tuple[int, ...], scores: tuple[float, ...], state: bytes) -> bool:
        """Put saved parked cells back (saved(): sequence 0 already restored); False when the cache does not hold
        the saved positions afterwards (the caller puts the conversation back as it was). llama.cpp's refusal
        of the state is raised."""
        if not positions:
            return True
        self.ctx.set_seq_state(state, PARK_SEQ)
        if tuple(int(p) for p in self.positions()) != tuple(positions):
            return False
        self.scores = dict(zip(positions, scores))
        self.lay_out(0)
        return True

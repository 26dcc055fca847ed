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

from page_local.engine.turn import N_SINK, W

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


def hard_protected(held: np.ndarray, tokens: np.ndarray, n_keep: int, is_control) -> int:
    """Cells that can never be evicted to make room (sinks, the system prompt, turn boundaries)."""
    keep = held < max(N_SINK, n_keep)
    keep |= np.fromiter((is_control(int(t)) for t in tokens), dtype=bool, count=tokens.size)
    return int(keep.sum())


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

"""The evictor contract and the helpers every evictor shares.

An evictor turns the signals of one prompt into ONE keep set of token positions: in llama.cpp a KV
cell is shared by every layer and head, so per-(layer, head) scores must be reduced to one score
per position first (docs/algorithms.md §0.2). Evictors are pure functions of numpy arrays.

Contract of `select(inp) -> i32 (B,)`: the kept positions, sorted ascending, unique, a subset of
`inp.held`; exactly `inp.budget` of them when T > B (all of `held` when T <= B); the protected
positions (the first `n_sink` held positions and the probe window) are always among them.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from page_local.probe import ProbeResult

NEEDS = frozenset({"probe", "last_query", "prefill_attention", "key_norms", "lookahead", "answer_lookahead",
                   "spans"})
POOLS = ("none", "avg", "max")


@dataclass(frozen=True)
class EvictionInput:
    """Everything an evictor may read. Arrays are aligned with `held` unless stated otherwise."""

    held: np.ndarray  # i32 (T,)  positions in the sequence, ascending (gaps after earlier evictions)
    budget: int  # B: total kept positions, protected ones included (see resolve_budget)
    window: np.ndarray  # i32 (W,)  positions of the probe window's queries; always kept
    n_sink: int = 4  # the first n_sink held positions are always kept
    probe: ProbeResult | None = None  # window probe (SnapKV, PyramidKV)
    last_query: ProbeResult | None = None  # probe of the final prompt token only (TOVA)
    prefill_attention: np.ndarray | None = None  # f32 (n_layer, T) column sums over all queries, head-mean
    key_norms: np.ndarray | None = None  # f32 (n_layer, n_head_kv, T)
    lookahead: object | None = None  # page_local.lookahead.Lookahead (LORE-KV): costs over its own positions
    answer_lookahead: object | None = None  # the same, scored by the full cache's answer (lorekv-answer)
    spans: np.ndarray | None = None  # i64 (T,) the span (sentence) each held position belongs to (snapkv-spans)
    # f64 (T,): the best score each held cell had when the same queries ranked it before (room-making's earlier
    # cuts of one message; 0 where it was not ranked yet); an evictor that takes it says so (snapkv-spans)
    prior: np.ndarray | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        held = np.asarray(self.held)
        if held.ndim != 1 or not np.issubdtype(held.dtype, np.integer):
            raise ValueError(f"held must be a 1-D integer array, got {held.dtype} {held.shape}")
        if held.size > 1 and np.any(np.diff(held) <= 0):
            raise ValueError("held must be strictly ascending (unique positions)")
        window = np.asarray(self.window)
        if window.ndim != 1 or (window.size and not np.issubdtype(window.dtype, np.integer)):
            raise ValueError(f"window must be a 1-D integer array, got {window.dtype} {window.shape}")
        if not np.all(np.isin(window, held)):
            missing = np.setdiff1d(window, held)[:5].tolist()
            raise ValueError(f"window positions {missing} are not held")
        if self.spans is not None:
            spans = np.asarray(self.spans)
            if spans.shape != held.shape or (spans.size and not np.issubdtype(spans.dtype, np.integer)):
                raise ValueError(f"spans must be integers aligned with held {held.shape}, got {spans.dtype} "
                                 f"{spans.shape}")
            object.__setattr__(self, "spans", spans.astype(np.int64, copy=False))
        if self.prior is not None:
            prior = np.asarray(self.prior, dtype=np.float64)
            if prior.shape != held.shape or np.isnan(prior).any():
                raise ValueError(f"prior must be scores aligned with held {held.shape}, got {prior.shape}")
            object.__setattr__(self, "prior", prior)
        if isinstance(self.budget, bool) or not isinstance(self.budget, numbers.Integral) \
                or self.budget < 1:
            raise ValueError(f"budget must be an int >= 1 (use resolve_budget for ratios), got {self.budget!r}")
        if isinstance(self.n_sink, bool) or not isinstance(self.n_sink, numbers.Integral) or self.n_sink < 0:
            raise ValueError(f"n_sink must be an int >= 0, got {self.n_sink!r}")
        # Normalise dtypes once so that evictors can rely on them (frozen: bypass __setattr__).
        object.__setattr__(self, "held", held.astype(np.int32, copy=False))
        object.__setattr__(self, "window", np.unique(window).astype(np.int32))
        object.__setattr__(self, "budget", int(self.budget))
        object.__setattr__(self, "n_sink", int(self.n_sink))

    @property
    def T(self) -> int:
        return int(self.held.shape[0])

    def protected(self) -> np.ndarray:
        """bool (T,): the first n_sink held positions and the window."""
        mask = np.isin(self.held, self.window)
        mask[: self.n_sink] = True
        return mask


def resolve_budget(budget: object, T: int, window: int = 32, n_sink: int = 4) -> int:
    """Turn a user budget into B, the total number of kept positions.

    A float in (0, 1] is a ratio b: B = max(window + n_sink + 4, int(T * b)) (PAGE's convention,
    `gated_eviction.py`). An int >= 1 is an absolute count and must cover the protected
    n_sink + window positions. B may exceed T, in which case there is nothing to evict.
    """
    if isinstance(budget, (bool, np.bool_)):
        raise ValueError(f"budget must be a ratio in (0, 1] or a count, got {budget!r}")
    if isinstance(budget, numbers.Integral):
        b = int(budget)
        if b < 1:
            raise ValueError(f"budget count must be >= 1, got {b}")
        if b < n_sink + window:
            raise ValueError(
                f"budget {b} is smaller than the {n_sink + window} protected positions "
                f"({n_sink} sinks + {window} window)"
            )
        return b
    if isinstance(budget, numbers.Real):
        r = float(budget)
        if math.isnan(r) or r <= 0.0 or r > 1.0:
            raise ValueError(f"budget ratio must be in (0, 1], got {budget!r}")
        return max(window + n_sink + 4, int(T * r))
    raise ValueError(f"budget must be a ratio in (0, 1] or a count, got {budget!r}")


def probe_scores(probe: ProbeResult, held: np.ndarray) -> np.ndarray:
    """f64 (n_layer, T): probe.mean aligned to `held`; a held position the probe did not see scores 0."""
    mean = np.asarray(probe.mean, dtype=np.float64)  # (n_layer, n_pos)
    positions = np.asarray(probe.positions)
    if mean.ndim != 2 or mean.shape[1] != positions.shape[0]:
        raise ValueError(f"probe.mean {mean.shape} does not match probe.positions {positions.shape}")
    out = np.zeros((mean.shape[0], held.shape[0]), dtype=np.float64)
    col = np.searchsorted(positions, held)
    seen = col < positions.shape[0]
    seen[seen] = positions[col[seen]] == held[seen]
    out[:, seen] = mean[:, col[seen]]
    return out


def pool1d(score: np.ndarray, pool: str = "none", kernel: int = 5) -> np.ndarray:
    """f64 (..., n): smooth scores along the last axis, stride 1, same length (SnapKV's clustering).

    "avg" counts the zero padding like PyTorch's avg_pool1d; "max" pads with -inf.
    """
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {', '.join(POOLS)}; got {pool!r}")
    if isinstance(kernel, bool) or not isinstance(kernel, numbers.Integral) or kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"kernel must be an odd int >= 1, got {kernel!r}")
    score = np.asarray(score, dtype=np.float64)
    if pool == "none" or kernel == 1 or score.shape[-1] == 0:
        return score
    half = kernel // 2
    fill = 0.0 if pool == "avg" else -np.inf
    pad = [(0, 0)] * (score.ndim - 1) + [(half, half)]
    padded = np.pad(score, pad, constant_values=fill)
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernel, axis=-1)
    return windows.mean(axis=-1) if pool == "avg" else windows.max(axis=-1)



def keep_top(held: np.ndarray, protected: np.ndarray, score: np.ndarray, budget: int) -> np.ndarray:
    """i32 (budget,): protected positions + the highest-scoring others, sorted ascending.

    held i32 (T,), protected bool (T,), score f64 (T,) (higher = keep). Ties go to the lower
    position, so the result is deterministic.
    """
    n_protected = int(protected.sum())
    k = budget - n_protected
    if k < 0:
        raise ValueError(f"budget {budget} is smaller than the {n_protected} protected positions")
    score = np.asarray(score, dtype=np.float64)
    if score.shape != held.shape:
        raise ValueError(f"score shape {score.shape} does not match held {held.shape}")
    candidates = np.flatnonzero(~protected)
    cand_score = score[candidates]
    if np.isnan(cand_score).any():
        raise ValueError("scores contain NaN")
    # Stable sort of the negated score: equal scores keep ascending (= position) order.
    order = np.argsort(-cand_score, kind="stable")[:k]
    keep = protected.copy()
    keep[candidates[order]] = True
    return held[keep].astype(np.int32)


class Evictor:
    """Base class. Subclasses set `name` and `needs` and implement `score` (or override `select`).

    `needs` lists the signals the engine must provide (a subset of NEEDS); the engine reads it
    instead of branching on evictor classes.
    """

    name: ClassVar[str] = ""
    needs: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not cls.needs <= NEEDS:  # a typo here would silently never be provided by the engine
            raise TypeError(f"{cls.__name__}.needs has unknown signals {sorted(cls.needs - NEEDS)}")

    def select(self, inp: EvictionInput) -> np.ndarray:
        """i32 (min(T, B),): the sorted kept positions (see the module docstring)."""
        if inp.T <= inp.budget:
            return inp.held.copy()
        self.check_needs(inp)
        protected = self.protected(inp)
        return keep_top(inp.held, protected, self.score(inp), inp.budget)

    def protected(self, inp: EvictionInput) -> np.ndarray:
        """bool (T,): positions kept whatever the score."""
        return inp.protected()

    def score(self, inp: EvictionInput) -> np.ndarray:
        """f64 (T,): higher = more worth keeping; protected entries are ignored."""
        raise NotImplementedError

    def check_needs(self, inp: EvictionInput) -> None:
        missing = sorted(n for n in self.needs if getattr(inp, n) is None)
        if missing:
            raise ValueError(f"evictor {self.name!r} needs {', '.join(missing)}, which the input lacks")

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({opts})"


def aligned_layer_rows(arr: np.ndarray | None, T: int, what: str, ndim: int) -> np.ndarray:
    """f64 view of a per-position signal whose last axis must have length T."""
    a = np.asarray(arr, dtype=np.float64)
    if a.ndim != ndim or a.shape[-1] != T or a.shape[0] < 1:
        raise ValueError(f"{what} must have {ndim} dims with last axis T={T}, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{what} contains non-finite values")
    return a

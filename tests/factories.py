"""Synthetic inputs for the numpy layer (signal, gate, evictors): no model needed."""

from __future__ import annotations

import numpy as np

from page_local.engine.lookahead import Lookahead

from page_local.evictors.base import EvictionInput
from page_local.probe import ProbeResult


def make_probe(positions, mean=None, topk_pos=None, *, n_layer=3, n_head=4, k=8, queries=None,
               rng=None) -> ProbeResult:
    """A ProbeResult over `positions`. Missing parts are random (mean) or derived from a random
    per-head score (topk_pos); scores are consistent with each other only where it matters."""
    rng = np.random.default_rng(0) if rng is None else rng
    positions = np.asarray(positions, dtype=np.int32)
    n_pos = positions.size
    if mean is None:
        mean = rng.random((n_layer, n_pos)).astype(np.float32)
    mean = np.asarray(mean, dtype=np.float32)
    n_layer = mean.shape[0]
    if topk_pos is None:
        kk = min(k, n_pos)
        per_head = rng.random((n_layer, n_head, n_pos))
        idx = np.argsort(-per_head, axis=-1)[..., :kk]
        topk_pos = np.full((n_layer, n_head, k), -1, dtype=np.int32)
        topk_pos[..., :kk] = positions[idx]
    topk_pos = np.asarray(topk_pos, dtype=np.int32)
    topk_score = np.where(topk_pos >= 0, 1.0, 0.0).astype(np.float32)
    if queries is None:
        queries = positions[-min(4, n_pos):]
    return ProbeResult(positions=positions, queries=np.asarray(queries, dtype=np.int32), mean=mean,
                       topk_pos=topk_pos, topk_score=topk_score)


def held_positions(T: int, gaps: bool, rng) -> np.ndarray:
    """i32 (T,): 0..T-1, or T ascending positions with random gaps (after earlier evictions)."""
    if not gaps:
        return np.arange(T, dtype=np.int32)
    return np.sort(rng.choice(3 * T, size=T, replace=False)).astype(np.int32)


def make_input(T: int, B: int, *, W: int = 8, n_sink: int = 4, seed: int = 0, gaps: bool = False,
               n_layer: int = 3, n_head: int = 4, n_head_kv: int = 2, **overrides) -> EvictionInput:
    """An EvictionInput with every signal present (random), so that any evictor can run on it."""
    rng = np.random.default_rng(1000 + seed)
    held = held_positions(T, gaps, rng)
    window = held[T - W:] if W else held[:0]
    probe = make_probe(held, n_layer=n_layer, n_head=n_head, queries=window, rng=rng)
    last = make_probe(held, n_layer=n_layer, n_head=n_head, queries=held[-1:], rng=rng)
    fields = dict(
        held=held, budget=B, window=window, n_sink=n_sink, probe=probe, last_query=last,
        prefill_attention=rng.random((n_layer, T)).astype(np.float32),
        # Norm scales differ by layer, as in real models.
        key_norms=((1.0 + rng.random((n_layer, n_head_kv, T))) * np.arange(1, n_layer + 1)[:, None, None])
        .astype(np.float32),
        lookahead=Lookahead(positions=held.astype(np.int32), cost=rng.random((2, n_layer, T)),
                            n_fed=np.array([3, 2], dtype=np.int32), logprob=-rng.random(2), entropy=rng.random(2)),
        answer_lookahead=Lookahead(positions=held.astype(np.int32), cost=rng.random((1, n_layer, T)),
                                   n_fed=np.array([5], dtype=np.int32), logprob=np.zeros(1), entropy=np.zeros(1)),
        spans=np.cumsum(rng.random(T) < 0.2),  # sentences of about 5 cells
        seed=seed,
    )
    fields.update(overrides)
    return EvictionInput(**fields)

"""LORE-KV (arXiv 2610.07643): keep what the model's own continuations will need.

The engine runs the lookahead (page_local/engine/lookahead.py: S sampled futures of tau tokens whose
queries score every prompt position by its leave-one-out deletion cost) and hands the result to
`select` as `inp.lookahead`; this class only aggregates it (docs/algorithms.md §4.4):

    U(p) = sum_s w_s * (1/tau_s) sum_t sum_l sum_h c(l, h, s, t, p)

Weights: "uniform" (w_s = 1/S, the default) or "trajectory": w_s = softmax_s(beta * (lp_s - mean lp)
- eta * (H_s - mean H)) with lp_s the future's mean token log-prob and H_s its mean entropy (the
proposal in docs/algorithms.md §4.4; beta = 1, eta = 0 by default). layer_norm=True divides each
layer's cost by its mean over positions before the sum. Sinks and the probe window are protected like
SnapKV's; futures never count against the budget. A future that produced no token (end-of-generation
first) has weight 0.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from page_local.evictors.base import EvictionInput, Evictor

WEIGHTINGS = ("uniform", "trajectory")
PROJECTIONS = ("wo", "none", "gain")  # how the deletion cost weighs heads (engine/outproj.py)
MAX_FUTURES = 8  # the engine's context holds this many extra sequences


@dataclass(frozen=True)
class LookaheadSpec:
    futures: int = 4  # S
    tokens: int = 32  # tau
    temperature: float = 0.7
    top_p: float = 0.95
    seed: int = 0
    projection: str = "wo"  # wo | none | gain (outproj.py)

    def __post_init__(self) -> None:
        def _int(name, lo, hi):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not lo <= v <= hi:
                raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {v!r}")

        _int("futures", 1, MAX_FUTURES)
        _int("tokens", 1, 512)
        _int("seed", 0, 2**63 - 1)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, numbers.Real) \
                or not 0 < self.temperature <= 5:
            raise ValueError(f"temperature must be in (0, 5], got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, numbers.Real) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.projection not in PROJECTIONS:
            raise ValueError(f"projection must be one of {', '.join(PROJECTIONS)}; got {self.projection!r}")



class LoreKV(Evictor):
    name = "lorekv"
    needs = frozenset({"lookahead"})

    def __init__(self, futures: int = 4, tokens: int = 32, temperature: float = 0.7, top_p: float = 0.95,
                 seed: int = 0, projection: str = "wo", weighting: str = "uniform", beta: float = 1.0,
                 eta: float = 0.0, layer_norm: bool = False):
        self.spec = LookaheadSpec(futures=futures, tokens=tokens, temperature=temperature, top_p=top_p,
                                  seed=seed, projection=projection)
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}; got {weighting!r}")
        for k, v in (("beta", beta), ("eta", eta)):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not np.isfinite(v):
                raise ValueError(f"{k} must be a finite number, got {v!r}")
        self.weighting, self.beta, self.eta, self.layer_norm = weighting, float(beta), float(eta), bool(layer_norm)

    def weights(self, la) -> np.ndarray:
        """f64 (S,): the futures' weights, summing to 1 over the futures that fed tokens."""
        ok = la.n_fed > 0
        w = np.zeros(la.n_fed.shape[0])
        if not ok.any():
            return w
        if self.weighting == "uniform":
            w[ok] = 1.0 / ok.sum()
            return w
        lp, ent = la.logprob[ok], la.entropy[ok]
        z = self.beta * (lp - lp.mean()) - self.eta * (ent - ent.mean())
        e = np.exp(z - z.max())
        w[ok] = e / e.sum()
        return w

    def score(self, inp: EvictionInput) -> np.ndarray:
        return self._score(inp, inp.lookahead)

    def _score(self, inp: EvictionInput, la) -> np.ndarray:
        cost = np.asarray(la.cost, dtype=np.float64)  # (S, n_layer, P)
        if self.layer_norm:
            mean = cost.mean(axis=2, keepdims=True)
            cost = np.divide(cost, mean, out=np.zeros_like(cost), where=mean > 0)
        u = np.einsum("s,slp->p", self.weights(la), cost)
        out = np.zeros(inp.T, dtype=np.float64)
        col = np.searchsorted(la.positions, inp.held)
        ok = col < la.positions.size
        ok[ok] = la.positions[col[ok]] == inp.held[ok]
        out[ok] = u[col[ok]]
        return out


class LoreKVAnswer(LoreKV):
    """LORE-KV whose one future is the answer itself: under the verify and search gates the full cache
    decodes the answer (up to the check's cap) before anything is evicted, and the check forces exactly
    those tokens on every candidate. Scoring the prompt by their queries costs one batch of the answer
    (engine/lookahead.py score_answer) instead of S sampled futures, and keeps what this answer reads.
    The other gates have no answer before the eviction: the engine refuses the pair."""

    name = "lorekv-answer"
    needs = frozenset({"answer_lookahead"})

    def __init__(self, projection: str = "wo", layer_norm: bool = False):
        super().__init__(futures=1, projection=projection, layer_norm=layer_norm)

    def score(self, inp: EvictionInput) -> np.ndarray:
        return self._score(inp, inp.answer_lookahead)

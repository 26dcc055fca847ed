"""PAGE's gate: evict only when the head-agreement drop D says eviction is safe (arXiv 2609.22157, §5.2).

Rules (docs/algorithms.md §5.2, pinned to the authors' code):
* raw: open iff D >= 0.07 ("the value used for every reported result");
* calibrated, once the model has a profile from an unlabeled pilot (store.profiles): z = (D - mu) / sigma,
  open iff z >= -0.6934 (`normalized_predictor.py`; numpy std, ddof 0).

The gate modes a user chooses are GATE_MODES. The two verify modes run a base gate first (BASE_MODE)
and then self-verification (verify.py) on the candidate it lets through.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from page_local.store.profiles import Profile, read_profile

GATE_MODES = ("page", "always", "never", "verify", "page+verify", "search", "page+search")  # what a user chooses
MODES = ("page", "always", "never")  # the rule's own modes: what BASE_MODE maps every gate mode to
BASE_MODE = {"page": "page", "always": "always", "never": "never", "verify": "always", "page+verify": "page",
             "search": "always", "page+search": "page"}
VERIFY_MODES = ("verify", "page+verify", "search", "page+search")  # the modes that check candidates on the answer
SEARCH_MODES = ("search", "page+search")  # one candidate per budget of a ladder; the smallest that passes wins
RAW_THRESHOLD = 0.07
Z_THRESHOLD = -0.6934


def check_gate_mode(mode: str) -> str:
    """`mode` if it is one of GATE_MODES, else ValueError listing them."""
    if mode not in GATE_MODES:
        raise ValueError(f"gate mode must be one of {', '.join(GATE_MODES)}; got {mode!r}")
    return mode


def d_threshold(mu: float | None = None, sigma: float | None = None, z_threshold: float = Z_THRESHOLD,
                threshold: float = RAW_THRESHOLD) -> float:
    """The D at which the page rule flips: the raw threshold, or mu + z_threshold * sigma."""
    return threshold if mu is None or sigma is None else mu + z_threshold * sigma


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


# ---------------------------------------------------------------------------------------------
# gate


@dataclass(frozen=True)
class GateDecision:
    open: bool  # True = run the evictor; False = keep the full cache
    mode: str  # "page" | "always" | "never"
    D: float | None
    z: float | None  # (D - mu) / sigma when a profile is in use, else None
    threshold: float | None  # RAW_THRESHOLD on D, or the z threshold; None when forced
    rule: str  # "raw" | "calibrated" | "forced"
    reason: str  # one plain sentence for logs and the CLI
    note: str | None = None  # a calibrated rule applied outside its pilot's prompt lengths (also in reason)


class Gate:
    """Decides per input whether to evict. `profile` switches the page mode to the calibrated rule."""

    def __init__(self, mode: str = "page", profile: Profile | None = None,
                 threshold: float = RAW_THRESHOLD, z_threshold: float = Z_THRESHOLD):
        if mode not in MODES:
            raise ValueError(f"gate mode must be one of {', '.join(MODES)}; got {mode!r}")
        for name, v in (("threshold", threshold), ("z_threshold", z_threshold)):
            if not (_is_real(v) and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        self.mode = mode
        self.profile = profile
        self.threshold = float(threshold)
        self.z_threshold = float(z_threshold)
        self.warning: str | None = None  # set by for_model when a stored profile was unusable

    @classmethod
    def for_model(cls, model_id: str, mode: str = "page") -> Gate:
        """A gate using the stored profile of `model_id` if there is a valid one (see `.warning`)."""
        status = read_profile(model_id)
        gate = cls(mode, status.profile)
        gate.warning = status.warning
        return gate

    @classmethod
    def calibrated(cls, mu: float, sigma: float, z_threshold: float = Z_THRESHOLD, model_id: str = "-") -> Gate:
        """The page rule under (mu, sigma) without a stored profile (re-gating rows under another pilot)."""
        return cls("page", Profile(model_id=model_id, model="", n_pilot=2, mu=float(mu), sigma=float(sigma),
                                   created="", page_local_version=""), z_threshold=z_threshold)

    @property
    def d_threshold(self) -> float:
        """The D at which the page mode flips: the raw threshold, or mu + z_threshold * sigma."""
        p = self.profile
        return d_threshold(None if p is None else p.mu, None if p is None else p.sigma, self.z_threshold,
                           self.threshold)

    def decide(self, D: float | None, n_tokens: int | None = None) -> GateDecision:
        """Open or closed for one input with drop D (D may be None only in the forced modes).
        n_tokens, the prompt's length, lets a calibrated rule say when the prompt is far outside the
        lengths its pilot had (GateDecision.note)."""
        if D is not None:
            if not (_is_real(D) and math.isfinite(D)):
                raise ValueError(f"D must be a finite number, got {D!r}")
            D = float(D)
        z = None if (D is None or self.profile is None) else (D - self.profile.mu) / self.profile.sigma
        if self.mode != "page":
            is_open = self.mode == "always"
            action = "evicting" if is_open else "keeping the full cache"
            return GateDecision(is_open, self.mode, D, z, None, "forced",
                                f"gate mode '{self.mode}': {action} whatever D is")
        if D is None:
            raise ValueError("gate mode 'page' needs D, got None")
        if z is None:
            is_open = D >= self.threshold
            cmp = ">=" if is_open else "<"
            value = f"D = {D:.4f} {cmp} {self.threshold:g} (raw threshold)"
            rule, threshold = "raw", self.threshold
        else:
            is_open = z >= self.z_threshold
            cmp = ">=" if is_open else "<"
            value = (f"z = (D - mu) / sigma = ({D:.4f} - {self.profile.mu:.4f}) / {self.profile.sigma:.4f}"
                     f" = {z:.3f} {cmp} {self.z_threshold:g} (calibrated for {self.profile.model_id})")
            rule, threshold = "calibrated", self.z_threshold
        if is_open:
            why = "heads agree much less in late layers than early ones: eviction is safe, evicting"
        else:
            why = "head agreement barely drops across layers (capacity-bound input): keeping the full cache"
        note = self.profile.length_note(n_tokens) if rule == "calibrated" else None
        return GateDecision(is_open, self.mode, D, z, threshold, rule,
                            f"{value}; {why}" + (f" (note: {note})" if note else ""), note)


def calibrate(D_values) -> tuple[float, float]:
    """(mu, sigma) of the drops of an unlabeled pilot: numpy mean and std with ddof=0 (PAGE)."""
    d = np.asarray(D_values, dtype=np.float64).reshape(-1)
    if d.size < 2:
        raise ValueError(f"calibration needs at least 2 D values, got {d.size}")
    if not np.all(np.isfinite(d)):
        raise ValueError("calibration D values must all be finite")
    mu, sigma = float(d.mean()), float(d.std(ddof=0))
    if np.ptp(d) == 0 or not sigma > 0:  # equal values can leave a rounding-level std
        raise ValueError(f"all {d.size} pilot D values are equal ({mu!r}): sigma is 0, cannot calibrate")
    return mu, sigma

"""PAGE's gate: evict only when the head-agreement drop D says eviction is safe (arXiv 2609.22157, §5.2).

Rules (docs/algorithms.md §5.2, pinned to the authors' code):
* raw: open iff D >= 0.07 ("the value used for every reported result");
* calibrated, once the model has a profile from an unlabeled pilot: z = (D - mu) / sigma,
  open iff z >= -0.6934 (`normalized_predictor.py`; numpy std, ddof 0).

Profiles are small JSON files under <home>/profiles/<model_id>.json, where <home> is
$PAGE_LOCAL_HOME or platformdirs.user_data_dir("page-local") (read at call time, so tests can
isolate it). `model_identity` derives <model_id> from the GGUF header without touching tensors.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import re
import struct
import tempfile
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

MODES = ("page", "always", "never")
RAW_THRESHOLD = 0.07
Z_THRESHOLD = -0.6934
PROFILE_FORMAT = "page-local-profile"
PROFILE_VERSION = 1
LENGTH_SLACK = 1.25  # prompts within [shortest / 1.25, longest * 1.25] of the pilot count as covered
_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


class ProfileWarning(UserWarning):
    """A calibration profile exists but cannot be used (the gate falls back to the raw rule)."""


# ---------------------------------------------------------------------------------------------
# gate


@dataclass(frozen=True)
class Profile:
    model_id: str
    model: str  # human-readable description of the model
    n_pilot: int
    mu: float
    sigma: float
    created: str  # ISO 8601 UTC timestamp
    page_local_version: str
    pilot_tokens: tuple[int, int] | None = None  # shortest and longest pilot prompt (None: not recorded)

    def length_note(self, n_tokens: int | None) -> str | None:
        """A warning when a prompt of n_tokens is well outside the pilot's lengths, else None. D falls
        as prompts grow (SmolLM2: by 0.02-0.07 per task from 2K to 4K, docs/results.md), so mu and
        sigma from short prompts misplace the threshold for long ones."""
        if self.pilot_tokens is None or n_tokens is None:
            return None
        lo, hi = self.pilot_tokens
        if lo / LENGTH_SLACK <= n_tokens <= hi * LENGTH_SLACK:
            return None
        return (f"this prompt has {n_tokens} tokens; the calibration pilot had {lo}-{hi}, and D shifts with "
                f"prompt length: recalibrate at this length (`page-local calibrate --lengths {n_tokens}`)")


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

    @property
    def d_threshold(self) -> float:
        """The D at which the page mode flips: the raw threshold, or mu + z_threshold * sigma."""
        p = self.profile
        return self.threshold if p is None else p.mu + self.z_threshold * p.sigma

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


# ---------------------------------------------------------------------------------------------
# profiles


@dataclass(frozen=True)
class ProfileStatus:
    profile: Profile | None
    path: Path
    warning: str | None = None  # why an existing file was not used; None when fine or simply missing


def page_local_home() -> Path:
    """$PAGE_LOCAL_HOME if set, else the per-user data directory of page-local."""
    env = os.environ.get("PAGE_LOCAL_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs  # imported on first use (nothing runs at import time)

    return Path(platformdirs.user_data_dir("page-local"))


def profile_path(model_id: str) -> Path:
    if not isinstance(model_id, str) or not _MODEL_ID.fullmatch(model_id):
        raise ValueError(f"model id must be 1-128 characters of [A-Za-z0-9._-], got {model_id!r}")
    return page_local_home() / "profiles" / f"{model_id}.json"


def save_profile(model_id: str, mu: float, sigma: float, n_pilot: int, model_desc: str,
                 pilot_tokens: tuple[int, int] | None = None) -> Path:
    """Write the profile atomically (temp file in the same directory + os.replace); returns its path.
    pilot_tokens: the shortest and longest pilot prompt in tokens, when known."""
    path = profile_path(model_id)
    if not (_is_real(mu) and math.isfinite(mu)):
        raise ValueError(f"mu must be a finite number, got {mu!r}")
    if not (_is_real(sigma) and math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma must be a finite number > 0, got {sigma!r}")
    if isinstance(n_pilot, bool) or not isinstance(n_pilot, numbers.Integral) or n_pilot < 2:
        raise ValueError(f"n_pilot must be an int >= 2, got {n_pilot!r}")
    if pilot_tokens is not None:
        pilot_tokens = _check_pilot_tokens(pilot_tokens)
    from page_local import __version__

    data = {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "model_id": model_id,
        "model": str(model_desc),
        "n_pilot": int(n_pilot),
        "mu": float(mu),
        "sigma": float(sigma),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "page_local_version": __version__,
    }
    if pilot_tokens is not None:
        data["pilot_tokens"] = list(pilot_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{model_id}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_profile(model_id: str) -> ProfileStatus:
    """The stored profile of `model_id` with a warning instead of an exception for unusable files."""
    path = profile_path(model_id)
    if not path.exists():
        return ProfileStatus(None, path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        profile = _parse_profile(data)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return ProfileStatus(None, path, f"ignoring unreadable calibration profile {path}: {e}; "
                                         "using the raw threshold")
    except ValueError as e:
        return ProfileStatus(None, path, f"ignoring invalid calibration profile {path}: {e}; "
                                         "using the raw threshold")
    if profile.model_id != model_id:
        return ProfileStatus(None, path, f"ignoring calibration profile {path}: it belongs to model "
                                         f"{profile.model_id!r}, not {model_id!r}; using the raw threshold")
    return ProfileStatus(profile, path)


def load_profile(model_id: str) -> Profile | None:
    """The stored profile, or None when missing or unusable (then a ProfileWarning is issued too)."""
    status = read_profile(model_id)
    if status.warning:
        warnings.warn(status.warning, ProfileWarning, stacklevel=2)
    return status.profile


def read_profile_file(path: str | os.PathLike) -> Profile:
    """A profile from an explicit file (e.g. one copied from another machine); ValueError if unusable."""
    p = Path(path).expanduser()
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"no such calibration profile: {p} (`page-local calibrate` prints where it "
                         "stores one)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read calibration profile {p}: {e}") from None
    try:
        return _parse_profile(data)
    except ValueError as e:
        raise ValueError(f"{p} is not a page-local calibration profile: {e}") from None


def _parse_profile(data: object) -> Profile:
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if data.get("format") != PROFILE_FORMAT or data.get("version") != PROFILE_VERSION:
        raise ValueError(f"format {data.get('format')!r} version {data.get('version')!r}, "
                         f"expected {PROFILE_FORMAT!r} version {PROFILE_VERSION}")
    missing = [k for k in ("model_id", "model", "n_pilot", "mu", "sigma", "created", "page_local_version")
               if k not in data]
    if missing:
        raise ValueError(f"missing keys {missing}")
    mu, sigma, n = data["mu"], data["sigma"], data["n_pilot"]
    for name, v in (("mu", mu), ("sigma", sigma)):
        if not (_is_real(v) and math.isfinite(v)):
            raise ValueError(f"{name} = {v!r} is not a finite number")
    if sigma <= 0:
        raise ValueError(f"sigma = {sigma!r} is not > 0")
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"n_pilot = {n!r} is not an int >= 2")
    if not isinstance(data["model_id"], str):
        raise ValueError(f"model_id = {data['model_id']!r} is not a string")
    pilot_tokens = data.get("pilot_tokens")  # optional: profiles from before it was recorded lack it
    if pilot_tokens is not None:
        pilot_tokens = _check_pilot_tokens(pilot_tokens)
    return Profile(model_id=data["model_id"], model=str(data["model"]), n_pilot=n, mu=float(mu),
                   sigma=float(sigma), created=str(data["created"]),
                   page_local_version=str(data["page_local_version"]), pilot_tokens=pilot_tokens)


def _check_pilot_tokens(v: object) -> tuple[int, int]:
    ok = (isinstance(v, (list, tuple)) and len(v) == 2
          and all(isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_)) and x >= 1 for x in v)
          and v[0] <= v[1])
    if not ok:
        raise ValueError(f"pilot_tokens = {v!r} is not [shortest, longest] with 1 <= shortest <= longest")
    return int(v[0]), int(v[1])


# ---------------------------------------------------------------------------------------------
# model identity from the GGUF header

_IDENTITY_KEYS = ("general.architecture", "general.name", "block_count", "embedding_length")
# GGUF value types: scalar struct formats by type id; 8 = string, 9 = array.
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_metadata(gguf_path: str | os.PathLike) -> dict[str, object]:
    """general.architecture, general.name, <arch>.block_count, <arch>.embedding_length (missing ones
    absent) and file_size, read from the GGUF key-value header only: tensors are never read."""
    path = Path(gguf_path)
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        version, _n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")

        def read(fmt: str):
            size = struct.calcsize("<" + fmt)
            buf = f.read(size)
            if len(buf) != size:
                raise ValueError(f"{path}: truncated GGUF header")
            return struct.unpack("<" + fmt, buf)[0]

        def read_str() -> str:
            n = read("Q")
            return f.read(n).decode("utf-8", errors="replace")

        def skip(vtype: int) -> object:
            if vtype in _SCALAR:
                return read(_SCALAR[vtype])
            if vtype == 8:
                return read_str()
            if vtype == 9:
                etype, count = read("I"), read("Q")
                if etype in _SCALAR:
                    f.seek(count * struct.calcsize("<" + _SCALAR[etype]), os.SEEK_CUR)
                else:
                    for _ in range(count):  # strings (token lists) or nested arrays
                        skip(etype)
                return None
            raise ValueError(f"{path}: unknown GGUF value type {vtype}")

        raw: dict[str, object] = {}
        for _ in range(n_kv):
            key = read_str()
            value = skip(read("I"))
            if key.startswith("general.") or key.endswith((".block_count", ".embedding_length")):
                raw[key] = value
            arch = raw.get("general.architecture")
            wanted = ("general.name", f"{arch}.block_count", f"{arch}.embedding_length")
            if arch and all(k in raw for k in wanted):
                break  # the tokenizer arrays usually follow; no need to walk them
    found = {k: raw[k] for k in _IDENTITY_KEYS[:2] if k in raw}
    arch = raw.get("general.architecture")
    for k in _IDENTITY_KEYS[2:]:
        if f"{arch}.{k}" in raw:
            found[k] = raw[f"{arch}.{k}"]
    found["file_size"] = path.stat().st_size
    return found


def model_identity(gguf_path: str | os.PathLike) -> str:
    """Stable model id "<arch>-<16 hex>": sha256 of architecture, name, layer count, width and file size."""
    meta = gguf_metadata(gguf_path)
    parts = [str(meta.get(k, "")) for k in _IDENTITY_KEYS] + [str(meta["file_size"])]
    digest = hashlib.sha256("\x1f".join(parts).encode("utf-8")).hexdigest()[:16]
    arch = re.sub(r"[^A-Za-z0-9_-]", "_", str(meta.get("general.architecture", "gguf"))) or "gguf"
    return f"{arch[:64]}-{digest}"


def describe_model(gguf_path: str | os.PathLike) -> str:
    """Human-readable description for a profile's "model" field."""
    meta = gguf_metadata(gguf_path)
    return (f"{meta.get('general.name', Path(gguf_path).name)} ({meta.get('general.architecture', '?')}, "
            f"{meta.get('block_count', '?')} layers, width {meta.get('embedding_length', '?')}, "
            f"{meta['file_size']} bytes)")

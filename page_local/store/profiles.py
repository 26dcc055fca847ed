"""Calibration profiles: small JSON files under <home>/profiles/<model_id>.json (store.home), holding the
mu and sigma of an unlabeled pilot's drops D for one model (gate.Gate uses them for the calibrated rule).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from page_local.errors import ProfileWarning
from page_local.store.home import atomic_write, page_local_home

PROFILE_FORMAT = "page-local-profile"
PROFILE_VERSION = 1
LENGTH_SLACK = 1.25  # prompts within [shortest / 1.25, longest * 1.25] of the pilot count as covered
_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


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
class ProfileStatus:
    profile: Profile | None
    path: Path
    warning: str | None = None  # why an existing file was not used; None when fine or simply missing


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
    with atomic_write(path, fsync=True) as f:
        json.dump(data, f, indent=2)
        f.write("\n")
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

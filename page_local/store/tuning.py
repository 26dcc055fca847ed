"""Attention tunings: what `page-local tune` measured, one JSON file per (model, machine, device, threads,
library) under <home>/tuning/ (store.home).

A tuning is valid only for the setting it was measured in: the key hashes the model's identity, the CPU
(its model name and feature flags), the device that holds the layers, the thread count and the native
libraries' files (a rebuild or an upgrade makes a new key, so an old measurement is never reused). A file
that cannot be read, that is malformed or that was written for another key is ignored with a warning.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import os
import platform
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

from page_local.store.home import atomic_write, page_local_home

TUNING_FORMAT = "page-local-tuning"
TUNING_VERSION = 1
SETTINGS = ("on", "off")  # flash attention on / off: the two measured paths


@lru_cache(maxsize=1)
def machine_signature() -> str:
    """The CPU as a person would name it plus a hash of its feature flags (two CPUs with one name but
    different instruction sets, e.g. a VM that hides AVX-512, differ)."""
    name, flags = platform.processor() or platform.machine(), ""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
            name = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = " ".join(sorted(value.split()))
    digest = hashlib.sha256(flags.encode()).hexdigest()[:8]
    return f"{platform.machine()} {name} [{digest}]"


def library_signature(lib_dir: Path) -> str:
    """Size and modification time of every shared library in lib_dir (libllama, libggml*): a rebuild
    changes it."""
    parts = []
    for p in sorted(lib_dir.glob("*")):
        if p.suffix in (".so", ".dylib", ".dll") or ".so." in p.name:
            try:
                st = p.stat()
            except OSError:
                continue
            parts.append(f"{p.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TuningKey:
    model_id: str
    machine: str
    device: str  # where the layers run: "CPU", a GPU's name, a split
    threads: int
    library: str

    def digest(self) -> str:
        text = "\x1f".join([self.model_id, self.machine, self.device, str(self.threads), self.library])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return {"model_id": self.model_id, "machine": self.machine, "device": self.device,
                "threads": self.threads, "library": self.library}


@dataclass(frozen=True)
class Tuning:
    """Measured timings of one key: per setting ("on"/"off"), points (T, prefill ms per token of the chunk
    that ended at T, median decode ms of one token at T cells, the interquartile range of those decode steps),
    T ascending. A tuning stored before the spread was measured has points of three fields."""

    key: TuningKey
    points: dict  # {"on": [(T, prefill_ms_per_token, decode_ms[, decode_spread_ms]), ...], "off": [...]}
    created: str
    seconds: float  # how long the measurement took
    others_cores: float | None = None  # other processes' average CPU use while it measured (None: not recorded)


def tuning_path(key: TuningKey) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", key.model_id)[:80]
    return page_local_home() / "tuning" / f"{safe}-{key.digest()}.json"


def save_tuning(tuning: Tuning) -> Path:
    path = tuning_path(tuning.key)
    data = {"format": TUNING_FORMAT, "version": TUNING_VERSION, "key": tuning.key.to_dict(),
            "created": tuning.created, "seconds": round(float(tuning.seconds), 2),
            "points": {s: [[int(row[0])] + [float(v) for v in row[1:]] for row in tuning.points[s]]
                       for s in SETTINGS}}
    if tuning.others_cores is not None:
        data["others_cores"] = round(float(tuning.others_cores), 3)
    with atomic_write(path) as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    return path


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def parse_points(raw) -> dict:
    """Validate {"on": [[T, p, d(, spread)], ...], "off": [...]}: ValueError says what is wrong."""
    if not isinstance(raw, dict) or set(raw) != set(SETTINGS):
        raise ValueError("'points' must have exactly the settings 'on' and 'off'")
    out = {}
    for s in SETTINGS:
        rows = raw[s]
        if not isinstance(rows, list) or not rows:
            raise ValueError(f"'points.{s}' must be a non-empty list")
        pts = []
        for row in rows:
            if (not isinstance(row, (list, tuple)) or len(row) not in (3, 4) or not all(_real(v) for v in row)
                    or row[0] < 1 or row[1] <= 0 or row[2] <= 0 or (len(row) == 4 and row[3] < 0)):
                raise ValueError(f"'points.{s}' rows must be [T >= 1, prefill ms > 0, decode ms > 0, and optionally "
                                 f"decode spread ms >= 0], got {row!r}")
            pts.append((int(row[0]),) + tuple(float(v) for v in row[1:]))
        if [p[0] for p in pts] != sorted({p[0] for p in pts}):
            raise ValueError(f"'points.{s}' must be in ascending T without repeats")
        out[s] = pts
    return out


@dataclass(frozen=True)
class TuningStatus:
    tuning: Tuning | None
    path: Path
    warning: str | None = None  # why an existing file was not used


def read_tuning(key: TuningKey) -> TuningStatus:
    """The stored tuning of `key`; a missing file is None, an unusable one None with a warning."""
    path = tuning_path(key)
    if not path.exists():
        return TuningStatus(None, path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != TUNING_FORMAT:
            raise ValueError("not a page-local tuning file (format field missing)")
        if data.get("version") != TUNING_VERSION:
            raise ValueError(f"version {data.get('version')!r}, this page-local reads {TUNING_VERSION}")
        if data.get("key") != key.to_dict():
            return TuningStatus(None, path, f"ignoring the attention tuning {path}: it was measured for another "
                                            "model, machine, thread count or library; run `page-local tune` again")
        points = parse_points(data.get("points"))
        seconds = data.get("seconds", 0.0)
        others = data.get("others_cores")
        tuning = Tuning(key, points, str(data.get("created", "")), float(seconds) if _real(seconds) else 0.0,
                        float(others) if _real(others) and others >= 0 else None)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError, TypeError) as e:
        return TuningStatus(None, path, f"ignoring the unreadable attention tuning {path} ({e}); "
                                        "run `page-local tune` again")
    return TuningStatus(tuning, path)


def remove_tuning(key: TuningKey) -> bool:
    path = tuning_path(key)
    try:
        os.remove(path)
        return True
    except FileNotFoundError:
        return False

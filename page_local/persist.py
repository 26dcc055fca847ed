"""Saving and restoring an engine's KV cache with page-local's bookkeeping, so that a chat whose
cache was evicted continues with identical tokens after a reload (a re-prefill could not: the
evicted positions are gone, and re-running the gate on the whole text would evict differently).

File layout (little-endian):
    b"PGLC" | u32 version | u64 header length | header (UTF-8 JSON) | u64 state length | state |
    32-byte sha256 of everything before it
The header holds the model identity, n_ctx, the token history, the positions held, and the
caller's own data (the chat's messages and settings). The state is llama.cpp's sequence state
(llama_state_seq_get_data of sequence 0), which keeps each cell's position: the gaps left by
eviction survive the round trip.

Files are written atomically (temp file + rename): a failed save never clobbers the old file, and a
truncated, corrupt or foreign file is refused before anything in the engine is touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np

MAGIC = b"PGLC"
VERSION = 1


class StateFileError(ValueError):
    """A cache file that cannot be restored: truncated, corrupt, another model, or too large."""


def is_state_file(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def save(engine, path: str | os.PathLike, extra: dict | None = None) -> Path:
    """Write the engine's sequence 0 (cache + history) and `extra` (JSON-serialisable) to path."""
    path = Path(path).expanduser()
    state = engine.ctx.seq_state(0)
    header = {
        "format": "page-local-cache",
        "model_id": engine.model_id,
        "n_ctx": engine.n_ctx,
        "history": [int(t) for t in engine.history],
        "positions": engine.ctx.page.positions(0).tolist(),
        "extra": extra or {},
    }
    hb = json.dumps(header).encode("utf-8")
    body = MAGIC + struct.pack("<IQ", VERSION, len(hb)) + hb + struct.pack("<Q", len(state)) + state
    blob = body + hashlib.sha256(body).digest()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read(path: str | os.PathLike) -> tuple[dict, bytes]:
    """Parse and verify a cache file; returns (header, state). Raises StateFileError."""
    path = Path(path).expanduser()
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise StateFileError(f"no such file: {path}") from None
    except OSError as e:
        raise StateFileError(f"cannot read {path}: {e.strerror}") from None
    if blob[:4] != MAGIC:
        raise StateFileError(f"{path} is not a page-local cache file")
    if len(blob) < 4 + 12 + 8 + 32:
        raise StateFileError(f"{path} is truncated")
    body, digest = blob[:-32], blob[-32:]
    if hashlib.sha256(body).digest() != digest:
        raise StateFileError(f"{path} is truncated or corrupt (checksum mismatch)")
    version, hlen = struct.unpack_from("<IQ", body, 4)
    if version != VERSION:
        raise StateFileError(f"{path} has format version {version}; this page-local reads version {VERSION}")
    off = 16
    try:
        header = json.loads(body[off : off + hlen].decode("utf-8"))
        (slen,) = struct.unpack_from("<Q", body, off + hlen)
    except (UnicodeDecodeError, json.JSONDecodeError, struct.error) as e:
        raise StateFileError(f"{path} has a corrupt header ({e})") from None
    state = body[off + hlen + 8 :]
    if len(state) != slen or not isinstance(header, dict) or header.get("format") != "page-local-cache":
        raise StateFileError(f"{path} is truncated or corrupt")
    return header, state


def load(engine, path: str | os.PathLike) -> dict:
    """Restore a saved cache into the engine; returns the saved `extra`. The engine is untouched if
    the file is refused (StateFileError)."""
    header, state = read(path)
    if header.get("model_id") != engine.model_id:
        raise StateFileError(f"{path} was saved with model {header.get('model_id')}, "
                             f"not the loaded one ({engine.model_id})")
    positions = header.get("positions") or []
    if len(positions) + 1 > engine.n_ctx:
        raise StateFileError(f"{path} holds {len(positions)} cells; this engine's n_ctx is {engine.n_ctx}")
    engine.reset()
    try:
        engine.ctx.set_seq_state(state, 0)
    except Exception as e:
        engine.reset()
        raise StateFileError(f"llama.cpp refused the cache in {path}: {e}") from None
    held = engine.ctx.page.positions(0)
    if not np.array_equal(held, np.asarray(positions, dtype=held.dtype)):
        engine.reset()
        raise StateFileError(f"{path}: the restored cache does not hold the saved positions")
    engine.history = [int(t) for t in header.get("history", [])]
    return header.get("extra") or {}

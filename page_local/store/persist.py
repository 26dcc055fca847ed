"""Saving and restoring an engine's KV cache with page-local's bookkeeping, so that a chat whose
cache was evicted continues with identical tokens after a reload (a re-prefill could not: the
evicted positions are gone, and re-running the gate on the whole text would evict differently).

File layout (little-endian):
    b"PGLC" | u32 version | u64 header length | header (UTF-8 JSON) | u64 state length | state |
    32-byte sha256 of everything before it
The header holds the model identity, n_ctx, the token history, the positions held, and the
caller's own data (the chat's messages and settings). The state is llama.cpp's sequence state
(llama_state_seq_get_data of sequence 0), which keeps each cell's position: the gaps left by
eviction survive the round trip. Version 2 (a conversation with parked cells, engine/parking.py): the
state is followed by the parking sequence's state, its length, positions and scores in the header.

Files are written atomically (temp file + rename): a failed save never clobbers the old file, and a
truncated, corrupt or foreign file is refused before anything in the engine is touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from page_local.errors import StateFileError
from page_local.store.home import atomic_write

MAGIC = b"PGLC"
VERSION = 2  # written when cells are parked; 1 otherwise (what page-local wrote before parking)
VERSIONS = (1, 2)


def is_state_file(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


@dataclass(frozen=True)
class Snapshot:
    """One conversation's cache held in host memory: what Engine.snapshot() returns and restore() takes,
    and what a cache file holds (with the caller's extra data)."""

    model_id: str
    n_ctx: int
    history: tuple[int, ...]  # every token the conversation decoded, evicted ones included
    positions: tuple[int, ...]  # the positions the cache holds (gaps where eviction removed cells)
    state: bytes  # llama.cpp's sequence state of sequence 0 (bytes-like: a view of a file read)
    history_pos: tuple[int, ...] | None = None  # the position of each history token; None: its index
    parked_state: bytes = b""  # llama.cpp's sequence state of the parking sequence (engine/parking.py)
    parked: tuple[int, ...] = ()  # the positions parked
    parked_scores: tuple[float, ...] = ()  # each one's score when it was parked (the lowest goes first)
    # with parking: the tokens after the check's cap of the conversation's recent answers (selfcheck.Payback)
    answers_after: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return len(self.state) + len(self.parked_state)


def save(snap: Snapshot, path: str | os.PathLike, extra: dict | None = None) -> Path:
    """Write a snapshot and `extra` (JSON-serialisable) to path, atomically."""
    path = Path(path).expanduser()
    header = {
        "format": "page-local-cache",
        "model_id": snap.model_id,
        "n_ctx": snap.n_ctx,
        "history": list(snap.history),
        "positions": list(snap.positions),
        "history_pos": None if snap.history_pos is None else list(snap.history_pos),
        "extra": extra or {},
    }
    if snap.answers_after:  # optional in every version: a reader without it starts with none
        header["answers_after"] = list(snap.answers_after)
    version = 1
    if snap.parked:
        version = VERSION
        header.update(parked=list(snap.parked), parked_scores=list(snap.parked_scores),
                      parked_state_bytes=len(snap.parked_state))
    hb = json.dumps(header).encode("utf-8")
    # written piece by piece and hashed as it goes: a cache of tens of MB is never copied to be joined
    pieces = (MAGIC + struct.pack("<IQ", version, len(hb)) + hb
              + struct.pack("<Q", len(snap.state) + len(snap.parked_state)), snap.state, snap.parked_state)
    h = hashlib.sha256()
    with atomic_write(path, "wb") as f:
        for piece in pieces:
            h.update(piece)
            f.write(piece)
        f.write(h.digest())
    return path


def read(path: str | os.PathLike) -> tuple[Snapshot, dict]:
    """Parse and verify a cache file; returns (the snapshot, the saved extra). Raises StateFileError."""
    path = Path(path).expanduser()
    try:  # read once into one buffer; the state is a view of it, never copied again (tens of MB)
        with open(path, "rb") as f:
            blob = bytearray(os.fstat(f.fileno()).st_size)
            n = f.readinto(blob)
        del blob[n:]
    except FileNotFoundError:
        raise StateFileError(f"no such file: {path}") from None
    except OSError as e:
        raise StateFileError(f"cannot read {path}: {e.strerror}") from None
    if blob[:4] != MAGIC:
        raise StateFileError(f"{path} is not a page-local cache file")
    if len(blob) < 4 + 12 + 8 + 32:
        raise StateFileError(f"{path} is truncated")
    body, digest = memoryview(blob)[:-32], bytes(blob[-32:])
    if hashlib.sha256(body).digest() != digest:
        raise StateFileError(f"{path} is truncated or corrupt (checksum mismatch)")
    version, hlen = struct.unpack_from("<IQ", body, 4)
    if version not in VERSIONS:
        raise StateFileError(f"{path} has format version {version}; this page-local reads versions "
                             f"{', '.join(map(str, VERSIONS))}")
    off = 16
    try:
        header = json.loads(bytes(body[off : off + hlen]).decode("utf-8"))
        (slen,) = struct.unpack_from("<Q", body, off + hlen)
    except (UnicodeDecodeError, json.JSONDecodeError, struct.error) as e:
        raise StateFileError(f"{path} has a corrupt header ({e})") from None
    state = body[off + hlen + 8 :]
    if len(state) != slen or not isinstance(header, dict) or header.get("format") != "page-local-cache":
        raise StateFileError(f"{path} is truncated or corrupt")
    try:
        n_parked = int(header.get("parked_state_bytes", 0)) if version >= 2 else 0
        if not 0 <= n_parked <= len(state):
            raise ValueError("parked_state_bytes is outside the state")
        snap = Snapshot(model_id=str(header["model_id"]), n_ctx=int(header["n_ctx"]),
                        history=tuple(int(t) for t in header.get("history", [])),
                        positions=tuple(int(p) for p in header.get("positions", [])),
                        state=state[: len(state) - n_parked],
                        history_pos=None if header.get("history_pos") is None
                        else tuple(int(p) for p in header["history_pos"]),
                        parked_state=state[len(state) - n_parked:] if n_parked else b"",
                        parked=tuple(int(p) for p in header.get("parked", [])) if n_parked else (),
                        parked_scores=tuple(float(x) for x in header.get("parked_scores", [])) if n_parked else (),
                        answers_after=tuple(int(x) for x in header.get("answers_after", [])))
    except (KeyError, TypeError, ValueError) as e:
        raise StateFileError(f"{path} has a corrupt header ({e})") from None
    extra = header.get("extra") or {}
    if not isinstance(extra, dict):
        raise StateFileError(f"{path} has a corrupt header (extra is not an object)")
    return snap, extra

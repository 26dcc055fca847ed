"""Model identity and metadata from a GGUF file's key-value header (tensors are never read)."""

from __future__ import annotations

import hashlib
import os
import re
import struct
from pathlib import Path


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

"""Model identity and metadata from a GGUF file's key-value header (tensors are never read)."""

from __future__ import annotations

import hashlib
import os
import re
import struct
from pathlib import Path
from typing import Callable


_IDENTITY_KEYS = ("general.architecture", "general.name", "block_count", "embedding_length")
# GGUF value types: scalar struct formats by type id; 8 = string, 9 = array.
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _header(gguf_path: str | os.PathLike, keep: Callable[[str], bool], enough: Callable[[dict], bool]) -> dict:
    """The header's values whose key `keep` accepts, read in order until `enough(found)` (the tokenizer arrays
    that usually follow are then never walked) or the header ends."""
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
            if keep(key):
                raw[key] = value
                if enough(raw):
                    break
    return raw


def gguf_metadata(gguf_path: str | os.PathLike) -> dict[str, object]:
    """general.architecture, general.name, <arch>.block_count, <arch>.embedding_length (missing ones
    absent) and file_size, read from the GGUF key-value header only: tensors are never read."""

    def enough(raw: dict) -> bool:
        arch = raw.get("general.architecture")
        return bool(arch) and all(k in raw for k in ("general.name", f"{arch}.block_count",
                                                     f"{arch}.embedding_length"))

    raw = _header(gguf_path, lambda k: k.startswith("general.") or k.endswith((".block_count", ".embedding_length")),
                  enough)
    found = {k: raw[k] for k in _IDENTITY_KEYS[:2] if k in raw}
    arch = raw.get("general.architecture")
    for k in _IDENTITY_KEYS[2:]:
        if f"{arch}.{k}" in raw:
            found[k] = raw[f"{arch}.{k}"]
    found["file_size"] = Path(gguf_path).stat().st_size
    return found


# the hyperparameters that size a context: <arch>.<key> -> the name gguf_shape gives it
_SHAPE_KEYS = {"context_length": "n_ctx_train", "block_count": "n_layer", "embedding_length": "n_embd",
               "attention.head_count": "n_head", "attention.head_count_kv": "n_head_kv",
               "attention.key_length": "head_dim_k", "attention.value_length": "head_dim_v"}


def gguf_shape(gguf_path: str | os.PathLike) -> dict[str, int]:
    """n_ctx_train, n_layer, n_embd, n_head, n_head_kv, head_dim_k, head_dim_v from the header (those it does
    not give are absent; a per-layer array of head counts gives its largest). Tensors are never read."""
    raw = _header(gguf_path, lambda k: k == "general.architecture" or k.endswith(tuple(_SHAPE_KEYS)),
                  lambda raw: raw.get("general.architecture") is not None
                  and all(f"{raw['general.architecture']}.{k}" in raw for k in _SHAPE_KEYS))
    arch = raw.get("general.architecture")
    out = {}
    for k, name in _SHAPE_KEYS.items():
        v = raw.get(f"{arch}.{k}")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            out[name] = int(v)
    return out


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

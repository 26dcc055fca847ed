"""Factors of the attention output projection W_O, for LORE-KV's deletion cost (docs/algorithms.md §4.3).

Head h writes to the residual stream through its column block W_O^(h) (d_model x d_v). With the QR
factorisation W_O^(h) = Q_h R_h (Q_h orthonormal columns), ||W_O^(h) x|| = ||R_h x||, so the device
only needs the small d_v x d_v factor R_h (computed as the Cholesky factor of W_O^(h)^T W_O^(h),
which is the same matrix). Three projections, as docs/algorithms.md §4.3 lists them:

  "wo"   : R_h from the QR of W_O^(h) (exact)
  "none" : R_h = I (no W_O: the cost is measured in value space)
  "gain" : R_h = g_h I with g_h = ||W_O^(h)||_F / sqrt(d_v), the RMS singular value (fixes the
           cross-head weighting at no per-token cost)

The weights are read from the loaded model (dequantized by ggml), or, where the CPU backend has
repacked them into a layout it cannot read back, from the GGUF file (dequantized with the gguf
package); once per model and projection.
"""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np

from page_local.evictors.lorekv import PROJECTIONS


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None or not f.data:
        return None
    vals = [f.parts[i] for i in f.data]
    return [int(np.asarray(v).ravel()[0]) for v in vals] if len(vals) > 1 else np.asarray(vals[0]).ravel()


def _scalar(reader, key: str) -> int | None:
    v = _field(reader, key)
    if v is None:
        return None
    arr = np.asarray(v).ravel()
    if arr.dtype.kind not in "iu" or arr.size == 0:
        return None
    if arr.size > 1 and not np.all(arr == arr[0]):
        raise ValueError(f"{key} differs between layers; LORE-KV's deletion cost needs one head count")
    return int(arr[0])


@lru_cache(maxsize=4)
def _load(path: str, mtime: float, mode: str) -> np.ndarray:
    import gguf
    from gguf import quants

    reader = gguf.GGUFReader(path)
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise ValueError(f"{os.path.basename(path)}: no general.architecture in the GGUF metadata")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode("utf-8")
    n_layer = _scalar(reader, f"{arch}.block_count")
    n_head = _scalar(reader, f"{arch}.attention.head_count")
    n_embd = _scalar(reader, f"{arch}.embedding_length")
    if not n_layer or not n_head or not n_embd:
        raise ValueError(f"{os.path.basename(path)}: the GGUF lacks block_count, head_count or embedding_length")
    d_v = _scalar(reader, f"{arch}.attention.value_length") or n_embd // n_head
    tensors = {t.name: t for t in reader.tensors}
    out = np.empty((n_layer, n_head, d_v, d_v), dtype=np.float32)
    for il in range(n_layer):
        t = tensors.get(f"blk.{il}.attn_output.weight")
        if t is None:
            raise ValueError(f"{os.path.basename(path)}: layer {il} has no attn_output.weight; "
                             "LORE-KV needs a standard attention output projection")
        w = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float64)  # (d_model, n_head * d_v)
        if w.ndim != 2 or w.shape[1] != n_head * d_v:
            raise ValueError(f"{os.path.basename(path)}: blk.{il}.attn_output.weight has shape {w.shape}, "
                             f"expected (d_model, {n_head} * {d_v})")
        for h in range(n_head):
            block = w[:, h * d_v:(h + 1) * d_v]
            out[il, h] = head_factor(block, mode)
    return out


def head_factor(block: np.ndarray, mode: str = "wo") -> np.ndarray:
    """f64 (d_v, d_v): the factor R with ||R x|| standing in for ||block x|| (block: d_model x d_v)."""
    if mode not in PROJECTIONS:
        raise ValueError(f"projection must be one of {', '.join(PROJECTIONS)}; got {mode!r}")
    d_v = block.shape[1]
    if mode == "none":
        return np.eye(d_v)
    if mode == "gain":
        return np.eye(d_v) * (np.linalg.norm(block) / np.sqrt(d_v))
    # R of the QR factorisation (positive diagonal) is the Cholesky factor of the Gram matrix
    # G = block^T block; computed that way because a d_v x d_v Cholesky is ~10x cheaper than a
    # d_model x d_v QR (and multithreaded BLAS QRs crawl on a busy 2-core machine). A rank-deficient
    # block (G singular) takes the eigendecomposition instead: any R with R^T R = G preserves ||.||.
    g = block.T @ block
    try:
        return np.linalg.cholesky(g).T
    except np.linalg.LinAlgError:
        lam, u = np.linalg.eigh(g)
        return np.sqrt(np.clip(lam, 0.0, None))[:, None] * u.T


def out_proj_factors(path: str | os.PathLike, mode: str = "wo") -> np.ndarray:
    """f32 (n_layer, n_head, d_v, d_v): R_h of every layer and query head of the GGUF model at path."""
    if mode not in PROJECTIONS:
        raise ValueError(f"projection must be one of {', '.join(PROJECTIONS)}; got {mode!r}")
    p = os.fspath(path)
    return _load(p, os.path.getmtime(p), mode)


def context_out_proj_factors(ctx, n_layer: int, n_head: int, n_embd: int, mode: str = "wo",
                             path: str | os.PathLike | None = None) -> np.ndarray:
    """Like out_proj_factors, reading W_O from the model loaded in `ctx` (a runtime.Context); falls
    back to the GGUF file at `path` when the backend cannot read a weight back (repacked)."""
    from page_local.native.pageops import UnsupportedModel

    if mode not in PROJECTIONS:
        raise ValueError(f"projection must be one of {', '.join(PROJECTIONS)}; got {mode!r}")
    out = None
    for il in range(n_layer):
        try:
            w = ctx.page.out_proj_weight(il, n_embd).astype(np.float64)  # (d_model, n_head * d_v)
        except UnsupportedModel:
            if path is None:
                raise
            return out_proj_factors(path, mode)
        if w.shape[1] % n_head:
            raise ValueError(f"layer {il}: W_O has {w.shape[1]} input columns, not a multiple of {n_head} heads")
        d_v = w.shape[1] // n_head
        if out is None:
            out = np.empty((n_layer, n_head, d_v, d_v), dtype=np.float32)
        for h in range(n_head):
            out[il, h] = head_factor(w[:, h * d_v:(h + 1) * d_v], mode)
    return out

"""Thin Python owners of page-local's native calls (the only module that touches the cffi library).

`PageOps` wraps one llama_context created by llama-cpp-python (it does not own it: the engine
does) and exposes the probe, eviction and compaction with numpy outputs and Python exceptions.
Every native failure arrives as a return code plus a message (csrc/include/llama-page.h); here it
becomes one of the exceptions below, and the context stays usable.
"""

from __future__ import annotations

import ctypes
from types import ModuleType

import numpy as np

from page_local.probe import ProbeResult
from page_local.errors import InvalidArgument, InvalidPositions, LibraryError, PageError, ProbeError, UnsupportedModel


_ERRORS = {-1: InvalidArgument, -2: ProbeError, -3: UnsupportedModel, -4: ProbeError, -5: InvalidPositions}


def load() -> tuple:
    """(ffi, lib, llama_cpp) bound to the one patched libllama (see bindings.loader). A library that is
    missing, cannot be opened or is not the patched build is a LibraryError (the message says what to do)."""
    from page_local_bindings import LibraryMismatch, load as _load  # late: nothing is loaded at import time

    try:
        return _load()
    except (LibraryMismatch, OSError) as e:  # OSError: missing (FileNotFoundError) or not loadable
        raise LibraryError(str(e)) from e


def library_dir():
    """The folder the patched libllama is (or would be) loaded from: where the native libraries are."""
    from page_local_bindings.loader import library_dir as _dir

    return _dir()


def llama_cpp() -> ModuleType:
    """The llama_cpp module, guaranteed to run on page-local's patched library."""
    return load()[2]


class PageOps:
    """Probe / evict / compact on one llama_context (borrowed, not owned)."""

    def __init__(self, ctx_ptr):
        self._ffi, self._lib, _ = load()
        address = ctypes.cast(ctx_ptr, ctypes.c_void_p).value
        if not address:
            raise InvalidArgument("the llama_context is NULL (closed?)")
        self._ctx = self._ffi.cast("struct llama_context *", address)

    def _check(self, rc: int) -> int:
        if rc < 0:
            msg = self._ffi.string(self._lib.llama_page_last_error()).decode("utf-8", "replace")
            raise _ERRORS.get(rc, PageError)(msg or f"page-local native call failed with code {rc}", rc)
        return rc

    # --- probe -------------------------------------------------------------------------------
    def arm_probe(self, seq_id: int, top_k: int = 32, keep_rows: bool = False, last: int = 0) -> None:
        """Arm the probe for the next llama_decode (one ubatch, tokens of seq_id only). last: it reads only
        the batch's last `last` queries (0: all); the others are decoded as usual."""
        for name, v in (("top_k", top_k), ("last", last)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise InvalidArgument(f"{name} must be an int, got {v!r}")
        if last < 0:
            raise InvalidArgument(f"last must be >= 0 (0: every query of the batch), got {last}")
        self._check(self._lib.llama_page_probe_arm(self._ctx, int(seq_id), int(top_k), bool(keep_rows)))
        if last:
            self._check(self._lib.llama_page_probe_last_queries(self._ctx, int(last)))

    def disarm_probe(self) -> None:
        self._check(self._lib.llama_page_probe_disarm(self._ctx))

    def read_probe(self) -> ProbeResult:
        """The result of the last armed decode (ProbeError if there is none)."""
        ffi, lib = self._ffi, self._lib
        info = ffi.new("struct llama_page_probe_info *")
        self._check(lib.llama_page_probe_get_info(self._ctx, info))
        if info.has_costs:
            raise ProbeError("the last probe computed deletion costs; read them with read_costs()")
        L, H, K, P, Q = info.n_layer, info.n_head, info.top_k, info.n_pos, info.n_query

        positions = np.empty(P, dtype=np.int32)
        queries = np.empty(Q, dtype=np.int32)
        mean = np.empty((L, P), dtype=np.float32)
        topk_pos = np.empty((L, H, K), dtype=np.int32)
        topk_score = np.empty((L, H, K), dtype=np.float32)
        self._check(lib.llama_page_probe_get_positions(self._ctx, _ptr(ffi, "llama_pos *", positions), P))
        self._check(lib.llama_page_probe_get_queries(self._ctx, _ptr(ffi, "llama_pos *", queries), Q))
        self._check(lib.llama_page_probe_get_mean(self._ctx, _ptr(ffi, "float *", mean), mean.size))
        self._check(lib.llama_page_probe_get_topk(
            self._ctx, _ptr(ffi, "llama_pos *", topk_pos), _ptr(ffi, "float *", topk_score), topk_pos.size))
        rows = None
        if info.has_rows:
            rows = np.empty((L, H, P), dtype=np.float32)
            self._check(lib.llama_page_probe_get_rows(self._ctx, _ptr(ffi, "float *", rows), rows.size))
        return ProbeResult(positions=positions, queries=queries, mean=mean,
                           topk_pos=topk_pos, topk_score=topk_score, rows=rows)

    # --- deletion cost (LORE-KV) -------------------------------------------------------------
    def set_out_proj(self, r: np.ndarray | None) -> None:
        """Factors R_h of the output projection, f32 (n_layer, n_head, d_v, d_v); None clears them."""
        if r is None:
            self._check(self._lib.llama_page_set_out_proj(self._ctx, self._ffi.NULL, 0))
            return
        arr = np.ascontiguousarray(r, dtype=np.float32)
        if arr.ndim != 4 or arr.shape[2] != arr.shape[3]:
            raise InvalidArgument(f"out_proj must be (n_layer, n_head, d_v, d_v), got shape {arr.shape}")
        self._check(self._lib.llama_page_set_out_proj(self._ctx, _ptr(self._ffi, "float *", arr), arr.size))

    def out_proj_weight(self, il: int, n_embd: int) -> np.ndarray:
        """f32 (n_embd, n_head * d_v): layer il's attention output projection W_O, dequantized."""
        lib, ffi = self._lib, self._ffi
        cols = self._check(lib.llama_page_out_proj_weight(self._ctx, int(il), ffi.NULL, 0))
        out = np.empty((int(n_embd), cols), dtype=np.float32)
        self._check(lib.llama_page_out_proj_weight(self._ctx, int(il), _ptr(ffi, "float *", out), out.size))
        return out

    def arm_cost_probe(self, target_seq: int, reuse_value_norms: bool = False) -> None:
        """Arm the deletion-cost probe for the next decode (any sequences; costs over target_seq).
        reuse_value_norms: keep the previous cost decode's ||R v||^2 if target_seq's cells are unchanged."""
        self._check(self._lib.llama_page_probe_arm_cost(self._ctx, int(target_seq), bool(reuse_value_norms)))

    def read_costs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(positions i32 (n_pos,), queries i32 (n_query,), costs f32 (n_layer, n_query, n_pos)):
        the deletion cost of each of target_seq's positions for each query, summed over heads."""
        ffi, lib = self._ffi, self._lib
        info = ffi.new("struct llama_page_probe_info *")
        self._check(lib.llama_page_probe_get_info(self._ctx, info))
        if not info.has_costs:
            raise ProbeError("the last probe computed attention scores, not deletion costs (arm_cost_probe)")
        L, P, Q = info.n_layer, info.n_pos, info.n_query
        positions = np.empty(P, dtype=np.int32)
        queries = np.empty(Q, dtype=np.int32)
        costs = np.empty((L, Q, P), dtype=np.float32)
        self._check(lib.llama_page_probe_get_positions(self._ctx, _ptr(ffi, "llama_pos *", positions), P))
        self._check(lib.llama_page_probe_get_queries(self._ctx, _ptr(ffi, "llama_pos *", queries), Q))
        self._check(lib.llama_page_probe_get_costs(self._ctx, _ptr(ffi, "float *", costs), costs.size))
        return positions, queries, costs

    # --- eviction ----------------------------------------------------------------------------
    def positions(self, seq_id: int) -> np.ndarray:
        """i32 (n,) positions currently held by seq_id, ascending."""
        n = self._check(self._lib.llama_page_seq_positions(self._ctx, int(seq_id), self._ffi.NULL, 0))
        out = np.empty(n, dtype=np.int32)
        if n:
            self._check(self._lib.llama_page_seq_positions(self._ctx, int(seq_id), _ptr(self._ffi, "llama_pos *", out), n))
        return out

    def evict(self, seq_id: int, positions) -> None:
        """Remove exactly `positions` from seq_id in one call (InvalidPositions: nothing changed)."""
        arr = _positions(positions)
        self._check(self._lib.llama_page_evict(self._ctx, int(seq_id), _ptr(self._ffi, "llama_pos *", arr), arr.size))

    # --- parking -----------------------------------------------------------------------------
    def park(self, seq_id: int, park_seq: int, positions, gap: int = 0) -> None:
        """Move exactly `positions` of seq_id to park_seq: the cells stay in memory, leave seq_id's attention and
        are laid out past seq_id's cells and `gap` free cells, so a decode of seq_id attends over its own cells
        only (InvalidPositions: nothing changed). Never decode on park_seq."""
        arr = _positions(positions)
        self._check(self._lib.llama_page_park(self._ctx, int(seq_id), int(park_seq), _ptr(self._ffi, "llama_pos *", arr),
                                              arr.size, int(gap)))

    def restore(self, seq_id: int, park_seq: int, positions=None) -> None:
        """Return parked positions (all when None) to seq_id, in place: one call, no data moved."""
        if positions is None:
            self._check(self._lib.llama_page_restore(self._ctx, int(seq_id), int(park_seq), self._ffi.NULL, -1))
            return
        arr = _positions(positions)
        self._check(self._lib.llama_page_restore(self._ctx, int(seq_id), int(park_seq), _ptr(self._ffi, "llama_pos *", arr),
                                                 arr.size))

    def order(self, seq_id: int) -> None:
        """Put seq_id's cells in position order from cell 0, as a never-parked conversation lies (after a restore of
        every parked cell: the next decode is then the never-parked one, bit for bit). Only when seq_id alone holds
        its cells."""
        self._check(self._lib.llama_page_order(self._ctx, int(seq_id)))

    def parked(self, park_seq: int) -> np.ndarray:
        """i32 (n,) positions parked under park_seq, ascending."""
        return self.positions(park_seq)

    def debug_poison(self, seq_id: int, positions) -> None:
        """For tests: overwrite the K and V bytes of seq_id's cells at `positions` with NaN, so that a decode that
        reads them outputs NaN."""
        arr = _positions(positions)
        self._check(self._lib.llama_page_debug_poison(self._ctx, int(seq_id), _ptr(self._ffi, "llama_pos *", arr), arr.size))

    def key_norms(self, seq_id: int, n_layer: int, n_head_kv: int) -> np.ndarray:
        """f32 (n_layer, n_head_kv, n_pos): L2 norms of the cached keys, columns = positions(seq_id)."""
        n_pos = self._check(self._lib.llama_page_seq_positions(self._ctx, int(seq_id), self._ffi.NULL, 0))
        out = np.empty((n_layer, n_head_kv, n_pos), dtype=np.float32)
        self._check(self._lib.llama_page_key_norms(self._ctx, int(seq_id), _ptr(self._ffi, "float *", out), out.size))
        return out

    def compact(self, seq_id: int) -> None:
        """Move every used cell of seq_id's KV stream down to the lowest cells, in place and in order
        (shared cells stay shared), so the attended range shrinks; positions and outputs are unchanged."""
        self._check(self._lib.llama_page_compact(self._ctx, int(seq_id)))


def _positions(positions) -> np.ndarray:
    arr = np.asarray(positions)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InvalidPositions(f"positions must be a 1-D sequence of ints, got shape {arr.shape} dtype {arr.dtype}")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise InvalidPositions("positions must fit in int32")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _ptr(ffi, ctype: str, arr: np.ndarray):
    assert arr.flags.c_contiguous  # internal invariant: every array above is created contiguous
    return ffi.cast(ctype, arr.ctypes.data)

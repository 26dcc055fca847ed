"""A long cache without a long prefill (issue 54): a decode step's cost at T cells depends on how many cells it
attends and their type, not on what they hold, so a cache of T cells for a decode benchmark can be made from a
short real prefill, its cells repeated to T at positions 0..T-1. On 2 cores a 32K-token prefill of a 3B model takes
most of an hour; this takes seconds, and the same cells go to page-local (llama_state_seq_set_data) and to stock
llama-server (its slot file, `POST /slots/0?action=restore`), so both decode over the same cache.

What it leaves out: the time to first token at T (not measured), and attention that means anything (the repeated
keys sit at positions other than the ones they were rotated for; a probe over them ranks noise, so which cells an
eviction keeps is arbitrary: its speed is what is measured, never its answers).

The bytes are llama.cpp's sequence state at the pin (src/llama-kv-cache.cpp, state_write / state_write_meta /
state_write_data), after the u32 magic 0xaf143cd8 and i32 sequence id that llama_state_seq_get_data puts first
(src/llama-context.cpp; a slot file has neither): a u32 stream count (1), a u32 cell count, per cell (i32 pos, u32 n_seq_id, i32 seq ids), a u32
v_trans and u32 layer count, per layer (i32 K type, u64 K row size, the rows), then per layer V: as rows (i32 type,
u64 row size, rows) or, transposed (flash attention off), (i32 type, u32 element size, u32 V width, per V element
the cells' values). A slot file is (u32 'ggsq', u32 version 3, u32 token count, i32 tokens, the state).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

GGSQ_MAGIC = 0x67677371  # LLAMA_FILE_MAGIC_GGSQ
GGSQ_VERSION = 3  # LLAMA_STATE_SEQ_VERSION
IO_MAGIC = 0xaf143cd8  # llama_state_seq_get_data's first word
HEADER = 8  # that magic and the sequence id


@dataclass
class SeqState:
    """One sequence's cells: K per layer (cells, K row bytes) and V per layer as (cells, V width) elements."""

    positions: np.ndarray  # i32 (cells,)
    k: list[tuple[int, np.ndarray]]  # (ggml type, u8 (cells, row bytes))
    v: list[tuple[int, int, np.ndarray]]  # (ggml type, element size, u8 (cells, width * element size))

    @property
    def cells(self) -> int:
        return len(self.positions)


def parse(buf) -> SeqState:
    """The cells of a one-stream, one-sequence state (llama_state_seq_get_data); ValueError for anything else."""
    mv = memoryview(buf).cast("B")
    off = 0

    def take(fmt: str):
        nonlocal off
        out = struct.unpack_from("<" + fmt, mv, off)
        off += struct.calcsize("<" + fmt)
        return out

    def raw(n: int) -> np.ndarray:
        nonlocal off
        out = np.frombuffer(mv[off: off + n], dtype=np.uint8)
        if len(out) != n:
            raise ValueError("the sequence state ends early")
        off += n
        return out

    magic, _seq = take("Ii")
    if magic != IO_MAGIC:
        raise ValueError(f"not a sequence state of this llama.cpp (magic {magic:#x})")
    (n_stream,) = take("I")
    if n_stream != 1:
        raise ValueError(f"a state of {n_stream} streams: one is supported")
    (cells,) = take("I")
    if cells == 0:
        raise ValueError("the sequence state holds no cells")
    pos = np.empty(cells, np.int32)
    for i in range(cells):
        p, n_seq = take("iI")
        if n_seq != 1:
            raise ValueError("a cell shared by several sequences (or a cell extension): not supported")
        take("i")
        pos[i] = p
    v_trans, n_layer = take("II")
    k = []
    for _ in range(n_layer):
        t, row = take("iQ")
        k.append((t, raw(cells * row).reshape(cells, row)))
    v = []
    for _ in range(n_layer):
        if not v_trans:
            t, row = take("iQ")
            v.append((t, 0, raw(cells * row).reshape(cells, row)))
        else:
            t, el, width = take("iII")
            by_element = raw(cells * el * width).reshape(width, cells, el)
            v.append((t, el, np.ascontiguousarray(by_element.transpose(1, 0, 2)).reshape(cells, width * el)))
    if off != len(mv):
        raise ValueError(f"{len(mv) - off} bytes after the last layer: not a state of this llama.cpp")
    return SeqState(pos, k, v)


def repeat_to(state: SeqState, n_cells: int, v_trans: bool, seq_id: int = 0) -> bytearray:
    """The bytes of a state of n_cells cells at positions 0..n_cells-1 of seq_id, as llama_state_seq_set_data
    takes them: state's cells repeated in order; V written as rows, or transposed (v_trans: the layout llama.cpp
    uses without flash attention). A slot file takes them without the first HEADER bytes (write_slot_file)."""
    if n_cells < 1:
        raise ValueError(f"n_cells must be >= 1, got {n_cells}")
    idx = np.arange(n_cells) % state.cells
    out = bytearray()
    out += struct.pack("<IiII", IO_MAGIC, seq_id, 1, n_cells)
    meta = np.zeros((n_cells, 3), dtype=np.int32)
    meta[:, 0] = np.arange(n_cells, dtype=np.int32)
    meta[:, 1] = 1
    meta[:, 2] = seq_id
    out += meta.tobytes()
    out += struct.pack("<II", int(v_trans), len(state.k))
    for t, rows in state.k:
        out += struct.pack("<iQ", t, rows.shape[1])
        out += rows[idx].tobytes()
    for t, el, rows in state.v:
        rep = rows[idx]
        if not v_trans:
            out += struct.pack("<iQ", t, rep.shape[1])
            out += rep.tobytes()
        else:
            el = el or _element_size(t)
            width = rep.shape[1] // el
            out += struct.pack("<iII", t, el, width)
            out += np.ascontiguousarray(rep.reshape(n_cells, width, el).transpose(1, 0, 2)).tobytes()
    return out


def _element_size(ggml_type: int) -> int:
    sizes = {0: 4, 1: 2, 30: 2}  # F32, F16, BF16: a transposed V cache is never quantized
    if ggml_type not in sizes:
        raise ValueError(f"a V cache of ggml type {ggml_type} cannot be transposed (flash attention off needs f16)")
    return sizes[ggml_type]


def write_slot_file(path: str | os.PathLike, tokens: list[int], state: bytes | bytearray) -> None:
    """A llama-server slot file (llama_state_seq_save_file's format) of `tokens` and a state as repeat_to makes
    it (its in-memory header left out, as the file format has none)."""
    if struct.unpack_from("<I", state, 0)[0] != IO_MAGIC:
        raise ValueError("not a sequence state as llama_state_seq_get_data gives it")
    with open(path, "wb") as f:
        f.write(struct.pack("<III", GGSQ_MAGIC, GGSQ_VERSION, len(tokens)))
        f.write(np.asarray(tokens, dtype=np.int32).tobytes())
        f.write(memoryview(state)[HEADER:])

"""The context a conversation gets when the user does not say: sized by the machine's free memory and the model's
trained context (`chat` and `serve` without --n-ctx; issue 42).

With the cache held in memory a larger context costs memory, not speed: a decode step reads the cells a
conversation holds, not n_ctx. What a larger context buys is a later wall: room-making, which deletes earlier
cells for good, starts only when the conversation fills it. So the default is the largest of CANDIDATES that

- the model was trained for (n_ctx_train; past it answers are unreliable), and
- fits in MEMORY_SHARE of the memory available now, for every slot: the KV cache (K and V of every layer, in
  the cache type) and the attention scratch that grows with the context (a batch of 512 queries' scores
  against every cell, f32, on the path without flash attention: the larger of the two paths' buffers).

At least DEFAULT_N_CTX (4096) when the model was trained for it, even where memory is short (as before: a
smaller model file than that fits anything this estimate would refuse). Ollama sizes its default context by
the memory it can use as well (4K below 24 GiB of VRAM, more above). With a GPU backend the cache may live in
VRAM, which this does not measure: the default stays DEFAULT_N_CTX there.

SmolLM2-135M (8K trained, 40 KB a cell with the scratch) gets 8192 with 3 GiB available; Qwen2.5-Coder-0.5B
(32K trained, 40 KB a cell) gets 32768 with 11 GiB available, 16384 with 6, 8192 with 3.
"""

from __future__ import annotations

import os
from pathlib import Path

from page_local.store.gguf import gguf_shape

DEFAULT_N_CTX = 4096  # the floor (and the default where the rule does not apply)
CANDIDATES = (4096, 8192, 16384, 32768)  # larger ones: a 2-core machine reads a 32K prompt in minutes already
MEMORY_SHARE = 1 / 8  # of the memory available now, for the KV cache and its scratch (weights and the OS beside it)
SCRATCH_QUERIES = 512  # the physical batch: queries whose scores against every cell one step holds (no flash path)
# bytes per element of the KV cache types (ggml's block sizes: q8_0 34 bytes / 32 values, q4_0 18 / 32)
CACHE_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


def available_memory() -> int | None:
    """Bytes of memory available now: Linux's MemAvailable, else the free physical pages sysconf reports
    (None where neither is known)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def cell_bytes(shape: dict[str, int], cache_type: str = "f16") -> int:
    """Memory one context cell costs: its K and V in every layer, and its column of the attention scratch."""
    if cache_type not in CACHE_BYTES:
        raise ValueError(f"unknown cache type {cache_type!r}; choose from {', '.join(CACHE_BYTES)}")
    head = shape["n_embd"] // shape["n_head"]
    kv = shape["n_layer"] * shape["n_head_kv"] * (shape.get("head_dim_k", head) + shape.get("head_dim_v", head))
    return int(kv * CACHE_BYTES[cache_type] + SCRATCH_QUERIES * shape["n_head"] * 4)


def default_n_ctx(model_path: str | os.PathLike, cache_type: str = "f16", slots: int = 1,
                  available: int | None = None, gpu: bool = False) -> tuple[int, str]:
    """(n_ctx, why in words) for a model file: see the module docstring. available: bytes (default: now);
    slots: contexts of this size the process holds (serve --parallel); gpu: the library offloads to a GPU."""
    shape = gguf_shape(model_path)
    trained = shape.get("n_ctx_train", 0)
    floor = min(DEFAULT_N_CTX, trained) if trained else DEFAULT_N_CTX
    if gpu:
        return floor, f"{floor} (the default with a GPU backend: its memory is not measured)"
    if not all(k in shape for k in ("n_layer", "n_embd", "n_head", "n_head_kv")):
        return floor, f"{floor} (the model file does not give its attention's shape)"
    avail = available_memory() if available is None else available
    if avail is None:
        return floor, f"{floor} (this system does not say how much memory is available)"
    per_cell = cell_bytes(shape, cache_type) * max(1, slots)
    share = avail * MEMORY_SHARE
    fits = [c for c in CANDIDATES if (not trained or c <= trained) and c * per_cell <= share]
    n = max(fits + [floor])
    trained_words = f"trained for {trained}" if trained else "trained context unknown"
    return n, (f"{n}: the largest of {', '.join(map(str, CANDIDATES))} within the model's context ({trained_words}) "
               f"whose cache ({per_cell / 1024:.0f} KB a cell{f' x {slots} slots' if slots > 1 else ''}) fits in "
               f"1/{round(1 / MEMORY_SHARE)} of the {avail / 2**30:.1f} GiB available")

"""Owners of llama.cpp's model and context, on llama-cpp-python's low-level API.

This is the lower half of the engine layer: the only place (with engine.py) that touches
llama-cpp-python objects. It never uses `Llama.generate`, which assumes contiguous positions
(an evicted sequence has gaps). Every native resource has one owner with close() and a context
manager; the context is closed before the model that it borrows.

Loading also settles the honest limits: which device holds the layers and the KV cache
(n_gpu_layers, Context.placement()), n_ctx against the model's trained context (ContextTooLong), and
llama.cpp's log, routed to the "page_local.llama" logger by llama_log on first load.

Remote devices (Model(rpc=...)) are rpc.py's; a server lost mid-run is a RemoteLost of the context's
next decode, and the process goes on (a local engine still loads and runs).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from page_local.native import backend, llama_log
from page_local.native import rpc as rpc_mod
from page_local.native import pageops as native
from page_local.errors import Cancelled, ContextTooLong, DecodeError, ModelError, RemoteLost

FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8, "q4_0": 2}
GGUF_MAGIC = b"GGUF"
N_GPU_LAYERS_ENV = "PAGE_LOCAL_N_GPU_LAYERS"  # the default of n_gpu_layers: a count or "all"
ALL_LAYERS = -1  # llama.cpp: a negative n_gpu_layers offloads every layer and the output layer


def parse_n_gpu_layers(value, source: str = "n_gpu_layers") -> int:
    """'all' (or -1, llama.cpp's spelling) -> ALL_LAYERS; a whole number >= 0 -> itself; else ValueError."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "all":
            return ALL_LAYERS
        if re.fullmatch(r"\+?\d+|-1", text):
            return int(text)
    elif isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= -1:
        return int(value)
    raise ValueError(f"{source} must be a number of layers (0 or more) or 'all', got {value!r}")


def supports_gpu_offload() -> bool:
    """Whether this build of the library has a GPU backend with a device present. Not llama.cpp's
    llama_supports_gpu_offload(), which is also true for every build with the RPC backend, servers or not."""
    return bool(gpu_devices())


def _gpu_device_handles() -> list[tuple[int, str]]:
    """(handle, label) of each device llama.cpp offloads layers to by default: the discrete GPUs, or the
    integrated ones when there is none."""
    lib = backend.lib()
    found: dict[int, list] = {1: [], 2: []}  # enum ggml_backend_dev_type: GPU = 1, IGPU = 2
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        kind = lib.ggml_backend_dev_type(dev)
        if kind in found:
            found[kind].append((dev, backend.dev_label(lib, dev)))
    return found[1] or found[2]


def gpu_devices() -> list[str]:
    """'NAME (description)' of each device llama.cpp offloads layers to, as llama.cpp picks them with
    the default split: the discrete GPUs, or the integrated ones when there is none ([] on CPU builds)."""
    return [label for _, label in _gpu_device_handles()]


def default_n_gpu_layers(rpc: bool = False) -> int:
    """$PAGE_LOCAL_N_GPU_LAYERS if set; else every layer when the library can offload to a GPU or remote
    devices are given (rpc), else 0."""
    env = os.environ.get(N_GPU_LAYERS_ENV, "").strip()
    if env:
        return parse_n_gpu_layers(env, f"${N_GPU_LAYERS_ENV}")
    return ALL_LAYERS if rpc or supports_gpu_offload() else 0


def layer_split(free: list[int], n_gpu: int, n_layer: int) -> list[int]:
    """The device index of each repeating layer and of the output layer (n_layer + 1 entries; -1 = the
    local CPU), as llama_model::load_tensors assigns them with the default split (by free memory)."""
    n = n_layer + 1 if n_gpu < 0 else n_gpu
    start, active = max(n_layer + 1 - n, 0), min(n, n_layer + 1) if free else 0
    total = float(sum(free)) or 1.0
    bounds = np.cumsum(np.asarray(free, dtype=np.float64)) / total
    out = []
    for il in range(n_layer + 1):
        if il < start or il - start >= active:
            out.append(-1)
        else:
            out.append(min(int(np.searchsorted(bounds, (il - start) / active, side="right")), len(free) - 1))
    return out


def _describe_split(labels: list[str], split: list[int], with_output: bool) -> str:
    """'CPU (11 of 30 layers), RPC0 127.0.0.1:50052 (10 of 30 layers), ...' in llama.cpp's device order."""
    layers = split[:-1]
    parts = []
    for d in [-1, *range(len(labels))]:
        k, out = layers.count(d), with_output and split[-1] == d
        if k or out:
            name = "CPU" if d < 0 else labels[d]
            parts.append(f"{name} ({k} of {len(layers)} layers{' + output' if out else ''})")
    return ", ".join(parts)


def _where(gpu: str | None, on_gpu: int, total: int) -> str:
    if not gpu or on_gpu <= 0:
        return "CPU"
    if on_gpu >= total:
        return gpu
    return f"{gpu} ({on_gpu} of {total} layers), CPU (the rest)"


def describe_placement(placement: dict) -> str:
    """'layers and KV cache on CPU', or 'layers on X, KV cache on Y' when they differ."""
    layers, kv = placement["layers"], placement["kv_cache"]
    return f"layers and KV cache on {layers}" if layers == kv else f"layers on {layers}, KV cache on {kv}"


def check_gguf(path: str | os.PathLike) -> Path:
    """Return the path if it names a readable GGUF file, else raise ModelError saying what is wrong."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelError(f"model file not found: {p}")
    if not p.is_file():
        raise ModelError(f"model path is not a file: {p}")
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelError(f"cannot read model file {p}: {e.strerror}") from e
    if magic != GGUF_MAGIC:
        raise ModelError(f"{p} is not a GGUF model file (it starts with {magic!r}, not b'GGUF')")
    return p


class Model:
    """A loaded GGUF model (owner of llama_model)."""

    def __init__(self, path: str | os.PathLike, n_gpu_layers: int | str | None = None, rpc=None):
        """n_gpu_layers: layers to offload to the GPU(s) and remote devices, 'all' (or -1), or None for the
        default (default_n_gpu_layers(): $PAGE_LOCAL_N_GPU_LAYERS, else all on a GPU build or with rpc,
        else 0). rpc: 'HOST:PORT' of ggml-rpc-servers (a list or a comma-separated string), None for
        $PAGE_LOCAL_RPC; their devices come first, as llama.cpp orders them, then the local GPUs; the
        offloaded layers are split between them by free memory (llama.cpp's default split)."""
        self.rpc = rpc_mod.default_rpc() if rpc is None else rpc_mod.parse_rpc(rpc)
        n_gpu = default_n_gpu_layers(bool(self.rpc)) if n_gpu_layers is None else parse_n_gpu_layers(n_gpu_layers)
        self.path = check_gguf(path)
        # Contexts on this model that share the CPU's cores (the server's slots) set a Turns here: a batch
        # of several tokens (a prefill) then runs alone, single-token decode steps run together
        self.compute_turns = None
        lc = native.llama_cpp()
        from llama_cpp import _internals

        params = lc.llama_model_default_params()
        params.n_gpu_layers = n_gpu
        self._devices = None
        if self.rpc:
            devs = rpc_mod.rpc_devices(self.rpc) + _gpu_device_handles()
            self._devices = (ctypes.c_void_p * (len(devs) + 1))(*[d for d, _ in devs], None)  # NULL-terminated
            params.devices = ctypes.cast(self._devices, ctypes.c_void_p)
            self._split_labels = [label for _, label in devs]
            self._split_free = [backend.free_memory(d) for d, _ in devs]
        with llama_log.held() as log:
            try:
                # verbose=True: llama-cpp-python then leaves stdout/stderr alone during the load (its
                # verbose=False points both at /dev/null); llama.cpp's log goes to llama_log instead
                self._m = _internals.LlamaModel(path_model=str(self.path), params=params, verbose=True)
            except ValueError as e:  # llama-cpp-python raises ValueError("Failed to load model from file")
                reason = log.reason()
                log.mark_reported()
                raise ModelError(
                    f"llama.cpp could not load {self.path}: the file is truncated, corrupt, or of an unsupported "
                    "architecture" + (", or a remote device could not take its layers" if self.rpc else "")
                    + (f" (llama.cpp: {reason})" if reason else "")
                ) from e
        rpc_mod.in_use.update(self.rpc)
        self.ptr = self._m.model
        self.vocab = lc.llama_model_get_vocab(self.ptr)
        self.n_layer = int(lc.llama_model_n_layer(self.ptr))
        self.n_head = int(lc.llama_model_n_head(self.ptr))
        self.n_head_kv = int(lc.llama_model_n_head_kv(self.ptr))
        self.n_embd = int(lc.llama_model_n_embd(self.ptr))
        self.n_ctx_train = int(lc.llama_model_n_ctx_train(self.ptr))
        self.n_vocab = int(lc.llama_vocab_n_tokens(self.vocab))
        # where llama.cpp put the layers (llama_model::load_tensors, split mode "layer"): the last
        # n_gpu - 1 repeating layers and the output layer on the GPU(s), the rest and the input on CPU
        self.n_gpu_layers = n_gpu
        gpus = gpu_devices() if n_gpu != 0 and supports_gpu_offload() else []
        self.gpu = " + ".join(gpus) if gpus else None
        wanted = self.n_layer + 1 if n_gpu < 0 else n_gpu
        self.gpu_layers = max(0, min(self.n_layer, wanted - 1)) if gpus else 0  # repeating layers offloaded
        self.output_on_gpu = bool(gpus) and wanted >= 1
        # with remote devices: the device of each layer and of the output layer (-1: the local CPU)
        self.split = layer_split(self._split_free, n_gpu, self.n_layer) if self.rpc else None

    def kv_device(self, offload_kqv: bool = True) -> str:
        """Which device holds the KV cache: each layer's K/V sit beside the layer when offload_kqv is on."""
        if self.split is not None:
            return _describe_split(self._split_labels, self.split if offload_kqv else [-1] * len(self.split), False)
        return _where(self.gpu, self.gpu_layers if offload_kqv else 0, self.n_layer)

    @property
    def layers_device(self) -> str:
        """'CPU', the GPU's name, or a split: which device holds the model's layers."""
        if self.split is not None:
            return _describe_split(self._split_labels, self.split, True)
        where = _where(self.gpu, self.gpu_layers, self.n_layer)
        if where == "CPU" and self.output_on_gpu:
            return f"CPU (output layer on {self.gpu})"
        return where

    @property
    def llama_model(self):
        """The llama-cpp-python LlamaModel (for tokenization and metadata)."""
        return self._m

    def metadata(self) -> dict[str, str]:
        return self._m.metadata()

    @property
    def description(self) -> str:
        """llama.cpp's one line about the model: architecture, size and weight type ("llama 135M Q4_1")."""
        buf = ctypes.create_string_buffer(256)
        n = native.llama_cpp().llama_model_desc(self.ptr, buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n > 0 else ""

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self._m.tokenize(text.encode("utf-8"), add_special, parse_special)

    def detokenize(self, tokens: list[int]) -> str:
        return self._m.detokenize(list(tokens)).decode("utf-8", "replace")

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (possibly part of a UTF-8 character); special: control tokens as their
        text (<|im_start|>), else as nothing."""
        lc = native.llama_cpp()
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = lc.llama_token_to_piece(self.vocab, int(token), buf, size, 0, bool(special))
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def is_eog(self, token: int) -> bool:
        return bool(native.llama_cpp().llama_vocab_is_eog(self.vocab, int(token)))

    def is_control(self, token: int) -> bool:
        """A control token (a chat template's turn boundaries: <|im_start|>, <end_of_turn>, ...)."""
        return bool(native.llama_cpp().llama_vocab_is_control(self.vocab, int(token)))

    @property
    def closed(self) -> bool:
        return getattr(self, "_m", None) is None

    def close(self) -> None:
        if getattr(self, "_m", None) is not None:
            self._m.close()
            self._m = None
            rpc_mod.in_use.subtract(self.rpc)
            for ep in self.rpc:
                if rpc_mod.in_use[ep] <= 0:
                    del rpc_mod.in_use[ep]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Turns:
    """Who computes on a model's shared CPU cores: many at once (single-token decode steps, which leave
    the cores idle between their small kernels) or one alone (a batch of several tokens: a prefill, which
    keeps every core busy, so another slot's work beside it only slows it down). A waiting `alone` comes
    before new shared entrants, so a prefill is not starved by a stream of decode steps."""

    def __init__(self):
        self._cv = threading.Condition()
        self._shared = 0  # decode steps running
        self._alone = False  # a batch running alone
        self._waiting_alone = 0

    @contextlib.contextmanager
    def take(self, alone: bool):
        with self._cv:
            if alone:
                self._waiting_alone += 1
                self._cv.wait_for(lambda: not self._alone and self._shared == 0)
                self._waiting_alone -= 1
                self._alone = True
            else:
                self._cv.wait_for(lambda: not self._alone and self._waiting_alone == 0)
                self._shared += 1
        try:
            yield
        finally:
            with self._cv:
                if alone:
                    self._alone = False
                else:
                    self._shared -= 1
                self._cv.notify_all()


@dataclass(frozen=True)
class ContextConfig:
    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 1
    threads: int = 2
    flash_attn: str = "auto"  # auto | on | off
    type_kv: str = "f16"  # f16 | f32 | q8_0 | q4_0
    allow_long_context: bool = False  # n_ctx above the model's trained context: refused unless True

    def validate(self) -> None:
        if self.flash_attn not in FLASH_ATTN:
            raise ValueError(f"flash_attn must be one of {sorted(FLASH_ATTN)}, got {self.flash_attn!r}")
        if self.type_kv not in KV_TYPES:
            raise ValueError(f"type_kv must be one of {sorted(KV_TYPES)}, got {self.type_kv!r}")
        for name in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.n_ubatch > self.n_batch:
            raise ValueError(f"n_ubatch ({self.n_ubatch}) must not exceed n_batch ({self.n_batch})")


class Context:
    """A llama_context on one Model, with a unified KV cache so sequences can share cells."""

    def __init__(self, model: Model, config: ContextConfig = ContextConfig(), cb_eval=None):
        """cb_eval: an optional llama_cpp.ggml_backend_sched_eval_callback (kept alive here; for tests)."""
        config.validate()
        if config.n_ctx > model.n_ctx_train > 0 and not config.allow_long_context:
            raise ContextTooLong(config.n_ctx, model.n_ctx_train)
        lc = native.llama_cpp()
        from llama_cpp import _internals

        self.model = model
        self.config = config
        p = lc.llama_context_default_params()
        p.n_ctx = config.n_ctx
        p.n_batch = config.n_batch
        p.n_ubatch = config.n_ubatch
        p.n_seq_max = config.n_seq_max
        p.n_threads = config.threads
        p.n_threads_batch = config.threads
        p.flash_attn_type = FLASH_ATTN[config.flash_attn]
        p.type_k = p.type_v = KV_TYPES[config.type_kv]
        p.kv_unified = True
        p.no_perf = True
        if cb_eval is not None:
            p.cb_eval = cb_eval
        self._params = p  # keep callbacks referenced for the context's lifetime
        with llama_log.held() as log:
            try:
                self._c = _internals.LlamaContext(model=model.llama_model, params=p, verbose=False)
            except ValueError as e:
                reason = log.reason()
                log.mark_reported()
                raise ModelError(f"llama.cpp could not create a context (n_ctx={config.n_ctx}): "
                                 + (f"{e} (llama.cpp: {reason})" if reason else str(e))) from e
        # llama.cpp keeps each layer's K/V beside the layer when offload_kqv is on (the default)
        self.kv_device = model.kv_device(bool(p.offload_kqv))
        self.ptr = self._c.ctx
        self.mem = lc.llama_get_memory(self.ptr)
        self.n_ctx = int(lc.llama_n_ctx(self.ptr))
        self.n_ubatch = int(lc.llama_n_ubatch(self.ptr))
        self.n_batch = int(lc.llama_n_batch(self.ptr))
        self.n_seq_max = int(config.n_seq_max)
        self.page = native.PageOps(self.ptr)
        self._batch = lc.llama_batch_init(self.n_batch, 0, 1)
        self._lc = lc

    # --- decoding ----------------------------------------------------------------------------
    def decode(self, tokens, pos0: int, seq_id: int = 0, logits: str | np.ndarray = "last",
               cancel=None) -> None:
        """Decode `tokens` at positions pos0.. in seq_id, in chunks of n_batch.

        logits: "last" (only the final token), "all", "none", or a bool mask per token.
        cancel: None, or an object with is_set() (a threading.Event) asked before each chunk: once it is
        set, Cancelled is raised before the next chunk is decoded (the chunks already decoded stay in the
        cache: the caller removes them). A chunk is one ubatch when n_batch == n_ubatch (the default), so a
        long prefill stops within one ubatch. (Not llama_set_abort_callback: ggml's CPU backend calls it
        before every graph node, and a Python callback would take the GIL hundreds of times per ubatch,
        while the event loop and other slots hold it; the GPU backends do not consult it mid-graph.)
        """
        tokens = list(tokens)
        n = len(tokens)
        if n == 0:
            raise ValueError("nothing to decode: the token list is empty")
        if isinstance(logits, str):
            if logits not in ("last", "all", "none"):
                raise ValueError(f"logits must be 'last', 'all', 'none' or a mask, got {logits!r}")
            mask = np.zeros(n, dtype=bool)
            if logits == "all":
                mask[:] = True
            elif logits == "last":
                mask[-1] = True
        else:
            mask = np.asarray(logits, dtype=bool)
            if mask.shape != (n,):
                raise ValueError(f"logits mask has shape {mask.shape}, expected ({n},)")
        b = self._batch
        for s in range(0, n, self.n_batch):
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"decoding stopped by its cancel flag after {s} of {n} tokens")
            m = min(self.n_batch, n - s)
            for i in range(m):
                b.token[i] = tokens[s + i]
                b.pos[i] = pos0 + s + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq_id
                b.logits[i] = bool(mask[s + i])
            b.n_tokens = m
            self._run(b)

    def decode_step(self, tokens, positions, seq_ids) -> None:
        """Decode one batch whose token i sits at positions[i] in sequence seq_ids[i], with logits for
        every token (e.g. one step of several sampled continuations at once). At most n_batch tokens."""
        tokens, positions, seq_ids = list(tokens), list(positions), list(seq_ids)
        n = len(tokens)
        if n == 0 or n > self.n_batch or len(positions) != n or len(seq_ids) != n:
            raise ValueError(f"decode_step needs 1..{self.n_batch} tokens with one position and one sequence each")
        b = self._batch
        for i in range(n):
            b.token[i] = tokens[i]
            b.pos[i] = positions[i]
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq_ids[i]
            b.logits[i] = True
        b.n_tokens = n
        self._run(b)

    def _run(self, b) -> None:
        """llama_decode of the filled batch; RemoteLost once a server of this model's is gone (the batch's
        outputs then read as zeros, and every later graph fails: the check after the read-back covers both)."""
        remote = self.model.rpc
        turns = self.model.compute_turns
        with turns.take(alone=b.n_tokens > 1) if turns is not None else contextlib.nullcontext():
            rc = self._lc.llama_decode(self.ptr, b)
            if remote:  # llama_decode returns before the outputs are read back: wait for them
                self._lc.llama_synchronize(self.ptr)
        if remote:  # then ask
            if gone := rpc_mod.lost(remote):
                raise RemoteLost(gone)
        if rc != 0:
            raise DecodeError(
                "llama_decode failed: the KV cache is full (no free slot)" if rc == 1 else f"llama_decode failed with code {rc}"
            )

    def logits(self, i: int = -1) -> np.ndarray:
        """f32 (n_vocab,) logits of output i of the last decode (-1 = last), copied."""
        ptr = self._lc.llama_get_logits_ith(self.ptr, i)
        if not ptr:
            raise DecodeError(f"no logits for output {i} of the last decode")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).copy()

    # --- sequences ---------------------------------------------------------------------------
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        return bool(self._lc.llama_memory_seq_rm(self.mem, seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self._lc.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Shift the positions in [p0, p1) of a sequence by delta; llama.cpp re-rotates their keys (RoPE)
        on the next decode, as its context shift does."""
        self._lc.llama_memory_seq_add(self.mem, seq_id, p0, p1, delta)

    def can_shift(self) -> bool:
        """Whether the KV cache supports position shifts (seq_add)."""
        return bool(self._lc.llama_memory_can_shift(self.mem))

    def seq_pos_max(self, seq_id: int) -> int:
        return int(self._lc.llama_memory_seq_pos_max(self.mem, seq_id))

    def clear(self) -> None:
        self._lc.llama_memory_clear(self.mem, True)

    def cells_used(self, seq_id: int = 0) -> int:
        return len(self.page.positions(seq_id))

    def placement(self) -> dict:
        """Which device holds the layers and the KV cache, and how many layers were offloaded."""
        m = self.model
        out = {"layers": m.layers_device, "kv_cache": self.kv_device,
               "n_gpu_layers": "all" if m.n_gpu_layers < 0 else m.n_gpu_layers,
               "gpu_layers": m.gpu_layers, "n_layer": m.n_layer, "gpu": m.gpu}
        if m.rpc:
            out["rpc"] = list(m.rpc)
        return out

    # --- state -------------------------------------------------------------------------------
    def seq_state(self, seq_id: int) -> bytes:
        size = self._lc.llama_state_seq_get_size(self.ptr, seq_id)
        out = bytearray(size)  # llama.cpp writes into it: one copy of tens of MB, not two
        n = self._lc.llama_state_seq_get_data(self.ptr, (ctypes.c_uint8 * size).from_buffer(out), size, seq_id)
        if n != size:
            raise DecodeError("could not save the sequence state")
        return out

    def set_seq_state(self, data, seq_id: int) -> None:
        """data: bytes, a bytearray or a view of one (a cache file read); passed to llama.cpp without a copy
        where it can be (llama.cpp only reads it)."""
        if isinstance(data, bytes):
            buf = data
        else:
            view = memoryview(data)
            buf = ((ctypes.c_uint8 * view.nbytes).from_buffer(view) if not view.readonly and view.contiguous
                   else (ctypes.c_uint8 * view.nbytes).from_buffer_copy(view))
        with llama_log.held() as log:
            if self._lc.llama_state_seq_set_data(self.ptr, buf, len(data), seq_id) == 0:
                reason = log.reason()
                log.mark_reported()
                raise DecodeError("could not restore the sequence state (from another model or context size?)"
                                  + (f" (llama.cpp: {reason})" if reason else ""))

    def close(self) -> None:
        if getattr(self, "_c", None) is not None:
            self._lc.llama_batch_free(self._batch)
            self._c.close()
            self._c = None
            self.ptr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def chat_formatter(template: str, eos_token: str, bos_token: str):
    """llama-cpp-python's Jinja2 chat formatter for a GGUF chat template (jinja2.TemplateError if it does
    not parse). The patched library is loaded first: llama_cpp binds to whichever it finds first."""
    native.llama_cpp()
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    return Jinja2ChatFormatter(template=template, eos_token=eos_token, bos_token=bos_token)

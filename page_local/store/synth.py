"""Benchmark models of the real shapes: a GGUF with the architecture, shapes, vocabulary size and trained context
of a model people run (Llama-3.2-1B and -3B, Llama-3.1-8B, Mistral-7B, Qwen2.5-7B) and random weights, in
llama.cpp's Q4_K_M mix (issue 54).

Speed and memory do not depend on what the weights say: a decode step reads every weight and the K/V it attends,
whatever their values (vLLM benchmarks with random weights of the real shapes for the same reason). Answers do:
a synthetic model's text is noise, so it is named as what it is everywhere (`synth:NAME`, general.name "synthetic
… shape", the key `page_local.synthetic`) and chat, run and serve refuse it (`refuse_synthetic`).

No GGUF above 0.5B reaches these machines (PyPI and Debian only), and an 8B model written in f16 to be quantized
would take 16 GB of disk and minutes of quantizing. So the Q4_K_M file is written directly, block by block: each
tensor gets the type llama.cpp's quantizer gives it for Q4_K_M (src/llama-quant.cpp at the pin: the output
projection, or the token embeddings when they are tied to it, Q6_K; attn_v and ffn_down Q6_K on the layers
`use_more_bits` picks; every other matrix Q4_K; norms and biases f32 — tests/test_synth.py checks the mix against
the quantizer itself on a small shape), filled with random bytes whose block scales are set to small normal f16
values, so that every weight is finite and small. The tokenizer is the embedded SmolLM2's (a byte-level BPE)
padded with unused tokens to the shape's vocabulary size: the output projection and the embeddings have the real
size; tokenizing is not what is measured.

Files are written once into <page-local home>/models/synth/NAME-Q4_K_M.gguf (temporary name, then rename) and
reused; `page-local models synth NAME` writes one.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from page_local.errors import ModelError, ModelNotInstalled

PREFIX = "synth:"
SYNTH_KEY = "page_local.synthetic"
FTYPE_Q4_K_M = 15  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_K_M
QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}


@dataclass(frozen=True)
class Shape:
    """The hyperparameters of a model's GGUF that set its speed and memory (from each model's config.json)."""

    name: str
    title: str  # the model whose shape this is
    arch: str  # general.architecture: llama | qwen2
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rope_theta: float
    rms_eps: float
    tied: bool  # the output projection is the token embeddings (no output.weight)
    qkv_bias: bool = False  # Qwen2: attn_q/k/v carry biases
    llama3_rope: tuple[float, float, float, int] | None = None  # (factor, low, high, original context)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_bytes_per_cell(self) -> int:
        """K and V of one cell in an f16 cache, every layer."""
        return 2 * 2 * self.n_layer * self.n_head_kv * self.head_dim


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("llama-3.2-1b", "Llama-3.2-1B", "llama", 2048, 16, 32, 8, 8192, 128256, 131072, 500000.0, 1e-5,
          tied=True, llama3_rope=(32.0, 1.0, 4.0, 8192)),
    Shape("llama-3.2-3b", "Llama-3.2-3B", "llama", 3072, 28, 24, 8, 8192, 128256, 131072, 500000.0, 1e-5,
          tied=True, llama3_rope=(32.0, 1.0, 4.0, 8192)),
    Shape("llama-3.1-8b", "Llama-3.1-8B", "llama", 4096, 32, 32, 8, 14336, 128256, 131072, 500000.0, 1e-5,
          tied=False, llama3_rope=(8.0, 1.0, 4.0, 8192)),
    Shape("mistral-7b", "Mistral-7B-v0.3", "llama", 4096, 32, 32, 8, 14336, 32768, 32768, 1000000.0, 1e-5,
          tied=False),
    Shape("qwen2.5-7b", "Qwen2.5-7B", "qwen2", 3584, 28, 28, 4, 18944, 152064, 32768, 1000000.0, 1e-6,
          tied=False, qkv_bias=True),
)}


def shape(name: str) -> Shape:
    """The Shape of NAME (with or without `synth:`); ModelError naming the shapes for any other."""
    key = name[len(PREFIX):] if name.startswith(PREFIX) else name
    try:
        return SHAPES[key]
    except KeyError:
        raise ModelError(f"no synthetic model shape {key!r}; the shapes: {', '.join(SHAPES)}") from None


def folder() -> Path:
    from page_local.store.home import page_local_home

    return page_local_home() / "models" / "synth"


def path_of(name: str) -> Path:
    return folder() / f"{shape(name).name}-Q4_K_M.gguf"


def resolve(name: str) -> Path:
    """`synth:NAME` -> its written file; ModelNotInstalled saying how to write it when it is not there yet."""
    p = path_of(name)
    if not p.is_file():
        s = shape(name)
        raise ModelNotInstalled(
            f"the synthetic {s.title} shape is not written yet: `page-local models synth {s.name}` writes it "
            f"(~{approx_bytes(s) / 1e9:.1f} GB of random Q4_K_M weights, for benchmarks only)")
    return p


def is_synthetic(gguf_path: str | os.PathLike) -> str | None:
    """The shape's name if the GGUF at gguf_path is one of these benchmark models, else None (read from the
    header's general.* and page_local.* keys; a file that cannot be read is not called synthetic)."""
    from page_local.store.gguf import _header

    try:
        raw = _header(gguf_path, lambda k: k == SYNTH_KEY, lambda raw: SYNTH_KEY in raw)
    except (OSError, ValueError):
        return None
    v = raw.get(SYNTH_KEY)
    return str(v) if v else None


def refuse_synthetic(gguf_path: str | os.PathLike, command: str) -> None:
    """ModelError when gguf_path is a synthetic benchmark model: its answers are noise."""
    name = is_synthetic(gguf_path)
    if name is not None:
        title = SHAPES[name].title if name in SHAPES else name
        raise ModelError(
            f"{PREFIX}{name} is a benchmark model (random weights of {title}'s shapes): what it writes is noise, so "
            f"`page-local {command}` does not run it. Use it with `page-local bench` (decode, chat, probe), or give a "
            "real model (`page-local models` lists them)")


# --- the Q4_K_M mix (src/llama-quant.cpp, llama_tensor_get_type, at the pin) -------------------------

def use_more_bits(i_layer: int, n_layer: int) -> bool:
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def tensors(s: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, ggml shape ne0.., type) of every tensor, in llama.cpp's order; type F32 | Q4_K | Q6_K."""
    e, kv = s.n_embd, s.n_head_kv * s.head_dim
    out = [("token_embd.weight", (e, s.n_vocab), "Q6_K" if s.tied else "Q4_K")]
    if s.llama3_rope is not None:
        out.append(("rope_freqs.weight", (s.head_dim // 2,), "F32"))
    for i in range(s.n_layer):
        more = "Q6_K" if use_more_bits(i, s.n_layer) else "Q4_K"
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (e,), "F32"),
                (b + "attn_q.weight", (e, e), "Q4_K"), (b + "attn_k.weight", (e, kv), "Q4_K"),
                (b + "attn_v.weight", (e, kv), more)]
        if s.qkv_bias:
            out += [(b + "attn_q.bias", (e,), "F32"), (b + "attn_k.bias", (kv,), "F32"), (b + "attn_v.bias", (kv,), "F32")]
        out += [(b + "attn_output.weight", (e, e), "Q4_K"), (b + "ffn_norm.weight", (e,), "F32"),
                (b + "ffn_gate.weight", (e, s.n_ff), "Q4_K"), (b + "ffn_down.weight", (s.n_ff, e), more),
                (b + "ffn_up.weight", (e, s.n_ff), "Q4_K")]
    out.append(("output_norm.weight", (e,), "F32"))
    if not s.tied:
        out.append(("output.weight", (e, s.n_vocab), "Q6_K"))
    return out


def nbytes(ne: tuple[int, ...], kind: str) -> int:
    n = int(np.prod(ne))
    return 4 * n if kind == "F32" else n // QK_K * BLOCK_BYTES[kind]


def approx_bytes(s: Shape) -> int:
    return sum(nbytes(ne, k) for _, ne, k in tensors(s))


def llama3_rope_factors(s: Shape) -> np.ndarray:
    """rope_freqs.weight of Llama 3.1/3.2: per frequency, the divisor its long-context scaling applies."""
    factor, low, high, orig = s.llama3_rope
    freqs = 1.0 / s.rope_theta ** (np.arange(0, s.head_dim, 2, dtype=np.float64) / s.head_dim)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _blocks(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """n random bytes of `kind` blocks whose f16 scales are small normal numbers: weights finite and of the size
    an initialised layer has (|w| < ~0.1)."""
    raw = np.frombuffer(rng.bytes(n), dtype=np.uint8).copy()
    blocks = raw.reshape(-1, BLOCK_BYTES[kind])
    if kind == "Q4_K":  # d, dmin (f16) then 12 bytes of 6-bit scales and mins, 128 of 4-bit quants
        blocks[:, 0:2] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
        blocks[:, 2:4] = np.frombuffer(np.float16(7e-4).tobytes(), np.uint8)
    else:  # Q6_K: 128 + 64 bytes of quants, 16 int8 scales, then d (f16)
        blocks[:, 208:210] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
    return raw


def _tokenizer(source: str | os.PathLike, n_vocab: int) -> dict:
    """The tokenizer keys of the GGUF at source (the embedded SmolLM2's), its token list padded with unused tokens
    to n_vocab."""
    from gguf import GGUFReader

    r = GGUFReader(source)
    out = {}
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.chat_template"):
        f = r.fields.get(key)
        if f is not None:
            out[key] = f.contents()
    tokens, types = list(out["tokenizer.ggml.tokens"]), list(out["tokenizer.ggml.token_type"])
    if len(tokens) > n_vocab:
        raise ValueError(f"the tokenizer has {len(tokens)} tokens, more than the shape's {n_vocab}")
    pad = n_vocab - len(tokens)
    out["tokenizer.ggml.tokens"] = tokens + [f"<|synthetic_unused_{i}|>" for i in range(pad)]
    out["tokenizer.ggml.token_type"] = types + [5] * pad  # LLAMA_TOKEN_TYPE_UNUSED
    return out


def write(name: str | Shape, tokenizer_from: str | os.PathLike, dst: str | os.PathLike | None = None, seed: int = 0,
          progress: Callable[[int, int], None] | None = None) -> Path:
    """Write the synthetic model NAME (a key of SHAPES, or a Shape) at dst (default path_of(NAME)), atomically;
    returns the path. tokenizer_from: the GGUF whose tokenizer it takes (store.models.smollm2_path(): the embedded
    SmolLM2). An existing file at the default place is reused. progress(bytes written, total)."""
    import gguf

    s = name if isinstance(name, Shape) else shape(name)
    if dst is None and s.name not in SHAPES:
        raise ValueError(f"a shape of its own ({s.name!r}) needs a destination")
    target = Path(dst) if dst is not None else path_of(s.name)
    if dst is None and target.is_file() and is_synthetic(target) == s.name:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".partial")
    plan = tensors(s)
    total = sum(nbytes(ne, k) for _, ne, k in plan)
    w = gguf.GGUFWriter(tmp, s.arch)
    try:
        w.add_name(f"synthetic {s.title} shape (random weights, benchmark only)")
        w.add_string(SYNTH_KEY, s.name)
        w.add_file_type(FTYPE_Q4_K_M)
        w.add_context_length(s.n_ctx_train)
        w.add_embedding_length(s.n_embd)
        w.add_block_count(s.n_layer)
        w.add_feed_forward_length(s.n_ff)
        w.add_head_count(s.n_head)
        w.add_head_count_kv(s.n_head_kv)
        w.add_rope_freq_base(s.rope_theta)
        w.add_layer_norm_rms_eps(s.rms_eps)
        w.add_rope_dimension_count(s.head_dim)
        w.add_vocab_size(s.n_vocab)
        tok = _tokenizer(tokenizer_from, s.n_vocab)
        w.add_tokenizer_model(tok["tokenizer.ggml.model"])
        w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
        w.add_token_list(tok["tokenizer.ggml.tokens"])
        w.add_token_types(tok["tokenizer.ggml.token_type"])
        w.add_token_merges(tok["tokenizer.ggml.merges"])
        for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                         ("unknown_token_id", w.add_unk_token_id), ("padding_token_id", w.add_pad_token_id)):
            if f"tokenizer.ggml.{key}" in tok:
                add(int(tok[f"tokenizer.ggml.{key}"]))
        if "tokenizer.chat_template" in tok:
            w.add_chat_template(tok["tokenizer.chat_template"])
        kinds = {"F32": gguf.GGMLQuantizationType.F32, "Q4_K": gguf.GGMLQuantizationType.Q4_K,
                 "Q6_K": gguf.GGMLQuantizationType.Q6_K}
        for tname, ne, kind in plan:
            if kind == "F32":
                w.add_tensor_info(tname, tuple(reversed(ne)), np.dtype(np.float32), nbytes(ne, kind))
            else:
                w.add_tensor_info(tname, tuple(reversed(ne)), np.dtype(np.float32), nbytes(ne, kind),
                                  raw_dtype=kinds[kind])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        rng = np.random.default_rng(seed)
        done = 0
        for tname, ne, kind in plan:
            if tname == "rope_freqs.weight":
                data = llama3_rope_factors(s)
            elif kind == "F32":  # norms 1, biases small
                data = (np.ones(ne, np.float32) if tname.endswith("norm.weight")
                        else rng.normal(0, 0.02, int(np.prod(ne))).astype(np.float32))
            else:
                data = _blocks(kind, nbytes(ne, kind), rng)
            w.write_tensor_data(data)
            done += data.nbytes
            if progress is not None:
                progress(done, total)
        w.close()
        os.replace(tmp, target)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return target

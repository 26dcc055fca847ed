"""Tiny random GGUF models plus an exact float64 reference forward pass, for tests.

    w   = write_tiny_llama(tmp_path / "tiny.gguf")             # arch "llama", all tensors F32
    ref = reference_forward(w, tokens)                         # logits + per-layer attention
    s   = window_scores(ref, q_start, q_end)                   # (n_layer, n_head, n_tokens)

`write_tiny_llama(..., sliding_window=W)` writes arch "gemma3" instead: interleaved sliding-window
layers (iSWA; layer il is a sliding-window layer iff il % swa_pattern < swa_pattern - 1, so with the
default swa_pattern=2 layers 0, 2, 4... are SWA and 1, 3, 5... are global), per-head q/k RMS norms,
post-attention / post-FFN norms, GeGLU and a NEOX RoPE. `reference_forward` follows that graph too.

Conventions (shared by both architectures):
  * a weight mapping n_in -> n_out is a numpy array of shape (n_out, n_in) (y = W @ x); the gguf
    writer reverses numpy shapes, so it lands in ggml as ne = {n_in, n_out}, which is what
    llama.cpp's create_tensor expects;
  * q/k/v rows are head-major: rows h*d_head .. (h+1)*d_head-1 of wq belong to query head h;
  * query head h reads kv head h // (n_head // n_head_kv) (GQA);
  * token positions are 0..n-1 and the attention is causal (plus the window on SWA layers: key p
    is hidden from query i when i - p >= sliding_window, llama.cpp's LLAMA_SWA_TYPE_STANDARD).

Everything written to the file is float32; TinyWeights holds float64 copies of exactly those values.

Measured agreement with the patched libllama (CPU, F32 KV cache, 200 random tokens, max |diff| /
max |logit| per row): llama, flash attention off ~2e-7 (every row); flash attention on with
reference_forward(fa_f16=True) ~1e-5 on the last row, <=1.1e-4 on the worst row (f16 rounding
boundaries amplify through layers; the plain f32 reference is ~3e-4 off). gemma3: ~1e-5..6e-5 last
row, ~3e-4 worst row with FA off (ggml's GELU is an fp16 table lookup: inputs on an fp16 rounding
boundary round differently in f32 and f64), ~5e-4 with FA on (emulated).
gemma3 specifics the reference follows: embeddings scaled by sqrt(n_embd); Q pre-scaled by
1/sqrt(d_head) before attention with kq_scale 1 (Reference.q is unscaled, Reference.scale applies).
`llama_cpp_logits` runs the real library (llama-cpp-python's low-level API) for comparisons.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# llama.cpp SentencePiece token types (llama_token_type / gguf.TokenType)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_BYTE = 1, 2, 3, 6
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
N_SPECIAL = 3
BYTE_BASE = N_SPECIAL  # "<0xXX>" is token BYTE_BASE + XX
MIN_VOCAB = N_SPECIAL + 256


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # (n_embd,)
    wq: np.ndarray  # (n_head*d_head, n_embd)
    wk: np.ndarray  # (n_head_kv*d_head, n_embd)
    wv: np.ndarray  # (n_head_kv*d_head, n_embd)
    wo: np.ndarray  # (n_embd, n_head*d_head)
    ffn_norm: np.ndarray  # (n_embd,)
    w_gate: np.ndarray  # (n_ff, n_embd)
    w_up: np.ndarray  # (n_ff, n_embd)
    w_down: np.ndarray  # (n_embd, n_ff)
    # gemma3 only (None for llama)
    q_norm: np.ndarray | None = None  # (d_head,)
    k_norm: np.ndarray | None = None  # (d_head,)
    attn_post_norm: np.ndarray | None = None  # (n_embd,)
    ffn_post_norm: np.ndarray | None = None  # (n_embd,)


@dataclass
class TinyWeights:
    path: Path
    arch: str  # "llama" or "gemma3"
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    d_head: int
    rope_theta: float
    rms_eps: float
    tok_embd: np.ndarray  # (n_vocab, n_embd)
    output_norm: np.ndarray  # (n_embd,)
    output: np.ndarray  # (n_vocab, n_embd)
    layers: list[LayerWeights]
    sliding_window: int | None = None  # None: no SWA layers (always None for llama)
    swa_layers: tuple[bool, ...] = ()  # per layer: is it a sliding-window layer
    rope_theta_swa: float = 10000.0  # gemma3: RoPE base of the SWA layers
    seed: int = 0
    # filled in by the writer: bos/eos/unk ids and the byte-token offset
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    unk_id: int = UNK_ID
    extra: dict = field(default_factory=dict)

    @property
    def n_rep(self) -> int:
        return self.n_head // self.n_head_kv

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.d_head)

    def is_swa(self, il: int) -> bool:
        return bool(self.swa_layers[il]) if self.swa_layers else False

    def byte_token(self, b: int) -> int:
        return BYTE_BASE + int(b)


@dataclass
class Reference:
    logits: np.ndarray  # (n_tokens, n_vocab) float64
    attn: np.ndarray  # (n_layer, n_head, n_tokens, n_tokens); row = query, col = key; from unrounded q, k
    q: np.ndarray  # (n_layer, n_tokens, n_head, d_head)    post-RoPE (gemma3: post-norm, pre-scale)
    k: np.ndarray  # (n_layer, n_tokens, n_head_kv, d_head) post-RoPE, as stored in the KV cache
    v: np.ndarray  # (n_layer, n_tokens, n_head_kv, d_head)
    hidden: np.ndarray  # (n_layer + 1, n_tokens, n_embd) residual stream entering each layer, + final
    scale: float  # softmax scale applied to q . k

    @property
    def n_layer(self) -> int:
        return int(self.attn.shape[0])

    @property
    def n_head(self) -> int:
        return int(self.attn.shape[1])

    @property
    def n_tokens(self) -> int:
        return int(self.attn.shape[2])


# --------------------------------------------------------------------------------------------
# writer
# --------------------------------------------------------------------------------------------


def _tokenizer(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    if n_vocab < MIN_VOCAB:
        raise ValueError(f"n_vocab must be >= {MIN_VOCAB} (3 specials + 256 byte tokens)")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL] + [TOKEN_BYTE] * 256
    scores = [0.0] * len(tokens)
    for i in range(n_vocab - len(tokens)):
        tokens.append(f"\u2581t{i}")  # "▁t0", "▁t1", ... distinct SentencePiece-style pieces
        types.append(TOKEN_NORMAL)
        scores.append(-float(i + 1))
    return tokens, scores, types


# The two shapes the fidelity tests compare against the float64 reference. attn_out_scale: a smaller
# attention contribution to the residual stream keeps the f16 rounding of the flash path (emulated,
# but not bit for bit) from compounding across layers.
FIDELITY_MODELS = ("llama-gqa", "gemma3-iswa")


def write_fidelity_model(name: str, d: Path) -> "TinyWeights":
    if name == "llama-gqa":
        return write_tiny_llama(d / "llama.gguf", n_layer=3, n_head=4, n_head_kv=2, attn_out_scale=0.2)
    if name == "gemma3-iswa":
        return write_tiny_llama(d / "gemma3.gguf", n_layer=4, n_head=4, n_head_kv=2, sliding_window=64,
                                attn_out_scale=0.2)
    raise ValueError(f"unknown fidelity model {name!r}; choose from {FIDELITY_MODELS}")


def write_tiny_llama(
    path,
    *,
    n_layer: int = 3,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int = 300,
    n_ctx_train: int = 2048,
    seed: int = 0,
    rope_theta: float = 10000.0,
    sliding_window: int | None = None,
    swa_pattern: int = 2,
    rope_theta_swa: float = 10000.0,
    rms_eps: float = 1e-5,
    qk_std: float = 1.4,
    attn_out_scale: float = 1.0,
    chat_template: str | None = None,
) -> TinyWeights:
    """Write a random all-F32 GGUF and return the weights (float64 copies of what was written).

    sliding_window=None -> arch "llama". sliding_window=W -> arch "gemma3" with iSWA: layer il is a
    window-W layer iff il % swa_pattern < swa_pattern - 1 (llama.cpp's set_swa_pattern).
    qk_std: per-component std of q and k (llama) so attention logits q.k/sqrt(d) have std ~qk_std**2.
    """
    import gguf

    if n_embd % n_head:
        raise ValueError("n_embd must be a multiple of n_head")
    if n_head % n_head_kv:
        raise ValueError("n_head must be a multiple of n_head_kv")
    d_head = n_embd // n_head
    if d_head % 2:
        raise ValueError("d_head must be even (RoPE)")
    arch = "llama" if sliding_window is None else "gemma3"
    if sliding_window is not None and sliding_window < 1:
        raise ValueError("sliding_window must be >= 1")

    rng = np.random.default_rng(seed)

    def f32(a) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(a, dtype=np.float32))

    def mat(n_out: int, n_in: int, std: float) -> np.ndarray:
        return f32(rng.standard_normal((n_out, n_in)) * std)

    def norm_w(n: int, center: float = 1.0, spread: float = 0.1) -> np.ndarray:
        return f32(center + spread * rng.standard_normal(n))

    n_q, n_kv = n_head * d_head, n_head_kv * d_head
    if arch == "llama":
        # x after RMSNorm has unit-rms components, so q_i ~ N(0, (std*sqrt(n_embd))^2)
        wqk_std = qk_std / math.sqrt(n_embd)
        tok_std = 1.0
    else:
        # gemma3 RMS-normalises q and k per head (q_norm/k_norm carry the temperature), and scales
        # the embeddings by sqrt(n_embd) itself
        wqk_std = 1.0 / math.sqrt(n_embd)
        tok_std = 1.0 / math.sqrt(n_embd)

    tok_embd = mat(n_vocab, n_embd, tok_std)
    layers: list[LayerWeights] = []
    for _ in range(n_layer):
        lw = LayerWeights(
            attn_norm=norm_w(n_embd),
            wq=mat(n_q, n_embd, wqk_std),
            wk=mat(n_kv, n_embd, wqk_std),
            wv=mat(n_kv, n_embd, 1.0 / math.sqrt(n_embd)),
            wo=mat(n_embd, n_q, 0.5 * attn_out_scale / math.sqrt(n_q)),
            ffn_norm=norm_w(n_embd),
            w_gate=mat(n_ff, n_embd, 1.0 / math.sqrt(n_embd)),
            w_up=mat(n_ff, n_embd, 1.0 / math.sqrt(n_embd)),
            w_down=mat(n_embd, n_ff, 0.5 / math.sqrt(n_ff)),
        )
        if arch == "gemma3":
            lw.q_norm = norm_w(d_head, center=qk_std, spread=0.1)
            lw.k_norm = norm_w(d_head, center=qk_std, spread=0.1)
            lw.attn_post_norm = norm_w(n_embd, center=0.7) * attn_out_scale
            lw.ffn_post_norm = norm_w(n_embd, center=0.7)
        layers.append(lw)
    output_norm = norm_w(n_embd)
    output = mat(n_vocab, n_embd, 1.5 / math.sqrt(n_embd))

    if arch == "gemma3":
        swa_layers = tuple(bool(il % swa_pattern < swa_pattern - 1) for il in range(n_layer))
    else:
        swa_layers = tuple(False for _ in range(n_layer))

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(n_vocab)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(d_head)
    w.add_value_length(d_head)
    w.add_rope_dimension_count(d_head)
    w.add_rope_freq_base(float(rope_theta))
    w.add_layer_norm_rms_eps(float(rms_eps))
    if arch == "gemma3":
        w.add_sliding_window(int(sliding_window))
        w.add_sliding_window_pattern(int(swa_pattern))
        w.add_rope_freq_base_swa(float(rope_theta_swa))

    tokens, scores, types = _tokenizer(n_vocab)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)

    w.add_tensor("token_embd.weight", tok_embd)
    w.add_tensor("output_norm.weight", output_norm)
    w.add_tensor("output.weight", output)
    for il, lw in enumerate(layers):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", lw.attn_norm)
        w.add_tensor(p + "attn_q.weight", lw.wq)
        w.add_tensor(p + "attn_k.weight", lw.wk)
        w.add_tensor(p + "attn_v.weight", lw.wv)
        w.add_tensor(p + "attn_output.weight", lw.wo)
        w.add_tensor(p + "ffn_norm.weight", lw.ffn_norm)
        w.add_tensor(p + "ffn_gate.weight", lw.w_gate)
        w.add_tensor(p + "ffn_up.weight", lw.w_up)
        w.add_tensor(p + "ffn_down.weight", lw.w_down)
        if arch == "gemma3":
            w.add_tensor(p + "attn_q_norm.weight", lw.q_norm)
            w.add_tensor(p + "attn_k_norm.weight", lw.k_norm)
            w.add_tensor(p + "post_attention_norm.weight", lw.attn_post_norm)
            w.add_tensor(p + "post_ffw_norm.weight", lw.ffn_post_norm)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    def f64(a):
        return None if a is None else np.array(a, dtype=np.float64)

    return TinyWeights(
        path=path,
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=n_ff,
        n_vocab=n_vocab,
        n_ctx_train=n_ctx_train,
        d_head=d_head,
        rope_theta=float(rope_theta),
        rms_eps=float(np.float32(rms_eps)),
        tok_embd=f64(tok_embd),
        output_norm=f64(output_norm),
        output=f64(output),
        layers=[LayerWeights(**{k: f64(v) for k, v in vars(lw).items()}) for lw in layers],
        sliding_window=None if sliding_window is None else int(sliding_window),
        swa_layers=swa_layers,
        rope_theta_swa=float(rope_theta_swa),
        seed=seed,
    )


# --------------------------------------------------------------------------------------------
# reference forward
# --------------------------------------------------------------------------------------------


def _rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * weight


def _rope_cos_sin(n_tokens: int, d_rot: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin (n_tokens, d_rot/2) with thetas built exactly like ggml's CPU rope cache: in float32,
    theta_0 = pos, theta_{i+1} = theta_i * powf(base, -2/d_rot)."""
    theta_scale = np.float32(np.power(np.float32(base), np.float32(-2.0) / np.float32(d_rot)))
    theta = np.empty((n_tokens, d_rot // 2), dtype=np.float32)
    t = np.arange(n_tokens, dtype=np.float32)
    for i in range(d_rot // 2):
        theta[:, i] = t
        t = (t * theta_scale).astype(np.float32)
    th = theta.astype(np.float64)
    return np.cos(th), np.sin(th)


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> np.ndarray:
    """x: (n_tokens, n_heads, d). NORM mode rotates (x[2i], x[2i+1]); NEOX mode (x[i], x[i+d/2])."""
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    if neox:
        h = x.shape[-1] // 2
        x0, x1 = x[..., :h], x[..., h:]
        out[..., :h] = x0 * c - x1 * s
        out[..., h:] = x0 * s + x1 * c
    else:
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
    return out


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _gelu_ggml(x: np.ndarray) -> np.ndarray:
    """ggml CPU GELU (GGML_GELU_FP16): tanh-GELU looked up from an fp16 table at fp16(x)."""
    xh = x.astype(np.float16).astype(np.float64)
    g = 0.5 * xh * (1.0 + np.tanh(0.7978845608028654 * xh * (1.0 + 0.044715 * xh * xh)))
    g = g.astype(np.float16).astype(np.float64)
    return np.where(x <= -10.0, 0.0, np.where(x >= 10.0, x, g))


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float64)


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - np.max(z, axis=-1, keepdims=True)
    e = np.exp(z)
    return e / np.sum(e, axis=-1, keepdims=True)


def attention_mask(w: TinyWeights, il: int, n_tokens: int) -> np.ndarray:
    """(n_tokens, n_tokens) bool, True where query row i may see key column p."""
    i = np.arange(n_tokens)[:, None]
    p = np.arange(n_tokens)[None, :]
    m = p <= i
    if w.is_swa(il):
        m &= (i - p) < w.sliding_window
    return m


FA_TILE_Q = 64  # ggml-cpu GGML_FA_TILE_Q: ubatches with >= this many queries use the tiled kernel
FA_SPLIT_KV_MIN = 512  # single-query ubatches with n_kv >= this split the keys across threads
KV_PAD = 256  # llama_kv_cache::get_n_kv pads the KV view to a multiple of 256 cells


def _fa_rows_kernel(q16, k16, v16, mask, kq_scale, chunks):
    """ggml_compute_forward_flash_attn_ext_f16_one_chunk, vectorised over (rows, heads).

    q16 (m, H, d) and k16/v16 (n, H, d) already rounded to f16 (as float64); mask (m, n) bool.
    Keys are visited in order; M, S in f32; the V accumulator is f16 (ggml_vec_mad_f16 /
    ggml_vec_scale_f16 round after every step). Several chunks are reduced like
    ggml_flash_attn_ext_reduce_partials (f32)."""
    f32, f16 = np.float32, np.float16
    m, H, d = q16.shape
    n = k16.shape[0]
    parts = []
    for c0, c1 in chunks:
        M = np.full((m, H), -np.inf, dtype=f32)
        S = np.zeros((m, H), dtype=f32)
        acc = np.zeros((m, H, d), dtype=f16)
        for p in range(c0, min(c1, n)):
            vis = mask[:, p]
            if not vis.any():
                continue
            s = (np.einsum("ihd,hd->ih", q16, k16[p]).astype(f32) * f32(kq_scale)).astype(f32)
            vis = np.broadcast_to(vis[:, None], (m, H))
            new = vis & (s > M)
            with np.errstate(invalid="ignore", over="ignore"):
                ms = np.where(new, np.exp((M - s).astype(f32)), f32(1.0)).astype(f32)
                vs = np.where(new, f32(1.0), np.exp((s - M).astype(f32))).astype(f32)
            M = np.where(new, s, M)
            acc = np.where(new[..., None], (acc.astype(f32) * ms[..., None]).astype(f16), acc)
            upd = (acc.astype(f32) + v16[p].astype(f32)[None] * vs[..., None]).astype(f16)
            acc = np.where(vis[..., None], upd, acc)
            S = np.where(vis, (S * ms + vs).astype(f32), S)
        parts.append((M, S, acc.astype(f32)))
    if len(parts) == 1:
        M, S, acc = parts[0]
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(S[..., None] == 0, 0.0, acc.astype(np.float64) / S[..., None].astype(np.float64))
    Mf = np.full((m, H), -np.inf, dtype=f32)
    Sf = np.zeros((m, H), dtype=f32)
    Vf = np.zeros((m, H, d), dtype=f32)
    for M, S, acc in parts:
        live = S != 0
        Mn = np.maximum(Mf, M)
        with np.errstate(invalid="ignore"):
            so = np.where(live, np.exp((Mf - Mn).astype(f32)), f32(1.0)).astype(f32)
            sn = np.where(live, np.exp((M - Mn).astype(f32)), f32(0.0)).astype(f32)
        Vf = np.where(live[..., None], (Vf * so[..., None] + acc * sn[..., None]).astype(f32), Vf)
        Sf = np.where(live, (Sf * so + S * sn).astype(f32), Sf)
        Mf = np.where(live, Mn, Mf)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(Sf[..., None] == 0, 0.0, Vf.astype(np.float64) / Sf[..., None].astype(np.float64))


def reference_forward(
    w: TinyWeights,
    tokens,
    *,
    fa_f16: bool = False,
    fa_split=None,
    fa_n_threads: int = 2,
    fa_kv_size: int = 1024,
    fa_kernels: str = "page-local",
) -> Reference:
    """float64 forward pass of the whole sequence at positions 0..n-1 (causal; windowed on SWA layers).

    fa_f16=False reproduces llama.cpp's f32 path (F32 KV cache, flash attention off) to ~1e-7.

    fa_f16=True emulates llama.cpp's CPU flash attention (F32 cache; llama-graph casts K and V to
    f16 before ggml_flash_attn_ext) for the attention that feeds each layer's output. The kernel
    depends on the ubatch, so pass fa_split = the sizes of the llama_decode calls (None: a single
    call with every token):
      * a ubatch of >= 64 queries uses the tiled kernel: Q stays f32, K and V are rounded to f16,
        softmax and accumulation in f32;
      * a smaller ubatch, with fa_kernels="page-local" (the library's default): page-local's decode kernel
        (one query) and row kernel (2..63 queries, csrc/kernels/page-fa-decode.cpp) compute as the tiled
        kernel does: Q f32, K and V f16, scores, softmax and accumulation in f32 (blocks of 32 cells, an
        online softmax: f32 rounding apart, the same numbers);
      * a smaller ubatch, with fa_kernels="llama.cpp" ($PAGE_LOCAL_FA_KERNEL=llama.cpp): llama.cpp's one-row
        kernel: Q is rounded to f16 as well and V is accumulated in an f16 buffer, key by key (emulated
        step by step); a single-query ubatch whose KV view (used cells padded to 256, capped at
        fa_kv_size = the context's n_ctx) has >= 512 cells splits the keys into fa_n_threads chunks
        (n_threads of the context) reduced in f32.
    The emulation assumes KV cell index == position (one sequence, fresh cache, no eviction).
    The returned `attn` probabilities are always computed from the unrounded q and k.
    """
    tokens = np.asarray(list(tokens), dtype=np.int64)
    n = int(tokens.shape[0])
    if n == 0:
        raise ValueError("empty token list")
    if tokens.min() < 0 or tokens.max() >= w.n_vocab:
        raise ValueError("token id out of range")
    if fa_kernels not in ("page-local", "llama.cpp"):
        raise ValueError(f"fa_kernels must be 'page-local' or 'llama.cpp', got {fa_kernels!r}")
    parts = [n] if fa_split is None else [int(x) for x in fa_split]
    if sum(parts) != n or min(parts) < 1:
        raise ValueError("fa_split must be positive sizes summing to len(tokens)")
    d, H, Hkv = w.d_head, w.n_head, w.n_head_kv
    gemma = w.arch == "gemma3"
    eps = w.rms_eps

    x = w.tok_embd[tokens].copy()
    if gemma:
        x *= float(np.sqrt(np.float32(w.n_embd)))  # ggml_scale by sqrtf(n_embd)

    cs_cache: dict[float, tuple[np.ndarray, np.ndarray]] = {}

    def cos_sin(base: float):
        if base not in cs_cache:
            cs_cache[base] = _rope_cos_sin(n, d, base)
        return cs_cache[base]

    attn_all = np.zeros((w.n_layer, H, n, n))
    q_all = np.zeros((w.n_layer, n, H, d))
    k_all = np.zeros((w.n_layer, n, Hkv, d))
    v_all = np.zeros((w.n_layer, n, Hkv, d))
    hidden = np.zeros((w.n_layer + 1, n, w.n_embd))
    scale = w.attn_scale
    kv_of = np.arange(H) // w.n_rep

    for il, lw in enumerate(w.layers):
        hidden[il] = x
        h = _rms_norm(x, lw.attn_norm, eps)
        q = (h @ lw.wq.T).reshape(n, H, d)
        k = (h @ lw.wk.T).reshape(n, Hkv, d)
        v = (h @ lw.wv.T).reshape(n, Hkv, d)
        if gemma:
            q = _rms_norm(q, lw.q_norm, eps)
            k = _rms_norm(k, lw.k_norm, eps)
            base = w.rope_theta_swa if w.is_swa(il) else w.rope_theta
        else:
            base = w.rope_theta
        cos, sin = cos_sin(base)
        q = _rope(q, cos, sin, neox=gemma)
        k = _rope(k, cos, sin, neox=gemma)
        q_all[il], k_all[il], v_all[il] = q, k, v

        mask = attention_mask(w, il, n)
        neg = np.where(mask, 0.0, -np.inf)

        kh = k[:, kv_of, :]  # (n, H, d)
        vh = v[:, kv_of, :]
        logits = np.einsum("ihd,phd->hip", q, kh) * scale + neg[None]
        probs = _softmax(logits)
        attn_all[il] = probs

        if fa_f16:
            # gemma3 pre-scales Q (ggml_scale) and calls attention with kq_scale = 1
            qs, kq_scale = (q * scale, 1.0) if gemma else (q, scale)
            k16, v16 = _f16(kh), _f16(vh)
            out = np.empty((n, H, d))
            by_chunks: dict[tuple, list[int]] = {}  # rows of small ubatches, grouped by KV chunking
            a0 = 0
            for m in parts:
                a1 = a0 + m
                if m >= FA_TILE_Q or fa_kernels == "page-local":
                    lg = np.einsum("ihd,phd->hip", qs[a0:a1], k16) * kq_scale + neg[None, a0:a1]
                    out[a0:a1] = np.einsum("hip,phd->ihd", _softmax(lg), v16)
                else:
                    n_kv = min(fa_kv_size, max(KV_PAD, -(-a1 // KV_PAD) * KV_PAD))
                    if m == 1 and n_kv >= FA_SPLIT_KV_MIN:
                        cs = -(-n_kv // fa_n_threads)
                        chunks = tuple((c, min(c + cs, n_kv)) for c in range(0, n_kv, cs))
                    else:
                        chunks = ((0, n_kv),)
                    by_chunks.setdefault(chunks, []).extend(range(a0, a1))
                a0 = a1
            for chunks, rows in by_chunks.items():
                r = np.asarray(rows)
                out[r] = _fa_rows_kernel(_f16(qs[r]), k16, v16, mask[r], kq_scale, chunks)
        else:
            out = np.einsum("hip,phd->ihd", probs, vh)
        a = out.reshape(n, H * d) @ lw.wo.T
        if gemma:
            a = _rms_norm(a, lw.attn_post_norm, eps)
        x = x + a

        h = _rms_norm(x, lw.ffn_norm, eps)
        g = h @ lw.w_gate.T
        u = h @ lw.w_up.T
        act = _gelu_ggml(g) if gemma else _silu(g)
        f = (act * u) @ lw.w_down.T
        if gemma:
            f = _rms_norm(f, lw.ffn_post_norm, eps)
        x = x + f

    hidden[w.n_layer] = x
    logits = _rms_norm(x, w.output_norm, eps) @ w.output.T
    return Reference(logits=logits, attn=attn_all, q=q_all, k=k_all, v=v_all, hidden=hidden, scale=scale)


def window_scores(ref: Reference, q_start: int, q_end: int) -> np.ndarray:
    """Mean of the attention rows of queries q_start..q_end-1: (n_layer, n_head, n_tokens).

    Columns past q_end-1 are zero (causal). This is what the page-local probe reports per head."""
    if not (0 <= q_start < q_end <= ref.n_tokens):
        raise ValueError(f"bad query window [{q_start}, {q_end}) for {ref.n_tokens} tokens")
    return ref.attn[:, :, q_start:q_end, :].mean(axis=2)


# --------------------------------------------------------------------------------------------
# running the real library
# --------------------------------------------------------------------------------------------


def default_lib_path() -> Path:
    """The folder page_local loads the patched libllama from (installed package or checkout build)."""
    from page_local_bindings import loader

    return loader.library_dir()


def llama_cpp_logits(
    path,
    tokens,
    *,
    flash_attn: bool = False,
    n_ctx: int = 1024,
    n_batch: int = 512,
    n_threads: int = 2,
    all_logits: bool = False,
    split=None,
) -> np.ndarray:
    """Decode `tokens` (positions 0..n-1, seq 0) with llama-cpp-python's low-level API, F32 KV cache.

    split: sizes of consecutive llama_decode calls (default: one call with every token; each part
    must be <= n_batch). Returns the last token's logits (n_vocab,), or (n_tokens, n_vocab) with
    all_logits=True. LLAMA_CPP_LIB_PATH must point at the patched build before llama_cpp is first
    imported (defaults here to the folder page_local loads it from)."""
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(default_lib_path()))
    import llama_cpp

    tokens = [int(t) for t in tokens]
    n = len(tokens)
    parts = [n] if split is None else [int(s) for s in split]
    if sum(parts) != n or min(parts) < 1 or max(parts) > n_batch:
        raise ValueError("split must be positive sizes <= n_batch summing to len(tokens)")
    if n > n_ctx:
        raise ValueError("len(tokens) must be <= n_ctx")

    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama_model_load_from_file failed for {path}")
    ctx = None
    batch = None
    try:
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = 1
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.type_k = llama_cpp.GGML_TYPE_F32
        cparams.type_v = llama_cpp.GGML_TYPE_F32
        cparams.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        cparams.no_perf = True
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            raise RuntimeError("llama_init_from_model failed")
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        batch = llama_cpp.llama_batch_init(max(parts), 0, 1)
        rows = []
        start = 0
        for m in parts:
            batch.n_tokens = m
            for j in range(m):
                i = start + j
                batch.token[j] = tokens[i]
                batch.pos[j] = i
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = 0
                batch.logits[j] = 1 if (all_logits or i == n - 1) else 0
            rc = llama_cpp.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            for j in range(m):
                if all_logits or start + j == n - 1:
                    ptr = llama_cpp.llama_get_logits_ith(ctx, j)
                    rows.append(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).astype(np.float64))
            start += m
        out = np.stack(rows)
        return out if all_logits else out[0]
    finally:
        if batch is not None:
            llama_cpp.llama_batch_free(batch)
        if ctx:
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)

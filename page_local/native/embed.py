"""Sentence embeddings from a generative model: a small llama_context of its own with embeddings on and
mean pooling, beside (never inside) the contexts that hold conversations.

What llama-server returns on /v1/embeddings for a model without a pooling head of its own when it is
asked for mean pooling: the final hidden states (after the output norm, before the LM head) averaged
over the input's tokens, then L2-normalised. The input must fit one physical batch (llama.cpp pools
within a ubatch), as in llama-server.
"""

from __future__ import annotations

import ctypes

import numpy as np

from page_local.errors import DecodeError, ModelError
from page_local.native import llama_log, pageops


class Embedder:
    """Owner of one embeddings context on a Model (borrowed: close this before the model). Not
    thread-safe: one caller at a time."""

    def __init__(self, model, n_ctx: int = 512, threads: int = 2):
        """n_ctx: the longest input in tokens (also the batch: pooling needs the input in one ubatch)."""
        if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 8:
            raise ValueError(f"n_ctx must be an int >= 8, got {n_ctx!r}")
        lc = pageops.llama_cpp()
        from llama_cpp import _internals

        self.model = model
        p = lc.llama_context_default_params()
        p.n_ctx = p.n_batch = p.n_ubatch = n_ctx
        p.n_seq_max = 1
        p.n_threads = p.n_threads_batch = threads
        p.embeddings = True
        p.pooling_type = lc.LLAMA_POOLING_TYPE_MEAN
        p.no_perf = True
        self._params = p
        with llama_log.held() as log:
            try:
                self._c = _internals.LlamaContext(model=model.llama_model, params=p, verbose=False)
            except ValueError as e:
                reason = log.reason()
                log.mark_reported()
                raise ModelError(f"llama.cpp could not create an embeddings context (n_ctx={n_ctx}): "
                                 + (f"{e} (llama.cpp: {reason})" if reason else str(e))) from e
        self.ptr = self._c.ctx
        self.n_ctx = int(lc.llama_n_ctx(self.ptr))
        self.n_embd = model.n_embd
        self._batch = lc.llama_batch_init(self.n_ctx, 0, 1)
        self._lc = lc

    def embed(self, tokens: list[int]) -> np.ndarray:
        """f32 (n_embd,): the mean of the final hidden states over `tokens`, L2-normalised. ValueError
        for an empty input, one longer than n_ctx, or a token outside the vocabulary."""
        if self.ptr is None:
            raise ValueError("this Embedder is closed")
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("the input is empty")
        if len(tokens) > self.n_ctx:
            raise ValueError(f"the input is {len(tokens)} tokens, above the {self.n_ctx} an embedding reads")
        bad = [t for t in tokens if not 0 <= t < self.model.n_vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.model.n_vocab - 1})")
        lc, b = self._lc, self._batch
        lc.llama_memory_clear(lc.llama_get_memory(self.ptr), True)  # each input alone, from position 0
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = True
        b.n_tokens = len(tokens)
        rc = lc.llama_decode(self.ptr, b)
        if rc != 0:
            raise DecodeError(f"llama_decode failed with code {rc} (embeddings)")
        ptr = lc.llama_get_embeddings_seq(self.ptr, 0)
        if not ptr:
            raise DecodeError("llama.cpp returned no pooled embedding")
        v = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_embd,)).copy()
        norm = float(np.linalg.norm(v.astype(np.float64)))
        return v / norm if norm > 0 else v  # f32 (n_embd,)

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

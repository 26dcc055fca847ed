"""llama.cpp's sampler chain (llama-cpp-python's LlamaSampler): the engine's generation loop samples
through it (only the native layer touches llama_cpp objects)."""

from __future__ import annotations


def make_sampler(temperature: float, top_k: int, top_p: float, seed: int):
    """A sampler chain: greedy at temperature 0, else top-k (0 = off), top-p, temperature, seeded draw.
    The caller closes it (.close())."""
    from llama_cpp import _internals

    smp = _internals.LlamaSampler()
    if temperature <= 0:
        smp.add_greedy()
    else:
        if top_k > 0:
            smp.add_top_k(top_k)
        smp.add_top_p(top_p, 1)
        smp.add_temp(temperature)
        smp.add_dist(seed)
    return smp


def sample(sampler, ctx) -> int:
    """Sample from the logits of the context's last decoded token (ctx: native.runtime.Context)."""
    from llama_cpp import llama_cpp as lc

    return int(lc.llama_sampler_sample(sampler.sampler, ctx.ptr, -1))

"""Evictor registry: name -> class. Adding an evictor = one file + one line here.

Every evictor follows the contract in page_local.evictors.base (`needs`, `select(inp)`).
"""

from __future__ import annotations

from page_local.evictors.base import EvictionInput, Evictor, resolve_budget
from page_local.evictors.h2o import H2O
from page_local.evictors.knorm import KNorm
from page_local.evictors.lorekv import LoreKV, LoreKVAnswer
from page_local.evictors.pyramidkv import PyramidKV
from page_local.evictors.random_keep import RandomKeep
from page_local.evictors.snapkv import SnapKV
from page_local.evictors.spans import SnapKVSpans
from page_local.evictors.streamingllm import StreamingLLM
from page_local.evictors.tova import TOVA

EVICTORS: dict[str, type[Evictor]] = {
    cls.name: cls for cls in (SnapKV, SnapKVSpans, StreamingLLM, H2O, TOVA, KNorm, PyramidKV, RandomKeep, LoreKV,
                              LoreKVAnswer)
}

DEFAULT_EVICTOR = "snapkv"


def get_evictor(name: str, **options) -> Evictor:
    """An evictor instance by registry name (EVICTORS); `options` go to its constructor (e.g. pool="avg")."""
    every = EVICTORS
    try:
        cls = every[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown evictor {name!r}; valid names: {', '.join(sorted(every))}") from None
    try:
        return cls(**options)
    except TypeError as e:  # an option the class does not take
        raise ValueError(f"bad options for evictor {name!r}: {e}") from None


__all__ = ["EVICTORS", "DEFAULT_EVICTOR", "EvictionInput", "Evictor", "get_evictor", "resolve_budget"]

"""page-local: PAGE-gated KV-cache eviction for llama.cpp (arXiv 2609.22157).

    from page_local import Engine, ChatSession, Sampling

    with Engine() as eng:                       # the embedded SmolLM2 by default
        result = eng.generate("Summarise: ...", max_tokens=64)
        print(result.text, result.decision.evicted)

Importing page_local loads nothing native: the names below are imported on first use, and the
patched library is loaded when the first model is. Every error page-local raises on purpose is a
page_local.errors.PageLocalError.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_FACE = {
    "Engine": "page_local.engine.engine",
    "Stream": "page_local.engine.engine",
    "Decision": "page_local.engine.decision",
    "Result": "page_local.engine.decision",
    "Sampling": "page_local.engine.decision",
    "ChatSession": "page_local.chat.session",
    "PageLocalError": "page_local.errors",
}

__all__ = sorted(_FACE) + ["__version__"]


def __getattr__(name: str):
    if name in _FACE:
        value = getattr(importlib.import_module(_FACE[name]), name)
        globals()[name] = value  # once: later lookups do not come back here
        return value
    raise AttributeError(f"module 'page_local' has no attribute {name!r}")


def __dir__():
    return __all__

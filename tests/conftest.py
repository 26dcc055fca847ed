"""Shared fixtures: the real patched library and real GGUF models (embedded SmolLM2, tiny f32 models)."""

from __future__ import annotations

import numpy as np
import pytest

from page_local import models
from page_local.runtime import Context, ContextConfig, Model


@pytest.fixture(scope="session")
def smollm2_path():
    try:
        return models.smollm2_path()
    except models.ModelNotInstalled as e:
        pytest.skip(f"SmolLM2 is not installed ({e})")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    with Model(smollm2_path) as m:
        yield m


@pytest.fixture
def make_ctx():
    """make_ctx(model, **ContextConfig fields) -> Context, closed at the end of the test."""
    made = []

    def make(model, cb_eval=None, **kw):
        kw.setdefault("threads", 2)
        ctx = Context(model, ContextConfig(**kw), cb_eval=cb_eval)
        made.append(ctx)
        return ctx

    yield make
    for c in reversed(made):
        c.close()


def random_tokens(n: int, seed: int = 0, lo: int = 100, hi: int = 4000) -> list[int]:
    return np.random.default_rng(seed).integers(lo, hi, size=n).tolist()

"""`make test` installs the [test] and [serve] extras, so none of the tests that import them may be
skipped there: a missing package (openai 3 no longer pulls in httpx, which the server tests use) would
otherwise turn 50 server tests into one silent skip. The Makefile sets PAGE_LOCAL_REQUIRE_EXTRAS=1;
a plain `pytest` run by someone who installed only part of the extras skips this check."""

from __future__ import annotations

import importlib
import os

import pytest

EXTRAS = ("pytest", "xdist", "hypothesis", "pexpect", "openai", "httpx", "ollama", "selenium",  # [test]
          "starlette", "uvicorn", "sse_starlette", "prometheus_client")  # [serve]


@pytest.mark.skipif(os.environ.get("PAGE_LOCAL_REQUIRE_EXTRAS") != "1",
                    reason="only under `make test`, which installs the [test] and [serve] extras")
@pytest.mark.parametrize("module", EXTRAS)
def test_the_extras_make_setup_installs_are_importable(module):
    importlib.import_module(module)

"""`page-local bench peer` (page-local vs NVIDIA kvpress): without the optional [peer] extra it fails
with one line that says how to install it; with the extra, a small real run on the embedded SmolLM2.
Neither test needs the extra to be installed (the real run is skipped without it)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.conftest import one_line_error
from page_local.bench.peer import PEER_MODULES


@pytest.mark.parametrize("hidden", [PEER_MODULES, ("kvpress",)], ids=["no-extra", "no-kvpress"])
def test_missing_extra_is_one_line(cli, monkeypatch, hidden):
    missing = [m for m in PEER_MODULES if m in hidden or importlib.util.find_spec(m) is None]
    for name in hidden:  # None in sys.modules: `import name` raises ImportError, installed or not
        monkeypatch.setitem(sys.modules, name, None)
    res = cli("bench", "peer", "--n", "1")
    last = one_line_error(res, 1, "pip install 'page-local[peer]'", "make bench-peer")
    assert f"missing: {', '.join(missing)};" in last
    assert res.stdout == ""


def test_bad_options_are_usage_errors(cli):
    one_line_error(cli("bench", "peer", "--budget", "1"), 2, "--budget")
    one_line_error(cli("bench", "peer", "--tokens", "100"), 2, "--tokens")
    one_line_error(cli("bench", "peer", "--kvpress-kernel", "4"), 2, "--kvpress-kernel must be an odd int")


def _peer_installed() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in PEER_MODULES)


@pytest.mark.slow
@pytest.mark.skipif(not _peer_installed(), reason="the optional [peer] extra (torch, transformers, kvpress) "
                                                  "is not installed: pip install 'page-local[peer]'")
def test_peer_smoke(cli):
    res = cli("bench", "peer", "--tokens", "512", "--n", "2", "--gen", "4", "--json")
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["bench"] == "peer" and r["n"] == 2 and len(r["rows"]) == 2
    assert r["page_local_s"] > 0 and r["kvpress_s"] > 0
    assert r["speedup"] == pytest.approx(r["kvpress_s"] / r["page_local_s"], rel=1e-2)
    for v in r["accuracy"].values():
        assert 0.0 <= v <= 1.0
    for row in r["rows"]:
        T = row["T"]
        assert T <= 512
        # the same budget on the same tokens: page-local B = int(0.25 T); kvpress int(0.25 (T-1)) + 1
        assert row["page-local_evicted"]["kept"] == int(0.25 * T)
        assert row["kvpress_evicted"]["kept"] == int(0.25 * (T - 1)) + 1
        assert row["page-local_full"]["kept"] == T and row["kvpress_full"]["kept"] == T
        # kvpress's own pipeline renders the same chat prompt page-local compresses
        assert row["kvpress_pipeline_query_agnostic"]["same_tokens"]

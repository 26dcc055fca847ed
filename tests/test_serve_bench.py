"""`page-local bench serve` at a tiny size (2 clients, 4 requests of 4 tokens): two real servers on
free loopback ports, the JSON fields it documents, 0 errors, and every greedy answer under load equal
to the same request served alone. The command is driven through click's CliRunner."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("starlette", reason="the [serve] extra is not installed")
pytest.importorskip("uvicorn", reason="the [serve] extra is not installed")
pytest.importorskip("sse_starlette", reason="the [serve] extra is not installed")

from page_local.cli.serve import bench_serve_cmd
from page_local.serve.bench import plan

FIELDS = {"clients", "requests", "max_tokens", "parallel", "n_ctx", "threads", "errors", "error_messages", "compared",
          "mismatches", "seeded_compared", "seeded_mismatches", "unmatched", "ttft_p50_s", "ttft_p95_s",
          "latency_p50_s", "latency_p95_s", "load_s", "load_tokens", "tokens_per_s", "alone_s", "alone_tokens",
          "alone_tokens_per_s", "prompt_tokens", "cached_tokens", "rss_first_bytes", "rss_load_bytes",
          "rss_end_bytes", "cache_first_bytes", "cache_load_bytes", "cache_end_bytes", "snapshots_end",
          "cache_cap_bytes", "second_round_growth_beyond_cache_bytes", "memory_ok"}


def test_the_plan_mixes_streams_gates_and_sampling():
    chats = plan(clients=8, requests=48)
    specs = [s for chat in chats for s in chat]
    assert [len(c) for c in chats] == [6] * 8 and [s.turn for s in chats[3]] == list(range(6))
    assert {s.stream for s in specs} == {True, False}
    assert {s.gate for s in specs} == {"never", "verify", "always", "page"}
    assert sum(s.temperature == 0 for s in specs) == 36


def test_bench_serve_json(smollm2_path, monkeypatch):
    monkeypatch.delenv("PAGE_LOCAL_MODEL", raising=False)
    monkeypatch.setenv("PAGE_LOCAL_PEER_BIN", "")  # the load test alone (the side by side: below)
    res = CliRunner().invoke(bench_serve_cmd, ["--clients", "2", "--requests", "4", "--max-tokens", "4",
                                               "--parallel", "2", "--n-ctx", "512", "--threads", "1", "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(r) == FIELDS
    assert r["errors"] == 0 and r["mismatches"] == 0 and r["unmatched"] == 0
    assert r["compared"] + r["seeded_compared"] == 4 and r["compared"] == 3
    assert r["ttft_p50_s"] is not None and r["tokens_per_s"] > 0 and r["load_tokens"] > 0
    assert r["cached_tokens"] > 0  # the second turns reused the first
    assert r["rss_first_bytes"] > 0 and r["memory_ok"] is True


def test_no_load_test_without_a_stock_server_says_how_to_build_one(smollm2_path, monkeypatch):
    monkeypatch.delenv("PAGE_LOCAL_MODEL", raising=False)
    monkeypatch.setenv("PAGE_LOCAL_PEER_BIN", "")
    res = CliRunner().invoke(bench_serve_cmd, ["--no-load-test", "--json"])
    assert res.exit_code == 2
    assert "no stock llama-server" in res.output and "make peer-server" in res.output
    assert "Traceback" not in res.output


def test_side_by_side_with_stock_llama_server(smollm2_path):
    """page-local serve and stock llama-server (build-peer/bin, `make peer-server`), 1 and 2 clients, at a
    tiny size: every request answered by every server, the ratios and the memory of 2 slots against one."""
    from page_local.bench.stock import find_bin
    from page_local.serve import peer

    bin_dir = find_bin()
    if bin_dir is None:
        pytest.skip("stock llama-server is not built (`make peer-server`)")
    r = peer.stock_comparison(smollm2_path, bin_dir, parallel=2, clients=(1, 2), reps=1, turns=2, max_tokens=4,
                              n_ctx=512, threads=1)
    assert set(r["runs"]) == {"page-local --parallel 2", "stock fa on", "stock fa off"}
    for run in r["runs"].values():
        for c in ("1", "2"):
            assert run[c]["tokens_per_s"] > 0 and run[c]["ttft_p50_s"] > 0
    for c in ("1", "2"):
        assert r["ratios"][c]["tokens_per_s_vs_stock_best"] > 0 and r["ratios"][c]["ttft_vs_stock_best"] > 0
    # one model for both slots: two slots hold one copy of the weights, so less than twice one slot's memory
    assert 1.0 < r["rss_parallel_vs_one"] < 2.0
    assert "1 client(s)" in peer.describe_stock(r)

"""`page-local run` and `page-local bench` through click's CliRunner on the embedded SmolLM2: answers
stream to stdout, --json is one object, every error is one line and an exit code, never a traceback;
every bench subcommand runs at a tiny size and prints the JSON fields it documents. `run`'s status
line is also checked on tests/fakes.py's FakeEngine (no model), word for word."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from dataclasses import fields

import pytest
from click.testing import CliRunner

from page_local.cli import main
from page_local.cli.bench import bench_group
from page_local.engine import Decision
from page_local.engine.turn import AFTER_ANSWER
from page_local.evictors import EVICTORS
from tests.conftest import one_line_error
from tests.fakes import FakeEngine, decision

PROMPT = "The capital of France is"
SMALL = ["--max-tokens", "4", "--n-ctx", "256", "--threads", "1"]


def test_run_streams_the_answer(cli):
    res = cli("run", "--prompt", PROMPT, "--raw", *SMALL)
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith(" Paris") and res.stdout.endswith("\n")
    footer = res.stderr.strip().splitlines()[-1]  # the default gate, verify, on a prompt within the budget
    assert footer.startswith("[full cache kept: ") and "; 4 tokens at " in footer and "; finish: length; " in footer
    res = cli("run", "--prompt", PROMPT, "--raw", "--gate", "page", *SMALL)
    assert res.stderr.strip().splitlines()[-1].startswith("[gate closed (D ")


def test_run_sends_the_prompt_as_a_user_message_in_the_chat_template(cli, smollm2_path):
    """As `ollama run` does: the prompt is the user's message in the model's template, the answer the assistant's (the
    same as a chat's first turn); --raw sends the text as it is, to continue."""
    from page_local.chat.session import ChatSession
    from page_local.engine.engine import Engine

    templated = json.loads(cli("run", "--prompt", PROMPT, "--json", "--gate", "never", *SMALL).stdout)
    raw = json.loads(cli("run", "--prompt", PROMPT, "--raw", "--json", "--gate", "never", *SMALL).stdout)
    with Engine(smollm2_path, n_ctx=256, threads=1, gate="never", autotune=False) as eng:
        turn = ChatSession(eng).send(PROMPT, max_tokens=4)
        text = "".join(turn)
    assert templated["decision"]["T"] == turn.decision.T > raw["decision"]["T"] + 10
    assert templated["text"] == text and raw["text"].startswith(" Paris")


def test_run_status_line_on_a_fake_engine(monkeypatch):
    """The stderr footer, word for word, for a turn whose self-verification refused the eviction."""
    eng = FakeEngine("fake.gguf")
    eng.enqueue([" Paris", ",", " France"], decision(
        T=1897, B=474, kept=1897, D=0.1109, open=True, gate_mode="verify", rule="forced", verify_m=3,
        verify_until="length", verify_rule="argmax", verify_score=1.0, verify_threshold=0.0), finish="length")
    monkeypatch.setattr("page_local.engine.engine.Engine", lambda *a, **kw: eng)
    res = CliRunner().invoke(main, ["run", "--model", "fake.gguf", "--prompt", PROMPT, "--raw", "--max-tokens", "3"])
    assert res.exit_code == 0, res.output
    assert res.stdout == " Paris, France\n" and eng.closed
    assert res.stderr == ("[verify refused: full cache of 1897 kept (1 changed top token > 0 over 3 tokens); "
                          "3 tokens at 50.0 tok/s; finish: length; layers and KV cache on CPU]\n")


def test_flags_reach_the_engine_as_values_never_through_the_environment(monkeypatch):
    """--flash-attn, --cache-type and --rpc are resolved once, at the CLI's edge (the flag, else its
    variable, else the default), and handed to the Engine as values; the environment is not written, not
    even while the command runs."""
    from page_local.defaults import CACHE_ENV, FLASH_ENV
    from page_local.engine.attention import AttentionSettings
    from page_local.native.rpc import RPC_ENV

    got = []

    def engine(*args, **kwargs):
        got.append((kwargs, dict(os.environ)))
        eng = FakeEngine("fake.gguf")
        eng.enqueue([" Paris"])
        return eng

    monkeypatch.setattr("page_local.engine.engine.Engine", engine)
    for var in (FLASH_ENV, CACHE_ENV, RPC_ENV):
        monkeypatch.delenv(var, raising=False)
    args = ["run", "--model", "fake.gguf", "--prompt", PROMPT, "--raw", "--max-tokens", "1"]

    def run(*extra):
        before = dict(os.environ)
        res = CliRunner().invoke(main, args + list(extra))
        assert res.exit_code == 0, res.output
        kwargs, during = got[-1]
        assert during == before == dict(os.environ)
        return kwargs["attention_settings"], kwargs["rpc"]

    assert run() == (AttentionSettings("auto", "f16"), ())
    assert run("--flash-attn", "off", "--cache-type", "q8_0", "--rpc", "127.0.0.1:50052") == \
        (AttentionSettings("off", "q8_0"), ("127.0.0.1:50052",))
    monkeypatch.setenv(FLASH_ENV, "on")
    monkeypatch.setenv(CACHE_ENV, "q4_0")
    monkeypatch.setenv(RPC_ENV, "10.0.0.2:50052,10.0.0.3:50052")
    assert run() == (AttentionSettings("on", "q4_0"), ("10.0.0.2:50052", "10.0.0.3:50052"))  # no flag: the variables
    assert run("--flash-attn", "auto", "--rpc", "127.0.0.1:50052") == \
        (AttentionSettings("auto", "q4_0"), ("127.0.0.1:50052",))  # a flag wins, "auto" included
    monkeypatch.setenv(CACHE_ENV, "q5_1")
    one_line_error(CliRunner().invoke(main, args), 2, "$PAGE_LOCAL_CACHE_TYPE", "'q5_1'")
    monkeypatch.setenv(RPC_ENV, "nowhere")
    one_line_error(CliRunner().invoke(main, args + ["--cache-type", "f16"]), 2, "$PAGE_LOCAL_RPC", "'nowhere'")


def test_serve_hands_the_flags_to_its_backend_as_values(smollm2_path, monkeypatch):
    pytest.importorskip("uvicorn", reason="the optional [serve] extra: pip install 'page-local[serve]'")
    from page_local.engine.attention import AttentionSettings

    class Loaded(Exception):
        pass

    def backend(settings):
        raise Loaded(settings, dict(os.environ))

    monkeypatch.setattr("page_local.serve.backend.Backend", backend)
    before = dict(os.environ)
    res = CliRunner().invoke(main, ["serve", "--model", str(smollm2_path), "--flash-attn", "off", "--cache-type",
                                    "f16", "--rpc", "127.0.0.1:50052"])
    assert isinstance(res.exception, Loaded), res.output
    settings, during = res.exception.args
    assert settings.attention_settings == AttentionSettings("off", "f16") and settings.rpc == ("127.0.0.1:50052",)
    assert during == before == dict(os.environ)


def test_run_json(cli, tmp_path):
    res = cli("run", "--prompt", PROMPT, "--raw", "--json", "--gate", "never", *SMALL)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert set(out) == {"text", "finish_reason", "decision", "tokens_per_s", "device", "attention"}
    assert set(out["decision"]) == {f.name for f in fields(Decision)}
    # untuned (the test's user directory is empty): the backend's default, said with its reason
    assert out["attention"]["source"] == "default" and out["attention"]["cache_type"] == "f16"
    assert out["attention"]["flash_attn"] == "on"  # the default on every backend (engine/attention.py)
    assert out["text"].startswith(" Paris") and out["finish_reason"] == "length" and out["tokens_per_s"] > 0
    assert out["decision"]["gate_mode"] == "never" and out["decision"]["kept"] == out["decision"]["T"]

    f = tmp_path / "prompt.txt"
    f.write_text(PROMPT, encoding="utf-8")
    from_file = json.loads(cli("run", "--prompt-file", str(f), "--raw", "--json", "--gate", "never", *SMALL).stdout)
    assert from_file["text"] == out["text"]


@pytest.mark.parametrize("budget, B", [("0.5", 120), ("64", 64)], ids=["ratio", "count"])
def test_run_budget_ratio_or_count(cli, budget, B):
    prompt = "The grass is green. The sky is blue. " * 24
    res = cli("run", "--prompt", prompt, "--raw", "--json", "--gate", "always", "--budget", budget, *SMALL)
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)["decision"]
    assert d["T"] == 241 and d["B"] == B and d["kept"] == B and d["evicted"]


@pytest.mark.parametrize("budget, needle", [
    ("1.5", "ratio must be in (0, 1]"), ("0", "count must be >= 1"), ("0.0", "ratio must be in"),
    ("-0.5", "ratio must be in"), ("10", "smaller than the 36 protected"), ("lots", "neither a ratio"),
], ids=["above-1", "zero", "zero-ratio", "negative", "below-protected", "text"])
def test_run_bad_budget(cli, budget, needle):
    one_line_error(cli("run", "--prompt", PROMPT, "--budget", budget, *SMALL), 2, "--budget", needle)


def test_run_model_errors(cli, tmp_path):
    one_line_error(cli("run", "--prompt", PROMPT, "--model", str(tmp_path / "nope.gguf"), *SMALL), 1,
                   "model file not found")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all" * 10)
    one_line_error(cli("run", "--prompt", PROMPT, "--model", str(bad), *SMALL), 1, "not a GGUF")


def test_run_context_full(cli):
    one_line_error(cli("run", "--prompt", "The grass is green. " * 80, "--on-full", "refuse", *SMALL), 1,
                   "the context is full")


def test_run_reads_a_prompt_longer_than_the_context_in_parts(cli):
    res = cli("run", "--prompt", "The grass is green. " * 80 + "What colour is the grass?", *SMALL)
    assert res.exit_code == 0, res.output
    assert "earlier tokens deleted to make room" in res.output and "read in" in res.output and "tokens held" in res.output, res.output


@pytest.mark.parametrize("args, needle", [
    ((), "exactly one of --prompt and --prompt-file"),
    (("--prompt", PROMPT, "--prompt-file", "x.txt"), "does not exist"),
    (("--prompt", "  \n"), "the prompt is empty"),
    (("--prompt-file", "/nonexistent/prompt.txt"), "does not exist"),
    (("--prompt", PROMPT, "--gate", "sometimes"), "'sometimes' is not one of"),
    (("--prompt", PROMPT, "--evictor", "snapky"), "'snapky' is not one of"),
    (("--prompt", PROMPT, "--temperature", "9"), "--temperature"),
], ids=["no-prompt", "both-prompts", "empty", "missing-file", "gate", "evictor", "temperature"])
def test_run_usage_errors(cli, args, needle):
    one_line_error(cli("run", *args, *SMALL), 2, needle)


def test_run_both_prompts(cli, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text(PROMPT)
    one_line_error(cli("run", "--prompt", PROMPT, "--prompt-file", str(f), *SMALL), 2, "exactly one of")


def test_run_binary_prompt_file(cli, tmp_path):
    f = tmp_path / "p.bin"
    f.write_bytes(b"\xff\xfe\x00binary")
    one_line_error(cli("run", "--prompt-file", str(f), *SMALL), 2, "not UTF-8")


@pytest.mark.parametrize("name", sorted(EVICTORS), ids=sorted(EVICTORS))
def test_run_every_evictor_is_accepted(cli, name):
    after_answer = bool(EVICTORS[name].needs & AFTER_ANSWER)  # lorekv-answer: only under a verify gate
    res = cli("run", "--prompt", "The grass is green. " * 12, "--evictor", name, "--gate",
              "verify" if after_answer else "always", "--json", *SMALL)
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)["decision"]
    if after_answer:  # scored by the answer at the check; committed or not, as the check says
        assert d["evictor"] == name and d["lookahead_ms"] > 0 and d["verify_forced"] > 0
        assert d["kept"] == (d["B"] if d["evicted"] else d["T"])
    else:
        assert d["evictor"] == name and d["evicted"] and d["kept"] == d["B"] < d["T"]


def _peer_installed() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "kvpress"))


# Every `bench` subcommand at a tiny size: (arguments, the JSON fields it documents, a check of their values).
# Speeds are not asserted: the suite runs on loaded machines; the fields and what they count are.
BENCHES = {
    "probe": (["--tokens", "64", "--repeats", "1"],
              {"tokens", "threads", "repeats", "unarmed_s", "armed_s", "ratio", "unarmed_runs", "armed_runs", "device"},
              lambda r: r["tokens"] == 64 and len(r["unarmed_runs"]) == len(r["armed_runs"]) == 1),
    "decode": (["--tokens", "160", "--new-tokens", "2", "--repeats", "1"],
               {"tokens", "budget", "kept", "new_tokens", "full_tok_s", "evicted_tok_s", "speedup", "gate_ms",
                "evict_ms", "compact_ms", "full_runs", "evicted_runs", "device", "attention", "stock_paths",
                "stock_source", "ttft_s", "stock_default_tok_s", "stock_best_tok_s", "stock_default_ttft_s",
                "stock_best_ttft_s", "full_vs_stock_best", "evicted_vs_stock_best", "evicted_vs_stock_default",
                "ttft_vs_stock_best", "ttft_vs_stock_default", "same_full_tokens_as_stock", "parked_tok_s",
                "parked_vs_evicted", "park_ms", "parked_runs"},
               lambda r: r["kept"] < r["tokens"] <= 160 and r["new_tokens"] == 2 and len(r["full_runs"]) == 1
               and len(r["parked_runs"]) == 1 and r["parked_tok_s"] > 0
               and r["gate_ms"] > 0 and set(r["stock_paths"]) == {"on", "off"}
               and "llama.cpp's attention kernels" in r["stock_source"]  # no peer build: tests set no PEER_BIN
               and r["stock_default_tok_s"] == r["stock_paths"]["on"]["decode_tok_s"]
               and r["stock_best_tok_s"] == max(p["decode_tok_s"] for p in r["stock_paths"].values())
               and r["stock_best_ttft_s"] == min(p["ttft_s"] for p in r["stock_paths"].values())
               and set(r["same_full_tokens_as_stock"]) == {"on", "off"}
               and r["attention"]["source"] == "default" and r["attention"]["flash_attn"] == "on"),
    "verify": (["--tokens", "256", "--m", "4", "--repeats", "1", "--n-gpu-layers", "0"],
               {"tokens", "m", "m_checked", "rule", "budget", "verify_ms", "prefill_ms", "ratio", "target_ratio",
                "device"},
               lambda r: r["rule"] == "argmax" and r["m"] == 4 and 1 <= r["m_checked"] <= 4 and r["tokens"] > 200
               and r["verify_ms"] > 0 and r["device"]["layers"] == "CPU" and r["device"]["gpu_layers"] == 0),
    "forced": (["--tokens", "128", "--repeats", "1"],
               {"tokens", "repeats", "prefill_ms", "prefill_ms_per_token", "chunk_ms", "ms_per_forced_token", "ratio",
                "device"},
               lambda r: r["tokens"] == 128 and list(r["ratio"]) == ["1", "4", "8", "16", "32", "64"]
               and all(ms > 0 and abs(r["ms_per_forced_token"][n] - ms / int(n)) < 1e-2 for n, ms in r["chunk_ms"].items())),
    "lorekv": (["--tokens", "256", "--futures", "1", "--lookahead-tokens", "4", "--repeats", "1"],
               {"tokens", "budget", "futures", "lookahead_tokens", "snapkv_ms", "lorekv_ms", "ratio", "lookahead_ms",
                "paper_ratio_range", "device"},
               lambda r: r["futures"] == 1 and r["lookahead_tokens"] == 4 and r["lookahead_ms"] > 0),
    "memory": (["--tokens", "256"],
               {"tokens", "compact", "page_local_peak_rss_mb", "stock_peak_rss_mb", "ratio", "n_ctx", "T",
                "kept_after_eviction", "free_cells_full_cache", "free_cells_after_eviction", "device"},
               lambda r: r["T"] == 256 and r["kept_after_eviction"] == 64
               and r["free_cells_after_eviction"] - r["free_cells_full_cache"] == 192),
    "peer": (["--tokens", "512", "--n", "1", "--gen", "2"],
             {"model", "n", "tokens", "budget", "page_local_s", "kvpress_s", "speedup", "page_local_kept",
              "kvpress_kept_per_kv_head", "accuracy", "rows", "page_local_device"},
             lambda r: r["n"] == len(r["rows"]) == 1 and all(0 <= v <= 1 for v in r["accuracy"].values())),
    "chat": (["--turns", "3", "--n-ctx", "256", "--outgrow", "2", "--gen", "4"],
             {"turns", "n_ctx", "full_n_ctx", "outgrow", "gen", "repeats", "conversation_tokens", "first_wall_turn",
              "full_fits_turns", "refusals", "ttft_ratio", "tok_s_ratio", "ttft_ratio_past_wall",
              "tok_s_ratio_past_wall", "per_turn", "device"},
             lambda r: len(r["per_turn"]) == 3 and r["refusals"] == 0 and r["full_fits_turns"] == 3
             and r["conversation_tokens"] > 256 and r["first_wall_turn"] is not None
             and all(t["page_local"]["cells"] < 256 < r["full_n_ctx"] for t in r["per_turn"])
             and r["ttft_ratio"] > 0 and r["tok_s_ratio"] > 0
             and r["stock_source"] is None and "stock" not in r["per_turn"][0]),  # tests set no stock build
    # a 1 100-token document: written by the first engine, restored by the next (the cache's minimum is 1 024)
    "disk": (["--tokens", "1100", "--repeats", "1"],
             {"bench", "model", "threads", "repeats", "cache_type", "rows"},
             lambda r: r["cache_type"] == "f16" and len(r["rows"]) == 1 and r["rows"][0]["tokens"] == 1100
             and all(r["rows"][0][k] > 0 for k in ("read", "first", "disk", "memory", "disk_bytes", "save_ms"))
             and "stock" not in r["rows"][0]),  # tests set no stock build
}
SLOW = {"peer": pytest.mark.slow, "memory": pytest.mark.slow, "disk": pytest.mark.slow}


def test_every_bench_subcommand_is_tested(cli):
    assert set(bench_group.commands) == set(BENCHES) | {"serve"}  # bench serve: tests/test_serve_bench.py
    res = cli("bench", "--help")
    assert res.exit_code == 0 and all(name in res.stdout for name in BENCHES)


@pytest.mark.parametrize("name", [pytest.param(n, marks=SLOW.get(n, ())) for n in BENCHES], ids=list(BENCHES))
def test_bench_json_at_a_tiny_size(cli, name, monkeypatch, tmp_path):
    monkeypatch.setenv("PAGE_LOCAL_PEER_BIN", str(tmp_path))  # no stock llama-server: bench decode's fallback
    if name == "peer" and not _peer_installed():
        pytest.skip("the optional [peer] extra (torch, transformers, kvpress) is not installed: "
                    "pip install 'page-local[peer]'")
    args, documented, check = BENCHES[name]
    res = cli("bench", name, *args, "--threads", "1", "--json")
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["bench"] == name and r["threads"] == 1
    assert documented <= set(r), sorted(documented - set(r))
    assert check(r), r


BENCH_FUNCTIONS = {"probe": "speed.probe_overhead", "decode": "speed.decode_speedup", "verify": "speed.verify_cost",
                   "forced": "speed.forced_cost", "lorekv": "speed.lorekv_overhead", "memory": "speed.peak_memory",
                   "peer": "peer.peer_benchmark", "chat": "chat.chat_speed", "disk": "diskcache.measure"}


@pytest.mark.parametrize("name", list(BENCH_FUNCTIONS), ids=list(BENCH_FUNCTIONS))
def test_bench_passes_its_load_options_down_as_values(name, monkeypatch):
    """Every benchmark gets --n-gpu-layers, --rpc, --flash-attn and --cache-type as arguments, the
    environment untouched."""
    from page_local.engine.attention import AttentionSettings

    assert set(BENCH_FUNCTIONS) == set(BENCHES)
    module, function = BENCH_FUNCTIONS[name].split(".")
    got = {}

    def bench(path, **kwargs):
        got.update(kwargs, environ=dict(os.environ))
        return {}

    monkeypatch.setattr(f"page_local.bench.{module}.{function}", bench)
    before = dict(os.environ)
    res = CliRunner().invoke(main, ["bench", name, "--model", "fake.gguf", "--json", "--n-gpu-layers", "2",
                                    "--rpc", "127.0.0.1:50052", "--flash-attn", "on", "--cache-type", "q8_0"])
    assert res.exit_code == 0, res.output
    assert got["attention_settings"] == AttentionSettings("on", "q8_0") and got["rpc"] == ("127.0.0.1:50052",)
    assert got["n_gpu_layers"] == 2 and got["environ"] == before == dict(os.environ)


def test_bench_memory_gives_its_child_processes_the_settings_as_arguments(monkeypatch):
    import subprocess

    from page_local.bench.speed import peak_memory
    from page_local.defaults import CACHE_ENV, FLASH_ENV
    from page_local.engine.attention import AttentionSettings
    from page_local.native.rpc import RPC_ENV

    calls = []

    def child(argv, **kwargs):
        calls.append((argv, kwargs))
        out = {"peak_rss_mb": 100.0, "n_ctx": 320, "T": 256, "kept": 64, "device": {"layers": "CPU"}}
        return subprocess.CompletedProcess(argv, 0, stdout=json.dumps(out) + "\n", stderr="")

    monkeypatch.setattr(subprocess, "run", child)
    peak_memory("m.gguf", tokens=256, attention_settings=AttentionSettings("off", "f16"),
                rpc=["127.0.0.1:50052", "127.0.0.1:50053"], park=True)
    assert [argv[-4:] for argv, _ in calls] == [["off", "f16", "127.0.0.1:50052,127.0.0.1:50053", "1"]] * 2
    assert all("env" not in kwargs for _, kwargs in calls)
    calls.clear()
    monkeypatch.setenv(FLASH_ENV, "on")  # a library caller's defaults: the environment, read here, once
    monkeypatch.setenv(CACHE_ENV, "q8_0")
    monkeypatch.delenv(RPC_ENV, raising=False)
    peak_memory("m.gguf", tokens=256)
    assert [argv[-4:] for argv, _ in calls] == [["on", "q8_0", "", "0"]] * 2


@pytest.mark.skipif(not (Path(__file__).resolve().parents[1] / "build-peer" / "bin" / "llama-server").is_file(),
                    reason="stock llama-server is not built: `make peer-server` (not part of `make test`)")
def test_bench_decode_against_stock_llama_server(cli):
    r = json.loads(cli("bench", "decode", "--tokens", "160", "--new-tokens", "4", "--repeats", "1", "--json").stdout)
    assert r["stock_source"].startswith("stock llama-server") and set(r["stock_paths"]) == {"on", "off"}
    assert all(p["ttft_s"] > 0 and p["decode_tok_s"] > 0 for p in r["stock_paths"].values())
    # the full cache on page-local's path (on) gives stock's greedy tokens on a clear prompt
    assert r["same_full_tokens_as_stock"]["on"], r


@pytest.mark.skipif(not (Path(__file__).resolve().parents[1] / "build-peer" / "bin" / "llama-server").is_file(),
                    reason="stock llama-server is not built: `make peer-server` (not part of `make test`)")
def test_bench_chat_against_stock_llama_server(cli):
    r = json.loads(cli("bench", "chat", "--turns", "3", "--n-ctx", "256", "--outgrow", "2", "--gen", "4",
                       "--threads", "1", "--json").stdout)
    assert r["stock_source"].startswith("stock llama-server")
    for t in r["per_turn"]:
        assert set(t["stock"]) == {"on", "off"} and all(s["ttft_s"] > 0 and s["tok_s"] > 0 for s in t["stock"].values())
        assert t["ttft_vs_stock_best"] > 0 and t["tok_s_vs_stock_best"] > 0
    # stock reuses the conversation it holds: from the second turn it reads the new message, not the whole chat
    reads = [t["stock"]["on"]["prompt_n"] for t in r["per_turn"]]
    assert reads[2] < reads[0] + reads[1], reads
    assert r["tok_s_vs_stock_best"] > 0 and r["stock_best_flash_attn"] in ("on", "off")


def test_bench_chat_says_what_the_check_did_each_turn(cli, monkeypatch, tmp_path):
    monkeypatch.setenv("PAGE_LOCAL_PEER_BIN", str(tmp_path))  # no stock llama-server: page-local's side only
    # a check of 8 tokens: the greedy summaries' lengths differ between CPU families (on AMD Zen 3 each ended inside
    # a 64-token check, so none ran), 8 is reached on every one
    r = json.loads(cli("bench", "chat", "--turns", "3", "--n-ctx", "512", "--outgrow", "0.6", "--gen", "130",
                       "--budget", "0.25", "--park", "--park-from", "0", "--repeats", "2", "--threads", "1",
                       "--verify-tokens", "8", "--json").stdout)
    checks = [t["page_local"]["checks"] for t in r["per_turn"]]
    assert all(len(c) == 2 and set(c) <= {"passed", "refused", "rested", "answer over", "would not pay", "none"} for c in checks), checks
    assert any("passed" in c or "refused" in c for c in checks), checks  # the check ran on a parked turn
    for t in r["per_turn"]:  # a turn parked exactly when its check passed
        assert (t["page_local"]["parked"] > 0) == (t["page_local"]["checks"][0] == "passed"), t


def test_bench_bad_input(cli):
    one_line_error(cli("bench", "decode", "--tokens", "100", "--budget", "1.0", "--threads", "1"), 2,
                   "nothing to evict")
    one_line_error(cli("bench", "decode", "--budget", "2"), 2, "--budget")
    one_line_error(cli("bench", "verify", "--n-gpu-layers", "x"), 2, "--n-gpu-layers")


def test_verify_tokens_sets_how_much_of_the_answer_verify_checks(cli):
    long_prompt = "The grass is green. " * 40 + "What colour is the grass?"
    args = ["--prompt", long_prompt, "--json", "--gate", "verify", "--max-tokens", "12", "--n-ctx", "512",
            "--threads", "1"]
    for m in (4, 9):
        res = cli("run", *args, "--verify-tokens", m)
        assert res.exit_code == 0, res.output
        d = json.loads(res.stdout)["decision"]
        assert d["T"] > d["B"] and d["verify_m"] == m, d  # the evicted cache was checked on exactly m tokens
    one_line_error(cli("run", *args, "--verify-tokens", "0"), 2, "--verify-tokens", "0")


def test_run_warns_when_the_calibration_pilot_had_other_prompt_lengths(cli, smollm2_path):
    """A profile calibrated on 3-4K-token prompts, a ~20-token prompt: the decision is made as usual
    and `run` says on stderr, after the answer, that the profile does not cover this length."""
    from page_local.store.gguf import model_identity
    from page_local.store.profiles import save_profile

    save_profile(model_identity(smollm2_path), 0.05, 0.02, 100, "test", pilot_tokens=(3000, 4000))
    res = cli("run", "--prompt", PROMPT, "--gate", "page", *SMALL)
    assert res.exit_code == 0, res.output
    lines = res.stderr.strip().splitlines()
    assert lines[-2].startswith("warning: this prompt has ") and "the calibration pilot had 3000-4000" in lines[-2]
    assert "--lengths" in lines[-2] and "calibrated" in lines[-1]
    assert "warning" not in res.stdout  # the answer stays clean
    d = json.loads(cli("run", "--prompt", PROMPT, "--gate", "page", "--json", *SMALL).stdout)["decision"]
    assert d["rule"] == "calibrated" and d["gate_note"] == lines[-2].removeprefix("warning: ")


def test_bench_verify_with_a_ladder_checks_the_smallest_rung_first(cli):
    res = cli("bench", "verify", "--tokens", "256", "--m", "4", "--repeats", "1", "--ladder", "1/4,1/2",
              "--threads", "1", "--json")
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["candidates"] == 2 and r["ladder"] == [0.25, 0.5] and r["verify_ms"] > 0 and r["ratio"] > 0
    # every check passes on this prompt: the smallest rung decodes the answer's tokens + the last prompt
    # token; the larger one only its first chunk (every rung's first chunk goes in one batch)
    assert r["prompt"] == "needle" and r["forced_mean"] == r["m_checked"] + 1 + min(4, r["m_checked"] + 1)


def test_bench_forced_says_what_a_forced_token_costs(cli):
    res = cli("bench", "forced", "--tokens", "128", "--repeats", "1", "--threads", "1")
    assert res.exit_code == 0, res.output
    assert "a forced token costs" in res.stdout and "in chunks of 64" in res.stdout and "prefill" in res.stdout


def test_bench_verify_on_task_prompts_decides_as_in_use(cli):
    res = cli("bench", "verify", "--tokens", "448", "--m", "8", "--repeats", "1", "--prompt", "tasks",
              "--ladder", "1/8,1/2", "--threads", "1", "--json")
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    # the prompts leave room for the task's answer, as `eval run --length` does
    assert r["prompt"] == "tasks" and 1 <= r["runs"] <= 5 and 256 <= r["tokens"] <= 448
    assert 0 < r["forced_mean"] <= 2 * (8 + 1) and r["ratio_max"] >= r["ratio"] > 0


def test_run_with_budget_search(cli):
    res = cli("run", "--prompt", "The grass is green. " * 30 + "What colour is the grass?", "--gate", "search",
              "--ladder", "1/8,1/2", "--max-tokens", "6", "--n-ctx", "512", "--threads", "1", "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)["decision"]
    assert d["gate_mode"] == "search" and [r["label"] for r in d["search"]] == ["1/8", "1/2"]
    assert d["evicted"] == any(r["passed"] for r in d["search"])
    one_line_error(cli("run", "--prompt", "Hi", "--gate", "search", "--ladder", "1/8,1/4,1/2,1,2", "--threads", "1"),
                   2, "--ladder")

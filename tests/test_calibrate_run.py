"""`page-local calibrate` on the built-in pilot, then `page-local run --json` with the stored profile,
as real processes on the embedded SmolLM2 under an empty PAGE_LOCAL_HOME (threads 1, n_ctx 2048).

Before calibration `run` uses the raw rule (z null); `calibrate` stores mu and sigma (numpy mean and
std, ddof 0, of its D values); afterwards `run` on the same prompt measures the same D and reports
rule "calibrated" with z = (D - mu)/sigma and open iff z >= the z threshold.

The built-in pilot's prompts are 1-3K tokens (only its 1024-token ones fit n_ctx 2048), so calibrating
is one long prefill per prompt on one thread, ~15-25 s each on a 2-core AMD EPYC: the test calibrates on
N_PILOT = 3 of them (calibrate's own default is 100): the needle and the two multi-key tasks, three distinct
drops for numpy's mean and std. That the rest of the pilot's cycle (vt, fwe, prose) fits n_ctx 2048 as
calibrate frames it is checked on the tokenizer (test_every_pilot_task_fits_the_test_context), without
a prefill.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

N_CTX = 2048
SMALL = ["--n-ctx", str(N_CTX), "--threads", "1"]
PAGE = ["--gate", "page"]  # run: the PAGE rule is what calibration changes (the default gate is verify)
FACTS = ("The lighthouse on Gull Island was built in 1874 by a crew of eleven masons from Aberdeen. Its lamp "
         "burned whale oil until 1902, then kerosene until 1931, when an electric lamp replaced it. The keeper's "
         "cottage has four rooms and a cellar where the oil barrels were stored. Three families kept the light "
         "over its history: the Morrisons until 1899, the Pattersons until 1946, and the Gillespies until the "
         "light was automated in 1978. The tower is 31 metres tall and has 142 steps. Its beam, white with a red "
         "sector over the reef to the south, can be seen 19 nautical miles away in clear weather. A fog bell was "
         "added in 1890 and replaced by a horn in 1925. The island has no trees, a small harbour on its eastern "
         "side, and a colony of puffins that nests on the northern cliffs every spring. ")
PROMPT = FACTS + "\n\nQuestion: in which year was the lighthouse automated? Answer with the year only."
N_PILOT = 3  # the built-in pilot cycles through 6 tasks (needle, multi-key x2, vt, fwe, prose): the first 3


def command() -> list[str]:
    """The installed console script next to this interpreter (or on PATH), else `python -m`."""
    script = Path(sys.executable).with_name("page-local")
    if not script.exists():
        script = Path(shutil.which("page-local") or "")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "page_local.cli"]


@pytest.fixture
def page_local(smollm2_path, tmp_path):
    """page_local(*args) -> the parsed JSON line of a successful command, under PAGE_LOCAL_HOME=tmp_path."""
    env = {k: v for k, v in os.environ.items() if k != "PAGE_LOCAL_MODEL"}
    env["PAGE_LOCAL_HOME"] = str(tmp_path)

    def run(*args, timeout=600):
        res = subprocess.run(command() + [str(a) for a in args], env=env, capture_output=True, text=True,
                             timeout=timeout, check=False)
        assert res.returncode == 0, res.stderr
        assert "Traceback" not in res.stderr
        lines = res.stdout.strip().splitlines()
        assert len(lines) == 1, res.stdout  # --json: one JSON object, nothing else on stdout
        return json.loads(lines[0]), res.stderr

    return run


def test_calibrate_then_run_reports_z(page_local, tmp_path):
    # no profile yet: the raw rule, no z
    before, _ = page_local("run", "--prompt", PROMPT, "--max-tokens", "4", *SMALL, *PAGE, "--json")
    d0 = before["decision"]
    assert d0["rule"] == "raw" and d0["z"] is None and d0["D"] is not None
    n_tokens = d0["T"]
    assert 150 <= n_tokens <= 400, n_tokens  # a ~200-token document and a question

    t0 = time.monotonic()
    cal, _ = page_local("calibrate", "--n", N_PILOT, *SMALL, "--json")
    print(f"calibrate --n {N_PILOT} on the built-in pilot: {time.monotonic() - t0:.1f} s")
    assert cal["n"] == N_PILOT and cal["prompts"] == N_PILOT
    assert cal["skipped_too_long"] == 0 and cal["skipped_empty"] == 0
    drops = np.asarray(cal["drops"], dtype=np.float64)
    assert drops.shape == (N_PILOT,) and np.isfinite(drops).all()
    mu, sigma = cal["mu"], cal["sigma"]
    assert mu == pytest.approx(float(drops.mean()), abs=1e-12)
    assert sigma == pytest.approx(float(drops.std()), abs=1e-12) and sigma > 0  # numpy std, ddof 0
    assert cal["raw_threshold"] == pytest.approx(mu + cal["z_threshold"] * sigma, abs=1e-12)

    profile = Path(cal["profile"])
    assert profile.parent == tmp_path / "profiles" and profile.name == f"{cal['model_id']}.json"
    stored = json.loads(profile.read_text(encoding="utf-8"))
    assert stored["mu"] == mu and stored["sigma"] == sigma and stored["n_pilot"] == N_PILOT
    assert stored["model_id"] == cal["model_id"]
    # only the 1024-token prompts of the built-in pilot fit n_ctx 2048; the profile records their span
    lo, hi = cal["pilot_tokens"]
    assert 700 <= lo <= hi <= 1024, cal["pilot_tokens"]
    assert stored["pilot_tokens"] == [lo, hi]

    # with the profile: the calibrated rule and z = (D - mu)/sigma
    out, err = page_local("run", "--prompt", PROMPT, "--max-tokens", "4", *SMALL, *PAGE, "--json")
    assert "warning" not in err  # the profile is valid for this model
    d = out["decision"]
    assert d["rule"] == "calibrated", d
    assert d["z"] is not None and d["D"] is not None
    assert d["z"] == pytest.approx((d["D"] - mu) / sigma, abs=1e-9)
    assert d["D"] == pytest.approx(d0["D"], abs=1e-9)  # the profile changes the rule, not the measurement
    assert d["gate_mode"] == "page" and d["T"] == n_tokens
    assert d["open"] == (d["z"] >= cal["z_threshold"])
    # a ~250-token prompt is far shorter than the pilot's: the decision says so (D shifts with length)
    assert f"this prompt has {n_tokens} tokens" in d["gate_note"] and f"{lo}-{hi}" in d["gate_note"]
    assert "--lengths" in d["gate_note"] and d["gate_note"] in d["reason"]
    assert out["finish_reason"] in ("stop", "length")
    assert isinstance(out["text"], str) and out["tokens_per_s"] >= 0


def test_every_pilot_task_fits_the_test_context(smollm2_path):
    """One full cycle of the built-in pilot (its six tasks at 1024 tokens), framed as calibrate frames it
    (chat template) and checked as calibrate checks it, fits n_ctx 2048: the test above measures only the
    first N_PILOT, and none of the others would have been skipped as too long."""
    from types import SimpleNamespace

    from page_local.eval.calibrate import builtin_pilot, chat_renderer
    from page_local.native.runtime import Model
    from page_local.tasks.synthetic import PILOT_MIX

    with Model(smollm2_path) as model:
        engine = SimpleNamespace(n_ctx=N_CTX, model=model)  # builtin_pilot reads these two
        prompts = builtin_pilot(engine, len(PILOT_MIX), render=chat_renderer(model))
        tokens = [len(model.tokenize(p, add_special=True)) for p in prompts]
    assert len(prompts) == len(PILOT_MIX) == 6
    assert all(700 <= t and t + 1 <= N_CTX for t in tokens), tokens  # calibrate's fit: tokens + 1 <= n_ctx
    assert all(t <= 1024 for t in tokens), tokens  # the 1024-token length only: 2048 + 128 > n_ctx

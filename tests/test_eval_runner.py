"""The evaluation runner, metrics and report on SmolLM2 (1 thread, ~400-token samples: nothing tested
depends on the length): one prefill per sample gives the same full-cache answer as Engine(gate="never"),
the copy/re-decode path without eviction reproduces the full cache, every (sample, configuration) has one
complete row, resuming adds nothing (and re-creates removed rows identically), metrics on hand-made rows
give known numbers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from page_local.cli import main
from page_local.eval import metrics
from page_local.eval.report import write_report
from page_local.chat.prompts import ChatPrompter
from page_local.eval.rows import FULL, KEY_FIELDS, read_rows, row_key
from page_local.engine import Engine
from page_local.eval.runner import _Run, load_samples, run_eval
from page_local.native.runtime import Model
from page_local.tasks.synthetic import generate
from page_local.evictors.base import Evictor
from page_local.gate import Gate
from page_local.verify import VERIFY_CAP, verify_score

THREADS = 1
LENGTH = 400  # niah: a ~270-token prompt beside its 128-token answer budget
VT_LENGTH = 1000
BUDGETS = (0.5, 0.125)
EVICTORS = ("snapkv", "random")
GATES = ("always", "page", "verify")
N_CONFIGS = 1 + len(BUDGETS) * len(EVICTORS) * len(GATES)
ROW_FIELDS = ("task", "index", "length", "T", "B", "evictor", "budget", "gate", "D", "z", "open", "kept",
              "compression", "prediction", "score", "correct", "nll_full", "nll_evicted", "delta_nll",
              "delta_self", "verify_open", "verify_rule", "verify_score", "verify_threshold", "verify_end",
              "verify_loss", "verify_changed", "timings", "evicted", "correct_full", "score_full", "page_open",
              "nll_candidate", "delta_nll_candidate", "correct_candidate", "correct_committed", "n_prompt",
              *KEY_FIELDS)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGE_LOCAL_HOME", str(tmp_path_factory.mktemp("home")))  # no calibration profile
    yield
    mp.undo()


def _run(out, task, n, **kw):
    args = dict(tasks=[task], n=n, length=LENGTH, budgets=BUDGETS, evictors=EVICTORS, gates=GATES, out=out,
                threads=THREADS)
    args.update(kw)
    return run_eval("smollm2", **args)


@pytest.fixture(scope="module")
def tiny(smollm2_path, home, tmp_path_factory):
    """(results file, [run_eval's results], progress calls of the first run, prompt lengths given to
    turn.Pipeline.prefill during the first run: niah_single_1, 2 samples x N_CONFIGS configurations)."""
    from page_local.engine import turn

    out = tmp_path_factory.mktemp("eval") / "tiny.jsonl"
    calls, prefills = [], []
    real = turn.Pipeline.prefill
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(turn.Pipeline, "prefill", lambda self, toks, *a, **k: prefills.append(len(toks)) or real(self, toks, *a, **k))
        r1 = _run(out, "niah_single_1", 2, progress=lambda d, t: calls.append((d, t)))
    r2 = _run(out, "vt", 1, length=VT_LENGTH)  # vt's in-context example needs ~930 tokens on SmolLM2
    return out, [r1, r2], calls, prefills


def test_every_sample_and_configuration_has_one_complete_row(tiny):
    out, results, calls, _ = tiny
    rows = read_rows(out)
    assert len(rows) == 3 * N_CONFIGS
    assert sum(r["rows_written"] for r in results) == 3 * N_CONFIGS
    assert calls[0] == (0, 2 * N_CONFIGS) and calls[-1] == (2 * N_CONFIGS, 2 * N_CONFIGS)
    assert len({row_key(r) for r in rows}) == len(rows)
    full_len = {(r["task"], r["index"]): r["timings"]["gen_tokens"] for r in rows if r["gate"] == FULL}
    for r in rows:
        missing = [f for f in ROW_FIELDS if f not in r]
        assert not missing, missing
        assert r["T"] == r["n_prompt"] and 0 < r["kept"] <= r["T"]
        assert r["compression"] == pytest.approx(r["T"] / r["kept"])
        assert isinstance(r["D"], float) and r["z"] is None  # no profile in this home
        assert np.isfinite(r["nll_full"]) and np.isfinite(r["nll_evicted"])
        assert r["delta_nll"] == pytest.approx(r["nll_evicted"] - r["nll_full"])
        if r["gate"] == FULL:
            assert r["evictor"] is None and r["budget"] is None and not r["evicted"]
            assert r["delta_nll"] == 0.0 and r["nll_evicted"] == r["nll_full"]  # budget-1.0 sanity
            assert r["prediction"] is not None and r["correct"] == r["correct_full"]
            continue
        assert r["B"] == max(40, int(r["T"] * r["budget"]))
        if r["gate"] == "always":
            assert r["open"] and r["evicted"] and r["kept"] == r["B"]
            assert r["delta_nll"] == r["delta_nll_candidate"] and r["correct"] == r["correct_candidate"]
        if r["gate"] == "page":
            assert r["open"] == r["page_open"] == (r["D"] >= 0.07)
        if r["gate"] == "verify":
            # the whole answer is checked (up to the cap), its end too when it ended in the span
            assert r["verify_m"] == VERIFY_CAP
            assert r["verify_tokens"] == min(full_len[(r["task"], r["index"])], VERIFY_CAP) >= 1
            loss = np.asarray(r["verify_loss"])
            assert loss.size == r["verify_tokens"] + r["verify_end"]
            assert r["delta_self"] == pytest.approx(loss.mean(), abs=1e-5)
            changed = np.zeros(loss.size, bool)
            changed[r["verify_changed"]] = True
            v = verify_score(loss, np.zeros(loss.size), changed, rule=r["verify_rule"], threshold=r["verify_threshold"])
            assert r["verify_score"] == pytest.approx(v.score, abs=1e-5)
            assert r["verify_open"] == v.passed == (r["verify_score"] <= r["verify_threshold"])
            assert r["open"] == r["verify_open"]
            if r["verify_open"] and r["verify_end"]:  # the whole answer passed: the user reads the full cache's
                assert r["prediction"] == next(x["prediction"] for x in rows if x["gate"] == FULL
                                               and (x["task"], x["index"]) == (r["task"], r["index"]))
        if not r["evicted"]:  # a closed gate is exactly the full cache
            assert r["kept"] == r["T"] and r["delta_nll"] == 0.0
            assert r["correct"] == r["correct_full"]
        t = r["timings"]
        assert t["prefill_ms"] > 0 and t["gen_ms"] >= 0 and t["nll_ms"] > 0 and t["verify_ms"] > 0


def test_the_samples_are_the_task_generators(tiny):
    rows = read_rows(tiny[0])
    assert sorted({(r["task"], r["index"]) for r in rows}) == [("niah_single_1", 0), ("niah_single_1", 1), ("vt", 0)]


def test_every_configuration_of_a_sample_shares_one_prefill_and_the_engine_agrees(smollm2_path, tiny):
    """The runner prefills each sample once (turn.Pipeline.prefill is counted, in the tiny fixture's first
    run), whatever the number of evictors, budgets and gates; and the D it records is the D Engine.measure
    finds on the same prompt."""
    out, (res, _), _, calls = tiny
    rows = [r for r in read_rows(out) if r["task"] == "niah_single_1"]
    assert len(rows) == 2 * (1 + 2 * 2 * 3) == 2 * N_CONFIGS and len(calls) == 2
    with Model(smollm2_path) as tok_model:
        prompter = ChatPrompter(tok_model)
        samples = load_samples(prompter, ["niah_single_1"], 2, LENGTH, 42, None)
        prompts = [prompter.prompt(s).tokens for s in samples]
    with Engine(smollm2_path, n_ctx=res["n_ctx"], threads=THREADS, gate="page") as eng:
        for i, toks in enumerate(prompts):
            D = {r["D"] for r in rows if r["index"] == i}
            assert len(D) == 1 and D.pop() == pytest.approx(eng.measure(toks).D, rel=1e-6)


def test_resuming_adds_no_rows_and_recreates_removed_rows_identically(tiny):
    out = tiny[0]
    before = out.read_text().splitlines()
    calls = []
    res = _run(out, "niah_single_1", 2, progress=lambda d, t: calls.append((d, t)))
    assert res["rows_written"] == 0 and res["samples_run"] == 0
    assert calls == [(2 * N_CONFIGS, 2 * N_CONFIGS)]
    assert out.read_text().splitlines() == before
    # drop the rows of one sample (niah_single_1[1]) plus a torn last line, then resume
    keep = [ln for ln in before if not (json.loads(ln)["task"] == "niah_single_1" and json.loads(ln)["index"] == 1)]
    removed = [json.loads(ln) for ln in before if ln not in keep]
    out.write_text("\n".join(keep) + "\n" + before[-1][:40])
    res = _run(out, "niah_single_1", 2)
    assert res["rows_written"] == N_CONFIGS
    again = [r for r in read_rows(out) if r["task"] == "niah_single_1" and r["index"] == 1]
    strip = lambda r: {k: v for k, v in r.items() if k != "timings"}  # noqa: E731
    assert [strip(r) for r in again] == [strip(r) for r in removed]  # greedy + deterministic
    out.write_text("\n".join(before) + "\n")


class KeepAll(Evictor):
    """Keeps every position: the candidate path (copy, evict nothing, re-decode) must equal the full cache."""

    name = "keep-all"
    needs = frozenset()

    def select(self, inp):
        return inp.held.copy()


def test_prefill_once_and_copies_match_the_engine_and_an_empty_eviction_changes_nothing(smollm2_path, home):
    from page_local.engine.engine import Engine

    with Engine(smollm2_path, n_ctx=1024, gate="never", threads=THREADS) as eng:
        prompter = ChatPrompter(eng.model)
        sample = generate("niah_single_1", 1, LENGTH, prompter.count_tokens, 42, start=1)[0]
        p = prompter.prompt(sample)
        ref = eng.generate(p.text, max_tokens=sample.max_new_tokens)
        run = _Run(eng, Gate("page"), {"keep-all": KeepAll()}, [0.5], ["always", "verify"], VERIFY_CAP, 42)
        rows = run.sample(p, {(None, None, FULL), ("keep-all", "0.5", "always"), ("keep-all", "0.5", "verify")})
        assert run.last_full.tokens == ref.tokens  # token for token
        assert len(eng.ctx.page.positions(1)) == 0  # sequence 1 is cleaned up
        assert len(eng.ctx.page.positions(0)) == p.n  # sequence 0 is untouched
    full = next(r for r in rows if r["gate"] == FULL)
    assert full["prediction"] == ref.text
    for r in rows:
        if r["gate"] == FULL:
            continue
        assert abs(r["delta_nll_candidate"]) < 0.05 and abs(r["delta_self"]) < 0.01
        assert r["verify_score"] < 0.05 and r["verify_changed"] == [] and r["verify_end"]
        assert r["verify_open"] and r["correct_candidate"] == full["correct"]


def test_query_agnostic_compresses_the_context_only(smollm2_path, home, tmp_path):
    out = tmp_path / "qa.jsonl"
    res = run_eval("smollm2", tasks=["niah_single_1"], n=1, length=LENGTH, budgets=(0.5,), evictors=("snapkv",),
                   gates=("always",), out=out, threads=THREADS, query_agnostic=True)
    rows = read_rows(out)
    assert res["rows_written"] == len(rows) == 2
    for r in rows:
        assert r["query_agnostic"] and r["T"] < r["n_prompt"]
    ev = next(r for r in rows if r["gate"] == "always")
    assert ev["kept"] == ev["B"] == max(40, int(ev["T"] * 0.5))


def test_report_writes_markdown_and_plots(tiny, tmp_path):
    md = write_report(tiny[0], tmp_path / "rep")
    text = md.read_text()
    assert "Accuracy vs budget" in text and "niah_single_1" in text and "AUROC" in text
    for run in ("run1_", "run2_"):  # two runs in the file (length targets LENGTH and VT_LENGTH)
        for png in ("accuracy_vs_budget.png", "D_by_task.png", "roc.png"):
            assert (tmp_path / "rep" / (run + png)).stat().st_size > 1000
            assert f"]({run + png})" in text
    runs = json.loads((tmp_path / "rep" / "summary.json").read_text())  # one run per length target
    assert sorted(r["n_samples"] for r in runs) == [1, 2] and text.count("## Run ") == 2


def test_report_with_a_profile_adds_the_calibrated_gate_and_refuses_another_models(tiny, tmp_path, monkeypatch):
    from page_local.store.profiles import save_profile

    monkeypatch.setenv("PAGE_LOCAL_HOME", str(tmp_path / "home"))  # the profiles stay out of the module's home
    rows = [json.loads(line) for line in Path(tiny[0]).read_text().splitlines()]
    model_id = rows[0]["model"]
    d = sorted({r["D"] for r in rows})
    mu, sigma = d[len(d) // 2], 0.01  # the median input sits at z = 0: open; the gate splits the inputs
    prof = save_profile(model_id, mu, sigma, 100, "test")
    res = CliRunner().invoke(main, ["eval", "report", str(tiny[0]), "--out", str(tmp_path / "r"), "--profile",
                                    str(prof), "--json"])
    assert res.exit_code == 0, res.output
    for s in json.loads(res.stdout):
        assert "page-z" in s["gates"] and s["profile"]["threshold_D"] == pytest.approx(mu - 0.6934 * sigma)
        opened = {o["task"]: o["open_rate"] for o in s["open_rates"] if o["gate"] == "page-z"}
        assert opened  # one open rate per task under the calibrated rule
    assert "PAGE (z)" in (tmp_path / "r" / "report.md").read_text()
    assert "Caution" not in (tmp_path / "r" / "report.md").read_text()  # no pilot lengths recorded: no claim
    # a profile whose pilot had far longer prompts: the report says the re-decision is off-length
    Ts = sorted({r["T"] for r in rows})
    for span, outside in (((Ts[-1] * 10, Ts[-1] * 20), len({(r["task"], r["index"]) for r in rows})),
                          ((Ts[0], Ts[-1]), 0)):
        far = save_profile(model_id, mu, sigma, 100, "test", pilot_tokens=span)
        out = tmp_path / f"len{span[0]}"
        res = CliRunner().invoke(main, ["eval", "report", str(tiny[0]), "--out", str(out), "--profile", str(far), "--json"])
        assert res.exit_code == 0, res.output
        summaries = json.loads(res.stdout)  # one per run in the file
        assert sum(s["profile"]["inputs_outside_pilot_lengths"] for s in summaries) == outside
        text = (out / "report.md").read_text()
        assert ("Caution: the pilot's prompts had" in text) == bool(outside)
        assert ("calibrate --lengths" in text) == bool(outside)
    other = save_profile("some-other-model", 0.0, 1.0, 100, "test")
    res = CliRunner().invoke(main, ["eval", "report", str(tiny[0]), "--out", str(tmp_path / "o"), "--profile", str(other)])
    assert res.exit_code == 1 and "belongs to model some-other-model" in res.stderr and "Traceback" not in res.output
    (tmp_path / "bad.json").write_text("{not json")
    res = CliRunner().invoke(main, ["eval", "report", str(tiny[0]), "--out", str(tmp_path / "b"), "--profile",
                                    str(tmp_path / "bad.json")])
    assert res.exit_code == 1 and "cannot read calibration profile" in res.stderr


def test_a_gzipped_results_file_reports_the_same_and_is_never_appended_to(tiny, tmp_path):
    import gzip

    gz = tmp_path / "rows.jsonl.gz"
    gz.write_bytes(gzip.compress(Path(tiny[0]).read_bytes()))
    assert read_rows(gz) == read_rows(tiny[0])
    a = json.loads((write_report(tiny[0], tmp_path / "a").parent / "summary.json").read_text())
    b = json.loads((write_report(gz, tmp_path / "b").parent / "summary.json").read_text())
    assert a == b
    with pytest.raises(ValueError, match="plain JSONL"):
        _run(gz, "niah_single_1", 1)
    (tmp_path / "bad.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="not a readable gzip file"):
        read_rows(tmp_path / "bad.gz")


def test_resuming_under_another_gate_rule_is_refused(tiny, tmp_path, monkeypatch):
    from page_local.store.profiles import save_profile

    out = tmp_path / "raw.jsonl"
    out.write_bytes(Path(tiny[0]).read_bytes())  # rows decided with the raw threshold
    model_id = json.loads(out.read_text().splitlines()[0])["model"]
    monkeypatch.setenv("PAGE_LOCAL_HOME", str(tmp_path / "home"))
    save_profile(model_id, 0.05, 0.02, 100, "test")
    before = out.read_bytes()
    with pytest.raises(ValueError, match="mix two gate rules"):
        _run(out, "niah_single_1", 3)  # one more sample to run: its PAGE rows would be calibrated
    assert out.read_bytes() == before
    assert _run(out, "niah_single_1", 2)["rows_written"] == 0  # nothing to add: no complaint
    _run(out, "niah_single_1", 3, gates=("always",))  # no PAGE rows wanted: resumes


def test_cli_report_and_usage_errors(tiny, tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["eval", "report", str(tiny[0]), "--out", str(tmp_path / "r"), "--json"])
    assert res.exit_code == 0, res.output
    assert sum(r["n_rows"] for r in json.loads(res.stdout)) == 3 * N_CONFIGS
    res = runner.invoke(main, ["eval", "report", str(tmp_path / "missing.jsonl")])
    assert res.exit_code == 2 and "no such results file" in res.stderr
    for args, needle in ((["--tasks", "nope"], "unknown task"), (["--tasks", "vt", "--gates", "sometimes"], "gate"),
                         (["--tasks", "vt", "--evictors", "x"], "evictor"), (["--tasks", "vt", "--budgets", "2.5"], "budget"),
                         ([], "--tasks")):
        res = runner.invoke(main, ["eval", "run", *args])
        assert res.exit_code == 2, (args, res.output)
        assert needle in res.output and "Traceback" not in res.output


# --- metrics on hand-made rows ----------------------------------------------------------------------

def test_auroc_known_values():
    assert metrics.auroc([0.9, 0.8, 0.1, 0.2], [1, 1, 0, 0]) == 1.0
    assert metrics.auroc([0.1, 0.2, 0.9, 0.8], [1, 1, 0, 0]) == 0.0
    assert metrics.auroc([0.5, 0.5, 0.5, 0.5], [1, 0, 1, 0]) == 0.5
    assert metrics.auroc([0.3, 0.5, 0.5, 0.1], [1, 1, 0, 0]) == pytest.approx(0.625)  # 2.5 of 4 pairs
    assert metrics.auroc([0.1, 0.2], [1, 1]) is None and metrics.auroc([], []) is None
    assert metrics.auroc([None, 0.2, 0.1], [0, 1, 0]) == 1.0  # missing scores are dropped
    fpr, tpr = metrics.roc_curve([0.9, 0.8, 0.1, 0.2], [1, 1, 0, 0])
    assert fpr[0] == tpr[0] == 0 and fpr[-1] == tpr[-1] == 1 and tpr[np.argmax(fpr > 0)] == 1


def _row(index, task, gate, evictor, budget, correct, correct_full, dnll, D, dself=None, kept=64, T=128,
         is_open=True):
    evicted = gate != FULL and is_open
    return dict(model="m", source="generated", task=task, index=index, length_target=600, seed=42,
                query_agnostic=False, verify_m=16, evictor=evictor, budget=budget, gate=gate, D=D, z=None,
                T=T, kept=kept if evicted else T, open=is_open if gate != FULL else False, evicted=evicted,
                correct=correct, score=float(correct), correct_full=correct_full, delta_nll=dnll if evicted else 0.0,
                delta_nll_candidate=None if gate == FULL else dnll, correct_candidate=None if gate == FULL else correct,
                delta_self=dself, page_open=D >= 0.07, verify_open=None if dself is None else dself <= 0.05,
                timings={"sample_s": 1.0, "prefill_ms": 10.0, "gate_ms": 1.0})


def test_metrics_on_hand_made_rows():
    rows = []
    # sample 0: right with the full cache, harmed at both budgets (capacity-bound), low D, high delta_self
    # sample 1: right, harmed only at 0.125 (dilution-prone)
    # sample 2: right, never harmed; sample 3: wrong with the full cache
    spec = {0: (True, {0.5: (False, 5.0, 0.9), 0.125: (False, 9.0, 1.5)}, 0.01),
            1: (True, {0.5: (True, 0.1, 0.01), 0.125: (False, 3.0, 0.6)}, 0.05),
            2: (True, {0.5: (True, 0.0, 0.0), 0.125: (True, 0.2, 0.02)}, 0.09),
            3: (False, {0.5: (False, 0.5, 0.03), 0.125: (False, 2.0, 0.04)}, 0.08)}
    for i, (full_ok, per_b, D) in spec.items():
        rows.append(_row(i, "t", FULL, None, None, full_ok, full_ok, 0.0, D))
        for b, (ok, dn, ds) in per_b.items():
            rows.append(_row(i, "t", "always", "snapkv", b, ok, full_ok, dn, D, ds, kept=int(128 * b)))
    acc = {(a["gate"], a["budget"]): a["accuracy"] for a in metrics.accuracy(rows)}
    assert acc[(FULL, None)] == 0.75 and acc[("always", 0.5)] == 0.5 and acc[("always", 0.125)] == 0.25
    h = {x["budget"]: x for x in metrics.harm(rows)}
    assert h[0.5]["harm_rate"] == pytest.approx(1 / 3) and h[0.125]["harm_rate"] == pytest.approx(2 / 3)
    assert h[0.125]["harm_rate_nll"] == 0.75 and h[0.5]["n_harmed_nll"] == 1
    cls = metrics.classes(rows)
    by = {sid[3]: c for (sid, ev), c in cls.items()}
    assert by[0]["by_correct"] == "capacity-bound" and by[1]["by_correct"] == "dilution-prone"
    assert by[2]["by_correct"] == "dilution-prone" and by[3]["by_correct"] is None
    assert by[0]["by_nll"] == "capacity-bound" and by[3]["by_nll"] == "dilution-prone"
    ch = {(x["definition"], x["klass"]): x for x in metrics.class_harm(rows, cls)}
    assert ch[("by_correct", "capacity-bound")]["harm_rate"] == 1.0
    assert ch[("by_correct", "dilution-prone")]["harm_rate"] == 0.25
    comp = {(c["gate"], c["budget"]): c for c in metrics.compression(rows)}
    assert comp[("always", 0.5)]["compression"] == 2.0 and comp[("always", 0.125)]["kept_fraction"] == 0.125
    assert comp[(FULL, None)]["compression"] == 1.0 and comp[(FULL, None)]["open_rate"] == 0.0
    au = {(a["signal"], a["target"], a["budget"]): a for a in metrics.aurocs(rows)}
    # by correctness at 0.125: harmed = samples 0, 1 (D 0.01, 0.05), unharmed = 2 (D 0.09): -D separates them
    assert au[("-D", "harm_by_correct", 0.125)]["auroc"] == 1.0
    assert au[("delta_self", "harm_by_correct", "all")]["auroc"] == 1.0
    assert au[("-D", "harm_by_correct", 0.5)]["auroc"] == 1.0 and au[("-D", "harm_by_correct", 0.5)]["n_pos"] == 1
    assert au[("-D", "capacity_by_correct", None)]["auroc"] == 1.0
    s = metrics.summarize(rows)
    assert s["n_samples"] == 4 and s["budgets"] == [0.5, 0.125] and s["gates"] == [FULL, "always"]


def test_regate_re_decides_page_from_D_between_the_two_evaluated_caches():
    rows = []
    # D 0.01, 0.05, 0.09: under mu 0.05, sigma 0.02 -> z -2 (closed), 0 and 2 (open)
    for i, (D, ok, dn) in enumerate(((0.01, False, 5.0), (0.05, True, 0.1), (0.09, False, 3.0))):
        full = _row(i, "t", FULL, None, None, True, True, 0.0, D)
        full.update(prediction="right", finish="stop", nll_evicted=1.0)
        plain = _row(i, "t", "always", "snapkv", 0.5, ok, True, dn, D, kept=64)
        plain.update(prediction="x" if not ok else "right", finish="stop", nll_evicted=1.0 + dn)
        rows += [full, plain]
    z = metrics.regate(rows, mu=0.05, sigma=0.02)
    assert [r["gate"] for r in z] == ["page-z"] * 3 and [r["z"] for r in z] == pytest.approx([-2.0, 0.0, 2.0])
    closed, open1, open2 = z
    assert not closed["open"] and not closed["evicted"] and closed["correct"] and closed["kept"] == closed["T"]
    assert closed["delta_nll"] == 0.0 and closed["prediction"] == "right" and closed["delta_nll_candidate"] == 5.0
    assert open1["open"] and open1["kept"] == 64 and open1["correct"] and open2["open"] and not open2["correct"]
    ch = {(x["klass"], x["gate"]): x for x in metrics.class_harm(rows + z) if x["definition"] == "by_correct"}
    # capacity-bound (wrong at the only budget): samples 0 (closed: kept whole) and 2 (opened: harmed)
    assert ch[("capacity-bound", "always")]["harm_rate"] == 1.0 and ch[("capacity-bound", "page-z")]["harm_rate"] == 0.5
    assert ch[("capacity-bound", "page-z")]["open_rate"] == 0.5 and ch[("dilution-prone", "page-z")]["open_rate"] == 1.0
    assert metrics.calibrated_threshold(rows + z) == pytest.approx(0.05 - 0.6934 * 0.02)
    with pytest.raises(ValueError, match="sigma > 0"):
        metrics.regate(rows, 0.05, 0.0)
    with pytest.raises(ValueError, match="gate 'always'"):
        metrics.regate([r for r in rows if r["gate"] == FULL], 0.05, 0.02)


def _check_search_rows(rows: list[dict], ladder: list[float]) -> dict[tuple, list[dict]]:
    """The search test's checks on one results file (one search ladder); returns each sample's verify
    rows that passed (evicted), smallest budget first."""
    passed_by = {}
    for (task, index) in {(r["task"], r["index"]) for r in rows}:
        mine = [r for r in rows if (r["task"], r["index"]) == (task, index)]
        verify = sorted((r for r in mine if r["gate"] == "verify"), key=lambda r: r["B"])
        full = next(r for r in mine if r["gate"] == FULL)
        search = next(r for r in mine if r["gate"] == "search")
        passed = [r for r in verify if r["evicted"]]
        passed_by[(task, index)] = passed
        assert search["budget"] == ladder
        assert [x["passed"] for x in search["search"]] == [bool(r["verify_open"]) for r in verify]
        if passed:
            assert search["evicted"] and search["B"] == passed[0]["B"] and search["kept"] == passed[0]["kept"]
            assert search["prediction"] == passed[0]["prediction"]
        else:
            assert not search["evicted"] and search["prediction"] == full["prediction"] and search["kept"] == search["T"]
        ps = next(r for r in mine if r["gate"] == "page+search")
        assert ps["evicted"] == (search["evicted"] and full["page_open"])
        # the check's cost as the engine pays it: every rung's first chunk in one batch, then the rungs
        # smallest first, up to the committed one
        checked = [r for r in verify if r["verify_forced"]]
        upto = checked[: checked.index(passed[0]) + 1] if passed else checked
        first = min(4, checked[0]["verify_tokens"] + 1) if checked else 0
        extra = first * (len(checked) - len(upto)) if len(checked) > 1 else 0
        assert search["search_forced"] == sum(r["verify_forced"] for r in upto) + extra
        for r in verify:  # a candidate stops at the chunk of its first changed top token
            n = r["verify_tokens"] + 1  # the last prompt token and the answer
            assert r["verify_forced"] == (n if not r["verify_changed"] else
                                          next(min(e, n) for e in (4, 12, 28, 60, 124) if e > r["verify_changed"][0]))
    return passed_by


def test_search_rows_commit_the_smallest_budget_whose_verify_row_passed(smollm2_path, home, tmp_path):
    # niah_single_1 at 450 tokens (T ~310, a 9-token answer): snapkv's candidates keep the full cache's answer
    # (argmax rule: no top token changed) only near the full cache: on sample 0 at 0.9 only, on sample 1 at
    # 0.75 and 0.9; at 0.25 on neither (7 of its 9 top tokens changed)
    ladder = [0.25, 0.75, 0.9]
    run_eval(smollm2_path, tasks=["niah_single_1"], n=2, length=450, budgets=ladder, evictors=["snapkv"],
             gates=["verify", "search", "page+search"], out=tmp_path / "rows.jsonl", threads=THREADS)
    checked = _check_search_rows(read_rows(tmp_path / "rows.jsonl"), ladder)
    passed = {k: [r["budget"] for r in p] for k, p in checked.items()}  # each sample's passing rungs
    assert sorted(passed) == [("niah_single_1", 0), ("niah_single_1", 1)]
    # a rung passed on every sample, above a failing one: search committed a rung, not the first
    assert all(p and p[0] != ladder[0] for p in passed.values()), passed
    # and on one sample two rungs passed: the smaller is the one committed (checked above)
    assert any(len(p) >= 2 for p in passed.values()), passed
    # a ladder on which no rung passes (sample 0 at 0.0625 and 0.5): search keeps the full cache
    ladder = [0.0625, 0.5]
    run_eval(smollm2_path, tasks=["niah_single_1"], n=1, length=450, budgets=ladder, evictors=["snapkv"],
             gates=["verify", "search", "page+search"], out=tmp_path / "none.jsonl", threads=THREADS)
    assert _check_search_rows(read_rows(tmp_path / "none.jsonl"), ladder) == {("niah_single_1", 0): []}


def test_lorekv_answer_rows_are_scored_by_the_full_cache_answer(smollm2_path, home, tmp_path):
    out = tmp_path / "rows.jsonl"
    with pytest.raises(ValueError, match="only the verify and search gates"):
        run_eval(smollm2_path, tasks=["niah_single_1"], n=1, length=LENGTH, budgets=[0.25], evictors=["lorekv-answer"],
                 gates=["always", "verify"], out=out, threads=THREADS)
    run_eval(smollm2_path, tasks=["niah_single_1"], n=2, length=LENGTH, budgets=[0.125, 0.5],
             evictors=["lorekv-answer"], gates=["verify", "search"], out=out, threads=THREADS)
    rows = read_rows(out)
    ver = [r for r in rows if r["gate"] == "verify"]
    assert len(ver) == 4 and all(r["evictor"] == "lorekv-answer" for r in ver)
    # one scoring per input, shared by its budgets, and every candidate was checked
    assert all(r["timings"]["lookahead_ms"] > 0 and r["verify_tokens"] >= 1 for r in ver)
    assert len({(r["index"], r["timings"]["lookahead_ms"]) for r in ver}) == 2

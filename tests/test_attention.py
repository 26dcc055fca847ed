"""The attention path and cache type: page-local's choice (engine/attention.py), the stored tuning
(store/tuning.py), `page-local tune`, --flash-attn / --cache-type, and every pipeline step on each offered
(flash attention, cache type) pair on the embedded model."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from page_local.engine import attention
from page_local.store import tuning as store
from tests.conftest import one_line_error

# fake timings (T, prefill ms/token, decode ms): flash attention wins short caches, loses long ones
ON = [(256, 10.0, 18.0), (1024, 10.5, 26.0), (2048, 11.0, 45.0)]
OFF = [(256, 14.0, 21.0), (1024, 14.5, 24.0), (2048, 15.0, 31.0)]


# --- the decision, pure ----------------------------------------------------------------------

def test_decide_weighs_decode_over_the_whole_context():
    assert attention.decide({"on": ON, "off": OFF}, 4096)[0] == "off"
    pick, why = attention.decide({"on": ON, "off": OFF}, 256)
    assert pick == "on" and "0-256 cells" in why
    assert "extrapolated past the 2048 cells" in attention.decide({"on": ON, "off": OFF}, 8192)[1]


def test_a_tie_goes_to_the_faster_prompt_reader():
    same = [(t, p, d) for t, p, d in OFF]
    faster_reading = [(t, p - 1.0, d + 1.0) for t, p, d in OFF]  # the same cost, read faster
    pick, why = attention.decide({"on": faster_reading, "off": same}, 2048)
    assert pick == "on" and "a tie" in why


def test_cost_curve_is_measured_between_points_and_never_falls_past_them():
    t = np.array([100.0, 256.0, 640.0, 2048.0, 4096.0])
    c = attention.cost_curve(ON, t)
    assert c[0] == c[1] == 28.0  # constant below the first point
    assert c[2] == pytest.approx(28.0 + (36.5 - 28.0) * (640 - 256) / (1024 - 256))
    slope = np.polyfit([256, 1024, 2048], [28.0, 36.5, 56.0], 1)[0]  # all the points, not the last segment
    assert c[3] == 56.0 and c[4] == pytest.approx(56.0 + slope * 2048)
    falling = [(256, 10.0, 30.0), (1024, 10.0, 20.0)]
    assert attention.cost_curve(falling, np.array([4096.0]))[0] == 30.0 - 10.0 + 10.0  # held at the last point


def test_bands_name_a_winner_per_length():
    b = attention.bands({"on": ON, "off": OFF}, 4096)
    assert [(x["from"], x["to"]) for x in b] == [(0, 1024), (1024, 2048), (2048, 4096)]
    assert b[0]["flash_attn"] == "on" and b[-1]["flash_attn"] == "off"


@pytest.mark.parametrize("fa, ct, device, tuned, want, source", [
    ("auto", "f16", "CPU", None, "on", "default"),
    ("auto", "f16", "NVIDIA H100", None, "on", "default"),
    ("auto", "f16", "CPU", {"on": ON, "off": OFF}, "off", "tuned"),
    ("auto", "q8_0", "CPU", None, "on", "cache type"),
    ("on", "f16", "CPU", {"on": ON, "off": OFF}, "on", "requested"),
    ("off", "f16", "CPU", None, "off", "requested"),
], ids=["cpu-default", "gpu-default", "tuned", "quantized-v", "asked-on", "asked-off"])
def test_resolve(fa, ct, device, tuned, want, source):
    a = attention.resolve(fa, ct, device, 4096, tuned)
    assert (a.flash_attn, a.cache_type, a.source) == (want, ct, source)


def test_a_quantized_cache_without_flash_attention_is_refused_in_one_sentence():
    with pytest.raises(ValueError, match="q4_0 quantizes the V cache.*flash attention on"):
        attention.resolve("off", "q4_0", "CPU", 4096, None)
    with pytest.raises(ValueError, match="must be one of auto, on, off; got 'yes'"):
        attention.resolve("yes", "f16", "CPU", 4096, None)


def test_the_environment_fills_what_was_not_asked(monkeypatch):
    monkeypatch.setenv(attention.FLASH_ENV, "ON")
    monkeypatch.setenv(attention.CACHE_ENV, "q8_0")
    assert attention.from_environment() == attention.AttentionSettings("on", "q8_0")
    # given values win, "auto" included: it is asked for, not left out
    assert attention.from_environment("auto", "f16") == attention.AttentionSettings("auto", "f16")
    assert attention.from_environment("off", None) == attention.AttentionSettings("off", "q8_0")
    monkeypatch.setenv(attention.FLASH_ENV, "fast")
    with pytest.raises(ValueError, match=r"\$PAGE_LOCAL_FLASH_ATTN must be one of"):
        attention.from_environment()
    monkeypatch.delenv(attention.FLASH_ENV)
    monkeypatch.delenv(attention.CACHE_ENV)
    assert attention.from_environment() == attention.AttentionSettings("auto", "f16")


def test_attention_settings_are_checked_values():
    with pytest.raises(ValueError, match="flash_attn must be one of auto, on, off; got 'yes'"):
        attention.AttentionSettings("yes")
    with pytest.raises(ValueError, match="cache type must be one of f16, q8_0, q4_0; got 'q5_1'"):
        attention.AttentionSettings("on", "q5_1")
    with pytest.raises(AttributeError):
        attention.AttentionSettings().flash_attn = "on"  # frozen: passed down as a value


def test_an_engines_arguments_read_the_environment_only_for_what_was_not_given(monkeypatch):
    monkeypatch.setenv(attention.FLASH_ENV, "off")
    monkeypatch.setenv(attention.CACHE_ENV, "q4_0")
    given = attention.AttentionSettings("on", "q8_0")
    assert attention.engine_settings(given, None, None) is given  # resolved by the caller: the environment unread
    assert attention.engine_settings(None, "on", None) == attention.AttentionSettings("on", "q4_0")
    assert attention.engine_settings(None, None, None, type_kv="f16") == attention.AttentionSettings("off", "f16")
    assert attention.engine_settings(None, None, "q8_0", type_kv="q8_0").cache_type == "q8_0"
    with pytest.raises(ValueError, match="type_kv is the older name of cache_type"):
        attention.engine_settings(None, None, "q8_0", type_kv="f16")
    with pytest.raises(ValueError, match="not both"):
        attention.engine_settings(given, "off", None)
    with pytest.raises(ValueError, match="must be an AttentionSettings"):
        attention.engine_settings(("on", "f16"), None, None)


# --- the store -------------------------------------------------------------------------------

def _key(**kw):
    base = dict(model_id="llama-0123456789abcdef", machine="x86_64 Test CPU [00000000]", device="CPU", threads=2,
                library="feedfacefeedface")
    base.update(kw)
    return store.TuningKey(**base)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGE_LOCAL_HOME", str(tmp_path))
    return tmp_path


def test_a_tuning_is_stored_and_read_back(home):
    t = store.Tuning(_key(), {"on": ON, "off": OFF}, store.now(), 12.5)
    path = store.save_tuning(t)
    assert path.parent == home / "tuning"
    got = store.read_tuning(_key())
    assert got.warning is None and got.tuning.points == {"on": ON, "off": OFF}


@pytest.mark.parametrize("change", [dict(threads=1), dict(library="0000000000000000"),
                                    dict(model_id="qwen2-0123456789abcdef"), dict(machine="arm64 Other [1]")],
                         ids=["threads", "library", "model", "machine"])
def test_a_tuning_is_not_reused_for_another_setting(home, change):
    store.save_tuning(store.Tuning(_key(), {"on": ON, "off": OFF}, store.now(), 1.0))
    got = store.read_tuning(_key(**change))
    assert got.tuning is None and got.warning is None


@pytest.mark.parametrize("text, needle", [
    ("{not json", "unreadable attention tuning"),
    ('{"format": "page-local-profile"}', "format field missing"),
    ('{"format": "page-local-tuning", "version": 1, "key": null}', "measured for another"),
    ('[1, 2]', "format field missing"),
], ids=["corrupt", "another-format", "foreign-key", "not-an-object"])
def test_an_unusable_tuning_file_is_ignored_with_a_warning(home, text, needle):
    path = store.tuning_path(_key())
    path.parent.mkdir(parents=True)
    path.write_text(text)
    got = store.read_tuning(_key())
    assert got.tuning is None and needle in got.warning


def test_malformed_points_are_refused_by_name(home):
    store.save_tuning(store.Tuning(_key(), {"on": ON, "off": OFF}, store.now(), 1.0))
    path = store.tuning_path(_key())
    data = json.loads(path.read_text())
    data["points"]["off"] = [[1024, 1.0, 2.0], [256, 1.0, -3.0]]
    path.write_text(json.dumps(data))
    got = store.read_tuning(_key())
    assert got.tuning is None and "decode ms > 0" in got.warning


# --- real runs on the embedded model -----------------------------------------------------------

@pytest.fixture
def meter_off(monkeypatch):
    """The suite's other worker shares this machine's cores: a test of storing and reusing a tuning does not
    also test the busy check (test_a_tuning_measured_beside_busy_processes_is_not_kept does)."""
    monkeypatch.setattr(attention, "BUSY_CORES", float("inf"))


def test_tune_measures_stores_and_auto_uses_it(cli, meter_off):
    res = cli("tune", "--lengths", "48,96", "--n-ctx", "1024", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["tuned"] and out["auto"]["source"] == "tuned" and out["others_cores"] >= 0
    assert [p[0] for p in out["points"]["on"]] == [48, 96] == [p[0] for p in out["points"]["off"]]
    assert all(p[1] > 0 and p[2] > 0 for s in ("on", "off") for p in out["points"][s])
    shown = json.loads(cli("tune", "--show", "--n-ctx", "1024", "--json").stdout)
    assert shown["points"] == out["points"] and shown["auto"] == out["auto"]
    ran = cli("run", "--prompt", "Say hi.", "--max-tokens", "2", "--n-ctx", "1024", "--json")
    assert ran.exit_code == 0, ran.output
    assert json.loads(ran.stdout)["attention"] == out["auto"]
    asked = json.loads(cli("run", "--prompt", "Say hi.", "--max-tokens", "2", "--n-ctx", "1024",
                           "--flash-attn", "on", "--json").stdout)
    assert asked["attention"]["flash_attn"] == "on" and asked["attention"]["source"] == "requested"
    assert json.loads(cli("tune", "--forget", "--json").stdout) == {"removed": True}
    untuned = json.loads(cli("run", "--prompt", "Say hi.", "--max-tokens", "2", "--n-ctx", "1024", "--json").stdout)
    assert untuned["attention"]["source"] == "default" and untuned["attention"]["flash_attn"] == "on"


def test_first_use_tuning_is_measured_once_in_its_time_box_and_then_reused(cli, monkeypatch, meter_off):
    # the suite runs with $PAGE_LOCAL_AUTOTUNE=off (conftest); a user's first run measures, in a box of 8 s here
    monkeypatch.setenv("PAGE_LOCAL_AUTOTUNE", "8")
    first = cli("run", "--prompt", "Say hi.", "--max-tokens", "2", "--n-ctx", "1024", "--json")
    assert first.exit_code == 0, first.output
    a = json.loads(first.stdout)["attention"]
    assert a["source"] == "tuned" and "first use" in a["why"], a
    assert "measuring this machine's attention paths" in first.stderr
    shown = json.loads(cli("tune", "--show", "--n-ctx", "1024", "--json").stdout)
    lengths = [p[0] for p in shown["points"]["on"]]
    assert shown["tuned"] and lengths == [p[0] for p in shown["points"]["off"]]
    assert lengths == list(attention.TUNE_LENGTHS[:len(lengths)]) and lengths  # a prefix: the box stops early
    again = cli("run", "--prompt", "Say hi.", "--max-tokens", "2", "--n-ctx", "1024", "--json")
    b = json.loads(again.stdout)["attention"]
    assert b["source"] == "tuned" and "first use" not in b["why"] and b["flash_attn"] == a["flash_attn"]
    assert "measuring" not in again.stderr
    assert json.loads(cli("tune", "--show", "--n-ctx", "1024", "--json").stdout)["created"] == shown["created"]
    monkeypatch.setenv("PAGE_LOCAL_AUTOTUNE", "soon")
    one_line_error(cli("run", "--prompt", "x", "--max-tokens", "1"), 2, "PAGE_LOCAL_AUTOTUNE", "'soon'")


def test_the_time_box_stops_before_a_length_it_cannot_afford(smollm2):
    points = attention.measure(smollm2, 1, (64, 128, 256), repeats=1, budget_s=1e-3)
    assert [p[0] for p in points["on"]] == [64] == [p[0] for p in points["off"]]  # the first length always


def test_bad_attention_options_are_one_clear_line(cli):
    one_line_error(cli("run", "--prompt", "x", "--flash-attn", "maybe"), 2, "--flash-attn", "'maybe'")
    one_line_error(cli("run", "--prompt", "x", "--cache-type", "q5_1"), 2, "--cache-type", "'q5_1'")
    one_line_error(cli("run", "--prompt", "x", "--flash-attn", "off", "--cache-type", "q8_0"), 2,
                   "q8_0 quantizes the V cache", "flash attention on")


def test_a_corrupt_tuning_is_a_warning_not_a_failure(cli, smollm2_path, tmp_path):
    from page_local.native.runtime import Model

    with Model(smollm2_path) as m:
        path = store.tuning_path(attention.tuning_key(smollm2_path, m, 2))
    path.parent.mkdir(parents=True)
    path.write_text("\x00garbage")
    res = cli("run", "--prompt", "Say hi.", "--max-tokens", "2", "--n-ctx", "512", "--json")
    assert res.exit_code == 0
    assert "warning: ignoring the unreadable attention tuning" in res.stderr
    assert json.loads(res.stdout)["attention"]["source"] == "default"


# ~200 tokens in 256 cells (was ~410 in 512): every step runs at any length; the last turn still does not fit
# beside the restored conversation, so room is made
DOC = ("The archive keeps many records. " * 14 + "The vault code is 8841. " + "Old ledgers fill the shelves. " * 14
       + "What is the vault code?")


@pytest.mark.parametrize("fa, ct", [("on", "f16"), ("off", "f16"), ("on", "q8_0"), ("on", "q4_0")],
                         ids=["flash-on-f16", "flash-off-f16", "flash-on-q8_0", "flash-on-q4_0"])
def test_every_step_on_each_path_and_cache_type(smollm2_path, fa, ct, tmp_path):
    """Probe and gate, eviction + compaction, the verify check, snapshot / restore, and room-making, with
    this attention path and cache type."""
    from page_local.engine import Engine

    with Engine(smollm2_path, n_ctx=256, budget=0.5, gate="always", flash_attn=fa, cache_type=ct, threads=2) as eng:
        assert (eng.attention.flash_attn, eng.attention.cache_type) == (fa, ct)
        assert eng.ctx.config.flash_attn == fa and eng.ctx.config.type_kv == ct
        d = _turn(eng, DOC, 4).decision
        assert d.evicted and d.kept < d.T and np.isfinite(d.D)  # probe -> D, eviction (compacted)
        snap = eng.snapshot()
        eng.set_gate("verify")
        eng.reset()
        d2 = _turn(eng, DOC, 4).decision  # the check: the answer teacher-forced on the evicted copy
        assert d2.T == d.T and d2.verify_score is not None and d2.verify_m >= 1
        eng.restore(snap)  # save / restore on this cache type
        assert tuple(eng.history) == snap.history and eng.cells_used() == len(snap.positions)
        eng.set_gate("never")
        d3 = _turn(eng, " " + DOC, 2).decision  # does not fit beside the conversation: room is made
        assert d3.room_evicted > 0 and eng.cells_used() <= eng.n_ctx


def test_an_engine_takes_attention_settings_as_a_value(smollm2_path, monkeypatch):
    from page_local.engine import Engine

    monkeypatch.setenv(attention.FLASH_ENV, "off")
    monkeypatch.setenv(attention.CACHE_ENV, "q4_0")
    settings = attention.AttentionSettings("on", "q8_0")
    with Engine(smollm2_path, n_ctx=256, gate="never", attention_settings=settings, threads=2) as eng:
        assert (eng.attention.flash_attn, eng.attention.cache_type) == ("on", "q8_0")  # the environment unread
    with Engine(smollm2_path, n_ctx=256, gate="never", flash_attn="on", threads=2) as eng:
        assert (eng.attention.flash_attn, eng.attention.cache_type) == ("on", "q4_0")  # the cache type left out
    monkeypatch.delenv(attention.FLASH_ENV)
    monkeypatch.delenv(attention.CACHE_ENV)
    with Engine(smollm2_path, n_ctx=256, gate="never", flash_attn="off", type_kv="f16", threads=2) as eng:
        assert eng.ctx.config.type_kv == "f16" and eng.attention.source == "requested"  # type_kv: still accepted
    with pytest.raises(ValueError, match="not both"):
        Engine(smollm2_path, attention_settings=settings, cache_type="f16")


def _turn(eng, text: str, max_tokens: int):
    """One turn that continues the conversation (Engine.generate would start a new one)."""
    stream = eng.stream(text, max_tokens=max_tokens)
    for _ in stream:
        pass
    return stream.result


def test_a_cache_saved_under_one_path_says_why_it_does_not_restore_under_the_other(smollm2_path):
    from page_local.engine import Engine
    from page_local.errors import StateFileError

    with Engine(smollm2_path, n_ctx=256, gate="never", flash_attn="on", threads=2) as on:
        _turn(on, "Hello there.", 2)
        snap = on.snapshot()
    with Engine(smollm2_path, n_ctx=256, gate="never", flash_attn="off", threads=2) as off:
        with pytest.raises(StateFileError, match="flash attention off with cache type f16"):
            off.restore(snap)
        assert off.history == [] and off.cells_used() == 0


# --- a tuning that does not flip (issue 42): recorded noisy timings ---------------------------------------
# An Intel Xeon's first-use tuning at n_ctx 4096 chose flash attention off from one noisy point: on was
# faster at 256 and 1024 cells, then 22.0 ms against 18.2 at 2048 in a single timing, while `bench decode`
# measured on (page-local's kernel) at 18.2 ms per token against stock's best at 20.9 the same hour. Five
# tunings of that machine, each with its own noise (the decode steps as measured: five alternated repeats per
# setting and length), must all choose the same path, and it is on.
XEON_TRUE = {"on": [(256, 3.6, 9.0), (1024, 3.8, 12.5), (2048, 4.0, 17.5)],
             "off": [(256, 3.7, 9.3), (1024, 3.9, 12.9), (2048, 4.1, 18.2)]}


def _noisy_tuning(seed: int) -> dict:
    """Points as measure() records them (median and interquartile range of 5 decode steps per setting and
    length) from the true costs with the host's noise: +-8 % jitter and, now and then, a step 25 % slow."""
    rng = np.random.default_rng(seed)
    out = {}
    for s, pts in XEON_TRUE.items():
        rows = []
        for t, pre, dec in pts:
            steps = dec * (1 + rng.normal(0, 0.08, 5)) * np.where(rng.random(5) < 0.25, 1.3, 1.0)
            q1, q2, q3 = np.percentile(steps, [25, 50, 75])
            rows.append((t, pre * (1 + rng.normal(0, 0.05)), float(q2), float(q3 - q1)))
        out[s] = rows
    return out


def _rule_before(points: dict, n_ctx: int) -> str:
    """The rule this replaced: the lower mean cost, a tie (3 %) to the faster prompt reader, no spread."""
    on, off = attention.mean_cost(points["on"], 0, n_ctx), attention.mean_cost(points["off"], 0, n_ctx)
    if abs(on - off) <= 0.03 * min(on, off):
        pre = {s: np.mean([p[1] for p in points[s]]) for s in points}
        return "on" if pre["on"] <= pre["off"] else "off"
    return "on" if on < off else "off"


def test_five_noisy_tunings_choose_the_same_path_and_it_is_the_kernels():
    tunings = [_noisy_tuning(seed) for seed in range(5)]
    assert len({_rule_before(t, 4096) for t in tunings}) == 2  # the noise flipped the rule before
    picks = [attention.decide(t, 4096)[0] for t in tunings]
    assert picks == ["on"] * 5, picks


def test_the_single_noisy_point_that_chose_off_no_longer_does():
    """The points of the issue, with the spread such timings have (one step of five 25 % slow)."""
    pts = {"on": [(256, 3.1, 9.0, 0.9), (1024, 3.3, 12.5, 1.2), (2048, 3.6, 22.0, 3.5)],
           "off": [(256, 3.9, 9.6, 0.8), (1024, 4.1, 13.4, 1.1), (2048, 4.4, 18.2, 1.6)]}
    assert _rule_before(pts, 4096) == "off"  # what the single timings said
    pick, why = attention.decide(pts, 4096)
    assert pick == "on" and "spread" in why


def test_off_is_still_chosen_where_it_is_faster_beyond_the_spread():
    """The plain path wins where it truly decodes faster (stock llama.cpp's flash kernel on a long cache)."""
    pts = {"on": [(t, p, d, 0.05 * d) for t, p, d in ON], "off": [(t, p, d, 0.05 * d) for t, p, d in OFF]}
    assert attention.decide(pts, 4096)[0] == "off"
    assert attention.decide(pts, 256)[0] == "on"


def test_a_tuning_with_spreads_is_stored_and_read_back(home):
    key = _key()
    pts = {"on": [(256, 3.1, 9.0, 0.9)], "off": [(256, 3.9, 9.6, 0.8)]}
    store.save_tuning(store.Tuning(key, pts, store.now(), 1.0))
    assert store.read_tuning(key).tuning.points == pts


# --- a tuning beside busy processes (issue 42): the load, not the paths ------------------------------------
# This Zen 4's first-use tuning, measured while the suite ran, chose flash attention off for n_ctx 8192 (17.6
# against 25.0 ms, "beyond the 7 % spread"); five tunings of the quiet machine in a row all chose on. Alternated
# repeats remove drift, not a load that slows one path more than the other.

@contextlib.contextmanager
def _spinners(n: int):
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.2)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_busy_is_the_cores_a_tuning_needs():
    assert not attention.disturbed(0.2, threads=2, cores=2) and attention.disturbed(0.3, threads=2, cores=2)
    assert not attention.disturbed(1.2, threads=1, cores=2) and attention.disturbed(1.3, threads=1, cores=2)
    assert not attention.disturbed(12.0, threads=4, cores=16) and attention.disturbed(12.5, threads=4, cores=16)


def test_the_host_meter_sees_another_process_and_not_its_own_work():
    with _spinners(1), attention.HostMeter() as busy:
        time.sleep(1.0)
    assert busy.others_cores > 0.6, busy.others_cores
    with attention.HostMeter() as own:
        t_end = time.perf_counter() + 0.5
        while time.perf_counter() < t_end:
            pass
    assert own.others_cores < busy.others_cores - 0.5, (own.others_cores, busy.others_cores)


def test_a_tuning_measured_beside_busy_processes_is_not_kept(cli, monkeypatch):
    monkeypatch.setenv("PAGE_LOCAL_AUTOTUNE", "8")
    with _spinners(os.cpu_count() or 2):
        ran = cli("run", "--prompt", "Say hi.", "--max-tokens", "2", "--n-ctx", "1024", "--json")
        assert ran.exit_code == 0, ran.output
        a = json.loads(ran.stdout)["attention"]
        assert a["source"] == "default" and a["flash_attn"] == "on", a
        assert "tuning was not kept: other processes used" in ran.stderr and "next start measures again" in ran.stderr
        refused = cli("tune", "--lengths", "48,96", "--n-ctx", "1024")
        one_line_error(refused, 1, "not stored: other processes used", "--busy-ok")
        assert json.loads(cli("tune", "--show", "--json").stdout)["tuned"] is False
        kept = json.loads(cli("tune", "--lengths", "48,96", "--n-ctx", "1024", "--busy-ok", "--json").stdout)
    assert kept["tuned"] and kept["others_cores"] > 0.25
    shown = cli("tune", "--show", "--n-ctx", "1024")
    assert f"other processes used {kept['others_cores']:.2f} cores meanwhile" in shown.stdout


def test_a_tuning_that_chose_off_by_a_fast_last_point_keeps_the_kernel():
    """A first-use tuning stored on a quiet AMD Zen 4 (SmolLM2, 2 threads): off's decode at 2 048 cells came out
    below its own 1 024-cell step (7 % under on's), so the last segment's slope made off flat to 32K and the rule
    chose off from 4K on, where off reads a prompt 25 % slower (issue 54). Its prompt reading at the last length
    is 25 % slower than on's; nothing here is beyond 10 %."""
    pts = {"on": [(256, 1.69, 7.83, 0.39), (1024, 2.26, 10.99, 0.15), (2048, 2.95, 13.09, 0.14)],
           "off": [(256, 1.80, 7.94, 0.10), (1024, 3.02, 12.53, 0.17), (2048, 3.68, 12.13, 0.99)]}
    assert [attention.decide(pts, n)[0] for n in (2048, 4096, 8192, 32768)] == ["on"] * 4
    flat = attention.cost_curve(pts["off"], np.array([2048.0, 32768.0]))
    assert flat[1] > flat[0] * 1.5  # off's cost grows past the points measured, as a decode step does

"""The PAGE gate: modes, raw and calibrated rules, calibration profiles, model identity."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from page_local.errors import ProfileWarning
from page_local.gate import MODES, RAW_THRESHOLD, Z_THRESHOLD, Gate, calibrate
from page_local.store import gguf, home as home_mod, profiles
from page_local.store.gguf import model_identity
from page_local.store.home import page_local_home
from page_local.store.profiles import Profile, load_profile, profile_path, read_profile, save_profile


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGE_LOCAL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def profile(mu=0.10, sigma=0.05, model_id="m-1"):
    return Profile(model_id=model_id, model="test model", n_pilot=100, mu=mu, sigma=sigma,
                   created="2026-01-01T00:00:00+00:00", page_local_version="0.1.0")


# --- rules and modes ---------------------------------------------------------------------------

@pytest.mark.parametrize("D, is_open", [(0.07, True), (0.2, True), (0.0699, False), (-0.3, False)],
                         ids=["at-threshold", "above", "just-below", "negative"])
def test_raw_rule(D, is_open):
    d = Gate().decide(D)
    assert (d.open, d.rule, d.mode, d.z, d.threshold) == (is_open, "raw", "page", None, RAW_THRESHOLD)
    assert d.D == D and d.reason


@pytest.mark.parametrize("D, is_open", [(0.10, True), (0.10 - 0.6934 * 0.05 + 1e-9, True),
                                        (0.10 - 0.6934 * 0.05 - 1e-6, False), (0.0, False)],
                         ids=["at-mean", "at-threshold", "just-below", "low"])
def test_calibrated_rule(D, is_open):
    d = Gate(profile=profile()).decide(D)
    assert d.rule == "calibrated" and d.threshold == Z_THRESHOLD
    assert d.z == pytest.approx((D - 0.10) / 0.05)
    assert d.open is is_open


def test_calibrated_rule_can_disagree_with_raw():
    # D = 0.03 is below the raw 0.07 but only z = -0.4 for a model whose drops are small.
    assert not Gate().decide(0.03).open
    assert Gate(profile=profile(mu=0.04, sigma=0.025)).decide(0.03).open


@pytest.mark.parametrize("mode, is_open", [("always", True), ("never", False)], ids=["always", "never"])
def test_forced_modes_ignore_D(mode, is_open):
    for D in (-1.0, 0.0, 1.0, None):
        d = Gate(mode).decide(D)
        assert (d.open, d.rule, d.mode, d.threshold) == (is_open, "forced", mode, None)
        assert mode in d.reason


def test_page_mode_needs_a_finite_D():
    for bad in (None, math.nan, math.inf, "0.1", True):
        with pytest.raises(ValueError):
            Gate().decide(bad)


def test_unknown_mode_names_the_choices():
    with pytest.raises(ValueError, match="page, always, never") as e:
        Gate("sometimes")
    assert "sometimes" in str(e.value)
    assert MODES == ("page", "always", "never")


def test_reason_is_plain_words():
    assert "keeping the full cache" in Gate().decide(0.01).reason
    assert "evicting" in Gate().decide(0.5).reason


# --- calibration -------------------------------------------------------------------------------

def test_calibrate_uses_population_std():
    mu, sigma = calibrate([0.0, 0.1, 0.2, 0.3])
    assert mu == pytest.approx(0.15)
    assert sigma == pytest.approx(np.std([0.0, 0.1, 0.2, 0.3], ddof=0))


@pytest.mark.parametrize("values", [[], [0.1], [0.2, 0.2, 0.2], [0.1, math.nan]],
                         ids=["empty", "one", "constant", "nan"])
def test_calibrate_rejects(values):
    with pytest.raises(ValueError):
        calibrate(values)


# --- profiles ----------------------------------------------------------------------------------

def test_home_is_read_at_call_time(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGE_LOCAL_HOME", str(tmp_path / "a"))
    assert page_local_home() == tmp_path / "a"
    monkeypatch.setenv("PAGE_LOCAL_HOME", str(tmp_path / "b"))
    assert profile_path("x") == tmp_path / "b" / "profiles" / "x.json"


def test_profile_round_trip(home):
    path = save_profile("llama-abc", 0.12, 0.03, 100, "SmolLM2 135M")
    assert path == home / "profiles" / "llama-abc.json"
    data = json.loads(path.read_text())
    assert data["format"] == "page-local-profile" and data["version"] == 1
    assert set(data) == {"format", "version", "model_id", "model", "n_pilot", "mu", "sigma", "created",
                         "page_local_version"}
    p = load_profile("llama-abc")
    assert (p.model_id, p.model, p.n_pilot, p.mu, p.sigma) == ("llama-abc", "SmolLM2 135M", 100, 0.12, 0.03)
    g = Gate.for_model("llama-abc")
    assert g.profile == p and g.warning is None and g.decide(0.12).rule == "calibrated"


def test_profile_records_the_pilot_lengths_and_the_gate_notes_prompts_far_outside_them(home):
    path = save_profile("m", 0.05, 0.02, 100, "x", pilot_tokens=(950, 3050))
    assert json.loads(path.read_text())["pilot_tokens"] == [950, 3050]
    g = Gate.for_model("m")
    assert g.profile.pilot_tokens == (950, 3050)
    for n in (760, 950, 2000, 3050, 3812, None):  # within [950 / 1.25, 3050 * 1.25], or length unknown
        d = g.decide(0.04, n_tokens=n)
        assert d.note is None and "note" not in d.reason
    for n in (300, 759, 3813, 8000):
        d = g.decide(0.04, n_tokens=n)
        assert d.rule == "calibrated" and f"this prompt has {n} tokens" in d.note and "950-3050" in d.note
        assert d.note in d.reason and d.open == g.decide(0.04).open  # a note, never a different decision
    # the raw rule and the forced modes have no pilot to compare with
    assert Gate().decide(0.04, n_tokens=8000).note is None
    assert Gate("always", g.profile).decide(0.04, n_tokens=8000).note is None


def test_profiles_without_pilot_lengths_still_load(home):
    _write(home, "m", _good())  # written before pilot_tokens was recorded
    g = Gate.for_model("m")
    assert g.warning is None and g.profile.pilot_tokens is None
    assert g.decide(0.1, n_tokens=100_000).note is None


def test_missing_profile_is_none_without_warning(home, recwarn):
    status = read_profile("nobody")
    assert status.profile is None and status.warning is None
    assert load_profile("nobody") is None
    assert not [w for w in recwarn if issubclass(w.category, ProfileWarning)]
    assert Gate.for_model("nobody").decide(0.1).rule == "raw"


def test_atomic_write_leaves_no_temp_files(home):
    save_profile("m", 0.1, 0.02, 10, "first")
    save_profile("m", 0.2, 0.04, 20, "second")  # overwrite
    assert [p.name for p in (home / "profiles").iterdir()] == ["m.json"]
    assert load_profile("m").mu == 0.2


def test_failed_write_leaves_no_temp_file(home, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(home_mod.os, "replace", boom)
    with pytest.raises(OSError):
        save_profile("m", 0.1, 0.02, 10, "x")
    assert list((home / "profiles").iterdir()) == []


def _write(home, model_id, text):
    path = home / "profiles" / f"{model_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _good(**changes):
    data = {"format": "page-local-profile", "version": 1, "model_id": "m", "model": "x", "n_pilot": 100,
            "mu": 0.1, "sigma": 0.05, "created": "2026-01-01", "page_local_version": "0.1.0"}
    data.update(changes)
    return json.dumps(data)


@pytest.mark.parametrize("text, why", [
    ("{not json", "unreadable"),
    ("[1, 2]", "not a JSON object"),
    (_good(sigma=0), "sigma"),
    (_good(sigma=-0.1), "sigma"),
    (_good(mu="NaN"), "mu"),
    ('{"format": "page-local-profile", "version": 1, "model_id": "m", "model": "x", "n_pilot": 100,'
     ' "mu": NaN, "sigma": 0.05, "created": "2026", "page_local_version": "0"}', "mu"),
    (_good(sigma=float("inf")), "sigma"),
    (json.dumps({"format": "page-local-profile", "version": 1, "model_id": "m"}), "missing keys"),
    (_good(version=2), "version"),
    (_good(model_id="other"), "belongs to model 'other'"),
    (_good(pilot_tokens=[4096, 1024]), "pilot_tokens"),
    (_good(pilot_tokens=[0, 10]), "pilot_tokens"),
    (_good(pilot_tokens="1024-3072"), "pilot_tokens"),
], ids=["bad-json", "not-object", "sigma-zero", "sigma-negative", "mu-string", "mu-nan", "sigma-inf",
        "missing-keys", "future-version", "foreign-model", "pilot-tokens-reversed", "pilot-tokens-zero",
        "pilot-tokens-string"])
def test_unusable_profile_is_none_with_warning(home, text, why):
    _write(home, "m", text)
    status = read_profile("m")
    assert status.profile is None and why in status.warning
    with pytest.warns(ProfileWarning, match="ignoring"):
        assert load_profile("m") is None
    g = Gate.for_model("m")
    assert g.profile is None and g.warning == status.warning and g.decide(0.1).rule == "raw"


@pytest.mark.parametrize("kwargs", [dict(mu=math.nan), dict(sigma=0.0), dict(sigma=-1.0), dict(n_pilot=1)],
                         ids=["mu-nan", "sigma-zero", "sigma-negative", "n-pilot-1"])
def test_save_profile_rejects(home, kwargs):
    args = dict(model_id="m", mu=0.1, sigma=0.05, n_pilot=10, model_desc="x") | kwargs
    with pytest.raises(ValueError):
        save_profile(**args)


@pytest.mark.parametrize("model_id", ["", "../evil", "a/b", ".hidden", "x\n"], ids=repr)
def test_model_id_must_be_a_safe_file_name(home, model_id):
    with pytest.raises(ValueError):
        profile_path(model_id)


# --- model identity ----------------------------------------------------------------------------

def _tiny_gguf(path, name="tiny", n_layer=2, width=8, name_last=False):
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    if not name_last:
        w.add_name(name)
    w.add_token_list([f"tok{i}" for i in range(50)])  # an array of strings to walk past
    w.add_block_count(n_layer)
    w.add_embedding_length(width)
    if name_last:
        w.add_name(name)
    w.add_tensor("t", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_model_identity_is_stable_and_discriminating(tmp_path):
    a = model_identity(_tiny_gguf(tmp_path / "a.gguf"))
    assert a == model_identity(_tiny_gguf(tmp_path / "a-copy.gguf"))  # same content, other file name
    assert a.startswith("llama-") and profiles._MODEL_ID.fullmatch(a)
    assert a == model_identity(_tiny_gguf(tmp_path / "a-order.gguf", name_last=True))
    assert a != model_identity(_tiny_gguf(tmp_path / "b.gguf", name="other"))
    assert a != model_identity(_tiny_gguf(tmp_path / "c.gguf", n_layer=3))
    meta = gguf.gguf_metadata(tmp_path / "a.gguf")
    assert (meta["general.architecture"], meta["general.name"], meta["block_count"],
            meta["embedding_length"]) == ("llama", "tiny", 2, 8)


def test_model_identity_rejects_non_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF"):
        model_identity(p)

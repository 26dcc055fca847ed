"""The models other tools keep (page_local/store/discover.py), laid out by hand in a temporary home around the
real SmolLM2 file (linked, never copied): an Ollama store, an LM Studio folder, the Hugging Face cache and
llama.cpp's older flat cache. Each is listed with its header's facts and found by the names those tools use
(`page-local models`, store.models.resolve, `page-local run --model NAME`, Engine(NAME)); a store that is
damaged (a manifest that does not parse, a blob missing, short or not GGUF, a LoRA layer, a vision tower
inside the GGUF, a split missing a part, a link to a deleted blob) costs its one model, with a reason, and
never a traceback."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from page_local.cli import main
from page_local.errors import ModelError
from page_local.store import discover, models

HUB_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
STUDIO_REPO = "lmstudio-community/SmolLM2-135M-Instruct-GGUF"
SMOL_FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="session")
def smol_digest(smollm2_path):
    return sha256(smollm2_path)


def ollama_model(root: Path, name: str, tag: str, blob: Path | None, digest: str, size: int,
                 host: str = "registry.ollama.ai", namespace: str = "library", extra_layers: tuple = ()) -> Path:
    """A manifest as Ollama writes it, its model layer pointing at blobs/sha256-<digest> (a link to `blob`)."""
    if blob is not None:
        target = root / "blobs" / f"sha256-{digest}"
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.symlink_to(blob)
    manifest = root / "manifests" / host / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    layers = [{"mediaType": discover.OLLAMA_MODEL_LAYER, "digest": f"sha256:{digest}", "size": size},
              {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "1" * 64, "size": 10},
              *extra_layers]
    manifest.write_text(json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution."
                                    "manifest.v2+json", "config": {}, "layers": layers}))
    return manifest


def hub_file(cache: Path, repo: str, rel: str, target: Path, commit: str = COMMIT) -> Path:
    """A file as huggingface_hub leaves it: snapshots/<commit>/<rel> linking to a blob; refs/main."""
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    blob = repo_dir / "blobs" / hashlib.sha1(f"{rel}{commit}".encode()).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    if not blob.exists():
        blob.symlink_to(target)
    link = repo_dir / "snapshots" / commit / rel
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return link


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty home: every store's variable unset, so the stores are the ones under it."""
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "LLAMA_CACHE",
                "OLLAMA_MODELS", "PAGE_LOCAL_MODEL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PAGE_LOCAL_HOME", str(tmp_path / "page-local"))
    monkeypatch.setattr(discover, "ollama_dirs", lambda: [_ollama_root()])  # not the machine's /usr/share/ollama
    return h


def _ollama_root() -> Path:
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env) if env else Path.home() / ".ollama" / "models"


@pytest.fixture
def stores(home, smollm2_path, smol_digest):
    """SmolLM2 in all four stores, under the names each tool gives it."""
    size = smollm2_path.stat().st_size
    ollama = home / ".ollama" / "models"
    ollama_model(ollama, "smollm2", "135m", smollm2_path, smol_digest, size)
    ollama_model(ollama, "smollm2", "latest", smollm2_path, smol_digest, size)
    ollama_model(ollama, "SmolLM2-135M-Instruct-GGUF", "Q4_1", smollm2_path, smol_digest, size, host="hf.co",
                 namespace="bartowski")
    hub = home / ".cache" / "huggingface" / "hub"
    hub_file(hub, HUB_REPO, SMOL_FILE, smollm2_path)
    studio = home / ".lmstudio" / "models" / STUDIO_REPO
    studio.mkdir(parents=True)
    (studio / SMOL_FILE).symlink_to(smollm2_path)
    flat = home / ".cache" / "llama.cpp"
    flat.mkdir(parents=True)
    (flat / f"unsloth_SmolLM2-GGUF_{SMOL_FILE}").symlink_to(smollm2_path)
    (flat / "manifest=unsloth=SmolLM2-GGUF=latest.json").write_text(json.dumps({"ggufFile": {"rfilename": SMOL_FILE}}))
    return home


def names(found) -> dict[str, discover.Found]:
    return {f.name: f for f in found}


def test_every_store_is_listed_with_the_header_facts(stores, smollm2_path):
    found, skipped = discover.discover()
    got = names(found)
    assert set(got) == {"smollm2:135m", "smollm2:latest", "hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_1",
                        f"{HUB_REPO}:Q4_1", f"{STUDIO_REPO}:Q4_1", "unsloth/SmolLM2-GGUF:Q4_1"}, skipped
    assert not skipped
    assert {f.store for f in found} == {"ollama", "huggingface", "lmstudio", "llama.cpp"}
    for f in found:
        assert f.path.resolve() == smollm2_path.resolve() and f.size == smollm2_path.stat().st_size
        assert f.details() == {"architecture": "llama", "parameters": "135M", "quantization": "Q4_1",
                               "n_ctx_train": 8192, "model_name": f.details()["model_name"]}
    assert got["smollm2:135m"].path.name.startswith("sha256-")  # Ollama's blob, read where it lies


@pytest.mark.parametrize("name, store", [
    ("smollm2:135m", "ollama"), ("smollm2", "ollama"), ("SmolLM2:Latest", "ollama"),
    (f"{HUB_REPO}:Q4_1", "huggingface"), (f"hf.co/{HUB_REPO}:q4_1", "huggingface"), (HUB_REPO, "huggingface"),
    (f"https://huggingface.co/{HUB_REPO}:Q4_1", "huggingface"), (f"{STUDIO_REPO}:Q4_1", "lmstudio"),
    ("hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_1", "ollama"),
    ("bartowski/SmolLM2-135M-Instruct-GGUF:Q4_1", "ollama"),
    ("unsloth/SmolLM2-GGUF:Q4_1", "llama.cpp"), ("unsloth/SmolLM2-GGUF", "llama.cpp"),
], ids=["ollama-tag", "ollama-latest", "ollama-case", "hub", "hub-hf.co", "hub-no-quant", "hub-url", "lmstudio",
        "ollama-hf.co", "ollama-hf-short", "llama.cpp-manifest", "llama.cpp-no-quant"])
def test_names_resolve_to_the_file(stores, smollm2_path, name, store):
    found, _ = discover.scan()
    hits = discover.matches(name, found)
    assert hits and hits[0].store == store, [(h.name, h.store) for h in hits]
    assert models.resolve(name).resolve() == smollm2_path.resolve()


def test_registered_names_and_paths_keep_their_meaning(stores, smollm2_path, tmp_path):
    assert models.resolve("smollm2") == smollm2_path  # the registry first, though Ollama has a smollm2 too
    assert models.resolve(str(smollm2_path)) == smollm2_path
    assert models.resolve(smollm2_path) == smollm2_path
    missing = tmp_path / "nope.gguf"
    assert models.resolve(str(missing)) == missing  # a path: loading it says the file is missing


def test_a_name_for_two_models_names_both(stores, smollm2_path, tmp_path):
    # the same file under three stores' names is one model: no ambiguity
    assert models.resolve("smollm2-135m-instruct-q4_1").resolve() == smollm2_path.resolve()
    other = tmp_path / "other-Q4_1.gguf"  # a different model (another size) under the same repo name
    other.write_bytes(smollm2_path.read_bytes()[: 1 << 20])
    studio = stores / ".lmstudio" / "models" / HUB_REPO
    studio.mkdir(parents=True)
    (studio / SMOL_FILE).symlink_to(other)
    with pytest.raises(ModelError) as e:
        models.resolve(f"{HUB_REPO}:Q4_1")
    msg = str(e.value)
    assert "matches 2 models" in msg and "huggingface" in msg and "lmstudio" in msg and str(studio) in msg


def test_an_unknown_name_says_how_to_list_and_get_models(stores):
    with pytest.raises(ModelError) as e:
        models.resolve("llama3.2:3b")
    assert "`page-local models`" in str(e.value) and "`page-local pull ORG/REPO[:QUANT]`" in str(e.value)
    with pytest.raises(ModelError) as e:
        models.resolve("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M")
    assert "`page-local pull bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M`" in str(e.value)
    with pytest.raises(ModelError) as e:
        models.resolve("smollm2:13")
    assert "did you mean smollm2:135m" in str(e.value)


def test_a_repo_with_several_quantizations_takes_q4_k_m(home, smollm2_path, tmp_path):
    hub = home / ".cache" / "huggingface" / "hub"
    for quant in ("Q8_0", "Q4_K_M", "Q2_K"):
        hub_file(hub, "org/Model-GGUF", f"Model-{quant}.gguf", smollm2_path)
    found, _ = discover.scan()
    assert [f.name for f in discover.matches("org/Model-GGUF", found)] == ["org/Model-GGUF:Q4_K_M"]
    assert models.resolve("org/model-gguf:q2_k").name == "Model-Q2_K.gguf"


def test_damaged_stores_cost_one_model_each_with_a_reason(home, smollm2_path, smol_digest, tmp_path):
    import gguf

    size = smollm2_path.stat().st_size
    ollama = home / ".ollama" / "models"
    ollama_model(ollama, "good", "latest", smollm2_path, smol_digest, size)
    bad = ollama / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    ollama_model(ollama, "gone", "latest", None, "a" * 64, 10)  # its blob is not there
    ollama_model(ollama, "short", "latest", smollm2_path, smol_digest, size + 1)  # a download in progress
    text = tmp_path / "weights.bin"
    text.write_bytes(b"safetensors, not a GGUF" * 10)
    ollama_model(ollama, "notgguf", "latest", text, sha256(text), text.stat().st_size)
    ollama_model(ollama, "lora", "latest", smollm2_path, smol_digest, size,
                 extra_layers=({"mediaType": discover.OLLAMA_ADAPTER_LAYER, "digest": "sha256:" + "2" * 64},))
    noimage = ollama / "manifests" / "registry.ollama.ai" / "library" / "empty" / "latest"
    noimage.parent.mkdir(parents=True)
    noimage.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.license"}]}))
    vision = tmp_path / "vision.gguf"  # Ollama's single-file vision models: the tower's keys in the header
    w = gguf.GGUFWriter(str(vision), "gemma3")
    w.add_uint32("gemma3.context_length", 8192)
    w.add_uint32("gemma3.vision.block_count", 27)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ollama_model(ollama, "gemma3", "4b", vision, sha256(vision), vision.stat().st_size)

    hub = home / ".cache" / "huggingface" / "hub"
    hub_file(hub, "org/Split-GGUF", "Split-Q4_K_M-00001-of-00002.gguf", smollm2_path)  # part 2 never came
    gone = tmp_path / "deleted.gguf"
    gone.write_bytes(b"GGUF")
    hub_file(hub, "org/Gone-GGUF", "Gone-Q8_0.gguf", gone)
    gone.unlink()
    partial = hub / "models--org--Part-GGUF" / "blobs" / "abc.1234abcd.incomplete"  # a download in progress
    partial.parent.mkdir(parents=True)
    partial.write_bytes(smollm2_path.read_bytes()[:4096])
    (hub / "models--org--Part-GGUF" / "snapshots").mkdir()

    found, skipped = discover.discover()
    assert [f.name for f in found] == ["good:latest"]
    reasons = "\n".join(map(str, skipped))
    for needle in ("broken:latest does not parse", "gone:latest: its model blob sha256-aaaa", "is missing",
                   f"blob is {size} bytes, the manifest says {size + 1}", "notgguf:latest (ollama): not a GGUF file",
                   "lora:latest applies a LoRA adapter", "empty:latest has no model layer",
                   "gemma3:4b (ollama): Ollama's gemma3 file carries its vision tower inside",
                   "split model with 1 of its 2 parts", "links to a blob that is gone"):
        assert needle in reasons, reasons
    assert len(skipped) == 9, reasons

    res = CliRunner().invoke(main, ["models", "--verbose"])
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert "good:latest" in res.stdout and "broken" not in res.stdout
    assert res.stderr.count("skipped ") == 9 and "does not parse" in res.stderr
    with pytest.raises(ModelError, match="vision tower"):
        models.resolve("gemma3:4b")
    with pytest.raises(ModelError, match="no model named"):
        models.resolve("org/Split-GGUF:Q4_K_M")  # half a split is never taken for a model


def test_store_variables_are_honoured(home, smollm2_path, smol_digest, tmp_path, monkeypatch):
    own = tmp_path / "ollama-store"
    ollama_model(own, "tiny", "1b", smollm2_path, smol_digest, smollm2_path.stat().st_size)
    hub = tmp_path / "hf-cache"
    hub_file(hub, "org/Hub-GGUF", "Hub-Q4_1.gguf", smollm2_path)
    monkeypatch.setenv("OLLAMA_MODELS", str(own))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("LLAMA_CACHE", str(hub))  # the same folder twice: read once
    found, _ = discover.discover()
    assert sorted(f.name for f in found) == ["org/Hub-GGUF:Q4_1", "tiny:1b"]
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    assert discover.hf_cache_dir() == tmp_path / "hfhome" / "hub"


def test_models_lists_them_in_a_table_and_json(stores, smollm2_path):
    res = CliRunner().invoke(main, ["models"])
    assert res.exit_code == 0, res.output
    row = next(line for line in res.stdout.splitlines() if line.startswith("smollm2:135m"))
    for cell in ("ollama", "llama", "135M", "Q4_1", "98 MB", "8192", "~/.ollama/models/blobs/sha256-"):
        assert cell in row, row
    assert "pull ORG/REPO[:QUANT]" in res.stdout
    rows = {r["name"]: r for r in json.loads(CliRunner().invoke(main, ["models", "--json"]).stdout)}
    assert rows["smollm2"]["store"] == "registry"
    hub = rows[f"{HUB_REPO}:Q4_1"]
    assert hub["store"] == "huggingface" and hub["quantization"] == "Q4_1" and hub["n_ctx_train"] == 8192
    assert hub["size_bytes"] == smollm2_path.stat().st_size and hub["parameters"] == "135M"


def test_run_and_engine_by_an_ollama_name(stores, smollm2_path):
    """The issue's 'done when': a model in Ollama's store runs by its name, from the CLI and from Python."""
    from page_local.engine import Engine

    res = CliRunner().invoke(main, ["run", "--model", "smollm2:135m", "--prompt", "The capital of France is",
                                    "--max-tokens", "3", "--n-ctx", "256", "--threads", "1", "--gate", "never"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip()
    with Engine("smollm2:135m", n_ctx=256, gate="never", threads=1) as eng:
        assert eng.generate("The capital of France is", max_tokens=3).text.strip()
    with Engine(f"hf.co/{HUB_REPO}:Q4_1", n_ctx=256, gate="never", threads=1) as eng:
        assert Path(eng.model.path).resolve() == smollm2_path.resolve()
    link = models.resolve(f"{HUB_REPO}:Q4_1")
    assert models.name_for(link) == f"{HUB_REPO}:Q4_1"  # the file itself first, then what it links to
    assert models.name_for(smollm2_path) == "smollm2"

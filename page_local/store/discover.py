"""The GGUF models other tools already keep on this machine, found read-only, one reader per store:

| store       | where (first that is set)                                         | name it is used by               |
|-------------|-------------------------------------------------------------------|----------------------------------|
| huggingface | $HF_HUB_CACHE, $HUGGINGFACE_HUB_CACHE, $HF_HOME/hub,              | ORG/REPO:QUANT (hf.co/... too)   |
|             | $XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub         |                                  |
| llama.cpp   | $LLAMA_CACHE, ~/.cache/llama.cpp (the Hub's layout, or the older  | ORG/REPO:QUANT, or the file stem |
|             | flat files with manifest=ORG=REPO=TAG.json beside them)           |                                  |
| lmstudio    | ~/.lmstudio/models, ~/.cache/lm-studio/models (PUBLISHER/REPO/)   | PUBLISHER/REPO:QUANT             |
| ollama      | $OLLAMA_MODELS, ~/.ollama/models, /usr/share/ollama/.ollama/models | NAME:TAG as Ollama names it     |

The Hub's cache (huggingface_hub, llama.cpp's -hf, llama-cpp-python's from_pretrained) links a file into
snapshots/<commit>/ only once its download is complete (a download in progress is a *.incomplete blob), so
only snapshots are read. QUANT is the tag at the end of the file name, read as llama.cpp reads it
(`Llama-3.2-1B-Instruct-Q4_K_M.gguf` -> Q4_K_M); a split model (`-00001-of-00003.gguf`) counts when every
part is there, and is opened by its first part, as llama.cpp opens one.

Ollama's store is Ollama's private format: a manifest per name (manifests/<host>/<namespace>/<model>/<tag>,
JSON) lists layers; the layer of mediaType application/vnd.ollama.image.model is the GGUF, stored as
blobs/sha256-<hex>. A manifest that does not parse, a missing or short blob, a layer that is not GGUF, a
LoRA adapter layer, a GGUF that carries its vision tower inside (Ollama's own engine reads those; llama.cpp
takes the tower as a separate file) is not a model here: it is returned as a Skipped with the reason.

Nothing here writes, and nothing raises for what it finds: `discover()` returns what is usable and what
was skipped. Headers are read lazily (Found.details), so resolving a name reads one header, not all.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_ADAPTER_LAYER = "application/vnd.ollama.image.adapter"
OLLAMA_REGISTRY = "registry.ollama.ai"
MAX_MANIFEST_BYTES = 1 << 20  # an Ollama manifest is a few hundred bytes; anything larger is not one

# llama.cpp's reading of a GGUF file name (common/download.cpp get_gguf_split_info)
_SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)
# files beside a model that are not one (llama.cpp's gguf_filename_is_model)
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")


@dataclass(frozen=True)
class SplitName:
    prefix: str  # the name without .gguf and the split suffix, tag included
    tag: str  # upper case, "" when the name has none
    index: int  # 1-based
    count: int


def split_name(filename: str) -> SplitName | None:
    """'Llama-3.2-1B-Instruct-Q4_K_M-00001-of-00002.gguf' -> (prefix 'Llama-3.2-1B-Instruct-Q4_K_M', tag
    'Q4_K_M', 1, 2); None for a name that does not end in .gguf. As llama.cpp reads it."""
    name = filename.rsplit("/", 1)[-1]
    if not name.lower().endswith(".gguf"):
        return None
    prefix = filename[: -len(".gguf")]
    index = count = 1
    m = _SPLIT.match(prefix)
    if m:
        prefix, index, count = m.group(1), int(m.group(2)), int(m.group(3))
    t = _TAG.search(prefix.rsplit("/", 1)[-1])
    return SplitName(prefix, t.group(1).upper() if t else "", index, count)


def is_model_file(filename: str) -> bool:
    """A .gguf that is a language model, not a projector, an importance matrix or a draft head."""
    name = filename.rsplit("/", 1)[-1]
    return name.lower().endswith(".gguf") and not any(k in name.lower() for k in _NOT_MODELS)


@dataclass
class Found:
    """A usable model: `name` is what --model takes; `keys` every lower-case name that finds it."""

    name: str
    store: str  # "huggingface" | "llama.cpp" | "lmstudio" | "ollama"
    path: Path  # what llama.cpp opens (a split model's first part)
    parts: tuple[Path, ...]
    keys: frozenset[str]
    repo: str = ""  # ORG/REPO in the Hub's layouts (a name without QUANT chooses among a repo's files)
    tag: str = ""  # QUANT from the file name ("" when it has none); Ollama: the tag
    _details: dict | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return sum(p.stat().st_size for p in self.parts)

    def details(self) -> dict:
        """architecture, parameters ("1.2B"), quantization ("Q4_K_M"), n_ctx_train, name from the header
        (tensors are read only when the header has no size label); raises Unusable(reason)."""
        if self._details is None:
            self._details = read_details(self.path, ollama=self.store == "ollama")
        return self._details


@dataclass(frozen=True)
class Skipped:
    where: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


class Unusable(Exception):
    """Why a file found in a store is not a model page-local can run (a one-line reason)."""


# --- headers -----------------------------------------------------------------------------------

def _file_type_name(value) -> str:
    """general.file_type (llama_ftype) -> 'Q4_K_M', as llama.cpp names it."""
    try:
        import gguf

        return gguf.LlamaFileType(int(value)).name.removeprefix("MOSTLY_").replace("ALL_", "")
    except (ImportError, ValueError, TypeError):
        return f"type {value}"


def _count_parameters(path: Path) -> int | None:
    """Weights in the file, from its tensor infos (for a header without general.size_label)."""
    try:
        import gguf
        import numpy as np

        reader = gguf.GGUFReader(path)
        return int(sum(int(np.prod(t.shape)) for t in reader.tensors))
    except Exception:  # noqa: BLE001 -- a count for a listing; the file is judged by the header read
        return None


def _size_label(n: int) -> str:
    """135_000_000 -> '135M', 1_236_000_000 -> '1.2B' (as general.size_label writes it)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f}{unit}" if v >= 10 else f"{v:.1f}{unit}".replace(f".0{unit}", unit)
    return str(n)


def read_details(path: Path, ollama: bool = False) -> dict:
    """The header's facts about a model, or Unusable with the reason it cannot be run here."""
    from page_local.store.gguf import _header  # the key-value walker gguf.py shares: tensors are never read

    try:
        raw = _header(path, lambda k: k.startswith(("general.", "split.")) or ".context_length" in k
                      or ".vision." in k or k.startswith("tokenizer."),
                      # the tokenizer's keys come after the model's: stop at the first (a short string)
                      lambda raw: any(k.startswith("tokenizer.") for k in raw))
    except ValueError as e:  # not GGUF, truncated, an unknown value type: the reader's words, less the path
        msg = str(e)
        for head in (f"{path}: ", f"{path} is "):
            msg = msg.removeprefix(head)
        raise Unusable(msg) from None
    except OSError as e:
        raise Unusable(f"cannot read it: {e.strerror or e}") from None
    arch = raw.get("general.architecture")
    if not arch:
        raise Unusable("the GGUF header names no architecture (general.architecture)")
    if arch == "clip":
        raise Unusable("a vision projector (mmproj), not a language model")
    if ollama and any(k.startswith(f"{arch}.vision.") for k in raw):
        raise Unusable(f"Ollama's {arch} file carries its vision tower inside; llama.cpp loads only models whose "
                       "projector is a separate file")
    label = raw.get("general.size_label")
    if not label:
        n = _count_parameters(path)
        label = _size_label(n) if n else ""
    ctx = raw.get(f"{arch}.context_length")
    return {"architecture": str(arch), "parameters": str(label or ""),
            "quantization": _file_type_name(raw["general.file_type"]) if "general.file_type" in raw else "",
            "n_ctx_train": int(ctx) if isinstance(ctx, int) and ctx > 0 else None,
            "model_name": str(raw.get("general.name") or "")}


# --- where the stores are ----------------------------------------------------------------------

def _env_path(var: str) -> Path | None:
    v = os.environ.get(var)
    return Path(v).expanduser() if v else None


def hf_cache_dir() -> Path:
    """The Hugging Face Hub cache, read from the environment now (as huggingface_hub reads it at import)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if (p := _env_path(var)) is not None:
            return p
    if (p := _env_path("HF_HOME")) is not None:
        return p / "hub"
    if (p := _env_path("XDG_CACHE_HOME")) is not None:
        return p / "huggingface" / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def llama_cache_dirs() -> list[Path]:
    p = _env_path("LLAMA_CACHE")
    return [p] if p is not None else [Path.home() / ".cache" / "llama.cpp"]


def lmstudio_dirs() -> list[Path]:
    return [Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models"]


def ollama_dirs() -> list[Path]:
    p = _env_path("OLLAMA_MODELS")
    if p is not None:
        return [p]
    # the Linux install runs the server as the user `ollama`, whose home is /usr/share/ollama
    return [Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]


# --- readers -----------------------------------------------------------------------------------

Group = tuple[str, SplitName, tuple[Path, ...]]


def _group_files(files: list[tuple[str, Path]], where: Path) -> Iterator[Group | Skipped]:
    """(relative name, path) of .gguf files -> (relative name of the first part, its SplitName, all parts)
    per model file; a split with parts missing is Skipped; projectors and the like are left out."""
    splits: dict[tuple[str, int], dict[int, tuple[str, Path]]] = {}
    for rel, path in sorted(files):
        if not is_model_file(rel):
            continue
        s = split_name(rel)
        if s is None:
            continue
        if s.count == 1:
            yield rel, s, (path,)
        else:
            splits.setdefault((s.prefix, s.count), {})[s.index] = (rel, path)
    for (prefix, count), parts in splits.items():
        have = sorted(parts)
        if have != list(range(1, count + 1)):
            yield Skipped(where / f"{prefix}-*-of-{count:05d}.gguf",
                          f"split model with {len(have)} of its {count} parts (an interrupted download?)")
            continue
        first_rel = parts[1][0]
        yield first_rel, split_name(first_rel), tuple(parts[i][1] for i in have)


def _hub_found(store: str, repo: str, rel: str, s: SplitName, parts: tuple[Path, ...]) -> Found:
    name = f"{repo}:{s.tag}" if s.tag else f"{repo}/{rel}"
    keys = {f"{repo}/{rel}".lower(), Path(s.prefix).name.lower()}
    if s.tag:
        keys.add(f"{repo}:{s.tag}".lower())
    return Found(name, store, parts[0], parts, frozenset(keys), repo=repo, tag=s.tag)


def read_hub_cache(root: Path, store: str = "huggingface") -> Iterator[Found | Skipped]:
    """models--ORG--REPO/snapshots/<commit>/**.gguf; the snapshot refs/main names comes first, and a file of
    an older snapshot counts only when the newer ones do not have it."""
    if not root.is_dir():
        return
    for repo_dir in sorted(root.glob("models--*")):
        org, _, name = repo_dir.name[len("models--"):].partition("--")
        if not org or not name:
            continue
        repo = f"{org}/{name}"
        snaps = repo_dir / "snapshots"
        if not snaps.is_dir():
            continue
        try:
            main = (repo_dir / "refs" / "main").read_text().strip()
        except OSError:
            main = ""
        commits = sorted((d for d in snaps.iterdir() if d.is_dir()), key=lambda d: (d.name != main, d.name))
        seen: set[str] = set()
        for commit in commits:
            files = []
            for p in commit.rglob("*.gguf"):
                rel = p.relative_to(commit).as_posix()
                if rel in seen:
                    continue
                if not p.exists():  # a link whose blob was deleted
                    yield Skipped(p, "the snapshot links to a blob that is gone")
                    continue
                files.append((rel, p))
            for item in _group_files(files, commit):
                if isinstance(item, Skipped):
                    yield item
                    continue
                rel, s, parts = item
                seen.add(rel)
                yield _hub_found(store, repo, rel, s, parts)


def read_lmstudio(root: Path) -> Iterator[Found | Skipped]:
    """PUBLISHER/REPO/*.gguf (LM Studio keeps the Hub's names, one folder per repository)."""
    if not root.is_dir():
        return
    for repo_dir in sorted(p for p in root.glob("*/*") if p.is_dir()):
        repo = f"{repo_dir.parent.name}/{repo_dir.name}"
        files = [(p.relative_to(repo_dir).as_posix(), p) for p in repo_dir.rglob("*.gguf") if p.is_file()]
        for item in _group_files(files, repo_dir):
            yield item if isinstance(item, Skipped) else _hub_found("lmstudio", repo, *item)


def read_llama_cache(root: Path) -> Iterator[Found | Skipped]:
    """llama.cpp's cache: the Hub's layout (llama.cpp since it shares the Hub's cache), and the older flat
    files, named by the manifest=ORG=REPO=TAG.json beside them when one lists the file, else by their stem."""
    if not root.is_dir():
        return
    yield from read_hub_cache(root, "llama.cpp")
    named: dict[str, tuple[str, str]] = {}  # file name -> (repo, tag)
    for m in root.glob("manifest=*.json"):
        bits = m.name[len("manifest="):-len(".json")].split("=")
        try:
            data = json.loads(m.read_text(encoding="utf-8")) if m.stat().st_size < MAX_MANIFEST_BYTES else {}
            rfile = str(data["ggufFile"]["rfilename"]).rsplit("/", 1)[-1]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if len(bits) >= 2:
            named[rfile] = (f"{bits[0]}/{bits[1]}", bits[2] if len(bits) > 2 else "latest")
    files = [(p.name, p) for p in root.glob("*.gguf") if p.is_file()]
    for item in _group_files(files, root):
        if isinstance(item, Skipped):
            yield item
            continue
        rel, s, parts = item
        # the file is <rfilename>, or <ORG>_<REPO>_<rfilename> in later releases
        hit = next(((r, t) for f, (r, t) in named.items() if rel == f or rel.endswith("_" + f)), None)
        stem = Path(s.prefix).name
        keys = {stem.lower(), rel.lower()}
        name = stem
        if hit is not None:
            repo, tag = hit
            tag = s.tag if tag == "latest" else tag.upper()
            name = f"{repo}:{tag}" if tag else repo
            keys.add(name.lower())
            yield Found(name, "llama.cpp", parts[0], parts, frozenset(keys), repo=repo, tag=tag)
        else:
            yield Found(name, "llama.cpp", parts[0], parts, frozenset(keys), tag=s.tag)


_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")


def read_ollama(root: Path) -> Iterator[Found | Skipped]:
    """manifests/<host>/<namespace>/<model>/<tag> -> the model layer's blob. Ollama's names: NAME:TAG for its
    library, NAMESPACE/NAME:TAG for other namespaces, HOST/NAMESPACE/NAME:TAG for other hosts (hf.co/ORG/REPO:
    QUANT for what Ollama pulled from the Hub, which ORG/REPO:QUANT finds too); NAME alone is NAME:latest."""
    manifests = root / "manifests"
    if not manifests.is_dir():
        return
    for m in sorted(manifests.glob("*/*/*/*")):
        if not m.is_file():
            continue
        host, namespace, model, tag = m.relative_to(manifests).parts
        if host == OLLAMA_REGISTRY:
            name = f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"
        else:
            name = f"{host}/{namespace}/{model}:{tag}"
        try:
            if m.stat().st_size > MAX_MANIFEST_BYTES:
                raise ValueError("too large to be a manifest")
            manifest = json.loads(m.read_text(encoding="utf-8"))
            layers = manifest["layers"]
            if not isinstance(layers, list):
                raise TypeError("layers is not a list")
        except (OSError, ValueError, KeyError, TypeError) as e:
            yield Skipped(m, f"Ollama manifest of {name} does not parse ({e})")
            continue
        kinds = [layer.get("mediaType") for layer in layers if isinstance(layer, dict)]
        model_layer = next((layer for layer in layers if isinstance(layer, dict)
                            and layer.get("mediaType") == OLLAMA_MODEL_LAYER), None)
        if model_layer is None:
            yield Skipped(m, f"{name} has no model layer ({OLLAMA_MODEL_LAYER})")
            continue
        if OLLAMA_ADAPTER_LAYER in kinds:
            yield Skipped(m, f"{name} applies a LoRA adapter layer, which page-local does not load")
            continue
        d = _DIGEST.fullmatch(str(model_layer.get("digest", "")))
        if d is None:
            yield Skipped(m, f"{name}: the model layer's digest {model_layer.get('digest')!r} is not sha256:<hex>")
            continue
        blob = root / "blobs" / f"sha256-{d.group(1)}"
        if not blob.is_file():
            yield Skipped(m, f"{name}: its model blob {blob.name} is missing")
            continue
        want = model_layer.get("size")
        if isinstance(want, int) and blob.stat().st_size != want:
            yield Skipped(m, f"{name}: its model blob is {blob.stat().st_size} bytes, the manifest says {want} "
                             "(a download in progress?)")
            continue
        keys = {name.lower()}
        if tag == "latest":
            keys.add(name[: -len(":latest")].lower())
        if host in ("hf.co", "huggingface.co"):  # Ollama's pulls from the Hub answer to the Hub's names too
            keys.add(f"{namespace}/{model}:{tag}".lower())
        yield Found(name, "ollama", blob, (blob,), frozenset(keys), repo=f"{namespace}/{model}", tag=tag)


def _readers() -> list[tuple[Path, object]]:
    out: list[tuple[Path, object]] = [(hf_cache_dir(), read_hub_cache)]
    out += [(d, read_llama_cache) for d in llama_cache_dirs()]
    out += [(d, read_lmstudio) for d in lmstudio_dirs()]
    out += [(d, read_ollama) for d in ollama_dirs()]
    return out


def scan() -> tuple[list[Found], list[Skipped]]:
    """Every model file the stores name (headers not read) and what was skipped. A store folder reached twice
    ($LLAMA_CACHE set to the Hub's cache) is read once; one file under two names (a link from LM Studio's
    folder into the Hub's cache) is listed under each, since each name finds it."""
    found: list[Found] = []
    skipped: list[Skipped] = []
    seen_dirs: set[Path] = set()
    for root, reader in _readers():
        try:
            real = root.resolve()
        except OSError:
            continue
        if real in seen_dirs:
            continue
        seen_dirs.add(real)
        try:
            for item in reader(root):
                if isinstance(item, Skipped):
                    skipped.append(item)
                    continue
                found.append(item)
        except OSError as e:  # a folder that cannot be read (permissions): the rest is still listed
            skipped.append(Skipped(root, f"cannot be read ({e.strerror or e})"))
    return found, skipped


def discover() -> tuple[list[Found], list[Skipped]]:
    """scan(), with each model's header read: those that cannot be run here move to the skipped list."""
    found, skipped = scan()
    usable = []
    for f in found:
        try:
            f.details()
            usable.append(f)
        except Unusable as e:
            skipped.append(Skipped(f.path, f"{f.name} ({f.store}): {e}"))
    return usable, skipped


# --- names -------------------------------------------------------------------------------------

_HUB_PREFIXES = ("https://huggingface.co/", "https://hf.co/", "huggingface.co/", "hf.co/")
PREFERRED_QUANTS = ("Q4_K_M", "Q8_0")  # llama.cpp's choice when a name gives none (common/download.cpp)


def hub_ref(text: str) -> str:
    """'hf.co/ORG/REPO:Q4_K_M' -> 'ORG/REPO:Q4_K_M' (the Hub's host, as Ollama and llama.cpp spell it, dropped)."""
    for p in _HUB_PREFIXES:
        if text.lower().startswith(p):
            return text[len(p):]
    return text


def matches(query: str, found: list[Found]) -> list[Found]:
    """The models a name means: an exact name (case-insensitive; hf.co/ dropped); else, for ORG/REPO without a
    quantization, the repo's files (Q4_K_M, then Q8_0 when there are several, as llama.cpp chooses)."""
    q = query.strip().lower()
    exact = [f for f in found if q in f.keys]
    short = hub_ref(q)
    if not exact and short != q:
        exact = [f for f in found if short in f.keys]
    if exact or ":" in short:
        return exact
    repo = [f for f in found if f.repo and f.repo.lower() == short and f.store != "ollama"]
    for tag in PREFERRED_QUANTS:
        pick = [f for f in repo if f.tag == tag]
        if pick and len(repo) > 1:
            return pick
    return repo


def same_model(a: Found, b: Found) -> bool:
    """One model reached twice (a copy in another store): the same file name and size."""
    return a.path.name == b.path.name and a.size == b.size

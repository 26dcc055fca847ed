"""`page-local pull ORG/REPO[:QUANT]`: a GGUF from the Hugging Face Hub into the Hub's own cache.

The file is chosen as `llama-server -hf ORG/REPO:QUANT` chooses it (llama.cpp common/download.cpp
find_best_model): the first .gguf model file (not a projector, an importance matrix or a draft head) whose
name holds QUANT followed by '.' or '-', case-insensitive; without QUANT, Q4_K_M, then Q8_0, then the first
model file. A split model (`-00001-of-00003.gguf`) is chosen by its first part and downloaded whole.

huggingface_hub does the transfer into the cache (store/discover.py reads it back): each file goes to a
temporary blob that is renamed into place only when complete, and linked into snapshots/<commit>/ after
that, so an interrupted pull leaves nothing that a later run takes for a model (a split model missing a
part is skipped by the listing too); a connection that drops mid-file is resumed with a range request.
Each file is then checked against the sha256 the Hub lists for it (its LFS object id); one that differs is
removed. $HF_TOKEN (or a token saved by `hf auth login`) reaches gated and private repos; $HF_ENDPOINT
points at another Hub (a mirror; the tests' stand-in). Both are read at call time, not at import.

Every failure is a ModelInstallError whose message is one line saying what to do: no such repo, no such
quantization (the ones there are listed), gated or refused, the Hub not reachable, the disk full.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from page_local.errors import ModelInstallError
from page_local.store import discover

DEFAULT_ENDPOINT = "https://huggingface.co"
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_QUANT = re.compile(r"[A-Za-z0-9_]+")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class Pulled:
    name: str  # what --model takes: ORG/REPO:QUANT
    path: Path  # the file llama.cpp opens (a split model's first part)
    parts: tuple[Path, ...]
    size: int  # bytes, every part
    downloaded: bool  # False: every part was in the cache already


def parse_ref(ref: str) -> tuple[str, str | None]:
    """'ORG/REPO[:QUANT]' or 'hf.co/ORG/REPO:QUANT' -> (ORG/REPO, QUANT or None); ValueError for anything else."""
    text = discover.hub_ref(ref.strip())
    repo, _, quant = text.partition(":")
    if not _REPO.fullmatch(repo) or (quant and not _QUANT.fullmatch(quant)) or repo.endswith((".", "-")):
        raise ValueError(f"{ref!r} is not a Hugging Face model name: give ORG/REPO or ORG/REPO:QUANT, like "
                         "bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M (hf.co/ in front is accepted)")
    return repo, (quant or None)


def available_quants(files: list[str]) -> list[str]:
    """The quantization tags of a repo's model files, as `pull ORG/REPO:QUANT` takes them."""
    tags = {s.tag for f in files if discover.is_model_file(f) and (s := discover.split_name(f)) and s.tag}
    return sorted(tags)


def choose(files: list[str], quant: str | None) -> list[str] | None:
    """The files of the model `quant` names in a repo's file list (every part of a split model, in order),
    or None when it has none. As llama.cpp's find_best_model chooses."""
    candidates = [f for f in files if discover.is_model_file(f)]
    for tag in ([quant] if quant else list(discover.PREFERRED_QUANTS)):
        pattern = re.compile(re.escape(tag) + r"[.-]", re.IGNORECASE)
        for f in candidates:
            s = discover.split_name(f)
            if pattern.search(f) and s is not None and (s.count == 1 or s.index == 1):
                return _parts(candidates, f)
    if quant is None:
        for f in candidates:
            s = discover.split_name(f)
            if s is not None and (s.count == 1 or s.index == 1):
                return _parts(candidates, f)
    return None


def _parts(files: list[str], first: str) -> list[str]:
    s = discover.split_name(first)
    if s.count == 1:
        return [first]
    parts = {t.index: f for f in files if (t := discover.split_name(f)) and t.prefix == s.prefix and t.count == s.count}
    missing = [i for i in range(1, s.count + 1) if i not in parts]
    if missing:
        raise ModelInstallError(f"{first} is part 1 of {s.count}, but the repository lacks part(s) "
                                f"{', '.join(map(str, missing))}: it cannot be downloaded whole")
    return [parts[i] for i in range(1, s.count + 1)]


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _token() -> str | bool | None:
    # None: huggingface_hub's own lookup (HF_TOKEN, then a token `hf auth login` saved)
    return os.environ.get("HF_TOKEN") or None


def _size_text(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _explain(e: BaseException, repo: str, what: str) -> ModelInstallError:
    """A huggingface_hub / network / disk error -> one line saying what to do."""
    from huggingface_hub import errors as hf

    host = endpoint()
    if isinstance(e, hf.GatedRepoError):
        return ModelInstallError(f"{repo} is gated: accept its terms at {host}/{repo} while signed in, then set "
                                 "HF_TOKEN to a token of that account (https://huggingface.co/settings/tokens)")
    if isinstance(e, hf.RepositoryNotFoundError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        hint = ("; the token in HF_TOKEN was refused" if status == 401 and _token()
                else "; if it is private, set HF_TOKEN to a token that can read it")
        return ModelInstallError(f"no model repository {repo} on {host}{hint}")
    if isinstance(e, hf.RevisionNotFoundError):
        return ModelInstallError(f"{repo} has no branch main on {host}")
    if isinstance(e, hf.LocalEntryNotFoundError):  # huggingface_hub's words for "the HEAD request failed"
        return ModelInstallError(f"cannot reach {host} to download {repo} ({_reason(e)}): check the network, "
                                 "or HF_ENDPOINT")
    if isinstance(e, getattr(hf, "RemoteEntryNotFoundError", hf.EntryNotFoundError)):
        return ModelInstallError(f"{what} is listed in {repo} but {host} does not serve it; try again later")
    if isinstance(e, hf.HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            return ModelInstallError(f"{host} refused access to {repo} (HTTP {status}): set HF_TOKEN to a token "
                                     "that can read it")
        return ModelInstallError(f"{host} answered HTTP {status} for {what} of {repo}; try again later")
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        cache = discover.hf_cache_dir()
        return ModelInstallError(f"the disk is full: {what} of {repo} did not fit in {cache} "
                                 f"({_size_text(_free(cache))} free); free some space, or point HF_HUB_CACHE elsewhere")
    if _is_network(e):
        return ModelInstallError(f"cannot reach {host} to download {repo} ({_reason(e)}): check the network, "
                                 "or HF_ENDPOINT")
    if isinstance(e, OSError) and "Consistency check failed" in str(e):
        return ModelInstallError(f"the download of {what} was cut short (the size differs from the Hub's); run "
                                 "the pull again")
    return ModelInstallError(f"pulling {repo} failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}")


def _is_network(e: BaseException) -> bool:
    from huggingface_hub import errors as hf

    if isinstance(e, (hf.LocalEntryNotFoundError, hf.OfflineModeIsEnabled, ConnectionError, TimeoutError)):
        return True
    mod = type(e).__module__.split(".")[0]
    return mod.startswith("httpx") and any(k in type(e).__name__ for k in ("Connect", "Timeout", "Network",
                                                                         "Protocol", "Read"))


def _reason(e: BaseException) -> str:
    while e.__cause__ is not None and not str(e).strip():
        e = e.__cause__
    text = " ".join(str(e).split()) or type(e).__name__
    if "An error happened while trying to locate the file" in text and e.__cause__ is not None:
        text = " ".join(str(e.__cause__).split()) or type(e.__cause__).__name__
    return text[:200]


def _free(path: Path) -> int:
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return 0


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def _forget(pointer: Path) -> None:
    """Remove a snapshot link and its blob (a file that failed its checksum): the next pull fetches it again."""
    blob = pointer.resolve()
    pointer.unlink(missing_ok=True)
    if blob != pointer:
        blob.unlink(missing_ok=True)


def _from_cache(repo: str, quant: str | None) -> discover.Found | None:
    """The model a pull would fetch, when the Hub's cache holds it already (a pull without a network)."""
    found = [f for f in discover.read_hub_cache(discover.hf_cache_dir()) if isinstance(f, discover.Found)]
    mine = [f for f in found if f.repo.lower() == repo.lower()]
    names = [f.path.name for f in mine]
    chosen = choose(names, quant) if names else None
    return next((f for f in mine if chosen and f.path.name == chosen[0]), None)


Progress = Callable[[str, int, int], None]  # (file being fetched, bytes done over all parts, total bytes)


def pull(ref: str, progress: Progress | None = None) -> Pulled:
    """Download the model `ref` names (ORG/REPO[:QUANT], hf.co/ in front accepted) into the Hub's cache and
    return where it is; every part already cached is reused. Raises ValueError for a malformed ref and
    ModelInstallError (one line) for everything else."""
    repo, quant = parse_ref(ref)
    from huggingface_hub import HfApi, hf_hub_download
    from tqdm.auto import tqdm as _tqdm

    cache = discover.hf_cache_dir()
    try:
        info = HfApi(endpoint=endpoint(), token=_token()).model_info(repo, files_metadata=True)
    except Exception as e:  # noqa: BLE001 -- every cause becomes one line below
        if _is_network(e):
            cached = _from_cache(repo, quant)
            if cached is not None:  # offline, but it is here: nothing to fetch
                return Pulled(f"{repo}:{cached.tag}" if cached.tag else cached.name, cached.path, cached.parts,
                              cached.size, downloaded=False)
        raise _explain(e, repo, "the file list") from None
    siblings = {s.rfilename: s for s in info.siblings or ()}
    files = choose(sorted(siblings), quant)
    if files is None:
        quants = available_quants(list(siblings))
        if quant is None:
            raise ModelInstallError(f"{repo} has no GGUF model file: page-local runs GGUF files (look for a "
                                    "repository named ...-GGUF)")
        if not quants:
            raise ModelInstallError(f"{repo} has no {quant} file, and its GGUF files have no quantization tag: "
                                    f"run `page-local pull {repo}` for its first model file")
        raise ModelInstallError(f"{repo} has no {quant} file; it has {', '.join(quants)}: run "
                                f"`page-local pull {repo}:{quants[0]}` (or another of these)")
    sizes = [siblings[f].size or (siblings[f].lfs.size if siblings[f].lfs else 0) or 0 for f in files]
    total = sum(sizes)
    revision = info.sha if info.sha and _COMMIT.fullmatch(info.sha) else None
    tag = discover.split_name(files[0]).tag
    name = f"{repo}:{tag}" if tag else f"{repo}/{files[0]}"

    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    need = sum(sz for f, sz in zip(files, sizes)
               if not (revision and (repo_dir / "snapshots" / revision / f).exists()))
    if need and _free(cache) < need:
        raise ModelInstallError(f"the disk is full for this: {name} needs {_size_text(need)}, {cache} has "
                                f"{_size_text(_free(cache))} free; free some space, or point HF_HUB_CACHE elsewhere")

    done = [0]

    class Bar(_tqdm):  # huggingface_hub's byte counts, summed over the parts, to `progress`
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            kwargs.pop("name", None)
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            done[0] += n
            if progress is not None:
                progress(current[0], done[0], total)
            return super().update(n)

    current = [files[0]]
    paths, downloaded = [], False
    for f, size in zip(files, sizes):
        current[0] = f
        pointer = repo_dir / "snapshots" / revision / f if revision else None
        was_there = pointer is not None and pointer.exists()
        try:
            got = Path(hf_hub_download(repo, f, revision=revision, cache_dir=cache, endpoint=endpoint(),
                                       token=_token(), tqdm_class=Bar))
        except Exception as e:  # noqa: BLE001
            raise _explain(e, repo, f) from None
        if was_there:
            done[0] += size
        else:
            downloaded = True
            sib = siblings[f]
            want = sib.lfs.sha256 if sib.lfs else None
            if want:  # the Hub's sha256 of the file (its LFS object id); huggingface_hub checks only the size
                if progress is not None:
                    progress(f"checking {f}", done[0], total)
                got_sha = _sha256(got)
                if got_sha != want:
                    _forget(got)
                    raise ModelInstallError(f"{f} of {repo} arrived with sha256 {got_sha[:12]}…, the Hub lists "
                                            f"{want[:12]}…; it was removed: run the pull again")
        paths.append(got)
        if progress is not None:
            progress(f, done[0], total)
    if revision:  # huggingface_hub records refs/main only for a download by branch name; this one was by commit
        ref = repo_dir / "refs" / "main"
        try:
            if not ref.is_file() or ref.read_text().strip() != revision:
                ref.parent.mkdir(parents=True, exist_ok=True)
                ref.write_text(revision)
        except OSError:
            pass  # the listing reads every snapshot without it
    return Pulled(name, paths[0], tuple(paths), sum(p.stat().st_size for p in paths), downloaded)

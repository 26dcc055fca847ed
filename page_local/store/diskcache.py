"""A disk cache of prompt prefixes: a long prompt read once is not read again, after a restart, in a new chat or
from another program on the same machine.

What is kept. After a prefill of at least `MIN_TOKENS` new tokens on a fresh conversation, the cache of exactly that
prompt (llama.cpp's sequence state and page-local's bookkeeping: store/persist.py's format) is written here, before the
gate evicts or parks anything, off the path of the answer's first token (a writer thread). A later prompt that starts
with a saved prompt's tokens restores the longest such prefix and reads only the rest.

Keys. A state restores only into the same weights, cache type and flash-attention setting, so those make the *model
key* (a folder). Inside it each entry is indexed by chained block hashes of its tokens (hash i covers tokens
[0, (i+1) * BLOCK), as prefix caching in vLLM and the llama.cpp proposals for a disk cache do): a lookup compares the
new prompt's hashes with each entry's, then compares the tokens themselves before anything is restored -- never a
hash alone.

Layout: <root>/<namespace>/<model key>/<entry>.pglc (the state) + <entry>.json (its index: written last, so an entry
whose index exists is whole). One namespace per API key (the hash of the key, never the key), so that no key reads,
or times, another key's documents; "shared" without keys.

Safety. A truncated, corrupt or foreign file, a state llama.cpp refuses, a full disk, a read-only folder, another
process deleting an entry while it is read: the entry is skipped (and removed where it is ours), one line is logged,
and the prompt is read as without a cache -- never a wrong answer (the tokens are compared), never a crash. Files are
written atomically (temp file + rename) so two processes sharing the folder see whole files or none. The size limit
holds over the whole root: after each write the least recently used entries (by their index's mtime, touched on
every hit) go first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from page_local.errors import StateFileError
from page_local.store import persist
from page_local.store.home import atomic_write

log = logging.getLogger("page_local.diskcache")

BLOCK = 256  # tokens per hash block
MIN_TOKENS = 1024  # a prefill shorter than this is not written, and a match shorter than this is not restored
INDEX_VERSION = 1
SHARED = "shared"
ENV_DIR = "PAGE_LOCAL_KV_CACHE_DIR"


def default_root() -> Path:
    """$PAGE_LOCAL_KV_CACHE_DIR, else the user's cache folder (platformdirs) / kv."""
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env).expanduser()
    import platformdirs  # imported on first use

    return Path(platformdirs.user_cache_dir("page-local")) / "kv"


def default_max_bytes(root: Path | None = None) -> int:
    """A tenth of the free disk where the cache lives, between 1 GiB and 64 GiB."""
    root = Path(root or default_root())
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = 10 << 30
    return int(min(64 << 30, max(1 << 30, free // 10)))


def namespace_for(api_key: str | None) -> str:
    """The folder of one API key: a hash of the key (the key itself never reaches the disk)."""
    if not api_key:
        return SHARED
    return "key-" + hashlib.sha256(api_key.encode("utf-8")).hexdigest()[:24]


def weights_fingerprint(gguf_path: str | os.PathLike) -> str:
    """The file's size and 16 samples of 4 KiB spread over it, hashed: a model replaced under the same name (a
    fine-tune of the same shapes has the same header and size) gets another key. Costs 16 reads, not a full hash."""
    p = Path(gguf_path)
    h = hashlib.sha256()
    size = p.stat().st_size
    h.update(struct.pack("<Q", size))
    with open(p, "rb") as f:
        for i in range(16):
            f.seek(max(0, (size - 4096) * i // 15))
            h.update(f.read(4096))
    return h.hexdigest()[:16]


def model_key(model_id: str, fingerprint: str, cache_type: str, flash_attn: str) -> str:
    """The folder of states that restore into this model, cache type and flash-attention setting."""
    raw = "\x1f".join((model_id, fingerprint, cache_type, flash_attn))
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()[:20]


def block_hashes(tokens, seed: str) -> list[str]:
    """Chained hashes: entry i covers tokens [0, (i + 1) * BLOCK); a partial last block has none."""
    out, prev = [], hashlib.sha256(seed.encode("utf-8")).digest()
    for i in range(len(tokens) // BLOCK):
        block = tokens[i * BLOCK:(i + 1) * BLOCK]
        prev = hashlib.sha256(prev + struct.pack(f"<{BLOCK}i", *block)).digest()
        out.append(prev.hex()[:32])
    return out


def _leading_equal(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    a, b = list(a[:n]), list(b[:n])
    if a == b:
        return n
    lo, hi = 0, n
    while lo < hi:  # binary search on slice equality: C-speed comparisons
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class Hit:
    """A saved prefix that the new prompt shares: the snapshot (its history is the saved prompt) and how many of
    the new prompt's first tokens it holds."""

    snapshot: persist.Snapshot
    n_common: int
    path: Path
    seconds: float  # reading and checking the file


@dataclass(frozen=True)
class Entry:
    """One saved prompt, as `page-local cache` lists it."""

    path: Path
    namespace: str
    model_key: str
    model_id: str
    n_tokens: int
    nbytes: int
    used: float  # last written or restored (epoch seconds)


class DiskCache:
    """The cache at `root`, for one namespace, bounded by max_bytes over the whole root."""

    def __init__(self, root: str | os.PathLike | None = None, max_bytes: int | None = None,
                 namespace: str = SHARED, min_tokens: int = MIN_TOKENS):
        self.root = Path(root).expanduser() if root is not None else default_root()
        if max_bytes is not None and (isinstance(max_bytes, bool) or int(max_bytes) <= 0):
            raise ValueError(f"the disk cache's size limit must be positive, got {max_bytes!r}")
        self.max_bytes = int(max_bytes) if max_bytes is not None else default_max_bytes(self.root)
        if isinstance(min_tokens, bool) or int(min_tokens) < BLOCK:
            raise ValueError(f"min_tokens must be at least {BLOCK}, got {min_tokens!r}")
        self.min_tokens = int(min_tokens)
        self.namespace = namespace
        self._writer: _Writer | None = None
        self._lock = threading.Lock()

    def in_namespace(self, namespace: str) -> DiskCache:
        """The same cache (root, limit, writer) seen from another namespace."""
        other = DiskCache.__new__(DiskCache)
        other.__dict__.update(self.__dict__)
        other.namespace = namespace
        return other

    def _folder(self, key: str) -> Path:
        return self.root / self.namespace / key

    # --- reading ---------------------------------------------------------------------------------------------

    def lookup(self, key: str, tokens: list[int]) -> Hit | None:
        """The saved prompt sharing the longest prefix with tokens (at least min_tokens of them), read and checked;
        None when there is none. Bad entries met on the way are removed and logged."""
        folder = self._folder(key)
        try:
            metas = sorted(folder.glob("*.json"))
        except OSError:
            return None
        if not metas:
            return None
        mine = block_hashes(tokens, key)
        ranked = []
        for meta in metas:
            index = self._read_index(meta)
            if index is None:
                continue
            n = _leading_equal(mine, index["blocks"])
            if n * BLOCK >= self.min_tokens:
                ranked.append((n, meta))
        for _, meta in sorted(ranked, reverse=True):
            t0 = time.perf_counter()
            path = meta.with_suffix(".pglc")
            try:
                snap, _extra = persist.read(path)
            except StateFileError as e:
                self._drop(meta, f"unreadable ({e})")
                continue
            n_common = common_prefix(snap.history, tokens)
            if n_common < self.min_tokens:  # a hash collision or a tampered index: the tokens decide
                log.warning("disk cache: %s: its tokens differ from its index; removed", path.name)
                self._drop(meta, None)
                continue
            try:
                os.utime(meta)  # least recently used goes first
            except OSError:
                pass
            return Hit(snap, n_common, path, time.perf_counter() - t0)
        return None

    def _read_index(self, meta: Path) -> dict | None:
        try:
            index = json.loads(meta.read_text(encoding="utf-8"))
            if (not isinstance(index, dict) or index.get("version") != INDEX_VERSION
                    or not isinstance(index.get("blocks"), list)
                    or not all(isinstance(b, str) for b in index["blocks"])):
                raise ValueError("not a page-local index")
            return index
        except FileNotFoundError:  # another process removed it just now
            return None
        except (OSError, UnicodeDecodeError, ValueError) as e:
            self._drop(meta, f"unreadable index ({e})")
            return None

    def _drop(self, meta: Path, why: str | None) -> None:
        if why:
            log.warning("disk cache: %s: %s; removed", meta.stem, why)
        for p in (meta, meta.with_suffix(".pglc")):
            try:
                p.unlink(missing_ok=True)
            except OSError:
                pass

    def discard(self, hit: Hit, why: str) -> None:
        """A hit the engine could not restore (llama.cpp refused it): removed, one line logged."""
        self._drop(hit.path.with_suffix(".json"), why)

    # --- writing ---------------------------------------------------------------------------------------------

    def save(self, key: str, snap: persist.Snapshot) -> Path | None:
        """Write one saved prompt (now, on this thread); None if it could not be written (logged, never raised)."""
        blocks = block_hashes(list(snap.history), key)
        if len(snap.history) < self.min_tokens or not blocks:
            return None
        folder = self._folder(key)
        meta = folder / f"{blocks[-1]}-{len(snap.history)}.json"
        if meta.exists():  # the same prompt again: only its place in the LRU order moves
            try:
                os.utime(meta)
            except OSError:
                pass
            return meta.with_suffix(".pglc")
        try:
            persist.save(snap, meta.with_suffix(".pglc"))
            index = {"version": INDEX_VERSION, "model_id": snap.model_id, "n_tokens": len(snap.history),
                     "blocks": blocks, "created": time.time()}
            with atomic_write(meta, "w") as f:
                json.dump(index, f)
        except OSError as e:
            log.warning("disk cache: not written (%s: %s)", folder, e.strerror or e)
            self._drop(meta, None)
            return None
        self.trim()
        return meta.with_suffix(".pglc")

    def save_later(self, key: str, snap: persist.Snapshot) -> None:
        """Queue a write on the cache's writer thread (the answer does not wait for the disk)."""
        with self._lock:
            if self._writer is None or not self._writer.is_alive():
                self._writer = _Writer(self)
        self._writer.jobs.put((key, snap))

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued write is on disk (tests, a shutdown)."""
        w = self._writer
        if w is not None and w.is_alive():
            w.drained(timeout)

    def close(self) -> None:
        self.flush()
        w, self._writer = self._writer, None
        if w is not None:
            w.jobs.put(None)

    # --- the whole root: listing, size, clearing ---------------------------------------------------------------

    def entries(self) -> list[Entry]:
        """Every whole entry under the root, every namespace, least recently used first."""
        out = []
        try:
            metas = list(self.root.glob("*/*/*.json"))
        except OSError:
            return out
        for meta in metas:
            try:
                st = meta.stat()
                index = json.loads(meta.read_text(encoding="utf-8"))
                size = meta.with_suffix(".pglc").stat().st_size + st.st_size
            except (OSError, ValueError):
                continue
            if not isinstance(index, dict):
                continue
            out.append(Entry(meta.with_suffix(".pglc"), meta.parent.parent.name, meta.parent.name,
                             str(index.get("model_id", "?")), int(index.get("n_tokens", 0) or 0), size, st.st_mtime))
        return sorted(out, key=lambda e: e.used)

    def nbytes(self) -> int:
        total = 0
        for p in self.root.glob("*/*/*"):
            try:
                total += p.stat().st_size
            except OSError:
                pass
        return total

    def trim(self) -> int:
        """Remove the least recently used entries (and stray files) until the root is within the limit; returns
        how many entries went."""
        now = time.time()
        for p in self.root.glob("*/*/*"):  # a .pglc whose index never came (a crash mid-write), old temp files
            try:
                if p.suffix == ".pglc" and not p.with_suffix(".json").exists() and now - p.stat().st_mtime > 60:
                    p.unlink()
                elif p.name.startswith(".") and p.suffix == ".tmp" and now - p.stat().st_mtime > 3600:
                    p.unlink()
            except OSError:
                pass
        entries = self.entries()
        total = sum(e.nbytes for e in entries)
        gone = 0
        for e in entries:
            if total <= self.max_bytes:
                break
            self._drop(e.path.with_suffix(".json"), None)
            total -= e.nbytes
            gone += 1
        return gone

    def clear(self) -> int:
        """Remove every entry under the root; returns the bytes freed."""
        freed = 0
        for p in self.root.glob("*/*/*"):
            try:
                freed += p.stat().st_size
                p.unlink()
            except OSError:
                pass
        return freed


class _Writer(threading.Thread):
    """One thread writing queued snapshots, in order; a failure is logged and the next one goes on."""

    def __init__(self, cache: DiskCache):
        super().__init__(name="page-local-disk-cache", daemon=True)
        self.cache = cache
        self.jobs: queue.Queue = queue.Queue()
        self.start()

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                self.cache.save(*job)
            except Exception as e:  # noqa: BLE001 -- a write must never take the process down
                log.warning("disk cache: not written (%s)", e)
            finally:
                self.jobs.task_done()

    def drained(self, timeout: float | None) -> None:
        if timeout is None:
            self.jobs.join()
            return
        end = time.monotonic() + timeout
        while self.jobs.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.01)

"""The disk cache of prompt prefixes as files (store/diskcache.py): keys, lookups that compare tokens, namespaces,
the size limit, and every bad file skipped and removed, never raised. The engine's use of it (restoring a prefix
on the real model) is tested in tests/test_diskcache_engine.py."""

from __future__ import annotations

import json
import os
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from page_local.store import persist
from page_local.store.diskcache import BLOCK, DiskCache, block_hashes, namespace_for, weights_fingerprint

KEY = "m" * 20


def snap(tokens, nbytes: int = 1000) -> persist.Snapshot:
    return persist.Snapshot(model_id="llama-0123456789abcdef", n_ctx=8192, history=tuple(tokens),
                            positions=tuple(range(len(tokens))), state=bytes(nbytes))


def doc(n: int, seed: int = 0) -> list[int]:
    return [(i * 7919 + seed * 104729) % 49000 + 1 for i in range(n)]


@pytest.fixture
def cache(tmp_path):
    return DiskCache(tmp_path / "kv", max_bytes=1 << 30, min_tokens=BLOCK * 4)


def test_the_longest_saved_prefix_is_found_and_its_tokens_compared(cache):
    d = doc(3000)
    cache.save(KEY, snap(d[:2000]))
    cache.save(KEY, snap(d[:1200]))
    hit = cache.lookup(KEY, d + [5, 6, 7])
    assert hit is not None and hit.n_common == 2000 and hit.snapshot.history == tuple(d[:2000])
    # a prompt that diverges inside the saved one shares exactly up to the divergence (not a block boundary)
    other = d[:1500] + [1] * 600
    hit = cache.lookup(KEY, other)
    assert hit is not None and hit.n_common == 1500


def test_short_matches_another_model_and_unrelated_prompts_miss(cache):
    d = doc(3000)
    cache.save(KEY, snap(d[:2000]))
    assert cache.lookup(KEY, d[:BLOCK * 3]) is None  # below min_tokens
    assert cache.lookup("x" * 20, d) is None  # another model key
    assert cache.lookup(KEY, doc(3000, seed=1)) is None
    assert cache.save(KEY, snap(d[:BLOCK * 2])) is None  # too short to be worth writing


def test_namespaces_never_share_files(cache, tmp_path):
    d = doc(2000)
    a, b = cache.in_namespace(namespace_for("key-a")), cache.in_namespace(namespace_for("key-b"))
    path = a.save(KEY, snap(d))
    assert a.lookup(KEY, d) is not None
    assert b.lookup(KEY, d) is None and cache.lookup(KEY, d) is None
    assert "key-a" not in str(path) and namespace_for("key-a") in str(path)
    assert namespace_for(None) == namespace_for("") == "shared"


def test_the_size_limit_holds_least_recently_used_first(tmp_path):
    cache = DiskCache(tmp_path / "kv", max_bytes=250_000, min_tokens=BLOCK * 4)
    docs = [doc(1500, seed=s) for s in range(4)]
    for i, d in enumerate(docs):
        cache.save(KEY, snap(d, nbytes=100_000))
        for j, e in enumerate(cache.entries()):  # mtimes a second apart: the order is the order written
            os.utime(e.path.with_suffix(".json"), (1000 + j, 1000 + j))
        assert cache.nbytes() <= 250_000
    assert len(cache.entries()) == 2
    assert [cache.lookup(KEY, d) is not None for d in docs] == [False, False, True, True]


def test_a_hit_moves_an_entry_to_the_back_of_the_queue(tmp_path):
    cache = DiskCache(tmp_path / "kv", max_bytes=250_000, min_tokens=BLOCK * 4)
    d0, d1, d2 = (doc(1500, seed=s) for s in range(3))
    cache.save(KEY, snap(d0, nbytes=100_000))
    cache.save(KEY, snap(d1, nbytes=100_000))
    for i, e in enumerate(cache.entries()):  # d0 older than d1 on disk
        os.utime(e.path.with_suffix(".json"), (1000 + i, 1000 + i))
    assert cache.lookup(KEY, d0) is not None  # d0 used now: d1 is the least recently used
    cache.save(KEY, snap(d2, nbytes=100_000))
    assert cache.lookup(KEY, d0) is not None and cache.lookup(KEY, d1) is None


def test_bad_files_are_skipped_removed_and_logged(cache, caplog):
    d = doc(2000)
    path = cache.save(KEY, snap(d))
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])  # truncated
    assert cache.lookup(KEY, d) is None
    assert not path.exists() and not path.with_suffix(".json").exists()
    assert "removed" in caplog.text
    # an index that lies about its tokens: the tokens decide
    path = cache.save(KEY, snap(d))
    other = snap(doc(2000, seed=3))
    persist.save(other, path)
    assert cache.lookup(KEY, d) is None and not path.exists()
    # an index that is not JSON, and a foreign file with a .json name
    path = cache.save(KEY, snap(d))
    path.with_suffix(".json").write_text("{not json")
    assert cache.lookup(KEY, d) is None and not path.exists()


def test_a_read_only_folder_or_a_full_disk_is_a_logged_miss(tmp_path, caplog, monkeypatch):
    cache = DiskCache(tmp_path / "kv", max_bytes=1 << 30, min_tokens=BLOCK * 4)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(persist, "save", full)
    assert cache.save(KEY, snap(doc(2000))) is None
    assert "No space left" in caplog.text
    assert list((tmp_path / "kv").glob("*/*/*")) == []  # nothing half-written is left for a later lookup


def test_writes_queued_on_the_writer_thread_land(cache):
    docs = [doc(1100, seed=s) for s in range(3)]
    for d in docs:
        cache.save_later(KEY, snap(d))
    cache.flush(timeout=30)
    assert all(cache.lookup(KEY, d) is not None for d in docs)
    assert cache.clear() > 0 and cache.entries() == []


def test_two_processes_writing_the_same_folder(tmp_path):
    """Writers racing on one folder: every entry that has an index is whole."""
    a = DiskCache(tmp_path / "kv", max_bytes=1 << 30, min_tokens=BLOCK * 4)
    b = DiskCache(tmp_path / "kv", max_bytes=1 << 30, min_tokens=BLOCK * 4)
    docs = [doc(1100, seed=s) for s in range(6)]
    threads = [threading.Thread(target=c.save, args=(KEY, snap(d))) for d in docs for c in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for d in docs:
        hit = a.lookup(KEY, d)
        assert hit is not None and hit.snapshot.history == tuple(d)


def test_block_hashes_chain(cache):
    d = doc(1000)
    h = block_hashes(d, KEY)
    assert len(h) == 1000 // BLOCK
    assert block_hashes(d[:BLOCK * 2], KEY) == h[:2]
    changed = list(d)
    changed[0] += 1
    assert all(x != y for x, y in zip(block_hashes(changed, KEY), h))  # a change early changes every later hash


def test_weights_fingerprint_sees_a_replaced_file_of_the_same_size(tmp_path):
    """Another fine-tune of the same shapes: the same header and size, other weights throughout."""
    import random

    p = tmp_path / "m.gguf"
    header = b"GGUF" + bytes(4092)
    p.write_bytes(header + random.Random(0).randbytes(1 << 20))
    before = weights_fingerprint(p)
    assert weights_fingerprint(p) == before
    p.write_bytes(header + random.Random(1).randbytes(1 << 20))
    assert weights_fingerprint(p) != before


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=0, max_value=10_000), flips=st.lists(st.integers(min_value=0), max_size=4),
       junk=st.binary(max_size=64))
def test_fuzz_the_loader_never_raises_and_never_returns_a_wrong_prefix(tmp_path_factory, cut, flips, junk):
    cache = DiskCache(tmp_path_factory.mktemp("kv"), max_bytes=1 << 30, min_tokens=BLOCK * 4)
    d = doc(1200)
    path = cache.save(KEY, snap(d, nbytes=200))
    raw = bytearray(path.read_bytes())
    for f in flips:
        raw[f % len(raw)] ^= 0xFF
    raw = raw[: max(0, len(raw) - cut)] + junk if cut else raw + junk
    path.write_bytes(bytes(raw))
    hit = cache.lookup(KEY, d)
    assert hit is None or hit.snapshot.history[: hit.n_common] == tuple(d[: hit.n_common])
    meta = path.with_suffix(".json")
    if meta.exists():
        meta.write_text(json.dumps({"version": 1, "blocks": [1, 2]}))
        assert cache.lookup(KEY, d) is None

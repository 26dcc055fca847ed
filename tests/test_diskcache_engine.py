"""The disk cache of prompt prefixes on the real model (engine/prefixes.py): a document read by one engine is
restored by the next (a restart, a new conversation), the answer is the same token for token as a fresh read, and
the restored tokens are not read again (the prefill's own progress counts what it reads)."""

from __future__ import annotations

import pytest

from page_local import Engine
from page_local.engine.turn import W
from page_local.store.diskcache import DiskCache

pytestmark = pytest.mark.slow

TEXT = open("/usr/share/common-licenses/GPL-3", encoding="utf-8").read()[:7000]
Q1 = "\n\nQuestion: what is this license called? Answer:"
Q2 = "\n\nQuestion: which foundation published it? Answer:"


def engine(path, disk, **kw):
    return Engine(path, n_ctx=4096, threads=1, disk_cache=disk, **kw)


def read_counts(eng):
    seen = []
    eng.set_progress(lambda done, total: seen.append((done, total)))
    return seen


def test_a_document_read_once_is_restored_by_the_next_engine(smollm2_path, tmp_path):
    disk = DiskCache(tmp_path / "kv", max_bytes=1 << 30)
    with engine(smollm2_path, disk) as e:
        first = e.generate(TEXT + Q1, max_tokens=12)
    assert first.decision.disk_tokens == 0
    assert len(disk.entries()) == 1 and disk.entries()[0].n_tokens == first.prompt_tokens
    with engine(smollm2_path, DiskCache(tmp_path / "kv", max_bytes=1 << 30)) as e:  # "after a restart"
        seen = read_counts(e)
        again = e.generate(TEXT + Q2, max_tokens=12)
    with engine(smollm2_path, None) as e:
        fresh = e.generate(TEXT + Q2, max_tokens=12)
    n_doc = again.decision.disk_tokens
    assert n_doc > 1000 and again.prompt_tokens == fresh.prompt_tokens
    assert seen[-1][1] == again.prompt_tokens - n_doc  # only the rest was read
    assert seen[-1][1] >= W  # the message can evict (budget 0.25): the probe's window is read as on a fresh read
    assert again.tokens == fresh.tokens  # the same answer as reading the whole prompt
    assert "from the disk cache" in __import__("page_local.engine.narrate", fromlist=["status"]).status(again.decision)


def test_a_message_that_cannot_evict_reads_only_what_the_disk_does_not_hold(smollm2_path, tmp_path):
    """With the full cache kept (budget 1.0) the probe decides nothing, so the window is not read again: only the
    tokens after the shared prefix are (the question's own), and the answer is still the fresh read's."""
    disk = DiskCache(tmp_path / "kv", max_bytes=1 << 30)
    with engine(smollm2_path, disk, budget=1.0) as e:
        e.generate(TEXT + Q1, max_tokens=2)
    with engine(smollm2_path, DiskCache(tmp_path / "kv", max_bytes=1 << 30), budget=1.0) as e:
        seen = read_counts(e)
        again = e.generate(TEXT + Q2, max_tokens=12)
    with engine(smollm2_path, None, budget=1.0) as e:
        fresh = e.generate(TEXT + Q2, max_tokens=12)
        n_q2 = len(e.model.tokenize(Q2, add_special=False))
    assert 1 <= seen[-1][1] == again.prompt_tokens - again.decision.disk_tokens <= n_q2 < W
    assert again.tokens == fresh.tokens
    with engine(smollm2_path, DiskCache(tmp_path / "kv", max_bytes=1 << 30), budget=1.0) as e:
        seen = read_counts(e)
        same = e.generate(TEXT + Q1, max_tokens=2)  # a prompt saved whole: its window is read as a fresh read's
    assert same.decision.disk_tokens == same.prompt_tokens - W and seen[-1][1] == W


def test_no_disk_cache_reads_everything_and_writes_nothing(smollm2_path, tmp_path):
    with engine(smollm2_path, False) as e:
        seen = read_counts(e)
        r = e.generate(TEXT + Q1, max_tokens=4)
    assert r.decision.disk_tokens == 0 and seen[-1][1] == r.prompt_tokens
    assert not (tmp_path / "kv").exists()


def test_another_cache_type_or_a_replaced_model_is_another_key(smollm2_path, tmp_path):
    disk = DiskCache(tmp_path / "kv", max_bytes=1 << 30)
    with engine(smollm2_path, disk) as e:
        e.generate(TEXT + Q1, max_tokens=2)
    with engine(smollm2_path, disk, cache_type="q8_0", flash_attn="on") as e:
        r = e.generate(TEXT + Q2, max_tokens=2)
    assert r.decision.disk_tokens == 0  # a state saved under f16 is not offered to a q8_0 cache
    assert len(disk.entries()) == 2


def test_a_corrupt_entry_is_read_as_today_and_removed(smollm2_path, tmp_path, caplog):
    disk = DiskCache(tmp_path / "kv", max_bytes=1 << 30)
    with engine(smollm2_path, disk) as e:
        e.generate(TEXT + Q1, max_tokens=2)
    (entry,) = disk.entries()
    raw = entry.path.read_bytes()
    entry.path.write_bytes(raw[:100] + bytes(len(raw) - 100))
    with engine(smollm2_path, disk) as e:
        r = e.generate(TEXT + Q2, max_tokens=2)
    assert r.decision.disk_tokens == 0 and "removed" in caplog.text
    assert len(disk.entries()) == 1  # the new read is written in its place


def test_namespaces_do_not_see_each_other(smollm2_path, tmp_path):
    disk = DiskCache(tmp_path / "kv", max_bytes=1 << 30)
    with engine(smollm2_path, disk) as e:
        e.set_disk_namespace("alice-key")
        e.generate(TEXT + Q1, max_tokens=2)
        e.reset()
        e.set_disk_namespace("bob-key")
        bob = e.generate(TEXT + Q2, max_tokens=2)
        e.reset()
        e.set_disk_namespace("alice-key")
        alice = e.generate(TEXT + Q2, max_tokens=2)
    assert bob.decision.disk_tokens == 0 and alice.decision.disk_tokens > 1000

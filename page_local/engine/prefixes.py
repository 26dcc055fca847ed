"""An engine's use of the disk cache of prompt prefixes (store/diskcache.py): a long prompt read once is restored,
not read again, in a new conversation, after a restart, from another program.

Before a message is read (message.Messages.answer): when the conversation holds every token it has read (nothing
evicted, parked or cut for room) and the message fits, the conversation plus the message is looked up; the longest
saved prompt sharing at least the cache's min_tokens with it is restored (Snapshots: all or nothing) and rewound to
the shared part. When this message can evict or park (the conversation it makes is over the turn's budget, and
over park_from where parking keeps the full cache below it), the probe's window W is left to read, so that the
probe, the gate and the keep set are what a fresh prefill gives; otherwise the probe decides nothing for this
message (the answer is the full cache's either way) and only the tokens after the shared prefix are read: the
window's 32 tokens cost as much as the file itself (bench disk, docs/benchmarks.md). A prompt saved whole (the same
request again) reads the window again all the same, as serve's slot cache does: llama.cpp rounds a 1-token batch
differently from a 32-token one, and a sampled answer would differ from a fresh read's. An evictor that reads the
whole prefill's attention (h2o) never uses it.

After a message is read (message.Messages._gate, before the gate evicts or parks anything): when it read at least
min_tokens new tokens into such a conversation, the cache of exactly that prompt is copied to host memory and
written by the cache's writer thread (the answer does not wait for the disk).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from page_local.engine.turn import W
from page_local.errors import StateFileError
from page_local.store.diskcache import DiskCache, model_key, namespace_for, weights_fingerprint


class PrefixDisk:
    """One engine's key into a DiskCache (its weights, cache type and flash attention) and the two steps."""

    def __init__(self, cache: DiskCache, key: str):
        self.cache, self.key = cache, key

    @classmethod
    def of(cls, disk_cache, model_path: Path, model_id: str, attention) -> PrefixDisk | None:
        """disk_cache: None/False (off), True (the default folder and limit), a folder, or a DiskCache."""
        if disk_cache is None or disk_cache is False:
            return None
        if disk_cache is True:
            cache = DiskCache()
        elif isinstance(disk_cache, DiskCache):
            cache = disk_cache
        elif isinstance(disk_cache, (str, os.PathLike)):
            cache = DiskCache(disk_cache)
        else:
            raise ValueError(f"disk_cache must be True, False, a folder or a DiskCache, got {disk_cache!r}")
        key = model_key(model_id, weights_fingerprint(model_path), attention.cache_type, attention.flash_attn)
        return cls(cache, key)

    def in_namespace(self: PrefixDisk | None, namespace: str) -> None:
        """Whose documents the next messages read and write (serve: the request's API key, hashed); nothing
        when the engine has no disk cache (self None: called on the class)."""
        ns = namespace_for(namespace)
        if self is not None and self.cache.namespace != ns:
            self.cache = self.cache.in_namespace(ns)

    def flush(self: PrefixDisk | None) -> None:
        """Wait for the queued writes (the prompts are in host memory already): before the engine closes."""
        if self is not None:
            self.cache.flush()

    @staticmethod
    def whole(ctx, conv, parking) -> bool:
        """The conversation holds every token it read, at positions 0..n-1 (what a saved prompt holds)."""
        n = len(conv)
        return (parking.count() == 0 and ctx.cells_used(0) == n and conv.room_out in (None, set())
                and (n == 0 or (conv.pos[0] == 0 and conv.pos[-1] == n - 1)))

    def restore(self, ctx, conv, parking, snapshots, rewind, toks: list[int], reserve: int,
                needs: frozenset, window: int = W) -> tuple[list[int], int, float]:
        """Before a message: (the tokens still to read, how many came from the disk, seconds it took). window:
        the prompt's last tokens read however much is saved (W when the message's probe decides something, else
        1: the last token's logits)."""
        cache = self.cache
        n_conv = len(conv)
        full_len = n_conv + len(toks)
        if ("prefill_attention" in needs or full_len < cache.min_tokens or full_len + reserve > ctx.n_ctx
                or not self.whole(ctx, conv, parking)):
            return toks, 0, 0.0
        t0 = time.perf_counter()
        full = list(conv.history) + list(toks)
        hit = cache.lookup(self.key, full)
        if hit is None:
            return toks, 0, 0.0
        if hit.n_common >= full_len:  # the whole prompt saved (the same request again): read the window as a fresh
            window = W  # prefill does, so that the answer is the same bits, sampled ones too (serve's slot cache)
        upto = min(hit.n_common, full_len - max(1, window))  # the probe's window is read, never restored
        if upto - n_conv < W:  # no more than the conversation holds already: nothing to gain
            return toks, 0, 0.0
        try:
            snapshots.check(hit.snapshot)
            snapshots.restore(hit.snapshot)  # all or nothing: on a refusal the conversation is as it was
        except StateFileError as e:
            cache.discard(hit, f"not restored ({e})")
            return toks, 0, 0.0
        rewind(upto)
        return full[upto:], upto - n_conv, time.perf_counter() - t0

    def wants(self, ctx, conv, parking, n_read: int) -> bool:
        """Whether the message about to be read (n_read tokens) is worth writing once it is read."""
        return n_read >= self.cache.min_tokens and self.whole(ctx, conv, parking)

    def save(self, snapshots) -> None:
        """The prompt just read, copied to host memory now and written on the writer thread."""
        self.cache.save_later(self.key, snapshots.take())

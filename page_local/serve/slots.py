"""Engine slots and the conversation cache: why a client that resends its whole conversation is not
prefilled again.

A slot is one Engine (its own context and KV cache, on the one Model the backend loaded for every
slot) and the one thread that ever drives it. `--parallel N` gives N slots. What a slot's engine holds is its *live*
conversation; conversations pushed out of a slot are kept as host-RAM snapshots (Engine.snapshot) in
one LRU shared by all slots, under a byte cap.

For each request the rendered conversation is tokenized and matched against every cached
conversation's *token history* (Engine.history: what was prefilled and generated, evicted tokens
included; with eviction the cells no longer hold the whole prefix, so the match is on the history,
not on the cells). The best match is restored if it is a snapshot and rewound to the common prefix
(Engine.rewind keeps what eviction left of that prefix); only the rest is prefilled. Reuse is honest
about eviction:

  * a request that contains the cached conversation's last prompt (it diverges, if at all, inside
    the last answer: the same chat going on, or a regenerate) continues on the cache as the gate
    left it, as ChatSession does between turns;
  * any other request (an edited earlier message, another conversation sharing a system prompt)
    reuses a prefix only from a cache that was never evicted: an eviction decided for another
    question is not imposed on this one, so an evicted cache is prefilled again from scratch.

Before a live conversation is rewound for another conversation it is snapshotted (unless the
divergence is inside its last answer, which is the same conversation going on).

Each conversation belongs to a namespace: the API key its requests came with (guards.KeyGuard), or
one namespace on a server without keys. A request is matched only against its own namespace's
conversations, live or snapshot, so what it reuses (cached_tokens, the time to its first token) says
nothing about what another key's clients wrote.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from page_local.engine.turn import W
from page_local.serve.guards import NO_KEY
from page_local.serve.errors import ApiError


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    lo, hi = 0, n  # binary search on slice equality: C-speed comparisons, O(n log n)
    a, b = list(a[:n]), list(b[:n])
    if a == b:
        return n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class Cached:
    """A conversation kept in host RAM, and where its last answer began (history index)."""

    snap: object  # store.persist.Snapshot
    answer_from: int
    namespace: str = NO_KEY  # whose conversation it is (only that namespace's requests reuse it)

    @property
    def history(self):
        return self.snap.history

    @property
    def evicted(self) -> bool:
        return len(self.snap.positions) < len(self.snap.history)

    @property
    def nbytes(self) -> int:
        return self.snap.nbytes


class SnapshotCache:
    """Conversations pushed out of the slots: LRU under a byte cap, shared by every slot's thread."""

    def __init__(self, cap_bytes: int):
        self.cap = int(cap_bytes)
        self._lock = threading.Lock()
        self._items: OrderedDict[int, Cached] = OrderedDict()
        self._keys = itertools.count()
        self.nbytes = 0
        self.dropped = 0  # conversations evicted from the cache by the cap

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: Cached) -> None:
        with self._lock:
            if item.nbytes > self.cap:
                self.dropped += 1
                return
            self._items[next(self._keys)] = item
            self.nbytes += item.nbytes
            while self.nbytes > self.cap:
                _, old = self._items.popitem(last=False)
                self.nbytes -= old.nbytes
                self.dropped += 1

    def answer_from(self, key: int) -> int:
        with self._lock:
            item = self._items.get(key)
            return item.answer_from if item is not None else 0

    def best(self, tokens: list[int], namespace: str = NO_KEY) -> tuple[int, int | None]:
        """(common prefix length, key) of the namespace's snapshot sharing the longest prefix with tokens."""
        with self._lock:
            found = (0, None)
            for key, item in self._items.items():
                if item.namespace != namespace:
                    continue
                n = usable_prefix(item.history, tokens, item.answer_from, item.evicted)
                if n > found[0]:
                    found = (n, key)
            return found

    def drop_prefixes(self, history, namespace: str) -> None:
        """Forget the namespace's snapshots that `history` continues (an older copy of the same conversation)."""
        with self._lock:
            for key in [k for k, item in self._items.items() if item.namespace == namespace
                        and len(item.history) <= len(history) and common_prefix(item.history, history)
                        == len(item.history)]:
                self.nbytes -= self._items.pop(key).nbytes

    def take(self, key: int, keep: bool = False) -> Cached | None:
        """A snapshot that becomes a slot's live conversation: removed from the cache, or with keep
        (the request shares only a prefix of it: the conversation itself stays cached) marked as the
        most recently used."""
        with self._lock:
            if keep:
                item = self._items.get(key)
                if item is not None:
                    self._items.move_to_end(key)
                return item
            item = self._items.pop(key, None)
            if item is not None:
                self.nbytes -= item.nbytes
            return item


def usable_prefix(history, tokens: list[int], answer_from: int, evicted: bool) -> int:
    """How many tokens of a cached conversation a request may reuse (the rule in the module docstring)."""
    n = common_prefix(history, tokens)
    if evicted and n < answer_from:
        return 0
    return n


@dataclass
class Reuse:
    tokens: int  # the request's tokens reused from the cache (not prefilled again)
    source: str  # live | snapshot | none
    evicted: bool  # the reused cache had been evicted by an earlier turn's gate


class Slot:
    """One Engine and the single thread that drives it."""

    def __init__(self, index: int, engine, cache: SnapshotCache):
        self.index, self.engine, self.cache = index, engine, cache
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"page-local-slot{index}")
        self.answer_from = 0  # history index where the live conversation's last answer began
        self.owner = NO_KEY  # the namespace of the live conversation
        self.evicted = False  # the live conversation's cache was evicted by some turn
        self.last_used = 0.0
        self.busy = False
        self.cancel: threading.Event | None = None  # the running request's, for shutdown
        self.parked = False  # the live conversation is also in the cache as it is now (park)

    def live_prefix(self, tokens: list[int], namespace: str = NO_KEY) -> int:
        if namespace != self.owner:
            return 0
        return usable_prefix(self.engine.history, tokens, self.answer_from, self.evicted)

    # --- in the slot's thread ----------------------------------------------------------------
    def prepare(self, tokens: list[int], namespace: str = NO_KEY) -> Reuse:
        """Put the namespace's best cached conversation in the engine, rewound so that tokens[reuse:] is
        what is left to prefill (at least one token: the engine needs a token to decode before sampling).
        Another namespace's live conversation is snapshotted (as its own) and replaced."""
        eng = self.engine
        eng.set_disk_namespace(namespace)  # the disk cache's saved prompts are per API key too
        parked, self.parked = self.parked, False
        n_live = self.live_prefix(tokens, namespace)
        n_snap, key = self.cache.best(tokens, namespace)
        source, evicted = ("live" if n_live else "none"), self.evicted
        if n_snap > n_live:
            # taken before the live one goes in, which could push it out of the cap; a request that does
            # not continue it (it shares a system prompt, or diverges in an earlier turn) leaves it cached
            continues = n_snap >= self.cache.answer_from(key)
            item = self.cache.take(key, keep=not continues)
            if item is not None:
                if not parked:
                    self._push_out(0)  # the live conversation is replaced whole
                try:
                    eng.restore(item.snap)
                    self.answer_from, self.evicted = item.answer_from, item.evicted
                    source, evicted, n_live = "snapshot", item.evicted, n_snap
                except ValueError:  # StateFileError: the engine kept the conversation it had
                    if continues:
                        self.cache.put(item)
        elif not parked:
            self._push_out(n_live)
        n = min(n_live, len(tokens) - 1)
        if n == len(tokens) - 1:
            # the whole prompt is cached (a request sent again): its last W tokens are read again as one batch,
            # as a fresh prefill reads them, so the probe sees the same window and the logits are the same bits
            # (llama.cpp's plain attention path rounds a 1-token batch differently from a W-token one: a
            # seeded, sampled answer would change with the cache)
            n = max(0, len(tokens) - W)
        if n < len(eng.history):
            eng.rewind(n)  # rewind(0) resets
        if n == 0:
            self.answer_from, self.evicted = 0, False
        self.owner = namespace
        return Reuse(n, source if n else "none", evicted and n > 0)

    def _push_out(self, keep: int) -> None:
        """Snapshot the live conversation before it is cut to `keep` tokens, unless the cut is inside its
        last answer (the same conversation going on) or nothing would be lost."""
        eng = self.engine
        if len(eng.history) > keep and keep < self.answer_from:
            self.cache.put(Cached(eng.snapshot(), self.answer_from, self.owner))

    def park(self) -> None:
        """After a request, on a server with keys: the live conversation is snapshotted now, as its key's, so
        that another key's request taking this slot does not snapshot it inside its own turn (its time to the
        first token would grow with this key's conversation). Older snapshots it continues are dropped."""
        eng = self.engine
        if self.parked or not len(eng.history):
            return
        self.cache.drop_prefixes(eng.history, self.owner)
        self.cache.put(Cached(eng.snapshot(), self.answer_from, self.owner))
        self.parked = True

    def settle(self, n_prompt: int) -> None:
        """After a request: where the live conversation's last answer began (n_prompt, if the prompt
        reached the cache; else the whole history is prompt) and whether its cells miss any token."""
        eng = self.engine
        self.answer_from = min(n_prompt, len(eng.history))
        self.evicted = eng.cells_used() < len(eng.history)

    def forget(self) -> None:
        """After a request that failed once its conversation was in place: the engine may hold a half
        prefilled prompt, or a cache evicted under that request's own settings; nobody reuses it."""
        self.answer_from, self.evicted, self.parked = 0, False, False
        self.engine.rewind(0)

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        self.engine.close()


class Admission:
    """A request let in by SlotPool.admit() until it asks for a slot (or fails before): close() once."""

    def __init__(self, pool: SlotPool):
        self._pool = pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.entering -= 1
            self._pool = None


class SlotPool:
    """The slots and a bounded FIFO of requests waiting for one; used on the event loop only.

    acquire() gives a free slot at once (the one whose live conversation, in the request's namespace,
    shares the longest prefix with the request), else waits in line; ApiError 503 with Retry-After
    when the line is full. admit() says so before the request is even read, and counts the requests it
    let in that are still reading their bodies or being tokenized (`entering`) as already in line: the
    free slots and the queue are for them first."""

    def __init__(self, slots: list[Slot], queue_max: int):
        self.slots = slots
        self.queue_max = queue_max
        self._free: list[Slot] = list(slots)
        self._waiting: deque[asyncio.Future] = deque()
        self.entering = 0  # admitted, not yet in acquire(): reading the body, tokenizing

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiting if not f.done())

    def admit(self) -> Admission:
        """503 now if a request arriving now could neither run nor wait, counting those admitted before it
        that have not reached acquire() yet: checked before its body is read. The Admission is closed by
        acquire() (or by the caller, when the request fails before)."""
        if self.entering + self.waiting >= len(self._free) + self.queue_max:
            raise self._busy()
        self.entering += 1
        return Admission(self)

    def _busy(self) -> ApiError:
        return ApiError(503, f"the server is busy: {len(self.slots)} request(s) running and {self.queue_max} "
                             "waiting; retry shortly", "server_busy", headers={"Retry-After": "1"})

    async def acquire(self, tokens: list[int], namespace: str = NO_KEY, admission: Admission | None = None) -> Slot:
        if admission is not None:
            admission.close()
        if self._free:
            return self._take(tokens, namespace)
        if self.waiting >= self.queue_max:
            raise self._busy()
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # a slot was handed over as the waiter was cancelled
                self.release(fut.result())
            raise

    def _take(self, tokens: list[int], namespace: str) -> Slot:
        slot = max(self._free, key=lambda s: (s.live_prefix(tokens, namespace), -s.last_used))
        self._free.remove(slot)
        slot.busy = True
        return slot

    def release(self, slot: Slot) -> None:
        slot.busy, slot.last_used = False, time.monotonic()
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                slot.busy = True
                fut.set_result(slot)
                return
        self._free.append(slot)

"""What the HTTP layer asks of the engines: load the slots, turn a request into tokens, run one request
in a slot's thread, and say how the server is doing. No HTTP here (app.py), no OpenAI shapes beyond
the events a request produces (protocol.py builds the bodies).

A request's events, in order, each put on the event loop's queue from the slot's thread:
    ("text", piece, logprobs)*  then one of  ("done", {"finish", "usage", "page_local", "logprobs"})
                                      |  ("error", ApiError)
(logprobs: the OpenAI entries of the tokens the piece begins, or None when the request did not ask.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from page_local import defaults
from page_local.engine import narrate
from page_local.engine.attention import AttentionSettings
from page_local.engine.settings import SettingError
from page_local.errors import Cancelled, ContextFull, EngineBusy, PageLocalError, RemoteLost
from page_local.serve.errors import ApiError, bad
from page_local.serve.fields import check_with_model
from page_local.serve.metrics import Metrics
from page_local.serve.prompt import Prompt
from page_local.serve.protocol import Job, StopScanner, finish_reason, finite, usage
from page_local.serve.logprobs import LogprobTracker
from page_local.serve.slots import Slot, SlotPool, SnapshotCache

log = logging.getLogger("page_local.serve")
EMBED_CTX = 512  # the longest /v1/embeddings input, in tokens: llama-server's default physical batch, which
# it also needs an embedding's input to fit (llama.cpp pools within one ubatch)


@dataclass
class Settings:
    """The server's configuration (the `serve` command's options)."""

    model_path: Path
    served_name: str  # the model's id in /v1/models and in requests' "model"
    n_ctx: int = defaults.N_CTX
    budget: float | int = defaults.CHAT_BUDGET
    park: bool = defaults.CHAT_PARK  # the speed budget parks cells (engine/parking.py)
    park_from: int | None = None  # with park: the engine's park_from (None: its default)
    reread: str = defaults.CHAT_REREAD  # after a cut, when the next message reads the conversation again (room.py)
    evictor: str = defaults.CHAT_EVICTOR
    gate: str = defaults.CHAT_GATE
    ladder: tuple = defaults.CHAT_LADDER  # the budgets gate "search" tries, smallest first
    verify_tokens: int | None = None  # None: the engine's default (verify.VERIFY_CAP)
    on_full: str = defaults.ON_FULL
    threads: int = defaults.THREADS
    n_gpu_layers: int | str | None = None
    rpc: tuple[str, ...] | None = None  # as Model's (None: $PAGE_LOCAL_RPC)
    attention_settings: AttentionSettings | None = None  # as Engine's (None: the environment's)
    allow_long_context: bool = False
    parallel: int = 1
    queue: int = 16  # requests waiting for a slot before 503
    cache_bytes: int = 512 * 2**20  # conversation snapshots in host RAM
    disk_cache: object = None  # store.diskcache.DiskCache: long prompts kept on disk (engine/prefixes.py), or None
    max_tokens_limit: int = 0  # 0: n_ctx
    max_body_bytes: int = 2 * 2**20
    api_key: str | None = None  # one key (the same as api_keys=[key])
    api_keys: list[str] = field(default_factory=list)  # each key its own namespace of conversations
    cors_origins: list[str] = field(default_factory=list)  # web origins allowed to call ("*": any)
    host: str | None = None  # the address bound; None (an app served by someone else): no Host check
    allow_hosts: list[str] = field(default_factory=list)  # more names the Host header may give ("*": any)

    @property
    def keys(self) -> list[str]:
        keys = list(self.api_keys) + ([self.api_key] if self.api_key else [])
        return list(dict.fromkeys(keys))  # in order, once each (a key's namespace is a hash of it: guards.KeyGuard)


class Backend:
    """The slots, the conversation cache and the chat template, loaded in a background thread so that
    /health can answer 503 while the model loads."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.state = "loading"  # loading | ready | error | closed
        self.error: str | None = None
        self.warnings: list[str] = []
        self.slots: list[Slot] = []
        self.model = None  # native.runtime.Model: loaded once, shared by every slot's engine
        self.pool: SlotPool | None = None
        self.cache = SnapshotCache(settings.cache_bytes)
        self.prompt = None  # prompt.Prompt: the chat templates and how a request becomes tokens
        self.loaded_at = int(time.time())
        self.counts = {"requests": 0, "errors": 0, "cancelled": 0, "prompt_tokens": 0, "cached_tokens": 0,
                       "completion_tokens": 0}
        self._count_lock = threading.Lock()
        self.metrics = Metrics()  # GET /metrics (metrics.py), counted where a request ends
        self._loader: threading.Thread | None = None
        self._state_lock = threading.Lock()
        self._embedder = None  # native.embed.Embedder, made on the first /v1/embeddings request
        self._embed_lock = threading.Lock()
        # embeddings run on a thread of their own, not the event loop's default pool that every chat request's
        # tokenizing needs; requests wait for it on the loop (embed_gate), where a client leaving is seen
        self.embed_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="page-local-embed")
        self._embed_gate: asyncio.Lock | None = None
        self.embeds_cancelled = 0  # embeddings requests stopped between inputs because their client left

    @property
    def names(self) -> set[str]:
        p = self.settings.model_path
        return {self.settings.served_name, p.name, p.stem}

    @property
    def max_tokens_limit(self) -> int:
        return self.settings.max_tokens_limit or self.settings.n_ctx

    # --- lifetime ------------------------------------------------------------------------------
    def start_loading(self, on_ready: Callable[[], None] | None = None,
                      on_error: Callable[[str], None] | None = None) -> None:
        self._loader = threading.Thread(target=self._load, args=(on_ready, on_error), name="page-local-load",
                                        daemon=True)
        self._loader.start()

    def _load(self, on_ready, on_error) -> None:
        from page_local.engine.engine import Engine
        from page_local.native.runtime import Model, Turns

        s = self.settings
        try:
            # one copy of the weights for every slot: each slot's engine borrows it (its own context and KV
            # cache), and _close_slots closes it once, after the last engine
            self.model = Model(s.model_path, n_gpu_layers=s.n_gpu_layers, rpc=s.rpc)
            if s.parallel > 1 and os.environ.get("PAGE_LOCAL_SLOT_TURNS", "on") != "off":
                self.model.compute_turns = Turns()
            for i in range(s.parallel):
                if self.state == "closed":
                    return
                extra = {} if s.verify_tokens is None else {"verify_tokens": s.verify_tokens}
                if s.park_from is not None:
                    extra["park_from"] = s.park_from
                eng = Engine(self.model, n_ctx=s.n_ctx, budget=s.budget, evictor=s.evictor, gate=s.gate,
                             ladder=s.ladder, threads=s.threads, on_full=s.on_full, attention_settings=s.attention_settings,
                             allow_long_context=s.allow_long_context, park=s.park, reread=s.reread,
                             disk_cache=s.disk_cache, **extra)
                self.slots.append(Slot(i, eng, self.cache))
                if i == 0 and eng.profile_warning:
                    self.warnings.append(eng.profile_warning)
            self.prompt = Prompt(self.model, s.served_name)
            if self.prompt.template_error:  # chat completions are refused, completions work
                self.warnings.append(self.prompt.template_error)
        except (PageLocalError, OSError, ValueError) as e:
            self.error, self.state = " ".join(str(e).split()), "error"
            self._close_slots()
            if on_error:
                on_error(self.error)
            return
        self.pool = SlotPool(self.slots, s.queue)
        with self._state_lock:
            if self.state != "loading":  # closed while loading: close() frees the slots
                return
            self.state = "ready"
        if on_ready:
            on_ready()

    def close(self) -> None:
        """Stop every running request (within one token), wait for the slots' threads, free the engines."""
        with self._state_lock:
            self.state = "closed"
        if self._loader is not None:
            self._loader.join()
        self._close_slots()

    def cancel_running(self) -> None:
        """Stop every running request: a prefill before its next ubatch, an answer within one token (Ctrl-C)."""
        for slot in self.slots:
            if slot.cancel is not None:
                slot.cancel.set()

    def _close_slots(self) -> None:
        self.cancel_running()
        self.embed_executor.shutdown(wait=True)
        with self._embed_lock:  # before the model it borrows
            if self._embedder is not None:
                self._embedder.close()
                self._embedder = None
        for slot in self.slots:
            slot.close()
        self.slots = []
        if self.model is not None:  # after every engine that borrowed it
            self.model.close()
            self.model = None

    # --- one request ---------------------------------------------------------------------------
    def tokens(self, job: Job) -> tuple[list[int], int]:
        """The request as the model reads it, and n_keep (prompt.Prompt.tokens). Thread-safe. A grammar or a
        logit bias the model cannot take, or tools it cannot call, are refused here, before the request
        waits for a slot."""
        if job.kind == "chat" and job.uses_tools:
            self.prompt.check_tools(job)
        check_with_model(job, self.model)
        return self.prompt.tokens(job)

    def render(self, job: Job) -> str:
        """The chat request's conversation as the model reads it, or a text request's prompt. Thread-safe."""
        return self.prompt.render(job)

    @property
    def tool_template(self):
        """chat_template.ToolTemplate, once loaded (None before)."""
        return self.prompt.tool_template if self.prompt is not None else None

    def cache_map(self, eng, job: Job, tokens: list[int], answer: list[int], shown: str) -> dict | None:
        """The response's `cache_map` (held.py): which tokens of the conversation (the request's `tokens`,
        then the `answer` tokens) the engine's cache holds, in the messages' characters; None when the
        engine's history is not that conversation."""
        from page_local.serve import held

        if list(eng.history) != list(tokens) + list(answer):  # not expected: the slot prefilled the request
            log.warning("the cache map was skipped: the engine's history is not the request's conversation")
            return None
        try:
            mask, room = eng.cache_map()
            parked = eng.parked_map()
            model = eng.model
            contents = [m["content"] for m in job.messages] if job.kind == "chat" else None
            return held.cache_map(mask, room, [model.token_to_piece(t, special=True) for t in tokens],
                                  self.render(job), contents, [model.token_to_piece(t) for t in answer], shown,
                                  eng.n_ctx, parked=parked if parked.any() else None)
        except Exception:  # a view of the answer, not the answer: its failure must not cost the answer
            log.exception("the cache map failed")
            return None

    def run(self, slot: Slot, job: Job, tokens: list[int], n_keep: int, emit: Callable[[tuple], None],
            cancel: threading.Event) -> None:
        """One request on `slot`, in the slot's thread: the request's overrides resolved into the settings
        its turn runs with (a value: the slot's engine is not changed), the best cached conversation put in place, the rest prefilled and the
        answer streamed as events. A set `cancel` stops it within one generated token. Only a request that
        ends (answered, or stopped by `cancel`) updates the slot's bookkeeping: one refused in its overrides
        leaves the slot as it was, one that fails later makes the slot forget its conversation."""
        eng = slot.engine
        slot.cancel = cancel
        eng.set_cancel(cancel)  # a set `cancel` also stops the prefill between ubatches (Cancelled)
        reuse = None
        placed = finished = False
        last = None  # the request's last event, sent once the slot's bookkeeping is done
        try:
            turn = self._turn_settings(eng, job)  # a refused override changes nothing: the slot is as it was
            placed = True
            reuse = slot.prepare(tokens, job.namespace)
            tail = tokens[reuse.tokens:]
            cells = eng.cells_used()  # (what this request evicted: the cells it added that are gone after)
            eng.n_keep = n_keep
            if job.return_progress:
                t0, cached = time.perf_counter(), reuse.tokens
                eng.set_progress(lambda done, total: emit(("progress", {
                    "total": cached + total, "cache": cached, "processed": cached + done,
                    "time_ms": round((time.perf_counter() - t0) * 1e3, 1)})))
            stream = eng.stream(tail, max_tokens=job.max_tokens, sampling=job.sampling(), add_special=False,
                                settings=turn)
            scanner = StopScanner(job.stop)
            lp = LogprobTracker(eng.model, stream, job.logprobs)
            shown = []  # the answer as sent: what the cache map places the answer's tokens in
            try:
                for piece in stream:
                    text = scanner.feed(piece)
                    if text:
                        shown.append(text)
                        emit(("text", text, lp.take(text)))
                    if scanner.stopped or cancel.is_set():
                        break
            finally:
                stream.close()
            rest = scanner.flush()
            if rest:
                shown.append(rest)
                emit(("text", rest, lp.take(rest)))
            res = stream.result
            disk = res.decision.disk_tokens if res.decision is not None else 0  # restored from the disk cache
            use = usage(len(tokens), len(res.tokens), reuse.tokens + disk)
            self._count(use, cancelled=cancel.is_set(), res=res,
                        evicted=cells + len(tail) + len(res.tokens) - eng.cells_used())
            finished = True
            extension = self._extension(res, reuse, turn)
            if job.overrides.cache_map:  # asked for: it costs ~10 ms per 1K tokens, and for a cache evicted
                # for speed, runs of a few tokens each (at 11K tokens, 30 % held: 130 ms and 440 KB of JSON)
                extension["cache_map"] = self.cache_map(eng, job, tokens, res.tokens, "".join(shown))
            last = ("done", {"finish": finish_reason(res.finish_reason, scanner.stopped), "usage": use,
                             "page_local": extension, "logprobs": lp.all})
        except Cancelled:  # the client went away (or the server is stopping) during the prefill
            self._count(None, prefill_cancelled=True)
            last = ("error", ApiError(503, "the request was cancelled during its prefill (the client went away or "
                                           "the server is stopping)", "cancelled"))
        except ContextFull as e:
            self._count(None)
            n = reuse.tokens if reuse else 0
            last = ("error", ApiError(
                400, f"the conversation does not fit in the context: it is {len(tokens)} tokens ({n} reused from "
                     f"the cache); {e.used} cells are in use and {e.needed} more are needed, but n_ctx is {e.n_ctx}. "
                     "Nothing was dropped (on_full is \"refuse\"): shorten the conversation, let the server "
                     "make room (page_local.on_full \"evict\") or start it with a larger --n-ctx",
                "context_length_exceeded", "messages" if job.kind == "chat" else "prompt"))
        except ApiError as e:
            self._count(None)
            last = ("error", e)
        except RemoteLost as e:  # an --rpc server stopped answering: this slot's model cannot run on
            self._count(None)
            log.error("slot %d: %s", slot.index, e)
            last = ("error", ApiError(503, f"{e}. Restart page-local serve once the RPC server is back.",
                                      "rpc_server_lost"))
        except EngineBusy as e:  # not expected: one thread drives each engine
            self._count(None)
            last = ("error", ApiError(503, str(e), "server_busy", headers={"Retry-After": "1"}))
        except ValueError as e:  # the engine refusing an input (a budget too small for the prompt, ...)
            self._count(None)
            last = ("error", bad(str(e)))
        except Exception as e:
            self._count(None)
            log.exception("request failed in slot %d", slot.index)
            last = ("error", ApiError(500, f"{type(e).__name__}: {e}", "internal_error"))
        finally:
            slot.cancel = None
            eng.set_cancel(None)
            eng.set_progress(None)
            try:
                if finished:
                    slot.settle(len(tokens))
                elif placed:  # failed once its conversation was being put in place
                    slot.forget()
            except Exception:
                log.exception("could not restore slot %d after a request", slot.index)
        if last is not None:  # after the bookkeeping: a client's next request finds the slot as it is
            emit(last)
        if finished and len(self.settings.keys) > 1:  # keys: snapshot it now, outside anyone's turn
            try:
                slot.park()
            except Exception:
                log.exception("could not snapshot slot %d's conversation", slot.index)

    def embed_gate(self) -> asyncio.Lock:
        """The event loop's lock in front of embed_executor (made on the loop, on first use)."""
        if self._embed_gate is None:
            self._embed_gate = asyncio.Lock()
        return self._embed_gate

    def embed(self, inputs: list[list[int]], cancel: threading.Event | None = None) -> list:
        """f32 (n_embd,) per input: the served model's final hidden states mean-pooled and L2-normalised,
        on a context of its own (made on first use, EMBED_CTX tokens): the slots' caches are not touched.
        One request at a time; thread-safe. ValueError for an input the context cannot take; a set `cancel`
        stops between inputs (ApiError 499: nobody reads it)."""
        from page_local.native.embed import Embedder

        with self._embed_lock:
            if self.state != "ready":
                raise ApiError(503, "the server is not ready", "not_ready")
            if self._embedder is None:
                model = self.model
                self._embedder = Embedder(model, n_ctx=self.embed_ctx, threads=self.settings.threads)
            out = []
            for toks in inputs:
                if cancel is not None and cancel.is_set():
                    self.embeds_cancelled += 1
                    raise ApiError(499, "the client went away", "cancelled")
                out.append(self._embedder.embed(toks))
            return out

    @property
    def embed_ctx(self) -> int:
        return min(EMBED_CTX, self.settings.n_ctx)

    @staticmethod
    def _turn_settings(eng, job: Job):
        """The request's overrides over the slot's settings, as the value its turn runs with (the engine's
        settings are not touched); a refused one is a 400 naming the field, in the engine's words."""
        o = job.overrides
        try:
            return eng.turn_settings(gate=o.gate, evictor=o.evictor, budget=o.budget, verify_tokens=o.verify_tokens,
                                     on_full=o.on_full)
        except SettingError as e:
            raise bad(f"page_local.{e.field}: {e}", f"page_local.{e.field}") from None

    @staticmethod
    def _extension(res, reuse, turn) -> dict:
        """The response's `page_local` object: the Decision (and its summary in words), the cache reuse,
        the settings the request ran with."""
        d = res.decision
        decision = None
        if d is not None:
            decision = finite(d.to_dict())
            decision["summary"] = narrate.summary(res)
            decision["verdict"] = narrate.status(d)  # the status phrase (the REPL's line)
        return {"decision": decision,
                "cache": {"reused_tokens": reuse.tokens, "source": reuse.source, "reused_evicted": reuse.evicted,
                          "disk_tokens": d.disk_tokens if d is not None else 0,
                          "disk_ms": d.disk_ms if d is not None else 0.0},
                "settings": {"gate": turn.gate_mode, "budget": turn.budget, "evictor": turn.evictor.name,
                             "verify_tokens": turn.verify_tokens, "on_full": turn.on_full, "park": turn.park},
                "answer": {"tokens": len(res.tokens), "gen_ms": res.gen_s * 1e3,
                           "tokens_per_s": res.tokens_per_s}}

    def _count(self, use: dict | None, cancelled: bool = False, res=None, evicted: int = 0,
               prefill_cancelled: bool = False) -> None:
        """A request's end in the stats' counts and the metrics: use None for one that did not finish
        (an error, or prefill_cancelled); evicted: the cells it evicted (the gate's and room-making's)."""
        with self._count_lock:
            self.counts["requests"] += 1
            if use is None:
                self.counts["cancelled" if prefill_cancelled else "errors"] += 1
                if prefill_cancelled:
                    self.metrics.cancelled_prefill()
                else:
                    self.metrics.failed()
                return
            self.counts["cancelled"] += int(cancelled)
            self.counts["prompt_tokens"] += use["prompt_tokens"]
            self.counts["cached_tokens"] += use["prompt_tokens_details"]["cached_tokens"]
            self.counts["completion_tokens"] += use["completion_tokens"]
        d = res.decision if res is not None else None
        room = d.room_evicted if d is not None else 0
        self.metrics.finished(use["prompt_tokens"], use["prompt_tokens_details"]["cached_tokens"],
                              use["completion_tokens"], d, gate_cells=evicted - room, room_cells=room,
                              cancelled=cancelled)

    # --- how it is doing -----------------------------------------------------------------------
    def stats(self, namespace: str = "") -> dict:
        """How the server is doing. A slot's history_tokens (the length of its conversation) is shown only
        to the namespace the conversation belongs to (null to others)."""
        return {"state": self.state,
                "slots": [{"index": s.index, "busy": s.busy,
                           "history_tokens": len(s.engine.history) if s.owner == namespace else None}
                          for s in self.slots],
                "queue": {"waiting": self.pool.waiting if self.pool else 0, "max": self.settings.queue},
                "cache": {"snapshots": len(self.cache), "bytes": self.cache.nbytes, "cap_bytes": self.cache.cap,
                          "dropped": self.cache.dropped},
                "counts": dict(self.counts), "rss_bytes": rss_bytes()}


class Turn:
    """A request running in a slot, seen from the event loop: next() gives its events; close() stops
    it (within one token). The slot goes back to the pool when the slot's thread is done with it,
    not when the client goes away, so a slot is never handed out while its engine still runs."""

    def __init__(self, backend: Backend, slot: Slot, job: Job, tokens: list[int], n_keep: int):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        slot.cancel = self.cancel  # now, not when the slot's thread starts: Backend.cancel_running sees it at once
        pool = backend.pool
        fut = slot.executor.submit(backend.run, slot, job, tokens, n_keep, self._emit, self.cancel)
        fut.add_done_callback(lambda _f: self._call(pool.release, slot))

    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed (shutdown): nobody is listening any more
            pass

    def _emit(self, event: tuple) -> None:
        self._call(self._queue.put_nowait, event)

    async def next(self) -> tuple:
        return await self._queue.get()

    def close(self) -> None:
        self.cancel.set()


def rss_bytes(pid: int | None = None) -> int | None:
    """Resident memory of this process, or of process pid (Linux: /proc/PID/statm; elsewhere this process's
    peak, from getrusage, and None for another process)."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        if pid is not None:
            return None
        try:
            import resource
            import sys

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return peak if sys.platform == "darwin" else peak * 1024
        except (ImportError, OSError):
            return None

"""What `GET /metrics` tells Prometheus: counters kept here (plain Python, thread-safe: the slots'
threads and the event loop both count), written out in the text exposition format by
prometheus_client's collector API when scraped.

    page_local_http_requests_total{route,status}      every request the app answered, by route template
    page_local_http_request_seconds{route}            time to the end of the response body (a stream's too)
    page_local_prompt_tokens_total                    prompt tokens of finished requests
    page_local_cached_tokens_total                    of them, reused from the conversation cache (hits)
    page_local_generated_tokens_total                 answer tokens
    page_local_cache_hits_total                       finished requests that reused at least one token
    page_local_evicted_cells_total{reason}            KV cells evicted: gate (the speed budget) | room
    page_local_gate_decisions_total{verdict}          evicted | kept (gate open, nothing committed) | closed
    page_local_cancelled_total{stage}                 requests stopped early: prefill | answer
    page_local_failed_total                           requests that ended in an error in their slot
    page_local_queue_waiting, page_local_slots, page_local_slots_busy, page_local_cache_snapshots,
    page_local_cache_bytes, page_local_up             gauges read at scrape time

Nothing here imports prometheus_client until /metrics is scraped (it is in the `serve` extra).
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter

# request seconds: from a quick 404 to a long answer on a CPU
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
VERDICTS = ("evicted", "kept", "closed")


def verdict(decision) -> str:
    """A Decision as one label: its eviction committed, the gate open but nothing evicted (the conversation
    within the budget, or self-verification kept the full cache), or the gate closed."""
    if decision.evicted:
        return "evicted"
    return "kept" if decision.open else "closed"


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.http = Counter()  # (route, status) -> requests
        self.seconds: dict[str, list] = {}  # route -> [bucket counts..., +Inf count, sum]
        self.tokens = Counter()  # prompt | cached | generated | hits | failed
        self.evicted = Counter()  # gate | room -> cells
        self.verdicts = Counter()  # verdict -> turns
        self.cancelled = Counter()  # prefill | answer -> requests

    # --- counting ------------------------------------------------------------------------------
    def http_done(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.http[(route, str(status))] += 1
            h = self.seconds.setdefault(route, [0] * (len(BUCKETS) + 1) + [0.0])
            h[bisect.bisect_left(BUCKETS, seconds)] += 1
            h[-1] += seconds

    def finished(self, prompt: int, cached: int, generated: int, decision=None, gate_cells: int = 0,
                 room_cells: int = 0, cancelled: bool = False) -> None:
        """A request that ran to its end (or was stopped while answering) in a slot."""
        with self._lock:
            self.tokens["prompt"] += prompt
            self.tokens["cached"] += cached
            self.tokens["generated"] += generated
            self.tokens["hits"] += int(cached > 0)
            if decision is not None:
                self.verdicts[verdict(decision)] += 1
            self.evicted["gate"] += max(0, gate_cells)
            self.evicted["room"] += max(0, room_cells)
            if cancelled:
                self.cancelled["answer"] += 1

    def cancelled_prefill(self) -> None:
        with self._lock:
            self.cancelled["prefill"] += 1

    def failed(self) -> None:
        with self._lock:
            self.tokens["failed"] += 1

    # --- exposition ----------------------------------------------------------------------------
    def exposition(self, backend=None) -> tuple[bytes, str]:
        """(the text format, its content type), with the backend's gauges read now."""
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.exposition import CONTENT_TYPE_LATEST

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self, backend))
        return generate_latest(registry), CONTENT_TYPE_LATEST


class _Collector:
    def __init__(self, metrics: Metrics, backend):
        self.m, self.backend = metrics, backend

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        m = self.m
        with m._lock:
            http, seconds = dict(m.http), {k: list(v) for k, v in m.seconds.items()}
            tokens, evicted = dict(m.tokens), dict(m.evicted)
            verdicts, cancelled = dict(m.verdicts), dict(m.cancelled)

        c = CounterMetricFamily("page_local_http_requests", "HTTP requests answered, by route and status",
                                labels=["route", "status"])
        for (route, status), n in sorted(http.items()):
            c.add_metric([route, status], n)
        yield c
        h = HistogramMetricFamily("page_local_http_request_seconds",
                                  "Seconds from a request's arrival to the end of its response body",
                                  labels=["route"])
        for route, v in sorted(seconds.items()):
            cumulative, buckets = 0, []
            for bound, n in zip([*map(str, BUCKETS), "+Inf"], v[:-1]):
                cumulative += n
                buckets.append((bound, cumulative))
            h.add_metric([route], buckets, v[-1])
        yield h
        for name, key, text in (("page_local_prompt_tokens", "prompt", "Prompt tokens of requests answered"),
                                ("page_local_cached_tokens", "cached",
                                 "Prompt tokens reused from the conversation cache (not prefilled again)"),
                                ("page_local_generated_tokens", "generated", "Answer tokens generated"),
                                ("page_local_cache_hits", "hits", "Requests that reused cached tokens"),
                                ("page_local_failed", "failed", "Requests that ended in an error in their slot")):
            yield CounterMetricFamily(name, text, value=tokens.get(key, 0))
        c = CounterMetricFamily("page_local_evicted_cells", "KV cells evicted: by the gate's speed budget, or to "
                                "make room for a turn that did not fit", labels=["reason"])
        for reason in ("gate", "room"):
            c.add_metric([reason], evicted.get(reason, 0))
        yield c
        c = CounterMetricFamily("page_local_gate_decisions", "Turns by the gate's decision", labels=["verdict"])
        for v in VERDICTS:
            c.add_metric([v], verdicts.get(v, 0))
        yield c
        c = CounterMetricFamily("page_local_cancelled", "Requests stopped early (client gone, shutdown)",
                                labels=["stage"])
        for stage in ("prefill", "answer"):
            c.add_metric([stage], cancelled.get(stage, 0))
        yield c

        b = self.backend
        if b is None:
            return
        pool = b.pool
        for name, value, text in (
                ("page_local_up", int(b.state == "ready"), "1 when the model is loaded and requests are served"),
                ("page_local_slots", len(b.slots), "Slots (--parallel)"),
                ("page_local_slots_busy", sum(1 for s in b.slots if s.busy), "Slots running a request"),
                ("page_local_queue_waiting", pool.waiting if pool else 0, "Requests waiting for a slot"),
                ("page_local_queue_max", b.settings.queue, "Requests that may wait (--queue)"),
                ("page_local_cache_snapshots", len(b.cache), "Conversations kept in host RAM"),
                ("page_local_cache_bytes", b.cache.nbytes, "Bytes of the conversation cache in host RAM")):
            yield GaugeMetricFamily(name, text, value=value)


class HttpMetrics:
    """ASGI middleware, outermost: every answered request by its route's template (`other` for a path no
    route matches), its status and its seconds to the end of the response body. A client gone before
    the status line counts as 499 (nginx's "client closed request")."""

    def __init__(self, app, metrics: Metrics, routes):
        self.app, self.metrics = app, metrics
        self.routes = routes  # read when a request comes (the app's list, complete by then)

    @property
    def _patterns(self):
        return [(r.path_regex, r.path) for r in self.routes if hasattr(r, "path_regex")]

    def route(self, path: str) -> str:
        for regex, template in self._patterns:
            if regex.match(path):
                return template
        return "other"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        import time

        t0 = time.perf_counter()
        status = [499]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.http_done(self.route(scope["path"]), status[0], time.perf_counter() - t0)

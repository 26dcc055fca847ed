"""`page-local bench serve`: a load test of the server, measured side by side in one run.

Each client holds one chat (its own topic; its requests are the chat's turns, every answer sent back
as the assistant's message), streamed and not, the gate mixed across requests (never, verify,
always, page), greedy except every fourth request (temperature 0.7 with a fixed seed).

  1. alone: a fresh server answers every request one at a time, the chats one after another;
  2. load: a second fresh server (so that no cache from phase 1 is reused) answers client 0's first
     request alone, the server's memory is read, then all clients run their chats concurrently;
     then once more with new chats (the same turns, another first message), for the memory check.

Reported: errors; each greedy answer of phase 2 against the same request in phase 1 (identical
messages and settings), mismatches counted; time to first token (streamed requests) and latency,
p50/p95; completion tokens per second of both phases; the server's resident memory after the first
request, after the run and after the second round. The first run pages in the preallocated KV
buffers (n_ctx cells per slot) as its chats grow, so the leak check is the second round: its growth
beyond what the conversation cache grew by (the cache is bounded by --cache-mb) must be within 5 %
of the memory after the first run (memory_ok).

The clients use the standard library's http.client: the benchmark needs nothing beyond [serve].
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from page_local.errors import BenchError

TOPICS = ("the moon", "volcanoes", "honey bees", "the Roman empire", "rainbows", "chess", "coffee", "glaciers",
          "whales", "bicycles", "tea", "lighthouses", "deserts", "owls", "clocks", "bridges")
TURNS = ("Tell me about {topic} in two sentences.", "Why is that interesting?", "Give one example.",
         "Say it again in simpler words.", "What is a common mistake people make about it?",
         "Summarise our chat in one sentence.")
GATES = ("never", "verify", "always", "page")
MEMORY_TOLERANCE = 0.05


@dataclass(frozen=True)
class Spec:
    client: int
    turn: int
    stream: bool
    gate: str | None  # None: no page_local field
    temperature: float
    seed: int
    round: int = 1  # the memory check's second load round asks the same turns of new chats


def plan(clients: int, requests: int, chat_round: int = 1) -> list[list[Spec]]:
    """Per client, its chat's requests: request i goes to client i % clients, as turn i // clients."""
    out: list[list[Spec]] = [[] for _ in range(clients)]
    for i in range(requests):
        c, t = i % clients, i // clients
        out[c].append(Spec(c, t, stream=(c + t) % 2 == 0, gate=GATES[i % len(GATES)],
                           temperature=0.7 if i % 4 == 3 else 0.0, seed=1000 + i, round=chat_round))
    return out


def _user_text(spec: Spec) -> str:
    topic = TOPICS[spec.client % len(TOPICS)]
    text = TURNS[spec.turn % len(TURNS)].format(topic=topic)
    if spec.turn >= len(TURNS):
        text += f" (again, turn {spec.turn + 1})"
    return text if spec.round == 1 or spec.turn else f"{text} (round {spec.round})"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server in a child process on a free loopback port, with a random key (page_local_server(),
    or llama-cpp-python's own server for the side-by-side in serve/peer.py)."""

    def __init__(self, cmd: list[str], port: int, key: str, ready_path: str = "/health", env: dict | None = None):
        self.port, self.key, self.ready_path = port, key, ready_path
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self._err: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self._err.append(line.rstrip())

    def wait_ready(self, timeout: float = 180.0) -> None:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise BenchError(f"the server exited ({self.proc.returncode}): {' | '.join(self._err[-3:])}")
            try:
                status, _ = request(self.port, self.key, "GET", self.ready_path)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise BenchError(f"the server was not ready within {timeout:.0f} s")

    def stats(self) -> dict:
        status, body = request(self.port, self.key, "GET", "/v1/page_local/stats")
        if status != 200:
            raise BenchError(f"stats: HTTP {status}")
        return json.loads(body)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Server:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def page_local_server(model: Path, parallel: int, n_ctx: int, threads: int, queue: int,
                      extra: tuple[str, ...] = ()) -> Server:
    """`python -m page_local.cli serve` (the key through $PAGE_LOCAL_API_KEY, not the command line)."""
    port, key = free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "page_local.cli", "serve", "--model", str(model), "--port", str(port),
           "--parallel", str(parallel), "--n-ctx", str(n_ctx), "--threads", str(threads), "--queue", str(queue),
           *extra]
    return Server(cmd, port, key, env=dict(os.environ, PAGE_LOCAL_API_KEY=key))


def request(port: int, key: str, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read().decode("utf-8", "replace")
    finally:
        conn.close()


@dataclass
class Outcome:
    key: str  # the request, canonical JSON
    spec: Spec
    text: str | None  # None: the request failed
    error: str | None
    completion_tokens: int
    cached_tokens: int
    prompt_tokens: int
    ttft_s: float | None  # streamed requests: the first content chunk
    total_s: float


def chat(port: int, key: str, spec: Spec, messages: list[dict], max_tokens: int) -> Outcome:
    """One request, streamed or not; never raises for an HTTP or stream error (it is the Outcome's).
    spec.gate None: no page_local field (another server)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": spec.temperature,
            "seed": spec.seed, "stream": spec.stream}
    if spec.gate is not None:
        body["page_local"] = {"gate": spec.gate}
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    rkey = json.dumps({k: v for k, v in body.items() if k not in ("stream", "stream_options")}, sort_keys=True)
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            msg = resp.read().decode("utf-8", "replace")
            return Outcome(rkey, spec, None, f"HTTP {resp.status}: {msg[:200]}", 0, 0, 0, None,
                           time.perf_counter() - t0)
        if not spec.stream:
            obj = json.loads(resp.read())
            u = obj["usage"]
            return Outcome(rkey, spec, obj["choices"][0]["message"]["content"], None, u["completion_tokens"],
                           _cached(u), u["prompt_tokens"], None, time.perf_counter() - t0)
        parts, ttft, use, error, done = [], None, None, None, False
        for raw in resp:
            line = raw.decode("utf-8").rstrip("\r\n")
            if not line.startswith("data: "):
                if line.startswith(":") and spec.gate is not None:  # page-local sends no keep-alive comments
                    error = error or "a comment frame in the stream"
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                error = obj["error"]["message"]
                continue
            if obj.get("usage"):
                use = obj["usage"]
            for ch in obj.get("choices", ()):
                piece = ch.get("delta", {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    parts.append(piece)
        if use is None and spec.gate is None:  # another server, without the usage chunk: one piece a token
            use = {"completion_tokens": len(parts), "prompt_tokens": 0}
        if not done or use is None:
            error = error or ("no [DONE]" if not done else "no usage chunk")
        total = time.perf_counter() - t0
        if error:
            return Outcome(rkey, spec, None, error, 0, 0, 0, ttft, total)
        return Outcome(rkey, spec, "".join(parts), None, use["completion_tokens"], _cached(use),
                       use["prompt_tokens"], ttft, total)
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        return Outcome(rkey, spec, None, f"{type(e).__name__}: {e}", 0, 0, 0, None, time.perf_counter() - t0)
    finally:
        conn.close()


def _cached(use: dict) -> int:
    return int((use.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def run_chat(port: int, key: str, specs: list[Spec], max_tokens: int, out: list[Outcome],
             messages: list[dict] | None = None) -> list[dict]:
    """A client's chat: its requests in order, each answer sent back; stops at the first failure."""
    messages = list(messages or [])
    for spec in specs:
        messages.append({"role": "user", "content": _user_text(spec)})
        o = chat(port, key, spec, messages, max_tokens)
        out.append(o)
        if o.text is None:
            break
        messages.append({"role": "assistant", "content": o.text})
    return messages


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, round(q * (len(v) - 1)))], 4)


def serve_benchmark(model: Path, clients: int = 8, requests: int = 48, max_tokens: int = 32, parallel: int = 2,
                    n_ctx: int = 4096, threads: int = 2,
                    progress: Callable[[str], None] | None = None) -> dict:
    if requests < clients:
        raise ValueError(f"--requests {requests} is fewer than --clients {clients}: every client needs a request")
    say = progress or (lambda m: None)
    chats = plan(clients, requests)
    common = {"model": model, "parallel": parallel, "n_ctx": n_ctx, "threads": threads, "queue": clients + 1}

    say(f"phase 1: {requests} requests alone, one at a time")
    alone: list[Outcome] = []
    with page_local_server(**common) as srv:
        t0 = time.perf_counter()
        for specs in chats:
            run_chat(srv.port, srv.key, specs, max_tokens, alone)
        alone_s = time.perf_counter() - t0

    say(f"phase 2: {clients} clients at once")
    load: list[Outcome] = []
    with page_local_server(**common) as srv:
        first: list[Outcome] = []
        history0 = run_chat(srv.port, srv.key, chats[0][:1], max_tokens, first)
        s_first = srv.stats()
        t0 = time.perf_counter()
        per_client: list[list[Outcome]] = [[] for _ in chats]
        workers = [threading.Thread(target=run_chat, args=(srv.port, srv.key, chats[0][1:], max_tokens,
                                                            per_client[0], history0))]
        workers += [threading.Thread(target=run_chat, args=(srv.port, srv.key, specs, max_tokens, per_client[c]))
                    for c, specs in enumerate(chats) if c > 0]
        _together(workers)
        load_s = time.perf_counter() - t0
        s_load = srv.stats()
        load = first + [o for outs in per_client for o in outs]

        # memory: the KV buffers (n_ctx cells per slot) and the allocator are paged in as the first
        # conversations grow, so a leak shows as growth over a second round of new chats, beyond
        # what the conversation cache (bounded by --cache-mb) grew by
        say(f"phase 2, memory: {clients} new chats at once")
        again: list[list[Outcome]] = [[] for _ in chats]
        _together([threading.Thread(target=run_chat, args=(srv.port, srv.key, specs, max_tokens, again[c]))
                   for c, specs in enumerate(plan(clients, requests, chat_round=2))])
        s_end = srv.stats()

    ref = {o.key: o for o in alone if o.text is not None}
    errors = [o for o in alone + load + [o for outs in again for o in outs] if o.text is None]
    compared = mismatches = seeded_compared = seeded_mismatches = unmatched = 0
    for o in load:
        if o.text is None:
            continue
        r = ref.get(o.key)
        if r is None:
            unmatched += 1
        elif o.spec.temperature == 0:
            compared += 1
            mismatches += r.text != o.text
        else:
            seeded_compared += 1
            seeded_mismatches += r.text != o.text
    ok = [o for o in load if o.text is not None]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    load_tokens = sum(o.completion_tokens for o in ok if o is not load[0])
    alone_tokens = sum(o.completion_tokens for o in alone if o.text is not None)
    rss0, rss1, rss2 = s_first.get("rss_bytes"), s_load.get("rss_bytes"), s_end.get("rss_bytes")
    cache0, cache1, cache2 = s_first["cache"]["bytes"], s_load["cache"]["bytes"], s_end["cache"]["bytes"]
    leak = (rss2 - rss1) - (cache2 - cache1) if rss1 and rss2 else None
    return {
        "clients": clients, "requests": requests, "max_tokens": max_tokens, "parallel": parallel, "n_ctx": n_ctx,
        "threads": threads, "errors": len(errors), "error_messages": [o.error for o in errors[:5]],
        "compared": compared, "mismatches": mismatches, "seeded_compared": seeded_compared,
        "seeded_mismatches": seeded_mismatches, "unmatched": unmatched,
        "ttft_p50_s": _pct(ttft, 0.5), "ttft_p95_s": _pct(ttft, 0.95),
        "latency_p50_s": _pct([o.total_s for o in ok], 0.5), "latency_p95_s": _pct([o.total_s for o in ok], 0.95),
        "load_s": round(load_s, 3), "load_tokens": load_tokens,
        "tokens_per_s": round(load_tokens / load_s, 2) if load_s > 0 else None,
        "alone_s": round(alone_s, 3), "alone_tokens": alone_tokens,
        "alone_tokens_per_s": round(alone_tokens / alone_s, 2) if alone_s > 0 else None,
        "prompt_tokens": sum(o.prompt_tokens for o in ok), "cached_tokens": sum(o.cached_tokens for o in ok),
        "rss_first_bytes": rss0, "rss_load_bytes": rss1, "rss_end_bytes": rss2,
        "cache_first_bytes": cache0, "cache_load_bytes": cache1, "cache_end_bytes": cache2,
        "snapshots_end": s_end["cache"]["snapshots"], "cache_cap_bytes": s_end["cache"]["cap_bytes"],
        "second_round_growth_beyond_cache_bytes": leak,
        "memory_ok": None if leak is None else leak <= MEMORY_TOLERANCE * rss1,
    }


def _together(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def describe(r: dict) -> str:
    mb = 2**20
    mem = ("memory: not measured on this platform" if r["rss_first_bytes"] is None else
           f"server memory {r['rss_first_bytes'] / mb:.0f} MiB after the first request, {r['rss_load_bytes'] / mb:.0f} "
           f"MiB after the run ({r['cache_load_bytes'] / mb:.0f} MiB of it the conversation cache), "
           f"{r['rss_end_bytes'] / mb:.0f} MiB after a second round of new chats (cache {r['cache_end_bytes'] / mb:.0f} "
           f"MiB): {r['second_round_growth_beyond_cache_bytes'] / mb:+.1f} MiB beyond the cache, "
           f"{'within' if r['memory_ok'] else 'over'} 5 %")
    return (f"{r['clients']} clients, {r['requests']} requests of up to {r['max_tokens']} tokens, "
            f"--parallel {r['parallel']}: {r['errors']} errors; {r['mismatches']} of {r['compared']} greedy answers "
            f"differ from the request served alone ({r['seeded_mismatches']} of {r['seeded_compared']} seeded); "
            f"time to first token p50 {r['ttft_p50_s']} s, p95 {r['ttft_p95_s']} s; latency p50 {r['latency_p50_s']} s, "
            f"p95 {r['latency_p95_s']} s; {r['tokens_per_s']} tok/s under load vs {r['alone_tokens_per_s']} tok/s "
            f"alone; {r['cached_tokens']} of {r['prompt_tokens']} prompt tokens reused from the cache; {mem}")

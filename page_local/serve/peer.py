"""Peers of `page-local bench serve`, measured side by side in one run.

`stock_comparison()`: page-local serve next to stock llama.cpp's own `llama-server` (built unpatched from
the same pinned tree by `make peer-server`), both with the same --parallel (llama-server's -np, its -c the
per-slot n_ctx times the slots), thread count and GGUF, stock on both flash-attention paths (its default
"auto" is "on" on the CPU). For 1, 2, 4 and 8 concurrent clients, each holding a streamed, greedy 3-turn
chat (answers sent back, so both servers reuse the conversation's prefix): completion tokens per second
and the time to first token (p50 over the requests). All servers are started first and measured in turn,
client count by client count, repetition by repetition (medians), so that whatever else the machine runs
weighs on each alike. Resident memory is read from /proc once each server is ready and after the run,
with a page-local `--parallel 1` server beside it for the ratio of N slots to one.

`peer_comparison()`, `page-local bench serve --peer-python PY`: page-local serve next to llama-cpp-python's own server
(`llama_cpp.server`, its [server] extra), the same GGUF, prompts and thread count, in one run: all
servers started, then measured in turn, repetition by repetition (medians over the repetitions):

  * time to first token on the last turn (default 6) of a chat whose earlier turns the client sent
    first, each answer sent back (both servers reuse the conversation's prefix: llama-cpp-python
    keeps the longest prefix of its one sequence); and on the first turn;
  * throughput: completion tokens per second with 4 concurrent clients, each running a short chat
    (page-local with --parallel 1, as llama-cpp-python's one sequence).

llama-cpp-python cannot live in page-local's environment (its `llama_cpp` would replace the one
page-local's build installs), so it runs from another Python, PY (a venv with
`pip install 'llama-cpp-python[server]'`). Ratios are page-local / llama-cpp-python: below 1 for
time to first token and above 1 for throughput favour page-local.
"""

from __future__ import annotations

import secrets
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

from page_local.errors import BenchError
from page_local.serve.backend import rss_bytes
from page_local.serve.bench import (
    Outcome,
    Server,
    Spec,
    free_port,
    page_local_server,
    run_chat,
)


def llama_cpp_server(python: str, model: Path, n_ctx: int, threads: int) -> Server:
    port, key = free_port(), secrets.token_hex(16)
    cmd = [python, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--n_ctx", str(n_ctx), "--n_threads", str(threads), "--n_threads_batch", str(threads), "--api_key", key]
    return Server(cmd, port, key, ready_path="/v1/models")


def measure(srv: Server, gate: str | None, rep: int, turns: int, clients: int, requests: int,
            max_tokens: int) -> dict:
    """One repetition on one server: a chat of `turns` turns (the first and the last streamed), then
    `clients` concurrent chats of `requests` turns. Chats differ between repetitions (no cache carries
    over)."""
    base = rep * (clients + 1)
    outs: list[Outcome] = []
    run_chat(srv.port, srv.key, [Spec(client=base, turn=t, stream=t in (0, turns - 1), gate=gate,
                                      temperature=0.0, seed=0) for t in range(turns)], max_tokens, outs)
    errors = [o.error for o in outs if o.text is None]
    ttft = (outs[0].ttft_s, outs[-1].ttft_s) if len(outs) == turns and not errors else (None, None)
    done, wall = concurrent_chats(srv, [[Spec(client=base + 1 + c, turn=t, stream=False, gate=gate, temperature=0.0,
                                              seed=0) for t in range(requests)] for c in range(clients)], max_tokens)
    errors += [o.error for o in done if o.text is None]
    tokens = sum(o.completion_tokens for o in done if o.text is not None)
    return {"ttft_first": ttft[0], "ttft_last": ttft[1], "tok_s": tokens / wall if wall > 0 else None,
            "errors": errors}


def concurrent_chats(srv: Server, chats: list[list[Spec]], max_tokens: int) -> tuple[list[Outcome], float]:
    """Each chat in its own client thread, all at once: every request's Outcome, and the wall time."""
    per: list[list[Outcome]] = [[] for _ in chats]
    workers = [threading.Thread(target=run_chat, args=(srv.port, srv.key, specs, max_tokens, per[c]))
               for c, specs in enumerate(chats)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return [o for p in per for o in p], time.perf_counter() - t0


def peer_comparison(model: Path, peer_python: str, turns: int = 6, reps: int = 3, clients: int = 4,
                    requests: int = 3, max_tokens: int = 32, n_ctx: int = 4096, threads: int = 2,
                    progress: Callable[[str], None] | None = None) -> dict:
    """All servers are started first and measured in turn, repetition by repetition, so that whatever
    else the machine runs weighs on each alike; medians over the repetitions."""
    say = progress or (lambda m: None)
    servers = {"llama-cpp-python": (llama_cpp_server(peer_python, model, n_ctx, threads), None)}
    for gate in ("never", "verify"):
        servers[f"page-local gate {gate}"] = (page_local_server(model, parallel=1, n_ctx=n_ctx, threads=threads,
                                                                queue=clients + 1, extra=("--gate", gate)), gate)
    samples: dict[str, list[dict]] = {name: [] for name in servers}
    try:
        for srv, _ in servers.values():
            srv.wait_ready()
        for rep in range(reps):
            for name, (srv, gate) in servers.items():
                say(f"repetition {rep + 1} of {reps}: {name}")
                samples[name].append(measure(srv, gate, rep, turns, clients, requests, max_tokens))
    finally:
        for srv, _ in servers.values():
            srv.stop()
    bad = {k: e for k, runs in samples.items() for r in runs for e in r["errors"][:1]}
    if bad:
        raise BenchError(f"requests failed: {bad}")
    runs = {name: {"ttft_first_turn_s": _median([r["ttft_first"] for r in rs]),
                   f"ttft_turn{turns}_s": _median([r["ttft_last"] for r in rs]),
                   "tokens_per_s": _median([r["tok_s"] for r in rs])} for name, rs in samples.items()}
    peer, key = runs["llama-cpp-python"], f"ttft_turn{turns}_s"
    ratios = {name: {f"ttft_turn{turns}": _ratio(r[key], peer[key]),
                     "ttft_first_turn": _ratio(r["ttft_first_turn_s"], peer["ttft_first_turn_s"]),
                     f"tokens_per_s_{clients}_clients": _ratio(r["tokens_per_s"], peer["tokens_per_s"])}
              for name, r in runs.items() if name != "llama-cpp-python"}
    return {"model": model.name, "turns": turns, "reps": reps, "clients": clients, "requests": requests,
            "max_tokens": max_tokens, "n_ctx": n_ctx, "threads": threads, "runs": runs, "ratios": ratios}


def _median(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def describe(r: dict) -> str:
    lines = [f"{r['model']}, n_ctx {r['n_ctx']}, {r['threads']} threads, answers of up to {r['max_tokens']} tokens:"]
    key = f"ttft_turn{r['turns']}_s"
    for name, run in r["runs"].items():
        lines.append(f"  {name}: first token on turn 1 {run['ttft_first_turn_s']} s, on turn {r['turns']} "
                     f"{run[key]} s; {r['clients']} clients {run['tokens_per_s']} tok/s")
    for name, q in r["ratios"].items():
        lines.append(f"  {name} / llama-cpp-python: " + ", ".join(f"{k} {v}" for k, v in q.items()))
    return "\n".join(lines)


# --- stock llama-server ---------------------------------------------------------------------------

CLIENT_COUNTS = (1, 2, 4, 8)


def stock_server(bin_dir: Path, model: Path, parallel: int, n_ctx: int, threads: int, flash_attn: str) -> Server:
    """llama-server with `parallel` slots of n_ctx tokens each (its -c is the total), its prompt cache on
    (its default), a random key."""
    port, key = free_port(), secrets.token_hex(16)
    cmd = [str(bin_dir / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-c", str(n_ctx * parallel), "-np", str(parallel), "-t", str(threads), "-tb", str(threads),
           "-fa", flash_attn, "--no-webui", "--api-key", key]
    return Server(cmd, port, key, ready_path="/health")


def measure_clients(srv: Server, clients: int, round_: int, turns: int, max_tokens: int) -> dict:
    """`clients` concurrent streamed greedy chats of `turns` turns on one server; round_ makes the chats'
    first messages new (no cache from an earlier measurement is reused)."""
    done, wall = concurrent_chats(srv, [[Spec(client=c, turn=t, stream=True, gate=None, temperature=0.0, seed=0,
                                              round=round_) for t in range(turns)] for c in range(clients)],
                                  max_tokens)
    ok = [o for o in done if o.text is not None]
    tokens = sum(o.completion_tokens for o in ok)
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    return {"tok_s": tokens / wall if wall > 0 else None, "ttft_p50": statistics.median(ttft) if ttft else None,
            "tokens": tokens, "errors": [o.error for o in done if o.text is None]}


def stock_comparison(model: Path, bin_dir: Path, parallel: int = 4, clients: tuple[int, ...] = CLIENT_COUNTS,
                     reps: int = 3, turns: int = 3, max_tokens: int = 32, n_ctx: int = 4096, threads: int = 2,
                     progress: Callable[[str], None] | None = None) -> dict:
    say = progress or (lambda m: None)
    common = {"n_ctx": n_ctx, "threads": threads, "queue": max(clients) + 1}
    # started one after another: a page-local server's first-use attention tuning (when this machine has
    # none stored) must not share the CPU with another's
    makers = {f"page-local --parallel {parallel}": lambda: page_local_server(model, parallel=parallel, **common),
              "stock fa on": lambda: stock_server(bin_dir, model, parallel, n_ctx, threads, "on"),
              "stock fa off": lambda: stock_server(bin_dir, model, parallel, n_ctx, threads, "off"),
              "page-local --parallel 1": lambda: page_local_server(model, parallel=1, **common)}
    started: dict[str, Server] = {}
    rss: dict[str, dict] = {}
    try:
        for name, make in makers.items():
            say(f"starting {name}")
            started[name] = make()
            started[name].wait_ready()
            rss[name] = {"ready_bytes": rss_bytes(started[name].proc.pid)}
        one = started.pop("page-local --parallel 1")  # memory only: N slots against one
        one.stop()  # it stays out of the timings
        servers = started
        samples: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in clients} for name in servers}
        round_ = 1
        for rep in range(reps):
            for c in clients:
                round_ += 1
                for name, srv in servers.items():
                    say(f"repetition {rep + 1} of {reps}, {c} client(s): {name}")
                    samples[name][c].append(measure_clients(srv, c, round_, turns, max_tokens))
        for name, srv in servers.items():
            rss[name]["after_bytes"] = rss_bytes(srv.proc.pid)
    finally:
        for srv in started.values():
            srv.stop()
    bad = {k: e for k, per_c in samples.items() for runs in per_c.values() for r in runs for e in r["errors"][:1]}
    if bad:
        raise BenchError(f"requests failed: {bad}")
    runs = {name: {str(c): {"tokens_per_s": _median([r["tok_s"] for r in rs]),
                            "ttft_p50_s": _median([r["ttft_p50"] for r in rs]),
                            "tokens_per_s_runs": [round(r["tok_s"], 2) for r in rs]}
                   for c, rs in per_c.items()} for name, per_c in samples.items()}
    pl = f"page-local --parallel {parallel}"
    stock = {name: r for name, r in runs.items() if name.startswith("stock")}
    ratios = {}
    for c in clients:
        k = str(c)
        best_tps = max(r[k]["tokens_per_s"] or 0 for r in stock.values())
        best_ttft = min(r[k]["ttft_p50_s"] or float("inf") for r in stock.values())
        ratios[k] = {"tokens_per_s_vs_stock_best": _ratio(runs[pl][k]["tokens_per_s"], best_tps),
                     "tokens_per_s_vs_stock_default": _ratio(runs[pl][k]["tokens_per_s"],
                                                             runs["stock fa on"][k]["tokens_per_s"]),
                     "ttft_vs_stock_best": _ratio(runs[pl][k]["ttft_p50_s"], best_ttft)}
    one_rss = rss["page-local --parallel 1"]["ready_bytes"]
    mem_ratio = _ratio(rss[pl]["ready_bytes"], one_rss)
    return {"model": model.name, "parallel": parallel, "clients": list(clients), "reps": reps, "turns": turns,
            "max_tokens": max_tokens, "n_ctx": n_ctx, "threads": threads, "stock_bin": str(bin_dir),
            "runs": runs, "ratios": ratios, "rss": rss, "rss_parallel_vs_one": mem_ratio}


def describe_stock(r: dict) -> str:
    mb = 2**20
    lines = [f"{r['model']}, --parallel {r['parallel']} (stock -np {r['parallel']}), n_ctx {r['n_ctx']} per slot, "
             f"{r['threads']} threads, {r['turns']}-turn chats, answers of up to {r['max_tokens']} tokens, "
             f"medians of {r['reps']}:"]
    for c in r["clients"]:
        k = str(c)
        row = "; ".join(f"{name} {run[k]['tokens_per_s']} tok/s, first token {run[k]['ttft_p50_s']} s"
                        for name, run in r["runs"].items())
        q = r["ratios"][k]
        lines.append(f"  {c} client(s): {row}; page-local / stock best: tok/s {q['tokens_per_s_vs_stock_best']}, "
                     f"first token {q['ttft_vs_stock_best']}")
    mem = ", ".join(f"{name} {v['ready_bytes'] / mb:.0f} MiB" for name, v in r["rss"].items() if v["ready_bytes"])
    lines.append(f"  resident memory once ready: {mem}; --parallel {r['parallel']} / --parallel 1: "
                 f"{r['rss_parallel_vs_one']}")
    return "\n".join(lines)

"""`page-local bench serve --peer-python PY`: page-local serve next to llama-cpp-python's own server
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
    per: list[list[Outcome]] = [[] for _ in range(clients)]
    workers = [threading.Thread(target=run_chat, args=(
        srv.port, srv.key, [Spec(client=base + 1 + c, turn=t, stream=False, gate=gate, temperature=0.0, seed=0)
                            for t in range(requests)], max_tokens, per[c])) for c in range(clients)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    done = [o for p in per for o in p]
    errors += [o.error for o in done if o.text is None]
    tokens = sum(o.completion_tokens for o in done if o.text is not None)
    return {"ttft_first": ttft[0], "ttft_last": ttft[1], "tok_s": tokens / wall if wall > 0 else None,
            "errors": errors}


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

"""`page-local bench chat`: time to first token and tokens/s per turn of a chat that outgrows n_ctx,
page-local beside the full cache, measured side by side in one run.

page-local is the Engine as `page-local chat` gives it (no eviction for speed, defaults.CHAT_BUDGET;
room on demand at the wall; `budget` sets a speed budget instead, under the verify gate) in a context of n_ctx; the full cache is a ChatSession on a context large enough for the
whole chat (capped at the model's trained context: past it the full cache no longer fits, and the
later turns are page-local's alone). Every turn is sent to both chats, one after the other, in an
order that alternates from turn to turn and from repeat to repeat; per turn the medians over the
repeats, and the ratios page-local / full (TTFT: below 1 is faster; tok/s: above 1 is faster).

Each message is a generated prose document (tasks.synthetic's "prose") and a request to summarise
it, sized so that the chat's messages add up to `outgrow` x n_ctx tokens; answers are greedy, at most
`gen` tokens. Run it alone on the machine (bench/speed.py says why).
"""

from __future__ import annotations

import statistics
import time

from page_local import defaults
from page_local.chat.session import ChatSession
from page_local.engine.engine import Engine
from page_local.errors import ContextFull
from page_local.tasks import synthetic


def _messages(model, turns: int, n_ctx: int, outgrow: float, gen: int, seed: int) -> list[str]:
    size = max(48, int(outgrow * n_ctx / turns) - gen - 16)  # the template and the answer take the rest

    def count(text: str) -> int:
        return len(model.tokenize(text, add_special=False))

    return [s.user_content() for s in synthetic.generate("prose", turns, size, count, seed=seed, max_new_tokens=1)]


def _turn(chat: ChatSession, message: str, gen: int) -> dict:
    t0 = time.perf_counter()
    first = None
    s = chat.send(message, max_tokens=gen)
    for _ in s:
        if first is None:
            first = time.perf_counter() - t0
    d, r = s.decision, s.result
    return dict(ttft_s=first if first is not None else time.perf_counter() - t0, tok_s=r.tokens_per_s,
                gen_tokens=len(r.tokens), T=d.T, cells=chat.engine.cells_used(), room_evicted=d.room_evicted,
                chunks=d.chunks, speed_evicted=d.evicted)


def _med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def chat_speed(model_path, turns: int = 10, n_ctx: int = 1024, outgrow: float = 3.0, gen: int = 32,
               repeats: int = 1, threads: int = 2, seed: int = 0, n_gpu_layers: int | str | None = None,
               budget: float | int = defaults.CHAT_BUDGET) -> dict:
    """A `turns`-turn chat of about outgrow x n_ctx tokens through page-local (n_ctx) and the full cache."""
    for name, v, low in (("turns", turns, 2), ("n_ctx", n_ctx, 128), ("gen", gen, 1), ("repeats", repeats, 1),
                         ("threads", threads, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"--{name.replace('_', '-')} must be an int >= {low}, got {v!r}")
    if not outgrow > 1:
        raise ValueError(f"--outgrow must be above 1 (the chat outgrows n_ctx), got {outgrow!r}")
    runs: dict[str, list[list[dict]]] = {"page_local": [[] for _ in range(turns)], "full": [[] for _ in range(turns)]}
    refusals = 0
    with Engine(model_path, n_ctx=n_ctx, budget=budget, threads=threads, n_gpu_layers=n_gpu_layers) as pl:
        n_train = pl.model.n_ctx_train
        need = int(outgrow * n_ctx) + turns * (2 * gen + 32) + 256
        full_ctx = min(need, n_train) if n_train > 0 else need
        messages = _messages(pl.model, turns, n_ctx, outgrow, gen, seed)
        with Engine(model_path, n_ctx=full_ctx, gate="never", on_full="refuse", threads=threads,
                    n_gpu_layers=n_gpu_layers) as full:
            device = pl.placement
            for r in range(repeats):
                chats = {"page_local": ChatSession(pl), "full": ChatSession(full)}
                fits = True
                for k, message in enumerate(messages):
                    for name in (("page_local", "full") if (k + r) % 2 == 0 else ("full", "page_local")):
                        if name == "full" and not fits:
                            continue
                        try:
                            runs[name][k].append(_turn(chats[name], message, gen))
                        except ContextFull:
                            if name == "full":
                                fits = False  # the whole chat no longer fits the trained context
                            else:
                                refusals += 1
    per_turn, wall = [], None
    for k in range(turns):
        p, f = runs["page_local"][k], runs["full"][k]
        row = dict(turn=k + 1, conversation_tokens=p[0]["T"] if p else None)
        if p:
            row["page_local"] = dict(ttft_s=round(_med(p, "ttft_s"), 4), tok_s=round(_med(p, "tok_s"), 2),
                                     cells=p[0]["cells"], room_evicted=p[0]["room_evicted"], chunks=p[0]["chunks"],
                                     speed_evicted=p[0]["speed_evicted"], gen_tokens=p[0]["gen_tokens"])
            if wall is None and (p[0]["room_evicted"] or p[0]["chunks"] > 1):
                wall = k + 1
        if f:
            row["full"] = dict(ttft_s=round(_med(f, "ttft_s"), 4), tok_s=round(_med(f, "tok_s"), 2),
                               cells=f[0]["cells"], gen_tokens=f[0]["gen_tokens"])
        if p and f:
            row["ttft_ratio"] = round(row["page_local"]["ttft_s"] / row["full"]["ttft_s"], 4)
            row["tok_s_ratio"] = round(row["page_local"]["tok_s"] / row["full"]["tok_s"], 4) \
                if row["full"]["tok_s"] > 0 else None
        per_turn.append(row)

    def ratio(key: str, past_wall: bool) -> float | None:
        xs = [t[key] for t in per_turn if t.get(key) is not None and (not past_wall or (wall and t["turn"] >= wall))]
        return round(statistics.median(xs), 4) if xs else None

    return {
        "bench": "chat", "turns": turns, "n_ctx": n_ctx, "budget": budget, "full_n_ctx": full_ctx, "outgrow": outgrow, "gen": gen,
        "repeats": repeats, "threads": threads,
        "conversation_tokens": per_turn[-1]["conversation_tokens"],
        "first_wall_turn": wall, "full_fits_turns": sum(1 for t in per_turn if "full" in t), "refusals": refusals,
        "ttft_ratio": ratio("ttft_ratio", False), "tok_s_ratio": ratio("tok_s_ratio", False),
        "ttft_ratio_past_wall": ratio("ttft_ratio", True), "tok_s_ratio_past_wall": ratio("tok_s_ratio", True),
        "per_turn": per_turn, "device": device,
    }

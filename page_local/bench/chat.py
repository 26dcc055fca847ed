"""`page-local bench chat`: time to first token and tokens/s per turn of a chat that outgrows n_ctx,
page-local beside the full cache, measured side by side in one run.

page-local is the Engine as `page-local chat` gives it (defaults.CHAT_BUDGET and CHAT_LADDER under CHAT_GATE, parking
cells, engine/parking.py, defaults.CHAT_PARK; room on demand at the wall; budget 1.0: no eviction for speed;
park False: the budget evicts for good) in a context of n_ctx; the full cache is a ChatSession on a context large enough for the
whole chat (capped at the model's trained context: past it the full cache no longer fits, and the
later turns are page-local's alone). Every turn is sent to both chats, one after the other, in an
order that alternates from turn to turn and from repeat to repeat; per turn the medians over the
repeats, and the ratios page-local / full (TTFT: below 1 is faster; tok/s: above 1 is faster).

Stock llama.cpp beside them, when its llama-server is built (`make peer-server`, bench/stock.py): the
same messages sent as a chat app sends them, the whole conversation each turn to /v1/chat/completions
with the prefix the slot holds reused (cache_prompt), in a context that holds the whole chat (as the
full cache's), on each flash-attention path; per turn the server's own prompt_ms and decode tok/s.
Stock's default is flash attention on ("auto"); its best is the faster path per figure, over the whole
chat. page-local against it is "x as fast" (stock TTFT / page-local's, page-local tok/s / stock's:
above 1, page-local is faster). Each repeat's first turn is read with cache_prompt off, so a repeat
never reuses the previous one's conversation.

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


def _check(d) -> str:
    """What the speed budget's check did on a turn, in a word: below park_from (the full cache kept without
    one), rested (selfcheck.Backoff), answer over (parking: the answer ended inside the check's span, so none
    ran), would not pay (parking: too few tokens expected after the cap, selfcheck.Payback), passed (the
    eviction or parking committed), refused, or none (nothing to evict, or a gate without a
    check)."""
    if d.park_from is not None:
        return "below park_from"
    if d.check_rested is not None:
        return "rested"
    if d.check_unneeded is not None:
        return "answer over"
    if d.check_unpaid is not None:
        return "would not pay"
    if d.verify_score is None:
        return "none"
    return "passed" if d.evicted else "refused"


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
                chunks=d.chunks, speed_evicted=d.evicted, parked=d.parked, restored=d.restored, check=_check(d))


def _med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _stock_chat(bin_dir, model_path, messages: list[str], n_ctx: int, gen: int, repeats: int,
                threads: int) -> dict:
    """Stock llama-server on each flash-attention path: per path, per turn, the medians over the repeats of
    TTFT (prompt_ms) and decode tok/s, and the tokens it read."""
    from pathlib import Path

    from page_local.bench import stock

    out = {}
    for setting in stock.SETTINGS:
        turns: list[list[dict]] = [[] for _ in messages]
        with stock.StockServer(bin_dir, Path(model_path), n_ctx, threads, setting, cache_prompt=True) as srv:
            for _ in range(repeats):
                conv: list[dict] = []
                for k, message in enumerate(messages):
                    conv.append({"role": "user", "content": message})
                    r = srv.chat(conv, gen, cache_prompt=k > 0)
                    conv.append({"role": "assistant", "content": r["content"]})
                    turns[k].append(r)
        out[setting] = [dict(ttft_s=round(statistics.median(r["prompt_ms"] for r in t) / 1e3, 4),
                             tok_s=round(statistics.median(r["decode_tok_s"] for r in t), 2),
                             prompt_n=t[0]["prompt_n"], gen_tokens=t[0]["gen_tokens"]) for t in turns]
    return out


def chat_speed(model_path, turns: int = 10, n_ctx: int = 1024, outgrow: float = 3.0, gen: int = 32,
               repeats: int = 1, threads: int = 2, seed: int = 0, n_gpu_layers: int | str | None = None,
               budget: float | int = defaults.CHAT_BUDGET, peer_bin=None, rpc=None, attention_settings=None,
               park: bool = defaults.CHAT_PARK, park_from: int | None = None,
               evictor: str = defaults.CHAT_EVICTOR, gate: str = defaults.CHAT_GATE,
               ladder=defaults.CHAT_LADDER, verify_tokens: int | None = None) -> dict:
    """A `turns`-turn chat of about outgrow x n_ctx tokens through page-local (n_ctx) and the full cache, and
    stock llama-server when built (peer_bin, else bench/stock.find_bin's default). n_gpu_layers, rpc,
    attention_settings: as Engine's, for both engines; verify_tokens: page-local's check span (None: the
    engine's)."""
    from page_local.bench import stock

    for name, v, low in (("turns", turns, 2), ("n_ctx", n_ctx, 128), ("gen", gen, 1), ("repeats", repeats, 1),
                         ("threads", threads, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"--{name.replace('_', '-')} must be an int >= {low}, got {v!r}")
    if not outgrow > 0:
        raise ValueError(f"--outgrow must be above 0, got {outgrow!r}")
    bin_dir = stock.find_bin(peer_bin)
    runs: dict[str, list[list[dict]]] = {"page_local": [[] for _ in range(turns)], "full": [[] for _ in range(turns)]}
    refusals = 0
    load = dict(n_gpu_layers=n_gpu_layers, rpc=rpc, attention_settings=attention_settings)
    parking = dict(park=True) if park else {}
    if park and park_from is not None:
        parking["park_from"] = park_from
    if verify_tokens is not None:
        parking["verify_tokens"] = verify_tokens
    with Engine(model_path, n_ctx=n_ctx, budget=budget, evictor=evictor, threads=threads, gate=gate, ladder=ladder,
                **parking, **load) as pl:
        n_train = pl.model.n_ctx_train
        need = int(outgrow * n_ctx) + turns * (2 * gen + 32) + 256
        full_ctx = min(need, n_train) if n_train > 0 else need
        messages = _messages(pl.model, turns, n_ctx, outgrow, gen, seed)
        with Engine(model_path, n_ctx=full_ctx, gate="never", on_full="refuse", threads=threads, **load) as full:
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
    stock_runs = _stock_chat(bin_dir, model_path, messages, full_ctx, gen, repeats, threads) if bin_dir else None
    per_turn, wall = [], None
    for k in range(turns):
        p, f = runs["page_local"][k], runs["full"][k]
        row = dict(turn=k + 1, conversation_tokens=p[0]["T"] if p else None)
        if p:
            row["page_local"] = dict(ttft_s=round(_med(p, "ttft_s"), 4), tok_s=round(_med(p, "tok_s"), 2),
                                     cells=p[0]["cells"], room_evicted=p[0]["room_evicted"], chunks=p[0]["chunks"],
                                     speed_evicted=p[0]["speed_evicted"], gen_tokens=p[0]["gen_tokens"],
                                     parked=p[0]["parked"], restored=p[0]["restored"],
                                     checks=[x["check"] for x in p])  # one per repeat
            if wall is None and (p[0]["room_evicted"] or p[0]["chunks"] > 1):
                wall = k + 1
        if f:
            row["full"] = dict(ttft_s=round(_med(f, "ttft_s"), 4), tok_s=round(_med(f, "tok_s"), 2),
                               cells=f[0]["cells"], gen_tokens=f[0]["gen_tokens"])
        if p and f:
            row["ttft_ratio"] = round(row["page_local"]["ttft_s"] / row["full"]["ttft_s"], 4)
            row["tok_s_ratio"] = round(row["page_local"]["tok_s"] / row["full"]["tok_s"], 4) \
                if row["full"]["tok_s"] > 0 else None
        if stock_runs is not None:
            row["stock"] = {s: stock_runs[s][k] for s in stock.SETTINGS}
        per_turn.append(row)

    best = None
    if stock_runs is not None:  # stock's best path per figure, over the whole chat (medians over its turns)
        best = {"ttft": min(stock.SETTINGS, key=lambda s: statistics.median(t["ttft_s"] for t in stock_runs[s])),
                "tok_s": max(stock.SETTINGS, key=lambda s: statistics.median(t["tok_s"] for t in stock_runs[s]))}
        for row in per_turn:
            p = row.get("page_local")
            if not p:
                continue
            st = row["stock"]
            row["ttft_vs_stock_best"] = round(st[best["ttft"]]["ttft_s"] / p["ttft_s"], 4)
            row["tok_s_vs_stock_best"] = round(p["tok_s"] / st[best["tok_s"]]["tok_s"], 4)
            row["ttft_vs_stock_default"] = round(st["on"]["ttft_s"] / p["ttft_s"], 4)
            row["tok_s_vs_stock_default"] = round(p["tok_s"] / st["on"]["tok_s"], 4)

    def ratio(key: str, past_wall: bool) -> float | None:
        xs = [t[key] for t in per_turn if t.get(key) is not None and (not past_wall or (wall and t["turn"] >= wall))]
        return round(statistics.median(xs), 4) if xs else None

    return {
        "bench": "chat", "turns": turns, "n_ctx": n_ctx, "budget": budget, "park": park, "evictor": evictor,
        "gate": gate, "ladder": list(ladder), "full_n_ctx": full_ctx,
        "outgrow": outgrow, "gen": gen,
        "repeats": repeats, "threads": threads,
        "conversation_tokens": per_turn[-1]["conversation_tokens"],
        "first_wall_turn": wall, "full_fits_turns": sum(1 for t in per_turn if "full" in t), "refusals": refusals,
        "ttft_ratio": ratio("ttft_ratio", False), "tok_s_ratio": ratio("tok_s_ratio", False),
        "ttft_ratio_past_wall": ratio("ttft_ratio", True), "tok_s_ratio_past_wall": ratio("tok_s_ratio", True),
        "per_turn": per_turn, "device": device,
        "stock_source": f"stock llama-server ({bin_dir})" if bin_dir else None,
        **({} if best is None else {
            "stock_best_ttft_flash_attn": best["ttft"], "stock_best_flash_attn": best["tok_s"],
            "ttft_vs_stock_best": ratio("ttft_vs_stock_best", False),
            "tok_s_vs_stock_best": ratio("tok_s_vs_stock_best", False),
            "ttft_vs_stock_default": ratio("ttft_vs_stock_default", False),
            "tok_s_vs_stock_default": ratio("tok_s_vs_stock_default", False),
            "ttft_vs_stock_best_past_wall": ratio("ttft_vs_stock_best", True),
            "tok_s_vs_stock_best_past_wall": ratio("tok_s_vs_stock_best", True)}),
    }

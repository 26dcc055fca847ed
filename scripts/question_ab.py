#!/usr/bin/env python3
"""One question at a long conversation's length: the chat default against the full cache, alternated (issue 54)

    python scripts/question_ab.py [--model qwen2.5-coder] [--n-ctx 20480] [--fill 0.85] [--repeats 8] [--out F]

A message of generated prose fills one full-cache engine to `fill` x n_ctx cells (read once, as a chat's first
message); its snapshot is restored into three more engines: the full cache's twin (the same settings: how much two
engines differ when nothing differs), the chat's default (park-search: past park_from the message is probed and
its keep sets prepared for the check), and the default at the full cache's n_ctx. Each then gets the same short
question, in an order that reverses every repeat, and is rewound to the document after it. Prints one JSON line
per question and, at the end, each engine's median ratio to the full cache (time to first token, decode tok/s)
over the repeats. Run it alone: bench/speed.py says why.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from page_local import defaults
from page_local.bench.chat import _check, _messages
from page_local.chat.session import ChatSession
from page_local.cli.common import resolve_model
from page_local.engine.engine import Engine

QUESTION = "What did the document above say first? Answer in one sentence."


def ask(chat: ChatSession, max_tokens: int) -> dict:
    t0, first = time.perf_counter(), None
    s = chat.send(QUESTION, max_tokens=max_tokens)
    for _ in s:
        first = first or time.perf_counter() - t0
    d, r = s.decision, s.result
    return dict(T=d.T, ttft_s=round(first, 4), prefill_ms=round(d.prefill_ms, 1), keep_sets_ms=round(d.evict_ms, 1),
                tok_s=round(r.tokens_per_s, 3), tokens=len(r.tokens), check=_check(d))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder")
    ap.add_argument("--n-ctx", type=int, default=20480)
    ap.add_argument("--fill", type=float, default=0.85)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = ap.parse_args()
    out = open(args.out, "a") if args.out else None

    def emit(**row) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    path = resolve_model(args.model)
    full = dict(gate="never", on_full="refuse", threads=args.threads)
    default = dict(budget=defaults.CHAT_BUDGET, evictor=defaults.CHAT_EVICTOR, gate=defaults.CHAT_GATE,
                   ladder=defaults.CHAT_LADDER, park=True, threads=args.threads)
    small = args.n_ctx - 160  # the full cache's context in bench chat: the chat's tokens, not n_ctx
    engines = {"full": Engine(path, n_ctx=small, **full), "full_twin": Engine(path, n_ctx=small, **full),
               "default": Engine(path, n_ctx=args.n_ctx, **default),
               "default_same_n_ctx": Engine(path, n_ctx=small, **default)}
    first = ChatSession(engines["full"])
    doc = _messages(engines["full"].model, 1, args.n_ctx, args.fill, 64, 0)[0]
    t0 = time.perf_counter()
    for _ in first.send(doc, max_tokens=16):
        pass
    emit(event="fill", cells=engines["full"].cells_used(), seconds=round(time.perf_counter() - t0, 1),
         attention=engines["default"].attention.why)
    snap = engines["full"].snapshot()
    chats = {}
    for name, e in engines.items():
        c = first if name == "full" else ChatSession(e)
        if c is not first:
            e.restore(snap)
            c.messages, c._text = list(first.messages), first._text
        chats[name] = (c, len(e.history), list(c.messages), c._text)
    names, rows = list(engines), []
    for rep in range(args.repeats):
        per = {}
        for name in (names if rep % 2 == 0 else names[::-1]):
            c, n, messages, text = chats[name]
            per[name] = ask(c, args.max_tokens)
            emit(event="question", repeat=rep, engine=name, **per[name])
            c.engine.rewind(n)
            c.messages, c._text = list(messages), text
        rows.append(per)
    for name in names[1:]:
        emit(event="ratio", engine=name, to="full", repeats=len(rows),
             ttft=round(statistics.median(r[name]["ttft_s"] / r["full"]["ttft_s"] for r in rows), 3),
             tok_s=round(statistics.median(r[name]["tok_s"] / r["full"]["tok_s"] for r in rows), 3))


if __name__ == "__main__":
    main()

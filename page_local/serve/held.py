"""What the cache holds, told in the conversation's own terms: the engine says which tokens of the
conversation are held (Engine.cache_map, by history index); this module maps those tokens to the
messages and characters a client sent, so that a page can mark them in the text it shows.

The prompt is the chat template rendered over the messages (Backend.render) and tokenized; each
token's piece (control tokens as their text) is found, in order, in the rendered text, which gives
each token a character span; each message's content is found, in order, in the rendered text, which
places the token spans inside messages. The answer's tokens are placed the same way in the answer's
text as it was sent (a stop string may have cut it). Offsets are Unicode code points (Python's str
indices; a page in JavaScript indexes `Array.from(text)`). The template's own text (turn headers)
belongs to no message: its tokens count in `held` and `evicted` but in no span.

Pure functions of lists: testable without a model.
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

# parked: set aside (engine/parking.py: in memory, out of the attention, back for the next message); speed, room:
# deleted by the gate's budget or to make room; evicted: deleted, why is not known (a restored conversation)
STATES = ("held", "parked", "speed", "room", "evicted")


def token_spans(pieces: list[bytes], text: str) -> tuple[list[tuple[int, int]], bool]:
    """The character span [start, end) of each token in `text`, and whether the pieces cover the text
    exactly. A piece not found at the cursor (a BOS the tokenizer added, which the text does not show)
    is empty at the cursor; a piece whose leading space the text lacks (SentencePiece's first word) is
    matched without it."""
    raw = text.encode("utf-8")
    starts = [i for i, b in enumerate(raw) if b & 0xC0 != 0x80]  # the byte offset where each character begins
    spans, cur = [], 0
    for p in pieces:
        a = cur
        if p and raw.startswith(p, cur):
            cur += len(p)
        elif len(p) > 1 and p[:1] == b" " and raw.startswith(p[1:], cur):
            cur += len(p) - 1
        # a character whose bytes two tokens share belongs to the token holding its first byte
        spans.append((bisect_left(starts, a), bisect_left(starts, cur)))
    return spans, cur == len(raw)


def message_ranges(text: str, contents: list[str]) -> list[tuple[int, int] | None]:
    """Where each message's content lies in the rendered text, found in order (None: the template changed
    it, e.g. stripped it; then its characters are not marked)."""
    out, cur = [], 0
    for c in contents:
        i = text.find(c, cur) if c else -1
        if i < 0:
            out.append(None)
            continue
        out.append((i, i + len(c)))
        cur = i + len(c)
    return out


def runs(mask: np.ndarray) -> list[list[int]]:
    """[[from, to), ...] of the True runs of a bool (n,) array."""
    m = np.concatenate(([False], np.asarray(mask, dtype=bool), [False]))
    edges = np.flatnonzero(m[1:] != m[:-1])
    return [[int(a), int(b)] for a, b in zip(edges[::2], edges[1::2])]


def states(held: np.ndarray, room: np.ndarray | None, parked: np.ndarray | None = None) -> list[str]:
    """Each token's state: held, parked, or why it went (speed: the gate's budget; room: making room)."""
    if room is None:
        out = ["held" if h else "evicted" for h in held.tolist()]
    else:
        out = ["held" if h else ("room" if r else "speed") for h, r in zip(held.tolist(), room.tolist())]
    if parked is not None:
        out = ["parked" if p and s != "held" else s for s, p in zip(out, parked.tolist())]
    return out


def _spans_in(spans: list[tuple[int, int]], token_states: list[str], ranges: list[tuple[int, int] | None],
              first_message: int) -> list[dict]:
    """Marked character runs of the messages: each token's span clipped to the message that holds it, runs of
    the same state merged. ranges[k]: message first_message + k's place in the text the spans index."""
    out: list[dict] = []
    placed = [(k, r) for k, r in enumerate(ranges) if r is not None]
    j = 0
    for (a, b), st in zip(spans, token_states):
        if a == b:
            continue
        while j < len(placed) and placed[j][1][1] <= a:
            j += 1
        k = j
        while k < len(placed) and placed[k][1][0] < b:  # a token may end one message and begin the next
            m, (ms, me) = placed[k]
            lo, hi = max(a, ms) - ms, min(b, me) - ms
            if hi > lo:
                msg = first_message + m
                last = out[-1] if out else None
                if last and last["message"] == msg and last["state"] == st and last["end"] == lo:
                    last["end"] = hi
                else:
                    out.append({"message": msg, "start": lo, "end": hi, "state": st})
            k += 1
    return out


def cache_map(held: np.ndarray, room: np.ndarray | None, prompt_pieces: list[bytes], prompt_text: str,
              contents: list[str] | None, answer_pieces: list[bytes], answer_text: str, n_ctx: int,
              parked: np.ndarray | None = None) -> dict:
    """The response's `cache_map`: held (bool (T,)), room (bool (T,) | None) and parked (bool (T,) | None) over
    the conversation's tokens, the prompt's first len(prompt_pieces), then the answer's len(answer_pieces); the
    rendered prompt and the messages' contents (None: a text completion, whose prompt is message 0); the
    answer's text as sent. Message len(contents) is the answer."""
    n_prompt = len(prompt_pieces)
    if len(held) != n_prompt + len(answer_pieces):
        raise ValueError(f"the cache map covers {len(held)} tokens, the conversation has "
                         f"{n_prompt} + {len(answer_pieces)}")
    st = states(held, room, parked)
    p_spans, aligned = token_spans(prompt_pieces, prompt_text)
    if contents is None:  # a text completion: the prompt is one message
        contents, ranges = [prompt_text], [(0, len(prompt_text))]
    else:
        ranges = message_ranges(prompt_text, contents)
    spans = _spans_in(p_spans, st[:n_prompt], ranges, 0) if aligned else []
    a_spans, _ = token_spans(answer_pieces, answer_text)
    spans += _spans_in(a_spans, st[n_prompt:], [(0, len(answer_text))], len(contents))
    evicted = []
    for kind in ("speed", "room", "evicted"):
        evicted += [{"from": a, "to": b, "why": kind} for a, b in runs(np.array([s == kind for s in st]))]
    evicted.sort(key=lambda e: e["from"])
    is_parked = np.array([s == "parked" for s in st], dtype=bool)
    return {"n_ctx": int(n_ctx), "cells": int(np.count_nonzero(held)), "tokens": int(len(held)),
            "parked_cells": int(is_parked.sum()), "parked": runs(is_parked),
            "prompt_tokens": n_prompt, "held": runs(held), "evicted": evicted, "aligned": aligned,
            "placed": [r is not None for r in ranges], "spans": spans}

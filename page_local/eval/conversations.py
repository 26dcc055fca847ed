"""Multi-turn evaluation: conversations over long documents that outgrow the context (issue 17, item 4).

A conversation (build_conversation) has T turns (2-8). A document is pasted on every even turn: generated
prose (tasks.synthetic's "prose" builder) holding NEEDLES_PER_DOC needles, "One of the special magic
numbers for {key} is: {value}." (synthetic.NEEDLE), at spread depths. Every turn asks about a different
needle: turn 2k about the document it pastes, turn 2k+1 about document k // 2, which was read one or
three turns earlier, with other documents in between. The documents share FILL x length x n_ctx tokens
of the whole conversation (answers included), so that at 1x it fits the context with its last answer
and at 2x and 4x it outgrows it (at 4x with n_ctx 1024 each document is longer than the context).

One turn (turns=1) is the long-document family: a single message, a document of length x n_ctx holding
NEEDLES_PER_DOC needles (at 5-30 %, 35-65 % and 70-95 % of its depth) and the question about one of them at
its end, as `/read doc.txt QUESTION` sends it.

Policies (POLICIES; COMPARE_POLICIES on request), on the same conversations, model and greedy answers
of at most max_tokens:
* full      the full cache: one context large enough for the longest conversation, nothing evicted
* verify    page-local as a user gets it: the speed budget (a share of the conversation), SnapKV, the
            verify gate, and room on demand at the wall (engine/room.py)
* page      the same with the PAGE gate (the raw rule, or the model's calibrated profile if stored)
* park      verify's budget, evictor and gate, but the speed budget parks cells instead of evicting them
            (engine/parking.py): each message is read over the whole conversation and chooses again; from
            the first turn (park_from 0), so that every turn's choice is tested, not only the long ones
* park-search  (comparison) park's, with budget search (gate search) over defaults.CHAT_LADDER: the smallest
            share whose check passes is kept, the rest parked
* always, park-always  (comparisons) the speed budget applied on every turn without a check (gate always),
            evicting for good or parking: which later-turn questions each loses when eviction does happen
            (under verify, a check that never passes evicts nothing and both equal the full cache)
* room      room on demand alone (gate never: the speed budget never evicts), its evictions ranked by
            the message's own question (engine/room.py, the default)
* room-recent  the same, ranked as before issue 28: by the conversation's newest queries (for a
            document read in parts, the previous part's own text)
* refuse    llama-server's answer to a prompt over the context: 400 (on_full "refuse": the turn is
            refused and scored wrong)
* shift     llama.cpp's context shift (examples/main, `--keep`): when the next message and its answer
            do not fit, keep the first n_keep tokens (the system prompt and the first turn's header,
            the same tokens page-local protects), drop the oldest half of the rest, repeat until it
            fits; a message that still does not fit keeps its tail (llama-server's old prompt
            truncation keeps n_keep and the end of the prompt). Done over the public Engine API
            (on_full="refuse", gate never): Engine.rewind(n_keep), then Engine.prefill of the kept
            tokens. llama.cpp instead re-rotates the kept cells (llama_memory_seq_add); the kept
            tokens are the same, their cells here are recomputed without the dropped ones, and the
            re-prefill is counted in the turn's time to first token (an upper bound of llama.cpp's).
* truncate  Ollama's chatPrompt (server/prompt.go): re-render the conversation without its oldest
            messages until it fits (the latest message always kept), reuse the longest common prefix
            of the cache (Engine.rewind) and prefill the rest; a latest message that alone does not
            fit keeps its first 4 tokens and its tail (Ollama's runner, num_keep 4). Both fit to
            n_ctx - max_tokens - 1, so that the answer never needs a shift.

Rows (one per turn, JSONL as eval/rows.py reads them) are written when a (conversation, length,
policy) finishes; a re-run skips what is there. The report (report_markdown, plot_by_turn) reads them.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from page_local import defaults
from page_local.chat.session import ChatSession
from page_local.chat.template import ChatTemplate
from page_local.engine.engine import Engine
from page_local.errors import ContextFull
from page_local.eval.rows import made_where, read_rows
from page_local.tasks import synthetic
from page_local.tasks.scoring import normalize_prediction, string_match_all

POLICIES = ("full", "verify", "page", "park", "room", "shift", "truncate")
# for comparisons only (not in a default run): room ranked as before issue 28, and llama-server's 400
COMPARE_POLICIES = ("room-recent", "refuse", "always", "park-always", "park-search")
ALL_POLICIES = POLICIES + COMPARE_POLICIES
DEFAULT_POLICIES = ("full", "verify", "page", "shift", "truncate")
NEEDLES_PER_DOC = 3
FILL = 0.9  # the conversation's planned tokens, as a fraction of length x n_ctx
OLLAMA_NUM_KEEP = 4
KEY_FIELDS = ("model", "conversation", "length", "turn", "turns", "n_ctx", "policy", "budget", "evictor", "max_tokens",
              "seed", "summaries", "verify_tokens")
INTRO = "Read this document. I will ask you about the special magic numbers in it.\n\n"
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
# summaries: a turn that pastes a document asks for its summary instead of a number (a long answer, whose tokens
# after the check come from the parked cache under parking; SmolLM2 answered only the number when asked for both);
# the later turns' questions stay short, and they are what such a run measures
SUMMARY = "Summarise the document above in a few sentences."
ANSWER = "The special magic number for {key} mentioned in the provided text is {value}."  # for sizing only


# --- conversations ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fact:
    key: str
    value: str
    doc: int  # the document that holds it
    depth: float  # where in the document: sentence index / sentences


@dataclass(frozen=True)
class Turn:
    user: str
    fact: Fact  # what this turn asks
    doc: int | None  # the document this turn pastes, if any


@dataclass(frozen=True)
class Conversation:
    index: int
    length: float  # the planned size in units of n_ctx
    turns: tuple[Turn, ...]
    planned_tokens: int  # the rendered conversation with ideal answers


def asked_doc(turn: int) -> int:
    """The document turn `turn` asks about: the one it pastes (even turns), else document (turn // 2) // 2."""
    return turn // 2 if turn % 2 == 0 else (turn // 2) // 2


def _rng(seed: int, *parts) -> random.Random:
    digest = hashlib.sha256("|".join(map(str, ("conversations", seed) + parts)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _prose(n_tokens: int, index: int, count_tokens, seed: int) -> list[str]:
    """Sentences of generated prose of about n_tokens tokens (synthetic's "prose" task, its instruction cut)."""
    s = synthetic.generate("prose", 1, max(32, n_tokens) + 16, count_tokens, seed=seed, max_new_tokens=1,
                           start=index)[0]
    body = s.context[len(synthetic.PROSE_INSTRUCTION):].strip()
    return [x for x in re.split(r"(?<=\.)\s+", body) if x]


def _document(sentences: list[str], needles: list[str], depths: list[float]) -> tuple[str, list[float]]:
    """The sentences with each needle inserted at its depth, in paragraphs of 6; the depths as placed."""
    slots = sorted(zip(depths, needles))
    out, placed, j = [], [], 0
    for i, sent in enumerate(sentences + [None]):
        while j < len(slots) and slots[j][0] * len(sentences) <= i:
            placed.append((slots[j][1], i / max(1, len(sentences))))
            out.append(slots[j][1])
            j += 1
        if sent is not None:
            out.append(sent)
    where = dict(placed)
    text = "\n\n".join(" ".join(out[i:i + 6]) for i in range(0, len(out), 6))
    return text, [where[n] for n in needles]


def build_conversation(index: int, turns: int, length: float, n_ctx: int, count_tokens: Callable[[str], int],
                       measure: Callable[[list[dict]], int], seed: int = 42, summaries: bool = False) -> Conversation:
    """Conversation `index` (a pure function of the arguments). count_tokens: text -> tokens (sizes the
    prose); measure: messages -> tokens of the rendered chat (sizes the whole conversation, with the short
    answers: summaries add their own length). summaries: a pasted document's turn asks for its summary (its
    fact is then asked by no one: that turn's row scores the summary against it)."""
    if not 1 <= turns <= 8:
        raise ValueError(f"turns must be in [1, 8], got {turns!r}")
    if not length > 0:
        raise ValueError(f"length must be > 0 (a multiple of n_ctx), got {length!r}")
    rng = _rng(seed, index)
    n_docs = (turns + 1) // 2
    keys = _keys(rng, n_docs * NEEDLES_PER_DOC)
    depths = [sorted([rng.uniform(0.05, 0.3), rng.uniform(0.35, 0.65), rng.uniform(0.7, 0.95)])
              for _ in range(n_docs)]
    order = [rng.sample(range(NEEDLES_PER_DOC), NEEDLES_PER_DOC) for _ in range(n_docs)]

    def make(prose_tokens: int) -> tuple[list[Turn], int]:
        facts, texts = [], []
        for d in range(n_docs):
            kv = keys[d * NEEDLES_PER_DOC:(d + 1) * NEEDLES_PER_DOC]
            needles = [synthetic.NEEDLE.format(type_v="numbers", key=k, value=v) for k, v in kv]
            sents = _prose(prose_tokens, index * 8 + d, count_tokens, seed) if prose_tokens > 0 else []
            text, placed = _document(sents, needles, depths[d])
            texts.append(text)
            facts.append([Fact(k, v, d, round(p, 3)) for (k, v), p in zip(kv, placed)])
        used = [0] * n_docs
        out, msgs = [], []
        for t in range(turns):
            d = asked_doc(t)
            fact = facts[d][order[d][used[d]]]
            used[d] += 1
            q = QUESTION.format(key=fact.key)
            pasted = t // 2 if t % 2 == 0 else None
            if pasted is not None:
                user = INTRO + texts[pasted] + "\n\n" + (SUMMARY if summaries else q)
            else:
                user = q
            out.append(Turn(user, fact, pasted))
            msgs += [{"role": "user", "content": user},
                     {"role": "assistant", "content": ANSWER.format(key=fact.key, value=fact.value)}]
        return out, measure(msgs)

    target = FILL * length * n_ctx
    _, overhead = make(0)  # the needles, questions, answers and chat markup
    prose = int(max(0, target - overhead) / n_docs)
    convo, planned = make(prose)
    return Conversation(index, float(length), tuple(convo), planned)


def _keys(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """n distinct (word key, 7-digit value) pairs, as synthetic's niah tasks draw them."""
    keys: dict[str, str] = {}
    while len(keys) < n:
        k = f"{rng.choice(synthetic.ADJECTIVES)}-{rng.choice(synthetic.NOUNS)}"
        if k not in keys:
            keys[k] = str(rng.randint(10**6, 10**7 - 1))
    return list(keys.items())


# --- policies -----------------------------------------------------------------------------------

@dataclass
class TurnOut:
    answer: str
    finish: str
    gen_tokens: int
    decode_tok_s: float
    ttft_s: float  # from the message to the first piece of the answer (making room included)
    turn_s: float
    prefilled: int  # tokens decoded before the answer (re-prefills included)
    wall: bool  # the policy dropped something to fit this turn
    detail: dict


def _answer(stream, t0: float) -> tuple[str, float]:
    pieces, first = [], None
    for piece in stream:
        if first is None:
            first = time.perf_counter() - t0
        pieces.append(piece)
    return "".join(pieces), first if first is not None else time.perf_counter() - t0


class _Session:
    """full, verify, page, park, room: page-local's own ChatSession on an engine set for the policy."""

    def __init__(self, engine: Engine):
        self.session = ChatSession(engine)

    @property
    def messages(self) -> list[dict]:
        return [m.__dict__ for m in self.session.messages]

    def turn(self, user: str, max_tokens: int) -> TurnOut:
        t0 = time.perf_counter()
        s = self.session.send(user, max_tokens=max_tokens)
        answer, ttft = _answer(s, t0)
        d, r = s.decision, s.result
        detail = dict(T=d.T, B=d.B, speed_evicted=d.evicted, kept=d.kept, room_evicted=d.room_evicted,
                      chunks=d.chunks, prompt_tokens=r.prompt_tokens, prompt_held=d.prompt_held,
                      gaps_closed=d.gaps_closed, rule=d.rule, D=d.D, verify_m=d.verify_m, parked=d.parked,
                      restored=d.restored, park_dropped=d.park_dropped)
        return TurnOut(answer, r.finish_reason, len(r.tokens), r.tokens_per_s, ttft, time.perf_counter() - t0,
                       r.prompt_tokens, bool(d.room_evicted or d.chunks > 1 or d.park_dropped), detail)


class _Rendered:
    """The conversation rendered with the model's template, for the policies page-local does not run."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.template = ChatTemplate(engine.model, fallback="the conversations need a chat model")
        self.messages: list[dict] = []
        engine.reset()

    def tokens(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        return self.engine.model.tokenize(self.template.render(messages, generation_prompt), add_special=True)


class _Shift(_Rendered):
    """llama.cpp's context shift (see the module docstring)."""

    def __init__(self, engine: Engine, n_keep: int):
        super().__init__(engine)
        self.n_keep, self.text = n_keep, ""

    def turn(self, user: str, max_tokens: int) -> TurnOut:
        eng, n_ctx = self.engine, self.engine.n_ctx
        t0 = time.perf_counter()
        rendered = self.template.render(self.messages + [{"role": "user", "content": user}], True)
        common = os.path.commonprefix([rendered, self.text])  # as ChatSession appends only the new text
        toks = eng.model.tokenize(rendered[len(common):], add_special=not eng.history)
        need = len(toks) + max_tokens + 1
        shifts = dropped = reprefill = cut = 0
        while eng.cells_used() + need > n_ctx and eng.cells_used() > self.n_keep:
            n_discard = max(1, (eng.cells_used() - self.n_keep) // 2)
            rest = eng.history[self.n_keep + n_discard:]
            eng.rewind(self.n_keep)
            if rest:
                eng.prefill(rest)
            shifts, dropped, reprefill = shifts + 1, dropped + n_discard, reprefill + len(rest)
        if eng.cells_used() + need > n_ctx:  # the message alone does not fit: its tail is kept
            room = n_ctx - eng.cells_used() - max_tokens - 1
            cut, toks = len(toks) - room, toks[len(toks) - room:]
        s = eng.stream(toks, max_tokens=max_tokens, add_special=False)
        answer, ttft = _answer(s, t0)
        r = s.result
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        self.text = rendered + answer
        return TurnOut(answer, r.finish_reason, len(r.tokens), r.tokens_per_s, ttft, time.perf_counter() - t0,
                       len(toks) + reprefill, bool(shifts or cut),
                       dict(shifts=shifts, shift_dropped=dropped, reprefill=reprefill, message_cut=cut))


class _Truncate(_Rendered):
    """Ollama's truncation of the oldest messages (see the module docstring)."""

    def turn(self, user: str, max_tokens: int) -> TurnOut:
        eng = self.engine
        t0 = time.perf_counter()
        msgs = self.messages + [{"role": "user", "content": user}]
        limit = eng.n_ctx - max_tokens - 1
        start = len(msgs) - 1
        for i in range(len(msgs) - 2, -1, -1):  # the longest suffix of messages that fits
            if len(self.tokens(msgs[i:], True)) > limit:
                break
            start = i
        toks = self.tokens(msgs[start:], True)
        cut = max(0, len(toks) - limit)
        if cut:
            toks = toks[:OLLAMA_NUM_KEEP] + toks[len(toks) - (limit - OLLAMA_NUM_KEEP):]
        hist = eng.history
        common = 0
        while common < min(len(hist), len(toks) - 1) and hist[common] == toks[common]:
            common += 1
        eng.rewind(common)
        s = eng.stream(toks[common:], max_tokens=max_tokens, add_special=False)
        answer, ttft = _answer(s, t0)
        r = s.result
        self.messages = msgs + [{"role": "assistant", "content": answer}]
        return TurnOut(answer, r.finish_reason, len(r.tokens), r.tokens_per_s, ttft, time.perf_counter() - t0,
                       len(toks) - common, bool(start or cut),
                       dict(messages_dropped=start, reused=common, message_cut=cut))


# --- the run ------------------------------------------------------------------------------------

class Sizer:
    """A model's token counts: of a text (count), and of a rendered chat (measure)."""

    def __init__(self, model):
        self.model = model
        self.template = ChatTemplate(model, fallback="the conversations need a chat model")

    def count(self, text: str) -> int:
        return len(self.model.tokenize(text, add_special=False))

    def measure(self, messages: list[dict]) -> int:
        return len(self.model.tokenize(self.template.render(messages, False), add_special=True))


def set_policy(eng: Engine, policy: str) -> Engine:
    """Set an engine for a policy: its gate and what it does at the wall (the rest is the runner's)."""
    eng.set_gate({"verify": "verify", "page": "page", "park": "verify", "always": "always",
                  "park-always": "always", "park-search": "search"}.get(policy, "never"))
    eng.set_ladder(defaults.CHAT_LADDER if policy == "park-search" else defaults.LADDER)
    eng.set_park(policy in ("park", "park-always", "park-search"), 0)
    eng.on_full = "evict" if policy in ("verify", "page", "park", "room", "room-recent", "always",
                                        "park-always", "park-search") else "refuse"
    eng.set_room_ranking("recent" if policy == "room-recent" else "question")
    return eng


def run_one(conv: Conversation, policy: str, eng: Engine, max_tokens: int, sizer: Sizer) -> list[dict]:
    """One conversation under one policy on `eng` (set_policy first): a row per turn (without the
    run's key fields). A refused message ends the conversation: its turn and the later ones say so."""
    if policy in ("shift", "truncate"):
        n_keep = ChatSession(eng).engine.n_keep  # the tokens page-local protects: the same for the shift
        runner = _Shift(eng, n_keep) if policy == "shift" else _Truncate(eng)
    else:
        runner = _Session(eng)
    rows, refused = [], None
    for t, turn in enumerate(conv.turns):
        row = dict(kind="conversation", conversation=conv.index, length=conv.length, turn=t, policy=policy,
                   cache_n_ctx=eng.n_ctx, planned_tokens=conv.planned_tokens, doc_read=turn.doc,
                   asked_doc=turn.fact.doc, age=t - 2 * turn.fact.doc, depth=turn.fact.depth,
                   key=turn.fact.key, expected=turn.fact.value)
        rows.append(row)
        if refused is None:
            try:
                o = runner.turn(turn.user, max_tokens)
            except ContextFull as e:
                refused = str(e)
        if refused is not None:
            row.update(answer="", correct=False, finish="refused", error=refused, wall=True, cells=eng.cells_used())
            continue
        row.update(answer=o.answer, correct=string_match_all(normalize_prediction(o.answer), [turn.fact.value]) == 1.0,
                   finish=o.finish, gen_tokens=o.gen_tokens, decode_tok_s=round(o.decode_tok_s, 2),
                   ttft_s=round(o.ttft_s, 4), turn_s=round(o.turn_s, 4), prefilled=o.prefilled, wall=o.wall,
                   cells=eng.cells_used(), conv_tokens=sizer.measure(runner.messages), detail=o.detail)
    return rows


def _key(row: dict) -> tuple:
    return tuple(json.dumps(row.get(k)) for k in KEY_FIELDS)


def run_conversations(model_path, n: int = 6, turns: int = 6, lengths: Sequence[float] = (1, 2, 4),
                      n_ctx: int = 1024, policies: Sequence[str] = DEFAULT_POLICIES, budget: float | int = 0.25,
                      evictor: str = defaults.EVICTOR, max_tokens: int = 32, seed: int = 42, threads: int = 2,
                      out: str | os.PathLike | None = None,
                      progress: Callable[[int, int], None] | None = None, n_gpu_layers=None,
                      allow_long_context: bool = False, rpc=None, attention_settings=None,
                      summaries: bool = False, verify_tokens: int | None = None) -> dict:
    """Every conversation at every length under every policy, side by side (one conversation's
    policies run one after the other); rows appended to `out`, a re-run resumes. The full cache's
    context holds the longest conversation: max(lengths) x n_ctx and the answers. n_gpu_layers, rpc,
    attention_settings, allow_long_context: as Engine's. verify_tokens: the check's span (None: the engine's,
    64); a shorter one lets more long answers pass and go on over a parked cache."""
    from page_local.store.gguf import gguf_metadata, model_identity

    bad = [p for p in policies if p not in ALL_POLICIES]
    if bad or not policies:
        raise ValueError(f"unknown policies {bad or '(none)'}; choose from {', '.join(ALL_POLICIES)}")
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 128:
        raise ValueError(f"n_ctx must be an int >= 128, got {n_ctx!r}")
    if not lengths or any(not L > 0 for L in lengths):
        raise ValueError(f"lengths must be multiples of n_ctx above 0, got {list(lengths)!r}")
    out = Path(out) if out is not None else Path(f"results/conversations-{Path(model_path).stem}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    base = dict(model=model_identity(model_path), model_name=gguf_metadata(model_path).get("general.name"),
                turns=turns, n_ctx=n_ctx, budget=budget, max_tokens=max_tokens, seed=seed)
    made = made_where()
    if evictor != defaults.EVICTOR:  # rows of the default evictor carry no field (as before it could be chosen)
        base["evictor"] = evictor
    if summaries:  # likewise: rows of short-answer chats carry no field
        base["summaries"] = True
    if verify_tokens is not None:  # likewise: rows checked over the engine's default span carry no field
        base["verify_tokens"] = verify_tokens
    present = {_key(r) for r in read_rows(out, repair=True)}
    todo = [(c, float(L), p) for c in range(n) for L in lengths for p in policies
            if any(_key(dict(base, conversation=c, length=float(L), turn=t, policy=p)) not in present
                   for t in range(turns))]
    total = n * len(lengths) * len(policies) * turns
    done = total - len(todo) * turns
    res = dict(out=str(out), rows_present=len(present), rows_written=0, units=len(todo), wall_s=0.0)
    if not todo:
        return res
    full_ctx = int(max(lengths) * n_ctx + 2 * turns * max_tokens + 256)
    engines: dict[str, Engine] = {}
    convs: dict[tuple, Conversation] = {}
    t0 = time.perf_counter()
    try:
        with open(out, "a", encoding="utf-8") as f:
            for c, L, policy in todo:
                kind = "full" if policy == "full" else "small"
                if kind not in engines:
                    engines[kind] = Engine(model_path, n_ctx=full_ctx if kind == "full" else n_ctx, budget=budget,
                                           evictor=evictor, **({} if verify_tokens is None
                                                               else {"verify_tokens": verify_tokens}),
                                           threads=threads, n_gpu_layers=n_gpu_layers, rpc=rpc,
                                           attention_settings=attention_settings,
                                           allow_long_context=allow_long_context)
                eng = set_policy(engines[kind], policy)
                sizer = Sizer(eng.model)
                if (c, L) not in convs:
                    convs[(c, L)] = build_conversation(c, turns, L, n_ctx, sizer.count, sizer.measure, seed,
                                                       summaries)
                rows = run_one(convs[(c, L)], policy, eng, max_tokens, sizer)
                for row in rows:
                    f.write(json.dumps({**base, **row, **made}) + "\n")
                f.flush()
                res["rows_written"] += len(rows)
                done += turns
                if progress:
                    progress(done, total)
    finally:
        for e in engines.values():
            e.close()
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    res["per_unit_s"] = round(res["wall_s"] / len(todo), 2)
    return res

"""Long documents, read once per document and asked several questions (issue 43, item 1).

A document (build_document) is generated prose (tasks.synthetic's essay sentences, as eval/conversations.py's
long-document family reads them) holding FACTS facts, one in each quarter of its depth, each of its own
kind (KINDS, in a drawn order): "The door code for the {name} office is {code}.", "The vault combination
for the {name} archive is {code}."... (4-digit codes). Each fact is a question, "What is the door code for
the {name} office?", sent as one chat message after the document, as `/read doc.txt QUESTION` sends it.
The kinds differ so that a question is about keeping its fact, not about telling four facts of one
form apart (SmolLM2 answered a neighbour's code in a pilot where all four were door codes). The rendered
prompt is `length` x n_ctx tokens (2x and 4x: longer than the context).

What does not depend on the question is read once per (document, policy): every policy's prompt is a
shared reading followed by a per-question suffix (Reading); the shared part is prefilled, saved with
Engine.snapshot(), and restored for each question, which then prefills only its suffix and answers.

Policies (POLICIES), greedy answers of at most max_tokens, on the same documents:
* full         the full cache: an engine whose context holds the whole prompt and its answer; shared: the
               prompt up to where the questions differ (the document).
* room         room on demand, ranked by the question (engine/room.py: on_full "evict",
               gate never); shared: the first part room-making reads before it evicts anything (its
               size as RoomMaker.fit chooses it: half of the context less the answer's room), then the
               rest of the message goes through room-making, ranked by the message's last W tokens, each
               cell by SnapKV's score pooled over 15 neighbours (ROOM_POOLED: room.ROOM_EVICTOR as it was
               when this evaluation began; the rows keep that meaning whatever the default becomes).
* room-spans   the same reading, ranked by the question, with cells kept a sentence at a time (snapkv-spans,
               evictors/spans.py: a sentence's score is the sum of its cells'; room's default since issue 43).
* room-best    room-spans, each cell ranked by the larger of its score now and the best one an earlier cut of the
               message gave it (snapkv-spans prior "max": room's default since; room-spans is pinned to prior
               "none", the ranking its rows were made with, as room-reread and room-both are).
* room-bm25    room-best's reading and cells, its sentences ranked by the question's words: BM25 over the
               conversation's sentences with the question's terms (room ranking "bm25", engine/room.py; issue 57),
               the attention ordering only what no question word reaches.
* room-hybrid  the same, each sentence ranked by a share of each: (1 - room.LEXICAL_SHARE) x its attention +
               LEXICAL_SHARE x its BM25, each normalised by its largest (room ranking "hybrid").
* room-hybrid-reread  room-hybrid, and a message after the cut reads the conversation again (as room-reread): the
               second question ranks what is held and what went by its own attention and words.
* room-hybrid-words  room-hybrid, and a message after the cut reads the conversation again only when the sentence
               its question's words meet best (BM25) went with the cut (Engine reread "words"): room-hybrid's cost
               where the asked sentence is held, room-hybrid-reread's answer where it went.
* room-reread  room-spans, and a message after the cut reads the conversation again from the first token room
               made it delete (Engine reread): the same as room-spans on a first question; a second question
               ranks the document again by itself, at the cost of that reading.
* room-both    the same reading, kept a sentence at a time, the kept cells shared between the question and a
               generic query (room ranking "question+generic": GENERIC_SHARE of them ranked by KVzip's
               "Repeat the previous context exactly."), for a second question about another fact (measured at
               2x n_ctx 1024: it does not keep an earlier fact, docs/design.md §5.1).
* room-recent  the same, ranked by the newest queries (the ranking before issue 28), to compare.
* shift        llama.cpp's context shift (llama-server's prompt truncation with --context-shift): keep the
               first n_keep tokens (the system prompt and the turn's header, at least N_SINK) and discard
               whole blocks of half the rest (n_left / 2) after them until the prompt fits: the newest
               cells are kept. llama.cpp would keep those cells as computed while reading; here they are
               recomputed without the discarded ones (the kept tokens are the same).
* truncate     Ollama's runner (num_keep 4): the first 4 tokens and the tail that fits.
* server       llama-server without context shift: 400 for a prompt over the context. A row per question
               with accuracy 0 by definition; nothing is run.
shift and truncate fit to n_ctx - max_tokens - 1 (the answer never needs a shift). Both cut the
document where its LONGEST question needs it, so that every question of a document shares one reading:
for a shorter question Ollama would keep a few more tokens of the document (as many as the questions
differ in length), llama-server rarely one block more.

Real prose (haystack="prose", `--haystack prose`; issue 57): the same facts and questions in a passage of a real
text (eval/longdoc_prose.py: Debian's licences, the Python tutorial and HOWTOs of python3-doc, GNU manuals), half of
each document's questions paraphrased; its rows carry haystack, source, paraphrased and question_text (write them to
their own file). A missing text is refused before any model is loaded, naming the package that ships it.

The second-question mode (second=True, `--second`; issue 43, item 3): after each question's answer, the next
turn asks about another fact of the document, two quarters away (q + SECOND, mod FACTS: half of the second
questions are about a fact before the first one's, half after), in the same conversation, as a
chat client sends it (the template's rendering of both turns, less what the cache already holds). Its
rows carry turns=2 and second, second_expected, second_answer, second_correct, second_ttft_s,
second_fact_held (and second_reread, the tokens read again, under room-reread); write them to their own file.

Rows (JSONL, one per (document, question, policy), written as each finishes; a rerun with the same out
skips the rows there): KEY_FIELDS, machine and library (the CPU and the build that made the row: rows of
different ones differ by rounding, not only by policy), depth, expected, answer, correct, ttft_s (the shared reading's time
plus the question's own time to its first answer token: what one question alone waits), decode_tok_s,
shared_s (the reading, once per document), own_s (the question: restore, suffix, answer) and cost_s =
shared_s / questions of the document + own_s, the cost of a question; fact_held, the share of the asked fact's
sentence the cache holds after the answer (what the policy kept, apart from whether the model answered with it). The report: longdoc_report.py.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from page_local.chat.session import ChatSession
from page_local.chat.template import ChatTemplate
from page_local.engine.engine import Engine
from page_local.engine.room import ROOM_POOLED, answer_room, part_size
from page_local.engine.turn import N_SINK
from page_local.errors import ContextFull
# the documents (longdoc_docs.py), named here too: the run's rows and its tests speak of them as longdoc's
from page_local.eval.longdoc_docs import (DEPTHS, FACT, FACTS, INTRO, KINDS, QUESTION, Document, Fact,  # noqa: F401
                                          build_document)
from page_local.eval.longdoc_prose import build_prose_document, text_kind
from page_local.eval.rows import made_where, read_rows
from page_local.tasks.scoring import normalize_prediction, string_match_all

# the room policies that read the question's words too (issue 57): room-best's cells, its spans ranked by BM25 over
# the question's terms (room-bm25) or by a share of each (room-hybrid); room-hybrid-reread reads again (room-reread),
# room-hybrid-words when the words point to what went
WORDS = ("room-bm25", "room-hybrid", "room-hybrid-reread", "room-hybrid-words")
POLICIES = ("full", "room", "room-spans", "room-best") + WORDS + ("room-reread", "room-both", "room-recent", "shift",
                                                                  "truncate", "server")
# the policies that run (server: a 400, no run)
RUN = tuple(p for p in POLICIES if p != "server")
# the policies that make room at the wall
ROOM = ("room", "room-spans", "room-best") + WORDS + ("room-reread", "room-both", "room-recent")
# each room policy's evictor: "room" and "room-recent" are pinned to the pooled ranking their rows were made with
ROOM_EVICTORS = {"room": ROOM_POOLED, "room-recent": ROOM_POOLED, "room-spans": ("snapkv-spans", {"prior": "none"}),
                 "room-best": ("snapkv-spans", {"prior": "max"}), "room-reread": ("snapkv-spans", {"prior": "none"}),
                 "room-both": ("snapkv-spans", {"prior": "none"}),
                 **{p: ("snapkv-spans", {"prior": "max"}) for p in WORDS}}
ROOM_RANKING = {"room-recent": "recent", "room-both": "question+generic", "room-bm25": "bm25", "room-hybrid": "hybrid",
                "room-hybrid-reread": "hybrid", "room-hybrid-words": "hybrid"}  # else "question"
REREAD = {"room-reread": "always", "room-hybrid-reread": "always", "room-hybrid-words": "words"}  # else "never"
HAYSTACKS = ("generated", "prose")  # the documents' text: generated sentences, or real prose (eval/longdoc_prose.py)
N_CTXS = (512, 1024)
LENGTHS = (2, 4)
SECOND = 2  # the second-question mode asks about fact (q + SECOND) % FACTS after question q
OLLAMA_NUM_KEEP = 4
PILOT_QUESTIONS = 3
# turns: 2 in the second-question mode (absent otherwise, as in the rows written before it existed)
# haystack: "prose" in rows on real prose (absent for generated sentences, as in the rows written before it existed)
KEY_FIELDS = ("model", "n_ctx", "length", "policy", "doc", "question", "max_tokens", "seed", "turns", "haystack")


# --- readings -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reading:
    """A policy's prompts for one document: `shared` is read once, then each question's `suffix[q]`."""
    shared: tuple[int, ...]
    suffix: tuple[tuple[int, ...], ...]
    held: tuple[int, ...]  # the prompt's tokens the policy reads, per question (before any room-making)


def common_prefix(prompts: Sequence[Sequence[int]]) -> int:
    n = min(len(p) for p in prompts)
    for i in range(n):
        t = prompts[0][i]
        if any(p[i] != t for p in prompts[1:]):
            return i
    return n


def room_first_part(n_ctx: int, max_tokens: int) -> int:
    """The first part room-making reads of a message longer than the context, before it evicts anything
    (RoomMaker.fit on an empty conversation: no cell is protected yet)."""
    return part_size(n_ctx, 0, answer_room(max_tokens, n_ctx))


def reading(policy: str, prompts: Sequence[Sequence[int]], n_ctx: int, max_tokens: int, n_keep: int) -> Reading:
    """What `policy` reads of a document's prompts (one per question: the document, then the question);
    every question of the document must be in `prompts`, so that the shared part never depends on
    which of them are still to run. n_keep: the system prompt and the turn's header (ChatSession's)."""
    if len(prompts) < 1:
        raise ValueError("a reading needs at least one prompt")
    lcp = common_prefix(prompts)
    if lcp == min(len(p) for p in prompts):
        raise ValueError("every question's prompt must end in tokens of its own")
    limit = n_ctx - max_tokens - 1  # shift and truncate: the prompt and its answer fit, never shifted
    if policy == "full":
        head, cut = lcp, None
    elif policy in ROOM:
        head, cut = min(lcp, room_first_part(n_ctx, max_tokens)), None
    elif policy in ("truncate", "shift"):
        keep = OLLAMA_NUM_KEEP if policy == "truncate" else max(N_SINK, n_keep)
        longest = max(len(p) for p in prompts)
        if longest <= limit:
            start = keep
        elif policy == "truncate":  # the tail that fits, with the first 4 tokens
            start = longest - (limit - keep)
        else:  # llama-server: discard whole blocks of half the rest after n_keep
            block = max(1, (limit - keep) // 2)
            start = keep + max(0, (longest - keep - block) // block) * block
        if not keep <= start <= lcp:
            raise ValueError(f"the context ({n_ctx}) is too small for {policy}: {keep} kept tokens, the question "
                             f"{longest - lcp} and the answer {max_tokens}")
        head, cut = lcp, (keep, start)
    else:
        raise ValueError(f"policy {policy!r} reads nothing; choose from {', '.join(RUN)}")
    first = list(prompts[0][:head]) if cut is None else list(prompts[0][:cut[0]]) + list(prompts[0][cut[1]:lcp])
    suffix = tuple(tuple(p[head:]) for p in prompts)
    return Reading(tuple(first), suffix, tuple(len(first) + len(s) for s in suffix))


# --- the run ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cell:
    n_ctx: int
    length: float

    @property
    def tokens(self) -> int:
        return int(self.length * self.n_ctx)


class Prompter:
    """A model's chat prompts: a message rendered with its template, as token ids (what the engine reads)."""

    def __init__(self, model):
        self.model = model
        self.template = ChatTemplate(model, fallback="the long-document evaluation needs a chat model")

    def count(self, text: str) -> int:
        return len(self.model.tokenize(text, add_special=False))

    def tokens(self, message: str) -> list[int]:
        return self.model.tokenize(self.render([("user", message)]), add_special=True)

    def render(self, turns: Sequence[tuple[str, str]]) -> str:
        """(role, content) turns rendered with the template, the assistant's turn opened."""
        return self.template.render([{"role": r, "content": c} for r, c in turns], True)

    def measure(self, message: str) -> int:
        return len(self.tokens(message))


def set_policy(eng: Engine, policy: str) -> Engine:
    """The gate never evicts for speed; the room policies make room at the wall, the others refuse."""
    eng.set_gate("never")
    eng.on_full = "evict" if policy in ROOM else "refuse"
    eng.set_room_ranking(ROOM_RANKING.get(policy, "question"))
    name, options = ROOM_EVICTORS.get(policy, ROOM_POOLED)
    eng.set_room_evictor(name, **options)
    eng.set_reread(REREAD.get(policy, "never"))
    return eng


def read_shared(eng: Engine, r: Reading) -> tuple[object, float]:
    """Prefill the reading's shared part on a fresh conversation; (its snapshot, seconds)."""
    t0 = time.perf_counter()
    eng.reset()
    if r.shared:
        eng.prefill(list(r.shared), add_special=False)
    return eng.snapshot(), time.perf_counter() - t0


def text_cells(model, tokens: Sequence[int], text: str) -> list[int]:
    """The indices of the tokens whose text overlaps the first occurrence of `text` in theirs ([] if absent)."""
    pieces = [model.token_to_piece(t, special=True) for t in tokens]
    joined, needle = b"".join(pieces), text.encode()
    i = joined.find(needle)
    if i < 0:
        return []
    out, at = [], 0
    for k, p in enumerate(pieces):
        if at < i + len(needle) and at + len(p) > i:
            out.append(k)
        at += len(p)
    return out


def fact_held(eng: Engine, fact: Fact) -> float:
    """The share of the fact's sentence the cache holds now (0 when the conversation does not hold its text: a
    reading that cut it): what room-making kept, apart from whether the model then answers with it."""
    idx = text_cells(eng.model, eng.history, FACT.format(**fact.__dict__))
    return round(float(eng.cache_map()[0][idx].mean()), 3) if idx else 0.0


def ask(eng: Engine, snap, suffix: Sequence[int], max_tokens: int) -> dict:
    """Restore the shared reading and answer one question: its suffix is prefilled (through room-making
    when the engine makes room) and the answer generated greedily."""
    t0 = time.perf_counter()
    eng.restore(snap)
    s = eng.stream(list(suffix), max_tokens=max_tokens, add_special=False)
    pieces, first = [], None
    for piece in s:
        if first is None:
            first = time.perf_counter() - t0
        pieces.append(piece)
    own = time.perf_counter() - t0
    r, d = s.result, s.decision
    n_prompt = len(snap.history) + len(suffix)
    held = int(eng.cache_map()[0][:n_prompt].sum())
    return dict(answer="".join(pieces), tokens=list(r.tokens), finish=r.finish_reason, gen_tokens=len(r.tokens),
                decode_tok_s=round(r.tokens_per_s, 2), first_s=first if first is not None else own, own_s=own,
                held=held, room_evicted=d.room_evicted, chunks=d.chunks)


def ask_next(eng: Engine, prompter: Prompter, first: str, answer: str, second: str, max_tokens: int) -> dict:
    """The next turn of the conversation `ask` left (its message `first`, its answer `answer`): the message
    `second`, rendered after both as a chat client sends it, less the text the cache already holds."""
    before = prompter.render([("user", first)]) + answer
    after = prompter.render([("user", first), ("assistant", answer), ("user", second)])
    delta = after[len(os.path.commonprefix([before, after])):]
    t0 = time.perf_counter()
    s = eng.stream(eng.model.tokenize(delta, add_special=False), max_tokens=max_tokens, add_special=False)
    pieces, first_s, refused = [], None, None
    try:
        for piece in s:
            if first_s is None:
                first_s = time.perf_counter() - t0
            pieces.append(piece)
    except ContextFull as e:  # shift and truncate fit the first turn only (they never make room): refused
        refused = str(e)
    own = time.perf_counter() - t0
    return dict(answer="".join(pieces), first_s=first_s if first_s is not None else own, own_s=own,
                room_evicted=s.decision.room_evicted if s.decision is not None else 0, refused=refused,
                reread=s.decision.reread if s.decision is not None else 0)


def _key(row: dict) -> tuple:
    return tuple(json.dumps(row.get(k)) for k in KEY_FIELDS)


class LongDocRun:
    """The evaluation: cells (n_ctx x length) x documents x questions x policies, rows appended to `out`
    as each (document, question, policy) finishes. engine_options: passed to every Engine (n_gpu_layers,
    rpc, attention_settings, allow_long_context...). Close it (or use `with`) to free the engines."""

    def __init__(self, model_path, out, docs: int = 25, questions: int = FACTS, n_ctxs: Sequence[int] = N_CTXS,
                 lengths: Sequence[float] = LENGTHS, policies: Sequence[str] = POLICIES, max_tokens: int = 32,
                 seed: int = 42, threads: int = 2, engine_options: dict | None = None, second: bool = False,
                 haystack: str = "generated"):
        from page_local.store.gguf import gguf_metadata, model_identity

        bad = [p for p in policies if p not in POLICIES]
        if bad or not policies:
            raise ValueError(f"unknown policies {bad or '(none)'}; choose from {', '.join(POLICIES)}")
        if not 1 <= questions <= FACTS:
            raise ValueError(f"questions must be in [1, {FACTS}] (the facts of a document), got {questions!r}")
        if docs < 1 or any(isinstance(n, bool) or not isinstance(n, int) or n < 128 for n in n_ctxs) or not n_ctxs:
            raise ValueError(f"docs must be >= 1 and n_ctx ints >= 128, got {docs!r}, {list(n_ctxs)!r}")
        if not lengths or any(not L > 1 for L in lengths):
            raise ValueError(f"lengths are multiples of n_ctx above 1 (longer than the context), got {list(lengths)!r}")
        if haystack not in HAYSTACKS:
            raise ValueError(f"haystack must be one of {', '.join(HAYSTACKS)}; got {haystack!r}")
        if haystack == "prose":  # said before any model is loaded: which package ships a missing text
            from page_local.tasks.realtext import check_available
            check_available(tuple(dict.fromkeys(text_kind(i) for i in range(docs))))  # the kinds its documents read
        self.haystack = haystack
        self.model_path, self.out = model_path, Path(out)
        self.docs, self.questions, self.max_tokens, self.seed, self.threads = docs, questions, max_tokens, seed, threads
        self.cells = [Cell(n, float(L)) for n in n_ctxs for L in lengths]
        self.policies = [p for p in POLICIES if p in policies]
        self.engine_options = dict(engine_options or {})
        self.base = dict(model=model_identity(model_path), model_name=gguf_metadata(model_path).get("general.name"),
                         max_tokens=max_tokens, seed=seed, **made_where())  # rows.made_where
        self.second = bool(second)
        if self.second:  # a key field only here: the rows of the one-question mode keep their keys
            self.base["turns"] = 2
        if haystack != "generated":  # likewise: the generated documents' rows keep theirs
            self.base["haystack"] = haystack
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.done = {_key(r) for r in read_rows(self.out, repair=True)}
        self._engines: dict[str, Engine] = {}
        self._prompter: Prompter | None = None
        self._docs: dict[tuple, Document] = {}

    # what is to do
    def row_base(self, cell: Cell, doc: int, q: int, policy: str) -> dict:
        return dict(self.base, n_ctx=cell.n_ctx, length=cell.length, policy=policy, doc=doc, question=q)

    def units(self) -> list[tuple[Cell, int, str, list[int]]]:
        """(cell, document, policy, questions to do), in the order they run: largest cell first."""
        out = []
        for cell in sorted(self.cells, key=lambda c: (-c.tokens, -c.n_ctx)):
            for d in range(self.docs):
                for p in self.policies:
                    qs = [q for q in range(self.questions) if _key(self.row_base(cell, d, q, p)) not in self.done]
                    if qs:
                        out.append((cell, d, p, qs))
        return out

    def plan(self) -> dict:
        """Questions, policies, cells and what is left: `runs` are (question, policy) pairs that run a model."""
        units = self.units()
        per_cell = self.docs * self.questions
        rows = len(self.cells) * per_cell * len(self.policies)
        runs = [(c, len(qs)) for c, _, p, qs in units if p in RUN]
        return dict(model=self.base["model_name"] or self.base["model"],
                    cells=[(c.n_ctx, c.length) for c in self.cells],
                    docs=self.docs, questions_per_doc=self.questions, questions_per_cell=per_cell,
                    policies=self.policies, rows=rows, rows_done=rows - sum(len(u[3]) for u in units),
                    runs_left=sum(n for _, n in runs),
                    runs_left_by_cell={(c.n_ctx, c.length): sum(n for cc, n in runs if cc == c) for c in self.cells})

    # engines and documents
    def engine(self, policy: str, cell: Cell) -> Engine:
        kind = "full" if policy == "full" else f"small-{cell.n_ctx}"
        if kind not in self._engines:
            for k in [k for k in self._engines if k != "full" and kind != "full"]:  # one small engine at a time
                old = self._engines.pop(k)
                if self._prompter is not None and self._prompter.model is old.model:
                    self._prompter = None
                old.close()
            n_ctx = (max(c.tokens for c in self.cells) + self.max_tokens + 64) if kind == "full" else cell.n_ctx
            self._engines[kind] = Engine(self.model_path, n_ctx=n_ctx, threads=self.threads, gate="never",
                                         **self.engine_options)
        eng = set_policy(self._engines[kind], policy)
        ChatSession(eng)  # sets eng.n_keep: the system prompt and the turn's header (protected, shift's n_keep)
        return eng

    @property
    def prompter(self) -> Prompter:
        if self._prompter is None:
            eng = next(iter(self._engines.values()), None) or self.engine("truncate", self.cells[0])
            self._prompter = Prompter(eng.model)
        return self._prompter

    def document(self, cell: Cell, d: int) -> Document:
        if (cell.tokens, d) not in self._docs:
            pr = self.prompter
            build = build_prose_document if self.haystack == "prose" else build_document
            self._docs[(cell.tokens, d)] = build(d, cell.tokens, pr.count, pr.measure, self.seed)
        return self._docs[(cell.tokens, d)]

    @staticmethod
    def words(doc: Document, q: int) -> dict:
        """A prose document's row fields: the real text it was cut from and whether question q is paraphrased
        (with its words); {} for generated documents (their rows as before)."""
        if not doc.source:
            return {}
        return dict(source=doc.source, paraphrased=doc.paraphrased[q], question_text=doc.question(q))

    # running
    def run_unit(self, cell: Cell, d: int, policy: str, qs: Iterable[int], write: Callable[[dict], None]) -> None:
        """The questions qs of document d under one policy: the shared reading once, then each question;
        a row written as each finishes."""
        doc = self.document(cell, d)
        if policy == "server":
            for q in qs:
                n, fact = self.prompter.measure(doc.message(q)), doc.facts[q]
                write(dict(self.row_base(cell, d, q, policy), **self.words(doc, q), kind=fact.what, depth=fact.depth,
                           expected=fact.code,
                           answer="", correct=False, finish="refused", prompt_tokens=n, ttft_s=None,
                           decode_tok_s=None, cost_s=0.0,
                           error=f"400: the prompt ({n} tokens) exceeds the context ({cell.n_ctx})"))
            return
        eng = self.engine(policy, cell)
        prompts = [self.prompter.tokens(doc.message(q)) for q in range(FACTS)]  # all: the reading never varies
        r = reading(policy, prompts, cell.n_ctx, self.max_tokens, eng.n_keep)
        snap, shared_s = read_shared(eng, r)
        qs = list(qs)
        for q in qs:
            o = ask(eng, snap, r.suffix[q], self.max_tokens)
            fact = doc.facts[q]
            held_share = fact_held(eng, fact)
            correct = string_match_all(normalize_prediction(o["answer"]), [fact.code]) == 1.0
            row = dict(self.row_base(cell, d, q, policy), **self.words(doc, q), kind=fact.what, depth=fact.depth,
                       expected=fact.code,
                       answer=o["answer"], correct=correct, finish=o["finish"], gen_tokens=o["gen_tokens"],
                       ttft_s=round(shared_s + o["first_s"], 4), decode_tok_s=o["decode_tok_s"],
                       shared_s=round(shared_s, 4), own_s=round(o["own_s"], 4),
                       cost_s=round(shared_s / self.questions + o["own_s"], 4), prompt_tokens=len(prompts[q]),
                       read_tokens=r.held[q], held=o["held"], shared_tokens=len(r.shared),
                       room_evicted=o["room_evicted"], chunks=o["chunks"], fact_held=held_share)
            if self.second:  # the next turn: the fact two quarters away (as often before the first as after it)
                q2 = (q + SECOND) % FACTS
                o2 = ask_next(eng, self.prompter, doc.message(q), o["answer"], doc.question(q2), self.max_tokens)
                f2 = doc.facts[q2]
                row["second_fact_held"] = fact_held(eng, doc.facts[q2])
                if o2["reread"]:
                    row["second_reread"] = o2["reread"]
                if doc.paraphrased:
                    row["second_paraphrased"] = doc.paraphrased[q2]
                row.update(second=q2, second_kind=f2.what, second_depth=f2.depth, second_expected=f2.code,
                           second_answer=o2["answer"], second_ttft_s=round(o2["first_s"], 4),
                           second_correct=string_match_all(normalize_prediction(o2["answer"]), [f2.code]) == 1.0,
                           second_room_evicted=o2["room_evicted"])
                if o2["refused"]:
                    row["second_error"] = o2["refused"]
                row["cost_s"] = round(row["cost_s"] + o2["own_s"], 4)
            write(row)

    def run(self, progress: Callable[[int, int], None] | None = None, units=None) -> dict:
        """Every unit still to do (or `units`, a part of them), rows appended to out; progress(done, total):
        rows, those already in the file included. cost_s: the mean seconds per question per policy."""
        plan = self.plan()
        done, total = plan["rows_done"], plan["rows"]
        res = dict(out=str(self.out), rows_present=done, rows_written=0, wall_s=0.0, cost_s={})
        t0 = time.perf_counter()
        costs: dict[str, list[float]] = {}
        with open(self.out, "a", encoding="utf-8") as f:
            def write(row: dict) -> None:
                nonlocal done
                f.write(json.dumps(row) + "\n")
                f.flush()
                self.done.add(_key(row))
                if row["policy"] in RUN:
                    costs.setdefault(row["policy"], []).append(row["cost_s"])
                res["rows_written"] += 1
                done += 1
                if progress:
                    progress(done, total)

            for cell, d, policy, qs in (self.units() if units is None else units):
                self.run_unit(cell, d, policy, qs, write)
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        res["cost_s"] = {p: round(sum(v) / len(v), 2) for p, v in costs.items()}
        return res

    def pilot(self, progress=None, n: int = PILOT_QUESTIONS) -> dict:
        """Run the first n questions still to do of the largest cell's first document with work left, under
        every policy (rows of the evaluation: kept). cost_s {policy: seconds per question}, at `cell`."""
        units = self.units()
        if not units:
            return dict(cell=None, cost_s={}, wall_s=0.0, rows_written=0)
        cell, d = units[0][0], units[0][1]
        res = self.run(progress, [(c, dd, p, qs[:n]) for c, dd, p, qs in units if (c, dd) == (cell, d)])
        return dict(cell=(cell.n_ctx, cell.length), cost_s=res["cost_s"], wall_s=res["wall_s"],
                    rows_written=res["rows_written"])

    def estimate_hours(self, cost_s: dict[str, float], cell: tuple[int, float]) -> float:
        """Hours for what is left, from seconds per question per policy measured at `cell`, scaled by the
        cells' document tokens (prefill dominates: a cell of twice the tokens costs twice)."""
        ref = cell[0] * cell[1]
        secs = 0.0
        for c, _, p, qs in self.units():
            if p in RUN:
                secs += len(qs) * cost_s.get(p, max(cost_s.values(), default=0.0)) * c.tokens / ref
        return secs / 3600

    def close(self) -> None:
        for e in self._engines.values():
            e.close()
        self._engines.clear()

    def __enter__(self) -> LongDocRun:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def default_out(model_path: str | os.PathLike, second: bool = False, haystack: str = "generated") -> Path:
    prose = "-prose" if haystack == "prose" else ""
    return Path(f"results/longdoc{prose}-{Path(model_path).stem}{'-second' if second else ''}.jsonl")

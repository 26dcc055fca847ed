"""Room on demand: what a conversation does when the next message does not fit the context.

The speed budget (Engine.budget) is verified eviction for speed. This module is the other kind:
eviction because the alternative is refusing the message. When the conversation's cells plus the
next message and room for its answer would pass n_ctx, the earlier conversation is evicted down to
a low-water mark (LOW_WATER of n_ctx) so that the next turns fit without evicting again, and a
message longer than the context is prefilled in parts with this eviction between them.

What ranks the cells (ROOM_RANKINGS): "question" ranks them by the queries the next
tokens will ask with: the message's own last W tokens (its question, and the template's turn end)
are decoded after the cells they are to rank, with the probe armed, read, and removed again (never
kept: the message is then prefilled at the positions it would have had). So a document read in parts
keeps what its question asks about, and a new chat message keeps the earlier turns it refers to. The
cost is W tokens decoded per eviction (docs/design.md §5.1). "recent" is the earlier ranking (the
conversation's newest W queries: for a document, the previous part's own text; the engine's evictor,
unpooled), kept to compare.

Never upfront: the room made for an answer before its message is read is a normal answer's
(ANSWER_ROOM, or max_tokens if fewer), not max_tokens'; a message that fits whole, with MIN_ANSWER
cells to spare once earlier turns are evicted, is never evicted itself; only a longer one is read in
parts. An answer that outgrows the context may evict earlier turns, never the message it answers:
when nothing else can go it ends (finish "context").

Why it is not self-verified: verification compares the evicted cache with the full one on the
answer, and here the full one cannot hold the message: there is no reference to check against.
It protects structure instead, as the measured failure of global caps asks (arXiv 2605.18053): the
sinks, the system prompt (Engine.n_keep), every control token (the chat template's turn
boundaries) and the latest RECENT of n_ctx; the rest is kept a sentence at a time: SnapKV's score summed
over each sentence, whole sentences best first (ROOM_EVICTOR, evictors/spans.py; the sentences are cut from
the conversation's token text, RoomMaker.spans). A message read in parts is cut several times, each cut ranked
by the same question decoded after the newest part: each cell's score is the best any cut of the message gave it
(the room record's "best", EvictionInput.prior), so that a sentence the question ranked high when it was read
does not sink below newer ones as the question moves away from it. set_room_evictor takes another that reads only the probe
(and the spans): ("snapkv", pool "avg", kernel 15), cells pooled over 15 neighbours, was the default until
issue 43 and lost a fact's last digits at 4x n_ctx (docs/design.md §5.1).

"question+generic" shares the kept cells between the question (1 - GENERIC_SHARE) and a generic query
(GENERIC_SHARE: KVzip's reconstruction prompt), decoded and removed as the question is, for a later question
about another part of a long message; W more tokens decoded per eviction. Measured, it does not keep that
part any better than the question alone (docs/design.md §5.1); kept to compare.

Reading again (Engine reread, off by default): what room-making deleted was chosen by the message that was
read then; a later message about another part of it finds nothing (issue 43: a second question about a long
document, 0 of 12 where the full cache answered 6). With reread, the message after a cut reads the conversation
again from the first token room-making deleted (reread_from), through room-making ranked by the new message:
the deleted part comes back if the new message asks about it. The cost is that reading again (its time to first
token is the long message's again); nothing else changes. "always" pays it on every message while the
conversation holds a cut; "words" only when the sentence that the new message's question meets best by its words
(BM25, as "hybrid" ranks: words_went) lost tokens to a cut, so that a follow-up about what is still held, or a
message about something else, is read as it is.

Reading the words too (issue 57; "bm25" and "hybrid"): on real prose a 135M model's attention from a question does
not single out the fact's sentence among 2 000 tokens of essay (4x n_ctx 512: room 7 of 16 where the full cache
answered 16). A reader who has to cut a document also looks at the words: each sentence (span) the question's
probe ranks is also scored by BM25 (Robertson and Zaragoza, "The Probabilistic Relevance Framework: BM25 and
Beyond", 2009; the bm25s package) over the conversation's sentences, evicted ones included (so that a term's rarity
is the document's, not what is left of it), with the question's terms (query_text: the message's last sentence that
asks, the chat template's words left out). "hybrid" keeps whole sentences by (1 - share) x their attention (summed
over the sentence's cells, as snapkv-spans does, with each cell's best score of the message's cuts) + share x their
BM25, each divided by its largest over the candidates (word_scores; share: RoomMaker.lexical_share, LEXICAL_SHARE by
default); "bm25" by BM25 alone, the attention ordering only what no question word reaches (TIE). The probe is
decoded as for "question": the attention part and the sentences BM25 does not score need it. A second message ranks
again what is held; what went comes back only by reading again (Engine reread), which then ranks it by the new
message's words too. "hybrid" is the default (ROOM_RANKING, measured in docs/results.md, "Real prose"); a message
whose words hold no question, or a room evictor with no score to add the words to, is ranked by the attention alone.

Positions: eviction leaves gaps, and every turn appends after the highest position, so a long chat
walks past the model's trained context while its cells still fit. close_gaps renumbers the held
cells 0..n-1 (llama_memory_seq_add; llama.cpp re-rotates the keys as its context shift does).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from page_local import defaults
from page_local.engine.decision import Decision
from page_local.engine.transcript import Transcript
from page_local.engine.turn import N_SINK, TOP_K, W
from page_local.errors import ContextFull
from page_local.evictors import get_evictor
from page_local.evictors.base import EvictionInput, Evictor
from page_local.evictors.spans import SentenceCut, keep_spans, sentence_spans

LOW_WATER = 0.5  # after making room, the earlier conversation holds at most this fraction of n_ctx
RECENT = 0.125  # the conversation's latest tokens protected while making room, as a fraction of n_ctx
RECENT_MAX = 512
ON_FULL = ("evict", "refuse")
# what ranks the cells room-making evicts (see above)
ROOM_RANKINGS = ("question", "recent", "question+generic", "bm25", "hybrid")
# the default: the question's attention and its words (issue 57). On real prose at 4x n_ctx 512 (SmolLM2, 25
# documents) hybrid answered 23 of 44 where "question" answered 11 and the full cache 20 of 48, and held the asked
# fact's sentence whole in 44 of 44 against 22 (docs/results.md, "Real prose"); on generated sentences it answers
# as "question" does (the same section). A message with no question in its words, or an evictor with no score
# (set_evictor), is ranked by the attention alone, as "question".
ROOM_RANKING = "hybrid"
# the rankings that read the question's words (issue 57): the share of BM25 in a sentence's score (None: the
# RoomMaker's lexical_share, LEXICAL_SHARE by default). What share is best is measured: docs/results.md, "Real prose".
WORD_RANKINGS = {"bm25": 1.0, "hybrid": None}
LEXICAL_SHARE = 0.5
TIE = 1e-3  # "bm25": the attention's weight, so that it orders the sentences no question word reaches
QUERY_TOKENS = 2 * W  # the message's tail in which the question is looked for (query_text)
QUERY_MIN_WORDS = 3  # a sentence of fewer words ("assistant", a template's header) is not the question
# "question+generic": the share of the ranked cells that a generic query keeps, the rest the question's, for a
# later question about another part of the message (issue 43, item 3), and that query: KVzip's reconstruction
# prompt (Kim et al., arXiv 2505.23416), which asks for all of the context, not one part of it. Measured at 2x
# n_ctx 1024 (24 second questions): 12 answered against 14 by the question alone and 19 by the full cache; a
# fact before the first question's was kept 3 of 12 times (2 of 12, full 7 of 12): a generic query ranks a
# fact's sentence as it ranks filler. Not the default.
GENERIC_SHARE = 0.5
GENERIC_QUERY = "\n\nRepeat the previous context exactly."
# The evictor that ranks them: SnapKV's score, kept a sentence at a time (evictors/spans.py). The question's
# queries attend to a fact's key, not to its value: per cell, the value's last digits rank below the budget
# (raw ranks 109-382 of ~395 candidates, 168 kept, at 4x n_ctx 512), and SnapKV's pooling over 15 centred
# neighbours (the default before issue 43, ROOM_POOLED) lifts them by their distance from the key, least for
# the last digit, which each of the 8-10 evictions of a 4x document erodes further ("405" for 4050). Kept a
# sentence at a time: 16 of 24 questions at 4x n_ctx 512 against 6 pooled (docs/design.md §5.1). With each cell's
# best score of the message's cuts (prior "max", the evictor's default): an early fact's sentence no longer
# sinks from 3rd-6th at its first cut to 16th at the last (docs/design.md §5.1, eval longdoc's room-best).
ROOM_EVICTOR = ("snapkv-spans", {"prior": "max"})
ROOM_POOLED = ("snapkv", {"pool": "avg", "kernel": 15})  # the default before issue 43, kept to compare
ROOM_PROVIDES = frozenset({"probe", "spans"})  # what room-making gives its evictor (spans: sentence_spans)
MIN_ANSWER = 64  # a message is read whole (never evicted) when it fits with this many answer cells to spare
# the answer's room made before a message (from earlier turns; from the message only when it is longer than
# the context): a normal answer's, not max_tokens' (Engine passes min(max_tokens, n_ctx/4, ANSWER_ROOM))
ANSWER_ROOM = 256


def check_on_full(mode: str) -> str:
    if mode not in ON_FULL:
        raise ValueError(f"on_full must be one of {', '.join(ON_FULL)}; got {mode!r}")
    return mode


def reread_from(conv: Transcript) -> int | None:
    """The first history index room-making deleted (where reading again starts), None if it deleted none or
    that is not known (a conversation restored from a snapshot)."""
    return min(conv.room_out) if conv.room_out else None


def check_reread(mode) -> str:
    """A reread mode (defaults.REREADS); True and False, the older switch, are "always" and "never"."""
    if mode is True or mode is False:
        return "always" if mode else "never"
    if mode not in defaults.REREADS:
        raise ValueError(f"reread must be one of {', '.join(defaults.REREADS)}; got {mode!r}")
    return mode


def check_room_ranking(mode: str) -> str:
    if mode not in ROOM_RANKINGS:
        raise ValueError(f"room ranking must be one of {', '.join(ROOM_RANKINGS)}; got {mode!r}")
    return mode


def check_lexical_share(share: float) -> float:
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= float(share) <= 1.0:
        raise ValueError(f"the lexical share must be a number in [0, 1], got {share!r}")
    return float(share)


def bm25_scores(docs: list[str], query: str) -> np.ndarray:
    """f64 (len(docs),): each text's BM25 score for the query's terms (bm25s: Lucene's BM25, k1 1.5, b 0.75, English
    stop words, lower case, words of 2 or more letters or digits; the IDF is the docs'). Zeros when no query term is
    in any doc."""
    try:
        import bm25s
    except ImportError as e:  # a dependency: only an install that skipped it lacks it
        raise ImportError("room ranking by the question's words needs the bm25s package (pip install bm25s)") from e
    out = np.zeros(len(docs), np.float64)
    if not docs:
        return out
    corpus = bm25s.tokenize(list(docs), stopwords="en", return_ids=False, show_progress=False)
    terms = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)[0]
    vocab = {t for d in corpus for t in d}
    terms = [t for t in terms if t in vocab]
    if not terms:
        return out
    index = bm25s.BM25()
    index.index(corpus, show_progress=False)
    out[:] = index.get_scores(terms)
    return out


def word_scores(attention: np.ndarray, lexical: np.ndarray, spans: np.ndarray, share: float) -> np.ndarray:
    """f64 (T,): the cells' scores for keep_spans (summed per span) that rank each span by
    (1 - share) x A_s / max A + share x L_s / max L, where A_s is the span's attention summed over its cells and L_s
    its lexical score. attention f64 (T,) per cell; lexical f64 (T,), each cell its span's score (spread evenly over
    the span's cells here); spans i64 (T,). With share 1 the attention still weighs TIE (it orders the spans the
    lexical score does not reach); a maximum of 0 counts as 1 (that part then adds nothing)."""
    share = check_lexical_share(share)
    attention, lexical = np.asarray(attention, np.float64), np.asarray(lexical, np.float64)
    if not attention.shape == lexical.shape == np.shape(spans):
        raise ValueError(f"attention {attention.shape}, lexical {lexical.shape} and spans {np.shape(spans)} must align")
    if attention.size == 0:
        return attention.copy()
    _, inv, size = np.unique(spans, return_inverse=True, return_counts=True)
    a_max = float(np.bincount(inv, weights=attention).max())
    l_max = float(lexical.max())
    a_max, l_max = (a_max if a_max > 0 else 1.0), (l_max if l_max > 0 else 1.0)
    return max(1.0 - share, TIE) * attention / a_max + share * lexical / (l_max * size[inv])


def target_cells(n_ctx: int, need: int) -> int:
    """How many cells the earlier conversation may keep when `need` more must fit: at most the low-water
    mark, and never so many that the need does not fit."""
    return max(0, min(int(n_ctx * LOW_WATER), n_ctx - 1 - need))


def protected(held: np.ndarray, tokens: np.ndarray, n_keep: int, n_ctx: int, is_control) -> np.ndarray:
    """bool (T,): the held cells room-making must not evict. held: i32 (T,) positions, ascending;
    tokens: the token each of them holds; n_keep: positions below it are the system prompt."""
    keep = held < max(N_SINK, n_keep)
    keep |= np.fromiter((is_control(int(t)) for t in tokens), dtype=bool, count=tokens.size)
    recent = min(RECENT_MAX, int(n_ctx * RECENT))
    if recent and held.size:
        keep[max(0, held.size - recent):] = True
    return keep


def gap_runs(held: np.ndarray) -> list[tuple[int, int, int]]:
    """(p0, p1, delta) shifts that renumber the held positions 0..T-1, applied in order: each maximal
    run of consecutive positions [p0, p1) moves down by -delta. Empty when there are no gaps."""
    runs = []
    if held.size == 0:
        return runs
    breaks = np.flatnonzero(np.diff(held) != 1) + 1
    starts = np.r_[0, breaks]
    ends = np.r_[breaks, held.size]
    for s, e in zip(starts.tolist(), ends.tolist()):
        delta = s - int(held[s])  # the run's first cell goes to position s
        if delta:
            runs.append((int(held[s]), int(held[e - 1]) + 1, delta))
    return runs


def renumber(pos_of: np.ndarray, held: np.ndarray) -> np.ndarray:
    """The position of every history token after close_gaps: a held token's new position, and for an
    evicted one the position the next held token takes (monotone, so a prefix of the history is
    still a prefix of positions)."""
    return np.searchsorted(held, pos_of, side="left").astype(np.int64)


def window_of(held: np.ndarray) -> np.ndarray:
    """The conversation's newest contiguous positions, at most W: the queries that rank the rest."""
    if held.size == 0:
        return held
    breaks = np.flatnonzero(np.diff(held) != 1) + 1
    start = int(breaks[-1]) if breaks.size else 0
    return held[max(start, held.size - W):]


def answer_room(max_tokens: int, n_ctx: int) -> int:
    """The room made for an answer before its message is read: a normal answer's, not max_tokens' (never
    upfront: an answer that grows past it makes room from earlier turns then)."""
    return min(max_tokens, max(1, n_ctx // 4), ANSWER_ROOM)


def part_size(n_ctx: int, hard: int, answer: int) -> int:
    """The parts a message longer than the context is read in: half of what room-making can free once the
    `hard` cells that never go (sinks, system prompt, turn boundaries) and the answer's room are set aside."""
    return max(W + 1, (n_ctx - 1 - answer - hard) // 2)


def _chunks(toks: list[int], size: int) -> list[list[int]]:
    """toks in pieces of at most `size`, the last one full (it carries the question)."""
    head = len(toks) - size
    return [toks[i: min(i + size, head)] for i in range(0, head, size)] + [toks[head:]]


@dataclass(frozen=True)
class RoomRules:
    """What the Engine's settings say to room-making, handed over with each call: on_full "evict" or
    "refuse"; n_keep: positions below it are never evicted (the system prompt); compact: move the held
    cells together after evicting; seed: for an evictor that draws; evictor: the engine's speed evictor
    (the "recent" ranking uses it when it reads only the probe)."""
    on_full: str
    n_keep: int
    compact: bool
    seed: int
    evictor: object


class RoomMaker:
    """Room on demand, owned by the Engine: fitting a turn that does not fit, making room, closing gaps.
    It drives the context it was made with; the conversation (a Transcript) and the Engine's rules are
    handed to each call, and what it did is returned in the Decision and the `room` record."""

    def __init__(self, ctx, model, pipeline):
        self.ctx, self.model, self.pipeline = ctx, model, pipeline
        self.ranking = ROOM_RANKING  # what ranks the cells room-making evicts (set_ranking)
        self._evictor = None  # set_evictor; None: ROOM_EVICTOR
        self._pieces: dict[int, str] = {}  # token -> its text, for sentence_spans
        # the conversation's sentences as cut so far, and the tokens they were cut from (history_spans)
        self._cut: tuple[SentenceCut, list[int]] = (SentenceCut(), [])
        self.generic_share = GENERIC_SHARE  # "question+generic": the generic query's share of the kept cells
        self.lexical_share = LEXICAL_SHARE  # "hybrid": BM25's share of a sentence's score (set_lexical_share)

    def set_evictor(self, name: str, **options) -> None:
        """The evictor that ranks the cells room-making evicts; it may need nothing but the probe."""
        ev = get_evictor(name, **options)
        if not ev.needs <= ROOM_PROVIDES:
            raise ValueError(f"evictor {name!r} needs {', '.join(sorted(ev.needs - ROOM_PROVIDES))}, which room-making "
                             "does not provide; choose one that reads only the probe (snapkv, snapkv-spans, "
                             "pyramidkv, streamingllm, random)")
        self._evictor = ev

    @property
    def evictor(self):
        if self._evictor is None:
            name, options = ROOM_EVICTOR
            self._evictor = get_evictor(name, **options)
        return self._evictor

    def set_ranking(self, mode: str) -> None:
        """'hybrid' (the default, ROOM_RANKING) or 'bm25' (the question's attention and its words: BM25 over the
        sentences, the module docstring), 'question' (the message's own last W tokens rank the cells alone),
        'question+generic' (the question ranks 1 - generic_share of the kept cells, GENERIC_QUERY the rest) or 'recent' (the
        conversation's newest queries, the earlier ranking, kept to compare)."""
        self.ranking = check_room_ranking(mode)

    def set_lexical_share(self, share: float) -> None:
        """'hybrid': the share of BM25 in a sentence's score, in [0, 1] (0: the attention alone, as 'question';
        1: as 'bm25')."""
        self.lexical_share = check_lexical_share(share)

    @property
    def pos_limit(self) -> int:
        """The first position past what the model was trained on (no limit when unknown)."""
        return self.model.n_ctx_train if self.model.n_ctx_train > 0 else 1 << 62

    def fit(self, conv: Transcript, toks: list[int], reserve: int, rules: RoomRules,
            prefill: Callable[[list[int]], tuple[Decision, object]], save: Callable[[], object],
            back: Callable[[object], None]) -> tuple[Decision, object]:
        """Prefill a turn that may not fit: refuse (on_full "refuse"), or make room by evicting earlier
        turns, and prefill a message longer than the context in parts with room made between them.
        reserve: the answer's room wanted; only earlier turns give it, unless the message itself is longer
        than the context (then at most ANSWER_ROOM of it). prefill(part): the Engine's prefill, probe and gate
        of the message's last part, returning (Decision, plan). save() / back(point): the conversation as it
        is, and put back as it was: interrupted or failed, the conversation is left as before the message."""
        ctx, n_ctx = self.ctx, self.ctx.n_ctx
        used = ctx.cells_used(0)
        fits = used + len(toks) + reserve + 1 <= n_ctx
        if rules.on_full == "refuse" or (fits and ctx.seq_pos_max(0) + len(toks) + reserve < self.pos_limit):
            if used + len(toks) + 1 > n_ctx:
                raise ContextFull(used, len(toks) + 1, n_ctx)
            return prefill(toks)
        point = save()
        room = _room()
        question = list(toks[-W:]) if self.ranking != "recent" else None
        if self.ranking in WORD_RANKINGS:
            room["query"] = self.query_text(toks)
        try:
            held = ctx.page.positions(0)
            tokens = conv.tokens_at(held)
            # cells that can never go: sinks, the system prompt, turn boundaries (no "latest turns" share)
            hard = int(protected(held, tokens, rules.n_keep, 0, self.model.is_control).sum())
            if hard + len(toks) + 1 + min(reserve, MIN_ANSWER) <= n_ctx:
                # it fits whole once earlier turns go: never evicted itself (never upfront, for an answer
                # that may stay short); its answer gets what earlier turns can give, up to reserve
                answer = max(0, min(reserve, n_ctx - 1 - hard - len(toks) - 4))
                parts = [toks]
            else:
                answer = reserve
                cap = n_ctx - 1 - answer  # cells for the conversation and this message before its answer
                if hard + W + N_SINK + 4 > cap:
                    raise ContextFull(used, len(toks) + 1, n_ctx)
                size = part_size(n_ctx, hard, answer)  # a part: half of what room-making can free
                parts = _chunks(toks, size) if len(toks) > size else [toks]
            probe = None
            for part in parts[:-1]:
                self.make_room(conv, len(part), room, rules, probe, question)
                self.close_gaps(conv, len(part), room)
                pos0 = ctx.seq_pos_max(0) + 1
                probe = self.pipeline.prefill(part, pos0, 0).probe  # "recent": its newest queries rank the next room
                conv.extend(part, pos0)
            room["chunks"] = len(parts)
            self.make_room(conv, len(parts[-1]) + answer, room, rules, probe, question)
            self.close_gaps(conv, len(parts[-1]) + answer, room)
            dec, plan = prefill(parts[-1])
        except BaseException:
            back(point)  # the message never happened
            raise
        prompt_pos = np.asarray(conv.pos[len(conv) - len(toks):], dtype=np.int64)
        dec.prompt_tokens, dec.prompt_held = len(toks), int(np.isin(prompt_pos, ctx.page.positions(0)).sum())
        tell_room(dec, room)
        return dec, plan

    def make_room(self, conv: Transcript, need: int, room: dict, rules: RoomRules, probe=None,
                  question: list[int] | None = None, floor: int | None = None, want: int = 0) -> None:
        """Evict earlier cells so that `need` more fit (and, as far as the low-water mark allows, `want`
        more); ContextFull when the protected ones alone leave too little. question: the tokens whose
        queries rank the cells (None: the conversation's newest, or `probe`'s). floor: positions from it on
        are never evicted (the message an answer answers, and the answer so far)."""
        ctx, n_ctx = self.ctx, self.ctx.n_ctx
        held = ctx.page.positions(0)
        tokens = conv.tokens_at(held)
        if held.size + need + want + 1 <= n_ctx:
            return
        hard = protected(held, tokens, rules.n_keep, 0, self.model.is_control)
        prot = protected(held, tokens, rules.n_keep, n_ctx, self.model.is_control)
        if floor is not None:
            hard |= held >= floor
            prot |= held >= floor
        target = target_cells(n_ctx, need + want)
        if prot.sum() > target:  # the latest turns are protected only as long as there is room for them
            prot = hard
        n_prot = int(prot.sum())
        # before a message: refused when what may not go passes the low-water target (the message would
        # keep too little of itself); for an answer (floor): every earlier cell may go if it must
        if n_prot + need + 1 > n_ctx or (floor is None and n_prot + 4 > target):
            raise ContextFull(int(held.size), need + 1, n_ctx)
        n_rank = max(target, n_prot) - n_prot  # unprotected cells kept
        cand = held[~prot]
        if n_rank < cand.size:
            if n_rank:
                # "recent" is the ranking as it was: the engine's evictor (if it reads only the probe), unpooled
                ev = self.evictor if self.ranking != "recent" else (
                    rules.evictor if rules.evictor.needs <= {"probe"} else get_evictor("snapkv"))
                probe = self._ranking_probe(held, tokens, probe, question, room)
                # the words need a question in the message and an evictor with a score to add them to
                words = (bool(question) and self.ranking in WORD_RANKINGS and bool(room.get("query"))
                         and type(ev).score is not Evictor.score)
                # the evictor ranks the unprotected cells only: the protected ones cost it nothing
                hist_spans = self.history_spans(conv) if "spans" in ev.needs or words else None
                spans = None if hist_spans is None else hist_spans[conv.indices_of(cand)]
                n_gen = int(n_rank * self.generic_share) if question and self.ranking == "question+generic" else 0
                # the best score each cell had at an earlier cut of this message, by the same question
                best = room["best"] if question and getattr(ev, "prior", None) == "max" else None
                idx = conv.indices_of(cand) if best is not None else None
                prior = None if best is None else np.fromiter((best.get(int(i), 0.0) for i in idx), np.float64,
                                                              count=idx.size)
                if words:
                    keep, inp = self._select_words(ev, conv, cand, n_rank, probe, hist_spans, spans, rules.seed, prior,
                                                   room)
                else:
                    keep, inp = select_kept(ev, cand, n_rank - n_gen, probe, spans, rules.seed, prior)
                if best is not None and inp is not None:
                    best.update(zip(idx.tolist(), ev.score(inp).tolist()))  # the larger of the two (prior "max")
                if n_gen:  # the generic query's share, from what the question's did not keep
                    generic = self.model.tokenize(GENERIC_QUERY, add_special=False)[-W:]
                    gprobe = self._ranking_probe(held, tokens, None, generic, room)
                    rest = ~np.isin(cand, keep)
                    keep = np.union1d(keep, select_kept(ev, cand[rest], n_gen, gprobe,
                                                        None if spans is None else spans[rest], rules.seed)[0])
                drop = np.setdiff1d(cand, keep, assume_unique=True)
            else:
                drop = cand
            ctx.page.evict(0, drop)
            if conv.room_out is not None:  # which history tokens went, and why (Engine.cache_map)
                conv.room_out.update(int(i) for i in conv.indices_of(drop))  # (the held token of a shared position)
            if rules.compact:
                ctx.page.compact(0)
            room["evicted"] += int(drop.size)
            lo, hi = int(drop.min()), int(drop.max())
            room["from"] = (lo, hi) if room["from"] is None else (min(lo, room["from"][0]), max(hi, room["from"][1]))
        if ctx.cells_used(0) + need + 1 > n_ctx:
            raise ContextFull(ctx.cells_used(0), need + 1, n_ctx)

    def spans(self, conv: Transcript, held: np.ndarray) -> np.ndarray:
        """i64 (len(held),): the sentence each held position belongs to, cut from the conversation's whole text
        (evicted tokens included, so that a sentence whose stop was evicted still ends there)."""
        return self.history_spans(conv)[conv.indices_of(held)]

    def history_spans(self, conv: Transcript) -> np.ndarray:
        """i64 (len(history),): the sentence of every token of the conversation (sentence_spans)."""
        hist = conv.history
        cut, seen = self._cut
        if len(seen) > len(hist) or hist[:len(seen)] != seen:  # not the conversation cut before, or rewound
            cut, seen = self._cut = (SentenceCut(), [])
        add = [int(t) for t in hist[len(seen):]]
        cut.extend([self._piece(t) for t in add], [self.model.is_control(t) for t in add])
        seen.extend(add)
        return cut.ids

    def query_text(self, toks: list[int]) -> str:
        """The question in a message's tokens, as text, for the lexical ranking: of the sentences in its last
        QUERY_TOKENS tokens (control tokens left out), those of at least QUERY_MIN_WORDS words (a chat template's
        "assistant" is not one), from the last one that asks ("?") to the end, else the last one. "" when none."""
        tail = [int(t) for t in toks[-QUERY_TOKENS:]]
        control = [self.model.is_control(t) for t in tail]
        ids = sentence_spans([self._piece(t) for t in tail], lambda i: control[i])
        sents: dict[int, list[str]] = {}
        for t, c, i in zip(tail, control, ids.tolist()):
            if not c:
                sents.setdefault(i, []).append(self._piece(t))
        texts = [" ".join("".join(p).split()) for p in sents.values()]
        content = [x for x in texts if len(re.findall(r"\w+", x)) >= QUERY_MIN_WORDS]
        if not content:
            return ""
        asked = [i for i, x in enumerate(content) if "?" in x]
        return " ".join(content[asked[-1] if asked else -1:])

    def _select_words(self, ev, conv: Transcript, cand: np.ndarray, n: int, probe, hist_spans: np.ndarray,
                      spans: np.ndarray, seed: int, prior: np.ndarray | None,
                      room: dict) -> tuple[np.ndarray, EvictionInput]:
        """(i32 (n,): the cells of cand kept, whole sentences by word_scores; the evictor's input, whose score is
        the attention part): the 'bm25' and 'hybrid' rankings. hist_spans: i64 (len(history),); spans: cand's."""
        t0 = time.perf_counter()
        inp = EvictionInput(held=cand, budget=n, window=np.zeros(0, np.int32), n_sink=0, probe=probe, spans=spans,
                            prior=prior, seed=seed)
        attention = ev.score(inp)  # f64 (T,): with snapkv-spans' prior "max", each cell's best of the cuts
        # the conversation's sentences as text (control tokens left out), evicted ones included: BM25's IDF is the
        # document's, and the same sentence scores the same at every cut
        per_span = bm25_scores(self.span_texts(conv), room["query"])
        share = WORD_RANKINGS[self.ranking]
        score = word_scores(attention, per_span[spans], spans, self.lexical_share if share is None else share)
        keep = keep_spans(score, spans, np.zeros(cand.size, bool), n)
        room["words_ms"] += (time.perf_counter() - t0) * 1e3
        room["ranking"] = self.ranking
        return cand[keep].astype(np.int32), inp

    def span_texts(self, conv: Transcript) -> list[str]:
        """The text of each of the conversation's sentences (history_spans), evicted ones included, control tokens
        left out."""
        self.history_spans(conv)
        return self._cut[0].texts

    def words_went(self, conv: Transcript, toks: list[int]) -> bool:
        """Reading again "words": whether the sentence of the conversation that the message's question (query_text)
        meets best by BM25 lost tokens to room-making (conv.room_out), i.e. what it asks about went with a cut.
        False when no cut is known, the message asks nothing, or none of its words is in the conversation."""
        if not conv.room_out:
            return False
        query = self.query_text(toks)
        if not query:
            return False
        spans = self.history_spans(conv)
        scores = bm25_scores(self.span_texts(conv), query)
        if not scores.size or scores.max() <= 0:
            return False
        went = np.zeros(scores.size, bool)
        went[spans[np.fromiter(conv.room_out, np.int64)]] = True
        return bool(went[int(np.argmax(scores))])

    def _piece(self, tok: int) -> str:
        p = self._pieces.get(tok)
        if p is None:
            p = self._pieces[tok] = self.model.token_to_piece(int(tok), special=True).decode("utf-8", "replace")
        return p

    def _ranking_probe(self, held: np.ndarray, tokens: np.ndarray, probe, question: list[int] | None, room: dict):
        """The probe whose queries rank the held cells. With a question: its tokens are decoded right after
        the held cells with the probe armed (as many as free cells allow), read, and removed again: the
        cache is as before. Otherwise (or with no free cell): `probe` if its queries are still held, else the
        conversation's newest W tokens re-decoded with the probe armed."""
        ctx = self.ctx
        pos0 = ctx.seq_pos_max(0) + 1
        n = min(len(question or ()), ctx.n_ctx - 1 - int(held.size))
        if n > 0 and pos0 + n < self.pos_limit:
            t0 = time.perf_counter()
            try:
                ctx.page.arm_probe(0, TOP_K)
                ctx.decode(list(question[-n:]), pos0, 0)
                probe = ctx.page.read_probe()
            except BaseException:
                ctx.page.disarm_probe()
                raise
            finally:
                ctx.seq_rm(0, pos0, -1)  # never kept
            room["probes"] += 1
            room["probe_ms"] += (time.perf_counter() - t0) * 1e3
            room["ranking"] = "question"
            return probe
        room["ranking"] = room["ranking"] or "recent"
        if probe is None or not np.isin(probe.queries, held).all():
            win = window_of(held)  # re-decode the newest queries with the probe armed
            ctx.seq_rm(0, int(win[0]), -1)
            probe = self.pipeline.prefill(tokens[-win.size:].tolist(), int(win[0]), 0).probe
        return probe

    def for_answer(self, conv: Transcript, dec: Decision, reserve: int, start: int, rules: RoomRules) -> bool:
        """Make room while the answer is generated, from earlier turns only: the message it answers
        (history[start:]) and the answer so far are never evicted. True when there is room for one more
        token; False when nothing else can go (the answer then ends, finish "context")."""
        room = _room()
        try:
            self.make_room(conv, 1, room, rules, floor=conv.pos[start] if start < len(conv.pos) else None,
                           want=reserve)
        except ContextFull:
            return False
        self.close_gaps(conv, reserve, room)
        tell_room(dec, room, add=True)
        return self.ctx.cells_used(0) + 1 <= self.ctx.n_ctx and self.ctx.seq_pos_max(0) + 1 < self.pos_limit

    def close_gaps(self, conv: Transcript, need: int, room: dict) -> None:
        """Renumber the held cells 0..n-1 when `need` more positions would pass the trained context."""
        ctx = self.ctx
        if ctx.seq_pos_max(0) + 1 + need < self.pos_limit or not ctx.can_shift():
            return
        held = ctx.page.positions(0)
        for p0, p1, delta in gap_runs(held):
            ctx.seq_add(0, p0, p1, delta)
        room["closed"] += int(held[-1]) + 1 - int(held.size) if held.size else 0
        conv.pos = renumber(np.asarray(conv.pos, dtype=np.int64), held).tolist()


def select_kept(ev, cand: np.ndarray, n: int, probe, spans: np.ndarray | None, seed: int,
                prior: np.ndarray | None = None) -> tuple[np.ndarray, EvictionInput | None]:
    """(i32 (min(n, len(cand)),): the cells of cand (ascending positions) that evictor ev keeps, n of them,
    ranked by probe; the evictor's input, None when n <= 0). spans: i64 (len(cand),) for an evictor that needs
    them; prior: f64 (len(cand),), each cell's best earlier score (EvictionInput.prior)."""
    if n <= 0:
        return np.zeros(0, np.int32), None
    inp = EvictionInput(held=cand, budget=n, window=np.zeros(0, np.int32), n_sink=0, probe=probe, spans=spans,
                        prior=prior, seed=seed)
    return ev.select(inp), inp


def tell_room(dec: Decision, room: dict, add: bool = False) -> None:
    """Copy what room-making did into the Decision (add: on top of what the prefill did)."""
    if add:
        dec.room_evicted += room["evicted"]
        dec.gaps_closed += room["closed"]
        if room["from"] is not None:
            f = dec.room_from
            dec.room_from = room["from"] if f is None else (min(f[0], room["from"][0]), max(f[1], room["from"][1]))
    else:
        dec.room_evicted, dec.chunks, dec.gaps_closed = room["evicted"], room["chunks"], room["closed"]
        dec.room_from = room["from"]
    dec.room_ranking = dec.room_ranking or room["ranking"]
    dec.room_probe_ms += room["probe_ms"]


def _room() -> dict:
    """What one room-making did: cells evicted, parts, positions closed, the range evicted, how the cells
    were ranked and what the question's probe decodes cost. best: history index -> the best score the message's
    question gave it at a cut; query: the question's text for the lexical ranking, words_ms what that ranking took."""
    return {"evicted": 0, "chunks": 1, "closed": 0, "from": None, "ranking": None, "probes": 0, "probe_ms": 0.0,
            "best": {}, "query": "", "words_ms": 0.0}

"""eval longdoc's documents: facts, their questions, and the generated-sentence documents that hold them.

A document holds FACTS facts, one in each quarter of its depth (DEPTHS), each of its own kind (KINDS, in a drawn
order): "The door code for the {name} office is {code}.", "The vault combination for the {name} archive is {code}."...
(4-digit codes). Each fact is a question, "What is the door code for the {name} office?". build_document's text is
generated prose (tasks.synthetic's essay sentences); eval/longdoc_prose.py builds the same facts into real prose.
Apart from eval/longdoc.py (the run) so that both builders share them without importing the run.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Callable

from page_local.eval.conversations import _document, _prose
from page_local.tasks import synthetic

FACTS = 4  # facts (and questions) per document: one in each quarter of its depth
DEPTHS = ((0.05, 0.25), (0.3, 0.5), (0.55, 0.75), (0.8, 0.95))
INTRO = "Read this document. I will ask you about the codes in it.\n\n"
# (what, where): the fact "The {what} for the {name} {where} is {code}." and its question
KINDS = (("door code", "office"), ("vault combination", "archive"), ("locker number", "gym"),
         ("alarm code", "warehouse"))
FACT = "The {what} for the {name} {where} is {code}."
QUESTION = "What is the {what} for the {name} {where}?"


@dataclass(frozen=True)
class Fact:
    what: str
    name: str
    where: str
    code: str
    depth: float  # where in the document: sentence index / sentences


@dataclass(frozen=True)
class Document:
    index: int
    n_tokens: int  # the planned prompt: length x n_ctx
    text: str  # the document, without the question
    facts: tuple[Fact, ...]
    questions: tuple[str, ...] = ()  # each fact's question; () -> QUESTION (generated documents)
    paraphrased: tuple[bool, ...] = ()  # which questions do not repeat their fact's words (eval/longdoc_prose.py)
    source: str = ""  # the real text a prose document was cut from: "kind/file:paragraph"

    def question(self, q: int) -> str:
        return self.questions[q] if self.questions else QUESTION.format(**self.facts[q].__dict__)

    def message(self, q: int) -> str:
        return INTRO + self.text + "\n\n" + self.question(q)


def doc_rng(seed: int, *parts) -> random.Random:
    digest = hashlib.sha256("|".join(map(str, ("longdoc", seed) + parts)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def fact_names(rng: random.Random) -> tuple[list[str], list[str], list[tuple[str, str]], list[float]]:
    """A document's facts as drawn from its rng (in this order, which fixes every document): the places' names,
    the 4-digit codes, the kinds (what, where) and the depths, one of each per fact."""
    names: list[str] = []
    while len(names) < FACTS:
        name = f"{rng.choice(synthetic.ADJECTIVES)} {rng.choice(synthetic.NOUNS)}"
        if name not in names:
            names.append(name)
    codes = [str(c) for c in rng.sample(range(1000, 10000), FACTS)]
    kinds = rng.sample(KINDS, FACTS)
    depths = [rng.uniform(lo, hi) for lo, hi in DEPTHS]
    return names, codes, kinds, depths


def build_document(index: int, n_tokens: int, count_tokens: Callable[[str], int],
                   measure: Callable[[str], int], seed: int = 42) -> Document:
    """Document `index` of a prompt of about n_tokens tokens (a pure function of the arguments; the same
    index at the same size is the same document at any n_ctx). count_tokens: text -> tokens (sizes the
    prose); measure: a message -> tokens of its rendered chat prompt (sizes the markup and the question)."""
    if n_tokens < 64:
        raise ValueError(f"a document needs n_tokens >= 64, got {n_tokens!r}")
    rng = doc_rng(seed, index)
    names, codes, kinds, depths = fact_names(rng)
    needles = [FACT.format(what=k[0], name=n, where=k[1], code=c) for k, n, c in zip(kinds, names, codes)]

    def make(prose_tokens: int) -> Document:
        sents = _prose(prose_tokens, index, count_tokens, seed) if prose_tokens > 0 else []
        text, placed = _document(sents, needles, depths)
        facts = tuple(Fact(k[0], n, k[1], c, round(p, 3)) for k, n, c, p in zip(kinds, names, codes, placed))
        return Document(index, n_tokens, text, facts)

    bare = make(0)
    overhead = max(measure(bare.message(q)) for q in range(FACTS))
    return make(max(0, n_tokens - overhead))

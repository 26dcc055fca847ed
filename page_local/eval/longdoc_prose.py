"""eval longdoc on real prose (issue 57, item 1): the same facts and questions, a real text around them, and half of
the questions paraphrased.

A document here (build_prose_document) is a passage of a real text (tasks/realtext.py: Debian's licences, the Python
tutorial and HOWTOs, GNU manuals; the kind goes round with the document's index, KINDS[index % 3], the place in it
is drawn from the seed) of `length` x n_ctx tokens, with eval longdoc's four facts (longdoc.FACT, one kind each, one
in each quarter of the depth) put between its sentences, inside its paragraphs. On generated sentences a fact is
the one sentence unlike the others; in real prose many sentences compete for the question's attention (SmolLM2 at
4x n_ctx 512 on essays: room 7 of 16 where the full cache answered 16).

Paraphrased questions (PARAPHRASES; half of each document's questions, drawn by the seed): the question names the
fact's place by its name and says neither the kind's words nor the place's ("Which digits are on the storage cubby
at the crisp anchor fitness centre?" for "The locker number for the crisp anchor gym is 7987."), so that a ranking by
the question's words is not measured only on its easiest case: the name is all it shares with the fact.
"""

from __future__ import annotations

from typing import Callable

from page_local.eval.longdoc_docs import FACT, FACTS, QUESTION, Document, Fact, doc_rng, fact_names
from page_local.tasks import realtext

TEXT_KINDS = realtext.KINDS


def text_kind(index: int) -> str:
    """The kind of real text document `index` is made of: the kinds go round with the index."""
    return TEXT_KINDS[index % len(TEXT_KINDS)]


# per fact kind (longdoc.KINDS: what, where), questions that share only the name with the fact: neither the kind's
# words ("door", "code", "locker", ...) nor the place's ("office", "gym", ...)
PARAPHRASES: dict[tuple[str, str], tuple[str, ...]] = {
    ("door code", "office"): ("Which digits let a visitor through the entrance of the {name} workplace?",
                              "What must be keyed in to get into the {name} bureau?"),
    ("vault combination", "archive"): ("Which digits open the strongroom of the {name} records store?",
                                       "What must be dialled to unlock the safe at the {name} repository?"),
    ("locker number", "gym"): ("Which digits are on the storage cubby at the {name} fitness centre?",
                               "What figure is painted on my cubby at the {name} health club?"),
    ("alarm code", "warehouse"): ("Which digits silence the siren at the {name} depot?",
                                  "What disarms the security system of the {name} storehouse?"),
}
PARAPHRASED = FACTS // 2  # questions of each document asked in other words


def paraphrase(fact: Fact, seed: int, doc: int) -> str:
    """One of PARAPHRASES for the fact's kind, drawn by (seed, doc, the fact's kind): deterministic."""
    options = PARAPHRASES.get((fact.what, fact.where))
    if options is None:
        raise ValueError(f"no paraphrase for a fact of kind {(fact.what, fact.where)!r}")
    return doc_rng(seed, "paraphrase", doc, fact.what).choice(options).format(name=fact.name)


def place(paragraphs: list[list[str]], needles: list[str], depths: list[float]) -> tuple[str, list[float]]:
    """The paragraphs (lists of sentences) with each needle put after the sentence at its depth (a share of the
    sentences), inside that sentence's paragraph; paragraphs joined by blank lines. (text, the depths as placed)."""
    n = sum(len(p) for p in paragraphs)
    # the needles' slots: after sentence round(depth * n) - 1 (0: before the first), in depth order
    slots = sorted((min(n, max(0, round(d * n))), i) for i, d in enumerate(depths))
    placed = [0.0] * len(needles)
    out_paras, k, j = [], 0, 0
    for para in paragraphs:
        sents = []
        for s in para:
            while j < len(slots) and slots[j][0] == k:
                sents.append(needles[slots[j][1]])
                placed[slots[j][1]] = k / max(1, n)
                j += 1
            sents.append(s)
            k += 1
        out_paras.append(sents)
    if not out_paras:
        out_paras.append([])
    for _, i in slots[j:]:  # after the last sentence
        out_paras[-1].append(needles[i])
        placed[i] = 1.0
    return "\n\n".join(" ".join(p) for p in out_paras), placed


def build_prose_document(index: int, n_tokens: int, count_tokens: Callable[[str], int],
                         measure: Callable[[str], int], seed: int = 42) -> Document:
    """Document `index` of a prompt of about n_tokens tokens on real prose (a pure function of the arguments and the
    texts on the machine: the same index at the same size is the same document at any n_ctx). The facts, their kinds
    and depths are eval longdoc's for the same (index, seed); PARAPHRASED of the four questions are paraphrased.
    realtext.TextMissing when the text of this document's kind is not on the machine."""
    if n_tokens < 64:
        raise ValueError(f"a document needs n_tokens >= 64, got {n_tokens!r}")
    rng = doc_rng(seed, index)
    names, codes, kinds, depths = fact_names(rng)
    needles = [FACT.format(what=k[0], name=n, where=k[1], code=c) for k, n, c in zip(kinds, names, codes)]
    kind = text_kind(index)
    start = doc_rng(seed, "prose", index).random()
    para_q = set(doc_rng(seed, "paraphrased", index).sample(range(FACTS), PARAPHRASED))

    def make(prose_tokens: int) -> Document:
        where, paras = realtext.passage(kind, start, prose_tokens, count_tokens) if prose_tokens > 0 else ("", [])
        text, placed = place(paras, needles, depths)
        facts = tuple(Fact(k[0], n, k[1], c, round(p, 3)) for k, n, c, p in zip(kinds, names, codes, placed))
        questions = tuple(paraphrase(f, seed, index) if q in para_q else QUESTION.format(**f.__dict__)
                          for q, f in enumerate(facts))
        return Document(index, n_tokens, text, facts, questions=questions,
                        paraphrased=tuple(q in para_q for q in range(FACTS)), source=f"{kind}/{where}")

    bare = make(0)
    overhead = max(measure(bare.message(q)) for q in range(FACTS))
    return make(max(0, n_tokens - overhead))

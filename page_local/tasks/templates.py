"""RULER's prompt format (docs/algorithms.md §6): the templates and answer prefixes of each task family, the
anchors that split a RULER input into context, question and answer prefix, and the family of a task name.
Data and string functions only: the generators (tasks/builders.py) and the readers of existing RULER builds
(tasks/readers.py) share them.
"""

from __future__ import annotations

import re

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
NIAH_TEMPLATE = (
    "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_v} afterwards.\n{context}\n"
    "What are all the special magic {type_v} for {query} mentioned in the provided text?")
NIAH_ANSWER_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text are"
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.")
VT_ANSWER_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, "
                    "{num_v} variables are assigned the value {query}, they are: ")
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?")
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
    "ignore the dots '....'. What are the three most frequently appeared words in the above coded "
    "text?")
FWE_ANSWER_PREFIX = (" Answer: According to the coded text above, the three most frequently "
                     "appeared words are:")
PROSE_INSTRUCTION = "Read the following text."
PROSE_QUESTION = "Summarize the text above in a few sentences."

# Where the question starts (last match) and the answer prefix starts (first match after it):
# the same anchors as kvpress's evaluation/benchmarks/ruler/create_huggingface_dataset.py.
QUESTION_PATTERNS = {
    "niah": re.compile(r"What (?:is|are all) the special magic"),
    "vt": re.compile(r"Question: Find all variables that are assigned the value"),
    "cwe": re.compile(r"Question: What are the 10 most common words in the above list\?"),
    "fwe": re.compile(r"Question: Do not provide any explanation\."),
    "qa": re.compile(r"Answer the question based on the given documents\."),
}
ANSWER_PATTERNS = {
    "niah": re.compile(r"The special magic"),
    "vt": re.compile(r"Answer:"),
    "cwe": re.compile(r"Answer:"),
    "fwe": re.compile(r"Answer:"),
    "qa": re.compile(r"Answer:"),
}
FAMILY_MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32, "prose": 64}


def niah_singular(text: str) -> str:
    """RULER's switch to the singular when exactly one value is asked for (niah.py), verbatim."""
    return (text.replace("Some", "A").replace("are all", "is").replace("are", "is")
            .replace("answers", "answer"))


def family(task: str) -> str | None:
    """'niah' | 'vt' | 'cwe' | 'fwe' | 'qa' | 'prose' for a RULER-style task name, else None."""
    head = str(task).split("_")[0]
    if head in FAMILY_MAX_NEW_TOKENS:
        return head
    return {"variable": "vt", "common": "cwe", "freq": "fwe"}.get(head)


def metric_for(task: str) -> str:
    """RULER's metric: string_match_part for qa_*, string_match_all for everything else."""
    return "part" if family(task) == "qa" else "all"


def split_ruler_input(text: str, fam: str) -> tuple[str, str, str]:
    """(context, question, answer_prefix) of a RULER input; answer_prefix is '' when absent.

    The question starts at the last match of QUESTION_PATTERNS[fam] (few-shot examples repeat it);
    the prefix at the first ANSWER_PATTERNS[fam] match after that, keeping RULER's leading space.
    ValueError when the question anchor is missing.
    """
    if fam not in QUESTION_PATTERNS:
        raise ValueError(f"no RULER question pattern for task family {fam!r}")
    matches = list(QUESTION_PATTERNS[fam].finditer(text))
    if not matches:
        raise ValueError(f"no {fam} question found (pattern {QUESTION_PATTERNS[fam].pattern!r})")
    q0 = matches[-1].start()
    context, rest = text[:q0], text[q0:]
    m = ANSWER_PATTERNS[fam].search(rest)
    if m is None:
        return context, rest, ""
    a0 = m.start()
    while a0 > 0 and rest[a0 - 1] in " \t":
        a0 -= 1
    return context, rest[:a0], rest[a0:]

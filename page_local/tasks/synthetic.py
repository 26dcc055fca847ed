"""RULER synthetic tasks generated locally with no external data (NVIDIA/RULER; docs/algorithms.md §6).

A task instance is a pure function of (task, index, seed, target length): every sample draws from
its own RNG, seeded from those values, so `generate(t, 10, ...)[3]` equals `generate(t, 1, ...,
start=3)[0]`. Length control follows RULER: the haystack size (lines, words, or the Zipf total) is
searched so that count_tokens(sample.text()) + max_new_tokens <= target_tokens, with the caller's
tokenizer (tests pass a whitespace counter; the runner passes the model's tokenizer).

Tasks (RULER's generators, templates and answer prefixes; `TASKS` below):
* niah_single_1   noise haystack, word key, one 7-digit number
* niah_multikey_2 needle haystack: every line is a distractor "One of the special magic numbers
                  for {key} is: {value}." with a word key (never the queried key)
* niah_multikey_3 needle haystack with UUID keys and UUID values
* niah_multivalue 1 key, 4 values;  niah_multiquery 4 keys, all 4 queried.  DEVIATION: RULER puts
                  these two on the Paul Graham essay haystack; here they use the noise haystack,
                  because the essays are external data.
* niah_single_2, niah_multivalue_essay, niah_multiquery_essay: the same needles in an essay-like
                  haystack of generated prose (the pilot's sentence grammar; no two lines alike)
* vt              1 chain, 4 hops, noise haystack, one in-context example (RULER builds it at 500
                  tokens; here at min(500, target_tokens // 3) so that short targets still fit)
* cwe             numbered word list, 10 common words x 30 and the rest x 3 with a 40-word
                  few-shot example (10/3); 6/1 with a 20-word example (3/1) below 4096 tokens
* fwe             Zipf (alpha = 2) counts over random 6-letter words; rank 1 is replaced by "...";
                  answers = ranks 2-4
* prose           unlabeled pilot text (generated sentences + a summarise request) for calibration

Word lists (RULER uses the `wonderwords` package, which is not a dependency here): ~270 adjectives,
~280 nouns and ~220 verbs, common English words written into tasks/words.py. NIAH word keys are
"adjective-noun" pairs from them. The cwe pool is those words, deduplicated, minus every word that
is a substring of another pool word or of the cwe prompt (so that substring scoring cannot give
credit for a different word; RULER does not filter), extended when a long context needs more by
deterministic pronounceable pseudo-words (CV CV CV; RULER falls back to a bundled word list).

Other deviations, all whitespace or wording: `Sample.text()` joins context and question with a
blank line (RULER: one newline); the vt example is separated from the task by one blank line; the
vt answer prefix says "assigned" as docs/algorithms.md §6.3 does (RULER's constants.py has the typo "assgined").

Where the parts live (every name below is importable from here too, as callers have always done):
* tasks/templates.py  RULER's templates, answer prefixes and question anchors; family(), split_ruler_input()
* tasks/words.py      the word lists, pseudo-words and the prose grammar (data)
* tasks/sample.py     Sample, the prompt every task yields
* tasks/builders.py   one builder per RULER family (niah, vt, cwe, fwe, prose)
* tasks/fit.py        the search for the largest haystack that fits the target length
* this module         the task table (TASKS), the pilot mix, and generate() / pilot_prompts()
A new task is a row in TASKS (a builder from builders.py, or a new one there).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from page_local.tasks import builders
from page_local.tasks.builders import (CWE_SMALL_BELOW, ZETA_2, ZIPF_ALPHA, Env, cwe_real_words,
                                       rng_for)
from page_local.tasks.fit import CountTokens, fit
from page_local.tasks.sample import METRICS, Sample
from page_local.tasks.templates import (ANSWER_PATTERNS, CWE_ANSWER_PREFIX, CWE_TEMPLATE,
                                        FAMILY_MAX_NEW_TOKENS, FWE_ANSWER_PREFIX, FWE_TEMPLATE, NEEDLE,
                                        NIAH_ANSWER_PREFIX, NIAH_TEMPLATE, NOISE, PROSE_INSTRUCTION,
                                        PROSE_QUESTION, QUESTION_PATTERNS, VT_ANSWER_PREFIX, VT_TEMPLATE,
                                        family, metric_for, niah_singular, split_ruler_input)
from page_local.tasks.words import ADJECTIVES, NOUNS, VERBS, pseudo_words

# the names callers import from here; they live in the modules above
__all__ = [
    "ADJECTIVES", "ANSWER_PATTERNS", "CWE_ANSWER_PREFIX", "CWE_SMALL_BELOW", "CWE_TEMPLATE", "CountTokens",
    "FAMILY_MAX_NEW_TOKENS", "FWE_ANSWER_PREFIX", "FWE_TEMPLATE", "METRICS", "NEEDLE", "NIAH_ANSWER_PREFIX",
    "NIAH_TEMPLATE", "NOISE", "NOUNS", "PILOT_MIX", "PROSE_INSTRUCTION", "PROSE_QUESTION", "QUESTION_PATTERNS",
    "Sample", "TASKS", "TaskSpec", "UUID_MIN_NEW_TOKENS", "VERBS", "VT_ANSWER_PREFIX", "VT_TEMPLATE", "ZETA_2",
    "ZIPF_ALPHA", "cwe_real_words", "family", "generate", "get_task", "metric_for", "niah_singular",
    "pilot_prompts", "pseudo_words", "split_ruler_input",
]

UUID_MIN_NEW_TOKENS = 48  # a UUID is 33-36 SmolLM2 tokens (docs/design.md §10, practicalities)


@dataclass(frozen=True)
class TaskSpec:
    """A row of TASKS: `build(rng, size, env)` (tasks/builders.py) makes one instance for a haystack of `size`
    units; generate() fits `size` to the target length."""

    name: str
    family: str
    max_new_tokens: int
    min_new_tokens: int  # the smallest decode budget that can hold the answer
    min_size: int  # smallest haystack size the generator accepts
    labeled: bool
    description: str
    build: Callable = field(repr=False, compare=False)

    @property
    def metric(self) -> str:
        return metric_for(self.name)


# --- the tasks -------------------------------------------------------------------------------

def _spec(name, fam, build, min_size, description, labeled=True, min_new=1):
    return TaskSpec(name=name, family=fam, max_new_tokens=FAMILY_MAX_NEW_TOKENS[fam],
                    min_new_tokens=min_new, min_size=min_size, labeled=labeled,
                    description=description, build=build)


TASKS: dict[str, TaskSpec] = {s.name: s for s in (
    _spec("niah_single_1", "niah", builders.niah("noise", "words", "numbers", 1, 1, 1), 1,
          "one word key -> 7-digit number in the noise haystack"),
    _spec("niah_multikey_2", "niah", builders.niah("needle", "words", "numbers", 1, 1, 1), 1,
          "word key -> number among distractor needles on every line"),
    _spec("niah_multikey_3", "niah", builders.niah("needle", "uuids", "uuids", 1, 1, 1), 1,
          "UUID key -> UUID among distractor needles on every line", min_new=UUID_MIN_NEW_TOKENS),
    _spec("niah_multivalue", "niah", builders.niah("noise", "words", "numbers", 1, 4, 1), 4,
          "one key, 4 values, noise haystack (RULER: essay)"),
    _spec("niah_multiquery", "niah", builders.niah("noise", "words", "numbers", 4, 1, 4), 4,
          "4 keys, all queried, noise haystack (RULER: essay)"),
    # RULER's essay haystack is external data (Paul Graham essays); these use generated prose instead
    _spec("niah_single_2", "niah", builders.niah("prose", "words", "numbers", 1, 1, 1), 1,
          "one word key -> 7-digit number in an essay-like (generated prose) haystack"),
    _spec("niah_multivalue_essay", "niah", builders.niah("prose", "words", "numbers", 1, 4, 1), 4,
          "one key, 4 values, essay-like haystack (RULER's niah_multivalue)"),
    _spec("niah_multiquery_essay", "niah", builders.niah("prose", "words", "numbers", 4, 1, 4), 4,
          "4 keys, all queried, essay-like haystack (RULER's niah_multiquery)"),
    _spec("vt", "vt", builders.vt, 5, "variable tracking: 1 chain of 4 hops, one in-context example"),
    _spec("cwe", "cwe", builders.cwe, 11, "10 most common words of a numbered list"),
    # 80: the smallest Zipf total where ranks 2-5 all have distinct counts
    _spec("fwe", "fwe", builders.fwe, 80, "3 most frequent coded words (Zipf, rank 1 = '...')"),
    _spec("prose", "prose", builders.prose, 1, "unlabeled generated prose + a summarise request",
          labeled=False),
)}

PILOT_MIX = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "fwe", "prose")


# --- generation --------------------------------------------------------------------------------

def _one(spec: TaskSpec, index: int, env: Env) -> Sample:
    def make(size: int) -> Sample:
        context, question, prefix, answers, meta = spec.build(
            rng_for(env.seed, spec.name, index, env.salt), size, env)
        return Sample(task=spec.name, index=index, context=context, question=question,
                      answer_prefix=prefix, answers=answers, max_new_tokens=env.max_new_tokens,
                      metric=spec.metric, seed=env.seed,
                      meta={**meta, "size": size, "target_tokens": env.target_tokens})
    sample, tokens = fit(make, Sample.text, spec.min_size, env.target_tokens - env.max_new_tokens,
                          env.count_tokens, spec.name)
    return replace(sample, length=tokens)


def _check_int(name: str, v, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    return v


def get_task(task: str) -> TaskSpec:
    try:
        return TASKS[task]
    except (KeyError, TypeError):
        raise ValueError(f"unknown task {task!r}; generated tasks: {', '.join(TASKS)}") from None


def generate(task: str, n: int, target_tokens: int, count_tokens: CountTokens, seed: int = 42,
             *, max_new_tokens: int | None = None, start: int = 0) -> list[Sample]:
    """Samples start..start+n-1 of `task`, each with the largest haystack such that
    count_tokens(sample.text()) + max_new_tokens <= target_tokens (sample.length = that count).

    max_new_tokens: defaults to the task's (niah 128, vt 30, cwe 120, fwe 50, prose 64); UUID tasks
    refuse fewer than 48. ValueError for an unknown task, bad sizes, or a target too small.
    count_tokens sees text() (no chat markup): a chat runner adds its template's fixed overhead
    inside count_tokens, or lowers target_tokens by it.
    """
    spec = get_task(task)
    _check_int("n", n, 0)
    _check_int("start", start, 0)
    _check_int("seed", seed, 0)
    new = spec.max_new_tokens if max_new_tokens is None else _check_int("max_new_tokens",
                                                                         max_new_tokens, 1)
    if new < spec.min_new_tokens:
        raise ValueError(f"{task} needs max_new_tokens >= {spec.min_new_tokens}, got {new}")
    if _check_int("target_tokens", target_tokens, 1) <= new:
        raise ValueError(f"target_tokens={target_tokens} leaves no room for the prompt next to "
                         f"max_new_tokens={new}")
    if not callable(count_tokens):
        raise ValueError("count_tokens must be callable: str -> int")
    env = Env(target_tokens, new, count_tokens, seed, salt="eval")
    return [_one(spec, i, env) for i in range(start, start + n)]


def pilot_prompts(n: int, lengths, count_tokens: CountTokens, seed: int = 0) -> list[Sample]:
    """n unlabeled-use calibration prompts for `page-local calibrate`, cycling through PILOT_MIX
    (needle, multi-key numbers, multi-key UUIDs, vt, fwe, prose) and, every full cycle, the next
    of `lengths` (target tokens). Drawn from a separate RNG stream, so a pilot never repeats an
    evaluation sample even with the same seed."""
    _check_int("n", n, 0)
    _check_int("seed", seed, 0)
    lengths = [_check_int("length", t, 2) for t in lengths]
    if not lengths:
        raise ValueError("lengths must name at least one target length")
    if not callable(count_tokens):
        raise ValueError("count_tokens must be callable: str -> int")
    envs: dict[tuple[str, int], Env] = {}
    out = []
    for i in range(n):
        spec = TASKS[PILOT_MIX[i % len(PILOT_MIX)]]
        target = lengths[(i // len(PILOT_MIX)) % len(lengths)]
        env = envs.setdefault((spec.name, target), Env(target, spec.max_new_tokens, count_tokens,
                                                        seed, salt="pilot"))
        out.append(_one(spec, i, env))
    return out

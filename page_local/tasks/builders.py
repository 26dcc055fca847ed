"""The RULER-family builders (NVIDIA/RULER's generators; docs/algorithms.md §6): one per task family, each
`build(rng, size, env) -> (context, question, answer_prefix, answers, meta)` for a haystack of `size` units
(lines, words, or the Zipf total). tasks/synthetic.py names them in its TASKS table and fits `size` to a
target length (tasks/fit.py). Every random choice comes from `rng` (see rng_for), so an instance is a pure
function of its arguments.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
import string
import uuid
from dataclasses import dataclass
from typing import Callable

from page_local.tasks.fit import CountTokens, fit
from page_local.tasks.templates import (CWE_ANSWER_PREFIX, CWE_TEMPLATE, FWE_ANSWER_PREFIX, FWE_TEMPLATE,
                                        NEEDLE, NIAH_ANSWER_PREFIX, NIAH_TEMPLATE, NOISE, PROSE_INSTRUCTION,
                                        PROSE_QUESTION, VT_ANSWER_PREFIX, VT_TEMPLATE, niah_singular,
                                        split_ruler_input)
from page_local.tasks.words import ADJECTIVES, NOUNS, VERBS, pseudo_words, sentence

ZIPF_ALPHA = 2.0
ZETA_2 = math.pi ** 2 / 6  # zeta(ALPHA) for alpha = 2
CWE_SMALL_BELOW = 4096  # RULER switches cwe to 6/1 repetitions below this max_seq_length


# --- random pieces ---------------------------------------------------------------------------

def rng_for(seed: int, task: str, index: int, salt: str) -> random.Random:
    # sha256, not hash(): stable across processes and Python versions.
    digest = hashlib.sha256(f"{salt}|{task}|{seed}|{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _number(rng: random.Random) -> str:
    return str(rng.randint(10**6, 10**7 - 1))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _word_key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


_DRAW = {"words": _word_key, "numbers": _number, "uuids": _uuid}


def _distinct(draw: Callable[[], str], n: int, exclude: set[str] = frozenset()) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = draw()
        if v not in exclude and v not in out:
            out.append(v)
    return out


@functools.cache
def cwe_real_words() -> tuple[str, ...]:
    """The built-in words usable as cwe list entries: sorted, deduplicated, substring-free, and
    not inside the cwe prompt."""
    words = sorted(set(ADJECTIVES) | set(NOUNS) | set(VERBS))
    prompt = (CWE_TEMPLATE + CWE_ANSWER_PREFIX).lower()
    return tuple(w for w in words
                 if w not in prompt and not any(w != o and w in o for o in words))


def _unique_words(rng: random.Random, n: int) -> list[str]:
    real = cwe_real_words()
    if n <= len(real):
        return rng.sample(real, n)
    words = list(real) + list(pseudo_words(n - len(real)))
    rng.shuffle(words)
    return words


# --- task builders: build(rng, size, env) -> (context, question, answer_prefix, answers, meta) --

@dataclass
class Env:
    """What a builder knows of the run: the target length and decode budget, the tokenizer, the seed and the
    RNG stream's salt ("eval" or "pilot"); it keeps vt's in-context example, one per (seed, target)."""

    target_tokens: int
    max_new_tokens: int
    count_tokens: CountTokens
    seed: int
    salt: str
    _vt_icl: tuple[str, str] | None = None


def _split(text: str, fam: str):
    context, question, prefix = split_ruler_input(text, fam)
    return context.rstrip(), question.strip(), prefix


def _depths(lines: list[str], marked: list[str]) -> list[float]:
    where = {line: i for i, line in enumerate(lines)}
    return [where[m] / max(1, len(lines) - 1) for m in marked]


def niah(haystack: str, k_type: str, v_type: str, n_k: int, n_v: int, n_q: int):
    """The NIAH builder for one variant: haystack "noise" | "needle" (distractor needles) | "prose"; keys
    and values "words" | "numbers" | "uuids"; n_k keys with n_v values each, n_q of the keys queried."""
    def build(rng: random.Random, size: int, env: Env):
        keys = _distinct(lambda: _DRAW[k_type](rng), n_k)
        values = [_distinct(lambda: _DRAW[v_type](rng), n_v) for _ in keys]
        needles = [NEEDLE.format(type_v=v_type, key=k, value=v)
                   for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        if haystack == "noise":
            lines = [NOISE] * size
        elif haystack == "prose":  # an essay-like haystack: generated sentences, no two lines alike
            lines = [sentence(rng) for _ in range(size)]
        else:  # every line a distractor needle; never a real key, so the answer is unique
            real = set(keys)
            lines = [NEEDLE.format(type_v=v_type, key=_distinct(lambda: _DRAW[k_type](rng), 1,
                                                                real)[0],
                                   value=_DRAW[v_type](rng)) for _ in range(size)]
        for pos, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True),
                               needles):
            lines.insert(pos, needle)
        picked = rng.sample(range(n_k), n_q)
        queries = [keys[i] for i in picked]
        answers = [v for i in picked for v in values[i]]
        query = queries[0] if n_q == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
        template, prefix, type_v = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX, v_type
        if n_q * n_v == 1:
            template, prefix, type_v = niah_singular(template), niah_singular(prefix), v_type[:-1]
        text = (template.format(type_v=type_v, context="\n".join(lines), query=query)
                + prefix.format(type_v=type_v, query=query))
        meta = {"haystack": haystack, "keys": queries, "depths": _depths(lines, needles)}
        return (*_split(text, "niah"), answers, meta)
    return build


def _vt_instance(rng: random.Random, size: int, var_len: int, hops: int, avoid_value: str = ""):
    names = _distinct(lambda: "".join(rng.choices(string.ascii_uppercase, k=var_len)), hops + 1,
                      {"VAR"})
    value = str(rng.randint(10000, 99999))
    while value == avoid_value:
        value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} "
                                             for j in range(hops)]
    sentences = [NOISE + "\n"] * size
    for j, pos in enumerate(sorted(rng.sample(range(size), len(chain)))):
        sentences.insert(pos + j, chain[j])
    context = " ".join(sentences).replace(". \n", ".\n")
    text = (VT_TEMPLATE.format(context=context, query=value)
            + VT_ANSWER_PREFIX.format(num_v=hops + 1, query=value))
    return text, names, value, _depths(sentences, chain)


def _vt_icl(env: Env) -> tuple[str, str]:
    """RULER's in-context example: 3-letter names, same hops, its answer appended; one per
    (seed, target), fitted to min(500, target // 3) tokens like RULER's 500-token example."""
    if env._vt_icl is None:
        budget = min(500, env.target_tokens // 3) - env.max_new_tokens

        def make(size):
            text, names, value, _ = _vt_instance(rng_for(env.seed, "vt-icl", 0, env.salt), size, 3, 4)
            return text + " " + " ".join(names), value
        icl, _ = fit(make, lambda x: x[0], 5, budget, env.count_tokens, "vt example")
        env._vt_icl = icl
    return env._vt_icl


def vt(rng: random.Random, size: int, env: Env):
    icl_text, icl_value = _vt_icl(env)
    text, names, value, depths = _vt_instance(rng, size, 5, 4, avoid_value=icl_value)
    return (*_split(icl_text + "\n\n" + text, "vt"), names, {"value": value, "depths": depths})


def _cwe_list(rng: random.Random, n_words: int, freq_cw: int, freq_ucw: int, n_cw: int = 10):
    words = _unique_words(rng, n_words)
    common, uncommon = words[:n_cw], words[n_cw:]
    entries = common * freq_cw + uncommon * freq_ucw
    rng.shuffle(entries)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries)), common


def cwe(rng: random.Random, size: int, env: Env):
    small = env.target_tokens < CWE_SMALL_BELOW
    shot_ctx, shot_ans = _cwe_list(rng, *((20, 3, 1) if small else (40, 10, 3)))
    shot = (CWE_TEMPLATE.format(context=shot_ctx) + CWE_ANSWER_PREFIX + " "
            + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_ans)))
    ctx, answers = _cwe_list(rng, size, *((6, 1) if small else (30, 3)))
    text = shot + "\n" + CWE_TEMPLATE.format(context=ctx) + CWE_ANSWER_PREFIX
    return (*_split(text, "cwe"), answers, {"repetitions": [6, 1] if small else [30, 3]})


def fwe(rng: random.Random, size: int, env: Env):
    vocab_size = max(5, (env.target_tokens - env.max_new_tokens) // 50)
    vocab = _distinct(lambda: "".join(rng.choices(string.ascii_lowercase, k=6)), vocab_size)
    vocab[0] = "..."  # rank 1 is noise
    words = [w for k, w in enumerate(vocab, start=1)
             for _ in range(int(size * k ** -ZIPF_ALPHA / ZETA_2))]
    rng.shuffle(words)
    text = FWE_TEMPLATE.format(context=" ".join(words)) + FWE_ANSWER_PREFIX
    return (*_split(text, "fwe"), vocab[1:4], {"vocab_size": vocab_size})


def prose(rng: random.Random, size: int, env: Env):
    sentences = [sentence(rng) for _ in range(size)]
    paragraphs = [" ".join(sentences[i:i + 6]) for i in range(0, len(sentences), 6)]
    context = PROSE_INSTRUCTION + "\n\n" + "\n\n".join(paragraphs)
    return context, PROSE_QUESTION, "", [], {"sentences": size}

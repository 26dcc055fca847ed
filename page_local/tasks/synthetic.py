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
~280 nouns and ~220 verbs, common English words written into this module. NIAH word keys are
"adjective-noun" pairs from them. The cwe pool is those words, deduplicated, minus every word that
is a substring of another pool word or of the cwe prompt (so that substring scoring cannot give
credit for a different word; RULER does not filter), extended when a long context needs more by
deterministic pronounceable pseudo-words (CV CV CV; RULER falls back to a bundled word list).

Other deviations, all whitespace or wording: `Sample.text()` joins context and question with a
blank line (RULER: one newline); the vt example is separated from the task by one blank line; the
vt answer prefix says "assigned" as docs/algorithms.md §6.3 does (RULER's constants.py has the typo "assgined").
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
import re
import string
import uuid
from dataclasses import dataclass, field, replace
from typing import Callable

CountTokens = Callable[[str], int]
METRICS = ("all", "part")

# --- word lists ------------------------------------------------------------------------------

ADJECTIVES = tuple("""
able active agile alert amber ancient angry anxious arctic ashen autumn awake balmy bashful bold
bouncy brave breezy bright brisk broad bronze bubbly busy calm candid careful casual cheerful chilly
chubby civil classic clever cloudy clumsy coastal cold colorful cosmic cozy crafty creamy crisp
crooked crowded cuddly curious curly cute daily damp dapper daring dark dazzling deep dense dizzy
dreamy dusty eager early earnest easy elated elegant emerald empty endless epic even exotic faded
fair famous fancy fearless festive fierce fine firm flat fluffy foggy fond formal fragile frank free
fresh friendly frosty frozen funny fuzzy gentle giant gifted glad gleaming glossy golden graceful
grand grateful gray green grumpy handy happy hardy hasty healthy hearty heavy helpful hollow honest
humble hungry icy ideal idle jolly joyful juicy keen kind large lazy leafy lean light likely little
lively local lofty lonely long loud lovely loyal lucky lunar major merry mighty mild misty modern
modest moody muddy musical narrow nautical neat nervous nimble noble noisy normal odd old orange oval
pale patient peaceful perfect placid plain plucky plush polite proud purple quick quiet quirky
radiant rainy rapid rare ready regal rich rigid ripe rocky rosy rough round royal rural rustic rusty
sandy scarlet secret serene shaggy shallow sharp shiny short shy silent silky silver simple sleepy
slim slow small smooth snowy soft solar solid sour spicy spotless square stable steady steep sticky
stormy striped strong sturdy subtle sudden sunny super sweet swift tall tame tender thick thirsty
tidy tiny tired tough tranquil tropical true upbeat urban vast velvet vibrant violet vivid wacky warm
wary weary wild windy wise witty wooden woolly young zany zealous
""".split())

NOUNS = tuple("""
acorn actor airport almond anchor antelope apple apron arch arrow artist attic avenue badger bakery
balloon banana bandit barn basket beach beacon bear bed bell bicycle bird biscuit blanket boat bonnet
book boot bottle boulder bracelet bread bridge broom bucket buffalo butter button cabin cactus cake
camel camera canal candle canoe canyon captain carpet carrot castle cat cave cellar chair cheese
cherry chimney church circus city cliff cloud clover coat coconut coffee comet compass cookie copper
cottage cotton cow crayon cricket crown cup curtain cushion daisy dancer desert desk diamond dolphin
donkey door dragon drum eagle engine falcon farm feather fence ferry field fig flag flute forest fork
fountain fox frog garden garlic gate giraffe glacier glove goat goose grape guitar hammer harbor harp
hat hedge helmet hill honey horse island ivory jacket jaguar jelly jewel kettle kitchen kite koala
ladder lagoon lake lamp lantern lemon library lighthouse lion lizard llama lobster locket magnet
mango maple market meadow melon mirror mitten monkey moon mountain muffin museum napkin nest notebook
oasis ocean office olive onion orchard otter oven owl paddle palace pancake panda parrot peach pebble
pelican pencil pepper piano pickle pillow pirate planet plum pocket pond poppy potato puddle pumpkin
puzzle quilt rabbit raccoon radio raft raven ribbon river robot rocket saddle sailor salad salmon
sandal satchel saucer scarf school scooter seal shell ship shovel silo singer skate sled sloth snail
sparrow spider spoon squirrel stable stamp station statue stove street sugar summit sweater table
teacher teapot temple tent theater thimble tiger toast tomato tower tractor trumpet tulip tunnel
turtle umbrella valley vase village violin volcano wagon walnut walrus whale wheel whistle window
wizard wolf yacht zebra
""".split())

VERBS = tuple("""
accept admire adopt agree allow amuse appear applaud arrange arrive attach bake balance bathe beam
behave belong blink boil bounce breathe brush bubble build bump calculate carry carve celebrate
chase cheer chew chop clap climb coach collect comb compare compose connect cook copy count cover
crawl cross cycle dance decide decorate deliver describe design dig discover dive doodle drift drink
drive dust earn embrace enjoy enter escape examine explain explore fasten fetch fill film float flow
fold follow gather giggle glide glow grab greet grin guard guess guide gallop hike hop hover hug hum
hurry imagine improve invent invite jog join juggle jump kneel knit knock label land laugh launch
learn lift listen march marvel measure melt mend mix nod notice observe offer open order organize
pack paddle paint pause pedal peel perform plant play polish pour practice prepare print promise
protect pull push question race reach read relax remember repair repeat rescue rest return rinse
roam roll row rush sail save scatter scribble search settle sew shake share shine shiver shrug sing
sip sketch skip slide smile sneeze sniff snore sort sparkle spell spin splash sprint squeeze stack
stir stitch stretch stroll study swim swing tap taste teach tickle tidy toss trace travel tumble
twirl type unlock unpack visit wade wander wash watch wave weave whisper wiggle wink wonder wrap
write yawn yodel zoom
""".split())

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"

# --- RULER templates (docs/algorithms.md §6) ---------------------------------------------------

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
UUID_MIN_NEW_TOKENS = 48  # a UUID is 33-36 SmolLM2 tokens (docs/design.md §10, practicalities)
ZIPF_ALPHA = 2.0
ZETA_2 = math.pi ** 2 / 6  # zeta(ALPHA) for alpha = 2
CWE_SMALL_BELOW = 4096  # RULER switches cwe to 6/1 repetitions below this max_seq_length


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


# --- samples ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sample:
    """One evaluation prompt. `answers` are the references scored by `metric` (scoring.py).

    length: tokens of text() as counted by the generator's count_tokens (None when unknown).
    meta: task details, e.g. {"depths": [...]} (needle line index / (lines - 1)), "size".
    """

    task: str
    index: int
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    max_new_tokens: int
    metric: str = "all"
    length: int | None = None
    seed: int | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("task", "context", "question", "answer_prefix"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r:.80}")
        if not isinstance(self.answers, list) or not all(isinstance(a, str) for a in self.answers):
            raise ValueError(f"answers must be a list of strings, got {self.answers!r:.80}")
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {self.metric!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        for name in ("index", "length", "seed"):
            v = getattr(self, name)
            if (v is not None or name == "index") and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"{name} must be an int{'' if name == 'index' else ' or None'}, "
                                 f"got {v!r}")
        if not isinstance(self.meta, dict):
            raise ValueError(f"meta must be a dict, got {self.meta!r:.80}")

    def user_content(self) -> str:
        """Query-aware user turn: context, a blank line, the question (question at the end)."""
        q = self.question.strip()
        return self.context.rstrip() + "\n\n" + q if q else self.context.rstrip()

    def messages(self) -> tuple[str, str]:
        """(user_content, answer_prefix) for a chat template.

        The prefix opens the assistant turn (otherwise small models restate the question); it is
        stripped of RULER's surrounding spaces there, so the model emits the leading space itself.
        """
        return self.user_content(), self.answer_prefix.strip()

    def text(self) -> str:
        """The base-model prompt: user_content() + answer_prefix. Lengths are counted on this."""
        return self.user_content() + self.answer_prefix

    def query_agnostic(self) -> tuple[str, str]:
        """(context_only, question_and_prefix); they concatenate to text().

        For query-agnostic compression: prefill and compress the context, then append the rest.
        """
        ctx = self.context.rstrip()
        return ctx, self.text()[len(ctx):]

    def to_row(self) -> dict:
        """A kvpress-style row (context, question, answer_prefix, answer, task, max_new_tokens)
        plus this sample's other fields; readers.read_kvpress reads it back."""
        return {"context": self.context, "question": self.question,
                "answer_prefix": self.answer_prefix, "answer": list(self.answers),
                "task": self.task, "max_new_tokens": self.max_new_tokens, "index": self.index,
                "metric": self.metric, "length": self.length, "seed": self.seed,
                "meta": dict(self.meta)}


@dataclass(frozen=True)
class TaskSpec:
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


# --- random pieces ---------------------------------------------------------------------------

def _rng(seed: int, task: str, index: int, salt: str) -> random.Random:
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


@functools.cache
def pseudo_words(n: int) -> tuple[str, ...]:
    """n distinct pronounceable 6-letter pseudo-words (CV CV CV), deterministic, none containing
    or contained in a built-in word (equal length keeps them substring-free among themselves)."""
    real = sorted(set(ADJECTIVES) | set(NOUNS) | set(VERBS))
    contains_real = re.compile("|".join(map(re.escape, sorted(real, key=len, reverse=True))))
    inside_real = {w[i:i + 6] for w in real for i in range(len(w) - 5)}
    rng = random.Random("page-local pseudo-words")
    out: dict[str, None] = {}
    cap = (len(_CONSONANTS) * len(_VOWELS)) ** 3
    if n > cap // 2:
        raise ValueError(f"at most {cap // 2} pseudo-words, asked for {n}")
    while len(out) < n:
        w = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(3))
        if w not in out and w not in inside_real and not contains_real.search(w):
            out[w] = None
    return tuple(out)


def _unique_words(rng: random.Random, n: int) -> list[str]:
    real = cwe_real_words()
    if n <= len(real):
        return rng.sample(real, n)
    words = list(real) + list(pseudo_words(n - len(real)))
    rng.shuffle(words)
    return words


# --- task builders: build(rng, size, env) -> (context, question, answer_prefix, answers, meta) --

@dataclass
class _Env:
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


def _niah(haystack: str, k_type: str, v_type: str, n_k: int, n_v: int, n_q: int):
    def build(rng: random.Random, size: int, env: _Env):
        keys = _distinct(lambda: _DRAW[k_type](rng), n_k)
        values = [_distinct(lambda: _DRAW[v_type](rng), n_v) for _ in keys]
        needles = [NEEDLE.format(type_v=v_type, key=k, value=v)
                   for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        if haystack == "noise":
            lines = [NOISE] * size
        elif haystack == "prose":  # an essay-like haystack: generated sentences, no two lines alike
            lines = [_sentence(rng) for _ in range(size)]
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


def _vt_icl(env: _Env) -> tuple[str, str]:
    """RULER's in-context example: 3-letter names, same hops, its answer appended; one per
    (seed, target), fitted to min(500, target // 3) tokens like RULER's 500-token example."""
    if env._vt_icl is None:
        budget = min(500, env.target_tokens // 3) - env.max_new_tokens

        def make(size):
            text, names, value, _ = _vt_instance(_rng(env.seed, "vt-icl", 0, env.salt), size, 3, 4)
            return text + " " + " ".join(names), value
        icl, _ = _fit(make, lambda x: x[0], 5, budget, env.count_tokens, "vt example")
        env._vt_icl = icl
    return env._vt_icl


def _vt(rng: random.Random, size: int, env: _Env):
    icl_text, icl_value = _vt_icl(env)
    text, names, value, depths = _vt_instance(rng, size, 5, 4, avoid_value=icl_value)
    return (*_split(icl_text + "\n\n" + text, "vt"), names, {"value": value, "depths": depths})


def _cwe_list(rng: random.Random, n_words: int, freq_cw: int, freq_ucw: int, n_cw: int = 10):
    words = _unique_words(rng, n_words)
    common, uncommon = words[:n_cw], words[n_cw:]
    entries = common * freq_cw + uncommon * freq_ucw
    rng.shuffle(entries)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries)), common


def _cwe(rng: random.Random, size: int, env: _Env):
    small = env.target_tokens < CWE_SMALL_BELOW
    shot_ctx, shot_ans = _cwe_list(rng, *((20, 3, 1) if small else (40, 10, 3)))
    shot = (CWE_TEMPLATE.format(context=shot_ctx) + CWE_ANSWER_PREFIX + " "
            + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_ans)))
    ctx, answers = _cwe_list(rng, size, *((6, 1) if small else (30, 3)))
    text = shot + "\n" + CWE_TEMPLATE.format(context=ctx) + CWE_ANSWER_PREFIX
    return (*_split(text, "cwe"), answers, {"repetitions": [6, 1] if small else [30, 3]})


def _fwe(rng: random.Random, size: int, env: _Env):
    vocab_size = max(5, (env.target_tokens - env.max_new_tokens) // 50)
    vocab = _distinct(lambda: "".join(rng.choices(string.ascii_lowercase, k=6)), vocab_size)
    vocab[0] = "..."  # rank 1 is noise
    words = [w for k, w in enumerate(vocab, start=1)
             for _ in range(int(size * k ** -ZIPF_ALPHA / ZETA_2))]
    rng.shuffle(words)
    text = FWE_TEMPLATE.format(context=" ".join(words)) + FWE_ANSWER_PREFIX
    return (*_split(text, "fwe"), vocab[1:4], {"vocab_size": vocab_size})


_PROSE = (
    "The {a} {n} wanted to {v} the {a2} {n2} before the {n3} arrived.",
    "In the {a} {n}, {an_n2} {n2} tried to {v} every {n3}.",
    "Every morning the {n} and the {n2} {v} together near the {a} {n3}.",
    "{an_a} {a} {n} once asked {an_n2} {n2} how to {v} {an_n3} {n3}.",
    "Nobody could {v} the {n} because it looked so {a}.",
    "Later that day, the {a} {n} learned to {v} without {an_n2} {n2}.",
    "If you {v} the {n}, the {n2} becomes {a}.",
    "Some people {v} their {n} whenever the {n2} feels {a}.",
    "Near the old {n}, {an_a2} {a2} {n2} began to {v} quietly.",
)


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _sentence(rng: random.Random) -> str:
    """One generated sentence of prose (the unlabeled pilot's and the essay haystack's)."""
    w = {"a": rng.choice(ADJECTIVES), "a2": rng.choice(ADJECTIVES), "n": rng.choice(NOUNS),
         "n2": rng.choice(NOUNS), "n3": rng.choice(NOUNS), "v": rng.choice(VERBS)}
    w.update({f"an_{k}": _article(w[k]) for k in ("a", "a2", "n2", "n3")})
    s = rng.choice(_PROSE).format(**w)
    return s[0].upper() + s[1:]


def _prose(rng: random.Random, size: int, env: _Env):
    sentences = [_sentence(rng) for _ in range(size)]
    paragraphs = [" ".join(sentences[i:i + 6]) for i in range(0, len(sentences), 6)]
    context = PROSE_INSTRUCTION + "\n\n" + "\n\n".join(paragraphs)
    return context, PROSE_QUESTION, "", [], {"sentences": size}


def _spec(name, fam, build, min_size, description, labeled=True, min_new=1):
    return TaskSpec(name=name, family=fam, max_new_tokens=FAMILY_MAX_NEW_TOKENS[fam],
                    min_new_tokens=min_new, min_size=min_size, labeled=labeled,
                    description=description, build=build)


TASKS: dict[str, TaskSpec] = {s.name: s for s in (
    _spec("niah_single_1", "niah", _niah("noise", "words", "numbers", 1, 1, 1), 1,
          "one word key -> 7-digit number in the noise haystack"),
    _spec("niah_multikey_2", "niah", _niah("needle", "words", "numbers", 1, 1, 1), 1,
          "word key -> number among distractor needles on every line"),
    _spec("niah_multikey_3", "niah", _niah("needle", "uuids", "uuids", 1, 1, 1), 1,
          "UUID key -> UUID among distractor needles on every line", min_new=UUID_MIN_NEW_TOKENS),
    _spec("niah_multivalue", "niah", _niah("noise", "words", "numbers", 1, 4, 1), 4,
          "one key, 4 values, noise haystack (RULER: essay)"),
    _spec("niah_multiquery", "niah", _niah("noise", "words", "numbers", 4, 1, 4), 4,
          "4 keys, all queried, noise haystack (RULER: essay)"),
    # RULER's essay haystack is external data (Paul Graham essays); these use generated prose instead
    _spec("niah_single_2", "niah", _niah("prose", "words", "numbers", 1, 1, 1), 1,
          "one word key -> 7-digit number in an essay-like (generated prose) haystack"),
    _spec("niah_multivalue_essay", "niah", _niah("prose", "words", "numbers", 1, 4, 1), 4,
          "one key, 4 values, essay-like haystack (RULER's niah_multivalue)"),
    _spec("niah_multiquery_essay", "niah", _niah("prose", "words", "numbers", 4, 1, 4), 4,
          "4 keys, all queried, essay-like haystack (RULER's niah_multiquery)"),
    _spec("vt", "vt", _vt, 5, "variable tracking: 1 chain of 4 hops, one in-context example"),
    _spec("cwe", "cwe", _cwe, 11, "10 most common words of a numbered list"),
    # 80: the smallest Zipf total where ranks 2-5 all have distinct counts
    _spec("fwe", "fwe", _fwe, 80, "3 most frequent coded words (Zipf, rank 1 = '...')"),
    _spec("prose", "prose", _prose, 1, "unlabeled generated prose + a summarise request",
          labeled=False),
)}

PILOT_MIX = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "fwe", "prose")
_MAX_SIZE = 1 << 20


# --- length control --------------------------------------------------------------------------

def _fit(make, text_of, min_size: int, budget: int, count_tokens: CountTokens, what: str):
    """(make(size), tokens) for the largest size whose count_tokens(text_of(.)) <= budget: bracket
    a linear estimate from two small sizes, then bisect. Every instance is rebuilt from scratch,
    so the result depends only on the arguments. ValueError when even min_size does not fit."""
    seen: dict[int, tuple[int, object]] = {}

    def fits(size: int) -> bool:
        if size not in seen:
            obj = make(size)
            t = count_tokens(text_of(obj))
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"count_tokens must return a non-negative int, got {t!r}")
            seen[size] = (t, obj)
        return seen[size][0] <= budget

    lo, probe = min_size, 2 * min_size + 16
    if not fits(lo):
        raise ValueError(f"{what}: the smallest instance takes {seen[lo][0]} tokens, more than "
                         f"the {budget} available; raise target_tokens")
    if not fits(probe):
        hi = probe
    else:
        per_unit = (seen[probe][0] - seen[lo][0]) / (probe - lo)
        if per_unit <= 0:
            raise ValueError(f"{what}: count_tokens does not grow with the haystack")
        guess = min(probe + max(1, int((budget - seen[probe][0]) / per_unit)), _MAX_SIZE)
        step = max(1, guess // 64)
        if fits(guess):  # gallop up
            lo, hi = guess, min(guess + step, _MAX_SIZE)
            while fits(hi):
                if hi >= _MAX_SIZE:
                    raise ValueError(f"{what}: no haystack up to {_MAX_SIZE} reaches the target")
                lo, step = hi, step * 2
                hi = min(lo + step, _MAX_SIZE)
        else:  # gallop down; probe fits
            lo, hi = probe, guess
            while hi - step > lo:
                if fits(hi - step):
                    lo = hi - step
                    break
                hi, step = hi - step, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    t, obj = seen[lo]
    return obj, t


def _one(spec: TaskSpec, index: int, env: _Env) -> Sample:
    def make(size: int) -> Sample:
        context, question, prefix, answers, meta = spec.build(
            _rng(env.seed, spec.name, index, env.salt), size, env)
        return Sample(task=spec.name, index=index, context=context, question=question,
                      answer_prefix=prefix, answers=answers, max_new_tokens=env.max_new_tokens,
                      metric=spec.metric, seed=env.seed,
                      meta={**meta, "size": size, "target_tokens": env.target_tokens})
    sample, tokens = _fit(make, Sample.text, spec.min_size, env.target_tokens - env.max_new_tokens,
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
    env = _Env(target_tokens, new, count_tokens, seed, salt="eval")
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
    envs: dict[tuple[str, int], _Env] = {}
    out = []
    for i in range(n):
        spec = TASKS[PILOT_MIX[i % len(PILOT_MIX)]]
        target = lengths[(i // len(PILOT_MIX)) % len(lengths)]
        env = envs.setdefault((spec.name, target), _Env(target, spec.max_new_tokens, count_tokens,
                                                        seed, salt="pilot"))
        out.append(_one(spec, i, env))
    return out

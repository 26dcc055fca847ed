"""The vocabulary of the synthetic tasks (tasks/synthetic.py), written here as data, and the prose grammar.

RULER draws its words from the `wonderwords` package, which is not a dependency here: ~270 adjectives,
~280 nouns and ~220 verbs, common English words. NIAH word keys are "adjective-noun" pairs from them;
the cwe pool is built from them (builders.cwe_real_words) and extended, when a long context needs more,
by deterministic pronounceable pseudo-words (`pseudo_words`; RULER falls back to a bundled word list).
`sentence(rng)` writes one sentence of generated prose (the unlabeled pilot's and the essay haystack's).
"""

from __future__ import annotations

import functools
import random
import re

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


# --- generated prose -------------------------------------------------------------------------

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


def sentence(rng: random.Random) -> str:
    """One generated sentence of prose (the unlabeled pilot's and the essay haystack's)."""
    w = {"a": rng.choice(ADJECTIVES), "a2": rng.choice(ADJECTIVES), "n": rng.choice(NOUNS),
         "n2": rng.choice(NOUNS), "n3": rng.choice(NOUNS), "v": rng.choice(VERBS)}
    w.update({f"an_{k}": _article(w[k]) for k in ("a", "a2", "n2", "n3")})
    s = rng.choice(_PROSE).format(**w)
    return s[0].upper() + s[1:]

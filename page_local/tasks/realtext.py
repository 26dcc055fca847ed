"""Real prose from texts Debian machines carry: the haystacks of eval longdoc's real-prose documents (issue 57).

Generated sentences (tasks.synthetic's essay sentences) make a document in which a fact is the one sentence
unlike the others; in real prose many sentences compete for a question's attention, and what a user pastes is
real prose. Three kinds of text, each a fixed list of files so that a document is the same on every machine
that has them (SOURCES):

* "licenses"     the licenses in /usr/share/common-licenses (Debian's base-files: always present);
* "python-docs"  the Python tutorial and HOWTOs, from the HTML of Debian's python3-doc package (paragraphs,
                 list items and definitions of the page's main part, read with the standard library's
                 html.parser; code blocks left out);
* "gnu-manuals"  GNU manuals in Info format (/usr/share/info/*.info.gz, from the essential packages coreutils,
                 grep, sed, gzip, diffutils and findutils): the prose paragraphs of their nodes (examples,
                 menus, the index and the licence left out).

Not the Paul Graham essays that circulate in long-context benchmarks: they are kept aside for an independent
check. A text that is missing is said plainly, with the package that ships it (TextMissing), never a traceback.

Each text is read into paragraphs of sentences (a paragraph: list[str]); `passage` takes a run of them from a
drawn place, wrapping through the kind's files in their order. Pure reading: no model, no engine.
"""

from __future__ import annotations

import gzip
import re
from functools import lru_cache
from html.parser import HTMLParser
from pathlib import Path
from typing import Callable

LICENSES = Path("/usr/share/common-licenses")
PYTHON_HTML = Path("/usr/share/doc/python3/html")  # python3-doc's link to the versioned python3.X-doc HTML
INFO = Path("/usr/share/info")

# kind -> (folder, files in order, the package that ships them, how to install it)
SOURCES: dict[str, tuple[Path, tuple[str, ...], str]] = {
    "licenses": (LICENSES, ("GPL-3", "GPL-2", "LGPL-2.1", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "Artistic", "CC0-1.0"),
                 "base-files (apt-get install --reinstall base-files)"),
    "python-docs": (PYTHON_HTML, tuple(f"tutorial/{p}.html" for p in (
        "appetite", "interpreter", "introduction", "controlflow", "datastructures", "modules", "inputoutput", "errors",
        "classes", "stdlib", "stdlib2", "venv", "floatingpoint")) + tuple(f"howto/{p}.html" for p in (
            "sockets", "unicode", "sorting", "logging", "functional", "regex", "descriptor")),
        "python3-doc (apt-get update; apt-get install -y python3-doc)"),
    "gnu-manuals": (INFO, ("grep.info.gz", "sed.info.gz", "gzip.info.gz", "diffutils.info.gz", "find.info-1.gz",
                           "coreutils.info.gz"),
                    "the GNU manuals of coreutils, grep, sed, gzip, diffutils and findutils (apt-get install "
                    "--reinstall coreutils grep sed gzip diffutils findutils; a minimal image may exclude "
                    "/usr/share/info in /etc/dpkg/dpkg.cfg.d/)"),
}
KINDS = tuple(SOURCES)
MIN_WORDS = 8  # a paragraph of fewer words (a heading, a label, a line of a table) is not prose
# a sentence ends at a stop followed by spaces and a capital, a quote or a bracket: "e.g. the" stays whole
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"'\u201d\u2019)]?\s+(?=[A-Z\u2018\u201c\"'(])")
_SKIP_NODES = ("Top", "Index", "Copying", "GNU Free Documentation License", "Concept Index", "Option Index")


class TextMissing(ValueError):
    """A real text that eval longdoc's prose haystack reads is not on this machine; the message names the package."""


def sentences(paragraph: str) -> list[str]:
    """A paragraph's sentences (spaces collapsed); a paragraph with no stop is one sentence."""
    text = " ".join(paragraph.split())
    return [s for s in _SENTENCE_END.split(text) if s] if text else []


def _prose(paragraphs: list[str]) -> list[list[str]]:
    """The paragraphs that are prose (at least MIN_WORDS words, ending a sentence), as lists of sentences."""
    out = []
    for p in paragraphs:
        words = p.split()
        if len(words) >= MIN_WORDS and re.search(r"[.!?:][\"'\u201d\u2019)]?$", words[-1]):
            out.append(sentences(p))
    return out


def read_license(text: str) -> list[list[str]]:
    """A plain-text licence: paragraphs are separated by blank lines; lines are unwrapped."""
    return _prose([" ".join(b.split()) for b in re.split(r"\n\s*\n", text)])


class _MainText(HTMLParser):
    """The text of a Sphinx page's main part (div role=main): paragraphs, list items, definitions; code blocks
    (pre), the headings' pilcrow links and scripts left out."""

    BLOCKS = {"p", "li", "dd", "dt", "h1", "h2", "h3", "h4", "blockquote"}
    SKIP = {"pre", "script", "style"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.main_depth = 0  # > 0 inside the main div (counts nested divs)
        self.skip: list[str] = []  # the open tags whose text is left out
        self.buf: list[str] = []
        self.blocks: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "div":
            if self.main_depth:
                self.main_depth += 1
            elif a.get("role") == "main" or "body" in (a.get("class") or "").split():
                self.main_depth = 1
        if not self.main_depth:
            return
        if tag in self.SKIP or (tag == "a" and "headerlink" in (a.get("class") or "")):
            self.skip.append(tag)
        elif tag in self.BLOCKS:
            self._flush()

    def handle_endtag(self, tag):
        if not self.main_depth:
            return
        if self.skip and self.skip[-1] == tag:
            self.skip.pop()
        elif tag in self.BLOCKS:
            self._flush()
        if tag == "div":
            self.main_depth -= 1

    def handle_data(self, data):
        if self.main_depth and not self.skip:
            self.buf.append(data)

    def _flush(self):
        text = " ".join("".join(self.buf).split())
        if text:
            self.blocks.append(text)
        self.buf = []


def read_sphinx_html(html: str) -> list[list[str]]:
    """A page of Sphinx HTML (the Python documentation): the prose of its main part."""
    p = _MainText()
    p.feed(html)
    p.close()
    p._flush()
    return _prose(p.blocks)


def read_info(text: str) -> list[list[str]]:
    """A GNU Info manual: each node's prose paragraphs (lines indented by at most 3 spaces, unwrapped); the
    node headers, menus, underlines, examples (indented by 5) and the Top, index and licence nodes left out."""
    out: list[str] = []
    for node in text.split("\x1f"):
        lines = node.strip("\n").split("\n")
        head = lines[0] if lines else ""
        m = re.search(r"Node: ([^,]+)", head)
        if not m or m.group(1).strip() in _SKIP_NODES:
            continue
        # blank lines end a paragraph (the next line's indentation kept: it tells an example from prose)
        for block in re.split(r"\n[ \t]*\n", "\n".join(lines[1:])):
            rows = [r for r in block.split("\n") if r.strip()]
            if not rows or any(len(r) - len(r.lstrip(" ")) > 3 for r in rows) or rows[0].lstrip().startswith("*"):
                continue  # an example, a table or a menu
            if len(rows) == 2 and set(rows[1].strip()) <= set("*=-."):
                continue  # a heading and its underline
            out.append(" ".join(block.split()))
    return _prose(out)


READERS: dict[str, Callable[[str], list[list[str]]]] = {
    "licenses": read_license, "python-docs": read_sphinx_html, "gnu-manuals": read_info}


def _read_file(path: Path) -> str:
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
            return f.read()
    return path.read_text(encoding="utf-8", errors="replace")


def check_kind(kind: str) -> str:
    if kind not in SOURCES:
        raise ValueError(f"text kind must be one of {', '.join(KINDS)}; got {kind!r}")
    return kind


def missing(kind: str) -> list[Path]:
    """The files of `kind` this machine lacks ([] when every one is there)."""
    folder, files, _ = SOURCES[check_kind(kind)]
    return [folder / f for f in files if not (folder / f).is_file()]


def check_available(kinds=KINDS) -> None:
    """TextMissing naming each kind whose files are not all here and the package that ships them."""
    lines = []
    for k in kinds:
        gone = missing(k)
        if gone:
            lines.append(f"{k}: {len(gone)} of {len(SOURCES[k][1])} files missing (first: {gone[0]}); install "
                         f"{SOURCES[k][2]}")
    if lines:
        raise TextMissing("the real-prose haystack needs texts this machine lacks: " + "; ".join(lines))


@lru_cache(maxsize=None)
def library(kind: str) -> tuple[tuple[str, tuple[tuple[str, ...], ...]], ...]:
    """kind's texts in order: (file name, its paragraphs as tuples of sentences). TextMissing when one is absent."""
    check_available((check_kind(kind),))
    folder, files, _ = SOURCES[kind]
    out = []
    for name in files:
        paras = READERS[kind](_read_file(folder / name))
        if not paras:
            raise TextMissing(f"{folder / name} holds no prose paragraphs (is it the file {SOURCES[kind][2]} ships?)")
        out.append((name, tuple(tuple(p) for p in paras)))
    return tuple(out)


def passage(kind: str, start: float, n_tokens: int, count_tokens: Callable[[str], int]) -> tuple[str, list[list[str]]]:
    """(where it starts, "file:paragraph"; its paragraphs as lists of sentences): a run of kind's paragraphs of
    about n_tokens tokens (at least n_tokens, the last paragraph cut at a sentence), beginning at `start` in [0, 1)
    of the kind's paragraphs, wrapping through its files in order. count_tokens: text -> tokens."""
    if not 0 <= start < 1:
        raise ValueError(f"start must be in [0, 1), got {start!r}")
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
        raise ValueError(f"n_tokens must be an int >= 0, got {n_tokens!r}")
    flat = [(name, i, p) for name, paras in library(kind) for i, p in enumerate(paras)]
    at = int(start * len(flat))
    where = f"{flat[at][0]}:{flat[at][1]}"
    out: list[list[str]] = []
    total = 0
    for k in range(len(flat) * 4):  # a passage longer than the kind's whole text wraps (at most four times)
        if total >= n_tokens:
            break
        para = list(flat[(at + k) % len(flat)][2])
        kept = []
        for s in para:
            if total >= n_tokens:
                break
            kept.append(s)
            total += count_tokens(s + " ")
        out.append(kept)
    return where, out

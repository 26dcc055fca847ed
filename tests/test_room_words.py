"""Room that also reads the words (issue 57): the sentences room-making keeps are ranked by the question's attention
and by BM25 over the question's terms ("bm25", "hybrid"); eval longdoc's documents on real prose (tasks/realtext.py,
eval/longdoc_prose.py) with half of the questions paraphrased. Pure parts without a model; the ranking on a real
licence (Debian's common-licenses) with the real SmolLM2, 1 thread (a shared CPU)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from page_local.engine import room
from page_local.eval import longdoc as ld
from page_local.eval import longdoc_prose as lp
from page_local.tasks import realtext

THREADS = 1


def words(text: str) -> int:  # a tokenizer stand-in: about a token per word
    return len(text.split())


# --- the lexical score and how it joins the attention ---------------------------------------------------------

def test_bm25_ranks_the_sentence_with_the_question_terms_first_and_nothing_without_them():
    docs = ["This License applies to any program or other work.", "The locker number for the crisp anchor gym is 7987.",
            "You may charge any price or no price for each copy that you convey."]
    s = room.bm25_scores(docs, "What is the locker number for the crisp anchor gym?")
    assert s.shape == (3,) and int(np.argmax(s)) == 1 and s[0] == 0 == s[2]
    assert not room.bm25_scores(docs, "What about zebras?").any()  # no term of it in any sentence
    assert room.bm25_scores([], "anything").shape == (0,)


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0], ids=["attention-alone", "half-each", "words-alone"])
def test_word_scores_sum_per_sentence_to_the_shares_of_each_normalised_score(share):
    attention = np.array([3.0, 1.0, 0.5, 0.5, 0.0, 2.0])  # spans 0: 4.0, 1: 1.0, 2: 2.0
    spans = np.array([0, 0, 1, 1, 2, 2])
    per_span = np.array([0.0, 6.0, 3.0])  # BM25 of spans 0, 1, 2
    cell = room.word_scores(attention, per_span[spans], spans, share)
    span_sum = np.bincount(spans, weights=cell)
    expect = max(1 - share, room.TIE) * np.array([4.0, 1.0, 2.0]) / 4.0 + share * per_span / 6.0
    np.testing.assert_allclose(span_sum, expect)
    order = np.argsort(-span_sum, kind="stable").tolist()
    assert order == {0.0: [0, 2, 1], 0.5: [1, 0, 2], 1.0: [1, 2, 0]}[share]


def test_words_alone_still_order_by_attention_what_no_question_word_reaches():
    spans = np.array([0, 1, 2])
    cell = room.word_scores(np.array([0.1, 0.9, 0.5]), np.zeros(3), spans, 1.0)
    assert np.argsort(-cell).tolist() == [1, 2, 0]


@pytest.mark.parametrize("bad", [-0.1, 1.5, "half", True, float("nan")], ids=repr)
def test_a_bad_lexical_share_is_refused(bad):
    with pytest.raises(ValueError, match="lexical share"):
        room.check_lexical_share(bad)
    with pytest.raises(ValueError, match="lexical share"):
        room.word_scores(np.ones(2), np.ones(2), np.array([0, 1]), bad)


def test_misaligned_scores_are_refused_and_the_rankings_are_named():
    with pytest.raises(ValueError, match="must align"):
        room.word_scores(np.ones(3), np.ones(2), np.array([0, 0, 1]), 0.5)
    assert {"bm25", "hybrid"} <= set(room.ROOM_RANKINGS) and set(room.WORD_RANKINGS) == {"bm25", "hybrid"}
    assert room.check_room_ranking("hybrid") == "hybrid"
    with pytest.raises(ValueError, match="room ranking must be one of"):
        room.check_room_ranking("bm52")


# --- real texts -----------------------------------------------------------------------------------------------

def test_the_licences_read_into_prose_paragraphs_and_a_passage_is_a_function_of_its_arguments():
    lib = realtext.library("licenses")
    assert [name for name, _ in lib] == list(realtext.SOURCES["licenses"][1])
    gpl = lib[0][1]
    assert any("freedom to distribute copies of free software" in s for p in gpl for s in p)
    assert all(len(" ".join(p).split()) >= realtext.MIN_WORDS for p in gpl)
    a = realtext.passage("licenses", 0.3, 400, words)
    assert a == realtext.passage("licenses", 0.3, 400, words)
    assert a[0].startswith("GPL-") or ":" in a[0]
    n = sum(words(s + " ") for p in a[1] for s in p)
    assert 400 <= n < 400 + max(words(s) for p in a[1] for s in p) + 1  # cut at the sentence that reaches it


def test_an_info_node_keeps_its_prose_and_leaves_examples_menus_and_headings_out():
    info = ("preamble\n\x1f\nFile: x.info,  Node: Top,  Next: Intro\n\nNot this paragraph, which is in the top node "
            "of the manual.\n\x1f\nFile: x.info,  Node: Intro,  Prev: Top\n\n1 Intro\n*******\n\n"
            "Given one or more patterns, the program searches input files for\nmatches to the patterns today.\n\n"
            "     grep -e pattern file and more words here to be long\n\n* Menu:\n\n* Usage:: How to use it well and "
            "more words.\n\n   Though it expects text, it has no limits on input line length at all.\n")
    paras = realtext.read_info(info)
    assert paras == [["Given one or more patterns, the program searches input files for matches to the patterns "
                      "today."], ["Though it expects text, it has no limits on input line length at all."]]


def test_a_sphinx_page_gives_its_main_paragraphs_without_code_or_pilcrows():
    html = ('<html><body><div class="sphinxsidebar"><p>Navigation text that is long enough to be prose here.</p></div>'
            '<div class="body" role="main"><h1>Title<a class="headerlink" href="#">¶</a></h1>'
            '<p>Python is an easy to learn, powerful programming language. It has <em>efficient</em> data '
            'structures.</p><div class="highlight"><pre>&gt;&gt;&gt; print("not prose at all, only code here.")</pre>'
            '</div><ul><li><p>A list item that says something in eight words or more.</p></li></ul></div>'
            '</body></html>')
    assert realtext.read_sphinx_html(html) == [
        ["Python is an easy to learn, powerful programming language.", "It has efficient data structures."],
        ["A list item that says something in eight words or more."]]


def test_a_missing_text_names_the_package_that_ships_it(monkeypatch, tmp_path):
    folder, files, pkg = realtext.SOURCES["python-docs"]
    monkeypatch.setitem(realtext.SOURCES, "python-docs", (tmp_path / "nowhere", files, pkg))
    realtext.library.cache_clear()
    try:
        with pytest.raises(realtext.TextMissing, match=r"python-docs: 20 of 20 files missing .*python3-doc"):
            realtext.check_available()
        with pytest.raises(realtext.TextMissing, match="apt-get install -y python3-doc"):
            realtext.library("python-docs")
    finally:
        realtext.library.cache_clear()
    with pytest.raises(ValueError, match="text kind must be one of"):
        realtext.check_kind("essays")
    with pytest.raises(ValueError, match="start must be in"):
        realtext.passage("licenses", 1.0, 10, words)
    with pytest.raises(ValueError, match="n_tokens must be"):
        realtext.passage("licenses", 0.0, -1, words)


# --- documents on real prose, paraphrased questions ----------------------------------------------------------

@pytest.fixture(scope="module")
def prose_docs():
    """Documents 0-5 of 2 000 word-tokens, built twice: the kinds go round (licences first, always present)."""
    missing = [k for k in realtext.KINDS if realtext.missing(k)]
    if missing:
        pytest.skip(f"texts not on this machine: {missing} ({realtext.SOURCES[missing[0]][2]})")
    return [[lp.build_prose_document(i, 2000, words, lambda m: words(m) + 12, seed=42) for i in range(6)]
            for _ in range(2)]


def test_a_prose_document_is_deterministic_by_seed_and_holds_longdocs_facts(prose_docs):
    first, again = prose_docs
    assert first == again
    other = lp.build_prose_document(0, 2000, words, lambda m: words(m) + 12, seed=7)
    assert other.text != first[0].text and other.facts != first[0].facts
    assert [d.source.split("/")[0] for d in first] == list(realtext.KINDS) * 2
    for d in first:
        gen = ld.build_document(d.index, 300, words, lambda m: words(m) + 12, seed=42)
        assert [(f.what, f.name, f.where, f.code) for f in d.facts] == [(f.what, f.name, f.where, f.code)
                                                                         for f in gen.facts]
        for f, (lo, hi) in zip(d.facts, ld.DEPTHS):
            assert ld.FACT.format(**f.__dict__) in d.text
            assert lo - 0.02 <= f.depth <= hi + 0.02
        assert abs(words(d.message(0)) + 12 - 2000) < 80


def test_half_of_the_questions_are_paraphrased_without_the_facts_words(prose_docs):
    for d in prose_docs[0]:
        assert sum(d.paraphrased) == lp.PARAPHRASED == 2
        for q, f in enumerate(d.facts):
            question = d.question(q)
            assert f.name in question and question.endswith("?")
            if d.paraphrased[q]:
                fact_words = set(re.findall(r"\w+", f"{f.what} {f.where}".lower()))
                assert not fact_words & set(re.findall(r"\w+", question.lower())), question
                assert question == lp.paraphrase(f, 42, d.index)  # drawn by the seed, not by chance
            else:
                assert question == ld.QUESTION.format(**f.__dict__)
    with pytest.raises(ValueError, match="no paraphrase"):
        lp.paraphrase(ld.Fact("pin", "x y", "bank", "1234", 0.5), 42, 0)
    with pytest.raises(ValueError, match="n_tokens >= 64"):
        lp.build_prose_document(0, 10, words, words)


def test_facts_are_placed_between_sentences_at_their_depths():
    paras = [["A one.", "A two."], ["B one.", "B two.", "B three."], ["C one."]]
    text, placed = lp.place(paras, ["N1.", "N2.", "N3."], [0.0, 0.5, 0.99])
    assert text == "N1. A one. A two.\n\nB one. N2. B two. B three.\n\nC one. N3."
    assert placed == [0.0, 3 / 6, 1.0]


def test_a_run_on_prose_refuses_a_bad_haystack_and_names_a_missing_package_before_loading(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="haystack must be one of generated, prose"):
        ld.LongDocRun("no-such-model.gguf", tmp_path / "r.jsonl", haystack="essays")
    folder, files, pkg = realtext.SOURCES["gnu-manuals"]
    monkeypatch.setitem(realtext.SOURCES, "gnu-manuals", (tmp_path / "info", files, pkg))
    with pytest.raises(realtext.TextMissing, match="gnu-manuals: 6 of 6 files missing.*coreutils"):
        ld.LongDocRun("no-such-model.gguf", tmp_path / "r.jsonl", haystack="prose")  # before the model is read
    # documents 0 and 1 read the licences and the Python docs: a run of two never needs the manuals
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        ld.LongDocRun("no-such-model.gguf", tmp_path / "r.jsonl", docs=2, haystack="prose")


def test_the_command_says_which_package_is_missing_in_one_line(cli, monkeypatch, tmp_path):
    folder, files, pkg = realtext.SOURCES["python-docs"]
    monkeypatch.setitem(realtext.SOURCES, "python-docs", (tmp_path / "html", files, pkg))
    res = cli("eval", "longdoc", "--haystack", "prose", "--docs", "2", "--n-ctx", "256", "--lengths", "2",
              "--pilot-s", "1", "--plan-only", "--out", tmp_path / "rows.jsonl")
    assert res.exit_code == 2, res.output
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("Error:") and "python3-doc" in last and "Traceback" not in res.output


# --- the real model on a real licence -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run(smollm2_path, tmp_path_factory):
    with ld.LongDocRun(smollm2_path, tmp_path_factory.mktemp("words") / "rows.jsonl", docs=1, n_ctxs=[512],
                       lengths=[4], policies=["room-best", "room-bm25"], threads=THREADS, haystack="prose") as r:
        yield r


def test_the_question_is_found_in_the_rendered_message(run):
    cell = run.cells[0]
    eng = run.engine("room-bm25", cell)
    doc = run.document(cell, 0)
    for q in range(ld.FACTS):
        assert eng.room.query_text(run.prompter.tokens(doc.message(q))) == doc.question(q)
    # a next turn of a chat that says no sentence of three words: nothing to match
    turn = eng.model.tokenize("<|im_end|>\n<|im_start|>user\nok thanks<|im_end|>\n<|im_start|>assistant\n",
                              add_special=False)
    assert eng.room.query_text(turn) == ""
    two = eng.model.tokenize("The end of a page of text. Which digits open the safe?\nPlease answer briefly.",
                             add_special=False)
    assert eng.room.query_text(two) == "Which digits open the safe? Please answer briefly."  # from what it asks on


@pytest.mark.parametrize("ranking", ["question", "bm25", "hybrid"],
                         ids=["attention-alone-loses-it", "bm25-keeps-it", "hybrid-keeps-it"])
def test_the_ranking_keeps_the_sentence_with_the_questions_terms_in_a_licence(run, ranking):
    """Document 0 on real prose (Debian's MPL-2.0, always present) at 4x n_ctx 512, read in 8 or more parts, its third
    fact ("The vault combination for the clever stove archive is 4050.", depth 0.64) asked in its own words. Ranked by
    the question's attention alone (room's default, room-best), none of the fact's sentence is left after the last
    cut: the licence's sentences take its place. With the question's words in the ranking, every cell of it is held,
    and the probe decodes leave nothing behind."""
    cell = run.cells[0]
    eng = run.engine("room-bm25", cell)
    eng.set_room_ranking(ranking)
    doc = run.document(cell, 0)
    assert doc.source.startswith("licenses/")
    q = 2
    f = doc.facts[q]
    assert not doc.paraphrased[q] and f.code == "4050"
    prompts = [run.prompter.tokens(doc.message(i)) for i in range(ld.FACTS)]
    r = ld.reading("room-bm25", prompts, cell.n_ctx, run.max_tokens, eng.n_keep)
    snap, _ = ld.read_shared(eng, r)
    try:
        o = ld.ask(eng, snap, r.suffix[q], run.max_tokens)  # as the evaluation asks it: with its answer's room
    finally:
        eng.set_room_ranking("bm25")
    assert o["chunks"] >= 8 and o["room_evicted"] > len(prompts[q]) // 2  # most of the licence went
    assert ld.fact_held(eng, f) == (0.0 if ranking == "question" else 1.0), o["answer"]
    assert eng.conv.pos == list(range(len(eng.history)))  # the probe decodes took no position
    assert np.isin(eng.ctx.page.positions(0), eng.conv.pos).all()


def test_a_ranking_with_words_falls_back_to_the_attention_with_an_evictor_without_a_score(run):
    """The words are added to the room evictor's score: one with none (random) ranks as 'question' does, the
    Decision says so, and nothing fails mid-turn."""
    cell = run.cells[0]
    eng = run.engine("room-bm25", cell)
    doc = run.document(cell, 0)
    prompts = [run.prompter.tokens(doc.message(i)) for i in range(ld.FACTS)]
    r = ld.reading("room-bm25", prompts, cell.n_ctx, run.max_tokens, eng.n_keep)
    snap, _ = ld.read_shared(eng, r)
    eng.set_room_evictor("random")
    try:
        eng.restore(snap)
        d = eng.prefill(list(r.suffix[0]), add_special=False)
        assert d.room_evicted > 0 and d.room_ranking == "question"
        eng.restore(snap)
        eng.set_room_evictor("snapkv-spans", prior="max")
        d = eng.prefill(list(r.suffix[0]), add_special=False)
        assert d.room_evicted > 0 and d.room_ranking == "bm25"
    finally:
        ld.set_policy(eng, "room-bm25")

"""RULER-style tasks, readers and scoring (page_local.eval; docs/algorithms.md §6). No model needed."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from page_local.tasks import readers
from page_local.tasks import scoring
from page_local.tasks.synthetic import ADJECTIVES, CWE_TEMPLATE, FWE_TEMPLATE, NIAH_ANSWER_PREFIX, NIAH_TEMPLATE, NOISE, NOUNS, PILOT_MIX, TASKS, VERBS, Sample, cwe_real_words, generate, niah_singular, pilot_prompts, pseudo_words


def ws(text: str) -> int:
    """The cheap counter the tests use in place of a tokenizer."""
    return len(text.split())


def chars4(text: str) -> int:
    return len(text) // 4


LABELED = [t for t, spec in TASKS.items() if spec.labeled]
NIAH = [t for t in TASKS if t.startswith("niah")]
CWE_HEAD = CWE_TEMPLATE.split("{context}")[0]
FWE_HEAD = FWE_TEMPLATE.split("{context}")[0]
VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text."


def one(task, target=1500, seed=42, index=0, count=ws, **kw) -> Sample:
    return generate(task, 1, target, count, seed=seed, start=index, **kw)[0]


# --- determinism and lengths -------------------------------------------------------------------

@pytest.mark.parametrize("task", list(TASKS), ids=str)
def test_deterministic_per_task_index_seed(task):
    a = generate(task, 3, 1500, ws, seed=5)
    assert a == generate(task, 3, 1500, ws, seed=5)
    assert one(task, seed=5, index=2) == a[2]  # independent of n and start
    assert a[0].text() != a[1].text()
    assert one(task, seed=6).text() != a[0].text()
    if TASKS[task].labeled:
        assert a[0].answers != a[1].answers  # a different needle / chain / word set


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(task=st.sampled_from(list(TASKS)), target=st.integers(1200, 5000),
       seed=st.integers(0, 2**31), index=st.integers(0, 1000))
def test_length_respects_and_approaches_target(task, target, seed, index):
    s = one(task, target, seed=seed, index=index)
    assert s.length == ws(s.text())
    assert s.length + s.max_new_tokens <= target
    assert s.length + s.max_new_tokens >= 0.9 * target


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multikey_3", "vt", "cwe", "fwe"],
                         ids=str)
@pytest.mark.parametrize("count", [ws, chars4], ids=["whitespace", "chars/4"])
def test_length_with_other_counters(task, count):
    s = one(task, 3000, count=count)
    assert 0.9 * 3000 <= s.length + s.max_new_tokens <= 3000
    assert s.length == count(s.text())


def test_generate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown task"):
        generate("qa_1", 1, 2000, ws)
    with pytest.raises(ValueError, match=">= 48"):
        generate("niah_multikey_3", 1, 2000, ws, max_new_tokens=32)
    with pytest.raises(ValueError, match="raise target_tokens"):
        generate("niah_single_1", 1, 160, ws)
    with pytest.raises(ValueError, match="no room"):
        generate("vt", 1, 30, ws)
    with pytest.raises(ValueError, match="n must be"):
        generate("vt", -1, 2000, ws)
    with pytest.raises(ValueError, match="non-negative int"):
        generate("vt", 1, 2000, lambda s: "many")
    assert generate("fwe", 0, 2000, ws) == []
    assert one("niah_multikey_3", max_new_tokens=48).max_new_tokens == 48


# --- the answer is really in the context -------------------------------------------------------

@pytest.mark.parametrize("task", NIAH, ids=str)
def test_niah_values_are_in_the_context(task):
    for s in generate(task, 4, 2000, ws, seed=11):
        type_v = "uuids" if task == "niah_multikey_3" else "numbers"
        lines = s.context.split("\n")[1:]
        needles = [ln for ln in lines if ln.startswith("One of the special magic")]
        for key in s.meta["keys"]:
            mine = [ln for ln in needles if f" for {key} is: " in ln]
            assert mine, key
            for ln in mine:
                value = ln.split(" is: ")[1][:-1]
                assert ln == f"One of the special magic {type_v} for {key} is: {value}."
                assert value in s.answers
        for value in s.answers:
            assert s.context.count(value) == 1
        assert all(0.0 <= d <= 1.0 for d in s.meta["depths"])
        if task in ("niah_multikey_2", "niah_multikey_3"):  # every line a distractor needle
            pat = re.compile(rf"One of the special magic {type_v} for \S+ is: \S+\.")
            assert all(pat.fullmatch(ln) for ln in lines)
            assert len(lines) > 50
        elif s.meta["haystack"] == "prose":  # generated prose around the needles, never a needle-like line
            assert len(needles) == len(s.answers) and NOISE not in lines and "magic" not in "".join(
                ln for ln in lines if ln not in needles)
        else:
            assert len(needles) == len(s.answers) and lines.count(NOISE) == len(lines) - len(needles)


def _resolve_vt(text: str) -> dict[str, str]:
    """variable -> value for every `VAR X = ...` statement in text, following the chain."""
    direct = dict(re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)", text))
    out = {}
    for var in direct:
        v = direct[var]
        for _ in range(len(direct)):
            if not v.startswith("VAR "):
                break
            v = direct[v[4:]]
        out[var] = v
    return out


def test_vt_chain_is_resolvable():
    for s in generate("vt", 4, 2500, ws, seed=3):
        cut = s.context.rindex(VT_HEAD)
        example, task_part = s.context[:cut], s.context[cut:]
        value = s.meta["value"]
        resolved = _resolve_vt(task_part)
        assert sorted(v for v, val in resolved.items() if val == value) == sorted(s.answers)
        assert len(s.answers) == 5 and all(re.fullmatch(r"[A-Z]{5}", a) for a in s.answers)
        assert f"assigned the value {value} " in s.question + " "
        # the in-context example carries its own chain and its answer
        m = re.search(r"assigned the value (\d+), they are:\s+((?:[A-Z]{3} ?){5})", example)
        assert m and m.group(1) != value
        ex = _resolve_vt(example[:m.start()])
        assert sorted(v for v, val in ex.items() if val == m.group(1)) == sorted(m.group(2).split())


@pytest.mark.parametrize("target", [1500, 5000], ids=["short", "long"])
def test_fwe_answers_are_ranks_2_to_4(target):
    for s in generate("fwe", 3, target, ws, seed=9):
        assert s.context.startswith(FWE_HEAD)
        counts = Counter(s.context[len(FWE_HEAD):].split()).most_common()
        assert counts[0][0] == "..."
        assert [w for w, _ in counts[1:4]] == s.answers
        c = [n for _, n in counts[:5]]
        assert c[0] > c[1] > c[2] > c[3] > c[4]


@pytest.mark.parametrize("target, reps", [(2000, (6, 1)), (4096, (30, 3)), (8192, (30, 3))],
                         ids=["below-4096", "4096", "8192-pseudo-words"])
def test_cwe_answers_are_the_most_common_words(target, reps):
    s = one("cwe", target, seed=4)
    assert tuple(s.meta["repetitions"]) == reps
    main = s.context[s.context.rindex(CWE_HEAD):]
    entries = re.findall(r"(\d+)\. (\S+)", main)
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
    counts = Counter(w for _, w in entries)
    assert len(s.answers) == 10 and all(counts[a] == reps[0] for a in s.answers)
    assert set(counts.values()) == set(reps)
    # in the whole context (few-shot example included) they are still the top 10
    total = Counter(re.findall(r"\d+\. (\S+)", s.context))
    assert min(total[a] for a in s.answers) > max(n for w, n in total.items() if w not in s.answers)
    if target == 8192:
        assert set(counts) - set(cwe_real_words())  # the pool was extended with pseudo-words


# --- templates (docs/algorithms.md §6) ----------------------------------------------------------

def test_niah_singular_rule_matches_ruler():
    assert niah_singular(NIAH_TEMPLATE).format(type_v="number", context="C", query="k") == (
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\nC\n"
        "What is the special magic number for k mentioned in the provided text?")
    assert niah_singular(NIAH_ANSWER_PREFIX).format(type_v="number", query="k") == \
        " The special magic number for k mentioned in the provided text is"


@pytest.mark.parametrize("task, type_v, plural", [
    ("niah_single_1", "number", False), ("niah_multikey_2", "number", False),
    ("niah_multikey_3", "uuid", False), ("niah_multivalue", "numbers", True),
    ("niah_multiquery", "numbers", True)], ids=lambda v: str(v))
def test_niah_template(task, type_v, plural):
    s = one(task)
    keys = s.meta["keys"]
    query = keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]
    if plural:
        head = (f"Some special magic {type_v} are hidden within the following text. Make sure to "
                f"memorize it. I will quiz you about the {type_v} afterwards.\n")
        question = f"What are all the special magic {type_v} for {query} mentioned in the provided text?"
        prefix = f" The special magic {type_v} for {query} mentioned in the provided text are"
    else:
        head = (f"A special magic {type_v} is hidden within the following text. Make sure to "
                f"memorize it. I will quiz you about the {type_v} afterwards.\n")
        question = f"What is the special magic {type_v} for {query} mentioned in the provided text?"
        prefix = f" The special magic {type_v} for {query} mentioned in the provided text is"
    assert s.context.startswith(head)
    assert (s.question, s.answer_prefix) == (question, prefix)
    assert len(keys) == (4 if task == "niah_multiquery" else 1)
    assert len(s.answers) == (4 if plural else 1)


def test_other_templates():
    vt = one("vt")
    v = vt.meta["value"]
    assert vt.context.rindex(VT_HEAD + "\n\n") > 0  # after the in-context example
    assert vt.question == f"Question: Find all variables that are assigned the value {v} in the text above."
    assert vt.answer_prefix == (" Answer: According to the chain(s) of variable assignment in the "
                                f"text above, 5 variables are assigned the value {v}, they are: ")
    cwe = one("cwe")
    assert CWE_HEAD == ("Below is a numbered list of words. In these words, some appear more often "
                        "than others. Memorize the ones that appear most often.\n")
    assert cwe.context.startswith(CWE_HEAD) and cwe.context.count(CWE_HEAD) == 2
    assert cwe.question == "Question: What are the 10 most common words in the above list?"
    assert cwe.answer_prefix == " Answer: The top 10 words that appear most often in the list are:"
    assert ("Question: What are the 10 most common words in the above list? Answer: The top 10 "
            "words that appear most often in the list are: 1. ") in cwe.context  # few-shot answer
    fwe = one("fwe")
    assert fwe.context.startswith(
        "Read the following coded text and track the frequency of each coded word. Find the three "
        "most frequently appeared coded words. ")
    assert fwe.question == ("Question: Do not provide any explanation. Please ignore the dots "
                            "'....'. What are the three most frequently appeared words in the "
                            "above coded text?")
    assert fwe.answer_prefix == (" Answer: According to the coded text above, the three most "
                                 "frequently appeared words are:")


@pytest.mark.parametrize("task", list(TASKS), ids=str)
def test_prompt_layouts(task):
    s = one(task, 1200)
    user, prefix = s.messages()
    assert user == s.context + "\n\n" + s.question and user.endswith(s.question)
    assert prefix == s.answer_prefix.strip()
    assert s.text() == user + s.answer_prefix
    ctx, rest = s.query_agnostic()
    assert ctx == s.context and ctx + rest == s.text()
    assert s.question and not ctx.endswith(s.question)
    if task not in ("vt", "cwe"):  # their in-context examples repeat the question
        assert s.question not in ctx


def test_pilot_prompts_mix_lengths_and_stream():
    pilot = pilot_prompts(14, [700, 1400], ws, seed=42)
    assert [p.task for p in pilot] == [PILOT_MIX[i % len(PILOT_MIX)] for i in range(14)]
    for i, p in enumerate(pilot):
        target = [700, 1400][(i // len(PILOT_MIX)) % 2]
        assert 0.8 * target <= p.length + p.max_new_tokens <= target
    assert pilot == pilot_prompts(14, [700, 1400], ws, seed=42)
    assert pilot[0].text() != one(pilot[0].task, 700, seed=42, index=0).text()
    prose = pilot[PILOT_MIX.index("prose")]
    assert prose.answers == [] and prose.answer_prefix == "" and "Summarize" in prose.question
    with pytest.raises(ValueError):
        pilot_prompts(3, [], ws)


def test_word_lists():
    for words in (ADJECTIVES, NOUNS, VERBS):
        assert len(words) >= 200 and len(set(words)) == len(words)
        assert all(w.isascii() and w.isalpha() and w.islower() for w in words)
    pool = cwe_real_words()
    assert len(pool) > 600
    assert not [(a, b) for a in pool for b in pool if a != b and a in b]
    assert not [w for w in pool if w in (CWE_TEMPLATE + "answer").lower()]
    pw = pseudo_words(300)
    assert pw == pseudo_words(300) and len(set(pw)) == 300
    assert all(re.fullmatch(r"([bdfgklmnprstvz][aeiou]){3}", w) for w in pw)
    assert not [(w, r) for w in pw for r in pool if r in w or w in r]


# --- readers -----------------------------------------------------------------------------------

def _ruler_row(s: Sample, keep_prefix=True) -> dict:
    """A row as RULER's generators write it (base template: context, newline, question)."""
    inp = s.context + "\n" + s.question + (s.answer_prefix if keep_prefix else "")
    row = {"index": s.index, "input": inp, "outputs": s.answers,
           "length": s.length + s.max_new_tokens}
    if not keep_prefix:
        row["answer_prefix"] = s.answer_prefix
    return row


def _write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multiquery", "vt", "cwe", "fwe"],
                         ids=str)
def test_read_ruler_jsonl(tmp_path, task):
    made = generate(task, 3, 1500, ws)
    for path in (tmp_path / f"{task}.jsonl", tmp_path / task / "validation.jsonl"):
        got = readers.read_ruler_jsonl(_write_jsonl(path, [_ruler_row(s) for s in made]))
        for s, r in zip(made, got):
            assert (r.task, r.index, r.answers, r.metric) == (task, s.index, s.answers, "all")
            assert r.messages() == s.messages()
            assert r.answer_prefix == s.answer_prefix
            assert r.max_new_tokens == s.max_new_tokens and r.length == s.length
    # newer RULER builds keep the prefix in its own field; a bare file name needs detection
    path = _write_jsonl(tmp_path / "data.jsonl", [_ruler_row(s, keep_prefix=False) for s in made])
    got = readers.read_samples(path)
    assert [r.messages() for r in got] == [s.messages() for s in made]
    assert {r.task for r in got} == {task.split("_")[0]}


def test_read_ruler_qa_uses_part_metric(tmp_path):
    inp = ("Answer the question based on the given documents. Only give me the answer and do not "
           "output any other words.\n\nThe following are given documents.\n\nDocument 1:\nParis is "
           "the capital of France.\n\nAnswer the question based on the given documents. Only give "
           "me the answer and do not output any other words.\n\nQuestion: What is the capital of "
           "France? Answer:")
    path = _write_jsonl(tmp_path / "qa_1.jsonl", [{"index": 7, "input": inp,
                                                   "outputs": ["Paris", "paris, France"],
                                                   "length": 100}])
    (s,) = readers.read_samples(path)
    assert (s.task, s.index, s.metric, s.max_new_tokens, s.length) == ("qa_1", 7, "part", 32, 68)
    assert s.context.endswith("capital of France.\n\n")
    assert s.question == ("Answer the question based on the given documents. Only give me the "
                          "answer and do not output any other words.\n\nQuestion: What is the "
                          "capital of France?")
    assert s.answer_prefix == " Answer:"
    assert scoring.correct(s, "paris")


def test_read_kvpress_rows(tmp_path):
    made = [*generate("niah_multikey_3", 2, 1500, ws), *generate("cwe", 2, 1500, ws),
            *pilot_prompts(6, [800], ws)]
    rows = [s.to_row() for s in made]
    jsonl = _write_jsonl(tmp_path / "set.jsonl", rows)
    as_list = tmp_path / "set.json"
    as_list.write_text(json.dumps(rows))
    as_columns = tmp_path / "cols.json"
    as_columns.write_text(json.dumps({k: [r[k] for r in rows] for k in rows[0]}))
    for path in (jsonl, as_list, as_columns):
        assert readers.read_kvpress(path) == made
        assert readers.read_samples(path) == made
    hf = {"context": "Some text.\n", "question": "What is the special magic number for a-b "
          "mentioned in the provided text? ", "answer_prefix": "The special magic number for a-b "
          "mentioned in the provided text is", "answer": ["1234567"], "task": "niah_single_1",
          "max_new_tokens": 128}
    (s,) = readers.read_kvpress(_write_jsonl(tmp_path / "hf.jsonl", [hf]))
    assert (s.index, s.metric, s.answers, s.length) == (0, "all", ["1234567"], None)
    assert s.messages() == ("Some text.\n\nWhat is the special magic number for a-b mentioned in "
                            "the provided text?", hf["answer_prefix"])


@pytest.mark.parametrize("name, lines, where, what", [
    ("bad.jsonl", ['{"input": "x"', ''], "bad.jsonl:1", "invalid JSON"),
    ("niah_single_1.jsonl", ['', '{"input": "What is the special magic number? The special magic '
                                 'number is", "outputs": "1"}', '{"input": "x"}'],
     "niah_single_1.jsonl:3", "outputs"),
    ("vt.jsonl", ['{"input": "no anchor here", "outputs": ["A"]}'], "vt.jsonl:1", "question"),
    ("mystery.jsonl", ['{"input": "no anchor here", "outputs": ["A"]}'], "mystery.jsonl:1",
     "anchor"),
    ("fwe.jsonl", ['{"input": "Question: Do not provide any explanation. x", "outputs": ["a"]}'],
     "fwe.jsonl:1", "answer prefix"),
    ("kv.jsonl", ['{"context": "c", "question": "q", "answer_prefix": "", "answer": [1], '
                  '"task": "vt"}'], "kv.jsonl:1", "answer"),
    ("kv2.jsonl", ['{"context": "c", "question": "q", "answer": ["A"], "task": "vt"}'],
     "kv2.jsonl:1", "answer_prefix"),
    ("kv3.json", ['[{"context": "c", "question": "q", "answer_prefix": "", "answer": ["A"], '
                  '"task": "vt", "max_new_tokens": 0}]'], "kv3.json: row 0", "max_new_tokens"),
], ids=["json", "missing-outputs", "no-question", "undetectable", "no-prefix", "answer-type",
        "missing-key", "json-row"])
def test_readers_name_the_bad_row(tmp_path, name, lines, where, what):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=re.escape(where) + ".*" + what):
        readers.read_samples(path)


# --- scoring -----------------------------------------------------------------------------------

def test_scoring_examples():
    refs = ["1234567", "7654321", "1111111", "2222222"]
    pred = "The numbers are 1234567 and 7654321."
    assert scoring.string_match_all(pred, refs) == 0.5
    assert scoring.string_match_part(pred, refs) == 1.0
    assert scoring.string_match_part("none of them", refs) == 0.0
    assert scoring.string_match_all("ALPHA and Beta", ["alpha", "BETA"]) == 1.0
    assert scoring.normalize_prediction("  a\tb\x00c\x1f ") == "a\nb\nc"

    s = Sample(task="niah_single_1", index=0, context="c", question="q", answer_prefix="p",
               answers=["1234567"], max_new_tokens=128)
    assert scoring.score(s, "\x02 1234567\x1f") == 1.0 and scoring.correct(s, " 1234567.")
    assert scoring.score(s, "123\x004567") == 0.0  # a control char splits the number
    multi = Sample(task="niah_multivalue", index=0, context="c", question="q", answer_prefix="p",
                   answers=refs, max_new_tokens=128)
    assert scoring.score(multi, pred) == 0.5 and not scoring.correct(multi, pred)
    qa = Sample(task="qa_2", index=0, context="c", question="q", answer_prefix="p",
                answers=["Paris", "the city of Paris"], max_new_tokens=32, metric="part")
    assert scoring.correct(qa, "PARIS")
    assert scoring.task_score([s, multi, qa], ["1234567", pred, "Lyon"]) == pytest.approx(50.0)
    with pytest.raises(ValueError, match="no reference"):
        scoring.score(pilot_prompts(6, [800], ws)[-1], "anything")


_ascii = st.text(alphabet="abcdefghijKLMNOP0123 -", max_size=12)


@settings(max_examples=200, deadline=None)
@given(refs=st.lists(_ascii.filter(bool), min_size=1, max_size=5), pred=_ascii)
def test_scoring_properties(refs, pred):
    full = scoring.string_match_all(pred, refs)
    part = scoring.string_match_part(pred, refs)
    assert 0.0 <= full <= 1.0 and part in (0.0, 1.0)
    assert (part == 1.0) == (full > 0.0)
    assert scoring.string_match_all(pred.upper(), refs) == full
    assert scoring.string_match_all(" ".join(refs).swapcase(), refs) == 1.0
    s = Sample(task="niah_multivalue", index=0, context="c", question="q", answer_prefix="p",
               answers=refs, max_new_tokens=8)
    assert scoring.correct(s, pred) == (scoring.score(s, pred) == 1.0)


@pytest.mark.parametrize("task", ["niah_single_2", "niah_multivalue_essay", "niah_multiquery_essay"])
def test_essay_haystack_tasks_hide_their_needles_in_varied_prose(task):
    samples = generate(task, 3, 1500, ws, seed=7)
    for s in samples:
        lines = [ln for ln in s.context.split("\n") if ln.strip()]
        prose = [ln for ln in lines if "special magic" not in ln]
        assert len(set(prose)) > 0.9 * len(prose) > 20  # real variety, not a repeated noise sentence
        assert all(a in s.context for a in s.answers) and len(s.answers) == (1 if task == "niah_single_2" else 4)
        assert ws(s.context) <= 1500

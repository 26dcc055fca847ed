"""The multi-turn evaluation (eval/conversations.py): the conversations it builds, and a tiny run of every
policy on SmolLM2 (rows complete and resumed, what each policy did at the wall, the report)."""

from __future__ import annotations

import json

import pytest

from page_local.eval import conversations as cv
from page_local.eval.conversations_report import summarize, write_report
from page_local.eval.rows import read_rows
from tests.conftest import one_line_error


def _words(text: str) -> int:
    return len(text.split())


def _measure(messages: list[dict]) -> int:
    return sum(_words(m["content"]) + 4 for m in messages)


# --- the conversations, without a model -----------------------------------------------------------

@pytest.mark.parametrize("turns", [2, 5, 8], ids=lambda t: f"{t}-turns")
def test_each_turn_asks_a_different_fact_of_a_document_already_read(turns):
    conv = cv.build_conversation(3, turns, 2.0, 1024, _words, _measure, seed=7)
    assert len(conv.turns) == turns
    asked = [t.fact for t in conv.turns]
    assert len({f.key for f in asked}) == turns  # one question per turn, each about a different needle
    for t, turn in enumerate(conv.turns):
        assert turn.doc == (t // 2 if t % 2 == 0 else None)  # a document on every even turn
        assert turn.fact.doc == cv.asked_doc(t) <= t // 2  # never about a document not read yet
        assert turn.user.endswith(cv.QUESTION.format(key=turn.fact.key))
        paste = conv.turns[2 * turn.fact.doc].user  # the needle is in the message that pasted its document
        assert f"for {turn.fact.key} is: {turn.fact.value}." in paste
        assert 0 <= turn.fact.depth <= 1
    if turns >= 4:
        assert any(t - 2 * f.doc >= 3 for t, f in enumerate(asked))  # some asked long after their document


def test_conversations_are_reproducible_and_sized_to_the_length():
    a = cv.build_conversation(0, 6, 4.0, 1024, _words, _measure, seed=1)
    assert a == cv.build_conversation(0, 6, 4.0, 1024, _words, _measure, seed=1)
    assert a != cv.build_conversation(1, 6, 4.0, 1024, _words, _measure, seed=1)
    target = cv.FILL * 4.0 * 1024
    assert abs(a.planned_tokens - target) < 0.1 * target, (a.planned_tokens, target)
    short = cv.build_conversation(0, 6, 1.0, 1024, _words, _measure, seed=1)
    assert short.planned_tokens < 1024 < a.planned_tokens
    with pytest.raises(ValueError, match="turns"):
        cv.build_conversation(0, 9, 1.0, 1024, _words, _measure)


def test_summaries_ask_a_pasted_document_for_a_long_answer_and_keep_the_later_questions():
    plain = cv.build_conversation(2, 6, 1.0, 1024, _words, _measure, seed=3)
    summ = cv.build_conversation(2, 6, 1.0, 1024, _words, _measure, seed=3, summaries=True)
    for a, b in zip(plain.turns, summ.turns):
        # the same facts asked in the same order (the prose is sized again around the longer requests)
        assert (a.fact.key, a.fact.value, a.fact.doc, a.doc) == (b.fact.key, b.fact.value, b.fact.doc, b.doc)
        q = cv.QUESTION.format(key=a.fact.key)
        if a.doc is not None:  # pasted: a summary asked instead of the number
            assert a.user.endswith("\n\n" + q) and b.user.endswith("\n\n" + cv.SUMMARY)
        else:
            assert a.user == b.user == q


def test_a_summaries_run_keeps_its_rows_apart(smollm2_path, tmp_path):
    out = tmp_path / "rows.jsonl"
    kw = dict(n=1, turns=2, lengths=(1.0,), n_ctx=512, policies=("full",), max_tokens=8, threads=2, out=out)
    assert cv.run_conversations(smollm2_path, **kw)["rows_written"] == 2
    res = cv.run_conversations(smollm2_path, summaries=True, **kw)  # not taken for the plain run's rows
    assert res["rows_written"] == 2 and res["rows_present"] == 2
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("summaries") for r in rows] == [None, None, True, True]
    assert cv.run_conversations(smollm2_path, summaries=True, **kw)["rows_written"] == 0  # resumed
    # a shorter check's span: rows of their own (not taken for the default span's)
    res = cv.run_conversations(smollm2_path, summaries=True, verify_tokens=16, **kw)
    assert res["rows_written"] == 2
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("verify_tokens") for r in rows] == [None, None, None, None, 16, 16]
    # each row names the CPU and the build that made it; rows made elsewhere still count for the resume
    from page_local.store.tuning import machine_signature
    assert {r["machine"] for r in rows} == {machine_signature()} and all(r["library"] for r in rows)
    out.write_text("".join(json.dumps(dict(r, machine="another CPU")) + "\n" for r in rows))
    assert cv.run_conversations(smollm2_path, summaries=True, verify_tokens=16, **kw)["rows_written"] == 0


# --- a tiny run on SmolLM2 ---------------------------------------------------------------------------

N_CTX, TURNS = 256, 4
LENGTH = 1.5  # the conversation plans ~1.35 x n_ctx tokens: it still outgrows the others' context


@pytest.fixture(scope="module")
def run(smollm2_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "rows.jsonl"
    res = cv.run_conversations(smollm2_path, n=1, turns=TURNS, lengths=(LENGTH,), n_ctx=N_CTX, policies=cv.POLICIES,
                               max_tokens=28, seed=42, threads=2, out=out)
    return out, res


def test_every_policy_answers_every_turn_and_a_rerun_resumes(run, smollm2_path):
    out, res = run
    rows = read_rows(out)
    assert res["rows_written"] == len(rows) == len(cv.POLICIES) * TURNS
    assert {(r["policy"], r["turn"]) for r in rows} == {(p, t) for p in cv.POLICIES for t in range(TURNS)}
    for r in rows:
        assert r["finish"] in ("stop", "length"), r  # nobody refused
        assert r["correct"] == (r["expected"] in r["answer"])
        assert r["gen_tokens"] >= 1 and r["ttft_s"] > 0 and r["decode_tok_s"] > 0
        assert r["cells"] <= r["cache_n_ctx"]
    again = cv.run_conversations(smollm2_path, n=1, turns=TURNS, lengths=(LENGTH,), n_ctx=N_CTX, policies=cv.POLICIES,
                                 max_tokens=28, seed=42, threads=2, out=out)
    assert again["rows_written"] == 0 and again["units"] == 0


def test_what_each_policy_does_at_the_wall(run):
    rows = {(r["policy"], r["turn"]): r for r in read_rows(run[0])}
    last = TURNS - 1
    full = [rows[("full", t)] for t in range(TURNS)]
    assert not any(r["wall"] for r in full)
    assert full[-1]["conv_tokens"] > N_CTX  # the conversation outgrew the others' context...
    assert full[-1]["cells"] >= full[-1]["conv_tokens"] - 4  # ...and the full cache holds all of it
    for p in ("verify", "page", "room", "shift", "truncate"):
        assert any(rows[(p, t)]["wall"] for t in range(TURNS)), p
        assert all(rows[(p, t)]["cells"] < N_CTX for t in range(TURNS)), p
    assert sum(rows[("room", t)]["detail"]["room_evicted"] for t in range(TURNS)) > 0
    assert not any(rows[("room", t)]["detail"]["speed_evicted"] for t in range(TURNS))  # gate never
    assert sum(rows[("shift", t)]["detail"]["shift_dropped"] for t in range(TURNS)) > 0
    # the last turn asks about the first document: truncation re-rendered the chat without that message,
    # so the number is nowhere in its context and cannot be answered; the full cache answers at least as well
    t = rows[("truncate", last)]
    assert t["asked_doc"] == 0 and t["detail"]["messages_dropped"] >= 1 and not t["correct"]
    assert sum(r["correct"] for r in full) >= sum(rows[("truncate", u)]["correct"] for u in range(TURNS))


def test_the_report_has_every_policy_and_the_plot(run, tmp_path):
    out = run[0]
    s = summarize(read_rows(out))
    assert s["policies"] == list(cv.POLICIES) and s["lengths"] == [LENGTH]
    for p in cv.POLICIES:
        c = s["cells"][f"{p}|{LENGTH:g}"]
        assert len(c["by_turn"]) == TURNS and 0 <= c["accuracy"] <= 1
    md = write_report(out, tmp_path / "rep")
    text = md.read_text(encoding="utf-8")
    assert "truncation (Ollama)" in text and "context shift (llama.cpp)" in text and "| turn 4 |" in text
    assert (tmp_path / "rep" / "accuracy_by_turn.png").stat().st_size > 1000
    assert json.loads((tmp_path / "rep" / "summary.json").read_text())["turns"] == TURNS


def test_eval_conversations_usage_errors(cli):
    one_line_error(cli("eval", "conversations", "--policies", "full,nope"), 2, "nope")
    one_line_error(cli("eval", "conversations", "--lengths", "1,x"), 2, "--lengths")
    one_line_error(cli("eval", "conversations", "--turns", "9"), 2, "--turns")


def test_the_help_names_every_policy(cli):
    res = cli("eval", "conversations", "--help")
    assert res.exit_code == 0
    text = " ".join(res.output.split())
    assert all(p in text for p in cv.ALL_POLICIES), [p for p in cv.ALL_POLICIES if p not in text]

"""The long-document evaluation (eval/longdoc.py): one reading per document restored per question, rows
written per question and skipped on a rerun, llama-server's row without a run, and the report. SmolLM2 on
tiny documents (n_ctx 256); 1 thread (a shared CPU: two threads that wait on each other are slower)."""

from __future__ import annotations

import json

import pytest

from page_local.eval import longdoc as ld
from page_local.eval.longdoc_report import markdown, summarize, wilson
from page_local.eval.rows import read_rows

THREADS = 1


def lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


# --- no model: readings and the report ----------------------------------------------------------------

PROMPTS = [list(range(100, 700)) + [1, 2, 3, 9], list(range(100, 700)) + [4, 5, 9], list(range(100, 700)) + [6, 9]]


@pytest.mark.parametrize("policy", ["full", "room", "room-spans", "room-both", "room-recent", "shift", "truncate"])
def test_every_question_is_its_shared_reading_and_its_own_suffix(policy):
    r = ld.reading(policy, PROMPTS, 256, 32, n_keep=10)
    for q, p in enumerate(PROMPTS):
        assert r.suffix[q] == tuple(p[len(p) - len(r.suffix[q]):])
        assert r.held[q] == len(r.shared) + len(r.suffix[q])
        if policy == "full":
            assert list(r.shared) + list(r.suffix[q]) == p
        elif policy.startswith("room"):  # the first part room-making reads before it evicts anything
            assert list(r.shared) == p[:ld.room_first_part(256, 32)] and list(r.shared) + list(r.suffix[q]) == p
        else:  # the first tokens and the newest: what fits with the answer, for the longest question too
            keep = 4 if policy == "truncate" else 10
            assert list(r.shared[:keep]) == p[:keep] and r.held[q] <= 256 - 32 - 1
            assert list(r.shared[keep:]) + list(r.suffix[q]) == p[len(p) - (r.held[q] - keep):]
    if policy == "truncate":  # Ollama keeps all that fits (for the longest question)
        assert max(r.held) == 256 - 32 - 1
    if policy == "shift":  # llama-server discards whole blocks of half the rest after n_keep
        block = (256 - 32 - 1 - 10) // 2
        assert (len(PROMPTS[0]) - (max(r.held) - 10) - 10) % block == 0


def test_a_reading_is_refused_where_nothing_is_the_questions_own():
    with pytest.raises(ValueError, match="every question's prompt must end in tokens of its own"):
        ld.reading("full", [[1, 2, 3], [1, 2, 3]], 256, 32, 4)
    with pytest.raises(ValueError, match="reads nothing"):
        ld.reading("server", PROMPTS, 256, 32, 4)


def test_wilson_and_the_report():
    lo, hi = wilson(7, 10)
    assert (round(lo, 2), round(hi, 2)) == (0.40, 0.89)  # docs/results.md's 0.70 [0.40, 0.89]
    assert wilson(0, 0) == (0.0, 1.0) and wilson(0, 5)[0] == 0.0
    base = dict(model="m", n_ctx=256, length=2.0, doc=0)
    depths = [0.1, 0.3, 0.9]
    rows = [dict(base, policy="full", question=q, correct=c, ttft_s=2.0, decode_tok_s=10.0, cost_s=1.0,
                 depth=depths[q], fact_held=1.0) for q, c in enumerate([True, True, False])]
    rows += [dict(base, policy="room", question=q, correct=c, ttft_s=4.0, decode_tok_s=20.0, cost_s=3.0,
                  depth=depths[q], fact_held=h) for q, (c, h) in enumerate([(True, 1.0), (False, 0.5), (True, 1.0)])]
    rows += [dict(base, policy="server", question=q, correct=False, ttft_s=None, decode_tok_s=None, cost_s=0.0)
             for q in range(3)]
    s = {x["policy"]: x for x in summarize(rows)}
    assert (s["room"]["correct"], s["room"]["wins"], s["room"]["losses"], s["room"]["cost_s"]) == (2, 1, 1, 3.0)
    assert s["server"]["accuracy"] == 0 and s["server"]["cost_s"] is None
    md = markdown(list(s.values()))
    assert "| 256 | 2× | room, ranked by the question, pooled cells | 2/3 |" in md and "| 1 / 1 | 2/3 |" in md
    assert (s["room"]["whole"], s["room"]["recorded"], s["room"]["quarters"]) == (2, 3, [[1, 1], [0, 1], [0, 0], [1, 1]])
    assert "| 256 | 2× | room, ranked by the question, pooled cells | 1/1 · 0/1 · 0/0 · 1/1 |" in md


# --- SmolLM2 --------------------------------------------------------------------------------------------------

def make_run(smollm2_path, out, policies, questions=2):
    return ld.LongDocRun(smollm2_path, out, docs=1, questions=questions, n_ctxs=[256], lengths=[1.5],
                         policies=policies, threads=THREADS, max_tokens=16)


def test_rows_are_written_per_question_and_a_rerun_skips_them(smollm2_path, tmp_path):
    out = tmp_path / "rows.jsonl"
    seen = []
    with make_run(smollm2_path, out, ["truncate", "server"]) as run:
        assert run.plan()["runs_left"] == 2 and run.plan()["rows"] == 4
        res = run.run(progress=lambda done, total: seen.append((done, total, len(lines(out)))))
    assert seen == [(1, 4, 1), (2, 4, 2), (3, 4, 3), (4, 4, 4)]  # each row is in the file when it is told
    rows = lines(out)
    assert res["rows_written"] == 4 and [(r["policy"], r["question"]) for r in rows] == [
        ("truncate", 0), ("truncate", 1), ("server", 0), ("server", 1)]
    for r in rows[:2]:
        assert r["expected"].isdigit() and len(r["expected"]) == 4 and 0 < r["depth"] < 1
        assert r["ttft_s"] >= r["shared_s"] > 0 and r["own_s"] > 0 and r["read_tokens"] <= 256 - 16 - 1
        assert r["correct"] == (r["expected"] in r["answer"])
        assert r["machine"] and len(r["library"]) == 16  # where the row was made
    with make_run(smollm2_path, out, ["truncate", "server"]) as run:  # everything there: nothing runs
        assert run.units() == [] and run.plan()["runs_left"] == 0
        assert run.run()["rows_written"] == 0 and not run._engines
    out.write_text("".join(json.dumps(r) + "\n" for r in rows[:1]) + '{"cut": ')  # an interrupted write
    with make_run(smollm2_path, out, ["truncate", "server"]) as run:
        assert [(u[2], u[3]) for u in run.units()] == [("truncate", [1]), ("server", [0, 1])]
        assert run.run()["rows_written"] == 3
    again = read_rows(out)
    assert len(again) == 4 and {json.dumps(r, sort_keys=True) for r in again[:1]} == {
        json.dumps(rows[0], sort_keys=True)}


def test_llama_server_is_a_400_with_accuracy_0_and_no_run(smollm2_path, tmp_path):
    out = tmp_path / "rows.jsonl"
    with make_run(smollm2_path, out, ["server"]) as run:
        assert run.plan()["runs_left"] == 0  # nothing to run: the rows are what llama-server answers
        run.run()
        assert "full" not in run._engines
    rows = lines(out)
    assert len(rows) == 2 and all(r["correct"] is False and r["answer"] == "" and r["ttft_s"] is None
                                  and r["finish"] == "refused" and r["prompt_tokens"] > 256 for r in rows)
    assert summarize(rows)[0]["accuracy"] == 0


def test_the_restored_reading_answers_as_a_fresh_prefill(smollm2_path, tmp_path):
    """The full cache: the document prefilled once, saved, restored per question, gives the greedy tokens
    of a fresh prefill of the whole prompt."""
    with make_run(smollm2_path, tmp_path / "rows.jsonl", ["full"]) as run:
        cell = run.cells[0]
        eng = run.engine("full", cell)
        doc = run.document(cell, 0)
        prompts = [run.prompter.tokens(doc.message(q)) for q in range(ld.FACTS)]
        r = ld.reading("full", prompts, cell.n_ctx, run.max_tokens, eng.n_keep)
        assert len(r.shared) > 300  # the document is read once
        snap, _ = ld.read_shared(eng, r)
        for q in range(2):
            restored = ld.ask(eng, snap, r.suffix[q], run.max_tokens)
            eng.reset()
            fresh = eng.generate(prompts[q], max_tokens=run.max_tokens, add_special=False)
            assert restored["tokens"] == fresh.tokens, (restored["answer"], fresh.text)
            assert restored["held"] == len(prompts[q])


def test_the_plan_from_a_given_pilot(cli, tmp_path):
    out = tmp_path / "rows.jsonl"
    res = cli("eval", "longdoc", "--docs", "2", "--n-ctx", "256", "--lengths", "2,4", "--pilot-s", "10",
              "--plan-only", "--out", out)
    assert res.exit_code == 0, res.output
    # 2 docs x 4 questions x 2 cells x 6 policies that run; 10 s at 4x, 5 s at 2x: 48 x 10 + 48 x 5 s
    assert "8 questions per cell" in res.output and "96 question runs left" in res.output
    assert "estimated 0.2 h" in res.output and not out.exists()
    res = cli("eval", "longdoc", "--report", "--out", tmp_path / "none.jsonl")
    assert res.exit_code == 2 and "no such rows file" in res.output


def test_the_command_pilots_plans_runs_and_reports_then_resumes(cli, tmp_path):
    out = tmp_path / "rows.jsonl"
    args = ("eval", "longdoc", "--docs", "2", "--questions", "1", "--n-ctx", "256", "--lengths", "1.5",
            "--policies", "truncate,server", "--threads", THREADS, "--max-tokens", "8", "--quiet", "--out", out)
    res = cli(*args)
    assert res.exit_code == 0, res.output
    assert "pilot at 1.5× n_ctx 256, s per question: truncate" in res.output  # measured first, its rows kept
    assert "| 256 | 1.5× | truncation (Ollama) |" in res.output and "4 rows written (0 already there)" in res.output
    assert len(lines(out)) == 4
    res = cli(*args)  # everything is there: no pilot, nothing runs
    assert res.exit_code == 0 and "pilot:" not in res.output and "0 question runs left; nothing to run" in res.output
    assert "0 rows written (4 already there)" in res.output


def test_the_second_question_is_the_next_turn_about_another_fact(smollm2_path, tmp_path):
    """--second: after each answer the next turn asks about another fact, in the same conversation. With the full
    cache the second answer is a fresh run's on the rendered two-turn conversation; truncation's reading leaves
    no room for a second turn (refused, as it never makes room); the rows are apart from the one-question
    mode's (turns=2) and reported in a table of their own."""
    out = tmp_path / "rows.jsonl"
    with ld.LongDocRun(smollm2_path, out, docs=1, questions=1, n_ctxs=[256], lengths=[1.5], threads=THREADS,
                       policies=["full", "room-both", "truncate"], max_tokens=16, second=True) as run:
        run.run()
        rows = {r["policy"]: r for r in lines(out)}
        doc = run.document(run.cells[0], 0)
        eng = run.engine("full", run.cells[0])
        pr = run.prompter
        convo = pr.render([("user", doc.message(0)), ("assistant", rows["full"]["answer"]),
                           ("user", ld.QUESTION.format(**doc.facts[2].__dict__))])
        eng.reset()
        fresh = eng.generate(eng.model.tokenize(convo, add_special=True), max_tokens=16, add_special=False)
        assert rows["full"]["second_answer"] == fresh.text
        with ld.LongDocRun(smollm2_path, out, docs=1, questions=1, n_ctxs=[256], lengths=[1.5],
                           policies=["full"], threads=THREADS, max_tokens=16) as one:
            assert len(one.units()) == 1  # the one-question row is not among the second mode's
    assert set(rows) == {"full", "room-both", "truncate"}
    for r in rows.values():
        assert r["turns"] == 2 and r["second"] == 2 and r["second_expected"] == doc.facts[2].code
        assert r["second_correct"] == (r["second_expected"] in r["second_answer"])
    assert "second_error" in rows["truncate"] and rows["truncate"]["second_answer"] == ""
    assert "second_error" not in rows["room-both"] and rows["room-both"]["room_evicted"] > 0
    assert rows["full"]["fact_held"] == rows["full"]["second_fact_held"] == 1.0  # the full cache holds every fact
    assert 0 <= rows["room-both"]["second_fact_held"] <= 1 and rows["truncate"]["fact_held"] <= 1
    s = {x["policy"]: x for x in summarize(list(rows.values()))}
    assert s["room-both"]["turns"] == 2 and s["room-both"]["second_correct"] == int(rows["room-both"]["second_correct"])
    md = markdown(list(s.values()))
    assert "## The second question" in md and "second accuracy (95 % Wilson)" in md

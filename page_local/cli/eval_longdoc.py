"""`page-local eval longdoc`: long documents read once per document, several questions each
(eval/longdoc.py); a plan with its estimated hours, a progress bar, then the report. Resumable: run the
same command again."""

from __future__ import annotations

import time
from pathlib import Path

import click

from page_local.cli.common import fail, load_options, model_option, one_line_errors, resolve_model, threads_option


def _list(value: str, kind, what: str) -> list:
    try:
        out = [kind(v.strip()) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a list of numbers", param_hint=what) from None
    if not out:
        raise click.BadParameter("give at least one value", param_hint=what)
    return out


def _plan_text(plan: dict, hours: float | None, source: str) -> str:
    cells = ", ".join(f"{L:g}× n_ctx {n}" for n, L in plan["cells"])
    est = ("nothing to run" if not plan["runs_left"] else
           f"estimated {hours:.1f} h ({source})" if hours is not None else "no estimate (no pilot measured)")
    return (f"plan: {plan['model']}; {plan['docs']} documents × {plan['questions_per_doc']} questions = "
            f"{plan['questions_per_cell']} questions per cell; cells: {cells}; "
            f"policies: {', '.join(plan['policies'])}\n"
            f"      {plan['rows']} rows, {plan['rows_done']} already there; {plan['runs_left']} question runs left; "
            f"{est}")


@click.command("longdoc")
@model_option
@click.option("--docs", default=25, show_default=True, type=click.IntRange(min=1), help="Documents per cell.")
@click.option("--questions", default=4, show_default=True, type=click.IntRange(1, 4),
              help="Questions per document (one per fact; facts sit in each quarter of its depth).")
@click.option("--n-ctx", "n_ctxs", default="512,1024", show_default=True,
              help="Comma-separated contexts every policy but the full cache gets.")
@click.option("--lengths", default="2,4", show_default=True, help="Comma-separated document lengths, × n_ctx.")
@click.option("--policies", default="full,room,room-spans,room-recent,shift,truncate,server", show_default=True,
              help="Comma-separated (page_local/eval/longdoc.py says what each does).")
@click.option("--max-tokens", "max_tokens", default=32, show_default=True, type=click.IntRange(1, 256),
              help="Greedy answer tokens, at most.")
@click.option("--seed", default=42, show_default=True, type=click.IntRange(min=0))
@click.option("--out", "out", default=None, type=click.Path(dir_okay=False),
              help="Rows JSONL (appended to; a rerun skips the rows there; default results/longdoc-<model>.jsonl).")
@click.option("--pilot-s", "pilot_s", default=None, type=click.FloatRange(min=0),
              help="Seconds per question per policy at the largest cell, for the plan; default: measure a "
                   "3-question pilot first (its rows are kept).")
@click.option("--second", is_flag=True,
              help="Second-question mode: after each answer, the next turn asks about another fact of the document "
                   "(rows with turns=2; give them their own --out).")
@click.option("--haystack", type=click.Choice(["generated", "prose"]), default="generated", show_default=True,
              help="The documents' text: generated sentences, or real prose (Debian's licences, the Python "
                   "documentation of python3-doc, GNU manuals; eval/longdoc_prose.py) with half of the questions "
                   "paraphrased (rows with haystack=prose; give them their own --out).")
@click.option("--plan-only", is_flag=True, help="Print the plan (and the pilot's estimate) and stop.")
@click.option("--report", "report", is_flag=True, help="Print the report of --out and run nothing.")
@threads_option
@click.option("--quiet", is_flag=True, help="No progress bar.")
@load_options
def eval_longdoc(model, docs, questions, n_ctxs, lengths, policies, max_tokens, seed, out, second, haystack, pilot_s,
                 plan_only, report, threads, quiet, **engine_options):
    """Long documents (2× and 4× n_ctx) with facts spread over them, several questions each: the full cache,
    room on demand, context shift, truncation and llama-server, one reading per document and policy."""
    from page_local.cli.eval import _Bar
    from page_local.eval.longdoc import POLICIES, LongDocRun, default_out
    from page_local.eval.longdoc_report import markdown, summarize
    from page_local.eval.rows import read_rows

    policy_list = [p.strip() for p in policies.split(",") if p.strip()]
    bad = [p for p in policy_list if p not in POLICIES]
    if bad or not policy_list:
        raise click.BadParameter(f"unknown policies {', '.join(bad) or '(none)'}; choose from {', '.join(POLICIES)}",
                                 param_hint="'--policies'")
    n_list, l_list = _list(n_ctxs, int, "'--n-ctx'"), _list(lengths, float, "'--lengths'")
    path = resolve_model(model, answers="eval longdoc")
    out = Path(out) if out is not None else default_out(path, second, haystack)
    if report:
        if not out.is_file():
            fail(f"no such rows file: {out}", 2)
        with one_line_errors():
            click.echo(markdown(summarize(read_rows(out))))
        return
    t0 = time.perf_counter()
    try:
        with one_line_errors(), LongDocRun(path, out, docs=docs, questions=questions, n_ctxs=n_list, lengths=l_list,
                                           policies=policy_list, max_tokens=max_tokens, seed=seed, threads=threads,
                                           engine_options=engine_options, second=second,
                                           haystack=haystack) as run:
            plan = run.plan()
            cell = (max(n_list), max(l_list))
            hours, source, piloted = None, "", 0
            if pilot_s is not None:
                hours = run.estimate_hours({p: pilot_s for p in policy_list}, cell)
                source = f"--pilot-s {pilot_s:g} s per question per policy at {cell[1]:g}× n_ctx {cell[0]}"
            elif plan["runs_left"]:
                click.echo(f"pilot: {len(policy_list)} policies × up to 3 questions of one document ...", err=True)
                p = run.pilot()
                piloted = p["rows_written"]
                if p["cost_s"]:
                    cell = p["cell"]
                    hours = run.estimate_hours(p["cost_s"], cell)
                    costs = ", ".join(f"{k} {v:.1f}" for k, v in p["cost_s"].items())
                    source = f"pilot at {cell[1]:g}× n_ctx {cell[0]}, s per question: {costs}; in {p['wall_s']:.0f} s"
            click.echo(_plan_text(run.plan(), hours, source), err=True)
            if plan_only:
                return
            with _Bar(quiet) as bar:
                res = run.run(progress=bar)
    except KeyboardInterrupt:
        fail(f"interrupted; finished rows are in {out} (run the same command again to resume)", 1)
    with one_line_errors():
        click.echo(markdown(summarize(read_rows(out))))
    click.echo(f"{res['rows_written'] + piloted} rows written ({res['rows_present'] - piloted} already there) in "
               f"{time.perf_counter() - t0:.1f} s -> {out}", err=True)

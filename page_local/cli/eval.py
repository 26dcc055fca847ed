"""`page-local eval run` and `page-local eval report` (exit codes: 0 ok, 2 usage, 1 runtime error)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from page_local import defaults
from page_local.cli.common import (
    BudgetType,
    evictor_option,
    fail,
    load_options,
    model_option,
    one_line_errors,
    resolve_model,
    threads_option,
)
from page_local.verify import VERIFY_CAP

DEFAULT_BUDGETS = "0.5,0.25,0.125,0.0625"


def _csv(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _budgets(value: str) -> list:
    t = BudgetType()
    out = []
    for v in _csv(value):
        try:
            out.append(t.convert(v, None, None))
        except click.BadParameter as e:
            raise click.BadParameter(e.message, param_hint="'--budgets'") from None
    if not out:
        raise click.BadParameter("give at least one budget", param_hint="'--budgets'")
    return out


@click.group("eval")
def eval_group():
    """Evaluate evictors and gates on RULER-style tasks, and report the results."""


@eval_group.command("run")
@model_option
@click.option("--tasks", default=None, help="Comma-separated generated tasks, e.g. niah_single_1,vt "
                                            "(with --input: only these tasks of the file).")
@click.option("--n", "n", default=None, type=click.IntRange(min=1),
              help="Samples per task (default 50; with --input: all, or at most N per task).")
@click.option("--length", default=2048, show_default=True, type=click.IntRange(min=64),
              help="Target tokens per sample (prompt + the task's answer budget) for generated tasks.")
@click.option("--budgets", default=DEFAULT_BUDGETS, show_default=True,
              help="Comma-separated budgets: ratios (0.25) or counts (1024).")
@click.option("--evictors", default=defaults.EVICTOR, show_default=True, help="Comma-separated evictors.")
@click.option("--gates", default="always,page,verify", show_default=True,
              help="Comma-separated gate modes among always, page, verify, page+verify (the full cache is "
                   "always evaluated).")
@click.option("--out", "out", default=None, type=click.Path(dir_okay=False),
              help="Results JSONL (appended to and resumed; default results/eval-<model>-<length>.jsonl).")
@click.option("--input", "input_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Read samples from a RULER jsonl or kvpress file instead of generating them.")
@threads_option
@click.option("--n-ctx", "n_ctx", default=None, type=click.IntRange(min=64),
              help="Context size (default: the longest prompt + its answer budget, rounded up).")
@click.option("--seed", default=42, show_default=True, type=click.IntRange(min=0))
@click.option("--verify-m", "verify_m", default=VERIFY_CAP, show_default=True, type=click.IntRange(1, 256),
              help="verify's cap: the full cache's answer, up to its end or this many tokens, is "
                   "teacher-forced on the evicted cache and scored (page_local/verify.py).")
@click.option("--query-agnostic", is_flag=True,
              help="Choose the keep set from the context alone; the question is decoded after eviction.")
@click.option("--system", default=None, help="A system prompt (default: the chat template's own).")
@click.option("--plain", is_flag=True,
              help="No chat template (base models): the user text, a blank line, then the answer prefix.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@load_options
def eval_run(model, tasks, n, length, budgets, evictors, gates, out, input_path, threads, n_ctx, seed, verify_m,
             query_agnostic, system, plain, quiet, n_gpu_layers, rpc, attention_settings, allow_long_context):
    """Run every sample under the full cache and every evictor x budget x gate, from one prefill each."""
    from page_local.eval.runner import EVAL_GATES, run_eval
    from page_local.evictors import EVICTORS

    task_list = _csv(tasks)
    if not task_list and input_path is None:
        raise click.UsageError("give --tasks (generated tasks) or --input FILE")
    if input_path is None:
        from page_local.tasks.synthetic import TASKS

        bad = [t for t in task_list if t not in TASKS]
        if bad:
            raise click.BadParameter(f"unknown task(s) {', '.join(bad)}; generated tasks: {', '.join(TASKS)}",
                                     param_hint="'--tasks'")
    budget_list = _budgets(budgets)
    ev_list = _csv(evictors)
    bad = [e for e in ev_list if e not in EVICTORS]
    if bad or not ev_list:
        raise click.BadParameter(f"unknown evictor(s) {', '.join(bad) or '(none)'}; choose from "
                                 f"{', '.join(sorted(EVICTORS))}", param_hint="'--evictors'")
    gate_list = _csv(gates)
    bad = [g for g in gate_list if g not in EVAL_GATES]
    if bad:
        raise click.BadParameter(f"unknown gate mode(s) {', '.join(bad)}; choose from {', '.join(EVAL_GATES)}",
                                 param_hint="'--gates'")
    if n is None and input_path is None:
        n = 50
    if out is None:
        name = Path(str(model)).stem if model else "default"
        out = f"results/eval-{name}-{'input' if input_path else length}.jsonl"

    path = resolve_model(model, answers="eval")
    t0 = time.perf_counter()
    try:
        # the bar is left first, so that an error's one line is not drawn over
        with one_line_errors(), _Bar(quiet) as bar:
            res = run_eval(path, tasks=task_list or None, n=n, length=length, budgets=budget_list,
                           evictors=ev_list, gates=gate_list, out=out, seed=seed, threads=threads, n_ctx=n_ctx,
                           query_agnostic=query_agnostic, verify_m=verify_m, progress=bar, input=input_path,
                           system=system, plain=plain, n_gpu_layers=n_gpu_layers, rpc=rpc,
                           attention_settings=attention_settings, allow_long_context=allow_long_context)
    except KeyboardInterrupt:
        fail(f"interrupted; finished samples are in {out} (run the same command again to resume)", 1)
    if res.get("profile_warning"):
        click.echo(f"warning: {res['profile_warning']}", err=True)
    per = res.get("per_sample_s")
    click.echo(f"{res['rows_written']} rows written ({res['rows_present']} already there) for "
               f"{res['samples_run']} of {res['samples']} samples in {time.perf_counter() - t0:.1f} s"
               + (f" ({per:.1f} s per sample)" if per else "") + f" -> {res['out']}")


class _Bar:
    """run_eval's progress(done, total) as a rich bar of rows, drawn from the first call (rows resumed
    from an earlier run are in `done`, so they do not skew the ETA); quiet draws nothing."""

    def __init__(self, quiet: bool):
        self.quiet, self.progress, self.task = quiet, None, None

    def __call__(self, done: int, total: int) -> None:
        if self.quiet:
            return
        if self.progress is None:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.progress = Progress(TextColumn("[bold]eval[/]"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("rows"), TimeElapsedColumn(), TextColumn("ETA"),
                                     TimeRemainingColumn(), transient=False)
            self.progress.start()
            self.task = self.progress.add_task("eval", total=total, completed=done)
        else:
            self.progress.update(self.task, completed=done)

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


@eval_group.command("report")
@click.argument("results", type=click.Path(dir_okay=False))
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Folder for report.md, summary.json and the plots (default: <results>_report).")
@click.option("--profile", default=None, type=click.Path(dir_okay=False),
              help="A calibration profile (JSON from `page-local calibrate`): adds the gate 'PAGE (z)', the "
                   "PAGE gate re-decided from each input's D under it, beside the raw rule.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of markdown.")
def eval_report(results, out_dir, profile, as_json):
    """Write report.md + PNG plots for a results file and print the markdown."""
    from page_local.eval.report import write_report

    if not Path(results).is_file():
        fail(f"no such results file: {results}", 2)
    try:
        md = write_report(results, out_dir, profile=profile)
    except (ValueError, OSError) as e:  # a results or profile file that cannot be read is not a usage error
        fail(str(e), 1)
    if as_json:
        click.echo(json.dumps(json.loads((md.parent / "summary.json").read_text(encoding="utf-8"))))
    else:
        click.echo(md.read_text(encoding="utf-8"))
        click.echo(f"[report written to {md}]", err=True)



@eval_group.command("conversations")
@model_option
@click.option("--n", "n", default=6, show_default=True, type=click.IntRange(min=1), help="Conversations.")
@click.option("--turns", default=6, show_default=True, type=click.IntRange(1, 8),
              help="Turns per conversation (a document pasted every other turn, one question each); 1: the "
                   "long-document family (one document of --lengths x --n-ctx, its question at the end).")
@click.option("--lengths", default="1,2,4", show_default=True,
              help="Comma-separated conversation lengths, in units of --n-ctx.")
@click.option("--n-ctx", "n_ctx", default=1024, show_default=True, type=click.IntRange(min=128),
              help="The context every policy but the full cache gets.")
@click.option("--policies", default="full,verify,page,shift,truncate", show_default=True,
              help="Comma-separated among full, verify, page, park, room, shift, truncate and, to compare, "
                   "room-recent, refuse, always, park-always, park-search (page_local/eval/conversations.py says "
                   "what each does).")
@click.option("--budget", default=str(defaults.BUDGET), show_default=True, type=BudgetType(),
              help="page-local's speed budget: a share of the conversation.")
@evictor_option
@click.option("--max-tokens", "max_tokens", default=32, show_default=True, type=click.IntRange(1, 512),
              help="Greedy answer tokens per turn, at most.")
@click.option("--seed", default=42, show_default=True, type=click.IntRange(min=0))
@click.option("--summaries", is_flag=True,
              help="A turn that pastes a document asks for its summary instead (a long answer: give --max-tokens "
                   "above the check's 64); the later turns' questions stay short: they are what it measures.")
@click.option("--verify-tokens", "verify_tokens", default=None, type=click.IntRange(1, 256),
              help="The check's span (default: the engine's, 64). Shorter: more long answers pass their check and go "
                   "on over a parked cache, what the later questions then read.")
@click.option("--out", "out", default=None, type=click.Path(dir_okay=False),
              help="Results JSONL (appended to and resumed; default results/conversations-<model>-<n_ctx>.jsonl).")
@click.option("--report-dir", "report_dir", default=None, type=click.Path(file_okay=False),
              help="Where report.md and the plot go (default: <out>_report).")
@threads_option
@click.option("--quiet", is_flag=True, help="No progress bar.")
@load_options
def eval_conversations(model, n, turns, lengths, n_ctx, policies, budget, evictor, max_tokens, seed, summaries,
                       verify_tokens, out,
                       report_dir, threads, quiet, n_gpu_layers, rpc, attention_settings, allow_long_context):
    """Multi-turn chats over long documents at 1x, 2x and 4x n_ctx: the full cache, page-local, llama.cpp's
    context shift and Ollama's truncation on the same conversations; then the report (run it again to resume)."""
    from page_local.eval.conversations import ALL_POLICIES, run_conversations
    from page_local.eval.conversations_report import write_report

    try:
        length_list = [float(v) for v in _csv(lengths)]
    except ValueError:
        raise click.BadParameter(f"{lengths!r} is not a list of numbers", param_hint="'--lengths'") from None
    if not length_list or any(not L > 0 for L in length_list):
        raise click.BadParameter("give lengths above 0, e.g. 1,2,4", param_hint="'--lengths'")
    policy_list = _csv(policies)
    bad = [p for p in policy_list if p not in ALL_POLICIES]
    if bad or not policy_list:
        raise click.BadParameter(f"unknown policies {', '.join(bad) or '(none)'}; choose from "
                                 f"{', '.join(ALL_POLICIES)}",
                                 param_hint="'--policies'")
    if out is None:
        name = Path(str(model)).stem if model else "default"
        out = f"results/conversations-{name}-{n_ctx}.jsonl"
    path = resolve_model(model, answers="eval")
    t0 = time.perf_counter()
    try:
        with one_line_errors(), _Bar(quiet) as bar:
            res = run_conversations(path, n=n, turns=turns, lengths=length_list, n_ctx=n_ctx, policies=policy_list,
                                    budget=budget, evictor=evictor, max_tokens=max_tokens, seed=seed, threads=threads, out=out,
                                    progress=bar, n_gpu_layers=n_gpu_layers, rpc=rpc,
                                    attention_settings=attention_settings, allow_long_context=allow_long_context,
                                    summaries=summaries, verify_tokens=verify_tokens)
    except KeyboardInterrupt:
        fail(f"interrupted; finished conversations are in {out} (run the same command again to resume)", 1)
    with one_line_errors():
        md = write_report(out, report_dir)
    click.echo(md.read_text(encoding="utf-8"))
    click.echo(f"{res['rows_written']} rows written ({res['rows_present']} already there) in "
               f"{time.perf_counter() - t0:.1f} s -> {res['out']}; report: {md}", err=True)

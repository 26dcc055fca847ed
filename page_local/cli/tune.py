"""`page-local tune`: measure flash attention on and off on this machine and store which is faster, so that
--flash-attn auto (the default) takes it (engine/attention.py, store/tuning.py)."""

from __future__ import annotations

import json
import time

import click

from page_local.cli.common import (console, json_option, model_option, n_gpu_layers_option, one_line_errors,
                                   progress, resolve_model, threads_option)


def _lengths(text: str) -> tuple[int, ...]:
    try:
        out = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of token counts like 256,1024,2048") from None
    if not out or out[0] < 16:
        raise click.BadParameter(f"give token counts of at least 16, e.g. 256,1024,2048 (got {text!r})")
    return out


@click.command("tune")
@model_option
@threads_option
@click.option("--lengths", default="256,1024,2048", show_default=True,
              help="Cache sizes (tokens) at which a decode step is timed; longer contexts are extrapolated.")
@click.option("--n-ctx", "n_ctx", default=None, type=click.IntRange(min=16),
              help="Say what auto picks for this context size (default: the model's trained context, capped at 8192).")
@click.option("--show", is_flag=True, help="Show the stored tuning and what auto picks; measure nothing.")
@click.option("--forget", is_flag=True, help="Remove the stored tuning (auto falls back to the backend's default).")
@click.option("--busy-ok", is_flag=True,
              help="Store the tuning even when other processes took the cores it needs while it measured "
                   "(by default it is not stored then: its timings would describe the load).")
@n_gpu_layers_option
@json_option()
def tune_cmd(model, threads, lengths, n_ctx, show, forget, busy_ok, n_gpu_layers, rpc, as_json):
    """Time flash attention on and off (prefill and one-token decode at a few cache sizes) for this model,
    machine, device and thread count, and store the result: later runs with --flash-attn auto use it.
    Takes about a minute for the embedded model on a 2-core CPU; run it alone."""
    from page_local.engine import attention
    from page_local.native.runtime import Model
    from page_local.store.tuning import Tuning, now, read_tuning, remove_tuning, save_tuning

    lens = _lengths(lengths)
    path = resolve_model(model)
    out = console(stderr=True)
    with one_line_errors():
        with Model(path, n_gpu_layers=n_gpu_layers, rpc=rpc) as m:
            key = attention.tuning_key(path, m, threads)
            ctx_len = n_ctx or min(m.n_ctx_train or 8192, 8192)
            if forget:
                gone = remove_tuning(key)
                click.echo(json.dumps({"removed": gone}) if as_json else
                           ("removed the stored tuning" if gone else "no tuning was stored for this setting"))
                return
            status = read_tuning(key)
            if status.warning:
                click.echo(f"warning: {status.warning}", err=True)
            if show:
                tuning = status.tuning
            else:
                t0 = time.perf_counter()
                with progress(out) as bar, attention.HostMeter() as host:
                    task = bar.add_task("tuning", total=1.0)
                    points = attention.measure(m, threads, lens,
                                               progress=lambda text, frac: bar.update(task, description=text,
                                                                                      completed=frac))
                if attention.disturbed(host.others_cores, threads) and not busy_ok:
                    raise click.ClickException(
                        f"not stored: {attention.busy_note(host.others_cores, threads)}. Run it again when the "
                        "machine is quiet, or add --busy-ok to store it anyway")
                tuning = Tuning(key, points, now(), time.perf_counter() - t0, round(host.others_cores, 3))
                save_tuning(tuning)
            choice = attention.resolve("auto", "f16", str(m.layers_device), ctx_len,
                                       tuning.points if tuning else None)
    result = {"key": key.to_dict(), "path": str(status.path), "tuned": tuning is not None,
              "n_ctx": ctx_len, "auto": choice.to_dict()}
    if tuning is not None:
        result.update(seconds=round(tuning.seconds, 1), created=tuning.created, others_cores=tuning.others_cores,
                      points={s: [list(p) for p in tuning.points[s]] for s in ("on", "off")},
                      bands=attention.bands(tuning.points, max(ctx_len, tuning.points["on"][-1][0])))
    if as_json:
        click.echo(json.dumps(result))
        return
    if tuning is None:
        click.echo(f"no tuning stored for {key.device}, {key.threads} threads ({status.path}); "
                   f"auto: {choice.why}")
        return
    click.echo(f"{key.machine}; {key.device}; {key.threads} threads"
               + (f"; measured in {tuning.seconds:.0f} s" if not show else f"; measured {tuning.created}")
               + (f"; other processes used {tuning.others_cores:.2f} cores meanwhile"
                  if tuning.others_cores is not None else ""))
    click.echo(f"{'cells':>6} {'prefill ms/tok on/off':>22} {'decode ms on/off (spread)':>27}")
    for on, off in zip(tuning.points["on"], tuning.points["off"]):
        spread = f" ({on[3]:.1f} / {off[3]:.1f})" if len(on) > 3 and len(off) > 3 else ""
        click.echo(f"{on[0]:>6} {on[1]:>10.2f} / {off[1]:<9.2f} {on[2]:>8.1f} / {off[2]:<8.1f}{spread}")
    for b in result["bands"]:
        click.echo(f"  {b['from']:>5}-{b['to']:<5} cells: flash attention {b['flash_attn']} "
                   f"({b['on_ms']:.1f} on, {b['off_ms']:.1f} off: ms per token read and written)")
    click.echo(f"auto at n_ctx {ctx_len}: {choice.why}")
    if not show:
        click.echo(f"stored in {status.path}")

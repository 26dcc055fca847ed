"""`page-local rpc-server`: the ggml-rpc-server built with this library (docs/rpc.md), started with
page-local's defaults (loopback, port 50052). It replaces this process (exec), so signals reach it."""

from __future__ import annotations

import os

import click

from page_local.cli.common import fail, one_line_errors
from page_local.cli.serve import is_loopback


@click.command("rpc-server")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to listen on. RPC is unauthenticated: loopback or a trusted LAN's address only.")
@click.option("--port", default=50052, show_default=True, type=click.IntRange(1, 65535))
@click.option("--threads", default=None, type=click.IntRange(1), help="Threads of its CPU device (default: its own).")
@click.option("--device", default=None, metavar="NAME", help="A device to offer, e.g. CUDA0 (default: its GPUs, else its CPU).")
@click.option("--cache", is_flag=True, help="Cache received weights on disk (faster reloads of the same model).")
def rpc_server_cmd(host, port, threads, device, cache):
    """Offer this machine's devices to page-local on another host (--rpc HOST:PORT there)."""
    from page_local.native.rpc import has_rpc, rpc_server_path

    with one_line_errors():
        exe = rpc_server_path() if has_rpc() else None
    if exe is None:
        fail("this build of page-local has no ggml-rpc-server: rebuild it with `make setup RPC=1` "
             "(or CMAKE_ARGS=-DPAGE_RPC=ON pip install .)", 1)
    args = [str(exe), "-H", host, "-p", str(port)]
    if threads:
        args += ["-t", str(threads)]
    if device:
        args += ["-d", device]
    if cache:
        args.append("-c")
    if not is_loopback(host):
        click.echo(f"warning: {host} is not loopback; RPC is unauthenticated and unencrypted: anyone who reaches "
                   f"port {port} can use this machine's memory and devices (docs/rpc.md)", err=True)
    click.echo(f"page-local rpc-server: {host}:{port} ({exe.name}); on the main host: --rpc {host}:{port}", err=True)
    os.execv(args[0], args)

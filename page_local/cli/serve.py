"""`page-local serve`: the OpenAI-compatible local server (docs/serve.md), and `page-local bench serve`,
its load test. Both are thin shells: the server is page_local.serve, the load test
page_local.serve.bench. Needs the optional extra: pip install 'page-local[serve]'."""

from __future__ import annotations

import ipaddress
import json
import time

import click

from page_local.cli.common import (
    chat_engine_options,
    disk_cache_options,
    fail,
    model_option,
    n_ctx_option,
    one_line_errors,
    resolve_model,
    show_llama_log,
    sized_n_ctx,
    speed_words,
    threads_option,
)

SERVE_EXTRA = "the server needs the optional [serve] extra: pip install 'page-local[serve]'"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost may resolve to anything
        return False


def read_keys(keys: tuple[str, ...], key_file) -> list[str]:
    """The server's API keys: each --api-key, then the file's (one a line; blank lines and # comments
    skipped), in order, once each. UsageError naming a key's line for one that cannot be sent."""
    found = [(k, "--api-key") for k in keys]
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise click.UsageError(f"cannot read --api-key-file {key_file}: {e}") from None
        listed = [(line.strip(), f"{key_file}:{i}") for i, line in enumerate(lines, 1)]
        listed = [(k, where) for k, where in listed if k and not k.startswith("#")]
        if not listed:
            raise click.UsageError(f"--api-key-file {key_file} holds no key (one key a line)")
        found += listed
    for key, where in found:
        if not key.isascii() or not key.isprintable() or " " in key or not key:
            raise click.UsageError(f"the API key from {where} must be printable ASCII without spaces "
                                   "(it is sent in an HTTP header)")
    return list(dict.fromkeys(k for k, _ in found))


def check_names(allow_hosts: tuple[str, ...], cors_origins: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """--allow-host names and --cors-origin origins, normalized as the guards compare them."""
    from page_local.serve.guards import host_name, origin_of

    hosts = []
    for h in allow_hosts:
        name = "*" if h == "*" else host_name(h)
        if name is None or (name != "*" and ("/" in h or "://" in h)):
            raise click.UsageError(f"--allow-host {h!r} is not a host name or address: give a name like my-pc.lan "
                                   "or an address like 192.168.1.20 (no scheme, no path)")
        hosts.append(name)
    origins = []
    for o in cors_origins:
        origin = origin_of(o)
        if origin is None:
            raise click.UsageError(f"--cors-origin {o!r} is not a web origin: give scheme://host[:port] as the "
                                   "browser shows it (http://localhost:3000), or '*' for any")
        origins.append(origin)
    return hosts, origins


def served_name(path, asked: str | None = None) -> str:
    """The id clients send as "model": the name --model gave (`smollm2`, `llama3.2:3b`, ORG/REPO:QUANT), else
    the name the file is known by (store.models.name_for), else its stem."""
    from pathlib import Path

    from page_local.store import models

    if asked and not Path(asked).expanduser().is_file():
        return asked
    return models.name_for(path) or path.stem


@click.command("serve")
@model_option
@chat_engine_options
@disk_cache_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; anything but loopback needs --api-key.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535))
@click.option("--api-key", "api_keys", envvar="PAGE_LOCAL_API_KEY", multiple=True, metavar="KEY",
              help="Require `Authorization: Bearer KEY` on every route but /health (repeatable: each key sees only "
                   "its own cached conversations; default: $PAGE_LOCAL_API_KEY, keys separated by spaces).")
@click.option("--api-key-file", "api_key_file", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="More keys, one a line (blank lines and # comments skipped); as --api-key.")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME",
              help="Another name clients reach the server by, allowed in the Host header (repeatable; '*' for any). "
                   "Always allowed: localhost, 127.0.0.1, [::1] and the --host address.")
@click.option("--parallel", default=1, show_default=True, type=click.IntRange(1, 64),
              help="Requests served at once: one engine (context) per slot over the same GGUF file.")
@click.option("--queue", default=16, show_default=True, type=click.IntRange(0, 4096),
              help="Requests that may wait for a slot; beyond them: 503 with Retry-After.")
@click.option("--cache-mb", "cache_mb", default=512, show_default=True, type=click.IntRange(0),
              help="Host RAM for the KV caches of conversations pushed out of the slots (LRU).")
@click.option("--max-tokens-limit", "max_tokens_limit", default=None, type=click.IntRange(1),
              help="The largest max_tokens a request may ask for, and the default (default: --n-ctx).")
@click.option("--max-body-kb", "max_body_kb", default=2048, show_default=True, type=click.IntRange(1),
              help="Request bodies over this size get 413.")
@click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
              help="Allow web pages from ORIGIN, e.g. http://localhost:3000 (repeatable; '*' for any). Without it a "
                   "request from another site's page is refused (403), and no CORS headers are sent.")
def serve_cmd(model, reread, park, park_from, ladder, budget, evictor, gate, verify_tokens, on_full, n_ctx, threads,
              n_gpu_layers, rpc, attention_settings, allow_long_context, disk_cache, host, port, api_keys, api_key_file, allow_hosts, parallel,
              queue, cache_mb, max_tokens_limit, max_body_kb, cors_origins):
    """An OpenAI-compatible HTTP server on this machine: /v1/chat/completions, /v1/completions,
    /v1/models, /health. Conversations a client resends are not prefilled again."""
    show_llama_log()
    keys = read_keys(api_keys, api_key_file)
    allow_hosts, cors_origins = check_names(allow_hosts, cors_origins)
    if not is_loopback(host) and not keys:
        raise click.UsageError(f"--host {host} is reachable from other machines: give an --api-key "
                               "(or $PAGE_LOCAL_API_KEY), or bind 127.0.0.1")
    try:
        import uvicorn

        from page_local.serve.app import create_app
        from page_local.serve.backend import Backend, Settings
    except ImportError as e:
        fail(f"{SERVE_EXTRA} ({e})", 1)
    path = resolve_model(model, answers="serve")
    with one_line_errors():
        from page_local.native.runtime import check_gguf

        check_gguf(path)  # a missing or non-GGUF file fails now, in one line, not in the loading thread
    name = served_name(path, model)
    n_ctx, _ = sized_n_ctx(path, n_ctx, attention_settings, n_gpu_layers, rpc, slots=parallel)
    settings = Settings(model_path=path, served_name=name, n_ctx=n_ctx, budget=budget, evictor=evictor, gate=gate,
                        verify_tokens=verify_tokens, on_full=on_full, threads=threads, n_gpu_layers=n_gpu_layers,
                        rpc=rpc, attention_settings=attention_settings, allow_long_context=allow_long_context,
                        parallel=parallel, queue=queue, cache_bytes=cache_mb * 2**20,
                        max_tokens_limit=max_tokens_limit or 0, max_body_bytes=max_body_kb * 1024, api_keys=keys,
                        cors_origins=cors_origins, host=host, allow_hosts=allow_hosts, park=park,
                        park_from=park_from, reread=reread, ladder=tuple(ladder), disk_cache=disk_cache or None)
    backend = Backend(settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # Ctrl-C: the running requests stop now, not after the grace time
            backend.cancel_running()
            super().handle_exit(sig, frame)

    # the grace time only bounds what cancel_running did not stop: a request ends within one token, or one
    # ubatch of its prefill (seconds on a slow CPU), and is then answered (503 "cancelled"), not cut off
    server = Server(uvicorn.Config(create_app(backend), host=host, port=port, log_level="warning",
                                   access_log=False, lifespan="on", timeout_graceful_shutdown=10))
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"page-local serve: http://{shown}:{port}/v1 (model {name}); loading", err=True)

    said_keys = ("no API key" if not keys else "1 API key" if len(keys) == 1
                 else f"{len(keys)} API keys (a conversation cache each)")

    def on_ready():  # in the loading thread: said once the model is loaded and the port is bound
        while not (server.started or server.should_exit or backend.state == "closed"):
            time.sleep(0.05)
        if not server.started or server.should_exit:
            return
        for w in backend.warnings:
            click.echo(f"warning: {w}", err=True)
        park_from = backend.slots[0].engine.park_from if backend.slots else park_from  # the model's, once loaded
        said_budget, said_gate = speed_words(budget, park, park_from, gate, ladder)
        click.echo(f"page-local serve: ready: {parallel} slot{'s' if parallel > 1 else ''}, n_ctx {n_ctx}, "
                   f"{said_gate}, {said_budget}, evictor {evictor}, on full: {on_full}, {said_keys}", err=True)
        page = "127.0.0.1" if host in ("0.0.0.0", "::", "") else shown  # (a wildcard bind: this machine's own)
        click.echo(f"page-local serve: the web UI is at http://{page}:{port}/", err=True)

    def on_error(message: str):
        server.should_exit = True

    backend.start_loading(on_ready, on_error)
    could_not_start = False
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl-C: uvicorn has shut down and re-raised it; a normal way to stop
        click.echo("page-local serve: stopped", err=True)
    except SystemExit:  # uvicorn could not listen (the port is taken, ...) and has logged why
        server.should_exit = could_not_start = True
    finally:
        backend.close()
    if backend.error:
        fail(backend.error, 1)
    if could_not_start:
        fail(f"could not listen on {shown}:{port} (the line above says why); choose another --port", 1)


@click.command("serve")
@model_option
@click.option("--clients", default=8, show_default=True, type=click.IntRange(1, 64),
              help="Concurrent clients, each holding one conversation.")
@click.option("--requests", "n_requests", default=48, show_default=True, type=click.IntRange(1),
              help="Requests in all, shared among the clients (a client's requests are the turns of its chat).")
@click.option("--max-tokens", default=32, show_default=True, type=click.IntRange(1))
@click.option("--parallel", default=2, show_default=True, type=click.IntRange(1, 64),
              help="The server's --parallel.")
@n_ctx_option
@threads_option
@click.option("--peer-python", "peer_python", default=None, metavar="PYTHON",
              help="Instead of the load test: page-local serve next to llama-cpp-python's own server, run by "
                   "PYTHON (a venv with llama-cpp-python[server]): time to first token on turn 6 of a chat, "
                   "throughput with 4 clients, as ratios.")
@click.option("--peer-bin", "peer_bin", default=None, metavar="DIR",
              help="Folder with stock llama-server (default: $PAGE_LOCAL_PEER_BIN or build-peer/bin, which `make "
                   "peer-server` builds). When there is one, the load test is followed by page-local next to it: "
                   "the same --parallel, n_ctx per slot and threads, 1, 2, 4 and 8 clients (and --clients).")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1),
              help="Repetitions of the side by side with stock llama-server (medians).")
@click.option("--no-load-test", "no_load_test", is_flag=True,
              help="Only the side by side with stock llama-server.")
@click.option("--json", "as_json", is_flag=True, help="print one JSON line")
def bench_serve_cmd(model, clients, n_requests, max_tokens, parallel, n_ctx, threads, peer_python, peer_bin, repeats,
                    no_load_test, as_json):
    """Load test of `page-local serve` (started here, twice): every request served alone first, then
    the same requests from concurrent clients (streamed and not, mixed gates); answers compared,
    time to first token, throughput, the server's memory. Then, when stock llama-server is built, both
    servers side by side: throughput and time to first token for 1-8 clients, memory of N slots."""
    from page_local.bench.stock import find_bin
    from page_local.serve.bench import describe, serve_benchmark

    path = resolve_model(model, answers="serve")
    say = None if as_json else (lambda m: click.echo(m, err=True))
    if peer_python:
        from page_local.serve import peer

        with one_line_errors():
            res = peer.peer_comparison(path, peer_python, max_tokens=max_tokens, n_ctx=n_ctx, threads=threads,
                                       progress=say)
        click.echo(json.dumps(res) if as_json else peer.describe(res))
        return
    with one_line_errors():
        stock_bin = find_bin(peer_bin)
    if no_load_test and stock_bin is None:
        fail("--no-load-test: there is no stock llama-server to compare with; `make peer-server` builds it "
             "(or give --peer-bin DIR)", 2)
    res: dict = {}
    if not no_load_test:
        with one_line_errors():
            res = serve_benchmark(path, clients=clients, requests=n_requests, max_tokens=max_tokens,
                                  parallel=parallel, n_ctx=n_ctx, threads=threads, progress=say)
        if not as_json:
            click.echo(describe(res))
    if stock_bin is not None:
        from page_local.serve import peer

        with one_line_errors():
            res["stock"] = peer.stock_comparison(
                path, stock_bin, parallel=parallel, clients=tuple(sorted({*peer.CLIENT_COUNTS, clients})),
                reps=repeats, max_tokens=max_tokens, n_ctx=n_ctx, threads=threads, progress=say)
        if not as_json:
            click.echo(peer.describe_stock(res["stock"]))
    elif not as_json:
        click.echo("stock llama-server: not built (`make peer-server`), not compared")
    if as_json:
        click.echo(json.dumps(res))
    if res.get("errors") or res.get("mismatches"):
        fail(f"{res['errors']} error(s) and {res['mismatches']} answer(s) that differ from the request served alone", 1)

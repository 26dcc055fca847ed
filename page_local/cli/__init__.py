"""`page-local`: the command line, a thin shell over the engine; one module per command (exit codes:
0 ok, 2 usage, 1 runtime error; every error one line on stderr, never a traceback).

click, rich and prompt_toolkit are imported only under page_local/cli/.
"""

from __future__ import annotations

import click

from page_local.cli.bench import bench_group
from page_local.cli.cache import cache_cmd
from page_local.cli.calibrate import calibrate_cmd
from page_local.cli.chat import chat_cmd
from page_local.cli.common import show_llama_log
from page_local.cli.eval import eval_group
from page_local.cli.eval_longdoc import eval_longdoc
from page_local.cli.inspect import inspect_cmd
from page_local.cli.models import models_cmd
from page_local.cli.pull import pull_cmd
from page_local.cli.rpc_server import rpc_server_cmd
from page_local.cli.run import run_cmd
from page_local.cli.serve import bench_serve_cmd, serve_cmd
from page_local.cli.tune import tune_cmd


@click.group()
@click.version_option(package_name="page-local")
def main():
    """page-local: KV-cache eviction for llama.cpp, gated per input by PAGE."""
    show_llama_log()


for _command in (run_cmd, chat_cmd, models_cmd, pull_cmd, calibrate_cmd, inspect_cmd, eval_group, bench_group,
                 serve_cmd, rpc_server_cmd, tune_cmd, cache_cmd):
    main.add_command(_command)
bench_group.add_command(bench_serve_cmd, name="serve")  # beside its server (cli/serve.py)
eval_group.add_command(eval_longdoc)  # eval longdoc (cli/eval_longdoc.py)

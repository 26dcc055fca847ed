"""`page-local pull ORG/REPO[:QUANT]`: a GGUF from the Hugging Face Hub into the Hub's cache
(store/pull.py), then usable by that name everywhere --model is taken."""

from __future__ import annotations

import json

import click

from page_local.cli import common
from page_local.store import pull as hub


@click.command("pull")
@click.argument("ref", metavar="ORG/REPO[:QUANT]")
@click.option("--json", "as_json", is_flag=True,
              help='print {"name", "path", "parts", "size_bytes", "downloaded"} instead of the sentence')
def pull_cmd(ref, as_json):
    """Download a GGUF model from Hugging Face (as `llama-server -hf ORG/REPO:QUANT` chooses it: Q4_K_M when
    no QUANT is given; hf.co/ORG/REPO:QUANT is accepted; split models come whole).

    It goes into the Hugging Face cache ($HF_HUB_CACHE, else ~/.cache/huggingface/hub), where llama.cpp and
    other tools find it too; $HF_TOKEN reaches gated and private repositories, $HF_ENDPOINT another Hub.
    Then: page-local chat --model ORG/REPO:QUANT."""
    from rich.progress import DownloadColumn, TimeRemainingColumn, TransferSpeedColumn

    try:
        hub.parse_ref(ref)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="ORG/REPO[:QUANT]") from None
    console = common.console(stderr=True)
    with common.progress(console, DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn()) as prog:
        task = prog.add_task(f"asking {hub.endpoint()} for {ref}", total=None)

        def on_progress(what: str, done: int, total: int) -> None:
            prog.update(task, description=what, completed=done, total=total or None)

        with common.one_line_errors():
            got = hub.pull(ref, on_progress)
    if as_json:
        click.echo(json.dumps({"name": got.name, "path": str(got.path), "parts": [str(p) for p in got.parts],
                               "size_bytes": got.size, "downloaded": got.downloaded}))
        return
    parts = f" in {len(got.parts)} parts" if len(got.parts) > 1 else ""
    said = "pulled" if got.downloaded else "already here:"
    click.echo(f"{said} {got.name} ({got.size / 1e6:.0f} MB{parts}) at {got.path}")
    click.echo(f"run it: page-local chat --model {got.name}")

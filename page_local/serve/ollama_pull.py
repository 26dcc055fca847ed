"""Ollama's POST /api/pull: a model pulled from the Hugging Face Hub (store/pull.py) on a worker thread, its progress
relayed as Ollama's status lines. Refused for Ollama's library names (page-local does not download from it)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from page_local.serve import model_routes, protocol
from page_local.serve.errors import ApiError, bad
from page_local.serve.http import read_body

PULL_FIELDS = frozenset({"model", "name", "stream", "insecure"})  # insecure: accepted, no effect (https or HF_ENDPOINT)
_pulling: dict = {}  # {"model": name} while a pull runs: one at a time (they share the disk and the link)


class PullStopped(Exception):
    """The client of a streamed pull went away: the download stops at its next chunk (its partial file removed)."""


def pull_route(backend):
    """POST /api/pull: the pull runs on a worker thread (store.pull.pull); a stream relays its progress as
    Ollama's status lines ({"status": "pulling manifest"}, {"status": "pulling FILE", "digest", "total",
    "completed"}, {"status": "verifying sha256 digest"}, {"status": "success"}; a failure is a line {"error"}).
    Without a stream: {"status": "success"}, or the error with status 500 as Ollama answers it."""
    from starlette.responses import JSONResponse, StreamingResponse

    from page_local.errors import ModelInstallError
    from page_local.store import pull as hub

    async def pull(request):
        body = protocol.parse_json(await read_body(request, backend.settings.max_body_bytes))
        for key in body:
            if key not in PULL_FIELDS:
                raise bad(f"field {key} is not supported by page-local's /api/pull; it reads "
                          f"{', '.join(sorted(PULL_FIELDS))}", key, "unsupported_parameter")
        name = body.get("model") or body.get("name")
        if not isinstance(name, str) or not name:
            raise bad("model is required: hf.co/ORG/REPO[:QUANT]", "model", "missing_required_parameter")
        stream = body.get("stream", True)
        if not isinstance(stream, bool):
            raise bad(f"stream must be true or false, got {stream!r}", "stream")
        try:
            hub.parse_ref(name)
        except ValueError:
            raise bad(f"page-local pulls GGUF models from Hugging Face, by hf.co/ORG/REPO[:QUANT]; {name!r} is not "
                      "such a name (page-local does not download from Ollama's library)", "model") from None
        if _pulling:
            raise ApiError(409, f"a pull of {_pulling['model']} is running; pull again when it is done",
                           "pull_running", "model")
        _pulling["model"] = name
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()

        def progress(what: str, done: int, total: int) -> None:
            if stop.is_set():
                raise PullStopped(f"the client of the pull of {name} went away")
            loop.call_soon_threadsafe(events.put_nowait, (what, done, total))

        def finished(_future) -> None:
            _pulling.clear()
            model_routes.forget_others()

        work = loop.run_in_executor(None, hub.pull, name, progress)
        work.add_done_callback(finished)
        if not stream:
            try:
                await work
            except ModelInstallError as e:
                return JSONResponse({"error": str(e)}, status_code=500)
            return JSONResponse({"status": "success"})
        return StreamingResponse(_pull_lines(work, events, stop), media_type="application/x-ndjson")

    return pull


async def _pull_lines(work, events: asyncio.Queue, stop: threading.Event):
    """The NDJSON body of a streamed pull: progress at most every 0.25 s (and each file's end), then the end."""
    def line(obj) -> bytes:
        return (json.dumps(obj) + "\n").encode("utf-8")

    try:
        yield line({"status": "pulling manifest"})
        last = 0.0
        while True:
            get = asyncio.ensure_future(events.get())
            done, _ = await asyncio.wait({get, work}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                break
            what, n, total = get.result()
            if what.startswith("checking "):
                yield line({"status": "verifying sha256 digest"})
            elif time.monotonic() - last >= 0.25 or n == total:
                last = time.monotonic()
                yield line({"status": f"pulling {what}", "digest": what, "total": total, "completed": n})
        error = work.exception()
        if error is not None:
            yield line({"error": " ".join(str(error).split())})
        else:
            got = work.result()
            yield line({"status": f"pulled {got.name}", "path": str(got.path), "total": got.size,
                        "completed": got.size})
            yield line({"status": "success"})
    finally:
        stop.set()  # a client gone mid-stream: the download stops at its next chunk



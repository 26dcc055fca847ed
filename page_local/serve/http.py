"""What every route shares below the routes themselves: reading a body under the size limit, waiting
on something unless the client goes away, collecting a request's events into one answer, the error
response in the OpenAI envelope, readiness and the request's key namespace.

Imported by the OpenAI, Ollama and model routes and by app.py; it imports no route (no serve module
above errors.py and guards.py), so the routes never import app.py or each other.
"""

from __future__ import annotations

import asyncio

from page_local.serve.errors import ApiError
from page_local.serve.guards import NO_KEY


# SSE keep-alive pings: none (OpenAI's streams are data frames only). Said as an interval no stream lasts, not
# as 0: sse-starlette releases before the fix of its issue #206 (2026) started their ping loop with 0 too and sent
# pings without pause (some 30 000 a second), while pyproject allows any release from 2.1
NO_PING = 24 * 3600


def sse_response(events):
    """An SSE response over an async generator of ServerSentEvent, without keep-alive pings."""
    from sse_starlette.sse import EventSourceResponse

    return EventSourceResponse(events, ping=NO_PING, sep="\n")


class Gone(Exception):
    """The client disconnected while its request was waiting or running."""


def error_response(e: ApiError):
    from starlette.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def read_body(request, limit: int) -> bytes:
    """The request's body, at most `limit` bytes (413 from Content-Length before reading, when declared)."""
    too_big = ApiError(413, f"the request body is over this server's limit of {limit} bytes", "request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_big
        chunks.append(part)
    return b"".join(chunks)


async def unless_gone(request, awaitable):
    """Await `awaitable` unless the client disconnects first (then Gone; the awaitable is cancelled)."""
    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watch.cancel()
    if work in done or (work.done() and not work.cancelled() and work.exception() is None):
        return work.result()  # (a result that came with the disconnect is the caller's to clean up)
    work.cancel()
    raise Gone


async def collect(turn, first: tuple) -> tuple[list[str], dict]:
    """A request's events (backend.Turn) from `first` to "done": (the text pieces, the done event's dict);
    an error event is raised."""
    parts, event = [], first
    while True:
        if event[0] == "text":
            parts.append(event[1])
        elif event[0] == "done":
            return parts, event[1]
        elif event[0] == "progress":
            pass
        else:
            raise event[1]
        event = await turn.next()


def ready(backend) -> None:
    """503 unless the model is loaded."""
    if backend.state == "loading":
        raise ApiError(503, "the model is still loading; retry shortly", "model_loading",
                       headers={"Retry-After": "1"})
    if backend.state != "ready":
        raise ApiError(503, f"the server is not ready: {backend.error or backend.state}", "not_ready")


def namespace(request) -> str:
    """The request's key namespace (guards.KeyGuard): whose conversation cache it may reuse."""
    return getattr(request.state, "namespace", NO_KEY)

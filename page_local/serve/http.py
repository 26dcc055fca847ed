"""What every route shares below the routes themselves: reading a body under the size limit, waiting
on something unless the client goes away, collecting a request's events into one answer, a generating
request's way from its slot to its response (run_turn), the error response in the OpenAI envelope,
readiness and the request's key namespace.

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


async def run_turn(request, acquire, start, *, stream, whole, error=error_response, on_first=None):
    """A generating request from its slot to its response: the block every generating route shares.

    acquire   an awaitable giving the request's slot (slots.SlotPool.acquire), awaited unless the client goes
    start     start(slot) -> the running turn (backend.Turn: next() and close())
    stream    stream(turn, first) -> the streamed response, which owns the turn from then on (its body closes
              it); None: the answer is collected and whole(parts, done) makes the response (collect's values)
    error     error(ApiError) -> the response, in the route's error shape
    on_first  on_first() when the first event has come (Ollama's timings)

    The status line waits for the first event: a request refused after the prefill (the conversation does not
    fit) is still a plain error response, not a 200 stream with an error in it. A client gone while its request
    waits or before its answer is whole gets 499 (nobody reads it), and its generation stops within one token.
    """
    from starlette.responses import Response

    try:
        slot = await unless_gone(request, acquire)
    except Gone:
        return Response(status_code=499)
    turn = start(slot)
    try:
        first = await unless_gone(request, turn.next())
        if on_first is not None:
            on_first()
        if first[0] == "error":
            return error(first[1])
        if stream is not None:
            return stream(turn, first)
        parts, done = await unless_gone(request, collect(turn, first))
    except Gone:
        turn.close()
        return Response(status_code=499)
    except ApiError as e:  # a mid-answer error of a request that is not streamed
        return error(e)
    except BaseException:  # the server cancelling the request (shutdown)
        turn.close()
        raise
    return whole(parts, done)


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

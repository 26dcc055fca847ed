"""The HTTP face: a Starlette app with the OpenAI routes, with and without the /v1 prefix.

    GET  /health                  200 {"status": "ok"} when ready, 503 while loading (no key needed)
    GET  /v1/models               the served model (and /v1/models/{id})
    POST /v1/chat/completions     chat, streamed (SSE) or not
    POST /v1/completions          plain text, streamed or not
    POST /v1/embeddings           the served model's mean-pooled hidden states (model_routes.py)
    POST /tokenize, /detokenize   llama-server's token routes (model_routes.py)
    GET  /v1/page_local/stats     slots, queue, conversation cache, counts, resident memory
    GET  /metrics                 Prometheus text (metrics.py)
    /api/...                      Ollama's API (ollama.py): version, tags, show, ps, chat, generate
    GET  /  and  /ui/{file}       the web UI (web.py): a chat page that shows what the cache holds

Before a route sees a request, guards.py checks its Host, its Origin (a web page's), its key and,
for a POST, that it is JSON; a request is refused with 503 while the queue is full before its body
is read.

The event loop never runs the engine: a request waits for a slot (slots.SlotPool), then runs in
that slot's thread (backend.Turn) while the loop relays its events. A client that goes away stops
its generation within one token; its slot is free again as soon as the slot's thread lets go.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

from page_local.serve import model_routes, ollama, protocol
from page_local.serve.backend import Backend, Turn
from page_local.serve.guards import (
    NO_KEY,
    HostGuard,
    HostPolicy,
    JsonOnly,
    KeyGuard,
    OriginGuard,
    OriginPolicy,
)
from page_local.serve.metrics import HttpMetrics
from page_local.serve.protocol import ApiError


class _Gone(Exception):
    """The client disconnected while its request was waiting or running."""


def error_response(e: ApiError):
    from starlette.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _read_body(request, limit: int) -> bytes:
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


async def _unless_gone(request, awaitable):
    """Await `awaitable` unless the client disconnects first (then _Gone; the awaitable is cancelled)."""
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
    raise _Gone


def create_app(backend: Backend):
    """The ASGI app over a Backend (which the app's lifespan starts loading and closes)."""
    # sse-starlette is imported here, not with this module: importing it hooks uvicorn's exit handler
    from sse_starlette.sse import EventSourceResponse
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    s = backend.settings

    @asynccontextmanager
    async def lifespan(app):
        if backend.state == "loading" and backend._loader is None:
            backend.start_loading()
        try:
            yield
        finally:
            await asyncio.to_thread(backend.close)

    def ready() -> None:
        if backend.state == "loading":
            raise ApiError(503, "the model is still loading; retry shortly", "model_loading",
                           headers={"Retry-After": "1"})
        if backend.state != "ready":
            raise ApiError(503, f"the server is not ready: {backend.error or backend.state}", "not_ready")

    async def health(request):
        if backend.state == "ready":
            return JSONResponse({"status": "ok"})
        body = {"status": backend.state}
        if backend.error:
            body["error"] = backend.error
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})

    def model_card() -> dict:
        return {"id": s.served_name, "object": "model", "created": backend.loaded_at, "owned_by": "page-local",
                "page_local": {"file": s.model_path.name, "n_ctx": s.n_ctx, "gate": s.gate, "budget": s.budget,
                               "evictor": s.evictor, "parallel": s.parallel}}

    async def models(request):
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model_one(request):
        name = request.path_params["model_id"]
        if name not in backend.names:
            raise _unknown_model(name)
        return JSONResponse(model_card())

    def _unknown_model(name: str) -> ApiError:
        return ApiError(404, f"the model {name!r} is not served here; this server serves {s.served_name!r}",
                        "model_not_found", "model")

    def namespace(request) -> str:
        return getattr(request.state, "namespace", NO_KEY)

    async def stats(request):
        return JSONResponse(backend.stats(namespace(request)))

    async def chat(request):
        return await complete(request, "chat")

    async def completions(request):
        return await complete(request, "text")

    async def complete(request, kind: str):
        ready()
        backend.pool.admit()  # a full queue refuses the request before its body is read
        job = protocol.parse_job(protocol.parse_json(await _read_body(request, s.max_body_bytes)), kind,
                                 backend.max_tokens_limit)
        job.namespace = namespace(request)
        if job.model and job.model not in backend.names:
            raise _unknown_model(job.model)
        tokens, n_keep = await asyncio.to_thread(backend.tokens, job)
        rid, created = protocol.new_id(kind), protocol.now()
        try:
            slot = await _unless_gone(request, backend.pool.acquire(tokens, job.namespace))
        except _Gone:
            return Response(status_code=499)
        turn = Turn(backend, slot, job, tokens, n_keep)
        name = s.served_name
        try:
            # the status line waits for the first event: a request refused after the prefill (the
            # conversation does not fit) is still a plain 400, not a 200 stream with an error in it
            first = await _unless_gone(request, turn.next())
            if first[0] == "error":
                return error_response(first[1])
            if job.stream:
                return EventSourceResponse(_sse(turn, first, job, kind, rid, created, name), ping=0, sep="\n")
            parts, done = await _unless_gone(request, _collect(turn, first))
        except _Gone:
            turn.close()
            return Response(status_code=499)  # nobody reads it: the client is gone
        except ApiError as e:  # a mid-answer error of a request that is not streamed
            return error_response(e)
        except BaseException:  # the server cancelling the request (shutdown)
            turn.close()
            raise
        return JSONResponse(protocol.body(kind, rid, created, name, "".join(parts), done["finish"], done["usage"],
                                          done["page_local"], done.get("logprobs")))

    def ollama_shaped(request) -> bool:  # Ollama's routes answer errors as {"error": "..."}
        return request.url.path.startswith("/api/")

    async def metrics(request):
        body, content_type = backend.metrics.exposition(backend)
        return Response(body, media_type=content_type)

    async def on_api_error(request, e: ApiError):
        return ollama.error_response(e) if ollama_shaped(request) else error_response(e)

    async def on_internal(request, e: Exception):  # a bug: the envelope all the same (the trace is logged)
        err = ApiError(500, f"internal error: {type(e).__name__}: {e}", "internal_error")
        return await on_api_error(request, err)

    async def on_http_error(request, e: HTTPException):
        if e.status_code == 404:
            err = ApiError(404, f"no route {request.method} {request.url.path}; see /v1/models, "
                                "/v1/chat/completions, /v1/completions", "not_found")
        elif e.status_code == 405:
            err = ApiError(405, f"{request.method} is not allowed on {request.url.path}", "method_not_allowed")
        else:
            err = ApiError(e.status_code, str(e.detail), "http_error")
        return await on_api_error(request, err)

    routes = []
    for prefix in ("", "/v1"):
        routes += [Route(f"{prefix}/health", health, methods=["GET"]),
                   Route(f"{prefix}/models", models, methods=["GET"]),
                   Route(f"{prefix}/models/{{model_id:path}}", model_one, methods=["GET"]),
                   Route(f"{prefix}/chat/completions", chat, methods=["POST"]),
                   Route(f"{prefix}/completions", completions, methods=["POST"]),
                   Route(f"{prefix}/page_local/stats", stats, methods=["GET"])]
    routes += [Route("/metrics", metrics, methods=["GET"]), *ollama.routes(backend, ready, namespace)]
    routes += model_routes.routes(backend, ready)  # /tokenize, /detokenize, /v1/embeddings
    from page_local.serve import web

    routes += web.routes()
    hosts = HostPolicy(s.host, s.allow_hosts)
    middleware = [Middleware(HttpMetrics, metrics=backend.metrics, routes=routes),  # refusals counted too
                  Middleware(HostGuard, policy=hosts),
                  Middleware(OriginGuard, policy=OriginPolicy(s.cors_origins, hosts))]
    if s.cors_origins:  # off unless asked for; outside the key guard, so that preflights get through, and
        # around it, so that an allowed page can read a 401 or 415; any header (the SDKs send their own),
        # and Chrome's private network preflight (a public site calling this loopback server) for these
        # origins only
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(s.cors_origins),
                                     allow_methods=["GET", "POST"], allow_headers=["*"],
                                     expose_headers=["Retry-After"], allow_private_network=True))
    middleware += [Middleware(KeyGuard, keys=s.keys), Middleware(JsonOnly)]
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                     exception_handlers={ApiError: on_api_error, HTTPException: on_http_error,
                                         Exception: on_internal})


async def _collect(turn: Turn, first: tuple) -> tuple[list[str], dict]:
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


async def _sse(turn: Turn, first: tuple, job, kind: str, rid: str, created: int, name: str):
    """The SSE body, as OpenAI streams it: a role chunk, text chunks, a chunk with finish_reason (and
    the page_local Decision), the usage chunk if asked for, then [DONE]. Same id on every chunk."""
    from sse_starlette.event import ServerSentEvent

    def data(obj) -> ServerSentEvent:
        return ServerSentEvent(data=obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False), sep="\n")

    def chunk(**kw):
        return data(protocol.chunk(kind, rid, created, name, include_usage=job.include_usage, **kw))

    try:
        if kind == "chat":
            yield chunk(role=True)
        event = first
        while True:
            if event[0] == "text":
                yield chunk(text=event[1], logprobs=event[2] if len(event) > 2 else None)
            elif event[0] == "progress":
                yield data(protocol.progress_chunk(kind, rid, created, name, event[1]))
            elif event[0] == "done":
                d = event[1]
                yield chunk(finish=d["finish"], extension=d["page_local"])
                if job.include_usage:
                    yield data(protocol.chunk(kind, rid, created, name, use=d["usage"]))
                break
            else:  # a mid-stream error: an error frame, then the end of the stream
                yield data(event[1].body())
                break
            event = await turn.next()
        yield data("[DONE]")
    finally:
        turn.close()  # a client gone mid-stream: the slot's thread stops within one token

"""The HTTP face: the Starlette app assembled from the routes, the guards and the error handlers.

    GET  /health                  200 {"status": "ok"} when ready, 503 while loading (no key needed)
    /v1/models, /v1/chat/completions, /v1/completions   OpenAI's routes (openai.py)
    POST /v1/responses            OpenAI's Responses API, stateless (responses.py)
    GET  /props                   llama-server's (model_routes.py)
    POST /v1/embeddings           the served model's mean-pooled hidden states (model_routes.py)
    POST /tokenize, /detokenize   llama-server's token routes (model_routes.py)
    GET  /v1/page_local/stats     slots, queue, conversation cache, counts, resident memory
    GET  /metrics                 Prometheus text (metrics.py)
    /api/...                      Ollama's API (ollama.py): version, tags, show, ps, chat, generate, embed
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
from contextlib import asynccontextmanager

from page_local.serve import model_routes, ollama, openai, responses, web
from page_local.serve.backend import Backend
from page_local.serve.errors import ApiError
from page_local.serve.guards import HostGuard, HostPolicy, JsonOnly, KeyGuard, OriginGuard, OriginPolicy
from page_local.serve.http import error_response, namespace
from page_local.serve.metrics import HttpMetrics


def create_app(backend: Backend):
    """The ASGI app over a Backend (which the app's lifespan starts loading and closes)."""
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

    async def health(request):
        if backend.state == "ready":
            return JSONResponse({"status": "ok"})
        body = {"status": backend.state}
        if backend.error:
            body["error"] = backend.error
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})

    async def stats(request):
        return JSONResponse(backend.stats(namespace(request)))

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

    routes = [Route(f"{prefix}{path}", handler, methods=["GET"]) for prefix in ("", "/v1")
              for path, handler in (("/health", health), ("/page_local/stats", stats))]
    routes += [Route("/metrics", metrics, methods=["GET"]), *openai.routes(backend), *ollama.routes(backend),
               *responses.routes(backend)]
    routes += model_routes.routes(backend)  # /tokenize, /detokenize, /v1/embeddings
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


"""OpenAI's routes: the model list, chat completions and text completions, streamed (SSE) or not.

    GET  /v1/models               the served model, then the others on this machine (model_routes.others), not
                                  loaded ("page_local": {"loaded": false, ...}); /v1/models/{id}: the served one
    POST /v1/chat/completions     chat, streamed (SSE) or not
    POST /v1/completions          plain text, streamed or not

A request is validated into a Job (protocol.parse_job), tokenized off the event loop, waits for a slot
(slots.SlotPool) and runs in that slot's thread (backend.Turn) while the loop relays its events. A
client that goes away stops its generation within one token.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from page_local.serve import model_routes, protocol, tools
from page_local.serve.backend import Turn
from page_local.serve.errors import ApiError
from page_local.serve.http import namespace, read_body, ready, run_turn, sse_response


def unknown_model(backend, name: str) -> ApiError:
    return ApiError(404, model_routes.not_loaded(backend, name) or f"the model {name!r} is not served here; this "
                    f"server serves {backend.settings.served_name!r}", "model_not_found", "model")


def routes(backend) -> list:
    """Starlette routes over `backend`, with and without the /v1 prefix."""
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    s = backend.settings

    def model_card() -> dict:
        return {"id": s.served_name, "object": "model", "created": backend.loaded_at, "owned_by": "page-local",
                "page_local": {"file": s.model_path.name, "n_ctx": s.n_ctx, "gate": s.gate, "budget": s.budget,
                               "park": s.park, "evictor": s.evictor, "parallel": s.parallel}}

    async def models(request):
        # the served model first (the web page shows data[0]); then the others on this machine, not loaded
        others = [{"id": r["name"], "object": "model", "created": int(r["modified"]),
                   "owned_by": r["store"], "page_local": {"loaded": False, "file": Path(r["path"]).name,
                                                          "size_bytes": r["size"], **(r["details"] or {})}}
                  for r in await model_routes.others(backend)]
        return JSONResponse({"object": "list", "data": [model_card(), *others]})

    async def model_one(request):
        name = request.path_params["model_id"]
        if name not in backend.names:
            raise unknown_model(backend, name)
        return JSONResponse(model_card())

    async def chat(request):
        return await complete(request, "chat")

    async def completions(request):
        return await complete(request, "text")

    async def complete(request, kind: str):
        ready(backend)
        admission = backend.pool.admit()  # a full queue refuses the request before its body is read
        try:
            return await answer_request(request, kind, admission)
        finally:
            admission.close()  # (acquire closed it, unless the request failed before)

    async def answer_request(request, kind: str, admission):
        job = protocol.parse_job(protocol.parse_json(await read_body(request, s.max_body_bytes)), kind,
                                 backend.max_tokens_limit)
        job.namespace = namespace(request)
        if job.model and job.model not in backend.names:
            raise unknown_model(backend, job.model)
        tokens, n_keep = await asyncio.to_thread(backend.tokens, job)
        rid, created, name = protocol.new_id(kind), protocol.now(), s.served_name

        def streamed(turn, first):
            return sse_response(sse(turn, first, job, kind, rid, created, name))

        def whole(parts: list[str], done: dict):
            text, calls, finish = answer(job, "".join(parts), done["finish"])
            return JSONResponse(protocol.body(kind, rid, created, name, text, finish, done["usage"],
                                              done["page_local"], done.get("logprobs"), calls))

        return await run_turn(request, backend.pool.acquire(tokens, job.namespace, admission),
                              lambda slot: Turn(backend, slot, job, tokens, n_keep),
                              stream=streamed if job.stream else None, whole=whole)

    out = []
    for prefix in ("", "/v1"):
        out += [Route(f"{prefix}/models", models, methods=["GET"]),
                Route(f"{prefix}/models/{{model_id:path}}", model_one, methods=["GET"]),
                Route(f"{prefix}/chat/completions", chat, methods=["POST"]),
                Route(f"{prefix}/completions", completions, methods=["POST"])]
    return out


def tool_names(job) -> set[str]:
    return {t["function"]["name"] for t in job.tools or ()} if job.offers_tools else set()


def answer(job, text: str, finish: str) -> tuple[str, list[dict], str]:
    """(the answer's text, its tool calls, its finish_reason): an answer that offered tools is read for calls;
    one that made calls and ended by itself finishes with "tool_calls"."""
    if not job.offers_tools:
        return text, [], finish
    content, calls = tools.split_calls(text, tool_names(job))
    return content, calls, ("tool_calls" if calls and finish == "stop" else finish)


async def sse(turn, first: tuple, job, kind: str, rid: str, created: int, name: str):
    """The SSE body, as OpenAI streams it: a role chunk, text chunks, a chunk with finish_reason (and
    the page_local Decision), the usage chunk if asked for, then [DONE]. Same id on every chunk."""
    from sse_starlette.event import ServerSentEvent

    def data(obj) -> ServerSentEvent:
        return ServerSentEvent(data=obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False), sep="\n")

    def chunk(**kw):
        return data(protocol.chunk(kind, rid, created, name, include_usage=job.include_usage, **kw))

    scan = tools.CallScanner(tool_names(job)) if job.offers_tools else None
    n_calls = 0

    def pieces(events):  # a call's text held back until it is whole, then sent as one tool_calls delta
        nonlocal n_calls
        for kind_, value in events:
            if kind_ == "text":
                yield chunk(text=value)
            else:
                yield chunk(tool_call=(n_calls, value))
                n_calls += 1

    try:
        if kind == "chat":
            yield chunk(role=True)
        event = first
        while True:
            if event[0] == "text":
                if scan is None:
                    yield chunk(text=event[1], logprobs=event[2] if len(event) > 2 else None)
                else:
                    for c in pieces(scan.feed(event[1])):
                        yield c
            elif event[0] == "progress":
                yield data(protocol.progress_chunk(kind, rid, created, name, event[1]))
            elif event[0] == "done":
                d = event[1]
                if scan is not None:
                    for c in pieces(scan.flush()):
                        yield c
                finish = "tool_calls" if n_calls and d["finish"] == "stop" else d["finish"]
                yield chunk(finish=finish, extension=d["page_local"])
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

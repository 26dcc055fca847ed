"""OpenAI's Responses API, stateless: POST /v1/responses.

    input          a string, or a list of items: messages ({"role", "content": a string or input_text /
                   output_text parts}), function_call items (an earlier answer's calls) and
                   function_call_output items (their results)
    instructions   the system message
    tools, tool_choice, parallel_tool_calls   the flat function tools of this API (tools.py)
    max_output_tokens, temperature, top_p, text.format, stream, and the `page_local` extension

A request becomes the chat request the /v1/chat/completions route takes (protocol.parse_job validates
it, so the rules live in one place) and runs on the same path: a slot, the conversation cache of its key.
Nothing is stored: `previous_response_id` is refused by name (send the conversation in `input`), `store`
is accepted and stores nothing. Streamed, the events are the API's: response.created, output items
added and done, output_text deltas, function_call_arguments, response.completed.
"""

from __future__ import annotations

import asyncio
import json
import secrets

from page_local.serve import protocol, tools
from page_local.serve.backend import Turn
from page_local.serve.errors import ApiError, bad
from page_local.serve.http import namespace, read_body, ready, run_turn, sse_response

# read, with what each becomes; NO_EFFECT: accepted without effect (nothing is stored or logged here)
FIELDS = frozenset({"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
                    "max_output_tokens", "temperature", "top_p", "text", "stream", "page_local"})
NO_EFFECT = frozenset({"store", "metadata", "user", "truncation", "include", "reasoning", "background",
                       "service_tier", "prompt_cache_key", "safety_identifier"})


def _refuse(body: dict) -> None:
    if body.get("previous_response_id") is not None:
        raise bad("previous_response_id is not supported: page-local keeps no responses (send the whole conversation "
                  "in input; its cached prefix is reused all the same)", "previous_response_id",
                  "unsupported_parameter")
    for name in body:
        if name not in FIELDS and name not in NO_EFFECT and name != "previous_response_id":
            raise bad(f"field {name} is not supported by page-local's /v1/responses; it reads "
                      f"{', '.join(sorted(FIELDS))} ({', '.join(sorted(NO_EFFECT))} are accepted without effect)",
                      name, "unsupported_parameter")
    if body.get("truncation") not in (None, "disabled"):
        raise bad("truncation \"auto\" is not supported: page-local makes room in its own way (page_local.on_full)",
                  "truncation", "unsupported_parameter")
    if body.get("include"):
        raise bad("include is not supported by page-local (it has no extra outputs to include)", "include",
                  "unsupported_parameter")
    reasoning = body.get("reasoning")
    if reasoning not in (None, {}) and not (isinstance(reasoning, dict) and reasoning.get("effort") is None
                                            and reasoning.get("summary") is None):
        raise bad("reasoning is not supported by page-local", "reasoning", "unsupported_parameter")
    if body.get("background"):
        raise bad("background is not supported by page-local", "background", "unsupported_parameter")


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text") \
                    and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"{where}[{j}]: only text parts are supported, got a {kind!r} part", f"{where}[{j}]",
                          "unsupported_parameter")
        return "\n".join(out)
    raise bad(f"{where} must be a string or a list of text parts", where)


def messages(body: dict) -> list[dict]:
    """instructions and input as chat messages (function calls and their outputs as tool_calls and tool)."""
    out: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions must be a string", "instructions")
        out.append({"role": "system", "content": instructions})
    x = body.get("input")
    if isinstance(x, str):
        if not x:
            raise bad("input is empty", "input")
        return out + [{"role": "user", "content": x}]
    if not isinstance(x, list) or not x:
        raise bad("input must be a string or a non-empty list of items", "input",
                  "missing_required_parameter" if x is None else "invalid_value")
    for i, item in enumerate(x):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(f"{where}.role must be user, assistant, system or developer, got {role!r}", f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise bad(f"{where}: a function_call has a name and a call_id", where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            elif out and out[-1]["role"] == "assistant" and "tool_calls" not in out[-1]:
                out[-1]["tool_calls"] = [call]  # the text that came with the calls
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise bad(f"{where}.call_id must be a string", f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        else:
            raise bad(f"{where}: items of type {kind!r} are not supported by page-local (message, function_call and "
                      "function_call_output are)", f"{where}.type", "unsupported_parameter")
    return out


def chat_request(body: dict) -> dict:
    """The /v1/chat/completions request this Responses request is."""
    _refuse(body)
    out: dict = {"messages": messages(body), "model": body.get("model")}
    for name in ("temperature", "top_p", "stream", "page_local", "parallel_tool_calls"):
        if body.get(name) is not None:
            out[name] = body[name]
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    offered = tools.parse_tools(body.get("tools"), flat=True)
    if offered:
        out["tools"] = offered
    if body.get("tool_choice") is not None:
        choice = body["tool_choice"]
        if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        out["tool_choice"] = choice
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or \
                (fmt is not None and not isinstance(fmt, dict)):
            raise bad("text must be {\"format\": {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}}", "text")
        if fmt and fmt.get("type") == "json_schema":
            out["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name", "answer"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
        elif fmt:
            out["response_format"] = {"type": fmt.get("type")}
    return out


def _rename(e: ApiError) -> ApiError:
    names = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}
    p = (e.param or "").split(".")[0].split("[")[0]
    if p in names:
        param = names[p] + (e.param or "")[len(p):]
        return ApiError(e.status, e.message.replace(p, names[p], 1), e.code, param, e.headers)
    return e


class Builder:
    """The response object, built from the answer's events (text pieces and calls)."""

    def __init__(self, job, name: str, body: dict):
        self.job, self.name = job, name
        self.id = "resp_" + secrets.token_hex(12)
        self.created = protocol.now()
        self.output: list[dict] = []
        self.message: dict | None = None  # the open message item
        self.body = body

    def obj(self, status: str, done: dict | None = None) -> dict:
        use = done["usage"] if done else None
        j = self.job
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "model": self.name, "output": self.output, "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": self.body.get("instructions"), "max_output_tokens": self.body.get("max_output_tokens"),
               "parallel_tool_calls": j.parallel_tool_calls, "previous_response_id": None,
               "temperature": j.temperature, "top_p": j.top_p, "store": False, "metadata": self.body.get("metadata") or {},
               "tool_choice": self.body.get("tool_choice", "auto" if j.tools else "none"),
               "tools": self.body.get("tools") or [], "text": self.body.get("text") or {"format": {"type": "text"}},
               "truncation": "disabled",
               "usage": None if use is None else {
                   "input_tokens": use["prompt_tokens"], "output_tokens": use["completion_tokens"],
                   "total_tokens": use["total_tokens"],
                   "input_tokens_details": {"cached_tokens": use["prompt_tokens_details"]["cached_tokens"]},
                   "output_tokens_details": {"reasoning_tokens": 0}}}
        if done is not None:
            out["page_local"] = done["page_local"]
        return out

    def text(self, piece: str) -> list[tuple[str, dict]]:
        """Events for a text piece (an item opened first if none is)."""
        events = []
        if self.message is None:
            self.message = {"id": "msg_" + secrets.token_hex(12), "type": "message", "status": "in_progress",
                            "role": "assistant", "content": [{"type": "output_text", "text": "", "annotations": []}]}
            self.output.append(self.message)
            item = {**self.message, "content": []}
            events += [("response.output_item.added", {"output_index": len(self.output) - 1, "item": item}),
                       ("response.content_part.added", {"item_id": self.message["id"], "output_index":
                        len(self.output) - 1, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": []}})]
        self.message["content"][0]["text"] += piece
        events.append(("response.output_text.delta", {"item_id": self.message["id"], "output_index":
                       self.output.index(self.message), "content_index": 0, "delta": piece}))
        return events

    def close_message(self) -> list[tuple[str, dict]]:
        if self.message is None:
            return []
        m, self.message = self.message, None
        m["status"] = "completed"
        i = self.output.index(m)
        part = m["content"][0]
        return [("response.output_text.done", {"item_id": m["id"], "output_index": i, "content_index": 0,
                                               "text": part["text"]}),
                ("response.content_part.done", {"item_id": m["id"], "output_index": i, "content_index": 0,
                                                "part": part}),
                ("response.output_item.done", {"output_index": i, "item": m})]

    def call(self, call: dict) -> list[tuple[str, dict]]:
        events = self.close_message()
        fn = call["function"]
        item = {"id": "fc_" + secrets.token_hex(12), "type": "function_call", "status": "completed",
                "call_id": call["id"], "name": fn["name"], "arguments": fn["arguments"]}
        self.output.append(item)
        i = len(self.output) - 1
        return events + [
            ("response.output_item.added", {"output_index": i, "item": {**item, "arguments": "",
                                                                         "status": "in_progress"}}),
            ("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": i,
                                                        "delta": fn["arguments"]}),
            ("response.function_call_arguments.done", {"item_id": item["id"], "output_index": i,
                                                       "arguments": fn["arguments"]}),
            ("response.output_item.done", {"output_index": i, "item": item})]


def routes(backend) -> list:
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    s = backend.settings

    async def create(request):
        ready(backend)
        admission = backend.pool.admit()  # a full queue refuses the request before its body is read
        try:
            return await answer_request(request, admission)
        finally:
            admission.close()

    async def answer_request(request, admission):
        body = protocol.parse_json(await read_body(request, s.max_body_bytes))
        try:
            job = protocol.parse_job(chat_request(body), "chat", backend.max_tokens_limit)
        except ApiError as e:
            raise _rename(e) from None
        job.namespace = namespace(request)
        if job.model and job.model not in backend.names:
            raise ApiError(404, f"the model {job.model!r} is not served here; this server serves {s.served_name!r}",
                           "model_not_found", "model")
        tokens, n_keep = await asyncio.to_thread(backend.tokens, job)
        build = Builder(job, s.served_name, body)

        def streamed(turn, first):
            return sse_response(_events(turn, first, job, build))

        def whole(parts: list[str], done: dict):
            scan = tools.CallScanner(_names(job)) if job.offers_tools else None
            for kind, value in (scan.feed("".join(parts)) + scan.flush()) if scan else [("text", "".join(parts))]:
                (build.text if kind == "text" else build.call)(value)
            build.close_message()
            return JSONResponse(build.obj(_status(done), done))

        return await run_turn(request, backend.pool.acquire(tokens, job.namespace, admission),
                              lambda slot: Turn(backend, slot, job, tokens, n_keep),
                              stream=streamed if job.stream else None, whole=whole)

    return [Route("/v1/responses", create, methods=["POST"]), Route("/responses", create, methods=["POST"])]


def _names(job) -> set[str]:
    return {t["function"]["name"] for t in job.tools or ()}


def _status(done: dict) -> str:
    return "incomplete" if done["finish"] == "length" else "completed"


async def _events(turn, first: tuple, job, build: Builder):
    from sse_starlette.event import ServerSentEvent

    seq = 0

    def event(kind: str, data: dict) -> ServerSentEvent:
        nonlocal seq
        seq += 1
        return ServerSentEvent(event=kind, data=json.dumps({"type": kind, "sequence_number": seq - 1, **data},
                                                           ensure_ascii=False), sep="\n")

    scan = tools.CallScanner(_names(job)) if job.offers_tools else None

    def pieces(value: str):
        for kind, v in (scan.feed(value) if scan else [("text", value)]):
            for e in (build.text(v) if kind == "text" else build.call(v)):
                yield event(*e)

    try:
        yield event("response.created", {"response": build.obj("in_progress")})
        yield event("response.in_progress", {"response": build.obj("in_progress")})
        ev = first
        while True:
            if ev[0] == "text":
                for e in pieces(ev[1]):
                    yield e
            elif ev[0] == "done":
                for kind, v in (scan.flush() if scan else []):
                    for e in (build.text(v) if kind == "text" else build.call(v)):
                        yield event(*e)
                for e in build.close_message():
                    yield event(*e)
                status = _status(ev[1])
                yield event(f"response.{status}", {"response": build.obj(status, ev[1])})
                break
            elif ev[0] == "error":
                yield event("error", {"code": ev[1].code, "message": ev[1].message, "param": ev[1].param})
                break
            ev = await turn.next()
    finally:
        turn.close()

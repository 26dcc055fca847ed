"""Ollama's API on the same server, so that apps written for Ollama work unchanged:

    GET  /api/version     {"version"}: the Ollama release whose API this follows
    GET  /api/tags        the served model, as Ollama lists its local models, then the others on this machine
                          (model_routes.others: this server runs only its own)
    POST /api/pull        {"model": "hf.co/ORG/REPO[:QUANT]"}: a GGUF from the Hugging Face Hub into its cache
                          (store/pull.py), with Ollama's NDJSON status lines; a name from Ollama's own library
                          is refused (page-local does not download from it), as is a second pull while one runs
    POST /api/show        its details, GGUF metadata (model_info), chat template, capabilities
    GET  /api/ps          the model as loaded (it stays loaded while the server runs)
    POST /api/chat        chat; NDJSON stream unless "stream": false (Ollama's default is a stream)
    POST /api/generate    a prompt, rendered with the chat template (raw: as is); streamed the same way
    POST /api/embed       {"model", "input": a string or a list of them, "truncate"} -> {"embeddings"}

A chat or generate request is translated into the OpenAI request the /v1 routes take (protocol.parse_job
validates it, so the rules live in one place) and runs on the same path: the guards (Host, Origin, keys,
JSON), the queue, a slot, the conversation cache of its key. What page-local cannot honour is refused
with a 400 that names the field, as is any top-level field these routes do not read; errors are Ollama's
{"error": "..."}. `tools` on /api/chat are OpenAI's tools (tools.py); the calls come back in Ollama's shape.

Options. temperature, top_p, top_k, seed (-1: a fresh one), num_predict (-1 and -2: until the context is
full), stop, and the sampling fields the OpenAI routes take (min_p, repeat_penalty, presence_penalty,
frequency_penalty, repeat_last_n as penalty_last_n) map to the OpenAI fields; typical_p, mirostat and
tfs_z are accepted at the values that turn them off. Absent ones take Ollama's defaults (temperature 0.8, top_k
40, top_p 0.9), not OpenAI's. The load-time options (num_ctx, num_batch, num_gpu, num_thread, ...) are
ignored: Ollama itself applies them by loading the model again, and apps send them with every request
(Continue sends num_ctx always), so a refusal would break those apps; this server's context is fixed
when it starts (--n-ctx), and /api/show and /api/ps say what it is. Any other option is refused by name.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from page_local.serve import model_routes, protocol, tools
from page_local.serve.backend import Turn, rss_bytes
from page_local.serve.errors import ApiError, bad
from page_local.serve.http import namespace, read_body, ready, run_turn
from page_local.serve.ollama_pull import pull_route

OLLAMA_VERSION = "0.32.0"  # the Ollama release whose API shapes these routes follow
# options Ollama applies when it loads a model: ignored here (the module docstring says why)
LOAD_OPTIONS = frozenset({"num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
                          "vocab_only", "use_mmap", "use_mlock", "num_thread", "numa", "draft_num_predict",
                          "num_keep"})  # (num_keep: what a context shift keeps; page-local keeps the system prompt)
# Ollama's option -> the OpenAI field it becomes
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed", "stop": "stop",
            "num_predict": "max_tokens", "min_p": "min_p", "repeat_penalty": "repeat_penalty",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
            "repeat_last_n": "penalty_last_n"}
# samplers page-local does not have: accepted at the value that turns them off (Ollama's defaults), else refused
NEUTRAL = {"typical_p": 1.0, "mirostat": 0, "tfs_z": 1.0}
OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
FAR = timedelta(days=365 * 292)  # Ollama's expires_at for a model kept loaded (keep_alive < 0)


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def error_response(e: ApiError):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)


# --- requests -> the OpenAI request ------------------------------------------------------------

def _options(body: dict, out: dict, names: dict) -> None:
    """Ollama's `options` into `out` (the OpenAI body); names: OpenAI field -> the Ollama name, for errors."""
    opts = body.get("options")
    if opts is None:
        opts = {}
    if not isinstance(opts, dict):
        raise bad(f"options must be an object like {{\"temperature\": 0.2}}, got {type(opts).__name__}", "options")
    for k, v in OLLAMA_DEFAULTS.items():
        out.setdefault(k, v)
    for key, value in opts.items():
        if key in LOAD_OPTIONS or value is None or (key in NEUTRAL and value == NEUTRAL[key]
                                                     and not isinstance(value, bool)):
            continue
        if key not in SAMPLING:
            raise bad(f"options.{key} is not supported by page-local; it honours {', '.join(sorted(SAMPLING))} "
                      f"(and ignores the load-time options {', '.join(sorted(LOAD_OPTIONS))})",
                      f"options.{key}", "unsupported_parameter")
        field = SAMPLING[key]
        if key == "num_predict":
            if isinstance(value, bool) or not isinstance(value, int) or value == 0 or value < -2:
                raise bad(f"options.num_predict must be a positive integer, or -1 / -2 (until the context is full), "
                          f"got {value!r}", "options.num_predict")
            if value < 0:
                continue  # the default: until the end of the answer or of the context
        if key == "stop" and isinstance(value, list) and not value:
            continue
        if key == "seed" and isinstance(value, int) and not isinstance(value, bool) and value < 0:
            continue  # Ollama's -1 (its default): a fresh seed per request
        out[field] = value
        names[field] = f"options.{key}"


def _format(body: dict, out: dict, names: dict) -> None:
    fmt = body.get("format")
    if fmt in (None, ""):
        return
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    else:
        raise bad(f"format must be \"json\" or a JSON schema object, got {fmt!r}", "format")
    names["response_format"] = "format"


# the top-level fields of /api/chat and /api/generate page-local reads (keep_alive: accepted, no effect: the
# model stays loaded while the server runs); anything else is refused by name
FIELDS = {"chat": frozenset({"model", "messages", "tools", "format", "options", "stream", "keep_alive", "think",
                             "truncate", "shift", "logprobs", "top_logprobs", "page_local"}),
          "generate": frozenset({"model", "prompt", "suffix", "images", "format", "options", "system", "template",
                                 "context", "stream", "raw", "keep_alive", "think", "truncate", "shift", "logprobs",
                                 "top_logprobs", "page_local"})}


# /api/embed's fields (options and keep_alive: accepted, no effect here)
EMBED_FIELDS = frozenset({"model", "input", "truncate", "options", "keep_alive", "dimensions"})


def _refuse(body: dict, route: str = "chat") -> None:
    """Ollama fields page-local cannot honour, or does not know: refused by name."""
    for name in body:
        if name not in FIELDS[route]:
            raise bad(f"field {name} is not supported by page-local's /api/{route}; it reads "
                      f"{', '.join(sorted(FIELDS[route]))}", name, "unsupported_parameter")
    if route == "generate" and body.get("tools"):
        raise bad("tools are read by /api/chat, not /api/generate", "tools", "unsupported_parameter")
    if body.get("think") not in (None, False):
        raise bad("think is not supported by page-local (it does not separate a model's thinking from its answer)",
                  "think", "unsupported_parameter")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise bad("logprobs are not supported on page-local's Ollama routes", "logprobs", "unsupported_parameter")
    if body.get("images"):
        raise bad("images are not supported by page-local", "images", "unsupported_parameter")
    for name in ("suffix", "template"):
        if body.get(name):
            raise bad(f"{name} is not supported by page-local", name, "unsupported_parameter")
    if body.get("context"):
        raise bad("context (the token list of an earlier /api/generate) is not supported by page-local: send the "
                  "conversation to /api/chat, whose prefix is reused from the cache", "context",
                  "unsupported_parameter")


def _on_full(body: dict, out: dict) -> None:
    """Ollama's truncate / shift false (error instead of dropping earlier context): page-local's on_full
    "refuse", unless the request's page_local extension says otherwise."""
    for name in ("truncate", "shift"):
        v = body.get(name)
        if v is not None and not isinstance(v, bool):
            raise bad(f"{name} must be true or false, got {v!r}", name)
    if body.get("truncate") is False or body.get("shift") is False:
        ext = out.setdefault("page_local", {})
        if isinstance(ext, dict):
            ext.setdefault("on_full", "refuse")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        return []
    if not isinstance(msgs, list):
        raise bad("messages must be a list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with role and content", f"messages[{i}]")
        if m.get("images"):
            raise bad(f"messages[{i}].images: images are not supported by page-local", f"messages[{i}].images",
                      "unsupported_parameter")
        role = m.get("role")
        msg = {"role": role.lower() if isinstance(role, str) else role, "content": m.get("content", "")}
        for name in ("tool_calls", "tool_call_id"):
            if m.get(name):
                msg[name] = m[name]
        if m.get("tool_name"):  # Ollama's name of the function a tool message answers
            msg["name"] = m["tool_name"]
        if msg.get("tool_calls") and not msg["content"]:
            msg["content"] = None
        out.append(msg)  # (an assistant message's `thinking`, an earlier answer's, is not sent to the model)
    return out


def openai_request(body: dict, route: str) -> tuple[dict, str, dict]:
    """(the OpenAI request body, its kind "chat" | "text", OpenAI field -> Ollama name for errors)."""
    _refuse(body, route)
    out: dict = {"model": body.get("model")}
    names: dict = {}
    ext = body.get("page_local")
    if ext is not None:
        out["page_local"] = ext
    _on_full(body, out)
    _options(body, out, names)
    _format(body, out, names)
    stream = body.get("stream", True)
    if stream is not None and not isinstance(stream, bool):
        raise bad(f"stream must be true or false, got {stream!r}", "stream")
    out["stream"] = True if stream is None else stream
    if route == "chat":
        out["messages"] = _messages(body)
        if body.get("tools"):
            out["tools"] = body["tools"]
        return out, "chat", names
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise bad(f"prompt must be a string, got {type(prompt).__name__}", "prompt")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise bad(f"system must be a string, got {type(system).__name__}", "system")
    raw = body.get("raw", False)
    if not isinstance(raw, bool):
        raise bad(f"raw must be true or false, got {raw!r}", "raw")
    if raw:
        if system:
            raise bad("raw mode does not take a system prompt: put it in the prompt", "system")
        out["prompt"] = prompt
        return out, "text", names
    out["messages"] = [{"role": "system", "content": system}] if system else []
    out["messages"].append({"role": "user", "content": prompt})
    return out, "chat", names


def _renamed(e: ApiError, names: dict) -> ApiError:
    """A parse_job error about a field that came from an Ollama one, told with the Ollama name."""
    ollama = names.get(e.param or "")
    if ollama is None:
        return e
    msg = e.message.replace(e.param, ollama, 1) if e.param in e.message else f"{ollama}: {e.message}"
    return ApiError(e.status, msg, e.code, ollama, e.headers)


# --- the routes --------------------------------------------------------------------------------

def routes(backend):
    """Starlette routes over `backend`."""
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    s = backend.settings
    digest: list[str] = []

    def tag(name: str) -> str:
        return name if ":" in name else f"{name}:latest"

    def served(name) -> bool:
        if not isinstance(name, str) or not name:
            return False
        return name in backend.names or (name.endswith(":latest") and name[: -len(":latest")] in backend.names)

    def check_model(name) -> None:
        if not isinstance(name, str) or not name:
            raise bad("model is required", "model", "missing_required_parameter")
        if not served(name):
            raise ApiError(404, model_routes.not_loaded(backend, name)
                           or f"model '{name}' not found; this server serves '{tag(s.served_name)}'",
                           "model_not_found", "model")

    def model():
        return backend.model

    def tool_format():
        t = backend.tool_template
        return t.tool_format if t is not None else None

    def details() -> dict:
        meta = model().metadata()
        arch = meta.get("general.architecture", "")
        words = model().description.split()  # "llama 135M Q4_1"
        size = meta.get("general.size_label") or (words[1] if len(words) >= 3 else "")
        return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch] if arch else None,
                "parameter_size": size, "quantization_level": words[-1] if len(words) >= 3 else ""}

    async def file_digest() -> str:
        if not digest:  # once: the GGUF file's sha256, as Ollama names a model's blob
            def sha() -> str:
                h = hashlib.sha256()
                with open(s.model_path, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
                return h.hexdigest()
            digest.append(await asyncio.to_thread(sha))
        return digest[0]

    def modified() -> str:
        return _rfc3339(s.model_path.stat().st_mtime)

    async def listing() -> dict:
        return {"name": tag(s.served_name), "model": tag(s.served_name), "modified_at": modified(),
                "size": s.model_path.stat().st_size, "digest": await file_digest(), "details": details()}

    def guarded(handler):
        async def run(request):
            try:
                return await handler(request)
            except ApiError as e:
                return error_response(e)
        return run

    async def version(request):
        return JSONResponse({"version": OLLAMA_VERSION})

    async def tags(request):
        ready(backend)
        others = [_tag_entry(r, tag) for r in await model_routes.others(backend)]
        return JSONResponse({"models": [await listing(), *others]})

    async def ps(request):
        ready(backend)
        m = model()
        entry = await listing()
        del entry["modified_at"]
        entry.update(expires_at=_rfc3339(time.time() + FAR.total_seconds()),
                     size_vram=entry["size"] if m.gpu else 0, context_length=s.n_ctx)
        entry["size"] = rss_bytes() or entry["size"]  # what the server holds: the model and every slot's cache
        return JSONResponse({"models": [entry]})

    async def show(request):
        ready(backend)
        body = protocol.parse_json(await read_body(request, s.max_body_bytes))
        name = body.get("model") or body.get("name")
        check_model(name)
        m = model()
        meta = m.metadata()
        info = {k: _typed(v) for k, v in meta.items() if not k.startswith("tokenizer.")}
        arch = meta.get("general.architecture", "")
        if arch:
            info[f"{arch}.context_length"] = m.n_ctx_train
        template = meta.get("tokenizer.chat_template", "")
        return JSONResponse({
            "modelfile": f"# served by page-local serve\nFROM {s.model_path.name}\nPARAMETER num_ctx {s.n_ctx}\n",
            "parameters": f"num_ctx {s.n_ctx}",
            "template": template, "details": details(), "model_info": info,
            "capabilities": ["completion"] + (["tools"] if tool_format() else []), "modified_at": modified(),
            "license": meta.get("general.license", "")})

    async def chat(request):
        return await complete(request, "chat")

    async def embed(request):
        t0 = time.perf_counter_ns()
        ready(backend)
        body = protocol.parse_json(await read_body(request, s.max_body_bytes))
        for key in body:
            if key not in EMBED_FIELDS:
                raise bad(f"field {key} is not supported by page-local's /api/embed; it reads "
                          f"{', '.join(sorted(EMBED_FIELDS))}", key, "unsupported_parameter")
        check_model(body.get("model"))
        if body.get("dimensions") is not None:
            raise bad("dimensions is not supported by page-local (the vectors have the model's own size)",
                      "dimensions", "unsupported_parameter")
        truncate = body.get("truncate", True)
        if not isinstance(truncate, bool):
            raise bad(f"truncate must be true or false, got {truncate!r}", "truncate")
        x = body.get("input")
        if isinstance(x, list) and any(not isinstance(i, str) for i in x):
            raise bad("input must be a string or a list of strings", "input")
        done = await model_routes.embed(request, backend, {"input": x}, truncate=truncate)
        if done is None:
            return Response(status_code=499)
        vectors, n = done
        return JSONResponse({"model": body["model"], "embeddings": [[float(v) for v in vec] for vec in vectors],
                             "total_duration": time.perf_counter_ns() - t0, "load_duration": 0,
                             "prompt_eval_count": n})

    async def generate(request):
        return await complete(request, "generate")

    async def complete(request, route: str):
        t0 = time.perf_counter_ns()
        ready(backend)
        admission = backend.pool.admit()  # a full queue refuses the request before its body is read
        try:
            return await answer_request(request, route, admission, t0)
        finally:
            admission.close()

    async def answer_request(request, route: str, admission, t0: int):
        body = protocol.parse_json(await read_body(request, s.max_body_bytes))
        check_model(body.get("model"))
        openai, kind, names = openai_request(body, route)
        name = body["model"]
        # nothing to answer: Ollama loads the model and says so (here it is loaded already)
        if not (body.get("messages") if route == "chat" else body.get("prompt")):
            out = {"model": name, "created_at": now_rfc3339(), "done": True, "done_reason": "load"}
            out.update({"message": {"role": "assistant", "content": ""}} if route == "chat" else {"response": ""})
            return JSONResponse(out)
        openai["model"] = None  # checked above, with Ollama's names
        try:
            job = protocol.parse_job(openai, kind, backend.max_tokens_limit)
        except ApiError as e:
            raise _renamed(e, names) from None
        job.namespace = namespace(request)
        tokens, n_keep = await asyncio.to_thread(backend.tokens, job)
        clock = {}

        def start(slot):
            clock["slot"] = time.perf_counter_ns()
            return Turn(backend, slot, job, tokens, n_keep)

        def piece(text: str, calls: list | None = None) -> dict:
            if route != "chat":
                return {"response": text}
            msg = {"role": "assistant", "content": text}
            if calls:  # Ollama's shape: arguments as an object, no id
                msg["tool_calls"] = [{"function": {"name": c["function"]["name"],
                                                   "arguments": json.loads(c["function"]["arguments"])}}
                                     for c in calls]
            return {"message": msg}

        def final(done: dict, text: str = "", calls: list | None = None) -> dict:
            t_end = time.perf_counter_ns()
            t_first = clock.get("first", t_end)
            use = done["usage"]
            return {"model": name, "created_at": now_rfc3339(), **piece(text, calls), "done": True,
                    "done_reason": done["finish"] if done["finish"] in ("stop", "length") else "stop",
                    "total_duration": t_end - t0,
                    "prompt_eval_count": use["prompt_tokens"], "prompt_eval_duration": t_first - clock["slot"],
                    "eval_count": use["completion_tokens"], "eval_duration": t_end - t_first,
                    "page_local": done["page_local"]}

        def streamed(turn, first):
            scan = tools.CallScanner(_names(job)) if job.offers_tools else None
            return StreamingResponse(_ndjson(turn, first, name, piece, final, scan), media_type="application/x-ndjson")

        def whole(parts: list[str], done: dict):
            text = "".join(parts)
            if job.offers_tools:
                text, calls = tools.split_calls(text, _names(job))
                return JSONResponse(final(done, text, calls))
            return JSONResponse(final(done, text))

        def first_came():
            clock["first"] = time.perf_counter_ns()

        return await run_turn(request, backend.pool.acquire(tokens, job.namespace, admission), start,
                              stream=streamed if job.stream else None, whole=whole, error=error_response,
                              on_first=first_came)

    return [Route("/api/version", guarded(version), methods=["GET", "HEAD"]),
            Route("/api/tags", guarded(tags), methods=["GET", "HEAD"]),
            Route("/api/ps", guarded(ps), methods=["GET"]),
            Route("/api/show", guarded(show), methods=["POST"]),
            Route("/api/chat", guarded(chat), methods=["POST"]),
            Route("/api/generate", guarded(generate), methods=["POST"]),
            Route("/api/embed", guarded(embed), methods=["POST"]),
            Route("/api/pull", guarded(pull_route(backend)), methods=["POST"])]


def _tag_entry(r: dict, tag) -> dict:
    """A model on this machine (model_routes.others) as /api/tags lists one. Its digest: the blob's sha256 for
    Ollama's own store; for the others a hash of the file's path, size and time (hashing gigabytes on every
    listing would take minutes), which names it as steadily."""
    path = str(r["path"])
    name = Path(path).name
    if r["store"] == "ollama" and name.startswith("sha256-"):
        digest = name[len("sha256-"):]
    else:
        digest = hashlib.sha256(f"{path}\0{r['size']}\0{r['modified']}".encode()).hexdigest()
    d = r["details"] or {}
    arch = d.get("architecture", "")
    return {"name": tag(r["name"]), "model": tag(r["name"]), "modified_at": _rfc3339(r["modified"]),
            "size": r["size"], "digest": digest,
            "details": {"parent_model": "", "format": "gguf", "family": arch, "families": [arch] if arch else None,
                        "parameter_size": d.get("parameters", ""), "quantization_level": d.get("quantization", "")}}


def _names(job) -> set[str]:
    return {t["function"]["name"] for t in job.tools or ()}


async def _ndjson(turn, first: tuple, name: str, piece, final, scan=None):
    """The NDJSON body, as Ollama streams it: a line per text piece ("done": false), then the line with
    done, done_reason and the counts; a mid-stream error is a line {"error": "..."}. scan: a
    tools.CallScanner when tools were offered (a call is one line with tool_calls, once it is whole)."""
    def line(obj) -> bytes:
        return (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")

    def lines(events):
        for kind, value in events:
            out = piece(value) if kind == "text" else piece("", [value])
            yield line({"model": name, "created_at": now_rfc3339(), **out, "done": False})

    try:
        event = first
        while True:
            if event[0] == "text":
                if scan is None:
                    yield line({"model": name, "created_at": now_rfc3339(), **piece(event[1]), "done": False})
                else:
                    for out in lines(scan.feed(event[1])):
                        yield out
            elif event[0] == "done":
                if scan is not None:
                    for out in lines(scan.flush()):
                        yield out
                yield line(final(event[1]))
                break
            else:
                yield line({"error": event[1].message})
                break
            event = await turn.next()
    finally:
        turn.close()  # a client gone mid-stream: the slot's thread stops within one token


def _typed(v: str):
    """A GGUF metadata value (llama.cpp gives strings) as a JSON number where it is one."""
    try:
        return int(v)
    except (TypeError, ValueError):
        pass
    try:
        f = float(v)
    except (TypeError, ValueError):
        return v
    return f if math.isfinite(f) else v

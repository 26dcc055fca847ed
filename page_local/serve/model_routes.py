"""Routes that read the served model without a conversation:

    POST /tokenize        llama-server's: {"content", "add_special"?, "parse_special"?, "with_pieces"?} -> {"tokens"}
    POST /detokenize      llama-server's: {"tokens"} -> {"content"}
    POST /v1/embeddings   OpenAI's: {"input": a string, a list of them, token ids or lists of them} -> vectors
    GET  /props           llama-server's: the defaults, the slots, the model's file, chat template and its caps

`others(backend)` gives the models on this machine besides the served one (registered and installed, or found
in the Hugging Face cache, llama.cpp's cache, LM Studio and Ollama: store/discover.py), which /v1/models and
Ollama's /api/tags list after it; this server runs only its own, and a request naming another gets a 404
that says how to serve that one.

An embedding is the served model's final hidden states, mean-pooled over the input's tokens and
L2-normalised (native/embed.py), what llama-server returns for a generative model with mean pooling.
It runs on a small context of its own, so no slot's conversation cache is touched, and it does not
wait for a slot. Fields these routes do not read are refused by name, as on the completion routes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from pathlib import Path

from page_local.serve.errors import ApiError, bad
from page_local.serve.http import Gone, read_body, ready, unless_gone
from page_local.serve.protocol import parse_json

MAX_INPUTS = 256  # inputs per embeddings request (OpenAI allows 2048; each one is a decode here)
TOKENIZE_FIELDS = ("content", "add_special", "parse_special", "with_pieces")
EMBED_FIELDS = ("input", "model", "encoding_format", "user")


OTHERS_TTL = 10.0  # seconds a listing of the stores is reused (apps poll /api/tags every few seconds)
_others: dict = {}  # {"at": monotonic time, "rows": [...]} of the last listing


def _machine_models() -> list[dict]:
    """Every model on this machine that --model can name: registered and installed, then found in the stores."""
    from page_local.store import discover, models

    rows = []
    for name in models.REGISTRY:
        try:
            path = models.model_path(name)
        except (OSError, ValueError):
            continue
        if path is not None:
            st = path.stat()
            try:
                details = discover.read_details(path)
            except discover.Unusable:
                details = None
            rows.append({"name": name, "store": "registry", "path": path, "size": st.st_size,
                         "modified": st.st_mtime, "details": details})
    found, _ = discover.discover()
    for f in found:
        rows.append({"name": f.name, "store": f.store, "path": f.path, "size": f.size,
                     "modified": f.path.stat().st_mtime, "details": f.details()})
    return rows


def forget_others() -> None:
    """The next listing reads the stores again (after a pull)."""
    _others.clear()


async def others(backend) -> list[dict]:
    """The models on this machine other than the served one ({"name", "store", "path", "size", "modified",
    "details": discover's header facts or None}), read off the event loop and reused for OTHERS_TTL seconds; a store that
    cannot be read costs its models, never the route."""
    now = time.monotonic()
    if not _others or now - _others["at"] > OTHERS_TTL:
        try:
            rows = await asyncio.to_thread(_machine_models)
        except OSError:
            rows = []
        _others.update(at=now, rows=rows)
    served = Path(backend.settings.model_path).resolve()
    return [r for r in _others["rows"] if Path(r["path"]).resolve() != served and r["name"] not in backend.names]


def not_loaded(backend, name: str) -> str | None:
    """For a request naming a model this server does not run: the words saying how to serve it, when the last
    listing has it (the listing is not read again here)."""
    for r in _others.get("rows", ()):
        if r["name"] == name or r["name"] == name.removesuffix(":latest"):
            return (f"the model {name!r} is on this machine but this server runs {backend.settings.served_name!r}; "
                    f"serve it with `page-local serve --model {r['name']}`")
    return None


def _known(body: dict, fields: tuple, route: str) -> None:
    for name in body:
        if name not in fields:
            raise bad(f"field {name} is not supported by {route}; it reads {', '.join(fields)}", name,
                      "unsupported_parameter")


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if not isinstance(v, bool):
        raise bad(f"{name} must be true or false, got {v!r}", name)
    return v


def _ids(value, name: str, n_vocab: int) -> list[int]:
    if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise bad(f"{name} must be a list of token ids (integers)", name)
    out_of_range = [t for t in value if not 0 <= t < n_vocab]
    if out_of_range:
        raise bad(f"{name}: token ids {out_of_range[:5]} are outside the vocabulary (0..{n_vocab - 1})", name)
    return value


def embedding_inputs(body: dict, model) -> list[list[int]]:
    """OpenAI's `input` as token lists: a string, a list of strings, a list of token ids, or a list of
    lists of token ids; strings tokenized as llama-server does (special tokens added and parsed)."""
    x = body.get("input")
    if x is None:
        raise bad("input is required: a string or a list of strings", "input", "missing_required_parameter")
    if isinstance(x, str) or (isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool)
                                                                 for t in x)):
        items = [x]
    elif isinstance(x, list) and x:
        items = x
    else:
        raise bad("input must be a non-empty string, a list of strings, or token ids", "input")
    if len(items) > MAX_INPUTS:
        raise bad(f"input has {len(items)} items; page-local embeds at most {MAX_INPUTS} per request", "input")
    out = []
    for i, item in enumerate(items):
        name = "input" if len(items) == 1 and not isinstance(x, list) else f"input[{i}]"
        if isinstance(item, str):
            if not item:
                raise bad(f"{name} is an empty string", name)
            out.append(model.tokenize(item, add_special=True, parse_special=True))
        else:
            out.append(_ids(item, name, model.n_vocab))
        if not out[-1]:
            raise bad(f"{name} has no tokens", name)
    return out


def _tokenize(model, body: dict) -> bytes:
    """/tokenize's answer, as JSON bytes (built in a worker thread: a 2 MB body takes a second)."""
    content = body.get("content")
    if not isinstance(content, str):
        raise bad("content must be a string", "content",
                  "missing_required_parameter" if content is None else "invalid_value")
    add_special = _flag(body, "add_special", False)  # llama-server's defaults
    parse_special = _flag(body, "parse_special", True)
    with_pieces = _flag(body, "with_pieces", False)
    toks = model.tokenize(content, add_special=add_special, parse_special=parse_special)
    if not with_pieces:
        return json.dumps({"tokens": toks}).encode()
    pieces = []
    for t in toks:  # llama-server: the piece as text when it is valid UTF-8, else its bytes
        raw = model.token_to_piece(t, special=True)
        try:
            piece = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        pieces.append({"id": t, "piece": piece})
    return json.dumps({"tokens": pieces}, ensure_ascii=False).encode()


def _detokenize(model, body: dict) -> bytes:
    toks = body.get("tokens")
    if toks is None:
        raise bad("tokens is required: a list of token ids", "tokens", "missing_required_parameter")
    raw = b"".join(model.token_to_piece(t, special=True) for t in _ids(toks, "tokens", model.n_vocab))
    # special tokens as text, as llama-server
    return json.dumps({"content": raw.decode("utf-8", "replace")}, ensure_ascii=False).encode()


async def embed(request, backend, body: dict, truncate: bool = False) -> tuple[list, int] | None:
    """The vectors of `body["input"]` (f32 (n_embd,) each) and their token count, or None when the client
    left. Tokenizing and embedding run on the backend's own embedding thread (Backend.embed_executor), one
    request at a time; a request waits for it on the event loop, where a client that leaves is noticed
    (and one that leaves while its inputs are embedded stops them between inputs). truncate: an input
    longer than an embedding reads is cut to its first tokens (Ollama's default), else a 400."""
    loop = asyncio.get_running_loop()
    gate = backend.embed_gate()
    try:
        await unless_gone(request, gate.acquire())
    except Gone:
        return None
    cancel = threading.Event()
    try:
        def work():
            inputs = embedding_inputs(body, backend.model)  # up to MAX_INPUTS tokenizations
            limit = backend.embed_ctx
            if truncate:
                inputs = [toks[:limit] for toks in inputs]
            for i, toks in enumerate(inputs):
                if len(toks) > limit:
                    raise bad(f"input{'' if len(inputs) == 1 else f'[{i}]'} is {len(toks)} tokens; an embedding "
                              f"reads at most {limit} (one batch, as llama-server)", "input")
            return backend.embed(inputs, cancel), sum(len(t) for t in inputs)

        try:
            return await unless_gone(request, loop.run_in_executor(backend.embed_executor, work))
        except Gone:
            cancel.set()
            return None
        except ValueError as e:
            raise bad(str(e), "input") from None
    finally:
        gate.release()


def routes(backend):
    """Starlette routes over `backend`."""
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    s = backend.settings

    async def read(request) -> dict:
        ready(backend)
        return parse_json(await read_body(request, s.max_body_bytes))

    async def tokenize(request):
        body = await read(request)
        _known(body, TOKENIZE_FIELDS, "/tokenize")
        return Response(await asyncio.to_thread(_tokenize, backend.model, body), media_type="application/json")

    async def detokenize(request):
        body = await read(request)
        _known(body, ("tokens",), "/detokenize")
        return Response(await asyncio.to_thread(_detokenize, backend.model, body), media_type="application/json")

    async def embeddings(request):
        body = await read(request)
        _known(body, EMBED_FIELDS, "/v1/embeddings")
        name = body.get("model")
        if name is not None and name not in backend.names:
            raise ApiError(404, f"the model {name!r} is not served here; this server serves {s.served_name!r}",
                           "model_not_found", "model")
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise bad(f"encoding_format must be \"float\" or \"base64\", got {fmt!r}", "encoding_format")
        done = await embed(request, backend, body)
        if done is None:
            return Response(status_code=499)
        vectors, n = done
        data = []
        for i, v in enumerate(vectors):  # f32 (n_embd,)
            emb = base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") if fmt == "base64" \
                else [float(x) for x in v]
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return JSONResponse({"object": "list", "data": data, "model": s.served_name,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def props(request):
        """llama-server's /props: the defaults a request gets, the slots, the model and its template."""
        ready(backend)
        m = backend.model
        lm = m.llama_model
        t = backend.tool_template
        return JSONResponse({
            "default_generation_settings": {"n_ctx": s.n_ctx, "model": s.served_name, "params": {
                "n_predict": -1, "temperature": 1.0, "top_k": 40, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0,
                "penalty_last_n": 64, "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": -1,
                "max_tokens_limit": backend.max_tokens_limit}},
            "total_slots": s.parallel, "model_path": s.model_path.name, "model_alias": s.served_name,
            "chat_template": t.source if t is not None else "",
            "chat_template_caps": {"supports_tools": bool(t and t.tool_format),
                                   "supports_tool_calls": bool(t and t.tool_format)},
            "bos_token": lm.token_get_text(lm.token_bos()) if lm.token_bos() >= 0 else "",
            "eos_token": lm.token_get_text(lm.token_eos()) if lm.token_eos() >= 0 else "",
            "modalities": {"vision": False, "audio": False}, "is_sleeping": False,
            "build_info": "page-local", "page_local": {"gate": s.gate, "budget": s.budget, "park": s.park,
                                                          "evictor": s.evictor}})

    return [Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"]),
            Route("/embeddings", embeddings, methods=["POST"]), Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/props", props, methods=["GET"])]

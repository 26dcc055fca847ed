"""Routes that read the served model without a conversation:

    POST /tokenize        llama-server's: {"content", "add_special"?, "parse_special"?, "with_pieces"?} -> {"tokens"}
    POST /detokenize      llama-server's: {"tokens"} -> {"content"}
    POST /v1/embeddings   OpenAI's: {"input": a string, a list of them, token ids or lists of them} -> vectors

An embedding is the served model's final hidden states, mean-pooled over the input's tokens and
L2-normalised (native/embed.py), what llama-server returns for a generative model with mean pooling.
It runs on a small context of its own, so no slot's conversation cache is touched, and it does not
wait for a slot. Fields these routes do not read are refused by name, as on the completion routes.
"""

from __future__ import annotations

import asyncio
import base64

from page_local.serve.errors import ApiError, bad
from page_local.serve.http import read_body, ready
from page_local.serve.protocol import parse_json

MAX_INPUTS = 256  # inputs per embeddings request (OpenAI allows 2048; each one is a decode here)
TOKENIZE_FIELDS = ("content", "add_special", "parse_special", "with_pieces")
EMBED_FIELDS = ("input", "model", "encoding_format", "user")


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


def routes(backend):
    """Starlette routes over `backend`."""
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    s = backend.settings

    def model():
        return backend.model

    async def read(request) -> dict:
        ready(backend)
        return parse_json(await read_body(request, s.max_body_bytes))

    async def tokenize(request):
        body = await read(request)
        _known(body, TOKENIZE_FIELDS, "/tokenize")
        content = body.get("content")
        if not isinstance(content, str):
            raise bad("content must be a string", "content",
                      "missing_required_parameter" if content is None else "invalid_value")
        add_special = _flag(body, "add_special", False)  # llama-server's defaults
        parse_special = _flag(body, "parse_special", True)
        with_pieces = _flag(body, "with_pieces", False)
        m = model()
        toks = m.tokenize(content, add_special=add_special, parse_special=parse_special)
        if not with_pieces:
            return JSONResponse({"tokens": toks})
        pieces = []
        for t in toks:  # llama-server: the piece as text when it is valid UTF-8, else its bytes
            raw = m.token_to_piece(t, special=True)
            try:
                piece = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)
            pieces.append({"id": t, "piece": piece})
        return JSONResponse({"tokens": pieces})

    async def detokenize(request):
        body = await read(request)
        _known(body, ("tokens",), "/detokenize")
        toks = body.get("tokens")
        if toks is None:
            raise bad("tokens is required: a list of token ids", "tokens", "missing_required_parameter")
        m = model()
        raw = b"".join(m.token_to_piece(t, special=True) for t in _ids(toks, "tokens", m.n_vocab))
        return JSONResponse({"content": raw.decode("utf-8", "replace")})  # special tokens as text, as llama-server

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
        inputs = await asyncio.to_thread(embedding_inputs, body, model())  # up to MAX_INPUTS tokenizations
        limit = backend.embed_ctx
        for i, toks in enumerate(inputs):
            if len(toks) > limit:
                raise bad(f"input{'' if len(inputs) == 1 else f'[{i}]'} is {len(toks)} tokens; an embedding reads at "
                          f"most {limit} (one batch, as llama-server)", "input")
        try:
            vectors = await asyncio.to_thread(backend.embed, inputs)
        except ValueError as e:
            raise bad(str(e), "input") from None
        data = []
        for i, v in enumerate(vectors):  # f32 (n_embd,)
            emb = base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") if fmt == "base64" \
                else [float(x) for x in v]
            data.append({"object": "embedding", "index": i, "embedding": emb})
        n = sum(len(t) for t in inputs)
        return JSONResponse({"object": "list", "data": data, "model": s.served_name,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    return [Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"]),
            Route("/embeddings", embeddings, methods=["POST"]), Route("/v1/embeddings", embeddings, methods=["POST"])]

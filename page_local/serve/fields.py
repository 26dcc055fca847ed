"""Which request fields the completion routes read, and how the sampling, structured-output and
logprobs fields become a Job's settings.

Every field a client sends is either honoured, accepted as having no effect here (said in
docs/serve.md), or refused with a 400 that names it: nothing is silently ignored, so a client never
believes a setting ran that did not (llama-server and Ollama ignore what they do not know; a
grammar or a penalty that is dropped without a word gives a wrong answer, not an error).

Structured output is grammar-constrained sampling: a JSON schema (response_format json_schema,
llama-server's json_schema) becomes a GBNF grammar by llama-cpp-python's converter, json_object is
llama.cpp's JSON grammar, and `grammar` is GBNF as it is; llama.cpp's grammar sampler then keeps
every token of the answer inside it. Whether a grammar parses is checked against the model's
vocabulary once the model is known (Backend.tokens).
"""

from __future__ import annotations

from page_local.serve.errors import bad

# read by both completion routes
COMMON = ("model", "max_tokens", "n_predict", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
          "stream_options", "repeat_penalty", "presence_penalty", "frequency_penalty", "penalty_last_n",
          "logit_bias", "response_format", "json_schema", "grammar", "n", "page_local", "cache_prompt",
          "return_progress")
HONOURED = {"chat": frozenset(COMMON + ("messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                        "tools", "tool_choice", "parallel_tool_calls")),
            "text": frozenset(COMMON + ("prompt",))}
# accepted and without effect here: who the client says the user is (OpenAI's abuse monitoring), and
# its own labels for the request; page-local keeps no record of either
NO_EFFECT = frozenset({"user", "metadata"})
# refused with their own reason (protocol._refuse_unsupported, or below): listed so the generic
# refusal does not hide the specific one
SPECIFIC = frozenset({"functions", "function_call", "logprobs", "echo", "suffix", "best_of"})
MAX_TOP_LOGPROBS = 20  # OpenAI's limit


def refuse_unknown(body: dict, kind: str) -> None:
    """400 for the first field (in the client's order) page-local does not read."""
    known = HONOURED[kind] | NO_EFFECT | SPECIFIC
    for name in body:
        if name not in known:
            route = "chat completions" if kind == "chat" else "text completions"
            raise bad(f"field {name} is not supported by page-local's {route}; leave it out (the fields read are "
                      f"{', '.join(sorted(HONOURED[kind]))}; {', '.join(sorted(NO_EFFECT))} are accepted without "
                      "effect)", name, "unsupported_parameter")
    if body.get("cache_prompt") not in (None, True):  # llama-server's; page-local always reuses a cached prefix
        raise bad("cache_prompt false is not supported: page-local always reuses the cached prefix of a "
                  "conversation (send true or leave it out)", "cache_prompt", "unsupported_parameter")


def _num(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise bad(f"{name} must be a number in [{lo:g}, {hi:g}], got {v!r}", name)
    return float(v)


def sampling(body: dict, job) -> None:
    """min_p, the penalties and logit_bias into the job (absent: off, so greedy stays greedy)."""
    job.min_p = _num(body, "min_p", 0, 1, 0.0)
    rp = _num(body, "repeat_penalty", 0, 10, 1.0)
    if rp == 0:
        raise bad("repeat_penalty must be above 0 (1 = off), got 0", "repeat_penalty")
    job.repeat_penalty = rp
    job.presence_penalty = _num(body, "presence_penalty", -2, 2, 0.0)  # OpenAI's range
    job.frequency_penalty = _num(body, "frequency_penalty", -2, 2, 0.0)
    last_n = body.get("penalty_last_n")
    if last_n is not None:
        if isinstance(last_n, bool) or not isinstance(last_n, int) or last_n < -1:
            raise bad(f"penalty_last_n must be an integer >= -1 (-1: the whole context, 0: off), got {last_n!r}",
                      "penalty_last_n")
        job.penalty_last_n = last_n
    job.logit_bias = _logit_bias(body.get("logit_bias"))


def _logit_bias(lb) -> dict[int, float] | None:
    """OpenAI's {"token id": bias in [-100, 100]} (llama-server's [[id, bias], ...] too)."""
    if lb is None or lb == {} or lb == []:
        return None
    pairs = lb.items() if isinstance(lb, dict) else lb
    if not isinstance(lb, (dict, list)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise bad("logit_bias must be an object like {\"1234\": -100} (token id -> bias in [-100, 100])",
                  "logit_bias")
    out = {}
    for k, v in pairs:
        try:
            tok = int(k) if not isinstance(k, bool) else None
        except (TypeError, ValueError):
            tok = None
        if tok is None or tok < 0 or isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise bad(f"logit_bias: {k!r}: {v!r} is not a token id with a bias in [-100, 100]", "logit_bias")
        out[tok] = float(v)
    return out


def max_tokens(body: dict, kind: str) -> tuple[int | None, str]:
    """(the answer's token limit or None, the field it came from): max_completion_tokens (chat),
    max_tokens, or llama-server's n_predict (-1: no limit of its own); two of them that disagree: 400."""
    given = []
    for name in (("max_completion_tokens",) if kind == "chat" else ()) + ("max_tokens", "n_predict"):
        v = body.get(name)
        if v is None or (name == "n_predict" and v == -1):
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            extra = " (or -1: until the answer or the context ends)" if name == "n_predict" else ""
            raise bad(f"{name} must be an integer >= 1{extra}, got {v!r}", name)
        given.append((name, v))
    if len({v for _, v in given}) > 1:
        names = " and ".join(n for n, _ in given)
        raise bad(f"{names} disagree ({', '.join(f'{n} = {v}' for n, v in given)}): send one of them",
                  given[-1][0])
    return (given[0][1], given[0][0]) if given else (None, "max_tokens")


def structured(body: dict) -> tuple[str | None, str | None]:
    """(GBNF text, the field it came from) for response_format / json_schema / grammar, or (None, None).
    A schema that does not convert is a 400 naming its field; at most one of the three may constrain."""
    from page_local.native.sampler import GrammarError, json_grammar, schema_to_grammar

    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise bad("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                      "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}, got "
                      f"{fmt!r}"[:300], "response_format")
        if fmt["type"] == "json_object":
            schema = fmt.get("schema")  # llama-server takes a schema here too
            found.append(("response_format", None if schema is None else ("schema", schema)))
        elif fmt["type"] == "json_schema":
            js = fmt.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), (dict, bool)):
                raise bad("response_format.json_schema must be an object with a schema: {\"name\": ..., "
                          "\"schema\": {...}}", "response_format.json_schema", "missing_required_parameter"
                          if not isinstance(js, dict) or "schema" not in js else "invalid_value")
            found.append(("response_format.json_schema.schema", ("schema", js["schema"])))
    if body.get("json_schema") is not None:
        schema = body["json_schema"]
        if not isinstance(schema, (dict, bool)):
            raise bad(f"json_schema must be a JSON schema object, got {type(schema).__name__}", "json_schema")
        found.append(("json_schema", ("schema", schema)))
    if body.get("grammar") is not None:
        g = body["grammar"]
        if not isinstance(g, str) or not g.strip():
            raise bad("grammar must be a non-empty GBNF grammar (a string with a root rule)", "grammar")
        found.append(("grammar", ("gbnf", g)))
    if len(found) > 1:
        names = ", ".join(n.split(".")[0] for n, _ in found)
        raise bad(f"{names} each constrain the answer: send only one of them", found[-1][0].split(".")[0])
    if not found:
        return None, None
    name, spec = found[0]
    try:
        if spec is None:
            return json_grammar(), name
        kind, value = spec
        return (value if kind == "gbnf" else schema_to_grammar(value)), name
    except GrammarError as e:
        raise bad(f"{name}: {e}", name) from None


def logprobs(body: dict, kind: str) -> int | None:
    """Chat: logprobs true -> the number of alternatives per token (top_logprobs, 0 by default); None: off."""
    if kind != "chat":
        return None
    on = body.get("logprobs")
    top = body.get("top_logprobs")
    if on not in (None, True, False):
        raise bad(f"logprobs must be true or false, got {on!r}", "logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}", "top_logprobs")
        if not on and top > 0:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if on else None


def check_with_model(job, model) -> None:
    """What needs the model's vocabulary: the grammar parses, logit_bias names real tokens (400s)."""
    bad_ids = [t for t in (job.logit_bias or {}) if t >= model.n_vocab]
    if bad_ids:
        raise bad(f"logit_bias: token ids {bad_ids[:5]} are outside the vocabulary (0..{model.n_vocab - 1})",
                  "logit_bias")
    if job.grammar is not None:
        from page_local.native.sampler import GrammarError, check_grammar

        try:
            check_grammar(model, job.grammar)
        except GrammarError as e:
            name = job.grammar_field or "grammar"
            raise bad(f"{name}: {e} (GBNF: https://github.com/ggml-org/llama.cpp/blob/master/grammars/README.md)",
                      name) from None

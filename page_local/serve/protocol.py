"""The OpenAI wire format, without a web framework: requests validated into a Job, errors in the
OpenAI envelope, the response bodies and stream chunks, and stop strings.

Every check names the offending field and value (style rule 5: a clear 400, never an assert), so a
client's mistake is a BadRequestError it can show, and the `openai` SDK never retries it (it
retries 408/409/429/5xx). A field page-local does not read is refused by name, as are those it knows
but cannot honour (n > 1, tools, echo); fields.py says which fields are read.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass, field

from page_local.gate import GATE_MODES
from page_local.serve import fields, tools
from page_local.serve.errors import bad

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_STOPS = 16  # OpenAI allows 4; llama-server more: enough for a chat template's turn markers
MAX_STOP_CHARS = 256
EXTENSION_FIELDS = ("gate", "budget", "evictor", "verify_tokens", "on_full", "cache_map")


@dataclass
class Overrides:
    """The request's `page_local` extension: server defaults replaced for this request only (None = keep)."""

    gate: str | None = None
    budget: float | int | None = None
    evictor: str | None = None
    verify_tokens: int | None = None
    on_full: str | None = None  # a turn that does not fit: "evict" earlier cells, or "refuse" (400)
    cache_map: bool = False  # the response says what the cache holds, in the messages' characters (held.py)


@dataclass
class Job:
    """One validated request: what to render, how to sample, how to answer."""

    kind: str  # "chat" | "text"
    model: str
    messages: list[dict] | None = None  # chat: [{"role", "content"}] with content as text
    prompt: str | None = None  # text completions
    max_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 40
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    return_progress: bool = False  # llama-server's: a streamed request also gets prompt_progress chunks
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64  # llama-server's default; -1: the whole context
    logit_bias: dict[int, float] | None = None
    grammar: str | None = None  # GBNF the answer must follow (structured output)
    grammar_field: str | None = None  # the request field it came from (for errors)
    logprobs: int | None = None  # chat: alternatives per token (top_logprobs); None: no logprobs
    tools: list[dict] | None = None  # chat: OpenAI's function tools (tools.parse_tools), shown to the model
    tool_choice: str = "none"  # "auto" | "none" | "required" | a function's name
    parallel_tool_calls: bool = True
    overrides: Overrides = field(default_factory=Overrides)
    namespace: str = ""  # whose conversation cache the request may reuse: its API key's (guards.KeyGuard)

    @property
    def offers_tools(self) -> bool:
        """The model is shown tools and may answer with calls (tools.py reads them back)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def uses_tools(self) -> bool:
        """The request needs a chat template with tool calling: tools offered, or tool calls and results
        in its conversation (tools with tool_choice "none" are shown to a model that has them)."""
        return self.offers_tools or any(m["role"] == "tool" or m.get("tool_calls") for m in self.messages or ())

    def sampling(self):
        """The engine's Sampling for this request (every sampling field the request set)."""
        from page_local.engine.engine import Sampling

        return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                        min_p=self.min_p, repeat_penalty=self.repeat_penalty,
                        presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                        penalty_last_n=self.penalty_last_n, logit_bias=self.logit_bias, grammar=self.grammar,
                        logprobs=self.logprobs)


# --- validation --------------------------------------------------------------------------------

def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except RecursionError:  # the C decoder's depth check (about 1000 levels), not a crash
        raise bad("the request body nests arrays or objects too deeply to be read; no request field nests more "
                  "than a few levels", code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
        raise bad(f"the request body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _number(body: dict, name: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v > hi or v < lo or (lo_open and v == lo):
        span = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
        raise bad(f"{name} must be a number in {span}, got {v!r}", name)
    return float(v)


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad(f"{name} must be an integer {span}, got {v!r}", name)
    return v


def _refuse_unsupported(body: dict, kind: str) -> None:
    """Fields page-local knows and cannot honour: refused by name (a silent ignore would mislead)."""
    n = body.get("n")
    if n is not None and n != 1:
        raise bad(f"n = {n!r} is not supported: page-local returns one choice per request (n = 1)", "n",
                  "unsupported_parameter")
    if kind == "chat":
        for name, instead in (("functions", "tools"), ("function_call", "tool_choice")):
            if body.get(name) is not None:
                raise bad(f"{name} (OpenAI's deprecated form) is not supported by page-local: send {instead}", name,
                          "unsupported_parameter")
    else:
        if body.get("logprobs") is not None:
            raise bad("logprobs are not supported on page-local's text completions (chat completions have them)",
                      "logprobs", "unsupported_parameter")
        if body.get("echo"):
            raise bad("echo is not supported by page-local", "echo", "unsupported_parameter")
        if body.get("suffix"):
            raise bad("suffix (insertion) is not supported by page-local", "suffix", "unsupported_parameter")
        if body.get("best_of") not in (None, 1):
            raise bad(f"best_of = {body['best_of']!r} is not supported: page-local returns one choice", "best_of",
                      "unsupported_parameter")


def _content(content, i: int) -> str:
    """A message's content as text: a string, or a list of {"type": "text", "text"} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"messages[{i}].content: only text parts are supported, got a {kind!r} part",
                          f"messages[{i}].content", "unsupported_parameter")
        return "\n".join(texts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}",
              f"messages[{i}].content")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages",
                  "missing_required_parameter" if msgs is None else "invalid_value")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with role and content", f"messages[{i}]")
        role = m.get("role")
        if role == "function" or m.get("function_call"):
            raise bad(f"messages[{i}]: function messages and function_call (OpenAI's deprecated form) are not "
                      "supported by page-local: send tool_calls and role \"tool\"", f"messages[{i}]",
                      "unsupported_parameter")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}", f"messages[{i}].role")
        calls = m.get("tool_calls")
        if calls is not None and role != "assistant":
            raise bad(f"messages[{i}].tool_calls: only an assistant message has tool calls",
                      f"messages[{i}].tool_calls")
        if calls and m.get("content") is None:
            content = ""  # an assistant's call without text: OpenAI sends content null
        elif "content" not in m or m["content"] is None:
            raise bad(f"messages[{i}] has no content", f"messages[{i}].content", "missing_required_parameter")
        else:
            content = _content(m["content"], i)
        msg = {"role": ROLES[role], "content": content}
        if calls:
            msg["tool_calls"] = tools.message_tool_calls(calls, i)
        if role == "tool":
            call_id = m.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise bad(f"messages[{i}].tool_call_id must be a string", f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = call_id or ""
            name = m.get("name")
            if isinstance(name, str) and name:
                msg["name"] = name
        out.append(msg)
    return out


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad(f"stop must be a string or a list of strings, got {stop!r}", "stop")
    if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad(f"stop takes at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters",
                  "stop")
    return stops


def _overrides(body: dict) -> Overrides:
    """The `page_local` extension. Types are checked here; the values (an evictor's name, a budget's
    range) by the engine's own setters when they are applied, so the rules live in one place."""
    ext = body.get("page_local")
    if ext is None:
        return Overrides()
    if not isinstance(ext, dict):
        raise bad(f"page_local must be an object with some of {', '.join(EXTENSION_FIELDS)}", "page_local")
    unknown = sorted(set(ext) - set(EXTENSION_FIELDS))
    if unknown:  # our own extension: a typo must not silently run with the server's defaults
        raise bad(f"page_local: unknown field(s) {', '.join(unknown)}; known: {', '.join(EXTENSION_FIELDS)}",
                  f"page_local.{unknown[0]}")
    o = Overrides()
    gate = ext.get("gate")
    if gate is not None:
        if gate not in GATE_MODES:
            raise bad(f"page_local.gate must be one of {', '.join(GATE_MODES)}, got {gate!r}", "page_local.gate")
        o.gate = gate
    budget = ext.get("budget")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, (int, float)):
            raise bad(f"page_local.budget must be a ratio like 0.25 or a count like 1024, got {budget!r}",
                      "page_local.budget")
        o.budget = budget
    evictor = ext.get("evictor")
    if evictor is not None:
        if not isinstance(evictor, str):
            raise bad(f"page_local.evictor must be an evictor's name, got {evictor!r}", "page_local.evictor")
        o.evictor = evictor
    vt = ext.get("verify_tokens")
    if vt is not None:
        if isinstance(vt, bool) or not isinstance(vt, int) or not 1 <= vt <= 256:
            raise bad(f"page_local.verify_tokens must be an integer in [1, 256], got {vt!r}",
                      "page_local.verify_tokens")
        o.verify_tokens = vt
    on_full = ext.get("on_full")
    if on_full is not None:
        if not isinstance(on_full, str):
            raise bad(f"page_local.on_full must be \"evict\" or \"refuse\", got {on_full!r}", "page_local.on_full")
        o.on_full = on_full
    cache_map = ext.get("cache_map")
    if cache_map is not None:
        if not isinstance(cache_map, bool):
            raise bad(f"page_local.cache_map must be true or false, got {cache_map!r}", "page_local.cache_map")
        o.cache_map = cache_map
    return o


def parse_job(body: dict, kind: str, max_tokens_limit: int) -> Job:
    """A chat ("chat") or text ("text") completion request -> Job; ApiError(400) says what is wrong."""
    _refuse_unsupported(body, kind)
    fields.refuse_unknown(body, kind)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"model must be a string, got {model!r}", "model")
    job = Job(kind=kind, model=model or "")
    if kind == "chat":
        job.messages = _messages(body)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise bad("prompt must be a string (one prompt per request)", "prompt",
                      "missing_required_parameter" if prompt is None else "invalid_value")
        if not prompt.strip():
            raise bad("the prompt is empty", "prompt")
        job.prompt = prompt
    mt, mt_field = fields.max_tokens(body, kind)
    if mt is not None and mt > max_tokens_limit:
        raise bad(f"{mt_field} {mt} is above this server's limit of {max_tokens_limit}", mt_field)
    job.max_tokens = mt if mt is not None else max_tokens_limit
    job.temperature = _number(body, "temperature", 0, 5, 1.0)  # OpenAI's default is 1
    job.top_p = _number(body, "top_p", 0, 1, 1.0, lo_open=True)
    top_k = _int(body, "top_k", 0)  # llama-server's extension; 0 = off
    job.top_k = 40 if top_k is None else top_k
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad(f"seed must be an integer, got {seed!r}", "seed")
    # no seed: a fresh draw per request, as OpenAI (a regenerate gives another answer at temperature > 0)
    job.seed = secrets.randbits(32) if seed is None else seed % 2**32
    job.stop = _stop(body)
    fields.sampling(body, job)
    job.grammar, job.grammar_field = fields.structured(body)
    job.logprobs = fields.logprobs(body, kind)
    if kind == "chat":
        _tools(body, job)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad(f"stream must be true or false, got {stream!r}", "stream")
    job.stream = bool(stream)
    progress = body.get("return_progress", False)
    if progress is not None and not isinstance(progress, bool):
        raise bad(f"return_progress must be true or false, got {progress!r}", "return_progress")
    job.return_progress = bool(progress) and job.stream  # as llama-server: progress exists only in a stream
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options must be an object like {\"include_usage\": true}", "stream_options")
        for key in opts:  # include_obfuscation: OpenAI's padding of chunks; page-local adds none (no effect)
            if key not in ("include_usage", "include_obfuscation"):
                raise bad(f"stream_options.{key} is not supported by page-local (it reads include_usage; "
                          "include_obfuscation is accepted without effect)", f"stream_options.{key}",
                          "unsupported_parameter")
        job.include_usage = bool(opts.get("include_usage"))
    job.overrides = _overrides(body)
    return job


def _tools(body: dict, job: Job) -> None:
    """tools, tool_choice, parallel_tool_calls into the job; a call's grammar replaces no other constraint."""
    job.tools = tools.parse_tools(body.get("tools"))
    job.tool_choice = tools.parse_tool_choice(body.get("tool_choice"), job.tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad(f"parallel_tool_calls must be true or false, got {parallel!r}", "parallel_tool_calls")
    job.parallel_tool_calls = parallel is not False
    if not job.offers_tools:
        if job.tools and job.grammar is None:  # shown, and not to be called: text only
            job.grammar, job.grammar_field = tools.text_grammar(), "tool_choice"
        return
    if job.grammar is not None:
        raise bad(f"{job.grammar_field} and tools each constrain the answer: send one of them, or tool_choice "
                  "\"none\"", job.grammar_field.split(".")[0])
    if job.logprobs is not None:
        raise bad("logprobs with tools are not supported by page-local (a call's tokens are not text)", "logprobs",
                  "unsupported_parameter")
    job.grammar = tools.call_grammar(job.tools, job.tool_choice, job.parallel_tool_calls)
    job.grammar_field = "tools"


# --- stop strings ------------------------------------------------------------------------------

class StopScanner:
    """Cut the generated text at the first stop string, also when one spans pieces: feed() returns
    what may be shown now and holds back a tail that could still begin a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.buf = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        self.buf += piece
        if not self.stops:
            out, self.buf = self.buf, ""
            return out
        cut = min((i for i in (self.buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.buf = self.buf[:cut], ""
            return out
        keep = 0  # the longest tail of buf that is a proper prefix of a stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buf)), keep, -1):
                if self.buf.endswith(s[:k]):
                    keep = k
                    break
        out, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out

    def flush(self) -> str:
        out, self.buf = ("" if self.stopped else self.buf), ""
        return out


# --- response envelopes ------------------------------------------------------------------------

def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def finish_reason(engine_finish: str, stopped: bool) -> str:
    """The engine's stop | length | context | interrupted -> OpenAI's stop | length."""
    if stopped or engine_finish == "stop":
        return "stop"
    return "length"  # max_tokens, or the context filled up (llama-server says "length" too)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def finite(obj):
    """JSON has no NaN or infinity: such floats (a D the probe could not compute) become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def _logprobs(entries: list | None) -> dict | None:
    return None if entries is None else {"content": entries, "refusal": None}


def body(kind: str, rid: str, created: int, model: str, text: str, finish: str, use: dict, extension: dict,
         logprobs: list | None = None, tool_calls: list | None = None) -> dict:
    """A whole (not streamed) chat.completion or text_completion object. logprobs: the chat answer's
    tokens in OpenAI's shape (logprobs.LogprobTracker), None when not asked for. tool_calls: the calls the
    answer made (tools.split_calls): then the content is null when no text came with them."""
    if kind == "chat":
        message = {"role": "assistant", "content": text}
        if tool_calls:
            message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
        choice = {"index": 0, "message": message, "logprobs": _logprobs(logprobs), "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": use,
            "page_local": extension}


def chunk(kind: str, rid: str, created: int, model: str, text: str | None = None, role: bool = False,
          finish: str | None = None, use: dict | None = None, include_usage: bool = False,
          extension: dict | None = None, logprobs: list | None = None, tool_call: tuple | None = None) -> dict:
    """One stream chunk. use: the usage-only chunk (no choices). include_usage: the other chunks carry
    "usage": null, as OpenAI's do when the client asked for the usage chunk. tool_call: (index, the call)
    sent whole in one delta."""
    if kind == "chat":
        obj = "chat.completion.chunk"
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        if tool_call is not None:
            delta = {"tool_calls": [{"index": tool_call[0], **tool_call[1]}]}
        choices = [{"index": 0, "delta": delta, "logprobs": _logprobs(logprobs), "finish_reason": finish}]
    else:
        obj = "text_completion"
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if use is not None:
        out["choices"], out["usage"] = [], use
    elif include_usage:
        out["usage"] = None
    if extension is not None:
        out["page_local"] = extension
    return out


def progress_chunk(kind: str, rid: str, created: int, model: str, progress: dict) -> dict:
    """A chunk of the prompt's reading (return_progress), in llama-server's shape: no choices, and
    prompt_progress {total, cache, processed, time_ms} (tokens of the prompt; cache: those reused)."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "prompt_progress": progress}


def now() -> int:
    return int(time.time())

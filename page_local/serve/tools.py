"""Tool calling: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` validated, the grammar that keeps
a call inside its function's JSON schema, and the model's calls read back out of its text.

The model is shown the tools by its own chat template (chat_template.ToolTemplate) and answers in the
format that template asks for; page-local reads Hermes' (Qwen2.5's):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Small models often write the same JSON bare or in a ```json block instead (Qwen2.5-Coder-0.5B does);
those are read as calls too when the answer is nothing else (as llama.cpp's Hermes parser reads them).

A call is constrained by llama.cpp's grammar sampler, as JSON mode is (fields.structured): the JSON
must be {"name": one of the offered functions, "arguments": that function's `parameters` schema}, by
llama-cpp-python's schema converter. With tool_choice "required" or a named function the whole answer
is calls; with "auto" the answer is either calls or text that does not open like one (not with `<`,
`{` or ```json: llama.cpp's grammar sampler has no lazy trigger here, so the choice is made at the
first characters); with "none" the model is shown the tools (a conversation keeps one prefix whichever it is) and its
answer is such text.
"""

from __future__ import annotations

import json
import re
import secrets

from page_local.serve.errors import bad

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE = "```json"
MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_RULE = "page-local-call"
# text that does not open like a call: not "<", "{" or "```json" (empty text too)
_TEXT = "page-local-text ::= (" + " | ".join(["[^<{`] .*"] + [f'"{FENCE[:k]}" ([^{FENCE[k]}] .*)?'
                                                             for k in range(1, len(FENCE))]) + ")?"


# --- requests ----------------------------------------------------------------------------------

def parse_tools(value, param: str = "tools", flat: bool = False) -> list[dict] | None:
    """OpenAI's `tools` -> [{"type": "function", "function": {"name", "description", "parameters"}}] (None when
    absent or empty). flat: the Responses API's shape, {"type": "function", "name", "parameters", ...}."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise bad(f"{param} must be a list of {{\"type\": \"function\", ...}} objects", param)
    if len(value) > MAX_TOOLS:
        raise bad(f"{param} has {len(value)} tools; at most {MAX_TOOLS}", param)
    out, names = [], set()
    for i, tool in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise bad(f"{where}: only function tools are supported, got {kind!r}", f"{where}.type",
                      "unsupported_parameter")
        fn = tool if flat else tool.get("function")
        if not isinstance(fn, dict):
            raise bad(f"{where}.function must be an object with a name", f"{where}.function")
        fwhere = where if flat else f"{where}.function"
        known = {"name", "description", "parameters", "strict"} | ({"type"} if flat else set())
        for key in fn:
            if key not in known:
                raise bad(f"{fwhere}.{key} is not supported by page-local (a function has {', '.join(sorted(known))})",
                          f"{fwhere}.{key}", "unsupported_parameter")
        if not flat:
            for key in tool:
                if key not in ("type", "function"):
                    raise bad(f"{where}.{key} is not supported by page-local", f"{where}.{key}",
                              "unsupported_parameter")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad(f"{fwhere}.name must be 1-64 letters, digits, _ . : or -, got {name!r}", f"{fwhere}.name")
        if name in names:
            raise bad(f"{fwhere}.name {name!r} is given twice", f"{fwhere}.name")
        names.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad(f"{fwhere}.description must be a string", f"{fwhere}.description")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad(f"{fwhere}.parameters must be a JSON schema object", f"{fwhere}.parameters")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad(f"{fwhere}.strict must be true or false", f"{fwhere}.strict")
        clean = {"name": name, "parameters": params}
        if desc:
            clean["description"] = desc
        out.append({"type": "function", "function": clean})
    return out


def parse_tool_choice(value, tools: list[dict] | None, param: str = "tool_choice") -> str:
    """"auto" | "none" | "required" | a function's name. Absent: "auto" with tools, "none" without."""
    if value is None:
        return "auto" if tools else "none"
    names = [t["function"]["name"] for t in tools or ()]
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise bad(f"{param} must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"function\": "
                      f"{{\"name\": ...}}}}, got {value!r}", param)
        if value != "none" and not tools:
            raise bad(f"{param} {value!r} needs tools", param)
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function") if "function" in value else value  # the Responses API's is flat
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise bad(f"{param} names the function {name!r}, which is not among the tools "
                      f"({', '.join(names) or 'none'})", param)
        return name
    raise bad(f"{param} must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"function\": "
              f"{{\"name\": ...}}}}, got {value!r}"[:300], param)


def arguments_object(args, param: str):
    """A tool call's arguments as the template wants them: an object (OpenAI sends a JSON string)."""
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except ValueError:
            raise bad(f"{param} must be a JSON object (as a string), got {args[:80]!r}", param) from None
    if isinstance(args, dict):
        return args
    raise bad(f"{param} must be a JSON object or a string holding one", param)


def message_tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's tool_calls, as the template renders them."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list) or not calls:
        raise bad(f"{where} must be a non-empty list", where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{where}[{j}] must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                      "\"arguments\"}}}}", f"{where}[{j}]")
        out.append({"id": call.get("id") or new_call_id(), "type": "function",
                    "function": {"name": fn["name"],
                                 "arguments": arguments_object(fn.get("arguments", {}),
                                                               f"{where}[{j}].function.arguments")}})
    return out


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# --- the grammar -------------------------------------------------------------------------------

def call_grammar(tools: list[dict], choice: str, parallel: bool) -> str:
    """GBNF for the answer: Hermes calls whose JSON is {"name", "arguments"} of the offered functions (one, or
    several with `parallel`); with choice "auto", text that does not open with a call is allowed instead."""
    from page_local.native.sampler import GrammarError, schema_to_grammar

    offered = [t["function"] for t in tools if choice in ("auto", "required") or t["function"]["name"] == choice]
    alts = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
             "required": ["name", "arguments"], "additionalProperties": False} for f in offered]
    schema = alts[0] if len(alts) == 1 else {"anyOf": alts}
    try:
        gbnf = schema_to_grammar(schema)
    except GrammarError as e:
        raise bad(f"tools: a function's parameters could not be turned into a grammar: {e}", "tools") from None
    lines = gbnf.splitlines()
    body = [(_RULE + line[len("root"):]) if line.startswith("root ::=") else line for line in lines]
    if any(re.search(r"(?<![\w-])root(?![\w-])", line) for line in body if not line.startswith(_RULE)):
        raise bad("tools: a function's parameters refer to the whole schema (\"$ref\": \"#\"), which page-local "
                  "cannot constrain", "tools")
    one = f'"{OPEN}\\n" {_RULE} "\\n{CLOSE}"'
    tagged = f"{one} (\"\\n\" {one})*" if parallel else one
    head = [f"root ::= page-local-calls{' | page-local-text' if choice == 'auto' else ''}",
            f'page-local-calls ::= {tagged} | {_RULE} | "```json\\n" {_RULE} "\\n```"']
    if choice == "auto":
        head.append(_TEXT)
    return "\n".join(head + body) + "\n"


def text_grammar() -> str:
    """GBNF for an answer that is text and not a call (tool_choice "none" with the tools shown): it does not
    open with "<", "{" or "`" (small models write a call in a code block when told not to call)."""
    return "root ::= ([^<{`] .*)?\n"


# --- the answer --------------------------------------------------------------------------------

def _call(inner: str, names: set[str]) -> dict | None:
    try:
        obj = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def split_calls(text: str, names: set[str]) -> tuple[str, list[dict]]:
    """(the text outside the calls, stripped; the calls in OpenAI's shape). A call that does not parse, or
    names a function that was not offered, stays in the text."""
    scan = CallScanner(names)
    events = scan.feed(text) + scan.flush()
    content = "".join(e[1] for e in events if e[0] == "text")
    return content.strip(), [e[1] for e in events if e[0] == "call"]


def _bare(text: str, names: set[str]) -> list[dict] | None:
    """An answer that is only a call's JSON (or a list of them), bare or in a ```json block: its calls."""
    t = text.strip()
    if t.startswith("```"):
        t = t[3:]
        t = t[4:] if t.startswith("json") else t
        if not t.rstrip().endswith("```"):
            return None
        t = t.rstrip()[:-3]
    t = t.strip()
    try:
        obj = json.loads(t)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [_call(json.dumps(item), names) for item in items]
    return calls if calls and all(calls) else None


class CallScanner:
    """Text pieces in, ("text", str) and ("call", OpenAI tool call) events out: text that could be the start
    of a call is held back until it is one (or is not)."""

    def __init__(self, names: set[str]):
        self.names = names
        self.buf = ""
        self.hold: bool | None = None  # None: undecided; True: the answer opened like a bare call (held whole)

    def feed(self, piece: str) -> list[tuple]:
        self.buf += piece
        head = self.buf.lstrip()
        if self.hold is None and head:  # decided by the answer's first characters
            if head[0] == "`":  # "```json" holds; "```python", or any other text, does not
                if len(head) >= len(FENCE) or not FENCE.startswith(head):
                    self.hold = head.startswith(FENCE)
            else:
                self.hold = head[0] == "{"
        if self.hold is not False:
            return []
        out: list[tuple] = []
        while True:
            at = self.buf.find(OPEN)
            if at < 0:
                keep = 0  # the longest tail that is a proper prefix of OPEN
                for k in range(min(len(OPEN) - 1, len(self.buf)), 0, -1):
                    if self.buf.endswith(OPEN[:k]):
                        keep = k
                        break
                text, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                if text:
                    out.append(("text", text))
                return out
            end = self.buf.find(CLOSE, at)
            if end < 0:
                if at:
                    out.append(("text", self.buf[:at]))
                    self.buf = self.buf[at:]
                return out
            call = _call(self.buf[at + len(OPEN): end].strip(), self.names)
            if at:
                out.append(("text", self.buf[:at]))
            out.append(("call", call) if call else ("text", self.buf[at: end + len(CLOSE)]))
            rest = self.buf[end + len(CLOSE):]
            self.buf = rest.lstrip("\n") if call else rest

    def flush(self) -> list[tuple]:
        if self.hold:
            calls = _bare(self.buf, self.names)
            if calls:
                self.buf = ""
                return [("call", c) for c in calls]
            self.hold = False
            return self.feed("") + self.flush()
        out, self.buf = ([("text", self.buf)] if self.buf else []), ""
        return out

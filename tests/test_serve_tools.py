"""Tool calls and reasoning through the server as an agent's client sees them: a real process (tools/serve.py on
127.0.0.1, a free port, started once for the module) on a checkpoint whose greedy replies are known exactly
(chain_model.py: Qwen3.5's chat format; a reasoning, then an XML call of get_weather; once the tool's result is
in the prompt, a reasoning and an answer), called with the official `openai` client and raw HTTP (httpx).

Covered: the agent loop (call, the result sent back as a `tool` message, the answer), whole and streamed
(`delta.tool_calls` with the name first and the arguments in pieces, `delta.reasoning_content`), n > 1,
enable_thinking false (the template closes the reasoning in the prompt), tool_choice "none" (no tools rendered,
no call parsed), a call of a function the request does not offer (content, never a 500), a reply cut inside a
call, and the 400s naming their field (a tool without a name, tool_choice naming an unknown function, OpenAI's
fields this server does not honour). Forced calls (tool_choice "required" / named): test_serve_structured.py."""

import enum
import json

import httpx
import openai
import pydantic
import pytest

from chain_model import (AFTER_TOOL_REASONING, ANSWER, CALL, REASONING, WEATHER_TOOL, chain_checkpoint)
from server_process import running_server

NAME = "tiny-tools"
TIMEOUT = 120
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
ARGUMENTS = {"city": "Paris", "days": 3}
OTHER_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = chain_checkpoint(tmp_path_factory.mktemp("ckpt"))
    flags = ["--served-model-name", NAME, "--num-slots", "4", "--max-context", "2048", "--token-budget", "512"]
    with running_server(folder, tmp_path_factory.mktemp("server"), flags, TIMEOUT) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def ask(client, messages, tools=(WEATHER_TOOL,), **kw):
    return client.chat.completions.create(model=NAME, messages=messages, tools=list(tools), temperature=0, **kw)


def weather(city: str, days: int) -> dict:
    return {"city": city, "days": days, "forecast": "sunny", "celsius": 22}


def test_an_agent_loop_through_the_qwen_chat_template(client):
    messages = list(USER)
    first = ask(client, messages)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.reasoning_content == REASONING
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGUMENTS  # "days" an integer: its schema's type
    messages.append(choice.message.model_dump(exclude_none=True))  # as agents send it back
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(weather(**ARGUMENTS))})
    second = ask(client, messages)
    choice = second.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert (choice.message.reasoning_content, choice.message.content) == (AFTER_TOOL_REASONING, ANSWER)


def _streamed(client, messages, n=1, **kw) -> list[dict]:
    """Per choice: its reasoning and content joined, its tool-call deltas, finish reason."""
    choices = [{"reasoning": "", "content": "", "calls": [], "finish": None} for _ in range(n)]
    for chunk in ask(client, messages, n=n, stream=True, **kw):
        for c in chunk.choices:
            got = choices[c.index]
            got["reasoning"] += getattr(c.delta, "reasoning_content", None) or ""
            got["content"] += c.delta.content or ""
            got["calls"] += [d.model_dump(exclude_none=True) for d in c.delta.tool_calls or ()]
            got["finish"] = c.finish_reason or got["finish"]
    return choices


def test_the_agent_loop_streamed_with_arguments_in_pieces(client):
    for got in _streamed(client, USER, n=2):
        assert (got["reasoning"], got["content"], got["finish"]) == (REASONING, "", "tool_calls")
        first, *pieces = got["calls"]
        assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
        assert first["function"] == {"name": "get_weather", "arguments": ""}
        assert all(set(p) == {"index", "function"} and p["index"] == 0 for p in pieces)
        arguments = [p["function"]["arguments"] for p in pieces]
        assert len(arguments) == 3 and json.loads("".join(arguments)) == ARGUMENTS  # one piece a parameter, "}"
    call = {"id": first["id"], "type": "function", "function": {"name": "get_weather", "arguments": "".join(arguments)}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(weather(**ARGUMENTS))}]
    (got,) = _streamed(client, messages)
    assert got == {"reasoning": AFTER_TOOL_REASONING, "content": ANSWER, "calls": [], "finish": "stop"}


def test_the_reasoning_under_both_of_vllms_names(client):
    """The reasoning comes as `reasoning_content` and as `reasoning` (vLLM's newer name, which its clients read),
    whole and streamed; a past reply's reasoning sent back under either name reaches the template alike."""
    message = ask(client, USER).choices[0].message
    assert message.reasoning == message.reasoning_content == REASONING
    streamed = "".join(getattr(c.choices[0].delta, "reasoning", None) or ""
                       for c in ask(client, USER, stream=True) if c.choices)
    assert streamed == REASONING
    tokens = {}
    for name in (None, "reasoning", "reasoning_content"):
        past = {"role": "assistant", "content": "Sunny.", **({name: REASONING} if name else {})}
        tokens[name] = ask(client, [*USER, past, *USER], max_tokens=1).usage.prompt_tokens
    assert tokens["reasoning"] == tokens["reasoning_content"] > tokens[None], tokens


def test_parallel_tool_calls_false_is_served(client):
    """parallel_tool_calls false with tool_choice auto (LangChain's and the Agents SDK's way to ask for one call at a
    time; once a 400): served, the reply's first call given (the others dropped, as vLLM does: test_reply_parsers)."""
    for stream in (False, True):
        if stream:
            calls = [d for c in ask(client, USER, parallel_tool_calls=False, stream=True) if c.choices
                     for d in c.choices[0].delta.tool_calls or ()]
            name, arguments = calls[0].function.name, "".join(d.function.arguments for d in calls)
        else:
            (call,) = ask(client, USER, parallel_tool_calls=False).choices[0].message.tool_calls
            name, arguments = call.function.name, call.function.arguments
        assert (name, json.loads(arguments)) == ("get_weather", ARGUMENTS), stream


def test_without_thinking_the_reply_is_the_call_alone(client):
    choice = ask(client, USER, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
    assert choice.message.reasoning_content is None and choice.message.content is None
    assert json.loads(choice.message.tool_calls[0].function.arguments) == ARGUMENTS


def test_tool_choice_none_renders_no_tools_and_parses_no_call(client):
    auto, none = ask(client, USER), ask(client, USER, tool_choice="none")
    assert none.usage.prompt_tokens < auto.usage.prompt_tokens  # the tools are not in the prompt
    choice = none.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert (choice.message.reasoning_content, choice.message.content) == (REASONING, "".join(CALL))


def test_a_call_of_a_function_the_request_does_not_offer_stays_content(client):
    whole = ask(client, USER, tools=[OTHER_TOOL]).choices[0]
    assert whole.finish_reason == "stop" and whole.message.tool_calls is None
    assert whole.message.content == "".join(CALL)
    (streamed,) = _streamed(client, USER, tools=[OTHER_TOOL])
    assert streamed == {"reasoning": REASONING, "content": "".join(CALL), "calls": [], "finish": "stop"}



class City(str, enum.Enum):
    PARIS = "Paris"
    ROME = "Rome"


class Days(enum.IntEnum):
    ONE, THREE = 1, 3


class Forecast(pydantic.BaseModel):
    """get_weather's arguments as pydantic writes them: each enum a "$ref" to its "$defs" entry."""
    city: City
    days: Days


def test_parameters_typed_through_references_to_their_defs(client):
    """A parameter whose schema is a reference into the parameters' own $defs (pydantic's enums and nested models)
    is typed by what it points at: days, a "$ref" to an integer enum, is 3, not "3" (once left a string, which the
    pydantic model then refused), whole and streamed."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": Forecast.model_json_schema()}}
    assert tool["function"]["parameters"]["properties"]["days"] == {"$ref": "#/$defs/Days"}
    (call,) = ask(client, USER, tools=[tool]).choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == ARGUMENTS
    assert Forecast.model_validate_json(call.function.arguments) == Forecast(city=City.PARIS, days=Days.THREE)
    (streamed,) = _streamed(client, USER, tools=[tool])
    assert json.loads("".join(d["function"].get("arguments", "") for d in streamed["calls"])) == ARGUMENTS


def test_a_reply_cut_inside_a_call_closes_it_and_keeps_length(client):
    choice = ask(client, USER, max_tokens=3).choices[0]  # the reasoning, </think>, the call's <function=...>
    assert choice.finish_reason == "length"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("get_weather", "{}")]


def _error(server, body) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps({"messages": USER, "max_tokens": 1, **body}),
                   headers={"Content-Type": "application/json"}, timeout=TIMEOUT)  # (ASCII JSON: \u escapes)
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize("body, param, says", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "function.name"),
    ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools", "function.name"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools", "type"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools", "more than once"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "half \ud83d"}}]}, "tools",
     "invalid Unicode"),  # (a lone surrogate: the template would render what UTF-8 cannot encode)
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice", "'get_time'"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
])
def test_bad_tools_are_400_naming_the_field(server, body, param, says):
    error = _error(server, body)
    assert error["param"] == param and says in error["message"], error


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER_TOOL], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"functions": [WEATHER_TOOL["function"]]}, "functions"),
])
def test_what_the_server_does_not_honour_is_refused_by_name(server, body, param):
    error = _error(server, body)
    assert (error["param"], error["code"]) == (param, "unsupported_parameter"), error

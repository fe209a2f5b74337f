"""Tool calls and reasoning through the server as an agent's client sees them: a real process (tools/serve.py on
127.0.0.1, a free port, started once for the module) on a checkpoint whose greedy replies are known exactly
(chain_model.py: Qwen3.5's chat format; a reasoning, then an XML call of get_weather; once the tool's result is
in the prompt, a reasoning and an answer), called with the official `openai` client and raw HTTP (httpx).

Covered: the agent loop (call, the result sent back as a `tool` message, the answer), whole and streamed
(`delta.tool_calls` with the name first and the arguments in pieces, `delta.reasoning_content`), n > 1,
enable_thinking false (the template closes the reasoning in the prompt), leading system and developer messages as the
one system message Qwen3.5's template takes, vLLM's include_reasoning false (the reply
without its reasoning), tool_choice "none" (no tools rendered,
no call parsed), a call of a function the request does not offer (content, never a 500), a reply cut inside a
call, a stream's deltas accumulated by the openai client's stream helper equal to the whole reply (content null
for calls alone, "" where nothing is shown), two calls streamed (indices, ids), text before and after a call (the
whitespace between kept), and the 400s naming their field (a tool without a name, tool_choice naming an unknown
function, OpenAI's fields this server does not honour), a strict function under "auto" (its calls held to its
schema by a structural tag), usage's reasoning tokens of a `</think>` written in pieces. Forced calls (tool_choice
"required" / named): test_serve_structured.py.
The Responses API (POST /v1/responses) with the openai client over the same server: output items (reasoning, message,
function_call), instructions and a multi-turn input (the instructions and Codex's leading developer messages one system
message), the function-call round trip with function_call_output,
max_output_tokens cutting a reply (status incomplete), vLLM's chat_template_kwargs (enable_thinking false: no reasoning
item, whole and streamed), the stream's typed events in order and the client helper's final response, a stream's final
response equal to the whole one (text, calls, text around a call, cut in the reasoning or a call, forced calls, the
messages' output text logprobs) and its events in OpenAI's order,
reasoning.summary (the reasoning item's summary its text; streamed, OpenAI's summary events as the openai client types
them), and the 400s naming their field (background, item_reference, image parts, ...); the response store
(--responses-store-size 4): a conversation continued by previous_response_id (the second prompt holds the first
turn: the model answers the call's result, and its input tokens are those of the conversation sent whole, without
the first turn's instructions; its items sent again by id OpenAI's 400 "Duplicate item found"), retrieve / delete /
input_items (pages, order) through the client, a streamed response stored, store false, unknown ids as NotFoundError,
least recently used responses evicted at the bound;
truncation "auto" (a conversation past the context answered on its most recent items that fit: the input tokens those
of the conversation sent from the first place that fits, a call dropped with its output) and its 400s. Custom (freeform)
tools, Codex's apply_patch: their input held to a Lark grammar or a regular expression (named, "required", "auto",
allowed_tools; greedy and sampled), chat's custom calls and deltas, the Responses API's custom_tool_call items and their
typed stream events, past custom calls and outputs sent back, and their 400s. POST /v1/responses/input_tokens: the
input tokens a response to the same request has."""

import enum
import json
import re

import httpx
import openai
import pydantic
import pytest

from chain_model import (AFTER_TOOL_REASONING, ANSWER, CALL, CLOSE_THINK, EOS, REASONING, WEATHER_TOOL)
from server_process import chain_server, openai_client

NAME = "tiny-tools"
TIMEOUT = 120
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
ARGUMENTS = {"city": "Paris", "days": 3}
OTHER_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
STORE_SIZE = 4  # the server's stored responses (a small bound, so that a test reaches it)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with chain_server(tmp_path_factory, NAME, TIMEOUT, "--responses-store-size", str(STORE_SIZE)) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, TIMEOUT)


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


def test_include_reasoning_false_leaves_the_reasoning_out(client):
    """vLLM's include_reasoning false: the reply without its reasoning (under either name), whole and streamed, its
    calls and answer as they are; the reasoning's tokens still count and their logprobs go with the next delta."""
    off = {"include_reasoning": False}
    whole = ask(client, USER, extra_body=off, logprobs=True)
    (choice,) = whole.choices
    assert choice.message.reasoning_content is None and choice.message.reasoning is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert choice.finish_reason == "tool_calls"
    assert whole.usage.completion_tokens == len(choice.logprobs.content) == ask(client, USER).usage.completion_tokens
    (got,) = _streamed(client, USER, extra_body=off)
    assert got["reasoning"] == "" and got["finish"] == "tool_calls" and len(got["calls"]) == 4
    chunks = [c.choices[0] for c in ask(client, USER, stream=True, extra_body=off, logprobs=True) if c.choices]
    assert not any(getattr(c.delta, "reasoning", None) for c in chunks)
    assert sum(len(c.logprobs.content) for c in chunks if c.logprobs) == whole.usage.completion_tokens
    answer = [*USER, {"role": "assistant", "content": None, "tool_calls": [choice.message.tool_calls[0].model_dump()]},
              {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "sunny"}]
    message = ask(client, answer, extra_body=off).choices[0].message
    assert (message.reasoning_content, message.content) == (None, ANSWER)


def test_chat_usage_counts_the_reasoning_tokens(client):
    """usage.completion_tokens_details.reasoning_tokens (OpenAI's, and vLLM's with a reasoning parser; gateways such as
    LiteLLM read it): every choice's tokens inside its reasoning block, whole and in a stream's usage chunk, shown or
    not (include_reasoning false); none without thinking. REASONING is one token of this tokenizer."""
    def reasoning_tokens(usage):
        return usage.completion_tokens_details.reasoning_tokens

    assert reasoning_tokens(ask(client, USER, n=2).usage) == 2
    (last,) = [c for c in ask(client, USER, n=2, stream=True, stream_options={"include_usage": True}) if c.usage]
    assert last.choices == [] and reasoning_tokens(last.usage) == 2
    assert reasoning_tokens(ask(client, USER, extra_body={"include_reasoning": False}).usage) == 1
    assert reasoning_tokens(ask(client, USER, max_tokens=1).usage) == 1  # (cut inside the reasoning)
    assert reasoning_tokens(ask(client, USER, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).usage) == 0


def test_reasoning_tokens_of_a_think_end_written_in_pieces(server, client):
    """A reply whose `</think>` is not the tokenizer's one token but its text in pieces (here a grammar over ordinary
    tokens writes it; the parsers read the block's end all the same) counts the tokens through the one completing
    `</think>` as reasoning, not the answer's after it: it counted the whole reply (no `</think>` token: as though cut
    inside the reasoning). Whole and streamed."""
    text = "<think>\nabc\n</think>\n\nhello"
    body = dict(max_tokens=60, extra_body={"structured_outputs": {"regex": re.escape(text)}, "return_token_ids": True,
                                           "chat_template_kwargs": {"enable_thinking": False}})
    whole = ask(client, USER, tools=(), **body)
    choice = whole.choices[0]
    assert (choice.message.reasoning_content, choice.message.content) == ("abc", "hello"), choice

    def completed_by(tag: str) -> int:  # the fewest leading tokens whose text holds `tag`
        return next(k for k in range(1, len(ids) + 1) if tag in httpx.post(
            server.url + "/detokenize", json={"tokens": ids[:k]}, timeout=TIMEOUT).json()["prompt"])

    ids = choice.token_ids
    want = completed_by("</think>") - completed_by("<think>")
    assert 0 < want < whole.usage.completion_tokens == len(ids)
    assert whole.usage.completion_tokens_details.reasoning_tokens == want
    (last,) = [c for c in ask(client, USER, tools=(), stream=True, stream_options={"include_usage": True}, **body)
               if c.usage]
    assert last.usage.completion_tokens_details.reasoning_tokens == want


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


def _prompt_ids(client, messages, **kw) -> list[int]:
    r = ask(client, messages, max_tokens=1, extra_body={"return_token_ids": True}, **kw)
    return r.prompt_token_ids


def test_leading_system_and_developer_messages_are_one_system_message(server, client):
    """A system prompt then a developer message (or several system messages) at the start: Qwen3.5's chat template takes
    one system message, the first, and raises on another ("System message must be at the beginning": every such request
    a 400); this checkpoint's template, which reads messages[0] alone as Qwen3.5's does, dropped the others silently.
    They reach the template as one system message, their texts joined by a blank line, with and without tools; a
    system message after the conversation began is left as it is (the template's to take or refuse)."""
    lead = [{"role": "system", "content": "Answer briefly."}, {"role": "developer", "content": "Be kind."},
            {"role": "system", "content": [{"type": "text", "text": "Use the tools."}]}]
    joined = [{"role": "system", "content": "Answer briefly.\n\nBe kind.\n\nUse the tools."}]
    for tools in ((WEATHER_TOOL,), ()):
        assert _prompt_ids(client, [*lead, *USER], tools=tools) == _prompt_ids(client, [*joined, *USER], tools=tools)
    assert _prompt_ids(client, [*lead[:1], *USER]) != _prompt_ids(client, [*joined, *USER])
    r = httpx.post(server.url + "/tokenize", json={"model": NAME, "messages": [*lead, *USER]}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["tokens"] == _prompt_ids(client, [*joined, *USER], tools=()), r.text
    turn = [*USER, {"role": "assistant", "content": "Hi."}]
    assert _prompt_ids(client, [lead[0], *turn, lead[1], *USER]) != _prompt_ids(client, [*joined, *turn, *USER])

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


def _accumulated(client, **kw):
    """The stream's chunks and the openai client's stream helper's choice at the end: the deltas accumulated as clients
    accumulate them (a delta's text appended to the message's, a null left as it was; its snapshot, which a reply cut
    by max_tokens has too)."""
    kw = {"messages": USER, "tools": [WEATHER_TOOL], **kw}
    with client.chat.completions.stream(model=NAME, temperature=0, **kw) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        return chunks, stream.current_completion_snapshot.choices[0]


def _message(choice) -> tuple:
    calls = [(c.type, c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    return choice.message.content, getattr(choice.message, "reasoning_content", None), calls, choice.finish_reason


def _forced_text(text: str, **kw) -> dict:
    """The request's fields that make the reply, after this model's reasoning, `text` (a regular expression of it)."""
    return dict(max_tokens=300, extra_body={"structured_outputs": {"regex": re.escape(text)}, **kw})


TWO_CALLS = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
             "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n"
             "</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("case, kw, content", [
    ("a call", {}, None),
    ("a call without reasoning", {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}, None),
    ("two calls", _forced_text(TWO_CALLS), None),
    ("text", {"tool_choice": "none"}, "".join(CALL)),
    ("reasoning cut short", {"max_tokens": 1}, None),
    ("nothing shown", {"max_tokens": 1, "extra_body": {"include_reasoning": False}}, ""),
])
def test_a_stream_accumulates_to_the_whole_reply(client, case, kw, content):
    """A stream's deltas accumulated (the openai client's stream helper) give the whole reply's message: content null
    where the reply is only calls or reasoning, as OpenAI's whole and streamed replies have it, and "" where nothing
    is shown. The first delta's content was "" (vLLM's), so a reply of calls or reasoning accumulated to "" where the
    whole one has null; now it is null, as OpenAI's first delta of a reply of calls, and a reply that shows nothing
    gets its "" in the last delta."""
    whole = ask(client, USER, **kw).choices[0]
    chunks, final = _accumulated(client, **kw)
    assert _message(final) == _message(whole), case
    assert whole.message.content == content, case
    first = chunks[0].choices[0].delta.to_dict()
    assert first == {"role": "assistant", "content": None}, first
    assert sum(1 for c in chunks for choice in c.choices if choice.finish_reason) == 1


def test_text_before_and_after_a_call_keeps_the_whitespace_between(client):
    """Text the model writes before and after a call is the content, joined by the whitespace it wrote around the
    call (the longest run of it), whole and streamed alike (it was joined without any: "Let me check.Done.")."""
    call = TWO_CALLS.split("\n<tool_call>")[0]
    kw = _forced_text("Let me check.\n" + call + "\n\nDone.\n")
    whole = ask(client, USER, **kw).choices[0]
    assert whole.message.content == "Let me check.\n\nDone." and whole.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    (streamed,) = _streamed(client, USER, **kw)
    assert streamed["content"] == whole.message.content and streamed["finish"] == "tool_calls"
    _, final = _accumulated(client, **kw)
    assert _message(final) == _message(whole)


def test_parallel_calls_streamed_with_their_indices_and_ids(client):
    """Two calls in one reply, streamed: each call's first delta holds its index (0, 1), a unique id, its type and
    name; its arguments follow under that index alone (no id, name or type again, so that a client appending the
    deltas keeps one id and one name per call), the finish reason "tool_calls", each call's arguments joined its
    whole reply's."""
    kw = _forced_text(TWO_CALLS)
    whole = ask(client, USER, **kw).choices[0]
    (got,) = _streamed(client, USER, **kw)
    firsts = [d for d in got["calls"] if "id" in d]
    assert [(d["index"], d["type"], d["function"]) for d in firsts] == \
        [(i, "function", {"name": "get_weather", "arguments": ""}) for i in (0, 1)]
    assert len({d["id"] for d in firsts}) == 2 and all(d["id"].startswith("call_") for d in firsts)
    rest = [d for d in got["calls"] if "id" not in d]
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in rest), rest
    arguments = ["".join(d["function"]["arguments"] for d in got["calls"] if d["index"] == i) for i in (0, 1)]
    assert arguments == [c.function.arguments for c in whole.message.tool_calls]
    assert [json.loads(a) for a in arguments] == [{"city": "Paris"}, {"city": "Rome", "days": 2}]
    assert got["finish"] == whole.finish_reason == "tool_calls" and got["content"] == ""


STRICT_WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"anyOf": [{"type": "string", "enum": ["Rome", "Oslo"]}, {"type": "null"}]},
                                     "days": {"type": "integer", "minimum": 5, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}


def test_a_strict_function_under_auto_holds_the_calls_to_its_schema(client):
    """This model calls get_weather(city Paris, days 3) on its own; a strict function of that name whose schema allows
    neither gets a call that follows it (a structural tag holds the reply: free text and reasoning, calls in the
    model's XML format), whole, streamed and sampled alike (a null written for the optional city is null, not the
    word); with strict false the model's own call comes back."""
    pytest.importorskip("xgrammar")

    def follows(name, arguments):
        arguments = json.loads(arguments)
        return name == "get_weather" and arguments["city"] in ("Rome", "Oslo", None) and 5 <= arguments["days"] <= 7

    choice = ask(client, USER, tools=(STRICT_WEATHER,), max_tokens=80).choices[0]
    assert choice.message.reasoning_content == REASONING and choice.message.tool_calls
    assert all(follows(c.function.name, c.function.arguments) for c in choice.message.tool_calls)
    (got,) = _streamed(client, USER, tools=(STRICT_WEATHER,), max_tokens=80)
    names = [c["function"]["name"] for c in got["calls"] if "name" in c["function"]]
    assert follows(names[0], "".join(c["function"]["arguments"] for c in got["calls"] if c["index"] == 0))
    sampled = client.chat.completions.create(model=NAME, messages=USER, tools=[STRICT_WEATHER], max_tokens=200, n=3,
                                             seed=4, temperature=1.0)
    for choice in sampled.choices:  # (the whitespace around a value that is not free text is not part of it)
        assert choice.finish_reason in ("tool_calls", "stop"), choice
        assert all(follows(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ())
    loose = {"type": "function", "function": {**STRICT_WEATHER["function"], "strict": False}}
    (call,) = ask(client, USER, tools=(loose,)).choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == ARGUMENTS


class Answer(pydantic.BaseModel):
    """An agent's output_type, as pydantic writes it: a nested model and an enum under "$defs", an optional string of
    bounded length."""
    class Place(pydantic.BaseModel):
        name: City
        country: str | None = pydantic.Field(default=None, max_length=4)

    place: Place
    days: int = pydantic.Field(ge=1, le=7)
    sunny: bool


ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "final_output", "strict": True,
                                                        "schema": Answer.model_json_schema()}}


def _follows(call) -> bool:
    arguments = json.loads(call.function.arguments)
    return call.function.name == "get_weather" and arguments["city"] in ("Rome", "Oslo", None) and \
        5 <= arguments["days"] <= 7


def test_a_response_format_beside_tools_leaves_the_calls_free(server, client):
    """The OpenAI Agents SDK sends an agent's output_type as response_format on every turn, tools beside it (pydantic-ai's
    NativeOutput and LangChain's provider strategy alike): the reply is that JSON or calls, as OpenAI holds a reply
    with tools to its format only where it makes no call (once the JSON alone: an agent with an output_type never
    called its tools). This model calls get_weather on its own, whole, streamed and through the Responses API's
    text.format; pushed to '{' (logit_bias, thinking off) it answers JSON that validates, control characters kept out
    of its bounded string; sampled, each reply is one or the other."""
    pytest.importorskip("xgrammar")
    kw = dict(tools=(STRICT_WEATHER,), response_format=ANSWER_FORMAT, max_tokens=120)
    for fmt in (ANSWER_FORMAT, {"type": "json_object"}):
        choice = ask(client, USER, **{**kw, "response_format": fmt}).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        assert choice.message.reasoning_content == REASONING and all(map(_follows, choice.message.tool_calls))
    (got,) = _streamed(client, USER, **kw)
    assert got["content"] == "" and got["finish"] == "tool_calls" and got["calls"][0]["function"]["name"] == "get_weather"
    response = respond(client, tools=({"type": "function", **STRICT_WEATHER["function"]},), max_output_tokens=120,
                       text={"format": {"type": "json_schema", "name": "final_output", "strict": True,
                                        "schema": Answer.model_json_schema()}})
    assert _kinds(response) == ["reasoning", "function_call"], response.output
    (brace, tab), off = [httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
                         ["tokens"][0] for text in "{\t"], {"chat_template_kwargs": {"enable_thinking": False}}
    choice = ask(client, USER, **kw, extra_body=off, logit_bias={str(brace): 90, str(tab): 100}).choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None, choice
    answer = Answer.model_validate_json(choice.message.content)  # (a raw tab in the country: not JSON)
    assert answer.place.name == City.PARIS and answer.place.country == "{{{{"  # ("Paris" < "Rome")
    sampled = client.chat.completions.create(model=NAME, messages=USER, tools=[STRICT_WEATHER], n=3, seed=4,
                                             temperature=1.0, response_format=ANSWER_FORMAT, max_tokens=200)
    for choice in sampled.choices:
        assert choice.finish_reason in ("tool_calls", "stop"), choice
        if choice.message.tool_calls:
            assert choice.message.content is None and all(map(_follows, choice.message.tool_calls)), choice
        else:
            assert Answer.model_validate_json(choice.message.content), choice


STRICT_TIME = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}


def _allowed(mode: str, *names: str) -> dict:
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [
        {"type": "function", "function": {"name": name}} for name in names]}}


def test_allowed_tools_hold_the_calls_to_their_functions(server, client):
    """OpenAI's tool_choice allowed_tools (pydantic-ai sends it for a ToolOrOutput or a list of tool names; once a 400):
    every tool is rendered (the prompt as under auto), the calls held to the functions it names: under "auto" this
    model's own get_weather call where get_weather is allowed (whole and streamed), none of it where only get_time is;
    under "required" a call of get_time; the Responses API's flat shape alike, echoed in the response; a function the
    request does not offer is a 400 naming tool_choice."""
    pytest.importorskip("xgrammar")
    tools = (STRICT_WEATHER, STRICT_TIME)
    auto = ask(client, USER, tools=tools, tool_choice=_allowed("auto", "get_weather"), max_tokens=120)
    assert auto.usage.prompt_tokens == ask(client, USER, tools=tools, max_tokens=1).usage.prompt_tokens
    choice = auto.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls and \
        all(map(_follows, choice.message.tool_calls)), choice
    (got,) = _streamed(client, USER, tools=tools, tool_choice=_allowed("auto", "get_weather"), max_tokens=120)
    assert [c["function"]["name"] for c in got["calls"] if "name" in c["function"]] == ["get_weather"], got
    choice = ask(client, USER, tools=tools, tool_choice=_allowed("auto", "get_time"), max_tokens=120).choices[0]
    assert all(c.function.name == "get_time" for c in choice.message.tool_calls or ()), choice
    choice = ask(client, USER, tools=tools, tool_choice=_allowed("required", "get_time"), parallel_tool_calls=False,
                 max_tokens=120).choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.function.name == "get_time", choice
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    flat = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "get_weather"}]}
    response = respond(client, tools=[{"type": "function", **t["function"]} for t in tools], tool_choice=flat,
                       max_output_tokens=120)
    assert _kinds(response) == ["reasoning", "function_call"] and response.output[1].name == "get_weather"
    assert response.tool_choice.type == "allowed_tools" and response.tool_choice.tools == flat["tools"]
    error = _error(server, {"tools": list(tools), "tool_choice": _allowed("auto", "get_news")})
    assert error["param"] == "tool_choice" and "'get_news'" in error["message"], error


def _error(server, body) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps({"messages": USER, "max_tokens": 1, **body}),
                   headers={"Content-Type": "application/json"}, timeout=TIMEOUT)  # (ASCII JSON: \u escapes)
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize("body, param, says", [
    # the field as the body has it (it was "tools.0.function.function.name": pydantic's tag of the union, then the key)
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools",
     "tools.0.function.name: Field required"),
    ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools",
     "tools.0.function.name: String should match pattern"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools", "'function', 'custom'"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools", "more than once"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "half \ud83d"}}]}, "tools",
     "invalid Unicode"),  # (a lone surrogate: the template would render what UTF-8 cannot encode)
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice", "'get_time'"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    # the Responses API's flat shape sent here, or a choice without its function: the shape chat takes (it was "Input
    # should be 'none', 'auto' or 'required'", as though a named function were not taken)
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice",
     '{"type": "function", "function": {"name": ...}} (function: Field required) (got {\'type\': \'function\','),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice",
     'an allowed_tools choice is {"type": "allowed_tools", "allowed_tools": {"mode"'),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool"}}, "tool_choice",
     """expected 'none', 'auto', 'required', {"type": "function", "function": {"name": ...}} or {"type": """),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    # parameters of another type than an object: calls whose "arguments" were a JSON string (it was a 200)
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools", "the JSON schema of an object, its arguments by name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}]}, "tools", "'uniqueItems'"),
])
def test_bad_tools_are_400_naming_the_field(server, body, param, says):
    error = _error(server, body)
    assert error["param"] == param and says in error["message"], error
    assert "Value error" not in error["message"], error  # (pydantic's prefix before a check's own words: dropped)


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER_TOOL], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"functions": [WEATHER_TOOL["function"]]}, "functions"),
])
def test_what_the_server_does_not_honour_is_refused_by_name(server, body, param):
    error = _error(server, body)
    assert (error["param"], error["code"]) == (param, "unsupported_parameter"), error


# the Responses API (POST /v1/responses) over the same chat machinery ---------------------------------------------
RESPONSE_TOOL = {"type": "function", **WEATHER_TOOL["function"]}  # (the Responses API's flat shape)


def respond(client, input=USER, tools=(RESPONSE_TOOL,), **kw):
    return client.responses.create(model=NAME, input=input, tools=list(tools), temperature=0, **kw)


def _kinds(response) -> list[str]:
    return [item.type for item in response.output]


def test_responses_text_reasoning_and_usage(client):
    """Without tools the reply is a reasoning item (the thinking text, as reasoning_text content) and a message
    whose output_text is the rest (the call's text, unparsed: no tools offered); usage counts the reasoning."""
    r = respond(client, input="What is the weather in Paris?", tools=())
    assert (r.object, r.status, r.model, r.incomplete_details) == ("response", "completed", NAME, None)
    assert r.id.startswith("resp_") and _kinds(r) == ["reasoning", "message"]
    reasoning, message = r.output
    assert reasoning.id.startswith("rs_") and [c.text for c in reasoning.content] == [REASONING]
    assert message.id.startswith("msg_") and message.role == "assistant" and message.status == "completed"
    assert r.output_text == "".join(CALL) == message.content[0].text
    chat = ask(client, USER, tools=()).usage  # the same prompt through /v1/chat/completions
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.prompt_tokens, chat.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 1  # (REASONING is one token of this tokenizer)


def test_responses_instructions_and_a_multi_turn_input(client):
    """instructions become a system message; input items of each role (content as a string or as input_text /
    output_text parts) become the chat's messages, the template rendering them (more prompt tokens)."""
    plain = respond(client, tools=())
    told = respond(client, tools=(), instructions="Answer briefly.")
    turns = [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hi.", "annotations": []}]},
             {"type": "message", "role": "developer", "content": "Be kind."}, *USER]
    multi = respond(client, input=turns, tools=())
    assert told.instructions == "Answer briefly." and told.usage.input_tokens > plain.usage.input_tokens
    assert multi.usage.input_tokens > plain.usage.input_tokens
    assert told.output_text == multi.output_text == plain.output_text == "".join(CALL)


def test_responses_instructions_and_leading_developer_messages_are_one_system_message(client):
    """Codex's request: its instructions, then its developer messages (permissions, its config's instructions) first in
    `input`, with store false: the instructions and the system / developer messages that begin the input are one
    system message to the template, joined by blank lines (Qwen3.5's template raised on the second: a 400 for every
    Codex turn; this checkpoint's dropped it)."""
    lead = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be kind."}]},
            {"role": "system", "content": "Use the tools."}]
    got = respond(client, input=[*lead, *USER], instructions="Answer briefly.", store=False)
    joined = respond(client, input=USER, instructions="Answer briefly.\n\nBe kind.\n\nUse the tools.", store=False)
    assert got.usage.input_tokens == joined.usage.input_tokens
    assert _kinds(got) == _kinds(joined) == ["reasoning", "function_call"]
    alone = respond(client, input=[*lead, *USER], store=False)
    assert alone.usage.input_tokens == respond(client, input=[{"role": "system", "content": "Be kind.\n\nUse the tools."},
                                                              *USER], store=False).usage.input_tokens

def test_responses_function_call_round_trip(client):
    """A function tool in the flat shape: the reply is reasoning then a function_call item (call_id, name, JSON
    arguments typed by the schema); sent back as input with a function_call_output, the model answers."""
    first = respond(client)
    assert _kinds(first) == ["reasoning", "function_call"] and first.output_text == ""
    call = first.output[1]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    assert (call.name, json.loads(call.arguments)) == ("get_weather", ARGUMENTS)
    assert first.tools[0].name == "get_weather" and first.tool_choice == "auto"
    turn = [*USER, *[item.model_dump(exclude_none=True) for item in first.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps(weather(**ARGUMENTS))}]
    second = respond(client, input=turn)
    assert _kinds(second) == ["reasoning", "message"]
    assert (second.output[0].content[0].text, second.output_text) == (AFTER_TOOL_REASONING, ANSWER)


def test_responses_tool_choice_none_and_parallel_calls_false(client):
    none = respond(client, tool_choice="none")
    assert _kinds(none) == ["reasoning", "message"] and none.output_text == "".join(CALL)
    one = respond(client, parallel_tool_calls=False)
    assert _kinds(one) == ["reasoning", "function_call"] and one.parallel_tool_calls is False


def test_responses_cut_by_max_output_tokens_is_incomplete(client):
    r = respond(client, tools=(), max_output_tokens=1)
    assert (r.status, r.incomplete_details.reason, r.max_output_tokens) == ("incomplete", "max_output_tokens", 1)
    assert _kinds(r) == ["reasoning"] and r.output[0].status == "incomplete" and r.usage.output_tokens == 1


def test_responses_chat_template_kwargs_reach_the_template(client):
    """vLLM's chat_template_kwargs (its Responses API takes them as its chat endpoint does): enable_thinking false closes
    the reasoning in the prompt, so the reply is the call alone, no reasoning item, whole and streamed, and its input
    tokens are the chat's with the same kwargs, counted alike (it was ignored: a reasoning item, the plain prompt)."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    r = respond(client, extra_body=off)
    assert _kinds(r) == ["function_call"] and json.loads(r.output[0].arguments) == ARGUMENTS
    assert r.usage.output_tokens_details.reasoning_tokens == 0 and r.status == "completed"
    chat = ask(client, USER, extra_body=off).usage
    assert r.usage.input_tokens == chat.prompt_tokens > respond(client).usage.input_tokens
    count = client.responses.input_tokens.count(model=NAME, input=USER, tools=[RESPONSE_TOOL], extra_body=off)
    assert count.input_tokens == chat.prompt_tokens
    events, final = _events(client, tools=[RESPONSE_TOOL], extra_body=off)
    assert "response.reasoning_text.delta" not in [e.type for e in events]
    assert _kinds(final) == ["function_call"] and final.usage.model_dump() == r.usage.model_dump()


def _events(client, **kw) -> list:
    with client.responses.stream(model=NAME, input=USER, temperature=0, **kw) as stream:
        events = list(stream)
        return events, stream.get_final_response()


def test_responses_streamed_events_and_the_final_response(client):
    """The stream's events, in OpenAI's order and numbered from 0, as the openai client's stream helper reads them;
    its final response (from response.completed) equals the whole one, deltas joined equal the done texts."""
    events, final = _events(client, tools=[RESPONSE_TOOL])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    arguments = types.count("response.function_call_arguments.delta")
    assert types == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                     "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", *["response.function_call_arguments.delta"] * arguments,
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done = {e.type: e for e in events}
    assert done["response.reasoning_text.done"].text == REASONING
    assert done["response.function_call_arguments.done"].name == "get_weather"
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == \
        done["response.function_call_arguments.done"].arguments
    whole = respond(client)
    assert _kinds(final) == _kinds(whole) and final.status == "completed" and final.id == events[0].response.id
    assert json.loads(final.output[1].arguments) == json.loads(whole.output[1].arguments) == ARGUMENTS
    assert final.usage.model_dump() == whole.usage.model_dump()


def test_responses_streamed_text_with_stream_true(client):
    """stream=True through responses.create: the message's output_text deltas joined are its output_text.done;
    stream_options asking for no obfuscation (what every stream here is: no padding in its deltas) is taken."""
    events = list(respond(client, tools=(), stream=True, stream_options={"include_obfuscation": False}))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert deltas == done.text == "".join(CALL)
    assert [e.type for e in events if "content_part" in e.type] == ["response.content_part.added",
                                                                     "response.content_part.done"] * 2
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "".join(CALL)


def _spec_problems(events) -> list[str]:
    """Where a stream's events break OpenAI's order: sequence numbers 0, 1, ...; output_index counting the items in
    order; an item's events between its output_item.added and .done, a part's deltas between its content_part.added
    and .done; every delta's .done (before the part's and the item's .done) holding the deltas joined; the items
    of the output_item.done events those of response.completed."""
    problems, items, parts, texts, done = [], {}, {}, {}, {}
    if [e.sequence_number for e in events] != list(range(len(events))):
        problems.append("sequence numbers")
    for e in events:
        at = getattr(e, "output_index", None)
        if e.type == "response.output_item.added":
            problems += [] if at == len(items) else [f"{e.type} at {at}"]
            items[at] = e.item.id
        elif at is not None and (items.get(at) is None or at in done):
            problems.append(f"{e.type} outside its item {at}")
        elif e.type == "response.output_item.done":
            done[at] = e.item
            problems += [f"{e.type} before its parts' or texts' .done"] * any(
                k[0] == at for k in [*texts, *(k for k, v in parts.items() if v)])
        elif e.type == "response.content_part.added":
            parts[(at, e.content_index)] = True
        elif e.type == "response.content_part.done":
            problems += [f"{e.type} before its text's .done"] * ((at, "content", e.content_index) in texts)
            parts[(at, e.content_index)] = False
        elif e.type.endswith(".delta") or e.type.endswith(".done"):
            kind, end = e.type.rsplit(".", 1)
            part = getattr(e, "content_index", getattr(e, "summary_index", None))
            problems += [f"{e.type} of item {e.item_id}"] * (e.item_id != items[at])
            problems += [f"{e.type} outside its part"] * (hasattr(e, "content_index") and not parts.get((at, part)))
            key = (at, kind, part)
            if end == "delta":
                texts[key] = texts.get(key, "") + e.delta
            else:
                whole = next(getattr(e, f) for f in ("text", "arguments", "input") if hasattr(e, f))
                problems += [f"{e.type} {whole!r}: its deltas {texts.get(key, '')!r}"] * (texts.pop(key, "") != whole)
    if sorted(done) != sorted(items) or texts or any(parts.values()):
        problems.append("items, parts or texts left open")
    completed = events[-1].response.output if events[-1].type == "response.completed" else None
    if completed is None or _items(completed, ()) != _items([done[i] for i in sorted(done)], ()):
        problems.append("response.completed's output is not its items' output_item.done")
    return problems


def _items(output, ids=("id", "call_id")) -> list[dict]:
    """Output items without their `ids` (and the stream helper's parsed fields)."""
    items = [o.model_dump(exclude={*ids, "parsed_arguments"}) for o in output]
    for part in (p for item in items for p in item.get("content") or ()):
        part.pop("parsed", None)
    return items


def _forced_response(text: str) -> dict:
    """The request's fields that make the reply, after this model's reasoning, `text`."""
    return dict(max_output_tokens=300, extra_body={"structured_outputs": {"regex": re.escape(text)}})


ONE_CALL = TWO_CALLS.split("\n<tool_call>")[0]
LOGPROBS = dict(include=["message.output_text.logprobs"], top_logprobs=1)


@pytest.mark.parametrize("case, kw, kinds", [
    ("text", dict(tools=[]), ["reasoning", "message"]),
    ("a call", {}, ["reasoning", "function_call"]),
    ("two calls", _forced_response(TWO_CALLS), ["reasoning", "function_call", "function_call"]),
    ("text around a call", _forced_response("Let me check.\n" + ONE_CALL + "\n\nDone.\n"),
     ["reasoning", "message", "function_call", "message"]),
    ("cut in the reasoning", dict(max_output_tokens=1), ["reasoning"]),
    ("cut in a call", dict(max_output_tokens=4), ["reasoning", "function_call"]),
    ("required", dict(tool_choice="required", max_output_tokens=48), ["reasoning", "function_call"]),
    ("required, cut before its call", dict(tool_choice="required", max_output_tokens=12), ["reasoning", "message"]),
    ("named", dict(tool_choice={"type": "function", "name": "get_weather"}), ["reasoning", "function_call"]),
    ("logprobs of text", dict(tools=[], **LOGPROBS), ["reasoning", "message"]),
    ("logprobs of text then a call", dict(**_forced_response("Let me check.\n" + ONE_CALL), **LOGPROBS),
     ["reasoning", "message", "function_call"]),
    ("logprobs of text around a call", dict(**_forced_response("Let me check.\n" + ONE_CALL + "\n\nDone.\n"),
                                            **LOGPROBS), ["reasoning", "message", "function_call", "message"]),
])
def test_responses_stream_builds_the_whole_response(client, case, kw, kinds):
    """A stream's final response (its response.completed, and the openai client's stream helper's) equals the whole
    response to the same request: output items (ids aside; their logprobs too), status, incomplete_details, usage; its
    events in OpenAI's order (_spec_problems). A message's output text logprobs are those of the tokens up to its last
    text since the previous message (the reasoning's before the first, a call's before the next; the tokens after the
    last message's text, its calls', in none), whole and streamed alike: the whole response read the reply at once and
    gave the first message every token's, which no stream can send."""
    kw = {"tools": [RESPONSE_TOOL], **kw}
    whole = respond(client, **kw)
    events, final = _events(client, **kw)
    completed = events[-1].response
    assert _kinds(whole) == kinds, case
    assert _items(final.output) == _items(completed.output) == _items(whole.output), case
    for got in (final, completed):
        assert (got.status, got.incomplete_details, got.usage) == (whole.status, whole.incomplete_details, whole.usage)
    assert _spec_problems(events) == [], case
    texts = [[lp.token for lp in e.logprobs] for e in events if e.type == "response.output_text.done"]
    assert texts == [[lp.token for lp in item.content[0].logprobs] for item in whole.output if item.type == "message"]
    before = REASONING + CLOSE_THINK
    assert ["".join(tokens) for tokens in texts] == {  # (each message's tokens, joined)
        "logprobs of text": [before + "".join(CALL) + EOS], "logprobs of text then a call": [before + "Let me check."],
        "logprobs of text around a call": [before + "Let me check.", "\n" + ONE_CALL + "\n\nDone.\n" + EOS],
    }.get(case, [""] * len(texts)), case  # (none asked for: none)


def test_responses_reasoning_summary_is_the_reasoning(client):
    """reasoning.summary (any level, or its older name generate_summary) gives the reasoning item a summary of one
    summary_text part, the reasoning's text (no summarizer); without it the summary stays empty."""
    plain = respond(client, tools=())
    assert plain.output[0].summary == [] and plain.reasoning is None
    for reasoning in ({"summary": "auto"}, {"summary": "concise"}, {"summary": "detailed"},
                      {"generate_summary": "auto"}, {"effort": "low", "summary": "auto"}):
        r = respond(client, tools=(), reasoning=reasoning)
        item = r.output[0]
        assert [(p.type, p.text) for p in item.summary] == [("summary_text", REASONING)], reasoning
        assert [c.text for c in item.content] == [REASONING] and r.output_text == plain.output_text
        assert r.usage.model_dump() == plain.usage.model_dump()
        assert {k: v for k, v in r.reasoning.model_dump().items() if v is not None} == reasoning


SUMMARY_EVENTS = {  # the openai client's type of each summary event
    "response.reasoning_summary_part.added": "ResponseReasoningSummaryPartAddedEvent",
    "response.reasoning_summary_text.delta": "ResponseReasoningSummaryTextDeltaEvent",
    "response.reasoning_summary_text.done": "ResponseReasoningSummaryTextDoneEvent",
    "response.reasoning_summary_part.done": "ResponseReasoningSummaryPartDoneEvent"}


def test_responses_reasoning_summary_streamed(client):
    """Streamed, a summary asked for adds the summary's events in OpenAI's order (part added, text deltas, text
    done, part done), each before its reasoning_text counterpart, parsed by the openai client into its types, with the
    reasoning item's id and output_index, summary_index 0, numbered in sequence; the final response equals the whole."""
    from openai.types import responses as types

    events, final = _events(client, tools=[RESPONSE_TOOL], reasoning={"summary": "auto"})
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events][:12] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.reasoning_summary_part.added", "response.content_part.added",
        "response.reasoning_summary_text.delta", "response.reasoning_text.delta",
        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
    item = final.output[0]
    summary = [e for e in events if e.type in SUMMARY_EVENTS]
    assert [type(e).__name__ for e in summary] == [SUMMARY_EVENTS[e.type] for e in summary]
    assert all((e.item_id, e.output_index, e.summary_index) == (item.id, 0, 0) for e in summary)
    added, *deltas, text_done, part_done = summary
    assert (added.part.type, added.part.text) == ("summary_text", "")
    assert "".join(d.delta for d in deltas) == text_done.text == part_done.part.text == REASONING
    assert part_done.status is None and events[2].item.summary == []
    assert events[11].item.summary[0].text == REASONING and [p.text for p in item.summary] == [REASONING]
    whole = respond(client, reasoning={"summary": "auto"})
    assert [o.model_dump(exclude={"id", "call_id", "parsed_arguments"}) for o in final.output] == \
        [o.model_dump(exclude={"id", "call_id"}) for o in whole.output]
    cut = list(respond(client, tools=(), stream=True, max_output_tokens=1, reasoning={"summary": "concise"}))
    (done,) = [e for e in cut if isinstance(e, types.ResponseReasoningSummaryPartDoneEvent)]
    assert (done.status, done.part.text) == ("incomplete", REASONING)
    assert cut[-1].response.status == "incomplete" and cut[-1].response.output[0].summary[0].text == REASONING


def _responses_error(server, body) -> dict:
    r = httpx.post(server.url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 1, **body}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize("body, param, says", [
    ({"background": True}, "background", "not supported"),
    ({"include": ["file_search_call.results"]}, "include", "not supported"),
    ({"include": "message.output_text.logprobs"}, "include", "list"),
    ({"input": []}, "input", "non-empty"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_image"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "call_id"),
    # a past call's arguments not JSON, which Qwen3.5's `arguments|items` cannot render: named by its call
    ({"input": [*USER, {"type": "function_call", "call_id": "c_1", "name": "get_weather", "arguments": "{oops"},
                {"type": "function_call_output", "call_id": "c_1", "output": "sunny"}]}, "input",
     "input: the arguments of the function call 'c_1': '{oops' is not JSON text of an object"),
    ({"tools": [{"type": "web_search"}]}, "tools", "'function'"),
    # a flat tool's field by its path in the body (it was "tools.0.function.name": pydantic's tag of the union, a key
    # the flat shape has not)
    ({"tools": [{"type": "function", "name": "two words"}]}, "tools", "tools.0.name: String should match pattern"),
    ({"tools": [{"type": "function", "description": "no name"}]}, "tools", "tools.0.name: Field required"),
    ({"tools": [RESPONSE_TOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function"}]}},
     "tool_choice", "(tools.0.name: Field required)"),
    ({"tools": [{**RESPONSE_TOOL, "parameters": {"type": "array"}}]}, "tools", "not of type 'array'"),
    ({"tools": [RESPONSE_TOOL], "tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice", "'get_time'"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "schema"),
    ({"max_output_tokens": 5000}, "max_output_tokens", "too large"),
    ({"n": 2}, "n", "not supported"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "tools is set by the server"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "valid dictionary"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options", "not supported"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "'low'"),  # (named as "text", got TextConfig(...), once)
    # chat's nested shape sent here: the flat shape this API takes (it was "Input should be 'none', 'auto' or 'required'")
    ({"tools": [RESPONSE_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice",
     'a function choice is {"type": "function", "name": ...} (name: Field required)'),
    ({"tool_choice": "sometimes"}, "tool_choice", "expected 'none', 'auto', 'required', {\"type\": \"function\", \"name\""),
    # an item's bad value quoted, not the start of the whole input (which was quoted as what the field got), and the
    # forms a field of several takes named (once "output.str: Input should be a valid string")
    ({"input": [*USER, {"type": "function_call_output", "call_id": "c", "output": {"a": 1}}]}, "input",
     "item 1 (function_call_output) output: expected a string or a list of input_text parts (got {'a': 1})"),
    ({"input": [*USER, {"type": "message", "role": "user", "content": 7}]}, "input",
     "item 1 (message) content: expected a string or a list of text parts (input_text, output_text, refusal) (got 7)"),
    ({"input": [*USER, {"type": "reasoning", "summary": [], "content": [{"type": "text", "text": "Hm."}]}]}, "input",
     "item 1 (reasoning) content.0.type: Input should be 'reasoning_text' or 'summary_text' (got 'text')"),
])
def test_responses_bad_requests_are_400_naming_the_field(server, body, param, says):
    error = _responses_error(server, body)
    assert error["param"] == param and says in error["message"], error
    assert "What is the weather" not in error["message"], error  # (an item's error quotes its value, not the input)
    assert "Value error" not in error["message"], error


# the response store -----------------------------------------------------------------------------------------------
def _dumped(response) -> list[dict]:
    return [item.model_dump(exclude_none=True) for item in response.output]


def _call_output(call) -> dict:
    return {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps(weather(**ARGUMENTS))}


def test_responses_previous_response_id_continues_the_stored_conversation(client):
    """Turn 2 sends only the call's result with previous_response_id: the model answers it (the chain model answers
    only with the call in its context), and its prompt is the conversation sent whole (the same input tokens), the
    first turn's instructions not carried over (OpenAI's rule); a third turn follows the second."""
    first = respond(client, instructions="Answer briefly.")
    assert _kinds(first) == ["reasoning", "function_call"] and first.to_dict()["store"] is True
    second = respond(client, input=[_call_output(first.output[1])], previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.instructions is None
    assert (second.output[0].content[0].text, second.output_text) == (AFTER_TOOL_REASONING, ANSWER)
    whole = respond(client, input=[*USER, *_dumped(first), _call_output(first.output[1])], store=False)
    assert second.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    told = respond(client, input=[*USER, *_dumped(first), _call_output(first.output[1])], instructions="Answer briefly.",
                   store=False)
    assert told.usage.input_tokens > second.usage.input_tokens  # (the instructions are a system message)
    third = respond(client, input="Thanks!", previous_response_id=second.id)
    again = respond(client, input=[*USER, *_dumped(first), _call_output(first.output[1]), *_dumped(second),
                                   {"role": "user", "content": "Thanks!"}], store=False)
    assert third.usage.input_tokens == again.usage.input_tokens


def _duplicate(client, id_: str, **kw):
    """The 400 OpenAI answers an input item of an id the conversation already holds, whole, streamed and counted."""
    said = f"Duplicate item found with id {id_}. Remove duplicate items from your input and try again."
    for call in (lambda: respond(client, **kw), lambda: respond(client, stream=True, **kw),
                 lambda: client.responses.input_tokens.count(model=NAME, **kw)):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body == {"message": said, "type": "invalid_request_error", "param": "input", "code": None}


def test_responses_items_already_in_the_chain_are_400(client):
    """previous_response_id with the chain's items sent again in `input` (a client that resends the last output, ids and
    all) is OpenAI's 400 naming the first id already held (it ran on the conversation twice: more input tokens than
    the conversation sent once): a reasoning item, a function call, a message of the reply, an input item the chain
    holds; an id twice in the input alone too. Items without ids, or with ids of their own, are taken, and a client's
    id is held for the next turn."""
    first = respond(client)
    (sent,) = client.responses.input_items.list(first.id).data
    output = _call_output(first.output[1])
    _duplicate(client, first.output[0].id, input=[*_dumped(first), output], previous_response_id=first.id)
    _duplicate(client, first.output[1].id, input=[_dumped(first)[1], output], previous_response_id=first.id)
    _duplicate(client, sent.id, input=[sent.model_dump(exclude_none=True), output], previous_response_id=first.id)
    stripped = [{k: v for k, v in item.items() if k != "id"} for item in _dumped(first)]
    assert respond(client, input=[*stripped, output], previous_response_id=first.id).status == "completed"
    second = respond(client, input=[{**output, "id": "fco_mine"}], previous_response_id=first.id)
    assert second.output_text == ANSWER and _kinds(second) == ["reasoning", "message"]
    for item, dumped in zip(second.output, _dumped(second)):
        _duplicate(client, item.id, input=[dumped, {"role": "user", "content": "Thanks!"}],
                   previous_response_id=second.id)
    _duplicate(client, "fco_mine", input=[{**output, "id": "fco_mine"}], previous_response_id=second.id)
    twice = {"role": "user", "content": "Hi", "id": "msg_twice"}
    _duplicate(client, "msg_twice", input=[twice, {**twice, "content": "Hi again"}])


def test_responses_retrieve_delete_and_input_items(server, client):
    """The stored response through the openai client: retrieve equals the created one; input_items lists the
    conversation it ran on with ids (newest first by default, order asc, pages of `limit` followed by the
    client's auto-paging), a bad query value a 400 whose `param` is that query parameter (OpenAI's: `limit`, not
    `query`); cancel is a 400 (no background responses run here); delete, then retrieve, delete,
    previous_response_id and cancel are NotFoundError naming it."""
    first = respond(client, metadata={"run": "7"})
    second = respond(client, input=[_call_output(first.output[1])], previous_response_id=first.id)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    (item,) = client.responses.input_items.list(first.id).data
    assert (item.type, item.role, item.id[:4]) == ("message", "user", "msg_")
    assert [c.text for c in item.content] == [USER[0]["content"]]
    items = list(client.responses.input_items.list(second.id, order="asc", limit=2))  # (two pages and a half)
    assert [i.type for i in items] == ["message", "reasoning", "function_call", "function_call_output"]
    assert [i.id for i in items[1:3]] == [o.id for o in first.output] and items[3].id.startswith("fco_")
    page = client.responses.input_items.list(second.id, limit=3)
    assert [i.id for i in page.data] == [i.id for i in reversed(items)][:3] and page.has_more
    with pytest.raises(openai.BadRequestError, match="only a background response"):
        client.responses.cancel(first.id)  # (a completed response; the server runs no background ones)
    assert client.responses.delete(first.id) is None
    for call in (lambda: client.responses.retrieve(first.id), lambda: client.responses.delete(first.id),
                 lambda: respond(client, input="Hi", previous_response_id=first.id),
                 lambda: client.responses.cancel(first.id)):
        with pytest.raises(openai.NotFoundError, match=first.id):
            call()
    assert client.responses.retrieve(second.id).output_text == ANSWER  # (its conversation is its own)
    with pytest.raises(openai.BadRequestError, match="limit"):
        client.responses.input_items.list(second.id, limit=101)
    for query, param in ({"limit": "abc"}, "limit"), ({"limit": 0}, "limit"), ({"order": "newest"}, "order"), \
                        ({"after": "msg_none"}, "after"), ({"order": "asc", "limit": "1.5"}, "limit"):
        r = httpx.get(f"{server.url}/v1/responses/{second.id}/input_items", params=query, timeout=TIMEOUT)
        assert r.status_code == 400, (query, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["message"].startswith(f"{param}: "), (query, error)
    r = httpx.get(f"{server.url}/v1/responses/{second.id}", params={"stream": "maybe"}, timeout=TIMEOUT)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "stream"), r.text


def test_responses_streamed_and_not_stored(client):
    """A streamed response is stored once complete (retrieve equals the stream's final response) and can be
    followed; store false stores nothing (with include reasoning.encrypted_content, as Codex asks: taken, the
    reasoning item carries its text)."""
    events, final = _events(client, tools=[RESPONSE_TOOL])
    got = client.responses.retrieve(final.id)  # (the stream helper's final response is a ParsedResponse)
    assert [o.model_dump(exclude={"parsed_arguments"}) for o in final.output] == [o.model_dump() for o in got.output]
    assert (got.status, got.usage, got.created_at) == (final.status, final.usage, final.created_at)
    after = respond(client, input=[_call_output(final.output[1])], previous_response_id=final.id)
    assert after.output_text == ANSWER
    unstored = respond(client, tools=(), store=False, include=["reasoning.encrypted_content"])
    assert unstored.to_dict()["store"] is False and unstored.output[0].content[0].text == REASONING
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_responses_store_evicts_the_least_recently_used(client):
    """At the bound (STORE_SIZE) a new response evicts the least recently used one; a retrieve is a use."""
    ids = [respond(client, input="Hi", tools=(), max_output_tokens=1).id for _ in range(STORE_SIZE)]
    client.responses.retrieve(ids[0])  # ids[1] is now the least recently used
    newest = respond(client, input="Hi", tools=(), max_output_tokens=1).id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])
    for kept in (ids[0], *ids[2:], newest):
        assert client.responses.retrieve(kept).id == kept


def test_response_store_is_safe_across_threads():
    """The store itself: puts and gets from many threads keep its bound and its order."""
    from concurrent.futures import ThreadPoolExecutor

    from metrale_graph.server.responses_api_output import ResponseObject
    from metrale_graph.server.responses_store import ResponseStore, StoredResponse

    store = ResponseStore(8)

    def put(i):
        store.put(StoredResponse(ResponseObject(id=f"resp_{i}", created_at=0, status="completed", model=NAME), ()))
        return store.get(f"resp_{i}").response.id  # (not yet evicted: at most 8 threads put at once)

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(put, range(200))) == [f"resp_{i}" for i in range(200)]
    assert len(store) == 8
    with pytest.raises(ValueError, match=">= 0"):
        ResponseStore(-1)


# truncation "auto" ------------------------------------------------------------------------------------------------
NOTE = "the quick brown fox jumps over the lazy dog. " * 4  # (about 100 tokens a note)


def _notes(first: int, count: int) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Note {i}: {NOTE}"}
            for i in range(first, first + count)]


def _first_that_fits(client, items: list, places: list[int], **kw):
    """The response to items[k:] for the first k of `places` whose prompt fits (truncation disabled), and k."""
    for k in places:
        try:
            return respond(client, input=items[k:], store=False, **kw), k
        except openai.BadRequestError as e:
            assert e.code == "context_length_exceeded", e
    raise AssertionError("no place fits")


def test_responses_truncation_auto_drops_the_oldest_items(client):
    """A conversation (previous_response_id's, then the input) longer than the context: truncation disabled (the
    default) is a 400; "auto" answers, its prompt (input_tokens) the instructions and the conversation from the first
    place that fits (a whole message, never a call apart from its output) as sent whole; a larger max_output_tokens
    drops more, here the reasoning, the call and its output together (the reply no longer sees the tool's result)."""
    told = "Answer briefly."
    first = respond(client, input=[*_notes(0, 6), *USER], instructions=told)
    assert _kinds(first) == ["reasoning", "function_call"] and first.truncation == "disabled"
    turn = [_call_output(first.output[1]), *_notes(6, 10), {"role": "user", "content": "And in Lyon?"}]
    items = [*_notes(0, 6), *USER, *_dumped(first), *turn]
    places = [k for k, item in enumerate(items) if item.get("type") not in ("function_call", "function_call_output")]
    for disabled in ({}, {"truncation": "disabled"}):
        with pytest.raises(openai.BadRequestError, match="maximum context length") as e:
            respond(client, input=turn, previous_response_id=first.id, instructions=told, **disabled)
        assert e.value.code == "context_length_exceeded"
    auto = respond(client, input=turn, previous_response_id=first.id, instructions=told, truncation="auto")
    assert auto.truncation == "auto" and auto.status == "completed"
    assert (auto.output[0].content[0].text, auto.output_text) == (AFTER_TOOL_REASONING, ANSWER)  # (the result kept)
    whole, k = _first_that_fits(client, items, places, instructions=told)
    assert 0 < k < 6 and auto.usage.input_tokens == whole.usage.input_tokens <= 2047
    assert auto.output_text == whole.output_text
    room = 1000
    cut = respond(client, input=turn, previous_response_id=first.id, instructions=told, truncation="auto",
                  max_output_tokens=room)
    whole, k = _first_that_fits(client, items, places, instructions=told, max_output_tokens=room)
    assert k > items.index(turn[0]) and cut.usage.input_tokens == whole.usage.input_tokens <= 2048 - room
    assert _kinds(cut) == _kinds(whole) == ["reasoning", "function_call"]  # (no tool result in the prompt)
    assert client.responses.retrieve(cut.id).truncation == "auto"
    assert len(list(client.responses.input_items.list(cut.id, limit=100))) == len(items)  # (the whole conversation)


def test_responses_truncation_auto_that_cannot_fit_is_400(server):
    """Cut down to its last user message (and the instructions) the prompt still does not fit: a 400 saying so."""
    body = {"input": [*_notes(0, 2), {"role": "user", "content": NOTE * 25}], "truncation": "auto",
            "instructions": "Answer briefly.", "tools": [RESPONSE_TOOL]}
    error = _responses_error(server, {**body, "max_output_tokens": None})
    assert error["code"] == "context_length_exceeded" and error["param"] == "input", error
    assert "cut down to its last user message and the instructions" in error["message"], error
    error = _responses_error(server, {**body, "max_output_tokens": 1000})
    assert "with max_output_tokens (1000)" in error["message"], error
    error = _responses_error(server, {**body, "input": "Hi", "max_output_tokens": 2048})
    assert (error["param"], error["code"]) == ("max_output_tokens", "context_length_exceeded"), error
    assert "no room for a prompt" in error["message"], error
    assert "truncation" in _responses_error(server, {"truncation": "middle"})["message"]
    # only system / developer messages, which are always kept: the same 400 (not a 500 with no place to cut at)
    alone = {k: v for k, v in body.items() if k != "instructions"}  # (the template renders one system message)
    error = _responses_error(server, {**alone, "input": [{"role": "system", "content": NOTE * 25}]})
    assert (error["param"], error["code"]) == ("input", "context_length_exceeded"), error


def test_responses_input_tokens_count_is_a_responses_input_tokens(client, server):
    """POST /v1/responses/input_tokens (the openai client's responses.input_tokens.count: clients measure a
    conversation before they send it) was a 405 saying the path takes GET (the stored responses' route): it answers
    OpenAI's {"object": "response.input_tokens", "input_tokens": N}, N the usage.input_tokens of a response to the same
    request: a string, instructions with tools and a reasoning effort, previous_response_id's conversation, a
    conversation cut by truncation "auto"; nothing is run or stored. Its 400s and 404 are a response's."""
    first = respond(client, instructions="Answer briefly.")
    turn = [_call_output(first.output[1])]
    requests = [dict(input="Hi", tools=[]), dict(instructions="Answer briefly.", reasoning={"effort": "low"}),
                dict(input=turn, previous_response_id=first.id, tool_choice="none")]
    for kw in requests:
        kw = {"input": USER, "tools": [RESPONSE_TOOL], **kw}
        count = client.responses.input_tokens.count(model=NAME, **kw)
        assert count.object == "response.input_tokens", count
        assert count.input_tokens == respond(client, store=False, **kw).usage.input_tokens, kw
    long = [*_notes(0, 24), *USER]
    with pytest.raises(openai.BadRequestError, match="maximum context length") as e:
        client.responses.input_tokens.count(model=NAME, input=long)
    assert e.value.code == "context_length_exceeded"
    auto = client.responses.input_tokens.count(model=NAME, input=long, truncation="auto")
    assert 0 < auto.input_tokens == respond(client, input=long, tools=(), truncation="auto", store=False).usage.input_tokens \
        < 2048
    with pytest.raises(openai.NotFoundError):
        client.responses.input_tokens.count(model=NAME, input="Hi", previous_response_id="resp_gone")
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.responses.input_tokens.count(model=NAME, input="Hi", tool_choice={"type": "function", "name": "nope"})
    r = httpx.post(server.url + "/v1/responses/input_tokens/", json={"input": "Hi"}, timeout=TIMEOUT)
    assert r.json() == {"object": "response.input_tokens", "input_tokens": count_of(client, "Hi")}, r.text
    assert httpx.get(server.url + "/v1/responses/input_tokens", timeout=TIMEOUT).status_code == 404


def count_of(client, text: str) -> int:
    return respond(client, input=text, tools=(), store=False, max_output_tokens=1).usage.input_tokens


def test_truncation_cuts_keep_messages_and_calls_whole():
    """The places a conversation may begin at: never inside a message (a call joined to its reasoning), never
    between a call and its output, never past the last user message; its leading system messages always kept."""
    from metrale_graph.server.responses_api_items import check_items, _ITEM
    from metrale_graph.server.responses_truncation import cuts

    raw = [{"role": "developer", "content": "Be kind."}, {"role": "user", "content": "Hi"},
           {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]},
           {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
           {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{}"},
           {"type": "function_call_output", "call_id": "a", "output": "1"},
           {"type": "function_call_output", "call_id": "b", "output": "2"},
           {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks"},
           {"role": "assistant", "content": "You are welcome.", "status": "in_progress"}]
    items = [_ITEM.validate_python(item) for item in check_items(raw)]
    assert cuts(items) == (1, [1, 2, 7, 8])
    assert cuts(items[1:7]) == (0, [0])  # (no place past the last user message, the first item)
    assert cuts(items[2:8]) == (0, [0, 5])  # (no user message: up to the last item)
    assert cuts(items[:1]) == (1, [1])  # (its leading messages alone: the one place keeps them, and nothing follows)


# custom (freeform) tools: OpenAI's {"type": "custom"}, Codex's apply_patch ----------------------------------------
# Codex's apply_patch grammar, bounded (one hunk of one line) so that a reply the mask writes ends: this model never
# calls apply_patch, so its input is what the mask allows (greedy: the allowed token of lowest id)
PATCH_GRAMMAR = r'''start: begin_patch hunk end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: "*** Add File: " filename LF add_line
filename: /[a-z]{1,8}\.txt/
add_line: "+" /[a-z ]{0,12}/ LF -> line
%import common.LF
'''
PATCH = re.compile(r"\*\*\* Begin Patch\n\*\*\* Add File: [a-z]{1,8}\.txt\n\+[a-z ]{0,12}\n\*\*\* End Patch\n?")
APPLY_PATCH = {"type": "custom", "custom": {"name": "apply_patch", "description": "Edit files with a patch.", "format": {
    "type": "grammar", "grammar": {"syntax": "lark", "definition": PATCH_GRAMMAR}}}}
SHELL = {"type": "custom", "custom": {"name": "shell", "format": {"type": "grammar", "grammar": {
    "syntax": "regex", "definition": "(ls|pwd) -[a-z]{1,3}"}}}}
FREE_PATCH = {"type": "custom", "custom": {"name": "apply_patch", "format": {"type": "text"}}}
# the Responses API's flat shapes (Codex's)
FLAT_APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
                    "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}}
FLAT_FREE_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch."}
A_PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hello\n*** End Patch\n"


def _custom_deltas(client, **kw) -> tuple[list[dict], str | None]:
    """A streamed chat's tool-call deltas (as sent: the openai client keeps a custom call's as a dict) and its finish."""
    deltas, finish = [], None
    for chunk in ask(client, USER, stream=True, **kw):
        for c in chunk.choices:
            deltas += [d.model_dump(exclude_none=True) for d in c.delta.tool_calls or ()]
            finish = c.finish_reason or finish
    return deltas, finish


def test_a_custom_tool_forced_by_name_writes_input_of_its_grammar(client):
    """A custom tool of a Lark grammar named in tool_choice (OpenAI's {"type": "custom", "custom": {"name"}}): the reply
    is one custom call (type "custom", its input text of the grammar, held while sampled) after the free reasoning,
    finish "stop" as a function forced by name; streamed, OpenAI's shape: the call's id, type, name and input "" first,
    then its input; sampled, every input follows the grammar."""
    pytest.importorskip("xgrammar")
    kw = dict(tools=[APPLY_PATCH, WEATHER_TOOL], tool_choice={"type": "custom", "custom": {"name": "apply_patch"}},
              max_tokens=300)
    choice = ask(client, USER, **kw).choices[0]
    assert choice.finish_reason == "stop" and choice.message.reasoning_content == REASONING, choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.type, call.custom.name) == ("custom", "apply_patch") and call.id.startswith("call_")
    assert PATCH.fullmatch(call.custom.input), call.custom.input
    (first, *rest), finish = _custom_deltas(client, **kw)
    assert finish == "stop" and first["type"] == "custom" and first["id"].startswith("call_")
    assert first["custom"] == {"name": "apply_patch", "input": ""} and "function" not in first
    assert all(set(d) == {"index", "custom"} and d["index"] == 0 for d in rest)
    assert "".join(d["custom"]["input"] for d in rest) == call.custom.input
    sampled = client.chat.completions.create(model=NAME, messages=USER, n=3, seed=4, temperature=1.0, **kw)
    for choice in sampled.choices:
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "stop" and PATCH.fullmatch(call.custom.input), choice


def test_custom_tools_under_required_and_auto_are_held_to_their_grammars(client):
    """tool_choice "required" over a custom tool of a regular expression: a call whose input matches it. Under "auto"
    a custom tool named as this model's own call (get_weather) is called, its input held to its expression where the
    model would write its city and days; its format "text": the model's call, its input the arguments it wrote."""
    pytest.importorskip("xgrammar")
    choice = ask(client, USER, tools=[SHELL], tool_choice="required", parallel_tool_calls=False, max_tokens=200).choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.custom.name == "shell", choice
    assert re.fullmatch(r"(ls|pwd) -[a-z]{1,3}", call.custom.input), call.custom.input
    weather = {"type": "custom", "custom": {"name": "get_weather", "format": {"type": "grammar", "grammar": {
        "syntax": "regex", "definition": "(sunny|rainy) in [A-Z][a-z]{1,8}"}}}}
    choice = ask(client, USER, tools=[weather], max_tokens=200).choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == REASONING, choice
    assert call.custom.name == "get_weather" and re.fullmatch("(sunny|rainy) in [A-Z][a-z]{1,8}", call.custom.input)
    free = {"type": "custom", "custom": {"name": "get_weather"}}
    (call,) = ask(client, USER, tools=[free]).choices[0].message.tool_calls
    assert call.type == "custom" and json.loads(call.custom.input) == {"city": "Paris", "days": "3"}, call


def test_a_past_custom_call_reaches_the_template_as_its_function_call(client):
    """A past reply's custom call sent back ({"type": "custom", "custom": {"name", "input"}}) with its tool message:
    the prompt is that of the call of the function it stands for (arguments {"input": ...}), and the model answers the
    tool's result."""
    custom = {"id": "call_1", "type": "custom", "custom": {"name": "apply_patch", "input": A_PATCH}}
    function = {"id": "call_1", "type": "function", "function": {"name": "apply_patch",
                                                                  "arguments": json.dumps({"input": A_PATCH})}}
    turns = {name: [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "Done."}]
             for name, call in (("custom", custom), ("function", function))}
    for tools in ([APPLY_PATCH], [FREE_PATCH]):
        assert _prompt_ids(client, turns["custom"], tools=tools) == _prompt_ids(client, turns["function"], tools=tools)
    message = ask(client, turns["custom"], tools=[FREE_PATCH]).choices[0].message
    assert (message.reasoning_content, message.content, message.tool_calls) == (AFTER_TOOL_REASONING, ANSWER, None)


def _custom_call_item(response):
    (item,) = [o for o in response.output if o.type == "custom_tool_call"]
    return item


def test_responses_custom_tool_call_whole_and_streamed(client):
    """Codex's apply_patch (a flat custom tool of a Lark grammar) forced by name through the Responses API: a reasoning
    item, then a custom_tool_call item (ctc_ id, call_id, name, input of the grammar, status); the tool and the choice
    echoed. Streamed, OpenAI's events, typed by the openai client: the item added (input ""), the input's delta and
    done, the item done; the final response as the whole one."""
    pytest.importorskip("xgrammar")
    from openai.types import responses as types

    kw = dict(tools=[FLAT_APPLY_PATCH], tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=300)
    whole = respond(client, **kw)
    assert _kinds(whole) == ["reasoning", "custom_tool_call"] and whole.status == "completed", whole.output
    item = _custom_call_item(whole)
    assert item.id.startswith("ctc_") and item.call_id.startswith("call_") and item.name == "apply_patch"
    assert PATCH.fullmatch(item.input) and item.to_dict()["status"] == "completed", item
    assert whole.tools[0].type == "custom" and whole.tools[0].format.definition == PATCH_GRAMMAR
    assert (whole.tool_choice.type, whole.tool_choice.name) == ("custom", "apply_patch")
    events, final = _events(client, **kw)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types_ = [e.type for e in events]
    assert types_[types_.index("response.output_item.done") + 1:] == [
        "response.output_item.added", "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done",
        "response.output_item.done", "response.completed"], types_
    added, delta, done, item_done = events[-5:-1]
    assert isinstance(delta, types.ResponseCustomToolCallInputDeltaEvent)
    assert isinstance(done, types.ResponseCustomToolCallInputDoneEvent)
    assert (added.item.type, added.item.input, added.item.to_dict()["status"]) == ("custom_tool_call", "", "in_progress")
    assert delta.delta == done.input == item_done.item.input == item.input
    assert delta.item_id == done.item_id == added.item.id == final.output[1].id and done.output_index == 1
    assert [o.model_dump(exclude={"id", "call_id"}) for o in final.output] == \
        [o.model_dump(exclude={"id", "call_id"}) for o in whole.output]


def test_responses_custom_tool_calls_sent_back_and_stored(client):
    """custom_tool_call and custom_tool_call_output items in `input` (Codex's store false turns): the prompt is that of
    the function_call and function_call_output they stand for, and the model answers the tool's result; a stored
    response's custom call continued by previous_response_id with its output alike, its input items listed with ids."""
    call = {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch", "input": A_PATCH}
    output = {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Done."}
    as_function = [{"type": "function_call", "call_id": "call_1", "name": "apply_patch",
                    "arguments": json.dumps({"input": A_PATCH})}, {**output, "type": "function_call_output"}]
    custom = respond(client, input=[*USER, call, output], tools=[FLAT_FREE_PATCH], store=False)
    function = respond(client, input=[*USER, *as_function], tools=[FLAT_FREE_PATCH], store=False)
    assert custom.usage.input_tokens == function.usage.input_tokens
    assert (custom.output[0].content[0].text, custom.output_text) == (AFTER_TOOL_REASONING, ANSWER)
    first = respond(client, tools=[FLAT_APPLY_PATCH], tool_choice={"type": "custom", "name": "apply_patch"},
                    max_output_tokens=300)
    item = _custom_call_item(first)
    second = respond(client, input=[{**output, "call_id": item.call_id}], previous_response_id=first.id,
                     tools=[FLAT_FREE_PATCH])
    assert second.output_text == ANSWER
    items = list(client.responses.input_items.list(second.id, order="asc"))
    assert [i.type for i in items] == ["message", "reasoning", "custom_tool_call", "custom_tool_call_output"]
    assert items[2].id == item.id and items[2].input == item.input and items[3].id.startswith("ctco_")


def _custom_regex(name: str, pattern: str) -> dict:
    return {"type": "custom", "custom": {"name": name, "format": {"type": "grammar", "grammar": {
        "syntax": "regex", "definition": pattern}}}}


def test_a_custom_input_holding_xml_tags_comes_back_whole(client):
    """An input whose grammar lets it hold `</parameter>` (a patch of an XML file): the model's call, in Qwen's XML
    format, writes it as it is, and the call's input comes back whole (it was cut at the first `</parameter>`, which
    ends no parameter there, the rest dropped: an input its grammar does not take), whole and streamed. (A value ends at
    its last `</parameter>` before the next tag: one with `</function>` after its `</parameter>` is still cut there.)"""
    pytest.importorskip("xgrammar")
    pattern = "a</parameter>\n(b|c)"
    kw = dict(tools=[_custom_regex("xml", pattern)], tool_choice={"type": "custom", "custom": {"name": "xml"}},
              max_tokens=120)
    (call,) = ask(client, USER, **kw).choices[0].message.tool_calls
    assert re.fullmatch(pattern, call.custom.input), call.custom.input
    (_, *rest), finish = _custom_deltas(client, **kw)
    assert finish == "stop" and "".join(d["custom"]["input"] for d in rest) == call.custom.input


def test_an_empty_regular_expression_holds_the_input_to_no_text(client):
    """A custom tool of the regular expression "" (it matches the empty text alone): its call's input is "" (it was a
    400 of xgrammar's internals, "Regex format must have a pattern field with a non-empty string", naming no tool)."""
    pytest.importorskip("xgrammar")
    choice = ask(client, USER, tools=[_custom_regex("noop", "")], tool_choice={"type": "custom", "custom": {"name": "noop"}},
                 max_tokens=120).choices[0]
    (call,) = choice.message.tool_calls
    assert (choice.finish_reason, call.custom.name, call.custom.input) == ("stop", "noop", ""), choice


# Codex's apply_patch grammar as Codex sends it (codex-rs: tool_apply_patch.lark)
CODEX_PATCH_GRAMMAR = r'''start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
'''


def test_responses_allowed_custom_tools_and_codex_s_grammar(client):
    """allowed_tools "required" naming a custom tool (the flat {"type": "custom", "name"} entry): its call, its input of
    the grammar. Codex's own apply_patch grammar beside a function, as Codex sends them (instructions, store false,
    parallel calls off, the reasoning's encrypted content asked for): taken and held, the input of a call forced to it
    the start of a patch (this model, masked, fills an unbounded filename until max_output_tokens cut it)."""
    pytest.importorskip("xgrammar")
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "custom", "name": "apply_patch"}]}
    r = respond(client, tools=[FLAT_APPLY_PATCH, RESPONSE_TOOL], tool_choice=allowed, parallel_tool_calls=False,
                max_output_tokens=300)
    assert _kinds(r) == ["reasoning", "custom_tool_call"] and PATCH.fullmatch(_custom_call_item(r).input), r.output
    codex = {**FLAT_APPLY_PATCH, "format": {"type": "grammar", "syntax": "lark", "definition": CODEX_PATCH_GRAMMAR}}
    r = respond(client, tools=[codex, RESPONSE_TOOL], tool_choice={"type": "custom", "name": "apply_patch"},
                instructions="You are Codex.", parallel_tool_calls=False, store=False,
                include=["reasoning.encrypted_content"], max_output_tokens=120)
    item = _custom_call_item(r)
    assert r.status == "incomplete" and item.to_dict()["status"] == "incomplete", r.output
    assert item.input.startswith("*** Begin Patch\n***"), item.input


@pytest.mark.parametrize("body, param, says", [
    ({"tools": [{"type": "custom", "custom": {"name": "x", "format": {"type": "grammar", "grammar": {
        "syntax": "ebnf", "definition": 'root ::= "a"'}}}}]}, "tools", "Input should be 'lark' or 'regex' (got 'ebnf')"),
    ({"tools": [{"type": "custom", "custom": {"name": "x", "format": {"type": "grammar", "grammar": {
        "syntax": "lark", "definition": "start: foo"}}}}]}, "tools",
     "the custom tool 'x': its Lark grammar does not compile: Lark error at line 1"),
    ({"tools": [{"type": "custom", "custom": {"name": "x", "format": {"type": "grammar", "grammar": {
        "syntax": "regex", "definition": "a(b"}}}}], "tool_choice": "none"}, "tools",
     "the custom tool 'x': its regular expression does not compile"),
    ({"tools": [{"type": "custom", "custom": {"name": "x", "format": {"type": "grammar"}}}]}, "tools",
     'a grammar format is {"type": "grammar", "grammar": {"syntax": "lark" | "regex"'),
    ({"tools": [{"type": "custom", "custom": {"name": "x", "parameters": {"type": "object"}}}]}, "tools",
     "tools.0.custom: a custom tool takes no parameters"),
    ({"tools": [APPLY_PATCH], "tool_choice": {"type": "function", "function": {"name": "apply_patch"}}}, "tool_choice",
     "tool_choice names 'apply_patch' as a function tool, and the request's 'apply_patch' is a custom tool: choose it "
     "with type 'custom'"),
    ({"tools": [APPLY_PATCH], "tool_choice": {"type": "custom", "custom": {"name": "shell"}}}, "tool_choice",
     "tool_choice names the custom 'shell', which is not among the request's tools"),
    ({"tools": [APPLY_PATCH], "tool_choice": {"type": "custom", "name": "apply_patch"}}, "tool_choice",
     'a custom choice is {"type": "custom", "custom": {"name": ...}} (custom: Field required)'),
    ({"tools": [APPLY_PATCH], "tool_choice": {"type": "custom", "custom": {"name": "apply_patch"}},
      "guided_choice": ["a"]}, "tool_choice", "already asks for structured output with guided_choice"),
])
def test_bad_custom_tools_are_400_naming_the_problem(server, body, param, says):
    error = _error(server, body)
    assert error["param"] == param and says in error["message"], error


@pytest.mark.parametrize("body, param, says", [
    ({"tools": [{**FLAT_APPLY_PATCH, "format": {"type": "grammar", "syntax": "gbnf", "definition": "x"}}]}, "tools",
     "(got 'gbnf')"),
    ({"tools": [{**FLAT_APPLY_PATCH, "parameters": {"type": "object"}}]}, "tools",
     "tools.0: a custom tool takes no parameters"),  # (it was "tools.0.custom: ...", a key the flat shape has not)
    ({"tools": [{**FLAT_APPLY_PATCH, "format": {"type": "grammar"}}]}, "tools", "tools.0.format: a grammar format is"),
    ({"tools": [{**FLAT_APPLY_PATCH, "format": {"type": "grammar", "syntax": "lark", "definition": "start: ("}}]},
     "tools", "the custom tool 'apply_patch': its Lark grammar does not compile"),
    ({"tools": [FLAT_APPLY_PATCH], "tool_choice": {"type": "custom", "name": "shell"}}, "tool_choice", "'shell'"),
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "apply_patch"}]}, "input",
     "item 0 (custom_tool_call) input: Field required"),
])
def test_responses_bad_custom_tools_are_400_naming_the_problem(server, body, param, says):
    error = _responses_error(server, body)
    assert error["param"] == param and says in error["message"], error


def test_custom_tool_requests_without_a_server():
    """What tool_request makes of custom tools: each rendered as the function it stands for (one string parameter,
    input, its grammar described); under a forced choice a tool of format text is forced through JSON as a function is,
    one of a grammar through the tag of calls in Qwen's XML format; a grammar where the model's calls are JSON strings
    (qwen3_json) or unread is a 400 naming the tool."""
    from metrale_graph.server.errors import APIError
    from metrale_graph.server.protocol import ChatCompletionRequest
    from metrale_graph.server.tool_choice import tool_request

    def request(tools, choice=None, tool_format="qwen3_xml"):
        body = ChatCompletionRequest.model_validate({"messages": USER, "tools": tools, "tool_choice": choice})
        return tool_request(body.tools, body.tool_choice, tool_format)

    free = request([FREE_PATCH, WEATHER_TOOL], {"type": "custom", "custom": {"name": "apply_patch"}})
    assert free.template_tools[0] == {"type": "function", "function": {"name": "apply_patch", "parameters": {
        "type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
        "additionalProperties": False}}}
    assert free.forced == free.template_tools[0]["function"]["parameters"] and not free.required
    assert free.custom == {"apply_patch"} and free.held == {}
    held = request([APPLY_PATCH, WEATHER_TOOL], "required")
    assert held.forced is None and held.required and held.allowed == ("apply_patch", "get_weather")
    assert held.strict  # (a forced call's arguments follow its function's schema, as forced_call_schema's do)
    assert PATCH_GRAMMAR in held.template_tools[0]["function"]["parameters"]["properties"]["input"]["description"]
    assert held.held == {"apply_patch": {"type": "grammar", "grammar": PATCH_GRAMMAR, "syntax": "lark"}}
    for tool_format, says in (("qwen3_json", "writes its calls as JSON"), (None, "cannot read its model's calls")):
        with pytest.raises(APIError, match=says) as e:
            request([APPLY_PATCH], "required", tool_format)
        assert e.value.param == "tools" and "'apply_patch'" in str(e.value)
    assert request([FREE_PATCH], "required", None).forced is not None  # (text: JSON, any template)

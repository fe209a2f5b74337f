"""Structured output through the server as its clients use it: a real process (tools/serve.py on 127.0.0.1, a
free port, started once for the module) on the checkpoint of test_serve_tools.py (chain_model.py: Qwen3.5's chat
format, a reasoning block, then an XML call, never JSON), called with the official `openai` client, `instructor`
(PyPI) and raw HTTP. Under a grammar its replies follow the schema only because the mask forces them (the
model's own next token is masked away; it then takes the allowed token of lowest id, greedy), after its
reasoning, which stays free.

Covered: response_format json_schema (and instructor's JSON_SCHEMA mode) giving a validated pydantic object,
instructor's TOOLS mode (a named tool_choice, and its create_partial), tool_choice "required" and named, whole and
streamed (the arguments as they come, a reply cut inside them), a stop token the grammar needs ending the reply, vLLM's
guided_* and structured_outputs on both endpoints, sampled outputs that validate, and the 400s naming their
field (a schema that is not JSON Schema, one structured output asked twice, a keyword xgrammar would drop, ...).
The Responses API's text.format (client.responses.parse with a pydantic text_format, whole and streamed;
json_object), its forced tool_choice (named, "required") and instructor's RESPONSES_TOOLS mode."""

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from chain_model import REASONING
from server_process import chain_server, openai_client

pytest.importorskip("xgrammar")
NAME = "tiny-structured"
TIMEOUT = 120
USER = [{"role": "user", "content": "What is the weather in Paris?"}]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Weather(BaseModel):
    """A forecast whose every field is bounded: the model's output cannot grow without end."""
    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=7)
    sunny: bool


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": Weather.model_json_schema()}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with chain_server(tmp_path_factory, NAME, TIMEOUT) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, TIMEOUT)


def chat(client, **kw):
    return client.chat.completions.create(model=NAME, messages=USER, **{"temperature": 0, "max_tokens": 64, **kw})


def test_response_format_json_schema_after_the_reasoning(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "Weather", "schema": Weather.model_json_schema()}}
    choice = chat(client, response_format=fmt).choices[0]
    assert choice.finish_reason == "stop" and choice.message.reasoning_content == REASONING
    assert Weather.model_validate_json(choice.message.content) and choice.message.tool_calls is None
    streamed = [c.choices[0].delta.content or "" for c in chat(client, response_format=fmt, stream=True) if c.choices]
    assert "".join(streamed) == choice.message.content


def test_instructor_json_schema_mode_returns_a_validated_object(client):
    import instructor

    patched = instructor.from_openai(client, mode=instructor.Mode.JSON_SCHEMA)
    weather = patched.chat.completions.create(model=NAME, messages=USER, response_model=Weather, temperature=0,
                                              max_tokens=64, max_retries=1)
    assert isinstance(weather, Weather)


def test_instructor_tools_mode_returns_a_validated_object(client):
    """instructor's TOOLS mode sends the model as a function and names it in tool_choice: a forced call."""
    import instructor

    patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    weather, completion = patched.chat.completions.create_with_completion(
        model=NAME, messages=USER, response_model=Weather, temperature=0, max_tokens=64, max_retries=1)
    assert isinstance(weather, Weather) and completion.choices[0].message.tool_calls[0].function.name == "Weather"


def _calls(message_or_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message_or_calls]


def _streamed_calls(client, **kw) -> tuple[list[tuple[str, dict]], str]:
    """The calls and finish reason of a streamed reply, its tool_calls deltas put together as a client does."""
    names, arguments, finish = {}, {}, None
    for chunk in chat(client, stream=True, **kw):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.function.name:
                    names[call.index] = call.function.name
                arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
            finish = choice.finish_reason or finish
    return [(names[i], json.loads(arguments[i])) for i in sorted(names)], finish


def _check_calls(calls):
    assert calls
    for name, arguments in calls:
        assert name in ("get_weather", "get_time")
        assert Weather.model_validate(arguments) if name == "get_weather" else arguments["zone"] in ("UTC", "CET")


def test_tool_choice_required_makes_calls_of_the_offered_functions(client):
    """Greedy, this model would add calls without end (',' is the allowed token of lowest id): with
    parallel_tool_calls false it makes one. Sampled, it makes calls until it closes the list."""
    one = dict(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    choice = chat(client, **one).choices[0]
    calls = _calls(choice.message.tool_calls)
    assert choice.finish_reason == "tool_calls" and len(calls) == 1 and choice.message.content is None
    _check_calls(calls)
    assert _streamed_calls(client, **one) == (calls, "tool_calls")
    choice = chat(client, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=1,
                  max_tokens=400).choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(_calls(choice.message.tool_calls))


def test_a_named_tool_choice_calls_that_function(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = chat(client, tools=[WEATHER, TIME], tool_choice=named).choices[0]
    # a call forced by name finishes with "stop", as OpenAI and vLLM answer it ("required" and auto: "tool_calls")
    assert choice.finish_reason == "stop" and choice.message.reasoning_content == REASONING
    (call,) = _calls(choice.message.tool_calls)
    assert call[0] == "get_time" and call[1]["zone"] in ("UTC", "CET")
    assert _streamed_calls(client, tools=[WEATHER, TIME], tool_choice=named) == ([call], "stop")


def test_a_forced_call_streams_its_arguments_as_they_come(client):
    """As vLLM streams a forced call: the call's name first, then its arguments in pieces as they are sampled (what
    instructor's create_partial reads), under a named function and "required"; a reply cut by max_tokens keeps the
    call ("length"), its arguments closed into valid JSON, whole and streamed alike: the openai client's Responses
    stream helper, which parses every call of a strict tool, takes the cut response."""
    import instructor

    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, max_tokens, finish in ((named, 64, "stop"), ("required", 64, "tool_calls"), (named, 12, "length")):
        kw = dict(tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False, max_tokens=max_tokens)
        pieces = [(d.function.name, d.function.arguments) for chunk in chat(client, stream=True, **kw)
                  for c in chunk.choices for d in c.delta.tool_calls or ()]
        whole = chat(client, **kw).choices[0]
        (call,) = whole.message.tool_calls
        assert whole.finish_reason == finish and pieces[0] == (call.function.name, "") and len(pieces) > 3, pieces
        assert "".join(arguments for _, arguments in pieces) == call.function.arguments, (choice, max_tokens)
    assert call.function.arguments == '{"city": ""}'  # (cut inside a string: closed, valid JSON)
    strict = {"type": "function", "name": "get_weather", "parameters": openai.pydantic_function_tool(Weather)[
        "function"]["parameters"], "strict": True}
    with client.responses.stream(model=NAME, input="Weather?", tools=[strict], tool_choice="required", temperature=0,
                                 max_output_tokens=60) as stream:
        final = stream.get_final_response()
    (cut,) = [item for item in final.output if item.type == "function_call"]
    assert final.status == cut.status == "incomplete" and json.loads(cut.arguments) == {"city": "Paris"}
    patch = {"type": "custom", "custom": {"name": "patch"}}  # (format text: forced through the JSON {"input": ...})
    kw = dict(tools=[patch], tool_choice=patch, max_tokens=40)
    (whole,) = chat(client, **kw).choices[0].message.tool_calls
    streamed = [d.model_extra["custom"] for chunk in chat(client, stream=True, **kw) for c in chunk.choices
                for d in c.delta.tool_calls or ()]
    # cut: the input so far ("!", the grammar's allowed token of lowest id, greedy), whole and streamed alike
    assert whole.custom.input.startswith("!") and "".join(d["input"] for d in streamed) == whole.custom.input
    partials = list(instructor.from_openai(client, mode=instructor.Mode.TOOLS).chat.completions.create_partial(
        response_model=Weather, model=NAME, messages=USER, max_tokens=64, temperature=0))
    assert len(partials) > 3 and partials[0].city is None and partials[-1] == Weather(city="Paris", days=1, sunny=False)


def test_tools_and_a_named_choice_without_type_are_functions(client):
    """A tool or a named tool_choice without "type" (or a null one) is a function's, as in vLLM, whose request
    models default the type (once a 400 "Unable to extract tag using discriminator 'type'"): the same reply as typed."""
    untyped = [{"function": t["function"]} for t in (WEATHER, TIME)]
    named = {"type": "function", "function": {"name": "get_time"}}
    want = chat(client, tools=[WEATHER, TIME], tool_choice=named).choices[0].message
    for tools, choice in ((untyped, named), ([WEATHER, TIME], {"function": named["function"]}),
                          ([{**t, "type": None} for t in untyped], {"type": None, "function": named["function"]})):
        got = chat(client, tools=tools, tool_choice=choice).choices[0].message
        assert got.tool_calls[0].function == want.tool_calls[0].function, (tools, choice)


def test_a_forced_call_beside_a_response_format_is_the_call(client):
    """The OpenAI Agents SDK sends an agent's output_type as response_format on every turn, tool_choice "required" or
    a function's name beside it when the agent forces a tool (ModelSettings.tool_choice): the reply is the call, the
    format has no text to hold (OpenAI takes both; once a 400 "the request already asks for structured output")."""
    fmt = {"type": "json_schema", "json_schema": {"name": "final_output", "strict": True,
                                                  "schema": Weather.model_json_schema()}}
    for choice_ in ("required", {"type": "function", "function": {"name": "get_time"}}):
        kw = dict(tools=[WEATHER, TIME], tool_choice=choice_, parallel_tool_calls=False, response_format=fmt)
        choice = chat(client, **kw).choices[0]
        assert choice.message.content is None and choice.finish_reason == ("stop" if choice_ != "required"
                                                                            else "tool_calls"), choice
        calls = _calls(choice.message.tool_calls)
        assert len(calls) == 1 and _streamed_calls(client, **kw)[0] == calls
        _check_calls(calls)

def test_a_stop_token_the_grammar_needs_ends_the_reply(server):
    """A stop_token_ids token the grammar needs ('[' opening "required"'s list, '{' a response_format's object) is
    sampled and ends the reply, "stop" with that token as stop_reason, whole and streamed (vLLM's; the grammar made
    it an end token, masked where it is needed: a 500, no allowed token left to sample)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "Weather", "schema": Weather.model_json_schema()}}
    for kw, stop in ((dict(tools=[WEATHER, TIME], tool_choice="required"), "["), (dict(response_format=fmt), "{")):
        (stop_id,) = httpx.post(server.url + "/tokenize", timeout=TIMEOUT, json={
            "model": NAME, "prompt": stop, "add_special_tokens": False}).json()["tokens"]
        body = {"model": NAME, "messages": USER, "temperature": 0, "max_tokens": 64, "stop_token_ids": [stop_id], **kw}
        reply = httpx.post(server.url + "/v1/chat/completions", timeout=TIMEOUT, json=body)
        assert reply.status_code == 200, reply.text
        (choice,) = reply.json()["choices"]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_id), choice
        assert choice["message"]["content"] is None and not choice["message"].get("tool_calls"), choice
        reply = httpx.post(server.url + "/v1/chat/completions", timeout=TIMEOUT, json={**body, "stream": True})
        chunks = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop", reply.text


def test_a_forced_call_of_a_function_without_parameters_has_no_arguments(client):
    """A function sent without `parameters` (OpenAI's empty parameter list), forced by name or by "required": its
    call's arguments are {} (held to a bare object schema, this model wrote one key until max_tokens, and the
    client got that text as content, no call)."""
    clock = {"type": "function", "function": {"name": "get_clock", "description": "The time now"}}
    named = {"type": "function", "function": {"name": "get_clock"}}
    choice = chat(client, tools=[clock], tool_choice=named).choices[0]
    assert choice.finish_reason == "stop" and _calls(choice.message.tool_calls) == [("get_clock", {})], choice
    choice = chat(client, tools=[clock], tool_choice="required", parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls" and _calls(choice.message.tool_calls) == [("get_clock", {})], choice


class Place(BaseModel):
    name: Literal["Paris", "Rome"]


class Trip(BaseModel):
    """Arguments with a nested model: pydantic's schema refers to it as "#/$defs/Place"."""
    to: Place
    days: int = Field(ge=1, le=7)


class Route(BaseModel):
    """Another tool's nested model of the same name but another schema."""
    class Place(BaseModel):
        zone: Literal["UTC", "CET"]

    at: Place


def test_a_forced_call_of_functions_whose_parameters_refer_to_their_own_defs(client):
    """tool_choice "required" over tools whose parameters hold references into their own schema ("#/$defs/Place",
    pydantic's nested models; two tools with a definition of one name and different schemas): the calls'
    schema keeps each tool's references pointing into its own parameters (once a 400: "Cannot find field
    '$defs'"), and the calls validate."""
    tools = [{"type": "function", "function": {"name": "trip", "parameters": Trip.model_json_schema()}},
             {"type": "function", "function": {"name": "route", "parameters": Route.model_json_schema()}}]
    assert all("$ref" in json.dumps(t["function"]["parameters"]) for t in tools)
    for kw in (dict(parallel_tool_calls=False), dict(temperature=1.0, seed=3, max_tokens=400)):
        choice = chat(client, tools=tools, tool_choice="required", **kw).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        for name, arguments in _calls(choice.message.tool_calls):
            assert (Trip if name == "trip" else Route).model_validate(arguments)


def test_sampled_replies_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "Weather", "schema": Weather.model_json_schema()}}
    replies = client.chat.completions.create(model=NAME, messages=USER, temperature=1.0, seed=5, n=4, max_tokens=64,
                                             response_format=fmt)
    for choice in replies.choices:
        assert choice.finish_reason == "stop" and Weather.model_validate_json(choice.message.content)


GUIDED = [  # (endpoint, field, value, what the text must be)
    ("completions", "guided_choice", ["sunny", "rainy"], lambda t: t in ("sunny", "rainy")),
    ("completions", "guided_regex", "[0-9]{2}C", lambda t: re.fullmatch("[0-9]{2}C", t)),
    ("completions", "guided_json", Weather.model_json_schema(), Weather.model_validate_json),
    ("completions", "guided_grammar", 'root ::= "hot" | "cold"', lambda t: t in ("hot", "cold")),
    ("completions", "guided_grammar", '?start: "hot" | temp\ntemp: /[0-9]{2}/ "C"\n',  # Lark's, as vLLM takes it
     lambda t: t == "hot" or re.fullmatch("[0-9]{2}C", t)),
    ("completions", "structured_outputs", {"choice": ["a", "b"]}, lambda t: t in ("a", "b")),
    ("chat", "guided_choice", ["sunny", "rainy"], lambda t: t in ("sunny", "rainy")),
    ("chat", "structured_outputs", {"json": json.dumps(Weather.model_json_schema())}, Weather.model_validate_json),
]


@pytest.mark.parametrize("endpoint, field, value, check", GUIDED, ids=[f"{e}-{f}" for e, f, _, _ in GUIDED])
def test_vllm_s_fields(client, endpoint, field, value, check):
    for temperature in (0.0, 1.0):
        if endpoint == "completions":
            reply = client.completions.create(model=NAME, prompt="The weather:", max_tokens=64, seed=3,
                                              temperature=temperature, extra_body={field: value})
            text, finish = reply.choices[0].text, reply.choices[0].finish_reason
        else:
            reply = chat(client, temperature=temperature, seed=3, extra_body={field: value})
            text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert finish == "stop" and check(text), (temperature, text)


# characters outside the BMP (two UTF-16 units: JavaScript's regular expressions, and so JSON Schema's patterns, write them
# as a pair of escapes), each with the Python expression its reply must match (xgrammar read each escape of a pair as a
# code point of its own, and wrote their surrogates' UTF-8: replies decoded to U+FFFD's)
ASTRAL = [  # (endpoint, field, value, the text's expression)
    ("chat", "response_format", {"type": "json_schema", "json_schema": {"name": "e", "schema": {
        "type": "object", "properties": {"e": {"enum": ["🙂", "a😀b", "𝄞"]}, "c": {"const": "🎉 ok"}},
        "required": ["e", "c"], "additionalProperties": False}}}, r'\{"e": "(🙂|a😀b|𝄞)", "c": "🎉 ok"\}'),
    ("chat", "response_format", {"type": "json_schema", "json_schema": {"name": "e", "schema": {
        "type": "object", "properties": {"e": {"type": "string", "pattern": r"^(\ud83d\ude00|\uD83C\uDF89){1,3}x$"}},
        "required": ["e"], "additionalProperties": False}}}, r'\{"e": "(😀|🎉){1,3}x"\}'),
    ("completions", "structured_outputs", {"regex": r"[\ud83d\ude00-\ud83d\ude02]{2}\\ud83d[\u{1F389}]"},
     r"[😀-😂]{2}\\ud83d🎉"),  # (an escaped backslash: then ud83d is text)
    ("completions", "guided_grammar", r'root ::= "\ud83d\ude00" [\ud83d\ude01-\ud83d\ude02] "\U0001F389"', "😀[😁😂]🎉"),
    ("completions", "guided_grammar", '?start: "\\ud83d\\ude00" /[\\ud83d\\ude01-\\ud83d\\ude02]/', "😀[😁😂]"),  # (Lark's)
    ("completions", "structured_outputs", {"choice": ["😀🎉", "𝄞"]}, "😀🎉|𝄞"),
]


@pytest.mark.parametrize("endpoint, field, value, expression", ASTRAL, ids=[f"{e}-{f}-{i}" for i, (e, f, _, _) in
                                                                            enumerate(ASTRAL)])
def test_characters_outside_the_bmp_in_a_grammar_come_out_whole(client, endpoint, field, value, expression):
    for temperature in (0.0, 1.0):
        kw = {"temperature": temperature, "seed": 4, "max_tokens": 64, "extra_body": {field: value}}
        if endpoint == "completions":
            text = client.completions.create(model=NAME, prompt="Pick:", **kw).choices[0].text
            streamed = [c.choices[0].text for c in client.completions.create(model=NAME, prompt="Pick:", stream=True, **kw)]
        else:
            kw["extra_body"] = {"chat_template_kwargs": {"enable_thinking": False}}
            text = chat(client, response_format=value, **kw).choices[0].message.content
            streamed = [c.choices[0].delta.content or "" for c in chat(client, response_format=value, stream=True, **kw)
                        if c.choices]
        assert re.fullmatch(expression, text) and "".join(streamed) == text, (temperature, text)
        assert not any("\ufffd" in piece for piece in streamed), streamed


def _error(server, path, body) -> dict:
    base = {"prompt": "x"} if path == "/v1/completions" else {"messages": USER}
    r = httpx.post(server.url + path, json={**base, "max_tokens": 8, **body}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    return r.json()["error"]


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
BAD = [  # (path, body, param, words of the message)
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "needs its schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format", 'Unsupported type "nonsense"'),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ("/v1/completions", {"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "'uniqueItems'"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    # what xgrammar drops with a warning: a length beside a pattern, a number's multipleOf, a required property that
    # is not defined (never written)
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$", "maxLength": 3}}}}}},
     "response_format", "'maxLength' (at #/properties/code)"),
    ("/v1/completions", {"guided_json": {"type": "number", "multipleOf": 0.5}}, "guided_json", "'multipleOf' (at #)"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone", "tz"]}}}],
        "tool_choice": "required"}, "tool_choice", "names 'tz'"),
    ("/v1/completions", {"guided_regex": "(("}, "guided_regex", "regular expression does not compile"),
    ("/v1/completions", {"guided_grammar": "root ::= foo"}, "guided_grammar", "grammar does not compile"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice", "non-empty list"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "regex and choice"),
    ("/v1/completions", {"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs",
     "whitespace_pattern"),
    ("/v1/completions", {"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "already asks"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json",
     "already asks for structured output with response_format"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required", "guided_choice": ["a"]},
     "tool_choice", "already asks for structured output with guided_choice"),
    # half of a UTF-16 pair stands for no character (test_characters_outside_the_bmp_in_a_grammar_come_out_whole)
    ("/v1/completions", {"guided_regex": r"a\ud83d"}, "guided_regex", r"\ud83d at 1 is a lead surrogate without its pair"),
    ("/v1/completions", {"guided_grammar": r'root ::= "\ude00"'}, "guided_grammar", "trail surrogate without its pair"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": r"\uD83D[\uDE00-\uDE4F]"}}}}, "response_format", "json: pattern: \\uD83D at 0"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"e": {"type": "string", "pattern": r"\ud83d"}}}}}], "tool_choice": "required"},
     "tool_choice", "lead surrogate"),
]


@pytest.mark.parametrize("path, body, param, says", BAD, ids=[f"{p[1]}-{'-'.join(b)}" for _, b, p, _ in BAD])
def test_bad_structured_output_is_400_naming_the_field(server, path, body, param, says):
    error = _error(server, path, body)
    assert error["param"] == param and says in error["message"], error


def test_min_tokens_beside_structured_output(client):
    """min_tokens beside a grammar is served, as vLLM serves it (once a 400 "cannot be combined"): a choice ends at
    its word below min_tokens (where the grammar allows only a stop, it wins), a JSON object holds to its schema."""
    r = client.completions.create(model=NAME, prompt="x", max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": ["yes", "no"], "min_tokens": 6})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop", r
    r = chat(client, max_tokens=80, extra_body={"min_tokens": 3},
             response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": Weather.model_json_schema()}})
    assert r.choices[0].finish_reason == "stop" and Weather.model_validate_json(r.choices[0].message.content), r


# the Responses API (POST /v1/responses): text.format and forced tool_choice onto the same structured output ------
FLAT_WEATHER = {"type": "function", "name": "get_weather", "parameters": Weather.model_json_schema()}
FLAT_TIME = {"type": "function", **TIME["function"]}


def test_responses_parse_with_a_pydantic_text_format(client):
    """client.responses.parse(text_format=Model) sends text.format json_schema (strict): the message's text
    follows the schema after the free reasoning, and the client parses it into the model, whole and streamed."""
    r = client.responses.parse(model=NAME, input=USER, text_format=Weather, temperature=0, max_output_tokens=64)
    assert r.status == "completed" and [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == REASONING
    assert isinstance(r.output_parsed, Weather) and r.text.format.type == "json_schema"
    with client.responses.stream(model=NAME, input=USER, text_format=Weather, temperature=0,
                                 max_output_tokens=64) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == r.output_parsed


def test_responses_json_object_format(client):
    r = client.responses.create(model=NAME, input=USER, text={"format": {"type": "json_object"}}, temperature=0,
                                max_output_tokens=32)
    assert r.status in ("completed", "incomplete") and r.output_text.startswith("{")


def test_responses_forced_tool_choice_named_and_required(client):
    named = client.responses.create(model=NAME, input=USER, tools=[FLAT_WEATHER, FLAT_TIME], temperature=0,
                                    tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=64)
    (call,) = [item for item in named.output if item.type == "function_call"]
    assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("UTC", "CET")
    assert named.tool_choice.name == "get_time"
    required = client.responses.create(model=NAME, input=USER, tools=[FLAT_WEATHER, FLAT_TIME], temperature=0,
                                       tool_choice="required", parallel_tool_calls=False, max_output_tokens=64)
    calls = [(item.name, json.loads(item.arguments)) for item in required.output if item.type == "function_call"]
    assert len(calls) == 1
    _check_calls(calls)
    events = list(client.responses.create(model=NAME, input=USER, tools=[FLAT_WEATHER, FLAT_TIME], temperature=0,
                                          tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=64,
                                          stream=True))
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert (done.name, json.loads(done.arguments)) == ("get_time", json.loads(call.arguments))


def test_responses_text_format_with_a_forced_call_holds_no_text(server):
    """A forced call and text.format together (instructor's RESPONSES_TOOLS sends both): the reply is the call, the
    format has no text to hold; under tool_choice auto the reply is the format's JSON or calls (this model calls, its
    arguments held to the strict function's schema: test_serve_tools)."""
    body = {"input": USER, "tools": [FLAT_TIME], "text": {"format": {"type": "json_object"}}, "max_output_tokens": 64,
            "temperature": 0, "parallel_tool_calls": False}
    forced = httpx.post(server.url + "/v1/responses", timeout=TIMEOUT, json={**body, "tool_choice": "required"})
    assert forced.status_code == 200 and [i["type"] for i in forced.json()["output"]] == ["reasoning", "function_call"]
    auto = httpx.post(server.url + "/v1/responses", timeout=TIMEOUT, json={**body, "tool_choice": "auto",
                                                                          "tools": [{**FLAT_TIME, "strict": True}],
                                                                          "max_output_tokens": 200})
    assert auto.status_code == 200 and auto.json()["status"] == "completed", auto.text
    call = auto.json()["output"][-1]
    assert call["type"] == "function_call" and json.loads(call["arguments"])["zone"] in ("UTC", "CET"), auto.text


def test_instructor_responses_tools_mode_returns_a_validated_object(client):
    """instructor's RESPONSES_TOOLS mode: the model as a flat function tool, forced by name."""
    import instructor

    patched = instructor.from_openai(client, mode=instructor.Mode.RESPONSES_TOOLS)
    weather = patched.responses.create(model=NAME, input=USER, response_model=Weather, temperature=0,
                                       max_output_tokens=64, max_retries=1)
    assert isinstance(weather, Weather)

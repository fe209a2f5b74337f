"""The chat reply's parsers on text alone (no model, no server): Qwen3's reasoning split (reasoning.py), tool
calls in Qwen's XML and JSON formats (tool_parsers.py), the two together (reply.py), and a request's tools
and tool_choice (tool_choice.py). Every streamed case is checked against the whole text's result with the text
cut at every position (and at every pair of positions for the longer ones): tags split across deltas."""

import json

import pytest

from chain_model import QWEN35_TEMPLATE
from metrale_graph.server.errors import APIError
from metrale_graph.server.tool_protocol import NamedToolChoice, Tool
from metrale_graph.server.reasoning import ReasoningParser, split_reasoning, starts_in_reasoning
from metrale_graph.server.reply import Reply, ReplyParsers
from metrale_graph.server.forced_calls import ForcedCallParser, JsonPrefix, forced_calls
from metrale_graph.server.tool_choice import NO_PARAMETERS, forced_call_schema, tool_request
from metrale_graph.server.tool_parsers import (PARSERS, CallArguments, CallStart, ContentDelta, json_call,
                                               parser_of_template, typed_value)

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
    "metric": {"type": "boolean"}, "options": {"type": "object"}, "tags": {"type": "array"},
    "note": {"type": ["string", "null"]}, "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    "unit": {"anyOf": [{"enum": ["C", "F"]}, {"type": "null"}]}, "day": {"type": "string", "format": "date"}}}
FUNCTIONS = {"get_weather": SCHEMA, "get_time": {}}
JSON_TEMPLATE = ("{%- if tools %}For each function call, return a json object with function name and arguments "
                 "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                 "<args-json-object>}\n</tool_call>{%- endif %}")


def xml_call(name: str, **params) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def events_of(parser, pieces) -> list:
    return [e for piece in pieces for e in parser.feed(piece)] + parser.finish()


def cuts(text: str, pairs: bool = False):
    """The text cut at every position (pairs: at every pair of positions, the second a few apart)."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
        if pairs:
            for j in range(i + 1, min(len(text), i + 12) + 1):
                yield [text[:i], text[i:j], text[j:]]


def parse(kind: str, pieces, functions=FUNCTIONS) -> Reply:
    return Reply.of(events_of(PARSERS[kind](functions), pieces))


def assert_same_when_streamed(kind: str, text: str, functions=FUNCTIONS, pairs: bool = False) -> Reply:
    whole = parse(kind, [text], functions)
    for pieces in cuts(text, pairs):
        assert parse(kind, pieces, functions) == whole, pieces
    return whole


# reasoning ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, in_reasoning, want", [
    ("I think so.\n</think>\n\nYes.", True, ("I think so.", "Yes.")),  # Qwen3.5: the prompt opened the block
    ("<think>\nI think so.\n</think>\n\nYes.", False, ("I think so.", "Yes.")),  # Qwen3: the reply opens it
    ("\n<think>a</think>b", False, ("a", "b")),
    ("Yes.", False, (None, "Yes.")),  # enable_thinking false: the prompt closed the block
    ("  Yes, <think> is a tag.\n", False, (None, "  Yes, <think> is a tag.\n")),  # not at the start: content
    ("still thinking when max_tokens came", True, ("still thinking when max_tokens came", "")),
    ("cut inside the tag </thi", True, ("cut inside the tag </thi", "")),
    ("<thi", False, (None, "<thi")),
    ("</think>\n\nAt once.", True, (None, "At once.")),
    ("a\n\n b</think>x\n\ny\n", True, ("a\n\n b", "x\n\ny\n")),  # inner whitespace kept
    ("a</think></think>", True, ("a", "</think>")),
])
def test_reasoning_split_whole_and_at_every_cut(text, in_reasoning, want):
    assert split_reasoning(text, in_reasoning) == want
    for pieces in cuts(text, pairs=True):
        parser = ReasoningParser(in_reasoning)
        got = [parser.feed(p) for p in pieces] + [parser.finish()]
        reasoning, content = "".join(r for r, _ in got), "".join(c for _, c in got)
        assert ((reasoning or None), content) == want, pieces


def test_reasoning_is_sent_as_it_comes_not_held_to_the_end():
    parser = ReasoningParser(in_reasoning=True)
    assert parser.feed("Let me see") == ("Let me see", "")
    assert parser.feed(" more.\n</th") == (" more.", "")  # the newline and "</th" wait
    assert parser.feed("ink>\n\nOK") == ("", "OK")


def test_starts_in_reasoning_reads_the_rendered_prompt():
    from jinja2 import Environment

    template = Environment().from_string(QWEN35_TEMPLATE)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nx\n</think>\n\nhey"},
                {"role": "user", "content": "again"}]
    assert starts_in_reasoning(template.render(messages=messages, add_generation_prompt=True))
    assert not starts_in_reasoning(template.render(messages=messages, add_generation_prompt=True,
                                                   enable_thinking=False))
    assert not starts_in_reasoning(template.render(messages=messages, add_generation_prompt=False))
    assert not starts_in_reasoning("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")  # Qwen3's own


# XML calls ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, text, want", [
    ("city", "Paris", "Paris"), ("city", "42", "42"), ("city", " two\nlines ", " two\nlines "),
    ("days", "3", 3), ("days", " -7 ", -7), ("days", "3.5", "3.5"), ("days", "three", "three"),
    ("ratio", "0.25", 0.25), ("ratio", "2", 2), ("ratio", "1e3", 1000.0), ("ratio", "NaN", "NaN"),
    ("metric", "true", True), ("metric", "False", False), ("metric", "yes", "yes"),
    ("options", '{"a": [1, 2]}', {"a": [1, 2]}), ("options", "{'a': None}", {"a": None}),
    ("options", "[1]", "[1]"), ("tags", '["x", "y"]', ["x", "y"]), ("tags", "x, y", "x, y"),
    ("note", "null", "null"), ("limit", "null", None), ("limit", "5", 5),  # (a string allowed: text kept)
    ("unknown", "5", "5"),  # a parameter the schema does not name: as written
    # a string the schema fixes (an enum's, a format's) without the whitespace a strict call's grammar lets frame it
    ("unit", "\tC  ", "C"), ("unit", " K ", " K "), ("day", " 2024-01-02\t", "2024-01-02"),
    ("unit", " null ", None),  # (no free string beside null: the word is null)
])
def test_xml_parameter_values_are_typed_by_the_schema(name, text, want):
    value = typed_value(text, SCHEMA["properties"].get(name))
    assert value == want and type(value) is type(want)
    whole = parse("qwen3_xml", [xml_call("get_weather", **{name: text})])
    assert json.loads(whole.calls[0][1]) == {name: want}


def test_xml_call_streamed_at_every_cut_equals_the_whole():
    text = ("Let me check.\n\n" + xml_call("get_weather", city="Paris", days=3, options='{"x": "</parameter"}')
            + "\n" + xml_call("get_time") + "\n")
    whole = assert_same_when_streamed("qwen3_xml", text, pairs=True)
    assert whole == Reply(None, "Let me check.", [("get_weather", '{"city": "Paris", "days": 3, "options": '
                                                                  '{"x": "</parameter"}}'), ("get_time", "{}")])


def test_xml_call_streams_its_name_first_then_one_parameter_at_a_time():
    parser = PARSERS["qwen3_xml"](FUNCTIONS)
    assert parser.feed("Sure.\n<tool_call>\n<function=get_wea") == [ContentDelta("Sure.")]
    assert parser.feed("ther>\n<parameter=city>\nPar") == [CallStart(0, "get_weather")]
    assert parser.feed("is\n</parameter>\n<parameter=days>\n3\n") == [CallArguments(0, '{"city": "Paris"')]
    assert parser.feed("</parameter>\n</function>\n</tool_call>") == [CallArguments(0, ', "days": 3'),
                                                                        CallArguments(0, "}")]
    assert parser.finish() == [] and parser.calls == 1


@pytest.mark.parametrize("kind", ["qwen3_xml", "qwen3_json"])
@pytest.mark.parametrize("before, between, after, content", [
    ("foo\n", "\n", "\n\nbar", "foo\n\nbar"),  # the longest whitespace around the calls
    ("foo\n\n", "", "\nbar baz\n", "foo\n\nbar baz"),  # (the reply's end: the framing, dropped)
    ("foo ", " ", " bar", "foo bar"), ("foo\t", "\n", "  bar", "foo  bar"),  # (the first of equal ones)
    ("foo", "", "bar", "foobar"),  # none written: none added
    ("\n\n", "\n", "\nbar", "bar"), ("foo\n\n", "\n", "\n", "foo"),  # the content's start and end
])
def test_text_after_calls_keeps_the_whitespace_that_separates_it(kind, before, between, after, content):
    """Text the model writes before and after its calls is content joined by the longest run of whitespace written
    around the calls between them (it was joined without any: "foo" and "bar" became "foobar"); at the content's
    start and end that whitespace is the template's framing, dropped. Two calls, streamed at every cut as whole."""
    call = xml_call("get_time") if kind == "qwen3_xml" else '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    text = before + call + between + call + after
    assert assert_same_when_streamed(kind, text, pairs=True) == Reply(None, content, [("get_time", "{}")] * 2)


@pytest.mark.parametrize("text", [
    xml_call("delete_everything", path="/"),  # a function the request does not offer
    "<tool_call>\nnot xml at all\n</tool_call>",
    "<tool_call>{\"name\": \"get_weather\"}</tool_call>",  # JSON where the XML parser reads
    "<tool_call>\n<function=get_weather",  # cut in the name
    "<tool_call>\n<function=get\nweather>\n</function></tool_call>",
    "<tool_call>",
    "a <tool_call",
    "Use <tool_call> tags.",
])
def test_text_that_only_looks_like_an_xml_call_stays_content(text):
    whole = assert_same_when_streamed("qwen3_xml", text)
    assert whole == Reply(None, text, [])


def test_an_xml_call_without_its_opening_tag_counts():
    """A model may drop the `<tool_call>` before `<function=NAME>` (vLLM's qwen3_coder parser reads such calls):
    a bare `<function=NAME>` of an offered function whose next tag is a parameter or its `</function>` is a call,
    with or without the `</tool_call>` after it, streamed at every cut as whole, beside calls with the tag."""
    bare = xml_call("get_weather", city="Paris", days=3)[len("<tool_call>\n"):]
    text = "Let me check.\n\n" + bare + "\n" + xml_call("get_time") + "\n<function=get_time>\n</function>\nDone."
    whole = assert_same_when_streamed("qwen3_xml", text, pairs=True)
    assert whole == Reply(None, "Let me check.\n\nDone.", [("get_weather", '{"city": "Paris", "days": 3}'),
                                                           ("get_time", "{}"), ("get_time", "{}")])
    assert parse("qwen3_xml", [bare]) == Reply(None, None, [("get_weather", '{"city": "Paris", "days": 3}')])
    after_reasoning = ReplyParsers("qwen3_xml", True).parser(FUNCTIONS, in_reasoning=True)
    assert Reply.of(events_of(after_reasoning, ["Weather needed.\n</think>\n\n" + bare])) == \
        Reply("Weather needed.", None, [("get_weather", '{"city": "Paris", "days": 3}')])
    parser = PARSERS["qwen3_xml"](FUNCTIONS)
    assert parser.feed("Sure.\n<function=get_weather>\n") == [ContentDelta("Sure.")]  # its next tag to come
    assert parser.feed("<param") == []
    assert parser.feed("eter=ci") == [CallStart(0, "get_weather")]
    assert parser.feed("ty>\nParis\n</parameter>\n</function>") == [CallArguments(0, '{"city": "Paris"')]
    assert parser.finish() == [CallArguments(0, "}")]


@pytest.mark.parametrize("text", [
    "Call <function=get_weather> with a city.",  # prose: no parameter or </function> after it
    "<function=get_weather>",  # the reply ends before its next tag
    "<function=get_weather>\nParis\n</function>",
    "<function=delete_everything>\n<parameter=path>\n/\n</parameter>\n</function>",  # not offered
    "<function=get_weather",  # cut in the name
    "<function=get weather>\n</function>",
    "a <function",
    "<function=<function=get_weather>x",
])
def test_a_bare_function_tag_that_is_no_call_stays_content(text):
    assert assert_same_when_streamed("qwen3_xml", text) == Reply(None, text, [])
    assert parse("qwen3_json", [text]) == Reply(None, text, [])  # the JSON format has no such calls


def test_malformed_xml_inside_a_call_is_dropped_and_the_call_still_ends():
    text = ("<tool_call>\n<tool_call>\n<function=get_weather>\nstray text\n<parameter=city>\nOslo\n</parameter>\n"
            "<parameter=city>\nRome\n</parameter>\n<bogus>\n</function>\n</tool_call>Done.")
    whole = assert_same_when_streamed("qwen3_xml", text)
    # the first <tool_call> opened nothing (it is content); a name given twice keeps its first value; text after
    # a call is content too, after the whitespace before the call
    assert whole == Reply(None, "<tool_call>\nDone.", [("get_weather", '{"city": "Oslo"}')])
    assert parse("qwen3_xml", ["<tool_call><function=get_time></function>after"]) == \
        Reply(None, "after", [("get_time", "{}")])  # no </tool_call>: the call ends at </function>
    assert parse("qwen3_xml", ["<tool_call><function=get_time><parameter=x>1</parameter></tool_call>"]) == \
        Reply(None, None, [("get_time", '{"x": "1"}')])  # no </function>


def test_a_value_holding_the_parameter_end_tag_stays_whole():
    """A value with `</parameter>` in it (a custom tool's input editing an XML file): the value runs to the last
    `</parameter>` before the next tag, whole and however streamed (it was cut at the first, the rest dropped)."""
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\na</parameter>\nb\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    assert assert_same_when_streamed("qwen3_xml", text) == \
        Reply(None, None, [("get_weather", '{"city": "a</parameter>\\nb", "days": 3}')])

def test_a_reply_cut_inside_an_xml_call_closes_it_with_what_it_has():
    for tail, arguments in [("", "{}"), ("\n<parameter=city>\nLi", '{"city": "Li"}'),
                            ("\n<parameter=days>\n3\n</parameter>\n</func", '{"days": 3}'), ("\n<param", "{}")]:
        text = "<tool_call>\n<function=get_weather>" + tail
        assert assert_same_when_streamed("qwen3_xml", text) == Reply(None, None, [("get_weather", arguments)])


# JSON calls ---------------------------------------------------------------------------------------------
def test_json_call_streamed_at_every_cut_equals_the_whole():
    text = ('I will call it.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}\n</tool_call>')
    whole = assert_same_when_streamed("qwen3_json", text, pairs=True)
    assert whole == Reply(None, "I will call it.", [("get_weather", '{"city": "Paris", "days": 3}'),
                                                     ("get_time", '{"zone": "UTC"}')])


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',  # bad JSON
    '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',
    '<tool_call>\n["get_weather"]\n</tool_call>',
    '<tool_call>\n<function=get_weather>\n</function>\n</tool_call>',  # XML where the JSON parser reads
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut (max_tokens)
])
def test_text_that_only_looks_like_a_json_call_stays_content(text):
    assert assert_same_when_streamed("qwen3_json", text) == Reply(None, text, [])


def test_json_call_without_its_closing_tag_counts_when_its_json_is_whole():
    text = '<tool_call>\n{"name": "get_time", "parameters": {"zone": "UTC"}}'
    assert assert_same_when_streamed("qwen3_json", text) == Reply(None, None, [("get_time", '{"zone": "UTC"}')])
    assert json_call('{"name": "get_time"}', FUNCTIONS) == ("get_time", "{}")


def test_nested_json_blocks_read_the_inner_call():
    text = '<tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert assert_same_when_streamed("qwen3_json", text) == Reply(None, "<tool_call>", [("get_time", "{}")])


# the two together, and the server's choice of parsers -----------------------------------------------------
def test_reasoning_then_calls_in_one_reply():
    parsers = ReplyParsers.of(QWEN35_TEMPLATE)
    assert parsers == ReplyParsers("qwen3_xml", True)
    text = "Weather needed.\n</think>\n\n" + xml_call("get_weather", city="Paris") + "\n"
    whole = None
    for pieces in cuts(text):
        parser = parsers.parser(FUNCTIONS, in_reasoning=True)
        reply = Reply.of(events_of(parser, pieces))
        assert whole is None or reply == whole, pieces
        whole = reply
    assert whole == Reply("Weather needed.", None, [("get_weather", '{"city": "Paris"}')])
    # no functions (no tools, or tool_choice none): the call stays text; no reasoning parser: all is content
    assert Reply.of(events_of(parsers.parser(None, True), [text])) == \
        Reply("Weather needed.", xml_call("get_weather", city="Paris") + "\n", [])
    assert Reply.of(events_of(ReplyParsers(None, False).parser(FUNCTIONS, True), [text])) == Reply(None, text, [])


@pytest.mark.parametrize("tool_format", ["qwen3_xml", "qwen3_json"])
def test_parallel_tool_calls_false_gives_the_first_call_alone(tool_format):
    """parallel_tool_calls false under tool_choice auto: a reply of two calls gives its first alone (vLLM drops the
    others), streamed at every cut as whole; the text around the calls stays as it was."""
    call = xml_call if tool_format == "qwen3_xml" else lambda name, **args: (
        f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>")
    text = "Both.\n</think>\n\n" + call("get_weather", city="Paris") + "\n" + call("get_time") + "\n"
    parsers = ReplyParsers(tool_format, True)
    both = Reply.of(events_of(parsers.parser(FUNCTIONS, True), [text]))
    assert [name for name, _ in both.calls] == ["get_weather", "get_time"]
    for pieces in cuts(text):
        assert Reply.of(events_of(parsers.parser(FUNCTIONS, True, one_call=True), pieces)) == \
            Reply("Both.", None, both.calls[:1]), pieces


def test_the_parsers_are_picked_from_the_template_or_named():
    assert parser_of_template(QWEN35_TEMPLATE) == "qwen3_xml"
    assert parser_of_template(JSON_TEMPLATE) == "qwen3_json"
    assert parser_of_template("{{ messages }}") is None and parser_of_template(None) is None
    assert ReplyParsers.of(JSON_TEMPLATE) == ReplyParsers("qwen3_json", False)
    assert ReplyParsers.of(QWEN35_TEMPLATE, "qwen3_json", "none") == ReplyParsers("qwen3_json", False)
    assert ReplyParsers.of("{{ messages }}", "qwen3_xml", "qwen3") == ReplyParsers("qwen3_xml", True)
    assert ReplyParsers.of(QWEN35_TEMPLATE, "none") == ReplyParsers(None, True)
    with pytest.raises(ValueError, match="tool_call_parser: expected auto, none or one of qwen3_xml"):
        ReplyParsers.of(None, "hermes")
    with pytest.raises(ValueError, match="reasoning_parser"):
        ReplyParsers.of(None, "auto", "deepseek_r1")


# tools and tool_choice ----------------------------------------------------------------------------------
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": n, "parameters": s}})
         for n, s in (("get_weather", SCHEMA), ("get_time", None))]


def _refusal(tools, choice, tool_format="qwen3_xml") -> APIError:
    with pytest.raises(APIError) as e:
        tool_request(tools, choice, tool_format)
    assert e.value.status == 400
    return e.value


def test_tool_request_checks_names_and_choices():
    request = tool_request(TOOLS, None, "qwen3_xml")  # "auto"
    assert request.functions == {"get_weather": SCHEMA, "get_time": {}}
    assert request.template_tools[1] == {"type": "function", "function": {"name": "get_time"}}
    assert tool_request(TOOLS, "none", "qwen3_xml").template_tools is None  # none: not rendered, not parsed
    assert tool_request(None, None, None).functions is None
    assert _refusal(TOOLS * 2, "auto").param == "tools"
    e = _refusal(TOOLS, NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_date"}}))
    assert e.param == "tool_choice" and "'get_date'" in e.message and "'get_time'" in e.message
    assert _refusal(None, "required").param == "tool_choice"
    e = _refusal(TOOLS, "auto", tool_format=None)
    assert e.param == "tools" and "--tool-call-parser" in e.message


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("tool_format", ["qwen3_xml", None])
def test_forced_calls_are_held_to_their_schema_in_any_template(choice, tool_format):
    """tool_choice "required" and named functions give the schema the reply is sampled under, and no parser of
    the model's format: a server that cannot read its template's calls serves them too."""
    choice = choice if isinstance(choice, str) else NamedToolChoice.model_validate(choice)
    request = tool_request(TOOLS, choice, tool_format)
    assert request.forced == forced_call_schema(TOOLS, choice) and request.functions is None
    assert [t["function"]["name"] for t in request.template_tools] == ["get_weather", "get_time"]


def test_the_forced_call_parser_gives_the_calls_as_they_come():
    """A named function's call starts with the reply and its arguments are the reply's pieces; under "required" a
    call starts once its name is whole and its parameters' text comes in pieces (strings holding brackets, quotes
    and commas do not end them). A reply cut by max_tokens keeps the calls it began, their arguments closed into
    valid JSON (the member being written left out); cut before a call, it is content."""
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
    parser = ForcedCallParser(named)
    assert parser.feed('{"city": ') == [CallStart(0, "get_weather"), CallArguments(0, "{")]
    assert parser.feed('"Paris"}') == [CallArguments(0, '"city": "Paris"}')] and parser.finish() == []
    assert parser.calls == 1
    text = ('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"days": 21, '
            '"city": "a\\"}], {\\\\\\u00e9", "ok": true}}]')
    whole = [CallStart(0, "get_time"), CallArguments(0, "{}"), CallStart(1, "get_weather"),
             CallArguments(1, '{"days": 21, "city": "a\\"}], {\\\\\\u00e9", "ok": true}')]
    assert _forced("required", [text]) == whole
    assert [(n, json.loads(a)) for n, a in forced_calls(text, "required")] == [
        (n, json.loads(a)) for n, a in Reply.of(whole).calls]
    one_by_one = _forced("required", list(text))
    assert Reply.of(one_by_one) == Reply.of(whole) and one_by_one[:2] == [CallStart(0, "get_time"),
                                                                           CallArguments(0, "{")]
    for cut in range(len(text) + 1):  # every reply cut by max_tokens: the same whole or a character at a time, JSON
        calls = Reply.of(_forced("required", [text[:cut]])).calls
        assert calls == Reply.of(_forced("required", list(text[:cut]))).calls, cut
        assert all(json.loads(arguments) is not None for _, arguments in calls), (cut, calls)
    assert _forced("required", ['[{"name": "get_ti']) == [ContentDelta('[{"name": "get_ti')]
    assert Reply.of(_forced("required", [text[:96]])).calls == [("get_time", "{}"), ("get_weather", '{"days": 21}')]
    assert Reply.of(_forced("required", [text[:70]])).calls == [("get_time", "{}"), ("get_weather", "{}")]
    assert Reply.of(_forced(named, ['{"city": "Par'])).calls == [("get_weather", '{"city": "Par"}')]
    assert _forced(named, []) == []
    # parameters of another JSON type (a schema OpenAI would refuse, taken here) and given before the name
    odd = '[{"name": "get_time", "parameters": "x,}"}, {"parameters": {"days": [2]}, "name": "get_weather"}]'
    assert Reply.of(_forced("required", [odd])).calls == [("get_time", '"x,}"'), ("get_weather", '{"days": [2]}')]
    assert Reply.of(_forced("required", list(odd))) == Reply.of(_forced("required", [odd]))


@pytest.mark.parametrize("text, completed", [
    ('{"a": [1, {"b": "x\\', '{"a": [1, {"b": "x"}]}'), ('{"a": [1, {"b": "x\\n', '{"a": [1, {"b": "x\\n"}]}'),
    ('{"a": "\\u00', '{"a": ""}'), ('{"a": tru', '{}'), ('{"a": true', '{"a": true}'), ('{"a": 1.', '{}'),
    ('{"a": 12', '{"a": 12}'), ('{"a": [], ', '{"a": []}'), ('[1, 2', '[1, 2]'), ('[1, ', '[1]'), ('', None)])
def test_a_cut_json_value_is_completed_by_closing_it(text, completed):
    value = JsonPrefix()
    assert all(value.feed(c) for c in text)
    safe, closer = value.finish()
    assert (None if closer is None else text[:safe] + closer) == completed


def _forced(choice, pieces: list[str]) -> list:
    parser = ForcedCallParser(choice)
    return [e for piece in pieces for e in parser.feed(piece)] + parser.finish()


def test_the_forced_call_schema_and_its_replies():
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
    assert forced_call_schema(TOOLS, named) == SCHEMA
    schema = forced_call_schema(TOOLS, "required")
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == NO_PARAMETERS  # no parameters: an empty list
    assert "maxItems" not in schema and forced_call_schema(TOOLS, "required", parallel=False)["maxItems"] == 1
    assert tool_request(TOOLS, "required", None, parallel_tool_calls=False).forced["maxItems"] == 1
    assert forced_calls('{"city": "Paris"}', named) == [("get_weather", '{"city": "Paris"}')]
    assert forced_calls('[{"name": "get_time", "parameters": {}}]', "required") == [("get_time", "{}")]
    for bad, choice in (("[1]", named), ("[]", "required"), ('[{"name": "get_time"}]', "required")):
        with pytest.raises(ValueError):
            forced_calls(bad, choice)
    with pytest.raises(ValueError, match="forces no call"):
        forced_call_schema(TOOLS, "auto")

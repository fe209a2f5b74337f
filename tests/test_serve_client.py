"""The official `openai` client's higher-level helpers and its less common parameters against a real server process
(tools/serve.py on 127.0.0.1, a free port, started once for the module) on the checkpoint of test_serve_tools.py
(chain_model.py: Qwen3.5's chat format, a reasoning, then an XML call of get_weather; its greedy replies known).

Covered: client.chat.completions.parse with a pydantic response_format (`.parsed`, `.refusal`) and with
pydantic_function_tool's strict tools (`parsed_arguments`, auto and a named tool_choice); the
client.chat.completions.stream context manager's typed events (chunk, content.delta / done with the partial
`parsed`, logprobs.content.delta / done, tool_calls.function.arguments.delta / done with `parsed_arguments`), its
final completion equal to parse's, n > 1 and stream_options' usage; client.responses.parse and
client.responses.stream with pydantic_function_tool's tools (`parsed_arguments`), a text_format beside them. Then
the parameters OpenAI or vLLM take that the server once refused or ignored: spaces_between_special_tokens,
structured_outputs' backend switches and structural tags, truncate_prompt_tokens, best_of, chat echo, and the
X-Request-Id every answer carries (with_raw_response's headers)."""

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from chain_model import CALL, CLOSE_THINK, OPEN_THINK, REASONING
from server_process import chain_server, openai_client

pytest.importorskip("xgrammar")
NAME = "tiny-client"
TIMEOUT = 120
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 300  # (a held reply of this model's byte tokens runs to about 100)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Weather(BaseModel):
    """Every field bounded: the model's output under the schema cannot grow without end."""
    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=7)
    sunny: bool


class Zone(BaseModel):
    zone: Literal["UTC", "CET"]


WEATHER = openai.pydantic_function_tool(Weather, name="get_weather")  # strict: true
ZONE = openai.pydantic_function_tool(Zone, name="get_time")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with chain_server(tmp_path_factory, NAME, TIMEOUT) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, TIMEOUT)


def ask(**kw) -> dict:
    return {"model": NAME, "messages": USER, "temperature": 0, "max_tokens": MAX_TOKENS, **kw}


def test_chat_parse_with_a_pydantic_response_format(client):
    r = client.chat.completions.parse(**ask(response_format=Weather))
    (choice,) = r.choices
    assert choice.finish_reason == "stop" and choice.message.refusal is None
    assert isinstance(choice.message.parsed, Weather) and choice.message.reasoning_content == REASONING
    assert Weather.model_validate_json(choice.message.content) == choice.message.parsed
    sampled = client.chat.completions.parse(**ask(response_format=Weather, n=3, temperature=1.0, seed=2))
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert all(isinstance(c.message.parsed, Weather) and c.finish_reason == "stop" for c in sampled.choices)


def test_chat_parse_with_pydantic_function_tools(client):
    """pydantic_function_tool's tools are strict: the calls are held to their schemas, and parse gives each call's
    arguments as the model (`parsed_arguments`), under auto and under a named tool_choice ("stop", as OpenAI)."""
    r = client.chat.completions.parse(**ask(tools=[WEATHER, ZONE]))
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.parsed_arguments, Weather)
    assert json.loads(call.function.arguments) == call.function.parsed_arguments.model_dump()
    named = client.chat.completions.parse(**ask(tools=[WEATHER, ZONE], tool_choice={
        "type": "function", "function": {"name": "get_time"}}))
    (choice,) = named.choices
    assert choice.finish_reason == "stop" and isinstance(choice.message.tool_calls[0].function.parsed_arguments, Zone)


def _events(client, **kw) -> tuple[list, object]:
    with client.chat.completions.stream(**ask(**kw)) as stream:
        events = list(stream)
        return events, stream.get_final_completion()


def test_chat_stream_helper_with_a_response_format_and_logprobs(client):
    """chat.completions.stream's events: a chunk event per chunk, content.delta with the partial parse so far, one
    content.done with the parsed object, logprobs.content.delta for every token and one logprobs.content.done
    holding them all; the final completion equals parse's, its usage sent with include_usage."""
    whole = client.chat.completions.parse(**ask(response_format=Weather, logprobs=True, top_logprobs=2))
    events, final = _events(client, response_format=Weather, logprobs=True, top_logprobs=2,
                            stream_options={"include_usage": True})
    kinds = [e.type for e in events]
    assert set(kinds) == {"chunk", "content.delta", "content.done", "logprobs.content.delta", "logprobs.content.done"}
    assert kinds.count("content.done") == kinds.count("logprobs.content.done") == 1
    (done,) = [e for e in events if e.type == "content.done"]
    assert done.parsed == whole.choices[0].message.parsed and done.content == whole.choices[0].message.content
    deltas = [e for e in events if e.type == "content.delta"]
    assert "".join(e.delta for e in deltas) == done.content and isinstance(deltas[-1].parsed, dict)
    (lp_done,) = [e for e in events if e.type == "logprobs.content.done"]
    assert [(t.token, t.logprob) for t in lp_done.content] == [(t.token, t.logprob)
                                                               for t in whole.choices[0].logprobs.content]
    message = final.choices[0].message
    assert message.parsed == whole.choices[0].message.parsed and final.choices[0].finish_reason == "stop"
    assert final.usage.completion_tokens == whole.usage.completion_tokens and final.usage.prompt_tokens > 0


def test_chat_stream_helper_with_pydantic_function_tools(client):
    """Strict tools through the stream helper: tool_calls.function.arguments.delta events, then one .done per call
    with its name and `parsed_arguments`; the final completion's calls equal parse's; n 2 keeps each choice's calls
    apart."""
    whole = client.chat.completions.parse(**ask(tools=[WEATHER]))
    events, final = _events(client, tools=[WEATHER])
    (done,) = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert (done.name, done.index, done.parsed_arguments) == ("get_weather", 0,
                                                              whole.choices[0].message.tool_calls[0].function.parsed_arguments)
    deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert "".join(e.arguments_delta for e in deltas) == done.arguments
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.choices[0].message.tool_calls[0].function.parsed_arguments == done.parsed_arguments
    _, two = _events(client, tools=[WEATHER], n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert all(c.message.tool_calls[0].function.parsed_arguments == done.parsed_arguments for c in two.choices)


def test_responses_parse_and_stream_with_pydantic_function_tools(client):
    r = client.responses.parse(model=NAME, input=USER, tools=[WEATHER], temperature=0, max_output_tokens=MAX_TOKENS)
    assert r.status == "completed" and [o.type for o in r.output] == ["reasoning", "function_call"]
    assert isinstance(r.output[-1].parsed_arguments, Weather)
    with client.responses.stream(model=NAME, input=USER, tools=[WEATHER], temperature=0,
                                 max_output_tokens=MAX_TOKENS) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    assert final.output[-1].parsed_arguments == r.output[-1].parsed_arguments
    with client.responses.stream(model=NAME, input=USER, tools=[WEATHER], text_format=Weather, temperature=0,
                                 max_output_tokens=MAX_TOKENS) as stream:  # (a format beside tools: JSON or calls)
        both = stream.get_final_response()
    assert both.output_parsed is None and both.output[-1].parsed_arguments == r.output[-1].parsed_arguments


def test_spaces_between_special_tokens_either_way(client):
    """vLLM's spaces_between_special_tokens (once refused when false): a decode puts no space between special tokens
    whatever it says (transformers' tokenizers add none, nor vLLM's detokenizer of a fast tokenizer), so both values
    give the special tokens' text joined as it is, whole and streamed."""
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n" + OPEN_THINK
    want = REASONING + CLOSE_THINK + CALL[0] + CALL[1]  # (the last three special tokens, one after another)
    kw = dict(model=NAME, prompt=prompt, max_tokens=4, temperature=0)
    for spaces in (False, True, None):
        extra = {"skip_special_tokens": False, "spaces_between_special_tokens": spaces}
        whole = client.completions.create(extra_body=extra, **kw).choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, extra_body=extra, **kw))
        assert whole == streamed == want, spaces


def test_structured_outputs_backend_switches(client):
    """vLLM's structured_outputs switches (once refused as unknown keys): disable_any_whitespace (JSON is compact here
    always), disable_additional_properties (xgrammar's strict mode: no property the schema does not define, as vLLM's
    xgrammar backend holds either way) and disable_fallback (one backend) are taken, true or false, the reply the
    same as without them; whitespace_pattern stays a 400 naming structured_outputs."""
    schema = Weather.model_json_schema()
    plain = client.chat.completions.create(**ask(extra_body={"structured_outputs": {"json": schema}}))
    text = plain.choices[0].message.content
    assert json.dumps(Weather.model_validate_json(text).model_dump()) == text  # (compact: ", " and ": " only)
    for value in (True, False):
        switches = {"disable_any_whitespace": value, "disable_additional_properties": value, "disable_fallback": value}
        reply = client.chat.completions.create(**ask(extra_body={"structured_outputs": {"json": schema, **switches}}))
        assert reply.choices[0].message.content == text and reply.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**ask(extra_body={"structured_outputs": {"json": schema,
                                                                                "whitespace_pattern": " "}}))
    assert e.value.body["param"] == "structured_outputs" and "whitespace_pattern" in e.value.body["message"]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client):
    """vLLM's truncate_prompt_tokens (once refused): the prompt's last N tokens only, of a string or token ids, a
    chat's rendered messages too (the usage, vLLM's prompt_token_ids and the reply those of the cut prompt sent
    whole); echo shows the cut prompt; -1 keeps as many as leave room for a new token (a prompt longer than the
    context served); 0, more than the context and the Responses API's (which truncates by items) are 400s."""
    ids = {"return_token_ids": True}
    full = client.completions.create(model=NAME, prompt="The weather in Paris: sunny", max_tokens=3, temperature=0,
                                     extra_body=ids).choices[0].prompt_token_ids
    for prompt in ("The weather in Paris: sunny", full):
        cut = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                        extra_body={**ids, "truncate_prompt_tokens": 4})
        sent = client.completions.create(model=NAME, prompt=full[-4:], max_tokens=3, temperature=0, echo=True,
                                         extra_body=ids)
        assert cut.choices[0].prompt_token_ids == full[-4:] and cut.usage.prompt_tokens == 4
        assert cut.choices[0].text == sent.choices[0].text  # (the cut prompt, echoed, then the same reply)
    chat = client.chat.completions.create(**ask(max_tokens=2, extra_body=ids)).model_extra["prompt_token_ids"]
    cut = client.chat.completions.create(**ask(max_tokens=2, extra_body={**ids, "truncate_prompt_tokens": 5}))
    assert cut.model_extra["prompt_token_ids"] == chat[-5:] and cut.usage.prompt_tokens == 5
    too_long = client.completions.create(model=NAME, prompt=[7] * 2100, max_tokens=1,
                                         extra_body={"truncate_prompt_tokens": -1})
    assert too_long.usage.prompt_tokens == 2047 and too_long.choices[0].finish_reason == "length"
    for value in (0, 2049, -2):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=NAME, prompt="x", max_tokens=1, extra_body={"truncate_prompt_tokens": value})
        assert e.value.body["param"] == "truncate_prompt_tokens", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=NAME, input="x", extra_body={"truncate_prompt_tokens": 4})
    assert (e.value.body["param"], e.value.body["code"]) == ("truncate_prompt_tokens", "unsupported_parameter")


def test_best_of_returns_the_n_most_likely_of_its_candidates(client):
    """OpenAI's best_of (once refused above n): best_of candidates per prompt (candidate k sampling with seed + k, as
    n's choices), the n of the highest mean logprob per token returned, best first; usage counts every candidate's
    tokens; best_of below n, or above it in a stream, is a 400 naming best_of. (Compared by their mean logprobs: at
    this temperature most candidates draw from a near-uniform distribution, where a draw may take the neighbouring
    token in another batch: docs/generation.md, Sampling.)"""
    kw = dict(model=NAME, prompt=["<|im_start|>assistant\n" + OPEN_THINK, "Hi" + OPEN_THINK], max_tokens=3,
              temperature=8.0, seed=1, extra_body={"return_token_ids": True, "ignore_eos": True})  # (few follow the chain)
    every = client.completions.create(n=6, logprobs=0, **kw)
    candidates = [sorted(((sum(c.logprobs.token_logprobs) / 3, c.token_ids) for c in every.choices[p:p + 6]),
                         key=lambda m: -m[0]) for p in (0, 6)]
    assert all(best[0][0] > best[2][0] + 10 for best in candidates), candidates  # (some far likelier than others)
    for logprobs in (None, 1):
        best = client.completions.create(n=2, best_of=6, logprobs=logprobs, **kw)
        assert [c.index for c in best.choices] == [0, 1, 2, 3] and best.usage == every.usage
        assert all((c.logprobs is None) == (logprobs is None) for c in best.choices)
        for ranked, returned in zip(candidates, (best.choices[:2], best.choices[2:])):
            assert returned[0].token_ids == ranked[0][1]  # (the likeliest, far above the rest: the same tokens)
            if logprobs is not None:
                means = [sum(c.logprobs.token_logprobs) / 3 for c in returned]
                assert means == pytest.approx([m for m, _ in ranked[:2]], abs=1e-3), (means, ranked)
    same = client.completions.create(n=2, best_of=2, stream=True, **kw)  # (best_of = n: nothing to choose)
    assert {c.choices[0].index for c in same} == {0, 1, 2, 3}
    for extra in (dict(n=3, best_of=2), dict(n=1, best_of=2, stream=True)):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{**kw, **extra})
        assert e.value.body["param"] == "best_of", e.value.body


def test_chat_echo_puts_the_continued_message_before_the_reply(client):
    """vLLM's chat echo (once refused): with continue_final_message the reply's content is the last message's text
    and then the reply, whole and streamed (its text a delta of its own, after the role's), every choice's; where
    the reply does not go on with the last message (a user's: the assistant's turn starts) there is nothing to echo."""
    start = [*USER, {"role": "assistant", "content": [{"type": "text", "text": REASONING}]}]  # (one token)
    going_on = {"add_generation_prompt": False, "continue_final_message": True}
    kw = ask(messages=start, max_tokens=4)
    plain = client.chat.completions.create(**kw, extra_body=going_on).choices[0].message.content
    assert plain == CLOSE_THINK + "".join(CALL[:3]), plain
    for n in (1, 2):
        extra = {**going_on, "echo": True, "n": n}
        whole = client.chat.completions.create(**kw, extra_body=extra)
        assert [c.message.content for c in whole.choices] == [REASONING + plain] * n
        chunks = list(client.chat.completions.create(stream=True, **kw, extra_body=extra))
        assert [c.delta.content for c in chunks[1].choices] == [REASONING] * n
        for i in range(n):
            assert "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices if c.index == i) == \
                REASONING + plain
    turn = client.chat.completions.create(**ask(max_tokens=4, extra_body={"echo": True})).choices[0].message
    assert turn.content == client.chat.completions.create(**ask(max_tokens=4)).choices[0].message.content


def test_every_answer_carries_a_request_id(client):
    """with_raw_response's headers: X-Request-Id on every answer (the openai client's `_request_id`, an error's
    `request_id`; once none), a new one per request, or the client's own echoed (a tracing id, as vLLM echoes it),
    whole, streamed and on a 400."""
    raw = client.chat.completions.with_raw_response.create(**ask(max_tokens=2))
    completion = raw.parse()
    assert raw.headers["x-request-id"] and completion._request_id == raw.headers["x-request-id"]
    other = client.completions.create(model=NAME, prompt="Hi", max_tokens=1)
    assert other._request_id and other._request_id != completion._request_id
    mine = {"X-Request-Id": "trace-7"}
    assert client.models.with_raw_response.retrieve(NAME, extra_headers=mine).headers["x-request-id"] == "trace-7"
    with client.chat.completions.with_streaming_response.create(**ask(max_tokens=2), stream=True,
                                                                extra_headers=mine) as streamed:
        assert streamed.headers["x-request-id"] == "trace-7" and list(streamed.iter_lines())
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", max_tokens=1, suffix="y")
    assert e.value.request_id and e.value.body["param"] == "suffix"


def test_vllm_structural_tags(client):
    """vLLM's structural tags (once 400s: an unknown key of structured_outputs, a response_format type not taken):
    structured_outputs.structural_tag (xgrammar's tag as JSON text) and response_format type "structural_tag" (its
    `format`) hold a chat reply after its reasoning, and a completion, to the tag; vLLM's older form (structures and
    triggers) is taken as the triggered tags it stands for; a tag of neither form is a 400 naming its field."""
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<w>", "end": "</w>", "content": {
        "type": "json_schema", "json_schema": Weather.model_json_schema()}}}

    def held(text):
        assert text.startswith("<w>") and text.endswith("</w>"), text
        return Weather.model_validate_json(text[3:-4])

    for extra in ({"structured_outputs": {"structural_tag": json.dumps(tag)}}, {"response_format": tag}):
        choice = client.chat.completions.create(**ask(extra_body=extra)).choices[0]
        assert choice.finish_reason == "stop" and choice.message.reasoning_content == REASONING
        held(choice.message.content)
        completion = client.completions.create(model=NAME, prompt="The weather:", max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body=extra).choices[0]
        assert completion.finish_reason == "stop" and held(completion.text)
    older = {"type": "structural_tag", "triggers": ["<w>"], "structures": [
        {"begin": "<w>", "schema": Weather.model_json_schema(), "end": "</w>"}]}
    same = {"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<w>"], "tags": [{"type": "tag", "begin": "<w>", "end": "</w>", "content": {
            "type": "json_schema", "json_schema": Weather.model_json_schema()}}]}})}}
    kw = dict(model=NAME, prompt="The weather:", max_tokens=8, temperature=0)
    assert client.completions.create(**kw, extra_body={"response_format": older}).choices[0].text == \
        client.completions.create(**kw, extra_body=same).choices[0].text
    for extra, param in (({"response_format": {"type": "structural_tag"}}, "response_format"),
                         ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs"),
                         ({"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", "format": {
                             "type": "nonsense"}})}}, "structured_outputs")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**kw, extra_body=extra)
        assert e.value.body["param"] == param, e.value.body

"""The OpenAI-compatible server as vLLM's users call it: a real process (tools/serve.py on 127.0.0.1, a free
port, started once for the module, no API key) on a tiny checkpoint whose chat template reads a template
variable (Qwen3's `enable_thinking`), called with the official `openai` client and raw HTTP (httpx).

What test_serve.py does not cover: a max_tokens that overflows the context (400, as vLLM and OpenAI answer; an
unset one is capped), values of the wrong JSON type (400 naming the field, never coerced: `true` is not 1, "5"
is not 5), every optional field of the three endpoints and of the objects they hold sent as null answered as without
it (a required one's null a 400 naming it), the engine's checks answered with the field they are about, OpenAI's and
vLLM's fields this server cannot honour refused by name (never silently ignored) and those that change nothing in a
reply served (user, metadata, store, service_tier, ...), chat roles OpenAI does not have, vLLM's chat template
arguments (chat_template_kwargs, add_generation_prompt, continue_final_message), 405 with Allow, a body that
is not UTF-8, the Prometheus text parsed by prometheus_client with its counters moving, stop strings across
token boundaries (several at once, whole and streamed), streamed text equal to the whole text over sampled
outputs, include_usage's `"usage": null` in every chunk before the usage chunk (OpenAI's; none without it), and
SIGINT with streams in flight (the port freed at once, the process gone within the shutdown timeout), an engine
without a waiting queue (max_waiting=0) serving while a slot is free; text UTF-8 cannot encode (lone surrogates)
answered 400, a seed at the top of its range with n > 1, messages without their content (or a content of no form:
the 400 names the message), an assistant's refusal
parts in the history, HEAD /health, megabytes of prompts that could never be queued refused before any is tokenized;
a body over --max-request-bytes answered 413 as it is read (a chunked one that never ends too), and texts that
cannot fit in the context (a prompt, chat messages, a stop string) refused before they are
tokenized; CORS at its defaults (vLLM's: any origin, method and header), a browser's preflight and the headers
of a cross-origin request, whole and streamed; vLLM's /tokenize (a prompt, messages through the template),
/detokenize and /tokenizer_info against the tokenizer in this process, and their 400s; a `<think>` in a message's
text opening no reasoning block (only the reply's turn does), nor a prompt's open block under a grammar held from the
reply's first token; a past call's arguments sent as "", null or left out reaching a template that iterates them
(Qwen3.5's `arguments|items`) as an empty mapping; the Responses API on a server
without a response store (--responses-store-size 0): store true taken and nothing stored, previous_response_id a 400
saying so. Waits are bounded so that a hang fails fast."""

import json
import re
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_process import port_is_free, running_server
from tokenizer_fixture import CHAT_TEMPLATE, tiny_checkpoint

NAME = "tiny-compat"
ALIAS = "org/tiny-compat"  # the server's second name (vLLM's --served-model-name NAME ALIAS)
MAX_CONTEXT = 512
SLOTS = 8
SHUTDOWN_S = 2
MAX_REQUEST_BYTES = 3 * 1024 * 1024
TIMEOUT = 120
# an assistant's past calls as Qwen3.5's template writes them: each argument of a call whose `arguments` is defined
# through `arguments|items`, unguarded (a string or null there raises); where chat_template_kwargs set
# `string_arguments`, a string written as it is, as Qwen3's template does
CALLS = ("{% for call in message.tool_calls or [] %}{% set call = call.function if call.function is defined else call %}"
         "<tool_call>{{ call.name }}{% if call.arguments is string and string_arguments is defined %} {{ call.arguments }}"
         "{% elif call.arguments is defined %}{% for name, value in call.arguments|items %}"
         " {{ name }}={{ value }}{% endfor %}{% endif %}</tool_call>{% endfor %}")
# Qwen3's switch: a chat template variable that only chat_template_kwargs sets; a line of reasoning_effort, the
# variable gpt-oss's templates read, which vLLM sets from OpenAI's field of that name; vLLM's RAG documents
THINKING_TEMPLATE = ("{% if reasoning_effort is defined and reasoning_effort %}<|im_start|>system\nReasoning: "
                     "{{ reasoning_effort }}<|im_end|>\n{% endif %}{% for d in documents or [] %}<|im_start|>system\n"
                     "{{ d.title }}: {{ d.text }}<|im_end|>\n{% endfor %}"
                     + CHAT_TEMPLATE.replace("{{ message['content'] }}", "{{ message['content'] }}" + CALLS)
                     + "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = THINKING_TEMPLATE
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    flags = ["--served-model-name", NAME, ALIAS, "--num-slots", str(SLOTS), "--max-context", str(MAX_CONTEXT),
             "--token-budget", "128", "--max-waiting", "32", "--shutdown-timeout", str(SHUTDOWN_S),
             "--max-request-bytes", str(MAX_REQUEST_BYTES), "--enable-tokenizer-info-endpoint", "--responses-store-size",
             "0"]
    with running_server(checkpoint, tmp_path_factory.mktemp("server"), flags, TIMEOUT) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def _post(server, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        kw = {"content": body, "headers": {"Content-Type": "application/json"}}
    else:
        kw = {"json": body}
    return httpx.post(server.url + path, timeout=TIMEOUT, **kw)


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


CHAT = [{"role": "user", "content": "Hello world!"}]


def test_cors_defaults_answer_any_origin(server):
    """No CORS flags: vLLM's defaults, every origin, method and header; a preflight (OPTIONS, which the
    endpoints do not take: 405 without CORS) is 200 with the Access-Control headers, and a cross-origin POST's
    answer (a stream's too) carries Access-Control-Allow-Origin, so a page's fetch() can read it."""
    origin = "http://localhost:3000"
    r = httpx.options(server.url + "/v1/chat/completions", timeout=TIMEOUT,
                      headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                               "Access-Control-Request-Headers": "content-type, authorization, x-stainless-os"})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "*", r.headers
    assert "POST" in r.headers["access-control-allow-methods"], r.headers
    assert "x-stainless-os" in r.headers["access-control-allow-headers"], r.headers
    assert "access-control-allow-credentials" not in r.headers  # --allow-credentials: off by default
    body = {"model": NAME, "messages": CHAT, "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Origin": origin}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*", r.headers
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body | {"stream": True},
                      headers={"Origin": origin}, timeout=TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*", r.headers
        assert r.read().decode().rstrip().endswith("data: [DONE]")
    for path in ("/health", "/v1/models"):
        assert httpx.get(server.url + path, headers={"Origin": origin}).headers["access-control-allow-origin"] == "*"
    assert httpx.options(server.url + "/v1/chat/completions").status_code == 405  # not a preflight: as before


def test_max_tokens_over_the_context_is_400_and_an_unset_one_is_capped(server, client):
    prompt = [1 + i % 300 for i in range(500)]  # 500 tokens: 12 new ones fit
    for path, body, param in (("/v1/completions", {"prompt": prompt, "max_tokens": 13}, "max_tokens"),
                              ("/v1/completions", {"prompt": [[1, 2], prompt], "max_tokens": 13}, "max_tokens"),
                              ("/v1/chat/completions", {"messages": CHAT, "max_tokens": MAX_CONTEXT}, "max_tokens"),
                              ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": MAX_CONTEXT},
                               "max_completion_tokens")):
        error = _error(_post(server, path, body))
        assert (error["param"], error["code"]) == (param, "context_length_exceeded"), error
        assert str(MAX_CONTEXT) in error["message"], error
    fits = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, extra_body={"ignore_eos": True})
    assert fits.usage.completion_tokens == 12 and fits.choices[0].finish_reason == "length"
    capped = client.completions.create(model=NAME, prompt=(prompt * 2)[:MAX_CONTEXT - 3],  # the default max_tokens: 16
                                       extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == 3 and capped.choices[0].finish_reason == "length"


WRONG_TYPES = [  # (body, param): JSON values of another type than the field's, each refused
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "temperature": "0.5"}, "temperature"),
    ({"prompt": "x", "temperature": False}, "temperature"),
    ({"prompt": "x", "top_p": "1"}, "top_p"),
    ({"prompt": "x", "top_k": True}, "top_k"),
    ({"prompt": "x", "seed": "7"}, "seed"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream": 1}, "stream"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"prompt": "x", "ignore_eos": "no"}, "ignore_eos"),
    ({"prompt": "x", "echo": 0}, "echo"),
    ({"prompt": "x", "logprobs": False}, "logprobs"),
    ({"prompt": "x", "min_tokens": 1.0}, "min_tokens"),
]


@pytest.mark.parametrize("body, param", WRONG_TYPES, ids=[p for _, p in WRONG_TYPES])
def test_a_value_of_the_wrong_type_is_400_naming_its_field(server, body, param):
    error = _error(_post(server, "/v1/completions", body))
    assert error["param"] == param, error


ENGINE_CHECKS = [  # (body, param): what the engine would refuse, answered with the field it is about
    ({"prompt": "x", "stop": ""}, "stop"),
    ({"prompt": "x", "stop": ["a", ""]}, "stop"),
    ({"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "seed": -2**63 - 1}, "seed"),
    (b'{"prompt": "x", "temperature": Infinity}', "temperature"),
    (b'{"prompt": "x", "temperature": NaN}', "temperature"),
]


@pytest.mark.parametrize("body, param", ENGINE_CHECKS, ids=[p for _, p in ENGINE_CHECKS])
def test_an_engine_check_names_its_field(server, body, param):
    error = _error(_post(server, "/v1/completions", body))
    assert error["param"] == param, error


UNSUPPORTED = [  # (path, field, value): OpenAI's and vLLM's fields the engine cannot honour
    ("/v1/completions", "use_beam_search", True),
    ("/v1/completions", "bad_words", ["the"]),
    ("/v1/completions", "allowed_token_ids", [1, 2]),
    ("/v1/completions", "length_penalty", 0.5),
    ("/v1/chat/completions", "logits_processors", ["a"]),
    ("/v1/completions", "guided_whitespace_pattern", "\\n"),  # (once accepted and ignored)
    ("/v1/chat/completions", "chat_template", "{{ 'x' }}"),  # (once ignored: the server's template rendered)
    ("/v1/chat/completions", "priority", 5),  # (these four once accepted and ignored)
    ("/v1/completions", "cache_salt", "a-tenant's salt"),  # (the prefix cache not kept apart as it asks)
    ("/v1/completions", "kv_transfer_params", {"do_remote_decode": True}),
    ("/v1/chat/completions", "vllm_xargs", {"a": 1}),
    ("/v1/chat/completions", "thinking_token_budget", 64),  # (once accepted and ignored: the reasoning ran on)
    ("/v1/completions", "thinking_token_budget", 64),
    ("/v1/chat/completions", "verbosity", "low"),  # (these four OpenAI's, once accepted and ignored: a reply of
    ("/v1/chat/completions", "modalities", ["text", "audio"]),  # the one verbosity, text only, no web search)
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "web_search_options", {}),
]


@pytest.mark.parametrize("path, field, value", UNSUPPORTED,
                         ids=[f"{'chat' if 'chat' in p else 'completions'}-{f}" for p, f, _ in UNSUPPORTED])
def test_a_field_this_server_cannot_honour_is_refused_by_name(server, path, field, value):
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": CHAT}
    error = _error(_post(server, path, {**body, field: value, "max_tokens": 1}))
    assert (error["param"], error["code"]) == (field, "unsupported_parameter"), error
    assert f"(got {value!r})" in error["message"] and "leave it unset" in error["message"], error


def test_those_fields_at_their_neutral_values_are_served(server):
    neutral = {"min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "use_beam_search": False,
               "include_stop_str_in_output": False, "skip_special_tokens": True, "logprobs": None,
               "presence_penalty": None, "frequency_penalty": 0, "logit_bias": {}, "prompt_logprobs": None}
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, **neutral})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
    r = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "logprobs": False,
                                               "top_logprobs": 0, "response_format": {"type": "text"}, "echo": False,
                                               "chat_template": None, "priority": 0, "cache_salt": None,
                                               "vllm_xargs": {}, "verbosity": "medium", "modalities": ["text"]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text


def test_fields_that_change_nothing_in_a_reply_are_served(client):
    """What agent frameworks send that asks for nothing the reply shows (the Agents SDK's ModelSettings metadata, store
    and prompt_cache_retention, pydantic-ai's openai_user / openai_store / openai_prediction, LangChain's service_tier)
    is taken and changes nothing, on both endpoints (never to be refused as NEUTRAL's fields are)."""
    kept = dict(user="u-1", metadata={"run": "7"}, store=True, service_tier="auto", prompt_cache_key="k",
                prompt_cache_retention="24h", safety_identifier="s-1")
    plain = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=4, seed=3)
    chat = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=4, seed=3, **kept,
                                          prediction={"type": "content", "content": "Hello"})
    assert chat.choices[0].message.content == plain.choices[0].message.content
    response = client.responses.create(model=NAME, input=CHAT, max_output_tokens=4, temperature=0,
                                       **{k: v for k, v in kept.items() if k != "store"})
    assert response.metadata == {"run": "7"} and response.user == "u-1" and response.usage.output_tokens == 4


def test_null_for_a_field_openai_makes_nullable_is_its_default(server, client):
    # clients that write every field they know send null for those left unset (OpenAI's and vLLM's null: default)
    nulls = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=4, seed=3, n=None, temperature=None,
                                           top_p=None, extra_body={"top_k": None, "stream": None})
    unset = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=4, seed=3)
    assert len(nulls.choices) == 1 and nulls.choices[0].message.content == unset.choices[0].message.content
    body = {"prompt": "x", "max_tokens": 2, "seed": 3}
    r = _post(server, "/v1/completions", {**body, "n": None, "temperature": None, "top_p": None, "echo": None,
                                          "stream": None, "top_k": None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == _post(server, "/v1/completions", body).json()["choices"][0]["text"]


def _optional_fields(model, client_params) -> list[str]:
    """The top-level fields a client may leave unset: the official client's parameters of the endpoint (what clients
    that write every field they know send, as null where unset) and the request model's optional fields (vLLM's
    extensions among them), less the required ones."""
    import typing

    names = set(typing.get_type_hints(client_params)) | {f.alias or name for name, f in model.model_fields.items()
                                                         if not f.is_required()}
    return sorted(names - {name for name, f in model.model_fields.items() if f.is_required()})


def _null_cases():
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params
    from openai.types.responses import response_create_params

    from metrale_graph.server.protocol import ChatCompletionRequest, CompletionRequest
    from metrale_graph.server.responses_api_protocol import ResponsesRequest

    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    schema = {"type": "json_schema", "json_schema": {"name": "yes_no", "schema": {"type": "boolean"}}}
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "u"},
               {"role": "assistant", "content": "Hello"}, {"role": "tool", "content": "20C", "tool_call_id": "c1"},
               {"role": "user", "content": "Bye"}]
    # (endpoint, the null's path in the body, what the body holds besides the base's): nested objects' optional fields
    nested = [("chat", ("stream_options", "include_usage"), {"stream": True, "stream_options": {}}),
              ("chat", ("stream_options", "continuous_usage_stats"), usage),
              ("completions", ("stream_options", "include_usage"), {"stream": True, "stream_options": {}}),
              ("completions", ("stream_options", "continuous_usage_stats"), usage),
              ("chat", ("response_format", "json_schema"), {"response_format": {"type": "json_object"}}),
              *[("chat", ("response_format", "json_schema", name), {"response_format": schema})
                for name in ("description", "strict")],
              *[(kind, ("structured_outputs", name), {"structured_outputs": {"regex": "[ab]+"}})
                for kind in ("chat", "completions") for name in ("json", "choice", "grammar", "json_object",
                                                                  "structural_tag", "disable_any_whitespace",
                                                                  "disable_additional_properties", "disable_fallback",
                                                                  "whitespace_pattern")],
              ("chat", ("structured_outputs", "regex"), {"structured_outputs": {"choice": ["ab", "ba"]}}),
              *[("chat", ("tools", 0, "function", name), {"tools": [tool]}) for name in ("description", "strict")],
              ("chat", ("tools", 0, "function", "parameters"), {"tools": [{**tool, "function": {"name": "weather"}}]}),
              ("chat", ("tool_choice",), {"tools": [tool]}),
              ("chat", ("parallel_tool_calls",), {"tools": [tool]}),
              *[("chat", ("messages", i, name), {"messages": history})
                for i, name in ((1, "name"), (3, "tool_call_id"), (2, "tool_calls"), (2, "function_call"),
                                (2, "refusal"), (2, "audio"), (2, "reasoning_content"), (2, "reasoning"), (2, "name"))],
              ("responses", ("stream_options", "include_obfuscation"), {"stream": True, "stream_options": {}}),
              ("responses", ("text", "format"), {"text": {}}),
              ("responses", ("text", "verbosity"), {"text": {}}),
              *[("responses", ("text", "format", name), {"text": {"format": {"type": "json_schema", "name": "yes_no",
                                                                             "schema": {"type": "boolean"}}}})
                for name in ("description", "strict")],
              *[("responses", ("reasoning", name), {"reasoning": {}}) for name in ("effort", "summary",
                                                                                     "generate_summary")],
              *[("responses", ("tools", 0, name), {"tools": [{"type": "function", "name": "weather"}]})
                for name in ("description", "parameters", "strict")],
              *[("responses", ("input", 0, name), {"input": [{"role": "user", "content": "Hello world!"}]})
                for name in ("type", "id", "status")]]
    top = [(kind, (name,), {}) for kind, model, params in (
        ("chat", ChatCompletionRequest, chat_create_params.CompletionCreateParamsBase),
        ("completions", CompletionRequest, completion_create_params.CompletionCreateParamsBase),
        ("responses", ResponsesRequest, response_create_params.ResponseCreateParamsBase))
        for name in _optional_fields(model, params)
        # completions' max_tokens: null is no limit but the context's (vLLM's), unset OpenAI's 16
        if (kind, name) != ("completions", "max_tokens")]
    return top + nested


NULL_BASES = {"chat": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
              "completions": ("/v1/completions", {"prompt": "Hello world!", "max_tokens": 2}),
              "responses": ("/v1/responses", {"input": "Hello world!", "max_output_tokens": 2})}
NULL_CASES = _null_cases()
# keys of an answer that differ between two runs of one request
VOLATILE = {"id", "created", "created_at", "item_id", "response_id", "system_fingerprint"}


def _answer_of(r: httpx.Response):
    """An answer's JSON (a stream's: its events' list), its volatile keys left out."""
    def kept(value):
        if isinstance(value, dict):
            return {k: kept(v) for k, v in value.items() if k not in VOLATILE}
        return [kept(v) for v in value] if isinstance(value, list) else value
    assert r.status_code == 200, r.text
    if r.headers["content-type"].startswith("text/event-stream"):
        return [kept(json.loads(line[6:])) for line in r.text.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"]
    return kept(r.json())


@pytest.mark.parametrize("kind, where, extra", NULL_CASES, ids=[f"{k}-{'.'.join(map(str, w))}" for k, w, _ in NULL_CASES])
def test_null_for_an_optional_field_is_its_default(server, kind, where, extra):
    """Every optional field of the three endpoints, and of the objects they hold (stream_options, response_format,
    structured_outputs, tools, messages, text, reasoning, input items), sent as null: the answer is the one without the
    field (LiteLLM, LangChain and hand-written clients send null for what they leave unset; OpenAI's API and vLLM take
    it as the default). Seeded sampling, or greedy where the field is the seed, so that the answers match."""
    path, base = NULL_BASES[kind]
    body = json.loads(json.dumps({**base, "seed": 3, **extra}))
    if where == ("seed",):
        body = {**base, "temperature": 0, **extra}
    if where[0] in ("max_tokens", "max_completion_tokens") and kind == "chat":  # (the other one bounds the reply)
        body = {**{k: v for k, v in body.items() if k != "max_tokens"}, "max_completion_tokens" if where[0] ==
                "max_tokens" else "max_tokens": 2}
    if where == ("max_output_tokens",):  # (a grammar ends the reply)
        body = {**{k: v for k, v in body.items() if k != "max_output_tokens"}, "structured_outputs": {"regex": "ab"}}
    parent = body
    for key in where[:-1]:
        parent = parent[key]
    parent.pop(where[-1], None)
    unset = _answer_of(_post(server, path, body))
    parent[where[-1]] = None
    assert _answer_of(_post(server, path, body)) == unset


REQUIRED_NULLS = [  # (path, body, field): a required field sent as null is no default: 400 naming it
    ("/v1/chat/completions", {"messages": None}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": None, "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages.0"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": None}}, "response_format.type"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": None, "schema": {}}}}, "response_format.json_schema.name"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": None}}]},
     "tools.0.function.name"),
    # (the tag of chat's tool union, "function", before the key of that name: once 'tools.0.function.function')
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": None}]}, "tools.0.function"),
    ("/v1/completions", {"prompt": None}, "prompt"),
    ("/v1/responses", {"input": None}, "input"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function", "name": None}]}, "tools.0.name"),
]


@pytest.mark.parametrize("path, body, field", REQUIRED_NULLS, ids=[f for _, _, f in REQUIRED_NULLS])
def test_null_for_a_required_field_is_400_naming_it(server, path, body, field):
    """(param: the request's field; the message begins with the path to the value inside it)"""
    error = _error(_post(server, path, {**body, "max_tokens": 1}))
    assert error["param"] == field.split(".")[0] and error["message"].startswith(field + ":"), error


def test_null_for_an_optional_field_of_tokenize_is_its_default(server):
    """vLLM's /tokenize takes null for its optional fields too (a prompt's and messages')."""
    for body, names in (({"prompt": "Hello world!"}, ("model", "add_special_tokens", "return_token_strs")),
                        ({"messages": CHAT}, ("model", "tools", "add_generation_prompt", "continue_final_message",
                                              "chat_template_kwargs", "add_special_tokens", "return_token_strs"))):
        unset = _post(server, "/tokenize", body)
        assert unset.status_code == 200, unset.text
        for name in names:
            assert _post(server, "/tokenize", {**body, name: None}).json() == unset.json(), name


def test_a_messages_keys_sent_as_null_are_left_out_of_the_templates_message():
    """A message's other keys sent as null (LiteLLM's and LangChain's `"tool_calls": null`, `"name": null`) reach the
    template as keys left out, as vLLM builds a message of the keys set: a template that iterates `message.tool_calls`
    where it is defined (Llama 3.1's `'tool_calls' in message`) raised on null."""
    from metrale_graph.server.protocol import ChatMessage

    message = ChatMessage.model_validate({"role": "assistant", "content": "Hi", "tool_calls": None, "name": None,
                                          "function_call": None, "reasoning_content": None, "refusal": None})
    assert message.template_dict() == {"role": "assistant", "content": "Hi"}


def test_stream_options_that_set_nothing_are_taken_without_a_stream(server):
    """stream_options {} or of nulls alone ask for nothing, so they are taken without stream, as vLLM takes them (its
    check is the object's truth); one that asks for something is still a 400 naming it."""
    for options in ({}, {"include_usage": None}, {"include_usage": None, "continuous_usage_stats": None}):
        for path, body in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "x"})):
            r = _post(server, path, {**body, "max_tokens": 1, "stream_options": options, "stream": None})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
    error = _error(_post(server, "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": False}}))
    assert error["param"] == "stream_options" and "stream: true" in error["message"], error


def test_a_role_openai_does_not_have_is_400(server, client):
    error = _error(_post(server, "/v1/chat/completions",
                         {"messages": [{"role": "wizard", "content": "x"}], "max_tokens": 1}))
    assert error["param"] == "messages" and "wizard" in error["message"], error
    roles = [{"role": r, "content": "x"} for r in ("system", "developer", "user", "assistant", "tool")]
    assert client.chat.completions.create(model=NAME, messages=roles, max_tokens=1).usage.completion_tokens == 1


def _chat_prompt(tokenizer, messages, **kw) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_chat_template_arguments_reach_the_template(client, tokenizer):
    turns = [{"role": "user", "content": "Hello world!"}, {"role": "assistant", "content": "Hi"},
             {"role": "user", "content": "How are you?"}]

    def prompt_tokens(messages=turns, **extra_body):
        out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=1, extra_body=extra_body)
        return out.usage.prompt_tokens

    plain = prompt_tokens()
    assert plain == _chat_prompt(tokenizer, turns, add_generation_prompt=True)
    off = prompt_tokens(chat_template_kwargs={"enable_thinking": False})
    assert off == _chat_prompt(tokenizer, turns, add_generation_prompt=True, enable_thinking=False) > plain
    assert prompt_tokens(add_generation_prompt=False) == _chat_prompt(tokenizer, turns) < plain
    partial = turns + [{"role": "assistant", "content": "I am"}]
    assert prompt_tokens(partial, add_generation_prompt=False, continue_final_message=True) == _chat_prompt(
        tokenizer, partial, continue_final_message=True)
    with pytest.raises(openai.BadRequestError) as e:  # both at once: vLLM's 400
        prompt_tokens(partial, continue_final_message=True)
    assert e.value.body["param"] == "continue_final_message"
    with pytest.raises(openai.BadRequestError) as e:  # the server's own arguments stay its own
        prompt_tokens(chat_template_kwargs={"tokenize": True})
    assert e.value.body["param"] == "chat_template_kwargs"
    # OpenAI's reasoning_effort is the template's variable of that name (vLLM's way), unless chat_template_kwargs sets it
    def rendered(effort):
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, reasoning_effort=effort)
        return tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(effort, **extra_body):
        return client.chat.completions.create(model=NAME, messages=turns, max_tokens=1, reasoning_effort=effort,
                                              extra_body={"return_token_ids": True, **extra_body}).prompt_token_ids
    assert prompt_ids("high") == rendered("high") != rendered("low") and len(rendered("high")) > plain
    assert prompt_ids("high", chat_template_kwargs={"reasoning_effort": "low"}) == rendered("low")
    response = client.responses.create(model=NAME, input=turns, max_output_tokens=1, reasoning={"effort": "high"})
    assert response.usage.input_tokens == len(rendered("high"))  # (the Responses API's reasoning.effort alike)
    response = client.responses.create(model=NAME, input=turns, max_output_tokens=1, reasoning={"effort": "high"},
                                       extra_body={"chat_template_kwargs": {"reasoning_effort": "low"}})
    assert response.usage.input_tokens == len(rendered("low"))  # (and its chat_template_kwargs, as chat's)
    response = client.responses.create(model=NAME, input=turns, max_output_tokens=1,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert response.usage.input_tokens == off
    docs = [{"title": "Weather", "text": "Sunny in Paris."}]  # vLLM's documents: the template's, as they are
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, documents=docs)
    assert prompt_ids(None, documents=docs) == tokenizer.encode(text, add_special_tokens=False) != rendered(None)


def test_a_think_tag_in_a_messages_text_opens_no_reasoning(client):
    """This template's `</think>` turns the reasoning parser on and its generation prompt opens no block: a user's
    text that mentions `<think>` leaves the reply content (it was all reasoning, content None), whole and streamed,
    while an assistant message continued after its own open `<think>` is reasoning (usage's reasoning_tokens its new
    tokens, as the model wrote them). A grammar held from the reply's
    first token (this tokenizer has no one token that ends the reasoning, where it would start) makes it content,
    and a forced call a call (it was reasoning: no tool_calls, finish_reason "stop")."""
    asked = [{"role": "user", "content": "What does the <think> tag do?"}]
    reply = client.chat.completions.create(model=NAME, messages=asked, max_tokens=8, temperature=0).choices[0].message
    assert reply.content and reply.reasoning_content is None
    deltas = [c.choices[0].delta for c in client.chat.completions.create(
        model=NAME, messages=asked, max_tokens=8, temperature=0, stream=True) if c.choices]
    assert "".join(d.content or "" for d in deltas) == reply.content
    assert not any(getattr(d, "reasoning_content", None) for d in deltas)
    thinking = asked + [{"role": "assistant", "content": "<think>\nThe user asks"}]
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    whole = client.chat.completions.create(model=NAME, messages=thinking, max_tokens=8, temperature=0,
                                           extra_body=continued)
    reply = whole.choices[0].message
    assert reply.reasoning_content and reply.content is None
    # every new token is the reasoning's, counted as the model wrote them (its text encoded again was more: a byte
    # token of a cut character is U+FFFD, three bytes), whole and streamed
    last = list(client.chat.completions.create(model=NAME, messages=thinking, max_tokens=8, temperature=0, stream=True,
                                               stream_options={"include_usage": True}, extra_body=continued))[-1]
    for usage in (whole.usage, last.usage):
        assert usage.completion_tokens_details.reasoning_tokens == usage.completion_tokens == 8, usage
    pytest.importorskip("xgrammar")
    opened = asked + [{"role": "assistant", "content": "<think>\n"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": False}}}
    reply = client.chat.completions.create(model=NAME, messages=opened, max_tokens=16, temperature=0, seed=1,
                                           response_format=fmt, extra_body=continued).choices[0].message
    assert json.loads(reply.content)["n"] in range(10) and reply.reasoning_content is None
    tool = {"type": "function", "function": {"name": "pick", "parameters": fmt["json_schema"]["schema"]}}
    choice = client.chat.completions.create(model=NAME, messages=opened, max_tokens=64, temperature=0, seed=1,
                                            tools=[tool], tool_choice="required", parallel_tool_calls=False,
                                            extra_body=continued).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "pick"


def test_405_names_the_allowed_methods_and_a_body_that_is_not_utf8_is_400(server):
    r = httpx.get(server.url + "/v1/completions")
    assert _error(r, 405)["code"] == "method_not_allowed" and r.headers["allow"] == "POST"
    r = httpx.delete(server.url + "/v1/models")
    assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"
    error = _error(_post(server, "/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 1}'))
    assert error["code"] == "invalid_json" and "UTF-8" in error["message"], error


def test_an_empty_body_is_400_saying_it_is_empty(server):
    """No body (curl -X POST without -d; an empty one with its JSON type) was 400 "the request body must be a JSON
    object: Field required", naming no field there is: it says the body is empty, on every POST endpoint. JSON's
    null is a body: not an object, as before."""
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"):
        for headers in ({"Content-Type": "application/json"}, {}):
            error = _error(httpx.post(server.url + path, headers=headers, timeout=10))
            assert error["message"].startswith("the request body is empty: send a JSON object"), (path, error)
            assert (error["param"], error["code"]) == (None, "invalid_json"), error
    error = _error(_post(server, "/v1/completions", b"null"))
    assert "empty" not in error["message"] and "must be a JSON object" in error["message"], error


def _metric_values(server) -> dict:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return values


def test_metrics_parse_as_prometheus_text_and_counters_move(server, client):
    before = _metric_values(server)
    out = client.completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=5, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5
    after = _metric_values(server)
    assert after["metrale_prompt_tokens_total"] == before["metrale_prompt_tokens_total"] + 3
    assert after["metrale_generation_tokens_total"] == before["metrale_generation_tokens_total"] + 5
    key = "metrale_request_finished_total{finished_reason=length}"
    assert after[key] == before[key] + 1
    assert after["metrale_time_to_first_token_seconds_count"] == before["metrale_time_to_first_token_seconds_count"] + 1
    assert after["metrale_engine_steps_total"] >= before["metrale_engine_steps_total"] + 5
    assert after["metrale_slots_total"] == SLOTS and after["metrale_num_requests_running"] == 0


def test_stop_strings_across_token_boundaries_whole_and_streamed(client, tokenizer):
    prompt = "Hello world! How"
    free = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    text, ids = free.text, free.token_ids
    ends = [len(tokenizer.decode(ids[:k])) for k in range(1, len(ids))]
    across = [text[e - 1:e + 1] for e in ends if 1 <= e < len(text) - 1 and "\ufffd" not in text[e - 1:e + 1]]
    assert len(across) >= 3, (text, ends)
    for stop in ([across[0]], [across[2], across[1]], [across[-1], "never in the text \u00e9"]):
        cut = min(text.find(s) for s in stop if s in text)
        kw = dict(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stop=stop, extra_body={"ignore_eos": True})
        whole = client.completions.create(**kw)
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert whole.choices[0].text == streamed == text[:cut], (stop, text)
        assert whole.choices[0].finish_reason == "stop" and chunks[-2].choices[0].finish_reason == "stop"
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        matched = next(s for s in stop if text.find(s) == cut)  # vLLM's stop_reason: the stop string that matched
        assert whole.choices[0].stop_reason == chunks[-2].choices[0].stop_reason == matched
    chat = dict(model=NAME, messages=CHAT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    said = client.chat.completions.create(**chat).choices[0].message.content
    stop = said[3:5]
    for c in (client.chat.completions.create(**chat, stop=[stop]).choices[0],
              list(client.chat.completions.create(**chat, stop=[stop], stream=True))[-1].choices[0]):
        assert (c.finish_reason, c.stop_reason) == ("stop", stop), said


def test_streamed_text_equals_the_whole_text_when_sampling(client):
    for seed in range(3):
        for prompt in ("東京は日本の首都", "Emoji: 👋🌍"):
            kw = dict(model=NAME, prompt=prompt, max_tokens=20, temperature=1.0, seed=seed,
                      extra_body={"ignore_eos": True})
            whole = client.completions.create(**kw).choices[0].text
            pieces = [c.choices[0].text for c in client.completions.create(**kw, stream=True)]
            assert "".join(pieces) == whole, (seed, prompt, pieces)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_event(client):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every event of a completions and of a chat
    stream (n 2, its tokens counted over both choices) carries the usage so far: the prompt's tokens, the tokens
    sent so far (never fewer than the events with text have sent), the last event's the whole usage."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    kw = dict(model=NAME, max_tokens=4, n=2, temperature=0, stream=True, stream_options=options,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    for chunks in (list(client.completions.create(prompt="Hello world", **kw)),
                   list(client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **kw))):
        assert all(c.usage is not None for c in chunks)
        prompt, sent = chunks[-1].usage.prompt_tokens, 0
        for c in chunks:
            sent += sum(len(getattr(choice, "token_ids", None) or []) for choice in c.choices)
            assert c.usage.prompt_tokens == prompt and c.usage.completion_tokens >= sent
            assert c.usage.total_tokens == prompt + c.usage.completion_tokens
        assert sent == chunks[-1].usage.completion_tokens == 8 and chunks[-1].choices == []
    plain = list(client.completions.create(prompt="Hello world", **{**kw, "stream_options": {"include_usage": True}}))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def _stream_events(server, path: str, body: dict) -> list[dict]:
    r = _post(server, path, {"stream": True, **body})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hello world", "n": 2}),
    ("/v1/completions", {"prompt": "Hello world", "prompt_logprobs": 1, "echo": True, "logprobs": 1}),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2, "prompt_logprobs": 1}),
    ("/v1/chat/completions", {"messages": [*CHAT, {"role": "assistant", "content": "Sure"}], "echo": True,
                              "continue_final_message": True, "add_generation_prompt": False}),
])
def test_include_usage_writes_a_null_usage_in_every_chunk_before_the_last(server, path, body):
    """stream_options.include_usage: every chunk before the usage chunk carries "usage": null, as OpenAI's do ("All
    other chunks will also include a usage field, but with a null value": clients that read a chunk's usage key,
    as LiteLLM's users do, find it; vLLM leaves it out), the last one (no choices) the usage; without include_usage
    no chunk has the key; with continuous_usage_stats every chunk has the usage so far."""
    body = {"model": NAME, "max_tokens": 3, "temperature": 0, **body}
    usage = _stream_events(server, path, {**body, "stream_options": {"include_usage": True}})
    assert len(usage) > 3 and all("usage" in e and e["usage"] is None for e in usage[:-1]), usage
    assert usage[-1]["choices"] == [] and usage[-1]["usage"]["completion_tokens"] == 3 * body.get("n", 1)
    for options in (None, {"include_usage": False}):
        assert not any("usage" in e for e in _stream_events(server, path, {**body, "stream_options": options}))
    continuous = {"include_usage": True, "continuous_usage_stats": True}
    assert all(e["usage"]["prompt_tokens"] > 0 for e in _stream_events(server, path, {**body, "stream_options": continuous}))


SURROGATES = [  # (path, body, param): JSON's \ud800 escapes carry lone UTF-16 surrogates UTF-8 cannot encode
    ("/v1/completions", b'{"prompt": "hi \\ud800", "max_tokens": 1}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 1}', "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud83d"], "max_tokens": 1}', "stop"),
    ("/v1/completions", b'{"prompt": "hi \\ud800", "max_tokens": 1, "stream": true}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 1}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udc00"}]}]}',
     "messages"),
]


@pytest.mark.parametrize("path, body, param", SURROGATES, ids=[f"{p.split('/')[-1]}-{i}" for i, (p, _, _) in
                                                               enumerate(SURROGATES)])
def test_a_lone_surrogate_is_400_naming_its_field(server, path, body, param):
    error = _error(_post(server, path, body))
    assert error["param"] == param and "surrogate" in error["message"], error


def test_a_seed_at_the_top_of_its_range_serves_every_choice(client):
    """Choice k samples with seed + k, wrapped past 2**64 - 1: a valid seed is valid for every choice, and
    the choices stay reproducible."""
    kw = dict(model=NAME, prompt="a", max_tokens=4, temperature=1.0, n=3, seed=2**64 - 1)
    first = [c.text for c in client.completions.create(**kw).choices]
    assert [c.text for c in client.completions.create(**kw).choices] == first


def test_messages_need_their_content_but_an_assistants(server, client):
    error = _error(_post(server, "/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": 1}))
    assert error["param"] == "messages" and "needs its content" in error["message"], error
    # the check's own words after the field, without pydantic's "Value error, " before them
    assert error["message"].startswith("messages.0: a user message needs its content"), error
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}, {"role": "user", "content": "y"}]
    assert client.chat.completions.create(model=NAME, messages=messages, max_tokens=1).usage.completion_tokens == 1


def test_a_content_of_no_form_names_its_message(server):
    """A message's content that is neither a string nor a list of parts (a tool's result sent as a JSON object, not
    its text) is a 400 naming that message's content, as every other message error names its message (it said
    "messages: expected ...", which message unsaid); chat's and /tokenize's alike."""
    call = {"id": "c_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c_1", "content": {"temperature": 21}}]
    for path in ("/v1/chat/completions", "/tokenize"):
        error = _error(_post(server, path, {"messages": messages}))
        assert error["param"] == "messages", (path, error)
        assert error["message"].startswith(f"messages.{len(CHAT) + 1}.content: expected a string or a list of text "
                                           "parts"), (path, error)
        assert error["message"].endswith("got {'temperature': 21}"), (path, error)


def test_a_developer_message_is_a_system_message_to_the_template(client, tokenizer):
    """OpenAI's developer role reaches the chat template as system (Qwen's template raised "Unexpected message
    role" on it): the prompt is the system message's."""
    def prompt_ids(role):
        r = client.chat.completions.create(model=NAME, messages=[{"role": role, "content": "Be brief."}, *CHAT],
                                           max_tokens=1, extra_body={"return_token_ids": True})
        return r.prompt_token_ids
    assert prompt_ids("developer") == prompt_ids("system")


def test_tool_call_arguments_sent_as_json_strings_reach_the_template_as_mappings():
    """OpenAI's wire format carries a tool call's function.arguments as a JSON string; Qwen's template iterates
    `arguments|items` and raised on it (a 400 for every agent loop). The template gets the parsed object; an
    argument string that is not a JSON object stays as it was."""
    from metrale_graph.server.protocol import ChatMessage

    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    message = ChatMessage(role="assistant", content=None, tool_calls=[call, {**call, "function": {
        "name": "f", "arguments": "[1, 2]"}}, {**call, "function": {"name": "g", "arguments": "not json"}}])
    calls = message.template_dict()["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"city": "Paris"} and calls[0]["id"] == "c1"
    assert [c["function"]["arguments"] for c in calls[1:]] == ["[1, 2]", "not json"]
    assert call["function"]["arguments"] == '{"city": "Paris"}'  # the request's own message is not changed


def test_a_past_call_sent_without_arguments_reaches_the_template_with_none(server, tokenizer):
    """A past call's function.arguments sent as "" or null, or left out (a call of a function without parameters, as
    some clients and other providers write it), reaches the template as an empty mapping, as vLLM reads it ("if
    arguments is None or empty string, set to {}"): Qwen3.5's template iterates `arguments|items`, and "" or null
    made every request of such a history a 400 'the chat template failed ... Can only get item pairs from a
    mapping'. Whole and through /tokenize, the prompt is the one of arguments "{}"; arguments that are not a JSON
    object (no call the server wrote) still reach the template as they are, its to refuse."""
    def history(function):
        call = {"id": "call_1", "type": "function", "function": {"name": "now", **function}}
        return [{"role": "user", "content": "Hello world!"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]

    def rendered(function):
        r = _post(server, "/tokenize", {"messages": history(function)})
        assert r.status_code == 200, (function, r.text)
        return r.json()["tokens"]

    def text(arguments):  # (the template's own rendering here: the assistant's null content reaches it as "")
        messages = history({"arguments": arguments})
        messages[1]["content"] = ""
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    assert "<tool_call>now</tool_call>" in text({})
    assert rendered({"arguments": "{}"}) == tokenizer.encode(text({}), add_special_tokens=False)
    for function in ({"arguments": ""}, {"arguments": None}, {"arguments": " \n"}, {}):
        assert rendered(function) == rendered({"arguments": "{}"}), function
        chat = _post(server, "/v1/chat/completions", {"messages": history(function), "max_tokens": 1})
        assert chat.status_code == 200, (function, chat.text)
    assert "<tool_call>now hour=12</tool_call>" in text({"hour": 12})
    assert rendered({"arguments": '{"hour": 12}'}) == tokenizer.encode(text({"hour": 12}), add_special_tokens=False)
    error = _error(_post(server, "/v1/chat/completions", {"messages": history({"arguments": "[1, 2]"}), "max_tokens": 1}))
    assert error["param"] == "messages[1].tool_calls[0].function.arguments" and "template" in error["message"], error


def test_a_past_call_whose_arguments_are_not_json_reaches_the_template_as_sent(server, tokenizer):
    """A past call whose function.arguments is not JSON text (a model's own malformed call, replayed by an agent)
    reaches the template as the string sent: a template with a string branch (Qwen3's; here under
    chat_template_kwargs' `string_arguments`) writes it as it is and the chat is served; one that iterates
    `arguments|items` (Qwen3.5's) cannot, and the 400 names the call's arguments as not JSON, param and message
    (it was the template's 'Can only get item pairs from a mapping' naming only `messages`). A template that fails
    for another reason still gives its own error."""
    call = {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{oops"}}
    history = [{"role": "user", "content": "Hello world!"}, {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True, string_arguments=True)
    assert "<tool_call>now {oops</tool_call>" in text
    kwargs = {"chat_template_kwargs": {"string_arguments": True}}
    r = _post(server, "/tokenize", {"messages": history, **kwargs})
    assert r.status_code == 200 and r.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False), r.text
    chat = _post(server, "/v1/chat/completions", {"messages": history, "max_tokens": 1, **kwargs})
    assert chat.status_code == 200, chat.text
    for path in ("/v1/chat/completions", "/tokenize"):
        error = _error(_post(server, path, {"messages": history, "max_tokens": 1}))
        assert error["param"] == "messages[1].tool_calls[0].function.arguments", error
        assert error["message"].startswith(error["param"] + ": '{oops' is not JSON text of an object"), error
    number = {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": 5}}  # (no string: as sent)
    history[1]["tool_calls"].append(number)
    error = _error(_post(server, "/v1/chat/completions", {"messages": history, "max_tokens": 1}))
    assert error["param"] == "messages" and error["message"].startswith("the chat template failed"), error


def test_input_text_parts_are_text_and_image_parts_are_refused_alike(server, client):
    """The Responses API's text parts in chat messages (`input_text`, a past reply's `output_text`: clients that build
    messages in its shape) are text, as vLLM reads them: the prompt is the plain string's; an `input_image` part is
    refused as chat's `image_url` is (this server's models read text), with the same message."""
    def prompt_ids(messages):
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=1, extra_body={"return_token_ids": True})
        return r.prompt_token_ids
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "Hello "}, {"type": "text", "text": "world!"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Bye"}]}]
    plain = [{"role": "user", "content": "Hello world!"}, {"role": "assistant", "content": "Hi."},
             {"role": "user", "content": "Bye"}]
    assert prompt_ids(parts) == prompt_ids(plain)
    tokenized = [_post(server, "/tokenize", {"messages": m}).json()["tokens"] for m in (parts, plain)]
    assert tokenized[0] == tokenized[1]
    image = _error(_post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}], "max_tokens": 1}))
    refused = _error(_post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/a.png"}]}], "max_tokens": 1}))
    assert image["param"] == refused["param"] == "messages", refused
    assert image["message"].split(", got ")[0] == refused["message"].split(", got ")[0], (image, refused)


def test_an_assistants_refusal_in_the_history_is_its_text(server, client):
    """OpenAI's assistant messages may hold refusal parts ({"type": "refusal", "refusal": ...}; they were a 400),
    or a message-level `refusal` in place of content: the refusal's text is the assistant's text (vLLM's reading),
    so the prompt and the greedy reply are those of the same text sent as content. Only an assistant's parts may
    be refusals (OpenAI's rule): a user's is a 400 naming messages."""
    said = "I cannot help with that."

    def history(reply):
        return [{"role": "user", "content": "Hello world!"}, {"role": "assistant", **reply},
                {"role": "user", "content": "Why?"}]

    def answer(reply):
        r = client.chat.completions.create(model=NAME, messages=history(reply), max_tokens=4, temperature=0)
        return r.usage.prompt_tokens, r.choices[0].message.content

    plain = answer({"content": said})
    assert answer({"content": [{"type": "refusal", "refusal": said}]}) == plain
    assert answer({"content": [{"type": "text", "text": "I cannot "}, {"type": "refusal", "refusal": "help with that."}]}) \
        == plain
    assert answer({"content": None, "refusal": said}) == plain
    error = _error(_post(server, "/v1/chat/completions", {"model": NAME, "messages": [
        {"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]}))
    assert error["param"] == "messages" and "refusal" in error["message"], error
    error = _error(_post(server, "/v1/chat/completions", {"model": NAME, "messages": history(
        {"content": [{"type": "refusal", "text": said}]})}))  # a refusal part without its "refusal"
    assert error["param"] == "messages", error


def test_head_health_and_the_model_list_with_a_trailing_slash(server):
    assert httpx.head(server.url + "/health", timeout=10).status_code == 200
    # HEAD is GET without the body on every GET path (RFC 9110: a server supports both), not a 405
    for path in ("/v1/models", f"/v1/models/{NAME}", "/metrics", "/tokenizer_info"):
        head, get = httpx.head(server.url + path, timeout=10), httpx.get(server.url + path, timeout=10)
        assert (head.status_code, head.content) == (200, b"") and get.status_code == 200, (path, head.status_code)
        assert head.headers["content-type"] == get.headers["content-type"], path
    assert httpx.head(server.url + "/v1/models/other", timeout=10).status_code == 404
    r = httpx.get(server.url + "/v1/models/", timeout=10)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [NAME, ALIAS], r.text


def test_every_served_name_is_taken_and_answers_report_the_first(server, client):
    """vLLM's --served-model-name with several names (it was one: a second was a usage error): /v1/models lists each,
    a request naming any of them is served on every endpoint, and every answer reports the first, as vLLM's do (its
    model_name()); a name not among them is a 404 listing them."""
    assert [m.id for m in client.models.list().data] == [NAME, ALIAS]
    assert client.models.retrieve(ALIAS).id == ALIAS
    kw = dict(max_tokens=2, seed=3)
    chat = client.chat.completions.create(model=ALIAS, messages=CHAT, **kw)
    assert chat.model == NAME and chat.choices[0].message.content == client.chat.completions.create(
        model=NAME, messages=CHAT, **kw).choices[0].message.content
    assert client.completions.create(model=ALIAS, prompt="Hi", **kw).model == NAME
    assert {c.model for c in client.completions.create(model=ALIAS, prompt="Hi", stream=True, **kw)} == {NAME}
    assert client.responses.create(model=ALIAS, input="Hi", max_output_tokens=2).model == NAME
    assert _post(server, "/tokenize", {"model": ALIAS, "prompt": "Hi"}).status_code == 200
    error = _error(_post(server, "/v1/completions", {"model": "other", "prompt": "Hi"}), 404)
    assert error["code"] == "model_not_found" and f"{NAME!r} or {ALIAS!r}" in error["message"], error


def test_every_path_is_served_with_a_trailing_slash(server):
    """`POST /v1/completions/` (curl users' and some clients' base URLs write it) was a 307 to the path without it:
    curl without -L printed nothing, and a client that follows it may resend without the body. Each path is served
    as it is without the slash (one slash or more), never redirected, an error in OpenAI's shape included."""
    bodies = {"/v1/completions/": {"model": NAME, "prompt": "Hi", "max_tokens": 1},
              "/v1/chat/completions/": {"model": NAME, "messages": CHAT, "max_tokens": 1},
              "/v1/responses/": {"model": NAME, "input": "Hi", "max_output_tokens": 1},
              "/tokenize/": {"model": NAME, "prompt": "Hi"}, "/detokenize//": {"model": NAME, "tokens": [1]}}
    for path, body in bodies.items():
        r = httpx.post(server.url + path, json=body, timeout=TIMEOUT, follow_redirects=False)
        assert r.status_code == 200 and r.json(), (path, r.status_code, r.headers.get("location"), r.text)
    chat = httpx.post(server.url + "/v1/chat/completions/", json={"model": NAME, "messages": CHAT, "max_tokens": 1,
                                                                  "stream": True}, timeout=TIMEOUT)
    assert chat.status_code == 200 and chat.text.endswith("data: [DONE]\n\n"), chat.text
    for path in ("/health/", f"/v1/models/{NAME}/", "/v1/models/", "/metrics/"):
        r = httpx.get(server.url + path, timeout=10, follow_redirects=False)
        assert r.status_code == 200, (path, r.status_code, r.headers.get("location"))
    assert _error(_post(server, "/v1/completions/", {"model": NAME}))["param"] == "prompt"
    assert _error(httpx.get(server.url + "/v1/models/other/", timeout=10), 404)["code"] == "model_not_found"


def test_prompts_of_megabytes_that_could_never_be_queued_are_refused_unread(server):
    """3 MB of prompts, more than the slots and the queue hold (each fits in the context): the 400 naming
    --max-waiting comes from their count, before any is tokenized (78029c8: tokenizing them first held the
    tokenizing worker for seconds), and /health answers meanwhile. (A prompt longer than the context is refused
    before it is tokenized too: ServerState.check_fits.)"""
    done = threading.Event()
    result = {}
    prompt = "Hello world! " * 70  # 490 tokens
    prompts = [prompt] * ((MAX_REQUEST_BYTES - 100) // (len(prompt) + 4))  # a body within the limit

    def big():
        result["r"] = _post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 1})
        done.set()

    thread = threading.Thread(target=big)
    thread.start()
    time.sleep(0.3)  # (the request is in: its body is read before it is tokenized)
    health = httpx.get(server.url + "/health", timeout=TIMEOUT)
    thread.join(TIMEOUT)
    assert health.status_code == 200 and done.is_set()
    assert _error(result["r"])["param"] == "prompt" and "--max-waiting" in result["r"].text


def _answer(sock: socket.socket) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of the HTTP response read from `sock`."""
    data = b""
    while b"\r\n\r\n" not in data:
        received = sock.recv(65536)
        assert received, f"the server closed the connection without an answer (got {data!r})"
        data += received
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.lower(), v.strip()) for k, v in (line.split(":", 1) for line in lines[1:]))
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, json.loads(body)


def test_a_body_over_the_limit_is_413_before_it_is_read_whole(server):
    """--max-request-bytes: a Content-Length over it is answered at once (no byte of the body sent); a chunked
    body (no Content-Length) as soon as it passes the limit, though it never ends; a whole one too, with
    OpenAI's error; a body at the limit is served."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {30 * 1024 * 1024}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head)
        status, headers, body = _answer(sock)
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    assert f"at most {MAX_REQUEST_BYTES} bytes" in body["error"]["message"]
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 65536
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head)
        for _ in range(MAX_REQUEST_BYTES // len(chunk) + 1):  # one chunk past the limit; the last chunk never sent
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, headers, body = _answer(sock)
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    prompt = "x" * (MAX_REQUEST_BYTES - len('{"prompt": "", "max_tokens": 1}'))
    error = _error(_post(server, "/v1/completions", b'{"prompt": "%s!", "max_tokens": 1}' % prompt.encode()), 413)
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    at_limit = _post(server, "/v1/completions", b'{"prompt": "%s", "max_tokens": 1}' % prompt.encode())
    assert _error(at_limit)["code"] == "context_length_exceeded"  # read whole and answered: far past the context
    assert _post(server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1}).status_code == 200


def test_a_text_that_cannot_fit_is_refused_before_it_is_tokenized(server, tokenizer):
    """A text of more bytes than (context - 1) x the most bytes a token covers is a 400 context_length_exceeded
    naming its field, said before tokenizing (a prompt, one of several, chat messages through the template);
    a stop string longer than any text the context can generate is a 400 too."""
    from metrale_graph.server.limits import TokenBound

    per_token = TokenBound(tokenizer).bytes_per_token
    long = "hello world " * (MAX_CONTEXT * per_token // 12 + 1)
    for path, body, param, name in [
            ("/v1/completions", {"prompt": long}, "prompt", "prompt is at least"),
            ("/v1/completions", {"prompt": ["hi", long]}, "prompt", "prompt 1 is at least"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}, "messages",
             "messages (through the chat template) is at least")]:
        error = _error(_post(server, path, {**body, "max_tokens": 1}))
        assert (error["param"], error["code"]) == (param, "context_length_exceeded"), error
        assert name in error["message"] and f"covers more than {per_token} bytes" in error["message"], error
    most = (MAX_CONTEXT - 1) * per_token
    error = _error(_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop": ["x" * (most + 1)]}))
    assert error["param"] == "stop" and "can never match" in error["message"], error
    ok = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop": ["x" * most]})
    assert ok.status_code == 200, ok.text


# vLLM's tokenizer endpoints ---------------------------------------------------------------------------------
def test_tokenize_a_prompt_as_the_tokenizer_does(server, tokenizer):
    text = "Hello world! Ça va? 東京 👋"
    r = _post(server, "/tokenize", {"model": NAME, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    got = r.json()
    want = tokenizer.encode(text)
    assert got == {"count": len(want), "max_model_len": MAX_CONTEXT, "tokens": want,
                   "token_strs": tokenizer.convert_ids_to_tokens(want)}
    assert _post(server, "/tokenize", {"prompt": text}).json()["token_strs"] is None
    completion = _post(server, "/v1/completions", {"prompt": text, "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == len(want)  # the ids a completion's prompt becomes


def test_tokenize_messages_through_the_chat_template(server, tokenizer):
    """messages are rendered as chat renders them (the template's variables, add_generation_prompt) and encoded
    without special tokens added; the count is the chat's prompt_tokens."""
    kwargs = {"enable_thinking": False}
    r = _post(server, "/tokenize", {"messages": CHAT, "chat_template_kwargs": kwargs})
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, **kwargs)
    assert r.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    chat = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "chat_template_kwargs": kwargs})
    assert chat.json()["usage"]["prompt_tokens"] == r.json()["count"]
    bare = _post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["count"] < r.json()["count"]


def test_detokenize_gives_the_text_back(server, tokenizer):
    text = "The quick brown fox. 東京"
    tokens = _post(server, "/tokenize", {"prompt": text}).json()["tokens"]
    assert _post(server, "/detokenize", {"model": NAME, "tokens": tokens}).json() == {"prompt": text}
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert _post(server, "/detokenize", {"tokens": [special]}).json() == {"prompt": "<|im_end|>"}  # kept


@pytest.mark.parametrize("path, body, param, says", [
    ("/tokenize", {"prompt": 5}, "prompt", "valid string"),
    ("/tokenize", {}, "prompt", "Field required"),
    ("/tokenize", {"messages": "Hi"}, "messages", "valid list"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "Hi"}]}, "messages", "role"),
    ("/tokenize", {"prompt": "x" * (MAX_CONTEXT * 40)}, "prompt", "maximum context length"),
    ("/tokenize", {"prompt": "half \ud83d"}, "prompt", "invalid Unicode"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "tools"),
    ("/detokenize", {"tokens": [10 ** 6]}, "tokens", "not a token id"),
    ("/detokenize", {"tokens": [-1]}, "tokens", "greater than or equal to 0"),
    ("/detokenize", {"tokens": "1 2"}, "tokens", "valid list"),
])
def test_tokenizer_endpoints_bad_requests_are_400_naming_the_field(server, path, body, param, says):
    content = json.dumps(body).encode()  # (ASCII JSON: a lone surrogate as its \u escape)
    error = _error(_post(server, path, content))
    assert error["param"] == param and says in error["message"], error


def test_tokenize_of_another_model_is_404(server):
    assert _error(_post(server, "/tokenize", {"model": "other", "prompt": "Hi"}), 404)["code"] == "model_not_found"


def test_tokenizer_info_with_its_flag(server, tokenizer):
    info = httpx.get(server.url + "/tokenizer_info", timeout=TIMEOUT).json()
    assert info["tokenizer_class"] == type(tokenizer).__name__ and info["chat_template"] == THINKING_TEMPLATE
    assert info["eos_token"] == tokenizer.eos_token and "name_or_path" not in info  # (no server paths)


def test_responses_without_a_store(client):
    """--responses-store-size 0: store true (the default) is taken and stores nothing, as vLLM does without its
    store; previous_response_id is a 400 naming it and saying why; GET of the id is NotFoundError."""
    r = client.responses.create(model=NAME, input="Hello", max_output_tokens=2, store=True)
    assert r.to_dict()["store"] is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError, match="stores no responses") as e:
        client.responses.create(model=NAME, input="Hello", max_output_tokens=2, previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"


def test_an_engine_without_a_waiting_queue_serves_while_a_slot_is_free(checkpoint):
    from metrale_graph import Engine, HybridModel

    engine = Engine(HybridModel.from_pretrained(checkpoint, progress=False), num_slots=2, max_context=64,
                    token_budget=32, compile=False, max_waiting=0)
    try:
        assert len(engine.submit([1, 2, 3], max_new_tokens=2).result(timeout=TIMEOUT).token_ids) == 2
    finally:
        engine.shutdown()


def test_sigint_with_streams_in_flight_frees_the_port_at_once(server):
    """Last: SIGINT (Ctrl-C) while 6 streams run: the port is free within a second, every stream ends with an
    error event and [DONE] once the shutdown timeout passes, and the process exits 0 soon after."""
    ended, started = {}, threading.Semaphore(0)

    def stream(i):
        body = {"prompt": [1 + i, 2, 3], "max_tokens": MAX_CONTEXT - 4, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
                events = []
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        if len(events) == 1:
                            started.release()
            ended[i] = events[-2:]
        except httpx.HTTPError as e:
            ended[i] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=TIMEOUT)
    server.signal(signal.SIGINT)
    sent = time.monotonic()
    while not port_is_free(server.port) and time.monotonic() - sent < 5:
        time.sleep(0.02)
    freed = time.monotonic() - sent
    assert port_is_free(server.port) and freed < 1.5, freed
    for t in threads:
        t.join(SHUTDOWN_S + 30)
    assert not any(t.is_alive() for t in threads)
    for events in ended.values():
        assert isinstance(events, list) and events[-1] == "data: [DONE]", ended
        assert json.loads(events[0][6:])["error"]["code"] == "shutting_down", ended
    assert server.proc.wait(30) == 0, server.output()
    assert time.monotonic() - sent < SHUTDOWN_S + 15
    record = json.loads(open(server.out_path).read().strip().splitlines()[-1])
    assert record["tool"] == "serve" and record["requests"]["error"] == 6, record
    assert re.search(r"serving 'tiny-compat' at http://127\.0\.0\.1:\d+ \(pid \d+\)", server.output())


@pytest.mark.parametrize("text", ["", "a", 'quote " and \\ backslash', "line\nbreak\ttab\x01", "日本語 ☃ é",
                                  "\u2028\u2029", "</script>"])
@pytest.mark.parametrize("finish", [None, "stop", "length"])
@pytest.mark.parametrize("ids", [None, [0, 7, 123456]])
def test_streamed_chunks_are_the_models_json(text, finish, ids):
    """The per-output events written from a template (StreamChunks) hold the JSON event() writes of the
    response models, field for field (an event one JSON object; the same keys, values and order)."""
    from metrale_graph.server.responses import (ChatChunk, ChatChunkChoice, CompletionChoice, CompletionResponse,
                                                DeltaMessage, StreamChunks, event)

    def body(sse):
        assert sse.startswith("data: ") and sse.endswith("\n\n") and "\n" not in sse[6:-2]
        return json.loads(sse[6:-2], object_pairs_hook=list)  # pairs: the keys' order counts too

    rid, created, model = "cmpl-1f", 1764547200, 'tiny "model" é'
    completion = StreamChunks("text_completion", rid, created, model).completion(3, text, finish, ids)
    want = event(CompletionResponse(id=rid, created=created, model=model, choices=[
        CompletionChoice(index=3, text=text, finish_reason=finish, token_ids=ids)]))
    assert body(completion) == body(want)
    content = text or None
    chat = StreamChunks("chat.completion.chunk", rid, created, model).chat(0, content, finish, ids)
    want = event(ChatChunk(id=rid, created=created, model=model, choices=[
        ChatChunkChoice(index=0, delta=DeltaMessage(content=content), finish_reason=finish, token_ids=ids)]))
    assert body(chat) == body(want)




def test_a_request_of_many_tools_is_checked_without_holding_the_server():
    """The tools' checks run on the event loop, where every stream and /health wait for them: two tools of one name
    and a tool_choice's names are found by lookups, not by a scan of every name per tool (40,000 tools took 16 s on
    the 2-core machine, 60,000 fit in a 3 MB body). 150,000 tools, all allowed by name: checked within the bounded
    wait (a hang guard), the ToolRequest holding them all; a name given twice at the end is still a 400 naming it."""
    from metrale_graph.server.errors import APIError
    from metrale_graph.server.protocol import ChatCompletionRequest
    from metrale_graph.server.tool_choice import tool_request

    names = [f"f{i}" for i in range(150_000)]
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": n}} for n in names]}}
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], "tool_choice": choice,
                                                 "tools": [{"type": "function", "function": {"name": n}} for n in names]})
    twice = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], "tools": [
        {"type": "function", "function": {"name": n}} for n in names + ["f7"]]})
    done = {}

    def check():
        done["request"] = tool_request(body.tools, body.tool_choice, "qwen3_xml")
        try:
            tool_request(twice.tools, twice.tool_choice, "qwen3_xml")
        except APIError as e:
            done["twice"] = e

    worker = threading.Thread(target=check, daemon=True)
    worker.start()
    worker.join(TIMEOUT)
    assert not worker.is_alive(), "the tools' checks did not end"
    assert len(done["request"].functions) == len(names) and len(done["request"].template_tools) == len(names)
    assert done["twice"].param == "tools" and "'f7' is given more than once" in done["twice"].message

"""The OpenAI-compatible server as a real process (tools/serve.py on 127.0.0.1, a free port, started once
for the module) on a tiny checkpoint with a byte-level BPE tokenizer and a chat template, called with the
official `openai` client and httpx: completions (text, token ids, several prompts, n), chat, streaming, vLLM's
return_token_ids (the prompt's token ids where vLLM puts them),
greedy and seeded outputs identical to Engine.generate in this process, stop strings and stop token ids,
64 concurrent streaming clients, a client that disconnects mid-stream (its slot freed, the metrics show
it), bad requests answered 4xx in OpenAI's shape with the server going on, a full queue (503 +
Retry-After), CORS restricted to one origin with credentials (preflights answered before the API key's
check, a 401 readable by the page, another origin given no Access-Control-Allow-Origin), the benchmark
client, and SIGTERM (running requests end, the process exits 0, the port is free); /health while it
started ("loading" from the moment it listened). The app's warmup state is tested in-process. Waits are
bounded so that a hang fails fast."""

import asyncio
import importlib.metadata
import json
import re
import threading
import time

import httpx
import openai
import pytest

from helpers import random_tokens
from metrale_graph import Engine, HybridModel
from server_process import port_is_free, running_server
from tokenizer_fixture import tiny_checkpoint

KEY = "test-key"
ORIGIN = "https://app.example"
NAME = "tiny-chat"
MAX_CONTEXT = 512
SLOTS = 16
TIMEOUT = 120


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))




@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    flags = ["--served-model-name", NAME, "--api-key", KEY, "--num-slots", str(SLOTS), "--max-context",
             str(MAX_CONTEXT), "--token-budget", "256", "--max-waiting", "64", "--shutdown-timeout", "3",
             "--prefix-cache", "--allowed-origins", json.dumps([ORIGIN]), "--allowed-methods", '["GET", "POST"]',
             "--allow-credentials"]
    with running_server(checkpoint, tmp_path_factory.mktemp("server"), flags, TIMEOUT) as proc:
        yield proc


@pytest.fixture(scope="module")
def engine(checkpoint):
    """The same checkpoint in this process: the reference outputs."""
    model = HybridModel.from_pretrained(checkpoint, progress=False)
    engine = Engine(model, num_slots=SLOTS, max_context=MAX_CONTEXT, token_budget=256, compile=False)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)


def _metrics(server) -> dict[str, float]:
    """/metrics as {name{labels}: value} (model_name label left out)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[re.sub(r',?model_name="[^"]*"', "", name).replace("{}", "")] = float(value)
    return out


def _wait_metrics(server, ok, what: str) -> dict:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        m = _metrics(server)
        if ok(m):
            return m
        time.sleep(0.05)
    raise AssertionError(f"/metrics never showed {what}: {m}")


def _ids(engine, prompt, **kw):
    return engine.generate([prompt], **kw)[0].token_ids


def test_health_models_and_api_key(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    # vLLM's /ping (GET and POST, SageMaker's health check) answers as /health; /version the package's; open as /health
    for method in ("GET", "POST", "HEAD"):
        ping = httpx.request(method, server.url + "/ping", timeout=10)
        assert ping.status_code == 200 and ping.content == (b"" if method == "HEAD" else b'{"status":"ok"}'), method
    version = httpx.get(server.url + "/version", timeout=10)
    assert version.status_code == 200 and version.json() == {"version": importlib.metadata.version("metrale-graph")}
    (card,) = client.models.list().data
    assert card.id == NAME and card.max_model_len == MAX_CONTEXT and card.vocab_size > 256
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model=NAME, prompt="Hello", max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    bare = httpx.post(server.url + "/v1/completions", content=b"{not json")  # the key is checked first
    assert bare.status_code == 401 and set(bare.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/metrics").status_code == 200  # open without the key


def test_the_tokenizer_endpoints_need_the_key(server):
    """vLLM's /tokenize and /detokenize (outside /v1) are behind the API key too; /tokenizer_info is not served
    without --enable-tokenizer-info-endpoint."""
    for path, body in (("/tokenize", {"prompt": "Hello"}), ("/detokenize", {"tokens": [1]})):
        assert httpx.post(server.url + path, json=body).status_code == 401
        keyed = httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert keyed.status_code == 200, keyed.text
    assert httpx.get(server.url + "/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404


def test_it_answered_from_the_moment_it_listened(server):
    """The server listens before the model loads: from its first answer on (the connections refused before
    were the process starting), /health always answered: "loading", then "warming up" or "ok"."""
    answers = server.health_answers
    first = next(i for i, a in enumerate(answers) if a != "refused")
    assert answers[first] == "loading" and answers[-1] == "ok", answers
    assert set(answers[first:]) <= {"loading", "warming up", "ok"}, answers


def test_completion_text_and_token_ids_match_generate(client, engine):
    text = "Hello world! How are you"
    ids = engine.tokenizer.encode(text)
    want = _ids(engine, ids, max_new_tokens=8)
    out = client.completions.create(model=NAME, prompt=text, max_tokens=8, temperature=0,
                                    extra_body={"return_token_ids": True})
    (choice,) = out.choices
    assert choice.token_ids == want and choice.text == engine.decode(want)
    assert choice.finish_reason == ("stop" if want[-1] in engine.stop_token_ids else "length")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(want))
    assert out.usage.total_tokens == len(ids) + len(want) and out.usage.prompt_tokens_details.cached_tokens == 0
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == choice.text
    # several prompts, strings and token id lists: one choice each, in order
    prompts = [[5, 6, 7], [300, 2, 9, 11]]
    many = client.completions.create(model=NAME, prompt=prompts, max_tokens=5, temperature=0,
                                     extra_body={"return_token_ids": True})
    assert [c.index for c in many.choices] == [0, 1]
    assert [c.token_ids for c in many.choices] == [r.token_ids for r in engine.generate(prompts, max_new_tokens=5)]
    assert many.usage.prompt_tokens == 7


def test_return_token_ids_gives_the_prompt_tokens_where_vllm_does(client, engine):
    """vLLM's return_token_ids: a completion's prompt_token_ids in each choice (a stream: in each choice's first
    event, none after), a chat's once at the response's top level (a stream: in its first chunk), with every
    choice's token_ids (a stream: each event's new ones, which join to the whole response's)."""
    prompt, extra = [10, 20, 30, 40], {"return_token_ids": True}
    kw = dict(model=NAME, max_tokens=5, temperature=0, n=2)
    whole = client.completions.create(prompt=prompt, extra_body=extra, **kw)
    assert [c.prompt_token_ids for c in whole.choices] == [prompt, prompt]
    events = [c.choices[0] for c in client.completions.create(prompt=prompt, stream=True, extra_body=extra, **kw)]
    for i in range(2):
        mine = [c for c in events if c.index == i]
        assert mine[0].prompt_token_ids == prompt and all(getattr(c, "prompt_token_ids", None) is None for c in mine[1:])
        assert sum((c.token_ids for c in mine), []) == whole.choices[i].token_ids
    messages = [{"role": "user", "content": "Hello world!"}]
    tok = engine.tokenizer
    rendered = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    chat = client.chat.completions.create(messages=messages, extra_body=extra, **kw)
    assert chat.prompt_token_ids == rendered and all(c.token_ids for c in chat.choices)
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chat.choices)
    chunks = list(client.chat.completions.create(messages=messages, stream=True, extra_body=extra, **kw))
    assert chunks[0].prompt_token_ids == rendered
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert sum((getattr(c, "token_ids", None) or [] for c in mine), []) == chat.choices[i].token_ids


def test_streamed_completion_equals_whole(client, engine):
    prompt = "The quick brown fox"
    whole = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text and len(texts) > 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_seeded_n_choices_match_generate(client, engine):
    prompt = [10, 20, 30, 40]
    kw = dict(model=NAME, prompt=prompt, max_tokens=6, temperature=1.0, top_p=0.9, seed=7, n=2,
              extra_body={"top_k": 50, "return_token_ids": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    want = [r.token_ids for r in engine.generate([prompt, prompt], max_new_tokens=6, temperature=1.0, top_p=0.9,
                                                 top_k=50, seed=7)]  # request i draws with seed + i
    assert [c.token_ids for c in a.choices] == [c.token_ids for c in b.choices] == want
    assert a.usage.prompt_tokens == 4 and a.usage.completion_tokens == sum(map(len, want))


def test_stop_strings_and_stop_token_ids(client, engine):
    prompt = "Naïve café, résumé"
    ids = engine.tokenizer.encode(prompt)
    free = _ids(engine, ids, max_new_tokens=24, stop_token_ids=[])
    text = engine.decode(free)
    start = next(i for i in range(2, len(text) - 2) if "\ufffd" not in text[i:i + 2] and text[i:i + 2].strip())
    stop = text[start:start + 2]
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == text[:text.find(stop)] and out.choices[0].finish_reason == "stop"
    token = free[3]
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [token],
                                                "return_token_ids": True})
    assert out.choices[0].token_ids == free[:free.index(token) + 1] and out.choices[0].finish_reason == "stop"


def test_chat_whole_and_streamed(client, engine):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world!"}]
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    want = _ids(engine, prompt, max_new_tokens=10)
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content == engine.decode(want)
    assert choice.finish_reason in ("stop", "length") and out.usage.prompt_tokens == len(prompt)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and deltas[0].content == ""
    assert "".join(d.content or "" for d in deltas) == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == choice.finish_reason and not any(finishes[:-1])
    assert chunks[-1].usage.completion_tokens == len(want)
    # content as a list of text parts is the same message
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world!"}]}]
    plain = [{"role": "user", "content": "Hello world!"}]
    kw = dict(model=NAME, max_tokens=4, temperature=0)
    assert (client.chat.completions.create(messages=parts, **kw).choices[0].message.content
            == client.chat.completions.create(messages=plain, **kw).choices[0].message.content)


def test_64_concurrent_streaming_clients(server, engine):
    prompts = [random_tokens(3 + i % 7, seed=100 + i, vocab=256) for i in range(64)]
    want = [r.token_ids for r in engine.generate(prompts, max_new_tokens=6)]

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0,
                                                  stream=True, extra_body={"return_token_ids": True})
        tokens, reason = [], None
        async for chunk in stream:
            tokens += chunk.choices[0].token_ids or []
            reason = chunk.choices[0].finish_reason or reason
        return tokens, reason

    async def all_clients():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)
        async with aclient:
            return await asyncio.wait_for(asyncio.gather(*(one(aclient, p) for p in prompts)), TIMEOUT)

    t = time.monotonic()
    got = asyncio.run(all_clients())
    assert [tokens for tokens, _ in got] == want, f"{time.monotonic() - t:.1f} s"
    assert all(reason in ("stop", "length") for _, reason in got)
    _wait_metrics(server, lambda m: m["metrale_num_requests_running"] == 0, "no request running")


def test_client_that_disconnects_frees_its_slot(server, client):
    before = _metrics(server)['metrale_request_finished_total{finished_reason="abort"}']
    stream = client.completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    seen = 0
    for _ in stream:
        seen += 1
        if seen == 3:
            break
    running = _metrics(server)["metrale_num_requests_running"]
    stream.close()
    m = _wait_metrics(server, lambda m: m['metrale_request_finished_total{finished_reason="abort"}'] == before + 1
                      and m["metrale_num_requests_running"] == 0 and m["metrale_kv_blocks_used"] == 0,
                      "the aborted request's slot and blocks freed")
    assert running == 1 and m["metrale_slots_used"] == 0
    assert client.completions.create(model=NAME, prompt="Hello", max_tokens=2).choices[0].text is not None


BAD = [  # (path, body, status, param, code)
    ("/v1/completions", b"{not json", 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, None),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", None),
    ("/v1/completions", {"prompt": [1, -1]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [1, 10**6]}, 400, "prompt", None),  # the engine's check: not in the vocabulary
    ("/v1/completions", {"prompt": [1] * MAX_CONTEXT}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop", None),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/completions", {}, 400, "prompt", None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages",
     None),
    ("/v1/nothing", {"prompt": "x"}, 404, None, "not_found"),
]


@pytest.mark.parametrize("path, body, status, param, code", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_request_gets_its_4xx_and_the_next_is_served(server, client, path, body, status, param, code):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(server.url + path, headers=headers, timeout=30, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code), error
    assert client.completions.create(model=NAME, prompt=[1, 2], max_tokens=1).usage.completion_tokens == 1


def test_form_body_and_wrong_method(server):
    """JSON sent without its Content-Type is a 400 saying what to send (vLLM answers 415), never read as JSON nor a 500:
    a form (curl -d's default), no type, text/plain (some harnesses'), on each endpoint."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = b'{"prompt": "x", "messages": [{"role": "user", "content": "x"}], "input": "x"}'
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        for kw in ({"data": {"prompt": "x"}}, {"content": body}, {"content": body, "headers": {"Content-Type": "text/plain"}}):
            r = httpx.post(server.url + path, headers={**headers, **kw.pop("headers", {})}, **kw)
            assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"], r.text
    assert httpx.get(server.url + "/v1/completions", headers=headers).status_code == 405


def test_cors_restricted_to_one_origin_with_credentials(server):
    """--allowed-origins '["https://app.example"]' --allowed-methods '["GET", "POST"]' --allow-credentials: a
    preflight from that origin is answered 200 without the key (browsers send none on it), the request after it
    and its 401 carry the origin and credentials headers; another origin's preflight is refused and its requests
    carry no Access-Control-Allow-Origin (the browser then hides the answer from the page)."""
    url = server.url + "/v1/chat/completions"
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(url, headers={"Origin": ORIGIN, **preflight}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN and r.headers["access-control-allow-credentials"] == "true"
    assert {m.strip() for m in r.headers["access-control-allow-methods"].split(",")} == {"GET", "POST"}
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    body = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for key, status in ((KEY, 200), ("wrong", 401)):
        r = httpx.post(url, json=body, headers={"Origin": ORIGIN, "Authorization": f"Bearer {key}"}, timeout=TIMEOUT)
        assert r.status_code == status, r.text
        assert r.headers["access-control-allow-origin"] == ORIGIN, r.headers
        assert r.headers["access-control-allow-credentials"] == "true", r.headers
    other = "https://elsewhere.example"
    r = httpx.options(url, headers={"Origin": other, **preflight}, timeout=TIMEOUT)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers, (r.status_code, r.headers)
    r = httpx.post(url, json=body, headers={"Origin": other, "Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers, r.headers


def test_official_client_raises_on_bad_requests(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_full_queue_is_503_with_retry_after(server, client):
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/v1/completions", headers=headers, timeout=30,
                   json={"prompt": [1, 2], "max_tokens": 2, "n": SLOTS + 65})  # beyond 16 slots + 64 waiting: never fits
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "--max-waiting" in r.text, r.text
    # prompts that could never all be queued are counted before any is read: none tokenized (a 4 MB body of them held
    # the event loop, or the tokenizing worker, for seconds), so the first one's bad token id is never reached
    for first in ([10**6], "\ud800"):
        rest = [[1, 2] if isinstance(first, list) else "Hi"] * (SLOTS + 64)
        r = httpx.post(server.url + "/v1/completions", headers={**headers, "Content-Type": "application/json"},
                       content=json.dumps({"prompt": [first] + rest, "max_tokens": 2}), timeout=30)  # (ASCII: \ud800)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "--max-waiting" in r.text, r.text
    body = {"prompt": [1, 2], "max_tokens": MAX_CONTEXT - 4, "n": 64, "stream": True, "ignore_eos": True}
    aborts = _metrics(server)['metrale_request_finished_total{finished_reason="abort"}']
    with httpx.stream("POST", server.url + "/v1/completions", headers=headers, json=body, timeout=TIMEOUT) as s:
        assert s.status_code == 200
        _wait_metrics(server, lambda m: m["metrale_num_requests_running"] == SLOTS, "the slots full")
        r = httpx.post(server.url + "/v1/completions", headers=headers, timeout=30,  # 48 wait: 17 more do not fit
                       json={"prompt": [1, 2], "max_tokens": 2, "n": 17})
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "engine_overloaded"
    _wait_metrics(server, lambda m: m["metrale_num_requests_running"] == 0 and m["metrale_num_requests_waiting"] == 0,
                  "the stream's requests aborted and the refused request's others too")
    # each ended as an abort: the stream's 64 and the 16 of the refused request that the engine had taken
    _wait_metrics(server, lambda m: m['metrale_request_finished_total{finished_reason="abort"}'] == aborts + 64 + 16,
                  "80 more aborts")
    assert client.completions.create(model=NAME, prompt=[1, 2], max_tokens=1).usage.completion_tokens == 1


def test_metrics_count_tokens_and_latencies(server):
    m = _metrics(server)
    assert m["metrale_time_to_first_token_seconds_count"] > 64 and m["metrale_inter_token_latency_seconds_count"] > 0
    assert m["metrale_prompt_tokens_total"] > 0 and m["metrale_generation_tokens_total"] > 64 * 6
    assert m["metrale_slots_total"] == SLOTS and m["metrale_kv_blocks_total"] > 0
    assert m["metrale_prefix_cache_queries_total"] == m["metrale_prompt_tokens_total"]  # no request failed
    assert "metrale_prefix_cache_hits_total" in m and "metrale_engine_steps_total" in m


def test_prefix_cache_hits_show_in_usage_and_metrics(server, client, engine):
    prompt = random_tokens(200, seed=5, vocab=256)
    hits = _metrics(server)["metrale_prefix_cache_hits_total"]
    first, again = (client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0,
                                              extra_body={"return_token_ids": True}) for _ in range(2))
    assert first.choices[0].token_ids == again.choices[0].token_ids == _ids(engine, prompt, max_new_tokens=3)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < len(prompt) and again.usage.prompt_tokens == len(prompt)
    assert _metrics(server)["metrale_prefix_cache_hits_total"] >= hits + cached


def test_responses_usage_is_the_clients_type_with_its_prefix_cache_hits(client):
    """The Responses API's usage has every field of the openai client's ResponseUsage (which its models do not check:
    a missing input_tokens_details.cache_write_tokens read as None), whole and in response.completed; a repeated input
    counts its prefix-cache hits as cached_tokens, and the prefix cache writes nothing billed (cache_write_tokens 0)."""
    from openai.types.responses import Response, ResponseCompletedEvent

    text = "Tell me about the weather in Paris, " * 12
    first = client.responses.with_raw_response.create(model=NAME, input=text, max_output_tokens=3, temperature=0)
    again = client.responses.create(model=NAME, input=text, max_output_tokens=3, temperature=0)
    Response.model_validate_json(first.text)  # (strictly: the client's parse skips the checks)
    events = list(client.responses.create(model=NAME, input=text, max_output_tokens=3, temperature=0, stream=True))
    ResponseCompletedEvent.model_validate(events[-1].model_dump())
    for usage in (again.usage, events[-1].response.usage):
        details = usage.input_tokens_details
        assert 0 < details.cached_tokens < usage.input_tokens and details.cache_write_tokens == 0, usage
        assert usage.input_tokens == first.parse().usage.input_tokens


def test_bench_serve_runs_against_the_server(server, capsys, tmp_path):
    from metrale_graph.tools import bench_serve

    bench_serve.main(["--base-url", server.url + "/v1", "--api-key", KEY, "--num-prompts", "8", "--input-len", "4:8",
                      "--output-len", "4", "--max-concurrency", "4", "--json", str(tmp_path / "bench.json")])
    out = capsys.readouterr().out
    record = json.loads(out.strip().splitlines()[-1])
    assert record["tool"] == "bench_serve" and record["model"] == NAME
    assert "--max-concurrency 4" in record["command"] and record["torch"]  # what produced it (provenance)
    assert (record["completed"], record["failed"], record["output_tokens"]) == (8, 0, 32)
    assert 0 < record["ttft_p50_ms"] <= record["ttft_p99_ms"] and record["itl_p50_ms"] > 0
    assert record["output_tokens_per_s"] > 0 and "TTFT mean / p50 / p99 (ms)" in out
    assert json.loads((tmp_path / "bench.json").read_text()) == record


def test_bench_serve_cookbook_levels_beside_sglang(server, capsys, monkeypatch):
    """--cookbook runs one level per concurrency (here the workload shrunk to this server's context) and prints
    each level's TPOT beside SGLang's published figure."""
    from metrale_graph.tools import bench_serve

    monkeypatch.setattr(bench_serve, "COOKBOOK", {**bench_serve.COOKBOOK, "input_len": 6, "output_len": 3,
                                                  "concurrency": (1, 16)})
    bench_serve.main(["--base-url", server.url, "--api-key", KEY, "--cookbook"])
    out = capsys.readouterr().out
    record = json.loads(out.strip().splitlines()[-1])
    assert record["workload"] == "cookbook" and [r["max_concurrency"] for r in record["levels"]] == [1, 16]
    assert [(r["completed"], r["output_tokens"]) for r in record["levels"]] == [(4, 12), (32, 96)]
    assert record["sglang_tpot_ms"]["bf16"]["1"] == 2.23 and "2.23 / 1.98" in out and "8.13 / 6.2" in out


def test_warming_up_app_answers_503(engine):
    """In-process: an app built before its engine is warm answers /health and generation requests with 503."""
    from metrale_graph.server import build_app

    app = build_app(engine, "warming", ready=False)

    async def calls():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            health = await c.get("/health")
            ping = await c.post("/ping")
            refused = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
            app.state.server.ready.set()
            return health, ping, refused, await c.get("/health"), await c.post(
                "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})

    health, ping, refused, ready, served = asyncio.run(calls())
    assert health.status_code == 503 and health.json() == {"status": "warming up"}
    assert ping.status_code == 503 and ping.json() == {"status": "warming up"}
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "warming_up"
    assert refused.headers["retry-after"] == "1"
    assert ready.status_code == 200 and served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 1


def test_a_failing_step_is_500_or_an_error_event(engine, monkeypatch):
    """In-process: a step that raises fails its requests: a whole response is 500, a stream ends with an error
    event and [DONE] (a Responses API stream: an error event and response.failed); the app goes on serving."""
    from metrale_graph.server import build_app

    app = build_app(engine, "failing")
    real = engine._loop.launch

    def failing(streams, decodes):
        raise RuntimeError("injected step failure")

    async def calls():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            body = {"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True}  # (sampled: EOS could end it early)
            monkeypatch.setattr(engine._loop, "launch", failing)
            whole = await c.post("/v1/completions", json=body)
            streamed = await c.post("/v1/completions", json={**body, "stream": True})
            responses = await c.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 3, "stream": True,
                                                            "ignore_eos": True})
            monkeypatch.setattr(engine._loop, "launch", real)
            return whole, streamed, responses, await c.post("/v1/completions", json=body)

    whole, streamed, responses, after = asyncio.run(calls())
    assert whole.status_code == 500 and "injected step failure" in whole.json()["error"]["message"]
    events = [line for line in streamed.text.splitlines() if line]
    assert events[-1] == "data: [DONE]" and "injected step failure" in json.loads(events[-2][6:])["error"]["message"]
    # the Responses API's stream: an error event, then response.failed (status failed, its error)
    data = [json.loads(line[6:]) for line in responses.text.splitlines() if line.startswith("data: ")]
    assert [d["type"] for d in data] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert "injected step failure" in data[2]["message"] and data[3]["response"]["status"] == "failed"
    assert "injected step failure" in data[3]["response"]["error"]["message"]
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3


def test_sigterm_ends_running_requests_and_frees_the_port(server, client):
    """Last: a stream and a whole request run, SIGTERM arrives; new requests are refused, both end (here with
    an error: they would outlast the 3 s shutdown timeout, 64 choices of 508 tokens in waves of 16 slots; the
    whole one is 503), the process exits 0 and prints its JSON line, the port is free."""
    ended = {}

    def stream():
        try:
            for _ in client.completions.create(model=NAME, prompt=[4, 5, 6], max_tokens=MAX_CONTEXT - 4, stream=True,
                                               n=48, extra_body={"ignore_eos": True}):
                ended.setdefault("first", time.monotonic())
            ended["how"] = "finished"
        except openai.APIError as e:
            ended["how"] = f"error: {e}"

    def whole():
        try:
            client.completions.create(model=NAME, prompt=[7, 8], max_tokens=MAX_CONTEXT - 4, n=16,
                                      extra_body={"ignore_eos": True})
            ended["whole"] = "finished"
        except openai.APIStatusError as e:
            ended["whole"] = f"{e.status_code}: {e.message}"

    def submitted(m):  # every request the engine has taken: running, waiting or finished
        return m["metrale_num_requests_running"] + m["metrale_num_requests_waiting"] + sum(
            v for k, v in m.items() if k.startswith("metrale_request_finished_total"))

    # the stream first, then the whole request behind its 48 choices (started together, the whole one could
    # take the 16 slots and finish before the stream's first token, the moment SIGTERM used to be sent)
    t, w = threading.Thread(target=stream), threading.Thread(target=whole)
    t.start()
    deadline = time.monotonic() + TIMEOUT
    while "first" not in ended and time.monotonic() < deadline:
        time.sleep(0.02)
    before = submitted(_metrics(server))
    w.start()
    _wait_metrics(server, lambda m: submitted(m) >= before + 16, "the whole request's 16 choices submitted")
    server.signal()
    sent = time.monotonic()
    with pytest.raises((openai.APIStatusError, openai.APIConnectionError)) as refused:
        client.completions.create(model=NAME, prompt=[1, 2], max_tokens=2)
    assert not isinstance(refused.value, openai.APIStatusError) or refused.value.status_code == 503
    t.join(30)
    w.join(30)
    assert not t.is_alive() and "shutting down" in ended.get("how", ""), ended
    assert not w.is_alive() and ended.get("whole", "").startswith("503") and "shutting down" in ended["whole"], ended
    assert server.proc.wait(30) == 0, server.output()
    assert time.monotonic() - sent < 30 and port_is_free(server.port)
    last = open(server.out_path).read().strip().splitlines()[-1]
    record = json.loads(last)
    assert record["tool"] == "serve" and record["requests"]["error"] >= 1 and record["requests"]["abort"] >= 1

"""Logprobs and the sampling controls through the OpenAI-compatible server: a real process (tools/serve.py on
127.0.0.1, a free port, started once for the module, prefix caching on) on a tiny fp32 checkpoint with a byte-level
BPE tokenizer, called with the official `openai` client, httpx and lm-eval's `local-completions` model.

The reference is the same checkpoint in this process: log_softmax of model.prefill's logits, fed one token at a
time (tests/sampling_reference.py). Completions' logprobs (whole and streamed), chat's, echo with max_tokens 0
(the prompt's logprobs, as lm-eval asks) and vLLM's prompt_logprobs equal it within 1e-4; the Responses API's
output-text logprobs (include "message.output_text.logprobs", top_logprobs) whole and streamed equal chat's for the
same prompt and seed; they are the raw
distribution's whatever the request's temperature and penalties; greedy decoding with each control equals the
reference decode loop applying that control's definition; include_stop_str_in_output keeps the stop string; bad
values are 400s naming their field (min_tokens past the limit in the words of the field sent); lm-eval runs a
loglikelihood task and a generate_until task over local data (no hub download) and its loglikelihoods equal ours, a
loglikelihood_rolling task over several windows with the
server's own tokenizer (its remote backend) equals ours window by window, and local-chat-completions' generations
are the server's own chat replies."""

import json
import math

import httpx
import openai
import pytest
import torch

from metrale_graph import HybridModel, Stream
from metrale_graph.sampling import check_params
from sampling_reference import reference_decode
from server_process import running_server
from tokenizer_fixture import tiny_checkpoint

NAME = "tiny-logprobs"
MAX_CONTEXT = 256
TIMEOUT = 120
TOL = 1e-4
PROMPT = "The quick brown fox jumps over the lazy dog. Hello"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    flags = ["--served-model-name", NAME, "--num-slots", "4", "--max-context", str(MAX_CONTEXT), "--token-budget",
             "16", "--prefix-cache", "--enable-tokenizer-info-endpoint"]  # a budget of 16: PROMPT's 23 tokens are
    # prefilled in two chunks; /tokenizer_info: lm-eval's remote tokenizer
    with running_server(checkpoint, tmp_path_factory.mktemp("server"), flags, TIMEOUT) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def model(checkpoint):
    return HybridModel.from_pretrained(checkpoint, progress=False)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def log_softmax_after(model, tokens: list[int]) -> list[torch.Tensor]:
    """log_softmax of the model's logits after each of `tokens` (fp32 [vocab] each), one token fed at a time."""
    cache = model.new_cache(1, MAX_CONTEXT // 16, 16, MAX_CONTEXT)
    return [torch.log_softmax(model.prefill(cache, [Stream(0, [t])]).float(), -1)[0] for t in tokens]


def assert_top(top: dict, row: torch.Tensor, n: int, strings, token: int):
    """A completions top_logprobs dict: the n most likely tokens' strings and the token's own, with their values; a
    string that several tokens decode to (U+FFFD) with the most likely one's."""
    want = {}
    for t in [*row.topk(n).indices.tolist(), token]:
        want.setdefault(strings(t), float(row[t]))
    assert top.keys() == want.keys()
    assert all(abs(top[k] - want[k]) < TOL for k in want), (top, want)


def test_completion_logprobs_equal_the_models_log_softmax(client, model, tokenizer):
    """logprobs: 3 of greedy and of sampled-with-penalties completions: each new token's logprob and top 3 are
    log_softmax of the raw logits (the penalties and the temperature change the tokens, not the values); tokens are
    decode([id]); text_offset sums the token strings; streamed, the same values."""
    strings = lambda t: tokenizer.decode([t])  # noqa: E731
    prompt = tokenizer.encode(PROMPT)
    for kw in (dict(temperature=0), dict(temperature=1.5, seed=3, presence_penalty=1.0, frequency_penalty=0.5,
                                         extra={"repetition_penalty": 1.3, "min_p": 0.01})):
        extra = {"return_token_ids": True, "ignore_eos": True, **kw.pop("extra", {})}
        out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, logprobs=3, extra_body=extra, **kw)
        choice = out.choices[0]
        ids, lp = choice.token_ids, choice.logprobs
        rows = log_softmax_after(model, prompt + ids)[len(prompt) - 1:]
        assert lp.tokens == [strings(t) for t in ids]
        assert lp.text_offset == [sum(len(strings(t)) for t in ids[:i]) for i in range(len(ids))]
        for i, t in enumerate(ids):
            assert abs(lp.token_logprobs[i] - float(rows[i][t])) < TOL, i
            assert_top(lp.top_logprobs[i], rows[i], 3, strings, t)
        stream = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, logprobs=3, stream=True,
                                           extra_body=extra, **kw)
        streamed = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
        assert sum((s.tokens for s in streamed), []) == lp.tokens
        values = sum((s.token_logprobs for s in streamed), [])
        assert all(abs(a - b) < TOL for a, b in zip(values, lp.token_logprobs)) and len(values) == len(ids)
        assert sum((s.top_logprobs for s in streamed), []) == pytest.approx(lp.top_logprobs, abs=TOL)


def test_completion_top_logprobs_keep_the_most_likely_of_tokens_of_one_string(client, model, tokenizer):
    """logprobs: 20: byte tokens of the byte-level BPE that decode to one string (U+FFFD, each part of a character)
    share one key of a position's top_logprobs, which holds the most likely one's logprob (it held the least likely
    one's, the last written: a client reading the top's maximum as the greedy token's, as lm-eval does, saw another)."""
    strings = lambda t: tokenizer.decode([t])  # noqa: E731
    prompt = tokenizer.encode(PROMPT)
    choice = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, logprobs=20, temperature=0,
                                       extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    rows = log_softmax_after(model, prompt + choice.token_ids)[len(prompt) - 1:]
    shared = 0
    for i, t in enumerate(choice.token_ids):
        top = rows[i].topk(20).indices.tolist()
        shared += len(top) - len({strings(k) for k in top})
        assert_top(choice.logprobs.top_logprobs[i], rows[i], 20, strings, t)
        assert max(choice.logprobs.top_logprobs[i].values()) == pytest.approx(float(rows[i].max()), abs=TOL)
    assert shared > 0  # (the case)


def test_chat_logprobs_equal_the_models_log_softmax(client, model, tokenizer):
    """Chat's logprobs: true, top_logprobs: 4, whole and streamed: content[i] is token i's string, logprob, bytes
    and its position's top 4, equal to log_softmax of the raw logits."""
    messages = [{"role": "user", "content": "Hello world! How are you today?"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, logprobs=True, top_logprobs=4,
                                         temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    ids, content = out.choices[0].token_ids, out.choices[0].logprobs.content
    rows = log_softmax_after(model, prompt + ids)[len(prompt) - 1:]
    assert len(content) == len(ids) == 5
    for i, (t, entry) in enumerate(zip(ids, content)):
        assert entry.token == tokenizer.decode([t]) and bytes(entry.bytes).decode(errors="replace") == entry.token
        assert abs(entry.logprob - float(rows[i][t])) < TOL
        top = rows[i].topk(4)
        assert [e.token for e in entry.top_logprobs] == [tokenizer.decode([k]) for k in top.indices.tolist()]
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=TOL)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, logprobs=True,
                                            top_logprobs=4, temperature=0, stream=True, extra_body={"ignore_eos": True})
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.top_logprobs) for e in streamed] == [(e.token, e.top_logprobs) for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=TOL)


def test_chat_logprobs_bytes_join_into_the_text(client, tokenizer):
    """A chat token's `bytes` are its own bytes of the text's UTF-8 (OpenAI's field, for rebuilding a character that
    spans tokens): a reply held to an emoji and CJK characters (byte-level BPE tokens holding parts of them, whose
    strings are U+FFFD) joins its tokens' bytes into its text, whole, streamed and in the Responses API; each top
    entry's bytes read as its token's string. (They were U+FFFD's three bytes for each part, as vLLM writes them.)"""
    text = "😀 ok 中文"
    ask = dict(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=30, logprobs=True, top_logprobs=3,
               temperature=0, extra_body={"structured_outputs": {"regex": text}})
    whole = client.chat.completions.create(**ask).choices[0]
    streamed = [e for c in client.chat.completions.create(stream=True, **ask) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    response = client.responses.create(model=NAME, input="Hi", max_output_tokens=30, temperature=0, top_logprobs=3,
                                       include=["message.output_text.logprobs"], extra_body={"structured_outputs": {
                                           "regex": text}})
    assert whole.message.content == response.output_text == text
    for entries in (whole.logprobs.content, streamed, response.output[-1].content[0].logprobs):
        assert any(e.token == "\ufffd" for e in entries)  # (a character in parts)
        own = [e for e in entries if e.token not in tokenizer.all_special_tokens]  # (the stop token's text is no reply's)
        assert b"".join(bytes(e.bytes) for e in own) == text.encode()
        for e in entries:
            assert all(bytes(t.bytes).decode(errors="replace") == t.token for t in [e, *e.top_logprobs])


def test_responses_logprobs_equal_chats(client):
    """The Responses API's output text with include logprobs and top_logprobs 3, sampled (temperature 1, a seed):
    whole, its logprobs (token, bytes, logprob, top) equal chat's logprobs.content for the same prompt and seed;
    streamed, the output_text deltas' logprobs joined (the last delta, of empty text, holds the stop token's) equal
    them, as do the done event's and the final response's."""
    text, seed = "Hello world! How are you today?", 11
    sampling = dict(temperature=1.0, top_p=1.0, extra_body={"seed": seed})  # (a vLLM field of the Responses API)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": text}], max_tokens=6,
                                          logprobs=True, top_logprobs=3, **sampling).choices[0]
    want = [(e.token, e.bytes, e.logprob, [(t.token, t.bytes, t.logprob) for t in e.top_logprobs])
            for e in chat.logprobs.content]
    ask = dict(model=NAME, input=text, max_output_tokens=6, include=["message.output_text.logprobs"], top_logprobs=3,
               **sampling)
    whole = client.responses.create(**ask)
    assert whole.output_text == chat.message.content and whole.top_logprobs == 3
    (part,) = whole.output[-1].content
    got = [(e.token, e.bytes, e.logprob, [(t.token, t.bytes, t.logprob) for t in e.top_logprobs]) for e in part.logprobs]
    assert [(t, b, [(tt, tb) for tt, tb, _ in top]) for t, b, _, top in got] == \
        [(t, b, [(tt, tb) for tt, tb, _ in top]) for t, b, _, top in want]
    assert [v for *_, v, _ in got] == pytest.approx([v for *_, v, _ in want], abs=TOL)

    def short(entries):  # the delta and done events' shape: token, logprob, top (no bytes)
        return [(e.token, round(e.logprob, 4), [(t.token, round(t.logprob, 4)) for t in e.top_logprobs]) for e in entries]

    events = list(client.responses.create(stream=True, **ask))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == whole.output_text
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    joined = short([lp for e in deltas for lp in e.logprobs])
    assert joined == short(done.logprobs) == short(part.logprobs)
    assert short(events[-1].response.output[-1].content[0].logprobs) == short(part.logprobs)
    plain = client.responses.create(model=NAME, input=text, max_output_tokens=2)
    assert plain.output[-1].content[0].logprobs == [] and plain.top_logprobs is None


@pytest.mark.parametrize("body, param, says", [
    ({"top_logprobs": 2}, "top_logprobs", "include"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs", "20"),
    ({"include": ["message.input_image.image_url"]}, "include", "not supported"),
    ({"logprobs": True}, "logprobs", "not supported"),
])
def test_responses_logprobs_bad_requests(server, body, param, says):
    r = httpx.post(server.url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 1, **body}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and says in r.json()["error"]["message"], r.text


def test_echo_with_no_new_tokens_gives_the_prompts_logprobs(client, model, tokenizer):
    """echo, max_tokens 0, logprobs 1 (what lm-eval sends to score a text), for a string and token ids, whole and
    streamed: the text is the prompt, token_logprobs are None then each prompt token's logprob, no token is
    generated; echo with max_tokens 2 appends the new tokens after the prompt's."""
    prompt = tokenizer.encode(PROMPT)
    rows = log_softmax_after(model, prompt)
    want = [None] + [float(rows[i][t]) for i, t in enumerate(prompt[1:])]
    for sent in (PROMPT, prompt):
        out = client.completions.create(model=NAME, prompt=sent, max_tokens=0, echo=True, logprobs=1)
        choice = out.choices[0]
        assert choice.text == PROMPT and out.usage.completion_tokens == 0 and choice.finish_reason == "length"
        got = choice.logprobs.token_logprobs
        assert got[0] is None and choice.logprobs.top_logprobs[0] is None and len(got) == len(prompt)
        assert max(abs(a - b) for a, b in zip(got[1:], want[1:])) < TOL
        assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in prompt]
        for i, t in enumerate(prompt[1:]):
            assert_top(choice.logprobs.top_logprobs[i + 1], rows[i], 1, lambda k: tokenizer.decode([k]), t)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == PROMPT
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks), []) == pytest.approx(want, abs=TOL)
    both = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, echo=True, logprobs=0, temperature=0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    assert both.text.startswith(PROMPT) and len(both.logprobs.token_logprobs) == len(prompt) + 2
    assert both.logprobs.token_logprobs[:len(prompt)] == pytest.approx(want, abs=TOL)



def test_echo_of_token_ids_keeps_their_special_tokens(client, tokenizer):
    """echo of a token-id prompt holding special tokens (a chat turn's <|im_start|> / <|im_end|>), whole and
    streamed: the text is the ids decoded with their special tokens, as vLLM echoes them, so the echoed tokens'
    strings sit in it at their text_offset (once the special tokens were dropped from the text only)."""
    prompt = tokenizer.encode("<|im_start|>user\nHello<|im_end|>\n")
    assert set(tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])) <= set(prompt)
    assert tokenizer.decode(prompt, skip_special_tokens=True) == "user\nHello\n"  # what echo once sent
    choice = client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=0).choices[0]
    lp = choice.logprobs
    assert choice.text == tokenizer.decode(prompt) == "<|im_start|>user\nHello<|im_end|>\n"
    assert all(choice.text[o:o + len(t)] == t for o, t in zip(lp.text_offset, lp.tokens)), (choice.text, lp)
    streamed = client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_return_tokens_as_token_ids_writes_each_token_as_its_id(client, tokenizer):
    """vLLM's return_tokens_as_token_ids (RL clients read token ids back from the logprobs' strings): every token
    string, the tops' and the echoed prompt's too, is "token_id:N" of its id, whole and streamed, completions and
    chat, text_offset summing those strings; the values are the request's without it (it was ignored: the strings
    were the tokens' text)."""
    as_id = lambda t: f"token_id:{t}"  # noqa: E731
    prompt = tokenizer.encode(PROMPT)
    extra = {"return_token_ids": True, "ignore_eos": True}
    plain = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, logprobs=2, echo=True, temperature=0,
                                      extra_body=extra).choices[0]
    choice = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, logprobs=2, echo=True, temperature=0,
                                       extra_body=extra | {"return_tokens_as_token_ids": True}).choices[0]
    ids, lp = prompt + choice.token_ids, choice.logprobs
    assert lp.tokens == [as_id(t) for t in ids] and choice.token_ids == plain.token_ids
    assert lp.token_logprobs == pytest.approx(plain.logprobs.token_logprobs, abs=TOL)
    assert lp.text_offset == [sum(len(as_id(t)) for t in ids[:i]) for i in range(len(ids))]
    assert all(set(top) <= {as_id(t) for t in range(len(tokenizer))} and as_id(t) in top
               for top, t in zip(lp.top_logprobs[1:], ids[1:]))
    stream = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, logprobs=2, echo=True, temperature=0,
                                       stream=True, extra_body=extra | {"return_tokens_as_token_ids": True})
    streamed = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    messages = [{"role": "user", "content": "Hello world!"}]
    for stream in (False, True):
        out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, logprobs=True, top_logprobs=3,
                                             temperature=0, stream=stream,
                                             extra_body=extra | {"return_tokens_as_token_ids": True})
        chunks = list(out) if stream else [out]
        ids = sum((getattr(c.choices[0], "token_ids", None) or [] for c in chunks if c.choices), [])
        content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        assert [e.token for e in content] == [as_id(t) for t in ids] and len(ids) == 4
        assert all(e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 3 for e in content)
        assert all(top.token.startswith("token_id:") for e in content for top in e.top_logprobs)


def test_vllm_prompt_logprobs(server, model, tokenizer):
    """vLLM's prompt_logprobs: 2 on completions (and its choice's first streamed event) and chat: per prompt
    position None first, then {token id: {logprob, rank, decoded_token}}, the prompt's token first."""
    prompt = tokenizer.encode(PROMPT)
    rows = log_softmax_after(model, prompt)
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/completions", timeout=TIMEOUT, json={
            "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2, "stream": stream})
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            got = events[0]["choices"][0]["prompt_logprobs"]
            assert all("prompt_logprobs" not in e["choices"][0] for e in events[1:])
        else:
            got = r.json()["choices"][0]["prompt_logprobs"]
        assert got[0] is None and len(got) == len(prompt)
        for i, t in enumerate(prompt[1:]):
            position, row = got[i + 1], rows[i]
            assert list(position)[0] == str(t)
            assert abs(position[str(t)]["logprob"] - float(row[t])) < TOL
            assert position[str(t)]["rank"] == int((row >= row[t]).sum())
            assert position[str(t)]["decoded_token"] == tokenizer.decode([t])
            for k in row.topk(2).indices.tolist():
                assert abs(position[str(k)]["logprob"] - float(row[k])) < TOL
    r = httpx.post(server.url + "/v1/chat/completions", timeout=TIMEOUT, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0})
    assert r.status_code == 200 and r.json()["prompt_logprobs"][0] is None, r.text


CONTROLS = [dict(logit_bias={"7": 3.0}, presence_penalty=0.4), dict(logit_bias={"7": 3.0}, frequency_penalty=0.3),
            dict(logit_bias={"7": 3.0, "9": 2.9}, repetition_penalty=2.0), dict(logit_bias={"7": 3.0}),
            dict(min_tokens=3)]


@pytest.mark.parametrize("controls", CONTROLS, ids=lambda c: "-".join(c))
def test_each_control_changes_greedy_decoding_by_its_definition(client, model, tokenizer, controls):
    """Greedy completions with a control (sent as the openai client sends them: OpenAI's as arguments, vLLM's in
    extra_body) equal the reference decode loop applying that control's definition to model.prefill's logits, and
    differ from plain greedy decoding."""
    prompt = tokenizer.encode(PROMPT)
    plain = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0].token_ids
    openai_side = {k: v for k, v in controls.items() if k in ("logit_bias", "presence_penalty", "frequency_penalty")}
    extra = {k: v for k, v in controls.items() if k not in openai_side}
    stops = frozenset(plain[:2]) if "min_tokens" in controls else frozenset()
    extra.update(return_token_ids=True, ignore_eos=True, stop_token_ids=sorted(stops))
    got = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, extra_body=extra,
                                    **openai_side).choices[0].token_ids
    bias = {int(k): v for k, v in controls.get("logit_bias", {}).items()}
    params = check_params(0.0, 0, 1.0, **{**controls, "logit_bias": bias})
    want, _ = reference_decode(model, prompt, 8, params, stops)
    stop_at = next((i for i, t in enumerate(want) if t in stops), None)
    want = want if stop_at is None else want[:stop_at + 1]
    assert got == want != plain


def test_min_p_of_one_samples_the_most_likely_token(client):
    """min_p 1 keeps only the most likely token: any seed at any temperature gives the greedy tokens."""
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=6, extra_body={"ignore_eos": True})
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    sampled = client.completions.create(temperature=2.0, seed=5, **kw).choices[0].text
    kw["extra_body"] = {"ignore_eos": True, "min_p": 1.0}
    assert [client.completions.create(temperature=2.0, seed=s, **kw).choices[0].text for s in (5, 6)] == [greedy] * 2
    assert sampled != greedy


def test_include_stop_str_in_output(client):
    """A stop string from the middle of the greedy text ends it: before the stop string, or after it with vLLM's
    include_stop_str_in_output, whole and streamed; vLLM's stop_reason names it (null for a reply cut by length)."""
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    text = client.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0].text
    stop = text[4:6]
    assert stop and text.find(stop) == 4, text
    cut = client.completions.create(stop=[stop], extra_body={"ignore_eos": True}, **kw).choices[0]
    kept = client.completions.create(stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
                                     **kw).choices[0]
    chunks = list(client.completions.create(
        stop=[stop], stream=True, extra_body={"ignore_eos": True, "include_stop_str_in_output": True}, **kw))
    streamed = "".join(c.choices[0].text for c in chunks)
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (text[:4], "stop", stop)
    assert chunks[-1].choices[0].stop_reason == stop and chunks[0].choices[0].stop_reason is None
    assert client.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0].stop_reason is None
    assert (kept.text, kept.finish_reason) == (text[:6], "stop") and streamed == text[:6]


def test_a_stop_token_adds_no_text(client, tokenizer):
    """A stop_token_ids token that ends the reply (a word of the vocabulary, not a special token) is counted and
    returned among the token ids but adds no text, as vLLM answers (its text once ended the reply); with
    include_stop_str_in_output its text is kept; whole and streamed alike."""
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    ids = client.completions.create(extra_body={"ignore_eos": True, "return_token_ids": True}, **kw).choices[0].token_ids
    stop = ids[3]
    assert stop not in ids[:3] and tokenizer.decode([stop]), ids  # its first time, a token with text
    for include in (False, True):
        extra = {"ignore_eos": True, "stop_token_ids": [stop], "include_stop_str_in_output": include,
                 "return_token_ids": True}
        whole = client.completions.create(extra_body=extra, **kw)
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, extra_body=extra, **kw))
        want = tokenizer.decode(ids[:4] if include else ids[:3])
        choice = whole.choices[0]
        assert (choice.text, choice.finish_reason, choice.token_ids) == (want, "stop", ids[:4]), include
        assert streamed == want and whole.usage.completion_tokens == 4
        assert choice.stop_reason == stop  # vLLM's stop_reason: the stop_token_ids token that ended it


def test_skip_special_tokens_false_keeps_their_text(client, tokenizer):
    """vLLM's skip_special_tokens false (once refused) keeps a special token's text, whole and streamed; by default it
    is skipped; a special token that ends the reply as a stop token adds none either way."""
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=2, temperature=0, logit_bias={str(special): 100})
    for extra, want in (({}, ""), ({"skip_special_tokens": False}, "<|im_start|>" * 2),
                        ({"skip_special_tokens": False, "stop_token_ids": [special]}, "")):
        whole = client.completions.create(extra_body=extra, **kw).choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, extra_body=extra, **kw))
        assert whole == streamed == want, extra



def test_streamed_text_offsets_equal_the_whole_responses(client):
    """Streamed completions logprobs with a stop string (its text held back while it may begin the stop string, so
    the text sent lags the tokens) and echo, n 2: the events' tokens, text_offset and values joined equal the whole
    response's (text_offset sums the token strings before each token, whatever text was sent so far)."""
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=1, n=2)
    text = client.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0].text
    for extra in ({"ignore_eos": True}, {"ignore_eos": True, "include_stop_str_in_output": True}):
        for echo in (False, True):
            whole = client.completions.create(stop=[text[5:7]], echo=echo, extra_body=extra, **kw)
            joined = {0: ([], [], [], ""), 1: ([], [], [], "")}
            for chunk in client.completions.create(stop=[text[5:7]], echo=echo, extra_body=extra, stream=True, **kw):
                for c in chunk.choices:
                    tokens, offsets, values, got = joined[c.index]
                    lp = c.logprobs or openai.types.completion_choice.Logprobs()
                    tokens += lp.tokens or []
                    offsets += lp.text_offset or []
                    values += lp.token_logprobs or []
                    joined[c.index] = (tokens, offsets, values, got + c.text)
            for c in whole.choices:
                tokens, offsets, values, got = joined[c.index]
                assert (got, tokens, offsets) == (c.text, c.logprobs.tokens, c.logprobs.text_offset), (extra, echo)
                assert values == pytest.approx(c.logprobs.token_logprobs, abs=TOL)



def test_repetition_penalties_past_fp32s_range_serve(client):
    """repetition_penalty 1e-45 (0 in fp32: positive logits divided by it were inf, negative ones times it 0, a
    masked one NaN) and 1e39 (inf in fp32): valid JSON numbers > 0, served like fp32's extremes (once 1e-45 was a
    500, 'index -1 is out of bounds', the sampler given NaN, or other tokens), greedy and sampled."""
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=6, logprobs=1)
    for penalty, like in ((1e-45, 1.2e-38), (1e39, 3.4e38)):
        for temperature in (0.0, 1.0):
            extra = {"repetition_penalty": penalty, "ignore_eos": True, "return_token_ids": True}
            got = client.completions.create(temperature=temperature, seed=1, extra_body=extra, **kw).choices[0]
            want = client.completions.create(temperature=temperature, seed=1, extra_body={**extra, "repetition_penalty": like},
                                             **kw).choices[0]
            assert got.token_ids == want.token_ids and all(math.isfinite(v) for v in got.logprobs.token_logprobs)


BAD = [  # (path, body, param)
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),  # chat's is a boolean
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),  # without echo
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"100000": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": "1"}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
    ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
]


@pytest.mark.parametrize("path, body, param", BAD, ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD)])
def test_bad_values_are_400_naming_the_field(server, path, body, param):
    base = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(server.url + path, json={**base, "max_tokens": 1, **body}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


MIN_TOKENS = [  # (path, body, what the 400 names: the field the client sent, else the limit it did not set)
    ("/v1/completions", {"prompt": "x", "max_tokens": 3}, "max_tokens (3)"),
    ("/v1/completions", {"prompt": "x"}, "16, the most new tokens of a request that sets no limit"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}, "max_tokens (3)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3},
     "max_completion_tokens (3)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
     f"{MAX_CONTEXT}, the most new tokens of a request that sets no limit"),
    ("/v1/responses", {"input": "x", "max_output_tokens": 3}, "max_output_tokens (3)"),
]


@pytest.mark.parametrize("path, body, says", MIN_TOKENS, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(MIN_TOKENS)])
def test_min_tokens_past_the_limit_names_the_field_sent(server, path, body, says):
    """min_tokens past the limit on new tokens is a 400 in the API's words: the field the client sent, or the limit
    that applies when it sent none (the engine's argument, max_new_tokens, is no field of any endpoint)."""
    r = httpx.post(server.url + path, json={**body, "min_tokens": MAX_CONTEXT + 1}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["message"]) == ("min_tokens", f"min_tokens ({MAX_CONTEXT + 1}) must be at most {says}")


# lm-eval ----------------------------------------------------------------------------------------------------------
DOCS = [{"question": "The quick brown fox", "choices": ["jumps over", "sleeps", "runs away"], "answer": 0},
        {"question": "Hello world! How are", "choices": ["you today?", "they"], "answer": 0},
        {"question": "東京は日本の", "choices": ["首都です。", "天気"], "answer": 0}]
TASKS = {
    "tiny_ll": "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
               "doc_to_target: answer\nmetric_list:\n  - metric: acc\n",
    "tiny_gen": "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{choices[0]}}'\n"
                "generation_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 5\nmetric_list:\n  - metric: exact_match\n",
    "tiny_roll": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{question}} {{choices[0]}}'\n"
                 "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
}


@pytest.fixture
def lm_eval_tasks(tmp_path, monkeypatch):
    """lm-eval's TaskManager over TASKS' task files and DOCS as a local jsonl in tmp_path (offline: no hub)."""
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))  # (read when datasets is first imported)
    monkeypatch.chdir(tmp_path)
    from lm_eval.tasks import TaskManager

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in DOCS))
    for name, body in TASKS.items():
        (tmp_path / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                              f"    test: {data}\ntest_split: test\n{body}")
    return TaskManager(include_path=str(tmp_path))


def test_lm_eval_scores_through_the_server(server, model, checkpoint, lm_eval_tasks):
    """lm-eval's local-completions model on the server, with local task files over a local jsonl (offline): a
    loglikelihood (multiple choice) task and a generate_until task run to the end, and every loglikelihood it
    got equals the sum of log_softmax of model.prefill's logits over the continuation's tokens."""
    import lm_eval
    from lm_eval.api.registry import get_model

    lm = get_model("local-completions")(base_url=server.url + "/v1/completions", model=NAME, tokenizer=checkpoint,
                                        tokenizer_backend="huggingface", max_length=MAX_CONTEXT, max_retries=1)
    out = lm_eval.simple_evaluate(model=lm, tasks=["tiny_ll", "tiny_gen"], task_manager=lm_eval_tasks,
                                  log_samples=True)
    assert out["results"]["tiny_ll"]["sample_len"] == out["results"]["tiny_gen"]["sample_len"] == len(DOCS)
    assert 0.0 <= out["results"]["tiny_ll"]["acc,none"] <= 1.0
    scored = [(s["arguments"][k], s["resps"][k][0][0]) for s in out["samples"]["tiny_ll"]
              for k in range(len(s["arguments"]))]
    assert len(scored) == sum(len(d["choices"]) for d in DOCS)
    for (context, continuation), got in scored:
        context_ids, continuation_ids = lm._encode_pair(context, continuation)
        tokens = context_ids + continuation_ids
        rows = log_softmax_after(model, tokens[:-1])[len(context_ids) - 1:]
        want = sum(float(row[t]) for row, t in zip(rows, continuation_ids))
        assert math.isfinite(got) and abs(got - want) < TOL * len(continuation_ids), (context, continuation)
    generated = [s["resps"][0][0] for s in out["samples"]["tiny_gen"]]
    assert len(generated) == len(DOCS) and all(isinstance(g, str) for g in generated)


def test_lm_eval_rolling_windows_and_chat_through_the_server(server, client, model, tokenizer, lm_eval_tasks):
    """lm-eval with the server's own tokenizer (tokenizer_backend auto finds /tokenizer_info and /tokenize: its remote
    backend) on a loglikelihood_rolling task whose texts span several windows (max_length 8, batches of 2): each
    text's loglikelihood equals the sum, over lm-eval's windows, of log_softmax of model.prefill's logits; and
    local-chat-completions' generate_until through the chat template gives the server's own greedy chat replies."""
    import lm_eval
    from lm_eval import utils
    from lm_eval.api.registry import get_model

    lm = get_model("local-completions")(base_url=server.url + "/v1/completions", model=NAME, max_length=8,
                                        batch_size=2, max_retries=1)
    assert lm.tokenizer_backend == "remote"
    out = lm_eval.simple_evaluate(model=lm, tasks=["tiny_roll"], task_manager=lm_eval_tasks, log_samples=True)
    for sample in out["samples"]["tiny_roll"]:
        ((text,),), got = sample["arguments"], sample["resps"][0][0]
        tokens = tokenizer.encode(text, add_special_tokens=False)
        windows = list(map(utils.make_disjoint_window, utils.get_rolling_token_windows(
            tokens, tokenizer.eos_token_id, max_seq_len=lm.max_length - 1, context_len=1)))  # (lm-eval's max_length 7)
        assert len(windows) > 1
        want = 0.0
        for context, continuation in windows:
            rows = log_softmax_after(model, (context + continuation)[:-1])[len(context) - 1:]
            want += sum(float(row[t]) for row, t in zip(rows, continuation))
        assert abs(got - want) < TOL * len(tokens), text

    chat = get_model("local-chat-completions")(base_url=server.url + "/v1/chat/completions", model=NAME, max_retries=1)
    out = lm_eval.simple_evaluate(model=chat, tasks=["tiny_gen"], task_manager=lm_eval_tasks, log_samples=True,
                                  apply_chat_template=True)
    for doc, sample in zip(DOCS, out["samples"]["tiny_gen"]):
        reply = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": doc["question"]}],
                                               max_tokens=5, temperature=0, stop=["\n\n"])
        assert sample["resps"][0][0] == reply.choices[0].message.content

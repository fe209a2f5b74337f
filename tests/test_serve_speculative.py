"""metrale-serve --speculative-config as a real process (tools/serve.py on 127.0.0.1, a free port, started once for
the module) on a tiny checkpoint with a tokenizer whose model is issue 39's bigram checkpoint (its MTP head computes
the model's own next-token function: every draft is accepted), called with the official `openai` client:
completions and chat, whole and streamed, greedy output identical to Engine.generate without speculation in this
process (what a server without speculation answers: test_serve.py), and /metrics' acceptance counters moving by
exactly what a lone request verifies. The refused configurations end the tool before it listens (in-process:
exit code 2, the problem named, no traceback). Waits are bounded so that a hang fails fast."""

import json
import re

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from helpers import tiny_config
from metrale_graph import Engine, HybridModel
from metrale_graph.server.metrics import ServerMetrics
from metrale_graph.tools.serve import main
from server_process import running_server
from speculative_reference import bigram_model
from tokenizer_fixture import build_tokenizer

NAME = "tiny-bigram"
K = 3
CONFIG = json.dumps({"method": "mtp", "num_speculative_tokens": K})
MAX_CONTEXT = 256
TIMEOUT = 120

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("bigram"))
    build_tokenizer(folder)
    vocab = len(AutoTokenizer.from_pretrained(folder))
    bigram_model(tiny_config(vocab_size=vocab, mtp_num_hidden_layers=1)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    flags = ["--served-model-name", NAME, "--num-slots", "4", "--max-context", str(MAX_CONTEXT),
             "--shutdown-timeout", "3", "--speculative-config", CONFIG]
    with running_server(checkpoint, tmp_path_factory.mktemp("server"), flags, TIMEOUT) as proc:
        yield proc


@pytest.fixture(scope="module")
def engine(checkpoint):
    """The same checkpoint in this process, without speculation: the reference outputs."""
    model = HybridModel.from_pretrained(checkpoint, progress=False)
    engine = Engine(model, num_slots=4, max_context=MAX_CONTEXT, compile=False)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def _speculative_counters(server) -> dict[str, float]:
    """/metrics' spec_decode counters, {name: value} (the model_name label left out)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    found = re.findall(r"^metrale_(spec_decode_\w+)_total\{[^}]*\} (\S+)$", text, re.M)
    return {name: float(value) for name, value in found}


def test_completions_whole_and_streamed_equal_plain_decoding(client, engine):
    text = "The quick brown fox"
    ids = engine.tokenizer.encode(text)
    for n in (1, 2, 13, 30):  # max_tokens inside and at the end of a run of k + 1
        want = engine.generate([ids], max_new_tokens=n, stop_token_ids=[])[0].token_ids
        out = client.completions.create(model=NAME, prompt=text, max_tokens=n, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        (choice,) = out.choices
        assert (choice.token_ids, choice.text, choice.finish_reason) == (want, engine.decode(want), "length")
        assert out.usage.completion_tokens == n
    chunks = list(client.completions.create(model=NAME, prompt=text, max_tokens=30, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == 30
    # with the model's stop tokens (ignore_eos off): the same request as without speculation
    want = engine.generate([ids], max_new_tokens=30)[0]
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=30, temperature=0,
                                    extra_body={"return_token_ids": True}).choices[0]
    assert (out.token_ids, out.finish_reason) == (want.token_ids, want.finish_reason)


def test_chat_whole_and_streamed_equal_plain_decoding(client, engine):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world!"}]
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    want = engine.generate([prompt], max_new_tokens=20, stop_token_ids=[])[0].token_ids
    kw = dict(model=NAME, messages=messages, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    out = client.chat.completions.create(**kw)
    assert out.choices[0].message.content == engine.decode(want) and out.usage.completion_tokens == len(want)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_metrics_count_the_drafts_a_request_verifies(server, client):
    before = _speculative_counters(server)
    assert set(before) == {"spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_drafts",
                           "spec_decode_verify_steps"}
    n = 1 + 4 * (K + 1)  # the prompt's step gives a token, then 4 verify steps of k + 1
    out = client.completions.create(model=NAME, prompt=[5, 6, 7], max_tokens=n, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == n
    after = _speculative_counters(server)
    moved = {name: after[name] - before[name] for name in before}
    # the bigram head's drafts are the model's own tokens: every one accepted, k + 1 tokens per verify step
    assert moved == {"spec_decode_num_draft_tokens": 4 * K, "spec_decode_num_accepted_tokens": 4 * K,
                     "spec_decode_num_drafts": 4, "spec_decode_verify_steps": 4}


def test_a_server_without_speculation_has_no_acceptance_counters(engine):
    from prometheus_client import generate_latest

    assert b"spec_decode" not in generate_latest(ServerMetrics(engine, NAME).registry)


@pytest.mark.parametrize("flags, message", [
    (["--speculative-config", '{"method": "mtp", num_speculative_tokens: 3}'],
     r"--speculative-config: not valid JSON \(Expecting property name"),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3, "model": "draft"}'],
     r"--speculative-config: unknown key\(s\) 'model'; the keys taken are 'method', 'num_speculative_tokens'"),
    (["--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 3}'], "unknown method 'eagle3'"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
     r"num_speculative_tokens \(the drafts per step\) must be an integer >= 1, got 0"),
    (["--speculative-config", '{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}'],
     r"prompt_lookup_min \(5\) must be at most prompt_lookup_max \(3\)"),
    (["--speculative-config", CONFIG], r"--speculative-config: --model tiny: speculative method 'mtp' needs the "
                                       r"model's multi-token-prediction head, and this model has none: no mtp\.\*"),
])
def test_refused_configs_end_the_tool_before_it_listens(capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        main(["--model", "tiny", "--device", "cpu", "--eager", "--port", "0", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert re.search(message, err), err


def test_a_checkpoint_without_mtp_tensors_is_refused_before_it_loads(tmp_path, capsys):
    """config.json declares the head but the files do not hold it (transformers' save_pretrained drops mtp.*): the
    checkpoint's headers are read, not its weights."""
    folder = tmp_path / "no-head"
    HybridModel.from_preset(tiny_config()).save_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"mtp_num_hidden_layers": 1}))
    with pytest.raises(SystemExit) as e:
        main(["--model", str(folder), "--device", "cpu", "--eager", "--port", "0", "--speculative-config", CONFIG])
    assert e.value.code == 2 and "has none: no mtp.* weights" in capsys.readouterr().err

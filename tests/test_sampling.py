"""Sampling controls and logprobs, against plain references: the logits processors (token bitmask, logit_bias,
min_tokens, repetition / frequency / presence penalties) over several steps of rows in slots that are reused,
the draw's distribution (temperature, min_p, top-k, top-p), the raw logprobs, and the Engine end to end (its
logprobs and prompt logprobs equal log_softmax of model.prefill's logits; each control changes greedy
decoding as a reference decode loop over model.prefill says; bad controls are ValueErrors naming them), and
the stop strings' include_stop_str_in_output and min_tokens."""

import pytest
import math

import torch

from helpers import random_tokens, tiny_config
from metrale_graph import Engine, HybridModel
from metrale_graph.detokenizer import StreamingText
from metrale_graph.logits_processors import PenaltyState, process_logits
from metrale_graph.sampling import SampleRow, SamplingParams, check_params, new_generator, probabilities, sample
from sampling_reference import reference_decode, reference_logits, reference_probs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 37  # not a multiple of 32: the bitmask's last word is partial


CONTROLS = {  # the control under test on some rows, the others left neutral
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.7),
    "repetition": dict(repetition_penalty=1.8),
    "negative_penalties": dict(presence_penalty=-0.5, frequency_penalty=-0.3, repetition_penalty=0.6),
    "logit_bias": dict(logit_bias={3: 2.5, 36: -100.0, 10: 0.75}),
    "min_tokens": dict(min_tokens=3),
    "bitmask": dict(),
    "all": dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3, logit_bias={5: 1.0},
                min_tokens=2),
}


@pytest.mark.parametrize("control", list(CONTROLS))
def test_processed_logits_follow_the_definitions_over_steps(control):
    """Five requests in slots of a PenaltyState over ten steps (greedy and sampled rows, the control on three of
    them), one replaced mid-way by a new request in the same slot: each step's processed logits equal the
    reference's for every row, greedy rows take their argmax, sampled rows draw inside their support."""
    torch.manual_seed(1)
    kw = CONTROLS[control]
    state = PenaltyState(num_slots=8, vocab_size=VOCAB, device=torch.device("cpu"))
    slots = [6, 1, 3, 0, 4]
    temps = [0.0, 2.0, 0.0, 1.5, 0.0]

    def request(k, seed):
        params = check_params(temps[k], 0, 1.0, **(kw if k in (0, 1, 3) else {}))
        prompt = random_tokens(4 + k, seed=seed, vocab=VOCAB)
        stops = frozenset({2, 7}) if k != 4 else frozenset()
        return dict(params=params, prompt=prompt, stops=stops, out=[], gen=new_generator(seed))

    requests = [request(k, 10 + k) for k in range(5)]
    bitmask = None
    for step in range(10):
        if step == 5:
            requests[0] = request(0, 99)  # a new request in slot 6: nothing of the last one's counts
        logits = torch.randn(5, VOCAB) * 2
        if control in ("bitmask", "all"):
            bitmask = torch.randint(-2**31, 2**31, (5, 2), dtype=torch.int64).to(torch.int32)
            bitmask[:, 0] |= 1 << 3  # a token every row may take
        rows = [SampleRow(q["params"], q["gen"], slot, len(q["out"]), q["prompt"], q["stops"])
                for q, slot in zip(requests, slots)]
        x = process_logits(logits, rows, state, bitmask)
        tokens = sample(logits, rows, state, bitmask).tokens.tolist()
        for k, q in enumerate(requests):
            want = reference_logits(logits[k], q["params"], q["prompt"], q["out"], q["stops"],
                                    None if bitmask is None else bitmask[k])
            torch.testing.assert_close(x[k].double(), want, rtol=1e-6, atol=1e-5, msg=f"step {step} row {k}")
            if q["params"].greedy:
                assert tokens[k] == int(want.argmax()), (step, k)
            else:
                assert reference_probs(want, q["params"])[tokens[k]] > 0, (step, k)
            q["out"].append(tokens[k])
    if control in ("presence", "frequency", "repetition", "all"):  # the control mattered: a token came back
        assert any(len(set(q["out"])) < len(q["out"]) for q in requests[:4]), [q["out"] for q in requests]


def test_min_tokens_gives_way_where_the_bitmask_allows_only_stops():
    """A row whose bitmask allows nothing but its stop tokens (a grammar whose output is whole) keeps them under
    min_tokens (vLLM's rule, vllm-project/vllm#54218: masking them left every token -inf, and a draw from nothing);
    beside it, a held row with other tokens allowed and a row without a bitmask's limit still lose their stops."""
    torch.manual_seed(3)
    logits = torch.randn(3, VOCAB)
    bitmask = torch.zeros(3, 2, dtype=torch.int32)
    bitmask[0, 0] = (1 << 5) | (1 << 9)  # only the stop tokens 5 and 9
    bitmask[1, 0] = (1 << 5) | (1 << 11)  # a stop and an ordinary token
    bitmask[2] = -1  # everything
    rows = [SampleRow(check_params(t, 0, 1.0, min_tokens=4), new_generator(k), k, 1, (), frozenset({5, 9}))
            for k, t in enumerate((0.0, 0.0, 1.0))]
    x = process_logits(logits, rows, None, bitmask)
    for k, row in enumerate(rows):
        want = reference_logits(logits[k], row.params, (), [0], row.stop_ids, bitmask[k])
        torch.testing.assert_close(x[k].double(), want)
    assert torch.isfinite(x[0, [5, 9]]).all() and x[0].isfinite().sum() == 2
    assert x[1].isfinite().tolist() == [t == 11 for t in range(VOCAB)] and not x[2, [5, 9]].isfinite().any()
    assert sample(logits, rows, None, bitmask).tokens[0].item() in (5, 9)


def test_neutral_rows_are_not_copied():
    """Rows without any control give back the logits themselves: nothing copied, nothing changed."""
    logits = torch.randn(3, VOCAB)
    rows = [SampleRow(SamplingParams(temperature=t)) for t in (0.0, 1.0, 0.5)]
    assert process_logits(logits, rows, None) is logits


SAMPLED = [SamplingParams(1.0), SamplingParams(0.7, min_p=0.2), SamplingParams(1.3, top_k=5, min_p=0.05),
           SamplingParams(0.9, top_p=0.6, min_p=0.1), SamplingParams(2.0, top_k=9, top_p=0.8),
           SamplingParams(1.0, min_p=1.0)]


def test_probabilities_follow_the_definitions():
    """temperature, min_p (relative to the most likely token after temperature), top-k, then top-p: the
    distribution a row draws from equals the reference's."""
    logits = torch.randn(len(SAMPLED), VOCAB) * 3
    got = probabilities(logits, SAMPLED)
    for k, p in enumerate(SAMPLED):
        torch.testing.assert_close(got[k].double(), reference_probs(logits[k].double(), p), rtol=1e-5, atol=1e-6,
                                   msg=str(p))
    assert (got[-1] > 0).sum() == 1  # min_p 1: the most likely token alone


def test_min_p_draws_follow_the_distribution():
    """4000 rows with their own generators: the draws' frequencies are min_p's distribution, and tokens below
    min_p times the top probability never come."""
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.3, 0.15, 0.1]]))
    p = SamplingParams(1.0, min_p=0.3)  # 0.3 * 0.4 = 0.12: tokens 0 and 4 dropped
    n = 4000
    tokens = sample(logits.expand(n, 5), [SampleRow(p, new_generator(k)) for k in range(n)]).tokens
    freq = torch.bincount(tokens, minlength=5).double() / n
    want = torch.tensor([0.0, 0.4, 0.3, 0.15, 0.0], dtype=torch.float64) / 0.85
    assert freq[0] == 0 and freq[4] == 0
    assert (freq - want).abs().max() < 0.03, freq


def test_logprobs_are_the_raw_distribution():
    """A row's logprobs are log_softmax of its raw logits whatever its sampling does (temperature, penalties,
    bias, bitmask): the sampled token's value and rank, and its own number of top tokens, most likely first;
    rows that do not ask get None."""
    logits = torch.randn(4, VOCAB).to(torch.bfloat16)
    state = PenaltyState(4, VOCAB, torch.device("cpu"))
    params = [check_params(0.0, 0, 1.0, logprobs=3, logit_bias={4: 50.0}),  # samples token 4, unlikely raw
              check_params(1.7, 0, 1.0, logprobs=0, presence_penalty=1.0, repetition_penalty=2.0),
              check_params(0.0, 0, 1.0),
              check_params(0.8, 5, 0.9, logprobs=20)]
    rows = [SampleRow(p, new_generator(k), k, 0, [1, 2], frozenset()) for k, p in enumerate(params)]
    bitmask = torch.full((4, 2), -1, dtype=torch.int32)
    result = sample(logits, rows, state, bitmask)
    tokens, entries = result.to_host()
    raw = torch.log_softmax(logits.float(), -1)
    assert tokens[0] == 4 and entries[2] is None
    for k in (0, 1, 3):
        e = entries[k]
        assert e.logprob == pytest.approx(float(raw[k, tokens[k]]), abs=1e-6)
        assert e.rank == int((raw[k] >= raw[k, tokens[k]]).sum())
        top = raw[k].topk(params[k].logprobs)
        assert [t for t, _ in e.top] == top.indices.tolist()
        assert [v for _, v in e.top] == pytest.approx(top.values.tolist(), abs=1e-6)


def test_a_row_samples_alike_alone_and_in_a_batch():
    """A penalized, biased, sampled row gives the same tokens over steps alone or beside other rows (its own
    generator, its own slot's statistics)."""
    p = check_params(1.2, 0, 1.0, presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.5,
                     logit_bias={1: 1.0}, min_p=0.05)
    runs = []
    for batch in (False, True):
        state, gen, out = PenaltyState(4, VOCAB, torch.device("cpu")), new_generator(3), []
        other = SampleRow(check_params(0.9, 0, 1.0, frequency_penalty=1.0), new_generator(8), 0, 0, [5])
        g = torch.Generator().manual_seed(0)
        for step in range(8):
            logits = torch.randn(2, VOCAB, generator=g)
            row = SampleRow(p, gen, 2, step, [1, 2, 3])
            if batch:
                other = other._replace(generated=step)
                out.append(sample(logits, [other, row], state).tokens[1].item())
            else:
                out.append(sample(logits[1:], [row], state).tokens[0].item())
        runs.append(out)
    assert runs[0] == runs[1]


# the engine ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return HybridModel.from_preset("tiny", seed=3)


def test_engine_logprobs_equal_the_models_log_softmax(tiny):
    """generate with logprobs and prompt_logprobs, with a prompt chunked over steps (the budget is 12 tokens),
    prefix caching on (a request with prompt logprobs restores nothing) and requests without them in the same
    steps: every value equals log_softmax of model.prefill's logits; the first prompt token has None."""
    engine = Engine(tiny, num_slots=3, token_budget=12, block_size=16, max_context=96, compile=False,
                    prefix_cache=True)
    prompts = [random_tokens(n, seed=40 + n) for n in (30, 5, 17)]
    engine.generate(prompts[:1], max_new_tokens=2)  # cached: the next request must not restore it
    results = engine.generate(prompts, max_new_tokens=4, logprobs=2, prompt_logprobs=3)
    plain = engine.generate(prompts, max_new_tokens=4)
    for prompt, r, q in zip(prompts, results, plain):
        want, logprobs = reference_decode(tiny, prompt, 4)
        assert r.token_ids == want == q.token_ids and q.logprobs is None and q.prompt_logprobs is None
        assert r.cached_tokens == 0 and r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(prompt)
        entries = r.prompt_logprobs[1:] + r.logprobs
        for i, (token, e) in enumerate(zip(prompt[1:] + want, entries)):
            assert e.logprob == pytest.approx(float(logprobs[i][token]), abs=1e-5), i
            top = logprobs[i].topk(3 if i < len(prompt) - 1 else 2)
            assert [t for t, _ in e.top] == top.indices.tolist(), i
    engine.shutdown()


ENGINE_CONTROLS = [dict(logit_bias={7: 0.5}, presence_penalty=0.3), dict(logit_bias={7: 0.5}, frequency_penalty=0.1),
                   dict(logit_bias={7: 0.5, 9: 0.45}, repetition_penalty=5.0), dict(min_tokens=3),
                   dict(logit_bias={7: 0.5})]


@pytest.mark.parametrize("controls", ENGINE_CONTROLS, ids=lambda c: "-".join(c))
def test_engine_greedy_decoding_follows_each_control(tiny, controls):
    """Greedy decoding with a control equals a reference decode loop over model.prefill applying its definition,
    in a batch with other requests, and differs from decoding without it (the control did something)."""
    engine = Engine(tiny, num_slots=3, token_budget=16, block_size=16, max_context=96, compile=False)
    prompts = [random_tokens(n, seed=60 + n, vocab=tiny.config.vocab_size) for n in (6, 11)]
    plain = [r.token_ids for r in engine.generate(prompts, max_new_tokens=8)]
    stops = frozenset({plain[0][0], plain[0][1]}) if "min_tokens" in controls else frozenset()
    got = engine.generate(prompts[:1] + prompts, max_new_tokens=8, stop_token_ids=sorted(stops), **controls)
    params = check_params(0.0, 0, 1.0, **controls)
    want, _ = reference_decode(tiny, prompts[0], 8, params, stops)
    stop_at = next((i for i, t in enumerate(want) if t in stops), None)
    want = want if stop_at is None else want[:stop_at + 1]
    assert got[0].token_ids == got[1].token_ids == want != plain[0]
    engine.shutdown()


BAD_CONTROLS = [
    (dict(presence_penalty=2.5), "presence_penalty must be a number in \\[-2, 2\\]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(min_p=1.5), "min_p must be a number in \\[0, 1\\]"),
    (dict(logit_bias={10**6: 1.0}), "logit_bias: 1000000 is not a token id"),
    (dict(logit_bias={3: 101}), "logit_bias: the bias of token 3 must be a number in \\[-100, 100\\]"),
    (dict(logit_bias=[(3, 1.0)]), "logit_bias must be a mapping"),
    (dict(min_tokens=9), "min_tokens \\(9\\) must be at most max_new_tokens \\(4\\)"),
    (dict(min_tokens=-1), "min_tokens must be an integer >= 0"),
    (dict(logprobs=21), "logprobs must be None or an integer in \\[0, 20\\]"),
    (dict(prompt_logprobs=True), "prompt_logprobs must be None or an integer"),
    (dict(top_logprobs=2), "top_logprobs is not a sampling control"),
]


@pytest.mark.parametrize("controls, message", BAD_CONTROLS, ids=[next(iter(c)) + str(i) for i, (c, _) in
                                                                  enumerate(BAD_CONTROLS)])
def test_bad_controls_raise_naming_them(tiny, controls, message):
    engine = Engine(tiny, num_slots=2, token_budget=8, block_size=16, max_context=32, compile=False)
    with pytest.raises(ValueError, match=message):
        engine.generate([[1, 2]], max_new_tokens=4, **controls)
    with pytest.raises(ValueError, match=message):
        engine.submit([1, 2], max_new_tokens=4, **controls)
    assert engine.stats().waiting == 0 and engine.stats().steps == 0
    engine.shutdown()


def test_logprobs_past_a_small_vocabulary_are_refused_before_anything_runs():
    """logprobs / prompt_logprobs within [0, 20] but above the model's vocabulary (a vocabulary of 3 tokens) are a
    ValueError naming it before anything is queued (were an AssertionError in token_logprobs that failed the request
    after its step ran); the whole vocabulary is taken: every token's logprob, their probabilities summing to 1."""
    model = HybridModel.from_preset(tiny_config(vocab_size=3), seed=1)
    engine = Engine(model, num_slots=2, token_budget=8, block_size=16, max_context=32, compile=False)
    for controls in (dict(logprobs=4), dict(prompt_logprobs=20), dict(logprobs=3, prompt_logprobs=4)):
        name, value = [(k, v) for k, v in controls.items() if v > 3][0]
        with pytest.raises(ValueError, match=f"{name}={value} asks for more top tokens than the model's vocabulary "
                                             r"holds \(3 tokens\)"):
            engine.generate([[1, 2]], max_new_tokens=2, **controls)
        with pytest.raises(ValueError, match=f"{name}={value} asks"):
            engine.submit([1, 2], max_new_tokens=2, temperature=1.0, **controls)
    assert engine.stats().waiting == 0 and engine.stats().steps == 0
    r = engine.generate([[1, 2]], max_new_tokens=2, stop_token_ids=[], logprobs=3, prompt_logprobs=3)[0]
    for entry in r.logprobs + r.prompt_logprobs[1:]:
        assert sorted(t for t, _ in entry.top) == [0, 1, 2]
        assert abs(sum(math.exp(lp) for _, lp in entry.top) - 1) < 1e-5
    engine.shutdown()


class _Chars:
    """A tokenizer of one character per token id (id = code point)."""

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_stop_strings_with_include_and_min_tokens():
    """include_stop_str_in_output keeps the stop string (vLLM); with min_tokens a stop string ends the text only
    from token min_tokens + 1 on."""
    def run(text, **kw):
        t = StreamingText(_Chars(), [], stop=("ab",), **kw)
        pieces = [t.add([ord(c)], final=False) for c in text]
        return "".join(p for p, _ in pieces), any(s for _, s in pieces)

    assert run("xxabyy") == ("xx", True)
    assert run("xxabyy", include_stop=True) == ("xxab", True)
    assert run("abxabyy", min_tokens=2) == ("abx", True)  # the first "ab" ends at token 2: too early
    assert run("abxabyy", min_tokens=2, include_stop=True) == ("abxab", True)
    assert run("xab", min_tokens=3) == ("xa", False)  # "ab" ends at token 3: not a stop; its last character held


# on a GPU -----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_sample_reads_nothing_back_on_cuda():
    """sample() with every control (token bitmask, logit_bias, min_tokens, penalties starting and counting, min_p,
    top-k / top-p, logprobs) never synchronizes with the host: torch's sync debug mode raises on any read of the
    device (an .item(), a .tolist(), a pageable copy) over three steps, one of them starting new requests."""
    dev, vocab = torch.device("cuda"), 1000
    state = PenaltyState(8, vocab, dev)
    params = [check_params(0.0, 0, 1.0, presence_penalty=0.5, frequency_penalty=0.2, logprobs=5),
              check_params(0.9, 40, 0.9, repetition_penalty=1.3, min_p=0.05, logit_bias={3: 2.0}, logprobs=0),
              check_params(1.1, 0, 1.0, min_tokens=2), check_params(0.0, 0, 1.0)]
    bitmask = torch.full((4, -(-vocab // 32)), -1, dtype=torch.int32, device=dev)
    logits = torch.randn(4, vocab, device=dev, dtype=torch.bfloat16)

    def rows(generated, seed):
        return [SampleRow(p, new_generator(seed + k), 2 * k, generated, [1, 2, 3 + k], frozenset({7}))
                for k, p in enumerate(params)]

    sample(logits, rows(0, 0), state, bitmask).to_host()  # kernels loaded, pinned memory pooled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        results = [sample(logits, rows(g, 10 * g), state, bitmask) for g in (0, 1, 2)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    tokens, entries = results[-1].to_host()
    assert len(tokens) == 4 and entries[0] is not None and len(entries[0].top) == 5 and entries[3] is None


@pytest.mark.gpu
def test_graph_engine_logprobs_and_controls_equal_the_eager_engine():
    """On CUDA with every step a graph replay (prompt chunks asking for prompt logprobs run eagerly beside it): greedy
    tokens with penalties, logit_bias and min_tokens equal the eager engine's, and logprobs and prompt logprobs
    equal log_softmax of model.prefill's logits (fp32)."""
    from metrale_graph import PRESETS, Stream

    cfg = PRESETS["qwen3.5-9b"].replace(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
                                        linear_num_value_heads=4)
    model = HybridModel.from_preset(cfg, dtype=torch.float32, device="cuda", seed=5)
    prompts = [random_tokens(n, seed=70 + n, vocab=cfg.vocab_size) for n in (5, 37, 100)]
    opts = dict(num_slots=4, max_context=256, token_budget=64, batch_sizes=[4], token_counts=[4, 64])
    kw = dict(max_new_tokens=10, logprobs=4, prompt_logprobs=2, presence_penalty=0.5, frequency_penalty=0.3,
              repetition_penalty=1.2, logit_bias={7: 1.0}, min_tokens=2, stop_token_ids=[11])
    with Engine(model, **opts) as graphs, Engine(model, compile=False, **opts) as eager:
        assert graphs.runner is not None and graphs.runner.use_graphs
        got, want = graphs.generate(prompts, **kw), eager.generate(prompts, **kw)
    for prompt, a, b in zip(prompts, got, want):
        assert a.token_ids == b.token_ids
        cache = model.new_cache(1, 16, 16, 256)
        rows = [torch.log_softmax(model.prefill(cache, [Stream(0, [t])]).float(), -1)[0].cpu()
                for t in prompt + a.token_ids[:-1]]
        values = [e.logprob for e in a.prompt_logprobs[1:] + a.logprobs]
        assert a.prompt_logprobs[0] is None and len(values) == len(rows)
        for i, (t, v) in enumerate(zip(prompt[1:] + a.token_ids, values)):
            assert abs(v - float(rows[i][t])) < 1e-4, i


def test_row_cumsum_is_opaque_to_the_compiler_and_exact():
    """sampling.row_cumsum: torch.cumsum eagerly, an op of its own under torch.compile (Inductor's split scan of a
    vocabulary-long row fails to generate code for a dynamic row count on CUDA, torch 2.11: sampling.row_cumsum's
    docstring), so the graph the speculative tail compiles holds no aten cumsum; the op passes opcheck and gives
    the eager values exactly (the same kernel)."""
    from torch.library import opcheck

    from metrale_graph.sampling import _row_cumsum_op, _sorted_probs, row_cumsum

    x = torch.rand(3, 1000)
    opcheck(_row_cumsum_op, (x,))
    assert torch.equal(row_cumsum(x), torch.cumsum(x, dim=-1))
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def sorted_probs(logits, temps, top_k, top_p, log_min_p):
        return _sorted_probs(logits, temps, top_k, top_p, log_min_p)

    fn = torch.compile(sorted_probs, backend=backend, fullgraph=True, dynamic=True)
    logits = torch.randn(5, 300)
    args = (logits, torch.full((5,), 0.7), torch.full((5,), 50), torch.full((5,), 0.9), torch.full((5,), -math.inf))
    got, want = fn(*args), _sorted_probs(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert any("row_cumsum" in t for t in targets) and not any("cumsum" in t and "row_cumsum" not in t for t in targets)

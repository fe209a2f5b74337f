"""The MTP head as a drafter (issue 39, items 1-2), on the CPU without the engine: draft_mtp's logits against the
head built from transformers' own decoder layer and norms (fp32, each family), over two rounds whose second
rewrites the first's draft entries; the bigram checkpoint of the done-when (its drafts are the model's greedy
continuation: every draft accepted, k + 1 tokens a step, the output plain greedy decoding's) and the same model
with a random head (drafts mostly rejected, the output still plain decoding's), n-gram drafts through the same
loop; sampled drafts; the cache's MTP pools and bookkeeping; bad input named before anything changes."""

import pytest
import torch
import torch.nn.functional as F

from helpers import moe_config, tiny_config, unit_gain
from metrics import rel_err
from speculative_reference import (bigram_model, greedy_decode, prefill_hidden, speculative_greedy,
                                   with_random_mtp)
from metrale_graph import HybridModel
from metrale_graph.config import FULL
from metrale_graph.sampling import SamplingParams, new_generator, probabilities
from metrale_graph.speculative import draft_mtp
from metrale_graph.weights import hf_state_dict

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIGS = {
    "qwen3_5_text": tiny_config(mtp_num_hidden_layers=1),
    "qwen3_5_moe_text": moe_config(mtp_num_hidden_layers=1, tie_word_embeddings=True),
    "qwen3_next": moe_config("qwen3_next", mtp_num_hidden_layers=1),
}


def transformers_head(model):
    """The MTP head of `model` from transformers' modules: its decoder layer as the one layer of a family model
    of one full-attention layer whose final norm is mtp.norm (the layer, the norm and the LM head in one forward
    over inputs_embeds), and the family's RMSNorm for the fc's two norms. Returns step(x [T, D]) -> the head's
    normed outputs [T, D] of a whole sequence of fc inputs, fc_input(tokens, hidden) -> x, and the LM head."""
    import transformers

    cfg = model.config
    aux = cfg.replace(num_hidden_layers=1, layer_types=(FULL,), mtp_num_hidden_layers=0)
    params = dict(model.named_parameters())
    weights = {n: p for n, p in params.items() if not n.startswith(("layers.", "mtp."))}
    weights.update({"layers.0." + n[len("mtp.layers.0."):]: p for n, p in params.items()
                    if n.startswith("mtp.layers.0.")})
    weights["norm.weight"] = params["mtp.norm.weight"]
    hf = getattr(transformers, aux.family.causal_lm_class)(getattr(transformers, aux.family.config_class)(**aux.to_hf()))
    if cfg.num_experts:
        hf.set_experts_implementation("eager")
    missing, unexpected = hf.load_state_dict(hf_state_dict(weights, aux), strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    assert hf.lm_head.weight is hf.model.embed_tokens.weight or not cfg.tie_word_embeddings
    hf = hf.float().eval()
    norms = []
    for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"):
        norm = type(hf.model.norm)(cfg.hidden_size, eps=cfg.rms_norm_eps)
        norm.weight.data.copy_(params[name])
        norms.append(norm)

    def fc_input(tokens, hidden):
        e = F.embedding(torch.as_tensor(tokens), params["embed_tokens.weight"])
        return F.linear(torch.cat([norms[0](e), norms[1](hidden)], -1), params["mtp.fc.weight"])

    def step(x):
        return hf.model(inputs_embeds=x[None]).last_hidden_state[0]

    return step, fc_input, hf.lm_head


@torch.no_grad()
def oracle_drafts(model, follow, hidden, k):
    """The head's k greedy drafts' logits [k, V] after it has read (follow, hidden) at positions 0 .., from
    transformers' layer (transformers_head), the whole sequence recomputed each draft."""
    step, fc_input, lm_head = transformers_head(model)
    x, out = fc_input(follow, hidden), []
    for _ in range(k):
        h = step(x)[-1:]
        out.append(lm_head(h)[0])
        x = torch.cat([x, fc_input([int(out[-1].argmax())], h)])
    return torch.stack(out)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_drafts_match_transformers_layers(family):
    """Two rounds: a prompt, drafts; then a step of tokens that are not the drafts (the head's catch-up rewrites the
    draft entries) and drafts again. Each round's draft logits against the head of transformers' modules over the
    whole sequence (fp32)."""
    model = unit_gain(HybridModel.from_preset(CONFIGS[family], seed=1), seed=2)
    cache, k = model.new_cache(2, 16, 8), 3
    first, second = [9, 4, 77, 31, 2, 150, 6, 18, 90, 11, 23], [40, 41, 42, 43, 44]
    h1 = prefill_hidden(model, cache, 1, first)
    x1 = int(model.head(h1[-1:])[0].argmax())
    got1 = draft_mtp(model, cache, 1, first[1:] + [x1], h1, k)
    assert cache.mtp_context_lens[1] == len(first) and cache.context_lens[1] == len(first)
    h2 = prefill_hidden(model, cache, 1, [x1] + second)
    x2 = int(model.head(h2[-1:])[0].argmax())
    got2 = draft_mtp(model, cache, 1, second + [x2], h2, k)
    want1 = oracle_drafts(model, first[1:] + [x1], h1, k)
    want2 = oracle_drafts(model, first[1:] + [x1] + second + [x2], torch.cat([h1, h2]), k)
    for got, want in ((got1, want1), (got2, want2)):
        assert got.tokens == want.argmax(-1).tolist() and got.probs is None
        assert rel_err(got.logits, want) <= 1e-4, rel_err(got.logits, want)


@pytest.fixture(scope="module")
def bigram_checkpoints(tmp_path_factory):
    """family -> the folder of its bigram checkpoint (speculative_reference.bigram_model, saved)."""
    out = {}
    for family in ("qwen3_5_text", "qwen3_next"):
        out[family] = str(tmp_path_factory.mktemp(family))
        bigram_model(CONFIGS[family], seed=3).save_pretrained(out[family])
    return out


PROMPT = [3, 17, 100, 5, 9, 200, 14]


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
@pytest.mark.parametrize("k", [1, 3])
def test_a_bigram_checkpoint_drafts_its_own_greedy_continuation(bigram_checkpoints, family, k):
    """The done-when's chain: every draft accepted, k + 1 tokens a verify step, the output plain greedy decoding's."""
    model = HybridModel.from_pretrained(bigram_checkpoints[family], progress=False)
    want = greedy_decode(model, PROMPT, 24)
    got, steps = speculative_greedy(model, PROMPT, 24, k)
    assert got == want
    assert steps == [(k, k)] * len(steps) and len(steps) == -(-(24 - 1) // (k + 1))


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_a_random_head_drafts_but_the_output_is_plain_decodings(bigram_checkpoints, family):
    model = with_random_mtp(HybridModel.from_pretrained(bigram_checkpoints[family], progress=False), seed=7)
    want = greedy_decode(model, PROMPT, 20)
    got, steps = speculative_greedy(model, PROMPT, 20, 3)
    assert got == want
    proposed, accepted = (sum(s[i] for s in steps) for i in (0, 1))
    assert proposed == 3 * len(steps) and accepted < proposed / 4


def test_ngram_drafts_through_the_same_loop_give_plain_decoding(bigram_checkpoints):
    """A bigram model's greedy output falls into a cycle, which prompt lookup then proposes: drafts accepted, the
    output unchanged."""
    model = HybridModel.from_pretrained(bigram_checkpoints["qwen3_next"], progress=False)
    want = greedy_decode(model, PROMPT, 40)
    got, steps = speculative_greedy(model, PROMPT, 40, 3, method="ngram")
    assert got == want and sum(a for _, a in steps) >= 5


def test_sampled_drafts_draw_from_the_request_distribution():
    """Drafts drawn under a request's temperature / top-k with its generator: Draft.probs are sampling.probabilities
    of the head's logits, each draft within their support, the same seed the same drafts."""
    model = unit_gain(HybridModel.from_preset(CONFIGS["qwen3_5_text"], seed=1), seed=2)
    params = SamplingParams(temperature=0.8, top_k=5)
    runs = []
    for _ in range(2):
        cache = model.new_cache(1, 8, 16)
        hidden = prefill_hidden(model, cache, 0, PROMPT)
        runs.append(draft_mtp(model, cache, 0, PROMPT[1:] + [1], hidden, 4, params, new_generator(11)))
    a, b = runs
    assert a.tokens == b.tokens and torch.equal(a.probs, b.probs)
    assert torch.allclose(a.probs, probabilities(a.logits, [params] * 4))
    assert all(a.probs[j, t] > 0 for j, t in enumerate(a.tokens)) and ((a.probs > 0).sum(-1) <= 5).all()


# ---- the cache's MTP state ----------------------------------------------------------------------------------

def test_the_cache_holds_the_head_pools_and_forgets_with_the_slot():
    model = HybridModel.from_preset(CONFIGS["qwen3_5_moe_text"])
    cache = model.new_cache(2, 8, 16)
    assert len(cache.mtp_k_caches) == 1 and cache.mtp_k_caches[0].shape == cache.k_caches[0].shape
    assert HybridModel.from_preset(tiny_config()).new_cache(2, 8, 16).mtp_k_caches == []
    hidden = prefill_hidden(model, cache, 0, PROMPT)
    snapshot = cache.snapshot()
    draft_mtp(model, cache, 0, PROMPT[1:] + [1], hidden, 2)
    assert cache.mtp_context_lens == [len(PROMPT), 0]
    cache.restore(snapshot)
    assert cache.mtp_context_lens == [0, 0]
    draft_mtp(model, cache, 0, PROMPT[1:] + [1], hidden, 2)
    cache.reset(0)
    assert cache.mtp_context_lens == [0, 0] and cache.context_lens == [0, 0]


def test_bad_drafting_input_is_named_before_anything_changes():
    model = HybridModel.from_preset(CONFIGS["qwen3_5_text"])
    cache = model.new_cache(2, 1, 8, max_context=16)
    hidden = prefill_hidden(model, cache, 0, PROMPT)
    follow = PROMPT[1:] + [1]
    before = (list(cache.context_lens), list(cache.mtp_context_lens), cache.free_blocks)
    cases = [
        (dict(tokens=follow[:-1]), r"tokens must be the 7 token ids that follow positions 0 \.\. 6"),
        (dict(tokens=follow[:-1] + [256]), r"token ids \[256\] are outside the vocabulary"),
        (dict(hidden=hidden[:-1]), r"hidden must be the main model's normed hidden states \[7, 48\]"),
        (dict(hidden=hidden.double()), r"hidden must be .* torch\.float32"),
        (dict(k=0), "k .* must be an integer >= 1, got 0"),
        (dict(k=11), "reach position 16, past the slot's max_context 16"),
        (dict(k=3), "the cache has 0 free KV blocks; 3 drafts after 7 tokens need 1 more"),
        (dict(params=SamplingParams(temperature=1.0)), "sampled drafts need the request's torch.Generator"),
        (dict(slot=1), "slot 1's MTP head has caught up on all its 0 tokens"),
    ]
    for change, match in cases:
        args = dict(slot=0, tokens=follow, hidden=hidden, k=2, params=None)
        args.update(change)
        with pytest.raises(ValueError, match=match):
            draft_mtp(model, cache, args["slot"], args["tokens"], args["hidden"], args["k"], args["params"])
        assert (list(cache.context_lens), list(cache.mtp_context_lens), cache.free_blocks) == before
    plain = HybridModel.from_preset(tiny_config())
    with pytest.raises(ValueError, match="needs a model with an MTP head"):
        draft_mtp(plain, plain.new_cache(1, 2, 8), 0, [1], hidden, 1)

"""On a GPU: Engine(speculative=...) against plain decoding on CUDA, fp32 (token-identical: the verify step's GDN
states come from the CUDA conv and recurrent kernels' per-token checkpoints), eager and with the graph runner (the
verify steps in its hidden-states graphs, their tails in capture/speculative.py's: test_gpu_speculative_graphs.py);
bf16's agreement with plain bf16 decoding printed (a random tiny model's top logits lie within bf16's rounding of
each other, so an argmax may flip between a (k + 1)-token verify and a one-token decode)."""

import pytest
import torch

from helpers import moe_config, random_tokens, tiny_config, unit_gain
from speculative_reference import Oracle, bigram_model, staggered, with_random_mtp
from metrale_graph import Engine, HybridModel
from metrale_graph.speculative import verify

pytestmark = pytest.mark.gpu

CONFIGS = {
    "dense": tiny_config(mtp_num_hidden_layers=1),
    "moe": moe_config(mtp_num_hidden_layers=1, tie_word_embeddings=True),
    "next": moe_config("qwen3_next", mtp_num_hidden_layers=1),
}


def cuda_model(family, dtype=torch.float32):
    cpu = with_random_mtp(unit_gain(HybridModel.from_preset(CONFIGS[family], seed=1), seed=2), seed=3)
    return cpu.to("cuda", dtype)


def prompts_of(family):
    return [random_tokens(n, s, CONFIGS[family].vocab_size) for n, s in ((7, 1), (23, 2), (3, 3), (41, 4), (90, 5))]


def plain(model, prompts, compile=False, new=16):
    with Engine(model, 3, compile=compile) as e:
        return [r.token_ids for r in e.generate(prompts, max_new_tokens=new, stop_token_ids=[])]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_cuda_speculation_gives_plain_decoding(family, compile, monkeypatch):
    model, prompts = cuda_model(family), prompts_of(family)
    reference = plain(model, prompts, compile)
    monkeypatch.setattr(verify, "ngram_propose", Oracle(prompts, reference, CONFIGS[family].vocab_size))
    for spec in ({"method": "ngram", "num_tokens": 3}, {"method": "mtp", "num_tokens": 2}):
        with Engine(model, 3, compile=compile, speculative=spec) as e:
            assert staggered(e, prompts) == reference, spec
            s = e.stats().speculative
            assert s["proposed"] > 0 and (spec["method"] == "mtp" or 0 < s["accepted"] < s["proposed"])


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "graphs"])
def test_one_stream_keeps_the_state_after_a_rejected_draft(compile, monkeypatch):
    """A request decoding alone in a one-slot Engine: a one-stream step whose call is not decode-shaped would take
    the GDN op's chunked path whole, which keeps the states at chunk ends only; a 4-token verify in its one-stream
    bucket is decode-shaped (the recurrent kernel keeps any token), captured too (verify.pads_one_stream; padded
    to two streams always, it fitted no bucket of this grid and ran eagerly). The oracle's wrong drafts make
    partial runs, whose state comes from a verify entry."""
    model, prompts = cuda_model("dense"), prompts_of("dense")[3:4]
    reference = plain(model, prompts, compile, new=24)
    monkeypatch.setattr(verify, "ngram_propose", Oracle(prompts, reference, CONFIGS["dense"].vocab_size))
    with Engine(model, 1, compile=compile, speculative={"method": "ngram", "num_tokens": 3}) as e:
        out = e.generate(prompts, max_new_tokens=24, stop_token_ids=[])[0].token_ids
        s = e.stats().speculative
    assert out == reference[0] and 0 < s["accepted"] < s["proposed"]


def test_cuda_bigram_checkpoint_accepts_every_mtp_draft():
    model = bigram_model(CONFIGS["dense"]).to("cuda")
    with Engine(model, 2, compile=False, speculative={"method": "mtp", "num_tokens": 3}) as e:
        out = e.generate([[3, 5, 7]], max_new_tokens=41, stop_token_ids=[])[0].token_ids
        s = e.stats().speculative
    assert out == plain(model, [[3, 5, 7]], new=41)[0] and s["accepted"] == s["proposed"] == 30  # 10 steps of 3


def test_cuda_bf16_agreement_is_reported(monkeypatch):
    model, prompts = cuda_model("dense", torch.bfloat16), prompts_of("dense")
    reference = plain(model, prompts)
    monkeypatch.setattr(verify, "ngram_propose", Oracle(prompts, reference, CONFIGS["dense"].vocab_size))
    with Engine(model, 3, compile=False, speculative="ngram") as e:
        out = staggered(e, prompts)
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y)) for x, y in zip(out, reference)]
    print(f"bf16: tokens equal to plain bf16 decoding before the first difference: {agree} of 16 each")
    assert all(len(x) == 16 for x in out)

"""On a GPU: the MTP head's drafts through the ops' CUDA paths against the CPU reference (fp32, and bf16 within
its rounding), the done-when's bigram checkpoint drafting its own greedy continuation on CUDA, and acceptance on
CUDA tensors equal to the CPU's for the same inputs."""

import pytest
import torch

from helpers import moe_config, tiny_config, unit_gain
from metrics import rel_err
from speculative_reference import bigram_model, greedy_decode, prefill_hidden, speculative_greedy
from metrale_graph import HybridModel
from metrale_graph.sampling import SamplingParams
from metrale_graph.speculative import draft_mtp, rejection_sample, target_probabilities

pytestmark = pytest.mark.gpu

PROMPT = [9, 4, 77, 31, 2, 150, 6, 18, 90, 11, 23, 40, 41, 42, 43, 44, 70]


def drafts_on(model, k=4, first=None):
    """The head's k drafts after PROMPT and `first` (default: the model's own greedy token after PROMPT)."""
    cache = model.new_cache(2, 16, 16)
    hidden = prefill_hidden(model, cache, 1, PROMPT)
    if first is None:
        first = int(model.head(hidden[-1:])[0].argmax())
    return draft_mtp(model, cache, 1, PROMPT[1:] + [first], hidden, k)


@pytest.mark.parametrize("cfg", [tiny_config(mtp_num_hidden_layers=1), moe_config("qwen3_next", mtp_num_hidden_layers=1)],
                         ids=["qwen3_5", "qwen3_next"])
def test_cuda_drafts_match_the_cpu_reference(cfg):
    cpu = unit_gain(HybridModel.from_preset(cfg, seed=1), seed=2)
    first = int(cpu.head(prefill_hidden(cpu, cpu.new_cache(2, 16, 16), 1, PROMPT)[-1:])[0].argmax())
    want = drafts_on(cpu)
    # (before .to("cuda"), which moves the module itself)
    main_fp32 = cpu.head(prefill_hidden(cpu, cpu.new_cache(2, 16, 16), 1, PROMPT))
    got = drafts_on(cpu.to("cuda"))
    assert got.tokens == want.tokens and rel_err(got.logits.cpu(), want.logits) <= 1e-4
    # bf16: the same first token as fp32's (a random tiny model's top logits lie within bf16's rounding of each
    # other, so its own greedy choice may differ), and each draft's logits compared while the drafts before it
    # agree (an argmax that flips within the rounding feeds the head another token from there on). The bound is
    # the main model's own bf16 error on the prompt's logits, same model and device, times 2: the head reads the
    # main model's last hidden state (its error, at most the main logits') and adds one decoder layer of its own
    # (at most as much again). A flat figure will not do: on the CPU the tiny models' bf16 logits lie 0.07
    # (dense) and 0.20 (Next) from fp32's, their drafts 0.03 and 0.09; on the H200 the dense drafts 0.106.
    bf16_model = unit_gain(HybridModel.from_preset(cfg, seed=1), seed=2).to("cuda", torch.bfloat16)
    main_bf16 = bf16_model.head(prefill_hidden(bf16_model, bf16_model.new_cache(2, 16, 16), 1, PROMPT))
    main_err = rel_err(main_bf16.float().cpu(), main_fp32)
    bf16 = drafts_on(bf16_model, first=first)
    same = next((i for i, (a, b) in enumerate(zip(bf16.tokens, want.tokens)) if a != b), len(want.tokens))
    draft_err = rel_err(bf16.logits[:same + 1].float().cpu(), want.logits[:same + 1])
    print(f"bf16 vs fp32: main logits {main_err:.3e}, drafts {draft_err:.3e} ({same + 1} compared)")
    assert draft_err <= 2 * main_err


def test_a_bigram_checkpoint_drafts_its_own_continuation_on_cuda(tmp_path):
    bigram_model(tiny_config(mtp_num_hidden_layers=1), seed=3).save_pretrained(str(tmp_path))
    model = HybridModel.from_pretrained(str(tmp_path), device="cuda", progress=False)
    got, steps = speculative_greedy(model, PROMPT, 33, 3)
    assert got == greedy_decode(model, PROMPT, 33) and steps == [(3, 3)] * 8


def test_acceptance_on_cuda_equals_the_cpu():
    g = torch.Generator().manual_seed(0)
    B, K, V = 32, 4, 50
    logits, drafts = torch.randn(B, K + 1, V, generator=g), torch.randint(0, V, (B, K), generator=g)
    num, u = torch.randint(0, K + 1, (B,), generator=g), torch.rand(B, K + 1, generator=g)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    params = [SamplingParams() if b % 4 == 0 else SamplingParams(temperature=0.7, top_k=10, top_p=0.9) for b in range(B)]
    greedy = torch.tensor([p.greedy for p in params])
    want = rejection_sample(target_probabilities(logits, params), drafts, num, greedy, u, q)
    got = rejection_sample(target_probabilities(logits.cuda(), params), drafts.cuda(), num.cuda(), greedy.cuda(),
                           u.cuda(), q.cuda())
    assert torch.equal(got.counts.cpu(), want.counts) and torch.equal(got.tokens.cpu(), want.tokens)

"""On a GPU: the whole model over configs whose sizes are not powers of two (head dims 48-256,
rotary dims 12-128, GDN dk != dv, value / key head ratios 1-4, one KV head and as many KV heads as
query heads, KV blocks of 16-256, conv widths 2-4), each on three batches (one stream of one
token; several one-token streams continuing context; ragged streams, then a continuation), in
bf16, eager, compiled and replayed from CUDA graphs, against the CPU fp32 reference on the same
(bf16-rounded) weights. Slots outside each batch stay bit-identical in the replayed cache.

Run in parallel (`-n 8`): each config compiles its own step. With METRALE_REPORT set, each batch's
errors are appended to that file as JSON lines (pytest-xdist keeps workers' prints)."""

import copy
import json

import pytest
import torch

from helpers import run_step, tiny_config
from metrics import rel_err
from metrale_graph import HybridModel, Stream, envs
from metrale_graph.capture import GraphRunner
from metrale_graph.config import FULL, LINEAR

pytestmark = pytest.mark.gpu

TWO = (LINEAR, FULL)
CONFIGS = [  # (overrides, KV block size)
    (dict(head_dim=48, partial_rotary_factor=0.25, num_attention_heads=4, num_key_value_heads=1,
          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=48, linear_value_head_dim=80), 16),
    (dict(head_dim=80, partial_rotary_factor=0.25, num_attention_heads=4, num_key_value_heads=4,
          linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=80, linear_value_head_dim=96,
          linear_conv_kernel_dim=3), 32),
    (dict(head_dim=96, partial_rotary_factor=40 / 96, num_attention_heads=8, num_key_value_heads=2,
          linear_num_key_heads=1, linear_num_value_heads=4, linear_key_head_dim=96, linear_value_head_dim=48), 48),
    (dict(head_dim=128, partial_rotary_factor=0.5, num_attention_heads=2, num_key_value_heads=1,
          linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128), 64),
    (dict(head_dim=256, partial_rotary_factor=0.25, num_attention_heads=4, num_key_value_heads=2,
          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128), 64),
    (dict(head_dim=256, partial_rotary_factor=0.5, num_attention_heads=2, num_key_value_heads=2,
          linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=64, linear_value_head_dim=192,
          linear_conv_kernel_dim=2), 128),
    (dict(head_dim=64, partial_rotary_factor=1.0, num_attention_heads=4, num_key_value_heads=1,
          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=200, linear_value_head_dim=136), 256),
    (dict(head_dim=112, partial_rotary_factor=0.25, num_attention_heads=6, num_key_value_heads=3,
          linear_num_key_heads=3, linear_num_value_heads=12, linear_key_head_dim=72, linear_value_head_dim=56), 32),
]
IDS = [f"hd{o['head_dim']}-r{int(o['head_dim'] * o['partial_rotary_factor'])}-k{o['linear_key_head_dim']}"
       f"-v{o['linear_value_head_dim']}-hv{o['linear_num_value_heads'] // o['linear_num_key_heads']}"
       f"-q{o['num_attention_heads']}kv{o['num_key_value_heads']}-bs{bs}" for o, bs in CONFIGS]


def _batches(vocab, g):
    def toks(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()
    return [
        [Stream(3, toks(1))],                                                         # one stream, one token
        [Stream(3, toks(1)), Stream(0, toks(1)), Stream(5, toks(1)), Stream(6, toks(1))],  # one-token streams
        [Stream(1, toks(63)), Stream(2, toks(65)), Stream(4, toks(300)), Stream(7, toks(1))],  # ragged
        [Stream(4, toks(77)), Stream(1, toks(2)), Stream(0, toks(130))],              # continuation + new
    ]


def _slot_rows(cache, slots):
    mask = torch.zeros(cache.num_slots + 1, dtype=torch.bool, device=cache.device)
    mask[slots] = True
    return mask


@pytest.mark.parametrize("overrides, block_size", CONFIGS, ids=IDS)
def test_config_eager_compiled_replayed_match_cpu_fp32(overrides, block_size):
    cfg = tiny_config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      layer_types=TWO, **overrides)
    bf16 = HybridModel.from_preset(cfg, dtype=torch.bfloat16, seed=3)
    ref_model = copy.deepcopy(bf16).float()  # the CPU fp32 reference on the same rounded weights
    gpu = copy.deepcopy(bf16).to("cuda")
    caches = {name: m.new_cache(8, 64, block_size=block_size) for name, m in
              (("ref", ref_model), ("eager", gpu), ("compiled", gpu), ("graphs", gpu))}
    runner = GraphRunner(gpu, caches["graphs"], batch_sizes=[1, 4], token_counts=[4, 512])
    runner.warmup(progress=False)
    g = torch.Generator().manual_seed(0)
    for k, batch in enumerate(_batches(cfg.vocab_size, g)):
        ref = ref_model.prefill(caches["ref"], batch)
        eager = gpu.prefill(caches["eager"], batch).float().cpu()
        # the runner's compiled step on its own cache, without graphs
        compiled = run_step(gpu, runner.step, caches["compiled"], batch).float().cpu()
        before = [t.clone() for t in caches["graphs"].conv_states + caches["graphs"].gdn_states]
        replayed = runner.prefill(batch).float().cpu()
        rows = _slot_rows(caches["graphs"], [s.slot for s in batch])
        for t, old in zip(caches["graphs"].conv_states + caches["graphs"].gdn_states, before):
            assert torch.equal(t[~rows], old[~rows]), f"batch {k}: a slot outside the batch changed"
        err = rel_err(eager, ref)
        row = {"config": f"hd{cfg.head_dim}-r{cfg.rotary_dim}-k{cfg.linear_key_head_dim}-v{cfg.linear_value_head_dim}",
               "batch": k, "eager_vs_cpu_fp32": err, "compiled_vs_eager": rel_err(compiled, eager),
               "replayed_vs_eager": rel_err(replayed, eager)}
        print(row)
        if envs.METRALE_REPORT:
            with open(envs.METRALE_REPORT, "a") as f:
                f.write(json.dumps(row) + "\n")
        assert err <= 3e-2, f"batch {k}: eager bf16 vs CPU fp32 {err:.2e}"
        assert rel_err(compiled, eager) <= 1e-2 and rel_err(replayed, eager) <= 1e-2, f"batch {k}"
    assert caches["graphs"].context_lens == caches["ref"].context_lens == caches["eager"].context_lens

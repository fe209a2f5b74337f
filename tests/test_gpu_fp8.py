"""On a GPU: the FP8 ops' CUDA paths (cuBLAS blockwise with rows padded to 16, the Triton GEMMs below
16 rows, the FP8 expert GEMMs) against their references at 35B-A3B-like head shapes, an FP8 model's
graph replay against eager, and the FP8 presets built on the device (9B whole, Qwen3-Next-80B-A3B with
all 48 layers on one H200)."""

import pytest
import torch

from metrics import clone_args, outputs, rel_err, upcast
from metrale_graph import PRESETS, HybridModel, Stream
from metrale_graph.ops import REGISTRY, Shapes, example_args
from op_cases import FP8_OPS

pytestmark = pytest.mark.gpu

# 35B-A3B's head shapes (fewer experts): D 2048, GDN 16 / 32 heads of 128, attention 16 / 2 heads of 256,
# experts of 512; a decode batch (Triton GEMMs), a prefill of 322 tokens (cuBLAS, rows padded to 336), one row
# (the 9B's MLP width, whose separate gate and up outputs the caching allocator once put back to back)
CASES = [Shapes(lengths=(1, 1, 1), context=(5, 9, 0), H=16, HV=32, K=128, V=128, HQ=16, HKV=2, HD=256, R=64, D=2048,
                I=4096, E=16, TOPK=4, IE=512, IS=512, BS=64, num_blocks=8, fp8=True),
         Shapes(lengths=(17, 300, 5), context=(0, 40, 0), H=16, HV=32, K=128, V=128, HQ=16, HKV=2, HD=256, R=64,
                D=2048, I=4096, E=16, TOPK=4, IE=512, IS=512, BS=64, num_blocks=24, fp8=True),
         Shapes(lengths=(1,), context=(7,), H=16, HV=32, K=128, V=128, HQ=16, HKV=2, HD=256, R=64, D=2048,
                I=12288, E=16, TOPK=4, IE=512, IS=512, BS=64, num_blocks=4, fp8=True)]
# bf16 against the fp32 reference on the same FP8 weights: a bf16 ulp in a quantizer's input flips an FP8
# code (tests/test_kernels.py FP8_BF16_TOL). fp32 too: the GEMMs' accumulation order moves a quantizer's
# input by an fp32 ulp, which flips the code of a value on a rounding boundary (one e4m3 step, 2^-3
# relative, of that element): measured on the H200 1.2e-4 (gdn_proj, attn_proj) to 1.8e-3 (mlp, moe)
TOL = {torch.float32: 5e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=["decode", "prefill", "one-row"])
@pytest.mark.parametrize("name", FP8_OPS)
def test_fp8_ops_match_reference_on_cuda(name, case, dtype):
    args = example_args(name, case, dtype, seed=1)
    ref = outputs(REGISTRY[name].op(*upcast(clone_args(args, "cpu"))))
    out = outputs(REGISTRY[name].op(*clone_args(args, "cuda")))
    for i, (r, o) in enumerate(zip(ref, out)):
        if r.numel():
            err = rel_err(o.cpu(), r)
            print(f"{name} {dtype} T={case.T} output {i}: {err:.2e}")
            assert err <= TOL[dtype], (name, i, err)


def test_fp8_model_graph_replay_equals_eager():
    """An FP8 model (9B head shapes, 4 layers) through GraphRunner: two replays of a batch are bit-identical;
    where the bucket's padded token count takes the same GEMM backend as the eager step's real one (both
    at most SPLITK_MAX_ROWS: the split-K GEMM, whose rows do not see each other and whose parts depend on
    the weight's shape only) replay = eager as in bf16; where padding crosses to cuBLAS (or cuBLAS runs at
    another row count) replay and eager are two W8A8 roundings of one product, as far apart as FP8
    activations go: within the activation rounding's own reach, measured on the same batch (eager W8A8
    against eager weight-only). Measured on the H200 at 6b9890b: 3 decode tokens padded to 64 (then the
    one-pass Triton GEMM eager, cuBLAS replay) 1.24e-1 of the logits, on a random model whose activation
    rounding moves them by ~2e-1 (on the CPU reference path 2.0e-1 at 3 tokens, 2.4e-1 at 322)."""
    from metrale_graph.capture import GraphRunner, choose
    from metrale_graph.ops.fp8 import SPLITK_MAX_ROWS, activation_rounding
    from metrale_graph.quantization import QWEN_KEPT
    from metrale_graph.quantized import fp8_config

    cfg = fp8_config(PRESETS["qwen3.5-9b"].replace(vocab_size=2048, hidden_size=1024, intermediate_size=2048,
                                                   num_hidden_layers=4), QWEN_KEPT)
    model = HybridModel.from_preset(cfg, dtype=torch.bfloat16, device="cuda", seed=3)
    runner = GraphRunner(model, model.new_cache(8, 64), batch_sizes=[4], token_counts=[4, 64, 512])
    g = torch.Generator().manual_seed(3)
    # 3 tokens -> bucket 4 (split-K in both); 15 -> 64 (split-K eager, cuBLAS replay); 322 -> 512 (cuBLAS both)
    for lengths in ([1, 1, 1], [5, 5, 5], [17, 300, 5]):
        streams = [Stream(i, torch.randint(0, 2048, (n,), generator=g)) for i, n in enumerate(lengths)]
        ref = model.prefill(model.new_cache(8, 64), streams).float()
        with activation_rounding(False):
            weight_only = model.prefill(model.new_cache(8, 64), streams).float()
        first = runner.prefill(streams)
        for s in range(len(lengths)):
            runner.cache.reset(s)
        again = runner.prefill(streams)
        for s in range(len(lengths)):
            runner.cache.reset(s)
        assert torch.equal(first, again)
        padded = choose(runner.grid, len(lengths), sum(lengths)).tokens
        err, reach = rel_err(first.float(), ref), rel_err(ref, weight_only)
        print(f"lengths {lengths} (bucket {padded}): graphs vs eager {err:.2e}, activation rounding's reach "
              f"{reach:.2e}")
        if padded <= SPLITK_MAX_ROWS:  # the same kernels on the same rows
            assert err <= 1e-2
        else:
            assert err <= reach


@pytest.mark.parametrize("preset, gb", [("qwen3.5-9b-fp8", 11.0), ("qwen3-next-80b-a3b-fp8", 80.4)])
def test_fp8_presets_on_one_gpu(preset, gb):
    """The FP8 presets drawn and quantized on the device: their weights' bytes, and a prefill runs (the
    80B-A3B with all 48 layers on one H200)."""
    torch.cuda.empty_cache()
    model = HybridModel.from_preset(preset, dtype=torch.bfloat16, device="cuda", seed=0)
    held = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    assert abs(held - gb) < 0.2, held
    cache = model.new_cache(4, 64)
    logits = model.prefill(cache, [Stream(0, list(range(1, 300))), Stream(1, [7])])
    assert logits.shape == (2, model.config.vocab_size) and torch.isfinite(logits).all()
    del model, cache
    torch.cuda.empty_cache()

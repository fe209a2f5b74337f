"""The weight-only FP8 GEMM for decode rows (ops/fp8/w8a16.py, METRALE_FP8_DECODE=w8a16): the kernel in
Triton's interpreter against its reference and against the exact product within the bound of its fp32
sums, at 1-32 rows, ragged N and K, with and without a residual, bf16 and fp32 out, each tile form and
split; its choice by auto_backend through the setting; the phase ops' CUDA paths with it against the
weight-only references; its sm_90 compilation (plain form mma.sync, swapped form wgmma); and, on a GPU,
the 9B's decode shapes."""

import os
import subprocess
import sys

import pytest
import torch

from helpers import BENCHMARKS, benchmark_script
from op_cases import FP8_CASES, op_args
from metrics import assert_close, clone_args, outputs, rel_err, upcast
from metrale_graph import envs
from metrale_graph.ops import REGISTRY, fp8
from metrale_graph.ops.fp8 import linear as lin
from metrale_graph.ops.fp8 import w8a16

F32, BF16 = torch.float32, torch.bfloat16
U = {F32: 2.0 ** -24, BF16: 2.0 ** -8}  # unit roundoff (round to nearest even) of each output dtype


def case(M, N, K, dtype, device="cpu", seed=0):
    """x [M, K] in dtype, a weight of blocks of varied ranges quantized (codes, scales), a residual [M, N]."""
    g = torch.Generator(device=device).manual_seed(seed * 7919 + M * 1000 + N + K)
    w = torch.randn(N, K, generator=g, device=device) * torch.logspace(-2, 0, K, device=device)
    q, s = fp8.quantize_weight_blocks(w)
    x = (torch.randn(M, K, generator=g, device=device) * torch.logspace(-1, 1, K, device=device)).to(dtype)
    return x, q, s, torch.randn(M, N, generator=g, device=device).to(dtype)


def assert_within_fp32_sums(name, x, q, s, out, residual=None):
    """out against the exact product (fp64) elementwise: a sum of K products in fp32 in any order (the
    products of a bf16 / fp32 x and an e4m3 code are exact in fp32; the block scale one rounding per block
    partial; the part sums and the residual one each) moves by at most (K + 4) u times the sum of the
    terms' magnitudes (|x| @ |w|.T + |residual|; Higham's bound for recursive summation, any order),
    then out_dtype's rounding, half an ulp (u_out) of the value. A misapplied scale or a dropped K step
    moves an element by a whole term (~|y| / sqrt(K)), far outside it."""
    wd = fp8.dequantize_weight_blocks(q, s).double()  # on x's device (the 9B's weights on a GPU)
    xd = x.double()
    r = torch.zeros((), device=x.device) if residual is None else residual.double()
    exact = xd @ wd.t() + r
    terms = xd.abs() @ wd.abs().t() + r.abs()
    K = x.shape[1]
    slack = (K + 4) * U[F32] * terms
    bound = slack + U[out.dtype] * (exact.abs() + slack) + 1e-30
    err = (out.double() - exact).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{name}: an element {worst:.2f}x past the fp32 sums' bound"


SHAPES = [(200, 384), (200, 320), (130, 128), (64, 1000)]  # ragged N, whole and ragged K (320: a partial
# block, as the format allows), one part (K 128: the direct store), eight parts (K 1000)


@pytest.mark.parametrize("N,K", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("M", [1, 3, 16, 32])
def test_w8a16_matches_reference(M, N, K):
    for out_dtype in (F32, BF16):
        x, q, s, residual = case(M, N, K, out_dtype)
        for r in (None, residual):
            out = w8a16.w8a16_linear(x, q, s, out_dtype, r)
            name = f"M {M} {out_dtype} residual {r is not None}"
            assert out.dtype == out_dtype and out.shape == (M, N)
            assert_within_fp32_sums(name, x, q, s, out, r)
            ref = w8a16.w8a16_linear_ref(x, q, s, out_dtype, r)
            assert_within_fp32_sums(f"{name} (reference)", x, q, s, ref, r)
            # the same sums in a fixed order: a second call is bit for bit the first
            assert torch.equal(out, w8a16.w8a16_linear(x, q, s, out_dtype, r))


@pytest.mark.parametrize("tiles", [(64, False, 4, 1), (64, True, 4, 1), (16, False, 4, 1), (128, True, 8, 1),
                                   (256, False, 8, 1)], ids=lambda t: f"BN{t[0]}{'-swap' if t[1] else ''}")
@pytest.mark.parametrize("per_sm", [1, 4, 16])
def test_w8a16_tile_forms_and_splits(tiles, per_sm):
    """Every form and width the autotuner may take on sm_90 (the swapped form: the codes on the dot's M
    side) and split-Ks from one part to one per scale block, with bf16 scales (as some checkpoints store
    them), give the product within the fp32 sums' bound."""
    for M, (N, K) in ((3, (200, 320)), (32, (130, 1000))):
        x, q, s, residual = case(M, N, K, BF16, seed=1)
        for scales in (s, s.bfloat16()):
            out = w8a16.w8a16_linear(x, q, scales, F32, residual.float(), tiles=tiles, per_sm=per_sm)
            assert_within_fp32_sums(f"{tiles} x{per_sm} M {M}", x, q, scales, out, residual.float())


def test_w8a16_parts_cover_k_in_whole_blocks():
    cpu = torch.device("cpu")
    for N, K in SHAPES + [(24576, 4096), (4096, 12288)]:
        for per_sm in (1, 4, 16):
            parts, k_per = w8a16.w8a16_parts(N, K, cpu, per_sm=per_sm)
            assert k_per % 128 == 0 and (parts - 1) * k_per < K <= parts * k_per, (N, K, per_sm)
    assert w8a16.w8a16_parts(4096, 4096, cpu) == lin.splitk_parts(4096, 4096, cpu)  # the split-K GEMM's rule


def test_w8a16_strided_fp16_and_empty():
    x, q, s, _ = case(5, 200, 384, torch.float16)
    wide = torch.zeros(5, 2 * 384, dtype=torch.float16)
    wide[:, ::2] = x
    out = w8a16.w8a16_linear(wide[:, ::2], q, s)  # x with an inner stride: made contiguous first
    assert out.dtype == torch.float16
    assert torch.equal(out, w8a16.w8a16_linear(x, q, s))
    assert_close("fp16", w8a16.w8a16_linear_ref(x, q, s), out, 1e-3)
    assert w8a16.w8a16_linear(x[:0], q, s).shape == (0, 200)
    r = torch.randn(5, 200, dtype=torch.float16)
    q0, s0 = fp8.quantize_weight_blocks(torch.randn(200, 0))
    assert torch.equal(w8a16.w8a16_linear(x[:, :0], q0, s0, torch.float16, r), r)


@pytest.mark.parametrize("call, message", [
    (lambda x, q, s: w8a16.w8a16_linear(torch.randn(33, 256), q, s), "at most 32 rows (decode), got 33"),
    (lambda x, q, s: w8a16.w8a16_linear(x[:, :128], q, s), "does not fit w"),
    (lambda x, q, s: w8a16.w8a16_linear(x, q.float(), s), "w must be a float8_e4m3fn tensor"),
    (lambda x, q, s: w8a16.w8a16_linear(x, q, s, torch.int8), "out_dtype must be one of"),
    (lambda x, q, s: w8a16.w8a16_linear(x, q, s, F32, torch.zeros(3, 65)), "residual must be torch.float32 of shape"),
    (lambda x, q, s: w8a16.w8a16_linear(x, q, s, tiles=(96, False, 4, 3)), "tiles must be"),
    (lambda x, q, s: fp8.block_fp8_linear(torch.randn(33, 256), q, s, backend="w8a16"), "at most 32 rows"),
])
def test_w8a16_errors_name_the_argument(call, message):
    q, s = fp8.quantize_weight_blocks(torch.randn(64, 256))
    with pytest.raises(ValueError, match=message.replace("(", ".").replace(")", ".")):
        call(torch.randn(3, 256), q, s)


def test_decode_rows_take_w8a16_when_the_setting_chooses_it(monkeypatch):
    """linear.DECODE_GEMM "w8a16" (METRALE_FP8_DECODE=w8a16) gives 1-32 rows to the W8A16 GEMM on CUDA and
    in the interpreter; more rows keep their W8A8 GEMMs; the default keeps the split-K GEMM. block_fp8_linear
    then computes the weight-only product."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert envs.choices("METRALE_FP8_DECODE")[-1] == "w8a16" and lin.DECODE_GEMM == "splitk"
    with envs.override(METRALE_FP8_DECODE="w8a16"):  # a value the setting takes
        assert envs.METRALE_FP8_DECODE == "w8a16"
    assert lin.auto_backend(3, 4096, 4096, cpu) == "triton"
    monkeypatch.setattr(lin, "DECODE_GEMM", "w8a16")
    assert [lin.auto_backend(t, 4096, 4096, d) for t in (1, 16, 32) for d in (cuda, cpu)] == ["w8a16"] * 6
    assert lin.auto_backend(33, 4096, 4096, cuda) != "w8a16" and lin.auto_backend(0, 4096, 4096, cpu) != "w8a16"
    x, q, s, residual = case(3, 200, 320, F32)
    out = fp8.block_fp8_linear(x, q, s, F32, residual)
    assert torch.equal(out, w8a16.w8a16_linear(x, q, s, F32, residual))
    assert rel_err(out, fp8.block_fp8_linear_ref(x, q, s, F32, residual)) > 1e-3  # not W8A8's numerics


_SETTING = """
import torch
from metrale_graph.ops import fp8
print(fp8.linear.DECODE_GEMM, fp8.linear.auto_backend(8, 4096, 4096, torch.device("cuda")))
"""


def test_the_environment_chooses_w8a16():
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    run = subprocess.run([sys.executable, "-c", _SETTING], cwd=os.path.dirname(BENCHMARKS),
                         env={**env, "METRALE_FP8_DECODE": "w8a16"}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["w8a16", "w8a16"]


# The ops' CUDA paths (project / project_one -> block_fp8_linear) with w8a16 take x unquantized: the weight-only
# references (activation_rounding(False)). fp32: the ops' own fp32 tolerance (1e-5: sums in another order). bf16
# against the upcast reference: the bf16 ops' 1e-2 (roundings in bf16 between the kernels), not the W8A8 cases'
# 3e-2 (no FP8 code of an activation to flip). metrale::moe is left out: its routed experts stay W8A8.
DENSE_FP8_OPS = ("gdn_proj", "gdn_out", "attn_proj", "attn_out", "mlp")
OP_TOL = {F32: 1e-5, BF16: 1e-2}


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", DENSE_FP8_OPS)
def test_ops_decode_with_w8a16_match_the_weight_only_reference(name, dtype, monkeypatch):
    decode = FP8_CASES[1]  # three streams of one token each
    launched = []
    real = w8a16.w8a16_linear

    def spy(*args, **kwargs):
        launched.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(lin, "DECODE_GEMM", "w8a16")
    monkeypatch.setattr(lin, "w8a16_linear", spy)
    args = op_args(name, decode, dtype)
    with fp8.activation_rounding(False):
        ref = outputs(REGISTRY[name].op(*upcast(clone_args(args, "cpu"))))
    out = outputs(REGISTRY[name].cuda(*clone_args(args, "cpu")))
    assert launched and all(t == decode.T for t in launched), launched
    for i, (r, o) in enumerate(zip(ref, out)):
        assert_close(f"{name} output {i}", r, o, OP_TOL[dtype])


_W8A16_SM90 = r"""
import importlib, re
import triton
from triton.backends.compiler import GPUTarget
w8 = importlib.import_module("metrale_graph.ops.fp8.w8a16")
target = GPUTarget("cuda", 90, 32)
backend = triton.compiler.make_backend(target)
fn = w8._w8a16_kernel
mma = re.compile(r"(wgmma\.mma_async\.sync\.aligned\.m64n(16|32)k16\.f32\.bf16\.bf16"
                 r"|mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16)")
for bm in (16, 32):
    for cfg in w8._prune(w8._w8a16_tuned.configs, {"N": 4096}, BM=bm):
        consts = dict(BM=bm, BK=128, IEEE=False, DIRECT=False, HAS_RESIDUAL=True, EVEN_K=True, **cfg.kwargs)
        types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "r_ptr": "*bf16", "p_ptr": "*fp32"}
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        hints = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n not in consts
                 and (n.endswith("_ptr") or n in ("N", "K", "K_PER") or n.startswith("stride"))}
        opts = backend.parse_options({"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        ptx = triton.compile(triton.compiler.ASTSource(fn=fn, constexprs=consts, signature=sig, attrs=hints),
                             target=target, options=opts.__dict__).asm["ptx"]
        found = {m.group(0).split(".")[0] for m in mma.finditer(ptx)}
        assert found == ({"wgmma"} if cfg.kwargs["SWAP"] else {"mma"}), (bm, cfg, found)
print("compiled")
"""


def test_w8a16_compiles_for_sm90():
    """Every autotune config the 9B's shapes keep, at 16 and 32 rows, through Triton's compiler for sm_90
    (no GPU needed; the interpreter accepts what the compiler rejects): the swapped form becomes bf16
    wgmma (m64n16k16 / m64n32k16, the converted codes the register operand), the plain form mma.sync."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _W8A16_SM90], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


def test_bench_script_help():
    bench = benchmark_script("kernels/bench_w8a16")
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--help"])
    assert exit_.value.code == 0
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--rows", "1,64"])
    assert exit_.value.code == 2


# On a GPU: the 9B's projection shapes ----------------------------------------------------------------------
SHAPES_9B = [(24576, 4096), (4096, 12288), (16448, 4096), (4096, 4096)]  # sweep_fp8_decode.py's SHAPES


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", SHAPES_9B, ids=lambda v: str(v))
def test_w8a16_on_cuda_at_the_9b_decode_shapes(N, K):
    """The autotuned kernel and each form at 1 / 8 / 16 / 32 rows within the fp32 sums' bound of the exact
    product (bf16 out, with the residual the down and out projections add), the same bits on a second call."""
    for M in (1, 8, 16, 32):
        x, q, s, residual = case(M, N, K, BF16, device="cuda")
        out = w8a16.w8a16_linear(x, q, s, BF16, residual)
        assert_within_fp32_sums(f"{N}x{K} M {M}", x, q, s, out, residual)
        assert torch.equal(out, w8a16.w8a16_linear(x, q, s, BF16, residual))
        for tiles in ((128, False, 4, 4), (128, True, 4, 4)):
            assert_within_fp32_sums(f"{N}x{K} M {M} {tiles}", x, q, s,
                                    w8a16.w8a16_linear(x, q, s, F32, tiles=tiles))


@pytest.mark.gpu
def test_fp8_model_decode_with_w8a16(monkeypatch):
    """An FP8 model (9B head shapes, 4 layers) on decode batches with linear.DECODE_GEMM "w8a16": its logits are
    weight-only FP8's (eager with activation_rounding(False): x @ the bf16-dequantized weights, whose one bf16
    rounding per weight is all that separates them), so much closer to them than W8A8's (the default), whose
    activation rounding moves a random model's logits by ~2e-1 (test_gpu_fp8.py); graph replay (bucket 4, the
    same kernels on one padded row more) within 1e-2 of eager, as the split-K GEMM's."""
    from metrale_graph import PRESETS, HybridModel, Stream
    from metrale_graph.capture import GraphRunner
    from metrale_graph.quantization import QWEN_KEPT
    from metrale_graph.quantized import fp8_config

    cfg = fp8_config(PRESETS["qwen3.5-9b"].replace(vocab_size=2048, hidden_size=1024, intermediate_size=2048,
                                                   num_hidden_layers=4), QWEN_KEPT)
    model = HybridModel.from_preset(cfg, dtype=torch.bfloat16, device="cuda", seed=3)
    g = torch.Generator().manual_seed(3)
    streams = [Stream(i, torch.randint(0, 2048, (1,), generator=g)) for i in range(3)]
    w8a8 = model.prefill(model.new_cache(8, 64), streams).float()
    with fp8.activation_rounding(False):
        weight_only = model.prefill(model.new_cache(8, 64), streams).float()
    monkeypatch.setattr(lin, "DECODE_GEMM", "w8a16")
    eager = model.prefill(model.new_cache(8, 64), streams).float()
    runner = GraphRunner(model, model.new_cache(8, 64), batch_sizes=[4], token_counts=[4])
    replay = runner.prefill(streams).float()
    err, reach = rel_err(eager, weight_only), rel_err(w8a8, weight_only)
    print(f"w8a16 vs weight-only {err:.2e}, W8A8 vs weight-only {reach:.2e}, replay vs eager "
          f"{rel_err(replay, eager):.2e}")
    assert err <= reach / 4
    assert rel_err(replay, eager) <= 1e-2

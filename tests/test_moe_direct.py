"""The MoE direct decode path (ops/moe/direct.py, METRALE_MOE_DECODE=direct): one row per token-expert pair, no
sort nor alignment. On the CPU (Triton's interpreter): against the op's reference and against the aligned path
at T = 1..8, several top_k / E / D / IE (tiles' non-multiples included), a tensor-parallel rank's experts, fp32
and bf16, zero tokens; its choice by shapes; no host sync; its kernels through Triton's compiler for sm_90. On a
GPU (`gpu`): the 35B-A3B's shape against the reference and the aligned path, and replayed from a CUDA graph."""

import pytest
import torch

from metrics import TOL, assert_close, assert_no_aliasing, clone_args, compared_rows, upcast
from metrale_graph.ops import REGISTRY, Shapes, declaration, moe
from metrale_graph.ops.moe import direct
from op_cases import op_args
from test_kernels import _forbid_python_syncs, _NoHostSync

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (tokens, experts, top_k, D, IE): D and IE off the interpreter's 16-column and 32-K tiles, top_k 1 and top_k = E
SHAPES = [((1, 2, 3), 8, 2, 32, 24), ((4,), 16, 4, 40, 20), ((6,), 6, 6, 24, 36), ((7,), 12, 3, 33, 17),
          ((5, 8), 5, 1, 48, 64)]


def _direct(monkeypatch):
    """moe_cuda takes the direct path whatever its shapes (its own rule, 4P <= E, is tested apart)."""
    monkeypatch.setattr(direct, "takes_direct", lambda P, E, decode=None: P > 0)


def _args(T, E, k, D, IE, dtype, seed):
    return list(op_args("moe", Shapes(lengths=(T,), context=(0,), E=E, TOPK=k, D=D, IE=IE, IS=20), dtype, seed))


def _local(args, first, count):
    """The op's arguments for the tensor-parallel rank holding experts first .. first + count - 1."""
    a = declaration(REGISTRY["moe"].op).Args(*args)
    args = list(args)
    args[3], args[5] = a.w13[first:first + count], a.w2[first:first + count]
    return args + [first]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens,E,k,D,IE", SHAPES)
def test_direct_matches_reference_and_aligned(tokens, E, k, D, IE, dtype, monkeypatch):
    """Every token's output within the dtype's tolerance of the upcast reference (tokens whose routing is decided:
    metrics.moe_decided_rows) and of the aligned path (all tokens: both route alike); fresh outputs. Both paths
    sum fp32 products in fp32 (tl.dot against a row's sum: the order differs) and round at the same points."""
    for T in tokens:
        args = _args(T, E, k, D, IE, dtype, seed=T + E)
        ref = REGISTRY["moe"].op(*upcast(clone_args(args, "cpu")))
        aligned = moe.moe_cuda(*clone_args(args, DEVICE))
        with monkeypatch.context() as m:
            _direct(m)
            call = clone_args(args, DEVICE)
            out = moe.moe_cuda(*call)
        assert out.shape == (T, D) and out.dtype == dtype and out.is_contiguous()
        assert_no_aliasing("moe (direct)", [out], call)
        rows = compared_rows("moe", args, dtype)
        assert rows.any()
        assert_close(f"moe direct T={T} vs reference", ref[rows], out.cpu()[rows], TOL[dtype])
        assert_close(f"moe direct T={T} vs aligned", aligned.cpu().float(), out.cpu().float(), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_direct_for_a_ranks_experts(dtype, monkeypatch):
    """Experts split across ranks (first_expert 3, 5 of 12 local): the other ranks' pairs give zero rows (checked
    on direct_experts' y), the op's output as the aligned path's, with and without the residual, and as the
    reference's (bf16: with the residual; without it the output is a partial sum of a few bf16-rounded terms,
    1.2e-2 from the fp32 reference at one token, the aligned path's distance too: the suite's 1e-2 is for
    outputs that carry h)."""
    from metrale_graph.ops.common import rms_norm
    from metrale_graph.ops.moe.reference import route

    for T, add_residual in ((1, False), (5, True)):
        args = _local(_args(T, 12, 3, 40, 20, dtype, seed=T), 3, 5) + [add_residual]
        ref = REGISTRY["moe"].op(*upcast(clone_args(args, "cpu")))
        aligned = moe.moe_cuda(*clone_args(args, DEVICE))
        with monkeypatch.context() as m:
            _direct(m)
            out = moe.moe_cuda(*clone_args(args, DEVICE))
        rows = compared_rows("moe", args, dtype)
        if add_residual or dtype == torch.float32:
            assert_close("moe direct (rank) vs reference", ref[rows], out.cpu()[rows], TOL[dtype])
        assert_close("moe direct (rank) vs aligned", aligned.cpu().float(), out.cpu().float(), TOL[dtype])
        a = declaration(REGISTRY["moe"].op).Args(*args)
        n = rms_norm(a.h, a.norm_w, a.eps)
        top_w, top_e = route(n, a.router_w, a.top_k, True)
        y = direct.direct_experts(n.contiguous(), top_w.contiguous(), top_e.contiguous(), a.w13, a.w2, 3)
        theirs = ((top_e < 3) | (top_e >= 8)).reshape(-1)
        assert theirs.any() and (~theirs).any()
        assert (y[theirs] == 0).all() and (y[~theirs] != 0).any(dim=1).all()


def test_direct_with_no_tokens(monkeypatch):
    """Zero tokens: a [0, D] output from the op, an empty y from direct_experts (no launch)."""
    args = _args(0, 8, 2, 32, 24, torch.bfloat16, seed=0)
    with monkeypatch.context() as m:
        _direct(m)
        assert moe.moe_cuda(*args).shape == (0, 32)
    a = declaration(REGISTRY["moe"].op).Args(*args)
    y = direct.direct_experts(a.h, torch.zeros(0, 2, dtype=a.h.dtype), torch.zeros(0, 2, dtype=torch.long),
                              a.w13, a.w2, 0)
    assert y.shape == (0, 32)


def test_direct_is_chosen_by_shapes(monkeypatch):
    """takes_direct: "direct" with 1..MAX_PAIRS pairs and 4 pairs per expert at most (the 35B-A3B: 256 experts,
    top 8, up to 8 tokens; Qwen3-Next: 512, top 10, up to 6); never with "aligned"; an unknown choice is a
    ValueError naming the setting. moe_cuda with DECODE "direct" at such a shape calls no alignment, with
    "aligned" no direct kernel."""
    assert direct.DECODES == ("aligned", "direct")
    for P, E, want in ((8, 256, True), (64, 256, True), (72, 512, False), (65, 1024, False), (60, 512, True),
                       (0, 256, False), (9, 32, False), (8, 32, True)):
        assert direct.takes_direct(P, E, "direct") is want, (P, E)
        assert direct.takes_direct(P, E, "aligned") is False
    with pytest.raises(ValueError, match="METRALE_MOE_DECODE.*one of aligned, direct, got 'sorted'"):
        direct.takes_direct(8, 256, "sorted")

    def forbidden(*args, **kwargs):
        raise AssertionError("the other path ran")

    args = _args(2, 16, 2, 32, 24, torch.bfloat16, seed=1)  # 4 pairs over 16 experts
    ref = moe.moe_cuda(*args)
    monkeypatch.setattr(direct, "DECODE", "direct")
    with monkeypatch.context() as m:
        m.setattr(moe, "align_local_pairs", forbidden)
        out = moe.moe_cuda(*args)
    assert_close("moe direct (chosen)", ref.float(), out.float(), TOL[torch.bfloat16])
    monkeypatch.setattr(direct, "DECODE", "aligned")
    monkeypatch.setattr(direct, "direct_experts", forbidden)
    moe.moe_cuda(*args)


def test_direct_path_never_syncs(monkeypatch):
    """The direct path calls no op that syncs with the host or sizes its output from data."""
    _direct(monkeypatch)
    _forbid_python_syncs(monkeypatch)
    args = _args(3, 16, 4, 32, 24, torch.bfloat16, seed=2)
    with _NoHostSync():
        moe.moe_cuda(*args)


_SM90_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from metrale_graph.ops.moe import direct
target = GPUTarget("cuda", 90, 32)
backend = triton.compiler.make_backend(target)

def compile_(fn, types, consts, cfg):
    sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
    src = triton.compiler.ASTSource(fn=fn, constexprs=consts, signature=sig)
    opts = backend.parse_options({"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    return triton.compile(src, target=target, options=opts.__dict__).metadata.shared

I = "*i64"
gu = dict(x_ptr="*X", w_ptr="*X", act_ptr="*X", e_ptr=I, P="i32", first_expert="i32", EL="i32", N="i32", K="i32",
          stride_x="i32", stride_we="i32", stride_wn="i32")
dn = dict(act_ptr="*X", w_ptr="*X", y_ptr="*X", e_ptr=I, rw_ptr="*X", P="i32", first_expert="i32", EL="i32", N="i32",
          K="i32", stride_we="i32", stride_wn="i32")
smem = []
for fn, types, extra, acc in ((direct._moe_direct_gate_up_kernel.fn.fn, gu, dict(TOP_K=8), 2),
                              (direct._moe_direct_down_kernel.fn.fn, dn, {}, 1)):
    # bf16: every candidate the 35B-A3B's shapes keep, K a multiple of BK or not; fp32: its one tile
    N, K = (512, 2048) if acc == 2 else (2048, 512)
    for x, cfgs in (("bf16", direct._prune(direct._configs(acc), dict(N=N, K=K))), ("fp32", [direct.FP32_CONFIG])):
        for i, cfg in enumerate(cfgs):
            for even_k in (True, False) if i == 0 else (True,):
                t = {n: v.replace("X", x) for n, v in types.items()}
                smem.append(compile_(fn, t, dict(EVEN_K=even_k, FP32=x == "fp32", **extra, **cfg.kwargs), cfg))
assert max(smem) <= 232448, smem
print("compiled", len(smem))
"""


def test_direct_kernels_compile_for_sm90():
    """The direct kernels through Triton's real compiler for sm_90 (PTX and ptxas, no GPU needed): the interpreter
    accepts what the compiler rejects. A subprocess: the interpreter is on in this one."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


@pytest.mark.gpu
def test_direct_at_35b_a3b_shape_and_replay(monkeypatch):
    """CUDA, the 35B-A3B's layer (D 2048, 256 experts, top 8, IE 512, shared 512), bf16, T = 1..8 (one set of
    weights, the first T of 16 tokens): the direct path against the reference (decided tokens) and the aligned
    path; then captured in a CUDA graph at T = 1 and 8 and replayed on other tokens (other routings): equal to
    eager bit for bit (no atomics, a fixed order)."""
    from metrale_graph import PRESETS

    cfg = PRESETS["qwen3.5-35b-a3b"]
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    dtype = torch.bfloat16
    case = Shapes(lengths=(16,), context=(0,), E=E, TOPK=k, D=cfg.hidden_size, IE=cfg.moe_intermediate_size,
                  IS=cfg.shared_expert_intermediate_size)
    args = list(op_args("moe", case, dtype, seed=1))  # generated once: 1.5 GB of expert weights
    ref_args, call = upcast(clone_args(args, "cpu")), clone_args(args, "cuda")
    h, ref_h, cuda_h = args[0], ref_args[0], call[0]
    for T in range(1, 9):
        assert direct.takes_direct(T * k, E, "direct")
        ref_args[0], call[0], args[0] = ref_h[:T], cuda_h[:T], h[:T]
        ref = REGISTRY["moe"].op(*ref_args)
        monkeypatch.setattr(direct, "DECODE", "aligned")
        aligned = moe.moe_cuda(*call)
        monkeypatch.setattr(direct, "DECODE", "direct")
        out = moe.moe_cuda(*call)
        rows = compared_rows("moe", args, dtype)
        assert_close(f"35B-A3B direct T={T} vs reference", ref[rows], out.cpu()[rows], TOL[dtype])
        assert_close(f"35B-A3B direct T={T} vs aligned", aligned.cpu().float(), out.cpu().float(), TOL[dtype])
    monkeypatch.setattr(direct, "DECODE", "direct")
    for T in (1, 8):
        call[0] = cuda_h[:T].clone()
        moe.moe_cuda(*call)  # autotuned before capture, as the runner's warmup does
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = moe.moe_cuda(*call)
        for start in (3, 5, 8):
            call[0].copy_(cuda_h[start:start + T])
            graph.replay()
            assert torch.equal(static_out, moe.moe_cuda(*call)), (T, start)

"""The MoE direct decode path (ops/moe/direct.py, taken by its shape rule): one row per token-expert pair, no
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
    monkeypatch.setattr(direct, "takes_direct", lambda P, E: P > 0)


def _moe_aligned(args):
    """moe_cuda on the aligned path whatever the shapes (MAX_PAIRS 0: no call of pairs takes the direct one), the
    comparison for the direct path."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(direct, "MAX_PAIRS", 0)
        return moe.moe_cuda(*args)


def _args(T, E, k, D, IE, dtype, seed):
    return list(op_args("moe", Shapes(lengths=(T,), context=(0,), E=E, TOPK=k, D=D, IE=IE, IS=20), dtype, seed))


def _local(args, first, count):
    """The op's arguments for the tensor-parallel rank holding experts first .. first + count - 1."""
    a = declaration(REGISTRY["moe"].op).Args(*args)
    args = list(args)
    args[3], args[5] = a.w13[first:first + count], a.w2[first:first + count]
    if a.w13_s.numel():  # FP8 experts: their block scales too
        args[4], args[6] = a.w13_s[first:first + count], a.w2_s[first:first + count]
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
        aligned = _moe_aligned(clone_args(args, DEVICE))
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
        aligned = _moe_aligned(clone_args(args, DEVICE))
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
    """takes_direct: 1..MAX_PAIRS pairs and 4 pairs per expert at most (the 35B-A3B: 256 experts, top 8, up to 8
    tokens; Qwen3-Next: 512, top 10, up to 6). moe_cuda at such a shape calls no alignment; at one past the rule
    (5 pairs of 16 experts), or with MAX_PAIRS lowered below its pairs, no direct kernel."""
    assert direct.MAX_PAIRS == 64
    for P, E, want in ((8, 256, True), (64, 256, True), (72, 512, False), (65, 1024, False), (60, 512, True),
                       (0, 256, False), (9, 32, False), (8, 32, True)):
        assert direct.takes_direct(P, E) is want, (P, E)

    def forbidden(*args, **kwargs):
        raise AssertionError("the other path ran")

    args = _args(2, 16, 2, 32, 24, torch.bfloat16, seed=1)  # 4 pairs over 16 experts
    ref = _moe_aligned(args)
    with monkeypatch.context() as m:
        m.setattr(moe, "align_local_pairs", forbidden)
        out = moe.moe_cuda(*args)
    assert_close("moe direct (chosen)", ref.float(), out.float(), TOL[torch.bfloat16])
    monkeypatch.setattr(direct, "direct_experts", forbidden)
    moe.moe_cuda(*_args(5, 16, 1, 32, 24, torch.bfloat16, seed=1))  # 5 pairs over 16 experts: 4P > E
    monkeypatch.setattr(direct, "MAX_PAIRS", 3)
    moe.moe_cuda(*args)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_direct_skips_padding_rows(fp8, monkeypatch):
    """With the batch's cu_seqlens (3 tokens of 2 streams in a bucket of 4) the direct path (bf16 and FP8) runs no
    expert for the padding row: its pairs' rows of the experts' output are zero, the other rows' outputs equal
    the call's without cu_seqlens bit for bit (each pair is computed alone). A padding row's output is
    unspecified (metrale_graph/batch.py)."""
    seen = []

    def recording(fn):
        return lambda *a, **kw: seen.append(fn(*a, **kw)) or seen[-1]

    monkeypatch.setattr(direct, "direct_experts", recording(direct.direct_experts))
    monkeypatch.setattr(moe, "moe_experts_fp8_direct", recording(moe.moe_experts_fp8_direct))
    k = 2
    args = list(op_args("moe", Shapes(lengths=(4,), context=(0,), E=32, TOPK=k, D=40, IE=24, IS=20, fp8=fp8),
                        torch.bfloat16, 5))
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=DEVICE)
    call = clone_args(args, DEVICE)
    whole = moe.moe_cuda(*call)
    padded = moe.moe_cuda(*call, 0, True, cu)
    assert len(seen) == 2
    assert torch.equal(padded[:3], whole[:3])
    assert (seen[1][3 * k:] == 0).all() and (seen[0][3 * k:] != 0).any(dim=1).all()
    assert torch.equal(seen[1][:3 * k], seen[0][:3 * k])


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("first,count", [(0, 8), (2, 4)], ids=["all", "rank"])
def test_aligned_path_skips_padding_rows(fp8, first, count):
    """The aligned path (6 tokens x top 3 of 8 experts, 2 of them padding past cu_seqlens[-1] = 4; all experts and
    a tensor-parallel rank's): the padding rows' pairs sort before expert 0's group, so the grouped GEMMs' blocks
    hold the real rows' experts alone; the real rows' outputs are those of the call without cu_seqlens."""
    from metrale_graph.ops.moe import align

    blocks = []
    real = align.align_local_pairs

    def recording(top_e, *rest):
        out = real(top_e, *rest)
        blocks.append(out[1])
        return out

    args = list(op_args("moe", Shapes(lengths=(6,), context=(0,), E=8, TOPK=3, D=40, IE=24, IS=20, fp8=fp8),
                        torch.bfloat16, 7))
    args = _local(args, first, count) if count < 8 else args + [0]
    cu = torch.tensor([0, 3, 4], dtype=torch.int32, device=DEVICE)
    call = clone_args(args, DEVICE)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(align, "align_local_pairs", recording)
        m.setattr(moe, "align_local_pairs", recording)
        whole = moe.moe_cuda(*call)
        padded = moe.moe_cuda(*call, True, cu)
    assert len(blocks) == 2
    assert_close("moe aligned, padding rows marked", whole[:4].float(), padded[:4].float(), 1e-6)
    a = declaration(REGISTRY["moe"].op).Args(*args)
    from metrale_graph.ops.common import rms_norm
    from metrale_graph.ops.moe.reference import route

    _, top_e = route(rms_norm(a.h, a.norm_w, a.eps), a.router_w, 3, True)
    local = lambda e: {x - first for x in e.reshape(-1).tolist() if first <= x < first + count}  # noqa: E731
    assert set(blocks[0].tolist()) - {-1} == local(top_e)
    assert set(blocks[1].tolist()) - {-1} == local(top_e[:4])
    assert local(top_e[:4]) != local(top_e)  # (the padding rows chose experts of their own)


def test_direct_path_never_syncs(monkeypatch):
    """The direct path calls no op that syncs with the host or sizes its output from data."""
    _direct(monkeypatch)
    _forbid_python_syncs(monkeypatch)
    args = _args(3, 16, 4, 32, 24, torch.bfloat16, seed=2)
    with _NoHostSync():
        moe.moe_cuda(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_direct_matches_reference_and_aligned(dtype):
    """The W8A8 experts' direct form (ops/fp8/experts_direct.py) against moe_experts_fp8_ref and the aligned
    moe_experts_fp8 (test_fp8's tolerances: the same quantization points, fp32 sums in another order), at D and IE
    off the 128-groups and the tiles, all experts and a rank's (first_expert 3, 5 of 12: zero rows for the others'
    pairs); zero tokens; a fresh output."""
    from metrale_graph.ops.fp8 import experts as fp8_experts, quantize_weight_blocks
    from metrale_graph.ops.fp8.experts_direct import moe_experts_fp8_direct

    g = torch.Generator().manual_seed(9)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for T, k, E, D, IE, first, EL in ((1, 2, 8, 200, 136, 0, 8), (5, 3, 12, 256, 72, 3, 5), (8, 1, 6, 130, 128, 0, 6)):
        x = torch.randn(T, D, generator=g).to(dtype)
        gate, up, down = (torch.randn(EL, *s, generator=g) * 0.1 for s in ((IE, D), (IE, D), (D, IE)))
        w13, w13s = fp8_experts.stack_gate_up(*quantize_weight_blocks(gate), *quantize_weight_blocks(up))
        w2, w2s = quantize_weight_blocks(down)
        top_e = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        top_w = torch.rand(T, k, generator=g).to(dtype)
        call = (x, top_w, top_e, w13, w13s, w2, w2s, first, E)
        ref = fp8_experts.moe_experts_fp8_ref(*call)
        aligned = fp8_experts.moe_experts_fp8(*call)
        out = moe_experts_fp8_direct(*call)
        assert out.shape == (T * k, D) and out.dtype == dtype
        assert_no_aliasing("moe_experts_fp8_direct", [out], list(call))
        assert_close("fp8 direct vs reference", ref.float(), out.float(), tol)
        assert_close("fp8 direct vs aligned", aligned.float(), out.float(), tol)
        theirs = ((top_e < first) | (top_e >= first + EL)).reshape(-1)
        assert (out[theirs] == 0).all() and (out[~theirs] != 0).any(dim=1).all()
    empty = moe_experts_fp8_direct(x[:0], top_w[:0], top_e[:0], w13, w13s, w2, w2s, 0, E)
    assert empty.shape == (0, D)


def test_fp8_op_takes_the_direct_form(monkeypatch):
    """moe_cuda with FP8 experts at a decode shape (2 tokens x top 2 of 16 experts) calls the direct form, not the
    aligned one, and agrees with the aligned op."""
    def forbidden(*args, **kwargs):
        raise AssertionError("the aligned FP8 experts ran")

    args = list(op_args("moe", Shapes(lengths=(2,), context=(0,), D=200, IE=72, IS=40, E=16, TOPK=2, fp8=True),
                        torch.bfloat16, seed=4))
    aligned = _moe_aligned(args)
    monkeypatch.setattr(moe, "moe_experts_fp8", forbidden)
    out = moe.moe_cuda(*args)
    assert_close("moe fp8 direct vs aligned", aligned.float(), out.float(), TOL[torch.bfloat16])


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
for fn, types, extra in ((direct._moe_direct_gate_up_kernel, gu, dict(TOP_K=8)),
                         (direct._moe_direct_down_kernel, dn, {})):
    # bf16: every candidate tile (the taken one with K a multiple of BK and not); fp32: its one tile
    for x, tiles in (("bf16", direct.CANDIDATES), ("fp32", [direct.FP32_TILE])):
        for bn, bk, w in tiles:
            cfg = triton.Config({}, num_warps=w, num_stages=3)
            taken = (bn, bk, w) in (direct.GATE_UP_TILE, direct.DOWN_TILE, direct.FP32_TILE)
            for even_k in (True, False) if taken else (True,):
                t = {n: v.replace("X", x) for n, v in types.items()}
                smem.append(compile_(fn, t, dict(EVEN_K=even_k, FP32=x == "fp32", BN=bn, BK=bk, **extra), cfg))
from metrale_graph.ops.fp8 import experts_direct as fd
F8, F = "*fp8e4nv", "*fp32"
fgu = dict(x_ptr=F8, xs_ptr=F, w_ptr=F8, ws_ptr=F, gu_ptr=F, e_ptr=I, P="i32", first_expert="i32", EL="i32", N="i32",
           K="i32", stride_x="i32", stride_xs="i32", stride_we="i32", stride_wn="i32", stride_wse="i32",
           stride_wsn="i32")
fdn = dict(a_ptr=F8, as_ptr=F, w_ptr=F8, ws_ptr=F, y_ptr="*bf16", e_ptr=I, rw_ptr="*bf16", P="i32",
           first_expert="i32", EL="i32", N="i32", K="i32", stride_as="i32", stride_we="i32", stride_wn="i32",
           stride_wse="i32", stride_wsn="i32")
for fn, types, extra in ((fd._moe_direct_gate_up_fp8_kernel.fn.fn, fgu, dict(TOP_K=8)),
                         (fd._moe_direct_down_fp8_kernel.fn.fn, fdn, {})):
    for i, cfg in enumerate(fd._configs()):
        for even_k in (True, False) if i == 0 else (True,):
            smem.append(compile_(fn, types, dict(EVEN_K=even_k, **extra, **cfg.kwargs), cfg))
smem.append(compile_(fd._moe_direct_act_fp8_kernel, dict(gu_ptr=F, q_ptr=F8, qs_ptr=F, e_ptr=I, first_expert="i32",
                     EL="i32", N="i32", stride_qs="i32"), dict(DT=triton.language.bfloat16), fd._configs()[0]))
assert max(smem) <= 232448, smem
print("compiled", len(smem))
"""


def test_direct_kernels_compile_for_sm90():
    """The direct kernels (bf16 / fp32 and FP8) through Triton's real compiler for sm_90 (PTX and ptxas, no GPU
    needed): the interpreter accepts what the compiler rejects. A subprocess: the interpreter is on in this one."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


@pytest.mark.gpu
def test_direct_at_35b_a3b_shape_and_replay():
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
        assert direct.takes_direct(T * k, E)
        ref_args[0], call[0], args[0] = ref_h[:T], cuda_h[:T], h[:T]
        ref = REGISTRY["moe"].op(*ref_args)
        aligned = _moe_aligned(call)
        out = moe.moe_cuda(*call)
        rows = compared_rows("moe", args, dtype)
        assert_close(f"35B-A3B direct T={T} vs reference", ref[rows], out.cpu()[rows], TOL[dtype])
        assert_close(f"35B-A3B direct T={T} vs aligned", aligned.cpu().float(), out.cpu().float(), TOL[dtype])
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


@pytest.mark.gpu
def test_fp8_direct_at_35b_a3b_shape_and_replay():
    """CUDA, the 35B-A3B-FP8's routed experts (D 2048, 256 experts, top 8, IE 512; weights quantized on the
    device), bf16, T = 1 and 8: the direct form against the reference and the aligned form (test_fp8's bf16
    tolerance), then captured in a CUDA graph at T = 8 and replayed on other routings, equal to eager bit for bit."""
    from metrale_graph.ops.fp8 import experts as fp8_experts, quantize_weight_blocks
    from metrale_graph.ops.fp8.experts_direct import moe_experts_fp8_direct

    E, k, D, IE = 256, 8, 2048, 512
    g = torch.Generator(device="cuda").manual_seed(5)
    gate, up = (torch.randn(E, IE, D, generator=g, device="cuda") * 0.02 for _ in range(2))
    w13, w13s = fp8_experts.stack_gate_up(*quantize_weight_blocks(gate), *quantize_weight_blocks(up))
    del gate, up
    w2, w2s = quantize_weight_blocks(torch.randn(E, D, IE, generator=g, device="cuda") * 0.02)

    def routing(T):
        x = torch.randn(T, D, generator=g, device="cuda").to(torch.bfloat16)
        top_e = torch.stack([torch.randperm(E, generator=g, device="cuda")[:k] for _ in range(T)])
        return x, torch.rand(T, k, generator=g, device="cuda").to(torch.bfloat16), top_e

    for T in (1, 8):
        call = (*routing(T), w13, w13s, w2, w2s, 0, E)
        out = moe_experts_fp8_direct(*call)
        assert_close(f"fp8 direct T={T} vs reference", fp8_experts.moe_experts_fp8_ref(*call).float(), out.float(), 1e-2)
        assert_close(f"fp8 direct T={T} vs aligned", fp8_experts.moe_experts_fp8(*call).float(), out.float(), 1e-2)
    x, top_w, top_e = routing(8)
    moe_experts_fp8_direct(x, top_w, top_e, w13, w13s, w2, w2s, 0, E)  # autotuned before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe_experts_fp8_direct(x, top_w, top_e, w13, w13s, w2, w2s, 0, E)
    for _ in range(3):
        for buf, new in zip((x, top_w, top_e), routing(8)):
            buf.copy_(new)
        graph.replay()
        assert torch.equal(static_out, moe_experts_fp8_direct(x, top_w, top_e, w13, w13s, w2, w2s, 0, E))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_shared_expert_stream_is_exact(fp8, monkeypatch):
    """METRALE_MOE_SHARED_STREAM (ops.moe.SHARED_STREAM): the shared expert on a second stream gives the op's
    output bit for bit, eager and replayed from a CUDA graph captured with the fork and join, on the direct path
    (T 1, 4) and the aligned one (T 64), bf16 and FP8 (shared expert and experts FP8)."""
    case = Shapes(lengths=(64,), context=(0,), E=128, TOPK=8, D=1024, IE=256, IS=512, fp8=fp8)
    call = clone_args(list(op_args("moe", case, torch.bfloat16, seed=3)), "cuda")
    tokens = call[0].clone()
    for T in (1, 4, 64):
        call[0] = tokens[:T].clone()
        monkeypatch.setattr(moe, "SHARED_STREAM", False)
        want = moe.moe_cuda(*call)
        monkeypatch.setattr(moe, "SHARED_STREAM", True)
        assert torch.equal(moe.moe_cuda(*call), want), T
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = moe.moe_cuda(*call)
        for start in (0, 3) if T < 64 else (0,):
            call[0].copy_(tokens.roll(start, 0)[:T])
            graph.replay()
            monkeypatch.setattr(moe, "SHARED_STREAM", False)
            assert torch.equal(static_out, moe.moe_cuda(*call)), (T, start)
            monkeypatch.setattr(moe, "SHARED_STREAM", True)

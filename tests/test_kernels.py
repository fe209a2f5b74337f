"""The CUDA implementations of the phase ops against their CPU references on upcast inputs.

Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1): the recurrence's CUDA path runs whole here (our chunked kernels on the packed
tokens, split with the recurrent kernel for short streams of calls that are not decode-shaped; the
recurrent kernel alone for decode-shaped ones). flash-linear-attention does not run there, so its
chunk-aligned layout (the "fla" backend's) is checked with the reference as the varlen kernel (the
fla call itself is covered by the GPU tests). The decode paths are also checked directly on any
lengths, and their choice against static sizes.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from helpers import tiny_config
from kernel_oracles import align_pairs_torch, aligned_layout
from metrics import (TOL, assert_close, assert_no_aliasing, clone_args, compared_rows, outputs, round_bf16_to_nearest,
                     upcast)
from metrale_graph.config import FULL
from metrale_graph.ops import (REGISTRY, Shapes, causal_conv1d, declaration, gdn_recurrence, kernels, moe,
                               paged_attention)
from metrale_graph.ops.common import decode_shaped, rms_norm
from metrale_graph.ops.gdn_chunked import launch as gdn_chunked_launch
from metrale_graph.ops.gdn_recurrence import (chunked as gdn_chunked_path, layout as gdn_layout,
                                              recurrent as gdn_recurrent, split as gdn_split)
from metrale_graph.ops.limits import check_supported
from metrale_graph.ops.moe import align as moe_align, reference as moe_reference, routing as moe_routing
from metrale_graph.ops.paged_attention import decode as attn_decode, kv_write, prefill as attn_prefill
from metrale_graph.ops.tiles import _stream_of, search_steps
from op_cases import CASES, FP8_CASES, FP8_OPS, op_args

# every op's CUDA path
CUDA_IMPLS = {name: spec.cuda for name, spec in REGISTRY.items() if spec.cuda}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# flash-linear-attention's chunk kernels take fp32 inputs through tf32 tensor-core dots (Triton's default
# input precision): ~1e-3 of relative error on the H200, which the fp32 tolerance does not cover. Ours take
# them through tf32x3 (~1e-6 measured at the 9B heads on the H200; fp32 exact in the interpreter): on a GPU
# they get test_gdn_chunked's 1e-4.
FLA_FP32_TOL = 5e-3
CHUNKED_FP32_TOL = 1e-4


def takes_chunked_path(name, case):
    """Whether the op's CUDA path runs the recurrence's chunked kernels: the recurrence, not decode-shaped,
    with a stream longer than split_max_len(B) (the others take the recurrent kernel)."""
    longest = max(case.lengths, default=0)
    return (name == "gdn_recurrence" and not decode_shaped(case.B, case.T)
            and longest > gdn_split.split_max_len(case.B))


def tolerance(name, case, dtype):
    if DEVICE == "cuda" and dtype == torch.float32 and takes_chunked_path(name, case):
        return FLA_FP32_TOL if gdn_recurrence.chunked_backend(case.K, case.V, DEVICE) == "fla" else CHUNKED_FP32_TOL
    return TOL[dtype]


# FP8 ops in bf16 against the upcast reference: a bf16 ulp of difference in an activation (the norm kernel's
# rounding against torch's; under the interpreter Triton truncates to bf16) flips an FP8 code where the
# value sits on a rounding boundary, one FP8 step (2^-3 relative) of that element: measured 1.3e-2..2.1e-2
# on FP8_CASES, below W8A8's own distance from the bf16 product (3.7e-2), far below a misread scale
FP8_BF16_TOL = 3e-2


def check_against_reference(name, impl, case, dtype, seed=0):
    tol = tolerance(name, case, dtype)
    if case.fp8 and dtype == torch.bfloat16:
        tol = FP8_BF16_TOL
    args = op_args(name, case, dtype, seed)
    ref_args = upcast(clone_args(args, "cpu"))
    test_args = clone_args(args, DEVICE)
    ref = outputs(REGISTRY[name].op(*ref_args))
    out = outputs(impl(*test_args))
    assert len(out) == len(ref), f"{name}: {len(out)} outputs, the reference returns {len(ref)}"
    if dtype == torch.float32:  # fresh outputs (fp32: where a dtype cast is a no-op that could hand back its input)
        assert_no_aliasing(f"{name} (reference)", ref, ref_args)
        assert_no_aliasing(f"{name} (cuda)", out, test_args)
    rows = compared_rows(name, args, dtype)  # moe: tokens whose routing has a margin
    if rows is not None and len(rows) >= 16:
        assert rows.float().mean() >= 0.5, f"{name}: too few tokens to compare ({int(rows.sum())} of {len(rows)})"
    if rows is not None and len(rows):
        assert rows.any(), f"{name}: no token to compare (every routing on a near tie)"
    for i, (r, o) in enumerate(zip(ref, out)):
        o = o.cpu()
        if rows is not None:
            r, o = r[rows], o[rows]
        assert_close(f"{name} output {i}", r, o, tol)
    for i, (r, a) in enumerate(zip(ref_args, test_args)):  # mutated pools
        if isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn:  # FP8 weights: read only
            assert torch.equal(a.cpu().view(torch.uint8), r.view(torch.uint8)), f"{name}: FP8 argument {i} changed"
        elif isinstance(a, torch.Tensor) and a.is_floating_point() and not torch.equal(a.cpu().float(), r):
            assert_close(f"{name} mutated arg {i}", r, a.cpu(), tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("name", list(CUDA_IMPLS))
def test_cuda_impl_matches_reference(name, case, dtype, monkeypatch):
    if name == "gdn_recurrence":
        fla = gdn_recurrence.chunked_backend(case.K, case.V, DEVICE) == "fla"
        if DEVICE == "cpu" and takes_chunked_path(name, case) and fla:
            pytest.skip("METRALE_GDN_CHUNKED=fla: fla runs on a GPU only")
        round_bf16_to_nearest(monkeypatch)  # the interpreter's bf16 casts, as the GPU rounds (chunked kernels)
    check_against_reference(name, CUDA_IMPLS[name], case, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", FP8_CASES, ids=[c.id for c in FP8_CASES])
@pytest.mark.parametrize("name", FP8_OPS)
def test_fp8_cuda_impl_matches_reference(name, case, dtype):
    """The FP8 variants (W8A8 GEMMs: the Triton kernels in the interpreter on the CPU) against the
    reference (fake-quantized activations, dequantized weights, fp32): fp32 within 1e-5, bf16 FP8_BF16_TOL."""
    check_against_reference(name, CUDA_IMPLS[name], case, dtype)


@pytest.mark.parametrize("case", FP8_CASES[:2], ids=[c.id for c in FP8_CASES[:2]])
@pytest.mark.parametrize("name", FP8_OPS)
def test_fp8_outputs_alias_nothing(name, case):
    args = clone_args(op_args(name, case, torch.float32), DEVICE)
    for fn in (REGISTRY[name].reference, CUDA_PATHS[name]):
        assert_no_aliasing(f"{name} (FP8)", outputs(fn(*args)), args)


def _reference_varlen(q, k, v, g, beta, cu_aligned, chunk_indices, h0):
    NT = chunk_indices.shape[0]
    assert cu_aligned[-1].item() == NT * gdn_layout.CHUNK
    starts = cu_aligned[chunk_indices[:, 0]] + gdn_layout.CHUNK * chunk_indices[:, 1]
    assert torch.equal(starts, torch.arange(NT, device=starts.device) * gdn_layout.CHUNK)
    slots = torch.arange(h0.shape[0], device=h0.device)
    return REGISTRY["gdn_recurrence"].reference(q, k, v, g, beta, cu_aligned.int(), slots, h0), h0


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_recurrence_aligned_layout_is_exact(case):
    """Chunk alignment with identity tokens, state gather / scatter: bit-exact against the direct
    reference, padding streams included."""
    args = op_args("gdn_recurrence", case, torch.float32, seed=9)
    test_args = clone_args(args, "cpu")
    ref = REGISTRY["gdn_recurrence"].reference(*args)
    out = gdn_layout.gdn_recurrence_aligned(*test_args, _reference_varlen)
    assert torch.equal(out, ref) and torch.equal(test_args[-1], args[-1])


@pytest.mark.parametrize("short", [0, 64])
def test_chunk_layout_kernel_matches_torch_layout(short):
    """The one-launch Triton layout (the CUDA path's) against aligned_layout in torch ops: the same
    sequence offsets and chunk indices, for ragged, zero-length, short and boundary streams."""
    g = torch.Generator().manual_seed(short)
    batches = [(300,), (1,) * 31 + (512,), (64, 65, 0, 1, 130), (0, 0, 7), (200, 0, 64, 65, 63, 129, 1, 1000)]
    batches += [tuple(torch.randint(0, 300, (B,), generator=g).tolist()) for B in (3, 17, 40)]
    for lengths in batches:
        for spare in (0, 5):  # tokens past the last stream
            cu = torch.tensor((0,) + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
            T = int(cu[-1]) + spare
            _, cu_al, chunks, _ = aligned_layout(cu, T, short)
            got_cu, got_bounds, got_chunks = gdn_layout.chunk_layout_bounds(cu.to(DEVICE), T, short)
            assert torch.equal(got_cu.cpu(), cu_al), (lengths, got_cu, cu_al)
            assert torch.equal(got_chunks.cpu(), chunks), lengths
            # the packed bounds: each stream where it lies (empty at its start when left out), then sequence B
            # empty at cu[B]
            ends = torch.where(cu[1:] - cu[:-1] > short, cu[1:], cu[:-1])
            expected = torch.stack([cu, torch.cat([ends, cu[-1:]])]).long()
            assert torch.equal(got_bounds.cpu(), expected), (lengths, got_bounds)
            # the compacted layout (the CUDA chunked path's): the long streams in order, then empty sequences
            # at cu[B] up to M = num_long, then the spare M; chunk rows renamed to these sequences
            slot_ids = torch.randperm(len(lengths) + 3, generator=g)[:len(lengths)]
            c_cu, c_bounds, c_slots, c_chunks = gdn_layout.chunk_layout_compact(cu.to(DEVICE), slot_ids.to(DEVICE),
                                                                               T, short)
            M = gdn_layout.num_long(len(lengths), T, short)
            long = [b for b, n in enumerate(lengths) if n > short]
            assert torch.equal(c_cu.cpu(), cu_al) and c_bounds.shape == (2, M + 1) and c_slots.shape == (M,)
            want = expected[:, long + [len(lengths)] * (M + 1 - len(long))]
            assert torch.equal(c_bounds.cpu(), want), (lengths, c_bounds)
            assert c_slots.cpu()[:len(long)].tolist() == slot_ids[long].tolist()
            rename = {b: j for j, b in enumerate(long)} | {len(lengths): M}
            assert torch.equal(c_chunks.cpu()[:, 1], chunks[:, 1]), lengths
            assert c_chunks.cpu()[:, 0].tolist() == [rename[int(b)] for b in chunks[:, 0]], lengths


@pytest.mark.parametrize("short", [0, gdn_split.SHORT])
def test_aligned_layout_chunk_count_is_fixed(short):
    """Any lengths with the same (B, T) give the same number of sequences and chunks; streams of at most
    `short` tokens are left out (length 0, their tokens on the dump row T_al), the others keep their
    tokens in order from a chunk boundary, and the chunks fit (the absorber's length is not negative)."""
    shapes = set()
    for lengths in ([1, 1, 126], [64, 64, 0], [100, 27, 1], [0, 0, 128], [65, 63, 0], [1, 126, 1]):
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
        dest, cu_al, chunks, T_al = aligned_layout(cu, 128, short)
        shapes.add((cu_al.shape, chunks.shape, T_al))
        assert T_al == gdn_layout.CHUNK * (2 + min(3, 128 // (short + 1)))
        assert (cu_al[1:] >= cu_al[:-1]).all() and (cu_al % gdn_layout.CHUNK == 0).all()
        for b, n in enumerate(lengths):
            rows = dest[cu[b]:cu[b + 1]]
            if n > short:
                assert cu_al[b + 1] - cu_al[b] == -(-n // gdn_layout.CHUNK) * gdn_layout.CHUNK
                assert torch.equal(rows, cu_al[b] + torch.arange(n))
            else:
                assert cu_al[b + 1] == cu_al[b] and (rows == T_al).all()
    assert len(shapes) == 1


def test_mixed_step_chunk_count():
    """31 one-token decodes and a 512-token prompt chunk: 17 chunks in the split layout, not 41."""
    cu = torch.tensor([0] + list(range(1, 32)) + [543], dtype=torch.int32)
    assert aligned_layout(cu, 543)[2].shape[0] == 41
    assert aligned_layout(cu, 543, gdn_split.split_max_len(32))[2].shape[0] == 17


def _aligned_path(*args):
    """The recurrence's CUDA path with the "fla" backend, the reference in fla's place on the aligned layout."""
    if gdn_split.use_recurrent(args[0], args[6]):
        return gdn_recurrence.gdn_recurrence_cuda(*args)
    return gdn_split.gdn_recurrence_split(*args, _reference_varlen)


CUDA_PATHS = dict(CUDA_IMPLS)


# (op, path) pairs check_against_reference does not run: references of ops without a CUDA path, the aligned layout
ALIAS_PATHS = [(name, "reference") for name in REGISTRY if name not in CUDA_PATHS] + [("gdn_recurrence", "aligned")]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("name, impl", ALIAS_PATHS, ids=[f"{n}-{i}" for n, i in ALIAS_PATHS])
def test_outputs_alias_nothing(name, impl, case):
    """Fresh outputs (T = 1 and T = 0 are where a slice or reshape of one GEMM output comes back as a
    view; fp32, where dtype casts are no-ops that could hand back their input) from the paths the fp32
    reference comparison does not run: the CPU reference of an op without a CUDA path, and the fla
    backend's aligned layout of the recurrence. The CUDA paths and the references of the others are checked
    in check_against_reference (test_cuda_impl_matches_reference's fp32 cases)."""
    args = clone_args(op_args(name, case, torch.float32), DEVICE)
    fn = {"reference": REGISTRY[name].reference, "aligned": _aligned_path}[impl]
    assert_no_aliasing(f"{name} ({impl})", outputs(fn(*args)), args)


# The decode paths, directly ----------------------------------------------------------------------
# The recurrent kernel on any lengths (long streams too: the path choice only makes it slower), key
# dims up to 256 and value dims that are not powers of two (partial V tiles), head ratios 1..3.
RECURRENT_CASES = [c for c in CASES if decode_shaped(c.B, c.T)] + [
    CASES[0],  # streams of 1, 63 and 65 tokens
    Shapes(lengths=(3, 0, 2), context=(0, 0, 0), H=1, HV=2, K=200, V=136),
    Shapes(lengths=(2, 1), context=(0, 0), H=2, HV=2, K=256, V=256),
    Shapes(lengths=(1, 1, 1), context=(0, 0, 0), H=1, HV=1, K=5, V=3),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", RECURRENT_CASES, ids=[c.id for c in RECURRENT_CASES])
def test_recurrent_kernel_matches_reference(case, dtype):
    """Outputs and every pool row against the token-by-token reference on upcast inputs; rows of
    slots outside the batch (and of zero-length streams) bit-identical."""
    args = op_args("gdn_recurrence", case, dtype, seed=4)
    ref_args = upcast(clone_args(args, "cpu"))
    test_args = clone_args(args, DEVICE)
    ref = REGISTRY["gdn_recurrence"].reference(*ref_args)
    out = gdn_recurrent.gdn_recurrence_recurrent(*test_args)
    assert out.dtype == args[2].dtype
    assert_close("o", ref, out.cpu(), TOL[dtype])
    _check_pool(args, ref_args, test_args, dtype)


@pytest.mark.parametrize("tiles", [(8, 1), (16, 2), (32, 4), (64, 4)])
def test_recurrent_kernel_tiles_match_the_default(tiles):
    """benchmarks/kernels/check_decode.py's tile sweep: other (BV, num_warps) tiles give the default's outputs and states (each
    value column is its own reduction over K); tiles that are not two powers of two are a ValueError."""
    case = RECURRENT_CASES[1]
    args = op_args("gdn_recurrence", case, torch.float32, seed=4)
    default, other = clone_args(args, DEVICE), clone_args(args, DEVICE)
    out = gdn_recurrent.gdn_recurrence_recurrent(*default)
    assert torch.equal(out, gdn_recurrent.gdn_recurrence_recurrent(*other, tiles=tiles))
    assert torch.equal(default[-1], other[-1])
    for bad in ((12, 2), (16,), (16, 0), (16.0, 2)):
        with pytest.raises(ValueError, match="tiles must be"):
            gdn_recurrent.gdn_recurrence_recurrent(*clone_args(args, DEVICE), tiles=bad)


def _check_pool(args, ref_args, test_args, dtype, tol=None):
    """The GDN state pool after a call: within tolerance (default TOL[dtype]) of the reference's, and the rows
    of slots outside the batch (and of zero-length streams) bit-identical to before."""
    state, before = test_args[-1].cpu(), args[-1]
    assert_close("gdn_state", ref_args[-1], state, TOL[dtype] if tol is None else tol)
    touched = set(args[6][args[5][1:] > args[5][:-1]].tolist())
    for slot in range(state.shape[0]):
        if slot not in touched:
            assert torch.equal(state[slot], before[slot]), f"slot {slot} outside the batch changed"


# The split path (calls that are not decode-shaped), the reference in fla's place: a mixed step (one-token
# decodes and a prompt chunk), the SHORT / SHORT + 1 boundary, all streams short, all long, a single stream
# (chunked whole), padding streams among them, tokens in no stream. Tiny heads: the recurrent kernel runs
# in the interpreter.
def _split_case(lengths, **dims):
    B = len(lengths)
    return Shapes(lengths=lengths, context=(0,) * B, **dict(dict(H=1, HV=2, K=8, V=8), **dims), BS=512, num_blocks=B,
                  num_slots=B + 2)


SPLIT_CASES = [
    (_split_case((1,) * 31 + (300,)), 0),
    (_split_case((64, 65, 0, 1)), 0),
    (_split_case((65, 64), H=2, HV=6, K=12, V=10), 0),
    (_split_case((40, 64, 1, 0, 30)), 0),  # all short
    (_split_case((70, 130, 66)), 0),  # all long
    (_split_case((150,)), 0),
    (_split_case((0, 3, 0, 90, 0, 1, 0)), 0),
    (_split_case((2, 1, 100, 33)), 7),  # the last 7 tokens in no stream
    (_split_case((130,)), 20),  # one stream (chunked whole), the last 20 tokens in no stream
]
CHUNKED_PATHS = {"ours": lambda *a: gdn_split.gdn_recurrence_split(*a),
                 "aligned": lambda *a: gdn_split.gdn_recurrence_split(*a, _reference_varlen)}


@pytest.mark.parametrize("chunked", list(CHUNKED_PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case,spare", SPLIT_CASES, ids=[f"{c.id}-spare{n}" for c, n in SPLIT_CASES])
def test_split_path_matches_reference(case, spare, dtype, chunked, monkeypatch):
    """Outputs of tokens in streams and every pool row against the token-by-token reference on upcast
    inputs; rows of slots outside the batch (and of zero-length streams) bit-identical. Our chunked kernels
    (the CUDA path) or the aligned layout (the fla backend's, the reference in fla's place). Ours also zero
    the rows of tokens in no stream."""
    assert not decode_shaped(case.B, case.T)
    round_bf16_to_nearest(monkeypatch)
    args = list(op_args("gdn_recurrence", case, dtype, seed=6))
    args[5] = args[5].clone()
    args[5][-1] -= spare
    ref_args = upcast(clone_args(args, "cpu"))
    test_args = clone_args(args, DEVICE)
    ref = REGISTRY["gdn_recurrence"].reference(*ref_args)
    out = CHUNKED_PATHS[chunked](*test_args)
    assert out.dtype == args[2].dtype and out.shape == args[2].shape
    in_stream = case.T - spare
    tol = CHUNKED_FP32_TOL if DEVICE == "cuda" and dtype == torch.float32 and chunked == "ours" else TOL[dtype]
    assert_close("o", ref[:in_stream], out.cpu()[:in_stream], tol)
    assert torch.equal(out[in_stream:].cpu(), torch.zeros_like(out[in_stream:].cpu())), "rows in no stream"
    _check_pool(args, ref_args, test_args, dtype, tol)


@pytest.mark.parametrize("chunked", list(CHUNKED_PATHS))
def test_split_path_takes_int32_slot_ids(chunked):
    """slot_ids may be int32 (the op's schema takes int32 or int64): our state kernel's slot loads, the aligned
    layout's state scatter (index_copy_, which takes only int64 indices), and the recurrent kernel."""
    case = SPLIT_CASES[1][0]  # streams of 64, 65, 0 and 1 tokens: both paths, a padding stream
    args = list(op_args("gdn_recurrence", case, torch.float32, seed=6))
    args[6] = args[6].to(torch.int32)
    ref_args = clone_args(args, "cpu")
    test_args = clone_args(args, DEVICE)
    ref = REGISTRY["gdn_recurrence"].reference(*ref_args)
    out = CHUNKED_PATHS[chunked](*test_args)
    tol = CHUNKED_FP32_TOL if DEVICE == "cuda" and chunked == "ours" else TOL[torch.float32]
    assert_close("o", ref, out.cpu(), tol)
    _check_pool(args, ref_args, test_args, torch.float32, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_path_touches_no_slot_but_its_streams(dtype, monkeypatch):
    """Our chunked path alone (no recurrent kernel after it): the slots of short and zero-length streams
    (poisoned with NaN) and of slots outside the batch are neither read nor written, their output rows are
    left as they were, rows of tokens in no stream become 0; the long streams' rows and slots match the
    reference. And through the op's checkpoints (internal): the state at the start of chunk rows."""
    round_bf16_to_nearest(monkeypatch)
    case = _split_case((1, 70, 0, 64, 130, 65))
    args = list(op_args("gdn_recurrence", case, dtype, seed=8))
    args[5] = args[5].clone()
    args[5][-1] -= 10  # 10 tokens in no stream
    cu, slots = args[5], args[6]
    lengths = (cu[1:] - cu[:-1]).tolist()
    short = gdn_split.split_max_len(case.B)
    for b, n in enumerate(lengths):
        if n <= short:
            args[7][slots[b]] = float("nan")
    ref_args = upcast(clone_args(args, "cpu"))
    ref = REGISTRY["gdn_recurrence"].reference(*ref_args)
    test_args = clone_args(args, DEVICE)
    q, k, v, g, beta, cu_d, slots_d, pool = test_args
    o = torch.full(v.shape, 5.0, dtype=v.dtype, device=v.device)
    cu_al, _, rows = gdn_layout.chunk_layout_bounds(cu_d, case.T, short)
    first = (cu_al // gdn_layout.CHUNK).cpu()
    # stream 4's chunk 1, stream 1's chunk 0, none
    chunks = torch.stack([first[4] + 1, first[1], torch.tensor(-1)]).to(DEVICE)
    ckpt = torch.zeros((3,) + tuple(pool.shape[1:]), device=DEVICE)
    out = gdn_chunked_path.gdn_recurrence_chunked(q, k, v, g, beta, cu_d, slots_d, pool, short, o,
                                                  checkpoint_chunks=chunks, checkpoints=ckpt)
    assert out is o
    out, pool, ckpt = out.cpu(), pool.cpu(), ckpt.cpu()
    for b, n in enumerate(lengths):
        r = slice(int(cu[b]), int(cu[b + 1]))
        if n > short:
            assert_close(f"o of stream {b}", ref[r], out[r].float(), TOL[dtype])
            assert_close(f"slot of stream {b}", ref_args[7][slots[b]], pool[slots[b]], TOL[dtype])
        else:
            assert (out[r] == 5).all(), f"rows of short stream {b} were written"
    assert (out[int(cu[-1]):] == 0).all()
    touched = {int(slots[b]) for b, n in enumerate(lengths) if n > short}
    for slot in range(pool.shape[0]):
        if slot not in touched:
            same = (pool[slot] == args[7][slot]) | (pool[slot].isnan() & args[7][slot].isnan())
            assert same.all(), f"slot {slot} outside the chunked streams changed"
    # the reference's state at the starts: stream 4 after its first 64 tokens, stream 1 before any
    s4 = clone_args(args, "cpu")
    s4[5] = torch.tensor([0, 64], dtype=torch.int32)
    s4 = upcast([x[int(cu[4]):int(cu[4]) + 64] if i < 5 else x for i, x in enumerate(s4)])
    s4[6] = slots[4:5]
    REGISTRY["gdn_recurrence"].reference(*s4)
    assert_close("checkpoint of stream 4's chunk 1", s4[7][slots[4]], ckpt[0], TOL[dtype])
    assert torch.equal(ckpt[1], args[7][slots[1]]) and torch.equal(ckpt[2], torch.zeros_like(ckpt[2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lengths", [(1, 70, 0, 64, 130, 65), (200,), (1, 40, 2), (3, 1, 1, 129, 1, 1, 1, 1)],
                         ids=["split", "one-stream", "decode-shaped", "decode-shaped-long"])
def test_gdn_recurrence_cuda_path_keeps_prefix_checkpoints(lengths, dtype, monkeypatch):
    """The op's prefix-caching checkpoints (ops/checkpoints.py) on the CUDA path: the states after the
    tokens the prefill protocol asks for (chunk ends of chunked streams, any token of the recurrent kernel's
    streams, every stream's last token) match the reference's; entries no checkpoint names are untouched,
    tokens -1 and past the streams keep nothing, and o / the pool are those of a call without checkpoints."""
    round_bf16_to_nearest(monkeypatch)
    case = _split_case(lengths)
    args = list(op_args("gdn_recurrence", case, dtype, seed=3))
    cu, B, T = args[5], case.B, case.T
    decode = decode_shaped(B, T)
    short = T if decode else gdn_split.split_max_len(B)
    tokens = []
    for b, n in enumerate(lengths):
        ends = range(1, n + 1) if n <= short else [*range(64, n, 64), n]
        tokens += [int(cu[b]) + r - 1 for r in ends if r in (1, 2, n) or n > short or r % 17 == 0]
    tokens += [-1, T + 5]
    NC, E = len(tokens), len(tokens) + 3
    entries = torch.randperm(E - 1, generator=torch.Generator().manual_seed(0))[:NC]
    entries[-2:] = E - 1  # the none-targets' scratch entry
    ck = [torch.tensor(tokens, dtype=torch.int64), entries.long(),
          torch.full((E,) + tuple(args[7].shape[1:]), 9.0)]
    ref_args = upcast(clone_args(args + ck, "cpu"))
    ref = REGISTRY["gdn_recurrence"].op(*ref_args)
    plain = clone_args(args, DEVICE)
    o_plain = CUDA_IMPLS["gdn_recurrence"](*plain)
    test_args = clone_args(args + ck, DEVICE)
    o = CUDA_IMPLS["gdn_recurrence"](*test_args)
    assert torch.equal(o.cpu(), o_plain.cpu()) and torch.equal(test_args[7].cpu(), plain[7].cpu())
    tol = tolerance("gdn_recurrence", case, dtype)
    assert_close("o", ref, o.cpu().float(), tol)
    pool = test_args[10].cpu()
    for t, e in zip(tokens[:-2], entries[:-2].tolist()):
        assert_close(f"checkpoint after token {t}", ref_args[10][e], pool[e], tol)
    untouched = set(range(E - 1)) - set(entries[:-2].tolist())
    assert untouched and all((pool[e] == 9.0).all() for e in untouched), "an entry no checkpoint names changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lengths", [(1, 5, 0, 2, 1), (7,), (0, 0, 3), (0, 0)],
                         ids=["streams", "one", "padding-first", "no-tokens"])
def test_checkpoint_kernels_match_their_torch_versions(lengths, dtype):
    """The one-launch checkpoint kernels of the CUDA paths (ops/checkpoints.py: conv windows, stream-end
    states, the per-token entry map) write what the torch versions write into every entry a checkpoint
    names, and nothing anywhere else (the torch versions dump the none-targets into the scratch entry). With
    no tokens at all every checkpoint keeps nothing (the torch conv windows indexed the empty x: IndexError)."""
    from metrale_graph.ops import checkpoints as ck
    g = torch.Generator().manual_seed(11)
    B, T, C, W1, S = len(lengths), sum(lengths), 40, 3, 9
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    slots = torch.randperm(S - 1, generator=g)[:B].long()
    x = torch.randn(T, 2 * C, generator=g).to(dtype)[:, ::2]  # strided, as the model passes it
    conv_state = torch.randn(S, C, W1, generator=g).to(dtype)
    gdn_state = torch.randn(S, 2, 8, 8, generator=g)
    tokens = [*range(T), -1, T, T + 7]  # every token, then three that keep nothing
    E = len(tokens) + 4
    entries = torch.randperm(E - 1, generator=g)[:len(tokens)]
    entries[-3:] = E - 1
    tokens = torch.tensor(tokens, dtype=torch.int64)
    named = set(entries[:-3].tolist())
    for longer_than in (0, 2):
        for torch_fn, kernel_fn, args, pool in (
                (ck.keep_conv_windows, ck.keep_conv_windows_triton, (x, cu, slots, conv_state),
                 torch.full((E, C, W1), 5.0, dtype=dtype)),
                (ck.keep_end_states, ck.keep_end_states_triton, (cu, slots, gdn_state),
                 torch.full((E, 2, 8, 8), 5.0))):
            kw = {"longer_than": longer_than} if torch_fn is ck.keep_end_states else {}
            want, got = pool.clone(), pool.clone()
            torch_fn(*clone_args(args, "cpu"), tokens, entries, want, **kw)
            kernel_fn(*clone_args(args, DEVICE), tokens.to(DEVICE), entries.to(DEVICE), got_d := got.to(DEVICE), **kw)
            got = got_d.cpu()
            for e in range(E):
                if e in named:
                    assert torch.equal(got[e], want[e]), f"{kernel_fn.__name__}: entry {e}"
                else:
                    assert (got[e] == 5.0).all(), f"{kernel_fn.__name__}: entry {e} that no checkpoint names changed"
    # copy_rows (the accepted verify states into their slots): the named rows moved, padding rows skipped
    index = torch.tensor([[3, 0, S - 1, 5], [E - 2, 1, E - 1, 0]])
    for dst, src in ((conv_state, torch.randn(E, C, W1, generator=g).to(dtype)), (gdn_state, torch.randn(E, 2, 8, 8))):
        got, want = dst.clone().to(DEVICE), dst.clone()
        ck.copy_rows(got, src.to(DEVICE), index.to(DEVICE), skip=S - 1)
        want[[3, 0, 5]] = src[[E - 2, 1, 0]]
        assert torch.equal(got.cpu(), want)
    with pytest.raises(ValueError, match="int64"):
        ck.copy_rows(gdn_state.clone(), gdn_state.clone(), index.int())
    entries_map = ck.token_entries(tokens.to(DEVICE), entries.to(DEVICE), T).cpu()
    assert entries_map.tolist() == entries[:T].tolist()
    assert ck.token_entries(tokens[T:].to(DEVICE), entries[T:].to(DEVICE), T).cpu().tolist() == [-1] * T


# several 64 / 128-key splits per stream with a partial last one, blocks of 16 / 48 / 64 (splits and
# blocks unaligned), query heads per KV head 1..4, streams of several query tiles, zero-length streams
DECODE_ATTENTION_CASES = [
    Shapes(lengths=(1, 1, 0, 1), context=(130, 0, 0, 47), BS=16, num_blocks=40),
    Shapes(lengths=(2, 1), context=(200, 95), HD=48, HQ=3, HKV=1, BS=48, num_blocks=12),
    Shapes(lengths=(1, 9), context=(250, 60), HQ=8, HKV=2, HD=32, BS=64, num_blocks=10),
    Shapes(lengths=(0, 17, 1), context=(0, 100, 191), HQ=2, HKV=2, BS=64, num_blocks=12),
]


@pytest.mark.parametrize("split", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", DECODE_ATTENTION_CASES, ids=[c.id for c in DECODE_ATTENTION_CASES])
def test_decode_attention_matches_reference(case, dtype, split):
    args = op_args("paged_attention", case, dtype, seed=5)
    ref_args = upcast(clone_args(args, "cpu"))
    test_args = clone_args(args, DEVICE)
    ref = REGISTRY["paged_attention"].reference(*ref_args)
    default = paged_attention.paged_attention_triton(*test_args, decode=True)  # KV write, default split
    q, _, _, k_cache, v_cache, cu, ctx, blocks = test_args
    out = attn_decode.paged_attention_decode(q, k_cache, v_cache, cu, ctx, blocks, torch.empty_like(q),
                                                 split=split)
    assert_close("o (default split)", ref, default.cpu(), TOL[dtype])
    assert_close(f"o (split {split})", ref, out.cpu(), TOL[dtype])
    for i in (3, 4):
        assert_close(f"pool {i}", ref_args[i], test_args[i].cpu(), TOL[dtype])


def test_decode_attention_is_exact_for_long_streams():
    """A prefill-shaped batch through the split-K path: exact, only slower (query tiles of QB)."""
    case = Shapes(lengths=(70, 1), context=(9, 40), HQ=4, HKV=1)
    args = op_args("paged_attention", case, torch.float32, seed=6)
    ref = REGISTRY["paged_attention"].reference(*clone_args(args, "cpu"))
    out = paged_attention.paged_attention_triton(*clone_args(args, DEVICE), decode=True)
    assert_close("o", ref, out.cpu(), TOL[torch.float32])


@pytest.mark.parametrize("programs", [32, 64])
def test_decode_attention_spreads_each_stream_over_the_splits(monkeypatch, programs):
    """Block tables far wider than the contexts (a server's max_context against short chats): few target
    programs make the static split long (DECODE_PROGRAMS 32 / 64: 192 / 128 keys in 640-key tables), and each
    stream's own split (stream_split of its keys over the NS splits) cuts its keys finer than that; outputs
    match the reference and the fixed split's."""
    monkeypatch.setattr(attn_decode, "DECODE_PROGRAMS", programs)
    case = Shapes(lengths=(1, 3, 0, 1), context=(130, 70, 0, 400), HQ=4, HKV=2, HD=32, BS=16, num_blocks=160)
    for dtype in (torch.float32, torch.bfloat16):
        args = op_args("paged_attention", case, dtype, seed=7)
        ref = REGISTRY["paged_attention"].reference(*upcast(clone_args(args, "cpu")))
        test_args = clone_args(args, DEVICE)
        out = paged_attention.paged_attention_triton(*test_args, decode=True)
        q, _, _, k_cache, v_cache, cu, ctx, blocks = test_args
        fixed = attn_decode.paged_attention_decode(q, k_cache, v_cache, cu, ctx, blocks, torch.empty_like(q), split=64)
        assert_close("o (each stream's split)", ref, out.cpu(), TOL[dtype])
        assert_close("o (split 64)", ref, fixed.cpu(), TOL[dtype])
    SL = attn_decode.decode_split(4, 5, 2, 40 * 16)
    NS = -(-40 * 16 // SL)
    assert NS > 1 and SL > attn_decode.stream_split(131, NS) and SL > attn_decode.stream_split(73, NS)


def test_stream_split_fits_the_static_splits():
    """A stream's split never asks for more than the NS splits the static sizes allocate, nor is longer
    than the static split: for every context up to the table's keys."""
    for B, T, HKV, keys in [(1, 1, 2, 262144), (2, 2, 4, 4096), (32, 32, 4, 4096), (128, 128, 4, 2112), (3, 64, 1, 960)]:
        SL = attn_decode.decode_split(B, T, HKV, keys)
        NS = -(-keys // SL)
        for k in list(range(1, 300)) + list(range(keys - 300, keys + 1)):
            sl = attn_decode.stream_split(k, NS)
            assert sl % attn_decode.SPLIT_ALIGN == 0 and sl <= SL and -(-k // sl) <= NS
    # 2049 keys (2048 cached + 1) in 8 splits: 7 of 320 keys rather than 5 of 512 (the last with one key)
    assert attn_decode.stream_split(2049, 8) == 320 and attn_decode.stream_split(2049, 256) == 64


def test_decode_split_is_static_and_aligned():
    """Splits follow from (B, T, HKV, MB * BS) alone, are multiples of every key tile, and give
    about DECODE_PROGRAMS busy programs when contexts fill the block table."""
    for B, T, HKV, keys in [(2, 2, 4, 4096), (32, 32, 4, 4096), (1, 1, 1, 16), (64, 128, 8, 262144), (2, 64, 4, 0)]:
        SL = attn_decode.decode_split(B, T, HKV, keys)
        assert SL % attn_decode.SPLIT_ALIGN == 0 and SL >= attn_decode.SPLIT_ALIGN
        if keys >= SL * 2:
            busy = min(B, T) * HKV * -(-keys // SL)
            assert attn_decode.DECODE_PROGRAMS / 2 <= busy <= 2 * attn_decode.DECODE_PROGRAMS
    # 9B (HKV = 4), block tables of 4096 keys: D1 (bucket B = T = 2) 64 splits of 64 keys, D32 8 of 512
    assert attn_decode.decode_split(2, 2, 4, 4096) == 64
    assert attn_decode.decode_split(32, 32, 4, 4096) == 512
    assert [attn_decode.decode_queries(g) for g in (1, 2, 3, 4, 16, 24)] == [
        (16, 16), (8, 16), (5, 16), (4, 16), (1, 16), (1, 32)]


def test_decode_shaped_rule():
    assert decode_shaped(1, 1) and decode_shaped(2, 2) and decode_shaped(32, 32) and decode_shaped(2, 64)
    assert decode_shaped(64, 128) and decode_shaped(4, 0)
    assert not decode_shaped(2, 65) and not decode_shaped(32, 65) and not decode_shaped(64, 129)
    assert not decode_shaped(32, 256)


def _strided(t, transpose=None):
    """t's values in a view that is not contiguous: every stride doubled (the odd elements of a buffer twice
    the size, which must stay untouched), or with dims `transpose` swapped in memory."""
    if transpose is not None:
        return t.transpose(*transpose).contiguous().transpose(*transpose)
    view = torch.zeros(t.shape + (2,), dtype=t.dtype, device=t.device)[..., 0]
    view.copy_(t)
    return view


# (op, its CUDA path, case, positions of index tensors, {position of a pool: transposed dims or None})
STRIDED_CASES = [
    ("paged_attention", paged_attention.paged_attention_cuda, DECODE_ATTENTION_CASES[1], (5, 6, 7),
     {3: None, 4: (1, 2)}),
    ("paged_attention", paged_attention.paged_attention_cuda, Shapes(lengths=(70, 3), context=(5, 17), HQ=2, HKV=1),
     (5, 6, 7), {3: (1, 2), 4: None}),
    ("causal_conv1d", causal_conv1d.causal_conv1d_cuda, CASES[0], (2, 3), {4: None}),
    ("causal_conv1d", causal_conv1d.causal_conv1d_cuda, CASES[3], (2, 3), {4: (1, 2)}),
    ("gdn_recurrence", gdn_recurrence.gdn_recurrence_cuda, CASES[9], (5, 6), {7: None}),
    ("gdn_recurrence", gdn_recurrence.gdn_recurrence_cuda, SPLIT_CASES[1][0], (5, 6), {7: (2, 3)}),
    ("gdn_recurrence", gdn_recurrence.gdn_recurrence_cuda, SPLIT_CASES[5][0], (5, 6), {7: None}),
    ("gdn_recurrence", CHUNKED_PATHS["aligned"], SPLIT_CASES[1][0], (5, 6), {7: (2, 3)}),
]


@pytest.mark.parametrize("name,impl,case,index,pools", STRIDED_CASES,
                         ids=[f"{c[0]}-{c[2].id}" for c in STRIDED_CASES])
def test_strided_pools_and_index_tensors(name, impl, case, index, pools):
    """The schemas take pools and index tensors of any strides (the references index them as tensors): the
    CUDA paths read and write them through their strides, never past them (no contiguous layout assumed)."""
    args = list(op_args(name, case, torch.float32, seed=3))
    ref_args = clone_args(args, "cpu")
    ref = outputs(REGISTRY[name].reference(*ref_args))
    test_args = clone_args(args, DEVICE)
    for i in index:
        test_args[i] = _strided(test_args[i], (0, 1) if test_args[i].dim() == 2 else None)
    for i, transpose in pools.items():
        test_args[i] = _strided(test_args[i], transpose)
    out = outputs(impl(*test_args))
    assert len(out) == len(ref), f"{name}: {len(out)} outputs, the reference returns {len(ref)}"
    for i, (r, o) in enumerate(zip(ref, out)):
        assert_close(f"{name} output {i}", r, o.cpu(), TOL[torch.float32])
    for i, transpose in pools.items():
        assert_close(f"{name} pool {i}", ref_args[i], test_args[i].cpu(), TOL[torch.float32])
        if transpose is None:  # the elements between the view's stay zero
            assert not test_args[i].untyped_storage().nbytes() or torch.all(
                torch.as_strided(test_args[i], test_args[i].shape + (2,), test_args[i].stride() + (1,))[..., 1] == 0)


@pytest.mark.parametrize("W,dtype,pool", [(4, torch.bfloat16, "contiguous"), (4, torch.float32, "window outermost"),
                                          (3, torch.bfloat16, "window outermost"), (2, torch.float32, "contiguous"),
                                          (1, torch.bfloat16, "contiguous"), (5, torch.float32, "contiguous")])
def test_conv_decode_kernel_equals_the_two_kernel_path(W, dtype, pool, monkeypatch):
    """Decode-shaped calls of width up to DECODE_MAX_WIDTH take the one-launch conv (_conv1d_decode_kernel; W 5
    the two-kernel path): its outputs and new states equal the two-kernel path's bit for bit (the same fp32 taps in
    the same order) and the reference's, for streams of 0 to 6 tokens (shorter and longer than the window), slots
    in any order, zero-length streams on a live stream's slot (as the runner's padding streams may be), rows past
    cu_seqlens[-1] (zeroed by both, over memory that held other values), three channel tiles, the model's pool
    layout and one with its window dim outermost in memory, and every slot outside the batch untouched."""
    g = torch.Generator().manual_seed(W)
    C, S = 300, 7  # three channel tiles, the last partial
    for lengths, T in (((1, 1, 1, 1), 4), ((1, 0, 3, 1), 8), ((6, 2), 64), ((0, 0), 3), ((2,), 2), ((0, 5, 1), 6)):
        assert decode_shaped(len(lengths), T)
        cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
        slots = torch.randperm(S, generator=g)[:len(lengths)]
        live = [i for i, n in enumerate(lengths) if n]
        for i, n in enumerate(lengths):  # an empty stream shares a live stream's slot
            if not n and live:
                slots[i] = slots[live[0]]
        x = torch.randn(T, C, generator=g).to(dtype)
        w = torch.randn(C, W, generator=g).to(dtype)
        state = torch.randn(S, C, W - 1, generator=g).to(dtype)
        if pool != "contiguous":
            state = state.transpose(1, 2).contiguous().transpose(1, 2)
        results = []
        for decode in (True, False):
            monkeypatch.setattr(causal_conv1d, "decode_shaped", lambda B, T, decode=decode: decode)
            pool_ = state.clone(memory_format=torch.preserve_format).to(DEVICE)
            assert pool_.stride() == state.stride()
            torch.full((T * C + 64,), 7.0, dtype=dtype, device=DEVICE)  # freed: memory y may be given
            y = causal_conv1d.causal_conv1d_triton(x.to(DEVICE), w.to(DEVICE), cu.to(DEVICE), slots.to(DEVICE), pool_)
            results.append((y.cpu(), pool_.cpu()))
        (y, new_pool), (y2, new_pool2) = results
        assert torch.equal(y, y2) and torch.equal(new_pool, new_pool2), (lengths, T)
        assert torch.all(y[int(cu[-1]):] == 0)
        ref_pool = state.clone()
        ref = REGISTRY["causal_conv1d"].reference(x, w, cu, slots, ref_pool)
        n = int(cu[-1])
        assert_close(f"conv {lengths}", ref[:n].float(), y[:n].float(), TOL[dtype])
        assert_close(f"conv state {lengths}", ref_pool.float(), new_pool.float(), TOL[dtype])
        untouched = [s for s in range(S) if s not in slots[torch.tensor(lengths) > 0].tolist()]
        assert torch.equal(new_pool[untouched], state[untouched])


@pytest.mark.parametrize("name", ["gdn_proj", "attn_proj", "gdn_out", "mlp", "moe"])
def test_strided_vectors(name):
    """1-D parameters (norm weights, A_log, dt_bias, positions, inv_freq) of any stride, as the schemas take
    them: the row kernels read them through their strides (made contiguous), not as if they were."""
    args = op_args(name, CASES[4], torch.float32, seed=3)
    ref = outputs(REGISTRY[name].reference(*clone_args(args, "cpu")))
    test_args = [_strided(a) if isinstance(a, torch.Tensor) and a.dim() == 1 else a for a in clone_args(args, DEVICE)]
    assert any(isinstance(a, torch.Tensor) and not a.is_contiguous() for a in test_args)
    out = outputs(CUDA_IMPLS[name](*test_args))
    assert len(out) == len(ref), f"{name}: {len(out)} outputs, the reference returns {len(ref)}"
    for i, (r, o) in enumerate(zip(ref, out)):
        assert_close(f"{name} output {i}", r, o.cpu(), TOL[torch.float32])


# (op, position of its token-major input given column-major: dense, but not contiguous)
PERMUTED_INPUTS = [("mlp", 0), ("moe", 0), ("causal_conv1d", 0), ("gdn_out", 2), ("attn_out", 2), ("l2norm", 0)]


@pytest.mark.parametrize("name,pos", PERMUTED_INPUTS, ids=[n for n, _ in PERMUTED_INPUTS])
def test_fake_reference_and_cuda_strides_agree_on_permuted_inputs(name, pos):
    """A dense input laid out column-major (or heads-major) is legal: the fake, the CPU reference and the
    CUDA path all return contiguous outputs. (A fake that follows the input's layout while the CUDA path
    writes rows tells a compiled graph the wrong strides.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = clone_args(op_args(name, CASES[4], torch.float32, seed=3), DEVICE)
    args[pos] = _strided(args[pos], (0, 1))
    assert not args[pos].is_contiguous()
    mode = FakeTensorMode()
    with mode:
        fake = outputs(REGISTRY[name].op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]))
    ref = outputs(REGISTRY[name].reference(*clone_args(args, DEVICE)))
    cuda = outputs(CUDA_PATHS[name](*clone_args(args, DEVICE)))
    assert len(fake) == len(ref) == len(cuda), (name, len(fake), len(ref), len(cuda))
    for i, (f, r, c) in enumerate(zip(fake, ref, cuda)):
        assert f.shape == r.shape == c.shape and f.is_contiguous(), (i, f.shape, f.stride())
        assert f.stride() == r.stride() == c.stride(), (name, i, f.stride(), r.stride(), c.stride())


class _Launches:
    """Records each launch of the wrapped Triton kernel (its name and grid) and runs it."""

    def __init__(self, name, kernel, log):
        self.name, self.kernel, self.log = name, kernel, log

    def __getitem__(self, grid):
        self.log.append((self.name, tuple(grid)))
        return self.kernel[grid]


def _launch_log(monkeypatch):
    log = []
    for module, names in ((gdn_layout, ["_chunk_layout_kernel"]),
                          (gdn_chunked_launch, ["_gdn_chunk_intra_kernel", "_gdn_chunk_state_kernel"]),
                          (gdn_recurrent, ["_gdn_recurrent_kernel"]), (kv_write, ["_kv_write_kernel"]),
                          (attn_prefill, ["_paged_attention_kernel"]),
                          (attn_decode, ["_paged_decode_kernel", "_paged_decode_merge_kernel"])):
        for n in names:
            monkeypatch.setattr(module, n, _Launches(n, getattr(module, n), log))
    return log


# batches of one bucket: same (B, T) and pools, other lengths, contexts and slots
SAME_BUCKET = {
    "decode": [Shapes(lengths=(1, 1, 1, 1), context=(3, 40, 0, 70)),
               Shapes(lengths=(4, 0, 0, 0), context=(90, 0, 0, 0)),
               Shapes(lengths=(0, 2, 0, 2), context=(0, 1, 0, 57))],
    "prefill": [Shapes(lengths=(1, 63, 65), context=(0, 5, 0), num_blocks=36),
                Shapes(lengths=(129, 0, 0), context=(0, 0, 0), num_blocks=36),
                Shapes(lengths=(64, 64, 1), context=(30, 0, 9), num_blocks=36)],
}


@pytest.mark.parametrize("bucket", list(SAME_BUCKET))
def test_path_choice_depends_only_on_static_sizes(bucket, monkeypatch):
    """Within a bucket the same kernels launch with the same grids whatever the lengths, contexts
    and slots (what makes a captured graph exact for every batch of the bucket); decode-shaped
    buckets take the recurrent kernel and split-K, others the chunked kernels (layout, intra, state) then
    the recurrent kernel (short streams) and 64-row tiles (fp32 attention: the Triton kernel)."""
    log = _launch_log(monkeypatch)
    seen = []
    for case in SAME_BUCKET[bucket]:
        del log[:]
        for name, impl in (("gdn_recurrence", gdn_recurrence.gdn_recurrence_cuda),
                           ("paged_attention", paged_attention.paged_attention_cuda)):
            args = op_args(name, case, torch.float32, seed=7)
            ref_args = clone_args(args, "cpu")
            assert_close(name, REGISTRY[name].reference(*ref_args), impl(*args), TOL[torch.float32])
        seen.append(list(log))
    assert all(s == seen[0] for s in seen), seen
    names = [n for n, _ in seen[0]]
    if bucket == "decode":
        assert names == ["_gdn_recurrent_kernel", "_kv_write_kernel", "_paged_decode_kernel",
                         "_paged_decode_merge_kernel"]
    else:
        assert names == ["_chunk_layout_kernel", "_gdn_chunk_intra_kernel", "_gdn_chunk_state_kernel",
                         "_gdn_recurrent_kernel", "_kv_write_kernel", "_paged_attention_kernel"]


def test_stacked_is_a_view_of_adjacent_weights():
    buf = torch.randn(10, 4)
    a, b = buf[:3], buf[3:]
    assert kernels.stacked(a, b).data_ptr() == buf.data_ptr()
    c, d = torch.randn(3, 4), torch.randn(7, 4)
    assert torch.equal(kernels.stacked(c, d), torch.cat([c, d]))
    flat = torch.randn(40)  # adjacent in memory but separate tensors: no view across storages
    e, f = torch.randn(3, 4), flat[:28].view(7, 4)
    assert torch.equal(kernels.stacked(e, f), torch.cat([e, f]))


def test_side_by_side_is_a_view_only_within_one_buffer():
    """Column slices of one GEMM output come back as a view; separate tensors are concatenated, also
    when they sit back to back in memory (two storages over one numpy array: a view across them would
    reach outside the first one's storage, as the FP8 MLP's gate | up did at one row on the H200)."""
    y = torch.randn(3, 10)
    a, b = y[:, :4], y[:, 4:9]
    v = kernels.side_by_side(a, b)
    assert v.data_ptr() == y.data_ptr() and torch.equal(v, y[:, :9])
    c, d = torch.randn(3, 2), torch.randn(3, 5)
    assert torch.equal(kernels.side_by_side(c, d), torch.cat([c, d], dim=1))
    flat = np.random.rand(16).astype(np.float32)
    e, f = torch.from_numpy(flat[:8]).view(1, 8), torch.from_numpy(flat[8:]).view(1, 8)
    assert e.data_ptr() + 8 * 4 == f.data_ptr() and e.untyped_storage().nbytes() == 32
    out = kernels.side_by_side(e, f)
    assert out.data_ptr() != e.data_ptr() and torch.equal(out, torch.cat([e, f], dim=1))
    row = torch.randn(1, 6)  # one row: any stride
    assert kernels.side_by_side(row[:, :2], row[:, 2:]).data_ptr() == row.data_ptr()
    base = np.random.rand(16).astype(np.float32)  # two storages from one base pointer, the first the shorter
    short, long = torch.from_numpy(base[:8]).view(1, 8), torch.from_numpy(base).view(2, 8)
    assert short.untyped_storage().data_ptr() == long.untyped_storage().data_ptr()
    assert torch.equal(kernels.side_by_side(short, long[1:]), torch.cat([short, long[1:]], dim=1))
    assert torch.equal(kernels.stacked(short, long[1:]), torch.cat([short, long[1:]]))


def test_check_supported_rejects_only_fla_key_dims():
    """Odd head / rotary dims and ratios pass; a GDN key head dim above fla's 256 is named with its range."""
    check_supported(tiny_config(head_dim=48, partial_rotary_factor=0.25, num_key_value_heads=1,
                                linear_num_value_heads=6, linear_key_head_dim=256, linear_value_head_dim=40))
    with pytest.raises(ValueError, match=r"linear_key_head_dim 264 .* key head dims 1\.\.256"):
        check_supported(tiny_config(linear_key_head_dim=264))
    check_supported(tiny_config(linear_key_head_dim=264, layer_types=(FULL,) * 4))  # no GDN layer


# MoE: the expert alignment and the capture safety of the CUDA path ------------------------------
def _routings(T, k, E, g):
    """Routings of T tokens, k distinct experts each, over E experts: random, all tokens on the same
    k experts (groups of T pairs), and tokens spread round-robin."""
    yield (torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T
           else torch.zeros(0, k, dtype=torch.long))
    yield torch.arange(E - k, E).flip(0).repeat(T, 1)
    yield (torch.arange(T)[:, None] * k + torch.arange(k)[None, :]) % E


@pytest.mark.parametrize("align", ["triton", "count", "torch"])
@pytest.mark.parametrize("T,k,E,BM", [(0, 2, 4, 16), (1, 1, 1, 16), (1, 8, 16, 16), (3, 4, 16, 16), (150, 2, 4, 16),
                                      (37, 3, 5, 16), (64, 6, 6, 32), (200, 8, 64, 16)])
def test_moe_alignment(align, T, k, E, BM, monkeypatch):
    """Every (token, expert) pair appears exactly once, grouped by expert in ascending order, each group
    starting at a multiple of BM on a block of its expert; padding rows hold the sentinel P; blocks past the
    last group have expert -1 and only sentinels; the buffer sizes depend on (T, k, E, BM) alone. "triton"
    and "count": align_pairs with torch.sort (COUNT_SORT_MAX_PAIRS lowered to 0, the path of more pairs) and
    with the counting sort."""
    if align == "count" and T * k > 1000:
        pytest.skip("the interpreter walks the counting sort's P^2 / 64 loop slowly (13 s here); the sort is "
                    "checked up to 700 pairs by test_count_sort_is_the_stable_sort, in align_pairs up to 400 by "
                    "test_moe_alignment_matches_torch_oracle")
    if align != "count":
        monkeypatch.setattr(moe_align, "COUNT_SORT_MAX_PAIRS", 0)
    fn = align_pairs_torch if align == "torch" else moe_align.align_pairs
    P, sizes = T * k, set()
    for top_e in _routings(T, k, E, torch.Generator().manual_seed(T + k + E)):
        ids, block_expert = fn(top_e, E, BM)
        sizes.add((ids.shape, block_expert.shape, ids.dtype, block_expert.dtype))
        assert ids.shape == (block_expert.shape[0] * BM,)
        assert block_expert.shape[0] == moe_align.align_size(P, E, BM)
        row_expert = block_expert.long().repeat_interleave(BM)
        real = ids < P
        assert torch.equal(torch.sort(ids[real]).values, torch.arange(P, dtype=torch.int32))  # each pair once
        assert (ids[~real] == P).all() and (ids >= 0).all()
        flat = top_e.reshape(-1)
        assert torch.equal(row_expert[real], flat[ids[real].long()])  # each pair on a block of its expert
        assert (row_expert[real] >= 0).all()
        groups = row_expert[real]
        assert torch.equal(groups, torch.sort(groups).values)  # grouped by expert, ascending
        for e in groups.unique().tolist():
            rows = torch.where(real & (row_expert == e))[0]
            n = rows.numel()
            # contiguous, from the first row of the expert's first block, in pair order
            assert rows[0] % BM == 0 and torch.equal(rows, torch.arange(rows[0], rows[0] + n))
            assert torch.equal(ids[rows], torch.sort(ids[rows]).values)
            last_block = (rows[0] + n - 1) // BM
            assert (block_expert[rows[0] // BM:last_block + 1] == e).all()
            assert (ids[rows[0] + n:(last_block + 1) * BM] == P).all()  # padding after the group
        used = block_expert >= 0
        assert int(used.sum()) == sum(-(-int((flat == e).sum()) // BM) for e in range(E))  # no empty blocks
        assert torch.equal(used, torch.arange(used.numel()) < int(used.sum()))  # blocks past the end: -1
    assert len(sizes) <= 1


@pytest.mark.parametrize("sort", ["count", "torch"])
def test_moe_alignment_matches_torch_oracle(sort, monkeypatch):
    """align_pairs against the torch oracle with each sort ("torch": COUNT_SORT_MAX_PAIRS lowered to 0), with and
    without padding rows (id -1: their pairs in no block), and a rank's align_local_pairs alike under both."""
    if sort == "torch":
        monkeypatch.setattr(moe_align, "COUNT_SORT_MAX_PAIRS", 0)
    g = torch.Generator().manual_seed(5)
    for T, k, E, BM in ((1, 8, 256, 16), (150, 2, 4, 16), (100, 4, 33, 32), (257, 1, 3, 64)):
        for top_e in _routings(T, k, E, g):
            a, b = moe_align.align_pairs(top_e, E, BM), align_pairs_torch(top_e, E, BM)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            top_e = top_e.clone()
            top_e[T // 2:] = -1  # padding rows (routing.py marks them -1): in no block
            a, b = moe_align.align_pairs(top_e, E, BM), align_pairs_torch(top_e, E, BM)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            assert not torch.isin(a[0], torch.arange(T // 2 * k, T * k)).any()
    top_e = torch.randint(0, 12, (40, 3), generator=g)  # a tensor-parallel rank's experts 4..7 of 12
    local = moe_align.align_local_pairs(top_e, 4, 12, 4, 16)
    monkeypatch.setattr(moe_align, "COUNT_SORT_MAX_PAIRS", 0 if sort == "count" else 4096)
    assert all(torch.equal(x, y) for x, y in zip(local, moe_align.align_local_pairs(top_e, 4, 12, 4, 16)))


def test_count_sort_is_the_stable_sort(monkeypatch):
    """The counting sort (sort_experts up to COUNT_SORT_MAX_PAIRS pairs) gives torch.sort(stable=True)'s values
    and indices: ragged pair counts around its 64-pair programs, many ties, one expert, ids up to E (a rank's
    other-experts group); above COUNT_SORT_MAX_PAIRS it is torch.sort (int64 indices)."""
    g = torch.Generator().manual_seed(3)
    for P, E in ((1, 4), (5, 1), (63, 3), (64, 64), (65, 2), (130, 256), (700, 9)):
        e = torch.randint(0, E + 1, (P,), generator=g, dtype=torch.int32)
        values, order = moe_align.sort_experts(e)
        ref = torch.sort(e, stable=True)
        assert order.dtype == torch.int32 and torch.equal(values, ref.values)
        assert torch.equal(order.long(), ref.indices), (P, E)
    monkeypatch.setattr(moe_align, "COUNT_SORT_MAX_PAIRS", 8)
    assert moe_align.sort_experts(torch.arange(8, dtype=torch.int32).flip(0))[1].dtype == torch.int32
    values, order = moe_align.sort_experts(torch.arange(9, dtype=torch.int32).flip(0))
    assert order.dtype == torch.int64 and torch.equal(order, torch.arange(9).flip(0))


@pytest.mark.gpu
def test_count_sort_and_alignment_on_cuda():
    """On CUDA tensors (the kernel compiled, not interpreted): the counting sort gives torch.sort(stable=True)'s
    values and indices up to COUNT_SORT_MAX_PAIRS pairs (the 35B-A3B's D1 and D32, 4096 pairs of 256 experts and
    of one, ragged counts), torch.sort's above; align_pairs with it equals the torch oracle at decode and prefill
    routings, and replayed from a CUDA graph on another routing."""
    g = torch.Generator(device="cuda").manual_seed(11)
    for P, E in ((8, 256), (63, 3), (256, 256), (1000, 9), (4096, 256), (4096, 1), (4097, 256)):
        e = torch.randint(0, E + 1, (P,), generator=g, device="cuda", dtype=torch.int32)
        values, order = moe_align.sort_experts(e)
        ref = torch.sort(e, stable=True)
        assert order.dtype == (torch.int32 if P <= moe_align.COUNT_SORT_MAX_PAIRS else torch.int64), P
        assert torch.equal(values, ref.values) and torch.equal(order.long(), ref.indices), (P, E)
    for T, k, E, BM in ((1, 8, 256, 16), (32, 8, 256, 16), (500, 8, 256, 32), (150, 2, 4, 64)):
        for top_e in _routings(T, k, E, torch.Generator().manual_seed(T + E)):
            top_e = top_e.cuda()
            a, b = moe_align.align_pairs(top_e, E, BM), align_pairs_torch(top_e, E, BM)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (T, k, E)
    top_e = torch.randint(0, 256, (32, 8), device="cuda", generator=g)
    moe_align.align_pairs(top_e, 256, 16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = moe_align.align_pairs(top_e, 256, 16)
    top_e.copy_(torch.randint(0, 256, (32, 8), device="cuda", generator=g))
    graph.replay()
    ref = align_pairs_torch(top_e, 256, 16)
    assert torch.equal(static[0], ref[0]) and torch.equal(static[1], ref[1])


def test_moe_block_rows_follow_the_shapes():
    """The worst case fits: rows = P + min(E, P) * (BM - 1), in whole blocks; BM is a function of shapes."""
    for P, E in ((0, 4), (1, 1), (8, 256), (300, 4), (131072, 256)):
        BM = moe_align.block_m(P, E)
        assert BM in (16, 32, 64, 128)
        assert moe_align.align_size(P, E, BM) * BM <= P + min(E, P) * (BM - 1) < (moe_align.align_size(P, E, BM) + 1) * BM


@pytest.mark.parametrize("T, E, k, norm, dtype", [(0, 8, 2, True, torch.float32), (1, 1, 1, False, torch.float32),
                                                    (9, 6, 3, False, torch.float32), (5, 5, 5, True, torch.float32),
                                                    (64, 256, 8, True, torch.bfloat16),
                                                    (32, 512, 10, True, torch.bfloat16)])
def test_moe_route_topk_matches_select_experts(T, E, k, norm, dtype):
    """The fused router kernel against softmax / topk / renormalize in torch, on strided logits: the same
    experts (a set can differ only where the k-th and (k+1)-th probabilities tie exactly, when either
    expert is right), each expert's weight within an ulp (fp32: the exp and the sums round differently),
    int64 ids."""
    g = torch.Generator().manual_seed(E + k)
    logits = torch.randn(T, E + 5, generator=g).to(dtype)[:, 2:2 + E]
    w, e = moe_routing.route_topk(logits.to(DEVICE), k, norm)
    ref_w, ref_e = moe_reference.select_experts(logits, k, norm)
    assert e.dtype == torch.int64 and w.dtype == dtype and w.shape == e.shape == (T, k)
    probs = torch.softmax(logits, -1, dtype=torch.float32).sort(-1, descending=True).values
    for t in range(T):
        if k < E and probs[t, k - 1] == probs[t, k]:
            continue  # an exact tie at the boundary
        assert sorted(e[t].tolist()) == sorted(ref_e[t].tolist())
        mine, ref = dict(zip(e[t].tolist(), w[t].tolist())), dict(zip(ref_e[t].tolist(), ref_w[t].tolist()))
        ulp = 2e-6 if dtype == torch.float32 else 8e-3
        assert all(abs(mine[x] - ref[x]) <= ulp * abs(ref[x]) for x in ref), (mine, ref)


def test_moe_route_topk_keeps_ids_in_range_on_nan():
    """A padding row's activations are unspecified and may be NaN: its k ids are still distinct experts."""
    logits = torch.randn(3, 16)
    logits[1] = float("nan")
    logits[2, 3] = float("nan")
    _, e = moe_routing.route_topk(logits.to(DEVICE), 4, True)
    for row in e.cpu().tolist():
        assert len(set(row)) == 4 and all(0 <= x < 16 for x in row), row


def test_moe_route_topk_marks_padding_rows():
    """With the batch's cu_seqlens the rows at and past cu_seqlens[-1] (padding tokens) take expert id -1 and the
    others the ids and weights they take without it; a strided cu_seqlens is read by its values (its last one)."""
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    w, e = moe_routing.route_topk(logits, 4, True)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=DEVICE)
    w2, e2 = moe_routing.route_topk(logits, 4, True, cu)
    assert torch.equal(e2[:3], e[:3]) and torch.equal(w2[:3], w[:3]) and (e2[3:] == -1).all()
    strided = torch.tensor([0, 9, 1, 9, 3, 9], dtype=torch.int32, device=DEVICE)[::2]  # the same offsets, stride 2
    assert torch.equal(moe_routing.route_topk(logits, 4, True, strided)[1], e2)


def test_moe_skewed_routing_matches_reference():
    """Every token routed to the same experts (one group of T pairs per chosen expert, many blocks each)."""
    case = CASES[0]
    args = list(op_args("moe", case, torch.float32, seed=4))
    args[0] = args[0][:1].repeat(case.T, 1) + 1e-3 * args[0]  # near-identical tokens: near-identical routing
    ref = REGISTRY["moe"].op(*clone_args(args, "cpu"))
    out = moe.moe_cuda(*clone_args(args, DEVICE))
    a = declaration(REGISTRY["moe"].op).Args(*args)
    top_e = moe_reference.route(rms_norm(a.h, a.norm_w, a.eps), a.router_w, a.top_k, True)[1]
    assert top_e.unique().numel() <= 3  # the routing is skewed indeed
    assert_close("moe (skewed routing)", ref, out.cpu(), TOL[torch.float32])


class _NoHostSync(torch.utils._python_dispatch.TorchDispatchMode):
    """Raises on ops that sync with the host or size their output from data (on a GPU they break CUDA
    graph capture): reading a scalar, nonzero, unique, bincount, masked_select, boolean indexing."""
    FORBIDDEN = ("_local_scalar_dense", "nonzero", "bincount", "_unique", "unique_dim", "unique_consecutive",
                 "masked_select", "repeat_interleave", "item", "_assert_async", "equal")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in self.FORBIDDEN:
            raise AssertionError(f"host sync / data-dependent shape: {func}")
        if name.startswith("index") and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                            for a in args if isinstance(a, (list, tuple)) for i in a):
            raise AssertionError(f"boolean indexing: {func}")
        return func(*args, **(kwargs or {}))


def _forbid_python_syncs(monkeypatch):
    """The Python-level escapes to the host (a tensor's value read into Python, data-sized results) raise."""
    def forbidden(name):
        def raise_(*args, **kwargs):
            raise AssertionError(f"host sync: {name}")
        return raise_
    for name in ("item", "tolist", "numpy", "nonzero", "unique", "__bool__", "__int__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden(f"Tensor.{name}"))
    for name in ("bincount", "nonzero", "unique", "masked_select", "argwhere"):
        monkeypatch.setattr(torch, name, forbidden(f"torch.{name}"))


# CPU tensors through the interpreter: on a GPU machine (no interpreter) the kernels cannot take them, and there the
# CUDA-graph captures (tests/test_gpu_capture.py, test_gpu_moe.py) refuse any sync instead
NEEDS_INTERPRETER = pytest.mark.skipif(DEVICE == "cuda", reason="CPU tensors through Triton's interpreter; on a GPU "
                                       "the graph-capture tests check the same")


@NEEDS_INTERPRETER
@pytest.mark.parametrize("case", [c for c in CASES if c.T in (0, 1, 45, 150)], ids=lambda c: c.id)
def test_moe_cuda_path_never_syncs(case, monkeypatch):
    """The CUDA path (on CPU tensors, its Triton kernels in the interpreter) calls no op that syncs with
    the host or has a data-dependent output shape; the Python-level escapes raise too."""
    _forbid_python_syncs(monkeypatch)
    args = op_args("moe", case, torch.bfloat16, seed=2)
    with _NoHostSync():
        moe.moe_cuda(*args)


def _local_experts(args: list, first: int, count: int) -> list:
    """The moe op's arguments for the rank holding experts first .. first + count - 1 (tensor parallelism)."""
    a = declaration(REGISTRY["moe"].op).Args(*args)
    args = list(args)
    args[3], args[5] = a.w13[first:first + count], a.w2[first:first + count]
    return args + [first]


@pytest.mark.parametrize("case", [c for c in CASES if c.E > 2 and c.T < 128], ids=lambda c: c.id)
def test_moe_cuda_path_matches_reference_for_a_ranks_experts(case):
    """The CUDA path's experts (our grouped GEMMs) against the op's reference, all experts and a rank's slice of
    them (the other ranks' pairs 0), fp32."""
    args = list(op_args("moe", case, torch.float32, seed=3))
    first, count = 1, case.E - 2
    for call, experts in ((args, case.E), (_local_experts(args, first, count), count)):
        ref = REGISTRY["moe"].op(*clone_args(call, "cpu"))
        out = moe.moe_cuda(*clone_args(call, DEVICE))
        assert_close(f"moe ({experts} local experts)", ref, out.cpu(), TOL[torch.float32])


@NEEDS_INTERPRETER
@pytest.mark.parametrize("chunked", ["ours", "aligned"])
@pytest.mark.parametrize("case", [c for c, _ in SPLIT_CASES[:2]], ids=lambda c: c.id)
def test_recurrence_split_path_never_syncs(case, chunked, monkeypatch):
    """The recurrence's split path likewise: our chunked kernels and the recurrent kernel in the interpreter,
    or the aligned layout (state gather / scatter) with a stand-in of fla's shapes in place of the reference,
    which reads lengths on the host."""
    def varlen_shapes(q, k, v, g, beta, cu_aligned, chunk_indices, h0):
        return torch.zeros_like(v), h0.clone()

    _forbid_python_syncs(monkeypatch)
    args = op_args("gdn_recurrence", case, torch.bfloat16, seed=2)
    with _NoHostSync():
        gdn_split.gdn_recurrence_split(*args, *([varlen_shapes] if chunked == "aligned" else []))


_SM90_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from metrale_graph.ops import kernels as rows
from metrale_graph.ops import checkpoints
from metrale_graph.ops.gdn_recurrence import layout, recurrent
from metrale_graph.ops.moe import align, combine, gemm, routing
from metrale_graph.ops.paged_attention import decode, prefill
target = GPUTarget("cuda", 90, 32)
backend = triton.compiler.make_backend(target)

def compile_(fn, types, consts, warps, stages):
    sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
    src = triton.compiler.ASTSource(fn=fn, constexprs=consts, signature=sig)
    opts = backend.parse_options({"num_warps": warps, "num_stages": stages})
    return triton.compile(src, target=target, options=opts.__dict__).metadata.shared

P, I = "*bf16", "*i32"
gu = dict(x_ptr=P, w_ptr=P, act_ptr=P, ids_ptr=I, expert_ptr=I, num_pairs="i32", num_blocks="i32", N="i32", K="i32",
          stride_x="i32", stride_we="i32", stride_wn="i32")
dn = dict(act_ptr=P, w_ptr=P, y_ptr=P, ids_ptr=I, expert_ptr=I, rw_ptr=P, num_pairs="i32", num_blocks="i32", N="i32",
          K="i32", stride_we="i32", stride_wn="i32")
smem = []
for fn, types, extra, cfg in ((gemm._moe_gate_up_kernel.fn.fn, gu, dict(TOP_K=8), gemm._gemm_configs(2)[1]),
                              (gemm._moe_down_kernel.fn.fn, dn, {}, gemm._gemm_configs(1)[1])):
    for even_k in (True, False):
        smem.append(compile_(fn, types, dict(BM=64, EVEN_K=even_k, IEEE=False, **extra, **cfg.kwargs), 4, 4))
# fp32 (IEEE dots) has one autotune candidate (gemm.FP32_CONFIG): it must compile at every block size
F = "*fp32"
for fn, types, extra in ((gemm._moe_gate_up_kernel.fn.fn, gu, dict(TOP_K=8)), (gemm._moe_down_kernel.fn.fn, dn, {})):
    types = {n: F if t == P else t for n, t in types.items()}
    for BM in (16, 32, 64, 128):
        for even_k in (True, False):
            smem.append(compile_(fn, types, dict(BM=BM, EVEN_K=even_k, IEEE=True, **extra, **gemm.FP32_CONFIG.kwargs),
                                 gemm.FP32_CONFIG.num_warps, gemm.FP32_CONFIG.num_stages))
smem.append(compile_(combine._moe_combine_kernel, dict(h_ptr=P, n_ptr=P, seg_w_ptr=P, y_ptr=P, shared_ptr=P, out_ptr=P,
                     D="i32", stride_h="i32"), dict(TOP_K=8, BLOCK=2048, ADD_RESIDUAL=True), 8, 1))
smem.append(compile_(align._moe_align_groups_kernel, dict(experts_ptr=I, first_ptr=I, start_ptr=I, P="i32", E="i32",
                     steps="i32"), dict(BM=64, BLOCK_E=512), 4, 1))
for order in ("*i64", I):  # torch.sort's order (above COUNT_SORT_MAX_PAIRS), the counting sort's
    smem.append(compile_(align._moe_align_rows_kernel, dict(order_ptr=order, first_ptr=I, start_ptr=I, ids_ptr=I,
                         block_expert_ptr=I, P="i32", E="i32"), dict(BM=64, BLOCK_E=512), 4, 1))
smem.append(compile_(align._moe_count_sort_kernel, dict(e_ptr=I, experts_ptr=I, order_ptr=I, P="i32"),
                     dict(BLOCK=align.COUNT_BLOCK), 4, 3))
B16, F32 = "*bf16", "*fp32"
rec = dict(q_ptr=B16, k_ptr=B16, v_ptr=B16, g_ptr=F32, beta_ptr=B16, o_ptr=B16, state_ptr=F32, cu_ptr=I,
           slot_ptr="*i64", ck_map_ptr="*i64", ck_ptr=F32, scale="fp32")
fn = recurrent._gdn_recurrent_kernel
for K in (128, 256):
    for pairs in (1, recurrent.WIDE_PROGRAMS):  # both tiles
        BK, BV, warps = recurrent.recurrent_tiles(K, 128, pairs)
        for ck in (False, True):  # with prefix-caching checkpoints or without
            smem.append(compile_(fn, {n: rec.get(n, "i32") for n in fn.arg_names}, dict(BK=BK, BV=BV, CK=ck), warps,
                                 3))
for E, k in ((256, 8), (512, 10)):
    for padding in (False, True):
        smem.append(compile_(routing._moe_route_kernel, dict(logits_ptr=P, w_ptr=P, e_ptr="*i64", cu_ptr=I,
                                                             stride_l="i32", E="i32", LAST="i32"),
                             dict(TOP_K=k, BLOCK_K=16 if k > 8 else 8, BLOCK_E=E, NORM=True, PADDING=padding), 4, 1))
from metrale_graph.ops import causal_conv1d as conv
from metrale_graph.ops.paged_attention import kv_write
for steps in (1, 9):  # (tiles._stream_of's search, unrolled)
    smem.append(compile_(conv._conv1d_kernel, dict(x_ptr=B16, w_ptr=B16, y_ptr=B16, state_ptr=B16, cu_ptr=I,
                         slot_ptr="*i64", T="i32", C="i32", B="i32", stride_x="i32", stride_s0="i32", stride_s1="i32",
                         stride_s2="i32"), dict(W=4, BT=32, BC=128, STEPS=steps), 4, 1))
    smem.append(compile_(kv_write._kv_write_kernel, dict(k_ptr=B16, v_ptr=B16, k_cache=B16, v_cache=B16, cu_ptr=I,
                         ctx_ptr=I, bt_ptr=I, B="i32", BS="i32", N="i32", HD="i32", **{f"stride_{n}": "i32" for n in (
                             "kt", "vt", "kb", "ks", "kh", "kd", "vb", "vs", "vh", "vd", "bt")}),
                         dict(BLOCK=1024, STEPS=steps), 4, 1))
for W in range(1, conv.DECODE_MAX_WIDTH + 1):  # the decode-shaped conv (one launch: taps, new state, zeroed rows)
    smem.append(compile_(conv._conv1d_decode_kernel, dict(x_ptr=B16, w_ptr=B16, y_ptr=B16, state_ptr=B16, cu_ptr=I,
                         slot_ptr="*i64", T="i32", C="i32", B="i32", stride_x="i32", stride_s0="i32", stride_s1="i32",
                         stride_s2="i32"), dict(W=W, BC=128), 4, 3))
smem.append(compile_(rows._attn_heads_kernel, dict(qg_ptr=B16, k_ptr=B16, v_ptr=B16, qw_ptr=B16, kw_ptr=B16, pos_ptr="*i64",
                     inv_freq_ptr=F32, q_ptr=B16, ko_ptr=B16, vo_ptr=B16, gate_ptr=B16, HQ="i32", HKV="i32", HD="i32",
                     HALF="i32", stride_qg_t="i32", stride_qg_h="i32", stride_k_t="i32", stride_v_t="i32", eps="fp32",
                     scale="fp32"),
                     dict(BLOCK=256), 4, 1))
smem.append(compile_(rows._gdn_gates_split_kernel, dict(src_ptr=B16, gates_ptr=B16, qkv_ptr=B16, z_ptr=B16, A_ptr=B16,
                     dt_ptr=B16, beta_ptr=B16, g_ptr=F32, stride_src="i32", stride_gates="i32", b_off="i32",
                     a_off="i32", C="i32", Z="i32", HV="i32"), dict(BLOCK=1024, BLOCK_H=32), 4, 1))
for compact in (False, True):  # the layout kernel's two forms (chunk_layout_bounds, chunk_layout_compact)
    smem.append(compile_(layout._chunk_layout_kernel, dict(cu_ptr=I, slot_ptr="*i64" if compact else I, cu_al_ptr="*i64",
                         bounds_ptr="*i64", slots_out_ptr="*i64", idx_ptr="*i64", B="i32", M="i32", NT="i32",
                         short="i32"), dict(CHUNK=64, BLOCK_B=64, BLOCK_M=16 if compact else 1, BLOCK_C=64,
                                            COMPACT=compact), 4, 1))
# the checkpoint kernels of the conv and GDN ops (prefix caching, speculation's verify states)
for x in (B16, F32):
    smem.append(compile_(checkpoints._keep_windows_kernel, dict(
        x_ptr=x, cu_ptr=I, slot_ptr="*i64", state_ptr=x, tok_ptr="*i64", ent_ptr="*i64", pool_ptr=x, B="i32", C="i32",
        stride_xt="i32", stride_xc="i32", stride_s0="i32", stride_s1="i32", stride_s2="i32", stride_p0="i32",
        stride_p1="i32", stride_p2="i32"), dict(W1=3, BW=4, STEPS=7, BC=256), 4, 1))
    smem.append(compile_(checkpoints._copy_rows_kernel, dict(src_ptr=x, dst_ptr=x, index_ptr="*i64", n="i32", N="i32",
                         skip="i32", stride_src="i32", stride_dst="i32"), dict(BLOCK=4096), 4, 1))
smem.append(compile_(checkpoints._keep_end_states_kernel, dict(
    state_ptr=F32, cu_ptr=I, slot_ptr="*i64", tok_ptr="*i64", ent_ptr="*i64", pool_ptr=F32, B="i32", N="i32",
    longer_than="i32", stride_s0="i32", stride_p0="i32"), dict(STEPS=7, BLOCK=4096), 4, 1))
smem.append(compile_(checkpoints._token_entries_kernel, dict(tok_ptr="*i64", ent_ptr="*i64", out_ptr="*i64", T="i32",
                     NC="i32"), dict(BLOCK=1024), 4, 1))
for to_aligned in (True, False):
    for x in (B16, F32):
        smem.append(compile_(layout._aligned_copy_kernel, dict(x_ptr=x, out_ptr=x, cu_ptr=I, idx_ptr="*i64", B="i32",
                             short="i32", stride_x="i32", W="i32"), dict(TO_ALIGNED=to_aligned, CHUNK=64,
                             BLOCK_W=128), 4, 1))
# the attention kernels share _attend_tile (the decode kernel with EMPTY_ROWS)
pa = prefill._paged_attention_kernel.fn
types = {n: B16 if n in ("q_ptr", "k_cache", "v_cache", "o_ptr") else I if n.endswith("_ptr") else "i32"
         for n in pa.arg_names}
types["qk_scale"] = "fp32"
smem.append(compile_(pa, types, dict(BLOCK_D=256, BM=prefill.BM, BN=32, IEEE=False), 4, 2))
pd = decode._paged_decode_kernel.fn
types = {n: B16 if n in ("q_ptr", "k_cache", "v_cache") else F32 if n in ("m_ptr", "l_ptr", "acc_ptr")
         else I if n.endswith("_ptr") else "i32" for n in pd.arg_names}
types["qk_scale"] = "fp32"
for dynamic in (True, False):  # each stream's split, or a fixed one
    smem.append(compile_(pd, types, dict(BLOCK_D=256, BLOCK_M=16, BN=32, CH=decode.STREAM_CHUNK, IEEE=False,
                                         DYNAMIC=dynamic), 4, 2))
    pm = decode._paged_decode_merge_kernel
    types_m = {n: B16 if n == "o_ptr" else F32 if n.endswith("_ptr") and n[0] in "mla" else I if n.endswith("_ptr")
               else "i32" for n in pm.arg_names}
    smem.append(compile_(pm, types_m, dict(BLOCK_D=256, SC=decode.MERGE_SPLITS, STEPS=7, DYNAMIC=dynamic), 4, 1))
# fp32 (IEEE dots) has one autotune candidate (attend.one_config_for_fp32): it must compile at head dim 256
from metrale_graph.ops import attend
fp32 = attend.one_config_for_fp32(attend.attention_configs(), {}, IEEE=True)[0]  # (no interpreter here: all twelve)
types = {n: F32 if n in ("q_ptr", "k_cache", "v_cache", "o_ptr") else I if n.endswith("_ptr") else "i32"
         for n in pa.arg_names}
types["qk_scale"] = "fp32"
smem.append(compile_(pa, types, dict(BLOCK_D=256, BM=prefill.BM, BN=fp32.kwargs["BN"], IEEE=True), fp32.num_warps,
                     fp32.num_stages))
types = {n: F32 if n in ("q_ptr", "k_cache", "v_cache", "m_ptr", "l_ptr", "acc_ptr") else I if n.endswith("_ptr")
         else "i32" for n in pd.arg_names}
types["qk_scale"] = "fp32"
smem.append(compile_(pd, types, dict(BLOCK_D=256, BLOCK_M=16, BN=fp32.kwargs["BN"], CH=decode.STREAM_CHUNK, IEEE=True,
                                     DYNAMIC=True), fp32.num_warps, fp32.num_stages))
assert max(smem) <= 232448, smem  # an H100 / H200 block's shared memory
print("compiled", smem)
"""


def test_kernels_compile_for_sm90():
    """The MoE Triton kernels (the opt-in counting sort included), the GDN recurrent, layout, checkpoint and gates
    kernels and the attention kernels through Triton's real compiler for sm_90 (PTX and ptxas, no GPU needed): the
    interpreter runs Python and accepts what the compiler rejects (non-constexpr globals, types). A
    subprocess: the interpreter is on in this one."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


def test_moe_autotune_takes_one_config_for_fp32():
    """The routed experts' grouped GEMMs keep one candidate for fp32's IEEE dots (gemm.FP32_CONFIG), the
    pruned candidates for bf16 / fp16: autotuning every candidate in fp32 took 17-45 s per new prefill shape
    on an H200, with nothing printed."""
    from metrale_graph.ops.moe import gemm

    for kernel, acc_tiles in ((gemm._moe_gate_up_kernel, 2), (gemm._moe_down_kernel, 1)):
        configs = gemm._gemm_configs(acc_tiles)
        assert kernel.early_config_prune(configs, {"N": 512, "K": 2048}, BM=64, IEEE=True) == [gemm.FP32_CONFIG]
        kept = kernel.early_config_prune(configs, {"N": 512, "K": 2048}, BM=64, IEEE=False)
        assert kept == [c for c in configs if acc_tiles * 64 * c.kwargs["BN"] <= 128 * 128] and kept


def test_attention_autotune_takes_one_config_for_fp32():
    """The paged-attention kernels' autotuner keeps one candidate (the smallest in shared memory) for fp32's
    IEEE dots, all twelve for bf16 / fp16: fp32 is the tests' dtype, and compiling every candidate for it at
    the first call is the likely reason fp32 GPU tests were still compiling after 290 s on an H200."""
    import triton

    from metrale_graph.ops import attend

    configs = [triton.Config({"BN": bn}, num_warps=w, num_stages=st) for bn in (64, 32) for w in (8, 4)
               for st in (3, 2, 1)]
    (one,) = attend.one_config_for_fp32(configs, {}, IEEE=True)
    assert (one.kwargs["BN"], one.num_warps, one.num_stages) == (32, 8, 1)
    assert attend.one_config_for_fp32(configs, {}, IEEE=False) == configs
    for kernel in (attn_prefill._paged_attention_kernel, attn_decode._paged_decode_kernel):
        assert kernel.early_config_prune is attend.one_config_for_fp32


@triton.jit
def _stream_lookup(cu_ptr, out_ptr, scalar_ptr, T, B, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    """tiles._stream_of of tokens 0 .. T - 1 (a vector), and of T - 1 alone (a scalar, as the KV write's program id)."""
    t = tl.arange(0, BLOCK)
    tl.store(out_ptr + t, _stream_of(cu_ptr, t, B, STEPS), mask=t < T)
    tl.store(scalar_ptr, _stream_of(cu_ptr, T - 1, B, STEPS))


def test_stream_of_is_searchsorted_of_the_stream_ends():
    """tiles._stream_of (the conv and KV-write kernels' in-kernel stream lookup) equals searchsorted(cu[1:], t,
    right=True) for every token of batches with zero-length streams (at the start, in the middle, at the end), one
    stream, and padding tokens past cu[-1] (stream B: none), vector and scalar t, at search_steps(B) steps."""
    import itertools

    for lengths, pad in (([3], 0), ([0, 2, 0, 0, 5, 1, 0], 3), ([1] * 9, 2), ([4, 0], 1), ([0, 0, 1], 0),
                         ([2, 3, 1, 7, 2, 2, 1, 1, 4, 3, 2, 1, 1, 5, 6, 1, 2], 4)):
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEVICE)
        B, T = len(lengths), int(cu[-1]) + pad
        out = torch.full((T,), -1, dtype=torch.int32, device=DEVICE)
        scalar = torch.full((1,), -1, dtype=torch.int32, device=DEVICE)
        _stream_lookup[(1,)](cu, out, scalar, T, B, STEPS=search_steps(B), BLOCK=triton.next_power_of_2(T))
        want = torch.searchsorted(cu[1:], torch.arange(T, dtype=torch.int32, device=DEVICE), right=True)
        assert out.tolist() == want.tolist(), lengths
        assert scalar.item() == want[-1].item(), lengths

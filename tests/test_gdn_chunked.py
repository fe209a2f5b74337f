"""ops/gdn_chunked/ (our chunked gated delta rule) against the plain token-by-token fp32 reference.

The kernels run on the GPU where there is one, else in Triton's interpreter (conftest.py), whose dots
are fp32: fp32 inputs must match to 1e-4 and bf16 inputs to 1e-2 (relative norm error). Streams are
laid out as the op's chunk-aligned layout lays them (each stream at a multiple of 64, identity tokens
in the gaps, an absorber sequence of identity chunks at the end), built here in plain torch. The
tests marked gpu compare with flash-linear-attention at the Qwen3.5-9B head shape and replay a CUDA graph.
"""

import pytest
import torch
from metrics import assert_close, round_bf16_to_nearest

from metrale_graph.ops.gdn_chunked import (CHUNK, ChunkConfig, chunked_gdn_forward, chunked_gdn_pool_forward,
                                           chunked_gdn_reference, default_config)

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def ours(*args, checkpoint_chunks=None, checkpoints=None, config=None):
    """chunked_gdn_forward on DEVICE, results on the CPU (checkpoints updated in place, as on the device)."""
    on = [a.to(DEVICE) for a in args]
    ck = None if checkpoints is None else checkpoints.to(DEVICE)
    idx = None if checkpoint_chunks is None else checkpoint_chunks.to(DEVICE)
    o, final = chunked_gdn_forward(*on, checkpoint_chunks=idx, checkpoints=ck, config=config)
    if checkpoints is not None:
        checkpoints.copy_(ck.cpu())
    return o.cpu(), final.cpu()


@pytest.fixture(autouse=True)
def _bf16_rounds_to_nearest(monkeypatch):
    round_bf16_to_nearest(monkeypatch)


def aligned_layout(lengths, absorber_chunks=1):
    """(dest [T] int64 aligned row of each packed token, cu_aligned [B+2] int64, chunk_indices [NT, 2])."""
    counts = [-(-n // CHUNK) for n in lengths] + [absorber_chunks]
    cu = torch.tensor([0] + counts).cumsum(0) * CHUNK
    dest = torch.cat([cu[b] + torch.arange(n) for b, n in enumerate(lengths)]) if lengths else torch.zeros(0)
    return dest.long(), cu.long(), chunk_rows(cu)


def chunk_rows(cu):
    """fla's prepare_chunk_indices: (sequence, chunk within) of every chunk, sequence by sequence."""
    rows = [(n, i) for n in range(len(cu) - 1) for i in range(-(-int(cu[n + 1] - cu[n]) // CHUNK))]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)


def packed_inputs(T, H, HV, K, V, dtype, seed, decay=0.5):
    g = torch.Generator().manual_seed(seed)
    qk = torch.nn.functional.normalize(torch.randn(T, 2 * H, K, generator=g), dim=-1)
    q, k = qk[:, :H].to(dtype), qk[:, H:].to(dtype)
    v = torch.randn(T, HV, V, generator=g).to(dtype)
    gate = -torch.rand(T, HV, generator=g) * decay
    beta = torch.rand(T, HV, generator=g).to(dtype)
    return q, k, v, gate, beta


def scatter_rows(x, dest, T_al):
    out = x.new_zeros((T_al,) + tuple(x.shape[1:]))
    out[dest] = x
    return out


def run_aligned(lengths, H, HV, K, V, dtype, seed=0, nonzero_h0=True, config=None, **kw):
    """Both sides on the aligned layout of `lengths`; returns (ours, reference, layout)."""
    dest, cu, idx = aligned_layout(lengths)
    T_al = int(cu[-1])
    packed = packed_inputs(sum(lengths), H, HV, K, V, dtype, seed)
    q, k, v, g, beta = (scatter_rows(x, dest, T_al) for x in packed)
    N = cu.shape[0] - 1
    h0 = torch.randn(N, HV, K, V, generator=torch.Generator().manual_seed(seed + 1)) * 0.3
    if not nonzero_h0:
        h0.zero_()
    h0[-1] = 0  # the absorber starts from the scratch state zero
    got = ours(q, k, v, g, beta, cu, idx, h0, config=config, **kw)
    ref = chunked_gdn_reference(q, k, v, g, beta, cu, h0)
    return got, ref, (q, k, v, g, beta, cu, idx, h0, dest)


SHAPES = [  # (H, HV, K, V)
    pytest.param(2, 2, 16, 16, id="r1-K16-V16"),
    pytest.param(1, 2, 24, 48, id="r2-K24-V48"),
    pytest.param(1, 4, 32, 24, id="r4-K32-V24"),
    pytest.param(2, 4, 48, 32, id="r2-K48-V32"),
]


@pytest.mark.parametrize("H, HV, K, V", SHAPES)
def test_matches_reference_fp32(H, HV, K, V):
    (o, final), (o_ref, final_ref, _), _ = run_aligned([1, 63, 64, 65, 130], H, HV, K, V, torch.float32)
    assert_close("o", o_ref, o, TOL[torch.float32])
    assert_close("final", final_ref, final, TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_matches_reference_16bit(dtype):
    lengths = [65, 1, 130, 64] if dtype == torch.bfloat16 else [70, 1]
    (o, final), (o_ref, final_ref, _), _ = run_aligned(lengths, 1, 2, 32, 48, dtype)
    assert o.dtype == dtype
    assert_close("o", o_ref, o.float(), TOL[dtype])
    assert_close("final", final_ref, final, TOL[dtype])


def test_aligned_layout_equals_packed_streams():
    """Identity tokens in the gaps and the absorber leave each stream's outputs and state as if alone."""
    lengths, H, HV, K, V = [63, 1, 130], 1, 2, 16, 16
    (o, final), _, (q, k, v, g, beta, cu, idx, h0, dest) = run_aligned(lengths, H, HV, K, V, torch.float32)
    for b, n in enumerate(lengths):
        rows = dest[sum(lengths[:b]):sum(lengths[:b + 1])]
        alone = [x[rows] for x in (q, k, v, g, beta)]
        o_b, final_b, _ = chunked_gdn_reference(*alone, torch.tensor([0, n]), h0[b:b + 1])
        assert_close(f"o of stream {b}", o_b, o[rows], TOL[torch.float32])
        assert_close(f"final of stream {b}", final_b[0], final[b], TOL[torch.float32])
    assert torch.equal(o[-CHUNK:], torch.zeros_like(o[-CHUNK:]))  # the absorber's identity rows
    assert torch.equal(final[-1], h0[-1])


@pytest.mark.parametrize("cu", [[0, 1, 64, 129, 259], [0, 0, 100, 100, 164]], ids=["ragged", "empty-streams"])
def test_unaligned_sequences(cu):
    """Any cu_aligned, not only chunk-aligned ones (fla's contract): chunks start at each sequence's start."""
    cu = torch.tensor(cu, dtype=torch.int64)
    T, H, HV, K, V = int(cu[-1]), 1, 2, 16, 32
    q, k, v, g, beta = packed_inputs(T, H, HV, K, V, torch.float32, seed=3)
    h0 = torch.randn(cu.shape[0] - 1, HV, K, V) * 0.3
    o, final = ours(q, k, v, g, beta, cu, chunk_rows(cu), h0)
    o_ref, final_ref, _ = chunked_gdn_reference(q, k, v, g, beta, cu, h0)
    assert_close("o", o_ref, o, TOL[torch.float32])
    assert_close("final", final_ref, final, TOL[torch.float32])
    for n in range(cu.shape[0] - 1):
        if cu[n + 1] == cu[n]:
            assert torch.equal(final[n], h0[n]), f"empty sequence {n} changed its state"


def test_unused_chunk_rows_change_nothing():
    """Rows of chunk_indices past the real chunks, on an empty last sequence, are computed on nothing and
    read by no sequence: a packed (unaligned) layout can keep a fixed chunk count that way."""
    cu = torch.tensor([0, 100, 164, 164], dtype=torch.int64)
    T, H, HV, K, V = 164, 1, 2, 16, 16
    q, k, v, g, beta = packed_inputs(T, H, HV, K, V, torch.float32, seed=4)
    h0 = torch.randn(3, HV, K, V) * 0.3
    rows = torch.cat([chunk_rows(cu), torch.tensor([[2, 0], [2, 0]])])
    o, final = ours(q, k, v, g, beta, cu, rows, h0)
    o_ref, final_ref, _ = chunked_gdn_reference(q, k, v, g, beta, cu, h0)
    assert_close("o", o_ref, o, TOL[torch.float32])
    assert_close("final", final_ref, final, TOL[torch.float32])


def pool_layout(lengths, short, spare_rows):
    """What the op hands chunked_gdn_pool_forward for packed `lengths` (streams of at most `short` tokens left
    out): bounds [2, B+1] and chunk_indices (the long streams' chunks, then `spare_rows` rows naming the spare
    sequence B), built here in plain torch."""
    B = len(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0)
    long = [n > short for n in lengths]
    starts = torch.cat([cu[:-1], cu[-1:]])
    ends = torch.cat([torch.where(torch.tensor(long, dtype=torch.bool), cu[1:], cu[:-1]), cu[-1:]])
    rows = [(b, i) for b, n in enumerate(lengths) if long[b] for i in range(-(-n // CHUNK))]
    rows += [(B, j) for j in range(spare_rows)]
    return cu, torch.stack([starts, ends]).long(), torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pool_forward_reads_and_writes_only_its_streams(dtype):
    """The op's entry point on packed tokens: each long stream from and into its (strided) pool row, as if
    alone; the rows of short, empty and outside slots bit-identical; output rows of short / empty streams
    untouched, rows of tokens in no stream 0; checkpoints of chunk rows through the same call."""
    lengths, short, spare, H, HV, K, V = [70, 3, 0, 130, 64, 65], 64, 9, 1, 2, 16, 24
    cu, bounds, idx = pool_layout(lengths, short, spare_rows=3)
    T = int(cu[-1]) + spare
    q, k, v, g, beta = packed_inputs(T, H, HV, K, V, dtype, seed=11)
    slots = torch.tensor([5, 0, 7, 2, 3, 6])
    gen = torch.Generator().manual_seed(12)
    pool = (torch.randn(9, HV, V, K, generator=gen) * 0.3).transpose(2, 3)  # [S, HV, K, V], not contiguous
    before = pool.clone()
    o = torch.full((T, HV, V), float("nan"), dtype=dtype)
    # stream 3's chunk 1 (row 2 + 1), stream 5's chunk 0 (row 5), none, a spare row
    chunks = torch.tensor([3, 5, -1, 7], dtype=torch.int64)
    ckpt = torch.full((4, HV, K, V), 7.0)
    on = [x.to(DEVICE) for x in (q, k, v, g, beta, bounds, idx)]
    pool_d, o_d, ck_d = pool.to(DEVICE), o.to(DEVICE), ckpt.to(DEVICE)
    out = chunked_gdn_pool_forward(*on, pool_d, slots.to(DEVICE), o_d, checkpoint_chunks=chunks.to(DEVICE),
                                   checkpoints=ck_d)
    assert out is o_d
    out, pool_after, ckpt = out.cpu(), pool_d.cpu(), ck_d.cpu()
    for b, n in enumerate(lengths):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if n > short:
            o_ref, final_ref, starts = chunked_gdn_reference(*(x[rows] for x in (q, k, v, g, beta)),
                                                             torch.tensor([0, n]), before[slots[b]][None])
            assert_close(f"o of stream {b}", o_ref, out[rows].float(), TOL[dtype])
            assert_close(f"state of stream {b}", final_ref[0], pool_after[slots[b]], TOL[dtype])
            if b == 3:
                assert_close("checkpoint of stream 3's chunk 1", starts[1], ckpt[0], TOL[dtype])
            if b == 5:
                assert torch.equal(ckpt[1], before[slots[b]]), "checkpoint of a first chunk is the pool row"
        else:
            assert torch.isnan(out[rows].float()).all(), f"output rows of short stream {b} were written"
    for p in (2, 3):  # no chunk, a spare row (the spare sequence has no tokens): left as they were
        assert torch.equal(ckpt[p], torch.full_like(ckpt[p], 7.0)), f"checkpoint {p} was written"
    assert torch.equal(out[int(cu[-1]):], torch.zeros_like(out[int(cu[-1]):])), "spare rows are not 0"
    written = {int(slots[b]) for b, n in enumerate(lengths) if n > short}
    for slot in range(pool.shape[0]):
        if slot not in written:
            assert torch.equal(pool_after[slot], before[slot]), f"slot {slot} was written"


def test_pool_forward_without_streams_zeroes_every_row():
    """B = 0 (no slots): the spare sequence alone; every row is a token in no stream."""
    T, H, HV, K, V = 70, 1, 2, 16, 16
    q, k, v, g, beta = (x.to(DEVICE) for x in packed_inputs(T, H, HV, K, V, torch.float32, seed=1))
    bounds = torch.zeros((2, 1), dtype=torch.int64, device=DEVICE)
    idx = torch.tensor([[0, 0], [0, 1]], dtype=torch.int64, device=DEVICE)
    pool = torch.randn(2, HV, K, V, device=DEVICE)
    before = pool.clone()
    o = chunked_gdn_pool_forward(q, k, v, g, beta, bounds, idx, pool, torch.zeros(0, dtype=torch.int64,
                                                                                   device=DEVICE))
    assert torch.equal(o, torch.zeros_like(o)) and torch.equal(pool, before)


def test_repeated_keys_stay_exact():
    """Runs of one key with beta near 1: (I + A)^-1 is tame but the powers of A grow binomially, so a
    solver that sums a power series cancels catastrophically; forward substitution does not."""
    T, H, HV, K, V = 128, 1, 1, 16, 16
    q, k, v, g, beta = packed_inputs(T, H, HV, K, V, torch.float32, seed=5, decay=0.01)
    k[:] = k[:1]
    beta.fill_(0.999)
    cu = torch.tensor([0, T], dtype=torch.int64)
    h0 = torch.zeros(1, HV, K, V)
    o, final = ours(q, k, v, g, beta, cu, chunk_rows(cu), h0)
    o_ref, final_ref, _ = chunked_gdn_reference(q, k, v, g, beta, cu, h0)
    assert_close("o", o_ref, o, TOL[torch.float32])
    assert_close("final", final_ref, final, TOL[torch.float32])


def test_checkpoints_are_chunk_start_states():
    lengths = [130, 1, 65]
    _, cu, idx = aligned_layout(lengths)
    # chunk rows: stream 0: 0 1 2, stream 1: 3, stream 2: 4 5, absorber: 6
    chunks = torch.tensor([1, -1, 0, 2, 5, 5, 3, 6, -1, 99], dtype=torch.int64)
    poison = torch.full((chunks.shape[0], 2, 16, 24), 7.0)
    ckpt = poison.clone()
    (o, final), (o_ref, final_ref, starts), _ = run_aligned(lengths, 1, 2, 16, 24, torch.float32,
                                                            checkpoint_chunks=chunks, checkpoints=ckpt)
    assert_close("o", o_ref, o, TOL[torch.float32])
    for p, c in enumerate(chunks.tolist()):
        if c == idx.shape[0] - 1:  # the absorber's chunk: its zero state, exactly
            assert torch.equal(ckpt[p], torch.zeros_like(ckpt[p]))
        elif 0 <= c < idx.shape[0]:
            assert_close(f"checkpoint {p} (chunk {c})", starts[c], ckpt[p], TOL[torch.float32])
        else:
            assert torch.equal(ckpt[p], poison[p]), f"checkpoint {p} (chunk {c}) was written"


def test_checkpoint_of_a_first_chunk_is_h0():
    _, cu, _ = aligned_layout([64, 70])
    chunks = torch.tensor([0, 1], dtype=torch.int64)  # the first chunks of streams 0 and 1
    ckpt = torch.zeros(2, 1, 16, 16)
    _, _, (q, k, v, g, beta, cu, idx, h0, _) = run_aligned([64, 70], 1, 1, 16, 16, torch.float32,
                                                           checkpoint_chunks=chunks, checkpoints=ckpt)
    assert torch.equal(ckpt[0], h0[0]) and torch.equal(ckpt[1], h0[1])


@pytest.mark.parametrize("config", [ChunkConfig(block_v=16), ChunkConfig(block_v=64, state_warps=8),
                                    ChunkConfig(block_v=16, heads=2), ChunkConfig(block_v=32, heads=2)],
                         ids=lambda c: c.name)
def test_configs_agree(config):
    (o, final), (o_ref, final_ref, _), _ = run_aligned([65, 20], 1, 2, 32, 48, torch.float32, config=config)
    assert_close("o", o_ref, o, TOL[torch.float32])
    assert_close("final", final_ref, final, TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_two_heads_a_program_equal_one(dtype):
    """ChunkConfig.heads 2 (the two value heads of a key head in one state-pass program, side by side in one state
    tile): per column the same products as one head a program, so the same outputs, final states and checkpoints
    (bit for bit in the interpreter), with 4 value heads over 2 key heads (programs of heads 0-1 and 2-3), V not a
    multiple of the tile, the pool entry point (strided pool, empty and short streams, spare rows zeroed) and
    checkpoints."""
    lengths, short, spare, H, HV, K, V = [70, 3, 130, 0, 65], 64, 5, 2, 4, 16, 40
    cu, bounds, idx = pool_layout(lengths, short, spare_rows=2)
    T = int(cu[-1]) + spare
    q, k, v, g, beta = packed_inputs(T, H, HV, K, V, dtype, seed=21)
    slots = torch.tensor([4, 0, 2, 1, 6])
    pool = (torch.randn(7, HV, V, K, generator=torch.Generator().manual_seed(22)) * 0.3).transpose(2, 3)
    chunks = torch.tensor([1, 3, -1], dtype=torch.int64)
    results = []
    for heads in (1, 2):
        on = [x.to(DEVICE) for x in (q, k, v, g, beta, bounds, idx)]
        pool_d, ck_d = pool.to(DEVICE, copy=True), torch.full((3, HV, K, V), 7.0, device=DEVICE)
        o = chunked_gdn_pool_forward(*on, pool_d, slots.to(DEVICE), torch.full((T, HV, V), 5.0, dtype=dtype,
                                     device=DEVICE), checkpoint_chunks=chunks.to(DEVICE), checkpoints=ck_d,
                                     config=ChunkConfig(block_v=16, heads=heads))
        results.append((o.cpu(), pool_d.cpu(), ck_d.cpu()))
    for name, one, two in zip(("o", "pool", "checkpoints"), *results):
        if DEVICE == "cpu":  # (fp32 dots) the same products per column
            assert torch.equal(one, two), name
        else:  # tensor-core dots of another width may sum in another order
            assert_close(name, one.float(), two.float(), TOL[dtype])
    with pytest.raises(ValueError, match="heads 2 must divide"):
        run_aligned([65], 1, 3, 16, 16, torch.float32, config=ChunkConfig(heads=2))


@pytest.mark.parametrize("solve_block", [1, 2, 4, 8, 32, 64])
@pytest.mark.parametrize("repeated", [False, True], ids=["random-keys", "repeated-keys"])
def test_every_solve_split_is_exact(solve_block, repeated):
    """The solve's split between forward substitution and doublings changes rounding only, also where a
    run of one key makes a power series of A cancel (16, the default, runs in every other test)."""
    T, H, HV, K, V = 100, 1, 1, 16, 16
    q, k, v, g, beta = packed_inputs(T, H, HV, K, V, torch.float32, seed=solve_block, decay=0.01 if repeated else 0.5)
    if repeated:
        k[:] = k[:1]
        beta.fill_(0.999)
    cu = torch.tensor([0, T], dtype=torch.int64)
    h0 = torch.randn(1, HV, K, V) * 0.3
    o, final = ours(q, k, v, g, beta, cu, chunk_rows(cu), h0, config=ChunkConfig(solve_block=solve_block))
    o_ref, final_ref, _ = chunked_gdn_reference(q, k, v, g, beta, cu, h0)
    assert_close("o", o_ref, o, TOL[torch.float32])
    assert_close("final", final_ref, final, TOL[torch.float32])


def test_bad_inputs_raise():
    _, cu, idx = aligned_layout([10])
    T = int(cu[-1])
    q, k, v, g, beta = packed_inputs(T, 1, 2, 16, 16, torch.float32, seed=0)
    h0 = torch.zeros(2, 2, 16, 16)
    with pytest.raises(ValueError, match="g is"):
        chunked_gdn_forward(q, k, v, g.double(), beta, cu, idx, h0)
    with pytest.raises(ValueError, match="h0 is"):
        chunked_gdn_forward(q, k, v, g, beta, cu, idx, h0[:1])
    with pytest.raises(ValueError, match="cu_aligned must be int64"):
        chunked_gdn_forward(q, k, v, g, beta, cu.int(), idx, h0)
    with pytest.raises(ValueError, match="come together"):
        chunked_gdn_forward(q, k, v, g, beta, cu, idx, h0, checkpoint_chunks=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="checkpoints is"):
        chunked_gdn_forward(q, k, v, g, beta, cu, idx, h0, checkpoint_chunks=torch.zeros(2, dtype=torch.int64),
                            checkpoints=torch.zeros(1, 2, 16, 16))
    with pytest.raises(ValueError, match="block_v"):
        ChunkConfig(block_v=24)
    with pytest.raises(ValueError, match="solve_block"):
        ChunkConfig(solve_block=3)
    with pytest.raises(ValueError, match="fp32_dots"):
        ChunkConfig(fp32_dots="fp64")


# The interpreter runs the kernels as Python: it accepts what the compiler refuses (a global that is not
# constexpr, say). Compiling them for Hopper (Triton's front end, its sm_90 passes and ptxas, all on the
# CPU) catches that without a GPU.
HOPPER_COMPILE = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import metrale_graph.ops.gdn_chunked as m
from metrale_graph.ops.gdn_chunked import kernels

def build(fn, args, consts, warps, stages):
    names = [n for n in fn.arg_names if n not in consts]
    sig = {n: ("constexpr" if n in consts else args.get(n, "i32")) for n in fn.arg_names}
    div = [i for i, n in enumerate(fn.arg_names) if n in names and (sig[n].startswith("*") or n.startswith("stride"))]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs={(i,): [["tt.divisibility", 16]] for i in div})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})

ptr = lambda names, t: {n: t for n in names}
bf, f32, i64 = "*bf16", "*fp32", "*i64"
cfg = m.default_config(2, 32, 128)
intra = dict(ptr(["q_ptr", "k_ptr", "beta_ptr", "tm_ptr", "aqk_ptr"], bf), **ptr(["g_ptr", "gc_ptr"], f32),
             **ptr(["bos_ptr", "eos_ptr", "idx_ptr", "first_ptr"], i64), scale="fp32")
build(kernels._gdn_chunk_intra_kernel, intra, dict(stride_gh=1, stride_bh=1, R=2, K=128, BK=128, SB=cfg.solve_block,
      LOG_SB=cfg.solve_block.bit_length() - 1, PREC="tf32", DOT_T=tl.bfloat16), cfg.intra_warps, cfg.intra_stages)
state = dict(ptr(["q_ptr", "k_ptr", "v_ptr", "tm_ptr", "aqk_ptr", "o_ptr"], bf),
             **ptr(["gc_ptr", "h0_ptr", "ht_ptr", "ck_ptr"], f32),
             **ptr(["first_ptr", "slot_ptr", "bos_ptr", "eos_ptr", "ck_idx_ptr", "ck_dest_ptr"], i64), scale="fp32")
# fla's contract (h0 / final contiguous) and the op's pool (int32 or int64 slots), with and without checkpoints; one
# value head a program and two (ChunkConfig.heads)
for P, pool, G in ((0, False, 1), (3, False, 1), (0, True, 1), (3, True, 1), (0, True, 2), (3, False, 2)):
    sig = dict(state, slot_ptr="*i32") if pool and P == 0 else state
    build(kernels._gdn_chunk_state_kernel, sig, dict(stride_h0v=1, stride_htv=1, stride_c3=1, R=2, HV=32, K=128, V=128,
          P=P, BK=128, BV=cfg.block_v, BLOCK_P=4, PREC="tf32", DOT_T=tl.bfloat16, POOL=pool, G=G), cfg.state_warps,
          cfg.state_stages)
print("compiled")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU every other test compiles the kernels")
def test_kernels_compile_for_hopper():
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", HOPPER_COMPILE], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def test_default_config_widens_tiles_with_streams():
    """The measured choice at the 9B heads (HV 32, V 128) on 132 SMs: BV 16 for one stream, 32 for several."""
    assert default_config(2, 32, 128).block_v == 16  # one long stream: 256 programs of 16 columns
    for streams in (4, 8, 32):
        cfg = default_config(streams + 1, 32, 128)
        assert (cfg.block_v, cfg.state_warps, cfg.state_stages) == (32, 4, 2), streams


# On the GPU: flash-linear-attention at the Qwen3.5-9B head shape, and CUDA graph replay ----------------
H9, HV9, K9, V9 = 16, 32, 128, 128


def aligned_inputs(lengths, NT, seed):
    """bf16 inputs of `lengths` in the aligned layout of NT chunks on the GPU, h0 nonzero (absorber: zero)."""
    dest, cu, idx = aligned_layout(lengths, NT - sum(-(-n // CHUNK) for n in lengths))
    packed = packed_inputs(sum(lengths), H9, HV9, K9, V9, torch.bfloat16, seed)
    args = [scatter_rows(x, dest, NT * CHUNK).cuda() for x in packed]
    h0 = torch.randn(len(lengths) + 1, HV9, K9, V9, generator=torch.Generator().manual_seed(seed)) * 0.1
    h0[-1] = 0
    return args + [cu.cuda(), idx.cuda(), h0.cuda()]


@pytest.mark.gpu
def test_matches_fla_at_9b_heads(monkeypatch):
    monkeypatch.setenv("FLA_DISABLE_TENSOR_CACHE", "1")
    chunk = pytest.importorskip("fla.ops.gated_delta_rule.chunk")
    args = aligned_inputs([1, 65, 700, 2048], 60, seed=7)
    o, final = chunked_gdn_forward(*args)
    q, k, v, g, beta, cu, idx, h0 = args
    _, o_fla, _, final_fla, _, _ = chunk.chunk_gated_delta_rule_fwd(
        q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], scale=K9 ** -0.5, initial_state=h0,
        output_final_state=True, cu_seqlens=cu, chunk_indices=idx)
    assert_close("o vs fla", o_fla[0].float(), o.float(), TOL[torch.bfloat16])
    assert_close("final vs fla", final_fla, final, TOL[torch.bfloat16])


@pytest.mark.gpu
def test_graph_replay_with_other_lengths_is_exact():
    NT = 20
    static = aligned_inputs([100, 300, 500, 100], NT, seed=8)
    ck_chunks = torch.tensor([1, 9, -1], dtype=torch.int64, device="cuda")
    ckpt = torch.zeros(3, HV9, K9, V9, device="cuda")
    step = lambda: chunked_gdn_forward(*static, checkpoint_chunks=ck_chunks, checkpoints=ckpt)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, final = step()
    for lengths in ([37, 93, 126, 744], [1, 1, 2, 990]):
        new = aligned_inputs(lengths, NT, seed=9)
        for s, n in zip(static, new):
            s.copy_(n)
        ckpt.zero_()
        graph.replay()
        replayed = (o.clone(), final.clone(), ckpt.clone())
        ckpt.zero_()
        eager = chunked_gdn_forward(*new, checkpoint_chunks=ck_chunks, checkpoints=ckpt)
        for name, a, b in zip(("o", "final", "checkpoints"), replayed, (*eager, ckpt)):
            assert torch.equal(a, b), f"{name}: replay with lengths {lengths} differs from eager"

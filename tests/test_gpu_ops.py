"""On a GPU: every phase op's CUDA path against its CPU reference on upcast inputs (9B head
dims, ragged lengths up to 4097, with and without prior state; then head, rotary and block sizes
that are not powers of two; then decode-shaped batches at 9B head dims, which take the recurrent GDN
kernel and split-K attention, and mixed steps that are not, where the GDN op splits its streams between
our chunked kernels and the recurrent kernel; one-stream calls, where attention takes cuDNN's dense
kernel at head dims 128 / 256), and every op captured alone in a CUDA graph, replayed with other lengths
and slots of the same bucket (a prefill bucket, a decode one, a mixed one; for the GDN and attention ops
a one-stream bucket with tokens in no stream too). Attention calls that are not decode-shaped take
FlashAttention-2 / cuDNN plus our context + merge kernel; the GDN op's chunked path is also compared with
flash-linear-attention's (its "fla" backend, the previous path).
The MoE op also at realistic expert counts and sizes, and replayed with other routings (other group
sizes) of the same bucket."""

from dataclasses import replace

import pytest
import torch

from metrics import TOL, assert_close, assert_no_aliasing, clone_args, compared_rows, outputs, upcast
from metrale_graph.ops import REGISTRY, Shapes, declaration
from metrale_graph.ops import gdn_recurrence as gdn_op, paged_attention as attention_op
from metrale_graph.ops.moe.reference import route
from metrale_graph.ops.common import decode_shaped, rms_norm
from op_cases import op_args

pytestmark = pytest.mark.gpu

BIG = Shapes(lengths=(1, 63, 64, 65, 1000, 4097), context=(0, 0, 0, 0, 0, 0), H=2, HV=4, K=128, V=128, D=256,
           I=512, HQ=4, HKV=2, HD=256, R=64, BS=64, num_slots=8, num_blocks=480)
BIG_CASES = [BIG, replace(BIG, context=(5, 0, 130, 64, 2000, 1))]
# same bucket (B=6, T=5290) as BIG, other lengths, a zero-length padding stream, other slots
REPLAY = replace(BIG, lengths=(2000, 0, 1, 3017, 200, 72), context=(0, 0, 77, 3, 640, 1000))
# Sizes that are not powers of two, at moderate lengths: head_dim 48 / 72 / 80 / 96 with rotary
# dims 12 / 18 / 20 / 40; GDN dk != dv among 48 / 80 / 96 / 136 / 200 (200: all four of fla's
# 64-row state tiles, the last one partial); value / key head ratios 1..4; query / KV head ratios
# 1 (HQ == HKV), 3, 4 (one KV head); KV blocks of 16 / 32 / 48 / 256; conv widths 2..4; one
# stream of one token; a zero-length padding stream.
ODD_CASES = [
    Shapes(lengths=(1,), context=(0,), H=2, HV=2, K=48, V=80, D=128, I=192, HQ=2, HKV=2, HD=48, R=12, W=4, BS=16,
         num_blocks=8),
    Shapes(lengths=(63, 65, 300, 1), context=(0, 7, 0, 40), H=2, HV=6, K=80, V=96, D=192, I=320, HQ=4, HKV=1,
         HD=80, R=20, W=3, BS=48, num_blocks=28),
    Shapes(lengths=(1, 300, 0, 65), context=(129, 0, 0, 0), H=1, HV=4, K=96, V=48, D=128, I=256, HQ=8, HKV=2,
         HD=96, R=40, W=2, BS=256, num_blocks=8),
    Shapes(lengths=(300, 63), context=(0, 5), H=4, HV=8, K=200, V=136, D=256, I=384, HQ=6, HKV=2, HD=72, R=18,
         W=4, BS=32, num_blocks=20),
]

# MoE at realistic sizes: 64 experts, 8 per token (lengths summing to 2000, and one token: more
# experts than pairs); then Qwen3.5-35B-A3B's dims (D 2048, 256 experts of 512, shared 512). Their average
# groups (250, 1 / 8, 32 pairs) and BIG's (1763) give the grouped GEMMs blocks of 64, 16, 32 and 128 rows.
MOE = Shapes(lengths=(700, 1299, 1), context=(0, 0, 0), D=512, E=64, TOPK=8, IE=256, IS=256)
MOE_CASES = [MOE, replace(MOE, lengths=(1,), context=(0,)),
             replace(MOE, lengths=(1, 1023), context=(0, 0), D=2048, E=256, IE=512, IS=512)]


def moe_expert_counts(args):
    """Pairs per expert of metrale::moe's arguments (the routing the reference computes)."""
    a = declaration(REGISTRY["moe"].op).Args(*args)
    h, norm_w, router_w, top_k, eps = a.h, a.norm_w, a.router_w, a.top_k, a.eps
    top_e = route(rms_norm(h.float(), norm_w.float(), eps), router_w.float(), top_k, True)[1]
    return torch.zeros(router_w.shape[0], dtype=torch.long, device=h.device).scatter_add_(
        0, top_e.flatten(), torch.ones_like(top_e.flatten()))


# Decode-shaped (ops.common.decode_shaped) at 9B head dims: GDN K = V = 128 with two value heads per
# key head; attention HD 256 with 16 query heads on 4 KV heads; blocks of 64, block tables of 33
# blocks (2112 keys: split-K over 2048-token contexts, the last split partial).
NINE_B = dict(H=2, HV=4, K=128, V=128, D=256, I=512, HQ=16, HKV=4, HD=256, R=64, BS=64)
DECODE_CASES = [
    # D1 as the runner pads it: one token after 2048, a zero-length stream
    Shapes(lengths=(1, 0), context=(2048, 0), num_slots=2, num_blocks=2 * 33, **NINE_B),
    # D32: 32 one-token streams after 2047 .. 63 cached tokens
    Shapes(lengths=(1,) * 32, context=tuple(2047 - 64 * i for i in range(32)), num_slots=32, num_blocks=32 * 33,
           **NINE_B),
    # T == B = 8 with one stream holding all 8 tokens (two query tiles of 4)
    Shapes(lengths=(0, 0, 8, 0, 0, 0, 0, 0), context=(0, 0, 2040, 0, 0, 0, 0, 0), num_slots=8, num_blocks=8 * 33,
           **NINE_B),
    # a chunked-prefill step: decodes, a 40-token prompt chunk, a zero-length stream
    Shapes(lengths=(1, 1, 40, 0, 1), context=(2047, 5, 1000, 0, 64), num_slots=5, num_blocks=5 * 33, **NINE_B),
]
DECODE_OPS = ("causal_conv1d", "gdn_recurrence", "paged_attention")
# a decode bucket (B = T = 8) and another batch of it: a 3-token stream, zero-length streams, other contexts
DECODE_BUCKET = Shapes(lengths=(1,) * 8, context=(2047, 0, 5, 1000, 64, 63, 300, 1), num_slots=8, num_blocks=8 * 33,
                       **NINE_B)
DECODE_REPLAY = replace(DECODE_BUCKET, lengths=(3, 1, 0, 1, 1, 1, 1, 0), context=(100, 2047, 0, 7, 1500, 0, 64, 0))
# mixed steps, not decode-shaped (the GDN op's split path): 31 one-token decodes after contexts and a 512-token
# prompt chunk; the same bucket with long, boundary (64 / 65), zero-length and one-token streams elsewhere
MIXED = Shapes(lengths=(1,) * 31 + (512,), context=tuple(64 * i for i in range(31)) + (0,), num_slots=32,
               num_blocks=32 * 40, **NINE_B)
MIXED_REPLAY = replace(MIXED, lengths=(300, 0, 65, 64) + (1,) * 27 + (87,),
                       context=(0, 0, 5, 1000) + tuple(70 * i for i in range(27)) + (100,))
BUCKETS = {"prefill": (BIG, REPLAY), "decode": (DECODE_BUCKET, DECODE_REPLAY), "mixed": (MIXED, MIXED_REPLAY)}
# One-stream calls that are not decode-shaped: the GDN op's chunked path whole (V tiles of 16), attention by
# cuDNN's dense kernel at head dims 256 and 128, by FlashAttention-2 at 80; with and without cached context.
ONE_STREAM_CASES = [
    Shapes(lengths=(3000,), context=(0,), num_slots=2, num_blocks=60, **NINE_B),
    Shapes(lengths=(1500,), context=(700,), num_slots=2, num_blocks=60, **NINE_B),
    Shapes(lengths=(300,), context=(40,), H=2, HV=6, K=80, V=96, D=192, I=320, HQ=6, HKV=2, HD=128, R=32, W=3,
           BS=48, num_blocks=12),
    Shapes(lengths=(200,), context=(65,), H=1, HV=3, K=48, V=40, D=128, I=256, HQ=4, HKV=1, HD=80, R=20, W=2,
           BS=16, num_blocks=20),
]
ONE_STREAM_OPS = ("gdn_recurrence", "paged_attention")


def check_cuda_op(name, case):
    """The op on CUDA (through the dispatcher) against its CPU reference on upcast inputs: outputs,
    mutated pools, and outputs that alias nothing."""
    args = op_args(name, case, torch.bfloat16, seed=1)
    ref_args = upcast(clone_args(args, "cpu"))
    cuda_args = clone_args(args, "cuda")
    before = clone_args(cuda_args, "cuda")
    ref = outputs(REGISTRY[name].op(*ref_args))
    out = outputs(REGISTRY[name].op(*cuda_args))
    assert_no_aliasing(name, out, cuda_args)
    rows = compared_rows(name, args, torch.bfloat16)  # moe: tokens whose routing has a margin
    if rows is not None and len(rows) >= 16:
        assert rows.float().mean() >= 0.5, f"{name}: too few tokens to compare ({int(rows.sum())} of {len(rows)})"
    for i, (r, o) in enumerate(zip(ref, out)):
        assert o.is_cuda
        o = o.cpu()
        if rows is not None:
            r, o = r[rows], o[rows]
        assert_close(f"{name} output {i}", r, o, TOL[torch.bfloat16])
    for i, (r, a, b) in enumerate(zip(ref_args, cuda_args, before)):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and not torch.equal(a, b):
            assert_close(f"{name} mutated arg {i}", r, a.cpu(), TOL[torch.bfloat16])


@pytest.mark.parametrize("case", BIG_CASES, ids=["fresh", "prior-state"])
@pytest.mark.parametrize("name", list(REGISTRY))
def test_cuda_op_matches_reference(name, case):
    check_cuda_op(name, case)


@pytest.mark.parametrize("case", ODD_CASES, ids=[c.id for c in ODD_CASES])
@pytest.mark.parametrize("name", list(REGISTRY))
def test_cuda_op_odd_shapes_match_reference(name, case):
    check_cuda_op(name, case)


@pytest.mark.parametrize("case", DECODE_CASES, ids=["D1", "D32", "T=B-in-one-stream", "chunked-prefill-mix"])
@pytest.mark.parametrize("name", DECODE_OPS)
def test_cuda_op_decode_shapes_match_reference(name, case):
    assert decode_shaped(case.B, case.T)
    check_cuda_op(name, case)


@pytest.mark.parametrize("case", [MIXED, MIXED_REPLAY], ids=["31x1+512", "300-0-65-64-27x1-87"])
@pytest.mark.parametrize("name", DECODE_OPS)
def test_cuda_op_mixed_steps_match_reference(name, case):
    assert not decode_shaped(case.B, case.T)
    check_cuda_op(name, case)


@pytest.mark.parametrize("case", ONE_STREAM_CASES, ids=[c.id for c in ONE_STREAM_CASES])
@pytest.mark.parametrize("name", ONE_STREAM_OPS)
def test_cuda_op_one_stream_matches_reference(name, case):
    assert case.B == 1 and not decode_shaped(case.B, case.T)
    if name == "paged_attention":  # the path the call takes
        expected = "cudnn_fa2" if case.HD in attention_op.CUDNN_DENSE_HEAD_DIMS else "fa2"
        assert attention_op.prefill_backend(torch.empty(1, case.HQ, case.HD, dtype=torch.bfloat16, device="cuda"),
                                            1) == expected
    check_cuda_op(name, case)


GDN_VS_FLA = [BIG, BIG_CASES[1], ODD_CASES[1], ODD_CASES[3], MIXED, MIXED_REPLAY, ONE_STREAM_CASES[0]]


@pytest.mark.parametrize("case", GDN_VS_FLA, ids=[c.id[:60] for c in GDN_VS_FLA])
def test_gdn_chunked_kernels_match_fla(case, monkeypatch):
    """The GDN op's CUDA path with our chunked kernels (the default) against the same call with fla's on the
    aligned layout (CHUNKED_BACKEND "fla"), bf16: outputs and pools within 1e-2 of each other (each is within
    1e-2 of the fp32 reference: the tests above), slots outside the batch untouched by both."""
    args = op_args("gdn_recurrence", case, torch.bfloat16, seed=1)
    before = args[7].cuda()
    results = {}
    for backend in ("triton", "fla"):
        monkeypatch.setattr(gdn_op, "CHUNKED_BACKEND", backend)
        call = clone_args(args, "cuda")
        results[backend] = REGISTRY["gdn_recurrence"].cuda(*call), call[7]
    (o, pool), (o_fla, pool_fla) = results["triton"], results["fla"]
    assert_close("o vs fla", o_fla.float(), o.float(), 1e-2)
    changed = (pool_fla != before).flatten(1).any(1)
    assert torch.equal(pool[~changed], before[~changed]), "slots outside the batch changed"
    assert_close("pool vs fla", pool_fla[changed], pool[changed], 1e-2)


@pytest.mark.parametrize("case", MOE_CASES, ids=[c.id + f"-D{c.D}-IE{c.IE}" for c in MOE_CASES])
def test_cuda_moe_matches_reference(case):
    check_cuda_op("moe", case)


@pytest.mark.parametrize("bucket", list(BUCKETS))
@pytest.mark.parametrize("name", list(REGISTRY))
def test_cuda_op_replays_in_a_graph(name, bucket):
    """Capture with one batch's metadata, replay with another batch of the same bucket copied into
    the static inputs: equals eager on that batch; pool rows outside it stay bit-identical."""
    capture_case, replay_case = BUCKETS[bucket]
    check_replay(name, op_args(name, capture_case, torch.bfloat16, seed=2),
                 op_args(name, replay_case, torch.bfloat16, seed=3))


@pytest.mark.parametrize("name", ONE_STREAM_OPS)
def test_one_stream_bucket_replays_in_a_graph(name):
    """A one-stream bucket (B = 1, T = 3000, 9B head dims: our chunked GDN kernels whole, cuDNN's dense
    attention) captured with 3000 fresh tokens, replayed with 2500 tokens after 700 cached, the last 500
    rows in no stream: equals eager, and those rows are 0 (no NaN left for later layers' dense attention)."""
    capture_case = ONE_STREAM_CASES[0]
    replay = list(op_args(name, replace(capture_case, context=(700,)), torch.bfloat16, seed=3))
    replay[5] = torch.tensor([0, 2500], dtype=torch.int32)  # cu_seqlens: 500 tokens in no stream
    out = check_replay(name, op_args(name, capture_case, torch.bfloat16, seed=2), replay)
    assert torch.equal(out[0][2500:], torch.zeros_like(out[0][2500:])), "rows of tokens in no stream"


def check_replay(name, capture_args, replay_args):
    """Capture metrale::<name> with capture_args, replay with replay_args copied into its static inputs:
    equals eager on replay_args, pool rows outside that batch bit-identical. Returns the replayed outputs."""
    op = REGISTRY[name].op
    static = clone_args(capture_args, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (Triton compile + autotune) outside the capture
        op(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = outputs(op(*static))

    batch = clone_args(replay_args, "cuda")
    if name == "moe":  # the replayed batch routes elsewhere: other group sizes, other blocks per expert
        assert not torch.equal(moe_expert_counts(static), moe_expert_counts(batch))
    for s, b in zip(static, batch):
        if isinstance(s, torch.Tensor):
            s.copy_(b)
    pre = clone_args(batch, "cuda")
    ref = outputs(op(*batch))
    graph.replay()
    torch.cuda.synchronize()
    for i, (r, o) in enumerate(zip(ref, out)):
        assert_close(f"{name} replayed output {i}", r.float(), o.float(), 1e-2)
    for i, (s, b, p) in enumerate(zip(static, batch, pre)):
        if isinstance(s, torch.Tensor) and s.is_floating_point() and not torch.equal(b, p):  # a mutated pool
            changed = (b != p).flatten(1).any(1)
            assert torch.equal(s[~changed], p[~changed]), f"{name}: replay touched pool rows outside the batch"
            assert_close(f"{name} replayed pool {i}", b[changed].float(), s[changed].float(), 1e-2)
    return out


@pytest.mark.parametrize("case", MOE_CASES[:2], ids=["T2000", "T1"])
def test_moe_replays_other_routings(case):
    """metrale::moe captured once (random routing), replayed with the same weights and other tokens:
    a skewed routing (every token on the same experts: groups of T pairs over many blocks, most
    experts empty), then another random one; each replay equals eager on its batch."""
    op = REGISTRY["moe"].op
    static = clone_args(op_args("moe", case, torch.bfloat16, seed=2), "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(*static)
    counts = [moe_expert_counts(static)]
    h = static[0].clone()
    for new_h in (h[:1] + 1e-3 * torch.randn_like(h), torch.randn_like(h)):
        static[0].copy_(new_h)
        counts.append(moe_expert_counts(static))
        ref = op(*static)
        graph.replay()
        torch.cuda.synchronize()
        assert_close("moe replayed output", ref.float(), out.float(), 1e-2)
    if case.T > 1:
        assert counts[1].max() >= case.T // 2 and (counts[1] > 0).sum() < (counts[0] > 0).sum()  # skewed indeed
    assert not torch.equal(counts[0], counts[2])

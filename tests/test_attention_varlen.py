"""ops/attention_varlen: the context + merge kernel (parts (b) and (c)) against metrale::paged_attention's
reference, with part (a) (the new tokens over themselves, a library kernel on the GPU) computed by its
plain-torch reference and handed over in each library's log-sum-exp layout. On the CPU the kernel runs in
Triton's interpreter; cuDNN / FlashAttention run only on a GPU (benchmarks/kernels/check_attention_varlen.py).

Cases: head dims 16, 24 (masked to 32), 256; query heads per KV head 1, 2, 3, 4; blocks of 16 / 64; ragged
lengths 1, 63, 65 with contexts 0, 1, 130; zero-length streams inside and at the tail (padding) and spare
tokens past cu_seqlens[-1].
"""

import importlib

import pytest
import torch

from metrics import TOL, assert_close, upcast
from metrale_graph.ops import REGISTRY, Shapes, example_args
from test_kernels import _forbid_python_syncs, _NoHostSync

av = importlib.import_module("metrale_graph.ops.attention_varlen")

# CPU tensors through Triton's interpreter; on a GPU the library paths and our context kernel are covered by
# tests/test_gpu_ops.py (the op's one-stream, varlen and odd-dim calls) and benchmarks/kernels/check_attention_varlen.py
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests (CPU tensors)")
paged_attention_ref = REGISTRY["paged_attention"].reference

CASES = [
    Shapes(lengths=(1, 63, 65), context=(0, 1, 130), HQ=4, HKV=2, HD=16, BS=16, num_blocks=40),
    Shapes(lengths=(65, 0, 1), context=(130, 0, 1), HQ=4, HKV=4, HD=24, BS=64, num_blocks=12),
    Shapes(lengths=(63, 1), context=(130, 1), HQ=8, HKV=2, HD=256, BS=16, num_blocks=26),
    Shapes(lengths=(1, 65, 0, 0), context=(130, 0, 0, 0), HQ=6, HKV=2, HD=16, BS=64, num_blocks=12),
]


def inputs(case: Shapes, dtype, spare: int, seed: int = 0):
    """metrale::paged_attention's arguments for `case` with `spare` tokens past the last stream."""
    q, k, v, k_cache, v_cache, cu, ctx, blocks = example_args("paged_attention", case, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q, k, v = (torch.cat([x, torch.randn((spare, *x.shape[1:]), generator=g).to(dtype)]) for x in (q, k, v))
    return q, k, v, k_cache, v_cache, cu, ctx, blocks


def in_layout(lse_TH: torch.Tensor, cu: torch.Tensor, kind: str) -> torch.Tensor:
    """The reference's [T, HQ] log-sum-exp as a library kernel lays it out (cuDNN varlen: [T, HQ, 1];
    FlashAttention varlen: [HQ, T]; FlashAttention before its packed LSE: [B, HQ, max_q])."""
    if kind == "token_major":
        return lse_TH.unsqueeze(-1).contiguous()
    if kind == "head_major":
        return lse_TH.t().contiguous()
    bounds = cu.tolist()
    longest = max([e - s for s, e in zip(bounds[:-1], bounds[1:])] + [1])
    out = torch.full((len(bounds) - 1, lse_TH.shape[1], longest), float("nan"))
    for b, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        out[b, :, : e - s] = lse_TH[s:e].t()
    return out


def stream_rows(cu: torch.Tensor, context: torch.Tensor, with_context: bool) -> torch.Tensor:
    """[T'] bool over the packed rows (spare rows False): rows of streams with (without) cached context."""
    T = int(cu[-1])
    rows = torch.zeros(T, dtype=torch.bool)
    for b in range(cu.shape[0] - 1):
        if bool(context[b] > 0) == with_context:
            rows[int(cu[b]):int(cu[b + 1])] = True
    return rows


# each layout on cases of several head dims and GQA ratios, the padded one also with a zero-length stream
# inside (its rows index by stream); the head-dim-256 case once (the interpreter is slow at it)
MERGE_CASES = [(CASES[0], "token_major"), (CASES[0], "padded"), (CASES[1], "padded"), (CASES[1], "head_major"),
               (CASES[2], "head_major"), (CASES[3], "token_major")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case, kind", MERGE_CASES, ids=[f"{c.id}-{k}" for c, k in MERGE_CASES])
def test_context_merge_matches_reference(case, dtype, kind):
    """o_a / lse_a from the new tokens alone, merged with the context: metrale::paged_attention's output.
    Rows of streams without context stay o_a bit for bit, spare rows become 0 (poisoned before), the pools
    are not written (their new-token positions hold other values: only the context is read)."""
    spare = 5
    q, k, v, k_cache, v_cache, cu, ctx, blocks = inputs(case, dtype, spare)
    ref = paged_attention_ref(*upcast([q, k, v, k_cache.clone(), v_cache.clone(), cu, ctx, blocks]))
    o_new, lse = av.new_tokens_attention_ref(q.float(), k.float(), v.float(), cu)
    o = o_new.to(dtype)
    o[case.T:] = float("nan")
    before = o.clone()
    pools = k_cache.clone(), v_cache.clone()
    lse_lib = in_layout(lse, cu, kind)
    out = av.context_merge(q, k_cache, v_cache, cu, ctx, blocks, o, lse_lib, av.lse_layout(lse_lib, kind))
    assert out is o
    merged, plain = stream_rows(cu, ctx, True), stream_rows(cu, ctx, False)
    assert_close("rows with context", ref[: case.T][merged], out[: case.T][merged].float(), TOL[dtype])
    assert torch.equal(out[: case.T][plain], before[: case.T][plain]), "rows without context changed"
    assert torch.equal(out[case.T:], torch.zeros_like(out[case.T:])), "spare rows are not 0"
    assert torch.equal(k_cache, pools[0]) and torch.equal(v_cache, pools[1]), "the pools were written"


@pytest.mark.parametrize("case", CASES[:2], ids=[c.id for c in CASES[:2]])
def test_reference_backend_is_paged_attention(case):
    """The whole composition (part (a) by plain torch): metrale::paged_attention's reference, spare rows 0,
    the pools untouched."""
    q, k, v, k_cache, v_cache, cu, ctx, blocks = inputs(case, torch.float32, spare=3, seed=4)
    ref = paged_attention_ref(q, k, v, k_cache.clone(), v_cache.clone(), cu, ctx, blocks)
    pools = k_cache.clone(), v_cache.clone()
    out = av.varlen_prefill_attention(q, k, v, k_cache, v_cache, cu, ctx, blocks, backend="reference")
    assert_close("o", ref[: case.T], out[: case.T], TOL[torch.float32])
    assert torch.equal(out[case.T:], torch.zeros_like(out[case.T:]))
    assert torch.equal(k_cache, pools[0]) and torch.equal(v_cache, pools[1])


class FakeLibraries:
    """aten's cuDNN / FlashAttention entry points as the plain-torch reference, returning what the GPU ones
    return: cuDNN dense (o [1, HQ, T, HD] in q's BSHD layout, lse [1, HQ, T, 1]), FlashAttention varlen
    (o [T, HQ, HD], lse [HQ, T]). Records each call."""

    def __init__(self):
        self.calls = []

    def cudnn_dense(self, q, k, v, bias, lse, dropout, causal, debug, *, scale):
        self.calls.append(("cudnn_dense", q.shape[2], scale))
        T, HQ = q.shape[2], q.shape[1]
        o, lse = av.new_tokens_attention_ref(*(x[0].transpose(0, 1) for x in (q, k, v)),
                                             torch.tensor([0, T], dtype=torch.int32))
        return o.to(q.dtype).transpose(0, 1).unsqueeze(0), lse.t().reshape(1, HQ, T, 1), None, None, T, T, None, None, None

    def fa2_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale):
        self.calls.append(("fa2_varlen", max_q, scale))
        o, lse = av.new_tokens_attention_ref(q, k, v, cu_q)
        return o.to(q.dtype), lse.t().contiguous(), None, None, None


@pytest.mark.parametrize("backend, one, many", [("fa2", "fa2_varlen", "fa2_varlen"),
                                                ("cudnn_fa2", "cudnn_dense", "fa2_varlen")])
def test_library_backends_route_and_lay_out(backend, one, many, monkeypatch):
    """Each backend calls its library kernel (one-stream buckets and others) with the scale, and reads its
    output and log-sum-exp in the layout that kernel returns (faked from the reference):
    metrale::paged_attention's output, spare rows 0."""
    fake = FakeLibraries()
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", fake.cudnn_dense)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", fake.fa2_varlen)
    for case, expected in ((Shapes(lengths=(65,), context=(130,), HQ=4, HKV=2, HD=16, BS=16, num_blocks=13), one),
                           (CASES[0], many)):
        q, k, v, k_cache, v_cache, cu, ctx, blocks = inputs(case, torch.bfloat16, spare=3, seed=7)
        ref = paged_attention_ref(*upcast([q, k, v, k_cache.clone(), v_cache.clone(), cu, ctx, blocks]))
        fake.calls.clear()
        out = av.varlen_prefill_attention(q, k, v, k_cache, v_cache, cu, ctx, blocks, backend=backend)
        assert [c[0] for c in fake.calls] == [expected]
        assert fake.calls[0][2] == case.HD**-0.5
        assert_close(f"{backend} o", ref[: case.T], out[: case.T].float(), TOL[torch.bfloat16])
        assert torch.equal(out[case.T:], torch.zeros_like(out[case.T:]))


def test_padding_only_batches_give_zeros():
    """Every stream zero-length (a bucket filled with padding): all rows are spare, all 0; no tokens at all."""
    case = Shapes(lengths=(0, 0, 0), context=(0, 0, 0), HQ=4, HKV=2, HD=16)
    q, k, v, k_cache, v_cache, cu, ctx, blocks = inputs(case, torch.bfloat16, spare=7)
    o = torch.full_like(q, float("nan"))
    lse = torch.zeros(q.shape[0], 4, 1)
    av.context_merge(q, k_cache, v_cache, cu, ctx, blocks, o, lse, av.lse_layout(lse, "token_major"))
    assert torch.equal(o, torch.zeros_like(o))
    empty = q[:0]
    out = av.varlen_prefill_attention(empty, k[:0], v[:0], k_cache, v_cache, cu, ctx, blocks, backend="reference")
    assert out.shape == empty.shape


def test_context_merge_never_syncs(monkeypatch):
    """No op that syncs with the host or sizes its output from data (CUDA graph capture), and no Python-level
    read of a tensor's value: the launch reads static sizes only."""
    case = CASES[0]
    q, k, v, k_cache, v_cache, cu, ctx, blocks = inputs(case, torch.bfloat16, spare=2)
    o_new, lse = av.new_tokens_attention_ref(q.float(), k.float(), v.float(), cu)
    o, lse = o_new.to(torch.bfloat16), lse.unsqueeze(-1).contiguous()
    layout = av.lse_layout(lse, "token_major")
    _forbid_python_syncs(monkeypatch)
    with _NoHostSync():
        av.context_merge(q, k_cache, v_cache, cu, ctx, blocks, o, lse, layout)


def test_bad_backend_and_layout_are_refused():
    case = CASES[0]
    args = inputs(case, torch.bfloat16, spare=0)
    for removed in ("flash3", "cudnn", "cudnn_varlen", "fa2_paged"):  # (the last three: removed backends)
        with pytest.raises(ValueError, match=f"unknown attention backend '{removed}'"):
            av.varlen_prefill_attention(*args, backend=removed)
    with pytest.raises(ValueError, match="unknown LSE layout"):
        av.lse_layout(torch.zeros(2, 2), "bhsd")


def test_lse_layouts_read_the_libraries_shapes():
    """Strides of the shapes each part (a) returns: the reference's [T, HQ, 1], cuDNN dense [1, HQ, T, 1],
    FlashAttention varlen [HQ, T] and its older [B, HQ, max_q]."""
    T, HQ = 10, 4
    assert av.lse_layout(torch.empty(T, HQ, 1), "token_major") == av.LseLayout(False, 0, 1, HQ)
    assert av.lse_layout(torch.empty(1, HQ, T, 1), "head_major") == av.LseLayout(False, 0, T, 1)
    assert av.lse_layout(torch.empty(HQ, T), "head_major") == av.LseLayout(False, 0, T, 1)
    assert av.lse_layout(torch.empty(3, HQ, 8), "padded") == av.LseLayout(True, HQ * 8, 8, 1)
    assert [av.context_queries(g) for g in (1, 2, 3, 4, 128)] == [(64, 64), (32, 64), (21, 64), (16, 64),
                                                                  (1, 128)]


_SM90_COMPILE = r"""
import importlib
import triton
from triton.backends.compiler import GPUTarget
av = importlib.import_module("metrale_graph.ops.attention_varlen")
target = GPUTarget("cuda", 90, 32)
backend = triton.compiler.make_backend(target)
fn = av._context_merge_kernel
B16, F32, I = "*bf16", "*fp32", "*i32"
types = {n: B16 if n in ("q_ptr", "k_cache", "v_cache", "o_ptr") else F32 if n == "lse_ptr"
         else I if n.endswith("_ptr") else "i32" for n in fn.arg_names}
types["qk_scale"] = types["lse_to_log2"] = "fp32"
smem = []
for HD, group in ((256, 4), (128, 3), (80, 2)):
    BLOCK_D = triton.next_power_of_2(HD)
    BN, warps, stages = av.context_config(BLOCK_D)
    _, BLOCK_M = av.context_queries(group)
    for padded in (False, True):
        consts = dict(BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BN=BN, CH=av.STREAM_CHUNK, LSE_PADDED=padded, IEEE=False)
        sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
        src = triton.compiler.ASTSource(fn=fn, constexprs=consts, signature=sig)
        opts = backend.parse_options({"num_warps": warps, "num_stages": stages})
        smem.append(triton.compile(src, target=target, options=opts.__dict__).metadata.shared)
assert max(smem) <= 232448, smem  # an H100 / H200 block's shared memory
print("compiled", smem)
"""


def test_context_kernel_compiles_for_sm90():
    """The context + merge kernel at its configs for head dims 256 / 128 / 80 through Triton's real compiler
    for sm_90 (PTX and ptxas, no GPU needed): the interpreter accepts what the compiler rejects."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


# metrale::paged_attention's CUDA path: which attention each call takes ----------------------------------
pa = importlib.import_module("metrale_graph.ops.paged_attention")


def test_prefill_backend_follows_static_facts(monkeypatch):
    """One stream at a measured head dim on sm_90: cuDNN's dense kernel; several streams, other head dims,
    sm_80: FlashAttention-2 varlen; what the libraries do not take (fp32, CPU tensors): our Triton kernel."""
    q256, q96 = torch.empty(8, 4, 256, dtype=torch.bfloat16), torch.empty(8, 4, 96, dtype=torch.bfloat16)
    assert pa.prefill_backend(q256, 1) == "triton"  # CPU tensors: no library kernel
    monkeypatch.setattr(pa, "library_prefill_supported", lambda q: q.dtype != torch.float32)
    monkeypatch.setattr(pa, "device_capability", lambda device: (9, 0))
    assert pa.prefill_backend(q256, 1) == "cudnn_fa2" and pa.prefill_backend(q256[..., :128], 1) == "cudnn_fa2"
    assert pa.prefill_backend(q256, 2) == "fa2" and pa.prefill_backend(q96, 1) == "fa2"
    assert pa.prefill_backend(q256.float(), 1) == "triton"
    monkeypatch.setattr(pa, "device_capability", lambda device: (8, 0))
    assert pa.prefill_backend(q256, 1) == "fa2"
    assert not hasattr(pa, "PREFILL_BACKEND")  # the environment's choice of backend was removed


ONE_STREAM = Shapes(lengths=(65,), context=(130,), HQ=4, HKV=2, HD=128, BS=16, num_blocks=13)


@pytest.mark.parametrize("case, dtype, expected", [
    (ONE_STREAM, torch.bfloat16, ["cudnn_dense"]),
    (CASES[0], torch.bfloat16, ["fa2_varlen"]),
    (Shapes(lengths=(1, 1, 0), context=(40, 3, 0), HQ=4, HKV=2, HD=128, BS=16), torch.bfloat16, []),  # decode
    (ONE_STREAM, torch.float32, []),
], ids=["one-stream", "streams", "decode-shaped", "fp32"])
def test_op_cuda_path_dispatches_to_the_libraries(case, dtype, expected, monkeypatch):
    """paged_attention_cuda with the libraries faked (FakeLibraries) as if on an sm_90 GPU: the KV write, then
    cuDNN dense for one stream, FlashAttention-2 for several, split-K for decode-shaped calls and Triton for
    fp32; the op's output and pools either way (spare rows 0 on the library path)."""
    fake = FakeLibraries()
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", fake.cudnn_dense)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", fake.fa2_varlen)
    monkeypatch.setattr(pa, "library_prefill_supported", lambda q: q.dtype in (torch.bfloat16, torch.float16))
    monkeypatch.setattr(pa, "device_capability", lambda device: (9, 0))
    spare = 0 if expected == [] else 3
    args = list(inputs(case, dtype, spare=spare, seed=9))
    ref_args = upcast([a.clone() for a in args])
    ref = paged_attention_ref(*ref_args)
    out = pa.paged_attention_cuda(*args)
    assert [c[0] for c in fake.calls] == expected
    assert_close("o", ref[: case.T], out[: case.T].float(), TOL[dtype])
    if spare:
        assert torch.equal(out[case.T:], torch.zeros_like(out[case.T:]))
    for i in (3, 4):  # the new tokens written into the pools
        assert_close(f"pool {i}", ref_args[i], args[i].float(), TOL[dtype])

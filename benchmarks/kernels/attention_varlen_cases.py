"""check_attention_varlen.py's cases and what they share: the attention dims, implementations, batches and
timing shapes; a case's inputs (`build`: metrale::paged_attention's arguments with the new tokens in the pools),
the reference and an implementation's call; the errors compared; and how a case is recorded (`emit`, into the
section's JSON file `_PART`, which the section's process sets).
"""

from __future__ import annotations

import json
import os
import traceback

import torch

from metrale_graph.tools.files import write_whole

DIMS = {"9b": (16, 4, 256), "odd128": (6, 2, 128), "hd80": (4, 1, 80)}  # HQ, HKV, HD
IMPLS = ("fa2", "cudnn_fa2", "triton")
BATCHES = {  # lengths, contexts, spare tokens, spare rows NaN
    "fresh": ([700, 1, 0, 333, 64, 0, 0], [0] * 7, 37, False),
    "context": ([300, 129, 1, 0, 517, 0], [2048, 0, 65, 0, 130, 0], 11, False),
    "context_nan_spare": ([300, 129, 1, 0, 517, 0], [2048, 0, 65, 0, 130, 0], 11, True),
    "one_stream": ([1000], [0], 24, False),
    "one_stream_context": ([777], [1500], 0, False),
    "small_T": ([40, 30, 30], [10, 0, 3], 0, False),
}
ODD_DIMS_BATCHES = ("fresh", "context", "one_stream", "small_T")
TIMING_SHAPES = {"1x16384": ([16384], [0]), "1x8192": ([8192], [0]), "8x2048": ([2048] * 8, [0] * 8),
                 "8x512": ([512] * 8, [0] * 8), "4x512+2048": ([512] * 4, [2048] * 4)}
SWEEP_SHAPE = "4x512+2048"  # where the context kernel's configs are swept (the shape with context)
PROFILE_SHAPES = ("8x512", "4x512+2048")  # where each implementation's kernel names are recorded
TOL = 1e-2  # bf16, relative norm error (docs: each op against its reference on upcast inputs)
LOG2E = 1.4426950408889634
DEVICE = "cuda"


def err_text(e: BaseException) -> str:
    """The exception and where it was raised (innermost frame)."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} {frames[-1].name})" if frames else ""
    return f"{type(e).__name__}: {e}"[:600] + where


_PART = None  # a section process's JSON file, rewritten after every case (a timeout keeps what was done)


def emit(out: dict, rows: list, rec: dict) -> None:
    """Record one case: into the section's rows, as a JSON line, and into the section's file."""
    rows.append(rec)
    print(json.dumps(rec), flush=True)
    if _PART:
        write_whole(_PART, json.dumps(out, default=str))


# inputs ------------------------------------------------------------------------------------------------
def build(lengths, contexts, HQ, HKV, HD, BS=64, spare=0, seed=0, spare_nan=False, blocks_per_stream=None):
    """metrale::paged_attention's arguments (bf16, on the GPU) with the new tokens already in the pools (as
    the op's KV write leaves them); padding streams (no tokens, no context) on the null block."""
    dev, dt = DEVICE, torch.bfloat16
    B, n = len(lengths), sum(lengths)
    T = n + spare
    MB = blocks_per_stream or max(1, max(-(-(c + length) // BS) for c, length in zip(contexts, lengths)))
    NB = B * MB
    g = torch.Generator(device=dev).manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, device=dev).to(dt)

    q, k, v = r(T, HQ, HD), r(T, HKV, HD), r(T, HKV, HD)
    k_cache, v_cache = r(NB + 1, BS, HKV, HD), r(NB + 1, BS, HKV, HD)
    bt = torch.randperm(NB, generator=g, device=dev).view(B, MB).to(torch.int32)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    ctx = torch.tensor(contexts, dtype=torch.int32, device=dev)
    for b, (length, c) in enumerate(zip(lengths, contexts)):
        if length == 0 and c == 0:
            bt[b] = NB
        s = int(cu[b])
        pos = torch.arange(c, c + length, device=dev)
        blk = bt[b].long()[pos // BS]
        k_cache[blk, pos % BS] = k[s:s + length]
        v_cache[blk, pos % BS] = v[s:s + length]
    if spare_nan and spare:
        for x in (q, k, v):
            x[n:] = float("nan")
    return dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, cu=cu, ctx=ctx, bt=bt, n=n)


def args_of(c):
    return c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], c["cu"], c["ctx"], c["bt"]


def reference(c):
    from metrale_graph.ops import REGISTRY

    q, k, v, kc, vc, cu, ctx, bt = args_of(c)
    return REGISTRY["paged_attention"].reference(q.float(), k.float(), v.float(), kc.float(), vc.float(), cu, ctx, bt)


def implementation(name):
    from metrale_graph.ops import attention_varlen as av
    from metrale_graph.ops import paged_attention as pa

    if name == "triton":  # the KV write again (the pools hold the new tokens already), then the Triton kernel
        return lambda *a: pa.paged_attention_triton(*a, decode=False)
    return lambda *a: av.varlen_prefill_attention(*a, backend=name)


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm()) if ref.numel() and ref.norm() > 0 else 0.0


def compare(out, ref, n):
    """Errors of o's first n rows (the streams' tokens) and the state of its spare rows."""
    real = out[:n].float()
    spare = out[n:]
    return dict(rel_err=rel_err(real, ref[:n]), max_abs=float((real - ref[:n]).abs().max()) if n else 0.0,
                finite=bool(torch.isfinite(real).all()), spare_finite=bool(torch.isfinite(spare).all()),
                spare_zero=bool((spare == 0).all()))

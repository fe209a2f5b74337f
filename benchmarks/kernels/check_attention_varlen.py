"""GPU check of ops/attention_varlen (issue 24's attention lever), one run: what the library kernels return,
whether every implementation is exact, capture-safe and how fast, against metrale::paged_attention's
reference and its Triton fallback.

Sections, each in its own process (a CUDA fault in one loses only that one), each case in its own try:
  probe        raw cuDNN dense and FlashAttention-2 varlen calls on a ragged batch with zero-length
               streams inside and at the tail and spare tokens: output error, the log-sum-exp's shape,
               strides and units (which reading matches the reference), NaN in spare rows, spare tokens
               as an extra sequence instead
  correctness  every implementation against the reference (fp32 on upcast inputs) at 9B attention dims
               (HQ 16, HKV 4, HD 256) and odd ones (6 / 2 / 128, 4 / 1 / 80), batches with and without
               context, zero-length streams, spare tokens (also NaN-filled), a one-stream bucket, T < 129
  capture      CUDA graphs captured at buckets (4 streams, 2048 tokens) and (1, 2048), replayed with other
               lengths, contexts and zero-length padding streams: replay against eager and the reference
  timing       TFLOP/s (graph replay and eager) at 1 x 16384, 1 x 8192, 8 x 2048, 8 x 512 and 4 x 512 new
               after 2048 cached each; the library call alone; a sweep of the context kernel's configs at the
               last shape; the CUDA kernels each implementation launches (profile names)
Implementations (attention_varlen's backends): fa2, cudnn_fa2 (one-stream buckets cuDNN dense, else fa2);
triton: the op's 64-row Triton kernel, its fallback where the libraries do not take a call. (Its first run,
benchmarks/h200-attention-varlen-ops.json, also had cuDNN varlen, which failed under capture, and
FlashAttention over the pools, which torch 2.11 cannot run: both removed.)

    python benchmarks/kernels/check_attention_varlen.py --json $OUT/attention_varlen.json    (after: pip install -e .)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch

from metrale_graph.tools.files import write_whole
from metrale_graph.tools.flags import output_file, positive_int
from metrale_graph.tools.provenance import provenance
from metrale_graph.tools.report import print_json, print_table

SECTIONS = ("probe", "correctness", "capture", "timing")
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


# sections ----------------------------------------------------------------------------------------------
def section_probe(out):
    from metrale_graph.ops import attention_varlen as av

    lengths, spare = [300, 0, 517, 129, 0], 40
    calls = {"fa2_varlen": lambda q, k, v, cu: av._fa2_varlen(q, k, v, cu),
             "cudnn_dense_one_stream": lambda q, k, v, cu: av._cudnn_dense(q, k, v)}
    rows = out.setdefault("probe", [])
    for dims in ("9b", "odd128"):
        HQ, HKV, HD = DIMS[dims]
        for name, call in calls.items():
            for variant in ("as_packed", "nan_spare", "extra_sequence"):
                rec = dict(dims=dims, call=name, variant=variant)
                try:
                    ls = [517] if name.endswith("one_stream") else lengths
                    if variant == "extra_sequence" and name.endswith("one_stream"):
                        continue
                    c = build(ls, [0] * len(ls), HQ, HKV, HD, spare=spare, seed=1, spare_nan=variant == "nan_spare")
                    q, k, v, cu, n = c["q"], c["k"], c["v"], c["cu"], c["n"]
                    T = q.shape[0]
                    if variant == "extra_sequence":  # the spare tokens as one more stream
                        cu = torch.cat([cu, torch.tensor([T], dtype=torch.int32, device=cu.device)])
                    o, lse, kind = call(q, k, v, cu)
                    torch.cuda.synchronize()
                    o_ref, lse_ref = av.new_tokens_attention_ref(q[:n].float(), k[:n].float(), v[:n].float(), cu[:len(ls) + 1])
                    rec.update(o_shape=list(o.shape), o_stride=list(o.stride()), lse_shape=list(lse.shape),
                               lse_stride=list(lse.stride()), lse_dtype=str(lse.dtype), kind_assumed=kind,
                               **{f"o_{k_}": v_ for k_, v_ in compare(o, o_ref, n).items()})
                    readings = {}
                    if lse.numel() >= T * HQ:
                        flat = lse.reshape(-1)[: T * HQ] if lse.is_contiguous() else lse.contiguous().reshape(-1)[: T * HQ]
                        for lay, view in (("token_major", flat.view(T, HQ)), ("head_major", flat.view(HQ, T).t())):
                            for units, scale in (("ln", 1.0), ("log2", LOG2E)):
                                d = (view[:n] - lse_ref * scale).abs()
                                readings[f"{lay}/{units}"] = float(d.max()) if n else 0.0
                    rec["lse_max_abs_err"] = readings
                    rec["lse_reading"] = min(readings, key=readings.get) if readings else None
                    layout = av.lse_layout(lse, kind)
                    rec["layout_ok"] = _layout_matches(lse, layout, lse_ref, cu, n)
                except Exception as e:  # noqa: BLE001 - every case reports, none stops the run
                    rec["error"] = err_text(e)
                emit(out, rows, rec)
    table = [[r["dims"], r["call"], r["variant"], r.get("o_rel_err", "-"), r.get("o_finite", "-"),
              r.get("lse_shape", "-"), r.get("lse_reading", "-"), r.get("layout_ok", "-"), r.get("error", "")[:80]]
             for r in rows]
    print_table(["dims", "call", "variant", "o rel err", "o finite", "lse shape", "lse best reading",
                 "our layout ok", "error"], table)


def _layout_matches(lse, layout, lse_ref, cu, n):
    """Max abs error of lse read where attention_varlen's LseLayout says (in natural-log units) against the
    reference, over the streams' rows."""
    if n == 0:
        return 0.0
    rows = torch.arange(n, device=lse.device)
    stream = torch.searchsorted(cu[1:].long(), rows, right=True)
    i = rows - cu.long()[stream] if layout.padded else rows
    heads = torch.arange(lse_ref.shape[1], device=lse.device)
    idx = heads[None, :] * layout.stride_h + i[:, None] * layout.stride_t
    if layout.padded:
        idx = idx + stream[:, None] * layout.stride_b
    flat = lse.as_strided((int(idx.max()) + 1,), (1,))  # from lse's first element, as the kernel reads it
    return float((flat[idx] * (layout.to_log2 / LOG2E) - lse_ref[:n]).abs().max())


def section_correctness(out):
    rows = out.setdefault("correctness", [])
    refs = {}
    for dims, (HQ, HKV, HD) in DIMS.items():
        for batch, (lengths, contexts, spare, nan) in BATCHES.items():
            if dims != "9b" and batch not in ODD_DIMS_BATCHES:
                continue
            for impl in IMPLS:
                BS = 64
                rec = dict(impl=impl, dims=dims, batch=batch, BS=BS)
                skip = None
                if impl == "triton" and dims != "9b":
                    skip = "odd dims: tests/test_gpu_ops.py covers it (and its autotuning costs ~20 s a shape)"
                if skip:
                    rec["skipped"] = skip
                    emit(out, rows, rec)
                    continue
                try:
                    c = build(lengths, contexts, HQ, HKV, HD, BS=BS, spare=spare, seed=2, spare_nan=nan)
                    key = (dims, batch, BS)
                    if key not in refs:
                        refs[key] = reference(c)
                    pools = c["k_cache"].clone(), c["v_cache"].clone()
                    o = implementation(impl)(*args_of(c))
                    torch.cuda.synchronize()
                    rec.update(compare(o, refs[key], c["n"]))
                    rec["pools_unchanged"] = bool(torch.equal(pools[0], c["k_cache"]) and torch.equal(pools[1], c["v_cache"]))
                    rec["ok"] = rec["rel_err"] <= TOL and rec["finite"] and rec["spare_finite"] and rec["pools_unchanged"]
                except Exception as e:  # noqa: BLE001
                    rec["error"] = err_text(e)
                    rec["ok"] = False
                emit(out, rows, rec)
    print_table(["impl", "dims", "batch", "ok", "rel err", "max abs", "spare finite", "spare 0", "error / skipped"],
                [[r["impl"], r["dims"], r["batch"], r.get("ok", "-"), f"{r['rel_err']:.2e}" if "rel_err" in r else "-",
                  f"{r['max_abs']:.2e}" if "max_abs" in r else "-", r.get("spare_finite", "-"), r.get("spare_zero", "-"),
                  (r.get("error") or r.get("skipped") or "")[:90]] for r in rows])


CAPTURE_BUCKETS = {  # (streams, tokens): batches of lengths, contexts (the first one captured; the rest spare)
    (4, 2048): {"captured": ([1000, 500, 300, 200], [0, 700, 64, 0]),
                "two_padding_streams": ([1200, 600, 0, 0], [300, 0, 0, 0]),
                "one_full_stream": ([2048, 0, 0, 0], [100, 0, 0, 0]),
                "tiny_streams": ([5, 7, 3, 1], [0, 0, 2000, 1]),
                "all_padding": ([0, 0, 0, 0], [0, 0, 0, 0])},
    (1, 2048): {"captured": ([2000], [0]), "shorter_with_context": ([1500], [500]), "full": ([2048], [30]),
                "padding": ([0], [0])},
}
MAX_CONTEXT = 2048


def section_capture(out):
    HQ, HKV, HD = DIMS["9b"]
    rows = out.setdefault("capture", [])
    for (B, T), batches in CAPTURE_BUCKETS.items():
        for impl in IMPLS:
            _capture_one(out, rows, impl, B, T, batches, HQ, HKV, HD)
    print_table(["impl", "bucket", "batch", "ok", "replay-eager max abs", "bitwise", "replays equal",
                 "rel err vs ref", "spare 0", "error"],
                [[r["impl"], r["bucket"], r.get("batch", "-"), r.get("ok", "-"), r.get("replay_vs_eager_max_abs", "-"),
                  r.get("replay_bitwise_eager", "-"), r.get("replays_equal", "-"),
                  f"{r['rel_err']:.2e}" if "rel_err" in r else "-", r.get("spare_zero", "-"),
                  (r.get("error") or r.get("skipped") or "")[:90]] for r in rows])


def _capture_one(out, rows, impl, B, T, batches, HQ, HKV, HD):
    """Capture `impl` at bucket (B, T) on the first batch, replay it filled with each batch in turn."""
    BS = 64
    bucket = f"{B}x{T}"
    MB = -(-(T + MAX_CONTEXT) // BS)
    cases = {name: build(lens, c, HQ, HKV, HD, BS=BS, spare=T - sum(lens), seed=3 + i, blocks_per_stream=MB)
             for i, (name, (lens, c)) in enumerate(batches.items())}
    static = {k: v.clone() for k, v in cases["captured"].items() if isinstance(v, torch.Tensor)}
    fn = implementation(impl)

    def call():
        return fn(*args_of(static))

    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm up off the capture: compiles, cuDNN plans and handles
                call()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_static = call()
    except Exception as e:  # noqa: BLE001
        return emit(out, rows, dict(impl=impl, bucket=bucket, batch="capture", error=err_text(e), ok=False))
    for name, c in cases.items():
        rec = dict(impl=impl, bucket=bucket, batch=name)
        try:
            for k_, v_ in static.items():
                v_.copy_(c[k_])
            graph.replay()
            torch.cuda.synchronize()
            replayed = o_static.clone()
            graph.replay()
            torch.cuda.synchronize()
            again = o_static.clone()
            eager = call()
            torch.cuda.synchronize()
            n = c["n"]
            diff = float((replayed[:n].float() - eager[:n].float()).abs().max()) if n else 0.0
            rec.update(replay_vs_eager_max_abs=diff, replay_bitwise_eager=bool(torch.equal(replayed[:n], eager[:n])),
                       replays_equal=bool(torch.equal(replayed, again)))
            rec.update(compare(replayed, reference(c), n))
            rec["ok"] = rec["rel_err"] <= TOL and rec["finite"] and rec["spare_finite"] and diff <= 1e-2
        except Exception as e:  # noqa: BLE001
            rec["error"] = err_text(e)
            rec["ok"] = False
        emit(out, rows, rec)
    del graph, o_static
    torch.cuda.empty_cache()


def pairs(lengths, contexts):
    return sum(n * c + n * (n + 1) / 2 for n, c in zip(lengths, contexts))


def section_timing(out):
    import triton.testing

    from metrale_graph.ops import attention_varlen as av

    HQ, HKV, HD = DIMS["9b"]
    rows = out.setdefault("timing", [])
    kernels = out.setdefault("kernels", {})
    sweep = out.setdefault("context_config_sweep", [])

    def library_only(backend, c):
        q, k, v, cu = c["q"], c["k"], c["v"], c["cu"]
        if backend == "cudnn":  # its dense kernel: one stream
            return lambda: av._cudnn_dense(q, k, v)
        return lambda: av._fa2_varlen(q, k, v, cu)

    def sdpa_cudnn(c):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = (x.unsqueeze(0).transpose(1, 2) for x in (c["q"], c["k"], c["v"]))

        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return run

    for shape, (lengths, contexts) in TIMING_SHAPES.items():
        flops = 4 * HQ * HD * pairs(lengths, contexts)
        cases = {}
        for impl in IMPLS + ("cudnn (a) only", "fa2 (a) only", "sdpa cudnn dense"):
            BS = 64
            rec = dict(impl=impl, shape=shape)
            skip = None
            if impl in ("sdpa cudnn dense", "cudnn (a) only") and len(lengths) > 1:
                skip = "one stream only"
            if skip:
                rec["skipped"] = skip
                emit(out, rows, rec)
                continue
            try:
                if BS not in cases:
                    cases[BS] = build(lengths, contexts, HQ, HKV, HD, BS=BS, seed=5)
                c = cases[BS]
                if impl in IMPLS:
                    fn = implementation(impl)
                    def call(fn=fn, c=c):
                        return fn(*args_of(c))
                elif impl == "sdpa cudnn dense":
                    call = sdpa_cudnn(c)
                else:
                    call = library_only(impl.split()[0], c)
                call()
                torch.cuda.synchronize()
                eager = triton.testing.do_bench(call, warmup=5, rep=30, return_mode="median")
                with torch.cuda.stream(torch.cuda.Stream()):
                    graph = triton.testing.do_bench_cudagraph(call, rep=60, return_mode="median")
                rec.update(graph_ms=round(graph, 4), eager_ms=round(eager, 4), tflops=round(flops / graph / 1e9, 1),
                           eager_tflops=round(flops / eager / 1e9, 1))
            except Exception as e:  # noqa: BLE001
                rec["error"] = err_text(e)
            if shape in PROFILE_SHAPES and impl in IMPLS and "error" not in rec:
                try:
                    kernels[f"{impl} {shape}"] = _kernel_names(call)
                except Exception as e:  # noqa: BLE001
                    kernels[f"{impl} {shape}"] = [(err_text(e), 0.0)]
            emit(out, rows, rec)
        if shape == SWEEP_SHAPE:
            _sweep_context_configs(out, sweep, cases.get(64) or build(lengths, contexts, HQ, HKV, HD, seed=5))
        del cases
        torch.cuda.empty_cache()
    print_table(["impl", "shape", "graph ms", "TFLOP/s", "eager ms", "eager TFLOP/s", "error / skipped"],
                [[r["impl"], r["shape"], r.get("graph_ms", "-"), r.get("tflops", "-"), r.get("eager_ms", "-"),
                  r.get("eager_tflops", "-"), (r.get("error") or r.get("skipped") or "")[:90]] for r in rows])
    print(f"\ncontext + merge kernel alone at {SWEEP_SHAPE} (the default config marked *):")
    print_table(["BN", "warps", "stages", "graph ms", "TFLOP/s (context part)", "error"],
                [[r["config"][0], r["config"][1], r["config"][2], f"{r.get('graph_ms', '-')}{'*' if r['default'] else ''}",
                  r.get("tflops", "-"), r.get("error", "")[:80]] for r in sweep])
    for name, ks in kernels.items():
        print(f"{name}: " + "; ".join(f"{k} {us:.0f} us" for k, us in ks[:6]))


def _kernel_names(call):
    """(name, device us) of the CUDA kernels one call launches, the longest first."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    found = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            found[e.name] = found.get(e.name, 0.0) + getattr(e, "device_time_total", 0.0)
    return sorted(found.items(), key=lambda kv: -kv[1])


def _sweep_context_configs(out, rows, c):
    import triton
    import triton.testing

    from metrale_graph.ops import attention_varlen as av

    q, k, v, kc, vc, cu, ctx, bt = args_of(c)
    o, lse, kind = av._fa2_varlen(q, k, v, cu)
    layout = av.lse_layout(lse, kind)
    default = av.context_config(triton.next_power_of_2(q.shape[2]))
    HQ, HD = q.shape[1], q.shape[2]
    flops = 4 * HQ * HD * sum(int(n) * int(x) for n, x in zip((cu[1:] - cu[:-1]).tolist(), ctx.tolist()))
    for config in ((32, 4, 2), (32, 4, 3), (32, 8, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (64, 8, 3), (128, 8, 1)):
        rec = dict(config=list(config), default=config == default)
        try:
            work = o.clone()

            def call(work=work, config=config):
                return av.context_merge(q, kc, vc, cu, ctx, bt, work, lse, layout, config=config)

            call()
            torch.cuda.synchronize()
            with torch.cuda.stream(torch.cuda.Stream()):
                ms = triton.testing.do_bench_cudagraph(call, rep=40, return_mode="median")
            rec.update(graph_ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
        except Exception as e:  # noqa: BLE001
            rec["error"] = err_text(e)
        emit(out, rows, rec)


def environment():
    import triton

    env = dict(torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
               triton=triton.__version__, device=torch.cuda.get_device_name(),
               capability=list(torch.cuda.get_device_capability()))
    for op in ("_cudnn_attention_forward", "_flash_attention_forward", "_scaled_dot_product_cudnn_attention"):
        try:
            env[op] = str(getattr(torch.ops.aten, op).default._schema)
        except Exception as e:  # noqa: BLE001
            env[op] = err_text(e)
    return env


RUNNERS = {"probe": section_probe, "correctness": section_correctness, "capture": section_capture,
           "timing": section_timing}


def run_section(name: str, path: str) -> None:
    global _PART
    _PART = path
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference's einsums exact
    out = {"section": name, "env": environment()}
    start = time.time()
    try:
        RUNNERS[name](out)
    except Exception as e:  # noqa: BLE001
        out["error"] = err_text(e)
    out["seconds"] = round(time.time() - start, 1)
    write_whole(path, json.dumps(out, default=str))


def summarize(record: dict) -> None:
    """Per implementation: cases passed in correctness and capture, and graph TFLOP/s per timing shape."""
    secs = record["sections"]
    names = list(IMPLS) + ["cudnn (a) only", "fa2 (a) only", "sdpa cudnn dense"]
    table = []
    for impl in names:
        row = [impl]
        for sec in ("correctness", "capture"):
            rs = [r for r in secs.get(sec, {}).get(sec, []) if r["impl"] == impl and "skipped" not in r]
            row.append(f"{sum(bool(r.get('ok')) for r in rs)}/{len(rs)}" if rs else "-")
        timing = {r["shape"]: r for r in secs.get("timing", {}).get("timing", []) if r["impl"] == impl}
        row += [timing.get(shape, {}).get("tflops", "-") for shape in TIMING_SHAPES]
        table.append(row)
    print("\n=== summary (correctness / capture: cases ok; timing: TFLOP/s, graph replay) ===")
    print_table(["impl", "correctness", "capture", *TIMING_SHAPES], table)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/kernels/check_attention_varlen.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=output_file, default=None, help="write the whole record (every section) here")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default all)")
    p.add_argument("--timeout", type=positive_int, default=200, help="seconds one section may take (default 200)")
    p.add_argument("--budget", type=positive_int, default=540,
                   help="seconds for all sections together (default 540); a section gets what is left of it")
    p.add_argument("--section", choices=SECTIONS, default=None, help=argparse.SUPPRESS)  # a child process's one
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # where the child writes its JSON
    args = p.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        p.error(f"--sections: unknown {', '.join(bad)}; expected some of {', '.join(SECTIONS)}")
    if not torch.cuda.is_available():
        p.exit(1, f"{p.prog}: error: this check needs a CUDA GPU; torch sees none\n")
    if args.section:
        run_section(args.section, args.part)
        return
    record = {"tool": "check_attention_varlen", **provenance(), "sections": {}}
    began = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for name in sections:
            part = os.path.join(tmp, f"{name}.json")
            left = args.budget - (time.time() - began)
            if left < 20:
                record["sections"][name] = {"returncode": "not run: budget spent", "wall_s": 0.0}
                continue
            print(f"\n=== {name} ===", flush=True)
            start = time.time()
            try:
                run = subprocess.run([sys.executable, os.path.abspath(__file__),
                                      "--section", name, "--part", part], timeout=min(args.timeout, left))
                code = run.returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
            result = json.load(open(part)) if os.path.exists(part) else {}
            result.update(returncode=code, wall_s=round(time.time() - start, 1))
            record["sections"][name] = result
            if args.json:
                write_whole(args.json, json.dumps(record, indent=1, default=str))
    summarize(record)
    print_json({"tool": "check_attention_varlen", "sections": {n: {"returncode": r["returncode"], "wall_s": r["wall_s"],
                                                                   "error": r.get("error")}
                                                               for n, r in record["sections"].items()}})


if __name__ == "__main__":
    main()

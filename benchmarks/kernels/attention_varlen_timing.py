"""check_attention_varlen.py's timing section: TFLOP/s of every implementation in graph replay and eager at
the timing shapes, the library call alone, the CUDA kernels each launches (profile names) and a sweep of the
context kernel's configs.
"""

from __future__ import annotations

import torch

from metrale_graph.tools.report import print_table

from attention_varlen_cases import (DIMS, IMPLS, PROFILE_SHAPES, SWEEP_SHAPE, TIMING_SHAPES, args_of, build, emit,
                                    err_text, implementation)


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

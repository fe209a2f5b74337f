"""check_attention_varlen.py's checks of exactness: the probe of the raw library calls, every implementation
against the reference (correctness), and CUDA graphs captured at buckets and replayed (capture). Each case
is recorded whatever happens (attention_varlen_cases.emit).
"""

from __future__ import annotations

import torch

from metrale_graph.tools.report import print_table

from attention_varlen_cases import (BATCHES, DIMS, IMPLS, LOG2E, ODD_DIMS_BATCHES, TOL, args_of, build, compare, emit,
                                    err_text, implementation, reference)


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

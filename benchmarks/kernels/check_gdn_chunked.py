"""GPU check of our chunked gated delta rule (ops/gdn_chunked/) against flash-linear-attention 0.6.0:
correctness at the Qwen3.5-9B head shape (H 16, HV 32, K = V = 128, bf16) against fla and against the
fp32 token-by-token reference, checkpoints, exactness of CUDA graph replay with other stream lengths of
the same chunk count, per-layer times (triton.testing.do_bench medians, L2 flushed; plus CUDA graph
replay) of fla and of each config of a small sweep on the op's chunk-aligned layout, and the default
config's device time per call by kernel (kernel_split: the intra-chunk and state passes). Every case runs
in its own try/except, so one failure leaves the rest. Prints tables, ends with one JSON line, and
writes it to --json.

    . benchmarks/gpu_session.sh setup && python3 benchmarks/kernels/check_gdn_chunked.py --json "$OUT/gdn_chunked.json"
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

os.environ.setdefault("FLA_DISABLE_TENSOR_CACHE", "1")  # before fla is imported (its tensor cache breaks replay)

import torch  # noqa: E402

from metrale_graph.ops.gdn_chunked import (CHUNK, ChunkConfig, chunked_gdn_forward,  # noqa: E402
                                           chunked_gdn_reference, default_config)
from metrale_graph.tools.files import write_whole  # noqa: E402
from metrale_graph.tools.flags import non_negative_int, output_file  # noqa: E402
from metrale_graph.tools.provenance import provenance  # noqa: E402
from metrale_graph.tools.report import print_json, print_table  # noqa: E402
from measure import rel  # noqa: E402

H, HV, K, V = 16, 32, 128, 128  # Qwen3.5-9B GDN heads
DEVICE = "cuda"
SHAPES = [(8, 1024), (1, 8192), (1, 16384), (8, 512), (32, 128), (4, 2048)]  # (streams, tokens per stream)
# the best published H200 ms per layer at these shapes (FlashInfer at 8 x 1024 and 4 x 2048, FlashQLA otherwise)
PUBLISHED_MS = {(8, 1024): 0.119, (1, 8192): 0.28, (1, 16384): 0.47, (4, 2048): 0.11}
CONFIGS = {  # the sweep: state-pass tile / warps / stages, intra warps / stages, solve split; g2: two value heads a
    # state-pass program (ChunkConfig.heads: k and q loaded once for both, the dots G * BV columns wide)
    "bv16-w4s2": ChunkConfig(block_v=16), "bv32-w4s2": ChunkConfig(block_v=32),
    "bv64-w8s2": ChunkConfig(block_v=64, state_warps=8), "bv64-w4s2": ChunkConfig(block_v=64),
    "bv32-w4s3": ChunkConfig(block_v=32, state_stages=3), "bv16-w4s2-iw8": ChunkConfig(block_v=16, intra_warps=8),
    "bv16-w4s1": ChunkConfig(block_v=16, state_stages=1), "bv16-w4s2-sb8": ChunkConfig(block_v=16, solve_block=8),
    "bv16-w4s2-sb4": ChunkConfig(block_v=16, solve_block=4), "bv16-w4s2-g2": ChunkConfig(block_v=16, heads=2),
    "bv32-w4s2-g2": ChunkConfig(block_v=32, heads=2), "bv32-w8s2-g2": ChunkConfig(block_v=32, state_warps=8, heads=2),
}


def num_chunks(B: int, T: int) -> int:
    """The op's chunk count for B streams of T tokens in all: ceil(T / 64) + min(B, T // (short + 1)),
    short = 64 with several streams (those go to the recurrent kernel), 0 with one."""
    short = 64 if B > 1 else 0
    return -(-T // CHUNK) + min(B, T // (short + 1))


def layout(lengths: list[int], NT: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dest rows of the packed tokens, cu_aligned [B+2], chunk_indices [NT, 2]): each stream at a multiple
    of 64, the absorber taking the chunks left over, as the op lays them out."""
    counts = [-(-n // CHUNK) for n in lengths]
    if sum(counts) > NT:
        raise ValueError(f"lengths {lengths} need {sum(counts)} chunks, more than NT = {NT}")
    counts.append(NT - sum(counts))
    cu = torch.tensor([0] + counts).cumsum(0) * CHUNK
    dest = torch.cat([cu[b] + torch.arange(n) for b, n in enumerate(lengths)])
    rows = [(n, i) for n, c in enumerate(counts) for i in range(c)]
    return dest.to(device), cu.to(device), torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1, 2)


def inputs(lengths: list[int], NT: int, dtype, device, seed: int = 0, h0_scale: float = 0.1):
    """Aligned inputs of random streams (identity rows zero) and nonzero initial states (absorber: zero)."""
    g = torch.Generator(device=device).manual_seed(seed)
    dest, cu, idx = layout(lengths, NT, device)
    T, T_al = sum(lengths), NT * CHUNK

    def aligned(x):
        out = x.new_zeros((T_al,) + tuple(x.shape[1:]))
        out[dest] = x
        return out

    qk = torch.nn.functional.normalize(torch.randn(T, 2 * H, K, generator=g, device=device), dim=-1)
    q, k = aligned(qk[:, :H].to(dtype)), aligned(qk[:, H:].to(dtype))
    v = aligned(torch.randn(T, HV, V, generator=g, device=device).to(dtype))
    gate = aligned(torch.nn.functional.logsigmoid(torch.randn(T, HV, generator=g, device=device)) * 0.5)
    beta = aligned(torch.rand(T, HV, generator=g, device=device).to(dtype))
    h0 = torch.randn(len(lengths) + 1, HV, K, V, generator=g, device=device) * h0_scale
    h0[-1] = 0
    return q, k, v, gate, beta, cu, idx, h0


_fla_fwd = None


def fla_varlen(q, k, v, g, beta, cu_aligned, chunk_indices, h0):
    """fla 0.6.0's chunked forward below its autograd wrapper (as the op calls it)."""
    global _fla_fwd
    if _fla_fwd is None:
        import fla.utils
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

        fla.utils.FLA_DISABLE_TENSOR_CACHE = True
        _fla_fwd = chunk_gated_delta_rule_fwd
    _, o, _, final, _, _ = _fla_fwd(q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None],
                                    scale=q.shape[-1] ** -0.5, initial_state=h0, output_final_state=True,
                                    cu_seqlens=cu_aligned, chunk_indices=chunk_indices)
    return o[0], final


def _warm(job: tuple[str, int, str]) -> str:
    """One compile job in a worker process: (config name, "default", or "fla"; checkpoints P; dtype name).
    Triton caches what it compiles on disk, so the main process then loads instead of compiling."""
    name, P, dtype_name = job
    try:
        dtype = getattr(torch, dtype_name)
        NT = num_chunks(2, 130)
        args = inputs([100, 30], NT, dtype, DEVICE, seed=0)
        if name == "fla":
            fla_varlen(*args)
        else:
            ck = {} if not P else {"checkpoint_chunks": torch.full((P,), -1, dtype=torch.int64, device=DEVICE),
                                   "checkpoints": torch.zeros(P, HV, K, V, device=DEVICE)}
            chunked_gdn_forward(*args, config=CONFIGS.get(name), **ck)
        torch.cuda.synchronize()
        return f"{name} P{P} {dtype_name}: ok"
    except Exception as e:  # noqa: BLE001 (the main process reports the failure in its own case)
        return f"{name} P{P} {dtype_name}: {type(e).__name__}: {e}"


def precompile(names: list[str], jobs: int) -> None:
    """Compile every kernel variant the checks and the sweep use, `jobs` processes at a time."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    work = [("fla", 0, "bfloat16")] + [(n, 0, "bfloat16") for n in names]
    work += [("bv64-w8s2", 8, "bfloat16"), ("bv32-w4s2", 8, "bfloat16"), ("bv32-w4s2", 3, "bfloat16"),
             ("bv64-w8s2", 3, "bfloat16"), ("bv64-w8s2", 0, "float32"), ("bv64-w8s2", 8, "float32")]
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        for line in pool.map(_warm, work):
            print(f"  compiled {line}", flush=True)


class Report:
    """Cases that run in their own try/except; their results (or errors) under one record."""

    def __init__(self):
        self.record: dict = {"provenance": provenance(), "device": torch.cuda.get_device_name(), "cases": {}}
        self.t0 = time.time()

    def case(self, name: str, fn) -> None:
        start = time.time()
        try:
            result = fn()
            self.record["cases"][name] = {"ok": True, **(result or {})}
        except Exception as e:  # noqa: BLE001 (a failing case must not stop the others)
            traceback.print_exc()
            self.record["cases"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(f"[{time.time() - self.t0:6.1f}s] {name}: {time.time() - start:.1f}s "
              f"{'ok' if self.record['cases'][name]['ok'] else 'FAILED'}", flush=True)


def check_reference(dtype) -> dict:
    """Small ragged batch at the 9B head shape: ours and fla against the fp32 token-by-token reference."""
    lengths = [1, 63, 64, 65, 130, 300]
    NT = num_chunks(len(lengths), sum(lengths))
    args = inputs(lengths, NT, dtype, DEVICE, seed=1)
    o_ref, final_ref, starts = chunked_gdn_reference(*[a.float() if a.is_floating_point() else a for a in args[:6]],
                                                     args[7])
    o, final = chunked_gdn_forward(*args)
    out = {"ours_o": rel(o, o_ref), "ours_final": rel(final, final_ref)}
    if dtype != torch.float32:
        o_f, final_f = fla_varlen(*args)
        out.update(fla_o=rel(o_f, o_ref), fla_final=rel(final_f, final_ref))
    # checkpoints at the start of some chunks (first chunks, middle ones, the absorber's), none, twice, past NT
    chunks = torch.tensor([0, 3, 5, 6, -1, 6, NT - 1, NT + 5], dtype=torch.int64, device=DEVICE)
    poison = torch.full((chunks.shape[0], HV, K, V), 7.0, device=DEVICE)
    ckpt = poison.clone()
    chunked_gdn_forward(*args, checkpoint_chunks=chunks, checkpoints=ckpt)
    errs = [rel(ckpt[p], starts[c]) for p, c in enumerate(chunks.tolist()) if 0 <= c < NT and starts[c].norm() > 0]
    untouched = all(torch.equal(ckpt[p], poison[p]) for p, c in enumerate(chunks.tolist()) if not 0 <= c < NT)
    out.update(checkpoint_max=max(errs), checkpoints_none_untouched=untouched)
    tol = 1e-2 if dtype != torch.float32 else 1e-4
    out["pass"] = bool(max(out["ours_o"], out["ours_final"], out["checkpoint_max"]) <= tol and untouched)
    return out


def check_against_fla(lengths: list[int]) -> dict:
    """Ours against fla at the 9B head shape, bf16, a larger ragged batch (no fp32 reference: too slow)."""
    NT = num_chunks(len(lengths), sum(lengths))
    args = inputs(lengths, NT, torch.bfloat16, DEVICE, seed=2)
    o, final = chunked_gdn_forward(*args)
    o_f, final_f = fla_varlen(*args)
    out = {"o_vs_fla": rel(o, o_f), "final_vs_fla": rel(final, final_f),
           "finite": bool(torch.isfinite(o).all() and torch.isfinite(final).all())}
    out["pass"] = bool(out["finite"] and out["o_vs_fla"] <= 1e-2 and out["final_vs_fla"] <= 1e-2)
    return out


def check_graph_replay(config: ChunkConfig | None) -> dict:
    """Capture with one set of stream lengths, replay with others of the same chunk count: replay == eager."""
    B, T = 4, 1000
    NT = num_chunks(B, T)
    first = inputs([100, 300, 500, 100], NT, torch.bfloat16, DEVICE, seed=3)
    static = [a.clone() for a in first]
    ckpt_idx = torch.tensor([1, 9, -1], dtype=torch.int64, device=DEVICE)
    ckpt = torch.zeros(3, HV, K, V, device=DEVICE)

    def step():
        return chunked_gdn_forward(*static, checkpoint_chunks=ckpt_idx, checkpoints=ckpt, config=config)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, final_g = step()
    diffs = {}
    for name, lengths in (("same", [100, 300, 500, 100]), ("other", [37, 93, 126, 744]), ("short", [1, 1, 2, 990])):
        new = inputs(lengths, NT, torch.bfloat16, DEVICE, seed=4)
        for s, n in zip(static, new):
            s.copy_(n)
        ckpt.zero_()
        graph.replay()
        replay = (o_g.clone(), final_g.clone(), ckpt.clone())
        ckpt.zero_()
        eager = chunked_gdn_forward(*new, checkpoint_chunks=ckpt_idx, checkpoints=ckpt, config=config)
        diffs[name] = max((a.float() - b.float()).abs().max().item() for a, b in zip(replay, (*eager, ckpt)))
    torch.cuda.synchronize()
    return {"max_diff": diffs, "pass": all(d == 0 for d in diffs.values())}


def time_shapes(configs: dict[str, ChunkConfig], shapes, graphs: bool) -> tuple[list, dict]:
    """Per-layer ms of fla and each config on every shape (eager do_bench; CUDA graph replay if asked)."""
    import triton.testing

    rows, record = [], {}
    for B, L in shapes:
        NT = num_chunks(B, B * L)
        args = inputs([L] * B, NT, torch.bfloat16, DEVICE, seed=5)
        calls = {"fla": lambda: fla_varlen(*args)}
        calls["default"] = lambda: chunked_gdn_forward(*args)
        for name, cfg in configs.items():
            calls[name] = (lambda c: lambda: chunked_gdn_forward(*args, config=c))(cfg)
        shape_rec = {}
        for name, call in calls.items():
            try:
                call()
                eager = triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median")
                entry = {"eager_ms": round(eager, 4)}
                if graphs:
                    with torch.cuda.stream(torch.cuda.Stream()):
                        graph_ms = triton.testing.do_bench_cudagraph(call, rep=50, return_mode="median")
                    entry["graph_ms"] = round(graph_ms, 4)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                entry = {"error": f"{type(e).__name__}: {e}"}
            shape_rec[name] = entry
        ours = {n: e for n, e in shape_rec.items() if n != "fla" and "eager_ms" in e}
        key = "graph_ms" if graphs else "eager_ms"
        best = min(ours, key=lambda n: ours[n][key]) if ours else None
        shape_rec["best"] = best
        shape_rec["default_config"] = default_config(B + 1, HV, V, torch.device("cuda")).name
        record[f"{B}x{L}"] = shape_rec
        fla_ms = shape_rec["fla"].get(key)
        pub = PUBLISHED_MS.get((B, L))
        for name, e in shape_rec.items():
            if not isinstance(e, dict):
                continue
            ms = e.get(key)
            rows.append([f"{B}x{L}", name, e.get("eager_ms", "-"), e.get("graph_ms", "-"),
                         f"{fla_ms / ms:.2f}x" if ms and fla_ms else "-",
                         f"{ms / pub:.2f}x" if ms and pub else "-", "*" if name == best else "",
                         e.get("error", "")[:60]])
        print(f"  timed {B}x{L}: best {best}", flush=True)
    return rows, record


def time_whole_op(shapes, graphs: bool) -> dict:
    """The op's CUDA path for chunked calls (metrale::gdn_recurrence, and the recurrent kernel for streams of
    <= 64 tokens): "ours", our kernels on the packed tokens and the pool (the default path); "fla" and
    "ours_aligned", fla's varlen forward or ours on the aligned layout (state gather, five gathers, scatter)."""
    import triton.testing

    from metrale_graph.ops.gdn_recurrence import gdn_recurrence_split

    record = {}
    for B, L in shapes:
        g = torch.Generator(device=DEVICE).manual_seed(6)
        T = B * L
        qk = torch.nn.functional.normalize(torch.randn(T, 2 * H, K, generator=g, device=DEVICE), dim=-1)
        qk = qk.to(torch.bfloat16)
        q, k = qk[:, :H], qk[:, H:]  # head slices of one buffer, as the model passes them
        v = torch.randn(T, HV, V, generator=g, device=DEVICE).to(torch.bfloat16)
        gate = torch.nn.functional.logsigmoid(torch.randn(T, HV, generator=g, device=DEVICE)) * 0.5
        beta = torch.rand(T, HV, generator=g, device=DEVICE).to(torch.bfloat16)
        cu = torch.arange(B + 1, dtype=torch.int32, device=DEVICE) * L
        slots = torch.arange(B, dtype=torch.int32, device=DEVICE)
        pool = torch.randn(B + 1, HV, K, V, generator=g, device=DEVICE) * 0.1
        rec = {}
        for name, fn in (("fla", fla_varlen), ("ours_aligned", chunked_gdn_forward), ("ours", None)):
            def call(fn=fn):
                return gdn_recurrence_split(q, k, v, gate, beta, cu, slots, pool, *([fn] if fn else []))
            call()
            rec[name] = {"eager_ms": round(triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median"), 4)}
            if graphs:
                with torch.cuda.stream(torch.cuda.Stream()):
                    rec[name]["graph_ms"] = round(triton.testing.do_bench_cudagraph(call, rep=50,
                                                                                     return_mode="median"), 4)
        record[f"{B}x{L}"] = rec
        print(f"  whole op {B}x{L}: {rec}", flush=True)
    return {"shapes": record}


def kernel_split(shapes, calls: int = 20) -> dict:
    """Per shape, the default config's device us per call by kernel (torch.profiler over `calls` eager calls
    after a warm one): how the layer's time divides between the intra-chunk and the state pass."""
    from torch.profiler import ProfilerActivity, profile

    record = {}
    for B, L in shapes:
        args = inputs([L] * B, num_chunks(B, B * L), torch.bfloat16, DEVICE, seed=5)
        chunked_gdn_forward(*args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                chunked_gdn_forward(*args)
            torch.cuda.synchronize()
        split = {e.key: round(e.self_device_time_total / calls, 1) for e in prof.key_averages()
                 if e.self_device_time_total > 0}
        record[f"{B}x{L}"] = split
        print(f"  kernels {B}x{L} (us a call): {split}", flush=True)
    return {"shapes": record}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/kernels/check_gdn_chunked.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=output_file, default=None, help="write the record to this file")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated configs of the sweep to time (default: all of {', '.join(CONFIGS)})")
    p.add_argument("--shapes", default=",".join(f"{b}x{t}" for b, t in SHAPES),
                   help="comma-separated STREAMSxTOKENS per stream to time")
    p.add_argument("--no-graphs", action="store_true", help="time eager calls only (no CUDA graph replay times)")
    p.add_argument("--jobs", type=non_negative_int, default=8,
                   help="processes that compile the kernels first, in parallel (0: compile as they run)")
    args = p.parse_args(argv)
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
        assert all(len(s) == 2 and min(s) > 0 for s in shapes)
    except (ValueError, AssertionError):
        p.error(f"--shapes: expected STREAMSxTOKENS items like 8x1024, got {args.shapes!r}")
    if not torch.cuda.is_available():
        p.exit(1, f"{p.prog}: error: this check needs a CUDA GPU; torch sees none\n")

    report = Report()
    if args.jobs:
        report.case("precompile", lambda: precompile(names, args.jobs))
    report.case("reference_bf16", lambda: check_reference(torch.bfloat16))
    report.case("vs_fla_ragged", lambda: check_against_fla([1, 64, 65, 700, 1500, 4000, 37, 2048]))
    report.case("vs_fla_one_long", lambda: check_against_fla([16384]))
    report.case("graph_replay_default", lambda: check_graph_replay(None))
    report.case("graph_replay_bv64", lambda: check_graph_replay(CONFIGS["bv64-w8s2"]))
    rows = []

    def timing():
        nonlocal rows
        rows, rec = time_shapes({n: CONFIGS[n] for n in names}, shapes, graphs=not args.no_graphs)
        return {"shapes": rec}

    report.case("timing", timing)
    report.case("whole_op_timing", lambda: time_whole_op(shapes, graphs=not args.no_graphs))
    report.case("kernel_split", lambda: kernel_split(shapes))
    report.case("reference_fp32", lambda: check_reference(torch.float32))

    print(f"\nchecks ({report.record['device']}):")
    check_rows = [[n, "ok" if c.get("pass", c["ok"]) else "FAIL",
                   json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in c.items()
                               if k not in ("ok", "pass", "shapes")})[:150]]
                  for n, c in report.record["cases"].items() if not n.endswith(("timing", "split"))]
    print_table(["case", "result", "values"], check_rows)
    if rows:
        print("\nper-layer ms, 9B GDN heads, bf16 (eager: do_bench median, L2 flushed; graph: CUDA graph replay):")
        print_table(["shape", "kernel", "eager ms", "graph ms", "fla / this", "this / published", "best", "error"],
                    rows)
    report.record["total_s"] = round(time.time() - report.t0, 1)
    if args.json:
        write_whole(args.json, json.dumps(report.record, indent=1, sort_keys=True))
    print_json(report.record)


if __name__ == "__main__":
    main()

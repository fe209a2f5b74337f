"""One GPU run that settles the FP8 primitives (metrale_graph.ops.fp8, issue 26): correctness of
every path against the plain-torch references, which shapes cuBLAS' blockwise FP8 GEMM accepts,
speed against bf16, and CUDA-graph replay. Sections (each case in its own try, a failure is a row):

  correctness  at the Qwen3.5-9B projection shapes (N x K = 24576 x 4096, 4096 x 12288, 16448 x 4096,
               4096 x 4096) and ragged ones: the Triton activation quantizer bit for bit against its
               torch reference; block_fp8_linear's Triton, split-K (M <= 16), cuBLAS and auto paths against
               block_fp8_linear_ref (bf16 out); W8A8's distance from the bf16 product
  cublas       which (M, N, K, out dtype, weight-scale layout) torch._scaled_mm blockwise takes, and
               whether what it returns is right
  perf         device time (CUDA-graph replay) at M = 1 .. 16384 at the 9B shapes: bf16 x @ w.t(), the
               activation quantizer, FP8 via cuBLAS, via Triton and via split-K Triton (M <= 16; quantizer
               included), TFLOP/s and TB/s;
               the ceilings (bf16 and FP8 tensorwise 8192^3)
  experts      Qwen3.5-35B-A3B's routed experts (E 256, D 2048, IE 512, top 8) at T = 512, 4096, 16384:
               moe_experts_fp8 against moe_experts_fp8_ref and against ops/moe/gemm.py's bf16 grouped GEMMs
               (correctness and time)
  graphs       captured and replayed (with new inputs) = eager, bit for bit

    python benchmarks/kernels/check_fp8.py [--sections correctness,cublas,perf,experts,graphs] [--json FILE]
    TRITON_INTERPRET=1 python benchmarks/kernels/check_fp8.py --smoke   # tiny shapes on the CPU (no cuBLAS, perf, graphs)

Prints a table per section and ends with one JSON line (also written to --json FILE); exit code 1
if a correctness check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from measure import attempt, fmt_ms, fmt_num, fmt_value, rel as rel_err, titled_table

SECTIONS = ("correctness", "cublas", "perf", "experts", "graphs")
SHAPES_9B = [(24576, 4096), (4096, 12288), (16448, 4096), (4096, 4096)]
SHAPES_RAGGED = [(5632, 2048), (200, 300), (4096, 1000), (1000, 4096)]
PERF_M = (1, 4, 16, 32, 128, 512, 4096, 16384)
EXPERTS_35B = dict(E=256, D=2048, IE=512, k=8, tokens=(512, 4096, 16384))
SMOKE = dict(shapes=[(200, 300), (128, 256)], m=(1, 17), experts=dict(E=4, D=200, IE=100, k=2, tokens=(5,)))
TOL = 1e-2  # bf16 outputs against their reference (tests/metrics.TOL)
# a GEMM's bf16 output against the reference's bf16 output: only sums rounded in another order differ,
# which moves an element by one bf16 ulp where its fp32 value lies near a rounding boundary (all of them
# moving would be 2^-8 = 3.9e-3; the output's own bf16 rounding is ~1.6e-3)
TOL_SPEC = 3e-3


class Checker:
    def __init__(self, device, smoke: bool):
        from metrale_graph.ops import fp8
        self.fp8, self.dev, self.smoke = fp8, device, smoke
        self.failures: list[str] = []
        self._experts = {}

    def fail_if(self, bad: bool, what: str):
        if bad:
            self.failures.append(what)

    def weight(self, N, K, seed=0):
        g = torch.Generator(device=self.dev).manual_seed(seed)
        w = (torch.randn(N, K, generator=g, device=self.dev) * 0.02).to(torch.bfloat16)
        return (w, *self.fp8.quantize_weight_blocks(w))

    def acts(self, M, K, seed=1):
        g = torch.Generator(device=self.dev).manual_seed(seed)
        return torch.randn(M, K, generator=g, device=self.dev).to(torch.bfloat16)

    # correctness -----------------------------------------------------------------------------
    def correctness(self):
        fp8, rows, recs = self.fp8, [], []
        shapes = SMOKE["shapes"] if self.smoke else SHAPES_9B + SHAPES_RAGGED
        for N, K in shapes:
            w, q, s = self.weight(N, K)
            for M in (SMOKE["m"] if self.smoke else (1, 257)):
                x = self.acts(M, K)
                rec = {"N": N, "K": K, "M": M,
                       "auto_backend": fp8.auto_backend(M, N, K, x.device)}
                qa, sa = fp8.quantize_activations_ref(x)
                qb, sb = fp8.quantize_activations(x)
                rec["quant_bitexact"] = bool(torch.equal(qa.view(torch.uint8), qb.view(torch.uint8))
                                             and torch.equal(sa, sb))
                self.fail_if(not rec["quant_bitexact"], f"quantizer {M}x{K} not bit-exact")
                ref32 = fp8.block_fp8_linear_ref(x, q, s, torch.float32)
                ref = ref32.to(torch.bfloat16)  # the spec's bf16 output
                rec["w8a8_vs_bf16_product"] = rel_err(ref32, x.float() @ w.float().t())
                rec["bf16_rounding"] = rel_err(ref, ref32)
                for backend in ("triton", "splitk", "cublas", "auto"):
                    if (backend == "cublas" and not x.is_cuda) or (backend == "splitk"
                                                                   and M > fp8.linear.SPLITK_MAX_ROWS):
                        continue
                    out, err = attempt(lambda: fp8.block_fp8_linear(x, q, s, torch.bfloat16, backend=backend))
                    rec[backend] = err if err else rel_err(out, ref)
                    if backend != "cublas" or fp8.cublas_blockwise_ok(N, K, x.device):
                        self.fail_if(err is not None or rec[backend] > TOL_SPEC,
                                     f"{backend} {M}x{N}x{K}: {rec[backend]}")
                residual = self.acts(M, N, seed=3)
                ref_r = fp8.block_fp8_linear_ref(x, q, s, torch.bfloat16, residual)
                out, err = attempt(lambda: fp8.block_fp8_linear(x, q, s, torch.bfloat16, residual))
                rec["auto_residual"] = err if err else rel_err(out, ref_r)  # cuBLAS rounds twice: TOL
                self.fail_if(err is not None or rec["auto_residual"] > TOL,
                             f"residual {M}x{N}x{K}: {rec['auto_residual']}")
                recs.append(rec)
                rows.append([f"{N}x{K}", M, rec["auto_backend"], rec["quant_bitexact"], *(
                    fmt_value(rec.get(b, "-")) for b in ("triton", "splitk", "cublas", "auto", "auto_residual")),
                    fmt_value(rec["bf16_rounding"]), fmt_value(rec["w8a8_vs_bf16_product"])])
        titled_table("correctness: rel. error of bf16 outputs against block_fp8_linear_ref's bf16 output",
                     ["N x K", "M", "auto", "quant bit-exact", "triton", "splitk", "cublas", "auto", "auto + residual",
                      "bf16 rounding", "W8A8 vs bf16 product"], rows)
        return recs

    # cuBLAS acceptance -----------------------------------------------------------------------
    def cublas(self):
        if not torch.cuda.is_available():
            return []
        fp8, rows, recs = self.fp8, [], []
        shapes = [(256, 512), (256, 384), (256, 128), (200, 512), (256, 300), (200, 300), (5632, 2048), (4096, 4224),
                  (24576, 4096)]
        for N, K in shapes:
            _, q, s = self.weight(N, K)
            KB = fp8.num_blocks(K)
            padded = torch.zeros(s.shape[0], -(-KB // 4) * 4, device=self.dev)
            padded[:, :KB] = s
            layouts = {"contiguous": s, "stride4": padded[:, :KB]}
            for M in (1, 3, 16, 17, 128):
                x = self.acts(M, K)
                ref = fp8.block_fp8_linear_ref(x, q, s, torch.float32)
                xq, xs = fp8.quantize_activations(x, column_major_scales=True)
                for name, ws in layouts.items():
                    if name == "stride4" and KB % 4 == 0:
                        continue  # the same strides as contiguous
                    for out_dtype in (torch.bfloat16, torch.float32):
                        out, err = attempt(lambda: fp8.block_fp8_gemm_cublas(xq, xs, q, ws, out_dtype))
                        rec = {"N": N, "K": K, "M": M, "scale_layout": name, "out": str(out_dtype)[6:],
                               "accepted": err is None, "error": err,
                               "rel_err": None if err else rel_err(out, ref)}
                        recs.append(rec)
                        rows.append([N, K, M, name, rec["out"], rec["accepted"],
                                     fmt_value(rec["rel_err"]) if rec["accepted"] else err[:70]])
        titled_table("cublas: torch._scaled_mm blockwise (1x128 activations, 128x128 weights)",
                     ["N", "K", "M", "w scale layout", "out", "accepted", "rel. err / error"], rows)
        return recs

    # speed -----------------------------------------------------------------------------------
    def bench(self, fn) -> float:
        import triton.testing
        fn()  # autotuning and library set-up happen before capture
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream()):
            return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")

    def perf(self):
        if not torch.cuda.is_available():
            return {}
        fp8, rows, recs = self.fp8, [], []
        ceilings = {}
        a = torch.randn(8192, 8192, device=self.dev).to(torch.bfloat16)
        ms, _ = attempt(lambda: self.bench(lambda: a @ a.t()))
        ceilings["bf16_tflops"] = 2 * 8192 ** 3 / ms / 1e9 if ms else None
        a8, one = a.to(fp8.FP8_DTYPE), torch.ones((), device=self.dev)
        ms, _ = attempt(lambda: self.bench(lambda: torch._scaled_mm(a8, a8.t(), one, one, out_dtype=torch.bfloat16)))
        ceilings["fp8_tensorwise_tflops"] = 2 * 8192 ** 3 / ms / 1e9 if ms else None
        a = a8 = None  # the 8192^2 operands freed (lambdas above close over them: no del)
        for N, K in SHAPES_9B:
            w, q, s = self.weight(N, K)
            for M in PERF_M:
                x = self.acts(M, K)
                flops = 2 * M * N * K
                io = 2 * M * K + 2 * M * N
                times = {"bf16": attempt(lambda: self.bench(lambda: x @ w.t())),
                         "quant": attempt(lambda: self.bench(lambda: fp8.quantize_activations(x))),
                         "fp8_cublas": attempt(lambda: self.bench(
                             lambda: fp8.block_fp8_linear(x, q, s, torch.bfloat16, backend="cublas"))),
                         "fp8_triton": attempt(lambda: self.bench(
                             lambda: fp8.block_fp8_linear(x, q, s, torch.bfloat16, backend="triton"))),
                         "fp8_splitk": attempt(lambda: self.bench(
                             lambda: fp8.block_fp8_linear(x, q, s, torch.bfloat16, backend="splitk")))
                         if M <= fp8.linear.SPLITK_MAX_ROWS else (None, None)}
                rec = {"N": N, "K": K, "M": M, **{f"{k}_ms": v for k, (v, _) in times.items()},
                       **{f"{k}_error": e for k, (_, e) in times.items() if e}}
                wbytes = {"bf16": 2 * N * K, "fp8_cublas": N * K, "fp8_triton": N * K, "fp8_splitk": N * K}
                for k, nb in wbytes.items():
                    t = rec[f"{k}_ms"]
                    rec[f"{k}_tflops"] = flops / t / 1e9 if t else None
                    rec[f"{k}_tbs"] = (nb + io) / t / 1e9 if t else None
                kinds = ("fp8_cublas", "fp8_triton", "fp8_splitk")
                fp8_ms = [rec[f"{k}_ms"] for k in kinds if rec[f"{k}_ms"]]
                rec["best_fp8"] = min(kinds, key=lambda k: rec[f"{k}_ms"] or float("inf"))
                rec["speedup"] = rec["bf16_ms"] / min(fp8_ms) if fp8_ms and rec["bf16_ms"] else None
                recs.append(rec)
                rows.append([f"{N}x{K}", M,
                             *(fmt_ms(rec[f"{k}_ms"]) for k in ("bf16", "quant", *kinds)),
                             *(fmt_num(rec[f"{k}_tflops"]) for k in ("bf16", *kinds)),
                             *(fmt_num(rec[f"{k}_tbs"], 2) for k in ("bf16", *kinds)),
                             rec["best_fp8"][4:], fmt_num(rec["speedup"], 2)])
                x = None
            w = q = s = None
        print(f"\nceilings: bf16 8192^3 {fmt_num(ceilings['bf16_tflops'])} TFLOP/s, FP8 tensorwise 8192^3 "
              f"{fmt_num(ceilings['fp8_tensorwise_tflops'])} TFLOP/s")
        titled_table("perf: device ms (CUDA-graph replay); FP8 rows include the activation quantizer",
                     ["N x K", "M", "bf16", "quant", "fp8 cublas", "fp8 triton", "fp8 splitk", "TF bf16", "TF cublas",
                      "TF triton", "TF splitk", "TB/s bf16", "TB/s cublas", "TB/s triton", "TB/s splitk", "best fp8",
                      "speed-up"], rows)
        return {"ceilings": ceilings, "rows": recs}

    # experts ---------------------------------------------------------------------------------
    def bf16_experts(self):
        """ops/moe's bf16 grouped GEMMs (gemm.gate_up, gemm.down) over the pairs aligned as the op aligns them:
        pair rows [T * k, D]; IEEE dots in the interpreter, as the op's (its bf16 dots are not the GPU's there)."""
        from metrale_graph.ops.common import INTERPRET
        from metrale_graph.ops.moe import align, gemm

        def run(x, top_w, top_e, w13, w2):
            (T, D), k, E = x.shape, top_e.shape[1], w13.shape[0]
            BM = align.block_m(T * k, E)
            ids, block_expert = align.align_pairs(top_e, E, BM)
            act = gemm.gate_up(x, w13, ids, block_expert, k, BM, ieee=INTERPRET)
            return gemm.down(act, w2, ids, block_expert, top_w, x.new_empty(T * k, D), BM, ieee=INTERPRET)
        return run

    def expert_weights(self, E, D, IE):
        """((w13, w2) bf16, (w13, w13_scale, w2, w2_scale) FP8), made once per shape."""
        if (E, D, IE) not in self._experts:
            self._experts = {(E, D, IE): self._make_expert_weights(E, D, IE)}  # one set held at a time
        return self._experts[(E, D, IE)]

    def _make_expert_weights(self, E, D, IE):
        fp8, g = self.fp8, torch.Generator(device=self.dev).manual_seed(2)
        w13 = (torch.randn(E, 2 * IE, D, generator=g, device=self.dev) * 0.02).to(torch.bfloat16)
        w2 = (torch.randn(E, D, IE, generator=g, device=self.dev) * 0.02).to(torch.bfloat16)
        (gq, gs), (uq, us) = fp8.quantize_weight_blocks(w13[:, :IE]), fp8.quantize_weight_blocks(w13[:, IE:])
        return (w13, w2), (*fp8.stack_gate_up(gq, gs, uq, us), *fp8.quantize_weight_blocks(w2))

    def routing(self, T, E, k, D, seed):
        g = torch.Generator(device=self.dev).manual_seed(seed)
        top_w, top_e = torch.softmax(torch.randn(T, E, generator=g, device=self.dev), -1).topk(k, -1)
        return self.acts(T, D, seed), top_w.to(torch.bfloat16), top_e

    def experts(self):
        fp8, rows, recs = self.fp8, [], []
        cfg = SMOKE["experts"] if self.smoke else EXPERTS_35B
        E, D, IE, k = cfg["E"], cfg["D"], cfg["IE"], cfg["k"]
        (w13, w2), fp8_w = self.expert_weights(E, D, IE)
        bf16, bf16_err = attempt(self.bf16_experts) if torch.cuda.is_available() or self.smoke else (None, "no CUDA")
        for T in cfg["tokens"]:
            x, top_w, top_e = self.routing(T, E, k, D, seed=T)
            rec = {"E": E, "D": D, "IE": IE, "k": k, "T": T}
            out, err = attempt(lambda: fp8.moe_experts_fp8(x, top_w, top_e, *fp8_w))
            rec["fp8_error"] = err
            if T <= 4096 and out is not None:
                ref = fp8.moe_experts_fp8_ref(x, top_w, top_e, *fp8_w)
                rec["fp8_vs_ref"] = rel_err(out, ref.float())
                self.fail_if(rec["fp8_vs_ref"] > TOL, f"experts T={T}: {rec['fp8_vs_ref']}")
            self.fail_if(err is not None, f"experts T={T}: {err}")
            if bf16 is not None and out is not None:
                y16, e16 = attempt(lambda: bf16(x, top_w, top_e, w13, w2))
                rec["fp8_vs_bf16_kernels"] = e16 if e16 else rel_err(out, y16)
            if torch.cuda.is_available():
                touched = min(E, T * k)
                flops = 6 * T * k * D * IE
                io = 2 * T * D + 2 * T * k * D
                for name, fn, wb in (("fp8", lambda: fp8.moe_experts_fp8(x, top_w, top_e, *fp8_w), 1),
                                     ("bf16", bf16 and (lambda: bf16(x, top_w, top_e, w13, w2)), 2)):
                    ms, e = attempt(lambda: self.bench(fn)) if fn else (None, bf16_err)
                    rec[f"{name}_ms"], rec[f"{name}_bench_error"] = ms, e
                    rec[f"{name}_tflops"] = flops / ms / 1e9 if ms else None
                    rec[f"{name}_tbs"] = (touched * 3 * D * IE * wb + io) / ms / 1e9 if ms else None
            recs.append(rec)
            rows.append([T, fmt_value(rec.get("fp8_vs_ref", "-")), fmt_value(rec.get("fp8_vs_bf16_kernels", "-")),
                         fmt_ms(rec.get("fp8_ms")), fmt_ms(rec.get("bf16_ms")), fmt_num(rec.get("fp8_tflops")),
                         fmt_num(rec.get("bf16_tflops")), fmt_num(rec.get("fp8_tbs"), 2), fmt_num(rec.get("bf16_tbs"), 2),
                         fmt_num(rec["bf16_ms"] / rec["fp8_ms"], 2) if rec.get("fp8_ms") and rec.get("bf16_ms") else "-"])
        titled_table(f"experts: E {E}, D {D}, IE {IE}, top {k} (device ms; FP8 includes quantizing x)",
                     ["T", "fp8 vs ref", "fp8 vs bf16 kernels", "fp8 ms", "bf16 ms", "TF fp8", "TF bf16", "TB/s fp8",
                      "TB/s bf16", "speed-up"], rows)
        return recs

    # graphs ----------------------------------------------------------------------------------
    def replay_equals_eager(self, make_inputs, fn) -> dict:
        """Capture fn over static inputs, refill them with new values, replay: bit-equal to eager?"""
        static = make_inputs(0)
        eager = fn(*static).clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(*static)
        graph.replay()
        torch.cuda.synchronize()
        first = torch.equal(out, eager)
        for t, new in zip(static, make_inputs(1)):
            t.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        return {"replay_equal": first, "replay_new_inputs_equal": bool(torch.equal(out, fn(*static)))}

    def graphs(self):
        if not torch.cuda.is_available():
            return []
        fp8, rows, recs = self.fp8, [], []
        cases = []
        for N, K, M, backend in ((4096, 4096, 128, "auto"), (4096, 4096, 1, "triton"), (4096, 12288, 1, "splitk"),
                                 (200, 300, 7, "splitk"), (16448, 4096, 512, "auto"),
                                 (200, 300, 33, "auto")):
            _, q, s = self.weight(N, K)
            cases.append((f"linear {backend} {M}x{N}x{K}", lambda seed, M=M, K=K: (self.acts(M, K, seed),),
                          lambda x, q=q, s=s, b=backend: fp8.block_fp8_linear(x, q, s, torch.bfloat16, backend=b)))
        cfg = EXPERTS_35B
        _, fp8_w = self.expert_weights(cfg["E"], cfg["D"], cfg["IE"])
        cases.append(("moe_experts_fp8 T=512", lambda seed: self.routing(512, cfg["E"], cfg["k"], cfg["D"], seed),
                      lambda x, tw, te: fp8.moe_experts_fp8(x, tw, te, *fp8_w)))
        for name, make, fn in cases:
            rec, err = attempt(lambda: self.replay_equals_eager(make, fn))
            rec = {"case": name, **(rec or {}), "error": err}
            self.fail_if(err is not None or not (rec.get("replay_equal") and rec.get("replay_new_inputs_equal")),
                         f"graph {name}: {rec}")
            recs.append(rec)
            rows.append([name, rec.get("replay_equal", "-"), rec.get("replay_new_inputs_equal", "-"), err or ""])
        titled_table("graphs: captured, replayed = eager (bit for bit)",
                     ["case", "replay", "replay, new inputs", "error"], rows)
        return recs


def _sections(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",")]
    if not names or not all(n in SECTIONS for n in names):
        raise argparse.ArgumentTypeError(f"expected comma-separated names out of {', '.join(SECTIONS)}, got {text!r}")
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/kernels/check_fp8.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", type=_sections, default=list(SECTIONS), help="comma-separated, default all")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the JSON record to FILE")
    p.add_argument("--smoke", action="store_true", help="tiny shapes; on a CPU in Triton's interpreter")
    args = p.parse_args(argv)
    if args.json:
        from metrale_graph.tools.flags import output_file
        try:
            output_file(args.json)
        except argparse.ArgumentTypeError as e:
            p.error(f"argument --json: {e}")
    if not torch.cuda.is_available():
        if not args.smoke:
            p.exit(1, f"{p.prog}: error: this check needs a CUDA GPU (or --smoke on the CPU); torch sees none\n")
        if os.environ.get("TRITON_INTERPRET") != "1":  # read when the kernels are defined, before main runs
            p.exit(1, f"{p.prog}: error: --smoke on the CPU runs the kernels in Triton's interpreter: "
                      "set TRITON_INTERPRET=1\n")
    torch.backends.cuda.matmul.allow_tf32 = False  # the references multiply in true fp32
    from metrale_graph.tools.provenance import provenance
    from metrale_graph.tools.report import print_json

    checker = Checker(torch.device("cuda" if torch.cuda.is_available() else "cpu"), args.smoke)
    record = {"tool": "check_fp8", "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "smoke": args.smoke, **provenance()}
    for name in args.sections:
        start = time.perf_counter()
        record[name], err = attempt(getattr(checker, name))
        if err:
            checker.failures.append(f"{name}: {err}")
        record[f"{name}_s"] = round(time.perf_counter() - start, 1)
        print(f"[{name}: {record[f'{name}_s']} s]")
    record["failures"] = checker.failures
    record["ok"] = not checker.failures
    if checker.failures:
        print("\nFAILED:\n  " + "\n  ".join(checker.failures))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, sort_keys=True, indent=1, default=str)
    print_json(json.loads(json.dumps(record, default=str)))
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

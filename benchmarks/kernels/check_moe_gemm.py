"""The routed experts' grouped GEMMs of a sparse-MoE preset (ops/moe: the pairs aligned to blocks of BM rows,
gate|up with SiLU-mul in its epilogue, down with the routing weight in its epilogue) against their floor, per
layer, at the token counts of the workloads (W1 512, W2-W4 4096, W5 16384, decode 1 / 32 / 128), random uniform
routing. (It once timed torch._grouped_mm beside them: 1.17-1.28x slower at every 35B-A3B workload, that
backend was removed; BENCHMARKS.md keeps the figures.)

On a GPU each is timed under CUDA-graph replay (triton.testing.do_bench_cudagraph medians: capturing it is
part of the check) twice: the GEMMs alone (the alignment / sort done before) and the whole path (routing
given: from top-k ids to the pair rows). Beside each: the expert weights the tokens touch in expectation
and the floor, max(weight bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s); effective TB/s = those bytes / time, the
figure issue 25's targets name (>= 3.5 TB/s where memory-bound; >= 50% of the bf16 peak at W5: TFLOP/s).
Replays follow each other with nothing evicting the L2 between them: at 1 token the touched weights (~50-60
MB) about fit it, so decode-sized rows can read above the HBM rate. The pair rows are compared (relative
error) with a plain fp32 loop over the experts (reference_rows); the CPU suite checks both at tiny shapes under
Triton's interpreter (tests/test_bench.py).

    . benchmarks/gpu_session.sh setup && python3 benchmarks/kernels/check_moe_gemm.py --json "$OUT/moe_gemm.json"
"""

from __future__ import annotations

import argparse

import torch

from metrale_graph import PRESETS
from metrale_graph.tools.files import write_whole
from metrale_graph.tools.flags import output_file, positive_ints
from metrale_graph.tools.floors import COPY_RATE, MATMUL_RATE
from metrale_graph.tools.provenance import provenance
from metrale_graph.tools.report import print_json, print_table
from measure import graph_ms, rel

MOE_PRESETS = [name for name, cfg in PRESETS.items() if cfg.moe_layers and cfg.quantization is None]


def routing(T: int, E: int, k: int, device, dtype=torch.bfloat16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """top_w [T, k] (softmax over the chosen, in `dtype`) and top_e [T, k] int64: k distinct uniform experts a
    token."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    top_e = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    top_w = torch.softmax(torch.randn(T, k, generator=g), dim=1)
    return top_w.to(device, dtype), top_e.to(device)


class Ours:
    """ops/moe's CUDA path for the routed experts: align_local_pairs, gate_up, down (as moe_cuda calls them)."""

    def __init__(self, n, top_w, top_e, w13, w2):
        from metrale_graph.ops.common import INTERPRET
        from metrale_graph.ops.moe.align import align_local_pairs, block_m

        self.n, self.top_w, self.top_e, self.w13, self.w2 = n, top_w, top_e, w13, w2
        self.k, self.E = top_e.shape[1], w13.shape[0]
        self.BM = block_m(n.shape[0] * self.k, self.E)
        self.align = lambda: align_local_pairs(top_e, self.E, self.E, 0, self.BM)
        self.ieee = n.dtype == torch.float32 or INTERPRET
        self.sorted_ids, self.block_expert = self.align()
        self.y = n.new_empty(n.shape[0] * self.k, w2.shape[1])

    def gemms(self, sorted_ids=None, block_expert=None):
        from metrale_graph.ops.moe.gemm import down, gate_up

        ids = self.sorted_ids if sorted_ids is None else sorted_ids
        blocks = self.block_expert if block_expert is None else block_expert
        act = gate_up(self.n, self.w13, ids, blocks, self.k, self.BM, self.ieee)
        return down(act, self.w2, ids, blocks, self.top_w, self.y, self.BM, self.ieee)

    def whole(self):
        return self.gemms(*self.align())


def reference_rows(ours: Ours) -> torch.Tensor:
    """y [P, D] in pair order in fp32, one plain loop over the experts: row p = t * k + j holds top_w[t, j] *
    down_e(silu(gate_e(n[t])) * up_e(n[t])) for e = top_e[t, j]."""
    n, w13, w2, E = ours.n.float(), ours.w13, ours.w2, ours.E
    IE = w2.shape[-1]
    experts, weights = ours.top_e.reshape(-1), ours.top_w.reshape(-1).float()
    y = n.new_zeros(experts.shape[0], w2.shape[1])
    for e in range(E):
        pairs = (experts == e).nonzero().squeeze(1)
        h = n.index_select(0, pairs // ours.k) @ w13[e].float().T
        y[pairs] = (torch.nn.functional.silu(h[:, :IE]) * h[:, IE:]) @ w2[e].float().T * weights[pairs, None]
    return y


def pair_rows(path) -> torch.Tensor:
    """The path's y [P, D] in pair order (row p = t * k + j)."""
    return path.whole().clone()


def expert_bytes(T: int, E: int, k: int, IE: int, D: int, itemsize: int = 2) -> float:
    """The expert weights T tokens touch in expectation (uniform routing): E * (1 - (1 - k/E)^T) experts of
    3 * IE * D elements."""
    return E * (1 - (1 - k / E) ** T) * 3 * IE * D * itemsize


def expert_weights(cfg, device, dtype=torch.bfloat16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random w13 [E, 2 IE, D] and w2 [E, D, IE] of cfg's experts, drawn on `device` (a 512-expert stack is 3.2 GB
    in bf16: drawn once per preset)."""
    E, IE, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    g = torch.Generator(device=device).manual_seed(seed + 1)
    w13 = (torch.randn(E, 2 * IE, D, generator=g, device=device) * D ** -0.5).to(dtype)
    w2 = (torch.randn(E, D, IE, generator=g, device=device) * IE ** -0.5).to(dtype)
    return w13, w2


def case(cfg, T: int, device, dtype=torch.bfloat16, seed: int = 0, weights=None):
    """Ours for T tokens of cfg's expert shapes (weights: expert_weights' pair, else drawn)."""
    E, k, D = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size
    w13, w2 = weights if weights is not None else expert_weights(cfg, device, dtype, seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 2)
    n = torch.randn(T, D, generator=g).to(device, dtype)
    top_w, top_e = routing(T, E, k, device, dtype, seed)
    return Ours(n, top_w, top_e, w13, w2)


def measure(preset: str, T: int, weights) -> dict:
    cfg = PRESETS[preset]
    E, k, IE, D = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.hidden_size
    ours = case(cfg, T, "cuda", weights=weights)
    weights = expert_bytes(T, E, k, IE, D)
    flops = 2 * T * k * 3 * IE * D
    floor = max(weights / COPY_RATE, flops / MATMUL_RATE) * 1e3
    row = {"preset": preset, "tokens": T, "pairs": T * k, "BM": ours.BM, "weights_MB": round(weights / 1e6, 1),
           "floor_ms": round(floor, 4), "vs_reference": rel(pair_rows(ours), reference_rows(ours))}
    for part in ("gemms", "whole"):
        key = f"ours_{part}"
        try:
            ms = graph_ms(getattr(ours, part))
        except Exception as e:  # noqa: BLE001 (a path that fails to capture is a finding: reported, not fatal)
            row[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
            continue
        row[f"{key}_ms"] = round(ms, 4)
        row[f"{key}_TB_s"] = round(weights / (ms * 1e-3) / 1e12, 2)
        row[f"{key}_TFLOP_s"] = round(flops / (ms * 1e-3) / 1e12, 1)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/kernels/check_moe_gemm.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="qwen3.5-35b-a3b,qwen3-next-80b-a3b",
                   help=f"comma-separated, out of {', '.join(MOE_PRESETS)}")
    p.add_argument("--tokens", type=positive_ints, default="1,32,128,512,4096,16384")
    p.add_argument("--json", type=output_file, default=None)
    args = p.parse_args(argv)
    presets = [s for s in args.presets.split(",") if s]
    unknown = [s for s in presets if s not in MOE_PRESETS]
    if unknown or not presets:
        p.error(f"--presets: {', '.join(unknown) or 'none given'}; out of {', '.join(MOE_PRESETS)}")
    if not torch.cuda.is_available():
        p.exit(1, f"{p.prog}: error: this check needs a CUDA GPU; torch sees none\n")
    rows = []
    for preset in presets:
        weights = expert_weights(PRESETS[preset], "cuda")
        for T in args.tokens:
            rows.append(measure(preset, T, weights))
            print(f"  {preset}: {T} tokens", flush=True)
        del weights
    heads = ["preset", "tokens", "BM", "weights MB", "floor ms", "GEMMs ms", "TB/s", "TFLOP/s", "whole ms",
             "vs reference"]
    cell = lambda r, key: r.get(f"{key}_ms", "error" if f"{key}_error" in r else "-")  # noqa: E731
    table = [[r["preset"], r["tokens"], r["BM"], r["weights_MB"], r["floor_ms"], cell(r, "ours_gemms"),
              r.get("ours_gemms_TB_s", "-"), r.get("ours_gemms_TFLOP_s", "-"), cell(r, "ours_whole"),
              f"{r['vs_reference']:.1e}"] for r in rows]
    print(f"\nrouted experts, one layer, uniform routing, {torch.cuda.get_device_name()}")
    print_table(heads, table)
    for r in rows:
        for key, text in r.items():
            if key.endswith("_error"):
                print(f"{r['preset']} {r['tokens']} tokens, {key[:-6]}: {text}")
    record = {"tool": "check_moe_gemm", "device": torch.cuda.get_device_name(), **provenance(argv), "rows": rows}
    if args.json:
        import json

        write_whole(args.json, json.dumps(record, indent=1))
    print_json(record)

if __name__ == "__main__":
    main()

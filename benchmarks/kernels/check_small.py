"""The decode step's small kernels at a preset's one-stream bucket (2 token rows, one real): us a launch under
CUDA-graph replay, by form and warp count. Issue 38: at the 35B-A3B's D1 these kernels are launch- and
latency-bound (1.5-5.5 us each on an H100 at ef2139c, 15-17 a layer), so a form or a warp count that shortens
the chain of dependent loads and reductions is worth more than bytes.

- `conv decode`: ops/causal_conv1d.py's one-launch decode-shaped conv (taps and new state), against `conv two
  kernels` (the conv over the tokens, then the state update: the path of calls that are not decode-shaped);
- `route wN`: ops/moe/routing.py's router top-k at N warps (the op launches the default, 4);
- `rms_norm wN`, `l2norm wN`: ops/kernels.py's row kernels at N warps (defaults: Triton's 4);
- `combine`: the MoE combine kernel as the op launches it.

Outputs of each variant are compared with the op's default (max abs difference: 0 expected, the same arithmetic).

    . benchmarks/gpu_session.sh setup && python3 benchmarks/kernels/check_small.py --json "$OUT/small.json"
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from metrale_graph import PRESETS
from metrale_graph.ops import causal_conv1d as conv, kernels
from metrale_graph.ops.moe import combine, routing
from metrale_graph.tools.files import write_whole
from metrale_graph.tools.flags import output_file
from metrale_graph.tools.provenance import provenance
from metrale_graph.tools.report import print_json, print_table
from measure import attempt, graph_ms

WARPS = (4, 1, 2, 8)  # the launches' default (4) first: the others are compared with it


def _diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def cases(preset: str, rows: int):
    """(name, call) per variant, each call returning its output(s); the op's default first in each group."""
    cfg = PRESETS[preset]
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    H, K, HV, V = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    C, W, D = 2 * H * K + HV * V, cfg.linear_conv_kernel_dim, cfg.hidden_size
    cu = torch.tensor([0, 1] + [1] * (rows - 1), dtype=torch.int32, device=dev)  # one real token, padding streams
    slots = torch.arange(rows, dtype=torch.int64, device=dev)
    x = torch.randn(rows, C, device=dev, generator=g).to(dt)
    w = torch.randn(C, W, device=dev, generator=g).to(dt)
    state = torch.randn(rows + 1, C, W - 1, device=dev, generator=g).to(dt)
    out = []

    def conv_form(decode):
        def call():
            conv.decode_shaped = lambda B, T: decode
            try:
                return conv.causal_conv1d_triton(x, w, cu, slots, state)
            finally:
                conv.decode_shaped = _decode_shaped
        return call
    _decode_shaped = conv.decode_shaped
    out += [("conv decode", conv_form(True)), ("conv two kernels", conv_form(False))]

    E, k = cfg.num_experts or 256, cfg.num_experts_per_tok or 8
    logits = torch.randn(rows, E, device=dev, generator=g).to(dt)
    top_w = torch.empty(rows, k, dtype=dt, device=dev)
    top_e = torch.empty(rows, k, dtype=torch.int64, device=dev)

    def route(warps):
        def call():
            routing._moe_route_kernel[(rows,)](logits, top_w, top_e, cu, logits.stride(0), E, rows, TOP_K=k,
                                               BLOCK_K=triton.next_power_of_2(k), BLOCK_E=triton.next_power_of_2(E),
                                               NORM=True, PADDING=True, num_warps=warps)
            return top_w.clone(), top_e.clone()
        return call
    out += [(f"route w{n}", route(n)) for n in WARPS]

    h = torch.randn(rows, D, device=dev, generator=g).to(dt)
    nw = torch.randn(D, device=dev, generator=g).to(dt)
    y = torch.empty_like(h)

    def rms(warps):
        def call():
            kernels._rms_norm_kernel[(rows,)](h, nw, y, D, h.stride(0), 1e-6, BLOCK=triton.next_power_of_2(D),
                                              num_warps=warps)
            return y.clone()
        return call
    out += [(f"rms_norm w{n}", rms(n)) for n in WARPS]

    qk = torch.randn(rows, 2 * H, K, device=dev, generator=g).to(dt)
    yq = torch.empty_like(qk)

    def l2(warps):
        def call():
            kernels._l2norm_kernel[(rows * 2 * H,)](qk, yq, 2 * H, K, qk.stride(0), qk.stride(1), 1e-6,
                                                    BLOCK=triton.next_power_of_2(K), num_warps=warps)
            return yq.clone()
        return call
    out += [(f"l2norm w{n}", l2(n)) for n in WARPS]

    if cfg.num_experts:
        n_ = torch.randn(rows, D, device=dev, generator=g).to(dt)
        ye = torch.randn(rows * k, D, device=dev, generator=g).to(dt)
        shared = torch.randn(rows, D, device=dev, generator=g).to(dt)
        gate_w = torch.randn(1, D, device=dev, generator=g).to(dt)
        out.append(("combine", lambda: combine.combine_outputs(h, n_, gate_w, ye, shared, k, True)))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/kernels/check_small.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3.5-35b-a3b")
    ap.add_argument("--rows", type=int, default=2, help="token rows of the bucket (a one-stream bucket holds 2)")
    ap.add_argument("--json", type=output_file, default=None)
    args = ap.parse_args(argv)
    rows, results, first = [], [], {}
    for name, call in cases(args.preset, args.rows):
        group = name.split(" w")[0] if " w" in name else name.split(" ")[0]
        ref, err = attempt(call)
        us, err2 = attempt(lambda: graph_ms(call) * 1e3) if err is None else (None, err)
        outs = ref if isinstance(ref, tuple) else (ref,)
        diff = None if ref is None else max(_diff(a, b) for a, b in zip(outs, first.setdefault(group, outs)))
        rows.append([name, "-" if us is None else f"{us:.2f}", "-" if diff is None else f"{diff:.2e}",
                     err or err2 or ""])
        results.append(dict(form=name, us=us, max_abs_diff_vs_default=diff, error=err or err2))
    print(f"{args.preset}, {args.rows} token rows, {torch.cuda.get_device_name()}")
    print_table(["kernel", "us", "max |diff| vs default", "error"], rows)
    record = dict(tool="check_small", device=torch.cuda.get_device_name(), **provenance(argv), preset=args.preset,
                  rows=args.rows, results=results)
    print_json(record)
    if args.json:
        write_whole(args.json, json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

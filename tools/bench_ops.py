"""Per-op benchmark: each metrale:: phase op on the GPU at a model's shape (default the Qwen3.5-9B
shape) for a few token counts, against its floor max(FLOPs / 790 TFLOP/s, bytes / 4.3 TB/s).
Two medians of CUDA-event timings after warmup: called eagerly (triton.testing.do_bench, host
launch overhead included) and replayed from a CUDA graph (do_bench_cudagraph: device time,
which is what a captured prefill pays). Prints a table, optionally writes it as markdown, and
ends with one JSON line.

    python -m tools.bench_ops [--tokens 512,8192] [--streams 4] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import math

import torch

from metrale_graph import PRESETS, ops
from metrale_graph.tools.common import output_file, positive_int, positive_ints, print_json, print_table

MATMUL_RATE = 790e12  # bf16 dense, measured on an H200
COPY_RATE = 4.3e12    # device-to-device bytes (read + write), measured on an H200


def op_inputs(name: str, cfg, lengths: list[int], dtype=torch.bfloat16, device="cuda", block_size=64):
    """Random inputs of op `name` at config `cfg` for fresh streams of `lengths` (slots 0..B-1)."""
    T, B = sum(lengths), len(lengths)
    D, I = cfg.hidden_size, cfg.intermediate_size
    H, HV, K, V = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    HQ, HKV, HD = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    C, Z = cfg.conv_dim, HV * V
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    cu, slots = cu.to(device), torch.arange(B, device=device)
    ctx = torch.zeros(B, dtype=torch.int32, device=device)
    mb = max(math.ceil(n / block_size) for n in lengths)
    tables = torch.arange(B * mb, dtype=torch.int32, device=device).view(B, mb)

    def r(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, device=device) * scale).to(dt)

    def w(*shape):
        return r(*shape, scale=shape[-1] ** -0.5)

    eps = cfg.rms_norm_eps
    if name == "gdn_proj":
        return (r(T, D), r(D, scale=0.1), w(C, D), w(Z, D), w(HV, D), w(HV, D), r(HV, dt=dtype).abs().log1p(),
                r(HV), eps)
    if name == "causal_conv1d":
        return r(T, C), w(C, cfg.linear_conv_kernel_dim), cu, slots, r(B + 1, C, cfg.linear_conv_kernel_dim - 1)
    if name == "l2norm":
        return (r(T, C)[:, :2 * H * K].view(T, 2 * H, K),)
    if name == "gdn_recurrence":
        qk = torch.nn.functional.normalize(r(T, 2 * H, K).float(), dim=-1).to(dtype)
        return (qk[:, :H], qk[:, H:], r(T, HV, V), -torch.rand(T, HV, device=device), torch.rand(T, HV, device=device).to(dtype),
                cu, slots, torch.zeros(B + 1, HV, K, V, device=device))
    if name == "gdn_out":
        return r(T, HV, V), r(T, Z), r(T, D), 1 + r(V, scale=0.1), w(D, Z), r(D, scale=0.1), w(I, D), w(I, D), w(D, I), eps
    if name == "attn_proj":
        pos = torch.cat([torch.arange(n) for n in lengths]).to(device)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2, device=device).float() / cfg.rotary_dim))
        return (r(T, D), r(D, scale=0.1), w(2 * HQ * HD, D), w(HKV * HD, D), w(HKV * HD, D), r(HD, scale=0.1),
                r(HD, scale=0.1), pos, inv, HD, eps)
    if name == "paged_attention":
        kv = (B * mb + 1, block_size, HKV, HD)
        return r(T, HQ, HD), r(T, HKV, HD), r(T, HKV, HD), r(*kv), r(*kv), cu, ctx, tables
    if name == "attn_out":
        return r(T, HQ, HD), r(T, HQ * HD), r(T, D), w(D, HQ * HD), r(D, scale=0.1), w(I, D), w(I, D), w(D, I), eps
    raise KeyError(name)


def op_cost(name: str, cfg, lengths: list[int]) -> tuple[float, float]:
    """(FLOPs of the matrix work, fewest bytes moved) of one call on fresh streams, bf16."""
    T = sum(lengths)
    D, I = cfg.hidden_size, cfg.intermediate_size
    H, HV, K, V = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    HQ, HKV, HD = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    C, Z, W = cfg.conv_dim, HV * V, cfg.linear_conv_kernel_dim
    b = 2  # bf16
    if name == "gdn_proj":
        n = C + Z + 2 * HV
        return 2 * T * D * n, b * (n * D + T * D + T * (C + Z)) + 8 * T * HV
    if name == "causal_conv1d":
        return 2 * T * C * W, b * 2 * T * C
    if name == "l2norm":
        return 0, b * 2 * T * 2 * H * K
    if name == "gdn_recurrence":
        # chunked form, chunk 64: kk^T, w / u, state update and read, intra-chunk output
        per = 2 * (192 * K + 128 * V + 3 * K * V)
        return T * HV * per, b * (T * 2 * H * K + 2 * T * HV * V) + 6 * T * HV + 8 * len(lengths) * HV * K * V
    if name == "gdn_out":
        return 2 * T * (Z * D + 3 * D * I), b * (Z * D + 3 * D * I + T * (2 * Z + 2 * D))
    if name == "attn_proj":
        n = 2 * HQ * HD + 2 * HKV * HD
        return 2 * T * D * n, b * (n * D + T * D + T * n)
    if name == "paged_attention":
        pairs = sum(L * (L + 1) / 2 for L in lengths)
        return 4 * HQ * HD * pairs, b * (2 * T * HQ * HD + 4 * T * HKV * HD)
    if name == "attn_out":
        return 2 * T * (HQ * HD * D + 3 * D * I), b * (HQ * HD * D + 3 * D * I + T * (2 * HQ * HD + 2 * D))
    raise KeyError(name)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.bench_ops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3.5-9b", choices=list(PRESETS))
    p.add_argument("--tokens", type=positive_ints, default="512,8192", help="comma-separated total token counts")
    p.add_argument("--streams", type=positive_int, default=4, help="streams the tokens are split into")
    p.add_argument("--markdown", type=output_file, default=None, help="also write the table to this markdown file")
    args = p.parse_args(argv)
    if min(args.tokens) < args.streams:
        p.error(f"--tokens {min(args.tokens)} is fewer than --streams {args.streams}: every stream needs a token")
    if not torch.cuda.is_available():
        p.exit(1, f"{p.prog}: error: this benchmark needs a CUDA GPU; torch sees none\n")
    import triton.testing
    from tqdm.auto import tqdm

    cfg = PRESETS[args.preset]
    rows, records = [], []
    jobs = [(T, name) for T in args.tokens for name in ops.ALL_OPS]
    for T, name in tqdm(jobs, desc="ops", unit="op"):
        lengths = [T // args.streams] * args.streams
        lengths[-1] += T - sum(lengths)
        inputs = op_inputs(name, cfg, lengths)
        fn = ops.ALL_OPS[name]
        eager = triton.testing.do_bench(lambda: fn(*inputs), warmup=50, rep=200, return_mode="median")
        with torch.cuda.stream(torch.cuda.Stream()):
            ms = triton.testing.do_bench_cudagraph(lambda: fn(*inputs), rep=200, return_mode="median")
        flops, nbytes = op_cost(name, cfg, lengths)
        floor_ms = max(flops / MATMUL_RATE, nbytes / COPY_RATE) * 1e3
        bound = "compute" if flops / MATMUL_RATE > nbytes / COPY_RATE else "memory"
        rows.append([name, T, f"{eager:.3f}", f"{ms:.3f}", f"{floor_ms:.3f}", f"{ms / floor_ms:.2f}x", bound,
                     f"{flops / ms / 1e9:.0f}", f"{nbytes / ms / 1e6:.0f}"])
        records.append({"op": name, "tokens": T, "eager_ms": round(eager, 4), "graph_ms": round(ms, 4),
                        "floor_ms": round(floor_ms, 4)})
        del inputs
    headers = ["op", "tokens", "eager ms", "graph ms", "floor ms", "graph / floor", "bound", "TFLOP/s", "GB/s"]
    print(f"\n{args.preset}, bf16, {args.streams} streams, {torch.cuda.get_device_name()}")
    print_table(headers, rows)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("| " + " | ".join(headers) + " |\n|" + "---|" * len(headers) + "\n")
            for r in rows:
                f.write("| " + " | ".join(map(str, r)) + " |\n")
    print_json({"tool": "bench_ops", "preset": args.preset, "device": torch.cuda.get_device_name(), "ops": records})


if __name__ == "__main__":
    main()

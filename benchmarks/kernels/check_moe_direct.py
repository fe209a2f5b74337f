"""The MoE direct decode path's expert GEMVs (ops/moe/direct.py) at decode pair counts, against what the GPU does
with the same bytes: is the ~1.2-1.7 TB/s they read at the 35B-A3B's D1 (BENCHMARKS.md; H100 and H200) the
kernels' own, or what any reader of 8 experts' weights gets in a 10-30 us kernel?

Per case (a preset's expert shapes, T tokens x top_k pairs, uniform routing), each under CUDA-graph replay
(measure.graph_ms) over ROTATE routings in turn, so that the weights do not stay in the L2 between calls (one
call's gate|up weights are 33.5 MB at the 35B-A3B's D1; the H100 / H200 L2 is 50 MB), us a call and the rate
its weight bytes give:

- `gate_up BNxBK/w`, `down BNxBK/w`: ops/moe/direct.py's kernels at every tile of their candidates, forced
  (the tiles ops/moe/direct.py takes: the row marked `*`);
- `gate_up prefetch`: the rows kernel with the next K step's tiles loaded before the current one's products
  (two tiles in flight a program: Triton pipelines no loads that feed no dot), experimental, here only;
- `gate_up split S`: the K loop cut into S parts, one program each (S x the programs, each with fewer K steps),
  fp32 partial sums, then a finishing kernel (sum of the parts, SiLU-mul, rounding): experimental, here only;
- `gate_up dot BNxBK/stages/warps`, `down dot ...`: the rows kernels as ops/gemv.py's dot form (the weight tile
  [BN, BK] against the activations through tl.dot, K a multiple of BK) at DOT_TILES: experimental, here only;
- `bmm (pre-gathered)`: torch.bmm on the pairs' weights gathered beforehand (cuBLAS reading the same bytes);
- `sum (pre-gathered)`: torch.sum over those bytes (PyTorch's reduction: a plain read at this size).

With --layers N the routings walk N layers' expert weights in turn, as a model step does (cold L2 and TLB).
Outputs of the experimental forms are compared with the rows kernel's (relative error). Prints a table per
case and one JSON line (also written to --json).

    . benchmarks/gpu_session.sh setup && python3 benchmarks/kernels/check_moe_direct.py --json "$OUT/moe_direct.json"
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from metrale_graph import PRESETS
from metrale_graph.ops.moe.rounding import _rnd
from metrale_graph.tools.files import write_whole
from metrale_graph.tools.flags import output_file, positive_int, positive_ints
from metrale_graph.tools.provenance import provenance
from metrale_graph.tools.report import print_json, print_table
from measure import attempt, graph_ms, rel

ROTATE = 8  # routings a timed call runs in turn (their weights well past the L2 together)
SPLITS = (2, 4, 8)
# the dot form's (BN, BK, stages, warps)
DOT_TILES = ((16, 128, 4, 4), (16, 256, 3, 4), (16, 256, 4, 4), (16, 512, 2, 4), (32, 128, 4, 4), (32, 256, 3, 4),
             (32, 256, 4, 8), (64, 128, 4, 4), (64, 256, 3, 4), (16, 128, 6, 4), (32, 128, 6, 4))


@triton.jit
def _pair_tile(e_ptr, N, BN: tl.constexpr, TOP_K: tl.constexpr):
    """The program's (pair, its column tile, its expert, its token), pair-major as direct.py's kernels."""
    num_n = tl.cdiv(N, BN)
    pair = tl.program_id(0) // num_n
    cols = (tl.program_id(0) % num_n) * BN + tl.arange(0, BN)
    return pair, cols, tl.load(e_ptr + pair).to(tl.int64), (pair // TOP_K).to(tl.int64)


@triton.jit
def _prefetch_gate_up_kernel(x_ptr, w_ptr, act_ptr, e_ptr, N, K, stride_x, stride_we, stride_wn,
                             TOP_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """direct.py's gate|up rows kernel (K a multiple of BK, bf16 / fp16) with the next K step loaded first."""
    pair, cols, e, token = _pair_tile(e_ptr, N, BN, TOP_K)
    k = tl.arange(0, BK)
    x_ptrs = x_ptr + token * stride_x + k
    g_ptrs = w_ptr + e * stride_we + (cols % N).to(tl.int64)[:, None] * stride_wn + k[None, :]
    u_ptrs = g_ptrs + N * stride_wn
    g, u, x = tl.load(g_ptrs), tl.load(u_ptrs), tl.load(x_ptrs)
    gate = tl.zeros((BN, BK), dtype=tl.float32)
    up = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in range(BK, K, BK):
        g_next, u_next, x_next = tl.load(g_ptrs + k0), tl.load(u_ptrs + k0), tl.load(x_ptrs + k0)
        gate += g.to(tl.float32) * x.to(tl.float32)[None, :]
        up += u.to(tl.float32) * x.to(tl.float32)[None, :]
        g, u, x = g_next, u_next, x_next
    gate += g.to(tl.float32) * x.to(tl.float32)[None, :]
    up += u.to(tl.float32) * x.to(tl.float32)[None, :]
    dt = act_ptr.dtype.element_ty
    gate = _rnd(tl.sum(gate, axis=1), dt)
    up = tl.sum(up, axis=1)
    y = _rnd(_rnd(gate * tl.sigmoid(gate), dt) * _rnd(up, dt), dt).to(dt)
    tl.store(act_ptr + pair.to(tl.int64) * N + cols, y, mask=cols < N)


@triton.jit
def _dot_gate_up_kernel(x_ptr, w_ptr, act_ptr, e_ptr, N, K, stride_x, stride_we, stride_wn, TOP_K: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """The rows kernel as ops/gemv.py's dot form (K a multiple of BK): the weight tiles [BN, BK] the MMA's wide
    side, the token's row as all 16 columns of the narrow one, so that Triton pipelines the weight loads
    (STAGES K steps in flight a program); column 0 of the fp32 product kept."""
    pair, cols, e, token = _pair_tile(e_ptr, N, BN, TOP_K)
    k = tl.arange(0, BK)
    r = tl.arange(0, 16)
    x_ptrs = x_ptr + token * stride_x + k[:, None] + 0 * r[None, :]  # [BK, 16]: the token's row 16 times
    g_ptrs = w_ptr + e * stride_we + (cols % N).to(tl.int64)[:, None] * stride_wn + k[None, :]
    u_ptrs = g_ptrs + N * stride_wn
    gate = tl.zeros((BN, 16), dtype=tl.float32)
    up = tl.zeros((BN, 16), dtype=tl.float32)
    for _ in tl.range(0, K, BK, num_stages=STAGES):
        x = tl.load(x_ptrs)
        gate = tl.dot(tl.load(g_ptrs), x, gate)
        up = tl.dot(tl.load(u_ptrs), x, up)
        x_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    dt = act_ptr.dtype.element_ty
    gate = _rnd(tl.sum(tl.where(r[None, :] == 0, gate, 0.0), axis=1), dt)
    up = tl.sum(tl.where(r[None, :] == 0, up, 0.0), axis=1)
    y = _rnd(_rnd(gate * tl.sigmoid(gate), dt) * _rnd(up, dt), dt).to(dt)
    tl.store(act_ptr + pair.to(tl.int64) * N + cols, y, mask=cols < N)


@triton.jit
def _dot_down_kernel(act_ptr, w_ptr, y_ptr, e_ptr, rw_ptr, N, K, stride_we, stride_wn, BN: tl.constexpr,
                     BK: tl.constexpr, STAGES: tl.constexpr):
    """The down rows kernel in the dot form (K a multiple of BK)."""
    num_n = tl.cdiv(N, BN)
    pair = tl.program_id(0) // num_n
    cols = (tl.program_id(0) % num_n) * BN + tl.arange(0, BN)
    row = pair.to(tl.int64)
    e = tl.load(e_ptr + pair).to(tl.int64)
    k = tl.arange(0, BK)
    r = tl.arange(0, 16)
    a_ptrs = act_ptr + row * K + k[:, None] + 0 * r[None, :]
    w_ptrs = w_ptr + e * stride_we + (cols % N).to(tl.int64)[:, None] * stride_wn + k[None, :]
    acc = tl.zeros((BN, 16), dtype=tl.float32)
    for _ in tl.range(0, K, BK, num_stages=STAGES):
        acc = tl.dot(tl.load(w_ptrs), tl.load(a_ptrs), acc)
        a_ptrs += BK
        w_ptrs += BK
    dt = y_ptr.dtype.element_ty
    rw = tl.load(rw_ptr + row).to(tl.float32)
    y = _rnd(_rnd(tl.sum(tl.where(r[None, :] == 0, acc, 0.0), axis=1), dt) * rw, dt)
    tl.store(y_ptr + row * N + cols, y.to(dt), mask=cols < N)


@triton.jit
def _split_gate_up_kernel(x_ptr, w_ptr, part_ptr, e_ptr, P, N, K, K_PER, stride_x, stride_we, stride_wn,
                          TOP_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Program (pair x column tile, part s): the fp32 sums of gate and up over K columns s * K_PER .. + K_PER,
    into part [S, 2, P, N]."""
    num_n = tl.cdiv(N, BN)
    pair = tl.program_id(0) // num_n
    cols = (tl.program_id(0) % num_n) * BN + tl.arange(0, BN)
    s = tl.program_id(1)
    e = tl.load(e_ptr + pair).to(tl.int64)
    token = (pair // TOP_K).to(tl.int64)
    k = s * K_PER + tl.arange(0, BK)
    x_ptrs = x_ptr + token * stride_x + k
    g_ptrs = w_ptr + e * stride_we + (cols % N).to(tl.int64)[:, None] * stride_wn + k[None, :]
    u_ptrs = g_ptrs + N * stride_wn
    gate = tl.zeros((BN, BK), dtype=tl.float32)
    up = tl.zeros((BN, BK), dtype=tl.float32)
    for _ in range(0, K_PER, BK):
        x = tl.load(x_ptrs).to(tl.float32)[None, :]
        gate += tl.load(g_ptrs).to(tl.float32) * x
        up += tl.load(u_ptrs).to(tl.float32) * x
        x_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    out = part_ptr + (s * 2 * P + pair).to(tl.int64) * N + cols
    tl.store(out, tl.sum(gate, axis=1), mask=cols < N)
    tl.store(out + P * N, tl.sum(up, axis=1), mask=cols < N)


@triton.jit
def _split_finish_kernel(part_ptr, act_ptr, P, N, S: tl.constexpr, BLOCK: tl.constexpr):
    """act [P, N] = silu(sum_s gate) * sum_s up, rounded as the rows kernel rounds."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < P * N
    gate = tl.zeros((BLOCK,), dtype=tl.float32)
    up = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(S):
        gate += tl.load(part_ptr + s * 2 * P * N + i, mask=live, other=0.0)
        up += tl.load(part_ptr + (s * 2 + 1) * P * N + i, mask=live, other=0.0)
    dt = act_ptr.dtype.element_ty
    gate = _rnd(gate, dt)
    tl.store(act_ptr + i, _rnd(_rnd(gate * tl.sigmoid(gate), dt) * _rnd(up, dt), dt).to(dt), mask=live)


class Case:
    """ROTATE routings of T tokens over a preset's experts; the direct path's buffers for each."""

    def __init__(self, cfg, T: int, w13: torch.Tensor, w2: torch.Tensor, layers: int = 1, seed: int = 0):
        dev = w13.device
        self.EL = w13.shape[0]  # layers x E experts: routing i picks among layer i % layers's
        self.E, self.k, self.D, self.IE = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
        self.T, self.P, self.w13, self.w2 = T, T * self.k, w13, w2
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.x = [torch.randn(T, self.D, generator=g).to(dev, w13.dtype) for _ in range(ROTATE)]
        self.e = [(torch.rand(T, self.E, generator=g).topk(self.k, dim=1).indices.reshape(-1) + (i % layers) * self.E)
                  .to(dev) for i in range(ROTATE)]
        self.w = [torch.softmax(torch.randn(T, self.k, generator=g), 1).reshape(-1).to(dev, w13.dtype)
                  for _ in range(ROTATE)]
        self.act = [w13.new_empty(self.P, self.IE) for _ in range(ROTATE)]
        self.y = [w13.new_empty(self.P, self.D) for _ in range(ROTATE)]
        self.gate_up_bytes = self.P * 2 * self.IE * self.D * w13.element_size()
        self.down_bytes = self.P * self.D * self.IE * w13.element_size()

    def gate_up(self, i: int, tile=None):
        from metrale_graph.ops.moe import direct

        bn, bk, warps = tile or direct.tile("gate_up", self.IE, self.D, self.w13.dtype)
        direct._moe_direct_gate_up_kernel[(self.P * triton.cdiv(self.IE, bn),)](
            self.x[i], self.w13, self.act[i], self.e[i], self.P, 0, self.EL, self.IE, self.D, self.x[i].stride(0),
            self.w13.stride(0), self.w13.stride(1), TOP_K=self.k, BN=bn, BK=bk, EVEN_K=self.D % bk == 0, FP32=False,
            num_warps=warps)

    def down(self, i: int, tile=None):
        from metrale_graph.ops.moe import direct

        bn, bk, warps = tile or direct.tile("down", self.D, self.IE, self.w2.dtype)
        direct._moe_direct_down_kernel[(self.P * triton.cdiv(self.D, bn),)](
            self.act[i], self.w2, self.y[i], self.e[i], self.w[i], self.P, 0, self.EL, self.D, self.IE,
            self.w2.stride(0), self.w2.stride(1), BN=bn, BK=bk, EVEN_K=self.IE % bk == 0, FP32=False, num_warps=warps)

    def prefetch(self, i: int, BN: int, BK: int, warps: int):
        _prefetch_gate_up_kernel[(self.P * triton.cdiv(self.IE, BN),)](
            self.x[i], self.w13, self.act[i], self.e[i], self.IE, self.D, self.x[i].stride(0), self.w13.stride(0),
            self.w13.stride(1), TOP_K=self.k, BN=BN, BK=BK, num_warps=warps)

    def dot_gate_up(self, i: int, BN: int, BK: int, stages: int, warps: int):
        _dot_gate_up_kernel[(self.P * triton.cdiv(self.IE, BN),)](
            self.x[i], self.w13, self.act[i], self.e[i], self.IE, self.D, self.x[i].stride(0), self.w13.stride(0),
            self.w13.stride(1), TOP_K=self.k, BN=BN, BK=BK, STAGES=stages, num_warps=warps)

    def dot_down(self, i: int, BN: int, BK: int, stages: int, warps: int):
        _dot_down_kernel[(self.P * triton.cdiv(self.D, BN),)](
            self.act[i], self.w2, self.y[i], self.e[i], self.w[i], self.D, self.IE, self.w2.stride(0),
            self.w2.stride(1), BN=BN, BK=BK, STAGES=stages, num_warps=warps)

    def split(self, i: int, S: int, BN: int, BK: int, warps: int, part: torch.Tensor):
        _split_gate_up_kernel[(self.P * triton.cdiv(self.IE, BN), S)](
            self.x[i], self.w13, part, self.e[i], self.P, self.IE, self.D, self.D // S, self.x[i].stride(0),
            self.w13.stride(0), self.w13.stride(1), TOP_K=self.k, BN=BN, BK=BK, num_warps=warps)
        _split_finish_kernel[(triton.cdiv(self.P * self.IE, 1024),)](part, self.act[i], self.P, self.IE, S=S,
                                                                     BLOCK=1024, num_warps=4)


def rotated(fn):
    """A call of fn(i) for each routing i in turn."""
    return lambda: [fn(i) for i in range(ROTATE)]


def measure(preset: str, T: int, w13: torch.Tensor, w2: torch.Tensor, layers: int = 1) -> dict:
    from metrale_graph.ops.moe import direct

    c = Case(PRESETS[preset], T, w13, w2, layers)
    rows = []

    def timed(name: str, fn, nbytes: int, check=None):
        ms, err = attempt(lambda: graph_ms(rotated(fn)) / ROTATE)
        row = {"form": name, "us": None if ms is None else round(ms * 1e3, 2), "error": err,
               "TB_s": None if ms is None else round(nbytes / (ms * 1e-3) / 1e12, 2)}
        if check is not None and err is None:
            row["vs_rows"] = check()
        rows.append(row)

    timed("gate_up default *", c.gate_up, c.gate_up_bytes)
    ref = [a.clone() for a in c.act]
    check = lambda: max(rel(a, r) for a, r in zip(c.act, ref))  # noqa: E731
    for bn, bk, w in direct.CANDIDATES:
        if bk <= c.D and c.D % bk == 0:
            timed(f"gate_up {bn}x{bk}/{w}", lambda i, t=(bn, bk, w): c.gate_up(i, t), c.gate_up_bytes, check)
    for bn, bk, w in ((8, 512, 4), (16, 256, 4), (16, 512, 8), (32, 128, 4), (32, 256, 8)):
        timed(f"gate_up prefetch {bn}x{bk}/{w}", lambda i, a=(bn, bk, w): c.prefetch(i, *a), c.gate_up_bytes, check)
    for bn, bk, st, w in DOT_TILES:
        timed(f"gate_up dot {bn}x{bk}/{st}/{w}", lambda i, a=(bn, bk, st, w): c.dot_gate_up(i, *a), c.gate_up_bytes,
              check)
    for S in SPLITS:
        part = torch.empty(S, 2, c.P, c.IE, device=w13.device)
        for bn, bk, w in ((16, 256, 4), (16, 512, 8), (32, 128, 4), (32, 256, 8), (64, 128, 8)):
            if c.D % (S * bk) == 0:
                timed(f"gate_up split {S} {bn}x{bk}/{w}", lambda i, a=(S, bn, bk, w), part=part: c.split(i, *a, part),
                      c.gate_up_bytes, check)
    timed("down default *", c.down, c.down_bytes)
    for bn, bk, w in direct.CANDIDATES:
        if bk <= c.IE:
            timed(f"down {bn}x{bk}/{w}", lambda i, t=(bn, bk, w): c.down(i, t), c.down_bytes)
    yref = [y.clone() for y in c.y]
    check_down = lambda: max(rel(a, r) for a, r in zip(c.y, yref))  # noqa: E731
    for bn, bk, st, w in DOT_TILES:
        if bk <= c.IE:
            timed(f"down dot {bn}x{bk}/{st}/{w}", lambda i, a=(bn, bk, st, w): c.dot_down(i, *a), c.down_bytes,
                  check_down)
    gathered = [w13[e].contiguous() for e in c.e]  # [P, 2 IE, D] each
    xs = [x.repeat_interleave(c.k, 0).unsqueeze(-1) for x in c.x]
    timed("bmm (pre-gathered)", lambda i: torch.bmm(gathered[i], xs[i]), c.gate_up_bytes)
    timed("sum (pre-gathered)", lambda i: gathered[i].view(-1, 4096).sum(dim=1), c.gate_up_bytes)
    return {"preset": preset, "tokens": T, "pairs": c.P, "gate_up_MB": round(c.gate_up_bytes / 1e6, 1),
            "down_MB": round(c.down_bytes / 1e6, 1), "rows": rows}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/kernels/check_moe_direct.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3.5-35b-a3b", choices=[n for n, c in PRESETS.items()
                                                                   if c.moe_layers and c.quantization is None])
    p.add_argument("--tokens", type=positive_ints, default="1,4", help="tokens a call (x top_k pairs); 4: a k 3 verify")
    p.add_argument("--layers", type=positive_int, default=1,
                   help="layers' expert weights, routing i reading layer i %% LAYERS's (as a model step walks through "
                        "its layers: cold L2 and TLB); the routings a timed call runs: max(8, LAYERS)")
    p.add_argument("--json", type=output_file, default=None)
    args = p.parse_args(argv)
    global ROTATE
    ROTATE = max(ROTATE, args.layers)
    if not torch.cuda.is_available():
        p.exit(1, f"{p.prog}: error: this check needs a CUDA GPU; torch sees none\n")
    cfg = PRESETS[args.preset]
    E, IE, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    g = torch.Generator(device="cuda").manual_seed(1)
    L = args.layers
    w13 = torch.empty(L * E, 2 * IE, D, device="cuda", dtype=torch.bfloat16).normal_(0, D ** -0.5, generator=g)
    w2 = torch.empty(L * E, D, IE, device="cuda", dtype=torch.bfloat16).normal_(0, IE ** -0.5, generator=g)
    cases = []
    for T in args.tokens:
        case = measure(args.preset, T, w13, w2, L)
        cases.append(case)
        print(f"\n{args.preset}, {T} token(s), {case['pairs']} pairs: gate|up {case['gate_up_MB']} MB, down "
              f"{case['down_MB']} MB a call, {ROTATE} routings in turn, {torch.cuda.get_device_name()}")
        print_table(["form", "us", "TB/s", "vs rows", "error"],
                    [[r["form"], r["us"] if r["us"] is not None else "-", r["TB_s"] or "-",
                      f"{r['vs_rows']:.1e}" if "vs_rows" in r else "-", r["error"] or ""] for r in case["rows"]])
    record = {"tool": "check_moe_direct", "device": torch.cuda.get_device_name(), **provenance(argv), "layers": L,
              "cases": cases}
    if args.json:
        import json

        write_whole(args.json, json.dumps(record, indent=1))
    print_json(record)


if __name__ == "__main__":
    main()

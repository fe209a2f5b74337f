"""The feed-forward half of a sparse-MoE layer (Qwen3.5-MoE, Qwen3.6, Qwen3-Next): post-attention
RMSNorm, router, top-k experts, shared expert, residual add:

    n = rms_norm(h)
    p = softmax(n @ router_w.T) in fp32;  w, e = top_k(p);  w /= sum(w) if norm_topk;  w in h's dtype
    out = h + sum_j w_j * down_e(silu(gate_e(n)) * up_e(n)) + sigmoid(n @ shared_expert_gate_w.T) * shared(n)

Token-local: no stream metadata. Routing is data-dependent, shapes are not: the CUDA path
sorts token-expert pairs by expert on the device into buffers whose sizes follow from T,
top_k and the number of experts alone, so a bucket's CUDA graph is static.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from . import kernels
from .common import INTERPRET, check, check_tensor, rms_norm
from .registry import OpSpec, Shapes, metrale_cuda, metrale_fake, metrale_op, norm_weight, rand, register, weight

_ROUND_BF16_BITS = tl.constexpr(INTERPRET)  # see _rnd


def _check(a):
    check_tensor(a.h, "h", ndim=2)
    D = a.h.shape[1]
    check(tuple(a.norm_w.shape) == (D,), f"norm_w must have shape ({D},), got {tuple(a.norm_w.shape)}")
    E, EL, IE, IS = a.router_w.shape[0], a.w13.shape[0], a.w2.shape[-1], a.shared_down_w.shape[-1]
    first = a.first_expert
    check(isinstance(first, int) and 0 <= first and first + EL <= E,
          f"experts {first}..{first + EL - 1} are not among the router's {E}")
    for name, shape in (("router_w", (E, D)), ("w13", (EL, 2 * IE, D)), ("w2", (EL, D, IE)),
                        ("shared_gate_w", (IS, D)), ("shared_up_w", (IS, D)), ("shared_down_w", (D, IS)),
                        ("shared_expert_gate_w", (1, D))):
        w = getattr(a, name)
        check_tensor(w, name, ndim=len(shape), dtype=a.h.dtype, device=a.h.device)
        check(tuple(w.shape) == shape, f"{name} has shape {tuple(w.shape)}, expected {shape}")
    check(isinstance(a.top_k, int) and 1 <= a.top_k <= E, f"top_k must be in 1..{E} (the experts), got {a.top_k}")


@metrale_op(check=_check)
def moe(h: Tensor, norm_w: Tensor, router_w: Tensor, w13: Tensor, w2: Tensor, shared_gate_w: Tensor,
        shared_up_w: Tensor, shared_down_w: Tensor, shared_expert_gate_w: Tensor, top_k: int, norm_topk: bool,
        eps: float, first_expert: int = 0, add_residual: bool = True) -> Tensor:
    """Sparse MoE block with its norm and residual. The CPU reference: plain torch, op for op as
    transformers' Qwen3_5MoeSparseMoeBlock (experts in ascending order, each over the tokens that
    chose it: a host loop).

    Args:
        h: [T, D] the residual stream after the mixer (model dtype).
        norm_w: [D] zero-centred post-attention RMSNorm weight.
        router_w: [E, D] router.
        w13: [EL, 2*IE, D] each expert's gate rows then up rows (transformers' experts.gate_up_proj)
            for experts first_expert .. first_expert + EL - 1 (EL = E without tensor parallelism).
        w2: [EL, D, IE] each of those experts' down projection (experts.down_proj).
        shared_gate_w, shared_up_w: [IS, D]; shared_down_w: [D, IS]: the shared expert.
        shared_expert_gate_w: [1, D] the shared expert's sigmoid gate.
        top_k: experts per token (1..E). norm_topk: renormalize the top-k weights to sum 1.
        eps: RMSNorm epsilon.
        first_expert, add_residual: tensor parallelism. Experts split across ranks: this rank computes
            its EL experts (from first_expert) for every token that routes to them (the router still
            sees all E). Split within each expert (the default, first_expert 0): w13 / w2 hold this
            rank's IE slice of every expert. Either way only rank 0 adds the residual, and the
            all-reduce after the op sums the ranks.
    Returns:
        [T, D] the layer output (h + ..., or without h), h's dtype. Mutates nothing.
    """
    n = rms_norm(h, norm_w, eps)
    top_w, top_e = route(n, router_w, top_k, norm_topk)
    ffn = (routed_experts(n, top_w, top_e, w13, w2, first_expert)
           + shared_expert(n, shared_gate_w, shared_up_w, shared_down_w, shared_expert_gate_w))
    return (h + ffn if add_residual else ffn).contiguous()  # h + ffn follows h's layout


@metrale_fake(moe)
def _(a):
    return a.h.new_empty(a.h.shape)  # contiguous whatever h's layout, as the CUDA path's and the reference's


def route(n, router_w, top_k, norm_topk):
    """transformers' TopKRouter: softmax in fp32, top-k, optional renormalization, weights back in the
    model dtype. Returns (weights [T, k], expert ids [T, k] int64)."""
    return select_experts(F.linear(n, router_w), top_k, norm_topk)


def select_experts(logits, top_k, norm_topk):
    """Router logits [T, E] (model dtype) -> (weights [T, k] in the logits' dtype, expert ids [T, k] int64)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_w, top_e = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w.to(logits.dtype), top_e


def shared_expert(n, shared_gate_w, shared_up_w, shared_down_w, shared_expert_gate_w):
    out = F.linear(F.silu(F.linear(n, shared_gate_w)) * F.linear(n, shared_up_w), shared_down_w)
    return torch.sigmoid(F.linear(n, shared_expert_gate_w)) * out


def routed_experts(n, top_w, top_e, w13, w2, first_expert=0):
    """sum_j w_j * down_e(silu(gate_e(n)) * up_e(n)) over this rank's experts (w13 / w2 hold experts
    first_expert ..), each over the tokens that chose it, in ascending order (a host loop)."""
    out = torch.zeros_like(n)
    for e in torch.unique(top_e).tolist():
        if not first_expert <= e < first_expert + w13.shape[0]:
            continue  # another tensor-parallel rank's expert
        token, slot = torch.where(top_e == e)
        gate, up = F.linear(n[token], w13[e - first_expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e - first_expert]) * top_w[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


# The CUDA path -----------------------------------------------------------------------------------
# Token-expert pairs p = t * top_k + j (token t's j-th choice) are sorted by expert into groups, each
# padded to a multiple of BM rows, so every BM-row block of the sorted list belongs to one expert.
# The number of sorted rows depends on (T, top_k, E, BM) alone: P + min(E, P) * (BM - 1) rows
# (P = T * top_k pairs; each of at most min(E, P) non-empty groups wastes at most BM - 1 rows), rounded
# down to whole blocks (the padded total is a multiple of BM). So a bucket's graph is static: the
# routing only changes the contents of the sorted ids and of the per-block expert ids.


def block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per grouped-GEMM block for a call with this many pairs and experts: about the average
    group size (a static choice: shapes only). Small groups waste less padding with small blocks;
    large groups reuse each weight tile over more rows with large ones."""
    if INTERPRET:
        return 16
    per_expert = num_pairs / max(num_experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64 if per_expert <= 256 else 128


def align_size(num_pairs: int, num_experts: int, block: int) -> int:
    """Blocks of `block` sorted rows that hold any routing of `num_pairs` pairs over `num_experts`."""
    return (num_pairs + min(num_experts, num_pairs) * (block - 1)) // block


def align_pairs_torch(top_e: Tensor, num_experts: int, block: int) -> tuple[Tensor, Tensor]:
    """align_pairs in plain torch ops (the tests' oracle; about twenty launches where align_pairs makes three)."""
    P, E, dev = top_e.numel(), num_experts, top_e.device
    nblk = align_size(P, E, block)
    experts, order = torch.sort(top_e.reshape(-1).to(torch.int32), stable=True)
    first = torch.searchsorted(experts, torch.arange(E + 1, device=dev, dtype=torch.int32)).long()  # group bounds
    padded = (first[1:] - first[:-1] + block - 1) // block * block
    start = torch.zeros(E + 1, dtype=torch.int64, device=dev)  # padded group bounds in sorted rows
    start[1:] = torch.cumsum(padded, 0)
    experts = experts.long()
    dest = start[experts] + torch.arange(P, device=dev) - first[experts]  # sorted row of each sorted pair
    sorted_ids = torch.full((nblk * block,), P, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    owner = torch.searchsorted(start[1:], torch.arange(nblk, device=dev) * block, right=True)  # E: past the end
    return sorted_ids, torch.where(owner < E, owner, -1).to(torch.int32)


@triton.jit
def _moe_align_groups_kernel(experts_ptr, first_ptr, start_ptr, P, E, steps, BM: tl.constexpr,
                             BLOCK_E: tl.constexpr):
    """One program over all experts: first[e] = the first sorted pair of expert e (binary search of the
    sorted expert ids, e = 0..E; first[E] = P), start[e] = the first sorted row of its padded group."""
    e = tl.arange(0, BLOCK_E)
    lo = tl.zeros((BLOCK_E,), dtype=tl.int32)  # lower bounds of e and e + 1, searched side by side
    hi = tl.zeros((BLOCK_E,), dtype=tl.int32) + P
    lo1 = tl.zeros((BLOCK_E,), dtype=tl.int32)
    hi1 = tl.zeros((BLOCK_E,), dtype=tl.int32) + P
    for _ in range(steps):
        mid = (lo + hi) // 2
        go = (lo < hi) & (tl.load(experts_ptr + mid, mask=lo < hi, other=0) < e)
        lo, hi = tl.where(go, mid + 1, lo), tl.where(go | (lo >= hi), hi, mid)
        mid1 = (lo1 + hi1) // 2
        go1 = (lo1 < hi1) & (tl.load(experts_ptr + mid1, mask=lo1 < hi1, other=0) < e + 1)
        lo1, hi1 = tl.where(go1, mid1 + 1, lo1), tl.where(go1 | (lo1 >= hi1), hi1, mid1)
    padded = tl.where(e < E, (lo1 - lo + BM - 1) // BM * BM, 0)
    tl.store(first_ptr + e, lo, mask=e <= E)
    tl.store(start_ptr + e, tl.cumsum(padded, 0) - padded, mask=e <= E)


@triton.jit
def _moe_align_rows_kernel(order_ptr, first_ptr, start_ptr, ids_ptr, block_expert_ptr, P, E, BM: tl.constexpr,
                           BLOCK_E: tl.constexpr):
    """One program per block of BM sorted rows: its expert (-1 past the last group) and its rows' pair
    ids (the sentinel P on padding rows)."""
    b = tl.program_id(0)
    r0 = b * BM
    e_vec = tl.arange(0, BLOCK_E)
    ends = tl.load(start_ptr + 1 + e_vec, mask=e_vec < E, other=2147483647)  # padded group ends
    e = tl.sum((ends <= r0).to(tl.int32), 0)  # groups ending at or before this block: its expert (E: none)
    rows = tl.arange(0, BM)
    if e < E:
        tl.store(block_expert_ptr + b, e)
        first = tl.load(first_ptr + e)
        idx = r0 - tl.load(start_ptr + e) + rows
        valid = idx < tl.load(first_ptr + e + 1) - first
        pair = tl.load(order_ptr + first + idx, mask=valid, other=0).to(tl.int32)
        tl.store(ids_ptr + r0 + rows, tl.where(valid, pair, P))
    else:
        tl.store(block_expert_ptr + b, -1)
        tl.store(ids_ptr + r0 + rows, tl.zeros((BM,), dtype=tl.int32) + P)


def align_pairs(top_e: Tensor, num_experts: int, block: int) -> tuple[Tensor, Tensor]:
    """Sort the pairs of top_e [T, k] (expert ids) by expert, on the device and without a host sync:
    a stable sort, then two Triton launches.

    Returns:
        sorted_ids: [NBLK * block] int32 pair ids p = t * k + j: expert 0's pairs (in pair order), padded
            with the sentinel P = T * k to a multiple of `block` rows, then expert 1's, ...; rows past the
            last group also hold the sentinel.
        block_expert: [NBLK] int32 the expert of each block, -1 for blocks past the last group.
    NBLK = align_size(P, E, block): it depends on the shapes alone.
    """
    P, E, dev = top_e.numel(), num_experts, top_e.device
    nblk = align_size(P, E, block)
    sorted_ids = torch.empty(nblk * block, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nblk, dtype=torch.int32, device=dev)
    if nblk == 0:
        return sorted_ids, block_expert
    experts, order = torch.sort(top_e.reshape(-1).to(torch.int32), stable=True)  # pair order within an expert
    first = torch.empty(E + 1, dtype=torch.int32, device=dev)
    start = torch.empty(E + 1, dtype=torch.int32, device=dev)
    BLOCK_E = triton.next_power_of_2(E + 1)
    _moe_align_groups_kernel[(1,)](experts, first, start, P, E, P.bit_length(), BM=block, BLOCK_E=BLOCK_E)
    _moe_align_rows_kernel[(nblk,)](order, first, start, sorted_ids, block_expert, P, E, BM=block,
                                    BLOCK_E=BLOCK_E)
    return sorted_ids, block_expert


@triton.jit
def _moe_route_kernel(logits_ptr, w_ptr, e_ptr, stride_l, E, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_E: tl.constexpr, NORM: tl.constexpr):
    """One program per token: softmax of its E router logits in fp32, the TOP_K largest (descending;
    of equal ones the lowest expert, as torch.topk), renormalized if NORM; weights stored in the
    output's dtype, expert ids as int64. select_experts' torch expression in one launch."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    m = cols < E
    x = tl.load(logits_ptr + row * stride_l + cols, mask=m, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    # probabilities are >= 0; below them a NaN (a padding row's unspecified activations) is -1, a taken
    # expert -2 and a column past E -3: the k ids are distinct and in range, as torch.topk's
    p = tl.where(m, tl.where(p == p, p, -1.0), -3.0)
    ks = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_e = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        e = tl.min(tl.where(p == best, cols, BLOCK_E), 0)  # the lowest expert holding the maximum
        top_w = tl.where(ks == j, best, top_w)
        top_e = tl.where(ks == j, e.to(tl.int64), top_e)
        p = tl.where(cols == e, -2.0, p)
    if NORM:
        top_w = top_w / tl.sum(top_w, 0)  # the lanes past TOP_K hold 0
    mk = ks < TOP_K
    tl.store(w_ptr + row * TOP_K + ks, _rnd(top_w, w_ptr.dtype.element_ty), mask=mk)
    tl.store(e_ptr + row * TOP_K + ks, top_e, mask=mk)


def route_topk(logits: Tensor, top_k: int, norm_topk: bool) -> tuple[Tensor, Tensor]:
    """select_experts in one Triton launch (it is five torch launches: softmax, topk, sum, divide,
    cast): logits [T, E] with unit inner stride -> (weights [T, k] in the logits' dtype, ids [T, k]
    int64)."""
    T, E = logits.shape
    top_w = torch.empty((T, top_k), dtype=logits.dtype, device=logits.device)
    top_e = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    if T:
        _moe_route_kernel[(T,)](logits, top_w, top_e, logits.stride(0), E, TOP_K=top_k,
                                BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E),
                                NORM=norm_topk)
    return top_w, top_e


def _gemm_configs(acc_tiles: int):
    """(BN, BK, warps, stages) candidates; BM is fixed by the alignment (block_m), not tuned."""
    if INTERPRET:
        return [triton.Config({"BN": 32, "BK": 32, "GROUP_M": 8}, num_warps=4)]
    tiles = ((32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (64, 64, 8, 4), (128, 64, 4, 4), (128, 64, 8, 3))
    if acc_tiles == 1:
        tiles += ((256, 64, 8, 3),)
    return [triton.Config({"BN": bn, "BK": bk, "GROUP_M": 8}, num_warps=w, num_stages=st) for bn, bk, w, st in tiles]


def _prune(acc_tiles: int):
    """Drop tiles far wider than the problem, and accumulators that cannot stay in registers."""
    def prune(configs, named_args, **kwargs):
        N, K, BM = named_args["N"], named_args["K"], kwargs["BM"]
        keep = [c for c in configs if c.kwargs["BN"] <= max(32, triton.next_power_of_2(N))
                and c.kwargs["BK"] <= max(32, triton.next_power_of_2(K))
                and acc_tiles * BM * c.kwargs["BN"] <= 128 * 128]
        return keep or [min(configs, key=lambda c: c.kwargs["BN"] * c.kwargs["BK"])]
    return prune


_EVEN_K = {"EVEN_K": lambda a: a["K"] % a["BK"] == 0}


@triton.jit
def _tile(pid, num_blocks, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Program -> (row block, column tile), GROUP_M row blocks at a time: consecutive programs share a
    weight tile (same expert) in L2."""
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_blocks - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _rnd(x, dt: tl.constexpr):
    """x (fp32) rounded to dt, kept in fp32. Triton 3.6's interpreter truncates fp32 -> bf16 casts (rounds
    toward zero), which biases every rounding point; there bf16 is rounded to nearest even on the bits, so
    the CPU suite sees the GPU's numerics. Stores of a _rnd value cast exactly."""
    if _ROUND_BF16_BITS and dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(dt).to(tl.float32)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, acc)


# autotuned per (N, K, BM) and dtypes; warmup runs every bucket before capture, so no tuning runs in a graph
@triton.autotune(configs=_gemm_configs(2), key=["N", "K", "BM"], prune_configs_by={"early_config_prune": _prune(2)},
                 cache_results=True)
@triton.heuristics(_EVEN_K)
@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, act_ptr, ids_ptr, expert_ptr, num_pairs, num_blocks, N, K, stride_x,
                        stride_we, stride_wn, TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    """act[p, n] = silu(x[t] . w[e, n]) * (x[t] . w[e, N + n]) for the pairs p = t * TOP_K + j of one block
    (expert e); the gate and up tiles of the same columns are computed side by side."""
    pid_m, pid_n = _tile(tl.program_id(0), num_blocks, N, BM, BN, GROUP_M)
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    if e < 0:  # blocks past the last group
        return
    pair = tl.load(ids_ptr + pid_m * BM + tl.arange(0, BM))
    valid = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    k = tl.arange(0, BK)
    x_ptrs = x_ptr + token[:, None] * stride_x + k[None, :]
    g_ptrs = w_ptr + e * stride_we + (cols % N).to(tl.int64)[None, :] * stride_wn + k[:, None]  # [BK, BN]
    u_ptrs = g_ptrs + N * stride_wn
    gate = tl.zeros((BM, BN), dtype=tl.float32)
    up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=valid[:, None], other=0.0)
            wg = tl.load(g_ptrs)
            wu = tl.load(u_ptrs)
        else:
            mk = k < K - k0
            x = tl.load(x_ptrs, mask=valid[:, None] & mk[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=mk[:, None], other=0.0)
            wu = tl.load(u_ptrs, mask=mk[:, None], other=0.0)
        gate = _dot(x, wg, gate, IEEE)
        up = _dot(x, wu, up, IEEE)
        x_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    # rounded where transformers rounds: gate and up in the model dtype, silu(gate), the product
    dt = act_ptr.dtype.element_ty
    gate = _rnd(gate, dt)
    y = _rnd(_rnd(gate * tl.sigmoid(gate), dt) * _rnd(up, dt), dt).to(dt)
    tl.store(act_ptr + pair.to(tl.int64)[:, None] * N + cols[None, :], y, mask=valid[:, None] & (cols < N)[None, :])


@triton.autotune(configs=_gemm_configs(1), key=["N", "K", "BM"], prune_configs_by={"early_config_prune": _prune(1)},
                 cache_results=True)
@triton.heuristics(_EVEN_K)
@triton.jit
def _moe_down_kernel(act_ptr, w_ptr, y_ptr, ids_ptr, expert_ptr, rw_ptr, num_pairs, num_blocks, N, K, stride_we,
                     stride_wn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                     EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    """y[p, n] = (act[p] . w[e, n]) * rw[p] for the pairs p of one block (expert e)."""
    pid_m, pid_n = _tile(tl.program_id(0), num_blocks, N, BM, BN, GROUP_M)
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    pair = tl.load(ids_ptr + pid_m * BM + tl.arange(0, BM))
    valid = pair < num_pairs
    rows = pair.to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    k = tl.arange(0, BK)
    a_ptrs = act_ptr + rows[:, None] * K + k[None, :]
    w_ptrs = w_ptr + e * stride_we + (cols % N).to(tl.int64)[None, :] * stride_wn + k[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            mk = k < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & mk[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mk[:, None], other=0.0)
        acc = _dot(a, w, acc, IEEE)
        a_ptrs += BK
        w_ptrs += BK
    # the expert's output in the model dtype, times the routing weight (model dtype), rounded
    dt = y_ptr.dtype.element_ty
    rw = tl.load(rw_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    y = _rnd(_rnd(acc, dt) * rw[:, None], dt).to(dt)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y, mask=valid[:, None] & (cols < N)[None, :])


@triton.jit
def _moe_combine_kernel(h_ptr, n_ptr, seg_w_ptr, y_ptr, shared_ptr, out_ptr, D, stride_h, TOP_K: tl.constexpr,
                        BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr):
    """out[t] = h[t] + (sum_j y[t * TOP_K + j] + sigmoid(n[t] . seg_w) * shared[t]), one program per token:
    the shared-expert gate's dot product, the pair sum in fp32 in a fixed order (deterministic, no
    atomics), then rounded as transformers rounds its terms."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    dt = out_ptr.dtype.element_ty
    n = tl.load(n_ptr + t * D + cols, mask=m, other=0.0).to(tl.float32)
    logit = _rnd(tl.sum(n * tl.load(seg_w_ptr + cols, mask=m, other=0.0).to(tl.float32), 0), dt)
    sig = _rnd(tl.sigmoid(logit), dt)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j) * D + cols, mask=m, other=0.0).to(tl.float32)
    shared = _rnd(sig * tl.load(shared_ptr + t * D + cols, mask=m, other=0.0).to(tl.float32), dt)
    ffn = _rnd(_rnd(acc, dt) + shared, dt)
    if ADD_RESIDUAL:
        ffn = _rnd(tl.load(h_ptr + t * stride_h + cols, mask=m, other=0.0).to(tl.float32) + ffn, dt)
    tl.store(out_ptr + t * D + cols, ffn.to(dt), mask=m)


def _inner_contiguous(w: Tensor) -> Tensor:
    return w if w.stride(-1) == 1 else w.contiguous()


@metrale_cuda(moe)
def moe_cuda(a):
    """Triton norm; one GEMM for the projections of the normed input (shared gate | shared up | router:
    free when the model stores them back to back in that order); routing as transformers, in one kernel
    (route_topk); pairs sorted by expert on the device (align_pairs); grouped GEMM gate|up with SiLU-mul
    in its epilogue; grouped GEMM down with the routing weight in its epilogue; one combine kernel (the
    shared-expert gate's dot product, pair sum, gated shared expert, residual). No host sync; every size
    follows from T, top_k and E. (The one-row shared-expert gate stays out of the GEMM: it would make the
    output rows 2 * IS + E + 1 wide, unaligned for cuBLAS.)"""
    h, top_k, first_expert = a.h, a.top_k, a.first_expert
    T, D = h.shape
    E, EL, IE, IS = a.router_w.shape[0], a.w13.shape[0], a.w2.shape[-1], a.shared_down_w.shape[-1]
    if T == 0:
        return torch.empty_like(h, memory_format=torch.contiguous_format)
    h = h if h.stride(-1) == 1 else h.contiguous()
    n = kernels.rms_norm(h, a.norm_w, a.eps)  # [T, D] contiguous
    dense = n @ kernels.stacked(a.shared_gate_w, a.shared_up_w, a.router_w).t()  # [T, 2IS + E]
    shared = kernels.silu_mul(dense[:, :2 * IS]) @ a.shared_down_w.t()  # [T, D]
    top_w, top_e = route_topk(dense[:, 2 * IS:2 * IS + E], top_k, a.norm_topk)

    P = T * top_k
    if EL < E:  # tensor parallelism: other ranks' experts go to a group of their own, whose blocks are skipped
        top_e = top_e - first_expert
        top_e = torch.where((top_e >= 0) & (top_e < EL), top_e, EL)
    BM = block_m(P, EL)
    sorted_ids, block_expert = align_pairs(top_e, EL + (EL < E), BM)
    if EL < E:
        block_expert = torch.where(block_expert == EL, -1, block_expert)
    nblk = block_expert.shape[0]
    w13, w2 = _inner_contiguous(a.w13), _inner_contiguous(a.w2)
    ieee = h.dtype == torch.float32 or INTERPRET
    act = h.new_empty(P, IE)
    _moe_gate_up_kernel[lambda meta: (nblk * triton.cdiv(IE, meta["BN"]),)](
        n, w13, act, sorted_ids, block_expert, P, nblk, IE, D, n.stride(0), w13.stride(0), w13.stride(1),
        TOP_K=top_k, BM=BM, IEEE=ieee)
    y = h.new_empty(P, D) if EL == E else h.new_zeros(P, D)  # pairs of other ranks' experts: 0
    _moe_down_kernel[lambda meta: (nblk * triton.cdiv(D, meta["BN"]),)](
        act, w2, y, sorted_ids, block_expert, top_w.reshape(-1), P, nblk, D, IE, w2.stride(0), w2.stride(1),
        BM=BM, IEEE=ieee)
    out = torch.empty((T, D), dtype=h.dtype, device=h.device)
    block = triton.next_power_of_2(D)
    _moe_combine_kernel[(T,)](h, n, _inner_contiguous(a.shared_expert_gate_w), y, shared, out, D, h.stride(0),
                              TOP_K=top_k, BLOCK=block, ADD_RESIDUAL=a.add_residual,
                              num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16)
    return out


def example(s: Shapes, dtype, g):
    return (rand(g, s.T, s.D, dtype=dtype), norm_weight(g, s.D, dtype), weight(g, s.E, s.D, dtype=dtype),
            weight(g, s.E, 2 * s.IE, s.D, dtype=dtype), weight(g, s.E, s.D, s.IE, dtype=dtype),
            weight(g, s.IS, s.D, dtype=dtype), weight(g, s.IS, s.D, dtype=dtype), weight(g, s.D, s.IS, dtype=dtype),
            weight(g, 1, s.D, dtype=dtype), s.TOPK, True, s.eps)


def cost(s: Shapes):
    """Active FLOPs (router, top-k experts, shared expert), and bytes: the weights of the experts a
    batch can touch (at most min(E, T * top_k)), the dense weights, activations in and out."""
    T, D = s.T, s.D
    flops = 2 * T * (s.E * D + s.TOPK * 3 * D * s.IE + 3 * D * s.IS + D)
    touched = min(s.E, T * s.TOPK)
    return flops, 2 * (touched * 3 * D * s.IE + (s.E + 3 * s.IS + 1) * D + 2 * T * D)


register(OpSpec(moe, example, cost, cuda=moe_cuda,
                kernels=("_moe_route", "_moe_align", "_moe_gate_up", "_moe_down", "_moe_combine"),
                onnx="metrale_graph.onnx.translations:moe"))

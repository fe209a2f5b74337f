"""The alignment of token-expert pairs to grouped-GEMM blocks, on the device and without a host sync.

Token-expert pairs p = t * top_k + j (token t's j-th choice) are sorted by expert into groups, each
padded to a multiple of BM rows, so every BM-row block of the sorted list belongs to one expert.
The number of sorted rows depends on (T, top_k, E, BM) alone: P + min(E, P) * (BM - 1) rows
(P = T * top_k pairs; each of at most min(E, P) non-empty groups wastes at most BM - 1 rows), rounded
down to whole blocks (the padded total is a multiple of BM). So a bucket's graph is static: the
routing only changes the contents of the sorted ids and of the per-block expert ids.
tests/kernel_oracles.py has the same alignment in torch ops.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..common import INTERPRET

# align_pairs sorts the pairs by expert with _moe_count_sort_kernel up to COUNT_SORT_MAX_PAIRS pairs, torch.sort(
# stable=True) above them and for CPU tensors outside Triton's interpreter: the same result. Measured on the H200
# at 820b41b (BENCHMARKS.md, MoE): at decode sizes CUDA runs torch.sort as one warp's radixSortKVInPlace (0.75 ms
# of a D32 step); the counting sort took the 35B-A3B's D32 device time from 15.78 to 15.04 ms (and D1's, when it
# was aligned, from 4.69 to 4.46). Tests reach the torch.sort path by lowering COUNT_SORT_MAX_PAIRS.
COUNT_SORT_MAX_PAIRS = 4096  # its work grows as P^2 / COUNT_BLOCK per program
COUNT_BLOCK = 64


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


@triton.jit
def _moe_count_sort_kernel(e_ptr, experts_ptr, order_ptr, P, BLOCK: tl.constexpr):
    """torch.sort(e, stable=True) of P expert ids by counting, one program per BLOCK pairs i: pos[i] =
    #{j : e[j] < e[i]} + #{j < i : e[j] == e[i]} over all P pairs, BLOCK x BLOCK comparisons at a time; then
    experts[pos[i]] = e[i], order[pos[i]] = i. The positions are a permutation (ties in pair order), so
    the result is the stable sort's whatever the ids."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mi = i < P
    ei = tl.load(e_ptr + i, mask=mi, other=0)
    pos = tl.zeros((BLOCK,), dtype=tl.int32)
    for j0 in range(0, P, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ej = tl.load(e_ptr + j, mask=j < P, other=2147483647)  # past P: above every id, never counted
        before = (ej[None, :] < ei[:, None]) | ((ej[None, :] == ei[:, None]) & (j[None, :] < i[:, None]))
        pos += tl.sum(before.to(tl.int32), axis=1)
    tl.store(experts_ptr + pos, ei, mask=mi)
    tl.store(order_ptr + pos, i, mask=mi)


def sort_experts(experts: Tensor) -> tuple[Tensor, Tensor]:
    """(sorted ids, the pair order) of the int32 expert ids `experts` [P], ties in pair order:
    torch.sort(stable=True)'s values and indices: the counting sort's (indices int32) up to COUNT_SORT_MAX_PAIRS
    pairs on CUDA or under the interpreter, torch.sort's (indices int64) otherwise."""
    P = experts.numel()
    if P > COUNT_SORT_MAX_PAIRS or not (experts.is_cuda or INTERPRET) or P == 0:
        return torch.sort(experts, stable=True)
    out = torch.empty_like(experts)
    order = torch.empty(P, dtype=torch.int32, device=experts.device)
    _moe_count_sort_kernel[(triton.cdiv(P, COUNT_BLOCK),)](experts, out, order, P, BLOCK=COUNT_BLOCK)
    return out, order


def align_pairs(top_e: Tensor, num_experts: int, block: int) -> tuple[Tensor, Tensor]:
    """Sort the pairs of top_e [T, k] (expert ids) by expert, on the device and without a host sync:
    a stable sort (sort_experts), then two Triton launches.

    Returns:
        sorted_ids: [NBLK * block] int32 pair ids p = t * k + j: expert 0's pairs (in pair order), padded
            with the sentinel P = T * k to a multiple of `block` rows, then expert 1's, ...; rows past the
            last group also hold the sentinel. Pairs of a negative id (padding rows', ops/moe/routing.py) sort
            before expert 0's group and fall in no block.
        block_expert: [NBLK] int32 the expert of each block, -1 for blocks past the last group.
    NBLK = align_size(P, E, block): it depends on the shapes alone.
    """
    P, E, dev = top_e.numel(), num_experts, top_e.device
    nblk = align_size(P, E, block)
    sorted_ids = torch.empty(nblk * block, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nblk, dtype=torch.int32, device=dev)
    if nblk == 0:
        return sorted_ids, block_expert
    experts, order = sort_experts(top_e.reshape(-1).to(torch.int32).contiguous())  # pair order within an expert
    first = torch.empty(E + 1, dtype=torch.int32, device=dev)
    start = torch.empty(E + 1, dtype=torch.int32, device=dev)
    BLOCK_E = triton.next_power_of_2(E + 1)
    _moe_align_groups_kernel[(1,)](experts, first, start, P, E, P.bit_length(), BM=block, BLOCK_E=BLOCK_E)
    _moe_align_rows_kernel[(nblk,)](order, first, start, sorted_ids, block_expert, P, E, BM=block,
                                    BLOCK_E=BLOCK_E)
    return sorted_ids, block_expert


def align_local_pairs(top_e: Tensor, local_experts: int, num_experts: int, first_expert: int, block: int
                      ) -> tuple[Tensor, Tensor]:
    """align_pairs for the experts one rank holds, [first_expert, first_expert + local_experts) of
    num_experts (tensor parallelism; all of them without it): the pairs of other ranks' experts go to a group
    of their own, whose blocks are marked -1 in block_expert like the blocks past the last group, so the
    grouped GEMMs skip them. Returns (sorted_ids, block_expert) as align_pairs, expert ids local."""
    EL, E = local_experts, num_experts
    if EL < E:
        top_e = top_e - first_expert
        top_e = torch.where((top_e >= 0) & (top_e < EL), top_e, EL)
    sorted_ids, block_expert = align_pairs(top_e, EL + (EL < E), block)
    if EL < E:
        block_expert = torch.where(block_expert == EL, -1, block_expert)
    return sorted_ids, block_expert

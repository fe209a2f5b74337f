"""The routed experts through torch._grouped_mm (PyTorch's grouped GEMM; CUTLASS on sm_90): the EXPERTS_BACKEND
"grouped_mm" of the MoE op's CUDA path, the A/B partner of our aligned-block Triton GEMMs (gemm.py) that
benchmarks/kernels/check_moe_gemm.py and `tools.bench` under METRALE_MOE_EXPERTS=grouped_mm measure.

The pairs are sorted by expert (a stable sort; other ranks' experts after every local group), each group's end
found by searchsorted (no host sync: every size follows from T, top_k and the local experts), the normed rows
gathered, gate|up one grouped GEMM, SiLU-mul, down one grouped GEMM, the routing weight, and the rows put back
in pair order. Unlike the Triton kernels it rounds the down projection to the activations' dtype before the
routing weight multiplies it (one more rounding: bf16 parity, not bit equality, with the other backend)."""

import torch
from torch import Tensor

from .. import kernels


MAX_GROUPS = 1023  # torch's grouped kernels refuse 1024 groups or more


def grouped_mm_supported(dtype: torch.dtype, device: torch.device, D: int, IE: int, experts: int) -> bool:
    """Where torch._grouped_mm serves `experts` experts of hidden size D and intermediate size IE: bf16 on an
    sm_90 / sm_100 GPU (its fused kernels; elsewhere torch falls back to a loop that reads the group ends on
    the host, which CUDA graph capture forbids), any float dtype on the CPU (the interpreter's runs of the
    CUDA path); rows of D and IE elements a multiple of 16 bytes (its operands' strides must be); at most
    MAX_GROUPS groups (the local experts and, under tensor parallelism, one for the others' pairs)."""
    if not hasattr(torch, "_grouped_mm") or experts + 1 > MAX_GROUPS:
        return False
    if (D * dtype.itemsize) % 16 or (IE * dtype.itemsize) % 16:
        return False
    if device.type == "cpu":
        return True
    return (device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] in (9, 10))


def sort_pairs(top_e: Tensor, first_expert: int, local_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """The (token, expert) pairs of top_e [T, k] sorted by expert, no host sync: (mine [P] bool, the pairs of
    this rank's experts first_expert .. first_expert + local_experts - 1; order [P], the pair ids in expert
    order, others' last; offs [local_experts] int32, where each local expert's rows end)."""
    EL = local_experts
    local = top_e.reshape(-1) - first_expert
    mine = (local >= 0) & (local < EL)
    experts, order = torch.sort(torch.where(mine, local, EL).to(torch.int32), stable=True)  # others' pairs last
    ends = torch.arange(1, EL + 1, device=top_e.device, dtype=experts.dtype)
    return mine, order, torch.searchsorted(experts, ends).to(torch.int32)


def grouped_experts(x: Tensor, w13: Tensor, w2: Tensor, offs: Tensor) -> Tensor:
    """down_e(silu(gate_e(x)) * up_e(x)) [P, D] of rows x [P, D] in expert order (offs: sort_pairs'), two
    torch._grouped_mm calls; rows past offs[-1] unspecified."""
    act = kernels.silu_mul(torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs))  # [P, IE]
    return torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs)


def routed_experts_grouped_mm(n: Tensor, top_w: Tensor, top_e: Tensor, w13: Tensor, w2: Tensor, first_expert: int,
                              num_experts: int) -> Tensor:
    """y [P, D] (P = T * top_k, n's dtype): row p = t * top_k + j holds top_w[t, j] * down_e(silu(gate_e(n[t])) *
    up_e(n[t])) for e = top_e[t, j] among this rank's experts first_expert .. first_expert + EL - 1, 0 for the
    experts of other ranks (num_experts in all). w13 [EL, 2 * IE, D] (gate rows, then up rows), w2 [EL, D, IE]."""
    k, EL = top_e.shape[1], w13.shape[0]
    mine, order, offs = sort_pairs(top_e, first_expert, EL)
    out = grouped_experts(n.index_select(0, order // k), w13, w2, offs)
    out = out * top_w.reshape(-1).index_select(0, order)[:, None]
    if EL < num_experts:  # other ranks' pairs: 0 (their rows were never computed)
        out = torch.where(mine.index_select(0, order)[:, None], out, 0)
    return torch.empty_like(out).index_copy_(0, order, out)

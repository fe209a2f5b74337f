"""What the phase ops share besides the registry: plain-torch pieces of their CPU references, the
input checks, the Triton-interpreter flag, and the decode-shape rule.

Legend for shape letters used across ops/: T tokens (all streams packed), B streams,
S slots in a state pool (the last one is the scratch slot), D hidden size, I MLP size,
H / HV GDN key / value heads, K / V GDN key / value head dims, C conv channels,
W conv kernel width, NB KV blocks (the last one is the null block), BS block size,
MB blocks per stream, HQ / HKV attention query / KV heads, HD attention head dim, R rotary dims;
MoE: E experts (EL of them on this rank), IE expert intermediate size, IS shared-expert size, TOPK
experts per token.
"""

import os

import torch
from torch import Tensor

# Triton's CPU interpreter (the CPU suite sets TRITON_INTERPRET=1). Under it the kernels take their
# fp32 paths on upcast tiles (triton 3.6.0's interpreter computes bf16 tl.dot wrongly) and a single
# autotune config.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Zero-centred RMSNorm in fp32: `x * rsqrt(mean(x^2) + eps) * (1 + w)`, cast back to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


class OpInputError(ValueError):
    """A phase op was handed tensors that would compute garbage or corrupt state. Raised by an op's
    check (the registry prefixes the message with "metrale::<op>: ")."""


def check(cond: bool, msg: str) -> None:
    """Metadata-only input check (shapes, dtypes, devices): never reads device data."""
    if not cond:
        raise OpInputError(msg)


def check_tensor(t: Tensor, name: str, ndim: int | None = None, dtype=None, device=None) -> None:
    if ndim is not None:
        check(t.dim() == ndim, f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtype is not None:
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        check(t.dtype in dtypes, f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if device is not None:
        check(t.device == device, f"{name} is on {t.device}, expected {device}")


INDEX_DTYPES = (torch.int32, torch.int64)


# Decode-shaped calls ------------------------------------------------------------------------------
# A call of B streams and T tokens is decode-shaped when T <= max(DECODE_MAX_TOKENS, 2 * B). Then the
# GDN recurrence runs its recurrent kernel instead of fla's chunked kernels on a chunk-aligned layout,
# and the paged attention runs split-K instead of 64-row query tiles. Static sizes only, so every
# bucket's CUDA graph holds one path; both paths are exact for any lengths, the rule only picks the
# faster. Why this bound: docs/ops.md, "Decode-shaped calls".
DECODE_MAX_TOKENS = 64


def decode_shaped(num_streams: int, num_tokens: int) -> bool:
    """Whether a call of `num_streams` streams (padding included) and `num_tokens` tokens takes the
    decode paths. Static sizes only (a bucket's (B, T)), never device data."""
    return num_tokens <= max(DECODE_MAX_TOKENS, 2 * num_streams)

"""Plain-torch pieces shared by the phase ops' CPU references, and input checks.

Legend for shape letters used across ops/: T tokens (all streams packed), B streams,
S slots in a state pool (the last one is the scratch slot), D hidden size, I MLP size,
H / HV GDN key / value heads, K / V GDN key / value head dims, C conv channels,
W conv kernel width, NB KV blocks (the last one is the null block), BS block size,
MB blocks per stream, HQ / HKV attention query / KV heads, HD attention head dim.
"""

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Zero-centred RMSNorm in fp32: `x * rsqrt(mean(x^2) + eps) * (1 + w)`, cast back to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


class OpInputError(ValueError):
    """A phase op was handed tensors that would compute garbage or corrupt state."""


def check(cond: bool, op: str, msg: str) -> None:
    """Metadata-only input check (shapes, dtypes, devices): never reads device data."""
    if not cond:
        raise OpInputError(f"metrale::{op}: {msg}")


def check_tensor(t: Tensor, op: str, name: str, ndim: int | None = None, dtype=None, device=None) -> None:
    if ndim is not None:
        check(t.dim() == ndim, op, f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtype is not None:
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        check(t.dtype in dtypes, op, f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if device is not None:
        check(t.device == device, op, f"{name} is on {t.device}, expected {device}")


INDEX_DTYPES = (torch.int32, torch.int64)

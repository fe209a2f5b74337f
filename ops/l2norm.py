"""GDN phase 1, L2 norm of q and k per head over all stacked tokens:
`x / sqrt(sum(x^2) + 1e-6)`, computed in fp32 (as flash-linear-attention and
transformers do).
"""

import torch
from torch import Tensor

from . import kernels
from .common import check_tensor
from .registry import OpSpec, Shapes, metrale_cuda, metrale_fake, metrale_op, rand, register

EPS = 1e-6


def _check(a):
    check_tensor(a.x, "x", ndim=3)


@metrale_op(check=_check)
def l2norm(x: Tensor) -> Tensor:
    """Per-head L2 normalization.

    Args:
        x: [T, N, K] (q and k heads stacked: N = 2*H), any float dtype; may be a strided view
            into the conv output.
    Returns:
        [T, N, K] contiguous, x's dtype. Mutates nothing.
    """
    xf = x.float()
    # contiguous whatever x's layout (the elementwise result follows a dense x's), as the fake and the CUDA path
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + EPS)).to(x.dtype).contiguous()


@metrale_fake(l2norm)
def _(a):
    return a.x.new_empty(a.x.shape)


@metrale_cuda(l2norm)
def l2norm_cuda(a):
    return kernels.l2norm(a.x, EPS)


def example(s: Shapes, dtype, g):
    return (rand(g, s.T, 2 * s.H, s.K, dtype=dtype),)


def cost(s: Shapes):
    return 0, 2 * 2 * s.T * 2 * s.H * s.K


register(OpSpec(l2norm, example, cost, cuda=l2norm_cuda, kernels=("l2norm",),
                onnx="metrale_graph.onnx.translations:l2norm"))

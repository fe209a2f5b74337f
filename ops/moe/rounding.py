"""Rounding to the model dtype inside the MoE kernels, where transformers rounds (the kernels keep fp32
values rounded to bf16 / fp16 between steps)."""

import triton
import triton.language as tl

from ..common import INTERPRET

_ROUND_BF16_BITS = tl.constexpr(INTERPRET)  # see _rnd


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

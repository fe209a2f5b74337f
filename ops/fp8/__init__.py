"""FP8 compute primitives for Qwen's fine-grained FP8 checkpoints (issue 26): e4m3 weights in 128 x 128
blocks with `weight_scale_inv`, activations quantized per token per 128 channels, W8A8 block-scaled
GEMMs (dense and grouped over MoE experts), each with the plain-torch reference it is tested against.

- quant.py: quantize / dequantize weights and activations (the Triton activation quantizer and its
  bit-exact torch reference), shape checks.
- linear.py: block_fp8_linear (cuBLAS blockwise or a Triton GEMM on CUDA) and block_fp8_linear_ref.
- w8a16.py: w8a16_linear, the weight-only FP8 GEMM for 1-32 decode rows (x unquantized; block_fp8_linear's
  "w8a16" backend, auto's with METRALE_FP8_DECODE=w8a16), and w8a16_linear_ref.
- experts.py: moe_experts_fp8, the FP8 grouped gate|up and down GEMMs over expert-sorted pairs, and
  moe_experts_fp8_ref.
- experts_direct.py: moe_experts_fp8_direct, the same experts for decode-sized calls without the sort (one row
  per pair; taken by ops/moe/direct.py's shape rule).
- projection.py: what the phase ops with projections share: a weight's scales argument checked, the
  CPU references' FP8 linear, the CUDA paths' grouped projections.

Plain functions, not ops: the phase ops call them from their CUDA paths and references.
`activation_rounding(False)` (or METRALE_FP8_ACTIVATIONS=off) is the weight-only debug mode.
"""

from .experts import check_experts, dequantize_gate_up, moe_experts_fp8, moe_experts_fp8_ref, stack_gate_up
from .linear import (CUBLAS_MIN_ROWS, SPLITK_MAX_ROWS, auto_backend, block_fp8_gemm_cublas,
                     block_fp8_gemm_splitk, block_fp8_gemm_triton, block_fp8_linear, block_fp8_linear_ref,
                     cublas_blockwise_ok)
from .quant import (ACT_EPS, BLOCK, FP8_DTYPE, FP8_MAX, activation_rounding, activations_rounded, check_block_weight,
                    dequantize_activations,
                    dequantize_weight_blocks, fake_quantize_activations, num_blocks, quantize_activations,
                    quantize_activations_ref, quantize_activations_triton, quantize_weight_blocks)
from .w8a16 import W8A16_MAX_ROWS, w8a16_linear, w8a16_linear_ref

__all__ = ["ACT_EPS", "BLOCK", "CUBLAS_MIN_ROWS", "SPLITK_MAX_ROWS", "auto_backend",
           "activation_rounding", "activations_rounded", "FP8_DTYPE", "FP8_MAX", "block_fp8_gemm_cublas",
           "block_fp8_gemm_splitk", "block_fp8_gemm_triton",
           "block_fp8_linear", "block_fp8_linear_ref", "check_block_weight", "check_experts", "cublas_blockwise_ok",
           "dequantize_activations", "dequantize_gate_up", "dequantize_weight_blocks", "fake_quantize_activations",
           "moe_experts_fp8", "moe_experts_fp8_ref", "num_blocks", "quantize_activations", "quantize_activations_ref",
           "quantize_activations_triton", "quantize_weight_blocks", "stack_gate_up", "W8A16_MAX_ROWS", "w8a16_linear",
           "w8a16_linear_ref"]

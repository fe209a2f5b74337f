"""Model shapes the CUDA path cannot serve, rejected when a CUDA model is built instead of
failing at prefill.

Our Triton kernels mask every size a transformers config allows (any rotary dim up to
head_dim, any head dims, ratios of value to key heads and of query to KV heads, KV block sizes,
conv widths), except the GDN recurrence's chunked kernels (ops/gdn_chunked/), which hold a
[K, BV] state tile and [64, K] key tiles in registers: key and value head dims up to 256. Value
head dims above that take flash-linear-attention 0.6.0's chunked kernels (the op's "fla" backend),
whose limit on key head dims is the same 256. The attention's library kernels (cuDNN,
FlashAttention-2) serve only the shapes they take; the rest runs our Triton kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import ModelConfig

# ours: ops/gdn_chunked.MAX_HEAD_DIM; fla 0.6.0, fla/ops/common/chunk_delta_h.py, chunk_gated_delta_rule_fwd_h:
#     assert K <= 256, "current kernel does not support head dimension larger than 256."
# Its state-update kernel holds a head's [K, BV] state in at most four 64-row tiles (b_h1..b_h4).
# Below that, every kernel of its forward masks K and tiles V: no other head-dim limit.
MAX_LINEAR_KEY_HEAD_DIM = 256


def check_supported(config: ModelConfig) -> None:
    """Raise ValueError, naming the config field and the supported range, if the CUDA path cannot
    run `config`. (The CPU reference path runs every valid config.)"""
    K = config.linear_key_head_dim
    if config.linear_layers and K > MAX_LINEAR_KEY_HEAD_DIM:
        raise ValueError(
            f"linear_key_head_dim {K} is not supported on CUDA: the chunked gated delta rule (the GDN "
            f"recurrence: ours, and flash-linear-attention's) takes key head dims 1..{MAX_LINEAR_KEY_HEAD_DIM}")

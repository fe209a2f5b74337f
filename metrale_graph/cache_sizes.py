"""A HybridCache's sizes (cache.py), checked before anything is allocated, and the bytes its pools will take
(placement.check_memory's asks: a cache too large for the device is a ValueError naming each share)."""

from __future__ import annotations

import torch

from .config import ModelConfig
from .numbers import as_int


def checked_sizes(cfg: ModelConfig, num_slots, num_blocks, block_size, max_context, prefix_checkpoints,
                  checkpoint_interval, verify_entries) -> tuple[int, int, int, int, int, int, int]:
    """HybridCache's sizes as ints, checked (ValueError naming the first bad one), max_context's default filled:
    (num_slots, num_blocks, block_size, max_context, prefix_checkpoints, checkpoint_interval, verify_entries)."""
    sizes = {}
    for name, value in (("num_slots", num_slots), ("num_blocks", num_blocks), ("block_size", block_size)):
        sizes[name] = as_int(value)
        if sizes[name] is None or sizes[name] < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    num_slots, num_blocks, block_size = sizes["num_slots"], sizes["num_blocks"], sizes["block_size"]
    prefix_checkpoints, checkpoint_interval = prefix_options(prefix_checkpoints, checkpoint_interval, block_size)
    verify_entries = as_int(verify_entries)
    if verify_entries is None or verify_entries < 0:
        raise ValueError(f"verify_entries must be an integer >= 0, got {verify_entries!r}")
    if max_context is None:
        max_context = min(cfg.max_position_embeddings, num_blocks * block_size)
    max_context = as_int(max_context)
    if max_context is None or max_context < 1:
        raise ValueError(f"max_context must be a positive integer, got {max_context!r}")
    if max_context > cfg.max_position_embeddings:
        raise ValueError(f"max_context ({max_context}) exceeds the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings}): no position past it exists")
    return num_slots, num_blocks, block_size, max_context, prefix_checkpoints, checkpoint_interval, verify_entries


def prefix_options(checkpoints, interval, block_size: int) -> tuple[int, int]:
    """Prefix caching's sizes, checked: the checkpoint entries (0: no prefix caching) and the interval of the
    checkpoints a prompt leaves (0: none; else a multiple of the block size and of the GDN chunk, 64)."""
    n, every = as_int(checkpoints), as_int(interval)
    if n is None or n < 0:
        raise ValueError(f"prefix_checkpoints must be an integer >= 0, got {checkpoints!r}")
    if every is None or every < 0:
        raise ValueError(f"checkpoint_interval must be an integer >= 0, got {interval!r}")
    if every and (every % block_size or every % 64):
        raise ValueError(f"checkpoint_interval ({every}) must be a multiple of the block size ({block_size}) and of "
                         "the GDN chunk (64)")
    if every and not n:
        raise ValueError("checkpoint_interval needs prefix_checkpoints > 0 (the pool the checkpoints go to)")
    return n, every


def pool_asks(cfg: ModelConfig, num_slots: int, num_blocks: int, block_size: int, max_context: int,
              dtype: torch.dtype, prefix_checkpoints: int, verify_entries: int = 0) -> list[tuple[str, int]]:
    """The bytes of a cache's pools by the argument that sizes them (placement.check_memory's asks): each
    slot's states and block table, the KV blocks, the GDN state checkpoints (each pool with its padding row)."""
    states = len(cfg.linear_layers) * (cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * dtype.itemsize
                                       + cfg.linear_num_value_heads * cfg.linear_key_head_dim
                                       * cfg.linear_value_head_dim * 4)  # one slot's (or checkpoint's)
    kv_layers = len(cfg.full_layers) + cfg.mtp_num_hidden_layers  # the MTP head's attention layers have pools too
    kv_block = 2 * kv_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
    table_row = -(-max_context // block_size) * 4
    asks = [(f"slot states (num_slots={num_slots})", (num_slots + 1) * (states + table_row)),
            (f"KV blocks (num_blocks={num_blocks} of block_size={block_size})", (num_blocks + 1) * kv_block)]
    if prefix_checkpoints:
        asks.append((f"GDN state checkpoints (prefix_checkpoints={prefix_checkpoints})",
                     (prefix_checkpoints + 1) * states))
    if verify_entries:
        asks.append((f"speculative verify states (min(num_slots, max_streams) x num_tokens = {verify_entries})",
                     verify_entries * states))
    return asks

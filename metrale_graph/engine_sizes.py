"""An Engine's sizes: their defaults, the checks of Engine(...)'s size arguments, the bucket grid, and prefix
caching's checkpoint sizes (Engine.__init__'s docstring says what each means)."""

from __future__ import annotations

import math

from .numbers import is_int

DEFAULT_MAX_CONTEXT = 4096
DEFAULT_TOKEN_BUDGET = 2048
DEFAULT_CHECKPOINT_INTERVAL = 128


def default_grid(num_slots: int, token_budget: int) -> tuple[list[int], list[int]]:
    """Batch sizes 2, 4, 8, ... up to num_slots and token counts 2, 4, 8, ... up to token_budget
    (each list ends at the limit itself): every step fits one bucket (its streams <= num_slots,
    its tokens <= token_budget), pure-decode steps of B streams land in (B', B') with B' < 2B, and
    padding is under 2x in both dimensions. Sizes start at 2: a lone stream runs in a 2-stream
    bucket beside a zero-length one, through the step traced for several streams, so an Engine compiles one
    step, not also the runner's one-stream step (whose ops take one stream's paths: cuDNN's dense attention
    for a lone prompt; at one decode stream the two measured alike, BENCHMARKS.md's `--loop 1` against D1).
    batch_sizes=[1, ...] opts in."""
    return _doubling(num_slots), _doubling(token_budget)


def _doubling(limit: int) -> list[int]:
    sizes, n = [], min(2, limit)
    while n < limit:
        sizes.append(n)
        n *= 2
    return sizes + [limit]


def check_sizes(cfg, num_slots, max_context, token_budget, block_size, num_blocks,
                max_waiting) -> tuple[int, int, int, int, object, int]:
    """Engine(...)'s sizes for the model config `cfg`, defaulted and checked: (num_slots, max_context, token_budget,
    block_size, num_blocks, max_waiting), ints (num_blocks as given when it is not an integer: the cache names
    it); ValueError naming the first bad one."""
    if max_context is None:
        max_context = min(cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT)
        if max_context < 2:  # the default, which the call did not set: name the model's field
            raise ValueError(f"the model's max_position_embeddings ({cfg.max_position_embeddings}) leaves no room for a "
                             "new token: an Engine needs 2 positions at least (a prompt token and a new one)")
    if token_budget is None:
        token_budget = max(DEFAULT_TOKEN_BUDGET, num_slots if is_int(num_slots) else 0)
    if max_waiting is None:
        max_waiting = max(256, 4 * num_slots) if is_int(num_slots) else 0
    for name, value, low in (("num_slots", num_slots, 1), ("max_context", max_context, 2),
                             ("token_budget", token_budget, 1), ("block_size", block_size, 1),
                             ("max_waiting", max_waiting, 0)):
        if not is_int(value) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    num_slots, max_context, token_budget, block_size, max_waiting = map(
        int, (num_slots, max_context, token_budget, block_size, max_waiting))
    if max_context > cfg.max_position_embeddings:
        raise ValueError(f"max_context ({max_context}) exceeds the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings})")
    if token_budget < num_slots:
        raise ValueError(f"token_budget ({token_budget}) must be at least num_slots ({num_slots}): every "
                         "running request feeds one token per step")
    if num_blocks is None:
        num_blocks = num_slots * -(-max_context // block_size)
    elif is_int(num_blocks):
        num_blocks = int(num_blocks)
    return num_slots, max_context, token_budget, block_size, num_blocks, max_waiting


def prefix_sizes(prefix_cache, num_slots: int, block_size: int, prefix_checkpoints,
                 checkpoint_interval) -> tuple[int, int]:
    """Prefix caching's (checkpoint entries, checkpoint interval), (0, 0) when it is off; ValueError for a
    non-bool prefix_cache, or for sizes given while it is off."""
    if not isinstance(prefix_cache, bool):
        raise ValueError(f"prefix_cache must be True or False, got {prefix_cache!r}")
    for name, value in (("prefix_checkpoints", prefix_checkpoints), ("checkpoint_interval", checkpoint_interval)):
        if value is not None and not prefix_cache:
            raise ValueError(f"{name}={value!r} sizes the prefix cache, which is off: pass prefix_cache=True too, "
                             f"or leave {name} out")
    if not prefix_cache:
        return 0, 0
    return _prefix_sizes(num_slots, block_size, prefix_checkpoints, checkpoint_interval)


def _prefix_sizes(num_slots: int, block_size: int, checkpoints, interval) -> tuple[int, int]:
    """Prefix caching's checkpoint entries (default: four per slot: a request leaves a few, and the ones a
    later prompt needs must outlive the requests between) and interval (default: the first multiple of
    the block size and of 64 from DEFAULT_CHECKPOINT_INTERVAL on; 0: checkpoints at prompts' ends only)."""
    if checkpoints is None:
        checkpoints = 4 * num_slots
    if not is_int(checkpoints) or checkpoints < 1:
        raise ValueError(f"prefix_checkpoints must be an integer >= 1, got {checkpoints!r}")
    if interval is None:
        unit = block_size * 64 // math.gcd(block_size, 64)
        interval = -(-DEFAULT_CHECKPOINT_INTERVAL // unit) * unit
    return int(checkpoints), interval


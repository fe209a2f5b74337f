"""Shape cases every phase op is tested on (its inputs: the op's registered `example`): ragged
lengths (not multiples of 64, a single-token stream, a zero-length padding stream, one stream of one token, no tokens at
all), decode-shaped batches (one-token streams after contexts, a long context, T == B in one stream,
a chunked-prefill mix), grouped value heads, dk != dv, and sizes that are not powers of two (head
dims, rotary dims, head ratios, KV block sizes); for the MoE op, top_k = 1 and top_k = E, more
experts than token-expert pairs, and experts whose pairs span several grouped-GEMM blocks (16 rows
under the interpreter). Dims stay tiny: opcheck runs every op on every case."""

from __future__ import annotations

import torch

from metrale_graph.ops import REGISTRY, Shapes, example_args

CASES = [
    Shapes(lengths=(1, 63, 65), context=(0, 5, 0)),
    Shapes(lengths=(64, 7, 0), context=(3, 0, 0), H=2, HV=2, K=8, V=8, HQ=2, HKV=2),
    # an odd rotary dim (7: four frequencies over 8 channels, as transformers rotates it)
    Shapes(lengths=(130,), context=(17,), H=1, HV=3, K=8, V=20, HD=32, R=7),
    # one stream of one token (T = B = 1, where slices of a GEMM output come back contiguous);
    # one query head on one KV head; rotary over the whole head; every expert chosen (top_k = E)
    Shapes(lengths=(1,), context=(3,), HQ=1, HKV=1, R=16, E=6, TOPK=6),
    # head_dim 48 with rotary dim 12 (rotary / 2 = 6); three query heads on one KV head; blocks of 48;
    # one expert per token
    Shapes(lengths=(5, 40), context=(50, 0), HD=48, R=12, HQ=3, HKV=1, BS=48, TOPK=1),
    # dk != dv, neither a power of two, three value heads per key head; HQ == HKV; head_dim 24 with
    # rotary dim 2 (rotary / 2 = 1); conv width 2; blocks of 32; 8 experts, 3 per token, expert and
    # shared intermediate sizes 40 / 24
    Shapes(lengths=(70, 3), context=(0, 29), H=1, HV=3, K=24, V=40, HQ=2, HKV=2, HD=24, R=2, W=2, BS=32, E=8, TOPK=3,
           IE=40, IS=24),
    # MoE: more experts (16) than token-expert pairs (3 tokens x 4); expert size 20
    Shapes(lengths=(2, 1, 0), context=(0, 9, 0), E=16, TOPK=4, IE=20),
    # MoE: 4 experts, 2 per token, 150 tokens: each expert's ~75 pairs span several blocks
    Shapes(lengths=(150,), context=(0,), E=4, TOPK=2, IE=36, IS=20),
    # no tokens at all: every stream is zero-length padding
    Shapes(lengths=(0, 0), context=(0, 0)),
    # decode-shaped (ops.common.decode_shaped: the GDN recurrent kernel, split-K attention):
    # four one-token streams after contexts (one of them empty); rotary dim 0 (no channel rotates);
    Shapes(lengths=(1, 1, 1, 1), context=(3, 40, 0, 70), R=0),
    # one token after a long context (split-K: 64-key splits, the last one partial), and a zero-length
    # stream (as the runner pads a single-stream bucket)
    Shapes(lengths=(1, 0), context=(300, 0), num_blocks=48),
    # a bucket of T == B holding one stream of all T tokens (queries in two tiles: QB = 4 with three
    # query heads per KV head), the other streams zero-length
    Shapes(lengths=(0, 0, 6, 0, 0, 0), context=(0, 0, 20, 0, 0, 0), H=1, HV=3, K=24, V=40, HQ=6, HKV=2, HD=24,
           BS=48),
    # a chunked-prefill step: one-token decodes, a prompt chunk, a zero-length stream; dk != dv, blocks of 32
    Shapes(lengths=(1, 0, 9, 1), context=(64, 0, 17, 5), H=2, HV=4, K=32, V=16, HQ=4, HKV=1, HD=32, BS=32),
]


# FP8 variants of the ops with projections (their examples quantize what Qwen's FP8 checkpoints convert):
# hidden and intermediate sizes that are not multiples of 128 (ragged scale blocks), several K blocks, a
# decode batch (fewer rows than cuBLAS' 16), no tokens
FP8_OPS = ("gdn_proj", "gdn_out", "attn_proj", "attn_out", "mlp", "moe")
FP8_CASES = [
    Shapes(lengths=(3, 0, 20), context=(5, 0, 0), D=200, I=136, IE=72, IS=40, E=6, TOPK=2, fp8=True),
    Shapes(lengths=(1, 1, 1), context=(4, 9, 0), H=1, HV=3, K=24, V=48, HQ=2, HKV=1, HD=64, R=16, D=130, I=260,
           E=4, TOPK=2, IE=136, IS=24, fp8=True),
    Shapes(lengths=(0,), context=(0,), fp8=True),
]


def op_args(name: str, case: Shapes, dtype: torch.dtype, seed: int = 0) -> tuple:
    """Positional arguments of metrale::<name> for one case (the op's registered example)."""
    return example_args(name, case, dtype, seed)


def opcheck_cases() -> list[tuple[str, Shapes, torch.dtype]]:
    """(op, case, dtype) for every registered op, every case, fp32 and bf16, and the FP8 cases of the ops
    with projections: what test_opcheck runs."""
    dtypes = (torch.float32, torch.bfloat16)
    return ([(name, case, dtype) for name in REGISTRY for case in CASES for dtype in dtypes]
            + [(name, case, dtype) for name in FP8_OPS if name in REGISTRY for case in FP8_CASES for dtype in dtypes])

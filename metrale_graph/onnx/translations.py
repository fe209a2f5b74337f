"""ONNX translations of the `metrale::` phase ops: each op rebuilt from standard ONNX operators
(opset 20) with onnxscript, so an exported prefill step runs in plain onnxruntime.

`torch.onnx.export(..., dynamo=True, custom_translation_table=...)` calls a translation with the
op's tensor arguments as ONNX values of static shape (one graph per bucket) and its scalars as
Python values. The ops that mutate a state pool are exported in functional form (see
export.py): their translation returns the op's output followed by the updated pools. Each op's
spec (in its module, metrale_graph.ops.<op>) points at its translation here.

Varlen streams without host sync, as the CPU references (each op's declared function) specify:
- token t belongs to stream seg[t] = the number of streams that end at or before t (zero-length
  streams included); tokens at or past cu_seqlens[B] belong to no stream.
- states are read from the pools as they were before the step (a valid batch gives every
  non-empty stream its own slot and blocks, so this equals the references' stream-by-stream order).
- pool writes (`_write_slots`): each non-empty stream's slot gets its new state (the last such
  stream wins where streams share a slot, as in the references' stream order); zero-length
  streams write nothing; every other slot passes through unchanged.
- the GDN recurrence is an ONNX Loop over streams around a Loop over that stream's tokens (trip
  count = its length, zero for padding), token by token in fp32 like the op's reference.
- paged attention writes each token's K / V at (block, offset) with ScatterND, then every token
  attends over the positions of its stream's block table up to its own position. Tokens in no
  stream (padding) write the null block's current values back, so the null block stays as it is.

The translations live by block: gdn.py (the Gated DeltaNet mixer), attention.py (the gated full-attention
mixer), feed_forward.py (the MLP and the MoE block), each from the building blocks of builders.py (its
docstring: how bf16 / fp16 models compute, how loop bodies name their values); this module is the table the
op specs point at, and the aten translations.

FP8 models are not exported (export_prefill refuses them): a weight's scales argument (`*_s`) is the
empty tensor of a weight in the model dtype here, and is not read.

Shape letters as in ops/common.py; P = MB*BS key positions per stream.
"""

from __future__ import annotations

from onnxscript import opset20 as op

# each op's spec points at its translation here ("metrale_graph.onnx.translations:<op>"); they live by block
from .attention import attn_out, attn_proj, paged_attention
from .builders import OPSET, _down, _up
from .feed_forward import mlp, moe
from .gdn import causal_conv1d, gdn_out, gdn_proj, gdn_recurrence, l2norm

__all__ = ["ATEN", "OPSET", "attn_out", "attn_proj", "causal_conv1d", "gdn_out", "gdn_proj", "gdn_recurrence", "l2norm",
           "linear", "mlp", "moe", "paged_attention"]


# aten ops of the step outside the metrale ops, which torch.onnx's own translations would compute in the
# model dtype: export.py maps aten::<name> to each
def linear(x, w, bias=None):
    """aten::linear (the lm_head): x [..., in] @ w[out, in]^T (+ bias) in fp32, rounded to x's dtype once."""
    dt = x.dtype
    y = op.Gemm(_up(x), _up(w), transB=1) if len(x.shape) == 2 else op.MatMul(_up(x), op.Transpose(_up(w)))
    return _down(y if bias is None else op.Add(y, _up(bias)), dt)


ATEN = {"linear": linear}

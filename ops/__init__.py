"""The prefill phases as `torch.library` custom ops in the `metrale` namespace
(installed as metrale_graph.ops).

Each module holds one op, named after it: schema and docstring, fake, CPU reference, CUDA path,
and its OpSpec (test inputs, cost, kernel names, ONNX translation) registered in
`registry.REGISTRY`, which everything else reads. Importing this package registers them all;
the imports below are the registry's lines, one per op.
"""

from .registry import REGISTRY, OpSpec, Shapes, example_args, metrale_op, register

from .gdn_proj import gdn_proj
from .causal_conv1d import causal_conv1d
from .l2norm import l2norm
from .gdn_recurrence import gdn_recurrence
from .gdn_out import gdn_out
from .attn_proj import attn_proj
from .paged_attention import paged_attention
from .attn_out import attn_out
from .mlp import mlp
from .moe import moe

__all__ = ["REGISTRY", "OpSpec", "Shapes", "example_args", "metrale_op", "register", "gdn_proj", "causal_conv1d",
           "l2norm", "gdn_recurrence", "gdn_out", "attn_proj", "paged_attention", "attn_out", "mlp", "moe"]

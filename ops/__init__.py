"""The prefill phases as `torch.library` custom ops in the `metrale` namespace
(installed as metrale_graph.ops).

Each op has its own module (or package, for the three large ones), named after it: the op's
declaration (schema, docstring, CPU reference), check, fake, CUDA path, and its OpSpec (test inputs,
cost, kernel names, ONNX translation) registered in `registry.REGISTRY`, which everything else reads.
Importing this package registers them all; the import below is the registry's list. The ops are
called as `OPS.<name>` (what the model does) or `torch.ops.metrale.<name>`;
`metrale_graph.ops.<name>` is the op's module.
"""

from .registry import (OPS, REGISTRY, OpSpec, Shapes, declaration, example_args, metrale_cuda, metrale_fake,
                       metrale_op, register)

from . import gdn_proj, causal_conv1d, l2norm, gdn_recurrence, gdn_out, attn_proj, paged_attention, attn_out, mlp, moe

__all__ = ["OPS", "REGISTRY", "OpSpec", "Shapes", "declaration", "example_args", "metrale_cuda", "metrale_fake",
           "metrale_op", "register",
           # the op modules, in the model's order
           "gdn_proj", "causal_conv1d", "l2norm", "gdn_recurrence", "gdn_out", "attn_proj", "paged_attention",
           "attn_out", "mlp", "moe"]

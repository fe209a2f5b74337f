"""The prefill phases as `torch.library` custom ops in the `metrale` namespace.

Each module holds one op: its schema and docstring, its fake, its CPU reference and its CUDA
registration. Importing this package registers them all.
"""

from .gdn_proj import gdn_proj, gdn_proj_ref
from .conv1d import causal_conv1d, causal_conv1d_ref
from .l2norm import l2norm, l2norm_ref
from .gdn_recurrence import gdn_recurrence, gdn_recurrence_ref
from .gdn_out import gdn_out, gdn_out_ref
from .attn_proj import attn_proj, attn_proj_ref
from .paged_attention import paged_attention, paged_attention_ref
from .attn_out import attn_out, attn_out_ref

ALL_OPS = {
    "gdn_proj": gdn_proj,
    "causal_conv1d": causal_conv1d,
    "l2norm": l2norm,
    "gdn_recurrence": gdn_recurrence,
    "gdn_out": gdn_out,
    "attn_proj": attn_proj,
    "paged_attention": paged_attention,
    "attn_out": attn_out,
}

__all__ = list(ALL_OPS) + [f"{name}_ref" for name in ALL_OPS] + ["ALL_OPS"]

"""The CUDA implementations of the phase ops against their CPU references on upcast inputs.

Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1); flash-linear-attention does not run there, so the recurrence is checked
through its chunk-aligned layout with the reference as the varlen kernel (the fla call itself
is covered by the GPU tests).
"""

import importlib

import pytest
import torch

from helpers import TOL, assert_close, assert_no_aliasing, clone_args, outputs, tiny_config, upcast
from metrale_graph.config import FULL
from metrale_graph.ops import REGISTRY, kernels
from metrale_graph.ops.limits import check_supported
from op_cases import CASES, op_args

# the module (metrale_graph.ops.gdn_recurrence, the attribute, is the op it defines)
gdn_recurrence = importlib.import_module("metrale_graph.ops.gdn_recurrence")

# every op's CUDA path but the recurrence's (fla; covered here through its aligned layout)
CUDA_IMPLS = {name: spec.cuda for name, spec in REGISTRY.items() if spec.cuda and name != "gdn_recurrence"}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def check_against_reference(name, impl, case, dtype, seed=0):
    args = op_args(name, case, dtype, seed)
    ref_args = upcast(clone_args(args, "cpu"))
    test_args = clone_args(args, DEVICE)
    ref = outputs(REGISTRY[name].op(*ref_args))
    out = outputs(impl(*test_args))
    for i, (r, o) in enumerate(zip(ref, out)):
        assert_close(f"{name} output {i}", r, o.cpu(), TOL[dtype])
    for i, (r, a) in enumerate(zip(ref_args, test_args)):  # mutated pools
        if isinstance(a, torch.Tensor) and a.is_floating_point() and not torch.equal(a.cpu().float(), r):
            assert_close(f"{name} mutated arg {i}", r, a.cpu(), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("name", list(CUDA_IMPLS))
def test_cuda_impl_matches_reference(name, case, dtype):
    check_against_reference(name, CUDA_IMPLS[name], case, dtype)


def _reference_varlen(q, k, v, g, beta, cu_aligned, chunk_indices, h0):
    NT = chunk_indices.shape[0]
    assert cu_aligned[-1].item() == NT * gdn_recurrence.CHUNK
    starts = cu_aligned[chunk_indices[:, 0]] + gdn_recurrence.CHUNK * chunk_indices[:, 1]
    assert torch.equal(starts, torch.arange(NT, device=starts.device) * gdn_recurrence.CHUNK)
    slots = torch.arange(h0.shape[0], device=h0.device)
    return gdn_recurrence.gdn_recurrence_ref(q, k, v, g, beta, cu_aligned.int(), slots, h0), h0


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_recurrence_aligned_layout_is_exact(case):
    """Chunk alignment with identity tokens, state gather / scatter: bit-exact against the direct
    reference, padding streams included."""
    args = op_args("gdn_recurrence", case, torch.float32, seed=9)
    test_args = clone_args(args, "cpu")
    ref = gdn_recurrence.gdn_recurrence_ref(*args)
    out = gdn_recurrence.gdn_recurrence_aligned(*test_args, _reference_varlen)
    assert torch.equal(out, ref) and torch.equal(test_args[-1], args[-1])


def test_aligned_layout_chunk_count_is_fixed():
    """Any lengths with the same (B, T) give the same number of sequences and chunks."""
    shapes = set()
    for lengths in ([1, 1, 126], [64, 64, 0], [100, 27, 1], [0, 0, 128]):
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
        dest, cu_al, chunks, T_al = gdn_recurrence.aligned_layout(cu, 128)
        shapes.add((cu_al.shape, chunks.shape, T_al))
        assert len(set(dest.tolist())) == 128
    assert len(shapes) == 1


CUDA_PATHS = dict(CUDA_IMPLS, gdn_recurrence=lambda *args: gdn_recurrence.gdn_recurrence_aligned(
    *args, _reference_varlen))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("impl", ["reference", "cuda"])
@pytest.mark.parametrize("name", list(REGISTRY))
def test_outputs_alias_nothing(name, impl, case):
    """Fresh outputs from the CPU reference and the CUDA path (recurrence: its aligned layout) for
    every case; T = 1 and T = 0 are where a slice or reshape of one GEMM output comes back as a view.
    fp32 only: there dtype casts are no-ops that could hand back their input."""
    if impl == "cuda" and name not in CUDA_PATHS:
        pytest.skip(f"metrale::{name} has no CUDA path yet")
    args = clone_args(op_args(name, case, torch.float32), DEVICE)
    fn = REGISTRY[name].reference if impl == "reference" else CUDA_PATHS[name]
    assert_no_aliasing(f"{name} ({impl})", outputs(fn(*args)), args)


def test_stacked_is_a_view_of_adjacent_weights():
    buf = torch.randn(10, 4)
    a, b = buf[:3], buf[3:]
    assert kernels.stacked(a, b).data_ptr() == buf.data_ptr()
    c, d = torch.randn(3, 4), torch.randn(7, 4)
    assert torch.equal(kernels.stacked(c, d), torch.cat([c, d]))
    flat = torch.randn(40)  # adjacent in memory but separate tensors: no view across storages
    e, f = torch.randn(3, 4), flat[:28].view(7, 4)
    assert torch.equal(kernels.stacked(e, f), torch.cat([e, f]))


def test_check_supported_rejects_only_fla_key_dims():
    """Odd head / rotary dims and ratios pass; a GDN key head dim above fla's 256 is named with its range."""
    check_supported(tiny_config(head_dim=48, partial_rotary_factor=0.25, num_key_value_heads=1,
                                linear_num_value_heads=6, linear_key_head_dim=256, linear_value_head_dim=40))
    with pytest.raises(ValueError, match=r"linear_key_head_dim 264 .* key head dims 1\.\.256"):
        check_supported(tiny_config(linear_key_head_dim=264))
    check_supported(tiny_config(linear_key_head_dim=264, layer_types=(FULL,) * 4))  # no GDN layer

"""On a GPU: every phase op's CUDA path against its CPU reference on upcast inputs (9B head
dims, ragged lengths up to 4097, with and without prior state), and every op captured alone in
a CUDA graph, replayed with other lengths and slots of the same bucket."""

from dataclasses import replace

import pytest
import torch

from helpers import assert_close
from metrale_graph import ops
from op_cases import Case, op_args
from test_kernels import TOL, _clone, _outputs, _upcast

pytestmark = pytest.mark.gpu

BIG = Case(lengths=(1, 63, 64, 65, 1000, 4097), context=(0, 0, 0, 0, 0, 0), H=2, HV=4, K=128, V=128, D=256,
           I=512, HQ=4, HKV=2, HD=256, R=64, BS=64, num_slots=8, num_blocks=480)
BIG_CASES = [BIG, replace(BIG, context=(5, 0, 130, 64, 2000, 1))]
# same bucket (B=6, T=5290) as BIG, other lengths, a zero-length padding stream, other slots
REPLAY = replace(BIG, lengths=(2000, 0, 1, 3017, 200, 72), context=(0, 0, 77, 3, 640, 1000))


@pytest.mark.parametrize("case", BIG_CASES, ids=["fresh", "prior-state"])
@pytest.mark.parametrize("name", list(ops.ALL_OPS))
def test_cuda_op_matches_reference(name, case):
    args = op_args(name, case, torch.bfloat16, seed=1)
    ref_args = _upcast(_clone(args, "cpu"))
    cuda_args = _clone(args, "cuda")
    before = _clone(cuda_args, "cuda")
    ref = _outputs(ops.ALL_OPS[name](*ref_args))
    out = _outputs(ops.ALL_OPS[name](*cuda_args))
    for i, (r, o) in enumerate(zip(ref, out)):
        assert o.is_cuda
        assert_close(f"{name} output {i}", r, o.cpu(), TOL[torch.bfloat16])
    for i, (r, a, b) in enumerate(zip(ref_args, cuda_args, before)):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and not torch.equal(a, b):
            assert_close(f"{name} mutated arg {i}", r, a.cpu(), TOL[torch.bfloat16])


@pytest.mark.parametrize("name", list(ops.ALL_OPS))
def test_cuda_op_replays_in_a_graph(name):
    """Capture with one batch's metadata, replay with another batch of the same bucket copied into
    the static inputs: equals eager on that batch; pool rows outside it stay bit-identical."""
    op = ops.ALL_OPS[name]
    static = _clone(op_args(name, BIG, torch.bfloat16, seed=2), "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (Triton compile + autotune) outside the capture
        op(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _outputs(op(*static))

    batch = _clone(op_args(name, REPLAY, torch.bfloat16, seed=3), "cuda")
    for s, b in zip(static, batch):
        if isinstance(s, torch.Tensor):
            s.copy_(b)
    pre = _clone(batch, "cuda")
    ref = _outputs(op(*batch))
    graph.replay()
    torch.cuda.synchronize()
    for i, (r, o) in enumerate(zip(ref, out)):
        assert_close(f"{name} replayed output {i}", r.float(), o.float(), 1e-2)
    for i, (s, b, p) in enumerate(zip(static, batch, pre)):
        if isinstance(s, torch.Tensor) and s.is_floating_point() and not torch.equal(b, p):  # a mutated pool
            changed = (b != p).flatten(1).any(1)
            assert torch.equal(s[~changed], p[~changed]), f"{name}: replay touched pool rows outside the batch"
            assert_close(f"{name} replayed pool {i}", b[changed].float(), s[changed].float(), 1e-2)

"""ops/gemv.py, the decode-row GEMV (METRALE_DECODE_GEMV=triton): the product at any shape (rows 1-16, columns
and K not multiples of its tiles, K in several parts summed by the last part to finish, a residual in the
epilogue), the same bits call after call with its counters left at zero (what a graph replay needs), which calls
take it, and the phase ops' CUDA paths with it against their references (Triton's interpreter on the CPU; the
compiled kernel on a GPU)."""

from __future__ import annotations

import pytest
import torch

from metrale_graph import envs
from metrale_graph.ops import gemv
from metrics import round_bf16_to_nearest
from op_cases import CASES, op_args
from test_kernels import CUDA_IMPLS, DEVICE, check_against_reference


def _operands(M, N, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype).to(DEVICE)
    r = torch.randn(M, N, generator=g).to(dtype).to(DEVICE)
    return x, w, r


def _rel(out, ref) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("M, N, K, tiles", [
    (1, 200, 256, (64, 64, 1, 2)),       # one part; columns past the last full tile
    (3, 200, 320, (64, 64, 2, 2)),       # two parts, K not a multiple of parts x BK: the last part shorter
    (16, 64, 384, (64, 128, 4, 2)),      # more parts than K steps: the empty ones dropped
    (2, 130, 200, None),                 # config's own tiles, K not a multiple of BK
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemv_is_the_product_with_or_without_residual(M, N, K, tiles, dtype):
    x, w, r = _operands(M, N, K, dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    ref = x.double() @ w.double().t()
    first = gemv.gemv(x, w, None, tiles)
    assert first.dtype == dtype and first.shape == (M, N)
    assert _rel(first, ref) <= tol
    with_residual = gemv.gemv(x, w, r, tiles)
    assert _rel(with_residual, ref + r.double()) <= tol
    # call after call the same bits, the ticket counters back at zero for the next one (a graph replay)
    assert torch.equal(gemv.gemv(x, w, None, tiles), first)
    counters = gemv._COUNTERS.get(x.device)
    assert counters is None or not counters.any()


def test_gemv_takes_empty_shapes_and_strided_rows():
    x, w, r = _operands(4, 96, 128, torch.bfloat16)
    assert gemv.gemv(x, w[:0]).shape == (4, 0)
    assert torch.equal(gemv.gemv(x[:, :0], w[:, :0], r), r) and not gemv.gemv(x[:, :0], w[:, :0]).any()  # K = 0
    wide = torch.cat([x, x], dim=1)[:, :128]  # rows of stride 256
    assert torch.equal(gemv.gemv(wide, w), gemv.gemv(x.contiguous(), w))


def test_gemv_takes_a_residual_of_any_strides(monkeypatch):
    """A residual whose columns are not unit-strided (a column-major h: mlp's, attn_out's and gdn_out's residual
    may have any layout, torch.addmm takes it) is added as its values, not read as if its rows were contiguous."""
    x, w, r = _operands(3, 64, 256, torch.bfloat16)
    col_major = r.t().contiguous().t()
    for tiles in ((64, 128, 1, 2), (64, 64, 2, 2)):  # one part, several
        assert torch.equal(gemv.gemv(x, w, col_major, tiles), gemv.gemv(x, w, r, tiles))
    monkeypatch.setattr(gemv, "BACKEND", "triton")
    ref = x.double() @ w.double().t() + r.double()
    assert _rel(gemv.linear(x, w, col_major), ref) <= 1e-2
    # the ops: mlp's h and attn_out's residual column-major give the output of contiguous ones
    case = next(c for c in DECODE_CASES if sum(c.lengths) > 1)
    for name, at in (("mlp", 0), ("attn_out", 2)):
        args = list(op_args(name, case, torch.bfloat16, 0))
        args = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
        want = CUDA_IMPLS[name](*args)
        args[at] = args[at].t().contiguous().t()
        assert torch.equal(CUDA_IMPLS[name](*args), want), name


def test_linear_takes_the_chosen_backend_at_decode_rows_only(monkeypatch):
    x, w, r = _operands(5, 64, 128, torch.bfloat16)
    calls = []
    real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    monkeypatch.setattr(gemv, "BACKEND", "cublas")
    assert torch.equal(gemv.linear(x, w), x @ w.t()) and torch.equal(gemv.linear(x, w, r), torch.addmm(r, x, w.t()))
    assert calls == []
    monkeypatch.setattr(gemv, "BACKEND", "triton")
    gemv.linear(x, w, r)
    big = torch.randn(17, 128, dtype=torch.bfloat16, device=DEVICE)
    assert torch.equal(gemv.linear(big, w), big @ w.t())  # 17 rows: past the kernel's 16
    assert torch.equal(gemv.linear(x.float(), w.float()), x.float() @ w.float().t())  # fp32: not a 16-bit weight
    bias = torch.randn(64, dtype=torch.bfloat16, device=DEVICE)  # a residual addmm broadcasts: cuBLAS's
    assert torch.equal(gemv.linear(x, w, bias), torch.addmm(bias, x, w.t()))
    assert calls == [5]
    monkeypatch.setattr(gemv, "BACKEND", "cuBLAS")
    with pytest.raises(ValueError, match="METRALE_DECODE_GEMV.*cublas, triton.*'cuBLAS'"):
        gemv.linear(x, w)


def test_the_setting_names_both_backends():
    assert envs.choices("METRALE_DECODE_GEMV") == ("cublas", "triton")
    with envs.override(METRALE_DECODE_GEMV="triton"):
        assert envs.METRALE_DECODE_GEMV == "triton"


PROJECTING = ("gdn_proj", "attn_proj", "mlp", "attn_out", "gdn_out", "moe")
DECODE_CASES = [c for c in CASES if 0 < sum(c.lengths) <= gemv.MAX_ROWS]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c.id for c in DECODE_CASES])
@pytest.mark.parametrize("name", PROJECTING)
def test_ops_with_the_gemv_match_their_references(name, case, monkeypatch):
    """Every projecting op's CUDA path at decode rows with METRALE_DECODE_GEMV=triton (bf16: the kernel's dtype)
    against its reference, as tests/test_kernels.py checks the cuBLAS path."""
    monkeypatch.setattr(gemv, "BACKEND", "triton")
    round_bf16_to_nearest(monkeypatch)  # the interpreter truncates to bf16 where the GPU rounds
    calls = []
    real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *a, **k: calls.append(1) or real(*a, **k))
    check_against_reference(name, CUDA_IMPLS[name], case, torch.bfloat16)
    assert calls, f"{name}: the GEMV took no projection"

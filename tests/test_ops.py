"""Every phase op: opcheck (schema, fake, autograd registration, AOT dispatch) over ragged
shapes and two dtypes; the references against independent formulations; input checks."""

import importlib
import pkgutil
import types

import pytest
import torch
import torch.nn.functional as F

import metrale_graph.ops
from metrics import assert_close
from metrale_graph.ops import OPS, REGISTRY, OpSpec, metrale_cuda, metrale_fake, metrale_op, register
from metrale_graph.ops.common import OpInputError, check
from op_cases import CASES, op_args, opcheck_cases


@pytest.mark.parametrize("name, case, dtype", opcheck_cases(),
                         ids=[f"{n}-{c.id}-{str(d)[6:]}" for n, c, d in opcheck_cases()])
def test_opcheck(name, case, dtype):
    # FP8 cases: every check but test_schema, whose mutation check compares each input before and after
    # with torch.allclose, which torch has no float8 kernel for (the schema is the bf16 variant's, checked)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic") if case.fp8 else None
    torch.library.opcheck(REGISTRY[name].op, op_args(name, case, dtype), **({"test_utils": utils} if utils else {}))


@pytest.mark.parametrize("name", list(REGISTRY))
def test_fake_shapes_match_real(name):
    """The fake's outputs have the real outputs' shapes, dtypes and strides-independent sizes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = REGISTRY[name].op
    args = op_args(name, CASES[0], torch.bfloat16)
    real = op(*args)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = op(*fake_args)
    real = (real,) if isinstance(real, torch.Tensor) else real
    fake = (fake,) if isinstance(fake, torch.Tensor) else fake
    assert [(r.shape, r.dtype) for r in real] == [(f.shape, f.dtype) for f in fake]


def _assert_other_slots_unchanged(state, before, cu, slots):
    """Rows of a state pool that no non-empty stream owns (slots outside the batch, the scratch slot)
    are bit-identical to before the call."""
    busy = set(slots[cu[1:] > cu[:-1]].tolist())
    for slot in range(state.shape[0]):
        if slot not in busy:
            assert torch.equal(state[slot], before[slot]), f"slot {slot} outside the batch changed"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_recurrence_matches_transformers_chunked(case):
    """Our token-by-token reference vs transformers' chunked (WY) form, per stream, from state."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, g, beta, cu, slots, state = op_args("gdn_recurrence", case, torch.float32, seed=1)
    state_before = state.clone()
    out = OPS.gdn_recurrence(q, k, v, g, beta, cu, slots, state)
    r = case.HV // case.H
    for b, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        slot = slots[b].item()
        if e == s:
            assert torch.equal(state[slot], state_before[slot])
            continue
        ref_o, ref_state = torch_chunk_gated_delta_rule(
            q[None, s:e].repeat_interleave(r, 2), k[None, s:e].repeat_interleave(r, 2), v[None, s:e],
            g=g[None, s:e], beta=beta[None, s:e], initial_state=state_before[slot][None].clone(),
            output_final_state=True)
        assert_close(f"o[{b}]", ref_o[0], out[s:e], 1e-5)
        assert_close(f"state[{b}]", ref_state[0], state[slot], 1e-5)
    _assert_other_slots_unchanged(state, state_before, cu, slots)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_conv1d_matches_padded_conv(case):
    """Per stream: state ++ tokens through F.conv1d, against the varlen op."""
    x, w, cu, slots, state = op_args("causal_conv1d", case, torch.float32, seed=2)
    before = state.clone()
    y = OPS.causal_conv1d(x, w, cu, slots, state)
    for b, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        slot = slots[b].item()
        full = torch.cat([before[slot], x[s:e].t()], 1)
        assert torch.equal(state[slot], full[:, -(case.W - 1):])
        if e > s:
            ref = F.silu(F.conv1d(full[None], w[:, None], groups=w.shape[0]))[0].t()
            assert_close(f"y[{b}]", ref, y[s:e], 1e-6)
    _assert_other_slots_unchanged(state, before, cu, slots)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_paged_attention_matches_sdpa(case):
    """Paged, varlen, with cached context vs dense SDPA over each stream's full K/V."""
    q, k, v, kc, vc, cu, ctx, blocks = op_args("paged_attention", case, torch.float32, seed=3)
    before_k, before_v = kc.clone(), vc.clone()
    out = OPS.paged_attention(q, k, v, kc, vc, cu, ctx, blocks)
    touched = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for b, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        c, n = ctx[b].item(), e - s
        if n == 0:
            continue
        pos = torch.arange(c + n)
        blk, off = blocks[b].long()[pos // case.BS], pos % case.BS
        touched[blk[c:], off[c:]] = True
        # K / V from the cache as it was plus the new tokens (not read back from the op's writes: a V write
        # to the wrong place would otherwise feed the reference the same wrong values)
        K = torch.cat([before_k[blk[:c], off[:c]], k[s:e]])
        V = torch.cat([before_v[blk[:c], off[:c]], v[s:e]])
        assert torch.equal(kc[blk, off], K) and torch.equal(vc[blk, off], V)
        mask = pos[None, :] <= (c + torch.arange(n))[:, None]
        ref = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), K.transpose(0, 1), V.transpose(0, 1),
                                             attn_mask=mask, enable_gqa=True).transpose(0, 1)
        assert_close(f"o[{b}]", ref, out[s:e], 1e-5)
    assert torch.equal(kc[~touched], before_k[~touched]), "K write touched positions outside the batch"
    assert torch.equal(vc[~touched], before_v[~touched]), "V write touched positions outside the batch"


@pytest.mark.parametrize("name", list(REGISTRY))
def test_each_op_is_a_module_and_an_entry_of_the_table(name):
    """metrale_graph.ops.<name> is the op's module (not shadowed by the op); the op itself is OPS.<name>,
    torch.ops.metrale.<name>, and the registry's."""
    module = getattr(metrale_graph.ops, name)
    assert isinstance(module, types.ModuleType) and module is importlib.import_module(f"metrale_graph.ops.{name}")
    op = REGISTRY[name].op
    assert getattr(OPS, name) is op and getattr(module, name) is op
    assert getattr(torch.ops.metrale, name).default is op._opoverload
    for sub in pkgutil.iter_modules(getattr(module, "__path__", [])):  # an op package's files: not shadowed either
        assert getattr(module, sub.name) is importlib.import_module(f"{module.__name__}.{sub.name}"), sub.name


def _toy_check(a):
    check(a.factor > 0, f"factor must be positive, got {a.factor}")


@metrale_op(check=_toy_check)
def toy_scale(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
    """A toy op for the registry tests: x * factor."""
    return x * factor


@metrale_fake(toy_scale)
def _(a):
    return a.x.new_empty(a.x.shape)


@metrale_cuda(toy_scale)
def toy_scale_cuda(a):
    return a.x * a.factor


def test_an_op_is_added_by_its_module_and_one_registry_line():
    """Registering a spec is all it takes for an op to join the opcheck cases, the table (and the rest);
    its name, signature and reference come from its declaration."""
    def example(s, dtype, g):
        return torch.randn(s.T, s.D, generator=g).to(dtype), 3.0

    spec = OpSpec(toy_scale, example, lambda s: (0, 4 * s.T * s.D), cuda=toy_scale_cuda)
    assert spec.name == "toy_scale" and spec.mutates == () and list(spec.signature.parameters) == ["x", "factor"]
    register(spec)
    try:
        assert OPS.toy_scale is toy_scale
        cases = [(n, c, d) for n, c, d in opcheck_cases() if n == "toy_scale"]
        assert len(cases) == 2 * len(CASES)
        for name, case, dtype in cases[:2]:
            torch.library.opcheck(REGISTRY[name].op, op_args(name, case, dtype))
        x = torch.randn(3, 4)
        assert torch.equal(spec.reference(x, 3.0), x * 3.0) and torch.equal(spec.reference(x), x * 2.0)
        with pytest.raises(ValueError, match="metrale_op"):
            OpSpec(torch.sin, example, None)
    finally:
        REGISTRY.pop("toy_scale")
        delattr(OPS, "toy_scale")


def test_the_check_runs_in_every_implementation():
    """The declared check runs before the CPU reference (through the dispatcher and directly), the fake
    and the CUDA implementation, its message prefixed with the op's name; arguments bind by name, with
    the declared defaults."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(3, 4)
    message = r"^metrale::toy_scale: factor must be positive, got -1\.0$"
    mode = FakeTensorMode()
    fake_x = mode.from_tensor(x)
    for impl in (toy_scale, OpSpec(toy_scale, None, None).reference, toy_scale_cuda):
        with pytest.raises(OpInputError, match=message):
            impl(x, -1.0)
    with mode, pytest.raises(OpInputError, match=message):
        toy_scale(fake_x, factor=-1.0)
    with mode:
        assert toy_scale(fake_x).shape == x.shape
    assert torch.equal(toy_scale_cuda(x, factor=0.5), x * 0.5) and torch.equal(toy_scale_cuda(x), x * 2.0)


def test_bad_inputs_name_op_and_argument():
    case = CASES[0]
    q, k, v, g, beta, cu, slots, state = op_args("gdn_recurrence", case, torch.float32)
    with pytest.raises(OpInputError, match=r"metrale::gdn_recurrence: gdn_state must be torch.float32"):
        OPS.gdn_recurrence(q, k, v, g, beta, cu, slots, state.bfloat16())
    with pytest.raises(ValueError, match=r"metrale::gdn_recurrence: gdn_state slots are \(4, 8, 24\)"):
        OPS.gdn_recurrence(q, k, v, g, beta, cu, slots, state[:, :, :8])
    x, w, cu, slots, conv_state = op_args("causal_conv1d", case, torch.float32)
    with pytest.raises(ValueError, match=r"metrale::causal_conv1d: 2 slot_ids for 3 streams"):
        OPS.causal_conv1d(x, w, cu, slots[:2], conv_state)
    with pytest.raises(ValueError, match=r"metrale::causal_conv1d: cu_seqlens must be torch.int32"):
        OPS.causal_conv1d(x, w, cu.long(), slots, conv_state)
    args = list(op_args("paged_attention", case, torch.float32))
    args[3] = args[3][..., :8]
    with pytest.raises(ValueError, match=r"metrale::paged_attention: k_cache blocks hold"):
        OPS.paged_attention(*args)
    # no key heads / no KV heads: were ZeroDivisionErrors in the checks' modulo (HV % H, HQ % HKV)
    args = list(op_args("gdn_recurrence", case, torch.float32))
    args[0], args[1] = args[0][:, :0], args[1][:, :0]
    with pytest.raises(ValueError, match=r"metrale::gdn_recurrence: q must have heads of a positive size"):
        OPS.gdn_recurrence(*args)
    args = list(op_args("paged_attention", case, torch.float32))
    args[1], args[2], args[3], args[4] = (t[..., :0, :] for t in args[1:5])
    with pytest.raises(ValueError, match=r"metrale::paged_attention: k \(.*\) do not fit q .*HQ % HKV == 0"):
        OPS.paged_attention(*args)
    args = list(op_args("attn_proj", case, torch.float32))
    args[12] = 0  # head_dim: was a ZeroDivisionError in the check's modulo
    for impl in (OPS.attn_proj, REGISTRY["attn_proj"].cuda):
        with pytest.raises(ValueError, match=r"metrale::attn_proj: head_dim must be positive, got 0"):
            impl(*args)
    args = list(op_args("gdn_out", case, torch.bfloat16))
    args[3] = args[3].float()  # the gated norm's weight in another dtype than the activations
    with pytest.raises(ValueError, match=r"metrale::gdn_out: gnorm_w must be torch.bfloat16"):
        OPS.gdn_out(*args)


@pytest.mark.parametrize("case", [CASES[1], CASES[8], CASES[9]], ids=lambda c: c.id)
@pytest.mark.parametrize("name", ["causal_conv1d", "gdn_recurrence"])
def test_opcheck_with_checkpoint_pools(name, case):
    """opcheck of the GDN ops with their optional mutated checkpoint pools given (prefix caching), some
    checkpoints naming no token (-1, past the last); no tokens at all included (the conv's reference indexed
    its empty input: IndexError)."""
    g = torch.Generator().manual_seed(6)
    args = op_args(name, case, torch.float32)
    shape = (case.C, case.W - 1) if name == "causal_conv1d" else (case.HV, case.K, case.V)
    tokens = torch.tensor([case.T - 1, -1, case.T + 2, 0])
    entries = torch.tensor([2, 0, 3, 1])
    torch.library.opcheck(REGISTRY[name].op, (*args, tokens, entries, torch.randn(5, *shape, generator=g)))


@pytest.mark.parametrize("name", [n for n in REGISTRY if n != "l2norm"])  # (l2norm: one tensor, any device)
def test_an_argument_on_another_device_is_named(name):
    """Each tensor argument on another device than the rest (here the meta device) raises OpInputError naming the
    device, in the reference and the CUDA path: the norm weights, A_log and dt_bias went unchecked (the reference
    ran; on a GPU the Triton kernels would have read a host pointer)."""
    args = op_args(name, CASES[0], torch.float32)
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            continue
        moved = [x.clone() if isinstance(x, torch.Tensor) else x for x in args]
        moved[i] = a.to("meta")
        for impl in (REGISTRY[name].op, REGISTRY[name].cuda):
            with pytest.raises(OpInputError, match=rf"^metrale::{name}: .*meta"):
                impl(*moved)


def test_moe_with_cu_seqlens():
    """moe's optional cu_seqlens (the step's, marking padding rows for the CUDA path's experts): opcheck holds with
    it, the reference ignores it (equal outputs), and one of another dtype or rank is an OpInputError naming it."""
    args = op_args("moe", CASES[0], torch.float32)
    T = args[0].shape[0]
    cu = torch.tensor([0, T - 1], dtype=torch.int32)
    torch.library.opcheck(REGISTRY["moe"].op, (*args, 0, True, cu))
    assert torch.equal(OPS.moe(*args, 0, True, cu), OPS.moe(*args))
    for bad in (cu.long(), cu[None]):
        with pytest.raises(OpInputError, match="cu_seqlens"):
            OPS.moe(*args, 0, True, bad)


def test_moe_compiles_with_dynamic_ints():
    """torch.compile(dynamic=True) of a function taking moe's top_k and first_expert as arguments traces them as
    SymInts: the check took only ints, so the fake raised OpInputError ('top_k must be in 1..s21, got s77') and
    fullgraph compilation failed. The compiled call equals the eager one."""
    args = op_args("moe", CASES[0], torch.float32)
    compiled = torch.compile(lambda *a: OPS.moe(*a, 0, True), fullgraph=True, dynamic=True, backend="aot_eager")
    assert_close("moe (compiled, dynamic)", OPS.moe(*args), compiled(*args), 1e-6)


@pytest.mark.parametrize("name", ["gdn_out", "attn_out", "mlp"])
def test_without_the_residual(name):
    """Tensor-parallel ranks other than 0 run the output ops without the residual (residual None /
    add_residual False): the op's full output minus its residual, and opcheck holds for that form."""
    args = list(op_args(name, CASES[0], torch.float32))
    full = REGISTRY[name].op(*args)
    if name == "mlp":
        partial_args, residual = args + [False], args[0]
    else:
        partial_args, residual = list(args), args[2]
        partial_args[2] = None
    torch.library.opcheck(REGISTRY[name].op, partial_args)
    assert_close(name, full - residual, REGISTRY[name].op(*partial_args), 1e-6)
    assert_close(f"{name} (CUDA path)", full - residual, REGISTRY[name].cuda(*partial_args), 1e-5)


@pytest.mark.parametrize("impl", ["reference", "cuda"])
def test_moe_expert_shards_sum_to_the_whole(impl):
    """Experts split over two tensor-parallel ranks (the router sees all of them, each rank runs its
    own, rank 0 adds the residual; the shared expert split by its intermediate size): the two partial
    outputs sum to the op's output."""
    case = next(c for c in CASES if c.E % 2 == 0 and c.IS % 2 == 0 and c.T > 0)
    args = list(op_args("moe", case, torch.float32, seed=4))
    h, norm_w, router, w13, w13_s, w2, w2_s, sg, sg_s, su, su_s, sd, sd_s, seg, top_k, norm_topk, eps = args
    fn = REGISTRY["moe"].op if impl == "reference" else REGISTRY["moe"].cuda
    half, ihalf = case.E // 2, case.IS // 2
    parts = []
    for r in range(2):
        e, i = slice(r * half, (r + 1) * half), slice(r * ihalf, (r + 1) * ihalf)
        shard = [h, norm_w, router, w13[e], w13_s, w2[e], w2_s, sg[i], sg_s, su[i], su_s, sd[:, i], sd_s, seg, top_k,
                 norm_topk, eps, r * half, r == 0]
        if impl == "reference":
            torch.library.opcheck(REGISTRY["moe"].op, shard)
        parts.append(fn(*shard))
    assert_close("moe over 2 expert shards", REGISTRY["moe"].op(*args), parts[0] + parts[1], 1e-5)

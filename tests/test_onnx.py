"""ONNX export of the packed prefill step: every metrale op as standard ONNX operators, run in
plain onnxruntime against the torch step and the ops' CPU references; a metrale op without a
translation is an error that names it.

Batches are padded to the bucket by the one padding contract (metrale_graph/batch.py): spare
streams are zero-length on the scratch slot, spare tokens lie past the last stream, in no stream.
Their output rows are unspecified; every pool, the scratch slot and the null block included, must
come out as the torch step leaves it.
"""

import copy

import pytest
import torch

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")

from helpers import packed_batch, random_tokens, unit_gain  # noqa: E402
from metrics import assert_close  # noqa: E402
from metrale_graph import HybridModel, Stream, envs  # noqa: E402
from metrale_graph.batch import PackedBatch  # noqa: E402
from metrale_graph.onnx import (check_versions, export_onnx, export_prefill, ort_session, run_step,  # noqa: E402
                                translation)
from metrale_graph.ops import OPS, REGISTRY, Shapes  # noqa: E402
from op_cases import op_args  # noqa: E402

TRANSLATIONS = {name: translation(spec) for name, spec in REGISTRY.items()}

VOCAB = 512


@pytest.fixture(scope="module")
def model():
    """Unit-gain matrices (helpers.unit_gain): with the preset's std 0.02, an exported step that scaled
    layer 0's MLP output by 1 + 3e-4 matched the torch step within 1e-4; now it is 4e-4..7e-4 apart (fp32
    noise between the two: up to 5e-6)."""
    return unit_gain(HybridModel.from_preset("tiny", seed=7), 7)


def _cache_with_context(model):
    """Slots 1, 3, 4 hold 40, 17 and 5 tokens of context; 16-token blocks, 8 per slot."""
    cache = model.new_cache(6, 24, block_size=16, max_context=128)
    model.prefill(cache, [Stream(1, random_tokens(40, 1)), Stream(3, random_tokens(17, 2)),
                          Stream(4, random_tokens(5, 3))])
    return cache


def _domains(graph):
    """Operator domains of a graph's nodes, loop bodies included."""
    found = set()
    for node in graph.node:
        found.add(node.domain)
        for attr in node.attribute:
            for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                found |= _domains(g)
    return found


BUCKETS = [
    # continues slots 1 and 3, starts slot 0: 64 tokens fill T exactly; 1 zero-length stream
    pytest.param(4, 64, [(1, 30), (3, 14), (0, 20)], id="B4-T64-exact"),
    # continues 4 and 1, starts 2 and 5: 84 tokens + 12 tokens in no stream; 2 zero-length streams
    pytest.param(6, 96, [(4, 25), (1, 7), (2, 33), (5, 19)], id="B6-T96-padded"),
    # every stream of the bucket used, and spare tokens (the old padding stream could not do this)
    pytest.param(2, 64, [(3, 20), (0, 9)], id="B2-T64-all-streams"),
]


@pytest.mark.parametrize("B, T, new", BUCKETS)
def test_onnxruntime_step_matches_torch_step(model, tmp_path, B, T, new):
    cfg = model.config
    cache = _cache_with_context(model)
    path = str(tmp_path / "step.onnx")
    export_prefill(model, cache, B, T).save(path)
    proto = onnx.load(path)
    onnx.checker.check_model(proto, full_check=True)
    assert not proto.functions and _domains(proto.graph) == {""}  # standard operators only

    pools = cache.pool_names()
    assert pools[0] == "conv_state_L0" and pools[-1] == "v_cache_L3"
    assert [i.name for i in proto.graph.input] == PackedBatch.names() + pools
    assert [o.name for o in proto.graph.output] == ["logits"] + [f"{p}_out" for p in pools]

    def dims(value):
        return [d.dim_value for d in value.type.tensor_type.shape.dim]

    shapes = [[T], [T], [B + 1], [B], [B], [B, cache.max_blocks_per_slot]] + [list(p.shape) for p in cache.pools()]
    assert [dims(i) for i in proto.graph.input] == shapes
    assert [dims(o) for o in proto.graph.output] == [[B, cfg.vocab_size]] + shapes[6:]

    streams = [Stream(slot, random_tokens(n, 10 + slot)) for slot, n in new]
    batch = packed_batch(model, cache, streams).padded(B, T, cache)
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    assert lengths == [n for _, n in new] + [0] * (B - len(new))
    assert batch.context_lens.max() > 0  # a continuation: the step reads cached context

    before = [p.clone() for p in cache.pools()]
    ref_cache = copy.deepcopy(cache)
    with torch.no_grad():
        ref = model.forward_packed(ref_cache, batch)
    out = run_step(ort_session(path), batch, cache)
    assert all(torch.equal(a, b) for a, b in zip(cache.pools(), before))  # inputs left as they were

    assert_close("logits", ref, torch.from_numpy(out["logits"]), 1e-4)
    busy_slots = set(batch.slot_ids[torch.tensor(lengths) > 0].tolist())
    busy_blocks = set(batch.block_tables.flatten().tolist())
    for name, expected, old in zip(pools, ref_cache.pools(), before):
        got = torch.from_numpy(out[f"{name}_out"])
        assert_close(name, expected, got, 1e-4)
        rows = busy_slots if "state" in name else busy_blocks
        untouched = [i for i in range(old.shape[0]) if i not in rows]
        assert untouched and torch.equal(got[untouched], old[untouched]), f"{name}: rows outside the batch changed"


# one op at a time against its CPU reference; streams 1 and 4 are zero-length and share the
# scratch slot with the non-empty stream 2 between them, so they must not write it back
OP_CASE = Shapes(lengths=(5, 0, 2, 17, 0, 1), context=(3, 0, 0, 9, 0, 0))


class _OneOp(torch.nn.Module):
    """Calls one metrale op (through metrale_graph.ops.OPS, as the model does) on clones of the arguments
    it mutates; returns its outputs and the clones."""

    def __init__(self, name):
        super().__init__()
        spec = REGISTRY[name]
        self.name = name
        self.mutated = spec.mutated_positions

    def forward(self, *args):
        mutated = [i for i in self.mutated if i < len(args)]  # (optional pools left out: not passed)
        args = [a.clone() if i in mutated else a for i, a in enumerate(args)]
        out = getattr(OPS, self.name)(*args)
        return (*(out if isinstance(out, tuple) else (out,)), *(args[i] for i in mutated))


def _op_case_args(name):
    args = list(op_args(name, OP_CASE, torch.float32, seed=3))
    names = list(REGISTRY[name].signature.parameters)
    if "slot_ids" in names:
        i = names.index("slot_ids")
        args[i] = args[i].clone()
        args[i][2] = args[-1].shape[0] - 1  # stream 2 on the scratch slot too
    return args


@pytest.mark.parametrize("name", list(REGISTRY))
def test_each_op_matches_its_reference(name):
    _check_op_against_reference(name, _op_case_args(name))


@pytest.mark.parametrize("name", ["causal_conv1d", "gdn_recurrence", "paged_attention"])
def test_mutating_ops_with_no_tokens(name):
    """Two zero-length streams, no token: outputs empty, pools as they were (causal_conv1d's translation
    gathered rows of its empty input: onnxruntime's 'indices element out of data bounds')."""
    _check_op_against_reference(name, list(op_args(name, Shapes(lengths=(0, 0), context=(0, 0)), torch.float32, 3)))


def _check_op_against_reference(name, args):
    module = _OneOp(name)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    proto = export_onnx(module, tuple(args)).model_proto
    onnx.checker.check_model(proto, full_check=True)
    session = ort_session(proto)
    got = session.run(None, {i.name: t.numpy() for i, t in zip(session.get_inputs(), tensors)})
    ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    ref = REGISTRY[name].reference(*ref_args)
    ref = [*(ref if isinstance(ref, tuple) else (ref,)), *(ref_args[i] for i in module.mutated if i < len(args))]
    assert len(got) == len(ref)
    for k, (r, g) in enumerate(zip(ref, got)):
        assert_close(f"{name} output {k}", r, torch.from_numpy(g), 1e-5)


@pytest.mark.parametrize("name", ["l2norm", "causal_conv1d"])
def test_missing_translation_names_the_op(name):
    table = {k: v for k, v in TRANSLATIONS.items() if k != name}
    with pytest.raises(ValueError, match=f"no ONNX translation for metrale::{name}"):
        export_onnx(_OneOp(name), tuple(_op_case_args(name)), translations=table)


def test_translation_for_an_unknown_op_is_rejected():
    with pytest.raises(ValueError, match="unknown ops \\['gdn_prj'\\]"):
        export_onnx(_OneOp("l2norm"), tuple(_op_case_args("l2norm")),
                    translations={"gdn_prj": TRANSLATIONS["gdn_proj"]})


def test_versions_outside_the_verified_range_are_named(monkeypatch):
    import metrale_graph.onnx as export

    check_versions()  # the versions this suite runs on are verified
    monkeypatch.setitem(export.VERIFIED, "torch", ((1, 0), (1, 13)))
    with pytest.raises(RuntimeError, match=r"verified on torch 1\.0-1\.13, onnxscript 0\.7-0\.7; found torch 2\."):
        check_versions()
    with envs.override(METRALE_ONNX_UNVERIFIED="1"):
        check_versions()


def test_export_tool_verifies_a_bucket_with_fewer_tokens_than_streams(tmp_path, capsys):
    """tools.export_onnx --verify on a bucket of more streams than tokens (B=4, T=2): the verify batch
    had B - 1 streams of at least a token each, more tokens than the bucket holds, and failed after
    the export (naming --slots / --blocks / --max-context, none of which helps)."""
    import json

    from metrale_graph.tools import export_onnx

    path = tmp_path / "b4t2.onnx"
    export_onnx.main(["--model", "tiny", "-B", "4", "-T", "2", "--slots", "6", "--blocks", "8", "--block-size", "16",
                      "--max-context", "64", "--verify", "--dtype", "float32", "-o", str(path)])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["batch_size"] == 4 and record["tokens"] == 2 and record["max_rel_error"] < 1e-4


def _usage_error(capsys, argv, message):
    """tools.export_onnx ends with argparse's usage message and exit code 2, no traceback."""
    from metrale_graph.tools import export_onnx

    with pytest.raises(SystemExit) as e:
        export_onnx.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage:" in err and message in err and "Traceback" not in err, err


def test_a_tensor_parallel_shard_is_refused_before_the_export(capsys):
    """A shard's step all-reduces (functional collectives, no ONNX form): export_prefill traced it and
    failed in the translation with a ConversionError, and tools.export_onnx took --tp (under torchrun it
    failed the same way after the export's work; without torchrun it asked for torchrun)."""
    from metrale_graph.parallel import TensorParallel

    shard = HybridModel.from_preset("tiny", seed=7, tp=TensorParallel(0, 2))
    with pytest.raises(ValueError, match=r"tensor-parallel shard \(rank 0 of 2\)"):
        export_prefill(shard, shard.new_cache(2, 4, block_size=16), 2, 16)
    _usage_error(capsys, ["--tp", "2", "-B", "2", "-T", "16"], "--tp: the ONNX export writes one whole model")


def test_export_tool_checks_its_default_output_path_before_any_work(capsys, monkeypatch, tmp_path):
    """Without -o the default file (prefill_B{B}_T{T}.onnx) passes -o's check: a folder of that name was found
    only after the whole export, as an IsADirectoryError traceback."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prefill_B2_T8.onnx").mkdir()
    _usage_error(capsys, ["-B", "2", "-T", "8"], "-o (default): 'prefill_B2_T8.onnx' is a folder")


@pytest.mark.parametrize("argv, message", [
    (["-B", "4", "-T", "256", "--slots", "6", "--blocks", "3"],
     "need 13 KV blocks (it has 3); pass --blocks 13"),
    (["-B", "2", "-T", "256", "--max-context", "16"],
     "put 211 tokens in a slot (it holds 64) and need 4 KV blocks (it has 64); pass --max-context 256"),
    (["-B", "8", "-T", "256", "--slots", "14", "--block-size", "16", "--max-context", "64", "--blocks", "10"],
     "pass --max-context 80 --blocks 25"),
])
def test_export_tool_checks_the_verify_batches_fit_before_any_work(capsys, monkeypatch, argv, message):
    """--verify's batches depend on the flags alone; a cache too small for them (--blocks, --max-context)
    failed only after the export, naming three flags without the values that fit."""
    import metrale_graph.onnx

    def no_export(*args, **kwargs):
        raise AssertionError("the export ran before the flags were checked")

    monkeypatch.setattr(metrale_graph.onnx, "export_prefill", no_export)
    _usage_error(capsys, argv + ["--verify", "--dtype", "float32"], message)


def test_run_step_names_the_input_a_batch_or_cache_gets_wrong(model, tmp_path):
    """A batch or cache that does not fit the exported step reached onnxruntime, which raised its own
    InvalidArgument (no ValueError); the pools were fed by position, so a cache of another model fed
    one pool's tensor to another's input and the error named the wrong one."""
    from helpers import tiny_config

    small = HybridModel.from_preset(tiny_config(num_hidden_layers=2, layer_types=("linear_attention",
                                                                                   "full_attention")), seed=1)
    cache = small.new_cache(4, 8, block_size=16, max_context=64)
    path = str(tmp_path / "step.onnx")
    export_prefill(small, cache, 2, 16).save(path)
    session = ort_session(path)
    streams = [Stream(0, [1, 2, 3])]
    batch = packed_batch(small, cache, streams)
    run_step(session, batch.padded(2, 16, cache), cache)  # fits

    with pytest.raises(ValueError, match=r"input tokens: shape \[3\], the exported step takes \[16\] \(pad the batch"):
        run_step(session, batch, cache)
    with pytest.raises(ValueError, match=r"input cu_seqlens: shape \[4\], the exported step takes \[3\]"):
        run_step(session, batch.padded(3, 16, cache), cache)
    other = small.new_cache(5, 8, block_size=16, max_context=64)
    with pytest.raises(ValueError, match=r"input conv_state_L0: shape \[6, 160, 3\], the exported step takes "
                                         r"\[5, 160, 3\]"):
        run_step(session, batch.padded(2, 16, other), other)
    wide = batch.padded(2, 16, cache)
    wide.positions = wide.positions.int()
    with pytest.raises(ValueError, match="input positions: dtype torch.int32, the exported step takes torch.int64"):
        run_step(session, wide, cache)
    deeper = model.new_cache(4, 8, block_size=16, max_context=64)  # the 4-layer model's pools
    with pytest.raises(ValueError, match=r"this batch and cache give .*'conv_state_L2'.* \(a cache of another model\)"):
        run_step(session, batch.padded(2, 16, deeper), deeper)

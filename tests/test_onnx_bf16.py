"""bf16 models exported to ONNX run in plain onnxruntime (CPU) and match the torch step: onnxruntime's
CPU kernels lack bf16 for everything but data movement, and ONNX's Einsum takes no bf16, so the
translations compute in fp32 and round to bf16 where the ops' references do (translations.py). One
export per family: a dense model and both MoE families, one of them through tools.export_onnx, as a
user runs it."""

import copy

import pytest
import torch

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")

from helpers import moe_config, packed_batch, random_tokens, tiny_config, unit_gain  # noqa: E402
from metrics import TOL, assert_close  # noqa: E402
from metrale_graph import HybridModel, Stream  # noqa: E402
from metrale_graph.onnx import export_prefill, ort_session, run_step, save_onnx  # noqa: E402

GDN_THEN_ATTENTION = dict(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
B, T = 2, 32
GEOMETRY = dict(slots=4, blocks=16, block_size=16, max_context=64)

# ops onnxruntime's CPU provider runs on bf16 tensors (probed on 1.32): moving values, not computing them
MOVES = {"Cast", "Concat", "Gather", "GatherElements", "GatherND", "Identity", "Reshape", "ScatterElements",
         "ScatterND", "Slice", "Squeeze", "Transpose", "Unsqueeze"}


def _nodes_computing_in_bf16(proto) -> list[str]:
    """'op_type(node name)' of every node, loop bodies included, with a bf16 input outside MOVES."""
    inferred = onnx.shape_inference.infer_shapes(proto)
    bf16, found = set(), []

    def types(graph):
        for v in [*graph.input, *graph.value_info, *graph.output]:
            if v.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16:
                bf16.add(v.name)
        bf16.update(t.name for t in graph.initializer if t.data_type == onnx.TensorProto.BFLOAT16)

    def walk(graph):
        types(graph)
        for node in graph.node:
            for attr in node.attribute:
                for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    walk(g)
            if node.op_type not in MOVES and bf16.intersection(node.input):
                found.append(f"{node.op_type}({node.name})")

    walk(inferred.graph)
    return found


def _cache_with_context(model):
    cache = model.new_cache(GEOMETRY["slots"], GEOMETRY["blocks"], block_size=GEOMETRY["block_size"],
                            max_context=GEOMETRY["max_context"])
    model.prefill(cache, [Stream(1, random_tokens(20, 1, model.config.vocab_size)),
                          Stream(3, random_tokens(7, 2, model.config.vocab_size))])
    return cache


def _export_with_the_tool(model, path, tmp_path):
    """tools.export_onnx --model <checkpoint> --dtype bfloat16 (it crashed for MoE models in
    check_model and left the invalid file); returns the model as the tool loaded it."""
    from metrale_graph.tools import export_onnx

    checkpoint = tmp_path / "checkpoint"
    model.save_pretrained(str(checkpoint))
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in GEOMETRY.items()]
    export_onnx.main(["--model", str(checkpoint), "--dtype", "bfloat16", "-B", str(B), "-T", str(T), *flags,
                      "-o", str(path)])
    return HybridModel.from_pretrained(str(checkpoint), dtype=torch.bfloat16, progress=False)


@pytest.mark.parametrize("config, through_tool", [
    pytest.param(tiny_config(**GDN_THEN_ATTENTION), False, id="dense"),
    pytest.param(moe_config("qwen3_5_moe_text", **GDN_THEN_ATTENTION), True, id="qwen3_5_moe-tool"),
    pytest.param(moe_config("qwen3_next", norm_topk_prob=False, mlp_only_layers=(1,), **GDN_THEN_ATTENTION),
                 False, id="qwen3_next-moe-then-mlp"),
])
def test_bf16_step_runs_in_onnxruntime_and_matches_the_torch_step(tmp_path, capsys, config, through_tool):
    model = unit_gain(HybridModel.from_preset(config, seed=7), 7)
    path = tmp_path / "step.onnx"
    if through_tool:
        model = _export_with_the_tool(model, path, tmp_path)
        assert str(path) in capsys.readouterr().out
    else:
        model = model.to(torch.bfloat16)
        save_onnx(export_prefill(model, _cache_with_context(model), B, T), path)
    assert model.dtype == torch.bfloat16
    proto = onnx.load(str(path))
    assert _nodes_computing_in_bf16(proto) == []
    session = ort_session(str(path))  # onnxruntime refused: no bf16 Gemm / Einsum / Add / Where ... kernels

    cache = _cache_with_context(model)
    streams = [Stream(1, random_tokens(9, 3, model.config.vocab_size)),
               Stream(0, random_tokens(14, 4, model.config.vocab_size))]
    batch = packed_batch(model, cache, streams).padded(B, T, cache)
    before = [p.clone() for p in cache.pools()]
    ref_cache = copy.deepcopy(cache)
    with torch.no_grad():
        ref = model.forward_packed(ref_cache, batch)
    out = run_step(session, batch, cache)
    assert all(torch.equal(a, b) for a, b in zip(cache.pools(), before))

    def tensor(name, dtype):  # bf16 outputs come as ml_dtypes.bfloat16 arrays: to fp32 exactly, then back
        return torch.from_numpy(out[name].astype("float32")).to(dtype)

    assert out["logits"].dtype.name == "bfloat16"
    assert_close("logits", ref, tensor("logits", torch.bfloat16), TOL[torch.bfloat16])
    busy = {s.slot for s in streams}
    for name, expected, old in zip(cache.pool_names(), ref_cache.pools(), before):
        got = tensor(f"{name}_out", old.dtype)
        assert_close(name, expected, got, TOL[torch.bfloat16])
        rows = busy if "state" in name else set(batch.block_tables.flatten().tolist())
        untouched = [i for i in range(old.shape[0]) if i not in rows]
        assert torch.equal(got[untouched], old[untouched]), f"{name}: rows outside the batch changed"

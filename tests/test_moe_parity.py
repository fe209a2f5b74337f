"""The MoE families (Qwen3.5-MoE text and multimodal, Qwen3-Next): config, checkpoints both ways,
prefill against transformers (fp32, CPU), batching and chunking, and the compiled step."""

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch._dynamo.utils import counters

from helpers import moe_config, random_tokens, run_step, unit_gain
from metrics import rel_err
from references import check_parity, hf_class, hf_reference
from metrale_graph import PRESETS, HybridModel, ModelConfig, Stream, load_config
from metrale_graph.config import FULL, LINEAR
from metrale_graph.families import QWEN3_NEXT
from metrale_graph.spec import checkpoint_shapes, weight_shapes


CONFIGS = [
    # 5 experts top-3, grouped value heads (r = 2), dk 16 != dv 24
    pytest.param(moe_config("qwen3_5_moe_text"), id="qwen3_5_moe-e5-top3-r2-dk16-dv24"),
    pytest.param(moe_config("qwen3_5_moe_text", num_experts=7, num_experts_per_tok=1, linear_num_key_heads=1,
                            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=20,
                            tie_word_embeddings=True), id="qwen3_5_moe-e7-top1-r4-dk8-dv20-tied"),
    # dense layers mixed in: MoE where (i + 1) % 2 == 0 and i not in mlp_only_layers -> layers 1 and 5
    pytest.param(moe_config("qwen3_next", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,),
                            norm_topk_prob=True), id="qwen3_next-norm_topk-step2-mlp_only3"),
    pytest.param(moe_config("qwen3_next", num_experts=6, num_experts_per_tok=4, norm_topk_prob=False,
                            mlp_only_layers=(0,), linear_num_key_heads=3, linear_num_value_heads=6,
                            linear_key_head_dim=8, linear_value_head_dim=12),
                 id="qwen3_next-no-norm_topk-mlp_only0-H3-r2-dk8-dv12"),
]


def _checkpoint_keys(folder) -> set[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    return set(load_file(os.path.join(folder, "model.safetensors")))


# ---- parity with transformers -------------------------------------------------------------------

@pytest.mark.parametrize("cfg", CONFIGS)
def test_logits_match_transformers(tmp_path, cfg):
    """transformers' save_pretrained checkpoint (experts one tensor each; Qwen3-Next's GDN fused)
    loads, and the batched prefill matches transformers stream by stream."""
    hf = hf_reference(cfg)
    hf.save_pretrained(tmp_path)
    keys = _checkpoint_keys(tmp_path)
    moe = cfg.moe_layers[0]
    assert f"model.layers.{moe}.mlp.experts.{cfg.num_experts - 1}.up_proj.weight" in keys
    assert ("model.layers.0.linear_attn.in_proj_qkvz.weight" in keys) == (cfg.model_type == "qwen3_next")
    model = HybridModel.from_pretrained(str(tmp_path), progress=False)
    assert model.config == cfg
    dense = [i for i in range(cfg.num_hidden_layers) if i not in cfg.moe_layers]
    assert all(hasattr(model.layers[i].mlp, "experts") for i in cfg.moe_layers)
    assert all(hasattr(model.layers[i].mlp, "gate_proj") for i in dense)
    check_parity(model, hf, cfg)


def test_multimodal_sharded_checkpoint(tmp_path):
    """A qwen3_5_moe (multimodal) checkpoint, sharded: text weights under model.language_model.,
    experts one tensor each across shards, the vision tower skipped."""
    cfg = moe_config("qwen3_5_moe_text")
    hf = hf_reference(cfg, multimodal=True)
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 3
    assert any(k.startswith("model.visual.") for k in weight_map)
    assert "model.language_model.layers.2.mlp.experts.4.down_proj.weight" in weight_map
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    model = HybridModel.from_pretrained(str(tmp_path), progress=False)
    assert model.config == cfg
    check_parity(model, hf, cfg, lengths=[1, 65, 130])


# ---- batching, chunking, bad input ----------------------------------------------------------------

@pytest.fixture(scope="module")
def next_model():
    """Qwen3-Next with MoE and dense layers mixed, random weights (no transformers). Matrices of unit
    gain (std in**-0.5, as hf_reference): with random_weights' 0.02 every layer adds next to nothing to
    the residual stream, and a GDN state dropped between prefill calls moved the logits by 3e-6."""
    model = HybridModel.from_preset(moe_config("qwen3_next", num_hidden_layers=6, decoder_sparse_step=2,
                                               mlp_only_layers=(3,), num_experts=6, num_experts_per_tok=2),
                                    seed=4)
    return unit_gain(model, 4)


def test_batched_equals_each_alone(next_model):
    model = next_model
    lengths = [1, 63, 64, 65, 130, 7]
    streams = [random_tokens(n, i, model.config.vocab_size) for i, n in enumerate(lengths)]
    batched = model.prefill(model.new_cache(8, 64, block_size=16), [Stream(7 - i, t) for i, t in enumerate(streams)])
    for i, t in enumerate(streams):
        alone = model.prefill(model.new_cache(8, 64, block_size=16), [Stream(7 - i, t)])
        assert rel_err(batched[i], alone[0]) <= 1e-5


def test_chunks_equal_one_shot(next_model):
    model = next_model
    vocab = model.config.vocab_size
    tokens = random_tokens(150, 11, vocab)
    one = model.prefill(model.new_cache(4, 32, block_size=16), [Stream(1, tokens)])
    cache = model.new_cache(4, 32, block_size=16)
    model.prefill(cache, [Stream(1, tokens[:2])])
    model.prefill(cache, [Stream(3, random_tokens(40, 12, vocab)), Stream(1, tokens[2:67])])
    last = model.prefill(cache, [Stream(1, tokens[67:])])
    assert rel_err(last[0], one[0]) <= 1e-5


@pytest.mark.parametrize("make_batch, message", [
    (lambda v: [Stream(0, [1, 2]), Stream(1, [3, v])], "token id {v} is out of range"),
    (lambda v: [Stream(2, [1] * 100), Stream(3, [1] * 100)], "more KV blocks"),
], ids=["token-out-of-range", "out-of-blocks"])
def test_bad_input_leaves_the_cache_unchanged(next_model, make_batch, message):
    model = next_model
    vocab = model.config.vocab_size
    cache = model.new_cache(4, 12, block_size=16)
    model.prefill(cache, [Stream(0, random_tokens(20, 1, vocab)), Stream(1, random_tokens(100, 2, vocab))])
    before = [t.clone() for t in cache.state_tensors()], list(cache.context_lens), cache.free_blocks
    with pytest.raises(ValueError, match=message.format(v=vocab)):
        model.prefill(cache, make_batch(vocab))
    tensors, ctx, free = before
    assert all(torch.equal(a, b) for a, b in zip(cache.state_tensors(), tensors))
    assert cache.context_lens == ctx and cache.free_blocks == free


# ---- our checkpoints ----------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[3]])
def test_our_checkpoint_round_trips_through_transformers(tmp_path, cfg):
    """save_pretrained writes what transformers' save_pretrained writes for the family (experts one
    tensor each, Qwen3-Next's in_proj_qkvz / in_proj_ba), which transformers loads and agrees with,
    and which loads back bit for bit."""
    model = unit_gain(HybridModel.from_preset(cfg, seed=2), 2)  # random_weights' 0.02 routes almost uniformly
    model.save_pretrained(str(tmp_path))
    keys = {k.removeprefix("model.") for k in _checkpoint_keys(tmp_path)}
    assert keys == set(checkpoint_shapes(cfg))
    hf_reference(cfg).save_pretrained(tmp_path / "hf")  # what transformers writes for the family
    assert {k.removeprefix("model.") for k in _checkpoint_keys(tmp_path / "hf")} == keys
    hf = hf_class(cfg).from_pretrained(str(tmp_path), dtype=torch.float32, experts_implementation="eager").eval()
    check_parity(model, hf, cfg, lengths=[3, 70])
    back = HybridModel.from_pretrained(str(tmp_path), progress=False)
    mine = dict(model.named_parameters())
    assert all(torch.equal(p, mine[n]) for n, p in back.named_parameters())


def test_gdn_fusion_is_transformers_interleaving():
    """Qwen3-Next's fusions: split inverts fuse, and the fused rows are grouped per key head as
    transformers' fix_query_key_value_ordering reads them."""
    cfg = moe_config("qwen3_next", linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=3,
                     linear_value_head_dim=5)
    H, K, HV, V, D = 2, 3, 6, 5, cfg.hidden_size
    qkv, z = torch.randn(2 * H * K + HV * V, D), torch.randn(HV * V, D)
    b, a = torch.randn(HV, D), torch.randn(HV, D)
    fuse_qkvz, fuse_ba = QWEN3_NEXT.fusions
    assert fuse_qkvz.name == "linear_attn.in_proj_qkvz.weight" and fuse_ba.name == "linear_attn.in_proj_ba.weight"
    qkvz, ba = fuse_qkvz.fuse((qkv, z), cfg), fuse_ba.fuse((b, a), cfg)
    assert qkvz.shape == (fuse_qkvz.rows(cfg), D) and ba.shape == (fuse_ba.rows(cfg), D)
    assert all(torch.equal(x, y) for x, y in zip(fuse_qkvz.split(qkvz, cfg) + fuse_ba.split(ba, cfg), (qkv, z, b, a)))
    group = 2 * K + 2 * (HV // H) * V  # rows of key head 1: q, k, then its 3 value heads' v, then z
    assert torch.equal(qkvz[group:group + K], qkv[K:2 * K])  # q of head 1
    assert torch.equal(qkvz[group + K:group + 2 * K], qkv[H * K + K:H * K + 2 * K])  # k of head 1
    assert torch.equal(qkvz[group + 2 * K:group + 2 * K + 3 * V], qkv[2 * H * K + 3 * V:2 * H * K + 6 * V])
    assert torch.equal(qkvz[-3 * V:], z[3 * V:])
    assert torch.equal(ba[3:6], a[:3]) and torch.equal(ba[6:9], b[3:])


def test_stacked_expert_checkpoint_loads(tmp_path):
    """A checkpoint that already holds transformers' in-memory names (mlp.experts.gate_up_proj,
    down_proj) loads as it is, and the same weights as the per-expert one."""
    cfg = moe_config("qwen3_5_moe_text")
    model = HybridModel.from_preset(cfg, seed=6)
    model.save_pretrained(str(tmp_path))
    tensors = {("model." + n if n != "lm_head.weight" else n): p.detach().contiguous().clone()
               for n, p in model.named_parameters()}
    save_file(tensors, tmp_path / "model.safetensors")
    back = HybridModel.from_pretrained(str(tmp_path), progress=False)
    mine = dict(model.named_parameters())
    assert all(torch.equal(p, mine[n]) for n, p in back.named_parameters())


# ---- loading errors -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """model_type -> a folder holding our checkpoint of a small config of that family."""
    out = {}
    for cfg in (moe_config("qwen3_5_moe_text"), moe_config("qwen3_next", mlp_only_layers=(1,))):
        folder = tmp_path_factory.mktemp(cfg.model_type)
        HybridModel.from_preset(cfg).save_pretrained(str(folder))
        out[cfg.model_type] = folder
    return out


def _edited(checkpoints, model_type, edit, tmp_path):
    """A copy of a family's checkpoint with its tensors edited."""
    src = checkpoints[model_type]
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    return str(tmp_path)


def _stack(t, layer):
    """Replace layer's per-expert gate/up tensors by the stacked gate_up_proj."""
    p = f"model.layers.{layer}.mlp.experts."
    E = 1 + max(int(k[len(p):].split(".")[0]) for k in t if k.startswith(p))
    t[p + "gate_up_proj"] = torch.stack([torch.cat([t.pop(f"{p}{e}.gate_proj.weight"), t.pop(f"{p}{e}.up_proj.weight")])
                                         for e in range(E)])


LOAD_ERRORS = [
    ("qwen3_5_moe_text", lambda t: t.pop("model.layers.3.mlp.experts.4.up_proj.weight"),
     r"lacks 1 tensor\(s\) the config needs, e\.g\. \['layers\.3\.mlp\.experts\.4\.up_proj\.weight'\]"),
    ("qwen3_5_moe_text", lambda t: t.update({"model.layers.1.mlp.experts.2.down_proj.weight": torch.zeros(20, 48)}),
     r"'model\.layers\.1\.mlp\.experts\.2\.down_proj\.weight' has shape \(20, 48\), the config needs \(48, 20\)"),
    ("qwen3_5_moe_text", lambda t: t.update({"model.layers.0.mlp.experts.5.gate_proj.weight": torch.zeros(20, 48)}),
     r"unexpected tensor.*'model\.layers\.0\.mlp\.experts\.5\.gate_proj\.weight'"),
    ("qwen3_5_moe_text", lambda t: t.update({"model.layers.2.mlp.experts.gate_up_proj": torch.zeros(5, 40, 48)}),
     r"holds weights that 'model\.layers\.2\.mlp\.experts\.\d\.(gate|up)_proj\.weight' holds too"),
    ("qwen3_5_moe_text", lambda t: (_stack(t, 0), _stack(t, 1), t.pop("model.layers.1.mlp.experts.gate_up_proj")),
     r"lacks 10 tensor\(s\).*\['layers\.1\.mlp\.experts\.gate_up_proj'\]"),
    ("qwen3_5_moe_text", lambda t: t["model.layers.2.mlp.experts.3.gate_proj.weight"].__setitem__((1, 2), float("nan")),
     r"'model\.layers\.2\.mlp\.experts\.3\.gate_proj\.weight' in .* holds NaN or infinite values"),
    ("qwen3_5_moe_text", lambda t: t.pop("model.layers.0.mlp.shared_expert_gate.weight"),
     r"lacks 1 tensor.*'layers\.0\.mlp\.shared_expert_gate\.weight'"),
    ("qwen3_next", lambda t: t.pop("model.layers.0.linear_attn.in_proj_ba.weight"),
     r"lacks 1 tensor.*'layers\.0\.linear_attn\.in_proj_ba\.weight'"),
    ("qwen3_next", lambda t: t.update({"model.layers.0.linear_attn.in_proj_qkv.weight": torch.zeros(160, 48)}),
     r"unexpected tensor.*'model\.layers\.0\.linear_attn\.in_proj_qkv\.weight'"),
    ("qwen3_next", lambda t: t.update({"model.layers.2.linear_attn.in_proj_qkvz.weight": torch.zeros(208, 48)}),
     r"'model\.layers\.2\.linear_attn\.in_proj_qkvz\.weight' has shape \(208, 48\), the config needs \(256, 48\)"),
    ("qwen3_next", lambda t: t.update({"model.layers.1.mlp.experts.0.up_proj.weight": torch.zeros(20, 48)}),
     r"unexpected tensor.*'model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight'"),  # layer 1 is dense
]


@pytest.mark.parametrize("model_type, edit, message", LOAD_ERRORS,
                         ids=["missing-expert", "misshaped-expert", "expert-past-E", "stacked-and-per-expert",
                              "missing-stacked", "nan-in-expert", "missing-shared-gate", "missing-in_proj_ba",
                              "unfused-gdn-in-qwen3_next", "misshaped-qkvz", "expert-in-dense-layer"])
def test_loading_errors_name_the_tensor(checkpoints, tmp_path, model_type, edit, message):
    folder = _edited(checkpoints, model_type, edit, tmp_path)
    with pytest.raises(ValueError, match=message):
        HybridModel.from_pretrained(folder, progress=False)


def test_expert_in_two_shards_is_a_duplicate(checkpoints, tmp_path):
    src = checkpoints["qwen3_5_moe_text"]
    tensors = load_file(src / "model.safetensors")
    key = "model.layers.0.mlp.experts.1.up_proj.weight"
    save_file(tensors, tmp_path / "a.safetensors")
    save_file({key: tensors[key]}, tmp_path / "b.safetensors")
    weight_map = {k: "a.safetensors" for k in tensors} | {key: "b.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ValueError, match=re.escape(f"tensor {key!r} appears twice in the checkpoint")):
        HybridModel.from_pretrained(str(tmp_path), progress=False)


# ---- the compiled step ------------------------------------------------------------------------------

def test_compiled_moe_step_equals_eager_without_graph_breaks():
    torch._dynamo.reset()
    counters.clear()
    model = HybridModel.from_preset(moe_config("qwen3_next", num_hidden_layers=2, layer_types=(LINEAR, FULL),
                                               decoder_sparse_step=2, num_experts=6, num_experts_per_tok=2), seed=5)
    assert model.config.moe_layers == [1]  # a dense and a MoE layer in one graph
    unit_gain(model, 5)  # routers that pick (random_weights' 0.02 routes almost uniformly), layers that matter
    vocab = model.config.vocab_size
    first = [Stream(4, random_tokens(63, 1, vocab)), Stream(0, random_tokens(1, 2, vocab)),
             Stream(2, random_tokens(130, 3, vocab))]
    second = [Stream(2, random_tokens(20, 4, vocab)), Stream(1, random_tokens(65, 5, vocab))]
    compiled = torch.compile(model.forward_packed, fullgraph=True, dynamic=False)
    eager_cache, compiled_cache = model.new_cache(6, 32, block_size=16), model.new_cache(6, 32, block_size=16)
    for batch in (first, second):
        outs = []
        for step, cache in ((model.forward_packed, eager_cache), (compiled, compiled_cache)):
            outs.append(run_step(model, step, cache, batch))
        assert rel_err(outs[1], outs[0]) <= 1e-5
        for a, b in zip(compiled_cache.state_tensors(), eager_cache.state_tensors()):
            assert rel_err(a.float(), b.float()) <= 1e-5 if b.any() else torch.equal(a, b)
    assert dict(counters["graph_break"]) == {}, f"graph breaks: {dict(counters['graph_break'])}"
    assert counters["stats"]["unique_graphs"] == 2


# ---- config -----------------------------------------------------------------------------------------

def test_presets_and_transformers_defaults():
    import transformers

    moe, nxt = PRESETS["qwen3.5-35b-a3b"], PRESETS["qwen3-next-80b-a3b"]
    assert ModelConfig.from_hf(transformers.Qwen3_5MoeTextConfig().to_dict()) == moe
    assert ModelConfig.from_hf(transformers.Qwen3NextConfig().to_dict()) == nxt
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_layers) == (256, 8, list(range(40)))
    assert (nxt.num_experts, nxt.num_experts_per_tok, nxt.moe_layers) == (512, 10, list(range(48)))
    for cfg, billions in ((moe, 35), (nxt, 80)):
        n_params = sum(torch.Size(s).numel() for s in weight_shapes(cfg).values())
        assert abs(n_params / 1e9 - billions) < 1.5, n_params
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_moe_layers_follow_transformers():
    """moe_layers is the set of layers transformers builds a sparse MoE block in."""
    for cfg in (moe_config("qwen3_next", num_hidden_layers=7, decoder_sparse_step=3, mlp_only_layers=(5, 0)),
                moe_config("qwen3_next", num_experts=0), moe_config("qwen3_5_moe_text", num_hidden_layers=3)):
        hf = hf_reference(cfg)
        layers = hf.model.layers
        assert cfg.moe_layers == [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")]


def test_mlp_only_layers_past_the_last_layer_are_accepted_as_transformers_accepts_them():
    """An index past the last layer names no layer: transformers builds such a model (it was refused here),
    the same layers are MoE in both, and to_hf keeps the index, so the config round-trips."""
    hf_cfg = {**moe_config("qwen3_next").to_hf(), "mlp_only_layers": [1, 4, 9]}  # 4 layers: 0 .. 3
    cfg = ModelConfig.from_hf(hf_cfg)
    assert cfg.mlp_only_layers == (1, 4, 9) and cfg.moe_layers == [0, 2, 3]
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg and cfg.to_hf()["mlp_only_layers"] == [1, 4, 9]
    hf = hf_reference(cfg)
    assert cfg.moe_layers == [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    model = HybridModel.from_preset(cfg)
    assert [i for i, layer in enumerate(model.layers) if hasattr(layer.mlp, "experts")] == cfg.moe_layers


def test_multimodal_and_family_configs():
    text = moe_config("qwen3_5_moe_text").to_hf()
    del text["tie_word_embeddings"], text["model_type"]
    cfg = ModelConfig.from_hf({"model_type": "qwen3_5_moe", "tie_word_embeddings": True, "text_config": text})
    assert cfg == moe_config("qwen3_5_moe_text", tie_word_embeddings=True)
    # Qwen3.5-MoE has no norm_topk_prob / mlp_only_layers / dense MLP: transformers ignores them, and so do we
    extra = {**text, "norm_topk_prob": False, "mlp_only_layers": [0], "intermediate_size": 77}
    assert ModelConfig.from_hf({"model_type": "qwen3_5_moe", "text_config": extra}) == moe_config("qwen3_5_moe_text")
    nxt = moe_config("qwen3_next", mlp_only_layers=(2, 0), norm_topk_prob=False).to_hf()
    assert nxt["mlp_only_layers"] == [2, 0] and nxt["norm_topk_prob"] is False and nxt["intermediate_size"] == 80
    assert ModelConfig.from_hf({**nxt, "mlp_only_layers": None}).mlp_only_layers == ()


def _write_config(folder, data):
    (folder / "config.json").write_text(json.dumps(data))
    return str(folder / "config.json")


@pytest.mark.parametrize("model_type, patch, message", [
    ("qwen3_next", {"num_experts": -1}, "field 'num_experts' must be an integer >= 0, got -1"),
    ("qwen3_next", {"num_experts": "8"}, "field 'num_experts' must be an integer >= 0, got '8'"),
    ("qwen3_5_moe_text", {"num_experts": 2.5}, "field 'num_experts' must be an integer >= 0, got 2.5"),
    ("qwen3_5_moe_text", {"num_experts": 0}, "field 'num_experts' must be an integer >= 1 for model_type "
                                             "'qwen3_5_moe_text'"),
    ("qwen3_5_moe_text", {"num_experts_per_tok": 0}, "field 'num_experts_per_tok' must be an integer >= 1, got 0"),
    ("qwen3_next", {"num_experts_per_tok": 6}, r"field 'num_experts_per_tok' \(6\) exceeds num_experts \(5\)"),
    ("qwen3_next", {"num_experts_per_tok": True}, "field 'num_experts_per_tok' must be an integer >= 1, got True"),
    ("qwen3_5_moe_text", {"moe_intermediate_size": 0}, "field 'moe_intermediate_size' must be an integer >= 1"),
    ("qwen3_next", {"shared_expert_intermediate_size": None},
     "field 'shared_expert_intermediate_size' must be an integer >= 1, got None"),
    ("qwen3_next", {"norm_topk_prob": "true"}, "field 'norm_topk_prob' must be true or false, got 'true'"),
    ("qwen3_next", {"norm_topk_prob": 1}, "field 'norm_topk_prob' must be true or false, got 1"),
    ("qwen3_next", {"decoder_sparse_step": 0}, "field 'decoder_sparse_step' must be an integer >= 1, got 0"),
    ("qwen3_next", {"mlp_only_layers": 1}, "field 'mlp_only_layers' must be a list of layer indices, got 1"),
    ("qwen3_next", {"mlp_only_layers": [1.5]}, "field 'mlp_only_layers' must be an integer >= 0, got 1.5"),
    ("qwen3_next", {"mlp_only_layers": [-1]}, "field 'mlp_only_layers' must be an integer >= 0, got -1"),
    ("qwen3_next", {"mlp_only_layers": [1, 1]}, r"field 'mlp_only_layers' holds a layer twice: \[1, 1\]"),
    ("qwen3_next", {"mlp_only_layers": [1], "intermediate_size": 0},
     "field 'intermediate_size' must be an integer >= 1, got 0"),
])
def test_bad_moe_config_field(tmp_path, model_type, patch, message):
    path = _write_config(tmp_path, {**moe_config(model_type).to_hf(), **patch})
    with pytest.raises(ValueError, match=re.escape(f"invalid model config {path}: ") + message):
        load_config(str(tmp_path))


def test_moe_config_fields_checked_in_python():
    nxt = moe_config("qwen3_next")
    assert nxt.replace(mlp_only_layers=[3.0, 1]).mlp_only_layers == (3, 1)
    assert nxt.replace(intermediate_size=0, mlp_only_layers=()).intermediate_size == 0  # every layer MoE
    with pytest.raises(ValueError, match="field 'num_experts_per_tok' must be an integer >= 1, got 0"):
        nxt.replace(num_experts_per_tok=0)
    with pytest.raises(ValueError, match="field 'model_type' must be one of 'qwen3_5_text', 'qwen3_5_moe_text', "
                                         "'qwen3_next', got 'qwen3_5'"):
        nxt.replace(model_type="qwen3_5")
    with pytest.raises(ValueError, match="model_type 'qwen3_5_text' has no field 'num_experts': it must be 0, got 5"):
        nxt.replace(model_type="qwen3_5_text")
    with pytest.raises(ValueError, match="model_type 'qwen3_5_moe_text' has no field 'intermediate_size': it must "
                                         "be 0, got 80"):
        nxt.replace(model_type="qwen3_5_moe_text")
    with pytest.raises(ValueError, match="model_type 'qwen3_5_moe_text' has no field 'norm_topk_prob'"):
        moe_config("qwen3_5_moe_text", norm_topk_prob=False)
    with pytest.raises(ValueError, match="model_type 'qwen3_5_moe_text' has no field 'mlp_only_layers'"):
        moe_config("qwen3_5_moe_text", mlp_only_layers=(1,))
    with pytest.raises(ValueError, match="holds a text_config of model_type 'qwen3_next'; expected "
                                         "'qwen3_5_moe_text'"):
        ModelConfig.from_hf({"model_type": "qwen3_5_moe", "text_config": nxt.to_hf()})


def test_moe_weights_lie_as_the_op_reads_them():
    """The shared expert's gate / up and the router sit back to back (ops.moe's one dense GEMM reads
    them through kernels.stacked without a copy), also after .to()."""
    from metrale_graph.ops import kernels

    model = HybridModel.from_preset(moe_config(), seed=0)
    for convert in (lambda: None, lambda: model.to(torch.bfloat16)):
        convert()
        mlp = model.layers[1].mlp
        parts = (mlp.shared_expert.gate_proj.weight, mlp.shared_expert.up_proj.weight, mlp.gate.weight)
        assert kernels.stacked(*parts).data_ptr() == parts[0].data_ptr()

"""The whole prefill against transformers' Qwen3.5 (fp32, CPU), through real checkpoints."""

import json
import os

import pytest
import torch

from helpers import moe_config, tiny_config
from metrics import rel_err
from references import check_parity, hf_class, hf_logits, hf_reference, random_streams, randomize_reference
from metrale_graph import HybridModel, Stream

CONFIGS = [
    pytest.param(dict(), id="grouped-r2-dk16-dv24"),
    pytest.param(dict(linear_num_key_heads=3, linear_num_value_heads=3, linear_value_head_dim=16), id="r1-dk=dv"),
    pytest.param(dict(linear_num_key_heads=1, linear_num_value_heads=4, linear_key_head_dim=8,
                      linear_value_head_dim=20, partial_rotary_factor=0.25, head_dim=32), id="r4-dk8-dv20-rot8"),
    pytest.param(dict(num_hidden_layers=5, tie_word_embeddings=True,
                      layer_types=("full_attention", "linear_attention", "linear_attention",
                                   "full_attention", "linear_attention")), id="tied-custom-layer-types"),
]


@pytest.mark.parametrize("overrides", CONFIGS)
def test_logits_match_transformers(tmp_path, overrides):
    cfg = tiny_config(**overrides)
    hf = hf_reference(cfg)
    hf.save_pretrained(tmp_path)
    model = HybridModel.from_pretrained(str(tmp_path), progress=False)
    assert model.config == cfg
    check_parity(model, hf, cfg)


@pytest.mark.parametrize("cfg", [
    pytest.param(tiny_config(), id="qwen3_5"),
    pytest.param(moe_config("qwen3_5_moe_text"), id="qwen3_5_moe"),
    pytest.param(moe_config("qwen3_next", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,)),
                 id="qwen3_next-dense-layers-mixed-in")])
def test_continuation_matches_transformers(tmp_path, cfg):
    """A stream prefilled in two calls gives the logits transformers gives for the whole stream."""
    hf = hf_reference(cfg)
    hf.save_pretrained(tmp_path)
    model = HybridModel.from_pretrained(str(tmp_path), progress=False)
    cache = model.new_cache(4, 32, block_size=16)
    (tokens,) = random_streams(cfg.vocab_size, [90])
    model.prefill(cache, [Stream(2, tokens[:37])])
    out = model.prefill(cache, [Stream(2, tokens[37:])])
    assert rel_err(out[0], hf_logits(hf, tokens)[-1]) <= 1e-4


def test_multimodal_sharded_checkpoint(tmp_path):
    """A qwen3_5 (multimodal) checkpoint, sharded: text weights under model.language_model., the
    vision tower skipped, tie_word_embeddings read from the top level."""
    cfg = tiny_config()
    hf = hf_reference(cfg, multimodal=True)
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 3
    assert any(k.startswith("model.visual.") for k in weight_map)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5"
    model = HybridModel.from_pretrained(str(tmp_path), progress=False)
    assert model.config == cfg
    check_parity(model, hf, cfg, lengths=[1, 65, 130])


def test_our_checkpoint_round_trips_through_transformers(tmp_path):
    """save_pretrained writes a checkpoint that transformers loads and agrees with."""
    import transformers

    model = HybridModel.from_preset("tiny")
    model.save_pretrained(str(tmp_path))
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    check_parity(model, hf, model.config, lengths=[3, 70])


@pytest.mark.parametrize("top, text", [(True, False), (False, True)], ids=["tied-at-top", "untied-at-top"])
def test_multimodal_ties_by_top_level_flag(tmp_path, top, text):
    """A multimodal model ties lm_head to the embeddings by its top-level tie_word_embeddings, whatever
    its text_config says (transformers writes the text config's default, false, under a tied wrapper):
    reading the text_config's flag lost lm_head (tied-at-top) or ignored the stored one (untied-at-top)."""
    import transformers

    cfg = tiny_config(tie_word_embeddings=top)
    text_cfg = {**cfg.to_hf(), "tie_word_embeddings": text}
    mm = transformers.Qwen3_5Config(text_config=text_cfg, tie_word_embeddings=top, vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=cfg.hidden_size))
    torch.manual_seed(0)
    hf = randomize_reference(transformers.Qwen3_5ForConditionalGeneration(mm), 0)
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["text_config"]["tie_word_embeddings"] == text
    model = HybridModel.from_pretrained(str(tmp_path), progress=False)
    assert model.config == cfg
    check_parity(model, hf, cfg, lengths=[5, 70])


@pytest.mark.parametrize("same", [True, False], ids=["lm_head-equal", "lm_head-differs"])
def test_tied_config_with_a_stored_lm_head(tmp_path, same):
    """A config that ties lm_head to the embeddings over a checkpoint that stores lm_head.weight: transformers
    ties them when the two are equal, and otherwise does NOT tie (it warns and runs the stored lm_head).
    We ignored the stored lm_head, so a differing one gave other logits than transformers, silently; now
    an equal one loads tied and a differing one raises ValueError naming tie_word_embeddings."""
    import transformers

    cfg = tiny_config()
    hf = hf_reference(cfg)
    if same:
        with torch.no_grad():
            hf.lm_head.weight.copy_(hf.model.embed_tokens.weight)
    hf.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "tie_word_embeddings": True}))
    oracle = transformers.Qwen3_5ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert torch.equal(oracle.lm_head.weight, hf.lm_head.weight)  # transformers runs the stored lm_head
    if not same:
        with pytest.raises(ValueError, match="tie_word_embeddings.*lm_head.weight"):
            HybridModel.from_pretrained(str(tmp_path), progress=False)
        return
    model = HybridModel.from_pretrained(str(tmp_path), progress=False)
    assert model.config == cfg.replace(tie_word_embeddings=True)
    check_parity(model, oracle, model.config, lengths=[5, 70])


@pytest.mark.parametrize("cfg", [pytest.param(tiny_config(), id="qwen3_5"),
                                 pytest.param(moe_config("qwen3_next"), id="qwen3_next")])
def test_swish_is_silu(tmp_path, cfg):
    """hidden_act 'swish' is SiLU in transformers (ACT2FN['swish'] is nn.SiLU, for the MLPs, the experts and
    the GDN conv alike): such a config loads and matches; it was refused as an unsupported activation."""
    hf = hf_reference(cfg)
    hf.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "hidden_act": "swish"}))
    oracle = hf_class(cfg).from_pretrained(str(tmp_path), dtype=torch.float32,
                                           **({"experts_implementation": "eager"} if cfg.num_experts else {})).eval()
    assert oracle.config.hidden_act == "swish"
    model = HybridModel.from_pretrained(str(tmp_path), progress=False)
    assert model.config == cfg
    check_parity(model, oracle, cfg, lengths=[5, 70])

"""RoPE variants against transformers (metrale_graph/rope.py): each rope type's inverse frequencies and cos / sin
scale against transformers' rotary embedding of the same config (odd rotary dims and rotary dim 0 among them),
and the model's logits through checkpoints transformers wrote with scaled or odd-dimensioned RoPE."""

import pytest
import torch

from helpers import moe_config, tiny_config
from references import check_parity, hf_reference
from metrale_graph import HybridModel
from metrale_graph.config import ModelConfig
from metrale_graph.rope import RopeScaling, rope_frequencies

VARIANTS = [
    pytest.param(dict(), id="default"),
    # int(20 * 0.25) = 5: three frequencies over 6 channels, as transformers rotates an odd dim
    pytest.param(dict(head_dim=20, partial_rotary_factor=0.25), id="odd-dim5"),
    pytest.param(dict(partial_rotary_factor=0.05), id="dim0"),  # int(16 * 0.05) = 0: no channel rotates
    pytest.param(dict(rope_scaling=RopeScaling("linear", factor=2.0)), id="linear"),
    pytest.param(dict(rope_scaling=RopeScaling("dynamic", factor=2.0)), id="dynamic"),
    pytest.param(dict(rope_scaling=RopeScaling("yarn", factor=4.0, original_max_position_embeddings=256)), id="yarn"),
    pytest.param(dict(head_dim=32, partial_rotary_factor=1.0, rope_scaling=RopeScaling(
        "yarn", factor=4.0, original_max_position_embeddings=256, mscale=0.8, mscale_all_dim=1.0, beta_fast=8,
        beta_slow=2, truncate=False)), id="yarn-mscale-betas-untruncated"),
    pytest.param(dict(head_dim=32, partial_rotary_factor=1.0, rope_scaling=RopeScaling(
        "llama3", factor=8.0, original_max_position_embeddings=64, low_freq_factor=1.0, high_freq_factor=4.0)),
        id="llama3"),
    pytest.param(dict(head_dim=32, partial_rotary_factor=0.25, rope_scaling=RopeScaling("proportional", factor=2.0)),
                 id="proportional"),
]


@pytest.mark.parametrize("overrides", VARIANTS)
def test_frequencies_match_transformers(overrides):
    """Our frequencies and scale are those of transformers' rotary embedding built from to_hf(), which from_hf
    reads back to the same config."""
    import transformers

    cfg = tiny_config(num_hidden_layers=1, layer_types=("full_attention",), **overrides)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    hf_cfg = getattr(transformers, cfg.family.config_class)(**cfg.to_hf())
    rotary = getattr(transformers, cfg.family.causal_lm_class)(hf_cfg).model.rotary_emb
    inv_freq, scale = rope_frequencies(cfg)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == rotary.inv_freq.shape
    torch.testing.assert_close(inv_freq, rotary.inv_freq, rtol=1e-6, atol=0)
    assert scale == pytest.approx(rotary.attention_scaling, rel=1e-12)


@pytest.mark.parametrize("cfg", [
    pytest.param(tiny_config(rope_scaling=RopeScaling("yarn", factor=4.0, original_max_position_embeddings=32)),
                 id="qwen3_5-yarn"),
    pytest.param(moe_config("qwen3_next", head_dim=20, partial_rotary_factor=0.25,
                            rope_scaling=RopeScaling("linear", factor=3.0)), id="qwen3_next-odd-dim5-linear"),
    pytest.param(moe_config("qwen3_5_moe_text", partial_rotary_factor=0.05), id="qwen3_5_moe-dim0"),
])
def test_logits_match_transformers(tmp_path, cfg):
    """Checkpoints of RoPE configs that were refused (a scaled rope_type, an odd or zero rotary dim) load and give
    transformers' logits."""
    hf = hf_reference(cfg)
    hf.save_pretrained(tmp_path)
    model = HybridModel.from_pretrained(str(tmp_path), progress=False)
    assert model.config == cfg
    check_parity(model, hf, cfg, lengths=[1, 65, 130])

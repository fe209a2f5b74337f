"""The whole prefill against transformers' Qwen3.5 (fp32, CPU), through real checkpoints."""

import json
import os

import pytest
import torch

from helpers import hf_logits, hf_reference, rel_err, tiny_config
from metrale_graph import HybridModel, Stream

LENGTHS = [1, 63, 64, 65, 130]

CONFIGS = [
    pytest.param(dict(), id="grouped-r2-dk16-dv24"),
    pytest.param(dict(linear_num_key_heads=3, linear_num_value_heads=3, linear_value_head_dim=16), id="r1-dk=dv"),
    pytest.param(dict(linear_num_key_heads=1, linear_num_value_heads=4, linear_key_head_dim=8,
                      linear_value_head_dim=20, partial_rotary_factor=0.25, head_dim=32), id="r4-dk8-dv20-rot8"),
    pytest.param(dict(num_hidden_layers=5, tie_word_embeddings=True,
                      layer_types=("full_attention", "linear_attention", "linear_attention",
                                   "full_attention", "linear_attention")), id="tied-custom-layer-types"),
]


def _random_streams(vocab, lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _check_parity(model, hf, cfg, lengths=LENGTHS, tol=1e-4):
    cache = model.new_cache(num_slots=len(lengths) + 2, num_blocks=64, block_size=16)
    streams = _random_streams(cfg.vocab_size, lengths)
    slots = [len(lengths) + 1 - i for i in range(len(lengths))]  # not 0..B-1, to catch slot mix-ups
    out = model.prefill(cache, [Stream(s, t) for s, t in zip(slots, streams)])
    assert out.shape == (len(lengths), cfg.vocab_size)
    for i, tokens in enumerate(streams):
        err = rel_err(out[i], hf_logits(hf, tokens)[-1])
        assert err <= tol, f"stream {i} (length {lengths[i]}): relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("overrides", CONFIGS)
def test_logits_match_transformers(tmp_path, overrides):
    cfg = tiny_config(**overrides)
    hf = hf_reference(cfg)
    hf.save_pretrained(tmp_path)
    model = HybridModel.from_pretrained(str(tmp_path), progress=False)
    assert model.config == cfg
    _check_parity(model, hf, cfg)


def test_continuation_matches_transformers(tmp_path):
    """A stream prefilled in two calls gives the logits transformers gives for the whole stream."""
    cfg = tiny_config()
    hf = hf_reference(cfg)
    hf.save_pretrained(tmp_path)
    model = HybridModel.from_pretrained(str(tmp_path), progress=False)
    cache = model.new_cache(4, 32, block_size=16)
    (tokens,) = _random_streams(cfg.vocab_size, [90])
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
    _check_parity(model, hf, cfg, lengths=[1, 65, 130])


def test_our_checkpoint_round_trips_through_transformers(tmp_path):
    """save_pretrained writes a checkpoint that transformers loads and agrees with."""
    import transformers

    model = HybridModel.from_preset("tiny")
    model.save_pretrained(str(tmp_path))
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    _check_parity(model, hf, model.config, lengths=[3, 70])

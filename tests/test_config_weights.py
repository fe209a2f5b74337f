"""Config parsing and checkpoint loading errors."""

import io
import json
import re
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from metrale_graph import PRESETS, HybridModel, ModelConfig, load_config
from metrale_graph.families import COMMON_DEFAULTS, FAMILIES, OPTIONAL_FIELDS
from metrale_graph.spec import weight_shapes


def test_presets():
    tiny, big = PRESETS["tiny"], PRESETS["qwen3.5-9b"]
    assert tiny.linear_num_value_heads % tiny.linear_num_key_heads == 0
    assert tiny.linear_key_head_dim != tiny.linear_value_head_dim
    assert (big.hidden_size, big.num_hidden_layers, len(big.linear_layers), len(big.full_layers)) == (4096, 32, 24, 8)
    n_params = sum(torch.Size(s).numel() for s in weight_shapes(big).values())
    assert 8.5e9 < n_params < 10e9
    # 27B: 48 GDN + 16 attention layers, and 55.56 GB of bf16 in the hub's checkpoint with its vision
    # tower (~0.46B) and MTP layer (~0.85B) that a text model leaves out
    mid = PRESETS["qwen3.5-27b"]
    assert (len(mid.linear_layers), len(mid.full_layers)) == (48, 16)
    n_params = sum(torch.Size(s).numel() for s in weight_shapes(mid).values())
    assert 26e9 < n_params < 27.5e9, n_params
    assert ModelConfig.from_hf(mid.to_hf()) == mid


def test_from_hf_matches_transformers_defaults():
    import transformers

    hf = transformers.Qwen3_5TextConfig(num_hidden_layers=8).to_dict()
    cfg = ModelConfig.from_hf(hf)
    assert cfg.layer_types == tuple(hf["layer_types"])
    assert cfg.rotary_dim == 64 and cfg.head_dim == 256 and cfg.conv_dim == 2 * 16 * 128 + 32 * 128
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize("family", list(FAMILIES.values()), ids=list(FAMILIES))
def test_family_records_match_transformers(family):
    """A family's record names transformers' classes of it and holds its defaults; a field it lacks keeps
    ModelConfig's default."""
    import dataclasses

    import transformers

    config_cls = getattr(transformers, family.config_class)
    assert getattr(transformers, family.causal_lm_class).config_class is config_cls
    hf = config_cls().to_dict()
    assert hf["model_type"] == family.model_type
    for name in [*COMMON_DEFAULTS, *family.defaults]:
        value = hf["rope_parameters"][name] if name in ("rope_theta", "partial_rotary_factor") else hf.get(name)
        assert value == family.default(name) or (name == "full_attention_interval" and value is None), name
    for wrapper in family.multimodal:
        mm_cls = getattr(transformers, wrapper.config_class)
        assert mm_cls().to_dict()["model_type"] == wrapper.model_type
        assert getattr(transformers, wrapper.model_class).config_class is mm_cls
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.default is not dataclasses.MISSING}
    assert {n: defaults[n] for n in OPTIONAL_FIELDS if n in defaults} == {n: a for n, a in OPTIONAL_FIELDS.items()
                                                                          if n in defaults}
    assert ModelConfig.from_hf(hf).family is family


def test_quantized_multimodal_config():
    """The quantization_config of a multimodal checkpoint sits at the top level or in text_config; FP8 is
    read either way (its patterns against the wrapper's module names), any other method refused."""
    text = PRESETS["tiny"].to_hf()
    fp8 = {"quant_method": "fp8", "modules_to_not_convert": ["model.language_model.layers.0.linear_attn.in_proj_a"]}
    for top, inner in (({"quantization_config": fp8}, {}), ({}, {"quantization_config": fp8})):
        cfg = ModelConfig.from_hf({"model_type": "qwen3_5", "text_config": {**text, **inner}, **top})
        assert cfg.quantization.prefix == "model.language_model."
        assert not cfg.quantization.converts("layers.0.linear_attn.in_proj_a")
        assert cfg.quantization.converts("layers.1.linear_attn.in_proj_a")
    for top, inner in (({"quantization_config": {"quant_method": "awq"}}, {}),
                       ({}, {"quantization_config": {"quant_method": "awq"}})):
        with pytest.raises(ValueError, match="quantized checkpoint"):
            ModelConfig.from_hf({"model_type": "qwen3_5", "text_config": {**text, **inner}, **top})
    with pytest.raises(ValueError, match="different quantization_config"):
        ModelConfig.from_hf({"model_type": "qwen3_5", "quantization_config": fp8,
                             "text_config": {**text, "quantization_config": {"quant_method": "fp8"}}})


def test_multimodal_config_and_legacy_names():
    text = PRESETS["tiny"].to_hf()
    text.pop("tie_word_embeddings")
    text["layer_types"] = ["mamba", "mamba", "mamba", "attention"]
    cfg = ModelConfig.from_hf({"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": text})
    assert cfg.tie_word_embeddings and cfg.layer_types == PRESETS["tiny"].layer_types


@pytest.mark.parametrize("wrapper, family", [("qwen3_5", "qwen3_5_text"), ("qwen3_5_moe", "qwen3_5_moe_text")])
def test_text_config_named_as_its_wrapper_reads_as_the_wrappers_text_family(wrapper, family):
    """A text_config whose model_type is the wrapper's own (as early checkpoints wrote their sub-configs; transformers
    builds the wrapper's text config from it whatever it names) was 'unsupported model_type 'qwen3_5': metrale-graph
    runs ... 'qwen3_5''. Another name is refused, saying what the wrapper expects."""
    text = (PRESETS["tiny"] if family == "qwen3_5_text" else PRESETS["qwen3.5-35b-a3b"]).to_hf()
    cfg = ModelConfig.from_hf({"model_type": wrapper, "text_config": {**text, "model_type": wrapper}})
    assert cfg == ModelConfig.from_hf({"model_type": wrapper, "text_config": text}) and cfg.model_type == family
    for other in ("llama", ""):
        with pytest.raises(ValueError, match=f"model_type '{wrapper}' config holds a text_config of model_type "
                                             f"'{other}'; expected '{family}'"):
            ModelConfig.from_hf({"model_type": wrapper, "text_config": {**text, "model_type": other}})


@pytest.mark.parametrize("patch, message", [
    ({"model_type": "qwen3_moe"}, "unsupported model_type 'qwen3_moe'"),  # qwen3_next now runs: test_moe_parity.py
    ({"model_type": "llama"}, "unsupported model_type 'llama'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 2, "long_factor": [2.0] * 2}},
     "unsupported rope_type 'longrope' in 'rope_parameters'.*longrope's frequencies switch"),
    ({"rope_scaling": {"type": "linear"}}, "'rope_scaling' of rope_type 'linear' has no 'factor'"),
    ({"rope_parameters": {"rope_type": "su"}}, "unsupported rope_type 'su' in 'rope_parameters'"),
    # where transformers' computation fails (a shape mismatch, a division by zero, a KeyError), the field is named
    ({"head_dim": 20, "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "partial_rotary_factor": 0.25}},
     "rope_type 'yarn' needs an even rotary dim"),
    ({"head_dim": 8, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "partial_rotary_factor": 0.25}},
     "rope_type 'dynamic' with rotary dim 2"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}},
     "'rope_parameters' of rope_type 'llama3' has no 'low_freq_factor'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 0}}, "rope_parameters' factor must be a positive number"),
    # values the section's checks let through that failed only when the model was built, after its weights were read
    # (a TypeError, a ZeroDivisionError, a 'math domain error', an OverflowError)
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": None, "high_freq_factor": 4.0}},
     "rope_parameters' low_freq_factor must be a positive number for rope_type 'llama3', got None"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": None}},
     "rope_parameters' high_freq_factor must be a positive number for rope_type 'llama3', got None"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1}},
     "rope_type 'yarn' needs a rope_theta other than 1"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "beta_fast": -1}},
     "rope_parameters' beta_fast must not be negative for rope_type 'yarn' .*, got -1"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "beta_slow": -0.5}},
     "rope_parameters' beta_slow must not be negative for rope_type 'yarn' .*, got -0.5"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 10 ** 400}},
     "rope_parameters' factor must be a positive number for rope_type 'linear', got 1000"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 10 ** 400}},
     "rope_parameters' original_max_position_embeddings must be a positive integer for rope_type 'yarn', got 1000"),
    ({"linear_num_value_heads": 3}, "not a multiple of linear_num_key_heads"),
    ({"layer_types": ["linear_attention"] * 3}, "3 entries for 4 layers"),
    ({"layer_types": ["linear_attention"] * 3 + ["sliding"]}, "'sliding'"),
    # quantization: FP8 other than Qwen's fine-grained format, or another method, by the field
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}},
     "quantized checkpoint \\(quantization_config with quant_method 'gptq'\\) is not supported"),
    ({"quantization_config": "gptq"}, "field 'quantization_config' must be an object"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "'quantization_config.fmt' is 'e5m2'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 128]}},
     "'quantization_config.weight_block_size' is \\[64, 128\\]: only \\[128, 128\\] blocks"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}},
     "'quantization_config.activation_scheme' is 'static' .*per-tensor input scales"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "lazy"}},
     "'quantization_config.activation_scheme' must be 'dynamic'"),
    ({"quantization_config": {"quant_method": "fp8", "modules_to_not_convert": "lm_head"}},
     "'quantization_config.modules_to_not_convert' must be a list of module names"),
    ({"quantization_config": {"quant_method": "fp8", "modules_to_not_convert": ["lm_head", 3]}},
     "'quantization_config.modules_to_not_convert' must be a list of module names"),
    ({"quantization_config": {"quant_method": "fp8", "modules_to_not_convert": ["lm_head("]}},
     "'quantization_config.modules_to_not_convert' holds 'lm_head\\(', not a regular expression"),
    ({"quantization_config": {"quant_method": "fp8", "scale_fmt": "ue8m0"}}, "'quantization_config.scale_fmt'"),
    ({"quantization_config": {"quant_method": "fp8", "modules_to_convert": ["embed_tokens"]}},
     "FP8 embeddings are not supported"),
])
def test_bad_config(patch, message):
    cfg = {**PRESETS["tiny"].to_hf(), **patch}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(cfg)
    with pytest.raises(ValueError, match="neither a preset"):
        load_config("/nonexistent/folder")


@pytest.fixture
def checkpoint(tmp_path):
    HybridModel.from_preset("tiny").save_pretrained(str(tmp_path))
    return tmp_path


def _rewrite(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_missing_tensor(checkpoint):
    _rewrite(checkpoint, lambda t: t.pop("model.layers.2.linear_attn.A_log"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*layers\.2\.linear_attn\.A_log"):
        HybridModel.from_pretrained(str(checkpoint), progress=False)


def test_unexpected_tensor(checkpoint):
    _rewrite(checkpoint, lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(ValueError, match=r"unexpected tensor.*layers\.0\.self_attn\.q_proj"):
        HybridModel.from_pretrained(str(checkpoint), progress=False)


def test_misshaped_tensor(checkpoint):
    _rewrite(checkpoint, lambda t: t.update({"model.norm.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(3,\), the config needs \(64,\)") as e:
        HybridModel.from_pretrained(str(checkpoint), progress=False)
    assert "does not set" not in str(e.value)  # config.json sets every size (test_a_size_missing_from_config_json_is_named)


@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "multimodal"])
@pytest.mark.parametrize("fields, message", [
    (["vocab_size"], r"'[\w.]+\.weight' has shape \(512, 64\), the config needs \(248320, 64\) .*; "
                     r"config\.json does not set vocab_size, so transformers' default for model_type 'qwen3_5_text' "
                     r"\(vocab_size 248320\) was taken"),
    (["num_hidden_layers"], r"layer_types has 4 entries for 32 layers; config\.json does not set num_hidden_layers, so "
                            r"transformers' default .*\(num_hidden_layers 32\) was taken"),
    (["num_hidden_layers", "layer_types"], r"lacks 371 tensor\(s\).*; config\.json does not set num_hidden_layers"),
    (["linear_num_key_heads", "head_dim"], r"linear_num_value_heads \(4\) is not a multiple of linear_num_key_heads "
                                           r"\(16\); config\.json does not set head_dim, linear_num_key_heads, so "
                                           r"transformers' defaults .*\(head_dim 256, linear_num_key_heads 16\) were "
                                           r"taken"),
], ids=["vocab_size", "num_hidden_layers", "num_hidden_layers-layer_types", "two"])
def test_a_size_missing_from_config_json_is_named(checkpoint, fields, message, multimodal):
    """A config.json lacking a field that sizes the weights (written by hand, cut down): the field takes transformers'
    default, as in transformers, and the error that follows names the field and the default taken. The errors named
    a tensor's shape, or sizes the file never gave ('4 entries for 32 layers'), leaving the missing field to guess."""
    config = json.loads((checkpoint / "config.json").read_text())
    for field in fields:
        config.pop(field)
    if multimodal:
        config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": config}
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        HybridModel.from_pretrained(str(checkpoint), progress=False)


def test_a_checkpoint_its_config_does_not_describe_is_named_before_the_memory_it_would_take(checkpoint, monkeypatch):
    """A config.json whose sizes (here a vocab_size left to transformers' 248320) ask for more memory than the machine
    has, over a checkpoint they do not describe: the error names the tensor that does not fit the config and the missing
    field, from the headers. The memory was checked first, so the error said the weights 'need 122.0 MiB of memory and
    this machine has ...': a model that cannot be, sized from a field the file never gave."""
    from metrale_graph import placement

    config = json.loads((checkpoint / "config.json").read_text())
    del config["vocab_size"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(placement, "available_memory", lambda: 2 ** 20)  # the tiny model's 1.3 MiB would not fit either
    with pytest.raises(ValueError, match=r"has shape \(512, 64\), the config needs \(248320, 64\) .*does not set "
                                         r"vocab_size"):
        HybridModel.from_pretrained(str(checkpoint), progress=False)


def test_load_dtype_and_errors(checkpoint, tmp_path_factory):
    model = HybridModel.from_pretrained(str(checkpoint), dtype=torch.bfloat16, progress=False)
    assert model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype torch.int8"):
        HybridModel.from_pretrained(str(checkpoint), dtype=torch.int8)
    empty = tmp_path_factory.mktemp("empty")
    (empty / "config.json").write_text(json.dumps(PRESETS["tiny"].to_hf()))
    with pytest.raises(ValueError, match="no model.safetensors"):
        HybridModel.from_pretrained(str(empty))
    with pytest.raises(ValueError, match="does not exist"):
        HybridModel.from_pretrained(str(empty / "nope"))
    with pytest.raises(ValueError, match="unknown preset"):
        HybridModel.from_preset("huge")


def _write_config(folder, text):
    (folder / "config.json").write_text(text if isinstance(text, str) else json.dumps(text))
    return str(folder / "config.json")


@pytest.mark.parametrize("patch, message", [
    ({"num_attention_heads": 0, "head_dim": None}, "field 'num_attention_heads' must be an integer >= 1, got 0"),
    ({"vocab_size": 4.5}, "field 'vocab_size' must be an integer >= 1, got 4.5"),
    ({"vocab_size": "512"}, "field 'vocab_size' must be an integer >= 1, got '512'"),
    ({"hidden_size": True}, "field 'hidden_size' must be an integer >= 1, got True"),
    ({"intermediate_size": None}, "field 'intermediate_size' must be an integer >= 1, got None"),
    ({"max_position_embeddings": 0}, "field 'max_position_embeddings' must be an integer >= 1, got 0"),
    ({"linear_conv_kernel_dim": 1}, "field 'linear_conv_kernel_dim' must be an integer >= 2, got 1"),
    ({"layer_types": None, "full_attention_interval": 0}, "field 'full_attention_interval' must be an integer >= 1"),
    ({"tie_word_embeddings": "false"}, "field 'tie_word_embeddings' must be true or false, got 'false'"),
    ({"tie_word_embeddings": 0}, "field 'tie_word_embeddings' must be true or false, got 0"),
    ({"rope_parameters": {"rope_theta": 0}}, "field 'rope_theta' must be a positive number, got 0"),
    ({"rope_parameters": {"rope_theta": "1e4"}}, "field 'rope_theta' must be a positive number, got '1e4'"),
    ({"rope_parameters": {"rope_theta": float("inf")}}, "field 'rope_theta' must be a positive number, got inf"),
    ({"rope_parameters": [10000.0]}, "field 'rope_parameters' must be an object"),
    ({"rms_norm_eps": -1e-6}, "field 'rms_norm_eps' must be a positive number, got -1e-06"),
    ({"rms_norm_eps": float("nan")}, "field 'rms_norm_eps' must be a positive number, got nan"),
    ({"rope_parameters": {"partial_rotary_factor": 1.5}},
     r"field 'partial_rotary_factor' must be a number in \(0, 1\]"),
    ({"head_dim": 15, "rope_parameters": {"partial_rotary_factor": 1.0}},
     "partial_rotary_factor 1.0 gives rotary dim 15 of head_dim 15: it rotates 16 channels"),
    ({"layer_types": "linear_attention"}, "field 'layer_types' must be a list of strings"),
    ({"layer_types": [0, 0, 0, 1]}, "field 'layer_types' must be a list of strings"),
    ({"attention_bias": "false"}, "unsupported attention_bias 'false'"),
    ({"model_type": ["qwen3_5_text"]}, "unsupported model_type"),
])
def test_bad_config_field(tmp_path, patch, message):
    path = _write_config(tmp_path, {**PRESETS["tiny"].to_hf(), **patch})
    with pytest.raises(ValueError, match=re.escape(f"invalid model config {path}: ") + message):
        load_config(str(tmp_path))


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"model_type": "qwen3_5_text",', "cannot read model config .*config.json: Expecting"),
    ("", "cannot read model config .*config.json: Expecting value: line 1 column 1"),
    ("[" * 100_000 + "]" * 100_000, "cannot read model config .*config.json: maximum recursion depth"),
])
def test_unreadable_config_file(tmp_path, text, message):
    _write_config(tmp_path, text)
    with pytest.raises(ValueError, match=message):
        load_config(str(tmp_path))
    with pytest.raises(ValueError, match=message):  # the checkpoint path reads it too, before any tensor
        HybridModel.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("preset, patch, message", [
    ("qwen3.5-35b-a3b", {"shared_expert_intermediate_size": 0},
     "field 'shared_expert_intermediate_size' must be an integer >= 1, got 0: a MoE block without a shared expert"),
    ("qwen3-next-80b-a3b", {"shared_expert_intermediate_size": 0}, "without a shared expert .* is not supported"),
    ("qwen3-next-80b-a3b", {"moe_intermediate_size": 0}, "got 0: experts of width 0 .* are not supported"),
    ("tiny", {"linear_conv_kernel_dim": 1}, "got 1: a Gated DeltaNet conv of kernel 1 .* is not supported"),
    ("tiny", {"intermediate_size": 0}, "got 0: a dense MLP of width 0 .* is not supported"),
    ("qwen3-next-80b-a3b", {"intermediate_size": 0, "mlp_only_layers": [3]}, "got 0: a dense MLP of width 0"),
])
def test_degenerate_sizes_transformers_runs_are_refused_as_unsupported(preset, patch, message):
    """Sizes transformers builds a model of (a zero-width shared expert, experts or dense MLP, adding nothing; a conv
    over the current token alone) were refused as out of range alone ('must be an integer >= 1, got 0'), as if the
    config were malformed: the error says the model they describe is not supported, and what it is."""
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**PRESETS[preset].to_hf(), **patch})


def test_config_fields_checked_in_python():
    tiny = PRESETS["tiny"]
    with pytest.raises(ValueError, match="invalid model config: field 'rope_theta' must be a positive number, got 0"):
        tiny.replace(rope_theta=0)
    with pytest.raises(ValueError, match="field 'num_hidden_layers' must be an integer >= 1, got 0"):
        tiny.replace(num_hidden_layers=0)
    # JSON has one number type: integral floats are ints, ints are floats where a float is meant
    cfg = tiny.replace(hidden_size=64.0, rope_theta=10000, layer_types=list(tiny.layer_types))
    assert cfg == tiny and type(cfg.hidden_size) is int and type(cfg.rope_theta) is float
    assert isinstance(cfg.layer_types, tuple) and hash(cfg) == hash(tiny)
    assert ModelConfig.from_hf({**tiny.to_hf(), "vocab_size": 512.0, "rope_parameters": {"rope_theta": 10000}}) == tiny


# complex64 (its imaginary part was dropped), float4 (a NotImplementedError traceback) and the float8
# scale format e8m0 were converted to the model dtype like weights
@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool, torch.uint8, torch.complex64,
                                   torch.float4_e2m1fn_x2, torch.float8_e8m0fnu])
def test_non_float_tensor(checkpoint, dtype):
    if dtype == torch.float4_e2m1fn_x2:  # two values a byte: safetensors counts 4 values in 2 bytes
        ones = torch.ones(2, dtype=torch.uint8).view(dtype)
    else:
        ones = torch.ones(4, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else torch.ones(4, dtype=dtype)
    _rewrite(checkpoint, lambda t: t.update({"model.layers.0.linear_attn.A_log": ones}))
    with pytest.raises(ValueError, match=rf"'model\.layers\.0\.linear_attn\.A_log' in .*model\.safetensors is {dtype}; "
                                         "expected floating-point"):
        HybridModel.from_pretrained(str(checkpoint), progress=False)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_tensor(checkpoint, bad):
    def edit(t):
        t["model.layers.3.mlp.up_proj.weight"][5, 7] = bad
    _rewrite(checkpoint, edit)
    with pytest.raises(ValueError, match=r"'model\.layers\.3\.mlp\.up_proj\.weight' in .*model\.safetensors holds NaN "
                                         "or infinite values"):
        HybridModel.from_pretrained(str(checkpoint), progress=False)
    model = HybridModel.from_pretrained(str(checkpoint), progress=False, check_finite=False)
    assert not torch.isfinite(model.layers[3].mlp.up_proj.weight).all()


def test_float8_tensor_loads(checkpoint):
    """float8 e4m3 / e5m2 weights are floating point: converted to the model dtype."""
    _rewrite(checkpoint, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.float8_e4m3fn)}))
    stored = load_file(checkpoint / "model.safetensors")["model.norm.weight"]
    model = HybridModel.from_pretrained(str(checkpoint), progress=False)
    assert torch.equal(model.norm.weight, stored.float())


def test_tensor_beyond_target_dtype(checkpoint):
    _rewrite(checkpoint, lambda t: t["model.norm.weight"].fill_(1e5))
    HybridModel.from_pretrained(str(checkpoint), dtype=torch.bfloat16, progress=False)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' in .* holds values beyond the range of torch.float16"):
        HybridModel.from_pretrained(str(checkpoint), dtype=torch.float16, progress=False)


@pytest.mark.parametrize("cut", ["half", "header", "empty"])
def test_corrupt_safetensors(checkpoint, cut):
    path = checkpoint / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"half": data[: len(data) // 2], "header": b"not a safetensors file", "empty": b""}[cut])
    with pytest.raises(ValueError, match="cannot read safetensors file " + re.escape(str(path))):
        HybridModel.from_pretrained(str(checkpoint), progress=False)


@pytest.mark.parametrize("kind, named", [
    ("zip", "a zip archive \\(torch.save's format, or numpy's .npz\\)"),
    ("pickle", "a Python pickle \\(torch.save's legacy format\\)"),
    ("gguf", "a GGUF file \\(llama.cpp's format\\)"),
])
@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_weights_of_another_format_under_the_safetensors_name_are_named(checkpoint, kind, named, dtype):
    """A model.safetensors that holds another format (torch.save(state_dict, 'model.safetensors'), an .npz or a GGUF
    file renamed) was 'cannot read safetensors file ...: Error while deserializing header: header too large', which
    does not say what the file is; the error now names the format its first bytes show, and what to write instead."""
    path = checkpoint / "model.safetensors"
    tensors = {k: v.clone() for k, v in load_file(path).items()}
    path.unlink()
    if kind == "gguf":
        path.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(64))
    else:
        torch.save(tensors, path, _use_new_zipfile_serialization=kind == "zip")
    with pytest.raises(ValueError, match=f"cannot read safetensors file {re.escape(str(path))}: .*; it is {named}, not "
                                         "safetensors: .*save_pretrained"):
        HybridModel.from_pretrained(str(checkpoint), progress=False, dtype=dtype)


def test_corrupt_safetensors_with_auto_dtype_and_no_mtp(checkpoint):
    """dtype="auto" over a config.json naming no dtype reads the embeddings' stored dtype from the files; with
    mtp=False no header was read before that (the MTP count is not asked), and a cut file raised safetensors'
    SafetensorError, not the ValueError naming the file that every other load of it gives."""
    config = json.loads((checkpoint / "config.json").read_text())
    config.pop("dtype")
    (checkpoint / "config.json").write_text(json.dumps(config))
    path = checkpoint / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ValueError, match="cannot read safetensors file " + re.escape(str(path))):
        HybridModel.from_pretrained(str(checkpoint), progress=False, dtype="auto", mtp=False)


@pytest.mark.parametrize("text, message", [
    ('{"weight_map": ', "cannot read checkpoint index .*index.json: Expecting value"),
    ("[" * 100_000 + "]" * 100_000, "cannot read checkpoint index .*index.json: maximum recursion depth"),
    ("[]", "index.json has no weight_map"),
    ('{"weight_map": {"model.norm.weight": 3}}', "index.json has no weight_map"),
    ('{"weight_map": {"model.norm.weight": "shard-2.safetensors"}}', r"names shards that are not in .*shard-2"),
    ('{"weight_map": {"model.norm.weight": "../shard-1.safetensors"}}', r"names shards outside .*\.\./shard-1"),
    ('{"weight_map": {"model.norm.weight": "/etc/hostname"}}', r"names shards outside .*/etc/hostname"),
])
def test_bad_index(checkpoint, text, message):
    """A sharded checkpoint (no model.safetensors: with one, the index is not read) whose index is bad; a shard
    named outside the folder (a parent's file, an absolute path) is refused before anything is read."""
    (checkpoint / "model.safetensors").rename(checkpoint / "shard-1.safetensors")
    (checkpoint / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        HybridModel.from_pretrained(str(checkpoint), progress=False)


@pytest.mark.parametrize("key, listed", [("lm_head.weight", True), ("model.layers.2.linear_attn.A_log", True),
                                         ("lm_head.weight", False)])
def test_tensor_missing_from_its_shard_names_the_shard(checkpoint, key, listed):
    """A sharded checkpoint missing a tensor: where its index maps the tensor to a shard that does not hold it (a
    shard cut or replaced), the error names the shard and suggests nothing else; it said, for lm_head, to set
    tie_word_embeddings, which would run the embeddings as a head the checkpoint meant to store. Missing from the
    index too, lm_head alone is a tied checkpoint's absence: the error names tie_word_embeddings."""
    from helpers import write_sharded

    tensors = load_file(checkpoint / "model.safetensors")
    (checkpoint / "model.safetensors").unlink()
    write_sharded(str(checkpoint), tensors, 3)
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][key] if listed else index["weight_map"].pop(key)
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    held = load_file(checkpoint / shard)
    held.pop(key)
    save_file(held, checkpoint / shard)
    with pytest.raises(ValueError, match=r"lacks") as e:
        HybridModel.from_pretrained(str(checkpoint), progress=False)
    if listed:
        assert re.search(rf"index\.json maps 1 of them to shards that do not hold them: '{re.escape(key)}' to {shard} ",
                         str(e.value)), e.value
        assert "tie_word_embeddings" not in str(e.value)
    else:
        assert "sets tie_word_embeddings true" in str(e.value)


def test_checkpoint_path_is_a_file(checkpoint):
    path = str(checkpoint / "config.json")
    with pytest.raises(ValueError, match="is a file, not a checkpoint folder"):
        HybridModel.from_pretrained(path)


def test_missing_fields_take_transformers_defaults():
    """A config.json without head_dim gets transformers' 256, not hidden_size // heads."""
    import transformers

    hf = PRESETS["tiny"].to_hf()
    del hf["head_dim"]
    assert ModelConfig.from_hf(hf).head_dim == transformers.Qwen3_5TextConfig(**hf).head_dim == 256


def test_rope_scaling_read_as_transformers_reads_it():
    """Both rope_scaling and rope_parameters: transformers takes rope_scaling (rope_parameters was read,
    a silently different rope_theta); per-layer-type RoPE parameters (ignored before) are refused."""
    import transformers

    hf = {**PRESETS["tiny"].to_hf(), "rope_scaling": {"rope_type": "default", "rope_theta": 5e6,
                                                       "partial_rotary_factor": 0.5},
          "rope_parameters": {"rope_type": "default", "rope_theta": 3e6, "partial_rotary_factor": 0.25}}
    ref = transformers.Qwen3_5TextConfig(**hf).rope_parameters
    cfg = ModelConfig.from_hf(hf)
    got = (cfg.rope_theta, cfg.partial_rotary_factor)
    assert got == (ref["rope_theta"], ref["partial_rotary_factor"]) == (5e6, 0.5)
    hf = {**PRESETS["tiny"].to_hf(), "rope_scaling": [1.0]}
    with pytest.raises(ValueError, match="field 'rope_scaling' must be an object"):
        ModelConfig.from_hf(hf)
    hf = {**PRESETS["tiny"].to_hf(), "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e6}}}
    with pytest.raises(ValueError, match="field 'rope_parameters' holds per-layer-type entries"):
        ModelConfig.from_hf(hf)


def test_sharded_checkpoint_errors_name_the_files(checkpoint):
    """An unexpected tensor names the shard holding it; a tensor stored twice names both shards."""
    tensors = load_file(checkpoint / "model.safetensors")
    (checkpoint / "model.safetensors").unlink()
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    save_file({k: tensors[k] for k in first}, checkpoint / "a.safetensors")
    save_file({k: tensors[k] for k in second} | {"model.layers.0.bogus.weight": torch.zeros(2)},
              checkpoint / "b.safetensors")
    weight_map = {k: "a.safetensors" for k in first} | {k: "b.safetensors" for k in second}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=r"1 unexpected tensor\(s\), e\.g\. 'model\.layers\.0\.bogus\.weight' in "
                                         r".*b\.safetensors"):
        HybridModel.from_pretrained(str(checkpoint), progress=False)
    save_file({k: tensors[k] for k in second + [first[0]]}, checkpoint / "b.safetensors")
    with pytest.raises(ValueError, match=rf"tensor '{re.escape(first[0])}' appears twice in the checkpoint "
                                         r"\(.*b\.safetensors; .* in .*a\.safetensors\)"):
        HybridModel.from_pretrained(str(checkpoint), progress=False)


@pytest.mark.parametrize("call, message", [
    (lambda: HybridModel.from_pretrained(None), "path must be a checkpoint folder's path"),
    (lambda: HybridModel.from_preset(None), "preset must be a preset's name"),
    (lambda: HybridModel.from_preset("tiny", seed=1.5), "seed must be an integer"),
    (lambda: HybridModel.from_preset("tiny", device="meta"), "runs on 'cpu' or 'cuda'"),
], ids=["path-none", "preset-none", "float-seed", "meta-device"])
def test_bad_arguments_of_the_constructors_are_value_errors(call, message):
    """Each was a TypeError, AttributeError or RuntimeError from deep inside."""
    with pytest.raises(ValueError, match=message):
        call()


def test_restore_of_something_not_a_snapshot_is_a_value_error():
    cache = HybridModel.from_preset("tiny").new_cache(1, 4)
    for bad in (None, (1, 2)):
        with pytest.raises(ValueError, match="the snapshot is not of this cache"):
            cache.restore(bad)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("terminal", [False, True], ids=["log", "terminal"])
def test_loading_draws_its_progress_bar_on_a_terminal_only(checkpoint, monkeypatch, terminal):
    """from_pretrained's bar (progress=True, the default) goes to standard error when it is a terminal; in a
    log (here pytest's capture) none, as the README says: it landed inside pytest's dots and logs."""
    err = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    HybridModel.from_pretrained(checkpoint)
    assert ("loading weights" in err.getvalue()) == terminal

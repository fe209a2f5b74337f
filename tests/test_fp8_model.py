"""FP8 checkpoints end to end, on the CPU: tiny checkpoints of each family (hidden and intermediate
sizes that are not multiples of 128; Qwen3.5 in its multimodal wrapper, sharded) quantized by
tools.quantize and by an independent plain-torch script load; their logits against transformers (fp32)
on the dequantized weights, weight-only within metrics.fp32_model_bound and with FP8 activations within the reach of the
activation rounding; generation; the malformed checkpoints, each a ValueError naming the tensor before
anything is read; save_pretrained round trips, and transformers reads what it writes; the FP8 presets'
rule; one compile with zero graph breaks."""

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import moe_config, tiny_config
from metrics import fp32_model_bound, rel_err
from references import hf_class, hf_logits, hf_reference, random_streams
from metrale_graph import HybridModel, Stream
from metrale_graph.ops.fp8 import activation_rounding
from metrale_graph.quantization import QWEN_KEPT
from metrale_graph.quantized import dequantize_weights, fp8_config
from metrale_graph.tools import quantize
from metrale_graph.weights import hf_state_dict

FAMILIES = {
    # Qwen3.5 in its multimodal wrapper (a vision tower the quantizer keeps), ragged 200 / 136
    "qwen3_5": (tiny_config(hidden_size=200, intermediate_size=136), True),
    "qwen3_5_moe": (moe_config("qwen3_5_moe_text", hidden_size=136, moe_intermediate_size=72,
                               shared_expert_intermediate_size=40), False),
    # Qwen3-Next: the fused in_proj_qkvz split on 128-row blocks (key and value heads of 128), a dense layer
    "qwen3_next": (moe_config("qwen3_next", hidden_size=136, intermediate_size=144, linear_num_key_heads=1,
                              linear_num_value_heads=1, linear_key_head_dim=128, linear_value_head_dim=128,
                              moe_intermediate_size=72, shared_expert_intermediate_size=40, mlp_only_layers=(3,)),
                   False),
}
LENGTHS = [1, 37, 70]
# With activations rounded to FP8 too (per token per 128 channels before every FP8 GEMM) the logits move
# from transformers' (fp32, the same dequantized weights) as any rounding of the activations moves them,
# e4m3's 4 significant bits against bf16's 8 being 2^4 times coarser: bounded by 20 times the distance of
# transformers' own bf16 run from its fp32 on the same streams. Measured on these unit-gain random
# checkpoints: 4.8e-2 (one token) .. 0.43 (70 tokens: these models amplify any perturbation along a stream;
# transformers' bf16 is 1.9e-2 .. 0.99 from its fp32 there); each W8A8 GEMM alone is 3.7e-2 from its product.
ACTIVATION_REACH = 20


# The independent quantizer: plain torch, transformers' FP8 block rule (ops/fp8/quant.py's docstring) written
# from the format's description, not from this package.
LINEAR = re.compile(r".*\.(q_proj|k_proj|v_proj|o_proj|in_proj_qkv|in_proj_z|in_proj_qkvz|out_proj|gate_proj|"
                    r"up_proj|down_proj)\.weight$")
KEPT = ["lm_head", "model.visual", "in_proj_a", "in_proj_b", "in_proj_ba", "mlp.gate", "shared_expert_gate"]


def script_quantize_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 codes, scale [ceil(N/128), ceil(K/128)] fp32): per 128 x 128 block (the last ones
    partial) scale = amax / 448 (1 for a block of zeros), codes = w / scale rounded to e4m3."""
    N, K = w.shape
    nb, kb = -(-N // 128), -(-K // 128)
    codes = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    scale = torch.empty(nb, kb)
    for i in range(nb):
        for j in range(kb):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            amax = block.abs().max()
            s = amax / 448 if amax > 0 else torch.tensor(1.0)
            scale[i, j] = s
            codes[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (block / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes, scale


def script_dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:codes.shape[0], :codes.shape[1]]
    return codes.float() * full


def independent_quantize(src, dst) -> dict[str, torch.Tensor]:
    """Quantize the checkpoint folder `src` into `dst` (Qwen's conversions, one file); returns the dequantized
    weights by checkpoint key."""
    os.makedirs(dst)
    config = json.loads(open(os.path.join(src, "config.json")).read())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], "modules_to_not_convert": KEPT}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    tensors, dequantized = {}, {}
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, name)))
    out = {}
    for key, t in tensors.items():
        if LINEAR.match(key) and not key.startswith(("model.visual.", "mtp.")):
            codes, scale = script_quantize_block(t)
            out[key], out[key[:-len("weight")] + "weight_scale_inv"] = codes, scale
            dequantized[key] = script_dequantize(codes, scale)
        else:
            out[key] = t
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dequantized


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, cfg, source folder, tools.quantize's folder, the independent script's folder and dequantized
    weights) of one family's tiny checkpoint."""
    name = request.param
    cfg, multimodal = FAMILIES[name]
    folder = tmp_path_factory.mktemp(name)
    src, ours, theirs = (str(folder / n) for n in ("bf16", "quantized", "script"))
    hf_reference(cfg, seed=3, multimodal=multimodal).save_pretrained(src, max_shard_size="200KB")
    quantize.quantize_checkpoint(src, ours, shard_gb=2e-4)
    return name, cfg, src, ours, theirs, independent_quantize(src, theirs)


def transformers_of(model):
    """transformers' fp32 model of `model`'s weights dequantized (its unquantized family class)."""
    import transformers

    weights, cfg = dequantize_weights(dict(model.named_parameters()), model.config, torch.float32)
    hf = hf_class(cfg)(getattr(transformers, cfg.family.config_class)(**cfg.to_hf()))
    if cfg.num_experts:
        hf.set_experts_implementation("eager")
    hf.load_state_dict(hf_state_dict(weights, cfg), strict=True)
    return hf.float().eval()


def logits_errors(model, hf, lengths=LENGTHS) -> list[float]:
    cache = model.new_cache(num_slots=len(lengths) + 1, num_blocks=32, block_size=16)
    streams = random_streams(model.config.vocab_size, lengths)
    out = model.prefill(cache, [Stream(i + 1, t) for i, t in enumerate(streams)])
    return [rel_err(out[i], hf_logits(hf, t)[-1]) for i, t in enumerate(streams)]


@pytest.mark.parametrize("writer", ["quantizer", "script"])
def test_quantized_checkpoints_load_and_match_transformers(family, writer):
    name, cfg, src, ours, theirs, script_weights = family
    folder = ours if writer == "quantizer" else theirs
    model = HybridModel.from_pretrained(folder, progress=False)
    assert model.config.quantization is not None
    fp8 = {n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert any("in_proj_qkv" in n for n in fp8) and any("experts" in n or "mlp.up_proj" in n for n in fp8)
    assert not any(k in n for n in fp8 for k in ("in_proj_a", "in_proj_b", "mlp.gate.", "lm_head", "embed"))
    hf = transformers_of(model)
    with activation_rounding(False):
        weight_only = logits_errors(model, hf)
    rounded = logits_errors(model, hf)
    assert max(weight_only) <= fp32_model_bound(model.config, max(LENGTHS)), weight_only
    hf_bf16 = transformers_of(model).to(torch.bfloat16)
    bf16 = [rel_err(hf_logits(hf_bf16, t)[-1], hf_logits(hf, t)[-1]) for t in random_streams(cfg.vocab_size, LENGTHS)]
    assert max(rounded) <= ACTIVATION_REACH * max(bf16), (rounded, bf16)
    if writer == "script":  # what the loader holds is what the script wrote, block for block
        from metrale_graph.loader import our_name
        from metrale_graph.weights import to_checkpoint

        deq, cfg_f = dequantize_weights(dict(model.named_parameters()), model.config, torch.float32)
        held = to_checkpoint(deq, cfg_f)
        for key, w in script_weights.items():
            assert torch.equal(held[our_name(key)], w), key


def test_the_quantizer_keeps_the_layout_and_what_it_does_not_convert(family):
    name, cfg, src, ours, _, _ = family
    index = json.loads(open(os.path.join(ours, "model.safetensors.index.json")).read())["weight_map"]
    config = json.loads(open(os.path.join(ours, "config.json")).read())
    src_keys = set()
    for f in os.listdir(src):
        if f.endswith(".safetensors"):
            src_keys |= set(load_file(os.path.join(src, f)))
    scales = {k for k in index if k.endswith("weight_scale_inv")}
    assert set(index) - scales == src_keys and {k[:-len("_scale_inv")] for k in scales} <= src_keys
    kept = config["quantization_config"]["modules_to_not_convert"]
    assert "lm_head" in kept and (name != "qwen3_5" or "model.visual" in kept)
    assert config["model_type"] == json.loads(open(os.path.join(src, "config.json")).read())["model_type"]


def test_generation(family):
    """The Engine generates from an FP8 checkpoint: greedy tokens equal those of repeated prefills."""
    from metrale_graph import Engine

    model = HybridModel.from_pretrained(family[3], progress=False)
    prompt = [3, 1, 4, 1, 5]
    (result,) = Engine(model, num_slots=2, token_budget=16, block_size=16, max_context=64, compile=False).generate(
        [prompt], max_new_tokens=5, stop_token_ids=[])
    cache, tokens, nxt = model.new_cache(1, 8, block_size=16), [], prompt
    for _ in range(5):
        nxt = [int(model.prefill(cache, [Stream(0, nxt)])[0].argmax())]
        tokens += nxt
    assert result.token_ids == tokens


def test_save_pretrained_round_trip_and_transformers_reads_it(tmp_path):
    """An FP8 model saved and loaded back holds the same tensors; transformers reads the config's
    quantization_config, and (accelerate installed) loads the checkpoint, on the CPU dequantizing it, to
    the logits of our weight-only path."""
    import transformers

    # every FP8 weight in whole 128-blocks or one block: transformers' CPU dequantizer takes the block as
    # rows / scale rows (a ragged last block would read wrong there; ours are right: the tests above)
    cfg = fp8_config(tiny_config(hidden_size=128, intermediate_size=256, linear_key_head_dim=32,
                                 linear_value_head_dim=32, head_dim=32), QWEN_KEPT)
    model = HybridModel.from_preset(cfg, seed=4)
    model.save_pretrained(str(tmp_path / "a"))
    again = HybridModel.from_pretrained(str(tmp_path / "a"), progress=False)
    first, second = dict(model.named_parameters()), dict(again.named_parameters())
    assert set(first) == set(second)
    for n, t in first.items():
        assert t.dtype == second[n].dtype and torch.equal(t.view(torch.uint8) if t.dtype.itemsize == 1 else t,
                                                          second[n].view(torch.uint8) if t.dtype.itemsize == 1
                                                          else second[n]), n
    again.save_pretrained(str(tmp_path / "b"))  # the explicit modules_to_not_convert reads back the same
    assert (json.loads((tmp_path / "a" / "config.json").read_text())
            == json.loads((tmp_path / "b" / "config.json").read_text()))
    hf_cfg = transformers.AutoConfig.from_pretrained(str(tmp_path / "a"))
    assert hf_cfg.quantization_config["quant_method"] == "fp8"
    pytest.importorskip("accelerate")  # transformers needs it to load FP8 checkpoints
    # dequantized (as transformers does by itself without a GPU; with one it would keep FP8 modules on the CPU)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "a"), dtype=torch.float32,
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True)).eval()
    with activation_rounding(False):
        assert max(logits_errors(model, hf)) <= fp32_model_bound(model.config, max(LENGTHS))


def _edit(folder, dst, edit, config=None):
    shutil.copytree(folder, dst)
    tensors = {}
    files = [f for f in os.listdir(dst) if f.endswith(".safetensors")]
    for f in files:
        tensors.update(load_file(os.path.join(dst, f)))
        os.unlink(os.path.join(dst, f))
    if os.path.exists(os.path.join(dst, "model.safetensors.index.json")):
        os.unlink(os.path.join(dst, "model.safetensors.index.json"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        data = json.loads(open(os.path.join(dst, "config.json")).read())
        config(data)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(data, f)
    return str(dst)


def _per_tensor(tensors):
    """Each block scale grid -> one scalar weight_scale (its largest), as per-tensor FP8 checkpoints store it."""
    for key in [k for k in tensors if k.endswith("weight_scale_inv")]:
        tensors[key[:-len("_inv")]] = tensors.pop(key).float().max()


QKV = "model.layers.0.linear_attn.in_proj_qkv"
B_PROJ = "model.layers.0.linear_attn.in_proj_b"
BAD = [
    ("missing scale", lambda t: t.pop(QKV + ".weight_scale_inv"), None,
     r"lacks 1 tensor.*layers\.0\.linear_attn\.in_proj_qkv\.weight_scale_inv"),
    ("mis-shaped scale", lambda t: t.update({QKV + ".weight_scale_inv": torch.ones(1, 1)}), None,
     r"'model\.layers\.0\.linear_attn\.in_proj_qkv\.weight_scale_inv' has shape \(1, 1\), the config needs"),
    ("scale in int", lambda t: t.update({QKV + ".weight_scale_inv": t[QKV + ".weight_scale_inv"].int()}), None,
     r"in_proj_qkv\.weight_scale_inv' in .* is torch\.int32; FP8 block scales .* float32 or bfloat16"),
    ("converted weight in bf16", lambda t: t.update({QKV + ".weight": t[QKV + ".weight"].bfloat16()}), None,
     r"in_proj_qkv\.weight' in .* is BF16; the quantization_config converts it, so it must be float8_e4m3fn"),
    ("kept weight in fp8", lambda t: t.update({B_PROJ + ".weight": t[B_PROJ + ".weight"].to(torch.float8_e4m3fn)}),
     None, r"in_proj_b\.weight' in .* is float8_e4m3fn, but it is kept in floating point"),
    ("scale of a kept module", lambda t: t.update({B_PROJ + ".weight_scale_inv": torch.ones(1, 2)}), None,
     r"1 FP8 block scale\(s\) of modules the quantization_config does not convert.*in_proj_b\.weight_scale_inv"),
    ("module listed as kept", lambda t: None,
     lambda c: c["quantization_config"]["modules_to_not_convert"].append("in_proj_qkv"),
     r"in_proj_qkv\.weight' in .* is float8_e4m3fn, but it is kept in floating point"),
    ("lm_head in fp8", lambda t: t.update({"lm_head.weight": t["lm_head.weight"].to(torch.float8_e4m3fn)}), None,
     r"'lm_head\.weight' in .* is float8_e4m3fn, but it is one metrale-graph keeps in floating point"),
    # AutoFP8's / vLLM's per-tensor FP8: quant_method 'fp8' without weight_block_size, a scalar weight_scale (and
    # input_scale) per weight; it was 'N unexpected tensor(s)', or a converted weight's dtype, by the keys' order
    ("per-tensor scales", _per_tensor, lambda c: c["quantization_config"].pop("weight_block_size"),
     r"per-tensor FP8 scales \(e\.g\. 'model\.layers\..*\.weight_scale'.*AutoFP8.*weight_scale_inv"),
]


@pytest.mark.parametrize("what, edit, config, message", BAD, ids=[b[0] for b in BAD])
def test_malformed_checkpoints_name_the_tensor_before_reading(tmp_path, monkeypatch, what, edit, config, message):
    import safetensors

    cfg = fp8_config(tiny_config(), QWEN_KEPT)
    good = str(tmp_path / "good")
    HybridModel.from_preset(cfg).save_pretrained(good)
    bad = _edit(good, tmp_path / "bad", edit, config)
    real = safetensors.safe_open

    class HeadersOnly:  # a tensor's data read (get_tensor) fails the test: the checks come first
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, key):
            return self.f.get_slice(key)

        def get_tensor(self, key):
            raise AssertionError(f"read {key} before the checks")

    monkeypatch.setattr(safetensors, "safe_open", HeadersOnly)
    with pytest.raises(ValueError, match=message):
        HybridModel.from_pretrained(bad, progress=False)


EXPERT_UP = "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"
SHARED_DOWN = "model.layers.1.mlp.shared_expert.down_proj.weight_scale_inv"


def _set_block(key, value, dtype=None):
    """An edit: one block scale of `key` (its last block; the whole grid with value None: zeroed) set, the
    tensor stored in `dtype` (default: as it is)."""
    def edit(tensors):
        t = tensors[key].clone()
        if value is None:
            t.zero_()
        else:
            t.view(-1)[-1] = value
        tensors[key] = t if dtype is None else t.to(dtype)
    return edit


BAD_SCALES = [
    # (what, tensor, edit, the model's dtype, message): each loaded without a word, the logits NaN or moved
    ("huge", QKV + ".weight_scale_inv", _set_block(QKV + ".weight_scale_inv", 1e38), torch.float32,
     r"holds a block scale of 1e\+38: the largest e4m3 code \(448\) times it is not finite in torch\.float32"),
    ("infinite", QKV + ".weight_scale_inv", _set_block(QKV + ".weight_scale_inv", float("inf")), torch.float32,
     r"holds a block scale of inf"),
    ("negative", QKV + ".weight_scale_inv", _set_block(QKV + ".weight_scale_inv", -1e-3), torch.float32,
     r"holds a block scale of -0\.001: scales must be positive"),
    ("all zero", SHARED_DOWN, _set_block(SHARED_DOWN, None), torch.float32,
     r"holds a block scale of 0: scales must be positive"),
    ("subnormal", QKV + ".weight_scale_inv", _set_block(QKV + ".weight_scale_inv", 1e-45), torch.float32,
     r"holds a subnormal block scale, 1\.4\d*e-45 \(below float32's smallest normal number"),
    ("NaN", QKV + ".weight_scale_inv", _set_block(QKV + ".weight_scale_inv", float("nan")), torch.float32,
     r"holds NaN block scales"),
    ("subnormal in bf16", QKV + ".weight_scale_inv", _set_block(QKV + ".weight_scale_inv", 1e-39, torch.bfloat16),
     torch.float32, r"holds a subnormal block scale"),
    # one expert's of the per-expert tensors Qwen's releases store (the model stacks them)
    ("one expert's", EXPERT_UP, _set_block(EXPERT_UP, -2.0), torch.float32, r"holds a block scale of -2"),
    # finite in fp32, not in fp16: 448 x 200 > 65504
    ("beyond fp16", QKV + ".weight_scale_inv", _set_block(QKV + ".weight_scale_inv", 200.0), torch.float16,
     r"holds a block scale of 200: .* not finite in torch\.float16 \(scales up to 146\.2\d* are\)"),
]


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory):
    """An FP8 Qwen3.5-MoE checkpoint (hidden size 136: two column blocks, the last ragged; experts of 128 rows,
    which also stack on whole blocks), experts one tensor each."""
    folder = str(tmp_path_factory.mktemp("fp8-moe") / "good")
    cfg = moe_config("qwen3_5_moe_text", hidden_size=136, moe_intermediate_size=128)
    HybridModel.from_preset(fp8_config(cfg, QWEN_KEPT)).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("what, key, edit, dtype, message", BAD_SCALES, ids=[b[0] for b in BAD_SCALES])
def test_scales_that_make_the_model_unusable_are_refused(fp8_moe, tmp_path, what, key, edit, dtype, message):
    """A block scale must be finite, positive and normal, and 448 (the largest e4m3 code) times it finite in
    the model's dtype: otherwise a ValueError naming the tensor as the checkpoint names it and its file."""
    bad = _edit(fp8_moe, tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=rf"tensor '{re.escape(key)}' in .*model\.safetensors {message}"):
        HybridModel.from_pretrained(bad, dtype=dtype, progress=False)
    if what == "beyond fp16":
        HybridModel.from_pretrained(bad, dtype=torch.float32, progress=False)  # fine in fp32


def test_stacked_expert_scales_are_checked_by_their_stacked_name(fp8_moe, tmp_path):
    """Experts stored stacked (transformers' `experts.gate_up_proj` with `gate_up_proj_scale_inv`): the stacked
    tensor is named."""
    from test_checkpoints_foreign import stack_experts

    key = "model.layers.0.mlp.experts.gate_up_proj_scale_inv"

    def edit(tensors):
        stack_experts(tensors)
        tensors[key] = tensors[key].clone()
        tensors[key][2, 0, 1] = 0.0

    bad = _edit(fp8_moe, tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=rf"tensor '{re.escape(key)}' in .* holds a block scale of 0"):
        HybridModel.from_pretrained(bad, progress=False)
    HybridModel.from_pretrained(_edit(fp8_moe, tmp_path / "good", stack_experts), progress=False)


def test_a_fused_tensor_not_on_128_row_blocks_is_refused(tmp_path):
    """Qwen3-Next with 16-row heads: its FP8 in_proj_qkvz cannot be split into in_proj_qkv / in_proj_z."""
    cfg = fp8_config(moe_config("qwen3_next"), QWEN_KEPT)
    with pytest.raises(ValueError, match=r"converts layers\.0\.linear_attn\.in_proj_qkvz\.weight to FP8, but its "
                                         r"members' rows per group .* are not multiples of 128"):
        HybridModel.from_preset(cfg).save_pretrained(str(tmp_path))


def test_fp8_presets_are_the_bf16_draws_quantized():
    from metrale_graph import PRESETS
    from metrale_graph.quantized import quantize_weights
    from metrale_graph.weights import random_weights

    assert all(PRESETS[f"{n}-fp8"].quantization is not None
               for n in ("qwen3.5-9b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b"))
    cfg = fp8_config(FAMILIES["qwen3_5_moe"][0], QWEN_KEPT)
    drawn = random_weights(cfg, torch.bfloat16, "cpu", seed=7)
    quantized = quantize_weights(random_weights(cfg.replace(quantization=None), torch.bfloat16, "cpu", seed=7), cfg)
    assert set(drawn) == set(quantized)
    for n, t in drawn.items():
        u = (lambda x: x.view(torch.uint8)) if t.dtype.itemsize == 1 else (lambda x: x)
        assert t.dtype == quantized[n].dtype and torch.equal(u(t), u(quantized[n])), n


def test_onnx_export_refuses_fp8(tmp_path):
    pytest.importorskip("onnxscript")
    from metrale_graph.onnx import export_prefill

    model = HybridModel.from_preset(fp8_config(tiny_config()))
    with pytest.raises(ValueError, match="does not write FP8 models"):
        export_prefill(model, model.new_cache(2, 8), 2, 16)


def test_dtype_conversion_moves_fp8_weights_only():
    model = HybridModel.from_preset(fp8_config(tiny_config()))
    model.to(torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["layers.0.mlp.gate_proj.weight"] == torch.float8_e4m3fn
    assert dtypes["layers.0.mlp.gate_proj.weight_scale_inv"] == torch.float32
    assert dtypes["embed_tokens.weight"] == torch.bfloat16


def test_compiled_fp8_step_has_no_graph_break():
    from torch._dynamo.utils import counters

    from helpers import run_step

    torch._dynamo.reset()
    counters.clear()
    model = HybridModel.from_preset(fp8_config(FAMILIES["qwen3_5_moe"][0], QWEN_KEPT), seed=2)
    streams = [Stream(0, list(range(1, 40))), Stream(2, [5])]
    compiled = torch.compile(model.forward_packed, fullgraph=True, dynamic=False)
    ref = run_step(model, model.forward_packed, model.new_cache(4, 16, block_size=16), streams)
    out = run_step(model, compiled, model.new_cache(4, 16, block_size=16), streams)
    assert rel_err(out, ref) <= 1e-5
    assert dict(counters["graph_break"]) == {}, f"graph breaks: {dict(counters['graph_break'])}"


def test_the_quantizer_writes_scales_that_load(tmp_path):
    """A weight of values too small for 448 / amax to be finite (1e-38: its blocks got scale_inv 0 and NaN
    codes, so the checkpoint written could not load) quantizes to normal scales and loads, holding them; a
    weight holding NaN is refused by name, nothing written."""
    src, out = str(tmp_path / "src"), str(tmp_path / "fp8")
    HybridModel.from_preset(tiny_config()).save_pretrained(src)
    tiny = _edit(src, tmp_path / "tiny", lambda t: t.update({QKV + ".weight": t[QKV + ".weight"] * 1e-38}))
    quantize.quantize_checkpoint(tiny, out)
    held = dict(HybridModel.from_pretrained(out, progress=False).named_parameters())
    want = load_file(os.path.join(tiny, "model.safetensors"))[QKV + ".weight"]
    got = dequantize_weights(held, fp8_config(tiny_config(), QWEN_KEPT))[0]["layers.0.linear_attn.in_proj_qkv.weight"]
    assert rel_err(got, want) <= 0.1  # e4m3's subnormal codes at the smallest normal scale: 3 bits or fewer
    nan = _edit(src, tmp_path / "nan", lambda t: t[QKV + ".weight"].view(-1).__setitem__(7, float("nan")))
    with pytest.raises(ValueError, match=rf"tensor '{re.escape(QKV)}\.weight' in .* holds NaN or infinite values: "
                                         "it cannot be quantized"):
        quantize.quantize_checkpoint(nan, str(tmp_path / "nan-fp8"))
    assert not any(f.endswith((".safetensors", ".json")) for f in os.listdir(tmp_path / "nan-fp8"))


def test_quantizer_flags(tmp_path, capsys):
    src = str(tmp_path / "src")
    HybridModel.from_preset(tiny_config()).save_pretrained(src)
    weights_only = tmp_path / "weights-only"  # no config.json: was a FileNotFoundError traceback
    weights_only.mkdir()
    (weights_only / "model.safetensors").write_bytes((tmp_path / "src" / "model.safetensors").read_bytes())
    bad_json = tmp_path / "bad-json"  # was json's bare "Expecting value: line 1 column 1 (char 0)"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("")
    for argv, message in ((["--model", src, "--out", src], "another folder"),
                          (["--model", str(tmp_path / "nope"), "--out", "x"], "not a checkpoint folder"),
                          (["--model", str(weights_only), "--out", "x"], f"{weights_only} has no config.json"),
                          (["--model", str(bad_json), "--out", "x"], f"cannot read model config {bad_json}"),
                          (["--model", src, "--out", str(tmp_path / "a" / "b")], "does not exist"),
                          (["--model", src, "--out", ""], "--out is empty"),  # was os.makedirs' FileNotFoundError
                          (["--model", src, "--out", "x", "--modules-to-not-convert", "[("],  # was re.error
                           "'[(' is not a regular expression")):
        with pytest.raises(SystemExit) as e:
            quantize.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    quantize.main(["--model", src, "--out", str(tmp_path / "fp8")])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["tool"] == "quantize" and record["converted"] > 0
    with pytest.raises(SystemExit) as e:  # an FP8 checkpoint already
        quantize.main(["--model", str(tmp_path / "fp8"), "--out", str(tmp_path / "again")])
    assert e.value.code == 2 and "FP8 checkpoint already" in capsys.readouterr().err


def test_the_quantizer_writes_stacked_experts_one_tensor_each(family, tmp_path):
    """A bf16 checkpoint whose experts are stacked (transformers 5's `experts.gate_up_proj` [E, 2I, D],
    `experts.down_proj`; here I = 72, not whole 128-row blocks) quantizes into per-expert tensors with their
    scales, the layout Qwen's FP8 releases use: it loads, holding the same FP8 weights as the quantizer's
    output of the same checkpoint stored per expert."""
    from test_checkpoints_foreign import stack_experts

    name, cfg, src, ours, _, _ = family
    if name != "qwen3_5_moe":
        pytest.skip("one MoE family is enough: the stacking is the family's experts'")
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f)))
    stack_experts(tensors)
    assert any(k.endswith("experts.gate_up_proj") for k in tensors)
    stacked_src, out = str(tmp_path / "stacked"), str(tmp_path / "fp8")
    os.makedirs(stacked_src)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f != "model.safetensors.index.json":
            shutil.copyfile(os.path.join(src, f), os.path.join(stacked_src, f))
    save_file(tensors, os.path.join(stacked_src, "model.safetensors"), metadata={"format": "pt"})
    quantize.quantize_checkpoint(stacked_src, out)
    written = load_file(os.path.join(out, "model.safetensors"))
    assert not any("gate_up_proj" in k or k.endswith("experts.down_proj") for k in written)
    assert "model.layers.0.mlp.experts.4.up_proj.weight_scale_inv" in written
    got = dict(HybridModel.from_pretrained(out, progress=False).named_parameters())
    want = dict(HybridModel.from_pretrained(ours, progress=False).named_parameters())
    assert got.keys() == want.keys()
    for n, w in want.items():
        same = torch.equal(got[n].view(torch.uint8), w.view(torch.uint8)) if w.dtype == torch.float8_e4m3fn \
            else torch.equal(got[n], w)
        assert same, n

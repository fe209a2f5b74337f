"""compressed-tensors FP8 checkpoints (llm-compressor's float-quantized formats), written here by hand as
llm-compressor writes them (config.json's quantization_config as compressed-tensors serializes it, `<module>.weight`
float8_e4m3fn and `<module>.weight_scale` in the model's dtype, `input_scale` for static activations, `k_scale` /
`v_scale` for a kv_cache_scheme, several shards), from checkpoints transformers wrote, for the dense, both MoE
families, a multimodal wrapper and an MTP head copied in bf16: each loaded and run against transformers (fp32) on
the same checkpoint dequantized. Block [128, 128] scales load as 128 x 128-block FP8 whose dequantized weights are
the file's exactly (run weight-only, within metrics.fp32_model_bound), and so do tensor scales when asked
(requantize_fp8); other scales load dequantized, equal to the dequantized checkpoint's weights bit for bit, or
requantized to blocks when asked; a tensor-parallel rank's shard is the full load's. Other compressed-tensors
schemes are refused naming the format, malformed files naming the tensor before anything is read."""

import glob
import json
import logging
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import read_checkpoint, write_sharded
from metrics import fp32_model_bound
from test_checkpoints_foreign import LENGTHS, fp8_shapes, load_transformers, mtp_head, transformers_model, weight_only_error
from metrale_graph import HybridModel
from metrale_graph.config import ModelConfig
from metrale_graph.quantized import dequantize_weights, quantize_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# the linear layers of the checkpoints (what compressed-tensors' "Linear" target quantizes)
LINEAR = re.compile(r"(.*\.(q_proj|k_proj|v_proj|o_proj|in_proj_\w+|out_proj|gate_proj|up_proj|down_proj|fc|mlp\.gate|"
                    r"shared_expert_gate)|lm_head)\.weight$")


def args(strategy=None, dynamic=False, **extra) -> dict:
    """QuantizationArgs as compressed-tensors' model_dump writes them (every field)."""
    return {"actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": None, "num_bits": 8,
            "observer": None if dynamic else "minmax", "observer_kwargs": {}, "scale_dtype": None,
            "strategy": strategy, "symmetric": True, "type": "float", "zp_dtype": None, **extra}


SCHEMES = {  # llm-compressor's FP8 presets: (weights, input_activations)
    "FP8_DYNAMIC": (args("channel"), args("token", dynamic=True)),
    "FP8": (args("tensor"), args("tensor")),
    "FP8_BLOCK": (args("block", block_structure=[128, 128]), args("group", dynamic=True, group_size=128)),
    "W8A16_GROUP": (args("group", group_size=32), None),
}


def quantization_config(scheme: str, ignore: list[str], targets=("Linear",), kv=False) -> dict:
    weights, inputs = SCHEMES[scheme]
    fmt = "float-quantized" if inputs else "naive-quantized"
    return {"config_groups": {"group_0": {"format": fmt, "input_activations": inputs, "output_activations": None,
                                          "targets": list(targets), "weights": weights}},
            "format": fmt, "global_compression_ratio": None, "ignore": ignore,
            "kv_cache_scheme": args("tensor") if kv else None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {}, "version": "0.12.2"}


def matches(name: str, target: str) -> bool:
    return re.match(target[3:], name) is not None if target.startswith("re:") else target in (name, "Linear")


def quantize(w: torch.Tensor, weights: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] bf16 -> (e4m3 codes, weight_scale in w's dtype, the dequantized fp32 weight), as compressed-tensors'
    min-max observer and quantize do: scale = amax / 448 over the strategy's span, rounded to w's dtype,
    codes = clamp(w / scale) rounded to e4m3."""
    N, K = w.shape
    strategy = weights["strategy"]
    br, bc = {"tensor": (N, K), "channel": (1, K), "group": (1, weights["group_size"]),
              "block": tuple(weights["block_structure"] or (0, 0))}[strategy]
    nb, kb = -(-N // br), -(-K // bc)
    padded = torch.zeros(nb * br, kb * bc)
    padded[:N, :K] = w.float()
    amax = padded.abs().reshape(nb, br, kb, bc).amax(dim=(1, 3))
    scale = (amax.clamp(min=1e-12) / 448).to(w.dtype)
    full = scale.float().repeat_interleave(br, 0).repeat_interleave(bc, 1)[:N, :K]
    codes = (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    stored = scale.reshape(1) if strategy == "tensor" else scale
    return codes, stored, codes.float() * full


def write_compressed(src: str, dst: str, scheme: str, ignore: list[str], *, targets=("Linear",), kv=False,
                     mtp: dict | None = None, shards: int = 3, unmatched: str | None = None) -> str:
    """Quantize the transformers checkpoint `src` into `dst` as llm-compressor saves a compressed-tensors model:
    every linear layer a target matches and no ignore entry names quantized (its weight_scale beside it, an
    input_scale for static activations), the rest as stored; `kv`: a kv_cache_scheme and its k_scale / v_scale;
    `mtp`: a bf16 MTP head added as compressed-tensors' save_mtp_tensors_to_checkpoint adds it (ignored by
    "re:^mtp.*"); `unmatched`: a regular expression of linears no target matches in the model quantized, kept as
    stored and not in ignore (transformers' fused experts, which are no nn.Linear). Returns a folder with the same
    checkpoint dequantized (fp32, no quantization_config)."""
    os.makedirs(dst)
    ref = dst + "-dequantized"
    os.makedirs(ref)
    config, tensors = read_checkpoint(src)
    if mtp:
        tensors.update(mtp)
        ignore = [*ignore, "re:^mtp.*"]
    weights, inputs = SCHEMES[scheme]
    out, dequantized = {}, {}
    for key, w in sorted(tensors.items()):
        module = key[:-len(".weight")]
        if LINEAR.match(key) and any(matches(module, t) for t in targets) and not any(matches(module, t)
                                                                                       for t in ignore) and not (
                unmatched and re.match(unmatched, module)):
            out[key], out[module + ".weight_scale"], dequantized[key] = quantize(w, weights)
            if inputs is not None and not inputs["dynamic"]:
                out[module + ".input_scale"] = torch.tensor([0.02], dtype=w.dtype)
        else:
            out[key], dequantized[key] = w, w.float()
        if kv and key.endswith("self_attn.k_proj.weight"):
            out[key.replace("k_proj.weight", "k_scale")] = out[key.replace("k_proj.weight", "v_scale")] = torch.tensor(
                [0.1], dtype=w.dtype)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": quantization_config(scheme, ignore, targets, kv)}, f, indent=2)
    write_sharded(dst, out, shards)
    with open(os.path.join(ref, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(dequantized, os.path.join(ref, "model.safetensors"), metadata={"format": "pt"})
    return ref


def fp8_names(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}


def dequantized(model) -> dict[str, torch.Tensor]:
    """The model's weights with its FP8 ones dequantized (fp32)."""
    weights, _ = dequantize_weights(dict(model.named_parameters()), model.config, torch.float32)
    return weights


QWEN_IGNORE = ["re:.*lm_head", "re:.*mlp.gate$", "re:.*embed_tokens$", "re:.*shared_expert_gate$", "re:.*linear_attn.*"]


ATTENTION_MOE = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj"}
TENSOR_IGNORE = ["lm_head", "re:model.visual.*", "re:.*linear_attn.*", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]
CASES = [  # family, multimodal, scheme, ignore, MTP head, kv_cache_scheme, requantize_fp8; the FP8 weights in memory
    pytest.param("qwen3_5_text", False, "FP8_DYNAMIC", ["lm_head", "re:.*linear_attn.*"], False, True, False, set(),
                 id="qwen3_5-channel-dequantized-kv"),
    pytest.param("qwen3_5_moe_text", False, "FP8_BLOCK", QWEN_IGNORE, False, False, False, ATTENTION_MOE,
                 id="qwen3_5_moe-block"),
    pytest.param("qwen3_5_moe_text", True, "FP8", TENSOR_IGNORE, True, False, False, set(),
                 id="mm-qwen3_5_moe-tensor-static-mtp-dequantized"),
    # tensor scales held as block FP8 when asked: exactly (the codes as stored, the scale in every block)
    pytest.param("qwen3_5_moe_text", True, "FP8", TENSOR_IGNORE, True, False, True, ATTENTION_MOE,
                 id="mm-qwen3_5_moe-tensor-static-mtp-as-blocks"),
    # every linear but lm_head: the fused in_proj_qkvz as FP8, in_proj_ba (rows not 128-blocks), the router and the
    # shared-expert gate dequantized
    pytest.param("qwen3_next", False, "FP8_BLOCK", ["lm_head"], False, False, False,
                 ATTENTION_MOE | {"in_proj_qkv", "in_proj_z", "out_proj"}, id="qwen3_next-block-gates-dequantized"),
    pytest.param("qwen3_5_text", True, "W8A16_GROUP", ["lm_head", "re:model.visual.*"], True, False, False, set(),
                 id="mm-qwen3_5-group-weight-only-mtp"),
]


@pytest.mark.parametrize("family, multimodal, scheme, ignore, mtp, kv, requantize, in_fp8", CASES)
def test_llm_compressor_checkpoints_load_and_match(tmp_path, family, multimodal, scheme, ignore, mtp, kv, requantize,
                                                   in_fp8):
    src, dst = str(tmp_path / "bf16"), str(tmp_path / "ct")
    sizes = fp8_shapes(family, aligned=False)
    transformers_model(family, multimodal, **sizes).to(torch.bfloat16).save_pretrained(src)
    ref = write_compressed(src, dst, scheme, ignore, kv=kv, mtp=mtp_head(family, **sizes) if mtp else None)
    ours = HybridModel.from_pretrained(dst, progress=False, requantize_fp8=requantize)
    assert {n.split(".")[-2] if n.endswith("weight") else n.split(".")[-1] for n in fp8_names(ours)} == in_fp8
    assert (ours.mtp is not None) == mtp
    plain = HybridModel.from_pretrained(ref, progress=False)  # its MTP head too (transformers has none)
    expected = dict(plain.named_parameters())
    for name, w in dequantized(ours).items():  # the file's weights exactly: codes * scales
        assert torch.equal(w, expected[name]), name
    assert weight_only_error(ours, load_transformers(ref, multimodal)) <= fp32_model_bound(ours.config, max(LENGTHS))


@pytest.mark.parametrize("family, multimodal, scheme, in_fp8", [
    ("qwen3_5_moe_text", True, "FP8_BLOCK", {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj",
                                              "gate_proj", "up_proj", "down_proj"}),
    ("qwen3_next", False, "FP8_DYNAMIC", set())], ids=["mm-qwen3_5_moe-block", "qwen3_next-channel"])
def test_compressed_tensors_own_save_of_transformers_moe_keeps_the_experts_in_floating_point(tmp_path, family,
                                                                                             multimodal, scheme, in_fp8):
    """compressed-tensors applied to transformers' MoE model and saved by its ModelCompressor (checked against
    compressed-tensors 0.20.0): transformers' experts module is no nn.Linear, so the `Linear` target leaves the experts
    bf16, without scales, and the ignore list (the Linear modules it skipped) names none of them. They were refused
    ("is BF16; the compressed-tensors quantization_config quantizes it"), though transformers loads such a folder.
    Experts the files store so are floating point in memory; the rest as before (block FP8 as stored, or
    dequantized), every weight the file's."""
    src, dst = str(tmp_path / "bf16"), str(tmp_path / "ct")
    sizes = fp8_shapes(family, aligned=False)
    transformers_model(family, multimodal, **sizes).to(torch.bfloat16).save_pretrained(src)
    ignore = ["lm_head", "re:model.visual.*", "re:.*mlp.gate$", "re:.*shared_expert_gate$", "re:.*in_proj_(a|b|ba)$"]
    ref = write_compressed(src, dst, scheme, ignore, unmatched=r".*mlp\.experts\.\d+\.")
    ours = HybridModel.from_pretrained(dst, progress=False)
    assert {n.split(".")[-2] for n in fp8_names(ours)} == in_fp8
    assert not any(".experts." in n for n in fp8_names(ours))
    expected = dict(HybridModel.from_pretrained(ref, progress=False).named_parameters())
    for name, w in dequantized(ours).items():
        assert torch.equal(w, expected[name]), name
    assert weight_only_error(ours, load_transformers(ref, multimodal)) <= fp32_model_bound(ours.config, max(LENGTHS))
    experts, key = next((path, k) for path in sorted(glob.glob(os.path.join(dst, "*.safetensors")))
                        for k in load_file(path) if re.search(r"experts\.\d+\.up_proj\.weight$", k))
    tensors = load_file(experts)  # an expert stored FP8 without its scale: named
    tensors[key] = tensors[key].to(torch.float8_e4m3fn)
    save_file(tensors, experts, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(f"{key!r}") + ".* is FP8 but the checkpoint has no .*weight_scale"):
        HybridModel.from_pretrained(dst, progress=False)


def test_channel_scales_requantized_to_blocks_when_asked(tmp_path, caplog):
    """requantize_fp8: channel-scaled projections become 128 x 128-block FP8, exactly the dequantized weights
    quantized (quantized.quantize_weights: a second rounding of each), the modules metrale-graph keeps in floating
    point (the shared-expert gate here) dequantized as before; without it, nothing is FP8 in memory."""
    src, dst = str(tmp_path / "bf16"), str(tmp_path / "ct")
    sizes = fp8_shapes("qwen3_5_moe_text", aligned=False)
    transformers_model("qwen3_5_moe_text", False, **sizes).to(torch.bfloat16).save_pretrained(src)
    ref = write_compressed(src, dst, "FP8_DYNAMIC", ["lm_head", "re:.*mlp.gate$", "re:.*in_proj_[ab]$"])
    ours = HybridModel.from_pretrained(dst, progress=False, requantize_fp8=True)
    plain = HybridModel.from_pretrained(ref, progress=False)
    assert {"layers.0.linear_attn.in_proj_qkv.weight", "layers.0.mlp.experts.gate_up_proj", "layers.3.self_attn.o_proj"
            ".weight", "layers.0.mlp.shared_expert.up_proj.weight"} <= fp8_names(ours)
    assert "layers.0.mlp.shared_expert_gate.weight" not in fp8_names(ours)
    expected = quantize_weights(dict(plain.named_parameters()), ours.config)
    for name, p in ours.named_parameters():
        assert torch.equal(p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p,
                           expected[name].view(torch.uint8) if p.dtype == torch.float8_e4m3fn else expected[name]), name
    with caplog.at_level(logging.INFO, logger="metrale_graph"):
        assert not fp8_names(HybridModel.from_pretrained(dst, progress=False))
    assert re.search(r"FP8 weights 0 as stored, 0 tensor scale in every block, 0 requantized, \d+ dequantized, 4 "
                     r"dequantized \(kept in floating point\)", caplog.text)
    assert "held dequantized in torch.float32" in caplog.text and "requantize_fp8=True" in caplog.text


@pytest.mark.parametrize("scheme, moe", [("FP8_DYNAMIC", "within"), ("FP8_DYNAMIC", "expert"), ("FP8", "expert")])
def test_tensor_parallel_ranks_read_their_shards(tmp_path, scheme, moe):
    """A rank's shard of a compressed-tensors checkpoint is the full load's: channel scales (each rank dequantizes
    the rows or columns it reads), and the experts' tensor scales held as FP8 blocks (requantize_fp8; whole experts
    on each rank)."""
    from metrale_graph.loader import load_checkpoint
    from metrale_graph.parallel import TensorParallel
    from metrale_graph.weights import checkpoint_config, shard_weights

    src, dst = str(tmp_path / "bf16"), str(tmp_path / "ct")
    transformers_model("qwen3_5_moe_text", False, num_experts=4).to(torch.bfloat16).save_pretrained(src)
    targets = ("Linear",) if scheme == "FP8_DYNAMIC" else (r"re:.*mlp\.experts\.\d+\.",)
    write_compressed(src, dst, scheme, ["lm_head"], targets=targets, shards=2)
    cfg = checkpoint_config(dst, requantize_fp8=scheme == "FP8")
    full = load_checkpoint(dst, cfg, torch.float32, "cpu", progress=False)
    assert (scheme == "FP8") == ("layers.0.mlp.experts.down_proj_scale_inv" in full)
    for rank in range(2):
        tp = TensorParallel(rank, 2, moe=moe)
        part = load_checkpoint(dst, cfg, torch.float32, "cpu", progress=False, tp=tp)
        want = shard_weights(full, cfg, tp)
        assert part.keys() == want.keys()
        for name, w in want.items():
            fp8 = w.dtype == torch.float8_e4m3fn
            assert torch.equal(part[name].view(torch.uint8) if fp8 else part[name], w.view(torch.uint8) if fp8 else w), (
                rank, name)


def test_saved_in_qwens_format_and_config_round_trip(tmp_path):
    """A model loaded from a compressed-tensors checkpoint saves Qwen's FP8 format (weight_scale_inv, the modules
    kept in floating point listed), which loads back to the same weights; its config's to_hf gives back the
    checkpoint's quantization_config, which from_hf reads to the same config."""
    src, dst = str(tmp_path / "bf16"), str(tmp_path / "ct")
    sizes = fp8_shapes("qwen3_5_moe_text", aligned=False)
    transformers_model("qwen3_5_moe_text", False, **sizes).to(torch.bfloat16).save_pretrained(src)
    write_compressed(src, dst, "FP8_BLOCK", QWEN_IGNORE)
    ours = HybridModel.from_pretrained(dst, progress=False)
    assert ModelConfig.from_hf(ours.config.to_hf()) == ours.config
    ours.save_pretrained(str(tmp_path / "saved"))
    with open(tmp_path / "saved" / "config.json") as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "fp8"
    back = dict(HybridModel.from_pretrained(str(tmp_path / "saved"), progress=False).named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p.view(torch.uint8), back[name].view(torch.uint8)), name


# ---- refused -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_5_bf16(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("bf16"))
    transformers_model("qwen3_5_text", False).to(torch.bfloat16).save_pretrained(folder)
    return folder


def group(weights, inputs=None, fmt=None):
    return {"targets": ["Linear"], "weights": weights, "input_activations": inputs, "output_activations": None,
            **({"format": fmt} if fmt else {})}


INT = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}
OTHER = [  # config edit, what the message names
    ({"format": "pack-quantized", "config_groups": {"group_0": group(INT)}}, "format 'pack-quantized': int4"),
    ({"format": "nvfp4-pack-quantized", "config_groups": {"group_0": group(
        {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16})}}, "format 'nvfp4-pack"),
    ({"format": "int-quantized", "config_groups": {"group_0": group(
        {"num_bits": 8, "type": "int", "strategy": "channel"}, args("token", True, type="int"))}}, "int8 weights"),
    ({"format": "mixed-precision", "config_groups": {"group_0": group(args("channel"), fmt="float-quantized"),
                                                     "group_1": group(INT, fmt="pack-quantized")}},
     "group_1.format 'pack-quantized'"),
    ({"config_groups": {"group_0": group({**args("channel"), "symmetric": False})}}, "asymmetric"),
    ({"config_groups": {"group_0": group(args("group", group_size=128, actorder="group"))}}, "actorder 'group'"),
    ({"transform_config": {"config_groups": {"R1": {"type": "hadamard"}}}}, "rotated by transforms"),
    ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparse weights"),
    ({"format": "dense"}, "format 'dense': unquantized weights"),
    ({"config_groups": {"group_0": {**group(args("channel")), "output_activations": args("token", True)}}},
     "output_activations"),
    ({"config_groups": {"W4A16": ["Linear"]}}, "preset scheme 'W4A16'"),
]


@pytest.mark.parametrize("edit, message", OTHER, ids=[o[1].split()[0].strip("'") for o in OTHER])
def test_other_compressed_tensors_schemes_are_refused_by_name(qwen3_5_bf16, tmp_path, edit, message):
    folder = str(tmp_path / "ct")
    write_compressed(qwen3_5_bf16, folder, "FP8_DYNAMIC", ["lm_head"])
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"].update(edit)
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=f"quant_method 'compressed-tensors', .*{re.escape(message)}.*is not "
                                         "supported: .*compressed-tensors FP8"):
        HybridModel.from_pretrained(folder, progress=False)


def _retype(key, dtype):
    return lambda t: {**t, key: t[key].to(dtype)}


PROJ = "model.layers.0.mlp.down_proj"
BAD = [  # what, scheme, edit of the tensors, message
    ("no scale", "FP8_DYNAMIC", lambda t: {k: v for k, v in t.items() if k != PROJ + ".weight_scale"},
     f"'{PROJ}.weight'.* is FP8 but the checkpoint has no {PROJ}.weight_scale"),
    ("no block scale", "FP8_BLOCK", lambda t: {k: v for k, v in t.items() if k != PROJ + ".weight_scale"},
     r"lacks 1 tensor\(s\) .*'layers.0.mlp.down_proj.weight_scale_inv'.*compressed-tensors names an FP8 weight's "
     "scales weight_scale"),
    ("scale shape", "FP8_DYNAMIC", lambda t: {**t, PROJ + ".weight_scale": t[PROJ + ".weight_scale"][:-1]},
     r"weight_scale' .* has shape \(47, 1\); the channel scales of .*down_proj.weight' \[48, 80\] are \(48, 1\)"),
    ("scale dtype", "FP8_DYNAMIC", _retype(PROJ + ".weight_scale", torch.int32),
     "is I32; FP8 weight scales must be float32"),
    ("zero scale", "FP8_DYNAMIC", lambda t: {**t, PROJ + ".weight_scale": torch.zeros_like(t[PROJ + ".weight_scale"])},
     "weight_scale' in .* holds a block scale of 0"),
    ("bf16 weight", "FP8_BLOCK", _retype(PROJ + ".weight", torch.bfloat16),
     "down_proj.weight' in .* is BF16; the compressed-tensors quantization_config quantizes it"),
    ("ignored fp8", "FP8_DYNAMIC", _retype("lm_head.weight", torch.float8_e4m3fn),
     "'lm_head.weight' in .* is float8_e4m3fn, but the compressed-tensors quantization_config does not quantize"),
    ("ignored scale", "FP8", lambda t: {**t, "lm_head.weight_scale": torch.ones(256, 1, dtype=torch.bfloat16)},
     "'lm_head.weight_scale' in .* is the FP8 scale of a module the compressed-tensors quantization_config does not"),
]


@pytest.mark.parametrize("what, scheme, edit, message", BAD, ids=[b[0] for b in BAD])
def test_malformed_files_name_the_tensor(qwen3_5_bf16, tmp_path, monkeypatch, what, scheme, edit, message):
    """Each refused before any weight is allocated (a scale's values: before the weights are read)."""
    folder = str(tmp_path / "ct")
    write_compressed(qwen3_5_bf16, folder, scheme, ["lm_head"], shards=1)
    path = glob.glob(os.path.join(folder, "*.safetensors"))[0]
    save_file(edit(load_file(path)), path, metadata={"format": "pt"})
    allocated = []
    monkeypatch.setattr("metrale_graph.loader._Assembler.place", lambda *a: allocated.append(a))
    with pytest.raises(ValueError, match=message):
        HybridModel.from_pretrained(folder, progress=False)
    assert not allocated


def test_config_groups_read_as_compressed_tensors_reads_them():
    """A preset's name mapped to its targets is that preset's scheme; an unset strategy follows group_size (None:
    tensor, -1: channel); block_structure as "AxB"; targets by exact name before regular expressions before the
    Linear class, and ignore over all of them; only linear layers are quantized."""
    from metrale_graph.compressed_tensors import parse_compressed_tensors

    def parse(groups, ignore=()):
        return parse_compressed_tensors({"quant_method": "compressed-tensors", "format": "float-quantized",
                                         "config_groups": groups, "ignore": list(ignore)})

    explicit = parse({"group_0": {"targets": ["Linear"], "weights": SCHEMES["FP8_DYNAMIC"][0],
                                  "input_activations": SCHEMES["FP8_DYNAMIC"][1]}})
    assert parse({"FP8_DYNAMIC": ["Linear"]}).groups == explicit.groups
    assert parse({"FP8_BLOCK": ["Linear"]}).groups[0].block == (128, 128)
    assert parse({"FP8": ["Linear"]}).groups[0].activations == "static"
    inferred = {"num_bits": 8, "type": "float"}
    assert parse({"g": {"targets": ["Linear"], "weights": inferred}}).groups[0].strategy == "tensor"
    assert parse({"g": {"targets": ["Linear"], "weights": {**inferred, "group_size": -1}}}).groups[0].block == (1, None)
    assert parse({"g": {"targets": ["Linear"], "weights": {**inferred, "strategy": "block", "block_structure": "64x32"}}
                  }).groups[0].block == (64, 32)
    ct = parse({"a": {"targets": ["Linear"], "weights": {**inferred, "strategy": "channel"}},
                "b": {"targets": ["re:.*q_proj$"], "weights": {**inferred, "strategy": "tensor"}},
                "c": {"targets": ["model.layers.3.self_attn.q_proj"], "weights": {**inferred, "strategy": "block",
                                                                                 "block_structure": [128, 128]}}},
               ignore=["re:.*mlp.gate$"])
    strategy = {m: getattr(ct.scheme_of(m), "strategy", None) for m in (
        "model.layers.3.self_attn.q_proj", "model.layers.7.self_attn.q_proj", "model.layers.3.self_attn.k_proj",
        "model.layers.0.mlp.gate")}
    assert strategy == {"model.layers.3.self_attn.q_proj": "block", "model.layers.7.self_attn.q_proj": "tensor",
                        "model.layers.3.self_attn.k_proj": "channel", "model.layers.0.mlp.gate": None}
    assert ct.scheme_of("model.embed_tokens", linear=False) is None


def test_tools_requantize_flag(tmp_path):
    """The tools' --requantize-fp8 (flags.add_model_args) reaches from_pretrained."""
    import argparse

    from metrale_graph.tools.flags import add_model_args
    from metrale_graph.tools.loading import load_model

    src, dst = str(tmp_path / "bf16"), str(tmp_path / "ct")
    transformers_model("qwen3_5_text", False).to(torch.bfloat16).save_pretrained(src)
    write_compressed(src, dst, "FP8_DYNAMIC", ["lm_head"])
    p = argparse.ArgumentParser()
    add_model_args(p)
    for flags, fp8 in (([], False), (["--requantize-fp8"], True)):
        args = p.parse_args(["--model", dst, "--device", "cpu", *flags])
        assert bool(fp8_names(load_model(args, p))) == fp8


def test_older_writers_variants(qwen3_5_bf16, tmp_path):
    """What other compressed-tensors versions write loads alike: no top-level format (each group's, or float-quantized
    8-bit float weights), zero points saved beside symmetric scales (zeros, not read)."""
    folder = str(tmp_path / "ct")
    ref = write_compressed(qwen3_5_bf16, folder, "FP8_DYNAMIC", ["lm_head"], shards=1)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    del config["quantization_config"]["format"], config["quantization_config"]["config_groups"]["group_0"]["format"]
    with open(path, "w") as f:
        json.dump(config, f)
    weights = os.path.join(folder, "model-00001-of-00001.safetensors")
    tensors = load_file(weights)
    tensors.update({k.replace("weight_scale", "weight_zero_point"): torch.zeros_like(v, dtype=torch.float8_e4m3fn)
                    for k, v in tensors.items() if k.endswith("weight_scale")})
    save_file(tensors, weights, metadata={"format": "pt"})
    expected = dict(HybridModel.from_pretrained(ref, progress=False).named_parameters())
    for name, p in HybridModel.from_pretrained(folder, progress=False).named_parameters():
        assert torch.equal(p, expected[name]), name


def test_an_mtp_head_the_config_quantizes_but_the_file_does_not(tmp_path):
    """An MTP head copied in bf16 without its ignore entry: named, with the two ways out."""
    src, dst = str(tmp_path / "bf16"), str(tmp_path / "ct")
    transformers_model("qwen3_5_text", False).to(torch.bfloat16).save_pretrained(src)
    write_compressed(src, dst, "FP8_DYNAMIC", ["lm_head"], mtp=mtp_head("qwen3_5_text"))
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"]["ignore"].remove("re:^mtp.*")
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"'mtp\..*weight' in .* is BF16; .*quantizes it.*'re:\^mtp\.\*'.*mtp=False"):
        HybridModel.from_pretrained(dst, progress=False)
    assert HybridModel.from_pretrained(dst, progress=False, mtp=False).mtp is None


@pytest.mark.parametrize("top", ["absent", "null"])
def test_quantization_config_in_a_multimodal_text_config(tmp_path, top):
    """A multimodal config.json holding the compressed-tensors section in text_config, the top level without one
    (absent, or null as a hand-edited or re-serialized file has it): the model's config reads text_config's where the
    top level's is missing or null, and the loader now reads it alike; with a null at the top the loader read none
    (dict.get's default is not taken for a key that is there) and refused the valid checkpoint, 'unexpected tensor(s)
    ... weight_scale'."""
    src, dst = str(tmp_path / "bf16"), str(tmp_path / "ct")
    transformers_model("qwen3_5_text", True).to(torch.bfloat16).save_pretrained(src)
    ref = write_compressed(src, dst, "FP8_DYNAMIC", ["lm_head", "re:model.visual.*"], shards=1)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["text_config"]["quantization_config"] = config.pop("quantization_config")
    if top == "null":
        config["quantization_config"] = None
    with open(path, "w") as f:
        json.dump(config, f)
    expected = dict(HybridModel.from_pretrained(ref, progress=False).named_parameters())
    for name, p in HybridModel.from_pretrained(dst, progress=False).named_parameters():
        assert torch.equal(p, expected[name]), name

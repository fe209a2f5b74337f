"""What a checkpoint tensor may be, for the loader (loader.py): the safetensors dtypes each kind of weight may be
stored in (`check_dtype`, from the headers, before anything is read), whether what was read is finite
(`finite`), the buffers transformers skips (`ignored`), the decoder layers a cut-down config leaves out
(`cut_layer`), what in the config contradicts the checkpoint's unexpected tensors (`contradiction`), the tensors a
sharded checkpoint's index places in shards that lack them (`listed_absent`), the sizes config.json leaves to
transformers' defaults (`unset_sizes_of`), the formats it does not load (`packed_format`, `per_tensor_fp8`)."""

from __future__ import annotations

import json
import os
import re

import torch

from .config import FULL, LINEAR, ModelConfig
from .config_checks import unset_sizes
from .families import FAMILIES
from .spec import FP8_DTYPE, SCALE, WeightSpec
from .weights import INDEX_FILE, WEIGHTS_FILE

# safetensors' names of the real floating-point dtypes a weight may be stored in; any other (integers,
# bool, complex, float4, the exponent-only float8 scale format) is refused, not converted
REAL_FLOAT = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}
_SAFETENSORS_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
                       "U32": "uint32", "I64": "int64", "U64": "uint64", "C64": "complex64", "F4": "float4_e2m1fn_x2",
                       "F8_E8M0": "float8_e8m0fnu"}


def check_dtype(key: str, path: str, stored: str, spec: WeightSpec, cfg: ModelConfig) -> None:
    """ValueError naming the tensor unless safetensors dtype `stored` is what `spec` is stored in: FP8
    weights float8_e4m3fn, their scales fp32 / bf16 / fp16, the rest real floating point (in an FP8 checkpoint
    not float8_e4m3fn: such a tensor is a quantized weight the quantization_config does not convert)."""
    if spec.fp8:
        if stored != "F8_E4M3":
            raise ValueError(f"tensor {key!r} in {path} is {dtype_name(stored)}; the quantization_config "
                             "converts it, so it must be float8_e4m3fn with a weight_scale_inv beside it (list "
                             "its module in modules_to_not_convert to load it in floating point)")
    elif spec.kind == SCALE:
        if stored not in ("F32", "BF16", "F16"):
            raise ValueError(f"tensor {key!r} in {path} is {dtype_name(stored)}; FP8 block scales "
                             "(weight_scale_inv) must be float16, float32 or bfloat16")
    elif stored not in REAL_FLOAT:
        raise ValueError(f"tensor {key!r} in {path} is {dtype_name(stored)}; expected "
                         "floating-point weights (quantized checkpoints are not supported)")
    elif stored == "F8_E4M3" and cfg.quantization is None and spec.quantizable:
        raise ValueError(f"tensor {key!r} in {path} is float8_e4m3fn, but config.json has no quantization_config: "
                         "an FP8 projection is codes to be multiplied by its block scales (weight_scale_inv), "
                         "and the checkpoint declares its format there (quant_method 'fp8', fmt 'e4m3', "
                         "weight_block_size [128, 128]); without them its values are not the weights")
    elif stored == "F8_E4M3" and cfg.quantization is not None:
        why = ("kept in floating point: the quantization_config does not convert it (modules_to_not_convert)"
               if spec.quantizable else "one metrale-graph keeps in floating point (not an FP8 projection)")
        raise ValueError(f"tensor {key!r} in {path} is float8_e4m3fn, but it is {why}; an FP8 checkpoint "
                         "stores such tensors in bf16 / fp16 / fp32")


def ignored(key: str) -> bool:
    """Whether checkpoint tensor `key` is one transformers skips by name for every model, unread and unmentioned: the RoPE
    frequencies (`rotary_emb.inv_freq`), a buffer that older saves wrote beside the weights, at the model or in each
    attention layer, and which the model computes from its config."""
    return "rotary_emb.inv_freq" in key


_LAYER = re.compile(r"layers\.(\d+)\.")


def cut_layer(name: str, cfg: ModelConfig) -> int | None:
    """The index of the decoder layer that our name `name` (loader.our_name's: text prefix stripped, the MTP head's
    under `mtp.`) belongs to when the config holds fewer layers (index >= num_hidden_layers: a model cut down by
    editing config.json, whose later layers transformers skips with a warning), else None."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m and int(m.group(1)) >= cfg.num_hidden_layers else None


_PART = re.compile(r"layers\.(\d+)\.(linear_attn|self_attn|mlp)\.(.+)")
_MIXERS = {"linear_attn": LINEAR, "self_attn": FULL}


def contradiction(names, cfg: ModelConfig) -> str:
    """What the loader's unexpected-tensors error adds where the config contradicts what the checkpoint's unexpected
    tensors (our names, loader.our_name's) say of a main decoder layer: its mixer (layer_types), its feed-forward half
    (a MoE block or a dense MLP: num_experts, decoder_sparse_step, mlp_only_layers), or the family's GDN layout (the
    projections fused or apart: model_type); '' where they say nothing of the config."""
    found: dict[str, list[int]] = {}  # what the config contradicts -> the layers where it does
    fused = {f.name.split(".")[-2]: fam for fam in FAMILIES.values() for f in fam.fusions}  # in_proj_qkvz -> its family
    own = {m.split(".")[-2] for f in cfg.family.fusions for m in f.members}  # in_proj_qkv, ... fused in cfg's family
    moe = set(cfg.moe_layers)
    for name in names:
        m = _PART.fullmatch(name or "")
        if m is None or int(m[1]) >= cfg.num_hidden_layers:
            continue
        i, part, module = int(m[1]), m[2], m[3].split(".")[0]
        if part in _MIXERS and cfg.layer_types[i] != _MIXERS[part]:
            what = f"layer_types makes layer(s) {{}} {cfg.layer_types[i]!r} where the checkpoint holds {part}.* " \
                   f"({_MIXERS[part]!r} layers)"
        elif part == "linear_attn" and module in fused:
            what = (f"the checkpoint holds linear_attn.in_proj_qkvz and in_proj_ba, fused as {fused[module].model_type!r} "
                    f"checkpoints store them; the config's model_type is {cfg.model_type!r} (layers {{}})")
        elif part == "linear_attn" and module in own:
            what = (f"model_type {cfg.model_type!r} checkpoints fuse linear_attn.in_proj_qkv with in_proj_z (in_proj_qkvz) "
                    "and in_proj_b with in_proj_a (in_proj_ba); this one holds them apart, as another family's do "
                    "(layers {})")
        elif part == "mlp" and module in ("experts", "gate", "shared_expert", "shared_expert_gate") and i not in moe:
            why = (f"model_type {cfg.model_type!r} has no MoE blocks" if "num_experts" not in cfg.family.fields else
                   "num_experts 0" if cfg.num_experts == 0 else f"mlp_only_layers {list(cfg.mlp_only_layers)}"
                   if i in cfg.mlp_only_layers else f"decoder_sparse_step {cfg.decoder_sparse_step}")
            what = f"the config gives layer(s) {{}} a dense MLP ({why}) where the checkpoint holds a MoE block (mlp.experts.*)"
        elif part == "mlp" and module in ("gate_proj", "up_proj", "down_proj") and i in moe:
            what = "the config gives layer(s) {} a MoE block where the checkpoint holds a dense MLP (mlp.gate_proj.*)"
        else:
            continue
        if i not in (layers := found.setdefault(what, [])):
            layers.append(i)
    return ("; the config contradicts the checkpoint: " + "; ".join(
        what.format(", ".join(map(str, sorted(layers)))) for what, layers in found.items())) if found else ""


def listed_absent(files: list[str], missing: list[str], our_name) -> str:
    """Where the checkpoint's `files` are the shards of its index (weights.checkpoint_files) and its weight_map maps
    tensors of `missing` (our names; `our_name`: loader.our_name) to shards that do not hold them (a shard cut, or
    one of another save), what the loader's error adds: each such tensor and its shard; else ''."""
    index = os.path.join(os.path.dirname(files[0]), INDEX_FILE) if files else ""
    if not files or os.path.basename(files[0]) == WEIGHTS_FILE or not os.path.isfile(index):
        return ""
    with open(index) as f:  # checkpoint_files has read and checked it
        weight_map = json.load(f)["weight_map"]
    absent = set(missing)
    listed = [f"{k!r} to {v}" for k, v in weight_map.items() if our_name(k) in absent]
    return (f"; {INDEX_FILE} maps {len(listed)} of them to shards that do not hold them: {', '.join(listed[:5])} "
            "(a shard cut short, or from another save)") if listed else ""


def unset_sizes_of(folder: str | None, cfg: ModelConfig) -> str:
    """What the loader's errors of a checkpoint's tensors add where the folder's config.json sets none of some fields
    that size the weights and `cfg` holds the defaults transformers takes for them (config_checks.unset_sizes)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            raw = json.load(f)
    except (TypeError, OSError, ValueError, RecursionError):  # no folder, no file (a config given apart), not JSON
        return ""
    return unset_sizes(raw, cfg.family, cfg) if isinstance(raw, dict) else ""


def dtype_name(stored: str) -> str:
    """A safetensors dtype name as torch's (torch.int8), or as safetensors writes it when torch has no name."""
    name = _SAFETENSORS_DTYPES.get(stored)
    return f"torch.{name}" if name and hasattr(torch, name) else stored


def finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in t (NaN propagates through min / max; one pass, no temporary). float8_e4m3fn
    (no infinity): no NaN code (0x7F / 0xFF)."""
    if t.dtype == FP8_DTYPE:
        return not bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())
    if t.dtype.itemsize == 1:  # other 8-bit floats: compared in fp16
        t = t.half()
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


# key endings that only quantized formats metrale-graph does not load write (the weights packed into integers, their
# scales and zero points), for a checkpoint whose config.json does not say so: by format
_PACKED = {".qweight": "GPTQ / AWQ (int4 weights packed into int32: qweight, qzeros, scales)",
           ".qzeros": "GPTQ / AWQ (int4 weights packed into int32: qweight, qzeros, scales)",
           ".g_idx": "GPTQ (int4 weights packed into int32: qweight, qzeros, scales, g_idx)",
           ".absmax": "bitsandbytes 4-bit (weight.absmax, weight.quant_map, weight.quant_state)",
           ".quant_map": "bitsandbytes 4-bit (weight.absmax, weight.quant_map, weight.quant_state)",
           ".SCB": "bitsandbytes 8-bit (int8 weights with SCB scales)",
           ".biases": "MLX (weights packed into uint32 with scales and biases)",
           ".weight_packed": "compressed-tensors pack-quantized (int weights packed into int32)"}


def packed_format(keys) -> tuple[str, str] | None:
    """(the format, a key of it) where checkpoint tensor `keys` hold the packed weights of a quantized format
    metrale-graph does not load (GPTQ, AWQ, bitsandbytes, MLX, compressed-tensors' packed ints), else None."""
    for key in keys:
        if ".quant_state.bitsandbytes__" in key:
            return _PACKED[".absmax"], key
        for ending, what in _PACKED.items():
            if key.endswith(ending):
                return what, key
    return None


def per_tensor_fp8(keys, cfg: ModelConfig, path: str) -> ValueError | None:
    """The error for a checkpoint in per-tensor FP8 (AutoFP8's and vLLM's 'fp8' format: quant_method 'fp8' without
    weight_block_size, one scalar `weight_scale`, and `input_scale` for static activations, per weight) read under a
    fine-grained FP8 config, which reads 128 x 128 block scales named `weight_scale_inv`; None for other keys.
    (compressed-tensors' `weight_scale` is read by its own reader, loader_compressed.py.)"""
    if cfg.quantization is None or cfg.quantization.compressed is not None:
        return None
    found = [k for k in keys if k.endswith((".weight_scale", ".input_scale"))]
    if not found:
        return None
    return ValueError(f"checkpoint holds per-tensor FP8 scales (e.g. {found[0]!r} in {path}): AutoFP8's and vLLM's "
                      "per-tensor 'fp8' format (a quantization_config without weight_block_size), which metrale-graph "
                      "does not load. It loads fine-grained FP8, each weight with 128 x 128 block scales "
                      "(weight_scale_inv, as Qwen's FP8 releases), and compressed-tensors FP8: load the model's "
                      "floating-point checkpoint, or quantize it with metrale-quantize or llm-compressor")

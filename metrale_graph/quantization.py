"""FP8 checkpoints: the `quantization_config` of a config.json in Qwen's fine-grained FP8 format
(transformers' FineGrainedFP8), read and written, and the rule that says which modules it converts.

The format: `{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128], "modules_to_not_convert": [...]}` at the top of config.json or in a
multimodal wrapper's `text_config`. A converted linear weight [N, K] is stored float8_e4m3fn with its
`<module>.weight_scale_inv` [ceil(N / 128), ceil(K / 128)] (fp32 or bf16) beside it, w ~= w_fp8 * scale
per 128 x 128 block (ops/fp8/quant.py); activations are quantized on the fly per token per 128
channels ("dynamic"). Which weights may be converted is the weight spec's (spec.py: projections and
experts, except the router, the shared-expert gate and lm_head); which of those are converted is
`modules_to_not_convert`, matched as transformers' `should_convert_module` matches it against its
module names (`model.layers.0.linear_attn.in_proj_a`; `model.language_model.` in the multimodal
wrappers; `lm_head`; the MTP head's as its checkpoints name it, `mtp.fc`, `mtp.layers.0.self_attn.q_proj`),
a pattern being a regular expression matched at the start, or a suffix. compressed-tensors' FP8 checkpoints
(llm-compressor's) are read by compressed_tensors.py into an Fp8Config whose `compressed` rule says the same.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FP8_METHOD = "fp8"
FP8_BLOCK = 128  # the only weight_block_size supported, both ways
SCALE_SUFFIX = "_scale_inv"  # `<module>.weight` -> `<module>.weight_scale_inv`; experts: `gate_up_proj_scale_inv`
TEXT_PREFIX = "model."  # module names of a text-only causal LM (and of the checkpoints save_pretrained writes)
MTP_PREFIX = "mtp."  # the multi-token-prediction head's tensors, in our names and in checkpoints (spec.mtp_block)
# what Qwen's FP8 releases keep in floating point among the modules transformers would convert (the
# GDN gates' projections; the router, the shared-expert gate and lm_head are never converted here)
QWEN_KEPT = ("in_proj_a", "in_proj_b", "in_proj_ba")


@dataclass(frozen=True)
class Fp8Config:
    """A checkpoint's FP8 quantization_config, checked. `modules_to_not_convert`: transformers' patterns
    (None: the config lists none; then every convertible module is converted); `prefix`: how the
    checkpoint names the text model's modules (`model.`, or the multimodal wrapper's text prefix), the
    names the patterns were written against. `compressed`: a compressed-tensors checkpoint's config
    (compressed_tensors.CompressedTensors), which then says which modules are converted: those its files store
    as FP8 that 128 x 128 blocks hold (or any, when it requantizes)."""
    modules_to_not_convert: tuple[str, ...] | None = None
    prefix: str = TEXT_PREFIX
    compressed: object | None = None

    def converts(self, module: str, leaves: tuple[str, ...] = ()) -> bool:
        """Whether a module (our name: `layers.0.mlp.gate_proj`, `layers.3.mlp.experts`, `lm_head`) is
        converted: transformers' should_convert_module over its full name; with `compressed`, its rule over the
        module's checkpoint linears (`leaves` under it: an experts module's `3.gate_proj`, ...)."""
        full = checkpoint_module(module, self.prefix)
        if self.compressed is not None:
            return self.compressed.converts(full, leaves)
        if self.modules_to_not_convert is None:
            return True
        return not any(re.match(f"{p}\\.", full) or re.match(p, full) or full.endswith(p)
                       for p in self.modules_to_not_convert)

    def to_hf(self, modules_to_not_convert: list[str] | None = None) -> dict:
        """config.json's quantization_config; `modules_to_not_convert` replaces the patterns (the saver
        writes the modules it keeps in floating point, by their names in a text checkpoint)."""
        if modules_to_not_convert is None and self.compressed is not None:
            return self.compressed.to_hf()  # the checkpoint's own (compressed-tensors) section
        patterns = modules_to_not_convert if modules_to_not_convert is not None else self.modules_to_not_convert
        return {"quant_method": FP8_METHOD, "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
                "modules_to_not_convert": None if patterns is None else list(patterns)}


def checkpoint_module(module: str, prefix: str = TEXT_PREFIX) -> str:
    """A module's name in a checkpoint whose text modules start with `prefix`: `lm_head` and the MTP head's
    (`mtp.`) as they are, the others prefixed."""
    return module if module == "lm_head" or module.startswith(MTP_PREFIX) else prefix + module


def scale_name(weight: str) -> str:
    """The name of a weight's block scales: `x.weight` -> `x.weight_scale_inv`, `x.gate_up_proj` ->
    `x.gate_up_proj_scale_inv` (transformers' names, in memory and in checkpoints)."""
    return weight + SCALE_SUFFIX


def parse_quantization(raw, where: str = "", prefix: str = TEXT_PREFIX, field: str = "quantization_config"
                       ) -> Fp8Config:
    """A config.json's quantization_config -> Fp8Config. ValueError naming the field for anything else
    than fine-grained e4m3 FP8 with [128, 128] weight blocks and dynamic activations: another
    quant_method, fmt or scale_fmt, a block size, a static activation scheme (per-tensor input scales),
    converted embeddings, a modules_to_not_convert that is not a list of strings (regular expressions)."""
    def bad(msg):
        return ValueError(f"invalid model config{where}: {msg}")

    if not isinstance(raw, dict):
        raise bad(f"field {field!r} must be an object, got {raw!r}")
    method, what = raw.get("quant_method"), f"quant_method {raw.get('quant_method')!r}"
    legacy = [flag for flag in ("load_in_4bit", "load_in_8bit") if raw.get(flag)]
    if legacy:  # bitsandbytes' older configs name no quant_method; transformers reads the flags first, as bitsandbytes
        method = "bitsandbytes"
        what = f"{legacy[0]} true: bitsandbytes' {legacy[0][8]}-bit weights, quant_method 'bitsandbytes'"
    if method != FP8_METHOD:
        raise bad(f"a quantized checkpoint ({field} with {what}) is not supported: metrale-graph "
                  "loads floating-point weights, fine-grained FP8 ('fp8', as Qwen's FP8 releases: float8_e4m3fn "
                  "weights with 128 x 128 block weight_scale_inv) and compressed-tensors FP8 ('compressed-tensors', "
                  "llm-compressor's float-quantized FP8 schemes). Load the model's floating-point checkpoint, or its "
                  "FP8 one in Qwen's format (metrale-quantize writes one from a floating-point checkpoint)")
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise bad(f"field '{field}.fmt' is {fmt!r}: only 'e4m3' (float8_e4m3fn weights) is supported")
    scheme = raw.get("activation_scheme", "dynamic")
    if isinstance(scheme, str) and scheme.lower() == "static":
        raise bad(f"field '{field}.activation_scheme' is 'static' (activations scaled by per-tensor input scales "
                  "stored in the checkpoint): only 'dynamic' (activations quantized per token per 128 channels) "
                  "is supported")
    if not (isinstance(scheme, str) and scheme.lower() == "dynamic"):
        raise bad(f"field '{field}.activation_scheme' must be 'dynamic', got {scheme!r}")
    block = raw.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
    if not (isinstance(block, (list, tuple)) and list(block) == [FP8_BLOCK, FP8_BLOCK]
            and not any(isinstance(b, bool) for b in block)):
        raise bad(f"field '{field}.weight_block_size' is {block!r}: only [128, 128] blocks are supported")
    scale_fmt = raw.get("scale_fmt", "float")
    if scale_fmt != "float":
        raise bad(f"field '{field}.scale_fmt' is {scale_fmt!r}: only 'float' (fp32 / bf16 weight_scale_inv) "
                  "is supported")
    if raw.get("modules_to_convert"):
        raise bad(f"field '{field}.modules_to_convert' is {raw['modules_to_convert']!r}: FP8 embeddings are not "
                  "supported")
    name = "modules_to_not_convert"
    patterns = raw.get(name)
    if patterns is None and "ignored_layers" in raw:  # transformers' alias
        name, patterns = "ignored_layers", raw["ignored_layers"]
    if patterns is not None:
        if not (isinstance(patterns, (list, tuple)) and all(isinstance(p, str) for p in patterns)):
            raise bad(f"field '{field}.{name}' must be a list of module names (strings), got {patterns!r}")
        for p in patterns:
            try:
                re.compile(p)
            except re.error as e:
                raise bad(f"field '{field}.{name}' holds {p!r}, not a regular expression ({e})") from None
        patterns = tuple(patterns)
    return Fp8Config(patterns, prefix)

"""compressed-tensors FP8 checkpoints (llm-compressor's `float-quantized` / `naive-quantized` formats): their
`quantization_config` read and checked (`parse_compressed_tensors`), which checkpoint modules it stores as FP8 and
with which scales (`CompressedTensors.scheme_of`), and what the model holds in memory (`memory_config`).

The format (compressed-tensors' QuantizationConfig, as `ModelCompressor.update_config` writes it into config.json):
`{"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {"targets":
["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": ..., "symmetric": true, "dynamic": false, ...},
"input_activations": {...} | null, "output_activations": null}}, "ignore": [...], "kv_cache_scheme": null,
"quantization_status": "compressed", "sparsity_config": {}, "transform_config": {}, "version": ...}`; a group may
also be a preset's name mapped to its targets (`"FP8_DYNAMIC": ["Linear"]`). A module is quantized by the group
one of whose `targets` matches it (a name matches exactly; `re:<regex>` by `re.match` on the name; a class name,
`Linear`, every linear layer; exact names before regular expressions before classes), unless an `ignore` entry
matches it alike. Names are the checkpoint's (`model.layers.0.mlp.down_proj`, `model.language_model.layers...` in
the multimodal wrappers, `lm_head`, `mtp.layers.0...`; experts one linear each: `...mlp.experts.3.gate_proj`). The
class target alone leaves a MoE layer's experts ambiguous: llm-compressor stores them FP8 (it splits transformers'
fused experts module into linears), compressed-tensors on transformers' model leaves them in floating point (that
module is no nn.Linear): experts the files store in floating point without scales are `floating`, not quantized.

A quantized module stores `<module>.weight` float8_e4m3fn [N, K] and `<module>.weight_scale` in the model's dtype
(bf16 / fp16 / fp32) with w ~= weight * weight_scale: the same meaning as Qwen's `weight_scale_inv` (a block's
amax / 448; compressed-tensors' dequantize multiplies the codes by it). By the weights' `strategy`: `tensor`, one
scale ([1]); `channel`, one per output row ([N, 1]); `group`, one per row and `group_size` columns
([N, ceil(K / g)]); `block`, one per `block_structure` block ([ceil(N / b0), ceil(K / b1)]). Static input
activations add `<module>.input_scale` ([1]); a `kv_cache_scheme` adds `self_attn.k_scale` / `v_scale`.

In memory (module docstring of quantization.py for our FP8): `block` [128, 128] is our 128 x 128 block FP8 as it
is (weight_scale read as weight_scale_inv). Other scales are dequantized to the model's dtype at load (codes *
scale in fp32, rounded once), or with `requantize` (from_pretrained's `requantize_fp8`) held as 128 x 128-block FP8:
`tensor` ones exactly (the codes as stored, the one scale in every block of the grid), the others (`channel`,
`group`, other blocks: not any 128 x 128 grid's) requantized, a second rounding of every weight. Activations are
always quantized as our FP8 projections quantize them: dynamically, per token per 128 channels; a checkpoint's
static per-tensor input scales are not used (docs/fp8.md says what that changes).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace

from .quantization import FP8_BLOCK, TEXT_PREFIX, Fp8Config

CT_METHOD = "compressed-tensors"
FP8_FORMATS = ("float-quantized", "naive-quantized")  # FP8 weights with / without activation quantization
STRATEGIES = ("tensor", "channel", "group", "block")  # of FP8 weights this loader reads
LINEAR = "Linear"  # the class target every module this loader asks about (a linear layer's weight) matches
_ARGS = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False, "strategy": None}  # compressed-tensors'
# what other formats and schemes hold, for the refusals
_OTHER_FORMATS = {"pack-quantized": "int4 / int8 weights packed into int32", "int-quantized": "int8 weights",
                  "nvfp4-pack-quantized": "NVFP4 (4-bit float) weights", "mxfp4-pack-quantized": "MXFP4 weights",
                  "mxfp8-quantized": "MXFP8 weights (e8m0 group scales)", "marlin-24": "2:4-sparse int4 weights",
                  "sparse-24-bitmask": "2:4-sparse weights", "sparse-bitmask": "sparse weights",
                  "dense": "unquantized weights and the scales to quantize them at run time"}
_PRESETS = {  # compressed-tensors' FP8 presets, as a group named after one holds them
    "FP8": ({"type": "float", "strategy": "tensor"}, {"type": "float", "strategy": "tensor", "dynamic": False}),
    "FP8_DYNAMIC": ({"type": "float", "strategy": "channel"}, {"type": "float", "strategy": "token", "dynamic": True}),
    "FP8_BLOCK": ({"type": "float", "strategy": "block", "block_structure": [128, 128]},
                  {"type": "float", "strategy": "group", "group_size": 128, "dynamic": True}),
}


@dataclass(frozen=True)
class Scheme:
    """One config group's FP8 weights, checked: its targets, scale strategy and scale block (rows, columns;
    columns None: the whole row), and its input activations ("none", "dynamic" or "static")."""
    targets: tuple[str, ...]
    strategy: str
    block: tuple[int, int | None] | None
    activations: str

    @property
    def native(self) -> bool:
        """Whether these are our 128 x 128-block FP8 weights as they are (block [128, 128] scales)."""
        return self.block == (FP8_BLOCK, FP8_BLOCK)

    @property
    def exact(self) -> bool:
        """Whether 128 x 128-block FP8 holds these weights exactly (the codes as stored, each block a scale): block
        [128, 128] scales, or a tensor's one scale in every block."""
        return self.strategy == "tensor" or self.native

    def scale_shape(self, rows: int, cols: int) -> tuple[int, ...] | None:
        """The weight_scale shape of a weight [rows, cols]; None for `tensor` (one scale: [1], [] or [1, 1])."""
        if self.strategy == "tensor":
            return None
        br, bc = self.block
        return -(-rows // br), 1 if bc is None else -(-cols // bc)


@dataclass(frozen=True)
class CompressedTensors:
    """A checkpoint's compressed-tensors FP8 quantization_config (module docstring), checked. `prefix`: how the
    checkpoint names its text modules; `requantize`: whether weights whose scales are not 128 x 128 blocks
    are requantized to them in memory (else dequantized); `kv_cache`: a kv_cache_scheme (its scales unused);
    `raw`: the config as config.json holds it (JSON), what to_hf gives back."""
    groups: tuple[Scheme, ...]
    ignore: tuple[str, ...]
    prefix: str = TEXT_PREFIX
    requantize: bool = False
    kv_cache: bool = False
    raw: str = "{}"
    floating: tuple[str, ...] = ()  # MoE expert linears the class target names, stored in floating point (floats)

    def scheme_of(self, module: str, linear: bool = True) -> Scheme | None:
        """The scheme of a checkpoint module (its name in the checkpoint), None when not quantized: not a linear
        layer (compressed-tensors quantizes those), no group targets it, or the ignore list names it. The first of
        its matching targets by compressed-tensors' order: exact names, then regular expressions, then the class."""
        if not linear or module in self.floating or any(_matches(module, t) for t in self.ignore):
            return None
        found = [((t == LINEAR, t.startswith("re:"), t), i) for i, s in enumerate(self.groups) for t in s.targets
                 if _matches(module, t)]
        return self.groups[min(found)[1]] if found else None

    def floats(self, module: str, stored: str, scaled: bool) -> bool:
        """Whether checkpoint module `module`, a MoE expert's linear stored as safetensors dtype `stored` (`scaled`:
        with a weight_scale beside it), is one the quantization left in floating point: no FP8 and no scale, where
        only the class target `Linear` names it. transformers (5) builds a layer's experts as one module that is no
        nn.Linear, so compressed-tensors quantizing that model leaves them as they are (and its ignore list, the
        Linear modules it skipped, names none of them); llm-compressor splits them into Linear modules first and
        stores each FP8. Only the files tell which: those found so are `floating` (weights.compressed_format)."""
        if scaled or stored == "F8_E4M3" or self.scheme_of(module) is None:
            return False
        return not any(_matches(module, t) for s in self.groups for t in s.targets if t != LINEAR)

    def converts(self, module: str, leaves: tuple[str, ...] = ()) -> bool:
        """Whether our weight of checkpoint module `module` (with `leaves`: the linears under it that hold it, an
        experts module's `3.gate_proj`) is FP8 in memory: every one of them stored FP8, with 128 x 128-block
        scales, or any FP8 scales when requantizing."""
        names = [f"{module}.{leaf}" for leaf in leaves] if leaves else [module]
        schemes = [self.scheme_of(n) for n in names]
        return all(s is not None and (s.native or self.requantize) for s in schemes)

    def memory_config(self, requantize: bool = False) -> Fp8Config | None:
        """The Fp8Config of the model this checkpoint loads into (None: no weight is FP8 in memory, every FP8
        weight of the file dequantized). Which modules it converts is this config's (converts)."""
        source = replace(self, requantize=requantize)
        if not any(s.native or requantize for s in self.groups):
            return None
        return Fp8Config(None, self.prefix, compressed=source)

    def to_hf(self) -> dict:
        return json.loads(self.raw)


def _matches(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target == LINEAR


def parse_compressed_tensors(raw, where: str = "", prefix: str = TEXT_PREFIX,
                             field: str = "quantization_config") -> CompressedTensors:
    """A config.json's compressed-tensors quantization_config -> CompressedTensors. ValueError naming the field
    and what is supported for anything but 8-bit float weights (symmetric, static scales; tensor, channel, group
    or block strategy) and 8-bit float or no input activations: int / int4 / NVFP4 / MXFP formats, sparsity,
    transforms (rotations), output activations, asymmetric or dynamic weights, activation-ordered groups."""
    def bad(msg):
        return ValueError(f"invalid model config{where}: {msg}")

    def other(what):
        return bad(f"a quantized checkpoint ({field} with quant_method {CT_METHOD!r}, {what}) is not supported: "
                   "metrale-graph loads floating-point weights, fine-grained FP8 ('fp8', as Qwen's FP8 releases) and "
                   f"compressed-tensors FP8 ({' / '.join(FP8_FORMATS)}: 8-bit float weights with tensor, channel, group "
                   "or block scales). Load the model's floating-point checkpoint, or its FP8 one in Qwen's format or "
                   "llm-compressor's FP8 schemes (FP8, FP8_DYNAMIC, FP8_BLOCK)")

    if not isinstance(raw, dict):
        raise bad(f"field {field!r} must be an object, got {raw!r}")
    fmt = raw.get("format")  # None: each group's own, or what its weights are (as compressed-tensors infers it)
    if fmt is not None and (fmt in _OTHER_FORMATS or (fmt not in FP8_FORMATS and fmt != "mixed-precision")):
        raise other(f"format {fmt!r}" + (f": {_OTHER_FORMATS[fmt]}" if fmt in _OTHER_FORMATS else ""))
    for name in ("sparsity_config", "transform_config"):
        if raw.get(name):
            raise other(f"a {name} ({'sparse weights' if name[0] == 's' else 'weights rotated by transforms'})")
    groups = raw.get("config_groups")
    if not (isinstance(groups, dict) and groups):
        raise bad(f"field '{field}.config_groups' must be an object of quantization schemes, got {groups!r}")
    schemes = tuple(_scheme(name, g, f"{field}.config_groups.{name}", fmt, bad, other) for name, g in groups.items())
    ignore = raw.get("ignore") or []
    if not (isinstance(ignore, list) and all(isinstance(p, str) for p in ignore)):
        raise bad(f"field '{field}.ignore' must be a list of module names (strings), got {ignore!r}")
    for p in [*ignore, *(t for s in schemes for t in s.targets)]:
        try:
            re.compile(p[3:]) if p.startswith("re:") else None
        except re.error as e:
            raise bad(f"field {field!r} holds {p!r}, not a regular expression ({e})") from None
    kv = raw.get("kv_cache_scheme")
    if kv is not None and not isinstance(kv, dict):
        raise bad(f"field '{field}.kv_cache_scheme' must be an object or null, got {kv!r}")
    return CompressedTensors(schemes, tuple(ignore), prefix, kv_cache=kv is not None,
                             raw=json.dumps(raw, sort_keys=True))


def _scheme(name: str, group, field: str, fmt: str, bad, other) -> Scheme:
    """One config group -> Scheme (parse_compressed_tensors)."""
    if isinstance(group, list):  # a preset's name mapped to its targets
        if name.upper() not in _PRESETS:
            raise other(f"the preset scheme {name!r} (FP8 presets: {', '.join(_PRESETS)})")
        weights, inputs = _PRESETS[name.upper()]
        group = {"targets": group, "weights": {**weights, "num_bits": 8}, "input_activations": {**inputs, "num_bits": 8}}
    if not isinstance(group, dict):
        raise bad(f"field {field!r} must be a quantization scheme (an object) or a preset's targets, got {group!r}")
    targets = group.get("targets")
    if not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
        raise bad(f"field '{field}.targets' must be a list of module names or classes, got {targets!r}")
    group_fmt = group.get("format") or (FP8_FORMATS[0] if fmt in (None, "mixed-precision") else fmt)
    if group_fmt not in FP8_FORMATS:
        raise other(f"{field}.format {group_fmt!r}" + (f": {_OTHER_FORMATS[group_fmt]}" if group_fmt in _OTHER_FORMATS
                                                       else ""))
    if group.get("output_activations") is not None:
        raise other(f"{field}.output_activations (quantized outputs)")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise other(f"{field}.weights {w!r}: no quantized weights")
    w = {**_ARGS, **{k: v for k, v in w.items() if v is not None}}
    if (w["num_bits"], str(w["type"]).lower()) != (8, "float"):
        raise other(f"{field}.weights of {w['num_bits']}-bit {w['type']}")
    if w["symmetric"] is not True or w["dynamic"] is not False:
        raise other(f"{field}.weights " + ("asymmetric (zero points)" if w["symmetric"] is not True
                                           else f"with dynamic {w['dynamic']!r} scales"))
    if w.get("actorder") in (True, "group", "dynamic"):
        raise other(f"{field}.weights actorder {w['actorder']!r} (columns permuted by weight_g_idx)")
    strategy = w["strategy"] or ("tensor" if w.get("group_size") is None else "channel" if w["group_size"] == -1
                                 else "group")
    block = _block(strategy, w, f"{field}.weights", bad, other)
    return Scheme(tuple(targets), strategy, block, _activations(group.get("input_activations"), field, other))


def _block(strategy, w: dict, field: str, bad, other) -> tuple[int, int | None] | None:
    """The scale block of FP8 weights (Scheme.block) from their strategy and its size field."""
    if strategy not in STRATEGIES:
        raise other(f"{field}.strategy {strategy!r} (FP8 weights: {', '.join(STRATEGIES)})")
    if strategy == "tensor":
        return None
    if strategy == "channel":
        return 1, None
    size = w.get("group_size") if strategy == "group" else w.get("block_structure")
    if strategy == "block" and isinstance(size, str):  # compressed-tensors reads "128x128" too
        size = [int(x) if x.isdigit() else x for x in size.split("x")]
    sizes = [1, size] if strategy == "group" else size
    if not (isinstance(sizes, list) and len(sizes) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes)):
        what = "group_size" if strategy == "group" else "block_structure"
        raise bad(f"field '{field}.{what}' must be " + ("a positive integer" if strategy == "group" else
                                                        "[rows, columns] (positive integers)") + f", got {size!r}")
    return sizes[0], sizes[1]


def _activations(args, field: str, other) -> str:
    """A group's input activations: "none", or 8-bit float ones "dynamic" or "static" (per-tensor input_scale)."""
    if args is None:
        return "none"
    if not isinstance(args, dict):
        raise other(f"{field}.input_activations {args!r}")
    a = {**_ARGS, **{k: v for k, v in args.items() if v is not None}}
    if (a["num_bits"], str(a["type"]).lower()) != (8, "float"):
        raise other(f"{field}.input_activations of {a['num_bits']}-bit {a['type']}")
    if a["dynamic"] is True:
        return "dynamic"
    if a["dynamic"] is False and (a["strategy"] or "tensor") == "tensor" and a["symmetric"] is True:
        return "static"
    raise other(f"{field}.input_activations {a['strategy']!r} with dynamic {a['dynamic']!r}"
                + ("" if a["symmetric"] is True else ", asymmetric"))


def is_compressed_tensors(raw) -> bool:
    """Whether a quantization_config section is compressed-tensors'."""
    return isinstance(raw, dict) and raw.get("quant_method") == CT_METHOD


def checkpoint_format(folder: str) -> CompressedTensors | None:
    """The compressed-tensors quantization_config of a checkpoint folder's config.json (at the top, or in a
    multimodal wrapper's text_config), checked; None when it has none (or no config.json). How the loader reads
    the files' FP8 tensors; config.py has read the same section into the model's config."""
    from .families import MULTIMODAL

    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        raw = json.load(f)
    wrapper = MULTIMODAL.get(raw.get("model_type"))
    quant = raw.get("quantization_config")
    if quant is None and wrapper and isinstance(raw.get("text_config"), dict):  # read as config.from_hf reads it
        quant = raw["text_config"].get("quantization_config")
    if not is_compressed_tensors(quant):
        return None
    return parse_compressed_tensors(quant, f" {path}", wrapper[1].text_prefix if wrapper else TEXT_PREFIX)

"""FP8 weights in memory (spec.py's `fp8` weights and their SCALE specs): quantizing a floating-point
model's weights into an FP8 config's (the quantizer tool, the FP8 presets), dequantizing them back (the
transformers oracle, weight-only checks), and the explicit `modules_to_not_convert` a saved FP8
checkpoint carries.

Quantization is transformers' Fp8Quantize rule per 128 x 128 block (ops/fp8/quant.py's
quantize_weight_blocks; ragged last blocks included); stacked experts are quantized a few at a time so
a large preset's transient fp32 copies stay small.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig
from .ops.fp8.quant import FP8_MAX, dequantize_weight_blocks, quantize_weight_blocks
from .quantization import Fp8Config, checkpoint_module, scale_name
from .spec import EXPERTS, model_spec

EXPERTS_AT_ONCE = 16  # stacked experts quantized per call (transient fp32 copies of that many experts)


def scale_problem(scales: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Why block scales (weight_scale_inv, fp32 or bf16) cannot serve a model computing in `dtype`, or None.
    Each scale must be finite, positive and normal (a zero or negative scale zeroes or flips its block's
    weights, a subnormal one drops their bits), and the largest e4m3 code, 448, times it must be finite in
    `dtype` (else the block's weights are infinite there). One pass over the scales, none over the codes:
    448 bounds every block's codes, and is every block's largest code in a checkpoint quantized as
    transformers' Fp8Quantize quantizes (amax to 448)."""
    if scales.numel() == 0:
        return None
    lo, hi = (v.item() for v in torch.aminmax(scales.float()))  # NaN anywhere: both NaN
    normal, largest = torch.finfo(torch.float32).tiny, torch.finfo(dtype).max / FP8_MAX
    if math.isnan(lo):
        return "holds NaN block scales"
    if lo <= 0:
        return f"holds a block scale of {lo:g}: scales must be positive"
    if lo < normal:
        return f"holds a subnormal block scale, {lo:g} (below float32's smallest normal number, {normal:g})"
    if hi > largest:
        return (f"holds a block scale of {hi:g}: the largest e4m3 code (448) times it is not finite in {dtype} "
                f"(scales up to {largest:g} are)")
    return None


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] or stacked experts [E, N, K] (any float dtype, any device) -> (float8_e4m3fn codes, fp32
    scale_inv [.., ceil(N/128), ceil(K/128)]) on w's device. A stacked expert tensor whose rows are parts
    (gate, up) is quantized part by part by the caller (quantize_weight)."""
    if w.dim() == 2:
        return quantize_weight_blocks(w)
    codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scales = None
    for e in range(0, w.shape[0], EXPERTS_AT_ONCE):
        q, s = quantize_weight_blocks(w[e:e + EXPERTS_AT_ONCE])
        if scales is None:
            scales = torch.empty((w.shape[0], *s.shape[1:]), dtype=s.dtype, device=w.device)
        codes[e:e + EXPERTS_AT_ONCE], scales[e:e + EXPERTS_AT_ONCE] = q, s
    return codes, scales


def quantize_weight(w: torch.Tensor, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [.., rows, K] whose rows are `parts` equal parts (an expert's gate, then up), each
    block-quantized on its own (as the checkpoint's per-part tensors are): codes [.., rows, K], scales
    [.., parts * ceil(rows / parts / 128), ceil(K / 128)], each part's grid in turn."""
    if parts == 1:
        return quantize_blocks(w)
    pieces = [quantize_blocks(p) for p in w.chunk(parts, dim=-2)]
    return torch.cat([q for q, _ in pieces], dim=-2), torch.cat([s for _, s in pieces], dim=-2)


def dequantize_weight(codes: torch.Tensor, scales: torch.Tensor, parts: int = 1,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of quantize_weight: codes * scale per block, in fp32, cast to dtype."""
    if parts == 1:
        return dequantize_weight_blocks(codes, scales, dtype)
    return torch.cat([dequantize_weight_blocks(q, s, dtype) for q, s in zip(codes.chunk(parts, dim=-2),
                                                                            scales.chunk(parts, dim=-2))], dim=-2)


def quantize_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Floating-point weights (names of cfg without quantization) -> the FP8 config `cfg`'s weights: each
    converted weight quantized (its scales beside it), the others as they are. Pops from `weights` as it
    goes, so the peak is one weight's FP8 copy more."""
    out = {}
    for name, spec in model_spec(cfg).items():
        if spec.of is not None:
            continue
        w = weights.pop(name)
        if spec.fp8:
            out[name], out[scale_name(name)] = quantize_weight(w, _parts(spec))
        else:
            out[name] = w
    return out


def dequantize_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig,
                       dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """An FP8 model's weights -> (floating-point weights in `dtype` (default: the others' dtype), the config
    without quantization): what transformers' unquantized model of the same checkpoint computes with."""
    specs = model_spec(cfg)
    floating = [t.dtype for n, t in weights.items() if not specs[n].fp8 and specs[n].of is None]
    dtype = dtype or (floating[0] if floating else torch.float32)
    out = {}
    for name, t in weights.items():
        spec = specs[name]
        if spec.of is not None:
            continue
        out[name] = (dequantize_weight(t, weights[scale_name(name)], _parts(spec), dtype) if spec.fp8
                     else t.to(dtype))
    return out, cfg.replace(quantization=None)


def fp8_config(cfg: ModelConfig, modules_to_not_convert: list[str] | None = None) -> ModelConfig:
    """`cfg` quantized as Qwen's FP8 releases are: every convertible weight (spec.py) but the modules
    matching `modules_to_not_convert` (transformers' patterns; default: none, the weights metrale-graph
    keeps in floating point being kept anyway)."""
    patterns = None if modules_to_not_convert is None else tuple(modules_to_not_convert)
    return cfg.replace(quantization=Fp8Config(patterns))


def kept_modules(cfg: ModelConfig, prefix: str = "model.") -> list[str]:
    """The modules an FP8 config keeps in floating point that transformers would convert (nn.Linear and
    experts modules), by their names in a checkpoint whose text modules start with `prefix`
    (`model.layers.0.linear_attn.in_proj_a`, `lm_head`): the modules_to_not_convert a saved checkpoint
    lists, which transformers and this package both read back to the same weights."""
    kept = []
    for spec in model_spec(cfg).values():
        if spec.kind not in ("projection", EXPERTS) or spec.fp8:
            continue
        fusion = cfg.family.fusion_of(spec.local) if spec.layer is not None else None
        module = f"{spec.layer_prefix}{fusion.name.rsplit('.', 1)[0]}" if fusion is not None else spec.module
        name = checkpoint_module(module, prefix)
        if name not in kept:
            kept.append(name)
    return kept


def _parts(spec) -> int:
    return len(spec.parts) if spec.kind == EXPERTS else 1

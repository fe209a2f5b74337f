"""How the loader (loader.py) reads a compressed-tensors checkpoint's FP8 tensors (compressed_tensors.py): which of
the files' tensors it reads as what, their scales checked from the headers, and each FP8 weight turned into what
the model holds of it as it is read (`CompressedReader`).

By what the weight is in memory (spec.py's `fp8`, from the config's rule) and its scales' strategy:

- FP8 with `block` [128, 128] scales: read as Qwen's FP8 is, `<module>.weight_scale` as our `weight_scale_inv`.
- FP8 with `tensor` scales (requantize_fp8): the codes as stored; the one scale fills the weight's block grid (exact).
- FP8 with other scales (requantize_fp8): codes * scales in fp32, quantized to 128 x 128 blocks (ops/fp8/quant.py).
- floating point: codes * scales in fp32, which the loader rounds to the model's dtype: the weights compressed-tensors'
  decompression gives, rounded once. So are FP8 tensors of modules metrale-graph keeps in floating point (the
  router, the shared-expert gate, lm_head, a fused tensor 128-row blocks cannot split) when the file holds them so.

These scales are read whole before any weight (a [rows, 1] column per channel-quantized weight; only those of the
weights this rank reads), each checked as the loader checks block scales (quantized.scale_problem). Static input
scales (`input_scale`), a kv_cache_scheme's `k_scale` / `v_scale` and the zero points older compressed-tensors
saved beside symmetric scales (zeros) are not read: activations are quantized per token per 128 channels, the KV
cache kept in the model's dtype.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import NamedTuple

import torch

from .compressed_tensors import Scheme
from .ops.fp8.quant import quantize_weight_blocks
from .quantization import scale_name
from .quantized import scale_problem
from .sharding import NOTHING, Plan, Read
from .spec import EXPERTS, PROJECTION, blocks

log = logging.getLogger(__name__)
FP8 = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16", "F16")
UNUSED = {"input_scale": "static input scales", "k_scale": "KV-cache scales", "v_scale": "KV-cache scales",
          "weight_zero_point": "zero points", "input_zero_point": "zero points"}  # (symmetric: zeros)
AS_STORED, BROADCAST, REQUANTIZE, DEQUANTIZE = "as stored", "tensor scale in every block", "requantized", "dequantized"
KEPT = "dequantized (kept in floating point)"  # a module metrale-graph keeps so: the router, lm_head, ...


class Codes(NamedTuple):
    """An FP8 weight of the file that the reader turns into ours as it is read: its plan name, file, scheme, how,
    and its weight_scale's key and file (CompressedReader.finish)."""
    name: str
    path: str
    scheme: Scheme
    how: str
    scale_key: str = ""
    scale_path: str = ""


class CompressedReader:
    """The loader's reads of a compressed-tensors checkpoint (module docstring): `rename` each checkpoint tensor to
    the plan's name (or take it), `finish` the header checks, `read_scales`, then `convert` each weight read."""

    def __init__(self, fmt, plan: Plan, dtype: torch.dtype):
        self.fmt, self.plan, self.dtype = fmt, plan, dtype
        self.codes: dict[str, Codes] = {}  # checkpoint key of an FP8 weight -> what it becomes
        self.scale_keys: dict[str, tuple[str, str, tuple[int, ...], str]] = {}  # module -> (key, file, shape, dtype)
        self.scales: dict[str, torch.Tensor] = {}  # weight key -> its scales, fp32
        self.counts: Counter = Counter()

    def rename(self, key: str, path: str, name: str, header) -> str | None:
        """The plan's name for checkpoint tensor `key` (`name`: loader.our_name's), or None when the reader takes it
        (scales it applies itself, scales it does not use). ValueError naming the tensor when the file and the
        config disagree: a quantized module's weight not float8_e4m3fn, an FP8 weight or weight_scale of a module the
        config does not quantize."""
        module, _, leaf = key.rpartition(".")
        if (leaf == "input_scale" and getattr(self.fmt.scheme_of(module), "activations", None) == "static"
                or leaf in ("k_scale", "v_scale") and self.fmt.kv_cache
                or leaf.endswith("_zero_point") and self.fmt.scheme_of(module) is not None):
            self.counts[UNUSED[leaf]] += 1
            return None
        if leaf not in ("weight", "weight_scale"):
            return name
        weight = name if leaf == "weight" else name[:-len("_scale")]
        piece = self.plan.reads.get(weight)
        if piece is None:
            return name  # a tensor the model has no weight for: the loader names it
        scheme = self.fmt.scheme_of(module, linear=piece.spec.kind in (PROJECTION, EXPERTS))
        stored = header.get_dtype()
        if leaf == "weight_scale":
            if scheme is None:
                raise ValueError(f"tensor {key!r} in {path} is the FP8 scale of a module the compressed-tensors "
                                 "quantization_config does not quantize (no config_groups target, or named in ignore)")
            if piece.spec.fp8 and scheme.block == (128, 128):
                return scale_name(weight)  # our weight_scale_inv as it is
            self.scale_keys[module] = (key, path, tuple(header.get_shape()), stored)
            return None
        if scheme is None:
            if stored == FP8:
                raise ValueError(f"tensor {key!r} in {path} is float8_e4m3fn, but the compressed-tensors "
                                 "quantization_config does not quantize it (no config_groups target, or named in "
                                 "ignore): such a module is stored in floating point")
            return name
        if stored != FP8:
            if piece.spec.fp8 or piece.spec.quantizable:
                hint = ("; an MTP head copied unquantized is listed in ignore ('re:^mtp.*', as compressed-tensors' "
                        "save_mtp_tensors_to_checkpoint adds it), or from_pretrained(..., mtp=False) leaves it unread"
                        if key.startswith("mtp.") else "")
                raise ValueError(f"tensor {key!r} in {path} is {stored}; the compressed-tensors quantization_config "
                                 "quantizes it (a config_groups target, not in ignore), so it must be float8_e4m3fn "
                                 f"with a weight_scale beside it{hint}")
            return name  # a module kept in floating point that the file holds so (a router no Linear class targets)
        how = (AS_STORED if scheme.block == (128, 128) else BROADCAST if scheme.strategy == "tensor" else REQUANTIZE
               ) if piece.spec.fp8 else DEQUANTIZE
        self.counts[how if how != DEQUANTIZE or piece.spec.quantizable and not scheme.native else KEPT] += 1
        if how != AS_STORED:
            self.codes[key] = Codes(weight, path, scheme, how)
        return name

    def takes(self, key: str) -> bool:
        """Whether `key` is FP8 codes this reader dequantizes (the loader then accepts float8_e4m3fn there)."""
        return key in self.codes and self.codes[key].how == DEQUANTIZE

    def finish(self, given: dict[str, str]) -> None:
        """After every header: each weight the reader converts has its weight_scale, of a scale dtype and of its
        strategy's shape; the block scales it makes count as given (`given`: the loader's units -> key). ValueError
        naming the tensor otherwise, and for a weight_scale whose weight is not FP8 in the file."""
        for key, c in self.codes.items():
            module = key[:-len(".weight")]
            if module not in self.scale_keys:
                raise ValueError(f"tensor {key!r} in {c.path} is FP8 but the checkpoint has no {module}.weight_scale")
            skey, spath, shape, dtype = self.scale_keys.pop(module)
            if dtype not in SCALE_DTYPES:
                raise ValueError(f"tensor {skey!r} in {spath} is {dtype}; FP8 weight scales must be float32, bfloat16 "
                                 "or float16")
            rows, cols = self.plan.reads[c.name].shape[-2:]
            want = c.scheme.scale_shape(rows, cols)
            if (want is None and torch.Size(shape).numel() != 1) or (want is not None and shape != want):
                raise ValueError(f"tensor {skey!r} in {spath} has shape {shape}; the {c.scheme.strategy} scales of "
                                 f"{key!r} [{rows}, {cols}] are " + ("one number ([1])" if want is None else f"{want}"))
            self.codes[key] = c._replace(scale_key=skey, scale_path=spath)
            if c.how in (BROADCAST, REQUANTIZE):
                given.update(dict.fromkeys(self.plan.reads[scale_name(c.name)].units, skey))
        for module, (skey, spath, _, _) in self.scale_keys.items():
            raise ValueError(f"tensor {skey!r} in {spath} is an FP8 weight scale, but {module}.weight is not an FP8 "
                             "weight of the checkpoint")

    def read_scales(self) -> None:
        """Read the scales of the weights this rank reads (fp32), each checked (quantized.scale_problem); then log
        what the load does with the file's FP8 weights."""
        from safetensors import safe_open

        by_file: dict[str, list[tuple[str, str]]] = {}
        for key, c in self.codes.items():
            if self.plan.reads[c.name].ranges != NOTHING:
                by_file.setdefault(c.scale_path, []).append((key, c.scale_key))
        for path, items in by_file.items():
            with safe_open(path, framework="pt", device="cpu") as f:
                for key, skey in items:
                    scale = f.get_tensor(skey).float()
                    if (problem := scale_problem(scale, self.dtype)) is not None:
                        raise ValueError(f"tensor {skey!r} in {path} {problem}")
                    self.scales[key] = scale
        log.info("compressed-tensors FP8 checkpoint: FP8 weights %s; unused: %s. Block [128, 128] scales stay 128 x "
                 "128-block FP8, other scales are dequantized to %s (requantize_fp8: block FP8, tensor scales exactly, "
                 "others requantized); activations are quantized per token per 128 channels",
                 ", ".join(f"{self.counts[h]} {h}" for h in (AS_STORED, BROADCAST, REQUANTIZE, DEQUANTIZE, KEPT)),
                 ", ".join(f"{n} {what}" for what, n in self.counts.items() if what in UNUSED.values()) or "none",
                 self.dtype)
        if self.counts[DEQUANTIZE]:
            log.warning("%d FP8 weights of the checkpoint are held dequantized in %s (their scales are not 128 x 128 "
                        "blocks: exact, at %d bytes a weight instead of 1); from_pretrained(..., requantize_fp8=True) "
                        "holds them as 128 x 128-block FP8 instead (tensor scales exactly, others requantized: a "
                        "second rounding)", self.counts[DEQUANTIZE], self.dtype, self.dtype.itemsize)

    def convert(self, key: str, piece: Read, stored: torch.Tensor) -> list[tuple[Read, torch.Tensor]]:
        """What to place of checkpoint tensor `key` as read (this rank's part `stored`): [(the plan's read, tensor)],
        with the block scales of its weight where the reader makes them."""
        c = self.codes.get(key)
        if c is None or piece.ranges == NOTHING:
            return [(piece, stored)]
        scale_read = self.plan.reads.get(scale_name(c.name))
        if c.how == BROADCAST:
            grid = torch.full((blocks(stored.shape[0]), blocks(stored.shape[1])), self.scales[key].item())
            return [(piece, stored), (scale_read, grid)]
        w = stored.float() * part_scale(self.scales[key], c.scheme, piece.shape, piece.ranges)
        if c.how == REQUANTIZE:
            codes, grid = quantize_weight_blocks(w)
            return [(piece, codes), (scale_read, grid)]
        return [(piece, w)]


def part_scale(scale: torch.Tensor, scheme: Scheme, shape: tuple[int, ...], ranges) -> torch.Tensor:
    """The scale of each element of a part of an FP8 weight [rows, cols] (`ranges`: sharding.Ranges, None: all of
    it), broadcastable to the part: a number (tensor), a column (channel), else one per element."""
    if scheme.strategy == "tensor":
        return scale.reshape(())
    index = [torch.arange(n) for n in shape]
    if ranges is not None:
        dim, spans = ranges
        index[dim] = torch.cat([torch.arange(a, b) for a, b in spans])
    br, bc = scheme.block
    rows = scale.index_select(0, index[0] // br)
    return rows if bc is None else rows.index_select(1, index[1] // bc)

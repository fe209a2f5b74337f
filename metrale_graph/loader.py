"""The loader: a safetensors checkpoint in Hugging Face layout (single file or sharded, text-only or multimodal,
or this rank's shard) read into our weights in one pass. Which tensors the checkpoint holds is the config's spec
(spec.checkpoint_layout: names, shapes, FP8 scales, the MTP head, the family's fusions); what this rank reads of
each, and where it goes, is its plan (sharding.load_plan); here every file's headers are checked against the
plan before anything is read, then each tensor is read once, this rank's part of it only, and put in place:
converted to the model's dtype (FP8 weights as they are, their scales in fp32), an expert's part into the
stacked expert buffer, a fused tensor split into its members, a stacked group's members into their one buffer,
a vocabulary shard into its padded rows. What a family's checkpoint fuses is its record (families.py); our
weights back in checkpoint layout, random weights and the stacking of weights from elsewhere are weights.py;
saving is saving.py.

Our parameter names are transformers' in-memory names without the `model.` prefix
(`layers.3.linear_attn.in_proj_qkv.weight`, `embed_tokens.weight`, `lm_head.weight`,
`layers.0.mlp.experts.gate_up_proj`). Checkpoints differ from them in two ways, both rearranged
once at load and back at save (what transformers' own conversion does):

- MoE experts (spec.EXPERTS): the hub (and `save_pretrained`) stores one tensor per expert and part
  (`mlp.experts.{e}.gate_proj.weight` [IE, D], `up_proj` [IE, D], `down_proj` [D, IE]); we keep
  them stacked, `mlp.experts.gate_up_proj` [E, 2*IE, D] (gate rows, then up rows) and
  `mlp.experts.down_proj` [E, D, IE], filled expert by expert in a buffer allocated once on the
  target device. Checkpoints that already hold the stacked names load as they are.
- A family's fusions (families.Fusion; Qwen3-Next's GDN `in_proj_qkvz` [H * (2K + 2rV), D] and
  `in_proj_ba` [H * 2r, D], interleaved per key-head group): split at load into our weights
  (`in_proj_qkv` with channels [q | k | v], `in_proj_z`, `in_proj_b`, `in_proj_a`), fused at save.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from .config import ModelConfig
from .families import FAMILIES
from .loader_checks import (check_dtype, contradiction, cut_layer, finite, ignored, listed_absent, packed_format,
                            per_tensor_fp8, unset_sizes_of)
from .loader_compressed import CompressedReader
from .placement import as_device, as_dtype, check_host_memory
from .quantization import MTP_PREFIX, scale_name
from .quantized import scale_problem
from .sharding import NOTHING, Read, load_plan
from .spec import SCALE, WeightSpec, weight_bytes, weight_dtype
from .weights import MTP_KEYS, _leading, checkpoint_files, compressed_format, take, unreadable

log = logging.getLogger(__name__)
EMBEDDINGS = "embed_tokens.weight"  # a tied model's lm_head too
# Checkpoint prefixes of the language model, most specific first, and of the part of a multimodal checkpoint
# that a text model never uses (the vision tower): those of every family (families.py).
_TEXT_PREFIXES = tuple(sorted({m.text_prefix for f in FAMILIES.values() for m in f.multimodal} | {"model."},
                              key=len, reverse=True))
SKIPPED_PREFIXES = tuple(dict.fromkeys(p for f in FAMILIES.values() for m in f.multimodal for p in m.skipped_prefixes))


def our_name(key: str, mtp: bool = True) -> str | None:
    """Checkpoint key -> our name (spec.checkpoint_layout's names: experts one tensor each, fusions fused); None for
    tensors the model does not read: the vision tower's (SKIPPED_PREFIXES), and with mtp=False (a config without
    an MTP head) the MTP head's."""
    if key.startswith(SKIPPED_PREFIXES):
        return None
    if key.startswith(MTP_KEYS):
        return key[key.index(MTP_PREFIX):] if mtp else None
    if key == "lm_head.weight":
        return key
    for prefix in _TEXT_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


class _Assembler:
    """Lays checkpoint tensors into our weights on `device` in `dtype` (FP8 weights as they are, their
    scales in fp32: spec.weight_dtype), as the rank's plan (sharding.load_plan) says: whole tensors as they
    are, per-expert tensors into stacked buffers allocated once, the family's fused tensors split, a stacked
    group's members into its buffer (Shards.stacks), a vocabulary shard into its zero-padded rows. `reader`: how a
    compressed-tensors checkpoint's FP8 tensors are read (loader_compressed.py; None for other checkpoints)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device, tp=None, folder: str | None = None):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.plan = load_plan(cfg, tp)
        fmt = compressed_format(folder) if folder is not None else None
        self.reader = CompressedReader(fmt, self.plan, dtype) if fmt is not None else None
        self.out: dict[str, torch.Tensor] = {}
        self.stacks: dict[int, torch.Tensor] = {}  # the buffers of the plan's stacks, by index
        self.squeezed: set[str] = set()  # keys of FP8 scales stored without their grid's size-1 dims (_check_header)
        self.unset = unset_sizes_of(folder, cfg)  # what the errors add of sizes config.json leaves to the defaults

    def dtype_of(self, spec: WeightSpec) -> torch.dtype:
        return weight_dtype(spec, self.dtype)

    def converted(self, t: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype_of(spec))

    def place(self, read: Read, t: torch.Tensor) -> torch.Tensor | None:
        """Store what this rank read of a checkpoint tensor among the weights; returns what it wrote (None:
        nothing, another rank's expert)."""
        spec = read.spec
        if read.fusion is not None:
            t = self.converted(t, spec)
            for member, part in zip(read.fusion.members, read.fusion.split(t, self.plan.shards.local)):
                if self._stacked(spec.layer_prefix + member, part, spec) is None:
                    self.out[spec.layer_prefix + member] = part
            return t
        if read.expert is not None:  # copied straight into the stacked buffer: no converted copy of the expert
            if spec.name not in self.out:
                self.out[spec.name] = torch.empty(self.plan.shards.shapes[spec.name], dtype=self.dtype_of(spec),
                                                  device=self.device)
            view = self.out[spec.name][read.expert, read.rows]
            view.copy_(t)
            return view
        if read.ranges == NOTHING:
            return None
        if (view := self._stacked(spec.name, t, spec)) is not None:
            return view
        want = self.plan.shards.shapes[spec.name]
        if tuple(t.shape) == want:
            self.out[spec.name] = self.converted(t, spec)
            return self.out[spec.name]
        # this rank's vocabulary rows, short of its padded shard (sharding.PADDED): zeros after them
        self.out[spec.name] = torch.zeros(want, dtype=self.dtype_of(spec), device=self.device)
        return _leading(self.out[spec.name], t.shape).copy_(t)

    def _stacked(self, name: str, t: torch.Tensor, spec: WeightSpec) -> torch.Tensor | None:
        """Copy weight `name` into its rows of its stack's buffer (allocated at its first member) and return them;
        None when it is not stacked (sharding.Shards.stacks)."""
        where = self.plan.shards.stack_of.get(name)
        if where is None:
            return None
        index, row = where
        if index not in self.stacks:
            self.stacks[index] = torch.empty(self.plan.shards.stacks[index].shape, dtype=self.dtype_of(spec),
                                             device=self.device)
        self.out[name] = self.stacks[index][row:row + t.shape[0]]
        return self.out[name].copy_(t)


class _Reading(NamedTuple):
    """A checkpoint tensor to read: its key, file, and what the plan reads of it (sharding.Read)."""
    key: str
    path: str
    read: Read


def _check_headers(files: list[str], asm: _Assembler, cfg: ModelConfig
                   ) -> tuple[list[_Reading], tuple[str, str] | None]:
    """Every tensor the files hold, checked from their headers alone (names, shapes, dtypes; no tensor data
    read, nothing allocated): the reads that fill the weights, and a tied model's stored lm_head (key, file)
    to compare with its embeddings, or None (none stored, or it is the only copy of the pair: then it is
    read as the embeddings). ValueError naming the tensor and its file for a duplicate, mis-shaped or wrongly
    typed one, the unexpected ones (FP8 block scales of a module that is not converted, or under a config
    without a quantization_config, named as such), the missing ones (and the shard the index maps each to, where it
    maps one to a shard that lacks it: then no tie_word_embeddings hint for lm_head). The one kind of extra tensor
    taken: those of decoder layers past the config's num_hidden_layers (a model cut down by editing config.json),
    skipped unread with one warning, as transformers skips them (loader_checks.cut_layer), and the RoPE frequencies
    of older saves, skipped unread as transformers skips them (loader_checks.ignored); any other is an error."""
    from safetensors import SafetensorError, safe_open

    plan = asm.plan
    given: dict[str, str] = {}  # checkpoint_shapes name -> the checkpoint key that gave it
    given_in: dict[str, str] = {}  # checkpoint key -> its file
    unexpected = []  # (key, file)
    reads, tied_head, cut = [], None, set()  # cut: the layers past num_hidden_layers skipped
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                keys = list(f.keys())
                if (packed := packed_format(keys)) is not None:  # before its tensors' shapes and dtypes are checked
                    raise ValueError(f"checkpoint holds {packed[0]} tensors ({packed[1]!r} in {path}): a quantized "
                                     "format metrale-graph does not load, which its config.json's quantization_config "
                                     "does not declare either. Load the model's floating-point checkpoint, or an FP8 "
                                     "one (Qwen's fine-grained FP8, compressed-tensors FP8)")
                if (error := per_tensor_fp8(keys, cfg, path)) is not None:
                    raise error
                for key in keys:
                    if ignored(key):  # the RoPE frequencies of an older save: transformers skips them too
                        continue
                    name = our_name(key, mtp=cfg.mtp_num_hidden_layers > 0)
                    if name is not None and (layer := cut_layer(name, cfg)) is not None:
                        cut.add(layer)
                        continue
                    if name == "lm_head.weight" and cfg.tie_word_embeddings:
                        _check_header(f.get_slice(key), key, path, plan.reads[EMBEDDINGS], asm)
                        tied_head = (key, path)
                        continue
                    if name is None or asm.reader is not None and (
                            name := asm.reader.rename(key, path, name, f.get_slice(key))) is None:
                        continue
                    piece = plan.reads.get(name)
                    if piece is None:
                        unexpected.append((key, path))
                        continue
                    for unit in piece.units:
                        if unit in given:
                            other = given[unit]
                            if our_name(other) == name:
                                raise ValueError(f"tensor {key!r} appears twice in the checkpoint ({path}; "
                                                 f"{other!r} in {given_in[other]})")
                            raise ValueError(f"tensor {key!r} ({path}) holds weights that {other!r} holds too "
                                             f"(in {given_in[other]}; a layer's experts come either stacked or "
                                             "one tensor per expert)")
                    _check_header(f.get_slice(key), key, path, piece, asm)
                    given.update(dict.fromkeys(piece.units, key))
                    given_in[key] = path
                    reads.append(_Reading(key, path, piece))
        except (SafetensorError, OSError) as e:
            raise unreadable(path, e) from None
    if asm.reader is not None:
        asm.reader.finish(given)
    if unexpected:
        scales = [(k, f) for k, f in unexpected if k.endswith(scale_name("weight"))]
        examples = ", ".join(f"{k!r} in {f}" for k, f in scales[:5])
        if scales and cfg.quantization is not None:
            raise ValueError(f"checkpoint holds {len(scales)} FP8 block scale(s) of modules the quantization_config "
                             "does not convert (modules_to_not_convert, or a weight metrale-graph keeps in floating "
                             "point), e.g. " + examples)
        if scales:
            raise ValueError(f"checkpoint holds {len(scales)} FP8 block scale(s) but its config.json has no "
                             "quantization_config (an FP8 checkpoint declares its format there: quant_method 'fp8', "
                             "at the top or in text_config), e.g. " + examples)
        raise ValueError(f"checkpoint has {len(unexpected)} unexpected tensor(s), e.g. "
                         + ", ".join(f"{k!r} in {f}" for k, f in unexpected[:5])
                         + contradiction([our_name(k) for k, _ in unexpected], cfg) + asm.unset)
    if tied_head is not None and EMBEDDINGS not in given:
        # the tied pair stored under lm_head's name alone (safetensors' save_model keeps that name of shared
        # tensors; transformers' save_pretrained the embeddings'): transformers takes the embeddings from it
        reads.append(_Reading(*tied_head, plan.reads[EMBEDDINGS]))
        given[EMBEDDINGS] = tied_head[0]
        tied_head = None
    missing = [n for n in plan.layout if n not in given]
    absent = listed_absent(files, missing, our_name) if missing else ""  # the index's shards that lack them
    if missing == ["lm_head.weight"] and not absent:
        raise ValueError("checkpoint lacks lm_head.weight and its config does not tie lm_head to the embeddings: a "
                         "checkpoint whose lm_head is embed_tokens sets tie_word_embeddings true in config.json (a "
                         "multimodal one at its top level, where transformers reads it)")
    if missing:
        head = all(n.startswith(MTP_PREFIX) for n in missing)  # a head transformers never reads: its main model loads
        hint = "; its MTP head (mtp.*) is incomplete: from_pretrained(..., mtp=False) loads the model without it"
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. "
                         f"{_collapse(missing, asm, given)[:5]}{hint if head else ''}{absent}{asm.unset}"
                         + (" (compressed-tensors names an FP8 weight's scales weight_scale)" if asm.reader and any(
                             n.endswith("_scale_inv") for n in missing) else ""))
    if cut:
        log.warning("checkpoint holds %d decoder layer(s) past the config's num_hidden_layers (%d), layers %d to %d: "
                    "skipped, not read (as transformers skips them)", len(cut), cfg.num_hidden_layers, min(cut), max(cut))
    return reads, tied_head


def _check_header(header, key: str, path: str, piece: Read, asm: _Assembler) -> None:
    """ValueError naming the tensor and its file unless its header (a safetensors slice) has the piece's
    shape and a dtype the piece may be stored in (loader_checks.check_dtype; FP8 codes a compressed-tensors reader
    dequantizes are its to check)."""
    shape = tuple(header.get_shape())
    spec = piece.spec
    if spec.kind == SCALE and len(spec.parts) > 1 and len(piece.units) > 1 and spec.of is not None:
        rows = spec.of.shape[1] // len(spec.parts)  # a part's rows (gate's, up's)
        if rows % 128:
            parts = len(spec.parts)
            per_part, fused = parts * -(-rows // 128), -(-parts * rows // 128)
            got = shape[1] if len(shape) > 1 else None
            which = (f"its {got} block rows are the whole stacked matrix's (a grid per part has {per_part}), so a "
                     "block holds the end of one part and the start of the next, which this loader does not re-block "
                     "into the parts' own grids" if got == fused != per_part else
                     f"a 128-row block may hold the end of one part and the start of the next ({fused} block rows) "
                     f"or each part may start its own blocks ({per_part})" + (
                         "; its grid's shape does not say which" if fused == per_part else ""))
            raise ValueError(
                f"tensor {key!r} ({path}): FP8 block scales of stacked experts whose parts ({', '.join(spec.parts)}) "
                f"have {rows} rows each, not a multiple of 128: {which}. Store the experts one tensor per expert, "
                "each with its weight_scale_inv (as Qwen's FP8 releases do and metrale-graph's save_pretrained and "
                "tools.quantize write)")
    if spec.kind == SCALE and shape != piece.shape and shape == tuple(n for n in piece.shape if n != 1):
        # transformers' save of its FP8 MoE experts drops the size-1 dims of each expert's scale grid ([1, 2] as
        # [2], [1, 1] as a 0-d tensor): the grid's values in order, read whole and reshaped (load_checkpoint)
        asm.squeezed.add(key)
    elif shape != piece.shape:
        raise ValueError(f"tensor {key!r} has shape {shape}, the config needs {piece.shape} ({path}){asm.unset}")
    if asm.reader is None or not asm.reader.takes(key):
        check_dtype(key, path, header.get_dtype(), piece.spec, asm.cfg)


def check_checkpoint(folder: str, cfg: ModelConfig) -> dict[str, WeightSpec]:
    """Check a checkpoint folder's tensors against `cfg` from their headers alone, as load_checkpoint does
    before it reads anything (ValueError naming the tensor); returns each checkpoint tensor's spec by our
    name (our_name): the weight it is, or is a part of (an expert's, a fusion's first member), or its scales."""
    asm = _Assembler(cfg, torch.float32, torch.device("cpu"), folder=folder)
    _check_headers(checkpoint_files(folder), asm, cfg)
    return {name: read.spec for name, read in asm.plan.reads.items()}


def load_checkpoint(folder: str, cfg: ModelConfig, dtype: torch.dtype, device,
                    progress: bool = True, check_finite: bool = True, tp=None) -> dict[str, torch.Tensor]:
    """Read every tensor the config needs from a safetensors checkpoint folder, in our layout
    (weight_shapes), each once and straight into its place as the rank's plan says (sharding.load_plan):
    per-expert tensors into stacked buffers allocated once on `device`, stacked ones taken as they are, the
    family's fused tensors split (module docstring), a stacked group's members into its one buffer (so the
    model keeps them without a copy). `dtype` is
    a torch.dtype or its name; on the CPU, weights that would not fit in the memory available are a
    ValueError before any is read. An FP8 checkpoint's converted weights stay float8_e4m3fn, their
    weight_scale_inv are read into fp32 (spec.py).

    The files' headers are checked against the plan first, before anything is allocated or read (_check_headers):
    ValueError naming the tensor and its file for a missing, unexpected, duplicate, mis-shaped or wrongly typed one (per
    expert: `layers.3.mlp.experts.17.up_proj.weight`; an FP8 weight that is not float8_e4m3fn, a scale
    for a module that is not converted), and for a file safetensors cannot read. Tensors of the vision
    tower are skipped, with a warning those of decoder layers past num_hidden_layers (a config cut down), and the
    MTP head's when the config has none (checkpoint_config settles whether it does); a config with one needs all
    of it. A tied model takes a stored lm_head equal to the embeddings as
    tied and refuses (ValueError naming tie_word_embeddings) one that differs: transformers does not tie
    such a pair, it runs the stored lm_head. A tied checkpoint storing lm_head alone (safetensors'
    save_model names the pair so) gives the embeddings, as in transformers.

    FP8 block scales are checked as they are read, whatever check_finite says (quantized.scale_problem; one
    pass over the scales, not the codes): each finite, positive and normal, and 448 (the largest e4m3 code)
    times it finite in `dtype`, else ValueError naming the tensor and its file.

    `check_finite` rejects a tensor holding NaN or infinity once it is on `device` in `dtype`
    (so a value beyond float16's range counts too; FP8 codes: NaN). It reads every weight once more: for
    the 9B model's 19 GB in bfloat16, about 40 ms on an H200 and about 4.5 s on 2 CPU cores (measured
    4.4 GB/s in bfloat16, 6.3 GB/s in float32; torch.isfinite(t).all() reads 0.3 GB/s there).

    With a tensor-parallel `tp` (parallel.TensorParallel), only this rank's shard of each tensor is
    read from the files (and only its experts, and their blocks' scales, which it checks); the vocabulary
    shards are read into their rows of buffers padded with zeros to ceil(V / tp).
    """
    from safetensors import SafetensorError, safe_open

    dtype, device = as_dtype(dtype), as_device(device)
    asm = _Assembler(cfg, dtype, device, tp, folder)
    reads, tied_head = _check_headers(checkpoint_files(folder), asm, cfg)  # before the memory the config asks for
    check_host_memory(weight_bytes(asm.plan.shards.shapes, dtype, cfg), device, f"the weights of {folder} in {dtype}")
    if asm.reader is not None:
        asm.reader.read_scales()
    # drawn where standard error is a terminal (tqdm's disable=None; a notebook's widget too), never in a log
    bar = tqdm(total=len(asm.plan.layout), desc="loading weights", unit="tensor", disable=None if progress else True,
               leave=False)
    by_file: dict[str, list[_Reading]] = {}
    for r in reads:
        by_file.setdefault(r.path, []).append(r)
    for path, items in by_file.items():
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key, _, piece in items:
                    if key in asm.squeezed:
                        stored = take(f.get_tensor(key).reshape(piece.shape), piece.ranges)
                    else:
                        stored = take(f.get_slice(key), piece.ranges) if piece.ranges else f.get_tensor(key)
                    for part, t in asm.reader.convert(key, piece, stored) if asm.reader else [(piece, stored)]:
                        if part.spec.kind == SCALE and (problem := scale_problem(t, dtype)) is not None:
                            raise ValueError(f"tensor {key!r} in {path} {problem}")
                        written = asm.place(part, t)
                        if written is not None and check_finite and not finite(written):
                            what = (f"values beyond the range of {written.dtype}" if finite(t)
                                    else "NaN or infinite values")
                            raise ValueError(f"tensor {key!r} in {path} holds {what}")
                        bar.update(len(part.units))
        except (SafetensorError, OSError) as e:
            raise unreadable(path, e) from None
    bar.close()
    if tied_head is not None:
        _check_tied_head(asm, *tied_head)
    return asm.out


def _check_tied_head(asm: _Assembler, key: str, path: str) -> None:
    """A tied model's checkpoint stores lm_head.weight too: fine when it equals the embeddings (this rank's
    rows of it under tensor parallelism), else ValueError. transformers ties the pair only when the two are
    equal; otherwise it warns and runs the stored lm_head, which a tied model here would silently ignore."""
    from safetensors import safe_open

    embed = asm.plan.reads[EMBEDDINGS]  # _check_headers has checked the stored lm_head's shape and dtype against it
    with safe_open(path, framework="pt", device="cpu") as f:
        head = take(f.get_slice(key), embed.ranges) if embed.ranges else f.get_tensor(key)
    if not torch.equal(asm.converted(head, embed.spec), _leading(asm.out[EMBEDDINGS], head.shape)):
        raise ValueError(f"the config sets tie_word_embeddings (lm_head is embed_tokens) but the checkpoint stores "
                         f"a different {key!r} ({path}); transformers runs the stored one untied: set "
                         "tie_word_embeddings to false in config.json to load it")


def _collapse(missing: list[str], asm: _Assembler, given: dict[str, str]) -> list[str]:
    """Missing checkpoint tensors by name; where the checkpoint stores experts stacked, a stacked tensor
    missing whole is named as such rather than expert by expert."""
    stacked = not set(asm.plan.stacked_of.values()).isdisjoint(our_name(k) for k in given.values())
    absent, out = set(missing), []
    for name in missing:
        whole = asm.plan.stacked_of.get(name)
        if stacked and whole and all(u in absent for u in asm.plan.reads[whole].units):
            if whole not in out:
                out.append(whole)
        else:
            out.append(name)
    return out

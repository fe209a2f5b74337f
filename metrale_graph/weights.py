"""Weights apart from loading them (loader.py): a checkpoint folder's safetensors files (checkpoint_files; a file
safetensors cannot read named by the format it holds instead: unreadable), its
config with the MTP layers its files hold (checkpoint_config), its compressed-tensors format as its files hold it
(compressed_format), the keys save_pretrained writes (checkpoint_key;
loader.our_name reads keys back); our weights back in checkpoint layout (to_checkpoint, for saving.py;
hf_state_dict, transformers' in-memory state; the layout itself is the spec's, spec.checkpoint_layout); random
initialization; a rank's shard of full weights (take, shard_weights); the stacked projection buffers of weights
from elsewhere than a checkpoint (stack_projections)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace

import torch

from .compressed_tensors import checkpoint_format
from .config import ModelConfig, load_config
from .ops.kernels import rows_back_to_back
from .placement import as_device, as_dtype, check_host_memory
from .quantization import MTP_PREFIX, TEXT_PREFIX, scale_name
from .sharding import Ranges, Stack, rank_shards, shard_ranges
from .spec import EXPERTS, SCALE, VECTOR, Stored, checkpoint_layout, model_spec, weight_bytes, weight_shapes


WEIGHTS_FILE = "model.safetensors"  # a checkpoint in one file, or sharded with an index (transformers' names)
INDEX_FILE = "model.safetensors.index.json"
# PyTorch pickle checkpoints (torch.save; not read): transformers' older format, and its sharded index
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".bin.index.json")
# where checkpoints keep the MTP head (spec.mtp_block): Qwen's at the top (`mtp.fc.weight`, also in the multimodal
# wrappers), some under `model.`; our names are `mtp.*`, and save_pretrained writes them so
MTP_KEYS = (MTP_PREFIX, TEXT_PREFIX + MTP_PREFIX)


def unreadable(path: str, error: Exception) -> ValueError:
    """The error of a checkpoint file that safetensors cannot read (`error`), naming the format the file holds where
    its first bytes show one (torch.save's zip or legacy pickle, numpy's .npz, GGUF) and what to write instead."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        head = b""
    what = ("a zip archive (torch.save's format, or numpy's .npz)" if head == b"PK\x03\x04" else
            "a Python pickle (torch.save's legacy format)" if head[:1] == b"\x80" else
            "a GGUF file (llama.cpp's format)" if head == b"GGUF" else None)
    return ValueError(f"cannot read safetensors file {path}: {error}" + (
        f"; it is {what}, not safetensors: metrale-graph reads safetensors only (transformers' save_pretrained writes "
        "them)" if what else ""))


def stored_mtp_layers(folder: str) -> int:
    """The MTP layers a checkpoint's tensors hold, from the files' headers: 0 without any MTP tensor (MTP_KEYS),
    else 1 + the largest i of its `mtp.layers.{i}.` tensors (1 when it names none: the loader names what lacks)."""
    from safetensors import SafetensorError, safe_open

    found, layers = False, -1
    for path in checkpoint_files(folder):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                keys = list(f.keys())
        except (SafetensorError, OSError) as e:
            raise unreadable(path, e) from None
        for key in keys:
            if key.startswith(MTP_KEYS):
                found = True
                rest = key[key.index(MTP_PREFIX) + len(MTP_PREFIX):].split(".")
                if len(rest) > 2 and rest[0] == "layers" and rest[1].isdigit():
                    layers = max(layers, int(rest[1]))
    return 0 if not found else max(layers + 1, 1)


def checkpoint_config(folder: str, mtp: bool = True, requantize_fp8: bool = False) -> ModelConfig:
    """The config of a checkpoint folder (load_config) with its MTP layers settled by its tensors (config.py): none
    when the files hold no MTP tensor (transformers' save_pretrained drops them; its config.json still declares
    them) or with mtp=False (the head is not read), else the count config.json declares, or where it declares
    none (Qwen3-Next's files) the count the tensors name. `requantize_fp8`: a compressed-tensors FP8 checkpoint's
    weights whose scales are not 128 x 128 blocks are 128 x 128-block FP8 in memory (tensor scales exactly, per
    channel ones requantized) instead of dequantized (compressed_tensors.py); other checkpoints are not affected."""
    cfg = load_config(folder)
    if (fmt := compressed_format(folder)) is not None:  # what its files hold decides what is FP8 (compressed_format)
        cfg = cfg.replace(quantization=fmt.memory_config(requantize=requantize_fp8))
    stored = stored_mtp_layers(folder) if mtp else 0
    layers = (cfg.mtp_num_hidden_layers or stored) if stored else 0
    return cfg if layers == cfg.mtp_num_hidden_layers else cfg.replace(mtp_num_hidden_layers=layers)


_EXPERT_LINEAR = re.compile(r".*\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)")


def compressed_format(folder: str):
    """The compressed-tensors quantization_config of a checkpoint folder (compressed_tensors.checkpoint_format; None:
    none), with the MoE expert linears its files store in floating point though the config's class target names them
    (CompressedTensors.floats: compressed-tensors' own save of transformers' model) as `floating`, from the headers."""
    from safetensors import SafetensorError, safe_open

    fmt = checkpoint_format(folder)
    if fmt is None:
        return None
    experts, scaled = {}, set()  # expert linear -> its weight's stored dtype; modules with a weight_scale
    for path in checkpoint_files(folder):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    module, _, leaf = key.rpartition(".")
                    if leaf == "weight_scale":
                        scaled.add(module)
                    elif leaf == "weight" and _EXPERT_LINEAR.fullmatch(module):
                        experts[module] = f.get_slice(key).get_dtype()
        except (SafetensorError, OSError) as e:
            raise unreadable(path, e) from None
    floating = tuple(m for m, stored in experts.items() if fmt.floats(m, stored, m in scaled))
    return replace(fmt, floating=floating) if floating else fmt


def checkpoint_dtype(folder: str, dtype) -> torch.dtype:
    """The dtype a checkpoint folder's model loads in: `dtype` itself (a torch.dtype or its name, as_dtype), or for
    "auto" the checkpoint's own, as transformers' dtype="auto" takes it: config.json's `dtype` (`torch_dtype` before
    transformers 5; a multimodal config's text_config first), else the dtype its embeddings are stored in, else
    float32. ValueError naming the field for a dtype the model does not run in (placement.DTYPES)."""
    if not (isinstance(dtype, str) and dtype == "auto"):
        return as_dtype(dtype)
    with open(os.path.join(folder, "config.json")) as f:
        raw = json.load(f)  # load_config has read it already
    for section in (raw.get("text_config"), raw):
        for field in ("dtype", "torch_dtype"):
            if isinstance(section, dict) and section.get(field) is not None:
                try:
                    return as_dtype(section[field])
                except ValueError as e:
                    raise ValueError(f"dtype='auto' reads {field!r} of {folder}/config.json: {e}") from None
    from safetensors import SafetensorError, safe_open

    for path in checkpoint_files(folder):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key.endswith("embed_tokens.weight"):
                        return _STORED_DTYPES.get(f.get_slice(key).get_dtype(), torch.float32)
        except (SafetensorError, OSError) as e:  # (mtp=False: no header was read before)
            raise unreadable(path, e) from None
    return torch.float32


_STORED_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}  # safetensors' names


def checkpoint_files(folder: str) -> list[str]:
    """The safetensors files of a checkpoint folder, found as transformers finds them: `model.safetensors`,
    else the shards of `model.safetensors.index.json`, else the folder's one safetensors file. (A folder
    saved unsharded over a sharded checkpoint may keep the old index: the single file is the checkpoint.)
    ValueError naming what the folder holds instead: several safetensors files without their index, or
    PyTorch pickle weights (pytorch_model.bin, which is not read: it runs code when unpickled)."""
    single = os.path.join(folder, WEIGHTS_FILE)
    if os.path.isfile(single):
        return [single]
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                data = json.load(f)
        except (OSError, ValueError, RecursionError) as e:  # malformed JSON, not UTF-8, nested too deep
            raise ValueError(f"cannot read checkpoint index {index}: {e}") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not (isinstance(weight_map, dict) and weight_map and all(isinstance(v, str) for v in weight_map.values())):
            raise ValueError(f"{index} has no weight_map (an object of tensor name -> shard file name)")
        files = sorted(set(weight_map.values()))
        outside = [f for f in files if os.path.isabs(f) or os.path.normpath(f).split(os.sep)[0] == os.pardir]
        if outside:  # a shard is a file of the checkpoint's folder (or below it), never one elsewhere
            raise ValueError(f"{index} names shards outside {folder}: {outside}")
        missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
        if missing:
            raise ValueError(f"{index} names shards that are not in {folder}: {missing}")
        return [os.path.join(folder, f) for f in files]
    names = sorted(os.listdir(folder))
    found = [f for f in names if f.endswith(".safetensors")]
    if len(found) == 1:
        return [os.path.join(folder, found[0])]
    if found:  # shards whose index is missing: which of them make up the checkpoint is not known
        raise ValueError(f"{folder} holds {len(found)} safetensors files ({', '.join(map(repr, found[:4]))}"
                         f"{', ...' if len(found) > 4 else ''}) but no model.safetensors.index.json saying which "
                         "tensors they hold, and no model.safetensors")
    pickles = sorted((f for f in names if f.startswith(("pytorch_model", "model")) and f.endswith(PICKLE_SUFFIXES)),
                     key=lambda f: not f.endswith(".json"))  # a sharded one's index first
    if pickles:
        listed = ", ".join(pickles[:4]) + (", ..." if len(pickles) > 4 else "")
        raise ValueError(f"no model.safetensors or model.safetensors.index.json in {folder}: it holds PyTorch pickle "
                         f"weights ({listed}), which metrale-graph does not read; it reads safetensors only "
                         "(transformers' save_pretrained writes them: load the folder with transformers and save it "
                         "again)")
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {folder}")


def stack_projections(weights: dict[str, torch.Tensor], stacks: tuple[Stack, ...]) -> dict[str, torch.Tensor]:
    """Re-home each stack of the rank's plan (sharding.Shards.stacks: each layer's stacked groups, in FP8 runs with
    their scales) as row views of one buffer, so the CUDA path runs each group as one GEMM without copying
    (ops.kernels.stacked). Members already back to back (as load_checkpoint lays them) stay where they are; the
    others are copied, in place in the dict, one stack at a time, so the peak is one extra group."""
    for stack in stacks:
        parts = [weights[n] for n in stack.names]
        if rows_back_to_back(parts):
            continue
        buf = torch.cat(parts)
        for n, p, row in zip(stack.names, parts, stack.rows):
            weights[n] = buf[row:row + p.shape[0]]
    return weights


def _members(stored: Stored, weights: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [weights[f"{stored.spec.layer_prefix}{m}"] for m in stored.fusion.members]


def to_checkpoint(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our weights in checkpoint layout (spec.checkpoint_shapes' names; views where no rearranging is needed)."""
    out: dict[str, torch.Tensor] = {}
    for s in checkpoint_layout(cfg):
        if s.fusion is not None:
            out[s.name] = s.fusion.fuse(_members(s, weights), cfg)
        elif s.expert is not None:
            rows = s.shape[0]
            out[s.name] = weights[s.spec.name][s.expert, s.part * rows:(s.part + 1) * rows]
        else:
            out[s.name] = weights[s.name]
    return out


def hf_state_dict(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our weights as transformers' in-memory state dict of the family (its module names, experts
    stacked as its `experts.gate_up_proj` / `down_proj`, the family's fusions fused): what a
    transformers model of the same weights loads (the benchmarks' peer, the GPU parity tests). An FP8
    model's scales go by transformers' FP8 modules' names (`weight_scale_inv`, `gate_up_proj_scale_inv`);
    its bf16 peer takes quantized.dequantize_weights first. transformers' models have no MTP head: its weights
    are left out."""
    out = {s.name: s.fusion.fuse(_members(s, weights), cfg) if s.fusion is not None else weights[s.name]
           for s in checkpoint_layout(cfg, experts_apart=False) if not s.name.startswith(MTP_PREFIX)}
    return {checkpoint_key(n): t.contiguous() for n, t in out.items()}


def checkpoint_key(name: str) -> str:
    """Our name -> the key save_pretrained writes (a text checkpoint's: `model.` but for lm_head and the MTP head)."""
    return name if name == "lm_head.weight" or name.startswith(MTP_PREFIX) else TEXT_PREFIX + name


def take(t, ranges: Ranges | None) -> torch.Tensor:
    """The shard of `t` (a tensor, or a safetensors slice: only the ranges are read; sharding.Ranges)."""
    if ranges is None:
        return t if isinstance(t, torch.Tensor) else t[:]
    dim, spans = ranges
    index = [slice(None)] * (dim + 1)
    pieces = []
    for a, b in spans:
        index[dim] = slice(a, b)
        pieces.append(t[tuple(index)])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def _leading(t: torch.Tensor, shape) -> torch.Tensor:
    """The view of t's first `shape` elements along each dim (a padded shard's rows that hold weights)."""
    return t[tuple(slice(0, n) for n in shape)]


def shard_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig, tp) -> dict[str, torch.Tensor]:
    """Every weight's shard for this rank (from full tensors; loading from a checkpoint reads only the
    shard instead: loader.load_checkpoint(..., tp=)), copied. The vocabulary shard is padded to ceil(V / n)
    rows with zeros (sharding.rank_shards' shapes)."""
    shapes, out = rank_shards(cfg, tp).shapes, {}
    for name, t in weights.items():
        part = take(t, shard_ranges(name, cfg, tp))
        if tuple(part.shape) == shapes[name]:
            out[name] = part.clone()
        else:
            out[name] = part.new_zeros(shapes[name])
            _leading(out[name], part.shape).copy_(part)
    return out


def random_weights(cfg: ModelConfig, dtype: torch.dtype, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of realistic scale, each drawn as its spec says (spec.Init; vectors in float32, then
    converted), on the target device (fast for the 9B shape). `dtype` is a torch.dtype or its name; on the
    CPU, weights that would not fit in the memory available are a ValueError before any is drawn. An FP8
    config's converted weights are drawn in `dtype` and quantized there (quantized.quantize_blocks): the
    same draws as the unquantized config's, so its weights are theirs quantized."""
    from .quantized import quantize_weight

    dtype, device = as_dtype(dtype), as_device(device)
    check_host_memory(weight_bytes(weight_shapes(cfg), dtype, cfg), device, f"random weights in {dtype}")
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, spec in model_spec(cfg).items():
        if spec.kind == SCALE:
            continue  # its weight's quantization gives it
        t = torch.empty(spec.shape, dtype=torch.float32 if spec.kind == VECTOR else dtype, device=device)
        t = spec.init.draw(t, gen).to(dtype)
        if spec.fp8:  # stacked experts: each part (gate, up) on its own blocks, as the checkpoint's tensors
            out[name], out[scale_name(name)] = quantize_weight(t, len(spec.parts) if spec.kind == EXPERTS else 1)
        else:
            out[name] = t
    return out

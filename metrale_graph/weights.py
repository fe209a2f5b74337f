"""Weights: the expected tensors of a config, safetensors loading in Hugging Face layout
(single file or sharded, text-only or multimodal), random initialization, and saving.

Our parameter names are transformers' in-memory names without the `model.` prefix
(`layers.3.linear_attn.in_proj_qkv.weight`, `embed_tokens.weight`, `lm_head.weight`,
`layers.0.mlp.experts.gate_up_proj`). Checkpoints differ from them in two ways, both rearranged
once at load and back at save (what transformers' own conversion does):

- MoE experts: the hub (and `save_pretrained`) stores one tensor per expert
  (`mlp.experts.{e}.gate_proj.weight` [IE, D], `up_proj` [IE, D], `down_proj` [D, IE]); we keep
  them stacked, `mlp.experts.gate_up_proj` [E, 2*IE, D] (gate rows, then up rows) and
  `mlp.experts.down_proj` [E, D, IE], filled expert by expert in a buffer allocated once on the
  target device. Checkpoints that already hold the stacked names load as they are.
- Qwen3-Next GDN: the checkpoint fuses `in_proj_qkvz` [H * (2K + 2rV), D] and `in_proj_ba`
  [H * 2r, D] interleaved per key-head group (r = HV / H value heads per key head: q, k, v, z
  rows of group 0, then of group 1, ...; b, a likewise); we keep Qwen3.5's `in_proj_qkv`
  (channels [q | k | v]), `in_proj_z`, `in_proj_b`, `in_proj_a`.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable, NamedTuple

import torch
from tqdm.auto import tqdm

from .config import ModelConfig
from .families import QWEN3_NEXT

# Checkpoint prefixes of the language model, most specific first.
_TEXT_PREFIXES = ("model.language_model.", "model.")
# Tensors of other parts of a multimodal / MTP checkpoint that a text prefill never uses.
_SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by name, with its shape."""
    D, I = cfg.hidden_size, cfg.intermediate_size
    E, IE, IS = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    moe = set(cfg.moe_layers)
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, D)}
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (D,)
        shapes[p + "post_attention_layernorm.weight"] = (D,)
        if i in moe:
            m = p + "mlp."
            shapes[m + "gate.weight"] = (E, D)  # the router
            shapes[m + "experts.gate_up_proj"] = (E, 2 * IE, D)
            shapes[m + "experts.down_proj"] = (E, D, IE)
            shapes[m + "shared_expert.gate_proj.weight"] = (IS, D)
            shapes[m + "shared_expert.up_proj.weight"] = (IS, D)
            shapes[m + "shared_expert.down_proj.weight"] = (D, IS)
            shapes[m + "shared_expert_gate.weight"] = (1, D)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (I, D)
            shapes[p + "mlp.up_proj.weight"] = (I, D)
            shapes[p + "mlp.down_proj.weight"] = (D, I)
        if kind == "linear_attention":
            HV = cfg.linear_num_value_heads
            a = p + "linear_attn."
            shapes[a + "in_proj_qkv.weight"] = (cfg.conv_dim, D)
            shapes[a + "in_proj_z.weight"] = (cfg.value_dim, D)
            shapes[a + "in_proj_b.weight"] = (HV, D)
            shapes[a + "in_proj_a.weight"] = (HV, D)
            shapes[a + "conv1d.weight"] = (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim)
            shapes[a + "A_log"] = (HV,)
            shapes[a + "dt_bias"] = (HV,)
            shapes[a + "norm.weight"] = (cfg.linear_value_head_dim,)
            shapes[a + "out_proj.weight"] = (D, cfg.value_dim)
        else:
            HD, HQ, HKV = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
            a = p + "self_attn."
            shapes[a + "q_proj.weight"] = (HQ * HD * 2, D)
            shapes[a + "k_proj.weight"] = (HKV * HD, D)
            shapes[a + "v_proj.weight"] = (HKV * HD, D)
            shapes[a + "o_proj.weight"] = (D, HQ * HD)
            shapes[a + "q_norm.weight"] = (HD,)
            shapes[a + "k_norm.weight"] = (HD,)
    shapes["norm.weight"] = (D,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, D)
    return shapes


# Projections that read the same input: stored back to back in one buffer so the CUDA path runs
# each group as one GEMM without copying (ops.kernels.stacked). Members are `layers.{i}.<member>.weight`,
# in the order the ops stack them.
STACKED_GROUPS = {
    "gdn": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a"),
    "attention": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp": ("mlp.gate_proj", "mlp.up_proj"),
    # MoE layers: the shared expert's gate / up projections and the router, in ops.moe's order (the
    # shared expert's one-row sigmoid gate stays apart: a [2 IS + E + 1]-row GEMM output is unaligned)
    "moe": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.gate"),
}


def stack_projections(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Re-home each layer's STACKED_GROUPS weights as row views of one buffer (in place in the dict,
    one group at a time, so the peak is one extra group)."""
    for i in range(cfg.num_hidden_layers):
        for members in STACKED_GROUPS.values():
            names = [f"layers.{i}.{m}.weight" for m in members]
            if names[0] not in weights:
                continue
            parts = [weights[n] for n in names]
            buf = torch.cat(parts)
            row = 0
            for n, p in zip(names, parts):
                weights[n] = buf[row:row + p.shape[0]]
                row += p.shape[0]
    return weights


# ---- checkpoint layout: what transformers' save_pretrained writes, and how it maps onto ours ----

_STACKED_EXPERTS = re.compile(r"(layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)")
# Qwen3-Next: our projection -> (the checkpoint's fused tensor, our projection stored inside it)
_FUSED_GDN = {"in_proj_qkv": ("in_proj_qkvz", "in_proj_z"), "in_proj_b": ("in_proj_ba", "in_proj_a")}


def _gdn_fusion(cfg: ModelConfig, name: str) -> tuple[str, ...] | None:
    """Qwen3-Next's GDN projections: (fused checkpoint name, the partner stored in it) for in_proj_qkv
    and in_proj_b; () for in_proj_z and in_proj_a (stored inside those); None for any other tensor."""
    if cfg.model_type != QWEN3_NEXT.model_type or ".linear_attn." not in name:
        return None
    prefix, leaf = name.removesuffix(".weight").rsplit(".", 1)
    if leaf in _FUSED_GDN:
        fused, partner = _FUSED_GDN[leaf]
        return f"{prefix}.{fused}.weight", f"{prefix}.{partner}.weight"
    return () if leaf in ("in_proj_z", "in_proj_a") else None


def _gdn_groups(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """(H, K, r * V, r): key-head groups of Qwen3-Next's interleaved projections and their sizes."""
    H = cfg.linear_num_key_heads
    r = cfg.linear_num_value_heads // H
    return H, cfg.linear_key_head_dim, r * cfg.linear_value_head_dim, r


def fuse_qkvz(qkv: torch.Tensor, z: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """in_proj_qkv (rows [q | k | v]) and in_proj_z -> Qwen3-Next's in_proj_qkvz (q, k, v, z rows of
    each key-head group in turn)."""
    H, K, RV, _ = _gdn_groups(cfg)
    D = qkv.shape[1]
    q, k, v = qkv.split([H * K, H * K, H * RV])
    return torch.cat([q.reshape(H, K, D), k.reshape(H, K, D), v.reshape(H, RV, D), z.reshape(H, RV, D)],
                     dim=1).reshape(-1, D)


def split_qkvz(qkvz: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's in_proj_qkvz -> (in_proj_qkv, in_proj_z); the inverse of fuse_qkvz."""
    H, K, RV, _ = _gdn_groups(cfg)
    D = qkvz.shape[1]
    q, k, v, z = qkvz.reshape(H, 2 * K + 2 * RV, D).split([K, K, RV, RV], dim=1)
    return torch.cat([q.reshape(-1, D), k.reshape(-1, D), v.reshape(-1, D)]), z.reshape(-1, D)


def fuse_ba(b: torch.Tensor, a: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """in_proj_b and in_proj_a -> Qwen3-Next's in_proj_ba (b, a rows of each key-head group in turn)."""
    H, _, _, r = _gdn_groups(cfg)
    D = b.shape[1]
    return torch.cat([b.reshape(H, r, D), a.reshape(H, r, D)], dim=1).reshape(-1, D)


def split_ba(ba: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's in_proj_ba -> (in_proj_b, in_proj_a); the inverse of fuse_ba."""
    H, _, _, r = _gdn_groups(cfg)
    D = ba.shape[1]
    b, a = ba.reshape(H, 2 * r, D).split([r, r], dim=1)
    return b.reshape(-1, D), a.reshape(-1, D)


def _expert_names(prefix: str, stacked: str, E: int) -> list[str]:
    """The per-expert checkpoint names of one stacked expert tensor (gate_up_proj: gate, up of each expert)."""
    parts = ("gate_proj", "up_proj") if stacked == "gate_up_proj" else ("down_proj",)
    return [f"{prefix}{e}.{part}.weight" for e in range(E) for part in parts]


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the config's checkpoint as transformers' save_pretrained writes it (names
    without the `model.` prefix): experts one tensor each, Qwen3-Next's GDN projections fused."""
    D, IE = cfg.hidden_size, cfg.moe_intermediate_size
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in weight_shapes(cfg).items():
        stacked, fusion = _STACKED_EXPERTS.fullmatch(name), _gdn_fusion(cfg, name)
        if stacked:
            part_shape = {"gate_up_proj": (IE, D), "down_proj": (D, IE)}[stacked.group(2)]
            out.update(dict.fromkeys(_expert_names(stacked.group(1), stacked.group(2), shape[0]), part_shape))
        elif fusion:
            rows = 2 * cfg.key_dim + 2 * cfg.value_dim if "qkvz" in fusion[0] else 2 * cfg.linear_num_value_heads
            out[fusion[0]] = (rows, D)
        elif fusion is None:
            out[name] = shape
    return out


def to_checkpoint(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our weights in checkpoint layout (checkpoint_shapes' names; views where no rearranging is needed)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        stacked, fusion = _STACKED_EXPERTS.fullmatch(name), _gdn_fusion(cfg, name)
        if stacked:
            IE, parts = cfg.moe_intermediate_size, _expert_names(stacked.group(1), stacked.group(2), t.shape[0])
            views = ([v for e in range(t.shape[0]) for v in (t[e, :IE], t[e, IE:])]
                     if stacked.group(2) == "gate_up_proj" else list(t))
            out.update(zip(parts, views))
        elif fusion:
            fuse = fuse_qkvz if "qkvz" in fusion[0] else fuse_ba
            out[fusion[0]] = fuse(t, weights[fusion[1]], cfg)
        elif fusion is None:
            out[name] = t
    return out


def hf_state_dict(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our weights as transformers' in-memory state dict of the family (its module names, experts
    stacked as its `experts.gate_up_proj` / `down_proj`, Qwen3-Next's GDN projections fused): what a
    transformers model of the same weights loads (the benchmarks' peer, the GPU parity tests)."""
    out = {}
    for name, t in weights.items():
        fusion = _gdn_fusion(cfg, name)
        if fusion:
            fuse = fuse_qkvz if "qkvz" in fusion[0] else fuse_ba
            out[fusion[0]] = fuse(t, weights[fusion[1]], cfg)
        elif fusion is None:
            out[name] = t
    return {(n if n == "lm_head.weight" else "model." + n): t.contiguous() for n, t in out.items()}


class _Piece(NamedTuple):
    """One loadable checkpoint tensor (name without the `model.` prefix)."""
    shape: tuple[int, ...]
    units: tuple[str, ...]  # the checkpoint_shapes entries it provides (a stacked expert tensor: all its experts)
    place: Callable[[torch.Tensor], torch.Tensor | None]  # stores it among the weights; returns what it wrote
    ranges: tuple | None = None  # the part of it this tensor-parallel rank reads (parallel.take), None: all


class _Assembler:
    """Lays checkpoint tensors into our weights on `device` in `dtype`: whole tensors as they are,
    per-expert tensors into stacked buffers allocated once, Qwen3-Next's fused GDN projections split."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device, tp=None):
        from .parallel import first_expert, local_config, shard_ranges, sharded_shapes

        self.cfg, self.dtype, self.device = cfg, dtype, device
        tp = tp if tp is not None and tp.size > 1 else None
        full = weight_shapes(cfg)
        self.shapes = sharded_shapes(cfg, tp) if tp else full
        self.layout = checkpoint_shapes(cfg)
        self.local = local_config(cfg, tp.size, tp.moe) if tp else cfg  # the shard's sizes (Qwen3-Next's splits)
        ranges = (lambda name: shard_ranges(name, cfg, tp)) if tp else (lambda name: None)
        first = first_expert(cfg, tp)
        self.out: dict[str, torch.Tensor] = {}
        self.pieces: dict[str, _Piece] = {}
        self.stacked_of: dict[str, str] = {}  # per-expert name -> the stacked name that also provides it
        IE = self.local.moe_intermediate_size  # this rank's rows of each expert (split within: a slice)
        for name, shape in self.shapes.items():
            stacked, fusion = _STACKED_EXPERTS.fullmatch(name), _gdn_fusion(cfg, name)
            if stacked:
                parts = _expert_names(stacked.group(1), stacked.group(2), cfg.num_experts)
                self.pieces[name] = _Piece(full[name], tuple(parts), self._whole(name), ranges(name))
                for part in parts:
                    e, which = part[len(stacked.group(1)):].split(".")[:2]
                    rows = {"gate_proj": slice(0, IE), "up_proj": slice(IE, 2 * IE), "down_proj": slice(None)}[which]
                    local = int(e) - first
                    if 0 <= local < shape[0]:
                        self.pieces[part] = _Piece(self.layout[part], (part,), self._expert(name, local, rows),
                                                   ranges(part))
                    else:  # another rank's expert: none of it is read
                        self.pieces[part] = _Piece(self.layout[part], (part,), lambda t: None, (0, [(0, 0)]))
                    self.stacked_of[part] = name
            elif fusion:
                fused, partner = fusion
                split = split_qkvz if "qkvz" in fused else split_ba
                rows = self.layout[fused][0]  # the rank's key-head groups are one run of rows
                group = rows // cfg.linear_num_key_heads * self.local.linear_num_key_heads
                part = (0, [(tp.rank * group, (tp.rank + 1) * group)]) if tp else None
                self.pieces[fused] = _Piece(self.layout[fused], (fused,), self._split((name, partner), split), part)
            elif fusion is None:
                self.pieces[name] = _Piece(self.layout.get(name, shape), (name,), self._whole(name), ranges(name))

    def _converted(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype)

    def _whole(self, name):
        def place(t):
            self.out[name] = self._converted(t)
            return self.out[name]
        return place

    def _expert(self, name, e, rows):
        def place(t):  # copied straight into the stacked buffer: no converted copy of the expert
            if name not in self.out:
                self.out[name] = torch.empty(self.shapes[name], dtype=self.dtype, device=self.device)
            view = self.out[name][e, rows]
            view.copy_(t)
            return view
        return place

    def _split(self, names, split):
        def place(t):
            t = self._converted(t)
            self.out[names[0]], self.out[names[1]] = split(t, self.local)
            return t
        return place


def _our_name(key: str) -> str | None:
    """Checkpoint key -> our name; None for tensors a text prefill skips."""
    if key.startswith(_SKIPPED_PREFIXES):
        return None
    if key == "lm_head.weight":
        return key
    for prefix in _TEXT_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def checkpoint_files(folder: str) -> list[str]:
    """The safetensors files of a checkpoint folder: the shards of the index, or the single file."""
    index = os.path.join(folder, "model.safetensors.index.json")
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
        missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
        if missing:
            raise ValueError(f"{index} names shards that are not in {folder}: {missing}")
        return [os.path.join(folder, f) for f in files]
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if len(found) == 1:
        return [os.path.join(folder, found[0])]
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {folder}")


def load_checkpoint(folder: str, cfg: ModelConfig, dtype: torch.dtype, device,
                    progress: bool = True, check_finite: bool = True, tp=None) -> dict[str, torch.Tensor]:
    """Read every tensor the config needs from a safetensors checkpoint folder, in our layout
    (weight_shapes): per-expert tensors are copied into stacked buffers allocated once on `device`,
    stacked ones are taken as they are; Qwen3-Next's fused GDN projections are split (module docstring).

    Raises ValueError naming the tensor and its file for a missing, unexpected, duplicate, mis-shaped
    or non-floating-point one (per expert: `layers.3.mlp.experts.17.up_proj.weight`), and for a file
    safetensors cannot read. Tensors of the vision tower and the MTP head are skipped. A tied model
    takes a stored lm_head equal to the embeddings as tied and refuses (ValueError naming
    tie_word_embeddings) one that differs: transformers does not tie such a pair, it runs the stored lm_head.

    `check_finite` rejects a tensor holding NaN or infinity once it is on `device` in `dtype`
    (so a value beyond float16's range counts too). It reads every weight once more: for the 9B
    model's 19 GB in bfloat16, about 40 ms on an H200 and about 4.5 s on 2 CPU cores (measured
    4.4 GB/s in bfloat16, 6.3 GB/s in float32; torch.isfinite(t).all() reads 0.3 GB/s there).

    With a tensor-parallel `tp` (parallel.TensorParallel), only this rank's shard of each tensor is
    read from the files (and only its experts); the vocabulary shards are padded to ceil(V / tp).
    """
    from safetensors import SafetensorError, safe_open

    from .parallel import pad_vocab, take

    asm = _Assembler(cfg, dtype, device, tp)
    given: dict[str, str] = {}  # checkpoint_shapes name -> the checkpoint key that gave it
    given_in: dict[str, str] = {}  # checkpoint key -> its file
    unexpected = []  # (key, file)
    tied_head = None  # (key, file) of a stored lm_head.weight in a tied model: checked against the embeddings
    files = checkpoint_files(folder)
    bar = tqdm(total=len(asm.layout), desc="loading weights", unit="tensor", disable=not progress, leave=False)
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    name = _our_name(key)
                    if name == "lm_head.weight" and cfg.tie_word_embeddings:
                        tied_head = (key, path)
                        continue
                    if name is None:
                        continue
                    piece = asm.pieces.get(name)
                    if piece is None:
                        unexpected.append((key, path))
                        continue
                    for unit in piece.units:
                        if unit in given:
                            other = given[unit]
                            if _our_name(other) == name:
                                raise ValueError(f"tensor {key!r} appears twice in the checkpoint ({path}; "
                                                 f"{other!r} in {given_in[other]})")
                            raise ValueError(f"tensor {key!r} ({path}) holds weights that {other!r} holds too "
                                             f"(in {given_in[other]}; a layer's experts come either stacked or "
                                             "one tensor per expert)")
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != piece.shape:
                        raise ValueError(f"tensor {key!r} has shape {shape}, the config needs {piece.shape} "
                                         f"({path})")
                    stored_dtype = f.get_slice(key).get_dtype()
                    if stored_dtype not in _REAL_FLOAT:
                        raise ValueError(f"tensor {key!r} in {path} is {_dtype_name(stored_dtype)}; expected "
                                         "floating-point weights (quantized checkpoints are not supported)")
                    stored = take(f.get_slice(key), piece.ranges) if piece.ranges else f.get_tensor(key)
                    written = piece.place(stored)
                    if written is not None and check_finite and not _finite(written):
                        what = (f"values beyond the range of {dtype}" if _finite(stored)
                                else "NaN or infinite values")
                        raise ValueError(f"tensor {key!r} in {path} holds {what}")
                    given.update(dict.fromkeys(piece.units, key))
                    given_in[key] = path
                    bar.update(len(piece.units))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read safetensors file {path}: {e}") from None
    bar.close()
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} unexpected tensor(s), e.g. "
                         + ", ".join(f"{k!r} in {f}" for k, f in unexpected[:5]))
    missing = [n for n in asm.layout if n not in given]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. "
                         f"{_collapse(missing, asm, given)[:5]}")
    if tied_head is not None:
        _check_tied_head(asm, *tied_head)
    return pad_vocab(asm.out, cfg, tp) if tp is not None and tp.size > 1 else asm.out


def _check_tied_head(asm: _Assembler, key: str, path: str) -> None:
    """A tied model's checkpoint stores lm_head.weight too: fine when it equals the embeddings (this rank's
    rows of it under tensor parallelism), else ValueError. transformers ties the pair only when the two are
    equal; otherwise it warns and runs the stored lm_head, which a tied model here would silently ignore."""
    from safetensors import safe_open

    from .parallel import take

    embed = asm.pieces["embed_tokens.weight"]
    with safe_open(path, framework="pt", device="cpu") as f:
        shape = tuple(f.get_slice(key).get_shape())
        if shape != embed.shape:
            raise ValueError(f"tensor {key!r} has shape {shape}, the config needs {embed.shape} ({path})")
        head = take(f.get_slice(key), embed.ranges) if embed.ranges else f.get_tensor(key)
    if not torch.equal(asm._converted(head), asm.out["embed_tokens.weight"]):
        raise ValueError(f"the config sets tie_word_embeddings (lm_head is embed_tokens) but the checkpoint stores "
                         f"a different {key!r} ({path}); transformers runs the stored one untied: set "
                         "tie_word_embeddings to false in config.json to load it")


def _collapse(missing: list[str], asm: _Assembler, given: dict[str, str]) -> list[str]:
    """Missing checkpoint tensors by name; where the checkpoint stores experts stacked, a stacked tensor
    missing whole is named as such rather than expert by expert."""
    stacked = any(_STACKED_EXPERTS.fullmatch(_our_name(k) or "") for k in given.values())
    absent, out = set(missing), []
    for name in missing:
        whole = asm.stacked_of.get(name)
        if stacked and whole and all(u in absent for u in asm.pieces[whole].units):
            if whole not in out:
                out.append(whole)
        else:
            out.append(name)
    return out


# safetensors' names of the real floating-point dtypes a weight may be stored in; any other (integers,
# bool, complex, float4, the exponent-only float8 scale format) is refused, not converted
_REAL_FLOAT = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}
_SAFETENSORS_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
                       "U32": "uint32", "I64": "int64", "U64": "uint64", "C64": "complex64", "F4": "float4_e2m1fn_x2",
                       "F8_E8M0": "float8_e8m0fnu"}


def _dtype_name(stored: str) -> str:
    """A safetensors dtype name as torch's (torch.int8), or as safetensors writes it when torch has no name."""
    name = _SAFETENSORS_DTYPES.get(stored)
    return f"torch.{name}" if name and hasattr(torch, name) else stored


def _finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in t (NaN propagates through min / max; one pass, no temporary)."""
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def random_weights(cfg: ModelConfig, dtype: torch.dtype, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of realistic scale (random on the target device: fast for the 9B shape)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        t = torch.empty(shape, dtype=torch.float32 if len(shape) == 1 else dtype, device=device)
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
        if name.endswith("A_log"):
            t.uniform_(1.0, 16.0, generator=gen).log_()
        elif name.endswith("dt_bias"):
            t.uniform_(0.5, 1.5, generator=gen)
        elif leaf == "norm" and ".linear_attn." in name:  # gated norm: plain weight around 1
            t.normal_(1.0, 0.1, generator=gen)
        elif len(shape) == 1:  # zero-centred RMSNorm weights
            t.normal_(0.0, 0.1, generator=gen)
        elif leaf == "conv1d":
            t.uniform_(-0.5, 0.5, generator=gen)
        else:  # embeddings and projections: transformers' initializer_range
            t.normal_(0.0, 0.02, generator=gen)
        out[name] = t.to(dtype)
    return out


def save_checkpoint(weights: dict[str, torch.Tensor], cfg: ModelConfig, folder: str) -> None:
    """Write a Hugging Face text checkpoint (`config.json` + `model.safetensors`) as transformers'
    save_pretrained writes it for the family (experts one tensor each, Qwen3-Next's GDN projections
    fused), which `transformers.<Family>ForCausalLM.from_pretrained` and `HybridModel.from_pretrained` read."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    tensors = {(n if n == "lm_head.weight" else "model." + n): t.detach().contiguous().cpu()
               for n, t in to_checkpoint(weights, cfg).items()}
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf()
    hf["dtype"] = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)

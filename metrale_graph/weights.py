"""Weights: the expected tensors of a config, safetensors loading in Hugging Face layout
(single file or sharded, text-only or multimodal), random initialization, and saving.

Our parameter names are the Hugging Face ones without the `model.` prefix
(`layers.3.linear_attn.in_proj_qkv.weight`, `embed_tokens.weight`, `lm_head.weight`), so a
checkpoint maps onto the model name for name.
"""

from __future__ import annotations

import json
import os

import torch
from tqdm.auto import tqdm

from .config import ModelConfig

# Checkpoint prefixes of the language model, most specific first.
_TEXT_PREFIXES = ("model.language_model.", "model.")
# Tensors of other parts of a multimodal / MTP checkpoint that a text prefill never uses.
_SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by name, with its shape."""
    D, I = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, D)}
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (D,)
        shapes[p + "post_attention_layernorm.weight"] = (D,)
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
# each group as one GEMM without copying (ops.kernels.stacked).
STACKED_GROUPS = {
    "linear_attn.": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    "self_attn.": ("q_proj", "k_proj", "v_proj"),
    "mlp.": ("gate_proj", "up_proj"),
}


def stack_projections(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Re-home each layer's STACKED_GROUPS weights as row views of one buffer (in place in the dict,
    one group at a time, so the peak is one extra group)."""
    for i in range(cfg.num_hidden_layers):
        for prefix, members in STACKED_GROUPS.items():
            names = [f"layers.{i}.{prefix}{m}.weight" for m in members]
            if names[0] not in weights:
                continue
            parts = [weights[n] for n in names]
            buf = torch.cat(parts)
            row = 0
            for n, p in zip(names, parts):
                weights[n] = buf[row:row + p.shape[0]]
                row += p.shape[0]
    return weights


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
        except (OSError, ValueError) as e:  # ValueError: malformed JSON or not UTF-8
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
                    progress: bool = True, check_finite: bool = True) -> dict[str, torch.Tensor]:
    """Read every tensor the config needs from a safetensors checkpoint folder.

    Raises ValueError naming the tensor and its file for a missing, unexpected, mis-shaped or
    non-floating-point one, and for a file safetensors cannot read. Tensors of the vision tower
    and the MTP head are skipped; a tied model ignores a stored lm_head.

    `check_finite` rejects a tensor holding NaN or infinity once it is on `device` in `dtype`
    (so a value beyond float16's range counts too). It reads every weight once more: for the 9B
    model's 19 GB in bfloat16, about 40 ms on an H200 and about 4.5 s on 2 CPU cores (measured
    4.4 GB/s in bfloat16, 6.3 GB/s in float32; torch.isfinite(t).all() reads 0.3 GB/s there).
    """
    from safetensors import SafetensorError, safe_open

    expected = weight_shapes(cfg)
    out: dict[str, torch.Tensor] = {}
    unexpected = []
    files = checkpoint_files(folder)
    bar = tqdm(total=len(expected), desc="loading weights", unit="tensor", disable=not progress, leave=False)
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    name = _our_name(key)
                    if name is None or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                        continue
                    if name not in expected:
                        unexpected.append(key)
                        continue
                    if name in out:
                        raise ValueError(f"tensor {key!r} appears twice in the checkpoint ({path})")
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != expected[name]:
                        raise ValueError(f"tensor {key!r} has shape {shape}, the config needs {expected[name]} "
                                         f"({path})")
                    stored = f.get_tensor(key)
                    if not stored.dtype.is_floating_point:
                        raise ValueError(f"tensor {key!r} in {path} is {stored.dtype}; expected floating-point "
                                         "weights (quantized checkpoints are not supported)")
                    out[name] = stored.to(device=device, dtype=dtype)
                    if check_finite and not _finite(out[name]):
                        what = (f"values beyond the range of {dtype}" if _finite(stored)
                                else "NaN or infinite values")
                        raise ValueError(f"tensor {key!r} in {path} holds {what}")
                    bar.update(1)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read safetensors file {path}: {e}") from None
    bar.close()
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} unexpected tensor(s), e.g. {unexpected[:5]}")
    missing = [n for n in expected if n not in out]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. {missing[:5]}")
    return out


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
    """Write a Hugging Face text checkpoint (`config.json` + `model.safetensors`) that
    `transformers.Qwen3_5ForCausalLM.from_pretrained` and `HybridModel.from_pretrained` read."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    tensors = {(n if n == "lm_head.weight" else "model." + n): t.detach().contiguous().cpu()
               for n, t in weights.items()}
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf()
    hf["dtype"] = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)

"""Saving a Hugging Face checkpoint folder (`config.json` + `model.safetensors`) that transformers and
`HybridModel.from_pretrained` both load, also over a folder that already holds a checkpoint.

Every file is written under a temporary name in the folder and renamed into place once all are
written, so a failure (a full disk, Ctrl-C) leaves the folder as it was and no partial file. Then what
would be stale is removed: the shards of an earlier sharded save, by transformers' own rule in
`save_pretrained` (files named `model*-NNNNN-of-NNNNN.safetensors` / `.bin`), and its index (which
transformers leaves behind; both loaders prefer `model.safetensors` to it); and a
`generation_config.json` that is not this model's (the model's own, from the folder it was loaded
from, is copied in: transformers writes the model's generation config too).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil

import torch

from .config import ModelConfig
from .quantized import kept_modules
from .weights import INDEX_FILE, WEIGHTS_FILE, checkpoint_key, to_checkpoint

GENERATION_CONFIG = "generation_config.json"
_SHARD = re.compile(r"(.*?)-\d{5}-of-\d{5}")  # transformers' save_pretrained: a shard of an earlier save


def save_checkpoint(weights: dict[str, torch.Tensor], cfg: ModelConfig, folder: str,
                    generation_config: str | None = None) -> None:
    """Write the checkpoint of `weights` (our names, whole tensors) as transformers' save_pretrained writes
    it for the family (experts one tensor each, the family's fusions fused, the MTP head under `mtp.` as Qwen's
    checkpoints keep it; an FP8 model's converted weights
    float8_e4m3fn with their fp32 weight_scale_inv, its quantization_config listing the modules it keeps in
    floating point) into `folder` (created when
    missing), with `generation_config` (a generation_config.json path, e.g. the model's source folder's)
    copied in when given. See the module docstring for what happens to the files already there. Raises
    ValueError when `folder` is a file."""
    from safetensors.torch import save_file

    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"cannot save a checkpoint into {folder!r}: it is a file, not a folder")
    tensors = {checkpoint_key(n): t.detach().contiguous().cpu() for n, t in to_checkpoint(weights, cfg).items()}
    hf = cfg.to_hf()
    hf["dtype"] = str(weights["embed_tokens.weight"].dtype).removeprefix("torch.")
    if cfg.quantization is not None:  # the modules kept in floating point by name: what was converted reads back
        hf["quantization_config"] = cfg.quantization.to_hf(kept_modules(cfg))
    os.makedirs(folder, exist_ok=True)
    own = os.path.join(folder, GENERATION_CONFIG)
    keep_generation_config = generation_config is not None
    if keep_generation_config and os.path.isfile(own) and os.path.samefile(generation_config, own):
        generation_config = None  # saved where it was loaded from: the file there is the model's own
    written: dict[str, str] = {}  # final name -> its temporary file
    try:
        written[WEIGHTS_FILE] = _temporary(folder, WEIGHTS_FILE)
        save_file(tensors, written[WEIGHTS_FILE], metadata={"format": "pt"})
        written["config.json"] = _temporary(folder, "config.json")
        with open(written["config.json"], "w") as f:
            json.dump(hf, f, indent=2)
        if generation_config is not None:
            written[GENERATION_CONFIG] = _temporary(folder, GENERATION_CONFIG)
            shutil.copyfile(generation_config, written[GENERATION_CONFIG])
    except BaseException:
        for path in written.values():
            if os.path.exists(path):
                os.unlink(path)
        raise
    for name, path in written.items():
        publish(path, os.path.join(folder, name))
    for name in stale_files(folder, keep_generation_config):
        os.unlink(os.path.join(folder, name))


def stale_files(folder: str, keep_generation_config: bool) -> list[str]:
    """The files of `folder` that a save of one `model.safetensors` leaves stale (module docstring)."""
    stale = []
    for name in sorted(os.listdir(folder)):
        if not os.path.isfile(os.path.join(folder, name)):
            continue
        stem = name.replace(".bin", "").replace(".safetensors", "")
        if ((name.startswith("model") and _SHARD.fullmatch(stem)) or name == INDEX_FILE
                or (name == GENERATION_CONFIG and not keep_generation_config)):
            stale.append(name)
    return stale


def publish(temporary: str, final: str) -> None:
    """Rename a written temporary file into place with the mode a new file of this process gets (0666 less the
    umask): safetensors writes its files 0600, which a server running as another user could not read."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(temporary, 0o666 & ~mask)
    os.replace(temporary, final)


def _temporary(folder: str, name: str) -> str:
    """A fresh hidden file name beside `name` in `folder` (no loader reads it: not *.safetensors)."""
    return os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")

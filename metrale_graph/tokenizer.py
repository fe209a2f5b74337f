"""Finding the engine's tokenizer and default stop tokens in a checkpoint folder.

A tokenizer is optional: without one the engine takes and returns token ids only. transformers
(`AutoTokenizer`) loads it from a folder; it is needed only when a folder holds tokenizer files.
"""

from __future__ import annotations

import inspect
import json
import os
import warnings

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(folder) -> bool:
    return isinstance(folder, (str, os.PathLike)) and os.path.isdir(folder) and any(
        os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES)


def resolve_tokenizer(tokenizer, model):
    """The tokenizer to use: `tokenizer` itself (an object with encode/decode), loaded from a folder
    path, or, when None, from the folder the model was loaded from (`model.name_or_path`) if it
    holds tokenizer files; else None. An explicit tokenizer that cannot be loaded raises
    ValueError; an automatic one that cannot warns and gives None."""
    if tokenizer is None:
        folder = getattr(model, "name_or_path", None)
        if not has_tokenizer_files(folder):
            return None
        try:
            return _load(folder)
        except Exception as e:  # the model still runs on token ids
            warnings.warn(f"no tokenizer: loading the one in {folder!r} failed ({type(e).__name__}: {e})")
            return None
    if isinstance(tokenizer, (str, os.PathLike)):
        if not os.path.isdir(tokenizer):
            raise ValueError(f"tokenizer folder {str(tokenizer)!r} does not exist")
        try:
            return _load(tokenizer)
        except Exception as e:
            raise ValueError(f"could not load a tokenizer from {str(tokenizer)!r}: {type(e).__name__}: {e}") from e
    if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
        raise ValueError(f"tokenizer must be a folder path or an object with encode() and decode(), "
                         f"got {type(tokenizer).__name__}")
    return tokenizer


def decode_kwargs(tokenizer) -> dict:
    """What to pass to `tokenizer.decode` besides the ids: skip_special_tokens=True where it takes it
    (transformers' tokenizers); nothing for a decode of the ids only (tiktoken's, sentencepiece's)."""
    try:
        params = inspect.signature(tokenizer.decode).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): transformers' API assumed
        return {"skip_special_tokens": True}
    takes = any(p.name == "skip_special_tokens" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    return {"skip_special_tokens": True} if takes else {}


def special_token_ids(tokenizer) -> frozenset[int]:
    """The ids whose text a decode with skip_special_tokens=True drops: transformers' added tokens marked special
    (Qwen3.5's `<think>` and `<tool_call>` among them) and its named special tokens; empty for a tokenizer
    without them."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    ids = {i for i, t in added.items() if getattr(t, "special", False)} if isinstance(added, dict) else set()
    return frozenset(ids | set(getattr(tokenizer, "all_special_ids", None) or ()))


def _load(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


# where a composite config.json keeps its text model's settings (transformers' GenerationConfig.from_model_config
# takes a setting the outer config leaves unset from the first of these it has)
TEXT_CONFIG_KEYS = ("decoder", "generator", "text_config")


def default_stop_ids(model, tokenizer) -> list[int]:
    """What transformers' generate stops on by default: `eos_token_id` of the model folder's
    generation_config.json (an int or a list), else of config.json (or of its text_config, for a
    multimodal config), else the tokenizer's eos token; [] when there is none."""
    folder = getattr(model, "name_or_path", None)
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(folder, name) if isinstance(folder, (str, os.PathLike)) else None
        if path and os.path.isfile(path):
            try:
                with open(path) as f:
                    cfg = json.load(f)
                eos = cfg.get("eos_token_id")
                if eos is None and name == "config.json":
                    inner = next((cfg[k] for k in TEXT_CONFIG_KEYS if isinstance(cfg.get(k), dict) and cfg[k]), {})
                    eos = inner.get("eos_token_id")
            except (OSError, ValueError, AttributeError):
                eos = None
            if eos is not None:
                return _ints(eos)
    eos = getattr(tokenizer, "eos_token_id", None)
    return _ints(eos) if eos is not None else []


def _ints(value) -> list[int]:
    values = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]

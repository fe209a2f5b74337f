"""Quantize a floating-point checkpoint (bf16 / fp16 / fp32, e.g. a fine-tuned model) into Qwen's
fine-grained FP8 format, the one Qwen's FP8 releases use and HybridModel.from_pretrained (and
transformers, vLLM, SGLang) load: each converted linear weight float8_e4m3fn with its
`weight_scale_inv` per 128 x 128 block (transformers' Fp8Quantize rule, ragged last blocks included),
a `quantization_config` in config.json. Prints what it converted; ends with one JSON line.

    python -m metrale_graph.tools.quantize --model BF16_FOLDER --out FOLDER [--modules-to-not-convert P ...]

Converted: the projections and experts the weight spec allows (attention q/k/v/o, GDN in_proj_qkv / z /
b / a / out_proj or Qwen3-Next's fused in_proj_qkvz / in_proj_ba, MLP and shared-expert gate / up /
down, every routed expert, and an MTP head's fc and its layer's projections), less the modules matching
--modules-to-not-convert (transformers' patterns; default Qwen's: in_proj_a, in_proj_b, in_proj_ba). The
router, the shared-expert gate, lm_head, embeddings, norms and the conv stay as they are, and so does the
vision tower of a checkpoint that has one. The checkpoint keeps its layout (tensor names, per-expert tensors, fusions
as stored), except experts stored stacked (transformers 5's `experts.gate_up_proj` [E, 2I, D] /
`experts.down_proj`): those are written one tensor per expert and part with their scales, as Qwen's FP8
releases and transformers' FP8 quantizer write them (a stacked gate | up whose parts are not whole
128-row blocks has no scale grid both readers agree on). The other files of the folder (tokenizer,
generation config, ...) are copied. Tensors are
read one at a time; every file is written under a temporary name and renamed into place at the end,
so a failure leaves --out without a partial checkpoint. A weight to convert holding NaN or infinite values is
an error naming it; a block of values too small for a normal scale (amax below 5.3e-36) gets the smallest
normal one, so every scale written loads.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time

import torch

from metrale_graph.quantization import QWEN_KEPT
from metrale_graph.tools.files import unwritable
from metrale_graph.tools.flags import device, non_negative_float
from metrale_graph.tools.report import ends_quietly, print_json, print_table, progress_bar


FILE_PATTERN = "model-{:05d}-of-{:05d}.safetensors"


def _folder(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a checkpoint folder")
    return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m metrale_graph.tools.quantize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=_folder, required=True, help="the floating-point checkpoint folder")
    p.add_argument("--out", required=True, help="the folder to write (created; must hold no checkpoint)")
    p.add_argument("--modules-to-not-convert", nargs="*", default=None, metavar="PATTERN",
                   help="modules kept in floating point, as transformers matches them (a regular expression "
                        "matched at the start of a module name, or a suffix: in_proj_a, "
                        "model.layers.0.self_attn.q_proj); default: " + " ".join(QWEN_KEPT))
    p.add_argument("--shard-size", type=non_negative_float, default=5.0,
                   help="GB per safetensors file at most (default 5; 0: one file)")
    p.add_argument("--device", type=device, default=torch.device("cpu"),
                   help="where the blocks are quantized (cpu, cuda, cuda:N; default cpu)")
    return p


def plan(folder: str, patterns: list[str] | None):
    """(the input's config.json dict, its ModelConfig, the FP8 ModelConfig, each checkpoint tensor's spec
    under the FP8 config by our name) for a floating-point checkpoint folder, its headers checked; ValueError
    naming the problem (no or a bad config.json, an FP8 checkpoint already, a fused tensor whose split is not
    whole 128-row blocks, a tensor the config does not need, ...)."""
    import dataclasses

    from metrale_graph.compressed_tensors import checkpoint_format
    from metrale_graph.families import MULTIMODAL
    from metrale_graph.quantized import fp8_config
    from metrale_graph.loader import check_checkpoint
    from metrale_graph.weights import checkpoint_config

    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{folder} has no config.json")
    # a ValueError naming the file for one that cannot be read or is not valid; the MTP head as the files hold it
    cfg = checkpoint_config(folder)
    with open(path) as f:
        raw = json.load(f)
    if cfg.quantization is not None or checkpoint_format(folder) is not None:
        raise ValueError(f"{folder} is an FP8 checkpoint already (its config.json has a quantization_config)")
    check_checkpoint(folder, cfg)
    fp8 = fp8_config(cfg, QWEN_KEPT if patterns is None else patterns)
    # the prefix the checkpoint names its text modules with (a multimodal wrapper's): patterns match against it
    wrapper = MULTIMODAL.get(raw.get("model_type"))
    prefix = wrapper[1].text_prefix if wrapper else "model."
    fp8 = fp8.replace(quantization=dataclasses.replace(fp8.quantization, prefix=prefix))
    return raw, cfg, fp8, checkpoint_specs(fp8)


def checkpoint_specs(fp8_cfg):
    """Our name -> spec under the FP8 config of every tensor a floating-point checkpoint of it holds (the
    ones to quantize: their fp8 spec; experts one tensor each, or stacked)."""
    from metrale_graph.spec import checkpoint_layout

    specs = {}
    for s in checkpoint_layout(fp8_cfg):
        specs[s.name] = s.spec
        if s.expert is not None and (s.expert, s.part) == (0, 0):
            specs[s.spec.name] = s.spec  # the experts stored stacked
    return specs


def per_expert(key: str, name: str, spec, stacked: torch.Tensor, dev: torch.device) -> dict[str, torch.Tensor]:
    """The FP8 tensors of stacked experts [E, parts * rows, K] (checkpoint key `key`, our name `name`) one per
    expert and part, each with its `weight_scale_inv`, under the names per-expert checkpoints use
    (`...experts.3.up_proj.weight`), the key's prefix kept."""
    from metrale_graph.quantization import scale_name
    from metrale_graph.quantized import quantize_weight
    from metrale_graph.spec import expert_name

    prefix = key[:len(key) - len(name)]
    rows = stacked.shape[1] // len(spec.parts)
    out = {}
    for e in range(stacked.shape[0]):
        for k, part in enumerate(spec.parts):
            q, s = quantize_weight(stacked[e, k * rows:(k + 1) * rows].to(dev))
            weight = prefix + expert_name(spec, e, part)
            out[weight], out[scale_name(weight)] = q.cpu(), s.cpu()
    return out


def quantize_checkpoint(folder: str, out: str, patterns: list[str] | None = None, shard_gb: float = 5.0,
                        dev: torch.device = torch.device("cpu"), progress: bool = False) -> dict:
    """Write the FP8 checkpoint of `folder` into `out` (module docstring). Returns counts for the report."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from metrale_graph.quantization import scale_name
    from metrale_graph.quantized import kept_modules, quantize_weight
    from metrale_graph.saving import _temporary, publish
    from metrale_graph.spec import EXPERTS, SCALE
    from metrale_graph.loader import SKIPPED_PREFIXES, our_name
    from metrale_graph.loader_checks import finite
    from metrale_graph.weights import INDEX_FILE, WEIGHTS_FILE, checkpoint_files

    raw, cfg, fp8, specs = plan(folder, patterns)
    files = checkpoint_files(folder)
    os.makedirs(out, exist_ok=True)
    limit = shard_gb * 1e9 if shard_gb > 0 else float("inf")
    shards: list[str] = []  # temporary files, in order
    weight_map: dict[str, int] = {}  # tensor -> shard index
    pending: dict[str, torch.Tensor] = {}
    counts = {"converted": 0, "kept": 0, "bytes_in": 0, "bytes_out": 0}
    skipped = set()

    def flush():
        if pending:
            shards.append(_temporary(out, f"shard{len(shards)}.safetensors"))
            save_file(pending, shards[-1], metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(pending, len(shards) - 1))
            pending.clear()

    total = sum(len(safe_open(p, framework="pt").keys()) for p in files)
    bar = progress_bar(total=total, desc="quantizing", unit="tensor") if progress else None
    written: list[tuple[str, str]] = []  # (temporary, final)
    try:
        size = 0
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    t = f.get_tensor(key)
                    counts["bytes_in"] += t.numel() * t.element_size()
                    name = our_name(key)
                    if name is None:
                        skipped.add(next(p for p in SKIPPED_PREFIXES if key.startswith(p)).rstrip("."))
                    spec = specs.get(name) if name is not None else None
                    if spec is not None and spec.fp8 and spec.kind != SCALE:
                        if not finite(t):  # no block scale represents them (the loader would refuse the codes)
                            raise ValueError(f"tensor {key!r} in {path} holds NaN or infinite values: it cannot be "
                                             "quantized (keep its module in floating point, or fix the weights)")
                        if spec.kind == EXPERTS and t.dim() == 3:  # stacked experts: one tensor each
                            out_tensors = per_expert(key, name, spec, t, dev)
                        else:
                            q, s = quantize_weight(t.to(dev))
                            out_tensors = {key: q.cpu(), scale_name(key): s.cpu()}
                        counts["converted"] += 1
                    else:
                        out_tensors = {key: t}
                        counts["kept"] += 1
                    for k, v in out_tensors.items():
                        nbytes = v.numel() * v.element_size()
                        if size + nbytes > limit and pending:
                            flush()
                            size = 0
                        pending[k] = v.contiguous()
                        size += nbytes
                        counts["bytes_out"] += nbytes
                    if bar is not None:
                        bar.update(1)
        flush()
        if bar is not None:
            bar.close()
        n = len(shards)
        finals = [WEIGHTS_FILE] if n == 1 else [FILE_PATTERN.format(i + 1, n) for i in range(n)]
        written += list(zip(shards, finals))
        if n > 1:
            index = {"metadata": {"total_size": counts["bytes_out"]},
                     "weight_map": {k: finals[i] for k, i in sorted(weight_map.items())}}
            written.append((_temporary(out, INDEX_FILE), INDEX_FILE))
            with open(written[-1][0], "w") as fh:
                json.dump(index, fh, indent=2)
        quant = fp8.quantization.to_hf(kept_modules(fp8, fp8.quantization.prefix) + sorted(skipped))
        config = dict(raw, quantization_config=quant)
        written.append((_temporary(out, "config.json"), "config.json"))
        with open(written[-1][0], "w") as fh:
            json.dump(config, fh, indent=2)
        for other in sorted(os.listdir(folder)):  # tokenizer, generation config, ...
            src = os.path.join(folder, other)
            if (os.path.isfile(src) and not other.startswith(".") and not other.endswith(".safetensors")
                    and other not in (INDEX_FILE, "config.json")):
                written.append((_temporary(out, other), other))
                shutil.copyfile(src, written[-1][0])
    except BaseException:
        for tmp in shards + [t for t, _ in written]:
            if os.path.exists(tmp):
                os.unlink(tmp)
        raise
    for tmp, final in written:
        publish(tmp, os.path.join(out, final))
    counts["files"] = len(finals)
    return counts


def main(argv=None) -> None:
    p = _parser()
    args = p.parse_args(argv)
    if not args.out.strip():
        p.error("--out is empty: name the folder to write")
    for pattern in args.modules_to_not_convert or ():
        try:
            re.compile(pattern)
        except re.error as e:
            p.error(f"--modules-to-not-convert: {pattern!r} is not a regular expression ({e})")
    out = os.path.abspath(args.out)
    if os.path.abspath(args.model) == out:
        p.error("--out must be another folder than --model")
    if os.path.isfile(out):
        p.error(f"--out {args.out!r} is a file; expected a folder")
    if os.path.isdir(out) and any(n == "config.json" or n.endswith(".safetensors") for n in os.listdir(out)):
        p.error(f"--out {args.out!r} holds a checkpoint already; choose an empty or new folder")
    parent = out if os.path.isdir(out) else os.path.dirname(out)
    if not os.path.isdir(parent):
        p.error(f"--out {args.out!r}: folder {parent} does not exist")
    why = unwritable(parent)
    if why:
        p.error(f"--out {args.out!r}: cannot write into {parent} ({why})")
    start = time.perf_counter()
    try:
        counts = quantize_checkpoint(args.model, args.out, args.modules_to_not_convert, args.shard_size, args.device,
                                     progress=sys.stderr.isatty())
    except ValueError as e:
        p.error(f"--model {args.model}: {e}")
    seconds = time.perf_counter() - start
    print_table(["tensors converted", "kept", "GB in", "GB out", "files", "seconds"],
                [[counts["converted"], counts["kept"], f"{counts['bytes_in'] / 1e9:.3f}",
                  f"{counts['bytes_out'] / 1e9:.3f}", counts["files"], f"{seconds:.1f}"]])
    print_json({"tool": "quantize", "model": args.model, "out": args.out, "seconds": round(seconds, 2),
                **{k: counts[k] for k in ("converted", "kept", "bytes_in", "bytes_out", "files")}})


def cli() -> None:
    with ends_quietly():
        main()


if __name__ == "__main__":
    cli()

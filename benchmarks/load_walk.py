"""The walk of weight loading through the package's files: `HybridModel.from_pretrained` of a tiny Qwen3-Next FP8
checkpoint with an MTP head (its GDN fusions, FP8 block scales, experts one tensor each), as tensor-parallel rank 0
of 2 computed on the CPU (the ranks' agreement on the load answered locally: one process plays rank 0 alone).

Counts from a profile hook (sys.setprofile) over the call:

- the walk: the package's functions in the order the load first calls them, each once: what a reader follows to
  learn how a tensor gets from the files into the model. A stay is a run of consecutive functions of one file; a
  return is a stay in a file the walk was in before (returns = stays - files).
- the reader's walk: the same without what a reader takes in where it is used: property getters (a config's
  derived sizes, a spec's name parts), comprehensions, generator expressions and lambdas.
- crossings: calls from a function of one package file into another's, every call counted (the load's tensors
  each walk their own path; this grows with the tensor count).

    python benchmarks/load_walk.py [--moe within|expert] [--ranks 2] [--walk]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIRS = tuple(os.path.join(ROOT, d) + os.sep for d in ("metrale_graph", "ops", "capture", "tools"))


def fp8_mtp_config():
    """A Qwen3-Next shape whose every FP8 weight splits over 2 ranks on 128-blocks (tests/test_tensor_parallel.py's
    FP8_NEXT) with one MTP layer, FP8 as Qwen's releases convert it (QWEN_KEPT)."""
    from metrale_graph.config import ModelConfig, default_layer_types
    from metrale_graph.quantization import QWEN_KEPT
    from metrale_graph.quantized import fp8_config

    cfg = ModelConfig(vocab_size=256, hidden_size=96, intermediate_size=80, num_hidden_layers=4,
                      layer_types=default_layer_types(4), num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                      partial_rotary_factor=0.5, rope_theta=10000.0, linear_num_key_heads=2, linear_num_value_heads=2,
                      linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=2048,
                      model_type="qwen3_next", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                      shared_expert_intermediate_size=256, mtp_num_hidden_layers=1)
    return fp8_config(cfg, QWEN_KEPT)


def _local_rank(rank: int, size: int, moe: str):
    """A TensorParallel of rank `rank` of `size` whose only collective the load uses (the ranks' agreement that
    every one loaded) is answered by this process alone: the other ranks loaded."""
    from metrale_graph.parallel import TensorParallel

    class LocalRank(TensorParallel):
        def all_reduce(self, x):
            return x

    return LocalRank(rank, size, moe=moe)


def _file(code) -> str | None:
    path = os.path.abspath(code.co_filename)
    return os.path.relpath(path, ROOT) if path.startswith(PACKAGE_DIRS) else None


def trace(fn) -> tuple[list[tuple[str, str, object]], collections.Counter]:
    """Run fn() under a profile hook: the package's functions in first-call order as (file, function, code), and
    the calls from one package file into another, by (caller's file, callee's file)."""
    first: dict = {}
    crossings: collections.Counter = collections.Counter()

    def hook(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        where = _file(code)
        if where is None or code.co_name == "<module>":
            return
        if code not in first:
            first[code] = (where, code.co_qualname, code)
        caller = frame.f_back
        while caller is not None and _file(caller.f_code) is None:  # through torch / safetensors frames
            caller = caller.f_back
        if caller is not None and (origin := _file(caller.f_code)) != where:
            crossings[origin, where] += 1

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return list(first.values()), crossings


def _read_in_place(code, getters: set) -> bool:
    """Whether a reader takes the function in where it is used: a property getter, a comprehension or a lambda."""
    return code in getters or code.co_name.startswith("<")


def property_getters() -> set:
    """The code of every property getter of the package's classes (those of the modules loaded so far)."""
    out = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("metrale_graph") or module is None:
            continue
        for cls in vars(module).values():
            if isinstance(cls, type) and cls.__module__ == name:
                out.update(v.fget.__code__ for v in vars(cls).values()
                           if isinstance(v, property) and hasattr(v.fget, "__code__"))
    return out


def stays(walk: list[tuple[str, str, object]]) -> list[tuple[str, list[str]]]:
    """The walk's runs of consecutive functions of one file: (file, its functions)."""
    out: list[tuple[str, list[str]]] = []
    for where, name, _ in walk:
        if out and out[-1][0] == where:
            out[-1][1].append(name)
        else:
            out.append((where, [name]))
    return out


def measure(moe: str = "within", ranks: int = 2) -> dict:
    """Save the checkpoint, then trace its load as rank 0 of `ranks` (1: one process, no tensor parallelism)."""
    import torch

    from metrale_graph import HybridModel

    cfg = fp8_mtp_config()
    with tempfile.TemporaryDirectory() as folder:
        HybridModel.from_preset(cfg, seed=0).save_pretrained(folder)
        tp = _local_rank(0, ranks, moe) if ranks > 1 else None
        loaded = []
        walk, crossings = trace(lambda: loaded.append(HybridModel.from_pretrained(folder, progress=False, tp=tp)))
    model = loaded[0]
    scales = sum(1 for n, _ in model.named_parameters() if n.endswith("_scale_inv"))
    assert model.mtp is not None and scales and model.dtype == torch.float32
    runs = stays(walk)
    entered = collections.Counter(where for where, _ in runs)
    getters = property_getters()
    reader = stays([w for w in walk if not _read_in_place(w[2], getters)])
    reader_entered = collections.Counter(where for where, _ in reader)
    return {"tool": "load_walk", "moe": moe, "ranks": ranks, "functions": len(walk), "stays": len(runs),
            "files": len(entered), "returns": len(runs) - len(entered), "entered": dict(entered.most_common()),
            "reader": {"functions": sum(len(n) for _, n in reader), "stays": len(reader), "files": len(reader_entered),
                       "returns": len(reader) - len(reader_entered), "entered": dict(reader_entered.most_common())},
            "crossings": sum(crossings.values()), "walk": [f"{w}: {', '.join(names)}" for w, names in runs],
            "reader_walk": [f"{w}: {', '.join(names)}" for w, names in reader]}


def main(argv=None) -> None:
    from metrale_graph.tools.flags import positive_int
    from metrale_graph.tools.report import print_json, print_table

    p = argparse.ArgumentParser(prog="python benchmarks/load_walk.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--moe", choices=("within", "expert"), default="within", help="how the experts split over ranks")
    p.add_argument("--ranks", type=positive_int, default=2, help="tensor-parallel ranks (this process is rank 0)")
    p.add_argument("--walk", action="store_true", help="print the walk, stay by stay")
    p.add_argument("--reader", action="store_true", help="with --walk: the reader's walk")
    args = p.parse_args(argv)
    record = measure(args.moe, args.ranks)
    if args.walk:
        for i, stay in enumerate(record["reader_walk" if args.reader else "walk"], 1):
            print(f"{i:3d} {stay}")
    reader = record["reader"]
    print_table(["file", "stays", "reader's stays"], [[f, str(n), str(reader["entered"].get(f, 0))]
                                                      for f, n in record["entered"].items()])
    for what, r in (("walk", record), ("reader's walk", reader)):
        print(f"{what}: {r['functions']} functions, {r['stays']} stays in {r['files']} files, {r['returns']} returns")
    print(f"{record['crossings']} calls from one file into another")
    print_json({k: v for k, v in record.items() if k not in ("walk", "reader_walk")})


if __name__ == "__main__":
    main()

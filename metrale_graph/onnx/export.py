"""ONNX export of the packed prefill step (`HybridModel.forward_packed`) for one bucket (B, T).

    program = export_prefill(model, cache, batch_size=B, num_tokens=T)
    save_onnx(program, "prefill.onnx")  # whole and checked, or not at all (files.py)

The graph (fixed shapes: one file per bucket and cache geometry) takes the step's inputs in
`PackedBatch.names()` order, then the cache's pools in `HybridCache.pool_names()` order, and
returns logits [B, vocab] and every pool updated, named `<pool>_out`. Weights are initializers.
Batches are padded to the bucket by the one padding contract (metrale_graph/batch.py). Every
`metrale::` op becomes standard ONNX operators (translations.py, found through each op's spec),
so the file runs in plain onnxruntime.

How the state mutations get into the graph, with public APIs only: while the module is traced,
each op that mutates a pool is replaced in the op table `metrale_graph.ops.OPS` by a shim (`functional_ops`)
that calls the op's functional twin `metrale_onnx::<op>` (a custom op built from the op's
declared signature: the same arguments, returning the op's outputs and then the new value of
each mutated argument) and writes the new values back with `copy_`, which torch.export
functionalizes like any in-place op. `PrefillStep` runs the model on clones of the pools and
returns them. The translation table maps each twin to its op's translation.
"""

from __future__ import annotations

import contextlib
import importlib
import typing
from typing import Callable

import numpy as np
import torch
from torch import Tensor, nn

from ..batch import PackedBatch
from ..cache import HybridCache
from ..ops import OPS, REGISTRY, OpSpec
from .translations import ATEN, OPSET

_TWINS: dict[str, "torch._ops.OpOverload"] = {}


class PrefillStep(nn.Module):
    """`model.forward_packed` as a function of tensors: forward(*batch tensors, *pools) ->
    (logits [B, vocab], *updated pools). The pools are cloned first and left untouched."""

    def __init__(self, model, cache: HybridCache):
        super().__init__()
        self.model, self.cache = model, cache

    def forward(self, *inputs):
        n = len(PackedBatch.names())
        batch, pools = PackedBatch(*inputs[:n]), [p.clone() for p in inputs[n:]]
        return (self.model.forward_packed(self.cache.pool_view(pools), batch), *pools)


# functional twins of the mutating ops ---------------------------------------------------------------
def _outputs_of(spec: OpSpec) -> list:
    ret = spec.signature.return_annotation
    return list(typing.get_args(ret)) if typing.get_origin(ret) is tuple else [ret]


def _exported(spec: OpSpec) -> list[str]:
    """The op's parameters an export passes: all but the optional tensors defaulting to None (prefix
    caching's checkpoints, which an exported step does not keep: export_prefill refuses such a cache)."""
    return [n for n, p in spec.signature.parameters.items() if not (p.default is None and "Tensor" in str(p.annotation))]


def _mutated(spec: OpSpec) -> list[int]:
    """Positions, among the exported parameters, of the ones the op mutates."""
    return [i for i, n in enumerate(_exported(spec)) if n in spec.mutates]


def twin(spec: OpSpec) -> "torch._ops.OpOverload":
    """`metrale_onnx::<name>`: the op with its mutated arguments taken by value and their new values
    returned after the op's outputs."""
    if spec.name in _TWINS:
        return _TWINS[spec.name]
    where = _mutated(spec)
    names = _exported(spec)

    def functional(*args):
        args = list(args)
        for i in where:
            args[i] = args[i].clone()
        out = spec.op(*args)
        return (*(out if isinstance(out, tuple) else (out,)), *(args[i] for i in where))

    returns = tuple.__class_getitem__(tuple(_outputs_of(spec) + [Tensor] * len(where)))
    functional.__signature__ = spec.signature.replace(
        parameters=[spec.signature.parameters[n] for n in names], return_annotation=returns)
    op = torch.library.custom_op(f"metrale_onnx::{spec.name}", functional, mutates_args=())
    op.register_fake(functional)
    _TWINS[spec.name] = getattr(torch.ops.metrale_onnx, spec.name).default
    return _TWINS[spec.name]


@contextlib.contextmanager
def functional_ops():
    """Inside the block, every mutating op in the table `metrale_graph.ops.OPS` runs through its twin and
    writes the new values of its mutated arguments back with copy_ (what torch.export can trace)."""
    saved = {}
    for spec in REGISTRY.values():
        if not spec.mutates:
            continue
        fn, n_out = twin(spec), len(_outputs_of(spec))
        where = _mutated(spec)

        def shim(*args, _fn=fn, _n=n_out, _where=where):
            result = _fn(*args)
            for i, new in zip(_where, result[_n:]):
                args[i].copy_(new)
            return result[0] if _n == 1 else tuple(result[:_n])

        saved[spec.name] = getattr(OPS, spec.name)
        setattr(OPS, spec.name, shim)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(OPS, name, fn)


def translation(spec: OpSpec) -> Callable | None:
    """The op's ONNX translation (its spec's "module:function" pointer), or None."""
    if spec.onnx is None:
        return None
    module, _, function = spec.onnx.partition(":")
    return getattr(importlib.import_module(module), function)


def _metrale_ops(program: torch.export.ExportedProgram) -> set[str]:
    """Names of the metrale ops (direct or as twins) a program calls."""
    found = set()
    for gm in program.graph_module.modules():
        if isinstance(gm, torch.fx.GraphModule):
            for node in gm.graph.nodes:
                target = node.target
                if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and \
                        target.namespace in ("metrale", "metrale_onnx"):
                    found.add(target.name().split("::")[1].split(".")[0])
    return found


def export_onnx(module: nn.Module, args: tuple, translations: dict[str, Callable] | None = None,
                input_names: list[str] | None = None, output_names: list[str] | None = None,
                optimize: bool = True, progress: Callable[[str], None] | None = None):
    """Export `module(*args)` (fixed shapes), its metrale ops translated by `translations` (op name ->
    onnxscript translation; default: each registered op's own). The module must call the ops through
    `metrale_graph.ops.OPS` (functional_ops swaps the mutating ones there). Returns the ONNXProgram.

    Raises ValueError naming the first metrale op the module calls that has no translation."""
    from .versions import check_versions

    check_versions()
    if translations is None:
        translations = {name: fn for name, fn in ((n, translation(s)) for n, s in REGISTRY.items()) if fn}
    unknown = sorted(set(translations) - set(REGISTRY))
    if unknown:
        raise ValueError(f"translations for unknown ops {unknown}; metrale ops: {', '.join(REGISTRY)}")
    step = progress or (lambda _: None)
    step("torch.export")
    with torch.no_grad(), functional_ops():
        program = torch.export.export(module, args, strict=False).run_decompositions({})
    missing = sorted(f"metrale::{n}" for n in _metrale_ops(program) if n not in translations)
    if missing:
        raise ValueError(f"no ONNX translation for {missing[0]}" + (f" (nor {', '.join(missing[1:])})"
                                                                      if len(missing) > 1 else ""))
    table = {getattr(torch.ops.aten, name).default: fn for name, fn in ATEN.items()}
    for name, fn in translations.items():
        spec = REGISTRY[name]
        table[twin(spec) if spec.mutates else getattr(torch.ops.metrale, name).default] = fn
    step("translate to ONNX")
    return torch.onnx.export(program, (), dynamo=True, custom_translation_table=table, opset_version=OPSET,
                             input_names=input_names, output_names=output_names, optimize=optimize,
                             verbose=False)


def example_inputs(cache: HybridCache, batch_size: int, num_tokens: int) -> tuple[Tensor, ...]:
    """Inputs of the bucket's shapes (all padding): what the export traces; values do not matter."""
    return step_args(PackedBatch.padding(batch_size, num_tokens, cache), cache)


def step_args(batch: PackedBatch, cache: HybridCache) -> tuple[Tensor, ...]:
    """The graph's inputs, in order, for a packed batch on a cache."""
    return (*batch.tensors(), *cache.pools())


def export_prefill(model, cache: HybridCache, batch_size: int, num_tokens: int,
                   translations: dict[str, Callable] | None = None, optimize: bool = True,
                   progress: Callable[[str], None] | None = None):
    """Export `model.forward_packed` for bucket (batch_size, num_tokens) on `cache`'s geometry
    (slots, blocks, block size, blocks per stream). Returns the ONNXProgram.

    The model must be whole: a tensor-parallel shard's collectives have no ONNX form (ValueError); and
    floating point: an FP8 model (config.quantization) is refused (ValueError), its W8A8 projections
    (per-token dynamic FP8 activations) having no translation here."""
    for name, value in (("batch_size", batch_size), ("num_tokens", num_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if getattr(cache, "checkpoint_tokens", None) is not None:
        raise ValueError("the cache keeps prefix-caching checkpoints inside the step (checkpoint_interval > 0), which "
                         "the exported step does not: export with a cache built without checkpoint_interval")
    tp = getattr(model, "tp", None)
    if tp is not None:
        raise ValueError(f"the ONNX export writes one whole model; this one is a tensor-parallel shard (rank "
                         f"{tp.rank} of {tp.size}): load the model without tp")
    if getattr(model.config, "quantization", None) is not None:
        raise ValueError("the ONNX export does not write FP8 models (a quantization_config with float8 weights): "
                         "its translations have no W8A8 projections; dequantize it first "
                         "(metrale_graph.quantized.dequantize_weights) or export the floating-point checkpoint")
    model.check_cache(cache)
    pools = cache.pool_names()
    return export_onnx(PrefillStep(model, cache), example_inputs(cache, batch_size, num_tokens), translations,
                       input_names=PackedBatch.names() + pools, output_names=["logits"] + [f"{p}_out" for p in pools],
                       optimize=optimize, progress=progress)


def ort_session(model, threads: int | None = None):
    """An onnxruntime CPU session of an ONNX model (path, bytes or ModelProto)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    if not isinstance(model, (str, bytes)):
        model = model.SerializeToString()
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def run_step(session, batch: PackedBatch, cache: HybridCache) -> dict[str, np.ndarray]:
    """Run an exported step in onnxruntime on a packed batch and the cache's pools (left as they
    are). Returns every output by name, as numpy arrays (bfloat16 ones as `ml_dtypes.bfloat16`,
    which numpy lacks; `.astype(np.float32)` is exact).

    A batch or cache that does not match the exported step (another bucket, a batch not padded to
    it, a cache of another geometry or model, a field of another dtype) raises ValueError naming the
    input."""
    inputs, names = session.get_inputs(), PackedBatch.names() + cache.pool_names()
    if [i.name for i in inputs] != names:
        raise ValueError(f"the exported step takes inputs {[i.name for i in inputs]}; this batch and cache give "
                         f"{names} (a cache of another model)")
    args = step_args(batch, cache)
    for i, t in zip(inputs, args):
        if list(t.shape) != list(i.shape):
            raise ValueError(f"input {i.name}: shape {list(t.shape)}, the exported step takes {list(i.shape)} (pad "
                             "the batch to the bucket with batch.padded(B, T, cache), on a cache of the export's "
                             "geometry)")
        if _ORT_DTYPES.get(i.type, t.dtype) != t.dtype:
            raise ValueError(f"input {i.name}: dtype {t.dtype}, the exported step takes {_ORT_DTYPES[i.type]}")
    # through OrtValues over numpy buffers: onnxruntime's numpy feeds and outputs take no bfloat16
    binding = session.io_binding()
    for i, t in zip(inputs, args):
        binding.bind_ortvalue_input(i.name, _ort_value(_numpy(t.detach().cpu().contiguous())))
    outputs = {o.name: _numpy(torch.empty(o.shape, dtype=_ORT_DTYPES[o.type])) for o in session.get_outputs()}
    for name, array in outputs.items():
        binding.bind_ortvalue_output(name, _ort_value(array))
    session.run_with_iobinding(binding)
    return outputs


_ORT_DTYPES = {"tensor(float)": torch.float32, "tensor(double)": torch.float64, "tensor(float16)": torch.float16,
               "tensor(bfloat16)": torch.bfloat16, "tensor(int64)": torch.int64, "tensor(int32)": torch.int32}


def _numpy(t: Tensor) -> np.ndarray:
    """A CPU tensor as a numpy array sharing its memory; bfloat16 as ml_dtypes.bfloat16."""
    if t.dtype != torch.bfloat16:
        return t.numpy()
    import ml_dtypes  # onnx's own dependency

    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def _ort_value(array: np.ndarray):
    """An onnxruntime OrtValue over a numpy array's memory (bfloat16 given its ONNX type by hand)."""
    import onnxruntime as ort

    if array.dtype.name != "bfloat16":
        return ort.OrtValue.ortvalue_from_numpy(array)
    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16), 16)  # TensorProto.BFLOAT16


def node_counts(model) -> dict[str, tuple[int, int]]:
    """op type -> (nodes in the main graph, nodes inside subgraphs) of an onnx ModelProto."""
    counts: dict[str, list[int]] = {}

    def walk(graph, inside: int):
        for node in graph.node:
            counts.setdefault(node.op_type, [0, 0])[inside] += 1
            for attr in node.attribute:
                for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    walk(g, 1)

    walk(model.graph, 0)
    return {k: (v[0], v[1]) for k, v in sorted(counts.items(), key=lambda kv: -sum(kv[1]))}

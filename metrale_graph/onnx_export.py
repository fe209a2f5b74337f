"""ONNX export of the packed prefill step (`HybridModel.forward_packed`) for one bucket (B, T).

    program = export_prefill(model, cache, batch_size=B, num_tokens=T)
    program.save("prefill.onnx")

The graph (fixed shapes: one file per bucket and cache geometry) takes
    tokens [T] int64, positions [T] int64, cu_seqlens [B+1] int32, slot_ids [B] int64,
    context_lens [B] int32, block_tables [B, MB] int32,
    conv_state_L{i} [S+1, C, W-1] and gdn_state_L{i} [S+1, HV, K, V] fp32 per GDN layer i,
    k_cache_L{i}, v_cache_L{i} [NB+1, BS, HKV, HD] per attention layer i,
and returns logits [B, vocab] and every pool updated, named `<pool>_out`. Weights are
initializers. Every `metrale::` op becomes standard ONNX operators (onnx_translations.py), so
the file runs in plain onnxruntime.

How the state mutations get into the graph: torch.export turns a call of a custom op that
mutates its arguments into `auto_functionalized_v2(op, ...)`, a higher-order op whose first
argument is the op overload. torch.onnx 2.13 cannot translate that node (it looks the overload up
as a graph value and fails with a KeyError), and it drops mutated graph inputs from the ONNX
outputs. So `PrefillStep` clones the pools it is given and returns the clones, and after
torch.export every `auto_functionalized(_v2)` node of a metrale op is rewritten into a call of
its functional twin `metrale_onnx::<op>` (same arguments; returns the op's outputs, then the new
value of each mutated argument), which the translation table maps to the op's translation.
"""

from __future__ import annotations

import operator
from types import SimpleNamespace
from typing import Callable

import numpy as np
import torch
from torch import nn

from .batch import PackedBatch
from .cache import HybridCache
from .config import ModelConfig
from .onnx_translations import OPSET, TRANSLATIONS

STEP_INPUTS = ["tokens", "positions", "cu_seqlens", "slot_ids", "context_lens", "block_tables"]
_AUTO_FUNCTIONALIZED = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)
_TWINS: dict[str, torch._ops.OpOverload] = {}
_twin_lib: torch.library.Library | None = None


def pool_names(config: ModelConfig) -> list[str]:
    """Names of the state pools in graph order (the order of `HybridCache.pools()`)."""
    return ([f"conv_state_L{i}" for i in config.linear_layers] + [f"gdn_state_L{i}" for i in config.linear_layers]
            + [f"k_cache_L{i}" for i in config.full_layers] + [f"v_cache_L{i}" for i in config.full_layers])


class PrefillStep(nn.Module):
    """`model.forward_packed` as a function of tensors: forward(tokens, positions, cu_seqlens,
    slot_ids, context_lens, block_tables, *pools) -> (logits [B, vocab], *updated pools). The pools
    (in `pool_names` order) are cloned first and left untouched."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.num_gdn, self.num_attn = len(model.config.linear_layers), len(model.config.full_layers)

    def forward(self, tokens, positions, cu_seqlens, slot_ids, context_lens, block_tables, *pools):
        g, a = self.num_gdn, self.num_attn
        if len(pools) != 2 * (g + a):
            raise ValueError(f"expected {2 * (g + a)} state pools, got {len(pools)}")
        pools = [p.clone() for p in pools]
        cache = SimpleNamespace(conv_states=pools[:g], gdn_states=pools[g:2 * g], k_caches=pools[2 * g:2 * g + a],
                                v_caches=pools[2 * g + a:])
        batch = PackedBatch(tokens, positions, cu_seqlens, slot_ids, context_lens, block_tables)
        return (self.model.forward_packed(cache, batch), *pools)


# functional twins of the mutating ops
def _mutated(op: torch._ops.OpOverload) -> list[str]:
    return [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def _twin(op: torch._ops.OpOverload) -> torch._ops.OpOverload:
    """`metrale_onnx::<name>`: op with every mutated argument taken by value and its new value
    returned after the op's outputs."""
    global _twin_lib
    if op.name() in _TWINS:
        return _TWINS[op.name()]
    if _twin_lib is None:
        _twin_lib = torch.library.Library("metrale_onnx", "FRAGMENT")
    schema, mutated = op._schema, _mutated(op)
    where = [i for i, a in enumerate(schema.arguments) if a.name in mutated]
    name = op.name().split("::")[1]
    returns = [str(r.type) for r in schema.returns] + ["Tensor"] * len(mutated)
    _twin_lib.define(f"{name}({', '.join(f'{a.type} {a.name}' for a in schema.arguments)}) -> ({', '.join(returns)})")

    def functional(*args):
        args = list(args)
        for i in where:
            args[i] = args[i].clone()
        out = op(*args)
        return (*(out if isinstance(out, tuple) else (out,)), *(args[i] for i in where))

    _twin_lib.impl(name, functional, "CompositeExplicitAutograd")
    torch.library.register_fake(f"metrale_onnx::{name}", functional, lib=_twin_lib)
    _TWINS[op.name()] = getattr(torch.ops.metrale_onnx, name).default
    return _TWINS[op.name()]


def _is_metrale(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "metrale"


def metrale_ops(program: torch.export.ExportedProgram) -> set[str]:
    """Names (`metrale::x`) of the metrale ops a program calls, directly or auto-functionalized."""
    found = set()
    for gm in program.graph_module.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        for node in gm.graph.nodes:
            if node.op == "call_function":
                target = node.args[0] if node.target in _AUTO_FUNCTIONALIZED else node.target
                if _is_metrale(target):
                    found.add(target.name())
    return found


def _functionalize(program: torch.export.ExportedProgram) -> None:
    """Rewrite every auto_functionalized(_v2) node of a metrale op into its twin, in place."""
    gm = program.graph_module
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _AUTO_FUNCTIONALIZED or not _is_metrale(node.args[0]):
            continue
        op, kw = node.args[0], node.kwargs
        mutated, n_out = _mutated(op), len(op._schema.returns)
        if node.target is torch.ops.higher_order.auto_functionalized_v2:
            base = {}  # mutated arg -> index into _all_bases
            for name in mutated:
                views = [k for k in kw if k.startswith(f"_{name}_") and k != f"_{name}_base_index"]
                if views or kw.get(f"_{name}_base_index") is None:
                    raise NotImplementedError(f"{op.name()}: mutated argument {name!r} is a view; pass whole pools")
                base[name] = kw[f"_{name}_base_index"]
            if sorted(base.values()) != list(range(len(kw["_all_bases"]))):
                raise NotImplementedError(f"{op.name()}: mutated arguments share a base tensor")
            args = [kw["_all_bases"][base[a.name]] if a.name in base else kw[a.name] for a in op._schema.arguments]
            # auto_functionalized_v2 returns (outputs..., every base); the twin (outputs..., mutated args)
            new_index = {n_out + base[name]: n_out + j for j, name in enumerate(mutated)}
        else:  # auto_functionalized (v1): (outputs..., mutated args in schema order), like the twin
            args, new_index = [kw[a.name] for a in op._schema.arguments], {}
        with gm.graph.inserting_before(node):
            twin = gm.graph.call_function(_twin(op), tuple(args))
        source = {j: k for k, j in new_index.items()}  # twin output j <- node output k
        twin.meta.update(node.meta)
        twin.meta["val"] = tuple(node.meta["val"][source.get(j, j)] for j in range(n_out + len(mutated)))
        for user in list(node.users):
            assert user.target is operator.getitem, f"unexpected user {user} of {node}"
            user.args = (twin, new_index.get(user.args[1], user.args[1]))
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def export_onnx(module: nn.Module, args: tuple, translations: dict[str, Callable] | None = None,
                input_names: list[str] | None = None, output_names: list[str] | None = None,
                optimize: bool = True, progress: Callable[[str], None] | None = None):
    """Export `module(*args)` (fixed shapes) with the metrale ops translated by `translations`
    (op name -> onnxscript translation, default: all of TRANSLATIONS). Returns the ONNXProgram.

    Raises ValueError naming the first metrale op the module calls that has no translation."""
    translations = TRANSLATIONS if translations is None else translations
    unknown = sorted(set(translations) - set(TRANSLATIONS))
    if unknown:
        raise ValueError(f"translations for unknown ops {unknown}; metrale ops: {', '.join(TRANSLATIONS)}")
    step = progress or (lambda _: None)
    step("torch.export")
    with torch.no_grad():
        program = torch.export.export(module, args, strict=False).run_decompositions({})
    missing = sorted(n for n in metrale_ops(program) if n.split("::")[1] not in translations)
    if missing:
        raise ValueError(f"no ONNX translation for {missing[0]}" + (f" (nor {', '.join(missing[1:])})"
                                                                      if len(missing) > 1 else ""))
    _functionalize(program)
    table = {}
    for name, fn in translations.items():
        op = getattr(torch.ops.metrale, name).default
        table[_twin(op) if _mutated(op) else op] = fn
    step("translate to ONNX")
    return torch.onnx.export(program, (), dynamo=True, custom_translation_table=table, opset_version=OPSET,
                             input_names=input_names, output_names=output_names, optimize=optimize,
                             verbose=False)


def example_inputs(cache: HybridCache, batch_size: int, num_tokens: int) -> tuple[torch.Tensor, ...]:
    """Inputs of the bucket's shapes (one stream holding every token, the rest empty): what the
    export traces; values do not matter."""
    B, T, dev = batch_size, num_tokens, cache.device
    cu = torch.full((B + 1,), T, dtype=torch.int32, device=dev)
    cu[0] = 0
    batch = PackedBatch(torch.zeros(T, dtype=torch.int64, device=dev), torch.arange(T, device=dev), cu,
                        torch.full((B,), cache.scratch_slot, dtype=torch.int64, device=dev),
                        torch.zeros(B, dtype=torch.int32, device=dev),
                        cache.block_tables[cache.scratch_slot].expand(B, -1).contiguous())
    return step_args(batch, cache)


def step_args(batch: PackedBatch, cache: HybridCache) -> tuple[torch.Tensor, ...]:
    """The graph's inputs, in order, for a packed batch on a cache."""
    return (batch.tokens, batch.positions, batch.cu_seqlens, batch.slot_ids, batch.context_lens,
            batch.block_tables, *cache.pools())


def export_prefill(model, cache: HybridCache, batch_size: int, num_tokens: int,
                   translations: dict[str, Callable] | None = None, optimize: bool = True,
                   progress: Callable[[str], None] | None = None):
    """Export `model.forward_packed` for bucket (batch_size, num_tokens) on `cache`'s geometry
    (slots, blocks, block size, blocks per stream). Returns the ONNXProgram."""
    for name, value in (("batch_size", batch_size), ("num_tokens", num_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    model.check_cache(cache)
    pools = pool_names(model.config)
    return export_onnx(PrefillStep(model), example_inputs(cache, batch_size, num_tokens), translations,
                       input_names=STEP_INPUTS + pools, output_names=["logits"] + [f"{p}_out" for p in pools],
                       optimize=optimize, progress=progress)


def pad_batch(batch: PackedBatch, cache: HybridCache, batch_size: int, num_tokens: int) -> PackedBatch:
    """Pad a packed batch to bucket (batch_size, num_tokens): spare tokens go to one padding stream
    on the scratch slot (context 0, every block the null block; token id 0), spare streams are
    zero-length streams on the scratch slot. The padding stream's positions must fit a slot's
    capacity, and a batch needing one must leave a stream free for it."""
    B, T = batch.num_streams, batch.num_tokens
    pad_tokens = num_tokens - T
    pad_streams = batch_size - B
    if pad_tokens < 0 or pad_streams < 0:
        raise ValueError(f"a batch of {B} streams and {T} tokens does not fit bucket ({batch_size}, {num_tokens})")
    if pad_tokens > 0 and pad_streams == 0:
        raise ValueError(f"bucket ({batch_size}, {num_tokens}) leaves no stream for the {pad_tokens} padding tokens "
                         f"of a batch of {B} streams")
    if pad_tokens > cache.max_context:
        raise ValueError(f"{pad_tokens} padding tokens exceed a slot's capacity of {cache.max_context}")
    dev = batch.tokens.device
    cu = torch.cat([batch.cu_seqlens, torch.full((pad_streams,), num_tokens, dtype=torch.int32, device=dev)])
    return PackedBatch(
        tokens=torch.cat([batch.tokens, torch.zeros(pad_tokens, dtype=torch.int64, device=dev)]),
        positions=torch.cat([batch.positions, torch.arange(pad_tokens, device=dev)]),
        cu_seqlens=cu,
        slot_ids=torch.cat([batch.slot_ids, torch.full((pad_streams,), cache.scratch_slot, device=dev)]),
        context_lens=torch.cat([batch.context_lens, torch.zeros(pad_streams, dtype=torch.int32, device=dev)]),
        block_tables=torch.cat([batch.block_tables,
                                cache.block_tables[cache.scratch_slot].expand(pad_streams, -1)]),
    )


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
    are). Returns every output by name."""
    names = [i.name for i in session.get_inputs()]
    feeds = {n: t.detach().cpu().numpy() for n, t in zip(names, step_args(batch, cache))}
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


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

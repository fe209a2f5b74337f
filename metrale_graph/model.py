"""HybridModel: a Qwen3.5-style hybrid (Gated DeltaNet + gated full attention; a dense MLP or a
sparse MoE block per layer: Qwen3.5, Qwen3.5-MoE, Qwen3-Next) whose batched prefill runs as a
sequence of `metrale::` phase ops over packed varlen streams.

`prefill(cache, streams)` validates and packs on the host, then runs `forward_packed`, the
step: a pure function of packed tensors, weights and cache pools with no host sync and no
data-dependent shapes, which is what `torch.compile(fullgraph=True)` and CUDA graphs take.

With `tp` (parallel.TensorParallel) the model holds this rank's shard of every weight, its cache
this rank's shard of every pool, and the step all-reduces after each mixer and feed-forward half
(sharding.py says how each weight is split).

A checkpoint's multi-token-prediction head (config.mtp_num_hidden_layers > 0; spec.mtp_block) is held as
`model.mtp` (None without one): its weights load, shard, quantize and save with the others, and its decoder
layers `model.mtp.layers[i]` run through the same layer methods as the main ones (speculative/mtp.py).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .batch import PackedBatch, Stream
from .cache import HybridCache
from .config import LINEAR, ModelConfig, PRESETS, no_config
from .ops import OPS
from .ops.common import rms_norm
from .ops.limits import check_supported
from .parallel import TensorParallel
from .numbers import as_int
from .placement import DTYPES as _DTYPES, as_device, as_dtype
from .protocol import prefill_call
from .saving import GENERATION_CONFIG, save_checkpoint
from .quantization import SCALE_SUFFIX
from .rope import rope_frequencies
from .sharding import rank_shards
from .spec import MOE, feed_forward, model_spec, mtp_feed_forward, weight_dtype
from .loader import load_checkpoint
from .weights import checkpoint_config, checkpoint_dtype, random_weights, shard_weights, stack_projections


class HybridModel(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], tp: TensorParallel | None = None):
        """Wrap `weights` (names as `weight_shapes(config)`, all on one device and in one dtype but an FP8
        config's converted weights, float8_e4m3fn, and their fp32 scales (spec.weight_dtype); with a
        tensor-parallel `tp` of size > 1, this rank's shards: sharding.rank_shards' shapes)."""
        super().__init__()
        self.tp = tp if tp is not None and tp.size > 1 else None
        # what this rank holds (sharding.rank_shards): the sizes its ops and cache see (its heads, its MLP slice;
        # the config for all else), its weights' shapes, their stacked buffers, its first expert
        self._shards = rank_shards(config, self.tp)
        self.local, self._first_expert = self._shards.local, self._shards.first_expert
        expected = self._shards.shapes
        if set(weights) != set(expected):
            missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
            raise ValueError(f"weights do not match the config: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, tensor in weights.items():
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected[name]}")
        _check_uniform(weights, config)
        self.config = config
        self.layers = nn.ModuleList(nn.Module() for _ in range(config.num_hidden_layers))
        for i, layer in enumerate(self.layers):
            layer.feed_forward = feed_forward(config, i)  # its block (spec.py): MOE on config.moe_layers, else MLP
        if config.mtp_num_hidden_layers:
            self.mtp = nn.Module()
            self.mtp.layers = nn.ModuleList(nn.Module() for _ in range(config.mtp_num_hidden_layers))
            for i, layer in enumerate(self.mtp.layers):
                layer.feed_forward = mtp_feed_forward(config, i)
        else:
            self.mtp = None  # no MTP head
        self._set_weights(weights)
        # layer index -> index into the cache's per-kind pools
        self._pool_index = {i: j for kinds in (config.linear_layers, config.full_layers)
                            for j, i in enumerate(kinds)}

    def _set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Register `weights` as parameters, each layer's projections stacked in one buffer
        (spec.WeightSpec.stack), and the fp32 RoPE frequencies on their device."""
        if weights["embed_tokens.weight"].device.type == "cuda":
            check_supported(self.local)  # a shape the CUDA path cannot run: ValueError now, not at prefill
        weights = stack_projections(dict(weights), self._shards.stacks)
        # the scales argument of the ops' weights that are not FP8 (ops/fp8/projection.py)
        self.register_buffer("no_scale", torch.empty(0, device=weights["embed_tokens.weight"].device),
                             persistent=False)
        for name, tensor in weights.items():
            *path, leaf = name.split(".")
            module = self
            for part in path:
                if part not in module._modules:
                    module.add_module(part, nn.Module())
                module = module._modules[part]
            module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        cfg, device = self.config, weights["embed_tokens.weight"].device
        inv_freq, self.rope_scale = rope_frequencies(cfg, device)  # the scale: of cos and sin (YaRN's)
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)
        self.version = getattr(self, "version", -1) + 1  # GraphRunners check it: weights moved, graphs stale

    def _apply(self, fn, recurse=True):
        """`.to()`, `.half()`, `.bfloat16()`, `.cuda()`, ...: convert every weight, then stack the
        projections again and rebuild the fp32 RoPE buffer (converting tensor by tensor would
        un-stack the projections and cast the frequencies). The whole model converts or nothing
        does: a dtype the model does not run in raises ValueError first. An FP8 model's float8 weights
        and their scales only move (to the device the others go to): a dtype conversion leaves them."""
        params = dict(self.named_parameters())
        specs = model_spec(self.config)
        converted = {}
        for name, p in params.items():
            if specs[name].fp8 or specs[name].of is not None:
                device = fn(p.new_empty(0, dtype=self.dtype)).device
                converted[name] = p if p.device == device else p.to(device)
            else:
                converted[name] = fn(p)
        if all(converted[n] is p for n, p in params.items()):
            return self  # nothing moved (e.g. .to() of the current dtype and device)
        _check_uniform(converted, self.config, " Load the weights in the dtype you want: "
                                               "HybridModel.from_pretrained(path, dtype=...) or "
                                               "from_preset(..., dtype=...)")
        self._set_weights(converted)
        return self

    # construction
    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32, device="cpu", progress: bool = True,
                        check_finite: bool = True, tp: TensorParallel | None = None, mtp: bool = True,
                        requantize_fp8: bool = False) -> "HybridModel":
        """Load a Hugging Face checkpoint folder (config.json + safetensors, single or sharded): Qwen3.5
        (`qwen3_5_text`, multimodal `qwen3_5`), Qwen3.5-MoE (`qwen3_5_moe_text`, multimodal
        `qwen3_5_moe`) or Qwen3-Next (`qwen3_next`); a vision tower is skipped. The checkpoint's MTP head
        (`mtp.*`) is loaded as `model.mtp` when its files hold one (weights.checkpoint_config: whatever
        config.json declares, a checkpoint without `mtp.*` tensors loads without); mtp=False leaves it unread.

        A bad config or checkpoint raises ValueError naming the file and field or tensor.
        `check_finite` rejects NaN / infinite weights; it reads every weight once more on `device`:
        for the 9B model in bfloat16 about 40 ms on an H200, about 4.5 s on 2 CPU cores (see
        `load_checkpoint`). With a tensor-parallel `tp`, only this rank's shard is read. `dtype` is a
        torch.dtype or its name ("bfloat16"), or "auto": config.json's (weights.checkpoint_dtype); on the CPU,
        weights that would not fit in the memory available are a ValueError before any is read. `progress`: a bar
        while the weights load, drawn where standard error is a terminal (in a log, none). `requantize_fp8`: a
        compressed-tensors FP8 checkpoint's weights without 128 x 128-block scales are 128 x 128-block FP8 (tensor
        scales exactly, others requantized) instead of dequantized to `dtype` (compressed_tensors.py, docs/fp8.md)."""
        device = as_device(device)
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"path must be a checkpoint folder's path (a str), got {type(path).__name__} {path!r}")
        path = os.fspath(path)
        if os.path.isfile(path):
            raise ValueError(f"{path!r} is a file, not a checkpoint folder (a folder holding config.json and "
                             "the safetensors files)")
        if not os.path.isdir(path):
            raise ValueError(f"checkpoint folder {path!r} does not exist")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise no_config(path)
        for flag, value in (("mtp", mtp), ("requantize_fp8", requantize_fp8)):
            if not isinstance(value, bool):
                raise ValueError(f"{flag} must be True or False, got {value!r}")
        config, dtype = checkpoint_config(path, mtp, requantize_fp8), checkpoint_dtype(path, dtype)
        try:
            weights, error = load_checkpoint(path, config, dtype, device, progress=progress,
                                             check_finite=check_finite, tp=tp), None
        except Exception as e:  # under tp: raised only once every rank knows (below)
            weights, error = None, e
        if tp is not None and tp.size > 1:
            _agree_on_loading(tp, error, device)
        if error is not None:
            raise error
        model = cls(config, weights, tp)
        model.name_or_path = path  # where the Engine looks for a tokenizer and generation_config.json
        return model

    @classmethod
    def from_preset(cls, preset: str | ModelConfig = "tiny", dtype: torch.dtype = torch.float32, device="cpu",
                    seed: int = 0, tp: TensorParallel | None = None) -> "HybridModel":
        """A model with seeded random weights: `preset` names one of PRESETS or is a ModelConfig (an MTP head too
        when its mtp_num_hidden_layers > 0). With `tp`, every rank draws the same full weights and keeps its shard.
        `dtype` is a torch.dtype or its name; on the CPU, weights that would not fit in the memory available are a
        ValueError first."""
        dtype, device = as_dtype(dtype), as_device(device)
        if isinstance(preset, str):
            if preset not in PRESETS:
                raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
            preset = PRESETS[preset]
        elif not isinstance(preset, ModelConfig):
            raise ValueError(f"preset must be a preset's name ({', '.join(PRESETS)}) or a ModelConfig, got "
                             f"{type(preset).__name__} {preset!r}")
        if as_int(seed) is None:
            raise ValueError(f"seed must be an integer, got {type(seed).__name__} {seed!r}")
        seed = as_int(seed)
        weights = random_weights(preset, dtype, device, seed)
        if tp is not None and tp.size > 1:
            weights = shard_weights(weights, preset, tp)
        return cls(preset, weights, tp)

    def save_pretrained(self, folder: str) -> None:
        """Write a Hugging Face checkpoint folder that `from_pretrained` (ours or transformers') reads, also
        over a checkpoint already there (saving.py: no partial file on failure, stale shards removed); the
        generation_config.json of the folder the model was loaded from goes with it."""
        if self.tp:
            raise ValueError("save_pretrained writes a whole model; this one holds a tensor-parallel shard")
        source = getattr(self, "name_or_path", None)
        generation = os.path.join(source, GENERATION_CONFIG) if source else None
        save_checkpoint(dict(self.named_parameters()), self.config, folder,
                        generation if generation and os.path.isfile(generation) else None)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, num_slots: int, num_blocks: int, block_size: int = 64, max_context: int | None = None,
                  prefix_checkpoints: int = 0, checkpoint_interval: int = 0, verify_entries: int = 0) -> HybridCache:
        """A cache of `num_slots` streams and `num_blocks` KV blocks of `block_size` tokens. With
        `prefix_checkpoints` > 0 it keeps prefixes for later prompts (prefix caching: shared KV blocks and
        that many GDN state checkpoints; a prompt's state every `checkpoint_interval` tokens, 0: none).
        `verify_entries`: the state entries speculative decoding's verify step keeps (speculative/verify.py)."""
        return HybridCache(self.local, num_slots, num_blocks, block_size, max_context, self.dtype, self.device,
                           owner=self, prefix_checkpoints=prefix_checkpoints, checkpoint_interval=checkpoint_interval,
                           verify_entries=verify_entries)

    # the prefill
    def check_cache(self, cache: HybridCache, claim: bool = True) -> None:
        """ValueError unless `cache` is this model's (made by its new_cache, same dtype and device). A
        cache made without an owner becomes this model's (claim=False: only checked)."""
        if not isinstance(cache, HybridCache):
            raise ValueError(f"expected a HybridCache, got {type(cache).__name__}")
        if cache.config is not self.local and cache.config != self.local:  # (the comparison reads every field)
            raise ValueError("the cache was built for another model config")
        weight = self.embed_tokens.weight  # (dtype and device: read once, a module attribute is slow to reach)
        if cache.dtype != weight.dtype or cache.device != weight.device:
            raise ValueError(f"the cache is {cache.dtype} on {cache.device}; the model is {weight.dtype} "
                             f"on {weight.device}")
        cache.bind(self, claim)

    @torch.no_grad()
    def prefill(self, cache: HybridCache, streams: Sequence[Stream]) -> torch.Tensor:
        """Prefill a batch of streams; returns logits [num_streams, vocab] of each stream's last token.

        A stream whose slot holds context continues it. Bad input raises ValueError before any
        cache state changes; a failure while the step runs resets the batch's slots (see
        HybridCache.transaction). A cache serves one caller at a time (CacheInUseError).
        """
        with prefill_call(self, cache, streams) as call:  # metrale_graph/protocol.py
            return call.run(lambda batch: self.forward_packed(cache, batch))

    def forward_packed(self, cache: HybridCache, batch: PackedBatch) -> torch.Tensor:
        """The step: packed batch in, last-token logits [B, vocab] out; mutates the batch's slots
        and blocks in the cache pools. No host sync, shapes follow from input shapes."""
        h = self.hidden_states(cache, batch)
        last = (batch.cu_seqlens[1:].long() - 1).clamp(min=0)  # zero-length (padding) streams: any row
        return self.logits_of(h[last])

    def hidden_states(self, cache: HybridCache, batch: PackedBatch, h: torch.Tensor | None = None,
                      layers: tuple[int, int] | None = None) -> torch.Tensor:
        """The layers of the step: the hidden states [T, hidden] of every packed token before the final norm
        (forward_packed's, which keeps each stream's last; prompt_logprobs.py reads them all). Mutates the
        cache as forward_packed does. layers (start, stop): those layers alone, on `h` (default: the tokens'
        embeddings), as the verify step's graphs run them in pieces (capture/runner.py)."""
        start, stop = layers or (0, len(self.local.layer_types))
        h = self._embed(batch.tokens) if h is None else h
        for i in range(start, stop):
            j, layer, kind = self._pool_index[i], self.layers[i], self.local.layer_types[i]
            if kind == LINEAR:
                h = self._gdn_mixer(layer, h, batch, cache.conv_states[j], cache.gdn_states[j], _checkpoints(cache, j))
            else:
                h = self._attention_mixer(layer, h, batch, cache.k_caches[j], cache.v_caches[j])
            h = self._reduce(h)
            h = self._reduce(self._feed_forward(layer, h, batch))
        return h

    def logits_of(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] of hidden states [n, hidden] (hidden_states' rows): the final norm and the LM head."""
        return self.head(self.normed(h))

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm of hidden states [n, hidden] (hidden_states' rows): what the LM head reads, and the
        hidden state the MTP head takes beside the next token's embedding (speculative/mtp.py)."""
        return rms_norm(h, self.norm.weight, self.local.rms_norm_eps)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head: logits [n, vocab] of normed hidden states [n, hidden] (the main model's, or the MTP head's,
        which shares it)."""
        lm_head = self.embed_tokens.weight if self.local.tie_word_embeddings else self.lm_head.weight
        logits = F.linear(x, lm_head)
        if self.tp:  # every rank's vocabulary rows, the padding of the last shard cut off
            logits = self.tp.all_gather(logits, 1)[:, :self.config.vocab_size]
        return logits

    # tensor parallelism: identity without it
    def _reduce(self, x):
        return self.tp.all_reduce(x) if self.tp else x

    @property
    def _adds_residual(self) -> bool:
        """Only one rank adds the residual stream in an output op: the all-reduce sums it in once."""
        return self.tp is None or self.tp.rank == 0

    def _embed(self, tokens):
        table = self.embed_tokens.weight
        if not self.tp:
            return F.embedding(tokens, table)
        rows = table.shape[0]  # this rank's vocabulary shard starts at rank * rows
        local = tokens - self.tp.rank * rows
        inside = (local >= 0) & (local < rows)
        h = F.embedding(local.clamp(0, rows - 1), table) * inside[:, None].to(table.dtype)
        return self.tp.all_reduce(h)

    # a layer: h = x + mixer(norm(x)) (GDN or attention), then out = h + feed_forward(norm(h))
    def _gdn_mixer(self, layer, x, batch, conv_state, gdn_state, checkpoints=None):
        """checkpoints: (tokens, entries, conv pool, state pool) of a step that keeps prefix-caching
        checkpoints (ops/checkpoints.py), or None."""
        cfg, a = self.local, layer.linear_attn
        T, H, K = x.shape[0], cfg.linear_num_key_heads, cfg.linear_key_head_dim
        qkv, z, beta, g = OPS.gdn_proj(x, layer.input_layernorm.weight, *self._w(a.in_proj_qkv), *self._w(a.in_proj_z),
                                       *self._w(a.in_proj_b), *self._w(a.in_proj_a), a.A_log, a.dt_bias,
                                       cfg.rms_norm_eps)
        keep = () if checkpoints is None else checkpoints[:3]
        qkv = OPS.causal_conv1d(qkv, a.conv1d.weight.squeeze(1), batch.cu_seqlens, batch.slot_ids, conv_state, *keep)
        qk = OPS.l2norm(qkv[:, :2 * cfg.key_dim].view(T, 2 * H, K))
        v = qkv[:, 2 * cfg.key_dim:].view(T, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
        keep = () if checkpoints is None else (*checkpoints[:2], checkpoints[3])
        o = OPS.gdn_recurrence(qk[:, :H], qk[:, H:], v, g, beta, batch.cu_seqlens, batch.slot_ids, gdn_state, *keep)
        return OPS.gdn_out(o, z, x if self._adds_residual else None, a.norm.weight, *self._w(a.out_proj),
                           cfg.rms_norm_eps)

    def _attention_mixer(self, layer, x, batch, k_cache, v_cache):
        cfg, a = self.local, layer.self_attn
        q, k, v, gate = OPS.attn_proj(x, layer.input_layernorm.weight, *self._w(a.q_proj), *self._w(a.k_proj),
                                      *self._w(a.v_proj), a.q_norm.weight, a.k_norm.weight, batch.positions,
                                      self.rope_inv_freq, cfg.head_dim, cfg.rms_norm_eps, self.rope_scale)
        o = OPS.paged_attention(q, k, v, k_cache, v_cache, batch.cu_seqlens, batch.context_lens,
                                batch.block_tables)
        return OPS.attn_out(o, gate, x if self._adds_residual else None, *self._w(a.o_proj))

    def _feed_forward(self, layer, h, batch: PackedBatch | None = None):  # batch: its padding rows run no expert
        cfg, mlp = self.local, layer.mlp
        if layer.feed_forward == MOE:
            shared = mlp.shared_expert
            return OPS.moe(h, layer.post_attention_layernorm.weight, mlp.gate.weight,
                           *self._w(mlp.experts, "gate_up_proj"), *self._w(mlp.experts, "down_proj"),
                           *self._w(shared.gate_proj), *self._w(shared.up_proj), *self._w(shared.down_proj),
                           mlp.shared_expert_gate.weight, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                           cfg.rms_norm_eps, self._first_expert, self._adds_residual, batch and batch.cu_seqlens)
        return OPS.mlp(h, layer.post_attention_layernorm.weight, *self._w(mlp.gate_proj), *self._w(mlp.up_proj),
                       *self._w(mlp.down_proj), cfg.rms_norm_eps, self._adds_residual)

    def _w(self, module, leaf: str = "weight"):
        """(weight, its FP8 block scales or the empty no_scale): a projection's pair of op arguments."""
        return module._parameters[leaf], module._parameters.get(leaf + SCALE_SUFFIX, self.no_scale)

    def extra_repr(self) -> str:
        c = self.config
        moe = (f", {len(c.moe_layers)} MoE ({c.num_experts} experts, top-{c.num_experts_per_tok})"
               if c.moe_layers else "")
        mtp = f", MTP head of {c.mtp_num_hidden_layers} layer(s)" if c.mtp_num_hidden_layers else ""
        return (f"layers={c.num_hidden_layers} ({len(c.linear_layers)} GDN + {len(c.full_layers)} attention{moe}){mtp}, "
                f"hidden={c.hidden_size}, vocab={c.vocab_size}, dtype={self.dtype}, device={self.device}")


def _checkpoints(cache, j: int):
    """The prefix-caching checkpoints GDN layer j's ops keep in a step (HybridCache.plan_checkpoints), or None
    (no checkpoint_interval; a pool view under torch.export)."""
    tokens = getattr(cache, "checkpoint_tokens", None)
    if tokens is None:
        return None
    return tokens, cache.checkpoint_entries, cache.checkpoint_conv_states[j], cache.checkpoint_gdn_states[j]


def _agree_on_loading(tp: TensorParallel, error: BaseException | None, device: torch.device) -> None:
    """Each rank reads (and checks) only its shard, so a bad tensor may fail one rank's load alone; the
    others would go on to the first collective of a prefill and wait there for ever. The ranks exchange
    whether they failed; a rank whose own shard loaded raises ValueError naming the ones that did not."""
    failed = torch.zeros(tp.size, dtype=torch.int32, device=device)
    failed[tp.rank] = error is not None
    ranks = tp.all_reduce(failed).nonzero().flatten().tolist()
    if ranks and error is None:
        raise ValueError(f"tensor-parallel rank(s) {ranks} could not load their shard of the checkpoint (see "
                         "their error); this rank loaded its own")


def _check_uniform(weights: dict[str, torch.Tensor], config: ModelConfig, hint: str = "") -> None:
    """Every weight in one supported dtype, on one device; an FP8 config's converted weights float8_e4m3fn
    and their scales fp32 (spec.weight_dtype)."""
    specs = model_spec(config)
    dtype = weights["embed_tokens.weight"].dtype
    wrong = [f"{n} is {t.dtype}, expected {weight_dtype(specs[n], dtype)}" for n, t in weights.items()
             if (specs[n].fp8 or specs[n].of is not None) and t.dtype != weight_dtype(specs[n], dtype)]
    if wrong:
        raise ValueError(f"HybridModel's FP8 weights are float8_e4m3fn with float32 scales: {'; '.join(wrong[:3])}")
    plain = [t for n, t in weights.items() if not (specs[n].fp8 or specs[n].of is not None)]
    dtypes = sorted({str(t.dtype) for t in plain})
    devices = sorted({str(t.device) for t in weights.values()})
    if len(dtypes) != 1 or len(devices) != 1 or dtype not in _DTYPES:
        raise ValueError(f"HybridModel needs every weight in one of {', '.join(map(str, _DTYPES))} on one device; "
                         f"got {', '.join(dtypes)} on {', '.join(devices)}.{hint}")

"""The peer of tools.bench: transformers' causal LM of the model's family with the same bf16 weights
(flash-linear-attention's kernels when fla is installed), eager, timed on the same workloads."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from metrale_graph.tools.profiling import time_cuda

if TYPE_CHECKING:
    from metrale_graph.tools.workloads import Workload

def peer_model(model):
    """transformers' causal LM of the model's family with the same bf16 weights (it picks
    flash-linear-attention's kernels when fla is installed); an FP8 model's weights dequantized (the peer
    is transformers' bf16 model of the same checkpoint)."""
    import transformers

    from metrale_graph.quantized import dequantize_weights
    from metrale_graph.weights import hf_state_dict

    cfg, weights = model.config, dict(model.named_parameters())
    if cfg.quantization is not None:
        weights, cfg = dequantize_weights(weights, cfg)
    config_cls, model_cls = (getattr(transformers, n) for n in (cfg.family.config_class, cfg.family.causal_lm_class))
    hf_cfg = config_cls(**cfg.to_hf())
    with torch.device("meta"):
        hf = model_cls(hf_cfg)
    state = hf_state_dict(weights, cfg)
    hf.load_state_dict(state, strict=False, assign=True)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_cfg, device=model.device)
    return hf.to(model.device).eval()


def peer_prefill(hf, batch: torch.Tensor, mask=None, past=None):
    out = hf(input_ids=batch, attention_mask=mask, past_key_values=past, use_cache=True, logits_to_keep=1)
    return out.past_key_values


@torch.no_grad()
def bench_peer(hf, w: Workload, new, ctx, repeat):
    """The peer's best way through a workload: the streams with cached context as one batch through its
    own cache (their lengths agree in every workload); the others as one batch when their lengths
    agree, else as a left-padded batch or one stream at a time, whichever is faster. A mixed step (W7)
    is the two calls back to back."""
    dev = next(hf.parameters()).device
    cached = [i for i, c in enumerate(w.cached) if c]
    fresh = [i for i, c in enumerate(w.cached) if not c]
    calls, setups, modes = [], [], []
    if cached:
        past0 = peer_prefill(hf, torch.stack([ctx[i] for i in cached]).to(dev))
        batch = torch.stack([new[i] for i in cached]).to(dev)
        holder = {}
        calls.append(lambda: peer_prefill(hf, batch, past=holder["past"]))
        setups.append(lambda: holder.update(past=copy.deepcopy(past0)))
        modes.append("batch with cache")
    if fresh:
        toks = [new[i] for i in fresh]
        if len({t.numel() for t in toks}) == 1:
            batch2 = torch.stack(toks).to(dev)
            calls.append(lambda: peer_prefill(hf, batch2))
            modes.append("batch")
        else:
            L = max(t.numel() for t in toks)
            padded = torch.zeros(len(toks), L, dtype=torch.long)
            mask = torch.zeros(len(toks), L, dtype=torch.long)
            for i, t in enumerate(toks):
                padded[i, L - t.numel():] = t
                mask[i, L - t.numel():] = 1
            padded, mask = padded.to(dev), mask.to(dev)
            singles = [t.to(dev)[None] for t in toks]
            options = {"padded batch": lambda: peer_prefill(hf, padded, mask),
                       "one at a time": lambda: [peer_prefill(hf, s) for s in singles]}
            best = min(options, key=lambda k: time_cuda(options[k], lambda: None, max(1, repeat // 2)))
            calls.append(options[best])
            modes.append(best)
    ms = time_cuda(lambda: [c() for c in calls], lambda: [s() for s in setups], repeat)
    return ms, " + ".join(modes)

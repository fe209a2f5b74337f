"""Plain references for sampling's tests (tests/test_sampling.py, tests/test_serve_logprobs.py): one row at a time,
in float64, as the definitions read (vLLM's order and semantics, metrale_graph/logits_processors.py)."""

import math

import torch

from metrale_graph import Stream
from metrale_graph.sampling import SamplingParams


def reference_logits(logits, params: SamplingParams, prompt, out, stop_ids, bitmask=None):
    """vLLM's processing of one row's logits [vocab]: bitmask, logit_bias, min_tokens, repetition, then frequency
    and presence penalties; `out` the tokens generated so far."""
    x = [float(v) for v in logits]
    for t in range(len(x)):
        if bitmask is not None and not (int(bitmask[t // 32]) >> (t % 32)) & 1:
            x[t] = -math.inf
    for t, b in params.logit_bias:
        x[t] += b
    if len(out) < params.min_tokens:
        held = [-math.inf if t in stop_ids else v for t, v in enumerate(x)]
        if bitmask is None or any(v > -math.inf for v in held):  # (a grammar that allows only a stop wins)
            x = held
    r = params.repetition_penalty
    for t in set(prompt) | set(out):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(out):
        x[t] -= params.frequency_penalty * out.count(t) + params.presence_penalty
    return torch.tensor(x, dtype=torch.float64)


def reference_probs(x, params: SamplingParams):
    """The distribution one sampled row draws from: softmax(x / T), min_p against the most likely, top-k, then
    top-p over what is left (the smallest most-likely set reaching top_p), renormalized."""
    p = torch.softmax(x.double() / params.temperature, 0)
    p = torch.where(p >= params.min_p * p.max(), p, 0.0)
    p = p / p.sum()
    order = sorted(range(len(p)), key=lambda t: -float(p[t]))
    kept = order[:params.top_k] if params.top_k else order
    p = torch.tensor([float(p[t]) if t in kept else 0.0 for t in range(len(p))], dtype=torch.float64)
    p = p / p.sum()
    before, keep = 0.0, set()
    for t in order:
        if t in kept and (before < params.top_p or not keep):
            keep.add(t)
        before += float(p[t])
    p = torch.tensor([float(p[t]) if t in keep else 0.0 for t in range(len(p))], dtype=torch.float64)
    return p / p.sum()


def reference_decode(model, prompt, n, params=SamplingParams(), stop_ids=frozenset()):
    """Greedy decoding one token at a time through model.prefill on a cache of its own, with the reference's
    processing: the tokens, and log_softmax of the raw logits after each token (prompt and new) but the last."""
    cache = model.new_cache(1, 16, 16, 256)
    logprobs = []
    for token in prompt[:-1]:
        logprobs.append(torch.log_softmax(model.prefill(cache, [Stream(0, [token])]).float(), -1)[0])
    logits, out = model.prefill(cache, [Stream(0, prompt[-1:])]), []
    for _ in range(n):
        logprobs.append(torch.log_softmax(logits.float(), -1)[0])
        token = int(reference_logits(logits[0], params, prompt, out, stop_ids).argmax())
        out.append(token)
        logits = model.prefill(cache, [Stream(0, [token])])
    return out, logprobs

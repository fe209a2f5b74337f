"""Speculative decoding without the engine, for tests: the main model's normed hidden states through the prefill
protocol, plain greedy decoding, a greedy speculative decoding loop over our pieces (draft, verify, accept), and
the bigram checkpoint of issue 39's done-when.

    tokens, steps = speculative_greedy(model, prompt, new_tokens, k, method="mtp")   # steps: (drafts, accepted)
    monkeypatch.setattr(verify, "ngram_propose", Oracle(prompts, plain_outputs, vocab))  # the engine's drafts
    staggered(engine, prompts)                                                          # requests at two times
    with_eager_tail(engine, grid)            # its speculative steps through SpeculativeGraphs, uncompiled

The loop keeps exact state the plain way: each verify runs on a snapshot of the cache, which is then put back and
given the accepted tokens alone (a stream's GDN state cannot drop the rejected drafts' tokens). The engine's
verify will keep per-token state checkpoints instead (docs/speculative.md).

The bigram checkpoint: every output projection of the main model is zero (GDN out_proj, attention o_proj, MLP and
expert down projections), so its residual stream carries the current token's embedding alone to the head and the
next token depends on the current one only; the MTP head computes the same function: its fc passes the embedding
half (identity on it, zero on the hidden half), its layer's output projections are zero, its pre-fc embedding norm
is the identity (w 0) and its final norm the model's. Its drafts are then the model's own greedy continuation.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from metrale_graph import HybridModel, Stream
from metrale_graph.capture import choose
from metrale_graph.capture.speculative import SpeculativeGraphs
from metrale_graph.protocol import prefill_call
from metrale_graph.sampling import SamplingParams
from metrale_graph.speculative import draft_mtp, ngram_propose, rejection_sample, target_probabilities
from metrale_graph.tools.bench_speculative import bigram_weights


@torch.no_grad()
def prefill_hidden(model, cache, slot: int, tokens: list[int]) -> torch.Tensor:
    """model.prefill of one stream, returning the normed hidden states [len(tokens), D] of its positions
    (model.normed of hidden_states' rows: the LM head's input, the MTP head's hidden input)."""
    rows = []

    def step(batch):
        h = model.hidden_states(cache, batch)
        rows.append(model.normed(h[:len(tokens)]))
        last = (batch.cu_seqlens[1:].long() - 1).clamp(min=0)
        return model.logits_of(h[last])

    with prefill_call(model, cache, [Stream(slot, tokens)]) as call:
        call.run(step)
    return rows[0]


@torch.no_grad()
def greedy_decode(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Plain greedy decoding, one token per step."""
    cache = model.new_cache(1, 64, 16)
    logits = model.prefill(cache, [Stream(0, prompt)])
    out = []
    for _ in range(new_tokens):
        out.append(int(logits[0].argmax()))
        logits = model.prefill(cache, [Stream(0, out[-1:])])
    return out


@torch.no_grad()
def speculative_greedy(model, prompt: list[int], new_tokens: int, k: int, method: str = "mtp"):
    """Greedy speculative decoding of `new_tokens` tokens (the last step's extra ones cut off) with `method`'s
    drafts ("mtp": draft_mtp; "ngram": ngram_propose over prompt and output). Returns (tokens, steps): steps[i] =
    (drafts proposed, drafts accepted) of verify step i."""
    cache = model.new_cache(1, 64, 16)
    hidden = prefill_hidden(model, cache, 0, prompt)
    out = [int(model.head(hidden[-1:])[0].argmax())]
    follow = prompt[1:] + out  # the MTP head's tokens beside `hidden`: each position's next token
    steps = []
    while len(out) < new_tokens:
        if method == "mtp":
            drafts = draft_mtp(model, cache, 0, follow, hidden, k).tokens
        else:
            drafts = ngram_propose(prompt + out, k)
        snapshot = cache.snapshot()
        verified = prefill_hidden(model, cache, 0, out[-1:] + drafts)
        probs = target_probabilities(model.head(verified)[None], [SamplingParams()])  # [1, drafts + 1, V]
        probs = torch.cat([probs, probs.new_zeros(1, k - len(drafts), probs.shape[-1])], dim=1)
        dev = probs.device
        result = rejection_sample(probs, torch.tensor([drafts + [0] * (k - len(drafts))], device=dev),
                                  torch.tensor([len(drafts)], device=dev), torch.tensor([True], device=dev),
                                  torch.zeros(1, k + 1, device=dev))
        accepted = int(result.counts[0])
        emitted = result.tokens[0, :accepted + 1].tolist()
        steps.append((len(drafts), accepted))
        cache.restore(snapshot)
        hidden = prefill_hidden(model, cache, 0, out[-1:] + drafts[:accepted])
        follow = emitted
        out += emitted
    return out[:new_tokens], steps


def bigram_model(cfg, seed: int = 0) -> HybridModel:
    """from_preset(cfg) (cfg.mtp_num_hidden_layers 1) made a bigram model with an MTP head of the same function
    (module docstring)."""
    assert cfg.mtp_num_hidden_layers == 1
    model = HybridModel.from_preset(cfg, seed=seed)
    D = cfg.hidden_size
    bigram_weights(model)  # (the MTP layer's output projections too)
    with torch.no_grad():
        fc = model.mtp.fc.weight
        fc.zero_()
        fc[:, :D].copy_(torch.eye(D))
        model.mtp.pre_fc_norm_embedding.weight.zero_()
        model.mtp.norm.weight.copy_(model.norm.weight)
    return model


def with_random_mtp(model, seed: int) -> HybridModel:
    """The model with every MTP weight redrawn (matrices at unit gain, norms 0.2 randn), in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("mtp."):
                scale = p.shape[-1] ** -0.5 if p.dim() >= 2 else 0.2
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


class Oracle:
    """A stand-in for ngram_propose that knows plain decoding's output (`reference`: prompt -> tokens) and drafts
    it with one token in three wrong (at a place that moves with the output's length), so that verify steps
    accept 0 .. k drafts: partial runs, full runs and rejections at once."""

    def __init__(self, prompts, reference, vocab: int):
        self.refs = [(p, r) for p, r in zip(prompts, reference)]
        self.vocab, self.calls = vocab, 0

    def __call__(self, tokens, k, *lookup):  # (prompt lookup's suffix lengths: not an oracle's concern)
        self.calls += 1
        tokens = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)  # (the engine passes an array)
        for p, r in self.refs:
            if tokens[:len(p)] == p and len(tokens) - len(p) <= len(r):
                done = len(tokens) - len(p)
                drafts = list(r[done:done + k])
                wrong = (done * 7) % 3 + done % (k + 1)
                if wrong < len(drafts):
                    drafts[wrong] = (drafts[wrong] + 1) % self.vocab
                return drafts
        return []


def staggered(engine, prompts, new_tokens=16, abort=None):
    """Requests arriving at different times: two first, the rest once the first has 3 tokens out. `abort`: the
    index of a request aborted after its first output. Returns each request's tokens (None for the aborted)."""
    kw = dict(max_new_tokens=new_tokens, stop_token_ids=[])
    handles = [engine.submit(p, **kw) for p in prompts[:2]]
    seen = 0
    for _ in handles[0]:
        seen += 1
        if seen == 3:
            break
    handles += [engine.submit(p, **kw) for p in prompts[2:]]
    if abort is not None:
        next(iter(handles[abort]))
        handles[abort].abort()
    return [None if i == abort else h.result().token_ids for i, h in enumerate(handles)]


class EagerBuckets:
    """A stand-in for GraphRunner's hidden-states buckets: the grid's bucket of each step, run eagerly."""

    def __init__(self, model, cache, grid):
        self.model, self.cache, self.grid = model, cache, grid
        self.use_graphs, self.pool, self.hidden_entries = False, None, {}

    def hidden_bucket(self, num_streams, num_tokens):
        bucket = choose(self.grid, num_streams, num_tokens)
        return None if bucket is None else SimpleNamespace(bucket=bucket)

    def run_hidden(self, entry, packed):
        return self.model.hidden_states(self.cache, packed)


def with_eager_tail(engine, grid):
    """An eager (compile=False) speculative `engine` whose speculative steps take SpeculativeGraphs' path (its
    functions uncompiled, on their static buffers) in the buckets of `grid` (capture.make_grid's), behind
    EagerBuckets; returns it."""
    spec = engine._loop.spec
    spec.runner = EagerBuckets(engine.model, engine.cache, grid)
    spec.graphs = SpeculativeGraphs(spec.runner, spec.k, spec.mtp is not None, engine._loop.last_tokens,
                                    compiled=False)
    return engine

"""Prompt log-probabilities: at every prompt position, the log-probability of the prompt's next token (vLLM's
`prompt_logprobs`; the completions API's `echo` with `logprobs`, which is how lm-eval scores loglikelihood
tasks). The first prompt token has none (OpenAI and vLLM return None for it).

    logits, commit, pieces = prefill_step(loop.launch, model, cache, chunks, streams, decodes)  # in the loop
    pieces[i].request, pieces[i].first, pieces[i].to_host()                      # after the step's one sync

The step computes the LM head on each stream's last token only (model.forward_packed). So the prompt chunks
of requests that ask for prompt logprobs run apart from the step's other streams: through the same prefill
protocol, on the engine's own cache, in the engine loop's thread (the only one that may use it), eagerly, as
`model.hidden_states` and then the final norm and LM head over every position. Their slots end up holding
what the step would have written (the request then decodes as any other), and their last positions' logits
are sampled as the step's are. The head runs over at most SLICE_LOGITS logits at a time (positions x vocab,
fp32: 256 MiB, 270 positions at a 248k vocabulary), each slice reduced at once to the target tokens'
logprobs, ranks and top N (logprobs.py: raw log_softmax), so memory stays bounded whatever the prompt.

A request with prompt logprobs restores nothing from the prefix cache (vLLM skips it too): a restored
prefix has no logits. Its chunks cost an eager step beside the captured one. Under tensor parallelism every rank
runs these steps (the LM head's slices gather the vocabulary); with a plan broadcast rank 0's plan names the
scored chunks and their target counts (`scored_chunks`), and a follower runs `run_scored` on targets of those
lengths (the logprobs it computes are dropped: rank 0 answers).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from .batch import Stream
from .logits_processors import to_device
from .logprobs import DeviceLogprobs, TokenLogprobs, token_logprobs
from .protocol import prefill_call

SLICE_LOGITS = 2**26  # fp32 logits the LM head produces at once for prompt logprobs (256 MiB)


class PromptPiece(NamedTuple):
    """The prompt logprobs one step computed for one request: of its prompt tokens first + 1 .. first + n, where
    `start` is where the chunk began in the prompt (0: the first token's None comes first)."""
    request: object
    start: int
    logprobs: DeviceLogprobs
    top_n: int

    def to_host(self) -> list[TokenLogprobs | None]:
        entries = self.logprobs.to_host([self.top_n] * self.logprobs.logprobs.shape[0])
        return [None, *entries] if self.start == 0 else entries


def scored_chunks(chunks: Sequence, decodes: int) -> list[tuple[int, list[int]]]:
    """The prompt chunks of a step's `chunks` (scheduler Chunks, the first `decodes` decodes; their requests' `fed`
    not yet advanced) whose requests ask for prompt logprobs: (index, its targets: the prompt tokens that follow
    each of its positions)."""
    return [(k, c.request.prompt[c.request.fed + 1:c.request.fed + 1 + len(c.tokens)])
            for k, c in enumerate(chunks[decodes:], decodes) if c.request.params.prompt_logprobs is not None]


def prefill_step(launch: Callable, model, cache, chunks: Sequence, streams: list[Stream],
                 decodes: int) -> tuple[torch.Tensor, Callable[[list[int]], None], list[PromptPiece]]:
    """A step's chunks (scheduler Chunks, `streams` theirs: the first `decodes` are decodes, the others prompt
    chunks, their requests' `fed` not yet advanced): (logits [len(chunks), vocab], commit, pieces).
    `launch(streams, decodes)` (the engine loop's: PrefillCall.launch, which returns (logits, commit)) runs them
    all but the prompt chunks of requests that ask for prompt logprobs, which run apart and are committed at
    once (module docstring); commit(ids) commits the others once the loop has the decodes' ids."""
    scored = scored_chunks(chunks, decodes)
    requests = [chunks[k].request for k, _ in scored]
    top_n = max((r.params.prompt_logprobs for r in requests), default=0)
    logits, commit, scores = run_scored(launch, model, cache, streams, decodes, scored, top_n)
    return logits, commit, [PromptPiece(r, r.fed, score, r.params.prompt_logprobs) for r, score in zip(requests, scores)]


def run_scored(launch: Callable, model, cache, streams: list[Stream], decodes: int, scored: list[tuple[int, list[int]]],
               top_n: int) -> tuple[torch.Tensor, Callable[[list[int]], None], list[DeviceLogprobs]]:
    """prefill_step's steps for `scored` (scored_chunks'): (logits, commit, each scored chunk's DeviceLogprobs). The
    follower of a plan broadcast runs it too, with rank 0's chunks and targets of their lengths (plan_sync.py):
    the same steps, the same LM-head slices, so the same collectives."""
    if not scored:
        logits, commit = launch(streams, decodes)
        return logits, commit, []
    ks = [k for k, _ in scored]
    others = [k for k in range(len(streams)) if k not in set(ks)]
    logits, scores = prefill_with_logprobs(model, cache, [streams[k] for k in ks], [t for _, t in scored], top_n)
    if not others:
        return logits, (lambda ids: None), scores
    rest, commit = launch([streams[k] for k in others], decodes)
    out = logits.new_empty(len(streams), logits.shape[1])
    out.index_copy_(0, to_device(ks, torch.int64, logits.device), logits)
    out.index_copy_(0, to_device(others, torch.int64, logits.device), rest)
    return out, commit, scores


@torch.no_grad()
def prefill_with_logprobs(model, cache, streams: Sequence[Stream], targets: Sequence[Sequence[int]],
                          top_n: int) -> tuple[torch.Tensor, list[DeviceLogprobs]]:
    """model.prefill of `streams` (eager; the same checks, transaction and commits), also giving, for stream i,
    the raw logprobs (with ranks and the top `top_n`) of targets[i][j] at its position j, for j <
    len(targets[i]) <= len(stream i) (the tokens that follow each position: the prompt's next ones). Returns the
    last-token logits [len(streams), vocab] and one DeviceLogprobs per stream. Nothing is read back to the host."""
    scores: list[DeviceLogprobs] = []
    starts, at = [], 0  # where each stream's tokens begin in the packed batch (pack keeps the streams' order)
    for stream in streams:
        starts.append(at)
        at += len(stream.tokens)

    def step(batch):
        h = model.hidden_states(cache, batch)
        scores.extend(_score(model, h, starts, targets, top_n))
        last = (batch.cu_seqlens[1:].long() - 1).clamp(min=0)
        return model.logits_of(h[last])

    with prefill_call(model, cache, streams) as call:
        logits = call.run(step)
    return logits, scores


def _score(model, h: torch.Tensor, starts: list[int], targets: Sequence[Sequence[int]],
           top_n: int) -> list[DeviceLogprobs]:
    """Per stream (its tokens beginning at row starts[i] of `h` [T, hidden]), the logprobs of its targets at its
    first positions, the LM head run over SLICE_LOGITS logits at a time."""
    dev, vocab = h.device, model.config.vocab_size
    lengths = [len(t) for t in targets]
    flat = to_device([[s + j for s, n in zip(starts, lengths) for j in range(n)],
                      [t for target in targets for t in target]], torch.int64, dev)
    positions, ids = flat[0], flat[1]
    parts, step = [], max(1, SLICE_LOGITS // vocab)
    for a in range(0, positions.shape[0], step):
        rows = positions[a:a + step]
        parts.append(token_logprobs(model.logits_of(h.index_select(0, rows)), ids[a:a + step], top_n))
    if not parts:  # every stream's chunk is its prompt's last token: nothing follows it in the prompt
        parts = [DeviceLogprobs(h.new_empty(0, dtype=torch.float32), ids.new_empty(0), ids.new_empty(0, top_n),
                                h.new_empty(0, top_n, dtype=torch.float32))]
    whole = DeviceLogprobs.cat(parts)
    out, at = [], 0
    for n in lengths:
        out.append(DeviceLogprobs(*(field[at:at + n] for field in whole)))
        at += n
    return out


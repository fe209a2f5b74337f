"""Log-probabilities of tokens, computed on the device: what `logprobs`, `top_logprobs` and `prompt_logprobs`
return.

    dev = token_logprobs(logits, token_ids, top_n)    # [n, vocab] logits, [n] ids: no host sync
    host = dev.to_host([top_n_of_each_row, ...])      # list[TokenLogprobs], one per row

Which distribution: the model's own, `log_softmax` in fp32 of the raw logits, before temperature,
logit_bias, min_tokens, the penalties, min_p, top-k / top-p or a token bitmask. This is vLLM's default
(`logprobs_mode="raw_logprobs"`); it makes a request's logprobs independent of how it samples (greedy or
not, any penalty) and equal to `log_softmax(model.prefill(...))`, which is what a scorer (lm-eval) wants.
A sampled token that the raw distribution finds unlikely (a penalty or a high temperature picked it) gets
its raw, low logprob.

`rank` is vLLM's: the number of tokens whose logprob is at least the token's own (1: the most likely, ties
counted against it). The top N come from `torch.topk`: most likely first, ties in topk's order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MAX_LOGPROBS = 20  # the most top tokens a request may ask for per position (OpenAI's top_logprobs limit)


class TokenLogprobs(NamedTuple):
    """Log-probabilities at one position: of its token (the one sampled there, or the prompt's) and of the N
    most likely tokens (N: what the request asked for; 0 gives [])."""
    logprob: float
    rank: int  # 1: the most likely token (vLLM's rank: tokens at least as likely, the token included)
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


class DeviceLogprobs(NamedTuple):
    """token_logprobs' result, still on the device: row i's token's logprob and rank, and the top N ids and
    logprobs (N: the most any row asked for; rows that asked fewer are cut on the host)."""
    logprobs: torch.Tensor  # fp32 [n]
    ranks: torch.Tensor  # int64 [n]
    top_ids: torch.Tensor  # int64 [n, N]
    top_logprobs: torch.Tensor  # fp32 [n, N]

    def to_host(self, top_n: list[int]) -> list[TokenLogprobs]:
        """One TokenLogprobs per row, row i keeping its first top_n[i] top entries. Reads the device (a sync)."""
        logprobs, ranks = self.logprobs.tolist(), self.ranks.tolist()
        ids, values = self.top_ids.tolist(), self.top_logprobs.tolist()
        return [TokenLogprobs(lp, rank, list(zip(i[:n], v[:n])))
                for lp, rank, i, v, n in zip(logprobs, ranks, ids, values, top_n)]

    @staticmethod
    def cat(parts: list["DeviceLogprobs"]) -> "DeviceLogprobs":
        if len(parts) == 1:
            return parts[0]
        return DeviceLogprobs(*(torch.cat(field) for field in zip(*parts)))


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_n: int) -> DeviceLogprobs:
    """The raw log-probabilities of `token_ids` [n] (int64, on the logits' device) under `logits` [n, vocab] (any
    float dtype; computed in fp32), their ranks, and each row's `top_n` most likely tokens. No host sync."""
    assert 0 <= top_n <= logits.shape[-1], top_n
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs >= chosen).sum(dim=-1)
    if top_n:
        top_logprobs, top_ids = logprobs.topk(top_n, dim=-1)
    else:
        top_logprobs = logprobs.new_empty(logprobs.shape[0], 0)
        top_ids = token_ids.new_empty(logprobs.shape[0], 0)
    return DeviceLogprobs(chosen.squeeze(1), ranks, top_ids, top_logprobs)

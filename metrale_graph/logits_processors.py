"""What changes the logits before a token is drawn, batched over rows on the device (vLLM's semantics).

    state = PenaltyState(num_slots, vocab_size, device)   # one per engine: per-slot token statistics
    x = process_logits(logits, rows, state, token_bitmask) # fp32 copy, or `logits` itself when nothing applies
    ... draw from x (sampling.py) ...
    state.record(rows, tokens)                             # the sampled tokens [n] on the device

Each row is a request's (sampling.SampleRow, or a scheduler Request): `params` (SamplingParams), `slot` (its
cache slot: its row of the penalty state), `generated` (tokens sampled for it before this step), `prompt`
(its token ids, read once, when its first token is drawn, for repetition_penalty) and `stop_ids` (its stop
tokens: eos and stop_token_ids).

In order, as vLLM's v1 sampler applies them (before temperature; greedy rows take the argmax of the result):

1. token bitmask: int32 [n, ceil(vocab / 32)], bit j of word w allows token 32 w + j (xgrammar's and
   llguidance's layout, the hook for structured outputs: a grammar fills it on the host); a token whose bit
   is 0 gets -inf.
2. logit_bias (OpenAI): a per-request {token id: bias} added to the logits.
3. min_tokens: while a request has sampled fewer than min_tokens tokens its stop tokens (eos and
   stop_token_ids) get -inf, except in a row the token bitmask leaves nothing else (a grammar whose output is
   whole allows only a stop token): there the grammar wins and the stop tokens stay (vLLM's fix of that dead
   end, vllm-project/vllm#54218; masking them would leave no token to draw).
4. penalties: repetition_penalty r over every token of the prompt and of the output so far (a positive
   logit divided by r, a negative one multiplied: transformers' and vLLM's definition), then
   frequency_penalty f and presence_penalty p over the output so far (OpenAI's definition:
   logit - f * count - p * (count > 0)).

min_p (relative to the most likely token's probability after temperature), top-k and top-p come after the
temperature, in the draw (sampling.py).

Nothing here reads the device from the host: the per-row values are copied to the device (pinned memory,
non-blocking on CUDA), the penalty state is updated from the sampled tokens tensor, and each step is a
fixed number of batched ops whatever the rows.
"""

from __future__ import annotations

import torch

from . import numbers

NEG_INF = float("-inf")
_FP32 = torch.finfo(torch.float32)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (numbers, or equal-length lists of them) as a tensor of `dtype` on `device`, without waiting for
    the device (numbers.to_device)."""
    return numbers.to_device(torch.tensor(values, dtype=dtype), device)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf (in place) the logits [n, vocab] of the tokens `bitmask` [n, ceil(vocab / 32)] (int32, on the
    logits' device) does not allow: bit j of word w stands for token 32 w + j."""
    n, vocab = logits.shape
    words = -(-vocab // 32)
    if bitmask.dtype != torch.int32 or tuple(bitmask.shape) != (n, words):
        raise ValueError(f"token_bitmask must be int32 [{n}, {words}] (rows, ceil(vocab / 32)), got "
                         f"{bitmask.dtype} {list(bitmask.shape)}")
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(n, words * 32)[:, :vocab]
    logits.masked_fill_(allowed == 0, NEG_INF)


class PenaltyState:
    """Per-slot token statistics on the device, for the penalties: `counts` int32 [slots, vocab], how often each
    token was sampled since the slot's request started, and `prompt_mask` bool [slots, vocab], the tokens of its
    prompt (repetition_penalty only). Each is allocated when a request first needs it (at vocab 248k and 64
    slots: 63 MB and 16 MB). A request's rows are (re)set when its first token is drawn (`start`), so a slot
    keeps no statistics of an earlier request; only penalized requests are counted."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device):
        self.num_slots, self.vocab_size, self.device = num_slots, vocab_size, torch.device(device)
        self.counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None

    def start(self, rows: list) -> None:
        """Zero the statistics of these rows' slots (requests drawing their first token) and mark their prompts'
        tokens (for the rows with a repetition_penalty)."""
        if self.counts is None:
            self.counts = torch.zeros(self.num_slots, self.vocab_size, dtype=torch.int32, device=self.device)
        slots = to_device([r.slot for r in rows], torch.int64, self.device)
        self.counts.index_fill_(0, slots, 0)
        repeat = [r for r in rows if r.params.repetition_penalty != 1.0]
        if not repeat:
            return
        if self.prompt_mask is None:
            self.prompt_mask = torch.zeros(self.num_slots, self.vocab_size, dtype=torch.bool, device=self.device)
        slots = to_device([r.slot for r in repeat], torch.int64, self.device)
        self.prompt_mask.index_fill_(0, slots, False)
        # one flat index_fill_ (slot * vocab + token): a boolean index_put_ of a Python True copies the scalar
        # to the device with a blocking copy, a synchronization in every step that starts such a request
        flat = to_device([r.slot * self.vocab_size + t for r in repeat for t in r.prompt], torch.int64, self.device)
        self.prompt_mask.view(-1).index_fill_(0, flat, True)

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count `tokens` [m] (int64, sampled) in the rows of `slots` [m] (int64, distinct), on the device."""
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    def record_runs(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count each row of `tokens` [m, n] (int64: the tokens a verify step emits for a slot, then negative
        padding, which counts nothing) in the row of `slots` [m] (int64, distinct), on the device."""
        counted = tokens >= 0
        self.counts.index_put_((slots.unsqueeze(1).expand_as(tokens), tokens.clamp(min=0)), counted.to(torch.int32),
                               accumulate=True)


def process_logits(logits: torch.Tensor, rows: list, state: PenaltyState | None,
                   token_bitmask: torch.Tensor | None = None, pending: list | None = None) -> torch.Tensor:
    """The logits [n, vocab] with steps 1-4 of the module docstring applied for each row's request: `logits`
    itself when no row needs any (nothing copied), else a new fp32 tensor (the input is never changed: its
    raw values give the logprobs). `state` is needed when a row has a penalty; its rows drawing their first
    token are started here. `pending`: per row, tokens before it that `state` has not counted (a verify
    position's drafts: speculative/verify.py), counted for the penalties as if recorded; row.generated
    includes them."""
    params = [r.params for r in rows]
    biased = [k for k, p in enumerate(params) if p.logit_bias]
    holding = [k for k, r in enumerate(rows) if r.generated < r.params.min_tokens and r.stop_ids]
    penalized = [k for k, p in enumerate(params) if p.penalized]
    if token_bitmask is None and not biased and not holding and not penalized:
        return logits
    x = logits.to(torch.float32, copy=True)
    dev = x.device
    if token_bitmask is not None:
        apply_token_bitmask_(x, token_bitmask)
    if biased:
        where = to_device([[k for k in biased for _ in params[k].logit_bias],
                           [t for k in biased for t, _ in params[k].logit_bias]], torch.int64, dev)
        bias = to_device([b for k in biased for _, b in params[k].logit_bias], torch.float32, dev)
        x.index_put_((where[0], where[1]), bias, accumulate=True)
    if holding:
        where = to_device([[k for k in holding for _ in rows[k].stop_ids], [t for k in holding for t in rows[k].stop_ids]],
                          torch.int64, dev)
        if token_bitmask is None:
            x.index_put_((where[0], where[1]), x.new_full((), NEG_INF))
        else:  # (on the device, no sync) a held row that would keep no token keeps its stop tokens
            held = x.index_put((where[0], where[1]), x.new_full((), NEG_INF))
            k = to_device(holding, torch.int64, dev)
            rows_held = held.index_select(0, k)
            x.index_copy_(0, k, torch.where((rows_held > NEG_INF).any(-1, keepdim=True), rows_held, x.index_select(0, k)))
    if penalized:
        if state is None:
            raise ValueError("presence / frequency / repetition penalties need a PenaltyState")
        starting = [rows[k] for k in penalized if rows[k].generated == 0]
        if starting:
            state.start(starting)
        _apply_penalties_(x, [rows[k] for k in penalized], to_device(penalized, torch.int64, dev), state,
                          None if pending is None else [pending[k] for k in penalized])
    return x


def _apply_penalties_(x: torch.Tensor, rows: list, index: torch.Tensor, state: PenaltyState,
                      pending: list | None = None) -> None:
    """Step 4 on rows `index` [m] of x (in place), from the slots' statistics and each row's `pending` tokens."""
    dev = x.device
    slots = to_device([r.slot for r in rows], torch.int64, dev)
    values = to_device([[r.params.repetition_penalty for r in rows], [r.params.frequency_penalty for r in rows],
                        [r.params.presence_penalty for r in rows]], torch.float32, dev)
    repetition, frequency, presence = values[0].unsqueeze(1), values[1].unsqueeze(1), values[2].unsqueeze(1)
    sub = x.index_select(0, index)
    counts = state.counts.index_select(0, slots)
    if pending is not None and any(pending):  # one scatter for all rows' pending tokens
        where = to_device([[k for k, p in enumerate(pending) for _ in p], [t for p in pending for t in p]],
                          torch.int64, dev)
        counts.index_put_((where[0], where[1]), counts.new_ones(()), accumulate=True)
    generated = counts > 0
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        seen = generated | state.prompt_mask.index_select(0, slots)
        # a penalty past fp32's range (1e-45 is 0 in fp32, 1e39 inf) would make inf and 0 * inf = NaN logits, which
        # sample nothing: it is clamped to fp32's positive normals, and so are the penalized logits that overflow
        # (a -inf, a token masked before, stays -inf)
        penalty = torch.where(seen, repetition.clamp(_FP32.tiny, _FP32.max), 1.0)
        multiplied = torch.where(sub == NEG_INF, sub, (sub * penalty).clamp(min=-_FP32.max))
        sub = torch.where(sub > 0, (sub / penalty).clamp(max=_FP32.max), multiplied)
    sub = sub - frequency * counts - presence * generated
    x.index_copy_(0, index, sub)

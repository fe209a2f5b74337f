"""Draft proposers that need no weights. `ngram_propose`: prompt lookup (vLLM's `ngram` method), a pure host
function over a stream's token list (its prompt and output so far). The MTP head's drafts are speculative/mtp.py's.

The lookup: for n from max_n down to min_n, the last n tokens are searched for earlier in the list; at the
longest n that occurs, its most recent earlier occurrence proposes the up to k tokens that followed it there
(fewer where the list ends first). No occurrence of any n: no proposal. The proposals are one-hot drafts
(acceptance.accept_drawn).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..numbers import as_int

NGRAM_MIN, NGRAM_MAX = 2, 4  # the suffix lengths searched, longest first


def ngram_propose(tokens: Sequence[int], k: int, min_n: int = NGRAM_MIN, max_n: int = NGRAM_MAX) -> list[int]:
    """Up to k draft tokens for a stream whose tokens so far are `tokens` (ints, a numpy array or a 1-D tensor):
    what followed the most recent earlier occurrence of its longest suffix of min_n .. max_n tokens that occurs
    (module docstring); [] when none does. ValueError for k < 1 or 1 <= min_n <= max_n not holding.

    One pass over the tokens: the earlier positions holding the last token are the candidate ends of a match, and
    each is extended backwards over at most max_n - 1 tokens (the candidates only), so a 32k-token stream costs
    one comparison of its tokens, not max_n - min_n + 1 window scans (2.2 ms a call before, in numpy)."""
    steps, low, high = as_int(k), as_int(min_n), as_int(max_n)
    if steps is None or steps < 1:
        raise ValueError(f"k (the drafts to propose) must be an integer >= 1, got {k!r}")
    if low is None or high is None or not 1 <= low <= high:
        raise ValueError(f"min_n and max_n must be integers with 1 <= min_n <= max_n, got {min_n!r} and {max_n!r}")
    ids = tokens if isinstance(tokens, np.ndarray) else np.asarray(
        tokens.tolist() if hasattr(tokens, "tolist") else tokens, dtype=np.int64)
    ids = ids.reshape(-1)
    L = ids.shape[0]
    high = min(high, L - 1)
    if high < low:
        return []
    ends = np.flatnonzero(ids[:L - 1] == ids[L - 1])  # an earlier occurrence's last token (never the suffix's own)
    matched = np.ones(ends.shape, dtype=np.int64)  # how many tokens back each candidate matches the suffix
    for j in range(1, high):
        at = ends - j
        ok = (matched == j) & (at >= 0)
        ok[ok] = ids[at[ok]] == ids[L - 1 - j]
        matched += ok
    for n in range(high, low - 1, -1):
        hits = ends[matched >= n]
        if hits.size:
            start = int(hits[-1]) + 1
            return ids[start:start + steps].tolist()
    return []


def history(r) -> np.ndarray:
    """Request r's prompt and output as one int64 array for prompt lookup (its TokenHistory, made on first use)."""
    if r.history is None:
        r.history = TokenHistory()
    return r.history.view(r.prompt, r.out)


class TokenHistory:
    """A stream's tokens (prompt, then output) as one growing int64 array, for prompt lookup every step without
    converting the whole list each time: `view(prompt, out)` appends what `out` gained since the last call and
    returns the tokens so far (a view, valid until the next call). The prompt is taken once; an output shorter than
    what was seen (never expected) starts the array over."""

    def __init__(self):
        self.ids, self.size, self.prompt_len = np.empty(0, dtype=np.int64), 0, None

    def view(self, prompt: Sequence[int], out: Sequence[int]) -> np.ndarray:
        if self.prompt_len is None:
            self.prompt_len = len(prompt)
            self.ids = np.empty(max(2 * (len(prompt) + len(out)), 64), dtype=np.int64)
            self.ids[:len(prompt)] = prompt
            self.size = len(prompt)
        total = self.prompt_len + len(out)
        if total < self.size:
            self.prompt_len = None
            return self.view(prompt, out)
        if total > self.ids.shape[0]:
            grown = np.empty(2 * total, dtype=np.int64)
            grown[:self.size] = self.ids[:self.size]
            self.ids = grown
        if total > self.size:
            self.ids[self.size:total] = out[self.size - self.prompt_len:]
            self.size = total
        return self.ids[:total]

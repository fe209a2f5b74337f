"""Draft proposers that need no weights. `ngram_propose`: prompt lookup (vLLM's `ngram` method), a pure host
function over a stream's token list (its prompt and output so far). The MTP head's drafts are speculative/mtp.py's.

The lookup: for n from max_n down to min_n, the last n tokens are searched for earlier in the list; at the
longest n that occurs, its most recent earlier occurrence proposes the up to k tokens that followed it there
(fewer where the list ends first). No occurrence of any n: no proposal. The proposals are one-hot drafts
(acceptance.rejection_sample with draft_probs None).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..numbers import as_int

NGRAM_MIN, NGRAM_MAX = 2, 4  # the suffix lengths searched, longest first


def ngram_propose(tokens: Sequence[int], k: int, min_n: int = NGRAM_MIN, max_n: int = NGRAM_MAX) -> list[int]:
    """Up to k draft tokens for a stream whose tokens so far are `tokens` (ints, a numpy array or a 1-D tensor):
    what followed the most recent earlier occurrence of its longest suffix of min_n .. max_n tokens that occurs
    (module docstring); [] when none does. ValueError for k < 1 or 1 <= min_n <= max_n not holding."""
    steps, low, high = as_int(k), as_int(min_n), as_int(max_n)
    if steps is None or steps < 1:
        raise ValueError(f"k (the drafts to propose) must be an integer >= 1, got {k!r}")
    if low is None or high is None or not 1 <= low <= high:
        raise ValueError(f"min_n and max_n must be integers with 1 <= min_n <= max_n, got {min_n!r} and {max_n!r}")
    ids = np.asarray(tokens.tolist() if hasattr(tokens, "tolist") and not isinstance(tokens, np.ndarray)
                     else tokens, dtype=np.int64).reshape(-1)
    L = ids.shape[0]
    for n in range(min(high, L - 1), low - 1, -1):
        # windows starting at 0 .. L - n - 1: every earlier occurrence, never the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(ids[:L - 1], n)
        hits = np.flatnonzero((windows == ids[L - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start:start + steps].tolist()
    return []

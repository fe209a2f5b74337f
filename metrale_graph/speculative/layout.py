"""A verify step's layout: which packed tokens are whose, which verify entries keep states, which hidden-state rows
the acceptance reads, how many tokens each stream keeps. Made from the step's stream lengths alone, so that the
engine loop's speculative step (verify.py) and, under a plan broadcast, its followers (following.py), which know
only the streams rank 0 sent, lay the step out alike and meet in the same collectives; and whether a one-stream
verify step runs padded to two streams (pads_one_stream)."""

from __future__ import annotations

import itertools
from typing import NamedTuple

from ..ops.common import decode_shaped


class VerifyLayout(NamedTuple):
    lengths: list[int]  # each stream's tokens (a speculating decode: its last token and its drafts)
    starts: list[int]  # where each stream's tokens begin in the packed step
    spec: list[int]  # the speculating streams (decodes with drafts), in order
    plain: list[int]  # the other streams that sample (decodes without drafts, prompts' last chunks)
    keep_tokens: list[int]  # packed tokens after which the GDN ops keep the state ...
    keep_entries: list[int]  # ... in these verify entries (cache.checkpoint_tokens / entries past prefix_targets)


def verify_layout(lengths: list[int], decodes: int, sampling: list[int], base: int, K: int,
                  verify_entries: int) -> VerifyLayout:
    """The layout of a step of streams of `lengths` whose first `decodes` are decodes (those longer than one token
    speculate: the last token and its drafts) and whose streams `sampling` sample; the j-th speculating stream's
    packed token t (t < its drafts) keeps its state in verify entry base + j * K + t (K: the option's num_tokens).
    RuntimeError when the cache's `verify_entries` are too few (the loop keeps speculating steps to max_streams)."""
    starts = [0, *itertools.accumulate(lengths)][:-1]
    spec = [i for i in range(decodes) if lengths[i] > 1]
    plain = [i for i in sampling if not (i < decodes and lengths[i] > 1)]
    if len(spec) * K > verify_entries:
        raise RuntimeError(f"{len(spec)} speculating streams need {len(spec) * K} verify entries, the cache has "
                           f"{verify_entries}")
    keep_tokens = [starts[i] + t for i in spec for t in range(lengths[i] - 1)]
    keep_entries = [base + j * K + t for j, i in enumerate(spec) for t in range(lengths[i] - 1)]
    return VerifyLayout(list(lengths), starts, spec, plain, keep_tokens, keep_entries)


def position_rows(starts: list[int], drafts: list[int], K: int) -> list[int]:
    """The hidden-state rows of the eager acceptance, [S * (K + 1)] flat: stream s's K + 1 positions from starts[s],
    its last one repeated past its own `drafts[s]` drafts (masked by their count)."""
    return [s + min(t, m) for s, m in zip(starts, drafts) for t in range(K + 1)]


def acceptance_rows(layout: VerifyLayout, K: int) -> list[list[int]]:
    """The hidden-state rows of the captured acceptance (tail.py's `ints` layout), one row a speculating stream then
    a plain one: a speculating stream's K + 1 positions (position_rows), a plain row's last token K + 1 times."""
    return ([position_rows([layout.starts[i]], [layout.lengths[i] - 1], K) for i in layout.spec]
            + [[p] * (K + 1) for p in last_rows(layout, layout.plain)])


def last_rows(layout: VerifyLayout, streams: list[int]) -> list[int]:
    """The hidden-state row of each of `streams`' last token (the plain sampling rows)."""
    return [layout.starts[i] + layout.lengths[i] - 1 for i in streams]


def kept_lengths(layout: VerifyLayout, counts: list[int]) -> list[int]:
    """The tokens each stream keeps (run_settled's settle): a speculating stream its accepted drafts (counts, in
    layout.spec's order) and the token before them, the others all they fed."""
    kept = list(layout.lengths)
    for i, c in zip(layout.spec, counts):
        kept[i] = c + 1
    return kept


def pads_one_stream(runner, num_tokens: int) -> bool:
    """Whether a step of one stream and `num_tokens` tokens that keeps verify states runs padded to two streams (on
    CUDA; "mtp"'s prompt chunks keep none): when the call its GDN ops see (the runner's bucket, else the step) is not
    decode-shaped, one stream takes the chunked path whole (ops/gdn_recurrence/split.py), which keeps states at chunk
    ends only; an empty second stream sends it to the recurrent kernel, which keeps any token, in a graph too. A verify
    of a few tokens in a bucket of at most 64 is decode-shaped already (padded, it needed a 2-stream bucket)."""
    from ..capture.buckets import choose  # (capture imports this package: not at the top)

    bucket = choose(runner.grid, 1, num_tokens) if runner is not None else None
    return not decode_shaped(1, bucket.tokens if bucket is not None else num_tokens)

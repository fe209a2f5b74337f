"""Where a speculating request stops inside the tokens a verify step emits, known before its slot commits them.

A verify step keeps a stream's accepted drafts in its slot (its context, its GDN / conv state), then delivers the
emitted tokens through the loop's stop checks (verify.py, loop_readback._advance), which end the request at the
first token that stops it: a token after it is neither emitted nor counted. Its drafts kept past that token would
still lie in the slot, and with prefix caching the slot's context is kept for later prompts when the request
ends (scheduler.remove): a prefix holding tokens the request never emitted, which the next turn of a conversation
(its prompt, its output, more) does not continue, so it restored less than after plain decoding. So the kept
drafts are cut first (`kept_counts`): through the stopping token, when it is a kept draft, and nothing past it
(plain decoding, overlapped, feeds the stopping token in the step after it; the token a verify step adds after
its drafts is never fed, as without overlap).

`stop_index` replays _advance's checks in its order without changing what the request shows: a stop token,
max_new_tokens, the grammar's output complete (its matcher rolled back after), a stop string (on a copy of its text:
StreamingText.ahead, whose adds the text keeps for the delivery's, so that the tokens a stop string could end at are
decoded once a step, not by each check and again by the delivery; a second check of the same step goes on after the
first's tokens). `may_end`, its first test, answers alone for a request with neither a grammar nor stop strings.
"""

from __future__ import annotations


def stop_index(r, tokens: list[int]) -> int | None:
    """The index in `tokens` (what a verify step emits for request r, in order, not taken in yet) of the token at
    which the loop's _advance ends r, or None when r goes on past them. Nothing r shows changes (its text keeps the
    adds made for its own: the module docstring). A token its grammar refuses ends it too (_advance fails the
    request there)."""
    if not may_end(r, tokens):  # (most requests' answer, without a copy of the text or the grammar's walk)
        return None
    g, text = r.grammar, r.text.ahead() if r.text is not None and r.text.stop else None
    started, taken = g is not None and g.started, 0
    try:
        for i, token in enumerate(tokens):
            if token in r.stop_ids or len(r.out) + i + 1 >= r.max_new:
                return i
            if g is not None:
                if not started:
                    started = token == g.starts_after
                elif not g.matcher.accept_token(token):
                    return i
                else:
                    taken += 1
                    if g.ends_when_complete and g.matcher.is_terminated():
                        return i
            if text is not None and text.add(token):
                return i
        return None
    finally:
        if taken:
            g.matcher.rollback(taken)
        if text is not None:
            text.keep()


def may_end(r, tokens: list[int]) -> bool:
    """Whether the delivery of `tokens` may end request r (stop_index may be other than None): always for one with
    a grammar or stop strings (stop_index tells), else whether one is a stop token or they reach max_new_tokens."""
    return (r.grammar is not None or (r.text is not None and bool(r.text.stop))
            or len(r.out) + len(tokens) >= r.max_new or not r.stop_ids.isdisjoint(tokens))


def kept_counts(reqs: list, emitted: list[list[int]], counts: list[int]) -> list[int]:
    """The drafts each speculating request's slot keeps: counts[b] (the accepted ones; `emitted[b]` its tokens:
    those drafts, then the added one), or, where it stops at a kept draft, the drafts through that one. A check
    that raises (its tokenizer's decode) cuts nothing: the delivery meets it again and fails that request alone
    (its slot reset, nothing kept), not the whole step."""
    kept = []
    for r, tokens, c in zip(reqs, emitted, counts):
        try:
            at = stop_index(r, tokens[:c]) if c else None
        except BaseException:  # (KeyboardInterrupt included, as the delivery's own catch)
            at = None
        kept.append(c if at is None else at + 1)
    return kept

"""What the reply parsers (reasoning.py, tool_parsers.py) share: finding tags in text that arrives in pieces.

A streamed reply comes as text deltas cut anywhere, so a tag (`</think>`, `<tool_call>`) may be split over
two of them: the end of the text that could be the start of a tag is held back until the next delta says
whether it is one.
"""

from __future__ import annotations


def partial_tag_len(text: str, *tags: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of one of `tags` (0: none): what to hold
    back until more text comes."""
    longest = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:n]):
                longest = n
                break
    return longest


def trailing_space_len(text: str) -> int:
    """The length of the whitespace that ends `text`."""
    return len(text) - len(text.rstrip())

"""Qwen3's reasoning (`--reasoning-parser qwen3`): the `<think>` ... `</think>` block of a reply split out of
its text into `reasoning_content`, whole or as the text streams.

    parser = ReasoningParser(in_reasoning=starts_in_reasoning(prompt_text))
    reasoning, content = parser.feed(delta)        # per text delta: the pieces of each it completes
    reasoning, content = parser.finish()           # the end of the reply: what was held back
    reasoning, content = split_reasoning(text, in_reasoning)    # a whole reply (None: no reasoning)

Where the block opens depends on the chat template: Qwen3.5 / Qwen3.6 open it in the generation prompt
(`<|im_start|>assistant\\n<think>\\n`), so the reply starts inside the reasoning and only `</think>` comes;
with `chat_template_kwargs: {"enable_thinking": false}` they close it there too (`<think>\\n\\n</think>\\n\\n`)
and the reply is all content; older Qwen3 templates leave the opening to the model, whose reply then begins
with `<think>`. `starts_in_reasoning` reads which from the part of the prompt written for the reply's turn (the
server's `reply_in_reasoning`: a `<think>` in an earlier message's text opens nothing). A reply cut before `</think>`
(max_tokens) is all reasoning. The whitespace that only frames the block is dropped, as the templates drop it
when they render a reply again (`reasoning_content|trim`, the content's leading newlines): around the
reasoning, and the newlines that begin the content after `</think>`. Text between is kept as it is.
"""

from __future__ import annotations

from .tags import partial_tag_len, trailing_space_len

THINK_START, THINK_END = "<think>", "</think>"
BEFORE, REASONING, CONTENT = "before", "reasoning", "content"


def starts_in_reasoning(prompt_text: str) -> bool:
    """Whether a reply to `prompt_text` (a rendered chat prompt) begins inside a reasoning block: the prompt's
    last `<think>` is not closed after it."""
    return prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)


class ReasoningParser:
    """The reasoning and the content of one reply, from its text deltas in order. Not thread-safe (one per
    reply). Joined, the pieces equal split_reasoning of the whole text, however the text was cut."""

    def __init__(self, in_reasoning: bool = False):
        self._state = REASONING if in_reasoning else BEFORE
        self._held = ""  # text received and not yet given out
        self._trim_start = True  # the newlines or spaces that begin the current part are dropped

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` completes; either may be "" (text held back: a possible tag, the
        whitespace that may end the reasoning)."""
        self._held += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) held back until the end of the reply."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        while True:
            if self._state == BEFORE:  # may the reply open a block itself (after whitespace)?
                stripped = self._held.lstrip()
                if stripped.startswith(THINK_START):
                    self._held, self._state = stripped[len(THINK_START):], REASONING
                    continue
                if not final and THINK_START.startswith(stripped):  # all of it may still be the tag
                    return reasoning, content
                self._state, self._trim_start = CONTENT, False
                continue
            if self._state == REASONING:
                if self._trim_start:
                    self._held = self._held.lstrip()
                    if not self._held and not final:
                        return reasoning, content
                    self._trim_start = False
                end = self._held.find(THINK_END)
                if end >= 0:
                    reasoning += self._held[:end].rstrip()
                    self._held, self._state, self._trim_start = self._held[end + len(THINK_END):], CONTENT, True
                    continue
                if final:
                    reasoning += self._held.rstrip()
                    self._held = ""
                    return reasoning, content
                tag = partial_tag_len(self._held, THINK_END)  # "</thi" may be the start of the end
                body = self._held[:len(self._held) - tag]
                keep = len(body) - trailing_space_len(body)  # whitespace may be the last of the reasoning
                reasoning += body[:keep]
                self._held = self._held[keep:]
                return reasoning, content
            if self._trim_start:  # CONTENT after </think>: its leading newlines frame the block
                self._held = self._held.lstrip("\n")
                if not self._held:
                    return reasoning, content
                self._trim_start = False
            content += self._held
            self._held = ""
            return reasoning, content


def split_reasoning(text: str, in_reasoning: bool = False) -> tuple[str | None, str]:
    """(reasoning, content) of a whole reply; reasoning None when the reply has no reasoning block or an empty
    one."""
    parser = ReasoningParser(in_reasoning)
    reasoning, content = parser.feed(text)
    more_reasoning, more_content = parser.finish()
    reasoning += more_reasoning
    return (reasoning or None), content + more_content

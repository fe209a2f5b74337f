"""The engine's TokenLogprobs in the wire formats: OpenAI's completions (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`) and chat (`logprobs.content[{token, logprob, bytes, top_logprobs}]`) formats, and
vLLM's `prompt_logprobs` ({token id: {logprob, rank, decoded_token}} per prompt position).

Token strings are vLLM's: `tokenizer.decode([token_id])` of each token alone, special tokens kept, so a token
that ends inside a UTF-8 character is U+FFFD; without a tokenizer, and for a request with vLLM's
return_tokens_as_token_ids, "token_id:N" (`token_id_string`). A chat token's `bytes` are OpenAI's: the token's own
bytes of the text's UTF-8, which joined give the text back where a character spans tokens (a byte-level BPE's, Qwen's:
the piece read through GPT-2's byte alphabet; an added token's, its content's). vLLM wrote the string's, U+FFFD's
three bytes for each part of a character, from which no client could rebuild an emoji or a CJK character split in
tokens; a tokenizer of another kind still gives the string's.
A logprob of -inf is written -9999.0 (JSON has no infinity; vLLM's value). The values are the raw
distribution's (metrale_graph/logprobs.py).
"""

from __future__ import annotations

from typing import Sequence

from ..logprobs import TokenLogprobs
from .responses import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob, PromptLogprobs, TopLogprob

LOWEST = -9999.0  # what a logprob of -inf is written as


def _value(logprob: float) -> float:
    return max(logprob, LOWEST)


def token_id_string(token_id: int) -> str:
    """A token's string as vLLM's return_tokens_as_token_ids writes it, whatever its text: "token_id:N"."""
    return f"token_id:{token_id}"


class TokenStrings:
    """Each token id's string (and its bytes), decoded once and kept (a server sees the same few thousand tokens
    again and again). Used by the event loop only."""

    def __init__(self, tokenizer):
        self._tokenizer, self._strings, self._bytes = tokenizer, {}, {}
        self._byte_level = _byte_level(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {i: str(getattr(t, "content", t)) for i, t in added.items()}

    def __call__(self, token_id: int) -> str:
        string = self._strings.get(token_id)
        if string is None:
            string = token_id_string(token_id) if self._tokenizer is None else self._tokenizer.decode([token_id])
            self._strings[token_id] = string
        return string

    def bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (the module's docstring says whose)."""
        out = self._bytes.get(token_id)
        if out is None:
            piece = None
            if self._byte_level and token_id not in self._added:
                piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece and all(c in _UNICODE_BYTES for c in piece):
                out = [_UNICODE_BYTES[c] for c in piece]
            else:
                out = list(self._added.get(token_id, self(token_id)).encode("utf-8", errors="replace"))
            self._bytes[token_id] = out
        return out


def _gpt2_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a byte-level BPE's pieces, read back."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # ('!'-'~', '¡'-'¬', '®'-'ÿ': themselves)
    extra = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(extra)}}


_UNICODE_BYTES = _gpt2_alphabet()


def _byte_level(tokenizer) -> bool:
    """Whether `tokenizer` (a transformers tokenizer or None) is a byte-level BPE: its pieces spell bytes."""
    try:
        from tokenizers import decoders
    except ImportError:  # pragma: no cover (transformers' fast tokenizers need it)
        return False
    return isinstance(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None), decoders.ByteLevel)


def completion_logprobs(strings: TokenStrings, token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None],
                        top_n: int, offset: int = 0) -> CompletionLogprobs:
    """OpenAI's completions logprobs of `token_ids` (entries[i]: token i's, None for a prompt's first token), each
    position's top `top_n` and the token itself, keyed by their strings (where tokens share one, the most likely's
    value: vLLM writes the last's); offsets from `offset` (the text before these tokens)."""
    out = CompletionLogprobs()
    for token, entry in zip(token_ids, entries):
        string = strings(token)
        out.tokens.append(string)
        out.text_offset.append(offset)
        offset += len(string)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_value(entry.logprob))
        top: dict[str, float] = {}
        for t, v in [*entry.top[:top_n], (token, entry.logprob)]:  # (most likely first: a string shared by several
            top.setdefault(strings(t), _value(v))                  # tokens, U+FFFD, keeps the most likely one's)
        out.top_logprobs.append(top)
    return out


def chat_logprobs(strings: TokenStrings, token_ids: Sequence[int], entries: Sequence[TokenLogprobs],
                  top_n: int) -> ChatLogprobs:
    """OpenAI's chat logprobs of `token_ids`: each token's string, logprob and bytes, and its position's top
    `top_n`."""
    return ChatLogprobs(content=[
        ChatTokenLogprob(**_top(strings, token, entry.logprob),
                         top_logprobs=[TopLogprob(**_top(strings, t, v)) for t, v in entry.top[:top_n]])
        for token, entry in zip(token_ids, entries)])


def _top(strings, token: int, logprob: float) -> dict:
    """A chat entry's token, logprob and bytes; `strings`: a TokenStrings, or token_id_string (vLLM's
    return_tokens_as_token_ids: the bytes of "token_id:N", as vLLM writes them)."""
    string = strings(token)
    own = getattr(strings, "bytes", None)
    return {"token": string, "logprob": _value(logprob),
            "bytes": own(token) if own is not None else list(string.encode("utf-8", errors="replace"))}


def prompt_logprobs(strings: TokenStrings, prompt: Sequence[int], entries: Sequence[TokenLogprobs | None],
                    top_n: int) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per prompt position None (the first) or {token id: PromptLogprob}, the prompt's
    own token first, then the top `top_n` (most likely first, rank 1 up)."""
    out: PromptLogprobs = []
    for token, entry in zip(prompt, entries):
        if entry is None:
            out.append(None)
            continue
        position = {str(t): PromptLogprob(logprob=_value(v), rank=rank, decoded_token=strings(t))
                    for rank, (t, v) in enumerate(entry.top[:top_n], start=1)}
        own = PromptLogprob(logprob=_value(entry.logprob), rank=entry.rank, decoded_token=strings(token))
        out.append({str(token): own, **{k: v for k, v in position.items() if k != str(token)}})
    return out

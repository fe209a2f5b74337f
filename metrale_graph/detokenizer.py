"""Incremental detokenization: the text each new token adds, UTF-8 safe, with stop strings.

    text = StreamingText(tokenizer, prompt_ids, decode_kwargs, stop=("\\n\\n",))
    piece, stopped = text.add([token_id], final=False)   # the text to send now ("" while held back)

`IncrementalDetokenizer` follows vLLM's incremental detokenizer (and transformers' TextStreamer):
it decodes a short window of recent tokens and sends what the newest tokens add, but only once it
ends in a whole character. A byte-level BPE (Qwen's, GPT-2's) splits a multi-byte UTF-8 character
(CJK, emoji) over several tokens, and the first of them decode to U+FFFD alone; those are held back
until the character completes, so no streamed piece ends in a broken character. The window starts
with the last few prompt tokens, so a tokenizer that drops the leading space of a decoded text's
first word (sentencepiece) spaces the first new word as the whole text would.

`StreamingText` adds stop strings on top: a stop string is matched on the text (across token
boundaries), the text from it on is cut and never sent, and the request ends with "stop". While
the request runs the last (longest stop string - 1) characters are held back, because they may
be the start of a stop string that the next tokens complete. As in vLLM, `include_stop` keeps the
stop string (the text is cut after it, nothing held back), and with `min_tokens` a stop string ends
the text only from the token after the first min_tokens on. A stop token (one of `stop_ids`: the eos
tokens, a request's stop_token_ids) that ends the request adds no text, as vLLM's detokenizer leaves it
out: a stop token that is no special token (a word of the vocabulary sent as a stop_token_id) would
otherwise end the text; `include_stop` keeps it, as it keeps a stop string.

`drop_ids`: tokens whose text is left out, filtered before decoding: a request that keeps some special tokens'
text (Engine.submit's keep_special_ids) decodes with skip_special_tokens=False and drops the other special
tokens itself.

For a byte-level tokenizer the pieces joined equal `tokenizer.decode(new_ids)` (cut at a stop
string); a tokenizer that rewrites text across tokens (clean_up_tokenization_spaces) may differ
in those spaces, as vLLM's streams do.

`StreamingText.ahead` checks tokens before the text takes them (speculative/stops.py: where a stop string ends
a request inside the tokens a verify step will deliver): a `TextAhead` adds them on a private copy, and the text
keeps what each add gave and the state after it, so that its own adds of the same tokens, one by one and not final,
take them instead of decoding them a second time (the state after each is what adding it would leave). Any other
add drops what is left of them.
"""

from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"  # what a decode gives for the bytes of an incomplete UTF-8 character
CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the first new token (vLLM's offset)


class IncrementalDetokenizer:
    """The text of a growing token sequence, piece by piece. Not thread-safe (one per request)."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], decode_kwargs: dict | None = None,
                 drop_ids: frozenset = frozenset()):
        self._tokenizer, self._kwargs = tokenizer, dict(decode_kwargs or {})
        self._drop = drop_ids  # tokens left out before decoding (the special tokens a request skips itself)
        context = [t for t in prompt_ids[-CONTEXT_TOKENS:] if t not in drop_ids]
        if self._decode(context).endswith(REPLACEMENT):  # the prompt ends inside a character: no context
            context = []
        self._ids = context  # (only the window is kept: the ids before it are dropped as it moves on)
        self._prefix = 0  # the window is self._ids[self._prefix:]
        self._read = len(context)  # tokens before this one have been sent
        self._prefix_text: str | None = None  # decode of self._ids[self._prefix:self._read], cached

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, **self._kwargs) if ids else ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Append `token_ids`; the text they complete ("" while the newest token ends inside a character,
        or adds no text, e.g. a skipped special token)."""
        self._ids.extend(t for t in token_ids if t not in self._drop)
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        if len(full) <= len(self._prefix_text) or full.endswith(REPLACEMENT):
            return ""
        piece = full[len(self._prefix_text):]
        self._move_on()
        return piece

    def _move_on(self) -> None:
        """The tokens added so far are sent: the window starts at the first of them not sent before."""
        del self._ids[:self._read]
        self._prefix, self._read, self._prefix_text = 0, len(self._ids), None

    def fork(self) -> "IncrementalDetokenizer":
        """A copy that takes tokens without changing this one (the tokenizer shared)."""
        other = object.__new__(type(self))  # (copy.copy's protocol costs more than the copy)
        other.__dict__.update(self.__dict__)
        other._ids = list(self._ids)
        return other

    def flush(self) -> str:
        """The text held back (the sequence ended): as the tokenizer decodes it, replacement characters
        for an incomplete character included."""
        if self._read == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        piece = self._decode(self._ids[self._prefix:])[len(self._prefix_text):]
        self._move_on()
        return piece


def check_stop_strings(stop) -> tuple[str, ...]:
    """`stop` (None, a string, or a list of strings) as a tuple of non-empty strings; ValueError
    naming a bad one."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, bytes) or not isinstance(stop, (Sequence, set, frozenset)):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    out = []
    for s in stop:
        if not isinstance(s, str):
            raise ValueError(f"stop string {s!r} must be a str, got {type(s).__name__}")
        if not s:
            raise ValueError("stop strings must be non-empty (an empty one would stop before any text)")
        out.append(s)
    return tuple(out)


class StreamingText:
    """A request's streamed text: IncrementalDetokenizer plus stop strings (module docstring)."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], decode_kwargs: dict | None = None,
                 stop: Sequence[str] = (), include_stop: bool = False, min_tokens: int = 0,
                 stop_ids: frozenset = frozenset(), drop_ids: frozenset = frozenset()):
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, decode_kwargs, drop_ids)
        self.stop, self.include_stop, self.min_tokens = tuple(stop), include_stop, min_tokens
        self.stop_ids = stop_ids  # a last token among them adds no text (unless include_stop)
        self._hold = 0 if include_stop else max((len(s) for s in self.stop), default=1) - 1
        self._tokens = 0  # tokens added so far
        self._text = ""  # everything decoded so far (cut at a stop string once one matched)
        self.sent = 0  # characters of _text already given out
        self.stop_string: str | None = None  # the stop string that ended the text
        self._ahead: _Kept | None = None  # adds a TextAhead made, kept for this text's own (ahead())

    @property
    def text(self) -> str:
        """The text given out so far."""
        return self._text[:self.sent]

    def fork(self) -> "StreamingText":
        """A copy that takes tokens without changing this one: where a stop string would end the text
        (speculative/stops.py, ahead of the tokens' delivery)."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other._detok, other._ahead = self._detok.fork(), None
        return other

    def ahead(self) -> "TextAhead":
        """Adds checked before this text takes them (the module docstring); it goes on after the adds an earlier one
        kept that this text has not taken yet."""
        return TextAhead(self)

    def add(self, token_ids: Sequence[int], final: bool) -> tuple[str, bool]:
        """Append new tokens (final: the request ends with them). Returns the text to give out now and
        whether a stop string matched (then the text ends before it, and nothing more comes)."""
        kept = self._ahead
        if kept is not None:  # the next add a TextAhead made, or nothing of them any more
            j = kept.taken
            if not final and len(token_ids) == 1 and token_ids[0] == kept.tokens[j]:
                _restore(self, kept.states[j])
                kept.taken = j + 1
                if j + 1 == len(kept.tokens):
                    self._ahead = None
                return kept.results[j]
            self._ahead = None
        if self.stop_string is not None:
            return "", True
        start = len(self._text)
        self._tokens += len(token_ids)
        if final and token_ids and token_ids[-1] in self.stop_ids and not self.include_stop:
            token_ids = token_ids[:-1]  # the stop token that ends the request: no text of its own
        self._text += self._detok.add(token_ids)
        if final:
            self._text += self._detok.flush()
        cut = self._find_stop(start) if self._tokens > self.min_tokens else None
        if cut is not None:
            if self.include_stop:
                cut += len(self.stop_string)
            self._text = self._text[:cut]
            end = cut
        else:
            end = len(self._text) if final else max(self.sent, len(self._text) - self._hold)
        piece, self.sent = self._text[self.sent:end], end
        return piece, cut is not None

    def _find_stop(self, start: int) -> int | None:
        """Where the first stop string in the text begins, searching only where a match can end in the
        text added since `start` (one ending earlier was found before)."""
        best = None
        for s in self.stop:
            i = self._text.find(s, max(0, start - len(s) + 1))
            if i >= 0 and (best is None or i < best):
                best, self.stop_string = i, s
        return best


def _state(text: StreamingText) -> tuple:
    """What a StreamingText's add changes (its detokenizer's window included)."""
    d = text._detok
    return text._tokens, text._text, text.sent, text.stop_string, tuple(d._ids), d._prefix, d._read, d._prefix_text


def _restore(text: StreamingText, state: tuple) -> None:
    d = text._detok
    text._tokens, text._text, text.sent, text.stop_string, ids, d._prefix, d._read, d._prefix_text = state
    d._ids = list(ids)


class _Kept:
    """The adds a TextAhead kept with its text: per token, its id, what add gave ((piece, stopped)) and the state
    after it; `taken` of them taken by the text's own adds so far; `copy`: the TextAhead's copy in the last state,
    or None."""
    __slots__ = ("tokens", "results", "states", "copy", "taken")

    def __init__(self, tokens: list[int], results: list[tuple], states: list[tuple], copy: StreamingText | None):
        self.tokens, self.results, self.states, self.copy, self.taken = tokens, results, states, copy, 0


class TextAhead:
    """Tokens added ahead of a StreamingText's own adds (StreamingText.ahead, the module docstring), one by one and
    not final, on a private copy: add(token) says whether a stop string matched there; keep() leaves the adds with
    the text. Going on from an earlier one's kept adds, a token it added is not decoded again."""

    def __init__(self, text: StreamingText):
        kept, text._ahead = text._ahead, None  # (this one's until keep: none meanwhile)
        self.text, self.n = text, 0
        if kept is not None and kept.taken == 0:
            self.tokens, self.results, self.states, self.copy = kept.tokens, kept.results, kept.states, kept.copy
        else:
            self.tokens, self.results, self.states, self.copy = [], [], [], text.fork()
        # self.copy: None, or in the state after the last of self.tokens (the text's own without any)

    def add(self, token: int) -> bool:
        """Add `token` after the ones before (final=False); whether a stop string matched (then add no more)."""
        n, copy = self.n, self.copy
        if n < len(self.tokens):
            if self.tokens[n] == token:  # (added before)
                self.n = n + 1
                return self.results[n][1]
            del self.tokens[n:], self.results[n:], self.states[n:]  # another token: from the state before it
            copy = None
        if copy is None:
            copy = self.text.fork()
            if self.states:
                _restore(copy, self.states[-1])
        self.copy = None  # (until the add below returns)
        result = copy.add([token], final=False)
        self.tokens.append(token)
        self.results.append(result)
        self.states.append(_state(copy))
        self.n, self.copy = n + 1, copy
        return result[1]

    def keep(self) -> None:
        """The adds made, for the text's own adds of the same tokens to take."""
        if self.tokens:
            self.text._ahead = _Kept(self.tokens, self.results, self.states, self.copy)

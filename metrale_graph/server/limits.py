"""What one request may make the server hold: the bytes of its body, and the tokenizer's time on its texts.

    app = BodyLimit(app, max_bytes=DEFAULT_MAX_REQUEST_BYTES)   # 413 once a body passes max_bytes
    bound = TokenBound(tokenizer)                               # bound.bytes_per_token: None when unknown
    bound.fewest_tokens(text) >= max_context                    # refused before it is tokenized

A body is counted as it is read (a chunked one too: no Content-Length), so a body over the limit is never held
whole. A text is tokenized in the server's one tokenizing thread (state.ServerState.off_loop), so one prompt
of megabytes held every text request behind it for as long as it took; a text whose token count must exceed
the context is refused before that, from a bound that holds for every text, not an estimate.
"""

from __future__ import annotations

import json

from .errors import body_too_large

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # a full 262,144-token context of token ids is about 2 MB of JSON

# the normalizers whose output over a whole text is never longer (in UTF-8 bytes) than their outputs over the
# pieces the tokenizer cuts at its added tokens: composition across a cut can only shorten the whole
NORMAL_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}
# the pre-tokenizers of a byte-level BPE that keep every character of the text (a Split may not remove its
# matches: Qwen's and GPT-2's isolate them)
KEEP_EVERY_CHARACTER = {"ByteLevel", "Split", "Digits", "Punctuation"}


class BodyLimit:
    """ASGI middleware: 413 (OpenAI's error shape) for an HTTP request whose body passes `max_bytes`: at once
    when its Content-Length says so, else as soon as the bytes read pass it (the rest is never kept: uvicorn
    discards what comes after the response). A body within the limit is handed to the app in one message.
    `max_bytes` > 0 (build_app checks it)."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await body_too_large(self.max_bytes, int(length)).response()(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: the app sees it at its first receive
                first = message
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await body_too_large(self.max_bytes).response()(scope, receive, send)
                return
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        del chunks  # (the body is in `first`, whole)
        pending = [first]

        async def replay():
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)


class TokenBound:
    """The fewest tokens a text can be under `tokenizer`, known without tokenizing it.

    For a byte-level BPE (Qwen's, GPT-2's) every token covers whole bytes of the text's UTF-8 after the
    tokenizer's normalizer (a BPE token's string holds one character per byte; an added token, its content),
    so a text of B such bytes is at least ceil(B / bytes_per_token) tokens, bytes_per_token the most any token
    of the vocabulary covers. For a tokenizer this cannot be read from (another model or pre-tokenizer, an
    unknown normalizer, no `backend_tokenizer`), bytes_per_token is None and the bound says nothing (0)."""

    def __init__(self, tokenizer):
        self.bytes_per_token, self._normalizer = None, None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return
        spec = json.loads(backend.to_str())
        if not (spec.get("model", {}).get("type") == "BPE" and _keeps_every_byte(spec.get("pre_tokenizer"))
                and _shortens_whole(spec.get("normalizer"))):
            return
        from tokenizers.pre_tokenizers import ByteLevel

        self._normalizer = backend.normalizer
        alphabet = set(ByteLevel.alphabet())
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        bpe = (len(s) if set(s) <= alphabet else len(s.encode("utf-8"))
               for s in backend.get_vocab(with_added_tokens=False) if s not in added)
        # an added token is matched in the text as it came or as normalized (its `normalized` flag): either length
        whole = (max(len(s.encode("utf-8")), len(self._normalize(s).encode("utf-8"))) for s in added)
        self.bytes_per_token = max(max(bpe, default=1), max(whole, default=1))

    def _normalize(self, text: str) -> str:
        return text if self._normalizer is None else self._normalizer.normalize_str(text)

    def fewest_tokens(self, text: str) -> int:
        """A lower bound of len(tokenizer.encode(text)) (0 when unknown): linear in the text, no tokenizing."""
        if self.bytes_per_token is None:
            return 0
        return -(-len(self._normalize(text).encode("utf-8")) // self.bytes_per_token)

    def most_characters(self, tokens: int) -> int | None:
        """The most characters the text of `tokens` tokens can decode to (every token at most bytes_per_token
        bytes, a character at least one; a byte that is no character decodes to one U+FFFD), None when unknown."""
        return None if self.bytes_per_token is None else tokens * self.bytes_per_token


def _keeps_every_byte(pre_tokenizer) -> bool:
    """Whether the tokenizer's pre-tokenizer (its JSON) is a byte-level one that drops no character."""
    if not pre_tokenizer:
        return False
    steps = pre_tokenizer.get("pretokenizers") if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]
    return (bool(steps) and any(s.get("type") == "ByteLevel" for s in steps)
            and all(s.get("type") in KEEP_EVERY_CHARACTER and s.get("behavior") != "Removed" for s in steps))


def _shortens_whole(normalizer) -> bool:
    """Whether the tokenizer's normalizer (its JSON) is none or Unicode normal forms (NORMAL_FORMS)."""
    if normalizer is None:
        return True
    steps = normalizer.get("normalizers") if normalizer.get("type") == "Sequence" else [normalizer]
    return steps is not None and all(s.get("type") in NORMAL_FORMS for s in steps)

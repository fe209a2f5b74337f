"""The structured-output backend (xgrammar): grammars compiled in a worker and cached, one matcher per request,
and the batch's token bitmask filled on the host for the device to apply (vLLM's structured_output design).

    grammars = Grammars(tokenizer, vocab_size)        # one per engine; the tokenizer's vocabulary goes to xgrammar
    compiled = grammars.compile(spec).result()        # a Future: compiled in the worker, cached by spec.key
    r.grammar = grammars.matcher(compiled, spec, stop_ids)     # per request
    masks = TokenMasks(rows, vocab_size, device)      # per engine loop
    bitmask = masks.fill(requests)                    # int32 [n, ceil(vocab / 32)] on the device, for sample()
    r.grammar.accept(token)                           # each token read back; .complete: the output is whole
    bitmask = masks.fill_drafts(requests, K)          # a verify step's [len(requests) * (K + 1), words]

Why xgrammar and not llguidance: the mask's fill per token on Qwen3.5's 248k vocabulary measured 2-10 us
(median) against 15-21 us, and a batch of 64 0.6 ms against 1.0 ms (docs/structured.md).

Compilation: one worker thread compiles each distinct grammar once (the key: kind and source), the last
MAX_CACHED kept; a request waits for it before it is queued (Engine.submit), so the engine loop never compiles.
The first compilation also builds xgrammar's view of the vocabulary (about 1 s at 248k tokens). A grammar that
does not compile is a StructuredOutputError naming the library's reason; a failure is not cached.

JSON (json, json_object) is written compactly, `{"a": 1, "b": [2, 3]}`: xgrammar's separators ", " and ": " and
no other whitespace (vLLM's disable_any_whitespace), so a model cannot spend its tokens on whitespace between
values, or loop in it, and the text parses the same. A JSON text never holds a raw control character (U+0000 to
U+001F: JSON escapes them in strings, and compact JSON has no whitespace outside them), but xgrammar's strings of
bounded length (maxLength) allow them: a JSON grammar's mask is also held to the tokens without such a byte
(`plain_tokens`).

Added tokens: xgrammar reads an added token (`<|im_start|>`, `<think>`, `<tool_call>`) as the text of its content,
so a JSON string or a free regex allowed it, `{"a": "x<|im_start|>..."}`, a control token inside the output (whose
text the reply then skips, or a parser reads as a tag). Every grammar's mask is also held to the tokenizer's own
tokens (`ordinary_tokens`: not its added or special ones; a byte-level BPE spells any text without them); the
request's end tokens (below) stay allowed, where the grammar may end (xgrammar's mask). A structural tag also allows
the added tokens within its literal strings (`_tagged`: Qwen3.5's `<tool_call>` in the trigger `<tool_call>\n<function=`):
the model writes its calls with its own tokens, and where the tag does not write them they stay masked.

Stop tokens (vLLM's: its grammars end at the tokenizer's end tokens, and a request's stop_token_ids end it where
sampled, the grammar unaware of them): a request's stop tokens (eos and stop_token_ids) that its grammar never
writes as text (eos, `<|im_end|>`: neither ordinary nor a structural tag's) are its end tokens, allowed only where
the output may end. One it may write (`[` in stop_token_ids) is text as any other, allowed where the grammar allows
its text (a JSON array's `[`), never as an end: as an end token it would be masked where the grammar needs it,
leaving nothing to sample. Either ends the request where it is sampled, as always ("stop"). A request without end
tokens ends ("stop") as soon as its output is complete under the grammar (`complete`); the mask never allows eos then.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .grammar_unicode import joined_pairs, schema_pairs, tag_pairs
from .structured import StructuredOutput, StructuredOutputError, choice_grammar

MAX_CACHED = 256  # compiled grammars kept (each a few MB at most for big schemas)


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        if getattr(e, "name", None) == "xgrammar":
            raise StructuredOutputError("structured output needs the xgrammar package: pip install "
                                        "'metrale-graph[serve]' (or xgrammar)") from None
        # installed, but one of its own dependencies is missing or broken: say which
        raise StructuredOutputError(f"structured output: xgrammar is installed but does not import ({e})") from e
    return xgrammar


class Grammars:
    """One engine's grammar compiler: `tokenizer` a transformers tokenizer, `vocab_size` the model's (the
    tokenizer's ids padded up to it are never allowed)."""

    def __init__(self, tokenizer, vocab_size: int):
        xgr = _xgrammar()
        from transformers import PreTrainedTokenizerBase

        if not isinstance(tokenizer, PreTrainedTokenizerBase):
            raise StructuredOutputError(f"structured output needs a transformers tokenizer (its vocabulary goes to "
                                        f"the grammar library), got {type(tokenizer).__name__}")
        self.tokenizer, self.vocab_size, self._xgr = tokenizer, vocab_size, xgr
        self._compiler = None  # built in the worker by the first compilation
        self.ordinary_tokens: torch.Tensor | None = None  # int32 [words]: the tokens neither added nor special
        self.plain_tokens: torch.Tensor | None = None  # int32 [words]: those without a control byte (JSON's)
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrale-grammar")

    def compile(self, spec: StructuredOutput) -> Future:
        """A Future of `spec`'s compiled grammar (already done when cached); its exception a
        StructuredOutputError when the grammar does not compile."""
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None:
                self._cache.move_to_end(spec.key)
                return future
            future = self._worker.submit(self._compile, spec)
            self._cache[spec.key] = future
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: f.exception() is not None and self._forget(spec.key, f))
        return future

    def _forget(self, key, future: Future) -> None:
        with self._lock:
            if self._cache.get(key) is future:
                del self._cache[key]

    def _compile(self, spec: StructuredOutput):
        xgr = self._xgr
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            added = set(self.tokenizer.added_tokens_decoder) | set(self.tokenizer.all_special_ids)
            pieces = info.decoded_vocab  # (the ids past the tokenizer's, padding, are never allowed)
            ordinary = [i for i in range(min(self.vocab_size, len(pieces))) if i not in added]
            self.ordinary_tokens = _bitmask(self.vocab_size, ordinary)
            self.plain_tokens = _bitmask(self.vocab_size, [i for i in ordinary if not any(b < 0x20 for b in pieces[i])])
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # (the cache is ours, by key)
        compiler = self._compiler
        try:
            if spec.kind in ("json", "json_object"):
                schema = schema_pairs(spec.source) if spec.kind == "json" else '{"type": "object"}'
                return compiler.compile_json_schema(schema, any_whitespace=False)  # compact (module docstring)
            if spec.kind == "regex":
                return compiler.compile_regex(joined_pairs(spec.source, "regex"))
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(spec.source)))
            if spec.kind == "structural_tag":
                return compiler.compile_structural_tag(tag_pairs(spec.source))
            source = joined_pairs(spec.source, "grammar")
            return compiler.compile_lark(source) if is_lark(source) else compiler.compile_grammar(source)
        except StructuredOutputError:  # (grammar_unicode's: a lone surrogate escape)
            raise
        except (RuntimeError, ValueError) as e:
            raise StructuredOutputError(f"{spec.kind}: the {_NAMES[spec.kind]} does not compile: {_reason(e)}") from None

    def matcher(self, compiled, spec: StructuredOutput, stop_ids) -> "Grammar":
        """A request's Grammar over `compiled` (spec's, compile()'s result), with the request's stop tokens: those
        its grammar may write as text (the ordinary tokens, a structural tag's added ones) text, the others its end
        tokens (module docstring)."""
        # (compile() has run: the bitmasks are there)
        also = self.plain_tokens if spec.kind in ("json", "json_object") else self.ordinary_tokens
        text = self.ordinary_tokens
        if spec.kind == "structural_tag":
            tagged = self._tagged(spec.source)
            also, text = also | tagged, text | tagged
        ends = sorted(t for t in stop_ids if not _allowed(text, t))  # (stop ids are below vocab_size)
        matcher = (self._xgr.GrammarMatcher(compiled, override_stop_tokens=ends) if ends
                   else self._xgr.GrammarMatcher(compiled, terminate_without_stop_token=True))
        if ends:
            also = also | _bitmask(self.vocab_size, ends)
        return Grammar(matcher, spec.starts_after, not ends, also)

    @functools.lru_cache(maxsize=MAX_CACHED)
    def _tagged(self, source: str) -> torch.Tensor:
        """The bitmask of the added tokens a structural tag writes (one whose text lies within one of its literal
        strings: Qwen3.5's `<tool_call>` in the trigger `<tool_call>\\n<function=`), which its matcher may allow."""
        literals = []

        def walk(node):
            if isinstance(node, dict):
                for key, value in node.items():
                    if key in ("begin", "end", "value", "separator") and isinstance(value, str):
                        literals.append(value)
                    elif key == "triggers" and isinstance(value, list):
                        literals.extend(v for v in value if isinstance(v, str))
                    elif key != "excludes":
                        walk(value)
            elif isinstance(node, list):
                for value in node:
                    walk(value)
        walk(json.loads(source))
        added = {i: str(getattr(t, "content", t)) for i, t in self.tokenizer.added_tokens_decoder.items()}
        return _bitmask(self.vocab_size, [i for i, text in added.items() if text and any(text in lit for lit in literals)])

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


def _reason(e: Exception) -> str:
    """xgrammar's reason of an error ("[time] file.cc:line: reason")."""
    return str(e).strip().splitlines()[0].split(": ", 1)[-1] if str(e).strip() else type(e).__name__


# xgrammar 0.2.9's characters of a string of bounded length (minLength / maxLength): any but a quote, a backslash and
# CR / LF, so a tab or another control character JSON does not allow raw; the json kinds' masks hold them off
# (plain_tokens), and json_format's grammar writes the class of its unbounded strings instead
_BOUNDED_CHARACTER, _JSON_CHARACTER = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\]'


def json_format(schema: str) -> dict:
    """A structural tag's format (an EBNF grammar) of the JSON text that `schema` (a JSON schema's text, checked:
    structured.structured_output) allows, written compactly as the json kind's grammar is, for a tag whose other
    formats need the control characters that JSON text never holds raw (a newline between XML tags), so that its
    mask cannot hold them off. StructuredOutputError when xgrammar cannot convert it."""
    xgr = _xgrammar()
    try:
        grammar = str(xgr.Grammar.from_json_schema(schema_pairs(schema), any_whitespace=False))
    except StructuredOutputError:
        raise
    except (RuntimeError, ValueError) as e:
        raise StructuredOutputError(f"json: the JSON schema does not compile: {_reason(e)}") from None
    return {"type": "grammar", "grammar": grammar.replace(_BOUNDED_CHARACTER, _JSON_CHARACTER)}


def is_lark(grammar: str) -> bool:
    """Whether a grammar is Lark's (`start: "yes" | "no"`) rather than EBNF (`root ::= ...`): no line defines a rule
    with `::=` (vLLM's test, which takes both)."""
    lines = (re.sub(r"(#|//).*$", "", line).strip() for line in grammar.splitlines())
    return not any("::=" in line for line in lines)


def _bitmask(vocab_size: int, tokens) -> torch.Tensor:
    """int32 [ceil(vocab_size / 32)] with the bits of `tokens` (ids below vocab_size) set."""
    bits = torch.zeros(-(-vocab_size // 32) * 32, dtype=torch.bool)
    bits[torch.tensor([t for t in tokens if t < vocab_size], dtype=torch.int64)] = True
    weights = torch.tensor([1 << j for j in range(31)] + [-(1 << 31)], dtype=torch.int64)
    return (bits.view(-1, 32).to(torch.int64) * weights).sum(dim=1).to(torch.int32)


def _allowed(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[token // 32]) >> (token % 32)) & 1)


_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regular expression",
          "choice": "choice", "grammar": "grammar", "structural_tag": "structural tag"}


class Grammar:
    """One request's place in its grammar (used by the engine loop's thread only). Before `starts_after` is
    sampled the grammar has not started and allows every token."""

    def __init__(self, matcher, starts_after: int | None, ends_when_complete: bool,
                 also: torch.Tensor | None = None):
        self.matcher, self.starts_after, self.ends_when_complete = matcher, starts_after, ends_when_complete
        self.also = also  # a bitmask its masks are also held to (the ordinary or plain tokens, Grammars'), or None
        self.started = starts_after is None

    def accept(self, token: int) -> None:
        """Advance past `token`; StructuredOutputError if the grammar does not allow it (its mask failed: a row
        with every token masked, as min_tokens can make one)."""
        if not self.started:
            self.started = token == self.starts_after
            return
        if not self.matcher.accept_token(token):
            raise StructuredOutputError(f"the grammar does not allow the sampled token {token}: no allowed token "
                                        "was left to sample")

    @property
    def complete(self) -> bool:
        """Whether the output is whole and ends here (requests without stop tokens: module docstring)."""
        return self.ends_when_complete and self.started and self.matcher.is_terminated()


class TokenMasks:
    """The int32 bitmask of a step's sampling rows (bit j of word w: token 32 w + j allowed), `rows` at most:
    filled on the host (pinned on CUDA) by xgrammar's batch fill (threads), then copied to the device behind the
    step. `fill_s` / `filled`: host seconds spent filling and the grammar rows filled, for the stats."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device):
        xgr = _xgrammar()
        self.device = torch.device(device)
        words = -(-vocab_size // 32)
        cuda = self.device.type == "cuda"
        self.host = torch.empty(rows, words, dtype=torch.int32, pin_memory=cuda)
        self.on_device = torch.empty(rows, words, dtype=torch.int32, device=self.device) if cuda else self.host
        self._batch = xgr.BatchGrammarMatcher()
        self.fill_s, self.filled = 0.0, 0
        self._drafts: tuple[torch.Tensor, torch.Tensor] | None = None  # fill_drafts' host and device buffers

    def fill(self, requests: list) -> torch.Tensor | None:
        """The bitmask [len(requests), words] on the device of each request's allowed tokens (every token for a
        request without a grammar, or whose grammar has not started), or None when no request has one started.
        The host buffer is reused: the previous fill's copy must be done (the loop reads a step with grammars back
        before it plans the next)."""
        rows = [k for k, r in enumerate(requests) if r.grammar is not None and r.grammar.started]
        if not rows:
            return None
        t0 = time.perf_counter()
        n = len(requests)
        host = self.host[:n]
        if len(rows) < n:
            held = set(rows)
            for k in range(n):
                if k not in held:
                    host[k].fill_(-1)
        self._batch.batch_fill_next_token_bitmask([requests[k].grammar.matcher for k in rows], self.host, rows)
        for k in rows:
            also = requests[k].grammar.also
            if also is not None:
                host[k] &= also
        self.fill_s += time.perf_counter() - t0
        self.filled += len(rows)
        if self.on_device is self.host:
            return host
        return self.on_device[:n].copy_(host, non_blocking=True)

    def fill_drafts(self, requests: list, K: int) -> torch.Tensor | None:
        """A verify step's bitmask [len(requests) * (K + 1), words] on the device: row b * (K + 1) + j holds what
        request b may sample after its drafts d_1 .. d_j (`r.drafts`), as its matcher would after they were taken
        in. Filled per position over the requests (one batch fill each), the matchers advanced draft by draft and
        rolled back after, so they end as they began (the loop's `_advance` takes the kept tokens in). A draft the
        grammar does not allow ends its request's rows: that draft, masked at the row before, cannot be kept, nor
        can any after it, so their rows allow every token, never read (so do a terminated matcher's, past a stop
        token, and rows past a request's drafts: acceptance reads none). A grammar that has not started starts
        after a draft equal to starts_after. None when no row is held."""
        n = len(requests) * (K + 1)
        host, on_device = self._draft_buffers(n)
        host.fill_(-1)
        t0 = time.perf_counter()
        walk = [_Walk(r.grammar) if r.grammar is not None else None for r in requests]
        filled = 0
        try:
            for j in range(K + 1):
                rows = [b for b, w in enumerate(walk) if w is not None and w.live and j <= len(requests[b].drafts)]
                if rows:
                    self._batch.batch_fill_next_token_bitmask([walk[b].grammar.matcher for b in rows], host,
                                                              [b * (K + 1) + j for b in rows])
                    for b in rows:
                        also = walk[b].grammar.also
                        if also is not None:
                            host[b * (K + 1) + j] &= also
                    filled += len(rows)
                for w, r in zip(walk, requests):
                    if w is not None and j < len(r.drafts):
                        w.take(r.drafts[j])
        finally:
            for w in walk:
                if w is not None and w.taken:
                    w.grammar.matcher.rollback(w.taken)
        self.fill_s += time.perf_counter() - t0
        self.filled += filled
        if not filled:
            return None
        if on_device is host:
            return host
        return on_device.copy_(host, non_blocking=True)

    def _draft_buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fill_drafts' buffers of n rows at least (grown as needed), apart from fill's: a speculative step fills
        both (its verify rows, then its plain rows)."""
        if self._drafts is None or self._drafts[0].shape[0] < n:
            words, cuda = self.host.shape[1], self.device.type == "cuda"
            host = torch.empty(n, words, dtype=torch.int32, pin_memory=cuda)
            self._drafts = host, (torch.empty(n, words, dtype=torch.int32, device=self.device) if cuda else host)
        host, on_device = self._drafts
        return host[:n], on_device[:n]


class _Walk:
    """A request's grammar walked along its drafts by fill_drafts: `live` while its next row is to be filled,
    `taken` the tokens its matcher accepted (rolled back after)."""

    def __init__(self, grammar: Grammar):
        self.grammar, self.started, self.taken = grammar, grammar.started, 0
        self.live = self.started and not grammar.matcher.is_terminated()

    def take(self, token: int) -> None:
        g = self.grammar
        if not self.started:  # (its rows so far allow every token, as the plain step's would)
            self.started = self.live = token == g.starts_after
            return
        if not self.live:
            return
        if not g.matcher.accept_token(token):
            self.live = False
            return
        self.taken += 1
        self.live = not g.matcher.is_terminated()

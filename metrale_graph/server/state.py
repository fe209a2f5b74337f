"""What every endpoint shares: the engine, the served name, readiness, and the checks of a request
that come before the engine's (model name, unsupported fields, tokenizing, the context length: a text
that cannot fit is refused before it is tokenized, limits.TokenBound).

The engine checks the rest when a request is submitted (token ids in range, sampling values, KV
blocks), raising ValueError, which errors.from_engine answers with 400.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..tokenizer import special_token_ids
from .errors import APIError, bad_request, short, unauthorized, unknown_model, warming_up
from .limits import TokenBound
from .logprobs import TokenStrings, token_id_string
from .metrics import ServerMetrics
from .nulls import sets_anything
from .protocol import SamplingFields, field_value
from .reasoning import THINK_END, starts_in_reasoning
from .reply import ReplyParsers
from .responses import ModelCard
from .responses_store import DEFAULT_SIZE as DEFAULT_STORE_SIZE, ResponseStore


# apply_chat_template's arguments that the server sets itself (chat_template_kwargs may not)
TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
                                "return_dict", "return_tensors", "tokenizer_kwargs", "chat_template", "tools"})


# the request fields that go to Engine.submit as sampling controls of the same name, when set
CONTROLS = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")


@dataclass(frozen=True)
class Sampling:
    """One engine request's arguments (Engine.submit's), the same for every choice but the seed."""
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop_token_ids: frozenset
    stop: tuple[str, ...]
    controls: dict = field(default_factory=dict)  # submit's sampling controls (logprobs, penalties, ...) set
    include_stop_str_in_output: bool = False
    structured: object = None  # the engine's StructuredOutput (server/structured.py), or None
    keep_special_ids: frozenset = frozenset()  # special tokens whose text the reply keeps (Engine.submit's)
    request_stop_ids: frozenset = frozenset()  # the request's own stop_token_ids (a stop_reason, vLLM's field)


def check_text(value, name: str, param: str) -> None:
    """400 naming `name` if `value` (a string, or lists / dicts of them) holds a character UTF-8 cannot
    encode: a lone UTF-16 surrogate, which JSON's \\ud800 escapes can carry (half of an emoji pair)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad_request(f"{name}: the text holds an invalid Unicode character {value[e.start]!r} at {e.start} "
                              "(a lone UTF-16 surrogate, half of a pair): send valid UTF-8 text", param=param) from None
    elif isinstance(value, dict):
        for v in value.values():
            check_text(v, name, param)
    elif isinstance(value, (list, tuple)):
        for v in value:
            check_text(v, name, param)


def template_error(e: Exception, messages: list[dict], render, param: str) -> APIError:
    """The 400 of a chat template that raised `e` on `messages` (`render`: the same rendering of other messages). A
    past call's arguments that are not JSON text of an object reach the template as the string sent (a model's own
    malformed call replayed: templates with a string branch, Qwen3's, write it as it is); when the template renders
    the messages once those are {} (Qwen3.5's iterates `arguments|items`), the 400 names the first of them."""
    failed = bad_request(f"the chat template failed on these messages: {type(e).__name__}: {e}", param=param)
    calls = [(i, j) for i, m in enumerate(messages) if isinstance(m.get("tool_calls"), list)
             for j, call in enumerate(m["tool_calls"]) if isinstance(call, dict)
             and isinstance(call.get("function"), dict) and isinstance(call["function"].get("arguments"), str)]
    if not calls:
        return failed
    mapped = list(messages)
    for i, j in calls:
        mapped[i] = {**mapped[i], "tool_calls": [{**c, "function": {**c["function"], "arguments": {}}} if k == j else c
                                                 for k, c in enumerate(mapped[i]["tool_calls"])]}
    try:
        render(mapped)
    except Exception:  # (not the arguments alone)
        return failed
    (i, j), call = calls[0], messages[calls[0][0]]["tool_calls"][calls[0][1]]
    where = f"messages[{i}].tool_calls[{j}].function.arguments" if param == "messages" else param
    what = where if param == "messages" else f"{param}: the arguments of the function call {call.get('id')!r}"
    return bad_request(f"{what}: {short(call['function']['arguments'])} is not JSON text of an object, and this "
                       f"model's chat template renders a past call's arguments only as one ({type(e).__name__}: {e})",
                       param=where)


def one_system_message(messages: list[dict]) -> list[dict]:
    """`messages` (as a template reads them: developer already system) with the system messages they begin with
    joined into one, their texts separated by a blank line: Qwen3.5's template takes one system message, the first,
    and raises on any other ("System message must be at the beginning"), yet the Responses API's instructions come
    before Codex's leading developer messages, and chat clients send a system prompt then a developer one."""
    lead = 0
    while lead < len(messages) and messages[lead].get("role") == "system":
        lead += 1
    if lead < 2:
        return messages
    joined = "\n\n".join(m.get("content") or "" for m in messages[:lead])
    return [{**messages[0], "content": joined}, *messages[lead:]]


class ServerState:
    """The engine behind an app and what its endpoints share. `model_names`: the served names (vLLM's --served-model-name
    a b: any taken in requests and listed, the first, `model_name`, in answers). `ready` is set once the engine is warm
    (the serve tool warms it while the server already answers /health with 503); `closing` once the server shuts down."""

    def __init__(self, engine, model_name: str | tuple[str, ...], api_key: str | None = None, ready: bool = True,
                 tool_call_parser: str = "auto", reasoning_parser: str = "auto",
                 responses_store_size: int = DEFAULT_STORE_SIZE):
        self.model_names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
        self.engine, self.model_name, self.api_key = engine, self.model_names[0], api_key
        self.responses = ResponseStore(responses_store_size)  # the Responses API's stored responses
        self.tokenizer = engine.tokenizer
        # how chat replies are read: reasoning and tool calls (reply.py; "auto": from the chat template)
        self.replies = ReplyParsers.of(getattr(self.tokenizer, "chat_template", None), tool_call_parser,
                                       reasoning_parser)
        self.token_strings = TokenStrings(self.tokenizer)  # logprobs' token strings, cached
        self.max_context = engine.max_context
        self.vocab_size = engine.model.config.vocab_size
        self.token_bound = TokenBound(self.tokenizer)
        # the end of a reasoning block as one token id, where a reply's grammar starts (server/structured.py)
        self.think_end = _think_end_token(self.tokenizer)
        # the special tokens that hold the reply parsers' tags: their text kept in the replies they read
        self.tag_ids = frozenset(i for i in special_token_ids(self.tokenizer)
                                 if any(tag in _added_text(self.tokenizer, i) for tag in self.replies.tags))
        self.metrics = ServerMetrics(engine, self.model_name)
        self.ready, self.closing = threading.Event(), threading.Event()
        if ready:
            self.ready.set()
        self.background: set[asyncio.Task] = set()  # tasks that record aborted requests once they end
        # tokenizing and chat templates off the event loop (a prompt of megabytes takes seconds, and every
        # stream would wait), one worker: a tokenizer is not asked to encode two texts at once
        self._tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrale-tokenize")

    async def off_loop(self, fn, *args):
        """fn(*args) in the tokenizing worker, awaited (its exceptions raised here)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize, functools.partial(fn, *args))

    def logprob_strings(self, body: SamplingFields):
        """The token strings of `body`'s logprobs: each token's text, or "token_id:N" with vLLM's
        return_tokens_as_token_ids."""
        return token_id_string if body.return_tokens_as_token_ids else self.token_strings

    def model_card(self, name: str | None = None) -> ModelCard:
        return ModelCard(id=name or self.model_name, max_model_len=self.max_context, vocab_size=self.vocab_size)

    def check_model(self, model: str | None) -> None:
        """404 unless `model` (a request's field; None: the served one) is one of the served model's names."""
        if model is not None and model not in self.model_names:
            raise unknown_model(model, self.model_names)

    def check(self, body: SamplingFields, ready: bool = True) -> None:
        """The checks every generation request passes before any tokenizing: the model it names, the
        server being ready (unless `ready` is False: a request that only tokenizes), no field this server cannot
        honour."""
        self.check_model(body.model)
        if ready and not self.ready.is_set():
            raise warming_up()
        name = body.unsupported()
        if name is not None:
            neutral = [v for v in body.neutral().get(name, (None,)) if v is not None]
            unset = "leave it unset" + (f" (or {' / '.join(map(json.dumps, neutral))})" if neutral else "")
            raise bad_request(f"{name} is not supported by this server (got {short(field_value(body, name))}): {unset}",
                              param=name, code="unsupported_parameter")
        conflict = body.conflict()
        if conflict is not None:
            raise bad_request(conflict[1], param=conflict[0])
        if sets_anything(body.stream_options) and not body.stream:  # ({} or nulls alone: nothing, as vLLM reads it)
            raise bad_request("stream_options is only allowed with stream: true", param="stream_options")

    def kept_tokens(self, body: SamplingFields) -> int | None:
        """How many of a prompt's last tokens vLLM's truncate_prompt_tokens keeps (-1: as many as leave room for one
        new token), or None: all of them. 400 naming it for 0 (no prompt) or more than the context."""
        keep = body.truncate_prompt_tokens
        if keep is not None and not (keep == -1 or 0 < keep <= self.max_context):
            raise bad_request(f"truncate_prompt_tokens must be -1 (as many as leave room for a new token) or a number "
                              f"of tokens in [1, {self.max_context}] (this model's context), got {keep}",
                              param="truncate_prompt_tokens")
        return self.max_context - 1 if keep == -1 else keep

    def prompt_ids(self, prompt, param: str, index: int | None = None, keep: int | None = None) -> list[int]:
        """Token ids of one prompt (a string through the tokenizer, as Engine.submit encodes it; `keep`: only its last
        `keep` tokens), checked against the context (a prompt must leave room for one new token) and, given as ids,
        the vocabulary."""
        name = param if index is None else f"{param} {index}"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise bad_request(f"{param}: this server's model has no tokenizer: send token ids", param=param)
            check_text(prompt, name, param)
            if keep is None:  # (truncated, a text of any length is cut after it is tokenized)
                self.check_fits(prompt, name, param)
            ids = list(self.tokenizer.encode(prompt))[-keep if keep else 0:]
        else:
            ids = list(prompt)[-keep if keep else 0:]
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise bad_request(f"{name}: token id {bad} is out of range [0, {self.vocab_size})", param=param)
        if not ids:
            raise bad_request(f"{name} holds no tokens", param=param)
        if len(ids) >= self.max_context:
            raise bad_request(f"this model's maximum context length is {self.max_context} tokens (prompt and new "
                              f"tokens); {name} has {len(ids)} tokens, which leaves no room for a new one",
                              param=param, code="context_length_exceeded")
        return ids

    def check_fits(self, text: str, name: str, param: str, room: int | None = None) -> None:
        """400 context_length_exceeded, before tokenizing, for a text that is certainly more tokens than a
        prompt may have (TokenBound: its normalized UTF-8 bytes pass room x bytes_per_token; room: max_context - 1
        unless given), instead of holding the tokenizing thread for it; a shorter one is tokenized and checked as
        every prompt is."""
        per_token = self.token_bound.bytes_per_token
        generating, room = room is None, self.max_context - 1 if room is None else room
        if per_token is None or len(text) * 4 <= room * per_token:  # (at most 4 UTF-8 bytes a character)
            return
        fewest = self.token_bound.fewest_tokens(text)
        if fewest > room:
            raise bad_request(f"this model's maximum context length is {self.max_context} tokens (prompt and new "
                              f"tokens); {name} is at least {fewest} tokens ({len(text)} characters, and no token "
                              f"of this tokenizer covers more than {per_token} bytes), "
                              + ("which leaves no room for a new one" if generating else f"more than the {room} "
                                 "this server tokenizes"), param=param,
                              code="context_length_exceeded")

    def check_room(self, prompts: list[list[int]], body: SamplingFields) -> None:
        """400 if the request's own max_tokens (or max_completion_tokens) does not fit in the context after
        one of its prompts, as vLLM and OpenAI answer; a limit the request did not set is capped instead."""
        limit = body.explicit_max_tokens()
        if limit is None:
            return
        field, max_tokens = limit
        for i, ids in enumerate(prompts):
            if len(ids) + max_tokens > self.max_context:
                where = f"prompt {i}" if len(prompts) > 1 else "the prompt"
                raise bad_request(f"{field} is too large: {max_tokens}. This model's maximum context length is "
                                  f"{self.max_context} tokens and {where} has {len(ids)} tokens, which leaves room "
                                  f"for {self.max_context - len(ids)} new "
                                  f"{'one' if self.max_context - len(ids) == 1 else 'ones'}", param=field,
                                  code="context_length_exceeded")

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict | None = None,
                    tools: list[dict] | None = None, param: str = "messages",
                    keep: int | None = None) -> tuple[str, list[int], bool]:
        """The chat template of the tokenizer applied to `messages`, as text and as token ids (add_generation_prompt:
        the assistant's turn starts; continue_final_message: the last message stays open, its end tokens left
        out; template_kwargs: the template's own variables; tools: the functions the template renders), the
        template's special tokens not added twice, and whether a reply begins inside a reasoning block
        (`reply_in_reasoning`). `param`: the request field the messages came from (400s name it); `keep`: only the
        prompt's last `keep` tokens (kept_tokens)."""
        text = self.chat_text(messages, add_generation_prompt, continue_final_message, template_kwargs, tools, param)
        if keep is None:
            self.check_fits(text, f"{param} (through the chat template)", param)
        ids = self.prompt_ids(list(self.tokenizer.encode(text, add_special_tokens=False)), param, keep=keep)
        return text, ids, self.reply_in_reasoning(text, messages, continue_final_message, template_kwargs, tools)

    def reply_in_reasoning(self, text: str, messages: list[dict], continue_final_message: bool = False,
                           template_kwargs: dict | None = None, tools: list[dict] | None = None) -> bool:
        """Whether a reply to the rendered `text` begins inside a reasoning block, under a reasoning parser: the
        part of the prompt written for the reply's turn (the generation prompt, or the message continued) leaves a
        `<think>` open. A tag in the text of an earlier message (a user asking about `<think>`, a tool's result
        quoting it) opens nothing; that part is `text` past the conversation rendered without it (the whole of
        `text` is read when the template does not render it as a prefix)."""
        if not self.replies.reasoning or not starts_in_reasoning(text):
            return False  # (the part's `<think>` would be open in the whole text too)
        before = messages[:-1] if continue_final_message else messages
        try:
            rendered = self.chat_text(before, False, False, template_kwargs, tools)
        except APIError:
            return True
        return starts_in_reasoning(text[len(rendered):]) if text.startswith(rendered) else True

    def chat_text(self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
                  template_kwargs: dict | None = None, tools: list[dict] | None = None, param: str = "messages") -> str:
        """chat_prompt's text, not tokenized."""
        tok = self.tokenizer
        if tok is None or not callable(getattr(tok, "apply_chat_template", None)):
            raise bad_request("this server's model has no tokenizer with a chat template: use /v1/completions",
                              param=param)
        if not getattr(tok, "chat_template", None):
            raise bad_request("this model's tokenizer has no chat template: use /v1/completions", param=param)
        if add_generation_prompt and continue_final_message:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true (the last "
                              "message either goes on or the assistant's turn starts)", param="continue_final_message")
        template_kwargs = dict(template_kwargs or {})
        taken = sorted(set(template_kwargs) & TEMPLATE_ARGUMENTS)
        if taken:
            raise bad_request(f"chat_template_kwargs: {', '.join(taken)} is set by the server, not by the request "
                              "(chat completions takes add_generation_prompt and continue_final_message as fields)",
                              param="chat_template_kwargs")
        for i, message in enumerate(messages):  # every string the template may read: UTF-8 encodable
            for key, value in message.items():
                check_text(value, f"{param} {i}: {key}", param)
        if continue_final_message:  # (only then: a tokenizer of its own may not take the argument)
            template_kwargs["continue_final_message"] = True
        if tools:  # (likewise)
            check_text(tools, "tools", "tools")
            template_kwargs["tools"] = tools
        def render(messages: list[dict]) -> str:
            return tok.apply_chat_template(one_system_message(messages), tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **template_kwargs)
        try:
            return render(messages)
        except Exception as e:  # the template raised (a role it does not take, ...)
            raise template_error(e, messages, render, param) from e

    def sampling(self, body: SamplingFields, max_new_tokens: int | None, logprobs: int | None = None,
                 prompt_logprobs: int | None = None, structured=None, parsed: bool = False) -> Sampling:
        """The engine arguments of `body`: stop token ids are the request's added to the model's eos
        (only the request's with ignore_eos); max_new_tokens None runs up to the context; logprobs /
        prompt_logprobs: the top N the endpoint wants per new / prompt token (None: none); structured: the
        StructuredOutput the endpoint made of it (server/structured.py); parsed: the reply parsers read the text
        (the special tokens of their tags keep their text). vLLM's skip_special_tokens false keeps every special
        token's text (a stop token that ends the reply adds none, as in vLLM)."""
        stops = frozenset(body.stop_token_ids or ())
        bad = sorted(t for t in stops if t >= self.vocab_size)
        if bad:
            raise bad_request(f"stop_token_ids: {bad[0]} is not a token id of this model (expected ids in [0, "
                              f"{self.vocab_size}))", param="stop_token_ids")
        if not body.ignore_eos:
            stops |= self.engine.stop_token_ids
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        check_text(list(stop), "stop", "stop")
        if any(not s for s in stop):
            raise bad_request("stop: stop strings must be non-empty (an empty one would stop before any text)",
                              param="stop")
        if stop and self.tokenizer is None:
            raise bad_request("stop strings need a tokenizer and this server's model has none: use stop_token_ids",
                              param="stop")
        most = self.token_bound.most_characters(self.max_context - 1)
        longest = max(map(len, stop), default=0)
        if most is not None and longest > most:  # (and the detokenizer would hold back that much text per request)
            raise bad_request(f"stop: a stop string of {longest} characters can never match: this model generates at "
                              f"most {self.max_context - 1} tokens, which decode to at most {most} characters",
                              param="stop")
        max_new_tokens = max_new_tokens if max_new_tokens is not None else self.max_context
        if (body.min_tokens or 0) > max_new_tokens:  # (the engine's check, in the API's words: no max_new_tokens)
            limit = body.explicit_max_tokens()
            raise bad_request(f"min_tokens ({body.min_tokens}) must be at most " + (
                f"{limit[0]} ({limit[1]})" if limit is not None
                else f"{max_new_tokens}, the most new tokens of a request that sets no limit"), param="min_tokens")
        controls = {name: getattr(body, name) for name in CONTROLS if getattr(body, name) is not None}
        if body.logit_bias:
            controls["logit_bias"] = _token_keys(body.logit_bias)
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None:
                controls[name] = value
        keep = (special_token_ids(self.tokenizer) if body.skip_special_tokens is False else frozenset()) | (
            self.tag_ids if parsed else frozenset())
        return Sampling(max_new_tokens, body.temperature, max(body.top_k, 0), body.top_p, body.seed, stops, stop,
                        controls, bool(body.include_stop_str_in_output), structured, keep,
                        frozenset(body.stop_token_ids or ()))

    def check_api_key(self, authorization: str | None) -> None:
        """401 unless `authorization` (the request's header) is 'Bearer <the key>' (no key: all pass)."""
        if self.api_key is None:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise unauthorized()


def _think_end_token(tokenizer) -> int | None:
    """The id of the one token that ends a reasoning block: the added token whose text holds `</think>` (Qwen's
    `</think>`; some templates' `</think>\n\n`), or None when the tokenizer has none or several."""
    added = getattr(tokenizer, "get_added_vocab", None)
    ids = [i for text, i in (added() if callable(added) else {}).items() if THINK_END in text]
    return ids[0] if len(ids) == 1 else None


def _added_text(tokenizer, token_id: int) -> str:
    """The text of an added token (transformers' added_tokens_decoder), or "" for another token."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    token = added.get(token_id) if isinstance(added, dict) else None
    return str(getattr(token, "content", "")) if token is not None else ""


def _token_keys(logit_bias: dict[str, float]) -> dict[int, float]:
    """logit_bias with its JSON object keys as token ids (the engine checks them against the vocabulary); 400
    naming logit_bias for a key that is not a number."""
    out = {}
    for key, bias in logit_bias.items():
        if not (key.isascii() and key.isdigit()):
            raise bad_request(f"logit_bias: {key!r} is not a token id (its keys are token ids, as strings of digits)",
                              param="logit_bias")
        out[int(key)] = bias
    return out

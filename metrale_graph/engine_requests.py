"""Request intake: generate / stream / submit's arguments checked and made into the scheduler's Requests.

Every check runs before anything is queued, so a bad request is a ValueError naming it and leaves the engine as
it was: prompts (token id lists, 1-D int tensors or numpy arrays, strings through the tokenizer), their length
against max_context and the KV blocks, max_new_tokens, the sampling parameters and controls (sampling.py), the
seed, stop token ids, the structured output's spec and grammar (compiled in the engine's grammar worker, waited
for here, never in the engine loop), and the model's version. Only then does a call agree on a seed (under tensor
parallelism rank 0 draws it for every rank) and give each request its id, generator and streamed text.

`RequestIntake` is Engine's base class: its state is Engine's (model, cache, tokenizer, stop_token_ids,
max_context, `_loop`, `_broadcast`, `_ids`, `_grammars`, `_decode_kwargs`).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Sequence

import torch

from .batch import check_token_ids, token_tensor
from .detokenizer import StreamingText
from .handle import EngineClosedError
from .numbers import is_int, is_numpy_array, numpy_ids, plain_int
from .sampling import check_params, check_seed, new_generator
from .scheduler import Request
from .grammar import Grammars
from .structured import StructuredOutputError, structured_output
from .tokenizer import special_token_ids

# submit / generate / stream's keyword arguments that go to sampling.check_params
SAMPLING_CONTROLS = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                     "logprobs", "prompt_logprobs")


class RequestIntake:
    """Engine's checks of its calls' arguments and the Requests it makes of them (the module docstring)."""

    def _requests(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids,
                  stop: tuple[str, ...] = (), text: bool = False, controls: dict | None = None,
                  include_stop: bool = False, structured=None, keep_special=()) -> list[Request]:
        """Requests from generate's arguments (`controls`: the sampling controls, check_params' keywords);
        ValueError naming the first bad one."""
        self._check_not_follower("generate / stream / submit")
        controls = dict(controls or {})
        speculate = controls.pop("speculate", True)  # (a request's opt-out of Engine(speculative=...))
        if not isinstance(speculate, bool):
            raise ValueError(f"speculate must be True or False, got {speculate!r}")
        if self.model.version != self._loop._model_version:
            raise ValueError("the model was converted or moved (model.to / .half / ...) after this Engine was built: "
                             "its cache and compiled step hold the old dtype and device: build a new Engine")
        if isinstance(prompts, (str, bytes, torch.Tensor)) or is_numpy_array(prompts) or not isinstance(prompts, Sequence):
            raise ValueError("prompts must be a list of prompts (each a list of token ids, a 1-D int tensor or array, "
                             f"or a string with a tokenizer), got {type(prompts).__name__}")
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        params = self._check_controls(temperature, top_k, top_p, max_new_tokens, controls)
        seed = check_seed(seed)
        stops = self.stop_token_ids if stop_token_ids is None else self._check_stop_ids(stop_token_ids)
        spec = structured_output(structured, self.model.config.vocab_size)
        decoding, drop = self._decoding(keep_special)
        ids_of = [self._prompt_ids(i, prompt) for i, prompt in enumerate(prompts)]
        check_token_ids(ids_of, self.model.config.vocab_size, what="prompt")
        requests = []
        for i, ids in enumerate(ids_of):
            ids = ids.tolist()
            if len(ids) >= self.max_context:
                raise ValueError(f"prompt {i} has {len(ids)} tokens; max_context is {self.max_context} and a "
                                 f"prompt must leave room for at least one new token (at most {self.max_context - 1})")
            max_new = min(int(max_new_tokens), self.max_context - len(ids))
            r = Request(i, ids, max_new, params, None, stop_ids=stops, speculate=speculate,
                        logprobs=[] if params.logprobs is not None else None,
                        prompt_logprobs=[] if params.prompt_logprobs is not None else None)
            need = -(-r.kv_tokens // self.cache.block_size)
            if need > self.cache.num_blocks:
                raise ValueError(f"prompt {i}: {len(ids)} tokens + {max_new} new need {need} KV blocks; the "
                                 f"cache has {self.cache.num_blocks} (raise num_blocks or lower max_new_tokens)")
            requests.append(r)
        if spec is not None:  # the last check: the grammar compiles (waited for here, never in the engine loop)
            compiled = self._grammar_compiler().compile(spec).result()
            for r in requests:
                r.grammar = self._grammars.matcher(compiled, spec, stops)
        # every check passed (on every rank alike): only now agree on a seed
        if not params.greedy and seed is None and self.model.tp is not None and self._broadcast is None:
            seed = self._shared_seed()
        for r in requests:
            r.request_id = next(self._ids)
            if not params.greedy:
                r.generator = new_generator(None if seed is None else seed + r.index)
            if text:
                r.text = StreamingText(self.tokenizer, r.prompt, decoding, stop, include_stop, params.min_tokens,
                                       frozenset(stops), drop)
        return requests

    def _decoding(self, keep_special) -> tuple[dict, frozenset]:
        """(decode kwargs, token ids dropped before decoding) of a request that keeps the text of the special tokens
        `keep_special` (token ids): skip_special_tokens=False and every other special token dropped; ValueError for
        an id that is not an int in the vocabulary."""
        if getattr(keep_special, "ndim", None) == 1 and hasattr(keep_special, "tolist"):  # a numpy array, a tensor
            keep_special = keep_special.tolist()
        if isinstance(keep_special, (str, bytes)) or not isinstance(keep_special, (Sequence, set, frozenset)):
            raise ValueError(f"keep_special_ids must be a list of token ids, got {type(keep_special).__name__}")
        try:
            keep = frozenset(plain_int(t) for t in keep_special)
        except TypeError:  # an unhashable entry (a list)
            raise ValueError(f"keep_special_ids must be a list of token ids, got {keep_special!r}") from None
        bad = [t for t in keep if not is_int(t) or not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise ValueError(f"keep_special_ids: {bad[0]!r} is not a token id of this model (expected ints in [0, "
                             f"{self.model.config.vocab_size}))")
        if not keep or "skip_special_tokens" not in self._decode_kwargs:  # (a decode that skips nothing keeps all)
            return self._decode_kwargs, frozenset()
        return {**self._decode_kwargs, "skip_special_tokens": False}, special_token_ids(self.tokenizer) - keep

    def _check_controls(self, temperature, top_k, top_p, max_new_tokens: int, controls: dict):
        """The SamplingParams of a call (sampling.check_params), min_tokens within max_new_tokens; ValueError
        naming an unknown or bad control."""
        unknown = sorted(set(controls) - set(SAMPLING_CONTROLS))
        if unknown:
            raise ValueError(f"{unknown[0]} is not a sampling control (expected one of {', '.join(SAMPLING_CONTROLS)})")
        params = check_params(temperature, top_k, top_p, vocab_size=self.model.config.vocab_size, **controls)
        if params.min_tokens > max_new_tokens:
            raise ValueError(f"min_tokens ({params.min_tokens}) must be at most max_new_tokens ({max_new_tokens})")
        return params

    def _check_not_follower(self, what: str) -> None:
        if self._broadcast is not None and not self._broadcast.leader:
            raise ValueError(f"{what} on tensor-parallel rank {self._broadcast.tp.rank}: with broadcast_plans only "
                             "rank 0 takes requests; the other ranks run engine.follow()")

    def _shared_seed(self) -> int:
        """A seed drawn from the OS on rank 0 of the model's tensor-parallel group and given to every
        rank: the ranks sample from the same logits, so with the same generators they draw the same
        tokens and keep feeding the same batches (independent seeds let them diverge, and with stop
        tokens their schedules, and so their collectives, part ways)."""
        tp = self.model.tp
        mine = int(torch.randint(0, 2**62, (1,), generator=new_generator(None))) if tp.rank == 0 else 0
        return int(tp.all_reduce(torch.tensor([mine], dtype=torch.int64, device=self.model.device))[0])

    def _prompt_ids(self, i: int, prompt) -> torch.Tensor:
        """Prompt i's token ids (text through the tokenizer), type-checked as a batch's streams are."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {i} is a string but the engine has no tokenizer: pass token ids, or "
                                 "Engine(model, tokenizer=folder_or_object)")
            try:  # (a tokenizers' fast tokenizer raises a TypeError naming none of it)
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"prompt {i}: the text holds {prompt[e.start]!r} at {e.start}, a lone UTF-16 surrogate "
                                 "(half of a pair) that UTF-8 cannot encode: pass valid text") from None
            prompt = list(self.tokenizer.encode(prompt))
        elif is_numpy_array(prompt):
            prompt = numpy_ids(prompt, f"prompt {i}")
        elif prompt is None or isinstance(prompt, bytes) or not isinstance(prompt, (Sequence, torch.Tensor)):
            raise ValueError(f"prompt {i}: expected a list of token ids, a 1-D int tensor or array, or a string, "
                             f"got {type(prompt).__name__}")
        if not isinstance(prompt, torch.Tensor) and not (type(prompt) is list and set(map(type, prompt)) == {int}):
            prompt = [plain_int(x) for x in prompt]
        return token_tensor(prompt, f"prompt {i}", self.model.device)

    def _check_stop_ids(self, stop_token_ids) -> frozenset:
        if is_numpy_array(stop_token_ids):
            stop_token_ids = numpy_ids(stop_token_ids, "stop_token_ids")
        if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, (Sequence, set, frozenset)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {type(stop_token_ids).__name__}")
        vocab = self.model.config.vocab_size
        for t in stop_token_ids:
            if not is_int(t):
                raise ValueError(f"stop token {t!r} must be an int, got {type(t).__name__}")
            if not 0 <= t < vocab:
                raise ValueError(f"stop token {t!r} is not a token id in [0, {vocab})")
        return frozenset(int(t) for t in stop_token_ids)

    def compile_grammar(self, structured) -> Future:
        """Compile `structured`'s grammar (a dict as submit takes it, or a StructuredOutput) in the engine's grammar
        worker, or find it compiled: a Future whose exception is a StructuredOutputError when it does not compile.
        A request with the same grammar then finds it done (a server awaits this off its event loop before it
        submits). StructuredOutputError now for a bad spec."""
        spec = structured_output(structured, self.model.config.vocab_size)
        if spec is None:
            raise StructuredOutputError("expected a structured output, got None")
        return self._grammar_compiler().compile(spec)

    def _grammar_compiler(self) -> Grammars:
        if self.tokenizer is None:
            raise StructuredOutputError("structured output needs a tokenizer (Engine(model, tokenizer=...)): the "
                                        "grammar is over its vocabulary")
        if self._loop.closed:  # (its grammar worker is shut down too)
            raise EngineClosedError("the engine was shut down: build a new Engine")
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.model.config.vocab_size)
            return self._grammars

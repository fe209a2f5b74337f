"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize and GET /tokenizer_info, with vLLM's request and
response shapes.

    POST /tokenize    {"model", "prompt", "add_special_tokens": true, "return_token_strs": false}
                  or  {"model", "messages", "tools", "add_generation_prompt": true, "continue_final_message": false,
                       "chat_template_kwargs", "add_special_tokens": false, "return_token_strs": false}
                  ->  {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"model", "tokens"} -> {"prompt"}
    GET /tokenizer_info -> the tokenizer's configuration (tokenizer_config.json's keys), with --enable-tokenizer-info-endpoint

A prompt is encoded as /v1/completions encodes it; messages are rendered as /v1/chat/completions renders them
(ServerState.chat_text: the same checks, the tools through the template), then encoded. A text of more tokens than
the context holds is a 400 context_length_exceeded (vLLM's limit: max_model_len), refused before it is tokenized when
it must be (limits.TokenBound). token_strs are the tokenizer's own token strings (convert_ids_to_tokens: a
byte-level BPE's `Ġ` for a space). /detokenize decodes with the special tokens' text kept; an id the tokenizer
does not have is a 400 naming `tokens`. Tokenizing runs in the tokenizing worker, off the event loop; the model
need not be warm.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from .errors import bad_request
from .nulls import NullIsDefault
from .protocol import ChatMessage
from .tool_protocol import AnyTool
from .state import ServerState, check_text
from .tool_choice import rendered


class TokenizePromptRequest(NullIsDefault):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True  # the tokenizer's own (a BOS), as /v1/completions encodes a prompt
    return_token_strs: StrictBool | None = False


class TokenizeChatRequest(NullIsDefault):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[AnyTool] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: StrictBool = False  # the template holds them: none added (as chat prompts are encoded)
    return_token_strs: StrictBool | None = False


class DetokenizeRequest(NullIsDefault):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize_request(body: dict) -> TokenizePromptRequest | TokenizeChatRequest:
    """The request a /tokenize body is: messages (a chat's) or a prompt; a validation error names its field."""
    kind = TokenizeChatRequest if "messages" in body else TokenizePromptRequest
    try:
        return kind.model_validate(body)
    except ValidationError as e:  # (answered as FastAPI's own: 400 naming the field)
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


async def create_tokenize(state: ServerState, body: dict) -> TokenizeResponse:
    request = tokenize_request(body)
    state.check_model(request.model)
    if state.tokenizer is None:
        raise bad_request("this server's model has no tokenizer", param="prompt")
    ids = await state.off_loop(_tokens, state, request)
    strs = [str(s) for s in state.tokenizer.convert_ids_to_tokens(ids)] if request.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.max_context, tokens=ids, token_strs=strs)


def _tokens(state: ServerState, request: TokenizePromptRequest | TokenizeChatRequest) -> list[int]:
    """The token ids of a request's prompt or messages (in the tokenizing worker)."""
    if isinstance(request, TokenizeChatRequest):
        param = "messages"
        text = state.chat_text([m.template_dict() for m in request.messages], request.add_generation_prompt,
                               request.continue_final_message, request.chat_template_kwargs,
                               rendered(request.tools) if request.tools else None)
    else:
        param, text = "prompt", request.prompt
        check_text(text, param, param)
    state.check_fits(text, param, param, room=state.max_context)
    ids = list(state.tokenizer.encode(text, add_special_tokens=request.add_special_tokens))
    if len(ids) > state.max_context:
        raise bad_request(f"this model's maximum context length is {state.max_context} tokens; {param} has "
                          f"{len(ids)}", param=param, code="context_length_exceeded")
    return ids


async def create_detokenize(state: ServerState, body: DetokenizeRequest) -> DetokenizeResponse:
    state.check_model(body.model)
    tok = state.tokenizer
    if tok is None:
        raise bad_request("this server's model has no tokenizer", param="tokens")
    known = len(tok)
    bad = next((t for t in body.tokens if t >= known), None)
    if bad is not None:
        raise bad_request(f"tokens: {bad} is not a token id of this tokenizer (expected ids in [0, {known}))",
                          param="tokens")
    return DetokenizeResponse(prompt=await state.off_loop(tok.decode, body.tokens))


# init_kwargs that are files or folders of the server's disk, not the tokenizer's configuration
_PATHS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


def tokenizer_info(state: ServerState) -> dict:
    """vLLM's /tokenizer_info: the tokenizer's init_kwargs (tokenizer_config.json as loaded) without the server's
    paths, added tokens as their text, `tokenizer_class`, and the chat template the server renders with."""
    tok = state.tokenizer
    if tok is None:
        raise bad_request("this server's model has no tokenizer")
    config = {k: _json(v) for k, v in (getattr(tok, "init_kwargs", None) or {}).items() if k not in _PATHS}
    config["tokenizer_class"] = type(tok).__name__
    template = getattr(tok, "chat_template", None)
    if template:
        config["chat_template"] = template
    return config


def _json(value):
    """`value` as JSON can hold it: an added token as its text, mappings' keys as strings, anything else unknown as
    its str()."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)

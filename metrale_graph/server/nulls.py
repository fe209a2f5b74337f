"""JSON null as "unset" in a request: `NullIsDefault`, the base of the request models (protocol.py,
tool_protocol.py, responses_api_protocol.py, responses_api_items.py, tokenization.py).

Clients that write every field they know (LiteLLM, LangChain, generated SDKs, hand-written httpx code) send null for
those left unset: `"n": null`, `"stream_options": {"include_usage": null}`, `"ignore_eos": null`. OpenAI's API marks
its optional fields nullable and vLLM declares them Optional, so an optional field sent as null takes its default, as
though left out. Only a field whose type refuses null is touched (`n`, `stream`, `ignore_eos`, ...): where null is a
value of the field's own (`max_tokens: null`, no limit but the context's; `tool_choice: null`), it stays. A required
field (`messages`, `prompt`, `input`, a tool's `name`) has no default: null there is still a 400 naming it.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, model_validator


def takes_null(annotation) -> bool:
    """Whether a field of this type takes null as a value of its own (Optional, Any, a Literal holding None)."""
    if annotation is Any or annotation is None or annotation is type(None):
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(takes_null(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return takes_null(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return None in typing.get_args(annotation)
    return False


class NullIsDefault(BaseModel):
    """A request model whose optional fields sent as null take their defaults: the keys (names and aliases) of the
    fields that have a default and whose type refuses null are dropped from the body when null, before validation."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        if isinstance(data, dict):
            unset = _null_is_default(cls)
            if any(data.get(key, 0) is None for key in unset):
                return {k: v for k, v in data.items() if not (v is None and k in unset)}
        return data


_KEYS: dict[type, frozenset] = {}


def _null_is_default(model: type[BaseModel]) -> frozenset:
    """The keys of `model`'s optional fields whose type refuses null (computed once per model)."""
    keys = _KEYS.get(model)
    if keys is None:
        keys = _KEYS[model] = frozenset(key for name, f in model.model_fields.items()
                                        if not f.is_required() and not takes_null(f.annotation)
                                        for key in (name, f.alias) if key is not None)
    return keys


def sets_anything(options) -> bool:
    """Whether an options object (stream_options: a model, or a mapping) sets a field to something other than null:
    {} and {"include_usage": null} set nothing, as vLLM reads them (its check is the object's truth)."""
    if isinstance(options, BaseModel):
        return bool(options.model_fields_set)
    if isinstance(options, dict):
        return any(v is not None for v in options.values())
    return options is not None

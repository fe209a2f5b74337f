"""A tool call's parameter value as the JSON type its schema asks for (tool_parsers.py's XML calls write each
value as text): `typed_value(text, schema, root)`, and `schema_types` (the JSON types a schema allows, through
anyOf / oneOf / allOf, in-document $refs, enum, properties and items).
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, Mapping

INTEGER = re.compile(r"[+-]?\d+")


def schema_types(schema, root=None, _seen=()) -> set[str]:
    """The JSON types a schema allows: its "type" (one or a list), its anyOf / oneOf members', allOf's in common,
    what a "$ref" within the document `root` (the function's parameters: "#/$defs/Place", pydantic's nested models
    and enums) points at, else what its "enum", "properties" or "items" imply; empty when it says nothing."""
    if not isinstance(schema, Mapping):
        return set()
    kind = schema.get("type")
    types = {kind} if isinstance(kind, str) else {t for t in kind if isinstance(t, str)} if isinstance(kind, list) \
        else set()
    ref = schema.get("$ref")
    if not types and isinstance(ref, str) and ref.startswith("#") and ref not in _seen:
        types = schema_types(_pointed(root, ref), root, (*_seen, ref))
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or ():
            types |= schema_types(member, root, _seen)
    if not types and isinstance(schema.get("allOf"), list):
        each = [t for t in (schema_types(member, root, _seen) for member in schema["allOf"]) if t]
        types = set.intersection(*each) if each else set()
    if not types and isinstance(schema.get("enum"), list):
        types = {_json_type(v) for v in schema["enum"]}
    if not types and "properties" in schema:
        types = {"object"}
    if not types and "items" in schema:
        types = {"array"}
    return types


def _pointed(root, ref: str):
    """What the JSON pointer of an in-document reference ("#", "#/$defs/Place") points at in `root`, or None."""
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "string")


def typed_value(text: str, schema, root=None) -> Any:
    """`text`, a parameter's value as the model wrote it, as the JSON value its schema asks for: an integer,
    number, boolean or null when it reads as one, an object or array through JSON (or a Python literal, which
    models sometimes write); a string, or a value that reads as none of its types, as written (so a schema
    that allows a string keeps the text), without the whitespace around it where the schema fixes the string
    (`_fixed_string`: an enum's, a pattern's, ...). `root`: the document its references point into (the parameters)."""
    types = schema_types(schema, root)
    stripped = text.strip()
    if "null" in types and stripped in ("null", "None") and not _free_string(schema, root):
        return None  # (a string allowed beside null would keep the text: it may be the word)
    if not types or "string" in types:
        return stripped if stripped != text and _fixed_string(schema, root, stripped) else text
    for kind in ("integer", "number", "boolean", "object", "array"):
        if kind in types:
            value = _convert(kind, stripped)
            if value is not _NO_VALUE:
                return value
    return text


_NO_VALUE = object()
_FIXED = ("enum", "const", "pattern", "format")  # a string whose schema says what it is, not any text


def _fixed_string(schema, root, stripped: str, _depth: int = 0) -> bool:
    """Whether a string value of `schema` (through in-document $refs and anyOf / oneOf members) is one the schema
    fixes (an enum's, a const's, a pattern's or a format's) rather than free text: a strict call's grammar (xgrammar's
    qwen_xml) lets whitespace frame such a value, which is not part of it; an enum or const whose own value keeps it
    is kept."""
    ref = schema.get("$ref") if isinstance(schema, Mapping) else None
    if isinstance(ref, str) and ref.startswith("#") and _depth < 8:
        schema = _pointed(root, ref)
    if not isinstance(schema, Mapping):
        return False
    if any(_fixed_string(member, root, stripped, _depth + 1) for key in ("anyOf", "oneOf")
           for member in (schema.get(key) if isinstance(schema.get(key), list) else ())):
        return True
    if not any(k in schema for k in _FIXED):
        return False
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else None
    return values is None or stripped in values


def _free_string(schema, root, _depth: int = 0) -> bool:
    """Whether `schema` (through in-document $refs and anyOf / oneOf members) allows any text as a string: a string
    type without an enum, const, pattern or format."""
    ref = schema.get("$ref") if isinstance(schema, Mapping) else None
    if isinstance(ref, str) and ref.startswith("#") and _depth < 8:
        schema = _pointed(root, ref)
    if not isinstance(schema, Mapping):
        return False
    kind = schema.get("type")
    if (kind == "string" or (isinstance(kind, list) and "string" in kind)) and not any(k in schema for k in _FIXED):
        return True
    return any(_free_string(member, root, _depth + 1) for key in ("anyOf", "oneOf")
               for member in (schema.get(key) if isinstance(schema.get(key), list) else ()))


def _convert(kind: str, text: str):
    if kind == "integer":
        return int(text) if INTEGER.fullmatch(text) else _NO_VALUE
    if kind == "number":
        try:
            value = json.loads(text)
        except ValueError:
            return _NO_VALUE
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return value if number else _NO_VALUE  # (json reads NaN and Infinity, which no JSON text holds)
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _NO_VALUE)
    want = dict if kind == "object" else list
    try:
        value = json.loads(text)
    except ValueError:
        try:
            value = ast.literal_eval(text)
            json.dumps(value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return _NO_VALUE
    return value if isinstance(value, want) else _NO_VALUE

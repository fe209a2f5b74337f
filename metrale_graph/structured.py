"""Structured output: what a request's output must follow, as a user gives it, checked before anything is queued.

    spec = structured_output({"json": schema})     # or {"json_object": True}, {"regex": r"..."},
                                                   # {"choice": ["yes", "no"]}, {"grammar": EBNF}
    engine.submit(prompt, structured=spec)         # (or the dict itself): grammar.py holds the output to it

The kinds are vLLM's (`StructuredOutputsParams`): `json` a JSON schema (a dict, or its JSON text), `json_object`
any JSON object, `regex` a regular expression the whole output matches, `choice` one of these strings exactly,
`grammar` a context-free grammar in xgrammar's EBNF (GBNF-like: `root ::= "yes" | "no"`) or in Lark's (`start: "yes" |
"no"`, told apart as vLLM does: no rule defined with `::=`), `structural_tag` an
xgrammar structural tag (a dict, or its JSON text: free text with tagged parts, a model's tool calls held to their
functions' schemas; the server's strict tools, server/tool_choice.py). `starts_after`
(optional, a token id) delays the grammar until the request has sampled that token: a reasoning model's end of
thinking (`</think>`), so the reasoning before it is free and the answer after it is held (vLLM holds structured
output after the reasoning parser's end too).

A JSON schema is checked here for what grammar.py cannot enforce, so that an output that follows the grammar
also validates against the schema: a keyword of UNENFORCED (`uniqueItems: true`, `contains`, `not`, `if`, ...)
anywhere in it is refused by name and path, and so are the keywords xgrammar drops in some places only
(`check_conditions`: it logs a warning and writes the schema without them): `multipleOf` but on an integer, by a
whole number up to 1024, with both of its bounds or neither; `minLength` / `maxLength` beside a `pattern` or one
of xgrammar's FORMATS; a pattern's lookahead; a `required` property that `properties` does not define (never
written); a constraint of one JSON type on a schema that gives no type (any value is written); a `$ref` out of
the document. `oneOf` is held as `anyOf` (each branch enforced, exclusivity not:
pydantic's tagged unions, whose branches exclude each other, validate). xgrammar adds one thing of its own: an
object with `properties` takes no other properties unless its schema says `additionalProperties` (stricter than
JSON Schema's default, so what it produces still validates).

Every error is a StructuredOutputError (a ValueError) whose message starts with "structured: " and whose
`detail` says what is wrong without that prefix (the server puts its own field name there instead).
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from typing import Mapping

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")

# JSON Schema keywords grammar.py (xgrammar) does not enforce: a schema using one is refused. (allOf with more
# than one branch too: UNENFORCED_ALL_OF.)
UNENFORCED = {
    "uniqueItems": lambda v: v is True, "contains": None, "minContains": None, "maxContains": None, "not": None,
    "if": None, "then": None, "else": None, "dependentRequired": None, "dependentSchemas": None,
    "dependencies": None, "unevaluatedProperties": None, "unevaluatedItems": None,
    "$dynamicRef": None, "$recursiveRef": None,  # (xgrammar writes any value for them, silently)
}
# the string formats xgrammar writes by a grammar of their own, which drops the string's minLength / maxLength; the
# least length of a string of each (a minLength up to it holds: pydantic's AnyUrl is a uri of minLength 1)
FORMATS = {"email": 1, "date": 1, "time": 1, "date-time": 1, "duration": 1, "ipv4": 1, "ipv6": 1, "hostname": 1,
           "uuid": 1, "uri": 1, "uri-reference": 0, "uri-template": 0, "json-pointer": 0, "relative-json-pointer": 1}
# keywords that constrain a value of one JSON type: a schema with one and no type lets xgrammar write any value
_TYPED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern",
          "format", "minItems", "maxItems", "minProperties", "maxProperties", "required", "propertyNames",
          "patternProperties")
_SAYS_WHAT = ("enum", "const", "$ref", "anyOf", "oneOf", "allOf")  # what a schema without a type can be instead
# keywords whose value is a schema, a list of schemas, or a mapping of names to schemas (walked for the above)
_SCHEMA = ("additionalProperties", "items", "additionalItems", "propertyNames", "not", "if", "then", "else",
           "contains", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class StructuredOutputError(ValueError):
    """A structured-output request that cannot be served; `detail`: what is wrong."""

    def __init__(self, detail: str):
        super().__init__(f"structured: {detail}")
        self.detail = detail


@dataclass(frozen=True)
class StructuredOutput:
    """A checked structured-output request. `source`: json: the schema's JSON text (its key order kept: an object's
    properties are written in it); json_object: ""; regex: the expression; choice: the choices' JSON list;
    grammar: the EBNF text; structural_tag: the tag's JSON text. `starts_after`: the token after which the grammar
    holds (None: from the first)."""
    kind: str
    source: str
    starts_after: int | None = None

    @property
    def key(self) -> tuple[str, str]:
        """What a compiled grammar is cached by (starts_after is the request's, not the grammar's)."""
        return self.kind, self.source


def structured_output(value, vocab_size: int | None = None) -> StructuredOutput | None:
    """`value` checked: None, a StructuredOutput, or a mapping with exactly one of KINDS (and optionally
    starts_after, a token id below `vocab_size` when given). StructuredOutputError naming what is wrong."""
    if value is None:
        return None
    if isinstance(value, StructuredOutput):
        value = {value.kind: _value_of(value), "starts_after": value.starts_after}
    if not isinstance(value, Mapping):
        raise StructuredOutputError(f"expected a mapping with one of {', '.join(KINDS)} (e.g. {{'json': schema}}), "
                                    f"got {type(value).__name__}")
    unknown = sorted(set(value) - set(KINDS) - {"starts_after"}, key=str)
    if unknown:
        raise StructuredOutputError(f"{unknown[0]!r} is not a kind of structured output (expected one of "
                                    f"{', '.join(KINDS)}, and optionally starts_after)")
    kinds = [k for k in KINDS if k in value and value[k] is not None and value[k] is not False]
    if len(kinds) != 1:
        what = "none" if not kinds else " and ".join(kinds)
        raise StructuredOutputError(f"give exactly one of {', '.join(KINDS)}, got {what}")
    kind = kinds[0]
    starts_after = value.get("starts_after")
    if starts_after is not None and (not isinstance(starts_after, numbers.Integral) or isinstance(starts_after, bool)
                                     or starts_after < 0 or (vocab_size is not None and starts_after >= vocab_size)):
        where = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise StructuredOutputError(f"starts_after must be a token id in {where} or None, got {starts_after!r}")
    source = _SOURCES[kind](value[kind])
    return StructuredOutput(kind, source, None if starts_after is None else int(starts_after))


def _value_of(spec: StructuredOutput):
    return {"json": lambda s: s, "json_object": lambda s: True, "regex": lambda s: s,
            "choice": json.loads, "grammar": lambda s: s, "structural_tag": lambda s: s}[spec.kind](spec.source)


def _json_source(schema) -> str:
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise StructuredOutputError(f"json: the schema is not valid JSON ({e})") from None
    if not isinstance(schema, Mapping):
        raise StructuredOutputError(f"json: a JSON schema must be a JSON object, got {type(schema).__name__}")
    check_enforceable(schema)
    try:
        return json.dumps(schema, ensure_ascii=False, allow_nan=False)  # (key order kept: properties come in it)
    except (TypeError, ValueError) as e:
        raise StructuredOutputError(f"json: the schema holds a value JSON cannot carry ({e})") from None


def _json_object_source(flag) -> str:
    if flag is not True:
        raise StructuredOutputError(f"json_object must be True, got {flag!r}")
    return ""


def _text_source(kind: str):
    def source(text) -> str:
        if not isinstance(text, str) or not text:
            raise StructuredOutputError(f"{kind} must be a non-empty string, got {_short(text)}")
        return text
    return source


def _choice_source(choices) -> str:
    if isinstance(choices, (str, bytes)) or not isinstance(choices, (list, tuple)) or not choices:
        raise StructuredOutputError(f"choice must be a non-empty list of strings, got {_short(choices)}")
    for c in choices:
        if not isinstance(c, str) or not c:
            raise StructuredOutputError(f"choice: every choice must be a non-empty string, got {_short(c)}")
    return json.dumps(list(choices), ensure_ascii=False)


def _tag_source(tag) -> str:
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except ValueError as e:
            raise StructuredOutputError(f"structural_tag: not valid JSON ({e})") from None
    if not isinstance(tag, Mapping):
        raise StructuredOutputError(f"structural_tag must be a JSON object, got {type(tag).__name__}")
    try:
        return json.dumps(tag, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise StructuredOutputError(f"structural_tag: holds a value JSON cannot carry ({e})") from None


_SOURCES = {"json": _json_source, "json_object": _json_object_source, "regex": _text_source("regex"),
            "choice": _choice_source, "grammar": _text_source("grammar"), "structural_tag": _tag_source}


def check_enforceable(schema: Mapping, path: str = "#", names: bool = False) -> None:
    """StructuredOutputError naming the first keyword of UNENFORCED (or an allOf of several branches), or of
    check_conditions, in `schema` or any of its subschemas, with its JSON pointer. `names`: `schema` is a
    propertyNames' (of strings, without saying so)."""
    for keyword, refuse in UNENFORCED.items():
        if keyword in schema and (refuse is None or refuse(schema[keyword])):
            raise StructuredOutputError(f"json: the schema's {keyword!r} (at {path}) cannot be enforced by structured "
                                        "output: leave it out or check it after")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise StructuredOutputError(f"json: the schema's 'allOf' of {len(schema['allOf'])} schemas (at {path}) cannot "
                                    "be enforced by structured output: merge them into one")
    check_conditions(schema, path, {"string"} if names else None)
    for keyword in _SCHEMA:
        if isinstance(schema.get(keyword), Mapping):
            check_enforceable(schema[keyword], f"{path}/{keyword}", keyword == "propertyNames")
    for keyword in _SCHEMA_LISTS + ("items",):
        if isinstance(schema.get(keyword), list):
            for i, sub in enumerate(schema[keyword]):
                if isinstance(sub, Mapping):
                    check_enforceable(sub, f"{path}/{keyword}/{i}")
    for keyword in _SCHEMA_MAPS:
        if isinstance(schema.get(keyword), Mapping):
            for name, sub in schema[keyword].items():
                if isinstance(sub, Mapping):
                    check_enforceable(sub, f"{path}/{keyword}/{name}")


def check_conditions(schema: Mapping, path: str = "#", implied: set[str] | None = None) -> None:
    """StructuredOutputError naming what xgrammar would drop from `schema` itself (not its subschemas) in the
    places it drops it (the module's docstring; each found by the warning xgrammar logs for it, or by a grammar
    that writes any value). `implied`: the types of a schema whose place says them (a propertyNames')."""
    def refuse(keyword: str, why: str):
        raise StructuredOutputError(f"json: the schema's {keyword!r} (at {path}) cannot be enforced by structured "
                                    f"output: {why}")

    ref = schema.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        refuse("$ref", f"{ref!r} points out of the schema; only references within it ('#/$defs/...') are followed")
    kind = schema.get("type")
    types = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else implied
    if types is None and not any(k in schema for k in _SAYS_WHAT):
        if "properties" in schema or "additionalProperties" in schema:
            types = {"object"}  # (what xgrammar takes such a schema for)
        elif "items" in schema or "prefixItems" in schema:
            types = {"array"}
        else:
            loose = next((k for k in _TYPED if k in schema), None)
            if loose is not None:
                refuse(loose, "the schema gives no 'type', so any value would be written: add its 'type'")
    if not types:
        return
    multiple = schema.get("multipleOf")
    if multiple is not None and types & {"integer", "number"}:
        whole = isinstance(multiple, numbers.Real) and 0 < multiple <= 1024 and float(multiple).is_integer()
        every_integer = isinstance(multiple, numbers.Real) and multiple > 0 and (1 / multiple).is_integer()
        bounded = ({"minimum", "exclusiveMinimum"} & schema.keys() != set()) == \
            ({"maximum", "exclusiveMaximum"} & schema.keys() != set())
        if "number" in types or not (every_integer or (whole and bounded)):
            refuse("multipleOf", "only an integer's is, by a whole number up to 1024, with both of its bounds or neither")
    if "string" in types:
        held = "pattern" if "pattern" in schema else "format" if schema.get("format") in FORMATS else None
        least = FORMATS[schema["format"]] if held == "format" else 0
        length = "maxLength" if "maxLength" in schema else "minLength" if schema.get("minLength", 0) > least else None
        if held and length:
            refuse(length, f"its {held!r} is enforced and its length then is not: put the length in a pattern, or "
                           "check it after")
        if isinstance(schema.get("pattern"), str) and _has_lookahead(schema["pattern"]):
            refuse("pattern", "its lookahead ((?= or (?!) is not: leave it out or check it after")
    if "object" in types and isinstance(schema.get("required"), list):
        defined = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
        missing = [name for name in schema["required"] if name not in defined]
        if missing:
            refuse("required", f"it names {missing[0]!r}, which its 'properties' does not define: only the "
                               "properties a schema defines are written")


def _has_lookahead(pattern: str) -> bool:
    """Whether a regular expression holds a lookahead group, (?= or (?!, outside a character class."""
    escaped = in_class = False
    for i, ch in enumerate(pattern):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(" and pattern[i + 1:i + 3] in ("?=", "?!"):
            return True
    return False


def choice_grammar(choices: list[str]) -> str:
    """The EBNF of `choices` (one of them exactly): JSON string literals, whose escapes xgrammar's EBNF reads."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."

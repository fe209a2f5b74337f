"""UTF-16 surrogate escapes in the texts a grammar is compiled from, read as the characters they stand for.

    source = joined_pairs(r"^\\ud83d\\ude00+$", "regex")      # "^😀+$"
    source = schema_pairs(schema_text)                         # every "pattern" of a JSON schema's text, so
    source = tag_pairs(tag_text)                               # a structural tag's patterns and grammars

A character outside the Basic Multilingual Plane (an emoji) is two UTF-16 code units, and JavaScript writes it
in a regular expression as two escapes, `\\ud83d\\ude00`; JSON Schema's patterns are ECMA-262's, read with its
"u" flag (JSON Schema 2020-12), under which such a pair is the one code point, 😀. xgrammar reads each escape
as a code point of its own and writes the surrogates' UTF-8 (ED A0 BD, bytes no valid text holds), so the
grammar held the output to invalid UTF-8 and the reply decoded to U+FFFD's. A pair of escapes (`\\uHHHH`, `\\u{H}`
or EBNF's `\\UHHHHHHHH`) becomes its character here; a lone surrogate escape stands for no character UTF-8 can
write (and a lead escape before a class of trail escapes, `\\ud83d[\\ude00-\\ude4f]`, matches only lone
surrogates under the "u" flag): a StructuredOutputError naming it and its place.
"""

from __future__ import annotations

import json
import re

from .structured import StructuredOutputError

# an escape of a code point: \uHHHH, \u{H...} (xgrammar's regular expressions) or \UHHHHHHHH (its EBNF)
_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|u\{([0-9a-fA-F]{1,6})\}|U([0-9a-fA-F]{8}))")
# keywords whose values are data, not schemas: a "pattern" key inside them is a value's, left as it is
_DATA = ("const", "enum", "default", "examples")


def _code(match: re.Match) -> int:
    return int(next(g for g in match.groups() if g is not None), 16)


def joined_pairs(text: str, what: str) -> str:
    """`text` (a regular expression or a grammar; `what` names it) with each pair of surrogate escapes written as its
    character; StructuredOutputError for a lone surrogate escape. An escaped backslash (`\\\\u...`) is no escape."""
    out, i = [], 0
    while (j := text.find("\\", i)) >= 0:
        out.append(text[i:j])
        m = _ESCAPE.match(text, j)
        if m is None or not 0xD800 <= _code(m) <= 0xDFFF:
            out.append(text[j:j + 2])  # (a backslash and what it escapes: "\\\\" is one escape, not two)
            i = j + 2
            continue
        lead = _code(m)
        trail = _ESCAPE.match(text, m.end()) if lead <= 0xDBFF else None
        if trail is None or not 0xDC00 <= _code(trail) <= 0xDFFF:
            half = "a lead" if lead <= 0xDBFF else "a trail"
            raise StructuredOutputError(
                f"{what}: {m.group(0)} at {j} is {half} surrogate without its pair, which stands for no character: write "
                f"the character itself, or both halves of its UTF-16 pair (\\ud83d\\ude00 for U+1F600); a class of "
                f"surrogates, \\ud83d[\\ude00-\\ude4f], holds no character either: write [\\ud83d\\ude00-\\ud83d\\ude4f]")
        out.append(chr(0x10000 + ((lead - 0xD800) << 10) + (_code(trail) - 0xDC00)))
        i = trail.end()
    out.append(text[i:])
    return "".join(out)


def _walk(node, grammars: bool, what: str):
    """`node` (a JSON value) with joined_pairs applied to the string of every "pattern" key (and of every "grammar" key
    with `grammars`: a structural tag's EBNF formats) and to the keys of "patternProperties"; data left as it is."""
    if isinstance(node, list):
        return [_walk(v, grammars, what) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _DATA:
            out[key] = value
        elif isinstance(value, str) and (key == "pattern" or (grammars and key == "grammar")):
            out[key] = joined_pairs(value, f"{what}: {key}")
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {joined_pairs(k, f"{what}: patternProperties"): _walk(v, grammars, what) for k, v in value.items()}
        else:
            out[key] = _walk(value, grammars, what)
    return out


def schema_pairs(schema: str) -> str:
    """A JSON schema's text with its patterns' surrogate pairs joined (the text as it was where it holds none)."""
    return _joined_json(schema, grammars=False, what="json")


def tag_pairs(tag: str) -> str:
    """A structural tag's text with the surrogate pairs of its patterns and its EBNF grammars joined."""
    return _joined_json(tag, grammars=True, what="structural_tag")


def _joined_json(text: str, grammars: bool, what: str) -> str:
    if "\\u" not in text and "\\U" not in text:  # (JSON text: any escape of a pattern's is a backslash escaped)
        return text
    value = json.loads(text)
    joined = _walk(value, grammars, what)
    return text if joined == value else json.dumps(joined, ensure_ascii=False)

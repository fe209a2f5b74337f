"""Structured output on the wire: which field of a request asks for it, as the engine's StructuredOutput
(metrale_graph/structured.py), checked and compiled before the request is submitted.

    spec, field = structured_request(state, body, forced_schema, starts_after)   # 400 naming the field
    await compile_grammar(state, spec, field)      # off the event loop; a grammar that fails: 400 naming it

The fields, of both endpoints (at most one of them per request; two are a 400 naming the second):

| field | engine spec |
|---|---|
| `response_format` (OpenAI's): type "json_object", or "json_schema" with json_schema.schema | json_object / json |
| `text.format` (the Responses API's): the same types, its schema under `schema` | json_object / json |
| `structured_outputs` {"json" \\| "regex" \\| "choice" \\| "grammar" \\| "json_object" \\| "structural_tag"} (vLLM) | that |
| `response_format` type "structural_tag" (vLLM's: `format`, or its older `structures`, `triggers`) | structural_tag |
| `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (vLLM's older names) | json, regex, choice, grammar |
| `tool_choice` "required" or a named function (chat, tool_choice.py: the reply is the calls' JSON) | json |
| `tool_choice` "required" or named where a custom tool's grammar holds its input (tool_choice.py: calls) | structural_tag |
| `tools` with a `strict` function or a custom tool of a grammar under "auto" (calls in the model's format) | structural_tag |
| `response_format` / `text.format` beside `tools` under "auto" (tool_choice.py: that JSON, or calls) | structural_tag |

`response_format` {"type": "text"} asks for nothing, and so do `response_format` and `text.format` under a forced
call (tool_choice "required" or a function): the reply is the call, with no text for them to hold (OpenAI takes
both). A chat reply that starts inside a reasoning block (the prompt opened `<think>`, and the server parses
reasoning) is held to its grammar from after `</think>` on (`starts_after`), when the tokenizer has it as one
token: the reasoning stays free, the answer follows the grammar. Without such a token the grammar holds from the
reply's first token, and the reply is read as content (chat.start_chat): it has no reasoning block.
"""

from __future__ import annotations

import asyncio
import json

from ..grammar import json_format
from ..structured import StructuredOutput, StructuredOutputError, structured_output
from .errors import bad_request
from .protocol import SamplingFields


def structured_request(state, body: SamplingFields, forced_schema: dict | None = None, starts_after: int | None = None,
                       calls_tag=None, forced: bool = False) -> tuple[StructuredOutput | None, str | None]:
    """(the engine's spec, the field that asked for it), or (None, None): the request asks for no structured output.
    400 naming the field for a malformed one, or for a second field asking too. `calls_tag`: a callable giving the
    structural tag of the calls under tool_choice "auto" (tool_choice.ToolRequest.calls_tag of a reasoning mode and
    an answer's format; None where no call can come): strict tools' calls, or OpenAI's format (response_format,
    text.format) composed with the calls, as OpenAI holds a reply with tools to its format only where it makes no
    call. vLLM's fields (structured_outputs, guided_*) hold the whole reply: no call can be made. `forced`: a forced call
    held by `calls_tag` (a custom tool's grammar), as `forced_schema`'s is by its JSON."""
    # a forced call's reply is the call: OpenAI's formats hold a reply's text, and there is none (OpenAI takes both, and
    # vLLM drops the format: the OpenAI Agents SDK sends an agent's output_type with tool_choice "required")
    formats = _asked(body, formats=True, others=False) if forced_schema is None and not forced else []
    asked = formats + _asked(body, formats=False)
    if forced_schema is not None or (forced and asked):  # (forced and asked: a 400, below)
        asked.append(("tool_choice", {"json": forced_schema}))
    if calls_tag is not None and asked == formats and len(formats) <= 1:
        mode = "disabled" if starts_after is not None or not state.replies.reasoning else "auto"
        field, answer = formats[0] if formats else ("tools", None)
        if answer is not None:  # the reply is the format's JSON, or calls (the Agents SDK's output_type with tools)
            try:
                answer = json_format(structured_output(answer).source if "json" in answer else '{"type": "object"}')
            except StructuredOutputError as e:
                raise bad_request(f"{field}: {e.detail}", param=field) from None
        try:
            tag = calls_tag(mode, answer)
        except (StructuredOutputError, ValueError) as e:
            raise bad_request(f"tools: the functions' calls cannot be enforced: {e}", param="tools") from None
        if tag is not None:
            asked = [(field, {"structural_tag": tag})]
    if not asked:
        return None, None
    if len(asked) > 1:
        (first, _), (second, _) = asked[:2]
        raise bad_request(f"{second}: the request already asks for structured output with {first}: send one of "
                          "them", param=second)
    field, value = asked[0]
    try:
        return structured_output({**value, "starts_after": starts_after}, state.vocab_size), field
    except StructuredOutputError as e:
        raise bad_request(f"{field}: {e.detail}", param=field) from None


def _asked(body: SamplingFields, formats: bool = True, others: bool = True) -> list[tuple[str, dict]]:
    """(field, the engine's spec as a mapping) of every field of `body` that asks for structured output: OpenAI's
    formats (response_format, text.format) with `formats`, vLLM's fields with `others`."""
    asked = []
    for name, fmt in body.formats() if formats else ():
        if fmt.type == "json_object":
            asked.append((name, {"json_object": True}))
        elif fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise bad_request(f"{name}: type json_schema needs its schema: {{\"type\": \"json_schema\", "
                                  "\"json_schema\": {\"name\": ..., \"schema\": {...}}}", param=name)
            asked.append((name, {"json": fmt.json_schema.schema_}))
    if not others:
        return asked
    for name, fmt in body.formats():  # vLLM's structural_tag response_format: the whole reply, as vLLM's own fields
        if fmt.type == "structural_tag":
            tag = fmt.model_dump(include={"format", "structures", "triggers"}, exclude_none=True)
            asked.append((name, {"structural_tag": vllm_tag({"type": "structural_tag", **tag}, name)}))
    outputs = body.structured_outputs
    if outputs is not None:
        tag = outputs.structural_tag
        asked.append(("structured_outputs", {"json": outputs.json_, "regex": outputs.regex, "choice": outputs.choice,
                                             "grammar": outputs.grammar, "json_object": outputs.json_object,
                                             "structural_tag": None if tag is None else vllm_tag(tag, "structured_outputs")}))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        if getattr(body, field) is not None:
            asked.append((field, {kind: getattr(body, field)}))
    return asked


def vllm_tag(tag, field: str) -> dict:
    """A structural tag as vLLM takes it (a mapping, or its JSON text) as xgrammar's: {"type": "structural_tag", "format":
    {...}} as it is; vLLM's older form, {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}, as the
    triggered_tags it stands for (free text, and where a trigger begins, one of its tags: begin, the schema's JSON,
    end), as vLLM hands it to xgrammar. 400 naming `field` for one that is neither."""
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except ValueError as e:
            raise bad_request(f"{field}: the structural tag is not valid JSON ({e})", param=field) from None
    if isinstance(tag, dict) and "format" in tag:
        return tag
    structures, triggers = (tag.get("structures"), tag.get("triggers")) if isinstance(tag, dict) else (None, None)
    if not (isinstance(structures, list) and isinstance(triggers, list) and all(
            isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
            and isinstance(s.get("schema"), dict) for s in structures)):
        raise bad_request(f"{field}: a structural tag is {{\"type\": \"structural_tag\", \"format\": {{...}}}} "
                          "(xgrammar's), or vLLM's {\"structures\": [{\"begin\", \"schema\", \"end\"}, ...], "
                          "\"triggers\": [...]}", param=field)
    tags = [{"type": "tag", "begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]},
             "end": s["end"]} for s in structures]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}


async def compile_grammar(state, spec: StructuredOutput, field: str) -> None:
    """Compile `spec`'s grammar in the engine's grammar worker (or find it cached), awaited off the event loop:
    Engine.submit then finds it done. 400 naming `field` when it does not compile."""
    try:
        await asyncio.wrap_future(state.engine.compile_grammar(spec))
    except StructuredOutputError as e:
        raise bad_request(f"{field}: {e.detail}", param=field) from None

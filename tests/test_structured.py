"""Structured output: the spec's checks (structured.py), the xgrammar backend's masks against a brute-force
reference over a real byte-level BPE (tests/tokenizer_fixture.py: the mask allows exactly the tokens whose bytes
continue a string of the grammar's language, and the end token exactly where a string is complete), and the
Engine end to end on a tiny random model, whose outputs parse and validate only because the mask forces them:
greedy and sampled, beside plain requests, no added or special token allowed under a grammar (but a
stop token where the output may end), with prefix caching, with overlap (the same streams as without), a
grammar that starts after a token, a request without stop tokens, an ordinary stop token the grammar needs
(sampled, ending the request), and the ValueErrors before anything is queued."""

import json
import re

import pytest
import torch
from pydantic import BaseModel, Field, TypeAdapter
from typing import Literal

from helpers import benchmark_script, tiny_config
from metrale_graph import Engine, EngineClosedError, HybridModel
from metrale_graph.grammar import TokenMasks
from metrale_graph.scheduler import Request
from metrale_graph.structured import StructuredOutputError, structured_output
from tokenizer_fixture import build_tokenizer

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

PADDING = 7  # the model's vocabulary is the tokenizer's and 7 ids more, which no grammar may allow


class Pet(BaseModel):
    kind: Literal["cat", "dog", "emu"]
    age: int = Field(ge=0, le=20)
    indoor: bool
    name: str = Field(max_length=4)


PET = TypeAdapter(Pet)
SCHEMA = Pet.model_json_schema()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def model(tokenizer):
    return HybridModel.from_preset(tiny_config(vocab_size=len(tokenizer) + PADDING), seed=0)


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    with Engine(model, num_slots=4, max_context=256, compile=False, tokenizer=tokenizer) as engine:
        yield engine


# the spec ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, says", [
    ("json", "expected a mapping"),
    ({}, "got none"),
    ({"json": {}, "regex": "a"}, "json and regex"),
    ({"jsn": {}}, "'jsn' is not a kind"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1]}, "must be a JSON object"),
    ({"json": {"type": "array", "uniqueItems": True}}, "'uniqueItems' (at #)"),
    ({"json": {"properties": {"a": {"items": {"not": {}}}}}}, "'not' (at #/properties/a/items)"),
    ({"json": {"anyOf": [{"if": {}}]}}, "'if' (at #/anyOf/0)"),
    ({"json": {"allOf": [{"type": "integer"}, {"minimum": 3}]}}, "'allOf' of 2 schemas"),
    # what xgrammar drops only in some places (it logs a warning and writes the schema without it)
    ({"json": {"type": "number", "multipleOf": 0.5}}, "'multipleOf' (at #)"),
    ({"json": {"type": "integer", "multipleOf": 3, "minimum": 0}}, "'multipleOf' (at #)"),
    ({"json": {"type": "integer", "multipleOf": 2048}}, "'multipleOf' (at #)"),
    ({"json": {"properties": {"a": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 5}}}},
     "'maxLength' (at #/properties/a)"),
    ({"json": {"type": ["string", "null"], "format": "email", "minLength": 3}}, "'minLength' (at #)"),
    ({"json": {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{8}$"}}, "'pattern' (at #)"),
    ({"json": {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}}, "names 'b'"),
    ({"json": {"items": {"minimum": 3}}}, "'minimum' (at #/items)"),
    ({"json": {"$ref": "other.json#/Pet"}}, "'$ref' (at #)"),
    ({"json": {"$dynamicRef": "#node"}}, "'$dynamicRef' (at #)"),
    ({"json": {"const": float("nan")}}, "JSON cannot carry"),
    ({"json_object": "yes"}, "must be True"),
    ({"regex": ""}, "non-empty string"),
    ({"choice": "yes"}, "non-empty list of strings"),
    ({"choice": ["a", ""]}, "every choice must be a non-empty string"),
    ({"grammar": 3}, "non-empty string"),
    ({"structural_tag": "[1]"}, "structural_tag must be a JSON object"),
    ({"choice": ["a"], "starts_after": -1}, "starts_after"),
    ({"choice": ["a"], "starts_after": 10**6}, "starts_after"),
])
def test_a_bad_spec_is_named(value, says):
    with pytest.raises(StructuredOutputError, match=re.escape(says)) as e:
        structured_output(value, vocab_size=1000)
    assert str(e.value) == f"structured: {e.value.detail}"


@pytest.mark.parametrize("schema", [
    {"type": "integer", "multipleOf": 3, "minimum": 0, "exclusiveMaximum": 30},
    {"type": ["integer", "null"], "multipleOf": 3},
    {"type": "integer", "multipleOf": 0.5, "minimum": 1},  # (every integer is one)
    {"type": "string", "pattern": "^[a-z]+$", "minLength": 0},
    {"type": "string", "format": "uri", "minLength": 1},  # pydantic's AnyUrl (a uri is never empty)
    {"type": "string", "pattern": "[(?=]\\(?=x"},  # a class and an escape: no lookahead
    {"type": "object", "propertyNames": {"pattern": "^[a-z]$"}, "additionalProperties": {"type": "integer"}},
    {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
])
def test_what_xgrammar_enforces_in_those_places_is_taken(schema):
    assert structured_output({"json": schema}).kind == "json"


def test_a_property_named_like_a_keyword_is_no_keyword():
    spec = structured_output({"json": {"type": "object", "properties": {"not": {"type": "integer"}}}})
    assert (spec.kind, json.loads(spec.source)["properties"]) == ("json", {"not": {"type": "integer"}})
    assert structured_output(spec) == spec  # a StructuredOutput passes as it is


# the masks against a brute-force reference ---------------------------------------------------------------------
def _token_bytes(tokenizer) -> dict[int, bytes]:
    """Each ordinary token's bytes (byte-level BPE: the token string through the inverse of bytes_to_unicode)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    decode = {c: b for b, c in bytes_to_unicode().items()}
    special = set(tokenizer.all_special_ids)
    return {i: bytes(decode[c] for c in tok) for tok, i in tokenizer.get_vocab().items() if i not in special}


LANGUAGES = {  # a grammar and its language, finite, as UTF-8 strings
    "choice": ({"choice": ["yes", "yellow", "no", "Ça va", "東京"]}, ["yes", "yellow", "no", "Ça va", "東京"]),
    "regex": ({"regex": "(ab|c)d?|東"}, ["ab", "abd", "c", "cd", "東"]),
    "grammar": ({"grammar": 'root ::= "fox" ("es" | "")'}, ["fox", "foxes"]),
    "lark": ({"grammar": 'start: "fox" "es"?'}, ["fox", "foxes"]),
    "json": ({"json": {"enum": ["dog", 12]}}, ['"dog"', "12"]),
}


@pytest.mark.parametrize("name", list(LANGUAGES))
def test_the_mask_allows_exactly_the_continuations_of_the_language(engine, tokenizer, name):
    """Along every string of the language (its tokenizer's tokens), at every prefix: an ordinary token is
    allowed exactly when the prefix's bytes and its own begin a string of the language (an ordinary stop token,
    `o` here, too: text, as in vLLM, not an end), the end token (eos) exactly when the prefix is one, nothing else
    (other special tokens, the padding ids past the tokenizer's)."""
    spec, language = LANGUAGES[name]
    words = [w.encode() for w in language]
    pieces = _token_bytes(tokenizer)
    stops = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("o")}
    compiled = engine.compile_grammar(spec).result()
    masks = TokenMasks(1, engine.model.config.vocab_size, torch.device("cpu"))
    for word in language:
        request = Request(0, [1], 8, None, None)
        request.grammar = engine._grammars.matcher(compiled, structured_output(spec), stops)
        ids = tokenizer.encode(word, add_special_tokens=False)
        for k in range(len(ids) + 1):
            prefix = b"".join(pieces[t] for t in ids[:k])
            bits = masks.fill([request])[0]
            allowed = {t for t in range(engine.model.config.vocab_size) if (int(bits[t // 32]) >> (t % 32)) & 1}
            expected = {t for t, b in pieces.items() if any(w.startswith(prefix + b) for w in words)}
            if prefix in words:
                expected.add(tokenizer.eos_token_id)
            assert allowed == expected, (word, k, sorted(allowed ^ expected))
            if k < len(ids):
                request.grammar.accept(ids[k])


def test_json_object_is_an_object_written_compactly(engine, tokenizer):
    """json_object: the first token opens an object; `{"a": [1, 2]}` goes through, the same with any other
    spacing does not; once it closes only a stop token is left."""
    pieces = _token_bytes(tokenizer)
    compiled = engine.compile_grammar({"json_object": True}).result()
    masks = TokenMasks(1, engine.model.config.vocab_size, torch.device("cpu"))

    def walk(text):
        request = Request(0, [1], 8, None, None)
        request.grammar = engine._grammars.matcher(compiled, structured_output({"json_object": True}), {0})
        for t in tokenizer.encode(text, add_special_tokens=False):
            request.grammar.accept(t)
        bits = masks.fill([request])[0]
        return {t for t in range(len(tokenizer)) if (int(bits[t // 32]) >> (t % 32)) & 1}

    assert walk("") == {t for t, b in pieces.items() if b.startswith(b"{")}
    assert walk('{"a": [1, 2]}') == {0}
    with pytest.raises(StructuredOutputError):
        walk('{"a":[1, 2]}')


FREE_TEXT = {  # (spec, a prefix into the text): grammars whose language holds "<|im_start|><think>" as text there
    "json": ({"json": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}, '{"a": "x'),
    "json_object": ({"json_object": True}, '{"a": "x'),
    "regex": ({"regex": "[a-z<|>_]*"}, "x"),
    "grammar": ({"grammar": 'root ::= [^#]* "#"'}, "x"),
}


def _allowed_ids(masks, request, vocab: int) -> set[int]:
    bits = masks.fill([request])[0]
    return {t for t in range(vocab) if (int(bits[t // 32]) >> (t % 32)) & 1}


@pytest.mark.parametrize("name", list(FREE_TEXT))
def test_added_and_special_tokens_are_never_allowed_under_a_grammar(tmp_path, name):
    """xgrammar reads an added token as its content's text, so a JSON string or a free regex allowed
    `<|im_start|>` (special) and `<think>` (added, not special) as single tokens: control tokens inside the
    output. Every grammar's mask holds out the tokenizer's added and special tokens (the stop token only where
    the output may end); their text stays reachable, spelled with the BPE's own tokens."""
    from transformers import AutoTokenizer

    from metrale_graph.grammar import Grammars

    tok = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tok"))
    tok.add_tokens(["<think>"])  # as Qwen3's: added, not special
    vocab, eos = len(tok) + PADDING, tok.eos_token_id
    added = {tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<think>")}
    assert len(added) == 3 and eos not in added
    spec, prefix = FREE_TEXT[name]
    grammars = Grammars(tok, vocab)
    try:
        compiled = grammars.compile(structured_output(spec)).result()
    finally:
        grammars.close()
    masks = TokenMasks(1, vocab, torch.device("cpu"))
    request = Request(0, [1], 8, None, None)
    request.grammar = grammars.matcher(compiled, structured_output(spec), {eos})
    for t in tok.encode(prefix, add_special_tokens=False):
        request.grammar.accept(t)
    for char in "<|im_start|><think>":  # the tags' text, a byte-level token per character
        allowed = _allowed_ids(masks, request, vocab)
        assert not allowed & added, (char, sorted(allowed & added))
        assert (eos in allowed) == (name == "regex"), char  # json: the string is open; grammar: "#" is missing
        request.grammar.accept(tok.convert_tokens_to_ids(char))
    if name == "grammar":
        request.grammar.accept(tok.convert_tokens_to_ids("#"))
        assert _allowed_ids(masks, request, vocab) == {eos}


def test_a_model_biased_to_special_tokens_writes_json_without_them(engine, tokenizer):
    """logit_bias +100 on `<|im_start|>` and `<|im_end|>` (not stop tokens here): unmasked, the model would
    write them inside the JSON string; the output is JSON of ordinary tokens, ended by eos."""
    specials = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")]
    schema = {"type": "object", "properties": {"note": {"type": "string", "maxLength": 40}}, "required": ["note"]}
    results = engine.generate(PROMPTS, max_new_tokens=80, logit_bias={t: 100.0 for t in specials},
                              structured={"json": schema})
    for r in results:
        assert r.finish_reason == "stop" and not set(r.token_ids) & set(specials), r
        assert set(json.loads(r.text)) == {"note"} and r.token_ids[-1] == tokenizer.eos_token_id, r


def test_a_token_the_grammar_does_not_allow_is_an_error(engine):
    compiled = engine.compile_grammar({"choice": ["yes"]}).result()
    grammar = engine._grammars.matcher(compiled, structured_output({"choice": ["yes"]}), {0})
    with pytest.raises(StructuredOutputError, match="does not allow the sampled token"):
        grammar.accept(engine.tokenizer.encode("no")[0])


def test_grammars_are_compiled_once_and_failures_are_not_kept(engine):
    spec = {"json": {"type": "object", "properties": {"x": {"type": "integer"}}}}
    assert engine.compile_grammar(spec) is engine.compile_grammar(dict(spec))
    bad = {"regex": "(("}
    first = engine.compile_grammar(bad)
    with pytest.raises(StructuredOutputError, match="regex: the regular expression does not compile"):
        first.result()
    assert engine.compile_grammar(bad) is not first


# the engine -------------------------------------------------------------------------------------------------
PROMPTS = ["Hello world", "The quick brown fox", "def fibonacci(n):", "東京は"]


def _valid_pets(results):
    for r in results:
        assert r.finish_reason == "stop", r
        assert PET.validate_json(r.text), r.text


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_outputs_parse_and_validate(engine, temperature):
    results = engine.generate(PROMPTS, max_new_tokens=60, temperature=temperature, seed=1,
                              structured={"json": SCHEMA})
    _valid_pets(results)
    assert all(r.token_ids[-1] == engine.tokenizer.eos_token_id for r in results)  # eos once the object closes


def test_outputs_under_the_conditions_xgrammar_enforces_validate(engine):
    """An integer's multipleOf with both bounds, and a format with the minLength it implies, hold sampled outputs."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 7, "minimum": -50, "maximum": 50},
                                               "d": {"type": "string", "format": "date", "minLength": 1}},
              "required": ["n", "d"], "additionalProperties": False}
    for r in engine.generate(PROMPTS, max_new_tokens=40, temperature=1.0, seed=2, structured={"json": schema}):
        value = json.loads(r.text)
        assert r.finish_reason == "stop" and value["n"] % 7 == 0 and re.fullmatch(r"\d{4}-\d{2}-\d{2}", value["d"]), r


@pytest.mark.parametrize("spec, temperature, check", [
    ({"choice": ["cat", "dog", "emu"]}, 1.0, lambda t: t in ("cat", "dog", "emu")),
    ({"regex": "[0-9]{3}-[a-z]{2}"}, 1.0, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ({"grammar": 'root ::= ("ab" | "c")+ "."'}, 1.0, lambda t: re.fullmatch(r"(ab|c)+\.", t)),
], ids=["choice", "regex", "grammar"])
def test_every_kind_holds_the_outputs(engine, spec, temperature, check):
    results = engine.generate(PROMPTS, max_new_tokens=40, temperature=temperature, seed=3, structured=spec)
    for r in results:
        assert r.finish_reason == "stop" and check(r.text), r


def test_a_request_without_stop_tokens_ends_when_its_output_is_complete(engine):
    (r,) = engine.generate(PROMPTS[:1], max_new_tokens=60, stop_token_ids=[], structured={"json": SCHEMA})
    assert r.finish_reason == "stop" and PET.validate_json(r.text)
    assert engine.tokenizer.eos_token_id not in r.token_ids  # never allowed: it stops nothing


def test_a_stop_token_the_grammar_needs_is_sampled_and_ends_the_request(engine, tokenizer):
    """An ordinary token in stop_token_ids (`[`) is text to the grammar, not an end (vLLM's): where the grammar
    needs it, a JSON array's first token, it is sampled and ends the request ("stop"; the grammar made it an end
    token, masked there, and the request failed with no token left to sample). Where it never comes, the output is
    whole: ended by eos, or, with no end token among the stops, by its completion."""
    bracket, eos = tokenizer.convert_tokens_to_ids("["), tokenizer.eos_token_id
    array = {"json": {"type": "array", "items": {"type": "integer"}, "minItems": 1}}
    kinds = {"json": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"enum": [1, 2, 3]}},
                      "required": ["kind", "age"], "additionalProperties": False}}
    for stops in ([eos, bracket], [bracket]):
        for temperature in (0.0, 1.0):
            for r in engine.generate(PROMPTS, max_new_tokens=40, temperature=temperature, seed=4, stop_token_ids=stops,
                                     structured=array):
                assert (r.finish_reason, r.token_ids) == ("stop", [bracket]), (stops, r)
            for r in engine.generate(PROMPTS, max_new_tokens=40, temperature=temperature, seed=4, stop_token_ids=stops,
                                     structured=kinds):
                assert r.finish_reason == "stop" and json.loads(r.text)["kind"] in ("cat", "dog"), (stops, r)
                assert bracket not in r.token_ids and (r.token_ids[-1] == eos) == (eos in stops), (stops, r)


def test_a_grammar_that_starts_after_a_token(engine, tokenizer):
    """The first token is free (logit_bias makes it `think`); the grammar holds from the next one on."""
    (think,) = tokenizer.encode("#", add_special_tokens=False)
    (r,) = engine.generate(PROMPTS[:1], max_new_tokens=10, logit_bias={think: 100.0},
                           structured={"choice": ["cat", "dog"], "starts_after": think})
    assert r.finish_reason == "stop" and r.text in ("#cat", "#dog"), r


def _mixed(engine, **kw):
    """Grammar requests beside plain ones in one batch (streams by request), greedy and sampled."""
    handles = [engine.submit(p, max_new_tokens=60, temperature=t, seed=7, stop_token_ids=[] if plain else None,
                             structured=None if plain else {"json": SCHEMA}, **kw)
               for p in PROMPTS for t in (0.0, 1.0) for plain in (False, True)]
    return [h.result() for h in handles]


def test_overlap_gives_the_streams_of_a_loop_without_it(model, tokenizer, engine):
    with Engine(model, num_slots=4, max_context=256, compile=False, tokenizer=tokenizer, overlap=False) as serial:
        expected = _mixed(serial)
    got = _mixed(engine)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    _valid_pets(got[::2])
    assert all(len(r.token_ids) == 60 for r in got[1::2])  # the plain ones ran their length beside them


def test_prefix_caching(model, tokenizer):
    with Engine(model, num_slots=4, max_context=256, compile=False, tokenizer=tokenizer, prefix_cache=True,
                block_size=16, checkpoint_interval=64) as cached:
        prompts = [PROMPTS[1] * 12, PROMPTS[2] * 12]
        first = cached.generate(prompts, max_new_tokens=60, structured={"json": SCHEMA})
        again = cached.generate(prompts, max_new_tokens=60, structured={"json": SCHEMA})
    assert all(r.cached_tokens > 0 for r in again)
    assert [r.token_ids for r in again] == [r.token_ids for r in first]
    _valid_pets(again)


@pytest.mark.parametrize("kw, says", [
    (dict(structured={"json": {"type": "nonsense"}}), 'json: the JSON schema does not compile: Unsupported type "nonsense"'),
    (dict(structured={"grammar": "root ::= foo"}), 'grammar: the grammar does not compile'),
    (dict(structured={"regex": 5}), "regex must be a non-empty string"),
])
def test_bad_requests_are_value_errors_before_anything_is_queued(engine, kw, says):
    before = engine.stats()
    with pytest.raises(ValueError, match=re.escape(says)):
        engine.submit(PROMPTS[0], max_new_tokens=4, **kw)
    after = engine.stats()
    assert (after.waiting, after.running, after.steps) == (0, 0, before.steps)


def test_min_tokens_beside_a_grammar(engine, tokenizer):
    """min_tokens (once refused beside structured output) holds the stop tokens back while the grammar allows
    something else, and gives way where it allows only a stop (vLLM's rule: the row rule itself is
    test_sampling's): a choice of one word ends at its word, "stop", below min_tokens; a regular expression of any
    length is held to at least min_tokens tokens before its stop."""
    (word,) = engine.generate([PROMPTS[0]], max_new_tokens=12, structured={"choice": ["yes"]}, min_tokens=8)
    assert (word.text, word.finish_reason, word.token_ids[-1]) == ("yes", "stop", tokenizer.eos_token_id), word
    assert len(word.token_ids) < 8
    for m in (0, 6):
        (r,) = engine.generate([PROMPTS[1]], max_new_tokens=24, structured={"regex": "[a-z]{1,40}"}, min_tokens=m)
        assert re.fullmatch("[a-z]+", r.text) and r.finish_reason == "stop", r
        assert len(r.token_ids) - 1 >= m and r.token_ids[-1] == tokenizer.eos_token_id, r


def test_structured_output_needs_a_tokenizer(model):
    with Engine(model, num_slots=1, max_context=64, compile=False) as bare:
        with pytest.raises(ValueError, match="needs a tokenizer"):
            bare.generate([[1, 2]], max_new_tokens=4, structured={"choice": ["a"]})


@pytest.mark.gpu
def test_graphs_on_cuda_give_the_eager_engine_s_outputs(tokenizer):
    """On CUDA: the mask copied to the device behind the step, in the graph engine, gives the eager engine's
    tokens (greedy, fp32), and every output validates."""
    model = HybridModel.from_preset(tiny_config(vocab_size=len(tokenizer) + PADDING), seed=0, device="cuda",
                                    dtype=torch.float32)
    runs = []
    for compile in (False, True):
        with Engine(model, num_slots=4, max_context=256, compile=compile, tokenizer=tokenizer) as gpu:
            runs.append(gpu.generate(PROMPTS, max_new_tokens=60, structured={"json": SCHEMA}))
    assert [r.token_ids for r in runs[1]] == [r.token_ids for r in runs[0]]
    _valid_pets(runs[1])


# benchmarks/bench_structured.py (on the CPU, tiny sizes: the arithmetic and the report, not the figures) ------------------
@pytest.mark.parametrize("library", ["xgrammar", "llguidance"])
def test_bench_structured_times_the_mask_fill(tokenizer, capsys, library):
    pytest.importorskip(library)
    bench_structured = benchmark_script("bench_structured")

    bench_structured.main(["--masks-only", "--tokenizer", tokenizer.name_or_path, "--streams", "6", "--repeat", "1",
                           "--library", library])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (record["library"], record["vocab_size"]) == (library, len(tokenizer))
    assert [r["case"] for r in record["results"]] == ["object", "tool calls", "any object", "mixed"]
    assert all(0 < r["median"] <= r["p90"] <= r["max"] for r in record["results"])


def test_bench_structured_times_the_engine_s_steps(tmp_path, capsys):
    bench_structured = benchmark_script("bench_structured")
    from tokenizer_fixture import tiny_checkpoint

    folder = tiny_checkpoint(tmp_path / "ckpt")
    bench_structured.main(["--model", folder, "--eager", "--streams", "3", "--prompt-tokens", "4", "--new-tokens", "6"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["variant"]: r for r in record["results"]}
    assert list(rows) == ["plain", "plain, no overlap", "structured"]
    assert all(r["step_ms"] > 0 for r in rows.values())
    assert rows["plain"]["mask_fill_us_per_token"] is None and rows["structured"]["mask_fill_us_per_token"] > 0
    with pytest.raises(SystemExit) as e:
        bench_structured.main(["--model", "tiny"])
    assert e.value.code == 2 and "--tokenizer" in capsys.readouterr().err


def test_after_shutdown_a_grammar_request_is_refused_as_any_other(model, tokenizer):
    with Engine(model, num_slots=1, max_context=64, compile=False, tokenizer=tokenizer) as engine:
        assert engine.generate(["x"], max_new_tokens=8, structured={"choice": ["a"]})[0].text == "a"
    with pytest.raises(EngineClosedError):
        engine.submit("x", max_new_tokens=4, structured={"choice": ["b"]})

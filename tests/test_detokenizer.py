"""Incremental detokenization with a real byte-level BPE (tests/tokenizer_fixture.py): pieces never
end inside a UTF-8 character and join to the whole text; stop strings are matched across token
boundaries, cut, and nothing after them (nor the start of one) is streamed."""

import pytest

from metrale_graph.detokenizer import REPLACEMENT, IncrementalDetokenizer, StreamingText, check_stop_strings
from tokenizer_fixture import build_tokenizer

TEXTS = ["Hello 🦄 world, 東京は日本の首都です。", "naïve café 👋🌍 ½", "👩‍👩‍👧 emoji joined by ZWJ, 龍 and 𝔘𝔫𝔦",
         "def f(x):\n    return x  # ✓"]
SKIP = {"skip_special_tokens": True}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("tok")))


def _pieces(detok, ids):
    return [detok.add([t]) for t in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_are_whole_characters_and_join_to_the_text(tok, text):
    ids = tok.encode(text)
    assert any(tok.decode([t]).endswith(REPLACEMENT) for t in ids)  # some character spans several tokens
    pieces = _pieces(IncrementalDetokenizer(tok, [], SKIP), ids)
    assert all(REPLACEMENT not in p for p in pieces), pieces
    assert "".join(pieces) == text
    assert pieces.count("") >= 1  # held back while a character was incomplete


def test_prompt_context_and_special_tokens(tok):
    """The window starts in the prompt (its text is not repeated); a skipped special token adds nothing;
    a prompt ending inside a character gives the replacement characters the whole decode gives."""
    prompt, new = tok.encode("Hello world"), tok.encode(" 🦄 東京") + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, prompt, SKIP)
    pieces = _pieces(detok, new) + [detok.flush()]
    assert "".join(pieces) == " 🦄 東京" == tok.decode(new, **SKIP)
    emoji = tok.encode("🦄")
    assert len(emoji) > 1  # pieces of its four UTF-8 bytes
    detok = IncrementalDetokenizer(tok, tok.encode("a") + emoji[:1], SKIP)  # the prompt ends inside 🦄
    pieces = _pieces(detok, emoji[1:] + tok.encode(" ok")) + [detok.flush()]
    assert "".join(pieces) == tok.decode(emoji[1:] + tok.encode(" ok"))


def test_flush_gives_an_incomplete_character_as_the_tokenizer_decodes_it(tok):
    ids = tok.encode("ab🦄")[:-1]  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tok, [], SKIP)
    pieces = _pieces(detok, ids)
    assert "".join(pieces) == "ab" and detok.flush() == tok.decode(ids)[2:] and detok.flush() == ""


def _stream(tok, text, stop, chunk=1):
    ids = tok.encode(text)
    st = StreamingText(tok, [], SKIP, stop)
    pieces, stopped_at = [], None
    for k in range(0, len(ids), chunk):
        piece, stopped = st.add(ids[k:k + chunk], final=k + chunk >= len(ids))
        pieces.append(piece)
        if stopped:
            stopped_at = k + chunk
            break
    return ids, pieces, stopped_at, st


@pytest.mark.parametrize("text, stop", [
    ("The quick brown fox jumps over the lazy dog.", "own fo"),
    ("東京は日本の首都です。北京", "は日本"),
    ("Hello 🦄 world", "🦄 w"),
    ("one\n\ntwo", "\n\n"),
    ("abc###def", ["zzz", "###", "c#"]),  # the earliest match wins: "c#"
])
def test_stop_strings_across_token_boundaries(tok, text, stop):
    stops = check_stop_strings(stop)
    ids, pieces, stopped_at, st = _stream(tok, text, stops)
    cut = min(text.find(s) for s in stops if s in text)
    assert stopped_at is not None and "".join(pieces) == text[:cut] == st.text
    # the stop string spans several tokens, and the request stops at the token that completes it
    first = next(k for k in range(len(ids)) if len(tok.decode(ids[:k + 1])) > cut)
    assert stopped_at - 1 > first
    # (the first token at which it is in the text, but for text held back behind an incomplete character)
    assert st.stop_string in tok.decode(ids[:stopped_at])
    earlier = [tok.decode(ids[:k]) for k in range(stopped_at)]
    assert all(st.stop_string not in t or t.endswith(REPLACEMENT) for t in earlier)
    # nothing of the stop string was streamed before it matched
    sent = ""
    for p in pieces:
        sent += p
        assert len(sent) <= cut


def test_held_back_text_that_is_not_a_stop_string_comes_out(tok):
    ids, pieces, stopped_at, st = _stream(tok, "ab## no stop here", ("###",))
    assert stopped_at is None and "".join(pieces) == "ab## no stop here"
    assert pieces[0] == ""  # the last two characters wait while running: they may start "###"


def test_stop_string_at_the_start_and_after_the_end(tok):
    _, pieces, stopped_at, _ = _stream(tok, "END of it", ("END",))
    assert "".join(pieces) == "" and stopped_at is not None
    st = StreamingText(tok, [], SKIP, ("x",))
    assert st.add(tok.encode("axb"), final=False) == ("a", True) and st.add(tok.encode("c"), final=True) == ("", True)


def test_a_fork_finds_the_stop_string_and_leaves_the_text_as_it_was(tok):
    """StreamingText.fork (speculative/stops.py: where a request stops inside a verify step's kept drafts): the fork
    takes tokens and meets the stop string where the text itself later does; the text is unchanged meanwhile."""
    ids = tok.encode("東京は日本の首都です。")
    st = StreamingText(tok, [], SKIP, ("の首",))
    st.add(ids[:2], final=False)
    before = (st.text, st.sent, st.stop_string)
    fork = st.fork()
    forked = [fork.add([t], final=False) for t in ids[2:]]
    assert (st.text, st.sent, st.stop_string) == before and fork.stop_string == "の首"
    again = [st.add([t], final=False) for t in ids[2:]]
    assert forked == again and any(stopped for _, stopped in again) and fork.text == st.text


@pytest.mark.parametrize("stop, message", [
    (5, "stop must be a string or a list of strings, got int"),
    ([""], "stop strings must be non-empty"),
    (["a", 3], "stop string 3 must be a str, got int"),
    (b"x", "stop must be a string or a list of strings, got bytes"),
])
def test_bad_stop_strings(stop, message):
    with pytest.raises(ValueError, match=message):
        check_stop_strings(stop)
    assert check_stop_strings(None) == () and check_stop_strings("ab") == ("ab",)

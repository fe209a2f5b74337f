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


class Counting:
    """A tokenizer counting its decode calls."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.calls += 1
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("text, stop", [
    ("The quick brown fox jumps over the lazy dog.", ("own fo",)),
    ("東京は日本の首都です。北京", ("は日本",)),
    ("Hello 🦄 world, and more", ("🦄 w", "zz")),
    ("no stop string here at all", ("###",)),
])
@pytest.mark.parametrize("k", [1, 3])
def test_adds_checked_ahead_are_taken_without_decoding_again(tok, text, stop, k):
    """StreamingText.ahead (speculative/stops.py: a verify step's k + 1 tokens checked for a stop string before they
    are delivered, its kept drafts first, then all of them): the text's own adds of the checked tokens give what
    they give without the checks, state for state, and the tokenizer decodes what plain adds decode, no more; a
    check meets the stop string at the token the text's own add does."""
    ids = tok.encode(text)
    plain_tok, ahead_tok = Counting(tok), Counting(tok)
    plain, st = StreamingText(plain_tok, ids[:2], SKIP, stop), StreamingText(ahead_tok, ids[:2], SKIP, stop)
    for j in range(2, len(ids), k + 1):
        step, found = ids[j:j + k + 1], []
        for check in (step[:-1], step):  # (stops.kept_counts, then drafting.catch_up_ending: it goes on)
            ahead = st.ahead()
            found.append(next((i for i, t in enumerate(check) if ahead.add(t)), None))
            ahead.keep()
        assert found[0] in (found[1], None) and (found[0] is not None or found[1] in (len(step) - 1, None))
        for i, t in enumerate(step):
            assert st.add([t], final=False) == plain.add([t], final=False)
            assert (st.text, st.sent, st.stop_string) == (plain.text, plain.sent, plain.stop_string)
            if plain.stop_string is not None:
                assert found[1] == i
                break
        else:
            assert found[1] is None
        if plain.stop_string is not None:
            break
    assert (plain.stop_string is None) == (stop == ("###",))
    assert ahead_tok.calls == plain_tok.calls


@pytest.mark.parametrize("case", ["another token", "final", "two at once", "a check going another way", "past them"])
def test_adds_other_than_the_checked_ones_give_what_they_give_without_them(tok, case):
    ids = tok.encode("Hello 🦄 world, 東京は日本の首都です")
    plain, st = StreamingText(tok, ids[:2], SKIP, ("の首",)), StreamingText(tok, ids[:2], SKIP, ("の首",))
    ahead = st.ahead()
    assert not any(ahead.add(t) for t in ids[2:7])
    ahead.keep()
    adds = {"another token": [[ids[2]], [ids[3]], [ids[8]], [ids[9]]], "final": [[ids[2]], [ids[3]], ids[4:5] + [None]],
            "two at once": [ids[2:4], [ids[4]]], "a check going another way": [[ids[2]], [ids[9]], [ids[10]]],
            "past them": [[t] for t in ids[2:9]]}[case]
    if case == "a check going another way":
        ahead = st.ahead()
        assert not ahead.add(ids[2]) and not ahead.add(ids[9])
        ahead.keep()
    for tokens in adds:
        final = tokens[-1] is None
        tokens = [t for t in tokens if t is not None]
        assert st.add(tokens, final=final) == plain.add(tokens, final=final)
        assert (st.text, st.sent, st.stop_string) == (plain.text, plain.sent, plain.stop_string)
    for t in ids[len(ids) // 2:]:  # (the detokenizer's window too: what follows decodes alike)
        assert st.add([t], final=False) == plain.add([t], final=False)

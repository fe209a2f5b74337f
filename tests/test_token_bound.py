"""server.limits.TokenBound, in-process on real tokenizers: the fewest tokens a text can be is never more
than the tokenizer gives it (texts of every kind: the training text, random Unicode with combining marks,
decomposed Hangul, emoji, special tokens), and it is tight (a text of the longest token repeated is that many
tokens); it reads the text as the tokenizer's normalizer leaves it (under NFC a decomposed text is fewer
bytes than it came: counted as it came, the bound would pass the real count); a tokenizer it cannot read
(not a byte-level BPE) gets no bound."""

import random
import unicodedata

import pytest

from metrale_graph.server.limits import TokenBound
from tokenizer_fixture import CORPUS, SPECIAL_TOKENS, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("tok")))


def _random_text(rng: random.Random, n: int) -> str:
    ranges = [(0x20, 0x7E), (0xC0, 0x17F), (0x300, 0x36F), (0x1100, 0x11FF), (0x3040, 0x30FF), (0x4E00, 0x4FFF),
              (0x1F300, 0x1F64F), (0xAC00, 0xAC40)]
    return "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(n))


def test_the_bound_never_passes_the_token_count_and_is_tight(tokenizer):
    bound = TokenBound(tokenizer)
    longest = max(len(s.encode()) for s in SPECIAL_TOKENS)
    assert bound.bytes_per_token >= longest
    rng = random.Random(0)
    texts = [*CORPUS, " ".join(CORPUS) * 5, "".join(SPECIAL_TOKENS) * 7, unicodedata.normalize("NFD", CORPUS[1]) * 3,
             *(_random_text(rng, rng.randint(1, 400)) for _ in range(200))]
    for text in texts:
        assert bound.fewest_tokens(text) <= len(tokenizer.encode(text)), text
    # a longest token (its text one token again), repeated: exactly that many tokens, and the bound says so
    covered = {i: len(s.encode()) if s in SPECIAL_TOKENS else len(s) for s, i in tokenizer.get_vocab().items()}
    longest = [i for i, n in covered.items() if n == bound.bytes_per_token
               and tokenizer.encode(tokenizer.decode([i])) == [i]]
    text = tokenizer.decode(longest[:1]) * 20
    assert len(tokenizer.encode(text)) == 20 and bound.fewest_tokens(text) == 20, longest
    assert bound.most_characters(20) == 20 * bound.bytes_per_token


def _nfc_tokenizer():
    """A byte-level BPE with Qwen's NFC normalizer, trained on runs of 'é': its longest tokens cover 64 bytes."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(r"\s+", behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                    use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["é" * 64] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_the_bound_reads_the_text_as_the_normalizer_leaves_it():
    tokenizer = _nfc_tokenizer()
    bound = TokenBound(tokenizer)
    text = unicodedata.normalize("NFD", "é" * 640)  # 'e' + U+0301: 3 bytes a letter, 2 once composed
    tokens = len(tokenizer.encode(text))
    assert bound.fewest_tokens(text) == tokens
    assert -(-len(text.encode()) // bound.bytes_per_token) > tokens  # the bytes as they came: past the real count
    rng = random.Random(1)
    for _ in range(100):
        text = unicodedata.normalize(rng.choice(["NFC", "NFD"]), _random_text(rng, rng.randint(1, 300)))
        assert bound.fewest_tokens(text) <= len(tokenizer.encode(text)), text


def test_a_tokenizer_that_is_not_a_byte_level_bpe_gets_no_bound():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # an unknown word of any length is one token
    bound = TokenBound(PreTrainedTokenizerFast(tokenizer_object=tok))
    assert bound.bytes_per_token is None and bound.fewest_tokens("x" * 10_000) == 0
    assert bound.most_characters(10) is None
    assert TokenBound(None).bytes_per_token is None

"""A small real tokenizer for tests: a byte-level BPE (as Qwen's and GPT-2's) trained with the
`tokenizers` library on text with accented letters, CJK and emoji, saved as a transformers
PreTrainedTokenizerFast folder with a chat template; and a tiny checkpoint folder holding it.

    folder = build_tokenizer(tmp_path / "tok")          # AutoTokenizer.from_pretrained(folder) loads it
    folder = tiny_checkpoint(tmp_path / "ckpt")         # HybridModel.from_pretrained(folder): model + tokenizer

Characters the training text does not hold often enough (most emoji, rare CJK) stay split into
their UTF-8 bytes, one token each: what an incremental detokenizer must not stream half of.
"""

from __future__ import annotations

import os

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "Hello world! How are you today? I am fine, thank you. Ça va? Naïve café, résumé, über.",
    "東京は日本の首都です。北京は中国の首都です。今日は良い天気ですね。",
    "Emoji: 👋 🌍 😀 👋🌍 — and a long dash, «quotes», and ½ ¼.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Stop strings end a request: ###, END, \n\n, and the text after them is never sent.",
]


def build_tokenizer(folder, vocab_size: int = 400, repeat: int = 20) -> str:
    """Train the byte-level BPE on CORPUS and save it to `folder` (created); returns the folder path.
    The vocabulary holds the 256 byte tokens, SPECIAL_TOKENS and merges up to `vocab_size` (the
    trainer may stop below it when the text has no more pairs to merge)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * repeat, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(folder, exist_ok=True)
    fast.save_pretrained(str(folder))
    return str(folder)


def tiny_checkpoint(folder, seed: int = 0, **config) -> str:
    """A tiny random model whose vocabulary is the tokenizer's, saved with the tokenizer in `folder`;
    `config` overrides fields of the tiny config (tests/helpers.tiny_config)."""
    from transformers import AutoTokenizer

    from helpers import tiny_config
    from metrale_graph import HybridModel

    build_tokenizer(folder)
    vocab = len(AutoTokenizer.from_pretrained(str(folder)))
    HybridModel.from_preset(tiny_config(vocab_size=vocab, **config), seed=seed).save_pretrained(str(folder))
    return str(folder)

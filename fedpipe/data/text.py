"""Text as token ids (the data contract of fedpipe.data): a tokenizer, a vocabulary of the most frequent
words, and fixed-length encoding. AG News and a user's text column (fedpipe.data.files) share them."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from fedpipe.data import PAD_ID, UNK_ID

TEXT_MAX_LENGTH = 64  # tokens per text; longer texts are cut, shorter padded
TEXT_VOCAB_SIZE = 20_000  # token ids, padding and unknown included: the 19,998 most frequent words

_ENTITY_NUMBER = re.compile(r"&?#(\d+);")  # the files write "&#39;" as "#39;"
_ENTITY_NAMED = re.compile(r"&?(quot|amp|lt|gt|apos);")
_ENTITIES = {"quot": '"', "amp": "&", "lt": "<", "gt": ">", "apos": "'"}
_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")


def tokenize(text: str) -> list[str]:
    """Lower-cased words and numbers (an apostrophe suffix stays: "street's"); punctuation is dropped.

    The AG News files' escapes are undone first: a backslash stands for a line break, and HTML
    entities lost their '&' ("#39;", "quot;")."""
    text = text.replace("\\", " ")
    text = _ENTITY_NUMBER.sub(lambda m: chr(int(m.group(1))) if int(m.group(1)) < 0x110000 else " ", text)
    text = _ENTITY_NAMED.sub(lambda m: _ENTITIES[m.group(1)], text)
    return _WORD.findall(text.lower())


def build_vocabulary(texts: list[list[str]], vocab_size: int) -> dict[str, int]:
    """word -> token id for the vocab_size - 2 most frequent words of `texts` (ties: alphabetical), ids
    from 2 up; PAD_ID (0) and UNK_ID (1) are reserved. Built from the training split only, so nothing
    of the test data shapes the inputs."""
    return rank_words(Counter(word for words in texts for word in words), vocab_size)


def rank_words(counts: Counter[str], vocab_size: int) -> dict[str, int]:
    """`build_vocabulary` from the words' counts (a reader that counts as it goes keeps no list of every word)."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: vocab_size - 2]
    return {word: i + 2 for i, (word, _) in enumerate(ranked)}


def encode(texts: list[list[str]], vocabulary: dict[str, int], length: int) -> np.ndarray:
    """int64 [N, length]: each text's first `length` token ids, right-padded with PAD_ID; words
    outside the vocabulary become UNK_ID."""
    out = np.full((len(texts), length), PAD_ID, dtype=np.int64)
    for i, words in enumerate(texts):
        ids = [vocabulary.get(w, UNK_ID) for w in words[:length]]
        out[i, : len(ids)] = ids
    return out

"""kvscale/token_pieces.py: a text encoded piece by piece, pieces cached, gives exactly the ids of
the whole text, for every tokenizer shape it accepts; any other shape is encoded whole."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from kvscale import model_files
from kvscale.token_pieces import PieceCache, byte_lengths, cut_points, cuts_safely

LLAMA3_WORDS = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_WORDS = LLAMA3_WORDS.replace(r"\p{N}{1,3}", r"\p{N}")
SPECIALS = ["<|bos|>", "<|im_start|>", "<|im_end|>"]
# What random texts are made of: what the word regexes treat differently (letters, case, digits,
# contractions, runs of spaces, tabs and newlines, punctuation, non-ASCII letters, emoji) and
# the special tokens.
ATOMS = [*"abcXYZ", " ", " ", "  ", "\t", "\n", "\r\n", *".,;:!?-_'\"()", "'s", "'T", "'ll", "0", "12", "345",
         "é", "ß", "漢", "🙂", " a", "b ", "hello", " World", *SPECIALS]


def corpus(rng: random.Random, texts: int) -> list[str]:
    return ["".join(rng.choice(ATOMS) for _ in range(rng.randint(0, 400))) for _ in range(texts)]


def trained(pre_tokenizer: pre_tokenizers.PreTokenizer, bos_in_front: bool) -> Tokenizer:
    """A small byte-level BPE trained here, with the special tokens added and, when asked, a
    post-processor putting <|bos|> in front of a text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(random.Random(7), 300) + ["hello world the quick brown fox"] * 50, trainer)
    bos = tokenizer.token_to_id("<|bos|>")
    single = "<|bos|> $A" if bos_in_front else "$A"
    tokenizer.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<|bos|>", bos)])
    return tokenizer


SHAPES = {
    "gpt2-byte-level": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "llama3-split": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_WORDS), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
    "qwen2-split": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_WORDS), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
    "digits-then-byte-level": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
}


def whole(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def piece_cache(tokenizer: Tokenizer, every: int, max_pieces: int = 1000) -> PieceCache:
    prefix = cuts_safely(json.loads(tokenizer.to_str()))
    assert prefix is not None
    added = {token_id: token.content for token_id, token in tokenizer.get_added_tokens_decoder().items()}
    return PieceCache(lambda texts: [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)],
                      prefix, byte_lengths(tokenizer.get_vocab(with_added_tokens=True), added),
                      every=every, max_pieces=max_pieces)


@pytest.mark.parametrize("bos_in_front", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_pieces_encode_to_the_ids_of_the_whole(shape: str, bos_in_front: bool) -> None:
    tokenizer = trained(SHAPES[shape](), bos_in_front)
    cache = piece_cache(tokenizer, every=12)
    rng = random.Random(shape)
    prefixes = corpus(rng, 20)
    cut = 0
    for n in range(600):
        # Half the texts share a prefix with others, as prompts do: their pieces come from the cache.
        text = (rng.choice(prefixes) if n % 2 else "") + corpus(rng, 1)[0]
        cut += bool(cut_points(text, 12))
        for add_special_tokens in (True, False):
            ids = cache.ids(text, add_special_tokens)
            assert ids is None or ids == whole(tokenizer, text, add_special_tokens), (text, add_special_tokens)
    assert cut > 400 and cache.hits > 1000  # the texts were cut, and pieces were found again


@pytest.mark.parametrize("odd", ["", "\x04"])  # a control byte the bundled vocabulary drops
def test_the_bundled_tokenizer_is_cut_and_a_shared_prefix_is_encoded_once(odd: str) -> None:
    tokenizer = model_files.load_tokenizer(model_files.resolve_tokenizer_path(None))
    assert tokenizer.pieces is not None
    backend = tokenizer.backend_tokenizer
    rng = random.Random(0)
    prefix = " ".join(rng.choice(["the", "report", "says", "revenue", "grew", "in", "March", odd])
                      for _ in range(300))
    texts = [prefix + f" Question {n}: what next?" for n in range(3)]
    cuts = len(cut_points(texts[0]))
    # Met once: encoded whole. Met again: kept. After: found.
    expected = [(0, 0, 1), (0, cuts, 0), (cuts, 0, 0)]
    for text, (hits, kept, unseen) in zip(texts, expected, strict=True):
        before = (tokenizer.pieces.hits, tokenizer.pieces.misses, tokenizer.pieces.unseen)
        assert tokenizer(text)["input_ids"] == backend.encode(text).ids
        after = (tokenizer.pieces.hits, tokenizer.pieces.misses, tokenizer.pieces.unseen)
        assert tuple(a - b for a, b in zip(after, before, strict=True)) == (hits, kept, unseen)


def test_a_short_text_is_encoded_whole() -> None:
    cache = piece_cache(trained(SHAPES["gpt2-byte-level"](), False), every=256)
    assert cache.ids("a short prompt", True) is None and len(cache) == 0


def test_the_pieces_kept_are_bounded() -> None:
    cache = piece_cache(trained(SHAPES["gpt2-byte-level"](), False), every=4, max_pieces=10)
    rng = random.Random(1)
    for _ in range(50):
        cache.ids(" ".join("".join(rng.choices("abcdefgh", k=5)) for _ in range(40)), False)
    assert len(cache) == 10


def test_the_characters_kept_are_bounded_however_long_a_piece() -> None:
    """Long stretches without a space between letters make long pieces: the characters kept stay
    under the bound, whatever the count of pieces."""
    tokenizer = trained(SHAPES["gpt2-byte-level"](), False)
    cache = piece_cache(tokenizer, every=4, max_pieces=1000)
    cache.max_chars = 5000
    rng = random.Random(2)
    for _ in range(40):
        text = " ".join("ab" + "1" * rng.randint(500, 900) + "c" for _ in range(6))
        for _ in range(2):  # kept on the second sighting
            assert cache.ids(text, False) in (None, whole(tokenizer, text, False))
    assert 0 < cache.chars <= 5000 and len(cache) < 20
    assert cache.chars == sum(len(piece) for piece in cache._pieces)


def with_normalizer() -> dict:
    tokenizer = trained(SHAPES["gpt2-byte-level"](), False)
    tokenizer.normalizer = normalizers.Lowercase()
    return json.loads(tokenizer.to_str())


def with_added(token: str | AddedToken) -> dict:
    tokenizer = trained(SHAPES["gpt2-byte-level"](), False)
    tokenizer.add_special_tokens([token])
    return json.loads(tokenizer.to_str())


def with_special_after_the_text() -> dict:
    tokenizer = trained(SHAPES["gpt2-byte-level"](), False)
    eos = tokenizer.token_to_id("<|im_end|>")
    tokenizer.post_processor = processors.TemplateProcessing(single="$A <|im_end|>",
                                                             special_tokens=[("<|im_end|>", eos)])
    return json.loads(tokenizer.to_str())


def with_model(change: dict) -> dict:
    data = json.loads(trained(SHAPES["gpt2-byte-level"](), False).to_str())
    data["model"].update(change)
    return data


def pre_tokenized(pre_tokenizer: pre_tokenizers.PreTokenizer) -> dict:
    return json.loads(trained(pre_tokenizer, False).to_str())


# Tokenizers each differing from an accepted one in one way that could change the ids.
REFUSED = {
    "normalizer": with_normalizer,
    "prefix-space": lambda: pre_tokenized(pre_tokenizers.ByteLevel(add_prefix_space=True)),
    "metaspace": lambda: pre_tokenized(pre_tokenizers.Metaspace()),
    "no-word-regex": lambda: pre_tokenized(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)),
    "unknown-split": lambda: pre_tokenized(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\w+| "), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])),
    "whitespace-split": lambda: pre_tokenized(pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])),
    "added-token-with-a-space": lambda: with_added("<a b>"),
    "added-token-stripping-right": lambda: with_added(AddedToken("<mask>", rstrip=True)),
    "special-after-the-text": with_special_after_the_text,
    "bpe-dropout": lambda: with_model({"dropout": 0.1}),
    "word-piece": lambda: with_model({"type": "WordPiece"}),
}


@pytest.mark.parametrize("name", REFUSED)
def test_any_other_tokenizer_is_encoded_whole(name: str) -> None:
    assert cuts_safely(REFUSED[name]()) is None


def test_cuts_fall_between_ascii_letters_only() -> None:
    text = "word " * 10 + "1 2 3 " * 10 + "é ü " * 10 + "end of it"
    for at in cut_points(text, 8):
        assert text[at] == " " and text[at - 1].isascii() and text[at - 1].isalpha()
        assert text[at + 1].isascii() and text[at + 1].isalpha()
    assert cut_points("no_spaces_at_all_" * 40, 8) == []

"""Shipped text, tokenizers, batch sampling and the synthetic tasks."""

import pytest
import torch

from companion.tasks.text import (
    CharTokenizer,
    load_bpe,
    load_shakespeare,
    sample_windows,
    split_tokens,
    train_bpe,
)


def test_shakespeare_is_about_a_megabyte_of_ascii():
    text = load_shakespeare()
    assert 1_000_000 < len(text) < 1_100_000
    assert "To be, or not to be" in text
    assert text.isascii()


def test_char_tokenizer_round_trip_and_unknown():
    tok = CharTokenizer("hello world")
    assert tok.decode(tok.encode("low rod")) == "low rod"
    assert tok.vocab_size == 8
    with pytest.raises(ValueError, match=r"characters \['z'\]"):
        tok.encode("zoo")


def test_shipped_bpe_round_trips_and_compresses():
    bpe = load_bpe()
    assert bpe.vocab_size == 2048
    text = load_shakespeare()[:20000]
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert len(ids) < 0.45 * len(text)


def test_shipped_bpe_is_what_the_training_command_produces():
    retrained = train_bpe(load_shakespeare())
    sample = "Now is the winter of our discontent"
    assert retrained.encode(sample) == load_bpe().encode(sample)
    assert retrained._tok.to_str() == load_bpe()._tok.to_str()


def test_sample_windows_are_shifted_by_one():
    ids = torch.arange(100)
    x, y = sample_windows(ids, 4, 10, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 10)
    assert torch.equal(y, x + 1)
    with pytest.raises(ValueError, match="need more than seq_len=100"):
        sample_windows(ids, 1, 100)


def test_split_tokens():
    train_ids, val_ids = split_tokens(torch.arange(10), 0.2)
    assert len(train_ids) == 8 and len(val_ids) == 2
    with pytest.raises(ValueError, match="val_fraction"):
        split_tokens(torch.arange(10), 1.5)

"""The digits → words task: the words, the vocabulary, batches, held-out numbers, scoring."""

import pytest
import torch

from companion.tasks.synthetic import IGNORE
from companion.tasks.translation import (
    BOS,
    EOS,
    PAD,
    NumberTranslation,
    NumberVocab,
    aligned_words,
    number_to_words,
)


@pytest.fixture(scope="module")
def task() -> NumberTranslation:
    return NumberTranslation(max_digits=6, test_fraction=0.1, seed=0)


@pytest.mark.parametrize(
    "n, words",
    [
        (0, "zero"),
        (7, "seven"),
        (13, "thirteen"),
        (40, "forty"),
        (42, "forty two"),
        (105, "one hundred and five"),
        (110, "one hundred and ten"),
        (2005, "two thousand and five"),
        (40302, "forty thousand three hundred and two"),
        (100000, "one hundred thousand"),
        (110011, "one hundred and ten thousand and eleven"),
        (999999, "nine hundred and ninety nine thousand nine hundred and ninety nine"),
    ],
)
def test_number_to_words(n, words):
    assert " ".join(number_to_words(n)) == words


@pytest.mark.parametrize("bad", [-1, 1_000_000, 3.0, True, "12"])
def test_number_to_words_rejects_what_it_cannot_say(bad):
    with pytest.raises(ValueError, match="n must be an integer"):
        number_to_words(bad)


def test_each_number_word_points_at_the_digits_it_translates():
    ones = "zero one two three four five six seven eight nine".split()
    tens = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
    teens = "ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen"
    g = torch.Generator().manual_seed(0)
    for n in [
        0,
        7,
        10,
        19,
        20,
        705,
        2005,
        40302,
        110011,
        718245,
        999999,
        100000,
    ] + torch.randint(0, 1_000_000, (300,), generator=g).tolist():
        digits = str(n)
        for word, at in aligned_words(n):
            read = "".join(digits[i] for i in at)
            if word in ones:
                assert read == str(ones.index(word))
            elif word in tens:
                assert read == str(tens.index(word))
            elif word in teens.split():
                assert read == str(10 + teens.split().index(word))
            else:
                assert word in ("hundred", "thousand", "and") and at == ()
        # every nonzero digit is read by exactly one word
        read_at = sorted(i for _, at in aligned_words(n) for i in at)
        assert read_at == sorted(set(read_at))
        assert {i for i, c in enumerate(digits) if c != "0"} <= set(read_at)


def test_vocab_roundtrip_and_special_ids():
    vocab = NumberVocab()
    assert vocab.vocab_size == 3 + 10 + 31
    assert (vocab.tokens[PAD], vocab.tokens[BOS], vocab.tokens[EOS]) == (
        "<pad>",
        "<bos>",
        "<eos>",
    )
    assert len(set(vocab.tokens)) == vocab.vocab_size
    for n in (0, 19, 70, 4007, 123456):
        assert vocab.decode(vocab.source_ids(n)) == str(n)
        assert vocab.decode(vocab.target_ids(n)) == " ".join(number_to_words(n))
        assert vocab.target_ids(n)[-1] == EOS
    assert vocab.decode([BOS, *vocab.target_ids(12), 5, 6]) == "twelve"  # stops at EOS
    with pytest.raises(ValueError, match=r"ids must lie in \[0, vocab_size=44\)"):
        vocab.decode([99])


def test_batch_is_padded_and_shifted_for_teacher_forcing(task):
    b = task.batch([7, 40302, 2005])
    assert b.src.shape == (3, 5) and b.src_mask.shape == (3, 5)
    assert b.src_mask.tolist()[0] == [True, False, False, False, False]
    assert (b.src[~b.src_mask] == PAD).all()
    t = b.tgt_in.shape[1]
    assert t == len(number_to_words(40302)) + 1 and b.tgt_out.shape == (3, t)
    assert (b.tgt_in[:, 0] == BOS).all()
    real = b.tgt_mask
    # the decoder reads token t and must predict token t + 1
    assert torch.equal(b.tgt_in[:, 1:][real[:, 1:]], b.tgt_out[:, :-1][real[:, 1:]])
    assert (b.tgt_out[~real] == IGNORE).all() and (b.tgt_in[~real] == PAD).all()
    assert b.tgt_out[0].tolist()[:2] == [task.vocab.stoi["seven"], EOS]
    assert b.numbers.tolist() == [7, 40302, 2005]


def test_training_batches_are_seeded(task):
    a = task.train_batch(32, torch.Generator().manual_seed(5))
    b = task.train_batch(32, torch.Generator().manual_seed(5))
    c = task.train_batch(32, torch.Generator().manual_seed(6))
    assert torch.equal(a.src, b.src) and torch.equal(a.tgt_out, b.tgt_out)
    assert not torch.equal(a.numbers, c.numbers)
    assert torch.equal(
        NumberTranslation(seed=3).held_out, NumberTranslation(seed=3).held_out
    ) and not torch.equal(NumberTranslation(seed=3).held_out, task.held_out)


def test_training_never_sees_a_test_number(task):
    nums = task.sample_numbers(20_000, torch.Generator().manual_seed(0))
    assert not task.held_out[nums].any()
    lengths = torch.tensor([len(str(int(n))) for n in nums])
    assert set(lengths.tolist()) == set(range(1, 7))  # every length is drawn
    test = task.test_numbers(100)
    assert (
        len(test) == 1 + 9 + 90 + 3 * 100
    )  # ~10% of 1-, 2-, 3-digit numbers are held out
    assert task.held_out[test].all() and len(set(test.tolist())) == len(test)
    assert not set(test.tolist()) & set(nums.tolist())
    assert {len(str(int(n))) for n in test} == set(range(1, 7))
    assert 0.09 < task.held_out.float().mean() < 0.11
    assert torch.equal(test, task.test_numbers(100))  # the test set is fixed


def test_max_lengths(task):
    assert task.max_target_len == 12  # e.g. 777,777: 11 words and EOS
    small = NumberTranslation(max_digits=3)
    assert small.max_target_len == 6 and small.max_number == 999


def test_exact_match(task):
    nums = [5, 40302, 2005]
    b = task.batch(nums)
    refs = torch.where(b.tgt_out == IGNORE, PAD, b.tgt_out)
    assert task.exact_match(refs, nums).all()
    wrong = refs.clone()
    wrong[1, 2] = task.vocab.stoi["four"]
    assert task.exact_match(wrong, nums).tolist() == [True, False, True]
    no_eos = refs.clone()
    no_eos[0, 1] = task.vocab.stoi["five"]  # "five five ..." never ends
    assert not task.exact_match(no_eos, nums)[0]
    after = torch.cat([refs, torch.full((3, 2), 7)], dim=1)  # junk after EOS is ignored
    assert task.exact_match(after, nums).all()


def test_errors(task):
    with pytest.raises(ValueError, match="max_digits"):
        NumberTranslation(max_digits=7)
    with pytest.raises(ValueError, match="max_digits"):
        NumberTranslation(max_digits=0)
    with pytest.raises(ValueError, match="test_fraction"):
        NumberTranslation(test_fraction=1.0)
    with pytest.raises(ValueError, match="numbers must lie"):
        task.batch([1_000_000])
    with pytest.raises(ValueError, match="must not be empty"):
        task.batch([])
    with pytest.raises(ValueError, match="count"):
        task.sample_numbers(0)
    with pytest.raises(ValueError, match="per_length"):
        task.test_numbers(0)
    with pytest.raises(ValueError, match="predictions must have shape"):
        task.exact_match(torch.zeros(2, 3, dtype=torch.long), [1, 2, 3])

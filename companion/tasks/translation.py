"""A small translation task with real structure: digits to English words (chapter 03).

Shape legend: B batch, S source tokens, T target tokens. ``"40302"`` → ``"forty thousand
three hundred and two"``. The source is a digit string, the target a sequence of number
words (British "and"); both use one shared vocabulary, as the 2017 model shares one BPE
vocabulary between English and German. The output is longer than the input and what a
digit becomes depends on where it stands ("4" is "forty" in the tens place, "four" in
the units, part of "fourteen" before a "4" in the teens), so a model has to read the
whole number, count places and align.

A fixed, seeded set of numbers is held out: training batches never contain them, and the
test set is drawn only from them, so exact match on the test set measures generalisation
to numbers never seen in training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from companion.checks import check_id_list, check_int
from companion.tasks.synthetic import IGNORE

__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "NumberTranslation",
    "NumberVocab",
    "TranslationBatch",
    "aligned_words",
    "number_to_words",
]

PAD, BOS, EOS = 0, 1, 2

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
).split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()


Aligned = list[
    tuple[str, tuple[int, ...]]
]  # (word, indices of the digits it translates)


def _below_100(n: int, tens_at: int) -> Aligned:
    units_at = tens_at + 1  # tens_at: where the tens digit stands in the source string
    if n < 10:
        return [(_ONES[n], (units_at,))]
    if n < 20:
        return [(_ONES[n], (tens_at, units_at))]  # a teen reads two digits
    return [(_TENS[n // 10 - 2], (tens_at,))] + (
        [(_ONES[n % 10], (units_at,))] if n % 10 else []
    )


def _below_1000(n: int, hundreds_at: int) -> Aligned:
    hundreds, rest = divmod(n, 100)
    if hundreds == 0:
        return _below_100(rest, hundreds_at + 1)
    head = [(_ONES[hundreds], (hundreds_at,)), ("hundred", ())]
    return head + ([("and", ()), *_below_100(rest, hundreds_at + 1)] if rest else [])


def aligned_words(n: int) -> Aligned:
    """The words of ``n``, each with the positions of the source digits it translates.

    Number words point at their digits (a teen at two); ``hundred``, ``thousand`` and
    ``and`` point at none. 718245 → ``seven`` (0,), ``hundred`` (), ``and`` (),
    ``eighteen`` (1, 2), ``thousand`` (), ... ``five`` (5,).
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 999_999:
        raise ValueError(f"n must be an integer in [0, 999999], got {n!r}")
    length = len(str(n))
    if n < 1000:
        return _below_1000(n, length - 3)
    thousands, rest = divmod(n, 1000)
    if rest == 0:
        tail: Aligned = []
    elif rest < 100:
        tail = [("and", ()), *_below_100(rest, length - 2)]
    else:
        tail = _below_1000(rest, length - 3)
    return [*_below_1000(thousands, length - 6), ("thousand", ()), *tail]


def number_to_words(n: int) -> list[str]:
    """English words for ``0 <= n <= 999_999``: 2005 → ``two thousand and five``."""
    return [word for word, _ in aligned_words(n)]


class NumberVocab:
    """One vocabulary for both sides: PAD, BOS, EOS, the ten digits, then the 31
    words."""

    def __init__(self) -> None:
        self.tokens = ["<pad>", "<bos>", "<eos>", *"0123456789", *_ONES, *_TENS]
        self.tokens += ["hundred", "thousand", "and"]
        self.stoi = {t: i for i, t in enumerate(self.tokens)}

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def source_ids(self, n: int) -> list[int]:
        """The digits of ``n``, one id each (no BOS/EOS)."""
        return [self.stoi[c] for c in str(n)]

    def target_ids(self, n: int) -> list[int]:
        """The words of ``n`` followed by EOS."""
        return [self.stoi[w] for w in number_to_words(n)] + [EOS]

    def decode(self, ids: list[int] | Tensor) -> str:
        """Tokens up to the first EOS, without PAD/BOS, joined by spaces (digits
        glued)."""
        out: list[str] = []
        for i in check_id_list("ids", ids, self.vocab_size):
            if i == EOS:
                break
            if i in (PAD, BOS):
                continue
            out.append(self.tokens[i])
        glue = "" if out and all(t.isdigit() for t in out) else " "
        return glue.join(out)


@dataclass
class TranslationBatch:
    """One padded batch, ready for teacher forcing.

    ``src (B, S)`` digits padded with PAD; ``src_mask (B, S)`` True on real tokens;
    ``tgt_in (B, T)`` BOS + words (the decoder's input); ``tgt_out (B, T)`` words + EOS,
    with IGNORE (-100) on padding (the loss's targets); ``tgt_mask (B, T)`` True on real
    tokens; ``numbers (B,)`` the integers themselves.
    """

    src: Tensor
    src_mask: Tensor
    tgt_in: Tensor
    tgt_out: Tensor
    tgt_mask: Tensor
    numbers: Tensor

    def to(self, device: torch.device | str) -> TranslationBatch:
        return TranslationBatch(
            *(getattr(self, f).to(device) for f in self.__dataclass_fields__)
        )


class NumberTranslation:
    """Digits → words for numbers below ``10 ** max_digits``, with held-out test
    numbers.

    Numbers are drawn by first picking a length (1 to ``max_digits`` digits, uniformly)
    then a number of that length, so short numbers are not drowned out by long ones. A
    seeded fraction ``test_fraction`` of all numbers is held out of training.
    """

    def __init__(
        self, max_digits: int = 6, test_fraction: float = 0.1, seed: int = 0
    ) -> None:
        check_int("max_digits", max_digits, 1)
        if max_digits > 6:
            raise ValueError(
                f"max_digits must be an integer in [1, 6], got {max_digits!r}"
            )
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
        self.vocab = NumberVocab()
        self.max_digits = max_digits
        self.max_number = 10**max_digits - 1
        g = torch.Generator().manual_seed(seed)
        self.held_out = (
            torch.rand(self.max_number + 1, generator=g) < test_fraction
        )  # (N,)

    @property
    def max_target_len(self) -> int:
        """Longest word sequence plus EOS (e.g. 777,777 takes 11 words)."""
        return max(len(number_to_words(n)) for n in self._longest_candidates()) + 1

    def _longest_candidates(self) -> list[int]:
        return [int(str(d) * self.max_digits) for d in range(1, 10)]

    def _draw(self, count: int, generator: torch.Generator | None) -> Tensor:
        length = torch.randint(1, self.max_digits + 1, (count,), generator=generator)
        low = torch.where(length == 1, 0, 10 ** (length - 1))
        high = 10**length  # exclusive
        u = torch.rand(count, generator=generator, dtype=torch.float64)
        return (low + (u * (high - low)).long()).clamp(max=self.max_number)  # (count,)

    def sample_numbers(
        self, count: int, generator: torch.Generator | None = None
    ) -> Tensor:
        """``count`` training numbers (never a held-out one)."""
        check_int("count", count, 1)
        out = self._draw(count, generator)
        bad = self.held_out[out]
        while bad.any():  # resample the held-out draws until none is left
            out[bad] = self._draw(int(bad.sum()), generator)
            bad = self.held_out[out]
        return out

    def test_numbers(self, per_length: int, seed: int = 1) -> Tensor:
        """Sorted held-out numbers: ``per_length`` of each length (all, where fewer
        exist).

        With 6 digits and ``per_length=100``: 1 + 9 + 90 + 100 + 100 + 100 = 400 numbers
        (about a tenth of the 1- to 3-digit numbers are held out).
        """
        check_int("per_length", per_length, 1)
        g = torch.Generator().manual_seed(seed)
        picked = []
        for length in range(1, self.max_digits + 1):
            low = 0 if length == 1 else 10 ** (length - 1)
            pool = torch.nonzero(self.held_out[low : 10**length]).squeeze(1) + low
            picked.append(pool[torch.randperm(len(pool), generator=g)[:per_length]])
        return torch.cat(picked).sort().values

    def batch(self, numbers: Tensor | list[int]) -> TranslationBatch:
        """Pad the source and target of ``numbers`` into a :class:`TranslationBatch`."""
        nums = [int(n) for n in numbers]
        if not nums:
            raise ValueError("numbers must not be empty")
        if min(nums) < 0 or max(nums) > self.max_number:
            raise ValueError(f"numbers must lie in [0, {self.max_number}], got {nums}")
        srcs = [self.vocab.source_ids(n) for n in nums]
        tgts = [self.vocab.target_ids(n) for n in nums]
        s, t = max(map(len, srcs)), max(map(len, tgts))
        # pad as Python lists and build each tensor once (much faster than row by row)
        src = torch.tensor([a + [PAD] * (s - len(a)) for a in srcs])  # (B, S)
        tgt_in = torch.tensor(
            [[BOS, *b[:-1]] + [PAD] * (t - len(b)) for b in tgts]
        )  # (B, T)
        tgt_out = torch.tensor([b + [IGNORE] * (t - len(b)) for b in tgts])  # (B, T)
        return TranslationBatch(
            src, src != PAD, tgt_in, tgt_out, tgt_out != IGNORE, torch.tensor(nums)
        )

    def train_batch(
        self, batch_size: int, generator: torch.Generator | None = None
    ) -> TranslationBatch:
        """A batch of ``batch_size`` random training numbers."""
        return self.batch(self.sample_numbers(batch_size, generator))

    def exact_match(self, predictions: Tensor, numbers: Tensor | list[int]) -> Tensor:
        """Per row, True iff ``predictions (B, L)`` reads the reference words then EOS.

        Tokens after the first EOS are ignored; a row without EOS is wrong.
        """
        if predictions.ndim != 2 or predictions.shape[0] != len(numbers):
            raise ValueError(
                f"predictions must have shape (B={len(numbers)}, L), got {tuple(predictions.shape)}"
            )
        out = []
        for row, n in zip(predictions.tolist(), [int(n) for n in numbers], strict=True):
            ref = self.vocab.target_ids(n)
            out.append(row[: len(ref)] == ref)
        return torch.tensor(out)

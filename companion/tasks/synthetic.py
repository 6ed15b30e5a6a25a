"""Synthetic sequence tasks with known answers (chapters 01 and 05; tested from the
start).

Each function returns ``(x, y)`` with ``x (B, T)`` inputs and ``y (B, T)`` targets,
where ``y == IGNORE`` marks positions that are not scored (pass ``ignore_index=IGNORE``
to the loss).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["IGNORE", "associative_recall", "copy_task"]

IGNORE = -100


def copy_task(
    batch_size: int,
    length: int,
    vocab_size: int,
    delay: int = 0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Copy ``length`` random symbols after a separator and ``delay`` blanks.

    Vocabulary: symbols ``2 .. vocab_size - 1``, blank ``0``, separator ``1``. The input
    is ``symbols, SEP, blanks(delay), symbols[:-1]`` (teacher forcing); the targets
    score only the copied part. Shapes ``(B, 2·length + delay)``.
    """
    if vocab_size < 3:
        raise ValueError(
            f"vocab_size must be >= 3 (blank, separator, a symbol), got {vocab_size}"
        )
    if length < 1 or delay < 0:
        raise ValueError(
            f"need length >= 1 and delay >= 0, got length={length}, delay={delay}"
        )
    sym = torch.randint(2, vocab_size, (batch_size, length), generator=generator)
    sep = torch.ones(batch_size, 1, dtype=torch.long)
    blank = torch.zeros(batch_size, delay, dtype=torch.long)
    x = torch.cat([sym, sep, blank, sym[:, :-1]], dim=1)  # (B, 2L + delay)
    y = torch.full_like(x, IGNORE)
    y[:, length + delay :] = sym  # position length+delay predicts sym[0], and so on
    return x, y


def associative_recall(
    batch_size: int,
    n_pairs: int,
    n_keys: int,
    n_values: int,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Key-value pairs, then one of the keys again: predict its value.

    Keys are ids ``0 .. n_keys - 1`` (distinct within a sequence), values ``n_keys ..
    n_keys + n_values - 1``. ``x = k1 v1 k2 v2 ... kn vn q`` (length 2n + 1); only the
    last position is scored, its target the value paired with ``q``.
    """
    if n_pairs > n_keys:
        raise ValueError(
            f"n_pairs ({n_pairs}) must be <= n_keys ({n_keys}): keys are distinct"
        )
    keys = torch.rand(batch_size, n_keys, generator=generator).argsort(dim=1)[
        :, :n_pairs
    ]
    values = torch.randint(
        n_keys, n_keys + n_values, (batch_size, n_pairs), generator=generator
    )
    pick = torch.randint(0, n_pairs, (batch_size,), generator=generator)
    rows = torch.arange(batch_size)
    pairs = torch.stack([keys, values], dim=2).reshape(batch_size, 2 * n_pairs)
    x = torch.cat([pairs, keys[rows, pick][:, None]], dim=1)  # (B, 2n + 1)
    y = torch.full_like(x, IGNORE)
    y[:, -1] = values[rows, pick]
    return x, y

"""Probe tasks: small synthetic tasks, each built so that one capability decides it
(chapters 05, 09, 10, 11, 14).

A loss on text mixes every capability a model has; at the book's sizes the differences
between variants are mostly convergence speed. A probe isolates one thing:

* :func:`mqar`: multi-query associative recall (Arora et al., 2023, *Zoology*): ``n``
  key-value pairs, then the keys again in a new order; every value must be recalled.
  The pairs must all be held at once, so it measures a token mixer's memory.
* :func:`needle`: one marked token ``distance`` positions back, to be named at the end.
  It measures reach: a stack of ``L`` sliding layers of window ``w`` cannot see past
  ``L(w − 1)`` tokens back, whatever it learns.
* :func:`induction_copy`: a random segment repeated to the end (copying by induction),
  the length-generalisation probe: train short, score at lengths never seen.
* :func:`memorisation`: a fixed random table from two-token keys to values, to be
  learned by heart. It measures parameter capacity (dense against MoE).

Every function returns ``(x, y)``, ``x (B, T)`` token ids and ``y (B, T)`` targets with
``IGNORE`` (-100, from :mod:`companion.tasks.synthetic`) where a position is not scored.
Scored positions have exactly one right answer, so chance is ``1 / (number of
answers)``.
:func:`fit` trains any ``(B, T) → (B, T, V)`` model on a task and :func:`accuracy`
scores it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from companion.checks import check_int, check_positive
from companion.tasks.induction import repeated_segments
from companion.tasks.synthetic import IGNORE
from companion.training import cosine_lr, make_adamw, train

__all__ = [
    "accuracy",
    "fit",
    "induction_copy",
    "memorisation",
    "memorisation_table",
    "mqar",
    "mqar_vocab",
    "needle",
    "needle_vocab",
    "position_accuracy",
    "scored_loss",
]

Batch = tuple[Tensor, Tensor]


def _positive(**values: int) -> None:
    for name, x in values.items():
        check_int(name, x, 1)


def mqar_vocab(n_keys: int, n_values: int) -> int:
    """Vocabulary of :func:`mqar`: keys ``0 .. n_keys − 1``, then the values."""
    return n_keys + n_values


def mqar(
    batch_size: int,
    n_pairs: int,
    n_keys: int,
    n_values: int,
    generator: torch.Generator | None = None,
) -> Batch:
    """``n_pairs`` pairs ``k v``, then every key again in a shuffled order, each
    followed by its value (teacher forcing): ``x = k₁ v₁ … kₙ vₙ q₁ a₁ … qₙ aₙ``,
    length ``4n``.

    Keys are distinct within a sequence; values are drawn with replacement. Each query
    position is scored on its value, so one sequence asks ``n`` questions.
    """
    _positive(batch_size=batch_size, n_pairs=n_pairs, n_keys=n_keys, n_values=n_values)
    if n_pairs > n_keys:
        raise ValueError(f"n_pairs ({n_pairs}) must be <= n_keys ({n_keys})")
    b, n = batch_size, n_pairs
    keys = torch.rand(b, n_keys, generator=generator).argsort(dim=1)[:, :n]
    values = torch.randint(n_keys, n_keys + n_values, (b, n), generator=generator)
    order = torch.rand(b, n, generator=generator).argsort(dim=1)
    q, a = keys.gather(1, order), values.gather(1, order)
    context = torch.stack([keys, values], dim=2).reshape(b, 2 * n)
    queries = torch.stack([q, a], dim=2).reshape(b, 2 * n)
    x = torch.cat([context, queries], dim=1)  # (B, 4n)
    y = torch.full_like(x, IGNORE)
    y[:, 2 * n :: 2] = a  # query position 2n + 2i predicts its value a_i
    return x, y


def needle_vocab(n_needles: int, n_filler: int) -> int:
    """Vocabulary of :func:`needle`: the needles, the filler, then one query token."""
    return n_needles + n_filler + 1


def needle(
    batch_size: int,
    seq_len: int,
    distance: int | tuple[int, int],
    n_needles: int,
    n_filler: int,
    generator: torch.Generator | None = None,
) -> Batch:
    """Filler tokens with one needle ``distance`` positions before the last token, a
    query; only the query is scored, its target the needle.

    Needles are ids ``0 .. n_needles − 1``, filler the next ``n_filler`` ids, the query
    the last id. ``distance`` is one number or a ``(lo, hi)`` range drawn per sequence
    (inclusive); it must lie in ``1 .. seq_len − 1``. A model whose last position sees
    ``R`` tokens (itself included) can answer only when ``distance ≤ R − 1``.
    """
    _positive(
        batch_size=batch_size, seq_len=seq_len, n_needles=n_needles, n_filler=n_filler
    )
    lo, hi = (distance, distance) if isinstance(distance, int) else distance
    if not 1 <= lo <= hi <= seq_len - 1:
        raise ValueError(
            f"distance must lie in 1 .. seq_len - 1 = {seq_len - 1}, got {distance!r}"
        )
    b = batch_size
    x = torch.randint(
        n_needles, n_needles + n_filler, (b, seq_len), generator=generator
    )
    x[:, -1] = n_needles + n_filler
    d = torch.randint(lo, hi + 1, (b,), generator=generator)
    target = torch.randint(0, n_needles, (b,), generator=generator)
    x[torch.arange(b), seq_len - 1 - d] = target
    y = torch.full_like(x, IGNORE)
    y[:, -1] = target
    return x, y


def induction_copy(
    batch_size: int,
    seq_len: int,
    periods: tuple[int, int],
    vocab_size: int,
    generator: torch.Generator | None = None,
) -> Batch:
    """A random segment of ``P`` tokens repeated to length ``seq_len`` (``P`` drawn per
    sequence from ``periods``); every position after the first segment is scored on the
    next token, which an induction head copies from one period back."""
    _positive(batch_size=batch_size, seq_len=seq_len, vocab_size=vocab_size)
    tokens, p = repeated_segments(
        batch_size, seq_len + 1, periods, vocab_size, generator
    )
    x, y = tokens[:, :-1], tokens[:, 1:].clone()
    first = torch.arange(seq_len)[None, :] < p[:, None] - 1  # target not yet seen
    y[first] = IGNORE
    return x, y


def memorisation_table(
    n_facts: int, base: int, n_values: int, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """A fixed table of ``n_facts`` facts: keys ``(n_facts, 2)``, distinct pairs of
    ids in ``0 .. base − 1``, and values ``(n_facts,)`` in ``base .. base + n_values −
    1``. The table is drawn from its own generator, so ``seed`` names it."""
    _positive(n_facts=n_facts, base=base, n_values=n_values)
    if n_facts > base * base:
        raise ValueError(f"n_facts must be <= base**2 = {base * base}, got {n_facts}")
    g = torch.Generator().manual_seed(seed)
    flat = torch.randperm(base * base, generator=g)[:n_facts]
    keys = torch.stack([flat // base, flat % base], dim=1)
    values = torch.randint(base, base + n_values, (n_facts,), generator=g)
    return keys, values


def memorisation(
    batch_size: int,
    table: tuple[Tensor, Tensor],
    generator: torch.Generator | None = None,
) -> Batch:
    """Facts drawn from ``table`` (:func:`memorisation_table`): ``x = a b`` and the
    value is scored at ``b``. Neither token alone names the fact, so the value must be
    stored in the layers that combine them, not in one embedding row."""
    _positive(batch_size=batch_size)
    keys, values = table
    pick = torch.randint(0, len(values), (batch_size,), generator=generator)
    x = keys[pick]  # (B, 2)
    y = torch.full_like(x, IGNORE)
    y[:, 1] = values[pick]
    return x, y


def scored_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Cross-entropy over the scored positions only (a ``loss_fn`` for
    :func:`~companion.training.train`)."""
    logits = model(x)
    return F.cross_entropy(
        logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE
    )


def fit(
    model: nn.Module,
    task: Callable[[torch.Generator], Batch],
    steps: int,
    lr: float,
    seed: int = 0,
    warmup: int = 0,
    weight_decay: float = 0.0,
    loss_fn: Callable[[nn.Module, Tensor, Tensor], Tensor] = scored_loss,
) -> list[float]:
    """Train ``model`` for ``steps`` AdamW steps on fresh batches ``task(generator)``,
    with a cosine schedule after ``warmup`` steps; returns the loss per step.
    ``loss_fn`` may add terms to the scored loss (an MoE's balancing loss).

    ``seed`` seeds the batches (the model's initialisation is the caller's); the same
    seed gives the same batches to every model, so runs of two variants are paired.
    """
    _positive(steps=steps)
    check_positive("lr", lr)
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)

    def batch(_step: int) -> Batch:
        x, y = task(g)
        return x.to(device), y.to(device)

    hist = train(
        model,
        batch,
        steps,
        make_adamw(model, lr, weight_decay=weight_decay),
        lambda s: cosine_lr(s, lr, warmup, steps, 0.1 * lr),
        loss_fn=loss_fn,
    )
    return hist.loss


@torch.no_grad()
def position_accuracy(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Per position ``(T,)``: the fraction of scored entries predicted right (NaN where
    none is scored); the model is put in eval mode and restored."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        pred = model(x.to(device)).argmax(-1).cpu()
    finally:
        model.train(was_training)
    scored = y != IGNORE
    hits = ((pred == y) & scored).sum(0).double()
    return hits / scored.sum(0).double()  # 0 / 0 -> NaN


def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """The fraction of all scored positions predicted right."""
    per = position_accuracy(model, x, y)
    counts = (y != IGNORE).sum(0).double()
    return float((per.nan_to_num() * counts).sum() / counts.sum())

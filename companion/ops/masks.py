"""Boolean attention masks (chapter 02).

Convention everywhere in ``companion``: a mask is a bool tensor that broadcasts to
``(B, H, T, S)`` (batch, heads, queries, keys) and is ``True`` where a query may attend.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["causal_mask", "combine_masks", "guard_empty_rows", "padding_mask"]


def causal_mask(
    t: int, s: int | None = None, device: torch.device | str | None = None
) -> Tensor:
    """Lower-triangular ``(T, S)`` mask aligned to the *end* of the keys.

    With ``S > T`` (queries that continue a cached prefix) query ``i`` sees keys
    ``j <= i + S - T``; with ``S == T`` this is the usual triangle.
    """
    s = t if s is None else s
    if t < 1 or s < 1:
        raise ValueError(f"causal_mask needs t >= 1 and s >= 1, got t={t}, s={s}")
    if s < t:
        raise ValueError(
            f"causal_mask needs s >= t (keys include the queries), got t={t}, s={s}"
        )
    q = torch.arange(t, device=device).unsqueeze(1) + (s - t)
    k = torch.arange(s, device=device).unsqueeze(0)
    return k <= q


def padding_mask(attention_mask: Tensor) -> Tensor:
    """Turn a ``(B, S)`` 1/0 (or bool) attention mask into a ``(B, 1, 1, S)`` key
    mask."""
    if attention_mask.ndim != 2:
        raise ValueError(
            f"attention_mask must have shape (B, S), got {tuple(attention_mask.shape)}"
        )
    return attention_mask.bool()[:, None, None, :]


def combine_masks(*masks: Tensor | None) -> Tensor | None:
    """Logical AND of the masks that are not None (None if all are)."""
    out: Tensor | None = None
    for m in masks:
        if m is None:
            continue
        out = m if out is None else out & m
    return out


def guard_empty_rows(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Make every query row attend somewhere, and say which rows had no key at all.

    A row with no visible key has no defined softmax. We let it attend everywhere (so
    every backend computes finite numbers) and return ``has_key`` (``(..., T, 1)``) so
    the caller can zero those rows afterwards: fully masked queries output zeros. A
    1-D key mask ``(S,)`` is one row for every query.
    """
    if mask.ndim < 2:
        mask = mask[None]
    has_key = mask.any(dim=-1, keepdim=True)
    return mask | ~has_key, has_key

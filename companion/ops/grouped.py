"""Grouped-query attention: H query heads sharing H_kv key/value heads (chapter 08).

Shape legend: B batch, H query heads, H_kv key/value heads (H a multiple of H_kv),
G = H / H_kv, T queries, S keys, D head width, Dv value width.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from companion.ops.attention import check_qkv
from companion.ops.masks import guard_empty_rows

__all__ = ["expand_kv", "grouped_attention"]


def expand_kv(k: Tensor, n_heads: int) -> Tensor:
    """Repeat each of the H_kv heads H / H_kv times: ``(B, H_kv, S, D) -> (B, H, S,
    D)``."""
    groups = n_heads // k.shape[1]
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def grouped_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """softmax(q kᵀ · scale) v for grouped heads, without repeating K/V.

    The G = H / H_kv query heads that share a K/V head become G·T rows of one product: q
    ``(B, H, T, D)`` is viewed as ``(B, H_kv, G·T, D)``, so each cached key and value is
    read once per K/V head, not once per query head. This is why GQA speeds up decoding,
    where reading the cache is the cost. Query rows with no visible key output zeros,
    as in :func:`companion.ops.attention.naive_attention`.
    """
    check_qkv(q, k, v, mask, grouped=True)
    b, h, t, d = q.shape
    h_kv, s = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rows = q.reshape(b, h_kv, h // h_kv * t, d)  # head h = kv·G + g; row g·T + t
    scores = (rows @ k.transpose(-2, -1) * scale).view(b, h, t, s)
    has_key = None
    if mask is not None:
        mask, has_key = guard_empty_rows(mask)
        scores = scores.masked_fill(~mask, float("-inf"))
    acc = torch.promote_types(scores.dtype, torch.float32)
    weights = torch.softmax(scores.to(acc), dim=-1).to(q.dtype)
    out = (weights.view(b, h_kv, -1, s) @ v).view(b, h, t, v.shape[-1])  # (B, H, T, Dv)
    return out if has_key is None else out * has_key

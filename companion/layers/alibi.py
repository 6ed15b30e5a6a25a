"""ALiBi: attention with linear biases instead of a position signal (chapter 05).

Press et al. add no position vector and rotate nothing: each head h subtracts
``m_h · |i − j|`` from the score of query i and key j, a penalty that grows with the
distance at a fixed slope per head (BLOOM, MPT). The slopes form a geometric sequence,
so some heads look far and others only at their neighbours.

Shape legend: H heads, B batch, T query tokens, S key tokens, D head width (Dv of the
values), H_kv key/value heads. ``q_pos (T,)`` and ``k_pos (S,)`` are the positions of the
queries and of the keys (a cache's slots), so the bias is the same at decode as in a
full pass. The bias is an additive float mask ``(H, T, S)`` or ``(B, H, T, S)``, ``-inf``
where a key is hidden; :func:`biased_attention` runs attention with it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from companion.checks import check_choice
from companion.layers.kv_cache import position_mask
from companion.ops.grouped import expand_kv
from companion.ops.masks import combine_masks

__all__ = ["ALIBI_IMPLS", "alibi_bias", "alibi_slopes", "biased_attention"]

ALIBI_IMPLS = ("reference", "sdpa")  # the forms that take an additive float mask


def alibi_slopes(n_heads: int) -> Tensor:
    """The ``(H,)`` slopes m_h, steepest first.

    For H a power of two, m_h = 2^(-8h/H), h = 1..H. Otherwise the paper's rule (and
    BLOOM's): the slopes of the largest power of two P below H, then every other slope
    of 2P (the odd ones, 2^(-4(2k-1)/P)) until there are H.
    """
    if n_heads < 1:
        raise ValueError(f"n_heads must be >= 1, got {n_heads}")
    p = 2 ** math.floor(math.log2(n_heads))
    slopes = [2 ** (-8 * h / p) for h in range(1, p + 1)]
    slopes += [2 ** (-4 * h / p) for h in range(1, 2 * (n_heads - p), 2)]
    return torch.tensor(slopes)


def alibi_bias(
    slopes: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    mask: Tensor | None = None,
    causal: bool = False,
) -> Tensor:
    """The additive mask ``(H, T, S)`` (or ``(B, H, T, S)`` with a batched ``mask``):
    ``−m_h · |q_pos − k_pos|`` where a key is visible, ``-inf`` where it is hidden by
    ``mask`` (bool, True = attend) or, with ``causal``, by coming after the query."""
    dist = (q_pos[:, None] - k_pos[None, :]).abs().to(slopes.dtype)  # (T, S)
    bias = -slopes[:, None, None] * dist  # (H, T, S)
    visible = combine_masks(mask, position_mask(q_pos, k_pos) if causal else None)
    if visible is None:
        return bias
    return bias.masked_fill(~visible, float("-inf"))


def biased_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor,
    *,
    impl: str = "reference",
    scale: float | None = None,
    dropout_p: float = 0.0,
    weights: bool = False,
) -> Tensor:
    """softmax(q kᵀ · scale + bias) v, ``(B, H, T, Dv)``; with ``weights`` the softmax
    itself, ``(B, H, T, S)``. k and v may have H_kv heads (repeated to H here). Query
    rows with no visible key output zeros. ``impl``: ``"reference"`` writes it out,
    ``"sdpa"`` passes the bias to PyTorch's fused attention as its float mask."""
    check_choice("impl", impl, ALIBI_IMPLS)
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    has_key = torch.isfinite(bias).any(-1, keepdim=True)  # (..., T, 1)
    bias = bias.masked_fill(~has_key, 0.0).to(q.dtype)  # empty rows: finite, then 0
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if impl == "sdpa" and not weights:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, scale=scale, dropout_p=dropout_p
        )
        return out * has_key
    scores = (q @ k.transpose(-2, -1)) * scale + bias  # (B, H, T, S)
    acc = torch.promote_types(scores.dtype, torch.float32)
    w = torch.softmax(scores.to(acc), dim=-1).to(q.dtype) * has_key
    if weights:
        return w
    if dropout_p > 0.0:
        w = F.dropout(w, p=dropout_p)
    return w @ v  # (B, H, T, Dv)

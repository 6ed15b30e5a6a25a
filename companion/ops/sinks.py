"""Attention sinks (gpt-oss, chapter 12): one learned logit per head in the softmax.

``sinks (H,)`` adds exp(sink_h) to head h's softmax denominator, so a head may put
weight on "nothing" and output less than a convex mix of the values. The reference
appends the sink as an extra score column and drops it after the softmax; the SDPA form
gives the same result with one more key that every query sees and whose value is zero
(:func:`sink_as_key`). Shapes as in :mod:`companion.ops.attention`; K/V heads may be
grouped.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from companion.ops.attention import check_qkv, full_mask, masked_scores, sdpa_attention
from companion.ops.grouped import expand_kv

__all__ = [
    "check_sinks",
    "sink_as_key",
    "sink_attention_weights",
    "sink_naive_attention",
    "sink_sdpa_attention",
]


def check_sinks(q: Tensor, sinks: Tensor) -> None:
    """Raise a ValueError unless ``sinks`` has one logit per query head."""
    if sinks.shape != (q.shape[1],):
        raise ValueError(
            f"sinks must have shape (H,) = ({q.shape[1]},), one logit per query head; "
            f"got {tuple(sinks.shape)}"
        )


def sink_attention_weights(
    q: Tensor,
    k: Tensor,
    sinks: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """The ``(B, H, T, S)`` weights with each head's sink in the denominator (rows sum <
    1)."""
    check_sinks(q, sinks)
    scores, has_key = masked_scores(
        q, expand_kv(k, q.shape[1]), mask=mask, causal=causal, scale=scale
    )
    acc = torch.promote_types(scores.dtype, torch.float32)
    b, h, t, _ = scores.shape
    sink = sinks.to(acc).view(1, h, 1, 1).expand(b, h, t, 1)
    weights = torch.softmax(torch.cat([scores.to(acc), sink], dim=-1), dim=-1)
    weights = weights[..., :-1].to(q.dtype)  # the sink's column dropped
    return weights if has_key is None else weights * has_key


def sink_naive_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sinks: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """The reference with sinks: ``sink_attention_weights(...) @ v``, ``(B, H, T,
    Dv)``."""
    check_qkv(q, k, v, mask, grouped=True)
    weights = sink_attention_weights(q, k, sinks, mask=mask, causal=causal, scale=scale)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ expand_kv(v, q.shape[1])


def sink_as_key(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sinks: Tensor,
    mask: Tensor | None,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
    """Rewrite attention with sinks as plain attention over one extra key.

    Every key gains a channel holding 0 and the new last key is ``[0, ..., 0, 1]`` with
    a zero value; each query gains a channel holding ``sink_h / scale``. The new key's
    score is then exactly ``sink_h`` for head h, and its zero value adds nothing to the
    output: only its share of the denominator remains. Returns ``(q', k', v', mask',
    scale)``, the mask with the new key visible to every query (the scale is made
    explicit, since D grew by 1).
    """
    b, h, t, d = q.shape
    h_kv, s = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q_extra = (sinks.to(q.dtype) / scale).view(1, h, 1, 1).expand(b, h, t, 1)
    q2 = torch.cat([q, q_extra], dim=-1)  # (B, H, T, D+1)
    k2 = torch.cat([k, k.new_zeros(b, h_kv, s, 1)], dim=-1)
    sink_key = k.new_zeros(b, h_kv, 1, d + 1)
    sink_key[..., -1] = 1.0
    k2 = torch.cat([k2, sink_key], dim=2)  # (B, H_kv, S+1, D+1)
    v2 = torch.cat([v, v.new_zeros(b, h_kv, 1, v.shape[-1])], dim=2)
    visible = torch.ones(b, h, t, s + 1, dtype=torch.bool, device=q.device)
    if mask is not None:
        visible[..., :s] = mask
    return q2, k2, v2, visible, scale


def sink_sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sinks: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Sinks through SDPA: :func:`sink_as_key`, then plain attention."""
    check_qkv(q, k, v, mask, grouped=True)
    check_sinks(q, sinks)
    q2, k2, v2, visible, scale = sink_as_key(
        q, k, v, sinks, full_mask(q, k, mask, causal), scale
    )
    return sdpa_attention(q2, k2, v2, mask=visible, scale=scale, dropout_p=dropout_p)

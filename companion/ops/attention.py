"""Scaled dot-product attention, the 2017 form: the reference and the SDPA path (chapter
02).

Shape legend: B batch, H heads, T queries, S keys, D query/key width, Dv value width.
Masks are bool, ``True`` where a query may attend, broadcastable to ``(B, H, T, S)``
(see :mod:`companion.ops.masks`). ``causal=True`` aligns the triangle to the end of the
keys, so T new queries after S - T cached keys see the whole prefix.

Every form of attention in :mod:`companion.ops` has this signature, ``(q, k, v, *, mask,
causal, scale, dropout_p) -> out (B, H, T, Dv)``: :func:`naive_attention` (the
reference), :func:`sdpa_attention` (PyTorch's fused kernels),
:func:`companion.ops.tiled.tiled_attention` (online softmax over tiles) and
:func:`companion.ops.flex.flex_attention_forward`. The weights a figure draws come from
:func:`attention_weights`. Later mechanisms wrap these forms in their own modules:
grouped K/V heads in :mod:`companion.ops.grouped`, sinks in :mod:`companion.ops.sinks`;
:func:`companion.ops.dispatch.attention` picks a form by name.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from companion.ops.masks import causal_mask, combine_masks, guard_empty_rows

__all__ = [
    "attention_weights",
    "check_qkv",
    "full_mask",
    "masked_scores",
    "naive_attention",
    "sdpa_attention",
]


def check_qkv(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, grouped: bool = False
) -> None:
    """Raise a ValueError naming the argument whose shape or dtype does not fit.

    ``grouped``: k and v may have fewer heads than q (a divisor of H), as in chapter 08.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have shape (B, H, T, D), got {tuple(x.shape)}"
            )
    heads_fit = q.shape[1] % k.shape[1] == 0 if grouped else q.shape[1] == k.shape[1]
    if q.shape[0] != k.shape[0] or k.shape[:2] != v.shape[:2] or not heads_fit:
        heads = (
            "q's H must be a multiple of H_kv" if grouped else "q, k, v must share H"
        )
        raise ValueError(
            f"q, k, v must share B, k and v must share their heads, and {heads}; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must share D; got q D={q.shape[-1]}, k D={k.shape[-1]}"
        )
    if k.shape[2] != v.shape[2]:
        raise ValueError(
            f"k and v must share S; got k S={k.shape[2]}, v S={v.shape[2]}"
        )
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError(
                f"mask must be a bool tensor (True = attend), got dtype {mask.dtype}"
            )
        target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        # each trailing dimension equal or 1 (torch.broadcast_shapes costs ~40 µs a call)
        shape = (1,) * (4 - mask.ndim) + tuple(mask.shape)
        if len(shape) > 4 or not all(
            m in (1, t) for m, t in zip(shape, target, strict=True)
        ):
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to (B, H, T, S) = {target}"
            )


def full_mask(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool) -> Tensor | None:
    """``mask`` and, if ``causal``, the end-aligned triangle (None if neither)."""
    tri = causal_mask(q.shape[2], k.shape[2], device=q.device) if causal else None
    return combine_masks(mask, tri)


def masked_scores(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The scores q kᵀ · scale ``(B, H, T, S)``, ``-inf`` where a key is hidden, and
    which rows have a visible key at all (``(..., T, 1)``; None without a mask).
    ``scale`` defaults to 1/√D; a row with no visible key keeps finite scores (see
    :func:`companion.ops.masks.guard_empty_rows`)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, S)
    full = full_mask(q, k, mask, causal)
    if full is None:
        return scores, None
    full, has_key = guard_empty_rows(full)
    return scores.masked_fill(~full, float("-inf")), has_key


def attention_weights(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """softmax over the keys of :func:`masked_scores`: ``(B, H, T, S)``, rows summing to
    1 (rows with no visible key are 0). The softmax runs in fp32 for bf16 (fp64
    stays)."""
    scores, has_key = masked_scores(q, k, mask=mask, causal=causal, scale=scale)
    acc = torch.promote_types(scores.dtype, torch.float32)
    weights = torch.softmax(scores.to(acc), dim=-1).to(q.dtype)
    return weights if has_key is None else weights * has_key


def naive_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """softmax(q kᵀ · scale) v, written out: ``(B, H, T, Dv)``.

    q, k and v have the same H heads. Query rows with no visible key output zeros.
    """
    check_qkv(q, k, v, mask)
    weights = attention_weights(q, k, mask=mask, causal=causal, scale=scale)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v  # (B, H, T, Dv)


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """The same function through ``F.scaled_dot_product_attention`` (fused kernels).

    Grouped K/V heads (chapter 08) are passed as they are (``enable_gqa``), never
    repeated in memory.
    """
    check_qkv(q, k, v, mask, grouped=True)
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    if mask is None and (not causal or q.shape[2] == k.shape[2]):
        # SDPA's own is_causal is top-left aligned, which equals ours when T == S.
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, dropout_p=dropout_p, **gqa
        )
    full, has_key = guard_empty_rows(full_mask(q, k, mask, causal))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=full, scale=scale, dropout_p=dropout_p, **gqa
    )
    return out * has_key

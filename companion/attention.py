"""Scaled dot-product attention: the reference and the SDPA path (chapter 02).

Shape legend: B batch, H query heads, H_kv key/value heads (H a multiple of H_kv: grouped-query
attention, chapter 08), T queries, S keys, D query/key width, Dv value width.
Masks are bool, ``True`` where a query may attend, broadcastable to ``(B, H, T, S)``
(see :mod:`companion.masks`). ``causal=True`` aligns the triangle to the end of the keys,
so T new queries after S - T cached keys see the whole prefix.

All three forms share one signature: :func:`naive_attention` (the reference; it also
returns the weights), :func:`sdpa_attention` (PyTorch's fused kernels) and
:func:`companion.flash.tiled_attention` (online softmax over tiles). :func:`attention`
dispatches on ``impl``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .masks import causal_mask, combine_masks, guard_empty_rows

__all__ = ["IMPLS", "attention", "check_qkv", "expand_kv", "naive_attention", "sdpa_attention"]

IMPLS = ("reference", "sdpa", "tiled", "flex")


def check_qkv(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> None:
    """Raise a ValueError naming the argument whose shape or dtype does not fit."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have shape (B, H, T, D), got {tuple(x.shape)}")
    if q.shape[0] != k.shape[0] or k.shape[:2] != v.shape[:2] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"q, k, v must share B, k and v must share H_kv, and q's H must be a multiple of "
            f"H_kv; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share D; got q D={q.shape[-1]}, k D={k.shape[-1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must share S; got k S={k.shape[2]}, v S={v.shape[2]}")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor (True = attend), got dtype {mask.dtype}")
        target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        try:
            torch.broadcast_shapes(mask.shape, target)
        except RuntimeError:
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to (B, H, T, S) = {target}"
            ) from None


def expand_kv(k: Tensor, n_heads: int) -> Tensor:
    """Repeat each of the H_kv heads H / H_kv times: ``(B, H_kv, S, D) -> (B, H, S, D)``."""
    groups = n_heads // k.shape[1]
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def _full_mask(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool) -> Tensor | None:
    tri = causal_mask(q.shape[2], k.shape[2], device=q.device) if causal else None
    return combine_masks(mask, tri)


def naive_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ · scale) v, written out; returns ``(out (B,H,T,Dv), weights (B,H,T,S))``.

    ``scale`` defaults to 1/√D. Query rows with no visible key output zeros.
    """
    check_qkv(q, k, v, mask)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])  # GQA: share each K/V head
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, S)
    full = _full_mask(q, k, mask, causal)
    has_key = None
    if full is not None:
        full, has_key = guard_empty_rows(full)
        scores = scores.masked_fill(~full, float("-inf"))
    acc = torch.promote_types(scores.dtype, torch.float32)  # fp32 for bf16, fp64 stays
    weights = torch.softmax(scores.to(acc), dim=-1).to(q.dtype)  # (B, H, T, S)
    if has_key is not None:
        weights = weights * has_key
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v, weights  # (B, H, T, Dv)


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

    Grouped K/V heads are passed as they are (``enable_gqa``): never repeated in memory.
    """
    check_qkv(q, k, v, mask)
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    if mask is None and (not causal or q.shape[2] == k.shape[2]):
        # SDPA's own is_causal is top-left aligned, which equals ours when T == S.
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, dropout_p=dropout_p, **gqa
        )
    full, has_key = guard_empty_rows(_full_mask(q, k, mask, causal))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=full, scale=scale, dropout_p=dropout_p, **gqa
    )
    return out * has_key


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    impl: str = "reference",
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Dispatch by name: ``"reference"``, ``"sdpa"``, ``"tiled"`` or ``"flex"``."""
    if impl == "reference":
        return naive_attention(q, k, v, mask=mask, causal=causal, scale=scale, dropout_p=dropout_p)[
            0
        ]
    if impl == "sdpa":
        return sdpa_attention(q, k, v, mask=mask, causal=causal, scale=scale, dropout_p=dropout_p)
    if impl == "tiled":
        if dropout_p > 0.0:
            raise ValueError("impl='tiled' does not implement attention dropout; use dropout_p=0")
        from .flash import tiled_attention

        h = q.shape[1]
        return tiled_attention(
            q, expand_kv(k, h), expand_kv(v, h), mask=mask, causal=causal, scale=scale
        )
    if impl == "flex":
        if dropout_p > 0.0:
            raise ValueError("impl='flex' does not implement attention dropout; use dropout_p=0")
        from .flex import flex_attention_forward

        return flex_attention_forward(q, k, v, mask=mask, causal=causal, scale=scale)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")

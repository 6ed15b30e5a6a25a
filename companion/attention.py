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

Attention sinks (gpt-oss, chapter 12): ``sinks (H,)`` adds one learned logit per head to the
softmax denominator, so a head may put weight on "nothing" and output less than a convex
mix of the values. The reference appends the sink as an extra score column and drops it
after the softmax; the SDPA path gives the same result with a key every query sees, whose
value is zero (:func:`sink_as_key`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .masks import causal_mask, combine_masks, guard_empty_rows

__all__ = [
    "IMPLS",
    "attention",
    "check_qkv",
    "expand_kv",
    "grouped_attention",
    "naive_attention",
    "sdpa_attention",
    "sink_as_key",
]

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


def _check_sinks(q: Tensor, sinks: Tensor | None) -> None:
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(
            f"sinks must have shape (H,) = ({q.shape[1]},), one logit per query head; "
            f"got {tuple(sinks.shape)}"
        )


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
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ · scale) v, written out; returns ``(out (B,H,T,Dv), weights (B,H,T,S))``.

    ``scale`` defaults to 1/√D. Query rows with no visible key output zeros. With ``sinks``
    each head's softmax also counts exp(sink) in its denominator (the weights then sum to
    less than 1).
    """
    check_qkv(q, k, v, mask)
    _check_sinks(q, sinks)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])  # GQA: share each K/V head
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, S)
    full = _full_mask(q, k, mask, causal)
    has_key = None
    if full is not None:
        full, has_key = guard_empty_rows(full)
        scores = scores.masked_fill(~full, float("-inf"))
    acc = torch.promote_types(scores.dtype, torch.float32)  # fp32 for bf16, fp64 stays
    if sinks is None:
        weights = torch.softmax(scores.to(acc), dim=-1).to(q.dtype)  # (B, H, T, S)
    else:  # one more column per head, the sink's logit, dropped after the softmax
        b, h, t, _ = scores.shape
        sink = sinks.to(acc).view(1, h, 1, 1).expand(b, h, t, 1)
        weights = torch.softmax(torch.cat([scores.to(acc), sink], dim=-1), dim=-1)
        weights = weights[..., :-1].to(q.dtype)
    if has_key is not None:
        weights = weights * has_key
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v, weights  # (B, H, T, Dv)


def grouped_attention(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None, scale: float | None = None
) -> Tensor:
    """softmax(q kᵀ · scale) v for grouped heads, without repeating K/V (chapter 08).

    The G = H / H_kv query heads that share a K/V head become G·T rows of one product:
    q ``(B, H, T, D)`` is viewed as ``(B, H_kv, G·T, D)``, so each cached key and value is
    read once per K/V head, not once per query head. This is why GQA speeds up decoding,
    where reading the cache is the cost. ``mask`` must leave every query a visible key.
    """
    check_qkv(q, k, v, mask)
    b, h, t, d = q.shape
    h_kv, s = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rows = q.reshape(b, h_kv, h // h_kv * t, d)  # head h = kv·G + g; row g·T + t
    scores = (rows @ k.transpose(-2, -1) * scale).view(b, h, t, s)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    acc = torch.promote_types(scores.dtype, torch.float32)
    weights = torch.softmax(scores.to(acc), dim=-1).to(q.dtype)
    return (weights.view(b, h_kv, -1, s) @ v).view(b, h, t, v.shape[-1])  # (B, H, T, Dv)


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    sinks: Tensor | None = None,
) -> Tensor:
    """The same function through ``F.scaled_dot_product_attention`` (fused kernels).

    Grouped K/V heads are passed as they are (``enable_gqa``): never repeated in memory.
    Sinks become one extra key (:func:`sink_as_key`).
    """
    check_qkv(q, k, v, mask)
    _check_sinks(q, sinks)
    if sinks is not None:
        q, k, v, mask, scale = sink_as_key(q, k, v, sinks, _full_mask(q, k, mask, causal), scale)
        causal = False
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


def sink_as_key(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, mask: Tensor | None, scale: float | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
    """Rewrite attention with sinks as plain attention over one extra key.

    Every key gains a channel holding 0 and the new last key is ``[0, ..., 0, 1]`` with a
    zero value; each query gains a channel holding ``sink_h / scale``. The new key's score is
    then exactly ``sink_h`` for head h, and its zero value adds nothing to the output: only
    its share of the denominator remains. Returns ``(q', k', v', mask', scale)``, the mask
    with the new key visible to every query (the scale is made explicit, since D grew by 1).
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
    sinks: Tensor | None = None,
) -> Tensor:
    """Dispatch by name: ``"reference"``, ``"sdpa"``, ``"tiled"`` or ``"flex"``."""
    kw = {"mask": mask, "causal": causal, "scale": scale, "dropout_p": dropout_p, "sinks": sinks}
    if impl == "reference":
        return naive_attention(q, k, v, **kw)[0]
    if impl == "sdpa":
        return sdpa_attention(q, k, v, **kw)
    if sinks is not None:
        raise ValueError(f"impl={impl!r} has no attention sinks; use 'reference' or 'sdpa'")
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

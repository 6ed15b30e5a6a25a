"""Attention by name: one entry point over every form in :mod:`companion.ops`.

``impl`` is one of ``IMPLS``; each name is a form with the shared signature of
:mod:`companion.ops.attention`. Grouped K/V heads are repeated for the forms that need
one K/V head per query head (``reference``, ``tiled``); sinks (chapter 12) exist in the
``reference`` and ``sdpa`` forms, and any other form asked for them raises. ``triton``
runs :func:`companion.kernels.flash_attention.flash_attention` (the ``gpu`` extra; grouped
K/V read by index): it takes ``causal`` and no other mask.
"""

from __future__ import annotations

from torch import Tensor

from companion.checks import check_choice, check_dtypes_match
from companion.ops.attention import check_qkv, naive_attention, sdpa_attention
from companion.ops.flex import BlockMask, flex_attention_forward
from companion.ops.grouped import expand_kv
from companion.ops.sinks import sink_naive_attention, sink_sdpa_attention
from companion.ops.tiled import tiled_attention

__all__ = ["IMPLS", "attention"]

IMPLS = ("reference", "sdpa", "tiled", "flex", "triton")


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    impl: str = "reference",
    mask: Tensor | BlockMask | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    sinks: Tensor | None = None,
) -> Tensor:
    """``(B, H, T, Dv)`` from the form ``impl`` names: ``"reference"``, ``"sdpa"``,
    ``"tiled"``, ``"flex"`` (``mask`` may be a BlockMask only for ``"flex"``) or
    ``"triton"`` (no mask). q, k, v (and a float mask) must share one dtype."""
    check_choice("impl", impl, IMPLS)
    # a float mask is additive and must share q's dtype too; a bool mask or a BlockMask
    # carries no dtype of its own
    float_mask = mask if isinstance(mask, Tensor) and mask.is_floating_point() else None
    check_dtypes_match(q=q, k=k, v=v, mask=float_mask)
    kw = {"mask": mask, "causal": causal, "scale": scale, "dropout_p": dropout_p}
    if sinks is not None:
        if impl == "reference":
            return sink_naive_attention(q, k, v, sinks, **kw)
        if impl == "sdpa":
            return sink_sdpa_attention(q, k, v, sinks, **kw)
        raise ValueError(
            f"impl={impl!r} has no attention sinks; use 'reference' or 'sdpa'"
        )
    if impl == "sdpa":
        return sdpa_attention(q, k, v, **kw)
    if impl == "flex":
        return flex_attention_forward(q, k, v, **kw)
    check_qkv(q, k, v, mask, grouped=True)
    if impl == "triton":
        return _triton(q, k, v, mask, causal, scale, dropout_p)
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    if impl == "reference":
        return naive_attention(q, k, v, **kw)
    return tiled_attention(q, k, v, **kw)


def _triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | BlockMask | None,
    causal: bool,
    scale: float | None,
    dropout_p: float,
) -> Tensor:
    if mask is not None:
        raise ValueError(
            "impl='triton' takes causal=True or False and no mask (a sliding window: "
            "companion.kernels.flash_attention.flash_attention(..., window=W))"
        )
    if dropout_p > 0.0:
        raise ValueError("impl='triton' has no attention dropout; use 'sdpa'")
    from companion.kernels.flash_attention import flash_attention

    return flash_attention(q, k, v, causal=causal, scale=scale)

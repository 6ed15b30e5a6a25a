"""FlexAttention: masks as functions, compiled into block-sparse kernels (chapters 08,
09).

Shape legend: B batch, H query heads, H_kv key/value heads, T queries, S keys, D head
width. PyTorch's ``flex_attention`` takes a ``BlockMask``: the mask is described by a
function ``mask_mod(b, h, q_idx, kv_idx) -> bool`` and summarised per 128×128 tile as
empty, full or partial, so fully masked tiles (the future, or keys beyond a sliding
window) are skipped. Building a ``BlockMask`` is slow (about a second on a CPU): build
it once per shape and reuse it, as :class:`companion.models.decoder.DecoderLM` does.

Limits of this backend, raised as errors rather than hidden: it needs
``torch.nn.attention.flex_attention`` (torch >= 2.5), and on a CPU it has no backward
pass. Without ``torch.compile`` it runs an unfused version that materialises the scores,
fine for checking results, not for speed.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from companion.ops.attention import check_qkv
from companion.ops.masks import causal_mask

__all__ = ["available", "causal_window_block_mask", "flex_attention_forward"]

try:
    from torch.nn.attention.flex_attention import (
        BlockMask,
        create_block_mask,
        flex_attention,
    )
except ImportError:  # torch < 2.5
    BlockMask = create_block_mask = flex_attention = None


def available() -> bool:
    """True if this torch has FlexAttention."""
    return flex_attention is not None


def _require() -> None:
    if not available():
        raise RuntimeError(
            "attn_impl='flex' needs torch.nn.attention.flex_attention (torch >= 2.5); "
            "use 'sdpa' or 'reference'"
        )


def causal_window_block_mask(
    t: int,
    s: int | None = None,
    window: int | None = None,
    device: torch.device | str = "cpu",
) -> BlockMask:
    """Causal (end-aligned) attention, optionally to the last ``window`` keys only."""
    _require()
    s = t if s is None else s
    offset = s - t

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q_pos = q_idx + offset
        keep = kv_idx <= q_pos
        if window is not None:
            keep = keep & (q_pos - kv_idx < window)
        return keep

    return create_block_mask(mask_mod, None, None, t, s, device=str(device))


def _bool_block_mask(
    mask: Tensor, b: int, h: int, t: int, s: int, device: torch.device
) -> BlockMask:
    full = mask.expand(b, h, t, s)

    def mask_mod(bi: Tensor, hi: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return full[bi, hi, q_idx, kv_idx]

    return create_block_mask(mask_mod, b, h, t, s, device=str(device))


def flex_attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | BlockMask | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Attention through ``flex_attention``; ``mask`` is a bool tensor or a
    ``BlockMask``.

    Same conventions as :func:`companion.ops.attention.naive_attention`, grouped K/V
    heads included; a bool mask is turned into a ``BlockMask`` on each call (slow: pass
    a prebuilt one where it repeats).
    """
    _require()
    if dropout_p != 0.0:
        raise ValueError(
            f"flex_attention has no attention dropout; got dropout_p={dropout_p}"
        )
    if isinstance(mask, BlockMask):
        block = mask
    else:
        check_qkv(q, k, v, mask, grouped=True)
        b, h, t, s = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        if mask is None:
            block = causal_window_block_mask(t, s, None, q.device) if causal else None
        else:
            if causal:
                mask = mask & causal_mask(t, s, device=q.device)
            block = _bool_block_mask(mask, b, h, t, s, q.device)
    if q.device.type == "cpu":
        if torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad
        ):
            raise RuntimeError(
                "FlexAttention has no backward pass on the CPU: use attn_impl='sdpa' to train, "
                "or run under torch.no_grad()"
            )
        q, k, v = q.detach(), k.detach(), v.detach()  # no graph is built here anyway
    with warnings.catch_warnings():
        # Eager flex says it materialises the scores; the module docstring says so too.
        warnings.filterwarnings(
            "ignore", message="flex_attention called without torch.compile"
        )
        out = flex_attention(
            q, k, v, block_mask=block, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    return out

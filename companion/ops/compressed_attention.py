"""Softmax-gated pooling of token rows into compressed entries (DeepSeek-V4).

Shape legend: B batch, m ``ratio`` (tokens per block), n blocks, T = n·m rows, D entry
width, W row width (D, or 2D with ``overlap``), N entries, Tq queries.

DeepSeek-V4 shortens the key sequence by pooling each block of m consecutive tokens into
one entry. Every token brings a row ``kv`` and a gate logit per channel ``gate``; a
learned ``position_bias (m, W)`` is added to the gate by the token's slot in its block,
and each channel of the entry is the softmax-weighted mix of the block's rows:
``entry_c = Σ_j softmax_j(gate_jc + bias_jc) · kv_jc``.

With ``overlap`` (V4's compressed sparse attention, CSA) a row holds two series ``[a |
b]`` of width D each: entry w pools the b halves of block w together with the a halves of
block w − 1, 2m slots in one softmax, so consecutive entries share a block. Block 0 of a
sequence has no predecessor (its a slots get weight 0); a caller that continues a
sequence passes the full rows of the block before its first as ``prev_kv`` and
``prev_gate``. Without overlap (heavily compressed attention, HCA) blocks are disjoint.

:func:`naive_compress` loops over the blocks in fp32 and is the definition;
:func:`blocked_compress` pools every block at once; tests check they agree, outputs and
gradients. :func:`visible_entries` says which entries a query may read: entry w exists
once its last token, position (w + 1)·m − 1, has been seen.
"""

from __future__ import annotations

import torch
from torch import Tensor

from companion.checks import check_int

__all__ = ["blocked_compress", "check_compress", "naive_compress", "visible_entries"]


def check_compress(
    kv: Tensor,
    gate: Tensor,
    position_bias: Tensor,
    ratio: int,
    overlap: bool,
    prev_kv: Tensor | None,
    prev_gate: Tensor | None,
) -> None:
    """Raise a ValueError naming the argument whose shape does not fit."""
    check_int("ratio", ratio, 1)
    if kv.ndim != 3 or gate.shape != kv.shape:
        raise ValueError(
            f"kv and gate must share one shape (B, T, W); got kv {tuple(kv.shape)}, "
            f"gate {tuple(gate.shape)}"
        )
    b, t, w = kv.shape
    if t % ratio:
        raise ValueError(
            f"kv must hold whole blocks: T={t} is not a multiple of {ratio}"
        )
    if position_bias.shape != (ratio, w):
        raise ValueError(
            f"position_bias must have shape (ratio, W) = ({ratio}, {w}), got "
            f"{tuple(position_bias.shape)}"
        )
    if overlap and w % 2:
        raise ValueError(f"with overlap a row is [a | b]: W must be even, got {w}")
    if (prev_kv is None) != (prev_gate is None):
        raise ValueError("prev_kv and prev_gate must be given together")
    if prev_kv is not None:
        if not overlap:
            raise ValueError("prev_kv is only read with overlap=True")
        for name, x in (("prev_kv", prev_kv), ("prev_gate", prev_gate)):
            if x.shape != (b, ratio, w):
                raise ValueError(
                    f"{name} must have shape (B, ratio, W) = ({b}, {ratio}, {w}), got "
                    f"{tuple(x.shape)}"
                )


def naive_compress(
    kv: Tensor,
    gate: Tensor,
    position_bias: Tensor,
    ratio: int,
    *,
    overlap: bool = False,
    prev_kv: Tensor | None = None,
    prev_gate: Tensor | None = None,
) -> Tensor:
    """The reference: one softmax per block, written out in fp32. ``kv, gate (B, T, W)``
    -> entries ``(B, n, D)`` in kv's dtype."""
    check_compress(kv, gate, position_bias, ratio, overlap, prev_kv, prev_gate)
    b, t, w = kv.shape
    d = w // 2 if overlap else w
    bias = position_bias.float()
    entries = []
    for i in range(t // ratio):
        rows = slice(i * ratio, (i + 1) * ratio)
        k, g = kv[:, rows].float(), gate[:, rows].float() + bias  # (B, m, W)
        if overlap:
            before = None  # the rows of block i − 1: this call's, or the caller's
            if i > 0:
                before = (
                    kv[:, rows.start - ratio : rows.start],
                    gate[:, rows.start - ratio : rows.start],
                )
            elif prev_kv is not None:
                before = prev_kv, prev_gate
            k, g = k[..., d:], g[..., d:]  # series b of this block, (B, m, D)
            if before is not None:
                k = torch.cat([before[0].float()[..., :d], k], dim=1)  # (B, 2m, D)
                g = torch.cat([before[1].float()[..., :d] + bias[:, :d], g], dim=1)
        weights = torch.softmax(g, dim=1)  # over the slots of one entry
        entries.append((weights * k).sum(dim=1))  # (B, D)
    if not entries:
        return kv.new_zeros(b, 0, d)
    out = torch.stack(entries, dim=1)
    assert out.shape == (b, t // ratio, d)
    return out.to(kv.dtype)


def blocked_compress(
    kv: Tensor,
    gate: Tensor,
    position_bias: Tensor,
    ratio: int,
    *,
    overlap: bool = False,
    prev_kv: Tensor | None = None,
    prev_gate: Tensor | None = None,
) -> Tensor:
    """Every block at once: rows viewed as ``(B, n, m, W)``, one softmax over the slot
    axis; the same arguments and result as :func:`naive_compress`. The softmax runs in
    fp32, the weighted sum in kv's dtype."""
    check_compress(kv, gate, position_bias, ratio, overlap, prev_kv, prev_gate)
    b, t, w = kv.shape
    n = t // ratio
    d = w // 2 if overlap else w
    if n == 0:
        return kv.new_zeros(b, 0, d)
    k = kv.view(b, n, ratio, w)
    g = gate.view(b, n, ratio, w) + position_bias  # (B, n, m, W)
    if overlap:
        if prev_kv is None:  # no block before the first: zero rows, zero weight
            first_k = kv.new_zeros(b, 1, ratio, d)
            first_g = g.new_full((b, 1, ratio, d), float("-inf"))
        else:
            first_k = prev_kv[:, None, :, :d]
            first_g = (prev_gate[:, None] + position_bias)[..., :d]
        a_k = torch.cat([first_k.to(k.dtype), k[:, :-1, :, :d]], dim=1)  # (B, n, m, D)
        a_g = torch.cat([first_g.to(g.dtype), g[:, :-1, :, :d]], dim=1)
        k = torch.cat([a_k, k[..., d:]], dim=2)  # (B, n, 2m, D)
        g = torch.cat([a_g, g[..., d:]], dim=2)
    weights = torch.softmax(g, dim=2, dtype=torch.float32).to(k.dtype)
    return (k * weights).sum(dim=2)  # (B, n, D)


def visible_entries(positions: Tensor, n_entries: int, ratio: int) -> Tensor:
    """``(Tq, N)`` bool: the query at position p reads entry w once block w is complete,
    ``(w + 1)·m − 1 <= p``, i.e. ``w < (p + 1) // m``."""
    w = torch.arange(n_entries, device=positions.device)
    return w[None, :] < torch.div(positions[:, None] + 1, ratio, rounding_mode="floor")

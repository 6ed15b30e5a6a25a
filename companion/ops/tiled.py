"""FlashAttention as online softmax over tiles, in plain PyTorch (chapter 02).

Shape legend: B batch, H heads, T queries, S keys, D query/key width, Dv value width,
bq/bk the query/key tile sizes. Same conventions as :mod:`companion.ops.attention`: bool
mask (``True`` = attend) broadcastable to ``(B, H, T, S)``, ``causal=True`` aligned to
the end of the keys, and query rows with no visible key output zeros.

The T×S score matrix is never built, in the forward or the backward pass: each ``(bq,
bk)`` tile of scores lives only inside one loop step. The forward keeps, per query row,
a running max ``m``, a running softmax denominator ``denom`` and an unnormalised output,
rescaling them as each key tile arrives; it saves only ``q, k, v, out`` and the
log-sum-exp ``lse = m + log(denom)``. The backward recomputes every tile's weights from
``lse`` (FlashAttention-2 style), so memory stays O(T·D + bq·bk).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor

from companion.checks import check_int
from companion.ops.attention import check_qkv

__all__ = [
    "key_tiles",
    "online_softmax_trace",
    "tile_scores",
    "tile_setup",
    "tiled_attention",
    "tiled_attention_forward",
]


def tile_setup(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    causal: bool,
    scale: float | None,
    block_q: int,
    block_k: int,
) -> tuple[Tensor | None, float, torch.dtype, int | None]:
    """Validate; return the 4-d mask, the scale, the accumulation dtype and the causal
    offset."""
    check_qkv(q, k, v, mask)
    for name, block in (("block_q", block_q), ("block_k", block_k)):
        check_int(name, block, 1)
    t, s = q.shape[2], k.shape[2]
    if causal and s < t:
        raise ValueError(
            f"causal=True needs S >= T (keys include the queries), got T={t}, S={s}"
        )
    if mask is not None:
        mask = mask[
            (None,) * (4 - mask.ndim)
        ]  # left-pad to 4 dims: (B|1, H|1, T|1, S|1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    acc = torch.promote_types(
        q.dtype, torch.float32
    )  # fp32 for bf16/fp16; fp64 stays fp64
    return mask, scale, acc, (s - t if causal else None)


def key_tiles(
    i1: int, s: int, block_k: int, offset: int | None
) -> Iterator[tuple[int, int]]:
    """Yield ``(j0, j1)`` key tiles for a query block ending at ``i1``; skip future
    tiles."""
    # causal (offset = S - T): the block's last query, i1 - 1, sees keys
    # j <= i1 - 1 + offset
    k_end = s if offset is None else min(s, i1 + offset)
    for j0 in range(0, k_end, block_k):
        yield j0, min(j0 + block_k, s)


def tile_scores(
    q_blk: Tensor,
    k_blk: Tensor,
    mask: Tensor | None,
    scale: float,
    i0: int,
    j0: int,
    offset: int | None,
) -> Tensor:
    """Scaled scores of one tile, ``-inf`` where masked: ``(B, H, bq, bk)``."""
    bq, bk = q_blk.shape[2], k_blk.shape[2]
    scores = (q_blk @ k_blk.transpose(-2, -1)) * scale  # (B, H, bq, bk)
    if mask is not None:  # a mask dim of size 1 broadcasts: slice only the full ones
        rows = slice(i0, i0 + bq) if mask.shape[2] != 1 else slice(None)
        cols = slice(j0, j0 + bk) if mask.shape[3] != 1 else slice(None)
        scores = scores.masked_fill(~mask[:, :, rows, cols], float("-inf"))
    if (
        offset is not None and j0 + bk - 1 > i0 + offset
    ):  # the tile crosses the diagonal
        qi = (
            torch.arange(i0, i0 + bq, device=scores.device).unsqueeze(1) + offset
        )  # (bq, 1)
        kj = torch.arange(j0, j0 + bk, device=scores.device).unsqueeze(0)  # (1, bk)
        scores = scores.masked_fill(kj > qi, float("-inf"))
    return scores


def tiled_attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = 64,
    block_k: int = 64,
) -> tuple[Tensor, Tensor]:
    """The forward loop: ``(out (B,H,T,Dv) in q's dtype, lse (B,H,T) in fp32 or
    wider)``.

    ``lse`` is ``+inf`` for rows with no visible key, so their weights ``exp(s - lse)``
    are 0.
    """
    mask, scale, acc, offset = tile_setup(
        q, k, v, mask, causal, scale, block_q, block_k
    )
    b, h, t, _ = q.shape
    s, dv = k.shape[2], v.shape[-1]
    out = q.new_empty((b, h, t, dv), dtype=acc)  # (B, H, T, Dv)
    lse = q.new_empty((b, h, t), dtype=acc)  # (B, H, T)
    for i0 in range(0, t, block_q):
        i1 = min(i0 + block_q, t)
        q_blk = q[:, :, i0:i1].to(acc)  # (B, H, bq, D)
        # per query row: the running max, sum of exp(score - m), unnormalised output
        m = q.new_full((b, h, i1 - i0), float("-inf"), dtype=acc)
        denom = q.new_zeros((b, h, i1 - i0), dtype=acc)
        o = q.new_zeros((b, h, i1 - i0, dv), dtype=acc)
        for j0, j1 in key_tiles(i1, s, block_k, offset):
            scores = tile_scores(
                q_blk, k[:, :, j0:j1].to(acc), mask, scale, i0, j0, offset
            )
            m_new = torch.maximum(m, scores.amax(dim=-1))  # (B, H, bq)
            # rows with no key so far keep m = -inf; subtract 0 from them instead
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
            p = torch.exp(scores - m_safe.unsqueeze(-1))  # (B, H, bq, bk), 0 if masked
            alpha = torch.exp(m - m_safe)  # (B, H, bq): rescales the sums so far
            denom = denom * alpha + p.sum(dim=-1)
            o = o * alpha.unsqueeze(-1) + p @ v[:, :, j0:j1].to(acc)  # (B, H, bq, Dv)
            m = m_new
        has_key = denom > 0
        out[:, :, i0:i1] = o / torch.where(has_key, denom, 1.0).unsqueeze(
            -1
        )  # empty rows: 0
        lse[:, :, i0:i1] = torch.where(has_key, m + torch.log(denom), float("inf"))
    return out.to(q.dtype), lse


class _TiledAttention(torch.autograd.Function):
    """Forward by :func:`tiled_attention_forward`; backward recomputes each tile from
    lse."""

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, block_q, block_k):
        out, lse = tiled_attention_forward(
            q,
            k,
            v,
            mask=mask,
            causal=causal,
            scale=scale,
            block_q=block_q,
            block_k=block_k,
        )
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.options = (causal, scale, block_q, block_k)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, mask = ctx.saved_tensors
        causal, scale, block_q, block_k = ctx.options
        mask, scale, acc, offset = tile_setup(
            q, k, v, mask, causal, scale, block_q, block_k
        )
        t, s = q.shape[2], k.shape[2]
        d_out = d_out.to(acc)  # (B, H, T, Dv)
        delta = (d_out * out.to(acc)).sum(dim=-1)  # D_i = rowsum(dO ∘ O): (B, H, T)
        dq = torch.zeros_like(q, dtype=acc)
        dk = torch.zeros_like(k, dtype=acc)
        dv = torch.zeros_like(v, dtype=acc)
        for i0 in range(0, t, block_q):
            i1 = min(i0 + block_q, t)
            q_blk, do_blk = (
                q[:, :, i0:i1].to(acc),
                d_out[:, :, i0:i1],
            )  # (B,H,bq,D), (B,H,bq,Dv)
            for j0, j1 in key_tiles(i1, s, block_k, offset):
                k_blk, v_blk = k[:, :, j0:j1].to(acc), v[:, :, j0:j1].to(acc)
                scores = tile_scores(q_blk, k_blk, mask, scale, i0, j0, offset)
                p = torch.exp(scores - lse[:, :, i0:i1].unsqueeze(-1))  # (B, H, bq, bk)
                dv[:, :, j0:j1] += p.transpose(-2, -1) @ do_blk  # (B, H, bk, Dv)
                dp = do_blk @ v_blk.transpose(-2, -1)  # (B, H, bq, bk)
                ds = (
                    p * (dp - delta[:, :, i0:i1].unsqueeze(-1)) * scale
                )  # dS = P∘(dP − D)
                dq[:, :, i0:i1] += ds @ k_blk  # (B, H, bq, D)
                dk[:, :, j0:j1] += ds.transpose(-2, -1) @ q_blk  # (B, H, bk, D)
        return (
            dq.to(q.dtype),
            dk.to(k.dtype),
            dv.to(v.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def tiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    block_q: int = 64,
    block_k: int = 64,
) -> Tensor:
    """Attention computed tile by tile, forward and backward: returns ``(B, H, T, Dv)``.

    Same result as :func:`companion.ops.attention.naive_attention` up to rounding, in
    O(T·D + bq·bk) memory instead of O(T·S). bf16/fp16 inputs accumulate in fp32. There
    is no attention dropout here: ``dropout_p`` other than 0 raises.
    """
    if dropout_p != 0.0:
        raise ValueError(
            f"tiled_attention has no attention dropout; got dropout_p={dropout_p}"
        )
    return _TiledAttention.apply(q, k, v, mask, causal, scale, block_q, block_k)


def online_softmax_trace(x: Tensor, block: int) -> list[tuple[float, float]]:
    """The online softmax of one row ``x (S,)`` read in blocks: ``(m, ℓ)`` after each
    block.

    ``m`` is the running max and ``ℓ = Σ exp(x_j − m)`` over the keys seen so far,
    rescaled by ``exp(m_old − m_new)`` whenever the max grows; ``exp(x − m) / ℓ`` from
    the last pair is the softmax of ``x``. The scalar version of the loop in
    :func:`tiled_attention_forward`.
    """
    if x.ndim != 1 or block < 1:
        raise ValueError(
            f"need a 1-D x and block >= 1, got shape {tuple(x.shape)}, block={block}"
        )
    m, denom, trace = float("-inf"), 0.0, []
    for j0 in range(0, x.shape[0], block):
        chunk = x[j0 : j0 + block].detach().cpu().double()  # MPS has no float64
        m_new = max(m, chunk.max().item())
        denom = denom * math.exp(m - m_new) + torch.exp(chunk - m_new).sum().item()
        m = m_new
        trace.append((m, denom))
    return trace

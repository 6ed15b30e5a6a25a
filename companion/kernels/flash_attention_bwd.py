"""FlashAttention's backward in Triton, FlashAttention-2 style (chapter 02).

Shape legend as in :mod:`companion.kernels.flash_attention`: B batch, H query heads,
H_kv key/value heads, T queries, S keys, D head width, BM/BN the query/key tile sizes.

Nothing of size T×S is stored: with the saved log-sum-exp, each tile's weights are
recomputed as ``P = exp(q kᵀ · scale - lse)``. First ``delta = rowsum(dO ∘ O)`` (the
softmax backward's row term, ``(B, H, T)``), then two kernels: one program per key tile
accumulates dK and dV over the query tiles that see it, one per query tile accumulates
dQ over its key tiles. dK and dV are summed per query head into fp32 buffers shaped
``(B, H, S, D)``, then over the H / H_kv query heads that share a key/value head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)

__all__ = ["flash_backward"]


@triton.jit
def _flash_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    T, S, H, Q_PER_KV, band_lo, band_hi, qk_scale, scale,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """One program: dK, dV of BN keys for one query head, over the query tiles."""
    n0, bh = tl.program_id(0) * BN, tl.program_id(1)
    kv = (bh // H) * (H // Q_PER_KV) + (bh % H) // Q_PER_KV
    keys, r, d = n0 + tl.arange(0, BN), tl.arange(0, BM), tl.arange(0, D)
    kv_at, key_in = kv * S * D + keys[:, None] * D + d, keys[:, None] < S
    k = tl.load(k_ptr + kv_at, mask=key_in, other=0.0)
    v = tl.load(v_ptr + kv_at, mask=key_in, other=0.0)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    lo = tl.maximum(n0 - band_hi, 0) // BM * BM  # the first query that sees a key here
    hi = tl.minimum(n0 + BN - band_lo, T)
    for m0 in range(lo, hi, BM):
        rows = m0 + r
        q_at, row_in = bh * T * D + rows[:, None] * D + d, rows[:, None] < T
        q = tl.load(q_ptr + q_at, mask=row_in, other=0.0)
        do = tl.load(do_ptr + q_at, mask=row_in, other=0.0)
        lse = tl.load(lse_ptr + bh * T + rows, mask=rows < T, other=0.0) * LOG2E
        delta = tl.load(delta_ptr + bh * T + rows, mask=rows < T, other=0.0)
        diag = keys[:, None] - rows[None, :]  # (BN, BM): transposed tiles
        seen = (keys[:, None] < S) & (rows[None, :] < T)
        seen = seen & (diag >= band_lo) & (diag <= band_hi)
        s = tl.dot(k, tl.trans(q)) * qk_scale
        p = tl.where(seen, tl.exp2(s - lse[None, :]), 0.0)  # Pᵀ, recomputed
        dv += tl.dot(p.to(do.dtype), do)
        dp = tl.dot(v, tl.trans(do))
        ds = p * (dp - delta[None, :])  # dSᵀ, the softmax backward
        dk += tl.dot(ds.to(q.dtype), q)
    out_at = bh * S * D + keys[:, None] * D + d
    tl.store(dk_ptr + out_at, dk * scale, mask=key_in)
    tl.store(dv_ptr + out_at, dv, mask=key_in)


@triton.jit
def _flash_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    T, S, H, Q_PER_KV, band_lo, band_hi, qk_scale, scale,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """One program: dQ of BM queries of one head, over the key tiles it sees."""
    m0, bh = tl.program_id(0) * BM, tl.program_id(1)
    kv = (bh // H) * (H // Q_PER_KV) + (bh % H) // Q_PER_KV
    rows, c, d = m0 + tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, D)
    q_at, row_in = bh * T * D + rows[:, None] * D + d, rows[:, None] < T
    q = tl.load(q_ptr + q_at, mask=row_in, other=0.0)
    do = tl.load(do_ptr + q_at, mask=row_in, other=0.0)
    lse = tl.load(lse_ptr + bh * T + rows, mask=rows < T, other=0.0) * LOG2E
    delta = tl.load(delta_ptr + bh * T + rows, mask=rows < T, other=0.0)
    dq = tl.zeros([BM, D], tl.float32)
    lo = tl.maximum(m0 + band_lo, 0) // BN * BN
    hi = tl.minimum(m0 + BM + band_hi, S)
    for n0 in range(lo, hi, BN):
        keys = n0 + c
        kv_at, key_in = kv * S * D + keys[:, None] * D + d, keys[:, None] < S
        k = tl.load(k_ptr + kv_at, mask=key_in, other=0.0)
        v = tl.load(v_ptr + kv_at, mask=key_in, other=0.0)
        diag = keys[None, :] - rows[:, None]
        seen = (keys[None, :] < S) & (rows[:, None] < T)
        seen = seen & (diag >= band_lo) & (diag <= band_hi)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        p = tl.where(seen, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    tl.store(dq_ptr + q_at, (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_in)


def flash_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    d_out: Tensor,
    band: tuple[int, int],
    scale: float,
    blocks: tuple[int, int, int],
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` in the inputs' dtypes, from the forward's ``out`` and ``lse``,
    the band ``(lo, hi)`` of visible ``j - i`` and the forward's ``(BM, BN,
    num_warps)``."""
    q, k, v, d_out = q.contiguous(), k.contiguous(), v.contiguous(), d_out.contiguous()
    b, h, t, d = q.shape
    h_kv, s = k.shape[1], k.shape[2]
    delta = (d_out.float() * out.float()).sum(-1)  # (B, H, T)
    bm, bn, warps = min(blocks[0], 64), blocks[1], blocks[2]  # Q and dO tiles: 2 each
    dq = torch.empty_like(q)
    dk = torch.empty(b, h, s, d, device=q.device, dtype=torch.float32)
    dv = torch.empty_like(dk)
    args = (t, s, h, h // h_kv, *band, scale * LOG2E.value, scale)
    launch = {"D": d, "BM": bm, "BN": bn, "num_warps": warps, "num_stages": 2}
    grid_k, grid_q = (triton.cdiv(s, bn), b * h), (triton.cdiv(t, bm), b * h)
    _flash_dkdv_kernel[grid_k](q, k, v, d_out, lse, delta, dk, dv, *args, **launch)
    _flash_dq_kernel[grid_q](q, k, v, d_out, lse, delta, dq, *args, **launch)
    # the query heads of a group wrote their own rows; their sum is the group's gradient
    dk = dk.view(b, h_kv, h // h_kv, s, d).sum(2).to(k.dtype)
    dv = dv.view(b, h_kv, h // h_kv, s, d).sum(2).to(v.dtype)
    return dq, dk, dv

"""FlashAttention in Triton, forward and backward (chapter 02's tiled loop on the GPU).

Shape legend: B batch, H query heads, H_kv key/value heads (H a multiple of H_kv), T
queries, S keys, D head width (a power of two, 16 to 256), BM/BN the query/key tile
sizes. Same conventions as :func:`companion.ops.attention.naive_attention`: ``causal``
aligned to the end of the keys (query ``i`` sees keys ``j <= i + S - T``), ``window`` W
keeps the W most recent keys, the query's own included (the rule of
:func:`companion.layers.kv_cache.position_mask`), and query rows with no visible key
output zeros.

The kernels see one rule for every mask: a diagonal band, key ``j`` visible to query
``i`` where ``lo <= j - i <= hi`` (causal sets ``hi``, a window ``lo``); key tiles wholly
outside the band are never loaded. Query head ``h`` reads key/value head ``h // (H /
H_kv)`` by index, so K and V are never repeated in memory. The forward keeps a query
tile on chip, streams K and V once with the online softmax (fp32 running max,
denominator and output) and saves the log-sum-exp; the backward
(:mod:`companion.kernels.flash_attention_bwd`) recomputes each tile's weights from it.

On CUDA, fp32 inputs multiply in TF32 (``tl.dot``'s default): compare them with
TF32-sized tolerances, or use bf16/fp16, which accumulate in fp32 as everywhere here.
Non-contiguous inputs are copied to contiguous ones first.
"""

from __future__ import annotations

import inspect
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from companion.checks import check_tensor
from companion.kernels import check_triton, interpreting
from companion.kernels.flash_attention_bwd import flash_backward

__all__ = ["block_sizes", "flash_attention", "flash_forward", "forward_kernel_source"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128, 256)
LOG2E = 1.4426950408889634  # exp(x) = exp2(x · log2 e): exp2 is the hardware's


@triton.jit
def _flash_forward_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    T, S, H, Q_PER_KV, band_lo, band_hi, qk_scale,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """One program: BM queries of one (batch, head) against every visible key tile."""
    m0, bh = tl.program_id(0) * BM, tl.program_id(1)
    kv = (bh // H) * (H // Q_PER_KV) + (bh % H) // Q_PER_KV  # the K/V head it reads
    rows, cols, d = m0 + tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, D)
    q_at, row_in = bh * T * D + rows[:, None] * D + d, rows[:, None] < T
    q = tl.load(q_ptr + q_at, mask=row_in, other=0.0)  # stays on chip throughout
    m = tl.full([BM], float("-inf"), tl.float32)  # running max (log2 units)
    denom = tl.zeros([BM], tl.float32)  # running softmax denominator
    acc = tl.zeros([BM, D], tl.float32)  # unnormalised output
    lo = tl.maximum(m0 + band_lo, 0) // BN * BN  # first key tile in the band
    hi = tl.minimum(m0 + BM + band_hi, S)  # past the last visible key
    for n0 in range(lo, hi, BN):
        keys = n0 + cols
        kv_at, key_in = kv * S * D + keys[:, None] * D + d, keys[:, None] < S
        k = tl.load(k_ptr + kv_at, mask=key_in, other=0.0)  # streamed from HBM
        v = tl.load(v_ptr + kv_at, mask=key_in, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # (BM, BN) scores, log2 units
        diag = keys[None, :] - rows[:, None]
        seen = (keys[None, :] < S) & (diag >= band_lo) & (diag <= band_hi)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)  # rescales what was summed under the old max
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    empty = denom == 0.0  # rows with no visible key: output 0, lse +inf
    denom = tl.where(empty, 1.0, denom)
    lse = tl.where(empty, float("inf"), (m + tl.log2(denom)) * 0.6931471805599453)
    out = acc / denom[:, None]
    tl.store(o_ptr + q_at, out.to(o_ptr.dtype.element_ty), mask=row_in)
    tl.store(lse_ptr + bh * T + rows, lse, mask=rows < T)


def forward_kernel_source() -> str:
    """The Triton source of the forward kernel (one program per query tile and head)."""
    return inspect.getsource(_flash_forward_kernel.fn)


def block_sizes(d: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """``(BM, BN, num_warps)`` for head width ``d``: fixed, no autotuning (launched with
    two pipeline stages). Small tiles under the interpreter, so the tests' T and S span
    several; on the GPU tiles whose working set stays within about 160 kB of shared
    memory (an A100's 164 kB, an H100's 228 kB). Not tuned."""
    if interpreting():
        return 16, 16, 1
    wide = dtype.itemsize == 4  # fp32 tiles take twice the bytes
    if d <= 64:
        return (64, 64, 4) if wide else (128, 64, 4)
    if d <= 128:
        return (64, 32, 4) if wide else (128, 64, 8)
    return (16, 32, 4) if wide else (64, 32, 8)


def band(t: int, s: int, causal: bool, window: int | None) -> tuple[int, int]:
    """``(lo, hi)``: key ``j`` is visible to query ``i`` where ``lo <= j - i <= hi``
    (the whole matrix when neither ``causal`` nor ``window`` is set)."""
    hi = s - t if causal else s
    lo = s - t - window + 1 if window is not None else -t
    return lo, hi


def check_inputs(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, window: int | None
) -> None:
    """Raise an error naming the argument that does not fit the kernels."""
    check_tensor("q", q, (None,) * 4, legend="(B, H, T, D)", dtypes=DTYPES)
    b, h, t, d = q.shape
    check_tensor("k", k, (b, None, None, d), legend="(B, H_kv, S, D)", dtypes=DTYPES)
    check_tensor("v", v, tuple(k.shape), legend="(B, H_kv, S, D)", dtypes=DTYPES)
    if h % k.shape[1] != 0:
        raise ValueError(f"q's H={h} must be a multiple of k's H_kv={k.shape[1]}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}")
    if d not in HEAD_DIMS:
        raise ValueError(f"flash_attention needs D in {HEAD_DIMS}, got D={d}")
    if min(q.shape) < 1 or k.shape[2] < 1:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if causal and k.shape[2] < t:
        raise ValueError(f"causal=True needs S >= T, got T={t}, S={k.shape[2]}")
    if window is not None and (not causal or isinstance(window, bool) or window < 1):
        raise ValueError(
            f"window must be a positive int with causal=True, got {window}"
        )
    check_triton("flash_attention", q, k, v)


def flash_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out (B, H, T, D), lse (B, H, T) fp32)``: the forward kernel's two outputs."""
    check_inputs(q, k, v, causal, window)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _forward(q, k, v, band(q.shape[2], k.shape[2], causal, window), scale)


def _forward(
    q: Tensor, k: Tensor, v: Tensor, lo_hi: tuple[int, int], scale: float
) -> tuple[Tensor, Tensor]:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    b, h, t, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(b, h, t, device=q.device, dtype=torch.float32)
    bm, bn, warps = block_sizes(d, q.dtype)
    _flash_forward_kernel[(triton.cdiv(t, bm), b * h)](
        q, k, v, out, lse, t, k.shape[2], h, h // k.shape[1], *lo_hi, scale * LOG2E,
        D=d, BM=bm, BN=bn, num_warps=warps, num_stages=2,
    )  # fmt: skip
    return out, lse


class _FlashAttention(torch.autograd.Function):
    """The forward kernel; the backward kernels recompute weights from the lse. The
    band ``(lo, hi)`` of visible ``j - i`` is checked by the caller."""

    @staticmethod
    def forward(ctx, q, k, v, lo_hi, scale):  # noqa: ANN001, ANN205
        out, lse = _forward(q, k, v, lo_hi, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.lo_hi, ctx.scale = lo_hi, scale
        return out

    @staticmethod
    def backward(ctx, d_out):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        blocks = block_sizes(q.shape[-1], q.dtype)
        grads = flash_backward(q, k, v, out, lse, d_out, ctx.lo_hi, ctx.scale, blocks)
        return *grads, None, None


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
) -> Tensor:
    """softmax(q kᵀ · scale) v through the Triton kernels: ``(B, H, T, D)``.

    q ``(B, H, T, D)``, k and v ``(B, H_kv, S, D)``; differentiable in q, k and v.
    ``scale`` defaults to 1/√D; ``window`` needs ``causal=True``.
    """
    check_inputs(q, k, v, causal, window)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    lo_hi = band(q.shape[2], k.shape[2], causal, window)
    return _FlashAttention.apply(q, k, v, lo_hi, scale)

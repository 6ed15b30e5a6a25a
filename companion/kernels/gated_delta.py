"""The chunked gated delta rule as two Triton kernels (Gated DeltaNet, chapter 11).

Shape legend and layout are those of :mod:`companion.ops.linear_attention`: B batch, T
tokens, H_k query/key heads, H value heads (a multiple of H_k), D_k key width, D_v value
width, C chunk size, N = ⌈T / C⌉ chunks; ``q, k (B, T, H_k, D_k)``, ``v (B, T, H,
D_v)``, ``g, beta (B, T, H)``, state ``(B, H, D_k, D_v)``. The math is that of
:func:`~companion.ops.delta_rule.delta_rule_chunks` with a per-head gate (γ the
cumulative log-decay inside a chunk, S_0 the state at its start):

* kernel 1, one program per (chunk, head), all chunks at once: the ``C × C`` block
  ``L_rs = β_r e^{γ_r − γ_s} k_r·k_s`` (s < r), the inverse of the unit lower-triangular
  ``I + L`` by forward substitution, row by row in registers, and from it ``[u | w] =
  (I + L)⁻¹ [β v | β e^γ k]``;
* kernel 2, one program per (head, tile of D_v columns), one pass over the chunks in
  order with the state held on chip in fp32: ``δ = u − w S_0``, the outputs ``o =
  e^γ q S_0 + (decayed causal q kᵀ) δ``, then ``S ← e^{γ_C} S_0 + Σ_s e^{γ_C − γ_s}
  k_s δ_sᵀ``.

No ``T × T`` matrix exists anywhere; a padded tail chunk is masked (k = 0, β = 0, g = 0,
as the torch form pads). Everything runs in fp32: outputs and state come back in
fp32. Forward only: :mod:`companion.ops.delta_rule_triton` wraps it with
the torch chunk form's signature and gradients.
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl
from torch import Tensor

from companion.kernels import check_triton

__all__ = ["gated_delta_chunks", "kernel_sources"]

_CHUNK_SIZES = (16, 32, 64)  # tl.dot: sides >= 16; C ≤ 64 keeps L in registers
_WIDTHS = (16, 32, 64, 128)  # D_k and D_v: powers of two the state tile fits on chip


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    """``a @ b`` accumulated in fp32. On a GPU the products are TF32 (10-bit mantissa),
    or with FP32 three TF32 products of fp32 accuracy (measured on an H100: 2 ms against
    31 ms for exact "ieee" products at T = 4096, H = 16, D = 128)."""
    if FP32:
        return tl.dot(a, b, input_precision="tf32x3")
    return tl.dot(a, b)


@triton.jit
def _wy_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, u_ptr, w_ptr, T, NT,
               DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
               FP32: tl.constexpr):  # fmt: skip
    """One chunk of one head: ``[u | w] = (I + L)⁻¹ [β v | β e^γ k]``."""
    n, bh = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, C)
    t = n * C + rows
    live = t < T
    dk, dv = tl.arange(0, DK), tl.arange(0, DV)
    k = tl.load(k_ptr + bh * T * DK + t[:, None] * DK + dk[None, :],
                mask=live[:, None], other=0.0)  # fmt: skip
    v = tl.load(v_ptr + bh * T * DV + t[:, None] * DV + dv[None, :],
                mask=live[:, None], other=0.0)  # fmt: skip
    beta = tl.load(beta_ptr + bh * T + t, mask=live, other=0.0)
    gam = tl.cumsum(tl.load(g_ptr + bh * T + t, mask=live, other=0.0), 0)
    lower = rows[:, None] > rows[None, :]  # s < r
    diff = tl.where(lower, gam[:, None] - gam[None, :], 0.0)
    big_l = _dot(k * beta[:, None], tl.trans(k), FP32)
    big_l = tl.where(lower, big_l * tl.exp(diff), 0.0)  # (C, C)
    # forward substitution: row i of (I + L)⁻¹ is e_i − Σ_{j<i} L_ij (row j)
    inv = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in range(1, C):
        l_i = tl.sum(tl.where(rows[:, None] == i, big_l, 0.0), 0)  # L[i, :]
        row = tl.where(rows == i, 1.0, 0.0) - tl.sum(l_i[:, None] * inv, 0)
        inv = tl.where(rows[:, None] == i, row[None, :], inv)
    u = _dot(inv, v * beta[:, None], FP32)
    w = _dot(inv, k * (beta * tl.exp(gam))[:, None], FP32)
    tp = n * C + rows  # the buffers are padded to N·C rows: no mask
    tl.store(u_ptr + bh * NT * DV + tp[:, None] * DV + dv[None, :], u)
    tl.store(w_ptr + bh * NT * DK + tp[:, None] * DK + dk[None, :], w)


@triton.jit
def _state_kernel(q_ptr, k_ptr, g_ptr, u_ptr, w_ptr, s0_ptr, o_ptr, s_ptr, T, NT,
                  DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                  C: tl.constexpr, FP32: tl.constexpr):  # fmt: skip
    """One head, ``BV`` value columns: the chunks in order, the state on chip."""
    bh, j = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, C)
    dk, cv = tl.arange(0, DK), j * BV + tl.arange(0, BV)
    s_at = bh * DK * DV + dk[:, None] * DV + cv[None, :]
    s = tl.load(s0_ptr + s_at)  # (DK, BV) fp32
    causal = rows[:, None] >= rows[None, :]
    for n in range(0, tl.cdiv(T, C)):
        t = n * C + rows
        live = t < T
        q = tl.load(q_ptr + bh * T * DK + t[:, None] * DK + dk[None, :],
                    mask=live[:, None], other=0.0)  # fmt: skip
        k = tl.load(k_ptr + bh * T * DK + t[:, None] * DK + dk[None, :],
                    mask=live[:, None], other=0.0)  # fmt: skip
        gam = tl.cumsum(tl.load(g_ptr + bh * T + t, mask=live, other=0.0), 0)
        w = tl.load(w_ptr + bh * NT * DK + t[:, None] * DK + dk[None, :])
        u = tl.load(u_ptr + bh * NT * DV + t[:, None] * DV + cv[None, :])
        delta = u - _dot(w, s, FP32)  # (C, BV)
        diff = tl.where(causal, gam[:, None] - gam[None, :], 0.0)
        qk = tl.where(causal, _dot(q, tl.trans(k), FP32) * tl.exp(diff), 0.0)
        o = _dot(q * tl.exp(gam)[:, None], s, FP32) + _dot(qk, delta, FP32)
        tl.store(o_ptr + bh * T * DV + t[:, None] * DV + cv[None, :], o,
                 mask=live[:, None])  # fmt: skip
        g_end = tl.sum(tl.where(rows == C - 1, gam, 0.0), 0)  # γ_C (pads add 0)
        k_end = k * tl.exp(g_end - gam)[:, None]
        s = s * tl.exp(g_end) + _dot(tl.trans(k_end), delta, FP32)
    tl.store(s_ptr + s_at, s)


def kernel_sources() -> str:
    """The Triton source of both kernels: the per-chunk WY step, then the pass over
    chunks."""
    return "\n\n".join(inspect.getsource(f.fn) for f in (_wy_kernel, _state_kernel))


def _kernels(q, k, v, g, beta, s0, c: int, fp32: bool) -> tuple[Tensor, Tensor]:
    """Launch both kernels on heads-first contiguous fp32 inputs ``(B, H, T, D)``."""
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    nt = -(-t // c) * c
    u = q.new_empty(b, h, nt, dv)
    w = q.new_empty(b, h, nt, dk)
    _wy_kernel[(nt // c, b * h)](k, v, g, beta, u, w, t, nt, dk, dv, c, fp32)
    o, s = torch.empty_like(v), torch.empty_like(s0)
    bv = min(dv, 64 if dk <= 64 else 32)  # the state tile D_k × BV and q, k, w fit
    # one stage: the chunks run in order anyway, and pipelined copies overflow shared
    # memory at D_k = 128
    _state_kernel[(b * h, dv // bv)](
        q, k, g, u, w, s0, o, s, t, nt, dk, dv, bv, c, fp32, num_stages=1
    )
    return o, s


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor,
           c: int) -> None:  # fmt: skip
    """Raise a ValueError naming the argument that does not fit the kernels."""
    if c not in _CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {_CHUNK_SIZES}, got {c!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have shape (B, H, T, D), got {tuple(x.shape)}"
            )
    if q.shape != k.shape or v.shape[:3] != k.shape[:3] or k.shape[2] == 0:
        raise ValueError(
            "q and k must share one shape (B, H, T, D_k) with T >= 1, v its B, H and "
            f"T; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    for name, width in (("D_k", k.shape[3]), ("D_v", v.shape[3])):
        if width not in _WIDTHS:
            raise ValueError(f"{name} must be one of {_WIDTHS}, got {width}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != v.shape[:3]:
            raise ValueError(
                f"{name} must have shape (B, H, T) = {tuple(v.shape[:3])}, "
                f"got {tuple(x.shape)}"
            )
    want = (*v.shape[:2], k.shape[3], v.shape[3])
    if s.shape != want:
        raise ValueError(
            f"s must have shape (B, H, D_k, D_v) = {want}, got {tuple(s.shape)}"
        )


def gated_delta_chunks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    s: Tensor,
    c: int,
    fp32: bool = True,
) -> tuple[Tensor, Tensor]:
    """The forward of :func:`~companion.ops.delta_rule.delta_rule_chunks` with one gate
    per head, by the two kernels: same arguments, heads first (``q, k (B, H, T, D_k)``,
    ``v (B, H, T, D_v)``, ``g, beta (B, H, T)``, ``s (B, H, D_k, D_v)``); returns the
    outputs ``(B, H, T, D_v)`` and the final state, in fp32.

    ``c`` is 16, 32 or 64; D_k and D_v 16, 32, 64 or 128. ``fp32``: products of fp32
    accuracy on a GPU (three TF32 products each); False: plain TF32 (for 16-bit
    inputs). No autograd here:
    :func:`~companion.ops.delta_rule_triton.chunk_gated_delta_rule_triton` adds it.
    """
    check_triton("gated_delta_chunks", q, k, v, g, beta, s)
    _check(q, k, v, g, beta, s, c)
    q, k, v, g, beta, s = (x.float().contiguous() for x in (q, k, v, g, beta, s))
    return _kernels(q, k, v, g, beta, s, c, fp32)

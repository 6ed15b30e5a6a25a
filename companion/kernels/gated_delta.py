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
as the torch form pads). Everything runs in fp32; the output comes back in q's dtype,
the state in fp32. Forward kernel; gradients by a PyTorch rendering of the same chunk
steps (autograd through it, the inputs recomputed), so training works but its backward
is not a kernel.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from companion.kernels import check_triton

__all__ = ["chunk_gated_delta_rule_triton", "kernel_sources"]

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


def _torch_steps(q, k, v, g, beta, s, c: int) -> tuple[Tensor, Tensor]:
    """The kernels' steps in PyTorch, heads first, for the backward (autograd)."""
    t = q.shape[2]
    pad = -t % c
    q, k, v = (F.pad(x, (0, 0, 0, pad)).unflatten(2, (-1, c)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)).unflatten(2, (-1, c)) for x in (g, beta))
    gam = g.cumsum(-1)  # (B, H, N, C)
    ones = torch.ones(c, c, dtype=torch.bool, device=q.device)
    diff = gam[..., :, None] - gam[..., None, :]
    big_l = (
        (k * beta[..., None])
        @ k.mT
        * diff.masked_fill(~ones.tril(-1), -torch.inf).exp()
    )
    rhs = torch.cat([v * beta[..., None], k * (beta * gam.exp())[..., None]], -1)
    uw = torch.linalg.solve_triangular(big_l, rhs, upper=False, unitriangular=True)
    u, w = uw.split([v.shape[-1], k.shape[-1]], -1)
    qk = q @ k.mT * diff.masked_fill(~ones.tril(), -torch.inf).exp()
    outs = []
    for n in range(q.shape[2]):
        delta = u[:, :, n] - w[:, :, n] @ s
        outs.append(
            (q[:, :, n] * gam[:, :, n, :, None].exp()) @ s + qk[:, :, n] @ delta
        )
        g_end = gam[:, :, n, -1:]  # (B, H, 1)
        k_end = k[:, :, n] * (g_end - gam[:, :, n]).exp()[..., None]
        s = s * g_end[..., None].exp() + k_end.mT @ delta
    return torch.cat(outs, 2)[:, :, :t], s


class _ChunkGatedDelta(torch.autograd.Function):
    """Forward by the kernels; backward by autograd through :func:`_torch_steps`."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, s0, c: int, fp32: bool):  # noqa: ANN001
        ctx.save_for_backward(q, k, v, g, beta, s0)
        ctx.c = c
        return _kernels(q, k, v, g, beta, s0, c, fp32)

    @staticmethod
    def backward(ctx, do: Tensor, ds: Tensor):  # noqa: ANN205
        inputs = [x.detach().requires_grad_() for x in ctx.saved_tensors]
        with torch.enable_grad():
            o, s = _torch_steps(*inputs, ctx.c)
            grads = torch.autograd.grad((o, s), inputs, (do, ds), allow_unused=True)
        return (*grads, None, None)


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
           state: Tensor | None, chunk_size: int) -> None:  # fmt: skip
    """Raise a ValueError naming the argument that does not fit the kernels."""
    if chunk_size not in _CHUNK_SIZES:
        raise ValueError(
            f"chunk_size must be one of {_CHUNK_SIZES}, got {chunk_size!r}"
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have shape (B, T, H, D), got {tuple(x.shape)}"
            )
    if q.shape != k.shape or v.shape[:2] != k.shape[:2] or v.shape[2] % k.shape[2]:
        raise ValueError(
            "q and k must share one shape, v their B and T and a multiple of their "
            f"heads; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[1] == 0:
        raise ValueError("q, k, v must hold at least one token (T >= 1), got T = 0")
    for name, width in (("D_k", k.shape[3]), ("D_v", v.shape[3])):
        if width not in _WIDTHS:
            raise ValueError(f"{name} must be one of {_WIDTHS}, got {width}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != v.shape[:3]:
            raise ValueError(
                f"{name} must have shape (B, T, H) = {tuple(v.shape[:3])}, "
                f"got {tuple(x.shape)}"
            )
    for name, x, lo, hi in (("g", g, -torch.inf, 0.0), ("beta", beta, 0.0, 2.0)):
        if not torch.compiler.is_compiling() and bool(
            (~torch.isfinite(x) | (x < lo) | (x > hi)).any()
        ):  # the ranges of the torch form: g a log-decay, β in [0, 2]
            raise ValueError(f"{name} must be finite and in [{lo:g}, {hi:g}]")
    want = (v.shape[0], v.shape[2], k.shape[3], v.shape[3])
    if state is not None and state.shape != want:
        raise ValueError(
            f"initial_state must have shape (B, H, D_k, D_v) = {want}, "
            f"got {tuple(state.shape)}"
        )


def chunk_gated_delta_rule_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """:func:`~companion.ops.delta_rule.chunk_gated_delta_rule` by the two kernels
    (forward kernel; gradients by the PyTorch chunk form): same arguments, layout and
    result; ``chunk_size`` 16, 32 or 64; D_k and D_v 16, 32, 64 or 128."""
    tensors = (q, k, v, g, beta) + (() if initial_state is None else (initial_state,))
    check_triton("chunk_gated_delta_rule_triton", *tensors)
    _check(q, k, v, g, beta, initial_state, chunk_size)
    dtype, groups = q.dtype, v.shape[2] // k.shape[2]
    # heads first, fp32, contiguous: (B, H, T, D); q and k shared by `groups` heads
    q, k, v = (x.float().transpose(1, 2).contiguous() for x in (q, k, v))
    if groups > 1:
        q, k = (x.repeat_interleave(groups, dim=1) for x in (q, k))
    if use_qk_l2norm_in_kernel:  # x / √(Σx² + 1e-6), as the torch form
        q, k = (
            x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6) for x in (q, k)
        )
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    g, beta = (x.float().transpose(1, 2).contiguous() for x in (g, beta))
    b, h, _, dk = k.shape
    s0 = (
        v.new_zeros(b, h, dk, v.shape[-1])
        if initial_state is None
        else initial_state.float().contiguous()
    )
    fp32 = dtype in (torch.float32, torch.float64)  # plain TF32 for 16-bit inputs
    o, s = _ChunkGatedDelta.apply(q, k, v, g, beta, s0, chunk_size, fp32)
    return o.transpose(1, 2).to(dtype), (s if output_final_state else None)

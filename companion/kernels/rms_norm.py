"""The pre-norm block's residual add and RMSNorm fused into one Triton kernel (chapters
02 and 06).

Shape legend: ``x``, ``residual`` ``(..., D)`` with D ≤ 8192; ``weight`` ``(D,)``; N =
the number of rows (every axis but the last).

A pre-norm block adds a sublayer's output into the residual stream, ``h = x +
residual``, then normalises ``h`` for the next sublayer. Written in PyTorch that is two
kernels and ``h`` crosses memory three times (written by the add, read back twice by the
norm's statistics and its scaling). Here one program holds a tile of rows in registers:
it reads ``x`` and ``residual`` once and writes ``h`` and ``y`` once, so a
memory-bound step moves 4·N·D elements instead of 6·N·D. The backward kernel
fuses the same way: the gradient reaching ``h`` from the stream and the one coming back
through the norm are added in registers, and ``x`` and ``residual`` share it. The
result equals :func:`~companion.layers.norms.rms_norm_reference` applied to ``x +
residual`` (the sum rounded to ``x``'s dtype first, as PyTorch rounds it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from companion.checks import check_dtypes_match, check_number, check_positive
from companion.kernels import check_triton

__all__ = ["add_rms_norm"]

MAX_D = 8192
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _fwd_kernel(
    X, R, W, Y, H, RSTD, n_rows, d, eps, offset,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < d)
    at = rows[:, None].to(tl.int64) * d + cols[None, :]  # no int32 overflow past 2³¹
    x = tl.load(X + at, mask=mask, other=0.0)
    r = tl.load(R + at, mask=mask, other=0.0)
    h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded, as torch adds
    tl.store(H + at, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=1) / d + eps)  # (ROWS,)
    w = tl.load(W + cols, mask=cols < d, other=0.0).to(tl.float32) + offset
    y = hf * rstd[:, None] * w[None, :]
    tl.store(Y + at, y.to(x.dtype), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rows < n_rows)


@triton.jit
def _bwd_kernel(
    DY, DH, H, W, RSTD, DX, DW_PART, n_rows, d, offset,
    HAS_DH: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    w = tl.load(W + cols, mask=cols < d, other=0.0).to(tl.float32) + offset
    dw = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for tile in range(pid, tl.cdiv(n_rows, ROWS), n_programs):
        rows = tile * ROWS + tl.arange(0, ROWS)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < d)
        at = rows[:, None].to(tl.int64) * d + cols[None, :]
        hf = tl.load(H + at, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + at, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)
        hhat = hf * rstd[:, None]  # the normalised row
        dw += dy * hhat
        wdy = dy * w[None, :]
        # d/dh of h·rstd(h): rstd · (g − ĥ · mean(g · ĥ)), with g = dy · w
        c = tl.sum(wdy * hhat, axis=1) / d
        dh = rstd[:, None] * (wdy - hhat * c[:, None])
        if HAS_DH:  # the residual stream's own gradient into h
            dh += tl.load(DH + at, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + at, dh.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PART + pid * d + cols, tl.sum(dw, axis=0), mask=cols < d)


def _tile(d: int) -> tuple[int, int, int]:
    """(BLOCK, ROWS, num_warps): the row padded to a power of two; rows per program
    until a tile holds about 4096 elements."""
    block = triton.next_power_of_2(d)
    rows = max(1, min(16, 4096 // block))
    return block, rows, min(16, max(1, block * rows // 512))


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                offset: float) -> tuple[Tensor, Tensor]:  # fmt: skip
        d = x.shape[-1]
        x2, r2 = x.reshape(-1, d).contiguous(), residual.reshape(-1, d).contiguous()
        w = weight.contiguous()
        n = x2.shape[0]
        y, h = torch.empty_like(x2), torch.empty_like(x2)
        rstd = torch.empty(n, device=x.device, dtype=torch.float32)
        block, rows, warps = _tile(d)
        grid = (triton.cdiv(n, rows),)
        _fwd_kernel[grid](
            x2, r2, w, y, h, rstd, n, d, eps, offset,
            ROWS=rows, BLOCK=block, num_warps=warps,
        )  # fmt: skip
        ctx.save_for_backward(h, w, rstd)
        ctx.offset = offset
        ctx.set_materialize_grads(False)
        return y.view(x.shape), h.view(x.shape)

    @staticmethod
    def backward(ctx, dy: Tensor | None, dh: Tensor | None) -> tuple:
        h, w, rstd = ctx.saved_tensors
        if dy is None:  # only h was used: the norm passes nothing back
            return dh, dh, None, None, None
        shape, (n, d) = dy.shape, h.shape
        dy2 = dy.reshape(n, d).contiguous()
        dh2 = dh.reshape(n, d).contiguous() if dh is not None else dy2
        dx = torch.empty_like(h)
        block, rows, warps = _tile(d)
        tiles = triton.cdiv(n, rows)
        if h.device.type == "cuda":
            sms = torch.cuda.get_device_properties(h.device).multi_processor_count
            programs = min(tiles, 4 * sms)
        else:  # the interpreter: few programs, each looping over its tiles
            programs = min(tiles, 4)
        dw_part = torch.empty(programs, d, device=h.device, dtype=torch.float32)
        _bwd_kernel[(programs,)](
            dy2, dh2, h, w, rstd, dx, dw_part, n, d, ctx.offset,
            HAS_DH=dh is not None, ROWS=rows, BLOCK=block, num_warps=warps,
        )  # fmt: skip
        dw = dw_part.sum(0).to(w.dtype)  # each program's partial sum, added once
        dx = dx.view(shape)
        return dx, dx, dw, None, None


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6, offset: float = 0.0
) -> tuple[Tensor, Tensor]:
    """``(y, h)``: ``h = x + residual`` in ``x``'s dtype and ``y`` = RMSNorm(h) · (offset
    + weight), computed in fp32 and rounded to ``x``'s dtype; differentiable in ``x``,
    ``residual`` and ``weight``.

    ``offset=1`` is Gemma's gain stored as ``1 + w``. The numbers match
    :func:`~companion.layers.norms.rms_norm_reference` ``(x + residual, weight, eps,
    offset)``.
    """
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"{name} must be float16, bfloat16 or float32, got {t.dtype}"
            )
    check_triton("add_rms_norm", x, residual, weight)
    check_dtypes_match(x=x, residual=residual)
    if residual.shape != x.shape:
        raise ValueError(
            f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
        )
    d = x.shape[-1] if x.dim() else 0
    if not 1 <= d <= MAX_D:
        raise ValueError(f"x's last dimension D must be in [1, {MAX_D}], got {d}")
    if weight.shape != (d,):
        raise ValueError(
            f"weight must have shape (D,) = ({d},), got {tuple(weight.shape)}"
        )
    check_positive("eps", eps)
    check_number("offset", offset, minimum=-float("inf"))
    return _AddRMSNorm.apply(x, residual, weight, float(eps), float(offset))

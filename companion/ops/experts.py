"""The experts' computation, on tensors: a loop over experts and the grouped form
(chapter 10).

Shape legend: N tokens, d model width, E experts, k experts per token, F hidden width of
one expert, S = N·k (token, expert) pairs. Both forms have one signature:
:func:`experts_reference`, a loop over experts with ``index_add``, and
:func:`experts_grouped`, the (token, expert) pairs sorted by expert and multiplied
segment by segment in one grouped matmul (:func:`grouped_matmul`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from companion.checks import check_choice

__all__ = [
    "EXPERT_FORMS",
    "ContiguousGrad",
    "EXPERT_IMPLS",
    "GROUPED_KERNELS",
    "expert_load",
    "experts_grouped",
    "experts_reference",
    "gpt_oss_glu",
    "grouped_matmul",
    "grouped_mm_available",
    "swiglu",
    "swiglu_clamped",
]

GROUPED_KERNELS = ("segments", "grouped_mm")


def expert_load(indices: Tensor, n_experts: int) -> Tensor:
    """How many (token, slot) pairs each expert received: ``indices (N, k)`` -> ``(E,)``
    int64."""
    flat = indices.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def swiglu(h: Tensor) -> Tensor:
    """``(S, 2F)`` rows ``[gate; up]`` -> ``silu(gate) · up`` ``(S, F)``."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_clamped(h: Tensor, limit: float) -> Tensor:
    """DeepSeek-V4's SwiGLU on ``(S, 2F)`` rows ``[gate; up]``: gate clamped above at
    ``limit``, up to ±``limit``, then ``silu(gate) · up`` ``(S, F)``."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def gpt_oss_glu(h: Tensor, limit: float = 7.0, alpha: float = 1.702) -> Tensor:
    """gpt-oss's clamped SwiGLU on interleaved ``(S, 2F)``: (up + 1)·gate·σ(α·gate)."""
    gate = h[..., 0::2].clamp(max=limit)
    up = h[..., 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def experts_reference(
    x: Tensor,
    weights: Tensor,
    indices: Tensor,
    gate_up: Tensor,
    down: Tensor,
    act: Callable[[Tensor], Tensor],
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
) -> Tensor:
    """Σ_j weights[n, j]·expert_{indices[n, j]}(x[n]): one plain loop over the E
    experts.

    ``x (N, d)``, ``weights (N, k)``, ``indices (N, k)``, ``gate_up (E, 2F, d)``,
    ``down (E, d, F)``, biases ``(E, 2F)`` and ``(E, d)``; returns ``(N, d)``.
    """
    assert weights.shape == indices.shape and x.shape[0] == indices.shape[0]
    out = torch.zeros_like(x)  # (N, d)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(indices == e)  # (n_e,) each
        if token.numel() == 0:
            continue
        h = F.linear(
            x[token], gate_up[e], None if gate_up_bias is None else gate_up_bias[e]
        )
        y = F.linear(
            act(h), down[e], None if down_bias is None else down_bias[e]
        )  # (n_e, d)
        out = out.index_add(0, token, y * weights[token, slot, None].to(y.dtype))
    return out


class ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (``_grouped_mm``
    needs it)."""

    @staticmethod
    def forward(ctx: object, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> Tensor:
        return grad.contiguous()


@functools.cache
def _grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Try ``torch._grouped_mm`` forward and backward once on this device and dtype."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        with torch.enable_grad():  # the caller may be under no_grad
            x = torch.ones(3, 16, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
            offs = torch.tensor([1, 3], device=device, dtype=torch.int32)
            out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
            ContiguousGrad.apply(out).sum().backward()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def grouped_mm_available(x: Tensor, weight: Tensor) -> bool:
    """True if ``torch._grouped_mm`` runs on this device and dtype and the data are
    aligned."""
    size = x.element_size()
    aligned = (
        x.dtype == weight.dtype
        and x.is_contiguous()
        and all(t.data_ptr() % 16 == 0 for t in (x, weight))
        and all(n * size % 16 == 0 for n in weight.shape[1:])
    )
    return aligned and _grouped_mm_runs(x.device, x.dtype)


def grouped_matmul(
    x: Tensor, weight: Tensor, counts: Tensor, kernel: str = "segments"
) -> Tensor:
    """Rows of ``x (S, in)`` sorted by expert, segment e times ``weight[e].T``: ``(S,
    out)``.

    ``weight (E, out, in)``, ``counts (E,)`` rows per expert, in order. ``kernel``:
    ``"segments"`` one matmul per non-empty segment (runs everywhere), ``"grouped_mm"``
    one ``torch._grouped_mm`` call, which raises where it cannot run (nothing falls
    back).
    """
    check_choice("kernel", kernel, GROUPED_KERNELS)
    if kernel == "grouped_mm":
        if not grouped_mm_available(x, weight):
            raise ValueError(
                f"kernel='grouped_mm' is not available for {x.dtype} on {x.device.type} "
                f"(torch {torch.__version__}, or unaligned data); use kernel='segments'"
            )
        offsets = counts.cumsum(0).to(torch.int32)  # (E,) segment ends
        out = torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
        return ContiguousGrad.apply(out)
    pieces, start = [], 0
    for e, n in enumerate(counts.tolist()):  # one host sync, then E matmuls at most
        if n:
            pieces.append(x[start : start + n] @ weight[e].T)
            start += n
    return torch.cat(pieces)


def experts_grouped(
    x: Tensor,
    weights: Tensor,
    indices: Tensor,
    gate_up: Tensor,
    down: Tensor,
    act: Callable[[Tensor], Tensor],
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    kernel: str = "segments",
) -> Tensor:
    """:func:`experts_reference`, fast: sort the S pairs by expert, two grouped matmuls.

    The pairs' outputs are summed back per token with ``index_add`` (atomic, so not
    bitwise reproducible, on GPUs).
    """
    n, k = indices.shape
    flat = indices.reshape(-1)  # (S,)
    order = flat.argsort(stable=True)  # (S,) pair positions, grouped by expert
    expert, token = flat[order], order // k  # (S,) each
    counts = expert_load(flat, gate_up.shape[0])  # (E,)
    h = grouped_matmul(x.index_select(0, token), gate_up, counts, kernel)  # (S, 2F)
    if gate_up_bias is not None:
        h = h + gate_up_bias.index_select(0, expert)
    y = grouped_matmul(act(h), down, counts, kernel)  # (S, d)
    if down_bias is not None:
        y = y + down_bias.index_select(0, expert)
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add(0, token, y)  # (N, d)


# the experts' forms, by the name a layer's ``impl`` gives: the loop, the grouped form on
# per-segment matmuls, the grouped form on one torch._grouped_mm call
EXPERT_FORMS = {
    "reference": experts_reference,
    "grouped": experts_grouped,
    "grouped_mm": functools.partial(experts_grouped, kernel="grouped_mm"),
}
EXPERT_IMPLS = tuple(EXPERT_FORMS)

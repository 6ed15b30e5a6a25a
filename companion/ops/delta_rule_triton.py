"""The chunked gated delta rule with its forward on Triton kernels (chapter 11).

:func:`chunk_gated_delta_rule_triton` has the signature, layouts and result of
:func:`~companion.ops.delta_rule.chunk_gated_delta_rule` (shape legend in
:mod:`companion.ops.linear_attention`): the same preparation (heads first, shared q/k
heads, the L2 norm, the scale), then the forward by the two kernels of
:func:`~companion.kernels.gated_delta.gated_delta_chunks` and the gradients by autograd
through :func:`~companion.ops.delta_rule.delta_rule_chunks`, the torch chunk form, on
inputs kept from the forward. Training therefore works, but its backward is PyTorch, not
a kernel. Needs the ``gpu`` extra; ``impl="triton"`` in
:class:`~companion.layers.gated_deltanet.GatedDeltaNet` calls it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from companion.kernels.gated_delta import gated_delta_chunks
from companion.ops.delta_rule import delta_rule_chunks
from companion.ops.linear_attention import heads_first, heads_last

__all__ = ["chunk_gated_delta_rule_triton"]


class _KernelChunks(torch.autograd.Function):
    """Forward by the kernels; backward by autograd through the torch chunk form."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, s, c: int, fp32: bool):  # noqa: ANN001
        ctx.save_for_backward(q, k, v, g, beta, s)
        ctx.c = c
        o, s_end = gated_delta_chunks(q, k, v, g, beta, s, c, fp32)
        return o.to(q.dtype), s_end.to(q.dtype)

    @staticmethod
    def backward(ctx, do: Tensor, ds: Tensor):  # noqa: ANN205
        inputs = [x.detach().requires_grad_() for x in ctx.saved_tensors]
        with torch.enable_grad():
            o, s = delta_rule_chunks(*inputs, ctx.c)
            grads = torch.autograd.grad((o, s), inputs, (do, ds), allow_unused=True)
        return (*grads, None, None)


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
    """:func:`~companion.ops.delta_rule.chunk_gated_delta_rule` with the forward on the
    Triton kernels: same arguments and result; ``chunk_size`` 16, 32 or 64; D_k and D_v
    16, 32, 64 or 128."""
    dtype = q.dtype
    q, k, v, (g, beta), s = heads_first(
        q, k, v, {"g": g, "beta": beta}, initial_state, scale, use_qk_l2norm_in_kernel
    )
    fp32 = dtype in (torch.float32, torch.float64)  # plain TF32 for 16-bit inputs
    o, s = _KernelChunks.apply(q, k, v, g, beta, s, chunk_size, fp32)
    return heads_last(o, s, dtype, output_final_state)

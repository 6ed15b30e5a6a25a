"""Cross-entropy over a large vocabulary without the full logits tensor (chapter 12).

Shape legend: N tokens (batch × sequence, flattened), d model width, V vocabulary, C
rows per chunk. ``hidden (N, d)`` is the final-normed residual stream, ``weight (V, d)``
the output head (the embedding, if tied), ``targets (N,)`` the next-token ids.

:func:`naive_cross_entropy` is the reference: it builds the ``(N, V)`` logits in fp32
and calls ``F.cross_entropy``; autograd keeps that tensor (and makes its gradient, the
same size) for the backward pass. :func:`chunked_cross_entropy` gives the same loss and
the same gradients, but only ever holds ``(C, V)`` logits: the forward keeps one
log-sum-exp per row, and the backward recomputes each chunk's logits, turns them into
softmax − one-hot, and accumulates the gradients of ``hidden`` and ``weight`` before
moving on. Both return the mean loss over the rows whose target is not ``ignore_index``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from companion.checks import check_int, check_targets

__all__ = [
    "ChunkedCrossEntropy",
    "chunked_cross_entropy",
    "logits_bytes",
    "naive_cross_entropy",
]


def logits_bytes(
    batch: int, seq_len: int, vocab_size: int, dtype_bytes: int = 4
) -> int:
    """Bytes of one ``(B, S, V)`` logits tensor: B·S·V·dtype_bytes (fp32 by default)."""
    for name, value in (
        ("batch", batch),
        ("seq_len", seq_len),
        ("vocab_size", vocab_size),
        ("dtype_bytes", dtype_bytes),
    ):
        check_int(name, value, 1)
    return batch * seq_len * vocab_size * dtype_bytes


def _check(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int) -> None:
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be (N, d) and weight (V, d) with the same d; got hidden "
            f"{tuple(hidden.shape)}, weight {tuple(weight.shape)}"
        )
    if targets.shape != (hidden.shape[0],) or targets.dtype not in (
        torch.int64,
        torch.int32,
    ):
        raise ValueError(
            f"targets must be integer ids of shape (N,) = ({hidden.shape[0]},); got "
            f"{tuple(targets.shape)} of dtype {targets.dtype}"
        )
    check_targets(targets, weight.shape[0], ignore_index)


def naive_cross_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, *, ignore_index: int = -100
) -> Tensor:
    """Mean cross-entropy of ``hidden @ weightᵀ`` against ``targets``, full ``(N, V)``
    logits."""
    _check(hidden, weight, targets, ignore_index)
    logits = hidden.float() @ weight.float().T  # (N, V), all of it at once
    return F.cross_entropy(logits, targets.long(), ignore_index=ignore_index)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Forward and backward over chunks of C rows; saves only hidden, weight and (N,)
    stats."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, ignore_index):  # noqa: ANN001
        n = hidden.shape[0]
        keep = targets != ignore_index
        count = keep.sum().clamp_min(1)
        safe = torch.where(keep, targets, 0).long()
        w = weight.float()
        lse = hidden.new_empty(n, dtype=torch.float32)
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            logits = (
                hidden[rows].float() @ w.T
            )  # (C, V): the only vocabulary-wide tensor
            lse[rows] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[rows, None]).squeeze(1)  # (C,)
            total += ((lse[rows] - picked) * keep[rows]).sum()
            del logits
        ctx.save_for_backward(hidden, weight, safe, keep, lse, count)
        ctx.chunk_size = chunk_size
        return total / count

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001
        hidden, weight, safe, keep, lse, count = ctx.saved_tensors
        w = weight.float()
        grad_h = torch.zeros_like(hidden, dtype=torch.float32)
        grad_w = torch.zeros_like(w)
        scale = grad_out / count
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            h = hidden[rows].float()
            probs = torch.exp(h @ w.T - lse[rows, None])  # (C, V): softmax, recomputed
            probs[torch.arange(probs.shape[0]), safe[rows]] -= 1.0  # − one-hot
            probs *= (scale * keep[rows])[:, None]  # d loss / d logits
            grad_h[rows] = probs @ w  # (C, d)
            grad_w += probs.T @ h  # (V, d)
            del probs
        return grad_h.to(hidden.dtype), grad_w.to(weight.dtype), None, None, None


def chunked_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int = 1024,
) -> Tensor:
    """The same loss as :func:`naive_cross_entropy`, never holding more than ``(C, V)``
    logits."""
    _check(hidden, weight, targets, ignore_index)
    check_int("chunk_size", chunk_size, 1)
    return ChunkedCrossEntropy.apply(hidden, weight, targets, chunk_size, ignore_index)

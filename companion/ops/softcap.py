"""Two ways to keep logits from growing without bound, before QK-norm (chapter 06).

Shape legend: ``logits (..., V)``, the last dimension the one a softmax runs over
(the vocabulary of an output layer, the keys of an attention row, the experts of a
router); ``x`` any shape.

- :func:`soft_cap`: ``cap · tanh(x / cap)``, Gemma 2's logit soft-capping (50 on the
  attention logits, 30 on the final ones). About the identity while ``|x| ≪ cap``,
  never beyond ``±cap``.
- :func:`z_loss`: ``weight · mean(log² Z)``, ``Z = Σ exp(logits)`` over the last
  dimension: PaLM's auxiliary loss on the output logits (weight ``1e-4``), ST-MoE's on
  the router logits. A softmax ignores a shift of all its logits; the z-loss pins that
  shift so that ``log Z`` stays near 0 and the logits cannot drift upward together.
"""

from __future__ import annotations

import torch
from torch import Tensor

from companion.checks import check_number

__all__ = ["soft_cap", "z_loss"]


def soft_cap(x: Tensor, cap: float) -> Tensor:
    """``cap · tanh(x / cap)``: smooth, odd, slope 1 at 0, bounded by ``cap``."""
    check_number("cap", cap)
    if cap == 0:
        raise ValueError("cap must be > 0, got 0")
    return cap * torch.tanh(x / cap)


def z_loss(logits: Tensor, weight: float = 1e-4) -> Tensor:
    """``weight`` times the mean over rows of ``(log Σ_j exp logits_j)²``, in fp32."""
    check_number("weight", weight, 0.0)
    log_z = torch.logsumexp(logits.float(), dim=-1)  # (...,): one per row
    return weight * log_z.pow(2).mean()

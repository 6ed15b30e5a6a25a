"""Normalization layers (chapters 02, 06).

Shape legend: ``(..., d)`` in, same shape out; statistics over the last dimension.
:func:`layer_norm_reference` is the formula written out; :class:`LayerNorm` runs the fused
``F.layer_norm`` with the same parameters (tests check they agree, forward and backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LayerNorm", "build_norm", "layer_norm_reference"]


def layer_norm_reference(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float = 1e-5
) -> Tensor:
    """(x − mean) / √(var + eps) · weight + bias, with the biased variance, in fp32."""
    xf = x.float()
    mean = xf.mean(dim=-1, keepdim=True)
    var = ((xf - mean) ** 2).mean(dim=-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm (Ba et al., 2016) with an optional bias; the fast path of the reference."""

    def __init__(self, d: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


def build_norm(kind: str, d: int, eps: float, bias: bool = True) -> nn.Module:
    """Build the norm a config names (``"layernorm"``; later chapters add more)."""
    if kind == "layernorm":
        return LayerNorm(d, eps=eps, bias=bias)
    raise ValueError(f"norm must be one of ('layernorm',), got {kind!r}")

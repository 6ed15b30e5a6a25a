"""Normalization layers: LayerNorm and RMSNorm (chapters 02, 06), and DyT, which
replaces them without normalizing (chapter 06).

Shape legend: ``(..., d)`` in, same shape out; statistics over the last dimension.
:func:`layer_norm_reference` and :func:`rms_norm_reference` are the formulas written
out; :class:`LayerNorm` and :class:`RMSNorm` run the fused kernels with the same
parameters (tests check they agree, forward and backward). :class:`DyT` takes no
statistics at all: it squashes each number on its own with a tanh of learned slope.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "NORMS",
    "DyT",
    "LayerNorm",
    "RMSNorm",
    "build_norm",
    "layer_norm_reference",
    "rms_norm_reference",
]

NORMS = ("layernorm", "rmsnorm")


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
    """LayerNorm (Ba et al., 2016) with an optional bias; the fast path of the
    reference."""

    def __init__(self, d: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


def rms_norm_reference(
    x: Tensor, weight: Tensor | None, eps: float = 1e-6, offset: float = 0.0
) -> Tensor:
    """x / √(mean(x²) + eps) · (offset + weight), in fp32: no mean is removed, no
    bias."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (offset + weight.float())
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich, 2019); ``offset=1`` stores the gain as 1 + w
    (Gemma)."""

    def __init__(self, d: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.full((d,), 1.0 - offset))

    def forward(self, x: Tensor) -> Tensor:
        if self.offset == 0.0 and x.dtype == self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one kernel
        y = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return (y * (self.offset + self.weight.float())).to(x.dtype)


class DyT(nn.Module):
    """Dynamic Tanh (Zhu et al., 2025): ``weight ⊙ tanh(alpha · x) + bias``, ``alpha``
    one learned scalar (the paper's default start 0.5). No mean, no RMS: each number is
    squashed on its own, so a token's output never depends on the other tokens or
    features. Not one of ``NORMS``: pass it to a block as a norm module."""

    def __init__(self, d: int, alpha: float = 0.5, bias: bool = True) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(float(alpha)))
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = torch.tanh(self.alpha * x.float()) * self.weight.float()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)


def build_norm(
    kind: str, d: int, eps: float, bias: bool = True, offset: float = 0.0
) -> nn.Module:
    """Build the norm a config names: ``"layernorm"`` or ``"rmsnorm"``."""
    if kind == "layernorm":
        return LayerNorm(d, eps=eps, bias=bias)
    if kind == "rmsnorm":
        return RMSNorm(d, eps=eps, offset=offset)
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")

"""The position-wise feed-forward network of 2017 (chapters 02, 03, 07).

Shape legend: ``(..., d) -> (..., d_ff) -> (..., d)``. Applied to each token on its own.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ACTIVATIONS", "FeedForward"]

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


class FeedForward(nn.Module):
    """Two matrices and a nonlinearity: ``down(act(up(x)))``, with ``d_ff`` hidden units."""

    def __init__(
        self, d: int, d_ff: int, activation: str = "relu", bias: bool = True, dropout: float = 0.0
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
        self.up = nn.Linear(d, d_ff, bias=bias)
        self.down = nn.Linear(d_ff, d, bias=bias)
        self.act = ACTIVATIONS[activation]
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.dropout(self.act(self.up(x))))  # (..., d)

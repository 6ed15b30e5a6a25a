"""Position-wise feed-forward networks: the 2017 MLP and the gated GLU family (chapters
02, 07).

Shape legend: ``(..., d) -> (..., d_ff) -> (..., d)``. Applied to each token on its own.
The MLP has two matrices, ``down(act(up(x)))``; a GLU has three,
``down(act(gate(x)) * up(x))`` (SwiGLU with SiLU, GeGLU with GELU). ``"relu2"`` is
Primer's squared ReLU, ``relu(x)²``, used ungated in an MLP (Nemotron-4, the
modded-nanogpt speedrun).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from companion.checks import check_choice, check_int

__all__ = [
    "ACTIVATIONS",
    "FFN_FORMS",
    "FeedForward",
    "GatedFeedForward",
    "glu_hidden_size",
    "relu_squared",
]

FFN_FORMS = ("mlp", "glu")  # FeedForward, GatedFeedForward


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


def relu_squared(x: Tensor) -> Tensor:
    """Primer's squared ReLU, ``max(0, x)²``: 0 below zero, ``x²`` above."""
    return F.relu(x).square()  # slope 2·max(0, x): continuous at 0, unlike ReLU's


ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
    "silu": F.silu,
    "relu2": relu_squared,
}


class FeedForward(nn.Module):
    """Two matrices and a nonlinearity: ``down(act(up(x)))``, with ``d_ff`` hidden
    units."""

    def __init__(
        self,
        d: int,
        d_ff: int,
        activation: str = "relu",
        bias: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        check_choice("activation", activation, tuple(ACTIVATIONS))
        self.up = nn.Linear(d, d_ff, bias=bias)
        self.down = nn.Linear(d_ff, d, bias=bias)
        self.act = ACTIVATIONS[activation]
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.dropout(self.act(self.up(x))))  # (..., d)


class GatedFeedForward(nn.Module):
    """A GLU: ``down(act(gate(x)) * up(x))`` with three matrices and ``d_ff`` hidden
    units."""

    def __init__(
        self,
        d: int,
        d_ff: int,
        activation: str = "silu",
        bias: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        check_choice("activation", activation, tuple(ACTIVATIONS))
        self.gate = nn.Linear(d, d_ff, bias=bias)
        self.up = nn.Linear(d, d_ff, bias=bias)
        self.down = nn.Linear(d_ff, d, bias=bias)
        self.act = ACTIVATIONS[activation]
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.dropout(self.act(self.gate(x)) * self.up(x)))  # (..., d)


def glu_hidden_size(
    d: int, multiple_of: int = 256, multiplier: float | None = None
) -> int:
    """The GLU width that keeps an MLP's parameters: ⌈(multiplier ·) 8d/3⌉ to
    ``multiple_of``.

    Llama 2 7B: d = 4096 gives 11,008; Llama 3 8B (multiplier 1.3, multiple 1024)
    14,336.
    """
    check_int("d", d, 1)
    check_int("multiple_of", multiple_of, 1)
    hidden = int(2 * 4 * d / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * -(-hidden // multiple_of)

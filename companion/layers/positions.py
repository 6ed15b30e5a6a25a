"""Absolute position signals added to token embeddings (chapters 02, 03, 05).

Shape legend: T positions, d model width. Both modules map position ids ``(..., T)`` to
vectors ``(..., T, d)``; RoPE and its relatives (chapter 05) rotate q and k instead.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = [
    "POSITIONS",
    "LearnedPositions",
    "SinusoidalPositions",
    "sinusoid_shift_matrix",
    "sinusoidal_table",
]

# the position schemes a model can use: the two added here, rotary (layers.rotary), none
# (NoPE), and ALiBi's distance bias on the attention scores (layers.alibi)
POSITIONS = ("sinusoidal", "learned", "rope", "none", "alibi")


def sinusoidal_table(n_positions: int, d: int, base: float = 10000.0) -> Tensor:
    """The 2017 table: PE[pos, 2i] = sin(pos/base^(2i/d)), PE[pos, 2i+1] = cos(same)."""
    if d % 2 != 0:
        raise ValueError(f"sinusoidal positions need an even width d, got d={d}")
    f64 = {"dtype": torch.float64, "device": "cpu"}  # MPS has no float64: on the CPU
    pos = torch.arange(n_positions, **f64).unsqueeze(1)  # (T, 1)
    inv_freq = base ** (-torch.arange(0, d, 2, **f64) / d)  # (d/2,)
    angles = pos * inv_freq  # (T, d/2)
    table = torch.empty(n_positions, d, **f64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table.float().to(torch.get_default_device())  # a `with device` block's


class SinusoidalPositions(nn.Module):
    """Fixed sinusoids, computed once for ``max_positions`` positions (no
    parameters)."""

    def __init__(self, d: int, max_positions: int, base: float = 10000.0) -> None:
        super().__init__()
        self.register_buffer(
            "table", sinusoidal_table(max_positions, d, base), persistent=False
        )

    def forward(self, positions: Tensor) -> Tensor:
        _check_range(positions, self.table.shape[0], "sinusoidal table")
        return self.table[positions]  # (..., T, d)


class LearnedPositions(nn.Module):
    """A learned table of ``max_positions`` vectors (GPT-2, BERT): no signal past its
    end."""

    def __init__(self, d: int, max_positions: int) -> None:
        super().__init__()
        self.table = nn.Embedding(max_positions, d)

    def forward(self, positions: Tensor) -> Tensor:
        _check_range(positions, self.table.num_embeddings, "learned position table")
        return self.table(positions)  # (..., T, d)


def _check_range(positions: Tensor, n: int, what: str) -> None:
    if positions.numel() and int(positions.max()) >= n:
        raise ValueError(
            f"position {int(positions.max())} is past the end of the {what} "
            f"(max_seq_len={n}); use a prompt of at most {n} tokens"
        )


def sinusoid_shift_matrix(k: int, d: int, base: float = 10000.0) -> Tensor:
    """The fixed ``(d, d)`` matrix M with PE[pos + k] = PE[pos] @ M for every pos
    (chapter 03).

    Each (sin, cos) pair rotates by the angle k·ω_i, whatever pos is.
    """
    if d % 2 != 0:
        raise ValueError(f"sinusoidal positions need an even width d, got d={d}")
    m = torch.zeros(d, d)
    for i in range(d // 2):
        w = k * base ** (-2 * i / d)
        c, s = math.cos(w), math.sin(w)
        # [sin(a+w), cos(a+w)] = [sin a, cos a] @ [[c, -s], [s, c]]
        m[2 * i, 2 * i], m[2 * i, 2 * i + 1] = c, -s
        m[2 * i + 1, 2 * i], m[2 * i + 1, 2 * i + 1] = s, c
    return m

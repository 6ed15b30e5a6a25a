"""Causal dilated convolutions: the stack of ByteNet and WaveNet, and with no dilation
the stack of ConvS2S (chapter 01).

Shape legend: B batch, T positions, C channels (the width, the same in every layer), k
kernel size, L layers. A stack maps ``x (B, T, C)`` to ``(B, T, C)``.

Layer l has dilation ``base**l``: its k taps read positions t, t − base**l, …,
t − (k − 1)·base**l. It is causal because it pads (k − 1)·dilation zeros on the left
only, so output t never reads an input after t. With ``base = k`` the L layers reach
back k**L − 1 positions, every offset in between exactly one way (layer l supplies the
l-th digit of the offset written in base k); with ``base = 1`` (no dilation) they reach
back only L·(k − 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from companion.checks import check_int

__all__ = ["CausalConvStack", "dilations"]


def dilations(n_layers: int, base: int) -> list[int]:
    """The dilation of each layer: ``1, base, base², …`` (``n_layers`` of them)."""
    check_int("n_layers", n_layers, 1)
    check_int("base", base, 1)
    return [base**layer for layer in range(n_layers)]


class CausalConvStack(nn.Module):
    """``n_layers`` residual layers ``h + tanh(conv(h))`` of causal 1-D convolutions,
    layer l with dilation ``dilation_base**l`` (default base: the kernel size).

    tanh's derivative is never zero, so an input gradient of exactly zero means that no
    path connects the two positions, not that a unit happened to be switched off.
    """

    def __init__(
        self,
        channels: int,
        kernel_size: int,
        n_layers: int,
        *,
        dilation_base: int | None = None,
    ) -> None:
        super().__init__()
        check_int("channels", channels, 1)
        check_int("kernel_size", kernel_size, 1)
        base = kernel_size if dilation_base is None else dilation_base
        check_int("dilation_base", base, 1)
        self.channels, self.kernel_size = channels, kernel_size
        self.dilations = dilations(n_layers, base)
        self.convs = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, dilation=d)
            for d in self.dilations
        )

    @property
    def receptive_field(self) -> int:
        """The number of positions one output reads (itself and the
        ``(k − 1)·Σ dilations`` before it)."""
        return 1 + (self.kernel_size - 1) * sum(self.dilations)

    def layer(self, h: Tensor, index: int) -> Tensor:
        """Layer ``index`` on ``h (B, C, T)``, Conv1d's layout: pad the past, convolve,
        add the residual."""
        conv = self.convs[index]
        pad = (self.kernel_size - 1) * conv.dilation[0]
        # the left zeros stand for positions before the sequence; nothing on the right
        return h + torch.tanh(conv(F.pad(h, (pad, 0))))  # (B, C, T)

    def hidden_states(self, x: Tensor) -> list[Tensor]:
        """The output of every layer for ``x (B, T, C)``: L tensors ``(B, T, C)``."""
        if x.ndim != 3 or x.shape[-1] != self.channels or x.shape[1] < 1:
            raise ValueError(
                f"x must have shape (B, T, {self.channels}) with T >= 1, "
                f"got {tuple(x.shape)}"
            )
        h = x.transpose(1, 2)  # (B, C, T)
        outs = []
        for index in range(len(self.convs)):
            h = self.layer(h, index)
            outs.append(h.transpose(1, 2))  # (B, T, C)
        return outs

    def forward(self, x: Tensor) -> Tensor:
        """``x (B, T, C)`` -> the last layer's output ``(B, T, C)``."""
        return self.hidden_states(x)[-1]

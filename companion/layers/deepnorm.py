"""DeepNorm: the 2017 Post-LN block, made trainable at depth (chapter 06).

Shape legend: ``x (B, T, d)`` in and out of every sublayer ``f``.

Wang et al. (2022) keep the norm on the identity path, ``x ← LN(α·x + f(x))``, and
make it safe at depth with two constants that depend on the number of layers: the
stream is weighted by ``α > 1`` before the norm, so each sublayer's share of the sum
starts small, and the initial weights of the sublayers' value-path matrices (the
FFN's, the attention's value and output projections; not the query and key ones)
are multiplied by ``β < 1``.

- :func:`deepnorm_constants`: ``(α, β)`` for each stack, from the paper's table.
- :class:`DeepNormResidual`: the residual rule, as a module a block calls in place of
  its placement's (``TransformerBlock.connect``).
- :func:`deepnorm_`: turn a Post-LN stack of ``TransformerBlock`` in place into
  DeepNorm: the rule at every sublayer, and the ``β`` scaling of the initial weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from companion.checks import check_int, check_number

__all__ = ["DeepNormResidual", "deepnorm_", "deepnorm_constants"]


def deepnorm_constants(
    encoder_layers: int = 0, decoder_layers: int = 0
) -> dict[str, tuple[float, float]]:
    """``{"encoder": (α, β), "decoder": (α, β)}`` for the stacks that have layers.

    One stack of N layers (encoder-only or decoder-only): α = (2N)^¼, β = (8N)^-¼.
    Encoder-decoder, N encoder and M decoder layers: the encoder takes
    α = 0.81 (N⁴M)^(1/16), β = 0.87 (N⁴M)^(-1/16); the decoder α = (3M)^¼,
    β = (12M)^-¼.
    """
    check_int("encoder_layers", encoder_layers, 0)
    check_int("decoder_layers", decoder_layers, 0)
    n, m = encoder_layers, decoder_layers
    if n == m == 0:
        raise ValueError("give the number of encoder layers, decoder layers or both")
    if n == 0 or m == 0:  # one stack
        name, layers = ("encoder", n) if m == 0 else ("decoder", m)
        return {name: ((2 * layers) ** 0.25, (8 * layers) ** -0.25)}
    both = (n**4 * m) ** (1 / 16)
    return {
        "encoder": (0.81 * both, 0.87 / both),
        "decoder": ((3 * m) ** 0.25, (12 * m) ** -0.25),
    }


class DeepNormResidual(nn.Module):
    """``norm(alpha · x + f(x))``: Post-LN with the stream weighted by ``alpha``."""

    def __init__(self, alpha: float) -> None:
        super().__init__()
        check_number("alpha", alpha)
        self.alpha = alpha

    def forward(
        self,
        x: Tensor,
        norm: nn.Module,
        out_norm: nn.Module | None,
        sublayer: Callable[[Tensor], Tensor],
    ) -> Tensor:
        return norm(self.alpha * x + sublayer(x))


def _value_path(block: nn.Module) -> list[Tensor]:
    """The weights DeepNorm scales by β: every FFN matrix, and of each attention
    (self and cross) the value rows (of the fused ``qkv`` or of ``v_proj``) and the
    output projection."""
    chosen = [p for p in block.ffn.parameters() if p.ndim == 2]
    for attn in (block.attn, block.cross_attn):
        if attn is None:
            continue
        if hasattr(attn, "qkv"):
            q_width, kv_width, _ = attn.widths
            chosen.append(attn.qkv.weight[q_width + kv_width :])  # a view: the v rows
        else:
            chosen.append(attn.v_proj.weight)
        chosen.append(attn.out_proj.weight)
    return chosen


def deepnorm_(blocks: nn.Module, alpha: float, beta: float) -> nn.Module:
    """Make ``blocks`` (a model with ``.blocks``, or the list) DeepNorm, in place.

    Every block must be Post-LN (its norm is the one DeepNorm keeps) with dropout 0
    and a plain residual; the value-path weights are multiplied by ``beta``.
    """
    check_number("beta", beta)
    stack = getattr(blocks, "blocks", blocks)
    for block in stack:
        if block.placement != "post" or block.dropout.p or block.residuals is not None:
            raise ValueError(
                "deepnorm_ needs Post-LN blocks with dropout 0 and no residual rule of "
                f"their own; got placement={block.placement!r}, "
                f"dropout={block.dropout.p}"
            )
        sites = ("attn", "ffn") if block.cross_attn is None else ("attn", "cross", "ffn")
        block.residuals = nn.ModuleDict({s: DeepNormResidual(alpha) for s in sites})
        with torch.no_grad():
            for weight in _value_path(block):
                weight.mul_(beta)
    return blocks

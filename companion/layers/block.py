"""The Transformer block: a token mixer and an FFN, each inside a residual connection
(chapters 02-04, 06-12).

Shape legend: ``x (B, T, d)`` in and out; ``context (B, S, d)`` for cross-attention.
Around each sublayer f the residual stream is updated as ``placement`` says:
``pre`` x + f(norm(x)) (GPT-2 onward); ``post`` norm(x + f(x)) (2017); ``sandwich``
x + norm'(f(norm(x))) (Gemma 2/3); ``post_branch`` x + norm'(f(x)) (Olmo 2/3).

One class serves every stack: a decoder-only LM (causal self-attention, FFN), an encoder
(bidirectional self-attention, FFN) and the 2017 decoder (causal self-attention,
cross-attention to the encoder, FFN). The block receives finished parts
(:func:`companion.models.builders.build_block` makes them from a config): which
attention, window or RoPE table a layer has was fixed when its token mixer was built.
The residual rule is a part too: the placement's (:meth:`TransformerBlock.residual`)
unless ``residuals`` gives a module for each sublayer, called the same way, which may
keep the stream in another shape (DeepSeek-V4 keeps several parallel streams).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from torch import Tensor, nn

from companion.checks import check_choice

__all__ = ["PLACEMENTS", "TransformerBlock"]

PLACEMENTS = ("pre", "post", "sandwich", "post_branch")


class TransformerBlock(nn.Module):
    """Self-attention (or another token mixer), optional cross-attention, then an FFN.

    ``norms`` = (mixer norm, mixer output norm, FFN norm, FFN output norm); a placement
    uses the first of each pair (``pre``, ``post``), the second (``post_branch``) or
    both (``sandwich``), and the others are None. ``residuals`` maps each sublayer
    (``"attn"``, ``"cross"`` if any, ``"ffn"``) to the module that replaces
    :meth:`residual` there, called as ``rule(x, norm, out_norm, sublayer)``; it needs
    ``dropout=0`` and a placement other than ``post``.
    """

    def __init__(
        self,
        attn: nn.Module,
        ffn: nn.Module,
        *,
        placement: str = "pre",
        norms: tuple[nn.Module | None, ...] = (None,) * 4,
        dropout: float = 0.0,
        cross_attn: nn.Module | None = None,
        cross_norm: nn.Module | None = None,
        cross_out_norm: nn.Module | None = None,
        residuals: Mapping[str, nn.Module] | None = None,
    ) -> None:
        super().__init__()
        check_choice("placement", placement, PLACEMENTS)
        if residuals is not None:
            sites = ("attn", "ffn") if cross_attn is None else ("attn", "cross", "ffn")
            _check_residuals(residuals, sites, placement, dropout)
        self.placement = placement
        self.attn_norm, self.attn_out_norm, ffn_norm, ffn_out_norm = norms
        self.attn = attn
        self.cross_norm, self.cross_out_norm, self.cross_attn = (
            cross_norm,
            cross_out_norm,
            cross_attn,
        )
        self.ffn_norm, self.ffn_out_norm = ffn_norm, ffn_out_norm
        self.ffn = ffn
        self.dropout = nn.Dropout(dropout)
        # None: the placement's rule (``residual``) at every sublayer
        self.residuals = None if residuals is None else nn.ModuleDict(residuals)

    def residual(
        self,
        x: Tensor,
        norm: nn.Module | None,
        out_norm: nn.Module | None,
        sublayer: Callable[[Tensor], Tensor],
    ) -> Tensor:
        """One sublayer inside its residual connection, norms where the placement puts
        them."""
        if self.placement == "post":
            return norm(x + self.dropout(sublayer(x)))
        h = sublayer(norm(x) if norm is not None else x)
        return x + self.dropout(out_norm(h) if out_norm is not None else h)

    def connect(
        self,
        site: str,
        x: Tensor,
        norm: nn.Module | None,
        out_norm: nn.Module | None,
        sublayer: Callable[[Tensor], Tensor],
    ) -> Tensor:
        """Sublayer ``site`` inside the block's residual rule: :meth:`residual`, or the
        module given for ``site``."""
        if self.residuals is None:
            return self.residual(x, norm, out_norm, sublayer)
        return self.residuals[site](x, norm, out_norm, sublayer)

    def forward(
        self,
        x: Tensor,
        *mixer_args: object,
        mask: Tensor | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        token_ids: Tensor | None = None,
    ) -> Tensor:
        """``mask`` limits self-attention, ``context_mask`` cross-attention (True =
        attend).

        ``mixer_args`` go to the token mixer after the stream, unread here (a decoder
        passes the tokens' positions and the layer's decoding state, chapter 08).
        ``token_ids (B, T)``, if given, go to the FFN (an MoE routed by token id).
        """
        x = self.connect(
            "attn",
            x,
            self.attn_norm,
            self.attn_out_norm,
            lambda h: self.attn(h, *mixer_args, mask=mask),
        )
        if self.cross_attn is not None:
            if context is None:
                raise ValueError(
                    "this block has cross-attention: pass context (B, S, d)"
                )
            x = self.connect(
                "cross",
                x,
                self.cross_norm,
                self.cross_out_norm,
                lambda h: self.cross_attn(h, mask=context_mask, context=context),
            )
        ffn = self.ffn
        if token_ids is not None:
            ffn = functools.partial(self.ffn, token_ids=token_ids)
        return self.connect("ffn", x, self.ffn_norm, self.ffn_out_norm, ffn)


def _check_residuals(
    residuals: Mapping[str, nn.Module],
    sites: tuple[str, ...],
    placement: str,
    dropout: float,
) -> None:
    """A residual rule for each sublayer the block has, and nothing the placement's rule
    would do besides."""
    if sorted(residuals) != sorted(sites):
        raise ValueError(
            f"residuals must give one module for each sublayer {sites}, got "
            f"{tuple(residuals)}"
        )
    if placement == "post" or dropout != 0.0:
        raise ValueError(
            "residuals replace the placement's residual add: they need a placement "
            f"other than 'post' and dropout=0, got placement={placement!r}, "
            f"dropout={dropout}"
        )

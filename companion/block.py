"""The Transformer block with a Pre-LN / Post-LN switch (chapters 02, 03, 04, 06).

Shape legend: ``x (B, T, d)`` in and out; ``context (B, S, d)`` for cross-attention.
Post-LN (2017): ``x = norm(x + sublayer(x))``. Pre-LN (GPT-2 onward):
``x = x + sublayer(norm(x))``, which leaves the residual stream untouched between blocks
and needs a final norm after the last block.

One class serves every stack: a decoder-only LM (causal self-attention, FFN), an encoder
(bidirectional self-attention, FFN) and the 2017 decoder (causal self-attention,
cross-attention to the encoder, FFN).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from .config import ModelConfig
from .ffn import FeedForward
from .mha import MultiHeadAttention
from .norms import build_norm

__all__ = ["TransformerBlock"]


class TransformerBlock(nn.Module):
    """Self-attention (causal or not), optional cross-attention, then an FFN.

    Each sublayer is wrapped in a residual connection, dropout and a norm placed as
    ``cfg.norm_placement`` says.
    """

    def __init__(self, cfg: ModelConfig, *, causal: bool = True, cross_attention: bool = False):
        super().__init__()
        self.placement, self.causal = cfg.norm_placement, causal
        self.attn_norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias)
        self.attn = self._attention(cfg)
        self.cross_norm = self.cross_attn = None
        if cross_attention:
            self.cross_norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias)
            self.cross_attn = self._attention(cfg)
        self.ffn_norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias)
        self.ffn = FeedForward(cfg.d_model, cfg.ffn_dim, cfg.activation, cfg.bias, cfg.dropout)
        self.dropout = nn.Dropout(cfg.dropout)

    @staticmethod
    def _attention(cfg: ModelConfig) -> MultiHeadAttention:
        return MultiHeadAttention(
            cfg.d_model,
            cfg.n_heads,
            bias=cfg.bias,
            fused_qkv=cfg.fused_qkv,
            impl=cfg.attn_impl,
            dropout=cfg.attn_dropout,
        )

    def _residual(self, x: Tensor, norm: nn.Module, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        if self.placement == "pre":
            return x + self.dropout(sublayer(norm(x)))
        return norm(x + self.dropout(sublayer(x)))

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
    ) -> Tensor:
        """``mask`` limits self-attention, ``context_mask`` cross-attention (True = attend)."""
        x = self._residual(x, self.attn_norm, lambda h: self.attn(h, mask=mask, causal=self.causal))
        if self.cross_attn is not None:
            if context is None:
                raise ValueError("this block has cross-attention: pass context (B, S, d)")
            x = self._residual(
                x, self.cross_norm, lambda h: self.cross_attn(h, context=context, mask=context_mask)
            )
        return self._residual(x, self.ffn_norm, self.ffn)

    def attention_input(self, x: Tensor) -> Tensor:
        """What the self-attention sublayer sees: the normed stream (Pre-LN) or the stream."""
        return self.attn_norm(x) if self.placement == "pre" else x

"""The Transformer decoder block with a Pre-LN / Post-LN switch (chapters 02, 03, 06).

Shape legend: ``x (B, T, d)`` in and out. Post-LN (2017): ``x = norm(x + sublayer(x))``.
Pre-LN (GPT-2 onward): ``x = x + sublayer(norm(x))``, which leaves the residual stream
untouched between blocks and needs a final norm after the last block.
"""

from __future__ import annotations

from torch import Tensor, nn

from .config import ModelConfig
from .ffn import FeedForward
from .mha import MultiHeadAttention
from .norms import build_norm

__all__ = ["DecoderBlock"]


class DecoderBlock(nn.Module):
    """Causal self-attention then an FFN, each wrapped in a residual and a norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.placement = cfg.norm_placement
        self.attn_norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias)
        self.attn = MultiHeadAttention(
            cfg.d_model,
            cfg.n_heads,
            bias=cfg.bias,
            fused_qkv=cfg.fused_qkv,
            impl=cfg.attn_impl,
            dropout=cfg.attn_dropout,
        )
        self.ffn_norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias)
        self.ffn = FeedForward(cfg.d_model, cfg.ffn_dim, cfg.activation, cfg.bias, cfg.dropout)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        if self.placement == "pre":
            x = x + self.dropout(self.attn(self.attn_norm(x), mask=mask, causal=True))
            return x + self.dropout(self.ffn(self.ffn_norm(x)))
        x = self.attn_norm(x + self.dropout(self.attn(x, mask=mask, causal=True)))
        return self.ffn_norm(x + self.dropout(self.ffn(x)))

    def attention_input(self, x: Tensor) -> Tensor:
        """What the attention sublayer sees: the normed stream (Pre-LN) or the stream itself."""
        return self.attn_norm(x) if self.placement == "pre" else x

"""Multi-head attention with separate or fused projections (chapters 02, 03).

Shape legend: B batch, T query tokens, S key tokens, d model width, H heads, D = d / H.
``x (B, T, d)`` gives the queries; ``context (B, S, d)`` gives keys and values (``None``:
self-attention, S = T). The heads run through :func:`companion.attention.attention`, so
``impl`` picks the reference, SDPA or tiled kernel without changing the weights.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .attention import IMPLS, attention, naive_attention

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """H heads of width D = d / H, then an output projection back to d."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        bias: bool = True,
        fused_qkv: bool = True,
        impl: str = "sdpa",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        self.n_heads, self.head_dim, self.impl, self.dropout = (
            n_heads,
            d_model // n_heads,
            impl,
            dropout,
        )
        self.fused_qkv = fused_qkv
        if fused_qkv:
            self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)  # one matmul for q, k and v
        else:
            self.q_proj = nn.Linear(d_model, d_model, bias=bias)
            self.k_proj = nn.Linear(d_model, d_model, bias=bias)
            self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def project(self, x: Tensor, context: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v split into heads: each ``(B, H, T or S, D)``."""
        if x.ndim != 3 or x.shape[-1] != self.n_heads * self.head_dim:
            raise ValueError(
                f"x must have shape (B, T, {self.n_heads * self.head_dim}), got {tuple(x.shape)}"
            )
        src = x if context is None else context
        if self.fused_qkv:
            d = x.shape[-1]
            w, b = self.qkv.weight, self.qkv.bias
            if context is None:
                q, k, v = self.qkv(x).split(d, dim=-1)  # (B, T, d) each
            else:  # cross-attention: q from x, k and v from the context
                q = F.linear(x, w[:d], None if b is None else b[:d])
                k, v = F.linear(src, w[d:], None if b is None else b[d:]).split(d, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(src), self.v_proj(src)
        return self._heads(q), self._heads(k), self._heads(v)

    def _heads(self, t: Tensor) -> Tensor:
        b, n, _ = t.shape
        return t.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, n, D)

    def forward(
        self,
        x: Tensor,
        *,
        context: Tensor | None = None,
        mask: Tensor | None = None,
        causal: bool = False,
    ) -> Tensor:
        q, k, v = self.project(x, context)
        p = self.dropout if self.training else 0.0
        o = attention(q, k, v, impl=self.impl, mask=mask, causal=causal, dropout_p=p)
        b, _, t, _ = o.shape
        return self.out_proj(o.transpose(1, 2).reshape(b, t, -1))  # (B, T, d)

    def attention_weights(
        self,
        x: Tensor,
        *,
        context: Tensor | None = None,
        mask: Tensor | None = None,
        causal: bool = False,
    ) -> Tensor:
        """The ``(B, H, T, S)`` softmax weights, from the reference implementation."""
        q, k, v = self.project(x, context)
        return naive_attention(q, k, v, mask=mask, causal=causal)[1]

"""Induction heads: a repeated random segment, an attention-only model, and the
prefix-matching score that finds the head which copies from the earlier occurrence
(chapter 02).

Shape legend: B batch, T tokens, P period, V vocabulary, d width, H heads.
A sequence is a random segment of P tokens repeated until it is T long, with the
period P drawn per sequence so that no fixed offset finds the copy. An *induction head*
reads, at a position i of the repeat, the key that follows an earlier occurrence of
its token, ``i - P + 1``: it predicts that what came next then comes next now.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from companion.layers.mha import MultiHeadAttention
from companion.layers.rotary import RotaryEmbedding

__all__ = [
    "AttentionOnlyLM",
    "induction_targets",
    "prefix_matching_score",
    "repeated_segments",
]


def repeated_segments(
    batch: int,
    seq_len: int,
    periods: tuple[int, int],
    vocab: int,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """``tokens (B, T)``: a random segment of ``P`` tokens repeated until ``T``, with
    ``P (B,)`` drawn per sequence from ``periods = (lo, hi)`` inclusive."""
    lo, hi = periods
    if not 2 <= lo <= hi <= seq_len // 2:
        raise ValueError(
            f"need 2 <= lo <= hi <= seq_len // 2, got {periods} {seq_len=}"
        )
    p = torch.randint(lo, hi + 1, (batch,), generator=generator)
    seg = torch.randint(vocab, (batch, hi), generator=generator)
    idx = torch.arange(seq_len)[None, :] % p[:, None]  # (B, T)
    return seg.gather(1, idx), p


class AttentionOnlyLM(nn.Module):
    """Token embeddings, ``n_layers`` pre-norm residual causal attention layers (no
    FFN) with RoPE (or, ``rope=False``, a learned position table), an unembedding:
    ``(B, T)`` ids to ``(B, T, V)``."""

    def __init__(
        self,
        vocab: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        max_len: int,
        *,
        rope: bool = True,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = None if rope else nn.Embedding(max_len, d_model)
        rotary = RotaryEmbedding(d_model // n_heads, max_len=max_len) if rope else None
        self.layers = nn.ModuleList(
            MultiHeadAttention(d_model, n_heads, causal=True, rope=rotary)
            for _ in range(n_layers)
        )
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n_layers + 1))
        self.head = nn.Linear(d_model, vocab)
        for emb in (self.tok, self.pos):
            if emb is not None:
                nn.init.normal_(emb.weight, std=0.1)

    def forward(self, ids: Tensor, *, maps: bool = False) -> Tensor | list[Tensor]:
        """Logits ``(B, T, V)``, or with ``maps=True`` each layer's weights
        ``(B, H, T, T)``."""
        x = self.tok(ids)  # (B, T, d)
        if self.pos is not None:
            x = x + self.pos(torch.arange(ids.shape[1], device=ids.device))
        weights = []
        for layer, norm in zip(self.layers, self.norms, strict=False):
            h = norm(x)
            if maps:
                weights.append(layer.attention_weights(h))
            x = x + layer(h)  # (B, T, d)
        return weights if maps else self.head(self.norms[-1](x))


def induction_targets(periods: Tensor, seq_len: int) -> Tensor:
    """``(B, T, T)`` boolean: key ``j`` follows an earlier occurrence of query ``i``'s
    token, ``j = i - kP + 1`` for ``k >= 1`` (only queries ``i >= P`` have one)."""
    i = torch.arange(seq_len)[:, None]
    j = torch.arange(seq_len)[None, :]
    p = periods[:, None, None]
    return (j <= i) & (j >= 1) & ((i - j + 1) % p == 0) & (i - j + 1 >= p)


def prefix_matching_score(weights: Tensor, periods: Tensor) -> Tensor:
    """Per head ``(H,)``: the weight a query in the repeat puts on the keys that follow
    earlier copies of its token, averaged over those queries, from ``(B, H, T, T)``."""
    t = weights.shape[-1]
    target = induction_targets(periods, t)  # (B, T, T)
    in_repeat = target.any(-1)  # (B, T): queries i >= P
    mass = (weights * target[:, None]).sum(-1)  # (B, H, T)
    return (mass * in_repeat[:, None]).sum(dim=(0, 2)) / in_repeat.sum()

"""DeepSeek-V4's lightning indexer: which compressed entries each query of a CSA layer
reads.

Shape legend: B batch, T queries, d model width, C_q ``q_lora_rank``, H_I indexer heads,
c indexer head width, N compressed entries, k ``topk``, R rotated channels.

The indexer keeps its own, narrower compressor (width c, overlapping blocks, the same
ratio m as the layer's), so its keys are compressed entries too. Its queries come from
the layer's query latent ``q_residual (B, T, C_q)``, rotated at the query positions.
Each query scores each entry with ``Σ_h w_h · ReLU(q_h · k) / √c`` where the head
weights ``w = weights_proj(x) / √H_I`` depend on the token (:func:`index_scores`, the
scoring of DeepSeek-V3.2's indexer, here over pooled keys), and keeps the k best of the
entries it may see.

Parameter names and shapes equal those of transformers' ``DeepseekV4Indexer``, save one:
its ``scorer.weights_proj`` is ``weights_proj`` here. The compressor's parameters (see
:mod:`companion.layers.v4_compressor`) are ``kv_proj (2c, d)``, ``gate_proj (2c, d)``,
``position_bias (m, 2c)``, ``kv_norm (c,)``; then ``q_b_proj (H_I·c, C_q)`` and
``weights_proj (H_I, d)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from companion.layers.rotary import RotaryEmbedding
from companion.layers.v4_compressor import Compressor, rope_tail

__all__ = ["Indexer", "index_scores", "top_k_mask"]


def index_scores(q: Tensor, keys: Tensor, head_weights: Tensor) -> Tensor:
    """``Σ_h w_h · ReLU(q_h · k) / √c`` in fp32: ``q (B, T, H_I, c)``, ``keys (B, N,
    c)``, ``head_weights (B, T, H_I)`` -> ``(B, T, N)``."""
    dots = torch.einsum("bthc,bnc->bthn", q.float(), keys.float())  # (B, T, H_I, N)
    scores = F.relu(dots) * q.shape[-1] ** -0.5
    return (scores * head_weights.float()[..., None]).sum(dim=2)


def top_k_mask(scores: Tensor, visible: Tensor, k: int) -> Tensor:
    """``(B, T, N)`` bool: for each query the ``k`` best-scoring entries among those it
    may see (all of them when it sees fewer). ``visible`` broadcasts to the scores."""
    n = scores.shape[-1]
    chosen = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if n == 0:
        return chosen
    best = scores.masked_fill(~visible, float("-inf")).topk(min(k, n), dim=-1).indices
    return chosen.scatter_(-1, best, True) & visible


class Indexer(Compressor):
    """A compressor of width c with overlapping blocks, plus the query side that ranks
    its entries. ``forward`` (inherited) gives its keys; :meth:`select` the choice."""

    def __init__(
        self,
        d_model: int,
        q_lora_rank: int,
        n_heads: int,
        head_dim: int,
        ratio: int,
        topk: int,
        *,
        rope: RotaryEmbedding,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__(
            d_model, head_dim, ratio, overlap=True, rope=rope, norm_eps=norm_eps
        )
        self.n_heads, self.topk = n_heads, topk
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(d_model, n_heads, bias=False)

    def select(
        self,
        x: Tensor,
        q_residual: Tensor,
        positions: Tensor,
        keys: Tensor,
        visible: Tensor,
    ) -> Tensor:
        """``(B, T, N)`` bool: the entries ``keys (B, N, c)`` each query of ``x (B, T,
        d)`` at ``positions (T,)`` reads; ``visible (T, N)`` says which exist for it."""
        b, t, _ = x.shape
        cos, sin = self.rope(positions)  # (T, F)
        q = self.q_b_proj(q_residual).view(b, t, self.n_heads, self.head_dim)
        q = rope_tail(q, cos[:, None], sin[:, None])  # (B, T, H_I, c)
        head_weights = self.weights_proj(x) * self.n_heads**-0.5  # (B, T, H_I)
        return top_k_mask(index_scores(q, keys, head_weights), visible, self.topk)

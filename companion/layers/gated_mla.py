"""Multi-head latent attention with a sigmoid gate per head on its output: the full
attention layers of Ling's Bailing hybrid (chapters 08, 12).

Shape legend: B batch, T query tokens, d model width, H heads, Dv value head width.

Each head's attention output ``o_h (B, T, Dv)`` is scaled by one number per token,
``σ(W_g x)_h``, before the output projection: ``out_proj([σ(g_1)·o_1 | ... |
σ(g_H)·o_H])`` with ``W_g (H, d)``, stored as ``gate_proj``. Everything else is
:class:`~companion.layers.mla.MultiHeadLatentAttention` (both forms, the latent cache).
The gate is the head-wise form of Qwen3-Next's output gate (chapter 12), which gates
every channel; transformers' ``BailingHybridAttention`` calls its weight ``g_proj``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from companion.layers.mla import MultiHeadLatentAttention

__all__ = ["HeadGatedLatentAttention"]


class HeadGatedLatentAttention(MultiHeadLatentAttention):
    """MLA whose heads are each scaled by ``σ(gate_proj x)`` before ``out_proj``: only
    :meth:`merge_heads` differs. Takes
    :class:`~companion.layers.mla.MultiHeadLatentAttention`'s arguments; adds the
    parameter ``gate_proj (H, d)``."""

    def __init__(self, d_model: int, n_heads: int, **kwargs: object) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        self.gate_proj = nn.Linear(d_model, n_heads, bias=False)

    def merge_heads(self, x: Tensor, o: Tensor) -> Tensor:
        """``o (B, H, T, Dv)`` with each head scaled by ``σ(gate_proj x)``, side by side
        ``(B, T, H·Dv)``."""
        gate = torch.sigmoid(self.gate_proj(x))  # (B, T, H)
        return (o.transpose(1, 2) * gate[..., None]).flatten(2)

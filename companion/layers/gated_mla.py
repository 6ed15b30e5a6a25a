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

from companion.layers.kv_cache import LatentCache
from companion.layers.mla import MultiHeadLatentAttention
from companion.ops.dispatch import attention
from companion.ops.sparse_attention import sparse_attention

__all__ = ["HeadGatedLatentAttention"]


class HeadGatedLatentAttention(MultiHeadLatentAttention):
    """MLA whose heads are each scaled by ``σ(gate_proj x)`` before ``out_proj``. Takes
    :class:`~companion.layers.mla.MultiHeadLatentAttention`'s arguments; adds the
    parameter ``gate_proj (H, d)``."""

    def __init__(self, d_model: int, n_heads: int, **kwargs: object) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        self.gate_proj = nn.Linear(d_model, n_heads, bias=False)

    def forward(
        self,
        x: Tensor,
        positions: Tensor | None = None,
        cache: LatentCache | None = None,
        *,
        mask: Tensor | None = None,
    ) -> Tensor:
        """``(B, T, d)``, called like the ungated layer: the same attention, each head's
        output gated before the projection."""
        q, k, v, mask, causal, indices = self.attention_inputs(
            x, positions, cache, mask=mask
        )
        p = self.dropout if self.training else 0.0
        kw = {"impl": self.impl, "mask": mask, "scale": self.scale, "dropout_p": p}
        b, h, t, _ = q.shape
        if indices is not None:
            o = sparse_attention(
                q, k, v, indices, scale=self.scale, impl=self.sparse_impl
            )
        elif t == 1 and not causal and k.shape[1] == 1:  # absorbed decode step
            o = attention(q.reshape(b, 1, h, -1), k, v, **kw).reshape(b, h, 1, -1)
        else:
            o = attention(q, k, v, causal=causal, **kw)
        if self.form == "absorbed":
            _, w_uv = self.up_weights()
            o = torch.einsum("bhtc,hvc->bhtv", o, w_uv)  # (B, H, T, Dv)
        gate = torch.sigmoid(self.gate_proj(x))  # (B, T, H)
        o = o.transpose(1, 2) * gate[..., None]  # (B, T, H, Dv)
        return self.out_proj(o.reshape(b, t, -1))  # (B, T, d)

"""Multi-head attention: MHA, GQA, MQA, with RoPE, QK-norm and a KV cache (chapters 02-08),
attention sinks and a sigmoid output gate (chapter 12).

Shape legend: B batch, T query tokens, S key tokens, d model width, H query heads, H_kv
key/value heads (H_kv = H: MHA; 1: MQA; between: GQA), D head width, F = D/2 RoPE
frequencies. ``x (B, T, d)`` gives the queries; ``context (B, S, d)`` gives keys and values
(``None``: self-attention). The heads run through :func:`companion.attention.attention`, so
``impl`` picks the reference, SDPA or tiled kernel without changing the weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import IMPLS, attention, naive_attention
from .kv_cache import KVCache, SlidingWindowCache, position_mask
from .masks import combine_masks
from .norms import RMSNorm
from .rope import LAYOUTS, apply_rope

__all__ = ["QK_NORMS", "MultiHeadAttention"]

QK_NORMS = ("none", "head", "full")
Cache = KVCache | SlidingWindowCache


class MultiHeadAttention(nn.Module):
    """H query heads sharing H_kv key/value heads, then an output projection back to d."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = True,
        qkv_bias: bool | None = None,
        fused_qkv: bool = True,
        impl: str = "sdpa",
        dropout: float = 0.0,
        qk_norm: str = "none",
        norm_eps: float = 1e-6,
        norm_offset: float = 0.0,
        rope_layout: str = "half",
        scale: float | None = None,
        sinks: bool = False,
        output_gate: bool = False,
    ) -> None:
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        if head_dim is None:
            if d_model % n_heads != 0:
                raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
            head_dim = d_model // n_heads
        if n_heads % n_kv_heads != 0:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        for name, value, allowed in (
            ("impl", impl, IMPLS),
            ("qk_norm", qk_norm, QK_NORMS),
            ("rope_layout", rope_layout, LAYOUTS),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.d_model, self.impl, self.dropout, self.scale = d_model, impl, dropout, scale
        self.fused_qkv, self.rope_layout, self.qk_norm = fused_qkv, rope_layout, qk_norm
        qkv_bias = bias if qkv_bias is None else qkv_bias
        self.output_gate = output_gate
        # with an output gate, q's projection also makes each head's gate: [q_h, gate_h]
        q_out, kv_out = n_heads * head_dim * (2 if output_gate else 1), n_kv_heads * head_dim
        if fused_qkv:
            self.qkv = nn.Linear(d_model, q_out + 2 * kv_out, bias=qkv_bias)  # one matmul
        else:
            self.q_proj = nn.Linear(d_model, q_out, bias=qkv_bias)
            self.k_proj = nn.Linear(d_model, kv_out, bias=qkv_bias)
            self.v_proj = nn.Linear(d_model, kv_out, bias=qkv_bias)
        self.out_proj = nn.Linear(n_heads * head_dim, d_model, bias=bias)
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if sinks else None  # one logit per head
        if qk_norm != "none":
            q_width = head_dim if qk_norm == "head" else n_heads * head_dim
            k_width = head_dim if qk_norm == "head" else kv_out
            self.q_norm = RMSNorm(q_width, eps=norm_eps, offset=norm_offset)
            self.k_norm = RMSNorm(k_width, eps=norm_eps, offset=norm_offset)

    def project(
        self, x: Tensor, context: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """q ``(B, H, T, D)`` and k, v ``(B, H_kv, S, D)``, QK-normed, before RoPE; and the
        output gate's logits ``(B, T, H·D)`` (None without an output gate)."""
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (B, T, {self.d_model}), got {tuple(x.shape)}")
        src = x if context is None else context
        q_out = self.n_heads * self.head_dim * (2 if self.output_gate else 1)
        kv_out = self.n_kv_heads * self.head_dim
        if self.fused_qkv:
            w, b = self.qkv.weight, self.qkv.bias
            if context is None:
                q, k, v = self.qkv(x).split([q_out, kv_out, kv_out], dim=-1)
            else:  # cross-attention: q from x, k and v from the context
                q = F.linear(x, w[:q_out], None if b is None else b[:q_out])
                kv = F.linear(src, w[q_out:], None if b is None else b[q_out:])
                k, v = kv.split([kv_out, kv_out], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(src), self.v_proj(src)
        gate = None
        if self.output_gate:  # per head: the first D channels query, the next D gate
            b, t, _ = q.shape
            q, gate = q.view(b, t, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(b, t, -1), gate.reshape(b, t, -1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (
            self._heads(q, self.n_heads),
            self._heads(k, self.n_kv_heads),
            self._heads(v, self.n_kv_heads),
        )
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v, gate

    def _heads(self, t: Tensor, n: int) -> Tensor:
        b, s, _ = t.shape
        return t.view(b, s, n, self.head_dim).transpose(1, 2)  # (B, n, S, D)

    def _qkv_for_attention(
        self,
        x: Tensor,
        context: Tensor | None,
        mask: Tensor | None,
        causal: bool,
        rope: tuple[Tensor, Tensor] | None,
        cache: Cache | None,
        positions: Tensor | None,
        window: int | None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, bool, Tensor | None]:
        """q, k, v (RoPE applied, cache read), the mask and causal flag attention needs, and
        the output gate's logits."""
        q, k, v, gate = self.project(x, context)
        if rope is not None:
            q = apply_rope(q, *rope, layout=self.rope_layout)
            k = apply_rope(k, *rope, layout=self.rope_layout)
        if cache is not None:
            if positions is None:
                raise ValueError("decoding with a cache needs the query positions (T,)")
            k, v, k_pos = cache.update(k, v)
            if isinstance(cache, KVCache) and window is None and mask is None:
                # keys 0..S-1 in order: the end-aligned triangle; one new token sees them all
                causal = q.shape[2] > 1
            else:
                mask, causal = combine_masks(mask, position_mask(positions, k_pos, window)), False
        return q, k, v, mask, causal, gate

    def forward(
        self,
        x: Tensor,
        *,
        context: Tensor | None = None,
        mask: Tensor | None = None,
        causal: bool = False,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: Cache | None = None,
        positions: Tensor | None = None,
        window: int | None = None,
    ) -> Tensor:
        """``(B, T, d)``. With a ``cache``, the new keys are stored and the mask is built from
        ``positions`` (and ``window``)."""
        q, k, v, mask, causal, gate = self._qkv_for_attention(
            x, context, mask, causal, rope, cache, positions, window
        )
        p = self.dropout if self.training else 0.0
        # FlexAttention wants a BlockMask per shape; a decode step's shape changes every
        # token, so cached decoding runs on SDPA.
        impl = "sdpa" if self.impl == "flex" and cache is not None else self.impl
        b, h, t, d = q.shape
        if t == 1 and mask is None and not causal and self.n_kv_heads < h and self.sinks is None:
            # one query token: the G query heads of a group read the same keys, so fold them
            # into the query axis and run plain attention per K/V head (no repeated K/V)
            g = h // self.n_kv_heads
            q = q.view(b, self.n_kv_heads, g, d)
            o = attention(q, k, v, impl=impl, scale=self.scale, dropout_p=p)
            o = o.reshape(b, h, 1, -1)
        else:
            o = attention(
                q,
                k,
                v,
                impl=impl,
                mask=mask,
                causal=causal,
                scale=self.scale,
                dropout_p=p,
                sinks=self.sinks,
            )
        o = o.transpose(1, 2).reshape(b, t, -1)  # (B, T, H·D)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.out_proj(o)  # (B, T, d)

    def attention_weights(
        self,
        x: Tensor,
        *,
        context: Tensor | None = None,
        mask: Tensor | None = None,
        causal: bool = False,
        rope: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """The ``(B, H, T, S)`` softmax weights, from the reference implementation."""
        q, k, v, mask, causal, _ = self._qkv_for_attention(
            x, context, mask, causal, rope, None, None, None
        )
        return naive_attention(
            q, k, v, mask=mask, causal=causal, scale=self.scale, sinks=self.sinks
        )[1]

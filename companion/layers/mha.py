"""Multi-head attention: MHA, GQA, MQA, with RoPE (or ALiBi's distance bias,
:mod:`companion.layers.alibi`), QK-norm and a KV cache (chapters 02-08), attention sinks
and a sigmoid output gate (chapter 12).

Shape legend: B batch, T query tokens, S key tokens, d model width, H query heads, H_kv
key/value heads (H_kv = H: MHA; 1: MQA; between: GQA), D head width, F = D/2 RoPE
frequencies. ``x (B, T, d)`` gives the queries; ``context (B, S, d)`` gives keys and
values (``None``: self-attention). The heads run through
:func:`companion.ops.dispatch.attention`, so ``impl`` picks the reference, SDPA or tiled
kernel without changing the weights.

The output gate's logits come from the query projection, ``[q_h, gate_h]`` per head
(``gate_layout="interleaved"``, Qwen3-Next, Qwen3.5), or from a projection of their own,
``gate_proj.weight (H·D, d)`` with no bias (``"separate"``, Trinity/AFMoE).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from companion.checks import check_cache_buffers, check_choice, check_tensor
from companion.layers.alibi import ALIBI_IMPLS, alibi_bias, biased_attention
from companion.layers.kv_cache import (
    KVCache,
    SlidingWindowCache,
    attention_mask,
    query_positions,
)
from companion.layers.norms import RMSNorm
from companion.layers.rotary import RotaryEmbedding
from companion.ops.attention import attention_weights
from companion.ops.dispatch import IMPLS, attention
from companion.ops.flex import BlockMask, causal_window_block_mask
from companion.ops.grouped import expand_kv
from companion.ops.rope import LAYOUTS, apply_rope
from companion.ops.sinks import sink_attention_weights

__all__ = ["GATE_LAYOUTS", "QK_NORMS", "MultiHeadAttention"]

QK_NORMS = ("none", "head", "full")
GATE_LAYOUTS = ("interleaved", "separate")
Cache = KVCache | SlidingWindowCache


class MultiHeadAttention(nn.Module):
    """H query heads sharing H_kv key/value heads, then an output projection back to
    d."""

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
        gate_layout: str = "interleaved",
        causal: bool = False,
        window: int | None = None,
        rope: RotaryEmbedding | None = None,
        alibi: Tensor | None = None,
    ) -> None:
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        if head_dim is None:
            if d_model % n_heads != 0:
                raise ValueError(
                    f"d_model ({d_model}) must be divisible by n_heads ({n_heads})"
                )
            head_dim = d_model // n_heads
        if n_heads % n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})"
            )
        for name, value, allowed in (
            ("impl", impl, IMPLS),
            ("qk_norm", qk_norm, QK_NORMS),
            ("rope_layout", rope_layout, LAYOUTS),
            ("gate_layout", gate_layout, GATE_LAYOUTS),
        ):
            check_choice(name, value, allowed)
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.d_model, self.impl, self.dropout, self.scale = d_model, impl, dropout, scale
        self.fused_qkv, self.rope_layout, self.qk_norm = fused_qkv, rope_layout, qk_norm
        # fixed per layer: causal or not, the window, the RoPE table (None: no RoPE) and
        # ALiBi's (H,) slopes (None: no bias)
        self.causal, self.window, self.rope = causal, window, rope
        if alibi is not None and (impl not in ALIBI_IMPLS or sinks):
            raise ValueError(f"alibi needs impl in {ALIBI_IMPLS} and no sinks")
        self.register_buffer("alibi", alibi, persistent=False)
        self._block_masks: dict[tuple, BlockMask] = {}  # FlexAttention masks, by length
        qkv_bias = bias if qkv_bias is None else qkv_bias
        if gate_layout == "separate" and not output_gate:
            raise ValueError("gate_layout='separate' needs output_gate=True")
        self.output_gate = output_gate
        self.gate_layout = gate_layout
        # an interleaved output gate: q's projection also makes each head's gate [q_h, gate_h]
        interleaved = output_gate and gate_layout == "interleaved"
        q_out, kv_out = (
            n_heads * head_dim * (2 if interleaved else 1),
            n_kv_heads * head_dim,
        )
        self.widths = [q_out, kv_out, kv_out]
        if fused_qkv:  # one matmul
            self.qkv = nn.Linear(d_model, q_out + 2 * kv_out, bias=qkv_bias)
        else:
            self.q_proj = nn.Linear(d_model, q_out, bias=qkv_bias)
            self.k_proj = nn.Linear(d_model, kv_out, bias=qkv_bias)
            self.v_proj = nn.Linear(d_model, kv_out, bias=qkv_bias)
        self.out_proj = nn.Linear(n_heads * head_dim, d_model, bias=bias)
        if output_gate and not interleaved:  # the gate's own projection of the stream
            self.gate_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.sinks = (
            nn.Parameter(torch.zeros(n_heads)) if sinks else None
        )  # one logit per head
        if qk_norm != "none":
            q_width = head_dim if qk_norm == "head" else n_heads * head_dim
            k_width = head_dim if qk_norm == "head" else kv_out
            self.q_norm = RMSNorm(q_width, eps=norm_eps, offset=norm_offset)
            self.k_norm = RMSNorm(k_width, eps=norm_eps, offset=norm_offset)

    def project(
        self, x: Tensor, context: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q ``(B, T, ·)`` from the stream x; k and v ``(B, S, ·)`` from the context (x
        itself in self-attention): one linear map each, or one fused matmul."""
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"x must have shape (B, T, {self.d_model}), got {tuple(x.shape)}"
            )
        if not self.fused_qkv:
            src = x if context is None else context
            return self.q_proj(x), self.k_proj(src), self.v_proj(src)
        if context is None:
            return self.qkv(x).split(self.widths, dim=-1)
        w, b, n = self.qkv.weight, self.qkv.bias, self.widths[0]  # cross-attention
        q = F.linear(x, w[:n], None if b is None else b[:n])
        k, v = F.linear(context, w[n:], None if b is None else b[n:]).split(
            self.widths[1:], -1
        )
        return q, k, v

    def heads(self, t: Tensor, n: int) -> Tensor:
        """Split the width into n heads: ``(B, S, n·D) -> (B, n, S, D)``."""
        b, s, _ = t.shape
        return t.view(b, s, n, self.head_dim).transpose(1, 2)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, *, mask=None, causal=False
    ) -> Tensor:
        """Each head attends on its own, then the heads are concatenated: ``(B, T,
        H·D)``."""
        p = self.dropout if self.training else 0.0
        o = self.form(q, k, v, mask=mask, causal=causal, dropout_p=p)  # (B, H, T, D)
        b, h, t, d = o.shape
        return o.transpose(1, 2).reshape(b, t, h * d)

    def form(
        self, q: Tensor, k: Tensor, v: Tensor, *, mask=None, causal=False, dropout_p=0.0
    ) -> Tensor:
        """The attention form this layer runs (``impl``, sinks), ``(B, H, T, D)``.

        One query token with grouped K/V heads: the G query heads of a group read the
        same keys, so they are folded into the query axis, and attention runs once per
        K/V head (no repeated K/V; chapter 08).
        """
        b, h, t, d = q.shape
        kw = {"impl": self.impl, "scale": self.scale, "dropout_p": dropout_p}
        if self.alibi is not None:
            return biased_attention(q, k, v, mask, **kw)
        kw["mask"] = mask
        if t == 1 and not causal and self.n_kv_heads < h and self.sinks is None:
            q = q.view(b, self.n_kv_heads, h // self.n_kv_heads, d)
            return attention(q, k, v, **kw).reshape(b, h, 1, -1)
        return attention(q, k, v, causal=causal, sinks=self.sinks, **kw)

    def new_cache(
        self,
        batch: int,
        max_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> Cache:
        """An empty cache for ``batch`` sequences of up to ``max_len`` positions: a ring
        buffer of W slots if this layer's window W is shorter, else ``max_len``
        slots."""
        w = getattr(self.out_proj, "weight", self.out_proj)  # nn.Linear, or quantised
        args = (batch, self.n_kv_heads)
        kw = {"dtype": dtype or w.dtype, "device": device or w.device}
        if self.window is not None and self.window < max_len:
            return SlidingWindowCache(*args, self.window, self.head_dim, **kw)
        return KVCache(*args, max_len, self.head_dim, **kw)

    def attention_inputs(
        self,
        x: Tensor,
        positions: Tensor | None = None,
        cache: Cache | None = None,
        *,
        mask: Tensor | None = None,
        context: Tensor | None = None,
        block_mask: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | BlockMask | None, bool, Tensor | None]:
        """q, k, v (RoPE applied, cache written and read), the mask and causal flag
        attention needs, and the output gate's logits. ``block_mask``: a causal layer's
        mask as a FlexAttention BlockMask (built once per length) where no other mask is
        needed."""
        self.check_inputs(x, cache, context)
        q, k, v = self.project(x, context)
        gate = None
        if self.output_gate and self.gate_layout == "separate":
            gate = self.gate_proj(x)  # (B, T, H·D)
        elif self.output_gate:  # per head: the first D channels query, the next D gate
            b, t, _ = q.shape
            q, gate = q.view(b, t, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(b, t, -1), gate.reshape(b, t, -1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.heads(q, self.n_heads), self.heads(k, self.n_kv_heads)
        v = self.heads(v, self.n_kv_heads)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        uses = (self.rope, self.window, self.alibi)  # the settings that read positions
        needed = any(u is not None for u in uses)
        positions = query_positions(x, positions, cache, needed=needed)
        if self.rope is not None:
            cos, sin = self.rope(positions)
            q = apply_rope(q, cos, sin, layout=self.rope_layout)
            k = apply_rope(k, cos, sin, layout=self.rope_layout)
        k_pos = None
        if cache is not None:
            k, v, k_pos = cache.update(positions, k, v)
        elif block_mask and mask is None and self.causal and context is None:
            return q, k, v, self._flex_mask(x.shape[1], x.device), False, gate
        mask, causal = attention_mask(positions, k_pos, self.window, mask, self.causal)
        if self.alibi is not None:  # the mask becomes ALiBi's additive bias
            k_at = positions if k_pos is None else k_pos
            mask, causal = alibi_bias(self.alibi, positions, k_at, mask, causal), False
        return q, k, v, mask, causal, gate

    def check_inputs(
        self, x: Tensor, cache: Cache | None, context: Tensor | None
    ) -> None:
        """Raise an error naming what does not fit, before anything is written: ``x (B,
        T, d)``, ``context (B, S, d)``, a ``cache`` as :meth:`new_cache` makes it for B
        (window, H_kv, D, the weights' dtype and device). Shapes only: cheap per step."""
        w = getattr(self.out_proj, "weight", self.out_proj)  # nn.Linear, or quantised
        d, dev = self.d_model, w.device
        check_tensor("x", x, (None, None, d), legend="(B, T, d)", device=dev)
        b = x.shape[0]
        if context is not None:
            check_tensor(
                "context", context, (b, None, d), legend="(B, S, d)", device=dev
            )
        hint = f"this layer's new_cache({b}, max_len)"
        if isinstance(cache, SlidingWindowCache) and cache.window != self.window:
            raise ValueError(
                f"cache is a SlidingWindowCache of window {cache.window} but this "
                f"layer's window is {self.window}: make it with {hint}"
            )
        if cache is not None:
            shape = (b, self.n_kv_heads, getattr(cache, "max_len", 0), self.head_dim)
            kv = (shape, w.dtype)
            check_cache_buffers(cache, (KVCache,), {"k": kv, "v": kv}, dev, hint)

    def _flex_mask(self, t: int, device: torch.device) -> BlockMask:
        """This layer's causal (windowed) BlockMask for T tokens, built once per
        length."""
        key = (t, device)
        if key not in self._block_masks:
            self._block_masks[key] = causal_window_block_mask(
                t, None, self.window, device
            )
        return self._block_masks[key]

    def forward(
        self,
        x: Tensor,
        positions: Tensor | None = None,
        cache: Cache | None = None,
        *,
        mask: Tensor | None = None,
        context: Tensor | None = None,
    ) -> Tensor:
        """``(B, T, d)`` for the tokens at ``positions (T,)`` (default 0..T-1). With a
        ``cache`` the new keys are stored at their positions and the mask comes from the
        positions the cache holds (and this layer's window)."""
        flex = self.impl == "flex"
        q, k, v, mask, causal, gate = self.attention_inputs(
            x, positions, cache, mask=mask, context=context, block_mask=flex
        )
        o = self.attend(q, k, v, mask=mask, causal=causal)  # (B, T, H·D)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.out_proj(o)  # (B, T, d)

    def attention_weights(
        self,
        x: Tensor,
        positions: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        context: Tensor | None = None,
    ) -> Tensor:
        """The ``(B, H, T, S)`` softmax weights (with this layer's sinks, if any)."""
        q, k, v, mask, causal, _ = self.attention_inputs(
            x, positions, mask=mask, context=context
        )
        kw = {"mask": mask, "causal": causal, "scale": self.scale}
        if self.alibi is not None:
            return biased_attention(q, k, v, mask, scale=self.scale, weights=True)
        if self.sinks is not None:
            return sink_attention_weights(q, k, self.sinks, **kw)
        return attention_weights(q, expand_kv(k, self.n_heads), **kw)

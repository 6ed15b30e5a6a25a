"""The Transformer block: four norm placements, MLP, GLU or experts, and full, sliding,
latent or linear (Gated DeltaNet) token mixing (chapters 02-04, 06, 08-12).

Shape legend: ``x (B, T, d)`` in and out; ``context (B, S, d)`` for cross-attention.
Around each sublayer f the residual stream is updated as ``cfg.norm_placement`` says:
``pre`` x + f(norm(x)) (GPT-2 onward); ``post`` norm(x + f(x)) (2017); ``sandwich``
x + norm'(f(norm(x))) (Gemma 2/3); ``post_branch`` x + norm'(f(x)) (Olmo 2/3).

One class serves every stack: a decoder-only LM (causal self-attention, FFN), an encoder
(bidirectional self-attention, FFN) and the 2017 decoder (causal self-attention,
cross-attention to the encoder, FFN). Layer ``layer`` of the config decides whether its
token mixer is full or sliding attention (or MLA) or Gated DeltaNet, whether it uses RoPE,
and whether its FFN is dense or a mixture of experts.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from .config import ModelConfig
from .ffn import FeedForward, GatedFeedForward
from .gated_deltanet import GatedDeltaNet, GatedDeltaNetCache
from .kv_cache import KVCache, SlidingWindowCache
from .mha import MultiHeadAttention
from .mla import LatentCache, MultiHeadLatentAttention, softmax_scale
from .moe import MoEFeedForward
from .norms import build_norm

__all__ = ["TransformerBlock"]


class TransformerBlock(nn.Module):
    """Self-attention (causal or not), optional cross-attention, then an FFN."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        causal: bool = True,
        cross_attention: bool = False,
        layer: int = 0,
    ) -> None:
        super().__init__()
        self.placement, self.causal = cfg.norm_placement, causal
        self.window = cfg.sliding_window if cfg.layer_kinds[layer] == "sliding" else None
        self.uses_rope = cfg.position == "rope" and layer not in cfg.nope_layers
        self.attn_norm, self.attn_out_norm = self._norms(cfg)
        self.kind = cfg.layer_kinds[layer]  # "full", "sliding" or "linear"
        if self.kind == "linear":
            self.attn = self._linear_attention(cfg)
        else:
            self.attn = self._latent_attention(cfg) if cfg.is_mla else self._attention(cfg)
        self.cross_norm = self.cross_out_norm = self.cross_attn = None
        if cross_attention:
            self.cross_norm, self.cross_out_norm = self._norms(cfg)
            self.cross_attn = self._attention(cfg)
        self.ffn_norm, self.ffn_out_norm = self._norms(cfg)
        self.ffn = self._experts(cfg) if cfg.is_moe_layer(layer) else self._dense_ffn(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def _norms(self, cfg: ModelConfig) -> tuple[nn.Module | None, nn.Module | None]:
        """(norm before or around the sublayer, norm of its output) for this placement."""

        def make() -> nn.Module:
            return build_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias, cfg.norm_offset)

        into = make() if self.placement in ("pre", "post", "sandwich") else None
        out = make() if self.placement in ("sandwich", "post_branch") else None
        return into, out

    @staticmethod
    def _attention(cfg: ModelConfig) -> MultiHeadAttention:
        return MultiHeadAttention(
            cfg.d_model,
            cfg.n_heads,
            n_kv_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            bias=cfg.bias,
            qkv_bias=cfg.attn_bias,
            fused_qkv=cfg.fused_qkv,
            impl=cfg.attn_impl,
            dropout=cfg.attn_dropout,
            qk_norm=cfg.qk_norm,
            norm_eps=cfg.norm_eps,
            norm_offset=cfg.norm_offset,
            rope_layout=cfg.rope_layout,
            scale=cfg.attn_scale,
            sinks=cfg.attn_sinks,
            output_gate=cfg.attn_output_gate,
        )

    @staticmethod
    def _dense_ffn(cfg: ModelConfig) -> nn.Module:
        ffn_cls = GatedFeedForward if cfg.ffn == "glu" else FeedForward
        return ffn_cls(cfg.d_model, cfg.ffn_dim, cfg.activation, cfg.bias, cfg.dropout)

    @staticmethod
    def _experts(cfg: ModelConfig) -> MoEFeedForward:
        return MoEFeedForward(
            cfg.d_model,
            cfg.n_experts,
            cfg.experts_per_token,
            cfg.moe_d_ff,
            scoring=cfg.router,
            norm_topk=cfg.router_norm_topk,
            n_groups=cfg.router_groups,
            topk_groups=cfg.router_topk_groups,
            scale=cfg.router_scale,
            router_bias=cfg.router_bias,
            selection_bias=cfg.router_selection_bias,
            kind=cfg.expert_kind,
            shared_d_ff=cfg.shared_d_ff,
            shared_gate=cfg.shared_expert_gate,
        )

    @staticmethod
    def _linear_attention(cfg: ModelConfig) -> GatedDeltaNet:
        return GatedDeltaNet(
            cfg.d_model,
            cfg.linear_key_heads,
            cfg.linear_value_heads,
            cfg.linear_key_dim,
            cfg.linear_value_dim,
            cfg.linear_conv_kernel,
            norm_eps=cfg.norm_eps,
        )

    @staticmethod
    def _latent_attention(cfg: ModelConfig) -> MultiHeadLatentAttention:
        scale = cfg.attn_scale
        if scale is None:
            scale = softmax_scale(cfg.qk_head_dim, cfg.rope_scaling)
        return MultiHeadLatentAttention(
            cfg.d_model,
            cfg.n_heads,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            q_lora_rank=cfg.q_lora_rank,
            norm_eps=cfg.norm_eps,
            rope_layout=cfg.rope_layout,
            scale=scale,
            form=cfg.mla_form,
            impl=cfg.attn_impl,
            dropout=cfg.attn_dropout,
        )

    def _residual(
        self,
        x: Tensor,
        norm: nn.Module | None,
        out_norm: nn.Module | None,
        sublayer: Callable[[Tensor], Tensor],
    ) -> Tensor:
        if self.placement == "post":
            return norm(x + self.dropout(sublayer(x)))
        h = sublayer(norm(x) if norm is not None else x)
        return x + self.dropout(out_norm(h) if out_norm is not None else h)

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        *,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: KVCache | SlidingWindowCache | LatentCache | GatedDeltaNetCache | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """``mask`` limits self-attention, ``context_mask`` cross-attention (True = attend).

        ``rope`` is the (cos, sin) of the queries' positions; with a ``cache`` the new keys
        are stored and the mask comes from ``positions`` (and this layer's window).
        """

        def self_attention(h: Tensor) -> Tensor:
            if self.kind == "linear":  # a recurrence: causal by construction, no mask
                if mask is not None:
                    raise ValueError(
                        "Gated DeltaNet layers take no attention mask: pass unpadded batches"
                    )
                return self.attn(h, cache=cache)
            return self.attn(
                h,
                mask=mask,
                causal=self.causal,
                rope=rope if self.uses_rope else None,
                cache=cache,
                positions=positions,
                window=self.window,
            )

        x = self._residual(x, self.attn_norm, self.attn_out_norm, self_attention)
        if self.cross_attn is not None:
            if context is None:
                raise ValueError("this block has cross-attention: pass context (B, S, d)")
            x = self._residual(
                x,
                self.cross_norm,
                self.cross_out_norm,
                lambda h: self.cross_attn(h, context=context, mask=context_mask),
            )
        return self._residual(x, self.ffn_norm, self.ffn_out_norm, self.ffn)

    def attention_input(self, x: Tensor) -> Tensor:
        """What the self-attention sublayer sees: the normed stream, or the stream itself."""
        return self.attn_norm(x) if self.placement in ("pre", "sandwich") else x

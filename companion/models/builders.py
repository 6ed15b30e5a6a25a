"""Component builders: a :class:`~companion.models.config.ModelConfig` turned into
finished parts.

Each builder reads the config for one layer and returns a module; :func:`build_block`
wires them into a :class:`~companion.layers.block.TransformerBlock`, which receives its
parts and decides nothing itself (torchtune's component builders work the same way).
What is fixed per layer is fixed here, when the module is built: causal or not, the
sliding window, RoPE or NoPE and the RoPE table (a local base on sliding layers if the
config has one) or ALiBi's slopes, the softmax scale, dense FFN or experts.

Adding a mechanism (a token mixer, an FFN, a norm) means: its own module, its config
group (:mod:`companion.models.config_parts`), one branch here, and its entries in
:mod:`companion.analysis.calculator` and :mod:`companion.checkpoints.transformers`.
Every token mixer has the same two entry points, ``new_cache(batch, max_len, *, dtype,
device)`` and ``forward(x, positions=None, cache=None, *, mask=None)``.
"""

from __future__ import annotations

import functools

from torch import nn

from companion.layers.alibi import alibi_slopes
from companion.layers.block import TransformerBlock
from companion.layers.ffn import FeedForward, GatedFeedForward
from companion.layers.gated_deltanet import GatedDeltaNet
from companion.layers.gated_mla import HeadGatedLatentAttention
from companion.layers.kimi_delta import KimiDeltaAttention
from companion.layers.lightning_indexer import LightningIndexer, SharedIndexer
from companion.layers.mha import MultiHeadAttention
from companion.layers.mla import MultiHeadLatentAttention, softmax_scale
from companion.layers.moe import MoEFeedForward
from companion.layers.norms import build_norm
from companion.layers.rotary import RotaryEmbedding
from companion.models.config import ModelConfig
from companion.models.v4_builders import compressed_attention, hyper_connections
from companion.ops.rope import RopeScaling

__all__ = [
    "build_block",
    "build_blocks",
    "build_ffn",
    "build_mixer",
    "build_norms",
    "rotary_embedding",
]


@functools.lru_cache(maxsize=64)
def _shared_rope(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None,
    factor: float,
    max_len: int,
) -> RotaryEmbedding:
    """One RoPE module per setting, shared by every layer (and model) that uses it."""
    return RotaryEmbedding(head_dim, theta, scaling, factor, max_len)


def rotary_embedding(
    cfg: ModelConfig, local: bool = False, compress: bool = False
) -> RotaryEmbedding | None:
    """The RoPE table of the config's full layers, or with ``local`` of its sliding
    layers (``rope_local_theta``, no scaling; the global table if that is unset), or
    with ``compress`` of its CSA/HCA layers (``compression.rope_theta`` and
    ``rope_scaling``); None without RoPE."""
    if cfg.position != "rope":
        return None
    if compress:
        c = cfg.compression
        return _shared_rope(
            cfg.rope_dim,
            c.rope_theta,
            c.rope_scaling,
            cfg.partial_rotary_factor,
            cfg.max_seq_len,
        )
    if local and cfg.rope_local_theta is not None:
        return _shared_rope(
            cfg.rope_dim,
            cfg.rope_local_theta,
            None,
            cfg.partial_rotary_factor,
            cfg.max_seq_len,
        )
    return _shared_rope(
        cfg.rope_dim,
        cfg.rope_theta,
        cfg.rope_scaling,
        cfg.partial_rotary_factor,
        cfg.max_seq_len,
    )


def build_norms(cfg: ModelConfig) -> tuple[nn.Module | None, nn.Module | None]:
    """(norm before or around a sublayer, norm of its output) for
    ``cfg.norm_placement``."""

    def make() -> nn.Module:
        return build_norm(
            cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias, cfg.norm_offset
        )

    into = make() if cfg.norm_placement in ("pre", "post", "sandwich") else None
    out = make() if cfg.norm_placement in ("sandwich", "post_branch") else None
    return into, out


def _attention(cfg: ModelConfig, **fixed: object) -> MultiHeadAttention:
    return MultiHeadAttention(
        cfg.d_model,
        cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        bias=cfg.bias,
        qkv_bias=cfg.qkv_bias,
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
        gate_layout=cfg.attn_gate_layout,
        **fixed,
    )


def _indexer(
    cfg: ModelConfig,
    layer: int,
    rope: RotaryEmbedding | None,
    source: LightningIndexer | None,
) -> LightningIndexer | SharedIndexer | None:
    """Layer ``layer``'s DSA indexer: its own, the ``source`` one shared, or None."""
    sparse = cfg.mla.indexer
    if sparse is None:
        return None
    if sparse.kind(layer) == "shared":
        if source is None:
            raise ValueError(
                f"layer {layer} shares the indexer of an earlier 'full' layer "
                "(mla.indexer.layers): pass it as indexer_source, or build the stack "
                "with build_blocks"
            )
        return SharedIndexer(source)
    return LightningIndexer(
        cfg.d_model,
        cfg.mla.q_lora_rank,
        n_heads=sparse.n_heads,
        head_dim=sparse.head_dim,
        topk=sparse.topk,
        rope=rope,
        rope_layout=sparse.rope_layout,
    )


def _latent_attention(
    cfg: ModelConfig,
    layer: int = 0,
    source: LightningIndexer | None = None,
    **fixed: object,
) -> MultiHeadLatentAttention:
    scale = cfg.attn_scale
    if scale is None:
        scale = softmax_scale(cfg.head_dim, cfg.rope_scaling)
    mla = cfg.mla
    cls = HeadGatedLatentAttention if mla.output_gate else MultiHeadLatentAttention
    return cls(
        cfg.d_model,
        cfg.n_heads,
        kv_lora_rank=mla.kv_lora_rank,
        qk_nope_head_dim=mla.qk_nope_head_dim,
        qk_rope_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        q_lora_rank=mla.q_lora_rank,
        norm_eps=cfg.norm_eps if mla.latent_norm_eps is None else mla.latent_norm_eps,
        rope_layout=cfg.rope_layout,
        scale=scale,
        form=mla.form,
        impl=cfg.attn_impl,
        dropout=cfg.attn_dropout,
        indexer=_indexer(cfg, layer, fixed.get("rope"), source),
        **fixed,
    )


def _linear(cfg: ModelConfig) -> nn.Module:
    """A ``"linear"`` layer's recurrence: Gated DeltaNet or Kimi Delta Attention."""
    lin = cfg.linear
    if lin.kind == "kda":
        return KimiDeltaAttention(
            cfg.d_model,
            lin.key_heads,
            lin.key_dim,
            lin.conv_kernel,
            cfg.norm_eps,
            layout=lin.kda_layout,
            gate_lower_bound=lin.kda_gate_lower_bound,
        )
    return GatedDeltaNet(
        cfg.d_model,
        lin.key_heads,
        lin.value_heads,
        lin.key_dim,
        lin.value_dim,
        lin.conv_kernel,
        norm_eps=cfg.norm_eps,
        rule=lin.rule,
        projections=lin.projections,
    )


def build_mixer(
    cfg: ModelConfig,
    layer: int = 0,
    *,
    causal: bool = True,
    indexer_source: LightningIndexer | None = None,
) -> nn.Module:
    """Layer ``layer``'s token mixer: Gated DeltaNet or KDA on ``"linear"`` layers,
    else MLA (gated, sparse) or multi-head attention, with this layer's window and RoPE
    table fixed in it. A GLM-5 ``"shared"`` indexer layer reuses ``indexer_source``,
    the indexer of the last ``"full"`` one before it."""
    kind = cfg.layer_types[layer]
    if kind == "linear":
        return _linear(cfg)
    if cfg.compression is not None:
        rope = rotary_embedding(cfg, compress=kind != "sliding")
        return compressed_attention(cfg, kind, rope)
    sliding = kind == "sliding"
    rope = None if layer in cfg.nope_layers else rotary_embedding(cfg, local=sliding)
    window = cfg.sliding_window if sliding and causal else None
    if cfg.is_mla:
        return _latent_attention(
            cfg, layer, indexer_source, causal=causal, window=window, rope=rope
        )
    alibi = alibi_slopes(cfg.n_heads) if cfg.position == "alibi" else None
    return _attention(cfg, causal=causal, window=window, rope=rope, alibi=alibi)


def build_ffn(cfg: ModelConfig, layer: int = 0) -> nn.Module:
    """Layer ``layer``'s feed-forward sublayer: a mixture of experts or a dense
    MLP/GLU."""
    if cfg.is_moe_layer(layer):
        moe, hashed = cfg.moe, cfg.is_hash_layer(layer)
        return MoEFeedForward(
            cfg.d_model,
            moe.n_experts,
            moe.experts_per_token,
            moe.expert_d_ff,
            scoring=moe.router,
            norm_topk=moe.router_norm_topk,
            n_groups=moe.router_groups,
            topk_groups=moe.router_topk_groups,
            scale=moe.router_scale,
            router_bias=moe.router_bias,
            selection_bias=moe.router_selection_bias and not hashed,
            kind=moe.expert_kind,
            shared_d_ff=moe.shared_d_ff,
            shared_gate=moe.shared_expert_gate,
            routing="hash" if hashed else "topk",
            vocab_size=cfg.vocab_size,
            swiglu_limit=moe.swiglu_limit,
        )
    ffn_cls = GatedFeedForward if cfg.ffn == "glu" else FeedForward
    return ffn_cls(cfg.d_model, cfg.d_ff, cfg.activation, cfg.bias, cfg.dropout)


def build_block(
    cfg: ModelConfig,
    layer: int = 0,
    *,
    causal: bool = True,
    cross_attention: bool = False,
    indexer_source: LightningIndexer | None = None,
) -> TransformerBlock:
    """Layer ``layer`` of a stack: its norms, token mixer, optional cross-attention (the
    2017 decoder; no RoPE, never causal) and FFN, built in that order."""
    attn_norm, attn_out_norm = build_norms(cfg)
    attn = build_mixer(cfg, layer, causal=causal, indexer_source=indexer_source)
    cross = {}
    if cross_attention:
        cross_norm, cross_out_norm = build_norms(cfg)
        cross = {
            "cross_norm": cross_norm,
            "cross_out_norm": cross_out_norm,
            "cross_attn": _attention(cfg),
        }
    ffn_norm, ffn_out_norm = build_norms(cfg)
    cross_site = ("cross",) if cross_attention else ()
    return TransformerBlock(
        attn,
        build_ffn(cfg, layer),
        placement=cfg.norm_placement,
        norms=(attn_norm, attn_out_norm, ffn_norm, ffn_out_norm),
        dropout=cfg.dropout,
        residuals=hyper_connections(cfg, ("attn", *cross_site, "ffn")),
        **cross,
    )


def build_blocks(cfg: ModelConfig) -> list[TransformerBlock]:
    """The decoder's ``cfg.n_layers`` causal blocks in order, each ``"shared"``
    indexer layer (GLM-5) handed the indexer of the last ``"full"`` one before it."""
    blocks, source = [], None
    for i in range(cfg.n_layers):
        block = build_block(cfg, i, indexer_source=source)
        own = getattr(block.attn, "indexer", None)
        if isinstance(own, LightningIndexer):
            source = own
        blocks.append(block)
    return blocks

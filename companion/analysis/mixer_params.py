"""Parameter counts of the token mixers beyond plain attention, for the calculator
(:mod:`companion.analysis.calculator`, chapter 13): multi-head latent attention, Gated
DeltaNet, Kimi Delta Attention and DeepSeek Sparse Attention's lightning indexer.

Shape legend: d model width, H heads; MLA: r latent width, r_q query latent width, R
decoupled RoPE width, D_nope / D_v per-head key and value widths; Gated DeltaNet: H_k /
H_v heads, D_k / D_v head widths, K convolution width; KDA: H heads of width D (keys and
values alike); DSA: H_I indexer heads of width D_I.

Each function returns ``(parameters, matrix weights)`` of one layer: the second is what
a token's forward pass multiplies by (2 FLOPs each).
"""

from __future__ import annotations

from companion.models.config import ModelConfig

__all__ = [
    "gated_deltanet_params",
    "indexer_params",
    "kimi_delta_params",
    "latent_attention_params",
    "own_indexer",
]


def latent_attention_params(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters, matrix weights) of one MLA layer; its two norms have no bias."""
    mla = cfg.mla
    d, h, r, r_q = cfg.d_model, cfg.n_heads, mla.kv_lora_rank, mla.q_lora_rank
    q_heads = h * cfg.head_dim
    q = d * q_heads if r_q == 0 else d * r_q + r_q * q_heads
    kv_a = d * (r + mla.qk_rope_head_dim)
    kv_b = r * h * (mla.qk_nope_head_dim + mla.v_head_dim)
    out = h * mla.v_head_dim * d
    matrices = q + kv_a + kv_b + out
    return matrices + r_q + r, matrices


def gated_deltanet_params(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters, matrix and conv weights) of one Gated DeltaNet layer."""
    lin = cfg.linear
    d, h_v = cfg.d_model, lin.value_heads
    keys, values = lin.key_heads * lin.key_dim, h_v * lin.value_dim
    qkvz = d * (2 * keys + 2 * values)  # q, k, v and the output gate z
    ba = d * 2 * h_v  # the write strength β and the decay's input, per value head
    conv = (2 * keys + values) * lin.conv_kernel  # depthwise, no bias
    out = values * d
    weights = qkvz + ba + conv + out
    return (
        weights + 2 * h_v + lin.value_dim,
        weights,
    )  # + dt_bias, A_log, out norm


def kimi_delta_params(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters, matrix and conv weights) of one Kimi Delta Attention layer: q, k,
    v, the conv, β, the forget and output gates (low rank in the "kimi" layout, full
    rank in "bailing") and the output projection."""
    lin = cfg.linear
    d, h, d_h = cfg.d_model, lin.key_heads, lin.key_dim
    width = h * d_h
    qkv = 3 * d * width
    conv = 3 * width * lin.conv_kernel  # depthwise, no bias
    if lin.kda_layout == "kimi":
        gates = 2 * (d * d_h + d_h * width)  # f_a, f_b and g_a, g_b
    else:
        gates = 2 * d * width  # f_proj, g_proj
    weights = qkv + conv + d * h + gates + width * d  # + b_proj, o_proj
    return weights + width + h + d_h, weights  # + dt_bias, A_log, o_norm


def indexer_params(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters, matrix weights) of one DSA lightning indexer (a "full" layer's):
    its query heads from MLA's query latent, one key, a weight per head, the key's
    LayerNorm (weight and bias)."""
    sparse = cfg.mla.indexer
    h_i, d_i = sparse.n_heads, sparse.head_dim
    matrices = cfg.mla.q_lora_rank * h_i * d_i + cfg.d_model * (d_i + h_i)
    return matrices + 2 * d_i, matrices


def own_indexer(cfg: ModelConfig, layer: int) -> bool:
    """True if layer ``layer`` of ``cfg`` runs (and caches) an indexer of its own."""
    if cfg.mla is None or cfg.mla.indexer is None:
        return False
    return cfg.layer_types[layer] != "linear" and cfg.mla.indexer.kind(layer) == "full"

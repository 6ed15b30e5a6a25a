"""Parameter counts of the token mixers beyond plain attention, for the calculator
(:mod:`companion.analysis.calculator`, chapter 13): multi-head latent attention, Gated
DeltaNet, Kimi Delta Attention, DeepSeek Sparse Attention's lightning indexer, and
DeepSeek-V4's compressed attention and hyper-connections.

Shape legend: d model width, H heads; MLA: r latent width, r_q query latent width, R
decoupled RoPE width, D_nope / D_v per-head key and value widths; Gated DeltaNet: H_k /
H_v heads, D_k / D_v head widths, K convolution width; KDA: H heads of width D (keys and
values alike); DSA: H_I indexer heads of width D_I; V4: D head width, C_q query latent,
G output groups of rank r, m pooling ratio, H_I indexer heads of width c, n streams.

Each function returns ``(parameters, matrix weights)`` of one layer: the second is what
a token's forward pass multiplies by (2 FLOPs each).
"""

from __future__ import annotations

import math
from fractions import Fraction

from companion.models.config import ModelConfig

__all__ = [
    "compressed_attention_flops",
    "compressed_attention_params",
    "compressed_bytes_per_token",
    "compressed_cache_bytes",
    "gated_deltanet_params",
    "hyper_connection_params",
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


def compressed_attention_params(cfg: ModelConfig, kind: str) -> tuple[int, int]:
    """(parameters, matrix weights) of one DeepSeek-V4 layer of ``kind``: the query
    latent and heads, the one key/value head, the grouped output, the sinks; CSA and
    HCA add a compressor (kv and gate rows of width W = 2D with CSA's overlap, else D,
    a position bias (m, W), a norm), CSA its indexer (a compressor of width c, query
    heads from the latent, a weight per head)."""
    c = cfg.compression
    d, h, d_h, c_q = cfg.d_model, cfg.n_heads, cfg.head_dim, c.q_lora_rank
    out = c.o_groups * c.o_lora_rank
    matrices = d * c_q + c_q * h * d_h + d * d_h + h * d_h * c.o_lora_rank + out * d
    params = matrices + c_q + d_h + h  # q_a_norm, kv_norm, sinks
    m = c.ratio(kind)
    if kind == "sliding":
        return params, matrices
    width = (2 if kind == "csa" else 1) * d_h
    matrices += 2 * d * width
    params += 2 * d * width + m * width + d_h
    if kind == "csa":
        h_i, d_i = c.index_n_heads, c.index_head_dim
        index = 2 * d * 2 * d_i + c_q * h_i * d_i + d * h_i
        matrices += index
        params += index + m * 2 * d_i + d_i
    return params, matrices


def compressed_cache_bytes(
    cfg: ModelConfig, kind: str, tokens: int, dtype_bytes: int
) -> int:
    """Bytes one DeepSeek-V4 layer caches for ``tokens`` positions: the window ring
    (min(tokens, w) keys of D), and for CSA/HCA the tokens // m pooled entries of D plus
    the compressor's source rows (kv and gate of the last m positions, 2m with CSA's
    overlap); CSA adds its indexer's keys (tokens // m of c) and source rows."""
    c = cfg.compression
    d_h, m = cfg.head_dim, c.ratio(kind)
    numbers = min(tokens, cfg.sliding_window) * d_h
    if kind != "sliding":
        overlap = 2 if kind == "csa" else 1
        numbers += (tokens // m) * d_h + 2 * (overlap * m) * (overlap * d_h)
    if kind == "csa":
        d_i = c.index_head_dim
        numbers += (tokens // m) * d_i + 2 * (2 * m) * (2 * d_i)
    return numbers * dtype_bytes


def hyper_connection_params(cfg: ModelConfig) -> tuple[int, int, int]:
    """(parameters of one hyper-connection, its matrix weights, parameters of the head
    that collapses the streams): ``fn ((2+n)·n, n·d)``, ``base``, ``scale (3,)``; the
    head's ``hc_fn (n, n·d)``, ``hc_base (n,)``, ``hc_scale (1,)``."""
    n, d = cfg.residual.n_streams, cfg.d_model
    fn = (2 + n) * n * n * d
    return fn + (2 + n) * n + 3, fn, n * n * d + n + 1


def compressed_bytes_per_token(cfg: ModelConfig, dtype_bytes: int) -> int:
    """DeepSeek-V4: per layer D for the window ring, plus a pooled entry of D (and a CSA
    layer's index key of c) every m positions, amortised and rounded up to a byte."""
    c, d_h = cfg.compression, cfg.head_dim
    pooled = Fraction(0)
    for kind in cfg.layer_types:
        width = d_h + (c.index_head_dim if kind == "csa" else 0)
        pooled += Fraction(width, c.ratio(kind)) if kind != "sliding" else 0
    return math.ceil((cfg.n_layers * d_h + pooled) * dtype_bytes)


def compressed_attention_flops(cfg: ModelConfig, kind: str, context: int) -> int:
    """DeepSeek-V4: 4·s·H·D over the window's min(s, w) keys and the entries the layer
    reads (HCA: all s // m; CSA: the best min(s // m, K_I), which its indexer picks with
    2·(s // m)·H_I·c scores)."""
    c = cfg.compression
    keys = min(context, cfg.sliding_window)
    entries = context // c.ratio(kind) if kind != "sliding" else 0
    index = 0
    if kind == "csa":
        index = 2 * entries * c.index_n_heads * c.index_head_dim
        entries = min(entries, c.index_topk)
    return 4 * (keys + entries) * cfg.n_heads * cfg.head_dim + index

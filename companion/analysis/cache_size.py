"""The decoding cache a config needs: bytes per token and at a given length (chapters
09, 11, 13), for :mod:`companion.analysis.calculator`.

Shape legend: H_kv key/value heads, D head width, w sliding window; MLA: r latent
width, R RoPE width; DSA: D_I indexer key width; Gated DeltaNet: H_k / H_v heads, D_k /
D_v head widths, K convolution width.

The conventions are the calculator's (its module docstring): what decoding must keep
per sequence, the numbers :class:`companion.models.decoder.DecoderLM`'s caches hold.
"""

from __future__ import annotations

from companion.analysis.mixer_params import (
    compressed_bytes_per_token,
    compressed_cache_bytes,
    own_indexer,
)
from companion.checks import check_int
from companion.models.config import ModelConfig

__all__ = ["check_config", "kv_cache_bytes", "kv_cache_bytes_per_token"]


def check_config(cfg: object) -> None:
    """Raise a TypeError unless ``cfg`` is a ModelConfig."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(
            f"cfg must be a companion.models.config.ModelConfig, got {type(cfg).__name__}"
        )


def _cache_width(cfg: ModelConfig) -> int:
    """Numbers one attention layer caches per position: K and V, or MLA's latent + RoPE
    key."""
    if cfg.mla is not None:
        return cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    return 2 * cfg.n_kv_heads * cfg.head_dim


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes one more cached position costs, summed over layers, while the context is
    shorter than every window: 2·H_kv·D per attention layer (MLA: r + R); Gated DeltaNet
    layers add nothing per token (see :func:`kv_cache_bytes` for their fixed state)."""
    check_config(cfg)
    check_int("dtype_bytes", dtype_bytes, 1)
    if cfg.compression is not None:
        return compressed_bytes_per_token(cfg, dtype_bytes)
    layers = sum(kind != "linear" for kind in cfg.layer_types)
    index = sum(own_indexer(cfg, i) for i in range(cfg.n_layers))
    d_i = cfg.mla.indexer.head_dim if index else 0
    return (layers * _cache_width(cfg) + index * d_i) * dtype_bytes


def kv_cache_bytes(
    cfg: ModelConfig,
    tokens: int,
    dtype_bytes: int = 2,
    *,
    batch: int = 1,
    state_dtype_bytes: int = 4,
) -> int:
    """Bytes of the decoding cache of ``batch`` sequences of ``tokens`` positions each.

    Full layers keep every position, sliding layers the last min(tokens, w), Gated
    DeltaNet layers a fixed H_v·D_k·D_v state in ``state_dtype_bytes`` (4: fp32) plus
    their convolution's last K − 1 inputs, (2·H_k·D_k + H_v·D_v)·(K − 1) numbers in
    ``dtype_bytes``.
    """
    check_config(cfg)
    check_int("tokens", tokens, 0)
    check_int("dtype_bytes", dtype_bytes, 1)
    check_int("batch", batch, 1)
    check_int("state_dtype_bytes", state_dtype_bytes, 1)
    total = 0
    for layer, kind in enumerate(cfg.layer_types):
        if kind == "linear":
            lin = cfg.linear
            h_k, h_v, d_k, d_v = (
                lin.key_heads,
                lin.value_heads,
                lin.key_dim,
                lin.value_dim,
            )
            total += h_v * d_k * d_v * state_dtype_bytes
            total += (2 * h_k * d_k + h_v * d_v) * (lin.conv_kernel - 1) * dtype_bytes
        elif cfg.compression is not None:
            total += compressed_cache_bytes(cfg, kind, tokens, dtype_bytes)
        else:
            kept = min(tokens, cfg.sliding_window) if kind == "sliding" else tokens
            width = _cache_width(cfg)
            if own_indexer(cfg, layer):
                width += cfg.mla.indexer.head_dim
            total += kept * width * dtype_bytes
    return batch * total

"""The decoding cache a config needs: bytes per token and at a given length (chapters
08, 09, 11, 13), for :mod:`companion.analysis.calculator`.

Shape legend: H_kv key/value heads, D head width, w sliding window; MLA: r latent
width, R RoPE width; DSA: D_I indexer key width; Gated DeltaNet: H_k / H_v heads, D_k /
D_v head widths, K convolution width; DeepSeek-V4: m pooling ratio, c index key width;
b bytes per cached number (``dtype_bytes``), s bytes of scale per cached row
(``scale_bytes``).

The conventions are the calculator's (its module docstring): what decoding must keep
per sequence, the numbers :class:`companion.models.decoder.DecoderLM`'s caches hold.

**Scales.** A quantised cache (int8, fp8) stores each row with its own scale. A *row*
is what one position writes for one head: one K row and one V row of D per K/V head,
one MLA row [latent | RoPE key] of r + R, one indexer key of D_I; on DeepSeek-V4
layers one window key of D, one pooled entry of D, one CSA index entry of c, one
compressor source row (kv or gate); on Gated DeltaNet / KDA layers one convolution
input per head (2·H_k + H_v rows per position). Every row held in ``dtype_bytes``
carries ``scale_bytes`` more; the linear layers' recurrent state (``state_dtype_bytes``)
carries none. With ``scale_bytes=0`` (the default: bf16 or fp32, or one scale per
tensor) the counts are exactly the buffers of the plain caches.
"""

from __future__ import annotations

import math
from fractions import Fraction

from companion.analysis.mixer_params import compressed_cache_bytes, own_indexer
from companion.checks import check_int
from companion.models.config import ModelConfig

__all__ = ["check_config", "kv_cache_bytes", "kv_cache_bytes_per_token"]


def check_config(cfg: object) -> None:
    """Raise a TypeError unless ``cfg`` is a ModelConfig."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(
            f"cfg must be a companion.models.config.ModelConfig, got {type(cfg).__name__}"
        )


def _attention_row(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """(numbers, rows) one attention layer caches per position: K and V, 2·H_kv rows
    of D, or MLA's one row of r + R; plus its own indexer's key, one row of D_I."""
    if cfg.mla is not None:
        numbers, rows = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim, 1
    else:
        numbers, rows = 2 * cfg.n_kv_heads * cfg.head_dim, 2 * cfg.n_kv_heads
    if own_indexer(cfg, layer):
        numbers, rows = numbers + cfg.mla.indexer.head_dim, rows + 1
    return numbers, rows


def _compressed_per_token(cfg: ModelConfig) -> tuple[Fraction, Fraction]:
    """DeepSeek-V4 (numbers, rows) per token: per layer one window key of D, plus a
    pooled entry of D (and on CSA an index entry of c) every m positions."""
    c, d_h = cfg.compression, cfg.head_dim
    numbers, rows = Fraction(cfg.n_layers * d_h), Fraction(cfg.n_layers)
    for kind in cfg.layer_types:
        if kind != "sliding":
            csa = kind == "csa"
            numbers += Fraction(d_h + (c.index_head_dim if csa else 0), c.ratio(kind))
            rows += Fraction(2 if csa else 1, c.ratio(kind))
    return numbers, rows


def _compressed_rows(cfg: ModelConfig, kind: str, tokens: int) -> int:
    """Rows one DeepSeek-V4 layer holds for ``tokens`` positions (the numbers are
    :func:`~companion.analysis.mixer_params.compressed_cache_bytes`'): the window's
    keys, and on CSA/HCA the pooled entries and the compressor's kv and gate source
    rows of the open block (m each, 2m with CSA's overlap); CSA's indexer the same."""
    rows = min(tokens, cfg.sliding_window)
    if kind != "sliding":
        m = cfg.compression.ratio(kind)
        rows += tokens // m + 2 * (2 if kind == "csa" else 1) * m
    if kind == "csa":
        rows += tokens // m + 2 * 2 * m
    return rows


def kv_cache_bytes_per_token(
    cfg: ModelConfig, dtype_bytes: int = 2, *, scale_bytes: int = 0
) -> int:
    """Bytes one more cached position costs, summed over layers, while the context is
    shorter than every window: 2·H_kv·(D·b + s) per attention layer (MLA: (r + R)·b +
    s; an own indexer adds D_I·b + s); Gated DeltaNet layers add nothing per token (see
    :func:`kv_cache_bytes` for their fixed state). DeepSeek-V4: per layer D·b + s for
    the window key, plus each pooled entry's share, rounded up to a whole byte."""
    check_config(cfg)
    check_int("dtype_bytes", dtype_bytes, 1)
    check_int("scale_bytes", scale_bytes, 0)
    if cfg.compression is not None:
        numbers, rows = _compressed_per_token(cfg)
        return math.ceil(numbers * dtype_bytes + rows * scale_bytes)
    total = 0
    for layer, kind in enumerate(cfg.layer_types):
        if kind != "linear":
            numbers, rows = _attention_row(cfg, layer)
            total += numbers * dtype_bytes + rows * scale_bytes
    return total


def kv_cache_bytes(
    cfg: ModelConfig,
    tokens: int,
    dtype_bytes: int = 2,
    *,
    batch: int = 1,
    state_dtype_bytes: int = 4,
    scale_bytes: int = 0,
) -> int:
    """Bytes of the decoding cache of ``batch`` sequences of ``tokens`` positions each.

    Full layers keep every position, sliding layers the last min(tokens, w), Gated
    DeltaNet layers a fixed H_v·D_k·D_v state in ``state_dtype_bytes`` (4: fp32) plus
    their convolution's last K − 1 inputs, (2·H_k·D_k + H_v·D_v)·(K − 1) numbers in
    ``dtype_bytes``. Every row held in ``dtype_bytes`` adds ``scale_bytes`` (the module
    docstring says what a row is).
    """
    check_config(cfg)
    check_int("tokens", tokens, 0)
    check_int("dtype_bytes", dtype_bytes, 1)
    check_int("batch", batch, 1)
    check_int("state_dtype_bytes", state_dtype_bytes, 1)
    check_int("scale_bytes", scale_bytes, 0)
    b, s = dtype_bytes, scale_bytes
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
            tail = lin.conv_kernel - 1  # positions the convolution still needs
            total += ((2 * h_k * d_k + h_v * d_v) * b + (2 * h_k + h_v) * s) * tail
        elif cfg.compression is not None:
            total += compressed_cache_bytes(cfg, kind, tokens, b)
            total += _compressed_rows(cfg, kind, tokens) * s
        else:
            kept = min(tokens, cfg.sliding_window) if kind == "sliding" else tokens
            numbers, rows = _attention_row(cfg, layer)
            total += kept * (numbers * b + rows * s)
    return batch * total

"""Bytes of scale in the cache formula (companion.analysis.cache_size): a quantised
cache (int8, fp8; chapters 08 and 16) stores one scale per cached row, and
``scale_bytes`` prices it. Checked against the rows of the caches DecoderLM allocates
and against hand counts of released shapes."""

from __future__ import annotations

import pytest
import torch

from companion.analysis.cache_size import kv_cache_bytes, kv_cache_bytes_per_token
from companion.analysis.mixer_params import compressed_bytes_per_token
from companion.models.config import ModelConfig
from companion.models.config_parts import LinearAttentionConfig, MLAConfig, SparseConfig
from companion.models.config_streams import CompressedAttentionConfig
from companion.models.decoder import DecoderLM
from companion.models.presets import PRESETS, preset, tiny

# a Gated DeltaNet layer's convolution tail, counted by hand for "linear" below: q and
# k of 2 heads, v of 4 heads, one row each per position, for K - 1 = 3 positions
CONV_ROWS = (2 + 2 + 4) * 3


def _configs() -> dict[str, ModelConfig]:
    """One small config per kind of cached row: K/V per head (full and sliding), MLA's
    latent row with an indexer key, Gated DeltaNet's conv tail and fp32 state, and
    DeepSeek-V4's window, pooled entries, index entries and compressor source rows."""
    mla = MLAConfig(16, 8, 8, 12, q_lora_rank=24, indexer=SparseConfig(3, 16, 5))
    lin = LinearAttentionConfig(
        key_heads=2, value_heads=4, key_dim=8, value_dim=16, conv_kernel=4
    )
    v4 = CompressedAttentionConfig(24, 2, 8, 4, 12, 3, hca_ratio=8)
    return {
        "gqa-sliding": tiny(
            n_layers=3, sliding_window=4, layer_types=("sliding", "full", "sliding")
        ),
        "mla-indexer": tiny(head_dim=None, n_kv_heads=None, mla=mla),
        "linear": tiny(n_layers=2, layer_types=("linear", "full"), linear=lin),
        "v4": tiny(
            n_layers=4,
            n_kv_heads=1,
            head_dim=16,
            partial_rotary_factor=0.5,
            sliding_window=6,
            layer_types=("hca", "sliding", "csa", "hca"),
            attn_sinks=True,
            compression=v4,
        ),
    }


def _held(cfg: ModelConfig, tokens: int, dtype_bytes: int) -> tuple[int, int]:
    """(bytes, rows) of the cache DecoderLM allocates, its bf16 buffers priced at
    ``dtype_bytes`` a number: every such buffer is (..., rows, width), except the conv
    tail (batch, channels, K - 1), whose rows are CONV_ROWS."""
    cache = DecoderLM(cfg).new_cache(1, tokens, dtype=torch.bfloat16)
    held = rows = 0
    for name, buf in cache.state_dict().items():
        if buf.dtype != torch.bfloat16:  # the linear layers' fp32 state
            held += buf.numel() * buf.element_size()
            continue
        held += buf.numel() * dtype_bytes
        rows += (
            CONV_ROWS if name.endswith("conv_state") else buf.numel() // buf.shape[-1]
        )
    return held, rows


@pytest.mark.parametrize("name", sorted(_configs()))
def test_scales_are_one_per_row_the_caches_hold(name: str) -> None:
    cfg = _configs()[name]
    for tokens in (3, 16, 40):  # below the windows, past them, past many V4 blocks
        for dtype_bytes, scale_bytes in ((2, 0), (1, 2), (1, 4), (4, 3)):
            held, rows = _held(cfg, tokens, dtype_bytes)
            got = kv_cache_bytes(cfg, tokens, dtype_bytes, scale_bytes=scale_bytes)
            assert got == held + scale_bytes * rows, (tokens, dtype_bytes, scale_bytes)
            batch = kv_cache_bytes(cfg, tokens, dtype_bytes, batch=3, scale_bytes=1)
            assert batch == 3 * (held + rows)


def test_per_token_hand_counts() -> None:
    """int8 with a 4-byte scale per row: Llama 3 8B, 32 layers of 8 K and 8 V rows of
    128; DeepSeek-V3, 61 layers of one 512 + 64 row; DeepSeek-V3.2 adds a 128-wide
    indexer key per layer; Qwen3-Next: 12 full layers of 2 K and 2 V rows of 256."""
    assert kv_cache_bytes_per_token(preset("llama3-8b"), 1, scale_bytes=4) == (
        32 * 16 * (128 + 4)
    )
    assert kv_cache_bytes_per_token(preset("deepseek-v3"), 1, scale_bytes=4) == (
        61 * (576 + 4)
    )
    v32 = kv_cache_bytes_per_token(preset("deepseek-v3.2"), 1, scale_bytes=4)
    assert v32 == 61 * (576 + 4) + 61 * (128 + 4)
    nxt = preset("qwen3-next-80b-a3b")
    assert kv_cache_bytes_per_token(nxt, 1, scale_bytes=4) == 12 * 4 * (256 + 4)
    # its 36 linear layers: fp32 state (no scale), conv tail of 16 + 16 + 32 heads of 128
    state = 32 * 128 * 128 * 4 + ((2 * 16 + 32) * 128 + (2 * 16 + 32) * 4) * 3
    assert kv_cache_bytes(nxt, 0, 1, scale_bytes=4) == 36 * state
    assert kv_cache_bytes(nxt, 10, 1, scale_bytes=4) == 36 * state + 10 * 12 * 4 * 260


def test_per_token_is_what_each_more_position_adds() -> None:
    for name in ("llama3-8b", "deepseek-v3.2", "qwen3-next-80b-a3b", "gemma3-27b"):
        cfg = preset(name)
        per = kv_cache_bytes_per_token(cfg, 1, scale_bytes=2)
        grow = kv_cache_bytes(cfg, 101, 1, scale_bytes=2) - kv_cache_bytes(
            cfg, 100, 1, scale_bytes=2
        )
        assert grow == per, name


@pytest.mark.parametrize("name", [n for n, c in PRESETS.items() if c.compression])
def test_v4_per_token(name: str) -> None:
    """DeepSeek-V4: without scales, mixer_params' own count; with them, each window
    key and each pooled entry's share adds its scale, rounded up once."""
    cfg = preset(name)
    for dtype_bytes in (1, 2, 4):
        assert kv_cache_bytes_per_token(cfg, dtype_bytes) == compressed_bytes_per_token(
            cfg, dtype_bytes
        )
    c, layers = cfg.compression, cfg.layer_types
    n_csa, n_hca = layers.count("csa"), layers.count("hca")
    m_c, m_h = c.csa_ratio, c.hca_ratio
    # per m_c·m_h tokens: every layer m_c·m_h window keys, a CSA layer m_h entries and
    # m_h index entries, an HCA layer m_c entries
    numbers = (
        cfg.n_layers * cfg.head_dim * m_c * m_h
        + n_csa * (cfg.head_dim + c.index_head_dim) * m_h
        + n_hca * cfg.head_dim * m_c
    )
    rows = cfg.n_layers * m_c * m_h + n_csa * 2 * m_h + n_hca * m_c
    want = -(-(numbers * 1 + rows * 4) // (m_c * m_h))  # rounded up
    assert kv_cache_bytes_per_token(cfg, 1, scale_bytes=4) == want


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_bad_scale_bytes_is_named(bad: object) -> None:
    cfg = preset("smollm2-135m")
    with pytest.raises(ValueError, match="scale_bytes must be a non-negative integer"):
        kv_cache_bytes_per_token(cfg, 1, scale_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scale_bytes"):
        kv_cache_bytes(cfg, 8, 1, scale_bytes=bad)  # type: ignore[arg-type]

"""The builders of DeepSeek-V4's parts (chapters 08, 12): a config's compressed
attention layer and the hyper-connections around a block's sublayers.

:mod:`companion.models.builders` calls them where ``compression`` or ``residual`` is
set; each reads the config and returns finished modules.
"""

from __future__ import annotations

from companion.layers.compressed_attention import CompressedAttention
from companion.layers.hyper_connections import HyperConnection
from companion.layers.rotary import RotaryEmbedding
from companion.models.config import ModelConfig

__all__ = ["compressed_attention", "hyper_connections"]


def compressed_attention(
    cfg: ModelConfig, kind: str, rope: RotaryEmbedding
) -> CompressedAttention:
    """A DeepSeek-V4 layer of ``kind`` "sliding", "csa" or "hca": the window, and for
    CSA/HCA the pooled entries; ``rope`` is the layer's table (the model's for
    sliding layers, ``compression``'s for CSA and HCA)."""
    c = cfg.compression
    return CompressedAttention(
        cfg.d_model,
        cfg.n_heads,
        cfg.head_dim,
        q_lora_rank=c.q_lora_rank,
        o_groups=c.o_groups,
        o_lora_rank=c.o_lora_rank,
        window=cfg.sliding_window,
        rope=rope,
        kind=kind,
        compress_ratio=c.ratio(kind),
        index_n_heads=c.index_n_heads,
        index_head_dim=c.index_head_dim,
        index_topk=c.index_topk,
        norm_eps=cfg.norm_eps,
        impl=cfg.attn_impl,
        dropout=cfg.attn_dropout,
    )


def hyper_connections(
    cfg: ModelConfig, sites: tuple[str, ...]
) -> dict[str, HyperConnection] | None:
    """One hyper-connection per sublayer (``residual``), or None: the placement's add."""
    hc = cfg.residual
    if hc is None:
        return None
    return {
        site: HyperConnection(
            cfg.d_model,
            hc.n_streams,
            sinkhorn_iters=hc.sinkhorn_iters,
            eps=hc.eps,
            norm_eps=cfg.norm_eps,
            init_std=cfg.init_std,
        )
        for site in sites
    }

"""DeepSeek-V4's two config groups (chapters 08, 12): compressed attention and
hyper-connections.

``compression`` (:class:`CompressedAttentionConfig`) makes every attention layer
DeepSeek-V4's :class:`~companion.layers.compressed_attention.CompressedAttention`: the
config's ``layer_types`` then give each layer ``"sliding"`` (the window only), ``"csa"``
(plus the indexer's best ``index_topk`` of entries pooled over overlapping blocks of
``csa_ratio`` tokens) or ``"hca"`` (plus every entry pooled over blocks of
``hca_ratio``). The widths shared with other attention stay model fields: ``n_heads``
queries of ``head_dim`` channels, one key/value head, the window ``sliding_window``,
``partial_rotary_factor`` of each head rotated, sliding layers on the model's RoPE
(``rope_theta``, ``rope_scaling``), CSA and HCA layers on the group's own
(``rope_theta``, ``rope_scaling`` here: transformers' ``compress_rope_theta`` and its
YaRN).

``residual`` (:class:`HyperConnectionConfig`) replaces each sublayer's residual add by a
manifold-constrained hyper-connection over ``n_streams`` streams (transformers'
``hc_mult``), its mixing matrix pushed to the doubly stochastic ones by
``sinkhorn_iters`` Sinkhorn steps with floor ``eps`` (``hc_sinkhorn_iters``,
``hc_eps``); the model expands the embedding into the streams and collapses them with a
:class:`~companion.layers.hyper_connections.HyperHead` before the final norm.

Each group checks its own fields; what depends on the rest of the model is checked by
:mod:`companion.models.validation`. Errors name ``group.field``.
"""

from __future__ import annotations

from dataclasses import dataclass

from companion.checks import check_int
from companion.models.config_parts import ConfigError, ConfigPart, _check_finite
from companion.ops.rope import RopeScaling

__all__ = ["CompressedAttentionConfig", "HyperConnectionConfig", "validate_streams"]


@dataclass(frozen=True, repr=False)
class CompressedAttentionConfig(ConfigPart):
    """DeepSeek-V4's attention (``compression``): a query latent of ``q_lora_rank``,
    a grouped low-rank output (``o_groups`` groups of heads, each through
    ``o_lora_rank``), the pooling ratios of "csa" and "hca" layers, the CSA indexer
    (``index_n_heads`` heads of ``index_head_dim``, the best ``index_topk`` entries),
    and the RoPE of CSA/HCA layers (``rope_theta``, ``rope_scaling``)."""

    GROUP = "compression"

    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    csa_ratio: int = 4
    hca_ratio: int = 128
    rope_theta: float = 160000.0
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        g = self.GROUP
        for name in (
            "q_lora_rank",
            "o_groups",
            "o_lora_rank",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "csa_ratio",
            "hca_ratio",
        ):
            check_int(f"{g}.{name}", getattr(self, name), 1, ConfigError)
        _check_finite(g, "rope_theta", self.rope_theta, sign=1)
        if self.rope_scaling is not None and not isinstance(
            self.rope_scaling, RopeScaling
        ):
            raise ConfigError(
                f"{g}.rope_scaling must be a RopeScaling or None, got "
                f"{type(self.rope_scaling).__name__} {self.rope_scaling!r}"
            )

    def ratio(self, kind: str) -> int:
        """The pooling ratio of a ``"csa"`` or ``"hca"`` layer; 0 for ``"sliding"``."""
        return {"csa": self.csa_ratio, "hca": self.hca_ratio}.get(kind, 0)


@dataclass(frozen=True, repr=False)
class HyperConnectionConfig(ConfigPart):
    """Manifold-constrained hyper-connections (``residual``): ``n_streams`` residual
    streams, ``sinkhorn_iters`` Sinkhorn steps, the floor ``eps`` of the collapse
    weights and of Sinkhorn's sums."""

    GROUP = "residual"

    n_streams: int
    sinkhorn_iters: int = 20
    eps: float = 1e-6

    def __post_init__(self) -> None:
        g = self.GROUP
        check_int(f"{g}.n_streams", self.n_streams, 1, ConfigError)
        check_int(f"{g}.sinkhorn_iters", self.sinkhorn_iters, 1, ConfigError)
        _check_finite(g, "eps", self.eps, sign=1)


# ---------------------------------------------------------------- checks against the model


def validate_streams(cfg: object) -> None:
    """Raise a ConfigError naming the field if the model config's ``compression``,
    ``residual`` or ``moe.hash_layers`` do not fit the rest of it (called by
    :func:`companion.models.validation.validate`)."""
    for name, kind in (
        ("compression", CompressedAttentionConfig),
        ("residual", HyperConnectionConfig),
    ):
        value = getattr(cfg, name)
        if value is not None and not isinstance(value, kind):
            raise ConfigError(
                f"{name} must be a {kind.__name__} or None, got "
                f"{type(value).__name__} {value!r}"
            )
    kinds = tuple(cfg.layer_types or ())
    compressed = sorted({"csa", "hca"} & set(kinds))
    if cfg.compression is None:
        if compressed:
            raise ConfigError(
                f"layer_types has {compressed} layers: set "
                "compression=CompressedAttentionConfig(...)"
            )
    else:
        _validate_compression(cfg, kinds)
    if cfg.residual is not None:
        if cfg.norm_placement != "pre" or cfg.dropout != 0.0:
            raise ConfigError(
                "residual (hyper-connections) replaces the residual add: it needs "
                f"norm_placement='pre' and dropout=0, got {cfg.norm_placement!r} and "
                f"{cfg.dropout}"
            )
    if cfg.moe is not None:
        _validate_v4_moe(cfg)


def _validate_v4_moe(cfg: object) -> None:
    """Hash layers fit the stack and leave routing to their table; the SwiGLU clamp is
    for "glu" experts."""
    moe, g = cfg.moe, "moe"
    _check_finite(g, "swiglu_limit", moe.swiglu_limit, sign=1, optional=True)
    if moe.hash_layers and (moe.router_groups != 1 or moe.router_bias):
        raise ConfigError(
            f"{g}.hash_layers take their experts from a table: they need "
            f"{g}.router_groups=1 and {g}.router_bias=False"
        )
    if moe.swiglu_limit is not None and moe.expert_kind != "glu":
        raise ConfigError(
            f"{g}.swiglu_limit clamps 'glu' experts (gpt_oss's clamp is fixed), got "
            f"{g}.expert_kind={moe.expert_kind!r}"
        )
    if moe.hash_layers and moe.dense_layers + moe.hash_layers > cfg.n_layers:
        raise ConfigError(
            f"moe.hash_layers={moe.hash_layers} after moe.dense_layers="
            f"{moe.dense_layers} exceed n_layers={cfg.n_layers}"
        )


def _validate_compression(cfg: object, kinds: tuple[str, ...]) -> None:
    """Compressed attention on every layer: only "sliding", "csa" and "hca" layers,
    a window, RoPE, one key/value head, sinks, no other attention option."""
    c = cfg.compression
    other = sorted(set(kinds) - {"sliding", "csa", "hca"})
    if other:
        raise ConfigError(
            f"compression makes every layer compressed attention: layer_types entries "
            f"must be 'sliding', 'csa' or 'hca', got {other}"
        )
    if cfg.sliding_window is None:
        raise ConfigError(
            "compression needs sliding_window: every layer has the window"
        )
    if cfg.position != "rope":
        raise ConfigError(f"compression needs position='rope', got {cfg.position!r}")
    for name, value, want in (
        ("mla", cfg.mla, None),
        ("linear", cfg.linear, None),
        ("qk_norm", cfg.qk_norm, "none"),
        ("attn_output_gate", cfg.attn_output_gate, False),
        ("attn_sinks", cfg.attn_sinks, True),
        ("n_kv_heads", cfg.n_kv_heads, 1),
        ("nope_layers", cfg.nope_layers, ()),
        ("rope_local_theta", cfg.rope_local_theta, None),
    ):
        if value != want and not (name == "n_kv_heads" and value is None):
            raise ConfigError(
                f"{name}={value!r} does not combine with compression (DeepSeek-V4's "
                f"attention): it needs {name}={want!r}"
            )
    if cfg.attn_impl not in ("reference", "sdpa"):
        raise ConfigError(
            "compression's attention runs with attn_impl 'reference' or 'sdpa' (the "
            f"forms with sinks), got {cfg.attn_impl!r}"
        )
    if cfg.n_heads % c.o_groups:
        raise ConfigError(
            f"compression.o_groups ({c.o_groups}) must divide n_heads ({cfg.n_heads})"
        )
    if cfg.head_dim is not None and c.index_head_dim < _rotated(cfg):
        raise ConfigError(
            f"compression.index_head_dim ({c.index_head_dim}) must be at least the "
            f"rotated channels ({_rotated(cfg)})"
        )


def _rotated(cfg: object) -> int:
    """The channels of a head RoPE rotates: ``head_dim · partial_rotary_factor``."""
    return int(cfg.head_dim * cfg.partial_rotary_factor)

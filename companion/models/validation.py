"""The checks a :class:`companion.models.config.ModelConfig` runs on itself (chapters
02-13).

Each error names the field, what it got and what it accepts.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from companion.checks import check_int
from companion.models.config_parts import (
    INDEXER_KINDS,
    ConfigError,
    LinearAttentionConfig,
    MLAConfig,
    MoEConfig,
    SparseConfig,
)
from companion.models.config_streams import validate_streams
from companion.ops.rope import RopeScaling, rope_frequencies

if TYPE_CHECKING:
    from companion.models.config import ModelConfig

__all__ = ["LAYER_TYPES", "validate", "validate_rope"]

# "csa" and "hca": DeepSeek-V4's compressed layers (config.compression)
LAYER_TYPES = ("full", "sliding", "linear", "csa", "hca")


def _probability(cfg: ModelConfig, name: str) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ConfigError(f"{name} must be a probability in [0, 1), got {value!r}")


def validate(cfg: ModelConfig, choices: dict[str, tuple[str, ...]]) -> None:
    """Raise a ConfigError naming the first field of ``cfg`` that cannot be built
    from."""
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
        check_int(name, getattr(cfg, name), 1, ConfigError)
    if cfg.d_ff is not None:
        check_int("d_ff", cfg.d_ff, 1, ConfigError)
    for name in ("dropout", "attn_dropout"):
        _probability(cfg, name)
    for name, allowed in choices.items():
        value = getattr(cfg, name)
        if value not in allowed:
            raise ConfigError(f"{name} must be one of {allowed}, got {value!r}")
    if cfg.qkv_bias is not None and not isinstance(cfg.qkv_bias, bool):
        raise ConfigError(f"qkv_bias must be None, True or False, got {cfg.qkv_bias!r}")
    for name in ("fused_qkv", "bias", "tie_embeddings", "scale_embeddings"):
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(
                f"{name} must be True or False, got {getattr(cfg, name)!r}"
            )
    if cfg.head_dim is not None:
        check_int("head_dim", cfg.head_dim, 1, ConfigError)
    elif cfg.mla is None and cfg.d_model % cfg.n_heads != 0:
        divisors = [h for h in range(1, cfg.d_model + 1) if cfg.d_model % h == 0][:12]
        raise ConfigError(
            f"d_model ({cfg.d_model}) must be divisible by n_heads ({cfg.n_heads}); "
            f"n_heads values that divide it: {divisors}"
        )
    if cfg.n_kv_heads is not None:
        check_int("n_kv_heads", cfg.n_kv_heads, 1, ConfigError)
        if cfg.n_heads % cfg.n_kv_heads != 0:
            raise ConfigError(
                f"n_heads ({cfg.n_heads}) must be a multiple of n_kv_heads ({cfg.n_kv_heads})"
            )
    if cfg.sliding_window is not None:
        check_int("sliding_window", cfg.sliding_window, 1, ConfigError)
    for name in ("layer_types", "nope_layers"):
        value = getattr(cfg, name)
        if value is not None and not isinstance(value, tuple):
            raise ConfigError(
                f"{name} must be a tuple, got {type(value).__name__} {value!r}"
            )
    if cfg.layer_types is not None:
        if len(cfg.layer_types) != cfg.n_layers:
            raise ConfigError(
                f"layer_types has {len(cfg.layer_types)} entries but n_layers is {cfg.n_layers}"
            )
        bad = sorted(set(cfg.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(
                f"layer_types entries must be one of {LAYER_TYPES}, got {bad}"
            )
        if "sliding" in cfg.layer_types and cfg.sliding_window is None:
            raise ConfigError(
                "layer_types has 'sliding' layers but sliding_window is None"
            )
    _validate_linear(cfg)
    bad_layers = [i for i in cfg.nope_layers if not 0 <= i < cfg.n_layers]
    if bad_layers:
        raise ConfigError(
            f"nope_layers must be layer indices in [0, {cfg.n_layers}), got {bad_layers}"
        )
    _validate_moe(cfg)
    _validate_mla(cfg)
    validate_streams(cfg)
    if cfg.rope_scaling is not None and not isinstance(cfg.rope_scaling, RopeScaling):
        raise ConfigError(
            f"rope_scaling must be a RopeScaling or None, got {type(cfg.rope_scaling).__name__} "
            f"{cfg.rope_scaling!r}; e.g. RopeScaling('linear', factor=8.0)"
        )
    _validate_floats(cfg)
    _validate_effects(cfg)


def _finite(name: str, value: object, *, positive: bool) -> None:
    """Raise a ConfigError unless ``value`` is a finite number (> 0 if ``positive``)."""
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and (value > 0 or not positive)
    )
    if not ok:
        what = "a finite number > 0" if positive else "a finite number"
        raise ConfigError(f"{name} must be {what}, got {value!r}")


def _validate_floats(cfg: ModelConfig) -> None:
    """Every float field finite, and positive where a non-positive value means
    nothing (a NaN scale or an infinite eps gives silently wrong logits)."""
    for name in ("norm_eps", "init_std", "rope_theta"):
        _finite(name, getattr(cfg, name), positive=True)
    for name in ("rope_local_theta", "attn_scale"):
        if getattr(cfg, name) is not None:
            _finite(name, getattr(cfg, name), positive=True)
    _finite("norm_offset", cfg.norm_offset, positive=False)
    f = cfg.partial_rotary_factor
    _finite("partial_rotary_factor", f, positive=True)
    if f > 1:
        raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {f!r}")


def _validate_effects(cfg: ModelConfig) -> None:
    """Reject settings that could not change the model, saying why: a user who sets
    them expects an effect."""
    if cfg.attn_gate_layout != "interleaved" and not cfg.attn_output_gate:
        raise ConfigError(
            f"attn_gate_layout={cfg.attn_gate_layout!r} has no effect without an output "
            "gate: set attn_output_gate=True"
        )
    kinds = cfg.layer_types
    windowed = "sliding" in (kinds or ()) or cfg.compression is not None
    if cfg.sliding_window is not None and kinds is not None and not windowed:
        raise ConfigError(
            f"sliding_window={cfg.sliding_window} has no effect: layer_types has no "
            "'sliding' layer"
        )
    if cfg.moe is not None and cfg.moe.dense_layers >= cfg.n_layers:
        raise ConfigError(
            f"moe.dense_layers={cfg.moe.dense_layers} leaves no MoE layer in n_layers="
            f"{cfg.n_layers}: set moe.dense_layers < n_layers, or moe=None for a dense "
            "model"
        )
    if cfg.position != "rope":
        for name in ("rope_scaling", "rope_local_theta"):
            if getattr(cfg, name) is not None:
                raise ConfigError(
                    f"{name} has no effect with position={cfg.position!r}: it needs "
                    "position='rope'"
                )
        if cfg.nope_layers:
            raise ConfigError(
                f"nope_layers has no effect with position={cfg.position!r}: every layer "
                "is without RoPE already"
            )


def validate_rope(cfg: ModelConfig) -> None:
    """Raise a ConfigError if RoPE's tables cannot be built for ``cfg`` (resolved
    widths)."""
    if cfg.position != "rope":
        return
    tables = [(cfg.rope_theta, cfg.rope_scaling)]
    if cfg.compression is not None:  # CSA/HCA layers' own table
        tables.append((cfg.compression.rope_theta, cfg.compression.rope_scaling))
    try:
        for theta, scaling in tables:
            rope_frequencies(cfg.rope_dim, theta, scaling, cfg.partial_rotary_factor)
    except ValueError as err:
        width = "qk_rope_head_dim" if cfg.is_mla else "head_dim"
        raise ConfigError(
            f"rope settings: {err}, from {width}={cfg.rope_dim} and "
            f"partial_rotary_factor={cfg.partial_rotary_factor}"
        ) from None


def _group(cfg: ModelConfig, name: str, kind: type) -> None:
    """Raise a ConfigError unless ``cfg.<name>`` is None or a ``kind``."""
    value = getattr(cfg, name)
    if value is not None and not isinstance(value, kind):
        raise ConfigError(
            f"{name} must be a {kind.__name__} or None, got {type(value).__name__} "
            f"{value!r}"
        )


def _validate_moe(cfg: ModelConfig) -> None:
    for name in ("attn_sinks", "attn_output_gate"):
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(
                f"{name} must be True or False, got {getattr(cfg, name)!r}"
            )
    _group(cfg, "moe", MoEConfig)


def _validate_mla(cfg: ModelConfig) -> None:
    _group(cfg, "mla", MLAConfig)
    if cfg.mla is None:
        return
    if cfg.position not in ("rope", "none"):
        raise ConfigError(
            "multi-head latent attention needs position='rope' (or 'none': no RoPE, "
            f"Kimi Linear), got {cfg.position!r}"
        )
    qk = cfg.mla.qk_head_dim
    if cfg.head_dim not in (None, qk):
        raise ConfigError(
            f"head_dim under multi-head latent attention is mla.qk_nope_head_dim + "
            f"mla.qk_rope_head_dim = {qk} (or None), got {cfg.head_dim}; MLA sets its "
            "widths in mla"
        )
    _validate_indexer(cfg)


def _validate_linear(cfg: ModelConfig) -> None:
    _group(cfg, "linear", LinearAttentionConfig)
    has_layers = "linear" in (cfg.layer_types or ())
    if has_layers and cfg.linear is None:
        raise ConfigError(
            "layer_types has 'linear' layers: set linear=LinearAttentionConfig(...)"
        )
    if cfg.linear is not None and not has_layers:
        raise ConfigError("linear has no effect: layer_types has no 'linear' layer")


def _validate_indexer(cfg: ModelConfig) -> None:
    """A DSA indexer's per-layer kinds fit the stack: one per layer, the first
    attention layer "full", and no sliding window (the selection is the whole mask)."""
    mla, sparse = cfg.mla, cfg.mla.indexer
    if sparse is None:
        return
    if not isinstance(sparse, SparseConfig):
        raise ConfigError(
            f"mla.indexer must be a SparseConfig or None, got {type(sparse).__name__} "
            f"{sparse!r}"
        )
    if mla.q_lora_rank == 0:
        raise ConfigError("mla.indexer reads the query latent: set mla.q_lora_rank > 0")
    if sparse.head_dim < mla.qk_rope_head_dim:
        raise ConfigError(
            f"mla.indexer.head_dim ({sparse.head_dim}) must be at least "
            f"mla.qk_rope_head_dim ({mla.qk_rope_head_dim}), the channels it rotates"
        )
    if sparse.layers is not None and not isinstance(sparse.layers, tuple):
        raise ConfigError(
            f"mla.indexer.layers must be a tuple or None, got "
            f"{type(sparse.layers).__name__} {sparse.layers!r}"
        )
    bad = sorted(set(sparse.layers or ()) - set(INDEXER_KINDS))
    if bad:
        raise ConfigError(
            f"mla.indexer.layers entries must be one of {INDEXER_KINDS}, got {bad}"
        )
    if sparse.layers is not None and len(sparse.layers) != cfg.n_layers:
        raise ConfigError(
            f"mla.indexer.layers has {len(sparse.layers)} entries but n_layers is "
            f"{cfg.n_layers}"
        )
    default = "sliding" if cfg.sliding_window else "full"
    kinds = cfg.layer_types or (default,) * cfg.n_layers
    if "sliding" in kinds:
        raise ConfigError(
            "mla.indexer (sparse attention) does not combine with 'sliding' layers: the "
            "indexer's selection is the whole mask"
        )
    attn_layers = [i for i, k in enumerate(kinds) if k != "linear"]
    if attn_layers and sparse.kind(attn_layers[0]) != "full":
        raise ConfigError(
            f"mla.indexer.layers: the first attention layer ({attn_layers[0]}) must be "
            "'full'; a 'shared' layer reuses the selection of a 'full' one before it"
        )

"""The model configuration: one typed dataclass that checks itself (chapters 02, 03, 13).

Later chapters add fields (RoPE, RMSNorm, GQA, experts...). Each field's allowed values
live next to it in ``_CHOICES`` or in a check in ``_validate``, so an error always names
the field, what it got, and what it accepts. Derived values are properties; ``__post_init__``
never rewrites what the user set.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

__all__ = ["ConfigError", "ModelConfig"]


class ConfigError(ValueError):
    """A config field holds a value the model cannot be built from."""


# field name -> allowed values, for every field whose value is a choice
_CHOICES: dict[str, tuple[str, ...]] = {
    "norm": ("layernorm",),
    "norm_placement": ("pre", "post"),
    "activation": ("relu", "gelu"),
    "position": ("sinusoidal", "learned", "none"),
    "attn_impl": ("reference", "sdpa", "tiled"),
}


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only Transformer (the 2017 block by default).

    Shapes are named in the chapters as: V ``vocab_size``, d ``d_model``, L ``n_layers``,
    H ``n_heads``, D = d / H ``head_dim``, d_ff ``d_ff``, S_max ``max_seq_len``.
    """

    vocab_size: int
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int | None = None  # None: 4 * d_model, as in 2017
    max_seq_len: int = 256
    dropout: float = 0.0
    attn_dropout: float = 0.0
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    norm_placement: str = "pre"
    activation: str = "gelu"
    position: str = "learned"
    attn_impl: str = "sdpa"
    fused_qkv: bool = True
    bias: bool = True
    tie_embeddings: bool = True
    scale_embeddings: bool = False  # multiply token embeddings by √d, as in 2017
    init_std: float = 0.02

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def head_dim(self) -> int:
        """D, the width of one head."""
        return self.d_model // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """The FFN's hidden width, ``d_ff`` if given, else 4·d."""
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    def replace(self, **changes: object) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; known: {self.field_names()}")
        return ModelConfig(**{**asdict(self), **changes})

    @classmethod
    def field_names(cls) -> list[str]:
        """All field names, for error messages and docs."""
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ModelConfig:
        """Build from a plain dict, rejecting keys that are not fields."""
        unknown = sorted(set(data) - set(cls.field_names()))
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; known: {cls.field_names()}")
        return cls(**data)  # type: ignore[arg-type]


def _positive_int(cfg: ModelConfig, name: str) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _probability(cfg: ModelConfig, name: str) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ConfigError(f"{name} must be a probability in [0, 1), got {value!r}")


def _validate(cfg: ModelConfig) -> None:
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
        _positive_int(cfg, name)
    if cfg.d_ff is not None:
        _positive_int(cfg, "d_ff")
    for name in ("dropout", "attn_dropout"):
        _probability(cfg, name)
    for name, allowed in _CHOICES.items():
        value = getattr(cfg, name)
        if value not in allowed:
            raise ConfigError(f"{name} must be one of {allowed}, got {value!r}")
    for name in ("fused_qkv", "bias", "tie_embeddings", "scale_embeddings"):
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(f"{name} must be True or False, got {getattr(cfg, name)!r}")
    if cfg.d_model % cfg.n_heads != 0:
        divisors = [h for h in range(1, cfg.d_model + 1) if cfg.d_model % h == 0][:12]
        raise ConfigError(
            f"d_model ({cfg.d_model}) must be divisible by n_heads ({cfg.n_heads}); "
            f"n_heads values that divide it: {divisors}"
        )
    if not (isinstance(cfg.norm_eps, (int, float)) and cfg.norm_eps > 0):
        raise ConfigError(f"norm_eps must be a positive number, got {cfg.norm_eps!r}")
    if not (isinstance(cfg.init_std, (int, float)) and cfg.init_std > 0):
        raise ConfigError(f"init_std must be a positive number, got {cfg.init_std!r}")

"""The model configuration: one typed dataclass that checks itself (chapters 02, 03,
13).

Later chapters add fields (RoPE, RMSNorm, GQA, experts...). Each field's allowed values
live in ``CHOICES`` (the mechanism's own tuple) or in a check in
:mod:`companion.models.validation`, so an error always names
the field, what it got, and what it accepts.

The dense block's fields are flat; each later mechanism is one group
(:mod:`companion.models.config_parts`: ``moe``, ``mla``, ``linear``;
:mod:`companion.models.config_streams`: ``compression``, ``residual``), None when the
model does without it, so a 2017 config mentions nothing from 2026 and ``repr(cfg)``
shows only what differs from the defaults.

One name per quantity: a field that defaults from others (``d_ff``, ``head_dim``,
``n_kv_heads``, ``qkv_bias``, ``moe.expert_d_ff``, ``layer_types``) is given as None and
filled in when the config is built, so ``cfg.d_ff`` is always the width the model uses.
``replace`` derives such a field again from the changed fields; a value the user set
stays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

from companion.layers.block import PLACEMENTS
from companion.layers.ffn import ACTIVATIONS, FFN_FORMS
from companion.layers.mha import GATE_LAYOUTS, QK_NORMS
from companion.layers.norms import NORMS
from companion.layers.positions import POSITIONS
from companion.models.config_parts import (
    LinearAttentionConfig,
    MLAConfig,
    MoEConfig,
    changed_fields,
)
from companion.models.config_streams import (
    CompressedAttentionConfig,
    HyperConnectionConfig,
)
from companion.models.validation import ConfigError, validate, validate_rope
from companion.ops.dispatch import IMPLS
from companion.ops.rope import LAYOUTS, RopeScaling

__all__ = ["CHOICES", "ModelConfig"]


# field name -> allowed values, for every field whose value is a choice: the mechanism's own
# tuple where there is one
CHOICES: dict[str, tuple[str, ...]] = {
    "norm": NORMS,
    "norm_placement": PLACEMENTS,
    "activation": tuple(ACTIVATIONS),
    "ffn": FFN_FORMS,
    "position": POSITIONS,
    "rope_layout": LAYOUTS,
    "qk_norm": QK_NORMS,
    "attn_gate_layout": GATE_LAYOUTS,
    "attn_impl": IMPLS,
}


def _kinds(cfg: ModelConfig) -> tuple[str, ...]:
    return ("sliding" if cfg.sliding_window else "full",) * cfg.n_layers


def _head_dim(cfg: ModelConfig) -> int:
    if cfg.mla is not None:
        return cfg.mla.qk_head_dim
    return cfg.d_model // cfg.n_heads


# the fields a None derives, in order (moe.expert_d_ff, after them, reads d_ff)
_DERIVED: dict[str, Callable[[ModelConfig], object]] = {
    "d_ff": lambda cfg: 4 * cfg.d_model,
    "head_dim": _head_dim,
    # compressed attention (DeepSeek-V4) has one key/value head
    "n_kv_heads": lambda cfg: 1 if cfg.compression is not None else cfg.n_heads,
    "qkv_bias": lambda cfg: cfg.bias,
    "layer_types": _kinds,
}


@dataclass(frozen=True, repr=False)
class ModelConfig:
    """Hyper-parameters of a Transformer: the 2017 block by default, a 2026 one by
    choice.

    Shapes are named in the chapters as: V ``vocab_size``, d ``d_model``, L
    ``n_layers``, H ``n_heads``, H_kv ``n_kv_heads``, D ``head_dim``, d_ff ``d_ff``,
    S_max ``max_seq_len``.

    Placements (chapter 06): ``pre`` x + f(norm(x)); ``post`` norm(x + f(x)) (2017);
    ``sandwich`` x + norm(f(norm(x))) (Gemma); ``post_branch`` x + norm(f(x)) (Olmo
    2/3). ``qk_norm``: ``head`` normalises each head's q and k (Qwen3, Gemma 3),
    ``full`` the whole q and k projections (Olmo). ``layer_types`` gives each layer
    ``"full"`` or ``"sliding"`` attention; sliding layers see the last
    ``sliding_window`` keys (the query's own included) and use ``rope_local_theta`` when
    set (Gemma 3). ``nope_layers`` skip RoPE. With ``compression`` (DeepSeek-V4) the
    layers are ``"sliding"``, ``"csa"`` or ``"hca"`` compressed attention, every one
    with the window.
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
    # --- the modern dense block (chapters 05-09) ---
    n_kv_heads: int | None = None  # None: n_heads (MHA); 1: MQA; in between: GQA
    head_dim: int | None = None  # None: d_model // n_heads (MLA: qk_nope + qk_rope)
    ffn: str = "mlp"
    qkv_bias: bool | None = None  # None: same as `bias`
    norm_offset: float = 0.0  # 1.0: RMSNorm gain stored as 1 + w (Gemma)
    qk_norm: str = "none"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = (
        None  # linear, dynamic, yarn or llama3; None: plain
    )
    rope_local_theta: float | None = None
    partial_rotary_factor: float = 1.0
    rope_layout: str = "half"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = (
        None  # None: all "full" ("sliding" if a window is set)
    )
    nope_layers: tuple[int, ...] = ()
    attn_scale: float | None = None  # None: 1 / √head_dim
    # --- sinks and gates (chapter 12) ---
    attn_sinks: bool = (
        False  # a learned per-head logit in the softmax denominator (gpt-oss)
    )
    attn_output_gate: bool = False  # sigmoid gate on each head's output (Qwen3-Next)
    attn_gate_layout: str = (
        "interleaved"  # its logits from q's rows; "separate": Trinity
    )
    # --- mechanism groups (chapters 08, 10, 11): None leaves the mechanism out ---
    moe: MoEConfig | None = None  # routed experts in place of the dense FFN
    mla: MLAConfig | None = None  # multi-head latent attention on every attention layer
    linear: LinearAttentionConfig | None = None  # Gated DeltaNet on "linear" layers
    # DeepSeek-V4's sliding / CSA / HCA attention on every layer
    compression: CompressedAttentionConfig | None = None
    residual: HyperConnectionConfig | None = None  # hyper-connections: n streams
    _derived: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        validate(self, CHOICES)
        derived = [name for name in _DERIVED if getattr(self, name) is None]
        for name in derived:
            object.__setattr__(self, name, _DERIVED[name](self))
        if self.moe is not None and self.moe.expert_d_ff is None:
            # an expert as wide as the dense FFN unless set (Mixtral)
            object.__setattr__(self, "moe", self.moe.replace(expert_d_ff=self.d_ff))
            derived.append("moe.expert_d_ff")
        object.__setattr__(self, "_derived", frozenset(derived))
        validate_rope(self)

    def __repr__(self) -> str:
        """The fields that differ from the defaults (derived ones left out): a 2017
        config shows nothing from 2026."""
        shown = []
        for name, value in changed_fields(self):
            if name in self._derived:
                continue
            if name == "moe" and "moe.expert_d_ff" in self._derived:
                value = value.replace(expert_d_ff=None)
            shown.append(f"{name}={value!r}")
        return f"ModelConfig({', '.join(shown)})"

    @property
    def is_mla(self) -> bool:
        """True if attention is multi-head latent attention (``mla`` set)."""
        return self.mla is not None

    @property
    def rope_dim(self) -> int:
        """The channels per head that RoPE's tables are built for (under MLA, the RoPE
        part)."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """True if layer ``layer`` routes its FFN through experts."""
        return self.moe is not None and layer >= self.moe.dense_layers

    def is_hash_layer(self, layer: int) -> bool:
        """True if layer ``layer``'s experts come from a table by token id (the first
        ``moe.hash_layers`` MoE layers, DeepSeek-V4)."""
        return (
            self.is_moe_layer(layer)
            and layer < self.moe.dense_layers + self.moe.hash_layers
        )

    def replace(self, **changes: object) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        unknown = sorted(set(changes) - set(self.field_names()))
        if unknown:
            raise ConfigError(
                f"unknown config field(s) {unknown}; known: {self.field_names()}"
            )
        return ModelConfig(**{**self.settings(), **changes})

    def settings(self) -> dict[str, object]:
        """The fields as the user set them: a derived field (left None) is None again,
        so ``ModelConfig(**cfg.settings()) == cfg`` and a ``replace`` re-derives it."""
        out = {
            name: None if name in self._derived else getattr(self, name)
            for name in self.field_names()
        }
        if "moe.expert_d_ff" in self._derived:
            out["moe"] = self.moe.replace(expert_d_ff=None)
        return out

    @classmethod
    def field_names(cls) -> list[str]:
        """All field names, for error messages and docs."""
        return [f.name for f in fields(cls) if f.init]


"""The mechanism groups of a :class:`~companion.models.config.ModelConfig` (chapters
08, 10, 11, 13).

A 2017 config holds the dense block only; each later mechanism brings its fields as one
group, set as a whole or left None: ``moe`` (routed experts and their router, chapter
10), ``mla`` (multi-head latent attention, chapter 08), ``linear`` (the Gated DeltaNet
layers of a hybrid stack, chapter 11). A group checks its own fields when built; what
depends on the rest of the model (a MoE layer left in the stack, RoPE under MLA, a
"linear" layer in the pattern) is checked by the model config. Every error names the
field as ``group.field``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields

from companion.checks import check_int
from companion.layers.gated_deltanet import PROJECTIONS as LINEAR_PROJECTIONS
from companion.layers.gated_deltanet import RULES as LINEAR_RULES
from companion.layers.mla import FORMS as MLA_FORMS
from companion.layers.moe import EXPERT_KINDS
from companion.layers.router import SCORINGS, check_routing

__all__ = [
    "ConfigError",
    "ConfigPart",
    "LinearAttentionConfig",
    "MLAConfig",
    "MoEConfig",
    "changed_fields",
]


class ConfigError(ValueError):
    """A config field holds a value the model cannot be built from."""


def changed_fields(obj: object) -> list[tuple[str, object]]:
    """``(name, value)`` of each init field of a dataclass whose value differs from its
    default (a field without a default always counts), in declaration order."""
    out = []
    for f in fields(obj):
        if not f.init or not f.repr:
            continue
        value = getattr(obj, f.name)
        if f.default is dataclasses.MISSING or value != f.default:
            out.append((f.name, value))
    return out


def _check_bool(group: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{group}.{name} must be True or False, got {value!r}")


def _check_choice(group: str, name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{group}.{name} must be one of {allowed}, got {value!r}")


class ConfigPart:
    """What every group shares: ``replace`` and a repr of the fields that differ from
    their defaults."""

    GROUP = ""

    def replace(self, **changes: object) -> ConfigPart:
        """A copy with some fields changed (checked again)."""
        known = [f.name for f in fields(self) if f.init]
        unknown = sorted(set(changes) - set(known))
        if unknown:
            raise ConfigError(
                f"unknown {self.GROUP} field(s) {unknown}; known: {known}"
            )
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={v!r}" for n, v in changed_fields(self))
        return f"{type(self).__name__}({inner})"


@dataclass(frozen=True, repr=False)
class MoEConfig(ConfigPart):
    """Routed experts in place of the dense FFN (chapter 10).

    ``n_experts`` E experts per MoE layer, ``experts_per_token`` k of them per token,
    each of hidden width ``expert_d_ff`` (None: the model's ``d_ff``); the first
    ``dense_layers`` layers keep a dense FFN (DeepSeek-V3); ``shared_d_ff`` > 0 adds an
    always-on shared expert, ``shared_expert_gate`` a sigmoid gate on it (Qwen3-Next).
    The router scores with ``router`` ("softmax" or "sigmoid"), renormalises the k
    weights (``router_norm_topk``), searches the best ``router_topk_groups`` of
    ``router_groups`` groups (DeepSeek-V3), multiplies the weights by ``router_scale``,
    and may carry a learned bias (``router_bias``, gpt-oss) or a selection-only
    balancing bias (``router_selection_bias``, DeepSeek-V3). ``expert_kind`` "gpt_oss"
    is gpt-oss's biased clamped-SwiGLU expert.
    """

    GROUP = "moe"

    n_experts: int
    experts_per_token: int
    expert_d_ff: int | None = None
    expert_kind: str = "glu"
    dense_layers: int = 0
    shared_d_ff: int = 0
    shared_expert_gate: bool = False
    router: str = "softmax"
    router_norm_topk: bool = True
    router_groups: int = 1
    router_topk_groups: int = 1
    router_scale: float = 1.0
    router_bias: bool = False
    router_selection_bias: bool = False

    def __post_init__(self) -> None:
        g = self.GROUP
        check_int(f"{g}.n_experts", self.n_experts, 1, ConfigError)
        check_int(f"{g}.experts_per_token", self.experts_per_token, 1, ConfigError)
        for name in ("dense_layers", "shared_d_ff"):
            check_int(f"{g}.{name}", getattr(self, name), 0, ConfigError)
        if self.expert_d_ff is not None:
            check_int(f"{g}.expert_d_ff", self.expert_d_ff, 1, ConfigError)
        for name in ("router_groups", "router_topk_groups"):
            check_int(f"{g}.{name}", getattr(self, name), 1, ConfigError)
        for name in (
            "shared_expert_gate",
            "router_norm_topk",
            "router_bias",
            "router_selection_bias",
        ):
            _check_bool(g, name, getattr(self, name))
        _check_choice(g, "expert_kind", self.expert_kind, EXPERT_KINDS)
        _check_choice(g, "router", self.router, SCORINGS)
        s = self.router_scale
        if isinstance(s, bool) or not isinstance(s, (int, float)):
            raise ConfigError(
                f"{g}.router_scale must be a finite number > 0, got {s!r}"
            )
        if not (math.isfinite(s) and s > 0):
            raise ConfigError(
                f"{g}.router_scale must be a finite number > 0, got {s!r}"
            )
        check_routing(
            self.n_experts,
            self.experts_per_token,
            self.router_groups,
            self.router_topk_groups,
            names={
                "top_k": f"{g}.experts_per_token",
                "n_groups": f"{g}.router_groups",
                "topk_groups": f"{g}.router_topk_groups",
            },
            error=ConfigError,
        )
        if self.shared_expert_gate and self.shared_d_ff == 0:
            raise ConfigError(
                f"{g}.shared_expert_gate needs a shared expert: set {g}.shared_d_ff > 0"
            )


@dataclass(frozen=True, repr=False)
class MLAConfig(ConfigPart):
    """Multi-head latent attention (DeepSeek-V2/V3, chapter 08): keys and values through
    a latent of width ``kv_lora_rank``, queries direct or (``q_lora_rank`` > 0) through
    their own latent; per head ``qk_nope_head_dim`` channels without position plus one
    shared RoPE key of ``qk_rope_head_dim``, values of ``v_head_dim``. ``form``
    "absorbed" folds W_UK into the query and W_UV into the output (same model, cheaper
    decode)."""

    GROUP = "mla"

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0
    form: str = "naive"

    def __post_init__(self) -> None:
        g = self.GROUP
        for name in (
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        ):
            check_int(f"{g}.{name}", getattr(self, name), 1, ConfigError)
        check_int(f"{g}.q_lora_rank", self.q_lora_rank, 0, ConfigError)
        _check_choice(g, "form", self.form, MLA_FORMS)

    @property
    def qk_head_dim(self) -> int:
        """One head's query/key width in the naive form: nope + RoPE channels."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, repr=False)
class LinearAttentionConfig(ConfigPart):
    """The Gated DeltaNet of the config's ``"linear"`` layers (Qwen3-Next, chapter 11):
    ``key_heads`` query/key heads of width ``key_dim``, ``value_heads`` value heads (a
    multiple) of width ``value_dim``, a causal depthwise convolution of width
    ``conv_kernel``, and the state update ``rule`` ("gated_delta" as released; "delta"
    and "linear" for ablations). ``projections`` "grouped" fuses q, k, v, z and b, a
    per key head (Qwen3-Next's checkpoints); "split" keeps them apart (Qwen3.5)."""

    GROUP = "linear"

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int = 4
    rule: str = "gated_delta"
    projections: str = "grouped"

    def __post_init__(self) -> None:
        g = self.GROUP
        for name in ("key_heads", "value_heads", "key_dim", "value_dim", "conv_kernel"):
            check_int(f"{g}.{name}", getattr(self, name), 1, ConfigError)
        if self.value_heads % self.key_heads != 0:
            raise ConfigError(
                f"{g}.value_heads ({self.value_heads}) must be a multiple of "
                f"{g}.key_heads ({self.key_heads})"
            )
        _check_choice(g, "rule", self.rule, LINEAR_RULES)
        _check_choice(g, "projections", self.projections, LINEAR_PROJECTIONS)

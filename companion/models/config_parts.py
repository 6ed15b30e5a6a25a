"""The mechanism groups of a :class:`~companion.models.config.ModelConfig` (chapters
08, 10, 11, 13).

A 2017 config holds the dense block only; each later mechanism brings its fields as one
group, set as a whole or left None: ``moe`` (routed experts and their router, chapter
10), ``mla`` (multi-head latent attention, chapter 08; its ``indexer``, a
:class:`SparseConfig`, makes it DeepSeek Sparse Attention), ``linear`` (the Gated
DeltaNet or Kimi Delta Attention layers of a hybrid stack, chapter 11); DeepSeek-V4's
are in :mod:`companion.models.config_streams`. A group checks its own fields; what
depends on the rest of the model (a MoE layer left in the stack, RoPE under MLA, an
indexer per layer) is checked by the model config. Errors name ``group.field``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields

from companion.checks import check_int
from companion.layers.gated_deltanet import PROJECTIONS as LINEAR_PROJECTIONS
from companion.layers.gated_deltanet import RULES as LINEAR_RULES
from companion.layers.kimi_delta import KDA_LAYOUTS
from companion.layers.mla import FORMS as MLA_FORMS
from companion.layers.moe import EXPERT_KINDS
from companion.layers.router import SCORINGS, check_routing
from companion.ops.rope import LAYOUTS as ROPE_LAYOUTS

__all__ = [
    "ConfigError",
    "ConfigPart",
    "LinearAttentionConfig",
    "MLAConfig",
    "MoEConfig",
    "SparseConfig",
    "changed_fields",
]

# the recurrences a "linear" layer can run: Gated DeltaNet (one forget rate per head and
# token) or Kimi Delta Attention (one per key channel)
LINEAR_KINDS = ("gated_deltanet", "kda")
# where a sparse layer's indexer comes from: its own ("full") or the previous "full"
# layer's selection, reused (GLM-5's "shared")
INDEXER_KINDS = ("full", "shared")


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


def _check_finite(
    group: str, name: str, value: object, *, sign: int, optional: bool = False
) -> None:
    """A finite number with the sign of ``sign`` (> 0 or < 0), or None if
    ``optional``."""
    if optional and value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value * sign > 0)
    ):
        what = f"{'None or ' if optional else ''}a finite number {'>' if sign > 0 else '<'} 0"
        raise ConfigError(f"{group}.{name} must be {what}, got {value!r}")


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
    The router scores with ``router`` (softmax, sigmoid, √softplus), renormalises the k
    weights (``router_norm_topk``), searches the best ``router_topk_groups`` of
    ``router_groups`` groups (DeepSeek-V3), multiplies the weights by ``router_scale``,
    and may carry a learned bias (``router_bias``, gpt-oss) or a selection-only
    balancing bias (``router_selection_bias``, DeepSeek-V3). ``expert_kind`` "gpt_oss"
    is gpt-oss's biased clamped-SwiGLU expert; the first ``hash_layers`` MoE layers
    route by token id and ``swiglu_limit`` clamps gate and up (DeepSeek-V4)."""

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
    hash_layers: int = 0
    swiglu_limit: float | None = None

    def __post_init__(self) -> None:
        g = self.GROUP
        check_int(f"{g}.n_experts", self.n_experts, 1, ConfigError)
        check_int(f"{g}.experts_per_token", self.experts_per_token, 1, ConfigError)
        for name in ("dense_layers", "shared_d_ff", "hash_layers"):
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
        _check_finite(g, "router_scale", self.router_scale, sign=1)
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
class SparseConfig(ConfigPart):
    """DeepSeek Sparse Attention on MLA layers (DeepSeek-V3.2, GLM-5): a lightning
    indexer of ``n_heads`` heads of width ``head_dim`` scores every visible key and each
    query attends to the best ``topk``. The indexer reads MLA's query latent (so
    ``mla.q_lora_rank`` > 0) and rotates the first ``qk_rope_head_dim`` channels of its
    heads in ``rope_layout`` ("half": DeepSeek-V3.2, "interleaved": GLM-5). ``layers``
    gives each layer's indexer, "full" (its own) or "shared" (GLM-5: the selection of
    the last "full" layer before it, no weights); None: every layer "full". The model
    config checks ``layers`` and what the indexer needs of MLA."""

    GROUP = "mla.indexer"

    n_heads: int
    head_dim: int
    topk: int
    rope_layout: str = "half"
    layers: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        g = self.GROUP
        for name in ("n_heads", "head_dim", "topk"):
            check_int(f"{g}.{name}", getattr(self, name), 1, ConfigError)
        _check_choice(g, "rope_layout", self.rope_layout, ROPE_LAYOUTS)

    def kind(self, layer: int) -> str:
        """Layer ``layer``'s indexer: "full" or "shared"."""
        return "full" if self.layers is None else self.layers[layer]


@dataclass(frozen=True, repr=False)
class MLAConfig(ConfigPart):
    """Multi-head latent attention (DeepSeek-V2/V3, chapter 08): keys and values through
    a latent of width ``kv_lora_rank``, queries direct or (``q_lora_rank`` > 0) through
    their own latent; per head ``qk_nope_head_dim`` channels without position plus one
    shared RoPE key of ``qk_rope_head_dim``, values of ``v_head_dim``. ``form``
    "absorbed" folds W_UK into the query and W_UV into the output (same model, cheaper
    decode). ``latent_norm_eps`` is the eps of the RMSNorms on the latents (None: the
    model's ``norm_eps``; transformers' MLA keeps 1e-6 whatever ``rms_norm_eps`` is).
    ``output_gate`` multiplies each head's output by a sigmoid of a projection
    of x (Ling's Bailing hybrid); ``indexer`` (a :class:`SparseConfig`) makes the layers
    sparse."""

    GROUP = "mla"

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0
    form: str = "naive"
    latent_norm_eps: float | None = None
    output_gate: bool = False
    indexer: SparseConfig | None = None

    def __post_init__(self) -> None:
        g = self.GROUP
        _check_bool(g, "output_gate", self.output_gate)
        _check_finite(g, "latent_norm_eps", self.latent_norm_eps, sign=1, optional=True)
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
        """One head's query/key width in the naive form (nope + RoPE channels)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, repr=False)
class LinearAttentionConfig(ConfigPart):
    """The recurrence of the config's ``"linear"`` layers (chapter 11). ``kind``
    "gated_deltanet" is Qwen3-Next's Gated DeltaNet:
    ``key_heads`` query/key heads of width ``key_dim``, ``value_heads`` value heads (a
    multiple) of width ``value_dim``, a causal depthwise convolution of width
    ``conv_kernel``, and the state update ``rule`` ("gated_delta" as released; "delta"
    and "linear" for ablations). ``projections`` "grouped" fuses q, k, v, z and b, a
    per key head (Qwen3-Next's checkpoints); "split" keeps them apart (Qwen3.5).

    ``kind`` "kda" is Kimi Delta Attention (Kimi Linear, Ling's Bailing hybrid): one
    forget rate per key channel, as many value heads as key heads and values as wide as
    keys (``value_heads == key_heads``, ``value_dim == key_dim``); ``kda_layout`` places
    its gate parameters ("kimi": low rank, "bailing": full rank) and
    ``kda_gate_lower_bound`` (< 0, or None) bounds each log-decay to ``(bound, 0)``
    (Bailing's ``kda_safe_gate``)."""

    GROUP = "linear"

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int = 4
    rule: str = "gated_delta"
    projections: str = "grouped"
    kind: str = "gated_deltanet"
    kda_layout: str = "kimi"
    kda_gate_lower_bound: float | None = None

    def __post_init__(self) -> None:
        g = self.GROUP
        for name in ("key_heads", "value_heads", "key_dim", "value_dim", "conv_kernel"):
            check_int(f"{g}.{name}", getattr(self, name), 1, ConfigError)
        _check_choice(g, "kind", self.kind, LINEAR_KINDS)
        _check_choice(g, "kda_layout", self.kda_layout, KDA_LAYOUTS)
        if self.kind == "kda":
            self._check_kda()
        else:
            for name, default in (
                ("kda_layout", "kimi"),
                ("kda_gate_lower_bound", None),
            ):
                if getattr(self, name) != default:
                    raise ConfigError(
                        f"{g}.{name} has no effect unless {g}.kind == 'kda' (got kind="
                        f"{self.kind!r})"
                    )
        if self.value_heads % self.key_heads != 0:
            raise ConfigError(
                f"{g}.value_heads ({self.value_heads}) must be a multiple of "
                f"{g}.key_heads ({self.key_heads})"
            )
        _check_choice(g, "rule", self.rule, LINEAR_RULES)
        _check_choice(g, "projections", self.projections, LINEAR_PROJECTIONS)

    def _check_kda(self) -> None:
        g = self.GROUP
        for a, b in (("value_heads", "key_heads"), ("value_dim", "key_dim")):
            if getattr(self, a) != getattr(self, b):
                raise ConfigError(
                    f"{g}.kind='kda' needs {g}.{a} == {g}.{b}, got {getattr(self, a)} "
                    f"and {getattr(self, b)}"
                )
        for name, default in (("rule", "gated_delta"), ("projections", "grouped")):
            if getattr(self, name) != default:
                raise ConfigError(
                    f"{g}.{name} is a Gated DeltaNet option: leave it {default!r} with "
                    f"{g}.kind='kda' (got {getattr(self, name)!r})"
                )
        bound = self.kda_gate_lower_bound
        _check_finite(g, "kda_gate_lower_bound", bound, sign=-1, optional=True)

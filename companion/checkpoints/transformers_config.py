"""Read a Hugging Face transformers config as a ``companion`` config (chapters 05-13).

:func:`config_from_hf` maps ``hf_model.config`` to a
:class:`companion.models.config.ModelConfig`; the weights are
:mod:`companion.checkpoints.transformers`. Supported families: Llama (incl. Llama 3 RoPE
scaling), Mistral (sliding window), Qwen3 (QK-norm), Gemma 3 text (sandwich norms, (1+w)
gains, local/global layers with two RoPE bases), Olmo 3 (post-branch norms, full-width
QK-norm, sliding layers), Qwen3-MoE (experts), DeepSeek-V3 (latent attention,
group-limited sigmoid routing, a shared expert, dense first layers), gpt-oss (attention
sinks, biases, clamped-SwiGLU experts, 1:1 sliding layers) and Qwen3-Next (Gated
DeltaNet layers 3:1 with gated attention, experts with a gated shared expert), and the
families of :mod:`companion.checkpoints.hf_families` after them (Qwen3.5, Trinity,
SmolLM3, MiniMax-M2, Kimi Linear, Ling's Bailing hybrid, DeepSeek-V3.2, GLM-5,
DeepSeek-V4). Options
``companion`` cannot express are rejected with an error that names them, never silently
dropped.

This module and :mod:`companion.checkpoints.transformers` are the only ones that touch
transformers objects, and they import nothing from transformers itself: they read
``hf_model.config`` and ``hf_model.state_dict()``.
"""

from __future__ import annotations

from collections.abc import Mapping

from companion.checkpoints.hf_families import FAMILIES
from companion.checkpoints.hf_reader import REQUIRED, ConfigReader
from companion.models.config import ModelConfig
from companion.ops.rope import RopeScaling

__all__ = ["SUPPORTED", "architecture", "config_from_hf"]

# architecture -> norm placement of its blocks
SUPPORTED = {arch: family.placement for arch, family in FAMILIES.items()}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def architecture(hf_config: object) -> str:
    """The supported transformers architecture a config is for; a clear error if
    none."""
    archs = getattr(hf_config, "architectures", None) or []
    model_type = getattr(hf_config, "model_type", "")
    by_type = {family.model_type: arch for arch, family in FAMILIES.items()}
    for a in archs:
        if a in SUPPORTED:
            return a
    if model_type in by_type:
        return by_type[model_type]
    raise ValueError(
        f"unsupported model (architectures={archs}, model_type={model_type!r}); "
        f"supported: {sorted(SUPPORTED)}"
    )


def _rope(
    r: ConfigReader, params: Mapping, where: str
) -> tuple[float, RopeScaling | None]:
    params = dict(params)
    theta = float(r.entry(where, params, "rope_theta", "number"))
    params.pop("rope_theta", None)
    params.pop("partial_rotary_factor", None)  # a config field of its own
    # Qwen3.5's multimodal RoPE: text positions are equal on its three axes (plain RoPE)
    params.pop("mrope_section", None)
    params.pop("mrope_interleaved", None)
    trained = "original_max_position_embeddings"
    if params.get("rope_type") == "dynamic" and trained not in params:
        # transformers grows the base past max_position_embeddings: say so explicitly, so
        # a model built longer than the config (a larger max_seq_len) grows it there too
        params[trained] = r.integer("max_position_embeddings")
    return theta, r.make(RopeScaling.from_mapping, params)


def _rope_fields(
    r: ConfigReader, problems: list[str], uses_rope: bool
) -> tuple[float, RopeScaling | None, float | None]:
    """The RoPE base and scaling of the (global) layers and the base of sliding ones;
    ``rope_parameters`` may be absent only where no layer rotates (Kimi Linear)."""
    default = REQUIRED if uses_rope else {"rope_theta": 10000.0}
    rope, where = r.mapping("rope_parameters", default), "rope_parameters"
    local_theta = None
    if "main" in rope:  # DeepSeek-V4: "main" here, "compress" read by its family
        rope, where = r.entry(where, rope, "main", "mapping"), f"{where}['main']"
    if "full_attention" in rope:  # per-layer-type RoPE (Gemma 3, Olmo 3)
        full = r.entry(where, rope, "full_attention", "mapping")
        local = rope.get("sliding_attention", full)
        if not isinstance(local, Mapping):
            local = r.entry(where, rope, "sliding_attention", "mapping")
        local_theta, local_scaling = _rope(r, local, f"{where}['sliding_attention']")
        rope, where = full, f"{where}['full_attention']"
        if local_scaling is not None:
            problems.append(
                f"RoPE scaling on sliding layers ({local_scaling.rope_type!r})"
            )
    theta, scaling = _rope(r, rope, where)
    return theta, scaling, local_theta


def config_from_hf(hf_config: object) -> ModelConfig:
    """The :class:`~companion.models.config.ModelConfig` of a transformers config (or an
    error naming every missing, mistyped or unsupported field)."""
    arch = architecture(hf_config)
    r = ConfigReader(hf_config)
    problems = []
    for name, ok in (
        ("attention_bias", lambda v: not v or arch == "GptOssForCausalLM"),
        ("mlp_bias", lambda v: not v),
        ("pretraining_tp", lambda v: v == 1),
        ("final_logit_softcapping", lambda v: v is None),
        ("attn_logit_softcapping", lambda v: v is None),
        ("use_bidirectional_attention", lambda v: not v),
    ):
        if r.has(name) and not ok(r.get(name)):
            problems.append(f"{name}={r.get(name)!r}")
    act = r.get("hidden_activation") or r.get("hidden_act")
    if not isinstance(act, str) or act not in _ACTIVATIONS:
        problems.append(f"activation {act!r} (supported: {sorted(_ACTIVATIONS)})")
    n_layers, n_heads = r.integer("num_hidden_layers"), r.integer("num_attention_heads")
    d_model = r.integer("hidden_size")
    try:
        family = FAMILIES[arch].fields(r, problems)
    except (ValueError, TypeError, ArithmeticError):
        # a stand-in for a bad field can make a family's own config invalid: the bad
        # field is the error to report
        if not r.problems:
            raise
        family = {}
    theta, scaling, local_theta = _rope_fields(r, problems, FAMILIES[arch].rope)
    layer_types = r.sequence("layer_types", None, of="text")
    window = r.integer("sliding_window", None)
    fields = dict(
        vocab_size=r.integer("vocab_size"),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=r.integer("num_key_value_heads", None) or n_heads,
        head_dim=r.integer("head_dim", None) or d_model // max(n_heads, 1),
        d_ff=r.integer("intermediate_size", None),
        max_seq_len=r.integer("max_position_embeddings"),
        norm_eps=r.number("rms_norm_eps"),
    )
    r.raise_problems(arch)
    if problems:
        raise ValueError(f"{arch}: companion does not support {', '.join(problems)}")

    if arch == "MistralForCausalLM":
        layer_types = ["sliding_attention" if window else "full_attention"] * n_layers
    kind_of = {"sliding_attention": "sliding", "linear_attention": "linear"}
    kinds = tuple(kind_of.get(t, "full") for t in layer_types or [])
    if layer_types is None:
        kinds = ("full",) * n_layers
    fields |= dict(
        norm="rmsnorm",
        norm_placement=SUPPORTED[arch],
        activation=_ACTIVATIONS[act],
        ffn="glu",
        position="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        # sliding layers keep their own base, and stay unscaled when the global ones scale
        rope_local_theta=(
            local_theta
            if local_theta is not None and (local_theta != theta or scaling is not None)
            else None
        ),
        sliding_window=window if "sliding" in kinds else None,
        layer_types=kinds,
        bias=False,
        tie_embeddings=bool(r.get("tie_word_embeddings", False)),
        attn_impl="sdpa",
    )
    return ModelConfig(**(fields | family))

"""Read a Hugging Face transformers config as a ``companion`` config (chapters 05-13).

:func:`config_from_hf` maps ``hf_model.config`` to a
:class:`companion.models.config.ModelConfig`; the weights are
:mod:`companion.checkpoints.transformers`. Supported families: Llama (incl. Llama 3 RoPE
scaling), Mistral (sliding window), Qwen3 (QK-norm), Gemma 3 text (sandwich norms, (1+w)
gains, local/global layers with two RoPE bases), Olmo 3 (post-branch norms, full-width
QK-norm, sliding layers), Qwen3-MoE (experts), DeepSeek-V3 (latent attention,
group-limited sigmoid routing, a shared expert, dense first layers), gpt-oss (attention
sinks, biases, clamped-SwiGLU experts, 1:1 sliding layers) and Qwen3-Next (Gated
DeltaNet layers 3:1 with gated attention, experts with a gated shared expert). Options
``companion`` cannot express are rejected with an error that names them, never silently
dropped.

This module and :mod:`companion.checkpoints.transformers` are the only ones that touch
transformers objects, and they import nothing from transformers itself: they read
``hf_model.config`` and ``hf_model.state_dict()``.
"""

from __future__ import annotations

from collections.abc import Mapping

from companion.models.config import (
    LinearAttentionConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
)
from companion.ops.rope import RopeScaling

__all__ = ["SUPPORTED", "architecture", "config_from_hf"]

# architecture -> norm placement of its blocks
SUPPORTED = {
    "LlamaForCausalLM": "pre",
    "MistralForCausalLM": "pre",
    "Qwen3ForCausalLM": "pre",
    "Gemma3ForCausalLM": "sandwich",
    "Olmo3ForCausalLM": "post_branch",
    "Qwen3MoeForCausalLM": "pre",
    "DeepseekV3ForCausalLM": "pre",
    "GptOssForCausalLM": "pre",
    "Qwen3NextForCausalLM": "pre",
}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def architecture(hf_config: object) -> str:
    """The supported transformers architecture a config is for; a clear error if
    none."""
    archs = getattr(hf_config, "architectures", None) or []
    model_type = getattr(hf_config, "model_type", "")
    by_type = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "gemma3_text": "Gemma3ForCausalLM",
        "olmo3": "Olmo3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "deepseek_v3": "DeepseekV3ForCausalLM",
        "gpt_oss": "GptOssForCausalLM",
        "qwen3_next": "Qwen3NextForCausalLM",
    }
    for a in archs:
        if a in SUPPORTED:
            return a
    if model_type in by_type:
        return by_type[model_type]
    raise ValueError(
        f"unsupported model (architectures={archs}, model_type={model_type!r}); "
        f"supported: {sorted(SUPPORTED)}"
    )


def _rope(params: Mapping) -> tuple[float, RopeScaling | None]:
    params = dict(params)
    theta = float(params.pop("rope_theta"))
    params.pop("partial_rotary_factor", None)  # a config field of its own
    return theta, RopeScaling.from_mapping(params)


def _sparse_layers_ok(c: object) -> bool:
    """Qwen's MoE families: True if every layer is sparse (the only layout
    supported)."""
    return getattr(c, "decoder_sparse_step", 1) == 1 and not getattr(
        c, "mlp_only_layers", []
    )


def _family_fields(arch: str, c: object, problems: list[str]) -> dict[str, object]:
    """The config fields beyond the dense block: experts, MLA, sinks, gates,
    DeltaNet."""
    if arch in ("Qwen3MoeForCausalLM", "Qwen3NextForCausalLM"):
        if not _sparse_layers_ok(c):
            problems.append(
                f"decoder_sparse_step={c.decoder_sparse_step!r} / "
                f"mlp_only_layers={c.mlp_only_layers!r} (only all-sparse layers)"
            )
        moe = dict(
            n_experts=c.num_experts,
            experts_per_token=c.num_experts_per_tok,
            expert_d_ff=c.moe_intermediate_size,
            router_norm_topk=bool(c.norm_topk_prob),
        )
        if arch == "Qwen3MoeForCausalLM":
            return {"moe": MoEConfig(**moe)}
        moe |= dict(
            shared_d_ff=c.shared_expert_intermediate_size, shared_expert_gate=True
        )
        return {
            "moe": MoEConfig(**moe),
            "attn_output_gate": True,
            "norm_offset": 1.0,
            "partial_rotary_factor": float(
                c.rope_parameters.get("partial_rotary_factor", 1.0)
            ),
            "linear": LinearAttentionConfig(
                key_heads=c.linear_num_key_heads,
                value_heads=c.linear_num_value_heads,
                key_dim=c.linear_key_head_dim,
                value_dim=c.linear_value_head_dim,
                conv_kernel=c.linear_conv_kernel_dim,
            ),
        }
    if arch == "DeepseekV3ForCausalLM":
        return {
            "moe": MoEConfig(
                n_experts=c.n_routed_experts,
                experts_per_token=c.num_experts_per_tok,
                expert_d_ff=c.moe_intermediate_size,
                dense_layers=c.first_k_dense_replace,
                shared_d_ff=c.moe_intermediate_size * c.n_shared_experts,
                router="sigmoid",
                router_norm_topk=bool(c.norm_topk_prob),
                router_groups=c.n_group,
                router_topk_groups=c.topk_group,
                router_scale=float(c.routed_scaling_factor),
                router_selection_bias=True,
            ),
            "mla": MLAConfig(
                kv_lora_rank=c.kv_lora_rank,
                q_lora_rank=c.q_lora_rank or 0,
                qk_nope_head_dim=c.qk_nope_head_dim,
                qk_rope_head_dim=c.qk_rope_head_dim,
                v_head_dim=c.v_head_dim,
            ),
            "rope_layout": "interleaved"
            if getattr(c, "rope_interleave", True)
            else "half",
        }
    if arch == "GptOssForCausalLM":
        return {
            "moe": MoEConfig(
                n_experts=c.num_local_experts,
                experts_per_token=c.num_experts_per_tok,
                expert_d_ff=c.intermediate_size,
                expert_kind="gpt_oss",
                router_bias=True,
            ),
            "attn_sinks": True,
            "bias": bool(c.attention_bias),
        }
    return {}


def config_from_hf(hf_config: object) -> ModelConfig:
    """The :class:`~companion.models.config.ModelConfig` of a transformers config (or an
    error)."""
    arch = architecture(hf_config)
    c = hf_config
    problems = []
    for name, ok in (
        ("attention_bias", lambda v: not v or arch == "GptOssForCausalLM"),
        ("mlp_bias", lambda v: not v),
        ("pretraining_tp", lambda v: v == 1),
        ("final_logit_softcapping", lambda v: v is None),
        ("attn_logit_softcapping", lambda v: v is None),
        ("use_bidirectional_attention", lambda v: not v),
    ):
        if hasattr(c, name) and not ok(getattr(c, name)):
            problems.append(f"{name}={getattr(c, name)!r}")
    act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", None)
    if act not in _ACTIVATIONS:
        problems.append(f"activation {act!r} (supported: {sorted(_ACTIVATIONS)})")
    rope = dict(c.rope_parameters)
    local_theta = None
    if "full_attention" in rope:  # per-layer-type RoPE (Gemma 3, Olmo 3)
        local = dict(rope.get("sliding_attention", rope["full_attention"]))
        rope = dict(rope["full_attention"])
        local_theta, local_scaling = _rope(local)
        if local_scaling is not None:
            problems.append(
                f"RoPE scaling on sliding layers ({local_scaling.rope_type!r})"
            )
    theta, scaling = _rope(rope)
    if arch == "GptOssForCausalLM" and (c.swiglu_limit, c.swiglu_alpha) != (7.0, 1.702):
        problems.append(
            f"swiglu_limit/alpha={c.swiglu_limit}/{c.swiglu_alpha} (only 7.0/1.702)"
        )
    family = _family_fields(arch, c, problems)
    if problems:
        raise ValueError(f"{arch}: companion does not support {', '.join(problems)}")

    layer_types = getattr(c, "layer_types", None)
    window = getattr(c, "sliding_window", None)
    if arch == "MistralForCausalLM":
        layer_types = [
            "sliding_attention" if window else "full_attention"
        ] * c.num_hidden_layers
    kind_of = {"sliding_attention": "sliding", "linear_attention": "linear"}
    kinds = tuple(kind_of.get(t, "full") for t in layer_types or [])
    if layer_types is None:
        kinds = ("full",) * c.num_hidden_layers
    placement = SUPPORTED[arch]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if arch == "DeepseekV3ForCausalLM":
        head_dim = None  # MLA: qk_nope_head_dim + qk_rope_head_dim (HF's head_dim is the rope part)
    fields = dict(
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads,
        head_dim=head_dim,
        d_ff=c.intermediate_size,
        max_seq_len=c.max_position_embeddings,
        norm="rmsnorm",
        norm_eps=c.rms_norm_eps,
        norm_offset=1.0 if arch == "Gemma3ForCausalLM" else 0.0,
        norm_placement=placement,
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
        qk_norm={
            "Qwen3ForCausalLM": "head",
            "Qwen3MoeForCausalLM": "head",
            "Qwen3NextForCausalLM": "head",
            "Gemma3ForCausalLM": "head",
            "Olmo3ForCausalLM": "full",
        }.get(arch, "none"),
        sliding_window=window if "sliding" in kinds else None,
        layer_types=kinds,
        attn_scale=(
            c.query_pre_attn_scalar**-0.5 if arch == "Gemma3ForCausalLM" else None
        ),
        scale_embeddings=arch == "Gemma3ForCausalLM",
        bias=False,
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        attn_impl="sdpa",
    )
    return ModelConfig(**(fields | family))

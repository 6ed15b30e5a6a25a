"""What each supported transformers family adds to the dense block (chapters 05-13).

:func:`companion.checkpoints.transformers_config.config_from_hf` reads the fields every
family shares (widths, heads, RoPE, layer pattern); the ``FAMILIES`` entry of the
architecture gives its ``model_type``, its norm placement and a function that returns
the config fields beyond them (experts, MLA, gates, DeltaNet, NoPE layers, ...),
overriding the shared ones where the family differs (the DeepSeek-style families, MLA
and what composes onto it, are in :mod:`companion.checkpoints.hf_latent_families`,
DeepSeek-V4 in :mod:`companion.checkpoints.hf_v4`). A
family function appends to
``problems`` what ``companion`` cannot express; the caller raises them together.

Like the rest of :mod:`companion.checkpoints`, nothing here imports transformers: the
functions read attributes of ``hf_model.config``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from companion.checkpoints.hf_latent_families import LATENT_FAMILIES as LATENT
from companion.checkpoints.hf_reader import ConfigReader
from companion.checkpoints.hf_v4 import deepseek_v4
from companion.models.config_parts import LinearAttentionConfig, MoEConfig

__all__ = ["FAMILIES", "Family"]

Fields = dict[str, object]


class Family(NamedTuple):
    """One transformers architecture: its ``model_type``, the norm placement of its
    blocks, its own config fields (read through a
    :class:`~companion.checkpoints.hf_reader.ConfigReader`) and whether its layers
    rotate (without RoPE, ``rope_parameters`` may be absent)."""

    model_type: str
    placement: str
    fields: Callable[[ConfigReader, list[str]], dict[str, object]]
    rope: bool = True


def _none(c: ConfigReader, problems: list[str]) -> Fields:
    return {}


def _qk_head(c: ConfigReader, problems: list[str]) -> Fields:
    return {"qk_norm": "head"}


def _gemma3(c: ConfigReader, problems: list[str]) -> Fields:
    scalar = c.number("query_pre_attn_scalar")
    if scalar <= 0:
        problems.append(f"query_pre_attn_scalar={scalar!r} (must be > 0)")
    return {
        "qk_norm": "head",
        "norm_offset": 1.0,
        "attn_scale": scalar**-0.5 if scalar > 0 else 1.0,
        "scale_embeddings": True,
    }


def _sparse_layers(c: ConfigReader, problems: list[str]) -> None:
    """Qwen's MoE families: every layer must be sparse (the only layout supported)."""
    step, dense = (
        c.integer("decoder_sparse_step", 1),
        c.sequence("mlp_only_layers", []),
    )
    if step != 1 or dense:
        problems.append(
            f"decoder_sparse_step={step!r} / mlp_only_layers={dense!r} (only all-sparse "
            "layers)"
        )


def _qwen_moe(c: ConfigReader, **more: object) -> MoEConfig | None:
    return c.make(
        MoEConfig,
        n_experts=c.integer("num_experts"),
        experts_per_token=c.integer("num_experts_per_tok"),
        expert_d_ff=c.integer("moe_intermediate_size"),
        router_norm_topk=c.flag("norm_topk_prob", True),
        **more,
    )


def _qwen3_moe(c: ConfigReader, problems: list[str]) -> Fields:
    _sparse_layers(c, problems)
    return {"qk_norm": "head", "moe": _qwen_moe(c)}


def _gated_deltanet(c: ConfigReader, projections: str) -> LinearAttentionConfig | None:
    return c.make(
        LinearAttentionConfig,
        key_heads=c.integer("linear_num_key_heads"),
        value_heads=c.integer("linear_num_value_heads"),
        key_dim=c.integer("linear_key_head_dim"),
        value_dim=c.integer("linear_value_head_dim"),
        conv_kernel=c.integer("linear_conv_kernel_dim"),
        projections=projections,
    )


def _partial_rotary(c: ConfigReader) -> float:
    """The fraction of each head RoPE rotates (``rope_parameters``, 1 if unsaid)."""
    rope = c.mapping("rope_parameters")
    return float(c.entry("rope_parameters", rope, "partial_rotary_factor", "number", 1))


def _qwen_hybrid(c: ConfigReader, projections: str) -> Fields:
    """Qwen3-Next and Qwen3.5: Gated DeltaNet layers, gated attention, (1 + w) norms."""
    return {
        "qk_norm": "head",
        "attn_output_gate": True,
        "norm_offset": 1.0,
        "partial_rotary_factor": _partial_rotary(c),
        "linear": _gated_deltanet(c, projections),
    }


def _gated_shared(c: ConfigReader) -> Fields:
    return {
        "shared_d_ff": c.integer("shared_expert_intermediate_size"),
        "shared_expert_gate": True,
    }


def _qwen3_next(c: ConfigReader, problems: list[str]) -> Fields:
    _sparse_layers(c, problems)
    return _qwen_hybrid(c, "grouped") | {"moe": _qwen_moe(c, **_gated_shared(c))}


def _qwen3_5(c: ConfigReader, problems: list[str]) -> Fields:
    return _qwen_hybrid(c, "split")


def _qwen3_5_moe(c: ConfigReader, problems: list[str]) -> Fields:
    # no dense FFN anywhere: the config has no intermediate_size
    moe = _qwen_moe(c, **_gated_shared(c))
    return _qwen_hybrid(c, "split") | {"moe": moe, "d_ff": moe and moe.expert_d_ff}


def _gpt_oss(c: ConfigReader, problems: list[str]) -> Fields:
    limit, alpha = c.number("swiglu_limit"), c.number("swiglu_alpha")
    if (limit, alpha) != (7.0, 1.702):
        problems.append(f"swiglu_limit/alpha={limit}/{alpha} (only 7.0/1.702)")
    return {
        "moe": c.make(
            MoEConfig,
            n_experts=c.integer("num_local_experts"),
            experts_per_token=c.integer("num_experts_per_tok"),
            expert_d_ff=c.integer("intermediate_size"),
            expert_kind="gpt_oss",
            router_bias=True,
        ),
        "attn_sinks": True,
        "bias": c.flag("attention_bias"),
    }


def _afmoe(c: ConfigReader, problems: list[str]) -> Fields:
    """Trinity: RoPE on the sliding layers only, a gate of its own, sigmoid routing."""
    types = c.sequence("layer_types")
    full = tuple(i for i, t in enumerate(types) if t == "full_attention")
    expert_d_ff = c.integer("moe_intermediate_size")
    return {
        "qk_norm": "head",
        "attn_output_gate": True,
        "attn_gate_layout": "separate",
        "nope_layers": full,
        "scale_embeddings": c.flag("mup_enabled", False),
        "moe": c.make(
            MoEConfig,
            n_experts=c.integer("num_experts"),
            experts_per_token=c.integer("num_experts_per_tok"),
            expert_d_ff=expert_d_ff,
            dense_layers=c.integer("num_dense_layers"),
            shared_d_ff=expert_d_ff * c.integer("num_shared_experts"),
            router="sigmoid",
            router_scale=float(c.number("route_scale")),
            router_selection_bias=True,
        ),
    }


def _smollm3(c: ConfigReader, problems: list[str]) -> Fields:
    """SmolLM3: RoPE skipped where ``no_rope_layers`` holds 0."""
    flags = c.sequence("no_rope_layers")[: c.integer("num_hidden_layers")]
    return {"nope_layers": tuple(i for i, r in enumerate(flags) if not r)}


def _minimax_m2(c: ConfigReader, problems: list[str]) -> Fields:
    """MiniMax-M2: full attention with QK-norm over the whole projections, every FFN
    routed (sigmoid, selection bias), the expert width in ``intermediate_size``."""
    return {
        "qk_norm": "full",
        "partial_rotary_factor": _partial_rotary(c),
        "moe": c.make(
            MoEConfig,
            n_experts=c.integer("num_local_experts"),
            experts_per_token=c.integer("num_experts_per_tok"),
            expert_d_ff=c.integer("intermediate_size"),
            router="sigmoid",
            router_selection_bias=True,
        ),
    }


# architecture -> (model_type, norm placement, its fields)
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", "pre", _none),
    "MistralForCausalLM": Family("mistral", "pre", _none),
    "Qwen3ForCausalLM": Family("qwen3", "pre", _qk_head),
    "Gemma3ForCausalLM": Family("gemma3_text", "sandwich", _gemma3),
    "Olmo3ForCausalLM": Family(
        "olmo3", "post_branch", lambda c, p: {"qk_norm": "full"}
    ),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", "pre", _qwen3_moe),
    "DeepseekV3ForCausalLM": Family("deepseek_v3", "pre", LATENT["deepseek_v3"]),
    "GptOssForCausalLM": Family("gpt_oss", "pre", _gpt_oss),
    "Qwen3NextForCausalLM": Family("qwen3_next", "pre", _qwen3_next),
    "Qwen3_5ForCausalLM": Family("qwen3_5_text", "pre", _qwen3_5),
    "Qwen3_5MoeForCausalLM": Family("qwen3_5_moe_text", "pre", _qwen3_5_moe),
    "AfmoeForCausalLM": Family("afmoe", "sandwich", _afmoe),
    "SmolLM3ForCausalLM": Family("smollm3", "pre", _smollm3),
    "MiniMaxM2ForCausalLM": Family("minimax_m2", "pre", _minimax_m2),
    "KimiLinearForCausalLM": Family(
        "kimi_linear", "pre", LATENT["kimi_linear"], rope=False
    ),
    "BailingHybridForCausalLM": Family(
        "bailing_hybrid", "pre", LATENT["bailing_hybrid"]
    ),
    "DeepseekV32ForCausalLM": Family("deepseek_v32", "pre", LATENT["deepseek_v32"]),
    "GlmMoeDsaForCausalLM": Family("glm_moe_dsa", "pre", LATENT["glm_moe_dsa"]),
    "DeepseekV4ForCausalLM": Family("deepseek_v4", "pre", deepseek_v4),
}

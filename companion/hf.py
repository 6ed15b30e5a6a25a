"""Convert Hugging Face transformers models into ``companion`` models (chapters 05-13).

``from_hf(hf_model)`` reads the config and the weights of a transformers causal LM and
returns the equivalent :class:`companion.model.DecoderLM`, with the same logits. Supported
families: Llama (incl. Llama 3 RoPE scaling), Mistral (sliding window), Qwen3 (QK-norm),
Gemma 3 text (sandwich norms, (1+w) gains, local/global layers with two RoPE bases),
Olmo 3 (post-branch norms, full-width QK-norm, sliding layers), Qwen3-MoE (experts),
DeepSeek-V3 (latent attention, group-limited sigmoid routing, a shared expert, dense first
layers), gpt-oss (attention sinks, biases, clamped-SwiGLU experts, 1:1 sliding layers) and
Qwen3-Next (Gated DeltaNet layers 3:1 with gated attention, experts with a gated shared
expert). Options ``companion`` cannot express are rejected with an error that names them,
never silently dropped.

This is the only module that touches transformers objects, and it imports nothing from
transformers itself: it reads ``hf_model.config`` and ``hf_model.state_dict()``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from .config import ModelConfig
from .model import DecoderLM

__all__ = ["SUPPORTED", "config_from_hf", "convert_state_dict", "from_hf", "load_state_dict_strict"]

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
# HF block norm name -> ours, per placement
_NORM_NAMES = {
    "pre": {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"},
    "sandwich": {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "attn_out_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "ffn_out_norm",
    },
    "post_branch": {
        "post_attention_layernorm": "attn_out_norm",
        "post_feedforward_layernorm": "ffn_out_norm",
    },
}


def _arch(hf_config: object) -> str:
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


def _rope(params: Mapping) -> tuple[float, dict | None]:
    params = dict(params)
    theta = float(params.pop("rope_theta"))
    params.pop("partial_rotary_factor", None)  # a config field of its own
    kind = params.get("rope_type", "default")
    return theta, (None if kind == "default" else params)


def _sparse_layers_ok(c: object) -> bool:
    """Qwen's MoE families: True if every layer is sparse (the only layout supported)."""
    return getattr(c, "decoder_sparse_step", 1) == 1 and not getattr(c, "mlp_only_layers", [])


def _family_fields(arch: str, c: object, problems: list[str]) -> dict[str, object]:
    """The config fields beyond the dense block: experts, MLA, sinks, gates, DeltaNet."""
    if arch in ("Qwen3MoeForCausalLM", "Qwen3NextForCausalLM"):
        if not _sparse_layers_ok(c):
            problems.append(
                f"decoder_sparse_step={c.decoder_sparse_step!r} / "
                f"mlp_only_layers={c.mlp_only_layers!r} (only all-sparse layers)"
            )
        out: dict[str, object] = {
            "n_experts": c.num_experts,
            "experts_per_token": c.num_experts_per_tok,
            "expert_d_ff": c.moe_intermediate_size,
            "router_norm_topk": bool(c.norm_topk_prob),
        }
        if arch == "Qwen3NextForCausalLM":
            out |= {
                "shared_d_ff": c.shared_expert_intermediate_size,
                "shared_expert_gate": True,
                "attn_output_gate": True,
                "norm_offset": 1.0,
                "partial_rotary_factor": float(c.rope_parameters.get("partial_rotary_factor", 1.0)),
                "linear_key_heads": c.linear_num_key_heads,
                "linear_value_heads": c.linear_num_value_heads,
                "linear_key_dim": c.linear_key_head_dim,
                "linear_value_dim": c.linear_value_head_dim,
                "linear_conv_kernel": c.linear_conv_kernel_dim,
            }
        return out
    if arch == "DeepseekV3ForCausalLM":
        return {
            "n_experts": c.n_routed_experts,
            "experts_per_token": c.num_experts_per_tok,
            "expert_d_ff": c.moe_intermediate_size,
            "dense_layers": c.first_k_dense_replace,
            "shared_d_ff": c.moe_intermediate_size * c.n_shared_experts,
            "router": "sigmoid",
            "router_norm_topk": bool(c.norm_topk_prob),
            "router_groups": c.n_group,
            "router_topk_groups": c.topk_group,
            "router_scale": float(c.routed_scaling_factor),
            "router_selection_bias": True,
            "kv_lora_rank": c.kv_lora_rank,
            "q_lora_rank": c.q_lora_rank or 0,
            "qk_nope_head_dim": c.qk_nope_head_dim,
            "qk_rope_head_dim": c.qk_rope_head_dim,
            "v_head_dim": c.v_head_dim,
            "rope_layout": "interleaved" if getattr(c, "rope_interleave", True) else "half",
        }
    if arch == "GptOssForCausalLM":
        return {
            "n_experts": c.num_local_experts,
            "experts_per_token": c.num_experts_per_tok,
            "expert_d_ff": c.intermediate_size,
            "expert_kind": "gpt_oss",
            "router_bias": True,
            "attn_sinks": True,
            "bias": bool(c.attention_bias),
        }
    return {}


def config_from_hf(hf_config: object) -> ModelConfig:
    """The :class:`~companion.config.ModelConfig` of a transformers config (or an error)."""
    arch = _arch(hf_config)
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
            problems.append(f"RoPE scaling on sliding layers ({local_scaling['rope_type']!r})")
    theta, scaling = _rope(rope)
    if arch == "GptOssForCausalLM" and (c.swiglu_limit, c.swiglu_alpha) != (7.0, 1.702):
        problems.append(f"swiglu_limit/alpha={c.swiglu_limit}/{c.swiglu_alpha} (only 7.0/1.702)")
    family = _family_fields(arch, c, problems)
    if problems:
        raise ValueError(f"{arch}: companion does not support {', '.join(problems)}")

    layer_types = getattr(c, "layer_types", None)
    window = getattr(c, "sliding_window", None)
    if arch == "MistralForCausalLM":
        layer_types = ["sliding_attention" if window else "full_attention"] * c.num_hidden_layers
    kind_of = {"sliding_attention": "sliding", "linear_attention": "linear"}
    kinds = tuple(kind_of.get(t, "full") for t in layer_types or [])
    if layer_types is None:
        kinds = ("full",) * c.num_hidden_layers
    placement = SUPPORTED[arch]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if arch == "DeepseekV3ForCausalLM":
        head_dim = c.qk_rope_head_dim  # MLA: head_size only sizes the RoPE tables
    fields = dict(
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads,
        head_size=head_dim,
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
        attn_scale=(c.query_pre_attn_scalar**-0.5 if arch == "Gemma3ForCausalLM" else None),
        scale_embeddings=arch == "Gemma3ForCausalLM",
        bias=False,
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        attn_impl="sdpa",
    )
    return ModelConfig(**(fields | family))


_MLA_NAMES = {
    "self_attn.q_proj": "attn.q_proj",
    "self_attn.q_a_proj": "attn.q_a_proj",
    "self_attn.q_a_layernorm": "attn.q_a_norm",
    "self_attn.q_b_proj": "attn.q_b_proj",
    "self_attn.kv_a_proj_with_mqa": "attn.kv_a_proj",
    "self_attn.kv_a_layernorm": "attn.kv_a_norm",
    "self_attn.kv_b_proj": "attn.kv_b_proj",
}
_DENSE_FFN = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_MOE_NAMES = {
    "mlp.gate.weight": "ffn.router.weight",  # Qwen3-MoE, DeepSeek-V3, Qwen3-Next
    "mlp.gate.e_score_correction_bias": "ffn.router.selection_bias",
    "mlp.router.weight": "ffn.router.weight",  # gpt-oss
    "mlp.router.bias": "ffn.router.bias",
    "mlp.experts.gate_up_proj": "ffn.experts.gate_up",
    "mlp.experts.down_proj": "ffn.experts.down",
    "mlp.experts.gate_up_proj_bias": "ffn.experts.gate_up_bias",
    "mlp.experts.down_proj_bias": "ffn.experts.down_bias",
    "mlp.shared_expert_gate.weight": "ffn.shared_gate.weight",
}
# gpt-oss stores each expert's matrices as (in, out); ours are (out, in) like nn.Linear
_TRANSPOSED = {"GptOssForCausalLM": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")}


def _layer_key(rest: str, cfg: ModelConfig) -> str | None:
    """Our name (inside ``blocks.i``) of one HF layer tensor, or None if no rule maps it.
    Separate q, k and v projections are fused later, in :func:`convert_state_dict`."""
    mod, leaf = rest.rsplit(".", 1)  # e.g. "self_attn.o_proj", "weight"
    if cfg.is_mla and mod in _MLA_NAMES:
        return f"{_MLA_NAMES[mod]}.{leaf}"
    if mod == "self_attn.o_proj":
        return f"attn.out_proj.{leaf}"
    if mod in ("self_attn.q_norm", "self_attn.k_norm"):
        return f"attn.{mod.split('.')[1]}.{leaf}"
    if rest == "self_attn.sinks":
        return "attn.sinks"
    if rest.startswith("linear_attn."):  # Gated DeltaNet: the same names, one level up
        return "attn." + rest.removeprefix("linear_attn.")
    if cfg.n_experts and rest in _MOE_NAMES:
        return _MOE_NAMES[rest]
    if mod.startswith("mlp.") and mod.count(".") == 1 and mod[4:] in _DENSE_FFN:
        return f"ffn.{_DENSE_FFN[mod[4:]]}.{leaf}"
    shared, _, proj = mod.rpartition(".")
    if shared in ("mlp.shared_experts", "mlp.shared_expert") and proj in _DENSE_FFN:
        return f"ffn.shared.{_DENSE_FFN[proj]}.{leaf}"
    norm_names = _NORM_NAMES[cfg.norm_placement]
    if mod in norm_names:
        return f"{norm_names[mod]}.{leaf}"
    return None


def convert_state_dict(
    hf_sd: Mapping[str, Tensor], cfg: ModelConfig, arch: str = ""
) -> dict[str, Tensor]:
    """Rename (and fuse q, k, v of) a transformers state dict into ``companion``'s names.

    ``arch`` (e.g. ``"GptOssForCausalLM"``) names layouts that differ by more than names.
    Keys that no rule maps are kept under their own name, so that
    :func:`load_state_dict_strict` reports them as unexpected.
    """
    transposed = _TRANSPOSED.get(arch, ())
    out: dict[str, Tensor] = {}
    qkv: dict[tuple[int, str], dict[str, Tensor]] = {}  # (layer, "weight"|"bias") -> q, k, v
    for key, t in hf_sd.items():
        parts = key.split(".")
        if key == "model.embed_tokens.weight":
            out["tok_emb.weight"] = t
        elif key == "model.norm.weight":
            out["final_norm.weight"] = t
        elif key == "lm_head.weight":
            if not cfg.tie_embeddings:
                out["lm_head.weight"] = t
        elif parts[:2] == ["model", "layers"] and len(parts) >= 5:
            i, rest = int(parts[2]), ".".join(parts[3:])
            mod, leaf = rest.rsplit(".", 1)
            ours = _layer_key(rest, cfg)
            if ours is None and mod in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                qkv.setdefault((i, leaf), {})[mod[-6]] = t  # "q", "k" or "v"
            else:
                if rest in transposed:
                    t = t.transpose(1, 2)
                out[f"blocks.{i}.{ours}" if ours else key] = t
        else:
            out[key] = t
    for (i, leaf), parts in qkv.items():
        missing = [f"model.layers.{i}.self_attn.{p}_proj.{leaf}" for p in "qkv" if p not in parts]
        if missing:
            raise ValueError(f"cannot load weights; missing tensors: {missing}")
        out[f"blocks.{i}.attn.qkv.{leaf}"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    if cfg.tie_embeddings and "tok_emb.weight" in out:
        out["lm_head.weight"] = out["tok_emb.weight"]  # one tensor under both names
    return out


def load_state_dict_strict(model: nn.Module, sd: Mapping[str, Tensor]) -> None:
    """Copy ``sd`` into ``model``; raise one error naming every missing, unexpected or
    mis-shaped tensor."""
    own = model.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    wrong = [
        f"{k}: expected {tuple(own[k].shape)}, got {tuple(sd[k].shape)}"
        for k in sorted(set(own) & set(sd))
        if own[k].shape != sd[k].shape
    ]
    if missing or unexpected or wrong:
        lines = []
        if missing:
            lines.append(f"missing tensors: {missing}")
        if unexpected:
            lines.append(f"unexpected tensors: {unexpected}")
        if wrong:
            lines.append(f"wrong shapes: {wrong}")
        raise ValueError("cannot load weights; " + "; ".join(lines))
    model.load_state_dict(sd, strict=True)


def from_hf(hf_model: nn.Module) -> DecoderLM:
    """The ``companion`` model equivalent to a transformers causal LM (fp32, eval mode)."""
    cfg = config_from_hf(hf_model.config)
    model = DecoderLM(cfg)
    sd = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
    load_state_dict_strict(model, convert_state_dict(sd, cfg, _arch(hf_model.config)))
    return model.eval()

"""The presets from 2025 on (companion.models.presets), chapter 13: each one is what the
converter reads from the released config, its count equals transformers' model of that
config to the parameter, and it lands on the model card's published figures at the
precision the card gives them.

No card gives an exact count for these models (companion.models.presets.SOURCES says
where each figure was read), so the published-figure check rounds as the card rounds;
the exact checks are against transformers' own model of the same config, built on the
meta device.
"""

from __future__ import annotations

import pytest
import torch

from companion.analysis.calculator import count_params
from companion.models.presets import PRESETS, SOURCES, preset

transformers = pytest.importorskip("transformers")

from companion.checkpoints.transformers_config import config_from_hf  # noqa: E402

IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

# the released config.json values, as transformers' config classes take them
RELEASED = {
    "smollm3-3b": (
        "SmolLM3Config",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=4,
            max_position_embeddings=65536,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 2e6},
            no_rope_layer_interval=4,
            use_sliding_window=False,
            tie_word_embeddings=True,
        ),
    ),
    "minimax-m2": (
        "MiniMaxM2Config",
        dict(
            vocab_size=200064,
            hidden_size=3072,
            intermediate_size=1536,
            num_hidden_layers=62,
            num_attention_heads=48,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=196608,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 5e6},
            rotary_dim=64,
            num_local_experts=256,
            num_experts_per_tok=8,
            tie_word_embeddings=False,
        ),
    ),
    "trinity-large": (
        "AfmoeConfig",
        dict(
            vocab_size=200192,
            hidden_size=3072,
            intermediate_size=12288,
            moe_intermediate_size=3072,
            num_hidden_layers=60,
            num_dense_layers=6,
            num_attention_heads=48,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
            num_experts=256,
            num_experts_per_tok=4,
            num_shared_experts=1,
            route_scale=2.826,
            sliding_window=4096,
            global_attn_every_n_layers=4,
            mup_enabled=True,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3.5-397b-a17b": (
        "Qwen3_5MoeTextConfig",
        dict(
            vocab_size=248320,
            hidden_size=4096,
            num_hidden_layers=60,
            num_attention_heads=32,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=64,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            num_experts=512,
            num_experts_per_tok=10,
            moe_intermediate_size=1024,
            shared_expert_intermediate_size=1024,
            full_attention_interval=4,
            max_position_embeddings=262144,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e7,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
            tie_word_embeddings=False,
        ),
    ),
    "deepseek-v3.2": (
        "DeepseekV32Config",
        dict(
            vocab_size=129280,
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            first_k_dense_replace=3,
            num_attention_heads=128,
            num_key_value_heads=128,
            n_routed_experts=256,
            n_shared_experts=1,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            index_n_heads=64,
            index_head_dim=128,
            index_topk=2048,
            rope_parameters=DEEPSEEK_YARN,
            max_position_embeddings=163840,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
    "glm-5": (
        "GlmMoeDsaConfig",
        dict(
            vocab_size=154880,
            hidden_size=6144,
            intermediate_size=12288,
            moe_intermediate_size=2048,
            num_hidden_layers=78,
            first_k_dense_replace=3,
            num_attention_heads=64,
            num_key_value_heads=64,
            q_lora_rank=2048,
            kv_lora_rank=512,
            qk_nope_head_dim=192,
            qk_rope_head_dim=64,
            v_head_dim=256,
            n_routed_experts=256,
            n_shared_experts=1,
            num_experts_per_tok=8,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            index_n_heads=32,
            index_head_dim=128,
            index_topk=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            max_position_embeddings=202752,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
    "kimi-k2.5": (
        "DeepseekV3Config",
        dict(
            vocab_size=163840,
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            first_k_dense_replace=1,
            num_attention_heads=64,
            num_key_value_heads=64,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            n_routed_experts=384,
            n_shared_experts=1,
            num_experts_per_tok=8,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.827,
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
            max_position_embeddings=262144,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
    "kimi-linear-48b-a3b": (
        "KimiLinearConfig",
        dict(
            vocab_size=163840,
            hidden_size=2304,
            num_hidden_layers=27,
            num_attention_heads=32,
            num_key_value_heads=32,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            linear_attn_config={
                "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],  # 1-based
                "kda_layers": [i for i in range(1, 28) if i % 4 and i != 27],
                "num_heads": 32,
                "head_dim": 128,
                "short_conv_kernel_size": 4,
            },
            intermediate_size=9216,
            first_k_dense_replace=1,
            num_experts=256,
            num_experts_per_token=8,
            num_shared_experts=1,
            moe_intermediate_size=1024,
            routed_scaling_factor=2.446,
            num_expert_group=1,
            topk_group=1,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            max_position_embeddings=1048576,
        ),
    ),
    "ling-3.0-flash": (
        "BailingHybridConfig",
        dict(
            vocab_size=157184,
            hidden_size=2560,
            num_hidden_layers=42,
            layer_group_size=6,
            num_attention_heads=32,
            num_key_value_heads=32,
            head_dim=128,
            short_conv_kernel_size=4,
            kda_safe_gate=True,
            kda_lower_bound=-5.0,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            rope_parameters={"rope_type": "default", "rope_theta": 6e6},
            intermediate_size=6144,
            first_k_dense_replace=2,
            num_experts=512,
            num_experts_per_tok=8,
            num_shared_experts=1,
            moe_intermediate_size=768,
            moe_shared_expert_intermediate_size=768,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            n_group=8,
            topk_group=4,
            max_position_embeddings=262144,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
}

# DeepSeek-V4's released configs name their layers by compress_ratios (0 sliding, 4 CSA,
# 128 HCA; the last entry is the MTP layer's) and their RoPE scaling applies to the
# compressed layers only
V4_YARN = {
    "rope_type": "yarn",
    "factor": 16.0,
    "original_max_position_embeddings": 65536,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
V4 = dict(
    vocab_size=129280,
    num_key_value_heads=1,
    head_dim=512,
    qk_rope_head_dim=64,
    n_shared_experts=1,
    num_experts_per_tok=6,
    scoring_func="sqrtsoftplus",
    norm_topk_prob=True,
    num_hash_layers=3,
    swiglu_limit=10.0,
    sliding_window=128,
    index_n_heads=64,
    index_head_dim=128,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_parameters=V4_YARN,
    max_position_embeddings=1048576,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    num_nextn_predict_layers=1,
)
RELEASED["deepseek-v4-pro"] = (
    "DeepseekV4Config",
    V4
    | dict(
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=128,
        q_lora_rank=1536,
        o_lora_rank=1024,
        o_groups=16,
        moe_intermediate_size=3072,
        n_routed_experts=384,
        routed_scaling_factor=2.5,
        compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0],
        index_topk=1024,
    ),
)
RELEASED["deepseek-v4-flash"] = (
    "DeepseekV4Config",
    V4
    | dict(
        hidden_size=4096,
        num_hidden_layers=43,
        num_attention_heads=64,
        q_lora_rank=1024,
        o_lora_rank=1024,
        o_groups=8,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        routed_scaling_factor=1.5,
        compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0],
        index_topk=512,
    ),
)

# the published figures in units of 1e9, how the source writes them ("round" to the
# nearest, "floor": the integer part, as cards that say "398B" for 398.6B do), and what
# our count compares with: "total", "active", or "active_without_embeddings" where the
# card's active figure leaves the embedding and output tables out
PUBLISHED = {
    "smollm3-3b": [("total", 3, "round")],
    "trinity-large": [("total", 398, "floor"), ("active", 13, "round")],
    "qwen3.5-397b-a17b": [("active", 17, "round")],
    "minimax-m2": [("active_without_embeddings", 10, "round")],
    "glm-5": [("total", 744, "round"), ("active_without_embeddings", 40, "floor")],
    "kimi-k2.5": [("total", 1026, "round"), ("active", 32, "floor")],
    "kimi-linear-48b-a3b": [("active_without_embeddings", 3, "round")],
    # DeepSeek-V4 (card: 1.6T / 49B, 284B / 13B): totals without the MTP layer, rounded
    # (the Pro's to 0.1T); active with the embedding, as DeepSeek-V3's report counts
    # it, truncated to the integer
    "deepseek-v4-pro": [("total", 1600, "round100"), ("active", 49, "floor")],
    "deepseek-v4-flash": [("total", 284, "round"), ("active", 13, "floor")],
}
# Totals not checked, each said in SOURCES: Qwen3.5's and MiniMax-M2's cards (397B,
# 230B) count releases with more than the text tower (a vision encoder, MTP modules)
# without saying what; DeepSeek-V3.2's 685B includes its MTP module and no V3.2 source
# gives an active count; Kimi Linear's 48B is its name (the preset counts 49.12B);
# Ling-3.0-Flash has no published count.


def _hf_config(name: str):
    cls, fields = RELEASED[name]
    return getattr(transformers, cls)(**fields, **IDS)


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_preset_is_what_the_converter_reads_from_the_released_config(name: str) -> None:
    assert config_from_hf(_hf_config(name)) == preset(name)


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_count_equals_transformers_model_of_the_released_config(name: str) -> None:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_hf_config(name))
    # what a checkpoint holds: parameters and persistent buffers (balancing biases are a
    # frozen parameter in one family and a buffer in another), tied tensors once
    held = {id(t): t.numel() for t in model.state_dict(keep_vars=True).values()}
    assert sum(held.values()) == count_params(preset(name)).total


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_counts_round_to_the_published_figures(name: str) -> None:
    pc = count_params(preset(name))
    for attr, figure, how in PUBLISHED[name]:
        billions = getattr(pc, attr) / 1e9
        if how == "round100":  # to the nearest 0.1T
            billions = 100 * round(billions / 100)
        assert (int(billions) if how == "floor" else round(billions)) == figure, attr


def test_every_2026_preset_cites_its_sources() -> None:
    assert set(SOURCES) <= set(PRESETS)
    assert set(RELEASED) <= set(SOURCES)
    for name, source in SOURCES.items():
        assert source.config and source.counts, name

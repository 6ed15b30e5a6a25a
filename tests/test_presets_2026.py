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
}

# the published figures in units of 1e9 and the digits given, and what our count
# compares with: "total", "active", or "active_without_embeddings" where the card's
# active figure leaves the embedding and output tables out
PUBLISHED = {
    "smollm3-3b": [("total", 3, 0)],
    "trinity-large": [("total", 399, 0), ("active", 13, 0)],
    "qwen3.5-397b-a17b": [("active", 17, 0)],
    "minimax-m2": [("active_without_embeddings", 10, 0)],
}
# Qwen3.5's and MiniMax-M2's cards give totals (397B, 230B) for releases that carry more
# than the text tower (a vision encoder, MTP modules) without saying what they count: the
# presets' totals (396.35B, 228.69B) are stated in SOURCES, not checked against them.


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
    for attr, figure, digits in PUBLISHED[name]:
        assert round(getattr(pc, attr) / 1e9, digits) == figure, attr


def test_every_2026_preset_cites_its_sources() -> None:
    assert set(SOURCES) <= set(PRESETS)
    assert set(RELEASED) <= set(SOURCES)
    for name, source in SOURCES.items():
        assert source.config and source.counts, name

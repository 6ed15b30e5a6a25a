"""Real model configurations, as :class:`~companion.models.config.ModelConfig` presets
(chapter 13).

Each preset copies the released ``config.json`` of a model (hidden size, heads, KV
heads, head width, FFN and expert widths, vocabulary, layers, windows and layer pattern,
RoPE base and scaling, tied embeddings, biases), so that
:func:`companion.analysis.calculator.count_params` gives the published parameter count
and a ``DecoderLM`` built from it on the meta device has the shapes of the real
checkpoint. ``max_seq_len`` is the config's ``max_position_embeddings``. Text towers
only: Gemma 3's and Qwen3.5's vision encoders and the multi-token-prediction modules
(DeepSeek-V3, Qwen3.5, MiniMax-M2) are left out. For the presets from 2025 on,
``SOURCES`` says which file each copies, the published counts, and which values no
primary source gave. :func:`spec_row` writes a preset as one row of the chapter's spec sheet.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from companion.models.config import ModelConfig
from companion.models.config_parts import (
    LinearAttentionConfig,
    MLAConfig,
    MoEConfig,
    SparseConfig,
)
from companion.models.config_streams import (
    CompressedAttentionConfig,
    HyperConnectionConfig,
)
from companion.ops.rope import RopeScaling

__all__ = [
    "GLU_NAMES",
    "PRESETS",
    "SOURCES",
    "Source",
    "head_sharing",
    "preset",
    "rope_base",
    "spec_row",
    "tiny",
]


def _gpt2(**fields: object) -> ModelConfig:
    """The 2019 block: learned positions, pre-LayerNorm with biases, a GELU MLP of width
    4d."""
    base = {
        "vocab_size": 50257,
        "max_seq_len": 1024,
        "norm": "layernorm",
        "norm_placement": "pre",
        "activation": "gelu_tanh",
        "position": "learned",
        "ffn": "mlp",
        "bias": True,
        "tie_embeddings": True,
        "attn_impl": "sdpa",
    }
    return ModelConfig(**{**base, **fields})


def _modern(**fields: object) -> ModelConfig:
    """The 2023+ block: pre-RMSNorm, RoPE, SwiGLU, no biases, untied head (unless
    set)."""
    base = {
        "norm": "rmsnorm",
        "norm_placement": "pre",
        "activation": "silu",
        "position": "rope",
        "ffn": "glu",
        "bias": False,
        "tie_embeddings": False,
        "attn_impl": "sdpa",
    }
    return ModelConfig(**{**base, **fields})


def _every(n: int, layers: int, kind: str) -> tuple[str, ...]:
    """Layer i is full attention when (i + 1) is a multiple of n, else ``kind``."""
    return tuple("full" if (i + 1) % n == 0 else kind for i in range(layers))


def _nope_every(n: int, layers: int) -> tuple[int, ...]:
    """The layers i with (i + 1) a multiple of n: SmolLM3's NoPE layers, Trinity's full
    (and RoPE-free) ones."""
    return tuple(i for i in range(layers) if (i + 1) % n == 0)


_DEEPSEEK_YARN = RopeScaling(
    "yarn",
    factor=40.0,
    original_max_position_embeddings=4096,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=1.0,
)


def _deepseek_v4(first: tuple[str, ...], layers: int, **fields: object) -> ModelConfig:
    """DeepSeek-V4: ``first`` layers, then CSA and HCA alternating; the window of 128,
    one key/value head of 512 with 64 rotated channels, 4 streams, √softplus routing
    with the first 3 layers hash-routed, clamped SwiGLU experts beside one shared."""
    rest = tuple("csa" if i % 2 == 0 else "hca" for i in range(len(first), layers))
    moe = fields.pop("moe")
    return _modern(
        vocab_size=129280,
        n_layers=layers,
        head_dim=512,
        d_ff=moe.expert_d_ff,  # no dense FFN: every layer is MoE
        max_seq_len=1048576,
        norm_eps=1e-6,
        partial_rotary_factor=0.125,
        sliding_window=128,
        layer_types=first + rest,
        attn_sinks=True,
        moe=moe.replace(
            experts_per_token=6,
            shared_d_ff=moe.expert_d_ff,
            router="sqrtsoftplus",
            router_selection_bias=True,
            hash_layers=3,
            swiglu_limit=10.0,
        ),
        residual=HyperConnectionConfig(n_streams=4),
        **fields,
    )


_V4_YARN = RopeScaling(  # the compressed layers' RoPE only
    "yarn",
    factor=16.0,
    original_max_position_embeddings=65536,
    beta_fast=32.0,
    beta_slow=1.0,
    attention_factor=1.0,
)

PRESETS: dict[str, ModelConfig] = {
    "gpt2": _gpt2(d_model=768, n_layers=12, n_heads=12),
    "gpt2-xl": _gpt2(d_model=1600, n_layers=48, n_heads=25),
    # GPT-3 175B (Brown et al. 2020, Table 2.1). Its layers alternate dense and "locally
    # banded sparse" attention; the band width is not published, so every layer here is
    # dense (the sheet in chapter 13 says so)
    "gpt3-175b": _gpt2(d_model=12288, n_layers=96, n_heads=96, max_seq_len=2048),
    "llama2-7b": _modern(
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        d_ff=11008,
        max_seq_len=4096,
        norm_eps=1e-5,
    ),
    "mistral-7b": _modern(
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        max_seq_len=32768,
        norm_eps=1e-5,
        sliding_window=4096,
    ),
    "mixtral-8x7b": _modern(
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        max_seq_len=32768,
        norm_eps=1e-5,
        rope_theta=1e6,
        moe=MoEConfig(
            n_experts=8,
            experts_per_token=2,
        ),
    ),
    "llama3-8b": _modern(
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        max_seq_len=8192,
        norm_eps=1e-5,
        rope_theta=500000.0,
    ),
    "llama3.1-8b": _modern(
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        max_seq_len=131072,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(
            "llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    "deepseek-v3": _modern(
        vocab_size=129280,
        d_model=7168,
        n_layers=61,
        n_heads=128,
        d_ff=18432,
        max_seq_len=163840,
        norm_eps=1e-6,
        rope_scaling=_DEEPSEEK_YARN,
        rope_layout="interleaved",
        # 1/√(D_nope + R), times YaRN's mscale² (0.1·ln 40 + 1)²
        attn_scale=192**-0.5 * (0.1 * math.log(40.0) + 1.0) ** 2,
        moe=MoEConfig(
            n_experts=256,
            experts_per_token=8,
            expert_d_ff=2048,
            dense_layers=3,
            shared_d_ff=2048,
            router="sigmoid",
            router_groups=8,
            router_topk_groups=4,
            router_scale=2.5,
            router_selection_bias=True,
        ),
        mla=MLAConfig(
            kv_lora_rank=512,
            q_lora_rank=1536,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
    ),
    "qwen3-235b-a22b": _modern(
        vocab_size=151936,
        d_model=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        head_dim=128,
        d_ff=12288,
        max_seq_len=40960,
        norm_eps=1e-6,
        qk_norm="head",
        rope_theta=1000000.0,
        moe=MoEConfig(
            n_experts=128,
            experts_per_token=8,
            expert_d_ff=1536,
        ),
    ),
    "gpt-oss-120b": _modern(
        vocab_size=201088,
        d_model=2880,
        n_layers=36,
        n_heads=64,
        n_kv_heads=8,
        head_dim=64,
        d_ff=2880,
        max_seq_len=131072,
        norm_eps=1e-5,
        bias=True,  # q, k, v and output projections carry biases
        rope_theta=150000.0,
        rope_scaling=RopeScaling(
            "yarn",
            factor=32.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
        ),
        sliding_window=128,
        layer_types=_every(2, 36, "sliding"),
        attn_sinks=True,
        moe=MoEConfig(
            n_experts=128,
            experts_per_token=4,
            expert_d_ff=2880,
            expert_kind="gpt_oss",
            router_bias=True,
        ),
    ),
    "gemma3-27b": _modern(
        vocab_size=262208,
        d_model=5376,
        n_layers=62,
        n_heads=32,
        n_kv_heads=16,
        head_dim=128,
        d_ff=21504,
        max_seq_len=131072,
        norm_eps=1e-6,
        norm_placement="sandwich",
        norm_offset=1.0,
        activation="gelu_tanh",
        qk_norm="head",
        rope_theta=1000000.0,
        rope_scaling=RopeScaling("linear", factor=8.0),
        rope_local_theta=10000.0,
        sliding_window=1024,
        layer_types=_every(6, 62, "sliding"),
        attn_scale=168**-0.5,  # query_pre_attn_scalar = d / H
        scale_embeddings=True,
        tie_embeddings=True,
    ),
    "olmo3-32b": _modern(
        vocab_size=100278,
        d_model=5120,
        n_layers=64,
        n_heads=40,
        n_kv_heads=8,
        d_ff=27648,
        max_seq_len=65536,
        norm_eps=1e-6,
        norm_placement="post_branch",
        qk_norm="full",
        rope_theta=500000.0,
        rope_scaling=RopeScaling(
            "yarn",
            factor=8.0,
            original_max_position_embeddings=8192,
            attention_factor=1.2079441541679836,
            beta_fast=32.0,
            beta_slow=1.0,
        ),
        rope_local_theta=500000.0,  # sliding layers: the same base, without YaRN
        sliding_window=4096,
        layer_types=_every(4, 64, "sliding"),
    ),
    "qwen3-next-80b-a3b": _modern(
        vocab_size=151936,
        d_model=2048,
        n_layers=48,
        n_heads=16,
        n_kv_heads=2,
        head_dim=256,
        d_ff=5120,
        max_seq_len=262144,
        norm_eps=1e-6,
        norm_offset=1.0,  # zero-centred gains, stored as w and applied as 1 + w
        qk_norm="head",
        rope_theta=10000000.0,
        partial_rotary_factor=0.25,
        layer_types=_every(4, 48, "linear"),
        attn_output_gate=True,
        moe=MoEConfig(
            n_experts=512,
            experts_per_token=10,
            expert_d_ff=512,
            shared_d_ff=512,
            shared_expert_gate=True,
        ),
        linear=LinearAttentionConfig(
            key_heads=16,
            value_heads=32,
            key_dim=128,
            value_dim=128,
            conv_kernel=4,
        ),
    ),
    "smollm2-135m": _modern(
        vocab_size=49152,
        d_model=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        d_ff=1536,
        max_seq_len=8192,
        norm_eps=1e-5,
        rope_theta=100000.0,
        tie_embeddings=True,
    ),
    # --- 2025-2026: the sources and the values no primary source gave are in SOURCES ---
    "smollm3-3b": _modern(
        vocab_size=128256,
        d_model=2048,
        n_layers=36,
        n_heads=16,
        n_kv_heads=4,
        d_ff=11008,
        max_seq_len=65536,
        norm_eps=1e-6,
        rope_theta=2000000.0,
        nope_layers=_nope_every(
            4, 36
        ),  # no_rope_layer_interval 4: layers 3, 7, ..., 35
        tie_embeddings=True,
    ),
    "minimax-m2": _modern(
        vocab_size=200064,
        d_model=3072,
        n_layers=62,
        n_heads=48,
        n_kv_heads=8,
        head_dim=128,
        d_ff=1536,
        max_seq_len=196608,
        norm_eps=1e-6,
        qk_norm="full",  # RMSNorm over the whole q and k projections
        rope_theta=5000000.0,
        partial_rotary_factor=0.5,  # rotary_dim 64 of 128
        moe=MoEConfig(
            n_experts=256,
            experts_per_token=8,
            expert_d_ff=1536,
            router="sigmoid",
            router_selection_bias=True,
        ),
    ),
    "trinity-large": _modern(
        vocab_size=200192,
        d_model=3072,
        n_layers=60,
        n_heads=48,
        n_kv_heads=8,
        head_dim=128,
        d_ff=12288,
        max_seq_len=131072,
        norm_eps=1e-5,
        norm_placement="sandwich",
        qk_norm="head",
        rope_theta=10000.0,
        sliding_window=4096,
        layer_types=_every(4, 60, "sliding"),
        nope_layers=_nope_every(4, 60),  # RoPE on the sliding layers only
        attn_output_gate=True,
        attn_gate_layout="separate",
        scale_embeddings=True,  # mup_enabled
        moe=MoEConfig(
            n_experts=256,
            experts_per_token=4,
            expert_d_ff=3072,
            dense_layers=6,
            shared_d_ff=3072,
            router="sigmoid",
            router_scale=2.826,
            router_selection_bias=True,
        ),
    ),
    "qwen3.5-397b-a17b": _modern(
        vocab_size=248320,
        d_model=4096,
        n_layers=60,
        n_heads=32,
        n_kv_heads=2,
        head_dim=256,
        d_ff=1024,  # no dense FFN: the config has no intermediate_size
        max_seq_len=262144,
        norm_eps=1e-6,
        norm_offset=1.0,
        qk_norm="head",
        rope_theta=10000000.0,
        partial_rotary_factor=0.25,
        layer_types=_every(4, 60, "linear"),
        attn_output_gate=True,
        moe=MoEConfig(
            n_experts=512,
            experts_per_token=10,
            expert_d_ff=1024,
            shared_d_ff=1024,
            shared_expert_gate=True,
        ),
        linear=LinearAttentionConfig(
            key_heads=16,
            value_heads=64,
            key_dim=128,
            value_dim=128,
            projections="split",
        ),
    ),
    "deepseek-v3.2": _modern(
        vocab_size=129280,
        d_model=7168,
        n_layers=61,
        n_heads=128,
        d_ff=18432,
        max_seq_len=163840,
        norm_eps=1e-6,
        rope_scaling=_DEEPSEEK_YARN,
        rope_layout="interleaved",
        moe=MoEConfig(
            n_experts=256,
            experts_per_token=8,
            expert_d_ff=2048,
            dense_layers=3,
            shared_d_ff=2048,
            router="sigmoid",
            router_groups=8,
            router_topk_groups=4,
            router_scale=2.5,
            router_selection_bias=True,
        ),
        # DeepSeek-V3's MLA with the lightning indexer: 64 heads of 128, the top 2048 keys
        mla=MLAConfig(
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            q_lora_rank=1536,
            indexer=SparseConfig(n_heads=64, head_dim=128, topk=2048),
        ),
    ),
    "glm-5": _modern(
        vocab_size=154880,
        d_model=6144,
        n_layers=78,
        n_heads=64,
        d_ff=12288,
        max_seq_len=202752,
        norm_eps=1e-5,
        rope_theta=1000000.0,
        rope_layout="interleaved",
        moe=MoEConfig(
            n_experts=256,
            experts_per_token=8,
            expert_d_ff=2048,
            dense_layers=3,
            shared_d_ff=2048,
            router="sigmoid",
            router_scale=2.5,
            router_selection_bias=True,
        ),
        mla=MLAConfig(
            kv_lora_rank=512,
            qk_nope_head_dim=192,
            qk_rope_head_dim=64,
            v_head_dim=256,
            q_lora_rank=2048,
            latent_norm_eps=1e-6,
            indexer=SparseConfig(
                n_heads=32, head_dim=128, topk=2048, rope_layout="interleaved"
            ),
        ),
    ),
    "kimi-k2.5": _modern(
        vocab_size=163840,
        d_model=7168,
        n_layers=61,
        n_heads=64,
        d_ff=18432,
        max_seq_len=262144,
        norm_eps=1e-5,
        rope_theta=50000.0,
        rope_layout="interleaved",
        moe=MoEConfig(
            n_experts=384,
            experts_per_token=8,
            expert_d_ff=2048,
            dense_layers=1,
            shared_d_ff=2048,
            router="sigmoid",
            router_scale=2.827,
            router_selection_bias=True,
        ),
        mla=MLAConfig(
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            q_lora_rank=1536,
            latent_norm_eps=1e-6,
        ),
    ),
    "kimi-linear-48b-a3b": _modern(
        vocab_size=163840,
        d_model=2304,
        n_layers=27,
        n_heads=32,
        d_ff=9216,
        max_seq_len=1048576,
        norm_eps=1e-5,
        position="none",  # mla_use_nope: the MLA layers rotate nothing
        # 1-based full_attn_layers 4, 8, ..., 24 and 27: 7 MLA layers, 20 KDA layers
        layer_types=tuple(
            "full" if i in (3, 7, 11, 15, 19, 23, 26) else "linear" for i in range(27)
        ),
        moe=MoEConfig(
            n_experts=256,
            experts_per_token=8,
            expert_d_ff=1024,
            dense_layers=1,
            shared_d_ff=1024,
            router="sigmoid",
            router_scale=2.446,
            router_selection_bias=True,
        ),
        mla=MLAConfig(
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            latent_norm_eps=1e-6,
        ),
        linear=LinearAttentionConfig(
            key_heads=32, value_heads=32, key_dim=128, value_dim=128, kind="kda"
        ),
    ),
    "ling-3.0-flash": _modern(
        vocab_size=157184,
        d_model=2560,
        n_layers=42,
        n_heads=32,
        d_ff=6144,
        max_seq_len=262144,
        norm_eps=1e-6,
        rope_theta=6000000.0,
        rope_layout="interleaved",
        layer_types=_every(6, 42, "linear"),  # layer_group_size 6: one MLA layer in 6
        moe=MoEConfig(
            n_experts=512,
            experts_per_token=8,
            expert_d_ff=768,
            dense_layers=2,
            shared_d_ff=768,
            router="sigmoid",
            router_groups=8,
            router_topk_groups=4,
            router_scale=2.5,
            router_selection_bias=True,
        ),
        mla=MLAConfig(
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            output_gate=True,  # a sigmoid gate per head
        ),
        linear=LinearAttentionConfig(
            key_heads=32,
            value_heads=32,
            key_dim=128,
            value_dim=128,
            kind="kda",
            kda_layout="bailing",
            kda_gate_lower_bound=-5.0,
        ),
    ),
    "deepseek-v4-pro": _deepseek_v4(
        ("hca", "hca"),
        61,
        d_model=7168,
        n_heads=128,
        moe=MoEConfig(384, 6, expert_d_ff=3072, router_scale=2.5),
        compression=CompressedAttentionConfig(
            q_lora_rank=1536,
            o_groups=16,
            o_lora_rank=1024,
            index_n_heads=64,
            index_head_dim=128,
            index_topk=1024,
            rope_scaling=_V4_YARN,
        ),
    ),
    "deepseek-v4-flash": _deepseek_v4(
        ("sliding", "sliding"),
        43,
        d_model=4096,
        n_heads=64,
        moe=MoEConfig(256, 6, expert_d_ff=2048, router_scale=1.5),
        compression=CompressedAttentionConfig(
            q_lora_rank=1024,
            o_groups=8,
            o_lora_rank=1024,
            index_n_heads=64,
            index_head_dim=128,
            index_topk=512,
            rope_scaling=_V4_YARN,
        ),
    ),
}


class Source(NamedTuple):
    """Where a preset's values and published counts come from.

    ``config``: the released ``config.json`` or the copy of it that was read; ``counts``:
    the published total and active parameters as the card writes them, with where;
    ``unverified``: fields no primary source gave (read from transformers' defaults for
    that checkpoint or from a sibling model's file), each with what was used.
    """

    config: str
    counts: str
    unverified: tuple[str, ...] = ()


# the presets from 2025 on; the earlier ones cite their checkpoints in the chapters
SOURCES: dict[str, Source] = {
    "deepseek-v4-pro": Source(
        "deepseek-ai/DeepSeek-V4-Pro config.json, as copied verbatim into a third-party "
        "script (the HF repo itself was not read); MindSpore's DeepseekV4Config "
        "defaults agree",
        "'1.6T total / 49B active' (the DeepSeek-V4 model card's table, as extracted in "
        "antirez/ds4 MODEL_CARD.md, and press coverage); the preset counts 1573.00B "
        "without the MTP layer and 49.78B active with the embedding (48.85B without "
        "it): the card rounds the total to 0.1T and truncates the active count; which "
        "convention the card uses is not stated",
        (
            "the published counts' convention (embedding, MTP): not stated; exact "
            "counts: not found",
        ),
    ),
    "deepseek-v4-flash": Source(
        "deepseek-ai/DeepSeek-V4-Flash config.json, as quoted in third-party test "
        "fixtures and in the full copy of its V4.1 successor (same fields but the MTP "
        "stages); transformers 5.24's DeepseekV4Config and NeMo's defaults agree",
        "'284B total / 13B active' (the same card table); the preset counts 284.33B "
        "without the MTP layer (with it the total would be about 291B) and 13.80B "
        "active with the embedding (13.27B without it)",
        ("the published counts' convention: not stated; exact counts: not found",),
    ),
    "deepseek-v3.2": Source(
        "deepseek-ai/DeepSeek-V3.2-Exp inference/config_671B_v3.2.json and model.py's "
        "defaults (DeepSeek's GitHub), in transformers' field names; the HF-format "
        "values (positions, eps) as transformers 5.24's DeepseekV32Config defaults",
        "'685B-parameter MoE backbone' (transformers' docs: the hub's count, with the MTP "
        "module); the preset counts 671.88B without it (DeepSeek-V3's 671.03B plus "
        "0.85B of indexers) and 38.40B active; no V3.2 source gives an active count",
    ),
    "glm-5": Source(
        "zai-org/GLM-5-FP8 config.json (the official FP8 release)",
        "'744B parameters (40B active)' (zai-org/GLM-5 README); the preset counts "
        "743.91B without the MTP layer and 41.78B active, 40.83B without the "
        "embedding tables: the README truncates",
    ),
    "kimi-k2.5": Source(
        "moonshotai/Kimi-K2.5 text_config (DeepSeek-V3's architecture), as copied in "
        "third-party tests; the K2 family's widths as in NVIDIA's Kimi-K2 provider",
        "'1 trillion total parameters, 32 billion activated' (the Kimi K2 card, which "
        "K2.5 continues), '1.026T' in a registry's copy of the K2 card; the preset "
        "counts 1026.41B and 32.86B active for the text model: the card truncates",
        (
            "rope_scaling: the YaRN settings for 256k positions were not found; the "
            "preset has none",
            "max_position_embeddings 262144: from API context tables, not the file",
            "the vision tower is left out; K2.5's own card counts were not found",
        ),
    ),
    "kimi-linear-48b-a3b": Source(
        "moonshotai/Kimi-Linear-48B-A3B-Instruct config.json as copied in third-party "
        "tests (they agree with transformers 5.24's KimiLinearConfig defaults, which name "
        "that checkpoint)",
        "'48B total, 3B activated' (MoonshotAI/Kimi-Linear README); the preset counts "
        "49.12B and 3.11B active without the embedding tables: the README's total is "
        "the model's name, not a count",
    ),
    "ling-3.0-flash": Source(
        "inclusionAI/Ling-3.0-Flash config (model_type bailing_hybrid) as pinned in a "
        "third-party test against the real safetensors index, and transformers 5.24's "
        "BailingHybridConfig defaults (they name that checkpoint)",
        "no published count found; the preset counts 124.41B and 5.51B active. The "
        "source's Ling 2.5 1T ('1T total, 63B active', 1:7 MLA + lightning attention) "
        "is a different hybrid whose config was not found",
        (
            "max_position_embeddings 262144: transformers' default",
            "sigmoid scores with a selection bias: from small Ling fixtures, not the "
            "Flash file",
        ),
    ),
    "smollm3-3b": Source(
        "HuggingFaceTB/SmolLM3-3B config.json, as transformers 5.24's SmolLM3Config "
        "defaults (they name that checkpoint) and a fine-tune's copy of the file",
        "'3B' in the model's name; no exact count found",
        (
            "rope_theta: transformers' default 2e6, the released file not read",
            "max_position_embeddings: 65536 from a fine-tune's copy",
        ),
    ),
    "minimax-m2": Source(
        "MiniMaxAI/MiniMax-M2 config.json, as copied in third-party test fixtures (two "
        "agree on every width; one gives 204800 positions, likely from M2.1)",
        "'230 billion total parameters with 10 billion active' (SGLang's MiniMax-M2 "
        "page); the preset counts 228.69B (text, no MTP modules) and 9.80B active "
        "without the embedding tables; the card's convention is not stated",
    ),
    "trinity-large": Source(
        "arcee-ai/Trinity-Large-Preview: widths, layers, experts and window from a "
        "config copy that writes Large as overrides of Trinity-Nano's file; the card's "
        "architecture table agrees (6 dense layers, 256 experts + 1 shared, 4 active)",
        "'398B-parameter sparse MoE ... approximately 13B active parameters per token' "
        "(the Trinity-Large-Preview model card); the hub's count of the checkpoint "
        "shows 399B, the preset counts 398.64B: the card truncates",
        (
            "vocab_size 200192, rope_theta 1e4, route_scale 2.826, max positions 131072, "
            "norm_eps 1e-5, head_dim 128, 1 full layer in 4: Trinity-Nano's values, not "
            "confirmed for Large",
        ),
    ),
    "qwen3.5-397b-a17b": Source(
        "Qwen/Qwen3.5-397B-A17B config.json (text_config), as copied in third-party code "
        "(several copies agree; one writes a shared expert of 4096, the rest 1024)",
        "'397B total parameters, 17B activated' (SGLang's Qwen3.5 page, from the card); "
        "the preset counts 396.35B and 17.35B active for the text tower; the release is "
        "a vision-language model with an MTP layer, and which of them the 397B includes "
        "is not stated",
    ),
}


_TINY = ModelConfig(
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    max_seq_len=64,
    norm="rmsnorm",
    position="rope",
    ffn="glu",
    activation="silu",
    bias=False,
)


def tiny(**changes: object) -> ModelConfig:
    """A small modern decoder for tests and exercises: pre-RMSNorm, RoPE, SwiGLU, 4
    query heads sharing 2 K/V heads, d = 32, 2 layers, 64 tokens; ``changes`` replace
    fields."""
    return _TINY.replace(**changes)


def preset(name: str) -> ModelConfig:
    """The :class:`~companion.models.config.ModelConfig` of a released model, by
    name."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid names: {sorted(PRESETS)}")
    return PRESETS[name]


GLU_NAMES = {
    "silu": "SwiGLU",
    "gelu": "GeGLU",
    "gelu_tanh": "GeGLU",
    "relu": "ReGLU",
    "relu2": "ReLU²-GLU",
}
_PLACEMENTS = {
    "pre": "pre",
    "post": "post",
    "sandwich": "sandwich",
    "post_branch": "post-branch",
}


def rope_base(theta: float) -> str:
    """A RoPE base as the chapters write it: 5e5, 1.5e5, 1e4."""
    mantissa, exponent = f"{theta:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def head_sharing(n_heads: int, n_kv_heads: int) -> str:
    """``"MHA"``, ``"GQA"`` or ``"MQA"``: how many query heads share a key/value
    head."""
    if n_heads == n_kv_heads:
        return "MHA"
    return "MQA" if n_kv_heads == 1 else "GQA"


def _period(kinds: tuple[str, ...]) -> tuple[str, ...]:
    """The shortest prefix whose repetition gives the layer pattern (cut at the last
    layer)."""
    n = len(kinds)
    repeats = (
        p for p in range(1, n + 1) if all(kinds[i] == kinds[i % p] for i in range(n))
    )
    return kinds[: next(repeats)]


def spec_row(cfg: ModelConfig) -> dict[str, str]:
    """One spec-sheet row: ``norm``, ``position``, ``ffn``, ``attention``, ``vocab``,
    ``context``, each a short string derived from the config."""
    norm = f"{'RMSNorm' if cfg.norm == 'rmsnorm' else 'LayerNorm'}, "
    norm += _PLACEMENTS[cfg.norm_placement] + (
        " + QK-norm" if cfg.qk_norm != "none" else ""
    )
    if cfg.residual is not None:  # hyper-connections in place of the residual add
        norm += f"; {cfg.residual.n_streams} streams (mHC)"
    position = {
        "sinusoidal": "sinusoidal, additive",
        "learned": "learned absolute",
    }.get(cfg.position, "none (NoPE)")
    if cfg.position == "rope":
        position = f"RoPE, b={rope_base(cfg.rope_theta)}"
        if cfg.partial_rotary_factor < 1:
            position += f", on {cfg.partial_rotary_factor:g} of D"
        if cfg.rope_scaling is not None:
            factor = cfg.rope_scaling.factor
            position += f", {cfg.rope_scaling.rope_type}"
            position += f" ×{factor:g}" if factor else ""
        if cfg.rope_local_theta is not None:
            position += f"; local b={rope_base(cfg.rope_local_theta)}"
        if cfg.nope_layers:
            position += f"; NoPE on {len(cfg.nope_layers)} of {cfg.n_layers} layers"
    act = {"relu": "ReLU", "relu2": "ReLU²"}.get(
        cfg.activation, cfg.activation.split("_")[0].upper()
    )
    ffn = GLU_NAMES[cfg.activation] if cfg.ffn == "glu" else f"{act} MLP"
    moe = cfg.moe
    if moe is not None:
        shared = "+1" if moe.shared_d_ff else ""
        ffn = "clamped " + ffn if moe.expert_kind == "gpt_oss" else ffn
        ffn = f"MoE {moe.n_experts}{shared}, top-{moe.experts_per_token}, {ffn} {moe.expert_d_ff}"
    else:
        ffn += f", d_ff {cfg.d_ff}"
    h, h_kv = cfg.n_heads, cfg.n_kv_heads
    if cfg.is_mla:
        attention = f"MLA r={cfg.mla.kv_lora_rank}, {h} heads"
        if cfg.mla.output_gate:
            attention = "gated " + attention
        if cfg.mla.indexer is not None:
            attention += f", sparse top-{cfg.mla.indexer.topk}"
    else:
        sharing = head_sharing(h, h_kv)
        attention = f"MHA {h}" if sharing == "MHA" else f"{sharing} {h}:{h_kv}"
    if cfg.attn_output_gate:
        attention = "gated " + attention
    unit = _period(cfg.layer_types)
    if cfg.compression is not None:  # DeepSeek-V4: a window on every layer
        attention += f", SWA {cfg.sliding_window} + CSA/HCA"
    elif "sliding" in unit:
        attention += f", SWA {cfg.sliding_window}"
        if "full" in unit:
            attention += f" at {unit.count('sliding')}:{unit.count('full')}"
    if "linear" in unit:
        mixer = "KDA" if cfg.linear.kind == "kda" else "Gated DeltaNet"
        ratio = f"{unit.count('linear')}:{unit.count('full')}"
        attention = f"{mixer} : {attention}, {ratio}"
    if cfg.attn_sinks:
        attention += ", sinks"
    return {
        "norm": norm,
        "position": position,
        "ffn": ffn,
        "attention": attention,
        "vocab": f"{cfg.vocab_size:,}",
        "context": f"{cfg.max_seq_len:,}",
    }

"""The calculator (companion.analysis.calculator) and the presets (companion.models.presets),
chapter 13.

Counts are checked three ways: against the models themselves built on the meta device
(companion's DecoderLM, and transformers' for the sparse and hybrid families), against the
published parameter counts (stored numbers: the checkpoints cannot be read here), and the
KV-cache and FLOP figures against companion's own caches and torch's FLOP counter.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from companion.analysis.calculator import (
    COMPONENTS,
    count_params,
    flops_per_token,
    kv_cache_bytes,
    kv_cache_bytes_per_token,
)
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.models.presets import PRESETS, preset, spec_row, tiny

KIB, GIB = 2**10, 2**30

# Published counts of the released checkpoints (text towers, no MTP module): total, active.
# gpt-oss's card leaves the embedding table out of "active"; the others count it.
PUBLISHED = {
    "gpt2": (124_439_808, None),
    "gpt2-xl": (1_557_611_200, None),
    "llama2-7b": (6_738_415_616, None),
    "mistral-7b": (7_241_732_096, None),
    "llama3-8b": (8_030_261_248, None),
    "mixtral-8x7b": (46_702_792_704, 12_879_925_248),
    "smollm2-135m": (134_515_008, None),
    "qwen3-235b-a22b": (235_093_634_560, 22_190_763_520),
    "deepseek-v3": (671_026_419_200, 37_552_297_472),
    "gpt-oss-120b": (116_829_156_672, 5_132_849_472),
    "qwen3-next-80b-a3b": (79_674_391_296, 3_874_929_408),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_counts(name: str) -> None:
    pc = count_params(preset(name))
    total, active = PUBLISHED[name]
    assert pc.total == total
    if name == "gpt-oss-120b":
        assert pc.active_without_embeddings == active
    elif active is not None:
        assert pc.active == active
    else:
        assert pc.active == pc.total  # dense: every weight is used by every token


def test_gpt3_is_the_nominal_175b() -> None:
    """Brown et al. (2020), Table 2.1: 96 layers of width 12,288, "175.0B" parameters. The
    exact count of that shape is 174.6B: the paper's figure is a rounded name."""
    total = count_params(preset("gpt3-175b")).total
    assert round(total / 1e9) == 175 and round(total / 1e8) == 1746


def _state_numel(model: torch.nn.Module) -> int:
    """Numbers a checkpoint of ``model`` holds: parameters and persistent buffers, tied once."""
    unique = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    return sum(t.numel() for t in unique.values())


@pytest.mark.parametrize("name", list(PRESETS))
def test_count_matches_the_companion_model_on_meta(name: str) -> None:
    cfg = preset(name)
    with torch.device("meta"):
        model = DecoderLM(cfg)
    pc = count_params(cfg)
    assert _state_numel(model) == pc.total
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == pc.trainable


# transformers configs of the families companion's block cannot build yet, from config.json
HF_CONFIGS = {
    "deepseek-v3": (
        "DeepseekV3Config",
        {
            "vocab_size": 129280,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "n_shared_experts": 1,
            "n_routed_experts": 256,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "qk_nope_head_dim": 128,
            "n_group": 8,
            "topk_group": 4,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 3,
            "tie_word_embeddings": False,
        },
    ),
    "qwen3-235b-a22b": (
        "Qwen3MoeConfig",
        {
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "moe_intermediate_size": 1536,
            "num_hidden_layers": 94,
            "num_attention_heads": 64,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "tie_word_embeddings": False,
        },
    ),
    "gpt-oss-120b": ("GptOssConfig", {}),  # its defaults are the 120b model
    "gemma3-27b": (
        "Gemma3TextConfig",
        {
            "vocab_size": 262208,
            "hidden_size": 5376,
            "intermediate_size": 21504,
            "num_hidden_layers": 62,
            "num_attention_heads": 32,
            "num_key_value_heads": 16,
            "head_dim": 128,
            "query_pre_attn_scalar": 168,
        },
    ),
    "qwen3-next-80b-a3b": (
        "Qwen3NextConfig",
        {
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 5120,
            "num_hidden_layers": 48,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "num_experts": 512,
            "num_experts_per_tok": 10,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "tie_word_embeddings": False,
        },
    ),
}


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_count_matches_transformers_on_meta(name: str) -> None:
    transformers = pytest.importorskip("transformers")
    cls, fields = HF_CONFIGS[name]
    hf_cfg = getattr(transformers, cls)(**fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    pc = count_params(preset(name))
    assert _state_numel(model) == pc.total
    assert sum(p.numel() for p in model.parameters()) == pc.trainable


@pytest.mark.parametrize("name", list(PRESETS))
def test_breakdown_adds_up(name: str) -> None:
    pc = count_params(preset(name))
    assert set(pc.breakdown) == set(pc.active_breakdown) == set(COMPONENTS)
    assert sum(pc.breakdown.values()) == pc.total
    assert all(0 <= pc.active_breakdown[k] <= pc.breakdown[k] for k in COMPONENTS)
    routed_out = pc.breakdown["experts"] - pc.active_breakdown["experts"]
    assert pc.total - pc.active == routed_out


def test_breakdown_components() -> None:
    llama = count_params(preset("llama3-8b")).breakdown
    assert llama["embedding"] == llama["lm_head"] == 128256 * 4096
    assert llama["norms"] == (2 * 32 + 1) * 4096
    assert llama["attention"] == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024)
    assert llama["ffn"] == 32 * 3 * 4096 * 14336
    tied = count_params(preset("smollm2-135m")).breakdown
    assert tied["lm_head"] == 0
    ds = count_params(preset("deepseek-v3"))
    assert ds.frozen == 58 * 256  # the selection bias of each MoE layer
    assert ds.breakdown["ffn"] == 3 * 3 * 7168 * 18432  # the three dense layers
    assert ds.breakdown["shared_expert"] == 58 * 3 * 7168 * 2048


# --- KV cache ---


def test_kv_per_token_llama3_mha_vs_gqa() -> None:
    gqa = preset("llama3-8b")
    mha = gqa.replace(n_kv_heads=32)
    assert kv_cache_bytes_per_token(mha) == 512 * KIB
    assert kv_cache_bytes_per_token(gqa) == 128 * KIB
    assert kv_cache_bytes(mha, 128 * 1024) == 64 * GIB  # one 128k-token sequence
    assert kv_cache_bytes_per_token(gqa, dtype_bytes=4) == 256 * KIB


def test_kv_per_token_mla() -> None:
    ds = preset("deepseek-v3")
    assert kv_cache_bytes_per_token(ds) == 61 * (512 + 64) * 2 == 70_272
    assert kv_cache_bytes(ds, 128 * 1024) == 128 * 1024 * 70_272  # ≈ 8.6 GiB


def test_kv_sliding_window_olmo3() -> None:
    olmo = preset("olmo3-32b")
    full = olmo.replace(layer_types=None, sliding_window=None)
    assert kv_cache_bytes(full, 65536) == 16 * GIB
    assert kv_cache_bytes(olmo, 65536) == int(
        4.75 * GIB
    )  # 16 global + 48 capped layers
    assert kv_cache_bytes(olmo, 4096) == kv_cache_bytes(
        full, 4096
    )  # windows not yet full


def test_kv_mistral_stops_growing_at_its_window() -> None:
    mistral = preset("mistral-7b")
    assert kv_cache_bytes(mistral, 32768) == kv_cache_bytes(mistral, 4096)
    assert kv_cache_bytes(mistral, 4096) == 4096 * kv_cache_bytes_per_token(mistral)
    assert kv_cache_bytes(mistral, 10, batch=3) == 3 * kv_cache_bytes(mistral, 10)


def test_kv_linear_layers_hold_a_fixed_state() -> None:
    nxt = preset("qwen3-next-80b-a3b")
    state = (
        32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * 2
    )  # fp32 memory + conv tail
    attention = 12 * 2 * 2 * 256 * 2  # 12 full layers, 2 KV heads of width 256, bf16
    assert kv_cache_bytes_per_token(nxt) == attention
    for tokens in (0, 1, 1000):
        assert kv_cache_bytes(nxt, tokens) == 36 * state + tokens * attention
    half = 36 * (32 * 128 * 128 * 2 + (2 * 16 * 128 + 32 * 128) * 3 * 2)
    assert kv_cache_bytes(nxt, 0, state_dtype_bytes=2) == half


def test_kv_matches_companion_decode_cache() -> None:
    cfg = ModelConfig(
        vocab_size=32,
        d_model=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        position="rope",
        sliding_window=4,
        layer_types=("sliding", "full", "sliding"),
    )
    model = DecoderLM(cfg)
    for tokens in (3, 16):
        cache = model.new_cache(1, tokens, dtype=torch.bfloat16)
        stored = sum(b.numel() * b.element_size() for b in cache.state_dict().values())
        assert stored == kv_cache_bytes(cfg, tokens)


# --- FLOPs ---


def test_flops_llama3() -> None:
    cfg = preset("llama3-8b")
    pc = count_params(cfg)
    matrices = pc.total - pc.breakdown["embedding"] - pc.breakdown["norms"]
    assert flops_per_token(cfg, 0) == 2 * matrices
    per_key = 4 * 32 * 32 * 128  # 4·L·H·D
    assert flops_per_token(cfg, 8192) - flops_per_token(cfg, 0) == 8192 * per_key


def test_flops_moe_use_active_weights_and_windows_cap() -> None:
    qwen = preset("qwen3-235b-a22b")
    pc = count_params(qwen)
    no_matmul = (
        pc.breakdown["embedding"] + pc.breakdown["norms"] + 94 * 2 * 128
    )  # + QK-norms
    assert flops_per_token(qwen, 0) == 2 * (pc.active - no_matmul)
    mistral = preset("mistral-7b")
    assert flops_per_token(mistral, 100_000) == flops_per_token(mistral, 4096)
    # a tied head still costs its matmul
    smol = preset("smollm2-135m")
    assert flops_per_token(smol, 0) > 2 * count_params(smol).active_without_embeddings


def test_flops_match_torch_flop_counter() -> None:
    cfg = tiny(
        vocab_size=50,
        d_ff=48,
        tie_embeddings=False,
        attn_impl="reference",
        max_seq_len=256,
        activation="gelu",
    )
    model = DecoderLM(cfg).eval()
    t = 8
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.zeros(1, t, dtype=torch.long))
    # the counter charges every query all T keys (it ignores the causal mask)
    assert counter.get_total_flops() == t * flops_per_token(cfg, t)


# --- presets and errors ---


def test_preset_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="llama3-8b"):
        preset("llama-9000")


def test_presets_layer_patterns() -> None:
    assert preset("gemma3-27b").layer_types.count("full") == 10  # every 6th of 62
    assert preset("olmo3-32b").layer_types[-1] == "full"  # final layer is global
    assert preset("gpt-oss-120b").layer_types[:2] == ("sliding", "full")
    assert preset("qwen3-next-80b-a3b").layer_types.count("linear") == 36
    assert all(c.attn_impl == "sdpa" for c in PRESETS.values())


def test_spec_rows() -> None:
    assert spec_row(preset("llama3-8b")) == {
        "norm": "RMSNorm, pre",
        "position": "RoPE, b=5e5",
        "ffn": "SwiGLU, d_ff 14336",
        "attention": "GQA 32:8",
        "vocab": "128,256",
        "context": "8,192",
    }
    assert spec_row(preset("olmo3-32b"))["attention"] == "GQA 40:8, SWA 4096 at 3:1"
    assert spec_row(preset("gemma3-27b"))["attention"] == "GQA 32:16, SWA 1024 at 5:1"
    assert spec_row(preset("deepseek-v3"))["ffn"] == "MoE 256+1, top-8, SwiGLU 2048"
    assert spec_row(preset("qwen3-next-80b-a3b"))["attention"].startswith(
        "Gated DeltaNet"
    )
    assert spec_row(preset("gpt2"))["position"] == "learned absolute"
    assert (
        spec_row(preset("gpt-oss-120b"))["ffn"] == "MoE 128, top-4, clamped SwiGLU 2880"
    )
    assert spec_row(preset("deepseek-v4-flash"))["norm"] == "RMSNorm, pre; 4 streams (mHC)"
    assert spec_row(preset("gpt2"))["ffn"] == "GELU MLP, d_ff 3072"
    assert spec_row(tiny(ffn="mlp", activation="relu"))["ffn"] == "ReLU MLP, d_ff 128"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: kv_cache_bytes(c, -1), "tokens"),
        (lambda c: kv_cache_bytes(c, 1.5), "tokens"),
        (lambda c: kv_cache_bytes(c, 8, batch=0), "batch"),
        (lambda c: kv_cache_bytes(c, 8, state_dtype_bytes=0), "state_dtype_bytes"),
        (lambda c: kv_cache_bytes_per_token(c, dtype_bytes=0), "dtype_bytes"),
        (lambda c: kv_cache_bytes_per_token(c, dtype_bytes=True), "dtype_bytes"),
        (lambda c: flops_per_token(c, -5), "context"),
    ],
    ids=[
        "neg-tokens",
        "float-tokens",
        "batch",
        "state-bytes",
        "dtype-bytes",
        "bool",
        "context",
    ],
)
def test_bad_input_is_named(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(preset("smollm2-135m"))


def test_not_a_config() -> None:
    with pytest.raises(TypeError, match="ModelConfig"):
        count_params({"vocab_size": 10})


# --- 2026 layer kinds: Kimi Delta Attention, gated MLA, DeepSeek Sparse Attention ---


def _new_kinds() -> dict[str, ModelConfig]:
    from companion.models.config_parts import (
        LinearAttentionConfig,
        MLAConfig,
        MoEConfig,
        SparseConfig,
    )

    moe = MoEConfig(8, 2, 16, dense_layers=1, shared_d_ff=16, router="sigmoid")
    mla = MLAConfig(16, 8, 8, 12, q_lora_rank=24)
    base = dict(vocab_size=64, d_model=48, n_layers=4, n_heads=4, d_ff=80, ffn="glu")
    base |= dict(norm="rmsnorm", position="rope", moe=moe, bias=False)
    kda = dict(key_heads=3, value_heads=3, key_dim=8, value_dim=8, kind="kda")
    hybrid = dict(layer_types=("linear", "full") * 2)
    return {
        "kimi": ModelConfig(
            **base, **hybrid, mla=mla, linear=LinearAttentionConfig(**kda)
        ),
        "bailing": ModelConfig(
            **base,
            **hybrid,
            mla=mla.replace(output_gate=True),
            linear=LinearAttentionConfig(
                **kda, kda_layout="bailing", kda_gate_lower_bound=-5.0
            ),
        ),
        "glm-5": ModelConfig(
            **base,
            mla=mla.replace(
                indexer=SparseConfig(3, 16, 5, layers=("full", "shared") * 2)
            ),
        ),
    }


@pytest.mark.parametrize("name", ["kimi", "bailing", "glm-5"])
def test_new_layer_kinds_count_and_cache_as_built(name: str) -> None:
    cfg = _new_kinds()[name]
    with torch.device("meta"):
        model = DecoderLM(cfg)
    pc = count_params(cfg)
    assert _state_numel(model) == pc.total
    assert sum(p.numel() for p in model.parameters()) == pc.trainable
    model = DecoderLM(cfg)
    for tokens in (3, 16):
        cache = model.new_cache(1, tokens, dtype=torch.bfloat16)
        stored = sum(b.numel() * b.element_size() for b in cache.state_dict().values())
        assert stored == kv_cache_bytes(cfg, tokens)


def test_sparse_layers_attend_to_topk_keys_and_index_every_one() -> None:
    cfg = _new_kinds()["glm-5"]
    index = 2 * (2 * 3 * 16)  # two layers with an indexer of their own: 2·H_I·D_I
    attend = 4 * (2 * 4 * (16 + 12))  # four layers, H = 4: 2·H·(D_qk + D_v)
    # below top-k a key costs attention and indexing; past it, indexing only
    assert flops_per_token(cfg, 5) - flops_per_token(cfg, 4) == attend + index
    assert flops_per_token(cfg, 105) - flops_per_token(cfg, 5) == 100 * index


NEW_HF_CONFIGS = {  # transformers' defaults: the released models' shapes
    "kimi-linear-48b": ("KimiLinearConfig", {}),
    "ling-3.0-flash": ("BailingHybridConfig", {}),
    "deepseek-v3.2": ("DeepseekV32Config", {}),
    "glm-5": ("GlmMoeDsaConfig", {}),
}


@pytest.mark.parametrize("name", list(NEW_HF_CONFIGS))
def test_new_families_count_matches_transformers_on_meta(name: str) -> None:
    transformers = pytest.importorskip("transformers")
    from companion.checkpoints.transformers_config import config_from_hf

    cls, fields = NEW_HF_CONFIGS[name]
    hf_cfg = getattr(transformers, cls)(**fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    pc = count_params(config_from_hf(hf_cfg))
    assert _state_numel(model) == pc.total
    assert sum(p.numel() for p in model.parameters()) == pc.trainable


# --- DeepSeek-V4: compressed attention, hyper-connections, hash-routed experts ---


def _v4() -> ModelConfig:
    from companion.models.config_parts import MoEConfig
    from companion.models.config_streams import (
        CompressedAttentionConfig,
        HyperConnectionConfig,
    )

    return ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=4,
        n_heads=4,
        head_dim=16,
        norm="rmsnorm",
        position="rope",
        partial_rotary_factor=0.5,
        sliding_window=6,
        layer_types=("hca", "sliding", "csa", "hca"),
        attn_sinks=True,
        bias=False,
        ffn="glu",
        max_seq_len=64,
        compression=CompressedAttentionConfig(24, 2, 8, 4, 12, 3, hca_ratio=8),
        residual=HyperConnectionConfig(3),
        moe=MoEConfig(
            6,
            2,
            16,
            shared_d_ff=16,
            router="sqrtsoftplus",
            router_selection_bias=True,
            hash_layers=2,
            swiglu_limit=1.0,
        ),
    )


def test_v4_count_and_cache_as_built() -> None:
    cfg = _v4()
    with torch.device("meta"):
        model = DecoderLM(cfg)
    pc = count_params(cfg)
    assert _state_numel(model) == pc.total
    assert sum(p.numel() for p in model.parameters()) == pc.trainable
    assert pc.breakdown["residual"] > 0 and pc.active < pc.total
    model = DecoderLM(cfg)
    for tokens in (3, 16, 40):  # below the window, past a block, past many
        cache = model.new_cache(1, tokens, dtype=torch.bfloat16)
        stored = sum(b.numel() * b.element_size() for b in cache.state_dict().values())
        assert stored == kv_cache_bytes(cfg, tokens)
    # past the window a token adds no key, only its share of the pooled entries
    window = 4 * 16 * 2  # one key of D per layer, 2 bytes each
    grow = kv_cache_bytes(cfg, 6 + 800) - kv_cache_bytes(cfg, 6)
    assert grow == 800 * (kv_cache_bytes_per_token(cfg) - window)


def test_v4_flops_window_and_selected_entries() -> None:
    cfg = _v4()
    per_key = 4 * 4 * 16  # 4·H·D for a key read (scores and values, K = V)
    index = 2 * 4 * 12  # 2·H_I·c for an entry CSA's indexer scores
    # inside the window every layer reads one more key per token
    assert flops_per_token(cfg, 5) - flops_per_token(cfg, 4) == 4 * per_key
    # past it: CSA's 4th entry is scored but not read (top 3), HCA's 2nd is read
    assert flops_per_token(cfg, 12) - flops_per_token(cfg, 8) == per_key + index
    assert flops_per_token(cfg, 16) - flops_per_token(cfg, 12) == 2 * per_key + index
    # far past it: HCA reads every entry (one per 8), CSA the best 3 of them all scored
    far, farther = flops_per_token(cfg, 800), flops_per_token(cfg, 1600)
    assert farther - far == 2 * 100 * per_key + 200 * index


def test_v4_count_matches_transformers_on_meta() -> None:
    transformers = pytest.importorskip("transformers")
    from companion.checkpoints.transformers_config import config_from_hf

    hf_cfg = transformers.DeepseekV4Config(num_hidden_layers=4, vocab_size=1000)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    pc = count_params(config_from_hf(hf_cfg))
    assert _state_numel(model) == pc.total
    assert sum(p.numel() for p in model.parameters()) == pc.trainable

"""Real model configurations, as :class:`~companion.models.config.ModelConfig` presets
(chapter 13).

Each preset copies the released ``config.json`` of a model (hidden size, heads, KV
heads, head width, FFN and expert widths, vocabulary, layers, windows and layer pattern,
RoPE base and scaling, tied embeddings, biases), so that
:func:`companion.analysis.calculator.count_params` gives the published parameter count
and a ``DecoderLM`` built from it on the meta device has the shapes of the real
checkpoint. ``max_seq_len`` is the config's ``max_position_embeddings``. Text towers
only: Gemma 3's vision encoder and DeepSeek-V3's multi-token-prediction module are left
out. :func:`spec_row` writes a preset as one row of the chapter's spec sheet.
"""

from __future__ import annotations

import math

from companion.models.config import (
    LinearAttentionConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
)
from companion.ops.rope import RopeScaling

__all__ = [
    "GLU_NAMES",
    "PRESETS",
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


_DEEPSEEK_YARN = RopeScaling(
    "yarn",
    factor=40.0,
    original_max_position_embeddings=4096,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=1.0,
)

PRESETS: dict[str, ModelConfig] = {
    "gpt2": _gpt2(d_model=768, n_layers=12, n_heads=12),
    "gpt2-xl": _gpt2(d_model=1600, n_layers=48, n_heads=25),
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


GLU_NAMES = {"silu": "SwiGLU", "gelu": "GeGLU", "gelu_tanh": "GeGLU", "relu": "ReGLU"}
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
    position = {
        "sinusoidal": "sinusoidal, additive",
        "learned": "learned absolute",
    }.get(cfg.position, "none")
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
    act = cfg.activation.split("_")[0].upper()
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
    else:
        sharing = head_sharing(h, h_kv)
        attention = f"MHA {h}" if sharing == "MHA" else f"{sharing} {h}:{h_kv}"
    if cfg.attn_output_gate:
        attention = "gated " + attention
    unit = _period(cfg.layer_types)
    if "sliding" in unit:
        attention += f", SWA {cfg.sliding_window}"
        if "full" in unit:
            attention += f" at {unit.count('sliding')}:{unit.count('full')}"
    if "linear" in unit:
        attention = (
            f"Gated DeltaNet : {attention}, {unit.count('linear')}:{unit.count('full')}"
        )
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

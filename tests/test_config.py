"""ModelConfig validates itself and names the field in every error."""

import pytest

from companion.models.config import ModelConfig
from companion.models.config_parts import LinearAttentionConfig, MLAConfig, MoEConfig
from companion.models.presets import PRESETS, preset
from companion.models.validation import ConfigError
from companion.ops.rope import RopeScaling

BAD = [
    pytest.param(
        {"vocab_size": 0}, "vocab_size must be a positive integer", id="vocab-zero"
    ),
    pytest.param(
        {"vocab_size": 3.5}, "vocab_size must be a positive integer", id="vocab-float"
    ),
    pytest.param(
        {"d_model": -8}, "d_model must be a positive integer", id="d-negative"
    ),
    pytest.param(
        {"n_layers": True}, "n_layers must be a positive integer", id="layers-bool"
    ),
    pytest.param(
        {"d_model": 100, "n_heads": 3},
        r"d_model \(100\) must be divisible by n_heads \(3\)",
        id="heads-divide",
    ),
    pytest.param({"d_ff": 0}, "d_ff must be a positive integer", id="dff-zero"),
    pytest.param(
        {"max_seq_len": 0}, "max_seq_len must be a positive integer", id="context-zero"
    ),
    pytest.param(
        {"dropout": 1.0}, r"dropout must be a probability in \[0, 1\)", id="dropout-one"
    ),
    pytest.param(
        {"attn_dropout": -0.1},
        "attn_dropout must be a probability",
        id="attn-dropout-neg",
    ),
    pytest.param(
        {"norm": "rmsnorm2"},
        r"norm must be one of \('layernorm', 'rmsnorm'\), got 'rmsnorm2'",
        id="norm-unknown",
    ),
    pytest.param(
        {"norm_placement": "middle"},
        r"norm_placement must be one of \('pre', 'post', 'sandwich', 'post_branch'\)",
        id="placement",
    ),
    pytest.param(
        {"activation": "swish"},
        r"activation must be one of \('relu', 'gelu', 'gelu_tanh', 'silu', 'relu2'\)",
        id="activation",
    ),
    pytest.param(
        {"position": "xpos"},
        r"position must be one of \('sinusoidal', 'learned', 'rope', 'none', 'alibi'\)",
        id="position",
    ),
    pytest.param(
        {"attn_impl": "flash"},
        r"attn_impl must be one of \('reference', 'sdpa', 'tiled', 'flex', 'triton'\)",
        id="impl",
    ),
    pytest.param({"fused_qkv": 1}, "fused_qkv must be True or False", id="fused-int"),
    pytest.param(
        {"norm_eps": 0}, "norm_eps must be a finite number > 0", id="eps-zero"
    ),
    pytest.param(
        {"init_std": -1.0}, "init_std must be a finite number > 0", id="init-std"
    ),
    pytest.param({"ffn": "moe"}, r"ffn must be one of \('mlp', 'glu'\)", id="ffn"),
    pytest.param(
        {"qk_norm": "layer"},
        r"qk_norm must be one of \('none', 'head', 'full'\)",
        id="qk-norm",
    ),
    pytest.param(
        {"n_heads": 4, "n_kv_heads": 3},
        r"n_heads \(4\) must be a multiple of n_kv_heads \(3\)",
        id="gqa-groups",
    ),
    pytest.param(
        {"n_kv_heads": 0}, "n_kv_heads must be a positive integer", id="kv-heads-zero"
    ),
    pytest.param(
        {"n_layers": 2, "layer_types": ("full",)},
        "layer_types has 1 entries but n_layers is 2",
        id="layer-types-len",
    ),
    pytest.param(
        {"n_layers": 2, "layer_types": ("full", "local"), "sliding_window": 4},
        r"layer_types entries must be one of \('full', 'sliding', 'linear', 'csa', "
        r"'hca'\)",
        id="layer-types-value",
    ),
    pytest.param(
        {"n_layers": 2, "layer_types": ("full", "sliding")},
        "sliding_window is None",
        id="sliding-no-window",
    ),
    pytest.param(
        {"sliding_window": 0},
        "sliding_window must be a positive integer",
        id="window-zero",
    ),
    pytest.param(
        {"n_layers": 2, "nope_layers": (2,)},
        r"nope_layers must be layer indices in \[0, 2\)",
        id="nope-index",
    ),
    pytest.param(
        {"position": "rope", "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        r"rope_scaling must be a RopeScaling or None, got dict .*RopeScaling\('linear'",
        id="rope-dict",
    ),
    pytest.param(
        {"n_layers": 2, "layer_types": ["full"] * 2},
        "layer_types must be a tuple",
        id="list",
    ),
    pytest.param(
        {"position": "rope", "mla": MLAConfig(8, 8, 4, 8), "head_dim": 4},
        r"head_dim under multi-head latent attention is .* = 12 \(or None\), got 4",
        id="mla-head-dim",
    ),
    pytest.param(
        {"position": "rope", "d_model": 12, "n_heads": 2, "partial_rotary_factor": 0.5},
        "rope settings: .* must be even",
        id="rope-odd",
    ),
    pytest.param(
        {"qkv_bias": 1}, "qkv_bias must be None, True or False", id="qkv-bias"
    ),
    pytest.param({"head_dim": 0}, "head_dim must be a positive integer", id="head-dim"),
    pytest.param(
        {"linear": LinearAttentionConfig(1, 1, 4, 4, rule="delta")},
        "linear has no effect: layer_types has no 'linear' layer",
        id="linear-unused",
    ),
    pytest.param(
        {"n_layers": 2, "layer_types": ("linear", "full")},
        r"layer_types has 'linear' layers: set linear=LinearAttentionConfig",
        id="linear-layers-without-group",
    ),
    pytest.param(
        {"moe": {"n_experts": 4, "experts_per_token": 2}},
        "moe must be a MoEConfig or None, got dict",
        id="moe-dict",
    ),
    *[
        pytest.param(
            {"position": "rope", name: value},
            f"{name} must be a finite number > 0, got {value}",
            id=f"{name}-{value}",
        )
        for name in ("rope_theta", "attn_scale", "norm_eps", "init_std")
        for value in (float("nan"), float("inf"), -1e4)
    ],
    pytest.param(
        {"position": "rope", "rope_local_theta": float("nan")},
        "rope_local_theta must be a finite number > 0",
        id="local-theta-nan",
    ),
    pytest.param(
        {"norm_offset": float("nan")},
        "norm_offset must be a finite number, got nan",
        id="norm-offset-nan",
    ),
    pytest.param(
        {"position": "rope", "partial_rotary_factor": 1.5},
        r"partial_rotary_factor must be in \(0, 1\]",
        id="partial-rotary-above-one",
    ),
    pytest.param(
        {"sliding_window": 4, "layer_types": ("full", "full")},
        "sliding_window=4 has no effect: layer_types has no 'sliding' layer",
        id="window-unused",
    ),
    pytest.param(
        {"moe": MoEConfig(4, 2, dense_layers=2)},
        "moe.dense_layers=2 leaves no MoE layer in n_layers=2",
        id="dense-layers-past-depth",
    ),
    pytest.param(
        {"rope_scaling": RopeScaling("linear", factor=2.0)},
        "rope_scaling has no effect with position='learned'",
        id="scaling-without-rope",
    ),
    pytest.param(
        {"nope_layers": (0,)},
        "nope_layers has no effect with position='learned'",
        id="nope-without-rope",
    ),
    pytest.param(
        {"position": "rope", "mla": MLAConfig(8, 8, 3, 8)},
        "from qk_rope_head_dim=3",
        id="mla-rope-width",
    ),
]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rope_type": "linear", "factor": -2.0}, "factor must be a finite number > 0"),
        ({"rope_type": "linear", "factor": float("nan")}, "factor must be a finite"),
        ({"rope_type": "linear"}, "rope_type 'linear' needs a positive factor"),
        ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 0}, "beta_fast must be"),
        ({"rope_type": "yarn", "factor": 4.0, "mscale": -1.0}, "mscale must be"),
        ({"rope_type": "ntk"}, "rope_type must be one of"),
    ],
)
def test_bad_rope_scaling_is_rejected(changes, message):
    with pytest.raises(ValueError, match=message):
        RopeScaling(**changes)
    with pytest.raises(ValueError, match="unknown RoPE scaling key"):
        RopeScaling.from_mapping({"rope_type": "linear", "factr": 2.0})


@pytest.mark.parametrize(("changes", "message"), BAD)
def test_bad_values_are_rejected_with_the_field_named(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{"vocab_size": 10, **changes})


def test_modern_derived_values():
    cfg = ModelConfig(
        vocab_size=10,
        d_model=64,
        n_heads=8,
        n_kv_heads=2,
        head_dim=32,
        bias=False,
        qkv_bias=True,
    )
    assert (cfg.head_dim, cfg.n_kv_heads, cfg.qkv_bias) == (32, 2, True)
    assert (
        ModelConfig(vocab_size=10, n_layers=3, sliding_window=8).layer_types
        == ("sliding",) * 3
    )
    assert ModelConfig(vocab_size=10, n_layers=2).layer_types == ("full", "full")


def test_defaults_and_derived_values():
    cfg = ModelConfig(vocab_size=10, d_model=64, n_heads=4, moe=MoEConfig(4, 1))
    assert (cfg.head_dim, cfg.d_ff, cfg.moe.expert_d_ff, cfg.n_kv_heads) == (
        16,
        256,
        256,
        4,
    )
    assert cfg.replace(d_ff=100).d_ff == 100
    assert (
        cfg.replace(d_ff=100).moe.expert_d_ff == 100
    )  # a field left None follows its source
    wider = cfg.replace(d_model=128, n_heads=8)
    assert (wider.head_dim, wider.d_ff, wider.n_kv_heads) == (16, 512, 8)
    assert wider.replace(n_layers=3, sliding_window=4).layer_types == ("sliding",) * 3
    assert cfg.settings()["d_ff"] is None and ModelConfig(**cfg.settings()) == cfg
    pinned = ModelConfig(vocab_size=10, d_model=64, n_heads=4, d_ff=256, n_kv_heads=4)
    assert pinned == cfg.replace(moe=None)  # equal values, equal configs
    assert (
        pinned.replace(d_model=128, n_heads=8).d_ff == 256
    )  # a value the user set stays
    assert pinned.replace(d_model=128, n_heads=8).n_kv_heads == 4


def test_configs_hash_and_mla_derives_its_head_width():
    assert len(
        {preset(name) for name in PRESETS} | {preset(name) for name in PRESETS}
    ) == len(PRESETS)
    deepseek = preset("deepseek-v3")
    assert deepseek.rope_dim == deepseek.mla.qk_rope_head_dim
    assert deepseek.head_dim == 128 + 64  # released qk_nope_head_dim + qk_rope_head_dim
    assert hash(deepseek.replace(rope_scaling=RopeScaling("linear", 2.0))) != hash(
        deepseek
    )


def test_replace_validates_and_rejects_unknown_fields():
    cfg = ModelConfig(vocab_size=10)
    with pytest.raises(ConfigError, match=r"unknown config field\(s\) \['n_head'\]"):
        cfg.replace(n_head=4)
    with pytest.raises(ConfigError, match="n_heads"):
        cfg.replace(n_heads=7)


def test_config_is_immutable():
    cfg = ModelConfig(vocab_size=10)
    with pytest.raises(AttributeError):
        cfg.d_model = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: MoEConfig(0, 1), "moe.n_experts must be a positive integer, got 0"),
        (
            lambda: MoEConfig(8, 3, router_groups=4, router_topk_groups=1),
            r"moe.experts_per_token <= moe.router_topk_groups \* n_experts / "
            r"moe.router_groups",
        ),
        (
            lambda: MoEConfig(8, 2, router_groups=3),
            "moe.router_groups must divide n_experts=8, got 3",
        ),
        (
            lambda: MoEConfig(4, 5),
            r"moe.experts_per_token must be in \[1, n_experts=4\]",
        ),
        (lambda: MoEConfig(4, 2, router="relu"), r"moe.router must be one of \("),
        (
            lambda: MoEConfig(4, 2, router_scale=float("nan")),
            "moe.router_scale must be",
        ),
        (lambda: MoEConfig(4, 2, shared_expert_gate=True), "needs a shared expert"),
        (
            lambda: MoEConfig(4, 2, router_bias=1),
            "moe.router_bias must be True or False",
        ),
        (lambda: MLAConfig(0, 8, 4, 8), "mla.kv_lora_rank must be a positive integer"),
        (lambda: MLAConfig(8, 8, 4, 8, q_lora_rank=2.0), "mla.q_lora_rank must be"),
        (lambda: MLAConfig(8, 8, 4, 8, form="fused"), r"mla.form must be one of"),
        (
            lambda: LinearAttentionConfig(2, 3, 4, 4),
            r"must be a multiple of linear.key",
        ),
        (
            lambda: LinearAttentionConfig(1, 1, 4, 4, rule="mamba"),
            "linear.rule must be",
        ),
        (
            lambda: MoEConfig(4, 2).replace(top_k=1),
            r"unknown moe field\(s\) \['top_k'\]",
        ),
    ],
)
def test_each_group_checks_its_fields_and_names_them(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_a_2017_config_mentions_nothing_from_2026_and_repr_shows_what_differs():
    assert repr(ModelConfig(vocab_size=10)) == "ModelConfig(vocab_size=10)"
    cfg = ModelConfig(vocab_size=10, n_layers=3, moe=MoEConfig(8, 2, dense_layers=1))
    # derived fields (d_ff, head_dim, the expert width) stay out of the repr
    assert repr(cfg) == (
        "ModelConfig(vocab_size=10, n_layers=3, "
        "moe=MoEConfig(n_experts=8, experts_per_token=2, dense_layers=1))"
    )
    assert eval(repr(cfg)) == cfg  # noqa: S307 - the repr is valid Python for the same config
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert all(getattr(preset("gpt2"), g) is None for g in ("moe", "mla", "linear"))


def _sparse_mla(**indexer: object) -> MLAConfig:
    from companion.models.config_parts import SparseConfig

    return MLAConfig(
        16,
        8,
        8,
        8,
        q_lora_rank=16,
        indexer=SparseConfig(**{"n_heads": 2, "head_dim": 16, "topk": 4, **indexer}),
    )


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: LinearAttentionConfig(2, 2, 4, 4, kind="mamba"),
            r"linear.kind must be one of \('gated_deltanet', 'kda'\)",
        ),
        (
            lambda: LinearAttentionConfig(2, 4, 4, 4, kind="kda"),
            "kind='kda' needs linear.value_heads == linear.key_heads",
        ),
        (
            lambda: LinearAttentionConfig(2, 2, 4, 4, kda_gate_lower_bound=-5.0),
            "linear.kda_gate_lower_bound has no effect unless linear.kind == 'kda'",
        ),
        (
            lambda: LinearAttentionConfig(
                2, 2, 4, 4, kind="kda", kda_gate_lower_bound=1
            ),
            "linear.kda_gate_lower_bound must be None or a finite number < 0",
        ),
        (
            lambda: LinearAttentionConfig(2, 2, 4, 4, kind="kda", kda_layout="qwen"),
            "linear.kda_layout must be one of",
        ),
        (
            lambda: MLAConfig(8, 8, 4, 8, latent_norm_eps=0.0),
            "mla.latent_norm_eps must be None or a finite number > 0",
        ),
        (lambda: MLAConfig(8, 8, 4, 8, output_gate=1), "mla.output_gate must be True"),
        (
            lambda: ModelConfig(
                vocab_size=8,
                position="rope",
                mla=MLAConfig(8, 8, 4, 8, indexer=_sparse_mla().indexer),
            ),
            "mla.indexer reads the query latent: set mla.q_lora_rank > 0",
        ),
        (lambda: _sparse_mla(topk=0), "mla.indexer.topk must be a positive integer"),
        (
            lambda: ModelConfig(
                vocab_size=8, position="rope", mla=_sparse_mla(layers=("full", "all"))
            ),
            r"mla.indexer.layers entries must be one of \('full', 'shared'\)",
        ),
        (
            lambda: ModelConfig(
                vocab_size=8,
                position="rope",
                n_layers=3,
                mla=_sparse_mla(layers=("full",)),
            ),
            "mla.indexer.layers has 1 entries but n_layers is 3",
        ),
        (
            lambda: ModelConfig(
                vocab_size=8,
                position="rope",
                n_layers=2,
                mla=_sparse_mla(layers=("shared", "full")),
            ),
            r"the first attention layer \(0\) must be 'full'",
        ),
        (
            lambda: ModelConfig(vocab_size=8, position="learned", mla=_sparse_mla()),
            r"needs position='rope' \(or 'none'",
        ),
    ],
)
def test_kda_and_sparse_fields_are_checked_and_named(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_kda_and_sparse_groups_build_and_show_only_what_differs():
    kda = LinearAttentionConfig(2, 2, 8, 8, kind="kda", kda_gate_lower_bound=-5.0)
    cfg = ModelConfig(
        vocab_size=8,
        position="none",
        layer_types=("linear", "full"),
        linear=kda,
        mla=MLAConfig(16, 8, 8, 8, output_gate=True),
    )
    assert "kind='kda'" in repr(cfg) and "output_gate=True" in repr(cfg)
    assert "indexer" not in repr(cfg) and "latent_norm_eps" not in repr(cfg)
    assert cfg.replace(n_layers=2) == cfg


# --- DeepSeek-V4: compression, residual, hash layers, the SwiGLU clamp ---


def _v4(**changes):
    from companion.models.config_streams import (
        CompressedAttentionConfig,
        HyperConnectionConfig,
    )

    base = dict(
        vocab_size=8,
        n_layers=3,
        head_dim=16,
        norm="rmsnorm",
        position="rope",
        partial_rotary_factor=0.5,
        sliding_window=4,
        layer_types=("sliding", "csa", "hca"),
        attn_sinks=True,
        compression=CompressedAttentionConfig(16, 2, 8, 2, 8, 3),
        residual=HyperConnectionConfig(2),
        moe=MoEConfig(4, 2, 8, router="sqrtsoftplus", hash_layers=1, swiglu_limit=5.0),
    )
    return ModelConfig(**(base | changes))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(compression=None), r"layer_types has \['csa', 'hca'\] layers: set comp"),
        (dict(layer_types=("full",) * 3), "compression makes every layer compressed"),
        (dict(sliding_window=None), "'sliding' layers but sliding_window is None"),
        (dict(attn_sinks=False), r"attn_sinks=False does not combine with compression"),
        (dict(n_kv_heads=2), r"n_kv_heads=2 does not combine with compression"),
        (dict(attn_impl="flex"), "attn_impl 'reference' or 'sdpa'"),
        (
            dict(norm_placement="post"),
            "residual .hyper-connections. replaces the residual add",
        ),
        (dict(moe=MoEConfig(4, 2, 8, hash_layers=4)), "moe.hash_layers=4 .* exceed"),
        (dict(partial_rotary_factor=1.0), r"compression.index_head_dim \(8\) must be"),
    ],
)
def test_v4_groups_are_checked_against_the_model(changes, message):
    with pytest.raises(ConfigError, match=message):
        _v4(**changes)


def test_v4_group_fields_are_named():
    from companion.models.config_streams import (
        CompressedAttentionConfig,
        HyperConnectionConfig,
    )

    with pytest.raises(ConfigError, match="compression.csa_ratio must be a positive"):
        CompressedAttentionConfig(16, 2, 8, 2, 8, 3, csa_ratio=0)
    with pytest.raises(ConfigError, match="residual.n_streams must be a positive"):
        HyperConnectionConfig(0)
    with pytest.raises(ConfigError, match="moe.hash_layers must be a non-negative"):
        MoEConfig(4, 2, hash_layers=-1)
    with pytest.raises(ConfigError, match="moe.swiglu_limit must be"):
        _v4(moe=MoEConfig(4, 2, 8, swiglu_limit=-1.0))
    with pytest.raises(ConfigError, match="moe.hash_layers take their experts"):
        _v4(
            moe=MoEConfig(4, 2, 8, hash_layers=1, router_groups=2, router_topk_groups=1)
        )


def test_v4_config_derives_one_kv_head_and_shows_only_what_differs():
    cfg = _v4()
    assert cfg.n_kv_heads == 1 and "n_kv_heads" not in repr(cfg)
    assert "HyperConnectionConfig(n_streams=2)" in repr(cfg)
    assert cfg.replace(n_layers=3) == cfg
    assert [cfg.is_hash_layer(i) for i in range(3)] == [True, False, False]
    assert "compression" not in repr(ModelConfig(vocab_size=8))

"""ModelConfig validates itself and names the field in every error."""

import pytest

from companion.models.config import ModelConfig
from companion.models.validation import ConfigError

BAD = [
    pytest.param({"vocab_size": 0}, "vocab_size must be a positive integer", id="vocab-zero"),
    pytest.param({"vocab_size": 3.5}, "vocab_size must be a positive integer", id="vocab-float"),
    pytest.param({"d_model": -8}, "d_model must be a positive integer", id="d-negative"),
    pytest.param({"n_layers": True}, "n_layers must be a positive integer", id="layers-bool"),
    pytest.param(
        {"d_model": 100, "n_heads": 3},
        r"d_model \(100\) must be divisible by n_heads \(3\)",
        id="heads-divide",
    ),
    pytest.param({"d_ff": 0}, "d_ff must be a positive integer", id="dff-zero"),
    pytest.param({"max_seq_len": 0}, "max_seq_len must be a positive integer", id="context-zero"),
    pytest.param({"dropout": 1.0}, r"dropout must be a probability in \[0, 1\)", id="dropout-one"),
    pytest.param(
        {"attn_dropout": -0.1}, "attn_dropout must be a probability", id="attn-dropout-neg"
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
        r"activation must be one of \('relu', 'gelu', 'gelu_tanh', 'silu'\)",
        id="activation",
    ),
    pytest.param(
        {"position": "alibi"},
        r"position must be one of \('sinusoidal', 'learned', 'rope', 'none'\)",
        id="position",
    ),
    pytest.param(
        {"attn_impl": "flash"},
        r"attn_impl must be one of \('reference', 'sdpa', 'tiled', 'flex'\)",
        id="impl",
    ),
    pytest.param({"fused_qkv": 1}, "fused_qkv must be True or False", id="fused-int"),
    pytest.param({"norm_eps": 0}, "norm_eps must be a positive number", id="eps-zero"),
    pytest.param({"init_std": -1.0}, "init_std must be a positive number", id="init-std"),
    pytest.param({"ffn": "moe"}, r"ffn must be one of \('mlp', 'glu'\)", id="ffn"),
    pytest.param(
        {"qk_norm": "layer"}, r"qk_norm must be one of \('none', 'head', 'full'\)", id="qk-norm"
    ),
    pytest.param(
        {"n_heads": 4, "n_kv_heads": 3},
        r"n_heads \(4\) must be a multiple of n_kv_heads \(3\)",
        id="gqa-groups",
    ),
    pytest.param({"n_kv_heads": 0}, "n_kv_heads must be a positive integer", id="kv-heads-zero"),
    pytest.param(
        {"n_layers": 2, "layer_types": ("full",)},
        "layer_types has 1 entries but n_layers is 2",
        id="layer-types-len",
    ),
    pytest.param(
        {"n_layers": 2, "layer_types": ("full", "local"), "sliding_window": 4},
        r"layer_types entries must be one of \('full', 'sliding', 'linear'\)",
        id="layer-types-value",
    ),
    pytest.param(
        {"n_layers": 2, "layer_types": ("full", "sliding")},
        "sliding_window is None",
        id="sliding-no-window",
    ),
    pytest.param(
        {"sliding_window": 0}, "sliding_window must be a positive integer", id="window-zero"
    ),
    pytest.param(
        {"n_layers": 2, "nope_layers": (2,)},
        r"nope_layers must be layer indices in \[0, 2\)",
        id="nope-index",
    ),
    pytest.param(
        {"position": "rope", "rope_scaling": {"rope_type": "ntk"}},
        "rope settings: rope_type must be one of",
        id="rope-type",
    ),
    pytest.param(
        {"position": "rope", "d_model": 12, "n_heads": 2, "partial_rotary_factor": 0.5},
        "rope settings: .* must be even",
        id="rope-odd",
    ),
    pytest.param({"qkv_bias": 1}, "qkv_bias must be None, True or False", id="qkv-bias"),
    pytest.param({"head_size": 0}, "head_size must be a positive integer", id="head-size"),
]


@pytest.mark.parametrize(("changes", "message"), BAD)
def test_bad_values_are_rejected_with_the_field_named(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{"vocab_size": 10, **changes})


def test_modern_derived_values():
    cfg = ModelConfig(
        vocab_size=10, d_model=64, n_heads=8, n_kv_heads=2, head_size=32, bias=False, qkv_bias=True
    )
    assert (cfg.head_dim, cfg.kv_heads, cfg.attn_bias) == (32, 2, True)
    assert ModelConfig(vocab_size=10, n_layers=3, sliding_window=8).layer_kinds == ("sliding",) * 3
    assert ModelConfig(vocab_size=10, n_layers=2).layer_kinds == ("full", "full")


def test_defaults_and_derived_values():
    cfg = ModelConfig(vocab_size=10, d_model=64, n_heads=4)
    assert cfg.head_dim == 16
    assert cfg.ffn_dim == 256
    assert cfg.replace(d_ff=100).ffn_dim == 100
    assert cfg.d_ff is None  # derived values never overwrite the field


def test_replace_validates_and_rejects_unknown_fields():
    cfg = ModelConfig(vocab_size=10)
    with pytest.raises(ConfigError, match=r"unknown config field\(s\) \['n_head'\]"):
        cfg.replace(n_head=4)
    with pytest.raises(ConfigError, match="n_heads"):
        cfg.replace(n_heads=7)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ConfigError, match="unknown config field"):
        ModelConfig.from_dict({"vocab_size": 10, "hidden_size": 64})
    assert ModelConfig.from_dict({"vocab_size": 10}).vocab_size == 10


def test_config_is_immutable():
    cfg = ModelConfig(vocab_size=10)
    with pytest.raises(AttributeError):
        cfg.d_model = 3  # type: ignore[misc]

"""Bad input to the transformers converters: malformed checkpoint keys and values, configs
with missing or mistyped fields, objects that are not causal LMs, and weights that do
not fit their config each raise a ValueError/TypeError naming what is wrong and what is
allowed (never a KeyError, AttributeError, IndexError or int() error)."""

import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from companion.checkpoints.transformers import (  # noqa: E402
    convert_state_dict,
    from_hf,
    load_state_dict_strict,
)
from companion.checkpoints.transformers_config import config_from_hf  # noqa: E402
from companion.models.decoder import DecoderLM  # noqa: E402

TINY = dict(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
)


def _llama(cls=None, **changes):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**(TINY | changes))
    return (cls or transformers.LlamaForCausalLM)(cfg).eval()


def _with_state(hf, sd):
    """``hf`` whose ``state_dict()`` returns ``sd`` (a checkpoint that went wrong)."""
    hf.state_dict = lambda: sd
    return hf


def _stand_in(cfg, drop=(), **changes):
    """A plain object with the fields (and aliases) of a transformers config, less
    ``drop``, with ``changes``."""
    fields = cfg.to_dict()
    for alias, real in getattr(type(cfg), "attribute_map", {}).items():
        if real in fields:
            fields[alias] = fields[real]
    fields |= changes
    for name in drop:
        fields.pop(name)
    return types.SimpleNamespace(**fields)


# --- 1. malformed checkpoint keys and values ---------------------------------------

BAD_KEYS = {
    "index-not-int": (
        "model.layers.x.self_attn.q_proj.weight",
        r"'model.layers.x.self_attn.q_proj.weight' \(layer index 'x' is not an integer",
    ),
    "index-past-layers": (
        "model.layers.99.mlp.up_proj.weight",
        r"'model.layers.99.mlp.up_proj.weight' \(layer index 99 out of range: the "
        r"config has 2 layers, 0..1\)",
    ),
    "too-few-parts": (
        "model.layers.0.weight",
        r"'model.layers.0.weight' \(expected model.layers.<index>.<module>.<tensor>\)",
    ),
    "no-index": ("model.layers", r"'model.layers' \(expected model.layers.<index>"),
}


@pytest.mark.parametrize("name", list(BAD_KEYS))
def test_malformed_layer_keys_are_named(name):
    key, message = BAD_KEYS[name]
    hf = _llama()
    sd = dict(hf.state_dict()) | {key: torch.zeros(3)}
    with pytest.raises(ValueError, match=message):
        convert_state_dict(sd, config_from_hf(hf.config))
    with pytest.raises(ValueError, match=message):
        from_hf(_with_state(hf, sd))


def test_values_that_are_not_tensors_are_named():
    hf = _llama()
    cfg, good = config_from_hf(hf.config), dict(hf.state_dict())
    sd = good | {"model.norm.weight": [1.0] * 16}
    message = r"hf_sd must map str names to tensors; .*'model.norm.weight' \(list\)"
    with pytest.raises(TypeError, match=message):
        convert_state_dict(sd, cfg)
    with pytest.raises(TypeError, match=r"state_dict\(\) must map .*model.norm.weight"):
        from_hf(_with_state(hf, sd))
    with pytest.raises(TypeError, match=r"not a str name\): 3 \(Tensor\)"):
        convert_state_dict(good | {3: torch.zeros(1)}, cfg)
    with pytest.raises(TypeError, match="hf_sd must be a mapping .*, got list"):
        convert_state_dict(list(good.items()), cfg)
    model = DecoderLM(cfg)
    good = convert_state_dict(good, cfg)
    with pytest.raises(
        TypeError, match=r"sd must map .*'final_norm.weight' \(NoneType"
    ):
        load_state_dict_strict(model, good | {"final_norm.weight": None})
    with pytest.raises(TypeError, match="model must be an nn.Module, got dict"):
        load_state_dict_strict({}, good)


def test_q_k_v_that_cannot_be_fused_are_named():
    hf = _llama()
    sd = dict(hf.state_dict())
    sd["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(8, 7)
    with pytest.raises(
        ValueError,
        match=r"q, k and v must agree past their first dimension: "
        r"model.layers.1.self_attn.q_proj.weight \(16, 16\), "
        r"model.layers.1.self_attn.k_proj.weight \(8, 7\)",
    ):
        from_hf(_with_state(hf, sd))


def test_expert_tensors_of_the_wrong_rank_are_named_not_transposed():
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        **(TINY | dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8))
    )
    hf = transformers.GptOssForCausalLM(cfg).eval()
    sd = dict(hf.state_dict())
    sd["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(4, 16)
    with pytest.raises(
        ValueError,
        match=r"wrong shapes: \['blocks.0.ffn.experts.gate_up: expected \(4, 48, 16\), "
        r"got \(4, 16\)'\]",
    ):
        from_hf(_with_state(hf, sd))


# --- 2. incomplete or wrong-typed configs -------------------------------------------


def _hf_config(name):
    small = dict(num_hidden_layers=4)
    return {
        "llama": lambda: transformers.LlamaConfig(**TINY),
        "gemma3": lambda: transformers.Gemma3TextConfig(**TINY),
        "qwen3-moe": lambda: transformers.Qwen3MoeConfig(**small),
        "deepseek-v32": lambda: transformers.DeepseekV32Config(**small),
        "kimi-linear": lambda: transformers.KimiLinearConfig(**small),
        "deepseek-v4": lambda: transformers.DeepseekV4Config(**small),
    }[name]()


# (family, fields dropped, fields changed, what the message must say)
BAD_CONFIGS = {
    "no-hidden-size": (
        "llama",
        ["hidden_size"],
        {},
        r"LlamaForCausalLM: .*hidden_size \(missing; must be an integer\)",
    ),
    "no-rope-parameters": (
        "llama",
        ["rope_parameters"],
        {},
        r"rope_parameters \(missing; must be a mapping\)",
    ),
    "no-rope-theta": (
        "llama",
        [],
        {"rope_parameters": {"rope_type": "default"}},
        r"rope_parameters\['rope_theta'\] \(missing; must be a finite number\)",
    ),
    "eps-none": (
        "llama",
        [],
        {"rms_norm_eps": None},
        r"rms_norm_eps=None \(must be a finite number\)",
    ),
    "layers-as-text": (
        "llama",
        [],
        {"num_hidden_layers": "2"},
        r"num_hidden_layers='2' \(must be an integer\)",
    ),
    "gemma-scalar-none": (
        "gemma3",
        [],
        {"query_pre_attn_scalar": None},
        r"Gemma3ForCausalLM: .*query_pre_attn_scalar=None",
    ),
    "moe-no-experts": (
        "qwen3-moe",
        ["num_experts", "num_local_experts"],
        {},
        r"Qwen3MoeForCausalLM: .*num_experts \(missing; must be an integer\)",
    ),
    "dsa-no-index-topk": (
        "deepseek-v32",
        ["index_topk"],
        {},
        r"DeepseekV32ForCausalLM: .*index_topk \(missing; must be an integer\)",
    ),
    "kda-heads-float": (
        "kimi-linear",
        [],
        {"linear_num_heads": 2.5},
        r"KimiLinearForCausalLM: .*linear_num_heads=2.5 \(must be an integer\)",
    ),
    "v4-no-compress-rope": (
        "deepseek-v4",
        [],
        {"rope_parameters": {"main": {"rope_theta": 1e4}}},
        r"DeepseekV4ForCausalLM: .*rope_parameters\['compress'\] \(missing",
    ),
    "v4-layer-types-bad": (
        "deepseek-v4",
        [],
        {"layer_types": "sliding_attention"},
        r"layer_types='sliding_attention' \(must be a list\)",
    ),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_missing_or_wrong_typed_config_fields_are_named(name):
    family, drop, changes, message = BAD_CONFIGS[name]
    cfg = _hf_config(family)
    config_from_hf(_stand_in(cfg))  # the stand-in itself converts
    with pytest.raises(ValueError, match=message):
        config_from_hf(_stand_in(cfg, drop, **changes))


def test_every_bad_field_is_named_in_one_error():
    cfg = _stand_in(
        _hf_config("deepseek-v32"),
        ["index_topk", "n_group", "hidden_size"],
        vocab_size=None,
        kv_lora_rank=8.0,
    )
    with pytest.raises(ValueError) as err:
        config_from_hf(cfg)
    msg = str(err.value)
    assert msg.startswith("DeepseekV32ForCausalLM: the config cannot be read")
    for part in (
        "index_topk (missing",
        "n_group (missing",
        "hidden_size (missing",
        "vocab_size=None",
        "kv_lora_rank=8.0",
    ):
        assert part in msg, part


def test_a_model_without_rope_needs_no_rope_parameters():
    cfg = _stand_in(_hf_config("kimi-linear"))
    assert not hasattr(cfg, "rope_parameters")
    assert config_from_hf(cfg).position == "none"


# --- 3. objects that are not causal LMs, weights that do not fit ----------------------


def test_objects_that_are_not_causal_lms_are_named():
    with pytest.raises(TypeError, match="hf_model must be a transformers model"):
        from_hf("meta-llama/Llama-3.2-1B")
    with pytest.raises(
        ValueError,
        match="hf_model is a LlamaModel, not a causal LM .*pass LlamaForCausalLM",
    ):
        from_hf(_llama(transformers.LlamaModel))
    with pytest.raises(
        ValueError, match="hf_model is a LlamaForSequenceClassification"
    ):
        from_hf(_llama(transformers.LlamaForSequenceClassification))
    bert = transformers.BertConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8
    )
    with pytest.raises(ValueError, match="unsupported model .*supported: "):
        from_hf(transformers.BertModel(bert))
    with pytest.raises(ValueError, match="unsupported model"):
        config_from_hf({"model_type": "llama"})
    base = _llama(transformers.LlamaModel)
    stand_in = torch.nn.Module()
    stand_in.config, stand_in.inner = base.config, base  # keys "inner.layers...."
    with pytest.raises(
        ValueError, match=r"no 'model.embed_tokens.weight' \(keys start \['inner."
    ):
        from_hf(stand_in)


def test_weights_that_do_not_fit_the_config_are_all_named():
    hf = _llama()
    hf.config.intermediate_size = 20  # the weights were built for 24
    with pytest.raises(ValueError) as err:
        from_hf(hf)
    msg = str(err.value)
    for i in range(2):
        for name, shape in (("gate", (20, 16)), ("up", (20, 16)), ("down", (16, 20))):
            got = (24, 16) if name != "down" else (16, 24)
            assert f"blocks.{i}.ffn.{name}.weight: expected {shape}, got {got}" in msg

"""The static calculator page (chapter 13): its dials describe every preset completely, and
its HTML follows the contract the browser test uses. The page's arithmetic itself is
checked against companion.calc in the browser (tests/browser/test_html.py)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from companion.analysis.calculator import count_params, flops_per_token, kv_cache_bytes
from companion.analysis.calculator_page import (
    DIAL_CHOICES,
    DIALS,
    GROUP_DIALS,
    PAGE_PRESETS,
    USAGE,
    calculator_html,
    config_from_dials,
    dial_values,
    layer_period,
    undialled,
)
from companion.models.config import ModelConfig
from companion.models.config_parts import ConfigError
from companion.models.presets import PRESETS


def _variants() -> dict[str, ModelConfig]:
    """Settings no preset has: GLM-style shared indexer layers, KDA in place of Gated
    DeltaNet, Kimi's low-rank KDA gates beside a gated MLA."""
    glm, qwen, ling = (
        PRESETS["glm-5"],
        PRESETS["qwen3-next-80b-a3b"],
        PRESETS["ling-3.0-flash"],
    )
    shared = tuple("full" if i % 3 == 0 else "shared" for i in range(glm.n_layers))
    kda = qwen.linear.replace(kind="kda", value_heads=16)
    return {
        "glm-shared": glm.replace(
            mla=glm.mla.replace(indexer=glm.mla.indexer.replace(layers=shared))
        ),
        "qwen-kda": qwen.replace(linear=kda),
        "ling-kimi": ling.replace(linear=ling.linear.replace(kda_layout="kimi")),
    }


@pytest.mark.parametrize("name", sorted(PAGE_PRESETS) + sorted(_variants()))
def test_dials_describe_each_preset(name: str) -> None:
    """Read back from its dials, a preset gives the same parameters, cache and FLOPs."""
    cfg = PRESETS[name] if name in PRESETS else _variants()[name]
    back = config_from_dials(dial_values(cfg))
    assert count_params(back) == count_params(cfg)
    for tokens in (1, 4096, 131_072):
        assert kv_cache_bytes(back, tokens, batch=3) == kv_cache_bytes(
            cfg, tokens, batch=3
        )
        assert flops_per_token(back, tokens) == flops_per_token(cfg, tokens)


def test_layer_pattern_is_the_shortest_period_repeated_to_the_depth() -> None:
    values = dial_values(PRESETS["gemma3-27b"])
    assert values["layer_types"] == "SSSSSF"
    assert layer_period(PRESETS["gemma3-27b"].layer_types) == 6
    assert layer_period(PRESETS["qwen3-next-80b-a3b"].layer_types) == 4
    deeper = config_from_dials({**values, "n_layers": 8})
    assert deeper.layer_types == ("sliding",) * 5 + ("full", "sliding", "sliding")
    with pytest.raises(ValueError, match="layer_types must be letters"):
        config_from_dials({**values, "layer_types": "SXF"})


def test_the_page_leaves_out_only_what_it_has_no_dials_for() -> None:
    """DeepSeek-V4's compressed attention, hyper-connections and hash routing have no
    dials: its presets are off the page (and dial_values says why); no other is."""
    for name, cfg in PRESETS.items():
        v4 = [
            getattr(cfg, "compression", None) is not None,
            getattr(cfg, "residual", None) is not None,
            bool(getattr(cfg.moe, "hash_layers", 0)),
        ]
        assert (name in PAGE_PRESETS) == (not any(v4)), name
        if any(v4):
            assert undialled(cfg), name
            with pytest.raises(ValueError, match="the page has no dials for"):
                dial_values(cfg)


def test_indexer_pattern_and_kda_dials() -> None:
    variants = _variants()
    values = dial_values(variants["glm-shared"])
    assert values["indexer_layers"] == "FSS"
    back = config_from_dials(values)
    assert back.mla.indexer.layers == variants["glm-shared"].mla.indexer.layers
    assert config_from_dials(dial_values(PRESETS["glm-5"])).mla.indexer.layers is None
    values = dial_values(PRESETS["ling-3.0-flash"])
    assert (values["linear_kind"], values["kda_layout"]) == ("kda", "bailing")
    assert values["mla_output_gate"] is True
    dense = dial_values(PRESETS["llama3-8b"])
    assert (dense["indexer_topk"], dense["indexer_layers"]) == (0, "F")
    assert (dense["linear_kind"], dense["mla_output_gate"]) == ("gated_deltanet", False)


@pytest.mark.parametrize(
    ("preset", "changes", "field"),
    [
        ("llama3-8b", {"q_lora_rank": 64}, "mla.q_lora_rank"),
        ("llama3-8b", {"mla_output_gate": True}, "mla.output_gate"),
        ("llama3-8b", {"indexer_topk": 64}, "mla.indexer"),
        ("deepseek-v3.2", {"indexer_layers": "FQ"}, "mla.indexer.layers"),
        ("deepseek-v3.2", {"indexer_layers": "SF"}, "mla.indexer.layers"),
        ("deepseek-v3.2", {"q_lora_rank": 0}, "mla.indexer"),
        ("kimi-linear-48b-a3b", {"linear_value_heads": 64}, "linear.value_heads"),
        ("qwen3-next-80b-a3b", {"kda_layout": "bailing"}, "linear.kda_layout"),
        ("llama3-8b", {"n_heads": 12, "n_kv_heads": 9}, "n_kv_heads"),
    ],
)
def test_dials_that_describe_no_model_raise(preset: str, changes: dict, field: str):
    """The page shows these as problems; read back, they raise the config's error."""
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config_from_dials({**dial_values(PRESETS[preset]), **changes})


def test_every_field_the_formulas_read_has_a_dial() -> None:
    """A config that differs from its read-back in a dialled field would be a missed dial:
    changing any non-dial field must leave the four numbers alone."""
    dialled = {field for group in DIALS.values() for field, _ in group}
    in_groups = {dial for _, names in GROUP_DIALS.values() for dial in names}
    assert dialled - in_groups <= set(ModelConfig.field_names())
    for group, (cls, names) in GROUP_DIALS.items():
        assert set(names.values()) <= {f.name for f in dataclasses.fields(cls)}, group
    cfg = PRESETS["deepseek-v3"]
    for field, changed in {
        "rope_theta": 5e5,
        "activation": "gelu",
        "moe.router": "softmax",
        "moe.router_norm_topk": False,
        "mla.form": "absorbed",
        "dropout": 0.1,
        "norm_eps": 1e-6,
    }.items():
        assert field.split(".")[-1] not in dialled
        group, _, name = field.rpartition(".")
        if group:
            changed = getattr(cfg, group).replace(**{name: changed})
        other = cfg.replace(**{group or name: changed})
        assert count_params(other) == count_params(cfg), field
        assert flops_per_token(other, 4096) == flops_per_token(cfg, 4096), field


def test_html_contract() -> None:
    page = calculator_html("gpt2")
    options = re.findall(r'<option value="([^"]+)"', page.split('id="calc-preset">')[1])
    assert options[: len(PAGE_PRESETS)] == list(PAGE_PRESETS)
    for group in DIALS.values():
        for field, _ in group:
            assert f'id="calc-{field}"' in page, field
            if field in DIAL_CHOICES:
                for choice in DIAL_CHOICES[field]:
                    assert f'<option value="{choice}">' in page
    for name in USAGE:
        assert f'id="calc-{name}"' in page
    for out in ("total", "active", "kv-per-token", "kv-total", "flops-per-token"):
        assert f'<output id="calc-{out}">' in page
    data = json.loads(re.search(r'class="calc-data">(.*?)</script>', page, re.S)[1])
    assert set(data["presets"]) == set(PAGE_PRESETS)
    assert data["fields"]["indexer_topk"] == "mla.indexer.topk"
    assert data["fields"]["linear_kind"] == "linear.kind"
    assert '<div class="calc-problems">' in page
    assert '"gpt2" selected' in page
    with pytest.raises(ValueError, match="default must be one of"):
        calculator_html("gpt-5")

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
    USAGE,
    calculator_html,
    config_from_dials,
    dial_values,
    layer_period,
)
from companion.models.config import ModelConfig
from companion.models.presets import PRESETS


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dials_describe_each_preset(name: str) -> None:
    """Read back from its dials, a preset gives the same parameters, cache and FLOPs."""
    cfg = PRESETS[name]
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
    assert options[: len(PRESETS)] == list(PRESETS)
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
    assert set(data["presets"]) == set(PRESETS)
    assert '"gpt2" selected' in page
    with pytest.raises(ValueError, match="default must be one of"):
        calculator_html("gpt-5")

"""The static calculator page (chapter 13): its dials describe every preset completely
(DeepSeek-V4's included), and its HTML follows the contract the browser test uses. The
page's arithmetic itself is checked against companion.calc in the browser
(tests/browser/test_html.py), and its cache bytes with a quantised cache's scales here,
its script run by Node."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from companion.analysis.calculator import (
    count_params,
    flops_per_token,
    kv_cache_bytes,
    kv_cache_bytes_per_token,
)
from companion.analysis.calculator_dials import (
    DIAL_CHOICES,
    DIALS,
    FLOAT_DIALS,
    GROUP_DIALS,
    USAGE,
)
from companion.analysis.calculator_page import (
    PAGE_PRESETS,
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
    DeltaNet, Kimi's low-rank KDA gates beside a gated MLA; DeepSeek-V4 with a plain
    residual, no hash layers and other pooling ratios, and with a dense FFN."""
    glm, qwen, ling = (
        PRESETS["glm-5"],
        PRESETS["qwen3-next-80b-a3b"],
        PRESETS["ling-3.0-flash"],
    )
    flash = PRESETS["deepseek-v4-flash"]
    kinds = ("sliding", "csa", "csa", "hca") * 3
    shared = tuple("full" if i % 3 == 0 else "shared" for i in range(glm.n_layers))
    kda = qwen.linear.replace(kind="kda", value_heads=16)
    return {
        "glm-shared": glm.replace(
            mla=glm.mla.replace(indexer=glm.mla.indexer.replace(layers=shared))
        ),
        "qwen-kda": qwen.replace(linear=kda),
        "ling-kimi": ling.replace(linear=ling.linear.replace(kda_layout="kimi")),
        "v4-plain": flash.replace(
            n_layers=12,
            layer_types=kinds,
            residual=None,
            moe=flash.moe.replace(hash_layers=0, swiglu_limit=None),
            compression=flash.compression.replace(csa_ratio=3, hca_ratio=50),
        ),
        "v4-dense": flash.replace(
            n_layers=5, layer_types=kinds[:5], moe=None, d_ff=1000
        ),
    }


@pytest.mark.parametrize("name", sorted(PAGE_PRESETS) + sorted(_variants()))
def test_dials_describe_each_preset(name: str) -> None:
    """Read back from its dials, a preset gives the same parameters, cache and FLOPs."""
    cfg = PRESETS[name] if name in PRESETS else _variants()[name]
    back = config_from_dials(dial_values(cfg))
    assert count_params(back) == count_params(cfg)
    for dtype_bytes in (1, 2, 3):
        assert kv_cache_bytes_per_token(back, dtype_bytes) == kv_cache_bytes_per_token(
            cfg, dtype_bytes
        )
    for tokens in (1, 4096, 131_072, 1_000_003):
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


def test_every_preset_is_on_the_page() -> None:
    """DeepSeek-V4's compressed attention, hyper-connections and hash routing have
    dials too: no preset is left off, and none sets a field without a dial."""
    assert list(PAGE_PRESETS) == list(PRESETS)
    assert all(undialled(cfg) == [] for cfg in PRESETS.values())


def test_deepseek_v4_dials() -> None:
    """V4's pattern spells its sliding / CSA / HCA layers, its groups their fields; a
    model without them shows 0 (the ratios their defaults), and reads back as None."""
    pro = dial_values(PRESETS["deepseek-v4-pro"])
    assert pro["layer_types"] == "HH" + "CH" * 29 + "C"
    assert dial_values(PRESETS["deepseek-v4-flash"])["layer_types"][:4] == "SSCH"
    assert (pro["compression_o_groups"], pro["compression_index_topk"]) == (16, 1024)
    assert (pro["residual_n_streams"], pro["hash_layers"]) == (4, 3)
    assert (pro["swiglu_limit"], pro["partial_rotary_factor"]) == (10.0, 0.125)
    back = config_from_dials(pro)
    assert back.compression.o_lora_rank == 1024 and back.residual.n_streams == 4
    assert back.moe.swiglu_limit == 10.0 and back.partial_rotary_factor == 0.125
    dense = dial_values(PRESETS["llama3-8b"])
    assert dense["compression_q_lora_rank"] == dense["residual_n_streams"] == 0
    assert (dense["compression_csa_ratio"], dense["compression_hca_ratio"]) == (4, 128)
    assert dense["swiglu_limit"] == 0 and set(FLOAT_DIALS) <= set(dense)
    back = config_from_dials(dense)
    assert back.compression is None and back.residual is None


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
        ("llama3-8b", {"layer_types": "FH"}, "compression"),
        ("deepseek-v4-pro", {"layer_types": "CHF"}, "layer_types"),
        ("deepseek-v4-pro", {"sliding_window": 0}, "compression needs sliding_window"),
        ("deepseek-v4-flash", {"n_kv_heads": 4}, "n_kv_heads"),
        ("deepseek-v4-flash", {"compression_o_groups": 3}, "compression.o_groups"),
        ("deepseek-v4-flash", {"compression_index_head_dim": 8}, "index_head_dim"),
        ("deepseek-v4-pro", {"norm_placement": "sandwich"}, "residual"),
        ("deepseek-v4-pro", {"residual_n_streams": -2}, "residual.n_streams"),
        ("deepseek-v4-pro", {"hash_layers": 62}, "moe.hash_layers"),
        ("deepseek-v4-pro", {"expert_kind": "gpt_oss"}, "moe.swiglu_limit"),
        ("deepseek-v4-pro", {"partial_rotary_factor": 0.127}, "partial_rotary_factor"),
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
    v4 = PRESETS["deepseek-v4-flash"]
    for field, changed in {
        "compression.rope_theta": 1e4,
        "residual.sinkhorn_iters": 3,
        "residual.eps": 1e-3,
        "moe.router_scale": 1.0,
        "norm_eps": 1e-5,
    }.items():
        assert field.split(".")[-1] not in dialled
        group, _, name = field.rpartition(".")
        changed = getattr(v4, group).replace(**{name: changed}) if group else changed
        other = v4.replace(**{group or name: changed})
        assert count_params(other) == count_params(v4), field
        assert kv_cache_bytes(other, 9999) == kv_cache_bytes(v4, 9999), field
        assert flops_per_token(other, 9999) == flops_per_token(v4, 9999), field
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
    assert data["fields"]["compression_o_groups"] == "compression.o_groups"
    assert data["fields"]["residual_n_streams"] == "residual.n_streams"
    assert data["kinds"]["partial_rotary_factor"] == "float"
    assert data["patterns"]["layer_types"]["C"] == "csa"
    assert '<div class="calc-problems">' in page
    assert '"gpt2" selected' in page
    with pytest.raises(ValueError, match="default must be one of"):
        calculator_html("gpt-5")


# The page's script run by Node on a stand-in for the few DOM calls it makes: each
# setting loads a preset, turns dials, and reads the five outputs and the problems line.
_STUB_JS = r"""
const fs = require("fs");
const { page, settings } = JSON.parse(fs.readFileSync(0, "utf8"));
const els = {};
for (const [id, value] of Object.entries(page.controls)) {
  els[id] = { id: "calc-" + id, value, checked: false, dataset: {}, textContent: "",
    title: "", on: [], addEventListener(_, f) { this.on.push(f); } };
}
const problems = { textContent: "" };
const root = {
  querySelector(sel) {
    if (sel === "script.calc-data") return { textContent: page.data };
    if (sel === ".calc-problems") return problems;
    return els[sel.replace("#calc-", "")];
  },
  querySelectorAll() { return Object.values(els); },
};
const document = { currentScript: { closest: () => root } };
new Function("document", page.script)(document);
const out = settings.map(({ preset, dials }) => {
  els.preset.value = preset;
  els.preset.on.forEach((f) => f({ target: els.preset }));
  for (const [name, value] of Object.entries(dials)) {
    if (typeof value === "boolean") els[name].checked = value;
    else els[name].value = String(value);
  }
  els.d_model.on[0]();
  const ids = ["total", "active", "kv-per-token", "kv-total", "flops-per-token"];
  return [ids.map((i) => els[i].dataset.value ?? null), problems.textContent];
});
process.stdout.write(JSON.stringify(out));
"""


def _node() -> str | None:
    """Node: on the PATH, or the one Playwright (a dev dependency) ships."""
    import shutil
    from pathlib import Path

    if found := shutil.which("node"):
        return found
    try:
        import playwright
    except ImportError:
        return None
    bundled = Path(playwright.__file__).parent / "driver" / "node"
    return str(bundled) if bundled.exists() else None


def _run_page(settings: list[dict]) -> list[tuple[list[int | None], str]]:
    """The page's five numbers (None: empty) and its problems line, per setting."""
    import subprocess

    node = _node()
    if node is None:
        pytest.skip("no Node to run the page's script (the browser test covers it)")
    html = calculator_html("llama3-8b")
    controls = {
        m[1]: m[2] or ""
        for m in re.finditer(r'id="calc-([\w-]+)"[^>]*?(?:value="(\d+)")?', html)
    }
    outputs = ("total", "active", "kv-per-token", "kv-total", "flops-per-token")
    controls |= dict.fromkeys(outputs, "") | {"preset": "llama3-8b"}
    page = {
        "controls": controls,
        "data": re.search(r'class="calc-data">(.*?)</script>', html, re.S)[1],
        "script": re.search(r"<script>(.*)</script>", html, re.S)[1],
    }
    done = subprocess.run(
        [node, "-e", _STUB_JS],
        input=json.dumps({"page": page, "settings": settings}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return [
        ([None if v is None else int(v) for v in values], problems)
        for values, problems in json.loads(done.stdout)
    ]


def test_page_prices_the_scale_dial_as_the_formulas_do() -> None:
    """Every preset and each small variant, at bf16 and at 1-byte numbers with a 2- or
    4-byte scale per row: the page's cache bytes (and its other numbers) equal
    companion's; a negative scale is the formula's own error."""
    configs = dict(PAGE_PRESETS) | _variants()
    usages = [
        {"context": 8192, "batch": 1, "dtype_bytes": 2, "scale_bytes": 0},
        {"context": 131_073, "batch": 3, "dtype_bytes": 1, "scale_bytes": 4},
        {"context": 77, "batch": 2, "dtype_bytes": 1, "scale_bytes": 2},
    ]
    settings, want = [], []
    for name, cfg in configs.items():
        for usage in usages:
            state = 2 if usage["scale_bytes"] == 2 else 4
            dials = dial_values(cfg) | usage | {"state_dtype_bytes": state}
            preset = name if name in PAGE_PRESETS else "llama3-8b"
            settings.append({"preset": preset, "dials": dials})
            b, s, tokens = usage["dtype_bytes"], usage["scale_bytes"], usage["context"]
            pc = count_params(cfg)
            kv = kv_cache_bytes(
                cfg,
                tokens,
                b,
                batch=usage["batch"],
                state_dtype_bytes=state,
                scale_bytes=s,
            )
            per_token = kv_cache_bytes_per_token(cfg, b, scale_bytes=s)
            flops = flops_per_token(cfg, tokens)
            want.append(([pc.total, pc.active, per_token, kv, flops], ""))
    bad = {"scale_bytes": -1}
    settings.append({"preset": "llama3-8b", "dials": bad})
    with pytest.raises(ValueError) as err:
        kv_cache_bytes(PRESETS["llama3-8b"], 8, scale_bytes=-1)
    got = _run_page(settings)
    assert got[:-1] == want
    assert got[-1][0] == [None] * 5 and str(err.value) in got[-1][1]
    assert "scale_bytes" in USAGE and USAGE["scale_bytes"][1] == 0

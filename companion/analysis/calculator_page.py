"""Chapter 13's calculator as a self-contained HTML panel that works with no kernel.

:func:`calculator_html` writes a preset menu, one dial per config field that
:mod:`companion.analysis.calculator` reads, and the five outputs, with a small script
(``calculator_page.js``, next to this file) that repeats the calculator's arithmetic in
exact integers. The page's contract, which the browser test relies on:

- ``<select id="calc-preset">``: its option values are ``PRESETS`` keys;
- a dial per field in ``DIALS``, id ``calc-<field>``: ``<input>`` for numbers and
  the
  layer pattern, checkbox for flags, ``<select>`` for a field with fixed choices; plus
  ``calc-context``, ``calc-batch``, ``calc-dtype_bytes`` and ``calc-state_dtype_bytes``;
- outputs ``#calc-total``, ``#calc-active``, ``#calc-kv-per-token``, ``#calc-kv-total``
  and
  ``#calc-flops-per-token``, each holding its exact integer in ``data-value``.

The layer pattern is written with one letter per layer kind (``F`` full, ``S`` sliding,
``L`` linear) and repeated to the depth, as chapter 13's ``build`` repeats a preset's
period; :func:`config_from_dials` reads dial values back into a
:class:`~companion.models.config.ModelConfig`, so the page's numbers can be checked
against :func:`~companion.analysis.calculator.count_params` and the rest.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from pathlib import Path

from companion.layers.moe import EXPERT_KINDS
from companion.models.config import (
    CHOICES,
    LinearAttentionConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
)
from companion.models.presets import PRESETS

__all__ = [
    "DIAL_CHOICES",
    "DIALS",
    "GROUP_DIALS",
    "USAGE",
    "calculator_html",
    "config_from_dials",
    "dial_values",
    "layer_period",
]

# (field, label) per group, in the order the panel shows them
DIALS: dict[str, tuple[tuple[str, str], ...]] = {
    "model": (
        ("vocab_size", "vocabulary V"),
        ("d_model", "width d"),
        ("n_layers", "layers L"),
        ("layer_types", "layer pattern (F/S/L)"),
        ("max_seq_len", "max positions"),
        ("position", "positions"),
        ("norm", "norm"),
        ("norm_placement", "norm placement"),
        ("bias", "biases"),
        ("tie_embeddings", "tied head"),
    ),
    "attention": (
        ("n_heads", "query heads H"),
        ("n_kv_heads", "KV heads H_kv"),
        ("head_dim", "head width D"),
        ("sliding_window", "window w (0: none)"),
        ("qkv_bias", "q/k/v biases"),
        ("qk_norm", "QK-norm"),
        ("attn_output_gate", "output gate"),
        ("attn_sinks", "sinks"),
    ),
    "feed-forward and experts": (
        ("ffn", "FFN form"),
        ("d_ff", "FFN width F"),
        ("n_experts", "experts E"),
        ("experts_per_token", "top-k"),
        ("expert_d_ff", "expert width F_e"),
        ("shared_d_ff", "shared width F_s"),
        ("shared_expert_gate", "shared gate"),
        ("dense_layers", "dense first layers"),
        ("expert_kind", "expert form"),
        ("router_bias", "router bias"),
        ("router_selection_bias", "selection bias"),
    ),
    "latent attention (MLA)": (
        ("kv_lora_rank", "KV latent r"),
        ("q_lora_rank", "query latent r_q"),
        ("qk_nope_head_dim", "D_nope"),
        ("qk_rope_head_dim", "RoPE key R"),
        ("v_head_dim", "value width D_v"),
    ),
    "linear attention (Gated DeltaNet)": (
        ("linear_key_heads", "key heads H_k"),
        ("linear_value_heads", "value heads H_v"),
        ("linear_key_dim", "key width D_k"),
        ("linear_value_dim", "value width D_v"),
        ("linear_conv_kernel", "conv width K"),
    ),
}
# the dials of a mechanism group: group -> (its class, {dial: field}); a dense model's
# group is None, and its dials then show what the page's arithmetic reads as "absent"
# (no experts, no latent, no linear heads; experts as wide as the FFN, conv width 4)
GROUP_DIALS: dict[str, tuple[type, dict[str, str]]] = {
    "moe": (
        MoEConfig,
        {
            "n_experts": "n_experts",
            "experts_per_token": "experts_per_token",
            "expert_d_ff": "expert_d_ff",
            "shared_d_ff": "shared_d_ff",
            "shared_expert_gate": "shared_expert_gate",
            "dense_layers": "dense_layers",
            "expert_kind": "expert_kind",
            "router_bias": "router_bias",
            "router_selection_bias": "router_selection_bias",
        },
    ),
    "mla": (
        MLAConfig,
        {
            "kv_lora_rank": "kv_lora_rank",
            "q_lora_rank": "q_lora_rank",
            "qk_nope_head_dim": "qk_nope_head_dim",
            "qk_rope_head_dim": "qk_rope_head_dim",
            "v_head_dim": "v_head_dim",
        },
    ),
    "linear": (
        LinearAttentionConfig,
        {
            "linear_key_heads": "key_heads",
            "linear_value_heads": "value_heads",
            "linear_key_dim": "key_dim",
            "linear_value_dim": "value_dim",
            "linear_conv_kernel": "conv_kernel",
        },
    ),
}
# dials with fixed choices beyond the config's own CHOICES
DIAL_CHOICES = {**CHOICES, "expert_kind": EXPERT_KINDS}
# the calculator's own arguments: name -> (label, default)
USAGE: dict[str, tuple[str, int]] = {
    "context": ("sequence length s", 8192),
    "batch": ("batch", 1),
    "dtype_bytes": ("bytes per cached number", 2),
    "state_dtype_bytes": ("bytes per state number", 4),
}
_LETTERS = {"F": "full", "S": "sliding", "L": "linear"}
_OUTPUTS = (
    ("total", "parameters"),
    ("active", "active per token"),
    ("kv-per-token", "KV cache per token"),
    ("kv-total", "KV cache at s, batch"),
    ("flops-per-token", "FLOPs per token at s"),
)
_SCRIPT = Path(__file__).with_name("calculator_page.js")


def _absent(cfg: ModelConfig, dial: str) -> object:
    """A group dial's value when the group is None."""
    if dial == "expert_d_ff":
        return cfg.d_ff
    if dial == "linear_conv_kernel":
        return 4
    if dial == "expert_kind":
        return "glu"
    return False if dial.endswith(("_gate", "_bias")) else 0


def _dial(cfg: ModelConfig, dial: str) -> object:
    """The value a dial shows for ``cfg``: a field, or a field of a group."""
    for group, (_, names) in GROUP_DIALS.items():
        if dial in names:
            part = getattr(cfg, group)
            return _absent(cfg, dial) if part is None else getattr(part, names[dial])
    return getattr(cfg, dial)


def _kind(cfg: ModelConfig, field: str) -> str:
    if field in DIAL_CHOICES:
        return "choice"
    if field == "layer_types":
        return "pattern"
    return "bool" if isinstance(_dial(cfg, field), bool) else "int"


def layer_period(kinds: tuple[str, ...]) -> int:
    """The length of the shortest pattern that, repeated, gives ``kinds`` (3:1 -> 4)."""
    n = len(kinds)
    return next(
        p for p in range(1, n + 1) if all(kinds[i] == kinds[i % p] for i in range(n))
    )


def dial_values(cfg: ModelConfig) -> dict[str, object]:
    """The dials' values for ``cfg``: its resolved fields, the window as 0 when unset,
    and
    the layer pattern as its shortest repeating period in letters (``"SSSF"``)."""
    values: dict[str, object] = {}
    for group in DIALS.values():
        for field, _ in group:
            values[field] = _dial(cfg, field)
    letters = {kind: letter for letter, kind in _LETTERS.items()}
    period = layer_period(cfg.layer_types)
    values["layer_types"] = "".join(letters[k] for k in cfg.layer_types[:period])
    values["sliding_window"] = cfg.sliding_window or 0
    return values


def config_from_dials(values: Mapping[str, object]) -> ModelConfig:
    """The ``ModelConfig`` the panel's dials describe (other fields at their
    defaults)."""
    fields = dict(values)
    pattern = str(fields.pop("layer_types"))
    unknown = set(pattern) - set(_LETTERS)
    if not pattern or unknown:
        raise ValueError(
            f"layer_types must be letters from {sorted(_LETTERS)}, got {pattern!r}"
        )
    n = int(fields["n_layers"])  # type: ignore[call-overload]
    fields["layer_types"] = tuple(_LETTERS[pattern[i % len(pattern)]] for i in range(n))
    fields["sliding_window"] = fields["sliding_window"] or None
    parts = {
        group: {field: fields.pop(dial) for dial, field in names.items()}
        for group, (_, names) in GROUP_DIALS.items()
    }
    present = {
        "moe": parts["moe"]["n_experts"],
        "mla": parts["mla"]["kv_lora_rank"],
        "linear": "linear" in fields["layer_types"],
    }
    for group, (cls, _) in GROUP_DIALS.items():
        fields[group] = cls(**parts[group]) if present[group] else None
    if fields["mla"] is None and parts["mla"]["q_lora_rank"]:
        raise ValueError(
            "q_lora_rank needs multi-head latent attention: set kv_lora_rank > 0"
        )
    return ModelConfig(**fields)  # type: ignore[arg-type]


def _control(cfg: ModelConfig, field: str, label: str) -> str:
    kind, ident = _kind(cfg, field), f"calc-{field}"
    if kind == "choice":
        options = "".join(
            f'<option value="{c}">{c}</option>' for c in DIAL_CHOICES[field]
        )
        control = f'<select id="{ident}">{options}</select>'
    elif kind == "bool":
        control = f'<input id="{ident}" type="checkbox">'
    elif kind == "pattern":
        control = f'<input id="{ident}" type="text" size="10" spellcheck="false">'
    else:
        control = f'<input id="{ident}" type="number" min="0" step="1">'
    return f'<label for="{ident}">{html.escape(label)}</label>{control}'


_STYLE = """
.calc { font-size: 0.85rem; border: 1px solid #ccc; border-radius: 6px; padding: 0.6rem; }
.calc fieldset { border: 0; border-top: 1px solid #ddd; margin: 0.3rem 0; padding: 0.2rem 0; }
.calc legend { font-weight: 600; font-size: 0.85rem; padding: 0 0.3rem; }
.calc .calc-grid { display: grid; grid-template-columns: repeat(3, auto 5.8rem);
  gap: 0.2rem 0.5rem; align-items: center; }
.calc label { text-align: right; }
.calc .calc-grid input[type=number], .calc .calc-grid input[type=text],
.calc .calc-grid select { width: 5.8rem; }
.calc table { margin: 0.4rem 0 0; }
.calc td { padding: 0.1rem 0.6rem; }
.calc output { font-weight: 600; font-variant-numeric: tabular-nums; }
.calc .calc-problems { color: #D55E00; min-height: 1em; }
"""


def calculator_html(default: str = "llama3-8b") -> str:
    """The panel's HTML: controls, outputs, the presets' dial values and the script."""
    if default not in PRESETS:
        raise ValueError(f"default must be one of {sorted(PRESETS)}, got {default!r}")
    sample = PRESETS[default]
    kinds: dict[str, str] = {}
    parts = [f"<style>{_STYLE}</style>", '<div class="calc">']
    options = "".join(
        f'<option value="{n}"{" selected" if n == default else ""}>{n}</option>'
        for n in PRESETS
    )
    parts.append(
        f'<label for="calc-preset"><b>preset</b></label> '
        f'<select id="calc-preset">{options}</select>'
    )
    for group, dials in DIALS.items():
        parts.append(
            f'<fieldset><legend>{html.escape(group)}</legend><div class="calc-grid">'
        )
        for field, label in dials:
            kind = _kind(sample, field)
            kinds[field] = "text" if kind in ("choice", "pattern") else kind
            parts.append(_control(sample, field, label))
        parts.append("</div></fieldset>")
    parts.append('<fieldset><legend>use</legend><div class="calc-grid">')
    for name, (label, default_value) in USAGE.items():
        kinds[name] = "int"
        parts.append(
            f'<label for="calc-{name}">{html.escape(label)}</label>'
            f'<input id="calc-{name}" type="number" min="1" step="1" value="{default_value}">'
        )
    parts.append("</div></fieldset><table>")
    for ident, label in _OUTPUTS:
        parts.append(
            f'<tr><td>{label}</td><td><output id="calc-{ident}"></output></td></tr>'
        )
    parts.append('</table><div class="calc-problems"></div>')
    data = {
        "kinds": kinds,
        "letters": _LETTERS,
        "presets": {name: dial_values(cfg) for name, cfg in PRESETS.items()},
    }
    parts.append(
        f'<script type="application/json" class="calc-data">{json.dumps(data)}</script>'
    )
    parts.append(f"<script>{_SCRIPT.read_text(encoding='utf-8')}</script></div>")
    return "\n".join(parts)

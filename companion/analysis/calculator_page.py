"""Chapter 13's calculator as a self-contained HTML panel that works with no kernel.

:func:`calculator_html` writes a preset menu, one dial per config field that
:mod:`companion.analysis.calculator` reads, and the five outputs, with a small script
(``calculator_page.js``, next to this file) that repeats the calculator's arithmetic in
exact integers, after the config's rules. The contract the browser test relies on:

- ``<select id="calc-preset">``: its option values are ``PAGE_PRESETS`` keys (those
  of ``PRESETS`` that set no field without a dial, :func:`undialled`: all of them);
- a dial per entry of ``companion.analysis.calculator_dials.DIALS``, id
  ``calc-<dial>``: ``<input>`` for numbers (``FLOAT_DIALS`` take fractions) and the
  two patterns, checkbox for flags, ``<select>`` for a field with fixed choices; plus
  ``calc-context``, ``calc-batch``, ``calc-dtype_bytes``, ``calc-scale_bytes`` (a
  quantised cache's scale per row, :mod:`companion.analysis.cache_size`) and
  ``calc-state_dtype_bytes``;
- outputs ``#calc-total``, ``#calc-active``, ``#calc-kv-per-token``, ``#calc-kv-total``
  and ``#calc-flops-per-token``, each holding its exact integer in ``data-value``;
- ``.calc-problems``: when the dials describe a config that ``ModelConfig``
  rejects, the outputs are empty (no ``data-value``) and this line gives the config's
  own error, field named, for each rule broken.

A pattern dial has one letter per layer (layers: ``F`` full, ``S`` sliding, ``L``
linear, ``C`` CSA, ``H`` HCA; DSA indexer: ``F`` its own, ``S`` shared, GLM-5),
repeated to the depth as chapter 13's ``build`` repeats a preset's period.
:func:`config_from_dials` reads the dials back into a
:class:`~companion.models.config.ModelConfig` (raising its ``ConfigError`` where the
page shows a problem), so the page can be checked against
:func:`~companion.analysis.calculator.count_params` and the rest.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from pathlib import Path

from companion.analysis.calculator_dials import (
    ABSENT_VALUES,
    DIAL_CHOICES,
    DIAL_FIELDS,
    DIALS,
    FLOAT_DIALS,
    GROUP_DIALS,
    GROUP_SWITCHES,
    PATTERNS,
    USAGE,
)
from companion.models.config import ModelConfig
from companion.models.config_parts import ConfigError
from companion.models.presets import PRESETS

__all__ = [
    "PAGE_PRESETS",
    "calculator_html",
    "config_from_dials",
    "dial_values",
    "layer_period",
    "undialled",
]

# fields a preset may set that the page's formulas read but no dial shows (none now:
# DeepSeek-V4's compression, residual and hash layers have theirs)
_UNDIALLED: tuple[str, ...] = ()
_OUTPUTS = {"total": "parameters", "active": "active per token"}
_OUTPUTS |= {"kv-per-token": "KV cache per token", "kv-total": "KV cache at s, batch"}
_OUTPUTS |= {"flops-per-token": "FLOPs per token at s"}
_SCRIPT = Path(__file__).with_name("calculator_page.js")


def undialled(cfg: ModelConfig) -> list[str]:
    """The fields ``cfg`` sets that no dial shows; none: the page can show it."""
    out = []
    for path in _UNDIALLED:
        value: object = cfg
        for name in path.split("."):
            value = getattr(value, name, None)
        out += [path] if value else []
    return out


PAGE_PRESETS = {name: cfg for name, cfg in PRESETS.items() if not undialled(cfg)}


def _dial(cfg: ModelConfig, dial: str) -> object:
    """The value a dial shows for ``cfg``: a field, or a field of a group."""
    for group, (_, names) in GROUP_DIALS.items():
        if dial in names:
            part: object = cfg
            for name in group.split("."):
                part = getattr(part, name) if part is not None else None
            if part is not None:
                return getattr(part, names[dial])
            if dial == "expert_d_ff":
                return cfg.d_ff
            return ABSENT_VALUES.get(
                dial, False if dial.endswith(("_gate", "_bias")) else 0
            )
    return getattr(cfg, dial)


def layer_period(kinds: tuple[str, ...]) -> int:
    """The length of the shortest pattern that, repeated, gives ``kinds`` (3:1 -> 4)."""
    n = len(kinds)
    return next(
        p for p in range(1, n + 1) if all(kinds[i] == kinds[i % p] for i in range(n))
    )


def dial_values(cfg: ModelConfig) -> dict[str, object]:
    """The dials' values for ``cfg``: its resolved fields, the window and the SwiGLU
    clamp as 0 when unset, and each pattern as its shortest repeating period in
    letters (``"SSSF"``)."""
    if undialled(cfg):
        raise ValueError(f"the page has no dials for {undialled(cfg)} of {cfg!r}")
    values = {
        field: _dial(cfg, field) for group in DIALS.values() for field, _ in group
    }
    values["sliding_window"] = cfg.sliding_window or 0
    values["swiglu_limit"] = values["swiglu_limit"] or 0
    for dial, letters in PATTERNS.items():
        kinds = values[dial] or ("full",)  # an indexer's None: every layer its own
        letter = {kind: letter for letter, kind in letters.items()}
        values[dial] = "".join(letter[k] for k in kinds[: layer_period(kinds)])
    return values


def _pattern(values: Mapping[str, object], dial: str) -> tuple[str, ...]:
    """A pattern dial repeated to the depth (the config's name for it in errors)."""
    letters, name = PATTERNS[dial], DIAL_FIELDS.get(dial, dial)
    text = str(values[dial]).strip().upper()
    if not text or set(text) - set(letters):
        raise ConfigError(
            f"{name} must be letters from {sorted(letters)}, got {values[dial]!r}"
        )
    n = max(int(values["n_layers"]), 0)  # type: ignore[call-overload]
    return tuple(letters[text[i % len(text)]] for i in range(n))


def config_from_dials(values: Mapping[str, object]) -> ModelConfig:
    """The ``ModelConfig`` the panel's dials describe (other fields at their defaults);
    a ``ConfigError`` names the field where they describe no model."""
    fields = dict(values)
    fields["layer_types"] = _pattern(values, "layer_types")
    for dial in FLOAT_DIALS:
        fields[dial] = float(values[dial])  # type: ignore[arg-type]
    for dial in ("sliding_window", "swiglu_limit"):  # 0: None
        fields[dial] = fields[dial] or None
    parts = {
        group: {field: fields.pop(dial) for dial, field in names.items()}
        for group, (_, names) in GROUP_DIALS.items()
    }
    on = {group: values[dial] for group, dial in GROUP_SWITCHES.items()}
    on["linear"] = "linear" in fields["layer_types"]
    if on["mla.indexer"]:
        layers = _pattern(values, "indexer_layers")
        parts["mla.indexer"]["layers"] = None if "shared" not in layers else layers
    for group, (cls, _) in GROUP_DIALS.items():
        fields[group] = cls(**parts[group]) if on[group] else None
    if fields["mla"] is not None:
        fields["mla"] = fields["mla"].replace(indexer=fields["mla.indexer"])
    else:  # the page's own rule: a part of MLA without MLA would be ignored
        wanted = {**parts["mla"], "indexer": on["mla.indexer"]}
        for what in (w for w in ("q_lora_rank", "output_gate", "indexer") if wanted[w]):
            need = "needs multi-head latent attention: set mla.kv_lora_rank > 0"
            raise ConfigError(f"mla.{what} {need}")
    del fields["mla.indexer"]
    return ModelConfig(**fields)  # type: ignore[arg-type]


def _control(cfg: ModelConfig, field: str, label: str) -> tuple[str, str]:
    """(the kind of value the script reads, the dial's label and control)."""
    ident = f"calc-{field}"
    if field in DIAL_CHOICES:
        options = "".join(
            f'<option value="{c}">{c}</option>' for c in DIAL_CHOICES[field]
        )
        kind, control = "text", f'<select id="{ident}">{options}</select>'
    elif field in FLOAT_DIALS:
        kind = "float"
        control = f'<input id="{ident}" type="number" step="any">'
    elif field in PATTERNS:
        control = f'<input id="{ident}" type="text" size="10" spellcheck="false">'
        kind = "text"
    elif field not in USAGE and isinstance(_dial(cfg, field), bool):
        kind, control = "bool", f'<input id="{ident}" type="checkbox">'
    else:
        value = f' value="{USAGE[field][1]}"' if field in USAGE else ""
        kind, control = "int", f'<input id="{ident}" type="number" step="1"{value}>'
    return kind, f'<label for="{ident}">{html.escape(label)}</label>{control}'


_STYLE = """
.calc { font-size: 0.85rem; border: 1px solid #ccc; border-radius: 6px; padding: 0.6rem; }
.calc fieldset { border: 0; border-top: 1px solid #ddd; margin: 0.3rem 0; padding: 0.2rem 0; }
.calc legend { font-weight: 600; font-size: 0.85rem; padding: 0 0.3rem; }
.calc .calc-grid { display: grid; grid-template-columns: repeat(3, auto 5.8rem);
  gap: 0.2rem 0.5rem; align-items: center; }
.calc label { text-align: right; } .calc table { margin: 0.4rem 0 0; }
.calc .calc-grid input, .calc .calc-grid select { width: 5.8rem; }
.calc td { padding: 0.1rem 0.6rem; } .calc .calc-problems { color: #D55E00; min-height: 1em; }
.calc output { font-weight: 600; font-variant-numeric: tabular-nums; }
"""


def calculator_html(default: str = "llama3-8b") -> str:
    """The panel's HTML: controls, outputs, the presets' dial values and the script."""
    if default not in PAGE_PRESETS:
        raise ValueError(
            f"default must be one of {sorted(PAGE_PRESETS)}, got {default!r}"
        )
    use = tuple((name, label) for name, (label, _) in USAGE.items())
    options = "".join(
        f'<option value="{n}"{" selected" if n == default else ""}>{n}</option>'
        for n in PAGE_PRESETS
    )
    parts = [
        f'<style>{_STYLE}</style><div class="calc"><label for="calc-preset"><b>preset'
        f'</b></label> <select id="calc-preset">{options}</select>'
    ]
    kinds: dict[str, str] = {}
    for group, dials in {**DIALS, "use": use}.items():
        parts.append(f'<fieldset><legend>{group}</legend><div class="calc-grid">')
        for field, label in dials:
            kinds[field], control = _control(PRESETS[default], field, label)
            parts.append(control)
        parts.append("</div></fieldset>")
    row = '<tr><td>{}</td><td><output id="calc-{}"></output></td></tr>'
    rows = "".join(row.format(label, ident) for ident, label in _OUTPUTS.items())
    parts.append(f'<table>{rows}</table><div class="calc-problems"></div>')
    presets = {name: dial_values(cfg) for name, cfg in PAGE_PRESETS.items()}
    data = {
        "kinds": kinds,
        "patterns": PATTERNS,
        "fields": DIAL_FIELDS,
        "presets": presets,
    }
    parts.append(
        f'<script type="application/json" class="calc-data">{json.dumps(data)}</script>'
    )
    parts.append(f"<script>{_SCRIPT.read_text(encoding='utf-8')}</script></div>")
    return "\n".join(parts)

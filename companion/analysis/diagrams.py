"""Architecture diagrams drawn from a config: one block, and the whole stack (chapters
03-14).

Every label is read from a :class:`~companion.models.config.ModelConfig` (change a field
and the drawing changes), through :func:`block_parts`, which lists what a layer's block
is made of in the order the stream meets it. :func:`block_diagram` draws one column per
kind of block the stack holds (a hybrid has several); :func:`model_diagram` draws the
embedding, the stack as two strips of layer kinds (token mixer and FFN), the final norm
and the head. One colour per mechanism (``COLORS``, from the book's palette) is used by
every architecture figure.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyBboxPatch, Patch, Rectangle

from companion.models.config import ModelConfig
from companion.models.presets import GLU_NAMES, head_sharing, rope_base
from companion.plotting import PALETTE

__all__ = [
    "COLORS",
    "Part",
    "block_diagram",
    "block_parts",
    "layer_groups",
    "model_diagram",
]

# mechanism -> colour: the same in every architecture figure
COLORS = {
    "full": PALETTE[0],
    "sliding": PALETTE[5],
    "linear": PALETTE[2],
    "latent": PALETTE[3],
    "csa": "#8C6BB1",  # DeepSeek-V4's compressed layers: the window's hue, darker
    "hca": "#54278F",
    "dense": PALETTE[4],
    "moe": PALETTE[1],
    "norm": PALETTE[6],
    "embedding": "#999999",
}
_NAMES = {
    "full": "full attention",
    "sliding": "sliding window",
    "linear": "Gated DeltaNet",
    "csa": "compressed sparse",
    "hca": "heavily compressed",
}


def _linear_name(cfg: ModelConfig) -> str:
    """What a ``"linear"`` layer of ``cfg`` is called: its delta rule."""
    if cfg.linear is not None and cfg.linear.kind == "kda":
        return "Kimi Delta Attention"
    title = {"gated_delta": "Gated DeltaNet", "delta": "DeltaNet"}
    return title.get(cfg.linear.rule if cfg.linear else "", "linear attention")


def _compressed(cfg: ModelConfig, kind: str) -> Part:
    """A DeepSeek-V4 layer: a window, plus pooled entries on CSA / HCA layers."""
    c = cfg.compression
    title = {"sliding": "sliding window", **_NAMES}[kind] + f", {cfg.n_heads} heads"
    detail = [f"window {cfg.sliding_window}", "one shared K=V head", "sinks"]
    if kind == "csa":
        detail.insert(1, f"+ entries pooled every {c.csa_ratio}, top-{c.index_topk}")
    elif kind == "hca":
        detail.insert(1, f"+ entries pooled every {c.hca_ratio}")
    return Part(kind, title, ", ".join(detail))


@dataclass(frozen=True)
class Part:
    """One box of a block: its mechanism (a ``COLORS`` key), title and detail line."""

    kind: str
    title: str
    detail: str = ""


def _norm(cfg: ModelConfig) -> Part:
    name = "RMSNorm" if cfg.norm == "rmsnorm" else "LayerNorm"
    detail = "gain 1 + w" if cfg.norm_offset else ("no bias" if not cfg.bias else "")
    return Part("norm", name, detail)


def _heads(cfg: ModelConfig) -> str:
    h, h_kv = cfg.n_heads, cfg.n_kv_heads
    return f"{head_sharing(h, h_kv)} {h}:{h_kv}, head dim {cfg.head_dim}"


def _mixer_kind(cfg: ModelConfig, layer: int) -> str:
    """``"full"``, ``"sliding"``, ``"linear"`` or, for MLA's attention layers,
    ``"latent"``."""
    kind = cfg.layer_types[layer]
    return "latent" if cfg.is_mla and kind != "linear" else kind


def _position(cfg: ModelConfig, layer: int) -> str:
    if cfg.position != "rope":
        return ""
    if layer in cfg.nope_layers:
        return "NoPE"
    # sliding layers with their own base keep it unscaled (models.builders.rotary_embedding)
    local = cfg.layer_types[layer] == "sliding" and cfg.rope_local_theta is not None
    text = f"RoPE θ={rope_base(cfg.rope_local_theta if local else cfg.rope_theta)}"
    if cfg.partial_rotary_factor < 1:
        text += f" on {cfg.partial_rotary_factor:g} of D"
    if cfg.rope_scaling is not None and not local:
        text += f", {cfg.rope_scaling.rope_type}"
    return text


def _mixer(cfg: ModelConfig, layer: int) -> Part:
    kind = cfg.layer_types[layer]
    if kind == "linear":
        lin = cfg.linear
        state = f"state {lin.key_dim}×{lin.value_dim} per head"
        heads = f"{lin.key_heads}:{lin.value_heads} heads"
        return Part(
            "linear", _linear_name(cfg), f"{heads}, {state}, conv {lin.conv_kernel}"
        )
    if cfg.compression is not None:
        return _compressed(cfg, kind)
    extras = [_position(cfg, layer)]
    if cfg.mla is not None:
        mla = cfg.mla
        q = f", q latent {mla.q_lora_rank}" if mla.q_lora_rank else ""
        title = f"MLA {cfg.n_heads} heads"
        detail = f"latent {mla.kv_lora_rank}{q}, RoPE key {mla.qk_rope_head_dim}"
        if mla.indexer is not None:
            detail += f", indexer top-{mla.indexer.topk}"
        return Part("latent", title, ", ".join(x for x in [detail, *extras] if x))
    title = _heads(cfg)
    if kind == "sliding":
        extras.insert(0, f"window {cfg.sliding_window}")
    extras += [
        "QK-norm" if cfg.qk_norm != "none" else "",
        "sinks" if cfg.attn_sinks else "",
        "output gate" if cfg.attn_output_gate else "",
        "qkv bias" if cfg.qkv_bias else "",
    ]
    return Part(kind, title, ", ".join(x for x in extras if x))


def _ffn(cfg: ModelConfig, layer: int) -> Part:
    act = cfg.activation.split("_")[0].upper()
    glu = f"{GLU_NAMES[cfg.activation]}, 3 matrices"
    form = glu if cfg.ffn == "glu" else f"{act} MLP, 2 matrices"
    if cfg.is_moe_layer(layer):
        moe = cfg.moe
        shared = " + 1 shared" if moe.shared_d_ff else ""
        title = f"MoE {moe.n_experts} routed{shared}, top-{moe.experts_per_token}"
        return Part(
            "moe", title, f"{form}, expert width {moe.expert_d_ff}, {moe.router} router"
        )
    return Part(
        "dense", "FFN", f"{form}, width {cfg.d_ff}" + (", bias" if cfg.bias else "")
    )


def block_parts(cfg: ModelConfig, layer: int = 0) -> list[Part]:
    """Layer ``layer``'s block in the order the stream meets it; ``Part("add", "+")``
    marks where a sublayer's output joins the residual stream."""
    if not 0 <= layer < cfg.n_layers:
        raise ValueError(f"layer must be in [0, n_layers={cfg.n_layers}), got {layer}")
    drop = f"dropout {cfg.dropout:g}" if cfg.dropout else ""
    parts: list[Part] = []
    placement = cfg.norm_placement
    for sublayer in (_mixer(cfg, layer), _ffn(cfg, layer)):
        parts += [_norm(cfg)] if placement in ("pre", "sandwich") else []
        parts.append(sublayer)
        parts += [_norm(cfg)] if placement in ("sandwich", "post_branch") else []
        parts.append(Part("add", "+", drop))
        parts += [_norm(cfg)] if placement == "post" else []
    return parts


def layer_groups(cfg: ModelConfig) -> dict[tuple[str, str, bool], list[int]]:
    """(mixer kind, FFN kind, NoPE) -> the layers with that block, by first layer."""
    groups: dict[tuple[str, str, bool], list[int]] = {}
    for layer in range(cfg.n_layers):
        ffn = "moe" if cfg.is_moe_layer(layer) else "dense"
        key = (_mixer_kind(cfg, layer), ffn, layer in cfg.nope_layers)
        groups.setdefault(key, []).append(layer)
    return groups


def _ranges(layers: list[int]) -> str:
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    text = [f"{r[0]}" if len(r) == 1 else f"{r[0]}–{r[-1]}" for r in runs[:3]]
    return ", ".join(text) + (", …" if len(runs) > 3 else "")


def _box(
    ax: plt.Axes, x: float, y: float, w: float, h: float, part: Part, wrap: int = 40
) -> None:
    color = COLORS[part.kind]
    ax.add_patch(
        FancyBboxPatch(
            (x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
            facecolor=color, alpha=0.3, edgecolor=color, linewidth=1.5,
        )
    )  # fmt: skip
    lines = textwrap.wrap(part.detail, wrap)
    ax.text(x, y + 0.09 * len(lines), part.title, ha="center", va="center", fontsize=9)
    if lines:
        ax.text(x, y - 0.1 - 0.04 * len(lines), "\n".join(lines), ha="center", va="center",
                fontsize=6.5, linespacing=1.1)  # fmt: skip


def block_diagram(cfg: ModelConfig, ax: plt.Axes | None = None) -> Figure:
    """One column per kind of block in the stack (stream bottom to top, the residual
    path on the left), each titled with the layers it stands for.

    With ``ax`` it draws into that (empty) axes, e.g. one frame of an animation, and
    returns its figure; otherwise it makes a figure sized to the number of columns."""
    groups = layer_groups(cfg)
    width, step = 3.4, 0.86
    columns = [block_parts(cfg, layers[0]) for layers in groups.values()]
    height = max(len(c) for c in columns) * step + 1.2
    if ax is None:
        _, ax = plt.subplots(figsize=(3.3 * len(columns) + 0.4, 0.72 * height + 0.3))
    for col, (parts, layers) in enumerate(zip(columns, groups.values(), strict=True)):
        x0 = col * (width + 0.6)
        y = 0.4
        ax.annotate("", (x0, y + 0.35), (x0, y - 0.15), arrowprops={"arrowstyle": "->"})
        branch_start = y + 0.1
        for part in parts:
            y += step
            if part.kind == "add":
                ax.add_patch(
                    Circle((x0, y), 0.16, facecolor="white", edgecolor="black")
                )
                ax.text(x0, y, "+", ha="center", va="center", fontsize=11)
                if part.detail:
                    ax.text(x0 + 0.25, y, part.detail, fontsize=6.5, va="center")
                skip = x0 - width / 2 - 0.15
                ax.plot(
                    [x0, skip, skip, x0 - 0.16],
                    [branch_start, branch_start, y, y],
                    "k-",
                    lw=1,
                )
                ax.plot([x0, x0], [y + 0.16, y + step - 0.3], "k-", lw=1)
                branch_start = y + 0.3
            else:
                _box(ax, x0, y, width, 0.64, part)
                ax.plot([x0, x0], [y + 0.32, y + step - 0.3], "k-", lw=1)
        n, total = len(layers), cfg.n_layers
        which = (
            f"all {total} layers"
            if n == total
            else f"{n} of {total} layers: {_ranges(layers)}"
        )
        ax.text(x0, y + 0.7, which, ha="center", fontsize=9, fontweight="bold")
    ax.set_xlim(-width / 2 - 0.4, (len(columns) - 1) * (width + 0.6) + width / 2 + 0.2)
    ax.set_ylim(-0.3, height + 0.3)
    ax.set_axis_off()
    ax.set_aspect("equal")
    return ax.figure


def model_diagram(cfg: ModelConfig, ax: plt.Axes | None = None) -> Figure:
    """The whole model left to right: embedding, the stack as a strip of token-mixer
    kinds over a strip of FFN kinds, the final norm and the output head (into ``ax`` if
    given)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9.0, 2.9))
    n = cfg.n_layers
    strip = 6.0
    cell = strip / n
    position = {"learned": " + learned positions", "sinusoidal": " + sinusoids"}.get(
        cfg.position, ""
    )
    scale = " × √d" if cfg.scale_embeddings else ""
    embed = Part(
        "embedding", "embedding", f"{cfg.vocab_size:,} × {cfg.d_model}{scale}{position}"
    )
    _box(ax, -1.3, 0.5, 2.2, 0.9, embed, wrap=26)
    mixers = [_mixer_kind(cfg, i) for i in range(n)]
    ffns = ["moe" if cfg.is_moe_layer(i) else "dense" for i in range(n)]
    for i in range(n):
        for row, kind in ((0.55, mixers[i]), (0.0, ffns[i])):
            ax.add_patch(
                Rectangle(
                    (i * cell, row), cell, 0.45, facecolor=COLORS[kind], alpha=0.7,
                    edgecolor="white", linewidth=0.5 if n > 40 else 1.0,
                )
            )  # fmt: skip
    counts = {k: mixers.count(k) for k in dict.fromkeys(mixers)}
    names = {**_NAMES, "latent": "latent attention", "linear": _linear_name(cfg)}
    mix_text = " + ".join(f"{c} {names[k]}" for k, c in counts.items())
    n_moe = ffns.count("moe")
    ffn_text = f"{n_moe} MoE + {n - n_moe} dense FFN" if n_moe and n_moe < n else (
        "MoE FFN in every layer" if n_moe else "dense FFN in every layer"
    )  # fmt: skip
    ax.text(strip / 2, 1.15, f"{n} layers: {mix_text}", ha="center", fontsize=9)
    ax.text(strip / 2, -0.08, ffn_text, ha="center", va="top", fontsize=9)
    kinds = list(dict.fromkeys(mixers + ffns))
    labels = {**names, "moe": "MoE FFN", "dense": "dense FFN"}
    handles = [Patch(color=COLORS[k], alpha=0.7, label=labels[k]) for k in kinds]
    ax.legend(handles=handles, loc="lower center", ncol=len(kinds), fontsize=8,
              bbox_to_anchor=(0.5, 0.0))  # fmt: skip
    ax.text(-0.08, 0.775, "mixer", ha="right", va="center", fontsize=7)
    ax.text(-0.08, 0.225, "FFN", ha="right", va="center", fontsize=7)
    _box(ax, strip + 0.8, 0.5, 1.1, 0.9, Part("norm", "final norm", _norm(cfg).title))
    tied = "tied to the embedding" if cfg.tie_embeddings else "own weights"
    _box(ax, strip + 2.45, 0.5, 1.9, 0.9, Part("embedding", "output head", f"{cfg.d_model} → "
         f"{cfg.vocab_size:,}, {tied}"), wrap=22)  # fmt: skip
    ax.set_xlim(-2.5, strip + 3.5)
    ax.set_ylim(-0.75, 1.4)
    ax.set_axis_off()
    return ax.figure

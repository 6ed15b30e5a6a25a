"""Architecture diagrams drawn from a config (chapters 03-14). Every label is read from
a :class:`~companion.models.config.ModelConfig` (change a field and the drawing
changes), through :func:`block_parts`, what a layer's block is made of in the order the
stream meets it. :func:`block_diagram` draws one column per kind of block (a hybrid has
several), and as a morph's frame also the embedding, positional signal and head, with
what changed outlined (:func:`changed_parts`); :func:`model_diagram` draws the stack as
two strips of layer kinds. ``COLORS``: one colour per mechanism, in every figure.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from itertools import groupby

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyBboxPatch, Patch, Rectangle

from companion.models.config import ModelConfig
from companion.models.presets import GLU_NAMES, head_sharing, rope_base
from companion.plotting import PALETTE

__all__ = ["COLORS", "Part", "block_diagram", "block_parts", "changed_parts",
           "end_parts", "layer_groups", "model_diagram"]  # fmt: skip

# mechanism -> colour: the same in every architecture figure
COLORS = {
    "full": PALETTE[0], "sliding": PALETTE[5], "linear": PALETTE[2],
    "latent": PALETTE[3],
    "csa": "#8C6BB1", "hca": "#54278F",  # DeepSeek-V4's: the window's hue, darker
    "dense": PALETTE[4], "moe": PALETTE[1], "norm": PALETTE[6],
    "embedding": "#999999", "position": "#A6761D",
}  # fmt: skip
HIGHLIGHT = "#E41A1C"  # the outline and tag of what a frame changed
_EDGE = {"fill": False, "edgecolor": HIGHLIGHT, "linewidth": 2.5}
_NAMES = {"full": "full attention", "sliding": "sliding window",
          "linear": "Gated DeltaNet", "csa": "compressed sparse",
          "hca": "heavily compressed"}  # fmt: skip


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
    detail = "gain 1 + w" if cfg.norm_offset else ("no bias" if not cfg.bias else "")
    return Part("norm", "RMSNorm" if cfg.norm == "rmsnorm" else "LayerNorm", detail)


def _mixer_kind(cfg: ModelConfig, layer: int) -> str:
    """``"full"``, ``"sliding"``, ``"linear"`` or, for MLA's attention, ``"latent"``."""
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
        detail = (f"{lin.key_heads}:{lin.value_heads} heads, state {lin.key_dim}×"
                  f"{lin.value_dim} per head, conv {lin.conv_kernel}")  # fmt: skip
        return Part("linear", _linear_name(cfg), detail)
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
    h, h_kv = cfg.n_heads, cfg.n_kv_heads
    title = f"{head_sharing(h, h_kv)} {h}:{h_kv}, head dim {cfg.head_dim}"
    if kind == "sliding":
        extras.insert(0, f"window {cfg.sliding_window}")
    extras += ["QK-norm" if cfg.qk_norm != "none" else "",
               "sinks" if cfg.attn_sinks else "",
               "output gate" if cfg.attn_output_gate else "",
               "qkv bias" if cfg.qkv_bias else ""]  # fmt: skip
    return Part(kind, title, ", ".join(x for x in extras if x))


def _ffn(cfg: ModelConfig, layer: int) -> Part:
    act = cfg.activation.split("_")[0].upper()
    glu = f"{GLU_NAMES[cfg.activation]}, 3 matrices"
    form = glu if cfg.ffn == "glu" else f"{act} MLP, 2 matrices"
    if cfg.is_moe_layer(layer):
        moe = cfg.moe
        shared = " + 1 shared" if moe.shared_d_ff else ""
        title = f"MoE {moe.n_experts} routed{shared}, top-{moe.experts_per_token}"
        detail = f"{form}, expert width {moe.expert_d_ff}, {moe.router} router"
        return Part("moe", title, detail)
    return Part("dense", "FFN", f"{form}, width {cfg.d_ff}" + (", bias" * cfg.bias))


def _block_slots(cfg: ModelConfig, layer: int) -> list[tuple[str, Part]]:
    """``block_parts`` with their places ("mixer", "ffn norm before", "mixer add")."""
    if not 0 <= layer < cfg.n_layers:
        raise ValueError(f"layer must be in [0, n_layers={cfg.n_layers}), got {layer}")
    drop = f"dropout {cfg.dropout:g}" if cfg.dropout else ""
    slots: list[tuple[str, Part]] = []
    w = cfg.norm_placement
    pre, branch = w in ("pre", "sandwich"), w in ("sandwich", "post_branch")
    for name, sub in (("mixer", _mixer(cfg, layer)), ("ffn", _ffn(cfg, layer))):
        slots += [(f"{name} norm before", _norm(cfg))] * pre + [(name, sub)]
        slots += [(f"{name} norm on branch", _norm(cfg))] * branch
        slots += [(f"{name} add", Part("add", "+", drop))]
        slots += [(f"{name} norm after", _norm(cfg))] * (w == "post")
    return slots


def block_parts(cfg: ModelConfig, layer: int = 0) -> list[Part]:
    """Layer ``layer``'s block in the order the stream meets it; ``Part("add", "+")``
    marks where a sublayer's output joins the residual stream."""
    return [part for _, part in _block_slots(cfg, layer)]


def end_parts(cfg: ModelConfig) -> dict[str, Part]:
    """What lies outside the blocks: the positional signal (added, or RoPE inside
    attention), embedding, final norm (none after post-norm blocks) and head."""
    V, d, f = f"{cfg.vocab_size:,}", cfg.d_model, cfg.partial_rotary_factor
    scale = ", × √d" if cfg.scale_embeddings else ""
    share = f"{f:g} of each head's" if f < 1 else "each head's"
    position = {"sinusoidal": ("+ sinusoidal positions", "added to the tokens"),
                "learned": ("+ learned positions", f"{cfg.max_seq_len:,} × {d}"),
                "rope": ("RoPE in attention", f"rotates {share} q and k"),
                }.get(cfg.position, ("no positions", "NoPE"))  # fmt: skip
    tied = "tied to the embedding" if cfg.tie_embeddings else "own weights"
    parts = {"embedding": Part("embedding", "token embedding", f"{V} × {d}{scale}"),
             "position": Part("position", *position),
             "final norm": Part("norm", "final norm", _norm(cfg).title),
             "head": Part("embedding", "output head", f"{d} → {V}, {tied}"),
             }  # fmt: skip
    post = cfg.norm_placement == "post"  # post-norm blocks end in a norm already
    return {k: p for k, p in parts.items() if not (post and k == "final norm")}


def changed_parts(old: ModelConfig, new: ModelConfig) -> list[tuple[int, str]]:
    """The boxes of ``new``'s frame that differ from ``old``'s: (first layer of the
    column, place in the block), then (-1, key of :func:`end_parts`)."""
    blocks = [(first, dict(_block_slots(old, first)), _block_slots(new, first))
              for first, *_ in layer_groups(new).values()]  # fmt: skip
    changed = [(i, k) for i, was, now in blocks for k, p in now if was.get(k) != p]
    was, now = end_parts(old), end_parts(new)
    return changed + [(-1, k) for k in now if was.get(k) != now[k]]


def layer_groups(cfg: ModelConfig) -> dict[tuple[str, str, bool], list[int]]:
    """(mixer kind, FFN kind, NoPE) -> the layers with that block, by first layer."""
    groups: dict[tuple[str, str, bool], list[int]] = {}
    for layer in range(cfg.n_layers):
        ffn = "moe" if cfg.is_moe_layer(layer) else "dense"
        key = (_mixer_kind(cfg, layer), ffn, layer in cfg.nope_layers)
        groups.setdefault(key, []).append(layer)
    return groups


def _ranges(layers: list[int]) -> str:
    steps = groupby(enumerate(layers), lambda t: t[1] - t[0])  # runs of consecutive
    runs = [[i for _, i in run] for _, run in steps]
    text = [f"{r[0]}" if len(r) == 1 else f"{r[0]}–{r[-1]}" for r in runs[:3]]
    return ", ".join(text) + (", …" if len(runs) > 3 else "")


def _box(ax: plt.Axes, x: float, y: float, w: float, h: float, part: Part,
         wrap: int = 40, mark: str | None = None) -> None:  # fmt: skip
    color = COLORS[part.kind]
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, facecolor=color,
                 alpha=0.3, boxstyle="round,pad=0.02,rounding_size=0.08",
                 edgecolor=color, linewidth=1.5))  # fmt: skip
    lines = textwrap.wrap(part.detail, wrap)
    ax.text(x, y + 0.09 * len(lines), part.title, ha="center", va="center", fontsize=9)
    if lines:
        ax.text(x, y - 0.1 - 0.04 * len(lines), "\n".join(lines), ha="center", va="center",
                fontsize=6.5, linespacing=1.1)  # fmt: skip
    if mark is not None:  # outlined as changed, tagged if ``mark``
        style = "round,pad=0.05,rounding_size=0.1"
        _mark(ax, FancyBboxPatch((x - w / 2, y - h / 2), w, h, style, **_EDGE),
              x + w / 2, y + h / 2, mark)  # fmt: skip


def _mark(ax: plt.Axes, outline: Patch, x: float, y: float, label: str) -> None:
    ax.add_patch(outline)
    if label:
        ax.text(x, y + 0.05, label, ha="right", va="center", fontsize=7.5, zorder=5,
                color="white", fontweight="bold", bbox={"boxstyle": "round,pad=0.2",
                "fc": HIGHLIGHT, "ec": HIGHLIGHT})  # fmt: skip


def block_diagram(cfg: ModelConfig, ax: plt.Axes | None = None,
                  changed_from: ModelConfig | None = None, label: str = "") -> Figure:
    """One column per kind of block in the stack (stream bottom to top, the residual
    path on the left), each titled with the layers it stands for; into ``ax`` if given
    (one frame of an animation), else into a figure sized to the columns. With
    ``changed_from`` (a morph's step before, or ``cfg``) it adds :func:`end_parts` and
    outlines :func:`changed_parts`, the first tagged with ``label``."""
    ends = changed_from is not None
    marks = changed_parts(changed_from, cfg) if ends else []
    tags = {key: "" if i else label for i, key in enumerate(marks)}  # the first: label

    columns = [(_block_slots(cfg, g[0]), g) for g in layer_groups(cfg).values()]
    width, step, rows = 3.4, 0.86, max(len(c) for c, _ in columns)
    height = rows * step + 1.2 + (2.5 * step if ends else 0)
    if ax is None:
        _, ax = plt.subplots(figsize=(3.3 * len(columns) + 0.4, 0.72 * height + 0.3))
    right = (len(columns) - 1) * (width + 0.6) + width / 2
    # what every layer shares spans two columns at least: in place as a morph splits
    span = max(right, width + 0.6) + width / 2
    end = end_parts(cfg) if ends else {}
    top = rows * step + 0.4 + step + 1.3
    for y, row in ((0.4, ["embedding", "position"]), (top, ["final norm", "head"])):
        row = [k for k in row if k in end]
        w = (span - 0.3 * (len(row) - 1)) / max(len(row), 1)
        for k, key in enumerate(row):
            x = -width / 2 + w / 2 + k * (w + 0.3)
            _box(ax, x, y, w, 0.6, end[key], int(12 * w), tags.get((-1, key)))
    for col, (slots, layers) in enumerate(columns):
        x0 = col * (width + 0.6)
        y = 0.4 + (step if ends else 0)
        start = 0.7 if ends else y - 0.15  # from the embedding row, if drawn
        ax.annotate("", (x0, y + 0.35), (x0, start), arrowprops={"arrowstyle": "->"})
        branch_start = y + 0.1
        for slot, part in slots:
            y += step
            tag = tags.get((layers[0], slot))
            if part.kind == "add":
                ax.add_patch(Circle((x0, y), 0.16, fc="white", ec="black"))
                ax.text(x0, y, "+", ha="center", va="center", fontsize=11)
                if part.detail:
                    ax.text(x0 + 0.25, y, part.detail, fontsize=6.5, va="center")
                skip = x0 - width / 2 - 0.15
                ax.plot([x0, skip, skip, x0 - 0.16], [branch_start, branch_start, y, y],
                        "k-", lw=1)  # fmt: skip
                ax.plot([x0, x0], [y + 0.16, y + step - 0.3], "k-", lw=1)
                branch_start = y + 0.3
                if tag is not None:
                    _mark(ax, Circle((x0, y), 0.25, **_EDGE), x0 + 1.2, y + 0.25, tag)
            else:
                _box(ax, x0, y, width, 0.64, part, mark=tag)
                ax.plot([x0, x0], [y + 0.32, y + step - 0.3], "k-", lw=1)
        n, total = len(layers), cfg.n_layers
        which = f"{n} of {total} layers: {_ranges(layers)}" if n < total else (
            f"all {total} layers")  # fmt: skip
        ax.text(x0, y + 0.7, which, ha="center", fontsize=9, fontweight="bold")
    xlim = (-width / 2 - 0.4, max(right, span - width / 2 if ends else 0) + 0.2)
    ax.set(xlim=xlim, ylim=(-0.3, height + 0.3), aspect="equal")
    ax.set_axis_off()
    return ax.figure


def model_diagram(cfg: ModelConfig, ax: plt.Axes | None = None) -> Figure:
    """The whole model left to right: embedding, the stack as a strip of token-mixer
    kinds over a strip of FFN kinds, final norm and head (into ``ax`` if given)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9.0, 2.9))
    n, strip = cfg.n_layers, 6.0
    cell = strip / n
    added = {"learned": " + learned positions", "sinusoidal": " + sinusoids"}
    scale = " × √d" if cfg.scale_embeddings else ""
    embed = f"{cfg.vocab_size:,} × {cfg.d_model}{scale}{added.get(cfg.position, '')}"
    _box(ax, -1.3, 0.5, 2.2, 0.9, Part("embedding", "embedding", embed), wrap=26)
    mixers = [_mixer_kind(cfg, i) for i in range(n)]
    ffns = ["moe" if cfg.is_moe_layer(i) else "dense" for i in range(n)]
    for i in range(n):
        for row, kind in ((0.55, mixers[i]), (0.0, ffns[i])):
            ax.add_patch(Rectangle((i * cell, row), cell, 0.45, facecolor=COLORS[kind],
                         alpha=0.7, edgecolor="white", lw=0.5 if n > 40 else 1.0))
    counts = {k: mixers.count(k) for k in dict.fromkeys(mixers)}
    names = {**_NAMES, "latent": "latent attention", "linear": _linear_name(cfg)}
    mix_text = " + ".join(f"{c} {names[k]}" for k, c in counts.items())
    n_moe = ffns.count("moe")
    ffn_text = {0: "dense FFN in every layer", n: "MoE FFN in every layer"}.get(
        n_moe, f"{n_moe} MoE + {n - n_moe} dense FFN")  # fmt: skip
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
    _box(ax, strip + 2.45, 0.5, 1.9, 0.9, end_parts(cfg)["head"], wrap=22)
    ax.set(xlim=(-2.5, strip + 3.5), ylim=(-0.75, 1.4))
    ax.set_axis_off()
    return ax.figure

# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 14 · The morph: 2017 → 2026, one change at a time
#
# Open the modelling file of a 2026 open-weights model and the skeleton is the one from
# chapter 3: embed the tokens, run a stack of blocks (attention, residual add, FFN, residual
# add), project to the vocabulary {cite}`vaswani2017attention`. Almost every organ inside that
# skeleton has been swapped, and the preceding chapters took them one at a time. This last
# chapter puts them back in a row. We start from a small 2017-style decoder and apply the
# changes of the book in order, **one per step**, each as an explicit `replace` on a
# `ModelConfig`, so that the difference between two neighbouring models is a handful of fields
# that a cell checks.
#
# For every step we ask the questions of chapter 13: how many parameters, how many of them a
# token uses, how many bytes of cache a token costs, how many FLOPs a token needs. Then we
# train every step on the same Shakespeare characters with the same seed, data and budget, and
# look at the held-out loss. The arithmetic moves a lot; the loss, at this scale, hardly does.

# %%
# Setup: on Colab, install the companion package (no effect elsewhere).
import subprocess
import sys

if "google.colab" in sys.modules:
    REPO = "https://github.com/transformer-2017-2026/book"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", f"companion @ git+{REPO}"],
        check=True,
    )

# Then fix the CPU's numerical path (MKL branch, ATen kernels, threads)
# before torch loads, so the printed digits match the stored ones on any
# x86-64 CPU with AVX2 (companion.numerics says why and what it costs).
from companion.numerics import pin_cpu_path

pin_cpu_path()

# %%

import textwrap

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import HTML

from companion.analysis.calculator import (
    count_params,
    flops_per_token,
    kv_cache_bytes,
    kv_cache_bytes_per_token,
)
from companion.analysis.diagrams import block_diagram
from companion.device import default_device, describe
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.plotting import PALETTE, animate, glue, use_style
from companion.tasks.text import (
    CharTokenizer,
    load_shakespeare,
    sample_windows,
    split_tokens,
)
from companion.training import cosine_lr, evaluate, make_adamw, seed_everything, train

FULL = False  # True: wider models, longer runs (use a GPU)
DEVICE = default_device() if FULL else torch.device("cpu")
use_style()
seed_everything(0)
torch.set_num_threads(
    1
)  # tiny models: one thread is as fast as two on a shared machine
print(describe(DEVICE))

# %% [markdown]
# ## The 2017 starting point
#
# The starting model is the decoder half of the 2017 Transformer, at toy size: post-LayerNorm,
# sinusoidal positions added to embeddings scaled by $\sqrt d$, a ReLU MLP of width $4d$,
# one key and value head per query head, biases everywhere, dropout 0.1 and tied input and
# output embeddings. The vocabulary is the Shakespeare character set of chapter 2. It has four
# layers, because two of the later steps mix layer kinds in a 3:1 ratio.

# %%
text = load_shakespeare()
chars = CharTokenizer(text)
D, LAYERS, HEADS = (128, 8, 8) if FULL else (64, 4, 4)
SEQ = 128 if FULL else 32
base = ModelConfig(
    vocab_size=chars.vocab_size,
    d_model=D,
    n_layers=LAYERS,
    n_heads=HEADS,
    max_seq_len=SEQ,
    norm="layernorm",
    norm_placement="post",
    position="sinusoidal",
    scale_embeddings=True,
    activation="relu",
    ffn="mlp",
    bias=True,
    dropout=0.1,
    attn_dropout=0.1,
    tie_embeddings=True,
    init_std=0.1,
)
print(textwrap.fill(repr(base), 88, subsequent_indent="    "))

# %% [markdown]
# ## Thirteen changes
#
# Each entry below is one organ transplant: a name, the chapter that argued for it, and the
# fields it changes. Some changes need more than one field (SwiGLU changes the FFN kind, its
# activation and its width to $\tfrac83 d$ so the parameter count stays put, chapter 7; the
# sliding-window step needs a window and a layer pattern). The order follows, roughly, the
# order in which open models adopted them:
#
# - **pre-LN** (2019, GPT-2): the norm moves onto the branch, the residual path stays an
#   identity {cite}`xiong2020layer` (chapter 6);
# - **no dropout**: one pass over a huge corpus does not overfit {cite}`srivastava2014dropout`;
# - **RMSNorm**: no mean, no bias {cite}`zhang2019root` (chapter 6);
# - **RoPE**: position as a rotation of queries and keys {cite}`su2024roformer`, which also
#   retires the $\sqrt d$ embedding scale that existed to balance the added positions
#   (chapter 5);
# - **SwiGLU at $\tfrac83 d$** {cite}`shazeer2020glu` (chapter 7);
# - **no biases** (Llama, {cite}`touvron2023llama`);
# - **GQA**: here all four query heads share one key/value head {cite}`ainslie2023gqa`
#   (chapter 8);
# - **QK-norm**: an RMSNorm on each head's queries and keys {cite}`dehghani2023scaling`
#   (chapter 12);
# - **sliding windows 3:1**: three local layers with a 16-token window for each global one
#   {cite}`gemmateam2025gemma3` (chapter 9);
# - **MoE**: each FFN becomes 8 experts of width $d/2$, two per token
#   {cite}`shazeer2017outrageously` (chapter 10);
# - **shared expert**: one more expert of width $d/2$ that every token passes through, with
#   a sigmoid gate as in Qwen3-Next {cite}`dai2024deepseekmoe` (chapter 10);
# - **output gate**: a sigmoid gate on each attention head's output, Qwen3-Next's gated
#   attention {cite}`qiu2025gated` (chapter 12);
# - **Gated DeltaNet 3:1**: three linear-attention layers for each full one, as in Qwen3-Next
#   {cite}`yang2024gated` {cite}`qwen3next` (chapter 11).

# %%
MORPH = [  # (name, fields changed)
    ("pre-LN", {"norm_placement": "pre"}),
    ("no dropout", {"dropout": 0.0, "attn_dropout": 0.0}),
    ("RMSNorm", {"norm": "rmsnorm"}),
    ("RoPE", {"position": "rope", "scale_embeddings": False}),
    ("SwiGLU 8/3", {"ffn": "glu", "activation": "silu", "d_ff": 8 * D // 3}),
    ("no biases", {"bias": False}),
    ("GQA", {"n_kv_heads": 1}),
    ("QK-norm", {"qk_norm": "head"}),
    (
        "sliding 3:1",
        {"sliding_window": 16, "layer_types": ("sliding",) * 3 + ("full",)},
    ),
    ("MoE", {"n_experts": 8, "experts_per_token": 2, "expert_d_ff": D // 2}),
    ("shared expert", {"shared_d_ff": D // 2, "shared_expert_gate": True}),
    ("output gate", {"attn_output_gate": True}),
    (
        "DeltaNet 3:1",
        {
            "sliding_window": None,
            "layer_types": ("linear",) * 3 + ("full",),
            "linear_key_heads": 2,
            "linear_value_heads": 4,
            "linear_key_dim": D // 4,
            "linear_value_dim": D // 4,
        },
    ),
]
if FULL:  # 8 layers: keep the 3:1 patterns (by_name holds MORPH's own dicts)
    by_name = dict(MORPH)
    by_name["sliding 3:1"]["layer_types"] = (("sliding",) * 3 + ("full",)) * 2
    by_name["DeltaNet 3:1"]["layer_types"] = (("linear",) * 3 + ("full",)) * 2
# the component of the block each field belongs to: a step must change one
COMPONENT = {
    "norm_placement": "norm",
    "norm": "norm",
    "dropout": "dropout",
    "attn_dropout": "dropout",
    "position": "position",
    "scale_embeddings": "position",
    "ffn": "FFN",
    "activation": "FFN",
    "d_ff": "FFN",
    "bias": "biases",
    "n_kv_heads": "KV heads",
    "qk_norm": "QK-norm",
    "sliding_window": "token mixers",
    "layer_types": "token mixers",
    "n_experts": "routed experts",
    "experts_per_token": "routed experts",
    "expert_d_ff": "routed experts",
    "shared_d_ff": "shared expert",
    "shared_expert_gate": "shared expert",
    "attn_output_gate": "output gate",
}
COMPONENT |= {f"linear_{k}": "token mixers" for k in ("key_heads", "value_heads")}
COMPONENT |= {f"linear_{k}": "token mixers" for k in ("key_dim", "value_dim")}

names, configs = ["2017"], [base]
for name, changes in MORPH:
    names.append(name)
    configs.append(configs[-1].replace(**changes))


def changed_fields(a: ModelConfig, b: ModelConfig) -> dict[str, tuple]:
    """The fields set differently in two configs: name -> (old, new), as the model
    uses them."""
    old, new = a.settings(), b.settings()
    return {k: (getattr(a, k), getattr(b, k)) for k in old if old[k] != new[k]}


def shown(value: object) -> str:
    """A field's value for the listing; a layer pattern as full/full/..."""
    return "/".join(value) if isinstance(value, tuple) else repr(value)


components = []
for i, (name, changes) in enumerate(MORPH, start=1):
    diff = changed_fields(configs[i - 1], configs[i])
    # exactly the intended fields, nothing else, and all of one component
    assert set(diff) == set(changes), (name, diff)
    (component,) = {COMPONENT[k] for k in diff}
    components.append(component)
    print(f"{i:>2} {name:<13} [{component}]")
    for k, (old, new) in diff.items():
        print(f"{'':>5}{k}: {shown(old)} → {shown(new)}")
assert len(configs) == 14

# %% [markdown]
# Every entry is exactly one step's diff, and the asserts check that nothing else moved and
# that each step changes the fields of one component of the block only.
# `replace` builds a fresh config, so each one is validated again: a step that
# produced an impossible model (say, sliding layers without a window) would fail right here.
#
# ## What each step costs
#
# The calculator of chapter 13 turns each config into four numbers: total parameters,
# **active** parameters (what one token touches), KV-cache bytes for a 4,096-token context
# in bf16, and forward FLOPs for a token that attends to 4,096 keys. Its `count_params` is
# arithmetic on the config; we also build every model and count its tensors, which must agree
# to the parameter.

# %%
CONTEXT = 4096
rows = []
for name, cfg in zip(names, configs, strict=True):
    pc = count_params(cfg)
    with torch.device("meta"):  # shapes only
        built = DecoderLM(cfg).num_params()
    assert built == pc.total, (name, built, pc.total)
    rows.append(
        {
            "name": name,
            "total": pc.total,
            "active": pc.active,
            "kv_per_token": kv_cache_bytes_per_token(cfg),
            "kv_context": kv_cache_bytes(cfg, CONTEXT),
            "flops": flops_per_token(cfg, CONTEXT),
        }
    )
print(
    f"{'step':<13} {'params':>8} {'active':>8} {'KV B/tok':>8} "
    f"{'KV @4k (KiB)':>12} {'FLOPs/tok @4k':>14}"
)
for r in rows:
    print(
        f"{r['name']:<13} {r['total']:>8,} {r['active']:>8,} {r['kv_per_token']:>8,} "
        f"{r['kv_context'] / 1024:>12,.0f} {r['flops']:>14,}"
    )
first, last = rows[0], rows[-1]
assert (first["total"], first["active"], first["kv_per_token"]) == (
    204_800,
    204_800,
    1_024,
)
assert first["flops"] == 4_597_248 and first["kv_context"] == 4_194_304
assert (last["total"], last["active"], last["kv_per_token"]) == (295_592, 148_136, 64)
assert last["flops"] == 1_361_920 and last["kv_context"] == 276_736
assert (
    rows[7]["kv_per_token"] * 4 == rows[6]["kv_per_token"]
)  # GQA 4 → 1 KV head: ¼ the cache
assert round(last["total"] / first["total"], 2) == 1.44  # 44% more parameters
assert round(last["active"] / first["active"], 2) == 0.72  # 72% of the active ones
assert (
    last["kv_per_token"] * 16 == first["kv_per_token"]
)  # a sixteenth of the cache growth
assert round(last["flops"] / first["flops"], 2) == 0.30  # 30% of the FLOPs at 4k

# %% [markdown]
# Read the table column by column. Through the first seven steps the parameter count barely
# moves (204,800 → 201,536, under 2%): pre-LN, RMSNorm, RoPE, SwiGLU at $\tfrac83 d$ and
# dropping biases are nearly free, by design. The cache does not move at all until **GQA**
# cuts it to a quarter (1,024 → 256 bytes per token: one KV head instead of four). The
# **sliding** layers leave the per-token growth alone while the context is short, but at 4,096
# tokens three of the four layers keep only 16 positions: the cache falls from 1,024 KiB to
# 259 KiB and the FLOPs per token to less than a third, since attention over 4,096 keys is
# most of this small model's work. **MoE** adds parameters (to 245,184) while halving the
# active ones (97,728). The **shared expert** and the **output gate** then add parameters
# that every token uses (24,832 and 16,384: 138,944 active), and the **Gated DeltaNet**
# hybrid removes the per-token cache of three layers for good: 64 bytes per token, against
# a fixed state. From first row to last: 44% more parameters, yet 72% of the 2017 model's
# active ones per token, a sixteenth of the cache growth and 30% of the FLOPs at 4k
# context.
#
# ## Does the loss care?
#
# Now the experiment every chapter ended with, for all fourteen models at once: the same seed,
# the same character windows in the same order, the same AdamW and cosine schedule, the same
# number of steps. The learning rate, $3\cdot10^{-3}$, is one the 2017 post-LN model can
# survive (chapter 6 showed it training far worse at a higher rate without warmup).

# %%
ids = torch.tensor(chars.encode(text))
train_ids, val_ids = split_tokens(ids, 0.1)
BATCH, STEPS, LR = (64, 2000, 3e-3) if FULL else (32, 60, 3e-3)
val_batches = [
    sample_windows(val_ids, 256, SEQ, torch.Generator().manual_seed(500 + i), DEVICE)
    for i in range(2)
]
counts = torch.bincount(train_ids, minlength=chars.vocab_size).double()
unigram_loss = -(counts / counts.sum()).clamp_min(1e-12).log()[val_ids].mean().item()

val_loss, curves = [], []
for cfg in configs:
    seed_everything(0)
    model = DecoderLM(cfg).to(DEVICE)
    windows = torch.Generator().manual_seed(
        1
    )  # the same batches for every step of the morph
    hist = train(
        model,
        lambda step, g=windows: sample_windows(train_ids, BATCH, SEQ, g, DEVICE),
        STEPS,
        make_adamw(model, lr=LR),
        lr_at=lambda s: cosine_lr(
            s, LR, warmup=STEPS // 10, total=STEPS, min_lr=LR / 10
        ),
    )
    curves.append(hist.loss)
    val_loss.append(evaluate(model, val_batches))
    rows[len(val_loss) - 1]["loss"] = val_loss[-1]

print(f"unigram baseline: {unigram_loss:.2f} nats/char")
for name, loss in zip(names, val_loss, strict=True):
    print(f"{name:<13} held-out loss {loss:.2f}")
assert all(
    loss < unigram_loss - 0.1 for loss in val_loss
)  # every model learned something
assert (
    max(abs(loss - val_loss[0]) for loss in val_loss) < 0.6
)  # and none is far from 2017

# %% [markdown]
# Every model beats the unigram baseline, and after a minute of CPU training none of them is
# more than a few tenths of a nat from the 2017 model. The early steps (pre-LN, RoPE) help
# most here, because they make a short run train faster, not because they are better models
# in the limit. Past RoPE the losses wander by a few hundredths with no pattern: with one seed
# and 60 steps **that is noise**, and the chapter asserts nothing about it. This matches the
# field's own ablations: the changes of the last nine years were driven by memory traffic,
# numerical stability and the cost per token, and their effect on next-token loss is mostly
# within the noise. The table above, not the loss, is where the morph shows.
#
# ## The morph, animated
#
# {numref}`fig-morph` puts the fourteen models in a row, one frame per step. On the left is
# the block as `companion.block_diagram` draws it from that step's config, with one column
# per kind of layer once the stack mixes kinds; on the right, the step's parameters (total
# and active), its cache at 4k context, its FLOPs per token and its held-out loss, each
# relative to the 2017 model. The title carries the step's change and the absolute numbers
# of the table above.

# %% tags=["remove-output"]
metrics = [
    ("params", "total"),
    ("active", "active"),
    ("KV @4k", "kv_context"),
    ("FLOPs @4k", "flops"),
    ("loss", "loss"),
]
ratios = np.array([[r[key] / rows[0][key] for _, key in metrics] for r in rows])


def diagram_limits() -> tuple[tuple[float, float], tuple[float, float]]:
    """The extent that holds every step's diagram, so that the frames do not jump."""
    scratch = plt.figure()
    ax = scratch.add_subplot()
    xs, ys = [], []
    for cfg in configs:
        ax.clear()
        block_diagram(cfg, ax=ax)
        xs += ax.get_xlim()
        ys += ax.get_ylim()
    plt.close(scratch)
    return (min(xs), max(xs)), (min(ys), max(ys))


XLIM, YLIM = diagram_limits()
drawn = {}  # frame -> the texts its block diagram shows


def step_title(i: int) -> str:
    r = rows[i]
    change = f"step {i}/{len(MORPH)}: {names[i]} ({components[i - 1]})"
    return (
        f"{change if i else 'the 2017 decoder'}\n"
        f"{r['total']:,} params, {r['active']:,} active · "
        f"KV {r['kv_per_token']:,} B/token · {r['flops'] / 1e6:.2f} MFLOP/token @4k"
    )


def draw_block(ax: plt.Axes, i: int) -> None:
    ax.clear()
    block_diagram(configs[i], ax=ax)
    ax.set(xlim=XLIM, ylim=YLIM)
    drawn[i] = [t.get_text() for t in ax.texts]


fig, (ax_block, ax_bars) = plt.subplots(1, 2, figsize=(9, 5.6), width_ratios=[2.5, 1])


def draw_morph(i: int) -> None:
    draw_block(ax_block, i)
    ax_bars.clear()
    ax_bars.barh(range(len(metrics)), ratios[i], color=PALETTE[: len(metrics)])
    ax_bars.axvline(1.0, color="black", lw=0.8, ls="--")
    ax_bars.set_yticks(range(len(metrics)), [label for label, _ in metrics])
    ax_bars.invert_yaxis()
    ax_bars.set(xlim=(0, 1.75), xlabel="relative to 2017")
    for j, v in enumerate(ratios[i]):
        ax_bars.text(v + 0.03, j, f"{v:.2f}", va="center", fontsize=8)
    fig.suptitle(step_title(i), fontsize=11)


glue("fig-morph", HTML(animate(fig, draw_morph, len(configs), interval_ms=1200)))
# the same frames, smaller, for the book's first page
fig_small, ax_small = plt.subplots(figsize=(5, 4.4))


def draw_small(i: int) -> None:
    draw_block(ax_small, i)
    ax_small.set_title(f"{i}/{len(MORPH)}: {names[i]}", fontsize=10)


glue("fig-morph-small", HTML(animate(fig_small, draw_small, len(configs), 1200)))
assert sorted(drawn) == list(range(len(configs)))  # a frame for every step
# every step changes what the block diagram shows...
assert all(drawn[i] != drawn[i - 1] for i in range(1, len(configs)))
# ... from one column of full attention to the hybrid's two kinds of layer
n_linear = configs[-1].layer_types.count("linear")
assert f"all {LAYERS} layers" in drawn[0] and "Gated DeltaNet" not in drawn[0]
assert f"{n_linear} of {LAYERS} layers: 0–2" in drawn[len(configs) - 1]
assert f"{LAYERS - n_linear} of {LAYERS} layers: 3" in drawn[len(configs) - 1]
assert "Gated DeltaNet" in drawn[len(configs) - 1]
assert ratios[-1, 2] < 0.1 and ratios[-1, 3] < 0.3 and ratios[-1, 0] > 1.2

# %% [markdown]
# ```{glue:figure} fig-morph
# :name: fig-morph
#
# The 2017 decoder turned into a 2026 hybrid, one component per frame. Left: the block of
# each step, drawn from its `ModelConfig` (the stream runs bottom to top, the residual path
# on the left; one column per kind of layer). Right: parameters, active parameters, cache
# at 4k context, FLOPs per token and held-out loss relative to the 2017 model (dashed line).
# Watch the norm move in front of the sublayers (step 1), the FFN become SwiGLU (5), the
# heads share one key/value head (7), the stack split into sliding and full layers (9),
# the experts arrive (10, 11) and the sliding layers become Gated DeltaNet (13). The cache
# and FLOPs bars fall at steps 7 and 9 and the parameters grow from step 10 on, while the
# loss bar hardly moves after RoPE (4).
# ```

# %% [markdown]
# ## Summary
#
# - The 2026 decoder is the 2017 decoder with thirteen transplants; each is a few config
#   fields of one component, and a config diff shows exactly what moved.
# - Pre-LN, RMSNorm, RoPE, SwiGLU at $\tfrac83 d$ and dropping biases leave the size almost
#   unchanged (−2% here): they were adopted for stability and simplicity (chapters 5-7).
# - GQA, sliding windows and linear-attention hybrids attack the cache: from 1,024 to 64
#   bytes per token here, a sixteenth (chapters 8, 9, 11).
# - MoE decouples parameters from compute: the final model, shared expert and output gates
#   included, stores 44% more parameters than the 2017 one but uses 72% as many per token
#   (chapters 10, 12).
# - On a small character model, the held-out loss of all fourteen steps stays within a few
#   tenths of the 2017 model: the book's arc is about **cost** (memory traffic, precision,
#   FLOPs per token), not about a better next-token predictor.
#
# ## Exercises
#
# 1. Move the MoE step before GQA. Which columns of the table change, and which stay the
#    same at the end?
#
# ```{admonition} Solution
# :class: dropdown
# Reorder `MORPH` and rerun. The last row is identical: the final config does not depend on
# the order of the replaces, only the intermediate rows do. The intermediate rows between
# the two steps now carry 8 experts with 4 KV heads.
# ```
#
# 2. Replace the GQA step by multi-head latent attention (chapter 8's MLA: `kv_lora_rank`,
#    `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`). How small can the cache get
#    before the parameter count grows?
#
# ```{admonition} Hint
# :class: dropdown
# MLA caches $r + R$ numbers per layer and token. With `kv_lora_rank=16`, `qk_rope_head_dim=8`
# the cache is 24 numbers per layer against 32 for GQA with one head of 16; the up-projections
# add parameters. `count_params` and `kv_cache_bytes_per_token` answer it in one cell.
# ```
#
# 3. Rerun the loss experiment with three seeds (0, 1, 2) and compute each step's mean and
#    standard deviation. How many steps differ from their predecessor by more than two
#    standard deviations?
#
# ```{admonition} Hint
# :class: dropdown
# Loop `seed_everything(seed)` and the window generator over the seeds. Expect the pre-LN
# and RoPE steps to stand out in a short run and most of the others not to.
# ```
#
# 4. Set `FULL = True` on a GPU. Do the sliding-window and DeltaNet steps still cost nothing
#    in loss at 2,000 steps and a 128-token context?
#
# ```{admonition} Hint
# :class: dropdown
# With a 128-token context, a 16-token window hides most of the sequence from three of every
# four layers; the one full layer in four carries the long-range information (chapter 9).
# ```
#
# 5. Add a fourteenth step, untied embeddings (`tie_embeddings=False`), as in most 2026 models.
#    How many parameters does it add, and what fraction of the final model is that?
#
# ```{admonition} Solution
# :class: dropdown
# It adds a second $V \times d$ matrix: $76 \cdot 64 = 4{,}864$ parameters, 1.6% of the
# final 295,592. In a large model with a big vocabulary (Llama 3: 128,256 × 4,096 = 525M)
# it is still a few percent of the total.
# ```

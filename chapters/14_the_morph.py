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
# A 2026 open-weights model still has the outline of the decoder of
# {doc}`chapter 3 <03_transformer_2017>`: a token table at the bottom, a tower of blocks in which a step that
# mixes positions and a per-position FFN each add into the residual stream, and a
# projection onto the vocabulary at the top {cite}`vaswani2017attention`. What sits inside
# the blocks has been replaced nearly piece by piece, and the chapters before this one
# examined the replacements separately. This last chapter puts them back in a row. We start from a small 2017-style decoder and apply the
# changes of the book in order, **one per step**, each as an explicit `replace` on a
# `ModelConfig`, so that the difference between two neighbouring models is a handful of fields
# that a cell checks.
#
# For every step we ask the questions of {doc}`chapter 13 <13_build_a_model>`: how many parameters, how many of them a
# token uses, how many bytes of cache a token costs, how many FLOPs a token needs. Then we
# train every step on the same Shakespeare characters with the same seed, data and budget, and
# look at the held-out loss. The arithmetic moves by factors. The loss moves too, by up to
# {glue:text}`ch14-loss-drop-max` nats, but nearly all of that in the first four steps;
# what the later steps do to the loss, one short run cannot tell.

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
# output embeddings. The vocabulary is the Shakespeare character set of
# {doc}`chapter 2 <02_attention>`. It has four
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
# Each entry below is one replacement: a name, the chapter that argued for it, and the
# fields it changes. Some changes need more than one field (SwiGLU changes the FFN kind, its
# activation and its width to $\tfrac83 d$ so the parameter count stays put,
# {doc}`chapter 7 <07_gated_ffn>`; the
# sliding-window step needs a window and a layer pattern). The order follows, roughly, the
# order in which open models adopted them:
#
# - **pre-LN** (2019, GPT-2): the norm moves onto the branch, the residual path stays an
#   identity {cite}`xiong2020layer` ({doc}`chapter 6 <06_normalization>`);
# - **no dropout** {cite}`srivastava2014dropout`: a model that sees each token of a huge
#   corpus about once has little to overfit;
# - **RMSNorm**: no mean, no bias {cite}`zhang2019root` ({doc}`chapter 6 <06_normalization>`);
# - **RoPE**: position as a rotation of queries and keys {cite}`su2024roformer`, which also
#   retires the $\sqrt d$ embedding scale that existed to balance the added positions
#   ({doc}`chapter 5 <05_position>`);
# - **SwiGLU at $\tfrac83 d$** {cite}`shazeer2020glu` ({doc}`chapter 7 <07_gated_ffn>`);
# - **no biases** (Llama, {cite}`touvron2023llama`);
# - **GQA**: here all four query heads share one key/value head {cite}`ainslie2023gqa`
#   ({doc}`chapter 8 <08_kv_cache>`);
# - **QK-norm**: an RMSNorm on each head's queries and keys {cite}`dehghani2023scaling`
#   ({doc}`chapter 6 <06_normalization>`);
# - **sliding windows 3:1**: three local layers with a 16-token window for each global one
#   {cite}`gemmateam2025gemma3` ({doc}`chapter 9 <09_sliding_windows>`);
# - **MoE**: each FFN becomes 8 experts of width $d/2$, two per token
#   {cite}`shazeer2017outrageously` ({doc}`chapter 10 <10_mixture_of_experts>`);
# - **shared expert**: one more expert of width $d/2$ that every token passes through, with
#   a sigmoid gate as in Qwen3-Next {cite}`dai2024deepseekmoe` ({doc}`chapter 10 <10_mixture_of_experts>`);
# - **output gate**: a sigmoid gate on each attention head's output, Qwen3-Next's gated
#   attention {cite}`qiu2025gated` ({doc}`chapter 12 <12_small_changes>`);
# - **Gated DeltaNet 3:1**: three linear-attention layers for each full one, as in Qwen3-Next
#   {cite}`yang2024gated` {cite}`qwen3next` ({doc}`chapter 11 <11_linear_attention>`). It takes the place of the
#   sliding layers of step 9.

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
# The calculator of {doc}`chapter 13 <13_build_a_model>` turns each config into four numbers: total parameters,
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
V, d, n = chars.vocab_size, D, LAYERS
# the 2017 row by hand: per layer 4d² attention weights + 4d biases, 8d² FFN weights +
# 5d biases, two LayerNorms (4d); the tied table Vd; no final norm after post-LN
assert first["total"] == first["active"] == n * (12 * d * d + 13 * d) + V * d
# FLOPs: 2 per weight a token goes through (not the lookup), 4 d per key for attention
assert first["flops"] == 2 * (n * 12 * d * d + V * d) + 4 * n * d * CONTEXT
assert first["kv_per_token"] == n * 2 * d * 2  # K and V, all heads, bf16
# the last row by hand: each full layer caches K, V of one head; each linear layer holds
# 4 fp32 states of d/4 × d/4 and 3 bf16 inputs of its convolution (q, k: 2 heads of d/4;
# v: 4 heads of d/4)
n_lin = configs[-1].layer_types.count("linear")
n_sw = configs[names.index("sliding 3:1")].layer_types.count("sliding")
dk, hd = D // 4, configs[-1].head_dim
state = 4 * dk * dk * 4 + 3 * (2 * 2 * dk + 4 * dk) * 2
assert last["kv_per_token"] == (LAYERS - n_lin) * 2 * hd * 2
assert last["kv_context"] == last["kv_per_token"] * CONTEXT + n_lin * state
assert rows[7]["kv_per_token"] * 4 == rows[6]["kv_per_token"]  # GQA: ¼ the cache
assert last["total"] > first["total"] and last["active"] < first["active"]
assert last["flops"] < first["flops"] / 3
step = dict(zip(names, rows, strict=True))
sw, og, dn = step["sliding 3:1"], step["output gate"], step["DeltaNet 3:1"]
# the DeltaNet step adds parameters, undoes the window and, at 4k, costs cache and FLOPs
assert dn["total"] - og["total"] == dn["active"] - og["active"] > 0
assert configs[-1].sliding_window is None and "sliding" not in configs[-1].layer_types
assert dn["kv_context"] > og["kv_context"] == sw["kv_context"]
assert dn["flops"] > og["flops"]
per_layer = og["kv_per_token"] // LAYERS  # bytes per token and layer
window = n_sw * 16 * per_layer  # the sliding layers hold 16 positions each
assert og["kv_context"] == (LAYERS - n_sw) * per_layer * CONTEXT + window


def pct(a: float, b: float) -> str:
    return f"{a / b:.0%}"


for key, value in {
    "p0": f"{first['total']:,}",
    "p6": f"{step['no biases']['total']:,}",
    "p6-change": f"{step['no biases']['total'] / first['total'] - 1:+.1%}",
    "kvtok0": f"{first['kv_per_token']:,}",
    "kvtok7": f"{step['GQA']['kv_per_token']:,}",
    "kv7": f"{step['GQA']['kv_context'] / 1024:,.0f}",
    "kv9": f"{sw['kv_context'] / 1024:,.0f}",
    "flop9": pct(sw["flops"], step["QK-norm"]["flops"]),
    "p10": f"{step['MoE']['total']:,}",
    "a10": f"{step['MoE']['active']:,}",
    "a10pct": pct(step["MoE"]["active"], sw["active"]),
    "shared": f"{step['shared expert']['total'] - step['MoE']['total']:,}",
    "gate": f"{og['total'] - step['shared expert']['total']:,}",
    "a12": f"{og['active']:,}",
    "dn-params": f"{dn['total'] - og['total']:,}",
    "p13": f"{dn['total']:,}",
    "a13": f"{dn['active']:,}",
    "kvtok13": f"{dn['kv_per_token']:,}",
    "kv12": f"{og['kv_context'] / 1024:,.0f}",
    "kv13": f"{dn['kv_context'] / 1024:,.0f}",
    "dn-state": f"{n_lin * state:,}",
    "sw-window": f"{window:,}",
    "flop12": f"{og['flops']:,}",
    "flop13": f"{dn['flops']:,}",
    "dn-flop-up": f"{dn['flops'] / og['flops'] - 1:.1%}",
    "p-more": f"{last['total'] / first['total'] - 1:.0%}",
    "a-share": pct(last["active"], first["active"]),
    "kv-div": f"{first['kv_per_token'] // last['kv_per_token']}",
    "flop-share": pct(last["flops"], first["flops"]),
    "final-total": f"{last['total']:,}",
    "untie-share": f"{V * d / last['total']:.1%}",
}.items():
    glue(f"ch14-{key}", value, display=False)

# %% [markdown]
# Read the table column by column. Through the first six steps the parameter count barely
# moves ({glue:text}`ch14-p0` → {glue:text}`ch14-p6`, {glue:text}`ch14-p6-change`): pre-LN,
# RMSNorm, RoPE, SwiGLU at $\tfrac83 d$ and dropping biases are nearly free, by design. The
# cache does not move at all until **GQA** cuts it to a quarter ({glue:text}`ch14-kvtok0`
# → {glue:text}`ch14-kvtok7` bytes per token: one KV head instead of four). The **sliding**
# layers leave the per-token growth alone while the context is short, but at 4,096 tokens
# three of the four layers keep only 16 positions: the cache falls from
# {glue:text}`ch14-kv7` KiB to {glue:text}`ch14-kv9` KiB and the FLOPs per token to
# {glue:text}`ch14-flop9` of the step before, since attention over 4,096 keys is most of
# this small model's work. **MoE** adds parameters (to {glue:text}`ch14-p10`) while cutting
# the active ones to {glue:text}`ch14-a10` ({glue:text}`ch14-a10pct` of the step before).
# The **shared expert** and the **output gate** then add parameters that every token uses
# ({glue:text}`ch14-shared` and {glue:text}`ch14-gate`: {glue:text}`ch14-a12` active).
#
# The **Gated DeltaNet** step is not free either. It adds {glue:text}`ch14-dn-params`
# parameters, all of them active (to {glue:text}`ch14-p13` in total and
# {glue:text}`ch14-a13` active): a linear layer's projections, convolution, gates and norm
# outweigh the attention layer it replaces. And it undoes step 9: the three sliding layers
# become linear layers and the window is gone (`sliding_window` is `None` again). Only the
# full layer's cache now grows with the context, {glue:text}`ch14-kvtok13` bytes per token,
# but at a 4,096-token context the sliding windows were cheaper still: the three fixed
# states hold {glue:text}`ch14-dn-state` bytes where the three 16-token windows held
# {glue:text}`ch14-sw-window`, so the cache at 4k grows from {glue:text}`ch14-kv12` to
# {glue:text}`ch14-kv13` KiB, and the FLOPs per token rise by {glue:text}`ch14-dn-flop-up`
# ({glue:text}`ch14-flop12` → {glue:text}`ch14-flop13`). What the linear layers buy over a
# window is not a smaller cache at this length but a memory of the whole past in a fixed
# state ({doc}`chapter 11 <11_linear_attention>`).
#
# From first row to last: {glue:text}`ch14-p-more` more parameters, yet
# {glue:text}`ch14-a-share` of the 2017 model's active ones per token, a
# {glue:text}`ch14-kv-div`th of the cache growth per token and {glue:text}`ch14-flop-share`
# of the FLOPs at 4k context.
#
# ## Does the loss care?
#
# Now the experiment every chapter ended with, for all fourteen models at once: the same seed,
# the same character windows in the same order, the same AdamW and cosine schedule, the same
# number of steps. The learning rate, $3\cdot10^{-3}$ after a short warmup, is one the
# 2017 post-LN model trains at ({doc}`chapter 6 <06_normalization>` shows what post-LN does at a higher rate
# without warmup).

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
i_rope = names.index("RoPE")
drops = [val_loss[0] - loss for loss in val_loss]
assert min(drops[1:]) > 0.1  # every later step ends below the 2017 model
assert drops[i_rope] > 0.7 * max(drops)  # most of the fall is in the first four steps
late = val_loss[i_rope:]
worst_late = names[i_rope + late.index(max(late))]
for key, value in {
    "unigram": f"{unigram_loss:.2f}",
    "loss-2017": f"{val_loss[0]:.2f}",
    "loss-rope": f"{val_loss[i_rope]:.2f}",
    "loss-drop-max": f"{max(drops):.2f}",
    "loss-drop-min": f"{min(drops[1:]):.2f}",
    "loss-drop-rope": f"{drops[i_rope]:.2f}",
    "loss-preln-gain": f"{drops[1]:.2f}",
    "loss-rope-gain": f"{val_loss[i_rope - 1] - val_loss[i_rope]:.2f}",
    "loss-late-range": f"{max(late) - min(late):.2f}",
    "loss-late-worst": worst_late,
}.items():
    glue(f"ch14-{key}", value, display=False)

# %% [markdown]
# Every model beats the unigram baseline ({glue:text}`ch14-unigram` nats per character),
# and every later step ends below the 2017 model, by {glue:text}`ch14-loss-drop-min` to
# {glue:text}`ch14-loss-drop-max` nats. The loss does move: from
# {glue:text}`ch14-loss-2017` to {glue:text}`ch14-loss-rope` in the first four steps, pre-LN
# alone taking {glue:text}`ch14-loss-preln-gain` nats and RoPE
# {glue:text}`ch14-loss-rope-gain`. We read those gains as a short run training faster
# (pre-LN needs little warmup, RoPE hands every layer relative positions), which this run
# cannot tell apart from a better model in the limit. Past RoPE the losses spread over
# {glue:text}`ch14-loss-late-range` nats (the {glue:text}`ch14-loss-late-worst` step
# highest) with no pattern we would trust: with one seed and 60 steps we cannot tell those
# differences from noise (exercise 3 measures the seed spread), and the chapter asserts
# nothing about them. What the later changes do to the loss of a large model trained for
# long is a question for the papers cited with each step; a run this small neither
# confirms nor contradicts them. At this scale the morph shows in the table above, in
# memory, parameters and FLOPs, far more than in the loss.
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
# and FLOPs bars fall at steps 7 and 9, the parameters grow from step 10 on and the cache
# and FLOPs bars rise a little at step 13. The loss bar falls by
# {glue:text}`ch14-loss-drop-rope` nats over the first four steps and the later steps
# spread over {glue:text}`ch14-loss-late-range` nats.
# ```

# %% [markdown]
# ## Summary
#
# - The 2026 decoder is the 2017 decoder with thirteen replacements; each is a few config
#   fields of one component, and a config diff shows exactly what moved.
# - Pre-LN, RMSNorm, RoPE, SwiGLU at $\tfrac83 d$ and dropping biases leave the size almost
#   unchanged ({glue:text}`ch14-p6-change` here): they were adopted for stability and
#   simplicity ({doc}`chapters 5 <05_position>`, {doc}`6 <06_normalization>` and
#   {doc}`7 <07_gated_ffn>`).
# - GQA, sliding windows and linear-attention hybrids attack the cache: from
#   {glue:text}`ch14-kvtok0` to {glue:text}`ch14-kvtok13` bytes per token here
#   ({doc}`chapters 8 <08_kv_cache>`, {doc}`9 <09_sliding_windows>` and
#   {doc}`11 <11_linear_attention>`). The Gated DeltaNet step replaces the sliding layers
#   and, at a 4k context, costs a little more cache and FLOPs than they did, plus
#   {glue:text}`ch14-dn-params` parameters.
# - MoE decouples parameters from compute: the final model, shared expert, output gates and
#   linear layers included, stores {glue:text}`ch14-p-more` more parameters than the 2017
#   one but uses {glue:text}`ch14-a-share` as many per token
#   ({doc}`chapters 10 <10_mixture_of_experts>` and {doc}`12 <12_small_changes>`).
# - On a small character model the held-out loss falls by up to
#   {glue:text}`ch14-loss-drop-max` nats, nearly all of it in the first four steps; what
#   the later steps do to it, one seed and 60 steps cannot say. What they do to the cost
#   (memory traffic, parameters, FLOPs per token) the table shows exactly.
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
# 2. Replace the GQA step by multi-head latent attention ({doc}`chapter 8 <08_kv_cache>`'s MLA: `kv_lora_rank`,
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
# 4. Set `FULL = True` on a GPU. Do the sliding-window and DeltaNet steps change the loss,
#    beyond the seed spread of exercise 3, at 2,000 steps and a 128-token context?
#
# ```{admonition} Hint
# :class: dropdown
# With a 128-token context, a 16-token window hides most of the sequence from three of every
# four layers; the one full layer in four carries the long-range information
# ({doc}`chapter 9 <09_sliding_windows>`).
# ```
#
# 5. Add a fourteenth step, untied embeddings (`tie_embeddings=False`), as in most 2026 models.
#    How many parameters does it add, and what fraction of the final model is that?
#
# ```{admonition} Solution
# :class: dropdown
# It adds a second $V \times d$ matrix: $76 \cdot 64 = 4{,}864$ parameters,
# {glue:text}`ch14-untie-share` of the final {glue:text}`ch14-final-total`. In a large model with a big vocabulary (Llama 3: 128,256 × 4,096 = 525M)
# it is still a few percent of the total.
# ```

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
# # 7 · The FFN learned to gate
#
# ```{admonition} The question
# :class: tip
# What did the feed-forward network gain when the 2017 two-matrix MLP gave way to SwiGLU's three gated matrices at the same parameter count?
# The switch from GELU to SiLU changes almost nothing, while the gate lets one layer compute products that an MLP of the same size only approximates (over ten times lower error on a toy task). On Shakespeare at our small scale, over five paired seeds, all three gated FFNs end with a lower training loss than the MLP by more than the seeds' interval. {glue:text}`ch07-val-verdict` Squared ReLU, Primer's ungated alternative at the same parameters, could not be told apart from SwiGLU or from the GELU MLP at this scale.
# ```
#
# The feed-forward network (FFN) is the part of a block that works on each token alone.
# In 2017 it was two matrices with a ReLU between them and a hidden layer four times the
# model width {cite}`vaswani2017attention`. A year later GPT-1 and BERT had replaced the
# ReLU by a GELU {cite}`hendrycks2016gaussian` {cite}`radford2018improving`
# {cite}`devlin2019bert`, and GPT-2 kept it {cite}`radford2019language`. Since Llama
# {cite}`touvron2023llama`, nearly every open model uses **SwiGLU**: three matrices, a SiLU
# instead of the GELU, and a hidden layer only $8/3$ times the width
# {cite}`shazeer2020glu`. Because most of a dense model's parameters sit in its FFNs, this
# is a change to most of the model.
#
# Two things changed at once, and this chapter pulls them apart. The **activation** (GELU →
# SiLU) changes little: we plot the curves and their slopes, check the identities that
# define them, and time them, and find two nearly equal shapes whose cost is a small part
# of the FFN's either way. The **gate** (two matrices → three, with a product) changes
# what one layer can compute: we find a small task a gated layer solves exactly and an MLP
# of the same size can only approximate. In between sits the bookkeeping that keeps the
# comparison fair, the 8/3 rule, checked against Llama 2 and Llama 3. And at the end, the
# honest test: the MLP against three gated variants on Shakespeare, same parameters, same data,
# same budget, several seeds, with Primer's squared ReLU as a fifth, ungated, contender.

# %% tags=["remove-input"]
# Setup: on Colab, install the companion package (no effect elsewhere).
import subprocess
import sys

if "google.colab" in sys.modules:
    REPO, REF = "https://github.com/transformer-2017-2026/book", "main"
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    spec = f"transformer-2017-2026 @ git+{REPO}@{REF}"
    subprocess.run([*pip, spec], check=True)

# Then fix the CPU's numerical path (MKL branch, ATen kernels, threads)
# before torch loads, so the printed digits match the stored ones on any
# x86-64 CPU with AVX2 (companion.numerics says why and what it costs).
from companion.numerics import pin_cpu_path

pin_cpu_path()

# %% tags=["hide-input"]
import inspect
import math
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from IPython.display import HTML, Code
from matplotlib.patches import Circle, Rectangle

from companion import COLORS
from companion.analysis.seeds import difference
from companion.device import default_device, describe
from companion.layers.ffn import (
    ACTIVATIONS,
    FeedForward,
    GatedFeedForward,
    glu_hidden_size,
    relu_squared,
)
from companion.models.builders import build_block, build_ffn
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.models.presets import preset, tiny
from companion.plotting import PALETTE, animate, glue, use_style
from companion.tasks.products import (
    exact_product_glu,
    mse,
    product_surface,
    product_task,
    train_regression,
)
from companion.tasks.text import (
    CharTokenizer,
    load_shakespeare,
    sample_windows,
    split_tokens,
)
from companion.training import (
    cosine_lr,
    evaluate,
    make_adamw,
    seed_everything,
    train,
)

FULL = (
    False  # True: wider, deeper language models, longer runs, more seeds (use a GPU)
)  # fmt: skip
DEVICE = default_device() if FULL else torch.device("cpu")
use_style()
seed_everything(0)
# Every model here is tiny: one thread is nearly as fast as two on an idle 2-core
# machine, and much faster when other programs share the cores.
torch.set_num_threads(1)
print(describe(DEVICE))


def n_params(module: torch.nn.Module) -> int:
    """All parameters of a module (works on the meta device: only shapes are
    needed)."""
    return sum(p.numel() for p in module.parameters())


# %% [markdown]
# ## Where the parameters live
#
# A block has two sublayers. Attention has four $d \times d$ projections ($4d^2$ weights);
# the 2017 FFN has an up-projection $d \to 4d$ and a down-projection $4d \to d$ ($8d^2$).
# So two thirds of the weights of a block without cross-attention are FFN weights, and
# {doc}`chapter 3 <03_transformer_2017>` found that its units behave like a key-value
# memory {cite}`geva2021transformer`. The same holds in a 2023
# model. Here is a block of Llama 2 7B {cite}`touvron2023llama2`, built by `companion`'s
# `build_block(cfg)` on PyTorch's **meta** device: its tensors have shapes but no storage,
# so a 200-million parameter block costs no memory and no time.

# %%
llama2 = ModelConfig(
    vocab_size=32000,
    d_model=4096,
    n_layers=32,
    n_heads=32,
    d_ff=11008,
    ffn="glu",
    activation="silu",
    norm="rmsnorm",
    bias=False,
    position="rope",
    max_seq_len=4096,
    tie_embeddings=False,
)
with torch.device("meta"):  # shapes only: nothing is allocated or initialised for real
    block = build_block(llama2)
for name, p in block.named_parameters():
    print(f"{name:<22} {str(tuple(p.shape)):>15} {p.numel():>12,}")
n_attn, n_ffn, n_block = n_params(block.attn), n_params(block.ffn), n_params(block)
d, V, L = llama2.d_model, llama2.vocab_size, llama2.n_layers
n_model = L * n_block + 2 * V * d + d  # blocks, input and output embeddings, final norm
print(
    f"FFN share of a block: {n_ffn / n_block:.1%}; whole model: {n_model:,} parameters"
)
glue("ch07-ffn-share", f"{n_ffn / n_block:.1%}", display=False)
assert n_attn == 4 * d * d and n_ffn == 3 * d * 11008
assert 0.66 < n_ffn / n_block < 0.67  # still two thirds
assert (
    n_model == 6_738_415_616
)  # the published size of Llama 2 7B, to the last parameter

# %% [markdown]
# The count matches Llama 2 7B's published 6,738,415,616 parameters exactly, and
# {glue:text}`ch07-ffn-share` of every block is FFN. Its FFN has three weight matrices
# (`gate`, `up`, `down`) of width
# 11,008 instead of two of width 16,384. The rest of this chapter explains each of those
# numbers.
#
# ## The activation: ReLU, GELU, SiLU
#
# The three activations in question, with $\Phi$ the standard normal CDF and $\sigma$ the
# logistic sigmoid:
#
# $$\mathrm{ReLU}(x) = \max(0, x), \qquad \mathrm{GELU}(x) = x\,\Phi(x), \qquad
# \mathrm{SiLU}(x) = x\,\sigma(x).$$
#
# GELU weights its input by the probability that a standard normal variable falls below
# it {cite}`hendrycks2016gaussian`. BERT and GPT-2 used the faster approximation that
# the same paper offered,
#
# $$\mathrm{GELU}(x) \approx \tfrac12\, x\,\Big(1 + \tanh\big(\sqrt{2/\pi}\,(x + 0.044715\,x^3)\big)\Big).$$
#
# The name SiLU, sigmoid linear unit, comes from the same GELU paper, which wrote down
# $x\,\sigma(x)$ next to the GELU {cite}`hendrycks2016gaussian`. Elfwing et al. then used
# it in reinforcement learning {cite}`elfwing2018sigmoid`, and an automated search over
# activation functions found it again and called it Swish
# {cite}`ramachandran2017searching`; the "Sw" of SwiGLU is that Swish. All three have the
# form $x \cdot F(x)$ with $F$ rising from 0 to 1.
#
# A fourth came out of another search. Primer searched over whole Transformer programs
# for a language model that reaches a given quality with less compute, and one of the two
# changes it kept was to square the ReLU in the FFN {cite:p}`so2021primer`:
#
# $$\mathrm{ReLU}^2(x) = \max(0, x)^2.$$
#
# It is not of the form $x \cdot F(x)$ with $F$ a CDF, and it is used without a gate:
# Nemotron-4 15B puts it in a two-matrix MLP {cite:p}`parmar2024nemotron`, and so does
# the modded-nanogpt speedrun, whose training script credits it with being about 1–2 %
# better than GELU in its own setting {cite:p}`jordan2024modded` (a code comment; we found
# no written ablation against SwiGLU there).
# We plot all four and, with autograd, their derivatives, and check the definitions
# against PyTorch's kernels (in float64):

# %% tags=["hide-input"]
xs = torch.linspace(
    -10, 10, 200_001, dtype=torch.float64
)  # a fine grid for the identities
phi = 0.5 * (1 + torch.erf(xs / math.sqrt(2)))  # the standard normal CDF Φ
silu_gap = (F.silu(xs) - xs * torch.sigmoid(xs)).abs().max().item()
gelu_gap = (F.gelu(xs) - xs * phi).abs().max().item()
tanh_err = (F.gelu(xs) - ACTIVATIONS["gelu_tanh"](xs)).abs()
print(
    f"max |SiLU(x) - x·σ(x)| < 1e-12: {silu_gap < 1e-12};  "
    f"max |GELU(x) - x·Φ(x)| < 1e-12: {gelu_gap < 1e-12}"
)
print(
    f"max |GELU - its tanh approximation| = {tanh_err.max().item():.1e} "
    f"at x = {xs[tanh_err.argmax()].item():.2f}"
)
assert silu_gap < 1e-12 and gelu_gap < 1e-12
assert tanh_err.max() < 5e-4  # everywhere, not only near zero
glue("ch07-tanh-err", f"{tanh_err.max().item():.1e}", display=False)

names = {
    "relu": "ReLU",
    "gelu": "GELU",
    "gelu_tanh": "GELU (tanh approx.)",
    "silu": "SiLU",
    "relu2": "squared ReLU",
}
grid = torch.linspace(-5, 5, 1001, dtype=torch.float64, requires_grad=True)
values, slopes = {}, {}
for key in names:
    out = ACTIVATIONS[key](grid)
    (slope,) = torch.autograd.grad(out.sum(), grid)  # d act / dx at every grid point
    values[key], slopes[key] = out.detach(), slope
g = grid.detach()
sig, pdf = torch.sigmoid(g), torch.exp(-(g**2) / 2) / math.sqrt(2 * math.pi)
assert torch.allclose(
    slopes["silu"], sig * (1 + g * (1 - sig)), atol=1e-12
)  # σ(1 + x(1-σ))
assert torch.allclose(
    slopes["gelu"], 0.5 * (1 + torch.erf(g / math.sqrt(2))) + g * pdf
)  # Φ + xφ
for key in ("gelu", "silu"):
    low = values[key].argmin()
    print(
        f"{names[key]}: minimum {values[key][low].item():.3f} "
        f"at x = {g[low].item():.2f}; "
        f"slope from {slopes[key].min().item():.3f} "
        f"to {slopes[key].max().item():.3f}"
    )


def bisect(f, lo: float, hi: float) -> float:
    """The root of an increasing f between lo and hi."""
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


# the minima sit where the closed-form slopes vanish: found without the grid
cdf = lambda t: 0.5 * (1 + math.erf(t / math.sqrt(2)))  # noqa: E731
pdf_at = lambda t: math.exp(-t * t / 2) / math.sqrt(2 * math.pi)  # noqa: E731
x_gelu = bisect(lambda t: cdf(t) + t * pdf_at(t), -2.0, -0.1)  # Φ + xφ = 0
x_silu = bisect(lambda t: t + 1 + math.exp(t), -2.0, -1.0)  # 1 + x(1 − σ) = 0
assert abs(values["gelu"].min().item() - x_gelu * cdf(x_gelu)) < 1e-4
assert abs(values["silu"].min().item() - x_silu / (1 + math.exp(-x_silu))) < 1e-4
glue("ch07-gelu-min", f"−{-values['gelu'].min().item():.3f}", display=False)
glue("ch07-silu-min", f"−{-values['silu'].min().item():.3f}", display=False)
assert (
    slopes["gelu"].min() < 0
    and slopes["silu"].min() < 0
    and slopes["relu"].min() == 0
)  # fmt: skip
# squared ReLU: max(0, x)² with slope 2·max(0, x), written without relu
assert torch.equal(values["relu2"], torch.where(g > 0, g * g, 0 * g))
assert torch.allclose(slopes["relu2"], torch.where(g > 0, 2 * g, 0 * g))
near0 = g.abs() < 0.02  # the slope's jump across x = 0: 1 for ReLU, ~0 for ReLU²
jumps = {k: (slopes[k][near0].max() - slopes[k][near0].min()).item() for k in names}
print(
    f"slope's change across |x| < 0.02: ReLU {jumps['relu']:.2f}, "
    f"squared ReLU {jumps['relu2']:.2f}"
)
print(
    f"squared ReLU at x = 5: {values['relu2'][-1].item():.0f}, "
    f"slope {slopes['relu2'][-1].item():.0f}"
)
assert jumps["relu"] == 1 and jumps["relu2"] < 0.05 and values["relu2"].min() == 0

# %% tags=["hide-input"]
fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
styles = {"relu": "-", "gelu": "-", "gelu_tanh": "--", "silu": "-", "relu2": ":"}
colors = {
    "relu": PALETTE[7],
    "gelu": PALETTE[0],
    "gelu_tanh": PALETTE[4],
    "silu": PALETTE[1],
    "relu2": PALETTE[2],
}
for key, label in names.items():
    axes[0].plot(g, values[key], styles[key], color=colors[key], label=label)
    axes[1].plot(g, slopes[key], styles[key], color=colors[key], label=label)
axes[0].set(
    xlim=(-4, 3), ylim=(-0.5, 3), xlabel="x", ylabel="act(x)", title="The curves"
)
axes[0].legend()
axes[1].set(
    xlim=(-5, 5),
    ylim=(-0.3, 2.5),  # squared ReLU's slope 2x runs on, off the top
    xlabel="x",
    ylabel="d act / dx (autograd)",
    title="Their slopes",
)
err_grid = xs[(xs > -6) & (xs < 6)]
axes[2].plot(
    err_grid,
    1e4 * (F.gelu(err_grid) - ACTIVATIONS["gelu_tanh"](err_grid)),
    color=PALETTE[4],
)
axes[2].set(
    xlabel="x",
    ylabel="GELU − tanh approx. (×10⁻⁴)",
    title="The tanh approximation's error",
)
fig.suptitle(
    "GELU and SiLU: nearly one smooth shape; squared ReLU: 0, then x² (dotted)"
)  # fmt: skip
plt.show()

# %% [markdown]
# ReLU's slope jumps from 0 to 1; GELU's and SiLU's change smoothly, overshoot 1, and turn
# slightly negative on the left, so both curves dip below zero (to
# {glue:text}`ch07-gelu-min` and {glue:text}`ch07-silu-min`) and a unit that is "off" still
# passes a small gradient. The dashed tanh approximation sits on top of the exact GELU: the
# third panel magnifies their difference, at most {glue:text}`ch07-tanh-err` anywhere.
# Squared ReLU (dotted) keeps ReLU's exact zeros on the left and never dips, but its slope,
# $2\max(0, x)$, starts from 0 instead of jumping to 1, so it is smooth where ReLU has a
# kink, and it keeps growing: a unit twice as active contributes four times as much.
#
# GELU and SiLU are nearly the same function at two scales. The logistic sigmoid is close to
# the normal CDF when stretched by 1.702, $\Phi(x) \approx \sigma(1.702\,x)$, so
# $\mathrm{GELU}(x) \approx x\,\sigma(1.702\,x)$ {cite}`hendrycks2016gaussian`, and SiLU is a
# GELU stretched by 1.702 in both directions:

# %%
approx_gelu = (F.gelu(xs) - xs * torch.sigmoid(1.702 * xs)).abs().max().item()
rescaled = (F.silu(xs) - 1.702 * F.gelu(xs / 1.702)).abs().max().item()
print(f"max |GELU(x) - x·σ(1.702x)| = {approx_gelu:.3f}")
print(f"max |SiLU(x) - 1.702·GELU(x / 1.702)| = {rescaled:.3f}")
assert approx_gelu < 0.021 and rescaled < 0.035
glue("ch07-rescaled", f"{rescaled:.3f}", display=False)

# %% [markdown]
# So the switch from GELU to SiLU changes the shape very little: a network can absorb a
# factor of 1.7 into the weights around the activation. Does it change the cost? On paper
# GELU needs the error function, SiLU one exponential, squared ReLU a comparison and a
# multiplication. Here are the five kernels on a million numbers, and, for scale, the
# whole FFN forward pass that surrounds one of them (width 1024, 256 tokens), on one CPU
# thread:


# %% tags=["hide-input"]
# NBVAL_IGNORE_OUTPUT
# (timings depend on the machine and on what else runs on it: shown, not asserted)
def fastest(fn, reps: int = 7) -> float:
    """The fastest of ``reps`` timed calls (after one warm-up), in seconds."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


z = torch.randn(
    256, 4096
)  # the hidden activations of 256 tokens through a 1024 → 4096 FFN
ffn_1024 = FeedForward(1024, 4096, "gelu", bias=False)
tokens_1024 = torch.randn(256, 1024)
with torch.no_grad():
    t_act = {key: fastest(lambda f=ACTIVATIONS[key]: f(z)) for key in names}
    t_ffn = fastest(lambda: ffn_1024(tokens_1024))
for key, t in t_act.items():
    print(
        f"{names[key]:<20} {1e3 * t:6.2f} ms  {t / t_act['relu']:4.1f}× ReLU  "
        f"{t / t_ffn:5.1%} of the FFN's forward"
    )
print(f"{'whole FFN forward':<20} {1e3 * t_ffn:6.2f} ms")

# %% [markdown]
# The order of the five depends on the CPU, the PyTorch version and the load: between two
# builds of this page the exact GELU went from faster than SiLU to slower. PyTorch's CPU
# kernels evaluate the error function with a vectorised polynomial, so the exact GELU need
# not cost more than the exponential of a SiLU, and the tanh "approximation", introduced to
# be cheap, need not be faster than the exact form. Squared ReLU, the simplest on paper,
# runs here as two kernels, a ReLU and then a square, each a pass over memory. On a GPU an
# activation is usually fused into a neighbouring kernel anyway. What does not change is the scale: per hidden unit and
# token the two matrix multiplications do $4d = 4096$ FLOPs, the activation a few dozen
# operations at most, so we expect it to take a few percent of the FFN's time or less, as
# in the last column above. Neither the shape nor the cost, then, makes a case for SiLU
# over GELU: SiLU came into the open models together with the gate, in SwiGLU, one of the
# two variants that Shazeer's experiments ranked best {cite}`shazeer2020glu` (the other,
# GeGLU, is what Gemma ships).
#
# ## The gate: three matrices
#
# A gated linear unit multiplies two projections of the same input, one passed through a
# nonlinearity. Dauphin et al. introduced it with a sigmoid gate for convolutional language
# models {cite}`dauphin2017language`; Shazeer put it into the Transformer's FFN with other
# gates and named the results by their activation: ReGLU, GeGLU, SwiGLU, and "bilinear"
# with none at all {cite}`shazeer2020glu`:
#
# $$\mathrm{FFN}_\mathrm{MLP}(x) = W_\mathrm{down}\,\phi(W_\mathrm{up}\,x), \qquad
# \mathrm{FFN}_\mathrm{GLU}(x) = W_\mathrm{down}\big(\phi(W_\mathrm{gate}\,x) \odot
# W_\mathrm{up}\,x\big).$$
#
# In `companion` the gated form is one line longer than the plain one:

# %%
Code(inspect.getsource(GatedFeedForward), language="python")

# %% [markdown]
# `ACTIVATIONS` holds ReLU, GELU (exact and tanh), SiLU and squared ReLU (`"relu2"`), so
# the same class is ReGLU, GeGLU or SwiGLU by its `activation` argument, and
# `FeedForward(d, 4 * d, "relu2")` is Primer's ungated MLP;
# `ModelConfig(ffn="glu", activation=...)` puts either in every block. Squared ReLU is one
# line of `companion.layers.ffn`:

# %%
Code(inspect.getsource(relu_squared), language="python")

# %% [markdown]
# ## The 8/3 accounting
#
# A third matrix costs parameters, unless the hidden layer shrinks. An MLP with hidden width
# $4d$ has $2 \cdot d \cdot 4d = 8d^2$ weights; a GLU with hidden width $h$ has $3dh$.
# Setting $3dh = 8d^2$ gives
#
# $$h = \tfrac{8}{3}\,d \approx 2.67\,d,$$
#
# which is then rounded up to a multiple that suits the hardware. Llama 2 7B has $d = 4096$:
# $\tfrac83 d = 10{,}922.7$, and the next multiple of 256 is 11,008. Llama 3 8B, with the
# same $d$, multiplies by 1.3 first and rounds to a multiple of 1024, which gives 14,336
# $= 3.5\,d$ {cite}`grattafiori2024llama`: {glue:text}`ch07-llama3-over` more FFN
# parameters than the parity rule, spent on purpose. `glu_hidden_size` does this
# arithmetic, and modules built on the
# meta device confirm it:

# %%
d = 4096
print(f"8d/3 = {8 * d / 3:,.1f}")
print(f"glu_hidden_size({d}) = {glu_hidden_size(d):,}  (Llama 2 7B)")
print(
    f"glu_hidden_size({d}, multiple_of=1024, multiplier=1.3) = "
    f"{glu_hidden_size(d, multiple_of=1024, multiplier=1.3):,}  (Llama 3 8B)"
)
assert glu_hidden_size(d) == 11008 == 43 * 256
assert glu_hidden_size(d, multiple_of=1024, multiplier=1.3) == 14336 == int(3.5 * d)

with torch.device("meta"):
    big = {
        "MLP, 4d = 16,384": FeedForward(d, 4 * d, "gelu", bias=False),
        "SwiGLU, 11,008 (Llama 2 7B)": GatedFeedForward(d, 11008),
        "SwiGLU, 14,336 (Llama 3 8B)": GatedFeedForward(d, 14336),
    }
counts = {name: n_params(m) for name, m in big.items()}
mlp_count = counts["MLP, 4d = 16,384"]
for name, n in counts.items():
    print(f"{name:<28} {n:>13,} weights  {n / mlp_count:6.3f}× the MLP")
assert mlp_count == 8 * d * d
assert (
    abs(counts["SwiGLU, 11,008 (Llama 2 7B)"] / mlp_count - 1) < 0.01
)  # parity, within 1%
assert counts["SwiGLU, 14,336 (Llama 3 8B)"] / mlp_count == 1.3125  # 3 · 3.5 / 8
glue(
    "ch07-llama2-over",
    f"{counts['SwiGLU, 11,008 (Llama 2 7B)'] / mlp_count - 1:.1%}",
    display=False,
)
glue(
    "ch07-llama3-over",
    f"{counts['SwiGLU, 14,336 (Llama 3 8B)'] / mlp_count - 1:.0%}",
    display=False,
)

# %% [markdown]
# Equal weights also means equal arithmetic: each weight takes part in one multiply-add per
# token, so both FFNs cost $2 \times$ (weights) FLOPs per token, plus a few elementwise
# operations per hidden unit (the GLU has fewer hidden units, but one more product each).
# At the width of this chapter's language models, $d = 48$, the rule is exact:
# $\tfrac83 \cdot 48 = 128$.

# %%
D_LM = 128 if FULL else 48
mlp_small = FeedForward(D_LM, 4 * D_LM, "gelu", bias=False)
glu_small = GatedFeedForward(D_LM, 8 * D_LM // 3, "silu")
print(
    f"d = {D_LM}: MLP {n_params(mlp_small):,} weights, "
    f"SwiGLU {n_params(glu_small):,} weights"
)
assert n_params(mlp_small) == n_params(glu_small) == 8 * D_LM**2

# %% [markdown]
# {numref}`fig-gated-ffn` builds both FFNs at this width, one matrix at a time, and then
# the two Llama widths. Its modules come from `build_ffn`, which makes a block's FFN out
# of a `ModelConfig` the way the models do: two `tiny()` configs at $d = 48$, and Llama 2
# 7B's and Llama 3 8B's configs on the meta device. Every count in the figure is read from
# those modules' weights:

# %% tags=["hide-input"]
# the width of this chapter's language models (FULL = False): 8/3 · 48 = 128
D_FIG = 48
# FFN modules built from configs, as the models build them: at that width...
fig_mlp_cfg = tiny(
    d_model=D_FIG, n_heads=D_FIG // 16, n_kv_heads=None,
    ffn="mlp", activation="gelu", d_ff=4 * D_FIG,
)  # fmt: skip
fig_glu_cfg = fig_mlp_cfg.replace(ffn="glu", activation="silu", d_ff=8 * D_FIG // 3)
llama3_8b = preset("llama3-8b")
assert llama2.d_model == llama3_8b.d_model == 4096  # one MLP budget for both
with torch.device("meta"):  # ...and at Llama's (shapes only)
    ffns = {
        "MLP": build_ffn(fig_mlp_cfg),
        "SwiGLU": build_ffn(fig_glu_cfg),
        "MLP, 4d": build_ffn(
            llama2.replace(ffn="mlp", activation="gelu", d_ff=16384)
        ),
        "Llama 2 7B": build_ffn(llama2),
        "Llama 3 8B": build_ffn(llama3_8b),
    }  # fmt: skip


def weights(m: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Each weight matrix of an FFN as role -> (d_out, d_in), read from the
    module."""
    roles = [r for r in ("gate", "up", "down") if hasattr(m, r)]
    return {r: tuple(getattr(m, r).weight.shape) for r in roles}


shapes = {name: weights(m) for name, m in ffns.items()}
n_ffn_w = {name: n_params(m) for name, m in ffns.items()}
budget = {
    name: n_ffn_w["MLP" if i < 2 else "MLP, 4d"] for i, name in enumerate(ffns)
}  # fmt: skip
print(
    f"{'FFN':<11} {'module':<16} {'d':>6} {'hidden':>7} {'weights':>12} {'÷ MLP':>6}"
)  # fmt: skip
for name, m in ffns.items():
    d_out, d_in = shapes[name]["up"]
    print(
        f"{name:<11} {type(m).__name__:<16} {d_in:>6,} {d_out:>7,} "
        f"{n_ffn_w[name]:>12,} {n_ffn_w[name] / budget[name]:>6.3f}"
    )
# at d = 48 the 8/3 width is a whole number, so the two budgets agree exactly...
assert n_ffn_w["SwiGLU"] == n_ffn_w["MLP"]
# ...at d = 4096 it is rounded up to a multiple of 256: under 256 extra units of 3d
# each
assert 0 < n_ffn_w["Llama 2 7B"] - n_ffn_w["MLP, 4d"] < 3 * 4096 * 256
# the drawing misses nothing: its matrices' areas add up to each module's parameters
assert all(sum(a * b for a, b in shapes[k].values()) == n_ffn_w[k] for k in ffns)

# %% tags=["hide-input", "remove-output"]
DENSE, VEC = COLORS["dense"], "#d9d9d9"
BAR = 8  # drawn thickness of a vector; a matrix is drawn d_out wide and d_in tall
mlp_up, mlp_down = shapes["MLP"]["up"], shapes["MLP"]["down"]
g_gate, g_up, g_down = (shapes["SwiGLU"][r] for r in ("gate", "up", "down"))
d_fig, h_fig = mlp_up[1], g_gate[0]
# the stream runs upwards; centres of the MLP and of the SwiGLU's two branches
X_MLP, X_G, X_U = 110, 320, 470
X_GLU = (X_G + X_U) / 2
Y_W2, Y_WD = 182, 218  # where each down-projection starts


def vec(xc, y, n, label=""):  # a vector of n numbers at height y
    return ("vec", xc, y, n, label)


def mat(xc, y, shape, name, side=False):  # a (d_out, d_in) matrix from height y
    return ("mat", xc, y, shape, name, side)


def arrow(x0, y0, x1, y1):
    return ("arrow", x0, y0, x1, y1)


pieces = [  # what each frame adds to the diagram: one idea per frame
    [
        vec(X_MLP, 0, mlp_up[1], "x"), arrow(X_MLP, BAR, X_MLP, 28),
        mat(X_MLP, 30, mlp_up, "W₁ (up)"), arrow(X_MLP, 80, X_MLP, 94),
        vec(X_MLP, 96, mlp_up[0]),
    ],
    [
        ("act", X_MLP, 124, "GELU"), arrow(X_MLP, 104, X_MLP, 114),
        arrow(X_MLP, 134, X_MLP, 152), vec(X_MLP, 154, mlp_up[0]),
    ],
    [
        arrow(X_MLP, 162, X_MLP, Y_W2 - 2),
        mat(X_MLP, Y_W2, mlp_down, "W₂ (down)", True),
        arrow(X_MLP, Y_W2 + mlp_down[1] + 2, X_MLP, Y_W2 + mlp_down[1] + 16),
        vec(X_MLP, Y_W2 + mlp_down[1] + 18, mlp_down[0], "y"),
    ],
    [
        vec(X_GLU, 0, g_gate[1], "x"), arrow(X_GLU, BAR, X_G, 28),
        mat(X_G, 30, g_gate, "W_g (gate)"), arrow(X_G, 80, X_G, 94),
        vec(X_G, 96, g_gate[0]),
    ],
    [
        arrow(X_GLU, BAR, X_U, 28), mat(X_U, 30, g_up, "W_u (up)"),
        arrow(X_U, 80, X_U, 94), vec(X_U, 96, g_up[0]),
    ],
    [
        ("act", X_G, 124, "SiLU"), arrow(X_G, 104, X_G, 114),
        arrow(X_G, 134, X_G, 152), vec(X_G, 154, g_gate[0]),
        arrow(X_G, 162, X_GLU - 8, 176), arrow(X_U, 104, X_GLU + 8, 176),
        ("mul", X_GLU, 182), arrow(X_GLU, 190, X_GLU, 198),
        vec(X_GLU, 200, g_gate[0]),
    ],
    [
        arrow(X_GLU, 208, X_GLU, Y_WD - 2),
        mat(X_GLU, Y_WD, g_down, "W_d (down)", True),
        arrow(X_GLU, Y_WD + g_down[1] + 2, X_GLU, Y_WD + g_down[1] + 16),
        vec(X_GLU, Y_WD + g_down[1] + 18, g_down[0], "y"),
    ],
    [], [], [],  # the budget, then Llama 2's and Llama 3's widths
]  # fmt: skip
N_FFN_FRAMES = len(pieces)
r_l2 = n_ffn_w["Llama 2 7B"] / n_ffn_w["MLP, 4d"]
r_l3 = n_ffn_w["Llama 3 8B"] / n_ffn_w["MLP, 4d"]
captions = [
    f"2017: W₁ takes x (d = {d_fig}) to 4d = {mlp_up[0]} hidden units, "
    f"{mlp_up[0] * mlp_up[1]:,} weights",
    f"an activation on each of the {mlp_up[0]} hidden units (no weights)",
    f"W₂ takes them back to d: the MLP has 2·d·4d = {n_ffn_w['MLP']:,} weights",
    f"SwiGLU: a gate W_g takes x to h = {h_fig} units "
    f"({g_gate[0] * g_gate[1]:,} weights)",
    f"beside it an up-projection W_u, also d → h ({g_up[0] * g_up[1]:,} weights)",
    "the gate: SiLU(x W_g) ⊙ (x W_u), one product per hidden unit",
    f"W_d takes the products back to d: the GLU has 3·d·h = {n_ffn_w['SwiGLU']:,}",
    f"h = 8d/3 = {h_fig} keeps the budget: 2·d·4d = 3·d·(8/3)d, the same area",
    f"Llama 2 7B, d = 4096: 8d/3 = {8 * 4096 / 3:,.1f}, rounded up to "
    f"{shapes['Llama 2 7B']['up'][0]:,}: {r_l2 - 1:+.1%}",
    f"Llama 3 8B: h = {shapes['Llama 3 8B']['up'][0]:,} = 3.5d, "
    f"{r_l3 - 1:+.0%} on purpose",
]
rows_n = {  # parameter panel row: (module, the frame at which each matrix appears)
    f"MLP, d = {d_fig}": ("MLP", {"up": 0, "down": 2}),
    f"SwiGLU, d = {d_fig}": ("SwiGLU", {"gate": 3, "up": 4, "down": 6}),
    "Llama 2 7B": ("Llama 2 7B", {"gate": 8, "up": 8, "down": 8}),
    "Llama 3 8B": ("Llama 3 8B", {"gate": 9, "up": 9, "down": 9}),
}
fig, (ax_d, ax_n) = plt.subplots(1, 2, figsize=(8.8, 4.4), width_ratios=[1.45, 1])


def draw_piece(p: tuple, new: bool) -> None:
    alpha, edge = (1.0, 1.4) if new else (0.45, 0.6)
    style = {"alpha": alpha, "edgecolor": "black", "lw": edge}
    kind, xc, y = p[:3]
    if kind == "vec":
        n, label = p[3:]
        ax_d.add_patch(Rectangle((xc - n / 2, y), n, BAR, facecolor=VEC, **style))
        if label:
            ax_d.text(xc + n / 2 + 5, y + BAR / 2, f"{label} ({n})", va="center",
                      fontsize=7.5, alpha=alpha)  # fmt: skip
    elif kind == "mat":
        (d_out, d_in), name, side = p[3:]
        ax_d.add_patch(
            Rectangle((xc - d_out / 2, y), d_out, d_in, facecolor=DENSE, **style)
        )
        at = (xc + d_out / 2 + 5, y + d_in / 2) if side else (xc, y + d_in / 2)
        ax_d.text(*at, f"{name}\n{d_in} × {d_out}", ha="left" if side else "center",
                  va="center", fontsize=7.5, alpha=alpha)  # fmt: skip
    elif kind == "act":
        ax_d.text(xc, y, p[3], ha="center", va="center", fontsize=7.5, alpha=alpha,
                  bbox={"boxstyle": "round", "fc": "white",
                        "ec": "grey"})  # fmt: skip
    elif kind == "mul":
        ax_d.add_patch(Circle((xc, y), 8, facecolor="white", **style))
        ax_d.text(xc, y, "×", ha="center", va="center", fontsize=9, alpha=alpha)
    else:
        props = {"arrowstyle": "->", "lw": 0.8, "alpha": alpha}
        ax_d.annotate("", p[3:], (xc, y), arrowprops=props)


def draw_ffn(i: int) -> None:
    ax_d.cla()
    for j, frame in enumerate(pieces[: i + 1]):
        for p in frame:
            draw_piece(p, new=j == i or (i == 7 and p[0] == "mat"))
    ax_d.text(X_MLP, 430, "MLP (2017)", ha="center", fontsize=9, weight="bold")
    if i >= 3:
        ax_d.text(X_GLU, 430, "SwiGLU", ha="center", fontsize=9, weight="bold")
    ax_d.set(xlim=(0, 570), ylim=(-10, 445), aspect="equal")
    ax_d.axis("off")
    ax_n.cla()
    for row, (name, appear) in enumerate(rows_n.values()):
        left = 0.0
        for role, (d_out, d_in) in shapes[name].items():
            if appear[role] > i:
                continue
            share = d_out * d_in / budget[name]
            now = appear[role] == i or i == 7
            ax_n.barh(row, share, left=left, color=DENSE, edgecolor="white",
                      alpha=1.0 if now else 0.55)  # fmt: skip
            n = d_out * d_in
            text = f"{n:,}" if n < 1e6 else f"{n / 1e6:.1f}M"
            ax_n.text(left + share / 2, row, f"{role}\n{text}", ha="center",
                      va="center", fontsize=7)  # fmt: skip
            left += share
        if max(appear.values()) <= i:
            ax_n.text(left + 0.02, row, f"{n_ffn_w[name] / budget[name]:.3f}×",
                      va="center", fontsize=8)  # fmt: skip
    ax_n.axvline(1, color="grey", ls=":", lw=1)
    ax_n.set_yticks(range(len(rows_n)), list(rows_n), fontsize=8)
    ax_n.set(xlim=(0, 1.6), ylim=(len(rows_n) - 0.5, -0.5),
             xlabel="weights ÷ a 4d MLP's at the same d")  # fmt: skip
    ax_n.grid(False)
    fig.suptitle(f"{i + 1}/{N_FFN_FRAMES}  " + captions[i], fontsize=10)


glue("fig-gated-ffn", HTML(animate(fig, draw_ffn, N_FFN_FRAMES, interval_ms=1200)))

# %% [markdown]
# ```{glue:figure} fig-gated-ffn
# :name: fig-gated-ffn
#
# The 2017 MLP and SwiGLU at $d = 48$, drawn to scale: a vector is a grey bar as wide as
# its number of entries, and a matrix an orange rectangle $d_\mathrm{in}$ tall and
# $d_\mathrm{out}$ wide (written $d_\mathrm{in} \times d_\mathrm{out}$, as in $x W$), so its
# area is its number of weights; the stream runs upwards. Frames 1–3 build the MLP ($W_1$
# up to $4d = 192$, GELU, $W_2$ down), frames 4–7 the SwiGLU (gate $W_g$ and up $W_u$ to
# $h = 128$, the elementwise product $\mathrm{SiLU}(x W_g) \odot x W_u$, down $W_d$); the
# right panel stacks each matrix's weights as a fraction of the MLP's. Watch frame 8: the
# three thinner matrices cover the same area as the two wide ones, because
# $2 \cdot d \cdot 4d = 3 \cdot d \cdot \tfrac83 d$. Frames 9 and 10 add Llama 2 7B, where
# rounding $\tfrac83 d$ up to 11,008 costs {glue:text}`ch07-llama2-over`, and Llama 3 8B,
# {glue:text}`ch07-llama3-over` over on purpose.
# ```

# %% [markdown]
# ## What a gate can compute
#
# Why would the gate help? A two-matrix MLP computes a sum of *ridge functions*
# $\sum_i w_i\,\phi(a_i \cdot x)$: each hidden unit looks at one direction of the input. A
# product of two features, "pass $x_j$ through only when $x_k$ is large", is not of that
# form; an MLP has to build it out of many units. A GLU multiplies by construction.
#
# For all three activations there is an exact identity. Each is $x F(x)$ with
# $F(x) + F(-x) = 1$ ($\Phi$ and $\sigma$ are symmetric CDFs, ReLU's $F$ is a step), so
# $\phi(x) - \phi(-x) = x\,F(x) + x\,F(-x) = x$. Two gated units therefore give a product
# exactly: $\phi(x_k)\,x_j - \phi(-x_k)\,x_j = x_k x_j$.
#
# Squared ReLU breaks the pattern: its odd part is $z\,|z|$, not $z$. Its *even* part is
# the useful one, $\mathrm{ReLU}^2(z) + \mathrm{ReLU}^2(-z) = z^2$, and a product is a
# difference of squares, $x_j x_k = \tfrac14\big[(x_j + x_k)^2 - (x_j - x_k)^2\big]$. So
# an MLP with squared ReLU, no gate, can also write a product exactly, with four hidden
# units per product: $4d$ units for the task's $d$ products, the width of a 2017 MLP.
#
# The task in `companion.tasks.products`: $d$ Gaussian inputs, $d$ outputs
# $y_k = x_k \cdot x_{k-1}$, trained with mean squared error (predicting 0 scores 1).
# `exact_product_glu` writes the two-units-per-product weights by hand: a GLU with $2d$
# hidden units, $6d^2$ weights, fewer than an MLP's $8d^2$.

# %%
D_TASK = 24
z64 = torch.linspace(-8, 8, 1001, dtype=torch.float64)
x_test, y_test = product_task(8192, D_TASK, generator=torch.Generator().manual_seed(99))
for key in ("relu", "gelu", "gelu_tanh", "silu"):
    act = ACTIVATIONS[key]
    odd_gap = (act(z64) - act(-z64) - z64).abs().max().item()
    hand_built = mse(exact_product_glu(D_TASK, activation=key), x_test, y_test)
    print(
        f"{names[key]:<20} |φ(z) − φ(−z) − z| < 1e-12: {odd_gap < 1e-12};  "
        f"hand-built GLU MSE < 1e-10: {hand_built < 1e-10}"
    )
    assert odd_gap < 1e-12 and hand_built < 1e-10
relu2 = ACTIVATIONS["relu2"]
square = lambda z: relu2(z) + relu2(-z)  # noqa: E731  (the even part: z²)
a, b = torch.randn(2, 10_000, dtype=torch.float64)
four_units = (square(a + b) - square(a - b)) / 4  # four squared-ReLU units
gap = (four_units - a * b).abs().max().item()
print(f"squared ReLU MLP, 4 units per product: max |error| < 1e-12: {gap < 1e-12}")
assert gap < 1e-12

# %% [markdown]
# A solution exists; does gradient descent find it? We train four one-layer FFNs of exactly
# the same size, $8d^2 = 4{,}608$ weights at $d = 24$: a ReLU, a GELU and a squared-ReLU
# MLP with $4d = 96$ hidden units, and a SwiGLU with $\tfrac83 d = 64$. Same optimizer, same 500 steps, the same
# batches, three seeds; for the first seed we also record the function each model computes
# for output $k=1$ over the $(x_1, x_0)$ plane, all other inputs zero, as it trains.

# %% tags=["hide-input"]
TASK_STEPS, TASK_SEEDS = 500, (0, 1, 2)
SNAPSHOTS = (0, 20, 50, 100, 250, 500)
task_models = {
    "MLP (ReLU)": lambda: FeedForward(D_TASK, 4 * D_TASK, "relu", bias=False),
    "MLP (GELU)": lambda: FeedForward(D_TASK, 4 * D_TASK, "gelu", bias=False),
    "MLP (ReLU²)": lambda: FeedForward(D_TASK, 4 * D_TASK, "relu2", bias=False),
    "SwiGLU": lambda: GatedFeedForward(D_TASK, 8 * D_TASK // 3, "silu"),
}
plane = torch.linspace(-3, 3, 61)
task_mse = {name: [] for name in task_models}
task_curves, surfaces = {}, {name: [] for name in task_models}
for name, build in task_models.items():
    for seed in TASK_SEEDS:
        torch.manual_seed(seed)
        model = build()
        assert n_params(model) == 8 * D_TASK**2

        def snap(
            step: int, m: torch.nn.Module, name: str = name, seed: int = seed
        ) -> None:
            if seed == 0 and step in SNAPSHOTS:
                surfaces[name].append(product_surface(m, D_TASK, plane, k=1))

        hist = train_regression(
            model,
            D_TASK,
            TASK_STEPS,
            generator=torch.Generator().manual_seed(10 + seed),
            on_step=snap,
        )
        task_mse[name].append(mse(model, x_test, y_test))
        if seed == 0:
            task_curves[name] = hist.loss
print(
    f"{'model':<12} {'weights':>8} "
    + " ".join(f"{'seed ' + str(s):>9}" for s in TASK_SEEDS)
)
for name, errs in task_mse.items():
    print(f"{name:<12} {8 * D_TASK**2:>8,} " + " ".join(f"{e:>9.5f}" for e in errs))
ratios = [
    m / s for m, s in zip(task_mse["MLP (GELU)"], task_mse["SwiGLU"], strict=True)
]
print(f"GELU MLP error ÷ SwiGLU error: {min(ratios):.0f}× to {max(ratios):.0f}×")
glue("ch07-task-ratio", f"{min(ratios):.0f} to {max(ratios):.0f}", display=False)
glue("ch07-task-weights", f"{8 * D_TASK**2:,}", display=False)
# every seed: the gated layer is at least 10× better
assert all(r > 10 for r in ratios)
assert max(task_mse["MLP (GELU)"]) < min(
    task_mse["MLP (ReLU)"]
)  # smooth curvature helps the MLP
# squared ReLU, ungated: every seed well below the GELU MLP, still above the SwiGLU
err = {name: np.array(errs) for name, errs in task_mse.items()}  # per seed
sq_gelu = list(err["MLP (GELU)"] / err["MLP (ReLU²)"])
sq_glu = list(err["MLP (ReLU²)"] / err["SwiGLU"])
lo_hi = lambda r, f: f"{min(r):{f}}× to {max(r):{f}}×"  # noqa: E731
print(f"GELU MLP error ÷ squared-ReLU MLP error: {lo_hi(sq_gelu, '.0f')}")
print(f"squared-ReLU MLP error ÷ SwiGLU error: {lo_hi(sq_glu, '.1f')}")
assert all(r > 3 for r in sq_gelu) and all(r > 1 for r in sq_glu)
glue(
    "ch07-task-relu2-gelu", f"{min(sq_gelu):.0f} to {max(sq_gelu):.0f}", display=False
)
glue("ch07-task-relu2-glu", f"{min(sq_glu):.1f} to {max(sq_glu):.1f}", display=False)

# %% tags=["hide-input"]
fig, axes = plt.subplots(1, 4, figsize=(12.5, 3.3), width_ratios=[1, 1, 1, 1.3])
target = plane[None, :] * plane[:, None]  # rows x_0, columns x_1
images = {}
panels = {"target": "target  x₁·x₀", "MLP (GELU)": "MLP (GELU)", "SwiGLU": "SwiGLU"}
for ax, (key, title) in zip(axes[:3], panels.items(), strict=True):
    start = target if key == "target" else surfaces[key][0]
    images[key] = ax.imshow(
        start.numpy(),
        origin="lower",
        extent=(-3, 3, -3, 3),
        cmap="RdBu_r",
        vmin=-9,
        vmax=9,
    )
    ax.grid(False)
    ax.set(title=title, xlabel="x₁", ylabel="x₀" if key == "target" else None)
fig.colorbar(images["SwiGLU"], ax=axes[2], fraction=0.05, label="output")
smoothed = {
    k: np.convolve(c, np.ones(10) / 10, mode="valid") for k, c in task_curves.items()
}
lines = {
    k: axes[3].semilogy([], [], color=PALETTE[j], label=k)[0]
    for j, k in enumerate(task_models)
}
axes[3].set(
    xlim=(0, TASK_STEPS),
    ylim=(1e-4, 2),
    xlabel="step",
    ylabel="training MSE (10-step mean)",
)
axes[3].legend(fontsize=8, loc="lower left")
fig.suptitle(
    "Output 1 over the (x₁, x₀) plane: the gated layer learns the saddle x₁·x₀"
)


def draw_task(i: int) -> None:
    step = SNAPSHOTS[i]
    for key in ("MLP (GELU)", "SwiGLU"):
        images[key].set_data(surfaces[key][i].numpy())
    for key, line in lines.items():
        line.set_data(np.arange(min(step, len(smoothed[key]))), smoothed[key][:step])
    axes[3].set_title(f"after {step} steps")


HTML(animate(fig, draw_task, len(SNAPSHOTS), interval_ms=900))

# %% [markdown]
# The target is a saddle: positive (red) where $x_0$ and $x_1$ share a sign, negative (blue)
# where they differ. The SwiGLU has its shape after about fifty steps and then keeps
# sharpening it, its error falling steadily. The ReLU and GELU MLPs find the sign pattern
# too, but their surface stays too flat in the corners and their error levels off: each hidden unit
# responds to one direction of the input, and a finite sum of such ridges can only
# approximate a saddle (a ReLU MLP is piecewise linear, so it can never be exact; the
# GELU's curvature gets closer). With the same number of weights, the gated layer ends
# {glue:text}`ch07-task-ratio` times more accurate than the GELU MLP, on each of the three
# seeds (the printed errors cover all 24 outputs, on held-out inputs).
#
# The squared-ReLU MLP (in the right panel only) has no gate, yet it ends
# {glue:text}`ch07-task-relu2-gelu` times more accurate than the GELU MLP on every seed:
# the difference of squares gives its units a way to multiply that GELU's units lack. It
# still ends {glue:text}`ch07-task-relu2-glu` times less accurate than the SwiGLU, on each
# seed: a gated unit holds a product directly, while the MLP must find four units whose
# squares cancel.
#
# This is the mechanism usually offered for the gate: one layer can express "feature $k$
# scales feature $j$" directly. Whether that is *why* gated FFNs train better language
# models nobody has shown; Shazeer's paper offered no explanation and credited the gains
# to "divine benevolence" {cite}`shazeer2020glu`. So let us measure the language-model
# gain rather than assume it.
#
# ## A fair comparison on Shakespeare
#
# Five FFNs in the same decoder. Two are ungated MLPs with hidden width $4d$: the
# GPT-2-style MLP with GELU, and Primer's with squared ReLU. Three are gated, with hidden
# width $\tfrac83 d$: ReGLU, GeGLU and SwiGLU. At $d = 48$ that is 192 and 128 units, and
# all five models have exactly the same number of parameters. Everything else is a
# 2023-style block (RMSNorm, RoPE, no biases), one layer deep, trained on the same
# character windows in the same order for the same number of steps, from five seeds. The
# seed sets the initial weights and the order of the batches; within a seed all five
# variants see the same batches, so each comparison is made on the paired differences. The
# configs start from `tiny()` of `companion.models.presets`, the small modern decoder the
# later chapters and the tests share, with a few fields changed (unfold the next cell to
# see which).
# One learning rate serves all five ($10^{-2}$ after a short warm-up, cosine decay;
# $3 \cdot 10^{-3}$ in the `FULL` run), so that the FFN is the only thing that differs; a
# sweep per variant would multiply a budget that has no room for it, which is one more
# reason to read every gap below as a statement about this setting only.
#
# ```{admonition} Reading the numbers
# :class: note
# The runs below are small and short. A ± is a 95 % interval over seeds, on the paired
# differences where runs share seeds and batches; a difference is claimed only when that
# interval excludes zero, and a null says these seeds cannot tell the two apart. The
# {ref}`preface <reading-the-numbers>` says what follows from that.
# ```

# %% tags=["hide-input"]
text = load_shakespeare()
chars = CharTokenizer(text)
ids = torch.tensor(chars.encode(text))
train_ids, val_ids = split_tokens(ids, 0.1)
SEQ, BATCH, STEPS, LR = (128, 64, 3000, 3e-3) if FULL else (32, 32, 250, 1e-2)
SEEDS = (0, 1, 2, 3, 4)
VARIANTS = {  # name -> (ffn, activation, hidden width)
    "MLP (GELU)": ("mlp", "gelu", 4 * D_LM),
    "MLP (ReLU²)": ("mlp", "relu2", 4 * D_LM),
    "ReGLU": ("glu", "relu", 8 * D_LM // 3),
    "GeGLU": ("glu", "gelu", 8 * D_LM // 3),
    "SwiGLU": ("glu", "silu", 8 * D_LM // 3),
}
GATED = [name for name, spec in VARIANTS.items() if spec[0] == "glu"]


def lm_config(ffn: str, activation: str, hidden: int) -> ModelConfig:
    """The chapter's decoder: RMSNorm, RoPE, no biases; only the FFN varies."""
    return tiny(
        vocab_size=chars.vocab_size,
        d_model=D_LM,
        n_layers=4 if FULL else 1,
        n_heads=D_LM // 16,
        d_ff=hidden,
        ffn=ffn,
        activation=activation,
        max_seq_len=SEQ,
        init_std=0.1,
        n_kv_heads=None,
    )


sizes = {
    name: DecoderLM(lm_config(*spec)).num_params() for name, spec in VARIANTS.items()
}
print(f"{len(VARIANTS)} variants, each with {sizes['SwiGLU']:,} parameters")
assert len(set(sizes.values())) == 1  # equal: 2·d·4d = 3·d·(8/3)d exactly at d = 48

counts_train = torch.bincount(train_ids, minlength=chars.vocab_size).double()
unigram = counts_train / counts_train.sum()
unigram_loss = -unigram.clamp_min(1e-12).log()[val_ids].mean().item()
print(f"unigram baseline (letter frequencies only): {unigram_loss:.2f} nats/char")
glue("ch07-unigram", f"{unigram_loss:.2f}", display=False)
glue("ch07-lm-params", f"{sizes['SwiGLU']:,}", display=False)

# %% tags=["hide-input"]
val_batches = [
    sample_windows(val_ids, 256, SEQ, torch.Generator().manual_seed(500 + i), DEVICE)
    for i in range(4)
]
lm_curves = {name: [] for name in VARIANTS}
lm_val = {name: [] for name in VARIANTS}
for seed in SEEDS:
    for name, spec in VARIANTS.items():
        seed_everything(seed)
        model = DecoderLM(lm_config(*spec)).to(DEVICE)
        windows = torch.Generator().manual_seed(
            1000 + seed
        )  # same batches for every variant
        hist = train(
            model,
            lambda step, g=windows: sample_windows(train_ids, BATCH, SEQ, g, DEVICE),
            STEPS,
            make_adamw(model, lr=LR),
            lr_at=lambda s: cosine_lr(
                s, LR, warmup=STEPS // 10, total=STEPS, min_lr=LR / 10
            ),
        )
        lm_curves[name].append(hist.loss)
        lm_val[name].append(evaluate(model, val_batches))

print(
    f"{'FFN':<11} {'parameters':>10} "
    + "".join(f"{'seed ' + str(s):>8}" for s in SEEDS)
    + f"{'mean ± sd':>15}"
)
for name, losses in lm_val.items():
    arr = np.array(losses)
    print(
        f"{name:<11} {sizes[name]:>10,} "
        + "".join(f"{v:>8.3f}" for v in arr)
        + f"{arr.mean():>9.3f} ± {arr.std(ddof=1):.3f}"
    )
# training loss: the mean over the last 50 steps (fresh batches, each seen once)
tail = {
    name: [float(np.mean(c[-50:])) for c in curves]
    for name, curves in lm_curves.items()
}
pairs = [(name, "MLP (GELU)") for name in VARIANTS if name != "MLP (GELU)"]
pairs.append(("MLP (ReLU²)", "SwiGLU"))
gaps = {  # (a, b) -> (held-out, training): a − b, paired by seed, with its interval
    (a, b): (difference(lm_val[a], lm_val[b]), difference(tail[a], tail[b]))
    for a, b in pairs
}
print(f"{'paired by seed, 95 % interval':<26}{'held-out':>15}{'training':>16}")
for (a, b), (val_gap, train_gap) in gaps.items():
    print(f"  {a + ' − ' + b:<24}{val_gap.format(3):>15}{train_gap.format(3):>16}")
assert all(
    v < unigram_loss - 0.7 for losses in lm_val.values() for v in losses
)  # all runs learn
# the gate: on the training batches every GLU ends below the GELU MLP, beyond the
# interval...
assert all(gaps[name, "MLP (GELU)"][1].verdict == -1 for name in GATED)
# ...squared ReLU at the same parameters: these seeds tell it apart neither from SwiGLU
# nor from the GELU MLP, on either loss (the nulls the prose reports)
relu2_gaps = (*gaps["MLP (ReLU²)", "SwiGLU"], *gaps["MLP (ReLU²)", "MLP (GELU)"])
assert all(d.verdict == 0 for d in relu2_gaps)


def listing(names: list[str]) -> str:
    """'A', 'A and B', 'A, B and C'."""
    return " and ".join([", ".join(names[:-1]), names[-1]] if names[1:] else names)


held = {  # the held-out verdict of each GLU against the GELU MLP
    v: [n for n in GATED if gaps[n, "MLP (GELU)"][0].verdict == v] for v in (-1, 0, 1)
}
clauses = []  # one clause per outcome that occurs, chosen by the intervals
if held[-1]:
    ends = "ends" if len(held[-1]) == 1 else "end"
    below = "below the GELU MLP beyond the interval"
    clauses.append(f"{listing(held[-1])} also {ends} {below}")
if held[0]:
    clauses.append(f"for {listing(held[0])} the interval includes zero, a null")
if held[1]:
    ends = "ends" if len(held[1]) == 1 else "end"
    clauses.append(f"{listing(held[1])} {ends} above it beyond the interval")
glue("ch07-val-verdict", "On held-out text " + "; ".join(clauses) + ".", display=False)
glue("ch07-n-runs", f"{len(SEEDS) * len(VARIANTS)}", display=False)
glue("ch07-n-seeds", f"{len(SEEDS)}", display=False)
relu2_keys = {"SwiGLU": "relu2-swiglu", "MLP (GELU)": "relu2-mlp"}
for (a, b), (val_gap, train_gap) in gaps.items():
    key = relu2_keys[b] if a == "MLP (ReLU²)" else a.lower()
    glue(f"ch07-{key}-val", val_gap.format(3), display=False)
    glue(f"ch07-{key}-train", train_gap.format(3), display=False)
sds = [np.std(v, ddof=1) for v in lm_val.values()]
glue("ch07-seed-sd", f"{min(sds):.3f} to {max(sds):.3f}", display=False)

# %% tags=["hide-input", "remove-output"]
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), width_ratios=[1.4, 1])
window = 25
smooth = {  # (seeds, steps): each run's training loss, averaged over `window` steps
    name: np.array(
        [np.convolve(c, np.ones(window) / window, mode="valid") for c in curves]
    )
    for name, curves in lm_curves.items()
}
steps_axis = np.arange(window - 1, STEPS)
# the step from which every gated variant's mean gap to the MLP stays below zero
gated_gaps = np.array([(smooth[n] - smooth["MLP (GELU)"]).mean(0) for n in GATED])
not_ahead = np.nonzero(~(gated_gaps < 0).all(0))[0]
assert len(not_ahead) == 0 or not_ahead[-1] < len(steps_axis) - 1  # ahead at the end
ahead_from = steps_axis[not_ahead[-1] + 1] if len(not_ahead) else steps_axis[0]
glue("ch07-ahead-from", f"{ahead_from}", display=False)
axes[0].axhline(0, color=PALETTE[0], lw=1.5, label="MLP (GELU), the reference")
for j, name in enumerate(VARIANTS):
    style = ":" if VARIANTS[name][0] == "mlp" else "-"  # dotted: ungated
    if name != "MLP (GELU)":
        gap = smooth[name] - smooth["MLP (GELU)"]  # paired: same seed, same batches
        axes[0].plot(steps_axis, gap.mean(0), style, color=PALETTE[j], label=name)
        axes[0].fill_between(
            steps_axis, gap.min(0), gap.max(0), color=PALETTE[j], alpha=0.1
        )
    vals = np.array(lm_val[name])
    axes[1].plot(np.full(len(vals), j), vals, "o", color=PALETTE[j], alpha=0.6)
    axes[1].errorbar(
        j + 0.18,
        vals.mean(),
        yerr=vals.std(ddof=1),
        fmt="s",
        color=PALETTE[j],
        capsize=4,
    )
axes[0].set(
    xlabel="step",
    ylabel="training loss − MLP's (nats/char)",
    title=f"Gap to the GELU MLP, same seed ({window}-step mean; band: min–max)",
)
axes[0].legend(fontsize=8)
axes[1].set_xticks(range(len(VARIANTS)), list(VARIANTS), fontsize=7)
axes[1].set(
    ylabel="validation loss (nats/char)", title="Held-out loss: seeds and mean ± sd"
)
fig.suptitle("Does a gate, or a squared ReLU, beat the 2017 MLP at equal parameters?")
glue("fig-ffn-shakespeare", fig)
plt.close(fig)

# %% [markdown]
# ```{glue:figure} fig-ffn-shakespeare
# :name: fig-ffn-shakespeare
#
# Five FFNs with the same parameters in a one-layer decoder on Shakespeare, five seeds.
# Left: each variant's training loss minus the GELU MLP's on the same seed and batches
# (mean over seeds, band from the lowest to the highest seed; dotted: the ungated
# squared-ReLU MLP). Right: the held-out loss of every run (dots) and each variant's
# mean ± standard deviation over seeds (squares).
# ```
#
# All {glue:text}`ch07-n-runs` runs learn: every held-out loss is about a nat below the
# {glue:text}`ch07-unigram` nats of letter frequencies. The left panel of
# {numref}`fig-ffn-shakespeare` shows the gated variants pulling ahead of the MLP: averaged
# over seeds, all three stay below it from step {glue:text}`ch07-ahead-from` on. By the
# end, on the training batches (fresh windows at every step, so not a matter of
# memorisation), each GLU's paired gap to the GELU MLP lies below zero with its whole
# interval: ReGLU {glue:text}`ch07-reglu-train`, GeGLU {glue:text}`ch07-geglu-train`,
# SwiGLU {glue:text}`ch07-swiglu-train` nats. On the held-out plays the gaps are ReGLU
# {glue:text}`ch07-reglu-val`, GeGLU {glue:text}`ch07-geglu-val` and SwiGLU
# {glue:text}`ch07-swiglu-val` nats, to be set against the spread of a single variant
# between seeds (standard deviations of {glue:text}`ch07-seed-sd` nats): pairing the runs
# by seed is what lets {glue:text}`ch07-n-seeds` seeds see gaps this small.
# {glue:text}`ch07-val-verdict` The table makes ten such comparisons, and at the 5 % level
# one of them could exclude zero by chance alone: an interval that only just clears zero
# is weak evidence on its own.
# We draw no conclusion about the order among the three gated variants: one learning rate,
# tuned for none of them, can reorder gaps this small. The notebook asserts equal
# parameter counts, that every run learns, and the training-batch gaps.
#
# Squared ReLU changes the activation, not the form: an ungated MLP of width $4d$. Against
# SwiGLU at the same parameters its paired gap is {glue:text}`ch07-relu2-swiglu-val` nats
# held out and {glue:text}`ch07-relu2-swiglu-train` on the training batches; against the
# GELU MLP, {glue:text}`ch07-relu2-mlp-val` and {glue:text}`ch07-relu2-mlp-train`. All four
# intervals include zero, and the notebook asserts it: this is a null result. Five seeds of
# a one-layer model at 250 steps cannot tell squared ReLU from SwiGLU, or from GELU. That
# neither confirms nor contradicts the speedrun, which races a 124-million-parameter GPT-2
# to a target validation loss on eight H100 GPUs with every other choice tuned around it
# {cite:p}`jordan2024modded`, or Primer, whose search and comparisons used far larger
# models trained far longer {cite:p}`so2021primer`: a gain of one or two percent is far
# below what these seeds can resolve at this scale.
#
# Shazeer's gains were measured on a T5-base-sized model trained for hundreds of
# thousands of steps, and even there they were small, a few hundredths in held-out
# log-perplexity {cite}`shazeer2020glu`. A later study re-implemented many proposed
# Transformer modifications in one shared setting and found that most did not
# meaningfully help; the GLU variants were among the few that did
# {cite}`narang2021transformer`. Their shared setting was the T5 codebase, the one
# Shazeer's experiments had used, and the authors note that most of the variants they
# found beneficial had been developed there. SwiGLU spread because it was at
# least as good, cost nothing at parity, and the large labs that tried it kept it, not
# because a mechanism was proven. The product task shows what a gate *can* do that an MLP cannot
# do cheaply; how much of that a language model uses is still an open question.

# %% [markdown]
# ## What we learned
#
# The FFN changed in two ways at once, and they are worth keeping apart. The activation
# hardly matters: GELU and SiLU are one smooth curve at two scales, either costs a few
# percent of the FFN's time, and SiLU came in with the gate rather than on its own merits.
# The gate is the real change: a product of two projections, held to the 2017 parameter
# budget by shrinking the hidden width to $\tfrac83 d$, lets one layer compute
# multiplicative interactions that an MLP of the same size can only approximate, as the
# product task showed on every seed. Whether language models profit from that, our small
# Shakespeare runs answer only in part: over five paired seeds every GLU trained to a lower
# loss than the MLP, by more than the seeds' interval. {glue:text}`ch07-val-verdict` We
# drew no conclusion about the order of ReGLU, GeGLU and SwiGLU among themselves.
#
# - Squared ReLU, $\max(0, x)^2$, found by Primer's search and used ungated by Nemotron-4
#   and the modded-nanogpt speedrun, is the one activation here not of the form
#   $x \cdot F(x)$: zero on the left like ReLU, smooth at 0 unlike it, quadratic on the
#   right. In an MLP of width $4d$, at SwiGLU's parameters, our five seeds could not tell
#   it from SwiGLU or from the GELU MLP on either loss: a null at this scale, not a verdict
#   on the speedrun's or Primer's much larger settings.
#
# | Component | 2017 default | Modern default | Quality gain (what this chapter measured) | Pressure that drove it |
# |---|---|---|---|---|
# | FFN | ReLU, two matrices | SwiGLU, three matrices (or an ungated squared-ReLU MLP) | Clear on a toy product task (over 10× lower error); on Shakespeare, lower training loss beyond the interval over 5 paired seeds (one layer), held-out: see {numref}`fig-ffn-shakespeare`; squared ReLU vs SwiGLU: null | Better parameter use |

# %% [markdown]
# ## Exercises
#
# 1. Shazeer's "bilinear" GLU has no activation at all: $W_\mathrm{down}(W_\mathrm{gate}x
#    \odot W_\mathrm{up}x)$. Build one from a `GatedFeedForward` by replacing its `act` with
#    the identity, and train it on the product task. How many hidden units does it need per
#    product, and how does it do with $\tfrac83 d$?
#
# ```{admonition} Solution
# :class: dropdown
# `glu = GatedFeedForward(24, 64); glu.act = lambda z: z`, then `train_regression(glu, 24,
# 500)`. One unit per product suffices (gate $= x_k$, up $= x_{k-1}$), so 24 of its 64 units
# are enough; when we ran it, its error after 500 steps was near $3 \cdot 10^{-5}$, lower
# than the SwiGLU's, since it has nothing to approximate. On language Shazeer found the
# bilinear form about as
# good as the other GLUs {cite}`shazeer2020glu`: the product seems to matter more than the
# activation.
# ```
#
# 2. Llama 2 13B has $d = 5120$ and an FFN width of 13,824; Llama 2 70B has $d = 8192$ and
#    28,672. Which rounding rules reproduce these with `glu_hidden_size`?
#
# ```{admonition} Solution
# :class: dropdown
# `glu_hidden_size(5120) == 13824` (8/3 rule, multiple of 256).
# `glu_hidden_size(8192, multiple_of=4096, multiplier=1.3) == 28672`: the 70B model already
# used the 1.3 multiplier that Llama 3 8B later adopted, with a coarser rounding.
# ```
#
# 3. How wide must the GELU MLP be to match the SwiGLU on the product task? Train it with
#    hidden widths $4d, 8d, 16d, 32d$ and plot its error against its number of weights.
#
# ```{admonition} Hint
# :class: dropdown
# `FeedForward(24, w, "gelu", bias=False)` for each width `w`, 500 steps each. In our runs
# each doubling of the width cut the error by only about 40% (0.034, 0.020, 0.013 for $4d$,
# $8d$, $16d$): matching the SwiGLU would take a far bigger MLP.
# ```
#
# 4. Rerun the Shakespeare comparison with `FULL = True` on a GPU (four layers, $d = 128$,
#    3000 steps, five seeds). Do the held-out gaps between the MLP and the GLU variants, and
#    between squared ReLU and SwiGLU, move out of their intervals?
#
# ```{admonition} Hint
# :class: dropdown
# Compare the paired differences (same seed, same batches) with their standard deviation.
# Shazeer's gains were a few hundredths in log-perplexity on a much larger model and
# dataset {cite}`shazeer2020glu`: a small effect needs many seeds, or a bigger model, to see.
# ```
#
# 5. Time the backward pass too: wrap each activation in `torch.autograd.grad` on the
#    tensor `z` of the timing cell. Does the ordering of the five activations change?
#
# ```{admonition} Hint
# :class: dropdown
# The derivative of GELU needs $\Phi$ and the normal density $\varphi$; SiLU's needs only the
# sigmoid it computed on the way forward. Time `torch.autograd.grad(f(zr).sum(), zr)` with
# `zr = z.clone().requires_grad_()`.
# ```

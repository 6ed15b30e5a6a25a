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
# # 8 · The KV cache: MQA, GQA and MLA
#
# ```{admonition} The question
# :class: tip
# Why did attention stop giving every query head its own keys and values, and what do MQA, GQA and MLA each save?
# Not quality but decoding: under multi-head attention every generated token reads the whole cache for one FLOP per byte, and sharing K/V heads (GQA keeps a quarter of the cache at Llama 3 8B's shape, MQA a thirty-second) or caching one compressed latent per token (MLA, about seventy times smaller than DeepSeek-V3's equivalent MHA) cuts the bytes a step must read by the factors the cache formula gives, checked against the caches the modules allocate; the chapter measures no quality, and its CPU timings neither confirm nor refute that decode time follows the bytes.
# ```
#
# In the 2017 Transformer every attention head had its own keys and values
# {cite}`vaswani2017attention`. In Llama 3 eight key/value heads serve thirty-two query
# heads {cite}`grattafiori2024llama`; in DeepSeek-V3 there are no per-head keys in memory at
# all, only one 512-number summary of each token and one 64-number rotated key
# {cite}`deepseekai2024deepseekv3`. None of these changes was made to model language
# better. They were made because of what happens *after* training, when a model writes
# its answer one token at a time and has to keep the keys and values of everything it has
# read so far: the **KV cache**.
#
# This chapter follows that pressure from the bottom up. First why a cache at all: the same
# tokens with it and without it, and linear instead of quadratic work. Then its size, from
# one formula, for the released models in `companion.models.presets`. Then the less obvious
# problem, which explains the rest of the chapter: not the bytes the cache *occupies* but
# the bytes each decoding step must *read*, against the few FLOPs it does with them. The
# answers in order: multi-query attention (MQA) {cite}`shazeer2019fast`, grouped-query
# attention (GQA) {cite}`ainslie2023gqa`, and multi-head latent attention (MLA)
# {cite}`deepseekai2024deepseekv2`, each run, compared with its reference, and measured in
# bytes. At the end: the decode path that `companion` uses for speed.

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

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import HTML, Code
from matplotlib.patches import Patch
from torch.utils.flop_counter import FlopCounterMode

from companion import COLORS
from companion.analysis.calculator import (
    count_params,
    flops_per_token,
    kv_cache_bytes,
    kv_cache_bytes_per_token,
)
from companion.analysis.decode_cost import (
    arithmetic_intensity,
    attainable_flops,
    attended_pairs,
    decode_attention_bytes,
    decode_attention_flops,
    max_context_tokens,
    projected_tokens,
    ridge_point,
)
from companion.bench.bandwidth import LAYOUTS, bench_kv_read, format_kv_read
from companion.device import default_device, default_dtype, describe
from companion.layers.kv_cache import KVCache, LatentCache, position_mask
from companion.layers.mla import MultiHeadLatentAttention, bytes_per_token
from companion.layers.rotary import RotaryEmbedding
from companion.models.builders import build_mixer
from companion.models.config_parts import MLAConfig
from companion.models.decoder import DecoderLM
from companion.models.generation import decode_one_token
from companion.models.presets import PRESETS, preset, spec_row, tiny
from companion.ops.attention import naive_attention
from companion.ops.grouped import expand_kv, grouped_attention
from companion.ops.rope import apply_rope, rope_frequencies
from companion.plotting import PALETTE, animate, glue, loglog_fit, use_style
from companion.training import seed_everything

# True: longer generations and caches (use a GPU for the timing section)
FULL = False
DEVICE = default_device() if FULL else torch.device("cpu")
use_style()
seed_everything(0)
# Every model here is tiny: one thread is nearly as fast as two on an idle 2-core
# machine, and much faster when other programs share the cores.
torch.set_num_threads(1)
print(describe(DEVICE))

KIB, MIB, GIB = 2**10, 2**20, 2**30

# %% [markdown]
# ## Why cache at all
#
# A decoder writes one token, appends it to its input, and runs again. In a causal model
# the keys and values of the earlier positions do not depend on anything that comes later,
# so the second run recomputes, exactly, what the first one computed, plus one new
# position. The cache keeps every layer's keys and values and feeds the model only the new
# token: the prompt is read once in one batched pass (the *prefill*), then each step costs
# one token's worth of projections and one row of attention.
#
# We check both halves of that on a small `DecoderLM` with random weights (two layers,
# four query heads sharing two K/V heads, RoPE). A forward pre-hook on the first layer's
# attention records, for every forward pass, how many tokens go through its projections
# and how many (query, key) pairs its causal attention scores.

# %% tags=["hide-input"]
tiny_cfg = tiny(
    vocab_size=96,
    d_model=64,
    d_ff=128,
    max_seq_len=256,
    tie_embeddings=False,
    init_std=0.1,
)
seed_everything(0)
tiny_lm = DecoderLM(tiny_cfg).eval().to(DEVICE)
PROMPT, NEW = 8, (192 if FULL else 48)
prompt = torch.randint(
    0, tiny_cfg.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1)
)
prompt = prompt.to(DEVICE)


def generate_counting(
    model: DecoderLM, ids: torch.Tensor, new: int, use_cache: bool
):  # fmt: skip
    """Greedy generation; per forward pass, the tokens layer 0's attention projects
    and the causal (query, key) pairs it scores, read by a pre-hook from its input
    and positions."""
    passes = []

    def hook(module, args, kwargs):
        t, pos = args[0].shape[1], args[1].cpu()  # the block passes the positions
        passes.append((t, int((pos + 1).sum())))  # query at p sees keys 0..p

    handle = model.blocks[0].attn.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        out = model.generate(ids, new, use_cache=use_cache)
    finally:
        handle.remove()
    return out, np.array(passes)


with_cache, work_cached = generate_counting(tiny_lm, prompt, NEW, use_cache=True)
without, work_recomputed = generate_counting(tiny_lm, prompt, NEW, use_cache=False)
print("first generated ids:", with_cache[0, PROMPT : PROMPT + 12].tolist())
print(
    f"identical tokens with and without the cache: "
    f"{torch.equal(with_cache, without)}"
)  # fmt: skip
assert torch.equal(with_cache, without)

# the cached logits are the full forward's logits, position by position
with torch.no_grad():
    full = tiny_lm(with_cache)  # one pass over the whole sequence, no cache
    cache = tiny_lm.new_cache(1, with_cache.shape[1])
    steps = [tiny_lm(with_cache[:, :PROMPT], cache=cache)]
    steps += [
        tiny_lm(with_cache[:, t : t + 1], cache=cache)
        for t in range(PROMPT, with_cache.shape[1])
    ]
gap = (torch.cat(steps, dim=1) - full).abs().max().item()
print(
    f"max |cached logits − full-forward logits| "
    f"over {with_cache.shape[1]} positions "
    f"< 1e-5: {gap < 1e-5}"
)  # fmt: skip
assert gap < 1e-5

for name, work, cached in (
    ("cache", work_cached, True),
    ("recompute", work_recomputed, False),
):
    rows, pairs = work.sum(axis=0)
    print(
        f"{name:<10} {len(work):>3} passes {rows:>6,} projected tokens "
        f"{pairs:>7,} scored pairs"
    )
    assert rows == projected_tokens(PROMPT, NEW, cached=cached)
    assert pairs == attended_pairs(PROMPT, NEW, cached=cached)
    glue(f"ch08-rows-{name}", f"{rows:,}", display=False)
glue("ch08-prompt", f"{PROMPT}", display=False)
glue("ch08-new", f"{NEW}", display=False)

# %% [markdown]
# The tokens are identical, and the logits agree to float32 rounding at every position. The
# work does not: to write {glue:text}`ch08-new` tokens after a {glue:text}`ch08-prompt`-token
# prompt, the model with a cache pushes {glue:text}`ch08-rows-cache` tokens through each
# projection, the one without pushes {glue:text}`ch08-rows-recompute` (every pass re-reads
# the whole sequence). The counts are the ones `companion.analysis.decode_cost` predicts,
# $P + n - 1$ against $\sum_{i<n}(P + i)$, and the scored pairs follow the same pattern one
# power higher. Per step, recomputation costs a whole forward pass over the sequence so
# far; the cache costs one token's projections and one row of attention.
#
# At a real model's size the same arithmetic comes from
# `companion.analysis.calculator.flops_per_token`, the forward FLOPs of one token that
# attends to $s$ keys ({doc}`chapter 13 <13_build_a_model>` builds the calculator). It is affine in $s$: a constant $2N$ for the weights it multiplies, plus
# $4 L H D\, s$ for scores and weighted values. Summing it over the positions each step
# must process gives the cost of generating $n$ tokens, here for Llama 3 8B.

# %% tags=["hide-input"]
llama3 = preset("llama3-8b")
# the weights: 2 FLOPs per active weight (head included)
a = flops_per_token(llama3, 0)
b = flops_per_token(llama3, 1) - a  # attention: 4·L·H·D per key
assert b == 4 * llama3.n_layers * llama3.n_heads * llama3.head_dim
assert all(flops_per_token(llama3, s) == a + b * s for s in (1, 1000, 8192))
n = np.arange(
    1, (32768 if FULL else 8192) + 1, dtype=np.float64
)  # sequence length per step
step_cached = a + b * n  # the new token attends to n keys
step_recomputed = a * n + b * n * (n + 1) / 2  # all n positions again, causal
total_cached, total_recomputed = np.cumsum(step_cached), np.cumsum(step_recomputed)
fit = n >= 1024
slope_c, _ = loglog_fit(n[fit], total_cached[fit])
slope_r, _ = loglog_fit(n[fit], total_recomputed[fit])
ratio_8k = total_recomputed[8191] / total_cached[8191]
print(
    f"FLOPs per token: {a / 1e9:.1f} GFLOP for the weights "
    f"+ {b / 1e3:.0f} kFLOP per cached key"
)
print(
    f"generating 8,192 tokens: recompute {total_recomputed[8191]:.1e} FLOPs, "
    f"cache {total_cached[8191]:.1e} FLOPs ({ratio_8k:,.0f}× fewer)"
)
print(
    f"log-log slopes of the totals from 1k tokens: recompute {slope_r:.2f}, "
    f"cache {slope_c:.2f}"
)
assert 1.9 < slope_r < 2.3 and 0.95 < slope_c < 1.3
# the closed form of the two sums, against the cumulative sums above
n_8k = 8192
closed_c = a * n_8k + b * n_8k * (n_8k + 1) / 2
closed_r = a * n_8k * (n_8k + 1) / 2 + b * n_8k * (n_8k + 1) * (n_8k + 2) / 6
assert abs(ratio_8k / (closed_r / closed_c) - 1) < 1e-9
glue("ch08-ratio-8k", f"{ratio_8k:,.0f}", display=False)
glue("ch08-slope-r", f"{slope_r:.2f}", display=False)
glue("ch08-slope-c", f"{slope_c:.2f}", display=False)

# %% tags=["hide-input"]
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
for j, (name, work) in enumerate(
    (("recompute", work_recomputed), ("cache", work_cached))
):
    axes[0].plot(
        np.arange(1, len(work) + 1),
        work[:, 0],
        "o-",
        ms=3,
        color=PALETTE[j],
        label=name,
    )
axes[0].set(
    xlabel="generation step",
    ylabel="tokens through the projections",
    title=f"Tiny model, {PROMPT}-token prompt: work per step",
)
axes[0].legend()
for j, (name, total) in enumerate(
    (("recompute", total_recomputed), ("cache", total_cached))
):
    axes[1].loglog(n, total, color=PALETTE[j], label=name)
axes[1].set(
    xlabel="tokens generated",
    ylabel="forward FLOPs, total",
    title="Llama 3 8B: quadratic against linear",
)
axes[1].legend()
plt.show()

# %% [markdown]
# On the left the first step of both is the prompt; after it, recomputation processes one
# more token each step, the cache one token always. On the right, the totals for Llama 3 8B
# grow with log-log slopes of {glue:text}`ch08-slope-r` against {glue:text}`ch08-slope-c`
# from 1,024 tokens on, and the cache makes 8,192 tokens {glue:text}`ch08-ratio-8k` times
# cheaper in FLOPs (the attention term bends both curves above slopes 2 and 1). In
# practice every decoder keeps a cache; the question is what to keep in it, and how much.
#
# ## How big the cache is
#
# Every attention layer keeps, for every position, a key and a value for each of its
# $n_\mathrm{kv}$ key/value heads of width $d_h$. For $L$ layers, $s$ positions, a batch
# of $b$ sequences:
#
# $$\text{bytes}_\mathrm{KV} = 2 \cdot L \cdot n_\mathrm{kv} \cdot d_h \cdot s \cdot b
# \cdot \text{bytes per element},$$
#
# the 2 for K and V. In the 2017 design $n_\mathrm{kv}$ is the number of query heads. Llama 3
# 8B has 32 layers and 32 query heads of width 128, but only 8 key/value heads. We build the
# same model with a full set of 32 K/V heads (`replace` on the preset, which
# validates the new config) and compare, in bf16:

# %%
gqa_8b = preset("llama3-8b")
assert (gqa_8b.n_layers, gqa_8b.n_heads, gqa_8b.n_kv_heads, gqa_8b.head_dim) == (
    32,
    32,
    8,
    128,
)
mha_8b = gqa_8b.replace(n_kv_heads=gqa_8b.n_heads)  # the 2017 layout
S128K = 128 * 1024
weights_8b = count_params(gqa_8b).total * 2  # bf16, the released model
print(
    f"Llama 3 8B: {count_params(gqa_8b).total:,} parameters "
    f"= {weights_8b / 1e9:.2f} GB "
    f"({weights_8b / GIB:.2f} GiB) of bf16 weights"
)
per_token = {}
for name, cfg in (("MHA, 32 K/V heads", mha_8b), ("GQA, 8 K/V heads", gqa_8b)):
    per_token[name] = kv_cache_bytes_per_token(cfg, dtype_bytes=2)
    at_128k = kv_cache_bytes(cfg, S128K, dtype_bytes=2)
    room = max_context_tokens(80 * GIB, weights_8b, per_token[name])
    print(
        f"{name}: {per_token[name] / KIB:.0f} KiB/token; "
        f"128k tokens: {at_128k / GIB:.0f} GiB "
        f"= {at_128k / weights_8b:.1f}× the weights"
    )
    print(f"{'':<{len(name)}}  an 80 GiB GPU holds {room:,} tokens")
    assert per_token[name] == 2 * 32 * cfg.n_kv_heads * 128 * 2
    key = "mha" if cfg.n_kv_heads == cfg.n_heads else "gqa"
    glue(f"ch08-{key}-kib", f"{per_token[name] / KIB:.0f}", display=False)
    glue(f"ch08-{key}-128k-gib", f"{at_128k / GIB:.0f}", display=False)
    glue(f"ch08-{key}-users", f"{room // S128K}", display=False)
glue("ch08-weights-gib", f"{weights_8b / GIB:.0f}", display=False)
glue("ch08-weights-gb", f"{weights_8b / 1e9:.1f}", display=False)
glue(
    "ch08-mha-over-weights",
    f"{kv_cache_bytes(mha_8b, S128K) / weights_8b:.1f}",
    display=False,
)
assert (
    per_token["MHA, 32 K/V heads"] == 512 * KIB
    and per_token["GQA, 8 K/V heads"] == 128 * KIB
)
assert (
    kv_cache_bytes(mha_8b, S128K) == 64 * GIB
    and kv_cache_bytes(gqa_8b, S128K) == 16 * GIB
)
assert weights_8b == 2 * 8_030_261_248  # the released model's parameter count

# %% [markdown]
# With 2017-style heads every token costs {glue:text}`ch08-mha-kib` KiB, and one 128k-token
# conversation needs {glue:text}`ch08-mha-128k-gib` GiB of cache,
# {glue:text}`ch08-mha-over-weights` times the model's own {glue:text}`ch08-weights-gib` GiB
# ({glue:text}`ch08-weights-gb` GB) of weights. On an 80 GiB GPU that is
# {glue:text}`ch08-mha-users` user at that length, with nothing left over for activations.
# GQA's eight K/V heads cut it to {glue:text}`ch08-gqa-kib` KiB per token and
# {glue:text}`ch08-gqa-128k-gib` GiB per 128k conversation: {glue:text}`ch08-gqa-users`
# users.
#
# The same formula for every preset in `companion`, with the cache at each model's full
# context. `kv_cache_bytes` also knows what the formula leaves out: sliding-window layers
# keep only the last $w$ positions ({doc}`chapter 9 <09_sliding_windows>`), Gated DeltaNet
# layers a fixed state ({doc}`chapter 11 <11_linear_attention>`), and an MLA layer one
# latent and one RoPE key per position (below).

# %% tags=["hide-input"]
print("cache: at the model's full context; weights: bf16; both in GiB")
print(
    f"{'model':<20}{'attention':<38}{'KiB/tok':>7}{'context':>8}"
    f"{'cache':>7}{'weights':>7}"
)
rows = {}
for name, cfg in PRESETS.items():
    kib = kv_cache_bytes_per_token(cfg) / KIB
    cache_gib = kv_cache_bytes(cfg, cfg.max_seq_len) / GIB
    weight_gib = count_params(cfg).total * 2 / GIB
    rows[name] = (kib, cache_gib, weight_gib)
    print(
        f"{name:<20}{spec_row(cfg)['attention']:<38}{kib:>7.1f}"
        f"{cfg.max_seq_len // 1024:>7,}k{cache_gib:>7.2f}{weight_gib:>7.1f}"
    )
assert (
    rows["gpt2"][0] == 36
    and rows["llama2-7b"][0] == 512
    and rows["smollm2-135m"][0] == 22.5
)
assert (
    rows["deepseek-v3"][0] == 70_272 / KIB
)  # 68.6 KiB, the smallest of the large models
assert rows["mistral-7b"][1] == 0.5  # a 4096-token window caps the whole cache
assert (
    rows["llama3.1-8b"][1] == 16 and rows["llama3.1-8b"][1] > rows["llama3.1-8b"][2]
)  # fmt: skip
mha_presets = [
    name
    for name, cfg in PRESETS.items()
    if not cfg.is_mla and cfg.n_kv_heads == cfg.n_heads
]
assert mha_presets == ["gpt2", "gpt2-xl", "gpt3-175b", "llama2-7b"]
assert all(r[0] < 512 for name, r in rows.items() if name not in mha_presets)
# over 10 GiB of bf16 weights
big = {name: r for name, r in rows.items() if r[2] > 10}
lower = {name for name, r in big.items() if r[0] < big["deepseek-v3"][0]}
hybrids = {name for name in big if "linear" in PRESETS[name].layer_types}
assert hybrids <= lower  # every large hybrid caches less per token than DeepSeek-V3
# and the one below it without a linear layer pools its keys
assert [PRESETS[name].compression is not None for name in lower - hybrids] == [True]
glue("ch08-n-lower", str(len(lower)), display=False)
glue("ch08-llama2-kib", f"{rows['llama2-7b'][0]:.0f}", display=False)
glue("ch08-llama31-gib", f"{rows['llama3.1-8b'][1]:.0f}", display=False)
glue("ch08-v3-kib", f"{rows['deepseek-v3'][0]:.1f}", display=False)
glue("ch08-mistral-gib", f"{rows['mistral-7b'][1]:.1f}", display=False)

# %% [markdown]
# Three things stand out. Llama 2 7B, the last model here with one K/V head per query
# head, pays {glue:text}`ch08-llama2-kib` KiB per token; every model after it pays less,
# though most are larger. Llama 3.1 8B's cache at its full 131,072-token context
# ({glue:text}`ch08-llama31-gib` GiB) outweighs its weights. And DeepSeek-V3, with 671
# billion parameters and 128 heads, caches {glue:text}`ch08-v3-kib` KiB per token; among
# the models with over 10 GiB of weights only {glue:text}`ch08-n-lower` go lower: the
# hybrids (Qwen3-Next, and from late 2025 Kimi Linear, Ling and Qwen3.5), because most of
# their layers are linear-attention layers with a fixed state instead of a cache, and
# DeepSeek-V4-Flash, whose layers keep a short window and pool older keys into a few
# entries. (Mistral's
# {glue:text}`ch08-mistral-gib` GiB, and the totals of gpt-oss, Gemma 3 and Olmo 3, are
# small for their per-token cost because of sliding windows, which
# {doc}`chapter 9 <09_sliding_windows>` takes up.)
#
# ### Bytes per element is a dial
#
# Every byte so far is bf16, 2 per number. The formula's last factor is a choice like
# the others: a cache can hold its numbers in one byte, as 8-bit integers or in the
# fp8 E4M3 format {cite:p}`micikevicius2022fp8`, if each number keeps a scale to map
# it back. One scale per cached *row* (one key or one value of one head, one MLA latent
# row) adds a few bytes to every row of $d_h$ numbers:
#
# $$\text{bytes}_\mathrm{KV} = 2 \cdot L \cdot n_\mathrm{kv} \cdot s \cdot b \cdot
# (d_h \cdot \text{bytes per element} + \text{bytes of scale per row}).$$
#
# A single scale per tensor costs nothing per row, but then one outlier sets the step
# for every row; a scale per row follows each token's own range. Both are dials of
# `kv_cache_bytes_per_token` and `kv_cache_bytes` (`dtype_bytes`, `scale_bytes`), and
# of the calculator in {doc}`chapter 13 <13_build_a_model>`. Per token, with an fp32
# scale (4 bytes) per row:

# %%
FORMATS = {"bf16": (2, 0), "8-bit": (1, 0), "8-bit + scale": (1, 4)}  # (b, scale)
print(f"{'bytes per token':<16}" + "".join(f"{f:>15}" for f in FORMATS), "   saved")
cost = {}
for name in ("smollm2-135m", "llama3-8b", "deepseek-v3"):
    cost[name] = [
        kv_cache_bytes_per_token(preset(name), b, scale_bytes=s)
        for b, s in FORMATS.values()
    ]
    saved = 1 - cost[name][2] / cost[name][0]
    print(f"{name:<16}" + "".join(f"{c:>15,}" for c in cost[name]), f"{saved:>8.1%}")

# %% tags=["hide-input"]
# hand counts: rows of d_h numbers, each with its 4-byte scale
assert cost["llama3-8b"] == [32 * 16 * 128 * 2, 32 * 16 * 128, 32 * 16 * (128 + 4)]
assert cost["smollm2-135m"][2] == 30 * 2 * 3 * (64 + 4)  # 3 K/V heads of 64
assert cost["deepseek-v3"][2] == 61 * (512 + 64 + 4)  # one latent row per layer
for name, (bf16, bare, scaled) in cost.items():
    assert bf16 == 2 * bare < 2 * scaled  # the scale is what 8 bits do not halve
    key = {"smollm2-135m": "smol", "llama3-8b": "llama", "deepseek-v3": "v3"}[name]
    glue(f"ch08-int8-{key}-saved", f"{1 - scaled / bf16:.1%}", display=False)
    glue(f"ch08-int8-{key}-kib", f"{scaled / KIB:.1f}", display=False)
glue("ch08-bf16-llama-kib", f"{cost['llama3-8b'][0] / KIB:.0f}", display=False)
gqa_room = {  # 128k-token sequences an 80 GiB GPU holds beside the bf16 weights
    f: max_context_tokens(80 * GIB, weights_8b, c) // S128K
    for f, c in zip(FORMATS, cost["llama3-8b"], strict=True)
}
gqa_bf16 = per_token["GQA, 8 K/V heads"]  # the bf16 count above
room_bf16 = max_context_tokens(80 * GIB, weights_8b, gqa_bf16)
assert gqa_room["bf16"] == room_bf16 // S128K
assert gqa_room["8-bit + scale"] > gqa_room["bf16"]
glue("ch08-int8-users", str(gqa_room["8-bit + scale"]), display=False)

# %% tags=["hide-input", "remove-output"]
SHOWN = ["gpt2", "smollm2-135m", "llama3-8b", "gemma3-27b", "qwen3-235b-a22b",
         "gpt-oss-120b", "deepseek-v3", "qwen3-next-80b-a3b",
         "deepseek-v4-flash"]  # fmt: skip
WIDE = ["smollm2-135m", "llama3-8b", "deepseek-v3"]  # rows of 64, 128, 576
fig, (ax_b, ax_s) = plt.subplots(1, 2, figsize=(9, 4.2), width_ratios=[1.3, 1])
ys = np.arange(len(SHOWN))[::-1]
for j, (fmt, (b, s)) in enumerate(FORMATS.items()):
    if fmt == "8-bit":
        continue  # the bars: bf16 against 8-bit with its scales
    kib = [kv_cache_bytes_per_token(preset(n), b, scale_bytes=s) for n in SHOWN]
    ax_b.barh(ys + (0.2 if j == 0 else -0.2), np.array(kib) / KIB, height=0.4,
              color=PALETTE[0 if j == 0 else 2], label=fmt)  # fmt: skip
ax_b.set_yticks(ys, SHOWN, fontsize=7)
ax_b.set_xscale("log")
ax_b.xaxis.set_major_formatter(lambda value, _: f"{value:g}")
ax_b.set(xlabel="KV cache per token, KiB (all layers)",
         title="What does an 8-bit cache save per token?")  # fmt: skip
ax_b.legend(fontsize=8, loc="lower right")
scales = np.arange(0, 9)
for name, color in zip(WIDE, (PALETTE[1], PALETTE[0], PALETTE[3]), strict=True):
    cfg = preset(name)
    bf16 = kv_cache_bytes_per_token(cfg)
    kept = [kv_cache_bytes_per_token(cfg, 1, scale_bytes=int(s)) for s in scales]
    ax_s.plot(scales, np.array(kept) / bf16, "o-", ms=3, color=color, label=name)
ax_s.axhline(0.5, color="grey", ls="--", lw=1)
ax_s.set_xticks(scales)
ax_s.set(xlabel="bytes of scale per cached row", ylabel="8-bit cache / bf16 cache",
         title="How much of the half do the scales take back?")  # fmt: skip
ax_s.legend(fontsize=8)
glue("fig-kv-dtype", fig)
plt.close(fig)

# %% [markdown]
# ```{glue:figure} fig-kv-dtype
# :name: fig-kv-dtype
#
# Bytes per element as a dial. Left: KV cache per token (all layers, context shorter
# than every window) for nine presets, in bf16 and in 8-bit numbers with one fp32
# scale per cached row. Right: the 8-bit cache as a share of the bf16 one as the scale
# grows from 0 to 8 bytes per row, for rows of 64 numbers (SmolLM2-135M), 128 (Llama 3
# 8B) and 576 (DeepSeek-V3's latent row); the dashed line is the half that 8 bits alone
# would give. Narrow rows pay the most for their scales.
# ```

# %% [markdown]
# With a scale per row an 8-bit cache saves {glue:text}`ch08-int8-llama-saved` of
# Llama 3 8B's bf16 cache ({glue:text}`ch08-int8-llama-kib` KiB per token instead of
# {glue:text}`ch08-bf16-llama-kib`; {glue:text}`ch08-int8-users` sequences of 128k
# tokens on the 80 GiB GPU instead of {glue:text}`ch08-gqa-users`), not half: each row
# of 128 numbers carries its 4 bytes of scale. SmolLM2-135M's rows of 64 numbers save
# {glue:text}`ch08-int8-smol-saved`, DeepSeek-V3's latent rows of 576 numbers
# {glue:text}`ch08-int8-v3-saved` ({numref}`fig-kv-dtype`). The dial takes whole
# bytes: the 2- to 4-bit caches of KIVI and KVQuant
# {cite:p}`liu2024kivi,hooper2024kvquant`, which pack several numbers into a byte and
# give keys a scale per channel, are beyond it. What the rounding costs in quality is
# no part of this formula; {doc}`chapter 16 <16_serving>` builds int8 and fp8 caches
# and measures it on SmolLM2-135M's real weights.
#
# ## Bandwidth, not capacity
#
# Capacity is the obvious problem; the one that shaped the designs is bandwidth. In one
# decoding step, each layer's attention must read its whole cache, $2 n_\mathrm{kv} d_h s$
# numbers, and do little with them: $2 n_q d_h s$ FLOPs for the scores $q \cdot k$ and as
# many for the weighted sum of the values. Its **arithmetic intensity**, FLOPs per byte
# moved, is in bf16 (2 bytes per number)
#
# $$I = \frac{4\, n_q\, d_h\, s}{2 \cdot 2\, n_\mathrm{kv}\, d_h\, s}
#     = \frac{n_q}{n_\mathrm{kv}} \ \text{FLOPs per byte},$$
#
# whatever the context length, the head width or the batch (each sequence has its own
# cache, so a batch multiplies FLOPs and bytes alike). A chip's **ridge point** is the
# intensity at which it can feed its arithmetic units from memory: peak FLOP/s divided by
# bytes/s. Below it, a kernel waits on memory; this is the *roofline* model
# {cite}`williams2009roofline`. An H100 SXM does about 989 TFLOP/s of dense bf16 against
# 3.35 TB/s of HBM3.

# %%
H100_FLOPS, H100_BW = (
    989e12,
    3.35e12,
)  # dense bf16 FLOP/s, HBM bytes/s (H100 SXM datasheet)
ridge = ridge_point(H100_FLOPS, H100_BW)
print(f"H100 SXM ridge point: {ridge:.1f} FLOPs/byte")
glue("ch08-ridge", f"{ridge:.0f}", display=False)

# measured, not derived: torch's FLOP counter on one real decode step of
# grouped_attention, over the bytes of the bf16 cache it reads
measured = set()
for s in (16, 256):
    for b in (1, 3):
        for d_h in (64, 128):
            for n_q, n_kv in ((32, 32), (32, 8), (32, 1), (64, 4)):
                kv = KVCache(b, n_kv, s, d_h, dtype=torch.bfloat16)
                q1 = torch.zeros(b, n_q, 1, d_h, dtype=torch.bfloat16)
                with FlopCounterMode(display=False) as counter:
                    grouped_attention(q1, kv.k, kv.v)
                flops, nbytes = counter.get_total_flops(), kv.k.nbytes + kv.v.nbytes
                # the counted step is the formula's step ...
                assert flops == decode_attention_flops(n_q, d_h, d_h, s, b)
                assert nbytes == decode_attention_bytes(2 * n_kv * d_h, s, b)
                intensity_now = arithmetic_intensity(flops, nbytes)
                measured.add((n_q, n_kv, intensity_now))
# ... and its intensity depends on the head counts alone
assert all(i == n_q / n_kv for n_q, n_kv, i in measured)
assert len({i for _, _, i in measured}) == 4  # one value per (n_q, n_kv)
print("counted FLOPs / cache bytes of a decode step, every context, batch and width:")
print("  " + ", ".join(f"{q}:{k} -> {i:g}" for q, k, i in sorted(measured)))

# %% [markdown]
# The counted FLOPs of a real step match the formula's, and their ratio to the bytes of the
# cache depends only on the head counts. Multi-head attention has $I = 1$: the H100 could
# do {glue:text}`ch08-ridge` times more arithmetic than the step asks for in the time it
# takes to stream the cache in. Making the FLOPs cheaper would change nothing; only reading
# fewer bytes helps. At 128k tokens, Llama 3 8B with MHA would read
# {glue:text}`ch08-mha-128k-gib` GiB of cache per generated token,
# {glue:text}`ch08-mha-over-weights` times its weights; that alone is
# {glue:text}`ch08-mha-ms` ms per token at the H100's bandwidth, whatever the tensor cores
# do. With GQA it is {glue:text}`ch08-gqa-128k-gib` GiB and {glue:text}`ch08-gqa-ms` ms.

# %%
for name, cfg in (("MHA", mha_8b), ("GQA", gqa_8b)):
    per_step = kv_cache_bytes(cfg, S128K)  # every layer reads its whole cache each step
    print(
        f"{name}: {per_step / GIB:.0f} GiB read per token at 128k = "
        f"{per_step / H100_BW * 1e3:.1f} ms at 3.35 TB/s (weights: "
        f"{weights_8b / H100_BW * 1e3:.1f} ms)"
    )
    glue(f"ch08-{name.lower()}-ms", f"{per_step / H100_BW * 1e3:.1f}", display=False)

# %% [markdown]
# This one ratio orders the rest of the chapter. Sharing K/V heads raises $I$ to
# $n_q / n_\mathrm{kv}$: {glue:text}`ch08-gqa-intensity` for Llama 3's GQA,
# {glue:text}`ch08-mqa-intensity` for MQA with 32 heads. MLA, in the absorbed form derived
# below, reads one shared latent row of $r + d_R = 576$ numbers per token and does
# $2 n_q (576 + 512)$ FLOPs with it, for DeepSeek's 128 heads $I = 128 \cdot 1088 / 576$,
# about {glue:text}`ch08-mla-intensity`, close to the ridge (counted on a real step below). The roofline puts each on the
# chip's curve:

# %% tags=["hide-input"]
# name: (FLOPs, bytes) of one layer's decode-step attention at any s (here 4096)
kinds = {
    "MHA 32:32": (
        decode_attention_flops(32, 128, 128, 4096),
        decode_attention_bytes(2 * 32 * 128, 4096),
    ),
    "GQA 32:8": (
        decode_attention_flops(32, 128, 128, 4096),
        decode_attention_bytes(2 * 8 * 128, 4096),
    ),
    "MQA 32:1": (
        decode_attention_flops(32, 128, 128, 4096),
        decode_attention_bytes(2 * 1 * 128, 4096),
    ),
    "MLA, 128 heads": (
        decode_attention_flops(128, 576, 512, 4096),
        decode_attention_bytes(576, 4096),
    ),
}
intensity = {name: arithmetic_intensity(*fb) for name, fb in kinds.items()}
for name, i in intensity.items():
    share = attainable_flops(i, H100_FLOPS, H100_BW) / H100_FLOPS
    print(
        f"{name:<15} I = {i:6.1f} FLOPs/byte "
        f"-> at most {share:6.1%} of the H100's peak"
    )  # fmt: skip
# the same ratios counted on real steps: the loop above for MHA, GQA and MQA; for
# MLA, 128 heads of the absorbed form reading a bf16 latent cache (keys 576 wide,
# values its first 512 numbers)
latent = LatentCache(1, 256, 512, 64, dtype=torch.bfloat16)
with FlopCounterMode(display=False) as counter:
    rows_kv = latent.kv[:, None]  # (1, 1, S, 576): one "head" shared by all 128
    grouped_attention(
        torch.zeros(1, 128, 1, 576, dtype=torch.bfloat16),
        rows_kv,
        rows_kv[..., :512]
    )  # fmt: skip
counted = {f"{q}:{k}": i for q, k, i in measured}
counted["MLA"] = arithmetic_intensity(counter.get_total_flops(), latent.kv.nbytes)
for name, i in intensity.items():  # the formula's intensity = the counted one
    assert i == counted["MLA" if name.startswith("MLA") else name.split()[1]], name
assert intensity["MLA, 128 heads"] < ridge  # near the ridge, still below it
for name, key in (
    ("GQA 32:8", "gqa"), ("MQA 32:1", "mqa"), ("MLA, 128 heads", "mla")
):  # fmt: skip
    glue(f"ch08-{key}-intensity", f"{intensity[name]:.0f}", display=False)

fig, ax = plt.subplots(figsize=(7, 3.6))
grid = np.logspace(-0.3, 3.3, 200)
ax.loglog(
    grid,
    [attainable_flops(i, H100_FLOPS, H100_BW) / 1e12 for i in grid],
    color="grey"
)  # fmt: skip
ax.axvline(ridge, color="grey", ls=":", lw=1)
ax.text(
    ridge * 1.08, 1.5, f"ridge point\n{ridge:.0f} FLOPs/byte",
    fontsize=8, color="grey"
)  # fmt: skip
for j, (name, i) in enumerate(intensity.items()):
    ax.plot(
        i,
        attainable_flops(i, H100_FLOPS, H100_BW) / 1e12,
        "o",
        color=PALETTE[j],
        label=name,
    )
ax.set(
    xlabel="arithmetic intensity (FLOPs per byte)",
    ylabel="attainable TFLOP/s",
    title="H100 roofline: where decode attention sits",
)
ax.legend(loc="upper left")
plt.show()

# %% [markdown]
# The weights have the same problem at batch 1, where every bf16 weight is read for 2
# FLOPs ($I = 1$); batching fixes that, since $b$ sequences share one read of each weight.
# Batching does nothing for attention, whose bytes grow with the batch (exercise 3). That is
# why the cache, not the weights, set the limit once contexts grew long and servers batched
# many users.
#
# ## MHA → MQA → GQA
#
# Shazeer's fix was the simplest one: keep all the query heads, give them **one** shared
# key head and one shared value head {cite}`shazeer2019fast`. The cache shrinks by the
# number of heads, and $I$ grows by the same factor. MQA lost some quality and was unstable
# to train in some settings, so Ainslie et al. proposed the middle ground
# {cite}`ainslie2023gqa`: $n_\mathrm{kv}$ groups, each K/V head shared by
# $G = n_q / n_\mathrm{kv}$ query heads. MHA ($G = 1$) and MQA ($n_\mathrm{kv} = 1$) are the
# two ends. They also showed an existing MHA checkpoint can be converted, by mean-pooling
# the K/V heads of each group and training briefly. Llama 2's 70B model
# {cite}`touvron2023llama2` and every Llama 3 model use $n_\mathrm{kv} = 8$.
#
# How GQA is computed matters as much as what it stores. The easy way repeats each K/V
# head $G$ times so that ordinary attention applies (`expand_kv`, which the
# dispatcher uses before the 2017 reference); that builds, and reads, a full MHA-sized copy of the cache at every step.
# `grouped_attention` never copies: it folds the $G$ query heads of each K/V head into $G$
# rows of one product, so each cached head is read once.

# %%
Code(inspect.getsource(grouped_attention), language="python")

# %% [markdown]
# It gives the same result as the naive form on repeated heads, for a decode step and for
# a block of new queries with a causal mask, from MHA to MQA:

# %%
g = torch.Generator().manual_seed(2)
B_, H_, S_, D_ = 2, 8, 40, 16
for h_kv in (8, 4, 2, 1):
    k = torch.randn(B_, h_kv, S_, D_, generator=g, dtype=torch.float64)
    v = torch.randn(B_, h_kv, S_, D_, generator=g, dtype=torch.float64)
    for t in (1, 5):
        q = torch.randn(B_, H_, t, D_, generator=g, dtype=torch.float64)
        mask = position_mask(
            torch.arange(S_ - t, S_), torch.arange(S_)
        )  # (T, S), causal
        ref = naive_attention(q, expand_kv(k, H_), expand_kv(v, H_), mask=mask)
        out = grouped_attention(q, k, v, mask=mask)
        assert (out - ref).abs().max() < 1e-12
    print(
        f"H = {H_}, H_kv = {h_kv} (G = {H_ // h_kv}): grouped = naive on repeated heads"
    )

# %% [markdown]
# What must one decode step read per layer? At least its whole cache: every cached key
# enters one score and every cached value one weighted sum. We build a `KVCache` for each
# variant at Llama 3's head shape (32 query heads of width 128) with 4096 positions in
# fp32 and check that its tensors hold the bytes `decode_attention_bytes` counts. That is
# bookkeeping, not a measurement: the cache is allocated from the very shape the formula
# multiplies out, so the two agree by construction, and neither says how many bytes
# cross the memory bus or how long that takes (the next cell times it). `expand_kv`
# would also write, and then read, a copy $G$ times larger.

# %% tags=["hide-input"]
S_STEP, D_STEP = 4096, 128
step_bytes = {}
for name, h_kv in (("MHA", 32), ("GQA", 8), ("MQA", 1)):
    cache_v = KVCache(1, h_kv, S_STEP, D_STEP, dtype=torch.float32)
    step_bytes[name] = cache_v.k.nbytes + cache_v.v.nbytes
    assert step_bytes[name] == decode_attention_bytes(
        2 * h_kv * D_STEP, S_STEP, bytes_per_element=4
    )
    copy = expand_kv(cache_v.k, 32).nbytes + expand_kv(cache_v.v, 32).nbytes
    print(
        f"{name}: cache allocated {step_bytes[name] / MIB:5.0f} MiB "
        f"= the formula's; "
        f"repeated to 32 heads: {copy / MIB:.0f} MiB"
    )  # fmt: skip
assert step_bytes["MHA"] == 4 * step_bytes["GQA"] == 32 * step_bytes["MQA"]
for name, nbytes in step_bytes.items():
    glue(f"ch08-step-mib-{name.lower()}", f"{nbytes / MIB:.0f}", display=False)

# %% [markdown]
# Does time follow bytes? If a step were limited by memory alone, its time would be the
# bytes it moves divided by the machine's bandwidth, whatever the layout.
# `companion.bench.bandwidth` tests that: it times one decode step's attention (batch 1,
# one query for each of 32 heads of width 128) for the three layouts with
# `grouped_attention`, and GQA once more with its heads first repeated by `expand_kv`, as
# the easy implementation does, and sets the rate each achieves beside the bandwidth of
# a large tensor copy measured in the same process. Every layout gets a cache of the same
# size (so MQA holds 32 times MHA's positions), of 64 MiB and more: larger than this CPU's
# 32 MiB last-level cache, which would otherwise serve small caches at a speed memory
# cannot. Each layout is counted at the bytes it moves: the grouped forms read their
# cache once; the repeated GQA reads its cache, writes an MHA-sized copy and reads that
# copy back. The times belong to the machine that ran this notebook, and the notebook
# asserts nothing about them.

# %%
# NBVAL_IGNORE_OUTPUT
CACHE_MIB = (64, 128) + ((256, 512, 1024) if FULL else ())  # K/V cache per layout
kv_rows, copy_bps = bench_kv_read(CACHE_MIB, DEVICE, repeats=5)
print(format_kv_read(kv_rows, copy_bps))

# %% tags=["hide-input"]
# NBVAL_IGNORE_OUTPUT
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
width = 0.8 / len(CACHE_MIB)
for j, name in enumerate(LAYOUTS):
    mine = [r for r in kv_rows if r["layout"] == name]
    style = dict(ls="--" if "repeated" in name else "-", marker="o", ms=4)
    moved, times = [r["mib"] for r in mine], [r["ms"] for r in mine]
    axes[0].loglog(moved, times, color=PALETTE[j], label=name, **style)
    for i, r in enumerate(mine):  # one bar per cache size, lighter for smaller
        alpha = 0.4 + 0.6 * (i + 1) / len(mine)
        axes[1].bar(
            j + (i - (len(mine) - 1) / 2) * width,
            r["gbps"],
            width * 0.9,
            color=PALETTE[j],
            alpha=alpha,
        )
span = np.array([min(r["mib"] for r in kv_rows), max(r["mib"] for r in kv_rows)])
axes[0].loglog(
    span, span * MIB / copy_bps * 1e3, ":", color="grey", label="copy rate"
)  # fmt: skip
axes[1].axhline(copy_bps / 1e9, color="grey", ls=":", label="copy rate")
axes[0].set(
    xlabel="bytes moved (MiB)",
    ylabel="ms per step (one layer)",
    title="Time against bytes moved",
)
axes[1].set(
    ylabel="GB/s (bytes moved ÷ time)",
    title=f"Achieved rate; bars: K/V caches of {', '.join(map(str, CACHE_MIB))} MiB",
    ylim=(0, None),
)
axes[1].set_xticks(
    range(len(LAYOUTS)), [n.replace(" rep", "\nrep") for n in LAYOUTS]
)  # fmt: skip
axes[1].legend(fontsize=8)
axes[0].legend(fontsize=8)
fig.suptitle(
    f"One decode step's attention, 32 query heads of width 128, "
    f"{default_dtype(DEVICE)} on {DEVICE.type}, {torch.get_num_threads()} thread(s)"
)
plt.show()

grouped = [r for r in kv_rows if "repeated" not in r["layout"]]
share = max(r["of_copy"] for r in grouped)
per_mib = [r["ms"] / r["mib"] for r in grouped]
largest = {r["layout"]: r for r in kv_rows if r["cache_mib"] == CACHE_MIB[-1]}
n_threads = torch.get_num_threads()
where = (
    f"CPU ({n_threads} thread{'s' * (n_threads > 1)})"
    if DEVICE.type == "cpu"
    else DEVICE.type.upper()
)
verdict = (
    f"On the {where} that built this page, a decode step is not bandwidth-bound: "
    "no layout comes near the rate of a plain copy."
    if share < 0.5
    else f"On the {where} that built this page, the steps come near the copy rate: "
    "here time does follow bytes."
)
glue("ch08-bw-verdict", verdict, display=False)
glue("ch08-copy-gbps", f"{copy_bps / 1e9:.0f}", display=False)
glue("ch08-read-gbps-lo", f"{min(r['gbps'] for r in grouped):.1f}", display=False)
glue("ch08-read-gbps-hi", f"{max(r['gbps'] for r in grouped):.1f}", display=False)
glue("ch08-read-share", f"{share:.0%}", display=False)
glue("ch08-ms-per-mib-spread", f"{max(per_mib) / min(per_mib):.0f}", display=False)
glue("ch08-largest-mib", f"{CACHE_MIB[-1]:,}", display=False)
repeated_over_mha = largest["GQA 32:8 repeated"]["ms"] / largest["MHA 32:32"]["ms"]
glue("ch08-repeated-over-mha", f"{repeated_over_mha:.1f}", display=False)

# %% [markdown]
# On the left each layout sits at the bytes it moves, and the dotted line is where a step
# would sit if it moved them at the copy rate; on the right, the rate each achieved.
# {glue:text}`ch08-bw-verdict` A plain copy moved {glue:text}`ch08-copy-gbps` GB/s in the
# same process; the grouped steps moved their caches at {glue:text}`ch08-read-gbps-lo` to
# {glue:text}`ch08-read-gbps-hi` GB/s, at most {glue:text}`ch08-read-share` of that, and
# their milliseconds per MiB differ {glue:text}`ch08-ms-per-mib-spread`-fold from one
# layout and size to another. What sets the time instead, the table does not measure;
# the candidates are arithmetic and the fixed costs of each call: in fp32, MQA asks 16
# FLOPs of every byte it reads (32 query heads on each key), MHA half a FLOP. The
# roofline of the previous section is about chips whose arithmetic outruns their memory
# by hundreds of FLOPs per byte (the H100's ridge point is {glue:text}`ch08-ridge`), so a
# CPU core neither confirms nor refutes it. `python -m companion.bench bandwidth --device
# cuda` makes the same table on a GPU; this page claims nothing from a run it did not
# make. The repeated GQA (dashed) moves its quarter-size cache plus an MHA-sized copy,
# written and read back, nine times its own cache and more than MHA, and with
# {glue:text}`ch08-largest-mib` MiB caches it took {glue:text}`ch08-repeated-over-mha`
# times MHA's time here: storing less saves nothing if each step rebuilds the full cache.
#
# ## Multi-head latent attention
#
# GQA and MQA buy bytes by giving heads the *same* keys. DeepSeek-V2 asked for something
# else {cite}`deepseekai2024deepseekv2`: keep 128 distinct key and value heads, but store
# them compressed. Every head's key and every head's value at position $t$ is a matrix
# times one vector, the token's $h_t$; route that vector through a narrow bottleneck
# first, a latent $c_t$ of rank $r$, and let each head expand it again:
#
# $$c_t = W^{DKV} h_t \in \mathbb{R}^{r}, \qquad k^{(i)}_t = W^{UK}_i c_t, \qquad
# v^{(i)}_t = W^{UV}_i c_t .$$
#
# DeepSeek-V3 has $r = 512$ for a model width of 7168 and 128 heads whose keys and values
# are 128 wide (each key also has a 64-wide rotated part, below): the latent is as large
# as four such vectors, the keys and values of two heads, and stands in for those of all
# 128. Only $c_t$ is cached. And the up-projections never have to be applied to the
# cache, because each can move to the other side of its product. For head $i$ with
# query $q^{(i)}$,
#
# $$q^{(i)\top} k^{(i)}_t = q^{(i)\top} W^{UK}_i c_t
#   = \big(W^{UK\top}_i q^{(i)}\big)^{\top} c_t,
# \qquad
# \sum_t p^{(i)}_t\, v^{(i)}_t = W^{UV}_i \sum_t p^{(i)}_t\, c_t .$$
#
# $W^{UK}_i$ is *absorbed* into the query (a $d_h \to r$ map applied once per step, not
# once per cached token) and $W^{UV}_i$ into the output side. What is left is attention
# in which all 128 query heads read the same keys, the latents, and the same values, the
# latents again: MQA with one head of width $r$, which is where the intensity of
# {glue:text}`ch08-mla-intensity` above comes from.
#
# **The RoPE obstruction.** RoPE ({doc}`chapter 5 <05_position>`) rotates each key by a
# position-dependent rotation $R_n$ *after* the projection: $k_n = R_n W^{UK} c_n$. The
# score of the query at position $m$ is then $q^\top R_m^\top R_n W^{UK} c_n = q^\top R_{n-m} W^{UK} c_n$: the
# matrix between the query and the cached latent depends on the key's position, so no
# single matrix can be folded into the query. Rotations commute with rotations but not with
# $W^{UK}$: $R_n W \neq W R_n$. DeepSeek's way out is to split each head's query and key in
# two: a 128-dimensional part without position, absorbed as above, and a **decoupled**
# 64-dimensional RoPE part whose key, $k^R_t = R_t W^{KR} h_t$, is computed from the hidden
# state, shared by all heads like MQA, and cached already rotated beside $c_t$. Per token
# and layer the cache holds $r + d_R = 512 + 64$ numbers.
#
# Both claims, numerically, with a random $W$ and RoPE's own rotation matrices (built by
# applying `apply_rope` to the identity):

# %%
D_R = 8
inv_freq, _ = rope_frequencies(D_R)


def rotation(n: int) -> torch.Tensor:
    """The (D_R, D_R) matrix R_n that RoPE multiplies a vector at position n by
    (float64)."""
    angles = n * inv_freq.double()[None]  # (1, F)
    return apply_rope(torch.eye(D_R, dtype=torch.float64), angles.cos(), angles.sin()).T


g = torch.Generator().manual_seed(3)
W = torch.randn(D_R, D_R, generator=g, dtype=torch.float64)  # an up-projection W_UK
q, c = (
    torch.randn(D_R, generator=g, dtype=torch.float64),
    torch.randn(D_R, generator=g, dtype=torch.float64),
)
R5, R9 = rotation(5), rotation(9)
commute_gap = ((R9 @ W - W @ R9).norm() / W.norm()).item()
print(f"‖R_n W − W R_n‖ / ‖W‖ = {commute_gap:.2f}")
print(
    "rotations among themselves: "
    f"‖R_5 R_9 − R_9 R_5‖ < 1e-12: {bool((R5 @ R9 - R9 @ R5).norm() < 1e-12)}"
)
assert commute_gap > 0.5 and (R5 @ R9 - R9 @ R5).norm() < 1e-12
assert (
    R5.T @ R9 - rotation(4)
).abs().max() < 1e-12  # R_mᵀ R_n = R_{n−m}: only the offset remains
# without RoPE the up-projection moves to the query side exactly ...
assert abs(q @ (W @ c) - (W.T @ q) @ c) < 1e-12
# ... with it, the matrix the query must meet the latent with depends on the key's
# offset
absorbed = {offset: (rotation(offset) @ W).T for offset in (1, 2, 3)}
for m, n_ in ((0, 1), (4, 5), (0, 2)):
    assert (
        abs((rotation(m) @ q) @ (rotation(n_) @ W @ c) - (absorbed[n_ - m] @ q) @ c)
        < 1e-12
    )
assert (absorbed[1] - absorbed[2]).norm() > 0.5 * W.norm()
print(
    "absorbing W_UK works without RoPE; "
    "with it, the folded query changes with every offset"
)

# %% [markdown]
# `companion.layers.mla.MultiHeadLatentAttention` implements both forms on the same parameters
# (its `kv_b_proj` holds every head's $W^{UK}_i$ and $W^{UV}_i$). `form="naive"`
# up-projects the cached latents to full per-head keys and values, as the model is trained
# and as transformers' DeepSeek-V3 code runs it; `form="absorbed"` scores the latents
# directly. The absorbed form's query, keys and values:

# %%
Code(inspect.getsource(MultiHeadLatentAttention.absorbed_qkv), language="python")

# %% [markdown]
# We build a small MLA layer (width 64, 4 heads, latent $r = 16$, query latent 12,
# 8 + 4 query/key channels per head, values of width 8) in float64, copy its weights into
# an absorbed twin, and compare: a causal forward over 12 tokens, then the absorbed form
# decoding the same tokens one at a time from its `LatentCache`.

# %% tags=["hide-input"]
MLA_DIMS = {
    "kv_lora_rank": 16,
    "q_lora_rank": 12,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
}
T_MLA = 12
fixed = {
    "causal": True,
    "rope": RotaryEmbedding(MLA_DIMS["qk_rope_head_dim"], max_len=T_MLA),
}
torch.manual_seed(4)
naive_mla = (
    MultiHeadLatentAttention(64, 4, **MLA_DIMS, **fixed, form="naive")
    .double()
    .eval()
)  # fmt: skip
absorbed_mla = (
    MultiHeadLatentAttention(64, 4, **MLA_DIMS, **fixed, form="absorbed")
    .double()
    .eval()
)
absorbed_mla.load_state_dict(naive_mla.state_dict())
x = torch.randn(1, T_MLA, 64, dtype=torch.float64)
with torch.no_grad():
    y_naive, y_absorbed = naive_mla(x), absorbed_mla(x)
    latent_cache = absorbed_mla.new_cache(1, T_MLA)
    y_steps = torch.cat(
        [
            absorbed_mla(
                x[:, t : t + 1], torch.tensor([t]), latent_cache
            )  # token t at position t
            for t in range(T_MLA)
        ],
        dim=1,
    )
forward_ok = bool((y_naive - y_absorbed).abs().max() < 1e-12)
steps_ok = bool((y_naive - y_steps).abs().max() < 1e-12)
print(f"max |naive − absorbed| < 1e-12: {forward_ok} (causal forward),")
print(f"{steps_ok} (absorbed, token by token from the cache)")
assert torch.allclose(y_naive, y_absorbed, atol=1e-12, rtol=0)
assert torch.allclose(y_naive, y_steps, atol=1e-12, rtol=0)

width = latent_cache.kv.shape[-1]
# the per-head keys and values the naive form rebuilds from those cached rows: what
# an MHA layer of the same widths would have to cache
with torch.no_grad():
    q_nope, q_rope, _ = naive_mla.project(x)
    _, k_heads, v_heads = naive_mla.naive_qkv(q_nope, q_rope, latent_cache.kv)
# one token, all heads
mha_width = k_heads[0, :, 0].numel() + v_heads[0, :, 0].numel()
print(
    f"latent cache: {tuple(latent_cache.kv.shape)} = {width} numbers per token "
    "and layer (r + d_R = 16 + 4)"
)
print(
    f"per-head K {tuple(k_heads.shape)} and V {tuple(v_heads.shape)}: "
    f"{mha_width} numbers per token"
)
assert latent_cache.kv.shape == (1, T_MLA, 16 + 4)
assert torch.equal(latent_cache.pos, torch.arange(T_MLA))  # row t holds position t
# H (D_nope + D_rope) + H D_v, from the config
assert mha_width == 4 * (8 + 4) + 4 * 8
glue("ch08-latent-width", f"{width}", display=False)
glue("ch08-heads-width", f"{mha_width}", display=False)

# %% [markdown]
# The two forms agree to $10^{-12}$ in float64, whether the absorbed one reads the whole
# sequence or decodes it token by token from a cache of {glue:text}`ch08-latent-width`
# numbers per token ({glue:text}`ch08-heads-width` for the full per-head keys and values
# the naive form rebuilds in this small layer). The same holds inside a whole model: `DecoderLM`
# builds MLA layers from `ModelConfig`'s `mla` group (`MLAConfig`: `kv_lora_rank`,
# `q_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim` and `form`), and a
# model switched to the absorbed form on the same weights generates the same tokens:

# %% tags=["hide-input"]
mla_cfg = tiny_cfg.replace(n_kv_heads=None, mla=MLAConfig(**MLA_DIMS, form="naive"))
seed_everything(5)
mla_naive_lm = DecoderLM(mla_cfg).eval()
mla_absorbed_lm = DecoderLM(
    mla_cfg.replace(mla=mla_cfg.mla.replace(form="absorbed"))
).eval()
mla_absorbed_lm.load_state_dict(mla_naive_lm.state_dict())
tokens_naive = mla_naive_lm.generate(prompt.cpu(), 24)
tokens_absorbed = mla_absorbed_lm.generate(prompt.cpu(), 24)
mla_cache = mla_absorbed_lm.new_cache(1, 32)
print(
    f"same 24 tokens: {torch.equal(tokens_naive, tokens_absorbed)}; "
    f"cache per layer: "
    f"{[tuple(layer.kv.shape) for layer in mla_cache.layers]}"
)  # fmt: skip
assert torch.equal(tokens_naive, tokens_absorbed)
# per token: one (r + d_R)-row per layer, as the calculator counts it
assert (
    kv_cache_bytes_per_token(mla_cfg, dtype_bytes=4)
    == sum(layer.kv[0, 0].nbytes for layer in mla_cache.layers)
    == 2 * (16 + 4) * 4
)

# %% [markdown]
# Now DeepSeek-V3's real sizes: $r = 512$, $d_R = 64$, 61 layers, bf16. The "equivalent
# MHA" keeps 128 heads with keys of width $128 + 64 = 192$ and values of width 128.

# %% tags=["hide-input"]
v3 = preset("deepseek-v3")
assert (v3.d_model, v3.n_layers, v3.n_heads) == (7168, 61, 128)
assert (v3.mla.kv_lora_rank, v3.mla.qk_rope_head_dim) == (512, 64)
assert (v3.mla.qk_nope_head_dim, v3.mla.v_head_dim) == (128, 128)
mla_bytes = bytes_per_token(512, 64, 61)  # (r + d_R) · L · 2 bytes
mha_bytes = 61 * 128 * (192 + 128) * 2  # L · heads · (key + value widths) · 2 bytes
print(
    f"MLA: {mla_bytes:,} B/token = {mla_bytes / KIB:.1f} KiB; equivalent MHA: "
    f"{mha_bytes:,} B = {mha_bytes / MIB:.2f} MiB; "
    f"{mha_bytes / mla_bytes:.1f}× smaller"
)  # fmt: skip
print(
    f"at 128k tokens: {mla_bytes * S128K / GIB:.1f} GiB "
    f"against {mha_bytes * S128K / GIB:.0f} GiB"
)
# the layer's own count and the calculator's, from two different code paths
assert mla_bytes == kv_cache_bytes_per_token(v3)
# and the MHA count against the calculator on the same preset with 128 K/V heads
# (keys and values both 160 wide: the same bytes as 192 + 128)
v3_mha = v3.replace(mla=None, n_kv_heads=128, head_dim=160)
assert not v3_mha.is_mla and kv_cache_bytes_per_token(v3_mha) == mha_bytes
glue("ch08-v3-mla-bytes", f"{mla_bytes:,}", display=False)
glue("ch08-v3-mla-kib", f"{mla_bytes / KIB:.1f}", display=False)
glue("ch08-v3-mha-mib", f"{mha_bytes / MIB:.2f}", display=False)
glue("ch08-v3-ratio", f"{mha_bytes / mla_bytes:.0f}", display=False)
glue("ch08-v3-mla-128k", f"{mla_bytes * S128K / GIB:.1f}", display=False)
glue("ch08-v3-mha-128k", f"{mha_bytes * S128K / GIB:.0f}", display=False)

# %% [markdown]
# {glue:text}`ch08-v3-mla-kib` KiB per token instead of {glue:text}`ch08-v3-mha-mib` MiB,
# {glue:text}`ch08-v3-ratio` times less; a 128k-token context in
# {glue:text}`ch08-v3-mla-128k` GiB instead of {glue:text}`ch08-v3-mha-128k` GiB. In DeepSeek-V2's ablations MLA also scored better than MHA, while
# GQA and MQA scored worse {cite}`deepseekai2024deepseekv2`: it is the one step in this
# chapter that was not sold as a quality trade. It is harder to implement and to shard
# than GQA (the decoupled key, the absorbed matrices, kernels specialised for a 576-wide
# head), which is why it spread slowly beyond DeepSeek's own models.
#
# ## What each variant stores
#
# The four layouts side by side at one model shape, Llama 3 8B's (32 layers, 32 query
# heads of width 128, bf16), with DeepSeek's latent widths for MLA ($r = 512$,
# $d_R = 64$): the preset with an `mla` group of these widths, which
# `ModelConfig` validates like any other. Every byte below comes from the calculator,
# `kv_cache_bytes_per_token` and `kv_cache_bytes`, and each layout's count per token and
# layer is checked against the cache that one layer of the real module allocates
# (`build_mixer(cfg).new_cache`, on the meta device, so nothing is allocated):

# %% tags=["hide-input"]
# the four layouts at Llama 3 8B's shape; MLA with DeepSeek's latent and RoPE-key
# widths
mla_8b = gqa_8b.replace(
    n_kv_heads=None,
    head_dim=None,
    mla=MLAConfig(
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
    ),
)
SCHEMES = {
    "MHA": mha_8b,
    "GQA": gqa_8b,
    "MQA": gqa_8b.replace(n_kv_heads=1),
    "MLA": mla_8b,
}
L8 = gqa_8b.n_layers
per_tok = {name: kv_cache_bytes_per_token(cfg) for name, cfg in SCHEMES.items()}
per_layer = {name: b // L8 for name, b in per_tok.items()}  # one token, one layer
for name, cfg in SCHEMES.items():
    # the calculator against the cache one layer of the real module allocates
    with torch.device("meta"):
        one = build_mixer(cfg).new_cache(1, 1, dtype=torch.bfloat16, device="meta")
    held = sum(b.nbytes for b in one.buffers() if b.is_floating_point())
    assert held == per_layer[name] and per_tok[name] == L8 * held
STACKS = {}  # scheme: [(part, bytes of one copy, copies)] per token and layer
for name, cfg in SCHEMES.items():
    if cfg.is_mla:  # the calculator's row split by the config's widths
        row = per_layer[name] / (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
        STACKS[name] = [
            ("latent c", row * cfg.mla.kv_lora_rank, 1),
            ("RoPE key", row * cfg.mla.qk_rope_head_dim, 1),
        ]
    else:  # half keys, half values, one copy per K/V head
        head = per_layer[name] / (2 * cfg.n_kv_heads)
        STACKS[name] = [("K", head, cfg.n_kv_heads), ("V", head, cfg.n_kv_heads)]
CONTEXTS = [1024 * 2**k for k in range(11)]  # 1k to 1M tokens, one doubling a frame
total = {
    name: np.array([kv_cache_bytes(cfg, s) for s in CONTEXTS])
    for name, cfg in SCHEMES.items()
}
# what an 80 GiB GPU has left beside Llama 3 8B's weights
ROOM = 80 * GIB - weights_8b
overflow = {  # the first context whose cache no longer fits in that room
    name: next((s for s, b in zip(CONTEXTS, t, strict=True) if b > ROOM), None)
    for name, t in total.items()
}
print(f"{'':<5}{'B/token/layer':>14}{'KiB/token':>10}" + "".join(
    f"{s // 1024:>7,}k" for s in CONTEXTS[::2]) + "  (GiB)")  # fmt: skip
for name in SCHEMES:
    print(
        f"{name:<5}{per_layer[name]:>14,}{per_tok[name] / KIB:>10.0f}"
        + "".join(f"{t / GIB:>8.2f}" for t in total[name][::2])
    )
print("first context that does not fit beside the weights on an 80 GiB GPU:")
print(
    "  "
    + ", ".join(f"{k} {f'{s:,}' if s else 'none'}" for k, s in overflow.items())
)  # fmt: skip
p = per_tok
assert p["MHA"] > p["GQA"] > p["MQA"] and p["MQA"] < p["MLA"] < p["GQA"]
# no windows here: every doubling of the context doubles every cache
assert all((t[1:] == 2 * t[:-1]).all() for t in total.values())
assert overflow == {"MHA": 256 * 1024, "GQA": 1024**2, "MQA": None, "MLA": None}
glue("ch08-head-bytes", f"{STACKS['MHA'][0][1]:.0f}", display=False)
for name in SCHEMES:
    key = name.lower()
    glue(f"ch08-layer-bytes-{key}", f"{per_layer[name]:,}", display=False)
    glue(f"ch08-128k-{key}", f"{total[name][CONTEXTS.index(S128K)] / GIB:.3g}",
         display=False)  # fmt: skip
    glue(f"ch08-1m-{key}", f"{total[name][-1] / GIB:.3g}", display=False)
glue("ch08-layer-kib-mha", f"{per_layer['MHA'] / KIB:.0f}", display=False)
glue(
    "ch08-mla-over-mqa",
    f"{per_layer['MLA'] / per_layer['MQA']:.2f}",
    display=False
)  # fmt: skip

# %% tags=["hide-input", "remove-output"]
PART_COLORS = {
    "K": COLORS["full"], "V": PALETTE[5],
    "latent c": COLORS["latent"], "RoPE key": PALETTE[1],
}  # fmt: skip
LINE = {"MHA": PALETTE[7], "GQA": PALETTE[0], "MQA": PALETTE[2], "MLA": PALETTE[3]}


def size(n: float) -> str:
    """Bytes as the figure writes them: B, KiB, MiB, GiB or TiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(8.8, 4.2), width_ratios=[1, 1.25])
fig.legend(
    handles=[Patch(color=c, label=p) for p, c in PART_COLORS.items()],
    loc="outside lower center", ncol=4, fontsize=8,
)  # fmt: skip
# the stacks: the same every frame
for j, (name, parts) in enumerate(STACKS.items()):
    bottom = 0.0
    for part, each, copies in parts:
        ax_s.bar(
            j, copies * each / KIB, bottom=bottom, width=0.7, color=PART_COLORS[part]
        )
        if copies > 1:  # one white line between two heads
            ax_s.hlines(bottom + each / KIB * np.arange(1, copies),
                        j - 0.35, j + 0.35, color="white", lw=0.4)  # fmt: skip
        bottom += copies * each / KIB
    what = (
        f"{parts[0][2]} K + {parts[0][2]} V\n× {parts[0][1]:,.0f} B"
        if parts[0][0] == "K"
        else f"{parts[0][1]:,.0f} B\n+ {parts[1][1]:,.0f} B"
    )
    label = f"{what}\n= {per_layer[name]:,} B\n{size(per_tok[name])}/token"
    ax_s.text(j, bottom + 0.3, label, ha="center", va="bottom", fontsize=7)
ax_s.set_xticks(range(len(STACKS)), list(STACKS))
for tick, name in zip(ax_s.get_xticklabels(), STACKS, strict=True):
    tick.set_color(LINE[name])
ax_s.set(ylim=(0, 23), ylabel="KiB per token and layer",
         title=f"One token, one layer (× {L8} layers)")  # fmt: skip
ax_s.grid(False, axis="x")
lines = {
    name: ax_t.loglog([], [], "o-", ms=3, color=LINE[name])[0] for name in SCHEMES
}  # fmt: skip
ax_t.axhline(ROOM, color="grey", ls="--", lw=1)
ax_t.text(CONTEXTS[0], ROOM * 1.3,
          f"80 GiB GPU minus the {weights_8b / GIB:.0f} GiB of weights",
          fontsize=7, color="grey")  # fmt: skip
yticks = [16 * MIB * 16**k for k in range(6)]
ax_t.set_yticks(yticks, [size(y) for y in yticks])
ax_t.set_xticks(CONTEXTS[::2], ["1k", "4k", "16k", "64k", "256k", "1M"])
ax_t.minorticks_off()
ax_t.set(xlim=(CONTEXTS[0] / 1.4, CONTEXTS[-1] * 1.4), ylim=(8 * MIB, 2**41),
         xlabel="context (tokens)", ylabel="whole cache, all layers")  # fmt: skip


def draw_kv(i: int) -> None:
    for name, line in lines.items():
        line.set_data(CONTEXTS[: i + 1], total[name][: i + 1])
        line.set_label(f"{name}: {size(total[name][i])}")
    ax_t.legend(loc="lower right", fontsize=8)
    ax_t.set_title(f"Context {CONTEXTS[i]:,} tokens")


glue("fig-kv-cache", HTML(animate(fig, draw_kv, len(CONTEXTS), interval_ms=600)))

# %% [markdown]
# ```{glue:figure} fig-kv-cache
# :name: fig-kv-cache
#
# What the KV cache holds at Llama 3 8B's shape (32 layers, 32 query heads of width 128,
# bf16) under four layouts, MLA with DeepSeek's $r = 512$ and $d_R = 64$. Left: one token
# in one layer, in bytes; MHA, GQA and MQA keep a key and a value of
# {glue:text}`ch08-head-bytes` bytes per K/V head (thin white lines separate the heads), MLA one latent and one rotated key shared by
# all heads. Right: the whole cache, all layers, as the context doubles from 1,024 to
# 1,048,576 tokens, one doubling a frame. Watch the four lines climb in parallel, a fixed
# factor apart, and cross the dashed line of what an 80 GiB GPU has left beside the
# weights: MHA between 128k and 256k tokens, GQA between 512k and 1M, MQA and MLA never
# (asserted from the same totals).
# ```

# %% [markdown]
# {numref}`fig-kv-cache` separates the formula's two factors. Per token and layer MHA
# keeps {glue:text}`ch08-layer-kib-mha` KiB, 32 keys and 32 values of
# {glue:text}`ch08-head-bytes` bytes each; GQA a quarter of that; MQA's single K/V head
# and MLA's latent are thin strips of {glue:text}`ch08-layer-bytes-mqa` and
# {glue:text}`ch08-layer-bytes-mla` bytes. MLA stores more than MQA,
# {glue:text}`ch08-mla-over-mqa` times as much, but it keeps 32 distinct keys and values
# per layer (one per head, rebuilt from the latent when needed); MQA keeps one. The
# context only multiplies: every doubling doubles every cache, so the lines stay parallel
# and the layout alone decides how far one GPU goes. At 128k tokens the four caches are
# {glue:text}`ch08-128k-mha`, {glue:text}`ch08-128k-gqa`, {glue:text}`ch08-128k-mqa` and
# {glue:text}`ch08-128k-mla` GiB; at 1M tokens {glue:text}`ch08-1m-mha`,
# {glue:text}`ch08-1m-gqa`, {glue:text}`ch08-1m-mqa` and {glue:text}`ch08-1m-mla` GiB. For
# DeepSeek-V3 itself, with 128 heads, 61 layers and wider keys, the gap to MHA is the
# {glue:text}`ch08-v3-ratio`× computed above.
#
# ## The fast decode path
#
# Bytes are also the yardstick for a whole decode step, weights included, and
# `companion`'s real-weights benchmark holds its loops to it. A decode step of
# `DecoderLM` has the same shapes at every position: each layer's cache is a buffer
# preallocated for the whole generation and written at the new token's position
# `input_pos`, and attention reads all of it through a mask built from the position each
# slot holds (`-1` while empty). This is gpt-fast's design, and it turns one step into a
# fixed graph: `torch.compile` compiles the model's own blocks once and reuses the
# result at every position. `generate` is built from `prefill`, `decode_one_token`,
# `decode_n_tokens` and `sample`; here are the step and the cache write it relies on:

# %%
Code(
    inspect.getsource(decode_one_token) + "\n" + inspect.getsource(KVCache.update),
    language="python",
)

# %% [markdown]
# `generate(..., compile=True)` compiles the step (the first call pays for the
# compilation). Inside it, every linear map of one row runs in a *decode form*,
# $\sum_i w_{oi} x_i$ written as a multiply and a sum, which the compiler turns into one
# loop streaming the weights; a library's matrix product is built for many rows
# ({doc}`16_serving` shows the form). On the tiny model of the first section (four
# query heads sharing two K/V heads) the compiled step writes the same tokens as the
# eager one:

# %%
fast = tiny_lm.generate(prompt, NEW, compile=True)
reference = tiny_lm.generate(prompt, NEW)
print(
    f"compiled decode step: same {NEW} tokens as the eager one: "
    f"{torch.equal(fast, reference)}"
)
assert torch.equal(fast, reference)
smol = preset("smollm2-135m")  # the benchmark's model
assert (smol.n_layers, smol.n_heads, smol.n_kv_heads) == (30, 9, 3)

# %% [markdown]
# How much faster is it? That is a measurement of a machine, not of the model, so this
# chapter does not type a speed-up into its prose. `python -m companion.bench decode`
# runs both loops, and transformers' `generate`, on the real SmolLM2-135M weights (30
# layers, 9 query heads sharing 3 K/V heads, fp32, batch 1), and compares them with a bound
# measured on the same machine: one token must read every weight once, so no decoder can
# beat copy bandwidth ÷ weight bytes tokens per second; it also times the weights'
# matrix-vector products alone (the *matmul floor*), as the library's products and in
# the decode form. Run it to see where your machine's loops fall. The bound is the yardstick for this chapter's reason once more: at batch 1
# the weights, like the cache, are read for two FLOPs per number, so on a chip whose
# arithmetic outruns its memory a decode step is memory-bound, and a fast path should win
# by doing little besides the reads it must do. Whether a given machine is such a chip is
# what the bench's fraction of the bound, like the table above, shows.

# %% [markdown]
# ## What we learned
#
# Between 2017 and now the attention layer changed what it keeps in memory, not what it
# computes: MQA and GQA let groups of query heads share one key and one value head, and
# MLA caches one low-rank latent and one rotated key per token, from which every head's
# keys and values are rebuilt or, with the up-projections absorbed, never built at all.
# The pressure was decoding: a cache turns quadratic work into linear work, but every step
# must then read the whole cache and does only as many FLOPs per byte as there are query
# heads per K/V head, far below what a GPU's arithmetic could use. Our checks of sizes and
# forms are exact: cached and uncached decoding agree, grouped attention equals attention
# on repeated heads, the naive and absorbed MLA forms agree to float64 rounding, and every
# byte count matches the cache the modules allocate. What the chapter does not show is
# speed or quality: our CPU timings neither confirm nor refute that decode time follows
# the bytes, and what sharing or compressing K/V heads costs in quality we took from the
# papers rather than measured. Bytes per element is a dial of its own: 8-bit numbers
# with a scale per row keep a little over half of the bf16 cache, more the narrower the
# row; what that rounding costs, {doc}`chapter 16 <16_serving>` measures.
#
# | Component | 2017 default | Modern default | Quality gain (what this chapter measured) | Pressure that drove it |
# |---|---|---|---|---|
# | KV heads | One pair per query head | Grouped or latent KV | Not measured (nothing trained here); what we measured is bytes: GQA 32:8 caches a quarter of MHA, DeepSeek-V3's MLA about 70× less than its equivalent MHA | Decode memory bandwidth |

# %% [markdown]
# ## Exercises
#
# 1. GQA's uptraining recipe starts from an MHA checkpoint and mean-pools the K/V heads of
#    each group {cite}`ainslie2023gqa`. Take an MHA layer's keys and values `(B, 8, S, D)`,
#    pool them to 2 heads, and measure how far `grouped_attention` with the pooled heads is
#    from the original attention, for random heads and for heads that are already similar.
#
# ```{admonition} Solution
# :class: dropdown
# `k2 = k.view(B, 2, 4, S, D).mean(2)` (and the same for `v`), then compare
# `grouped_attention(q, k2, v2)` with `naive_attention(q, k, v)`. With independent random
# heads the error is of the order of the outputs themselves: pooling averages unrelated
# keys. Make the heads of a group similar (`k = base + 0.1 * noise`, with `base` repeated
# four times) and the error shrinks with the noise. This is why the conversion needs a
# short period of training afterwards: trained heads are not interchangeable.
# ```
#
# 2. How many 32k-token conversations fit beside the weights on one 80 GiB GPU for
#    Llama 3 8B with MHA, with GQA, and with MQA? Use `max_context_tokens` with `batch`.
#
# ```{admonition} Solution
# :class: dropdown
# `max_context_tokens(80 * 2**30, 16_060_522_496, per_token, batch=b) >= 32768` for the
# largest `b`: with 512, 128 and 16 KiB per token, that is 4, 16 and 130 conversations
# (the free 65 GiB divided by 16, 4 and 0.5 GiB each). Activations and the memory
# allocator take some of that in practice.
# ```
#
# 3. At batch $b$, a weight matrix of a decode step is read once and used for $b$ tokens.
#    Compute the arithmetic intensity of a $d \times d$ bf16 projection as a function of
#    $b$, and the batch at which it crosses the H100's ridge point. Why does the same not
#    happen for attention?
#
# ```{admonition} Solution
# :class: dropdown
# $2 b d^2$ FLOPs over $2 d^2$ bytes: $I = b$, so from about $b$ =
# {glue:text}`ch08-ridge` the projections
# are compute-bound. Attention's bytes are the cache, and every sequence has its own:
# `decode_attention_flops(..., batch=b)` and `decode_attention_bytes(..., batch=b)` both
# grow with $b$, and their ratio stays $n_q / n_\mathrm{kv}$. Large batches make the
# weights cheap per token and leave attention as the memory-bound part of decoding.
# ```
#
# 4. DeepSeek-V3 could have used GQA with 8 K/V heads of the same widths (keys 192,
#    values 128). How many bytes per token would that cache, and how does it compare with
#    MLA's {glue:text}`ch08-v3-mla-bytes`?
#
# ```{admonition} Solution
# :class: dropdown
# $61 \cdot 8 \cdot (192 + 128) \cdot 2 = 312{,}320$ bytes (305 KiB), 4.4 times MLA's
# cache. To get down to MLA's size GQA would need about two K/V heads for 128 query heads,
# nearly MQA; MLA keeps 128 distinct keys and values per layer at that cost.
# ```
#
# 5. `python -m companion.bench mla` times one decode step of `MultiHeadLatentAttention`
#    in both forms at several context lengths. Predict from this chapter which form wins
#    at long contexts and why, then run it.
#
# ```{admonition} Hint
# :class: dropdown
# The naive form up-projects every cached latent to per-head keys and values at every
# step: work and memory traffic of $H (D_n + D_v)$ numbers per cached token, on top of
# reading the latents. The absorbed form reads the $r + d_R$ numbers of each cached token
# once, for all heads. The bench also prints the bytes of both caches and the largest
# difference between the two forms' outputs.
# ```

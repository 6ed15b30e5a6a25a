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
# # 13 · Build a model: the calculator and the spec sheet
#
# ```{admonition} The question
# :class: tip
# What does a model's configuration alone fix about its cost (parameters stored and used, bytes cached and FLOPs spent per token), and how did that cost move from GPT-2 to the models of 2026?
# A few short formulas reproduce released parameter counts to the integer, and over the released configs they show sparse experts pulling stored and active parameters apart and most of the largest models caching fewer bytes per token than a dense 8B model, with training still costing about six FLOPs per active parameter per token; what the models can do, no config records.
# ```
#
# Twelve chapters took the 2017 block apart one piece at a time: positions, norms, the
# gated FFN, the KV cache, windows, experts, linear attention, a handful of small changes.
# This chapter puts the pieces back together as arithmetic. A model's configuration (a
# dozen integers and a few choices) fixes how many parameters it stores, how many one
# token uses, how many bytes each cached token costs and how many FLOPs each token takes.
# We write the formulas, check them to the integer against `companion.analysis.calculator` (which is
# itself tested against the released checkpoints' counts), print the spec sheet of
# {glue:text}`ch13-n-presets` released models from GPT-2 to Qwen3.5, and build a small calculator you can turn
# the dials of. We end with the one budgeting rule that survived the whole period, the
# $6N$ rule, and what it means once $N$ is the *active* count.

# %% tags=["remove-input"]
# Setup: on Colab, install the companion package (no effect elsewhere).
import subprocess
import sys

if "google.colab" in sys.modules:
    REPO, REF = "https://github.com/transformer-2017-2026/book", "main"
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    spec = f"transformer-2017-2026[widgets] @ git+{REPO}@{REF}"
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

from companion.analysis import calculator as calc
from companion.analysis.calculator import (
    count_params,
    flops_per_token,
    kv_cache_bytes,
    kv_cache_bytes_per_token,
)
from companion.analysis.calculator_page import (
    PAGE_PRESETS,
    calculator_html,
    config_from_dials,
    dial_values,
    layer_period,
)
from companion.device import default_device, describe
from companion.models.config import ModelConfig
from companion.models.presets import PRESETS, preset, spec_row
from companion.models.seq2seq import (
    PAPER_BASE_PARAMS,
    base_param_breakdown,
    transformer_base_config,
)
from companion.models.validation import ConfigError
from companion.plotting import PALETTE, glue, use_style
from companion.training import seed_everything

# nothing here trains: the switch only picks the device (all arithmetic)
FULL = False
DEVICE = default_device() if FULL else torch.device("cpu")
use_style()
seed_everything(0)
torch.set_num_threads(1)
print(describe(DEVICE))

# %% [markdown]
# ## The formulas
#
# Name the shapes: $L$ layers of width $d$, $n_q$ query heads and $n_\mathrm{kv}$ key/value
# heads of width $d_h$, a dense FFN of width $d_\mathrm{ff}$, or $N$ routed experts of
# width $d_e$ of which $k$ run per token, plus $N_\mathrm{shared}$ always-on ones. A
# bias-free attention layer has a query and an output projection of $d \cdot n_q d_h$
# each and a key and a value projection of $d \cdot n_\mathrm{kv} d_h$ each; a SwiGLU FFN
# has three matrices ({doc}`chapter 7 <07_gated_ffn>`). Summed over layers:
#
# $$P_\text{attn} = 2\,L\,d\,d_h(n_q + n_\text{kv}), \qquad P_\text{ffn}^\text{dense} = 3\,L\,d\,d_\text{ff}, \qquad P_\text{ffn}^\text{moe} = 3\,L\,d\,d_e(N + N_\text{shared}),$$
#
# $$P_\text{active} = P_\text{attn} + 3\,L\,d\,d_e(k + N_\text{shared}), \qquad \text{FLOPs/token} \approx 2 P_\text{active} + 4 L\, n_q d_h s.$$
#
# The embedding table adds $Vd$ once if the output head reuses it (tied, {doc}`chapter 12 <12_small_changes>`) and
# twice if not. The last term is attention's own work: $2 s\, n_q d_h$ for the scores of a
# query against $s$ keys and as much again for the weighted sum of values, work no weight
# matrix accounts for. `companion.analysis.calculator` does the same sums layer by layer, and handles
# what the short formulas leave out: norms, biases, routers, latent attention, sliding and
# linear layers.

# %%
Code(
    inspect.getsource(calc.attention_layer_params)
    + "\n\n"
    + inspect.getsource(calc.tally_moe),
    language="python",
)

# %% [markdown]
# Check the dense formula on Llama 3 8B {cite}`grattafiori2024llama`. Beyond the two
# matrices per layer, the model stores an untied embedding and output head ($2Vd$) and its
# RMSNorm gains: two per layer and one before the head, $d$ numbers each. With those the
# formula is not an approximation but the exact count.


# %%
def shapes(cfg: ModelConfig) -> tuple[int, int, int, int, int, int]:
    """(L, d, d_h, n_q, n_kv, V) of a config, the letters of the formulas."""
    return (
        cfg.n_layers,
        cfg.d_model,
        cfg.head_dim,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.vocab_size,
    )


llama3 = preset("llama3-8b")
L, d, d_h, n_q, n_kv, V = shapes(llama3)
p_attn = 2 * L * d * d_h * (n_q + n_kv)
p_ffn = 3 * L * d * llama3.d_ff
embeddings = (1 if llama3.tie_embeddings else 2) * V * d
norms = (2 * L + 1) * d
pc = count_params(llama3)
print(f"attention {p_attn:>15,}\nFFN       {p_ffn:>15,}\nembedding {embeddings:>15,}")
print(f"norms     {norms:>15,}\nsum       {p_attn + p_ffn + embeddings + norms:>15,}")
print(f"calc      {pc.total:>15,}")
assert p_attn + p_ffn + embeddings + norms == pc.total
assert pc.total == 8_030_261_248  # the released checkpoint's count
assert pc.breakdown["attention"] == p_attn and pc.breakdown["ffn"] == p_ffn
for key, part in {"ffn": p_ffn, "attn": p_attn, "emb": embeddings}.items():
    glue(f"ch13-llama-{key}", f"{part / pc.total:.1%}", display=False)
glue("ch13-llama-norms", f"{norms:,}", display=False)
glue("ch13-llama-norms-pct", f"{norms / pc.total:.3%}", display=False)
glue("ch13-llama-total", f"{pc.total:,}", display=False)

# %% [markdown]
# {glue:text}`ch13-llama-ffn` of Llama 3 8B is FFN, {glue:text}`ch13-llama-attn`
# attention, {glue:text}`ch13-llama-emb` the two vocabulary tables (a 128,256-token
# vocabulary is expensive at $d = 4096$), and {glue:text}`ch13-llama-norms` numbers,
# {glue:text}`ch13-llama-norms-pct`, are norm gains.
#
# Now an MoE: Mixtral 8x7B {cite}`jiang2024mixtral`, eight experts of width 14,336, two per
# token, no shared expert. The active formula leaves out three things, and we can name
# them exactly: the two vocabulary tables (untied, both counted as active, as the released
# reports count them), the norm gains, and the **router**, a $d \times N$ matrix per layer
# that every token multiplies by whichever experts it then picks.

# %%
mixtral = preset("mixtral-8x7b")
L, d, d_h, n_q, n_kv, V = shapes(mixtral)
moe = mixtral.moe
N, k, d_e = moe.n_experts, moe.experts_per_token, moe.expert_d_ff
p_attn = 2 * L * d * d_h * (n_q + n_kv)
p_total_formula = p_attn + 3 * L * d * d_e * N
p_active_formula = p_attn + 3 * L * d * d_e * k
pm = count_params(mixtral)
residual_total = pm.total - p_total_formula
residual_active = pm.active - p_active_formula
router = L * N * d
omitted = 2 * V * d + (2 * L + 1) * d + router
print(f"formula total {p_total_formula:>16,}   calc total  {pm.total:>16,}")
print(f"formula active{p_active_formula:>16,}   calc active {pm.active:>16,}")
print(
    f"residual {residual_active:,} = embeddings {2 * V * d:,} "
    f"+ norms {(2 * L + 1) * d:,} "
    f"+ router {router:,}"
)
assert residual_active == residual_total == omitted
assert pm.total == 46_702_792_704  # the released checkpoint's count
assert pm.active_breakdown["router"] == router
glue("ch13-mix-residual", f"{residual_active:,}", display=False)
glue("ch13-mix-residual-pct", f"{residual_active / pm.active:.1%}", display=False)
glue("ch13-mix-not-tables", f"{residual_active - 2 * V * d:,}", display=False)
glue("ch13-mix-router", f"{router:,}", display=False)
glue("ch13-mix-active-b", f"{pm.active / 1e9:.1f}", display=False)

# %% [markdown]
# The formula misses {glue:text}`ch13-mix-residual` parameters,
# {glue:text}`ch13-mix-residual-pct` of the active count, and all but
# {glue:text}`ch13-mix-not-tables` of them are the two vocabulary tables; the router is
# {glue:text}`ch13-mix-router` numbers against {glue:text}`ch13-mix-active-b` billion. Both residuals, total and active, are the same number, since
# nothing the formula omits is routed.
#
# The FLOP formula deserves the same care. `calc.flops_per_token` charges two FLOPs per
# weight of every matrix a token goes *through*: the output head is a matrix product, but
# the input embedding is a lookup, and a norm gain is an element-wise multiply. So the
# short formula, which doubles all of $P_\text{active}$, overcounts by exactly
# $2(Vd + \text{norms})$, {glue:text}`ch13-flop-over` for Llama 3 8B at its full
# 8,192-token context:

# %%
s = 8192
L, d, d_h, n_q, n_kv, V = shapes(llama3)
short = 2 * pc.active + 4 * L * n_q * d_h * s
exact = flops_per_token(llama3, s)
print(
    f"short formula {short / 1e9:.2f} GFLOP, "
    f"calc {exact / 1e9:.2f} GFLOP per token at s = {s:,}"
)
assert short - exact == 2 * (V * d + pc.breakdown["norms"])
attn_share = 4 * L * n_q * d_h * s / exact  # attention's own work at 8k
s_long = 131_072
attn_share_long = 4 * L * n_q * d_h * s_long / flops_per_token(llama3, s_long)
print(f"attention's own share: {attn_share:.1%} at 8k, {attn_share_long:.1%} at 128k")
assert attn_share_long > 0.5  # at 128k it is most of the work
glue("ch13-flop-over", f"{short / exact - 1:.1%}", display=False)
glue("ch13-attn-share", f"{attn_share:.0%}", display=False)
glue("ch13-attn-share-long", f"{attn_share_long:.0%}", display=False)

# %% [markdown]
# At 8k tokens attention's weight-free work is already {glue:text}`ch13-attn-share` of the
# total; at 128k tokens (were the model run that long) it would be
# {glue:text}`ch13-attn-share-long`. That is the second reason, after the cache, why long context is expensive.
#
# ## The spec sheet
#
# Every preset in `companion.models.presets` copies a released `config.json`, and `spec_row`
# writes one as a row of text. Here are all {glue:text}`ch13-n-presets`, in order of
# release and grouped by era, after the 2017 base model of {doc}`chapter 3
# <03_transformer_2017>`: one column per part of the block, then the calculator's total and
# active parameters and the cache a token costs on average over a 128k-token context (bf16;
# windows, compressed entries and fixed recurrent states included), whether or not the model
# was trained to read that far. A dash is a value no primary source gives.

# %% tags=["hide-input"]
RELEASED = {  # name -> (label, release date as a fractional year)
    "gpt2": ("GPT-2 small", 2019.1),
    "gpt2-xl": ("GPT-2 XL", 2019.85),
    "gpt3-175b": ("GPT-3 175B", 2020.4),
    "llama2-7b": ("Llama 2 7B", 2023.55),
    "mistral-7b": ("Mistral 7B", 2023.7),
    "mixtral-8x7b": ("Mixtral 8x7B", 2023.95),
    "llama3-8b": ("Llama 3 8B", 2024.3),
    "llama3.1-8b": ("Llama 3.1 8B", 2024.55),
    "smollm2-135m": ("SmolLM2 135M", 2024.85),
    "deepseek-v3": ("DeepSeek-V3", 2024.98),
    "gemma3-27b": ("Gemma 3 27B", 2025.2),
    "qwen3-235b-a22b": ("Qwen3-235B-A22B", 2025.32),
    "gpt-oss-120b": ("gpt-oss-120b", 2025.6),
    "qwen3-next-80b-a3b": ("Qwen3-Next-80B-A3B", 2025.7),
    "smollm3-3b": ("SmolLM3 3B", 2025.52),
    "minimax-m2": ("MiniMax-M2", 2025.82),
    "kimi-linear-48b-a3b": ("Kimi Linear 48B-A3B", 2025.83),
    "olmo3-32b": ("Olmo 3 32B", 2025.88),
    "deepseek-v3.2": ("DeepSeek-V3.2", 2025.92),
    "kimi-k2.5": ("Kimi K2.5", 2026.07),
    "trinity-large": ("Trinity Large", 2026.08),
    "glm-5": ("GLM-5", 2026.11),
    "qwen3.5-397b-a17b": ("Qwen3.5-397B-A17B", 2026.12),
    "deepseek-v4-flash": ("DeepSeek-V4-Flash", 2026.31),
    "deepseek-v4-pro": ("DeepSeek-V4-Pro", 2026.31),
    # its release date was not found: placed in the year transformers added its class
    "ling-3.0-flash": ("Ling-3.0-Flash", 2026.46),
}
assert sorted(RELEASED) == sorted(PRESETS)
glue("ch13-n-presets", str(len(RELEASED)), display=False)
rows = {name: spec_row(preset(name)) for name in RELEASED}
FIELDS = ("norm", "position", "ffn", "attention", "vocab", "context")
assert all(tuple(row) == FIELDS for row in rows.values())
LONG = 128 * 1024  # the context of the cache column


def sheet_cells(row: dict[str, str], total: float, active: float, kv: float) -> str:
    """One row's cells after the name and year: the spec fields, params, cache."""
    def count(n: float) -> str:
        return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"

    numbers = (row["vocab"], row["context"], count(total), count(active),
               f"{kv / 1024:.1f}")
    return "".join(f"<td>{row[f]}</td>" for f in FIELDS[:4]) + "".join(
        f"<td style='text-align:right'>{v}</td>" for v in numbers)


# the 2017 base model is an encoder-decoder (chapter 3): its own counts and cache
t2017 = transformer_base_config()
row2017 = spec_row(t2017) | {"context": "—"}  # the sinusoid has no trained maximum
n2017 = sum(base_param_breakdown().values())  # the paper's Table 3 says 65M
kv2017 = kv_cache_bytes(t2017, LONG) / LONG  # decoder self-attention only
ERAS = ((2021, "The original"), (2024.9, "The consolidation"),
        (2026, "The sparse turn"), (2100, "The hybrid turn"))
sheet, era = [], None
by_date = sorted(rows.items(), key=lambda item: RELEASED[item[0]][1])
for name, row in [("transformer-2017", row2017), *by_date]:
    label, year = RELEASED.get(name, ("Transformer base", 2017.45))
    new_era = next(title for end, title in ERAS if year < end)
    if new_era != era:
        era = new_era
        sheet.append(f"<tr><th colspan='11' style='text-align:left'>{era}</th></tr>")
    if name == "gpt3-175b":  # alternating dense and banded layers, band unpublished
        row = row | {"attention": row["attention"] + ", banded every other layer (—)"}
    if name == "transformer-2017":
        numbers = (n2017, n2017, kv2017)
    else:
        pc = count_params(preset(name))
        numbers = (pc.total, pc.active, kv_cache_bytes(preset(name), LONG) / LONG)
    sheet.append(f"<tr><td>{label}</td><td>{int(year)}</td>"
                 + sheet_cells(row, *numbers) + "</tr>")
header = "".join(f"<th>{f}</th>" for f in (
    "model", "year", *FIELDS, "total", "active", "KV KiB/token at 128k"))
# DeepSeek-V4 reads the whole past through compressed entries: a smaller cache at 128k
# than any model that keeps every past token of every layer at full resolution
avg = {n: kv_cache_bytes(preset(n), LONG) / LONG / 1024 for n in RELEASED}
dense_past = [n for n in RELEASED if set(preset(n).layer_types) == {"full"}
              and preset(n).compression is None]
assert avg["deepseek-v4-flash"] < min(avg[n] for n in dense_past)
glue("ch13-kv-v4", f"{avg['deepseek-v4-flash']:.1f}", display=False)
glue("ch13-kv-dense-min", f"{min(avg[n] for n in dense_past):.1f}", display=False)
gpt3 = count_params(preset("gpt3-175b")).total
assert abs(n2017 / PAPER_BASE_PARAMS - 1) < 0.05 and round(gpt3 / 1e9) == 175
glue("ch13-n2017", f"{n2017 / 1e6:.1f}", display=False)
glue("ch13-gpt3", f"{gpt3 / 1e9:.1f}", display=False)
HTML(
    "<table style='font-size:80%'>"
    f"<thead><tr>{header}</tr></thead><tbody>{''.join(sheet)}</tbody></table>"
)

# %% [markdown]
# Read down the `norm` column and the 2019 convention, LayerNorm before each sublayer, gives
# way to RMSNorm in 2023 and never comes back; the placement then moves again, in this
# table with Gemma 3 and Olmo 3 (2025): Gemma's sandwich and Olmo's post-branch norms, with
# QK-norm added. Both placements are a year older than their rows here: they came with
# Gemma 2 {cite}`gemmateam2024gemma2` and OLMo 2 {cite}`olmo2024olmo2` in 2024, models
# that have no preset in this sheet. The `ffn` column goes from a
# GELU MLP to SwiGLU to experts; the `attention` column from full multi-head attention to
# grouped queries, latent attention, windows and, in the hybrid, three Gated DeltaNet
# layers per softmax layer. The largest vocabulary is {glue:text}`ch13-vocab-growth` times
# GPT-2's. In the last block the residual add itself changes for the first time:
# DeepSeek-V4 carries four residual streams mixed by hyper-connections, and reads the whole
# past through a window and compressed entries at {glue:text}`ch13-kv-v4` KiB per token at
# 128k, below the {glue:text}`ch13-kv-dense-min` KiB of the leanest model here that keeps
# every past token of every layer.
#
# Two rows need a word. The 2017 base model is an encoder-decoder, so its count is
# {doc}`chapter 3 <03_transformer_2017>`'s breakdown, {glue:text}`ch13-n2017`M (the paper
# rounds it to 65M), and its cache is the decoder's self-attention alone. GPT-3 is GPT-2's
# block at 96 layers of width 12,288: {glue:text}`ch13-gpt3`B parameters, which the paper
# names 175.0B {cite}`brown2020language`. Every other GPT-3 layer attends only within a
# local band whose width the paper does not give, so the sheet counts its cache as dense.
#
# The rows agree with the hand-made spec sheet of the same models in Anirudh Srinivasan's
# article *What Changed Inside the Transformer?*
# wherever that sheet gives a number from the config; the folded cell below checks each of
# those numbers, typed from the article, against the rows. Three differences are matters of what one calls "the context": the configs
# store `max_position_embeddings`, which is 32,768 for Mistral 7B (the paper trained at
# 8,192 with a 4,096 window {cite}`jiang2023mistral`), 163,840 for DeepSeek-V3 (YaRN's
# factor 40 on 4,096; the report quotes 128k {cite}`deepseekai2024deepseekv3`) and 40,960
# for Qwen3-235B (32,768 plus room for a reply {cite}`yang2025qwen3`). And Gemma 3's
# embedding table has 262,208 rows, 64 more than the 262,144-token vocabulary usually
# quoted {cite}`gemmateam2025gemma3`.

# %% tags=["hide-input"]
vocab = {name: int(rows[name]["vocab"].replace(",", "")) for name in rows}
assert (
    vocab["gpt2-xl"] == 50_257
    and vocab["llama2-7b"] == vocab["mistral-7b"] == 32_000
)
assert vocab["llama3-8b"] == 128_256 and vocab["deepseek-v3"] == 129_280
assert vocab["qwen3-235b-a22b"] == 151_936 and vocab["gpt-oss-120b"] == 201_088
assert vocab["gemma3-27b"] == 262_208 == 262_144 + 64
glue(
    "ch13-vocab-growth",
    f"{max(vocab.values()) / vocab['gpt2']:.1f}",
    display=False,
)
attention = {name: rows[name]["attention"] for name in rows}
assert attention["gpt2-xl"] == "MHA 25" and attention["llama2-7b"] == "MHA 32"
assert attention["mistral-7b"] == "GQA 32:8, SWA 4096"
assert attention["deepseek-v3"] == "MLA r=512, 128 heads"
assert attention["qwen3-235b-a22b"] == "GQA 64:4"
assert attention["gpt-oss-120b"] == "GQA 64:8, SWA 128 at 1:1, sinks"
assert attention["gemma3-27b"] == "GQA 32:16, SWA 1024 at 5:1"
assert attention["olmo3-32b"] == "GQA 40:8, SWA 4096 at 3:1"
assert rows["deepseek-v3"]["ffn"].startswith("MoE 256+1, top-8")
assert rows["qwen3-235b-a22b"]["ffn"].startswith("MoE 128, top-8")
assert rows["gpt-oss-120b"]["ffn"].startswith("MoE 128, top-4")
context = {name: int(rows[name]["context"].replace(",", "")) for name in rows}
assert context["gpt2-xl"] == 1_024 and context["llama2-7b"] == 4_096
# 8k -> 128k
assert (context["llama3-8b"], context["llama3.1-8b"]) == (8_192, 131_072)
assert context["gpt-oss-120b"] == context["gemma3-27b"] == 131_072
assert context["olmo3-32b"] == 65_536 and context["qwen3-next-80b-a3b"] == 262_144
assert (
    context["mistral-7b"] == 32_768
    and context["deepseek-v3"] == 163_840 == 40 * 4096
)

# %% [markdown]
# The sheet's last three columns, drawn in order of release ({numref}`fig-sparse-turn`,
# with the cache one token adds while the context is shorter than every window), show the
# **sparse turn**: from Mixtral on, the total and the active count part ways, and from
# DeepSeek-V3 on, the per-token cache of the largest models *falls*.

# %% tags=["hide-input"]
names = list(RELEASED)
years = np.array([RELEASED[n][1] for n in names])
totals = np.array([count_params(preset(n)).total for n in names], dtype=float)
actives = np.array([count_params(preset(n)).active for n in names], dtype=float)
kv = np.array([kv_cache_bytes_per_token(preset(n)) for n in names], dtype=float)
ratio = dict(zip(names, totals / actives, strict=True))
assert all(ratio[n] == 1 for n in names if preset(n).moe is None)  # dense: equal
assert all(ratio[n] > 3 for n in names if preset(n).moe is not None)  # sparse: apart
kib = dict(zip(names, kv / 1024, strict=True))
# the cache per token by hand: layers × (K and V) × KV heads × head width × 2 bytes
by_hand = {
    "llama2-7b": 32 * 2 * 32 * 128 * 2,
    "llama3-8b": 32 * 2 * 8 * 128 * 2,
    # MLA: a latent of 512 and a 64-wide RoPE key
    "deepseek-v3": 61 * (512 + 64) * 2,
    "gpt-oss-120b": 36 * 2 * 8 * 64 * 2,  # every layer, while the context < 128
    "qwen3-next-80b-a3b": 12 * 2 * 2 * 256 * 2,  # the 12 full layers only
    "qwen3-235b-a22b": 94 * 2 * 4 * 128 * 2,
}
assert all(kib[n] * 1024 == b for n, b in by_hand.items())
big = ("deepseek-v3", "gpt-oss-120b", "qwen3-next-80b-a3b")
assert max(kib[n] for n in big) < kib["llama3-8b"]
assert (
    kib["qwen3-235b-a22b"] > kib["llama3-8b"]
)  # 94 layers x 4 KV heads: the exception
for n in ("deepseek-v3", "qwen3-235b-a22b", "qwen3-next-80b-a3b"):
    glue(f"ch13-ratio-{n}", f"{ratio[n]:.1f}", display=False)
for n in (
    "llama2-7b",
    "llama3-8b",
    "gpt-oss-120b",
    "qwen3-next-80b-a3b",
    "qwen3-235b-a22b",
):
    glue(f"ch13-kib-{n}", f"{kib[n]:.0f}", display=False)
glue("ch13-kib-deepseek-v3", f"{kib['deepseek-v3']:.1f}", display=False)
size_ratio = totals[names.index("deepseek-v3")] / totals[names.index("llama3-8b")]
glue("ch13-dsv3-vs-llama", f"{size_ratio:.0f}", display=False)
glue(
    "ch13-kib-big-range",
    f"{min(kib[n] for n in big):.0f}–{max(kib[n] for n in big):.0f}",
    display=False,
)

# %% tags=["hide-input", "remove-output"]
order = np.argsort(years, kind="stable")  # by release date, top to bottom
row = np.arange(len(names))
ticks = [f"{RELEASED[names[i]][0]} ({int(years[i])})" for i in order]
tot, act, cache = totals[order], actives[order], kv[order] / 1024
mix = tot > act
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 7.4), sharey=True)
ax1.hlines(row[mix], act[mix], tot[mix], color="0.6", lw=1.5)
ax1.scatter(tot, row, color=PALETTE[0], label="total (stored)", zorder=3)
ax1.scatter(
    act[mix], row[mix], color=PALETTE[1], marker="s", label="active (MoE)", zorder=3
)
ax1.set(
    xscale="log",
    xlabel="parameters",
    title="Parameters: stored vs used per token",
)
ax1.set_yticks(row, ticks)
ax1.invert_yaxis()
ax1.legend(loc="lower left")
ax2.scatter(cache, row, color=PALETTE[2], zorder=3)
ax2.axvline(kib["llama3-8b"], color="0.4", ls="--", lw=1)
ax2.text(kib["llama3-8b"] * 1.08, len(row) - 0.6, "Llama 3 8B", color="0.3")
ax2.set(
    xscale="log",
    xlabel="KiB per cached token (bf16)",
    title="KV cache: bytes each token adds",
)
glue("fig-sparse-turn", fig)
plt.close(fig)

# %% [markdown]
# ```{glue:figure} fig-sparse-turn
# :name: fig-sparse-turn
#
# The {glue:text}`ch13-n-presets` presets in order of release, one row each. Left: the
# parameters a model stores (circles) and, for a mixture of experts, those one token
# uses (squares, joined to the total). Right: the bytes one token adds to the KV cache in
# bf16, while the context is shorter than every window; the dashed line is Llama 3 8B.
# Both axes are logarithmic.
# ```
#
# DeepSeek-V3 stores {glue:text}`ch13-ratio-deepseek-v3` times the parameters it uses per
# token, Qwen3-235B {glue:text}`ch13-ratio-qwen3-235b-a22b` times and Qwen3-Next
# {glue:text}`ch13-ratio-qwen3-next-80b-a3b` times. Per cached token, the dense Llama 2 7B
# needs {glue:text}`ch13-kib-llama2-7b` KiB and Llama 3 8B, with grouped queries,
# {glue:text}`ch13-kib-llama3-8b` KiB; DeepSeek-V3, a model
# {glue:text}`ch13-dsv3-vs-llama` times larger, needs {glue:text}`ch13-kib-deepseek-v3`
# KiB thanks to its latent cache ({doc}`chapter 8 <08_kv_cache>`), gpt-oss-120b
# {glue:text}`ch13-kib-gpt-oss-120b` KiB, and the hybrid Qwen3-Next
# {glue:text}`ch13-kib-qwen3-next-80b-a3b` KiB, because three layers in four keep a
# fixed-size state instead of a cache ({doc}`chapter 11 <11_linear_attention>`).
# Qwen3-235B is the exception that shows the dial: four KV heads, but 94 layers, so
# {glue:text}`ch13-kib-qwen3-235b-a22b` KiB.
#
# ## Drawing the architecture
#
# The same config also draws the model. `block_diagram` draws one column per kind of block
# a stack holds, the stream going up and the residual path on the left, and
# `model_diagram` draws the stack as two strips, the token mixer of every layer over its
# FFN. Every label is read from a field, so a changed field changes the drawing. Here is
# the hybrid Qwen3-Next: a Gated DeltaNet block and a gated, grouped-query attention block,
# both with 512 routed experts, and the 3:1 pattern of the two across its 48 layers.

# %%
from companion.analysis.diagrams import (  # noqa: E402
    block_diagram,
    block_parts,
    model_diagram,
)

qwen_next = preset("qwen3-next-80b-a3b")
block_diagram(qwen_next)
plt.show()
model_diagram(qwen_next)
plt.show()
# the drawing follows the config: one field changed, one label changed
kinds = [p.kind for p in block_parts(qwen_next, 3)]  # layer 3: full attention
assert kinds == ["norm", "full", "add", "norm", "moe", "add"]
gqa = next(p for p in block_parts(qwen_next, 3) if p.kind == "full").title
mqa = next(
    p for p in block_parts(qwen_next.replace(n_kv_heads=1), 3) if p.kind == "full"
).title
print(f"{gqa}  ->  with n_kv_heads=1: {mqa}")
assert gqa.startswith(
    f"GQA {qwen_next.n_heads}:{qwen_next.n_kv_heads}"
) and mqa.startswith("MQA")

# %% [markdown]
# *Top: Qwen3-Next-80B-A3B's two kinds of block, drawn from its preset; bottom: its 48
# layers, each cell coloured by its token mixer (upper strip) and its FFN (lower strip).*
#
# ## The calculator
#
# One function builds a configuration from a preset and a few dials, through
# `ModelConfig.replace` (which validates every field again), and another prints what
# `companion.analysis.calculator` makes of it. "Width" changes $d$ with the head count and head width
# held, so it scales the FFN-facing parts and the vocabulary tables; changing the layer
# count keeps a preset's repeating layer pattern.


# %%
def build(
    name: str, layers=None, width=None, kv_heads=None, experts=None, top_k=None
) -> ModelConfig:
    """A preset with some dials turned; None keeps the preset's value."""
    cfg = preset(name)
    changes: dict[str, object] = {"head_dim": cfg.head_dim}
    if layers is not None:
        kinds, period = cfg.layer_types, layer_period(cfg.layer_types)
        changes["n_layers"] = layers
        changes["layer_types"] = tuple(kinds[i % period] for i in range(layers))
    if width is not None:
        changes["d_model"] = width
    if kv_heads is not None and not cfg.is_mla:
        # the largest divisor of the query heads not above the dial
        changes["n_kv_heads"] = max(
            h for h in range(1, kv_heads + 1) if cfg.n_heads % h == 0
        )
    moe = cfg.moe
    if moe is not None and (experts is not None or top_k is not None):
        n = moe.n_experts if experts is None else experts
        groups = moe.router_groups if n % moe.router_groups == 0 else 1
        changes["moe"] = moe.replace(
            n_experts=n,
            router_groups=groups,
            router_topk_groups=min(moe.router_topk_groups, groups),
            experts_per_token=min(moe.experts_per_token if top_k is None else top_k, n),
        )
    return cfg.replace(**changes)


def report(cfg: ModelConfig, context: int) -> dict[str, float]:
    """Print and return parameters, active parameters, KV cache, FLOPs/token."""
    pc = count_params(cfg)
    out = {
        "params_B": pc.total / 1e9,
        "active_B": pc.active / 1e9,
        "kv_GiB": kv_cache_bytes(cfg, context) / 2**30,
        "gflops_token": flops_per_token(cfg, context) / 1e9,
    }
    print(f"parameters   {out['params_B']:10.2f} B   (active {out['active_B']:.2f} B)")
    print(
        f"KV cache     {out['kv_GiB']:10.2f} GiB at {context:,} tokens "
        "(bf16, one sequence)"
    )
    print(f"forward      {out['gflops_token']:10.2f} GFLOP per token at that context")
    return out


base = report(build("llama3-8b"), 8192)
mqa = report(build("llama3-8b", kv_heads=1), 8192)
L, d, d_h = llama3.n_layers, llama3.d_model, llama3.head_dim
assert base["kv_GiB"] * 2**30 == L * 2 * 8 * d_h * 2 * 8192  # by hand, 8 KV heads
assert mqa["kv_GiB"] == base["kv_GiB"] / 8
dropped = round((base["params_B"] - mqa["params_B"]) * 1e9)
assert dropped == 2 * L * d * d_h * 7  # the K and V projections of 7 heads
glue("ch13-calc-kv", f"{base['kv_GiB']:g}", display=False)
glue("ch13-calc-dropped", f"{dropped / 1e6:.0f}", display=False)
flop_cut = 1 - mqa["gflops_token"] / base["gflops_token"]
glue("ch13-calc-flop-cut", f"{flop_cut:.0%}", display=False)

# %% [markdown]
# At its 8k context one Llama 3 8B sequence caches exactly {glue:text}`ch13-calc-kv` GiB;
# with a single KV head (multi-query attention) an eighth of that, for
# {glue:text}`ch13-calc-dropped` million fewer parameters and
# {glue:text}`ch13-calc-flop-cut` fewer FLOPs.
#
# {numref}`fig-calculator` turns every dial the formulas read, in the page itself: pick a
# preset, then change the width, the heads, the experts, the latent ranks, the sparse
# indexer, the window or the layer pattern (one letter per layer, `F` full, `S` sliding,
# `L` linear, `C` and `H` DeepSeek-V4's compressed sparse and heavily compressed layers,
# repeated to the depth as `build` repeats a preset's pattern). It is a small script written
# for the page by `companion.analysis.calculator_page`, which repeats the calculator's
# arithmetic in exact integers and applies the config's rules: dials that describe a model
# that cannot be built (12 query heads over 9 KV heads, a query latent without a latent)
# clear the numbers and say which field is wrong, as `ModelConfig` would. The book's browser
# test sets every preset, random dials and such impossible ones, and requires the page's
# five numbers (or its message) to equal `companion.analysis.calculator`'s.

# %% tags=["hide-input", "remove-output"]

# the dials describe each preset on the page: read back, the same four numbers
for name, cfg in PAGE_PRESETS.items():
    back = config_from_dials(dial_values(cfg))
    assert count_params(back) == count_params(cfg), name
    assert kv_cache_bytes(back, 8192) == kv_cache_bytes(cfg, 8192), name
    assert flops_per_token(back, 8192) == flops_per_token(cfg, 8192), name
glue("fig-calculator", HTML(calculator_html("llama3-8b")))

# %% [markdown]
# ```{glue:figure} fig-calculator
# :name: fig-calculator
#
# The calculator with no kernel: a preset menu, one dial per configuration field that
# the parameter, cache and FLOP counts read, and the five outputs (hover over a number
# for its exact value). Dials the preset does not use (the MLA ranks of a GQA model, say)
# start at 0.
# ```

# %% [markdown] tags=["remove-cell"]
# In Jupyter, the panel below calls `build` and `report` themselves through ipywidgets
# (the book leaves it out: it needs a running kernel).

# %% tags=["remove-cell"]
# NBVAL_IGNORE_OUTPUT
import ipywidgets as widgets  # noqa: E402

dials = {
    "layers": widgets.IntSlider(32, 1, 128, description="layers"),
    "width": widgets.IntSlider(4096, 256, 16384, 256, description="width d"),
    "kv_heads": widgets.IntSlider(8, 1, 128, description="KV heads"),
    "experts": widgets.IntSlider(8, 2, 512, description="experts"),
    "top_k": widgets.IntSlider(2, 1, 16, description="top-k"),
    "context": widgets.IntSlider(8192, 1024, 262144, 1024, description="context"),
}
choice = widgets.Dropdown(
    options=list(RELEASED), value="llama3-8b", description="preset"
)


def reset(change) -> None:
    """Move the dials to the chosen preset's own values."""
    cfg = preset(change["new"])
    dials["layers"].value, dials["width"].value = cfg.n_layers, cfg.d_model
    dials["kv_heads"].value = cfg.n_kv_heads
    dials["experts"].value = cfg.moe.n_experts if cfg.moe else 8
    dials["top_k"].value = cfg.moe.experts_per_token if cfg.moe else 2
    dials["context"].value = min(cfg.max_seq_len, 262144)


choice.observe(reset, names="value")


def panel(name, layers, width, kv_heads, experts, top_k, context) -> None:
    try:
        report(build(name, layers, width, kv_heads, experts, top_k), context)
    except ConfigError as err:
        print("not a valid model:", err)


widgets.interactive(panel, name=choice, **dials)

# %% [markdown]
# To see which numbers move together without a kernel, {numref}`fig-kv-heads` turns one
# dial: the number of KV heads of Llama 3 8B, from 32 (full multi-head attention, like
# Llama 2) down to 1, at the 8k context, each number relative to the 32-head model.

# %% tags=["hide-input", "remove-output"]
steps = [32, 16, 8, 4, 2, 1]
sweep = [build("llama3-8b", kv_heads=h) for h in steps]
raw = np.array(
    [
        [count_params(c).total, kv_cache_bytes(c, 8192), flops_per_token(c, 8192)]
        for c in sweep
    ],
    dtype=float,
)
rel = raw / raw[0]
fig, ax = plt.subplots(figsize=(7.2, 3.8))
labels = [
    f"parameters ({raw[0, 0] / 1e9:.2f} → {raw[-1, 0] / 1e9:.2f} B)",
    f"KV cache, 8k tokens ({raw[0, 1] / 2**30:g} → {raw[-1, 1] / 2**30:g} GiB)",
    f"FLOPs/token at 8k ({raw[0, 2] / 1e9:.1f} → {raw[-1, 2] / 1e9:.1f} G)",
]
for j, (label, marker) in enumerate(zip(labels, "os^", strict=True)):
    ax.plot(steps, rel[:, j], marker=marker, color=PALETTE[j], label=label)
ax.axvline(8, color="0.4", ls="--", lw=1)
ax.text(7.6, 0.3, "Llama 3 8B\nas released", color="0.3", fontsize=9)
ax.set_xscale("log", base=2)
ax.set_xticks(steps, [str(h) for h in steps])
ax.minorticks_off()
ax.invert_xaxis()
ax.set(
    ylim=(0, 1.05),
    xlabel="KV heads (of 32 query heads)",
    ylabel="fraction of the 32-KV-head model",
    title="What fewer KV heads save (Llama 3 8B, 8k context)",
)
ax.legend(loc="center right", title="32 → 1 KV heads", title_fontsize=9)
glue("fig-kv-heads", fig)
plt.close(fig)

# %% [markdown]
# ```{glue:figure} fig-kv-heads
# :name: fig-kv-heads
#
# Llama 3 8B with its KV heads cut from 32 to 1 (the released model has 8, dashed),
# everything else held: parameters, KV cache of one 8,192-token sequence in bf16, and
# forward FLOPs per token at that context, each as a fraction of the 32-head model
# (the legend gives the two ends). The horizontal axis halves at each step.
# ```

# %% tags=["hide-input"]
print("KV heads:", steps)
print("params   ", np.round(rel[:, 0], 3))
print("KV cache ", np.round(rel[:, 1], 4))
print("FLOPs    ", np.round(rel[:, 2], 3))
assert np.allclose(rel[:, 1], np.array(steps) / 32)  # the cache is linear in n_kv
L, d, d_h = llama3.n_layers, llama3.d_model, llama3.head_dim
assert (
    count_params(sweep[0]).total - count_params(sweep[-1]).total
    == 2 * L * d * d_h * 31
)
assert rel[-1, 0] > 0.8 and rel[-1, 2] > 0.8  # both fall far less than the cache
glue("ch13-sweep-params", f"{1 - rel[-1, 0]:.0%}", display=False)
glue("ch13-sweep-flops", f"{1 - rel[-1, 2]:.0%}", display=False)
glue("ch13-sweep-kv", f"{rel[0, 1] / rel[-1, 1]:.0f}", display=False)

# %% [markdown]
# The cache falls in proportion, to 1/{glue:text}`ch13-sweep-kv`; the parameters by
# {glue:text}`ch13-sweep-params` (the $K$ and $V$ projections, $2Ld\,d_h$ per head removed)
# and the FLOPs by {glue:text}`ch13-sweep-flops`, since attention's
# weight-free term depends on the query heads, not the KV heads. That asymmetry is why
# grouped-query attention spread: it is almost free in compute and parameters and buys
# its savings where decoding is bound, in memory traffic ({doc}`chapter 8 <08_kv_cache>`).
#
# ## The 6N rule
#
# One forward pass costs about $2N$ FLOPs per token for $N$ parameters used; the backward
# pass costs about twice that (a gradient for the activations and one for the weights),
# so training costs about $6N$ FLOPs per token {cite}`kaplan2020scaling`
# {cite}`hoffmann2022training`. With experts, $N$ is the active count. Llama 3 8B was
# trained on about 15 trillion tokens {cite}`grattafiori2024llama`, DeepSeek-V3 on 14.8
# trillion {cite}`deepseekai2024deepseekv3`:

# %%
budgets = {"llama3-8b": 15e12, "deepseek-v3": 14.8e12}
compute = {}
for name, tokens in budgets.items():
    pc = count_params(preset(name))
    compute[name] = 6 * pc.active * tokens
    naive = 6 * pc.total * tokens
    print(
        f"{RELEASED[name][0]:<12} 6·N_active·D = {compute[name]:.2e} FLOPs   "
        f"(with N_total: {naive:.2e})"
    )
dsv3, ll3 = count_params(preset("deepseek-v3")), count_params(preset("llama3-8b"))
assert compute["deepseek-v3"] / compute["llama3-8b"] < dsv3.total / ll3.total / 10
for name in budgets:
    mantissa, exponent = f"{compute[name]:.2e}".split("e")
    glue(f"ch13-6n-{name}", f"{mantissa}e{int(exponent)}", display=False)
glue(
    "ch13-6n-ratio",
    f"{compute['deepseek-v3'] / compute['llama3-8b']:.1f}",
    display=False,
)
glue("ch13-6n-size", f"{dsv3.total / ll3.total:.0f}", display=False)
glue("ch13-6n-over", f"{dsv3.total / dsv3.active:.1f}", display=False)

# %% [markdown]
# DeepSeek-V3 has {glue:text}`ch13-6n-size` times the parameters of Llama 3 8B but took
# only {glue:text}`ch13-6n-ratio` times the training compute: a sparse model is budgeted by
# what each token touches. Counting its total instead would overstate the run
# {glue:text}`ch13-6n-over`-fold. (The report gives 2.788 million H800
# GPU-hours for the whole run; turning FLOPs into hours needs a utilisation we cannot
# compute here, so we stop at the FLOPs.) The rule leaves out attention's $4Ln_qd_hs$ per
# token, which at long context and small width is not small, as the FLOP cell above showed.
#
# ## What didn't change
#
# Lay the 2019 and 2025 rows of the spec sheet side by side and almost every cell has
# changed. The shape of the thing has not. Every model above still alternates a step that
# mixes information across positions with a step that works on each position alone, joined
# by residual additions, and in every one of them at least some layers are softmax
# attention: even Qwen3-Next keeps one full-attention layer in four, because exact
# retrieval of an earlier token is what the linear layers give up
# ({doc}`chapter 11 <11_linear_attention>`). Every one
# is a decoder-only next-token predictor trained with cross-entropy; multi-token prediction
# adds heads that predict further ahead, with the same cross-entropy. And the $6N$ budget still holds, with one new word in it:
# active.
#
# What the nine years bought, measured with the calculator, is mostly efficiency: fewer
# cached bytes per token, fewer FLOPs per stored parameter, longer contexts. What these
# models can do is not in the spec sheet at all: the calculator prices a configuration,
# and capability depends as well on data and training, which no row records.
#
# ## What we learned
#
# A model's configuration fixes its cost: four short formulas, plus the embedding tables,
# norm gains and routers they leave out, give the released parameter counts to the
# integer, and the FLOPs per token follow once the input embedding is counted as a lookup
# and attention's own work is allowed to grow with the context. Run over the released
# configs from GPT-2 to 2026, the calculator shows where the period's changes went: sparse
# experts pulled the stored and the active parameter counts apart, and grouped, latent and
# linear attention cut the bytes most of the largest models cache per token, while the
# outline of the block stayed what it was. Turning one dial shows why grouped queries
# spread: fewer KV heads cut the cache in proportion but the parameters and FLOPs only a
# little. Training compute is still about six FLOPs per active parameter per token, so a
# sparse model is budgeted by what each token touches, and none of these numbers measures
# quality, which depends on data and training that no spec sheet records.
#
# ## Exercises
#
# 1. Extend the dense check to Llama 2 7B, which uses full multi-head attention and an FFN
#    of width 11,008. Does the same formula, with the same extra terms, give its count
#    exactly?
#
# ```{admonition} Solution
# :class: dropdown
# Yes: with `shapes(preset("llama2-7b"))`, $2Ld\,d_h(n_q+n_\text{kv}) + 3Ld\,d_\text{ff} +
# 2Vd + (2L+1)d = 6{,}738{,}415{,}616$, equal to `count_params(...).total`.
# ```
#
# 2. Qwen3-235B-A22B has QK-norm. Compute the residual between `count_params(...).active`
#    and the active formula and explain every term.
#
# ```{admonition} Solution
# :class: dropdown
# The residual is $2Vd + (2L+1)d + LNd + 2L\,d_h$: the untied tables, the block norms, a
# $d \times 128$ router per layer and, new, two head-width gains per layer for the query and
# key norms ({doc}`chapter 6 <06_normalization>`). It has no shared expert, so the MoE term is $3Ld\,d_e k$.
# ```
#
# 3. Use `build` and `report` to find the smallest number of experts for which a
#    DeepSeek-V3-shaped model with top-8 routing stores more than 10 times its active
#    parameters.
#
# ```{admonition} Hint
# :class: dropdown
# Loop `experts` over multiples of 8 and compare `count_params(cfg).total /
# count_params(cfg).active`. The dense first three layers, the attention and the
# embeddings form a floor under the active count that more experts do not raise.
# ```
#
# 4. The 6N rule ignores attention's $4Ln_qd_hs$. For Llama 3 8B, at what context $s$ does
#    this term equal $2N_\text{active}$? And for gpt-oss-120b, whose sliding layers cap
#    $s$ at 128?
#
# ```{admonition} Hint
# :class: dropdown
# For Llama 3 8B, $s = 2N/(4Ln_qd_h) \approx 30{,}600$ tokens. For gpt-oss, only the 18
# full layers grow with $s$; compare `flops_per_token(cfg, s)` with `2 * active` for growing
# `s`. Its small active count makes attention dominate much sooner.
# ```
#
# 5. Gemma 3 27B ties its embeddings and has a 262,208-row table. What fraction of its
#    parameters is that table, and how much would untying it add?
#
# ```{admonition} Solution
# :class: dropdown
# $Vd = 262{,}208 \times 5376 = 1{,}409{,}630{,}208$, 5.2% of its 27.0B; untying adds as
# much again (`count_params(preset("gemma3-27b").replace(tie_embeddings=False))`).
# ```

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
# ```{admonition} The question
# :class: tip
# What happens to a model's cost and to its quality when the 2017 decoder is turned into a 2026 hybrid one change at a time?
# The cost moves by exact factors (the final model stores about half again as many parameters as the 2017 one yet uses fewer per token, caches a sixteenth of the bytes per token and spends under a third of the FLOPs per token at 4k context); in our very short runs with three paired seeds most of the fall in held-out loss comes with the first four changes, the final hybrid ends below the 2017 decoder, and what the later changes do to quality these runs cannot tell.
# ```
#
# A 2026 open-weights model still has the outline of the decoder of
# {doc}`chapter 3 <03_transformer_2017>`: a token table at the bottom, a tower of blocks in which a step that
# mixes positions and a per-position FFN each add into the residual stream, and a
# projection onto the vocabulary at the top {cite}`vaswani2017attention`. What sits inside
# the blocks has been replaced nearly piece by piece, and the chapters before this one
# examined the replacements separately. This last chapter puts them back in a row. We start from a small 2017-style decoder and apply the
# changes of the book in order, **one per step**, thirteen steps and fourteen models, each step an explicit `replace` on a
# `ModelConfig`, so that the difference between two neighbouring models is a handful of fields
# that a cell checks.
#
# For every step we ask the questions of {doc}`chapter 13 <13_build_a_model>`: how many
# parameters, how many of them a token uses, how many bytes of cache a token costs at 4k
# and at 64k context, how many FLOPs a token needs. Then we train every step with three
# paired seeds, on the same Shakespeare characters and on a needle probe that only a
# model reaching far back can answer. The arithmetic moves by factors. The quality runs
# are very short, {glue:text}`ch14-lm-steps` steps, after which the 2017 decoder is
# barely below a unigram model: they measure how fast each model gets going, not how
# good it would become. The held-out loss moves at
# {glue:text}`ch14-n-moved` of the thirteen steps; what the later steps do to quality,
# runs this small cannot tell.

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
from companion.analysis.diagrams import block_diagram, changed_parts
from companion.analysis.seeds import compare, difference, spread
from companion.device import default_device, describe
from companion.models.config import ModelConfig
from companion.models.config_parts import LinearAttentionConfig, MoEConfig
from companion.models.decoder import DecoderLM
from companion.models.presets import preset
from companion.plotting import PALETTE, animate, glue, use_style
from companion.tasks.probes import accuracy, fit, needle, needle_vocab
from companion.tasks.text import (
    CharTokenizer,
    load_shakespeare,
    sample_windows,
    split_tokens,
)
from companion.training import (
    History,
    cosine_lr,
    evaluate,
    make_adamw,
    seed_everything,
    train,
)

FULL = False  # True: wider models, longer runs, five seeds (use a GPU)
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
# 1. **pre-LN** (2019, GPT-2 {cite}`radford2019language`): the norm moves onto the branch,
#    the residual path stays an identity {cite}`xiong2020layer`
#    ({doc}`chapter 6 <06_normalization>`);
# 2. **no dropout**: dropout fights overfitting {cite}`srivastava2014dropout`, but a model
#    that sees each token of a huge corpus about once has little to overfit, and in
#    single-epoch pretraining runs of BERT and Pythia models downstream scores were
#    better without it {cite}`liu2025drop`;
# 3. **RMSNorm**: no mean, no bias {cite}`zhang2019root` ({doc}`chapter 6 <06_normalization>`);
# 4. **RoPE**: position as a rotation of queries and keys {cite}`su2024roformer`, which also
#    retires the $\sqrt d$ embedding scale that existed to balance the added positions
#    ({doc}`chapter 5 <05_position>`);
# 5. **SwiGLU at $\tfrac83 d$** {cite}`shazeer2020glu` ({doc}`chapter 7 <07_gated_ffn>`);
# 6. **no biases, untied head**: the two ways Llama 1's linear maps differ from GPT-2's
#    {cite}`touvron2023llama`. Every matrix loses its bias, and the output head gets its
#    own $V \times d$ matrix instead of reusing the token table (GPT-2, like 2017, ties
#    them {cite}`press2017using`). One step, because both are about the same component,
#    the model's linear maps, and arrived together;
# 7. **MQA**: all four query heads share one key/value head, multi-query attention
#    {cite}`shazeer2019fast`, the limit of grouped-query attention with a single group
#    {cite}`ainslie2023gqa` ({doc}`chapter 8 <08_kv_cache>`);
# 8. **QK-norm**: an RMSNorm on each head's queries and keys {cite}`dehghani2023scaling`
#    ({doc}`chapter 6 <06_normalization>`);
# 9. **sliding windows 3:1**: three local layers with a 16-token window for each global
#    one, the ratio of Olmo 3 {cite}`olmo2025olmo3` and Trinity Large
#    {cite}`singh2026trinity` (Gemma 3 uses 5:1 {cite}`gemmateam2025gemma3`;
#    {doc}`chapter 9 <09_sliding_windows>`). *Replaced at step 12*;
# 10. **MoE with a shared expert**: each FFN becomes 8 routed experts of width $d/2$, two
#     per token {cite}`shazeer2017outrageously`, plus one shared expert of width $d/2$ that
#     every token passes through, behind a sigmoid gate as in Qwen3-Next
#     {cite}`dai2024deepseekmoe` ({doc}`chapter 10 <10_mixture_of_experts>`);
# 11. **output gate**: a sigmoid gate on each attention head's output, Qwen3-Next's gated
#     attention {cite}`qiu2025gated` ({doc}`chapter 12 <12_small_changes>`);
# 12. **Gated DeltaNet 3:1**: three linear-attention layers for each full one, as in
#     Qwen3-Next {cite}`yang2024gated` {cite}`qwen3next`
#     ({doc}`chapter 11 <11_linear_attention>`). It **replaces the sliding layers of
#     step 9**: the window is gone (`sliding_window` back to `None`);
# 13. **partial RoPE**: the full layer rotates only a quarter of each head's channels
#     (4 of 16) and leaves the rest without position, as Qwen3-Next and Qwen3.5 do
#     {cite}`qwen3next` ({doc}`chapter 5 <05_position>`). Everything before it stays.
#
# After the last step the block is Qwen3.5's at toy size: pre-RMSNorm with QK-norm,
# partial RoPE, one shared key/value head and a gated output in the full layer, three
# Gated DeltaNet layers for each full one, experts with a gated shared expert, an untied
# head and no biases. A cell below checks it against the package's preset of
# Qwen3.5-397B-A17B. Its sizes differ, of course (60 layers, 512 experts, 2 key/value
# heads for 32 query heads, a RoPE base of $10^7$), and so does one setting: Qwen3.5
# stores each RMSNorm gain as $1 + w$, which computes the same function and changes
# only what weight decay pulls the gain towards. Moonshot AI's Kimi Linear
# {cite}`kimiteam2025kimilinear` is the other 3:1 hybrid of the time; it would end the
# morph differently, with MLA in the full layer and Kimi Delta Attention, a Gated
# DeltaNet whose forget gate acts per channel, in the linear ones.

# %%
MORPH = [  # (name, fields changed, earlier steps it replaces)
    ("pre-LN", {"norm_placement": "pre"}, ()),
    ("no dropout", {"dropout": 0.0, "attn_dropout": 0.0}, ()),
    ("RMSNorm", {"norm": "rmsnorm"}, ()),
    ("RoPE", {"position": "rope", "scale_embeddings": False}, ()),
    ("SwiGLU 8/3", {"ffn": "glu", "activation": "silu", "d_ff": 8 * D // 3}, ()),
    ("no bias, untied", {"bias": False, "tie_embeddings": False}, ()),
    ("MQA", {"n_kv_heads": 1}, ()),
    ("QK-norm", {"qk_norm": "head"}, ()),
    (
        "sliding 3:1",
        {"sliding_window": 16, "layer_types": ("sliding",) * 3 + ("full",)},
        (),
    ),
    (
        "MoE + shared",
        {
            "moe": MoEConfig(
                n_experts=8,
                experts_per_token=2,
                expert_d_ff=D // 2,
                shared_d_ff=D // 2,
                shared_expert_gate=True,
            )
        },
        (),
    ),
    ("output gate", {"attn_output_gate": True}, ()),
    (
        "DeltaNet 3:1",
        {
            "sliding_window": None,
            "layer_types": ("linear",) * 3 + ("full",),
            "linear": LinearAttentionConfig(
                key_heads=2, value_heads=4, key_dim=D // 4, value_dim=D // 4
            ),
        },
        ("sliding 3:1",),
    ),
    ("partial RoPE", {"partial_rotary_factor": 0.25}, ()),
]
by_name = {name: changes for name, changes, _ in MORPH}
if FULL:  # 8 layers: keep the 3:1 patterns (by_name holds MORPH's own dicts)
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
    "partial_rotary_factor": "position",
    "ffn": "FFN",
    "activation": "FFN",
    "d_ff": "FFN",
    "bias": "linear maps",
    "tie_embeddings": "linear maps",
    "n_kv_heads": "keys and values",
    "qk_norm": "QK-norm",
    "sliding_window": "token mixers",
    "layer_types": "token mixers",
    "attn_output_gate": "output gate",
    "moe": "experts",
    "linear": "token mixers",
}

names, configs = ["2017"], [base]
for name, changes, _ in MORPH:
    names.append(name)
    configs.append(configs[-1].replace(**changes))


def changed_fields(a: ModelConfig, b: ModelConfig) -> dict[str, tuple]:
    """The fields set differently in two configs: name -> (old, new), as the model
    uses them (None where a field is unset again: it no longer applies)."""
    old, new = a.settings(), b.settings()
    return {
        k: (getattr(a, k), None if new[k] is None else getattr(b, k))
        for k in old
        if old[k] != new[k]
    }


def shown(value: object) -> str:
    """A field's value for the listing; a layer pattern as full/full/..., a mechanism
    group wrapped to the column."""
    text = "/".join(value) if isinstance(value, tuple) else repr(value)
    return textwrap.fill(text, 64, subsequent_indent=" " * 9, break_long_words=False)


components, replaced_by = [], {}
for i, (name, changes, replaces) in enumerate(MORPH, start=1):
    diff = changed_fields(configs[i - 1], configs[i])
    # exactly the intended fields, nothing else...
    assert set(diff) == set(changes), (name, diff)
    # ... each replaced step really loses fields here...
    undone = {k for r in replaces for k in by_name[r]}
    assert all(set(by_name[r]) & set(changes) for r in replaces), name
    replaced_by |= dict.fromkeys(replaces, i)
    # ... and the rest are all of one component
    (component,) = {COMPONENT[k] for k in set(changes) - undone}
    components.append(component)
    note = f" replaces {', '.join(replaces)}" if replaces else ""
    print(f"{i:>2} {name:<16} [{component}]{note}")
    for k, (old, new) in diff.items():
        print(f"{'':>5}{k}: {shown(old)} → {shown(new)}")
# every change stays in once made, until a step that says so replaces it
for i, (name, changes, _) in enumerate(MORPH, start=1):
    end = replaced_by.get(name, len(configs))
    for cfg in configs[i:end]:
        assert all(cfg.settings()[k] == v for k, v in changes.items()), name
    if name in replaced_by:  # and the replacing step really changes its fields
        assert any(configs[end].settings()[k] != v for k, v in changes.items()), name
assert len(configs) == 14
assert set(replaced_by) == {"sliding 3:1"}  # only the window is taken out again
# the last model is Qwen3.5's block at toy size: all that differs from the preset
# is a size, the gain's storage (1 + w) and how a checkpoint lays out the DeltaNet's
# projections
qwen35 = preset("qwen3.5-397b-a17b")
toy, real = configs[-1].settings(), qwen35.settings()
SIZES = {"vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
         "d_ff", "max_seq_len", "norm_eps", "init_std", "rope_theta"}  # fmt: skip
assert {k for k in toy if toy[k] != real[k]} == SIZES | {
    "norm_offset", "layer_types", "moe", "linear"}  # fmt: skip
unit = ("linear",) * 3 + ("full",)  # the layer pattern: 3:1, full layer last
assert qwen35.layer_types == unit * 15
assert configs[-1].layer_types == unit * (LAYERS // 4)


def differing(a: object, b: object) -> set[str]:
    return {k for k in vars(a) if getattr(a, k) != getattr(b, k)}


assert differing(configs[-1].moe, qwen35.moe) == {
    "n_experts", "experts_per_token", "expert_d_ff", "shared_d_ff"}  # fmt: skip
assert differing(configs[-1].linear, qwen35.linear) == {
    "key_heads", "value_heads", "key_dim", "value_dim", "projections"}  # fmt: skip
LAST = "Qwen3.5 block (toy size)"

# %% [markdown]
# Every entry is exactly one step's diff, and the asserts check that nothing else moved,
# that each step changes the fields of one component of the block (besides those of the
# steps it says it replaces), and that every change stays in every later config until a
# step that names it takes it out. `replace` builds a fresh config, so each one is
# validated again: a step that produced an impossible model (say, sliding layers without a
# window) would fail right here. The last checks hold the final config to Qwen3.5's: set
# beside the preset, it differs only in sizes, in the gain's $1 + w$ and in how a
# checkpoint lays out the DeltaNet's projections.
#
# ## What each step costs
#
# The calculator of {doc}`chapter 13 <13_build_a_model>` turns each config into exact
# numbers: total parameters, **active** parameters (what one token touches), KV-cache
# bytes per token and for a whole 4,096- and 65,536-token context in bf16 (with the
# DeltaNet layers' fixed state in fp32), and forward FLOPs for a token that attends to
# 4k or 64k keys. Its `count_params` is arithmetic on the config; we also build every
# model and count its tensors, which must agree to the parameter.

# %% tags=["hide-input"]
CONTEXTS = {"4k": 4096, "64k": 65536}
rows = []
for name, cfg in zip(names, configs, strict=True):
    pc = count_params(cfg)
    with torch.device("meta"):  # shapes only
        built = DecoderLM(cfg).num_params()
    assert built == pc.total, (name, built, pc.total)
    rows.append(
        {"name": name, "total": pc.total, "active": pc.active,
         "kv_per_token": kv_cache_bytes_per_token(cfg)}
        | {f"kv{c}": kv_cache_bytes(cfg, s) for c, s in CONTEXTS.items()}
        | {f"flops{c}": flops_per_token(cfg, s) for c, s in CONTEXTS.items()}
    )  # fmt: skip
where = {i: f"→ {replaced_by[n]}" for i, n in enumerate(names) if n in replaced_by}
print(f"{'':<19}{'':>16}{'KV':>7}{'KV cache (KiB)':>17}{'MFLOP/token':>15}")
print(
    f"{'step':<19}{'params':>8}{'active':>8}{'B/tok':>7}{'4k':>8}{'64k':>9}"
    f"{'4k':>7}{'64k':>8}  replaced"
)
for i, r in enumerate(rows):
    line = (
        f"{i:>2} {r['name']:<16}{r['total']:>8,}{r['active']:>8,}"
        f"{r['kv_per_token']:>7,}{r['kv4k'] / 1024:>8,.0f}{r['kv64k'] / 1024:>9,.0f}"
        f"{r['flops4k'] / 1e6:>7.2f}{r['flops64k'] / 1e6:>8.2f}  {where.get(i, '')}"
    )
    print(line.rstrip())
first, last = rows[0], rows[-1]
step = dict(zip(names, rows, strict=True))
cfg_of = dict(zip(names, configs, strict=True))
V, d, n = chars.vocab_size, D, LAYERS
# the 2017 row by hand: per layer 4d² attention weights + 4d biases, 8d² FFN
# weights + 5d biases, two LayerNorms (4d); the tied table Vd; no final norm after
# post-LN
assert first["total"] == first["active"] == n * (12 * d * d + 13 * d) + V * d
# FLOPs: 2 per weight a token goes through (not the lookup), 4 d per key for
# attention
assert first["flops4k"] == 2 * (n * 12 * d * d + V * d) + 4 * n * d * 4096
assert first["kv_per_token"] == n * 2 * d * 2  # K and V, all heads, bf16
# step 6: the biases go, the head gets its own V × d matrix
untied = step["no bias, untied"]
tied = count_params(cfg_of["no bias, untied"].replace(tie_embeddings=True)).total
assert untied["total"] == tied + V * d
assert step["MQA"]["kv_per_token"] * 4 == step["no bias, untied"]["kv_per_token"]
# the sliding layers hold 16 positions each; the full layer every position
sw, og = step["sliding 3:1"], step["output gate"]
dn = step["DeltaNet 3:1"]
n_sw = cfg_of["sliding 3:1"].layer_types.count("sliding")
per_layer = og["kv_per_token"] // LAYERS  # bytes per token and layer
window = n_sw * 16 * per_layer
assert og["kv4k"] == (LAYERS - n_sw) * per_layer * 4096 + window == sw["kv4k"]
# the DeltaNet step: each linear layer holds 4 fp32 states of d/4 × d/4 and 3 bf16
# inputs of its convolution (q, k: 2 heads of d/4; v: 4 heads of d/4)
n_lin = configs[-1].layer_types.count("linear")
dk, hd = D // 4, cfg_of["DeltaNet 3:1"].head_dim
state = 4 * dk * dk * 4 + 3 * (2 * 2 * dk + 4 * dk) * 2
assert dn["kv4k"] == (LAYERS - n_lin) * 2 * hd * 2 * 4096 + n_lin * state
assert dn["total"] - og["total"] == dn["active"] - og["active"] > 0
assert cfg_of["DeltaNet 3:1"].sliding_window is None
assert "sliding" not in cfg_of["DeltaNet 3:1"].layer_types
# ... at both lengths the fixed states cost more than the 16-token windows did
assert dn["kv4k"] > og["kv4k"] and dn["kv64k"] > og["kv64k"]
# partial RoPE: a rotation has no weights and caches nothing, so the last row is row 12
assert {k: v for k, v in last.items() if k != "name"} == {
    k: v for k, v in dn.items() if k != "name"}  # fmt: skip
assert abs(step["SwiGLU 8/3"]["total"] / first["total"] - 1) < 0.01  # steps 1-5
assert last["total"] > first["total"] and last["active"] < first["active"]
assert last["flops4k"] < first["flops4k"] / 3


def pct(a: float, b: float) -> str:
    return f"{a / b:.0%}"


for key, value in {
    "p0": f"{first['total']:,}",
    "p5": f"{step['SwiGLU 8/3']['total']:,}",
    "p5-change": f"{step['SwiGLU 8/3']['total'] / first['total'] - 1:+.1%}",
    "untie": f"{V * d:,}",
    "p6": f"{untied['total']:,}",
    "kvtok0": f"{first['kv_per_token']:,}",
    "kvtok7": f"{step['MQA']['kv_per_token']:,}",
    "kv7": f"{step['MQA']['kv4k'] / 1024:,.0f}",
    "kv9": f"{sw['kv4k'] / 1024:,.0f}",
    "kv9-64k": f"{sw['kv64k'] / 1024:,.0f}",
    "kv7-64k": f"{step['MQA']['kv64k'] / 1024:,.0f}",
    "flop9": pct(sw["flops4k"], step["QK-norm"]["flops4k"]),
    "flop9-64k": pct(sw["flops64k"], step["QK-norm"]["flops64k"]),
    "p10": f"{step['MoE + shared']['total']:,}",
    "a10": f"{step['MoE + shared']['active']:,}",
    "a10pct": pct(step["MoE + shared"]["active"], sw["active"]),
    "gate": f"{og['total'] - step['MoE + shared']['total']:,}",
    "dn-params": f"{dn['total'] - og['total']:,}",
    "kvtok12": f"{dn['kv_per_token']:,}",
    "kv11": f"{og['kv4k'] / 1024:,.0f}",
    "kv12": f"{dn['kv4k'] / 1024:,.0f}",
    "kv11-64k": f"{og['kv64k'] / 1024:,.0f}",
    "kv12-64k": f"{dn['kv64k'] / 1024:,.0f}",
    "dn-state": f"{n_lin * state:,}",
    "sw-window": f"{window:,}",
    "dn-flop-up": f"{dn['flops4k'] / og['flops4k'] - 1:+.1%}",
    "p-more": f"{last['total'] / first['total'] - 1:.0%}",
    "a-share": pct(last["active"], first["active"]),
    "kv-div": f"{first['kv_per_token'] // last['kv_per_token']}",
    "kv64k-div": f"{first['kv64k'] / last['kv64k']:.0f}",
    "flop-share": pct(last["flops4k"], first["flops4k"]),
    "flop-share-64k": pct(last["flops64k"], first["flops64k"]),
    "untie-share": f"{V * d / last['total']:.1%}",
}.items():
    glue(f"ch14-{key}", value, display=False)

# %% [markdown]
# Read the table column by column. Through the first five steps the parameter count
# barely moves ({glue:text}`ch14-p0` → {glue:text}`ch14-p5`, {glue:text}`ch14-p5-change`):
# pre-LN, RMSNorm, RoPE and SwiGLU at $\tfrac83 d$ are nearly free, by design. Step 6
# drops the biases but gives the head its own matrix, {glue:text}`ch14-untie` numbers, so
# the count rises to {glue:text}`ch14-p6`; in a model with a 128k vocabulary the untied
# head is still only a few percent of the total. The cache does not move at all until
# **MQA** cuts it to a quarter ({glue:text}`ch14-kvtok0` → {glue:text}`ch14-kvtok7` bytes
# per token: one KV head instead of four). The **sliding** layers leave the per-token
# growth alone while the context is short, but at 4,096 tokens three of the four layers
# keep only 16 positions: the cache falls from {glue:text}`ch14-kv7` KiB to
# {glue:text}`ch14-kv9` KiB (at 64k: {glue:text}`ch14-kv7-64k` → {glue:text}`ch14-kv9-64k`)
# and the FLOPs per token to {glue:text}`ch14-flop9` of the step before
# ({glue:text}`ch14-flop9-64k` at 64k), since attention over thousands of keys is most
# of this small model's work. **MoE with a shared expert** adds parameters (to
# {glue:text}`ch14-p10`) while cutting the active ones to {glue:text}`ch14-a10`
# ({glue:text}`ch14-a10pct` of the step before). The **output gate** then adds
# {glue:text}`ch14-gate` parameters that every token uses.
#
# The **Gated DeltaNet** step is not free. It adds {glue:text}`ch14-dn-params`
# parameters, all of them active: a linear layer's projections, convolution, gates and
# norm outweigh the attention layer it replaces. And it undoes step 9: the three sliding
# layers become linear layers and the window is gone. Only the full layer's cache now
# grows with the context, {glue:text}`ch14-kvtok12` bytes per token, but the sliding
# windows were cheaper still: the three fixed states hold {glue:text}`ch14-dn-state`
# bytes where the three 16-token windows held {glue:text}`ch14-sw-window`, so the cache
# grows from {glue:text}`ch14-kv11` to {glue:text}`ch14-kv12` KiB at 4k (and from
# {glue:text}`ch14-kv11-64k` to {glue:text}`ch14-kv12-64k` at 64k), and the FLOPs per
# token move by {glue:text}`ch14-dn-flop-up`. What the linear layers buy over a window is
# not a smaller cache but a memory of the whole past in a fixed state
# ({doc}`chapter 11 <11_linear_attention>`); the probe below asks whether the small
# models use it. Last, **partial RoPE** costs nothing the table counts: a rotation has
# no weights and caches nothing, so row 13 repeats row 12.
#
# From first row to last: {glue:text}`ch14-p-more` more parameters, yet
# {glue:text}`ch14-a-share` of the 2017 model's active ones per token, 1/{glue:text}`ch14-kv-div`
# of the cache growth per token (1/{glue:text}`ch14-kv64k-div` of the whole cache at
# 64k), and
# {glue:text}`ch14-flop-share` of the FLOPs at 4k ({glue:text}`ch14-flop-share-64k` at
# 64k).
#
# ## Does quality care?
#
# The table is exact; quality has to be measured. Every step is trained twice, each time
# with three seeds (seed $s$ fixes the initialisation and the batches, the same for
# every step of the morph, so the runs are paired):
#
# - **language modelling**: the same Shakespeare character windows in the same order, the
#   same AdamW and cosine schedule, {glue:text}`ch14-lm-steps` steps of
#   {glue:text}`ch14-lm-batch` windows, then the loss on held-out text. The learning rate,
#   $3\cdot10^{-3}$ after a short warmup, is fixed for all steps: it is one the 2017
#   post-LN model trains at ({doc}`chapter 6 <06_normalization>` shows what post-LN does
#   at a higher rate without warmup), and a per-step sweep would multiply a budget that
#   has no room for it;
# - **a needle probe** ({doc}`chapter 9 <09_sliding_windows>`): {glue:text}`ch14-n-len`
#   tokens of filler with one marked token somewhere, to be named at the last position,
#   trained at every distance for {glue:text}`ch14-n-steps` steps and scored on needles
#   {glue:text}`ch14-far` tokens back, beyond the {glue:text}`ch14-reach` tokens that
#   three sliding layers of window 16 can see, and, for contrast, 1 to 15 back. A stack
#   that keeps one full layer (or a state that remembers) can answer far needles; three
#   sliding layers alone could not.
#
# ```{admonition} Reading the numbers
# :class: note
# The runs below are small and short. A ± is a 95 % interval over seeds, on the paired
# differences where runs share seeds and batches; a difference is claimed only when that
# interval excludes zero, and a null says these seeds cannot tell the two apart. The
# {ref}`preface <reading-the-numbers>` says what follows from that.
# ```

# %% tags=["hide-input"]
ids = torch.tensor(chars.encode(text))
train_ids, val_ids = split_tokens(ids, 0.1)
SEEDS = range(5) if FULL else range(3)
BATCH, STEPS, LR = (64, 2000, 3e-3) if FULL else (16, 40, 3e-3)
EVAL_EVERY = 100 if FULL else 8
val_batches = [
    sample_windows(val_ids, 256, SEQ, torch.Generator().manual_seed(500 + i), DEVICE)
    for i in range(2)
]
curve_batch = [
    sample_windows(val_ids, 64, SEQ, torch.Generator().manual_seed(600), DEVICE)
]
counts = torch.bincount(train_ids, minlength=chars.vocab_size).double()
unigram_loss = -(counts / counts.sum()).clamp_min(1e-12).log()[val_ids].mean().item()
# the needle: T positions, trained at every distance, scored beyond the sliding reach
# the sliding layers of window 16 see this far back, together
REACH = n_sw * (16 - 1)
N_T, N_NEEDLES, N_FILLER = REACH + 3, 8, 8
N_BATCH, N_STEPS, N_LR = (64, 400, 3e-3) if FULL else (16, 48, 1e-2)
FAR, NEAR = (REACH + 1, N_T - 1), (1, 15)
needle_test = {
    span: needle(
        256, N_T, span, N_NEEDLES, N_FILLER, torch.Generator().manual_seed(700)
    )
    for span in (FAR, NEAR)
}


def lm_run(cfg: ModelConfig, seed: int) -> tuple[float, History]:
    """Held-out loss and the training history (loss per step, held-out loss every
    EVAL_EVERY steps) of one seed: the init seeded by `seed`, the batches too, the
    same for every step of the morph (paired)."""
    seed_everything(seed)
    model = DecoderLM(cfg).to(DEVICE)
    windows = torch.Generator().manual_seed(1 + seed)
    hist = train(
        model,
        lambda step, g=windows: sample_windows(train_ids, BATCH, SEQ, g, DEVICE),
        STEPS,
        make_adamw(model, lr=LR),
        lr_at=lambda s: cosine_lr(
            s, LR, warmup=STEPS // 10, total=STEPS, min_lr=LR / 10
        ),
        eval_fn=lambda: evaluate(model, curve_batch),
        eval_every=EVAL_EVERY,
    )
    return evaluate(model, val_batches), hist


def needle_run(cfg: ModelConfig, seed: int) -> dict[tuple[int, int], float]:
    """Accuracy on the needle, far and near, of the step's block trained on it."""
    seed_everything(seed)
    vocab = needle_vocab(N_NEEDLES, N_FILLER)
    model = DecoderLM(cfg.replace(vocab_size=vocab, max_seq_len=N_T)).to(DEVICE)
    fit(
        model,
        lambda g: needle(N_BATCH, N_T, (1, N_T - 1), N_NEEDLES, N_FILLER, g),
        N_STEPS,
        N_LR,
        seed=seed,
        warmup=N_STEPS // 10,
    )
    return {span: accuracy(model, *needle_test[span]) for span in needle_test}


runs = [[lm_run(cfg, s) for s in SEEDS] for cfg in configs]
probe = [[needle_run(cfg, s) for s in SEEDS] for cfg in configs]
loss = [spread([r[0] for r in step]) for step in runs]
far = [spread([p[FAR] for p in step]) for step in probe]
near = [spread([p[NEAR] for p in step]) for step in probe]
# a step against the one before: the paired difference and its 95 % interval,
# "−" / "+" where the interval lies below / above zero, "·" where it holds zero
MARK = {-1: "−", 0: "·", 1: "+"}
dl = [None] + [difference(loss[i].values, loss[i - 1].values) for i in range(1, 14)]
df = [None] + [difference(far[i].values, far[i - 1].values) for i in range(1, 14)]
d_loss, d_far = ([0] + [d.verdict for d in ds[1:]] for ds in (dl, df))
print(f"unigram: {unigram_loss:.2f} nats/char; needle chance: {1 / N_NEEDLES:.3f}")
print(
    f"{'':<18}{'held-out loss':>14}{'Δ, 95 %':>15}{'needle far':>14}{'Δ, 95 %':>13}"
)
for i, name in enumerate(names):
    print(
        f"{i:>2} {name:<15}{loss[i].format(3):>14}"
        f"{dl[i].format(3) if i else '':>15} {MARK[d_loss[i]]}"
        f"{far[i].format(2):>12}{df[i].format(2) if i else '':>13} {MARK[d_far[i]]}"
    )
assert all(s.mean < unigram_loss for s in loss[1:])  # every later mean beats unigram

# %% tags=["hide-input", "remove-output"]
fig = plt.figure(figsize=(11, 8.6))
top, bottom = fig.subfigures(2, 1, height_ratios=[2.9, 1.25])
axs = top.subplots(3, 5, sharex=True, sharey=True)
smooth = np.ones(5) / 5  # a five-step running mean of the training loss
tx = np.arange(5, STEPS + 1)
train_c = [
    np.convolve(np.mean([h.loss for _, h in sr], axis=0), smooth, "valid")
    for sr in runs
]
held = [np.mean([h.eval_loss for _, h in sr], axis=0) for sr in runs]
at = np.array(runs[0][0][1].eval_step) + 1
for i, ax in enumerate(axs.flat[: len(runs)]):
    ax.axhline(unigram_loss, color="grey", ls=":", lw=1)
    if i > 1:
        ax.plot(tx, train_c[0], color="0.8", lw=1)
    if i > 0:
        ax.plot(tx, train_c[i - 1], color="0.45", lw=1.2, ls="--")
    ax.plot(tx, train_c[i], color=PALETTE[0], lw=1.8)
    ax.plot(at, held[i], "o", color=PALETTE[1], ms=3.5)
    ax.set_title(f"{i} {names[i]}")
low = min(min(c.min() for c in train_c), min(h.min() for h in held))
ax.set_ylim(low - 0.05, unigram_loss + 0.6)  # the first steps lie above: cut off
for ax in axs[:, 0]:
    ax.set_ylabel("loss (nats/char)")
for ax in axs[-1]:
    ax.set_xlabel("training step")
key = axs.flat[-1]
key.axis("off")
for style, label in (
    ({"color": PALETTE[0], "lw": 1.8}, "this step, training"),
    ({"color": PALETTE[1], "marker": "o", "ls": "", "ms": 3.5},
     "this step, held-out"),
    ({"color": "0.45", "lw": 1.2, "ls": "--"}, "step before, training"),
    ({"color": "0.8", "lw": 1}, "2017, training"),
    ({"color": "grey", "ls": ":", "lw": 1}, "unigram baseline"),
):
    key.plot([], [], **style, label=label)
key.legend(loc="center")
top.suptitle("How fast does each step of the morph learn? (mean of seeds)")
ax_end, ax_d = bottom.subplots(1, 2)
x = np.arange(len(runs))
for i, s in enumerate(loss):
    ax_end.scatter([i] * len(s.values), s.values, color=PALETTE[0], s=10, zorder=3)
ax_end.errorbar(x, [s.mean for s in loss], [s.sd for s in loss], fmt="_",
                color="black", ms=10, capsize=2)  # fmt: skip
ax_end.axhline(unigram_loss, color="grey", ls=":", lw=1)
ax_end.set_xticks(x, [str(i) for i in x])
ax_end.set(xlabel="step of the morph", ylabel="nats/char",
           title="final held-out loss: seeds, mean ± sd")  # fmt: skip
# the table's Δ column: green below zero, purple above, grey where it holds zero
shade = {-1: PALETTE[2], 0: "0.5", 1: PALETTE[3]}
ax_d.axhline(0, color="black", lw=0.8)
for i in range(1, len(runs)):
    ax_d.errorbar(i, dl[i].mean, dl[i].half_width, fmt="o",
                  color=shade[d_loss[i]], ms=4, capsize=2)  # fmt: skip
ax_d.set_xticks(x[1:], [str(i) for i in x[1:]])
ax_d.set(xlabel="step of the morph", ylabel="Δ nats/char",
         title="change vs the step before: paired 95 % interval")  # fmt: skip
glue("fig-morph-curves", fig)
plt.close(fig)

# %% [markdown]
# ```{glue:figure} fig-morph-curves
# :name: fig-morph-curves
#
# The fourteen models' loss, mean over three paired seeds. Top, one panel per step of
# the morph: its training loss (a five-step running mean, blue) and its held-out loss on
# one batch of held-out windows every eight steps (orange dots), against the step before
# (dashed) and the 2017 decoder (light grey); the dotted line is the unigram baseline,
# and losses more than 0.6 nats above it, the first few steps, are cut off. Bottom left: the final
# held-out loss of each seed (dots) with the mean ± sd (black). Bottom right: the table's
# Δ column, each step's mean paired difference from the step before with its 95 %
# interval, green where the interval lies below zero, purple above, grey where it holds
# zero. The curves are short: what they compare is how fast each model gets going, not
# where it would end.
# ```

# %% tags=["hide-input"]
# i_full: the last all-full step
i_rope, i_full = names.index("RoPE"), names.index("QK-norm")
i_sw, i_og = names.index("sliding 3:1"), names.index("output gate")
i_dn = names.index("DeltaNet 3:1")


def listed(idx: list[int]) -> str:
    """Steps by number and name, for the prose ("none" if there are none)."""
    return ", ".join(f"{i} ({names[i]})" for i in idx) or "none"


moved = [i for i in range(1, 14) if d_loss[i] != 0]
moved_late = [i for i in moved if i > i_rope]
moved_far = [i for i in range(1, 14) if d_far[i] != 0]
# claims, each a paired 95 % interval over the three seeds that excludes zero
# the 2017 decoder ends below the unigram baseline by less than its seed spread
assert 0 < unigram_loss - loss[0].mean < loss[0].sd
d_last = difference(loss[-1].values, loss[0].values)
assert d_last.verdict == -1  # after these steps the hybrid's loss is below 2017's
# the all-full modern block of step 8 finds far needles better than the 2017 one
d_full = difference(far[i_full].values, far[0].values)
assert d_full.verdict == 1
fall = loss[0].mean - min(s.mean for s in loss)
assert loss[0].mean - loss[i_rope].mean > 0.7 * fall  # most of the fall by step 4
# the needle: with three sliding layers the short run no longer finds far needles
d_sw = difference(far[i_sw].values, far[i_full].values)
assert d_sw.verdict == -1
sw_vs_full = d_sw.verdict
i_mqa = names.index("MQA")
# the far needle at the MQA step, a sentence whichever way the rule falls
mqa_moves = (
    f"far accuracy {'rises' if df[i_mqa].mean > 0 else 'falls'} from "
    f"{far[i_mqa - 1].mean:.2f} to {far[i_mqa].mean:.2f} ({df[i_mqa].format(2)})"
)
mqa_text = (
    f"The rule also flags MQA, whose {mqa_moves}; we have no mechanism to offer"
    " for it."
    if d_far[i_mqa]
    else f"At the MQA step the {mqa_moves}, and the seeds cannot tell the two apart."
)
dn_vs_sw = compare(far[i_dn].values, far[i_og].values)
sw_near_far = compare(near[i_sw].values, far[i_sw].values)
VERDICT = {-1: "lower than", 0: "not distinguishable from", 1: "higher than"}
# the two verdicts no assert pins, each a whole sentence whichever way it falls
DN_VS_SW = {
    -1: "The DeltaNet model finds far needles less often than the sliding one.",
    0: "The seeds cannot tell the two apart.",
    1: "The DeltaNet model finds far needles more often than the sliding one.",
}
SW_NEAR_FAR = {
    -1: "It finds near needles less often than far ones.",
    0: "The seeds cannot tell its near needles from its far ones.",
    1: "It finds near needles more often than far ones.",
}
for key, value in {
    "lm-steps": f"{STEPS}",
    "lm-batch": f"{BATCH}",
    "n-steps": f"{N_STEPS}",
    "n-len": f"{N_T}",
    "reach": f"{REACH}",
    "far": f"{FAR[0]}–{FAR[1]}",
    "chance": f"{1 / N_NEEDLES:.3f}",
    "unigram": f"{unigram_loss:.2f}",
    "loss-2017": loss[0].format(2),
    "loss-rope": loss[i_rope].format(2),
    "loss-last": loss[-1].format(2),
    "loss-fall": f"{fall:.2f}",
    "loss-fall-rope": f"{loss[0].mean - loss[i_rope].mean:.2f}",
    "d-last": d_last.format(2),
    "d-full": d_full.format(2),
    "d-sw": d_sw.format(2),
    "mqa": mqa_text,
    "moved": listed(moved),
    "n-moved": f"{len(moved)}",
    "moved-late": listed(moved_late),
    "moved-far": listed(moved_far),
    "far-2017": far[0].format(2),
    "far-sd-max": f"{max(s.sd for s in far[1:i_full + 1]):.2f}",
    "far-full": far[i_full].format(2),
    "far-sw": far[i_sw].format(2),
    "near-sw": near[i_sw].format(2),
    "far-og": far[i_og].format(2),
    "far-dn": far[i_dn].format(2),
    "far-last": far[-1].format(2),
    "dn-vs-sw": DN_VS_SW[dn_vs_sw],
    "sw-near-far": SW_NEAR_FAR[sw_near_far],
}.items():
    glue(f"ch14-{key}", value, display=False)
for what, idx in (("loss", moved), ("needle far", moved_far)):
    line = (
        f"{what}, paired 95 % interval excludes 0 vs the step before: {listed(idx)}"
    )
    print(textwrap.fill(line, 88))
print(f"needle far, sliding 3:1 vs all-full step {i_full}: {VERDICT[sw_vs_full]}")
print(f"needle far, DeltaNet 3:1 vs sliding (step {i_og}): {VERDICT[dn_vs_sw]}")

# %% [markdown]
# The table gives each step's held-out loss and far-needle accuracy (mean ± sd over the
# seeds) and the paired difference from the step before, marked "−" or "+" where its
# interval lies below or above zero and "·" where it holds zero;
# {numref}`fig-morph-curves` draws the loss column.
#
# Read the loss column against its baseline first. The 2017 decoder ends at
# {glue:text}`ch14-loss-2017` nats per character, and a unigram model, which knows only
# how often each character occurs, scores {glue:text}`ch14-unigram`: after
# {glue:text}`ch14-lm-steps` steps, post-LN with dropout has learned hardly more than
# character frequencies. By the last step the held-out loss falls to
# {glue:text}`ch14-loss-last` (paired against the 2017 decoder, {glue:text}`ch14-d-last`
# nats), and of the largest fall, {glue:text}`ch14-loss-fall` nats,
# {glue:text}`ch14-loss-fall-rope` have happened by step 4. Against the step before, the
# loss moves at {glue:text}`ch14-n-moved` of the thirteen steps: {glue:text}`ch14-moved`;
# past RoPE, {glue:text}`ch14-moved-late`. The seeds agree on those later moves, but they are moves
# of runs that have barely left the unigram level, at one learning rate chosen for the
# 2017 model: a token that reaches only two small experts, or a layer that must first
# learn its gates and decay, may start slower and end anywhere. We report them and
# assert none of them.
#
# The needle asks one question the loss cannot. The 2017 decoder stays near chance on
# far needles ({glue:text}`ch14-far-2017`, chance {glue:text}`ch14-chance`); the
# all-full modern block of step 8 finds more of them ({glue:text}`ch14-far-full`; paired
# against 2017, {glue:text}`ch14-d-full`). With three sliding layers the model can
# still reach every position through its one full layer, yet after
# {glue:text}`ch14-n-steps` steps its far accuracy falls back to
# {glue:text}`ch14-far-sw`, lower than the all-full model's ({glue:text}`ch14-d-sw`)
# and near chance. On near needles it scores {glue:text}`ch14-near-sw`.
# {glue:text}`ch14-sw-near-far` In this budget the hybrid has not learned to route the
# needle through its one full layer. The DeltaNet step, whose linear layers could carry a needle in their state,
# scores {glue:text}`ch14-far-dn` on far needles against {glue:text}`ch14-far-og` for
# the sliding model before it. {glue:text}`ch14-dn-vs-sw` The final model, Qwen3.5's
# block, scores {glue:text}`ch14-far-last`. Steps whose far accuracy moves against the step
# before: {glue:text}`ch14-moved-far`. {glue:text}`ch14-mqa` The all-full steps scatter
# widely over seeds (sd up to {glue:text}`ch14-far-sd-max`) in a probe trained this
# briefly.
#
# What runs this small can show. A {glue:text}`ch14-lm-steps`-step loss at one fixed
# learning rate measures how fast a model gets going: a change that helps an early,
# unstable run (pre-LN, which needs little warmup; RoPE, which hands every layer relative
# positions) can show, but a faster start cannot be told from a better model in the
# limit. Changes made for cost (MQA, MoE), for stability at scale (QK-norm, the output
# gate) or for long contexts (partial RoPE) have nothing to show here; the papers cited with each step measured them
# on large models trained long. The needle, trained for {glue:text}`ch14-n-steps` steps,
# likewise measures how soon a model learns to use its reach, not whether it has it:
# every model here keeps at least one full layer and could in principle find every
# needle.
#
# ## The morph, animated
#
# {numref}`fig-morph` puts the fourteen models in a row, one frame per step. On the left is
# the model as `companion.block_diagram` draws it from that step's config: the token
# embedding and the positional signal at the bottom, the block in the middle (one column
# per kind of layer once the stack mixes kinds), the final norm and the output head at
# the top. What a step changed is outlined in red and tagged with the step's name. On the
# right, the step's parameters (total and active), its cache at 4k context and its FLOPs
# per token, each relative to the 2017 model. The title carries the step's change and the
# absolute numbers of the table above; the last frame is Qwen3.5's block at toy size.
# The held-out loss has no bar: it comes from runs too short to stand beside exact
# counts, and the quality table gives it with its intervals.

# %% tags=["hide-input", "remove-output"]
metrics = [
    ("params", "total"),
    ("active", "active"),
    ("KV @4k", "kv4k"),
    ("FLOPs @4k", "flops4k"),
]
ratios = np.array([[r[key] / rows[0][key] for _, key in metrics] for r in rows])


def diagram_limits() -> tuple[tuple[float, float], tuple[float, float]]:
    """The extent that holds every step's diagram, so that the frames do not jump."""
    scratch = plt.figure()
    ax = scratch.add_subplot()
    xs, ys = [], []
    for cfg in configs:
        ax.clear()
        block_diagram(cfg, ax=ax, changed_from=cfg)
        xs += ax.get_xlim()
        ys += ax.get_ylim()
    plt.close(scratch)
    return (min(xs), max(xs)), (min(ys), max(ys))


XLIM, YLIM = diagram_limits()
drawn = {}  # frame -> the texts its block diagram shows
# frame -> what it outlines: (first layer of the column, or -1 outside the blocks, box)
marked = {i: changed_parts(configs[i - 1], configs[i]) for i in range(1, len(configs))}


def step_title(i: int) -> str:
    r = rows[i]
    change = f"step {i}/{len(MORPH)}: {names[i]} ({components[i - 1]})"
    change += f" = the {LAST}" if i == len(MORPH) else ""
    return (
        f"{change if i else 'the 2017 decoder'}\n"
        f"{r['total']:,} params, {r['active']:,} active · "
        f"KV {r['kv_per_token']:,} B/token · "
        f"{r['flops4k'] / 1e6:.2f} MFLOP/token @4k"
    )


def draw_block(ax: plt.Axes, i: int) -> None:
    ax.clear()
    before = configs[max(i - 1, 0)]  # the 2017 frame: itself, nothing outlined
    block_diagram(configs[i], ax=ax, changed_from=before, label=names[i])
    ax.set(xlim=XLIM, ylim=YLIM)
    drawn[i] = [t.get_text() for t in ax.texts]


fig, (ax_block, ax_bars) = plt.subplots(
    1, 2, figsize=(9, 6.6), width_ratios=[2.5, 1]
)


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


glue("fig-morph", HTML(animate(fig, draw_morph, len(configs), interval_ms=2500)))
# the same frames, smaller, for the book's first page
fig_small, ax_small = plt.subplots(figsize=(5, 5.4))


def draw_small(i: int) -> None:
    draw_block(ax_small, i)
    last = f"\n= the {LAST}" if i == len(MORPH) else ""
    ax_small.set_title(f"{i}/{len(MORPH)}: {names[i]}{last}", fontsize=10)


glue("fig-morph-small", HTML(animate(fig_small, draw_small, len(configs), 2500)))
assert sorted(drawn) == list(range(14))  # a frame for every step: fourteen
# every step changes what the block diagram shows...
assert all(drawn[i] != drawn[i - 1] for i in range(1, len(configs)))
# ... from one column of full attention to the hybrid's two kinds of layer
n_linear = configs[-1].layer_types.count("linear")
assert f"all {LAYERS} layers" in drawn[0] and "Gated DeltaNet" not in drawn[0]
assert f"{n_linear} of {LAYERS} layers: 0–2" in drawn[len(configs) - 1]
assert f"{LAYERS - n_linear} of {LAYERS} layers: 3" in drawn[len(configs) - 1]
assert "Gated DeltaNet" in drawn[len(configs) - 1]
# ... and outlines what changed, with the step's name as its tag
assert all(marked[i] and names[i] in drawn[i] for i in marked)
rope, untie = names.index("RoPE"), names.index("no bias, untied")
assert {(-1, "position"), (-1, "embedding"), (0, "mixer")} <= set(marked[rope])
words = {i: " ".join(" ".join(t).split()) for i, t in drawn.items()}  # unwrapped
assert (-1, "head") in marked[untie] and "own weights" in words[untie]
# the last frame: a quarter of the full layer's head rotated, nothing else changed
i_full_layer = configs[-1].layer_types.index("full")
assert marked[len(MORPH)] == [(i_full_layer, "mixer"), (-1, "position")]
assert "rotates 0.25 of each head's q and k" in words[len(MORPH)]
assert LAST in step_title(len(MORPH))
assert ratios[-1, 2] < 0.1 and ratios[-1, 3] < 0.3 and ratios[-1, 0] > 1.2

# %% [markdown]
# ```{glue:figure} fig-morph
# :name: fig-morph
#
# What does each of the thirteen steps change, from the 2017 decoder to Qwen3.5's block at
# toy size? One change per frame, outlined in red and tagged with the step's name. Left:
# the model of each step, drawn from its `ModelConfig` (the stream runs bottom to top from
# the token embedding and positional signal to the final norm and output head, the
# residual path on the left; one column per kind of layer). Right: parameters, active
# parameters, cache at 4k context and FLOPs per token relative to the 2017 model (dashed
# line). Watch the norm move in front of the sublayers (step 1), the added sinusoid give
# way to RoPE inside attention (4), the FFN become SwiGLU (5), the biases go and the head
# get its own weights (6), the heads share one key/value head (7), the stack split into
# sliding and full layers (9), the experts arrive (10), the sliding layers become Gated
# DeltaNet (12) and RoPE shrink to a quarter of each head (13). The cache and FLOPs bars
# fall at steps 7 and 9, the parameters grow from step 10 on and the cache bar rises a
# little at step 12.
# ```

# %% [markdown]
# ## What we learned
#
# The 2026 decoder is the 2017 decoder with thirteen replacements, each a few config
# fields of one component, and the checks hold every step to exactly the fields it names,
# including the one later step that takes an earlier one out; the last block is
# Qwen3.5's, at toy size. The cost of each step is exact:
# pre-LN, RMSNorm, RoPE and SwiGLU at $\tfrac83 d$ leave the size almost unchanged; MQA
# and sliding windows cut the cache (the Gated DeltaNet step that replaces the windows
# buys a memory of the whole past, not bytes); and the experts make the final model
# store more parameters than the 2017 one while each token uses fewer. Quality we could
# measure only coarsely, with three paired seeds and runs so short that the 2017 decoder
# barely beats a unigram model: most of the fall in held-out loss comes with the first
# four changes, the final hybrid ends below the 2017 decoder, and the modern all-full block
# finds far needles that the 2017 one misses, while the sliding hybrid, this early in
# training, falls back to near chance on them. What the later steps do to the quality of a
# large model trained long, these runs cannot say; what they do to memory, parameters and
# FLOPs per token, the table shows exactly.
#
# ## Exercises
#
# 1. Move the MoE step before MQA. Which columns of the table change, and which stay the
#    same at the end?
#
# ```{admonition} Solution
# :class: dropdown
# Reorder `MORPH` and rerun. The last row is identical: the final config does not depend on
# the order of the replaces, only the intermediate rows do. The intermediate rows between
# the two steps now carry 8 experts with 4 KV heads.
# ```
#
# 2. End the morph on Kimi Linear's full layer instead: add a fourteenth step, MLA
#    (`mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
#    v_head_dim=16)` with `n_kv_heads=None`). How does the full layer's cache per token
#    compare with MQA's one head, and which checks must change?
#
# ```{admonition} Hint
# :class: dropdown
# MLA caches $r + R = 24$ numbers per layer and token, MQA's one head of 16 caches 32. The
# package's MLA layer has neither per-head QK-norm nor an output gate, so the step must
# also turn `qk_norm` and `attn_output_gate` off and name MQA, QK-norm and the output gate
# in its `replaces`. The frame count becomes fifteen, and the Qwen3.5 check fails, as it
# should: the block is no longer Qwen3.5's (nor quite Kimi Linear's, whose linear layers
# are Kimi Delta Attention).
# ```
#
# 3. Rotate half of each head at step 13, or a sixteenth. Which columns of the cost table
#    change?
#
# ```{admonition} Solution
# :class: dropdown
# None: a rotation has no weights and caches nothing, and the calculator counts no FLOPs
# for it (a few multiplications per channel beside the matrix products). Only the trained
# runs can differ, and the Qwen3.5 check fails, since Qwen3.5 rotates a quarter.
# ```
#
# 4. Set `FULL = True` on a GPU (five seeds, 2,000 steps, a 128-token context, the needle
#    trained for 400 steps). Which steps now change the loss or the needle beyond the
#    seed spread?
#
# ```{admonition} Hint
# :class: dropdown
# With a 128-token context, a 16-token window hides most of the sequence from three of
# every four layers; the one full layer in four carries the long-range information
# ({doc}`chapter 9 <09_sliding_windows>`). Expect the early steps' lead to shrink as every
# model trains longer.
# ```
#
# 5. Split step 6 in two: untied embeddings as its own step, and "no biases" folded into
#    the SwiGLU step. What does the chapter's check say?
#
# ```{admonition} Solution
# :class: dropdown
# The one-component check fails on the merged step: `bias` belongs to the linear maps and
# `ffn` to the FFN, so `(component,) = {...}` finds two components and raises. The split
# also makes fourteen steps, and the frame count check (fourteen frames) fails with it.
# ```

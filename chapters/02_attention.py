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
# # 2 · Attention
#
# ```{admonition} The question
# :class: tip
# How does attention let every token read every other token directly, and what does that cost?
# Each token scores all others by a dot product scaled by $1/\sqrt{d_k}$ (without it, wide heads saturate the softmax and its gradient vanishes) and averages their values; two attention layers formed an induction head in two of three seeds while one layer never did, and the $n \times n$ score matrix makes memory and work grow as $n^2$, which FlashAttention's tiled online softmax cuts to at most linear memory with the same outputs and gradients.
# ```
#
# A recurrent network reads a sentence one token at a time and squeezes everything it has
# seen into one state vector. Attention drops that bottleneck: every token looks at every
# other token directly, and decides for itself how much of each to take. This chapter builds
# the mechanism from nothing, measures the three facts that shaped everything after 2017 —
# why the scores are divided by $\sqrt{d_k}$, why the cost grows as $n^2$, and how
# FlashAttention computes the *same* numbers without ever storing the $n \times n$ matrix —
# and trains a small model on Shakespeare to watch real attention heads form
# {cite}`vaswani2017attention`.
#
# It then trains two-layer attention-only models until one of their heads becomes an
# *induction head*, the circuit that copies from an earlier occurrence, and tests what the
# claim "in-context learning is gradient descent" rests on, with one layer of attention
# that learns a regression rule from its prompt.

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
# no CUDA GPU: the Triton kernel near the end runs under Triton's interpreter,
# which must be switched on before anything loads Triton (torch's modules may)
from companion.kernels import interpret_on_cpu

interpret_on_cpu()

import inspect
import math
import time
from unittest import mock

import matplotlib.pyplot as plt
import torch
from IPython.display import HTML, Code
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
from torch.utils.flop_counter import FlopCounterMode

import companion.ops.tiled as tiled_ops
from companion.analysis.peak_memory import PeakMemory
from companion.analysis.seeds import difference
from companion.device import default_device, describe
from companion.kernels import interpreting, triton_available
from companion.layers.mha import MultiHeadAttention
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.ops.attention import (
    attention_weights,
    masked_scores,
    naive_attention,
    sdpa_attention,
)
from companion.ops.masks import causal_mask
from companion.ops.tiled import (
    key_tiles,
    online_softmax_trace,
    tile_scores,
    tiled_attention,
    tiled_attention_forward,
)
from companion.plotting import PALETTE, animate, glue, heatmap, loglog_fit, use_style
from companion.tasks.icl_regression import (
    LinearSelfAttention,
    best_gd_lr,
    effective_step,
    gd_construction,
    gd_step_prediction,
    least_squares_prediction,
    regression_prompts,
    train_icl_layer,
)
from companion.tasks.induction import (
    AttentionOnlyLM,
    induction_targets,
    prefix_matching_score,
    repeated_segments,
)
from companion.tasks.text import (
    CharTokenizer,
    load_bpe,
    load_shakespeare,
    sample_windows,
    split_tokens,
)
from companion.training import (
    cosine_lr,
    evaluate,
    make_adamw,
    portable_adam,
    seed_everything,
    train,
)

# FULL = True: a bigger model, longer training and longer sequences (use a GPU)
FULL = False
DEVICE = default_device() if FULL else torch.device("cpu")
use_style()
torch.set_num_threads(2)
print(describe(DEVICE))

# %% [markdown]
# ## Tokens become vectors
#
# A model never sees text. A tokenizer cuts the text into pieces and numbers them; an
# embedding table turns each number into a vector of $d$ learned values. Our tokenizer is a
# byte-level BPE with {glue:text}`ch02-bpe-size` pieces, trained on the eight Shakespeare
# plays that ship with `companion`.

# %%
bpe = load_bpe()
sentence = "To be, or not to be, that is the question"
ids = bpe.encode(sentence)
pieces = [p.replace("Ġ", "·") for p in bpe.tokens(sentence)]
print(len(ids), "tokens:", " | ".join(pieces))
print("ids:", ids)
assert bpe.decode(ids) == sentence
glue("ch02-bpe-size", f"{bpe.vocab_size:,}", display=False)

# %%
seed_everything(0)
d = 16
embedding = torch.nn.Embedding(bpe.vocab_size, d)
x = embedding(torch.tensor(ids)).detach()  # (T, d): one row per token
print("x:", tuple(x.shape))

# %% [markdown]
# ## Queries, keys and values, one step at a time
#
# Each token plays three roles. Its **query** $q_i = x_i W_Q$ says what it is looking for;
# its **key** $k_j = x_j W_K$ says what it offers to be found by; its **value**
# $v_j = x_j W_V$ is what it hands over when found. Token $i$ scores every token $j$ by the
# dot product $q_i \cdot k_j$, turns the scores into weights with a softmax, and takes the
# weighted average of the values:
#
# $$
# \operatorname{Attention}(Q, K, V) = \operatorname{softmax}\!\left(\frac{Q K^\top}{\sqrt{d_k}}\right) V .
# $$
#
# Below, the three projections are random (the model is untrained), so the point is the
# arithmetic, not the pattern; {numref}`fig-one-query` follows one query through it.

# %%
W_q, W_k, W_v = (torch.randn(d, d) / math.sqrt(d) for _ in range(3))
q, k, v = x @ W_q, x @ W_k, x @ W_v  # (T, d) each
scores = q @ k.T / math.sqrt(d)  # (T, T): row i = how well each key matches query i
weights = torch.softmax(scores, dim=-1)  # each row sums to 1
out = weights @ v  # (T, d): a weighted average of the values
print(
    "scores",
    tuple(scores.shape),
    "| first row sums",
    [round(s, 4) for s in weights.sum(-1)[:3].tolist()],
)

# the package's reference implementation computes exactly this
ref_out = naive_attention(q[None, None], k[None, None], v[None, None])
ref_w = attention_weights(q[None, None], k[None, None])
assert torch.allclose(ref_out[0, 0], out, atol=1e-6) and torch.allclose(
    ref_w[0, 0], weights
)

# %% tags=["hide-input"]
Code(
    inspect.getsource(masked_scores)
    + "\n"
    + inspect.getsource(attention_weights)
    + "\n"
    + inspect.getsource(naive_attention),
    language="python",
)

# %% tags=["remove-output", "hide-input"]
row_i = weights.max(-1).values.argmax().item()  # the most peaked row
top = weights[row_i].argmax().item()
fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.4), sharex=True)
for ax, vals, title, ylabel in (
    (axes[0], scores[row_i], "1. scores q·k/√d: any sign", "score"),
    (axes[1], weights[row_i], "2. softmax: positive, sum to 1", "weight"),
):
    ax.bar(range(len(pieces)), vals.numpy(), color=PALETTE[0])
    ax.bar([top], [vals[top].item()], color=PALETTE[1])  # the largest
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(pieces)), pieces, rotation=90)
    ax.set(title=title, ylabel=ylabel, xlabel="key token")
    ax.grid(axis="x", visible=False)
axes[1].annotate(
    f"{weights[row_i, top]:.2f}",
    (top, weights[row_i, top].item()),
    xytext=(0, 2),
    textcoords="offset points",
    ha="center",
    va="bottom",
)
axes[1].set_ylim(0, 1.12 * weights[row_i].max().item())
fig.suptitle(f"How does one query, «{pieces[row_i]}», turn its scores into weights?")
glue("fig-one-query", fig)
plt.close(fig)
glue("ch02-one-query", pieces[row_i], display=False)
glue("ch02-one-query-top", pieces[top], display=False)
glue("ch02-one-query-w", f"{weights[row_i, top]:.2f}", display=False)

# %% [markdown]
# ```{glue:figure} fig-one-query
# :name: fig-one-query
#
# One row of the computation above: the query «{glue:text}`ch02-one-query`» (the row
# with the most peaked weights) against every key of the sentence. Left: its scaled
# dot products with each key, of either sign. Right: their softmax, the row of `weights`.
# Exponentiating keeps the order of the scores and makes every weight positive; dividing
# by the sum makes the row sum to 1. The largest score (orange, key
# «{glue:text}`ch02-one-query-top`») takes {glue:text}`ch02-one-query-w` of the weight,
# and this query's output is the average of the value rows with these weights. The
# projections are random, so which key wins means nothing yet.
# ```

# %% [markdown]
# ## Why divide by $\sqrt{d_k}$?
#
# If the entries of $q$ and $k$ are independent with variance 1, the dot product
# $q \cdot k = \sum_{m=1}^{d_k} q_m k_m$ is a sum of $d_k$ such products: its variance is
# $d_k$. Wide heads therefore produce large scores, and a softmax of large numbers is
# nearly one-hot. A one-hot softmax has an almost-zero Jacobian
# $\partial p / \partial s = \operatorname{diag}(p) - p p^\top$: gradients stop flowing
# through the weights and the head cannot learn where to look. Dividing by $\sqrt{d_k}$
# brings the variance back to 1 whatever the width. Let us measure all three quantities:
# the spread of the scores, the largest weight of each softmax row, and the size (Frobenius
# norm) of the Jacobian for a typical row, over 256 random queries against 64 keys.

# %% tags=["hide-input"]
gen = torch.Generator().manual_seed(0)
n_keys, trials = 64, 256
rows = []
for d_k in [4, 16, 64, 256, 1024]:
    qs = torch.randn(trials, d_k, generator=gen)
    ks = torch.randn(trials, n_keys, d_k, generator=gen)
    raw = torch.einsum("td,tnd->tn", qs, ks)  # (trials, n_keys)
    for is_scaled in (False, True):
        s = raw / math.sqrt(d_k) if is_scaled else raw
        p = torch.softmax(s, dim=-1)
        jac = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]  # ∂p/∂s per trial
        rows.append(
            {
                "d_k": d_k,
                "scaled": is_scaled,
                "score_std": s.std().item(),
                "max_weight": p.max(-1).values.mean().item(),
                "jacobian_norm": torch.linalg.matrix_norm(jac)
                .median()
                .item(),  # typical row
            }
        )
print(
    f"{'d_k':>5} {'scaled':>7} {'std(score)':>11} {'max weight':>11} "
    f"{'median ‖∂p/∂s‖':>15}"
)
for r in rows:
    print(
        f"{r['d_k']:>5} {r['scaled']!s:>7} {r['score_std']:>11.2f} "
        f"{r['max_weight']:>11.3f} {r['jacobian_norm']:>15.4f}"
    )

# %% tags=["hide-input"]
unscaled = [r for r in rows if not r["scaled"]]
scaled = [r for r in rows if r["scaled"]]
# the claim: unscaled score spread grows like sqrt(d_k); scaled stays near 1
for r in unscaled:
    assert abs(r["score_std"] / math.sqrt(r["d_k"]) - 1) < 0.1
assert all(abs(r["score_std"] - 1) < 0.1 for r in scaled)
# ... so without the scale the softmax saturates and its gradient collapses
assert unscaled[-1]["max_weight"] > 0.9 and scaled[-1]["max_weight"] < 0.3
assert unscaled[-1]["jacobian_norm"] < 0.01 * scaled[-1]["jacobian_norm"]
assert max(r["jacobian_norm"] for r in scaled) < 1.5 * min(
    r["jacobian_norm"] for r in scaled
)

# %% tags=["hide-input"]
fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.2))
dks = [r["d_k"] for r in scaled]
for data, label, style in ((unscaled, "q·k", "o--"), (scaled, "q·k / √d_k", "o-")):
    axes[0].plot(dks, [r["max_weight"] for r in data], style, label=label)
    axes[1].plot(dks, [r["jacobian_norm"] for r in data], style, label=label)
axes[0].set(
    xscale="log",
    xlabel="head width d_k",
    ylabel="mean largest weight",
    title="Softmax saturates without the scale",
)
axes[1].set(
    xscale="log",
    yscale="log",
    xlabel="head width d_k",
    ylabel="median ‖∂softmax/∂scores‖",
    title="…and its gradient vanishes",
)
axes[0].legend()
plt.show()

# %% [markdown]
# ## The causal mask
#
# A language model predicts token $t+1$ from tokens $1..t$, and it is trained on all
# positions of a sequence at once. Position $i$ must therefore not see keys $j > i$: we set
# those scores to $-\infty$ before the softmax, so their weights are exactly zero. In
# `companion` a mask is a boolean tensor, `True` where attention is allowed.

# %%
T = len(ids)
print(causal_mask(T)[:5, :5].int())
out_c = naive_attention(q[None, None], k[None, None], v[None, None], causal=True)
w_c = attention_weights(q[None, None], k[None, None], causal=True)
assert w_c[0, 0].triu(1).abs().max() == 0  # no weight on the future

# change the last token's vector: no earlier output may move
x2 = x.clone()
x2[-1] += 10.0
q2, k2, v2 = x2 @ W_q, x2 @ W_k, x2 @ W_v
out_c2 = naive_attention(q2[None, None], k2[None, None], v2[None, None], causal=True)
assert torch.allclose(out_c2[0, 0, :-1], out_c[0, 0, :-1])
assert not torch.allclose(out_c2[0, 0, -1], out_c[0, 0, -1])
print("outputs before the changed token unchanged; the last one changed")

# %% [markdown]
# ## Many heads
#
# One softmax can only express one way of mixing the sequence. Multi-head attention splits
# the width $d$ into $H$ heads of width $D = d/H$, runs attention in each independently, and
# concatenates the results before a final projection $W_O$. The parameter count is the same
# as one wide head ($4d^2$ plus biases); what changes is that each head gets its own
# softmax. Here are the module's three steps, with one fused matrix producing $q$, $k$ and
# $v$: `project` maps the stream, `heads` splits the width, `attend` runs the heads and
# concatenates them; the forward pass ends with the output projection $W_O$ (`out_proj`).

# %% tags=["hide-input"]
Code(
    inspect.getsource(MultiHeadAttention.project)
    + "\n"
    + inspect.getsource(MultiHeadAttention.heads)
    + "\n"
    + inspect.getsource(MultiHeadAttention.attend),
    language="python",
)

# %%
mha = MultiHeadAttention(d_model=64, n_heads=4, causal=True)
xb = torch.randn(2, 10, 64)  # (B, T, d)
qh, kh, vh = (mha.heads(t, 4) for t in mha.project(xb))
print(
    "x",
    tuple(xb.shape),
    "-> q, k, v per head",
    tuple(qh.shape),
    "-> out",
    tuple(mha(xb).shape),
)
assert qh.shape == (2, 4, 10, 16)
assert sum(p.numel() for p in mha.parameters()) == 4 * 64 * 64 + 4 * 64

# %% [markdown]
# ### Training a small model to watch heads specialise
#
# A two-layer, four-head decoder trained for a few hundred steps on the plays is enough for
# heads to stop being uniform, and for the two layers to read differently. To learn
# quickly on a CPU it reads *characters* ({glue:text}`ch02-n-chars` distinct ones) rather
# than BPE pieces. While it trains we keep a snapshot of one head's attention (layer 1,
# head 4) on a short line at regular intervals.

# %% tags=["hide-input"]
seed_everything(0)
text = load_shakespeare()
chars = CharTokenizer(text)
tokens = torch.tensor(chars.encode(text))
train_ids, val_ids = split_tokens(tokens, 0.1)
steps, seq_len, batch = (3000, 256, 64) if FULL else (600, 64, 32)
cfg = ModelConfig(
    vocab_size=chars.vocab_size,
    d_model=128 if FULL else 64,
    n_layers=2,
    n_heads=4,
    max_seq_len=seq_len,
    position="learned",
    norm_placement="pre",
    attn_impl="sdpa",
)
model = DecoderLM(cfg).to(DEVICE)
glue("ch02-n-chars", f"{chars.vocab_size}", display=False)
gen = torch.Generator().manual_seed(0)
val_batches = [
    sample_windows(val_ids, 32, seq_len, torch.Generator().manual_seed(i), DEVICE)
    for i in range(4)
]
line = "To be, or not to be"
line_chars = list(line)
probe = torch.tensor([chars.encode(line)], device=DEVICE)
snapshots = [
    model.attention_maps(probe)[0][0, 3].cpu()
]  # layer 1, head 4, before training


def eval_and_snapshot() -> float:
    snapshots.append(model.attention_maps(probe)[0][0, 3].cpu())
    return evaluate(model, val_batches)


hist = train(
    model,
    lambda step: sample_windows(train_ids, batch, seq_len, gen, DEVICE),
    steps,
    make_adamw(model, lr=1e-2, weight_decay=0.1),
    lr_at=lambda s: cosine_lr(s, 1e-2, warmup=steps // 10, total=steps, min_lr=1e-3),
    eval_fn=eval_and_snapshot,
    eval_every=steps // 8,
)
unigram = torch.bincount(
    train_ids, minlength=chars.vocab_size
).float() / len(train_ids)
unigram_loss = -(unigram[val_ids] + 1e-12).log().mean().item()
print(
    f"validation loss {hist.eval_loss[-1]:.2f} nats/char; "
    f"unigram baseline {unigram_loss:.2f}"
)
assert (
    hist.eval_loss[-1] < unigram_loss - 0.8
)  # it learned far more than letter frequencies

# %% [markdown]
# Before training, every head is uniform over the visible prefix: each row spreads its
# weight over the characters so far. {numref}`fig-heads` shows all eight heads of the
# trained model on the same line. The two rows differ; within the second row,
# the heads look alike (the statistics below measure how far).

# %% tags=["remove-output", "hide-input"]
maps = model.attention_maps(probe)
shown = [c if c != " " else "␣" for c in line]  # a visible space
fig, axes = plt.subplots(2, 4, figsize=(11.5, 6.4), sharex=True, sharey=True)
for layer in range(2):
    for head in range(4):
        ax = axes[layer, head]
        heatmap(
            ax,
            maps[layer][0, head].cpu().numpy(),
            title=f"layer {layer + 1} · head {head + 1}",
            vmax=1.0,
        )
        ax.set_xticks(range(len(shown)), shown, fontsize=8)
        ax.set_yticks(range(len(shown)), shown, fontsize=8)
        ax.tick_params(length=0)
for ax in axes[1]:
    ax.set_xlabel("key (character read)")
for ax in axes[:, 0]:
    ax.set_ylabel("query (character reading)")
fig.colorbar(axes[0, 0].images[0], ax=axes, label="attention weight", shrink=0.6)
fig.suptitle(
    "Which characters does each trained head read?"
    " Layer 1: the last few; layer 2: the whole line"
)
glue("fig-heads", fig)
plt.close(fig)

# %% [markdown]
# ```{glue:figure} fig-heads
# :name: fig-heads
#
# The attention weights of all eight heads of the trained model on the line «To be, or not
# to be» (␣ marks a space): one row per query character, one column per key character it
# reads, on one colour scale from 0 to 1; the cells above the diagonal are the masked
# future. Top row, layer 1: narrow bands on and just below the diagonal, the last few
# characters. Bottom row, layer 2: weight spread over the whole prefix, with a few
# brighter cells. The first query can only read itself, hence the bright corner.
# ```

# %% [markdown]
# Do the heads really differ? Three summaries of a head, measured on held-out text. *How
# far back it looks*: the average distance $\sum_j w_{ij}\,(i-j)$ between a query and the
# keys it attends to. *How much weight it puts on the immediately preceding character.*
# And *how spread out it is*: the entropy $-\sum_j w_{ij} \log w_{ij}$ of each row, as a
# fraction of $\log(i+1)$, the entropy of a uniform row over the $i+1$ visible keys. The
# look-back alone cannot tell a head that reads far back from one that reads everything:
# a uniform head over the visible prefix of {glue:text}`ch02-seq-len` characters looks
# back {glue:text}`ch02-uniform-lookback` on average. A head that reads selectively far
# back has a large look-back *and* an entropy well below uniform; a broad head has both
# near their uniform values.


# %% tags=["hide-input"]
def head_summary(m: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per head ``(H,)``: mean look-back, weight on the previous token, and the row
    entropy as a fraction of the uniform row's, from weights ``(B, H, T, T)``."""
    t = m.shape[-1]
    pos = torch.arange(t, device=m.device)
    dist = (pos[:, None] - pos[None, :]).clamp(min=0).float()  # (T, T)
    look = (m * dist).sum(-1).mean(dim=(0, 2))
    prev = torch.diagonal(m, offset=-1, dim1=-2, dim2=-1).mean(dim=(0, 2))
    ent = -(m * m.clamp(min=1e-30).log()).sum(-1)  # (B, H, T)
    # row 0 has 1 key: skip it
    frac = (ent[..., 1:] / (pos[1:] + 1).float().log()).mean(dim=(0, 2))
    return look, prev, frac


xv = val_batches[0][0]
t_val = xv.shape[1]
uniform = torch.tril(torch.ones(t_val, t_val)) / torch.arange(1, t_val + 1)[:, None]
u_look, _, u_frac = head_summary(uniform[None, None])
head_stats = []
for layer, m in enumerate(model.attention_maps(xv)):
    for h, (lb, pv, fr) in enumerate(zip(*head_summary(m), strict=True)):
        head_stats.append((layer + 1, h + 1, lb.item(), pv.item(), fr.item()))
print("layer head  look-back  weight on previous  entropy / uniform")
for layer, h, lb, pv, fr in head_stats:
    print(f"{layer:>5} {h:>4} {lb:>10.1f} {pv:>19.2f} {fr:>18.2f}")
print(f"  uniform {u_look.item():>10.1f} {'':>19} {u_frac.item():>18.2f}")
glue("ch02-seq-len", f"{t_val}", display=False)
glue("ch02-uniform-lookback", f"{u_look.item():.2f}", display=False)
# %% tags=["hide-input"]
stats = {la: [r for r in head_stats if r[0] == la] for la in (1, 2)}
u_look, u_frac = u_look.item(), u_frac.item()
# layer 1: local heads, far narrower than uniform, one leaning on the previous char
assert max(r[2] for r in stats[1]) < 0.3 * u_look
assert max(r[3] for r in stats[1]) > 0.3
assert min(r[4] for r in stats[1]) < 0.5 * u_frac
# layer 2: looks back about as far as a uniform head (so the look-back cannot tell
# them apart), but the entropy can: broad, yet measurably more selective than
# uniform
assert all(abs(r[2] / u_look - 1) < 0.15 for r in stats[2])
assert all(0.6 < r[4] < 0.9 for r in stats[2])
# the snapshotted head: uniform before training, far from it after
snap_frac = [head_summary(m[None, None])[2].item() for m in snapshots]
assert snap_frac[0] > 0.99 and snap_frac[-1] < 0.7
for la in (1, 2):
    for i, col in ((2, "look"), (4, "ent")):
        vals = [r[i] for r in stats[la]]
        glue(
            f"ch02-l{la}-{col}",
            f"{min(vals):.2f} to {max(vals):.2f}",
            display=False
        )
glue("ch02-l1-prev-max", f"{max(r[3] for r in stats[1]):.2f}", display=False)
glue("ch02-snap-ent", f"{snap_frac[0]:.2f} to {snap_frac[-1]:.2f}", display=False)

# %% [markdown]
# The first layer's heads are local: they look back {glue:text}`ch02-l1-look` characters
# on average, with an entropy of {glue:text}`ch02-l1-ent` of the uniform one, and one puts
# {glue:text}`ch02-l1-prev-max` of its weight on the previous character. The second
# layer's heads look back {glue:text}`ch02-l2-look` characters, about what a uniform head
# would; by that measure alone they could be averaging the whole line. Their entropy
# ({glue:text}`ch02-l2-ent` of uniform) says they are broad but not uniform: they read the
# whole prefix with preferences, not a few far-away characters. By these three measures
# the four second-layer heads are alike: the bottom row of {numref}`fig-heads` shows four
# versions of one broad pattern, not four different jobs. Long-range specialists
# (heads with a large look-back *and* a low entropy) do not appear in this small, briefly
# trained model. The snapshots of layer 1's head 4 show the sharpening: its entropy fell
# from {glue:text}`ch02-snap-ent` of uniform during training.

# %% [markdown]
# (ch02-induction)=
# ### Induction heads: two layers that copy
#
# One kind of head matters more than the others for how language models use their context.
# Anthropic's interpretability team found it in two-layer attention-only models
# {cite}`elhage2021mathematical` and named it the *induction head*: at a token it has seen
# before, it attends to the token that *followed* the earlier occurrence and copies it, so
# that "… Harry Potter … Harry" predicts "Potter". One layer cannot do this. The head must
# find the key whose *previous* token matches the current one, and a key only knows its
# previous token if a head in an earlier layer has written it there (a previous-token
# head). Olsson et al. later tied the sudden appearance of these heads during training to
# the onset of in-context learning in larger models {cite}`olsson2022induction`.
#
# A task that only induction can solve: a random segment of $P$ tokens repeated until the
# sequence is full, with $P$ drawn afresh for every sequence, so that no fixed offset finds
# the copy. Past the first period every token is predictable, but only by looking up where
# the current token occurred before. The *prefix-matching score* of a head is the weight a
# query in the repeat puts on the keys that follow earlier occurrences of its token. We
# train attention-only models (`companion.tasks.induction.AttentionOnlyLM`: embeddings,
# two-head attention layers with residuals and norms, no feed-forward network) with two
# layers and with one, three seeds each, and score every head of the last layer on held-out
# sequences; the untrained two-layer model is the baseline. Positions enter through RoPE
# ({doc}`chapter 5 <05_position>`), under which "the previous token" is one and the same
# pattern at every position, an easy thing for a first-layer head to learn.

# %%
Code(inspect.getsource(prefix_matching_score), language="python")

# %% tags=["hide-input"]
IND = {"vocab": 64, "seq_len": 32, "periods": (6, 16), "d_model": 32, "heads": 2}
IND |= {"steps": 600, "batch": 32, "lr": 2e-2}
IND_SEEDS = (0, 1, 2)
ind_eval, ind_periods = repeated_segments(
    256,
    IND["seq_len"],
    IND["periods"],
    IND["vocab"],
    torch.Generator().manual_seed(99)
)


def induction_model(n_layers: int, seed: int, steps: int) -> AttentionOnlyLM:
    seed_everything(seed)
    net = AttentionOnlyLM(
        IND["vocab"], IND["d_model"], n_layers, IND["heads"], IND["seq_len"]
    )
    data = torch.Generator().manual_seed(100 + seed)
    opt = torch.optim.AdamW(
        net.parameters(),
        lr=IND["lr"],
        weight_decay=0.0,
        **portable_adam(net.parameters()),
    )
    for _ in range(steps):
        ids, _ = repeated_segments(
            IND["batch"], IND["seq_len"], IND["periods"], IND["vocab"], data
        )
        loss = torch.nn.functional.cross_entropy(
            net(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten()
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return net


@torch.no_grad()
def induction_summary(net: AttentionOnlyLM) -> tuple[float, float]:
    """The last layer's best prefix-matching score, and the loss (nats) on the tokens
    that only a copy can predict (a query in the repeat)."""
    score = prefix_matching_score(net(ind_eval, maps=True)[-1], ind_periods).max()
    logp = torch.log_softmax(net(ind_eval)[:, :-1], dim=-1)
    nll = -logp.gather(-1, ind_eval[:, 1:, None])[..., 0]  # (B, T-1)
    in_repeat = torch.arange(IND["seq_len"] - 1)[None] >= ind_periods[:, None]
    return score.item(), nll[in_repeat].mean().item()


ind_names = ["two layers, untrained", "one layer, trained", "two layers, trained"]
ind_nets, ind_rows = {}, {}
torch.set_num_threads(1)  # small matrices: a second thread only waits
for seed in IND_SEEDS:
    for name, n_layers, steps in zip(
        ind_names, (2, 1, 2), (0, IND["steps"], IND["steps"]), strict=True
    ):
        ind_nets[name, seed] = induction_model(n_layers, seed, steps)
        ind_rows[name, seed] = induction_summary(ind_nets[name, seed])
torch.set_num_threads(2)
print(f"{'':>22}" + "".join(f"{'seed ' + str(s):>14}" for s in IND_SEEDS))
print(f"{'':>22}" + "".join(f"{'score':>7}{'nats':>7}" for _ in IND_SEEDS))
for name in ind_names:
    cells = "".join(
        f"{ind_rows[name, s][0]:>7.2f}{ind_rows[name, s][1]:>7.2f}"
        for s in IND_SEEDS
    )
    print(f"{name:>22}{cells}")
print(f"uniform guess: {math.log(IND['vocab']):.2f} nats")

# %% tags=["hide-input"]
ind_score = {n: [ind_rows[n, s][0] for s in IND_SEEDS] for n in ind_names}
ind_nll = {n: [ind_rows[n, s][1] for s in IND_SEEDS] for n in ind_names}
baseline = max(max(ind_score[ind_names[0]]), max(ind_score[ind_names[1]]))
two = ind_names[2]
formed = [i for i, sc in enumerate(ind_score[two]) if sc > 3 * baseline]
waiting = [i for i in range(len(IND_SEEDS)) if i not in formed]
print(f"induction head formed in seeds {[IND_SEEDS[i] for i in formed]}")
# most seeds form it within the budget, far above every baseline seed...
assert len(formed) >= 2
assert min(ind_score[two][i] for i in formed) - baseline > 0.5
# ...and where it formed, the copy predicts the repeat: far below the one-layer loss
assert max(ind_nll[two][i] for i in formed) < 0.5 * min(ind_nll[ind_names[1]])
# a seed without it is still on the plateau: no better than one layer
assert all(ind_nll[two][i] > 0.8 * min(ind_nll[ind_names[1]]) for i in waiting)


def span(vals: list[float]) -> str:
    lo, hi = f"{min(vals):.2f}", f"{max(vals):.2f}"
    return lo if lo == hi else f"{lo} to {hi}"


for key, name in zip(("untrained", "one"), ind_names[:2], strict=True):
    glue(f"ch02-ind-score-{key}", span(ind_score[name]), display=False)
    glue(f"ch02-ind-nll-{key}", span(ind_nll[name]), display=False)
glue("ch02-ind-score-two", span([ind_score[two][i] for i in formed]), display=False)
glue("ch02-ind-nll-two", span([ind_nll[two][i] for i in formed]), display=False)
words = {1: "one", 2: "two", 3: "three"}
glue("ch02-ind-n-formed", words[len(formed)], display=False)
glue("ch02-ind-n-seeds", words[len(IND_SEEDS)], display=False)
if waiting:
    glue(
        "ch02-ind-score-waiting",
        span([ind_score[two][i] for i in waiting]),
        display=False,
    )
    glue(
        "ch02-ind-nll-waiting",
        span([ind_nll[two][i] for i in waiting]),
        display=False
    )
glue("ch02-ind-uniform-nll", f"{math.log(IND['vocab']):.2f}", display=False)
glue("ch02-ind-steps", f"{IND['steps']:,}", display=False)

# %% [markdown]
# After {glue:text}`ch02-ind-steps` steps, in {glue:text}`ch02-ind-n-formed` of the
# {glue:text}`ch02-ind-n-seeds` seeds the best head of the second layer puts
# {glue:text}`ch02-ind-score-two` of its weight on the tokens after earlier occurrences;
# the untrained model's best head puts {glue:text}`ch02-ind-score-untrained` there, and
# the trained one-layer model's {glue:text}`ch02-ind-score-one`. The loss on the repeated
# tokens says the same from the other side: {glue:text}`ch02-ind-nll-two` nats with the
# induction head, against {glue:text}`ch02-ind-nll-one` for one layer (a uniform guess
# costs {glue:text}`ch02-ind-uniform-nll`). The one-layer model, with no earlier layer to
# tell each key its predecessor, finds no such head; it only learns that tokens seen
# before are likely again. The remaining seed is still where the one-layer models are
# (score {glue:text}`ch02-ind-score-waiting`, {glue:text}`ch02-ind-nll-waiting` nats):
# Olsson et al. report that induction heads appear abruptly, after a plateau
# {cite}`olsson2022induction`, and here the
# plateau's length varies from seed to seed, so a fixed budget catches some runs before
# the jump (raise `IND["steps"]` to give the third more time). Here is one of the heads on a
# held-out sequence:

# %% tags=["hide-input"]
ind_net = ind_nets["two layers, trained", 0]
with torch.no_grad():
    ind_maps = ind_net(ind_eval[:1], maps=True)
best = prefix_matching_score(ind_maps[-1], ind_periods[:1]).argmax().item()
fig, axes = plt.subplots(1, 2, figsize=(9.6, 4.2))
target_map = induction_targets(ind_periods[:1], IND["seq_len"])[0].float()
for ax, data, title in (
    (axes[0], ind_maps[-1][0, best].numpy(), f"layer 2, head {best + 1} (trained)"),
    (axes[1], target_map.numpy(), "keys after an earlier copy of the query's token"),
):
    heatmap(ax, data, title=title, vmax=1.0)
    ax.set(xlabel="key position", ylabel="query position")
fig.suptitle(f"An induction head, period P = {ind_periods[0].item()}")
plt.show()

# %% [markdown]
# (ch02-icl)=
# ### In-context learning: copying, and something like gradient descent
#
# An induction head is in-context learning in its plainest form: the answer is already in
# the prompt, and the head finds it and copies it. Olsson et al. argue that heads of this
# kind carry much of the in-context learning of large models {cite:p}`olsson2022induction`.
# A stronger claim is often repeated as settled: that attention runs a *learning
# algorithm* on the examples in the prompt, that in-context learning is gradient descent
# in disguise. The claim has a precise form, and a setting small enough to test it while
# reading every weight.
#
# A prompt holds $N$ examples $(x_i, y_i)$ of a linear rule $y = w \cdot x$, with a fresh
# $w \sim \mathcal N(0, I_d)$ in every prompt, then a query $x_q$ whose label the model
# must supply. No single $w$ can be stored in the weights: it has to be inferred from the
# prompt. A learner given the same examples could take one step of gradient descent on
# their squared error $L(w) = \frac{1}{2N}\sum_i (w \cdot x_i - y_i)^2$ from $w = 0$, with
# step size $\eta$. The gradient at zero is $-\frac{1}{N}\sum_i y_i x_i$, so the step lands
# at $w_1 = \frac{\eta}{N}\sum_i y_i x_i$ and predicts
#
# $$
# \hat y_q = w_1 \cdot x_q = \frac{\eta}{N} \sum_{i=1}^{N} (x_q \cdot x_i)\, y_i .
# $$
#
# Read as attention, this is a query $x_q$ scoring every key $x_i$ by a dot product and
# summing the values $y_i$ with those scores as weights, used as they are, with no
# softmax. Von Oswald et al. wrote down the weights with which one layer of such *linear*
# (softmax-free) self-attention computes exactly this step, and found that layers trained
# on these prompts come to compute it {cite:p}`vonoswald2023transformers`. Here are the
# step and the layer; a token is the vector $(x_i, y_i)$, the query's is $(x_q, 0)$, and
# the prediction is what the layer writes into the query's empty label slot.

# %% tags=["hide-input"]
Code(
    inspect.getsource(gd_step_prediction)
    + "\n"
    + inspect.getsource(LinearSelfAttention.forward),
    language="python",
)

# %% [markdown]
# With query and key weights that read $x$, and a value weight that writes $\eta\, y$
# into the label slot (`gd_construction`), the layer *is* the step. That is algebra, and
# the cell checks it on held-out prompts, with the step size that a line search over
# training prompts finds best.

# %%
ICL = {"n_examples": 16, "dim": 8}
fit = regression_prompts(65536, **ICL, generator=torch.Generator().manual_seed(7))
eta = best_gd_lr(*fit)  # the best single step, by line search on training prompts
icl_test, icl_y = regression_prompts(
    4096, **ICL, generator=torch.Generator().manual_seed(8)
)
gd_pred = gd_step_prediction(icl_test, eta)
built = gd_construction(ICL["dim"], eta)  # the hand-set weights
with torch.no_grad():
    built_err = (built(icl_test) - gd_pred).abs().max().item()
print(f"best step η = {eta:.3f}; hand-set layer vs the GD step: max |Δ| < 1e-4:",
      built_err < 1e-4)
assert built_err < 1e-4

# %% [markdown]
# The line search's $\eta$ = {glue:text}`ch02-icl-eta` is close to
# $N/(N+d+1)$ = {glue:text}`ch02-icl-eta-formula`, the best step in expectation for
# Gaussian inputs (a short calculation with their second and fourth moments). That such
# weights *exist* is the exact part of the claim; whether training *finds* them is an
# experiment. We train the layer from small random weights with Adam for
# {glue:text}`ch02-icl-steps` steps of fresh prompts ($d$ = {glue:text}`ch02-icl-dim`,
# $N$ = {glue:text}`ch02-icl-n`), over {glue:text}`ch02-icl-n-seeds` seeds, and compare
# its predictions on the held-out prompts with the step's, with those of exact least
# squares on the examples (with more examples than unknowns and no noise, it recovers
# $w$ itself), and with predicting 0. The *gap* between two predictors is the mean squared
# difference of their predictions as a fraction of the reference predictor's variance (0
# when they agree); we also give the cosine between the two vectors of predictions. And
# we read the layer's *effective step* $\Gamma$ (`effective_step`): the matrix through
# which the part of its prediction shaped like gradient descent,
# $\frac{1}{N}\sum_i y_i\, x_q^\top \Gamma\, x_i$, acts; one plain step has
# $\Gamma = \eta I$, but nothing in training forces that shape.
#
# ```{admonition} Reading the numbers
# :class: note
# The runs below are small and short. A ± is a 95 % interval over seeds, on the paired
# differences where runs share seeds and batches; a difference is claimed only when that
# interval excludes zero, and a null says these seeds cannot tell the two apart. The
# {ref}`preface <reading-the-numbers>` says what follows from that.
# ```

# %% tags=["hide-input"]
ICL_SEEDS, ICL_STEPS = (0, 1, 2, 3, 4), 1000
ls_pred = least_squares_prediction(icl_test)


@torch.no_grad()
def icl_metrics(layer: LinearSelfAttention) -> dict[str, float]:
    """Held-out loss, gaps to the GD step and to least squares, cosine to the step,
    and the effective step's mean diagonal and relative off-diagonal size."""
    pred = layer(icl_test)
    row = {"loss": (pred - icl_y).square().mean().item()}
    for key, ref in (("gd", gd_pred), ("ls", ls_pred)):
        row[f"gap_{key}"] = ((pred - ref).square().mean() / ref.var()).item()
    row["cos"] = torch.nn.functional.cosine_similarity(pred, gd_pred, dim=0).item()
    gamma = effective_step(layer)
    diag = gamma.diagonal().mean()
    rest = gamma - diag * torch.eye(ICL["dim"])
    return row | {"diag": diag.item(), "off": (rest.norm() / gamma.norm()).item()}


icl_layers, icl_rows = {}, {}
torch.set_num_threads(1)  # small matrices: a second thread only waits
for seed in ICL_SEEDS:
    seed_everything(seed)
    icl_layers[seed] = LinearSelfAttention(ICL["dim"])
    train_icl_layer(
        icl_layers[seed],
        ICL_STEPS,
        n_examples=ICL["n_examples"],
        generator=torch.Generator().manual_seed(200 + seed),
    )
    icl_rows[seed] = icl_metrics(icl_layers[seed])
seed_everything(0)
icl_control = icl_metrics(LinearSelfAttention(ICL["dim"]))  # untrained
torch.set_num_threads(2)
icl_ref = {  # held-out loss of the reference predictors
    name: (pred - icl_y).square().mean().item()
    for name, pred in (
        ("predict 0", torch.zeros_like(icl_y)),
        ("one GD step", gd_pred),
        ("least squares", ls_pred),
    )
}
print(f"{'held-out prompts':<22}{'loss':>8}{'gap GD':>9}{'gap LS':>9}{'cos GD':>9}"
      f"{'Γ diag':>9}{'Γ rest':>9}")
for name, loss in icl_ref.items():
    print(f"{name:<22}{loss:>8.3f}")
for name, r in [("untrained layer", icl_control)] + [
    (f"trained layer, seed {s}", icl_rows[s]) for s in ICL_SEEDS
]:
    print(f"{name:<22}{r['loss']:>8.3f}{r['gap_gd']:>9.4f}{r['gap_ls']:>9.3f}"
          f"{r['cos']:>9.4f}{r['diag']:>9.3f}{r['off']:>9.3f}")

# %% tags=["hide-input"]
icl_col = {k: [icl_rows[s][k] for s in ICL_SEEDS] for k in icl_rows[ICL_SEEDS[0]]}
loss_zero, loss_gd, loss_ls = icl_ref.values()
# every seed lands on the GD step: a gap of at most 2 % of its variance, far below
# the gap to exact least squares (which one step cannot reach), cosine near 1
assert max(icl_col["gap_gd"]) < 0.02 and min(icl_col["cos"]) > 0.99
nearer_gd = difference(icl_col["gap_ls"], icl_col["gap_gd"])
assert nearer_gd.verdict == 1
assert max(icl_col["gap_gd"]) < 0.05 * min(icl_col["gap_ls"])
# ...so its loss sits at the step's, far above least squares' and below predicting 0
assert all(abs(v / loss_gd - 1) < 0.02 for v in icl_col["loss"])
assert loss_ls < 0.01 * loss_gd and loss_gd < 0.5 * loss_zero
# the weights have the step's structure: Γ ≈ η I, measured from the trained weights
assert all(abs(v / eta - 1) < 0.05 for v in icl_col["diag"])
assert max(icl_col["off"]) < 0.1
# the measure can fail: the untrained layer is nowhere near the step
assert icl_control["gap_gd"] > 0.5 and abs(icl_control["cos"]) < 0.5
eta_formula = ICL["n_examples"] / (ICL["n_examples"] + ICL["dim"] + 1)
assert abs(eta / eta_formula - 1) < 0.05  # the line search finds the best step
excess = difference(icl_col["loss"], [loss_gd] * len(ICL_SEEDS))
excess_pct = 100 * excess.mean / loss_gd
print(f"trained − GD step, loss: {excess.format(4)} "
      f"({excess_pct:+.2f} % of the step's)")
print(f"gap to LS − gap to GD: {nearer_gd.format(3)}")
verdict = {
    1: "The seeds put the trained layer's loss above the step's, by a margin "
    "beyond their spread but small against the step's loss.",
    0: "These seeds cannot tell the trained layer's loss from the step's.",
    -1: "The seeds put the trained layer's loss below the step's, by a margin "
    "beyond their spread but small against the step's loss.",
}
glue("ch02-icl-excess-verdict", verdict[excess.verdict], display=False)
glue("ch02-icl-excess", excess.format(3), display=False)
glue("ch02-icl-excess-pct", f"{excess_pct:+.2f}", display=False)


def span_fmt(vals: list[float], fmt: str) -> str:
    lo, hi = format(min(vals), fmt), format(max(vals), fmt)
    return lo if lo == hi else f"{lo} to {hi}"


glue("ch02-icl-eta", f"{eta:.3f}", display=False)
n_ex, dim = ICL["n_examples"], ICL["dim"]
glue("ch02-icl-eta-formula", f"{eta_formula:.3f}", display=False)
glue("ch02-icl-dim", f"{dim}", display=False)
glue("ch02-icl-n", f"{n_ex}", display=False)
glue("ch02-icl-steps", f"{ICL_STEPS:,}", display=False)
glue("ch02-icl-n-seeds", {3: "three", 4: "four", 5: "five"}[len(ICL_SEEDS)],
     display=False)
glue("ch02-icl-gap-gd", span_fmt(icl_col["gap_gd"], ".4f"), display=False)
glue("ch02-icl-gap-ls", span_fmt(icl_col["gap_ls"], ".3f"), display=False)
glue("ch02-icl-cos", f"{min(icl_col['cos']):.4f}", display=False)
glue("ch02-icl-loss-layer", span_fmt(icl_col["loss"], ".3f"), display=False)
for key, val in (("gd", loss_gd), ("ls", loss_ls), ("zero", loss_zero)):
    glue(f"ch02-icl-loss-{key}", f"{val:.3f}", display=False)
glue("ch02-icl-diag", span_fmt(icl_col["diag"], ".3f"), display=False)
glue("ch02-icl-off", f"{max(icl_col['off']):.3f}", display=False)
glue("ch02-icl-gap-untrained", f"{icl_control['gap_gd']:.2f}", display=False)

# %% tags=["remove-output", "hide-input"]
with torch.no_grad():
    pred0 = icl_layers[ICL_SEEDS[0]](icl_test)[:800]
fig, axes = plt.subplots(1, 3, figsize=(12.8, 4.0))
for ax, ref, name in ((axes[0], gd_pred, "one GD step"),
                      (axes[1], ls_pred, "exact least squares")):
    ref = ref[:800]
    lim = 1.05 * max(ref.abs().max().item(), pred0.abs().max().item())
    ax.plot([-lim, lim], [-lim, lim], color="grey", lw=1, label="equal predictions")
    ax.scatter(ref, pred0, s=5, alpha=0.4, color=PALETTE[0], label="held-out prompt")
    ax.set(xlim=(-lim, lim), ylim=(-lim, lim), xlabel=f"{name}: prediction of y_q",
           ylabel="trained layer: prediction of y_q", title=f"Layer against {name}")
    ax.legend(loc="upper left", fontsize=8)
gamma0 = effective_step(icl_layers[ICL_SEEDS[0]]).numpy()
vmax = abs(gamma0).max()
im = axes[2].imshow(gamma0, cmap="RdBu_r", vmin=-vmax, vmax=vmax)
axes[2].grid(False)
axes[2].set(title="The trained layer's effective step Γ",
            xlabel="coordinate of the example x_i",
            ylabel="coordinate of the query x_q")
fig.colorbar(im, ax=axes[2], label="entry of Γ (η I for one GD step)")
fig.suptitle(
    "Does a trained attention layer predict like one step of gradient descent?"
)
glue("fig-icl-gd", fig)
plt.close(fig)

# %% [markdown]
# ```{glue:figure} fig-icl-gd
# :name: fig-icl-gd
#
# The layer trained with seed 0, on 800 of the held-out prompts. Left: its prediction
# for each prompt against the one-step gradient-descent prediction; the points lie on
# the grey line of equal predictions. Middle: against exact least squares, which
# recovers $w$ and predicts the true label; the points scatter, because one step falls
# short of the solution. Right: the effective step $\Gamma$ read from the trained
# weights; red is positive, blue negative. A plain gradient step is $\eta I$, a
# constant diagonal; the trained $\Gamma$ is close to that, which training did not
# have to produce.
# ```

# %% [markdown]
# In every seed the trained layer lands on the gradient step. Its predictions differ
# from the step's by {glue:text}`ch02-icl-gap-gd` of their variance (cosine at least
# {glue:text}`ch02-icl-cos`), and from exact least squares' by
# {glue:text}`ch02-icl-gap-ls`; the untrained layer, the control, sits at a gap of
# {glue:text}`ch02-icl-gap-untrained` from the step. On held-out prompts its squared
# error is {glue:text}`ch02-icl-loss-layer`, the step's {glue:text}`ch02-icl-loss-gd`,
# least squares' {glue:text}`ch02-icl-loss-ls` and predicting 0 costs
# {glue:text}`ch02-icl-loss-zero`. The paired difference of the layer's loss and the
# step's is {glue:text}`ch02-icl-excess` ({glue:text}`ch02-icl-excess-pct` % of the
# step's loss). {glue:text}`ch02-icl-excess-verdict` The weights agree too
# ({numref}`fig-icl-gd`): the diagonal of $\Gamma$ averages {glue:text}`ch02-icl-diag`
# across the seeds, against the line search's $\eta$ = {glue:text}`ch02-icl-eta`, and
# what is left of $\Gamma$ once that diagonal is removed is at most
# {glue:text}`ch02-icl-off` of its norm.
#
# What this shows, and what it does not. The equivalence is *exact* for the hand-set
# weights and *measured* for the trained ones, and it is measured here for one layer of
# softmax-free attention trained on nothing but regression prompts. One layer computes
# one step, and it stays there: its loss is the step's, far above what least squares
# reaches on the same examples. Akyürek et al. trained deeper transformers on the same
# kind of prompts and found their in-context predictions close to gradient descent, to
# ridge regression or to exact least squares depending on depth and label noise,
# approaching the best possible estimator as width and depth grew; they also built
# weights that implement these algorithms {cite:p}`akyurek2023what`. Shen et al. question
# the step from such models to language models {cite:p}`shen2024position`: the
# experiments train explicitly for in-context learning, as ours does, whereas a language
# model's in-context learning emerges from predicting text; the hand-built weights have
# properties the weights of real models lack; and in a pretrained model (LLaMA-7B),
# learning from demonstrations in the prompt and fine-tuning on the same demonstrations
# by gradient descent react differently to their order and move the output distribution
# differently. "In-context learning is gradient descent" is thus a theorem about
# constructed weights, an observation about small models trained on regression prompts,
# and an open hypothesis for pretrained language models. Our experiment supports the
# middle part only: one linear-attention layer on a synthetic task, not a softmax
# transformer and not a pretrained LLM. Induction heads and this layer are two readings of
# the same fact, that attention treats the prompt as data: the induction head looks an
# answer up in it, the regression layer fits a rule to all of it at once.

# %% [markdown]
# ## The $n^2$ bill
#
# The score matrix has one entry per (query, key) pair: $n^2$ of them per head. Doubling the
# context quadruples the work and — if the matrix is stored — the memory. We measure both
# for the reference implementation, which stores it. Peak memory is counted by
# `companion.analysis.peak_memory.PeakMemory` (every tensor allocated inside the block, so the count is
# exact and repeatable), the work by PyTorch's `FlopCounterMode`; the wall time (fastest of
# five runs) depends on the machine, so it is shown but not asserted.

# %% tags=["hide-input"]
lengths = [256, 512, 1024, 2048] + ([4096, 8192] if FULL else [])
H, D = 4, 64
mem_naive, time_naive, flops = [], [], []
for n in lengths:
    qq, kk, vv = (
        torch.randn(1, H, n, D, generator=gen).to(DEVICE) for _ in range(3)
    )
    with PeakMemory(DEVICE) as pm:
        naive_attention(qq, kk, vv, causal=True)
    mem_naive.append(pm.peak_bytes)
    with FlopCounterMode(display=False) as counter:
        naive_attention(qq, kk, vv, causal=True)
    flops.append(counter.get_total_flops())
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        naive_attention(qq, kk, vv, causal=True)
        runs.append(time.perf_counter() - t0)
    time_naive.append(min(runs))  # the least disturbed run
mem_slope, _ = loglog_fit(lengths, mem_naive)
flop_slope, _ = loglog_fit(lengths, flops)
time_slope, _ = loglog_fit(lengths, time_naive)
for n, mb, f in zip(lengths, mem_naive, flops, strict=True):
    print(f"n = {n:>5}: peak memory {mb / 2**20:8.1f} MiB, {f / 1e9:6.2f} GFLOP")
print(f"memory grows as n^{mem_slope:.2f}, FLOPs as n^{flop_slope:.2f}")
assert 1.9 < mem_slope < 2.1
assert abs(flop_slope - 2) < 0.01  # two n×n×D matmuls per head: 4·H·n²·D FLOPs
assert flops[-1] == 4 * H * lengths[-1] ** 2 * D
glue("ch02-mem-slope", f"{mem_slope:.2f}", display=False)
glue("ch02-flop-slope", f"{flop_slope:.2f}", display=False)

# %% tags=["hide-input"]
# NBVAL_IGNORE_OUTPUT
# (timings differ from run to run and machine to machine: shown, not asserted)
for n, t in zip(lengths, time_naive, strict=True):
    print(f"n = {n:>5}: {1e3 * t:7.1f} ms")
print(f"time grows as n^{time_slope:.2f}")

# %% tags=["remove-output", "hide-input"]
def length_axes(ax) -> None:
    """Log axes with plain tick labels: x at the measured lengths, y at 1, 3, 10…"""
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 3.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("sequence length n (tokens)")


fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.6))
panels = (  # values, unit factor, axis label, title
    (mem_naive, 2**-20, "peak memory (MiB)", f"Peak memory ∝ n^{mem_slope:.1f}"),
    (time_naive, 1e3, "forward time (ms)", f"Time on this CPU ∝ n^{time_slope:.1f}"),
)
for ax, color, panel in zip(axes, PALETTE, panels, strict=False):
    vals, unit, ylabel, title = panel
    ys = [unit * v for v in vals]
    n2 = [ys[0] * (n / lengths[0]) ** 2 for n in lengths]  # n² through the first
    ax.plot(lengths, n2, color="grey", lw=6, alpha=0.3, label="∝ n², for reference")
    ax.plot(lengths, ys, "o-", color=color, label="measured")
    length_axes(ax)
    ax.set(ylabel=ylabel, title=title)
    ax.legend(loc="upper left")
fig.suptitle(f"Does attention's cost grow as n²? ({H} heads of width {D}, causal)")
glue("fig-n2-bill", fig)
plt.close(fig)
glue("ch02-heads-width", f"{H} heads of width {D}", display=False)

# %% [markdown]
# ```{glue:figure} fig-n2-bill
# :name: fig-n2-bill
#
# The reference implementation's causal forward pass on one sequence of
# {glue:text}`ch02-heads-width`, at each measured length, on log–log axes, where a power
# law is a straight line. The grey band is an exact $n^2$ law through the shortest length.
# Left: the peak memory counted by `PeakMemory` lies on the band (fitted slope
# {glue:text}`ch02-mem-slope`): the stored score matrices dominate it. Right: the fastest
# of five runs on the machine that executed this page; the title gives its fitted slope,
# which varies from run to run and machine to machine and is not asserted.
# ```

# %% [markdown]
# ## FlashAttention: the same numbers, never the whole matrix
#
# The softmax of a row needs its maximum (for numerical safety) and its sum of exponentials
# before any weight is known — which seems to force us to hold the whole row. The *online
# softmax* {cite}`milakov2018online` removes that need. Read the scores in blocks and keep
# two running numbers per row: the largest score so far, $m$, and the sum
# $\ell = \sum_j e^{s_j - m}$. When a new block raises the maximum to $m'$, everything summed
# so far is simply rescaled:
#
# $$
# m' = \max\bigl(m, \max_{j \in \text{block}} s_j\bigr), \qquad
# \ell' = \ell\, e^{m - m'} + \sum_{j \in \text{block}} e^{s_j - m'} .
# $$
#
# The output row is a weighted sum of values, so it can be carried along the same way:
# $o' = o\,e^{m-m'} + \sum_j e^{s_j - m'} v_j$, divided by $\ell$ once at the end. Nothing
# larger than one block of scores ever exists {cite}`dao2022flashattention`. Watch one row
# being processed in blocks of four: the weights computed so far are exact up to the final
# rescaling, and after the last block they *are* the softmax.

# %%
Code(inspect.getsource(online_softmax_trace), language="python")

# %% tags=["hide-input"]
row = torch.randn(16, generator=torch.Generator().manual_seed(3)) * 2
trace = online_softmax_trace(row, block=4)
final_m, final_l = trace[-1]
assert torch.allclose(
    torch.exp(row.double() - final_m) / final_l, torch.softmax(row.double(), dim=0)
)
print("running (max, sum) after each block:")
print([(round(m, 2), round(s, 2)) for m, s in trace])

fig, ax = plt.subplots(figsize=(6.4, 3.2))
true_p = torch.softmax(row, dim=0).numpy()


def draw_block(i: int) -> None:
    ax.clear()
    m, l_sum = trace[i]
    seen = 4 * (i + 1)
    ax.bar(range(16), true_p, color="none", edgecolor="grey", label="true softmax")
    ax.bar(
        range(seen),
        (torch.exp(row[:seen] - m) / l_sum).numpy(),
        color=PALETTE[0],
        alpha=0.8,
        label="computed so far",
    )
    ax.axvspan(seen - 4 - 0.5, seen - 0.5, color=PALETTE[4], alpha=0.2)
    ax.set(
        ylim=(0, 1.05 * true_p.max()),
        xlabel="key position",
        ylabel="weight",
        title=f"After block {i + 1} of 4: running max {m:.2f}",
    )
    ax.legend(loc="upper right")


HTML(animate(fig, draw_block, len(trace), interval_ms=900))

# %% [markdown]
# `companion.ops.tiled` applies this to tiles of queries *and* keys. Its forward loop is in
# the folded listing below (unfold the cell's output to read it); the backward pass (not
# in the listing) recomputes each tile from the saved log-sum-exp
# $m + \log \ell$ instead of storing the weights, as FlashAttention-2 does
# {cite}`dao2023flashattention2`. `key_tiles` skips the tiles wholly in the future of a
# causal query block, and `tile_scores` computes one tile's masked scores.

# %% tags=["hide-output"]
Code(
    inspect.getsource(key_tiles)
    + "\n"
    + inspect.getsource(tile_scores)
    + "\n"
    + inspect.getsource(tiled_attention_forward),
    language="python",
)

# %% [markdown]
# The claim "exact, not an approximation" is an assertion: outputs and gradients of the
# tiled form agree with the reference and with PyTorch's fused SDPA, on a length that is not
# a multiple of the tile size, with a causal mask.

# %%
torch.manual_seed(0)
qq, kk, vv = (torch.randn(2, 4, 300, 32, requires_grad=True) for _ in range(3))
forms = {
    "reference": lambda a, b, c: naive_attention(a, b, c, causal=True),
    "sdpa": lambda a, b, c: sdpa_attention(a, b, c, causal=True),
    "tiled": lambda a, b, c: tiled_attention(
        a, b, c, causal=True, block_q=64, block_k=64
    ),
}
results = {}
for name, fn in forms.items():
    o = fn(qq, kk, vv)
    results[name] = (o.detach(), torch.autograd.grad(o.square().sum(), (qq, kk, vv)))
for name in ("sdpa", "tiled"):
    err_o = (results[name][0] - results["reference"][0]).abs().max().item()
    err_g = max(
        (a - b).abs().max().item()
        for a, b in zip(results[name][1], results["reference"][1], strict=True)
    )
    print(
        f"{name:>6} vs reference: max |Δ output| < 1e-5: {err_o < 1e-5}, "
        f"max |Δ grad| < 1e-4: {err_g < 1e-4}"
    )
    assert err_o < 1e-5 and err_g < 1e-4

# %% [markdown]
# And the memory: at each length the tiled form holds a few $64 \times 64$ tiles instead of
# the $n \times n$ matrix. Its peak is the output and the per-row statistics, which grow
# linearly in $n$, plus a fixed tile budget, so the fitted slope is at most 1 (over these
# short lengths the fixed part still dominates, which flattens it further).

# %% tags=["hide-input"]
mem_tiled = []
for n in lengths:
    qq, kk, vv = (
        torch.randn(1, H, n, D, generator=gen).to(DEVICE) for _ in range(3)
    )
    with PeakMemory(DEVICE) as pm:
        tiled_attention(qq, kk, vv, causal=True)
    mem_tiled.append(pm.peak_bytes)
tiled_slope, _ = loglog_fit(lengths, mem_tiled)
print(f"{'n':>6} {'reference MiB':>14} {'tiled MiB':>10} {'ratio':>7}")
for n, a, b in zip(lengths, mem_naive, mem_tiled, strict=True):
    print(f"{n:>6} {a / 2**20:>14.1f} {b / 2**20:>10.2f} {a / b:>7.1f}")
print(f"tiled memory grows as n^{tiled_slope:.2f}")
assert tiled_slope < 1.2
assert mem_naive[-1] > 20 * mem_tiled[-1]
glue("ch02-tiled-slope", f"{tiled_slope:.2f}", display=False)
glue("ch02-mem-ratio", f"{mem_naive[-1] / mem_tiled[-1]:.0f}", display=False)

# %% tags=["remove-output", "hide-input"]
fig, ax = plt.subplots(figsize=(6.4, 3.6))
for vals, label in (
    (mem_naive, f"reference (∝ n^{mem_slope:.1f})"),
    (mem_tiled, f"tiled online softmax (∝ n^{tiled_slope:.1f})"),
):
    ax.plot(lengths, [m / 2**20 for m in vals], "o-", label=label)
length_axes(ax)
ax.set(ylabel="peak memory (MiB)", title="Does the tiled form need the n × n matrix?")
ax.legend(loc="upper left")
glue("fig-tiled-memory", fig)
plt.close(fig)

# %% [markdown]
# ```{glue:figure} fig-tiled-memory
# :name: fig-tiled-memory
#
# Peak memory of the causal forward pass at each length, reference against tiled (the two
# agree, as asserted above), on log–log axes. The reference stores the score matrices and
# grows as $n^2$; the tiled form holds the output, its per-row statistics and a few
# $64 \times 64$ tiles, never the $n \times n$ matrix, and at the longest length needs
# {glue:text}`ch02-mem-ratio`× less memory.
# ```

# %% [markdown]
# (ch02-hbm-sram)=
# ### Why the tiles pay off on a GPU: bytes through HBM
#
# Saving memory is half of FlashAttention's argument; the other half is time, and on a GPU
# time is mostly *traffic*. A GPU has a large, slow memory and a small, fast one. The
# FlashAttention paper gives the A100's figures {cite}`dao2022flashattention`: 40–80 GB of
# high-bandwidth memory (HBM) at 1.5–2.0 TB/s, and 192 KB of on-chip SRAM in each of its
# 108 streaming multiprocessors, at about 19 TB/s. NVIDIA's A100 datasheet rates its
# dense fp16 tensor-core arithmetic at 312 TFLOP/s. The standard implementation (the
# paper's Algorithm 0) writes the $n \times n$ scores $S$ to HBM, reads them back for the
# softmax, writes the weights $P$, and reads them again for $PV$: four passes over $n^2$
# numbers that do not fit in SRAM. The tiled form reads $Q$ and writes $O$ once, and reads
# one $K$ tile and one $V$ tile per (query tile, key tile) pair; scores never leave SRAM.
# We count the tiled traffic by counting the tiles `companion`'s own loop touches (we wrap
# `tile_scores` and run it), for one head of width 64 at $n = 4096$, in fp16, with
# $128 \times 128$ tiles, and price both at the paper's lower bandwidth.

# %% tags=["hide-input"]
A100 = {  # FlashAttention paper, section 2.1; fp16 peak: NVIDIA A100 datasheet
    "hbm_bytes_per_s": 1.5e12,
    "sram_bytes_per_sm": 192e3,
    "fp16_flops_per_s": 312e12,
}
N_FA, D_FA, TILE, FP16, FP32 = 4096, 64, 128, 2, 4


def standard_hbm_bytes(n: int, d: int) -> int:
    """Algorithm 0: read Q, K; write S; read S; write P; read P, V; write O."""
    return FP16 * (2 * n * d + 4 * n * n + 2 * n * d)


def tiled_hbm_bytes(n: int, d: int, causal: bool) -> tuple[int, int]:
    """(HBM bytes, tiles) of companion's tiled forward, one head: Q in and O out
    once, the log-sum-exp out once, one K and one V tile in per tile visited."""
    q = torch.randn(1, 1, n, d)
    with mock.patch(
        "companion.ops.tiled.tile_scores", wraps=tiled_ops.tile_scores
    ) as counted:
        tiled_attention_forward(q, q, q, causal=causal, block_q=TILE, block_k=TILE)
    tiles = counted.call_count
    return FP16 * (2 * n * d + tiles * 2 * TILE * d) + FP32 * n, tiles


flops_fa = 4 * N_FA**2 * D_FA  # QKᵀ and PV, as measured above
std_bytes = standard_hbm_bytes(N_FA, D_FA)
print(f"one head, n = {N_FA}, d = {D_FA}, fp16, tiles {TILE}×{TILE}")
print(f"{'':>22} {'HBM MB':>8} {'at 1.5 TB/s':>12} {'tiles':>6}")
print(
    f"{'standard (Alg. 0)':>22} {std_bytes / 1e6:>8.1f} "
    f"{1e6 * std_bytes / A100['hbm_bytes_per_s']:>9.1f} µs"
)
fa_rows = {}
for causal in (False, True):
    b, tiles = tiled_hbm_bytes(N_FA, D_FA, causal)
    fa_rows[causal] = (b, tiles)
    name = "tiled, causal" if causal else "tiled"
    print(
        f"{name:>22} {b / 1e6:>8.1f} "
        f"{1e6 * b / A100['hbm_bytes_per_s']:>9.1f} µs {tiles:>6}"
    )
t_math = flops_fa / A100["fp16_flops_per_s"]
print(f"{'arithmetic (no mask)':>22} {'':>8} {1e6 * t_math:>9.1f} µs")
sram_tile = FP16 * 3 * TILE * D_FA + FP32 * (TILE * TILE + TILE * D_FA + 2 * TILE)
print(f"one tile's working set: {sram_tile / 1e3:.0f} kB of the SM's 192 kB")
print(f"the score matrix alone: {FP16 * N_FA**2 / 1e6:.1f} MB")
tiled_full = fa_rows[False][0]
glue("ch02-fa-std-mb", f"{std_bytes / 1e6:.0f}", display=False)
glue("ch02-fa-tiled-mb", f"{tiled_full / 1e6:.0f}", display=False)
glue("ch02-fa-ratio", f"{std_bytes / tiled_full:.1f}", display=False)
glue(
    "ch02-fa-std-us",
    f"{1e6 * std_bytes / A100['hbm_bytes_per_s']:.0f}",
    display=False
)
glue("ch02-fa-math-us", f"{1e6 * t_math:.0f}", display=False)
glue("ch02-fa-tile-kb", f"{sram_tile / 1e3:.0f}", display=False)

# %% tags=["hide-input"]
n_tiles = N_FA // TILE
# the loop visits every tile once, or the lower triangle with its diagonal if causal
assert fa_rows[False][1] == n_tiles**2
assert fa_rows[True][1] == n_tiles * (n_tiles + 1) // 2
# the reference really stores the n×n matrices the standard count charges to HBM
assert mem_naive[-1] >= 2 * H * lengths[-1] ** 2 * 4
# the tiled loop moves less than a third of the standard form's bytes
assert std_bytes > 3 * tiled_full

# %% [markdown]
# At this size the standard form moves {glue:text}`ch02-fa-std-mb` MB through HBM per
# head, {glue:text}`ch02-fa-std-us` µs at 1.5 TB/s, against {glue:text}`ch02-fa-math-us`
# µs for the arithmetic: it is bound by memory, not by the tensor cores. The tiled form
# moves {glue:text}`ch02-fa-tiled-mb` MB, {glue:text}`ch02-fa-ratio`× less, with one
# tile's working set ({glue:text}`ch02-fa-tile-kb` kB) inside one multiprocessor's SRAM.
# The counts show where the remaining traffic goes: $K$ and $V$ are re-read once per query
# tile, so the saving grows with the tile size, which SRAM bounds — the paper's
# $\Theta(n^2 d^2 / M)$ accesses for SRAM size $M$, against $\Theta(n d + n^2)$
# {cite}`dao2022flashattention`. (Re-read $K$ and $V$ tiles often come from the GPU's L2
# cache rather than HBM, so the real traffic is lower still; the count is an upper bound.)
#
# On a CPU there is no such split to exploit, and the pure-PyTorch tiled loop pays for
# Python driving each tile. We time it against PyTorch's fused SDPA at the longest length
# above:

# %% tags=["hide-input"]
# NBVAL_IGNORE_OUTPUT
# (timings differ from run to run and machine to machine: shown, not asserted)
qq, kk, vv = (torch.randn(1, H, lengths[-1], D, generator=gen) for _ in range(3))


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


t_loop = min(
    seconds(lambda: tiled_attention(qq, kk, vv, causal=True)) for _ in range(3)
)
t_sdpa = min(
    seconds(lambda: sdpa_attention(qq, kk, vv, causal=True)) for _ in range(3)
)
print(
    f"n = {lengths[-1]}: tiled loop {1e3 * t_loop:.1f} ms, "
    f"SDPA {1e3 * t_sdpa:.1f} ms ({t_loop / t_sdpa:.1f}×)"
)
glue("ch02-loop-vs-sdpa", f"{t_loop / t_sdpa:.1f}", display=False)

# %% [markdown]
# In the run stored with this page the tiled loop took {glue:text}`ch02-loop-vs-sdpa`×
# as long as SDPA.
# On a GPU the same algorithm, written as one fused kernel, keeps each tile in SRAM; it is
# what SDPA's flash backend runs. `make bench` (`python -m companion.bench attention`)
# prints the three side by side.
#
# ### The same loop as a GPU kernel
#
# `companion.kernels.flash_attention` writes that fused kernel in Triton
# {cite}`tillet2019triton`, a Python dialect in which one *program* handles one tile and
# the compiler places the tile's data in registers and shared memory. The folded listing
# below is the whole forward pass; read it beside the folded `tiled_attention_forward`
# above. What each part does on the hardware:
#
# - The launch grid has one program per (query tile, batch × head), and the programs run
#   side by side on the multiprocessors: the outer loop of the tiled form becomes
#   parallelism.
# - `q = tl.load(...)` reads a $BM 	imes D$ tile of $Q$ from HBM once; it stays on chip,
#   in registers, for the whole program.
# - `for n0 in range(lo, hi, BN)` is the one pass over $K$ and $V$: each tile is streamed
#   from HBM into on-chip memory, used, and dropped. `lo` and `hi` bound the keys a
#   causal query tile can see, so tiles wholly in its future are never loaded, as
#   `key_tiles` skips them in PyTorch.
# - `tl.dot(q, tl.trans(k))` makes the tile of scores on the tensor cores; it never leaves
#   the registers.
# - `m`, `denom` and `acc` are the running maximum, the running sum $\ell$ and the
#   unnormalised output of the online softmax above, kept in fp32 registers whatever the
#   input's dtype, and `alpha` is its rescaling factor $e^{m - m'}$. The kernel works in
#   base 2 (`tl.exp2` is the hardware's instruction; the scale is multiplied by
#   $\log_2 e$ once, before the loop).
# - After the loop each row is divided by its sum once, and two things go back to HBM: the
#   output tile and one fp32 number per row, the log-sum-exp $m + \log \ell$. The backward
#   kernels recompute every tile of weights from it instead of storing them, as
#   FlashAttention-2 does {cite}`dao2023flashattention2`.
# - `kv` is the key/value head the program reads. Here it is the query's own head; when
#   several query heads share one ({doc}`08_kv_cache`), the sharing is this index, and
#   nothing is copied.
#
# The kernel runs compiled on a CUDA GPU, or, on a machine without one, under Triton's
# interpreter, which executes each program with NumPy: slowly, but the same code. We run
# it on a small causal case whose length is not a multiple of its 16-wide tiles and
# compare it with the tiled form: output, log-sum-exp and all three gradients.

# %% tags=["hide-input"]
from IPython.display import display

HAS_TRITON = triton_available()
if HAS_TRITON:
    interpreted = interpreting()  # switched on at the top where there is no CUDA GPU
    from companion.kernels.flash_attention import (
        flash_attention,
        flash_forward,
        forward_kernel_source,
    )
else:
    print("Triton is not installed here (the gpu extra): the kernel is skipped.")

# %% tags=["hide-output"]
if HAS_TRITON:
    display(Code(forward_kernel_source(), language="python"))

# %% tags=["hide-input"]
if HAS_TRITON:
    kdev = torch.device("cpu" if interpreted else "cuda")
    # fp32: exact up to rounding interpreted; compiled, tl.dot multiplies fp32 in TF32
    bound = 1e-5 if interpreted else 2e-2
    g = torch.Generator().manual_seed(5)
    q, k, v, d_out = (torch.randn(1, 2, 45, 16, generator=g) for _ in range(4))
    out, lse = tiled_attention_forward(q, k, v, causal=True, block_q=16, block_k=16)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = tiled_attention(*leaves, causal=True, block_q=16, block_k=16)
    want = torch.autograd.grad(o, leaves, d_out)
    leaves = [x.to(kdev).requires_grad_() for x in (q, k, v)]
    o_k = flash_attention(*leaves, causal=True)
    _, lse_k = flash_forward(*leaves, causal=True)
    got = torch.autograd.grad(o_k, leaves, d_out.to(kdev))
    err = {
        "output": (o_k.cpu() - out).abs().max().item(),
        "lse": (lse_k.cpu() - lse).abs().max().item(),
        "dq, dk, dv": max(
            (a.cpu() - b).abs().max().item() for a, b in zip(got, want, strict=True)
        ),
    }
    where = "interpreted on the CPU" if interpreted else "compiled on a CUDA GPU"
    print(f"Triton kernel ({where}) against the tiled form, T = S = 45, causal:")
    for name, e in err.items():
        print(f"  max |Δ {name}| < {bound:.0e}: {e < bound}")
    assert all(e < bound for e in err.values()), err
    glue("ch02-triton-where", where, display=False)
    glue("ch02-triton-bound", f"{bound:.0e}".replace("e-0", "e-"), display=False)

# %% [markdown]
# In the run stored with this page the kernel ran {glue:text}`ch02-triton-where`, and its
# output, log-sum-exp and gradients agree with the tiled form's to within
# {glue:text}`ch02-triton-bound`. The tests (`tests/test_triton_flash.py`) hold it to the
# reference on more cases: causal with fewer queries than keys, the sliding windows and
# shared key/value heads of later chapters, a query with no visible key; on a GPU also in
# bf16 and fp16.
#
# ## What we learned
#
# Attention is a differentiable lookup: queries score keys, a softmax turns the scores into
# weights, the output is the weighted average of the values, and a causal mask keeps each
# position blind to its future so that one pass trains every position. The $1/\sqrt{d_k}$
# scale is what keeps that softmax trainable as heads get wider, and splitting the width
# into heads gives each its own softmax for the same parameters. In our small trained
# models the first layer's heads turned local and the second layer's broad and alike, with
# no long-range specialists, and two attention layers formed an induction head where one
# layer never did, though not in every seed within the budget. Attention can also fit a
# rule to the examples in its prompt: one softmax-free layer computes one step of
# gradient descent on them exactly with hand-set weights, and trained on in-context
# regression it learned that step in every seed, weights included; that supports
# "in-context learning as gradient descent" in such small trained models, and says
# nothing yet about pretrained language models. The price is the
# $n \times n$ score matrix, whose memory and work grow quadratically; FlashAttention's
# online softmax computes the same outputs and gradients tile by tile in memory at most
# linear in $n$, and the traffic it saves through a GPU's HBM we counted, not timed.
#
# ## Exercises
#
# 1. Replace $1/\sqrt{d_k}$ by $1/d_k$ in the saturation experiment. What happens to the
#    score spread and the Jacobian norm as $d_k$ grows?
#
# ```{admonition} Hint
# :class: dropdown
# The scores then have standard deviation $1/\sqrt{d_k}$: the softmax tends to *uniform*,
# and every head averages everything — the opposite failure.
# ```
#
# 2. Train the chapter's model with `n_heads=1` and the same `d_model`. Is the validation
#    loss better or worse, and what does the single head's map look like?
#
# ```{admonition} Hint
# :class: dropdown
# Build `ModelConfig(..., n_heads=1)`; the parameter count is unchanged. One softmax per
# layer must compromise between local and long-range reading.
# ```
#
# 3. How long can the context of one layer with $H = 32$ heads be before the reference
#    implementation's score matrices alone fill 80 GB, in fp32 and in bf16? Check your
#    formula against `PeakMemory` at a small $n$.
#
# ```{admonition} Solution
# :class: dropdown
# The scores take $4 H n^2$ bytes in fp32, so $n \approx \sqrt{80\cdot 10^9 / 128}
# \approx 25{,}000$; in bf16 ($2Hn^2$ bytes) about 35,000 — before the softmax's copy.
# ```
#
# 4. In `online_softmax_trace`, process the blocks in *reverse* order. Does the final
#    result change? Why is that useful for parallel hardware?
#
# ```{admonition} Hint
# :class: dropdown
# Two partial results $(m_1, \ell_1)$ and $(m_2, \ell_2)$ merge into
# $(\max(m_1, m_2),\ \ell_1 e^{m_1 - m} + \ell_2 e^{m_2 - m})$ in any order: blocks can be
# combined in a tree, which is how split-KV decoding parallelises over long contexts.
# ```

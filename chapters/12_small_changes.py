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
# # 12 · Small changes that aren't small
#
# Some of the changes between 2017 and 2026 fill a chapter each: RoPE, RMSNorm, SwiGLU,
# grouped heads, experts. Others take one line of a config file: a bigger vocabulary,
# `tie_word_embeddings: false`, `attention_bias: false`, `dropout: 0.0`, a `sinks`
# tensor, a `num_nextn_predict_layers: 1`, a different ratio of layers to width. This
# chapter takes seven of these one-liners and shows, with an experiment for each, why
# none of them is as small as it looks:
#
# 1. a larger vocabulary moves the memory peak of training to the loss, and chunked
#    cross-entropy removes it;
# 2. tying the output head to the embedding matters for small models only;
# 3. the key bias is provably useless without RoPE, and the value bias can be folded away;
# 4. dropout left because pretraining sees each token once;
# 5. attention sinks, and the output gate, let a head say nothing;
# 6. multi-token prediction trains a built-in draft model;
# 7. two models of the same size can have opposite shapes.

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
import inspect

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import HTML, Code

from companion.analysis.calculator import (
    count_params,
    flops_per_token,
    kv_cache_bytes_per_token,
)
from companion.analysis.peak_memory import PeakMemory
from companion.device import default_device, describe
from companion.layers.mha import MultiHeadAttention
from companion.layers.rotary import RotaryEmbedding
from companion.models.decoder import DecoderLM
from companion.models.mtp import MTPModule, mtp_losses, trunk_forward
from companion.models.presets import PRESETS, preset, tiny
from companion.ops.cross_entropy import (
    ChunkedCrossEntropy,
    chunked_cross_entropy,
    logits_bytes,
    naive_cross_entropy,
)
from companion.ops.sinks import (
    sink_as_key,
    sink_attention_weights,
    sink_naive_attention,
    sink_sdpa_attention,
)
from companion.plotting import PALETTE, animate, use_style
from companion.tasks.text import (
    CharTokenizer,
    load_shakespeare,
    sample_windows,
    split_tokens,
)
from companion.training import cosine_lr, make_adamw, seed_everything

FULL = False  # True: a bigger loss experiment and a longer multi-token run (use a GPU)
DEVICE = default_device() if FULL else torch.device("cpu")
use_style()
seed_everything(0)
torch.set_num_threads(1)  # tiny tensors: one thread, whatever else runs on the machine
print(describe(DEVICE))
GiB, MiB = 2**30, 2**20

# %% [markdown]
# ## 1 · The vocabulary grew, and the loss became the memory peak
#
# GPT-2's byte-level BPE had 50,257 tokens {cite}`radford2019language`. Llama 3 has
# 128,256 {cite}`grattafiori2024llama`, Qwen3 151,936 {cite}`yang2025qwen3`, Gemma 3 a
# tokenizer of 262,144 entries {cite}`gemmateam2025gemma3`. The reason is coverage: a
# tokenizer fitted mostly to English cuts Hindi, Arabic or Chinese words into many pieces,
# which costs those users context length and compute. The presets carry the released
# tables:

# %%
vocab = {
    name: preset(name).vocab_size
    for name in ("gpt2", "llama3-8b", "qwen3-235b-a22b", "gemma3-27b")
}
for name, v in vocab.items():
    print(f"{name:<16} {v:>8,} rows  ({v / vocab['gpt2']:.1f}× GPT-2)")
assert list(vocab.values()) == [50_257, 128_256, 151_936, 262_208]
assert (
    vocab["gemma3-27b"] - 262_144 == 64
)  # the checkpoint's table has 64 rows more than the tokenizer

# %% [markdown]
# The table itself is cheap: $V d$ numbers, under 0.3% of DeepSeek-V3 (section 2). The
# cost is the **logits**. The loss needs a score for every vocabulary entry at every
# position, a tensor of shape $(B, S, V)$, usually in fp32. For a batch of 8 sequences of
# 8,192 tokens with Qwen3's vocabulary:
#
# $$8 \times 8192 \times 151{,}936 \times 4 \text{ bytes} \approx 37 \text{ GiB},$$

# %%
qwen_logits = logits_bytes(8, 8192, 151_936)
print(f"{qwen_logits:,} bytes = {qwen_logits / GiB:.2f} GiB")
assert qwen_logits == 39_829_110_784 and round(qwen_logits / GiB) == 37

# %% [markdown]
# one tensor, for one micro-batch, and the backward pass wants a second of the same size
# for its gradient. The fix is to never build it. Cross-entropy of row $n$ is
# $\log \sum_v e^{z_{nv}} - z_{n,y_n}$, and its gradient with respect to the logits is
# $\mathrm{softmax}(z_n) - \mathrm{onehot}(y_n)$: both are per-row. So one can take a chunk
# of $C$ rows, compute their $(C, V)$ logits, keep only one log-sum-exp per row, and drop
# the chunk. The backward pass does the same: recompute a chunk's logits, turn them into
# softmax minus one-hot, add their contribution to the gradients of the hidden states and
# of the output matrix, drop the chunk. This is what fused and chunked loss kernels do on
# GPUs {cite}`wijmans2025cut`. `companion.ops.cross_entropy` writes it as a custom autograd
# function:

# %%
Code(inspect.getsource(ChunkedCrossEntropy), language="python")

# %% [markdown]
# We check it against the reference, which builds the full logits and calls
# `F.cross_entropy`, on 1,024 tokens (think $B = 4$, $S = 256$), width 64 and a
# vocabulary of 16,384, with chunks of 128 rows. `PeakMemory` (chapter 2) counts the bytes
# of every tensor created inside its block, deterministically, so its figures can be
# compared with the arithmetic.

# %%
N, D, V, C = (8192, 256, 65_536, 512) if FULL else (1024, 64, 16_384, 128)
gen = torch.Generator().manual_seed(0)
hidden = torch.randn(N, D, generator=gen)
head = torch.randn(V, D, generator=gen) / D**0.5
targets = torch.randint(0, V, (N,), generator=gen)


def loss_and_grads(fn, **kw):
    """Loss, d/d hidden, d/d head, and the peak bytes of forward + backward."""
    h, w = hidden.clone().requires_grad_(), head.clone().requires_grad_()
    with PeakMemory("cpu") as pm:
        loss = fn(h, w, targets, **kw)
        loss.backward()
    return loss.item(), h.grad, w.grad, pm.peak_bytes


ref = loss_and_grads(naive_cross_entropy)
chunk = loss_and_grads(chunked_cross_entropy, chunk_size=C)
full_logits, chunk_logits, head_bytes = N * V * 4, C * V * 4, V * D * 4
print(f"loss: full {ref[0]:.5f}, chunked {chunk[0]:.5f}")
for name, a, b in (("hidden", ref[1], chunk[1]), ("head", ref[2], chunk[2])):
    rel = ((a - b).abs().max() / a.abs().max()).item()
    print(f"grad of {name}: max |difference| / max |grad| < 1e-5: {rel < 1e-5}")
    assert rel < 1e-5
print(
    f"full logits {full_logits / MiB:.0f} MiB, one chunk's {chunk_logits / MiB:.0f} MiB"
)
print(f"peak: reference {ref[3] / MiB:.1f} MiB, chunked {chunk[3] / MiB:.1f} MiB")
assert abs(ref[0] - chunk[0]) < 1e-5
assert torch.allclose(ref[1], chunk[1], atol=1e-7) and torch.allclose(
    ref[2], chunk[2], atol=1e-7
)
assert (
    abs(ref[3] - 3 * full_logits) < 0.01 * full_logits
)  # logits, log-softmax, their gradient
assert (
    abs(chunk[3] - (2 * chunk_logits + head_bytes)) < 0.02 * chunk[3]
)  # 2 chunks + grad of head

# %% [markdown]
# Same loss, same gradients (to fp32 rounding), and the peak follows the arithmetic. The
# reference holds three $(N, V)$ tensors at its peak: the logits, the log-softmax that
# `F.cross_entropy` saves for the backward, and the gradient of the logits, $3 \times 64 = 192$
# MiB here. The chunked form holds two $(C, V)$ tensors of one chunk (the recomputed
# logits and their softmax) plus the gradient of the $(V, d)$ head, which it must hold
# anyway: about 20 MiB, independent of $N$. The peak now grows with the chunk, not with
# the batch:

# %%
sizes = [32, 64, 128, 256, 512, 1024]
peaks = [loss_and_grads(chunked_cross_entropy, chunk_size=c)[3] for c in sizes]
fig, ax = plt.subplots(figsize=(6.4, 3.4))
ax.plot(
    sizes, [p / MiB for p in peaks], "o-", color=PALETTE[0], label="chunked, measured"
)
ax.plot(
    sizes,
    [(2 * c * V * 4 + head_bytes) / MiB for c in sizes],
    "--",
    color=PALETTE[1],
    label="2·C·V·4 + V·d·4",
)
ax.axhline(ref[3] / MiB, color=PALETTE[7], lw=1, label="full logits (reference)")
ax.set(
    xscale="log",
    xlabel="chunk size C (rows)",
    ylabel="peak memory (MiB)",
    title=f"Loss memory follows the chunk, not the {N:,} tokens",
)
ax.legend()
plt.show()
assert all(a < b for a, b in zip(peaks, peaks[1:], strict=False))

# %% [markdown]
# The price is one more matrix product per chunk in the backward pass (the logits are
# computed twice), which costs about a third of the loss's FLOPs and is usually hidden
# by the memory it saves. At $C = N$ the chunked form still beats the reference by a
# third, because it never stores the log-softmax. A training run whose memory profile has
# an unexplained cliff at the loss is meeting its logits.
#
# ## 2 · Weight tying: only for small models
#
# The 2017 Transformer shared one matrix between the input embedding and the output
# projection {cite}`vaswani2017attention` {cite}`press2017using`, and GPT-2 kept it. It
# saves $V d$ parameters. Whether that matters depends on how large the rest of the model
# is. `count_params` (chapter 13) counts the released configurations exactly:

# %%
rows = {}
for name in ("smollm2-135m", "llama3-8b", "deepseek-v3"):
    cfg = preset(name)
    pc = count_params(cfg)
    tables = pc.breakdown["embedding"] + pc.breakdown["lm_head"]
    rows[name] = (pc.total, tables, cfg.tie_embeddings)
    print(
        f"{name:<13} total {pc.total:>15,}  V·d {pc.breakdown['embedding']:>12,}  "
        f"tied {str(cfg.tie_embeddings):<5}  tables {tables / pc.total:6.2%} of all"
    )
assert rows["smollm2-135m"] == (134_515_008, 49_152 * 576, True)
assert rows["llama3-8b"] == (8_030_261_248, 2 * 128_256 * 4096, False)
assert rows["deepseek-v3"] == (671_026_419_200, 2 * 129_280 * 7168, False)
untied_smol = count_params(preset("smollm2-135m").replace(tie_embeddings=False)).total
print(
    f"SmolLM2-135M untied would have {untied_smol:,} parameters "
    f"(+{untied_smol / rows['smollm2-135m'][0] - 1:.0%})"
)
assert untied_smol - rows["smollm2-135m"][0] == 28_311_552
assert (
    round(100 * 129_280 * 7168 / rows["deepseek-v3"][0], 2) == 0.14
)  # what tying would save
gemma = count_params(preset("gemma3-27b"))
assert round(100 * gemma.breakdown["embedding"] / gemma.total, 1) == 5.2
print("presets that tie:", [n for n, c in PRESETS.items() if c.tie_embeddings])
assert [n for n, c in PRESETS.items() if c.tie_embeddings] == [
    "gpt2",
    "gpt2-xl",
    "gemma3-27b",
    "smollm2-135m",
]

# %% [markdown]
# In SmolLM2-135M the one shared table is 21% of the model; untying it would add another
# 21%. In Llama 3 8B the two untied tables are 13%, in DeepSeek-V3 0.28%. So small models
# tie (SmolLM2, Gemma 3 at every size, the smallest Qwen3 models) and large ones do not:
# the parameters are cheap there, and a separate output matrix is free to learn something
# other than the input table. Gemma 3 is the exception: it ties at every size, 27B
# included, where its 262,208-row table is still 5.2% of the model.
#
# ## 3 · Biases: gone, then partly back
#
# Llama dropped the bias from every linear layer {cite}`touvron2023llama`; most models
# since have followed, except for the attention projections of Qwen2 and gpt-oss
# {cite}`openai2025gptoss`. One of the three attention biases can be removed for free,
# and there is a short proof. A bias $b_k$ on the keys adds $q_i \cdot b_k$ to the score
# of query $i$ with **every** key $j$: a constant per row, which softmax ignores. So the
# weights and the output do not change {cite}`namazifar2023role`. The query bias adds
# $b_q \cdot k_j$, which depends on the key: it does matter. The value bias adds $b_v$ to
# every value, and since each row of weights sums to one, it adds exactly $b_v$ to every
# head's output, hence $W_o b_v$ after the output projection: a constant the output bias
# could absorb. We check all three on `MultiHeadAttention` with separate projections:

# %%
torch.manual_seed(0)
mha = MultiHeadAttention(
    32, 4, bias=True, fused_qkv=False, impl="reference", causal=True
).double()
x = torch.randn(2, 7, 32, dtype=torch.float64)


def with_bias(proj: str, rope=None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The causal output after setting one projection's bias (zero if None), with the
    RoPE table ``rope`` given to the layer for this call (None: no positions)."""
    layer = getattr(mha, proj)
    old = layer.bias.detach().clone()
    mha.rope = rope
    with torch.no_grad():
        layer.bias.copy_(torch.zeros_like(old) if bias is None else bias)
        out = mha(x)
        layer.bias.copy_(old)
    mha.rope = None
    return out


b_rand = torch.randn(32, dtype=torch.float64)
gap = {
    p: (with_bias(p, bias=b_rand) - with_bias(p)).abs().max().item()
    for p in ("q_proj", "k_proj", "v_proj")
}
shift = with_bias("v_proj", bias=b_rand) - with_bias("v_proj")
print(
    f"max change of the output: query bias {gap['q_proj']:.2f}, "
    f"value bias {gap['v_proj']:.2f}, "
    f"key bias < 1e-12: {gap['k_proj'] < 1e-12}"
)
assert gap["k_proj"] < 1e-12 and gap["q_proj"] > 1e-2
assert torch.allclose(
    shift, (mha.out_proj.weight @ b_rand).expand_as(shift), atol=1e-12
)  # W_o b_v

rope = RotaryEmbedding(8, 10000.0, max_len=7)  # head width 8, positions 0..6
gap_rope = (
    (with_bias("k_proj", rope, b_rand) - with_bias("k_proj", rope)).abs().max().item()
)
print(f"with RoPE, the key bias moves the output by up to {gap_rope:.2f}")
assert gap_rope > 1e-2

# %% [markdown]
# Without positions in the scores, the key bias changes nothing (to $10^{-12}$), the query
# bias does, and the value bias shifts every output by exactly $W_o b_v$. With RoPE the
# proof breaks: the key bias is rotated with its key, so $q_i \cdot R_{j-i} b_k$ now
# depends on the distance, and the key bias acts as a learned, position-dependent score
# for every query. That is one reason a RoPE model might keep it, though gpt-oss's report
# gives none. Among our presets only GPT-2 and gpt-oss carry attention biases:

# %%
with_biases = [n for n, c in PRESETS.items() if c.qkv_bias]
print(with_biases)
assert with_biases == ["gpt2", "gpt2-xl", "gpt-oss-120b"]

# %% [markdown]
# ## 4 · Dropout is gone
#
# The 2017 Transformer dropped 10% of every sublayer's output and of the attention
# weights {cite}`vaswani2017attention`; GPT-2's configuration still sets 0.1 everywhere.
# Dropout fights overfitting: a model that sees the same examples for many epochs learns
# them by heart, and random masks make that harder {cite}`srivastava2014dropout`.
# Pretraining a large model is a single pass over trillions of tokens: every batch is new,
# so the training loss *is* a held-out loss and there is nothing to memorise. Dropout then
# only slows learning (each step trains a thinned network) and costs a mask per
# activation. Llama and every model since train without it, and a 2025 study found that
# single-epoch pretraining with dropout was worse on downstream tasks at every size it
# tried {cite}`liu2025drop`. The book's own runs follow the same regime: chapters 5 to 9
# sample fresh windows at every step and use `dropout=0.0`, the `ModelConfig` default.
# Dropout comes back when data does repeat, in fine-tuning on small sets.
#
# ## 5 · Attention sinks: a head may attend to nothing
#
# A row of softmax weights sums to one. If no key is relevant to a query, the head must
# still put its weight somewhere, and trained models put it on the first token, which
# becomes a "sink" of attention {cite}`xiao2024efficient` {cite}`sun2024massive`. That works
# until the first token is evicted, in streaming generation with a window (chapter 9), and
# quality collapses. gpt-oss gives each head a learned logit $s_h$ that joins the
# denominator and nothing else {cite}`openai2025gptoss`:
#
# $$a_{ij} = \frac{e^{z_{ij}}}{e^{s_h} + \sum_{j'} e^{z_{ij'}}}, \qquad
# \sum_j a_{ij} = \sigma\big(\mathrm{LSE}_j(z_{ij}) - s_h\big) < 1.$$
#
# `sink_naive_attention` (in `companion.ops.sinks`, beside the 2017 core it wraps) appends
# the sink as one more score column and drops it
# after the softmax; the SDPA path cannot take an extra column, so `sink_as_key` builds a
# key every query sees, whose score is exactly $s_h$ and whose value is zero:

# %%
Code(inspect.getsource(sink_as_key), language="python")

# %%
g = torch.Generator().manual_seed(1)
q, k, v = (torch.randn(2, 4, 6, 16, generator=g) for _ in range(3))
sinks = torch.tensor([-2.0, 0.0, 1.0, 3.0])
out_ref = sink_naive_attention(q, k, v, sinks, causal=True)
w = sink_attention_weights(q, k, sinks, causal=True)
out_sdpa = sink_sdpa_attention(q, k, v, sinks, causal=True)
row_sums = w.sum(-1)  # (B, H, T)
print(
    "mean weight on real keys, per head:",
    [f"{s:.3f}" for s in row_sums.mean((0, 2)).tolist()],
)
sink_err = (out_ref - out_sdpa).abs().max()
print("naive vs SDPA with the sink key: max difference < 1e-5:", bool(sink_err < 1e-5))
assert (row_sums < 1).all() and torch.allclose(out_ref, out_sdpa, atol=1e-5)
scores = (q @ k.transpose(-2, -1) / 4).masked_fill(
    ~torch.ones(6, 6, dtype=torch.bool).tril(), -torch.inf
)
expected = torch.sigmoid(torch.logsumexp(scores, -1) - sinks.view(1, 4, 1))
assert torch.allclose(row_sums, expected, atol=1e-6)
assert (
    row_sums[:, 3].mean() < row_sums[:, 0].mean()
)  # a larger sink logit takes more weight

# %% [markdown]
# Every row now sums to less than one, by exactly $\sigma(\mathrm{LSE} - s_h)$, and a head
# with a larger sink logit keeps less weight for the real keys. The two implementations
# agree. The animation shows what this buys. One query, eight keys; key 3 holds the only
# relevant content and its score falls, frame by frame, as if that token were evicted or
# had become irrelevant. Without a sink the weight has to go somewhere, and it spreads
# over the seven irrelevant keys. With a sink ($s = 1$) it drains into the sink.

# %%
base = torch.tensor(
    [0.3, -0.2, 0.1, 0.0, -0.1, 0.2, -0.3, 0.0]
)  # irrelevant keys: scores near 0
relevant = np.linspace(5.0, -5.0, 11)
sink_logit = torch.tensor([1.0])
frames_no, frames_sink = [], []
for s in relevant:
    z = base.clone()
    z[3] = s
    frames_no.append(torch.softmax(z, 0))
    frames_sink.append(torch.softmax(torch.cat([z, sink_logit]), 0))
last_no, last_sink = frames_no[-1], frames_sink[-1]
print(f"relevant score −5: no sink, irrelevant keys hold {1 - last_no[3]:.3f};")
print(
    f"{'':<19}with sink, real keys hold {last_sink[:8].sum():.3f}, "
    f"the sink {last_sink[8]:.3f}"
)
assert 1 - last_no[3] > 0.99 and last_sink[:8].sum() < 0.75 and last_sink[8] > 0.25

fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), sharey=True)
labels = [f"k{j}" for j in range(8)]
bars_no = axes[0].bar(
    labels, frames_no[0], color=[PALETTE[1] if j == 3 else PALETTE[0] for j in range(8)]
)
bars_sink = axes[1].bar(
    labels + ["sink"],
    frames_sink[0],
    color=[PALETTE[1] if j == 3 else PALETTE[0] for j in range(8)] + [PALETTE[7]],
)
axes[0].set(ylim=(0, 1), ylabel="attention weight", title="softmax: weights sum to 1")
axes[1].set(title="with a sink logit s = 1")
fig.suptitle("When the relevant key (orange) fades, where does the weight go?")


def draw_sink(i: int) -> None:
    for bar, h in zip(bars_no, frames_no[i], strict=True):
        bar.set_height(float(h))
    for bar, h in zip(bars_sink, frames_sink[i], strict=True):
        bar.set_height(float(h))
    axes[0].set_xlabel(
        f"score of k3 = {relevant[i]:+.0f}; real keys sum to {frames_no[i].sum():.2f}"
    )
    axes[1].set_xlabel(f"real keys sum to {frames_sink[i][:8].sum():.2f}")


HTML(animate(fig, draw_sink, len(relevant), interval_ms=500))

# %% [markdown]
# Without the sink, the output at the last frame is an average of seven values that have
# nothing to do with the query, and the head writes it into the residual stream anyway.
# With the sink, 27% of the mass is gone and the output shrinks toward zero.
#
# Qwen3-Next and Trinity reach the same goal another way: a sigmoid **output gate** on each
# head's result, computed from the token itself, before the output projection
# {cite}`qiu2025gated` {cite}`singh2026trinity`. A head with nothing to say closes its
# gate. In `MultiHeadAttention(output_gate=True)` the query projection is twice as wide and
# its second half per head gives the gate's logits. We force them: a bias of −30 closes
# every gate, +30 opens it, and the open module must equal one without a gate that has the
# same query, key, value and output weights:

# %%
torch.manual_seed(0)
d, H, Dh = 32, 4, 8
kw = {"bias": False, "qkv_bias": True, "impl": "reference", "causal": True}
plain = MultiHeadAttention(d, H, **kw).double()
gated = MultiHeadAttention(d, H, **kw, output_gate=True).double()
q_rows = 2 * H * Dh
with torch.no_grad():
    w_q = gated.qkv.weight[:q_rows].view(
        H, 2, Dh, d
    )  # per head: [query rows, gate rows]
    b_q = gated.qkv.bias[:q_rows].view(H, 2, Dh)
    w_q[:, 1] = 0.0
    plain.qkv.weight.copy_(
        torch.cat([w_q[:, 0].reshape(H * Dh, d), gated.qkv.weight[q_rows:]])
    )
    plain.qkv.bias.copy_(
        torch.cat([b_q[:, 0].reshape(H * Dh), gated.qkv.bias[q_rows:]])
    )
    plain.out_proj.weight.copy_(gated.out_proj.weight)
    outs = {}
    for name, logit in (("closed", -30.0), ("open", 30.0)):
        b_q[:, 1] = logit
        outs[name] = gated(x)
    ref_plain = plain(x)
print(
    f"gate closed: max |output| < 1e-10 · max |plain output|: "
    f"{outs['closed'].abs().max() < 1e-10 * ref_plain.abs().max()};"
)
print(
    f"gate open:   max |gated - plain| < 1e-10: "
    f"{(outs['open'] - ref_plain).abs().max() < 1e-10}"
)
assert outs["closed"].abs().max() < 1e-10 * ref_plain.abs().max()
assert torch.allclose(outs["open"], ref_plain, atol=1e-10)
next_cfg = preset("qwen3-next-80b-a3b")
gate_params = (
    count_params(next_cfg).breakdown["attention"]
    - count_params(next_cfg.replace(attn_output_gate=False)).breakdown["attention"]
)
print(f"Qwen3-Next-80B's output gates: {gate_params:,} parameters")
assert (
    gate_params == next_cfg.layer_types.count("full") * 2048 * 16 * 256 == 100_663_296
)

# %% [markdown]
# A closed gate silences the head completely (the output is $\sigma(-30) \approx 10^{-13}$
# of its size), an open one changes nothing. The two mechanisms differ in what they
# condition on: the sink logit is one number per head, fixed after training, and its share
# depends on how strong the real scores are; the gate is computed from the query token,
# channel by channel, so a head can be on for one token and off for the next. In Qwen3-Next
# it costs one more $d \times H D$ block in the query projection of each of its 12 softmax
# layers, 101 million parameters in an 80-billion-parameter model.
#
# ## 6 · Multi-token prediction
#
# A language model is trained to predict the next token. Multi-token prediction (MTP)
# asks, from the same forward pass, for the one after it as well {cite}`gloeckle2024better`.
# DeepSeek-V3 adds one small module {cite}`deepseekai2024deepseekv3`: at position $i$ it
# takes the trunk's last hidden state $h_i$ and the embedding of the true next token
# $t_{i+1}$, normalises and concatenates them, projects $2d \to d$, runs one extra
# Transformer block, and predicts $t_{i+2}$ through the trunk's own output head. The loss
# is $\mathcal{L}_{1} + \lambda\,\mathcal{L}_{2}$ with $\lambda = 0.3$ early in training.
# `companion.models.mtp` builds that module for a `DecoderLM`:

# %%
Code(
    inspect.getsource(MTPModule.forward) + "\n\n" + inspect.getsource(mtp_losses),
    language="python",
)

# %% [markdown]
# We train a small character model on Shakespeare twice, from the same seed and on the same
# batches: once on the next-token loss alone, with an MTP module attached but untrained,
# and once on $\mathcal{L}_1 + 0.3\,\mathcal{L}_2$.

# %%
text = load_shakespeare()
chars = CharTokenizer(text)
train_ids, val_ids = split_tokens(torch.tensor(chars.encode(text)), 0.1)
SEQ, BATCH, STEPS, LR = (256, 64, 2000, 3e-3) if FULL else (64, 32, 100, 1e-2)
cfg = tiny(
    vocab_size=chars.vocab_size,
    d_model=64,
    max_seq_len=SEQ,
    init_std=0.1,
    n_kv_heads=None,
)
x_val, y_val = sample_windows(val_ids, 128, SEQ, torch.Generator().manual_seed(5))
results = {}
for lam in (0.0, 0.3):
    seed_everything(0)
    model, mtp = DecoderLM(cfg).to(DEVICE), MTPModule(cfg).to(DEVICE)
    params = [*model.parameters(), *mtp.parameters()]
    opt = make_adamw(torch.nn.ModuleList([model, mtp]), lr=LR)
    batches = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, LR, STEPS // 10, STEPS, LR / 10)
        xb, yb = sample_windows(train_ids, BATCH, SEQ, batches, DEVICE)
        main, extra = mtp_losses(model, mtp, xb, yb)
        opt.zero_grad(set_to_none=True)
        (main + lam * extra).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    model.eval()
    mtp.eval()
    with torch.no_grad():
        l1, l2 = mtp_losses(model, mtp, x_val.to(DEVICE), y_val.to(DEVICE))
        # self-speculation: greedy text from the trunk, drafts of the token after next
        # from MTP
        seq = model.generate(x_val[:16, :16].to(DEVICE), 48)
        h, _ = trunk_forward(model, seq)
        draft = mtp(model, h[:, :-1], seq[:, 1:]).argmax(
            -1
        )  # position i drafts token i + 2
        accept = (draft[:, 15:-1] == seq[:, 17:]).float().mean().item()
    results[lam] = (l1.item(), l2.item(), accept)
counts = np.bincount(train_ids.numpy(), minlength=chars.vocab_size) / len(train_ids)
unigram = float(-(np.log(counts[y_val.numpy()] + 1e-12)).mean())
n_mtp = sum(p.numel() for p in mtp.parameters())
print(
    f"trunk {model.num_params():,} parameters, MTP module {n_mtp:,}; "
    f"unigram loss {unigram:.2f}"
)
print(
    f"{'λ':>4} {'next-token loss':>16} {'token-after-next loss':>22} "
    f"{'drafts accepted':>16}"
)
for lam, (l1, l2, acc) in results.items():
    print(f"{lam:>4} {l1:>16.3f} {l2:>22.3f} {acc:>16.1%}")
assert (
    n_mtp
    == 2 * cfg.d_model**2
    + sum(p.numel() for p in model.blocks[0].parameters())
    + 3 * cfg.d_model
)
assert all(r[0] < unigram - 0.8 for r in results.values())  # both trunks learn
assert (
    results[0.3][1] < unigram - 0.8 < results[0.0][1]
)  # only the trained module predicts t+2
assert results[0.3][2] > 0.5 > 10 * results[0.0][2]  # and only its drafts are accepted

# %% [markdown]
# Both trunks learn (their next-token losses are within a few hundredths of each other:
# at this scale we cannot tell whether the extra signal helps the trunk, and we assert
# nothing about it). The trained MTP module predicts the token after next about as well as
# the trunk predicts the next one; that is less surprising than it looks, since it is given
# the true next token as input and has one more block. The untrained one is no better than
# chance.
#
# The last column is the second use of MTP. At inference the module can run on the trunk's
# own guess for $t_{i+1}$ and draft $t_{i+2}$; the next forward pass checks the draft, and
# when it agrees, two tokens come out of one step. This is speculative decoding with a
# built-in draft model {cite}`leviathan2023fast`. On greedy continuations of 16 held-out
# prompts, the trained module's draft equals the trunk's own choice most of the time. (The
# rate flatters it: greedy text from a model this small repeats itself, and repeated text
# is easy to draft. DeepSeek-V3 reports 85 to 90% for its second token
# {cite}`deepseekai2024deepseekv3`, a figure quoted here, not measured.) DeepSeek-V3 can
# drop its module after training or keep it for this purpose; Step 3.5 Flash and GLM-4.7
# ship three MTP layers and keep them at inference for speculation.
#
# ## 7 · Width versus depth
#
# gpt-oss-20b and Qwen3-30B-A3B are mixture-of-experts models of about the same size,
# built in opposite shapes: 24 layers of width 2,880 against 48 layers of width 2,048. We
# build both from their released configurations (the presets hold their larger siblings,
# so we change the fields that differ) and let the calculator of chapter 13 count them:

# %%
gpt_oss_20b = preset("gpt-oss-120b").replace(
    n_layers=24,
    n_experts=32,
    layer_types=tuple("full" if i % 2 else "sliding" for i in range(24)),
)
qwen3_30b = preset("qwen3-235b-a22b").replace(
    d_model=2048,
    n_layers=48,
    n_heads=32,
    n_kv_heads=4,
    head_dim=128,
    d_ff=6144,
    expert_d_ff=768,
    n_experts=128,
    experts_per_token=8,
)
shape, column = {}, {}
for name, cfg_m in (("gpt-oss-20b", gpt_oss_20b), ("Qwen3-30B-A3B", qwen3_30b)):
    pc = count_params(cfg_m)
    per_layer = (
        pc.active_without_embeddings - pc.breakdown["lm_head"]
    ) // cfg_m.n_layers
    flops = flops_per_token(cfg_m, 4096)
    kv = kv_cache_bytes_per_token(cfg_m)
    shape[name] = (pc.total, pc.active_without_embeddings, flops, kv)
    column[name] = (
        f"{cfg_m.n_layers}",
        f"{cfg_m.d_model}",
        f"{pc.total:,}",
        f"{pc.active:,}",
        f"{per_layer:,}",
        f"{flops / 1e9:.1f}",
        f"{kv:,}",
    )
quantities = (
    "layers",
    "width",
    "total",
    "active",
    "active/layer",
    "GFLOP/token",
    "KV B/token",
)
# one column per model, one row per quantity
print(f"{'':<13}" + "".join(f"{name:>16}" for name in column))
for i, quantity in enumerate(quantities):
    print(f"{quantity:<13}" + "".join(f"{col[i]:>16}" for col in column.values()))
assert shape["gpt-oss-20b"] == (20_914_757_184, 3_608_307_264, 8_044_756_992, 49_152)
assert shape["Qwen3-30B-A3B"] == (30_532_122_624, 3_041_867_776, 9_304_539_136, 98_304)
assert (
    round(shape["gpt-oss-20b"][0] / 1e9, 1) == 20.9
    and round(shape["Qwen3-30B-A3B"][0] / 1e9, 1) == 30.5
)
assert (
    round(shape["gpt-oss-20b"][1] / 1e9, 2) == 3.61
)  # the model card's active count (no embeddings)

# %% [markdown]
# The totals, 20.9 and 30.5 billion, are the model cards' {cite}`openai2025gptoss`
# {cite}`yang2025qwen3`, and gpt-oss's 3.61 billion active parameters is our count without
# the embedding table (the "active" row above includes it; model cards do not agree on
# that convention). So the deeper model holds half again as many parameters, but each of
# its tokens touches fewer of them per layer: 57 million against 126 million. In
# exchange it runs 48 layers one after the other. Each layer is a step that cannot start
# before the previous one ends, so at batch size one, where decoding is a sequence of
# small matrix products, a shallow and wide model finishes a token in fewer, larger steps,
# which suits the hardware better; a deeper model cannot be split across devices along
# its depth without pipeline bubbles. Its KV cache per token is twice as large here (48
# layers against 24, before gpt-oss's sliding windows even start to help).
#
# What depth buys is harder to measure. Deeper networks compose more steps of
# computation per parameter, and for a fixed budget they have been reported slightly
# better; the only controlled comparison near this scale we know of, in the Gemma 2
# report, found a wide 9B model slightly *ahead* of a deep one {cite}`gemmateam2024gemma2`.
# One data point, at one size: width versus depth is set by serving constraints at least
# as much as by loss.
#
# ## Summary
#
# - Vocabularies grew from 50,257 (GPT-2) to 262,144 entries (Gemma 3). The fp32 logits of
#   8 × 8,192 tokens over Qwen3's 151,936 entries take 37 GiB. Chunked cross-entropy with a
#   recomputing backward gives the same loss and gradients while holding two $(C, V)$
#   chunks and the head's gradient: 20 MiB instead of 192 MiB in our test, exactly as the
#   arithmetic predicts.
# - Tying the head to the embedding saves $Vd$ parameters: 21% of SmolLM2-135M, 0.14% of
#   DeepSeek-V3. Small models tie, large ones do not.
# - The key bias is provably redundant without RoPE (the output moved by $3 \cdot 10^{-16}$),
#   the value bias is the constant $W_o b_v$, the query bias matters; with RoPE the key
#   bias becomes a position-dependent score.
# - Dropout guards against repetition, and single-pass pretraining has none.
# - A sink logit lets a head's weights sum to $\sigma(\mathrm{LSE} - s_h) < 1$; as an extra
#   zero-valued key it runs on SDPA unchanged. A sigmoid output gate can close a head
#   entirely, per token.
# - A DeepSeek-V3-style MTP module (74,048 parameters next to a 136,256-parameter trunk)
#   learned to predict the token after next, and its drafts matched most of the trunk's
#   greedy tokens: a built-in speculative decoder.
# - gpt-oss-20b (24 × 2,880) and Qwen3-30B-A3B (48 × 2,048): 20.9 and 30.5 billion
#   parameters, 126 and 57 million active per layer, a KV cache of 48 and 96 KiB per token.
#
# ## Exercises
#
# 1. Add label smoothing (chapter 4) to `chunked_cross_entropy`. What extra number per
#    row must the forward pass keep, and how does the backward change?
#
# ```{admonition} Solution
# :class: dropdown
# The smoothed loss adds $\frac{\varepsilon}{V}\sum_v (\mathrm{LSE} - z_v)$ per row, so the
# forward also keeps $\sum_v z_v$ of each chunk (one number per row, accumulated while the
# chunk is live). In the backward the gradient of the logits becomes
# $\mathrm{softmax}(z) - (1-\varepsilon)\,\mathrm{onehot}(y) - \varepsilon / V$: still per row,
# still chunkable. Check it against `label_smoothed_cross_entropy` of `companion.training`
# (which spreads ε over the V − 1 other classes: adjust one of the two).
# ```
#
# 2. The chunked backward computes every chunk's logits a second time. Count the FLOPs of
#    the reference and the chunked loss, forward plus backward, for $N$ rows, width $d$
#    and vocabulary $V$.
#
# ```{admonition} Solution
# :class: dropdown
# Reference: $2NdV$ forward, $4NdV$ backward (gradients of hidden and head). Chunked: $2NdV$
# forward, $2NdV + 4NdV$ backward. So $8NdV$ against $6NdV$: a third more for the loss,
# which is a small part of a whole step for any model with more than a few layers.
# ```
#
# 3. Prove that a bias on the keys cancels in softmax attention with a causal mask, and
#    find the smallest change to the attention function that makes it matter again
#    (without RoPE).
#
# ```{admonition} Solution
# :class: dropdown
# The masked scores of row $i$ all gain $q_i \cdot b_k$, masked ones stay $-\infty$, and
# softmax is invariant to adding a constant to a row. Anything that breaks "constant per
# row" brings it back: RoPE (shown above), ALiBi-style biases do not (they add to scores,
# the key bias still adds a row constant), but a sink does: the sink's logit does not gain
# $q_i \cdot b_k$, so the share of the real keys changes. Try
# `sink_naive_attention(q, k + b, v, s)` against `sink_naive_attention(q, k, v, s)`.
# ```
#
# 4. Train the model of section 6 with `attn_sinks=True` in its `ModelConfig` (and once
#    with `attn_output_gate=True`), then look at `model.attention_maps(...)`: how much
#    weight does the first token receive with and without sinks?
#
# ```{admonition} Hint
# :class: dropdown
# Use the MTP section's config and training loop with `lam = 0`, or `companion.training.train`.
# Average the weights of each head on key 0 over all queries beyond the tenth. Tiny models
# trained for a few hundred steps show weak sinks; the effect grows with training time.
# ```
#
# 5. Extend `MTPModule` to two depths, as in DeepSeek-V3's sequential scheme: the second
#    module takes the first one's hidden states and the embedding of $t_{i+2}$ to predict
#    $t_{i+3}$. How does the acceptance rate of its drafts compare with the first module's?
#
# ```{admonition} Hint
# :class: dropdown
# Have `MTPModule.forward` also return the block's output before the final norm, and pass
# it as `hidden` to the second module with `next_ids = y[:, 1:-1]`; its targets are
# `y[:, 2:]`. Expect lower acceptance: each further draft token must also survive the
# previous draft's errors.
# ```

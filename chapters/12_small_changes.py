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
# ```{admonition} The question
# :class: tip
# Which of the one-line configuration changes since 2017, from a larger vocabulary to multi-token prediction, are bigger than they look, and what does each of them buy?
# Mostly memory, parameters and decoding, not measured quality: chunked cross-entropy gave the same loss and gradients with roughly a tenth of the loss's memory peak in our test, tying pays only in small models, the key bias provably does nothing without RoPE, sinks and output gates let a head fall silent, and a multi-token module learned to draft the trunk's own next pick about three times in four without measurably improving its next-token loss over five seeds, while dropout and width against depth are argued from configurations and published evidence, not measured here.
# ```
#
# Some of the changes between 2017 and 2026 fill a chapter each: RoPE, RMSNorm, SwiGLU,
# grouped heads, experts. Others take one line of a config file: a bigger vocabulary,
# `tie_word_embeddings: false`, `attention_bias: false`, `dropout: 0.0`, a `sinks`
# tensor, a `num_nextn_predict_layers: 1`, a different ratio of layers to width. This
# chapter takes seven of these one-liners and shows why none of them is as small as it
# looks: five with an experiment or an exact count run here, two (dropout, and width
# against depth) with a check of the configurations and the published evidence, since
# the experiment that would settle them is a pretraining run far beyond this chapter's
# budget:
#
# 1. a larger vocabulary moves the memory peak of training to the loss, and chunked
#    cross-entropy removes it;
# 2. tying the output head to the embedding matters for small models only;
# 3. the key bias is provably useless without RoPE, and the value bias can be folded away;
# 4. dropout left because pretraining sees each token once;
# 5. attention sinks, and the output gate, let a head say nothing;
# 6. multi-token prediction trains a built-in draft model;
# 7. two models of the same size can have opposite shapes.

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
import dataclasses
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
from companion.analysis.seeds import difference, spread
from companion.device import default_device, describe
from companion.layers.mha import MultiHeadAttention
from companion.layers.rotary import RotaryEmbedding
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.models.mtp import MTPModule, mtp_losses, trunk_forward
from companion.models.presets import PRESETS, preset, tiny
from companion.models.speculative import MTPDrafter, speculative_generate
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
from companion.plotting import PALETTE, animate, glue, use_style
from companion.tasks.text import (
    CharTokenizer,
    load_shakespeare,
    sample_windows,
    split_tokens,
)
from companion.training import cosine_lr, make_adamw, seed_everything

# True: a bigger loss experiment and a longer multi-token run (use a GPU)
FULL = False
DEVICE = default_device() if FULL else torch.device("cpu")
use_style()
seed_everything(0)
# tiny tensors: one thread, whatever else runs on the machine
torch.set_num_threads(1)
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
# the released configurations' vocab_size fields (model cards); Gemma 3's checkpoint
# table has 64 rows more than its 262,144-entry tokenizer
assert list(vocab.values()) == [50_257, 128_256, 151_936, 262_208]

# %% [markdown]
# The table itself is cheap: $V d$ numbers, {glue:text}`ch12-dsv3-table` of DeepSeek-V3
# ({ref}`section 2 <ch12-tying>`). The
# cost is the **logits**. The loss needs a score for every vocabulary entry at every
# position, a tensor of shape $(B, S, V)$, usually in fp32. For a batch of 8 sequences of
# 8,192 tokens with Qwen3's vocabulary:
#
# $$8 \times 8192 \times 151{,}936 \times 4 \text{ bytes} \approx 37 \text{ GiB},$$

# %%
qwen_logits = logits_bytes(8, 8192, 151_936)
print(f"{qwen_logits:,} bytes = {qwen_logits / GiB:.2f} GiB")
# against the size PyTorch gives such a tensor (on the meta device: no memory taken)
assert qwen_logits == torch.empty(8, 8192, 151_936, device="meta").nbytes
glue("ch12-qwen-logits", f"{qwen_logits / GiB:.0f} GiB", display=False)

# %% [markdown]
# that is {glue:text}`ch12-qwen-logits`: one tensor, for one micro-batch, and the
# backward pass wants a second of the same size
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
# vocabulary of 16,384, with chunks of 128 rows. `PeakMemory`
# ({doc}`chapter 2 <02_attention>`) counts the bytes
# of every tensor created inside its block, deterministically, so its figures can be
# compared with the arithmetic.

# %% tags=["hide-input"]
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
glue("ch12-full-logits-mib", f"{full_logits / MiB:.0f}", display=False)
glue("ch12-ref-peak", f"{ref[3] / MiB:.0f} MiB", display=False)
glue("ch12-chunk-peak", f"{chunk[3] / MiB:.0f} MiB", display=False)

# %% [markdown]
# Same loss, same gradients (to fp32 rounding), and the peak follows the arithmetic. The
# reference holds three $(N, V)$ tensors at its peak: the logits, the log-softmax that
# `F.cross_entropy` saves for the backward, and the gradient of the logits: three times
# {glue:text}`ch12-full-logits-mib` MiB, {glue:text}`ch12-ref-peak` measured here. The
# chunked form holds two $(C, V)$ tensors of one chunk (the recomputed logits and their
# softmax) plus the gradient of the $(V, d)$ head, which it must hold anyway:
# {glue:text}`ch12-chunk-peak`, independent of $N$. The peak now grows with the chunk,
# not with
# the batch:

# %% tags=["hide-input"]
sizes = [32, 64, 128, 256, 512, 1024]
peaks = [loss_and_grads(chunked_cross_entropy, chunk_size=c)[3] for c in sizes]
fig, ax = plt.subplots(figsize=(6.4, 3.4))
ax.plot(
    sizes, [p / MiB for p in peaks], "o-", color=PALETTE[0],
    label="chunked, measured"
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
peak_cn = (
    peaks[sizes.index(N)]
    if N in sizes
    else loss_and_grads(chunked_cross_entropy, chunk_size=N)[3]
)
# one chunk of all N rows still holds less than the reference
assert peak_cn < ref[3]
glue("ch12-c-eq-n-saving", f"{1 - peak_cn / ref[3]:.0%}", display=False)

# %% [markdown]
# The price is one more matrix product per chunk in the backward pass (the logits are
# computed twice), which adds a third to the loss's FLOPs (exercise 2 counts them), a
# price usually worth the memory it saves. At $C = N$ the chunked form still holds
# {glue:text}`ch12-c-eq-n-saving` less than the reference, because it never stores the
# log-softmax. A training run whose memory profile has
# an unexplained cliff at the loss is meeting its logits.
#
# (ch12-tying)=
# ## 2 · Weight tying: only for small models
#
# The 2017 Transformer shared one matrix between the input embedding and the output
# projection {cite}`vaswani2017attention` {cite}`press2017using`, and GPT-2 kept it. It
# saves $V d$ parameters. Whether that matters depends on how large the rest of the model
# is. `count_params` ({doc}`chapter 13 <13_build_a_model>`) counts the released
# configurations exactly:

# %% tags=["hide-input"]
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
# the totals against the published checkpoints' counts (safetensors metadata)
assert [r[0] for r in rows.values()] == [134_515_008, 8_030_261_248, 671_026_419_200]
smol_cfg = preset("smollm2-135m")
untied_smol = count_params(smol_cfg.replace(tie_embeddings=False)).total
print(
    f"SmolLM2-135M untied would have {untied_smol:,} parameters "
    f"(+{untied_smol / rows['smollm2-135m'][0] - 1:.0%})"
)
# untying adds exactly one (V, d) output matrix
assert untied_smol - rows["smollm2-135m"][0] == \
    smol_cfg.vocab_size * smol_cfg.d_model
ds_cfg = preset("deepseek-v3")
ds_saving = ds_cfg.vocab_size * ds_cfg.d_model / rows["deepseek-v3"][0]
gemma = count_params(preset("gemma3-27b"))
gemma_share = gemma.breakdown["embedding"] / gemma.total
print(
    f"tying would save DeepSeek-V3 {ds_saving:.2%}; Gemma 3 27B's table: "
    f"{gemma_share:.1%}"
)
tie = [n for n, c in PRESETS.items() if c.tie_embeddings]
print("presets that tie:\n ", ", ".join(tie))
for name, (tot, tables, _tied) in rows.items():
    glue(f"ch12-tables-{name}", f"{tables / tot:.2%}", display=False)
glue(
    "ch12-smol-table",
    f"{rows['smollm2-135m'][1] / rows['smollm2-135m'][0]:.0%}",
    display=False,
)
glue(
    "ch12-smol-untied",
    f"{untied_smol / rows['smollm2-135m'][0] - 1:.0%}",
    display=False,
)
glue(
    "ch12-llama-tables",
    f"{rows['llama3-8b'][1] / rows['llama3-8b'][0]:.0%}",
    display=False,
)
glue("ch12-dsv3-table", f"{ds_saving:.2%}", display=False)
glue("ch12-gemma-table", f"{gemma_share:.1%}", display=False)

# %% [markdown]
# In SmolLM2-135M the one shared table is {glue:text}`ch12-smol-table` of the model;
# untying it would add another {glue:text}`ch12-smol-untied`. In Llama 3 8B the two untied
# tables are {glue:text}`ch12-llama-tables`, in DeepSeek-V3
# {glue:text}`ch12-tables-deepseek-v3`, of which tying would save half,
# {glue:text}`ch12-dsv3-table`. So small models tie (SmolLM2, the smallest Qwen3 models)
# and most large ones do not: the parameters are cheap there, and a separate output matrix
# is free to learn something other than the input table. Gemma 3 is the exception: it
# ties at every size, 27B included, where its 262,208-row table is still
# {glue:text}`ch12-gemma-table` of the model.
#
# ## 3 · Biases: gone, then partly back
#
# PaLM trained without a bias in any dense layer or layer norm, and reported that this
# made large models train more stably {cite}`chowdhery2022palm`; Llama followed a year
# later {cite}`touvron2023llama`, and most models since have too, except for the
# attention projections of Qwen2 and gpt-oss {cite}`openai2025gptoss`. One of the three
# attention biases can be removed for free, and there is a short proof. A bias $b_k$ on
# the keys adds $q_i \cdot b_k$ to the score of query $i$ with **every** key $j$: a
# constant per row, which softmax ignores. So the weights and the output do not change
# {cite}`namazifar2023role`. The query bias adds
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
glue("ch12-key-bias-gap", f"{gap['k_proj']:.0e}", display=False)
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
# Without positions in the scores, the key bias changes nothing (the output moved by
# {glue:text}`ch12-key-bias-gap`, float64 rounding), the query
# bias does, and the value bias shifts every output by exactly $W_o b_v$. With RoPE the
# proof breaks: the key bias is rotated with its key, so $q_i \cdot R_{j-i} b_k$ now
# depends on the distance, and the key bias acts as a learned, position-dependent score
# for every query. That is one reason a RoPE model might keep it, though gpt-oss's report
# gives none. Among our presets only GPT-2, GPT-3 (the same block) and gpt-oss carry
# attention biases:

# %%
with_biases = [n for n, c in PRESETS.items() if c.qkv_bias]
print(with_biases)
assert with_biases == ["gpt2", "gpt2-xl", "gpt3-175b", "gpt-oss-120b"]

# %% [markdown]
# ## 4 · Dropout is gone
#
# The 2017 Transformer dropped 10% of every sublayer's output and of the attention
# weights {cite}`vaswani2017attention`; GPT-2's released configuration still sets 0.1
# everywhere.
# Dropout fights overfitting: a model that sees the same examples for many epochs learns
# them by heart, and random masks make that harder {cite}`srivastava2014dropout`.
# Pretraining a large model is a single pass over trillions of tokens: every batch is new,
# so the training loss *is* a held-out loss and there is nothing to memorise. Dropout then
# only slows learning (each step trains a thinned network) and costs a mask per
# activation. Llama and most models since train without it, and a 2025 study reports
# that single-epoch pretraining with dropout did worse on downstream tasks than without,
# at the sizes it tried {cite}`liu2025drop`. We do not repeat that experiment here: the
# effect it reports needs real pretraining runs, and a few hundred steps of a toy model
# would only measure noise. The book's own runs follow the same regime: chapters
# {doc}`5 <05_position>` to {doc}`9 <09_sliding_windows>` sample fresh windows at every
# step and use `dropout=0.0`, the `ModelConfig` default (checked below), and the presets
# of released models carry 0 as well. Dropout comes back when data does repeat, in
# fine-tuning on small sets.

# %% tags=["hide-input"]
default_dropout = {
    f.name: f.default
    for f in dataclasses.fields(ModelConfig)
    if f.name in ("dropout", "attn_dropout")
}
print("ModelConfig defaults:", default_dropout)
print("presets with dropout:", [n for n, c in PRESETS.items() if c.dropout > 0])
assert default_dropout == {"dropout": 0.0, "attn_dropout": 0.0}
assert not any(c.dropout > 0 or c.attn_dropout > 0 for c in PRESETS.values())

# %% [markdown]
# ## 5 · Attention sinks: a head may attend to nothing
#
# A row of softmax weights sums to one. If no key is relevant to a query, the head must
# still put its weight somewhere, and trained models put it on the first token, which
# becomes a "sink" of attention {cite}`xiao2024efficient` {cite}`sun2024massive`. That works
# until the first token is evicted, in streaming generation with a window
# ({doc}`chapter 9 <09_sliding_windows>`), and
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
# agree. {numref}`fig-sink` shows what this buys. One query, eight keys; key 3 holds the
# only relevant content and its score falls, frame by frame, as if that token were evicted
# or had become irrelevant. Without a sink the weight has to go somewhere, and it spreads
# over the seven irrelevant keys. With a small sink logit ($s = 1$) only part of it leaves:
# at the last frame the sink holds {glue:text}`ch12-sink-share` and the real keys still
# {glue:text}`ch12-sink-real`, since seven scores near 0 together outweigh one sink logit
# of 1. With a large one ($s = 4$, the right panel) the sink takes most of the weight.

# %% tags=["hide-input"]
base = torch.tensor(
    [0.3, -0.2, 0.1, 0.0, -0.1, 0.2, -0.3, 0.0]
)  # irrelevant keys: scores near 0
relevant = np.linspace(5.0, -5.0, 11)
sink_logit = torch.tensor([1.0])


def sink_frames(sink: torch.Tensor | None) -> list[torch.Tensor]:
    """One row of weights per score of k3: over the 8 keys, and the sink if given."""
    frames = []
    for s in relevant:
        z = base.clone()
        z[3] = s
        frames.append(torch.softmax(z if sink is None else torch.cat([z, sink]), 0))
    return frames


frames_no, frames_sink = sink_frames(None), sink_frames(sink_logit)
last_no, last_sink = frames_no[-1], frames_sink[-1]
print(f"relevant score −5: no sink, irrelevant keys hold {1 - last_no[3]:.3f};")
print(
    f"{'':<19}with sink, real keys hold {last_sink[:8].sum():.3f}, "
    f"the sink {last_sink[8]:.3f}"
)
# the sink's share against its closed form σ(s − LSE(z)) at the last frame
z_last = base.clone()
z_last[3] = relevant[-1]
sink_closed = torch.sigmoid(sink_logit - torch.logsumexp(z_last, 0))
assert torch.isclose(last_sink[8], sink_closed[0]) and 1 - last_no[3] > 0.99
glue("ch12-sink-share", f"{last_sink[8]:.3f}", display=False)
glue("ch12-sink-real", f"{last_sink[:8].sum():.3f}", display=False)
glue("ch12-sink-gone", f"{last_sink[8]:.0%}", display=False)


# %% tags=["remove-output", "hide-input"]
# a head that has learned a large sink logit: the same frames with s = 4
big_sink = torch.tensor([4.0])
frames_big = sink_frames(big_sink)
first_big, last_big = frames_big[0], frames_big[-1]
assert last_big[8] > 0.85 and first_big[3] > 0.7  # the sink takes what k3 leaves
glue("ch12-bigsink-share", f"{last_big[8]:.0%}", display=False)
glue("ch12-bigsink-real", f"{last_big[:8].sum():.0%}", display=False)
glue("ch12-bigsink-k3", f"{first_big[3]:.0%}", display=False)
glue("ch12-bigsink-first", f"{first_big[8]:.0%}", display=False)
panels = [  # title, frames: one row of weights per score of k3
    ("plain softmax: weights sum to 1", frames_no),
    ("sink logit s = 1", frames_sink),
    (f"sink logit s = {big_sink.item():.0f}", frames_big),
]
labels = [f"k{j}" for j in range(8)] + ["sink"]
colors = [PALETTE[1] if j == 3 else PALETTE[0] for j in range(8)] + [PALETTE[7]]
fig, axes = plt.subplots(1, 3, figsize=(11, 3.6), sharey=True)
bars = []
for ax, (title, frames) in zip(axes, panels, strict=True):
    n = len(frames[0])  # 8 keys, or 8 keys and the sink
    bars.append(ax.bar(labels[:n], frames[0], color=colors[:n]))
    ax.set_title(title)
    ax.tick_params(axis="x", labelsize=8)
axes[0].set(ylim=(0, 1), ylabel="attention weight of one query")


def draw_sink(i: int) -> None:
    for ax, group, (_, frames) in zip(axes, bars, panels, strict=True):
        for bar, h in zip(group, frames[i], strict=True):
            bar.set_height(float(h))
        real = frames[i][:8].sum()
        sink = f" · sink {1 - real:.2f}" if len(frames[i]) > 8 else ""
        ax.set_xlabel(f"real keys {real:.2f}{sink}")
    fig.suptitle(
        f"Score of the relevant key k3 (orange): {relevant[i]:+.0f}. "
        "As it fades, where does the weight go?"
    )


glue("fig-sink", HTML(animate(fig, draw_sink, len(relevant), interval_ms=500)))

# %% [markdown]
# ```{glue:figure} fig-sink
# :name: fig-sink
#
# Where one query's attention weight goes as the only relevant key, k3 (orange), fades,
# one frame per score of k3 from +5 to −5; the seven other keys score near 0. Left, plain
# softmax: the weights sum to 1, so k3's weight moves to the irrelevant keys. Middle, a
# sink logit $s = 1$: at the last frame the sink (black) holds
# {glue:text}`ch12-sink-share` and the real keys still {glue:text}`ch12-sink-real`.
# Right, a large sink logit $s = 4$: while k3 scores +5 it keeps
# {glue:text}`ch12-bigsink-k3` of the weight and the sink takes
# {glue:text}`ch12-bigsink-first`; once k3 has faded the sink absorbs
# {glue:text}`ch12-bigsink-share` and the real keys keep {glue:text}`ch12-bigsink-real`.
# ```

# %% [markdown]
# Without the sink, the output at the last frame is an average of seven values that have
# nothing to do with the query, and the head writes it into the residual stream anyway.
# With the sink, {glue:text}`ch12-sink-gone` of the mass is gone and the output shrinks by
# that share toward zero; the rest still averages the irrelevant values. Silencing the
# head takes a sink logit well above the real scores, which is what training can learn
# to set per head: with $s = 4$ the sink absorbs {glue:text}`ch12-bigsink-share` of the
# mass at the last frame and the real keys keep {glue:text}`ch12-bigsink-real`, so the
# head writes that fraction of the average it would otherwise write.
# The logit is fixed, so it taxes relevant keys too: in the first frame, with k3 scoring
# +5, the sink still takes {glue:text}`ch12-bigsink-first`.
#
# Qwen3-Next and Trinity reach the same goal another way: a sigmoid **output gate** on each
# head's result, computed from the token itself, before the output projection
# {cite}`qiu2025gated` {cite}`singh2026trinity`. A head with nothing to say closes its
# gate. In `MultiHeadAttention(output_gate=True)` the query projection is twice as wide and
# its second half per head gives the gate's logits. We force them: a bias of −30 closes
# every gate, +30 opens it, and the open module must equal one without a gate that has the
# same query, key, value and output weights:

# %% tags=["hide-input"]
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
n_full = next_cfg.layer_types.count("full")
# one (d, H·D) gate block per softmax layer, counted by hand from the config
assert gate_params == \
    n_full * next_cfg.d_model * next_cfg.n_heads * next_cfg.head_dim
glue("ch12-gate-layers", f"{n_full}", display=False)
glue("ch12-gate-params", f"{gate_params / 1e6:.0f} million", display=False)

# %% [markdown]
# A closed gate silences the head completely (the output is $\sigma(-30) \approx 10^{-13}$
# of its size), an open one changes nothing. The two mechanisms differ in what they
# condition on: the sink logit is one number per head, fixed after training, and its share
# depends on how strong the real scores are; the gate is computed from the query token,
# channel by channel, so a head can be on for one token and off for the next. In Qwen3-Next
# it costs one more $d \times H D$ block in the query projection of each of its
# {glue:text}`ch12-gate-layers` softmax layers, {glue:text}`ch12-gate-params` parameters
# in an 80-billion-parameter model.
#
# (ch12-mtp)=
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
# We train a small character model on Shakespeare twice per seed, from the same initial
# weights and on the same batches: once on the next-token loss alone, with an MTP module
# attached but untrained, and once on $\mathcal{L}_1 + 0.3\,\mathcal{L}_2$. Each model is
# scored on held-out text: its two losses, and how often the module's draft of the token
# after next is the token the trunk itself picks there, which is what self-speculation
# needs (explained after the table). That agreement is measured twice: on held-out
# Shakespeare, where the module is given the true next token, and on continuations the
# trunk writes greedily from 16 held-out prompts.
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
train_ids, val_ids = split_tokens(torch.tensor(chars.encode(text)), 0.1)
SEQ, BATCH, STEPS, LR = (256, 64, 2000, 3e-3) if FULL else (64, 32, 100, 1e-2)
cfg = tiny(
    vocab_size=chars.vocab_size,
    d_model=64,
    max_seq_len=SEQ,
    init_std=0.1,
    n_kv_heads=None,
)
val_gen = torch.Generator().manual_seed(5)
x_val, y_val = sample_windows(val_ids, 128, SEQ, val_gen, DEVICE)
SEEDS = (0, 1, 2, 3, 4)


def train_with_mtp(lam: float, seed: int) -> tuple[DecoderLM, MTPModule]:
    """Trunk and MTP module trained on L1 + lam * L2 (seed: weights and batches)."""
    seed_everything(seed)
    model, mtp = DecoderLM(cfg).to(DEVICE), MTPModule(cfg).to(DEVICE)
    params = [*model.parameters(), *mtp.parameters()]
    opt = make_adamw(torch.nn.ModuleList([model, mtp]), lr=LR)
    batches = torch.Generator().manual_seed(1 + seed)
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
    return model, mtp


def repeat_share(rows: torch.Tensor, n: int = 8) -> float:
    """The share of each row's n-grams that already occurred earlier in that row."""
    return float(
        np.mean(
            [
                tuple(r[i : i + n]) in {tuple(r[j : j + n]) for j in range(i)}
                for r in rows.tolist()
                for i in range(1, len(r) - n + 1)
            ]
        )
    )


def draft_scores(model: DecoderLM, mtp: MTPModule) -> dict[str, float]:
    """Held-out losses, and how often the module's draft of t_{i+2} is the
    trunk's own pick: on held-out text given the true t_{i+1} ("real"), and on the
    trunk's greedy continuations of 16 held-out prompts ("greedy")."""
    with torch.no_grad():
        l1, l2 = mtp_losses(model, mtp, x_val, y_val)
        h, logits = trunk_forward(model, x_val)
        pick = logits.argmax(-1)  # (B, S): the trunk's pick for t_{i+1}
        draft = mtp(model, h[:, :-1], y_val[:, :-1]).argmax(-1)  # t_{i+2} | t_{i+1}
        # greedy: 16 prompt + 48 new tokens
        seq = model.generate(x_val[:16, :16], 48)
        h_g, _ = trunk_forward(model, seq)
        draft_g = mtp(model, h_g[:, :-1], seq[:, 1:]).argmax(-1)
    return {
        "L1": l1.item(),
        "L2": l2.item(),
        "real": (draft == pick[:, 1:]).float().mean().item(),
        "greedy": (draft_g[:, 15:-1] == seq[:, 17:]).float().mean().item(),
        "repeats": repeat_share(seq[:, 16:]),
        "mtp right": (draft == y_val[:, 1:]).float().mean().item(),
        "trunk right": (pick[:, 1:] == y_val[:, 1:]).float().mean().item(),
    }


runs = {0.0: [], 0.3: []}  # λ -> the scores of each seed, in the order of SEEDS
trained = []  # each seed's λ = 0.3 trunk and module, drafting below
for seed in SEEDS:
    for lam, scores in runs.items():
        model, mtp = train_with_mtp(lam, seed)
        scores.append(draft_scores(model, mtp))
        trained += [(model, mtp)] if lam else []
plain, mtp_on = ({k: [r[k] for r in rs] for k in rs[0]} for rs in runs.values())
counts = np.bincount(train_ids.numpy(), minlength=chars.vocab_size) / len(train_ids)
unigram = float(-(np.log(counts[y_val.cpu().numpy()] + 1e-12)).mean())
print(f"unigram loss {unigram:.2f}; mean ± sd over seeds {SEEDS}:")
print(f"{'λ':>4}{'L1':>16}{'L2':>16}{'agree: real':>16}{'greedy':>16}")
for lam, s in zip(runs, (plain, mtp_on), strict=True):
    cells = (spread(s[k]).format(3) for k in ("L1", "L2", "real", "greedy"))
    print(f"{lam:>4}" + "".join(f"{c:>16}" for c in cells))
real_repeats = repeat_share(x_val[:, 16:])  # held-out text, the same 48-token span
print(
    f"8-grams that repeat an earlier one: greedy text "
    f"{spread(mtp_on['repeats']).format(2)}, held-out text {real_repeats:.3f}"
)
print("held-out text, top-1 right about t(i+2), both having read t(i+1):")
for label, key in (("MTP module", "mtp right"), ("trunk", "trunk right")):
    print(f"  {label:<12}{spread(mtp_on[key]).format(3)}")

# %% tags=["hide-input"]
# Bookkeeping: the module's size, the paired differences over seeds (both runs of
# a seed share weights and batches), the asserts that pin the text, and the glue.
trunk, module = DecoderLM(cfg), MTPModule(cfg)
n_mtp = sum(p.numel() for p in module.parameters())
block_params = sum(p.numel() for p in trunk.blocks[0].parameters())
assert n_mtp == 2 * cfg.d_model**2 + block_params + 3 * cfg.d_model
assert max(plain["L1"] + mtp_on["L1"]) < unigram - 0.8  # both trunks learn
# only the trained module predicts the token after next
assert max(mtp_on["L2"]) < unigram - 0.8 < min(plain["L2"])
# on held-out text its drafts agree with the trunk, the untrained module's
# hardly ever
agree_gain = difference(mtp_on["real"], plain["real"])
assert agree_gain.low > 0.5 and max(plain["real"]) < 0.05
# greedy text flatters the drafts: it repeats itself, and held-out text does not
flattery = difference(mtp_on["greedy"], mtp_on["real"])
assert flattery.verdict == 1 and min(mtp_on["repeats"]) > 0.5 > 10 * real_repeats
like = difference(mtp_on["mtp right"], mtp_on["trunk right"])  # the same targets
l1_gap = difference(plain["L1"], mtp_on["L1"])  # > 0: the MTP loss lowers L1


def pct(values: list[float]) -> str:
    """Mean ± sd over seeds, in percent."""
    s = spread(values)
    return f"{s.mean:.1%} ± {s.sd:.1%}"


glue("ch12-trunk-params", f"{trunk.num_params():,}", display=False)
glue("ch12-mtp-params", f"{n_mtp:,}", display=False)
glue("ch12-unigram", f"{unigram:.2f}", display=False)
glue("ch12-n-seeds", str(len(SEEDS)), display=False)
glue("ch12-mtp-steps", f"{STEPS}", display=False)
glue("ch12-l1-plain-seeds", spread(plain["L1"]).format(3), display=False)
glue("ch12-l1-mtp-seeds", spread(mtp_on["L1"]).format(3), display=False)
glue("ch12-l1-gap", l1_gap.format(3), display=False)
glue(
    "ch12-mtp-verdict",
    {
        1: "With these seeds the MTP loss lowered the trunk's next-token loss.",
        0: "These seeds cannot tell the two apart.",
        -1: "With these seeds the MTP loss raised the trunk's next-token loss.",
    }[l1_gap.verdict],
    display=False,
)
glue("ch12-l2-plain", spread(plain["L2"]).format(2), display=False)
glue("ch12-l2-mtp", spread(mtp_on["L2"]).format(2), display=False)
glue("ch12-accept-real", pct(mtp_on["real"]), display=False)
glue("ch12-accept-real-plain", pct(plain["real"]), display=False)
glue("ch12-accept-greedy", pct(mtp_on["greedy"]), display=False)
glue("ch12-repeat-share", f"{spread(mtp_on['repeats']).mean:.0%}", display=False)
glue("ch12-real-repeats", f"{real_repeats:.1%}", display=False)
glue("ch12-mtp-right", pct(mtp_on["mtp right"]), display=False)
glue("ch12-trunk-right", pct(mtp_on["trunk right"]), display=False)
glue("ch12-like-gap", f"{like.mean:+.1%} ± {like.half_width:.1%}", display=False)
glue(
    "ch12-like-verdict",
    {
        1: "The module's top choice is right more often than the trunk's.",
        0: "The seeds cannot tell the two apart.",
        -1: "The trunk's top choice is right more often than the module's.",
    }[like.verdict],
    display=False,
)

# %% [markdown]
# Both trunks learn: their next-token losses are far below the unigram baseline of
# {glue:text}`ch12-unigram`. Does the extra signal help the trunk? Over
# {glue:text}`ch12-n-seeds` seeds the next-token loss is {glue:text}`ch12-l1-plain-seeds`
# without the MTP loss and {glue:text}`ch12-l1-mtp-seeds` with it (mean ± sd); paired by
# seed, without minus with is {glue:text}`ch12-l1-gap`. {glue:text}`ch12-mtp-verdict`
# The gains DeepSeek-V3 reports come from ablations at a scale far beyond
# {glue:text}`ch12-mtp-steps` steps of a 64-wide model.
#
# The trained module ({glue:text}`ch12-mtp-params` parameters next to a
# {glue:text}`ch12-trunk-params`-parameter trunk) predicts the token after next with a
# loss of {glue:text}`ch12-l2-mtp`, about as well as the trunk predicts the next one, and
# the untrained one ({glue:text}`ch12-l2-plain`) does worse than the unigram baseline. That is
# less surprising than it looks: the module is given the true $t_{i+1}$, so it has read
# exactly what the trunk has read when it predicts $t_{i+2}$ at the next position. It is a
# second next-token predictor with one block of its own, not a look-ahead. Scored on the
# same held-out targets, its top choice is right {glue:text}`ch12-mtp-right` of the time
# and the trunk's {glue:text}`ch12-trunk-right` (paired difference
# {glue:text}`ch12-like-gap`). {glue:text}`ch12-like-verdict`
#
# That is what makes it useful as a draft model. At inference the module runs on the
# trunk's own pick for $t_{i+1}$ and drafts $t_{i+2}$; the next forward pass checks the
# draft, and when it agrees, two tokens come out of one step. This is speculative
# decoding with a built-in draft model {cite}`leviathan2023fast`. What counts is how
# often the draft equals the token the trunk would pick. On held-out Shakespeare, given
# the true next token (as if decoding had produced that text), the trained module's draft
# is the trunk's pick {glue:text}`ch12-accept-real` of the time (mean ± sd over seeds;
# the untrained module's {glue:text}`ch12-accept-real-plain`). On the trunk's own greedy continuations the
# same count reaches {glue:text}`ch12-accept-greedy`, but that figure flatters the
# module: greedy text from a model this small repeats itself
# ({glue:text}`ch12-repeat-share` of its 8-grams repeat an earlier one in the same
# continuation, against {glue:text}`ch12-real-repeats` in the held-out text), and repeated
# text is easy to draft. DeepSeek-V3 reports 85 to 90% acceptance for its second token
# {cite}`deepseekai2024deepseekv3`, a figure quoted here, not measured. DeepSeek-V3 can
# drop its module after training or keep it for this purpose. GLM-4.5 adds one MTP layer
# and names speculative decoding at inference as its purpose {cite}`zeng2025glm45`; Step
# 3.5 Flash's report describes a three-way MTP ("MTP-3") used to cut the latency of
# decoding {cite}`stepfun2026step35`.
#
# ### The trained module as a drafter
#
# The agreement above is counted offline. Run as a drafter, the module has to earn its
# tokens in a decoding loop: {doc}`17_speculative_decoding` builds that loop, and its
# `MTPDrafter` wraps this section's module. At each step the trunk's hidden states and
# its last chosen token give one draft; the trunk verifies it in the same forward that
# produces its own next token, so a kept draft yields two tokens for one forward of the
# trunk. We decode 8 held-out prompts of 16 characters by 48 more with each seed's
# trained trunk, and assert that the output equals the trunk's own greedy decoding.

# %%
PROMPTS = x_val[:8, :16]
kept, per_step = [], []  # per seed: the share of drafts kept, tokens per forward
for model, mtp in trained:
    alone = model.generate(PROMPTS, 48)  # the trunk by itself, greedy
    drafter, results = MTPDrafter(model, mtp), []
    for i in range(len(PROMPTS)):
        r = speculative_generate(model, PROMPTS[i : i + 1], 48, drafter)
        assert torch.equal(r.ids, alone[i : i + 1])  # the trunk's own tokens
        results.append(r)
    n_kept = sum(sum(r.accepted) for r in results)
    kept.append(n_kept / sum(sum(r.drafted) for r in results))
    per_step.append(np.mean([a + 1 for r in results for a in r.accepted]))
print(f"drafts kept {spread(kept).format(3)}")
print(f"tokens per forward of the trunk {spread(per_step).format(2)}")

# %% tags=["hide-input"]
# Bookkeeping: the glue; one draft a step, so a step yields 1 + the share kept.
assert all(abs(t - 1 - k) < 0.05 for k, t in zip(kept, per_step, strict=True))
glue("ch12-draft-kept", pct(kept), display=False)
glue("ch12-draft-tokens", spread(per_step).format(2), display=False)

# %% [markdown]
# Every seed's speculative output is the trunk's own, and the module's draft is kept
# {glue:text}`ch12-draft-kept` of the time (mean ± sd over the
# {glue:text}`ch12-n-seeds` seeds), so one forward of the trunk yields
# {glue:text}`ch12-draft-tokens` tokens. That is the agreement on greedy text above
# measured as decoding, with the same caveat: these continuations repeat themselves.
# Each kept draft saves a forward of the trunk and costs one of the module's block:
# next to DeepSeek-V3's 61 layers {cite}`deepseekai2024deepseekv3` that block is
# cheap, next to this 2-layer trunk it is not, so here the count of forwards is the
# result, not the time.
#
# ## 7 · Width versus depth
#
# gpt-oss-20b and Qwen3-30B-A3B are mixture-of-experts models of about the same size,
# built in opposite shapes: 24 layers of width 2,880 against 48 layers of width 2,048. We
# build both from their released configurations (the presets hold their larger siblings,
# so we change the fields that differ) and let the calculator of
# {doc}`chapter 13 <13_build_a_model>` count them:

# %% tags=["hide-input"]
gpt_oss_120b = preset("gpt-oss-120b")
gpt_oss_20b = gpt_oss_120b.replace(
    n_layers=24,
    moe=gpt_oss_120b.moe.replace(n_experts=32),
    layer_types=tuple("full" if i % 2 else "sliding" for i in range(24)),
)
qwen3_235b = preset("qwen3-235b-a22b")
qwen3_30b = qwen3_235b.replace(
    d_model=2048,
    n_layers=48,
    n_heads=32,
    n_kv_heads=4,
    head_dim=128,
    d_ff=6144,
    moe=qwen3_235b.moe.replace(expert_d_ff=768, n_experts=128, experts_per_token=8),
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
# against the model cards: 20.9B and 30.5B in total, gpt-oss-20b 3.61B active
assert (
    round(shape["gpt-oss-20b"][0] / 1e9, 1) == 20.9
    and round(shape["Qwen3-30B-A3B"][0] / 1e9, 1) == 30.5
)
assert (
    round(shape["gpt-oss-20b"][1] / 1e9, 2) == 3.61
)  # the model card's active count (no embeddings)
# the cache per token by hand: K and V, H_kv heads of width D, every layer, 2 bytes
for name, cfg_m in (("gpt-oss-20b", gpt_oss_20b), ("Qwen3-30B-A3B", qwen3_30b)):
    hand = 2 * cfg_m.n_layers * cfg_m.n_kv_heads * cfg_m.head_dim * 2
    assert shape[name][3] == hand
(oss_t, oss_a, oss_f, oss_kv), (qw_t, qw_a, qw_f, qw_kv) = shape.values()
per_layer = {n: int(c[4].replace(",", "")) for n, c in column.items()}
glue("ch12-oss-total", f"{oss_t / 1e9:.1f}", display=False)
glue("ch12-qwen-total", f"{qw_t / 1e9:.1f}", display=False)
glue("ch12-oss-active", f"{oss_a / 1e9:.2f}", display=False)
glue("ch12-total-ratio", f"{qw_t / oss_t:.2f}", display=False)
glue("ch12-oss-per-layer", f"{per_layer['gpt-oss-20b'] / 1e6:.0f}", display=False)
glue("ch12-qwen-per-layer", f"{per_layer['Qwen3-30B-A3B'] / 1e6:.0f}", display=False)
glue("ch12-oss-kv", f"{oss_kv // 1024}", display=False)
glue("ch12-qwen-kv", f"{qw_kv // 1024}", display=False)
glue("ch12-kv-ratio", f"{qw_kv / oss_kv:.0f}", display=False)
glue("ch12-oss-gflop", f"{oss_f / 1e9:.1f}", display=False)
glue("ch12-qwen-gflop", f"{qw_f / 1e9:.1f}", display=False)

# %% [markdown]
# The totals, {glue:text}`ch12-oss-total` and {glue:text}`ch12-qwen-total` billion, are the
# model cards' {cite}`openai2025gptoss` {cite}`yang2025qwen3`, and gpt-oss's
# {glue:text}`ch12-oss-active` billion active parameters is our count without the
# embedding table (the "active" row above includes it; model cards do not agree on that
# convention). So the deeper model holds {glue:text}`ch12-total-ratio` times as many
# parameters, but each of its tokens touches fewer of them per layer:
# {glue:text}`ch12-qwen-per-layer` million against {glue:text}`ch12-oss-per-layer`
# million. In exchange it runs 48 layers one after the other. Each layer is a step that
# cannot start before the previous one ends, so at batch size one, where decoding is a
# sequence of small matrix products, a shallow and wide model finishes a token in fewer,
# larger steps, which we expect to suit the hardware better (we do not time it here).
# Splitting a model along its depth across devices (pipeline parallelism) leaves bubbles
# whatever its shape; what depth changes is how many sequential steps each token waits
# for. The deeper model's KV cache per token is {glue:text}`ch12-kv-ratio` times as large
# here ({glue:text}`ch12-qwen-kv` KiB against {glue:text}`ch12-oss-kv` KiB: twice the
# layers at the same bytes per layer, before gpt-oss's sliding windows even start to
# help).
#
# What depth buys in quality is harder to measure, and this chapter does not try: the
# comparison that would settle it trains two models of equal size to convergence on the
# same data, far beyond a CPU budget. Deeper networks compose more steps of computation
# per parameter. The Gemma 2 report includes one controlled comparison in its ablations
# (Table 9): two 9B models with the same number of parameters, one wider and one deeper,
# scored 50.8 and 52.0 on the average of four benchmarks, the deeper one ahead
# {cite}`gemmateam2024gemma2`. Its authors call the gap small but consistent across the
# four benchmarks, and it is the reason they give for making Gemma 2 deeper than Gemma 1.
# It is one pair of runs at one size, with no spread reported, and the table names
# neither the two shapes nor the benchmarks; in practice width against depth is set by
# serving constraints at least as much as by quality.
#
# ## What we learned
#
# None of these one-line changes is mainly about next-token quality: each answers a
# pressure of memory, parameter count or decoding. A larger vocabulary moves training's
# memory peak to the logits, and chunked cross-entropy removes it at the price of
# computing them twice, with the same loss and gradients; tying the head to the embedding
# saves a sizeable share of the parameters only in small models; the key bias is provably
# inert without RoPE; sinks and output gates give a head a way to say nothing. The
# multi-token module learned to draft the trunk's own next pick most of the time on
# held-out text, but its extra loss did not measurably change the trunk's next-token loss
# over five paired seeds at our tiny scale. Dropout and width against depth we only
# checked against configurations and published evidence, because the experiments that
# would settle them are pretraining runs far beyond this page's budget.
#
# | Component | 2017 default | Modern default | Quality gain (what this chapter measured) | Pressure that drove it |
# |---|---|---|---|---|
# | Vocabulary and loss | Tens of thousands of tokens, full logits in the loss | 128k–262k tokens, chunked or fused cross-entropy | None by construction: same loss and gradients, about a tenth of the loss's memory peak (one test) | Coverage of more languages; the logits' memory |
# | Attention sinks | Softmax weights sum to one | A learned sink logit per head (gpt-oss) or a sigmoid output gate (Qwen3-Next) | Not measured: exact checks only (a sink runs on SDPA as a zero-valued key, a closed gate silences its head) | Streaming with evicted first tokens; heads with nothing to say |
# | Multi-token prediction | Next-token loss only | One extra module predicting the token after next (DeepSeek-V3) | Null on the trunk's next-token loss (5 paired seeds); its drafts matched the trunk's pick about three times in four | A built-in draft model for faster decoding |
#
# ## Exercises
#
# 1. Add label smoothing ({doc}`chapter 3 <03_transformer_2017>`) to
#    `chunked_cross_entropy`. What extra number per
#    row must the forward pass keep, and how does the backward change?
#
# ```{admonition} Solution
# :class: dropdown
# The smoothed loss adds $\frac{\varepsilon}{V}\sum_v (\mathrm{LSE} - z_v)$ per row, so the
# forward also keeps $\sum_v z_v$ of each chunk (one number per row, accumulated while the
# chunk is live). In the backward the gradient of the logits becomes
# $\mathrm{softmax}(z) - (1-\varepsilon)\,\mathrm{onehot}(y) - \varepsilon / V$: still
# per row,
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
# 4. Train the model of {ref}`section 6 <ch12-mtp>` with `attn_sinks=True` in its
#    `ModelConfig` (and once with `attn_output_gate=True`), then look at `model.attention_maps(...)`: how much
#    weight does the first token receive with and without sinks?
#
# ```{admonition} Hint
# :class: dropdown
# Use the MTP section's config and training loop with `lam = 0`, or
# `companion.training.train`.
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

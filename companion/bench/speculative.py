"""Speculative decoding with real weights (chapter 17): ``python -m companion.bench
speculative``.

Greedy decoding of SmolLM2-135M-Instruct (batch 1, fp32, CPU) on prompts whose answer
copies the prompt (repeat a passage as written), alternated in one process: plain
cached decoding (``DecoderLM.generate``) and
:func:`~companion.models.speculative.speculative_generate` with a
:class:`~companion.models.speculative.PromptLookupDrafter` for each k. For each k the
table gives tokens/s, the speedup, drafts and tokens per verify step, the acceptance
rate α, and what α predicts (:func:`predicted`): per step with m drafts, (1 − α^{m+1})
/ (1 − α) tokens for the measured cost of an (m + 1)-token verify in 1-token steps
(Leviathan et al.'s formula with a drafter that costs nothing). Every speculative
output is checked equal to the plain one."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from companion.models.speculative import (
    PromptLookupDrafter,
    SpeculativeResult,
    expected_tokens_per_step,
    speculative_generate,
)

from .common import median_seconds, positive_int

__all__ = [
    "PASSAGES",
    "add_parser",
    "bench_speculative",
    "copy_prompt",
    "format_speculative",
    "predicted",
    "verify_cost",
]

PASSAGES = (
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to "
    "suffer the slings and arrows of outrageous fortune, or to take arms against a sea "
    "of troubles, and by opposing end them.",
    "The quick brown fox jumps over the lazy dog. The dog does not move; it only opens "
    "one eye, watches the fox land in the grass, and goes back to sleep in the sun.",
    "Our meeting is moved from Tuesday to Thursday at ten in the small room on the "
    "second floor. Please bring the printed report, the budget sheet and your laptop.",
)


def copy_prompt(tok: object, passage: str) -> list[int]:
    """A chat prompt asking the model to repeat ``passage`` word for word: an answer
    that copies its input, the case prompt lookup is for."""
    ask = f"Please repeat this text back to me exactly as written.\n\n{passage}"
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": ask}]))


def verify_cost(
    model: torch.nn.Module, prompt: torch.Tensor, k_max: int, repeats: int
) -> dict[int, float]:
    """For m = 0..k_max: seconds of a forward of m + 1 tokens through a cache holding
    ``prompt``, over seconds of a 1-token step there (medians): a verify's cost in
    steps."""
    cache = model.new_cache(1, prompt.shape[1] + k_max + 1)
    with torch.no_grad():
        model(prompt, cache=cache, last_only=True)
        start = cache.length

        def seconds(t: int) -> float:
            ids, pos = prompt[:, :t], torch.arange(start, start + t)
            return median_seconds(
                lambda: model.forward_at(ids, pos, cache), torch.device("cpu"), repeats
            )

        one = seconds(1)
        return {m: 1.0 if m == 0 else seconds(m + 1) / one for m in range(k_max + 1)}


def predicted(
    results: list[SpeculativeResult], cost: dict[int, float]
) -> tuple[float, float, float]:
    """``(alpha, expected tokens per step, expected speedup)`` of speculative runs:
    alpha pooled over every judged draft; per step with m drafts (1 − α^{m+1}) / (1 −
    α) tokens at ``cost[m]`` steps' time (Leviathan et al.'s formula, step by step,
    with a drafter that costs nothing)."""
    accepted = sum(sum(r.accepted) for r in results)
    judged = sum(r.acceptance_judged for r in results)
    alpha = accepted / max(judged, 1)
    drafted = [m for r in results for m in r.drafted]
    tokens = statistics.mean(expected_tokens_per_step(alpha, m) for m in drafted)
    return alpha, tokens, tokens / statistics.mean(cost[m] for m in drafted)


def bench_speculative(
    model: torch.nn.Module,
    prompts: list[torch.Tensor],
    new_tokens: int,
    ks: tuple[int, ...],
    n_gram: int,
    repeats: int,
) -> list[dict[str, float]]:
    """One row for plain decoding and one per k; times are medians over ``repeats``
    rounds (after one warm-up round) of all prompts, alternating the decoders."""
    drafters = {k: PromptLookupDrafter(n_gram, k) for k in ks}
    times: dict[int, list[float]] = {k: [] for k in (0, *ks)}
    runs: dict[int, list[SpeculativeResult]] = {}
    plain: list[torch.Tensor] = []
    for rnd in range(repeats + 1):
        for k in (0, *ks):
            start = time.perf_counter()
            if k == 0:
                plain = [model.generate(ids, new_tokens) for ids in prompts]
            else:
                runs[k] = [
                    speculative_generate(model, ids, new_tokens, drafters[k])
                    for ids in prompts
                ]
            if rnd:
                times[k].append(time.perf_counter() - start)
    cost = verify_cost(model, prompts[0], max(ks), repeats=max(repeats, 5))
    total = new_tokens * len(prompts)
    base = statistics.median(times[0])
    rows = [{"k": 0.0, "tps": total / base, "speedup": 1.0}]
    for k in ks:
        t = statistics.median(times[k])
        alpha, tokens, speedup = predicted(runs[k], cost)
        steps = [m for r in runs[k] for m in r.drafted]
        same = all(torch.equal(r.ids, p) for r, p in zip(runs[k], plain, strict=True))
        rows.append(
            {
                "k": float(k),
                "tps": total / t,
                "speedup": base / t,
                "drafted": statistics.mean(steps),
                "tokens_per_step": sum(
                    r.tokens_per_step * len(r.drafted) for r in runs[k]
                )
                / len(steps),
                "alpha": alpha,
                "expected_tokens": tokens,
                "expected": speedup,
                "identical": float(same),
            }
        )
    return rows


def format_speculative(rows: list[dict[str, float]]) -> str:
    """The rows as a table."""
    head = f"{'k':>3}{'tokens/s':>10}{'speedup':>9}{'drafts':>8}{'tok/step':>10}"
    lines = [head + f"{'alpha':>7}{'exp tok':>10}{'exp x':>9}  greedy output"]
    for r in rows:
        line = f"{int(r['k']):>3}{r['tps']:>10.1f}{r['speedup']:>8.2f}x"
        if r["k"] == 0:
            lines.append(line + "   (plain cached decoding)")
            continue
        same = "identical" if r["identical"] else "DIFFERS"
        lines.append(
            line
            + f"{r['drafted']:>8.2f}{r['tokens_per_step']:>10.2f}{r['alpha']:>7.2f}"
            f"{r['expected_tokens']:>10.2f}{r['expected']:>9.2f}x  {same}"
        )
    lines.append(
        "drafts, tok/step: per verify step; exp tok, exp x: the tokens per step and\n"
        "speedup alpha predicts at the measured cost of each (m+1)-token verify"
    )
    return "\n".join(lines)


def _command(args: argparse.Namespace) -> None:
    from companion.checkpoints.smollm2 import load_smollm2

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_smollm2()
    prompts = [torch.tensor([copy_prompt(tok, p)]) for p in PASSAGES]
    ks = tuple(args.k)
    print(
        f"speculative: SmolLM2-135M-Instruct, greedy, batch 1, fp32, cpu, "
        f"{len(prompts)} copy prompts, {args.new_tokens} new tokens each, "
        f"prompt lookup n_gram={args.n_gram}, median of {args.repeats} "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads)"
    )
    rows = bench_speculative(
        model, prompts, args.new_tokens, ks, args.n_gram, args.repeats
    )
    print(format_speculative(rows))


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``speculative`` on the ``python -m companion.bench`` command line."""
    p = sub.add_parser(
        "speculative", help="SmolLM2 greedy: plain vs prompt-lookup speculative"
    )
    p.add_argument("--new-tokens", type=positive_int, default=64)
    p.add_argument(
        "--k", type=positive_int, nargs="+", default=[4, 6, 8], help="drafts per step"
    )
    p.add_argument("--n-gram", type=positive_int, default=3)
    p.add_argument("--repeats", type=positive_int, default=2, help="timed rounds")
    p.add_argument(
        "--threads", type=positive_int, help="torch threads (default: torch's)"
    )
    p.set_defaults(run=_command)

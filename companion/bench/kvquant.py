"""Decoding through a quantised KV cache (chapter 16): ``python -m companion.bench
kvquant``.

Greedy decoding of SmolLM2-135M-Instruct's real weights (batch 1, fp32 compute, CPU)
three ways in one process, alternated round by round: the plain fp32 cache, and the
caches of :mod:`companion.layers.kv_quant` in int8 and fp8 (e4m3), one byte per number
plus one fp32 scale per row. It reports tokens/s and the ratio to fp32, the cache's
bytes (its buffers) and how many greedy tokens equal fp32's before the first
difference. On a CPU at this length the cache is a small part of what a step reads
(the weights dominate) and the dequantisation runs as separate PyTorch ops, so expect
no speed-up here; the saving is memory, which is what lets a server hold more
sequences.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from companion.layers.kv_quant import FORMATS, quantize_cache, stored_bytes
from companion.models.decoder import DecodeCache
from companion.models.generation import decode_n_tokens, prefill

from .common import positive_int

__all__ = [
    "add_parser",
    "bench_kvquant",
    "cached_logits",
    "cached_nll",
    "format_kvquant",
    "greedy_tokens",
    "leading_agreement",
]

Convert = Callable[[nn.Module], nn.Module] | None


def greedy_tokens(
    model: nn.Module, input_ids: Tensor, new_tokens: int, convert: Convert = None
) -> tuple[Tensor, DecodeCache]:
    """The greedy continuation ``(B, new_tokens)`` of ``input_ids (B, T)`` decoded
    through a cache made with ``convert`` (None: the plain cache), and that cache."""
    b, t = input_ids.shape
    cache = model.new_cache(b, t + new_tokens, convert=convert)
    with torch.no_grad():
        first = prefill(model, input_ids, cache).argmax(-1, keepdim=True)
        rest = decode_n_tokens(model, first, cache, new_tokens - 1)
    return torch.cat([first, *rest], dim=1), cache


def cached_logits(
    model: nn.Module, ids: Tensor, prompt: int, convert: Convert = None
) -> Tensor:
    """Logits ``(B, T - prompt, V)`` predicting ``ids[:, prompt:]`` from everything
    before, read through a cache made with ``convert``: the first ``prompt`` tokens as
    a prefill, the rest in one pass. A quantised cache returns the new rows as it
    stored them, so the pass reads every key as a token-by-token decode would."""
    b, t = ids.shape
    if not 1 <= prompt <= t - 2:
        raise ValueError(f"prompt must be in [1, {t - 2}] for {t} tokens, got {prompt}")
    cache = model.new_cache(b, t - 1, convert=convert)
    with torch.no_grad():
        head = model(ids[:, :prompt], cache=cache, last_only=True)
        return torch.cat([head, model(ids[:, prompt:-1], cache=cache)], dim=1)


def cached_nll(
    model: nn.Module, ids: Tensor, prompt: int, convert: Convert = None
) -> Tensor:
    """Negative log-likelihood ``(B, T - prompt)`` of ``ids[:, prompt:]`` from
    :func:`cached_logits` (teacher-forced through the cache)."""
    logits = cached_logits(model, ids, prompt, convert)
    target = ids[:, prompt:]
    return F.cross_entropy(logits.transpose(1, 2).float(), target, reduction="none")


def leading_agreement(a: Tensor, b: Tensor) -> list[int]:
    """Per sequence, how many tokens of ``a`` and ``b`` ``(B, N)`` agree before the
    first difference."""
    same = (a == b).long()
    return same.cumprod(dim=1).sum(dim=1).tolist()


def bench_kvquant(
    model: nn.Module, input_ids: Tensor, new_tokens: int, repeats: int
) -> dict[str, dict[str, float]]:
    """Per cache (``"fp32"`` and each of ``kv_quant.FORMATS``):
    greedy tokens/s (median of ``repeats`` rounds after a warm-up round, the caches
    alternated), its ratio to fp32, the cache's MB and the greedy tokens equal to
    fp32's before the first difference."""
    converts = {"fp32": None} | {f: quantize_cache(f) for f in FORMATS}
    times: dict[str, list[float]] = {name: [] for name in converts}
    out, caches = {}, {}
    for _ in range(repeats + 1):
        for name, convert in converts.items():
            start = time.perf_counter()
            out[name], caches[name] = greedy_tokens(
                model, input_ids, new_tokens, convert
            )
            times[name].append(time.perf_counter() - start)
    rows = {}
    for name in converts:
        tps = new_tokens / statistics.median(times[name][1:])
        rows[name] = {
            "tps": tps,
            "cache_mb": sum(stored_bytes(c) for c in caches[name].layers) / 1e6,
            "agreeing": float(leading_agreement(out[name], out["fp32"])[0]),
        }
    for row in rows.values():
        row["ratio"] = row["tps"] / rows["fp32"]["tps"]
    return rows


def format_kvquant(rows: dict[str, dict[str, float]], new_tokens: int) -> str:
    """The side-by-side table."""
    lines = [f"{'cache':<8}{'tokens/s':>10}{'vs fp32':>9}{'cache MB':>10}"
             f"{'greedy = fp32':>15}"]  # fmt: skip
    for name, r in rows.items():
        lines.append(
            f"{name:<8}{r['tps']:>10.1f}{r['ratio']:>8.2f}x{r['cache_mb']:>10.2f}"
            f"{int(r['agreeing']):>9} of {new_tokens}"
        )
    return "\n".join(lines)


def _kvquant_command(args: argparse.Namespace) -> None:
    from companion.checkpoints.smollm2 import load_smollm2

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_smollm2()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Tell me a long story."}]
    )
    ids = torch.tensor([tok.encode(prompt)])
    print(
        f"kvquant: SmolLM2-135M-Instruct, batch 1, fp32 compute, cpu, {ids.shape[1]}-"
        f"token prompt, {args.new_tokens} new tokens, median of {args.repeats} "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads)"
    )
    rows = bench_kvquant(model.eval(), ids, args.new_tokens, args.repeats)
    print(format_kvquant(rows, args.new_tokens))
    print("cache MB: the buffers (codes + one fp32 scale per row; fp32: the numbers)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``kvquant`` on the ``python -m companion.bench`` command line."""
    p = sub.add_parser(
        "kvquant", help="SmolLM2 greedy decoding: fp32 vs int8 vs fp8 KV cache"
    )
    p.add_argument("--new-tokens", type=positive_int, default=64)
    p.add_argument(
        "--repeats", type=positive_int, default=2, help="timed rounds per cache"
    )
    p.add_argument(
        "--threads", type=positive_int, help="torch threads (default: torch's)"
    )
    p.set_defaults(run=_kvquant_command)

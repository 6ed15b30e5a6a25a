"""Attention kernels side by side (chapter 02): ``python -m companion.bench attention``.

Times the forward pass (median of ``--repeats`` after one warm-up) of the naive
reference, the plain-PyTorch tiled (FlashAttention-style) loop and PyTorch's fused SDPA,
with B=1, H=8, D=64, causal; fp32 on CPU, bf16 on accelerators that support it. Peak
memory is taken by :class:`companion.analysis.peak_memory.PeakMemory` over one more
forward pass.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Sequence

import torch

from companion.analysis.peak_memory import PeakMemory
from companion.device import default_device, default_dtype
from companion.ops.attention import naive_attention, sdpa_attention
from companion.ops.tiled import tiled_attention

from .common import median_seconds, positive_int

__all__ = ["add_parser", "bench_attention", "format_attention"]


ATTENTION_IMPLS: dict[str, Callable[..., torch.Tensor]] = {
    "naive": lambda q, k, v: naive_attention(q, k, v, causal=True),
    "tiled": lambda q, k, v: tiled_attention(q, k, v, causal=True),
    "sdpa": lambda q, k, v: sdpa_attention(q, k, v, causal=True),
}


def bench_attention(
    lengths: Sequence[int], device: torch.device, repeats: int
) -> list[dict[str, float]]:
    """One row per length: ``{"T", "<impl>_ms", "<impl>_mib"}`` for naive, tiled and
    sdpa."""
    dtype = default_dtype(device)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for t in lengths:
        q, k, v = (
            torch.randn(1, 8, t, 64, generator=gen).to(device, dtype) for _ in range(3)
        )
        row: dict[str, float] = {"T": t}
        with torch.no_grad():
            for name, impl in ATTENTION_IMPLS.items():
                run = functools.partial(impl, q, k, v)
                row[f"{name}_ms"] = 1e3 * median_seconds(run, device, repeats)
                with PeakMemory(device) as pm:
                    run()
                row[f"{name}_mib"] = pm.peak_mib
        rows.append(row)
    return rows


def format_attention(rows: list[dict[str, float]]) -> str:
    """A plain-text table of :func:`bench_attention`'s rows, with the three ratios."""
    header = (
        f"{'T':>6} | {'naive ms':>9} {'tiled ms':>9} {'sdpa ms':>9} | "
        f"{'naive MiB':>9} {'tiled MiB':>9} {'sdpa MiB':>9} | "
        f"{'naive/sdpa time':>15} {'tiled/sdpa time':>15} {'naive/tiled mem':>15}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{int(r['T']):>6} | "
            f"{r['naive_ms']:>9.2f} {r['tiled_ms']:>9.2f} {r['sdpa_ms']:>9.2f} | "
            f"{r['naive_mib']:>9.2f} {r['tiled_mib']:>9.2f} {r['sdpa_mib']:>9.2f} | "
            f"{r['naive_ms'] / r['sdpa_ms']:>14.1f}x {r['tiled_ms'] / r['sdpa_ms']:>14.1f}x "
            f"{r['naive_mib'] / r['tiled_mib']:>14.1f}x"
        )
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> None:
    device = default_device(args.device)
    print(
        f"attention forward, B=1 H=8 D=64 causal, {default_dtype(device)} on {device.type}, "
        f"median of {args.repeats} after a warm-up (torch {torch.__version__})"
    )
    print(format_attention(bench_attention(args.lengths, device, args.repeats)))


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``attention`` on the ``python -m companion.bench`` command line."""
    p = sub.add_parser(
        "attention", help="naive vs tiled vs SDPA attention: time and memory"
    )
    p.add_argument(
        "--device", choices=("cuda", "mps", "cpu"), help="default: the best present"
    )
    p.add_argument(
        "--lengths",
        type=positive_int,
        nargs="+",
        default=[256, 512, 1024, 2048],
        help="T = S",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=5, help="timed runs per cell"
    )
    p.set_defaults(run=_run)

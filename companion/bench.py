"""Side-by-side micro-benchmarks for the book's chapters (chapter 02).

Run ``python -m companion.bench attention [--device cpu] [--lengths 256 512 1024 2048]
[--repeats N]``. Every row is measured in one process, on one machine, one after another, so
read the *ratios* (naive/SDPA time, tiled/SDPA time, naive/tiled memory), not the absolute
numbers: those depend on the hardware, the PyTorch build and what else is running.

``attention`` times the forward pass (median of ``--repeats`` after one warm-up) of the naive
reference, the plain-PyTorch tiled (FlashAttention-style) loop and PyTorch's fused SDPA, with
B=1, H=8, D=64, causal; fp32 on CPU, bf16 on accelerators that support it. Peak memory is
taken by :class:`companion.memory.PeakMemory` over one more forward pass.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from .attention import naive_attention, sdpa_attention
from .device import default_device, default_dtype
from .flash import tiled_attention
from .memory import PeakMemory

__all__ = ["bench_attention", "format_attention", "main"]

ATTENTION_IMPLS: dict[str, Callable[..., torch.Tensor]] = {
    "naive": lambda q, k, v: naive_attention(q, k, v, causal=True)[0],
    "tiled": lambda q, k, v: tiled_attention(q, k, v, causal=True),
    "sdpa": lambda q, k, v: sdpa_attention(q, k, v, causal=True),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs, after one warm-up run."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_attention(
    lengths: Sequence[int], device: torch.device, repeats: int
) -> list[dict[str, float]]:
    """One row per length: ``{"T", "<impl>_ms", "<impl>_mib"}`` for naive, tiled and sdpa."""
    dtype = default_dtype(device)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for t in lengths:
        q, k, v = (torch.randn(1, 8, t, 64, generator=gen).to(device, dtype) for _ in range(3))
        row: dict[str, float] = {"T": t}
        with torch.no_grad():
            for name, impl in ATTENTION_IMPLS.items():
                run = functools.partial(impl, q, k, v)
                row[f"{name}_ms"] = 1e3 * _median_seconds(run, device, repeats)
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


def _attention_command(args: argparse.Namespace) -> None:
    device = default_device(args.device)
    print(
        f"attention forward, B=1 H=8 D=64 causal, {default_dtype(device)} on {device.type}, "
        f"median of {args.repeats} after a warm-up (torch {torch.__version__})"
    )
    print(format_attention(bench_attention(args.lengths, device, args.repeats)))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point: ``python -m companion.bench <benchmark> [options]``."""
    parser = argparse.ArgumentParser(
        prog="python -m companion.bench",
        description="Side-by-side micro-benchmarks: read the ratios, not the absolute numbers.",
    )
    sub = parser.add_subparsers(dest="benchmark", metavar="benchmark", required=True)
    att = sub.add_parser("attention", help="naive vs tiled vs SDPA attention: time and memory")
    att.add_argument("--device", choices=("cuda", "mps", "cpu"), help="default: the best present")
    att.add_argument(
        "--lengths", type=_positive_int, nargs="+", default=[256, 512, 1024, 2048], help="T = S"
    )
    att.add_argument("--repeats", type=_positive_int, default=5, help="timed runs per cell")
    att.set_defaults(run=_attention_command)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()

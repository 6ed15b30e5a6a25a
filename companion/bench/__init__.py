"""Side-by-side benchmarks for the book's chapters: ``python -m companion.bench
<name>``.

Every table is measured in one process, on one machine, one row after another, so read
the *ratios*, not the absolute numbers: those depend on the hardware, the PyTorch build
and what else is running. Each benchmark is one module of this package (``attention``
for chapter 02, ``decode`` for chapter 08, ...) exposing ``add_parser(subparsers)``;
``BENCHMARKS`` lists them in the order ``make bench`` runs them.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

from .common import median_seconds, positive_int, sync

__all__ = ["BENCHMARKS", "main", "median_seconds", "positive_int", "sync"]

BENCHMARKS = (
    "attention",
    "decode",
    "bandwidth",
    "moe",
    "deltanet",
    "kda",
    "mla",
    "sparse",
    "kvquant",
    "weights",
    "expert_parallel",
    "speculative",
    "kernels",
)


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point: ``python -m companion.bench <benchmark> [options]``."""
    parser = argparse.ArgumentParser(
        prog="python -m companion.bench",
        description="Side-by-side benchmarks: read the ratios, not the absolute numbers.",
    )
    sub = parser.add_subparsers(dest="benchmark", metavar="benchmark", required=True)
    for name in BENCHMARKS:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    args = parser.parse_args(argv)
    args.run(args)

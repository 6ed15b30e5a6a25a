"""Timing helpers shared by the benchmarks: device sync, median wall time, CLI
integers."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["median_seconds", "positive_int", "sync"]


def sync(device: torch.device) -> None:
    """Wait for queued accelerator work, so that wall time covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def median_seconds(
    fn: Callable[[], object], device: torch.device, repeats: int
) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs, after one warm-up run."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value

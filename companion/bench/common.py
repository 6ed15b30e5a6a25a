"""Timing helpers shared by the benchmarks: device sync, median wall time, CLI
integers."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["interleaved_medians", "median_seconds", "positive_int", "sync"]


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


def interleaved_medians(
    runs: dict[str, Callable[[], object]], device: torch.device, repeats: int
) -> dict[str, float]:
    """Median wall time of each of ``runs`` over ``repeats`` rounds after a warm-up
    round, every round running each in turn: load from elsewhere hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats + 1):  # round 0 warms up and is not counted
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value

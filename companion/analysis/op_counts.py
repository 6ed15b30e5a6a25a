"""Which ATen ops a piece of code runs: counts, and the reductions among them (chapter
06).

A dispatch mode sees every operator call below autograd, so ``count_reductions`` tells
how many passes over the data a norm makes (LayerNorm's mean and variance against
RMSNorm's one mean of squares).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["REDUCTIONS", "count_aten_ops", "count_reductions"]


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_aten_ops(
    fn: Callable[..., object], *args: object, **kwargs: object
) -> Counter[str]:
    """How many times ``fn(*args)`` calls each ATen operator (``"mean"``, ``"mul"``,
    ...)."""
    with _OpCounter() as counter:
        fn(*args, **kwargs)
    return counter.counts


# ATen operators that reduce over a dimension (a sum across the feature axis, say)
REDUCTIONS = frozenset(
    {
        "sum",
        "mean",
        "var",
        "std",
        "var_mean",
        "std_mean",
        "amax",
        "amin",
        "max",
        "min",
        "norm",
    }
)


def count_reductions(fn: Callable[..., object], *args: object, **kwargs: object) -> int:
    """The number of reduction operators (``REDUCTIONS``) that ``fn(*args)`` runs."""
    counts = count_aten_ops(fn, *args, **kwargs)
    return sum(n for op, n in counts.items() if op in REDUCTIONS)

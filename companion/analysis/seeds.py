"""Results over seeds: the spread of a measurement and when two of them differ
(every chapter that compares trained variants).

One training run is one draw: another seed gives another number. A comparison is made
over seeds, and a difference is claimed only when it is larger than the seeds' own
scatter. The rule here is deliberately simple enough to state in a sentence:
:func:`compare` calls ``a`` higher than ``b`` when the gap between the means exceeds the
sum of the two standard deviations, and, for paired runs (seed ``i`` of both variants
saw the same batches), when every pair agrees in sign.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Spread", "compare", "spread"]


@dataclass(frozen=True)
class Spread:
    """A measurement over seeds: the values, their mean and sample standard
    deviation."""

    values: tuple[float, ...]

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    @property
    def sd(self) -> float:
        n, m = len(self.values), self.mean
        return math.sqrt(sum((v - m) ** 2 for v in self.values) / (n - 1))

    def format(self, digits: int = 2) -> str:
        """``mean ± sd`` with ``digits`` decimals."""
        return f"{self.mean:.{digits}f} ± {self.sd:.{digits}f}"


def spread(values: Sequence[float]) -> Spread:
    """The :class:`Spread` of at least two finite values."""
    vals = tuple(float(v) for v in values)
    if len(vals) < 2:
        raise ValueError(f"values must hold at least 2 seeds, got {len(vals)}")
    if not all(math.isfinite(v) for v in vals):
        raise ValueError(f"values must be finite, got {vals}")
    return Spread(vals)


def compare(a: Sequence[float], b: Sequence[float], paired: bool = True) -> int:
    """``+1`` if ``a`` is higher than ``b`` beyond the spread, ``-1`` if lower, ``0``
    when the seeds cannot tell them apart (a null result).

    Beyond the spread means ``|mean(a) − mean(b)| > sd(a) + sd(b)``; with ``paired``
    (the default, for runs that share seeds and batches), also every ``a_i − b_i`` of
    the same sign.
    """
    sa, sb = spread(a), spread(b)
    if paired and len(sa.values) != len(sb.values):
        raise ValueError(
            f"paired runs need as many seeds each, got {len(sa.values)} and "
            f"{len(sb.values)}"
        )
    gap = sa.mean - sb.mean
    if abs(gap) <= sa.sd + sb.sd:
        return 0
    sign = 1 if gap > 0 else -1
    if paired and not all(
        (x - y) * sign > 0 for x, y in zip(sa.values, sb.values, strict=True)
    ):
        return 0
    return sign

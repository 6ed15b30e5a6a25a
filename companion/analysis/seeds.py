"""Results over seeds: the spread of a measurement and when two of them differ
(every chapter that compares trained variants).

One training run is one draw: another seed gives another number. A comparison is made
over seeds, and a difference is claimed only when the seeds rule out chance at a stated
error rate. The rule is the textbook one, named so that a reader can check it:

* **paired runs** (seed ``i`` of both variants saw the same initial draw and the same
  batches): the differences ``d_i = a_i − b_i`` are the data; :func:`difference` gives
  their mean and its 95 % Student-t interval, ``mean(d) ± t(0.975, n−1) · sd(d)/√n``;
* **unpaired runs**: Welch's interval for the difference of the two means, with the
  Welch–Satterthwaite degrees of freedom rounded down (the cautious side).

:func:`compare` claims ``a`` higher (``+1``) or lower (``-1``) only when that interval
excludes zero: a two-sided test at the 5 % level, so when two variants do not differ it
still calls one of every twenty such comparisons a difference. With three seeds
``t = 4.30``: a gap must be large against its scatter before three runs can show it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Difference", "Spread", "compare", "difference", "spread", "t_quantile"]


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


@dataclass(frozen=True)
class Difference:
    """``mean(a) − mean(b)`` with the half-width of its 95 % interval."""

    mean: float
    half_width: float
    paired: bool

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    @property
    def verdict(self) -> int:
        """``+1`` / ``-1`` when the interval lies above / below zero, else ``0``."""
        if self.low > 0:
            return 1
        return -1 if self.high < 0 else 0

    def format(self, digits: int = 2) -> str:
        """``mean ± half-width`` with ``digits`` decimals."""
        return f"{self.mean:+.{digits}f} ± {self.half_width:.{digits}f}"


def spread(values: Sequence[float]) -> Spread:
    """The :class:`Spread` of at least two finite values."""
    vals = tuple(float(v) for v in values)
    if len(vals) < 2:
        raise ValueError(f"values must hold at least 2 seeds, got {len(vals)}")
    if not all(math.isfinite(v) for v in vals):
        raise ValueError(f"values must be finite, got {vals}")
    return Spread(vals)


def _t_two_sided(t: float, df: int) -> float:
    """P(|T| ≤ t) for Student's t with integer ``df`` (the finite series of
    Abramowitz & Stegun 26.7.3–26.7.4)."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 0:  # sinθ · (1 + ½cos²θ + (1·3)/(2·4)cos⁴θ + ...)
        term, total = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        return s * total
    if df == 1:
        return 2 * theta / math.pi
    term = math.cos(theta)  # (2/π)(θ + sinθ (cosθ + (2/3)cos³θ + ...))
    total = term
    for k in range(1, (df - 1) // 2):
        term *= c2 * (2 * k) / (2 * k + 1)
        total += term
    return 2 / math.pi * (theta + s * total)


def t_quantile(level: float, df: int) -> float:
    """The ``t`` with ``P(|T| ≤ t) = level`` for Student's t with ``df`` degrees of
    freedom (``level=0.95`` gives the 0.975 quantile)."""
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if df < 1:
        raise ValueError(f"df must be at least 1, got {df}")
    lo, hi = 0.0, 1.0
    while _t_two_sided(hi, df) < level:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_two_sided(mid, df) < level else (lo, mid)
    return (lo + hi) / 2


def difference(
    a: Sequence[float], b: Sequence[float], paired: bool = True
) -> Difference:
    """``mean(a) − mean(b)`` with its 95 % interval: Student's on the paired
    differences (``paired``, the default, for runs that share seeds and batches),
    Welch's otherwise."""
    sa, sb = spread(a), spread(b)
    if paired:
        if len(sa.values) != len(sb.values):
            raise ValueError(
                f"paired runs need as many seeds each, got {len(sa.values)} and "
                f"{len(sb.values)}"
            )
        d = spread([x - y for x, y in zip(sa.values, sb.values, strict=True)])
        n = len(d.values)
        return Difference(d.mean, t_quantile(0.95, n - 1) * d.sd / math.sqrt(n), True)
    va, vb = sa.sd**2 / len(sa.values), sb.sd**2 / len(sb.values)
    se = math.sqrt(va + vb)
    gap = sa.mean - sb.mean
    if se == 0:
        return Difference(gap, 0.0, False)
    df = (va + vb) ** 2 / (va**2 / (len(sa.values) - 1) + vb**2 / (len(sb.values) - 1))
    return Difference(gap, t_quantile(0.95, max(1, math.floor(df))) * se, False)


def compare(a: Sequence[float], b: Sequence[float], paired: bool = True) -> int:
    """``+1`` if ``a`` is higher than ``b`` beyond chance, ``-1`` if lower, ``0`` when
    the seeds cannot tell them apart (a null result): the sign of
    :func:`difference`'s 95 % interval when it excludes zero."""
    return difference(a, b, paired).verdict

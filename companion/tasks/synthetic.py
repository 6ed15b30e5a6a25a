"""The target label that no loss scores, shared by every task with known answers
(:mod:`companion.tasks.probes`, :mod:`companion.tasks.translation`).

A task returns ``(x, y)`` with ``y == IGNORE`` where a position is not scored; pass
``ignore_index=IGNORE`` to the loss (it is PyTorch's default, -100).
"""

from __future__ import annotations

__all__ = ["IGNORE"]

IGNORE = -100

"""Under nbval, report each chapter's wall time against its budget.

The budgets are the book's: 150 s per chapter on a 2-core CPU, 300 s for the morph. The
report is a measurement printed at the end of the run, not a test: a slow machine makes
every chapter slower, and a failing clock says nothing about the chapter.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

BUDGET_S = {"14_the_morph": 300.0}
DEFAULT_BUDGET_S = 150.0
_SECONDS: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add every phase of every cell to its notebook's total."""
    path = Path(report.nodeid.split("::")[0])
    if path.suffix == ".ipynb":
        _SECONDS[path.stem] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    """One line per notebook: seconds, budget, and whether it is over."""
    if not _SECONDS:
        return
    terminalreporter.section("chapter wall time under nbval")
    for stem, seconds in sorted(_SECONDS.items()):
        budget = BUDGET_S.get(stem, DEFAULT_BUDGET_S)
        flag = "  OVER BUDGET" if seconds > budget else ""
        terminalreporter.write_line(
            f"{stem:<28} {seconds:6.0f} s  (budget {budget:.0f} s){flag}"
        )
    total = sum(_SECONDS.values())
    terminalreporter.write_line(f"{'all chapters':<28} {total:6.0f} s")

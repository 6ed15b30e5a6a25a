"""Count the code a reader of the HTML book sees on each chapter page.

Visible code is (a) the source lines of code cells whose input is not folded or removed
(tags ``hide-input``, ``remove-input``, ``hide-cell``, ``remove-cell``) and (b) the lines of
displayed source listings (``IPython.display.Code`` outputs: HTML with a ``highlight``
block) in outputs that are not folded or removed (``hide-output``, ``remove-output``, or
the cell tags). Printed tables and figures are not code. The budget is 250 lines a page.

    python tools/visible_code.py           # the table
    python tools/visible_code.py --check   # exit 1 if a page is over the budget
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 250
FOLD_INPUT = {"hide-input", "remove-input", "hide-cell", "remove-cell"}
FOLD_OUTPUT = {"hide-output", "remove-output", "hide-cell", "remove-cell"}


def _text(value: object) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def is_listing(output: dict) -> bool:
    """Whether an output is a displayed source listing (``IPython.display.Code``)."""
    html = _text(output.get("data", {}).get("text/html", ""))
    return 'class="highlight' in html


def visible_lines(notebook: Path) -> dict[str, int]:
    """``{"input": n, "listings": m, "total": n + m}`` for one chapter notebook."""
    cells = json.loads(notebook.read_text())["cells"]
    shown_input = listings = 0
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        tags = set(cell.get("metadata", {}).get("tags", []))
        if not tags & FOLD_INPUT:
            shown_input += len(_text(cell["source"]).splitlines())
        if tags & FOLD_OUTPUT:
            continue
        for output in cell.get("outputs", []):
            if is_listing(output):
                plain = _text(output["data"].get("text/plain", ""))
                listings += len(plain.splitlines())
    return {"input": shown_input, "listings": listings, "total": shown_input + listings}


def chapters() -> list[Path]:
    return sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 over the budget")
    args = parser.parse_args()
    over = []
    print(f"{'chapter':<32}{'input':>7}{'listings':>10}{'total':>7}  (budget {BUDGET})")
    for nb in chapters():
        n = visible_lines(nb)
        flag = "  OVER" if n["total"] > BUDGET else ""
        print(f"{nb.stem:<32}{n['input']:>7}{n['listings']:>10}{n['total']:>7}{flag}")
        if flag:
            over.append(nb.stem)
    return 1 if args.check and over else 0


if __name__ == "__main__":
    sys.exit(main())

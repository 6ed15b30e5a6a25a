"""Each chapter page opens with its question, closes with what was learned, hides its setup
cell and shows at most 250 lines of code (tools/visible_code.py counts them)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "visible_code", ROOT / "tools" / "visible_code.py"
)
visible_code = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(visible_code)
CHAPTERS = visible_code.chapters()


def _cells(nb: Path) -> list[dict]:
    return json.loads(nb.read_text())["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"])


@pytest.mark.parametrize("nb", CHAPTERS, ids=lambda p: p.stem)
def test_page_shows_at_most_the_budget_of_code(nb: Path) -> None:
    lines = visible_code.visible_lines(nb)
    assert lines["total"] <= visible_code.BUDGET, lines


@pytest.mark.parametrize("nb", CHAPTERS, ids=lambda p: p.stem)
def test_page_opens_with_its_question_and_hides_its_setup(nb: Path) -> None:
    cells = _cells(nb)
    first = _source(cells[0])
    assert cells[0]["cell_type"] == "markdown" and first.startswith("# ")
    assert "```{admonition} The question" in first
    box = first.split("```{admonition} The question", 1)[1].split("```", 1)[0]
    assert box.count("?") >= 1  # the question itself, as a sentence
    setup = next(c for c in cells if c["cell_type"] == "code")
    assert "pin_cpu_path()" in _source(setup)
    assert "remove-input" in setup["metadata"].get("tags", [])


@pytest.mark.parametrize("nb", CHAPTERS, ids=lambda p: p.stem)
def test_page_closes_with_what_was_learned(nb: Path) -> None:
    headings = [
        line
        for cell in _cells(nb)
        if cell["cell_type"] == "markdown"
        for line in _source(cell).splitlines()
        if line.startswith("## ")
    ]
    assert "## What we learned" in headings
    learned = headings.index("## What we learned")
    assert all("Exercise" in h for h in headings[learned + 1 :])  # only exercises after


def test_the_counter_counts_unfolded_code_and_listings(tmp_path: Path) -> None:
    """A notebook with one shown cell (3 lines), one folded (5) and a shown listing
    (2 lines) counts 5."""
    listing = {
        "output_type": "display_data",
        "metadata": {},
        "data": {
            "text/plain": "def f():\n    return 1",
            "text/html": '<div class="highlight">',
        },
    }
    cell = {"cell_type": "code", "execution_count": 1, "metadata": {}, "outputs": []}
    cells = [
        cell | {"source": "a = 1\nb = 2\nc = 3"},
        cell | {"source": "1\n2\n3\n4\n5", "metadata": {"tags": ["hide-input"]}},
        cell | {"source": "", "outputs": [listing]},
        cell
        | {"source": "", "outputs": [listing], "metadata": {"tags": ["hide-output"]}},
    ]
    nb = tmp_path / "01_x.ipynb"
    nb.write_text(json.dumps({"cells": cells}))
    assert visible_code.visible_lines(nb) == {"input": 3, "listings": 2, "total": 5}


def _question(nb: Path) -> str:
    """The question sentence of a chapter's box, roles reduced to their text."""
    box = _source(_cells(nb)[0]).split("```{admonition} The question", 1)[1]
    lines = box.split("```", 1)[0].splitlines()
    text = " ".join(ln.strip() for ln in lines if ln.strip() and ln[0] != ":")
    return re.sub(r"\{doc\}`([^<`]+?) <[^>]+>`", r"\1", text[: text.index("?") + 1])


@pytest.mark.parametrize("nb", CHAPTERS, ids=lambda p: p.stem)
def test_intro_table_asks_the_chapters_question(nb: Path) -> None:
    intro = (ROOT / "book" / "intro.md").read_text()
    rows = [ln for ln in intro.splitlines() if ln.startswith("|")]
    row = next(ln for ln in rows if f"../chapters/{nb.stem}>" in ln)
    assert f" | {_question(nb)} | " in row


READING_BOX = """```{admonition} Reading the numbers
:class: note
The runs below are small and short. A ± is a 95 % interval over seeds, on the paired
differences where runs share seeds and batches; a difference is claimed only when that
interval excludes zero, and a null says these seeds cannot tell the two apart. The
{ref}`preface <reading-the-numbers>` says what follows from that.
```"""
_COMPARES = re.compile(r"\b(difference|compare|spread)\(")
_VERDICT_WORDS = re.compile(
    r"interval|cannot tell|beyond|distinguishable|\bthan\b|\bnull\b", re.IGNORECASE
)


@pytest.mark.parametrize("nb", CHAPTERS, ids=lambda p: p.stem)
def test_seed_comparisons_sit_under_the_standard_reading_box(nb: Path) -> None:
    cells = _cells(nb)
    first = next(
        (i for i, c in enumerate(cells)
         if c["cell_type"] == "code" and _COMPARES.search(_source(c))),
        None,
    )
    boxes = [i for i, c in enumerate(cells)
             if c["cell_type"] == "markdown" and "Reading the numbers" in _source(c)]
    if first is None:
        assert not boxes  # the box belongs to pages that compare seeds
        return
    assert len(boxes) == 1 and boxes[0] < first
    assert READING_BOX in _source(cells[boxes[0]])


def _glued(nb: Path) -> dict[str, str]:
    out = {}
    for cell in _cells(nb):
        for o in cell.get("outputs", []):
            name = o.get("metadata", {}).get("scrapbook", {}).get("name")
            text = o.get("data", {}).get("application/papermill.record/text/plain")
            if name and text:
                out[name] = text.strip("'\"")
    return out


@pytest.mark.parametrize("nb", CHAPTERS, ids=lambda p: p.stem)
def test_glue_carries_numbers_and_whole_sentences_not_verdict_fragments(
    nb: Path,
) -> None:
    """A glued verdict is a whole sentence chosen by the code; numbers and short labels
    are spliced into the prose, verdict words ("beyond the interval", "than") are not."""
    fragments = {
        name: text
        for name, text in _glued(nb).items()
        if _VERDICT_WORDS.search(text)
        and not (text[:1].isupper() and text.rstrip().endswith("."))
    }
    assert not fragments


def test_the_preface_defines_what_the_reading_box_links_to() -> None:
    preface = (ROOT / "book" / "preface.md").read_text()
    assert "(reading-the-numbers)=" in preface
    assert "{ref}`preface <reading-the-numbers>`" in READING_BOX

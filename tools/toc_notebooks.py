"""Print the chapter notebooks listed in ``_toc.yml``, one per line, in book order.

Used by ``make test`` (nbval runs exactly these) and ``make notebooks``. Paths are relative
to the repository root. An entry is a notebook when ``<file>.ipynb`` exists; Markdown pages
are skipped. ``--all`` prints every page (``<file>`` as written, no suffix) instead.

Importable too: :func:`toc_files` and :func:`toc_notebooks` take the repository root.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = (".ipynb", ".md")


def _strip_suffix(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _walk(node: object) -> Iterator[str]:
    """Yield every ``file:`` (and ``root:``) entry of a jb-book toc, depth first, in order."""
    if isinstance(node, dict):
        for key in ("root", "file"):
            if key in node:
                yield _strip_suffix(str(node[key]))
        for key in ("parts", "chapters", "sections"):
            for child in node.get(key, []) or []:
                yield from _walk(child)
    elif isinstance(node, list):
        for child in node:
            yield from _walk(child)


def toc_files(root: Path = ROOT) -> list[str]:
    """Every page of the book (repo-relative, without suffix), in the order of ``_toc.yml``."""
    toc = yaml.safe_load((root / "_toc.yml").read_text(encoding="utf-8"))
    if not isinstance(toc, dict) or toc.get("format") != "jb-book":
        raise ValueError(f"{root / '_toc.yml'} is not a jb-book table of contents")
    return list(dict.fromkeys(_walk(toc)))


def toc_notebooks(root: Path = ROOT) -> list[str]:
    """The pages that are notebooks, as repo-relative ``.ipynb`` paths."""
    return [f"{f}.ipynb" for f in toc_files(root) if (root / f"{f}.ipynb").is_file()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--all", action="store_true", help="print every page, not only notebooks"
    )
    args = parser.parse_args(argv)
    for line in toc_files() if args.all else toc_notebooks():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

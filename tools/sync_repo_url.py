"""Copy the repository URL from ``_config.yml`` into every chapter's Colab setup cell.

The URL is written down once, as ``repository.url`` in ``_config.yml``. Each chapter's first
code cell installs ``companion`` from it on Colab, through a line ``REPO = "<url>"``. This
tool rewrites that line in the ``.ipynb`` and in its paired ``py:percent`` file.

    python tools/sync_repo_url.py          # rewrite what is out of step
    python tools/sync_repo_url.py --check  # exit 1 and list what is out of step

A chapter whose first code cell has no ``REPO = "..."`` line is an error in both modes.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toc_notebooks import ROOT, toc_notebooks  # noqa: E402

REPO_LINE = re.compile(
    r'^(?P<indent>[ \t]*)REPO = "(?P<url>[^"]*)"[ \t]*$', re.MULTILINE
)


def config_url(root: Path = ROOT) -> str:
    """``repository.url`` from ``_config.yml``."""
    config = yaml.safe_load((root / "_config.yml").read_text(encoding="utf-8"))
    url = (config.get("repository") or {}).get("url")
    if not url:
        raise SystemExit(f"{root / '_config.yml'} has no repository.url")
    return str(url).rstrip("/")


def _replace(source: str, url: str, where: str) -> str:
    match = REPO_LINE.search(source)
    if match is None:
        raise ValueError(f'{where}: the first code cell has no line REPO = "..."')
    new_line = f'{match["indent"]}REPO = "{url}"'
    return source[: match.start()] + new_line + source[match.end() :]


def _first_code_cell(nb: nbformat.NotebookNode, where: str) -> nbformat.NotebookNode:
    for cell in nb.cells:
        if cell.cell_type == "code":
            return cell
    raise ValueError(f"{where}: no code cell")


def sync_notebook(path: Path, url: str, write: bool) -> bool:
    """Bring one ``.ipynb`` in step; return True if it was (or would be) changed."""
    nb = nbformat.read(path, as_version=4)
    cell = _first_code_cell(nb, str(path))
    new = _replace(cell.source, url, str(path))
    if new == cell.source:
        return False
    if write:
        cell.source = new
        nbformat.write(nb, path)
    return True


def sync_percent(path: Path, url: str, write: bool) -> bool:
    """Bring one ``py:percent`` file in step; return True if it was (or would be) changed.

    The REPO line must sit in the first code cell: the text from the first ``# %%`` marker
    that is not a Markdown/raw cell up to the next marker.
    """
    text = path.read_text(encoding="utf-8")
    markers = list(re.finditer(r"^# %%(.*)$", text, re.MULTILINE))
    code = [m for m in markers if "[markdown]" not in m[1] and "[raw]" not in m[1]]
    if not code:
        raise ValueError(f"{path}: no '# %%' code cell")
    start = code[0].end()
    later = [m.start() for m in markers if m.start() > start]
    end = later[0] if later else len(text)
    cell = _replace(text[start:end], url, str(path))
    new = text[:start] + cell + text[end:]
    if new == text:
        return False
    if write:
        path.write_text(new, encoding="utf-8")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if stale"
    )
    args = parser.parse_args(argv)
    url = config_url()
    stale: list[str] = []
    try:
        for nb in toc_notebooks():
            paths = [ROOT / nb]
            pair = (ROOT / nb).with_suffix(".py")
            if pair.is_file():
                paths.append(pair)
            for path in paths:
                sync = sync_notebook if path.suffix == ".ipynb" else sync_percent
                if sync(path, url, write=not args.check):
                    stale.append(str(path.relative_to(ROOT)))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.check:
        for path in stale:
            print(f"out of step with _config.yml ({url}): {path}", file=sys.stderr)
        if stale:
            print("run: python tools/sync_repo_url.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

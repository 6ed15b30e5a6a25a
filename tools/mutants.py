"""A standing mutation check: do the unit tests catch a broken core mechanism?

Each mutation in ``tools/mutants_list.py`` names a file of ``companion/``, one line of it
(matched without its indentation; it must occur exactly once, else this tool stops with
an error, so the list cannot silently rot), the line that replaces it (indented like the
original) and the tests that should catch it (files or pytest node ids). The tool copies
``companion/``, ``tests/`` and ``pyproject.toml`` into a temporary directory, checks that
``companion`` is imported from the copy there (not the editable install of this
checkout), runs the union of all named tests on the unmutated copy (they must pass),
then for each mutation: writes the line, runs ``pytest -x`` on its tests, restores the
file. KILLED: the tests fail (or run past the time limit); SURVIVED: they pass.

A killing test is part of ``make unit`` (tests/ minus the browser tests), so every killed
mutation makes ``make unit`` fail too. The report gives one line per mutation (id,
file:line, the change, the verdict, the test that failed, seconds) and the survivors at
the end; the exit status is 1 if any mutation survived (2 for a bad list or a failing
unmutated run).

    make mutants                                # all of them, under the Makefile's env
    .venv/bin/python tools/mutants.py rope-     # only ids starting with "rope-"
    .venv/bin/python tools/mutants.py --list    # the list, nothing run
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutants_list import MUTATIONS  # noqa: E402

COPIED = ("companion", "tests", "pyproject.toml")
LIMIT_S = 900  # per pytest run; a hang counts as killed ("timeout")


class ListError(Exception):
    """The mutation list does not fit the code."""


def locate(root: Path, m: dict) -> tuple[list[str], int]:
    """The file's lines and the index of the one line ``m["old"]`` names (exactly
    one)."""
    path = root / m["file"]
    if not path.is_file():
        raise ListError(f"{m['id']}: no file {m['file']}")
    lines = path.read_text().splitlines(keepends=True)
    want = m["old"].strip()
    hits = [i for i, line in enumerate(lines) if line.strip() == want]
    if len(hits) != 1:
        raise ListError(
            f"{m['id']}: {m['file']} holds the line {want!r} {len(hits)} times "
            "(needs exactly 1)"
        )
    return lines, hits[0]


def check_list(root: Path) -> None:
    """Raise a ListError for a duplicate id, a missing test file, a line not found once,
    or a replacement equal to the original."""
    seen = set()
    for m in MUTATIONS:
        if m["id"] in seen:
            raise ListError(f"duplicate id {m['id']}")
        seen.add(m["id"])
        locate(root, m)
        if m["new"].strip() == m["old"].strip():
            raise ListError(f"{m['id']}: the replacement equals the original")
        if not m["tests"]:
            raise ListError(f"{m['id']}: no tests named")
        for t in m["tests"]:
            if not (root / t.split("::")[0]).is_file():
                raise ListError(f"{m['id']}: no test file {t.split('::')[0]}")


def make_copy() -> Path:
    """A fresh copy of what the tests need, without caches; returns its root."""
    top = Path(tempfile.mkdtemp(prefix="mutants-"))
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, top / name, ignore=skip)
        else:
            shutil.copy2(src, top / name)
    return top


def environment(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(copy) + os.pathsep + env.get("PYTHONPATH", "")
    # no .pyc written, so a restored file is never read from a stale one
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("MPLBACKEND", "Agg")
    return env


def check_import(copy: Path, env: dict[str, str]) -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import companion; print(companion.__file__)"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(out).resolve().is_relative_to(copy.resolve()):
        raise ListError(f"companion is imported from {out}, not from the copy {copy}")
    print(f"companion imported from the copy: {out}")


def run_tests(copy: Path, env: dict[str, str], tests: list[str]) -> tuple[bool, str]:
    """(passed, the first failing test or why) for ``pytest -x`` on ``tests``."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
    try:
        res = subprocess.run(
            cmd + tests,
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            timeout=LIMIT_S,
        )
    except subprocess.TimeoutExpired:
        return False, f"timeout after {LIMIT_S} s"
    if res.returncode == 0:
        return True, ""
    text = res.stdout + res.stderr
    found = re.search(r"^(?:FAILED|ERROR) (\S+)", text, re.MULTILINE)
    if found:
        return False, found.group(1)
    return False, f"pytest exit {res.returncode}: " + " | ".join(text.splitlines()[-3:])


def short(text: str, width: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefix", nargs="*", help="run only ids starting with these")
    parser.add_argument("--list", action="store_true", help="print the list and stop")
    args = parser.parse_args()
    try:
        check_list(ROOT)
    except ListError as err:
        print(f"mutants: bad list: {err}", file=sys.stderr)
        return 2
    chosen = [
        m
        for m in MUTATIONS
        if not args.prefix or m["id"].startswith(tuple(args.prefix))
    ]
    if args.list:
        for m in chosen:
            print(
                f"{m['id']:24} {m['file']}: {short(m['old'], 50)} -> {short(m['new'], 50)}"
            )
            print(f"{'':24} tests: {' '.join(m['tests'])}")
        return 0
    start = time.monotonic()
    copy = make_copy()
    try:
        env = environment(copy)
        check_import(copy, env)
        union = list(dict.fromkeys(t for m in chosen for t in m["tests"]))
        t0 = time.monotonic()
        ok, why = run_tests(copy, env, union)
        print(f"unmutated: {len(union)} test targets, {time.monotonic() - t0:.0f} s")
        if not ok:
            print(f"mutants: the unmutated tests fail ({why}); nothing to measure")
            return 2
        survivors = []
        for m in chosen:
            lines, i = locate(copy, m)
            path = copy / m["file"]
            original = path.read_text()
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            lines[i] = indent + m["new"].strip() + "\n"
            t0 = time.monotonic()
            try:
                path.write_text("".join(lines))
                passed, why = run_tests(copy, env, m["tests"])
            finally:
                path.write_text(original)
            verdict = "SURVIVED" if passed else "killed"
            where = f"{m['file'].removeprefix('companion/')}:{i + 1}"
            print(
                f"{m['id']:24} {where:28} {verdict:8} {time.monotonic() - t0:5.0f} s  "
                f"{short(m['what'])}  [{why or ' '.join(m['tests'])}]",
                flush=True,
            )
            if passed:
                survivors.append(m)
        total = time.monotonic() - start
        print(
            f"\n{len(chosen)} mutations, {len(chosen) - len(survivors)} killed, "
            f"{len(survivors)} survived, {total:.0f} s"
        )
        for m in survivors:
            print(
                f"SURVIVOR {m['id']}: {m['file']}: {m['old'].strip()!r} -> {m['new']!r}"
            )
        return 1 if survivors else 0
    finally:
        shutil.rmtree(copy, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

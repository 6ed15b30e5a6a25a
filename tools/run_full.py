"""Run chapters' ``.py`` twins with ``FULL = True`` outside Jupyter and time each one.

This is how the README's table of ``FULL`` times is measured on a GPU machine::

    python tools/run_full.py --jobs 4 --out full.json chapters/0[1-3]_*.py

Each twin runs in its own ``python`` process from ``chapters/``, with its ``FULL = False``
switched to ``True`` (the twin on disk is not changed), ``COMPANION_NUMERICS=native``
(the CPU pin only serves the stored CPU digits) and ``MPLBACKEND=Agg``. A chapter's
asserts run as in the notebook, so a ``FULL`` run that breaks one fails here. The result
is one line per chapter (seconds, exit status, the last line of its error if any) and,
with ``--out``, a JSON file with the same.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_SWITCH = re.compile(r"^FULL = (\(\s*)?False", flags=re.M)


def full_source(twin: Path) -> str:
    """The twin's source with its one ``FULL = False`` switched to ``True``."""
    source = twin.read_text()
    switched, count = _SWITCH.subn(r"FULL = \1True", source, count=2)
    if count != 1:
        raise ValueError(
            f"{twin}: expected exactly one 'FULL = False' line, found {count}"
        )
    return switched


def run_one(
    twin: Path, timeout_s: float, logs: Path | None = None
) -> dict[str, object]:
    """Run one twin with FULL on; return its name, seconds, exit status and error.

    With ``logs``, the twin's stdout and stderr are written to ``logs/<stem>.log``.
    """
    env = os.environ | {"COMPANION_NUMERICS": "native", "MPLBACKEND": "Agg"}
    with tempfile.NamedTemporaryFile(
        "w", suffix=".py", dir=twin.parent, prefix=f".full_{twin.stem}_", delete=False
    ) as handle:
        handle.write(full_source(twin))
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, handle.name],
            cwd=twin.parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        status, tail = done.returncode, done.stderr.strip().splitlines()[-1:]
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as stopped:
        status, tail = None, [f"still running after {timeout_s:.0f} s"]
        output = "".join(
            part.decode() if isinstance(part, bytes) else part or ""
            for part in (stopped.stdout, stopped.stderr)
        )
    finally:
        Path(handle.name).unlink()
    if logs is not None:
        (logs / f"{twin.stem}.log").write_text(output)
    return {
        "chapter": twin.stem,
        "seconds": round(time.perf_counter() - start, 1),
        "status": status,
        "error": tail[0] if status != 0 and tail else "",
    }


def main(argv: list[str] | None = None) -> int:
    """Run the twins named on the command line; exit 1 if any failed or timed out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("twins", nargs="+", type=Path, help="chapters/NN_name.py files")
    parser.add_argument("--jobs", type=int, default=1, help="chapters run at once")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds each")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--logs", type=Path, help="a folder for each chapter's output")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    twins = [path.resolve() for path in args.twins]
    for twin in twins:
        full_source(twin)  # fail before anything runs
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda t: run_one(t, args.timeout, args.logs), twins))
    for row in results:
        print(
            f"{row['chapter']:<32} {row['seconds']:8.1f} s  status {row['status']}"
            f"  {row['error']}"
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all(row["status"] == 0 for row in results) else 1


if __name__ == "__main__":
    sys.exit(main())

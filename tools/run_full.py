"""Run chapters' ``.py`` twins with ``FULL = True`` outside Jupyter and time each one.

This is how the README's table of ``FULL`` times is measured on a GPU machine::

    python tools/run_full.py --jobs 4 --out full.json chapters/0[1-3]_*.py

Each twin runs in its own ``python`` process from ``chapters/``, with its ``FULL = False``
switched to ``True`` (the twin on disk is not changed), ``COMPANION_NUMERICS=native``
(the CPU pin only serves the stored CPU digits), ``MPLBACKEND=Agg`` and the repository
root on ``PYTHONPATH`` (so ``companion`` imports without ``pip install -e``). A chapter's
asserts run as in the notebook, so a ``FULL`` run that breaks one fails here. The result
is one line per chapter (seconds, exit status, the last line of its error if any) and,
with ``--out``, a JSON file with the same, rewritten as each chapter ends (a run that is
stopped keeps the chapters done so far).

Where ``IPython`` or ``ipywidgets`` is not installed (a bare GPU machine), the twin runs
through a small launcher that puts stand-ins for them in ``sys.modules`` first
(:func:`install_display_stubs`): the chapters use them only to show things
(``HTML``, ``Code``, ``glue``, a widget panel), which a run outside Jupyter does not
show anyway. Where both are installed, the twin runs as ``python twin.py``, as before.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_SWITCH = re.compile(r"^FULL = (\(\s*)?False", flags=re.M)
DISPLAY_MODULES = ("IPython", "ipywidgets")
# python -c launcher: the stand-ins, then the twin as __main__ (argv: modules, twin)
_LAUNCH = (
    "import runpy, sys; sys.path.insert(0, {tools!r}); import run_full; "
    "sys.path.pop(0); run_full.install_display_stubs(sys.argv[1].split(',')); "
    "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


class _Shown:
    """Stands in for a display object (``HTML``, ``Code``) or a widget: takes any
    arguments and attributes, shows nothing."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.args, self.kwargs, self.value = args, kwargs, kwargs.get("value")

    def observe(self, *args: object, **kwargs: object) -> None:
        """Widgets' callback registration: nothing will call back outside Jupyter."""


def _any_class(attr: str) -> type:
    """A stand-in for a class name (``HTML``, ``IntSlider``); nothing else, so that
    ``__file__`` and the like stay missing, as tools such as ``inspect`` expect."""
    if attr[:1].isupper():
        return _Shown
    raise AttributeError(attr)


def _stub(name: str, **attrs: object) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__getattr__ = _any_class  # any other class name: a stand-in
    sys.modules[name] = module
    return module


def install_display_stubs(modules: list[str]) -> None:
    """Put stand-ins for the named display modules (``IPython``, ``ipywidgets``) in
    ``sys.modules``: ``IPython.display.display`` shows nothing, ``format_display_data``
    gives the plain-text form (what ``companion.plotting.glue`` stores)."""
    if "IPython" in modules:
        # not in a shell; a version that asks matplotlib for no legacy integration
        ipython = _stub("IPython", get_ipython=lambda: None, version_info=(9, 0))
        ipython.display = _stub("IPython.display", display=lambda *a, **k: None)
        ipython.core = _stub("IPython.core")
        ipython.core.formatters = _stub(
            "IPython.core.formatters",
            format_display_data=lambda obj, *a, **k: ({"text/plain": repr(obj)}, {}),
        )
    if "ipywidgets" in modules:
        _stub("ipywidgets", interactive=_Shown)


def missing_display_modules() -> list[str]:
    """The display modules this Python cannot import."""
    return [name for name in DISPLAY_MODULES if importlib.util.find_spec(name) is None]


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
    twin: Path,
    timeout_s: float,
    logs: Path | None = None,
    stubs: list[str] | None = None,
) -> dict[str, object]:
    """Run one twin with FULL on; return its name, seconds, exit status and error.

    With ``logs``, the twin's stdout and stderr are written to ``logs/<stem>.log``.
    ``stubs`` names the display modules to stand in for (default: the ones missing
    here, :func:`missing_display_modules`; none missing: the twin runs plainly).
    """
    stubs = missing_display_modules() if stubs is None else stubs
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = os.environ | {
        "COMPANION_NUMERICS": "native",
        "MPLBACKEND": "Agg",
        "PYTHONPATH": path,
    }
    with tempfile.NamedTemporaryFile(
        "w", suffix=".py", dir=twin.parent, prefix=f".full_{twin.stem}_", delete=False
    ) as handle:
        handle.write(full_source(twin))
    start = time.perf_counter()
    try:
        launch = [sys.executable, handle.name]
        if stubs:
            code = _LAUNCH.format(tools=str(ROOT / "tools"))
            launch = [sys.executable, "-c", code, ",".join(stubs), handle.name]
        done = subprocess.run(
            launch,
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
    done: list[dict[str, object]] = []
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = [pool.submit(run_one, t, args.timeout, args.logs) for t in twins]
        for run in as_completed(runs):
            done.append(run.result())
            if args.out:  # the chapters so far, in case the run is stopped
                args.out.write_text(json.dumps(done, indent=1) + "\n")
    results = [run.result() for run in runs]
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

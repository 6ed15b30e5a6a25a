"""``make gpu-check``: run the book's GPU checks and write one markdown report.

    python tools/gpu_check.py --out _build/gpu-check/report.md [--budget-s 600]

Five sections, in this order, each in its own process with its own time limit
(``--limit NAME=SECONDS``; the defaults sum to 10 minutes), so a crash or a time-out in
one is reported and the others still run:

- ``env``: the GPU (name, memory, compute capability, bf16), driver, CUDA, Python,
  torch, triton, transformers, CPU cores, the date.
- ``tests``: ``pytest tests -m "not browser"`` with ``COMPANION_DEVICE=cuda`` (``-n``
  half the cores where pytest-xdist is installed): counts and the failed tests' ids.
  Without ``TRITON_INTERPRET`` the kernel tests compile their kernels for this GPU.
- ``kernels``: ``python -m companion.bench kernels --out-json``: its rows as a table
  (a JSON list of row dicts, or a dict holding them under ``rows``).
- ``decode``: ``python -m companion.bench decode`` in bf16 with a preset's random
  weights (``--decode-preset``), against the copy-bandwidth bound: eager alone, then
  eager and compiled (so a compilation that outlasts the limit leaves the first table).
- ``chapters``: every chapter's ``.py`` twin with ``FULL = True`` through
  ``tools/run_full.py`` (``--jobs`` at once): seconds, exit status and last error line.

``--budget-s`` caps the whole run: when the time left is less than the remaining
sections' limits, each limit shrinks in proportion, and a section whose share falls
under 10 s is reported as skipped. The report is rewritten after every section, so a
run that is killed still leaves the sections done so far. Its format: one ``#`` title
naming the GPU; a summary table (section, status, seconds, limit); then one ``##``
section each, with pipe tables and ``text`` code blocks only (valid MyST, so the file
can be a page of the book). Anything a program printed is inside a code span or block.
Statuses: ``ok``, ``failed (exit N)``, ``crashed (signal N)``, ``timed out after N s``,
``skipped: ...``, ``not available: ...``. Logs and raw results go to ``--work``
(default: ``<report>_files`` beside the report). Without a CUDA GPU the tool exits 2,
unless ``--allow-cpu`` (for testing it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMITS = {"env": 30, "tests": 180, "kernels": 90, "decode": 90, "chapters": 210}
MIN_SHARE_S = 10.0
_ENV = """
import datetime, json, os, platform, subprocess, torch
info = {"date (UTC)": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "python": platform.python_version(), "torch": torch.__version__,
        "CUDA (torch build)": str(torch.version.cuda), "CPU cores": os.cpu_count()}
for name in ("triton", "transformers", "numpy"):
    try:
        info[name] = __import__(name).__version__
    except ImportError:
        info[name] = "not installed"
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info |= {"GPU": p.name, "GPUs": torch.cuda.device_count(),
             "memory (GiB)": round(p.total_memory / 2**30, 1),
             "compute capability": f"{p.major}.{p.minor}",
             "bf16": torch.cuda.is_bf16_supported()}
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
            "--format=csv,noheader"], capture_output=True, text=True).stdout.split()[0]
    except (OSError, IndexError):
        info["driver"] = "nvidia-smi not found"
print(json.dumps(info))
"""


@dataclass
class Result:
    """What one section's process did."""

    status: str
    seconds: float
    limit_s: float
    stdout: str = ""
    stderr: str = ""


@dataclass
class Section:
    """A name, a title, a time limit, the command to run (or the reason it cannot) and
    how to render its result (markdown, without the heading)."""

    name: str
    title: str
    limit_s: float
    command: Callable[[], list[str] | str]
    render: Callable[[Result], str]
    env: dict[str, str] = field(default_factory=dict)


def cell(text: object, in_table: bool = True) -> str:
    """Program output as one line in a code span (pipes escaped for a table cell)."""
    text = " ".join(str(text).split()).replace("`", "'")
    text = text.replace("|", "\\|") if in_table else text
    return f"`{text}`" if text else ""


def table(rows: list[dict[str, object]], plain: tuple[str, ...] = ()) -> str:
    """Rows of dicts as a pipe table over the union of their keys; strings in code
    spans, except in the ``plain`` columns (the tool's own words)."""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    if not keys:
        return "No rows."
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        values = [_value(row.get(k, ""), k in plain) for k in keys]
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)


def _value(v: object, plain: bool = False) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return cell(v) if isinstance(v, str) and v and not plain else str(v)


def fence(text: str, lines: int = 25) -> str:
    """The last ``lines`` lines of ``text`` as a ``text`` code block."""
    tail = "\n".join(text.rstrip().splitlines()[-lines:]).replace("```", "'''")
    return f"```text\n{tail}\n```"


def run_section(section: Section, limit_s: float) -> Result:
    """Run one section's command in its own process group, killed at ``limit_s``."""
    command = section.command()
    if isinstance(command, str):
        return Result(f"not available: {command}", 0.0, limit_s)
    start = time.perf_counter()
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=os.environ | section.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=limit_s)
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        if proc.returncode < 0:
            status = f"crashed (signal {-proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        status = f"timed out after {limit_s:.0f} s"
    return Result(status, round(time.perf_counter() - start, 1), limit_s, out, err)


def write_report(out: Path, title: str, done: list[tuple[Section, Result]]) -> None:
    """(Re)write the whole report from the sections done so far."""
    summary = [
        {
            "section": s.title,
            "status": r.status,
            "seconds": r.seconds,
            "limit (s)": round(r.limit_s),
        }
        for s, r in done
    ]
    parts = [f"# {title}", table(summary, plain=("section",))]
    for section, result in done:
        try:
            body = (
                section.render(result)
                if not result.status.startswith(("skipped", "not available"))
                else ""
            )
        except Exception as err:  # a renderer must not lose the report
            body = f"The output could not be read: {cell(repr(err), in_table=False)}"
        # a failure's stderr; its stdout where the body does not show it already
        tail = result.stderr or ("" if "```" in body else result.stdout)
        if result.status != "ok" and tail.strip():
            body += "\n\nThe end of its output:\n\n" + fence(tail)
        status = cell(result.status, in_table=False)
        parts.append(f"## {section.title}\n\nStatus: {status}.\n\n{body}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n".join(p.rstrip() for p in parts) + "\n")


def run_all(
    sections: list[Section], out: Path, budget_s: float, title: str = "GPU check"
) -> list[tuple[Section, Result]]:
    """Run the sections in order within ``budget_s``, rewriting ``out`` after each."""
    done: list[tuple[Section, Result]] = []
    deadline = time.perf_counter() + budget_s
    for i, section in enumerate(sections):
        left = deadline - time.perf_counter()
        planned = sum(s.limit_s for s in sections[i:])
        limit = section.limit_s * min(1.0, left / planned) if planned else 0.0
        if limit < MIN_SHARE_S:
            result = Result(f"skipped: {left:.0f} s of the budget left", 0.0, limit)
        else:
            result = run_section(section, limit)
        done.append((section, result))
        if section.name == "env" and result.status == "ok":
            title = f"GPU check: {json.loads(result.stdout).get('GPU', 'no GPU')}"
        write_report(out, title, done)
    return done


def parse_pytest(text: str) -> dict[str, object]:
    """Counts from pytest's last summary line and the ids of its ``FAILED``/``ERROR``
    lines (``-rfE``)."""
    counts: dict[str, object] = {}
    finals = re.findall(r"^=*\s*(\d+ \w+.*) in [\d.]+s", text, flags=re.M)
    for number, word in re.findall(r"(\d+) (\w+)", finals[-1] if finals else ""):
        counts[word.rstrip("s") if word in ("errors", "warnings") else word] = int(
            number
        )
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, flags=re.M)
    return counts | {"failed ids": failed}


def render_env(result: Result) -> str:
    """The environment probe's JSON as a two-column table."""
    info = json.loads(result.stdout)
    return table([{"what": k, "value": v} for k, v in info.items()], plain=("what",))


def render_tests(result: Result) -> str:
    """The pytest counts as a table and the failed ids as a list."""
    parsed = parse_pytest(result.stdout)
    failed = parsed.pop("failed ids")
    progress = re.findall(r"\[\s*(\d+)%\]", result.stdout)
    lines = [table([parsed]) if parsed else "No pytest summary line."]
    if not parsed and progress:
        lines.append(f"It had reached {progress[-1]}% of the tests.")
    lines += [f"- {cell(test, in_table=False)}" for test in failed]
    return "\n\n".join(lines)


def render_json_rows(path: Path) -> Callable[[Result], str]:
    """A renderer for a section whose program wrote JSON: a list of row dicts, or a
    dict whose ``rows`` are that (its other keys become a table above); without the
    file, what the program printed."""

    def render(result: Result) -> str:
        if not path.exists():
            return fence(result.stdout or "(no output)", 40)
        data = json.loads(path.read_text())
        if isinstance(data, list):
            return table(data)
        about = [{"what": k, "value": v} for k, v in data.items() if k != "rows"]
        return table(about, plain=("what",)) + "\n\n" + table(data.get("rows", []))

    return render


def render_chapters(path: Path, twins: list[Path]) -> Callable[[Result], str]:
    """The chapters table from run_full's JSON; chapters missing from it did not end."""

    def render(result: Result) -> str:
        rows = json.loads(path.read_text()) if path.exists() else []
        ended = {row["chapter"] for row in rows}
        rows += [
            {"chapter": t.stem, "seconds": "", "status": "", "error": "did not end"}
            for t in twins
            if t.stem not in ended
        ]
        order = [t.stem for t in twins]
        return table(sorted(rows, key=lambda row: order.index(row["chapter"])))

    return render


def book_sections(args: argparse.Namespace, device: str) -> list[Section]:
    """The five sections of the check, with their commands and renderers."""
    py, work = sys.executable, args.work
    limits = LIMITS | dict(args.limit)
    pytest = [py, "-m", "pytest", "tests", "-m", "not browser", "-q", "-rfE"]
    pytest += ["-p", "no:cacheprovider"]
    if importlib.util.find_spec("xdist") is not None:
        pytest += ["-n", str(max(1, (os.cpu_count() or 2) // 2))]
    kernels_json, full_json = work / "kernels.json", work / "full.json"
    twins = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py"))
    per_chapter = max(MIN_SHARE_S, limits["chapters"] - 10)

    def kernels() -> list[str] | str:
        if importlib.util.find_spec("companion.bench.kernels") is None:
            return "companion.bench has no kernels benchmark"
        return [py, "-m", "companion.bench", "kernels", "--out-json", str(kernels_json)]

    decode = [py, "-m", "companion.bench", "decode", "--device", device, "--dtype"]
    decode += ["bf16" if device == "cuda" else "fp32", "--preset", args.decode_preset]
    decode += ["--new-tokens", "64", "--repeats", "3"]
    # eager alone first, so a compilation that outlasts the limit still leaves a table
    both = f"{shlex.join([*decode, '--no-compile'])} && {shlex.join(decode)}"
    chapters = [py, str(ROOT / "tools" / "run_full.py"), "--jobs", str(args.jobs)]
    chapters += ["--timeout", str(per_chapter), "--out", str(full_json)]
    chapters += ["--logs", str(work / "chapters"), *map(str, twins)]
    paths = {  # the repository importable; output unbuffered, so a killed run keeps it
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.getenv("PYTHONPATH")])
        ),
        "PYTHONUNBUFFERED": "1",
    }
    return [
        Section(
            "env",
            "Environment",
            limits["env"],
            lambda: [py, "-c", _ENV],
            render_env,
            paths,
        ),
        Section(
            "tests",
            "Unit tests on the GPU",
            limits["tests"],
            lambda: pytest,
            render_tests,
            paths | {"COMPANION_DEVICE": device, "MPLBACKEND": "Agg"},
        ),
        Section(
            "kernels",
            "Kernels against the references",
            limits["kernels"],
            kernels,
            render_json_rows(kernels_json),
            paths,
        ),
        Section(
            "decode",
            "Decoding against the bandwidth bound",
            limits["decode"],
            lambda: ["sh", "-c", both],
            lambda r: fence(r.stdout, 40),
            paths,
        ),
        Section(
            "chapters",
            "Every chapter with FULL = True",
            limits["chapters"],
            lambda: chapters,
            render_chapters(full_json, twins),
            paths,
        ),
    ]


def _limit(text: str) -> tuple[str, float]:
    name, _, seconds = text.partition("=")
    if name not in LIMITS or not seconds.replace(".", "", 1).isdigit():
        raise argparse.ArgumentTypeError(
            f"expected NAME=SECONDS with NAME one of {', '.join(LIMITS)}, got {text!r}"
        )
    return name, float(seconds)


def main(argv: list[str] | None = None) -> int:
    """Run the check; exit 0 when every section that ran is ok, 1 otherwise, 2 without
    a CUDA GPU (unless ``--allow-cpu``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the report (.md)")
    parser.add_argument("--work", type=Path, help="logs and raw results")
    parser.add_argument("--budget-s", type=float, default=sum(LIMITS.values()))
    parser.add_argument("--limit", type=_limit, action="append", default=[])
    parser.add_argument("--sections", default=",".join(LIMITS), help="comma-separated")
    parser.add_argument("--jobs", type=int, default=4, help="chapters run at once")
    parser.add_argument("--decode-preset", default="llama3-8b")
    parser.add_argument("--allow-cpu", action="store_true", help="for testing")
    args = parser.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(LIMITS)
    if unknown or args.jobs < 1 or args.budget_s <= 0:
        parser.error(
            f"--sections takes {', '.join(LIMITS)} (got {sorted(unknown)}); "
            "--jobs and --budget-s must be positive"
        )
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print(
            "gpu-check: no CUDA GPU here (torch.cuda.is_available() is False, torch "
            f"{torch.__version__}); it needs one. --allow-cpu runs it anyway, for testing.",
            file=sys.stderr,
        )
        return 2
    args.work = args.work or args.out.with_name(args.out.stem + "_files")
    args.work.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    chosen = args.sections.split(",")
    sections = [s for s in book_sections(args, device) if s.name in chosen]
    done = run_all(sections, args.out, args.budget_s)
    for leftover in (ROOT / "chapters").glob(".full_*.py"):  # a killed run_full's
        leftover.unlink()
    print(f"gpu-check: wrote {args.out}")
    for section, result in done:
        print(f"  {section.name:<10}{result.seconds:>8.1f} s  {result.status}")
    return 0 if all(r.status == "ok" for _, r in done) else 1


if __name__ == "__main__":
    sys.exit(main())

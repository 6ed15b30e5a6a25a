"""tools/run_full.py: each chapter twin's FULL switch is found, and a run reports what
happened (exit status, error line, time-out)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import run_full  # noqa: E402

TWINS = sorted(p for p in (ROOT / "chapters").glob("[0-9][0-9]_*.py"))


@pytest.mark.parametrize("twin", TWINS, ids=[t.stem for t in TWINS])
def test_every_twin_switches_to_full(twin: Path) -> None:
    source = run_full.full_source(twin)
    assert run_full._SWITCH.search(source) is None
    assert re.search(r"^FULL = (\(\s*)?True", source, flags=re.M)
    compile(source, str(twin), "exec")  # still Python


def test_a_twin_without_one_switch_is_refused(tmp_path: Path) -> None:
    for body in ("x = 1\n", "FULL = False\nFULL = False\n"):
        twin = tmp_path / "01_x.py"
        twin.write_text(body)
        with pytest.raises(ValueError, match="exactly one 'FULL = False'"):
            run_full.full_source(twin)


def _twin(tmp_path: Path, body: str) -> Path:
    twin = tmp_path / "01_x.py"
    twin.write_text("FULL = False\n" + body)
    return twin


def test_a_run_reports_status_error_and_log(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    ok = run_full.run_one(_twin(tmp_path, "assert FULL\nprint('ran')\n"), 60, logs)
    assert (ok["status"], ok["error"]) == (0, "")
    assert "ran" in (logs / "01_x.log").read_text()
    bad = run_full.run_one(_twin(tmp_path, "assert not FULL, 'was on'\n"), 60)
    assert bad["status"] == 1 and bad["error"] == "AssertionError: was on"
    slow = run_full.run_one(_twin(tmp_path, "import time\ntime.sleep(30)\n"), 1)
    assert slow["status"] is None and "still running after 1 s" in slow["error"]
    assert list(tmp_path.glob(".full_*")) == []  # the switched copies are removed


def test_main_exits_nonzero_when_a_chapter_fails(tmp_path: Path) -> None:
    twin = _twin(tmp_path, "raise SystemExit(3)\n")
    out = tmp_path / "full.json"
    assert run_full.main([str(twin), "--out", str(out)]) == 1
    assert '"status": 3' in out.read_text()
    with pytest.raises(SystemExit):
        run_full.main([str(twin), "--jobs", "0"])

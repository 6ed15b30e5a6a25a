"""tools/gpu_check.py on the CPU: the report from fake sections (a crash, a time-out, a
chapters table), rewritten after each section, the budget, the pytest-summary parser,
the refusal without a GPU; and tools/run_full.py's stand-ins for IPython."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import gpu_check  # noqa: E402
import run_full  # noqa: E402
from gpu_check import Result, Section  # noqa: E402


def _section(name: str, code: str, limit_s: float = 30, render=None) -> Section:
    return Section(
        name,
        f"Fake {name}",
        limit_s,
        lambda: [sys.executable, "-c", code],
        render or (lambda r: gpu_check.fence(r.stdout)),
    )


@pytest.fixture(autouse=True)
def _short_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "MIN_SHARE_S", 1.0)  # short sleeps suffice


# a section that starts a process of its own (pytest workers, chapters), then hangs
SLOW = (
    "import subprocess, sys, time; print('started', flush=True); "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
    "time.sleep(30)"
)


def test_report_has_every_section_and_is_rewritten_after_each(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    reader = f"print(open({str(out)!r}).read())"  # sees the report as it stands
    sections = [
        _section("ok", "print('fine')"),
        _section("crash", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"),
        _section("fail", "import sys; print('boom |x|', file=sys.stderr); sys.exit(3)"),
        _section("slow", SLOW, 2),
        _section("reader", reader),
    ]
    done = gpu_check.run_all(sections, out, budget_s=200)
    status = {s.name: r.status for s, r in done}
    assert status == {
        "ok": "ok",
        "crash": "crashed (signal 9)",
        "fail": "failed (exit 3)",
        "slow": "timed out after 2 s",
        "reader": "ok",
    }
    assert done[3][1].seconds < 10  # its child was stopped with it, not waited for
    seen_by_reader = done[-1][1].stdout
    assert "## Fake slow" in seen_by_reader and "timed out after 2 s" in seen_by_reader
    report = out.read_text()
    assert report.count("\n# ") + report.startswith("# ") == 1  # one title
    assert "| Fake fail | `failed (exit 3)` |" in report
    assert "boom |x|" in report  # the failing section's output, in a code block
    assert "started" in report  # a timed-out section keeps what it printed


def test_sections_shrink_to_the_budget_and_are_skipped_when_it_is_spent(
    tmp_path: Path,
) -> None:
    sections = [
        _section("a", "import time; time.sleep(30)", limit_s=100),
        _section("b", "pass", limit_s=1),
    ]
    done = gpu_check.run_all(sections, tmp_path / "r.md", budget_s=2.02)
    first, second = (r for _, r in done)
    assert first.limit_s == pytest.approx(2, abs=0.02)  # its 100/101 of 2.02 s
    assert first.status == "timed out after 2 s"
    assert second.status.startswith("skipped") and second.seconds == 0.0


def test_a_renderer_that_raises_does_not_lose_the_report(tmp_path: Path) -> None:
    def broken(result: Result) -> str:
        raise KeyError("no such key")

    out = tmp_path / "r.md"
    gpu_check.run_all([_section("x", "pass", render=broken)], out, 60)
    assert "could not be read: `KeyError('no such key')`" in out.read_text()


def test_tables_keep_program_output_in_code_spans() -> None:
    rows = [{"kernel": "flash|fwd", "TFLOP/s": 123.456}, {"kernel": "a`b", "x": ""}]
    text = gpu_check.table(rows, plain=())
    assert text.splitlines()[0] == "| kernel | TFLOP/s | x |"
    assert "| `flash\\|fwd` | 123.5 |  |" in text
    assert "`a'b`" in text  # a backtick cannot close the code span early


def test_chapters_table_lists_the_chapters_that_did_not_end(tmp_path: Path) -> None:
    full = tmp_path / "full.json"
    rows = [{"chapter": "02_b", "seconds": 3.0, "status": 1, "error": "E: gguf"}]
    full.write_text(json.dumps(rows))
    twins = [Path("01_a.py"), Path("02_b.py")]
    text = gpu_check.render_chapters(full, twins)(Result("timed out", 1, 1))
    lines = text.splitlines()
    assert lines[2].startswith("| `01_a` |") and "`did not end`" in lines[2]
    assert lines[3] == "| `02_b` | 3 | 1 | `E: gguf` |"


def test_json_rows_as_a_list_a_dict_or_missing(tmp_path: Path) -> None:
    path = tmp_path / "k.json"
    render = gpu_check.render_json_rows(path)
    assert "needs a CUDA GPU" in render(Result("ok", 1, 1, "it needs a CUDA GPU\n"))
    path.write_text(json.dumps([{"impl": "triton", "ms": 0.5}]))
    assert render(Result("ok", 1, 1)).splitlines()[2] == "| `triton` | 0.5 |"
    rows = [{"impl": "sdpa", "tflops": None}, {"impl": "triton", "tflops": 312.4}]
    path.write_text(json.dumps({"device": "H100", "tiny": False, "rows": rows}))
    text = render(Result("ok", 1, 1))
    assert "| device | `H100` |" in text and "| tiny | False |" in text
    assert "| impl | tflops |" in text and "| `sdpa` |  |" in text
    assert gpu_check.table([]) == "No rows."


PYTEST_OUT = """\
..F.s [ 50%]
=========================== short test summary info ============================
FAILED tests/test_x.py::test_a[cuda] - AssertionError: assert 1 == 2
ERROR tests/test_y.py::test_b - RuntimeError: CUDA error
== 1 failed, 310 passed, 12 skipped, 2 warnings, 1 error in 95.31s (0:01:35) ==
"""


def test_pytest_summary_parser() -> None:
    parsed = gpu_check.parse_pytest(PYTEST_OUT)
    assert parsed == {
        "failed": 1,
        "passed": 310,
        "skipped": 12,
        "warning": 2,
        "error": 1,
        "failed ids": ["tests/test_x.py::test_a[cuda]", "tests/test_y.py::test_b"],
    }
    assert gpu_check.parse_pytest("..") == {"failed ids": []}
    stopped = gpu_check.render_tests(Result("timed out", 1, 1, "....  [ 37%]\n"))
    assert "reached 37% of the tests" in stopped


def test_without_a_gpu_it_refuses_unless_allowed(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    out = tmp_path / "r.md"
    tool = [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--out", str(out)]
    refused = subprocess.run(tool, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "no CUDA GPU" in refused.stderr
    assert not out.exists()
    allowed = subprocess.run(
        [*tool, "--sections", "env", "--allow-cpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert allowed.returncode == 0, allowed.stderr
    assert out.read_text().startswith("# GPU check: no GPU\n")
    assert "| torch |" in out.read_text()


def test_bad_arguments_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--limit", "tests=x"], ["--sections", "env,nope"]):
        with pytest.raises(SystemExit):
            gpu_check.main(["--out", "r.md", *argv])
        err = capsys.readouterr().err
        assert "--limit" in err or "--sections" in err


def test_run_full_stands_in_for_missing_display_modules(tmp_path: Path) -> None:
    twin = tmp_path / "01_x.py"
    twin.write_text(
        "FULL = False\n"
        "import sys\n"
        "from IPython.display import HTML, Code\n"
        "import ipywidgets as widgets\n"
        "from companion.plotting import glue\n"
        "assert sys.modules['IPython'].__spec__ is None, 'the real IPython'\n"
        "glue('x', 3.5, display=False)\n"
        "w = widgets.IntSlider(3, 1, 5, description='d')\n"
        "w.observe(print, names='value')\n"
        "widgets.interactive(print, a=w)\n"
        "HTML('<b>x</b>'), Code('x = 1', language='python')\n"
        "import inspect, matplotlib.pyplot as plt\n"  # both look IPython over
        "plt.subplots(), inspect.getsource(glue)\n"
        "assert not hasattr(sys.modules['IPython'], '__file__')\n"  # as inspect wants
        "import os\n"  # companion importable without pip install -e:
        f"assert os.environ['PYTHONPATH'].split(os.pathsep)[0] == {str(ROOT)!r}\n"
    )
    stubbed = run_full.run_one(twin, 60, stubs=["IPython", "ipywidgets"])
    assert (stubbed["status"], stubbed["error"]) == (0, "")
    if not run_full.missing_display_modules():  # both installed: the twin runs plainly
        plain = run_full.run_one(twin, 60)
        assert plain["error"] == "AssertionError: the real IPython"


def test_decode_bench_without_a_reference_reports_eager_and_bound() -> None:
    torch = pytest.importorskip("torch")
    from companion.bench.decode import bench_decode, format_decode
    from companion.models.decoder import DecoderLM
    from companion.models.presets import tiny

    torch.manual_seed(0)
    model = DecoderLM(tiny()).eval()
    ids = torch.randint(model.cfg.vocab_size, (1, 5))
    r = bench_decode(model, None, ids, new_tokens=3, repeats=1, compiled=False)
    assert "transformers_tps" not in r and r["companion_tps"] > 0
    assert r["weight_mb"] * 1e6 == sum(p.numel() * 4 for p in model.parameters())
    table = format_decode(r)
    assert table.splitlines()[1].startswith("eager") and "transformers" not in table
    assert f"= {r['bound_tps']:.1f} tokens/s" in table


def test_decode_command_names_a_bad_preset(capsys: pytest.CaptureFixture[str]) -> None:
    from companion.bench import main

    with pytest.raises(SystemExit):
        main(["decode", "--preset", "gpt-5"])
    assert "argument --preset: unknown preset 'gpt-5'" in capsys.readouterr().err

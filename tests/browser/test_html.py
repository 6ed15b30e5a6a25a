"""The built HTML book works in a real browser, offline.

Serves ``_build/html`` on 127.0.0.1 and opens every page of ``_toc.yml`` in Debian's
Chromium through Playwright (never ``playwright install``: it downloads a browser). Each page
must load, render its math with the local MathJax, load every image, run its matplotlib
animations and raise no JavaScript error. Requests to any other host are blocked and fail
the test, so a page that works here works without a network.

Run after ``make book``: ``pytest tests/browser -m browser``. Without ``/usr/bin/chromium``
the tests skip, unless ``CI`` is set: then they fail.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
HTML = ROOT / "_build" / "html"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
IN_CI = bool(os.environ.get("CI"))

# Errors we accept: (message regex, where regex, why). "where" is the error's stack or the
# console message's URL. Everything else on the console, and every uncaught error, fails.
ALLOWED_ERRORS: list[tuple[str, str, str]] = [
    # The widget renderer (html-manager's embed-amd.js) typesets widget labels through
    # MathJax 2's MathJax.Hub.Queue; the book loads MathJax 3, which has no Hub. The widgets
    # still render (checked in test_page); only LaTeX inside widget labels stays raw.
    (
        r"^Cannot read properties of undefined \(reading 'Queue'\)$",
        r"/_static/js/embed-amd\.js",
        "widget renderer expects MathJax 2",
    ),
    # sphinx-thebe 0.3.1 registers its inline config script twice (once through the app and
    # once through the builder), so the second `const THEBE_JS_URL` throws at parse time.
    # The first copy defines everything; "Live Code" loads thebe only when pressed.
    (
        r"^Identifier 'THEBE_JS_URL' has already been declared$",
        r"",
        "sphinx-thebe config script included twice",
    ),
]
# External requests we accept (blocked, and the page must still work without them).
ALLOWED_EXTERNAL: list[tuple[str, str]] = [
    # matplotlib's to_jshtml() links Font Awesome 4 CSS from a CDN for its button icons;
    # the theme's local Font Awesome draws them anyway (checked in test_page).
    (r"^https://maxcdn\.bootstrapcdn\.com/font-awesome/", "jshtml button icons"),
]
# A failed load is also logged on the console, with the URL as its location.
FAILED_LOAD = re.compile(r"^Failed to load resource: ")


def _load_toc_module():
    path = ROOT / "tools" / "toc_notebooks.py"
    spec = importlib.util.spec_from_file_location("toc_notebooks", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PAGES: list[str] = _load_toc_module().toc_files(ROOT)


def _unavailable(reason: str) -> None:
    """Skip outside CI, fail in CI: CI must not pass without having looked at the book."""
    if IN_CI:
        pytest.fail(f"{reason} (CI is set, so this is a failure)", pytrace=False)
    pytest.skip(reason)


# --- what the sources say each page should contain -------------------------------------

_FENCE = re.compile(r"^(```+|~~~+)(.*?)$.*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"`+[^`\n]*`+")
_MATH = re.compile(r"\$\$|\$[^\s$][^$\n]*\$|\{math\}|\\\(|\\\[|\\begin\{")


def _markdown_sources(doc: str) -> tuple[list[str], list[dict]]:
    """Markdown text and code-cell outputs of a page (outputs only for notebooks)."""
    nb_path = ROOT / f"{doc}.ipynb"
    if nb_path.is_file():
        nb = json.loads(nb_path.read_text(encoding="utf-8"))
        texts = [
            "".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"
        ]
        outputs = [
            o
            for c in nb["cells"]
            if c["cell_type"] == "code"
            for o in c.get("outputs", [])
        ]
        return texts, outputs
    return [(ROOT / f"{doc}.md").read_text(encoding="utf-8")], []


def _has_math(doc: str) -> bool:
    texts, _ = _markdown_sources(doc)
    for text in texts:
        # math fences ({math}) count; other code fences and inline code do not
        text = _FENCE.sub(lambda m: "{math}" if "{math}" in m[2] else "", text)
        if _MATH.search(_INLINE_CODE.sub("", text)):
            return True
    return False


# A glued output is shown where a {glue:figure}/{glue:any} directive pastes it; a paste
# from another page names that page's notebook with :doc:.
_PASTE = re.compile(
    r"```\{glue(?::figure|:any)?\}[ \t]+(\S+)[ \t]*\n(?::doc:[ \t]*(\S+))?"
)
_HIDDEN = {"remove-cell", "remove-output"}


def _has(out: dict, needle: str) -> bool:
    data = out.get("data", {})
    blobs = ["".join(v) if isinstance(v, list) else str(v) for v in data.values()]
    return any(needle in b for b in blobs) or needle in data


def _glued(nb_path: Path) -> dict[str, dict]:
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    return {
        out["metadata"]["scrapbook"]["name"]: out
        for c in nb["cells"]
        if c["cell_type"] == "code"
        for out in c.get("outputs", [])
        if "scrapbook" in out.get("metadata", {})
    }


def _shown_outputs(doc: str) -> list[dict]:
    """The stored outputs the page shows: those of cells the book does not hide, and the
    glued outputs its paste directives name (from this notebook or, with :doc:, another)."""
    texts, _ = _markdown_sources(doc)
    nb_path = ROOT / f"{doc}.ipynb"
    shown: list[dict] = []
    if nb_path.is_file():
        nb = json.loads(nb_path.read_text(encoding="utf-8"))
        for cell in nb["cells"]:
            tags = set(cell["metadata"].get("tags", []))
            if cell["cell_type"] == "code" and not _HIDDEN & tags:
                shown += cell.get("outputs", [])
    for text in texts:
        for key, other in _PASTE.findall(text):
            source = (ROOT / doc).parent / other if other else nb_path
            shown.append(_glued(source.resolve())[key])
    return shown


def _count_outputs(doc: str, needle: str) -> int:
    """How many outputs the page shows contain ``needle`` in one of their forms."""
    return sum(_has(out, needle) for out in _shown_outputs(doc))


# The book's labelled figures: label -> (page, least number of frames; 0: a still).
FIGURES: dict[str, tuple[str, int]] = {
    "fig-morph": ("chapters/14_the_morph", 14),
    "fig-residual-stream": ("chapters/06_normalization", 13),
    "fig-rope": ("chapters/05_position", 12),
    "fig-norm-placement": ("chapters/06_normalization", 11),
    "fig-gated-ffn": ("chapters/07_gated_ffn", 9),
    "fig-kv-cache": ("chapters/08_kv_cache", 11),
    "fig-masks": ("chapters/09_sliding_windows", 12),
    "fig-moe": ("chapters/10_mixture_of_experts", 12),
    "fig-beyond-softmax": ("chapters/11_linear_attention", 0),
    "fig-sink": ("chapters/12_small_changes", 11),
    "fig-calculator": ("chapters/13_build_a_model", 0),
    "fig-sparse-turn": ("chapters/13_build_a_model", 0),
    "fig-kv-heads": ("chapters/13_build_a_model", 0),
    "fig-morph-curves": ("chapters/14_the_morph", 0),
    "fig-one-query": ("chapters/02_attention", 0),
    "fig-heads": ("chapters/02_attention", 0),
    "fig-n2-bill": ("chapters/02_attention", 0),
    "fig-tiled-memory": ("chapters/02_attention", 0),
    "fig-mlm-gpt": ("chapters/04_encoders_decoders_scale", 0),
    "fig-smollm2-stream": ("chapters/06_normalization", 0),
    "fig-rope-layers": ("chapters/05_position", 0),
    "fig-copy-lengths": ("chapters/05_position", 0),
    "fig-dsa-mass": ("chapters/15_select_compress_widen", 0),
    "fig-kv-bytes": ("chapters/15_select_compress_widen", 0),
    "fig-isoflop": ("chapters/04_encoders_decoders_scale", 0),
    "fig-ffn-shakespeare": ("chapters/07_gated_ffn", 0),
    "fig-icl-gd": ("chapters/02_attention", 0),
    "fig-layer-cost": ("chapters/01_sequential_cage", 0),
    "fig-path-length": ("chapters/01_sequential_cage", 0),
    "fig-dyt-smollm2": ("chapters/06_normalization", 0),
    "fig-kv-dtype": ("chapters/08_kv_cache", 0),
    "fig-ep-traffic": ("chapters/10_mixture_of_experts", 0),
    "fig-quant-row-error": ("chapters/16_serving", 0),
    "fig-paged-footprint": ("chapters/16_serving", 0),
    "fig-phases-roofline": ("chapters/16_serving", 0),
    "fig-spec-yield": ("chapters/17_speculative_decoding", 0),
}
# Unlabelled animations a page must show: page -> frame counts (the intro's small morph).
MIN_FRAMES: dict[str, tuple[int, ...]] = {"book/intro": (14,)}


# --- fixtures --------------------------------------------------------------------------


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    if not CHROMIUM.is_file():
        _unavailable(f"{CHROMIUM} not found (Debian: apt-get install chromium)")
    if not (HTML / "index.html").is_file():
        _unavailable(f"{HTML} has no index.html: run `make book` first")
    handler = functools.partial(_QuietHandler, directory=str(HTML))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser(base_url: str):
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
        )
        try:
            yield chromium
        finally:
            chromium.close()


# --- in-page probes ----------------------------------------------------------------------

# Text outside code and outside rendered math: raw TeX here means MathJax did not run.
_VISIBLE_TEXT_JS = """() => {
  const skip = "pre, code, script, style, textarea, mjx-container, .highlight";
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const parts = [];
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    if (!n.parentElement.closest(skip)) parts.push(n.textContent);
  }
  return parts.join(" ");
}"""

_IMAGES_JS = """async () => {
  const imgs = Array.from(document.images);
  imgs.forEach(i => { i.loading = "eager"; });
  await Promise.all(imgs.map(i => i.decode().catch(() => null)));
  return imgs.filter(i => !(i.complete && i.naturalWidth > 0))
             .map(i => (i.currentSrc || i.src || i.id || "<no src>").slice(0, 120));
}"""

# Each button's icon counts as drawn when Font Awesome turned its <i> into an <svg> (the
# theme's local copy does) or a CSS icon font gave the <i> a ::before glyph.
_ANIMATIONS_JS = """() => {
  const drawn = b => {
    if (b.querySelector("svg")) return true;
    const i = b.querySelector("i");
    return !!i && !["none", "normal", ""].includes(getComputedStyle(i, "::before").content);
  };
  return Array.from(document.querySelectorAll("div.animation")).map(a => {
    const img = a.querySelector("img");
    const buttons = Array.from(a.querySelectorAll("button"));
    const slider = a.querySelector("input[type=range]");
    return {
      loaded: !!img && img.complete && img.naturalWidth > 0,
      slider: !!slider,
      frames: slider ? Number(slider.max) + 1 : 0,
      buttons: buttons.length,
      drawn_icons: buttons.filter(drawn).length,
    };
  });
}"""

# First animation: press "Next frame" and report whether the frame's image changed.
_STEP_JS = """async () => {
  const a = document.querySelector("div.animation");
  const img = a.querySelector("img");
  const before = img.src;
  a.querySelector("button[title='Next frame']").click();
  await new Promise(r => setTimeout(r, 100));
  return before !== img.src;
}"""

# A labelled figure: its frame count if it holds an animation, 0 if it is not
# animated, null if no element has that id.
_FIGURE_JS = """(label) => {
  const el = document.getElementById(label);
  if (!el) return null;
  const slider = el.querySelector("div.animation input[type=range]");
  return slider ? Number(slider.max) + 1 : 0;
}"""

# Code blocks (cells, outputs, literal blocks) whose text is wider than their box.
_OVERFLOW_JS = """() => Array.from(document.querySelectorAll(".bd-article pre"))
  .filter(p => p.scrollWidth > p.clientWidth + 1)
  .map(p => {
    const lines = p.textContent.split("\\n");
    const widest = lines.reduce((a, l) => (l.length > a.length ? l : a), "");
    return `${widest.length} chars, ${p.clientWidth}px: ${widest.trim().slice(0, 50)}`;
  })"""

# code a reader sees without unfolding anything: cell inputs and displayed listings that
# are not inside a folded cell's closed <details> (which keeps its layout, so it is the
# open attribute that tells)
_VISIBLE_CODE_JS = """() => {
  const shown = Array.from(document.querySelectorAll(
    ".bd-article .cell_input pre, .bd-article .cell_output .text_html .highlight pre"))
    .filter(p => p.closest("details:not([open])") === null);
  const text = shown.map(p => p.textContent.replace(/\\n$/, ""));
  const box = Array.from(document.querySelectorAll(".bd-article .admonition-title"))
    .map(t => t.textContent.trim());
  return {lines: text.reduce((n, t) => n + t.split("\\n").length, 0),
          setup: text.some(t => t.includes("pin_cpu_path()")),
          first_box: box.length ? box[0] : null};
}"""

_MATHJAX_READY_JS = """async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await MathJax.startup.promise;
    return true;
  }
  return false;
}"""


# --- the test ------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", PAGES)
def test_page(browser, base_url: str, doc: str) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[tuple[str, str]] = []  # (message, stack or URL)
    external: list[str] = []

    def on_console(msg) -> None:
        if msg.type != "error":
            return
        url = msg.location.get("url", "")
        if FAILED_LOAD.match(msg.text):
            if url == f"{base_url}/favicon.ico":
                return  # Chromium asks for it on its own; the book declares no favicon
            if any(re.search(p, url) for p, _ in ALLOWED_EXTERNAL):
                return  # blocked on purpose, and checked below
        errors.append((f"console.error: {msg.text}", url))

    def route(r) -> None:
        url = r.request.url
        if urlsplit(url).hostname == "127.0.0.1":
            r.continue_()
        else:
            external.append(url)
            r.abort()

    def on_response(resp) -> None:
        if resp.status >= 400:
            errors.append((f"HTTP {resp.status}", resp.url))

    page.on("pageerror", lambda exc: errors.append((exc.message, exc.stack or "")))
    page.on("response", on_response)
    page.on("console", on_console)
    page.route("**/*", route)
    try:
        response = page.goto(f"{base_url}/{doc}.html", wait_until="load")
        assert response is not None and response.status == 200, (
            f"{doc}.html: HTTP error"
        )
        page.wait_for_load_state("networkidle")
        mathjax = page.evaluate(_MATHJAX_READY_JS)

        # Math: rendered by the local MathJax, no raw TeX left in the prose.
        if _has_math(doc):
            assert mathjax, f"{doc}: the source has math but MathJax is not on the page"
            n_mjx = page.locator("mjx-container").count()
            n_math = page.locator(".math").count()
            assert n_mjx > 0, f"{doc}: the source has math but nothing was typeset"
            assert n_mjx >= n_math, f"{doc}: {n_math} math nodes but {n_mjx} typeset"
        visible = page.evaluate(_VISIBLE_TEXT_JS)
        raw = [
            tex for tex in (r"\frac", r"\sqrt", "$$", r"\(", r"\[") if tex in visible
        ]
        assert not raw, f"{doc}: raw TeX visible in the page text: {raw}"

        # Images, including the frames of animations.
        broken = page.evaluate(_IMAGES_JS)
        assert not broken, f"{doc}: images that did not load: {broken}"

        # matplotlib to_jshtml() animations: as many as the notebook stored, all working.
        expected = _count_outputs(doc, 'class="animation"')
        animations = page.evaluate(_ANIMATIONS_JS)
        assert len(animations) == expected, (
            f"{doc}: {expected} jshtml animations in the notebook, {len(animations)} on the page"
        )
        for i, anim in enumerate(animations):
            assert anim["loaded"] and anim["slider"], (
                f"{doc}: animation {i} did not start: {anim}"
            )
            assert anim["drawn_icons"] == anim["buttons"], (
                f"{doc}: animation {i} icons: {anim}"
            )
        if animations:
            assert page.evaluate(_STEP_JS), (
                f"{doc}: 'Next frame' did not change the frame"
            )

        # No inert widget: an ipywidgets control needs a kernel, so the book hides every
        # widget cell (remove-cell) and shows an animation or the static calculator.
        n_widgets = _count_outputs(doc, "application/vnd.jupyter.widget-view+json")
        assert n_widgets == 0, f"{doc}: {n_widgets} ipywidgets outputs in the book"
        assert page.locator(".jupyter-widgets").count() == 0, f"{doc}: a widget shows"

        # Labelled figures: each under its name, with at least its frames.
        for label, (where, frames) in FIGURES.items():
            if where == doc:
                found = page.evaluate(_FIGURE_JS, label)
                assert found is not None, f"{doc}: no figure with id {label!r}"
                assert found >= frames, f"{doc}: {label}: {found} frames, not {frames}"
        for need in MIN_FRAMES.get(doc, ()):
            counts = [a["frames"] for a in animations]
            assert any(n >= need for n in counts), f"{doc}: no {need}-frame animation"

        # Code fits its column: no code block or printed output scrolls sideways.
        wide = page.evaluate(_OVERFLOW_JS)
        assert not wide, f"{doc}: {len(wide)} code blocks overflow: {wide[:5]}"

        # A chapter page: its question first, no setup cell, at most 250 lines of code.
        if doc.startswith("chapters/"):
            code = page.evaluate(_VISIBLE_CODE_JS)
            assert code["first_box"] == "The question", f"{doc}: {code}"
            assert not code["setup"], f"{doc}: the setup cell shows"
            assert code["lines"] <= 250, f"{doc}: {code['lines']} lines of code show"

        # Nothing fetched from elsewhere, no JavaScript errors beyond the allowlist.
        unexpected_ext = [
            u for u in external if not any(re.search(p, u) for p, _ in ALLOWED_EXTERNAL)
        ]
        assert not unexpected_ext, f"{doc}: requests to other hosts: {unexpected_ext}"
        unexpected = [
            f"{message} [{where[:200]}]"
            for message, where in errors
            if not any(
                re.search(m, message) and re.search(w, where)
                for m, w, _ in ALLOWED_ERRORS
            )
        ]
        assert not unexpected, f"{doc}: JavaScript errors: {unexpected}"
    finally:
        context.close()


# --- the calculator of chapter 13 -------------------------------------------------------

_OUTPUTS = ("total", "active", "kv-per-token", "kv-total", "flops-per-token")
# the five data-values (null when cleared), the shown texts, and the problems line
_READ_JS = """(ids) => [
  ids.map(i => document.querySelector("#calc-" + i).dataset.value ?? null),
  ids.map(i => document.querySelector("#calc-" + i).textContent),
  document.querySelector(".calc-problems").textContent,
]"""
_SET_JS = """(values) => {
  for (const [name, value] of Object.entries(values)) {
    const el = document.querySelector("#calc-" + name);
    if (el.type === "checkbox") el.checked = value; else el.value = String(value);
  }
  document.querySelector("#calc-d_model").dispatchEvent(new Event("change"));
}"""
# dial settings the config rejects: (preset, changed dials, the field its error names)
_INVALID: list[tuple[str, dict, str]] = [
    ("llama3-8b", {"n_heads": 12, "n_kv_heads": 9}, "n_kv_heads"),
    ("llama3-8b", {"n_kv_heads": 0}, "n_kv_heads"),
    ("llama3-8b", {"vocab_size": 0}, "vocab_size"),
    ("llama3-8b", {"head_dim": 127}, "head_dim"),
    ("llama3-8b", {"layer_types": "FQ"}, "layer_types"),
    ("llama3-8b", {"q_lora_rank": 256}, "mla.q_lora_rank"),
    ("llama3-8b", {"mla_output_gate": True}, "mla.output_gate"),
    ("llama3-8b", {"indexer_topk": 2048}, "mla.indexer"),
    ("gemma3-27b", {"sliding_window": 0}, "sliding_window"),
    ("gemma3-27b", {"layer_types": "F"}, "sliding_window"),
    ("mixtral-8x7b", {"experts_per_token": 9}, "moe.experts_per_token"),
    ("mixtral-8x7b", {"expert_d_ff": 0}, "moe.expert_d_ff"),
    ("deepseek-v3", {"dense_layers": 61}, "moe.dense_layers"),
    ("qwen3-next-80b-a3b", {"shared_d_ff": 0}, "moe.shared_expert_gate"),
    ("deepseek-v3", {"position": "learned"}, "position"),
    ("deepseek-v3", {"head_dim": 128}, "head_dim"),
    ("deepseek-v3", {"qk_nope_head_dim": 0}, "mla.qk_nope_head_dim"),
    ("deepseek-v3", {"qk_rope_head_dim": 63, "head_dim": 191}, "qk_rope_head_dim"),
    ("deepseek-v3.2", {"q_lora_rank": 0}, "mla.indexer"),
    ("deepseek-v3.2", {"indexer_n_heads": 0}, "mla.indexer.n_heads"),
    ("deepseek-v3.2", {"indexer_head_dim": 32}, "mla.indexer.head_dim"),
    ("deepseek-v3.2", {"indexer_layers": "SF"}, "mla.indexer.layers"),
    ("deepseek-v3.2", {"indexer_layers": "FX"}, "mla.indexer.layers"),
    ("glm-5", {"layer_types": "FS", "sliding_window": 128}, "mla.indexer"),
    ("qwen3-next-80b-a3b", {"linear_key_heads": 0}, "linear.key_heads"),
    ("qwen3-next-80b-a3b", {"linear_value_heads": 24}, "linear.value_heads"),
    ("qwen3-next-80b-a3b", {"kda_layout": "bailing"}, "linear.kda_layout"),
    ("kimi-linear-48b-a3b", {"linear_value_dim": 64}, "linear.value_dim"),
    ("ling-3.0-flash", {"linear_value_heads": 64}, "linear.value_heads"),
    ("llama3-8b", {"batch": 0}, "batch"),
    ("llama3-8b", {"dtype_bytes": 0}, "dtype_bytes"),
    ("llama3-8b", {"scale_bytes": -1}, "scale_bytes"),
    # DeepSeek-V4: compressed attention, hyper-connections, hash layers, the clamp
    ("llama3-8b", {"layer_types": "FC"}, "compression"),
    ("deepseek-v4-pro", {"compression_q_lora_rank": 0}, "compression"),
    ("deepseek-v4-pro", {"layer_types": "SCHF"}, "layer_types"),
    ("deepseek-v4-pro", {"sliding_window": 0}, "sliding_window"),
    ("deepseek-v4-flash", {"sliding_window": 0}, "sliding_window"),
    ("deepseek-v4-flash", {"position": "learned"}, "position"),
    ("deepseek-v4-flash", {"n_kv_heads": 8}, "n_kv_heads"),
    ("deepseek-v4-flash", {"attn_sinks": False}, "attn_sinks"),
    ("deepseek-v4-flash", {"qk_norm": "head"}, "qk_norm"),
    ("deepseek-v4-flash", {"attn_output_gate": True}, "attn_output_gate"),
    (
        "deepseek-v4-flash",
        {"kv_lora_rank": 512, "qk_nope_head_dim": 448, "qk_rope_head_dim": 64}
        | {"v_head_dim": 128},
        "mla=MLAConfig(kv_lora_rank=512",
    ),
    ("deepseek-v4-flash", {"compression_o_groups": 3}, "compression.o_groups"),
    ("deepseek-v4-flash", {"compression_o_groups": 0}, "compression.o_groups"),
    ("deepseek-v4-flash", {"compression_csa_ratio": 0}, "compression.csa_ratio"),
    ("deepseek-v4-pro", {"compression_index_topk": -1}, "compression.index_topk"),
    ("deepseek-v4-pro", {"compression_index_head_dim": 32}, "index_head_dim"),
    ("deepseek-v4-pro", {"partial_rotary_factor": 0.127}, "partial_rotary_factor"),
    ("deepseek-v4-pro", {"partial_rotary_factor": 0}, "partial_rotary_factor"),
    ("llama3-8b", {"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ("deepseek-v4-pro", {"norm_placement": "post"}, "residual"),
    ("deepseek-v4-pro", {"residual_n_streams": -1}, "residual.n_streams"),
    ("deepseek-v4-pro", {"hash_layers": 62}, "moe.hash_layers"),
    ("deepseek-v4-pro", {"hash_layers": -1}, "moe.hash_layers"),
    ("deepseek-v4-pro", {"router_bias": True}, "moe.hash_layers"),
    ("deepseek-v4-pro", {"expert_kind": "gpt_oss"}, "moe.swiglu_limit"),
    ("deepseek-v4-pro", {"swiglu_limit": -1.5}, "moe.swiglu_limit"),
    ("gemma3-27b", {"n_layers": 3, "layer_types": "SHC"}, "compression"),
]


def _expected(values: dict, usage: dict) -> list[int]:
    """companion.calc's five numbers for the configuration the dials describe."""
    from companion.analysis.calculator import (
        count_params,
        flops_per_token,
        kv_cache_bytes,
        kv_cache_bytes_per_token,
    )
    from companion.analysis.calculator_page import config_from_dials

    cfg = config_from_dials(values)
    pc = count_params(cfg)
    scale = usage.get("scale_bytes", 0)
    return [
        pc.total,
        pc.active,
        kv_cache_bytes_per_token(cfg, usage["dtype_bytes"], scale_bytes=scale),
        kv_cache_bytes(
            cfg,
            usage["context"],
            usage["dtype_bytes"],
            batch=usage["batch"],
            state_dtype_bytes=usage["state_dtype_bytes"],
            scale_bytes=scale,
        ),
        flops_per_token(cfg, usage["context"]),
    ]


def _random_v4(rng, values: dict) -> dict:
    """Turn a random subset of a DeepSeek-V4 preset's dials to other values a model can
    have: widths, heads, groups, ranks, ratios, the indexer, the window, the pattern
    of sliding / CSA / HCA layers, the streams (0: plain residual), hash layers, the
    clamp, experts, the rotated fraction."""
    v = dict(values)
    pick = rng.random
    if pick() < 0.5:
        v["vocab_size"] = rng.randint(1000, 300_000)
    if pick() < 0.5:
        v["d_model"] = 64 * rng.randint(1, 128)
    if pick() < 0.5:
        v["n_layers"] = rng.randint(1, 96)
        v["layer_types"] = "".join(rng.choice("SCH") for _ in range(rng.randint(1, 8)))
    if pick() < 0.5:
        v["compression_o_groups"] = rng.choice([1, 2, 4, 8, 16])
        v["n_heads"] = v["compression_o_groups"] * rng.randint(1, 16)
        v["head_dim"] = rng.choice([128, 256, 512])
        v["partial_rotary_factor"] = rng.choice([0.0625, 0.125, 0.25])
    if pick() < 0.5:
        v["compression_q_lora_rank"] = rng.randint(1, 2048)
        v["compression_o_lora_rank"] = rng.randint(1, 2048)
        v["compression_csa_ratio"] = rng.randint(1, 8)
        v["compression_hca_ratio"] = rng.randint(1, 256)
        v["sliding_window"] = rng.randint(1, 4096)
    if pick() < 0.5:
        v["compression_index_n_heads"] = rng.randint(1, 64)
        v["compression_index_head_dim"] = rng.choice([128, 256])
        v["compression_index_topk"] = rng.randint(1, 4096)
    if pick() < 0.5:
        v["residual_n_streams"] = rng.choice([0, rng.randint(1, 8)])
    if pick() < 0.7:
        v["n_experts"] = rng.randint(2, 512)
        v["experts_per_token"] = rng.randint(1, min(16, v["n_experts"]))
        v["expert_d_ff"] = rng.randint(64, 4096)
        v["shared_d_ff"] = rng.choice([0, rng.randint(64, 8192)])
        v["dense_layers"] = rng.randint(0, min(3, v["n_layers"] - 1))
        v["hash_layers"] = rng.randint(0, v["n_layers"] - v["dense_layers"])
        v["router_selection_bias"] = pick() < 0.5
        v["swiglu_limit"] = rng.choice([0, 7.0, 10.0])
    if pick() < 0.3:
        v["n_experts"] = 0  # a dense FFN
        v["d_ff"] = rng.randint(64, 50_000)
    for flag in ("bias", "tie_embeddings"):
        if pick() < 0.3:
            v[flag] = not v[flag]
    return v


def _random_dials(rng, values: dict) -> dict:
    """Turn a random subset of a preset's dials to other values a model can have."""
    from companion.models.config import CHOICES

    if values["compression_q_lora_rank"]:
        return _random_v4(rng, values)
    v = dict(values)
    pick = rng.random
    if pick() < 0.5:
        v["vocab_size"] = rng.randint(1000, 300_000)
    if pick() < 0.5:
        v["d_model"] = 64 * rng.randint(1, 128)
    if pick() < 0.5:
        v["n_layers"] = rng.randint(1, 96)
    if pick() < 0.4:
        letters = "FSL" if v["linear_key_heads"] else "FS"
        v["layer_types"] = "".join(
            rng.choice(letters) for _ in range(rng.randint(1, 6))
        )
    if "S" in v["layer_types"] and (not v["sliding_window"] or pick() < 0.5):
        v["sliding_window"] = rng.randint(16, 8192)
    if "S" not in v["layer_types"]:
        v["sliding_window"] = 0
    if not v["kv_lora_rank"] and pick() < 0.5:
        v["n_heads"] = rng.choice([4, 8, 16, 32, 64, 128])
        v["n_kv_heads"] = rng.choice([h for h in (1, 2, 4, 8) if v["n_heads"] % h == 0])
        v["head_dim"] = rng.choice([64, 80, 128, 256])
    if v["kv_lora_rank"] and pick() < 0.5:
        v["kv_lora_rank"] = rng.randint(64, 1024)
        v["q_lora_rank"] = rng.choice([0, rng.randint(64, 2048)])
        v["qk_rope_head_dim"] = rng.choice([32, 64])
        v["qk_nope_head_dim"] = rng.choice([64, 128])
        v["head_dim"] = v["qk_rope_head_dim"] + v["qk_nope_head_dim"]
        v["v_head_dim"] = rng.choice([64, 128])
        v["mla_output_gate"] = pick() < 0.5
    if v["kv_lora_rank"] and pick() < 0.5:  # DeepSeek Sparse Attention, on or off
        v["q_lora_rank"] = v["q_lora_rank"] or rng.randint(64, 2048)
        v["indexer_topk"] = rng.choice([0, rng.randint(1, 4096)])
        v["indexer_n_heads"] = rng.choice([8, 32, 64])
        v["indexer_head_dim"] = rng.choice([64, 128])
        period = rng.randint(1, 5)
        v["indexer_layers"] = "F" + "".join(rng.choice("FS") for _ in range(period))
        if "S" in v["layer_types"]:
            v["layer_types"], v["sliding_window"] = "F", 0
    if pick() < 0.5:
        v["d_ff"] = rng.randint(64, 50_000)
    if v["n_experts"] and pick() < 0.7:
        v["n_experts"] = rng.randint(2, 512)
        v["experts_per_token"] = rng.randint(1, min(16, v["n_experts"]))
        v["expert_d_ff"] = rng.randint(64, 4096)
        v["shared_d_ff"] = rng.choice([0, rng.randint(64, 8192)])
        v["shared_expert_gate"] = v["shared_expert_gate"] and v["shared_d_ff"] > 0
        v["dense_layers"] = rng.randint(0, 3)
    if v["linear_key_heads"] and pick() < 0.5:
        kda = pick() < 0.5
        v["linear_kind"] = "kda" if kda else "gated_deltanet"
        v["kda_layout"] = rng.choice(["kimi", "bailing"]) if kda else "kimi"
        v["linear_key_heads"] = rng.choice([4, 8, 16])
        v["linear_value_heads"] = v["linear_key_heads"] * (
            1 if kda else rng.choice([1, 2])
        )
        v["linear_key_dim"] = rng.choice([64, 128])
        v["linear_value_dim"] = v["linear_key_dim"] if kda else rng.choice([64, 128])
        v["linear_conv_kernel"] = rng.randint(2, 6)
    for flag in (
        "bias",
        "qkv_bias",
        "tie_embeddings",
        "attn_output_gate",
        "attn_sinks",
    ):
        if pick() < 0.3:
            v[flag] = not v[flag]
    if pick() < 0.2:
        v["partial_rotary_factor"] = rng.choice([0.25, 0.5, 1.0])
    for field in ("ffn", "norm", "norm_placement", "qk_norm", "position"):
        if pick() < 0.3:
            v[field] = rng.choice(CHOICES[field])
    return v


def check_calculator(page) -> None:
    """On a page that holds the calculator: every preset as loaded, random dials, and
    the invalid settings of ``_INVALID`` (no numbers, the config's own error shown)."""
    import random

    from companion.analysis.calculator_dials import USAGE
    from companion.analysis.calculator_page import (
        PAGE_PRESETS,
        config_from_dials,
        dial_values,
    )
    from companion.models.validation import ConfigError

    usage = {name: default for name, (_, default) in USAGE.items()}

    def outputs() -> tuple[list[int | None], list[str], str]:
        values, texts, problems = page.evaluate(_READ_JS, list(_OUTPUTS))
        return [None if x is None else int(x) for x in values], texts, problems

    for name, cfg in PAGE_PRESETS.items():  # every preset, DeepSeek-V4's included
        page.select_option("#calc-preset", name)
        got, _, problems = outputs()
        assert (got, problems) == (_expected(dial_values(cfg), usage), ""), name
    for name, changes, field in _INVALID:
        dials = {k: v for k, v in changes.items() if k not in USAGE}
        with pytest.raises(ValueError) as err:
            _expected(
                {**dial_values(PAGE_PRESETS[name]), **dials}, {**usage, **changes}
            )
        message = str(err.value)
        assert field in message, (name, changes, message)
        assert isinstance(err.value, ConfigError) or field in USAGE, message
        page.select_option("#calc-preset", name)
        page.evaluate(_SET_JS, changes)
        got, texts, problems = outputs()
        assert got == [None] * 5 and texts == [""] * 5, (name, changes, got)
        assert message in problems, (name, changes, message, problems)
    rng = random.Random(2026)
    checked = drawn = 0
    v4 = [name for name, cfg in PAGE_PRESETS.items() if cfg.compression is not None]
    assert v4, "no DeepSeek-V4 preset on the page"
    while checked < 56:
        drawn += 1
        # 40 draws from every preset, then 16 from DeepSeek-V4's
        name = rng.choice(list(PAGE_PRESETS) if checked < 40 else v4)
        values = _random_dials(rng, dial_values(PAGE_PRESETS[name]))
        try:
            config_from_dials(values)
        except ConfigError:
            continue  # not a model the config accepts: draw again
        turned = {
            "context": rng.randint(1, 1_000_000),
            "batch": rng.randint(1, 64),
            "dtype_bytes": rng.choice([1, 2, 4]),
            "state_dtype_bytes": rng.choice([2, 4]),
            "scale_bytes": rng.choice([0, 2, 4]),
        }
        page.select_option("#calc-preset", name)
        page.evaluate(_SET_JS, {**values, **turned})
        got, _, problems = outputs()
        assert (got, problems) == (_expected(values, turned), ""), (
            name,
            values,
            turned,
        )
        checked += 1
    assert drawn < 4 * checked, f"{drawn} draws for {checked} valid configs"


def test_calculator(browser, base_url: str) -> None:
    """The static calculator gives companion.calc's numbers: every preset as loaded, then
    random dial settings (layers, widths, heads, experts, ranks, indexer, linear kind,
    pattern, usage; DeepSeek-V4's compression, streams and hash layers); and for
    settings the config rejects, no numbers but its error."""
    from companion.analysis.calculator_page import PAGE_PRESETS

    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(exc.message))
    page.route(
        "**/*",
        lambda r: (
            r.continue_()
            if urlsplit(r.request.url).hostname == "127.0.0.1"
            else r.abort()
        ),
    )
    try:
        page.goto(f"{base_url}/chapters/13_build_a_model.html", wait_until="load")
        assert page.locator("#fig-calculator #calc-preset").count() == 1
        options = page.eval_on_selector_all(
            "#calc-preset option", "els => els.map(e => e.value)"
        )
        assert options == list(PAGE_PRESETS)
        check_calculator(page)
        unexpected = [
            e for e in errors if not any(re.search(m, e) for m, _, _ in ALLOWED_ERRORS)
        ]
        assert not unexpected, f"JavaScript errors: {unexpected}"
    finally:
        context.close()

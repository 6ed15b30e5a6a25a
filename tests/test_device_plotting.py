"""Device/dtype selection and the plotting helpers."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from companion.device import bf16_supported, default_device, default_dtype, describe  # noqa: E402
from companion.plotting import animate, heatmap, loglog_fit, use_style  # noqa: E402


def test_cpu_is_always_available_and_fp32():
    assert default_device("cpu").type == "cpu"
    assert not bf16_supported("cpu")
    assert default_dtype("cpu") == torch.float32
    assert "torch" in describe("cpu")


def test_emulated_bf16_on_cuda_picks_fp32(monkeypatch):
    """A T4 (sm_75) only emulates bf16: torch counts that as supported by default."""

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return including_emulation  # a Turing GPU: emulated, not native

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    assert not bf16_supported("cuda")
    assert default_dtype("cuda") == torch.float32


def test_device_errors(monkeypatch):
    with pytest.raises(
        ValueError, match=r"device must be one of \('cuda', 'mps', 'cpu'\)"
    ):
        default_device("tpu")
    monkeypatch.setenv("COMPANION_DEVICE", "cpu")
    assert default_device().type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="'cuda' was requested"):
            default_device("cuda")


def test_animation_is_self_contained_html():
    use_style()
    fig, ax = plt.subplots()
    (line,) = ax.plot([0, 1], [0, 1])
    html = animate(fig, lambda i: line.set_ydata([0, i]), frames=3)
    assert "<script" in html and "data:image/png;base64" in html
    assert not plt.get_fignums()


def test_heatmap_and_loglog_fit():
    fig, ax = plt.subplots()
    heatmap(ax, np.eye(3), ["a", "b", "c"], ["a", "b", "c"], title="t")
    plt.close(fig)
    x = np.array([1.0, 10.0, 100.0])
    slope, intercept = loglog_fit(x, 3.0 * x**2)
    assert slope == pytest.approx(2.0) and intercept == pytest.approx(np.log(3.0))


def test_glue_writes_the_record_myst_nb_reads():
    """The output is displayed as usual and carries myst-nb's glue metadata under the name."""
    pytest.importorskip("IPython")
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.display import HTML
    from IPython.utils.capture import capture_output

    from companion.plotting import glue

    InteractiveShell.instance()
    with capture_output() as cap:
        glue("fig-demo", HTML("<b>frame</b>"))
    (out,) = cap.outputs
    assert out.data["text/html"] == "<b>frame</b>"
    assert out.metadata["scrapbook"] == {"name": "fig-demo", "mime_prefix": ""}
    with capture_output() as cap:
        glue("n-demo", "0.45", display=False)
    (out,) = cap.outputs
    assert out.data == {"application/papermill.record/text/plain": "'0.45'"}
    assert out.metadata["scrapbook"]["mime_prefix"] == "application/papermill.record/"
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        glue("", HTML("x"))

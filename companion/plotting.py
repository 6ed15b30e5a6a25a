"""One look for every figure in the book (all chapters), and stepped figures as
animations.

Call :func:`use_style` at the top of a chapter. :func:`animate` turns a drawing function
into a self-contained ``to_jshtml()`` player that steps in the static HTML book, and
:func:`glue` shows an output and names it, so the book can paste it as a numbered
figure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.animation import FuncAnimation
from matplotlib.axes import Axes
from matplotlib.figure import Figure

__all__ = ["PALETTE", "animate", "glue", "heatmap", "loglog_fit", "use_style"]

# Colour-blind-safe (Okabe-Ito) palette, in the order lines are drawn.
PALETTE = [
    "#0072B2",
    "#D55E00",
    "#009E73",
    "#CC79A7",
    "#E69F00",
    "#56B4E9",
    "#F0E442",
    "#000000",
]


def use_style() -> None:
    """Set the book's matplotlib defaults (palette, sizes, grid, dpi)."""
    mpl.rcParams.update(
        {
            "figure.figsize": (6.4, 3.6),
            "figure.dpi": 90,
            "savefig.dpi": 90,
            "figure.constrained_layout.use": True,
            "axes.prop_cycle": mpl.cycler(color=PALETTE),
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.titlesize": 11,
            "axes.labelsize": 10,
            "legend.fontsize": 9,
            "legend.frameon": False,
            "image.cmap": "viridis",
            "animation.embed_limit": 8.0,  # MB
        }
    )


def heatmap(
    ax: Axes,
    matrix: np.ndarray,
    xlabels: Sequence[str] | None = None,
    ylabels: Sequence[str] | None = None,
    title: str = "",
    vmin: float | None = 0.0,
    vmax: float | None = None,
) -> None:
    """Draw a matrix (e.g. attention weights, queries down, keys across) with labels."""
    ax.imshow(np.asarray(matrix), vmin=vmin, vmax=vmax, aspect="auto")
    ax.grid(False)
    if xlabels is not None:
        ax.set_xticks(range(len(xlabels)), xlabels, rotation=90, fontsize=8)
    if ylabels is not None:
        ax.set_yticks(range(len(ylabels)), ylabels, fontsize=8)
    ax.set_title(title)


def animate(
    fig: Figure, draw: Callable[[int], object], frames: int, interval_ms: int = 400
) -> str:
    """Return the HTML of a ``to_jshtml()`` player calling ``draw(i)`` for each frame.

    The figure is closed afterwards so the notebook shows only the player. Display the
    result with ``IPython.display.HTML``.
    """
    anim = FuncAnimation(fig, draw, frames=frames, interval=interval_ms, blit=False)
    html = anim.to_jshtml(default_mode="once")
    plt.close(fig)
    return html


# myst-nb's prefix for glue records that are stored but not displayed
_GLUE_HIDDEN = "application/papermill.record/"


def glue(name: str, obj: object, display: bool = True) -> None:
    """Display ``obj`` and store its output under ``name`` for the book to paste.

    This writes myst-nb's glue record (the display data with ``scrapbook`` metadata,
    which ``{glue:figure}``, ``{glue:any}`` and ``{glue:text}`` read) without importing
    myst-nb, which a Colab kernel does not have. Jupyter shows the output as usual; tag
    the cell ``remove-output`` so the book shows only the pasted copy. With
    ``display=False`` the record is stored under myst-nb's hidden MIME prefix, for a
    number the prose quotes: Jupyter and the book show nothing, nbval still compares it.
    """
    from IPython.core.formatters import format_display_data
    from IPython.display import display as show

    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    bundle, metadata = format_display_data(obj)
    prefix = "" if display else _GLUE_HIDDEN
    metadata = {**metadata, "scrapbook": {"name": name, "mime_prefix": prefix}}
    show({prefix + k: v for k, v in bundle.items()}, metadata=metadata, raw=True)


def loglog_fit(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least-squares line through (log x, log y): returns ``(slope, intercept)``."""
    lx, ly = np.log(np.asarray(x, dtype=float)), np.log(np.asarray(y, dtype=float))
    slope, intercept = np.polyfit(lx, ly, 1)
    return float(slope), float(intercept)

"""The HTML report's images, one per fixture (matplotlib, imported only when drawing: an optional
extra): the weights of the reference and of each implementation, |implementation − reference|
on a log scale, and for an implementation that returned no weights its output's
|implementation − reference| (``_figure``, saved as PNG by ``_save``).

Weights arrays have the shape legend of the cores: (B, H, Lq, Lk), B batch, H heads, Lq query
length, Lk key length; the images show the first (B, H) slice."""

from __future__ import annotations

import io
import math
import textwrap

import numpy as np

from golden.report.bounds import _number
from golden.report.files import _write

FLOOR = 1e-18  # |difference| drawn at least this, so exact zeros have a colour on a log scale
PANEL_INCHES, DPI = 2.2, 80
# The rest of the image layout, in inches. A row of panels is one Axes holding its heatmaps
# side by side, plus a colorbar Axes: making an Axes is most of a figure's time.
GAP, TITLE, TOP, RIGHT, LEFT, BOTTOM = 0.2, 0.35, 0.4, 0.75, 0.1, 0.1
MIN_WIDTH = 4.5  # room for the figure's title above a single column
WEIGHTS_CAPTION = "|implementation −\nreference|,\nlog scale"
OUTPUT_CAPTION = "output:\n|implementation −\nreference|,\nlog scale"
NEEDS_MATPLOTLIB = "the --html report needs matplotlib: pip install 'attn-parity[report]'"


def _matplotlib():
    """(Figure, FigureCanvasAgg, LogNorm), imported here: matplotlib is an optional extra."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import LogNorm
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(NEEDS_MATPLOTLIB) from e
    return Figure, FigureCanvasAgg, LogNorm


def _save(fig, canvas_cls, path) -> None:
    """Render ``fig`` as PNG to ``path``. Made without pyplot, the figure is in no global
    registry: it is freed with its last reference (``Figure.clear`` only costs time)."""
    canvas_cls(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    _write(path, buf.getvalue())


def _figure(name, arrays, labels, figure_cls, log_norm, outputs=None):
    """The fixture's figure: weights in the first row (reference, then ``labels``), their
    |difference| from the reference on a log scale in the second; then, for the
    implementations in ``outputs`` beside its "reference" (those that returned no weights),
    their output's |implementation - reference| on a log scale."""
    shown = [k for k in ["reference", *labels] if k in arrays]
    by_output = [k for k in (outputs or {}) if k != "reference"]
    if not shown and not by_output:
        fig = figure_cls(figsize=(PANEL_INCHES * 1.5, 1.0))
        fig.text(0.5, 0.5, f"{name}: no attention weights", ha="center", va="center")
        return fig
    has_diff = "reference" in arrays and bool(labels)
    fig, rows = _strips(figure_cls, bool(shown) + has_diff + bool(by_output),
                        max(len(shown), 1 + len(by_output)))
    values = {k: np.asarray(arrays[k], np.float64) for k in shown}
    if shown:
        _weights_row(rows[0], values)
    if has_diff:
        _diff_row(rows[1], values["reference"], {k: values[k] for k in labels}, log_norm)
    if by_output:
        out = {k: np.asarray(outputs[k], np.float64) for k in outputs}
        _diff_row(rows[-1], out["reference"], {k: out[k] for k in by_output}, log_norm,
                  OUTPUT_CAPTION, titled=True)
    title = (f"{name}: attention weights{_slice_note(values[shown[0]])}; rows: query, "
             "columns: key" if shown else
             f"{name}: no attention weights returned; the output"
             f"{_slice_note(np.asarray(outputs['reference']))}, last two axes")
    fig.suptitle("\n".join(textwrap.wrap(title, int(fig.get_figwidth() * 14))), fontsize=8,
                 y=1 - 0.05 / fig.get_figheight(), va="top")
    return fig


def _strips(figure_cls, nrows, ncols):
    """(figure, [Axes per row]) for ``nrows`` rows of ``ncols`` panels of PANEL_INCHES."""
    width = max(MIN_WIDTH, LEFT + ncols * PANEL_INCHES + RIGHT)
    height = TOP + nrows * (TITLE + PANEL_INCHES) + BOTTOM
    fig = figure_cls(figsize=(width, height))
    side = PANEL_INCHES - GAP  # a heatmap's width and height
    rows = []
    for r in range(nrows):
        bottom = height - TOP - r * (TITLE + PANEL_INCHES) - TITLE - side
        ax = fig.add_axes((LEFT / width, bottom / height, (ncols * PANEL_INCHES - GAP) / width,
                           side / height))
        ax.set_axis_off()
        ax.set_xlim(0, ncols + (ncols - 1) * GAP / side)
        ax.set_ylim(1, 0)
        rows.append(ax)
    return fig, rows


def _draw(ax, column, image, title, **style):
    """Heatmap ``image`` (or the text ``image`` names) in panel ``column`` of row ``ax``,
    titled; returns the AxesImage, or None for text."""
    left = column * (1 + GAP / (PANEL_INCHES - GAP))
    ax.text(left + 0.5, -0.03, title, ha="center", va="bottom", fontsize=7)
    if isinstance(image, str):
        ax.text(left + 0.5, 0.5, image, ha="center", va="center", fontsize=7)
        return None
    return ax.imshow(image, extent=(left, left + 1, 1, 0), aspect="auto",
                     interpolation="nearest", **style)


def _first(a):
    """The first (Lq, Lk) slice of ``a``: index 0 along every leading axis."""
    a = np.atleast_2d(a)
    return a[(0,) * (a.ndim - 2)]


def _slice_note(a) -> str:
    """Which slice the panels show, when the weights have leading axes."""
    lead = np.ndim(a) - 2
    if lead <= 0:
        return ""
    return " (batch 0, head 0)" if lead == 2 else f" [{'0, ' * lead}:, :]"


def _title(label) -> str:
    """A panel title, wrapped to the panel's width."""
    return "\n".join(textwrap.wrap(str(label), 30)) or " "


def _weights_row(ax, arrays) -> None:
    """Heatmaps of ``arrays`` on one linear scale, with a colorbar."""
    finite = [a[np.isfinite(a)] for a in arrays.values()]
    top = max((float(a.max()) for a in finite if a.size), default=1.0) or 1.0
    images = [_draw(ax, i, _first(a), _title(label), vmin=0.0, vmax=top, cmap="viridis")
              for i, (label, a) in enumerate(arrays.items())]
    _colorbar(ax, images[-1], "%.2g")


def _diff_row(ax, ref, arrays, log_norm, caption=None, titled=False) -> None:
    """|array - reference| of each of ``arrays`` on one log scale floored at FLOOR, with a
    colorbar; the reference's column says what the row shows (``caption``). ``titled``: each
    panel's title names its implementation as well."""
    _draw(ax, 0, caption or WEIGHTS_CAPTION, "")
    diffs = {k: _difference(a, ref) for k, a in arrays.items()}
    tops = [_nanmax(d) for d in diffs.values() if d is not None and np.isfinite(d).any()]
    norm = log_norm(vmin=FLOOR, vmax=max([FLOOR * 10, *tops]), clip=True)
    images = []
    for i, (label, d) in enumerate(diffs.items(), start=1):
        if d is None:
            _draw(ax, i, f"shape {arrays[label].shape}\n≠ reference {ref.shape}", "")
        else:
            title = f"max |Δ| {_number(_nanmax(d))}"
            images.append(_draw(ax, i, np.maximum(_first(d), FLOOR),
                                f"{_title(label)}\n{title}" if titled else title, norm=norm,
                                cmap="magma"))
    if images:
        _colorbar(ax, images[-1], "%.0e")  # plain text: mathtext "10^-9" labels are slow


def _nanmax(a) -> float:
    """The largest value of ``a`` that is not NaN: 0 for an empty array, NaN for all NaN."""
    kept = a[~np.isnan(a)]
    if kept.size:
        return float(kept.max())
    return math.nan if a.size else 0.0


def _difference(a, ref):
    """|a - ref| with NaN where either is not finite, or None when the shapes differ."""
    if a.shape != ref.shape:
        return None
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(a - ref)
    return np.where(np.isfinite(d), d, np.nan)


def _colorbar(ax, image, fmt) -> None:
    """A colorbar with small ``fmt`` labels to the right of row ``ax``."""
    fig = ax.figure
    box = ax.get_position()  # figure coordinates
    inch = 1 / fig.get_figwidth()
    cax = fig.add_axes((box.x1 + 0.1 * inch, box.y0, 0.1 * inch, box.height))
    fig.colorbar(image, cax=cax, format=fmt).ax.tick_params(labelsize=6)

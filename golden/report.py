"""Reports of ``attn-parity check``: ``--json FILE``, ``--junit FILE`` and ``--html DIR``.

``golden.check`` builds one *report dict* and hands it to the writers here. Its JSON form
(``write_json``) is the public schema, ``"schema": "attn-parity-check"``, ``"schema_version": 3``;
keys appear in this order, and a float that is not finite (inf, NaN) is stored as ``null``::

    {
      "schema": "attn-parity-check", "schema_version": 3,
      "created": "2026-11-22T08:00:00Z",        # UTC, ISO-8601
      "command": "attn-parity check -k sdpa",   # as typed; "" from the Python API
      "environment": {...},                     # environment(), below
      "profile": {"name": "exact", "k": null, "description": "..."},  # "tf32"/"bf16": k a number
      "implementations": ["torch", "jax", "mypkg.port:runner"],
      "rows": [                                 # one per fixture x run x dtype
        {"fixture": "sdpa_plain", "variant": "scaled_dot_product_attention",
         "implementation": "torch",             # the implementation under test (a runner)
         "core": "explicit",                    # the core implementation(s) it ran, as
                                                # recorded (golden.implementations); "" unknown
         "dtype": "float32",
         "status": "pass",                      # "pass", "fail", "error" or "not supported"
         "reason": null,                        # the failing arrays, the exception, why not run
         "seconds": 0.012,
         "max_abs": 1.2e-07, "max_rel": 3.0e-07,   # worst over the arrays; null when nothing
                                                   # was compared or the worst is not finite
         "arrays": [                            # one per compared array; [] for error and
                                                # not supported
           {"name": "output", "kind": "value",  # kind: "value", "weights" or "grad"
            "max_abs": 1.2e-07, "max_rel": 3e-07, "rel_norm": 1e-07,
            "abs_err": 1.2e-07,                 # |a - e| at the deciding element, held to
            "bound_abs": 1.3e-06,               # its bound atol' + rtol |e| (see below)
            "bound_rel_norm": 1e-06,            # rel_norm's bound; null: not applied (zero)
            "rule": "table",                    # "table", "terms" or "profile"
            "ok": true, "zero": false,          # zero: the array is zero by structure
            "missing": false}                   # missing: the implementation returned none
        ]}
      ],
      "regeneration": {"checked": 57, "reproduced": 56,       # null when not run
                       "differ": {"sdpa_plain": ["output"]}},
      "summary": {"rows": 366, "passed": 360, "failed": 3, "errors": 1, "not_supported": 2,
                  "regeneration_failed": 1, "seconds": 40.2, "ok": false}
    }

Every array states the bounds it was judged against (``golden.tolerances.Comparison``). The
elementwise check holds each |aᵢ − eᵢ| to its own bound atol' + rtol·|eᵢ| (atol' the table's atol
times max(1, max|e|)·√terms), so no single number bounds ``max_abs``: ``abs_err`` and
``bound_abs`` are the error and the bound of the element nearest to (or furthest over) its
bound, and that check passes exactly when ``abs_err <= bound_abs``; the relative error norm
passes when ``rel_norm <= bound_rel_norm``. ``rule`` says which bounds decided: "table" (the
tolerance table), "profile" (``--profile tf32/bf16`` at float32, tried when the table fails:
``bound_abs`` = k × the plain implementation's max|b − e| + atol', ``bound_rel_norm`` = k × its
relative error norm + the table's, both flat, so ``abs_err`` = ``max_abs``) or "terms" (bounds
relative to the terms' size, golden.tolerances.compare_terms). For a missing array all four are
null.

Versions: 2, a row's "path" became "core"; 3, arrays gained ``abs_err``, ``bound_abs``,
``bound_rel_norm`` and ``rule`` (the text table's "worst err/bound" column, JUnit failure
texts and the HTML rows show them too).

``environment`` holds (each a string, or null where the package is not installed) ``python``,
``platform``, ``machine``, ``numpy``, ``torch``, ``jax``, ``jaxlib``, ``flax``, ``optax``,
``matplotlib``, ``attn_parity``, and when JAX was imported by the run ``jax_backend`` and
``devices`` (a list of strings), else null.

``write_junit`` writes JUnit XML for CI test reporters (one testsuite per implementation, one
testcase per row, plus a "reference regeneration" suite); ``write_html`` writes ``DIR/index.html``
and one heatmap image per fixture, ``DIR/fixtures/<fixture>.png`` (matplotlib, from the
``[report]`` extra). Every file is written whole or not at all (``golden.fixture.write_atomic``).

Weights arrays have the shape legend of the cores: (B, H, Lq, Lk), B batch, H heads, Lq query
length, Lk key length; the images show the first (B, H) slice.
"""

from __future__ import annotations

import html
import importlib.metadata
import io
import json
import math
import platform
import re
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path
from urllib.parse import quote

import numpy as np

from golden.fixture import write_atomic

SCHEMA = "attn-parity-check"
SCHEMA_VERSION = 3  # 2: a row's "path" became "core"; 3: arrays state their bounds
KEYS = ("schema", "schema_version", "created", "command", "environment", "profile",
        "implementations", "rows", "regeneration", "summary")
ROW_KEYS = ("fixture", "variant", "implementation", "core", "dtype", "status", "reason",
            "seconds", "max_abs", "max_rel", "arrays")
ARRAY_KEYS = ("name", "kind", "max_abs", "max_rel", "rel_norm", "abs_err", "bound_abs",
              "bound_rel_norm", "rule", "ok", "zero", "missing")
SUMMARY_KEYS = ("rows", "passed", "failed", "errors", "not_supported", "regeneration_failed",
                "seconds", "ok")
STATUSES = ("pass", "fail", "error", "not supported")
PACKAGES = ("torch", "jax", "jaxlib", "flax", "optax", "matplotlib")
MAX_COLUMNS = 6  # implementations drawn per fixture image, beside the reference
FLOOR = 1e-18  # |difference| drawn at least this, so exact zeros have a colour on a log scale
PANEL_INCHES, DPI = 2.2, 80
# The rest of the image layout, in inches. A row of panels is one Axes holding its heatmaps
# side by side, plus a colorbar Axes: making an Axes is most of a figure's time.
GAP, TITLE, TOP, RIGHT, LEFT, BOTTOM = 0.2, 0.35, 0.4, 0.75, 0.1, 0.1
MIN_WIDTH = 4.5  # room for the figure's title above a single column
WEIGHTS_CAPTION = "|implementation −\nreference|,\nlog scale"
OUTPUT_CAPTION = "output:\n|implementation −\nreference|,\nlog scale"
NEEDS_MATPLOTLIB = "the --html report needs matplotlib: pip install 'attn-parity[report]'"


# --- environment -----------------------------------------------------------------------------

def environment() -> dict:
    """Python, platform and package versions (null where not installed), and JAX's backend and
    devices if this process imported JAX (null otherwise; JAX is never imported here)."""
    env = {"python": platform.python_version(), "platform": platform.platform(),
           "machine": platform.machine(), "numpy": np.__version__}
    env.update({name: _version(name) for name in PACKAGES})
    env["attn_parity"] = _version("attn-parity")
    env["jax_backend"], env["devices"] = _jax_devices()
    return env


def _version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _jax_devices() -> tuple[str | None, list[str] | None]:
    """(backend, devices) of an already imported JAX, else (None, None)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None, None
    try:
        return jax.default_backend(), [str(d) for d in jax.devices()]
    except RuntimeError:  # no backend could be initialised
        return None, None


# --- checks and plain values -------------------------------------------------------------------

def check_report(report) -> None:
    """Raise ValueError unless ``report`` has the schema's keys and every row its keys and a
    known status."""
    if not isinstance(report, dict):
        raise ValueError(f"report should be a dict with keys {KEYS}, got {type(report).__name__}")
    missing = [k for k in KEYS if k not in report]
    if missing:
        raise ValueError(f"report should have the keys {KEYS}, got it without {missing}")
    if not isinstance(report["rows"], list):
        raise ValueError(f"report['rows'] should be a list, got {type(report['rows']).__name__}")
    for i, row in enumerate(report["rows"]):
        lacks = [k for k in ROW_KEYS if k not in row] if isinstance(row, dict) else list(ROW_KEYS)
        if lacks:
            raise ValueError(f"report['rows'][{i}] should have the keys {ROW_KEYS}, "
                             f"got it without {lacks}")
        if row["status"] not in STATUSES:
            raise ValueError(f"report['rows'][{i}]['status'] should be one of {STATUSES}, "
                             f"got {row['status']!r}")


def plain(value):
    """``value`` with NumPy scalars and arrays made Python values, tuples made lists and every
    float that is not finite made None: what ``json.dumps(..., allow_nan=False)`` accepts."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return plain(value.tolist())
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


# --- JSON --------------------------------------------------------------------------------------

def write_json(report: dict, path) -> Path:
    """Write ``report`` as the schema's JSON (indent 1, keys in order, non-finite as null)."""
    check_report(report)
    text = json.dumps(plain(report), indent=1, allow_nan=False, ensure_ascii=False)
    return _write(path, (text + "\n").encode("utf-8"))


def _write(path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically, creating its parent directories; the file gets
    the permissions the umask gives a new file (``write_atomic``), so that a web server or CI
    artifact upload can read it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)
    return path


# --- JUnit XML ---------------------------------------------------------------------------------

def write_junit(report: dict, path) -> Path:
    """Write JUnit XML: a testsuite per implementation (a testcase per row) and, when the
    regeneration check ran, a "reference regeneration" suite."""
    check_report(report)
    root = ET.Element("testsuites", name="attn-parity")
    for label in _implementations(report):
        rows = [r for r in report["rows"] if r["implementation"] == label]
        root.append(_suite(label, [_case(r) for r in rows], report["created"]))
    if report["regeneration"] is not None:
        cases = _regeneration_cases(report["regeneration"])
        root.append(_suite("reference regeneration", cases, report["created"]))
    _count(root, list(root))
    ET.indent(root, space=" ")
    buf = io.BytesIO()
    ET.ElementTree(root).write(buf, encoding="utf-8", xml_declaration=True)
    return _write(path, buf.getvalue() + b"\n")


def _implementations(report) -> list[str]:
    """The report's implementation labels, then any other that a row names, in order."""
    labels = list(report["implementations"])
    labels += [r["implementation"] for r in report["rows"] if r["implementation"] not in labels]
    return list(dict.fromkeys(labels))


def _suite(name, cases, timestamp) -> ET.Element:
    """A testsuite of ``cases`` with its counts."""
    suite = ET.Element("testsuite", name=_xml(name), timestamp=_xml(timestamp or ""))
    suite.extend(cases)
    _count(suite, cases)
    return suite


def _count(element, children) -> None:
    """Set tests/failures/errors/skipped/time on ``element``, summed over its ``children``
    (testcases, or testsuites carrying these attributes)."""
    def total(tag, attr):
        return sum(int(c.get(attr)) if c.tag != "testcase" else len(c.findall(tag))
                   for c in children)
    element.set("tests", str(sum(int(c.get("tests", 1)) for c in children)))
    element.set("failures", str(total("failure", "failures")))
    element.set("errors", str(total("error", "errors")))
    element.set("skipped", str(total("skipped", "skipped")))
    element.set("time", f"{sum(float(c.get('time', 0)) for c in children):.3f}")


def _case(row) -> ET.Element:
    """A row's testcase: a failure, an error, skipped, or nothing inside when it passed."""
    name = " ".join(p for p in (row["implementation"], row["core"], row["dtype"]) if p)
    case = ET.Element("testcase", classname=_xml(row["fixture"]), name=_xml(name),
                      time=f"{_finite(row['seconds']) or 0.0:.3f}")
    reason = _xml(row["reason"] or "")
    if row["status"] == "fail":
        failing = [_failing_text(a) for a in row["arrays"] if not a.get("ok")]
        message = _xml("tolerance exceeded: " + ", ".join(failing)) if failing else reason
        ET.SubElement(case, "failure", message=message, type="tolerance").text = _xml(
            "\n".join(_array_line(a) for a in row["arrays"]))
    elif row["status"] == "error":
        first = (reason.strip().splitlines() or ["error"])[0]  # the body holds all of it
        ET.SubElement(case, "error", message=first, type="error").text = reason
    elif row["status"] == "not supported":
        ET.SubElement(case, "skipped", message="not supported" + (f": {reason}" if reason else ""))
    return case


def _array_line(array) -> str:
    """One compared array as a line of a failure's text, each error beside its bound."""
    state = "missing" if array.get("missing") else ("ok" if array.get("ok") else "FAIL")
    return (f"{array.get('name')}: max_abs={_number(array.get('max_abs'))} "
            f"rel_norm={_number(array.get('rel_norm'))} ok={bool(array.get('ok'))} ({state})"
            f"{_bounds(array)}")


def _bounds(array) -> str:
    """"; |a-e| … vs bound …, rel_norm … vs bound … (table rule)" for an array that has
    bounds (the rel_norm part where one applied), else ""."""
    if array.get("bound_abs") is None and array.get("bound_rel_norm") is None:
        return ""
    norm = ("" if array.get("bound_rel_norm") is None else
            f", rel_norm {_number(array.get('rel_norm'))} vs bound "
            f"{_number(array.get('bound_rel_norm'))}")
    return (f"; |a-e| {_number(array.get('abs_err'))} vs bound "
            f"{_number(array.get('bound_abs'))}{norm} ({array.get('rule')} rule)")


def worst_bound(arrays) -> str:
    """"err/bound" of the check that came closest to (or went furthest over) its bound among
    a row's arrays: an elementwise one (abs_err/bound_abs) or a relative error norm's
    (rel_norm/bound_rel_norm); "missing" when an array is, "-" when nothing was compared."""
    if any(a.get("missing") for a in arrays):
        return "missing"
    pairs = [(a.get(err), a.get(bound)) for a in arrays
             for err, bound in (("abs_err", "bound_abs"), ("rel_norm", "bound_rel_norm"))]
    pairs = [(e, b) for e, b in pairs if b is not None]
    if not pairs:
        return "-"
    e, b = max(pairs, key=lambda p: _ratio(*p))
    return f"{_number(e, 1)}/{_number(b, 1)}"


def _ratio(err, bound) -> float:
    """err / bound; inf for an error that is not finite (null in JSON) or a zero bound
    exceeded."""
    if err is None or not math.isfinite(err):
        return math.inf
    return err / bound if bound > 0 else (0.0 if err == 0 else math.inf)


def _failing_text(array) -> str:
    """A failing array for a message: its name and the checks that exceeded their bounds."""
    if array.get("missing"):
        return f"{array.get('name')} (missing)"
    over = [f"{what} {_number(array.get(err))} > bound {_number(array.get(bound))}"
            for what, err, bound in (("|a-e|", "abs_err", "bound_abs"),
                                     ("rel_norm", "rel_norm", "bound_rel_norm"))
            if array.get(bound) is not None and _ratio(array.get(err), array[bound]) > 1]
    return f"{array.get('name')} ({'; '.join(over) or 'not finite'})"


def _regeneration_cases(regeneration) -> list[ET.Element]:
    """A failing testcase per fixture the reference does not reproduce, and one passing case
    for all those it does."""
    cases = []
    for name, what in regeneration["differ"].items():
        case = ET.Element("testcase", classname=_xml(name), name="regeneration", time="0.000")
        ET.SubElement(case, "failure", type="regeneration", message=_xml(
            "the reference does not reproduce " + ", ".join(what)))
        cases.append(case)
    if regeneration["reproduced"]:
        cases.append(ET.Element(
            "testcase", classname="reference regeneration", time="0.000",
            name=f"{regeneration['reproduced']} of {regeneration['checked']} fixtures "
                 "reproduced bit for bit"))
    return cases


_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml(text) -> str:
    """``text`` without the characters XML 1.0 cannot hold (such as terminal escapes)."""
    return _NOT_XML.sub("?", str(text))


def _finite(x) -> float | None:
    """``x`` as a float if it is a finite number, else None."""
    return float(x) if isinstance(x, (int, float, np.number)) and math.isfinite(x) else None


def _number(x, digits=2) -> str:
    """A number for a table or message: "1.20e-07", "inf", or "n/a" for null (nothing
    compared, or non-finite in a report read back from JSON)."""
    return "n/a" if x is None else f"{float(x):.{digits}e}"


# --- HTML ----------------------------------------------------------------------------------------

def write_html(report: dict, directory, weights: dict, progress=None,
               outputs: dict | None = None) -> Path:
    """Write ``directory/index.html`` and, per fixture in the rows, ``fixtures/<fixture>.png``:
    heatmaps of the reference weights, each implementation's, and |implementation - reference|
    on a log scale. ``weights`` is {fixture: {"reference" or a row label such as "torch autograd
    float32": array}}; ``outputs`` the same for the outputs: an implementation that returned
    no weights (a function without ``return_weights``, one that failed) is drawn as its
    output's |implementation - reference| instead. ``progress``: a tqdm bar on stderr; None
    shows it when stderr is a terminal. Returns the path of index.html."""
    check_report(report)
    _check_weights(weights)
    _check_weights(outputs or {}, "outputs")
    figure_cls, canvas_cls, log_norm = _matplotlib()
    directory = Path(directory)
    (directory / "fixtures").mkdir(parents=True, exist_ok=True)
    drawn = {}
    for name in _bar(_fixtures(report), progress):
        arrays, outs = weights.get(name, {}), (outputs or {}).get(name, {})
        labels = [k for k in arrays if k != "reference"]
        by_output = ([k for k in outs if k != "reference" and k not in labels]
                     if "reference" in outs else [])
        drawn[name] = {"left_out": labels[MAX_COLUMNS:] + by_output[MAX_COLUMNS:],
                       "by_output": by_output[:MAX_COLUMNS]}
        fig = _figure(name, arrays, labels[:MAX_COLUMNS], figure_cls, log_norm,
                      {k: outs[k] for k in ["reference", *by_output[:MAX_COLUMNS]] if k in outs})
        _save(fig, canvas_cls, directory / "fixtures" / _image_name(name))
    page = _page(report, drawn)
    return _write(directory / "index.html", page.encode("utf-8"))


def _check_weights(weights, what="weights") -> None:
    """Raise ValueError unless ``weights`` (named ``what``) is {fixture: {label: array}}."""
    if not isinstance(weights, dict):
        raise ValueError(f"{what} should be a dict {{fixture: {{label: array}}}}, "
                         f"got {type(weights).__name__}")
    for name, arrays in weights.items():
        if not isinstance(arrays, dict):
            raise ValueError(f"{what}[{name!r}] should be a dict {{label: array}}, "
                             f"got {type(arrays).__name__}")


def _matplotlib():
    """(Figure, FigureCanvasAgg, LogNorm), imported here: matplotlib is an optional extra."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import LogNorm
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(NEEDS_MATPLOTLIB) from e
    return Figure, FigureCanvasAgg, LogNorm


def _bar(items, progress):
    """``items`` wrapped in a tqdm bar on stderr when asked (None: when stderr is a terminal)
    and tqdm is installed."""
    show = sys.stderr.isatty() if progress is None else progress
    if not show:
        return items
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a convenience of the [report] extra
        return items
    return tqdm(items, desc="html", unit="image", file=sys.stderr, leave=False)


def _fixtures(report) -> list[str]:
    """Fixture names in the order the rows first name them."""
    return list(dict.fromkeys(r["fixture"] for r in report["rows"]))


def _image_name(name) -> str:
    """The image file of fixture ``name``: characters unsafe in a file name become "_"."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", str(name)).lstrip(".") + ".png"


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


# --- the page ----------------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.pass { color: #176b21; } .fail, .error { color: #b00020; font-weight: bold; }
.not-supported { color: #888; } img { max-width: 100%; }
.badge { border: 1px solid currentColor; border-radius: 0.3em; padding: 0 0.3em;
         font-size: 0.85em; margin-left: 0.3em; }
"""


def _page(report, drawn) -> str:
    """index.html: the run, environment, summary, per-implementation counts, per fixture."""
    e = html.escape
    head = (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>attn-parity check {e(str(report['created']))}</title>"
            f"<style>{_CSS}</style></head><body>\n<h1>attn-parity check</h1>\n")
    parts = [head, _run_info(report), "<h2>Summary</h2>\n", _summary_table(report),
             _regeneration_html(report["regeneration"]), "<h2>By implementation</h2>\n",
             _implementation_table(report), "<h2>Environment</h2>\n",
             _table(["key", "value"], [[k, _env_value(v)] for k, v in
                                       report["environment"].items()]),
             "<h2>Fixtures</h2>\n", _fixture_index(report)]
    parts += [_fixture_section(report, name, drawn.get(name, {})) for name in
              _fixtures(report)]
    return "".join(parts) + "</body></html>\n"


def _run_info(report) -> str:
    """Creation time, command and tolerance profile."""
    profile = report["profile"] or {}
    k = f", k = {profile.get('k')}" if profile.get("k") is not None else ""
    items = [("created", report["created"]), ("command", report["command"] or "(Python API)"),
             ("profile", f"{profile.get('name')}{k}: {profile.get('description') or ''}")]
    return "<ul>" + "".join(f"<li><b>{html.escape(a)}</b>: {html.escape(str(b))}</li>"
                            for a, b in items) + "</ul>\n"


def _summary_table(report) -> str:
    """The summary's counts and the overall verdict."""
    s = report["summary"]
    ok = s.get("ok")
    cells = [[k.replace("_", " "), str(s.get(k))] for k in SUMMARY_KEYS if k != "ok"]
    verdict = f'<p class="{"pass" if ok else "fail"}">overall: {"ok" if ok else "FAILED"}</p>\n'
    return _table(["", "count"], cells, numeric={1}) + verdict


def _regeneration_html(regeneration) -> str:
    """The regeneration check's line and the fixtures it does not reproduce."""
    if regeneration is None:
        return "<p>Regeneration check: not run.</p>\n"
    differ = "".join(f"<li class=\"fail\">{_link(n)}: the reference does not reproduce "
                     f"{html.escape(', '.join(w))}</li>" for n, w in regeneration["differ"].items())
    return (f"<p>Regeneration check: the reference reproduces {regeneration['reproduced']} of "
            f"{regeneration['checked']} fixtures bit for bit.</p>\n"
            + (f"<ul>{differ}</ul>\n" if differ else ""))


def _implementation_table(report) -> str:
    """Counts of each status per implementation."""
    cells = []
    for label in _implementations(report):
        rows = [r for r in report["rows"] if r["implementation"] == label]
        seconds = sum(_finite(r["seconds"]) or 0.0 for r in rows)
        cells.append([label, str(len(rows)),
                      *(str(sum(r["status"] == s for r in rows)) for s in STATUSES),
                      f"{seconds:.2f}"])
    return _table(["implementation", "rows", *STATUSES, "seconds"], cells,
                  numeric=set(range(1, 7)))


def _fixture_index(report) -> str:
    """Links to the fixtures' sections, each with one badge per implementation: its worst
    status over its rows of that fixture (cores, dtypes), so that one failing implementation
    does not colour the others."""
    items = []
    for name in _fixtures(report):
        rows = [r for r in report["rows"] if r["fixture"] == name]
        badges = []
        for label in dict.fromkeys(r["implementation"] for r in rows):
            status = _worst([r["status"] for r in rows if r["implementation"] == label])
            badges.append(f'<span class="badge {_css(status)}" title="{html.escape(label)}: '
                          f'{status}">{html.escape(label)}: {status}</span>')
        items.append(f"<li>{_link(name)} {' '.join(badges)}</li>")
    return "<ul>" + "".join(items) + "</ul>\n"


def _worst(statuses) -> str:
    """The status a fixture shows in the index: error, fail, pass, then not supported."""
    for s in ("error", "fail", "pass"):
        if s in statuses:
            return s
    return "not supported"


def _fixture_section(report, name, drawn) -> str:
    """A fixture's rows table and image."""
    e = html.escape
    rows = [r for r in report["rows"] if r["fixture"] == name]
    cells = [[r["implementation"], r["core"], r["dtype"], (r["status"], _css(r["status"])),
              _number(r["max_abs"]), _number(r["max_rel"]), worst_bound(r["arrays"]),
              _html_reason(r)] for r in rows]
    table = _table(["implementation", "core", "dtype", "status", "max abs", "max rel",
                    "worst err/bound", "reason"], cells, numeric={4, 5, 6})
    src = "fixtures/" + quote(_image_name(name))
    alt = f"attention weights of {name}: reference, implementations and |difference|"
    if drawn.get("by_output"):
        alt += "; output |implementation − reference| of " + ", ".join(drawn["by_output"])
    return (f'<section id="{e(name)}">\n<h3>{e(name)}</h3>\n<p>variant: '
            f"{e(str(rows[0]['variant']))}</p>\n{table}{_notes(report, name, drawn)}"
            f'<img src="{e(src)}" alt="{e(alt)}" loading="lazy">\n</section>\n')


def _html_reason(row) -> str:
    """A row's reason; for a failure, each failing array with its errors and bounds."""
    failing = [_failing_text(a) for a in row["arrays"] if not a.get("ok")]
    return ", ".join(failing) if row["status"] == "fail" and failing else row["reason"] or ""


def _notes(report, name, drawn) -> str:
    """What the fixture's regeneration did not reproduce, which implementations its image
    shows by their output, and which it leaves out."""
    differ = (report["regeneration"] or {"differ": {}})["differ"].get(name)
    left_out, by_output = drawn.get("left_out", []), drawn.get("by_output", [])
    notes = ""
    if by_output:
        notes += (f"<p>No attention weights from {html.escape(', '.join(by_output))}: the "
                  "image shows their output's |implementation − reference|.</p>\n")
    if differ:
        notes += (f'<p class="fail">Regeneration: the reference does not reproduce '
                  f"{html.escape(', '.join(differ))}.</p>\n")
    if left_out:
        notes += (f"<p>Not drawn (more than {MAX_COLUMNS} implementations): "
                  f"{html.escape(', '.join(left_out))}</p>\n")
    return notes


def _table(header, rows, numeric=frozenset()) -> str:
    """An HTML table; a cell is text, or (text, css class); columns in ``numeric`` align
    right. Everything is escaped."""
    e = html.escape
    out = ["<table><tr>" + "".join(f"<th>{e(str(h))}</th>" for h in header) + "</tr>"]
    for row in rows:
        tds = []
        for i, cell in enumerate(row):
            text, cls = cell if isinstance(cell, tuple) else (cell, "")
            cls = " ".join(c for c in (cls, "num" if i in numeric else "") if c)
            attr = f' class="{cls}"' if cls else ""
            tds.append(f"<td{attr}>{e(str(text))}</td>")
        out.append("<tr>" + "".join(tds) + "</tr>")
    return "\n".join(out) + "</table>\n"


def _link(name) -> str:
    """A link to a fixture's section."""
    return f'<a href="#{html.escape(quote(str(name)))}">{html.escape(str(name))}</a>'


def _css(status) -> str:
    """The CSS class of a status."""
    return status.replace(" ", "-")


def _env_value(value) -> str:
    """An environment value as text: lists joined, null (not installed, not run) as a dash."""
    if value is None:
        return "—"
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)

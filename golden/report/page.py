"""The HTML report (``write_html``): ``DIR/index.html`` (the run, the summary, counts per
implementation, the environment, a section per fixture with its rows) and the fixtures' images
(``golden.report.figures``) under ``DIR/fixtures/``. Everything on the page is escaped."""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path
from urllib.parse import quote

from golden.report.bounds import _failing_text, _finite, _number, worst_bound
from golden.report.figures import _figure, _matplotlib, _save
from golden.report.files import _write
from golden.report.schema import STATUSES, SUMMARY_KEYS, _implementations, check_report

MAX_COLUMNS = 6  # implementations drawn per fixture image, beside the reference


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

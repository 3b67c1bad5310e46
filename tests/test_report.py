"""The report writers of ``attn-parity check`` (golden.report) on a hand-built report: JSON
schema, JUnit XML, the HTML page and its images, and the environment."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from golden import report as rp
from golden.report.bounds import _failing_text

PNG = b"\x89PNG\r\n\x1a\n"
NASTY = "shape <2, 3> & more"  # a reason that XML and HTML must escape


def _array(name, kind="value", *, err=1e-7, ok=True, missing=False, bound=1e-6):
    """One compared array of a row, its errors held to ``bound``; missing: nothing compared."""
    value = None if missing else err
    return {"name": name, "kind": kind, "max_abs": value, "max_rel": value, "rel_norm": value,
            "abs_err": value, "bound_abs": None if missing else bound,
            "bound_rel_norm": None if missing else bound, "rule": None if missing else "table",
            "ok": ok and not missing, "zero": False, "missing": missing}


def _row(fixture, implementation, core, dtype, status, reason=None, arrays=()):
    """A row; its worst errors over its arrays (inf where one is missing)."""
    errs = [math.inf if a["max_abs"] is None else a["max_abs"] for a in arrays]
    worst = max(errs, default=None)
    return {"fixture": fixture, "variant": "scaled_dot_product_attention",
            "implementation": implementation, "core": core, "dtype": dtype, "status": status,
            "reason": reason, "seconds": 0.01, "max_abs": worst, "max_rel": worst,
            "arrays": list(arrays)}


def _report():
    """Three fixtures; rows of every status, a missing gradient, a non-finite error, a reason
    to escape and one fixture the reference does not regenerate."""
    rows = [
        _row("sdpa_plain", "torch", "explicit", "float32", "pass",
             arrays=[_array("output"), _array("weights", "weights")]),
        _row("sdpa_plain", "jax", "explicit", "float32", "fail", "weights, grad W_query",
             arrays=[_array("output"), _array("weights", "weights", err=math.inf, ok=False),
                     _array("grad W_query", "grad", missing=True)]),
        _row("sdpa_plain", "mypkg.port:runner", "", "float64", "error",
             "ValueError: " + NASTY),
        _row("causal_mask", "torch", "explicit", "float64", "pass",
             arrays=[_array("output", err=np.float64(2e-16))]),
        _row("causal_mask", "jax", "explicit", "float64", "not supported", NASTY),
        _row("dropout_only", "torch", "fused", "float32", "not supported", "dropout"),
    ]
    summary = {"rows": 6, "passed": 2, "failed": 1, "errors": 1, "not_supported": 2,
               "regeneration_failed": 1, "seconds": 0.06, "ok": False}
    return {"schema": rp.SCHEMA, "schema_version": rp.SCHEMA_VERSION,
            "created": "2026-11-22T08:00:00Z", "command": "attn-parity check -k sdpa",
            "environment": rp.environment(),
            "profile": {"name": "exact", "k": None, "description": "float32 and float64 exact"},
            "implementations": ["torch", "jax", "mypkg.port:runner"], "rows": rows,
            "regeneration": {"checked": 3, "reproduced": 2, "differ": {"causal_mask": ["output"]}},
            "summary": summary}


def _weights():
    """Reference and implementation weights: (B, H, Lq, Lk) = (2, 3, 4, 5) for sdpa_plain,
    (Lq, Lk) = (4, 5) for causal_mask (reference only); none for dropout_only. jax's differs
    from the reference by 1e-7 in one element and equals it elsewhere."""
    rng = np.random.default_rng(0)
    ref = rng.dirichlet(np.ones(5), size=(2, 3, 4))  # (B, H, Lq, Lk), rows sum to 1
    off = ref.copy()
    off[0, 0, 1, 2] += 1e-7
    return {"sdpa_plain": {"reference": ref, "torch explicit float32": ref.astype(np.float32),
                           "jax explicit float32": off},
            "causal_mask": {"reference": rng.dirichlet(np.ones(5), size=4)}}


# --- JSON --------------------------------------------------------------------------------------

def test_json_round_trips_with_the_documented_schema(tmp_path):
    path = rp.write_json(_report(), tmp_path / "out" / "report.json")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    assert list(data) == list(rp.KEYS)
    assert data["schema"] == "attn-parity-check" and data["schema_version"] == 3
    assert all(list(row) == list(rp.ROW_KEYS) for row in data["rows"])
    assert all(list(a) == list(rp.ARRAY_KEYS) for row in data["rows"] for a in row["arrays"])
    assert list(data["summary"]) == list(rp.SUMMARY_KEYS)
    json.dumps(data, allow_nan=False)  # nothing non-finite is left
    keys = rp.KEYS + rp.ROW_KEYS + rp.ARRAY_KEYS + rp.SUMMARY_KEYS
    assert [k in rp.__doc__ for k in keys] == [True] * 41


def test_json_stores_non_finite_as_null(tmp_path):
    data = json.loads(rp.write_json(_report(), tmp_path / "r.json").read_text("utf-8"))
    failed = data["rows"][1]
    assert failed["max_abs"] is None and failed["max_rel"] is None
    assert failed["arrays"][1]["max_abs"] is None  # inf
    assert failed["arrays"][2]["missing"] is True and failed["arrays"][2]["rel_norm"] is None
    assert data["rows"][3]["max_abs"] == 2e-16  # a NumPy float became a JSON number
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed


def test_plain_converts_numpy_and_non_finite():
    got = rp.plain({"a": (np.float32(0.5), np.nan, -math.inf), "b": np.arange(2),
                    "c": np.bool_(True), 3: np.int64(4)})
    assert got == {"a": [0.5, None, None], "b": [0, 1], "c": True, "3": 4}


@pytest.mark.parametrize("bad, match", [
    ([], "report should be a dict"),
    ({"schema": rp.SCHEMA}, "report should have the keys"),
])
def test_bad_report_is_a_value_error(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        rp.write_json(bad, tmp_path / "r.json")


def test_bad_row_is_a_value_error(tmp_path):
    report = _report()
    report["rows"][0]["status"] = "passed"
    with pytest.raises(ValueError, match=r"report\['rows'\]\[0\]\['status'\] should be one of"):
        rp.write_junit(report, tmp_path / "j.xml")
    report["rows"][0]["status"] = "pass"
    del report["rows"][2]["arrays"]
    with pytest.raises(ValueError, match=r"report\['rows'\]\[2\] should have the keys"):
        rp.write_json(report, tmp_path / "r.json")


# --- JUnit -------------------------------------------------------------------------------------

def test_junit_parses_and_counts_match_the_rows(tmp_path):
    report = _report()
    path = rp.write_junit(report, tmp_path / "junit.xml")
    assert path.read_bytes().startswith(b"<?xml version='1.0' encoding='utf-8'?>")
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites" and root.get("name") == "attn-parity"
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == [*report["implementations"],
                                               "reference regeneration"]
    cases = root.iter("testcase")
    assert int(root.get("tests")) == len(list(cases)) == 6 + 2  # rows + regeneration cases
    assert int(root.get("failures")) == len(list(root.iter("failure"))) == 1 + 1
    assert int(root.get("errors")) == len(list(root.iter("error"))) == 1
    assert int(root.get("skipped")) == len(list(root.iter("skipped"))) == 2
    for suite in suites:
        assert int(suite.get("tests")) == len(suite.findall("testcase"))


def test_junit_failure_names_the_arrays_and_escapes(tmp_path):
    root = ET.parse(rp.write_junit(_report(), tmp_path / "junit.xml")).getroot()
    jax = root.find("testsuite[@name='jax']")
    case = jax.find("testcase[@classname='sdpa_plain']")
    assert case.get("name") == "jax explicit float32"
    failure = case.find("failure")
    assert failure.get("type") == "tolerance" and "grad W_query" in failure.get("message")
    assert "grad W_query: max_abs=n/a rel_norm=n/a ok=False (missing)" in failure.text
    skipped = jax.find("testcase[@classname='causal_mask']/skipped")
    assert skipped.get("message") == "not supported: " + NASTY
    assert root.find(".//testcase[@classname='dropout_only']/skipped").get("message") == (
        "not supported: dropout")
    error = root.find("testsuite[@name='mypkg.port:runner']/testcase/error")
    assert error.get("message") == "ValueError: " + NASTY
    regen = root.find("testsuite[@name='reference regeneration']/testcase[@classname="
                      "'causal_mask']/failure")
    assert "output" in regen.get("message")


def test_junit_without_regeneration_and_with_control_characters(tmp_path):
    report = _report()
    report["regeneration"] = None
    report["rows"][2]["reason"] = "\x1b[31mboom\x1b[0m"  # a terminal escape in an exception
    root = ET.parse(rp.write_junit(report, tmp_path / "junit.xml")).getroot()
    assert "reference regeneration" not in [s.get("name") for s in root]
    assert int(root.get("tests")) == 6
    assert "boom" in root.find(".//error").get("message")


# --- HTML --------------------------------------------------------------------------------------

def test_html_writes_the_page_and_one_image_per_fixture(tmp_path):
    report = _report()
    weights = {**_weights(), "not_in_rows": {"reference": np.eye(3)}}
    index = rp.write_html(report, tmp_path / "html", weights, progress=False)
    assert index == tmp_path / "html" / "index.html"
    page = index.read_text("utf-8")
    names = ["sdpa_plain", "causal_mask", "dropout_only"]
    images = sorted(p.name for p in (tmp_path / "html" / "fixtures").iterdir())
    assert images == sorted(f"{n}.png" for n in names)
    for name in names:
        assert (tmp_path / "html" / "fixtures" / f"{name}.png").read_bytes().startswith(PNG)
        assert f'id="{name}"' in page and f'src="fixtures/{name}.png"' in page
    for key, count in report["summary"].items():
        if key != "ok":
            assert f"<td>{key.replace('_', ' ')}</td><td class=\"num\">{count}</td>" in page
    assert "overall: FAILED" in page and "attn-parity check -k sdpa" in page
    assert "Regeneration: the reference does not reproduce output" in page
    assert "shape &lt;2, 3&gt; &amp; more" in page and NASTY not in page


def _png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's header."""
    data = path.read_bytes()
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_html_images_draw_a_difference_row_where_there_is_one(tmp_path):
    rp.write_html(_report(), tmp_path, _weights(), progress=False)
    both = _png_size(tmp_path / "fixtures" / "sdpa_plain.png")  # reference, torch, jax
    alone = _png_size(tmp_path / "fixtures" / "causal_mask.png")  # reference only
    none = _png_size(tmp_path / "fixtures" / "dropout_only.png")  # no weights
    assert both[0] > alone[0] > none[0] and both[1] > alone[1] > none[1]


def test_html_caps_the_columns_and_says_which_were_left_out(tmp_path):
    report = _report()
    weights = {"causal_mask": {"reference": np.full((4, 5), 0.2)}}
    weights["causal_mask"].update({f"impl{i} numpy float64": np.full((4, 5), 0.2)
                                   for i in range(8)})
    page = rp.write_html(report, tmp_path, weights, progress=False).read_text("utf-8")
    assert "Not drawn (more than 6 implementations): impl6 numpy float64, impl7 numpy" in page
    assert len(list((tmp_path / "fixtures").glob("*.png"))) == 3


def test_html_rejects_weights_that_are_not_a_dict(tmp_path):
    with pytest.raises(ValueError, match="weights should be a dict .* got list"):
        rp.write_html(_report(), tmp_path, [], progress=False)
    with pytest.raises(ValueError, match=r"weights\['sdpa_plain'\] should be a dict"):
        rp.write_html(_report(), tmp_path, {"sdpa_plain": np.zeros(3)}, progress=False)


def test_html_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install 'attn-parity\[report\]'"):
        rp.write_html(_report(), tmp_path, {}, progress=False)


# --- environment -------------------------------------------------------------------------------

def test_environment_names_the_versions():
    env = rp.environment()
    keys = ["python", "platform", "machine", "numpy", *rp.PACKAGES, "attn_parity",
            "jax_backend", "devices"]
    assert list(env) == keys
    assert env["numpy"] == np.__version__
    assert all(isinstance(env[k], str) for k in ["python", "platform", "machine", "numpy",
                                                 "attn_parity", "matplotlib"])
    assert all(env[k] is None or isinstance(env[k], str) for k in rp.PACKAGES)
    json.dumps(env, allow_nan=False)


# --- bounds: every row says what it was held to ----------------------------------------------

def _one_off(delta, n=10_000, value=0.5):
    """(actual, expected): n elements of ``value``, the element 3 off by ``delta``. The relative
    error norm is delta / (value √n), far below its bound, so the elementwise check decides."""
    e = np.full(n, value)
    a = e.copy()
    a[3] += delta
    return a, e


def test_a_float32_value_row_shows_the_tables_bounds(tmp_path):
    from golden.harness.check import _array
    from golden.specification.tolerances import compare

    a, e = _one_off(5e-7)
    c = compare(a, e, "float32", "value")
    # float32 value row of the table: rel_norm 1e-6, rtol 1e-5, atol 1e-6; max|e| = 0.5 < 1 so
    # atol is not scaled: element 3 is held to 1e-6 + 1e-5 · 0.5
    assert c.ok and c.rule == "table" and c.bound_rel_norm == 1e-6
    assert c.bound_abs == pytest.approx(1e-6 + 1e-5 * 0.5, rel=1e-12)
    assert c.abs_err == pytest.approx(5e-7, rel=1e-9) == pytest.approx(c.max_abs, rel=1e-9)
    report = _report()
    report["rows"][0]["arrays"] = [_array("output", c)]
    data = json.loads(rp.write_json(report, tmp_path / "r.json").read_text("utf-8"))
    entry = data["rows"][0]["arrays"][0]
    assert entry["bound_abs"] == c.bound_abs and entry["bound_rel_norm"] == 1e-6
    assert entry["rule"] == "table" and entry["abs_err"] == c.abs_err


def test_a_scaled_gradient_row_shows_atol_scaled_by_its_size_and_terms():
    from golden.specification.tolerances import compare

    a, e = _one_off(1e-5, value=4.0)  # max|e| = 4, 9 terms: atol' = 1e-6 · 4 · 3
    c = compare(a, e, "float32", "grad", terms=9)
    assert c.bound_abs == pytest.approx(1e-6 * 4 * 3 + 1e-5 * 4, rel=1e-12)
    assert c.bound_rel_norm == 4e-6 and c.ok
    z = compare(np.full(5, 1e-7), np.zeros(5), "float32", "grad", zero=True)
    assert z.bound_rel_norm is None and z.bound_abs == 1e-6 and z.ok  # zero: atol alone


def test_a_terms_row_shows_the_bounds_relative_to_the_terms():
    from golden.specification.tolerances import compare_terms

    e, m = np.full(100, 1e-3), np.full(100, 10.0)  # sums of terms of size 10 that cancel
    c = compare_terms(e + 5e-6, e, m, "float32", "value")  # the table alone: 1.01e-6 < 5e-6
    assert c.ok and c.rule == "terms" and c.abs_err == pytest.approx(5e-6, rel=1e-9)
    assert c.bound_abs == pytest.approx(1e-6 * 10 + 1e-5 * 10, rel=1e-12)
    # ‖a − e‖ ≤ 1e-6 ‖m‖ + tiny·√n, as a bound on ‖a − e‖/‖e‖ with ‖e‖ = 1e-3 · 10
    assert c.bound_rel_norm == pytest.approx((1e-6 * 100 + 2.0**-126 * 10) / 1e-2, rel=1e-12)


@pytest.mark.parametrize("delta, ok", [(5.9e-6, True), (6.1e-6, False)])
def test_a_near_threshold_row_reads_against_its_bound(delta, ok):
    from golden.harness.check import _array, _format_row
    from golden.specification.tolerances import compare

    a, e = _one_off(delta)  # element 3 is held to 1e-6 + 1e-5 · 0.5 = 6e-6
    c = compare(a, e, "float32", "value")
    assert c.ok is ok
    row = {**_row("sdpa_plain", "jax", "explicit", "float32", "pass" if ok else "fail",
                  None if ok else "output", [_array("output", c)])}
    line = _format_row(row, 12)
    # as docs/validating.md "Reports" quotes them
    assert line.endswith(f"{delta:.1e}/6.0e-06  " + ("pass" if ok else "FAIL output"))
    assert rp.worst_bound(row["arrays"]) == f"{delta:.1e}/6.0e-06"
    if not ok:
        assert _failing_text(row["arrays"][0]) == "output (|a-e| 6.10e-06 > bound 6.00e-06)"


def test_the_relative_norm_decides_when_it_is_closer():
    from golden.harness.check import _array
    from golden.specification.tolerances import compare

    e = np.ones(100)
    c = compare(e * (1 + 1.1e-6), e, "float32", "value")  # rel_norm 1.1e-6 > 1e-6
    assert not c.ok and c.abs_err < c.bound_abs  # elementwise it passes
    assert rp.worst_bound([_array("output", c)]) == "1.1e-06/1.0e-06"
    assert _failing_text(_array("output", c)) == (
        "output (rel_norm 1.10e-06 > bound 1.00e-06)")


def test_a_profile_row_shows_k_times_the_plain_error_plus_atol():
    from golden.specification.tolerances import compare_profile, compare_to_plain

    rng = np.random.default_rng(1)
    e = rng.standard_normal((3, 5, 7)) * 2  # max|e| > 1: atol scales with it
    b = e + rng.standard_normal(e.shape) * 1e-4  # the plain implementation's error
    a = e + rng.standard_normal(e.shape) * 1e-4
    c = compare_profile(a, e, b, "float32", "value", profile_name="tf32")
    atol = 1e-6 * np.abs(e).max()
    assert c.rule == "profile" and c.abs_err == c.max_abs == np.abs(a - e).max()
    assert c.bound_abs == pytest.approx(2 * np.abs(b - e).max() + atol, rel=1e-12)
    assert c.bound_rel_norm == pytest.approx(
        2 * np.linalg.norm(b - e) / np.linalg.norm(e) + 1e-6, rel=1e-12)
    assert c.ok == (c.max_abs <= c.bound_abs and c.rel_norm <= c.bound_rel_norm)
    assert compare_to_plain(e, e, b, "float32").rule == "table"  # the table passed first


def test_junit_and_html_show_the_failing_arrays_bounds(tmp_path):
    report = _report()
    report["rows"][1]["arrays"][0] = _array("output", err=2.5e-6, ok=False)
    root = ET.parse(rp.write_junit(report, tmp_path / "j.xml")).getroot()
    failure = root.find("testsuite[@name='jax']/testcase[@classname='sdpa_plain']/failure")
    assert failure.get("message") == (
        "tolerance exceeded: output (|a-e| 2.50e-06 > bound 1.00e-06; rel_norm 2.50e-06 > "
        "bound 1.00e-06), weights (|a-e| inf > bound 1.00e-06; rel_norm inf > bound 1.00e-06), "
        "grad W_query (missing)")
    assert ("output: max_abs=2.50e-06 rel_norm=2.50e-06 ok=False (FAIL); |a-e| 2.50e-06 vs "
            "bound 1.00e-06, rel_norm 2.50e-06 vs bound 1.00e-06 (table rule)") in failure.text
    page = rp.write_html(report, tmp_path / "h", _weights(), progress=False).read_text("utf-8")
    assert "<th>worst err/bound</th>" in page
    assert '<td class="num">1.0e-07/1.0e-06</td>' in page  # torch's passing row
    assert "output (|a-e| 2.50e-06 &gt; bound 1.00e-06;" in page


# --- HTML: outputs where there are no weights, a badge per implementation --------------------

def test_html_draws_the_output_difference_when_no_weights_were_returned(tmp_path):
    report = _report()
    rng = np.random.default_rng(2)
    out = rng.standard_normal((2, 3, 4, 6))  # (B, H, Lq, Dv)
    outputs = {"causal_mask": {"reference": out, "torch explicit float64": out + 1e-12,
                               "jax explicit float64": out}}
    page = rp.write_html(report, tmp_path, _weights(), progress=False,
                         outputs=outputs).read_text("utf-8")
    assert ("No attention weights from torch explicit float64, jax explicit float64: the image "
            "shows their output's |implementation − reference|.") in page
    assert "sdpa_plain" not in outputs and page.count("No attention weights from") == 1
    with_outputs = _png_size(tmp_path / "fixtures" / "causal_mask.png")
    rp.write_html(report, tmp_path / "plain", _weights(), progress=False)
    alone = _png_size(tmp_path / "plain" / "fixtures" / "causal_mask.png")
    assert with_outputs[0] > alone[0] and with_outputs[1] > alone[1]  # a row, two columns more
    only = {"dropout_only": {"reference": out, "mypkg.port:runner  float32": out * 2}}
    rp.write_html(report, tmp_path / "only", {}, progress=False, outputs=only)
    none = _png_size(tmp_path / "plain" / "fixtures" / "dropout_only.png")
    assert _png_size(tmp_path / "only" / "fixtures" / "dropout_only.png")[1] > none[1]


def test_html_index_has_a_badge_per_implementation(tmp_path):
    page = rp.write_html(_report(), tmp_path, _weights(), progress=False).read_text("utf-8")
    index = page[page.index("<h2>Fixtures</h2>"):page.index("<section")]
    plain_item = index[index.index('href="#sdpa_plain"'):index.index('href="#causal_mask"')]
    assert '<span class="badge pass" title="torch: pass">torch: pass</span>' in plain_item
    assert '<span class="badge fail" title="jax: fail">jax: fail</span>' in plain_item
    assert ('<span class="badge error" title="mypkg.port:runner: error">mypkg.port:runner: '
            'error</span>') in plain_item
    assert '<span class="badge not-supported" title="jax: not supported">' in index


# --- compare's report ----------------------------------------------------------------------

def _port_report(delta):
    """A PortReport of an output off by ``delta`` in one element (no modules run)."""
    from golden.compare.verdict import _report as port_report

    a, e = _one_off(delta)
    expected = {"output": e, "grads": {}, "submodules": {}}
    return port_report(expected, {"output": a, "grads": {}, "submodules": {}}, None, {}, [], 1,
                       [], {"seed": 0})


@pytest.mark.parametrize("delta, ok", [(5.9e-6, True), (6.1e-6, False)])
def test_compare_text_and_json_show_the_flax_columns_bounds(delta, ok):
    from golden.compare import SCHEMA

    report = _port_report(delta)
    assert report.ok is ok
    line = next(x for x in report.text().splitlines() if x.startswith("output"))
    assert line.endswith(f"/1.0e-06  {delta:.1e}/6.0e-06  {'pass' if ok else 'FAIL'}")
    header = report.text().splitlines()[1]
    assert header.endswith("max|Δ|   rel‖Δ‖/bound     |Δᵢ|/boundᵢ")
    at = len(header) - len("max|Δ|   rel‖Δ‖/bound     |Δᵢ|/boundᵢ")
    cells = line[at:].split()  # the Flax column's cells start under its header
    rel = report.rows[0]["flax_float32"]["rel_norm"]
    assert line[at - 2:at] == "  " and cells[1] == f"{rel:.1e}/1.0e-06"
    assert SCHEMA["schema_version"] == 3
    row = json.loads(json.dumps(report.to_json(), allow_nan=False))["rows"][0]["flax_float32"]
    assert row["bound_rel_norm"] == 1e-6 and row["rule"] == "table"
    assert row["bound_abs"] == pytest.approx(6e-6, rel=1e-12)


# --- files get the mode a new file gets --------------------------------------------------------

@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_get_the_umasks_mode(tmp_path, mask, mode):
    import os

    from golden.specification.fixture import write_atomic

    old = os.umask(mask)
    try:
        write_atomic(tmp_path / "f.bin", b"x")
        rp.write_json(_report(), tmp_path / "r.json")
    finally:
        os.umask(old)
    assert (tmp_path / "f.bin").stat().st_mode & 0o777 == mode
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == mode
    assert (tmp_path / "f.bin").read_bytes() == b"x" and not list(tmp_path.glob(".*.tmp"))


def test_check_html_draws_the_output_of_a_function_without_weights(tmp_path):
    from golden.harness import check
    from golden.runners.adapt import from_function

    def sdpa(query, key, value):  # no return_weights: the runner's result has no "weights"
        s = query @ np.swapaxes(key, -1, -2) / np.sqrt(query.shape[-1])
        w = np.exp(s - s.max(-1, keepdims=True))
        return w / w.sum(-1, keepdims=True) @ value

    runner = from_function(sdpa, "numpy", name="mine")
    assert check.main(["sdpa_plain"], impls=[runner], html_dir=tmp_path, log=lambda line: None,
                      progress=False) == 0
    page = (tmp_path / "index.html").read_text("utf-8")
    assert ("No attention weights from mine  float32, mine  float64: the image shows their "
            "output's |implementation − reference|.") in page
    # two rows (reference weights, output difference): 5.6 in at 80 dpi; one row is 3.05 in
    assert _png_size(tmp_path / "fixtures" / "sdpa_plain.png")[1] == round(5.6 * 80)

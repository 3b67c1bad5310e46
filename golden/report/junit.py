"""The JUnit XML report for CI test reporters (``write_junit``): a testsuite per implementation,
a testcase per row (a failure, an error, skipped, or nothing inside when it passed), and a
"reference regeneration" suite when that check ran. Text XML 1.0 cannot hold becomes "?"."""

from __future__ import annotations

import io
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from golden.report.bounds import _failing_text, _finite, _number
from golden.report.files import _write
from golden.report.schema import _implementations, check_report


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

"""The JSON report (``write_json``): the schema's keys in order, indent 1, every float that is not
finite stored as null."""

from __future__ import annotations

import json
from pathlib import Path

from golden.report.files import _write
from golden.report.schema import check_report, plain


def write_json(report: dict, path) -> Path:
    """Write ``report`` as the schema's JSON (indent 1, keys in order, non-finite as null)."""
    check_report(report)
    text = json.dumps(plain(report), indent=1, allow_nan=False, ensure_ascii=False)
    return _write(path, (text + "\n").encode("utf-8"))

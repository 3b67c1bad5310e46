"""The report dict's schema: its name and version, the keys of a report, a row, an array and the
summary in their order, the statuses (``SCHEMA``, ``SCHEMA_VERSION``, ``KEYS``, ``ROW_KEYS``,
``ARRAY_KEYS``, ``SUMMARY_KEYS``, ``STATUSES``); the check every writer makes first
(``check_report``); NumPy and non-finite values made what JSON holds (``plain``); the
implementations a report names, in order. ``golden.report``'s docstring describes each key."""

from __future__ import annotations

import math

import numpy as np

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


def _implementations(report) -> list[str]:
    """The report's implementation labels, then any other that a row names, in order."""
    labels = list(report["implementations"])
    labels += [r["implementation"] for r in report["rows"] if r["implementation"] not in labels]
    return list(dict.fromkeys(labels))

"""A row's errors beside their bounds, as text, for the check table, the JUnit failures and the
HTML rows: the check that came closest to its bound (``worst_bound``), each failing array's
checks over their bounds (``_failing_text``), and how a number reads (``_number``,
``_finite``)."""

from __future__ import annotations

import math

import numpy as np


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


def _finite(x) -> float | None:
    """``x`` as a float if it is a finite number, else None."""
    return float(x) if isinstance(x, (int, float, np.number)) and math.isfinite(x) else None


def _number(x, digits=2) -> str:
    """A number for a table or message: "1.20e-07", "inf", or "n/a" for null (nothing
    compared, or non-finite in a report read back from JSON)."""
    return "n/a" if x is None else f"{float(x):.{digits}e}"

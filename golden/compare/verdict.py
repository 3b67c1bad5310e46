"""The verdict of ``golden.compare``: the Flax run judged against torch float64 (the torch run
at the same dtype shown beside it), a row for the output, each gradient and each paired
submodule's input and output, assembled into a ``PortReport`` with where it diverges
(``golden.compare.localise``) and the suspect parameters.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from golden.specification import mapping as mapping_lib
from golden.specification import tolerances
from golden.compare.localise import _locate
from golden.compare.report import PortReport


def _judged(got, e, baseline, dtype, kind, terms=1, zero=False):
    """The Flax array against the float64 one: the float32 table at float32; at bfloat16 and
    float16 the dtype's row of the table, or failing it at most 2x the torch baseline's error
    at that dtype on the same inputs (``tolerances.compare_to_plain``; the table alone without
    a baseline)."""
    if dtype == "float32" or baseline is None:
        return tolerances.compare(got, e, dtype, kind, terms=terms, zero=zero)
    return tolerances.compare_to_plain(got, e, baseline, dtype, kind, terms, zero)


def _report(expected: dict, flax: dict, torch32: dict | None, table: dict, pairs: list,
            terms: int, notes: list, data: dict) -> PortReport:
    """Judge the Flax run (and show torch's at the same dtype) against torch float64; the
    columns keep the names torch_float32 and flax_float32 at every dtype (data["dtype"])."""
    dtype = data.get("dtype", "float32")

    def row(what, key, kind, n, flax_path=None, rule=None, group=None):
        e = expected[group][key] if group else expected[key]
        got = [(r[group][key] if group else r[key]) if r is not None else None
               for r in (torch32, flax)]
        zero = group == "grads" and _zero(e, n)
        cmp = [None if got[0] is None else dataclasses.asdict(
            tolerances.compare(got[0], e, dtype, kind, terms=n, zero=zero)),
            dataclasses.asdict(_judged(got[1], e, got[0], dtype, kind, n, zero))]
        return {"what": what, "torch_float32": cmp[0], "flax_float32": cmp[1],
                "flax_path": flax_path, "rule": rule, "ok": cmp[1]["ok"]}

    rows = [row("output", "output", "value", 1)]
    for key, (path, rule) in table.items():
        rows.append(row(f"grad {key}", key, "grad", terms, path, str(rule), "grads"))
    for name in (k for k in expected["grads"] if k.startswith("input.")):
        rows.append(row(f"grad input {name[6:]}", name, "grad", 1, group="grads"))
    sub_rows, steps = _submodule_rows(expected, flax, torch32, pairs, notes, dtype)
    failing = [k for k, r in zip(table, rows[1:]) if not r["ok"]]
    ok = all(r["ok"] for r in rows)
    grads_failing = [r["what"] for r in rows[1:] if not r["ok"]]
    where = _locate(steps, rows[0]["ok"], grads_failing)
    first = next((s["pair"] for s in steps if s["output"] is False), None)
    suspects = [f"{k} -> {path} (rule {rule})" for k, (path, rule) in table.items()
                if (mapping_lib.submodule(k), mapping_lib.submodule(path)) in where["owners"]]
    return PortReport(ok, rows + sub_rows, first and " ~ ".join(first), failing, suspects,
                      notes, data, where["diagnosis"], where["interval"])


def _zero(expected, terms) -> bool:
    """A float64 gradient within float64 rounding of zero is taken as zero by structure (a
    key-projection bias: softmax ignores a constant added to a row) and judged, as the
    project's fixtures judge such gradients, by the absolute bound alone."""
    return tolerances.compare(expected, np.zeros_like(expected), "float64", "grad",
                              terms=terms, zero=True).ok


def _submodule_rows(expected, flax, torch32, pairs, notes, dtype="float32"):
    """Rows for the paired submodules in torch's execution order (each one's input, when it is
    a float array both sides recorded, then its output), and per pair what was found:
    {"pair", "missing" (None, or the side that never called it), "input", "output"}: True (agrees),
    False (diverges) or None (not compared)."""
    rows, steps = [], []
    if "submodule_inputs" not in expected:
        notes.append("the expectations hold no submodule inputs (a port fixture of format "
                     "version 1): divergences are located by submodule outputs alone")
    for t, f in pairs:
        label = f"{t} ~ {f}"
        step = {"pair": (t, f), "missing": None, "input": None, "output": None}
        steps.append(step)
        e, got = expected["submodules"].get(t), flax["submodules"].get(f)
        if e is None or got is None:
            step["missing"] = "torch" if e is None else "Flax"
            notes.append(f"submodule {label}: not called in {step['missing']}" + (
                f": the port does not call `{f}`'s `__call__`, so its output is compared nowhere"
                if e is not None else ""))
            continue
        for part, group in (("input", "submodule_inputs"), ("output", "submodules")):
            what = f"submodule {label}" if part == "output" else f"input of {label}"
            e, got = expected.get(group, {}).get(t), flax.get(group, {}).get(f)
            if e is None or got is None:
                continue  # an input that is not a float array, or not recorded
            if got.size != e.size:
                rows.append({"what": what, "torch_float32": None, "flax_float32": None,
                             "flax_path": f, "rule": None, "ok": None,
                             "note": f"shapes differ: {e.shape} vs {got.shape}"})
                step[part] = False
                continue
            base = None if torch32 is None else torch32.get(group, {}).get(t)
            cmp = [None if base is None else dataclasses.asdict(
                tolerances.compare(base.reshape(e.shape), e, dtype, "value")),
                dataclasses.asdict(_judged(got.reshape(e.shape), e, base, dtype, "value"))]
            rows.append({"what": what, "torch_float32": cmp[0], "flax_float32": cmp[1],
                         "flax_path": f, "rule": None, "ok": cmp[1]["ok"]})
            step[part] = cmp[1]["ok"]
    return rows, steps

"""How far the reference's float64 values are from the exact ones, in ulp.

    python bench/reference_accuracy.py [FIXTURE ...]

For each fixture (all by default) the reference runs three ways on the fixture's stored inputs:
- ``fast``: NumPy float64 (``golden.runners.run_reference(exact=False)``), what wrote the
  fixtures up to format version 2; its last bits depend on the CPU's instruction set;
- ``stored``: the 50-digit exact arithmetic rounded once to float64 (``exact=True``), what
  writes them now;
- the oracle: the same formulas at 100 significant digits, with exp, ln, tanh, sin and cos from
  mpmath at 120 digits (independent of golden.specification.exact's own series).
It prints, per kind of array (outputs, weights, gradients), the worst error of ``fast`` and of
``stored`` in units in the last place of the oracle's value rounded to float64 (an error of
0.5 ulp or less is correct rounding), the number of elements compared, and for the gradients
that are zero by structure (fixture meta "zero") the largest residue each leaves.
"""

from __future__ import annotations

import argparse
import sys
from decimal import Decimal
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import golden  # noqa: E402
from golden.specification import exact
from golden import reference, runners  # noqa: E402
from golden.specification.cases import CASES  # noqa: E402

ORACLE_DIGITS = 100


def oracle_type():
    """A golden.specification.exact number type of 100 digits whose transcendental functions are
    mpmath's."""
    import mpmath

    base = exact.real_type(ORACLE_DIGITS)

    def via_mpmath(name):
        def method(self):
            with mpmath.workdps(ORACLE_DIGITS + 20):
                y = getattr(mpmath, name)(mpmath.mpf(str(self)))
                return self._make(self.ctx.plus(Decimal(mpmath.nstr(y, ORACLE_DIGITS + 15,
                                                                     strip_zeros=False))))
        return method

    methods = {n: via_mpmath(n) for n in ("exp", "tanh", "sin", "cos")}
    methods["log"] = via_mpmath("log")
    return type("Oracle", (base,), {"__slots__": (), **methods})


def oracle(fixture, real):
    """The fixture's output, weights and gradients at the oracle's precision (object arrays),
    and the names that are zero by structure."""
    inputs = {n: (a.astype(np.float64) if a.dtype.kind == "f" else a)
              for n, a in fixture.inputs.items()}
    forward, backward = reference.pair(fixture.variant)
    with reference.exact_arithmetic(real):
        out, weights, saved = forward(fixture.config, inputs, fixture.params)
        grads = backward(saved, *_cotangents(fixture))
    kept = {"output": out} if weights is None else {"output": out, "weights": weights}
    return {**kept, **{f"grad {n}": g for n, g in grads.items()}}


def _cotangents(fixture):
    """(dO, dA) as float64; dA None for a recurrent mixer (no attention weights)."""
    return tuple(None if fixture.cotangents.get(n) is None
                 else fixture.cotangents[n].astype(np.float64) for n in ("output", "weights"))


def ulp_errors(got, want):
    """|got − want| / ulp(want) elementwise, with ulp(want) the spacing of float64 at the value
    of ``want`` rounded to float64 (exact zeros compare against the smallest subnormal)."""
    want_f = exact.to_float64(want)
    ulps = np.spacing(np.abs(want_f))
    flat = [abs(Decimal(float(g)) - w) / Decimal(float(u))
            for g, w, u in zip(got.reshape(-1), want.reshape(-1), ulps.reshape(-1))]
    return np.array([float(e) for e in flat]).reshape(got.shape)


def measure(names):
    real = oracle_type()
    runs = ("fast", "stored")
    rows = {k: {"n": 0, **{r: 0.0 for r in runs}, **{f"{r} normwise": 0.0 for r in runs}}
            for k in ("output", "weights", "gradients")}
    residue = {"fast": 0.0, "stored": 0.0, "oracle": 0.0, "n": 0}
    for name in names:
        fixture = golden.load(name)
        truth = oracle(fixture, real)
        results = {"fast": fast(fixture), "stored": runners.run_reference(fixture, exact=True)}
        for what, want in truth.items():
            grad = what.startswith("grad ")
            pick = (lambda r, w=what: r["grads"][w[5:]]) if grad else (lambda r, w=what: r[w])
            if grad and what[5:] in fixture.zero:
                residue["n"] += want.size
                residue["oracle"] = max(residue["oracle"], float(np.max(np.abs(want))))
                for run in runs:
                    residue[run] = max(residue[run], float(np.max(np.abs(pick(results[run])))))
                continue
            row = rows["gradients" if grad else what]
            row["n"] += want.size
            zero = reference.zero_elements(fixture.config) if what == "grad b_key" else None
            if zero is not None:  # partial rotary's pass-through features: residue, not values
                residue["n"] += int(zero.sum())
                residue["oracle"] = max(residue["oracle"], float(np.max(np.abs(want[zero]))))
                for run in runs:
                    residue[run] = max(residue[run], float(np.max(np.abs(
                        pick(results[run])[zero]))))
                want = np.where(zero, want.flat[0] * 0, want)
            for run in runs:
                got = pick(results[run])
                got = got if zero is None else np.where(zero, 0.0, got)
                row[run] = max(row[run], float(np.max(ulp_errors(got, want))))
                row[f"{run} normwise"] = max(row[f"{run} normwise"], normwise(got, want))
    return rows, residue


def fast(fixture):
    """The NumPy float64 reference's raw result (residue left where zero_grads would zero)."""
    inputs = {n: (a.astype(np.float64) if a.dtype.kind == "f" else a)
              for n, a in fixture.inputs.items()}
    forward, backward = reference.pair(fixture.variant)
    out, weights, saved = forward(fixture.config, inputs, fixture.params)
    grads = backward(saved, *_cotangents(fixture))
    return {"output": out, "weights": weights, "grads": grads}


def normwise(got, want):
    """max |got − want| in ulp of the array's largest exact element."""
    want_f = exact.to_float64(want)
    top = float(np.max(np.abs(want_f))) if want_f.size else 0.0
    if top == 0.0:
        return 0.0 if not np.any(got) else float("inf")
    errors = [abs(Decimal(float(g)) - w) for g, w in zip(got.reshape(-1), want.reshape(-1))]
    return float(max(errors) / Decimal(float(np.spacing(top))))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("fixtures", nargs="*", help="fixture names (default: all)")
    args = parser.parse_args(argv)
    names = args.fixtures or [c.name for c in CASES]
    rows, residue = measure(names)
    print(f"{len(names)} fixtures against a {ORACLE_DIGITS}-digit oracle (exp, ln, tanh, sin, cos "
          f"from mpmath)")
    print("worst error in ulp of each element (normwise: in ulp of its array's largest element)")
    print(f"{'arrays':<12}{'elements':>10}{'fast':>12}{'fast normwise':>15}{'stored':>9}"
          f"{'stored normwise':>17}")
    for kind, r in rows.items():
        print(f"{kind:<12}{r['n']:>10}{r['fast']:>12.4g}{r['fast normwise']:>15.4g}"
              f"{r['stored']:>9.3g}{r['stored normwise']:>17.3g}")
    print(f"zero by structure: {residue['n']} elements; largest residue fast "
          f"{residue['fast']:.2e}, stored {residue['stored']:.2e} (oracle's own "
          f"{residue['oracle']:.2e})")
    return rows, residue


if __name__ == "__main__":
    main()

"""The one tolerance table, and the comparison every test and ``attn-parity check`` uses.

An array passes when both hold:
    ‖actual − expected‖₂ / ‖expected‖₂ ≤ rel_norm
    |actual − expected| ≤ atol + rtol · |expected|   elementwise
The bounds are the tightest the arithmetic allows on this machine's CPUs (see the README's
figures for the errors actually seen); loosening one needs a reason written beside it.

Two rules widen the elementwise bound, the same for every case, and why:
- atol is relative to the array's scale, max(1, max |e|): an element near zero that is computed
  from operands of the array's scale carries their absolute rounding error, not its own.
- a gradient that sums ``terms`` partial gradients (a parameter's over every position, a
  broadcast bias's over B·H·Lq) has rounding error growing like √terms while the sum may cancel
  to a small number, so atol is also multiplied by √terms.
The relative error norm is not applied to an array that is zero at that resolution
(‖e‖ ≤ atol·√size), such as the gradient of a key-projection bias, which is exactly zero in exact
arithmetic (softmax is unchanged by a constant added to a row): there it measures only noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Tolerance:
    rel_norm: float
    rtol: float
    atol: float


TOLERANCES = {  # (dtype, "value" for outputs and weights | "grad" for gradients)
    ("float32", "value"): Tolerance(rel_norm=1e-6, rtol=1e-5, atol=1e-6),
    # Gradients go through the softmax backward P ⊙ (g − Σ g ⊙ P), whose subtraction cancels,
    # and then through sums over positions; float32 gradients of the module cases reach a
    # relative error norm of 1.1e-6 (torch, multi_head_attention_dropout, W_key), hence 2e-6.
    ("float32", "grad"): Tolerance(rel_norm=2e-6, rtol=1e-5, atol=1e-6),
    # float64: the largest seen is a relative error norm of 2.1e-15 (jax, sdpa_large_logits);
    # 1e-13 leaves room for other BLAS builds while still catching any float32 step.
    ("float64", "value"): Tolerance(rel_norm=1e-13, rtol=1e-13, atol=1e-14),
    ("float64", "grad"): Tolerance(rel_norm=1e-13, rtol=1e-13, atol=1e-14),
    # Low precision, in units of the unit roundoff u (bfloat16 2⁻⁹, float16 2⁻¹¹): inputs and
    # weights are exact on both grids, so this is the arithmetic alone. Projections and the
    # products with V run in the low dtype, softmax in float32. Largest seen on this machine
    # (golden/cases.py, LOW): bfloat16 values 1.9u, gradients 5.3u (rel. error norm) and 5.6u
    # (elementwise); float16 values 0.9u, gradients 2.9u.
    ("bfloat16", "value"): Tolerance(rel_norm=3 * 2**-9, rtol=4 * 2**-9, atol=4 * 2**-9),
    ("bfloat16", "grad"): Tolerance(rel_norm=8 * 2**-9, rtol=8 * 2**-9, atol=8 * 2**-9),
    ("float16", "value"): Tolerance(rel_norm=2 * 2**-11, rtol=3 * 2**-11, atol=3 * 2**-11),
    ("float16", "grad"): Tolerance(rel_norm=4 * 2**-11, rtol=4 * 2**-11, atol=4 * 2**-11),
}


@dataclass(frozen=True)
class Comparison:
    max_abs: float   # max |a − e|
    max_rel: float   # max |a − e| / max |e|: the error relative to the array's scale
    rel_norm: float  # ‖a − e‖₂ / ‖e‖₂
    ok: bool
    zero: bool = False  # e is zero at the tolerance's resolution: relative errors mean nothing


def compare(actual, expected, dtype: str, kind: str = "value", terms: int = 1) -> Comparison:
    """Compare to the float64 expectation; ``terms`` = summands per element (see above)."""
    tol = TOLERANCES[dtype, kind]
    a, e = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        return Comparison(np.inf, np.inf, np.inf, False)
    diff = np.abs(a - e)
    max_abs = float(diff.max(initial=0.0))
    scale, norm = float(np.abs(e).max(initial=0.0)), float(np.linalg.norm(e))
    atol = tol.atol * max(1.0, scale) * float(np.sqrt(terms))
    zero = norm <= atol * np.sqrt(e.size)
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else np.inf)
    rel_norm = (float(np.linalg.norm(a - e)) / norm if norm > 0
                else (0.0 if max_abs == 0 else np.inf))
    ok = bool(np.all(np.isfinite(a))) and (zero or rel_norm <= tol.rel_norm) and bool(
        np.all(diff <= atol + tol.rtol * np.abs(e)))
    return Comparison(max_abs, max_rel, rel_norm, ok, zero)

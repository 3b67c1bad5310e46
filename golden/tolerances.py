"""The one tolerance table, and the comparison every test and ``attn-parity check`` uses.

An array passes when both hold:
    ‖actual − expected‖₂ / ‖expected‖₂ ≤ rel_norm
    |actual − expected| ≤ atol + rtol · |expected|   elementwise
The bounds are the tightest the arithmetic allows on this machine's CPUs (see the README's
figures for the errors actually seen); loosening one needs a reason written beside it.

One widening, by rule rather than by case: the gradient of an array that was broadcast (a bias
of shape (Lk,) against weights (B, H, Lq, Lk), say) is a sum of ``terms`` = B·H·Lq partial
gradients. Its rounding error grows like √terms times the summands' scale while the sum itself
may cancel to a small number, so its elementwise ``atol`` is multiplied by √terms.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Tolerance:
    rel_norm: float
    rtol: float
    atol: float


TOLERANCES = {
    "float32": Tolerance(rel_norm=1e-6, rtol=1e-5, atol=1e-6),
    "float64": Tolerance(rel_norm=1e-12, rtol=1e-12, atol=1e-14),
}


@dataclass(frozen=True)
class Comparison:
    max_abs: float   # max |a − e|
    max_rel: float   # max |a − e| / max |e|: the error relative to the array's scale
    rel_norm: float  # ‖a − e‖₂ / ‖e‖₂
    ok: bool


def compare(actual, expected, dtype: str, terms: int = 1) -> Comparison:
    """Compare to the float64 expectation; ``terms`` = summands per element (see above)."""
    tol = TOLERANCES[dtype]
    atol = tol.atol * float(np.sqrt(terms))
    a, e = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        return Comparison(np.inf, np.inf, np.inf, False)
    diff = np.abs(a - e)
    max_abs = float(diff.max(initial=0.0))
    scale, norm = float(np.abs(e).max(initial=0.0)), float(np.linalg.norm(e))
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else np.inf)
    rel_norm = float(np.linalg.norm(a - e)) / norm if norm > 0 else (0.0 if max_abs == 0 else np.inf)
    ok = bool(np.all(np.isfinite(a))) and rel_norm <= tol.rel_norm and bool(
        np.all(diff <= atol + tol.rtol * np.abs(e)))
    return Comparison(max_abs, max_rel, rel_norm, ok)

"""The one tolerance table, and the comparison every test and ``attn-parity check`` uses.

An array passes when both hold:
    ‖actual − expected‖₂ / ‖expected‖₂ ≤ rel_norm
    |actual − expected| ≤ atol + rtol · |expected|   elementwise
The bounds are the tightest the arithmetic allows on this machine's CPUs (see docs/fixtures.md,
"Tolerances", for the errors actually seen); loosening one needs a reason written beside it.

Two rules widen the elementwise bound, the same for every case, and why:
- atol is relative to the array's scale, max(1, max |e|): an element near zero that is computed
  from operands of the array's scale carries their absolute rounding error, not its own.
- a gradient that sums ``terms`` partial gradients (a parameter's over every position, a
  broadcast bias's over B·H·Lq) has rounding error growing like √terms while the sum may cancel
  to a small number, so atol is also multiplied by √terms.
The relative error norm is not applied to an array that is zero in exact arithmetic by
structure, which the fixture says (meta "zero", golden.reference.ZERO_GRADS: the gradient of a
key-projection bias; softmax is unchanged by a constant added to a row): computed, it is rounding
noise, and it must satisfy |actual| ≤ atol·√terms elementwise. Every other array keeps the
relative-norm check whatever its size.

A third rule, ``compare_terms``, is for random inputs, where a sum may cancel anywhere (the
property tests, and the parameter gradients of ``attn-parity hf``'s layers, whose weights are
the user's and inputs drawn; fixtures and ``attn-parity check`` use ``compare``): an array that
fails ``compare`` passes if it meets the same table relative to the size of the terms it sums
instead of its own. Seen needing it: a Llama layer's key-bias gradient under RoPE (Σ over keys
of dL/dk, which cancels to zero without RoPE), float32, relative error norm 4.3e-6 against the
table's 4e-6, where its terms were 17 times its size (1 of 40 random checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Tolerance:
    rel_norm: float
    rtol: float
    atol: float


# The unit roundoff u = 2⁻ᵖ of a dtype with p bits of precision (the implicit bit included).
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24, "float64": 2.0**-53}
_BF16, _F16 = UNIT_ROUNDOFF["bfloat16"], UNIT_ROUNDOFF["float16"]

TOLERANCES = {  # (dtype, "value" for outputs | "weights" | "grad" for gradients)
    ("float32", "value"): Tolerance(rel_norm=1e-6, rtol=1e-5, atol=1e-6),
    # Gradients go through the softmax backward P ⊙ (g − Σ g ⊙ P), whose subtraction cancels,
    # and then through sums over positions; float32 gradients of the module cases reach a
    # relative error norm of 1.1e-6 (torch, multi_head_attention_dropout, W_key). Random
    # weights and inputs go further: over 400 seeds of tests/test_modules.py's torch<->JAX
    # gradient test (54,382 float32 gradients) the 99.9th percentile was 1.0e-6 and the largest
    # 2.4e-6 (W_key of self_attention; W_key's gradient Σ_j x_j ⊗ g_kj cancels by structure,
    # since Σ_j g_kj = 0 for the shift invariance that zeros the key bias's gradient), and 2e-6
    # failed 3 of those 4,800 test runs. Hence 4e-6.
    ("float32", "grad"): Tolerance(rel_norm=4e-6, rtol=1e-5, atol=1e-6),
    ("float32", "weights"): Tolerance(rel_norm=1e-6, rtol=1e-5, atol=1e-6),  # as values
    # float64: the largest seen is a relative error norm of 2.1e-15 (jax, sdpa_large_logits);
    # 1e-13 leaves room for other BLAS builds while still catching any float32 step.
    ("float64", "value"): Tolerance(rel_norm=1e-13, rtol=1e-13, atol=1e-14),
    ("float64", "grad"): Tolerance(rel_norm=1e-13, rtol=1e-13, atol=1e-14),
    ("float64", "weights"): Tolerance(rel_norm=1e-13, rtol=1e-13, atol=1e-14),
    # Low precision, in units of the unit roundoff u = 2⁻ᵖ for p bits of precision: bfloat16
    # u = 2⁻⁸, float16 u = 2⁻¹¹. Inputs and weights are exact on both grids, so this is the
    # arithmetic alone. Projections and the products with V run in the low dtype; the scores
    # and softmax in float32 (the weights are rounded once, to the low dtype, when applied).
    # Largest seen on this machine over golden/specification/cases.py's LOW cases, torch and JAX, as
    # (rel. error norm, elementwise c in |a − e| ≤ c·(max(1, max|e|)·√terms + |e|)):
    # bfloat16 values (0.85u, 0.92u), gradients (2.7u, 1.5u); float16 values (0.89u, 0.86u),
    # gradients (2.9u, 1.2u). One rounding of the weights and one of the product with V make
    # about 1u for values; the gradients chain three or four roundings.
    ("bfloat16", "value"): Tolerance(rel_norm=1.5 * _BF16, rtol=1.5 * _BF16, atol=1.5 * _BF16),
    # The weights are the float32 softmax of float32 scores, rounded once: seen 0.71u (bfloat16)
    # and 0.76u (float16), the extra from low-precision projections in the modules. A softmax
    # or scores kept in the low dtype give 1.3u and 1.9u there, and far more on large scores.
    # Rotary embeddings round q and k a second time (after the projection, after the rotation,
    # which itself runs in float32), and the scores carry both: gqa_low_precision_rope's
    # weights reach a relative error norm of 1.12u and an elementwise 1.48u (float16; bfloat16
    # 0.91u and 1.23u), torch and JAX alike. Hence 1.5u and 2u, from 1u.
    ("bfloat16", "weights"): Tolerance(rel_norm=1.5 * _BF16, rtol=2 * _BF16, atol=2 * _BF16),
    ("bfloat16", "grad"): Tolerance(rel_norm=4 * _BF16, rtol=2 * _BF16, atol=2 * _BF16),
    ("float16", "value"): Tolerance(rel_norm=1.5 * _F16, rtol=1.5 * _F16, atol=1.5 * _F16),
    ("float16", "weights"): Tolerance(rel_norm=1.5 * _F16, rtol=2 * _F16, atol=2 * _F16),
    ("float16", "grad"): Tolerance(rel_norm=4 * _F16, rtol=2 * _F16, atol=2 * _F16),
}


@dataclass(frozen=True)
class Comparison:
    """The errors of one array and the bounds they were held to, so that a report can print
    both (a verdict near its bound reads without the docs).

    The elementwise check holds each |aᵢ − eᵢ| to its own bound atol' + rtol·|eᵢ|, where
    atol' = atol·max(1, max|e|)·√terms (the table's atol after the two rules above); no single
    number bounds max|a − e|. ``abs_err`` and ``bound_abs`` are that check's deciding element:
    the i with the largest |aᵢ − eᵢ| / (atol' + rtol·|eᵢ|), its error and its bound, so the
    check passes exactly when abs_err ≤ bound_abs. ``bound_rel_norm`` is the bound rel_norm was
    held to (None where it does not apply: a zero-by-structure array, arrays of different
    shapes). ``rule`` names what decided: "table" (``compare``), "terms" (``compare_terms``'s
    bounds relative to the terms' size, expressed against ‖e‖ and eᵢ as above) or "profile"
    (``compare_to_plain``: bound_abs = k·max|b − e| + atol', bound_rel_norm =
    k·‖b − e‖/‖e‖ + rel_norm, both flat, so abs_err = max_abs)."""

    max_abs: float   # max |a − e|
    max_rel: float   # max |a − e| / max |e|: the error relative to the array's scale
    rel_norm: float  # ‖a − e‖₂ / ‖e‖₂
    ok: bool
    zero: bool = False  # e is zero by structure: judged by the absolute bound alone
    abs_err: float | None = None         # |aᵢ − eᵢ| at the elementwise check's deciding element
    bound_abs: float | None = None       # the bound that element was held to
    bound_rel_norm: float | None = None  # the bound rel_norm was held to; None: not applied
    rule: str = "table"                  # "table", "terms", "profile" or "recurrence"


def _deciding(diff, bound, within=False) -> tuple[float | None, float | None]:
    """(|aᵢ − eᵢ|, boundᵢ) at the element with the largest diffᵢ / boundᵢ (a non-finite
    difference first); (None, None) for an empty array. ``within``: every diffᵢ ≤ boundᵢ is
    known (so every diffᵢ is finite, and a ratio is NaN only for 0/0, which argmax picks
    first as it would the inf it stands for)."""
    if diff.size == 0:
        return None, None
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.divide(diff, bound, out=np.empty_like(diff))  # inf or NaN where diff is
        # not finite, or bound is 0
    if not within:
        ratio[~np.isfinite(diff) | np.isnan(ratio)] = np.inf
    i = np.unravel_index(int(np.argmax(ratio)), diff.shape)
    return float(diff[i]), float(bound[i])


def compare(actual, expected, dtype: str, kind: str = "value", terms: int = 1,
            zero: bool = False, table=None) -> Comparison:
    """Compare to the float64 expectation; ``terms`` = summands per element and ``zero`` = the
    array is zero in exact arithmetic (see above); ``table`` the rows held to (None:
    TOLERANCES; a recurrent mixer's fixture: RECURRENT_TOLERANCES)."""
    tol = (TOLERANCES if table is None else table)[dtype, kind]
    a, e = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        return Comparison(np.inf, np.inf, np.inf, False, zero)
    diff = np.subtract(a, e, out=np.empty_like(e))  # out=: an array at 0-d too
    np.abs(diff, out=diff)  # |a − e|, one array (these run over every gradient of a layer)
    max_abs = float(diff.max(initial=0.0))
    bound = np.abs(e, out=np.empty_like(e))
    scale, norm = float(bound.max(initial=0.0)), float(np.linalg.norm(e))
    atol = tol.atol * max(1.0, scale) * float(np.sqrt(terms))
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else np.inf)
    rel_norm = (float(np.linalg.norm(diff)) / norm if norm > 0  # ‖|a − e|‖ = ‖a − e‖
                else (0.0 if max_abs == 0 else np.inf))
    bound *= tol.rtol
    bound += atol  # atol + rtol·|e|
    within = bool(np.all(diff <= bound))
    ok = bool(np.all(np.isfinite(a))) and (zero or rel_norm <= tol.rel_norm) and within
    if within and diff.size:  # diff's own memory takes the ratios (no new array's pages)
        i = np.unravel_index(int(np.argmax(np.divide(diff, bound, out=diff))), diff.shape)
        abs_err, bound_abs = float(abs(a[i] - e[i])), float(bound[i])  # diff[i], again
    else:
        abs_err, bound_abs = _deciding(diff, bound, within)
    return Comparison(max_abs, max_rel, rel_norm, ok, zero, abs_err, bound_abs,
                      None if zero else tol.rel_norm, "table")


def compare_terms(actual, expected, terms_size, dtype: str, kind: str = "value",
                  terms: int = 1, zero: bool = False) -> Comparison:
    """``compare``, or failing it the same row's bounds relative to M = ``terms_size``, the size
    of the terms each element sums (M ≥ |expected|; golden.reference.sdpa_term_sizes):
        ‖a − e‖ ≤ rel_norm · ‖M‖ + tiny·√n,   |a − e| ≤ atol · max(1, max M)·√terms + rtol · M
    Why: ``compare``'s atol is relative to the array's scale because an element computed from
    operands of that scale carries their rounding; an array that cancels is computed from terms
    larger than itself and carries theirs. This loosens the table by ‖M‖/‖e‖, and only where
    it fails: the softmax backward of a saturated row, a saturated cap, sums over query rows,
    large logits' large operands, an output A V whose values cancel. Seen failing the table
    alone but within this (tests/test_properties.py's random cases, torch and JAX alike):
    float32 query and key gradients of max 6e-5 at 100× the relative-norm bound and one of
    max 2e-5 at 1.2× the elementwise bound, float16 ones of max 0.009 at 4×, bfloat16 ones of
    max 0.45 at 1.4×, and a bfloat16 output of two elements, max 0.32, at 10× (the weights'
    rounding, u relative, against values of opposite signs). The dtype's smallest normal
    number per element (tiny·√n) is added to the norm bound: float16 gradients below 6.1e-5
    are subnormal, their precision lost to the range."""
    c = compare(actual, expected, dtype, kind, terms=terms, zero=zero)
    if c.ok:
        return c
    tol = TOLERANCES[dtype, kind]
    a, e = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    m = np.asarray(terms_size, dtype=np.float64)
    atol = tol.atol * max(1.0, float(m.max(initial=0.0))) * float(np.sqrt(terms))
    floor = _SMALLEST_NORMAL[dtype] * float(np.sqrt(a.size))
    if not a.shape == e.shape == m.shape:
        return c
    bound = atol + tol.rtol * m
    norm_bound = tol.rel_norm * float(np.linalg.norm(m)) + floor
    ok = (bool(np.all(np.isfinite(a))) and float(np.linalg.norm(a - e)) <= norm_bound
          and bool(np.all(np.abs(a - e) <= bound)))
    abs_err, bound_abs = _deciding(np.abs(a - e), bound)
    norm = float(np.linalg.norm(e))  # the norm bound as a bound on rel_norm = ‖a − e‖/‖e‖
    bound_rel_norm = norm_bound / norm if norm > 0 else (0.0 if norm_bound == 0 else np.inf)
    return Comparison(c.max_abs, c.max_rel, c.rel_norm, ok, zero, abs_err, bound_abs,
                      bound_rel_norm, "terms")


_SMALLEST_NORMAL = {"bfloat16": 2.0**-126, "float16": 2.0**-14, "float32": 2.0**-126,
                    "float64": 2.0**-1022}

# ---- profiles: what users run on accelerators -------------------------------------------------
# On GPUs JAX's default float32 matmul takes TF32 operands (11 bits of precision), and on TPUs
# one bfloat16 pass (8 bits); PyTorch uses TF32 when torch.backends.cuda.matmul.allow_tf32 is
# set. Such a run cannot meet the float32 table, and no fixed bound says how far it may stray,
# because the error grows with the data. Kernel authors judge it against a plain implementation
# of the same precision on the same inputs: FlashAttention's tests assert
#     (out − out_ref).abs().max() ≤ 2 · (out_pt − out_ref).abs().max()
# ("FlashAttention's numerical error is at most twice the numerical error of a Pytorch
# implementation", Dao-AILab/flash-attention tests/test_flash_attn.py, outputs and gradients).
# We do the same with k = 2: two implementations that round the same operands the same way make
# errors of the same size whose signs and positions differ, so one may be the larger by chance;
# a factor 2 absorbs that, while the next precision down (bfloat16 under the tf32 profile: a unit
# roundoff 8× larger) or any real mistake does not fit. The plain implementation is the float64
# reference with every contraction's operands rounded to the profile's bits and its result to
# float32 (golden.reference.rounded_products). Its other steps stay float64, so the float32
# table's bound is added on top: an array passes when it meets the float32 table, or
#     max|a − e| ≤ k · max|b − e| + atol   and   ‖a − e‖/‖e‖ ≤ k · ‖b − e‖/‖e‖ + rel_norm
# with b the plain implementation's array and atol, rel_norm the float32 row's (atol scaled as
# in ``compare``). Profiles apply to float32 runs; the other dtypes keep the exact table.


@dataclass(frozen=True)
class Profile:
    name: str
    bits: int | None   # the matmul operands' bits of precision; None: the table alone
    k: float | None
    description: str


PROFILES = {
    "exact": Profile("exact", None, None, "the tolerance table, at every dtype"),
    "tf32": Profile("tf32", 11, 2.0, "float32 runs with TF32 matmul operands (GPUs: JAX's "
                    "default precision, torch allow_tf32): error at most 2x a plain TF32 "
                    "implementation's"),
    "bf16": Profile("bf16", 8, 2.0, "float32 runs with bfloat16 matmul operands (TPUs' default "
                    "precision): error at most 2x a plain bfloat16-operand implementation's"),
}


def profile(name) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"profile should be one of {', '.join(PROFILES)}, got {name!r}")
    return PROFILES[name]


def compare_profile(actual, expected, baseline, dtype: str, kind: str = "value", terms: int = 1,
                    zero: bool = False, profile_name: str = "exact", table=None) -> Comparison:
    """``compare``, or under a tf32/bf16 profile at float32 the k-times-the-plain-implementation
    rule above (``baseline``: the plain implementation's array); ``table`` as ``compare``."""
    prof = profile(profile_name)
    if prof.bits is None or dtype != "float32" or baseline is None:
        return compare(actual, expected, dtype, kind, terms, zero, table)
    return compare_to_plain(actual, expected, baseline, dtype, kind, terms, zero, k=prof.k,
                            table=table)


def compare_to_plain(actual, expected, baseline, dtype: str, kind: str = "value",
                     terms: int = 1, zero: bool = False, k: float = 2.0,
                     table=None) -> Comparison:
    """``compare``, or failing it the k-times-the-plain-implementation rule above: ``baseline``
    is a plain implementation's array on the same inputs at the same dtype (the tf32/bf16
    profiles' emulation, or in a test the framework's own built-in module in float32)."""
    exact = compare(actual, expected, dtype, kind, terms, zero, table)
    if exact.ok:
        return exact
    plain = compare(baseline, expected, dtype, kind, terms, zero, table)
    tol = (TOLERANCES if table is None else table)[dtype, kind]
    e = np.asarray(expected, dtype=np.float64)
    atol = tol.atol * max(1.0, float(np.abs(e).max(initial=0.0))) * float(np.sqrt(terms))
    bound_abs = k * plain.max_abs + atol
    bound_rel_norm = None if zero else k * plain.rel_norm + tol.rel_norm
    ok = (bool(np.all(np.isfinite(np.asarray(actual, dtype=np.float64))))
          and exact.max_abs <= bound_abs and (zero or exact.rel_norm <= bound_rel_norm))
    return Comparison(exact.max_abs, exact.max_rel, exact.rel_norm, ok, zero, exact.max_abs,
                      bound_abs, bound_rel_norm, "profile")


# ---- Gated DeltaNet (issue 43): a recurrence's error against the float64 reference ---------
# The delta rule carries its state S over every token, so its output's error may grow with the
# length L: the bound on the relative error norm ‖y − e‖/‖e‖ of a module's output is
# u · (a + c·√L), u the dtype's unit roundoff, (a, c) below; elementwise, max|y − e| ≤ 4 times
# that bound times max|e|. Seen (jax_attn.GatedDeltaNet, CPU, 30 seeds, d_in 16, Hk 2, Hv 4,
# Dk = Dv = 8, K 4, weights 0.3·N(0, 1) on the dtype's grid; largest over seeds, in u, at
# L = 64, 256, 1024): float32 "chunked" relative error norm 16.2, 15.7, 12.1 (largest element
# 44, 59, 48), "recurrent" 9.0, 6.1, 6.6 (28, 18, 37); bfloat16 (both) 3.2, 2.0, 1.7 (9.6,
# 5.4, 7.7). With these decays (e^g ≈ 0.2 to 0.7) the state forgets, so the error does not grow
# over this range; the √L term is there for slower decays, whose errors accumulate. The
# chunked form's float32 error is the UT system's triangular solve (its entries β k·k e^{Γi−Γj}
# up to 2). Bounds at L = 64, 256, 1024: float32 28, 36, 52 u; bfloat16 5, 7, 11 u.
DELTA_RULE_BOUNDS = {"float32": (20.0, 1.0), "bfloat16": (3.0, 0.25)}


def delta_rule_bound(dtype: str, length: int) -> float:
    """The bound on the relative error norm of a Gated DeltaNet output of ``length`` tokens at
    ``dtype`` against the float64 reference (DELTA_RULE_BOUNDS)."""
    a, c = DELTA_RULE_BOUNDS[dtype]
    return UNIT_ROUNDOFF[dtype] * (a + c * float(np.sqrt(length)))


def compare_recurrence(actual, expected, dtype: str, length: int) -> Comparison:
    """A recurrent mixer's output of ``length`` tokens against the float64 reference: at
    float32 and bfloat16 the relative error norm within ``delta_rule_bound(dtype, length)`` and
    every element within 4 times that bound times max|e| (the rule above); at float64 the
    table's values (``compare``). ``rule`` "recurrence"."""
    if dtype not in DELTA_RULE_BOUNDS:
        return compare(actual, expected, dtype)
    bound = delta_rule_bound(dtype, length)
    errors = _errors(actual, expected)
    if errors is None:
        return Comparison(np.inf, np.inf, np.inf, False)
    finite, scale, max_abs, max_rel, rel_norm = errors
    bound_abs = 4 * bound * scale
    ok = finite and rel_norm <= bound and max_abs <= bound_abs
    return Comparison(max_abs, max_rel, rel_norm, ok, False, max_abs, bound_abs, bound,
                      "recurrence")


def _errors(actual, expected):
    """(a all finite, max|e|, max|a − e|, that / max|e|, ‖a − e‖/‖e‖), each ratio 0 for a
    zero error over a zero e, else inf there; None where the shapes differ."""
    a, e = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        return None
    diff = np.abs(a - e)
    scale, norm = float(np.abs(e).max(initial=0.0)), float(np.linalg.norm(e))
    max_abs = float(diff.max(initial=0.0))
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else np.inf)
    rel_norm = (float(np.linalg.norm(diff)) / norm if norm > 0
                else (0.0 if max_abs == 0 else np.inf))
    return bool(np.all(np.isfinite(a))), scale, max_abs, max_rel, rel_norm


# The recurrent mixers' fixtures (golden.specification.recurrent: Gated DeltaNet, Kimi Delta
# Attention, lightning attention; golden.harness.check.compare_all holds them to these rows).
# Their outputs carry a state over every token, as above; their parameters' gradients sum over
# every token and the decay's (A_log, dt_bias) cancel: Σ|terms| / |Σ terms| per head is 7 to 75
# on gated_delta_net_grouped_chunks (B 2, L 70). Seen (torch_attn and jax_attn GatedDeltaNet,
# the default "chunked" core at L > 1, on the three gated_delta_net_* fixtures, in u): float32
# outputs a relative error norm of 15.5 (jax; torch 10.5), the elementwise c of
# |a − e| ≤ c·(max(1, max|e|)·√terms + |e|) 37; gradients 606 (jax, dt_bias; torch 167, the
# largest uncancelled conv_value at 108), elementwise 135 (x); float64 outputs 18.8 and 49,
# gradients 1090 (jax, dt_bias: 1.2e-13, against the terms' size 36) and 186. Hence float32
# outputs 2e-6 = 34u (delta_rule_bound at L = 70 is 28u) elementwise 8e-6 (4 times, as above),
# gradients 6e-5 = 1000u elementwise 2e-5 = 335u; float64 outputs as TOLERANCES, gradients
# 2e-13 (1800u). KDA and lightning attention: the same rows until their twins are measured.
# float64 outputs elementwise: atol 2e-13 (1800u), not the table's 1e-14, because the chunked
# form's triangular solve (A unit lower triangular, entries β k·k e^{…} up to 1 over 64 tokens)
# has a heavy tail: torch_attn's KDA module, "chunked" (64) against "recurrent", L 70, 300
# seeds each of tests/test_linear_mixers_torch.py's two KDA configurations: the largest error
# relative to max|e| 32u median, 210-220u at the 99th percentile, 489u at most (a CI draw, seed
# 1787830214, failed the table's row at 470u); its relative error norm at most 85u, within
# the table's 1e-13 (900u).
RECURRENT_TOLERANCES = {
    ("float32", "value"): Tolerance(rel_norm=2e-6, rtol=8e-6, atol=8e-6),
    ("float32", "grad"): Tolerance(rel_norm=6e-5, rtol=2e-5, atol=2e-5),
    ("float64", "value"): Tolerance(rel_norm=1e-13, rtol=1e-13, atol=2e-13),
    ("float64", "grad"): Tolerance(rel_norm=2e-13, rtol=1e-13, atol=1e-14),
}


# ---- HF's own linear-attention modules (issue 43): the float32 floor of their recurrence -----
# transformers computes the delta rule and the gated norm in float32 even in a float64 model
# (torch_chunk_gated_delta_rule casts to float32), so HF's module is judged against the float64
# reference by the floor its float32 steps reach, relative (max error / max |e|), growing with L
# (tests/test_hf_import_linear.py, golden.verifier.linear).

def delta_float32(length: int) -> float:
    """HF's float32 delta rule against float64, relative (max error / max output), measured
    over 12 seeds each (AMD EPYC, AVX-512; qwen3_next / olmo_hybrid tiny models): max 2.4e-7 /
    4.5e-7 at L = 9, 2.6e-6 / 1.0e-6 at L = 100 (3.2e-6 seen once), 2.7e-6 / 2.3e-6 at L = 300.
    A recurrence's float32 error accumulates over the tokens the decay has not yet forgotten,
    so the bound grows with L: 1.5e-6 · (1 + √(L/8)), about twice the largest seen at L = 100.
    Lightning attention (MiniMax) is held to it too."""
    return 1.5e-6 * (1 + (length / 8) ** 0.5)


def kda_float32(length: int) -> float:
    """The same for HF's Kimi Delta Attention (chunk_kimi_delta_attention in float32, its
    decay per key channel taken as e^{G_i − G_j} over the chunk): measured at L = 100 over 31
    seeds each of kimi_linear / glm5_next_text / bailing_hybrid, median 1.6e-6 / 2.5e-6 /
    2.6e-6, max 6.9e-6 / 1.08e-5 / 8.9e-6 (delta_float32(100) = 6.8e-6 failed about one draw
    in 25); at L = 9 max 1.5e-6 / 7.9e-7 / 1.6e-6. 5e-6 · (1 + √(L/8)): twice the largest
    seen at L = 100, six times at L = 9."""
    return 5e-6 * (1 + (length / 8) ** 0.5)


# A gradient runs the recurrence twice (forward, then back in reverse time): HF's input
# gradient is held to this many times its output's floor (tests/test_hf_import_linear.py's
# gradients, every family, both twins at float64 against HF's module).
HF_GRADIENT_FACTOR = 10.0


def hf_recurrence_floor(variant: str, length: int, kind: str = "value") -> float:
    """HF's float32 floor for a linear-attention layer of ``variant`` on ``length`` tokens:
    kda_float32 for Kimi Delta Attention, delta_float32 otherwise; times HF_GRADIENT_FACTOR
    for a gradient (``kind`` "grad")."""
    floor = (kda_float32 if variant == "kimi_delta_attention" else delta_float32)(length)
    return floor * (HF_GRADIENT_FACTOR if kind == "grad" else 1.0)


def compare_to_floor(actual, expected, floor: float) -> Comparison:
    """max|a − e| ≤ ``floor`` · max|e| (hf_recurrence_floor's relative measure), rule
    "recurrence"; no bound on the relative error norm (None)."""
    errors = _errors(actual, expected)
    if errors is None:
        return Comparison(np.inf, np.inf, np.inf, False)
    finite, scale, max_abs, max_rel, rel_norm = errors
    bound_abs = floor * scale
    return Comparison(max_abs, max_rel, rel_norm, finite and max_abs <= bound_abs, False,
                      max_abs, bound_abs, None, "recurrence")


def mixer_input_terms(params, d_in, length) -> int:
    """The summands of one element of a recurrent mixer's input gradient (``compare``'s
    ``terms``): every input projection's output (each (d_in, ·) matrix of the neutral layout)
    at each of the ``length`` tokens that read the element through the causal convolution and
    the recurrence. Counted as one term, the float64 elementwise bound failed 3 of 200 seeds
    of the JAX module test (seeds 63, 135 and 149: 3.1e-13, 1.5e-13 and 2.2e-12 against
    2.9e-13, 1.1e-13 and 6.0e-13; the relative error norm below 3e-14 against 1e-13), and the
    verifier's torch row of a tiny Kimi Linear checkpoint once (1.0e-13 against 3.6e-14)."""
    width = sum(int(np.shape(w)[-1]) for w in params.values()
                if np.ndim(w) == 2 and np.shape(w)[0] == d_in)
    return length * width


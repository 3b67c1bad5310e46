"""Every rule of ``golden.specification.tolerances.compare``, one at a time, on arrays made by hand,
and the table's units. (float32 bounds: rel_norm 1e-6, rtol 1e-5, atol 1e-6 for values.)"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from golden.specification.tolerances import TOLERANCES, UNIT_ROUNDOFF, compare, compare_terms


def test_identical_arrays_pass_with_no_error():
    e = np.linspace(-2, 3, 12)
    c = compare(e.copy(), e, "float32")
    assert c.ok and c.max_abs == 0 and c.rel_norm == 0 and c.max_rel == 0


def test_another_shape_fails():
    c = compare(np.ones((3, 4)), np.ones((4, 3)), "float64")
    assert not c.ok and c.max_abs == np.inf


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_element_fails(bad):
    e = np.ones(5)
    a = e.copy()
    a[2] = bad
    assert not compare(a, e, "float32").ok


def test_the_relative_norm_bounds_a_spread_error():
    # Every element 9e-6 off: within atol + rtol·|e| = 1.1e-5, but ‖a − e‖/‖e‖ = 9e-6 > 1e-6.
    e = np.ones(1000)
    assert not compare(e * (1 + 9e-6), e, "float32").ok
    assert compare(e * (1 + 9e-7), e, "float32").ok


def test_the_elementwise_bound_catches_one_bad_element():
    # One element 5e-5 off among 10⁴: the norm sees 5e-7 (< 1e-6), the element bound 1.1e-5.
    e = np.ones(10_000)
    a = e.copy()
    a[17] += 5e-5
    c = compare(a, e, "float32")
    assert c.rel_norm < TOLERANCES["float32", "value"].rel_norm and not c.ok
    a[17] = 1 + 5e-6
    assert compare(a, e, "float32").ok


def test_atol_is_relative_to_the_arrays_scale():
    # Near zero, an element computed from operands of scale 1000 carries their absolute error.
    assert compare([1000.0, 5e-4], [1000.0, 0.0], "float32").ok  # atol = 1e-6 · 1000
    assert not compare([1.0, 5e-4], [1.0, 0.0], "float32").ok     # atol = 1e-6 · 1


def test_atol_grows_with_the_square_root_of_the_terms_summed():
    e = np.concatenate([np.ones(100), [0.0]])
    a = e.copy()
    a[-1] = 3e-6  # rel. norm 3e-7 passes; the element needs atol ≥ 3e-6
    assert not compare(a, e, "float32", "grad").ok
    assert compare(a, e, "float32", "grad", terms=16).ok  # atol = 1e-6 · √16


def test_an_array_zero_by_structure_is_judged_by_the_absolute_bound():
    # A key-bias gradient: the reference computes rounding noise, an implementation other noise.
    e = np.array([3e-17, -1e-16, 2e-17])
    a = np.array([5e-7, -8e-7, 1e-7])
    assert compare(a, e, "float32", "grad", zero=True).ok
    assert not compare(a, e, "float32", "grad").ok  # not declared zero: the norm applies
    assert not compare(a * 10, e, "float32", "grad", zero=True).ok  # |a| > atol


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_gradient_replaced_by_zeros_fails_however_small(dtype):
    # The old rule skipped the relative norm below atol·√terms·√size; zeros must fail now.
    rng = np.random.default_rng(3)
    for magnitude in (1e-6, 1e-3, 0.05):
        e = magnitude * rng.standard_normal((3, 14))
        assert not compare(np.zeros_like(e), e, dtype, "grad", terms=14).ok, magnitude


def test_a_sparse_gradient_five_percent_off_fails_in_bfloat16():
    e = np.zeros(200)
    e[[3, 50, 120]] = [0.02, -0.01, 0.015]
    assert not compare(e * 1.05, e, "bfloat16", "grad", terms=14).ok
    assert compare(e * (1 + 2**-9), e, "bfloat16", "grad", terms=14).ok


@pytest.mark.parametrize("dtype, finfo", [("bfloat16", ml_dtypes.finfo(ml_dtypes.bfloat16)),
                                          ("float16", np.finfo(np.float16)),
                                          ("float32", np.finfo(np.float32)),
                                          ("float64", np.finfo(np.float64))])
def test_the_unit_roundoff_is_half_the_machine_epsilon(dtype, finfo):
    assert UNIT_ROUNDOFF[dtype] == float(finfo.eps) / 2


def test_the_table_covers_every_dtype_and_kind():
    kinds = {"value", "weights", "grad"}
    assert set(TOLERANCES) == {(d, k) for d in UNIT_ROUNDOFF for k in kinds}
    for (dtype, _), tol in TOLERANCES.items():
        assert 0 < tol.rel_norm and 0 < tol.atol and 0 <= tol.rtol, dtype


def test_compare_terms_judges_a_cancelled_sum_by_its_terms():
    # e = 1000 − 999.99 per element: float32 terms of size 1e3 carry ~6e-5 absolute error each,
    # far beyond the table for an array of size 0.01, and within it relative to the terms.
    terms = np.full(100, 1000.0)
    e = np.full(100, 0.01)
    a = e + 3e-5 * np.cos(np.arange(100))  # the rounding of the terms, not of the result
    assert not compare(a, e, "float32").ok
    assert compare_terms(a, e, terms, "float32").ok
    # an error beyond the terms' own rounding fails both
    assert not compare_terms(e + 2e-2, e, terms, "float32").ok
    # an array that passes compare passes compare_terms unchanged, and shapes must agree
    assert compare_terms(e, e, terms, "float32").ok
    assert not compare_terms(a, e, terms[:50], "float32").ok


def test_sdpa_term_sizes_bound_the_reference_arrays():
    # M ≥ |array| elementwise for the output and every gradient (the definition's premise).
    from golden import reference
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 5, 4)) for _ in range(3))
    bias = rng.standard_normal((3, 5, 5))
    out, _, saved = reference.sdpa_forward(q, k, v, None, bias, is_causal=True, softcap=2.0)
    d_out, d_w = rng.standard_normal(out.shape), rng.standard_normal((2, 3, 5, 5))
    grads = reference.sdpa_backward(saved, d_out, d_w)
    sizes = reference.sdpa_term_sizes(saved, d_out, d_w)
    assert set(sizes) == {"output", "query", "key", "value", "bias"}
    for name, x in dict(grads, output=out).items():
        assert np.all(sizes[name] >= np.abs(x) * (1 - 1e-12)), name


def test_parameter_term_sizes_bound_a_module_gradients_and_hold_them_by_terms():
    # golden.reference.parameter_term_sizes: M ≥ |gradient| for every projection's weight and
    # bias (its premise), the key bias's terms far larger than its sum under RoPE (the
    # cancellation that needs it), and a fixture carrying them held to compare_terms by
    # compare_all: rounding relative to M passes, a wrong gradient still fails.
    from dataclasses import replace

    import golden
    from golden import reference
    from golden.harness.check import compare_all

    f = golden.load("gqa_rope_half")
    forward, backward = reference.VARIANTS[f.variant]
    out, weights, saved = forward(f.config, f.inputs, f.params)
    with reference.parameter_term_sizes() as sizes:
        grads = backward(saved, f.cotangents["output"], f.cotangents["weights"])
    assert {n for n in sizes if n in f.params} == {n for n in f.params if n.startswith(("W_", "b_"))}
    for n, m in sizes.items():
        assert np.all(m >= np.abs(grads[n]) * (1 - 1e-12)), n
    key = grads["b_key"]
    assert np.linalg.norm(sizes["b_key"]) > 3 * np.linalg.norm(key)  # it cancels
    fixture = replace(f, term_sizes={n: m for n, m in sizes.items() if n in grads},
                      grads=grads)
    noise = np.random.default_rng(0).standard_normal(key.shape)
    near = key + 1e-6 * np.linalg.norm(sizes["b_key"]) / np.linalg.norm(noise) * noise
    result = {"output": out, "weights": weights, "grads": dict(grads, b_key=near)}
    assert not compare(near, key, "float32", "grad").ok  # beyond the table's own bound
    judged = compare_all(fixture, result, "float32")["grad b_key"]
    assert judged.ok and judged.rule == "terms"
    wrong = dict(result, grads=dict(grads, b_key=np.zeros_like(key)))
    assert not compare_all(fixture, wrong, "float32")["grad b_key"].ok

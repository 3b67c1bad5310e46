"""The attention core: hand-derived answers, the default scale, the reference's gradients against
finite differences, torch against JAX on fresh random inputs, twin signatures, dropout behaviour
(drawn dropout in depth: tests/test_dropout.py)."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

from golden import reference
from golden.specification.tolerances import compare
from golden.specification.validate import dtype_name
from tests.helpers import DTYPES, LOW_DTYPES, TWINS, fresh_rng

# Notebook 003's hand-made keys and values, (4, 3) each.
K003 = np.array([[10, 0, 0], [0, 10, 0], [0, 0, 10], [0, 0, 10]], dtype=np.float32)
V003 = np.array([[1, 0, 1], [10, 0, 2], [100, 5, 0], [1000, 6, 0]], dtype=np.float32)


def run(impl, *arrays, dtype="float64", **kw):
    """(output, weights) as float64 NumPy from the reference, torch or JAX."""
    with impl.float64(dtype == "float64"):
        args = [None if a is None else impl.array(a, dtype) for a in arrays]
        kw = {n: impl.array(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
        out, w = impl.sdpa(*args, return_weights=True, **kw)
        return impl.numpy(out), impl.numpy(w)


def test_one_hot_query_by_hand(impl):
    # q = (0, 10, 0) with scale 1/2: scores (0, 50, 0, 0), so the weights are e⁻⁵⁰/z and 1/z,
    # z = 1 + 3e⁻⁵⁰, and the output is their mix of V's rows (notebook 003 prints this case).
    q = np.array([[0, 10, 0]], dtype=np.float32)
    out, w = run(impl, q, K003, V003, scale=0.5)
    a = math.exp(-50)
    z = 1 + 3 * a
    np.testing.assert_allclose(w, [[a / z, 1 / z, a / z, a / z]], rtol=1e-14)
    np.testing.assert_allclose(out, [[(10 + 1101 * a) / z, 11 * a / z, (2 + a) / z]], rtol=1e-14)


def test_notebook_003_weights(impl):
    # Notebook 003, example 3, printed to 3 decimals (with its effective scale 1/2).
    q = np.array([[0, 10, 0], [0, 0, 10], [10, 10, 0]], dtype=np.float32)
    _, w = run(impl, q, K003, V003, scale=0.5)
    printed = [[0, 1, 0, 0], [0, 0, 0.5, 0.5], [0.5, 0.5, 0, 0]]
    np.testing.assert_array_equal(np.round(w, 3), printed)


def test_equal_keys_average_the_values(impl):
    rng, seed = fresh_rng()
    q, v = rng.standard_normal((3, 2)), rng.standard_normal((4, 5))
    k = np.tile(rng.standard_normal((1, 2)), (4, 1))
    out, w = run(impl, q, k, v)
    np.testing.assert_allclose(w, np.full((3, 4), 0.25), rtol=1e-15, err_msg=f"seed {seed}")
    np.testing.assert_allclose(out, np.tile(v.mean(0), (3, 1)), rtol=1e-13, err_msg=f"seed {seed}")


def test_causal_and_fully_masked_by_hand(impl):
    # Zero queries and keys: uniform over the allowed keys. Row 0 sees key 0, row 1 keys 0-1,
    # row 2 is masked out entirely and gives zeros, never NaN.
    q, k = np.zeros((3, 2)), np.zeros((3, 2))
    v = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    mask = np.array([[True], [True], [False]])
    out, w = run(impl, q, k, v, mask, is_causal=True)
    np.testing.assert_array_equal(w, [[1, 0, 0], [0.5, 0.5, 0], [0, 0, 0]])
    np.testing.assert_array_equal(out, [[1, 2], [2, 3], [0, 0]])


def test_dropout_keep_mask_by_hand(impl):
    # Uniform weights 1/4; keep keys 0 and 2 with rate 1/2, so they become 1/2 each.
    q, k, v = np.zeros((1, 2)), np.zeros((4, 2)), np.arange(8.0).reshape(4, 2)
    keep = np.array([[True, False, True, False]])
    out, w = run(impl, q, k, v, dropout_rate=0.5, dropout_mask=keep)
    np.testing.assert_array_equal(w, [[0.5, 0, 0.5, 0]])
    np.testing.assert_array_equal(out, [[2, 3]])


def _loss(q, k, v, bias, mask, keep, d_out, d_w):
    out, w = reference.scaled_dot_product_attention(
        q, k, v, mask, bias, is_causal=True, scale=0.7, dropout_rate=0.2, dropout_mask=keep)
    return np.sum(out * d_out) + np.sum(w * d_w)


def test_reference_gradients_match_finite_differences():
    rng, seed = fresh_rng()
    q, k, v = (rng.standard_normal(s) for s in [(2, 3, 4), (2, 5, 4), (2, 5, 3)])
    bias = rng.standard_normal((3, 5))
    mask = rng.random((2, 1, 5)) < 0.8
    keep = rng.random((2, 3, 5)) > 0.2
    d_out, d_w = rng.standard_normal((2, 3, 3)), rng.standard_normal((2, 3, 5))
    args = dict(q=q, k=k, v=v, bias=bias)
    _, _, saved = reference.sdpa_forward(q, k, v, mask, bias, is_causal=True, scale=0.7,
                                         dropout_rate=0.2, dropout_mask=keep)
    grads = reference.sdpa_backward(saved, d_out, d_w)
    h = 1e-6
    for name, key in [("q", "query"), ("k", "key"), ("v", "value"), ("bias", "bias")]:
        numeric = np.zeros_like(args[name])
        for idx in np.ndindex(args[name].shape):
            plus, minus = (dict(args) for _ in range(2))
            plus[name], minus[name] = args[name].copy(), args[name].copy()
            plus[name][idx] += h
            minus[name][idx] -= h
            numeric[idx] = (_loss(**plus, mask=mask, keep=keep, d_out=d_out, d_w=d_w)
                            - _loss(**minus, mask=mask, keep=keep, d_out=d_out, d_w=d_w)) / (2 * h)
        np.testing.assert_allclose(grads[key], numeric, rtol=1e-6, atol=1e-8,
                                   err_msg=f"{key}, seed {seed}")


def _random_case(rng, is_causal):
    q, k, v = (rng.standard_normal(s) for s in [(2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 6)])
    mask = rng.random((2, 1, 5, 7)) < 0.7
    bias = rng.standard_normal((3, 5, 7))
    keep = rng.random((2, 3, 5, 7)) > 0.3
    return (q, k, v, mask, bias), dict(is_causal=is_causal, dropout_rate=0.3, dropout_mask=keep)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_and_jax_agree_on_fresh_inputs(dtype, is_causal):
    rng, seed = fresh_rng()
    arrays, kw = _random_case(rng, is_causal)
    arrays = [a.astype(dtype) if a.dtype.kind == "f" else a for a in arrays]
    ref = reference.scaled_dot_product_attention(*arrays, **kw)
    t, j = (run(TWINS[name], *arrays, dtype=dtype, **kw) for name in ("torch", "jax"))
    for a, b, r, what in [(t[0], j[0], ref[0], "output"), (t[1], j[1], ref[1], "weights")]:
        assert compare(a, r, dtype).ok and compare(b, r, dtype).ok, f"{what} seed {seed}"
        assert compare(a, b, dtype).ok, f"torch vs jax {what}, seed {seed}"


def test_default_scale_is_one_over_sqrt_key_width(impl):
    # Dk = 5 and Dv = 6: a default of 1/Dk or 1/√Dv would differ from 1/√Dk.
    rng, seed = fresh_rng()
    q, k, v = (rng.standard_normal(s) for s in [(2, 3, 4, 5), (2, 3, 7, 5), (2, 3, 7, 6)])
    default = run(impl, q, k, v, is_causal=True)
    for a, b in zip(default, run(impl, q, k, v, is_causal=True, scale=1 / math.sqrt(5))):
        np.testing.assert_array_equal(a, b, err_msg=f"{impl.name}, seed {seed}")
    unscaled = run(impl, q, k, v, is_causal=True, scale=1.0)
    assert not np.allclose(default[1], unscaled[1]), f"the scale had no effect, seed {seed}"


# The core's parameters, in order, in both frameworks (issue 9 added softcap … lengths).
CORE_PARAMETERS = ["query", "key", "value", "mask", "bias", "is_causal", "scale", "softcap",
                   "local_window_size", "attention_chunk_size", "query_offset",
                   "query_seq_lengths", "key_value_seq_lengths", "sinks", "dropout_rate",
                   "dropout_mask", "dropout_rng", "implementation", "return_weights"]


def test_twin_signatures():
    t = inspect.signature(TWINS["torch"].sdpa).parameters
    j = inspect.signature(TWINS["jax"].sdpa).parameters
    # every JAX dot's precision (PyTorch has no per-call equivalent); block_sizes in both, for
    # their block implementations (JAX's blockwise (Bq, Bk), torch's row_chunks (rows, None));
    # distance_bias, the bias of key − query distance that JAX's blockwise gathers per block,
    # and distance_query and distance_keys, the bias of a query row's product with a table of
    # vectors over distances that it forms per block (torch has no blockwise path: its modules
    # form the bias)
    jax_only = ["precision", "distance_bias", "distance_query", "distance_keys"]
    assert list(t) == CORE_PARAMETERS + ["block_sizes", "key_indices"]
    assert list(j) == CORE_PARAMETERS + ["block_sizes", "key_indices"] + jax_only
    assert list(t) == [n for n in j if n not in jax_only]
    for name, p in t.items():
        assert (p.kind, p.default) == (j[name].kind, j[name].default), name
    assert all(j[n].kind is inspect.Parameter.KEYWORD_ONLY for n in jax_only)
    assert list(t)[:5] == ["query", "key", "value", "mask", "bias"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in list(t.values())[5:])
    new = ["softcap", "local_window_size", "query_offset", "query_seq_lengths",
           "key_value_seq_lengths"]
    assert all(t[n].default is None for n in new)


def test_reference_signature_follows_the_twins():
    # The reference has no drawn dropout, one implementation, and always returns (output,
    # weights); the selection comes last, as in the twins.
    r = inspect.signature(reference.scaled_dot_product_attention).parameters
    assert list(r) == [n for n in CORE_PARAMETERS
                       if n not in ("dropout_rng", "implementation", "return_weights")] + [
                           "key_indices"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in list(r.values())[5:])


def test_drawn_dropout_keeps_rate_and_scales(twin):
    _, seed = fresh_rng()
    q, k, v = np.zeros((4, 64, 2)), np.zeros((4, 64, 2)), np.ones((4, 64, 3))
    args = [twin.array(a, "float32") for a in (q, k, v)]
    out, w = twin.sdpa(*args, dropout_rate=0.25, dropout_rng=twin.dropout_rng(seed),
                       return_weights=True)
    w = twin.numpy(w)
    kept = w > 0
    assert abs(kept.mean() - 0.75) < 0.02, f"seed {seed}"  # 6 standard deviations
    np.testing.assert_allclose(w[kept], (1 / 64) / 0.75, rtol=1e-6, err_msg=f"seed {seed}")


def test_dropout_depends_only_on_the_rng(twin):
    q, v = twin.array(np.zeros((8, 2)), "float32"), twin.array(np.ones((8, 3)), "float32")

    def weights(seed):
        return twin.numpy(twin.sdpa(q, q, v, dropout_rate=0.5, dropout_rng=twin.dropout_rng(seed),
                                    return_weights=True)[1])

    a, b, c = weights(1), weights(2), weights(1)
    assert not np.array_equal(a, b) and np.array_equal(a, c)


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_low_precision_keeps_dtype(twin, dtype):
    rng, seed = fresh_rng()
    q, k, v = (rng.standard_normal(s) for s in [(3, 5, 4), (3, 7, 4), (3, 7, 6)])
    args = [twin.array(a, dtype) for a in (q, k, v)]
    out, w = twin.sdpa(*args, return_weights=True)
    assert dtype_name(out.dtype) == dtype and dtype_name(w.dtype) == dtype
    ref, _ = reference.scaled_dot_product_attention(*(twin.numpy(a) for a in args))
    # bf16 keeps 8 mantissa bits (unit roundoff 2⁻⁸ ≈ 4e-3), fp16 11 bits (2⁻¹¹ ≈ 5e-4).
    tol = 2 ** -6 if dtype == "bfloat16" else 2 ** -9
    np.testing.assert_allclose(twin.numpy(out), ref, atol=tol * 4, rtol=tol,
                               err_msg=f"seed {seed}")

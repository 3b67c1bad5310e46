"""The recurrent mixers' low-precision check, shared by tests/test_delta_rule_torch.py,
tests/test_delta_rule_jax.py, tests/test_linear_mixers_torch.py and
tests/test_linear_mixers_jax.py: a module's float32 or bfloat16 output against the float64
reference at several lengths, within golden.specification.tolerances.delta_rule_bound (the
relative error norm) and 4 times that relative to max |e| elementwise (compare_recurrence's
rule, the numbers beside DELTA_RULE_BOUNDS)."""

from __future__ import annotations

import numpy as np

from golden.specification.tolerances import UNIT_ROUNDOFF, delta_rule_bound, mixer_input_terms

LENGTHS = (64, 256, 1024)


def assert_low_precision_within_bound(forward, reference, inputs, dtype, seed,
                                      lengths=LENGTHS):
    """For each L of ``lengths``: x = inputs(L) (on the dtype's grid, float64), y = forward(x)
    (the module's output at ``dtype`` as float64; ``forward`` checks its dtype) and e =
    reference(x): ‖y − e‖/‖e‖ ≤ delta_rule_bound(dtype, L) and max|y − e| ≤ 4 times that
    times max|e|; a failure names L, both errors, their bounds, the error in units of
    roundoff and the seed."""
    for length in lengths:
        x = inputs(length)
        y, expected = forward(x), reference(x)
        err = y - expected
        rel_norm = np.linalg.norm(err) / np.linalg.norm(expected)
        elem = np.abs(err).max() / np.abs(expected).max()
        bound = delta_rule_bound(dtype, length)
        assert rel_norm <= bound and elem <= 4 * bound, (
            f"L {length}: {rel_norm:.3g} (bound {bound:.3g}, "
            f"{rel_norm / UNIT_ROUNDOFF[dtype]:.3g} u), {elem:.3g} (bound {4 * bound:.3g}), "
            f"seed {seed}")


def torch_output(module, x, dtype):
    """A torch module's output on x (float64, on the grid of ``dtype``, a name) at ``dtype``,
    as float64; the output's dtype checked."""
    import torch

    low = getattr(torch, dtype)
    with torch.no_grad():
        y = module(torch.tensor(x).to(low))
    assert y.dtype == low
    return y.double().numpy()


def jax_output(module, x, dtype):
    """The same for a JAX module."""
    import jax.numpy as jnp

    y = module(jnp.asarray(x, dtype))
    assert y.dtype == jnp.dtype(dtype)
    return np.asarray(y.astype(jnp.float32), np.float64)


def x_terms(params, d_in, length):
    """golden.specification.tolerances.mixer_input_terms (its measurements there)."""
    return mixer_input_terms(params, d_in, length)

"""Run a golden fixture through JAX: outputs, weights and the gradients of the fixed loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from golden.variants import SDPA, call_args
from jax_attn.functional import scaled_dot_product_attention
from jax_attn.params import build, export_params


def run_fixture(fixture, dtype: str = "float32") -> dict:
    """Return {'output', 'weights', 'grads': {name: array}} as float64 NumPy arrays, and under
    'dtype' the dtype the output was computed in.

    float64 runs inside ``jax.enable_x64(True)``, so the setting does not leak to the caller.
    Modules are built from the fixture's parameters cast to ``dtype``, in training mode when the
    fixture holds a dropout keep-mask and in eval mode otherwise.
    """
    with jax.enable_x64(dtype == "float64"):
        arrays = {n: jnp.asarray(a, dtype=dtype if a.dtype.kind == "f" else a.dtype)
                  for n, a in fixture.inputs.items()}
        floats = {n: a for n, a in arrays.items() if jnp.issubdtype(a.dtype, jnp.floating)}
        d_out, d_w = (jnp.asarray(fixture.cotangents[n], dtype=dtype)
                      for n in ("output", "weights"))
        call, params, merge = _callable(fixture, dtype, train="dropout_mask" in arrays)

        def loss(floats, params):
            args, kwargs = call_args(fixture.variant, {**arrays, **floats})
            out, weights = call(params, *args, **kwargs)
            return jnp.sum(out * d_out) + jnp.sum(weights * d_w), (out, weights)

        (g_in, g_params), (out, weights) = jax.grad(loss, argnums=(0, 1), has_aux=True)(
            floats, params)
        grads = {n: _numpy(g) for n, g in g_in.items()}
        if merge is not None:  # a module whose weights are the gradients, exported
            grads.update({n: _numpy(g) for n, g in export_params(merge(g_params)).items()})
        return {"output": _numpy(out), "weights": _numpy(weights), "grads": grads,
                "dtype": str(out.dtype)}


def _numpy(a):
    return np.asarray(a).astype(np.float64)


def _callable(fixture, dtype, train):
    """(call(params, *args, **kwargs), params, merge) for the core or a built module."""
    if fixture.variant == SDPA:
        def call(params, *args, **kwargs):
            return scaled_dot_product_attention(*args, **kwargs, **fixture.config,
                                                return_weights=True)
        return call, {}, None
    params = {n: jnp.asarray(a, dtype=dtype) for n, a in fixture.params.items()}
    module = build(fixture.variant, fixture.config, params)
    module.train() if train else module.eval()
    graphdef, weights, rest = nnx.split(module, nnx.Param, ...)

    def call(weights, *args, **kwargs):
        return nnx.merge(graphdef, weights, rest)(*args, **kwargs, return_weights=True)

    return call, weights, lambda w: nnx.merge(graphdef, w, rest)

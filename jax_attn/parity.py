"""Run a golden fixture through JAX: outputs, weights and the gradients of the fixed loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn.functional import scaled_dot_product_attention


def run_fixture(fixture, dtype: str = "float32") -> dict:
    """Return {'output', 'weights', 'grads': {name: array}} as NumPy arrays.

    float64 runs inside ``jax.enable_x64(True)``, so the setting does not leak to the caller.
    """
    if fixture.variant != "scaled_dot_product_attention":
        raise ValueError(f"variant should be scaled_dot_product_attention, got {fixture.variant!r}")
    with jax.enable_x64(dtype == "float64"):
        arrays = {n: jnp.asarray(a, dtype=dtype if a.dtype.kind == "f" else a.dtype)
                  for n, a in fixture.inputs.items()}
        floats = {n: a for n, a in arrays.items() if a.dtype.kind == "f"}
        others = {n: a for n, a in arrays.items() if n not in floats}
        d_out, d_w = (jnp.asarray(fixture.cotangents[n], dtype=dtype) for n in ("output", "weights"))

        def loss(floats):
            out, weights = scaled_dot_product_attention(**floats, **others, **fixture.config,
                                                        return_weights=True)
            return jnp.sum(out * d_out) + jnp.sum(weights * d_w), (out, weights)

        grads, (out, weights) = jax.grad(loss, has_aux=True)(floats)
        return {"output": np.asarray(out), "weights": np.asarray(weights),
                "grads": {n: np.asarray(g) for n, g in grads.items()}}

"""Run a golden fixture through JAX: outputs, weights and the gradients of the fixed loss (the
contract is in ``golden.runners``).

The forward and backward of one fixture at one dtype are one compiled program: a module's
structure and the core's settings are static, every array traced.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_attn
from golden import variants


def run_fixture(fixture, dtype: str = "float32") -> dict:
    """float64 runs inside ``jax.enable_x64(True)``, so the setting does not leak to the
    caller."""
    with jax.enable_x64(dtype == "float64"):
        module = None
        if variants.get(fixture.variant).is_module:
            module = jax_attn.build(fixture.variant, fixture.config,
                                    {n: jnp.asarray(a, dtype=dtype)
                                     for n, a in fixture.params.items()})
            module.train() if "dropout_mask" in fixture.inputs else module.eval()
        return run_module(module, fixture, dtype)


def run_module(module, fixture, dtype: str = "float32") -> dict:
    """The runner's result for ``module``, of the fixture's variant in the mode and dtype it
    has (None: the core with the fixture's settings), on the fixture's inputs. float64 needs the
    caller's ``jax.enable_x64``."""
    arrays = {n: jnp.asarray(a, dtype=dtype if a.dtype.kind == "f" else a.dtype)
              for n, a in fixture.inputs.items()}
    floats = {n: a for n, a in arrays.items() if jnp.issubdtype(a.dtype, jnp.floating)}
    others = {n: a for n, a in arrays.items() if n not in floats}
    cot = {n: jnp.asarray(a, dtype=dtype) for n, a in fixture.cotangents.items()}
    graphdef, params, rest = (None, {}, {}) if module is None else nnx.split(module, nnx.Param,
                                                                             ...)
    out, weights, g_in, g_params = _value_and_grads(
        floats, others, params, rest, cot, variant=fixture.variant, graphdef=graphdef,
        config=_static(fixture.config))
    grads = {n: _numpy(g) for n, g in g_in.items()}
    if module is not None:  # a module holding the gradients in its weights' places, exported
        grads.update({n: _numpy(g) for n, g in
                      jax_attn.export_params(nnx.merge(graphdef, g_params, rest)).items()})
    return {"output": _numpy(out), "weights": _numpy(weights), "grads": grads,
            "dtype": str(out.dtype), "path": _path(weights.shape)}


def _static(config) -> tuple:
    """The fixture's config as a hashable jit argument: JSON gives a window pair as a list."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in config.items()))


def _path(weights_shape) -> str:
    """How the core batched its (batch, head) pairs at these weights: one vmap or chunks."""
    chunk = jax_attn.functional.heads_per_step(weights_shape[:-1] + (1,), weights_shape[-1:] + (1,))
    return "vmap" if chunk is None else "chunks"


@partial(jax.jit, static_argnames=("variant", "graphdef", "config"))
def _value_and_grads(floats, others, params, rest, cot, *, variant, graphdef, config):
    """Output, weights and the loss's gradients for the float inputs and the parameters."""
    def loss(floats, params):
        args, kwargs = variants.get(variant).call_args({**others, **floats})
        if graphdef is None:  # the core itself, its settings from the fixture's config
            out, weights = jax_attn.scaled_dot_product_attention(
                *args, **kwargs, **dict(config), return_weights=True)
        else:
            out, weights = nnx.merge(graphdef, params, rest)(*args, **kwargs,
                                                             return_weights=True)
        return jnp.sum(out * cot["output"]) + jnp.sum(weights * cot["weights"]), (out, weights)

    (g_in, g_params), (out, weights) = jax.grad(loss, argnums=(0, 1), has_aux=True)(floats,
                                                                                 params)
    return out, weights, g_in, g_params


def _numpy(a):
    return np.asarray(a).astype(np.float64)

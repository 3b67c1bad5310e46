"""Run a golden fixture through JAX: outputs, weights and the gradients of the fixed loss (the
contract is in ``golden.runners``).

The forward and backward of one fixture at one dtype are one compiled program: a module's
structure and the core's settings are static, every array traced.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

import jax_attn
from golden import implementations, variants
from golden.frameworks import JAX

# The core implementations a compiled program ran, recorded when it was traced: a later call
# of the same program (jit's cache) does not trace again, so it reads them here.
_TRACED: dict = {}


def run_fixture(fixture, dtype: str = "float32") -> dict:
    """float64 runs inside ``jax.enable_x64(True)``, so the setting does not leak to the
    caller."""
    with JAX.float64(dtype == "float64"):
        module = None
        if variants.get(fixture.variant).is_module:
            module = jax_attn.build(fixture.variant, fixture.config,
                                    JAX.leaves(fixture.params, dtype))
            module.train() if "dropout_mask" in fixture.inputs else module.eval()
        return run_module(module, fixture, dtype)


def run_module(module, fixture, dtype: str = "float32") -> dict:
    """The runner's result for ``module``, of the fixture's variant in the mode and dtype it
    has (None: the core with the fixture's settings), on the fixture's inputs. float64 needs the
    caller's ``jax.enable_x64``."""
    arrays = JAX.leaves(fixture.inputs, dtype)
    floats = {n: a for n, a in arrays.items() if jnp.issubdtype(a.dtype, jnp.floating)}
    others = {n: a for n, a in arrays.items() if n not in floats}
    cot = JAX.leaves(fixture.cotangents, dtype)
    graphdef, params, rest = (None, {}, {}) if module is None else nnx.split(module, nnx.Param,
                                                                             ...)
    static = dict(variant=fixture.variant, graphdef=graphdef, config=_static(fixture.config))
    with implementations.record() as ran:
        out, weights, g_in, g_params = _value_and_grads(floats, others, params, rest, cot,
                                                        **static)
    key = (fixture.variant, graphdef, static["config"], dtype,
           tuple((n, a.shape, str(a.dtype)) for n, a in arrays.items()))
    core = _TRACED.setdefault(key, implementations.names(ran)) if ran else _TRACED.get(key, "")
    grads = {n: JAX.numpy(g) for n, g in g_in.items()}
    if module is not None:  # a module holding the gradients in its weights' places, exported
        grads.update({n: JAX.numpy(g) for n, g in
                      jax_attn.export_params(nnx.merge(graphdef, g_params, rest)).items()})
    return {"output": JAX.numpy(out), "weights": JAX.numpy(weights), "grads": grads,
            "dtype": JAX.dtype_name(out), "core": core}


def _static(config) -> tuple:
    """The fixture's config as a hashable jit argument: JSON gives a window pair as a list, and
    a dict option (query_temperature, rope_parameters) is frozen (golden.variants.freeze)."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else variants.freeze(v))
                        for k, v in config.items()))


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
        return JAX.loss(cot, out, weights, None), (out, weights)

    (g_in, g_params), (out, weights) = jax.grad(loss, argnums=(0, 1), has_aux=True)(floats,
                                                                                 params)
    return out, weights, g_in, g_params

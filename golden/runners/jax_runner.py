"""Run a golden fixture through JAX: outputs, weights and the gradients of the fixed loss (the
contract is in ``golden.runners``).

The forward and backward of one fixture at one dtype are one compiled program: a module's
structure and the core's settings are static, every array traced. Where the commands' cache is
on (golden.runners.cache), ``run_fixture`` keeps that program traced on disk
(golden.runners.stored) with the module's parameters as arguments in their neutral layout, so a
second run neither builds the module nor traces it.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

import jax_attn
from golden.specification import implementations, variants
from golden.specification.indexer import INDEX_PARAMS
from golden.runners.adapt import refuse_pending
from golden.runners.frameworks import JAX
from golden.runners import cache, stored

# The core implementations a compiled program ran, recorded when it was traced: a later call
# of the same program (jit's cache) does not trace again, so it reads them here.
_TRACED: dict = {}


def run_fixture(fixture, dtype: str = "float32") -> dict:
    """float64 runs inside ``jax.enable_x64(True)``, so the setting does not leak to the
    caller."""
    refuse_pending(fixture, "jax_attn")
    with JAX.float64(dtype == "float64"):
        directory = cache.programs_directory()
        if directory is not None:
            return _run_stored(fixture, dtype, directory)
        module = None
        if variants.lookup(fixture.variant).is_module:
            module = jax_attn.build(fixture.variant, fixture.config,
                                    JAX.leaves(fixture.params, dtype))
            module.train() if "dropout_mask" in fixture.inputs else module.eval()
        return run_module(module, fixture, dtype)


def run_module(module, fixture, dtype: str = "float32") -> dict:
    """The runner's result for ``module``, of the fixture's variant in the mode and dtype it
    has (None: the core with the fixture's settings), on the fixture's inputs. float64 needs the
    caller's ``jax.enable_x64``."""
    arrays = JAX.leaves(fixture.inputs, dtype)
    floats, others = _split(arrays)
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
        grads.update({n: JAX.numpy(g) for n, g in _graded(
            jax_attn.export_params(nnx.merge(graphdef, g_params, rest))).items()})
    return _result(out, weights, grads, core)


def _graded(grads) -> dict:
    """The parameters' gradients less a learned indexer's (golden.specification.indexer's
    INDEX_PARAMS: the indexer runs without gradient, so the reference gives them none; the
    module's are zeros)."""
    return {n: g for n, g in grads.items() if n not in INDEX_PARAMS}


def _split(arrays) -> tuple[dict, dict]:
    """(the float inputs, differentiated; the others: lengths, offsets, boolean masks)."""
    floats = {n: a for n, a in arrays.items() if jnp.issubdtype(a.dtype, jnp.floating)}
    return floats, {n: a for n, a in arrays.items() if n not in floats}


def _result(out, weights, grads, core) -> dict:
    """The runner contract's dict (golden.runners): float64 NumPy copies; no "weights" where
    there are none (a recurrent mixer)."""
    result = {"output": JAX.numpy(out), "weights": JAX.numpy(weights), "grads": grads,
              "dtype": JAX.dtype_name(out), "core": core}
    return result if weights is not None else {k: v for k, v in result.items() if k != "weights"}


def _run_stored(fixture, dtype, directory) -> dict:
    """``run_fixture`` through the program stored in ``directory`` (traced and stored first
    when missing): the same computation, its parameters' gradients taken in the neutral
    layout's arrays (each the module's weight itself, or a slice of it stacked per head)."""
    floats, others = _split(JAX.leaves(fixture.inputs, dtype))
    is_module = variants.lookup(fixture.variant).is_module
    args = (floats, others, JAX.leaves(fixture.params, dtype) if is_module else {},
            JAX.leaves(fixture.cotangents, dtype))
    train = "dropout_mask" in fixture.inputs
    row = {"variant": fixture.variant, "config": fixture.config, "dtype": dtype,
           "train": train, "module": is_module}

    def export():
        program = _program(fixture, args[2], train) if is_module else _core_program(fixture)
        for attempt in range(2):
            with implementations.record() as ran:
                exported = jax.export.export(jax.jit(program))(*args)
            if ran or attempt:
                return exported, implementations.names(ran)
            # A module's compiled __call__ was traced earlier in this process (its cache hit):
            # the core it runs is recorded only when traced, so trace once more from scratch.
            jax.clear_caches()

    exported, core = stored.load_or_export(directory, row, args, export)
    out, weights, g_in, g_params = exported.call(*args)
    return _result(out, weights, {n: JAX.numpy(g) for n, g in {**g_in, **g_params}.items()},
                   core)


def _core_program(fixture):
    config = _static(fixture.config)

    def program(floats, others, params, cot):
        out, weights, g_in, _ = _forward_backward(floats, others, {}, {}, cot,
                                                 variant=fixture.variant, graphdef=None,
                                                 config=config)
        return out, weights, g_in, {}
    return program


def _program(fixture, params, train):
    """The fixture's module as a function of its neutral-layout parameters: the module built
    once for its structure, its weights replaced by the traced arguments."""
    module = jax_attn.build(fixture.variant, fixture.config, params)
    module.train() if train else module.eval()
    graphdef, state = nnx.split(module)
    config = _static(fixture.config)

    def program(floats, others, params, cot):
        traced = nnx.merge(graphdef, state, copy=True)  # its own Variables, set below
        variants.load_layers(traced, params, lambda lin, w: lin.kernel.set_value(w),
                             lambda lin, b: lin.bias.set_value(b),
                             lambda held, a: held.set_value(a), xp=jnp)
        structure, weights, rest = nnx.split(traced, nnx.Param, ...)
        out, attention, g_in, g_weights = _forward_backward(
            floats, others, weights, rest, cot, variant=fixture.variant, graphdef=structure,
            config=config)
        grads = variants.export_layers(
            nnx.merge(structure, g_weights, rest), lambda lin: lin.kernel.get_value(),
            lambda lin: None if lin.bias is None else lin.bias.get_value(),
            lambda held: held.get_value(), xp=jnp)
        return out, attention, g_in, _graded(grads)
    return program


def _static(config) -> tuple:
    """The fixture's config as a hashable jit argument: JSON gives a window pair as a list, and
    a dict option (query_temperature, rope_parameters) is frozen
    (golden.specification.variants.freeze)."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else variants.freeze(v))
                        for k, v in config.items()))


def _forward_backward(floats, others, params, rest, cot, *, variant, graphdef, config):
    """Output, weights and the loss's gradients for the float inputs and the parameters."""
    def loss(floats, params):
        args, kwargs = variants.lookup(variant).call_args({**others, **floats})
        if graphdef is None:  # the core itself, its settings from the fixture's config
            out, weights = jax_attn.scaled_dot_product_attention(
                *args, **kwargs, **dict(config), return_weights=True)
        elif variant in variants.VARIANTS:
            out, weights = nnx.merge(graphdef, params, rest)(*args, **kwargs,
                                                             return_weights=True)
        else:  # a recurrent mixer (golden.specification.recurrent): y alone, no weights
            out, weights = nnx.merge(graphdef, params, rest)(*args, **kwargs), None
        return JAX.loss(cot, out, weights, None), (out, weights)

    (g_in, g_params), (out, weights) = jax.grad(loss, argnums=(0, 1), has_aux=True)(floats,
                                                                                 params)
    return out, weights, g_in, g_params


# Compiled; a stored program traces _forward_backward itself, so that the core it runs is
# recorded on every export (a jit cached in this process would not trace it again).
_value_and_grads = partial(jax.jit, static_argnames=("variant", "graphdef", "config"))(
    _forward_backward)

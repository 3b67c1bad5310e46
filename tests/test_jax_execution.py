"""The JAX execution model: jit (identical to eager, compiled once per shape), the one-head core
vmapped over heads and batch, a caller's own jax.grad / jax.vmap through every module, no device
or host round trip, and the precision argument reaching every compiled dot."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_attn
from golden.variants import CLASS_NAMES, call_args
from jax_attn import functional, modules
from tests.conftest import fresh_rng
from tests.test_modules import CONFIGS, make, random_inputs

VARIANTS = list(CLASS_NAMES)


def _core_inputs(rng, dtype="float32"):
    """q, k, v, mask, bias as JAX arrays (float64 needs the caller's jax.enable_x64)."""
    q, k, v = (jnp.asarray(rng.standard_normal(s), dtype) for s in
               [(2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 6)])
    mask = jnp.asarray(rng.random((2, 1, 5, 7)) < 0.7)
    bias = jnp.asarray(rng.standard_normal((3, 5, 7)), dtype)
    return q, k, v, mask, bias


def _module_call(module, inputs):
    args, kwargs = call_args(module.variant, {n: jnp.asarray(a) for n, a in inputs.items()})
    return module(*args, **kwargs, return_weights=True)


# ---- jit --------------------------------------------------------------------------------------

def test_core_jit_equals_eager():
    rng, seed = fresh_rng()
    args = _core_inputs(rng)
    jitted = jax_attn.scaled_dot_product_attention(*args, is_causal=True, return_weights=True)
    with jax.disable_jit():
        eager = jax_attn.scaled_dot_product_attention(*args, is_causal=True, return_weights=True)
    for a, b in zip(jitted, eager):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"seed {seed}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_module_jit_equals_eager(variant):
    rng, seed = fresh_rng()
    module = make("jax", variant, CONFIGS[variant], seed)
    module.eval()
    inputs = random_inputs(variant, rng, "float32")
    jitted = _module_call(module, inputs)
    with jax.disable_jit():
        eager = _module_call(module, inputs)
    for a, b in zip(jitted, eager):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"seed {seed}")


def test_core_compiles_once_per_shape():
    rng, _ = fresh_rng()
    args = _core_inputs(rng)
    functional._attention.clear_cache()
    jax_attn.scaled_dot_product_attention(*args, is_causal=True)
    jax_attn.scaled_dot_product_attention(*(a + 0 for a in args[:3]), *args[3:], is_causal=True)
    assert functional._attention._cache_size() == 1
    jax_attn.scaled_dot_product_attention(*args, is_causal=False)  # a static argument changed
    assert functional._attention._cache_size() == 2


@pytest.mark.parametrize("variant", VARIANTS)
def test_module_compiles_once_per_shape(variant):
    rng, _ = fresh_rng()
    module = make("jax", variant, CONFIGS[variant])
    module.eval()
    modules._apply.clear_cache()
    _module_call(module, random_inputs(variant, rng, "float32"))
    _module_call(module, random_inputs(variant, rng, "float32"))  # new values, same shapes
    assert modules._apply._cache_size() == 1
    twin = make("jax", variant, CONFIGS[variant], seed=7)  # other weights, same structure
    twin.eval()
    _module_call(twin, random_inputs(variant, rng, "float32"))
    assert modules._apply._cache_size() == 1


# ---- vmap -------------------------------------------------------------------------------------

def test_vmapped_core_equals_python_loop():
    rng, seed = fresh_rng()
    with jax.enable_x64(True):
        q, k, v, mask, bias = _core_inputs(rng, "float64")
        out, w = jax_attn.scaled_dot_product_attention(q, k, v, mask, bias, is_causal=True,
                                                       return_weights=True)
        for b in range(2):
            for h in range(3):
                o1, w1 = jax_attn.scaled_dot_product_attention(
                    q[b, h], k[b, h], v[b, h], mask[b, 0], bias[h], is_causal=True,
                    return_weights=True)
                np.testing.assert_allclose(out[b, h], o1, rtol=1e-14, err_msg=f"seed {seed}")
                np.testing.assert_allclose(w[b, h], w1, rtol=1e-14, err_msg=f"seed {seed}")


@pytest.mark.parametrize("chunk", [1, 2, 4, 5])
def test_chunked_and_plain_vmap_agree(chunk):
    # CPU runs (batch, head) pairs in chunks; accelerators vmap them all at once.
    rng, seed = fresh_rng()
    q, k, v, mask, bias = _core_inputs(rng)
    keep = jnp.asarray(rng.random((2, 3, 1, 7)) < 0.8)
    kw = dict(scale=0.5, is_causal=True, dropout_rate=0.2, precision=jax.lax.Precision.HIGHEST,
              return_weights=True)
    plain = functional._attention(q, k, v, mask, bias, keep, None, chunk=None, **kw)
    chunked = functional._attention(q, k, v, mask, bias, keep, None, chunk=chunk, **kw)
    for a, b in zip(plain, chunked):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7,
                                   err_msg=f"seed {seed}")


def test_cpu_runs_chunks():
    assert functional.heads_per_step() == functional.CPU_HEADS_PER_STEP  # this machine: CPU
    rng, _ = fresh_rng()
    text = functional._attention.lower(
        *_core_inputs(rng), None, None, scale=0.5, is_causal=True, dropout_rate=0.0,
        precision=jax_attn.DEFAULT_PRECISION, return_weights=False,
        chunk=functional.heads_per_step()).as_text()
    assert "stablehlo.while" in text and "batching_dims = [0] x [0]" in text


def test_core_lowers_to_one_batched_program():
    # Without chunks (accelerators) the one-head core is vmapped over heads and batch at once.
    rng, _ = fresh_rng()
    args = _core_inputs(rng)
    text = functional._attention.lower(
        *args, None, None, scale=0.5, is_causal=True, dropout_rate=0.0,
        precision=jax_attn.DEFAULT_PRECISION, return_weights=True).as_text()
    assert len(re.findall(r"stablehlo\.dot_general", text)) == 2
    assert "batching_dims = [0, 1]" in text


@pytest.mark.parametrize("variant", VARIANTS)
def test_users_vmap_over_extra_axis(variant):
    rng, seed = fresh_rng()
    module = make("jax", variant, CONFIGS[variant], seed)
    module.eval()
    stacked = random_inputs(variant, rng, "float32", batch=(4, 2))  # (E, B, L, d)
    name = "x_q" if variant == "cross_attention" else "x"
    others = {n: jnp.asarray(a[0]) for n, a in stacked.items() if n != name}

    def one(x):
        args, kwargs = call_args(variant, {**others, name: x})
        return module(*args, **kwargs)

    batched = jax.vmap(one)(jnp.asarray(stacked[name]))
    for e in range(4):
        np.testing.assert_allclose(batched[e], one(jnp.asarray(stacked[name][e])), rtol=1e-6,
                                   atol=1e-6, err_msg=f"seed {seed}")


# ---- grad -------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_jax_grad_through_module(variant):
    rng, seed = fresh_rng()
    with jax.enable_x64(True):  # float64, so that a finite difference is a sharp check
        module = make("jax", variant, CONFIGS[variant], seed)
        module.eval()
        inputs = {n: jnp.asarray(a) for n, a in random_inputs(variant, rng, "float64").items()}
        name = "x_q" if variant == "cross_attention" else "x"

        def loss_x(x):
            args, kwargs = call_args(variant, {**inputs, name: x})
            return jnp.sum(module(*args, **kwargs) ** 2)

        g = jax.grad(loss_x)(inputs[name])
        h, d = 1e-5, jnp.asarray(rng.standard_normal(inputs[name].shape))
        fd = (loss_x(inputs[name] + h * d) - loss_x(inputs[name] - h * d)) / (2 * h)
        np.testing.assert_allclose(float(jnp.sum(g * d)), float(fd), rtol=1e-6,
                                   err_msg=f"seed {seed}")
        if variant != "simple_self_attention":
            args, kwargs = call_args(variant, inputs)
            grads = nnx.grad(lambda m: jnp.sum(m(*args, **kwargs) ** 2))(module)
            assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(grads))
            graphdef, _, rest = nnx.split(module, nnx.Param, ...)
            as_module = nnx.merge(graphdef, grads, rest)  # gradients in the module's places
            assert np.any(jax_attn.export_params(as_module)["W_query"] != 0)


# ---- devices, transfers, precision ------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_no_host_round_trip_and_device_kept(variant):
    module, args, kwargs = _eval_module_and_args(variant)
    module(*args, **kwargs)  # compile first: constants are moved once, at compile time
    with jax.transfer_guard("disallow"):
        out = module(*args, **kwargs)
    assert out.devices() == args[0].devices()


def _eval_module_and_args(variant):
    """A module in eval mode and fresh float32 arguments for it."""
    rng, _ = fresh_rng()
    module = make("jax", variant, CONFIGS[variant])
    module.eval()
    inputs = {n: jnp.asarray(a) for n, a in random_inputs(variant, rng, "float32").items()}
    return (module, *call_args(variant, inputs))


def _dots(text):
    return re.findall(r"stablehlo\.dot_general.*", text)


@pytest.mark.parametrize("precision, word", [(jax.lax.Precision.HIGHEST, "HIGHEST"),
                                             (jax.lax.Precision.HIGH, "HIGH")])
def test_precision_reaches_every_core_dot(precision, word):
    rng, _ = fresh_rng()
    args = _core_inputs(rng)
    text = functional._attention.lower(
        *args, None, None, scale=0.5, is_causal=False, dropout_rate=0.0, precision=precision,
        return_weights=False).as_text()
    dots = _dots(text)
    assert dots and all(f"precision = [{word}, {word}]" in d for d in dots), dots


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "simple_self_attention"])
def test_precision_reaches_every_module_dot(variant):
    module, args, kwargs = _eval_module_and_args(variant)
    text = jax.jit(lambda *a: module(*a, **kwargs)).lower(*args).as_text()
    dots = _dots(text)
    assert len(dots) >= 5  # three projections and the two dots of attention
    assert all("precision = [HIGHEST, HIGHEST]" in d for d in dots), dots

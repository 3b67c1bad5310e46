"""Flax NNX modules in training mode, the way Flax users compose them: dropout draws from the
module's stream under a caller's nnx.jit, an optax step, nnx.grad, nnx.vmap and eager calls, and
the stream's count advances by one key per call in each case; build draws no random weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from golden.specification.tolerances import compare
from golden.specification.variants import MODULES
from tests.helpers import (
    DROPOUT_MODULES,
    JAX,
    assert_directional_derivative,
    by_name,
    count_compiles,
    fresh_rng,
    main_input,
    random_inputs,
)


def _training(variant, seed):
    """A module of the variant with dropout 0.5 in training mode, and a fresh input x."""
    rng = np.random.default_rng(seed)
    module = JAX.make(variant.name, {**variant.sample, "dropout": 0.5}, seed)
    module.train()
    return module, JAX.array(random_inputs(variant, rng, "float32")[main_input(variant)])


def _count(module) -> int:
    return int(module.dropout_rngs.count[...])


@pytest.mark.parametrize("variant", by_name(DROPOUT_MODULES, share=True))
def test_eager_training_calls_advance_the_stream(variant):
    _, seed = fresh_rng()
    module, x = _training(variant, seed)
    before = _count(module)
    same_state = nnx.clone(module)
    a = module(x)
    assert _count(module) == before + 1, f"one key per call, seed {seed}"
    b = module(x)
    assert _count(module) == before + 2, f"one key per call, seed {seed}"
    assert not np.allclose(a, b), f"two calls drew the same dropout, seed {seed}"
    np.testing.assert_array_equal(a, same_state(x), err_msg=f"same stream state, seed {seed}")


@pytest.mark.parametrize("variant", by_name(DROPOUT_MODULES, share=True))
def test_training_under_callers_nnx_jit(variant):
    _, seed = fresh_rng()
    module, x = _training(variant, seed)

    @nnx.jit
    def forward(model, x):
        return model(x)

    before, same_state = _count(module), nnx.clone(module)
    a = forward(module, x)
    assert _count(module) == before + 1, f"the stream did not advance under nnx.jit, seed {seed}"
    with count_compiles() as compiled:
        b = forward(module, x)
    assert compiled == [], f"the second call compiled {compiled}"
    assert _count(module) == before + 2, f"seed {seed}"
    assert not np.allclose(a, b), f"two calls drew the same dropout, seed {seed}"
    np.testing.assert_allclose(a, same_state(x), rtol=1e-6, atol=1e-6,
                               err_msg=f"jitted and eager differ at one stream state, seed {seed}")


@pytest.mark.parametrize("variant", by_name(DROPOUT_MODULES, share=True))
def test_optax_training_steps(variant):
    _, seed = fresh_rng()
    model, x = _training(variant, seed)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def loss_fn(model):
        return jnp.mean(model(x) ** 2)

    @nnx.jit
    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    for i in range(3):
        before, params = _count(model), JAX.export(model)
        loss = step(model, optimizer, x)
        assert np.isfinite(float(loss)), f"step {i}, seed {seed}"
        assert _count(model) == before + 1, f"step {i}: the stream did not advance, seed {seed}"
        after = JAX.export(model)
        assert all(not np.array_equal(after[n], params[n]) for n in params), \
            f"step {i} left a parameter unchanged, seed {seed}"


@pytest.mark.parametrize("variant", by_name(DROPOUT_MODULES, share=True))
def test_nnx_grad_in_training_mode(variant):
    # The gradient is that of the function computed: the same keep-mask in forward and backward.
    rng, seed = fresh_rng()
    with jax.enable_x64(True):  # float64, so that a finite difference is a sharp check
        module, _ = _training(variant, seed)
        x = JAX.array(random_inputs(variant, rng, "float64")[main_input(variant)])
        state = nnx.clone(module)  # the stream before the call: every loss below draws alike

        def loss(model, x):
            return jnp.sum(model(x) ** 2)

        g_model, g_x = nnx.grad(loss, argnums=(0, 1))(module, x)
        assert _count(module) == _count(state) + 1, f"seed {seed}"
        assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(g_model))
        assert any(bool(jnp.any(leaf != 0)) for leaf in jax.tree.leaves(g_model)), f"seed {seed}"
        d = jnp.asarray(rng.standard_normal(x.shape))
        assert_directional_derivative(lambda y: loss(nnx.clone(state), y), x, d, g_x, seed)
        state.eval()
        assert loss(state, x) != loss(nnx.clone(module), x), f"no dropout, seed {seed}"


@pytest.mark.parametrize("variant", by_name(DROPOUT_MODULES, share=True))
def test_nnx_vmap_in_training_mode(variant):
    # The module is shared across the extra axis (in_axes None): one key for the whole call, so
    # each element gets the dropout of a call on it alone from the same stream state.
    rng, seed = fresh_rng()
    module, _ = _training(variant, seed)
    xs = JAX.array(random_inputs(variant, rng, "float32", batch=(4, 2))[main_input(variant)])
    state = nnx.clone(module)
    ys = nnx.vmap(lambda model, x: model(x), in_axes=(None, 0))(module, xs)  # (E, B, L, d)
    assert ys.shape[0] == 4
    assert _count(module) == _count(state) + 1, f"seed {seed}"
    for e in range(4):  # the same dropout; the batched products may round otherwise in float32,
        # so the table's float32 rule (a hand-set rtol 1e-6 failed on one seed: 9.6e-6 relative
        # at one element of 168, where the batched and the single product round apart)
        alone = nnx.clone(state)(xs[e])
        result = compare(np.asarray(ys[e]), np.asarray(alone), "float32")
        assert result.ok, f"element {e}, seed {seed}: {result}"
    state.eval()
    assert not np.allclose(ys[0], state(xs[0])), f"no dropout under nnx.vmap, seed {seed}"


@pytest.mark.parametrize("variant", by_name(DROPOUT_MODULES, share=True))
def test_build_seeds_the_dropout_stream(variant):
    _, seed = fresh_rng()
    module, x = _training(variant, seed)
    params, config = JAX.export(module), module.config

    def trained(rngs=None):
        built = JAX.lib.build(variant.name, config, params, rngs=rngs)
        built.train()
        return np.asarray(built(x))

    np.testing.assert_array_equal(trained(), trained(nnx.Rngs(0)),  # the documented default
                                  err_msg=f"seed {seed}")
    np.testing.assert_array_equal(trained(nnx.Rngs(seed)), trained(nnx.Rngs(seed)),
                                  err_msg=f"seed {seed}")
    assert not np.allclose(trained(nnx.Rngs(seed)), trained(nnx.Rngs(seed + 1))), f"seed {seed}"


@pytest.mark.parametrize("variant", by_name(MODULES, share=True))
def test_build_draws_no_random_weights(variant):
    # build constructs the structure abstractly (nnx.eval_shape), so a configuration of new
    # sizes compiles no initialiser, as constructing one does.
    rng, seed = fresh_rng()

    def random_params(config):
        return {n: rng.standard_normal(s).astype(np.float32)
                for n, s in variant.param_shapes(config).items()}

    JAX.build(variant.name, variant.sample, random_params(variant.sample))  # seeding the stream
    wider = {n: a * 3 if n.startswith("d_") else a for n, a in variant.sample.items()}
    params = random_params(wider)
    with count_compiles() as compiled:
        module = JAX.build(variant.name, wider, params)
    assert compiled == [], f"build compiled {compiled}"
    back = JAX.export(module)
    assert back.keys() == params.keys()
    assert all(np.array_equal(back[n], params[n]) for n in params), f"seed {seed}"
    if params:
        with count_compiles() as compiled:
            JAX.make(variant.name, {n: a * 5 if n.startswith("d_") else a
                                    for n, a in variant.sample.items()})
        assert compiled, "constructing compiled nothing: the counter does not see compilations"

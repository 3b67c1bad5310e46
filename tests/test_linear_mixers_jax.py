"""The JAX twins of Kimi Delta Attention and lightning attention (issue 43, jax_attn.recurrent
over jax_attn.delta_rule): each module against the float64 reference (golden.reference.
delta_rule) forward and gradients through nnx.grad, both implementations; "recurrent" against
"chunked" at the cores (the decay per key channel; lightning's blocks) with their custom VJPs,
strong decays included; the chunked backward's residuals O(L); float32 and bfloat16 errors
against the reference; prefill then decoding through the cache; jit; bad inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_attn
from golden.reference.delta_rule import MIXERS
from golden.specification import recurrent
from golden.specification.implementations import record
from golden.specification.tolerances import compare, delta_rule_bound
from jax_attn.recurrent import (
    DELTA_RULE_IMPLEMENTATIONS,
    LIGHTNING_IMPLEMENTATIONS,
    gated_delta_rule,
    lightning_rule,
)
from tests.helpers import fresh_rng, matrix
from tests.recurrent_checks import assert_low_precision_within_bound, jax_output, x_terms

KDA, LIGHTNING = "kimi_delta_attention", "lightning_attention"
IMPLEMENTATIONS = tuple(DELTA_RULE_IMPLEMENTATIONS)
assert IMPLEMENTATIONS == tuple(LIGHTNING_IMPLEMENTATIONS)
QUICK_LENGTHS = {(65, 16)}  # a padded last chunk after several whole ones
# (mixer, configuration over its sample): softplus and bounded_sigmoid, low- and full-rank.
CONFIGS = {
    "kda-bounded-lowrank": (KDA, dict(forget_gate="bounded_sigmoid", decay_lower_bound=-2.0)),
    "kda-softplus-fullrank": (KDA, dict(decay_rank=None, gate_rank=None)),
    "kda-softplus-lowrank": (KDA, {}),
    "kda-bounded-fullrank": (KDA, dict(forget_gate="bounded_sigmoid", decay_lower_bound=-5.0,
                                       decay_rank=None, gate_rank=None)),
    "lightning": (LIGHTNING, dict(block_size=3)),
}
QUICK_CONFIGS = ("kda-bounded-lowrank", "lightning")
# The quick suite (about 25 s on 2 shared cores, mostly compilation): both modules against the
# reference (chunked), the KDA core's chunked VJP, strong decays, the cache, residuals, inputs.


def _cases(names=CONFIGS, quick=QUICK_CONFIGS, implementations=IMPLEMENTATIONS):
    return [pytest.param(n, i, id=f"{n}-{i}",
                         marks=() if n in quick and i == implementations[-1] else matrix)
            for n in names for i in implementations]


def _config(name, **more):
    mixer, extra = CONFIGS[name]
    return mixer, {**recurrent.get(mixer).sample, **extra, **more}


def _params(rng, mixer, config, scale=0.5):
    shapes = recurrent.get(mixer).param_shapes(config)
    params = {n: rng.standard_normal(s) * scale for n, s in shapes.items()}
    if "slope" in params:  # decaying heads, as MiniMax's slopes (0, 1)
        params["slope"] = rng.uniform(0.05, 1.0, shapes["slope"])
    return params


def _padded(batch, length, pad):
    """A mask (B, L) whose last row is left-padded by ``pad`` tokens."""
    mask = np.ones((batch, length), bool)
    mask[-1, :pad] = False
    return mask


def _module_grads(module, x, mask, dy, **call):
    """(y, {"x" and every neutral parameter: gradient of Σ y ⊙ dy}) through nnx.grad."""
    def loss(m, xx):
        return jnp.sum(m(xx, mask, **call) * dy)
    grads, d_x = nnx.grad(loss, argnums=(0, 1))(module, x)
    held = jax_attn.export_params(nnx.merge(nnx.graphdef(module), grads))
    return module(x, mask, **call), {"x": np.asarray(d_x), **held}


@pytest.mark.parametrize("name, implementation", _cases())
def test_module_matches_reference_float64(name, implementation):
    # 7 tokens in chunks (blocks) of 3, the last padded, the second row left-padded by 2: the
    # output, the input's and every parameter's gradient at the float64 rows of the table.
    rng, seed = fresh_rng()
    mixer, config = _config(name)
    call = {"implementation": implementation}
    if mixer == KDA:
        call["chunk_size"] = 3
    with jax.enable_x64(True):
        params = _params(rng, mixer, config)
        x, mask = rng.standard_normal((2, 7, config["d_in"])), _padded(2, 7, 2)
        expected, _, saved = MIXERS[mixer][0](config, {"x": x, "mask": mask}, params)
        dy = rng.standard_normal(expected.shape)
        want = MIXERS[mixer][1](saved, dy)
        module = jax_attn.build(mixer, config, params)
        with record() as ran:
            y, grads = _module_grads(module, jnp.asarray(x), jnp.asarray(mask),
                                     jnp.asarray(dy), **call)
    assert ("jax", implementation) in ran and len(set(ran)) == 1, ran
    assert y.dtype == jnp.float64
    assert compare(y, expected, "float64").ok, seed
    assert set(grads) == set(want)
    for param, g in grads.items():
        terms = x_terms(params, config["d_in"], 7) if param == "x" else 2 * 7
        assert compare(g, want[param], "float64", "grad", terms=terms).ok, (param, seed)


def _core_inputs(rng, b, h, length, dk, dv, strong=False):
    """q, k L2-normalised (q scaled), v, g per key channel (B, H, L, Dk) (−softplus of a
    normal, or about −5 a token with ``strong``), β in (0, 1), a random S_0."""
    unit = rng.standard_normal((b, h, length, dk))
    q = unit / np.linalg.norm(unit, axis=-1, keepdims=True) * dk ** -0.5
    k = rng.standard_normal((b, h, length, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((b, h, length, dv))
    g = (-5 + 0.5 * rng.standard_normal((b, h, length, dk)) if strong
         else -np.log1p(np.exp(rng.standard_normal((b, h, length, dk)))))
    beta = rng.uniform(0, 1, (b, h, length))
    state = rng.standard_normal((b, h, dk, dv))
    return [jnp.asarray(a) for a in (q, k, v, g, beta, state)]


def _lightning_inputs(rng, b, h, length, dk, dv):
    q, k, v = (rng.standard_normal((b, h, length, d)) * 0.5 for d in (dk, dk, dv))
    slope = rng.uniform(0.01, 1.0, (h,))
    state = rng.standard_normal((b, h, dk, dv))
    return [jnp.asarray(a) for a in (q, k, v, slope, state)]


def _both(core, inputs, d_o, d_s, **sizes):
    """{implementation: (o, final, every input's gradient)} of Σ o ⊙ d_o + Σ S_L ⊙ d_s."""
    results = {}
    for name in IMPLEMENTATIONS:
        def loss(*a, name=name):
            o, final = core(*a[:-1], initial_state=a[-1], implementation=name, **sizes)
            return jnp.sum(o * d_o) + jnp.sum(final * d_s), (o, final)
        grads, outs = jax.grad(loss, argnums=tuple(range(len(inputs))), has_aux=True)(*inputs)
        results[name] = (*outs, *grads)
    return results


@pytest.mark.parametrize("core", ["kda", pytest.param("lightning", marks=matrix)])
@pytest.mark.parametrize("length, size", [
    pytest.param(n, t, id=f"{n}-{t}", marks=() if (n, t) in QUICK_LENGTHS else matrix)
    for t in (64, 16) for n in (1, 5, 63, 64, 65, 130)])
def test_recurrent_equals_chunked_float64(core, length, size):
    # From a random initial state: the outputs, the final state and every input's gradient
    # (slope's included: the chunked custom_vjp against the recurrent scan's autodiff).
    rng, seed = fresh_rng()
    with jax.enable_x64(True):
        if core == "kda":
            inputs = _core_inputs(rng, 2, 3, length, 4, 5)
            fn, sizes = gated_delta_rule, {"chunk_size": size}
        else:
            inputs = _lightning_inputs(rng, 2, 3, length, 4, 5)
            fn, sizes = lightning_rule, {"block_size": size}
        d_o, d_s = (jnp.asarray(rng.standard_normal(s))
                    for s in ((2, 3, length, 5), inputs[-1].shape))
        results = _both(fn, inputs, d_o, d_s, **sizes)
    for got, want in zip(results["chunked"], results["recurrent"]):
        assert compare(got, want, "float64", "grad", terms=length).ok, seed


@pytest.mark.parametrize("dtype", ["float64", pytest.param("float32", marks=matrix)])
def test_strong_per_channel_decay_stays_finite_and_accurate(dtype):
    # g ≈ −5 a token and channel over chunks of 64 (Γ reaches −320 within a chunk: e^{−Γ}
    # alone overflows even float64): the chunked outputs, state and gradients finite and equal
    # to the float64 recurrent ones on the same (dtype-rounded) inputs at the dtype's grad row.
    # float32 dg is what needs the segment sums: as differences of cumulative sums its
    # relative error norm was 3.8e-5 (the row's bound 4e-6); with them 1.1e-7.
    rng, seed = fresh_rng()
    with jax.enable_x64(True):
        inputs = [a.astype(dtype).astype(jnp.float64)
                  for a in _core_inputs(rng, 1, 2, 130, 8, 6, strong=True)]
        d_o, d_s = (jnp.asarray(rng.standard_normal(s)).astype(dtype).astype(jnp.float64)
                    for s in ((1, 2, 130, 6), (1, 2, 8, 6)))
        want = _both(gated_delta_rule, inputs, d_o, d_s, chunk_size=64)["recurrent"]
        low = [a.astype(dtype) for a in inputs]
        got = _both(gated_delta_rule, low, d_o.astype(dtype), d_s.astype(dtype),
                    chunk_size=64)["chunked"]
    for a, b in zip(got, want):
        assert bool(jnp.all(jnp.isfinite(a))), seed
        assert compare(a, b, dtype, "grad", terms=130).ok, seed


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == QUICK_CONFIGS[0] else matrix)
                                  for n in CONFIGS])
def test_prefill_then_decode_through_the_cache_float64(name):
    # 6 tokens prefilled (chunked, chunks/blocks of 4), then 5 one at a time (recurrent), the
    # second row left-padded by 3: the outputs equal the full forward's (and the reference's).
    rng, seed = fresh_rng()
    mixer, config = _config(name, **({"block_size": 4} if name == "lightning" else {}))
    call = {"chunk_size": 4} if mixer == KDA else {}
    with jax.enable_x64(True):
        params = _params(rng, mixer, config)
        module = jax_attn.build(mixer, config, params)
        x = jnp.asarray(rng.standard_normal((2, 11, config["d_in"])))
        mask = jnp.asarray(_padded(2, 11, 3))
        full = module(x, mask)
        expected = MIXERS[mixer][0](config, {"x": np.asarray(x), "mask": np.asarray(mask)},
                                    params)[0]
        cache = module.init_cache(2, 16)
        assert cache.conv.shape == recurrent.cache_shapes(config, 2)["conv"]
        assert cache.state.dtype == jnp.float64
        with record() as ran:
            y, cache = module(x[:, :6], mask[:, :6], cache=cache, **call)
        outs = [y]
        with record() as ran_step:
            for t in range(6, 11):
                y, cache = module(x[:, t:t + 1], mask[:, t:t + 1], cache=cache)
                outs.append(y)
        np.testing.assert_array_equal(np.asarray(cache.lengths), [11, 11])
    assert [n for _, n in ran] == ["chunked"] and [n for _, n in ran_step] == ["recurrent"]
    assert compare(jnp.concatenate(outs, axis=1), full, "float64").ok, seed
    assert compare(full, expected, "float64").ok, seed


def _on_grid(a, dtype):
    return np.asarray(jnp.asarray(a, dtype).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("mixer, dtype", [
    pytest.param(m, d, id=f"{m}-{d}", marks=matrix)
    for m in (KDA, LIGHTNING) for d in ("float32", "bfloat16")])
def test_low_precision_error_against_reference(mixer, dtype):
    # One configuration, L = 64, 256, 1024 (lightning: blocks of 64), parameters and inputs on
    # the dtype's grid (the arithmetic alone): the output's relative error norm, and its
    # largest error relative to max |y|, within tolerances.delta_rule_bound.
    rng, seed = fresh_rng()
    if mixer == KDA:
        config = dict(d_in=16, num_heads=3, head_dim=8, d_out=12, conv_kernel=4, decay_rank=4,
                      forget_gate="bounded_sigmoid", decay_lower_bound=-3.0)
    else:
        config = dict(d_in=16, num_heads=3, head_dim=8, d_out=12, block_size=64)
    params = {n: _on_grid(a, dtype) for n, a in _params(rng, mixer, config, 0.3).items()}
    module = jax_attn.build(mixer, config, {n: a.astype(np.float32) for n, a in params.items()})
    nnx.update(module, jax.tree.map(lambda a: a.astype(dtype), nnx.state(module, nnx.Param)))
    x_all = _on_grid(rng.standard_normal((1, 1024, 16)), dtype)
    assert_low_precision_within_bound(
        lambda x: jax_output(module, x, dtype), lambda x: MIXERS[mixer][0](config, {"x": x}, params)[0],
        lambda length: x_all[:, :length], dtype, seed)


@pytest.mark.parametrize("core", ["kda", pytest.param("lightning", marks=matrix)])
def test_chunked_backward_keeps_chunk_states_only(core):
    # The residuals jax.vjp keeps for L = 256 in chunks of 16: each smaller than one head's
    # per-token states L·Dk·Dv and in all O(L·(Dk + Dv)) (the per-channel decay (L, Dk)
    # included); the recurrent scan's autodiff keeps every S_t (so the check can fail).
    rng, _ = fresh_rng()
    b, h, length, dk, dv = 1, 2, 256, 8, 8
    if core == "kda":
        inputs, fn, sizes = _core_inputs(rng, b, h, length, dk, dv)[:5], gated_delta_rule, \
            {"chunk_size": 16}
    else:
        inputs, fn, sizes = _lightning_inputs(rng, b, h, length, dk, dv)[:4], lightning_rule, \
            {"block_size": 16}
    per_token = b * h * length * dk * dv

    def residuals(name):
        _, pullback = jax.vjp(lambda *a: fn(*a, implementation=name, **sizes)[0], *inputs)
        return [leaf.shape for leaf in jax.tree.leaves(pullback)]
    chunked = residuals("chunked")
    assert chunked and max(int(np.prod(s)) for s in chunked) <= per_token // 8, chunked
    assert sum(int(np.prod(s)) for s in chunked) <= 8 * b * h * length * (dk + dv), chunked
    assert max(int(np.prod(s)) for s in residuals("recurrent")) >= per_token


@pytest.mark.parametrize("name", [pytest.param(n, marks=matrix) for n in QUICK_CONFIGS])
def test_module_jits_and_unbatched_inputs(name):
    # Under a caller's nnx.jit the module equals its eager call; (L, d_in) equals a batch of 1.
    rng, _ = fresh_rng()
    mixer, config = _config(name)
    module = jax_attn.build(mixer, config, _params(rng, mixer, config))
    x = jnp.asarray(rng.standard_normal((3, 9, config["d_in"])), jnp.float32)
    jitted = nnx.jit(lambda m, xx: m(xx))(module, x)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(module(x)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(module(x[0])), np.asarray(module(x[:1])[0]),
                               rtol=1e-6, atol=1e-6)


def test_build_export_round_trip_and_public_names():
    rng, _ = fresh_rng()
    for name in ("kda-bounded-lowrank", "kda-softplus-fullrank", "lightning"):
        mixer, config = _config(name)
        params = {n: a.astype(np.float32) for n, a in _params(rng, mixer, config).items()}
        module = jax_attn.build(mixer, config, params)
        assert type(module).__name__ == recurrent.get(mixer).class_name
        assert getattr(jax_attn, type(module).__name__) is type(module)
        out = jax_attn.export_params(module)
        assert set(out) == set(params), name
        for n in params:
            np.testing.assert_array_equal(out[n], params[n])
        assert module.config == recurrent.get(mixer).config(config)


def test_bad_inputs_name_the_argument():
    rng, _ = fresh_rng()
    for name in QUICK_CONFIGS:
        mixer, config = _config(name)
        module = jax_attn.build(mixer, config, _params(rng, mixer, config))
        x = jnp.zeros((2, 4, config["d_in"]))
        with pytest.raises(ValueError, match=r"x .*\(B, L, d_in\)"):
            module(jnp.zeros((2, 4, config["d_in"] + 1)))
        with pytest.raises(ValueError, match="mask dtype should be bool"):
            module(x, jnp.ones((2, 4)))
        with pytest.raises(ValueError, match=r"cache.conv shape should be"):
            module(x, cache=module.init_cache(3, 8))
        with pytest.raises(ValueError, match="implementation should be None or one of"):
            module(x, implementation="fused")
    kda = jax_attn.build(KDA, _config("kda-softplus-lowrank")[1],
                         _params(rng, *_config("kda-softplus-lowrank")))
    with pytest.raises(ValueError, match="chunk_size should be a positive int"):
        kda(x, chunk_size=0)
    with pytest.raises(TypeError):
        module(x, chunk_size=4)  # lightning's block is its configuration's
    with pytest.raises(ValueError, match="block_size should be a positive int"):
        jax_attn.LightningAttention(5, 2, 3, block_size=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="decay_lower_bound should be"):
        jax_attn.KimiDeltaAttention(5, 2, 3, forget_gate="bounded_sigmoid", rngs=nnx.Rngs(0))
    q, k, v, g, beta, _ = _core_inputs(rng, 1, 2, 5, 4, 3)
    with pytest.raises(ValueError, match=r"g shape should be \(B, H, L\) or \(B, H, L, Dk\)"):
        gated_delta_rule(q, k, v, g[..., :3], beta)
    q, k, v, slope, _ = _lightning_inputs(rng, 1, 2, 5, 4, 3)
    with pytest.raises(ValueError, match=r"slope shape should be \(H,\) = \(2,\)"):
        lightning_rule(q, k, v, slope[:1])
    with pytest.raises(ValueError, match="block_size should be a positive int"):
        lightning_rule(q, k, v, slope, block_size=0)
    with pytest.raises(ValueError, match="implementation should be None or one of"):
        lightning_rule(q, k, v, slope, implementation="fused")


def test_the_twins_call_signatures_agree():
    # the house's twin APIs: each recurrent mixer's call and constructor take the same names in
    # the same order with the same defaults in both frameworks (JAX's constructor adds its
    # keyword-only rngs and precision)
    import inspect

    import jax_attn
    import torch_attn
    for name in ("GatedDeltaNet", "KimiDeltaAttention", "LightningAttention"):
        torch_call = inspect.signature(getattr(torch_attn, name).forward)
        jax_call = inspect.signature(getattr(jax_attn, name).__call__)
        assert list(torch_call.parameters.values()) == list(jax_call.parameters.values()), name
        torch_init = list(inspect.signature(getattr(torch_attn, name).__init__).parameters
                          .values())
        jax_init = [p for p in inspect.signature(getattr(jax_attn, name).__init__).parameters
                    .values() if p.name not in ("rngs", "precision")]
        assert torch_init == jax_init, name

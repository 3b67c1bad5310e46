"""The JAX execution model: jit (identical to eager, compiled once per shape), the one-head core
vmapped over heads and batch (in chunks on CPU once the scores are large), a caller's own
jax.grad / jax.vmap / nnx.grad through every module (nnx.grad against the reference's
gradients), no device or host round trip, and the precision argument, HIGHEST by default in the
core and every module, reaching every compiled dot."""

from __future__ import annotations

import inspect
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import golden
import jax_attn
from golden import reference
from golden.specification import variants
from golden.harness.check import compare_all
from golden.specification.tolerances import compare
from golden.specification.validate import window
from golden.specification.variants import MODULES
from jax_attn import functional
from tests.helpers import (
    DTYPES,
    JAX,
    assert_directional_derivative,
    by_name,
    count_compiles,
    fixture_of,
    fixture_sweep,
    fresh_rng,
    has_params,
    main_input,
    random_cotangents,
    random_inputs,
    reference_fixture,
)

CORE_FIXTURES = [n for n in golden.names()
                 if not variants.lookup(fixture_of(n).variant).is_module]


def _core_inputs(rng, dtype="float32"):
    """q, k, v, mask, bias as JAX arrays (float64 needs the caller's jax.enable_x64)."""
    q, k, v = (jnp.asarray(rng.standard_normal(s), dtype) for s in
               [(2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 6)])
    mask = jnp.asarray(rng.random((2, 1, 5, 7)) < 0.7)
    bias = jnp.asarray(rng.standard_normal((3, 5, 7)), dtype)
    return q, k, v, mask, bias


GQA = "grouped_query_attention"


def _module_call(module, inputs):
    """(output, weights) of a module on JAX arrays."""
    args, kwargs = variants.get(module.variant).call_args(inputs)
    return module(*args, **kwargs, return_weights=True)


def _eval_module(variant, seed=0):
    module = JAX.make(variant.name, variant.sample, seed)
    module.eval()
    return module


# ---- jit --------------------------------------------------------------------------------------

def test_core_jit_equals_eager():
    rng, seed = fresh_rng()
    args = _core_inputs(rng)
    jitted = jax_attn.scaled_dot_product_attention(*args, is_causal=True, return_weights=True)
    with jax.disable_jit():
        eager = jax_attn.scaled_dot_product_attention(*args, is_causal=True, return_weights=True)
    for a, b in zip(jitted, eager):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"seed {seed}")


@pytest.mark.parametrize("variant", by_name(MODULES, share=True))
def test_module_jit_equals_eager(variant):
    rng, seed = fresh_rng()
    module = _eval_module(variant, seed)
    inputs = JAX.arrays(random_inputs(variant, rng, "float32"))
    jitted = _module_call(module, inputs)
    with jax.disable_jit():
        eager = _module_call(module, inputs)
    for a, b in zip(jitted, eager):
        # Not bit for bit: XLA compiles the jitted call as one program and the eager one op by
        # op, and may contract a·b + c into fused multiply-adds in one and not the other,
        # depending on the CPU: RoPE's a·cos − b·sin an ulp or two apart (2.4e-7 seen), and on
        # an AVX2 host (AMD EPYC, Zen 3 class, 2026-11-25) the cross-attention's output 1 ulp
        # apart (2.4e-7) in 50 of 84 elements, bit-equal on the AVX-512 host before it.
        assert compare(a, b, "float32").ok, f"seed {seed}"


def test_core_compiles_once_per_shape():
    rng, _ = fresh_rng()
    args = _core_inputs(rng)
    functional._attention.clear_cache()
    jax_attn.scaled_dot_product_attention(*args, is_causal=True)
    jax_attn.scaled_dot_product_attention(*(a + 0 for a in args[:3]), *args[3:], is_causal=True)
    assert functional._attention._cache_size() == 1
    jax_attn.scaled_dot_product_attention(*args, is_causal=False)  # a static argument changed
    assert functional._attention._cache_size() == 2


@pytest.mark.parametrize("variant", by_name(MODULES, share=True))
def test_module_compiles_once_per_shape(variant):
    rng, seed = fresh_rng()
    # B=8 is this test's own batch size, so that nothing before it compiled these shapes.
    first, second, third = (JAX.arrays(random_inputs(variant, rng, "float32", batch=(8,)))
                            for _ in range(3))
    module = _eval_module(variant, seed)
    with count_compiles() as compiled:
        _module_call(module, first)
    assert compiled, "the first call compiled nothing: the counter does not see compilations"
    with count_compiles() as compiled:
        _module_call(module, second)  # new values, same shapes
    assert compiled == [], f"a second call compiled {compiled}"
    twin = _eval_module(variant, seed + 1)  # other weights, same structure
    with count_compiles() as compiled:
        _module_call(twin, third)
    assert compiled == [], f"a module with other weights compiled {compiled}"


# ---- vmap, and the chunks of (batch, head) pairs on CPU ---------------------------------------

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
    # CPU runs (batch, head) pairs in chunks once the scores are large; else one vmap over all.
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


def test_cpu_chunks_only_large_scores():
    assert jax.default_backend() == "cpu"  # this machine
    per_step, least = functional.CPU_HEADS_PER_STEP, functional.CPU_CHUNK_MIN_SCORES
    assert functional.heads_per_step((4, 8, 512, 64), (4, 8, 512, 64)) == per_step
    # The threshold counts B·H·Lq·Lk score elements: 8·512·512 = 2**21 is the first large one.
    assert least == 8 * 512 * 512
    assert functional.heads_per_step((2, 4, 512, 16), (2, 4, 512, 16)) == per_step
    assert functional.heads_per_step((2, 4, 512, 16), (2, 4, 511, 16)) is None
    # No chunks when there are no more (batch, head) pairs than one chunk holds.
    assert functional.heads_per_step((1, 2, 2048, 8), (1, 2, 2048, 8)) is None
    assert functional.heads_per_step((2048, 8), (2048, 8)) is None
    for name in CORE_FIXTURES:  # the fixtures' shapes are tiny: one vmap over all pairs
        f = golden.load(name)
        assert functional.heads_per_step(f.inputs["query"].shape, f.inputs["key"].shape) is None


def test_chunks_lower_to_a_loop():
    rng, _ = fresh_rng()
    text = functional._attention.lower(
        *_core_inputs(rng), None, None, scale=0.5, is_causal=True, dropout_rate=0.0,
        precision=jax_attn.DEFAULT_PRECISION, return_weights=False,
        chunk=functional.CPU_HEADS_PER_STEP).as_text()
    assert "stablehlo.while" in text and "batching_dims = [0] x [0]" in text


def _chunked_cases():
    """Every core fixture at float32 and float64: a covering few in the quick suite (every
    dtype, option and input kind; tests/helpers.py ``sweep``), all in the whole matrix."""
    return fixture_sweep([(n, d) for n in CORE_FIXTURES for d in DTYPES])


@pytest.mark.parametrize("name, dtype", _chunked_cases())
def test_chunked_core_matches_fixture(name, dtype):
    # The fixtures are too small to take the chunked path by default (previous test), so it is
    # run here explicitly: output, weights and every gradient against the golden values.
    fixture = golden.load(name)
    config = variants.get(fixture.variant).config(fixture.config)
    with jax.enable_x64(dtype == "float64"):
        arrays = JAX.arrays(fixture.inputs, dtype)
        floats = {n: a for n, a in arrays.items() if jnp.issubdtype(a.dtype, jnp.floating)}
        cot = JAX.arrays(fixture.cotangents, dtype)
        q = arrays["query"]
        scale = 1 / math.sqrt(q.shape[-1]) if config["scale"] is None else config["scale"]

        @jax.jit
        def loss(floats):
            a = {**arrays, **floats}
            out, w = functional._attention(
                a["query"], a["key"], a["value"], a.get("mask"), a.get("bias"),
                a.get("dropout_mask"), None, a.get("query_offset"), a.get("query_seq_lengths"),
                a.get("key_value_seq_lengths"), a.get("sinks"), scale=scale,
                is_causal=config["is_causal"], softcap=config["softcap"],
                window=window(config["local_window_size"]),
                chunk_size=config["attention_chunk_size"], dropout_rate=config["dropout_rate"],
                precision=jax_attn.DEFAULT_PRECISION, return_weights=True,
                chunk=functional.CPU_HEADS_PER_STEP)
            return jnp.sum(out * cot["output"]) + jnp.sum(w * cot["weights"]), (out, w)

        grads, (out, w) = jax.grad(loss, has_aux=True)(floats)
        assert out.dtype == dtype
        result = {"output": JAX.numpy(out), "weights": JAX.numpy(w),
                  "grads": {n: JAX.numpy(g) for n, g in grads.items()}}
    comps = compare_all(fixture, result, dtype)
    bad = {what: c for what, c in comps.items() if not c.ok}
    assert not bad, f"chunked {dtype} {name}: {bad}"


def test_core_lowers_to_one_batched_program():
    # Without chunks (small scores, accelerators) the one-head core is vmapped over heads and
    # batch at once.
    rng, _ = fresh_rng()
    args = _core_inputs(rng)
    text = functional._attention.lower(
        *args, None, None, scale=0.5, is_causal=True, dropout_rate=0.0,
        precision=jax_attn.DEFAULT_PRECISION, return_weights=True).as_text()
    assert len(re.findall(r"stablehlo\.dot_general", text)) == 2
    assert "batching_dims = [0, 1]" in text
    assert "stablehlo.while" not in text


@pytest.mark.parametrize("variant", by_name(MODULES, share=True))
def test_users_vmap_over_extra_axis(variant):
    rng, seed = fresh_rng()
    module = _eval_module(variant, seed)
    stacked = random_inputs(variant, rng, "float32", batch=(4, 2))  # (E, B, L, d)
    name = main_input(variant)
    others = JAX.arrays({n: a[0] for n, a in stacked.items() if n != name})

    def one(x):
        args, kwargs = variant.call_args({**others, name: x})
        return module(*args, **kwargs)

    batched = jax.vmap(one)(jnp.asarray(stacked[name]))
    for e in range(4):
        np.testing.assert_allclose(batched[e], one(jnp.asarray(stacked[name][e])), rtol=1e-6,
                                   atol=1e-6, err_msg=f"seed {seed}")


# ---- grad -------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", by_name(MODULES, share=True))
def test_jax_grad_through_module(variant):
    rng, seed = fresh_rng()
    with jax.enable_x64(True):  # float64, so that a finite difference is a sharp check
        module = _eval_module(variant, seed)
        inputs = JAX.arrays(random_inputs(variant, rng, "float64"))
        name = main_input(variant)

        def loss_x(x):
            args, kwargs = variant.call_args({**inputs, name: x})
            return jnp.sum(module(*args, **kwargs) ** 2)

        g = jax.grad(loss_x)(inputs[name])
        d = jnp.asarray(rng.standard_normal(inputs[name].shape))
        assert_directional_derivative(loss_x, inputs[name], d, g, seed)


@pytest.mark.parametrize("variant", by_name(MODULES, share=True))
def test_nnx_grad_through_module_matches_reference(variant):
    # nnx.grad of a user's loss over the module and its inputs, float64, against the reference's
    # analytic gradients of the same loss: every parameter and every float input. Modules with
    # dropout train with a random keep-mask.
    rng, seed = fresh_rng()
    arrays = random_inputs(variant, rng, "float64")
    with jax.enable_x64(True):
        module = JAX.cast(_eval_module(variant, seed), "float64")
        params = JAX.export(module)
        out, weights, _ = reference.VARIANTS[variant.name][0](module.config, arrays, params)
        if variant.dropout:
            module.train()
            arrays["dropout_mask"] = rng.random(weights.shape) >= module.config["dropout"]
            out, weights, _ = reference.VARIANTS[variant.name][0](module.config, arrays, params)
        cot = random_cotangents(rng, out.shape, weights.shape)
        fixture = reference_fixture(variant.name, module.config, arrays, params, cot, "float64")
        inputs, d = JAX.arrays(arrays), JAX.arrays(cot)
        floats = {n: a for n, a in inputs.items() if jnp.issubdtype(a.dtype, jnp.floating)}

        def loss(model, floats):
            out, weights = _module_call(model, {**inputs, **floats})
            return jnp.sum(out * d["output"]) + jnp.sum(weights * d["weights"])

        g_model, g_inputs = nnx.grad(loss, argnums=(0, 1))(module, floats)
        graphdef, _, rest = nnx.split(module, nnx.Param, ...)
        as_module = nnx.merge(graphdef, g_model, rest)  # gradients in the module's places
        out, weights = _module_call(module, inputs)
    result = {"output": JAX.numpy(out), "weights": JAX.numpy(weights),
              "grads": {**{n: JAX.numpy(g) for n, g in g_inputs.items()},
                        **JAX.export(as_module)}}
    assert set(result["grads"]) == set(fixture.grads), "a gradient is missing"
    assert has_params(variant) == bool(params)
    bad = {what: c for what, c in compare_all(fixture, result, "float64").items() if not c.ok}
    assert not bad, f"nnx.grad vs reference, seed {seed}: {bad}"


# The relative positions and buckets of the speech encoders (issue 41), each with the setting
# that makes it bite (blocks, a two-sided window under a soft cap, clipped distances past M):
# under a caller's nnx.jit of nnx.grad, float64, against the reference's analytic gradients.
RELATIVE = {
    "transformer_xl": dict(causal=False, relative_positions="transformer_xl"),
    "shaw_blocks": dict(causal=False, attention_chunk_size=3, relative_positions="shaw",
                        relative_max_distance=2),
    "conformer_timing": dict(causal=False, sliding_window=(3, 1), softcap=2.0,
                             relative_positions="conformer_timing", key_scale=1.5),
    "clipped_buckets": dict(causal=False, relative_attention_num_buckets=4,
                            relative_attention_max_distance=2,
                            relative_attention_buckets="clipped"),
}


@pytest.mark.parametrize("name", sorted(RELATIVE))
def test_relative_positions_under_nnx_jit_and_grad_match_the_reference(name):
    rng, seed = fresh_rng()
    config = dict(d_in=6, num_heads=2, num_kv_heads=1, head_dim=4, qkv_bias=True,
                  **RELATIVE[name])
    x = rng.standard_normal((2, 9, 6))
    with jax.enable_x64(True):
        made = JAX.cast(JAX.make(GQA, config, seed), "float64")
        params = {n: rng.standard_normal(np.shape(a)) * 0.5 for n, a in JAX.export(made).items()}
        module = JAX.build(GQA, config, params)
        module.eval()
        out, weights, _ = reference.VARIANTS[GQA][0](dict(config), {"x": x}, params)
        cot = random_cotangents(rng, out.shape, weights.shape)
        fixture = reference_fixture(GQA, config, {"x": x}, params, cot, "float64")
        d = JAX.arrays(cot)

        def loss(model, x):
            out, weights = model(x, return_weights=True)
            return jnp.sum(out * d["output"]) + jnp.sum(weights * d["weights"])

        g_model, g_x = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(module, jnp.asarray(x))
        graphdef, _, rest = nnx.split(module, nnx.Param, ...)
        as_module = nnx.merge(graphdef, g_model, rest)  # gradients in the module's places
        out, weights = nnx.jit(lambda m, x: m(x, return_weights=True))(module, jnp.asarray(x))
    result = {"output": JAX.numpy(out), "weights": JAX.numpy(weights),
              "grads": {"x": JAX.numpy(g_x), **JAX.export(as_module)}}
    assert set(result["grads"]) == set(fixture.grads), "a gradient is missing"
    bad = {what: c for what, c in compare_all(fixture, result, "float64").items() if not c.ok}
    assert not bad, f"{name} under nnx.jit and nnx.grad vs reference, seed {seed}: {bad}"


# ---- devices, transfers, precision ------------------------------------------------------------

@pytest.mark.parametrize("variant", by_name(MODULES, share=True))
def test_no_host_round_trip_and_device_kept(variant):
    module, args, kwargs = _eval_module_and_args(variant)
    module(*args, **kwargs)  # compile first: constants are moved once, at compile time
    with jax.transfer_guard("disallow"):
        out = module(*args, **kwargs)
    assert out.devices() == args[0].devices()


def _eval_module_and_args(variant):
    """A module in eval mode and fresh float32 arguments for it."""
    rng, _ = fresh_rng()
    module = _eval_module(variant)
    return (module, *variant.call_args(JAX.arrays(random_inputs(variant, rng, "float32"))))


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


@pytest.mark.parametrize("variant", by_name(MODULES, share=True))
def test_precision_reaches_every_module_dot(variant):
    # Constructed without ``precision``: the default, HIGHEST, reaches every dot.
    module, args, kwargs = _eval_module_and_args(variant)
    text = jax.jit(lambda *a: module(*a, **kwargs)).lower(*args).as_text()
    dots = _dots(text)
    assert len(dots) >= (5 if has_params(variant) else 2)  # projections, attention's two dots
    assert all("precision = [HIGHEST, HIGHEST]" in d for d in dots), dots


def test_precision_defaults_to_highest():
    highest = jax.lax.Precision.HIGHEST
    assert jax_attn.DEFAULT_PRECISION is highest
    core = inspect.signature(jax_attn.scaled_dot_product_attention).parameters["precision"]
    assert core.default is highest
    for variant in MODULES:
        init = inspect.signature(getattr(jax_attn, variant.class_name).__init__).parameters
        assert init["precision"].default is highest, variant.class_name


@pytest.mark.parametrize("shapes, chunked", [(((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 6)), False),
                                             (((4, 8, 512, 4), (4, 8, 512, 4), (4, 8, 512, 6)),
                                              True)], ids=["one-vmap", "chunks"])
def test_default_precision_reaches_every_core_dot(shapes, chunked):
    # The public core called without ``precision``, as a user calls it, on both CPU paths.
    q, k, v = (jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)
    mask = jax.ShapeDtypeStruct(shapes[0][:-1] + shapes[1][-2:-1], jnp.bool_)  # (B, H, Lq, Lk)
    plain = jax.jit(lambda q, k, v: jax_attn.scaled_dot_product_attention(q, k, v, is_causal=True))
    full = jax.jit(lambda q, k, v, mask, key: jax_attn.scaled_dot_product_attention(
        q, k, v, mask, is_causal=True, dropout_rate=0.2, dropout_rng=key, return_weights=True))
    for text in (plain.lower(q, k, v).as_text(),
                 full.lower(q, k, v, mask, jax.random.key(0)).as_text()):
        dots = _dots(text)
        batched = "batching_dims = [0] x [0]" if chunked else "batching_dims = [0, 1] x [0, 1]"
        tiles = 4 if chunked else 1  # causal L = 512: explicit's four query tiles of 128 rows
        assert len(dots) == 2 * tiles and all(batched in d for d in dots), dots  # the path
        assert all("precision = [HIGHEST, HIGHEST]" in d for d in dots), dots


@pytest.mark.parametrize("heads", [(2, 1), (4, 1), (4, 2)])
@pytest.mark.parametrize("length", [64, 256])
def test_blockwise_gqa_gradients_compiled_with_their_forward(heads, length):
    # jax.jit(jax.grad(...)) of "blockwise" with fewer kv heads than query heads: its custom
    # VJP vmapped over a kv head's G query heads with k and v not mapped gave wrong key, value
    # and query gradients (order 1, value gradients up to 1e30, different at each compilation)
    # whenever forward and backward were one program and the loss was a plain out.sum() (its
    # cotangent a constant: a random one was right); k and v are now broadcast to the G heads
    # (jax_attn.functional._over_groups). Against the float64 reference, each of 3
    # compilations.
    rng = np.random.default_rng(length + 10 * heads[0] + heads[1])
    q = rng.standard_normal((1, heads[0], length, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, heads[1], length, 16)).astype(np.float32) for _ in range(2))
    d_out = np.ones(q.shape, np.float32)  # the loss out.sum(): a constant cotangent
    g = heads[0] // heads[1]  # the reference on the kv heads repeated, their gradients summed
    wide = [x.astype(np.float64) for x in (q, np.repeat(k, g, 1), np.repeat(v, g, 1))]
    expected = reference.sdpa_backward(reference.sdpa_forward(*wide, None, None,
                                                              is_causal=True)[2],
                                       d_out.astype(np.float64),
                                       np.zeros((1, heads[0], length, length)))
    for name in ("key", "value"):
        expected[name] = expected[name].reshape((1, heads[1], g) + k.shape[2:]).sum(2)
    for _ in range(3):
        def loss(q, k, v):
            out = jax_attn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                        implementation="blockwise")
            return out.sum()
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        for name, got in zip(("query", "key", "value"), grads):
            assert compare(np.asarray(got), expected[name], "float32", "grad",
                           terms=length).ok, (name, heads, length)

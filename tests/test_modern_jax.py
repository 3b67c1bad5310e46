"""The JAX core's modern arguments (issue 9): grouped-query attention by shape, soft-capping,
query offsets, sliding windows and sequence lengths; sinks and chunks with the heads in steps.
Checked against jax.nn.dot_product_attention (float32, non-empty rows), the float64 reference
(output, weights, every gradient), an explicit repetition of K and V, and the lowered program
(K and V never repeated to H heads; a growing offset never recompiles).

Shape legend: B batch, H query heads, Hkv key-value heads, G = H / Hkv, Lq query length, Lk key
length, Dk key width, Dv value width.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_attn
from golden.specification import variants
from golden.harness.check import compare_all
from golden.specification.tolerances import compare
from golden.specification.validate import window
from jax_attn import functional
from tests.helpers import (
    JAX,
    count_compiles,
    fresh_rng,
    random_cotangents,
    reference_fixture,
)

B, H, HKV, LQ, LK, DK, DV = 2, 6, 2, 5, 7, 4, 3  # every size different; G = 3


def _qkv(rng, dtype="float32", lead=(B,), heads=(H, HKV), lq=LQ, lk=LK, dk=DK, dv=DV):
    """q (..., H, Lq, Dk), k (..., Hkv, Lk, Dk), v (..., Hkv, Lk, Dv) as NumPy."""
    return tuple(rng.standard_normal(s).astype(dtype) for s in
                 [lead + (heads[0], lq, dk), lead + (heads[1], lk, dk), lead + (heads[1], lk, dv)])


# ---- against jax.nn.dot_product_attention ------------------------------------------------------

# Each case: (keyword arguments of both, mask, bias); jax.nn has no offset and no softcap.
NN_CASES = {
    "gqa": dict(),
    "mqa_causal": dict(heads=(H, 1), is_causal=True),
    "window_int": dict(local_window_size=1),
    "window_pair_causal": dict(local_window_size=(2, 0), is_causal=True),
    "lengths": dict(query_seq_lengths=[3, 5], key_value_seq_lengths=[4, 7]),
    "all": dict(is_causal=True, local_window_size=(3, 1), query_seq_lengths=[5, 2],
                key_value_seq_lengths=[6, 3], scale=0.7, mask=True, bias=True),
}


@pytest.mark.parametrize("name", NN_CASES)
def test_matches_jax_nn_on_non_empty_rows(name):
    rng, seed = fresh_rng()
    kw = dict(NN_CASES[name])
    q, k, v = _qkv(rng, heads=kw.pop("heads", (H, HKV)), dv=DK)  # jax.nn: Dv = Dk
    mask = rng.random((B, 1, LQ, LK)) < 0.6 if kw.pop("mask", False) else None
    bias = rng.standard_normal((B, H, LQ, LK)).astype("float32") if kw.pop("bias", False) else None
    ours_kw = {n: (np.asarray(x, "int32") if n.endswith("lengths") else x) for n, x in kw.items()}
    out, w = jax_attn.scaled_dot_product_attention(q, k, v, mask, bias, return_weights=True,
                                                   **ours_kw)
    to_blhd = lambda x: jnp.swapaxes(jnp.asarray(x), 1, 2)  # noqa: E731  (B, H, L, D) -> (B, L, H, D)
    theirs = jax.nn.dot_product_attention(
        to_blhd(q), to_blhd(k), to_blhd(v), bias=bias, mask=mask,
        **{n: (tuple(x) if isinstance(x, tuple) else (x, x) if n == "local_window_size"
               else jnp.asarray(x, "int32") if n.endswith("lengths") else x)
           for n, x in kw.items()})
    theirs = np.asarray(jnp.swapaxes(theirs, 1, 2))  # (B, H, Lq, Dv)
    filled = np.asarray(w).sum(axis=-1) > 0  # (B, H, Lq): rows with an allowed key
    if "query_seq_lengths" in kw:  # jax.nn zeroes the rows past the lengths too
        past = np.arange(LQ) >= np.asarray(kw["query_seq_lengths"])[:, None, None]  # (B, 1, Lq)
        assert np.all(theirs[np.broadcast_to(past, filled.shape)] == 0)
    assert filled.any(), "every row is empty: the case compares nothing"
    # Both are float32 with the same formula (jax.nn's logits and softmax in float32, its dots at
    # full float32 on CPU): they differ by the summation order only, a few float32 ulps.
    c = compare(np.asarray(out)[filled], theirs[filled], "float32")
    assert c.ok, f"{name}, seed {seed}: {c}"
    np.testing.assert_allclose(np.asarray(out)[filled], theirs[filled], rtol=1e-5, atol=1e-6,
                               err_msg=f"seed {seed}")
    assert np.all(np.asarray(out)[~filled] == 0)  # ours gives zeros where jax.nn gives mean(V)


# ---- against the float64 reference, gradients included ------------------------------------------

REF_CASES = {
    "gqa_softcap_bias": dict(config=dict(softcap=2.0, scale=1.5), bias=(B, 1, LQ, LK)),
    "offset_causal_window": dict(config=dict(is_causal=True, local_window_size=[None, 1]),
                                 query_offset=np.array([0, 3], "int32")),
    "lengths_mask_softcap": dict(config=dict(softcap=1.0), mask=(B, H, LQ, LK),
                                 query_seq_lengths=np.array([4, 5], "int32"),
                                 key_value_seq_lengths=np.array([7, 2], "int32")),
    "unbatched_mqa_window": dict(lead=(), heads=(H, 1),
                                 config=dict(local_window_size=(1, 2), is_causal=True),
                                 query_offset=np.array(2, "int32")),
    "unbatched_2d_offset_window": dict(lead=None, config=dict(local_window_size=0),
                                       query_offset=np.array(4, "int32")),
    "dropout_gqa_lengths": dict(config=dict(dropout_rate=0.3, is_causal=True),
                                keep=(B, H, LQ, LK), key_value_seq_lengths=np.array([3, 6],
                                                                                    "int32")),
}


@pytest.mark.parametrize("name", REF_CASES)
def test_matches_float64_reference_with_gradients(name):
    rng, seed = fresh_rng()
    case = dict(REF_CASES[name])
    lead, heads = case.pop("lead", (B,)), case.pop("heads", (H, HKV))
    config = variants.get(variants.SDPA).config(case.pop("config"))
    if lead is None:  # (L, D) inputs
        q, k, v = (x[0] for x in _qkv(rng, "float64", lead=(), heads=(1, 1)))
    else:
        q, k, v = _qkv(rng, "float64", lead=lead, heads=heads)
    inputs = {"query": q, "key": k, "value": v}
    if "mask" in case:
        inputs["mask"] = rng.random(case.pop("mask")) < 0.6
    if "bias" in case:
        inputs["bias"] = rng.standard_normal(case.pop("bias"))
    if "keep" in case:
        inputs["dropout_mask"] = rng.random(case.pop("keep")) >= config["dropout_rate"]
    inputs.update(case)  # offsets and lengths
    weights_shape = q.shape[:-1] + (k.shape[-2],)
    cot = random_cotangents(rng, q.shape[:-1] + (v.shape[-1],), weights_shape)
    fixture = reference_fixture(variants.SDPA, config, inputs, {}, cot, "float64")
    with jax.enable_x64(True):
        arrays, d = JAX.arrays(inputs), JAX.arrays(cot)
        floats = {n: a for n, a in arrays.items() if jnp.issubdtype(a.dtype, jnp.floating)}

        def loss(floats):
            a = {**arrays, **floats}
            out, w = jax_attn.scaled_dot_product_attention(**a, **config, return_weights=True)
            return jnp.sum(out * d["output"]) + jnp.sum(w * d["weights"]), (out, w)

        grads, (out, w) = jax.grad(loss, has_aux=True)(floats)
        result = {"output": JAX.numpy(out), "weights": JAX.numpy(w),
                  "grads": {n: JAX.numpy(g) for n, g in grads.items()}}
    assert set(result["grads"]) == set(fixture.grads)
    bad = {what: c for what, c in compare_all(fixture, result, "float64").items() if not c.ok}
    assert not bad, f"{name}, seed {seed}: {bad}"
    rows = fixture.expected["weights"].sum(axis=-1) == 0  # empty rows: exact zeros in both
    assert np.all(result["output"][rows] == 0) and np.all(result["weights"][rows] == 0)


# ---- offsets: traced, not static -------------------------------------------------------------

def test_growing_offset_does_not_recompile():
    # Decoding: one new query per step (Lq = 1) at a growing offset, against a fixed cache.
    rng, seed = fresh_rng()
    q, k, v = (jnp.asarray(x) for x in _qkv(rng, lq=1, lk=9))
    step = lambda t: jax_attn.scaled_dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, local_window_size=(3, 0), query_offset=t)
    functional._attention.clear_cache()
    step(0)
    fives = jnp.array([5, 5], "int32")  # made outside the count: its conversion is no step's
    with count_compiles() as compiled:
        outs = [step(t) for t in range(1, 6)] + [step(fives)]
    assert functional._attention._cache_size() == 1
    assert compiled == [], f"a new offset compiled {compiled}"
    np.testing.assert_array_equal(outs[4], outs[5], err_msg=f"seed {seed}")  # int 5 = array 5s
    np.testing.assert_allclose(outs[0], step(1), rtol=0, atol=0)
    assert not np.allclose(outs[0], outs[4])  # the offset is not ignored


def test_int_and_array_offsets_agree_per_batch():
    rng, seed = fresh_rng()
    q, k, v = _qkv(rng)
    kw = dict(is_causal=True, local_window_size=2, return_weights=True)
    both = jax_attn.scaled_dot_product_attention(q, k, v, query_offset=jnp.array([1, 3]), **kw)
    for b, t in enumerate((1, 3)):
        one = jax_attn.scaled_dot_product_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1],
                                                    query_offset=t, **kw)
        for x, y in zip(both, one):
            np.testing.assert_allclose(x[b:b + 1], y, rtol=1e-6, atol=1e-7,
                                       err_msg=f"seed {seed}")


# ---- GQA: by shape, never repeating K and V ---------------------------------------------------

def test_gqa_equals_repeated_kv_with_group_summed_gradients():
    rng, seed = fresh_rng()
    q, k, v = (jnp.asarray(x) for x in _qkv(rng))
    g = H // HKV
    d_out = jnp.asarray(rng.standard_normal((B, H, LQ, DV)), "float32")

    def loss(k, v, repeat):
        if repeat:
            k, v = jnp.repeat(k, g, axis=-3), jnp.repeat(v, g, axis=-3)  # (B, H, Lk, D)
        out = jax_attn.scaled_dot_product_attention(q, k, v, is_causal=True, softcap=3.0)
        return jnp.sum(out * d_out), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(k, v, False)
    (_, out_r), grads_r = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(k, v, True)
    # The same float32 operations per head, XLA free to fuse and order them differently, and
    # the group sums taken in another order: the float32 table. (A fixed rtol 1e-6 failed one
    # output of 0.0137 off by 1.4e-7, seed 998297432: a row whose terms are of size 1 cancel.)
    c = compare(out, out_r, "float32")
    assert c.ok, f"seed {seed}: {c}"
    for a, r in zip(grads, grads_r):
        assert a.shape == (B, HKV, LK, a.shape[-1])
        c = compare(a, r, "float32", "grad")
        assert c.ok, f"seed {seed}: {c}"
    # ... and jax's gradient of jnp.repeat is the group sum of the per-head gradients:
    per_head = jax.grad(lambda k: loss(k, jnp.repeat(v, g, axis=-3), False)[0])(
        jnp.repeat(k, g, axis=-3))  # (B, H, Lk, Dk)
    c = compare(grads[0], per_head.reshape(B, HKV, g, LK, DK).sum(2), "float32", "grad")
    assert c.ok, f"seed {seed}: {c}"


def _tensor_shapes(text):
    """Every tensor type of a lowered program, as tuples of dims."""
    return {tuple(int(n) for n in dims.split("x")[:-1])
            for dims in re.findall(r"tensor<((?:\d+x)+)\w+>", text)}


def _repeated_kv(shapes, sizes):
    """Tensors holding (Lk, D) slices of K or V for more than B·Hkv heads: a repetition."""
    b, hkv, lk, dk, dv = sizes
    return {s for s in shapes for d in (dk, dv)
            if lk in s and d in s and math.prod(s) > b * hkv * lk * d}


@pytest.mark.parametrize("chunk", [None, 2], ids=["one-vmap", "chunks"])
def test_gqa_program_never_repeats_kv(chunk):
    # Sizes that are all distinct primes, so a tensor holding Lk and Dk (or Dv) with more
    # elements than K (or V) itself can only be a repetition of it. Forward and backward.
    b, h, hkv, lq, lk, dk, dv = 2, 6, 2, 5, 11, 13, 17
    q, k, v = (jax.ShapeDtypeStruct(s, jnp.float32)
               for s in [(b, h, lq, dk), (b, hkv, lk, dk), (b, hkv, lk, dv)])
    kw = dict(scale=0.5, is_causal=True, dropout_rate=0.0, precision=jax_attn.DEFAULT_PRECISION,
              return_weights=False, softcap=2.0, window=(3, None), chunk=chunk)

    def loss(q, k, v, repeat=False):
        if repeat:
            k, v = jnp.repeat(k, h // hkv, axis=1), jnp.repeat(v, h // hkv, axis=1)
        out, _ = functional._attention(q, k, v, None, None, None, None, jnp.zeros(b, "int32"),
                                       **kw)
        return jnp.sum(out)

    lowered = lambda repeat: jax.jit(jax.grad(loss, argnums=(0, 1, 2)),  # noqa: E731
                                     static_argnums=3).lower(q, k, v, repeat).as_text()
    sizes = (b, hkv, lk, dk, dv)
    text = lowered(False)
    assert (b, hkv, lk, dk) in _tensor_shapes(text), "K itself is not found: the check is blind"
    assert _repeated_kv(_tensor_shapes(text), sizes) == set()
    assert _repeated_kv(_tensor_shapes(lowered(True)), sizes), "the check misses a repetition"
    dots = re.findall(r"stablehlo\.dot_general.*", text)
    assert dots and all("precision = [HIGHEST, HIGHEST]" in d for d in dots), dots


# ---- empty rows: zeros, never NaN --------------------------------------------------------------

def test_softcap_with_empty_rows_is_finite_and_zero():
    rng, seed = fresh_rng()
    q, k, v = (jnp.asarray(x) for x in _qkv(rng))
    mask = np.ones((B, H, LQ, LK), bool)
    mask[0, 1, 2] = False  # one row fully masked
    kw = dict(softcap=0.5, scale=4.0, local_window_size=(1, 0),
              query_offset=jnp.array([0, 9]),  # batch 1: every key out of the window
              query_seq_lengths=jnp.array([4, 5]))  # batch 0: row 4 past the length

    def loss(q, k, v):
        out, w = jax_attn.scaled_dot_product_attention(q, k, v, jnp.asarray(mask), **kw,
                                                       return_weights=True)
        return jnp.sum(out ** 2) + jnp.sum(w ** 2), (out, w)

    (_, (out, w)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    for x in (out, w, *grads):
        assert np.all(np.isfinite(np.asarray(x))), f"seed {seed}"
    empty = np.zeros((B, H, LQ), bool)
    empty[0, 1, 2] = empty[0, :, 4] = empty[1] = True
    assert np.all(np.asarray(out)[empty] == 0) and np.all(np.asarray(w)[empty] == 0)
    assert np.all(np.asarray(grads[0])[empty] == 0)  # no gradient reaches an empty row's query
    assert np.all(np.asarray(grads[1])[1] == 0) and np.all(np.asarray(grads[2])[1] == 0)
    assert np.all(np.asarray(w)[~empty].sum(-1) > 0.99)  # the other rows are softmaxes


def test_window_is_static_and_normalised():
    # An int w and (w, w) and a JSON list [w, w] are one configuration: one compilation.
    rng, _ = fresh_rng()
    q, k, v = _qkv(rng)
    functional._attention.clear_cache()
    outs = [jax_attn.scaled_dot_product_attention(q, k, v, local_window_size=w)
            for w in (2, (2, 2), [2, 2])]
    assert functional._attention._cache_size() == 1
    assert window([2, None]) == (2, None)
    for o in outs[1:]:
        np.testing.assert_array_equal(outs[0], o)


# ---- sinks and chunks: the heads taken in steps, as on large problems ---------------------------

@pytest.mark.parametrize("heads, implementation", [((H, HKV), "explicit"), ((H, H), "explicit"),
                                                   ((H, 1), "blockwise")],
                         ids=["gqa-explicit", "mha-explicit", "mqa-blockwise"])
def test_sinks_and_chunks_alike_in_one_vmap_and_in_head_steps(heads, implementation):
    # On CPU, large problems take the (batch, kv head) pairs in steps of chunk query heads
    # (functional.heads_per_step), a group larger than a step in steps of its own: each query
    # head must still read its own sink. Forward and the gradients, sinks included.
    rng, seed = fresh_rng()
    q, k, v = (jnp.asarray(x) for x in _qkv(rng, heads=heads))
    sinks, d_out = jnp.asarray(rng.standard_normal(H), "float32"), jnp.asarray(
        rng.standard_normal((B, H, LQ, DV)), "float32")
    kw = dict(scale=0.5, is_causal=True, dropout_rate=0.0, precision=jax_attn.DEFAULT_PRECISION,
              return_weights=False, chunk_size=3, implementation=implementation,
              block_sizes=(2, 3))

    def grads(chunk):
        def loss(q, k, v, sinks):
            out, _ = functional._attention(q, k, v, None, None, None, None, jnp.array([0, 2]),
                                           None, None, sinks, chunk=chunk, **kw)
            return jnp.sum(out * d_out)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)

    whole, steps = grads(None), grads(2)
    for what, a, e in zip(("loss", "query", "key", "value", "sinks"),
                          (steps[0], *steps[1]), (whole[0], *whole[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-6,
                                   err_msg=f"{what}, seed {seed}")

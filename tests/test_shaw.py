"""Shaw's relative positions in GroupedQueryAttention (``relative_positions="shaw"``,
``relative_max_distance`` M: one relative_key_table E (2M + 1, Dh) shared by the heads, the
scores gaining scale · q_i·E[M + clip(p_i − j, −M, M)]): the float64 reference's term by hand and
its backward against finite differences (with Granite's input norm); both twins against the reference (output, weights and
every gradient, float64 and float32) in Granite Speech's blocks (attention_chunk_size,
bidirectional) on right-padded rows, with and without its pre_norm (input_norm="layer"); decoding with a KV cache; the JAX core's distance_query and
distance_keys (the table reversed) against the (L, L) bias the reference forms, blockwise and
explicit; a long sequence through blockwise; the lowered program of the JAX module holding no
(L, L) array; bad settings, the input norm's included. Granite's own modules are tests/test_hf_import_speech.py's.

Shape legend: B batch, L length, D model width (d_in), N heads, Nkv key-value heads, Dh head
width, M relative_max_distance, C the block (attention_chunk_size).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_attn
from golden import reference
from golden.harness.check import compare_all
from golden.specification.implementations import record
from tests.helpers import (JAX, TWINS, assert_central_differences, decoded, fresh_rng,
                           long_blockwise_against_torch, random_cotangents, reference_fixture)

GQA = "grouped_query_attention"
EXACT = 1e-12
B, L, D, N, NKV, DH, M, C = 2, 8, 6, 4, 2, 3, 4, 3
# Granite's layout: blocks of C frames, bidirectional, no q/k/v bias, an output bias, M > C.
GRANITE = dict(d_in=D, num_heads=N, num_kv_heads=NKV, head_dim=DH, d_out=5, out_bias=True,
               causal=False, attention_chunk_size=C, relative_positions="shaw",
               relative_max_distance=M)


def _params(rng, config):
    """Every parameter of ``config``'s module drawn N(0, 0.5²), float32 values in float64."""
    shapes = TWINS["torch"].export(TWINS["torch"].make(GQA, config))
    return {n: (rng.standard_normal(np.shape(a)) * 0.5).astype(np.float32).astype(np.float64)
            for n, a in shapes.items()}


# ---- the reference --------------------------------------------------------------------------

def test_shaw_term_by_hand():
    # L = 3, M = 1, Dh = 1: rows E[0], E[1], E[2] are query − key = −1, 0, 1 (clipped).
    q = np.array([[[1.0], [2.0], [3.0]]])  # (N = 1, L, Dh)
    table = np.array([[10.0], [20.0], [30.0]])  # (2M + 1, Dh)
    bias, _ = reference.shaw_term(q, table, 0.5)
    t = np.array([[20, 10, 10], [30, 20, 10], [30, 30, 20]])  # E[1 + clip(i − j, −1, 1)]
    np.testing.assert_array_equal(bias[0], 0.5 * q[0] * t)


def test_reference_gradients_match_finite_differences():
    # The loss Σ y⊙dy + Σ A⊙dA of the reference module (Granite's blocks, a padded row) against
    # central differences in every float input and parameter, the table included.
    rng, seed = fresh_rng()
    config = dict(GRANITE, qkv_bias=True, input_norm="layer", input_norm_eps=1e-3)
    params = _params(rng, config)
    inputs = {"x": rng.standard_normal((B, 7, D)),
              "query_seq_lengths": np.array([7, 5], np.int32)}
    forward, backward = reference.VARIANTS[GQA]
    out, weights, saved = forward(config, inputs, params)
    cot = {n: a.astype(np.float64) for n, a in random_cotangents(
        rng, out.shape, weights.shape).items()}
    grads = backward(saved, cot["output"], cot["weights"])

    def loss():
        y, w, _ = forward(config, inputs, params)
        return np.sum(y * cot["output"]) + np.sum(w * cot["weights"])

    assert_central_differences(loss, (inputs, params), grads, f"seed {seed}:")
    # rows past the farthest distance a block holds (|t| ≥ C) see no pair: zero by structure
    assert np.all(grads["relative_key_table"][[0, 2 * M]] == 0)
    assert np.all(grads["relative_key_table"][M - C + 1:M + C] != 0)


# ---- the twins against the reference ----------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("framework", list(TWINS))
@pytest.mark.parametrize("config", [
    pytest.param(GRANITE, id="granite_blocks"),
    pytest.param(dict(GRANITE, input_norm="layer"), id="granite_input_norm"),
    pytest.param(dict(d_in=D, num_heads=N, num_kv_heads=NKV, head_dim=2, qkv_bias=True,
                      scale=0.7, rope_theta=50.0, relative_positions="shaw",
                      relative_max_distance=2), id="causal_rope_clipped"),
])
def test_twin_matches_the_reference(framework, dtype, config):
    # Output, weights and the gradients of every float input and parameter (the table's
    # included), fresh inputs, a right-padded row of a length not a multiple of C.
    twin, (rng, seed) = TWINS[framework], fresh_rng()
    params = {n: a.astype(dtype) for n, a in _params(rng, config).items()}
    inputs = {"x": rng.standard_normal((B, L, D)).astype(np.float32),
              "query_seq_lengths": np.array([L, 5], np.int32)}
    out, weights, _ = reference.VARIANTS[GQA][0](config, inputs, params)
    fixture = reference_fixture(GQA, config, inputs, params,
                                random_cotangents(rng, out.shape, weights.shape), dtype)
    assert "relative_key_table" in fixture.grads
    with twin.float64(dtype == "float64"):
        module = twin.build(GQA, config, params)
        module.eval()
        result = twin.run_with_grads(module, fixture, dtype)
    assert set(result["grads"]) == set(fixture.grads)
    bad = {what: c for what, c in compare_all(fixture, result, dtype).items() if not c.ok}
    assert not bad, f"{framework} {dtype}, seed {seed}: {bad}"


@pytest.mark.parametrize("framework", list(TWINS))
def test_decoding_equals_the_full_forward(framework):
    # Causal, with a cache: token i at position cache length + i reads E at M + clip(p − j),
    # as in the full forward; prefill of 3 then one token at a time, float64.
    twin, (rng, seed) = TWINS[framework], fresh_rng()
    config = dict(d_in=D, num_heads=N, num_kv_heads=NKV, head_dim=2, rope_theta=50.0,
                  relative_positions="shaw", relative_max_distance=2)
    x = rng.standard_normal((B, L, D))
    with twin.float64():
        module = twin.build(GQA, config, _params(rng, config))
        module.eval()
        full = twin.numpy(module(twin.array(x)))
        steps = decoded(twin, module, x, 3)
    assert np.abs(steps - full).max() <= EXACT, f"seed {seed}"


# ---- JAX: the table reversed as distance_keys, per block ---------------------------------------

@pytest.mark.parametrize("implementation", ["explicit", "blockwise"])
def test_distance_keys_are_the_table_reversed(implementation):
    # The JAX module's distance_query scale·q and distance_keys E[::-1] (one per head) equal the
    # reference's (L, L) bias given to explicit, in blocks of C (bidirectional) with a padded
    # row: output, and the gradients of q, k, v and of the table, float64.
    rng, seed = fresh_rng()
    lq, scale = 11, 0.6
    q, k, v = (rng.standard_normal((B, n, lq, DH)) for n in (N, NKV, NKV))
    table = rng.standard_normal((2 * M + 1, DH))
    d_out = rng.standard_normal((B, N, lq, DH))
    settings = dict(attention_chunk_size=C, scale=scale,
                    key_value_seq_lengths=np.array([lq, 8], np.int32),
                    query_seq_lengths=np.array([lq, 8], np.int32))
    kw = {"block_sizes": (2, 4)} if implementation == "blockwise" else {}
    with JAX.float64():
        def shaw(q, k, v, table):
            keys = jnp.broadcast_to(table[::-1], (N,) + table.shape)
            return jnp.sum(d_out * jax_attn.scaled_dot_product_attention(
                q, k, v, distance_query=q * scale, distance_keys=keys,
                implementation=implementation, **kw, **settings))

        def biased(q, k, v, table):
            span = np.clip(np.arange(lq)[:, None] - np.arange(lq), -M, M) + M
            bias = scale * jnp.einsum("bnid,ijd->bnij", q, table[span])
            return jnp.sum(d_out * jax_attn.scaled_dot_product_attention(
                q, k, v, None, bias, implementation="explicit", **settings))

        with record() as ran:
            got = jax.value_and_grad(shaw, argnums=(0, 1, 2, 3))(q, k, v, table)
        want = jax.value_and_grad(biased, argnums=(0, 1, 2, 3))(q, k, v, table)
    assert ("jax", implementation) in ran
    ref_bias, _ = reference.shaw_term(q, table, scale)  # the reference's bias is the one above
    span = np.clip(np.arange(lq)[:, None] - np.arange(lq), -M, M) + M
    np.testing.assert_allclose(ref_bias, scale * np.einsum("bnid,ijd->bnij", q, table[span]),
                               rtol=0, atol=1e-13)
    assert abs(float(got[0]) - float(want[0])) <= EXACT * abs(float(want[0])), f"seed {seed}"
    for name, a, b in zip("qkvE", got[1], want[1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=EXACT,
                                   err_msg=f"{name}, seed {seed}")


def test_a_long_sequence_runs_blockwise_and_equals_torch():
    # L = 1100 > 1024: the JAX core takes "blockwise", which forms the position term block by
    # block; torch forms the (N, L, L) bias. Blocks of C = 96 frames (the last one 44: 1100 is
    # not a multiple of C), M = 120 > C. Float64.
    out, expected, ran, seed = long_blockwise_against_torch(
        dict(d_in=4, num_heads=3, num_kv_heads=1, head_dim=2, d_out=2, causal=False,
             attention_chunk_size=96, relative_positions="shaw", relative_max_distance=120))
    assert ("jax", "blockwise") in ran
    assert np.abs(out - expected).max() <= EXACT * np.abs(expected).max(), f"seed {seed}"


def test_the_modules_program_holds_no_length_squared_array():
    # The JAX module's forward and gradient at L = 4096 (blockwise, blocks of Bq = Bk = 1024):
    # its largest array is one block's products with its band of distances (N, Bq, Bq + Bk −
    # 1), never an (L, L) bias or scores.
    length, config = 4096, dict(d_in=4, num_heads=2, num_kv_heads=2, head_dim=4, causal=False,
                                attention_chunk_size=200, relative_positions="shaw",
                                relative_max_distance=200)
    module = jax_attn.build(GQA, config, _params(np.random.default_rng(0), config))
    graphdef, state = nnx.split(module)

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x))

    x = jax.ShapeDtypeStruct((1, length, 4), jnp.float32)
    with record() as ran:
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).as_text()
    assert ("jax", "blockwise") in ran and "stablehlo.while" in text
    sizes = [int(np.prod([int(n) for n in dims.split("x")[:-1]]))
             for dims in re.findall(r"tensor<((?:\d+x)+)\w+>", text)]
    assert max(sizes) <= 2 * 1024 * (2 * 1024 - 1) < length * length, max(sizes)


# ---- settings ---------------------------------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    (dict(relative_positions="shaw"),
     r"relative_max_distance should be given with relative_positions='shaw' \(the table's "
     r"rows: distances −M … M\), got None"),
    (dict(relative_max_distance=4),
     r"relative_max_distance should be None unless relative_positions is 'shaw', got 4"),
    (dict(relative_positions="transformer_xl", relative_max_distance=4),
     r"relative_max_distance should be None unless relative_positions is 'shaw', got 4"),
    (dict(input_norm="rms"), r"input_norm should be None or one of 'layer', got 'rms'"),
    (dict(input_norm_eps=1e-6),
     r"input_norm_eps should be 1e-05 \(its default\) unless input_norm is set, got 1e-06"),
    (dict(input_norm="layer", input_norm_eps=0.0),
     r"input_norm_eps should be a positive number, got 0.0"),
    (dict(relative_positions="shaw", relative_max_distance=0),
     r"relative_max_distance should be a positive int, got 0"),
    (dict(relative_positions="shaw", relative_max_distance=2, alibi="bloom"),
     r"alibi should be None with relative_positions \(one position bias\), got 'bloom'"),
    (dict(relative_positions="shaw", relative_max_distance=2, causal=False,
          relative_attention_num_buckets=8),
     r"relative_attention_num_buckets should be None with relative_positions \(one position "
     r"bias\), got 8"),
])
@pytest.mark.parametrize("framework", list(TWINS))
def test_bad_shaw_settings(framework, change, message):
    with pytest.raises(ValueError, match=message):
        TWINS[framework].make(GQA, dict(dict(d_in=6, num_heads=2, num_kv_heads=2, head_dim=4),
                                        **change))

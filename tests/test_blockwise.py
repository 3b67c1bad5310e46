"""The JAX core's blockwise (flash) implementation, ``implementation="blockwise"``
(jax_attn.blockwise): against the float64 reference on every core fixture (output and every
gradient, small blocks so that each length spans several blocks, the last one mostly ragged),
against "explicit" on fresh inputs with every feature at once (float64), drawn dropout
(deterministic, the rate, explicit given the same mask, one stream per head however the heads
are mapped), empty rows, skipping by index, memory that grows linearly, one compilation per
shape, the automatic choice, each name running its algorithm, and the errors.

Shape legend: B batch, H query heads, Hkv key-value heads, Lq query length, Lk key length, Dk key
width, Dv value width; Bq, Bk the block sizes.
"""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import golden
import jax_attn
from golden import runners
from golden.specification import variants
from golden.specification.implementations import Asked, record
from golden.specification.tolerances import compare
from jax_attn import blockwise, functional
from tests.helpers import JAX, count_compiles, fixture_of, fixture_sweep, fresh_rng, matrix

BLOCKS = (2, 3)  # (Bq, Bk): the fixtures' lengths 5, 7, 8, 9 span several blocks
SDPA_FIXTURES = [n for n in golden.names() if fixture_of(n).variant == variants.SDPA]
B, H, HKV, LQ, LK, DK, DV = 2, 6, 2, 7, 11, 4, 3  # every size different; G = 3


def _blockwise(*args, **kw):
    return jax_attn.scaled_dot_product_attention(*args, implementation="blockwise", **kw)


def _grads(fn, arrays, d_out, **kw):
    """The output of fn(**arrays, **kw) and the gradients of Σ O ⊙ dO for every float array,
    as float64 NumPy; one compiled program (see _grads_of)."""
    return _grads_of(fn, **kw)(arrays, d_out)


def _grads_of(fn, **kw):
    """A jitted arrays, dO -> (output, {name: gradient}) of fn(**arrays, **kw), as float64
    NumPy: one compilation for every call with the same shapes."""
    @jax.jit
    def run(floats, others, d_out):
        def loss(floats):
            out = fn(**others, **floats, **kw)
            return jnp.sum(out.astype(d_out.dtype) * d_out), out

        return jax.grad(loss, has_aux=True)(floats)

    def call(arrays, d_out):
        floats = {n: a for n, a in arrays.items() if jnp.issubdtype(a.dtype, jnp.floating)}
        others = {n: a for n, a in arrays.items() if n not in floats}
        grads, out = run(floats, others, d_out)
        return JAX.numpy(out), {n: JAX.numpy(g) for n, g in grads.items()}

    return call


# ---- against the float64 reference, on every core fixture ---------------------------------------

# The whole matrix runs every fixture at every dtype it lists (a new shape or setting costs
# about 1 s of tracing and compiling for the forward and backward). The quick suite runs a
# covering few of the runs below (tests/helpers.py ``sweep``: every dtype, option and input
# kind at least once), chosen among each fixture at one dtype: float32, the tolerance table's
# tightest test of the arithmetic (it caught a log-sum-exp rounded at large logits), except a
# few feature-rich ones at float64 (1e-13) and the low-precision ones at bfloat16 and float16.
FIXTURE_DTYPES = {"sdpa_window_softcap_mask": "float64", "sdpa_lengths": "float64",
                  "sdpa_gqa_causal_offset": "float64", "sdpa_dropout_causal_bias": "float64",
                  "sdpa_mqa_decode_ragged": "float64", "sdpa_bias_query1": "float64",
                  "sdpa_low_precision_gqa_softcap": "bfloat16",
                  "sdpa_low_precision_bias_dropout_masked_row": "float16",
                  "sdpa_sinks_gqa_causal_window": "float64", "sdpa_sinks_masked_row": "float64",
                  "sdpa_chunks_offset_lengths": "float64", "sdpa_sinks_chunks_softcap": "float64"}


def _fixture_cases(chosen=FIXTURE_DTYPES):
    """(fixture, dtype) for every core fixture at every dtype it lists: those of ``chosen``
    (float32 by default) first, a covering few of them in the quick suite, the rest in the
    whole matrix only."""
    first = [(n, chosen.get(n, "float32")) for n in SDPA_FIXTURES]
    more = [(n, d) for n in SDPA_FIXTURES for d in fixture_of(n).dtypes if (n, d) not in first]
    return fixture_sweep(first) + [pytest.param(n, d, id=f"{n}-{d}", marks=matrix) for n, d in more]


@pytest.mark.parametrize("name, dtype", _fixture_cases())
def test_fixture_matches_reference(name, dtype):
    # The fixture's loss without its weights term (blockwise never forms the weights):
    # L = Σ O ⊙ dO, whose gradients the reference gives with dA = 0.
    fixture = golden.load(name)
    config = variants.get(fixture.variant).config(fixture.config)
    out_ref, weights_ref = fixture.expected["output"], fixture.expected["weights"]
    d_out = fixture.cotangents["output"]
    expected = runners.run_reference(fixture, weights_cotangent=False)["grads"]
    with jax.enable_x64(dtype == "float64"):
        out, grads = _grads(_blockwise, JAX.arrays(fixture.inputs, dtype),
                            jnp.asarray(d_out, "float32"), **config, block_sizes=BLOCKS)
    assert set(grads) == set(expected)
    comps = {"output": compare(out, out_ref, dtype)}
    terms = {n: weights_ref.size // fixture.inputs[n].size for n in ("bias", "sinks")
             if n in grads}  # summed over the weights (sinks: over each head's rows)
    comps.update({f"grad {n}": compare(g, expected[n], dtype, "grad", terms=terms.get(n, 1))
                  for n, g in grads.items()})  # a broadcast bias sums terms partial gradients
    bad = {what: c for what, c in comps.items() if not c.ok}
    assert not bad, f"blockwise {dtype} {name}: {bad}"


# ---- against explicit, fresh inputs, every feature at once -------------------------------

def _qkv(rng, lead=(B,), heads=(H, HKV), lq=LQ, lk=LK, dk=DK, dv=DV):
    """q (..., H, Lq, Dk), k (..., Hkv, Lk, Dk), v (..., Hkv, Lk, Dv) as float64 NumPy."""
    return {n: rng.standard_normal(s) for n, s in
            [("query", lead + (heads[0], lq, dk)), ("key", lead + (heads[1], lk, dk)),
             ("value", lead + (heads[1], lk, dv))]}


DENSE_CASES = {  # (inputs beyond q, k, v: shapes or values; the core's settings)
    "causal_offsets_lengths_softcap_bias": (
        dict(bias=(B, 1, LQ, 1), query_offset=np.array([0, 5], "int32"),
             key_value_seq_lengths=np.array([11, 4], "int32")),
        dict(is_causal=True, softcap=1.5, scale=0.8, local_window_size=(4, None))),
    "windows_lengths_mask_unbatched_mqa": (
        dict(lead=(), heads=(H, 1), mask=(H, LQ, LK), bias=(LK,),
             query_offset=np.array(3, "int32"), query_seq_lengths=np.array(5, "int32"),
             key_value_seq_lengths=np.array(9, "int32")),
        dict(local_window_size=(2, 3), softcap=3.0)),
    "sinks_chunks_causal_offsets_lengths": (
        dict(sinks=(H,), bias=(B, 1, LQ, LK), query_offset=np.array([2, 6], "int32"),
             query_seq_lengths=np.array([7, 5], "int32")),
        dict(is_causal=True, attention_chunk_size=4, softcap=2.0)),
}


@pytest.mark.parametrize("name", DENSE_CASES)
def test_matches_explicit_float64(name):
    # GQA (H = 6, Hkv = 2), Lq ≠ Lk, broadcast biases and masks, traced offsets and lengths:
    # the same maths in another order, so float64 agrees to rounding (1e-13).
    rng, seed = fresh_rng()
    given, config = DENSE_CASES[name]
    given = dict(given)
    inputs = _qkv(rng, lead=given.pop("lead", (B,)), heads=given.pop("heads", (H, HKV)))
    for n, x in given.items():
        inputs[n] = (rng.random(x) < 0.7 if n == "mask" else rng.standard_normal(x)
                     ) if isinstance(x, tuple) else x
    d_out = rng.standard_normal(inputs["query"].shape[:-1] + (DV,))
    with jax.enable_x64(True):
        arrays = JAX.arrays(inputs)
        explicit = _grads(jax_attn.scaled_dot_product_attention, arrays, jnp.asarray(d_out),
                          implementation="explicit", **config)
        blocks = _grads(_blockwise, arrays, jnp.asarray(d_out), block_sizes=(3, 4), **config)
    assert set(blocks[1]) == {"query", "key", "value", "bias"} | set(inputs) & {"sinks"}
    for what, a, e in [("output", blocks[0], explicit[0])] + [
            (f"grad {n}", blocks[1][n], g) for n, g in explicit[1].items()]:
        assert a.shape == e.shape, what
        np.testing.assert_allclose(a, e, rtol=1e-12, atol=1e-13, err_msg=f"{what}, seed {seed}")


# ---- dropout drawn per block --------------------------------------------------------------------

def test_drawn_dropout_is_deterministic_keeps_the_rate_and_equals_explicit_with_its_mask():
    # With V = I (Lk = Dv) the output is the applied weights A = P · keep / (1 − p): the drawn
    # keep-mask is read back (every P > 0 here) and, given to explicit as dropout_mask,
    # gives the same output and gradients: the backward regenerates the forward's mask. One
    # head (a key per head, under vmap, takes seconds to compile; the chunked test below draws
    # for many).
    rng, seed = fresh_rng()
    rate, lq, lk = 0.3, 48, 64
    inputs = _qkv(rng, lead=(), heads=(1, 1), lq=lq, lk=lk, dv=lk)
    inputs["value"] = np.eye(lk)[None]
    d_out = jnp.asarray(rng.standard_normal((1, lq, lk)))
    with jax.enable_x64(True):
        arrays = JAX.arrays(inputs)
        run = _grads_of(_blockwise, dropout_rate=rate, block_sizes=(16, 32))  # 3 × 2 blocks
        out, grads = run({**arrays, "dropout_rng": jax.random.key(seed)}, d_out)
        again, _ = run({**arrays, "dropout_rng": jax.random.key(seed)}, d_out)
        other, _ = run({**arrays, "dropout_rng": jax.random.key(seed + 1)}, d_out)
        keep = out > 0  # (1, Lq, Lk)
        explicit = _grads(jax_attn.scaled_dot_product_attention, {**arrays, "dropout_mask":
                          jnp.asarray(keep)}, d_out, dropout_rate=rate,
                          implementation="explicit")
        _, weights = jax_attn.scaled_dot_product_attention(**arrays, return_weights=True)
    np.testing.assert_array_equal(out, again)  # deterministic for a key
    assert not np.array_equal(keep, other > 0), f"seed {seed}: the key is ignored"
    assert abs(keep.mean() - (1 - rate)) < 0.04, f"seed {seed}"  # 3072 draws: σ = 0.008
    blocks = keep[0, :16].reshape(16, 2, 32)  # key blocks 0 and 1 of query block 0
    assert not np.array_equal(blocks[:, 0], blocks[:, 1]), f"seed {seed}: blocks share a mask"
    np.testing.assert_allclose(out[keep] * (1 - rate), JAX.numpy(weights)[keep], rtol=1e-13)
    np.testing.assert_allclose(out, explicit[0], rtol=1e-13, atol=1e-14, err_msg=f"seed {seed}")
    for n, g in explicit[1].items():
        np.testing.assert_allclose(grads[n], g, rtol=1e-12, atol=1e-13, err_msg=f"{n}, {seed}")


def test_chunked_heads_draw_the_same_streams():
    # On CPU, large problems take the (batch, head) pairs in chunks (functional.heads_per_step):
    # each head draws from its own stream fold_in(key, b·H + h) whichever way they are mapped.
    # V = I reads the keep-masks back: each head's differs.
    rng, seed = fresh_rng()
    arrays = JAX.arrays(_qkv(rng, dv=LK), "float32")
    arrays["value"] = jnp.broadcast_to(jnp.eye(LK), arrays["value"].shape)
    # mask, shared by a batch's heads: fixed, every key but 1. A random one (True with
    # probability 0.8) left seed 47 six allowed entries in batch 0, where two of its six heads'
    # keep-masks (0.58 agreement per entry) then coincided 40 % of the time.
    extras = (jnp.asarray(np.broadcast_to(np.arange(LK) != 1, (B, 1, 1, LK))),
              jnp.asarray(rng.standard_normal((B, 1, LQ, LK)), "float32"),  # bias
              None, jax.random.key(seed), jnp.array([0, 3]), None, jnp.array([LK, 6]))
    kw = dict(scale=0.5, is_causal=True, softcap=2.0, window=(5, None), dropout_rate=0.3,
              precision=jax_attn.DEFAULT_PRECISION, return_weights=False,
              implementation="blockwise", block_sizes=(2, 3))
    outs = [np.asarray(functional._attention(*arrays.values(), *extras, chunk=chunk, **kw)[0])
            for chunk in (None, 2)]
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-7, err_msg=f"seed {seed}")
    keep = outs[0] > 0  # (B, H, Lq, Lk)
    assert keep.sum() > 60, f"seed {seed}: compares zeros"  # about 190 of 924 kept
    heads = keep.reshape(B * H, -1)
    assert len({h.tobytes() for h in heads}) == B * H, f"seed {seed}: heads share a mask"


# ---- empty rows, skipping by index ------------------------------------------------------------

def test_empty_rows_give_zeros_and_zero_gradients():
    rng, seed = fresh_rng()
    inputs = _qkv(rng)
    mask = np.ones((B, H, LQ, LK), bool)
    mask[0, 1, 2] = False  # one row fully masked
    kw = dict(softcap=0.5, scale=4.0, local_window_size=(1, 0), block_sizes=(2, 3),
              query_offset=jnp.array([0, 20]),  # batch 1: every key out of the window
              query_seq_lengths=jnp.array([5, 7]))  # batch 0: rows 5 and 6 past the length
    out, grads = _grads(_blockwise, {**JAX.arrays(inputs, "float32"), "mask": jnp.asarray(mask)},
                        jnp.ones((B, H, LQ, DV)), **kw)
    for x in (out, *grads.values()):
        assert np.all(np.isfinite(x)), f"seed {seed}"
    empty = np.zeros((B, H, LQ), bool)
    empty[0, 1, 2] = True
    empty[0, :, 5:] = empty[1] = True
    assert np.all(out[empty] == 0) and np.all(grads["query"][empty] == 0)
    assert np.all(out[~empty] != 0)
    assert np.all(grads["key"][1] == 0) and np.all(grads["value"][1] == 0)


def test_blocks_outside_the_allowed_set_are_never_read():
    # Keys that no query may see, in key blocks wholly past the causal bound or the lengths,
    # hold NaN: the blockwise path never reads them (a masked read would give NaN · 0).
    rng, seed = fresh_rng()
    inputs = _qkv(rng, lq=6, lk=15)
    kw = dict(is_causal=True, key_value_seq_lengths=jnp.array([15, 3]), block_sizes=(2, 3))
    poisoned = {n: x.copy() for n, x in inputs.items()}
    for n in ("key", "value"):
        poisoned[n][:, :, 6:] = np.nan  # past every query's position (0 … 5): key blocks 2-4
        poisoned[n][1, :, 3:] = np.nan  # batch 1: past its length 3, key blocks 1-4
    d_out = jnp.asarray(rng.standard_normal((B, H, 6, DV)), "float32")
    run = _grads_of(_blockwise, **kw)
    clean, dirty = run(JAX.arrays(inputs, "float32"), d_out), run(JAX.arrays(poisoned, "float32"),
                                                                  d_out)
    np.testing.assert_array_equal(dirty[0], clean[0], err_msg=f"seed {seed}")
    np.testing.assert_array_equal(dirty[1]["query"], clean[1]["query"], err_msg=f"seed {seed}")
    for n in ("key", "value"):
        seen = np.isfinite(poisoned[n])
        np.testing.assert_array_equal(dirty[1][n][seen], clean[1][n][seen])
        assert np.all(clean[1][n][~seen] == 0)


def test_blocks_outside_the_chunks_are_never_read():
    # Chunks of 4 (attention_chunk_size), queries at 4 … 7 (batch 0) and 8 … 11 (batch 1): the
    # keys of the other chunks hold NaN, in whole key blocks of 2, and are never read, with a
    # sink (whose gradient they would poison too) and without causality.
    rng, seed = fresh_rng()
    inputs = {**_qkv(rng, lq=4, lk=12), "sinks": rng.standard_normal(H)}
    kw = dict(attention_chunk_size=4, query_offset=jnp.array([4, 8]), block_sizes=(2, 2))
    poisoned = {n: x.copy() for n, x in inputs.items()}
    for n in ("key", "value"):
        poisoned[n][0, :, :4] = poisoned[n][0, :, 8:] = np.nan
        poisoned[n][1, :, :8] = np.nan
    d_out = jnp.asarray(rng.standard_normal((B, H, 4, DV)), "float32")
    run = _grads_of(_blockwise, **kw)
    clean, dirty = run(JAX.arrays(inputs, "float32"), d_out), run(JAX.arrays(poisoned, "float32"),
                                                                  d_out)
    np.testing.assert_array_equal(dirty[0], clean[0], err_msg=f"seed {seed}")
    for n in ("query", "sinks"):
        np.testing.assert_array_equal(dirty[1][n], clean[1][n], err_msg=f"{n}, seed {seed}")
    for n in ("key", "value"):
        seen = np.isfinite(poisoned[n])
        np.testing.assert_array_equal(dirty[1][n][seen], clean[1][n][seen])
        assert np.all(clean[1][n][~seen] == 0)


def test_sink_at_minus_infinity_is_no_sink():
    # The online softmax starts from the sink: at −inf it must start as without one (m finite,
    # l = 0), a fully masked row included (zeros, not NaN), the sink's gradient 0.
    rng, seed = fresh_rng()
    inputs = _qkv(rng)
    mask = np.ones((B, 1, LQ, LK), bool)
    mask[1, 0, 3] = False
    arrays = {**JAX.arrays(inputs, "float32"), "mask": jnp.asarray(mask)}
    d_out = jnp.asarray(rng.standard_normal((B, H, LQ, DV)), "float32")
    kw = dict(is_causal=True, block_sizes=(2, 3))
    plain = _grads(_blockwise, arrays, d_out, **kw)
    sunk = _grads(_blockwise, {**arrays, "sinks": jnp.full(H, -jnp.inf)}, d_out, **kw)
    np.testing.assert_array_equal(sunk[0], plain[0], err_msg=f"seed {seed}")
    for n, g in plain[1].items():
        np.testing.assert_array_equal(sunk[1][n], g, err_msg=f"{n}, seed {seed}")
    assert np.all(sunk[1]["sinks"] == 0) and np.all(sunk[0][1, :, 3] == 0)


@pytest.mark.parametrize("is_causal, offset, expected", [
    (False, 0, 12),  # each query block of 2 visits the 2 key blocks of its chunk of 4
    (True, 0, 9),  # and causally 1 or 2 of them: 3 per chunk (causal alone: 21)
    (True, 2, 8),  # positions 2 … 13: 2, 1, 2, 1, 2 blocks, and none past key 11 for 12, 13
])
def test_visited_blocks_count_only_the_chunks(is_causal, offset, expected):
    st = blockwise.Static(1.0, is_causal, None, (None, None), 0.0, jax_attn.DEFAULT_PRECISION,
                          2, 2, chunk_size=4)
    x = jnp.zeros((12, 4))
    h = blockwise.Head.make(st, x, x, x, None, None, None, None, jnp.int32(offset), None, None)
    assert int(blockwise.visited(st, h)) == expected


# ---- the compiled program: linear memory, one compilation, no (Lq, Lk) tensor --------------------

def _fwd_bwd(implementation, length):
    """Forward and backward at B = H = 1, D = 64, causal, as a lowered program."""
    x = jax.ShapeDtypeStruct((1, 1, length, 64), jnp.float32)

    def loss(q, k, v):
        out = jax_attn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                    implementation=implementation)
        return jnp.sum(out)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x)


def test_memory_grows_linearly():
    temp = {}
    for implementation in ("blockwise", "explicit"):
        for length in (4096, 8192):
            analysis = _fwd_bwd(implementation, length).compile().memory_analysis()
            if analysis is None:
                pytest.skip("this backend's compiled programs give no memory_analysis()")
            temp[implementation, length] = analysis.temp_size_in_bytes
    blocks = temp["blockwise", 8192] / temp["blockwise", 4096]
    explicit = temp["explicit", 8192] / temp["explicit", 4096]
    assert blocks < 3, f"blockwise temp memory grows ×{blocks:.2f} for ×2 length: {temp}"
    assert explicit > 3, f"explicit should grow ~×4 (the check is blind otherwise): {temp}"
    assert temp["blockwise", 8192] < 64 * 2**20, temp  # far below one (L, L) float32 array


def test_program_never_forms_the_scores_and_keeps_precision():
    lq, lk, d = 64, 96, 8
    q = jax.ShapeDtypeStruct((1, 1, lq, d), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 1, lk, d), jnp.float32)

    def loss(q, k, v):
        out = _blockwise(q, k, v, is_causal=True, softcap=2.0, block_sizes=(16, 32),
                         precision=jax.lax.Precision.HIGH)
        return jnp.sum(out)

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k).as_text()
    sizes = [int(np.prod([int(n) for n in dims.split("x")[:-1]]))
             for dims in re.findall(r"tensor<((?:\d+x)+)\w+>", text)]
    assert "stablehlo.while" in text  # the blockwise path ran
    assert max(sizes) <= max(16 * 32, lk * d) < lq * lk // 4, max(sizes)  # K, or one block
    dots = re.findall(r"stablehlo\.dot_general.*", text)
    assert len(dots) >= 7 and all("precision = [HIGH, HIGH]" in d for d in dots), dots


def _materialised(distance_bias, lq, lk, offset):
    """distance_bias (H, 2S + 1) as the (B, H, Lq, Lk) bias it stands for, by NumPy loops:
    row i of batch b at position i + offset[b], key j, entry S + clip(j − position, −S, S)."""
    span = (distance_bias.shape[-1] - 1) // 2
    out = np.empty((len(offset), distance_bias.shape[0], lq, lk))
    for b, h, i, j in np.ndindex(out.shape):
        out[b, h, i, j] = distance_bias[h, span + min(max(j - (i + offset[b]), -span), span)]
    return out


@pytest.mark.parametrize("implementation", ["explicit", "blockwise"])
@pytest.mark.parametrize("span", [3, LQ + LK])  # 3: most distances take an end of the table
def test_distance_bias_equals_the_bias_it_stands_for(implementation, span):
    # ALiBi's and T5's biases depend on key − query only: passed as (H, 2S + 1), blockwise
    # gathers each block's terms. Output and every gradient, the table's included (dS summed
    # into each distance's entry), equal explicit with the (B, H, Lq, Lk) bias, float64.
    rng, seed = fresh_rng()
    arrays = _qkv(rng)
    table = rng.standard_normal((H, 2 * span + 1))
    offset = np.array([0, 5], "int32")
    settings = dict(query_offset=offset, key_value_seq_lengths=np.array([LK, 6], "int32"),
                    is_causal=True, local_window_size=(6, None))
    kw = {"block_sizes": BLOCKS} if implementation == "blockwise" else {}
    fn = partial(jax_attn.scaled_dot_product_attention, implementation=implementation, **kw)
    d_out = JAX.array(rng.standard_normal((B, H, LQ, DV)), "float64")
    with JAX.float64():
        out, grads = _grads(lambda distance_bias, **a: fn(**a, distance_bias=distance_bias),
                            JAX.arrays({**arrays, "distance_bias": table}, "float64"), d_out,
                            **settings)
        ref, ref_grads = _grads(partial(jax_attn.scaled_dot_product_attention,
                                        implementation="explicit"),
                                JAX.arrays({**arrays, "bias": _materialised(table, LQ, LK,
                                                                            offset)}, "float64"),
                                d_out, **settings)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-12, err_msg=f"seed {seed}")
    for n in ("query", "key", "value"):
        np.testing.assert_allclose(grads[n], ref_grads[n], rtol=0, atol=1e-12,
                                   err_msg=f"{n}, seed {seed}")
    # the table's gradient: the bias's gradient summed over the entries that read each distance
    index = _materialised(np.arange(2 * span + 1.0)[None].repeat(H, 0), LQ, LK, offset)
    expected = np.zeros_like(table)
    for b, h, i, j in np.ndindex(index.shape):
        expected[h, int(index[b, h, i, j])] += ref_grads["bias"][b, h, i, j]
    np.testing.assert_allclose(grads["distance_bias"], expected, rtol=0, atol=1e-12,
                               err_msg=f"seed {seed}")


def test_distance_bias_is_never_formed_as_scores():
    # The blockwise program holds the table (2S + 1) and one block's terms, never (Lq, Lk).
    lq, lk, d = 64, 96, 8
    q = jax.ShapeDtypeStruct((1, 2, lq, d), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 2, lk, d), jnp.float32)
    table = jax.ShapeDtypeStruct((2, 2 * (lq + lk) + 1), jnp.float32)

    def loss(q, k, v, table):
        return jnp.sum(_blockwise(q, k, v, is_causal=True, distance_bias=table,
                                  block_sizes=(16, 32)))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(q, k, k, table).as_text()
    sizes = [int(np.prod([int(n) for n in dims.split("x")[:-1]]))
             for dims in re.findall(r"tensor<((?:\d+x)+)\w+>", text)]
    assert "stablehlo.while" in text
    assert max(sizes) <= 2 * max(16 * 32, lk * d) < lq * lk, max(sizes)


@pytest.mark.parametrize("shape, match", [
    ((H, 8), r"distance_bias's last axis D should be odd .* got D = 8"),
    ((HKV, 9), r"distance_bias shape should be \(H, D\) = \(6, \?\), got \(2, 9\)"),
    ((3, H, 9), r"distance_bias shape should be \(B, H, D\) = \(2, 6, \?\), got \(3, 6, 9\)"),
])
def test_bad_distance_bias(shape, match):
    arrays = JAX.arrays(_qkv(np.random.default_rng(0)), "float32")
    with pytest.raises(ValueError, match=match):
        jax_attn.scaled_dot_product_attention(**arrays, distance_bias=jnp.zeros(shape))


def test_new_offsets_and_lengths_do_not_recompile():
    rng, seed = fresh_rng()
    arrays = JAX.arrays(_qkv(rng), "float32")

    def step(t, n):
        return _blockwise(**arrays, is_causal=True, local_window_size=(4, 0), query_offset=t,
                          key_value_seq_lengths=jnp.array([n, LK]), block_sizes=(2, 3))

    functional._attention.clear_cache()
    first = step(0, 5)
    with count_compiles() as compiled:
        outs = [step(t, n) for t, n in ((1, 5), (3, 9), (jnp.array([3, 3]), 9))]
    assert functional._attention._cache_size() == 1
    assert compiled == [], f"a new offset compiled {compiled}"
    np.testing.assert_array_equal(outs[1], outs[2], err_msg=f"seed {seed}")  # int 3 = 3s
    assert not np.allclose(first, outs[0])  # the offset is not ignored


# ---- the automatic choice and errors ------------------------------------------------------------

def auto(q_shape, k_shape, **asked):
    """The implementation None runs for these shapes and demands."""
    return functional.IMPLEMENTATIONS.select(None, Asked(**asked),
                                             functional.choose(q_shape, k_shape)).name


def test_automatic_choice():
    # Blockwise when one head's scores Lq·Lk are above 2²⁰ and the weights are not asked for.
    big = functional.BLOCKWISE_ABOVE
    assert auto((1, 1024, 64), (1, 1024, 64)) == "explicit"  # 2²⁰: not above
    assert auto((4, 8, 1025, 64), (4, 8, 1024, 64)) == "blockwise"
    assert auto((1, big + 1, 8), (1, 1, 8)) == "blockwise"
    assert auto((1, 2048, 8), (1, 2048, 8), return_weights=True) == "explicit"
    assert auto((1, 8, 8), (1, 8, 8), block_sizes=(2, 2)) == "blockwise"  # blocks asked for
    x = jax.ShapeDtypeStruct((1, 1, 1100, 8), jnp.float32)
    with record() as ran:
        auto_text = jax.jit(jax_attn.scaled_dot_product_attention).lower(x, x, x).as_text()
    assert "stablehlo.while" in auto_text and ran == [("jax", "blockwise")]  # as recorded
    with record() as ran:
        with_weights = jax.eval_shape(
            lambda x: jax_attn.scaled_dot_product_attention(x, x, x, return_weights=True), x)
    assert with_weights[1].shape == (1, 1, 1100, 1100) and ran == [("jax", "explicit")]


@pytest.mark.parametrize("implementation", ["explicit", "blockwise"])
def test_each_name_runs_the_algorithm_it_names_at_any_size(implementation):
    """Blockwise's program loops over blocks (a while loop) and forms no (Lq, Lk) tensor;
    explicit's forms it and has no loop; each is what record() reports."""
    x = jax.ShapeDtypeStruct((1, 1, 16, 8), jnp.float32)
    fn = partial(jax_attn.scaled_dot_product_attention, implementation=implementation)
    kw = {"block_sizes": (4, 4)} if implementation == "blockwise" else {}
    with record() as ran:
        text = jax.jit(partial(fn, **kw)).lower(x, x, x).as_text()
    assert ran == [("jax", implementation)]
    assert ("stablehlo.while" in text) == (implementation == "blockwise")
    scores = re.search(r"tensor<(\d+x)*16x16xf32>", text)  # (..., Lq, Lk)
    assert bool(scores) == (implementation == "explicit")


@pytest.mark.parametrize("implementation, kw, reason", [
    ("blockwise", dict(return_weights=True), "never forms the"),
    ("explicit", dict(block_sizes=(2, 2)), "block_sizes is for 'blockwise'"),
])
def test_an_argument_it_cannot_honour_raises_instead_of_falling_back(implementation, kw, reason):
    q = jnp.ones((2, 3, 4))
    with record() as ran, pytest.raises(ValueError, match=rf"implementation='{implementation}' "
                                                          rf"cannot run this call: .*{reason}"):
        jax_attn.scaled_dot_product_attention(q, q, q, implementation=implementation, **kw)
    assert ran == []


@pytest.mark.parametrize("kw, match", [
    (dict(implementation="flash"), "implementation should be None or one of 'explicit', "
                                   r"'blockwise', 'sparse', 'cudnn', 'pallas', 'splash' "
                                   r"\(jax\), got 'flash'"),
    (dict(implementation="dense"), r"got 'dense' \('dense' is now 'explicit'"),
    (dict(implementation="row_chunks"), "got 'row_chunks'"),
    (dict(block_sizes=(0, 4)), r"block_sizes should be None or a pair \(block_q, block_k\) of "
                               r"positive ints, got \(0, 4\)"),
    (dict(block_sizes=(4,)), r"block_sizes .* got \(4,\)"),
    (dict(block_sizes=(4, 2.0)), r"block_sizes .* got \(4, 2.0\)"),
    (dict(block_sizes=(True, 4)), r"block_sizes .* got \(True, 4\)"),
    (dict(block_sizes=8), "block_sizes .* got 8"),
])
def test_errors(kw, match):
    q = jnp.ones((2, 3, 4))
    with pytest.raises(ValueError, match=match):
        jax_attn.scaled_dot_product_attention(q, q, q, **kw)

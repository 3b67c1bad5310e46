"""The USM Conformer's relative positions in GroupedQueryAttention
(``relative_positions="conformer_timing"``: per_dim_scale (Dh,), W_pos (d_in, N·Dh), key_scale
κ; Gemma 3n's and Gemma 4's audio attention): the timing table by hand and against the
reference's own; the float64 reference's analytic gradients against finite differences; both
twins against the reference at float64 and float32; the relative term inside the soft cap (not
after it); JAX's blockwise path (the term formed block by block from distance_query and
distance_keys) against explicit and torch, and its lowered program holding no (L, L) array; a
(left, right) sliding_window; bad settings. The converted HF layers against transformers' own
modules are tests/test_hf_import_speech.py's.

Shape legend: B batch, L length, D model width (d_in), N heads, Nkv key-value heads, Dh head
width, S = L − 1.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from golden import reference
from golden.specification import variants
from golden.specification.decoder import timing_table
from golden.specification.tolerances import TOLERANCES
from tests.helpers import JAX, TWINS, fresh_rng, long_blockwise_against_torch

GQA = "grouped_query_attention"
CT = "conformer_timing"
EXACT = 1e-12
B, L, D = 2, 9, 6
KAPPA = math.log(1 + math.e) / math.log(2)  # Gemma 4's key scale
# bidirectional, 3 keys back and 2 ahead (a Conformer's left context and lookahead), a cap
# that bites, grouped heads, Gemma 4's key scale
CONFIG = dict(d_in=D, num_heads=4, num_kv_heads=2, head_dim=3, d_out=5, causal=False,
              sliding_window=(3, 2), softcap=1.5, relative_positions=CT, key_scale=KAPPA)


def _params(rng, config):
    v = variants.get(GQA)
    return {n: rng.standard_normal(s) for n, s in v.shapes(v.config(config)).items()}


def _reference(config, x, params, lengths=None):
    inputs = {"x": x} if lengths is None else {"x": x, "query_seq_lengths": lengths}
    return reference.VARIANTS[GQA][0](config, inputs, params)


def test_timing_table_by_hand():
    # width 6: n = 3, ι = (1, 10⁻², 10⁻⁴) (ln 10⁴ / (n − 1) steps); row S + d holds timing(−d),
    # sines in the first half, cosines in the second.
    table = timing_table(6, 2)
    np.testing.assert_array_equal(table[2], [0, 0, 0, 1, 1, 1])  # d = 0
    iota = np.array([1.0, 1e-2, 1e-4])
    np.testing.assert_allclose(table[1], np.concatenate([np.sin(iota), np.cos(iota)]),
                               rtol=1e-15)  # d = −1: t = 1
    np.testing.assert_allclose(table[4], np.concatenate([np.sin(-2 * iota),
                                                         np.cos(2 * iota)]), rtol=1e-14)


def test_reference_timing_term_is_the_twins_table():
    np.testing.assert_allclose(reference.timing_term(8, 5), timing_table(8, 5), rtol=0,
                               atol=1e-15)


def test_reference_gradients_match_finite_differences():
    # Σ y ⊙ dy + Σ A ⊙ dA, right padding, the cap biting: every gradient, central differences.
    rng, seed = fresh_rng()
    config = dict(CONFIG, qkv_bias=True)
    params = _params(rng, config)
    x, lengths = rng.standard_normal((B, 7, D)), np.array([7, 5])
    y, w, saved = _reference(config, x, params, lengths)
    dy, dw = rng.standard_normal(y.shape), rng.standard_normal(w.shape)
    grads = reference.VARIANTS[GQA][1](saved, dy, dw)

    def loss(p, xx):
        yy, ww, _ = _reference(config, xx, p, lengths)
        return np.sum(yy * dy) + np.sum(ww * dw)

    eps = 1e-6
    for name in ("per_dim_scale", "W_pos", "W_query", "W_key", "b_query", "x"):
        a = x if name == "x" else params[name]
        numeric = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            moved = a.copy()
            moved[i] += eps
            up = loss(params, moved) if name == "x" else loss({**params, name: moved}, x)
            moved[i] -= 2 * eps
            down = loss(params, moved) if name == "x" else loss({**params, name: moved}, x)
            numeric[i] = (up - down) / (2 * eps)
        assert np.abs(numeric - grads[name]).max() <= 1e-6 * max(1.0, np.abs(numeric).max()), (
            f"{name}, seed {seed}")


def test_the_term_is_inside_the_cap():
    # With a cap c the scores are c·tanh((κ q̃·k + q̃·E)/c): the reference's weights of one
    # row by hand, NumPy loops; the term added after the cap is far from it.
    rng, seed = fresh_rng()
    config = dict(CONFIG, sliding_window=None, softcap=0.5)
    params = _params(rng, config)
    x = rng.standard_normal((L, D))
    _, w, _ = _reference(config, x, params)
    dh, heads = 3, 4
    q = (x @ params["W_query"]).reshape(L, heads, dh)
    k = np.repeat((x @ params["W_key"]).reshape(L, 2, dh), 2, axis=1)
    factor = np.log1p(np.exp(params["per_dim_scale"])) / np.log(2) / np.sqrt(dh)
    table = timing_table(D, L - 1) @ params["W_pos"]  # (2S + 1, N·Dh)
    i, h = 4, 1
    qt = q[i, h] * factor
    content = np.array([KAPPA * qt @ k[j, h] for j in range(L)])
    term = np.array([qt @ table[L - 1 + j - i].reshape(heads, dh)[h] for j in range(L)])
    inside = 0.5 * np.tanh((content + term) / 0.5)
    after = 0.5 * np.tanh(content / 0.5) + term
    softmax = lambda s: np.exp(s - s.max()) / np.exp(s - s.max()).sum()  # noqa: E731
    np.testing.assert_allclose(w[h, i], softmax(inside), rtol=1e-12, err_msg=f"seed {seed}")
    assert np.abs(w[h, i] - softmax(after)).max() > 1e-3, f"seed {seed}"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("framework", sorted(TWINS))
def test_twins_match_the_reference(framework, dtype):
    # Right-padded rows, grouped heads, a (left, right) window, a biting cap, κ: the real rows
    # and padding rows (the output bias, zero here), to the table's relative error norm per
    # dtype (elementwise, a float32 output near zero after out_proj's sum errs past atol).
    twin, (rng, seed) = TWINS[framework], fresh_rng()
    params = {n: a.astype(dtype) for n, a in _params(rng, CONFIG).items()}  # as given
    x, lengths = rng.standard_normal((B, L, D)).astype(dtype), np.array([L, 5])
    expected, _, _ = _reference(CONFIG, x, params, lengths)  # float64 of the same values
    with twin.float64(dtype == "float64"):
        module = twin.build(GQA, CONFIG, params)
        out = twin.numpy(module(twin.array(x, dtype), query_seq_lengths=twin.array(
            lengths.astype(np.int32))))
    t = TOLERANCES[(dtype, "value")]  # its relative error norm
    error = np.linalg.norm(out - expected) / np.linalg.norm(expected)
    assert error <= t.rel_norm, f"seed {seed}: {error:.2e}"


@pytest.mark.parametrize("framework", sorted(TWINS))
def test_a_causal_window_equals_the_pair_with_no_lookahead(framework):
    # Gemma 3n with no lookahead: causal with sliding_window P + 1 is the pair (P, 0).
    twin, (rng, seed) = TWINS[framework], fresh_rng()
    params = _params(rng, CONFIG)
    x = rng.standard_normal((B, L, D))
    with twin.float64():
        outs = [twin.numpy(twin.build(GQA, dict(CONFIG, **change), params)(twin.array(x)))
                for change in (dict(causal=True, sliding_window=4),
                               dict(causal=False, sliding_window=(3, 0)))]
    assert np.abs(outs[0] - outs[1]).max() <= EXACT, f"seed {seed}"


def test_a_long_sequence_runs_blockwise_and_equals_torch():
    # L = 1100 > 1024: JAX's core takes "blockwise" and forms the term block by block
    # (distance_query, distance_keys) inside the cap; torch forms the (N, L, L) term and puts
    # it inside the cap through its bias. Float64.
    out, expected, ran, seed = long_blockwise_against_torch(
        dict(d_in=4, num_heads=2, num_kv_heads=1, head_dim=2, d_out=3, causal=False,
             sliding_window=(40, 7), softcap=2.0, relative_positions=CT, key_scale=KAPPA))
    assert ("jax", "blockwise") in ran
    assert np.abs(out - expected).max() <= EXACT * np.abs(expected).max(), f"seed {seed}"


def test_blockwise_gradients_equal_explicit():
    # The module's own core arguments (q̃, the timing table's keys as distance_keys): the loss
    # and the gradients of q̃, k, v, distance_query and distance_keys through "blockwise"
    # (small blocks, a ragged last one) equal "explicit"'s, the cap biting, float64.
    from functools import partial

    import jax_attn
    from golden.specification.implementations import record
    rng, seed = fresh_rng()
    params = _params(rng, CONFIG)
    with JAX.float64():
        module = JAX.build(GQA, CONFIG, params)
        q = jnp.asarray(rng.standard_normal((B, 4, L, 3)))
        q, relative = module._conformer(q, L)
        arrays = dict(query=q, key=jnp.asarray(rng.standard_normal((B, 2, L, 3))),
                      value=jnp.asarray(rng.standard_normal((B, 2, L, 5))), **relative)
        d_out = jnp.asarray(rng.standard_normal((B, 4, L, 5)))
        settings = dict(scale=KAPPA, softcap=1.5, local_window_size=(3, 2),
                        key_value_seq_lengths=jnp.asarray([L, 6]))

        def run(implementation, **kw):
            fn = partial(jax_attn.scaled_dot_product_attention, implementation=implementation,
                         **settings, **kw)
            return jax.value_and_grad(lambda a: jnp.sum(fn(**a) * d_out))(arrays)
        with record() as ran:
            value, grads = run("blockwise", block_sizes=(2, 4))
        want, want_grads = run("explicit")
    assert ran == [("jax", "blockwise")] and abs(float(value) - float(want)) <= EXACT * abs(float(want))
    for n, g in want_grads.items():
        g = np.asarray(g)
        np.testing.assert_allclose(np.asarray(grads[n]), g, rtol=0,
                                   atol=EXACT * np.abs(g).max(), err_msg=f"{n}, seed {seed}")


def test_the_blockwise_program_forms_no_length_squared_array():
    # L = 1100: the module's core takes "blockwise" (Lq·Lk > 2²⁰); its lowered gradient program
    # holds the projected timing table (2S + 1, N·Dh) and blocks, never an (L, L) array.
    from flax import nnx

    from golden.specification.implementations import record
    length, config = 1100, dict(CONFIG, d_in=8, sliding_window=None)
    module = JAX.build(GQA, config, _params(np.random.default_rng(0), config))
    graph, state = nnx.split(module)

    def loss(state, x):
        return jnp.sum(nnx.merge(graph, state)(x))

    with record() as ran:
        text = jax.jit(jax.grad(loss)).lower(
            state, jax.ShapeDtypeStruct((1, length, 8), jnp.float32)).as_text()
    sizes = [int(np.prod([int(n) for n in dims.split("x")[:-1]]))
             for dims in re.findall(r"tensor<((?:\d+x)+)\w+>", text)]
    assert ran == [("jax", "blockwise")] and "stablehlo.while" in text
    assert max(sizes) < length * length, max(sizes)


@pytest.mark.parametrize("change, message", [
    (dict(relative_positions=CT, d_in=5),
     r"d_in should be even with relative_positions \(the sinusoidal table's sin and cos "
     r"pairs\), got 5"),
    (dict(relative_positions="transformer_xl", key_scale=2.0),
     r"key_scale should be None unless relative_positions is 'conformer_timing', got 2.0 with "
     r"relative_positions = 'transformer_xl'"),
    (dict(relative_positions=CT, sliding_window=(3, 2)),
     r"sliding_window should be an int when causal \(a pair \(left, right\) is a "
     r"bidirectional window\), got \(3, 2\)"),
    (dict(relative_positions=CT, causal=False, sliding_window=(3, -1)),
     r"sliding_window should be a positive int or a pair \(left, right\) of ints >= 0, got "
     r"\(3, -1\)"),
    (dict(relative_positions=CT, key_scale=-1.0), r"key_scale"),
])
@pytest.mark.parametrize("framework", sorted(TWINS))
def test_bad_conformer_settings(framework, change, message):
    with pytest.raises(ValueError, match=message):
        TWINS[framework].make(GQA, dict(dict(d_in=6, num_heads=2, num_kv_heads=2, head_dim=4),
                                        **change))

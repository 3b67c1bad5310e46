"""The reference's grouped-query attention, soft-capping, query offsets, sliding windows and
sequence lengths (issue 9), attention sinks and chunked attention: answers derived by hand, and
its backward against finite differences for each feature and for all of them at once.

Shape legend: B batch, H query heads, Hkv key-value heads, Lq, Lk lengths, Dk, Dv widths.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from golden import reference
from tests.helpers import fresh_rng

FLOAT_ARGS = ("query", "key", "value", "bias", "sinks")


def _loss(arrays, kw, d_out, d_w):
    out, w = reference.scaled_dot_product_attention(**arrays, **kw)
    return np.sum(out * d_out) + np.sum(w * d_w)


def _check_finite_differences(arrays, kw, rng, seed, h=1e-6):
    """Every float argument's analytic gradient against central differences of the loss."""
    out, w, saved = reference.sdpa_forward(**arrays, **kw)
    d_out, d_w = rng.standard_normal(out.shape), rng.standard_normal(w.shape)
    grads = reference.sdpa_backward(saved, d_out, d_w)
    for name in (n for n in FLOAT_ARGS if n in arrays):
        assert grads[name].shape == arrays[name].shape, name
        numeric = np.zeros_like(arrays[name])
        for idx in np.ndindex(arrays[name].shape):
            plus, minus = dict(arrays), dict(arrays)
            plus[name], minus[name] = arrays[name].copy(), arrays[name].copy()
            plus[name][idx] += h
            minus[name][idx] -= h
            numeric[idx] = (_loss(plus, kw, d_out, d_w) - _loss(minus, kw, d_out, d_w)) / (2 * h)
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-6, atol=1e-8,
                                   err_msg=f"{name}, {sorted(kw)}, seed {seed}")
    return grads


def _qkv(rng, lead, kv_lead, lq, lk, dk=4, dv=3):
    return {"query": rng.standard_normal(lead + (lq, dk)),
            "key": rng.standard_normal(kv_lead + (lk, dk)),
            "value": rng.standard_normal(kv_lead + (lk, dv))}


# Small shapes, every dimension a different size within a case (B=2, H=6, Hkv=3 or 1, ...).
FD_CASES = {
    "gqa": lambda rng: (_qkv(rng, (2, 6), (2, 3), 5, 7), {}),
    "mqa_unbatched": lambda rng: (_qkv(rng, (3,), (1,), 2, 5), {"is_causal": True}),
    "softcap_bias": lambda rng: ({**_qkv(rng, (2, 3), (2, 3), 5, 7),
                                  "bias": rng.standard_normal((3, 5, 7))},
                                 {"softcap": 0.7, "scale": 1.3}),
    "window_offset_causal": lambda rng: (_qkv(rng, (2, 3), (2, 3), 4, 7),
                                         {"local_window_size": (2, None), "is_causal": True,
                                          "query_offset": np.array([3, 1])}),
    "lengths": lambda rng: ({**_qkv(rng, (2, 3), (2, 3), 5, 7),
                             "bias": rng.standard_normal((2, 1, 5, 7))},
                            {"query_seq_lengths": np.array([3, 5]),
                             "key_value_seq_lengths": np.array([7, 4])}),
    "all_at_once": lambda rng: ({**_qkv(rng, (2, 6), (2, 3), 4, 7),
                                 "mask": rng.random((2, 1, 4, 7)) < 0.8,
                                 "bias": rng.standard_normal((4, 7))},
                                {"softcap": 1.1, "local_window_size": [3, 1], "is_causal": True,
                                 "query_offset": np.array([2, 3]),
                                 "query_seq_lengths": np.array([4, 3]),
                                 "key_value_seq_lengths": np.array([6, 5]),
                                 "dropout_rate": 0.2,
                                 "dropout_mask": rng.random((2, 6, 4, 7)) > 0.2}),
    "sinks_gqa_chunks_masked_row": lambda rng: (
        {**_qkv(rng, (2, 6), (2, 3), 5, 7), "sinks": rng.standard_normal(6),
         # batch 0: row 3 has no key
         "mask": np.arange(5)[:, None] != np.array([3, 9])[:, None, None, None]},
        {"is_causal": True, "attention_chunk_size": 3, "query_offset": np.array([1, 2])}),
    "sinks_unbatched_softcap_dropout": lambda rng: (
        {**_qkv(rng, (), (), 4, 6), "sinks": rng.standard_normal(()),
         "bias": rng.standard_normal((4, 6))},
        {"softcap": 0.9, "attention_chunk_size": 2, "dropout_rate": 0.3,
         "dropout_mask": rng.random((4, 6)) > 0.3}),
}


@pytest.mark.parametrize("case", list(FD_CASES))
def test_reference_gradients_match_finite_differences(case):
    rng, seed = fresh_rng()
    arrays, kw = FD_CASES[case](rng)
    _check_finite_differences(arrays, kw, rng, seed)


def test_gqa_equals_multi_head_attention_on_repeated_keys_and_values():
    # Hkv = 2 for H = 6: query heads 0-2 read kv head 0 and 3-5 kv head 1, as repeat_interleave.
    rng, seed = fresh_rng()
    arrays = {**_qkv(rng, (2, 6), (2, 2), 5, 7), "mask": rng.random((2, 6, 5, 7)) < 0.8}
    kw = dict(softcap=2.0, is_causal=True, query_offset=np.array([2, 0]))
    repeated = {**arrays, "key": np.repeat(arrays["key"], 3, axis=1),
                "value": np.repeat(arrays["value"], 3, axis=1)}
    gqa, mha = (reference.sdpa_forward(**a, **kw) for a in (arrays, repeated))
    np.testing.assert_array_equal(gqa[0], mha[0], err_msg=f"seed {seed}")
    np.testing.assert_array_equal(gqa[1], mha[1], err_msg=f"seed {seed}")
    d_out, d_w = rng.standard_normal(gqa[0].shape), rng.standard_normal(gqa[1].shape)
    g_gqa, g_mha = (reference.sdpa_backward(r[2], d_out, d_w) for r in (gqa, mha))
    np.testing.assert_array_equal(g_gqa["query"], g_mha["query"])
    for name in ("key", "value"):  # each kv head's gradient sums its group of three
        grouped = g_mha[name].reshape((2, 2, 3) + g_mha[name].shape[2:]).sum(axis=2)
        np.testing.assert_allclose(g_gqa[name], grouped, rtol=1e-15, atol=1e-15,
                                   err_msg=f"{name}, seed {seed}")


def test_softcap_of_known_scores():
    # Scores (2, 0) with scale 1, capped at c = 1: (tanh 2, 0); softmax of those.
    q, k = np.array([[1.0, 0.0]]), np.array([[2.0, 0.0], [0.0, 5.0]])
    v = np.array([[1.0, 0.0, 3.0], [0.0, 1.0, -1.0]])
    out, w = reference.scaled_dot_product_attention(q, k, v, scale=1.0, softcap=1.0)
    t = math.tanh(2.0)
    expected = [math.exp(t) / (math.exp(t) + 1), 1 / (math.exp(t) + 1)]
    np.testing.assert_allclose(w, [expected], rtol=1e-15)
    np.testing.assert_allclose(out, [[expected[0], expected[1], 3 * expected[0] - expected[1]]],
                               rtol=1e-15)
    # The cap comes before the bias: a bias of 10 on key 1 is not capped.
    _, w = reference.scaled_dot_product_attention(q, k, v, np.array([True, True]),
                                                  np.array([0.0, 10.0]), scale=1.0, softcap=1.0)
    np.testing.assert_allclose(w, [[math.exp(t) / (math.exp(t) + math.exp(10)),
                                    math.exp(10) / (math.exp(t) + math.exp(10))]], rtol=1e-14)


def _uniform_weights(lq, lk, lead=(), **kw):
    """Weights for zero queries and keys: uniform over exactly the allowed keys."""
    q, k = np.zeros(lead + (lq, 2)), np.zeros(lead + (lk, 2))
    v = np.ones(lead + (lk, 3))
    return reference.scaled_dot_product_attention(q, k, v, **kw)


def _expected(allowed):
    allowed = np.asarray(allowed, dtype=float)
    counts = allowed.sum(axis=-1, keepdims=True)
    return allowed / np.where(counts > 0, counts, 1)


def test_window_allows_exactly_the_expected_keys():
    # Window (1, 2): query i sees keys i − 1 … i + 2; an int w means (w, w).
    _, w = _uniform_weights(4, 6, local_window_size=(1, 2))
    allowed = [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    np.testing.assert_array_equal(w, _expected(allowed))
    _, w = _uniform_weights(4, 6, local_window_size=1)
    allowed = [[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0]]
    np.testing.assert_array_equal(w, _expected(allowed))
    _, w = _uniform_weights(4, 6, local_window_size=[None, 0])  # a list, as JSON gives: causal
    np.testing.assert_array_equal(w, _expected(np.tri(4, 6)))


def test_offset_shifts_the_causal_diagonal():
    # Offset Lk − Lq aligns the last query with the last key (bottom-right), per batch row.
    _, w = _uniform_weights(3, 5, lead=(2, 1), is_causal=True, query_offset=np.array([2, 0]))
    np.testing.assert_array_equal(w[0, 0], _expected(np.tri(3, 5, k=2)))
    np.testing.assert_array_equal(w[1, 0], _expected(np.tri(3, 5)))
    _, w_int = _uniform_weights(3, 5, lead=(1,), is_causal=True, query_offset=2)
    np.testing.assert_array_equal(w_int[0], w[0, 0])
    # With a window of 1 on the left too: keys p − 1 and p, p = i + 2.
    _, w = _uniform_weights(3, 5, is_causal=True, query_offset=2, local_window_size=(1, 4))
    np.testing.assert_array_equal(w, _expected(np.tri(3, 5, k=2) - np.tri(3, 5, k=0)))


def test_lengths_zero_rows_and_exclude_keys():
    rng, seed = fresh_rng()
    arrays = _qkv(rng, (2, 3), (2, 3), 5, 7)
    kw = dict(query_seq_lengths=np.array([3, 5]), key_value_seq_lengths=np.array([7, 4]))
    out, w, saved = reference.sdpa_forward(**arrays, **kw)
    assert np.all(out[0, :, 3:] == 0) and np.all(w[0, :, 3:] == 0), f"seed {seed}"
    assert np.all(w[1, :, :, 4:] == 0) and np.all(w[1, :, :, :4] > 0), f"seed {seed}"
    np.testing.assert_allclose(w.sum(-1)[0, :, :3], 1, rtol=1e-15)
    np.testing.assert_allclose(w.sum(-1)[1], 1, rtol=1e-15)
    # The live part equals attention on the cut arrays.
    cut = reference.scaled_dot_product_attention(arrays["query"][1], arrays["key"][1, :, :4],
                                                 arrays["value"][1, :, :4])
    np.testing.assert_allclose(out[1], cut[0], rtol=1e-14)
    g = reference.sdpa_backward(saved, rng.standard_normal(out.shape),
                                rng.standard_normal(w.shape))
    assert np.all(g["query"][0, :, 3:] == 0), "dead query rows received a gradient"
    assert np.all(g["key"][1, :, 4:] == 0) and np.all(g["value"][1, :, 4:] == 0)


def test_softcap_with_fully_masked_row_gives_zeros_not_nan():
    rng, seed = fresh_rng()
    arrays = _qkv(rng, (2, 3), (2, 3), 5, 7)
    mask = np.ones((2, 3, 5, 7), dtype=bool)
    mask[1, 2, 3] = False
    kw = dict(softcap=0.5, scale=100.0, bias=rng.standard_normal((5, 7)),
              local_window_size=(0, 0), query_offset=np.array([5, 0]))  # batch 0: no key at i+5
    out, w, saved = reference.sdpa_forward(**arrays, mask=mask, **kw)
    g = reference.sdpa_backward(saved, np.ones(out.shape), np.ones(w.shape))
    for a in (out, w, *g.values()):
        assert np.all(np.isfinite(a)), f"seed {seed}"
    assert np.all(w[1, 2, 3] == 0) and np.all(out[1, 2, 3] == 0)
    assert np.all(w[0, :, 2:] == 0) and np.all(out[0, :, 2:] == 0)  # positions 7-9 past Lk
    assert np.all(g["query"][1, 2, 3] == 0) and np.all(g["query"][0, :, 2:] == 0)


# ---- attention sinks and chunks, by hand -------------------------------------------------------

def test_sink_by_hand():
    # Scores (2, 0) with scale 1 and a sink logit of 1: weights e^s_j / (e² + e⁰ + e¹), no value
    # for the sink, so the row sums to 1 − e / (e² + 1 + e).
    q, k = np.array([[1.0, 0.0]]), np.array([[2.0, 0.0], [0.0, 5.0]])
    v = np.array([[1.0, 0.0, 3.0], [0.0, 1.0, -1.0]])
    out, w = reference.scaled_dot_product_attention(q, k, v, scale=1.0, sinks=np.array(1.0))
    total = math.exp(2) + 1 + math.exp(1)
    expected = [math.exp(2) / total, 1 / total]
    np.testing.assert_allclose(w, [expected], rtol=1e-15)
    np.testing.assert_allclose(out, [[expected[0], expected[1], 3 * expected[0] - expected[1]]],
                               rtol=1e-15)
    # The sink is not capped: softcap 0.5 bounds the scores, not the sink's logit of 1.
    _, w = reference.scaled_dot_product_attention(q, k, v, scale=1.0, softcap=0.5,
                                                  sinks=np.array(1.0))
    t = 0.5 * math.tanh(4.0)
    total = math.exp(t) + 1 + math.exp(1)
    np.testing.assert_allclose(w, [[math.exp(t) / total, 1 / total]], rtol=1e-15)


def test_sink_with_every_key_masked_gives_zeros():
    rng, seed = fresh_rng()
    arrays = {**_qkv(rng, (2, 3), (2, 3), 5, 7), "sinks": rng.standard_normal(3)}
    mask = np.ones((2, 3, 5, 7), dtype=bool)
    mask[1, 2, 3] = False
    mask[0] = False  # batch 0: every row empty
    out, w, saved = reference.sdpa_forward(**arrays, mask=mask, is_causal=True)
    g = reference.sdpa_backward(saved, rng.standard_normal(out.shape),
                                rng.standard_normal(w.shape))
    assert np.all(out[1, 2, 3] == 0) and np.all(w[1, 2, 3] == 0), f"seed {seed}"
    assert np.all(out[0] == 0) and np.all(w[0] == 0)
    assert np.all(g["query"][1, 2, 3] == 0) and np.all(g["query"][0] == 0)
    assert np.all(g["key"][0] == 0) and np.all(g["value"][0] == 0)
    assert np.all(w.sum(-1)[1] < 1)  # the sink keeps a share of every live row
    only_empty = reference.sdpa_forward(**arrays, mask=np.zeros((5, 7), bool))
    g = reference.sdpa_backward(only_empty[2], np.ones(out.shape), np.ones(w.shape))
    assert np.all(g["sinks"] == 0) and np.all(only_empty[0] == 0)


def test_sink_at_minus_infinity_is_no_sink():
    rng, seed = fresh_rng()
    arrays = _qkv(rng, (2, 6), (2, 3), 5, 7)
    kw = dict(mask=rng.random((2, 1, 5, 7)) < 0.7, is_causal=True, softcap=2.0)
    with_sink = reference.sdpa_forward(**arrays, sinks=np.full(6, -np.inf), **kw)
    without = reference.sdpa_forward(**arrays, **kw)
    np.testing.assert_array_equal(with_sink[0], without[0], err_msg=f"seed {seed}")
    np.testing.assert_array_equal(with_sink[1], without[1])
    d_out, d_w = rng.standard_normal(without[0].shape), rng.standard_normal(without[1].shape)
    g_sink, g = (reference.sdpa_backward(r[2], d_out, d_w) for r in (with_sink, without))
    for name in ("query", "key", "value"):
        np.testing.assert_array_equal(g_sink[name], g[name], err_msg=name)
    np.testing.assert_array_equal(g_sink["sinks"], 0)


def test_chunks_by_hand():
    # Chunks of 3 with offset 2: positions 2 … 5 fall in chunks 0, 1, 1, 1 (keys 0-2, 3-5).
    _, w = _uniform_weights(4, 7, attention_chunk_size=3, query_offset=2)
    allowed = [[1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1, 0],
               [0, 0, 0, 1, 1, 1, 0]]
    np.testing.assert_array_equal(w, _expected(allowed))
    _, w = _uniform_weights(4, 7, attention_chunk_size=3, query_offset=2, is_causal=True)
    allowed = [[1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0, 0], [0, 0, 0, 1, 1, 0, 0],
               [0, 0, 0, 1, 1, 1, 0]]
    np.testing.assert_array_equal(w, _expected(allowed))


def test_chunk_covering_every_position_is_no_chunk_and_one_is_the_diagonal():
    rng, seed = fresh_rng()
    arrays = {**_qkv(rng, (2, 3), (2, 3), 5, 8), "bias": rng.standard_normal((5, 8))}
    kw = dict(is_causal=True, query_offset=np.array([3, 1]))
    plain = reference.scaled_dot_product_attention(**arrays, **kw)
    for c in (8 + 3, 100):  # C ≥ Lk + offset: one chunk holds every key and query
        chunked = reference.scaled_dot_product_attention(**arrays, attention_chunk_size=c, **kw)
        np.testing.assert_array_equal(chunked[0], plain[0], err_msg=f"C = {c}, seed {seed}")
        np.testing.assert_array_equal(chunked[1], plain[1])
    _, w = reference.scaled_dot_product_attention(**arrays, is_causal=True, attention_chunk_size=1)
    np.testing.assert_array_equal(w, np.broadcast_to(np.eye(5, 8), w.shape))  # itself only

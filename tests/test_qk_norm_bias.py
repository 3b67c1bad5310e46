"""GroupedQueryAttention's ``qk_norm="layer_with_bias"`` (Chameleon's ChameleonLayerNorm): q
and k LayerNorm-ed per head over Dh after the head split, before RoPE, each head with its own
weight and bias: q_norm, q_norm_bias (N, Dh), k_norm, k_norm_bias (Nkv, Dh). The fixtures
(golden/specification/cases.py, seeds 850–851) hold the twins to the reference, forward and
backward, and tests/test_modules.py the reference's gradients to finite differences on them;
here: one row by hand, the finite differences on fresh draws, the bias's meaning against
"layer", both twins against the reference on fresh draws and decoding, bad settings.
tests/test_hf_import.py holds it to Hugging Face's ChameleonAttention.

Shape legend: B batch, L length, D model width (d_in), N heads, Nkv key-value heads, Dh head
width.
"""

from __future__ import annotations

import numpy as np
import pytest

from golden import reference
from golden.harness.check import compare_all
from golden.specification import variants
from tests.helpers import (TWINS, assert_central_differences, decoded, fresh_rng,
                           random_cotangents, reference_fixture)

GQA = "grouped_query_attention"
EXACT = 1e-12
B, L, D, N, NKV, DH = 2, 7, 5, 6, 2, 4
BASE = dict(d_in=D, num_heads=N, num_kv_heads=NKV, head_dim=DH, d_out=3, rope_theta=100.0,
            qk_norm="layer_with_bias", qk_norm_eps=1e-5)


def _params(rng, config):
    v = variants.get(GQA)
    return {n: rng.standard_normal(s) for n, s in v.shapes(v.config(config)).items()}


def _reference(config, inputs, params):
    return reference.VARIANTS[GQA][0](config, inputs, params)


def test_parameters_are_the_weights_and_biases_per_head():
    v = variants.get(GQA)
    shapes = v.shapes(v.config(BASE))
    assert {n: shapes[n] for n in ("q_norm", "q_norm_bias", "k_norm", "k_norm_bias")} == {
        "q_norm": (N, DH), "q_norm_bias": (N, DH), "k_norm": (NKV, DH), "k_norm_bias": (NKV, DH)}
    assert variants.vector_starts(GQA, v.config(BASE))["q_norm_bias"] == ((N, DH), 0.0)


def test_one_row_by_hand():
    # No RoPE: each head's q and k over Dh, (t − mean) / √(var + ε) · w_h + b_h, then causal
    # softmax attention; NumPy loops over one token against the reference.
    rng, seed = fresh_rng()
    config = dict(BASE, rope_theta=None)
    params = _params(rng, config)
    x = rng.standard_normal((L, D))
    y = _reference(config, {"x": x}, params)[0]

    def norm(t, w, b):
        c = t - t.mean()
        return c / np.sqrt(np.mean(c * c) + 1e-5) * w + b

    i, group = 5, N // NKV
    q = (x @ params["W_query"]).reshape(L, N, DH)
    k, v = ((x @ params[n]).reshape(L, NKV, DH) for n in ("W_key", "W_value"))
    merged = []
    for h in range(N):
        qh = norm(q[i, h], params["q_norm"][h], params["q_norm_bias"][h])
        kh = [norm(k[j, h // group], params["k_norm"][h // group],
                   params["k_norm_bias"][h // group]) for j in range(i + 1)]
        s = np.array([qh @ kj / np.sqrt(DH) for kj in kh])
        p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        merged.append(sum(p[j] * v[j, h // group] for j in range(i + 1)))
    np.testing.assert_allclose(y[i], np.concatenate(merged) @ params["W_out"], rtol=EXACT,
                               atol=EXACT, err_msg=f"seed {seed}")


def test_reference_gradients_match_finite_differences():
    # Fresh draws, padding, one key-value head: every parameter's gradient, the norm's weights
    # and biases among them, and x's.
    rng, seed = fresh_rng()
    config = dict(BASE, num_kv_heads=1, qkv_bias=True)
    params = _params(rng, config)
    inputs = {"x": rng.standard_normal((B, L, D)), "query_seq_lengths": np.array([L, 4])}
    out, weights, saved = _reference(config, inputs, params)
    cot = {n: a.astype(np.float64) for n, a in
           random_cotangents(rng, out.shape, weights.shape).items()}
    grads = reference.VARIANTS[GQA][1](saved, cot["output"], cot["weights"])
    assert {"q_norm_bias", "k_norm_bias"} <= set(grads)

    def loss():
        y, w, _ = _reference(config, inputs, params)
        return np.sum(y * cot["output"]) + np.sum(w * cot["weights"])

    assert_central_differences(loss, ({"x": inputs["x"]}, params), grads, f"seed {seed}")


def test_zero_bias_is_layer_and_a_bias_moves_far():
    # Biases of zero: exactly "layer" (Cohere's) with the same weights; drawn biases: another
    # function (the bias shifts q and k before RoPE, not a constant on the scores).
    rng, seed = fresh_rng()
    params = _params(rng, BASE)
    x = {"x": rng.standard_normal((B, L, D))}
    layer = {n: a for n, a in params.items() if not n.endswith("_norm_bias")}
    zeros = dict(params, q_norm_bias=np.zeros((N, DH)), k_norm_bias=np.zeros((NKV, DH)))
    plain = _reference(dict(BASE, qk_norm="layer"), x, layer)[0]
    np.testing.assert_array_equal(_reference(BASE, x, zeros)[0], plain, err_msg=f"seed {seed}")
    wanted = _reference(BASE, x, params)[0]
    assert np.abs(wanted - plain).max() > 1e-2 * np.abs(wanted).max(), f"seed {seed}"


@pytest.mark.parametrize("framework", sorted(TWINS))
def test_twin_matches_reference_on_fresh_draws(framework):
    # float32, padding and a mask-free causal row: output, weights and every gradient within
    # the float32 tolerances of golden.specification.tolerances.
    twin, (rng, seed) = TWINS[framework], fresh_rng()
    config = dict(BASE, qkv_bias=True, out_bias=True)
    params = {n: a.astype(np.float32) for n, a in _params(rng, config).items()}
    inputs = {"x": rng.standard_normal((B, L, D)).astype(np.float32),
              "query_seq_lengths": np.array([L, 5], np.int32)}
    fixture = reference_fixture(GQA, config, inputs, params,
                                random_cotangents(rng, (B, L, 3), (B, N, L, L)), "float32")
    result = twin.run_with_grads(twin.build(GQA, config, params), fixture, "float32")
    comps = compare_all(fixture, result, "float32")
    assert {"grad q_norm_bias", "grad k_norm_bias"} <= set(comps)
    bad = {what: c for what, c in comps.items() if c is None or not c.ok}
    assert not bad, f"seed {seed}: {bad}"


@pytest.mark.parametrize("framework", sorted(TWINS))
def test_decoding_equals_the_full_forward(framework):
    # The cache holds normed, rotated keys: prefill of 3 then one token at a time, float64.
    twin, (rng, seed) = TWINS[framework], fresh_rng()
    x = rng.standard_normal((B, L, D))
    with twin.float64():
        module = twin.build(GQA, BASE, _params(rng, BASE))
        module.eval()
        full = twin.numpy(module(twin.array(x)))
        steps = decoded(twin, module, x, 3)
    assert np.abs(steps - full).max() <= EXACT * np.abs(full).max(), f"seed {seed}"


BAD = [
    (dict(qk_norm="layer_bias"), r"qk_norm should be None or one of .*'layer_with_bias'.*, got "
                                 r"'layer_bias'"),
    (dict(qk_norm_eps=-1.0), r"qk_norm_eps should be a positive number, got -1.0"),
]


@pytest.mark.parametrize("change, message", BAD)
@pytest.mark.parametrize("framework", sorted(TWINS))
def test_bad_settings(framework, change, message):
    with pytest.raises(ValueError, match=message):
        TWINS[framework].make(GQA, dict(BASE, **change))


@pytest.mark.parametrize("framework", sorted(TWINS))
def test_a_bias_of_the_wrong_shape_is_named(framework):
    rng, _ = fresh_rng()
    params = dict(_params(rng, BASE), k_norm_bias=np.zeros((N, DH)))  # (N, Dh), not (Nkv, Dh)
    with pytest.raises(ValueError, match=r"k_norm_bias"):
        TWINS[framework].build(GQA, BASE, params)

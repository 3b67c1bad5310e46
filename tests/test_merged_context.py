"""T5Gemma 2's merged self- and cross-attention in GroupedQueryAttention
(``merged_context=True``): one softmax over x's keys (causal, sliding window, RoPE, the QK norm)
and the context's (W_key and W_value on the context, k_norm, no RoPE). The float64
reference's backward against central differences; both twins against the reference (output,
weights and every gradient, float64 and float32); decoding with a MergedCache (the context's
keys stored by the prefill) equal to the full forward; a context masked out entirely equal to
the plain causal module; bad settings and inputs. HF's own T5Gemma2MergedAttention is
tests/test_hf_import_cross.py's.

Shape legend: B batch, L decoder length, Lc context length, D model width (d_in), N heads,
Nkv key-value heads, Dh head width.
"""

from __future__ import annotations

import numpy as np
import pytest

from golden import reference
from golden.harness.check import compare_all
from tests.helpers import (TWINS, assert_central_differences, fresh_rng, random_cotangents,
                           reference_fixture)

GQA = "grouped_query_attention"
B, L, LC, D, N, NKV, DH = 2, 7, 5, 6, 4, 2, 4
T5GEMMA2 = dict(d_in=D, num_heads=N, num_kv_heads=NKV, head_dim=DH, d_out=3, qkv_bias=True,
                out_bias=True, rope_theta=100.0, qk_norm="rms_one_plus", scale=0.3,
                softcap=3.0, sliding_window=3, merged_context=True)


def _params(rng, config):
    """Every parameter of ``config``'s module drawn N(0, 0.5²), float32 values in float64."""
    shapes = TWINS["torch"].export(TWINS["torch"].make(GQA, config))
    return {n: (rng.standard_normal(np.shape(a)) * 0.5).astype(np.float32).astype(np.float64)
            for n, a in shapes.items()}


def _inputs(rng, lengths=True):
    """x (B, L, D), context (B, Lc, D) float32 values; row 1's context padded (two tokens) and,
    with ``lengths``, its decoder row right-padded to 5."""
    inputs = {"x": rng.standard_normal((B, L, D)).astype(np.float32),
              "context": rng.standard_normal((B, LC, D)).astype(np.float32),
              "context_mask": np.array([[True] * LC, [True, False, True, True, False]])}
    if lengths:
        inputs["query_seq_lengths"] = np.array([L, 5], np.int32)
    return inputs


def test_reference_gradients_match_finite_differences():
    rng, seed = fresh_rng()
    config = dict(T5GEMMA2, qk_norm="layer")  # a weight per head: k_norm's two parts summed
    params, inputs = _params(rng, config), {n: a.astype(np.float64) if a.dtype.kind == "f"
                                            else a for n, a in _inputs(rng).items()}
    forward, backward = reference.VARIANTS[GQA]
    out, weights, saved = forward(config, inputs, params)
    assert weights.shape == (B, N, L, L + LC)
    cot = {n: a.astype(np.float64) for n, a in random_cotangents(
        rng, out.shape, weights.shape).items()}
    grads = backward(saved, cot["output"], cot["weights"])
    assert set(grads) == set(params) | {"x", "context"}

    def loss():
        o, w, _ = forward(config, inputs, params)
        return (o * cot["output"]).sum() + (w * cot["weights"]).sum()

    assert_central_differences(loss, [inputs, params], grads, f"seed {seed}:")


def test_reference_mask_by_hand():
    # L = 3, W = 2, Lc = 2 with the second context token padding: query 2 sees self keys 1, 2
    # and context key 0; a padded decoder row (length 2) sees no self key 2.
    allowed = reference.merged.merged_allowed((1,), 3, np.array([[True, False]]), 2, 2,
                                              np.array([2]))
    np.testing.assert_array_equal(allowed[0, 0], [[1, 0, 0, 1, 0], [1, 1, 0, 1, 0],
                                                  [0, 1, 0, 1, 0]])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_twins_match_the_reference(framework, dtype):
    twin, (rng, seed) = TWINS[framework], fresh_rng()
    params, inputs = _params(rng, T5GEMMA2), _inputs(rng)
    out, weights, _ = reference.VARIANTS[GQA][0](T5GEMMA2, inputs, params)
    fixture = reference_fixture(GQA, T5GEMMA2, inputs, params,
                                random_cotangents(rng, out.shape, weights.shape), dtype)
    with twin.float64(dtype == "float64"):
        module = twin.build(GQA, T5GEMMA2, {n: a.astype(dtype) for n, a in params.items()})
        result = twin.run_with_grads(module, fixture, dtype)
    assert set(result["grads"]) == set(params) | {"x", "context"}
    bad = {what: c for what, c in compare_all(fixture, result, dtype).items()
           if c is None or not c.ok}
    assert not bad, f"{framework} {dtype}, seed {seed}: {bad}"


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_decoding_equals_the_full_forward(framework):
    # Prefill 3 tokens with the context (its keys stored in the MergedCache), then one token at
    # a time without it: the full forward's rows, float64, 1e-12.
    twin, (rng, seed) = TWINS[framework], fresh_rng()
    inputs = _inputs(rng, lengths=False)
    x, context, real = inputs["x"], inputs["context"], inputs["context_mask"]
    with twin.float64():
        module = twin.cast(twin.make(GQA, T5GEMMA2, seed), "float64")
        full = twin.numpy(module(twin.array(x, "float64"), context=twin.array(context, "float64"),
                                 context_mask=twin.array(real)))
        cache, steps = module.init_cache(B, L + 2), []
        for start, stop in [(0, 3)] + [(t, t + 1) for t in range(3, L)]:
            given = (dict(context=twin.array(context, "float64"), context_mask=twin.array(real))
                     if start == 0 else {})
            out, cache = module(twin.array(x[:, start:stop], "float64"), cache=cache, **given)
            steps.append(twin.numpy(out))
    assert cache.context_key.shape == (B, NKV, LC, DH)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=0, atol=1e-12,
                               err_msg=f"seed {seed}")


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_a_context_masked_out_is_the_plain_causal_module(framework):
    # Every context token masked: the softmax is the plain causal one over x's own keys (the
    # same parameters, merged_context off), float64, 1e-12; and a real context moves it far.
    twin, (rng, seed) = TWINS[framework], fresh_rng()
    params, inputs = _params(rng, T5GEMMA2), _inputs(rng, lengths=False)
    plain = {k: v for k, v in T5GEMMA2.items() if k != "merged_context"}
    with twin.float64():
        merged = twin.build(GQA, T5GEMMA2, params)
        alone = twin.build(GQA, plain, params)
        x, context = (twin.array(inputs[n], "float64") for n in ("x", "context"))
        want = twin.numpy(alone(x))
        none = twin.numpy(merged(x, context=context,
                                 context_mask=twin.array(np.zeros((B, LC), bool))))
        some = twin.numpy(merged(x, context=context))
    np.testing.assert_allclose(none, want, rtol=0, atol=1e-12, err_msg=f"seed {seed}")
    assert np.abs(some - want).max() > 1e-2


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("change, message", [
    (dict(causal=False), r"causal should be True with merged_context=True"),
    (dict(sinks=True), r"sinks should be False with merged_context=True"),
    (dict(sliding_window=(2, 0)), r"sliding_window should be None or an int W with "
                                  r"merged_context=True"),
    (dict(qk_norm="l2"), r"qk_norm should be one of \(None, 'rms', 'rms_one_plus', 'layer'\) "
                         r"with merged_context=True"),
    (dict(relative_positions="transformer_xl"),
     r"relative_positions should be None with merged_context=True"),
])
def test_bad_merged_settings(framework, change, message):
    with pytest.raises(ValueError, match=message):
        TWINS[framework].make(GQA, {**T5GEMMA2, **change})


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_bad_merged_inputs(framework):
    twin = TWINS[framework]
    merged = twin.make(GQA, T5GEMMA2)
    plain = twin.make(GQA, {k: v for k, v in T5GEMMA2.items() if k != "merged_context"})
    x, context = twin.array(np.ones((B, L, D), np.float32)), twin.array(
        np.ones((B, LC, D), np.float32))
    with pytest.raises(ValueError, match=r"context should be given with merged_context=True"):
        merged(x)
    with pytest.raises(ValueError, match=r"context shape should be \(B, L, d_in\) = "
                                         r"\(2, \?, 6\), got \(2, 5, 4\)"):
        merged(x, context=twin.array(np.ones((B, LC, 4), np.float32)))
    with pytest.raises(ValueError, match=r"context_mask shape should be \(B, Lc\) = \(2, 5\), "
                                         r"got \(2, 4\)"):
        merged(x, context=context, context_mask=twin.array(np.ones((B, 4), bool)))
    with pytest.raises(ValueError, match=r"context_mask dtype should be bool"):
        merged(x, context=context, context_mask=twin.array(np.ones((B, LC), np.float32)))
    with pytest.raises(ValueError, match=r"context should be None without merged_context=True"):
        plain(x, context=context)

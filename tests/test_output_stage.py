"""GroupedQueryAttention's output stage and its QK norm after RoPE (golden.specification.outputs):
``output_gate`` per feature or per head, σ or softplus (Qwen3-Next, Step-3.7-Flash, Laguna),
``output_norm`` over all heads (BitNet's attn_sub_norm, with a weight) or per head (Muse
Spark's o_norm, without), ``qk_norm="rms_after_rope"`` (HunYuan v1). The fixtures
(golden/specification/cases.py, seeds 820–825) hold the twins to the reference, forward and
backward, and tests/test_modules.py the reference's gradients to finite differences; here: one
row by hand, what each setting means against another, low precision, bad settings.

Shape legend: B batch, L length, D model width (d_in), N heads, Nkv key-value heads, Dh head
width.
"""

from __future__ import annotations

import numpy as np
import pytest

from golden import reference
from golden.specification import variants
from tests.helpers import TWINS, fresh_rng

GQA = "grouped_query_attention"
EXACT = 1e-12
B, L, D = 2, 7, 5
BASE = dict(d_in=D, num_heads=4, num_kv_heads=2, head_dim=4, d_out=3, rope_theta=100.0)


def _params(rng, config):
    v = variants.get(GQA)
    return {n: rng.standard_normal(s) for n, s in v.shapes(v.config(config)).items()}


def _reference(config, x, params):
    return reference.VARIANTS[GQA][0](config, {"x": x}, params)[0]


def test_one_row_by_hand():
    # Muse Spark's order: each head's output over its RMS (no weight), then times softplus of
    # its own gate value, then out_proj; NumPy loops over one token against the reference.
    rng, seed = fresh_rng()
    config = dict(BASE, rope_theta=None, output_norm="rms_per_head", output_norm_eps=1e-5,
                  output_gate="softplus_per_head")
    params = _params(rng, config)
    x = rng.standard_normal((L, D))
    y = _reference(config, x, params)
    i, dh = 5, 4
    q = (x @ params["W_query"]).reshape(L, 4, dh)
    k, v = ((x @ params[n]).reshape(L, 2, dh) for n in ("W_key", "W_value"))
    z = x[i] @ params["W_gate"]  # (N,): one gate per head
    merged = []
    for h in range(4):
        s = np.array([q[i, h] @ k[j, h // 2] / np.sqrt(dh) for j in range(i + 1)])
        p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        o = sum(p[j] * v[j, h // 2] for j in range(i + 1))
        o = o / np.sqrt(np.mean(o * o) + 1e-5)
        merged.append(o * np.log1p(np.exp(z[h])))
    np.testing.assert_allclose(y[i], np.concatenate(merged) @ params["W_out"], rtol=EXACT,
                               atol=EXACT, err_msg=f"seed {seed}")


def test_a_gate_per_head_is_the_elementwise_gate_repeated():
    # W_gate (D, N) per head equals W_gate (D, N·Dh) with each head's column repeated Dh times.
    rng, seed = fresh_rng()
    for act in ("sigmoid", "softplus"):
        per_head = dict(BASE, output_gate=f"{act}_per_head", qkv_bias=True)
        params = _params(rng, per_head)
        x = rng.standard_normal((B, L, D))
        wide = dict(params, W_gate=np.repeat(params["W_gate"], 4, axis=-1),
                    b_gate=np.repeat(params["b_gate"], 4))
        np.testing.assert_allclose(_reference(per_head, x, params),
                                   _reference(dict(per_head, output_gate=act), x, wide),
                                   rtol=0, atol=EXACT, err_msg=f"{act}, seed {seed}")


@pytest.mark.parametrize("change", [dict(output_gate="softplus"), dict(output_norm="rms"),
                                    dict(qk_norm="rms_after_rope")])
def test_each_setting_undone_moves_far(change):
    # The softplus gate against σ, the norm over all heads against per head (a weight of ones),
    # the QK norm after RoPE against before it: each is a different function.
    rng, seed = fresh_rng()
    other = {"output_gate": "sigmoid", "output_norm": "rms_per_head", "qk_norm": "rms"}
    name = next(iter(change))
    params = _params(rng, dict(BASE, **change))
    if name == "output_norm":
        params["output_norm_weight"] = np.ones_like(params["output_norm_weight"])
    x = rng.standard_normal((B, L, D))
    wanted = _reference(dict(BASE, **change), x, params)
    undone = dict(BASE, **{name: other[name]})
    moved = _reference(undone, x, {n: a for n, a in params.items()
                                   if n in variants.get(GQA).shapes(variants.get(GQA)
                                                                    .config(undone))})
    assert np.abs(wanted - moved).max() > 1e-2 * np.abs(wanted).max(), f"seed {seed}"


@pytest.mark.parametrize("framework", sorted(TWINS))
def test_low_precision_runs_in_float32_where_it_should(framework):
    # bfloat16 parameters and input: the softplus gate and the output norm computed in float32
    # and rounded once: the output within bfloat16's rounding of the float64 reference of the
    # same values (a relative error norm of a few units of its 2^−8).
    import ml_dtypes
    twin, (rng, seed) = TWINS[framework], fresh_rng()
    config = dict(BASE, output_gate="softplus_per_head", output_norm="rms",
                  qk_norm="rms_after_rope")
    params = {n: a.astype(ml_dtypes.bfloat16) for n, a in _params(rng, config).items()}
    x = rng.standard_normal((B, L, D)).astype(ml_dtypes.bfloat16).astype(np.float32)
    expected = _reference(config, x.astype(np.float64),
                          {n: a.astype(np.float64) for n, a in params.items()})
    module = twin.cast(twin.build(GQA, config, {n: a.astype(np.float32)
                                                for n, a in params.items()}), "bfloat16")
    out = np.asarray(twin.numpy(module(twin.array(x, "bfloat16"))), np.float64)
    error = np.linalg.norm(out - expected) / np.linalg.norm(expected)
    assert error <= 8 * 2.0 ** -8, f"seed {seed}: {error:.2e}"


BAD = [
    (dict(output_gate="tanh"), r"output_gate should be False, True \(= 'sigmoid'\) or one of "
                               r"'sigmoid', 'sigmoid_per_head', 'softplus', 'softplus_per_head', "
                               r"got 'tanh'"),
    (dict(output_norm="layer"), r"output_norm should be None or one of 'rms', 'rms_per_head', "
                                r"got 'layer'"),
    (dict(output_norm_eps=1e-5), r"output_norm_eps should be 1e-06 \(its default\) unless "
                                 r"output_norm is set, got 1e-05"),
    (dict(output_norm="rms", output_norm_eps=0.0),
     r"output_norm_eps should be a positive number, got 0.0"),
    (dict(qk_norm="rms_after"), r"qk_norm should be None or one of .*'rms_after_rope', got "
                                r"'rms_after'"),
]


@pytest.mark.parametrize("change, message", BAD)
@pytest.mark.parametrize("framework", sorted(TWINS))
def test_bad_settings(framework, change, message):
    with pytest.raises(ValueError, match=message):
        TWINS[framework].make(GQA, dict(BASE, **change))

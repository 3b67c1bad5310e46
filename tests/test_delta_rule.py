"""Gated delta-rule linear attention's float64 reference (issue 43, golden.reference.delta_rule):
its analytic backward against central differences in float64 and, on a tiny case, in 100-digit
arithmetic; the recurrence against its definition written out for one head; padding."""

from __future__ import annotations

import numpy as np
import pytest

from golden.reference import exact_arithmetic
from golden.reference.delta_rule import MIXERS, delta_rule
from golden.specification import exact, recurrent
from tests.helpers import fresh_rng

GDN, KDA, LIGHTNING = "gated_delta_net", "kimi_delta_attention", "lightning_attention"


def _params(rng, config, name=GDN):
    shapes = recurrent.get(name).param_shapes(config)
    return {n: rng.standard_normal(s) * 0.5 for n, s in shapes.items()}


# Gated DeltaNet with β = σ and with OLMo hybrid's 2σ; Kimi Delta Attention with its softplus
# forget gate through low-rank projections (Kimi Linear, GLM-5.3) and with the bounded sigmoid
# through full-rank ones (Ling 3.0's safe gate)
CASES = {"gdn": (GDN, {}), "gdn-2sigma": (GDN, dict(allow_neg_eigval=True)),
         "kda-softplus": (KDA, {}),
         "kda-bounded": (KDA, dict(forget_gate="bounded_sigmoid", decay_lower_bound=-5.0,
                                   decay_rank=None, gate_rank=None)),
         "lightning": (LIGHTNING, {})}


@pytest.mark.parametrize("case", CASES)
def test_reference_gradients_match_finite_differences(case):
    # Σ y ⊙ dy with left padding, 7 tokens (past the convolution's width 3), grouped heads
    # (Gated DeltaNet: 4 value heads on 2 key heads): every gradient, central differences in
    # float64.
    rng, seed = fresh_rng()
    name, change = CASES[case]
    config = dict(recurrent.get(name).sample, **change)
    params = _params(rng, config, name)
    x = rng.standard_normal((2, 7, config["d_in"]))
    mask = np.ones((2, 7), bool)
    mask[1, :2] = False
    forward, backward = MIXERS[name]
    y, _, saved = forward(config, {"x": x, "mask": mask}, params)
    dy = rng.standard_normal(y.shape)
    grads = backward(saved, dy)

    def loss(p, xx):
        return np.sum(forward(config, {"x": xx, "mask": mask}, p)[0] * dy)

    h = 1e-6
    for name in ("x", *params):
        a = x if name == "x" else params[name]
        numeric = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            moved = a.copy()
            moved[i] += h
            up = loss(params, moved) if name == "x" else loss({**params, name: moved}, x)
            moved[i] -= 2 * h
            down = loss(params, moved) if name == "x" else loss({**params, name: moved}, x)
            numeric[i] = (up - down) / (2 * h)
        assert np.abs(numeric - grads[name]).max() <= 1e-6 * max(1.0, np.abs(numeric).max()), (
            f"{name}, seed {seed}")
    assert not grads["x"][1, :2].any()  # a padded token's input changes nothing


TINY = {GDN: dict(d_in=3, num_k_heads=1, num_v_heads=2, head_k_dim=2, head_v_dim=2,
                  conv_kernel=2, allow_neg_eigval=True),
        KDA: dict(d_in=3, num_heads=1, head_dim=2, conv_kernel=2, decay_rank=2,
                  forget_gate="bounded_sigmoid", decay_lower_bound=-3.0),
        LIGHTNING: dict(d_in=3, num_heads=2, head_dim=2)}


@pytest.mark.parametrize("name", TINY)
def test_reference_gradients_in_100_digit_arithmetic(name):
    # A tiny case (one batch row, 4 tokens; Gated DeltaNet: one key head serving two value
    # heads) whose gradient entries equal the central difference at step 1e-40 in 100-digit
    # arithmetic to 1e-30 (the difference's own error is ~1e-80 · the third derivative): the
    # backward is the forward's derivative, not merely close to it.
    rng, seed = fresh_rng()
    config = TINY[name]
    params = _params(rng, config, name)
    x = rng.standard_normal((4, 3))
    forward, backward = MIXERS[name]
    real = exact.real_type(100)
    with exact_arithmetic(real):
        p = {n: exact.array(a, real) for n, a in params.items()}
        xx = exact.array(x, real)
        y, _, saved = forward(config, {"x": xx}, p)
        dy = exact.array(rng.standard_normal(y.shape), real)
        grads = backward(saved, dy)
        h = real("1e-40")

        def loss(pp, xs):
            return (forward(config, {"x": xs}, pp)[0] * dy).sum()

        for what in ("x", "norm_weight", *(n for n in ("A_log", "dt_bias", "W_beta", "conv_key",
                                                       "slope") if n in p),
                     *(n for n in p if n.startswith(("W_decay", "W_gate")))):
            a = xx if what == "x" else p[what]
            for i in np.ndindex(a.shape):
                up, down = a.copy(), a.copy()
                up[i], down[i] = a[i] + h, a[i] - h
                if what == "x":
                    numeric = (loss(p, up) - loss(p, down)) / (2 * h)
                else:
                    numeric = (loss({**p, what: up}, xx) - loss({**p, what: down}, xx)) / (2 * h)
                assert abs(numeric - grads[what][i]) <= real("1e-30") * max(
                    real(1), abs(numeric)), (what, i, seed)


def test_recurrence_by_hand_for_one_head():
    # S′ = a S, u = S′ᵀk, S = S′ + k ⊗ β(v − u), o = Sᵀq written with plain loops and Python
    # floats, against delta_rule on one head of 5 tokens, per-head and per-channel decay.
    rng, _ = fresh_rng()
    q, k, v = (rng.standard_normal((1, 5, d)) for d in (3, 3, 2))
    beta = rng.uniform(0, 2, (1, 5))
    for a in (rng.uniform(0.5, 1, (1, 5)), rng.uniform(0.5, 1, (1, 5, 3))):
        o, _ = delta_rule(q, k, v, a, beta)
        s = [[0.0, 0.0] for _ in range(3)]
        for t in range(5):
            decay = [a[0, t] if a.ndim == 2 else a[0, t, i] for i in range(3)]
            s = [[decay[i] * s[i][j] for j in range(2)] for i in range(3)]
            u = [sum(s[i][j] * k[0, t, i] for i in range(3)) for j in range(2)]
            d = [beta[0, t] * (v[0, t, j] - u[j]) for j in range(2)]
            s = [[s[i][j] + k[0, t, i] * d[j] for j in range(2)] for i in range(3)]
            out = [sum(s[i][j] * q[0, t, i] for i in range(3)) for j in range(2)]
            np.testing.assert_allclose(o[0, t], out, rtol=1e-14, atol=1e-15)


def test_a_left_padded_row_equals_its_tokens_alone():
    # HF's left padding: the padded tokens zeroed at the input leave the state at zero, so the
    # real tokens' outputs are those of the row without its padding.
    rng, _ = fresh_rng()
    config = recurrent.get(GDN).sample
    params = _params(rng, config)
    x = rng.standard_normal((1, 6, config["d_in"]))
    mask = np.array([[False, False, True, True, True, True]])
    forward = MIXERS[GDN][0]
    padded, _, _ = forward(config, {"x": x, "mask": mask}, params)
    alone, _, _ = forward(config, {"x": x[:, 2:]}, params)
    np.testing.assert_allclose(padded[:, 2:], alone, rtol=1e-13, atol=1e-15)
    assert not padded[:, :2].any()

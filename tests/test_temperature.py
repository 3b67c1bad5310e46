"""The query temperature's kinds (golden.specification.temperature): the factors by hand at a
few positions, from the reference's own formula and from the twins' shared one; the learned
kind's parameters; bad settings by name. The fixtures gqa_temperature_* (seeds 426, 826–828)
hold both twins to the reference, forward and backward, and tests/test_grouped_query.py's
decode configurations the cache's positions.

Shape legend: N heads, L tokens.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from golden import reference
from golden.specification.temperature import learned_temperature, temperature
from tests.helpers import TWINS

GQA = "grouped_query_attention"
P = np.array([0, 1, 2, 5, 9])
# each kind's factor at P, written out from its formula
BY_HAND = [
    ({"beta": 0.5, "floor_scale": 2, "shift": 1},  # 1 + β ln(1 + ⌊(p + 1)/2⌋): 0, 1, 1, 3, 5
     [1, 1 + 0.5 * math.log(2), 1 + 0.5 * math.log(2), 1 + 0.5 * math.log(4),
      1 + 0.5 * math.log(6)]),
    ({"kind": "power", "alpha": 0.1, "length": 2048},  # Beam: (1 + (p + 1)/2048)^0.1
     [(1 + (p + 1) / 2048) ** 0.1 for p in P]),
    ({"kind": "log", "alpha": 0.3, "length": 3},  # 1 + 0.3 ln(max((p + 1)/3, 1)): 1 until p = 2
     [1, 1, 1, 1 + 0.3 * math.log(2), 1 + 0.3 * math.log(10 / 3)]),
]


@pytest.mark.parametrize("t, expected", BY_HAND, ids=["llama4", "power", "log"])
def test_factors_by_hand(t, expected):
    np.testing.assert_allclose(reference.temperature_factors(P, t), expected, rtol=1e-15)
    shared = temperature(P, t, real=lambda n: np.asarray(n, np.float64), log1p=np.log1p,
                         exp=np.exp)
    np.testing.assert_allclose(shared, expected, rtol=1e-15)


def test_learned_factors_by_hand():
    # Mistral Large 4: s_h ln(p + 1) + b_h, one row per head, batched positions too
    s, b = np.array([0.5, -1.0]), np.array([1.0, 2.0])
    expected = np.array([[0.5 * math.log(p + 1) + 1 for p in P],
                         [-math.log(p + 1) + 2 for p in P]])
    real = lambda n: np.asarray(n, np.float64)  # noqa: E731
    np.testing.assert_allclose(learned_temperature(P, s, b, real=real, log1p=np.log1p),
                               expected, rtol=1e-15)
    batched = learned_temperature(np.stack([P, P + 1]), s, b, real=real, log1p=np.log1p)
    assert batched.shape == (2, 2, len(P))
    np.testing.assert_allclose(batched[0], expected, rtol=1e-15)


@pytest.mark.parametrize("framework", sorted(TWINS))
def test_a_learned_temperature_starts_as_none(framework):
    # A new module holds s = 0 and b = 1: the factor 1 at every position, until trained.
    module = TWINS[framework].make(GQA, dict(d_in=5, num_heads=4, num_kv_heads=2,
                                             query_temperature={"kind": "learned"}))
    np.testing.assert_array_equal(TWINS[framework].numpy(module.temperature_scale), np.zeros(4))
    np.testing.assert_array_equal(TWINS[framework].numpy(module.temperature_bias), np.ones(4))


BAD = [
    ({"kind": "exp", "alpha": 1.0}, r"query_temperature should be None or a dict: Llama 4's keys "
                                    r"beta, floor_scale, shift, or 'kind' one of 'llama4', 'power', "
                                    r"'log', 'learned' with its keys, got 'exp'"),
    ({"kind": "power", "alpha": 0.1}, r"query_temperature of kind 'power' should have the keys "
                                      r"alpha, kind, length, got alpha, kind"),
    ({"kind": "learned", "beta": 0.1}, r"query_temperature of kind 'learned' should have the "
                                       r"keys kind, got beta, kind"),
    ({"kind": "log", "alpha": 0.1, "length": 0}, r"query_temperature\['length'\] should be a "
                                                 r"positive int, got 0"),
    ({"kind": "power", "alpha": None, "length": 4}, r"query_temperature\['alpha'\] should be a "
                                                    r"finite number, got None"),
    ("power", r"query_temperature should be None or a dict: .* got str"),
]


@pytest.mark.parametrize("t, message", BAD)
@pytest.mark.parametrize("framework", sorted(TWINS))
def test_bad_temperatures(framework, t, message):
    with pytest.raises(ValueError, match=message):
        TWINS[framework].make(GQA, dict(d_in=5, num_heads=4, num_kv_heads=2,
                                        query_temperature=t))

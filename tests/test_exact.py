"""golden.specification.exact, the arithmetic the fixtures are written in: every operation correctly
rounded to 50 digits (checked against mpmath at 120 digits, independent of the series written here),
one correct rounding to float64 at the end, and nothing that depends on the thread's decimal context
or on float operands."""

from __future__ import annotations

import decimal
import random
from decimal import Decimal

import mpmath
import numpy as np
import pytest

from golden.specification import exact

from golden import reference

R = exact.Real
HALF_ULP_50 = Decimal("5e-50")  # half a unit in the 50th significant digit, relative


def _points():
    rng = random.Random(0)
    edge = [0.0, -0.0, 5e-324, 1e-300, -1e-30, 1e-8, 0.5, -0.7, 1.0, 3.0, 20.0, -40.0, 300.0,
            1e4, -1e4, 2.0**20, 1048575.0, 12345.678, np.pi / 2, np.pi, -np.pi, 3 * np.pi / 2,
            1e-5, 710.0, -745.0]
    return (edge + [rng.uniform(-50, 50) for _ in range(200)]
            + [rng.uniform(-2.0**20, 2.0**20) for _ in range(50)])


@pytest.mark.parametrize("name", ["exp", "log", "sqrt", "tanh", "sin", "cos"])
def test_functions_are_correctly_rounded_to_50_digits(name):
    """Within half a unit of the 50th digit of mpmath's value at 120 digits (relative)."""
    mpmath.mp.dps = 120
    worst = Decimal(0)
    for x in _points():
        if name in ("log", "sqrt"):
            x = abs(x) or 1.5
        if name == "exp" and abs(x) > 1e5:
            continue
        got = getattr(R(x), name)()
        assert type(got) is R
        want = getattr(mpmath, name)(mpmath.mpf(x))
        if want == 0:
            assert got == 0, (name, x, got)
            continue
        want = Decimal(mpmath.nstr(want, 110, strip_zeros=False))
        worst = max(worst, abs((got - want) / want))
        assert float(got) == float(want), (name, x)
    # half an ulp of the value in its 50-digit decade, relative: at most 5e-50 / 1.0
    assert worst <= HALF_ULP_50, (name, worst)


def test_basic_operations_are_correctly_rounded_and_take_floats_exactly():
    a, b = R(0.1), 3.0  # 0.1 as the float it is: 0.1000000000000000055511151231257827...
    assert Decimal(0.1) == a
    wide, fifty = decimal.Context(prec=200), decimal.Context(prec=50)
    assert a + b == fifty.add(Decimal(0.1), 3) != wide.add(Decimal(0.1), 3)  # 56 digits -> 50
    q = a / b
    assert q == decimal.Context(prec=50).divide(Decimal(0.1), 3)
    assert type(q) is R and type(b - a) is R and type(b / a) is R and type(-a) is R
    assert R(2) ** 2 == 4 and type(R(2) ** 2) is R
    assert np.float32(0.5) * R(3) == Decimal("1.5") and type(np.float32(0.5) * R(3)) is R


def test_arithmetic_ignores_the_thread_context():
    x = R(1) / R(3)
    with decimal.localcontext(decimal.Context(prec=5, rounding=decimal.ROUND_DOWN)):
        y, z, w = R(1) / R(3), -R(1) / 3, abs(-(R(2).sqrt()))
    assert x == y and len(y.as_tuple().digits) == 50 and -z == x
    assert w == R(2).sqrt()


def test_to_float64_rounds_once_to_nearest_even():
    wide = decimal.Context(prec=200)
    one, ulp = Decimal(1), wide.power(2, -52)
    half = wide.divide(ulp, 2)
    values = [wide.add(one, half), wide.add(one, wide.multiply(3, half)),
              wide.add(wide.add(one, half), Decimal("1e-45")),
              Decimal("1e-400"), Decimal("-1e-400"), Decimal("2.4e-324"), Decimal("2.5e-324")]
    got = exact.to_float64(np.array([R(v) for v in values], dtype=object))
    assert got.dtype == np.float64
    assert got.tolist() == [1.0, 1.0 + 2 * 2.0**-52, 1.0 + 2.0**-52, 0.0, -0.0, 0.0, 5e-324]


def test_array_takes_floats_exactly_and_leaves_masks():
    a = np.array([[0.1, -2.5]], dtype=np.float32)
    e = exact.array(a)
    assert e.dtype == object and e.shape == (1, 2) and all(type(x) is R for x in e.flat)
    assert exact.to_float64(e).tolist() == a.astype(np.float64).tolist()
    mask = np.array([True, False])
    assert exact.array(mask) is mask
    assert exact.is_exact(e) and not exact.is_exact(a)


def test_exact_reference_equals_float64_on_exact_cases():
    """Where float64 itself is exact (small integers, scale 1, no exp), both arithmetics give
    the same answer: here 0/1 weights from a mask with one key per row."""
    q = np.array([[1.0, 2.0], [3.0, -1.0]])
    k = np.array([[2.0, 0.0], [1.0, 1.0]])
    v = np.array([[1.0, 5.0], [-2.0, 0.5]])
    mask = np.array([[True, False], [False, True]])
    fast = reference.scaled_dot_product_attention(q, k, v, mask)
    with reference.exact_arithmetic():
        slow = reference.scaled_dot_product_attention(q, k, v, mask)
    for a, b in zip(fast, slow):
        np.testing.assert_array_equal(a, exact.to_float64(b))


def test_modes_do_not_nest():
    with reference.exact_arithmetic(), pytest.raises(ValueError, match="rounded_products"):
        with reference.rounded_products(11):
            pass
    with reference.rounded_products(11), pytest.raises(ValueError, match="exact_arithmetic"):
        with reference.exact_arithmetic():
            pass
    with pytest.raises(TypeError, match="real should be a golden.specification.exact number type"):
        with reference.exact_arithmetic(float):
            pass

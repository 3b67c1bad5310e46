"""Arithmetic whose bits are the same on every machine: the reference in 50-digit decimal.

Why. NumPy picks one SIMD kernel per instruction set (baseline SSE, AVX2, AVX-512; NEON on Arm)
for float64 ``exp``, ``log``, ``tanh`` and ``power``, with different polynomials, so the same
call gives different last bits on different CPUs (measured: docs/reproducibility.md). Fixtures
written with them could not be reproduced bit for bit anywhere else.

How. ``golden.reference`` is written once over NumPy arrays. Inside
``golden.reference.exact_arithmetic()`` its arrays hold ``Real`` numbers (NumPy object arrays):
Python ``decimal`` values with ``PRECISION`` significant digits. Every ``+ − × ÷ √`` is
correctly rounded to that precision, and
so are ``exp`` and ``ln`` (the decimal module guarantees both); ``tanh``, ``sin`` and ``cos`` are
built here from those operations in a fixed order, with guard digits. The decimal module is
integer arithmetic (libmpdec), so none of this depends on the processor, its instruction set,
the compiler or the C library. ``to_float64`` then rounds each value once, with Python's own
correctly rounded decimal-to-binary conversion.

What it promises. A stored float64 is the exact value of the maths on the stored (float32)
inputs, rounded to nearest once, wherever the 50-digit result is closer to that value than to a
float64 rounding boundary: it carries about 35 more digits than float64 keeps, so only a value
that cancels by more than ~30 digits, or lies within ~1e-30 (relative) of a boundary, could
round differently. Values that are zero in exact arithmetic because of the structure of the
computation (golden.reference.zero_grads) come out as tiny residues here and are stored as
exact zeros by the caller.
"""

from __future__ import annotations

import decimal
import functools
from decimal import Decimal

import numpy as np

PRECISION = 50  # significant decimal digits of every intermediate value
_GUARD = 10  # extra digits inside tanh, sin and cos
_MAX_EXP = 999_999  # exp(±1e6) and every product of float64 values fit without overflow


def _context(prec: int) -> decimal.Context:
    return decimal.Context(prec=prec, rounding=decimal.ROUND_HALF_EVEN, Emin=-_MAX_EXP,
                           Emax=_MAX_EXP, traps=[decimal.InvalidOperation,
                                                 decimal.DivisionByZero, decimal.Overflow])


def _operand(x):
    """A Decimal equal to ``x`` exactly (floats, ints, bools and NumPy scalars)."""
    if isinstance(x, Decimal):
        return x
    if isinstance(x, (bool, np.bool_)):
        return Decimal(int(x))
    if isinstance(x, (int, np.integer)):
        return Decimal(int(x))
    if isinstance(x, (float, np.floating)):
        return Decimal(float(x))  # exact: every float32 and float64 is a finite decimal
    return NotImplemented


def _binary(operation: str, reflected: bool = False):
    """A binary operator of Number: the context's ``operation`` on self and the other operand
    taken exactly (``other op self`` when ``reflected``), rounded to the class's precision."""
    def method(self, other):
        other = _operand(other)
        if other is NotImplemented:
            return NotImplemented
        op = getattr(self.ctx, operation)
        return self._make(op(other, self) if reflected else op(self, other))
    return method


class Number(Decimal):
    """A decimal number whose arithmetic is rounded to its class's precision; mixes with
    Python and NumPy floats and ints (taken exactly). NumPy's ufuncs on object arrays call the
    methods of the same name (exp, log, sqrt, tanh, sin, cos)."""

    __slots__ = ()
    ctx: decimal.Context

    def _make(self, value):
        return self.__class__(value)

    __add__ = __radd__ = _binary("add")
    __sub__, __rsub__ = _binary("subtract"), _binary("subtract", reflected=True)
    __mul__ = __rmul__ = _binary("multiply")
    __truediv__, __rtruediv__ = _binary("divide"), _binary("divide", reflected=True)

    def __pow__(self, n):
        """Integer powers only, as repeated products (each correctly rounded)."""
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
            return NotImplemented
        result = self._make(1)
        for _ in range(int(n)):
            result = result * self
        return result

    # Decimal's own unary operators round to the thread's context: use this class's.
    def __neg__(self):
        return self._make(self.ctx.minus(self))

    def __pos__(self):
        return self._make(self.ctx.plus(self))

    def __abs__(self):
        return self._make(self.ctx.abs(self))

    def exp(self):
        return self._make(self.ctx.exp(self))  # correctly rounded (decimal module)

    def log(self):
        return self._make(self.ctx.ln(self))  # correctly rounded (decimal module)

    def sqrt(self):
        return self._make(self.ctx.sqrt(self))  # correctly rounded

    def tanh(self):
        return self._make(self.ctx.plus(_tanh(self, self.ctx.prec + _GUARD)))

    def sin(self):
        return self._make(self.ctx.plus(_sin_cos(self, self.ctx.prec + _GUARD)[0]))

    def cos(self):
        return self._make(self.ctx.plus(_sin_cos(self, self.ctx.prec + _GUARD)[1]))


@functools.cache
def real_type(prec: int = PRECISION) -> type:
    """The ``Real`` class of ``prec`` significant digits (tests use a higher one as oracle)."""
    return type(f"Real{prec}", (Number,), {"__slots__": (), "ctx": _context(prec)})


Real = real_type(PRECISION)


def _tanh(x: Decimal, prec: int) -> Decimal:
    """tanh x = (e^{2x} − 1) / (e^{2x} + 1), with as many more digits as e^{2x} − 1 cancels."""
    if x.is_zero():
        return Decimal(x)
    a = x.copy_abs()
    if a > 100_000:  # 1 − tanh a < 1e-86000: ±1 at any precision used here
        return Decimal(1).copy_sign(x)
    w = _context(prec + max(0, -a.adjusted()))
    e = w.exp(w.multiply(2, a))
    return w.divide(w.subtract(e, 1), w.add(e, 1)).copy_sign(x)


@functools.cache
def _pi(prec: int) -> Decimal:
    """π to ``prec`` digits (the series of the decimal module's documentation)."""
    w = _context(prec + 5)
    lasts, t, s, n, na, d, da = Decimal(0), Decimal(3), Decimal(3), 1, 0, 0, 24
    while s != lasts:
        lasts = s
        n, na = n + na, na + 8
        d, da = d + da, da + 32
        t = w.divide(w.multiply(t, n), d)
        s = w.add(s, t)
    return _context(prec).plus(s)


def _sin_cos(x: Decimal, prec: int) -> tuple[Decimal, Decimal]:
    """(sin x, cos x): x reduced by the nearest multiple k of π/2 (π with as many more digits
    as x has before the point and r = x − kπ/2 has zeros after it), Taylor series on
    |r| ≤ π/4, then the quadrant k mod 4."""
    extra = max(0, x.adjusted() + 1) + 5
    while True:  # r = x − kπ/2 loses as many digits as it is small: take them back, and redo
        w = _context(prec + extra)
        half_pi = w.divide(_pi(w.prec), 2)
        k = int(w.divide(x, half_pi).to_integral_value(rounding=decimal.ROUND_HALF_EVEN))
        r = w.subtract(x, w.multiply(k, half_pi))
        lost = max(0, x.adjusted() + 1) - min(0, r.adjusted()) + 5
        if r.is_zero() or lost <= extra:
            break
        extra = lost
    r2, eps = w.multiply(r, r), Decimal(f"1e-{w.prec + 2}")
    sin, cos, term_s, term_c, n = r, Decimal(1), r, Decimal(1), 0
    while term_s.copy_abs() > eps or term_c.copy_abs() > eps:
        n += 2
        term_c = w.divide(w.multiply(w.minus(term_c), r2), (n - 1) * n)  # (−1)^m r^2m / (2m)!
        term_s = w.divide(w.multiply(w.minus(term_s), r2), n * (n + 1))  # (−1)^m r^2m+1/(2m+1)!
        cos, sin = w.add(cos, term_c), w.add(sin, term_s)
    neg_sin, neg_cos = sin.copy_negate(), cos.copy_negate()
    return [(sin, cos), (cos, neg_sin), (neg_sin, neg_cos), (neg_cos, sin)][k % 4]


def pi(real: type = Real):
    """π correctly rounded to ``real``'s precision (from guard digits)."""
    return real(real.ctx.plus(_pi(real.ctx.prec + _GUARD)))


def is_exact(a) -> bool:
    """Whether ``a`` is an array (or scalar) of this module's numbers."""
    return isinstance(a, Number) or (isinstance(a, np.ndarray) and a.dtype == object)


def array(a, real: type = Real) -> np.ndarray:
    """A float array as an object array of ``real`` numbers, each equal to its float exactly;
    boolean and integer arrays are returned unchanged."""
    a = np.asarray(a)
    if a.dtype == object:
        return a
    if a.dtype.kind != "f":
        return a
    out = np.empty(a.shape, dtype=object)
    flat = out.reshape(-1)
    for i, v in enumerate(a.astype(np.float64).reshape(-1).tolist()):
        flat[i] = real(v)
    return out


def to_float64(a) -> np.ndarray:
    """Each number rounded once to the nearest float64 (ties to even): Python's correctly
    rounded conversion of the decimal string, the same on every machine."""
    return np.asarray(a).astype(np.float64)  # an object array: float(x) of each number

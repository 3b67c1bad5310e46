"""The reference's arithmetic: which numbers its arrays hold and how its products are rounded.

Two arithmetics run the same code. By default it is NumPy float64: fast, the oracle of the
property tests and of the tolerance profiles, but its last bits depend on the CPU (NumPy's float64
exp, tanh and power have one SIMD kernel per instruction set). Inside ``exact_arithmetic()`` the
arrays hold ``golden.specification.exact.Real`` numbers (50 significant digits, every operation
correctly rounded, integer arithmetic underneath), and ``stored`` (golden.reference.storage) rounds
each result once to float64: the fixtures' values, the same bits on every machine
(docs/reproducibility.md).

``rounded_products(bits)`` turns the same code into the plain low-precision implementation that
the tolerance profiles measure against (golden.specification.tolerances.PROFILES): inside it, every
contraction rounds its operands to ``bits`` bits of precision (TF32: 11, bfloat16: 8) and its
result to float32, as a float32 matmul on TF32 or bfloat16 units does; nothing else changes.
``blas_products()`` sums the float64 contractions through BLAS instead (not for fixtures).

The three switches are context variables held here alone and read at call time: every room of
the reference takes arrays through ``real``, Python constants through ``number`` and every
contraction through ``einsum``, and asks ``number_type()`` which arithmetic is in force, so one
switch reaches them all. Shapes: any; nothing here reads the layout.
"""

from __future__ import annotations

import contextlib
import contextvars

import numpy as np

from golden.specification import exact

_PRODUCT_BITS = contextvars.ContextVar("product_bits", default=None)
_EXACT = contextvars.ContextVar("exact", default=None)  # the number type, None for float64
_BLAS = contextvars.ContextVar("blas", default=False)


@contextlib.contextmanager
def exact_arithmetic(real=exact.Real):
    """Inside, the reference computes in golden.specification.exact's 50-digit decimal arithmetic:
    the float
    arrays it is given are taken exactly, and it returns object arrays of
    golden.specification.exact.Real (``stored`` rounds them to float64). ``real``: another
    golden.specification.exact number type (a higher precision, for measuring this one)."""
    if _PRODUCT_BITS.get() is not None:
        raise ValueError("exact_arithmetic() cannot run inside rounded_products()")
    if not (isinstance(real, type) and issubclass(real, exact.Number)):
        raise TypeError(f"real should be a golden.specification.exact number type, got {real!r}")
    token = _EXACT.set(real)
    try:
        yield
    finally:
        _EXACT.reset(token)


def real(a):
    """``a`` as float64, or inside exact_arithmetic() as an array of
    golden.specification.exact.Real."""
    if exact.is_exact(a):
        return a
    real_type = _EXACT.get()
    return np.asarray(a, dtype=np.float64) if real_type is None else exact.array(a, real_type)


def number(x):
    """A Python float, or inside exact_arithmetic() the golden.specification.exact.Real equal
    to it."""
    real_type = _EXACT.get()
    return float(x) if real_type is None else real_type(float(x))


def number_type():
    """The number type in force: None for float64, or inside exact_arithmetic() its
    golden.specification.exact type."""
    return _EXACT.get()


def einsum(spec, *operands):
    """``np.einsum``; inside ``rounded_products(bits)`` on rounded operands, rounded result."""
    bits = _PRODUCT_BITS.get()
    if bits is None:
        return np.einsum(spec, *operands, optimize=_BLAS.get() and _EXACT.get() is None)
    rounded = (round_to_bits(o, bits) for o in operands)
    return np.einsum(spec, *rounded).astype(np.float32).astype(np.float64)


@contextlib.contextmanager
def blas_products():
    """Every float64 contraction inside runs through NumPy's BLAS (``np.einsum(...,
    optimize=True)``): the same float64 arithmetic, summed in another order, so the last bits
    depend on the machine; many times faster on a real model's layer. For references computed
    in memory (``attn-parity hf``), never for the stored fixtures (exact arithmetic ignores
    it)."""
    token = _BLAS.set(True)
    try:
        yield
    finally:
        _BLAS.reset(token)


@contextlib.contextmanager
def rounded_products(bits):
    """Every contraction inside rounds its operands to ``bits`` (2..24) bits of precision."""
    if not (isinstance(bits, int) and 2 <= bits <= 24):
        raise ValueError(f"bits should be an int in [2, 24], got {bits!r}")
    if _EXACT.get() is not None:
        raise ValueError("rounded_products() cannot run inside exact_arithmetic()")
    token = _PRODUCT_BITS.set(bits)
    try:
        yield
    finally:
        _PRODUCT_BITS.reset(token)


def round_to_bits(x, bits):
    """``x`` rounded to float32, then to ``bits`` bits of precision (the implicit bit counted),
    to nearest with ties to even; as float64."""
    drop = np.uint32(24 - bits)
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    if drop:
        half = (np.uint32(1) << (drop - np.uint32(1))) - np.uint32(1)
        u = (u + half + ((u >> drop) & np.uint32(1))) & ~((np.uint32(1) << drop) - np.uint32(1))
    return u.view(np.float32).astype(np.float64)

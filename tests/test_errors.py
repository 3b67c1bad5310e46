"""Bad input raises ValueError naming the argument, the expected and the actual shape or dtype,
with the same message from the reference, torch and JAX."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.helpers import JAX

Q, K, V = (2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 6)


def call(impl, shapes=(Q, K, V), dtypes=("float32",) * 3, mask=None, bias=None, **kw):
    arrays = [np.ones(s, dtype=d) for s, d in zip(shapes, dtypes)]
    if "dropout_mask" in kw and kw["dropout_mask"] is not None:
        kw["dropout_mask"] = np.ones(kw["dropout_mask"], dtype=bool)
    extra = [None if m is None else np.ones(m[0], dtype=m[1]) for m in (mask, bias)]
    conv = [None if a is None else impl.array(a) for a in arrays + extra]
    kw = {n: impl.array(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    return impl.sdpa(*conv, **kw)


BAD = [
    (dict(shapes=((1,) + Q, (1,) + K, (1,) + V)),
     "query should have rank 2, 3 or 4: (Lq, Dk), (H, Lq, Dk) or (B, H, Lq, Dk), "
     "got shape (1, 2, 3, 5, 4)"),
    (dict(shapes=((4,), (4,), (4,))), "query should have rank 2, 3 or 4"),
    (dict(shapes=(Q, (2, 3, 7, 5), V)),
     "key shape should be (B, H, Lk, Dk) = (2, 3, ?, 4), got (2, 3, 7, 5)"),
    (dict(shapes=(Q, (2, 4, 7, 4), V)),
     "key shape should be (B, H, Lk, Dk) = (2, 3, ?, 4), got (2, 4, 7, 4)"),
    (dict(shapes=(Q, (3, 7, 4), V)),
     "key shape should be (B, H, Lk, Dk) = (2, 3, ?, 4), got (3, 7, 4)"),
    (dict(shapes=(Q, K, (2, 3, 6, 6))),
     "value shape should be (B, H, Lk, Dv) = (2, 3, 7, ?), got (2, 3, 6, 6)"),
    (dict(shapes=((5, 4), (7, 4), (6, 6))), "value shape should be (Lk, Dv) = (7, ?), got (6, 6)"),
    (dict(dtypes=("int32", "int32", "int32")),
     "query dtype should be one of float16, bfloat16, float32, float64, got int32"),
    (dict(dtypes=("float32", "float16", "float32")),
     "key dtype should be float32 (the query's), got float16"),
    (dict(dtypes=("float32", "float32", "float16")),
     "value dtype should be float32 (the query's), got float16"),
    (dict(mask=((5, 7), "float32")), "mask dtype should be bool (True = may attend), got float32"),
    (dict(mask=((2, 3, 5, 6), "bool")),
     "mask shape should broadcast to (B, H, Lq, Lk) = (2, 3, 5, 7), got (2, 3, 5, 6)"),
    (dict(mask=((1, 2, 3, 5, 7), "bool")),
     "mask shape should broadcast to (B, H, Lq, Lk) = (2, 3, 5, 7), got (1, 2, 3, 5, 7)"),
    (dict(bias=((5, 7), "bool")),
     "bias dtype should be one of float16, bfloat16, float32, float64, got bool"),
    (dict(bias=((3, 7, 5), "float32")),
     "bias shape should broadcast to (B, H, Lq, Lk) = (2, 3, 5, 7), got (3, 7, 5)"),
    (dict(dropout_rate=1.0), "dropout_rate should be in [0, 1), got 1.0"),
    (dict(dropout_rate=-0.1), "dropout_rate should be in [0, 1), got -0.1"),
    (dict(dropout_mask=(2, 3, 5, 7)),
     "dropout_mask was given but dropout_rate is 0.0; set dropout_rate"),
    (dict(dropout_rate=0.5, dropout_mask=(2, 3, 7, 5)),
     "dropout_mask shape should broadcast to (B, H, Lq, Lk) = (2, 3, 5, 7), got (2, 3, 7, 5)"),
    (dict(scale=float("nan")), "scale should be a finite number or None, got nan"),
]


@pytest.mark.parametrize("kwargs, message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_input_names_the_problem(impl, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call(impl, **kwargs)


def test_jax_dropout_without_rng():
    with pytest.raises(ValueError, match=re.escape(
            "dropout_rng should be a jax.random key when dropout_rate > 0 and no dropout_mask "
            "is given, got None")):
        call(JAX, dropout_rate=0.1)


def test_good_input_passes(impl):
    call(impl, mask=((2, 1, 5, 7), "bool"), bias=((7,), "float32"), dropout_rate=0.5,
         dropout_mask=(5, 7))

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
     "key shape should be (B, Hkv, Lk, Dk) = (2, ?, ?, 4), got (2, 3, 7, 5)"),
    (dict(shapes=(Q, (2, 4, 7, 4), (2, 4, 7, 6))),
     "key and value heads Hkv should divide the query's H = 3, got Hkv = 4"),
    (dict(shapes=((3, 5, 4), (2, 7, 4), (2, 7, 6))),
     "key and value heads Hkv should divide the query's H = 3, got Hkv = 2"),
    (dict(shapes=(Q, (3, 7, 4), V)),
     "key shape should be (B, Hkv, Lk, Dk) = (2, ?, ?, 4), got (3, 7, 4)"),
    (dict(shapes=(Q, K, (2, 3, 6, 6))),
     "value shape should be (B, Hkv, Lk, Dv) = (2, 3, 7, ?), got (2, 3, 6, 6)"),
    (dict(shapes=(Q, K, (2, 1, 7, 6))),  # value's heads must be key's
     "value shape should be (B, Hkv, Lk, Dv) = (2, 3, 7, ?), got (2, 1, 7, 6)"),
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
    # Soft-capping, sliding windows, offsets and lengths (issue 9).
    (dict(softcap=0.0), "softcap should be a positive number or None, got 0.0"),
    (dict(softcap=-2), "softcap should be a positive number or None, got -2"),
    (dict(local_window_size=(-1, 2)), "local_window_size should be None, an int ≥ 0 or a pair "
     "(left, right) of ints ≥ 0 or None, got (-1, 2)"),
    (dict(local_window_size=-3), "local_window_size should be None, an int ≥ 0 or a pair "
     "(left, right) of ints ≥ 0 or None, got -3"),
    (dict(query_offset=np.ones(2, dtype=np.float32)),
     "query_offset dtype should be an integer type, got float32"),
    (dict(query_offset=-1), "query_offset should be an int ≥ 0 or an integer array, got -1"),
    (dict(query_offset=np.ones((2, 1), dtype=np.int32)),
     "query_offset shape should be (B,) = (2,), got (2, 1)"),
    (dict(key_value_seq_lengths=np.ones(3, dtype=np.int32)),
     "key_value_seq_lengths shape should be (B,) = (2,), got (3,)"),
    (dict(query_seq_lengths=np.ones((), dtype=np.int32)),
     "query_seq_lengths shape should be (B,) = (2,), got ()"),
    (dict(shapes=((3, 5, 4), (3, 7, 4), (3, 7, 6)), query_seq_lengths=np.ones(3, dtype=np.int32)),
     "query_seq_lengths shape should be () = (), got (3,)"),
    # Attention sinks (one logit per query head) and chunked attention.
    (dict(sinks=np.ones(4, np.float32)), "sinks shape should be (H,) = (3,), got (4,)"),
    (dict(shapes=((6, 5, 4), (2, 7, 4), (2, 7, 6)), sinks=np.ones(2, np.float32)),
     "sinks shape should be (H,) = (6,), got (2,)"),  # one per query head, not per kv head
    (dict(shapes=((5, 4), (7, 4), (7, 6)), sinks=np.ones(1, np.float32)),
     "sinks shape should be () = (), got (1,)"),
    (dict(sinks=np.ones(3, np.float16)),
     "sinks dtype should be float32 (the query's), got float16"),
    (dict(attention_chunk_size=0), "attention_chunk_size should be None or an int ≥ 1, got 0"),
    (dict(attention_chunk_size="4"),
     "attention_chunk_size should be None or an int ≥ 1, got '4'"),
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


def test_good_modern_input_passes(impl):
    # Grouped-query key and value (Hkv = 1 and 3 divide H = 3), every new argument at once.
    lengths = np.array([4, 7], dtype=np.int32)
    for kv_heads in (1, 3):
        call(impl, shapes=(Q, (2, kv_heads, 7, 4), (2, kv_heads, 7, 6)), softcap=30.0,
             local_window_size=(None, 2), query_offset=np.array([2, 0], dtype=np.int32),
             query_seq_lengths=np.array([5, 3], dtype=np.int32), key_value_seq_lengths=lengths,
             is_causal=True)
    call(impl, shapes=((3, 5, 4), (1, 7, 4), (1, 7, 6)), local_window_size=[1, 0],
         query_offset=np.array(2, dtype=np.int32), key_value_seq_lengths=np.array(6))
    call(impl, shapes=((6, 5, 4), (2, 7, 4), (2, 7, 6)), sinks=np.ones(6, np.float32),
         attention_chunk_size=3, is_causal=True)
    call(impl, shapes=((5, 4), (7, 4), (7, 6)), sinks=np.ones((), np.float32),
         attention_chunk_size=1)

"""Token positions, shared by both frameworks: the KV cache's layout, and the rotary
embeddings' angle tables and arithmetic (written once for both: the twins' ``rotary`` modules
only convert the tables and choose the compute dtype). NumPy only (the bottom layer); the
float64 reference computes its angles on its own, directly, and does not use these tables.

Shape legend: B batch, Hkv key-value heads, M the cache's max_length, Dh head width, L the
tokens of one call.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np


class KVCache(NamedTuple):
    """A functional KV cache, the same fields and layout in torch and JAX (a pytree in JAX).

    key, value: (B, Hkv, M, Dh), row b's first ``lengths[b]`` positions hold its tokens' keys and
    values (already rotated when the module uses RoPE); lengths: (B,) int32, tokens held per row.
    A call never changes the cache it is given: it returns a new one.
    """

    key: Any
    value: Any
    lengths: Any


# RoPE angles p·f_i, f_i = θ^(−2i/Dh), for integer positions p = ROPE_BLOCK·a + b (0 ≤ b <
# ROPE_BLOCK): cos and sin of a·ROPE_BLOCK·f_i and of b·f_i are tabulated in float64 and rounded
# once to the compute dtype; the angle-addition formulas combine them. The error is a few units
# of roundoff at every position, where the usual float32 recipe (the angle p·f_i formed in
# float32) errs by about p·2⁻²⁴ radians. Two small tables instead of one row per position: a
# cache of 128k positions needs 512 + 256 rows, not 131,072.
ROPE_BLOCK = 256


def rope_frequencies(theta: float, head_dim: int) -> np.ndarray:
    """f_i = θ^(−2i/Dh) for i = 0 … Dh/2 − 1, float64."""
    return float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


@lru_cache(maxsize=64)
def rope_tables(theta: float, head_dim: int, positions: int) -> tuple:
    """(cos_hi, sin_hi, cos_lo, sin_lo), float64: the hi tables (⌈positions / ROPE_BLOCK⌉,
    Dh/2) at a·ROPE_BLOCK, the lo tables (ROPE_BLOCK, Dh/2) at b. Read-only (shared)."""
    f = rope_frequencies(theta, head_dim)
    hi = np.arange(-(-positions // ROPE_BLOCK), dtype=np.float64)[:, None] * ROPE_BLOCK * f
    lo = np.arange(ROPE_BLOCK, dtype=np.float64)[:, None] * f
    tables = (np.cos(hi), np.sin(hi), np.cos(lo), np.sin(lo))
    for t in tables:
        t.flags.writeable = False
    return tables


def rope_cos_sin(tables, positions):
    """cos and sin (..., L, Dh/2) of position · f_i from ``rope_tables`` (already arrays of the
    caller's framework and dtype), by angle addition over the rows a = position // ROPE_BLOCK
    and b = position % ROPE_BLOCK. ``positions``: an integer array of the same framework. Only
    indexing, ``*``, ``+`` and ``−``: the same code for torch, JAX and NumPy."""
    hi, lo = positions // ROPE_BLOCK, positions % ROPE_BLOCK
    cos_hi, sin_hi, cos_lo, sin_lo = tables[0][hi], tables[1][hi], tables[2][lo], tables[3][lo]
    return cos_hi * cos_lo - sin_hi * sin_lo, sin_hi * cos_lo + cos_hi * sin_lo


def rope_turn(x, cos, sin, interleaved, *, stack, concat):
    """Each feature pair of x (..., L, Dh), (a, b) -> (a cos − b sin, b cos + a sin): the pairs
    (i, i + Dh/2) ("rotate half") or, ``interleaved``, (2i, 2i + 1). ``stack(arrays, axis)`` and
    ``concat(arrays, axis)`` are the framework's (torch.stack/torch.cat, jnp.stack/
    jnp.concatenate)."""
    half = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    turned = (a * cos - b * sin, b * cos + a * sin)
    if interleaved:
        return stack(turned, -1).reshape(x.shape)  # (..., L, Dh/2, 2) -> (..., L, Dh)
    return concat(turned, -1)


def check_fits(held, new, room, length) -> None:
    """The strict mode of both twins' GroupedQueryAttention (``strict=True``): ValueError unless
    each row's new tokens ``new`` (its query_seq_lengths, or L) are in [0, L] and fit beside the
    ``held`` ones within max_length ``room``. ``held`` and ``new`` are read on the host (NumPy).
    Without it both twins drop what does not fit: neither written nor counted, its output rows
    those of padding."""
    held = np.asarray(held).reshape(-1)
    new = np.broadcast_to(np.asarray(new), held.shape)
    if ((new < 0) | (new > length)).any():
        raise ValueError(f"query_seq_lengths should be in [0, L = {length}], got {new.tolist()}")
    if (held + new > room).any():
        raise ValueError(f"cache is full: rows holding {held.tolist()} tokens cannot take "
                         f"{new.tolist()} more within max_length M = {room}")


def allowed_terms(row, key, pos, *, is_causal, window, chunk=None, q_lengths=None,
                  kv_lengths=None, key_start=0) -> list:
    """The conditions whose AND is the allowed set, for the twins' implementations
    (the reference states the same rule on its own, golden.reference.allowed_positions): query
    ``row`` i at position ``pos`` (= i + offset) may attend key position ``key`` j when
    j ≤ pos (``is_causal``), pos − left ≤ j ≤ pos + right (``window`` = (left, right), None
    for an unbounded side), j // C = pos // C (``chunk`` C, Llama 4's attention_chunk_size),
    j < ``kv_lengths`` and i < ``q_lengths``. Integer arrays of any framework, shaped to
    broadcast against each other; a condition whose argument is None is left out.
    ``key_start``: where key and pos count from when they are relative to a block of keys
    (JAX's ring): chunks are of absolute positions, key_start + j."""
    left, right = window
    terms = [key <= pos if is_causal else None,
             key >= pos - left if left is not None else None,
             key <= pos + right if right is not None else None,
             (key + key_start) // chunk == (pos + key_start) // chunk if chunk is not None
             else None,
             key < kv_lengths if kv_lengths is not None else None,
             row < q_lengths if q_lengths is not None else None]
    return [t for t in terms if t is not None]

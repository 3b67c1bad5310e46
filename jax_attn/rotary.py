"""Rotary position embeddings in JAX. The tables and the arithmetic are golden.positions' (the
same code as torch_attn.rotary); this module converts the tables to the compute dtype."""

from __future__ import annotations

import jax.numpy as jnp

from golden.positions import rope_cos_sin, rope_tables, rope_turn
from golden.validate import check_rotary


def rotary_embedding(x, *, theta, interleaved=False, offset=None, max_position=None):
    """Rotary position embedding of x (..., L, Dh): token i (of batch row b) at position
    i + ``offset`` (None: 0; an int; or an integer array (B,) for x of shape (B, H, L, Dh),
    traced under jit). Feature pair i, (i, i + Dh/2) by default ("rotate half", Hugging Face's
    Llama) or (2i, 2i + 1) when ``interleaved`` (GPT-J, Meta's Llama), turns by
    position · θ^(−2i/Dh).

    The angles are exact to a few roundings at any position: cos and sin come from float64
    tables (golden.positions.rope_tables, constants of the compiled program) for positions below
    ``max_position`` (static; default L, exact without an offset); every position must be below
    it (a larger one reads a clamped row). The rotation runs in at least float32 and is rounded
    once to x's dtype.
    """
    check_rotary(x, theta)
    length, dh = x.shape[-2], x.shape[-1]
    if dh % 2:
        raise ValueError(f"x's last axis Dh should be even for rotary embeddings, got {dh}")
    positions = jnp.arange(length)  # (L,)
    if offset is not None:
        offset = jnp.asarray(offset, dtype=jnp.int32)
        positions = positions + offset.reshape(offset.shape + (1,) * (x.ndim - 2))  # (B, 1, L)
    max_position = length if max_position is None else max_position
    compute = jnp.promote_types(x.dtype, jnp.float32)
    tables = [jnp.asarray(t, dtype=compute) for t in rope_tables(float(theta), dh, max_position)]
    cos, sin = rope_cos_sin(tables, positions)
    return rope_turn(x.astype(compute), cos, sin, interleaved, stack=jnp.stack,
                     concat=jnp.concatenate).astype(x.dtype)


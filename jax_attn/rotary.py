"""Rotary position embeddings in JAX. The tables and the arithmetic are
golden.specification.positions' (the same code as torch_attn.rotary); this module converts the
tables to the compute dtype.

Shape legend: B batch, H heads, L tokens, Dh head width, rd the rotated features (the first rd
of each head).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from golden.specification.positions import (
    call_dependent,
    hf_inv_freq,
    ROPE_BLOCK,
    mix_axes,
    rope_axes,
    rope_blocks,
    rope_cos_sin,
    rope_turn,
    settings_tables,
)
from golden.specification.validate import check_rotary, multi_axis, rotary_dims


def rotary_embedding(x, *, theta, interleaved=False, offset=None, max_position=None,
                     positions=None, rope_parameters=None, partial_rotary_factor=1.0,
                     precision="exact"):
    """Rotary position embedding of x (..., L, Dh): token i (of batch row b) at position
    i + ``offset`` (None: 0; an int; or an integer array (B,) for x of shape (B, H, L, Dh),
    traced under jit), or at ``positions`` when given (integers (L,), (B, L) or (..., L), traced
    or not: left padding's cumsum(mask) − 1, packed sequences). Feature pair i of the first
    rd = int(Dh · ``partial_rotary_factor``) features, (i, i + rd/2) by default ("rotate
    half", Hugging Face's Llama) or (2i, 2i + 1) when ``interleaved`` (GPT-J, Meta's Llama,
    GLM), turns by position · f_i; the other Dh − rd features pass through. f_i = θ^(−2i/rd),
    or scaled as ``rope_parameters`` (Hugging Face's dict: rope_type default, linear, dynamic,
    llama3, yarn, longrope) says, cos and sin times its attention factor.

    ``precision="exact"``: the angles are exact to a few roundings at any position: cos and sin
    come from float64 tables (golden.specification.positions.rope_tables, constants of the compiled
    program) for positions below ``max_position`` (static; default L, or the largest explicit
    |position| + 1 when they are not traced); every |position| must be below it (a negative
    position turns the other way: cos(−t), sin(−t)) (one past the
    tables' whole blocks of golden.specification.positions.ROPE_BLOCK gives NaN: a loud error,
    never another angle). The rotation runs in at least float32 and is rounded once to x's dtype.
    ``precision="hf"``: Hugging Face's float32 arithmetic on purpose (inv_freq, angles, cos and sin
    in float32, cast to x's dtype and applied in it), to match a port of it.

    longrope and dynamic depend on the call's largest position, traced under jit: longrope
    selects between its two static tables (jnp.where); dynamic NTK forms θ' and its angles in
    the program, in float64 when jax_enable_x64 is on (an error of about p·2⁻⁵³ radians at
    position p, then one rounding to the compute dtype), in float32 otherwise (about p·2⁻²⁴
    radians, Hugging Face's own float32 level); a call whose positions stay within
    original_max_position_embeddings reads the exact static tables.

    Multimodal RoPE (``rope_parameters`` with ``mrope_section``, Qwen2-VL's and Qwen3-VL's):
    ``positions`` may hold one row per axis, (3, B, L) (Hugging Face's position ids) or (3, ...)
    of any form above; pair i turns by the position of its axis
    (golden.specification.positions.rope_axes). Positions of one axis (or none) are every
    axis's: the 1-D RoPE. Axial RoPE (``rope_type="axial"``, vision towers) likewise takes
    (A, B, L), A = ``axial_axes`` (the patch's row and column): its sections, frequencies and
    pairing are golden.specification.positions' rope_axes, axial_exponents and rope_blocks;
    ``axial_scale`` multiplies each axis's frequencies (axial_multipliers; DINOv3's 2π/H and
    2π/W, its positions 2i + 1 − H: golden.hf.vision.dinov3_positions).
    """
    settings = check_rotary(x, theta, rope_parameters, partial_rotary_factor, precision,
                            positions)
    length, dh = x.shape[-2], x.shape[-1]
    if dh % 2:
        raise ValueError(f"x's last axis Dh should be even for rotary embeddings, got {dh}")
    rd = rotary_dims(dh, settings)
    multi = positions is not None and multi_axis(settings, positions, x.shape)
    if positions is None:
        positions = jnp.arange(length)  # (L,)
        if offset is not None:
            offset = jnp.asarray(offset, dtype=jnp.int32)
            positions = positions + offset.reshape(offset.shape + (1,) * (x.ndim - 2))  # (B,1,L)
        max_position = length if max_position is None else max_position
    else:
        if max_position is None:
            if isinstance(positions, jax.core.Tracer):
                raise ValueError("max_position should be given with traced positions (under "
                                 "jit: the tables' static size), got None")
            max_position = int(np.max(np.abs(np.asarray(positions)))) + 1
        positions = jnp.asarray(positions, dtype=jnp.int32)
        if positions.ndim - multi == 2 and x.ndim == 4:
            positions = positions[..., None, :]  # ([3,] B, L) -> ([3,] B, 1, L): against (B, H, L)
    s = dict(settings)
    long = None
    if call_dependent(settings):  # the call's largest position + 1 passes L0 (traced)
        long = jnp.max(positions) + 1 > s["original_max_position_embeddings"]
    if s["precision"] == "hf":
        cos, sin = _hf_cos_sin(settings, rd, positions, long)
        if multi:
            cos, sin = (_mix(t, settings, rd) for t in (cos, sin))
        return rope_turn(x, cos.astype(x.dtype), sin.astype(x.dtype), interleaved,
                         stack=jnp.stack, concat=jnp.concatenate, blocks=rope_blocks(settings))
    compute = jnp.promote_types(x.dtype, jnp.float32)

    # The tables hold whole blocks of ROPE_BLOCK positions: past them JAX's indexing would
    # clamp, silently another angle, so such a position's cos and sin are NaN. (A negative
    # position p reads |p|'s rows, its sin negated: rope_cos_sin.)
    held = abs(positions) < -(-max_position // ROPE_BLOCK) * ROPE_BLOCK

    def table_cos_sin(seq_len=None):
        tables = [jnp.asarray(t, dtype=compute)
                  for t in settings_tables(settings, rd, max_position, seq_len)]
        return (jnp.where(held[..., None], t, jnp.nan) for t in rope_cos_sin(tables, positions))
    cos, sin = table_cos_sin()  # default, or longrope's short factors
    if s["rope_type"] == "longrope":
        cos_long, sin_long = table_cos_sin(s["original_max_position_embeddings"] + 1)
        cos, sin = jnp.where(long, cos_long, cos), jnp.where(long, sin_long, sin)
    elif s["rope_type"] == "dynamic":
        cos_ntk, sin_ntk = (t.astype(compute) for t in _dynamic_cos_sin(s, rd, positions))
        cos, sin = jnp.where(long, cos_ntk, cos), jnp.where(long, sin_ntk, sin)
    if multi:
        cos, sin = (_mix(t, settings, rd) for t in (cos, sin))
    return rope_turn(x.astype(compute), cos, sin, interleaved, stack=jnp.stack,
                     concat=jnp.concatenate, blocks=rope_blocks(settings)).astype(x.dtype)


def _mix(values, settings, rd):
    """(..., L, rd/2) of each axis's (A, ..., L, rd/2): pair i from its axis (mix_axes)."""
    return mix_axes(values, rope_axes(settings, rd), _select)


def _select(values, index):
    """values (A, ..., rd/2) at ``index`` (1, ..., rd/2) along the first axis, by a chain of
    elementwise selects (fused with the rest of the rotation; a gather there, take_along_axis,
    was slower on XLA's CPU backend than the whole 1-D rotation)."""
    out = values[:1]
    for a in range(1, values.shape[0]):
        out = jnp.where(jnp.asarray(index) == a, values[a:a + 1], out)
    return out


def _dynamic_cos_sin(s, rd, positions):
    """Dynamic NTK's cos and sin (..., L, rd/2) in the program: θ' = θ · (s · seq / L0 −
    (s − 1))^(rd / (rd − 2)) from the traced seq = largest position + 1, f_i = θ'^(−2i/rd),
    in float64 when jax_enable_x64 is on, float32 otherwise."""
    wide = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    seq = (jnp.max(positions) + 1).astype(wide)
    ratio = s["factor"] * seq / s["original_max_position_embeddings"] - (s["factor"] - 1)
    log_theta = jnp.log(wide(s["rope_theta"])) + jnp.log(ratio) * (rd / (rd - 2))
    exponent = jnp.asarray(np.arange(0, rd, 2) / rd, dtype=wide)
    angles = positions[..., None].astype(wide) * jnp.exp(-exponent * log_theta)  # (..., L, rd/2)
    return jnp.cos(angles), jnp.sin(angles)


def _hf_cos_sin(settings, rd, positions, long):
    """Hugging Face's float32 cos and sin (..., L, rd/2) (golden.specification.positions.hf_inv_freq
    in JAX's
    float32; longrope's two inv_freq and dynamic's two selected by the traced ``long``)."""
    def array(values):
        return jnp.asarray(values, dtype=jnp.float32)
    s = dict(settings)
    inv_freq, factor = hf_inv_freq(settings, rd, array)
    if s["rope_type"] == "longrope":
        inv_long, _ = hf_inv_freq(settings, rd, array, s["original_max_position_embeddings"] + 1)
        inv_freq = jnp.where(long, inv_long, inv_freq)
    elif s["rope_type"] == "dynamic":
        seq = (jnp.max(positions) + 1).astype(jnp.float32)
        inv_freq = jnp.where(long, hf_inv_freq(settings, rd, array, seq)[0], inv_freq)
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # (..., L, rd/2)
    return jnp.cos(angles) * jnp.float32(factor), jnp.sin(angles) * jnp.float32(factor)


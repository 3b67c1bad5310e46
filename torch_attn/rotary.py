"""Rotary position embeddings in PyTorch. The tables and the arithmetic are
golden.specification.positions' (the same code as jax_attn.rotary); this module converts the tables
to the compute dtype.

Shape legend: B batch, H heads, L tokens, Dh head width, rd the rotated features (the first rd
of each head).
"""

from __future__ import annotations

import torch

from golden.specification.positions import (
    call_dependent,
    hf_inv_freq,
    mix_axes,
    rope_axes,
    rope_blocks,
    rope_cos_sin,
    rope_turn,
    settings_tables,
)
from golden.specification.validate import check_rotary, multi_axis, rotary_dims
from torch_attn.explicit import LOW_PRECISION, per_batch


def rotary_embedding(x, *, theta, interleaved=False, offset=None, max_position=None,
                     positions=None, rope_parameters=None, partial_rotary_factor=1.0,
                     precision="exact"):
    """Rotary position embedding of x (..., L, Dh): token i (of batch row b) at position
    i + ``offset`` (None: 0; an int; or an integer tensor (B,) for x of shape (B, H, L, Dh)), or
    at ``positions`` when given (integers (L,), (B, L) or (..., L): left padding's
    cumsum(mask) − 1, packed sequences). Feature pair i of the first rd = int(Dh ·
    ``partial_rotary_factor``) features, (i, i + rd/2) by default ("rotate half", Hugging
    Face's Llama) or (2i, 2i + 1) when ``interleaved`` (GPT-J, Meta's Llama, GLM), turns by
    position · f_i; the other Dh − rd features pass through. f_i = θ^(−2i/rd), or scaled as
    ``rope_parameters`` (Hugging Face's dict: rope_type default, linear, dynamic, llama3, yarn,
    longrope) says, cos and sin times its attention factor.

    ``precision="exact"``: the angles are exact to a few roundings at any position: cos and sin
    come from float64 tables (golden.specification.positions.rope_tables) for positions below
    ``max_position`` (default L, or the largest explicit |position| + 1); every |position| must
    be below it (a negative position turns the other way: cos(−t), sin(−t)). The rotation runs
    in at least float32 and is rounded once to x's dtype.
    ``precision="hf"``: Hugging Face's float32 arithmetic on purpose (inv_freq, angles, cos and
    sin in float32, cast to x's dtype and applied in it), to match a port of it.

    longrope and dynamic depend on the call's largest position (read on the host here).

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
        offset = per_batch(offset, x.device)  # 0, an int or (B, 1, 1, 1)
        if torch.is_tensor(offset):
            offset = offset.reshape(-1, *(1,) * (x.dim() - 2))  # (B, 1, 1): against (B, H, L)
        positions = torch.arange(length, device=x.device) + offset  # (L,) or (B, 1, L)
        max_position = length if max_position is None else max_position
    else:
        positions = positions.to(x.device)
        if positions.dim() - multi == 2 and x.dim() == 4:
            positions = positions.unsqueeze(-2)  # ([3,] B, L) -> ([3,] B, 1, L): against (B, H, L)
        if max_position is None:
            max_position = int(positions.abs().max()) + 1  # |p|: a negative p turns back
    seq_len = int(positions.max()) + 1 if call_dependent(settings) else None  # a host read
    if dict(settings)["precision"] == "hf":
        cos, sin = _hf_cos_sin(settings, rd, positions, seq_len, x.device)
        if multi:
            cos, sin = (_mix(t, settings, rd) for t in (cos, sin))
        return rope_turn(x, cos.to(x.dtype), sin.to(x.dtype), interleaved, stack=torch.stack,
                         concat=torch.cat, blocks=rope_blocks(settings))
    compute = torch.float32 if x.dtype in LOW_PRECISION else x.dtype
    tables = [torch.tensor(t, dtype=compute, device=x.device)  # a copy: the tables are shared
              for t in settings_tables(settings, rd, max_position, seq_len)]
    cos, sin = rope_cos_sin(tables, positions)
    if multi:
        cos, sin = (_mix(t, settings, rd) for t in (cos, sin))
    return rope_turn(x.to(compute), cos, sin, interleaved, stack=torch.stack,
                     concat=torch.cat, blocks=rope_blocks(settings)).to(x.dtype)


def _mix(values, settings, rd):
    """(..., L, rd/2) of each axis's (A, ..., L, rd/2): pair i from its axis (mix_axes)."""
    return mix_axes(values, rope_axes(settings, rd), lambda v, i: torch.gather(
        v, 0, torch.from_numpy(i).to(v.device).expand((1,) + tuple(v.shape[1:]))))


def _hf_cos_sin(settings, rd, positions, seq_len, device):
    """Hugging Face's float32 cos and sin (..., L, rd/2): its inv_freq
    (golden.specification.positions.hf_inv_freq with torch's own float32 operations), angles
    position · inv_freq in float32, cos and sin times the attention factor in float32."""
    def array(values):
        return torch.as_tensor(values, dtype=torch.float32, device=device)
    s = dict(settings)
    if s["rope_type"] == "dynamic" and seq_len is not None:  # HF: θ' in float32 past L0
        seq_len = array(seq_len) if seq_len > s["original_max_position_embeddings"] else None
    inv_freq, factor = hf_inv_freq(settings, rd, array, seq_len)
    angles = positions[..., None].float() * inv_freq  # (..., L, rd/2)
    return angles.cos() * factor, angles.sin() * factor


def rotary_cos_sin(settings, rd, positions, max_position, dtype):
    """(cos, sin) (..., rd/2) of the RoPE ``settings`` (checked: golden.specification.validate.
    rope_settings) for rd rotated features at integer ``positions`` (...), what
    rotary_embedding turns by, for a caller that turns features of another width
    (GroupedQueryAttention's block indexer): "exact" from the float64 tables, in ``dtype``
    (every |position| below ``max_position``); "hf" Hugging Face's float32. One position per
    token (a multimodal RoPE's text: every axis the same). longrope and dynamic read the
    largest position (a device sync), as rotary_embedding does."""
    seq_len = int(positions.max()) + 1 if call_dependent(settings) else None  # a host read
    if dict(settings)["precision"] == "hf":
        return _hf_cos_sin(settings, rd, positions, seq_len, positions.device)
    tables = [torch.tensor(t, dtype=dtype, device=positions.device)  # a copy: they are shared
              for t in settings_tables(settings, rd, max_position, seq_len)]
    return rope_cos_sin(tables, positions)

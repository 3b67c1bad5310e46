"""Rotary position embeddings in PyTorch. The tables and the arithmetic are golden.positions'
(the same code as jax_attn.rotary); this module converts the tables to the compute dtype."""

from __future__ import annotations

import torch

from golden.positions import rope_cos_sin, rope_tables, rope_turn
from golden.validate import check_rotary
from torch_attn.explicit import LOW_PRECISION, per_batch


def rotary_embedding(x, *, theta, interleaved=False, offset=None, max_position=None):
    """Rotary position embedding of x (..., L, Dh): token i (of batch row b) at position
    i + ``offset`` (None: 0; an int; or an integer tensor (B,) for x of shape (B, H, L, Dh)).
    Feature pair i, (i, i + Dh/2) by default ("rotate half", Hugging Face's Llama) or (2i,
    2i + 1) when ``interleaved`` (GPT-J, Meta's Llama), turns by position · θ^(−2i/Dh).

    The angles are exact to a few roundings at any position: cos and sin come from float64
    tables (golden.positions.rope_tables) for positions below ``max_position`` (default L,
    exact without an offset); every position must be below it. The rotation runs in at least
    float32 and is rounded once to x's dtype.
    """
    check_rotary(x, theta)
    length, dh = x.shape[-2], x.shape[-1]
    if dh % 2:
        raise ValueError(f"x's last axis Dh should be even for rotary embeddings, got {dh}")
    positions = torch.arange(length, device=x.device)  # (L,)
    offset = per_batch(offset, x.device)  # 0, an int or (B, 1, 1, 1)
    if torch.is_tensor(offset):
        offset = offset.reshape(-1, *(1,) * (x.dim() - 2))  # (B, 1, 1): against (B, H, L)
    positions = positions + offset  # (L,) or (B, 1, L)
    max_position = length if max_position is None else max_position
    compute = torch.float32 if x.dtype in LOW_PRECISION else x.dtype
    tables = [torch.tensor(t, dtype=compute, device=x.device)  # a copy: the tables are shared
              for t in rope_tables(float(theta), dh, max_position)]
    cos, sin = rope_cos_sin(tables, positions)
    return rope_turn(x.to(compute), cos, sin, interleaved, stack=torch.stack,
                     concat=torch.cat).to(x.dtype)


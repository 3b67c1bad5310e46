"""What every torch_attn variant module shares: ``_config`` (the constructor arguments checked
against the variant's description) and ``_dropout_rate`` (the module's dropout in training
mode, 0 in eval mode). The twin of jax_attn.modules.base, where the same machinery is a base
class because NNX keeps settings static and draws dropout from a stream.
"""

from __future__ import annotations

import torch

from golden.specification.temperature import learned_temperature, temperature
from golden.specification.variants import VARIANTS


def _config(variant, **given) -> dict:
    """The constructor arguments, checked against the variant's description
    (golden.specification.variants)."""
    return VARIANTS[variant].config(given)


def _dropout_rate(module) -> float:
    return module.dropout if module.training else 0.0


def _head_mask(mask, x):
    """The core's mask (B, 1 or N, Lq, Lk) of a module's mask for x (B, Lq, d): (B, Lq, Lk)
    gains the head axis; a mask with one, (B, 1 or N, Lq, Lk) (Hugging Face's 4-D boolean
    masks), is used as it is. None stays None."""
    if mask is None:
        return None
    return mask if mask.dim() == x.dim() + 1 else mask.unsqueeze(-3)


def _query_temperature(module, q, offset, positions):
    """q (B, N, L, Dh) times the module's query temperature (its ``query_temperature``,
    golden.specification.temperature; the learned kind's ``temperature_scale`` and
    ``temperature_bias``) at each token's position (``positions``, or index + offset), in at
    least float32, rounded once."""
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    if positions is None:
        positions = torch.arange(q.shape[-2], device=q.device)  # (L,)
        if offset is not None:
            positions = positions + offset[:, None]  # (B, L)
    positions, t = positions.to(q.device), module.query_temperature
    functions = dict(real=lambda n: n.to(compute), log1p=torch.log1p)
    if t.get("kind") == "learned":  # (N, L) or (B, N, L)
        factors = learned_temperature(positions, module.temperature_scale.to(compute),
                                      module.temperature_bias.to(compute), **functions)
        return (q.to(compute) * factors[..., None]).to(q.dtype)
    factors = temperature(positions, t, exp=torch.exp, **functions)
    factors = factors[..., None] if factors.dim() == 1 else factors[:, None, :, None]
    return (q.to(compute) * factors).to(q.dtype)  # (L, 1) or (B, 1, L, 1)

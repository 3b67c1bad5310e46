"""What every torch_attn variant module shares: ``_config`` (the constructor arguments checked
against the variant's description) and ``_dropout_rate`` (the module's dropout in training
mode, 0 in eval mode). The twin of jax_attn.modules.base, where the same machinery is a base
class because NNX keeps settings static and draws dropout from a stream.
"""

from __future__ import annotations

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

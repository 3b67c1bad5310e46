"""Run a golden fixture through PyTorch: outputs, weights and the gradients of the fixed loss."""

from __future__ import annotations

import numpy as np
import torch

from torch_attn.functional import scaled_dot_product_attention

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def run_fixture(fixture, dtype: str = "float32") -> dict:
    """Return {'output', 'weights', 'grads': {name: array}} as NumPy arrays."""
    dt = _DTYPES[dtype]
    inputs = {n: _tensor(a, dt) for n, a in fixture.inputs.items()}
    if fixture.variant != "scaled_dot_product_attention":
        raise ValueError(f"variant should be scaled_dot_product_attention, got {fixture.variant!r}")
    out, weights = scaled_dot_product_attention(**inputs, **fixture.config, return_weights=True)
    loss = (out * _tensor(fixture.cotangents["output"], dt)).sum() + (
        weights * _tensor(fixture.cotangents["weights"], dt)).sum()
    leaves = {n: t for n, t in inputs.items() if t.requires_grad}
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {"output": out.detach().numpy(), "weights": weights.detach().numpy(),
            "grads": {n: g.numpy() for n, g in zip(leaves, grads)}}


def _tensor(array, dtype):
    """Float arrays become leaves of ``dtype`` that need gradients; masks stay bool."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    return t.to(dtype).requires_grad_() if t.is_floating_point() else t

"""Run a golden fixture through PyTorch: outputs, weights and the gradients of the fixed loss."""

from __future__ import annotations

import numpy as np
import torch

from golden.variants import SDPA, call_args
from torch_attn.functional import scaled_dot_product_attention
from torch_attn.params import build, export_grads

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def run_fixture(fixture, dtype: str = "float32") -> dict:
    """Return {'output', 'weights', 'grads': {name: array}} as NumPy arrays.

    Modules are built from the fixture's parameters cast to ``dtype``, in training mode when the
    fixture holds a dropout keep-mask and in eval mode otherwise.
    """
    dt = _DTYPES[dtype]
    inputs = {n: _tensor(a, dt) for n, a in fixture.inputs.items()}
    args, kwargs = call_args(fixture.variant, inputs)
    module = None
    if fixture.variant == SDPA:
        out, weights = scaled_dot_product_attention(*args, **kwargs, **fixture.config,
                                                    return_weights=True)
    else:
        params = {n: a.astype(dtype) for n, a in fixture.params.items()}
        module = build(fixture.variant, fixture.config, params)
        module.train("dropout_mask" in inputs)
        out, weights = module(*args, **kwargs, return_weights=True)
    loss = (out * _tensor(fixture.cotangents["output"], dt)).sum() + (
        weights * _tensor(fixture.cotangents["weights"], dt)).sum()
    loss.backward()
    grads = {n: t.grad.numpy() for n, t in inputs.items() if t.requires_grad}
    if module is not None:
        grads.update(export_grads(module))
    return {"output": out.detach().numpy(), "weights": weights.detach().numpy(), "grads": grads}


def _tensor(array, dtype):
    """Float arrays become leaves of ``dtype`` that need gradients; masks stay bool."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    return t.to(dtype).requires_grad_() if t.is_floating_point() else t

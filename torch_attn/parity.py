"""Run a golden fixture through PyTorch: outputs, weights and the gradients of the fixed loss."""

from __future__ import annotations

import numpy as np
import torch

from golden.variants import SDPA, call_args
from torch_attn.functional import scaled_dot_product_attention
from torch_attn.params import build, export_grads

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
           "float16": torch.float16}


def run_fixture(fixture, dtype: str = "float32") -> dict:
    """Return {'output', 'weights', 'grads': {name: array}} as float64 NumPy arrays, and under
    'dtype' the dtype the output was computed in.

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
        module = build(fixture.variant, fixture.config, fixture.params).to(dt)
        module.train("dropout_mask" in inputs)
        out, weights = module(*args, **kwargs, return_weights=True)
    loss = (out * _tensor(fixture.cotangents["output"], dt)).sum() + (
        weights * _tensor(fixture.cotangents["weights"], dt)).sum()
    loss.backward()
    grads = {n: _numpy(t.grad) for n, t in inputs.items() if t.requires_grad}
    if module is not None:
        grads.update({n: g.astype(np.float64) for n, g in export_grads(module).items()})
    return {"output": _numpy(out), "weights": _numpy(weights), "grads": grads,
            "dtype": str(out.dtype).removeprefix("torch.")}


def _numpy(t):
    return t.detach().to(torch.float64).numpy()


def _tensor(array, dtype):
    """Float arrays become leaves of ``dtype`` that need gradients; masks stay bool."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    return t.to(dtype).requires_grad_() if t.is_floating_point() else t

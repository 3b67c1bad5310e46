"""Run a golden fixture through PyTorch: outputs, weights and the gradients of the fixed loss
(the contract is in ``golden.runners``)."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

import torch_attn
from golden import variants
from torch_attn.params import export_grads

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
           "float16": torch.float16}


def run_fixture(fixture, dtype: str = "float32") -> dict:
    """Forward with the weights and backward through autograd: the core's explicit path."""
    variant, dt = variants.get(fixture.variant), _DTYPES[dtype]
    inputs = {n: _tensor(a, dt) for n, a in fixture.inputs.items()}
    args, kwargs = variant.call_args(inputs)
    if variant.is_module:
        call = torch_attn.build(fixture.variant, fixture.config, fixture.params).to(dt)
        call.train("dropout_mask" in inputs)
    else:
        call = partial(torch_attn.scaled_dot_product_attention, **fixture.config)
    out, weights = call(*args, **kwargs, return_weights=True)
    loss = (out * _tensor(fixture.cotangents["output"], dt)).sum() + (
        weights * _tensor(fixture.cotangents["weights"], dt)).sum()
    loss.backward()
    grads = {n: _numpy(t.grad) for n, t in inputs.items() if t.requires_grad}
    if variant.is_module:
        grads.update({n: g.astype(np.float64) for n, g in export_grads(call).items()})
    return {"output": _numpy(out), "weights": _numpy(weights), "grads": grads,
            "dtype": str(out.dtype).removeprefix("torch.")}


def run_fused(fixture, dtype: str = "float32") -> dict:
    """The forward alone under ``torch.no_grad()``, which the core runs with PyTorch's fused
    kernel: {"output", "dtype"} (no weights, no gradients). Not for fixtures with a keep-mask:
    dropout always takes the explicit path."""
    variant, dt = variants.get(fixture.variant), _DTYPES[dtype]
    inputs = {n: _tensor(a, dt) for n, a in fixture.inputs.items()}
    args, kwargs = variant.call_args(inputs)
    if variant.is_module:
        call = torch_attn.build(fixture.variant, fixture.config, fixture.params).to(dt).eval()
    else:
        call = partial(torch_attn.scaled_dot_product_attention, **fixture.config)
    with torch.no_grad():
        out = call(*args, **kwargs)
    return {"output": _numpy(out), "dtype": str(out.dtype).removeprefix("torch.")}


def _numpy(t):
    return t.detach().to(torch.float64).numpy()


def _tensor(array, dtype):
    """Float arrays become leaves of ``dtype`` that need gradients; masks stay bool."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    return t.to(dtype).requires_grad_() if t.is_floating_point() else t

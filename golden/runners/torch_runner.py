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
    call, _ = _prepared(fixture, dtype, train="dropout_mask" in fixture.inputs)
    return run_module(call, fixture, dtype)


def run_module(call, fixture, dtype: str = "float32") -> dict:
    """The runner's result for ``call``, a module of the fixture's variant in the mode and
    dtype it has (or the core with the fixture's settings), on the fixture's inputs."""
    dt = _DTYPES[dtype]
    inputs = {n: _tensor(a, dt) for n, a in fixture.inputs.items()}
    args, kwargs = variants.get(fixture.variant).call_args(inputs)
    if isinstance(call, torch.nn.Module):
        call.zero_grad(set_to_none=True)
    out, weights = call(*args, **kwargs, return_weights=True)
    loss = (out * _tensor(fixture.cotangents["output"], dt)).sum() + (
        weights * _tensor(fixture.cotangents["weights"], dt)).sum()
    loss.backward()
    grads = {n: _numpy(t.grad) for n, t in inputs.items() if t.requires_grad}
    if isinstance(call, torch.nn.Module):
        grads.update({n: g.astype(np.float64) for n, g in export_grads(call).items()})
    return {"output": _numpy(out), "weights": _numpy(weights), "grads": grads,
            "dtype": str(out.dtype).removeprefix("torch.")}


def run_fused(fixture, dtype: str = "float32") -> dict:
    """The forward alone under ``torch.no_grad()``, which the core runs with PyTorch's fused
    kernel: {"output", "dtype"} (no weights, no gradients). Only where
    ``golden.runners.fused_applies``: dropout and soft-capping take the explicit path."""
    call, dt = _prepared(fixture, dtype, train=False)
    inputs = {n: _tensor(a, dt) for n, a in fixture.inputs.items()}
    args, kwargs = variants.get(fixture.variant).call_args(inputs)
    with torch.no_grad():
        out = call(*args, **kwargs)
    return {"output": _numpy(out), "dtype": str(out.dtype).removeprefix("torch.")}


def _prepared(fixture, dtype, train):
    """(the core with the fixture's settings, or the module built from its parameters in
    ``dtype``, in training mode when ``train``; the torch dtype)."""
    variant, dt = variants.get(fixture.variant), _DTYPES[dtype]
    if not variant.is_module:
        return partial(torch_attn.scaled_dot_product_attention, **fixture.config), dt
    module = torch_attn.build(fixture.variant, fixture.config, fixture.params).to(dt)
    return module.train(train), dt


def _numpy(t):
    return t.detach().to(torch.float64).numpy()


def _tensor(array, dtype):
    """Float arrays become leaves of ``dtype`` that need gradients; masks stay bool."""
    t = torch.from_numpy(np.require(array, requirements="C"))  # 0-d stays 0-d
    return t.to(dtype).requires_grad_() if t.is_floating_point() else t

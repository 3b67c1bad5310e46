"""Run a golden fixture through PyTorch: outputs, weights and the gradients of the fixed loss
(the contract is in ``golden.runners``)."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

import torch_attn
from golden.specification import implementations, variants
from golden.runners.adapt import refuse_pending
from golden.runners.frameworks import TORCH
from torch_attn.params import export_grads


def run_fixture(fixture, dtype: str = "float32") -> dict:
    """Forward with the weights and backward through autograd (the core takes "explicit")."""
    refuse_pending(fixture, "torch_attn")
    call, _ = _prepared(fixture, dtype, train="dropout_mask" in fixture.inputs)
    return run_module(call, fixture, dtype)


def run_module(call, fixture, dtype: str = "float32") -> dict:
    """The runner's result for ``call``, a module of the fixture's variant in the mode and
    dtype it has (or the core with the fixture's settings), on the fixture's inputs."""
    inputs = TORCH.leaves(fixture.inputs, dtype)
    args, kwargs = variants.lookup(fixture.variant).call_args(inputs)
    if isinstance(call, torch.nn.Module):
        call.zero_grad(set_to_none=True)
    with implementations.record() as ran:
        out, weights = _called(call, fixture, args, kwargs)
    TORCH.loss(fixture.cotangents, out, weights, dtype).backward()
    grads = {n: TORCH.numpy(t.grad) for n, t in inputs.items() if t.requires_grad}
    if isinstance(call, torch.nn.Module):
        grads.update({n: np.ascontiguousarray(g, dtype=np.float64)  # (in, out) in C order,
                      for n, g in export_grads(call).items()})  # as the expected arrays
    result = {"output": TORCH.numpy(out), "weights": TORCH.numpy(weights), "grads": grads,
              "dtype": TORCH.dtype_name(out), "core": implementations.names(ran)}
    return result if weights is not None else {k: v for k, v in result.items() if k != "weights"}


def _called(call, fixture, args, kwargs):
    """(output, weights): with ``return_weights=True`` where the fixture holds weights; a
    recurrent mixer's fixture holds none (its module returns y alone): (y, None)."""
    if "weights" in fixture.expected:
        return call(*args, **kwargs, return_weights=True)
    return call(*args, **kwargs), None


def run_fused(fixture, dtype: str = "float32") -> dict:
    """The forward alone under ``torch.no_grad()`` with PyTorch's fused kernel (the core with
    ``implementation="fused"``; a module's core chooses it, being forward-only): {"output",
    "dtype", "core"}, no weights, no gradients. Only for fixtures that ``refuses("fused",
    fixture)`` lets by."""
    refuse_pending(fixture, "torch_attn")
    call, _ = _prepared(fixture, dtype, train=False)
    if not isinstance(call, torch.nn.Module):
        call = partial(call, implementation="fused")
    inputs = TORCH.leaves(fixture.inputs, dtype)
    args, kwargs = variants.lookup(fixture.variant).call_args(inputs)
    with torch.no_grad(), implementations.record() as ran:
        out = call(*args, **kwargs)
    return {"output": TORCH.numpy(out), "dtype": TORCH.dtype_name(out),
            "core": implementations.names(ran)}


def refuses(core, fixture) -> str | None:
    """Why torch's core implementation ``core`` cannot run the fixture's forward (its own rule,
    from torch_attn.IMPLEMENTATIONS), or None."""
    if "weights" not in fixture.expected:
        return f"{fixture.variant} is a recurrent mixer: no attention core to choose"
    asked = implementations.Asked(softcap=fixture.config.get("softcap") is not None,
                                  dropout="dropout_mask" in fixture.inputs,
                                  sinks="sinks" in fixture.inputs or "sinks" in fixture.params)
    return torch_attn.IMPLEMENTATIONS.refuses(core, asked)


def _prepared(fixture, dtype, train):
    """(the core with the fixture's settings, or the module built from its parameters in
    ``dtype``, in training mode when ``train``; the torch dtype)."""
    variant, dt = variants.lookup(fixture.variant), TORCH.dtype(dtype)
    if not variant.is_module:
        return partial(torch_attn.scaled_dot_product_attention, **fixture.config), dt
    params = fixture.params  # float32 and float64 built as such (one copy); others cast after
    if dtype in ("float32", "float64"):
        params = {n: np.asarray(a, dtype=dtype) for n, a in params.items()}
    module = torch_attn.build(fixture.variant, fixture.config, params).to(dt)
    return module.train(train), dt

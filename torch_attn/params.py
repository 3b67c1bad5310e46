"""Build a module from neutral-layout parameters and export them back (see golden.variants).

PyTorch's ``nn.Linear`` stores W as (out, in); the neutral layout is (in, out), so weights are
transposed at this edge and nowhere else. The wrapper's heads are stacked on a leading axis.
"""

from __future__ import annotations

import numpy as np
import torch

from golden.variants import CLASS_NAMES, check_params
from torch_attn import modules


def _linears(module) -> dict:
    """{role: [nn.Linear, ...]} per projection; a list of one, or one per wrapper head."""
    if isinstance(module, modules.MultiHeadAttentionWrapper):
        found = {r: [getattr(h, f"W_{r}") for h in module.heads] for r in ("query", "key", "value")}
    else:
        found = {r: [getattr(module, f"W_{r}")] for r in ("query", "key", "value")
                 if hasattr(module, f"W_{r}")}
    if getattr(module, "out_proj", None) is not None:
        found["out"] = [module.out_proj]
    return found


def _stacked(module, role) -> bool:
    return isinstance(module, modules.MultiHeadAttentionWrapper) and role != "out"


def _check_module(module) -> None:
    if getattr(module, "variant", None) not in CLASS_NAMES:
        raise ValueError(f"module should be a torch_attn variant, got {type(module).__name__}")


def export_params(module) -> dict:
    """{neutral name: NumPy array}: W (in, out) and b (out,), or (N, in, out) and (N, out)."""
    return _export(module, lambda p: p.detach())


def export_grads(module) -> dict:
    """The parameters' ``.grad`` in the neutral layout (after a backward pass)."""
    return _export(module, lambda p: p.grad)


def _export(module, get) -> dict:
    _check_module(module)
    out = {}
    for role, layers in _linears(module).items():
        pick = np.stack if _stacked(module, role) else (lambda arrays: arrays[0])
        out[f"W_{role}"] = pick([_numpy(get(lin.weight)).T for lin in layers])
        if layers[0].bias is not None:
            out[f"b_{role}"] = pick([_numpy(get(lin.bias)) for lin in layers])
    return out


def _numpy(t):
    """NumPy has no bfloat16: low-precision tensors are exported as float32 (exactly)."""
    t = t.cpu()
    return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()


def load_params(module, params) -> None:
    """Copy neutral-layout parameters into the module, after checking names and shapes."""
    _check_module(module)
    check_params(module.variant, module.config, params)
    for role, layers in _linears(module).items():
        stacked = _stacked(module, role)
        for i, lin in enumerate(layers):
            w = np.asarray(params[f"W_{role}"])
            lin.weight.data = torch.as_tensor((w[i] if stacked else w).T.copy(),
                                              device=lin.weight.device)
            if lin.bias is not None:
                b = np.asarray(params[f"b_{role}"])
                lin.bias.data = torch.as_tensor((b[i] if stacked else b).copy(),
                                                device=lin.bias.device)


def build(variant, config, params):
    """A module of ``variant`` (its class name in snake_case) holding exactly ``params``."""
    if variant not in CLASS_NAMES:
        raise ValueError(f"variant should be one of {', '.join(CLASS_NAMES)}, got {variant!r}")
    module = getattr(modules, CLASS_NAMES[variant])(**config)
    load_params(module, params)
    return module

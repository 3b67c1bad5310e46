"""Build a module from neutral-layout parameters and export them back (see golden.variants).

``nnx.Linear`` kernels are already (in, out), the neutral layout; the wrapper's heads are stacked
on a leading axis. Loaded arrays keep their dtype (float64 needs ``jax.enable_x64``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from golden.variants import CLASS_NAMES, check_params
from jax_attn import modules


def _linears(module) -> dict:
    """{role: [nnx.Linear, ...]} per projection; a list of one, or one per wrapper head."""
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
        raise ValueError(f"module should be a jax_attn variant, got {type(module).__name__}")


def export_params(module) -> dict:
    """{neutral name: NumPy array}: W (in, out) and b (out,), or (N, in, out) and (N, out)."""
    _check_module(module)
    out = {}
    for role, layers in _linears(module).items():
        pick = np.stack if _stacked(module, role) else (lambda arrays: arrays[0])
        out[f"W_{role}"] = pick([np.asarray(lin.kernel.get_value()) for lin in layers])
        if layers[0].bias is not None:
            out[f"b_{role}"] = pick([np.asarray(lin.bias.get_value()) for lin in layers])
    return out


def load_params(module, params) -> None:
    """Copy neutral-layout parameters into the module, after checking names and shapes."""
    _check_module(module)
    check_params(module.variant, module.config, params)
    for role, layers in _linears(module).items():
        stacked = _stacked(module, role)
        for i, lin in enumerate(layers):
            w = np.asarray(params[f"W_{role}"])
            lin.kernel.set_value(jnp.asarray(w[i] if stacked else w))
            if lin.bias is not None:
                b = np.asarray(params[f"b_{role}"])
                lin.bias.set_value(jnp.asarray(b[i] if stacked else b))


def build(variant, config, params, *, rngs=None):
    """A module of ``variant`` (its class name in snake_case) holding exactly ``params``.

    ``rngs`` seeds the dropout stream (default ``nnx.Rngs(0)``).
    """
    if variant not in CLASS_NAMES:
        raise ValueError(f"variant should be one of {', '.join(CLASS_NAMES)}, got {variant!r}")
    rngs = nnx.Rngs(0) if rngs is None else rngs
    module = getattr(modules, CLASS_NAMES[variant])(**config, rngs=rngs)
    load_params(module, params)
    return module

"""Build a module from neutral-layout parameters and export them back (see
golden.specification.variants).

PyTorch's ``nn.Linear`` stores W as (out, in); the neutral layout is (in, out), so weights are
transposed at this edge and nowhere else. The wrapper's heads are stacked on a leading axis.
"""

from __future__ import annotations

import numpy as np
import torch

from golden.specification import recurrent as recurrent_spec
from golden.specification.positions import KVCache, LatentCache
from golden.specification.recurrent import RecurrentCache
from golden.specification.validate import check_any_cache, check_build_args, check_param_arrays
from golden.specification.variants import export_layers, load_layers, module_variant
from torch_attn import modules, recurrent


def _numpy(t):
    """A NumPy copy, never a view of the tensor's memory (a view would change as the module
    trains, and writing into it would change the module). NumPy has no bfloat16: low-precision
    tensors are exported as float32 (exactly)."""
    t = t.detach().cpu()
    return np.array((t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy())


def _ours(module) -> None:
    """ValueError unless ``module`` is a torch.nn.Module (a jax_attn module has other layers)."""
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"module should be a torch_attn variant (a torch.nn.Module), got "
                         f"{type(module).__module__}.{type(module).__name__}")


def export_params(module) -> dict:
    """{neutral name: NumPy array}: W (in, out) and b (out,), or (N, in, out) and (N, out);
    copies, a snapshot of the weights now."""
    _ours(module)
    return export_layers(module, lambda lin: _numpy(lin.weight).T,
                         lambda lin: None if lin.bias is None else _numpy(lin.bias), _numpy)


def export_grads(module) -> dict:
    """The parameters' ``.grad`` in the neutral layout (after a backward pass). A parameter
    without one is left out: the learned indexer's (golden.specification.indexer.INDEX_PARAMS),
    which no gradient reaches, as the reference gives them none."""
    _ours(module)

    def grad(t):
        return None if t is None or t.grad is None else _numpy(t.grad)
    grads = export_layers(module, lambda lin: None if lin.weight.grad is None
                          else grad(lin.weight).T, lambda lin: grad(lin.bias), grad)
    return {n: g for n, g in grads.items() if g is not None}


def load_params(module, params) -> None:
    """Copy neutral-layout parameters into the module, after checking names and shapes."""
    _ours(module)
    check_param_arrays(params)

    def set_weight(lin, w):  # (in, out) -> (out, in): torch's transpose, a copy (clone)
        w = torch.as_tensor(np.ascontiguousarray(w)).T
        lin.weight.data = w.clone(memory_format=torch.contiguous_format).to(lin.weight.device)

    def set_bias(lin, b):
        lin.bias.data = torch.as_tensor(b.copy(), device=lin.bias.device)

    def set_vector(held, a):
        held.data = torch.as_tensor(a.copy(), device=held.device)

    load_layers(module, params, set_weight, set_bias, set_vector)


def build(variant, config, params):
    """A module of ``variant`` (its class name in snake_case) holding exactly ``params``. It is
    made on PyTorch's meta device (no initial weights drawn: 10 ms a 2048² layer, and
    ``params`` replaces every one), then given memory and every parameter."""
    check_build_args(variant, config, params)
    if variant in recurrent_spec.MIXERS:  # the recurrent mixers (torch_attn.recurrent)
        room, described = recurrent, recurrent_spec.MIXERS[variant]
    else:
        room, described = modules, module_variant(variant)
    with torch.device("meta"):
        module = getattr(room, described.class_name)(**config)
    module = module.to_empty(device="cpu")
    load_params(module, params)
    return module


def _kind(fields):
    """The cache class with these field names (golden.specification.validate.check_any_cache)."""
    return LatentCache if "latent" in fields else KVCache


def export_cache(cache) -> KVCache | LatentCache | RecurrentCache:
    """A KV cache, MultiHeadLatentAttention's LatentCache or a recurrent mixer's RecurrentCache,
    as NumPy copies of the same class (detached; bfloat16 and float16 as float32, exactly), for
    the other framework's ``load_cache``."""
    if isinstance(cache, RecurrentCache):
        return RecurrentCache(*(_numpy(t) for t in cache))
    fields = check_any_cache(cache)
    out = _kind(fields)(*(_numpy(getattr(cache, f)) for f in fields))
    return _with_index_key(out, cache, _numpy)


def load_cache(cache, device=None, dtype=None) -> KVCache | LatentCache | RecurrentCache:
    """A KVCache or LatentCache of NumPy (or any array) fields as tensors (copies) of the same
    class: key and value, or latent and rope_key (and index_key), in ``dtype`` (default
    theirs), lengths int32, on ``device``. A RecurrentCache: conv in ``dtype``, the state in
    float64 for float64 and float32 otherwise (a recurrence's state is never kept narrower), as
    jax_attn's."""
    if isinstance(cache, RecurrentCache):
        wide = None if dtype is None else (torch.float64 if dtype == torch.float64
                                           else torch.float32)
        return RecurrentCache(
            torch.tensor(np.asarray(cache.conv), device=device, dtype=dtype),
            torch.tensor(np.asarray(cache.state), device=device, dtype=wide),
            torch.tensor(np.asarray(cache.lengths), dtype=torch.int32, device=device))
    fields = check_any_cache(cache)

    def tensor(a):
        return torch.tensor(np.asarray(a), device=device, dtype=dtype)
    arrays = (tensor(getattr(cache, f)) for f in fields[:-1])
    out = _kind(fields)(*arrays, torch.tensor(np.asarray(cache.lengths), dtype=torch.int32,
                                              device=device))
    return _with_index_key(out, cache, tensor)


def _with_index_key(out, cache, convert):
    """``out`` with the LatentCache's index_key (the learned indexer's keys) converted when
    ``cache`` holds one."""
    held = getattr(cache, "index_key", None)
    return out if held is None else out._replace(index_key=convert(held))

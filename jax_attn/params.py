"""Build a module from neutral-layout parameters and export them back (see
golden.specification.variants).

``nnx.Linear`` kernels are already (in, out), the neutral layout; the wrapper's heads are stacked
on a leading axis. Loaded arrays keep their dtype (float64 needs ``jax.enable_x64``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from golden.specification import recurrent as recurrent_spec
from golden.specification.positions import KVCache, LatentCache
from golden.specification.recurrent import RecurrentCache
from golden.specification.validate import check_any_cache, check_build_args, check_param_arrays
from golden.specification.variants import export_layers, load_layers, module_variant
from jax_attn import modules, recurrent


def _ours(module) -> None:
    """ValueError unless ``module`` is a flax.nnx.Module (a torch_attn module has other layers)."""
    if not isinstance(module, nnx.Module):
        raise ValueError(f"module should be a jax_attn variant (a flax.nnx.Module), got "
                         f"{type(module).__module__}.{type(module).__name__}")


def export_params(module) -> dict:
    """{neutral name: NumPy array}: W (in, out) and b (out,), or (N, in, out) and (N, out);
    copies (``np.asarray`` of a CPU array is a read-only view of its buffer, which a donating
    training step may free or reuse)."""
    _ours(module)
    return export_layers(module, lambda lin: np.array(lin.kernel.get_value()),
                         lambda lin: None if lin.bias is None else np.array(lin.bias.get_value()),
                         lambda p: np.array(p.get_value()))


def _device(array, dtype=None):
    """A JAX array holding a copy of ``array``: ``jax.device_put`` of a NumPy array on CPU
    aliases its memory, so a caller writing into their array would change the module. A JAX
    array is copied where it lies (its device and sharding kept)."""
    if isinstance(array, jax.Array):
        return jnp.array(array, dtype=dtype, copy=True)
    return jax.device_put(np.array(array, dtype=dtype))


def load_params(module, params) -> None:
    """Copy neutral-layout parameters into the module, after checking names and shapes."""
    _ours(module)
    check_param_arrays(params)
    load_layers(module, params, lambda lin, w: lin.kernel.set_value(_device(w)),
                lambda lin, b: lin.bias.set_value(_device(b)),
                lambda p, a: p.set_value(_device(a)))


def build(variant, config, params, *, rngs=None):
    """A module of ``variant`` (its class name in snake_case) holding exactly ``params``.

    ``rngs`` seeds the dropout stream (default ``nnx.Rngs(0)``).
    """
    check_build_args(variant, config, params)
    if variant in recurrent_spec.MIXERS:  # the recurrent mixers (jax_attn.recurrent)
        cls = getattr(recurrent, recurrent_spec.get(variant).class_name)
    else:
        cls = getattr(modules, module_variant(variant).class_name)
    # The structure only: nnx.eval_shape runs the constructor abstractly, so no weights are drawn
    # (each new shape of a random initialiser costs a compilation) just to be overwritten.
    module = nnx.eval_shape(lambda: cls(**config, rngs=nnx.Rngs(0)))
    load_params(module, params)
    if hasattr(module, "seed_dropout"):  # the recurrent mixers have no dropout
        module.seed_dropout(nnx.Rngs(0) if rngs is None else rngs)
    abstract = [p for p, v in nnx.to_flat_state(nnx.state(module))
                if isinstance(v.get_value(), jax.ShapeDtypeStruct)]
    if abstract:
        raise RuntimeError(f"build left {variant} without values for {abstract}")
    return module


_LOW = (jnp.bfloat16, jnp.float16)


def _kind(fields):
    """The cache class with these field names (golden.specification.validate.check_any_cache)."""
    return LatentCache if "latent" in fields else KVCache


def export_cache(cache) -> KVCache | LatentCache | RecurrentCache:
    """A KV cache, MultiHeadLatentAttention's LatentCache (with a learned indexer's index_key
    when it holds one) or a recurrent mixer's RecurrentCache, as NumPy copies of the same class
    (bfloat16 and float16 as float32, exactly, as in torch's ``export_cache``), for the other
    framework's ``load_cache``."""
    if isinstance(cache, RecurrentCache):
        kind, fields = RecurrentCache, RecurrentCache._fields
    else:
        fields = check_any_cache(cache)
        kind = _kind(fields)
    return kind(**{f: np.array(a, dtype=np.float32 if a.dtype in _LOW else a.dtype)
                   for f, a in _arrays(cache, fields).items()})


def _arrays(cache, fields) -> dict:
    """{field: array} of ``fields``, and a LatentCache's index_key (the learned indexer's keys)
    when it holds one."""
    held = getattr(cache, "index_key", None)
    return {f: getattr(cache, f) for f in fields} | ({} if held is None else {"index_key": held})


def load_cache(cache, dtype=None) -> KVCache | LatentCache | RecurrentCache:
    """A KVCache or LatentCache of NumPy (or any array) fields on the default device, of the
    same class: key and value, or latent and rope_key (and index_key), in ``dtype`` (default
    theirs; float64 needs ``jax.enable_x64``), lengths int32. A RecurrentCache: conv in
    ``dtype``, the state in float64 for float64 and float32 otherwise (a recurrence's state is
    never kept narrower), lengths int32."""
    if isinstance(cache, RecurrentCache):
        wide = None if dtype is None else (np.float64 if jnp.dtype(dtype) == jnp.float64
                                           else np.float32)
        return RecurrentCache(_device(cache.conv, dtype), _device(cache.state, wide),
                              _device(cache.lengths, np.int32))
    fields = check_any_cache(cache)
    arrays = {f: _device(a, np.int32 if f == "lengths" else dtype)
              for f, a in _arrays(cache, fields).items()}
    return _kind(fields)(**arrays)

"""Batch and heads over a ``jax.sharding.Mesh``: the PartitionSpecs, and a module's parameters
placed Megatron-style.

Shape legend: B batch, H query heads (N in the modules), Hkv key-value heads, L length (Lq
queries, Lk keys), D head width, d_* feature widths, n the size of the mesh's model axis.

Neither the core nor the modules have distributed code: they run unchanged, eagerly or under
jit, on arrays sharded with ``NamedSharding`` over a classic ``Mesh`` (auto axes) or one from
``jax.make_mesh`` (explicit axes), and XLA's SPMD partitioner splits them. This module says how
to shard so that no device needs another's activations inside attention (the compiled forward
has no collective there; tests/devices8/test_mesh.py reads the programs):

- the core: query, key, value (B, H, L, D) ``HEADS = P(data, model)``, and so its output and
  weights; a mask, bias or keep-mask (B, H, Lq, Lk) likewise, ``BATCH = P(data)`` when its head
  axis is 1; offsets and lengths (B,) ``BATCH``. Key and value with Hkv heads: ``HEADS`` when n
  divides Hkv, else ``BATCH`` (replicated over model, Hkv dividing n: each device's query heads
  then read one key-value head; the backward sums dK and dV over the devices sharing it).
- the modules: inputs, masks and outputs (B, L, d) ``BATCH``; parameters as ``layer_specs``
  says and ``shard_module`` places them. The forward's one collective is the all-reduce after
  the row-parallel output projection.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from golden.variants import projections

__all__ = ["BATCH", "DATA", "HEADS", "MODEL", "layer_specs", "shard_module"]

DATA, MODEL = "data", "model"  # the mesh axis names assumed by default
HEADS = P(DATA, MODEL)  # (B, H, ...): query, key, value, masks and biases with H heads, output
BATCH = P(DATA)  # (B, ...): offsets, lengths, masks without heads, the modules' inputs, outputs


def layer_specs(module, mesh, *, model=MODEL) -> dict:
    """{(layer path, "kernel" | "bias"): PartitionSpec} for a jax_attn module on ``mesh``.

    Megatron's tensor parallelism for the modules that fuse their heads into one projection
    per role (MultiHeadAttention, GroupedQueryAttention): W_query, W_key and W_value hold their
    heads as contiguous blocks of the output features, so splitting that axis over ``model``
    gives each device whole heads (column-parallel: kernel ``P(None, model)``, bias
    ``P(model)``, no communication); out_proj reads the heads' features on its input axis, so
    it is split there (row-parallel: kernel ``P(model, None)``; each device multiplies its
    heads' part and one all-reduce sums them; the bias is replicated, added once). W_key and
    W_value of Hkv heads are split when n divides Hkv, else replicated (each device computes
    every key-value head, n a multiple of Hkv). The other modules (one head, or the wrapper's
    independent heads) have no head axis to split and are replicated, as is everything with
    ``model=None`` (data parallelism alone)."""
    _check_module(module)
    n = _axis_size(mesh, model)
    fused = n > 1 and hasattr(module, "num_heads") and not projections(module)["query"][1]
    heads = {"query": getattr(module, "num_heads", 1), "out": getattr(module, "num_heads", 1)}
    heads["key"] = heads["value"] = getattr(module, "num_kv_heads", heads["query"])
    if fused and heads["query"] % n:
        raise ValueError(f"num_heads should be a multiple of the size of mesh axis {model!r}, "
                         f"{n}, to split {type(module).__name__} by head, got {heads['query']}")
    if fused and heads["key"] % n and n % heads["key"]:
        raise ValueError(f"num_kv_heads should divide or be a multiple of the size of mesh axis "
                         f"{model!r}, {n}, got {heads['key']}")
    specs = {}
    for role, (layers, _) in projections(module).items():
        split = fused and heads[role] % n == 0
        row = role == "out"
        for path, layer in _linears(module, layers):
            specs[path, "kernel"] = (P(model, None) if row else P(None, model)) if split else P()
            if layer.bias is not None:
                specs[path, "bias"] = P(model) if split and not row else P()
    return specs


def shard_module(module, mesh, *, model=MODEL):
    """Place ``module``'s parameters on ``mesh`` as ``layer_specs`` says, in place, and return
    it; its other state (the dropout stream) is replicated. Flax's own machinery: each Param
    gets the ``out_sharding`` metadata that ``nnx.with_partitioning`` would have given it, and
    the state goes through ``jax.device_put`` with ``nnx.get_named_sharding``, so
    ``nnx.get_partition_spec(nnx.state(module))`` reads the layout back."""
    specs = layer_specs(module, mesh, model=model)
    layers = dict(_linears(module, None))
    for (path, name), spec in specs.items():
        getattr(layers[path], name).set_metadata(out_sharding=tuple(spec))
    state = nnx.state(module)
    nnx.update(module, jax.device_put(state, nnx.get_named_sharding(state, mesh)))
    return module


def _check_module(module) -> None:
    if not isinstance(module, nnx.Module) or not hasattr(module, "variant"):
        raise ValueError(f"module should be a jax_attn variant (a flax.nnx.Module), got "
                         f"{type(module).__module__}.{type(module).__name__}")


def _axis_size(mesh, model) -> int:
    """n, the size of mesh axis ``model`` (1 for None), after checking both."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise ValueError(f"mesh should be a jax.sharding.Mesh (jax.make_mesh), got "
                         f"{type(mesh).__name__}")
    if model is not None and model not in mesh.axis_names:
        raise ValueError(f"model should be one of the mesh's axes {mesh.axis_names} or None, "
                         f"got {model!r}")
    return 1 if model is None else mesh.shape[model]


def _linears(module, layers):
    """(dotted path, layer) of the module's nnx.Linear layers (those in ``layers`` when given),
    in Flax's own traversal: "W_query", "heads.0.W_query", ..."""
    return [(".".join(map(str, path)), node) for path, node in nnx.iter_graph(module)
            if isinstance(node, nnx.Linear) and (layers is None or any(node is x for x in layers))]

"""Batch and heads over a ``jax.sharding.Mesh``: the PartitionSpecs, a module's parameters
placed Megatron-style, and the mesh plumbing the core runs through (head layout checks,
explicit axes made auto around it).

Shape legend: B batch, H query heads (N in the modules), Hkv key-value heads, L length (Lq
queries, Lk keys), D head width, d_* feature widths, n the size of the mesh's model axis.

Neither the core nor the modules have distributed code: they run unchanged, eagerly or under
jit, on arrays sharded with ``NamedSharding`` over a classic ``Mesh`` (auto axes) or one from
``jax.make_mesh`` (explicit axes), and XLA's SPMD partitioner splits them. This module says how
to shard so that no device needs another's activations inside attention (the compiled forward
has no collective there; tests/devices8/test_mesh.py reads the programs):

- the core: query, key, value (B, H, L, D) ``HEADS = P(data, model)``, and so its output and
  weights; a mask, bias or dropout mask (B, H, Lq, Lk) likewise, ``BATCH = P(data)`` when its head
  axis is 1; offsets and lengths (B,) ``BATCH``. Key and value with Hkv heads: ``HEADS`` when n
  divides Hkv, else ``BATCH`` (replicated over model, Hkv dividing n: each device's query heads
  then read one key-value head; the backward sums dK and dV over the devices sharing it).
- the modules: inputs, masks and outputs (B, L, d) ``BATCH``; parameters as ``layer_specs``
  says and ``shard_module`` places them. The forward's one collective is the all-reduce after
  the row-parallel output projection.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from golden.specification.variants import projections

# ---- the core on a mesh (jax_attn.functional calls these) -----------------------------------
# The core has no distributed code of its own: XLA's SPMD partitioner splits its vmap over batch
# and heads, each device computing the (batch, head) pairs it holds, with no collective in the
# forward (tests/devices8/test_mesh.py reads the compiled programs). Four things keep it so:
# sharded arrays never take the CPU chunks (lax.map over the flattened pairs would gather them),
# a head layout that would need the query gathered is refused (check_head_sharding), replicated
# key-value heads are split as the query's under explicit axes (heads_as_query), and explicit
# mesh axes are made auto around the core (on_mesh). The specs: below.

def on_one_device(*arrays) -> bool:
    """Whether the arrays are known to lie on one device, so that CPU may take the chunks:
    always in a process with one device; else only concrete arrays each on a single device (a
    tracer under the caller's jit may be sharded over a mesh with auto axes, which tracing does
    not see)."""
    if jax.device_count() == 1:
        return True
    return all(not isinstance(x, jax.core.Tracer) and
               (not isinstance(x, jax.Array) or len(x.sharding.device_set) == 1) for x in arrays)


def known_sharding(x):
    """(PartitionSpec entries, one per axis of x; the mesh) where the sharding is known: a
    concrete array's own, a traced one's explicit mesh axes; entries None where not known."""
    concrete = isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    sharding = x.sharding if concrete else jax.typeof(x).sharding
    spec = tuple(getattr(sharding, "spec", ()))
    return spec + (None,) * (x.ndim - len(spec)), getattr(sharding, "mesh", None)


def mesh_axes(entry) -> tuple:
    """The mesh axis names of one PartitionSpec entry (None, a name or a tuple of names)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def check_head_sharding(query, key) -> None:
    """ValueError unless each device's query heads read whole key-value heads that it holds:
    key and value heads split over the query's head axes, or not split and Hkv dividing, or a
    multiple of, the number of head shards n (then each device's H / n query heads share one
    key-value head, or hold whole groups). Other layouts would gather the query; a sharding
    hidden from tracing (auto axes under the caller's jit) is not checked."""
    if query.ndim < 3 or key.ndim < 3:
        return
    (q_spec, mesh), (k_spec, _) = known_sharding(query), known_sharding(key)
    names = mesh_axes(q_spec[-3])
    shards = math.prod(mesh.shape[n] for n in names) if names else 1
    hkv = key.shape[-3]
    if shards == 1 or mesh_axes(k_spec[-3]) == names or (
            not mesh_axes(k_spec[-3]) and (hkv % shards == 0 or shards % hkv == 0)):
        return
    raise ValueError(
        f"key and value heads should be sharded as the query's (over {names}), or replicated "
        f"with Hkv dividing or a multiple of the query's {shards} head shards, got Hkv = {hkv} "
        f"sharded over {mesh_axes(k_spec[-3])} for H = {query.shape[-3]}")


def explicit_spec(x):
    """x's PartitionSpec entries (one per axis) when x lies on a mesh with explicit axes
    (jax.make_mesh's default), where JAX types every array's sharding at trace time; else
    None (one device, or auto axes: XLA's partitioner decides)."""
    sharding = jax.typeof(x).sharding
    if jax.sharding.AxisType.Explicit not in getattr(sharding.mesh, "axis_types", ()):
        return None
    return known_sharding(x)[0]


def heads_as_query(query, x, spec):
    """Key or value x (..., Hkv, Lk, D) with its heads split as the query's over explicit mesh
    axes (``spec``: explicit_spec(query)) of n shards: as is when they are, or for one head
    (multi-query: the query's heads
    split whole); else repeated to a multiple of n heads (n / Hkv copies of each when Hkv < n;
    query head h still reads key-value head h // G) and resharded, each device keeping the
    ones its query heads read (a slice, no communication). Left replicated, the split of the
    query's heads into (Hkv, G) would straddle devices, and the partitioner, given typed
    shardings at auto_axes' edge, gathers the weights in the backward (measured, 8 heads, 2
    key-value heads, 4 shards); repeated, the backward gathers dK and dV alone."""
    if spec is None or query.ndim < 3 or x.ndim < 3:
        return x
    names, (x_spec, _) = mesh_axes(spec[-3]), known_sharding(x)
    n = math.prod(jax.typeof(query).sharding.mesh.shape[a] for a in names)
    if n == 1 or x.shape[-3] == 1 or mesh_axes(x_spec[-3]) == names:
        return x
    x = jnp.repeat(x, n // math.gcd(n, x.shape[-3]), axis=-3)  # (..., lcm(Hkv, n), Lk, D)
    target = jax.sharding.PartitionSpec(*x_spec[:-3], spec[-3], *x_spec[-2:])
    return jax.sharding.reshard(x, jax.typeof(query).sharding.update(spec=target))


def on_mesh(attention, query, spec, return_weights):
    """``attention`` as is, or for a query on a mesh with explicit axes (``spec``:
    explicit_spec(query); jax.make_mesh's default) with those axes auto inside
    (jax.sharding.auto_axes) and the output and weights
    typed back to the query's sharding (all its axes but the last). Explicit axes give every
    intermediate array a sharding at trace time, and two steps of the core have none that
    JAX's rules accept: query heads split into (Hkv, G) when key and value are replicated (a
    device's heads are part of one group: reshape raises ShardingTypeError), and the blockwise
    loops whose bounds depend on each row's offset and lengths (vmapped while loops raise
    "Resource axis ... not found in mesh: ()" in JAX 0.10). XLA's partitioner, which auto
    axes hand them to, splits both as under a classic Mesh."""
    if spec is None:
        return attention
    out = jax.sharding.PartitionSpec(*spec[:-1], None)  # (..., H, Lq, Dv) and (..., H, Lq, Lk)
    auto = jax.sharding.auto_axes(attention, out_sharding=(out, out if return_weights else None))

    def run(*args, **kwargs):  # auto_axes reads the context's mesh, unset unless jax.set_mesh
        with jax.sharding.use_abstract_mesh(jax.typeof(query).sharding.mesh):
            return auto(*args, **kwargs)
    return run

__all__ = ["BATCH", "DATA", "HEADS", "MODEL", "layer_specs", "shard_module"]

DATA, MODEL = "data", "model"  # the mesh axis names assumed by default
HEADS = P(DATA, MODEL)  # (B, H, ...): query, key, value, masks and biases with H heads, output
BATCH = P(DATA)  # (B, ...): offsets, lengths, masks without heads, the modules' inputs, outputs


# Each projection role's Megatron split (golden.specification.variants' role names): "column"
# when its output features hold whole heads (of the module's attribute named), "row" when its
# input features do, None when it is replicated: latent attention's down projections to the
# latent (q_a, kv_a with its rope part), which every head reads whole.
ROLES = {"query": ("column", "num_heads"), "key": ("column", "num_kv_heads"),
         "value": ("column", "num_kv_heads"), "gate": ("column", "num_heads"),
         "q_b": ("column", "num_heads"), "kv_b": ("column", "num_heads"),
         "out": ("row", "num_heads"), "q_a": (None, None), "kv_a": (None, None)}


def layer_specs(module, mesh, *, model=MODEL) -> dict:
    """{(layer path, "kernel" | "bias"): PartitionSpec} for a jax_attn module on ``mesh``.

    Megatron's tensor parallelism for the modules that fuse their heads into one projection per
    role (MultiHeadAttention, GroupedQueryAttention, MultiHeadLatentAttention): W_query, W_key
    and W_value hold their heads as contiguous blocks of the output features, so splitting that
    axis over ``model`` gives each device whole heads (column-parallel: kernel ``P(None,
    model)``, bias ``P(model)``, no communication; the output gate W_gate alike); out_proj reads
    the heads' features on its input axis, so it is split there (row-parallel: kernel ``P(model,
    None)``; each device multiplies its heads' part and one all-reduce sums them; the bias is
    replicated, added once). W_key and W_value of Hkv heads are split when n divides Hkv, else
    replicated (each device computes every key-value head, n a multiple of Hkv). Latent
    attention: W_q_b and W_kv_b (each head's [k_nope | v] from the latent) column-parallel,
    out_proj row-parallel; W_q_a and W_kv_a, down to the latents every head reads, replicated,
    as are the latents' norms (q_a_norm, kv_a_norm: plain parameters). The other modules (one
    head, or the wrapper's independent heads) have no head axis to split and are replicated, as
    is everything with ``model=None`` (data parallelism alone)."""
    _check_module(module)
    n = _axis_size(mesh, model)
    roles = projections(module)
    fused = n > 1 and hasattr(module, "num_heads") and not any(s for _, s in roles.values())
    unknown = sorted(set(roles) - set(ROLES)) if fused else []
    if unknown:
        raise ValueError(f"module's projections should be of the roles split by head "
                         f"({', '.join(ROLES)}) to split {type(module).__name__}, got "
                         f"{', '.join(unknown)}")
    # the heads each split role holds (num_kv_heads absent: as many as the query's)
    heads = {r: getattr(module, ROLES[r][1], module.num_heads) for r in roles
             if ROLES[r][0]} if fused else {}
    if fused and module.num_heads % n:
        raise ValueError(f"num_heads should be a multiple of the size of mesh axis {model!r}, "
                         f"{n}, to split {type(module).__name__} by head, got {module.num_heads}")
    kv = heads.get("key")
    if fused and kv is not None and kv % n and n % kv:
        raise ValueError(f"num_kv_heads should divide or be a multiple of the size of mesh axis "
                         f"{model!r}, {n}, got {kv}")
    specs = {}
    for role, (layers, _) in roles.items():
        kind = ROLES[role][0] if role in heads and heads[role] % n == 0 else None
        for path, layer in _linears(module, layers):
            specs[path, "kernel"] = {"column": P(None, model), "row": P(model, None),
                                     None: P()}[kind]
            if layer.bias is not None:
                specs[path, "bias"] = P(model) if kind == "column" else P()
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

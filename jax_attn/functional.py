"""The JAX attention core: written for one head, vmapped over heads and batch, jitted.

Shape legend: B batch, H query heads, Hkv key-value heads, G = H / Hkv query heads per key-value
head, Lq query length, Lk key length, Dk key width, Dv value width.
Inputs are (B, H, L, D), (H, L, D) or (L, D); key and value may have Hkv heads where the query
has H (grouped-query attention: query head h reads key-value head h // G). Masks and biases
broadcast to (..., H, Lq, Lk). Every dot takes ``precision`` (default HIGHEST: full float32 on
GPU and TPU too).
"""

from __future__ import annotations

import math
from functools import partial, reduce

import jax
import jax.numpy as jnp

from golden.positions import ROPE_BLOCK, rope_tables
from golden.validate import (
    check_attention_args,
    check_flags,
    check_implementation,
    check_rotary,
    window,
)
from jax_attn import blockwise

DEFAULT_PRECISION = jax.lax.Precision.HIGHEST
NO_WINDOW = (None, None)


def scaled_dot_product_attention(
    query, key, value, mask=None, bias=None, *,
    is_causal=False, scale=None, softcap=None, local_window_size=None, query_offset=None,
    query_seq_lengths=None, key_value_seq_lengths=None, dropout_rate=0.0, dropout_mask=None,
    dropout_rng=None, implementation=None, return_weights=False, block_sizes=None,
    precision=DEFAULT_PRECISION,
):
    """softmax(c · tanh(scale · Q Kᵀ / c) + bias, over allowed keys) V (without ``softcap`` c:
    scale · Q Kᵀ + bias).

    key and value may have Hkv heads, H a multiple of Hkv (query head h reads kv head h // G).
    Key j sits at position j, query row i at i + ``query_offset`` (an int, or an integer array
    (B,) for rank-4 inputs, () otherwise). Row i may attend key j when ``mask`` (bool, True = may
    attend) allows it, j ≤ its position (``is_causal``), position − left ≤ j ≤ position + right
    (``local_window_size`` w or (left, right), a side None = unbounded), j < the batch's
    ``key_value_seq_lengths`` and i < its ``query_seq_lengths``. A query row with no allowed key
    gives zeros in the output and the weights. ``is_causal``, ``softcap`` and the window are
    static (one compilation each); offsets and lengths are traced (a growing offset does not
    recompile).
    dropout_mask: bool keep-mask (weights kept are scaled by 1/(1 − dropout_rate)); without it,
    one is drawn from ``dropout_rng`` (a ``jax.random`` key), which is then required.
    Returns the output (..., H, Lq, Dv), and with ``return_weights`` also the applied weights
    (..., H, Lq, Lk), after masking and dropout, in the query's dtype.

    implementation: "dense" forms each head's (Lq, Lk) weights; "blockwise" never does
    (jax_attn.blockwise: FlashAttention-2's online softmax and a backward of its own that
    recomputes each block from the saved log-sum-exp, memory O(L); key blocks wholly outside the
    causal bound, the window or the lengths are skipped by index), so it cannot return the
    weights. None chooses: "blockwise" when the weights are not asked for and Lq·Lk exceeds
    BLOCKWISE_MIN_SCORES = 2²⁰ (L > 1024 for Lq = Lk), else "dense"; on this CPU (the figures
    are beside BLOCKWISE_MIN_SCORES) blockwise and dense forwards tie at L = 1024 (B = 4, H = 8,
    D = 64), blockwise is 1.3-1.8× faster at L = 1280-2048, and its forward + backward is
    already 7× faster at L = 1024.
    block_sizes: (Bq, Bk), the blockwise path's largest query and key blocks, static ints
    (default DEFAULT_BLOCK_SIZES = (1024, 1024), measured); each length is split into the
    fewest blocks of at most that size, evenly, the last one masked where ragged.
    Dropout drawn from ``dropout_rng`` differs between the paths for the same key: dense draws
    one (..., H, Lq, Lk) mask, blockwise draws each block's mask from
    fold_in(fold_in(fold_in(key, b·H + h), query block), key block) so that its backward
    regenerates it; both keep each weight with probability 1 − dropout_rate. A ``dropout_mask``
    gives both paths the same result.
    Arrays sharded over a jax.sharding.Mesh (batch over one axis, heads over another) run
    unchanged, each device computing its own heads, and the output keeps the query's sharding;
    jax_attn.sharding gives the specs.
    """
    check_attention_args(query, key, value, mask, bias, scale=scale, softcap=softcap,
                         local_window_size=local_window_size, query_offset=query_offset,
                         query_seq_lengths=query_seq_lengths,
                         key_value_seq_lengths=key_value_seq_lengths,
                         dropout_rate=dropout_rate, dropout_mask=dropout_mask)
    check_flags(is_causal=is_causal, return_weights=return_weights)
    check_implementation(implementation, return_weights)
    block_sizes = check_block_sizes(block_sizes)
    if dropout_rate > 0.0 and dropout_mask is None and dropout_rng is None:
        raise ValueError("dropout_rng should be a jax.random key when dropout_rate > 0 and no "
                         "dropout_mask is given, got None")
    if dropout_rng is not None and not _is_key(dropout_rng):
        raise TypeError(f"dropout_rng should be a jax.random key (jax.random.key(seed)) or None, "
                        f"got {type(dropout_rng).__name__}")
    if dropout_rate == 0.0:
        dropout_rng = None
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    batch = query.shape[:1] if query.ndim == 4 else ()  # the offsets' and lengths' shape
    positions = (per_batch(x, batch) for x in
                 (query_offset, query_seq_lengths, key_value_seq_lengths))
    check_head_sharding(query, key)
    spec = explicit_spec(query)  # None unless on a mesh with explicit axes
    key, value = (_heads_as_query(query, x, spec) for x in (key, value))
    one_device = _on_one_device(query, key, value)
    attention = _on_mesh(_attention, query, spec, return_weights)
    out, weights = attention(query, key, value, mask, bias, dropout_mask, dropout_rng,
                             *positions, scale=scale, is_causal=bool(is_causal),
                             softcap=None if softcap is None else float(softcap),
                             window=window(local_window_size),
                             dropout_rate=float(dropout_rate), precision=precision,
                             return_weights=bool(return_weights),
                             chunk=heads_per_step(query.shape, key.shape) if one_device else None,
                             implementation=implementation or choose_implementation(
                                 query.shape, key.shape, return_weights),
                             block_sizes=block_sizes)
    return (out, weights) if return_weights else out


def _is_key(rng) -> bool:
    """A typed key (jax.random.key) or a raw uint32 one (jax.random.PRNGKey), traced or not."""
    dtype = getattr(rng, "dtype", None)
    if dtype is None:
        return False
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) or (
        dtype == jnp.uint32 and len(rng.shape) >= 1)


def per_batch(x, batch):
    """An offset or lengths (Python int or integer array) as an int32 array of shape ``batch``:
    traced by the jitted core, so a new value does not recompile."""
    return None if x is None else jnp.broadcast_to(jnp.asarray(x, dtype=jnp.int32), batch)


# Heads per step on CPU: the one-head core is vmapped over chunks of this many (batch, head)
# pairs and the chunks run in sequence (``lax.map(..., batch_size=...)``), so one chunk's scores
# stay in cache. Below about 8 MiB of float32 scores one vmap over every head is as fast and
# compiles in half the time, so chunks start at CPU_CHUNK_MIN_SCORES score elements; the
# measurements behind both numbers: docs/performance.md, "Why the thresholds are where they
# are". Accelerators take the plain vmap over heads and batch.
CPU_HEADS_PER_STEP = 2
CPU_CHUNK_MIN_SCORES = 2**21


def heads_per_step(q_shape, k_shape):
    """The chunk size for these shapes on the default backend (None: one vmap over all)."""
    scores = math.prod(q_shape[:-1]) * k_shape[-2]  # (..., Lq, Lk) elements
    large = scores >= CPU_CHUNK_MIN_SCORES and math.prod(q_shape[:-2]) > CPU_HEADS_PER_STEP
    return CPU_HEADS_PER_STEP if jax.default_backend() == "cpu" and large else None


# ---- many devices: arrays sharded over a jax.sharding.Mesh ---------------------------------------
# The core has no distributed code of its own: XLA's SPMD partitioner splits its vmap over batch
# and heads, each device computing the (batch, head) pairs it holds, with no collective in the
# forward (tests/devices8/test_mesh.py reads the compiled programs). Four things keep it so:
# sharded arrays never take the CPU chunks (lax.map over the flattened pairs would gather them),
# a head layout that would need the query gathered is refused (check_head_sharding), replicated
# key-value heads are split as the query's under explicit axes (_heads_as_query), and explicit
# mesh axes are made auto around the core (_on_mesh). The specs: jax_attn.sharding.

def _on_one_device(*arrays) -> bool:
    """Whether the arrays are known to lie on one device, so that CPU may take the chunks:
    always in a process with one device; else only concrete arrays each on a single device (a
    tracer under the caller's jit may be sharded over a mesh with auto axes, which tracing does
    not see)."""
    if jax.device_count() == 1:
        return True
    return all(not isinstance(x, jax.core.Tracer) and
               (not isinstance(x, jax.Array) or len(x.sharding.device_set) == 1) for x in arrays)


def _known_sharding(x):
    """(PartitionSpec entries, one per axis of x; the mesh) where the sharding is known: a
    concrete array's own, a traced one's explicit mesh axes; entries None where not known."""
    concrete = isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    sharding = x.sharding if concrete else jax.typeof(x).sharding
    spec = tuple(getattr(sharding, "spec", ()))
    return spec + (None,) * (x.ndim - len(spec)), getattr(sharding, "mesh", None)


def _axes(entry) -> tuple:
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
    (q_spec, mesh), (k_spec, _) = _known_sharding(query), _known_sharding(key)
    names = _axes(q_spec[-3])
    shards = math.prod(mesh.shape[n] for n in names) if names else 1
    hkv = key.shape[-3]
    if shards == 1 or _axes(k_spec[-3]) == names or (
            not _axes(k_spec[-3]) and (hkv % shards == 0 or shards % hkv == 0)):
        return
    raise ValueError(
        f"key and value heads should be sharded as the query's (over {names}), or replicated "
        f"with Hkv dividing or a multiple of the query's {shards} head shards, got Hkv = {hkv} "
        f"sharded over {_axes(k_spec[-3])} for H = {query.shape[-3]}")


def explicit_spec(x):
    """x's PartitionSpec entries (one per axis) when x lies on a mesh with explicit axes
    (jax.make_mesh's default), where JAX types every array's sharding at trace time; else
    None (one device, or auto axes: XLA's partitioner decides)."""
    sharding = jax.typeof(x).sharding
    if jax.sharding.AxisType.Explicit not in getattr(sharding.mesh, "axis_types", ()):
        return None
    return _known_sharding(x)[0]


def _heads_as_query(query, x, spec):
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
    names, (x_spec, _) = _axes(spec[-3]), _known_sharding(x)
    n = math.prod(jax.typeof(query).sharding.mesh.shape[a] for a in names)
    if n == 1 or x.shape[-3] == 1 or _axes(x_spec[-3]) == names:
        return x
    x = jnp.repeat(x, n // math.gcd(n, x.shape[-3]), axis=-3)  # (..., lcm(Hkv, n), Lk, D)
    target = jax.sharding.PartitionSpec(*x_spec[:-3], spec[-3], *x_spec[-2:])
    return jax.sharding.reshard(x, jax.typeof(query).sharding.update(spec=target))


def _on_mesh(attention, query, spec, return_weights):
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


# The blockwise path's blocks, and the automatic choice between the paths: blockwise when
# Lq·Lk is above BLOCKWISE_MIN_SCORES. Both were measured on the CPU (forward and forward +
# backward, several block shapes and lengths): docs/performance.md, "Why the thresholds are
# where they are". For training at L = 1024, pass implementation="blockwise".
DEFAULT_BLOCK_SIZES = (1024, 1024)
BLOCKWISE_MIN_SCORES = 2**20  # blockwise when Lq·Lk is above it


def check_block_sizes(block_sizes):
    """(Bq, Bk) as a pair of positive ints; None gives DEFAULT_BLOCK_SIZES."""
    if block_sizes is None:
        return DEFAULT_BLOCK_SIZES
    ok = isinstance(block_sizes, (tuple, list)) and len(block_sizes) == 2 and all(
        isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block_sizes)
    if not ok:
        raise ValueError("block_sizes should be None or a pair (block_q, block_k) of positive "
                         f"ints, got {block_sizes!r}")
    return tuple(block_sizes)


def choose_implementation(q_shape, k_shape, return_weights=False):
    """implementation=None: "blockwise" when the weights are not asked for and one head's
    scores Lq·Lk exceed BLOCKWISE_MIN_SCORES, else "dense"."""
    large = q_shape[-2] * k_shape[-2] > BLOCKWISE_MIN_SCORES
    return "blockwise" if large and not return_weights else "dense"


@partial(jax.jit, static_argnames=("scale", "is_causal", "softcap", "window", "dropout_rate",
                                   "precision", "return_weights", "chunk", "implementation",
                                   "block_sizes"))
def _attention(query, key, value, mask, bias, keep, rng, offset=None, q_lengths=None,
               kv_lengths=None, *, scale, is_causal, dropout_rate, precision, return_weights,
               softcap=None, window=NO_WINDOW, chunk=None, implementation="dense",
               block_sizes=DEFAULT_BLOCK_SIZES):
    """Lift to (B, Hkv, G, ...), vmap the one-head core over G (key and value not mapped), Hkv
    and B, drop the added axes. offset, q_lengths, kv_lengths: int arrays (B,) or (), or None.
    The blockwise core draws its own dropout from rng, one stream per (batch, head)."""
    lead = query.shape[:-2]
    shape = lead + (query.shape[-2], key.shape[-2])  # (..., H, Lq, Lk)
    blocks = implementation == "blockwise"
    if dropout_rate > 0.0 and keep is None and not blocks:
        keep = jax.random.bernoulli(rng, 1.0 - dropout_rate, shape)
    q, k, v = (_lift(x) for x in (query, key, value))  # (B, H, Lq, Dk), (B, Hkv, Lk, D)
    groups = q.shape[1] // k.shape[1]  # G
    q = q.reshape(q.shape[:1] + (k.shape[1], groups) + q.shape[2:])  # (B, Hkv, G, Lq, Dk)
    extras = tuple(None if x is None else _group(_lift(x), groups)
                   for x in (mask, bias, keep))  # (B|1, Hkv|1, G|1, Lq|1, Lk|1)
    extras += tuple(None if x is None else x.reshape((x.shape[:1] or (1,)) + (1, 1))
                    for x in (offset, q_lengths, kv_lengths))  # (B|1, 1, 1)
    drawn = blocks and dropout_rate > 0.0 and keep is None
    extras += (jnp.arange(math.prod(q.shape[:3]), dtype=jnp.int32).reshape(q.shape[:3])
               if drawn else None,)  # (B, Hkv, G): the head's dropout stream

    static = blockwise.Static(scale, is_causal, softcap, window, dropout_rate, precision,
                              *block_sizes)

    def one(q, k, v, mask, bias, keep, offset, q_len, kv_len, stream):
        if blocks:  # the weights are never formed
            head_rng = None if stream is None else jax.random.fold_in(rng, stream)
            return blockwise.attend(q, k, v, mask, bias, keep, head_rng, offset, q_len, kv_len,
                                    static=static), None
        out, weights = _one_head(q, k, v, mask, bias, keep, offset, q_len, kv_len, scale=scale,
                                 is_causal=is_causal, softcap=softcap, window=window,
                                 dropout_rate=dropout_rate, precision=precision)
        return (out, weights) if return_weights else (out, None)  # weights only when asked for

    run = _vmap_all if chunk is None else partial(_vmap_chunks, chunk=chunk)
    out, weights = run(one, q, k, v, extras)  # (B, Hkv, G, Lq, Dv), (B, Hkv, G, Lq, Lk)
    return out.reshape(lead + out.shape[-2:]), (weights.reshape(shape) if return_weights else None)


def _lift(x):
    """(…, L, D) -> (B|1, H|1, L, D): missing leading axes become size 1."""
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _group(x, groups):
    """(B|1, H|1, Lq, Lk) -> (B|1, Hkv|1, G|1, Lq, Lk): head h = kv head h // G, member h % G."""
    heads = (1, 1) if x.shape[1] == 1 else (x.shape[1] // groups, groups)
    return x.reshape(x.shape[:1] + heads + x.shape[2:])


def _vmap_all(one, q, k, v, extras):
    """vmap over G with k and v not mapped (never copied per query head), then over Hkv, then
    B; size-1 axes of the extras are not mapped."""
    for axis in (2, 1, 0):  # G, Hkv, B: innermost first
        one = _mapped(one, extras, axis, kv=axis < 2)
    return one(q, k, v, *_squeezed(extras, 3))


def _vmap_chunks(one, q, k, v, extras, chunk):
    """The B·Hkv (batch, kv head) pairs, each with its G query heads (vmapped, k and v not
    mapped), ``max(1, chunk // G)`` pairs at a time: vmapped within, sequential across; a group
    of more than ``chunk`` query heads is itself taken ``chunk`` heads at a time, so a step's
    scores stay as small as without groups. The extras are indexed per pair, never copied."""
    b, hkv, g = q.shape[:3]
    per_group = _mapped(one, extras, 2, kv=False)

    def group_in_steps(qn, kn, vn, picked):
        """A group larger than a chunk: its query heads ``chunk`` at a time, k and v shared."""
        def head(args):
            qh, h = args
            return one(qh, kn, vn, *[None if x is None else x[h if x.shape[0] > 1 else 0]
                                     for x in picked])
        return jax.lax.map(head, (qn, jnp.arange(g)), batch_size=chunk)

    def pair(args):  # pair n = i·Hkv + j: batch i, kv head j
        qn, kn, vn, n = args
        i, j = n // hkv, n % hkv
        picked = [None if x is None else x[i if x.shape[0] > 1 else 0, j if x.shape[1] > 1 else 0]
                  for x in extras]  # (G|1, ...)
        if g > chunk:
            return group_in_steps(qn, kn, vn, picked)
        return per_group(qn, kn, vn, *_squeezed(picked, 1))

    flat = tuple(x.reshape((b * hkv,) + x.shape[2:]) for x in (q, k, v))  # (B·Hkv, [G,] L, D)
    out, weights = jax.lax.map(pair, flat + (jnp.arange(b * hkv),), batch_size=max(1, chunk // g))
    unflat = lambda x: None if x is None else x.reshape((b, hkv) + x.shape[1:])  # noqa: E731
    return unflat(out), unflat(weights)


def _mapped(fn, extras, axis, kv):
    """fn vmapped over one axis (0 of q; of k and v when ``kv``; of the extras whose ``axis`` is
    not of size 1, these extras having their size-1 leading axes squeezed)."""
    kv_axis = 0 if kv else None
    axes = tuple(None if x is None or x.shape[axis] == 1 else 0 for x in extras)
    return jax.vmap(fn, in_axes=(0, kv_axis, kv_axis) + axes)


def _squeezed(extras, lead):
    """The extras without their size-1 axes among the first ``lead`` (those not mapped)."""
    return [None if x is None else x.reshape(
        tuple(n for i, n in enumerate(x.shape) if i >= lead or n > 1)) for x in extras]


def _one_head(q, k, v, mask, bias, keep, offset, q_len, kv_len, *, scale, is_causal, softcap,
              window, dropout_rate, precision):
    """One head: q (Lq, Dk), k (Lk, Dk), v (Lk, Dv); mask, bias, keep broadcast to (Lq, Lk);
    offset, q_len, kv_len scalars or None."""
    compute = jnp.promote_types(q.dtype, jnp.float32)  # softmax in at least float32
    scores = scale * jnp.einsum("qd,kd->qk", q, k, precision=precision,
                                preferred_element_type=compute)  # (Lq, Lk)
    if softcap is not None:  # after scaling, before bias and masks
        scores = softcap * jnp.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias.astype(compute)
    allowed = _allowed(scores.shape, mask, offset, q_len, kv_len, is_causal=is_causal,
                       window=window)
    if allowed is None:
        weights = jax.nn.softmax(scores, axis=-1)
    else:
        filled = jnp.where(allowed, scores, jnp.finfo(compute).min)  # finite: no NaN anywhere
        weights = jax.nn.softmax(filled, axis=-1)
        if not _causal_only(mask, offset, q_len, kv_len, window):
            weights = weights * allowed.any(axis=-1, keepdims=True)  # empty rows give zeros
    if dropout_rate > 0.0:
        weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    weights = weights.astype(q.dtype)
    out = jnp.einsum("qk,kv->qv", weights, v, precision=precision,
                     preferred_element_type=compute)  # (Lq, Dv)
    return out.astype(q.dtype), weights


def _causal_only(mask, offset, q_len, kv_len, window):
    """Whether causality alone restricts the keys: every row then keeps key 0, none is empty."""
    return mask is None and offset is None and q_len is None and kv_len is None and (
        window == NO_WINDOW)


def _allowed(shape, mask, offset, q_len, kv_len, *, is_causal, window):
    """Where query row i, at position i + offset, may attend key j (position j): bool (Lq, Lk),
    or None when every key is allowed."""
    row = jnp.arange(shape[0])[:, None]  # (Lq, 1)
    key = jnp.arange(shape[1])[None, :]  # (1, Lk)
    pos = row if offset is None else row + offset  # (Lq, 1)
    left, right = window
    terms = [mask,
             key <= pos if is_causal else None,
             key >= pos - left if left is not None else None,
             key <= pos + right if right is not None else None,
             key < kv_len if kv_len is not None else None,
             row < q_len if q_len is not None else None]
    terms = [t for t in terms if t is not None]
    return jnp.broadcast_to(reduce(jnp.logical_and, terms), shape) if terms else None


def rotary_embedding(x, *, theta, interleaved=False, offset=None, max_position=None):
    """Rotary position embedding of x (..., L, Dh): token i (of batch row b) at position
    i + ``offset`` (None: 0; an int; or an integer array (B,) for x of shape (B, H, L, Dh),
    traced under jit). Feature pair i, (i, i + Dh/2) by default ("rotate half", Hugging Face's
    Llama) or (2i, 2i + 1) when ``interleaved`` (GPT-J, Meta's Llama), turns by
    position · θ^(−2i/Dh).

    The angles are exact to a few roundings at any position: cos and sin come from float64
    tables (golden.positions.rope_tables, constants of the compiled program) for positions below
    ``max_position`` (static; default L, exact without an offset); every position must be below
    it (a larger one reads a clamped row). The rotation runs in at least float32 and is rounded
    once to x's dtype.
    """
    check_rotary(x, theta)
    length, dh = x.shape[-2], x.shape[-1]
    if dh % 2:
        raise ValueError(f"x's last axis Dh should be even for rotary embeddings, got {dh}")
    positions = jnp.arange(length)  # (L,)
    if offset is not None:
        offset = jnp.asarray(offset, dtype=jnp.int32)
        positions = positions + offset.reshape(offset.shape + (1,) * (x.ndim - 2))  # (B, 1, L)
    max_position = length if max_position is None else max_position
    compute = jnp.promote_types(x.dtype, jnp.float32)
    cos, sin = _rope_cos_sin(positions, float(theta), dh, max_position, compute)
    return _turn(x.astype(compute), cos, sin, interleaved).astype(x.dtype)


def _rope_cos_sin(positions, theta, dh, max_position, dtype):
    """cos and sin (..., L, Dh/2) of position · f_i, by angle addition over the tables' rows
    a = position // ROPE_BLOCK and b = position % ROPE_BLOCK."""
    tables = [jnp.asarray(t, dtype=dtype) for t in rope_tables(theta, dh, max_position)]
    hi, lo = positions // ROPE_BLOCK, positions % ROPE_BLOCK
    cos_hi, sin_hi, cos_lo, sin_lo = tables[0][hi], tables[1][hi], tables[2][lo], tables[3][lo]
    return cos_hi * cos_lo - sin_hi * sin_lo, sin_hi * cos_lo + cos_hi * sin_lo


def _turn(x, cos, sin, interleaved):
    """(a, b) -> (a cos − b sin, b cos + a sin) for each feature pair of x (..., L, Dh)."""
    half = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    turned = (a * cos - b * sin, b * cos + a * sin)
    if interleaved:
        return jnp.stack(turned, axis=-1).reshape(x.shape)  # (..., L, Dh/2, 2) -> (..., L, Dh)
    return jnp.concatenate(turned, axis=-1)

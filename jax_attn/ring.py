"""Ring attention: the sequence sharded over a mesh axis (context parallelism).

Shape legend: B batch, H query heads, Hkv key-value heads, G = H / Hkv, Lq query length, Lk key
length, Dk key width, Dv value width; P devices along the sequence axis, n chunks per device (1
contiguous, 2 zig-zag), Cq = Lq / (n·P) and Ck = Lk / (n·P) the chunk lengths. Inside
``jax.shard_map`` B, H and Hkv are a device's own counts when ``batch_axis`` or ``head_axis``
shard them too.

Each device holds n chunks of the queries and n of the keys and values. The key/value blocks go
round the ring (``lax.ppermute`` to the next device, P − 1 times, each sent while the block in
hand is computed) and each device folds every block that reaches it into its queries' running
softmax state (m, l, acc) with the blockwise path's own pieces (``blockwise.accumulate``): query
chunk a against key chunk b is one blockwise head whose keys start at 0 and whose queries start
at position offset + a·Cq − b·Ck, the lengths shifted alike, so causal bounds, windows and
lengths keep their global meaning and blocks they exclude are skipped by index (a pair of chunks
wholly in the future costs index arithmetic, no product). A distance bias (ALiBi's, T5's) is a
table over key − query distances that every device holds whole for its heads; the shifted
positions make each block read it at its global distances. The backward (a custom VJP) sends the
key/value blocks round again with their dK and dV accumulators (P − 1 hops, and one more to
bring dK and dV home) while dQ and the distance table's gradient stay put (the latter summed
over the devices at the end); the residuals are the local q, k, v, output and each
row's (m, 1/l), so no device ever holds (L, L) scores or the whole K and V.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from golden.specification.validate import (
    check_attention_args,
    check_distance_bias,
    check_flags,
    window,
)
from jax_attn import blockwise
from jax_attn.functional import DEFAULT_PRECISION, batch_int32

LAYOUTS = ("zigzag", "contiguous", "zigzag_ordered")


class Ring(NamedTuple):
    """The compile-time configuration of the ring (hashable)."""

    static: blockwise.Static  # the blockwise settings, blocks fitted to the chunks
    axis: str  # the mesh axis along the sequence
    devices: int  # P
    chunks: int  # n, per device
    relayout: bool  # zig-zag chunks moved on device (the arrays come in natural order)
    batch_axis: str | None
    head_axis: str | None


def ring_attention(
    query, key, value, mask=None, bias=None, *, mesh, axis="seq", layout="zigzag",
    batch_axis=None, head_axis=None, is_causal=False, scale=None, softcap=None,
    local_window_size=None, attention_chunk_size=None, query_offset=None,
    query_seq_lengths=None, key_value_seq_lengths=None, sinks=None, dropout_rate=0.0,
    block_sizes=None, precision=DEFAULT_PRECISION, distance_bias=None,
):
    """jax_attn.scaled_dot_product_attention with the sequence sharded over ``mesh``'s ``axis``
    of P devices, by ring attention; the same numbers to rounding, gradients included.

    query (B, H, Lq, Dk), key (B, Hkv, Lk, Dk), value (B, Hkv, Lk, Dv): global arrays, the
    sequence axis sharded over ``axis``, the batch over ``batch_axis`` and the heads over
    ``head_axis`` when those are named (mesh axes; None: not sharded). Arrays laid out
    otherwise are moved to that layout first (name the axes your arrays are sharded over, or
    XLA gathers them). Returns the output (B, H, Lq, Dv), sharded the same way. Each device
    holds its own slices, one more K/V block in flight, and its rows' statistics; the
    gradients (a custom VJP) run the ring again and never gather (L, L) or the whole K and V.
    ``is_causal``, ``scale``, ``softcap``, ``local_window_size``, ``attention_chunk_size``,
    ``query_offset``, ``query_seq_lengths``, ``key_value_seq_lengths``, ``sinks`` (H,) (sharded
    over ``head_axis`` with the heads; its gradient summed over every device's rows),
    ``block_sizes`` (the blocks within a device's chunks) and ``precision`` mean what they mean
    in the core; positions are global (query row i at i + offset, key j at j, whichever device
    holds them; chunks of attention_chunk_size tokens too).
    distance_bias: a bias of key − query distance d only (ALiBi's m_h · d, T5's buckets), as in
    the core: (H, 2S + 1) or (B, H, 2S + 1), entry S + clip(d, −S, S), added after the cap.
    Every device holds the whole table of its heads (and batch rows): O(H·S), not O(L²); each
    pair of chunks gathers its blocks' entries at their global distances, so entry (i, j) is
    the one-device bias. Its gradient sums every device's rows (over the sequence axis, and
    over the batch axis for an (H, 2S + 1) table).

    layout: which tokens each device computes. "contiguous": device i the i-th of P equal
    slices of the arrays as given (causal work grows with i: the last device does 2P − 1 times
    the first's). "zigzag" (default): the arrays as given, in natural order; each device swaps
    halves of its slice with two others (two collective-permutes per array, and two more for
    the output) so as to compute chunks i and 2P − 1 − i of 2P, which gives every device the
    same causal work at every step of the ring; the moves send each device's slices of q, k, v
    and the output once more (at H = 4·Hkv and P = 8, 70 % on top of the ring's forward
    traffic). "zigzag_ordered": the arrays are already in that order along the sequence axis
    (``zigzag_order(L, P)`` lists the tokens; the output comes back in it), so nothing moves
    but the ring: the choice of a model that orders its tokens once, at its input. Lq and Lk
    must be multiples of P (contiguous) or 2P (zig-zag).

    Not supported (ValueError): ``mask`` and ``bias`` (full (Lq, Lk) arrays do not travel with
    a block of keys; causal bounds, windows and lengths cover causal and padding masks, and
    distance_bias a bias of distance only) and dropout. Inputs must have rank 4.
    """
    check_attention_args(query, key, value, mask, bias, scale=scale, softcap=softcap,
                         local_window_size=local_window_size, query_offset=query_offset,
                         query_seq_lengths=query_seq_lengths,
                         key_value_seq_lengths=key_value_seq_lengths, dropout_rate=dropout_rate,
                         sinks=sinks, attention_chunk_size=attention_chunk_size)
    if distance_bias is not None:
        check_distance_bias(distance_bias, query)
    check_flags(is_causal=is_causal)
    ring = _configure(query, key, mask, bias, dropout_rate, mesh=mesh, axis=axis, layout=layout,
                      batch_axis=batch_axis, head_axis=head_axis, is_causal=is_causal,
                      scale=scale, softcap=softcap, local_window_size=local_window_size,
                      block_sizes=block_sizes, precision=precision,
                      attention_chunk_size=attention_chunk_size)
    positions = (batch_int32(x, query.shape[:1]) for x in
                 (query_offset, query_seq_lengths, key_value_seq_lengths))
    return _sharded(query, key, value, *positions, sinks, distance_bias, ring=ring, mesh=mesh)


def zigzag_order(length, devices):
    """The token indices (L,) of the zig-zag layout over P devices: device i's slice holds
    chunks i and 2P − 1 − i of 2P. ``x[..., zigzag_order(L, P), :]`` orders an array for
    layout="zigzag_ordered"; ``np.argsort`` of it orders the output back."""
    chunk = length // (2 * devices)
    ids = [c for i in range(devices) for c in (i, 2 * devices - 1 - i)]
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in ids])


# ---- arguments ----------------------------------------------------------------------------------

def _configure(query, key, mask, bias, dropout_rate, *, mesh, axis, layout, batch_axis,
               head_axis, is_causal, scale, softcap, local_window_size, block_sizes, precision,
               attention_chunk_size=None):
    """The Ring of these arguments, after the checks the core does not make."""
    _check_ring(query, key, mask, bias, dropout_rate, mesh, axis, layout, batch_axis, head_axis)
    chunks = 1 if layout == "contiguous" else 2
    devices = mesh.shape[axis]
    block_q, block_k = blockwise.sizes(block_sizes)
    cq, ck = (n // (chunks * devices) for n in (query.shape[-2], key.shape[-2]))
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    static = blockwise.Static(scale, bool(is_causal), None if softcap is None else float(softcap),
                              window(local_window_size), 0.0, precision,
                              blockwise.fit(cq, block_q), blockwise.fit(ck, block_k),
                              chunk_size=attention_chunk_size)
    return Ring(static, axis, devices, chunks, layout == "zigzag", batch_axis, head_axis)


def _check_ring(query, key, mask, bias, dropout_rate, mesh, axis, layout, batch_axis,
                head_axis):
    for arg, x in (("mask", mask), ("bias", bias)):
        if x is not None:
            raise ValueError(f"ring_attention takes no {arg} (a full (Lq, Lk) array does not "
                             f"travel with a block of keys; use is_causal, local_window_size "
                             f"and the lengths, and distance_bias for a bias of key − query "
                             f"distance), got an array of shape {tuple(x.shape)}")
    if dropout_rate != 0.0:
        raise ValueError(f"ring_attention has no dropout: dropout_rate should be 0.0, got "
                         f"{dropout_rate!r}")
    if query.ndim != 4:
        raise ValueError(f"query should have rank 4, (B, H, Lq, Dk), for ring_attention, got "
                         f"shape {tuple(query.shape)}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh should be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout should be one of {', '.join(map(repr, LAYOUTS))}, got "
                         f"{layout!r}")
    names = tuple(mesh.axis_names)
    for arg, name in (("axis", axis), ("batch_axis", batch_axis), ("head_axis", head_axis)):
        if (arg == "axis" or name is not None) and name not in names:
            raise ValueError(f"{arg} should be one of the mesh's axes {names}"
                             f"{'' if arg == 'axis' else ' or None'}, got {name!r}")
    used = [a for a in (axis, batch_axis, head_axis) if a is not None]
    if len(set(used)) < len(used):
        raise ValueError(f"axis, batch_axis and head_axis should be different mesh axes, got "
                         f"{axis!r}, {batch_axis!r}, {head_axis!r}")
    devices, chunks = mesh.shape[axis], 1 if layout == "contiguous" else 2
    for arg, letter, n in (("query", "Lq", query.shape[2]), ("key", "Lk", key.shape[2])):
        if n % (chunks * devices):
            raise ValueError(f"{arg} length {letter} should be a multiple of "
                             f"{'' if chunks == 1 else '2·'}P = {chunks * devices} (layout "
                             f"{layout!r}, P = {devices} devices on axis {axis!r}), got {n}")
    sizes = [("batch B", "query", query.shape[0], batch_axis),
             ("heads H", "query", query.shape[1], head_axis),
             ("heads Hkv", "key", key.shape[1], head_axis)]
    for what, arg, n, name in sizes:
        if name is not None and n % mesh.shape[name]:
            raise ValueError(f"{arg} {what} should be a multiple of the {mesh.shape[name]} "
                             f"devices on axis {name!r}, got {n}")


# ---- the mesh and the zig-zag moves -------------------------------------------------------------

@partial(jax.jit, static_argnames=("ring", "mesh"))
def _sharded(query, key, value, offset, q_lengths, kv_lengths, sinks, distance_bias, *, ring,
             mesh):
    """One program: every device runs _on_device on its slices."""
    seq = PartitionSpec(ring.batch_axis, ring.head_axis, ring.axis, None)  # (B, H, L, D)
    rows = PartitionSpec(ring.batch_axis)  # (B,)
    heads = PartitionSpec(ring.head_axis)  # (H,)
    per_row = distance_bias is not None and distance_bias.ndim == 3
    table = PartitionSpec(*(ring.batch_axis,) * per_row, ring.head_axis,
                          None)  # ([B,] H, 2S + 1): whole on every device along the sequence
    run = jax.shard_map(partial(_on_device, ring), mesh=mesh, out_specs=seq,
                        in_specs=(seq, seq, seq, rows, rows, rows, heads, table))
    return run(*_laid_out(mesh, (query, key, value), seq),
               *_laid_out(mesh, (offset, q_lengths, kv_lengths), rows),
               *_laid_out(mesh, (sinks,), heads), *_laid_out(mesh, (distance_bias,), table))


def _laid_out(mesh, arrays, spec):
    """The arrays (None kept) moved to ``spec`` if they are laid out otherwise: shard_map takes
    them as they come on a mesh of auto axes, but on one of explicit axes (jax.make_mesh's
    default) only if they already match."""
    return [None if x is None else jax.device_put(x, NamedSharding(mesh, spec)) for x in arrays]


def _on_device(ring, q, k, v, offset, q_lengths, kv_lengths, sinks, distance_bias):
    """One device: q (B, H, n·Cq, Dk), k (B, Hkv, n·Ck, Dk), v (B, Hkv, n·Ck, Dv) ->
    (B, H, n·Cq, Dv); offset and lengths (B,) or None; sinks (H,) or None; distance_bias
    ([B,] H, 2S + 1) or None."""
    pos = (offset, q_lengths, kv_lengths)
    if not ring.relayout:
        return _ring(ring, q, k, v, pos, sinks, distance_bias)
    q, k, v = (_to_zigzag(ring, x) for x in (q, k, v))
    return _from_zigzag(ring, _ring(ring, q, k, v, pos, sinks, distance_bias))


def _zigzag_device(chunk, devices):
    """The device that holds a chunk (of 2P) in the zig-zag layout."""
    return chunk if chunk < devices else 2 * devices - 1 - chunk


def _to_zigzag(ring, x):
    """x (..., 2C, D), natural chunks 2i and 2i + 1 on device i -> chunks i and 2P − 1 − i.
    The first halves all go one way and the second halves another, each a permutation of
    the devices; an even device's first chunk is even, so it came with the first halves."""
    p, c = ring.devices, x.shape[-2] // 2
    sent = [lax.ppermute(half, ring.axis, [(i, _zigzag_device(2 * i + s, p)) for i in range(p)])
            for s, half in enumerate((x[..., :c, :], x[..., c:, :]))]
    even = lax.axis_index(ring.axis) % 2 == 0
    return jnp.concatenate([jnp.where(even, sent[0], sent[1]),
                            jnp.where(even, sent[1], sent[0])], axis=-2)


def _from_zigzag(ring, x):
    """The inverse of _to_zigzag: chunk c goes back to device c // 2, half c % 2."""
    p, c = ring.devices, x.shape[-2] // 2
    even = lax.axis_index(ring.axis) % 2 == 0
    first, second = x[..., :c, :], x[..., c:, :]
    halves = (jnp.where(even, first, second), jnp.where(even, second, first))  # even, odd chunk
    back = [lax.ppermute(half, ring.axis,
                         [(j, (j if j % 2 == s else 2 * p - 1 - j) // 2) for j in range(p)])
            for s, half in enumerate(halves)]
    return jnp.concatenate(back, axis=-2)


# ---- the ring: forward and backward -------------------------------------------------------------

@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring, q, k, v, pos, sinks, distance_bias):
    out, _ = _forward(ring, q, k, v, pos, sinks, distance_bias)
    return out.astype(q.dtype)


def _ring_fwd(ring, q, k, v, pos, sinks, distance_bias):
    out, stats = _forward(ring, q, k, v, pos, sinks, distance_bias)
    out = out.astype(q.dtype)  # the backward's D = rowsum(dO ⊙ O) uses the output returned
    return out, (q, k, v, pos, sinks, distance_bias, out, stats)


def _ring_bwd(ring, res, d_out):
    q, k, v, pos, sinks, distance_bias, out, stats = res
    dq, dk, dv, d_distance = _backward(ring, q, k, v, pos, distance_bias, out, stats, d_out)
    d_sinks = None if sinks is None else _sink_grads(ring, q, k, sinks, out, stats, d_out)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), (None, None, None),
            d_sinks, d_distance)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _forward(ring, q, k, v, pos, sinks=None, distance_bias=None):
    """The local output (B, H, n·Cq, Dv) in the compute dtype and each row's statistics
    (n, B, Hkv, G, 2, Cq) (m and 1 / l, as blockwise saves them). With sinks (H,) every row's
    softmax starts from its head's sink (m = sink, l = 1); distance_bias ([B,] H, 2S + 1) is
    gathered per block at the global distances."""
    st, p, n = ring.static, ring.devices, ring.chunks
    qs = _chunked(_grouped(q, k), n)  # (n, B, Hkv, G, Cq, Dk)
    table = _tables(ring, distance_bias, q, k)  # (B, Hkv, G, 2S + 1) or None
    kv = (_chunked(k, n), _chunked(v, n))  # (n, B, Hkv, Ck, Dk), (n, B, Hkv, Ck, Dv)
    lq, compute = qs.shape[-2], jnp.promote_types(q.dtype, jnp.float32)
    state = _varying(_lead(partial(blockwise.start, st, lq, v.shape[-1], compute),
                           qs.shape[:4]), ring)  # (m, l, acc), each (n, B, Hkv, G, Nq, Bq, ...)
    if sinks is not None:
        m, total, acc = state
        sink = sinks.astype(compute).reshape(qs.shape[2:4])[None, None, :, :, None, None]
        m = jnp.maximum(m, sink)  # the sink folded in (m finite, l = 0 for a sink of −inf)
        state = (m, total + jnp.exp(sink - m), acc)
    me = lax.axis_index(ring.axis)

    def step(carry, s):
        kv, state = carry
        ahead = lax.ppermute(kv, ring.axis, _next(p))  # in flight while this block computes
        return (ahead, _fold(ring, state, qs, table, kv, (me - s) % p, pos)), None

    (kv, state), _ = lax.scan(step, (kv, state), jnp.arange(p - 1))
    state = _fold(ring, state, qs, table, kv, (me + 1) % p, pos)  # the last: nothing to send
    out, stats = _batched(partial(_finish, st, lq), 4)(state)  # (n, B, Hkv, G, Cq, Dv), ...
    return _unchunked(out).reshape(q.shape[:-1] + out.shape[-1:]), stats


def _fold(ring, state, qs, table, kv, src, pos):
    """Every local query chunk's state after the keys and values of device ``src``: the n²
    pairs of chunks in a loop, so that the program holds one copy of the blockwise body."""
    n, (ks, vs) = ring.chunks, kv
    mine, theirs = _chunk_ids(ring, lax.axis_index(ring.axis)), _chunk_ids(ring, src)
    fold = _over_heads(partial(_fold_head, ring.static), 3, 2)

    def pair(t, state):
        i, j = t // n, t % n
        new = fold(jax.tree.map(lambda x: x[i], state), qs[i], table, ks[j], vs[j],
                   *_positions(mine[i], theirs[j], qs.shape[-2], ks.shape[-2], pos))
        return jax.tree.map(lambda x, y: x.at[i].set(y), state, new)

    return lax.fori_loop(0, n * n, pair, state)


def _fold_head(st, state, q, distance_bias, k, v, offset, q_lengths, kv_lengths, key_start):
    """One head: state after the keys k (Ck, Dk) and values v (Ck, Dv); distance_bias
    (2S + 1,) or None, read at key − query distances of the pair's shifted positions, which
    are the global ones (_positions)."""
    h = blockwise.Head.make(st, q, k, v, None, None, None, None, offset, q_lengths, kv_lengths,
                            key_start, distance_bias=distance_bias)
    return blockwise.accumulate(st, h, state)


def _finish(st, lq, state):
    return blockwise.finish(st, state, lq)


def _backward(ring, q, k, v, pos, distance_bias, out, stats, d_out):
    """dQ, dK, dV in the compute dtype, each of its input's local shape, and d(distance_bias)
    in its dtype and local shape (None without). The key/value blocks go round again, each
    with its dK and dV, which every device adds to; after P − 1 hops a device holds the block
    of the next device, which one more hop brings home. dQ and d(distance_bias) stay put; the
    latter is summed over the devices at the end (_table_grads)."""
    st, p, n = ring.static, ring.devices, ring.chunks
    compute = jnp.promote_types(q.dtype, jnp.float32)
    qs, outs, d_outs = (_chunked(_grouped(x, k), n) for x in (q, out, d_out))  # (n, B, ...)
    table = _tables(ring, distance_bias, q, k)  # (B, Hkv, G, 2S + 1) or None
    grads = _over_heads(partial(_grads_head, st), 5, 2)
    me = lax.axis_index(ring.axis)

    def visit(d_q, kv, d_kv, src):
        (ks, vs), mine, theirs = kv, _chunk_ids(ring, me), _chunk_ids(ring, src)

        def pair(t, carry):
            (d_q, d_table), (d_k, d_v) = carry
            i, j = t // n, t % n
            dq, dk, dv, dt = grads(qs[i], outs[i], stats[i], d_outs[i], table, ks[j], vs[j],
                                   *_positions(mine[i], theirs[j], qs.shape[-2], ks.shape[-2],
                                               pos))
            # dk, dv (B, Hkv, G, Ck, D): a key/value head's gradient sums over its group
            d_table = None if d_table is None else d_table + dt
            return (d_q.at[i].add(dq), d_table), (d_k.at[j].add(dk.sum(axis=2)),
                                                  d_v.at[j].add(dv.sum(axis=2)))

        return lax.fori_loop(0, n * n, pair, (d_q, d_kv))

    def step(carry, s):
        kv, d_kv, d_q = carry
        ahead = lax.ppermute(kv, ring.axis, _next(p))  # in flight while this block computes
        d_q, d_kv = visit(d_q, kv, d_kv, (me - s) % p)
        return (ahead, lax.ppermute(d_kv, ring.axis, _next(p)), d_q), None

    kv = (_chunked(k, n), _chunked(v, n))
    zeros = lambda x: None if x is None else _varying(jnp.zeros(x.shape, compute),  # noqa: E731
                                                      ring)
    d_q = (zeros(qs), zeros(table))  # dQ and the tables' gradient, both with the queries
    (kv, d_kv, d_q), _ = lax.scan(step, (kv, (zeros(kv[0]), zeros(kv[1])), d_q),
                                  jnp.arange(p - 1))
    (d_q, d_table), d_kv = visit(d_q, kv, d_kv, (me + 1) % p)
    dk, dv = lax.ppermute(d_kv, ring.axis, _next(p))  # home
    return (_unchunked(d_q).reshape(q.shape), _unchunked(dk), _unchunked(dv),
            _table_grads(ring, d_table, distance_bias))


def _grads_head(st, q, out, stats, d_out, distance_bias, k, v, offset, q_lengths, kv_lengths,
                key_start):
    """One head: this block's share of dQ (Cq, Dk), dK (Ck, Dk), dV (Ck, Dv) and
    d(distance_bias) (2S + 1,) (None without), from the output and statistics of the whole
    softmax."""
    h = blockwise.Head.make(st, q, k, v, None, None, None, None, offset, q_lengths, kv_lengths,
                            key_start, distance_bias=distance_bias)
    dq, dk, dv, _, (d_distance, _, _) = blockwise.backward(st, h, out, stats, d_out)
    return dq, dk, dv, d_distance


def _tables(ring, distance_bias, q, k):
    """distance_bias ([B,] H, 2S + 1) of the device's heads -> (B, Hkv, G, 2S + 1), one table
    per query head as _grouped orders them (a shared table broadcast over B); None kept."""
    if distance_bias is None:
        return None
    t = distance_bias if distance_bias.ndim == 3 else distance_bias[None]  # (B|1, H, 2S + 1)
    t = t.reshape(t.shape[:1] + (k.shape[1], -1) + t.shape[-1:])  # (B|1, Hkv, G, 2S + 1)
    # varying as the rows are (blockwise's gradient of it is a loop carry that meets them):
    # the table came whole to every device along the sequence, and along the batch if shared
    shared = (ring.axis,) + ((ring.batch_axis,) if distance_bias.ndim == 2 and
                             ring.batch_axis is not None else ())
    return jnp.broadcast_to(lax.pcast(t, shared, to="varying"), q.shape[:1] + t.shape[1:])


def _table_grads(ring, d_table, distance_bias):
    """d(distance_bias) of the device's heads from each row's d_table (B, Hkv, G, 2S + 1),
    summed over the rows of every device along the sequence axis, and over the batch (its
    rows here, and its devices along batch_axis) for a table (H, 2S + 1) shared by the
    batch."""
    if d_table is None:
        return None
    axes = (ring.axis,)
    if distance_bias.ndim == 2:
        d_table = d_table.sum(axis=0)
        axes += () if ring.batch_axis is None else (ring.batch_axis,)
    return lax.psum(d_table.reshape(distance_bias.shape), axes).astype(distance_bias.dtype)


# ---- positions, chunks and mapping --------------------------------------------------------------

def _next(devices):
    """Each device sends to the next, the last to the first."""
    return [(i, (i + 1) % devices) for i in range(devices)]


def _chunk_ids(ring, device):
    """The chunks a device holds, in order, int32 (n,): (i,) of P, or (i, 2P − 1 − i) of 2P."""
    ids = (device,) if ring.chunks == 1 else (device, 2 * ring.devices - 1 - device)
    return jnp.stack(ids).astype(jnp.int32)


def _positions(a, b, cq, ck, pos):
    """Query chunk a against key chunk b as one blockwise head whose keys start at 0: its
    query offset, query length and key length, (B,) or scalars, or None, and the global
    position of its first key (for the chunks of attention_chunk_size)."""
    offset, q_lengths, kv_lengths = pos
    shift = a * cq - b * ck  # global query position − global key position, at their starts
    return (shift if offset is None else offset + shift,
            None if q_lengths is None else q_lengths - a * cq,
            None if kv_lengths is None else jnp.maximum(kv_lengths - b * ck, 0), b * ck)


def _sink_grads(ring, q, k, sinks, out, stats, d_out):
    """dL/dsinks (H,) of the device's heads: each row's −p_sink · rowsum(dO ⊙ O)
    (blockwise.sink_grad) summed over the local rows and batch, then over the devices along
    the sequence (and the batch) axis."""
    outs, d_outs = (_chunked(_grouped(x, k), ring.chunks) for x in (out, d_out))
    sink = jnp.broadcast_to(sinks.reshape(outs.shape[2:4]), outs.shape[:4])  # (n, B, Hkv, G)
    grads = _batched(partial(blockwise.sink_grad, ring.static), 4)(sink, outs, stats, d_outs)
    axes = tuple(a for a in (ring.axis, ring.batch_axis) if a is not None)
    return lax.psum(grads.sum(axis=(0, 1)).reshape(sinks.shape), axes).astype(sinks.dtype)


def _grouped(x, like):
    """(B, H, L, D) -> (B, Hkv, G, L, D), Hkv = like's heads: query head h = kv head h // G."""
    b, h = x.shape[:2]
    return x.reshape((b, like.shape[1], h // like.shape[1]) + x.shape[2:])


def _chunked(x, n):
    """(..., n·C, D) -> (n, ..., C, D): the n chunks of the sequence axis, stacked."""
    x = x.reshape(x.shape[:-2] + (n, x.shape[-2] // n, x.shape[-1]))
    return jnp.moveaxis(x, -3, 0)


def _unchunked(x):
    """(n, ..., C, D) -> (..., n·C, D), the inverse of _chunked."""
    x = jnp.moveaxis(x, 0, -3)
    return x.reshape(x.shape[:-3] + (-1, x.shape[-1]))


def _over_heads(fn, n_query, n_kv):
    """fn of one head vmapped over G (its first n_query arguments), Hkv (and the next n_kv)
    and B (and the positions that are arrays (B,); scalars are shared)."""
    def mapped(*args):
        heads = args[:n_query + n_kv]
        rows = tuple(None if x is None or jnp.ndim(x) == 0 else 0 for x in args[len(heads):])
        f = jax.vmap(fn, in_axes=(0,) * n_query + (None,) * (n_kv + len(rows)))  # G
        f = jax.vmap(f, in_axes=(0,) * len(heads) + (None,) * len(rows))  # Hkv
        return jax.vmap(f, in_axes=(0,) * len(heads) + rows)(*args)  # B
    return mapped


def _batched(fn, depth):
    """fn vmapped over ``depth`` leading axes of every argument."""
    for _ in range(depth):
        fn = jax.vmap(fn)
    return fn


def _lead(make, shape):
    """make()'s arrays broadcast to ``shape`` + their own shape."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, shape + x.shape), make())


def _varying(tree, ring):
    """Constants marked as varying over the mesh axes the data varies over (those of the
    specs): a loop's carry must keep its type, and it varies once it has met the data."""
    axes = tuple(a for a in (ring.axis, ring.batch_axis, ring.head_axis) if a is not None)
    return jax.tree.map(lambda x: lax.pcast(x, axes, to="varying"), tree)


# ---- how the work is spread -----------------------------------------------------------------

def blocks_per_device(query, key, value, *, mesh, axis="seq", layout="zigzag", batch_axis=None,
                      head_axis=None, is_causal=False, scale=None, softcap=None,
                      local_window_size=None, attention_chunk_size=None, query_offset=None,
                      query_seq_lengths=None, key_value_seq_lengths=None, block_sizes=None):
    """How many (Bq, Bk) blocks of scores each device along ``axis`` computes in the forward
    of ring_attention with these arguments, summed over its heads and the ring's steps: an
    int32 array (P,). The same chunks, positions and skipping rules (blockwise.visited, the
    forward's own loop bounds) as the forward."""
    check_attention_args(query, key, value, scale=scale, softcap=softcap,
                         local_window_size=local_window_size, query_offset=query_offset,
                         query_seq_lengths=query_seq_lengths,
                         key_value_seq_lengths=key_value_seq_lengths,
                         attention_chunk_size=attention_chunk_size)
    ring = _configure(query, key, None, None, 0.0, mesh=mesh, axis=axis, layout=layout,
                      batch_axis=batch_axis, head_axis=head_axis, is_causal=is_causal,
                      scale=scale, softcap=softcap, local_window_size=local_window_size,
                      block_sizes=block_sizes, precision=DEFAULT_PRECISION,
                      attention_chunk_size=attention_chunk_size)
    positions = tuple(batch_int32(x, query.shape[:1]) for x in
                      (query_offset, query_seq_lengths, key_value_seq_lengths))
    return _counted(query, key, value, *positions, ring=ring, mesh=mesh)


@partial(jax.jit, static_argnames=("ring", "mesh"))
def _counted(query, key, value, offset, q_lengths, kv_lengths, *, ring, mesh):
    seq = PartitionSpec(ring.batch_axis, ring.head_axis, ring.axis, None)
    rows = PartitionSpec(ring.batch_axis)
    others = tuple(a for a in (ring.batch_axis, ring.head_axis) if a is not None)

    def count(q, k, v, *pos):
        st, me = ring.static, lax.axis_index(ring.axis)
        q, k, v = _chunked(_grouped(q, k), ring.chunks)[0], _chunked(k, ring.chunks)[0], \
            _chunked(v, ring.chunks)[0]  # one chunk of each: the counts need only shapes
        visited = _over_heads(lambda q, k, v, *p: blockwise.visited(
            st, blockwise.Head.make(st, q, k, v, None, None, None, None, *p)), 1, 2)
        total, mine = jnp.int32(0), _chunk_ids(ring, me)
        for s in range(ring.devices):
            theirs = _chunk_ids(ring, (me - s) % ring.devices)
            for i in range(ring.chunks):
                for j in range(ring.chunks):
                    where = _positions(mine[i], theirs[j], q.shape[-2], k.shape[-2], pos)
                    total += visited(q, k, v, *where).sum()
        total = lax.psum(total, others) if others else total
        return total.reshape(1)

    run = jax.shard_map(count, mesh=mesh, in_specs=(seq, seq, seq, rows, rows, rows),
                        out_specs=PartitionSpec(ring.axis))
    return run(query, key, value, offset, q_lengths, kv_lengths)

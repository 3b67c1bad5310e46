"""The "splash" implementation: the TPU splash-attention kernel
(``jax.experimental.pallas.ops.tpu.splash_attention``, block-sparse flash attention with its own
backward) behind the JAX core's registry (jax_attn.functional.IMPLEMENTATIONS), compiled on a
TPU, run in Pallas's interpret mode elsewhere (a CPU: slow, for validating the mapping, never
chosen automatically).

The mapping, read from the installed JAX's source (0.10: splash_attention_kernel.py,
splash_attention_mask.py):
- the allowed set's static part is one splash mask, the same for every head: ``CausalMask``
  (is_causal), ``LocalMask`` (the window (left, right), its offset 0: query row i at position
  i, as ours; is_causal with a window is the window (left, 0)), ``ChunkedCausalMask``
  (attention_chunk_size with is_causal; its chunks are ours, j // C = i // C), ANDed
  (``LogicalAnd``) when several apply, ``FullMask`` when none;
- key_value_seq_lengths as ``SegmentIds``: query rows id 1, key j id 1 when j < its batch's
  length, else 0; query_seq_lengths need nothing (the rows past them are zeroed after);
- GQA natively (make_splash_mha with Hkv key-value heads: query head h reads kv head h // G,
  our grouping), the batch by ``jax.vmap`` over the kernel;
- ``scale`` multiplies q before the kernel (in float32, rounded once to q's dtype: the kernel
  has no scale), ``softcap`` is its ``attn_logits_soft_cap`` (c · tanh(s / c) of the scaled
  scores, as ours), ``sinks`` its sinks (one logit per query head, joining the denominator
  after the cap, as ours);
- blocks (``BlockSizes``): for each length the largest of SPLASH_BLOCKS that divides it, the
  same for the forward and the fused backward (``use_fused_bwd_kernel``: dq, dk and dv in one
  kernel from the saved log-sum-exp; the kernel's custom VJP);
- rows with no allowed key are zeroed after the kernel, as the core does
  (jax_attn.accelerators.rows_allowed: splash averages the values there, or divides 0 by 0
  where a whole block of rows has none).
What it refuses, and why: ``splash_refuses``.

Shape legend: B batch, H query heads, Hkv key-value heads, G = H / Hkv, Lq query length,
Lk key length, Dk key width, Dv value width.
"""

from __future__ import annotations

import functools
import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from golden.specification.implementations import Asked, ran
from golden.specification.validate import window as window_of
from jax_attn.accelerators import _lift, _zero_empty_rows

# A length must be a multiple of one of these (the kernel's blocks divide the lengths; its
# segment ids and key blocks need multiples of 128 lanes); the largest that divides is taken.
SPLASH_BLOCKS = (512, 256, 128)
SPLASH_DTYPES = ("float32", "bfloat16")


def splash_refuses(asked) -> str | None:
    """Why the splash kernel cannot run this call, or None (off a TPU it runs in Pallas's
    interpret mode)."""
    taken_elsewhere = [
        (asked.return_weights, "return_weights=True (it never forms the weights)"),
        (asked.dropout, "dropout"), (asked.mask, "mask"), (asked.bias, "bias"),
        (asked.offset, "query_offset (its masks' offsets are static, ours traced)"),
        (asked.distance_bias, "distance_bias"),
        (asked.distance_keys, "distance_query and distance_keys"),
        (asked.key_indices, "key_indices (a selection: 'sparse' reads it)"),
        (asked.block_sizes is not None, "block_sizes (for 'blockwise')"),
        (asked.sharded, "arrays on a mesh with explicit axes (jax_attn.splash.sharded runs "
                        "it under shard_map)")]
    given = [what for flag, what in taken_elsewhere if flag]
    if given:
        return f"splash takes no {', '.join(given)}: 'explicit' or 'blockwise' does"
    if asked.platform == "gpu":
        return ("splash is the TPU kernel: on a GPU only its interpret mode would run, an "
                "emulation far slower than 'cudnn' or 'pallas'")
    if asked.chunk and not asked.causal:
        return ("splash's chunked mask (ChunkedCausalMask) is causal: attention_chunk_size "
                "needs is_causal=True")
    if asked.dtype and asked.dtype not in SPLASH_DTYPES:
        return (f"splash takes float32 or bfloat16 (it accumulates in float32), got "
                f"{asked.dtype}")
    if asked.platform == "tpu" and asked.dtype == "float32":
        return ("on a TPU splash's float32 dots carry no precision (its kernels' dot_general "
                "sets none), not known to run at precision HIGHEST: it takes bfloat16 there")
    if asked.lengths and any(block(n) is None for n in asked.lengths):
        return (f"splash needs each length a multiple of {SPLASH_BLOCKS[-1]} (its blocks of "
                f"{', '.join(map(str, SPLASH_BLOCKS))} divide the lengths), got Lq, Lk = "
                f"{asked.lengths}")
    return None


def block(n: int) -> int | None:
    """The largest of SPLASH_BLOCKS dividing ``n`` (None: none does)."""
    return next((b for b in SPLASH_BLOCKS if n % b == 0), None)


def splash_mask(lq, lk, *, is_causal, window, chunk_size):
    """The allowed set's static part for one head as a splash mask of shape (Lq, Lk)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as m

    left, right = window
    parts = []
    if chunk_size is not None:
        parts.append(m.ChunkedCausalMask((lq, lk), chunk_size))  # causal within its chunk
    if left is not None or right is not None:
        right = 0 if is_causal else right  # j ≤ i and j ≤ i + right, right ≥ 0
        parts.append(m.LocalMask((lq, lk), (left, right), offset=0))
    elif is_causal and chunk_size is None:
        parts.append(m.CausalMask((lq, lk)))
    if not parts:
        return m.FullMask((lq, lk))
    return functools.reduce(lambda a, b: a & b, parts)


@functools.cache
def kernel(heads, lq, lk, *, is_causal, window, chunk_size, softcap, interpret,
           head_shards=1, q_seq_shards=1):
    """The splash kernel (make_splash_mha) of (H, Lq, Dk), (Hkv, Lk, Dk), (Hkv, Lk, Dv) for
    these static arguments; its mask processed once (host NumPy), kept for later calls."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as k
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as m

    bq, bkv = block(lq // q_seq_shards), block(lk)
    sizes = k.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                         block_kv_dkv=bkv, block_kv_dkv_compute=bkv, use_fused_bwd_kernel=True)
    one = splash_mask(lq, lk, is_causal=is_causal, window=window, chunk_size=chunk_size)
    with jax.ensure_compile_time_eval():  # concrete mask arrays, kept past the trace that asks
        return k.make_splash_mha(m.MultiHeadMask([one] * heads), block_sizes=sizes,
                                 attn_logits_soft_cap=softcap, head_shards=head_shards,
                                 q_seq_shards=q_seq_shards, interpret=interpret)


def _segments(kv_lengths, lq, lk):
    """key_value_seq_lengths (B,) as the kernel's SegmentIds: q (B, Lq) all 1, kv (B, Lk) 1
    before the batch's length and 0 after; None without lengths."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as k

    if kv_lengths is None:
        return None
    kv = (jnp.arange(lk)[None, :] < kv_lengths[:, None]).astype(jnp.int32)  # (B, Lk)
    return k.SegmentIds(jnp.ones(kv.shape[:1] + (lq,), jnp.int32), kv)


def _run(run, q, k, v, q_lengths, kv_lengths, sinks, *, scale, is_causal, window, chunk_size):
    """``run`` (a splash kernel, or one under shard_map) on (B, H, Lq, Dk), (B, Hkv, Lk, D) with
    q scaled first, the batch's segment ids and sinks (H,); empty rows zeroed after."""
    batch, lq, lk = q.shape[0], q.shape[2], k.shape[2]
    kv_lengths = None if kv_lengths is None else jnp.broadcast_to(kv_lengths, (batch,))
    q_lengths = None if q_lengths is None else jnp.broadcast_to(q_lengths, (batch,))
    q = (q.astype(jnp.float32) * scale).astype(q.dtype)  # the kernel has no scale
    out = run(q, k, v, _segments(kv_lengths, lq, lk), sinks)  # (B, H, Lq, Dv)
    return _zero_empty_rows(out, lq, lk, None, q_lengths, kv_lengths, is_causal=is_causal,
                            window=window, chunk=chunk_size)


@partial(jax.jit, static_argnames=("scale", "is_causal", "window", "softcap", "chunk_size"))
def splash(query, key, value, mask=None, bias=None, q_lengths=None, kv_lengths=None,
           sinks=None, *, scale, is_causal, window, softcap=None, chunk_size=None):
    """The "splash" implementation: the kernel vmapped over the batch, interpret mode off a
    TPU. mask, bias, offsets and the rest are refused before (splash_refuses)."""
    del mask, bias
    q, k, v = (_lift(x) for x in (query, key, value))  # (B, H, Lq, Dk), (B, Hkv, Lk, D)
    heads, lq, lk = q.shape[1], q.shape[2], k.shape[2]
    one = kernel(heads, lq, lk, is_causal=is_causal, window=window, chunk_size=chunk_size,
                 softcap=softcap, interpret=jax.default_backend() != "tpu")
    sinks = None if sinks is None else sinks.reshape((heads,))  # (H,)

    def run(q, k, v, segments, sinks):
        return jax.vmap(one, in_axes=(0, 0, 0, 0 if segments is not None else None, None))(
            q, k, v, segments, sinks)

    out = _run(run, q, k, v, q_lengths, kv_lengths, sinks, scale=scale, is_causal=is_causal,
               window=window, chunk_size=chunk_size)
    return out.reshape(query.shape[:-1] + value.shape[-1:])


def sharded(query, key, value, *, mesh, batch_axis=None, head_axis=None, seq_axis=None,
            is_causal=False, scale=None, softcap=None, local_window_size=None,
            attention_chunk_size=None, query_seq_lengths=None, key_value_seq_lengths=None,
            sinks=None):
    """splash on ``mesh`` under ``jax.shard_map``: query (B, H, Lq, Dk), key (B, Hkv, Lk, Dk),
    value (B, Hkv, Lk, Dv), the batch split over mesh axis ``batch_axis``, query and
    key-value heads over ``head_axis``, query rows over ``seq_axis`` (each None: not split;
    keys are never split, the kernel cannot). The kernel is make_splash_mha's with
    ``head_shards`` and ``q_seq_shards`` the sizes of those axes, its mask information laid
    out by its ``manual_sharding_spec``; each device runs it on its batch, heads and rows.
    The other arguments mean what they mean to the core (lengths (B,), sinks (H,)), and what
    "splash" refuses (splash_refuses) is refused here too. Returns (B, H, Lq, Dv), split as
    the query."""
    sizes = {name: 1 if name is None else mesh.shape[name]
             for name in (batch_axis, head_axis, seq_axis)}
    _check_sharded(query, key, value, sizes, batch_axis, head_axis, seq_axis)
    asked = Asked(platform=jax.default_backend(), dtype=jnp.dtype(query.dtype).name,
                  lengths=(query.shape[2], key.shape[2]), causal=bool(is_causal),
                  softcap=softcap is not None, window=window_of(local_window_size),
                  chunk=attention_chunk_size is not None, sinks=sinks is not None,
                  seq_lengths=query_seq_lengths is not None or key_value_seq_lengths is not None)
    reason = splash_refuses(asked)
    if reason:
        raise ValueError(f"splash.sharded cannot run this call: {reason}")
    ran("jax", "splash")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    lengths = [None if x is None else jnp.broadcast_to(jnp.asarray(x, jnp.int32),
                                                       query.shape[:1])
               for x in (query_seq_lengths, key_value_seq_lengths)]
    return _sharded(query, key, value, *lengths, sinks, mesh=mesh,
                    axes=(batch_axis, head_axis, seq_axis), scale=scale,
                    is_causal=bool(is_causal), window=window_of(local_window_size),
                    softcap=None if softcap is None else float(softcap),
                    chunk_size=attention_chunk_size)


def _check_sharded(query, key, value, sizes, batch_axis, head_axis, seq_axis) -> None:
    """ValueError naming the argument when the arrays cannot be split so."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 4:
            raise ValueError(f"{name} should have rank 4, (B, H, L, D), for splash.sharded, "
                             f"got shape {tuple(x.shape)}")
    split = [("B", query.shape[0], batch_axis), ("H", query.shape[1], head_axis),
             ("Hkv", key.shape[1], head_axis), ("Lq", query.shape[2], seq_axis)]
    for letter, n, axis in split:
        if n % sizes[axis]:
            raise ValueError(f"{letter} should be a multiple of the size of mesh axis {axis!r}, "
                             f"{sizes[axis]}, got {n}")
    rows = query.shape[2] // sizes[seq_axis]
    if block(rows) is None:
        raise ValueError(f"Lq / (size of mesh axis {seq_axis!r}) should be a multiple of "
                         f"{SPLASH_BLOCKS[-1]} (each device's rows in whole blocks), got "
                         f"{query.shape[2]} / {sizes[seq_axis]}")


@partial(jax.jit, static_argnames=("mesh", "axes", "scale", "is_causal", "window", "softcap",
                                   "chunk_size"))
def _sharded(query, key, value, q_lengths, kv_lengths, sinks, *, mesh, axes, scale, is_causal,
             window, softcap, chunk_size):
    """One program: the kernel with its mask information split as the arrays, under shard_map."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as k

    batch, head, seq = axes
    lq, lk = query.shape[2], key.shape[2]
    one = kernel(query.shape[1], lq, lk, is_causal=is_causal, window=window,
                 chunk_size=chunk_size, softcap=softcap,
                 interpret=jax.default_backend() != "tpu",
                 head_shards=1 if head is None else mesh.shape[head],
                 q_seq_shards=1 if seq is None else mesh.shape[seq])
    rows, whole = P(batch, head, seq, None), P(batch, head, None, None)  # (B, H, L, D)
    segments = k.SegmentIds(P(batch, seq), P(batch, None))  # (B, Lq), (B, Lk)
    specs = (one.manual_sharding_spec(NamedSharding(mesh, P(head, seq))), rows, whole, whole,
             segments if kv_lengths is not None else None, P(head) if sinks is not None else None)

    def on_device(one, q, k, v, segments, sinks):
        return jax.vmap(one, in_axes=(0, 0, 0, 0 if segments is not None else None, None))(
            q, k, v, segments, sinks)

    def run(q, k, v, segments, sinks):
        args = (one, q, k, v, segments, sinks)
        placed = [x if s is None or x is None else _placed(x, mesh, s)
                  for x, s in zip(args, specs)]
        return jax.shard_map(on_device, mesh=mesh, in_specs=specs, out_specs=rows,
                             check_vma=False)(*placed)  # the kernel declares no varying axes

    return _run(run, query, key, value, q_lengths, kv_lengths, sinks, scale=scale,
                is_causal=is_causal, window=window, chunk_size=chunk_size)


def _placed(x, mesh, spec):
    """x (an array, or a pytree of them: the kernel, segment ids) laid out as ``spec`` says:
    shard_map takes arrays as they come on a mesh of auto axes, on one of explicit axes only
    if they already match."""
    return jax.tree.map(lambda s, a: jax.device_put(a, NamedSharding(mesh, s)), spec, x,
                        is_leaf=lambda s: isinstance(s, P))

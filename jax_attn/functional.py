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

from golden.positions import allowed_terms
from golden.validate import (
    check_attention_args,
    check_flags,
    check_implementation,
    window,
)
from jax_attn import blockwise
from jax_attn.sharding import (
    check_head_sharding,
    explicit_spec,
    heads_as_query,
    on_mesh,
    on_one_device,
)

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
    key, value = (heads_as_query(query, x, spec) for x in (key, value))
    one_device = on_one_device(query, key, value)
    attention = on_mesh(_attention, query, spec, return_weights)
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
    terms = [t for t in [mask] if t is not None] + allowed_terms(
        row, key, pos, is_causal=is_causal, window=window, q_len=q_len, kv_len=kv_len)
    return jnp.broadcast_to(reduce(jnp.logical_and, terms), shape) if terms else None

"""The JAX attention core: written for one head, vmapped over heads and batch, jitted.

Shape legend: B batch, H heads, Lq query length, Lk key length, Dk key width, Dv value width.
Inputs are (B, H, L, D), (H, L, D) or (L, D); masks and biases broadcast to (..., Lq, Lk).
Every dot takes ``precision`` (default HIGHEST: full float32 on GPU and TPU too).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from golden.validate import check_attention_args

DEFAULT_PRECISION = jax.lax.Precision.HIGHEST


def scaled_dot_product_attention(
    query, key, value, mask=None, bias=None, *,
    is_causal=False, scale=None, dropout_rate=0.0, dropout_mask=None, dropout_rng=None,
    return_weights=False, precision=DEFAULT_PRECISION,
):
    """softmax(scale · Q Kᵀ + bias, over allowed keys) V.

    mask: bool, True = may attend; combined with ``is_causal`` (query i sees keys j ≤ i).
    A query row with no allowed key gives zeros in the output and the weights.
    dropout_mask: bool keep-mask (weights kept are scaled by 1/(1 − dropout_rate)); without it,
    one is drawn from ``dropout_rng`` (a ``jax.random`` key), which is then required.
    Returns the output (..., Lq, Dv), and with ``return_weights`` also the applied weights
    (..., Lq, Lk), after masking and dropout, in the query's dtype.
    """
    check_attention_args(query, key, value, mask, bias, scale=scale,
                         dropout_rate=dropout_rate, dropout_mask=dropout_mask)
    if dropout_rate > 0.0 and dropout_mask is None and dropout_rng is None:
        raise ValueError("dropout_rng should be a jax.random key when dropout_rate > 0 and no "
                         "dropout_mask is given, got None")
    if dropout_rate == 0.0:
        dropout_rng = None
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    out, weights = _attention(query, key, value, mask, bias, dropout_mask, dropout_rng,
                              scale=scale, is_causal=bool(is_causal),
                              dropout_rate=float(dropout_rate), precision=precision,
                              return_weights=bool(return_weights),
                              chunk=heads_per_step(query.shape, key.shape))
    return (out, weights) if return_weights else out


# Heads per step on CPU: the one-head core is vmapped over chunks of this many (batch, head)
# pairs and the chunks run in sequence (``lax.map(..., batch_size=...)``), so one chunk's scores
# stay in cache; about twice as fast as one vmap over every head on a 2-core CPU once the scores
# of all pairs together are large (B=4, H=8, L=512: 9.8 ms against 20 ms). Below about 8 MiB of
# float32 scores one vmap is as fast or faster (B=4, H=8, L=128: 1.05 ms against 1.16 ms) and
# compiles in half the time, so chunks start at CPU_CHUNK_MIN_SCORES score elements.
# Accelerators take the plain vmap over heads and batch.
CPU_HEADS_PER_STEP = 2
CPU_CHUNK_MIN_SCORES = 2**21


def heads_per_step(q_shape, k_shape):
    """The chunk size for these shapes on the default backend (None: one vmap over all)."""
    scores = math.prod(q_shape[:-1]) * k_shape[-2]  # (..., Lq, Lk) elements
    large = scores >= CPU_CHUNK_MIN_SCORES and math.prod(q_shape[:-2]) > CPU_HEADS_PER_STEP
    return CPU_HEADS_PER_STEP if jax.default_backend() == "cpu" and large else None


@partial(jax.jit, static_argnames=("scale", "is_causal", "dropout_rate", "precision",
                                   "return_weights", "chunk"))
def _attention(query, key, value, mask, bias, keep, rng, *,
               scale, is_causal, dropout_rate, precision, return_weights, chunk=None):
    """Lift to (B, H, ...), vmap the one-head core over H and B, drop the added axes."""
    lead = query.shape[:-2]
    shape = lead + (query.shape[-2], key.shape[-2])  # (..., Lq, Lk)
    if dropout_rate > 0.0 and keep is None:
        keep = jax.random.bernoulli(rng, 1.0 - dropout_rate, shape)
    q, k, v = (_lift(x) for x in (query, key, value))  # (B, H, L, D)
    extras = tuple(None if x is None else _lift(x) for x in (mask, bias, keep))  # (B|1, H|1, ...)

    def one(q, k, v, *extras):  # the weights leave the core only when asked for
        out, weights = _one_head(q, k, v, *extras, scale=scale, is_causal=is_causal,
                                 dropout_rate=dropout_rate, precision=precision)
        return (out, weights) if return_weights else (out, None)

    run = _vmap_all if chunk is None else partial(_vmap_chunks, chunk=chunk)
    out, weights = run(one, q, k, v, extras)  # (B, H, Lq, Dv), (B, H, Lq, Lk)
    return out.reshape(lead + out.shape[-2:]), (weights.reshape(shape) if return_weights else None)


def _lift(x):
    """(…, L, D) -> (B|1, H|1, L, D): missing leading axes become size 1."""
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _vmap_all(one, q, k, v, extras):
    """vmap over H, then over B; size-1 B or H axes of the extras are not mapped."""
    axes = [(None, None) if x is None else (0 if x.shape[0] > 1 else None,
                                            0 if x.shape[1] > 1 else None) for x in extras]
    squeezed = [None if x is None else x.reshape(
        tuple(n for i, n in enumerate(x.shape) if i > 1 or n > 1)) for x in extras]
    per_head = jax.vmap(one, in_axes=(0, 0, 0) + tuple(a[1] for a in axes))
    per_batch = jax.vmap(per_head, in_axes=(0, 0, 0) + tuple(a[0] for a in axes))
    return per_batch(q, k, v, *squeezed)


def _vmap_chunks(one, q, k, v, extras, chunk):
    """The B·H (batch, head) pairs, ``chunk`` at a time: vmapped within, sequential across."""
    b, h = q.shape[:2]

    def pair(args):  # one (batch, head) pair g = i·H + j; extras are indexed, never copied
        qg, kg, vg, g = args
        i, j = g // h, g % h
        picked = [None if x is None else x[i if x.shape[0] > 1 else 0, j if x.shape[1] > 1 else 0]
                  for x in extras]
        return one(qg, kg, vg, *picked)

    flat = tuple(x.reshape((b * h,) + x.shape[2:]) for x in (q, k, v))  # (B·H, L, D)
    out, weights = jax.lax.map(pair, flat + (jnp.arange(b * h),), batch_size=chunk)
    unflat = lambda x: None if x is None else x.reshape((b, h) + x.shape[1:])  # noqa: E731
    return unflat(out), unflat(weights)


def _one_head(q, k, v, mask, bias, keep, *, scale, is_causal, dropout_rate, precision):
    """One head: q (Lq, Dk), k (Lk, Dk), v (Lk, Dv); mask, bias, keep broadcast to (Lq, Lk)."""
    compute = jnp.promote_types(q.dtype, jnp.float32)  # softmax in at least float32
    scores = scale * jnp.einsum("qd,kd->qk", q, k, precision=precision,
                                preferred_element_type=compute)  # (Lq, Lk)
    if bias is not None:
        scores = scores + bias.astype(compute)
    allowed = mask
    if is_causal:
        causal = jnp.tril(jnp.ones(scores.shape, dtype=bool))  # j <= i
        allowed = causal if allowed is None else allowed & causal
    if allowed is None:
        weights = jax.nn.softmax(scores, axis=-1)
    else:
        allowed = jnp.broadcast_to(allowed, scores.shape)
        filled = jnp.where(allowed, scores, jnp.finfo(compute).min)
        weights = jax.nn.softmax(filled, axis=-1)
        if mask is not None:  # only a mask can empty a row (a causal row keeps key 0): zero it
            weights = weights * allowed.any(axis=-1, keepdims=True)
    if dropout_rate > 0.0:
        weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    weights = weights.astype(q.dtype)
    out = jnp.einsum("qk,kv->qv", weights, v, precision=precision,
                     preferred_element_type=compute)  # (Lq, Dv)
    return out.astype(q.dtype), weights

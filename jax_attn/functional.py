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
    shape = check_attention_args(query, key, value, mask, bias, scale=scale,
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
                              return_weights=bool(return_weights))
    return (out, weights) if return_weights else out


@partial(jax.jit, static_argnames=("scale", "is_causal", "dropout_rate", "precision",
                                   "return_weights"))
def _attention(query, key, value, mask, bias, keep, rng, *,
               scale, is_causal, dropout_rate, precision, return_weights):
    """Lift to (B, H, ...), vmap the one-head core over H then B, drop the added axes."""
    lead = query.shape[:-2]
    shape = lead + (query.shape[-2], key.shape[-2])  # (..., Lq, Lk)
    if dropout_rate > 0.0 and keep is None:
        keep = jax.random.bernoulli(rng, 1.0 - dropout_rate, shape)
    q, k, v = (x.reshape((1,) * (4 - x.ndim) + x.shape) for x in (query, key, value))
    extras, axes = zip(*(_split_broadcast(x) for x in (mask, bias, keep)))
    one = partial(_one_head, scale=scale, is_causal=is_causal, dropout_rate=dropout_rate,
                  precision=precision)
    per_head = jax.vmap(one, in_axes=(0, 0, 0) + tuple(a[1] for a in axes))
    per_batch = jax.vmap(per_head, in_axes=(0, 0, 0) + tuple(a[0] for a in axes))
    out, weights = per_batch(q, k, v, *extras)  # (B, H, Lq, Dv), (B, H, Lq, Lk)
    out, weights = out.reshape(lead + out.shape[-2:]), weights.reshape(shape)
    return out, (weights if return_weights else None)


def _split_broadcast(x):
    """Lift x to rank 4 and drop its size-1 B and H axes; return it with its vmap axes."""
    if x is None:
        return None, (None, None)
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)  # (B|1, H|1, Lq|1, Lk|1)
    b_ax, h_ax = (0 if x.shape[0] > 1 else None), (0 if x.shape[1] > 1 else None)
    return x.reshape(tuple(n for i, n in enumerate(x.shape) if i > 1 or n > 1)), (b_ax, h_ax)


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
        weights = jax.nn.softmax(filled, axis=-1) * allowed.any(axis=-1, keepdims=True)
    if dropout_rate > 0.0:
        weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    weights = weights.astype(q.dtype)
    out = jnp.einsum("qk,kv->qv", weights, v, precision=precision,
                     preferred_element_type=compute)  # (Lq, Dv)
    return out.astype(q.dtype), weights

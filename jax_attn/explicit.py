"""The JAX core's "explicit" implementation for one head: the (Lq, Lk) weights formed (scores
and softmax in at least float32), then the weighted sum of values; JAX differentiates it.
jax_attn.functional vmaps it over heads and batch.

Shape legend: Lq query length, Lk key length, Dk key width, Dv value width.
"""

from __future__ import annotations

from functools import reduce

import jax
import jax.numpy as jnp

from golden.positions import allowed_terms, distance_terms

NO_WINDOW = (None, None)


def attend(q, k, v, mask, bias, dropout_mask, rng, offset, q_lengths, kv_lengths, sink=None,
           distance_bias=None, *, static):
    """One head: q (Lq, Dk), k (Lk, Dk), v (Lk, Dv); mask, bias, dropout_mask broadcast to
    (Lq, Lk); offset, q_lengths, kv_lengths scalars or None; sink the head's sink logit (a
    scalar) or None; distance_bias (2S + 1,) or None, the bias of each key − query distance
    (formed here as an (Lq, Lk) bias); ``static`` a blockwise.Static (its blocks unused). rng
    is unused: a drawn dropout mask comes in as ``dropout_mask``.
    Returns (output (Lq, Dv), weights (Lq, Lk)) in q's dtype."""
    del rng
    compute = jnp.promote_types(q.dtype, jnp.float32)  # softmax in at least float32
    scores = static.scale * jnp.einsum("qd,kd->qk", q, k, precision=static.precision,
                                       preferred_element_type=compute)  # (Lq, Lk)
    if static.softcap is not None:  # after scaling, before bias and masks
        scores = static.softcap * jnp.tanh(scores / static.softcap)
    if bias is not None:
        scores = scores + bias.astype(compute)
    if distance_bias is not None:
        key = jnp.arange(k.shape[0])[None, :]  # (1, Lk)
        pos = jnp.arange(q.shape[0])[:, None] + (0 if offset is None else offset)  # (Lq, 1)
        scores = scores + distance_terms(distance_bias.astype(compute), key, pos)
    allowed = _allowed(scores.shape, mask, offset, q_lengths, kv_lengths,
                       is_causal=static.is_causal, window=static.window,
                       chunk=static.chunk_size)
    if sink is not None:
        weights = _sink_softmax(scores, allowed, sink.astype(compute))
    elif allowed is None:
        weights = jax.nn.softmax(scores, axis=-1)
    else:
        filled = jnp.where(allowed, scores, jnp.finfo(compute).min)  # finite: no NaN anywhere
        weights = jax.nn.softmax(filled, axis=-1)
        if not _causal_only(mask, offset, q_lengths, kv_lengths, static.window,
                            static.chunk_size):
            weights = weights * allowed.any(axis=-1, keepdims=True)  # empty rows give zeros
    if static.dropout_rate > 0.0:
        weights = jnp.where(dropout_mask, weights / (1.0 - static.dropout_rate), 0.0)
    weights = weights.astype(q.dtype)
    out = jnp.einsum("qk,kv->qv", weights, v, precision=static.precision,
                     preferred_element_type=compute)  # (Lq, Dv)
    return out.astype(q.dtype), weights


def _sink_softmax(scores, allowed, sink):
    """softmax([S, s])[:, :-1] over the allowed keys and the sink logit s (GPT-OSS): masked
    entries are exactly 0, a row with no allowed key gives zeros."""
    if allowed is not None:
        scores = jnp.where(allowed, scores, jnp.finfo(scores.dtype).min)
    column = jnp.broadcast_to(sink, scores.shape[:1] + (1,))  # (Lq, 1)
    weights = jax.nn.softmax(jnp.concatenate([scores, column], axis=-1), axis=-1)[:, :-1]
    return weights if allowed is None else jnp.where(allowed, weights, 0.0)


def _causal_only(mask, offset, q_lengths, kv_lengths, window, chunk=None):
    """Whether causality alone restricts the keys: every row then keeps key 0, none is empty."""
    return mask is None and offset is None and q_lengths is None and kv_lengths is None and (
        window == NO_WINDOW) and chunk is None


def _allowed(shape, mask, offset, q_lengths, kv_lengths, *, is_causal, window, chunk=None):
    """Where query row i, at position i + offset, may attend key j (position j): bool (Lq, Lk),
    or None when every key is allowed."""
    row = jnp.arange(shape[0])[:, None]  # (Lq, 1)
    key = jnp.arange(shape[1])[None, :]  # (1, Lk)
    pos = row if offset is None else row + offset  # (Lq, 1)
    terms = [t for t in [mask] if t is not None] + allowed_terms(
        row, key, pos, is_causal=is_causal, window=window, chunk=chunk, q_lengths=q_lengths,
        kv_lengths=kv_lengths)
    return jnp.broadcast_to(reduce(jnp.logical_and, terms), shape) if terms else None

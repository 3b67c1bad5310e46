"""The JAX core's "sparse" implementation for one head: attention over the keys each query row
chose, with a backward of its own; jax_attn.functional vmaps it over heads and batch.

DeepSeek-V3.2's lightning indexer (and GLM-5's, Mistral Large 4's, ...) gives every query row k
keys, ``key_indices``; the dense implementations read it as the boolean mask it stands for
(``selected_mask``). "sparse" gathers only those k keys and values per row, applies the other
rules at the gathered positions (causal, window, chunks, lengths, the mask gathered there:
``allowed``), adds the bias gathered there, takes the softmax over the k scores (scale,
soft-cap, sinks) and their weighted sum. The query rows go in blocks of Bq (``lax.map``); the
forward saves the output and each row's log-sum-exp, and the backward (``jax.custom_vjp``)
recomputes each block's gathered keys, values and probabilities from them (``lax.scan``),
scattering dK and dV back to the keys read. Memory O(Lq·k) (the indices, the allowed set, the
gathered bias) plus one block's gathered keys and values (Bq·k·D): never an (Lq, Lk) array.
Vmapped over a kv head's G query heads with key, value and a shared selection not mapped, the
gather is one per kv head. The indices are sorted per row first and a repeat of an index is
masked after its first occurrence, so a repeated index counts once (the mask's meaning); an
index outside [0, Lk), which golden.specification.validate refuses where it can read it (not
under jit), chooses nothing.

Shape legend: Lq query length, Lk key length, k keys chosen per row, Bq rows per block,
Nq = ⌈Lq / Bq⌉ blocks, Dk key width, Dv value width.
"""

from __future__ import annotations

from functools import partial, reduce

import jax
import jax.numpy as jnp
from jax import lax

from golden.specification.positions import allowed_terms
from jax_attn.explicit import _widened, wide_products

# Rows per block when block_sizes is None: as many as keep one block's chosen keys (Bq·k) near
# BLOCK_ELEMENTS, at least one and at most Lq. Measured once on the 2-core AMD EPYC at L = 8192,
# k = 2048, D = 64: 4, 8 and 16 rows within 5 % of each other (one head's forward 0.45 s, 16
# heads on one kv head 0.98 s at 8 rows), 64 and 128 rows 40-50 % slower.
BLOCK_ELEMENTS = 2**14


def default_rows(lq, selected) -> int:
    """Bq when block_sizes is None: BLOCK_ELEMENTS // k rows, within 1 … Lq."""
    return max(1, min(lq, BLOCK_ELEMENTS // selected))


def selected_mask(key_indices, mask, lk):
    """key_indices (..., Lq, k) as the boolean (..., Lq, Lk) it stands for (row i's entry j True
    when j is one of key_indices[..., i, :]; an index outside [0, Lk) chooses nothing), ANDed
    with ``mask`` (None: alone)."""
    indices = jnp.asarray(key_indices)
    rows = indices.reshape(-1, indices.shape[-1])  # (N, k), N = every row of every head
    rows = jnp.where((rows >= 0) & (rows < lk), rows, lk)  # lk: dropped below
    chosen = jnp.zeros((rows.shape[0], lk), dtype=bool)
    chosen = chosen.at[jnp.arange(rows.shape[0])[:, None], rows].set(True, mode="drop")
    chosen = chosen.reshape(indices.shape[:-1] + (lk,))
    return chosen if mask is None else mask & chosen


def attend(q, k, v, mask, bias, dropout_mask, rng, offset, q_lengths, kv_lengths, sink=None,
           distance_bias=None, distance_query=None, distance_keys=None, *, static,
           key_indices):
    """One kv head's G query heads at once (the registry's ``grouped``): q (G, Lq, Dk), k (Lk,
    Dk), v (Lk, Dv), key_indices (G|1, Lq, k) integers; mask and bias (G|1, Lq|1, Lk|1),
    gathered at the chosen keys; offset, q_lengths, kv_lengths (1,) int or None; sink (G,) or
    None; ``static`` a jax_attn.blockwise.Static (block_q: the rows per block; block_k
    unused). A selection shared by the G heads is gathered once for all of them (their scores
    one batched product per block, their key and value gradients summed before one scatter);
    a selection per head runs each head alone (vmapped). Dropout and the distance terms are
    refused (jax_attn.functional). Returns (the output (G, Lq, Dv) in q's dtype, None): the
    weights are never formed."""
    del dropout_mask, rng, distance_bias, distance_query, distance_keys  # refused
    offset, q_lengths, kv_lengths = (None if x is None else x.reshape(())
                                     for x in (offset, q_lengths, kv_lengths))
    if key_indices.shape[0] > 1:  # a selection per head: nothing shared to gather once
        def head(q_h, i_h, m_h, b_h, s_h):  # one head, its arrays with a leading axis of 1
            return _group(static, q_h[None], k, v, i_h[None], m_h, b_h,
                          None if s_h is None else s_h[None], offset, q_lengths, kv_lengths)[0]

        def split(x):  # (G|1, ...): a head's slice keeps a leading axis of 1
            return (x, None) if x is None or x.shape[0] == 1 else (x[:, None], 0)
        (mask, m_axis), (bias, b_axis) = split(mask), split(bias)
        return jax.vmap(head, in_axes=(0, 0, m_axis, b_axis, None if sink is None else 0))(
            q, key_indices, mask, bias, sink), None
    return _group(static, q, k, v, key_indices, mask, bias, sink, offset, q_lengths,
                  kv_lengths), None


def _group(st, q, k, v, key_indices, mask, bias, sink, offset, q_lengths, kv_lengths):
    """G heads sharing one selection key_indices (1, Lq, k): mask and bias (G|1, Lq|1, Lk|1);
    the output (G, Lq, Dv). Inside, rows come first: (Lq, G, ...)."""
    lk = k.shape[0]
    indices = jnp.sort(key_indices[0].astype(jnp.int32), axis=-1)  # (Lq, k)
    allowed = _allowed(st, indices, mask, offset, q_lengths, kv_lengths, lk)  # (Lq, G|1, k)
    indices = jnp.clip(indices, 0, lk - 1)  # an index out of range is not allowed, above
    gathered = None
    if bias is not None:  # (Lq, G|1, k): JAX differentiates the gather (a scatter into bias)
        rows = jnp.broadcast_to(bias, bias.shape[:1] + (indices.shape[0], bias.shape[-1]))
        gathered = rows if bias.shape[-1] == 1 else jnp.take_along_axis(
            rows, jnp.broadcast_to(indices, rows.shape[:1] + indices.shape), axis=-1)
        gathered = jnp.moveaxis(jnp.broadcast_to(
            gathered, gathered.shape[:1] + indices.shape), 0, 1)
    out = _sparse(st, jnp.moveaxis(q, 0, 1), k, v, indices, allowed, gathered, sink)
    return jnp.moveaxis(out, 1, 0)


def _allowed(st, indices, mask, offset, q_lengths, kv_lengths, lk):
    """Where row i may attend its chosen key indices[i, t]: bool (Lq, G|1, k) (G|1 the mask's
    heads), a repeat after its first occurrence and an index outside [0, Lk) excluded."""
    row = jnp.arange(indices.shape[0])[:, None]  # (Lq, 1)
    first = jnp.concatenate([jnp.ones_like(indices[:, :1], dtype=bool),
                             indices[:, 1:] != indices[:, :-1]], axis=-1)  # sorted rows
    terms = [first, indices >= 0, indices < lk] + allowed_terms(
        row, indices, row if offset is None else row + offset, is_causal=st.is_causal,
        window=st.window, chunk=st.chunk_size, q_lengths=q_lengths, kv_lengths=kv_lengths)
    rule = jnp.broadcast_to(reduce(jnp.logical_and, terms), indices.shape)[:, None, :]
    if mask is None:
        return rule
    rows = jnp.broadcast_to(mask, mask.shape[:1] + (indices.shape[0], mask.shape[-1]))
    if mask.shape[-1] > 1:
        safe = jnp.clip(indices, 0, lk - 1)
        rows = jnp.take_along_axis(rows, jnp.broadcast_to(safe, rows.shape[:1] + safe.shape),
                                   axis=-1)
    return rule & jnp.moveaxis(rows, 0, 1)  # (Lq, G|1, k)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sparse(st, q, k, v, indices, allowed, bias, sink):
    return _forward(st, q, k, v, indices, allowed, bias, sink)[0]


def _sparse_fwd(st, q, k, v, indices, allowed, bias, sink):
    out, lse = _forward(st, q, k, v, indices, allowed, bias, sink)
    return out, (q, k, v, indices, allowed, bias, sink, out, lse)


def _blocks(st, x, fill):
    """x (Lq, ...) as (Nq, Bq, ...), the last block padded with ``fill``."""
    rows = min(st.block_q, x.shape[0])
    count = -(-x.shape[0] // rows)
    pad = [(0, count * rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
    x = jnp.pad(x, pad, constant_values=fill)
    return x.reshape((count, rows) + x.shape[1:])


def _einsum(spec, *operands, **kw):
    """``jnp.einsum`` of operands whose axis ``g`` (the heads, second) may have size 1: then
    without that axis (a size-1 axis between the rows and the keys makes XLA:CPU copy the
    scores into another layout, twice as slow for one head), put back on the result."""
    ins, out = spec.split("->")
    ins = ins.split(",")
    if not any("g" in i and o.shape[i.index("g")] == 1 for i, o in zip(ins, operands)):
        return jnp.einsum(spec, *operands, **kw)
    flat = [o.reshape(o.shape[:i.index("g")] + o.shape[i.index("g") + 1:]) if "g" in i else o
            for i, o in zip(ins, operands)]
    r = jnp.einsum(",".join(i.replace("g", "") for i in ins) + "->" + out.replace("g", ""),
                   *flat, **kw)
    return jnp.expand_dims(r, out.index("g")) if "g" in out else r


def _scores(st, q_b, keys, bias_b, compute):
    """(raw scale · q·k (Bq, G, k), the scores after the cap and the bias) of one block: one
    product batched over the block's rows, the G heads its rows."""
    raw = st.scale * _einsum("rgd,rkd->rgk", *_widened(wide_products(q_b.dtype), q_b, keys),
                                precision=st.precision, preferred_element_type=compute)
    scores = raw if st.softcap is None else st.softcap * jnp.tanh(raw / st.softcap)
    return raw, scores if bias_b is None else scores + bias_b.astype(compute)


def _forward(st, q, k, v, indices, allowed, bias, sink):
    """q (Lq, G, Dk): (output (Lq, G, Dv) in q's dtype, each row's log-sum-exp (Lq, G), +inf
    for a row with nothing allowed and no sink): the blocks one after another."""
    compute = jnp.promote_types(q.dtype, jnp.float32)  # softmax in at least float32
    wide = wide_products(q.dtype)
    sink_c = None if sink is None else sink.astype(compute)  # (G,)

    def block(args):
        q_b, i_b, a_b, bias_b = args  # (Bq, G, Dk), (Bq, k), (Bq, G|1, k), (Bq, G|1, k)|None
        keys, values = k[i_b], v[i_b]  # (Bq, k, Dk), (Bq, k, Dv): the one gather
        _, s = _scores(st, q_b, keys, bias_b, compute)  # (Bq, G, k)
        m = jnp.max(jnp.where(a_b, s, -jnp.inf), axis=-1)  # (Bq, G)
        if sink_c is not None:
            m = jnp.maximum(m, sink_c)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        e = jnp.where(a_b, jnp.exp(jnp.where(a_b, s - m[..., None], 0.0)), 0.0)
        total = e.sum(axis=-1) + (0.0 if sink_c is None else jnp.exp(sink_c - m))
        p = e / jnp.where(total > 0, total, 1.0)[..., None]
        out = _einsum("rgk,rkv->rgv", *_widened(wide, p.astype(q.dtype), values),
                         precision=st.precision, preferred_element_type=compute)
        lse = jnp.where(total > 0, m + jnp.log(jnp.where(total > 0, total, 1.0)), jnp.inf)
        return out.astype(q.dtype), lse

    args = (_blocks(st, q, 0), _blocks(st, indices, 0), _blocks(st, allowed, False),
            None if bias is None else _blocks(st, bias, 0))
    out, lse = lax.map(block, args)  # (Nq, Bq, G, Dv), (Nq, Bq, G)
    lq = q.shape[0]
    return out.reshape((-1,) + out.shape[2:])[:lq], lse.reshape((-1,) + lse.shape[2:])[:lq]


def _sparse_bwd(st, res, d_out):
    """Each block's probabilities again from the saved log-sum-exp, P = exp(S − lse) where
    allowed; dP = dO·Vᵀ at the chosen keys, dS = P ⊙ (dP − Σ P ⊙ dP) (the bias's gradient at
    those keys), through the cap to dR; dQ per block; the chosen keys' and values' gradients
    summed over the G heads (one product each), then scattered onto the keys read (in at least
    float32); the sink's −Σ_rows p_sink Σ P ⊙ dP."""
    q, k, v, indices, allowed, bias, sink, out, lse = res
    compute = jnp.promote_types(q.dtype, jnp.float32)
    wide = wide_products(q.dtype)

    def block(carry, args):
        dk, dv, dsink = carry
        q_b, i_b, a_b, bias_b, do_b, lse_b = args
        keys, values = k[i_b], v[i_b]  # (Bq, k, Dk), (Bq, k, Dv)
        raw, s = _scores(st, q_b, keys, bias_b, compute)  # (Bq, G, k)
        p = jnp.where(a_b, jnp.exp(jnp.where(a_b, s - lse_b[..., None], 0.0)), 0.0)
        dp = _einsum("rgv,rkv->rgk", *_widened(wide, do_b, values), precision=st.precision,
                        preferred_element_type=compute)
        row = (p * dp).sum(axis=-1)  # Σ P ⊙ dP (Bq, G)
        ds = p * (dp - row[..., None])  # dL/dS, the bias's gradient
        d_raw = ds if st.softcap is None else ds * (1.0 - jnp.tanh(raw / st.softcap) ** 2)
        dq_b = st.scale * _einsum("rgk,rkd->rgd", d_raw, keys.astype(compute),
                                     precision=st.precision)
        d_keys = st.scale * _einsum("rgk,rgd->rkd", d_raw, q_b.astype(compute),
                                       precision=st.precision)  # (Bq, k, Dk), heads summed
        d_values = _einsum("rgk,rgv->rkv", p.astype(q.dtype).astype(compute),
                              do_b.astype(compute), precision=st.precision)
        dk, dv = dk.at[i_b].add(d_keys), dv.at[i_b].add(d_values)
        if sink is not None:
            dsink = dsink - (jnp.exp(sink.astype(compute) - lse_b) * row).sum(axis=0)
        if bias_b is not None and bias_b.shape[1] == 1:  # a bias shared by the G heads
            ds = ds.sum(axis=1, keepdims=True)
        return (dk, dv, dsink), (dq_b, ds)

    args = (_blocks(st, q, 0), _blocks(st, indices, 0), _blocks(st, allowed, False),
            None if bias is None else _blocks(st, bias, 0), _blocks(st, d_out, 0),
            _blocks(st, lse, jnp.inf))
    heads = q.shape[1:2]
    start = (jnp.zeros(k.shape, compute), jnp.zeros(v.shape, compute),
             jnp.zeros(heads, compute))
    (dk, dv, dsink), (dq, dbias) = lax.scan(block, start, args)
    lq = q.shape[0]
    dq = dq.reshape((-1,) + dq.shape[2:])[:lq].astype(q.dtype)
    dbias = None if bias is None else dbias.reshape((-1,) + dbias.shape[2:])[:lq].astype(
        bias.dtype)
    dsink = None if sink is None else dsink.astype(sink.dtype).reshape(sink.shape)
    return (dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None, dbias, dsink)


_sparse.defvjp(_sparse_fwd, _sparse_bwd)

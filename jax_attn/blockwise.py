"""Blockwise (flash) attention for one head, with its own backward (FlashAttention-2's recipe).

Shape legend: Lq query length, Lk key length, Dk key width, Dv value width, Bq and Bk the query
and key block sizes, Nq = ⌈Lq / Bq⌉ and Nk = ⌈Lk / Bk⌉ the block counts, Lq' = Nq·Bq and
Lk' = Nk·Bk the padded lengths.

The forward takes the query blocks one after another (``lax.map``) and, for each, runs over only
the key blocks it may see, found by index from the causal bound, the window, the chunks of
attention_chunk_size and the lengths (a block wholly outside is never read), keeping a running
maximum m, sum l and accumulator acc (online softmax), which start from the head's sink logit
when there is one (m = sink, l = 1, acc = 0: it joins the denominator and takes no value; its
gradient comes from the saved statistics, ``sink_grad``). It saves the output and each row's m
and 1 / l (the log-sum-exp m + log l, in two parts); the backward recomputes each block's
probabilities from them, key block by key block (``lax.scan``, dK and dV per key block, dQ
carried whole), over the query blocks that can see it; when the positions are static (no
offset, no lengths) and (Lq', Lk') has at most UNROLL_AT_MOST entries, the backward's loops are
unrolled at trace time instead (straight-line code runs faster on XLA:CPU than a loop body,
docs/performance.md). Neither pass forms (Lq, Lk): memory is
O(L·D + Bq·Bk). Blocks whose every entry the positional rules allow take a body without the mask
(unless a ``mask`` or drawn dropout is given); blocks on a boundary are masked. mask, bias and
dropout_mask stay as broadcast as they came, (Lq|1, Lk|1), and are sliced per block.

The pieces are public for ``jax_attn.ring``, which runs them on each block of keys that reaches
a device: ``Head.make`` (one head, padded), ``start``, ``accumulate`` and ``finish`` (the
forward's running state, its update by a block of keys, the output and statistics),
``backward``, ``sink_grad`` (a sink's gradient from the statistics) and ``visited`` (how many
blocks the forward computes).
"""

from __future__ import annotations

from functools import partial, reduce
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from golden.specification.positions import allowed_terms, distance_index
from golden.specification.validate import check_block_sizes

# The largest query and key blocks when block_sizes is None: measured on a CPU (forward and
# forward + backward, several block shapes and lengths): docs/performance.md.
DEFAULT_BLOCK_SIZES = (1024, 1024)


def sizes(block_sizes):
    """(Bq, Bk): ``block_sizes`` checked, DEFAULT_BLOCK_SIZES for None."""
    return check_block_sizes(block_sizes) or DEFAULT_BLOCK_SIZES


class Static(NamedTuple):
    """The compile-time configuration of the blockwise core (hashable)."""

    scale: float
    is_causal: bool
    softcap: float | None
    window: tuple  # (left, right), each None (unbounded) or an int ≥ 0
    dropout_rate: float
    precision: Any
    block_q: int
    block_k: int
    chunk_size: int | None = None  # attention_chunk_size C: key j // C = position // C


def attend(q, k, v, mask, bias, dropout_mask, rng, offset, q_lengths, kv_lengths, sink=None,
           distance_bias=None, distance_query=None, distance_keys=None, *, static):
    """One head: q (Lq, Dk), k (Lk, Dk), v (Lk, Dv); mask, bias, dropout_mask broadcastable to
    (Lq, Lk) with size-1 axes kept; rng a key (drawn dropout) or None; offset, q_lengths, kv_lengths
    int scalars or None; sink the head's sink logit (a scalar) or None; distance_bias
    (2S + 1,) or None, the bias of each key − query distance, gathered block by block (ALiBi's
    and T5's biases in O(L) memory); distance_query (Lq, Dr) and distance_keys (2S + 1, Dr) or
    None, the term distance_query[i] · distance_keys[S + j − p_i] of R, inside the cap (the
    relative positions': Transformer-XL's, the USM Conformer's), each block's from the Bq + Bk
    − 1 distances it spans (``_band``). Returns (the output (Lq, Dv)
    in q's dtype, None): the weights are never formed."""
    return _flash(fitted(static, q.shape[0], k.shape[0]), q, k, v, mask, bias, dropout_mask,
                  rng, offset, q_lengths, kv_lengths, sink, distance_bias, distance_query,
                  distance_keys), None


def fit(length, block):
    """The block size actually used: at most ``block``, the fewest blocks, split evenly
    (L = 1500 with 1024 takes two blocks of 750, not 1024 and a padded 476)."""
    return _cdiv(length, _cdiv(length, block))


def fitted(st, lq, lk):
    """``st`` with its blocks fitted to (Lq, Lk) (``fit``), as ``attend`` runs them."""
    return st._replace(block_q=fit(lq, st.block_q), block_k=fit(lk, st.block_k))


def head_forward(st, q, k, v, mask, bias, dropout_mask, rng, offset, q_lengths, kv_lengths, sink,
                 distance_bias, distance_query=None, distance_keys=None):
    """One head's output in q's dtype and its statistics (2, Lq) (``_forward``), ``st`` fitted:
    _flash's forward, and jax_attn.explicit.attend_split's when it takes blockwise's."""
    out, stats = _forward(st, Head.make(st, q, k, v, mask, bias, dropout_mask, rng, offset,
                                        q_lengths, kv_lengths, distance_bias=distance_bias,
                                        distance_query=distance_query,
                                        distance_keys=distance_keys), sink)
    return out.astype(q.dtype), stats


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st, *args):
    return head_forward(st, *args)[0]


def _flash_fwd(st, *args):
    out, stats = head_forward(st, *args)
    return out, args + (out, stats)


def flash_bwd(st, res, d_out):
    """The gradients of _flash's differentiable arguments from its residuals (the arguments,
    the output and the statistics; jax_attn.explicit.attend_split saves the same)."""
    (q, k, v, mask, bias, dropout_mask, rng, offset, q_lengths, kv_lengths, sink, distance_bias,
     distance_query, distance_keys, out, stats) = res
    h = Head.make(st, q, k, v, mask, bias, dropout_mask, rng, offset, q_lengths, kv_lengths,
                  distance_bias=distance_bias, distance_query=distance_query,
                  distance_keys=distance_keys)
    dq, dk, dv, dbias, (ddistance, dquery, dkeys) = backward(st, h, out, stats, d_out)
    if bias is not None:
        dbias = dbias[:bias.shape[0], :bias.shape[1]].astype(bias.dtype)  # (Lq|1, Lk|1)
    cast = lambda g, x: None if x is None else g.astype(x.dtype)  # noqa: E731
    dquery = None if distance_query is None else dquery[:q.shape[0]]
    dsink = None if sink is None else sink_grad(st, sink, out, stats, d_out).astype(sink.dtype)
    grads = tuple(g.astype(x.dtype) for g, x in ((dq, q), (dk, k), (dv, v)))
    return grads + (None, dbias, None, None, None, None, None, dsink,
                    cast(ddistance, distance_bias), cast(dquery, distance_query),
                    cast(dkeys, distance_keys))


_flash.defvjp(_flash_fwd, flash_bwd)


# ---- the padded head and its positional rules ---------------------------------------------------

class Head(NamedTuple):
    """One head padded to whole blocks, in the compute dtype (at least float32)."""

    q: jax.Array  # (Lq', Dk), times scale / c (c the softcap, 1 without): R / c = q kᵀ
    k: jax.Array  # (Lk', Dk)
    v: jax.Array  # (Lk', Dv)
    mask: jax.Array | None  # (Lq'|1, Lk'|1) bool, padded with False
    bias: jax.Array | None  # (Lq'|1, Lk'|1), padded with 0
    dropout_mask: jax.Array | None  # (Lq'|1, Lk'|1) bool, padded with False
    rng: jax.Array | None
    offset: Any  # the first query's position: int scalar
    q_lengths: Any  # rows at or past it attend nothing (query_seq_lengths), or None
    kv_lengths: Any  # keys at or past it are never attended: min(Lk, kv_lengths)
    lq: int  # the unpadded lengths
    lk: int
    key_start: Any = 0  # the absolute position of key 0 (jax_attn.ring), for the chunks
    distance_bias: jax.Array | None = None  # (2S + 1,): the bias at key − query distance d is
    # entry S + clip(d, −S, S), gathered per block (golden.specification.positions.distance_terms)
    distance_query: jax.Array | None = None  # (Lq', Dr), padded with 0, and
    distance_keys: jax.Array | None = None  # (2S + 1, Dr): the term distance_query[i] ·
    # distance_keys[S + clip(j − p_i, −S, S)] of R (inside the cap), each block's from its band
    # of distances (_band)

    @classmethod
    def make(cls, st, q, k, v, mask, bias, dropout_mask, rng, offset, q_lengths, kv_lengths,
             key_start=0, distance_bias=None, distance_query=None, distance_keys=None):
        compute = jnp.promote_types(q.dtype, jnp.float32)
        lq, lk = q.shape[0], k.shape[0]
        rows, cols = _padding(lq, st.block_q), _padding(lk, st.block_k)
        pad = lambda x, fill: None if x is None else jnp.pad(  # noqa: E731  (size 1 stays 1)
            x, ((0, rows if x.shape[0] > 1 else 0), (0, cols if x.shape[1] > 1 else 0)),
            constant_values=fill)
        q = jnp.pad(q.astype(compute) * (st.scale / (st.softcap or 1.0)), ((0, rows), (0, 0)))
        k, v = (jnp.pad(x.astype(compute), ((0, cols), (0, 0))) for x in (k, v))
        kv_lengths = lk if kv_lengths is None else jnp.minimum(kv_lengths, lk)
        return cls(q, k, v, pad(mask, False), pad(None if bias is None else bias.astype(compute),
                                                  0), pad(dropout_mask, False), rng,
                   0 if offset is None else offset, q_lengths, kv_lengths, lq, lk, key_start,
                   None if distance_bias is None else distance_bias.astype(compute),
                   None if distance_query is None else jnp.pad(
                       distance_query.astype(compute), ((0, rows), (0, 0))),
                   None if distance_keys is None else distance_keys.astype(compute))


def _padding(length, block):
    """How many rows pad ``length`` to a whole number of blocks."""
    return -length % block


def _cdiv(a, b):
    """⌈a / b⌉ for integer scalars (traced or not), b > 0."""
    return -(-a // b)


def _key_blocks(st, h, i):
    """The key blocks query block i visits, [lo, hi), and among them [a, b), those whose every
    entry the positional rules allow (None when _split is False)."""
    xp = _xp(h, i)
    left, right = st.window
    r0 = i * st.block_q
    last = xp.minimum(r0 + st.block_q,
                       h.lq if h.q_lengths is None else xp.minimum(h.q_lengths, h.lq))
    p0, p1 = r0 + h.offset, last - 1 + h.offset  # positions of its first and last valid rows
    c, ks = st.chunk_size, h.key_start
    first = _max(xp, 0, None if left is None else p0 - left,
                 None if c is None else chunk_first(p0, c, ks))
    final = _min(xp, h.kv_lengths - 1, p1 if st.is_causal else None,
                 None if right is None else p1 + right,
                 None if c is None else chunk_last(p1, c, ks))  # the last key any row may see
    lo = first // st.block_k
    hi = xp.where(last > r0, xp.maximum(lo, final // st.block_k + 1), lo)
    if not _split(st, h):
        return _int32(xp, lo, None, None, hi)
    q_end = r0 + st.block_q - 1 + h.offset  # every row of the block, padding included
    full_first = _max(xp, 0, None if left is None else q_end - left,
                      None if c is None else chunk_first(q_end, c, ks))
    full_final = _min(xp, h.kv_lengths - 1, p0 if st.is_causal else None,
                      None if right is None else p0 + right,
                      None if c is None else chunk_last(p0, c, ks))  # the last key every row sees
    a = xp.clip(_cdiv(full_first, st.block_k), lo, hi)
    b = xp.clip((full_final + 1) // st.block_k, a, hi)
    if h.q_lengths is not None:  # rows past the length need the mask
        a, b = (xp.where(r0 + st.block_q <= h.q_lengths, x, hi) for x in (a, b))
    return _int32(xp, lo, a, b, hi)


def _query_blocks(st, h, j):
    """The query blocks that see some key of key block j, [lo, hi), and among them [a, b),
    those whose every entry the positional rules allow (None when _split is False)."""
    xp = _xp(h, j)
    left, right = st.window
    c, ks = st.chunk_size, h.key_start
    c0 = j * st.block_k
    c1 = xp.minimum(c0 + st.block_k, h.kv_lengths) - 1  # its last valid key
    row_lo = _max(xp, 0, c0 - h.offset if st.is_causal else None,
                  None if right is None else c0 - right - h.offset,
                  None if c is None else chunk_first(c0, c, ks) - h.offset)
    row_hi = _min(xp, h.lq - 1, None if h.q_lengths is None else h.q_lengths - 1,
                  None if left is None else c1 + left - h.offset,
                  None if c is None else chunk_last(c1, c, ks) - h.offset)
    lo = row_lo // st.block_q
    hi = xp.where((c1 >= c0) & (row_hi >= row_lo), xp.maximum(lo, row_hi // st.block_q + 1), lo)
    if not _split(st, h):
        return _int32(xp, lo, None, None, hi)
    c_end = c0 + st.block_k - 1  # every key of the block, padding included
    full_lo = _max(xp, 0, c_end - h.offset if st.is_causal else None,
                   None if right is None else c_end - right - h.offset,
                   None if c is None else chunk_first(c_end, c, ks) - h.offset)
    full_hi = _min(xp, None if h.q_lengths is None else h.q_lengths - 1,
                   None if left is None else c0 + left - h.offset,
                   None if c is None else chunk_last(c0, c, ks) - h.offset)  # None: unbounded
    a = xp.clip(_cdiv(full_lo, st.block_q), lo, hi)
    b = xp.clip(hi if full_hi is None else (full_hi + 1) // st.block_q, a, hi)
    a, b = (xp.where(c_end < h.kv_lengths, x, hi) for x in (a, b))  # padded keys need the mask
    return _int32(xp, lo, a, b, hi)


def chunk_first(p, c, ks):
    """The first key (relative to key_start ks) in the chunk of C tokens of position p."""
    return (p + ks) // c * c - ks


def chunk_last(p, c, ks):
    """The last key (relative to key_start ks) in the chunk of C tokens of position p."""
    return ((p + ks) // c + 1) * c - 1 - ks


def _split(st, h):
    """Whether some blocks can skip the mask: not with a ``mask`` (any block may hold a False),
    nor with drawn dropout (the random bits cost far more than the mask, and each loop body
    compiles its own copy of the generator)."""
    return h.mask is None and not (st.dropout_rate > 0.0 and h.dropout_mask is None)


# The backward's loops over blocks are unrolled when the blocks they visit are known at trace time
# (static positions) and the padded (Lq', Lk') has at most UNROLL_AT_MOST entries: at L <= 1024
# (implementation=None's split passes) XLA:CPU runs the blocks faster as straight-line code than
# as a while loop's body; at L = 2048-4096, with blocks of 1024, the loops were as fast or faster
# (docs/performance.md, "Why the thresholds are where they are").
UNROLL_AT_MOST = 2**20


def _xp(h, index):
    """NumPy when the block index and h's positions are Python ints (the loop bounds are then
    known at trace time and the loops unrolled: _loops), else jax.numpy."""
    static = all(x is None or isinstance(x, int) for x in
                 (index, h.offset, h.q_lengths, h.kv_lengths, h.key_start))
    return np if static else jnp


def _int32(xp, *xs):
    """Loop bounds as int32 scalars (under x64 too), None kept; Python ints when known."""
    if xp is np:
        return tuple(None if x is None else int(x) for x in xs)
    return tuple(None if x is None else jnp.asarray(x, jnp.int32) for x in xs)


def _min(xp, *xs):
    """The least of the bounds given (None: no bound); None when none is given."""
    xs = [x for x in xs if x is not None]
    return reduce(xp.minimum, xs) if xs else None


def _max(xp, *xs):
    """The greatest of the bounds given (None: no bound)."""
    return reduce(xp.maximum, [x for x in xs if x is not None])


def _allowed(st, h, i, j, mask):
    """Where rows of query block i may attend keys of key block j: bool (Bq, Bk)."""
    left, right = st.window
    row = i * st.block_q + lax.broadcasted_iota(jnp.int32, (st.block_q, 1), 0)  # (Bq, 1)
    key = j * st.block_k + lax.broadcasted_iota(jnp.int32, (1, st.block_k), 1)  # (1, Bk)
    pos = row + h.offset
    terms = [t for t in [mask] if t is not None] + allowed_terms(
        row, key, pos, is_causal=st.is_causal, window=(left, right), chunk=st.chunk_size,
        q_lengths=h.q_lengths, kv_lengths=h.kv_lengths, key_start=h.key_start)
    allowed = reduce(jnp.logical_and, terms)
    return jnp.broadcast_to(allowed, (st.block_q, st.block_k))


def _distances(st, i, j, h):
    """The table entries of query block i against key block j: int32 (Bq, Bk)
    (golden.specification.positions.distance_index)."""
    row = i * st.block_q + lax.broadcasted_iota(jnp.int32, (st.block_q, 1), 0)  # (Bq, 1)
    key = j * st.block_k + lax.broadcasted_iota(jnp.int32, (1, st.block_k), 1)  # (1, Bk)
    return distance_index(h.distance_bias.shape[0], key, row + h.offset)


def _block_bias(st, h, i, j, bias_ij):
    """The block's (bias, position term): the bias (Bq|1, Bk|1) or (Bq, Bk), ``bias`` sliced
    plus the distance bias gathered at its distances, added after the cap; the distance
    product (``_band``) (Bq, Bk), part of R (inside the cap); each None when not given."""
    terms = [t for t in (bias_ij,) if t is not None]
    if h.distance_bias is not None:
        terms.append(h.distance_bias[_distances(st, i, j, h)])  # (Bq, Bk)
    term = None
    if h.distance_query is not None:
        rows, keys, columns = _band(st, h, i, j)
        products = jnp.einsum("qd,td->qt", _rows(h.distance_query, i, st.block_q), keys,
                              precision=st.precision)  # (Bq, Bq + Bk − 1)
        term = jnp.take_along_axis(products, columns, axis=1)  # (Bq, Bk)
    return (reduce(jnp.add, terms) if terms else None), term


def _band(st, h, i, j):
    """The distances query block i spans against key block j: key c0 + b − query position
    r0 + a + offset = d0 + (b − a + Bq − 1), d0 = c0 − (r0 + Bq − 1 + offset), so Bq + Bk − 1
    consecutive ones. Returns their table rows (Bq + Bk − 1,) int32 (clipped to −S … S), the
    table's vectors there (Bq + Bk − 1, Dr), and each entry's column in the band (Bq, Bk),
    b − a + Bq − 1 (static): a block's products are (Bq, Bq + Bk − 1), never (Bq, 2S + 1)."""
    d0 = j * st.block_k - (i * st.block_q + st.block_q - 1 + h.offset)
    band = d0 + lax.broadcasted_iota(jnp.int32, (st.block_q + st.block_k - 1,), 0)
    rows = distance_index(h.distance_keys.shape[0], band, 0)
    columns = np.arange(st.block_k)[None, :] - np.arange(st.block_q)[:, None] + st.block_q - 1
    return rows, h.distance_keys[rows], jnp.asarray(columns, jnp.int32)


def _band_grads(st, h, i, j, ds, dquery, dkeys):
    """The distance product's gradients from the block's dR (Bq, Bk) (the product is part of
    R, inside the cap; dR = dS without one), named ds below: the band's dP (Bq,
    Bq + Bk − 1) (dS at each entry's column), then dquery's rows of block i += dP · keys and
    dkeys at the band's rows += dPᵀ · query (clipped distances summed into their end)."""
    rows, keys, columns = _band(st, h, i, j)
    d_products = jnp.zeros((st.block_q, keys.shape[0]), ds.dtype).at[
        np.arange(st.block_q)[:, None], columns].add(ds)
    q_i = _rows(h.distance_query, i, st.block_q)
    dq_i = _rows(dquery, i, st.block_q) + jnp.einsum("qt,td->qd", d_products, keys,
                                                    precision=st.precision)
    dquery = lax.dynamic_update_slice_in_dim(dquery, dq_i, i * st.block_q, axis=0)
    dkeys = dkeys.at[rows].add(jnp.einsum("qt,qd->td", d_products, q_i, precision=st.precision))
    return dquery, dkeys


# ---- per-block slices and scores ----------------------------------------------------------------

def _rows(x, i, size):
    """Block i of x's first axis (kept whole when it has size 1)."""
    if x is None or x.shape[0] == 1:
        return x
    return lax.dynamic_slice_in_dim(x, i * size, size, axis=0)


def _cols(x, j, size):
    """Block j of x's second axis (kept whole when it has size 1)."""
    if x is None or x.shape[1] == 1:
        return x
    return lax.dynamic_slice_in_dim(x, j * size, size, axis=1)


def _scores(st, q_i, k_j, biases):
    """Softcapped, biased scores of a block (Bq, Bk) in the compute dtype (q_i pre-scaled);
    ``biases`` _block_bias's (bias, position term), the term part of R."""
    bias_ij, term = biases
    s = jnp.einsum("qd,kd->qk", q_i, k_j, precision=st.precision,
                   preferred_element_type=q_i.dtype)  # R / c
    if term is not None:  # the relative positions' term, inside the cap
        s = s + term / (st.softcap or 1.0)
    if st.softcap is not None:  # after scaling, before bias and masks
        s = st.softcap * jnp.tanh(s)
    return s if bias_ij is None else s + bias_ij


def _dropout_mask(st, h, i, j, dropout_ij):
    """The block's dropout mask (Bq|1, Bk|1) or (Bq, Bk) drawn from (rng, i, j); None without
    dropout."""
    if st.dropout_rate == 0.0:
        return None
    if dropout_ij is not None:
        return dropout_ij
    key = jax.random.fold_in(jax.random.fold_in(h.rng, i), j)
    return jax.random.bernoulli(key, 1.0 - st.dropout_rate, (st.block_q, st.block_k))


def _dropped(st, p, dropout_mask):
    """p · dropout_mask / (1 − rate): the weights applied to V."""
    return p if dropout_mask is None else jnp.where(dropout_mask, p / (1.0 - st.dropout_rate), 0.0)


def _loops(ranges, masked, plain, carry):
    """Run ``masked`` over the blocks [lo, a) and [b, hi), ``plain`` over [a, b); ``masked``
    over all of [lo, hi) when a and b are None; unrolled when the bounds are Python ints."""
    lo, a, b, hi = ranges
    if isinstance(lo, int):  # known at trace time (_xp)
        if a is None:
            a = b = hi
        for i in range(lo, hi):
            carry = (plain if a <= i < b else masked)(i, carry)
        return carry
    if a is None:
        return lax.fori_loop(lo, hi, masked, carry)
    carry = lax.fori_loop(lo, a, masked, carry)
    carry = lax.fori_loop(a, b, plain, carry)
    return lax.fori_loop(b, hi, masked, carry)


# ---- forward ------------------------------------------------------------------------------------

def _forward(st, h, sink=None):
    """The output (Lq, Dv) in the compute dtype and each row's softmax statistics (2, Lq): its
    largest score m and 1 / l, l = Σ exp(s − m) (the log-sum-exp m + log l kept in two parts, so
    that the backward's exp(s − m) / l is as exact as the forward's at large logits). Rows that
    attend nothing have m = the dtype's largest finite number and 1 / l = 0, so p = 0. With a
    ``sink`` logit, m and l count it too (a row that attends nothing has m = sink, l = 1).
    """
    state = accumulate(st, h, start(st, h.lq, h.v.shape[1], h.q.dtype, sink))
    return finish(st, state, h.lq)


def start(st, lq, dv, dtype, sink=None):
    """The running state (m, l, acc) of Lq query rows before any key, per query block:
    m (Nq, Bq) at the dtype's least finite number (so that exp(−inf − m) = 0, never
    −inf − (−inf)), l (Nq, Bq) and acc (Nq, Bq, Dv) at 0. With a ``sink`` logit (a scalar) the
    softmax starts from it: m = sink, l = 1 (its exp(sink − m)), acc 0 (it takes no value); a
    sink of −inf is no sink (m stays finite, l = 0)."""
    n_q = _cdiv(lq, st.block_q)
    acc = jnp.zeros((n_q, st.block_q, dv), dtype)
    m = jnp.full((n_q, st.block_q), jnp.finfo(dtype).min, dtype)
    if sink is None:
        return m, jnp.zeros((n_q, st.block_q), dtype), acc
    m = jnp.maximum(m, sink.astype(dtype))
    return m, jnp.exp(sink.astype(dtype) - m), acc


def accumulate(st, h, state):
    """The running state (m, l, acc) of every query block after h's keys (online softmax):
    query blocks one after another, each over only the key blocks it may see. The ring
    (jax_attn.ring) calls it once per block of keys that reaches the device."""
    dt = h.q.dtype
    n_q = h.q.shape[0] // st.block_q

    def query_block(args):
        i, carry = args
        q_i = _rows(h.q, i, st.block_q)  # (Bq, Dk)
        mask_i, bias_i, dropout_i = (_rows(x, i, st.block_q)
                                     for x in (h.mask, h.bias, h.dropout_mask))

        def step(j, carry, masked):
            m, total, acc = carry  # running max, running sum l, accumulator: (Bq,), (Bq,), (Bq, Dv)
            k_j, v_j = _rows(h.k, j, st.block_k), _rows(h.v, j, st.block_k)
            s = _scores(st, q_i, k_j, _block_bias(st, h, i, j, _cols(bias_i, j, st.block_k)))
            if masked:  # exp(−inf − m) = 0: m starts finite, so never −inf − (−inf)
                s = jnp.where(_allowed(st, h, i, j, _cols(mask_i, j, st.block_k)), s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.exp(s - m_new[:, None])
            alpha = jnp.exp(m - m_new)
            a = _dropped(st, p, _dropout_mask(st, h, i, j, _cols(dropout_i, j, st.block_k)))
            acc = alpha[:, None] * acc + jnp.einsum("qk,kv->qv", a, v_j, precision=st.precision,
                                                    preferred_element_type=dt)
            return m_new, alpha * total + p.sum(axis=1), acc

        return _loops(_key_blocks(st, h, i), partial(step, masked=True),
                      partial(step, masked=False), carry)

    return lax.map(query_block, (jnp.arange(n_q, dtype=jnp.int32), state))


def finish(st, state, lq):
    """The output (Lq, Dv) and statistics (2, Lq) of _forward from the final running state."""
    m, total, acc = state  # (Nq, Bq), (Nq, Bq), (Nq, Bq, Dv)
    empty = total == 0.0  # a row with no allowed key: zeros, never NaN
    inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, total))  # 1 / l
    out = inv[..., None] * acc  # (Nq, Bq, Dv)
    stats = jnp.stack([jnp.where(empty, jnp.finfo(m.dtype).max, m), inv])  # (2, Nq, Bq)
    return out.reshape(-1, out.shape[-1])[:lq], stats.reshape(2, -1)[:, :lq]


def visited(st, h):
    """How many (Bq, Bk) blocks ``accumulate`` computes for h: the key blocks each query
    block visits, summed (an int32 scalar); blocks skipped by index do not count."""
    n_q = h.q.shape[0] // st.block_q
    ranges = jax.vmap(lambda i: _key_blocks(st, h, i))(jnp.arange(n_q, dtype=jnp.int32))
    return jnp.sum(ranges[-1] - ranges[0])


# ---- backward -----------------------------------------------------------------------------------

def backward(st, h, out, stats, d_out):
    """dQ (Lq, Dk), dK (Lk, Dk), dV (Lk, Dv) in the compute dtype, dbias (Lq'|1, Lk'|1) or
    None, and the distance terms' (d(distance_bias) (2S + 1,), d(distance_query) (Lq', Dr),
    d(distance_keys) (2S + 1, Dr), each None when not given). Each block is taken transposed,
    (Bk, Bq), so
    that dK and dV, summed over queries, are plain products (on CPU a product contracting both
    operands' first axes runs at a third of the speed); dQ is accumulated transposed,
    (Dk, Lq'), for the same reason."""
    dt = h.q.dtype
    rows = h.q.shape[0] - h.lq
    d_out = jnp.pad(d_out.astype(dt), ((0, rows), (0, 0)))  # (Lq', Dv)
    delta = jnp.einsum("qv,qv->q", d_out[:h.lq], out.astype(dt), precision=st.precision,
                       preferred_element_type=dt)  # D = rowsum(dO ⊙ O)
    delta = jnp.pad(delta, (0, rows))  # (Lq',)
    m = jnp.pad(stats[0], (0, rows), constant_values=jnp.finfo(dt).max)  # padded rows: p = 0
    inv = jnp.pad(stats[1], (0, rows))  # (Lq',): 1 / l
    n_k = h.k.shape[0] // st.block_k

    def key_block(carry, j):
        k_j, v_j = _rows(h.k, j, st.block_k), _rows(h.v, j, st.block_k)  # (Bk, Dk), (Bk, Dv)
        mask_j, bias_j, dropout_j = (_cols(x, j, st.block_k)
                                     for x in (h.mask, h.bias, h.dropout_mask))

        def step(i, c, masked):
            dq_t, dbias, (ddistance, dquery, dkeys), dk_j, dv_j = c  # (Dk, Lq'), ..., (Bk, Dk)
            q_i, do_i = _rows(h.q, i, st.block_q), _rows(d_out, i, st.block_q)
            bias_ij, term = _block_bias(st, h, i, j, _rows(bias_j, i, st.block_q))
            s_t, capped_t = _scores_t(st, q_i, k_j, None if bias_ij is None else bias_ij.T,
                                      None if term is None else term.T)
            p_t = jnp.exp(s_t - _rows(m, i, st.block_q)) * _rows(inv, i, st.block_q)  # (Bk, Bq)
            if masked:
                p_t = jnp.where(_allowed(st, h, i, j, _rows(mask_j, i, st.block_q)).T, p_t, 0.0)
            dropout_mask = _dropout_mask(st, h, i, j, _rows(dropout_j, i, st.block_q))
            dropout_t = None if dropout_mask is None else dropout_mask.T
            dv_j = dv_j + jnp.einsum("kq,qv->kv", _dropped(st, p_t, dropout_t), do_i,
                                     precision=st.precision, preferred_element_type=dt)
            dp_t = _dropped(st, jnp.einsum("kv,qv->kq", v_j, do_i, precision=st.precision,
                                           preferred_element_type=dt), dropout_t)
            ds_t = p_t * (dp_t - _rows(delta, i, st.block_q)[None, :])  # dL/dS
            dr_t = ds_t if capped_t is None else ds_t * (1.0 - capped_t * capped_t)  # dL/dR
            dk_j = dk_j + jnp.einsum("kq,qd->kd", dr_t, q_i, precision=st.precision,
                                     preferred_element_type=dt)  # q_i holds scale / c · q
            dq_i = _cols(dq_t, i, st.block_q) + jnp.einsum(
                "kd,kq->dq", k_j, dr_t, precision=st.precision, preferred_element_type=dt)
            dq_t = lax.dynamic_update_slice_in_dim(dq_t, dq_i, i * st.block_q, axis=1)
            if ddistance is not None:  # dS summed into each distance's entry
                ddistance = ddistance.at[_distances(st, i, j, h).T].add(ds_t)
            if dquery is not None:  # the product is part of R: its gradient is dR
                dquery, dkeys = _band_grads(st, h, i, j, dr_t.T, dquery, dkeys)
            return (dq_t, _add_bias_grad(st, dbias, ds_t.T, i, j), (ddistance, dquery, dkeys),
                    dk_j, dv_j)

        dq_t, dbias, dpos = carry
        init = (dq_t, dbias, dpos, jnp.zeros_like(k_j), jnp.zeros_like(v_j))
        dq_t, dbias, dpos, dk_j, dv_j = _loops(
            _query_blocks(st, h, j), partial(step, masked=True), partial(step, masked=False),
            init)
        return (dq_t, dbias, dpos), (dk_j, dv_j)

    dbias, *dpos = (None if x is None else jnp.zeros_like(x) for x in
                    (h.bias, h.distance_bias, h.distance_query, h.distance_keys))
    carry = (jnp.zeros_like(h.q.T), dbias, tuple(dpos))
    if _xp(h, 0) is np and h.q.shape[0] * h.k.shape[0] <= UNROLL_AT_MOST:  # unrolled
        parts = []
        for j in range(n_k):
            carry, part = key_block(carry, j)
            parts.append(part)
        dq_t, dbias, dpos = carry
        dk, dv = (jnp.stack(x) for x in zip(*parts))
    else:
        (dq_t, dbias, dpos), (dk, dv) = lax.scan(
            key_block, carry, jnp.arange(n_k, dtype=jnp.int32))
    flat = lambda x: x.reshape(-1, x.shape[-1])[:h.lk]  # noqa: E731  (Nk, Bk, D) -> (Lk, D)
    return (st.scale * dq_t.T[:h.lq], (st.softcap or 1.0) * flat(dk), flat(dv), dbias, dpos)


def sink_grad(st, sink, out, stats, d_out):
    """dL/d(sink) of one head, a scalar in the statistics' dtype: each row's −p_sink Σ_j P_j g_j
    (g = dL/dP), where Σ_j P_j g_j = D = rowsum(dO ⊙ O) as in the backward and p_sink =
    exp(sink − m) / l from the saved statistics, summed over the rows (padded and empty rows
    have O = 0, so D = 0)."""
    dt = stats.dtype
    delta = jnp.einsum("qv,qv->q", d_out.astype(dt), out.astype(dt), precision=st.precision,
                       preferred_element_type=dt)
    p_sink = jnp.exp(sink.astype(dt) - stats[0]) * stats[1]  # (Lq,)
    return -jnp.sum(p_sink * delta)


def _scores_t(st, q_i, k_j, bias_t, term_t=None):
    """The block's scores transposed (Bk, Bq), as _scores, and tanh(R / c) transposed."""
    s_t = jnp.einsum("kd,qd->kq", k_j, q_i, precision=st.precision,
                     preferred_element_type=q_i.dtype)  # R / c
    if term_t is not None:  # the relative positions' term, inside the cap
        s_t = s_t + term_t / (st.softcap or 1.0)
    capped = None
    if st.softcap is not None:
        capped = jnp.tanh(s_t)
        s_t = st.softcap * capped
    return (s_t if bias_t is None else s_t + bias_t), capped


def _add_bias_grad(st, dbias, ds, i, j):
    """dbias (Lq'|1, Lk'|1) plus the block's dS (Bq, Bk) summed over the bias's size-1 axes."""
    if dbias is None:
        return None
    ds = ds.sum(axis=tuple(a for a in (0, 1) if dbias.shape[a] == 1), keepdims=True)
    starts = tuple(jnp.int32(0 if n == 1 else start * size) for n, start, size in
                   zip(dbias.shape, (i, j), (st.block_q, st.block_k)))  # int32 under x64 too
    block = lax.dynamic_slice(dbias, starts, ds.shape)
    return lax.dynamic_update_slice(dbias, block + ds, starts)

"""The JAX core's "explicit" implementation for one head: the (Lq, Lk) weights formed (scores
and softmax in at least float32), then the weighted sum of values; JAX differentiates it.
jax_attn.functional vmaps it over heads and batch.

Shape legend: Lq query length, Lk key length, Dk key width, Dv value width.
"""

from __future__ import annotations

from functools import partial, reduce

import jax
import jax.numpy as jnp
from jax import lax

from golden.specification.implementations import ran, ran_instead
from golden.specification.positions import allowed_terms, distance_index, distance_terms
from jax_attn import blockwise

NO_WINDOW = (None, None)


def attend(q, k, v, mask, bias, dropout_mask, rng, offset, q_lengths, kv_lengths, sink=None,
           distance_bias=None, distance_query=None, distance_keys=None, *, static):
    """One head: q (Lq, Dk), k (Lk, Dk), v (Lk, Dv); mask, bias, dropout_mask broadcast to
    (Lq, Lk); offset, q_lengths, kv_lengths scalars or None; sink the head's sink logit (a
    scalar) or None; distance_bias (2S + 1,) or None, the bias of each key − query distance
    (formed here as an (Lq, Lk) bias); distance_query (Lq, Dr) and distance_keys (2S + 1, Dr)
    or None, the term distance_query[i] · distance_keys[S + j − p_i] of R, inside the cap
    (the (Lq, 2S + 1) products formed, each key's gathered); ``static`` a blockwise.Static
    (its blocks unused). rng is unused: a drawn dropout mask comes in as ``dropout_mask``.
    Where the causal bound, the window or the chunks leave each block of query rows a narrower
    range of keys (fixed at trace time: no ``offset``), the rows are taken in tiles of 128 to
    256, each against its keys only (``tiles``), and the weights outside are zeros: causal
    attention at L = 1024 then forms 62.5 % of the scores.
    Returns (output (Lq, Dv), weights (Lq, Lk)) in q's dtype."""
    del rng
    return _attend(static, q, k, v, mask, bias, dropout_mask, offset, q_lengths, kv_lengths,
                   sink, distance_bias, distance_query, distance_keys)


@partial(jax.custom_jvp, nondiff_argnums=(0,))
def _attend(static, *args):
    """``attend``'s (output, weights). Not differentiated, a float32 or float64 output is the
    product of the unnormalised exponentials with V divided by each row's sum (at B=4, H=8,
    L = 128 one XLA:CPU program 1.5-1.8x faster than the weights' product; the same speed at
    the other shapes measured: docs/performance.md). Differentiated (forward or reverse mode),
    it is the weights' product and JAX's derivative of it: its gradients are the more accurate
    (large logits: 10x closer to the float64 reference), and the two outputs differ by rounding
    only."""
    return _tiled(*args, static, divide_last=True)[:2]


@_attend.defjvp
def _attend_jvp(static, primals, tangents):
    return jax.jvp(lambda *args: _tiled(*args, static, divide_last=False)[:2], primals,
                   tangents)


def _tiled(q, k, v, mask, bias, dropout_mask, offset, q_lengths, kv_lengths, sink,
           distance_bias, distance_query, distance_keys, static, *, divide_last):
    """(output (Lq, Dv), weights (Lq, Lk), statistics (2, Lq)) of ``attend``, tile by tile;
    the statistics are each row's largest score m and 1 / l, l = Σ exp(s − m), in the format
    of jax_attn.blockwise (a row with no allowed key: m = the largest finite number, 1 / l = 0;
    a sink counted in both). ``divide_last``: a float32 or float64 output as (exp(S − m) V) / l
    instead of (exp(S − m) / l) V (``_attend``)."""
    found = tiles(q.shape[0], k.shape[0], offset, static)
    parts = [_attend_tile(q[a:b], k[lo:hi], v[lo:hi],
                          *(_slice(x, a, b, lo, hi) for x in (mask, bias, dropout_mask)),
                          offset, q_lengths, kv_lengths, sink, distance_bias,
                          None if distance_query is None else distance_query[a:b], distance_keys,
                          row0=a, key0=lo, static=static, divide_last=divide_last)
             for a, b, lo, hi in found]
    lk = k.shape[0]
    if found == [(0, q.shape[0], 0, lk)]:
        return parts[0]
    out = jnp.concatenate([o for o, _, _ in parts], axis=0)
    weights = jnp.concatenate([jnp.pad(w, ((0, 0), (lo, lk - hi)))
                               for (_, w, _), (_, _, lo, hi) in zip(parts, found)], axis=0)
    stats = jnp.concatenate([st for _, _, st in parts], axis=1)
    return out, weights, stats


def attend_split(q, k, v, mask, bias, dropout_mask, rng, offset, q_lengths, kv_lengths,
                 sink=None, distance_bias=None, distance_query=None, distance_keys=None, *,
                 static, passes=("explicit", "explicit")):
    """``attend``'s output, differentiated with jax_attn.blockwise's backward (each block's
    probabilities recomputed from the row statistics a forward saves) instead of JAX's
    derivative of this program: the same function, the faster pass each way on a CPU
    (docs/performance.md). ``passes``: (the forward that runs when the call is not
    differentiated, the forward whose statistics the backward reads), each "explicit" (this
    module's, its backward in the blocks of ``backward_blocks`` over only the keys its tiles
    see) or "blockwise" (jax_attn.blockwise's, its backward in ``static``'s blocks); the two
    differ only by rounding. jax_attn.functional picks them: ``forward_passes``. A custom_vjp:
    reverse mode only (jax.jvp and jax.jacfwd need implementation="explicit"). A drawn dropout
    mask is explicit's (``dropout_mask``): with dropout and no mask, both passes are explicit.
    Returns (output, None)."""
    if static.dropout_rate > 0.0 and dropout_mask is None and passes != ("explicit",) * 2:
        raise ValueError(f"passes should be ('explicit', 'explicit') when dropout is drawn, "
                         f"got {passes!r}")
    del rng  # a drawn dropout mask comes in as dropout_mask
    return _split(static, tuple(passes), q, k, v, mask, bias, dropout_mask, None, offset,
                  q_lengths, kv_lengths, sink, distance_bias, distance_query,
                  distance_keys), None


# The backward's blocks when attend_split differentiates explicit's forward
# (``backward_blocks``): measured on a CPU at B=4, H=8, D=64, L = 512 and 1024, causal and not
# (docs/performance.md, "Why the thresholds are where they are").
BACKWARD_BLOCK_K = 512
BACKWARD_BLOCK_Q = (256, 512)  # the least and most query rows: half the length between them


def backward_blocks(lq, lk):
    """(Bq, Bk) for attend_split's backward: query blocks of half the rows, 256 to 512 (as
    blockwise.fit spreads them), key blocks of at most 512."""
    least, most = BACKWARD_BLOCK_Q
    return (blockwise.fit(lq, min(most, max(least, lq // 2))),
            blockwise.fit(lk, BACKWARD_BLOCK_K))


def _forward(st, name, q, k, v, mask, bias, dropout_mask, rng, offset, q_lengths, kv_lengths,
             sink, distance_bias, distance_query, distance_keys, *, differentiated):
    """(output in q's dtype, statistics (2, Lq)) of implementation ``name``'s forward: both
    in jax_attn.blockwise's format. explicit's output is the weights' product when
    ``differentiated``, divided last when not, as in ``_attend``."""
    if name == "explicit":
        out, _, stats = _tiled(q, k, v, mask, bias, dropout_mask, offset, q_lengths,
                               kv_lengths, sink, distance_bias, distance_query, distance_keys,
                               st, divide_last=not differentiated)
        return out, stats
    return blockwise.head_forward(blockwise.fitted(st, q.shape[0], k.shape[0]), q, k, v, mask,
                                  bias, dropout_mask, rng, offset, q_lengths, kv_lengths, sink,
                                  distance_bias, distance_query, distance_keys)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _split(st, passes, *args):
    return _forward(st, passes[0], *args, differentiated=False)[0]


def _split_fwd(st, passes, *args):
    out, stats = _forward(st, passes[1], *args, differentiated=True)
    if passes[1] != passes[0]:  # this forward, not the one functional noted
        ran_instead("jax", passes[1], passes[0])
    if passes[1] != "blockwise":
        ran("jax", "blockwise")  # the backward
    return out, args + (out, stats)


def _split_bwd(st, passes, res, d_out):
    """blockwise's backward. After explicit's forward, over only the keys some tile sees, the
    first ``hi`` (with static positions row 0 sees key 0, so they start at 0): the others'
    gradients are zeros (causal Lq = 256 of Lk = 1024 needs a quarter of the keys)."""
    q, k, v, mask, bias, dropout_mask = res[:6]
    lq, lk = q.shape[0], k.shape[0]
    if passes[1] == "blockwise":
        return blockwise.flash_bwd(blockwise.fitted(st, lq, lk), res, d_out)
    hi = max(end for *_, end in tiles(lq, lk, res[7], st))
    over_keys = bias is not None and bias.shape[-1] > 1  # (Lq|1, Lk): its gradient too
    if hi < lk:  # the positions, lengths and chunks count from key 0 still
        res = (q, k[:hi], v[:hi]) + tuple(_slice(x, 0, lq, 0, hi) for x in
                                          (mask, bias, dropout_mask)) + res[6:]
    block_q, block_k = backward_blocks(lq, hi)
    grads = blockwise.flash_bwd(st._replace(block_q=block_q, block_k=block_k), res, d_out)
    if hi == lk:
        return grads
    dq, dk, dv, dmask, dbias = grads[:5]
    dk, dv = (jnp.pad(x, ((0, lk - hi), (0, 0))) for x in (dk, dv))
    if over_keys:  # zeros past hi
        dbias = jnp.pad(dbias, ((0, 0), (0, lk - hi)))
    return (dq, dk, dv, dmask, dbias) + grads[5:]


_split.defvjp(_split_fwd, _split_bwd)


# The query rows per tile when tiling pays (``tiles``): a quarter of Lq, at least and at most
# these, measured on a CPU at B=4, H=8, L = 512 and 1024 (docs/performance.md, "Why the
# thresholds are where they are"); TILED_AT_MOST: the share of the (Lq, Lk) scores the tiles
# may cover for tiling to be used.
TILE_ROWS = (128, 256)
TILED_AT_MOST = 0.8


def tiles(lq, lk, offset, static):
    """[(first row, end row, first key, end key)]: the query rows in tiles of about Lq / 4
    rows, within TILE_ROWS (128 to 256), each with the keys the positional rules can let it
    see, known at trace time; one tile [(0, Lq, 0, Lk)] when the positions are traced (an
    offset), no rule bounds the keys, or the tiles would cover more than TILED_AT_MOST of the
    scores."""
    whole = [(0, lq, 0, lk)]
    left, right = static.window
    bounded = static.is_causal or left is not None or right is not None or (
        static.chunk_size is not None)
    if offset is not None or not bounded:
        return whole
    least, most = TILE_ROWS
    count = max(1, round(lq / min(most, max(least, lq // 4))))
    edges = [lq * i // count for i in range(count + 1)]
    found = []
    for a, b in zip(edges[:-1], edges[1:]):  # rows a .. b - 1 at positions a .. b - 1
        lo, hi = 0, lk
        if static.is_causal:
            hi = min(hi, b)
        if right is not None:
            hi = min(hi, b + right)
        if left is not None:
            lo = max(lo, a - left)
        if static.chunk_size is not None:  # the chunks of the first and the last row
            c = static.chunk_size
            lo = max(lo, blockwise.chunk_first(a, c, 0))
            hi = min(hi, blockwise.chunk_last(b - 1, c, 0) + 1)
        lo, hi = min(lo, lk), max(min(hi, lk), 0)
        if hi <= lo:  # no key at all: keep one so that shapes stay non-empty (masked out)
            lo, hi = (0, 1) if lo >= lk else (lo, lo + 1)
        found.append((a, b, lo, hi))
    covered = sum((b - a) * (hi - lo) for a, b, lo, hi in found)
    return found if covered <= TILED_AT_MOST * lq * lk else whole


def _slice(x, a, b, lo, hi):
    """Rows a:b and keys lo:hi of a (Lq|1, Lk|1) array (a size-1 axis kept), or None."""
    if x is None or x.ndim < 2:
        return x
    return x[slice(a, b) if x.shape[-2] > 1 else slice(None),
             slice(lo, hi) if x.shape[-1] > 1 else slice(None)]


def _attend_tile(q, k, v, mask, bias, dropout_mask, offset, q_lengths, kv_lengths, sink,
                 distance_bias, distance_query, distance_keys, *, row0, key0, static,
                 divide_last):
    """``_tiled`` for query rows row0 … and keys key0 … (a tile; the whole head at 0, 0)."""
    compute = jnp.promote_types(q.dtype, jnp.float32)  # softmax in at least float32
    wide = wide_products(q.dtype)
    scores = static.scale * jnp.einsum("qd,kd->qk", *_widened(wide, q, k),
                                       precision=static.precision,
                                       preferred_element_type=compute)  # (Lq, Lk)
    key = key0 + jnp.arange(k.shape[0])[None, :]  # (1, Lk)
    pos = row0 + jnp.arange(q.shape[0])[:, None] + (0 if offset is None else offset)  # (Lq, 1)
    if distance_query is not None:  # the products with every distance, each key's gathered:
        products = jnp.einsum("qd,td->qt", distance_query.astype(compute),  # part of R,
                              distance_keys.astype(compute),  # inside the cap
                              precision=static.precision)  # (Lq, 2S + 1)
        index = jnp.broadcast_to(distance_index(products.shape[-1], key, pos), scores.shape)
        scores = scores + jnp.take_along_axis(products, index, axis=-1)
    if static.softcap is not None:  # after scaling, before bias and masks
        scores = static.softcap * jnp.tanh(scores / static.softcap)
    if bias is not None:
        scores = scores + bias.astype(compute)
    if distance_bias is not None:
        scores = scores + distance_terms(distance_bias.astype(compute), key, pos)
    allowed = _allowed(scores.shape, mask, offset, q_lengths, kv_lengths,
                       is_causal=static.is_causal, window=static.window,
                       chunk=static.chunk_size, row0=row0, key0=key0)
    causal_only = _causal_only(mask, offset, q_lengths, kv_lengths, static.window,
                               static.chunk_size)
    if allowed is None:
        filled = scores
    elif causal_only:  # every row keeps key 0: an added (Lq, Lk) 0 / min, the same for every
        # head, keeps the products and the softmax in one XLA:CPU fusion (a select splits it)
        filled = scores + jnp.where(allowed, 0.0, jnp.finfo(compute).min).astype(compute)
    else:
        filled = jnp.where(allowed, scores, jnp.finfo(compute).min)
    if sink is not None:  # softmax([S, s])[:, :-1]: masked entries are exactly 0
        column = jnp.broadcast_to(sink.astype(compute), filled.shape[:1] + (1,))  # (Lq, 1)
        filled = jnp.concatenate([filled, column], axis=-1)
    m = lax.stop_gradient(jnp.max(filled, axis=-1, keepdims=True))  # finite: no NaN anywhere
    e = jnp.exp(filled - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    weights = e / total  # jax.nn.softmax's arithmetic, with its statistics kept
    if sink is not None:
        weights = weights[:, :-1]
    inv = 1.0 / total
    if allowed is not None and (sink is not None or not causal_only):
        some = allowed.any(axis=-1, keepdims=True)
        weights = jnp.where(allowed, weights, 0.0) if sink is not None else weights * some
        if sink is None:  # an empty row: p = 0 in the backward
            m, inv = jnp.where(some, m, jnp.finfo(compute).max), jnp.where(some, inv, 0.0)
    if static.dropout_rate > 0.0:
        weights = jnp.where(dropout_mask, weights / (1.0 - static.dropout_rate), 0.0)
    weights = weights.astype(q.dtype)
    if divide_last and q.dtype == compute:  # (exp(S − m) V) / l (_attend)
        kept = e if sink is None else e[:, :-1]
        if sink is not None and allowed is not None:
            kept = jnp.where(allowed, kept, 0.0)
        per_row = inv  # 0 for an empty row
        if static.dropout_rate > 0.0:
            kept = jnp.where(dropout_mask, kept, 0.0)
            per_row = inv / (1.0 - static.dropout_rate)
        out = jnp.einsum("qk,kv->qv", kept, v, precision=static.precision,
                         preferred_element_type=compute) * per_row  # (Lq, Dv)
    else:  # the weights rounded to q's dtype, then the product, as torch computes it
        out = jnp.einsum("qk,kv->qv", *_widened(wide, weights, v), precision=static.precision,
                         preferred_element_type=compute)  # (Lq, Dv)
    return out.astype(q.dtype), weights, jnp.concatenate([m, inv], axis=-1).T


def wide_products(dtype) -> bool:
    """Whether a bfloat16 or float16 call takes its products on float32 copies of its operands:
    on CPU, where XLA:CPU otherwise converts them back to the half dtype for the product, which
    a CPU without AVX512_BF16 runs at half the speed (docs/performance.md, "bfloat16 on a host
    without AVX-512"). A product of two bfloat16 (or float16) numbers is exact in float32, so
    the sums are of the same terms, accumulated in float32 either way."""
    return jnp.dtype(dtype) in HALF and jax.default_backend() == "cpu"


HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _widened(wide, *xs):
    return tuple(x.astype(jnp.float32) for x in xs) if wide else xs


def _causal_only(mask, offset, q_lengths, kv_lengths, window, chunk=None):
    """Whether causality alone restricts the keys: every row then keeps key 0, none is empty."""
    return mask is None and offset is None and q_lengths is None and kv_lengths is None and (
        window == NO_WINDOW) and chunk is None


def _allowed(shape, mask, offset, q_lengths, kv_lengths, *, is_causal, window, chunk=None,
             row0=0, key0=0):
    """Where query row i, at position i + offset, may attend key j (position j): bool (Lq, Lk),
    or None when every key is allowed; the rows counted from row0, the keys from key0."""
    row = row0 + jnp.arange(shape[0])[:, None]  # (Lq, 1)
    key = key0 + jnp.arange(shape[1])[None, :]  # (1, Lk)
    pos = row if offset is None else row + offset  # (Lq, 1)
    terms = [t for t in [mask] if t is not None] + allowed_terms(
        row, key, pos, is_causal=is_causal, window=window, chunk=chunk, q_lengths=q_lengths,
        kv_lengths=kv_lengths)
    return jnp.broadcast_to(reduce(jnp.logical_and, terms), shape) if terms else None

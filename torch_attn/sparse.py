"""The torch core's "sparse" implementation: attention over the keys each query row chose.

DeepSeek-V3.2's lightning indexer (and GLM-5's, Mistral Large 4's, ...) gives every query row k
keys, ``key_indices``; the dense implementations read it as the boolean mask it stands for
(``selected_mask``). "sparse" gathers only those k keys and values per row, applies the other
rules at the gathered positions (causal, window, chunks, lengths, the mask and the bias gathered
there), takes the softmax over the k scores (scale, soft-cap, sinks) and their weighted sum:
O(Lq·k) work and memory, never an (Lq, Lk) array. The query rows go in blocks, forward and
backward (an autograd Function of its own, ``_Sparse``: what is kept between the passes is the
inputs and each row's log-sum-exp, not the gathered keys; each block's rules are found again
as it is read). A kv head's G query
heads share one gather when the selection is shared by the heads (key_indices without a head
axis, or with one of size 1): their scores one product batched over the rows, their key and
value gradients summed before one index_add. A repeat of an index in a row is masked after its
first occurrence (each block's rows sorted to find them), so a repeated index counts once (the
mask's meaning).

Shape legend: B batch, H query heads, Hkv key-value heads, G = H / Hkv, Lq query length, Lk key
length, k keys chosen per row, r rows of a block, Dk key width, Dv value width.
"""

from __future__ import annotations

import functools

import torch

from golden.specification.positions import allowed_terms
from golden.specification.validate import with_head_axis
from torch_attn.explicit import LOW_PRECISION

# Rows per block when block_sizes is None: as many as keep a block's gathered keys and values
# (B·Hkv·r·k, per row of width D) near BLOCK_ELEMENTS, at least one. Measured once on the
# 2-core AMD EPYC at L = 4096, k = 2048: 2¹⁴ the fastest of 2¹², 2¹⁴, 2¹⁶ and 2¹⁸ (one head's
# forward 0.25 s against 0.43, 0.33 and 1.4 s), though this host's torch timings vary 2-4x
# between identical calls.
BLOCK_ELEMENTS = 2**14


def selected_mask(key_indices, mask, lk):
    """key_indices (..., Lq, k) as the boolean (..., Lq, Lk) it stands for (row i's entry j True
    when j is one of key_indices[..., i, :]), ANDed with ``mask`` (None: alone)."""
    chosen = torch.zeros(key_indices.shape[:-1] + (lk,), dtype=torch.bool,
                         device=key_indices.device)
    chosen = chosen.scatter(-1, key_indices.long(), True)
    return chosen if mask is None else mask & chosen


def sparse(query, key, value, key_indices, mask, bias, where, scale, softcap, sinks, rows=None):
    """The output (..., H, Lq, Dv) of attention over the chosen keys. key_indices as the core
    takes it (golden.specification.validate.check_key_indices); mask, bias broadcastable
    to (..., H, Lq, Lk); ``where`` the other rules (torch_attn.explicit.Where)."""
    lead, lq = query.shape[:-2], query.shape[-2]
    q, k, v = (_lift(x) for x in (query, key, value))  # (B, H, Lq, Dk), (B, Hkv, Lk, D)
    hkv, g = k.shape[1], q.shape[1] // k.shape[1]
    q = q.reshape(q.shape[:1] + (hkv, g) + q.shape[2:])  # (B, Hkv, G, Lq, Dk)
    indices = _group(_lift(with_head_axis(key_indices, query)), hkv, g)  # (B|1, Hkv|1, G|1,
    # Lq, k), as given: each block's rows are sorted, their repeats found, as they are read
    mask, bias = (None if x is None else _group(_lift(x), hkv, g) for x in (mask, bias))
    chosen_bias = None if bias is None else _gathered(bias, indices.long())  # autograd: a scatter
    if sinks is not None:  # (Hkv, G), or (1, 1) unbatched
        sinks = sinks.reshape(hkv, g) if sinks.dim() else sinks.reshape(1, 1)
    rows = rows or max(1, BLOCK_ELEMENTS // (k.shape[0] * hkv * indices.shape[-1]))
    out = _Sparse.apply(q, k, v, indices.expand(k.shape[:2] + indices.shape[2:]), mask,
                        chosen_bias, sinks, (where, scale, softcap, rows))  # (B, Hkv, G, Lq, Dv)
    return out.reshape(lead + out.shape[-2:])


class _Sparse(torch.autograd.Function):
    """The attention over the chosen keys, block of rows by block, with a backward of its own:
    the forward keeps the output and each row's log-sum-exp; the backward recomputes each
    block's chosen keys and probabilities from them, P = exp(S − lse) where allowed, dS = P ⊙
    (dP − Σ P ⊙ dP), and adds the chosen keys' and values' gradients (summed over the heads
    sharing them) onto the keys read, one index_add per block. Nothing of size Lq·k·D is
    kept. Not twice differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, indices, mask, bias, sinks, settings):
        where, scale, softcap, rows = settings
        outs, lses = [], []
        for start in range(0, q.shape[-2], rows):
            part = _part(where, start, rows, indices, mask, bias)
            out, lse = _block_forward(q[..., start:start + rows, :], k, v, *part, sinks, scale,
                                      softcap)
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, indices, mask, bias, sinks, lse)
        ctx.settings = settings
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, indices, mask, bias, sinks, lse = ctx.saved_tensors
        where, scale, softcap, rows = ctx.settings
        compute = _compute(q)
        dq = torch.empty(q.shape, dtype=compute, device=q.device)
        dk = torch.zeros(k.shape, dtype=compute, device=k.device)
        dv = torch.zeros(v.shape, dtype=compute, device=v.device)
        dbias = None if bias is None else torch.empty(
            bias.shape[:-2] + (q.shape[-2], bias.shape[-1]), dtype=compute, device=q.device)
        dsink = None if sinks is None else torch.zeros(sinks.shape, dtype=compute,
                                                       device=q.device)
        for start in range(0, q.shape[-2], rows):
            part = _part(where, start, rows, indices, mask, bias)
            stop = start + part[0].shape[-2]
            dq[..., start:stop, :], ds = _block_backward(
                q[..., start:stop, :], k, v, *part, sinks, lse[..., start:stop],
                d_out[..., start:stop, :], scale, softcap, dk, dv, dsink)
            if dbias is not None:
                dbias[..., start:stop, :] = ds.sum_to_size(dbias[..., start:stop, :].shape)
        if dbias is not None:
            dbias = dbias.sum_to_size(bias.shape).to(bias.dtype)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, dbias,
                None if dsink is None else dsink.to(sinks.dtype), None)


def _compute(q):
    """The softmax's dtype: at least float32."""
    return torch.float32 if q.dtype in LOW_PRECISION else q.dtype


def _part(where, start, rows, indices, mask, bias):
    """Rows start:start + rows: their chosen indices (as given), where they may attend them
    (``_allowed``: a repeat of an index counts once, found by sorting the block's rows) and
    the chosen keys' bias."""
    cut = lambda x: x if x is None or x.shape[-2] == 1 else x[..., start:start + rows, :]  # noqa: E731
    chosen = cut(indices).long()
    ordered, order = torch.sort(chosen, dim=-1, stable=True)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
    first = torch.empty_like(first).scatter_(-1, order, first)  # back to the given order
    return chosen, _allowed(where, chosen, first, cut(mask), start), cut(bias)


def _rows_first(x, shared):
    """A block's (B, Hkv, G, r, X) in the layout of its products: (B, Hkv, r, G, X) when the G
    heads share the selection (batched over the rows, the heads a product's rows), else
    (B, Hkv, G, r, 1, X) (one row a product). A view."""
    return x.transpose(2, 3) if shared else x.unsqueeze(-2)


def _rows_back(x, shared):
    """The inverse of _rows_first: (B, Hkv, G, r, X), a view."""
    return x.transpose(2, 3) if shared else x.squeeze(-2)


def _at_rows(chosen, shared):
    """The chosen keys or values (B, Hkv, G|1, r, k, D) in the products' layout."""
    return chosen[:, :, 0] if shared else chosen


def _scores(q, keys, bias, scale, softcap, compute):
    """(scale · q·k, the scores after the cap and the bias) of a block: q (B, Hkv, G, r, Dk),
    keys (B, Hkv, G|1, r, k, Dk) -> (B, Hkv, G, r, k)."""
    shared = keys.shape[2] == 1
    raw = _rows_back(_rows_first(q.to(compute), shared)
                     @ _at_rows(keys.to(compute), shared).mT, shared)
    raw = scale * raw
    scores = raw if not softcap else softcap * torch.tanh(raw / softcap)
    return raw, scores if bias is None else scores + bias.to(compute)


def _block_forward(q, k, v, indices, allowed, bias, sinks, scale, softcap):
    """(output (B, Hkv, G, r, Dv) in q's dtype, log-sum-exp (B, Hkv, G, r), +inf for a row
    with nothing allowed and no sink)."""
    compute = _compute(q)
    keys, values = _chosen(k, indices), _chosen(v, indices)  # (B, Hkv, G|1, r, k, D)
    _, s = _scores(q, keys, bias, scale, softcap, compute)  # (B, Hkv, G, r, k)
    m = s.masked_fill(~allowed, -torch.inf).amax(dim=-1)  # (B, Hkv, G, r)
    sink = None if sinks is None else sinks.to(compute)[..., None]  # (Hkv, G, 1)
    if sink is not None:
        m = torch.maximum(m, sink)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp((s - m[..., None]).masked_fill(~allowed, -torch.inf))
    total = e.sum(dim=-1) + (0.0 if sink is None else torch.exp(sink - m))
    p = e / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    shared = values.shape[2] == 1
    out = _rows_back(_rows_first(p.to(q.dtype), shared) @ _at_rows(values, shared), shared)
    lse = torch.where(total > 0, m + torch.log(torch.where(total > 0, total, torch.ones_like(
        total))), torch.full_like(total, torch.inf))
    return out.to(q.dtype), lse


def _block_backward(q, k, v, indices, allowed, bias, sinks, lse, d_out, scale, softcap, dk, dv,
                    dsink):
    """dQ of the block and dL/dS at its chosen keys; dK, dV and the sinks' gradient added
    into ``dk``, ``dv``, ``dsink``."""
    compute = _compute(q)
    keys, values = _chosen(k, indices), _chosen(v, indices)
    shared = keys.shape[2] == 1
    raw, s = _scores(q, keys, bias, scale, softcap, compute)
    p = torch.exp((s - lse[..., None]).masked_fill(~allowed, -torch.inf))  # 0 where lse = inf
    do = _rows_first(d_out.to(compute), shared)
    dp = _rows_back(do @ _at_rows(values.to(compute), shared).mT, shared)
    row = (p * dp).sum(dim=-1)  # Σ P ⊙ dP (B, Hkv, G, r)
    ds = p * (dp - row[..., None])
    d_raw = ds if not softcap else ds * (1.0 - torch.tanh(raw / softcap) ** 2)
    d_raw_r = _rows_first(scale * d_raw, shared)
    dq = _rows_back(d_raw_r @ _at_rows(keys.to(compute), shared), shared)
    d_keys = d_raw_r.mT @ _rows_first(q.to(compute), shared)  # the G heads summed if shared
    d_values = _rows_first(p.to(q.dtype).to(compute), shared).mT @ do
    if shared:  # (B, Hkv, r, k, D) -> (B, Hkv, 1, r, k, D), as the indices
        d_keys, d_values = d_keys[:, :, None], d_values[:, :, None]
    _add_chosen(dk, indices, d_keys)
    _add_chosen(dv, indices, d_values)
    if dsink is not None:
        dsink -= (torch.exp(sinks.to(compute)[..., None] - lse) * row).sum(dim=(0, 3))
    return dq, ds


def _flat(x, indices):
    """The rows of x (B, Hkv, Lk, D) flattened to (B·Hkv·Lk, D) that the chosen indices
    (B, Hkv, G|1, r, k) name, as one index vector."""
    b, hkv, lk, _ = x.shape
    base = (torch.arange(b * hkv, device=x.device) * lk).reshape(b, hkv, 1, 1, 1)
    return (base + indices).reshape(-1)


def _chosen(x, indices):
    """x (B, Hkv, Lk, D) at the chosen indices (B, Hkv, G|1, r, k): (B, Hkv, G|1, r, k, D),
    read as one lookup of the flattened rows."""
    shape = tuple(x.shape[:2]) + tuple(indices.shape[2:]) + (x.shape[-1],)
    rows = x.reshape(-1, x.shape[-1])  # an embedding lookup: 3x index_select's speed on a CPU
    return torch.nn.functional.embedding(_flat(x, indices), rows).reshape(shape)


def _add_chosen(grad, indices, values):
    """grad (B, Hkv, Lk, D) += the chosen keys' gradients (B, Hkv, G|1, r, k, D) at their
    indices (repeats add)."""
    grad.view(-1, grad.shape[-1]).index_add_(0, _flat(grad, indices),
                                              values.reshape(-1, grad.shape[-1]))


def _allowed(where, indices, first, mask, start):
    """Where row start + i may attend its chosen key indices[..., i, t]: (B|1, ..., r, k)."""
    row = start + torch.arange(indices.shape[-2], device=indices.device)[:, None]  # (r, 1)
    offset, q_lengths, kv_lengths = (_per_batch(x, indices.device) for x in
                                     (where.offset, where.q_lengths, where.kv_lengths))
    terms = [first] + allowed_terms(
        row, indices, row + (0 if offset is None else offset), is_causal=where.is_causal,
        window=where.window, chunk=where.chunk_size, q_lengths=q_lengths, kv_lengths=kv_lengths)
    if mask is not None:
        terms.append(_gathered(mask, indices))
    return functools.reduce(torch.logical_and, terms)


def _gathered(x, indices):
    """x (B|1, Hkv|1, G|1, r|1, Lk|1) at each row's chosen keys: (..., r|1, k)."""
    if x.shape[-1] == 1:
        return x
    shape = torch.broadcast_shapes(x.shape[:-1], indices.shape[:-1])
    return torch.gather(x.expand(shape + x.shape[-1:]), -1,
                        indices.expand(shape + indices.shape[-1:]))


def _lift(x):
    """(…, L, D) -> (B|1, H|1, L, D): missing leading axes become size 1."""
    return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))


def _group(x, hkv, g):
    """(B|1, H|1, Lq, X) -> (B|1, Hkv|1, G|1, Lq, X): head h = kv head h // G, member h % G."""
    heads = (1, 1) if x.shape[1] == 1 else (hkv, g)
    return x.reshape(x.shape[:1] + heads + x.shape[2:])


def _per_batch(x, device):
    """An offset or lengths, None, an int, or an integer tensor (B,) -> (B, 1, 1, 1, 1) (a
    tensor () stays ()), to broadcast against (B, Hkv, G, r, k)."""
    if x is None or isinstance(x, int):
        return x
    x = x.to(device)
    return x.reshape(-1, 1, 1, 1, 1) if x.dim() else x

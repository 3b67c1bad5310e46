"""The torch core's "sparse" implementation: attention over the keys each query row chose.

DeepSeek-V3.2's lightning indexer (and GLM-5's, Mistral Large 4's, ...) gives every query row k
keys, ``key_indices``; the dense implementations read it as the boolean mask it stands for
(``selected_mask``). "sparse" gathers only those k keys and values per row, applies the other
rules at the gathered positions (causal, window, chunks, lengths, the mask and the bias gathered
there), takes the softmax over the k scores (scale, soft-cap, sinks) and their weighted sum:
O(Lq·k) work and memory, never an (Lq, Lk) array. The query rows go in blocks; under autograd
each block is recomputed in the backward (``torch.utils.checkpoint``), so what is kept between
the passes is the inputs and the output, not the gathered keys. A kv head's G query heads share
one gather when the selection is shared by the heads (key_indices without a head axis, or with
one of size 1). The indices are sorted per row first and a repeat of an index is masked after
its first occurrence, so a repeated index counts once (the mask's meaning).

Shape legend: B batch, H query heads, Hkv key-value heads, G = H / Hkv, Lq query length, Lk key
length, k keys chosen per row, r rows of a block, Dk key width, Dv value width.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from golden.specification.positions import allowed_terms
from golden.specification.validate import with_head_axis
from torch_attn.explicit import LOW_PRECISION, masked_softmax, sink_softmax

# Rows per block when block_sizes is None: as many as keep a block's gathered keys and values
# (B·Hkv·r·k, per row of width D) near BLOCK_ELEMENTS, at least one. Not measured yet.
BLOCK_ELEMENTS = 2**20


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
    indices = _group(_lift(with_head_axis(key_indices, query)), hkv, g).long()
    indices, _ = torch.sort(indices, dim=-1)  # (B|1, Hkv|1, G|1, Lq, k)
    first = torch.ones_like(indices, dtype=torch.bool)
    first[..., 1:] = indices[..., 1:] != indices[..., :-1]  # a repeat counts once
    mask, bias = (None if x is None else _group(_lift(x), hkv, g) for x in (mask, bias))
    if sinks is not None:  # (Hkv, G), or (1, 1) unbatched
        sinks = sinks.reshape(hkv, g) if sinks.dim() else sinks.reshape(1, 1)
    rows = rows or max(1, BLOCK_ELEMENTS // (k.shape[0] * hkv * indices.shape[-1]))
    block = functools.partial(_block, where=where, scale=scale, softcap=softcap)
    remember = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, bias, sinks))
    outs = []
    for start in range(0, lq, rows):
        stop = min(start + rows, lq)
        args = (q[..., start:stop, :], k, v, indices[..., start:stop, :],
                first[..., start:stop, :], _rows(mask, start, stop), _rows(bias, start, stop),
                sinks, start)
        outs.append(checkpoint(block, *args, use_reentrant=False) if remember else block(*args))
    out = torch.cat(outs, dim=-2)  # (B, Hkv, G, Lq, Dv)
    return out.reshape(lead + out.shape[-2:])


def _block(q, k, v, indices, first, mask, bias, sinks, start, *, where, scale, softcap):
    """Rows start:start + r: q (B, Hkv, G, r, Dk), indices and first (B|1, Hkv|1, G|1, r, k),
    mask and bias (B|1, Hkv|1, G|1, r|1, Lk|1) -> (B, Hkv, G, r, Dv)."""
    compute = torch.float32 if q.dtype in LOW_PRECISION else q.dtype
    batch = torch.arange(k.shape[0], device=k.device).reshape(-1, 1, 1, 1, 1)
    head = torch.arange(k.shape[1], device=k.device).reshape(1, -1, 1, 1, 1)
    keys, values = k[batch, head, indices], v[batch, head, indices]  # (B, Hkv, G|1, r, k, D)
    scores = scale * (q.to(compute).unsqueeze(-2) @ keys.to(compute).transpose(-1, -2))
    scores = scores.squeeze(-2)  # (B, Hkv, G, r, k)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + _gathered(bias, indices).to(compute)
    allowed = _allowed(where, indices, first, mask, start)
    if sinks is None:
        weights = masked_softmax(scores, allowed, True)
    else:
        weights = sink_softmax(scores, allowed, sinks.to(compute))
    out = weights.to(q.dtype).unsqueeze(-2) @ values  # (B, Hkv, G, r, 1, Dv)
    return out.squeeze(-2)


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


def _rows(x, start, stop):
    """Rows start:stop of x (..., Lq|1, Lk|1) (None stays None)."""
    return x if x is None or x.shape[-2] == 1 else x[..., start:stop, :]


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

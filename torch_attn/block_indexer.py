"""GroupedQueryAttention's block indexer (MiniMax M3's "max", Qwen4-Exp's "mean"): the blocks
each query keeps, as key_indices. The options and the rule are golden.specification.indexer's,
the maths golden.reference.indexer's (``_order``, ``_fill``, ``max_block_keys``,
``mean_block_keys``), here vectorised over the leading axes, the indexer heads and the query
rows; the only loops run over the blocks or the local blocks. The caller runs it under
torch.no_grad (no gradient through the choice). Equal scores: two stable sorts, as the
reference's (torch.topk does not promise which of equal scores it keeps).

Shape legend: ... the leading axes (B, or none), H_I indexer heads, Lq queries, Lk keys, D_I the
indexer's width, b the block size, M = ⌈Lk/b⌉ blocks (C = ⌊Lk/b⌋ complete ones for "mean"),
n = index_topk_blocks, k the slots of a row's key_indices.
"""

from __future__ import annotations

import math

import torch


def block_order(scores, kept, eligible):
    """Block indices (..., M) in the order they are taken: the ``kept`` ones first, then the
    ``eligible`` ones, each highest score first, equal scores by lowest index, then the rest
    (never taken): golden.reference.indexer._order's two stable sorts (by score, the others
    tied at 0; then by rank)."""
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    by_score = torch.argsort(torch.where(eligible, -scores, zero), dim=-1, stable=True)
    rank = torch.where(kept, 0, torch.where(eligible, 1, 2))
    ranked = torch.gather(rank, -1, by_score)
    return torch.gather(by_score, -1, torch.argsort(ranked, dim=-1, stable=True))


def fill_keys(keys, valid, k):
    """(..., k) int64: each row's ``valid`` ``keys`` (..., S) in their order, the others
    dropped, the first k of them; the slots past them repeat the row's first (key 0 if it has
    none): golden.reference.indexer._fill. S ≥ k."""
    order = torch.argsort((~valid).to(torch.uint8), dim=-1, stable=True)   # valid first
    keys = torch.gather(keys, -1, order)[..., :k]
    count = valid.sum(-1, keepdim=True)                                     # (..., 1)
    first = torch.where(count > 0, keys[..., :1], torch.zeros_like(keys[..., :1]))
    return torch.where(torch.arange(k, device=keys.device) < count, keys, first)


def max_block_keys(q, k, allowed, q_block, b, n, local_blocks):
    """MiniMax M3's choice (..., H_I, Lq, min(n·b, Lk)) int64 from indexer queries q (..., H_I,
    Lq, D_I) and keys k (..., 1, Lk, D_I) (normed and turned, one dtype), the keys each query
    may see ``allowed`` (..., Lq, Lk) and each query's block q_block (..., Lq) (its position
    // b): block m's score the max of q·k over its keys m·b … m·b + b − 1 that the query may
    see (none: not eligible); the ``local_blocks`` blocks q_block, q_block − 1, … (clipped to
    [0, M − 1]) kept first; then the highest-scoring eligible blocks, n in all."""
    s = q @ k.transpose(-1, -2)                                  # (..., H_I, Lq, Lk)
    lk, device = s.shape[-1], s.device
    m, ok = -(-lk // b), allowed.unsqueeze(-3)                   # ok (..., 1, Lq, Lk)
    low = s.amin() if s.numel() else s.new_zeros(())             # below every allowed score
    seg, pad = torch.where(ok, s, low), m * b - lk
    if pad:  # the last block's missing keys: never seen
        seg = torch.cat([seg, low.expand(seg.shape[:-1] + (pad,))], -1)
        ok = torch.cat([ok, ok.new_zeros(ok.shape[:-1] + (pad,))], -1)
    scores = seg.unflatten(-1, (m, b)).amax(-1)                  # (..., H_I, Lq, M)
    has = ok.unflatten(-1, (m, b)).any(-1)                       # (..., 1, Lq, M)
    blocks, own = torch.arange(m, device=device), q_block.unsqueeze(-2)[..., None]
    local = torch.zeros_like(has)                                # (..., 1, Lq, M)
    for i in range(local_blocks):
        local = local | (blocks == (own - i).clamp(0, m - 1))
    local = local.expand(scores.shape)
    eligible = (has | local).expand(scores.shape)
    order = block_order(scores, local, eligible)[..., :min(n, m)]            # (..., H_I, Lq, n')
    taken = torch.gather(eligible, -1, order)
    keys = order[..., None] * b + torch.arange(b, device=device)           # (..., n', b)
    valid = taken[..., None] & (keys < lk)
    return fill_keys(keys.flatten(-2), valid.flatten(-2), min(n * b, lk))


def mean_block_keys(q, raw_k, allowed, key_positions, block_key, b, n):
    """Qwen4-Exp's choice (..., Lq, min(n·b + b − 1, Lk)) int64 from turned, normed indexer
    queries q (..., H_I, Lq, D_I), raw keys raw_k (..., Lk, D_I) (one dtype), the keys each
    query may see ``allowed`` (..., Lq, Lk) and the keys' positions key_positions (..., Lk):
    each query's visible keys, in order, cut into complete blocks of b, each pooled (mean) and
    made a key by ``block_key(pooled (..., Lq, C, D_I), first key's positions (..., Lq, C))``
    (normed and turned), scored Σ_h ReLU(q·key) / √D_I; the n best blocks kept, then the tail
    (the last < b visible keys)."""
    lk, device = allowed.shape[-1], allowed.device
    c_max, k = lk // b, min(n * b + b - 1, lk)
    count = allowed.sum(-1, keepdim=True)                                  # (..., Lq, 1)
    complete = count // b
    visible = torch.argsort((~allowed).to(torch.uint8), dim=-1, stable=True)  # seen first
    tail_at = complete * b + torch.arange(b - 1, device=device)            # (..., Lq, b − 1)
    tail = torch.gather(visible, -1, tail_at.clamp(max=lk - 1))
    if c_max == 0:  # no complete block: the tail alone
        return fill_keys(tail, tail_at < count, k)
    groups = visible[..., :c_max * b].unflatten(-1, (c_max, b))            # (..., Lq, C, b)
    rows = raw_k.unsqueeze(-3).expand(groups.shape[:-2] + raw_k.shape[-2:])  # (..., Lq, Lk, D)
    pooled = torch.stack([_gathered(rows, groups[..., c, :]).sum(-2) for c in range(c_max)],
                         -2) / b                                           # (..., Lq, C, D)
    at = key_positions.unsqueeze(-2).expand(groups.shape[:-2] + (lk,))    # (..., Lq, Lk)
    keys = block_key(pooled, torch.gather(at, -1, groups[..., 0]))        # (..., Lq, C, D)
    dot = torch.einsum("...hld,...lcd->...lch", q, keys)
    scores = dot.clamp(min=0).sum(-1) * (1.0 / math.sqrt(q.shape[-1]))     # (..., Lq, C)
    eligible = torch.arange(c_max, device=device) < complete               # (..., Lq, C)
    order = block_order(scores, torch.zeros_like(eligible), eligible)[..., :min(n, c_max)]
    taken = torch.gather(eligible, -1, order)                              # (..., Lq, n')
    chosen = torch.gather(groups, -2, order[..., None].expand(order.shape + (b,)))
    keys = torch.cat([chosen.flatten(-2), tail], -1)
    valid = torch.cat([taken[..., None].expand(chosen.shape).flatten(-2), tail_at < count], -1)
    return fill_keys(keys, valid, k)


def _gathered(rows, index):
    """rows (..., Lq, Lk, D) at each query's keys ``index`` (..., Lq, b): (..., Lq, b, D)."""
    return torch.gather(rows, -2, index[..., None].expand(index.shape + rows.shape[-1:]))

"""The learned indexer of multi-head latent attention (DeepSeek-V3.2's lightning indexer, GLM-5's,
Mistral Large 4's, HY-V4's): its scores, its top-k selection, and the selection as a mask. The
options and the selection rule are golden.specification.indexer's.

    q^I = (q_resid or LayerNorm(x)) W_index_q          (..., L, H_I, D_I)
          [· (s_h ln(p + 1) + b_h): index_temperature]
    k^I = LayerNorm(x W_index_k) · w + b               (..., L, D_I)
    RoPE on qk_rope_head_dim features of both (first or last; rotate-half or interleaved)
    w   = x W_index_weights · H_I^−1/2                 (..., L, H_I)
    I[t, s] = Σ_h w[t, h] · ReLU(D_I^−1/2 · q^I[t, h] · k^I[s])      (index_scale "scores")
    I[t, s] = Σ_h (w[t, h] · D_I^−1/2) · ReLU(q^I[t, h] · k^I[s])    (index_scale "weights")

in that order, as Hugging Face's modules compute it. Hugging Face's own steps are float32 even
in a float64 model: ``q.float()``, ``k.float()``, ``weights_proj(...).float()`` (the products,
the ReLU, the head sum and the top-k all in float32); here every step is in the reference's
arithmetic (float64, or exact for the fixtures), so the two choose the same keys wherever the
k-th and (k+1)-th scores of a row are further apart than float32's error on them.

The indexer has no gradient (torch.no_grad in Hugging Face): the attention's backward treats the
chosen keys as a constant mask, and the indexer's parameters get no gradient.

Shape legend: L tokens (Lq queries, Lk keys), H_I indexer heads, D_I indexer head width, k the
keys kept per query, r = qk_rope_head_dim.
"""

from __future__ import annotations

import numpy as np

from golden.reference.arithmetic import einsum, number, real
from golden.reference.block import linear
from golden.reference.norms import normalize
from golden.reference.rotary import turn


def _layer_norm(x, weight, bias, eps):
    """LayerNorm over the last axis with weight and bias (torch.nn.LayerNorm)."""
    return normalize("layer", x, weight, eps)[0] + bias


def _index_rope(c, x, cos, sin):
    """x (..., D_I) with its first or last r features turned (index_rope_dims) by (cos, sin)
    (..., r/2) broadcast to it, rotate-half or interleaved pairs; x itself without index_rope."""
    if c["index_rope"] is None:
        return x
    interleaved, r = c["index_rope"] == "interleaved", c["qk_rope_head_dim"]
    if c["index_rope_dims"] == "first":
        return turn(x, cos, sin, interleaved)  # the first r turned, the rest passed through
    d = x.shape[-1]
    return np.concatenate([x[..., :d - r], turn(x[..., d - r:], cos, sin, interleaved)], axis=-1)


def index_scores(c, x, q_resid, positions, cos, sin, p):
    """The indexer's scores I (..., Lq, Lk) of a full configuration ``c`` on x (..., L, d_in):
    the query from ``q_resid`` (..., L, q_lora) (index_query "latent") or LayerNorm(x)
    ("layer_norm"), RoPE's (cos, sin) (..., L, r/2) at ``positions`` (L,) or (B, L); nothing
    masked yet."""
    h, d, eps = c["index_heads"], c["index_head_dim"], number(c["index_norm_eps"])
    source = (q_resid if c["index_query"] == "latent"
              else _layer_norm(x, p["index_q_norm"], p["index_q_norm_bias"], eps))
    q = linear(source, p["W_index_q"], None)
    q = q.reshape(q.shape[:-1] + (h, d))                              # (..., L, H_I, D_I)
    if c["index_temperature"]:  # Mistral Large 4's, before RoPE
        logs = np.log(real((np.asarray(positions) + 1).astype(np.float64)))[..., None]
        factors = p["index_temperature_scale"] * logs + p["index_temperature_bias"]
        q = q * factors[..., None]                                    # (..., L, H_I, 1)
    q = _index_rope(c, q, cos[..., None, :], sin[..., None, :])
    k = _layer_norm(linear(x, p["W_index_k"], None), p["index_k_norm"],
                    p["index_k_norm_bias"], eps)
    k = _index_rope(c, k, cos, sin)                                  # (..., L, D_I)
    dot = einsum("...thd,...sd->...ths", q, k)                       # (..., Lq, H_I, Lk)
    w = linear(x, p["W_index_weights"], None) * (number(1) / np.sqrt(number(h)))
    inv_sqrt_d = number(1) / np.sqrt(number(d))
    if c["index_scale"] == "scores":  # DeepSeek-V3.2: on q·k, before the ReLU
        dot = dot * inv_sqrt_d
    else:  # HY-V4: on the head weights
        w = w * inv_sqrt_d
    relu = np.where(dot > 0, dot, number(0))
    return einsum("...th,...ths->...ts", w, relu)                    # (..., Lq, Lk)


def select_keys(scores, allowed, k):
    """key_indices (..., Lq, k) int64: each row's k highest ``scores`` (..., Lq, Lk) among its
    ``allowed`` keys, best first, equal scores won by the lowest key index; then, if a row
    allows fewer than k, its other keys by index. Two stable sorts: by score (the others tied
    at 0), then allowed before not."""
    by_score = np.argsort(np.where(allowed, -scores, number(0)), axis=-1, kind="stable")
    refused = np.take_along_axis(~np.asarray(allowed, dtype=bool), by_score, axis=-1)
    order = np.take_along_axis(by_score, np.argsort(refused, axis=-1, kind="stable"), axis=-1)
    return order[..., :k].astype(np.int64)


def selected_mask(key_indices, lk):
    """Boolean (..., Lq, Lk): True at each row's chosen keys ``key_indices`` (..., Lq, k)."""
    key_indices = np.asarray(key_indices)
    chosen = np.zeros(key_indices.shape[:-1] + (lk,), dtype=bool)
    np.put_along_axis(chosen, key_indices.astype(np.int64), True, axis=-1)
    return chosen


def index_keys(c, x, q_resid, positions, cos, sin, p, allowed):
    """The indexer's choice key_indices (..., Lq, k), k = min(index_topk, Lk), among the
    ``allowed`` keys (..., Lq, Lk) (golden.specification.indexer's rule)."""
    scores = index_scores(c, x, q_resid, positions, cos, sin, p)
    return select_keys(scores, allowed, min(c["index_topk"], allowed.shape[-1]))


# ---- block selection (MiniMax M3 "max", Qwen4-Exp "mean"): golden.specification.indexer ------

def _rms(x, weight, eps):
    """RMSNorm over the last axis times ``weight`` (the multiplier)."""
    return normalize("rms", x, weight, eps)[0]


def _order(scores, kept, eligible):
    """Block indices (..., M) in the order they are taken: the ``kept`` ones first, then the
    other ``eligible`` ones, each group by score, highest first, equal scores by lowest index,
    then the rest (never taken). Stable sorts: by score (the others tied at 0), then by rank."""
    by_score = np.argsort(np.where(eligible, -scores, number(0)), axis=-1, kind="stable")
    rank = np.where(kept, 0, np.where(eligible, 1, 2))
    ranked = np.take_along_axis(rank, by_score, axis=-1)
    return np.take_along_axis(by_score, np.argsort(ranked, axis=-1, kind="stable"), axis=-1)


def _fill(keys, k):
    """A row's chosen keys as k int64 slots, the rest repeating the first (0 if none)."""
    keys = list(keys)[:k]
    return np.asarray(keys + [keys[0] if keys else 0] * (k - len(keys)), dtype=np.int64)


def max_block_scores(q, k, allowed, b):
    """MiniMax M3's block scores: (scores (..., H_I, Lq, M), has (..., 1, Lq, M)) of indexer
    queries q (..., Lq, H_I, D_I) and keys k (..., Lk, D_I): block m's score the max of
    q[t, h]·k[j] over the keys j of m·b … m·b + b − 1 that ``allowed`` (..., Lq, Lk) lets t see;
    ``has`` False where none (its score then meaningless)."""
    lk = k.shape[-2]
    s = einsum("...thd,...sd->...hts", q, k)                          # (..., H_I, Lq, Lk)
    allowed = np.asarray(allowed, dtype=bool)[..., None, :, :]        # (..., 1, Lq, Lk)
    low = s.min() if s.size else number(0)                            # below every allowed score
    scores, has = [], []
    for m in range(-(-lk // b)):
        seg, ok = s[..., m * b:(m + 1) * b], allowed[..., m * b:(m + 1) * b]
        scores.append(np.where(ok, seg, low).max(axis=-1))
        has.append(ok.any(axis=-1))
    return np.stack(scores, axis=-1), np.stack(has, axis=-1)


def max_block_keys(c, q, k, allowed, positions):
    """MiniMax M3's choice key_indices (..., H_I, Lq, k), k = min(index_topk_blocks · b, Lk),
    from indexer queries q (..., Lq, H_I, D_I), keys k (..., Lk, D_I) (normed and turned) and
    the keys each query may see ``allowed`` (..., Lq, Lk)."""
    b, n, lk = c["index_block_size"], c["index_topk_blocks"], k.shape[-2]
    scores, has = max_block_scores(q, k, allowed, b)
    blocks = scores.shape[-1]
    q_block = np.broadcast_to(np.asarray(positions), allowed.shape[:-1]) // b   # (..., Lq)
    local = np.zeros(allowed.shape[:-1] + (blocks,), dtype=bool)                # (..., Lq, M)
    for i in range(c["index_local_blocks"]):
        np.put_along_axis(local, np.clip(q_block - i, 0, blocks - 1)[..., None], True, axis=-1)
    local = np.broadcast_to(local[..., None, :, :], scores.shape)
    eligible = np.broadcast_to(has, scores.shape) | local
    order = _order(scores, local, eligible)[..., :min(n, blocks)]
    width = min(n * b, lk)
    out = np.zeros(order.shape[:-1] + (width,), dtype=np.int64)
    for idx in np.ndindex(order.shape[:-1]):
        taken = [m for m in order[idx] if eligible[idx + (m,)]]
        out[idx] = _fill([j for m in taken for j in range(m * b, min((m + 1) * b, lk))], width)
    return out


def mean_block_keys(c, q, raw_k, allowed, positions, cos_sin, p):
    """Qwen4-Exp's choice key_indices (..., Lq, k), k = min(index_topk_blocks · b + b − 1, Lk),
    from turned, normed indexer queries q (..., Lq, H_I, D_I), raw keys raw_k (..., Lk, D_I),
    the keys each query may see ``allowed`` (..., Lq, Lk), ``positions`` (..., Lk) and
    ``cos_sin`` (positions -> (cos, sin) (..., rd/2)): for each query, its visible keys cut
    into complete blocks of b, each pooled (mean), normed, turned at its first key's position
    and scored Σ_h ReLU(q·key)/√D_I; the top blocks and the tail kept."""
    b, n, lk = c["index_block_size"], c["index_topk_blocks"], raw_k.shape[-2]
    inv_sqrt_d = number(1) / np.sqrt(number(q.shape[-1]))
    width = min(n * b + b - 1, lk)
    allowed = np.asarray(allowed, dtype=bool)
    positions = np.broadcast_to(np.asarray(positions), allowed.shape[:-1])
    out = np.zeros(allowed.shape[:-1] + (width,), dtype=np.int64)
    for idx in np.ndindex(allowed.shape[:-1]):                          # (..., t)
        row = idx[:-1]
        visible = np.nonzero(allowed[idx])[0]
        complete = len(visible) // b
        groups = visible[:complete * b].reshape(complete, b)            # (C, b) key indices
        chosen = []
        if complete:
            pooled = raw_k[row][groups].sum(axis=-2) / number(b)        # (C, D_I)
            cos, sin = cos_sin(positions[row][groups[:, 0]])            # (C, rd/2)
            keys = turn(_rms(pooled, p["index_k_norm"], number(c["index_norm_eps"])), cos, sin,
                        False)
            dot = einsum("hd,cd->hc", q[idx], keys)                     # (H_I, C)
            scores = np.where(dot > 0, dot, number(0)).sum(axis=0) * inv_sqrt_d
            order = _order(scores, np.zeros(complete, bool), np.ones(complete, bool))
            chosen = [j for m in order[:min(n, complete)] for j in groups[m]]
        out[idx] = _fill(chosen + list(visible[complete * b:]), width)
    return out


def block_keys(c, x, positions, cos_sin, p, allowed):
    """The block indexer's choice of a full GroupedQueryAttention configuration ``c`` on x
    (..., L, d_in) at ``positions`` (L,) or (B, L), among the keys each query may see
    ``allowed`` (..., Lq, Lk): key_indices (..., H, Lq, k) for "max" (each KV group's choice
    for its query heads), (..., Lq, k) for "mean". ``cos_sin`` maps integer positions (...)
    to the layer's RoPE (cos, sin) (..., rd/2)."""
    h, d, eps = c["index_heads"], c["index_head_dim"], number(c["index_norm_eps"])
    lead, length = x.shape[:-2], x.shape[-2]
    positions = np.broadcast_to(np.asarray(positions), lead + (length,))
    cos, sin = cos_sin(positions)                                        # (..., L, rd/2)
    q = linear(x, p["W_index_q"], None)
    q = _rms(q.reshape(q.shape[:-1] + (h, d)), p["index_q_norm"], eps)  # (..., L, H_I, D_I)
    q = turn(q, cos[..., None, :], sin[..., None, :], False)
    raw_k = linear(x, p["W_index_k"], None)                              # (..., L, D_I)
    if c["index_blocks"] == "mean":
        return mean_block_keys(c, q, raw_k, allowed, positions, cos_sin, p)
    k = turn(_rms(raw_k, p["index_k_norm"], eps), cos, sin, False)
    chosen = max_block_keys(c, q, k, allowed, positions)                 # (..., H_I, Lq, k)
    return np.repeat(chosen, c["num_heads"] // h, axis=-3)               # (..., H, Lq, k)

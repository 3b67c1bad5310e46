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

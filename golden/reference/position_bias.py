"""Position biases: score terms that depend on where query and key sit, added to the scores
before the softmax. ALiBi's linear distance penalty (no parameter), T5's learned table read at
the bucket of each distance, with the table's gradient, and Transformer-XL's relative positional
term, a product of each query with a projected sinusoidal table of distances, with the
gradients of its query, its biases u and v and its projection; Shaw's relative key term, each
query's product with a learned table of clipped distances, with the gradients of its query
and its table; the USM Conformer's (Gemma 3n's and Gemma 4's audio encoders), each query scaled
per dimension by softplus(per_dim_scale) and its product with a projected timing signal of
distances, with the gradients of its query, the scale and the projection. The relative
positions' terms (Transformer-XL's, Shaw's, the Conformer's) are part of the raw scores R,
inside the soft cap (golden.reference.core's ``position_term``); ALiBi's and T5's biases are
added after it.

Shape legend: N heads, L sequence length (query i and key j both in token order), num_buckets
the rows of T5's table (num_buckets, N), Dh head width, d the model width (d_in), S = L − 1
the farthest distance (2S + 1 rows of a table over distances −S … S); M Shaw's
relative_max_distance (its table (2M + 1, Dh) over the query − key distances −M … M).
"""

from __future__ import annotations

import numpy as np

from golden.specification.decoder import (SINUSOID_BASE, TIMING_MAX_TIMESCALE, alibi_slopes,
                                          relative_position_bucket)
from golden.reference.arithmetic import einsum, number, number_type, real


def alibi_term(c, length, dh):
    """ALiBi's score bias (N, L, L) for ``length`` tokens: m_h · (j − i), key j and query i in
    token order (golden.specification.decoder.alibi_slopes gives m_h); Falcon adds it before the
    scale, so its bias is multiplied by the scale (default 1/√Dh). Exact: powers of two times
    integers, then the scale in the arithmetic in force. Not a parameter: no gradient."""
    slopes = alibi_slopes(c["num_heads"], c["alibi"], c["alibi_bias_max"])
    distance = np.arange(length)[None, :] - np.arange(length)[:, None]  # j − i (L, L)
    bias = real(slopes[:, None, None] * distance)
    if c["alibi"] != "falcon":
        return bias
    return bias * (number(1) / np.sqrt(number(dh)) if c["scale"] is None else number(c["scale"]))


def relative_term(c, length, table):
    """T5's score bias (N, L, L): the learned table (num_buckets, N) at the bucket of each
    distance j − i (golden.specification.decoder.relative_position_bucket, by the config's rule:
    T5's, bidirectional unless causal, or Phi-4's clipped distances); returns (bias, buckets (L, L))."""
    distance = np.arange(length)[None, :] - np.arange(length)[:, None]  # j − i (L, L)
    buckets = relative_position_bucket(distance, not c["causal"],
                                       c["relative_attention_num_buckets"],
                                       c["relative_attention_max_distance"],
                                       c["relative_attention_buckets"])
    return np.moveaxis(real(table)[buckets], -1, -3), buckets


def bucket_sums(g_bias, buckets, shape):
    """The gradient of relative_term's gather: g_bias (..., N, L, L) summed over the batch and
    scattered into the buckets, (num_buckets, N), in index order."""
    g = g_bias.reshape((-1,) + g_bias.shape[-3:]).sum(axis=0)  # (N, L, L)
    out = real(np.zeros(shape))
    np.add.at(out, buckets, np.moveaxis(g, 0, -1))  # (L, L, N) into (num_buckets, N)
    return out


# Transformer-XL (Dai et al. 2019, section 3.3; Hugging Face's ParakeetEncoderAttention): with q
# the query heads the core would see, u and v (N, Dh) per-head biases and r_h(t) head h's slice
# of R(t) W_pos (R the sinusoidal encoding of the query − key distance t), the scores are
#     s_ij = scale · (q_i + u)·k_j + scale · (q_i + v)·r(i − j)
# the first by the core (its query q + u), the second a bias (N, L, L) beside it.


def sinusoid_term(width, span):
    """The reference's own sinusoidal table (2·span + 1, width): row span + d is R(−d),
    R(t) = (sin tω_0, cos tω_0, sin tω_1, …), ω_k = 10000^(−2k/width) (exp(−(2k/width)·ln
    10000) inside exact_arithmetic()); golden.specification.decoder.sinusoid_table is the
    twins'."""
    exponent = np.arange(0, width, 2) / number(width)  # 2k / width
    base = number(SINUSOID_BASE)
    omega = base ** -exponent if number_type() is None else np.exp(-exponent * np.log(base))
    angles = -np.arange(-span, span + 1)[:, None] * omega  # (2S + 1, width/2): t·ω, t = −d
    return np.stack([np.sin(angles), np.cos(angles)], axis=-1).reshape(2 * span + 1, width)


def transformer_xl_term(q, p, scale):
    """(q + u, the bias (..., N, L, L), saved) for the query heads q (..., N, L, Dh) and the
    parameters p (W_pos (d, N·Dh), bias_u, bias_v (N, Dh)): the bias is scale · (q_i + v)·
    e[S + j − i], e = split(R W_pos) (N, 2S + 1, Dh), S = L − 1."""
    heads, length = q.shape[-3], q.shape[-2]
    pe = sinusoid_term(p["W_pos"].shape[0], length - 1)  # (2S + 1, d)
    e = einsum("ti,io->to", pe, p["W_pos"])  # (2S + 1, N·Dh)
    e = np.swapaxes(e.reshape(e.shape[0], heads, -1), 0, 1)  # (N, 2S + 1, Dh)
    index = length - 1 + np.arange(length)[None, :] - np.arange(length)[:, None]  # S + j − i
    gathered = e[:, index]  # (N, L, L, Dh)
    qv = q + p["bias_v"][:, None, :]
    bias = scale * einsum("...nid,nijd->...nij", qv, gathered)
    return q + p["bias_u"][:, None, :], bias, (qv, gathered, index, pe, scale)


def transformer_xl_backward(saved, p, g_query, g_bias):
    """(dL/dq, {bias_u, bias_v, W_pos: gradient}) of transformer_xl_term from the gradients of
    its query q + u (..., N, L, Dh) and of its bias (..., N, L, L): each table row's gradient
    summed over the query–key pairs at its distance, in index order."""
    qv, gathered, index, pe, scale = saved
    heads = qv.shape[-3]
    g_qv = scale * einsum("...nij,nijd->...nid", g_bias, gathered)
    flat_g = g_bias.reshape((-1,) + g_bias.shape[-3:])  # (B, N, L, L)
    flat_qv = qv.reshape((-1,) + qv.shape[-3:])  # (B, N, L, Dh)
    g_gathered = scale * einsum("bnij,bnid->ijnd", flat_g, flat_qv)  # (L, L, N, Dh)
    g_e = real(np.zeros((pe.shape[0],) + g_gathered.shape[2:]))  # (2S + 1, N, Dh)
    np.add.at(g_e, index, g_gathered)
    g_w = einsum("ti,to->io", pe, g_e.reshape(g_e.shape[0], -1))  # (d, N·Dh)
    per_head = lambda g: g.reshape((-1,) + g.shape[-3:]).sum(axis=(0, 2))  # noqa: E731 (N, Dh)
    return g_query + g_qv, {"bias_u": per_head(g_query), "bias_v": per_head(g_qv),
                            "W_pos": g_w}


# Shaw et al. 2018 (Hugging Face's GraniteSpeechConformerAttention): with q the query heads the
# core sees and E (2M + 1, Dh) one learned table shared by every head, the scores are
#     s_ij = scale · q_i·k_j + scale · q_i·E[M + clip(i − j, −M, M)]
# the first by the core, the second its position term (N, L, L), inside the cap (row M + t:
# query − key = t).


def shaw_term(q, table, scale):
    """(the position term (..., N, L, L), saved) for the query heads q (..., N, L, Dh) and the table
    (2M + 1, Dh): scale · q_i·E[M + clip(i − j, −M, M)]."""
    span, length = (table.shape[0] - 1) // 2, q.shape[-2]
    index = span + np.clip(np.arange(length)[:, None] - np.arange(length)[None, :],
                           -span, span)  # (L, L): M + clip(i − j)
    gathered = table[index]  # (L, L, Dh)
    return scale * einsum("...nid,ijd->...nij", q, gathered), (q, gathered, index, scale)


def shaw_backward(saved, table, g_bias):
    """(dL/dq (..., N, L, Dh), dL/dE (2M + 1, Dh)) of shaw_term from the gradient of its term
    (..., N, L, L): each table row's gradient summed over the heads and the query–key pairs at
    its clipped distance, in index order."""
    q, gathered, index, scale = saved
    g_q = scale * einsum("...nij,ijd->...nid", g_bias, gathered)
    flat_g = g_bias.reshape((-1,) + g_bias.shape[-3:])  # (B·N…, N, L, L)
    flat_q = q.reshape((-1,) + q.shape[-3:])  # (B, N, L, Dh)
    g_gathered = scale * einsum("bnij,bnid->ijd", flat_g, flat_q)  # (L, L, Dh)
    g_table = real(np.zeros(table.shape))
    np.add.at(g_table, index, g_gathered)
    return g_q, g_table


# The USM Conformer's relative position logits (Gemma 3n's and Gemma 4's audio encoders; Hugging
# Face's Gemma3nAudioAttention, Gemma4AudioAttention): with q the query heads the core would see,
# w = per_dim_scale (Dh,), s the scale (default Dh^−1/2), κ the key scale (Gemma 4's
# ln(1 + e)/ln 2, else 1) and E_h(t) head h's slice of timing(t) W_pos (timing: timing_term),
#     q̃ = q ⊙ s · softplus(w) / ln 2,      R_ij = κ q̃_i·k_j + q̃_i·E(i − j)
# the first by the core (query q̃, scale κ), the second its position term, inside the cap.


def timing_term(width, span):
    """The reference's own timing signal (2·span + 1, width): row span + d is timing(−d),
    timing(t) = (sin tι_0 … sin tι_{n−1}, cos tι_0 … cos tι_{n−1}), n = width/2, ι_k =
    exp(−k·ln(10⁴) / max(n − 1, 1)); golden.specification.decoder.timing_table is the
    twins'."""
    n = width // 2
    step = np.log(number(TIMING_MAX_TIMESCALE)) / number(max(n - 1, 1))
    inv = np.exp(-real(np.arange(n)) * step)  # (n,)
    angles = -real(np.arange(-span, span + 1))[:, None] * inv  # (2S + 1, n): t·ι, t = −d
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1)


def softplus(w):
    """(softplus(w) = ln(1 + e^w), its derivative σ(w) = 1 / (1 + e^−w))."""
    one = number(1)
    return np.log(one + np.exp(w)), one / (one + np.exp(-w))


def conformer_timing_term(q, p, scale):
    """(q̃, the position term (..., N, L, L), saved) for the query heads q (..., N, L, Dh) and
    the parameters p (W_pos (d, N·Dh), per_dim_scale (Dh,)): q̃ = q ⊙ scale · softplus(w) / ln 2
    and the term q̃_i·e[S + j − i], e = split(timing W_pos) (N, 2S + 1, Dh), S = L − 1."""
    heads, length = q.shape[-3], q.shape[-2]
    soft, slope = softplus(p["per_dim_scale"])
    factor = scale * soft / np.log(number(2))  # (Dh,)
    qt = q * factor
    pe = timing_term(p["W_pos"].shape[0], length - 1)  # (2S + 1, d)
    e = einsum("ti,io->to", pe, p["W_pos"])  # (2S + 1, N·Dh)
    e = np.swapaxes(e.reshape(e.shape[0], heads, -1), 0, 1)  # (N, 2S + 1, Dh)
    index = length - 1 + np.arange(length)[None, :] - np.arange(length)[:, None]  # S + j − i
    gathered = e[:, index]  # (N, L, L, Dh)
    term = einsum("...nid,nijd->...nij", qt, gathered)
    return qt, term, (q, qt, factor, scale * slope / np.log(number(2)), gathered, index, pe)


def conformer_timing_backward(saved, g_query, g_term):
    """(dL/dq, {per_dim_scale, W_pos: gradient}) of conformer_timing_term from the gradients of
    its q̃ (..., N, L, Dh) and of its term (..., N, L, L): each table row's gradient summed over
    the query–key pairs at its distance, in index order."""
    q, qt, factor, d_factor, gathered, index, pe = saved
    g_qt = g_query + einsum("...nij,nijd->...nid", g_term, gathered)
    flat_g = g_term.reshape((-1,) + g_term.shape[-3:])  # (B, N, L, L)
    flat_qt = qt.reshape((-1,) + qt.shape[-3:])  # (B, N, L, Dh)
    g_gathered = einsum("bnij,bnid->ijnd", flat_g, flat_qt)  # (L, L, N, Dh)
    g_e = real(np.zeros((pe.shape[0],) + g_gathered.shape[2:]))  # (2S + 1, N, Dh)
    np.add.at(g_e, index, g_gathered)
    g_w = einsum("ti,to->io", pe, g_e.reshape(g_e.shape[0], -1))  # (d, N·Dh)
    g_scale = (g_qt * q).reshape((-1, q.shape[-1])).sum(axis=0) * d_factor  # (Dh,)
    return g_qt * factor, {"per_dim_scale": g_scale, "W_pos": g_w}

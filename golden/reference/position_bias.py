"""Position biases: score terms that depend on where query and key sit, added to the scores
before the softmax. ALiBi's linear distance penalty (no parameter) and T5's learned table
read at the bucket of each distance, with the table's gradient.

Shape legend: N heads, L sequence length (query i and key j both in token order), num_buckets
the rows of T5's table (num_buckets, N).
"""

from __future__ import annotations

import numpy as np

from golden.specification.decoder import alibi_slopes, relative_position_bucket
from golden.reference.arithmetic import number, real


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
    distance j − i (golden.specification.decoder.relative_position_bucket, bidirectional unless
    causal); returns (bias, buckets (L, L))."""
    distance = np.arange(length)[None, :] - np.arange(length)[:, None]  # j − i (L, L)
    buckets = relative_position_bucket(distance, not c["causal"],
                                       c["relative_attention_num_buckets"],
                                       c["relative_attention_max_distance"])
    return np.moveaxis(real(table)[buckets], -1, -3), buckets


def bucket_sums(g_bias, buckets, shape):
    """The gradient of relative_term's gather: g_bias (..., N, L, L) summed over the batch and
    scattered into the buckets, (num_buckets, N), in index order."""
    g = g_bias.reshape((-1,) + g_bias.shape[-3:]).sum(axis=0)  # (N, L, L)
    out = real(np.zeros(shape))
    np.add.at(out, buckets, np.moveaxis(g, 0, -1))  # (L, L, N) into (num_buckets, N)
    return out

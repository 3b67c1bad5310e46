"""What both twins' GroupedQueryAttention do besides RoPE, written once: the QK norms, ALiBi's
bias (its slopes in NumPy float64), T5's buckets and Transformer-XL's
sinusoidal table of distances (NumPy float64). Only arithmetic operators, indexing and the
framework functions the caller passes (``mean``, ``rsqrt``, ``log1p``): the same code runs on
torch tensors and JAX arrays. The float64 reference states the same maths on its own
(golden.reference.qk_norm_stage, alibi_term, sinusoid_term: it shares only the slopes and the
buckets); golden.specification.variants.QK_NORMS lists the kinds. The query temperature's kinds
are golden.specification.temperature's, the output stage golden.specification.outputs'.

Shape legend: N heads, L tokens, Dh head width.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np


def qk_normalize(x, kind, weight, eps, *, mean, rsqrt, bias=None):
    """QK norm ``kind`` of x (..., width) over its last axis, in x's dtype (the caller widens
    it first): x̂ = (x − μ) / √(mean((x − μ)²) + ε), μ = mean(x) for "layer" and
    "layer_with_bias" and 0 otherwise, times ``weight`` ("rms", "layer", "layer_with_bias",
    "rms_across_heads"; broadcast against x by the caller), 1 + weight ("rms_one_plus") or
    nothing ("l2"); plus ``bias`` ("layer_with_bias", Chameleon's; broadcast as the weight).
    ``mean(t)``: the mean over the last axis, kept as an axis of size 1."""
    centred = x - mean(x) if kind in CENTRED else x
    unit = centred * rsqrt(mean(centred * centred) + eps)
    if kind == "l2":
        return unit
    y = unit * (1 + weight) if kind == "rms_one_plus" else unit * weight
    return y if bias is None else y + bias


# The QK norms that subtract the mean (LayerNorms), and those whose weights are per head (N, Dh).
CENTRED = ("layer", "layer_with_bias")
PER_HEAD_WEIGHTS = ("layer", "layer_with_bias")


def weight_broadcast(kind, weight):
    """The norm's weight (or bias) shaped to broadcast against (..., heads, L, Dh): "layer"'s
    and "layer_with_bias"'s (heads, Dh) get an L axis; the others' (Dh,) and (heads·Dh,)
    broadcast as they are."""
    return None if weight is None else weight[:, None, :] if kind in PER_HEAD_WEIGHTS else weight


def sliding_window(w, causal):
    """The core's (left, right) window for Hugging Face's ``sliding_window`` W: W keys including
    the query itself (kv_idx > q_idx − W), on both sides when not causal; None for None. A pair
    (left, right) (not causal: a Conformer's left context and lookahead, Gemma 3n's audio
    encoder) is the core's window as it is: keys p − left … p + right."""
    if w is None:
        return None
    if isinstance(w, (tuple, list)):
        return (int(w[0]), int(w[1]))
    return (w - 1, 0 if causal else w - 1)


def refuse_renamed(given) -> None:
    """GroupedQueryAttention's arguments of before the ``sliding_window`` change, each refused
    with its replacement (a ValueError, not Python's bare ``unexpected keyword argument``):
    ``local_window_size`` was the core's window (w keys each side, cut by causal), which is
    Hugging Face's W = w + 1 keys including the query."""
    if "local_window_size" in given:
        w = given["local_window_size"]
        raise ValueError(f"local_window_size is not an argument of GroupedQueryAttention any "
                         f"more, got local_window_size={w!r}: pass sliding_window=W, Hugging "
                         f"Face's meaning (W keys including the query: local_window_size=w "
                         f"with causal=True is sliding_window=w + 1; without causal, a pair "
                         f"sliding_window=(left, right) is the core's window as it is)")


# ALiBi (Press et al.), as Hugging Face's BLOOM, MPT and Falcon define the per-head slopes.
ALIBI_KINDS = ("bloom", "mpt", "falcon")


def alibi_slopes(num_heads, kind, bias_max=8):
    """The slopes m_h (N,) float64 of ALiBi ``kind``, each family's rule in HF's order of heads:
    "bloom" and "falcon" (``_get_alibi_slopes``): with P = 2^⌊log2 N⌋, m_h = 2^(−8h/P) for
    h = 1 … P, then for N > P the odd powers 2^(−4(2i − 1)/P), i = 1 … N − P; "falcon" rounds
    them to bfloat16 as HF's ``build_alibi_tensor`` does. "mpt" (``build_mpt_alibi_tensor``):
    with P = 2^⌈log2 N⌉, m_h = 2^(−h · bias_max / P) for h = 1 … P, and for N < P the even-
    indexed ones first, then the odd, the first N kept. Powers of two, exact, when the
    exponents are integers (N ≤ 8 with bias_max = 8); otherwise 2.0 ** x (HF: float32)."""
    if kind == "mpt":
        p = 2 ** math.ceil(math.log2(num_heads))
        slopes = 2.0 ** -(np.arange(1, p + 1, dtype=np.float64) * (bias_max / p))
        return np.concatenate([slopes[1::2], slopes[::2]])[:num_heads] if p != num_heads else slopes
    p = 2 ** math.floor(math.log2(num_heads))
    slopes = 2.0 ** (-8.0 * np.arange(1, p + 1, dtype=np.float64) / p)
    extra = 2.0 ** (-4.0 * np.arange(1, 2 * (num_heads - p), 2, dtype=np.float64) / p)
    slopes = np.concatenate([slopes, extra[:min(p, num_heads - p)]])
    return _bfloat16(slopes) if kind == "falcon" else slopes


def _bfloat16(x):
    """float64 ``x`` rounded to float32, then to bfloat16 (8 significant bits, ties to even)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return u.view(np.float32).astype(np.float64)


def alibi_bias(slopes, distance):
    """The ALiBi bias m_h · (j − p) (..., N, L, Lk) from the slopes (N,) and the distances
    key position − query position ``distance`` (..., L, Lk), both of one framework and dtype.
    HF's BLOOM and Falcon add m_h · j and MPT m_h · (j − (Lk − 1)): the same row by row up to a
    constant, which softmax removes; this relative form is the one a KV cache reproduces."""
    return slopes[:, None, None] * distance[..., None, :, :]


# Relative position buckets: T5's (Hugging Face's T5Attention._relative_position_bucket) and the
# clipped distances of Phi-4-multimodal's audio encoder (Phi4MultimodalAudioRelativeAttentionBias).
BUCKET_RULES = ("t5", "clipped", "clipped_symmetric")


def relative_position_bucket(distance, bidirectional, num_buckets, max_distance, rule="t5"):
    """The bucket (int64, distance's shape) of each integer ``distance`` = key − query.

    ``rule="t5"``, by HF's rule in its float32 operations and order: bidirectional, half the
    buckets for keys after the query; then max_exact = (those buckets) // 2 exact buckets for
    |d| < max_exact, and max_exact + ⌊ln(|d| / max_exact) / ln(max_distance / max_exact) ·
    (buckets − max_exact)⌋ (at most buckets − 1) beyond. Causal: keys after the query share
    bucket 0.
    ``rule="clipped"`` (Phi-4's audio, num_buckets = 2M, M = max_distance): d clipped to
    [−M, M − 1], plus M; ``"clipped_symmetric"`` (num_buckets = M): |d| clipped to M − 1 (HF
    clips d to [−M, M − 1] first, and its table of M rows has no row M: the two agree wherever
    HF's runs). Both ignore ``bidirectional``: the mask decides which keys a query sees."""
    d = np.asarray(distance, dtype=np.int64)
    if rule == "clipped":
        return np.clip(d, -max_distance, max_distance - 1) + max_distance
    if rule == "clipped_symmetric":
        return np.minimum(np.abs(d), max_distance - 1)
    buckets = np.zeros_like(d)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (d > 0) * num_buckets
        d = np.abs(d)
    else:
        d = -np.minimum(d, 0)
    max_exact = num_buckets // 2
    with np.errstate(divide="ignore"):  # d = 0: log 0, never selected
        ratio = np.log(d.astype(np.float32) / np.float32(max_exact))
        large = ratio / np.float32(math.log(max_distance / max_exact)) * np.float32(
            num_buckets - max_exact)
    large = max_exact + np.where(d < max_exact, 0, large).astype(np.int64)
    return buckets + np.where(d < max_exact, d, np.minimum(large, num_buckets - 1))


def bucket_table(span, bidirectional, num_buckets, max_distance, rule="t5"):
    """relative_position_bucket of the distances −span … span, (2·span + 1,): the bucket of
    distance d is entry d + span (what a twin indexes with distances it computes, traced)."""
    return relative_position_bucket(np.arange(-span, span + 1), bidirectional, num_buckets,
                                    max_distance, rule)


def relative_bias(table, buckets, *, moveaxis):
    """T5's score bias (..., N, L, Lk): the learned ``table`` (num_buckets, N) at each of
    ``buckets`` (..., L, Lk), heads moved before the two position axes; ``moveaxis`` is the
    framework's (torch.movedim, jnp.moveaxis, np.moveaxis)."""
    return moveaxis(table[buckets], -1, -3)  # (..., L, Lk, N) -> (..., N, L, Lk)


# Transformer-XL's relative positional attention (Dai et al. 2019, section 3.3), as NVIDIA's
# FastConformer encoders use it (Hugging Face's ParakeetEncoderAttention): a content bias u and a
# position bias v per head, and the keys of each distance projected from a sinusoidal table.
# Shaw et al. (2018)'s relative key embeddings, as IBM's Granite Speech Conformer has them: one
# learned table E (2M + 1, Dh) shared by every head, the score of query i and key j gaining
# scale · q_i · E[M + clip(p_i − j, −M, M)] (relative_max_distance M).
# "conformer_timing": the relative position logits of Google's USM Conformer as Gemma 3n's and
# Gemma 4's audio encoders have them (timing_table), named for the table they read.
RELATIVE_POSITIONS = ("transformer_xl", "shaw", "conformer_timing")
SINUSOID_BASE = 10000.0


@lru_cache(maxsize=32)
def sinusoid_table(width, span):
    """Transformer-XL's sinusoidal encodings of the key − query distances d = −span … span,
    (2·span + 1, width) float64, read-only: row span + d is R(−d), the encoding of the query −
    key distance t = −d (Transformer-XL's R_{i−j}), R(t) = (sin tω_0, cos tω_0, sin tω_1,
    cos tω_1, …), ω_k = 10000^(−2k/width), width even. Hugging Face's Parakeet forms the same
    table in float32 (ω, t·ω, sin and cos), rows ordered t = L − 1 … −(L − 1); its rel_shift
    reads row L − 1 − (i − j) for query i and key j, which is this row span + (j − i)."""
    t = -np.arange(-span, span + 1, dtype=np.float64)[:, None]  # (2S + 1, 1): query − key
    omega = SINUSOID_BASE ** -(np.arange(0, width, 2, dtype=np.float64) / width)  # (width/2,)
    angles = t * omega  # (2S + 1, width/2)
    table = np.stack([np.sin(angles), np.cos(angles)], axis=-1).reshape(2 * span + 1, width)
    table.flags.writeable = False
    return table


# Gemma 3n's and Gemma 4's audio attention (Google's USM Conformer, lingvo's "timing signal"):
# the keys of each query − key distance t projected from timing(t) = (sin tι_0, …, sin tι_{n−1},
# cos tι_0, …, cos tι_{n−1}), n = width / 2, ι_k = exp(−k · ln(10⁴) / max(n − 1, 1)): other
# frequencies than Transformer-XL's, and the sines and cosines in two halves, not in pairs.
TIMING_MAX_TIMESCALE = 1.0e4


@lru_cache(maxsize=32)
def timing_table(width, span):
    """The timing signal of the key − query distances d = −span … span, (2·span + 1, width)
    float64, read-only: row span + d is timing(−d), the encoding of the query − key distance
    t = −d, timing(t) = (sin tι, cos tι) (two halves), ι_k = exp(−k·ln(10⁴) / max(width/2 − 1,
    1)), width even. Hugging Face's Gemma 3n (Gemma3nAudioRelativePositionEmbedding) and Gemma 4
    (Gemma4AudioRelPositionalEncoding) form it in float32 for t = P … −F (Gemma 4: t = C//2 … 0)
    and read row t = p − j for query p and key j through their rel_shift."""
    n = width // 2
    t = -np.arange(-span, span + 1, dtype=np.float64)[:, None]  # (2S + 1, 1): query − key
    inv = np.exp(np.arange(n, dtype=np.float64) * -(math.log(TIMING_MAX_TIMESCALE) /
                                                     max(n - 1, 1)))  # (width/2,)
    angles = t * inv  # (2S + 1, width/2)
    table = np.concatenate([np.sin(angles), np.cos(angles)], axis=-1)
    table.flags.writeable = False
    return table

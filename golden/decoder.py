"""What both twins' GroupedQueryAttention do to q and k besides RoPE, written once: the QK norms
and the query temperature. Only arithmetic operators, indexing and the framework functions the
caller passes (``mean``, ``rsqrt``, ``log1p``): the same code runs on torch tensors and JAX
arrays. The float64 reference states the same maths on its own (golden.reference.qk_norm_stage,
temperature_factors); golden.variants.QK_NORMS lists the kinds.

Shape legend: N heads, L tokens, Dh head width.
"""

from __future__ import annotations


def qk_normalize(x, kind, weight, eps, *, mean, rsqrt):
    """QK norm ``kind`` of x (..., width) over its last axis, in x's dtype (the caller widens
    it first): x̂ = (x − μ) / √(mean((x − μ)²) + ε), μ = mean(x) for "layer" and 0 otherwise,
    times ``weight`` ("rms", "layer", "rms_across_heads"; broadcast against x by the caller),
    1 + weight ("rms_one_plus") or nothing ("l2"). ``mean(t)``: the mean over the last axis,
    kept as an axis of size 1."""
    centred = x - mean(x) if kind == "layer" else x
    unit = centred * rsqrt(mean(centred * centred) + eps)
    if kind == "l2":
        return unit
    return unit * (1 + weight) if kind == "rms_one_plus" else unit * weight


def temperature(positions, beta, floor_scale, shift, *, log1p):
    """Llama 4's query temperature 1 + β·ln(1 + ⌊(p + shift) / F⌋) at integer ``positions``
    (shift 1 for Llama 4, 0 for Ministral 3); ``log1p`` of the floor, already in the compute
    dtype, is the caller's."""
    return 1 + beta * log1p((positions + shift) // floor_scale)


def weight_broadcast(kind, weight):
    """The norm's weight shaped to broadcast against (..., heads, L, Dh): "layer"'s (heads, Dh)
    gets an L axis; the others' (Dh,) and (heads·Dh,) broadcast as they are."""
    return None if weight is None else weight[:, None, :] if kind == "layer" else weight


def sliding_window(w, causal):
    """The core's (left, right) window for Hugging Face's ``sliding_window`` W: W keys including
    the query itself (kv_idx > q_idx − W), on both sides when not causal; None for None."""
    return None if w is None else (w - 1, 0 if causal else w - 1)

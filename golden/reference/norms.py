"""The norms of the decoder's heads, forward and backward: QK norms (golden.reference.stages'
qk_norm_stage) and Gemma 4's value norm (golden.reference.block).

Shape legend: x (..., width), the norm over its last axis.
"""

from __future__ import annotations

import numpy as np

from golden.reference.arithmetic import number

CENTRED = ("layer", "layer_with_bias")  # the norms that subtract the mean: LayerNorms

# QK normalisation: y = x̂ · w with x̂ = (x − μ) r, r = (mean((x − μ)²) + ε)^(−1/2) over the last
# axis (μ = mean(x) for the LayerNorms "layer" and "layer_with_bias", 0 for the RMS kinds), and w
# the weight ("rms", "layer", "layer_with_bias", "rms_across_heads"), 1 + the weight
# ("rms_one_plus") or 1 ("l2"); "layer_with_bias"'s bias is added after (qk_norm_stage). Where
# each applies and its weight's shape: golden.specification.variants.QK_NORMS.


def normalize(kind, x, weight, eps):
    """(y, saved) of one QK norm on x (..., width); ``weight`` already broadcastable to x."""
    n = number(x.shape[-1])
    centred = x - x.sum(axis=-1, keepdims=True) / n if kind in CENTRED else x
    r = number(1) / np.sqrt((centred * centred).sum(axis=-1, keepdims=True) / n + eps)
    unit = centred * r
    w = (None if weight is None else number(1) + weight if kind == "rms_one_plus" else weight)
    return (unit if w is None else unit * w), (unit, r, w)


def normalize_backward(kind, saved, g):
    """(dL/dx, dL/dw broadcast like w, or None) of ``normalize``: with h = g ⊙ w,
    dL/dx = r (h − mean(h) − x̂ mean(h ⊙ x̂)), the mean(h) term for the LayerNorms only."""
    unit, r, w = saved
    n = number(unit.shape[-1])
    h = g if w is None else g * w
    inner = h - unit * ((h * unit).sum(axis=-1, keepdims=True) / n)
    if kind in CENTRED:
        inner = inner - h.sum(axis=-1, keepdims=True) / n
    return r * inner, None if w is None else g * unit

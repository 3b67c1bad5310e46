"""The decoder's stages (golden.reference.block.Stage) on the split heads between the
projections and the core: RoPE, the QK norms and the query temperature.

Shape legend: N query heads, Nkv key-value heads, L sequence length, Dh head width; q is
(..., N, L, Dh) and k (..., Nkv, L, Dh), rd/2 the rotated pairs (golden.reference.rotary).
"""

from __future__ import annotations

import numpy as np

from golden.reference.arithmetic import number, real
from golden.reference.block import Stage, clamp, merge_heads, split_heads
from golden.reference.core import unbroadcast
from golden.reference.norms import CENTRED, normalize, normalize_backward
from golden.reference.rotary import turn


def rope_stage(cos, sin, interleaved, blocks=1) -> Stage:
    """RoPE on q and k by (cos, sin) (..., L, rd/2), the attention factor in both (turn, its
    pairs in ``blocks``); the transpose of a rotation turns by the opposite angle, times the
    same factor, and the pass-through features' is the identity."""
    def rotate(t, s):
        return turn(t, cos, s, interleaved, blocks)
    return Stage(lambda q, k: (rotate(q, sin), rotate(k, sin), None),
                 lambda s, g_q, g_k: (rotate(g_q, -sin), rotate(g_k, -sin), {}))


def qk_norm_stage(kind, q_weight, k_weight, eps, q_bias=None, k_bias=None) -> Stage:
    """The QK norm ``kind`` on q and k: per head over Dh ("rms", "rms_one_plus", "l2": no
    weight; "layer": weights (N, Dh) and (Nkv, Dh), one row per head; "layer_with_bias":
    those weights and biases ``q_bias`` (N, Dh), ``k_bias`` (Nkv, Dh) added after, Chameleon's),
    or over all of a token's heads ("rms_across_heads": weights (N·Dh,) and (Nkv·Dh,), OLMo 2).
    A bias's gradient is the output gradient summed over every axis but (heads, Dh)."""
    across = kind == "rms_across_heads"

    def shaped(w):  # the weight broadcast against (..., heads, L, Dh), or the merged heads
        return None if w is None else w[:, None, :] if kind in CENTRED else w

    def forward(q, k):
        if across:
            heads = (q.shape[-3], k.shape[-3])
            (q, sq), (k, sk) = (normalize(kind, merge_heads(t), w, eps)
                                for t, w in ((q, q_weight), (k, k_weight)))
            return split_heads(q, heads[0]), split_heads(k, heads[1]), (sq, sk)
        (q, sq), (k, sk) = (normalize(kind, t, shaped(w), eps)
                            for t, w in ((q, q_weight), (k, k_weight)))
        q, k = (t if b is None else t + shaped(b)  # Chameleon: y = x̂ · w + b per head
                for t, b in ((q, q_bias), (k, k_bias)))
        return q, k, (sq, sk)

    def backward(saved, g_q, g_k):
        grads = {}
        out = []
        for g, s, name, w, b in ((g_q, saved[0], "q_norm", q_weight, q_bias),
                                 (g_k, saved[1], "k_norm", k_weight, k_bias)):
            heads = g.shape[-3]
            gx, gw = normalize_backward(kind, s, merge_heads(g) if across else g)
            out.append(split_heads(gx, heads) if across else gx)
            if gw is not None:
                grads[name] = unbroadcast(gw, shaped(w).shape).reshape(w.shape)
            if b is not None:  # dL/db = g summed over the axes b was broadcast along
                grads[f"{name}_bias"] = unbroadcast(g, shaped(b).shape).reshape(b.shape)
        return out[0], out[1], grads

    return Stage(forward, backward)


def clamp_stage(clip) -> Stage:
    """q and k clamped to [−c, c] (OLMoE's clip_qkv after the QK norm); the gradient passes
    where they were inside."""
    def forward(q, k):
        (q, k), inside = clamp((q, k), clip, ("query", "key"))
        return q, k, inside
    return Stage(forward, lambda inside, g_q, g_k: (np.where(inside[0], g_q, number(0)),
                                                   np.where(inside[1], g_k, number(0)), {}))


def temperature_factors(positions, t):
    """The query temperature ``t`` (golden.specification.temperature, a fixed kind) at integer
    ``positions``: Llama 4's 1 + β·ln(1 + ⌊(p + s)/F⌋), the power (1 + (p + 1)/n)^α or the log
    1 + α·ln(max((p + 1)/n, 1))."""
    p = np.asarray(positions)
    kind = t.get("kind", "llama4")
    if kind == "llama4":
        steps = (p + int(t["shift"])) // int(t["floor_scale"])
        return number(1) + number(t["beta"]) * np.log(real((1 + steps).astype(np.float64)))
    ratio = real((p + 1).astype(np.float64)) / number(t["length"])  # (p + 1)/n
    if kind == "power":
        return np.exp(number(t["alpha"]) * np.log(number(1) + ratio))
    return number(1) + number(t["alpha"]) * np.log(np.maximum(ratio, number(1)))


def learned_temperature_stage(positions, scale, bias) -> Stage:
    """Mistral Large 4's temperature: q (..., N, L, Dh) times s_h·ln(p + 1) + b_h, ``scale`` s
    and ``bias`` b (N,); their gradients Σ g_q·q·ln(p + 1) and Σ g_q·q over every other axis."""
    logs = np.log(real((np.asarray(positions) + 1).astype(np.float64)))[..., None, :, None]
    factors = scale[:, None, None] * logs + bias[:, None, None]  # (..., N, L, 1)

    def backward(q, g_q, g_k):
        g = (g_q * q).sum(axis=-1, keepdims=True)  # (..., N, L, 1)
        axes = tuple(range(g.ndim - 3)) + (-2, -1)  # all but the heads'
        g_bias, g_scale = g.sum(axis=axes), (g * logs).sum(axis=axes)
        return g_q * factors, g_k, {"temperature_scale": g_scale, "temperature_bias": g_bias}

    return Stage(lambda q, k: (q * factors, k, q), backward)


def temperature_stage(factors) -> Stage:
    """The query temperature: q times ``factors`` (..., 1, L, 1), k unchanged."""
    return Stage(lambda q, k: (q * factors, k, None),
                 lambda s, g_q, g_k: (g_q * factors, g_k, {}))

"""The float64 NumPy reference: the maths written out plainly, with analytic gradients.

Nothing here imports torch or JAX. Every function is loop-free and works on any number of leading
axes (``...``), so the unbatched (Lq, Dk), per-head (H, Lq, Dk) and batched (B, H, Lq, Dk) layouts
share one code path.

Shape legend: B batch, H heads, Lq query length, Lk key length, Dk key width, Dv value width.

Forward, with P the masked softmax and K the dropout keep-mask:
    S = scale · Q Kᵀ + bias                    (..., Lq, Lk)
    P = exp(S − max S) · allowed / Σ_row        (a row with nothing allowed is all zeros)
    A = P · K / (1 − p)                         the weights returned and applied
    O = A V                                     (..., Lq, Dv)
The fixtures' scalar loss is  L = Σ O ⊙ dO + Σ A ⊙ dA  for fixed random cotangents dO and dA.
"""

from __future__ import annotations

import numpy as np

from golden.validate import check_attention_args


def allowed_positions(weights_shape, mask=None, is_causal=False):
    """Boolean (..., Lq, Lk): True where query i may attend to key j."""
    lq, lk = weights_shape[-2:]
    allowed = np.ones(weights_shape, dtype=bool)
    if is_causal:
        allowed = allowed & np.tri(lq, lk, dtype=bool)  # j <= i, top-left aligned
    if mask is not None:
        allowed = allowed & mask
    return allowed


def masked_softmax(scores, allowed):
    """Softmax over the last axis among allowed entries; an all-masked row gives zeros."""
    shifted = np.where(allowed, scores, -np.inf)
    row_max = shifted.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.where(allowed, np.exp(shifted - row_max), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    return e / np.where(total > 0, total, 1.0)


def scaled_dot_product_attention(
    query, key, value, mask=None, bias=None, *,
    is_causal=False, scale=None, dropout_rate=0.0, dropout_mask=None,
):
    """Return (output, weights) in float64."""
    out, weights, _ = sdpa_forward(
        query, key, value, mask, bias, is_causal=is_causal, scale=scale,
        dropout_rate=dropout_rate, dropout_mask=dropout_mask,
    )
    return out, weights


def sdpa_forward(query, key, value, mask=None, bias=None, *,
                 is_causal=False, scale=None, dropout_rate=0.0, dropout_mask=None):
    """Forward pass; also returns what the backward pass needs."""
    shape = check_attention_args(query, key, value, mask, bias, scale=scale,
                                 dropout_rate=dropout_rate, dropout_mask=dropout_mask)
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (query, key, value))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else float(scale)
    scores = scale * np.einsum("...qd,...kd->...qk", q, k)
    if bias is not None:
        scores = scores + np.asarray(bias, dtype=np.float64)
    probs = masked_softmax(scores, allowed_positions(shape, mask, is_causal))
    keep = np.ones(shape) if dropout_mask is None else np.broadcast_to(dropout_mask, shape)
    keep_scaled = keep / (1.0 - dropout_rate)
    weights = probs * keep_scaled
    out = np.einsum("...qk,...kv->...qv", weights, v)
    cache = dict(q=q, k=k, v=v, scale=scale, probs=probs, keep_scaled=keep_scaled,
                 weights=weights, bias_shape=None if bias is None else np.shape(bias))
    return out, weights, cache


def unbroadcast(grad, shape):
    """Sum ``grad`` over the axes along which an array of ``shape`` was broadcast."""
    extra = grad.ndim - len(shape)
    grad = grad.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(axis=axes, keepdims=True)


def sdpa_backward(cache, d_output, d_weights):
    """Gradients of L = Σ O ⊙ dO + Σ A ⊙ dA with respect to query, key, value (and bias)."""
    q, k, v, weights, probs = cache["q"], cache["k"], cache["v"], cache["weights"], cache["probs"]
    g_weights = np.einsum("...qv,...kv->...qk", d_output, v) + d_weights   # dL/dA
    g_value = np.einsum("...qk,...qv->...kv", weights, d_output)
    g_probs = g_weights * cache["keep_scaled"]                              # dL/dP
    g_scores = probs * (g_probs - (g_probs * probs).sum(axis=-1, keepdims=True))  # softmax vjp
    grads = {
        "query": cache["scale"] * np.einsum("...qk,...kd->...qd", g_scores, k),
        "key": cache["scale"] * np.einsum("...qk,...qd->...kd", g_scores, q),
        "value": g_value,
    }
    if cache["bias_shape"] is not None:
        grads["bias"] = unbroadcast(g_scores, cache["bias_shape"])
    return grads

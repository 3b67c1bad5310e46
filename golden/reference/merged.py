"""T5Gemma 2's merged self- and cross-attention (GroupedQueryAttention with
``merged_context=True``): one softmax over the decoder's own keys and the context's.

Shape legend as in golden.reference.block: B batch, N query heads over Nkv key-value heads,
L the decoder's length, Lc the context's, Dh head width, d_in the features of x and context.
    q, k, v = split(x W_q + b_q), split(x W_k + b_k), split(x W_v + b_v)   (..., N|Nkv, L, Dh)
    q, k = stages(q, k)                              the QK norm, then RoPE at 0 … L − 1
    k_c, v_c = k_norm(split(c W_k + b_k)), split(c W_v + b_v)   (..., Nkv, Lc, Dh), no RoPE
    O = softmax(cap(scale · q [k ; k_c]ᵀ) + mask) [v ; v_c]      (..., N, L, Dh)
    y = merge(O) W_out + b_out
The mask over the L + Lc keys: self key j of query i when j ≤ i, i − j < W (sliding_window)
and j < query_seq_lengths; context key t when context_mask[t]; and the given mask (..., [N,]
L, L + Lc). Query rows past query_seq_lengths are padding (zero weights).
"""

from __future__ import annotations

import numpy as np

from golden.reference.arithmetic import number, real
from golden.reference.block import linear, linear_backward, merge_heads, split_heads
from golden.reference.core import sdpa_backward, sdpa_forward, unbroadcast
from golden.reference.norms import normalize, normalize_backward


def _shaped(kind, w):
    """The key norm's weight broadcast against (..., Nkv, Lc, Dh): "layer"'s (Nkv, Dh) rows."""
    return None if w is None else w[:, None, :] if kind == "layer" else w


def merged_allowed(lead, length, context_mask, lc, window, lengths):
    """(..., 1, L, L + Lc) bool: causal (and within ``window``) self keys among the first
    ``lengths`` tokens, then the context's real tokens."""
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    own = (j <= i) & (True if window is None else i - j < window)        # (L, L)
    own = np.broadcast_to(own, tuple(lead) + (length, length))
    if lengths is not None:
        own = own & (j < np.asarray(lengths)[..., None, None])
    real_tokens = (np.ones(tuple(lead) + (lc,), bool) if context_mask is None
                   else np.asarray(context_mask, bool))                   # (..., Lc)
    theirs = np.broadcast_to(real_tokens[..., None, :], tuple(lead) + (length, lc))
    return np.concatenate([own, theirs], axis=-1)[..., None, :, :]


def merged_forward(c, inputs, params, stages, norm):
    """(y, weights (..., N, L, L + Lc), saved); ``stages`` run on (q, k) of x, ``norm`` (kind,
    ε) or None the QK norm whose key half also runs on the context's keys."""
    x, context = real(inputs["x"]), real(inputs["context"])
    p = {n: real(a) for n, a in params.items()}
    n, nkv = c["num_heads"], c["num_kv_heads"]

    def project(t, role, heads):
        return split_heads(linear(t, p[f"W_{role}"], p.get(f"b_{role}")), heads)

    q, k, v = project(x, "query", n), project(x, "key", nkv), project(x, "value", nkv)
    staged = []
    for stage in stages:
        q, k, s = stage.forward(q, k)
        staged.append(s)
    k_c, v_c = project(context, "key", nkv), project(context, "value", nkv)
    normed = None
    if norm is not None:
        k_c, normed = normalize(norm[0], k_c, _shaped(norm[0], p["k_norm"]), norm[1])
    length, lengths = x.shape[-2], inputs.get("query_seq_lengths")
    allowed = merged_allowed(x.shape[:-2], length, inputs.get("context_mask"),
                             context.shape[-2], c.get("sliding_window"), lengths)
    mask = inputs.get("mask")
    if mask is not None:
        mask = np.asarray(mask)
        allowed = allowed & (mask if mask.ndim == x.ndim + 1 else mask[..., None, :, :])
    train = "dropout_mask" in inputs
    out, weights, attn = sdpa_forward(
        q, np.concatenate([k, k_c], axis=-2), np.concatenate([v, v_c], axis=-2), allowed,
        scale=c.get("scale"), softcap=c.get("softcap"), query_seq_lengths=lengths,
        dropout_rate=c.get("dropout", 0.0) if train else 0.0,
        dropout_mask=inputs.get("dropout_mask"))
    merged = merge_heads(out)                                   # (..., L, N·Dh)
    y = linear(merged, p["W_out"], p.get("b_out"))
    saved = dict(merged_context=True, x=x, context=context, p=p, heads=n, stages=stages,
                 staged=staged, norm=norm, normed=normed, merged=merged, attn=attn,
                 length=length)
    return y, weights, saved


def merged_backward(saved, d_y, d_weights):
    """Gradients of Σ y⊙dy + Σ A⊙dA: x, context and every parameter (W_key's and W_value's
    the sums of their self and context parts, k_norm's likewise)."""
    p, grads, length = saved["p"], {}, saved["length"]
    g_merged = linear_backward(saved["merged"], p["W_out"], real(d_y), grads,
                               ("W_out", "b_out" if "b_out" in p else None))
    g = sdpa_backward(saved["attn"], split_heads(g_merged, saved["heads"]), real(d_weights))
    g_q = g["query"]
    g_k, g_kc = g["key"][..., :length, :], g["key"][..., length:, :]
    g_v, g_vc = g["value"][..., :length, :], g["value"][..., length:, :]
    for stage, s in zip(reversed(saved["stages"]), reversed(saved["staged"])):
        g_q, g_k, g_params = stage.backward(s, g_q, g_k)
        grads.update(g_params)
    norm = saved["norm"]
    if norm is not None:
        g_kc, g_w = normalize_backward(norm[0], saved["normed"], g_kc)
        if g_w is not None:
            w = p["k_norm"]
            g_w = unbroadcast(g_w, _shaped(norm[0], w).shape).reshape(w.shape)
            grads["k_norm"] = grads.get("k_norm", number(0) * w) + g_w
    grads["x"], grads["context"] = 0, 0
    for source, role, g_role in (("x", "query", g_q), ("x", "key", g_k), ("x", "value", g_v),
                                 ("context", "key", g_kc), ("context", "value", g_vc)):
        part = {}
        grads[source] = grads[source] + linear_backward(
            saved[source], p[f"W_{role}"], merge_heads(g_role), part,
            (f"W_{role}", f"b_{role}" if f"b_{role}" in p else None))
        for name, a in part.items():
            grads[name] = grads[name] + a if name in grads else a
    return grads

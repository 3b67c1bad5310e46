"""The core: scaled dot-product attention, forward and hand-written backward, with the masks
and the softmax it is made of.

Nothing here imports torch or JAX. Every function is loop-free and works on any number of
leading axes (``...``), so the unbatched (Lq, Dk), per-head (H, Lq, Dk) and batched (B, H, Lq, Dk)
layouts share one code path; it runs in either arithmetic of golden.reference.arithmetic.

Shape legend: B batch, H heads (Hkv of key and value, H a multiple of Hkv), Lq query length,
Lk key length, Dk key width, Dv value width, G = H / Hkv query heads per key-value head.

Forward, with P the masked softmax and K the dropout mask:
    K', V' = K, V with each kv head repeated G times     query head h reads kv head h // G
    R = scale · Q K'ᵀ + T                                 (..., H, Lq, Lk)
    S = c · tanh(R / c) + bias                            (softcap c; S = R + bias without)
    P = exp(S − max S) · allowed / Σ_row                  (a row with nothing allowed: zeros)
    A = P · K / (1 − p)                                   the weights returned and applied
    O = A V'                                              (..., H, Lq, Dv)
T is sdpa_forward's ``position_term``, the relative positions' terms (Transformer-XL's, Shaw's,
the USM Conformer's: golden.reference.position_bias), part of R and so inside the cap, as Gemma 3n's and
Gemma 4's audio encoders cap the sum of their content and position logits; ``bias`` (ALiBi's,
T5's, the caller's) is added after the cap. No fixture combined a relative position term with a
soft cap before this rule was written.
Key j sits at position j, query i at i + query_offset. Query i may attend key j when the mask
allows it, j ≤ position (is_causal), position − left ≤ j ≤ position + right (the window),
j // C = position // C (attention_chunk_size C: Llama 4's chunks of C tokens),
j < key_value_seq_lengths and i < query_seq_lengths (rows past it attend nothing).
With key_indices (a selection, DeepSeek-V3.2's indexer's top-k), query i may attend key j
only when j is also one of key_indices[..., i, :] (selected_mask: the boolean mask it stands for).
With sinks (GPT-OSS), head h's logit s_h joins every row's softmax as one more entry that takes
no value: P = exp(S − m) · allowed / (Σ_row + exp(s_h − m)), m = max(max_row S, s_h), so a
row's weights sum to 1 − p_sink and a row with nothing allowed gives zeros.
The fixtures' scalar loss is  L = Σ O ⊙ dO + Σ A ⊙ dA  for fixed random cotangents dO and dA.
"""

from __future__ import annotations

import numpy as np

from golden.reference.arithmetic import einsum, number, number_type, real
from golden.specification.validate import (
    check_attention_args, check_key_indices, window, with_head_axis,
)


def _checkable(a):
    """What check_attention_args reads of ``a`` (shape and dtype): an exact array stands in
    as float64, without a copy."""
    if isinstance(a, np.ndarray) and a.dtype == object:
        return np.broadcast_to(np.zeros((), dtype=np.float64), a.shape)
    return a


def per_batch(x, rank):
    """An int or a (B,) integer array, shaped to broadcast against (B, H, Lq, Lk) of ``rank``."""
    x = np.asarray(x)
    return x.reshape(x.shape + (1,) * (rank - x.ndim))


def allowed_positions(weights_shape, mask=None, is_causal=False, *, local_window_size=None,
                      attention_chunk_size=None, query_offset=None, query_seq_lengths=None,
                      key_value_seq_lengths=None):
    """Boolean (..., Lq, Lk): True where query i may attend to key j."""
    rank, (lq, lk) = len(weights_shape), weights_shape[-2:]
    row = np.arange(lq)[:, None]                                # query index i   (Lq, 1)
    key = np.arange(lk)                                         # key position j  (Lk,)
    pos = row + per_batch(0 if query_offset is None else query_offset, rank)  # (..., Lq, 1)
    left, right = window(local_window_size)
    allowed = np.ones(weights_shape, dtype=bool)
    if is_causal:
        allowed = allowed & (key <= pos)                        # offset 0: top-left aligned
    if left is not None:
        allowed = allowed & (key >= pos - left)
    if right is not None:
        allowed = allowed & (key <= pos + right)
    if attention_chunk_size is not None:                        # the same chunk of C tokens
        allowed = allowed & (key // attention_chunk_size == pos // attention_chunk_size)
    if key_value_seq_lengths is not None:
        allowed = allowed & (key < per_batch(key_value_seq_lengths, rank))
    if query_seq_lengths is not None:
        allowed = allowed & (row < per_batch(query_seq_lengths, rank))
    if mask is not None:
        allowed = allowed & mask
    return allowed


def selected_mask(key_indices, lk):
    """key_indices (..., Lq, k) as the boolean (..., Lq, Lk) it stands for: row i's entry j is
    True when j is one of key_indices[..., i, :] (a repeated index means what it means once),
    as Hugging Face scatters the indexer's top-k into its mask."""
    chosen = np.zeros(key_indices.shape[:-1] + (lk,), dtype=bool)
    np.put_along_axis(chosen, key_indices.astype(np.intp), True, axis=-1)
    return chosen


def repeat_kv(x, heads):
    """(..., Hkv, Lk, D) -> (..., H, Lk, D): query head h reads kv head h // G."""
    return np.repeat(x, heads // x.shape[-3], axis=-3)


def sum_groups(grad, kv_heads):
    """The gradient of repeat_kv: (..., H, Lk, D) -> (..., Hkv, Lk, D), summed over each group."""
    shape = grad.shape[:-3] + (kv_heads, grad.shape[-3] // kv_heads) + grad.shape[-2:]
    return grad.reshape(shape).sum(axis=-3)  # (..., Hkv, G, Lk, D) summed over G


def masked_softmax(scores, allowed, sink=None):
    """Softmax over the last axis among allowed entries; an all-masked row gives zeros. With
    ``sink`` (broadcastable to (..., 1)), one more logit joins each row's denominator: returns
    (probabilities, the sink's probability (..., 1)); without, the probabilities alone."""
    zero = number(0)
    allowed = np.broadcast_to(allowed, np.shape(scores))
    row_max = np.where(allowed, scores, -np.inf).max(axis=-1, keepdims=True)
    row_max = np.where(allowed.any(axis=-1, keepdims=True) & (row_max > -np.inf), row_max, zero)
    if sink is not None:  # m = max(max S, s): every exponent ≤ 0
        sink = np.broadcast_to(sink, row_max.shape)
        live = allowed.any(axis=-1, keepdims=True)
        row_max = np.where(~live | (sink > row_max), sink, row_max)
        row_max = np.where(row_max > -np.inf, row_max, zero)  # a sink of −inf: no sink
    e = np.where(allowed, np.exp(np.where(allowed, scores - row_max, zero)), zero)
    total = e.sum(axis=-1, keepdims=True)
    if sink is None:
        return e / np.where(total > 0, total, number(1))
    e_sink = np.exp(sink - row_max)
    total = total + e_sink
    total = np.where(total > 0, total, number(1))
    return e / total, e_sink / total


def sink_logits(sinks):
    """sinks (H,) or () shaped (H, 1, 1) or (1, 1), to broadcast against (..., H, Lq, 1)."""
    return real(sinks).reshape(np.shape(sinks) + (1, 1))


def scaled_dot_product_attention(
    query, key, value, mask=None, bias=None, *, is_causal=False, scale=None, softcap=None,
    local_window_size=None, attention_chunk_size=None, query_offset=None,
    query_seq_lengths=None, key_value_seq_lengths=None, sinks=None, dropout_rate=0.0,
    dropout_mask=None, key_indices=None,
):
    """Return (output, weights) in float64."""
    out, weights, _ = sdpa_forward(
        query, key, value, mask, bias, is_causal=is_causal, scale=scale, softcap=softcap,
        local_window_size=local_window_size, attention_chunk_size=attention_chunk_size,
        query_offset=query_offset, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, sinks=sinks, dropout_rate=dropout_rate,
        dropout_mask=dropout_mask, key_indices=key_indices,
    )
    return out, weights


def sdpa_forward(query, key, value, mask=None, bias=None, *, is_causal=False, scale=None,
                 softcap=None, local_window_size=None, attention_chunk_size=None,
                 query_offset=None, query_seq_lengths=None, key_value_seq_lengths=None,
                 sinks=None, dropout_rate=0.0, dropout_mask=None, position_term=None,
                 key_indices=None):
    """Forward pass; also returns what the backward pass needs. The sink logits are added
    after the scale and the soft-cap (never capped) and no mask or bias touches them.
    ``position_term`` T (broadcastable to (..., H, Lq, Lk)) is added to R before the cap;
    sdpa_backward returns its gradient dL/dR as "position_term". ``key_indices`` (integer
    (..., Lq, k), or (..., H'|1, Lq, k) with heads: golden.specification.validate.
    check_key_indices) is the selection as the boolean mask it stands for (selected_mask),
    ANDed into ``mask``."""
    lengths = dict(query_offset=query_offset, query_seq_lengths=query_seq_lengths,
                   key_value_seq_lengths=key_value_seq_lengths)
    shape = check_attention_args(*map(_checkable, (query, key, value)), mask,
                                 None if bias is None else _checkable(bias), scale=scale,
                                 softcap=softcap, local_window_size=local_window_size, **lengths,
                                 dropout_rate=dropout_rate, dropout_mask=dropout_mask,
                                 sinks=None if sinks is None else _checkable(sinks),
                                 attention_chunk_size=attention_chunk_size)
    if key_indices is not None:
        check_key_indices(key_indices, query, key)
        chosen = selected_mask(with_head_axis(np.asarray(key_indices), query), shape[-1])
        mask = chosen if mask is None else mask & chosen
    q, k, v = (real(a) for a in (query, key, value))
    kv_heads = k.shape[-3] if k.ndim >= 3 else None
    if kv_heads is not None:
        k, v = repeat_kv(k, q.shape[-3]), repeat_kv(v, q.shape[-3])  # (..., H, Lk, D)
    scale = 1 / np.sqrt(number(q.shape[-1])) if scale is None else number(scale)
    scores = scale * einsum("...qd,...kd->...qk", q, k)
    if position_term is not None:  # the relative positions' term: part of R, inside the cap
        scores = scores + real(position_term)
    capped_arg = None if softcap is None else scores / number(softcap)  # R / c
    capped = None if softcap is None else np.tanh(capped_arg)         # tanh(R / c)
    if capped is not None:
        scores = number(softcap) * capped
    if bias is not None:
        scores = scores + real(bias)
    allowed = allowed_positions(shape, mask, is_causal, local_window_size=local_window_size,
                                attention_chunk_size=attention_chunk_size, **lengths)
    if sinks is None:
        probs, p_sink = masked_softmax(scores, allowed), None
    else:  # the sinks (H, 1, 1) join each row; p_sink (..., H, Lq, 1)
        probs, p_sink = masked_softmax(scores, allowed, sink_logits(sinks))
    keep = np.ones(shape) if dropout_mask is None else np.broadcast_to(dropout_mask, shape)
    keep_scaled = keep / (number(1) - number(dropout_rate))
    weights = probs * keep_scaled
    out = einsum("...qk,...kv->...qv", weights, v)
    saved = dict(q=q, k=k, v=v, kv_heads=kv_heads, scale=scale, capped=capped,
                 capped_arg=capped_arg, probs=probs,
                 keep_scaled=keep_scaled, weights=weights, p_sink=p_sink,
                 bias_shape=None if bias is None else np.shape(bias),
                 term_shape=None if position_term is None else np.shape(position_term),
                 sinks_shape=None if sinks is None else np.shape(sinks))
    return out, weights, saved


def unbroadcast(grad, shape):
    """Sum ``grad`` over the axes along which an array of ``shape`` was broadcast."""
    extra = grad.ndim - len(shape)
    grad = grad.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(axis=axes, keepdims=True)


def sdpa_backward(saved, d_output, d_weights):
    """Gradients of L = Σ O ⊙ dO + Σ A ⊙ dA with respect to query, key, value (and bias)."""
    q, k, v, weights, probs = saved["q"], saved["k"], saved["v"], saved["weights"], saved["probs"]
    d_output, d_weights = real(d_output), real(d_weights)
    g_weights = einsum("...qv,...kv->...qk", d_output, v) + d_weights   # dL/dA
    g_value = einsum("...qk,...qv->...kv", weights, d_output)
    g_probs = g_weights * saved["keep_scaled"]                              # dL/dP
    exact_mode = number_type() is not None
    p_sink = saved.get("p_sink")  # the sink takes no value: its g is 0
    if not exact_mode:  # the softmax vjp P ⊙ (g − Σ g ⊙ P)
        g_scores = probs * (g_probs - (g_probs * probs).sum(axis=-1, keepdims=True))
    else:  # the same, as P_j Σ_k P_k (g_j − g_k) (Σ P = 1): nothing cancels when one key takes
        # nearly all the weight, where g_j − Σ g ⊙ P would lose 1 − P_j below the precision;
        # with a sink Σ P = 1 − p_sink, and the sink's share adds p_sink · g_j
        diff = g_probs[..., :, None] - g_probs[..., None, :]               # (..., Lq, Lk, Lk)
        spread = (diff * probs[..., None, :]).sum(axis=-1)
        g_scores = probs * (spread if p_sink is None else spread + p_sink * g_probs)
    g_raw = g_scores                                                        # dL/dR
    if saved["capped"] is not None:  # d(c·tanh(R/c))/dR = 1 − tanh²(R/c) = 4 / (e^x + e^−x)²
        g_raw = g_scores * (4 / (np.exp(saved["capped_arg"]) + np.exp(-saved["capped_arg"])) ** 2
                            if exact_mode else number(1) - saved["capped"] ** 2)
    grads = {
        "query": saved["scale"] * einsum("...qk,...kd->...qd", g_raw, k),
        "key": saved["scale"] * einsum("...qk,...qd->...kd", g_raw, q),
        "value": g_value,
    }
    if saved["kv_heads"] is not None:
        grads["key"] = sum_groups(grads["key"], saved["kv_heads"])
        grads["value"] = sum_groups(grads["value"], saved["kv_heads"])
    if saved["bias_shape"] is not None:
        grads["bias"] = unbroadcast(g_scores, saved["bias_shape"])
    if saved.get("term_shape") is not None:  # part of R: the gradient through the cap
        grads["position_term"] = unbroadcast(g_raw, saved["term_shape"])
    if p_sink is not None:  # dL/ds = −p_sink Σ_j g_j P_j per row, summed over rows and batch
        g_sink = -(p_sink * (g_probs * probs).sum(axis=-1, keepdims=True))  # (..., H, Lq, 1)
        grads["sinks"] = _sum_to_sinks(g_sink, saved["sinks_shape"])
    return grads


def _sum_to_sinks(g, sinks_shape):
    """(..., H, Lq, 1) summed over the rows and the batch -> (H,), or () unbatched."""
    g = np.asarray(g.sum(axis=(-2, -1)), dtype=g.dtype)  # (..., H), or () unbatched
    return g.reshape((-1,) + sinks_shape).sum(axis=0) if sinks_shape else g


def sdpa_term_sizes(saved, d_output, d_weights):
    """The output A V and each gradient of ``sdpa_backward`` computed from absolute values,
    M ≥ |array| elementwise: the size of the terms each element sums, which its rounding is
    relative to (golden.specification.tolerances.compare_terms). The output's is A |V|; dL/dscores
    is P ⊙ (g − Σ g ⊙ P), whose subtraction cancels (to nothing on a saturated row), so M takes P ⊙
    (|g| + Σ |g| ⊙ P) and leaves out the soft-cap's 1 − tanh², itself a cancelling difference near
    ±c."""
    v, q, k, probs = (np.abs(saved[n]) for n in ("v", "q", "k", "probs"))
    g = (np.einsum("...qv,...kv->...qk", np.abs(d_output), v) + np.abs(d_weights)) * (
        saved["keep_scaled"])
    g_scores = probs * (g + (g * probs).sum(axis=-1, keepdims=True))
    scale = abs(saved["scale"])
    sizes = {"output": np.einsum("...qk,...kv->...qv", saved["weights"], v),
             "query": scale * np.einsum("...qk,...kd->...qd", g_scores, k),
             "key": scale * np.einsum("...qk,...qd->...kd", g_scores, q),
             "value": np.einsum("...qk,...qv->...kv", saved["weights"], np.abs(d_output))}
    if saved["kv_heads"] is not None:
        sizes["key"], sizes["value"] = (sum_groups(sizes[n], saved["kv_heads"])
                                        for n in ("key", "value"))
    if saved["bias_shape"] is not None:
        sizes["bias"] = unbroadcast(g_scores, saved["bias_shape"])
    if saved.get("p_sink") is not None:
        sizes["sinks"] = _sum_to_sinks(np.abs(saved["p_sink"]) * (g * probs).sum(
            axis=-1, keepdims=True), saved["sinks_shape"])
    return sizes

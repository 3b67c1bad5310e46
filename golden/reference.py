"""The float64 NumPy reference: the maths written out plainly, with analytic gradients.

Nothing here imports torch or JAX. Every function is loop-free and works on any number of
leading axes (``...``), so the unbatched (Lq, Dk), per-head (H, Lq, Dk) and batched (B, H, Lq, Dk)
layouts share one code path.

Two arithmetics run the same code. By default it is NumPy float64: fast, the oracle of the
property tests and of the tolerance profiles, but its last bits depend on the CPU (NumPy's float64
exp, tanh and power have one SIMD kernel per instruction set). Inside ``exact_arithmetic()`` the
arrays hold ``golden.exact.Real`` numbers (50 significant digits, every operation correctly
rounded, integer arithmetic underneath), and ``stored`` rounds each result once to float64: the
fixtures' values, the same bits on every machine (docs/reproducibility.md).

Shape legend: B batch, H heads (Hkv of key and value, H a multiple of Hkv), Lq query length,
Lk key length, Dk key width, Dv value width, G = H / Hkv query heads per key-value head.

Forward, with P the masked softmax and K the dropout mask:
    K', V' = K, V with each kv head repeated G times     query head h reads kv head h // G
    R = scale · Q K'ᵀ                                     (..., H, Lq, Lk)
    S = c · tanh(R / c) + bias                            (softcap c; S = R + bias without)
    P = exp(S − max S) · allowed / Σ_row                  (a row with nothing allowed: zeros)
    A = P · K / (1 − p)                                   the weights returned and applied
    O = A V'                                              (..., H, Lq, Dv)
Key j sits at position j, query i at i + query_offset. Query i may attend key j when the mask
allows it, j ≤ position (is_causal), position − left ≤ j ≤ position + right (the window),
j // C = position // C (attention_chunk_size C: Llama 4's chunks of C tokens),
j < key_value_seq_lengths and i < query_seq_lengths (rows past it attend nothing).
With sinks (GPT-OSS), head h's logit s_h joins every row's softmax as one more entry that takes
no value: P = exp(S − m) · allowed / (Σ_row + exp(s_h − m)), m = max(max_row S, s_h), so a
row's weights sum to 1 − p_sink and a row with nothing allowed gives zeros.
The fixtures' scalar loss is  L = Σ O ⊙ dO + Σ A ⊙ dA  for fixed random cotangents dO and dA.

``rounded_products(bits)`` turns the same code into the plain low-precision implementation that
the tolerance profiles measure against (golden.tolerances.PROFILES): inside it, every
contraction rounds its operands to ``bits`` bits of precision (TF32: 11, bfloat16: 8) and its
result to float32, as a float32 matmul on TF32 or bfloat16 units does; nothing else changes.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Callable, NamedTuple

import numpy as np

from golden import exact, variants
from golden.decoder import alibi_slopes, relative_position_bucket, sliding_window
from golden.positions import hf_inv_freq
from golden.validate import check_attention_args, rope_settings, rotary_dims, window

_PRODUCT_BITS = contextvars.ContextVar("product_bits", default=None)
_EXACT = contextvars.ContextVar("exact", default=None)  # the number type, None for float64
_BLAS = contextvars.ContextVar("blas", default=False)


@contextlib.contextmanager
def exact_arithmetic(real=exact.Real):
    """Inside, the reference computes in golden.exact's 50-digit decimal arithmetic: the float
    arrays it is given are taken exactly, and it returns object arrays of golden.exact.Real
    (``stored`` rounds them to float64). ``real``: another golden.exact number type (a higher
    precision, for measuring this one)."""
    if _PRODUCT_BITS.get() is not None:
        raise ValueError("exact_arithmetic() cannot run inside rounded_products()")
    if not (isinstance(real, type) and issubclass(real, exact.Number)):
        raise TypeError(f"real should be a golden.exact number type, got {real!r}")
    token = _EXACT.set(real)
    try:
        yield
    finally:
        _EXACT.reset(token)


def real(a):
    """``a`` as float64, or inside exact_arithmetic() as an array of golden.exact.Real."""
    if exact.is_exact(a):
        return a
    real_type = _EXACT.get()
    return np.asarray(a, dtype=np.float64) if real_type is None else exact.array(a, real_type)


def number(x):
    """A Python float, or inside exact_arithmetic() the golden.exact.Real equal to it."""
    real_type = _EXACT.get()
    return float(x) if real_type is None else real_type(float(x))


def _checkable(a):
    """What check_attention_args reads of ``a`` (shape and dtype): an exact array stands in
    as float64, without a copy."""
    if isinstance(a, np.ndarray) and a.dtype == object:
        return np.broadcast_to(np.zeros((), dtype=np.float64), a.shape)
    return a


def einsum(spec, *operands):
    """``np.einsum``; inside ``rounded_products(bits)`` on rounded operands, rounded result."""
    bits = _PRODUCT_BITS.get()
    if bits is None:
        return np.einsum(spec, *operands, optimize=_BLAS.get() and _EXACT.get() is None)
    rounded = (round_to_bits(o, bits) for o in operands)
    return np.einsum(spec, *rounded).astype(np.float32).astype(np.float64)


@contextlib.contextmanager
def blas_products():
    """Every float64 contraction inside runs through NumPy's BLAS (``np.einsum(...,
    optimize=True)``): the same float64 arithmetic, summed in another order, so the last bits
    depend on the machine; many times faster on a real model's layer. For references computed
    in memory (``attn-parity hf``), never for the stored fixtures (exact arithmetic ignores
    it)."""
    token = _BLAS.set(True)
    try:
        yield
    finally:
        _BLAS.reset(token)


@contextlib.contextmanager
def rounded_products(bits):
    """Every contraction inside rounds its operands to ``bits`` (2..24) bits of precision."""
    if not (isinstance(bits, int) and 2 <= bits <= 24):
        raise ValueError(f"bits should be an int in [2, 24], got {bits!r}")
    if _EXACT.get() is not None:
        raise ValueError("rounded_products() cannot run inside exact_arithmetic()")
    token = _PRODUCT_BITS.set(bits)
    try:
        yield
    finally:
        _PRODUCT_BITS.reset(token)


def round_to_bits(x, bits):
    """``x`` rounded to float32, then to ``bits`` bits of precision (the implicit bit counted),
    to nearest with ties to even; as float64."""
    drop = np.uint32(24 - bits)
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    if drop:
        half = (np.uint32(1) << (drop - np.uint32(1))) - np.uint32(1)
        u = (u + half + ((u >> drop) & np.uint32(1))) & ~((np.uint32(1) << drop) - np.uint32(1))
    return u.view(np.float32).astype(np.float64)


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
    dropout_mask=None,
):
    """Return (output, weights) in float64."""
    out, weights, _ = sdpa_forward(
        query, key, value, mask, bias, is_causal=is_causal, scale=scale, softcap=softcap,
        local_window_size=local_window_size, attention_chunk_size=attention_chunk_size,
        query_offset=query_offset, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, sinks=sinks, dropout_rate=dropout_rate,
        dropout_mask=dropout_mask,
    )
    return out, weights


def sdpa_forward(query, key, value, mask=None, bias=None, *, is_causal=False, scale=None,
                 softcap=None, local_window_size=None, attention_chunk_size=None,
                 query_offset=None, query_seq_lengths=None, key_value_seq_lengths=None,
                 sinks=None, dropout_rate=0.0, dropout_mask=None):
    """Forward pass; also returns what the backward pass needs. The sink logits are added
    after the scale and the soft-cap (never capped) and no mask or bias touches them."""
    lengths = dict(query_offset=query_offset, query_seq_lengths=query_seq_lengths,
                   key_value_seq_lengths=key_value_seq_lengths)
    shape = check_attention_args(*map(_checkable, (query, key, value)), mask,
                                 None if bias is None else _checkable(bias), scale=scale,
                                 softcap=softcap, local_window_size=local_window_size, **lengths,
                                 dropout_rate=dropout_rate, dropout_mask=dropout_mask,
                                 sinks=None if sinks is None else _checkable(sinks),
                                 attention_chunk_size=attention_chunk_size)
    q, k, v = (real(a) for a in (query, key, value))
    kv_heads = k.shape[-3] if k.ndim >= 3 else None
    if kv_heads is not None:
        k, v = repeat_kv(k, q.shape[-3]), repeat_kv(v, q.shape[-3])  # (..., H, Lk, D)
    scale = 1 / np.sqrt(number(q.shape[-1])) if scale is None else number(scale)
    scores = scale * einsum("...qd,...kd->...qk", q, k)
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
                 sinks_shape=None if sinks is None else np.shape(sinks))
    return out, weights, saved


# Gradients that are zero in exact arithmetic, whatever the inputs, because softmax is unchanged
# by a constant added to a row of scores:
# - the key projection's bias adds q_i · b_key to every score of query row i. Not with rotary
#   embeddings (the bias is rotated by each key's position, so the shift is no longer constant
#   along the row), nor with soft-capping (tanh bends a constant shift differently per key),
#   nor with a QK norm (the bias is normalised with the rest of k);
# - a score bias that is broadcast along the key axis (its last axis of size 1, or 0-d).
# Neither with sinks: a sink's logit is not shifted with its row, so the shift moves weight
# between the keys and the sink.
# Computed, they are rounding residue; fixtures store exact zeros and list the names (meta
# "zero"), which are checked against an absolute bound instead of a relative one.
ZERO_GRADS = {"b_key"}


def zero_grads(config, grads) -> list:
    """The names among ``grads`` that are zero by structure for this configuration, sorted."""
    names = set()
    rope = config.get("rope_theta") is not None or "rope_theta" in (
        config.get("rope_parameters") or {})
    if "sinks" in grads:
        return []
    if not rope and not config.get("softcap") and not config.get("qk_norm"):
        names |= set(grads) & ZERO_GRADS
    bias = grads.get("bias")
    if bias is not None and (np.ndim(bias) == 0 or np.shape(bias)[-1] == 1):
        names.add("bias")
    return sorted(names)


def zero_elements(config):
    """Boolean (Hkv·Dh,) or None: the elements of b_key's gradient that are zero by structure
    although the whole is not (zero_grads). With partial rotary (GroupedQueryAttention) the key
    bias's features that are not turned add a constant to each row of scores, as the whole
    b_key does without RoPE: their gradient is zero, stored as zeros, not residue (no soft-cap,
    which bends a constant shift, no QK norm, no sinks: see zero_grads)."""
    shifts = not (config.get("softcap") or config.get("qk_norm") or config.get("sinks"))
    settings = None if "num_kv_heads" not in config or not shifts else rope_settings(
        config.get("rope_theta"), config.get("rope_parameters"),
        config.get("partial_rotary_factor", 1.0))
    if settings is None:
        return None
    dh = config.get("head_dim") or config["d_in"] // config["num_heads"]
    passed = np.tile(np.arange(dh) >= rotary_dims(dh, settings), config["num_kv_heads"])
    return passed if passed.any() else None


def stored(config, output, weights, grads):
    """What a fixture stores of a forward and backward: (output, weights, grads, zero) as
    float64, each value rounded once (golden.exact.to_float64, exact for float64 input), the
    gradients named in ``zero`` (zero_grads) exact zeros."""
    grads = {n: exact.to_float64(g) for n, g in grads.items()}
    zero = zero_grads(config, grads)
    for n in zero:
        grads[n] = np.zeros_like(grads[n])
    passed = zero_elements(config)
    if passed is not None and "b_key" in grads:
        grads["b_key"] = np.where(passed, 0.0, grads["b_key"])
    return exact.to_float64(output), exact.to_float64(weights), grads, zero


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
    exact_mode = _EXACT.get() is not None
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
    relative to (golden.tolerances.compare_terms). The output's is A |V|; dL/dscores is
    P ⊙ (g − Σ g ⊙ P), whose subtraction cancels (to nothing on a saturated row), so M takes
    P ⊙ (|g| + Σ |g| ⊙ P) and leaves out the soft-cap's 1 − tanh², itself a cancelling
    difference near ±c."""
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

# ---------------------------------------------------------------------------------------------
# Modules. Legend as above, plus L sequence length, N heads, d_* feature widths.
# One block covers every variant: project, split heads, attend, merge heads, project out:
#     Q = x_q W_q + b_q, K = x_k W_k + b_k, V = x_v W_v + b_v      (..., L, N·D), K and V
#                                                                   (..., L, Nkv·D) with GQA
#     Q, K = rotate(split(Q)), rotate(split(K))                     RoPE, when the variant has it
#     O = attention(split(Q), split(K), split(V))                   (..., N, Lq, Dv)
#     y = merge(O) W_out + b_out   (or merge(O) when there is no output projection)
# ---------------------------------------------------------------------------------------------


def linear(x, w, b=None):
    """x W + b with W of shape (in, out)."""
    y = einsum("...i,io->...o", x, w)
    return y if b is None else y + b


def linear_backward(x, w, g_y, grads, names):
    """Accumulate dL/dW and dL/db into ``grads``; return dL/dx."""
    w_name, b_name = names
    x2, g2 = x.reshape(-1, x.shape[-1]), g_y.reshape(-1, g_y.shape[-1])  # (positions, width)
    grads[w_name] = einsum("ni,no->io", x2, g2)  # Σ over positions of xᵀ g
    if b_name is not None:
        grads[b_name] = g2.sum(axis=0)
    return einsum("...o,io->...i", g_y, w)


def split_heads(y, num_heads):
    """(..., L, N·D) -> (..., N, L, D): head n owns the n-th contiguous block of features."""
    y = y.reshape(y.shape[:-1] + (num_heads, y.shape[-1] // num_heads))  # (..., L, N, D)
    return np.swapaxes(y, -2, -3)


def merge_heads(y):
    """(..., N, L, D) -> (..., L, N·D)."""
    y = np.swapaxes(y, -2, -3)  # (..., L, N, D)
    return y.reshape(y.shape[:-2] + (-1,))


def _power(base, exponent):
    """base^exponent for base > 0: NumPy's power in float64; exp(exponent · ln base) inside
    exact_arithmetic(), where only integer powers exist."""
    if _EXACT.get() is None:
        return base ** exponent
    return np.exp(np.log(base) * exponent)


def _pi():
    real_type = _EXACT.get()
    return np.pi if real_type is None else exact.pi(real_type)


def rope_frequencies(settings, rd, seq_len=None):
    """(f (rd/2,), attention factor m) of RoPE ``settings`` (golden.validate.rope_settings)
    for rd rotated features, Hugging Face's rope_types written out (it forms them in float32):
        default   f_i = θ^(−2i/rd)
        linear    f_i / s
        dynamic   θ replaced by θ · (s · seq / L0 − (s − 1))^(rd / (rd − 2)) when seq > L0
        llama3    wavelength λ = 2π / f: λ > L0 / low: f / s; λ < L0 / high: f; between,
                  (1 − a) f / s + a f with a = (L0 / λ − low) / (high − low)
        yarn      r = clip((i − lo) / (hi − lo), 0, 1): f / s · r + f · (1 − r), lo and hi
                  the pairs turning beta_fast and beta_slow times within L0 (floored and
                  ceiled when truncate); m = attention_factor, or mscale(s, mscale) /
                  mscale(s, mscale_all_dim), or 0.1 ln s + 1
        longrope  f_i / long_factor_i when seq > L0, else / short_factor_i; m =
                  attention_factor or √(1 + ln s / ln L0)
    with s the factor, L0 original_max_position_embeddings, seq the call's largest position
    + 1. Float64, or exact inside exact_arithmetic()."""
    s = dict(settings)
    kind, theta, l0 = s["rope_type"], number(s["rope_theta"]), s.get(
        "original_max_position_embeddings")
    factor = None if s.get("factor") is None else number(s["factor"])
    exponent = 2 * np.arange(rd // 2) / number(rd)  # 2i / rd
    one, m = number(1), number(1)
    if kind == "dynamic" and seq_len is not None and seq_len > l0:
        theta = theta * _power(factor * seq_len / l0 - (factor - one), number(rd) / (rd - 2))
    f = _power(theta, -exponent)
    if kind == "linear":
        f = f / factor
    elif kind == "llama3":
        low, high = number(s["low_freq_factor"]), number(s["high_freq_factor"])
        wavelength = 2 * _pi() / f
        a = (l0 / wavelength - low) / (high - low)
        f = np.where(wavelength > l0 / low, f / factor,
                     np.where(wavelength < l0 / high, f, (one - a) * f / factor + a * f))
    elif kind == "yarn":
        f, m = _yarn(s, f, rd, theta, factor)
    elif kind == "longrope":
        long = seq_len is not None and seq_len > l0
        f = f / real(np.asarray(s["long_factor" if long else "short_factor"], np.float64))
        m = (number(s["attention_factor"]) if s["attention_factor"] is not None
             else one if factor <= 1 else np.sqrt(one + np.log(factor) / np.log(number(l0))))
    return f, m


def _yarn(s, f, rd, theta, factor):
    """YaRN's frequencies and attention factor (rope_frequencies)."""
    one, l0 = number(1), s["original_max_position_embeddings"]

    def correction(rotations):  # the pair index turning ``rotations`` times within L0
        return rd * np.log(l0 / (number(rotations) * 2 * _pi())) / (2 * np.log(theta))
    lo, hi = correction(s["beta_fast"]), correction(s["beta_slow"])
    if s["truncate"]:
        lo, hi = number(math.floor(lo)), number(math.ceil(hi))
    lo, hi = max(lo, number(0)), min(hi, number(rd - 1))
    hi = hi + number(0.001) if lo == hi else hi
    r = (np.arange(rd // 2) - lo) / (hi - lo)
    r = np.where(r < 0, number(0), np.where(r > 1, one, r))
    f = f / factor * r + f * (one - r)

    def mscale(a):
        return one if factor <= 1 else number(0.1) * number(a) * np.log(factor) + one
    if s["attention_factor"] is not None:
        return f, number(s["attention_factor"])
    if s["mscale"] and s["mscale_all_dim"]:
        return f, mscale(s["mscale"]) / mscale(s["mscale_all_dim"])
    return f, mscale(1.0)


def rope_angles(positions, head_dim, theta, rope_parameters=None, partial_rotary_factor=1.0):
    """(..., L, rd/2): position p times frequency f_i (rope_frequencies; θ^(−2i/Dh) by default,
    inside exact_arithmetic() exp(−2i · ln θ / Dh), the exponent a decimal too), for
    ``positions`` an int L (p = 0 … L − 1) or an integer array (..., L); rd = int(Dh ·
    partial_rotary_factor). The attention factor is rope_frequencies'."""
    settings = rope_settings(theta, rope_parameters, partial_rotary_factor)
    positions = np.arange(positions) if np.ndim(positions) == 0 else np.asarray(positions)
    rd = rotary_dims(head_dim, settings)
    f, _ = rope_frequencies(settings, rd, int(positions.max()) + 1)
    return positions[..., None] * f


def rope_cos_sin(settings, head_dim, positions):
    """(cos, sin) (..., L, rd/2) times the attention factor, for integer ``positions``
    (..., L): exact (or float64), or with settings' precision "hf" Hugging Face's float32
    arithmetic (golden.positions.hf_inv_freq in NumPy float32; np.cos in float32 is NumPy's,
    whose last bit depends on the CPU: no fixture uses it)."""
    rd = rotary_dims(head_dim, settings)
    seq_len = int(np.max(positions)) + 1
    if dict(settings)["precision"] == "hf":
        inv, m = hf_inv_freq(settings, rd, lambda v: np.asarray(v, np.float32), seq_len)
        angles = np.asarray(positions, np.float32)[..., None] * inv
        return tuple(real((t(angles) * np.float32(m)).astype(np.float64)) for t in (np.cos,
                                                                                   np.sin))
    f, m = rope_frequencies(settings, rd, seq_len)
    angles = positions[..., None] * f
    return m * np.cos(angles), m * np.sin(angles)


def turn(x, cos, sin, interleaved):
    """The first rd = 2 · cos.shape[-1] features of x (..., L, Dh) turned pair by pair by
    (cos, sin) (..., L, rd/2): the pair (i, i + rd/2) ("rotate half", interleaved=False) or
    (2i, 2i + 1) (interleaved=True), (a, b) -> (a cos − b sin, b cos + a sin); the other
    Dh − rd features passed through (partial rotary)."""
    half = cos.shape[-1]
    rot, rest = x[..., :2 * half], x[..., 2 * half:]
    a, b = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :half], rot[..., half:])
    turned = (a * cos - b * sin, b * cos + a * sin)
    if interleaved:
        turned = np.stack(turned, axis=-1).reshape(rot.shape)  # (..., L, rd/2, 2) -> (..., rd)
    else:
        turned = np.concatenate(turned, axis=-1)
    return np.concatenate([turned, rest], axis=-1)


def rotate(x, angles, interleaved, factor=None):
    """Rotary embedding of x (..., L, Dh) by angles (..., L, rd/2) (turn), cos and sin times
    ``factor`` (the attention factor) when given."""
    cos, sin = np.cos(angles), np.sin(angles)
    if factor is not None:
        cos, sin = factor * cos, factor * sin
    return turn(x, cos, sin, interleaved)


class Stage(NamedTuple):
    """A differentiable step on the split heads q (..., N, L, Dh) and k (..., Nkv, L, Dh)
    between the projections and the core (RoPE, a QK norm, the query temperature):
    ``forward(q, k) -> (q, k, saved)`` and ``backward(saved, g_q, g_k) -> (g_q, g_k, {parameter:
    gradient})``."""

    forward: Callable
    backward: Callable


def block_forward(x_q, x_k, x_v, p, *, num_heads, kv_heads=None, stages=(), mask=None,
                  clip=None, **core):
    """The generic block; p holds W_query, W_key, W_value, optional b_*, W_out, b_out, and for
    GroupedQueryAttention's options W_gate/b_gate (the output gate) and sinks. Key and value
    have ``kv_heads`` heads (default num_heads); ``stages`` (Stage) run in order on q and k;
    ``clip`` c (MPT's and OLMo's clip_qkv) clamps each projection to [−c, c] before the stages;
    ``core`` goes to sdpa_forward (is_causal, scale, dropout, lengths, ...)."""
    x_q, x_k, x_v = (real(a) for a in (x_q, x_k, x_v))
    p = {n: real(a) for n, a in p.items()}
    heads = {"query": num_heads, "key": kv_heads or num_heads, "value": kv_heads or num_heads}
    q, k, v = (split_heads(linear(x, p[f"W_{n}"], p.get(f"b_{n}")), heads[n])
               for x, n in ((x_q, "query"), (x_k, "key"), (x_v, "value")))
    inside = None
    if clip is not None:  # the derivative is 1 inside [−c, c] (ends included, as torch's), else 0
        c = number(clip)
        inside = [((a >= -c) & (a <= c)).astype(bool) for a in (q, k, v)]
        q, k, v = (np.where(i, a, np.where(a > c, c, -c)) for i, a in zip(inside, (q, k, v)))
    staged = []
    for stage in stages:
        q, k, s = stage.forward(q, k)
        staged.append(s)
    head_mask = None if mask is None else np.asarray(mask)[..., None, :, :]  # (..., 1, Lq, Lk)
    if "sinks" in p:
        core["sinks"] = p["sinks"]
    out, weights, attn = sdpa_forward(q, k, v, head_mask, **core)
    merged = merge_heads(out)  # (..., Lq, N·Dv)
    gate = None
    if "W_gate" in p:  # merged ⊙ σ(x_q W_gate + b_gate), σ(z) = 1 / (1 + e^−z)
        e = np.exp(-linear(x_q, p["W_gate"], p.get("b_gate")))
        gate = (merged, e, number(1) / (number(1) + e))
        merged = merged * gate[2]
    y = linear(merged, p["W_out"], p.get("b_out")) if "W_out" in p else merged
    saved = dict(x=(x_q, x_k, x_v), p=p, heads=heads, stages=stages, staged=staged,
                 merged=merged, gate=gate, attn=attn, inside=inside)
    return y, weights, saved


def block_backward(saved, d_y, d_weights):
    """Gradients of Σ y⊙dy + Σ A⊙dA: keys x_query, x_key, x_value and every parameter name."""
    p, grads = saved["p"], {}
    g_merged, d_weights = real(d_y), real(d_weights)
    if "W_out" in p:
        g_merged = linear_backward(saved["merged"], p["W_out"], g_merged, grads,
                                   ("W_out", "b_out" if "b_out" in p else None))
    g_gate = None
    if saved["gate"] is not None:  # dσ/dz = e^−z σ², no cancellation
        ungated, e, sigma = saved["gate"]
        g_gate, g_merged = g_merged * ungated * e * sigma * sigma, g_merged * sigma
    g = sdpa_backward(saved["attn"], split_heads(g_merged, saved["heads"]["query"]), d_weights)
    if "sinks" in p:
        grads["sinks"] = g["sinks"]
    if saved.get("buckets") is not None:  # T5: the bias's gradient summed into its buckets
        grads["relative_attention_bias"] = bucket_sums(g["bias"], saved["buckets"],
                                                       p["relative_attention_bias"].shape)
    for stage, s in zip(reversed(saved["stages"]), reversed(saved["staged"])):
        g["query"], g["key"], g_params = stage.backward(s, g["query"], g["key"])
        grads.update(g_params)
    for i, n in enumerate(("query", "key", "value") if saved.get("inside") else ()):
        g[n] = np.where(saved["inside"][i], g[n], number(0))
    for x, n in zip(saved["x"], ("query", "key", "value")):
        grads[f"x_{n}"] = linear_backward(x, p[f"W_{n}"], merge_heads(g[n]), grads,
                                          (f"W_{n}", f"b_{n}" if f"b_{n}" in p else None))
    if g_gate is not None:
        grads["x_query"] = grads["x_query"] + linear_backward(
            saved["x"][0], p["W_gate"], g_gate, grads, ("W_gate", "b_gate" if "b_gate" in p
                                                         else None))
    return grads


def rope_stage(cos, sin, interleaved) -> Stage:
    """RoPE on q and k by (cos, sin) (..., L, rd/2), the attention factor in both (turn); the
    transpose of a rotation turns by the opposite angle, times the same factor, and the
    pass-through features' is the identity."""
    return Stage(lambda q, k: (turn(q, cos, sin, interleaved), turn(k, cos, sin, interleaved),
                               None),
                 lambda s, g_q, g_k: (turn(g_q, cos, -sin, interleaved),
                                      turn(g_k, cos, -sin, interleaved), {}))


# QK normalisation: y = x̂ · w with x̂ = (x − μ) r, r = (mean((x − μ)²) + ε)^(−1/2) over the last
# axis (μ = mean(x) for "layer", 0 for the RMS kinds), and w the weight ("rms", "layer",
# "rms_across_heads"), 1 + the weight ("rms_one_plus") or 1 ("l2"). Where each applies and its
# weight's shape: golden.variants.QK_NORMS.


def _normalize(kind, x, weight, eps):
    """(y, saved) of one QK norm on x (..., width); ``weight`` already broadcastable to x."""
    n = number(x.shape[-1])
    centred = x - x.sum(axis=-1, keepdims=True) / n if kind == "layer" else x
    r = number(1) / np.sqrt((centred * centred).sum(axis=-1, keepdims=True) / n + eps)
    unit = centred * r
    w = (None if weight is None else number(1) + weight if kind == "rms_one_plus" else weight)
    return (unit if w is None else unit * w), (unit, r, w)


def _normalize_backward(kind, saved, g):
    """(dL/dx, dL/dw broadcast like w, or None) of ``_normalize``: with h = g ⊙ w,
    dL/dx = r (h − mean(h) − x̂ mean(h ⊙ x̂)), the mean(h) term for "layer" only."""
    unit, r, w = saved
    n = number(unit.shape[-1])
    h = g if w is None else g * w
    inner = h - unit * ((h * unit).sum(axis=-1, keepdims=True) / n)
    if kind == "layer":
        inner = inner - h.sum(axis=-1, keepdims=True) / n
    return r * inner, None if w is None else g * unit


def qk_norm_stage(kind, q_weight, k_weight, eps) -> Stage:
    """The QK norm ``kind`` on q and k: per head over Dh ("rms", "rms_one_plus", "l2": no
    weight; "layer": weights (N, Dh) and (Nkv, Dh), one row per head), or over all of a
    token's heads ("rms_across_heads": weights (N·Dh,) and (Nkv·Dh,), OLMo 2)."""
    across = kind == "rms_across_heads"

    def shaped(w):  # the weight broadcast against (..., heads, L, Dh), or the merged heads
        return None if w is None else w[:, None, :] if kind == "layer" else w

    def forward(q, k):
        if across:
            heads = (q.shape[-3], k.shape[-3])
            (q, sq), (k, sk) = (_normalize(kind, merge_heads(t), w, eps)
                                for t, w in ((q, q_weight), (k, k_weight)))
            return split_heads(q, heads[0]), split_heads(k, heads[1]), (sq, sk)
        (q, sq), (k, sk) = (_normalize(kind, t, shaped(w), eps)
                            for t, w in ((q, q_weight), (k, k_weight)))
        return q, k, (sq, sk)

    def backward(saved, g_q, g_k):
        grads = {}
        out = []
        for g, s, name, w in ((g_q, saved[0], "q_norm", q_weight),
                              (g_k, saved[1], "k_norm", k_weight)):
            heads = g.shape[-3]
            gx, gw = _normalize_backward(kind, s, merge_heads(g) if across else g)
            out.append(split_heads(gx, heads) if across else gx)
            if gw is not None:
                grads[name] = unbroadcast(gw, shaped(w).shape).reshape(w.shape)
        return out[0], out[1], grads

    return Stage(forward, backward)


def temperature_stage(factors) -> Stage:
    """The query temperature: q times ``factors`` (..., 1, L, 1), k unchanged."""
    return Stage(lambda q, k: (q * factors, k, None),
                 lambda s, g_q, g_k: (g_q * factors, g_k, {}))


# ---------------------------------------------------------------------------------------------
# Variants: forward(config, inputs, params) -> (output, weights, saved) and
# backward(saved, d_output, d_weights) -> {input or parameter name: gradient}.
# Dropout is active exactly when the inputs hold a dropout mask (the module is in training mode).
# ---------------------------------------------------------------------------------------------


def _sdpa(config, inputs, params):
    return sdpa_forward(**inputs, **config)


def _simple(config, inputs, params):
    x = inputs["x"]  # softmax(X Xᵀ) X: no weights, no scaling
    out, weights, attn = sdpa_forward(x, x, x, inputs.get("mask"), scale=1.0)
    return out, weights, attn


def _simple_backward(attn, d_out, d_weights):
    g = sdpa_backward(attn, d_out, d_weights)
    return {"x": g["query"] + g["key"] + g["value"]}


def _one_head(config, inputs, params, x_q, x_k, x_v, is_causal):
    """A single head: the block with N = 1, the head axis removed from the weights."""
    keep = inputs.get("dropout_mask")
    y, weights, saved = block_forward(
        x_q, x_k, x_v, params, num_heads=1, is_causal=is_causal, mask=inputs.get("mask"),
        dropout_rate=config.get("dropout", 0.0) if keep is not None else 0.0,
        dropout_mask=None if keep is None else keep[..., None, :, :])
    return y, weights[..., 0, :, :], saved


def _self(config, inputs, params):
    x = inputs["x"]
    return _one_head(config, inputs, params, x, x, x, is_causal=False)


def _causal(config, inputs, params):
    x = inputs["x"]
    return _one_head(config, inputs, params, x, x, x, is_causal=True)


def _self_backward(saved, d_y, d_weights):
    g = block_backward(saved, d_y, d_weights[..., None, :, :])
    g["x"] = g.pop("x_query") + g.pop("x_key") + g.pop("x_value")
    return g


def _cross(config, inputs, params):
    x_v = inputs.get("x_v", inputs["x_kv"])
    y, weights, saved = _one_head(config, inputs, params, inputs["x_q"], inputs["x_kv"], x_v,
                                  is_causal=False)
    saved["separate_values"] = "x_v" in inputs
    return y, weights, saved


def _cross_backward(saved, d_y, d_weights):
    g = block_backward(saved, d_y, d_weights[..., None, :, :])
    g["x_q"], g["x_kv"] = g.pop("x_query"), g.pop("x_key")
    if saved["separate_values"]:
        g["x_v"] = g.pop("x_value")
    else:
        g["x_kv"] = g["x_kv"] + g.pop("x_value")
    return g


def _multi_head(config, inputs, params):
    x = inputs["x"]
    train = "dropout_mask" in inputs
    return block_forward(x, x, x, params, num_heads=config["num_heads"],
                         is_causal=config.get("causal", False), mask=inputs.get("mask"),
                         dropout_rate=config.get("dropout", 0.0) if train else 0.0,
                         dropout_mask=inputs.get("dropout_mask"))


def _multi_head_backward(saved, d_y, d_weights):
    g = block_backward(saved, d_y, d_weights)
    g["x"] = g.pop("x_query") + g.pop("x_key") + g.pop("x_value")
    return g


def _stacked_to_fused(name, a):
    """Wrapper layout -> block layout: W (N, in, Dh) -> (in, N·Dh); b (N, Dh) -> (N·Dh,)."""
    if name.startswith("W_") and name != "W_out":
        return np.swapaxes(a, 0, 1).reshape(a.shape[1], -1)
    return a.reshape(-1) if name.startswith("b_") and name != "b_out" else a


def _fused_to_stacked(name, g, num_heads):
    """The inverse of _stacked_to_fused, for gradients."""
    if name.startswith("W_") and name != "W_out":
        return np.swapaxes(g.reshape(g.shape[0], num_heads, -1), 0, 1)
    return g.reshape(num_heads, -1) if name.startswith("b_") and name != "b_out" else g


def _wrapper(config, inputs, params):
    fused = {n: _stacked_to_fused(n, real(a)) for n, a in params.items()}
    return _multi_head(config, inputs, fused)


def _wrapper_backward(saved, d_y, d_weights):
    g = _multi_head_backward(saved, d_y, d_weights)
    return {n: _fused_to_stacked(n, a, saved["heads"]["query"]) for n, a in g.items()}


def temperature_factors(positions, beta, floor_scale, shift):
    """Llama 4's query temperature at integer ``positions``: 1 + β·ln(1 + ⌊(p + shift) / F⌋)
    (Llama 4: shift 1; Ministral 3: shift 0)."""
    steps = (np.asarray(positions) + int(shift)) // int(floor_scale)
    return number(1) + number(beta) * np.log(real((1 + steps).astype(np.float64)))


def alibi_term(c, length, dh):
    """ALiBi's score bias (N, L, L) for ``length`` tokens: m_h · (j − i), key j and query i in
    token order (golden.decoder.alibi_slopes gives m_h); Falcon adds it before the scale, so
    its bias is multiplied by the scale (default 1/√Dh). Exact: powers of two times integers,
    then the scale in the arithmetic in force. Not a parameter: no gradient."""
    slopes = alibi_slopes(c["num_heads"], c["alibi"], c["alibi_bias_max"])
    distance = np.arange(length)[None, :] - np.arange(length)[:, None]  # j − i (L, L)
    bias = real(slopes[:, None, None] * distance)
    if c["alibi"] != "falcon":
        return bias
    return bias * (number(1) / np.sqrt(number(dh)) if c["scale"] is None else number(c["scale"]))


def relative_term(c, length, table):
    """T5's score bias (N, L, L): the learned table (num_buckets, N) at the bucket of each
    distance j − i (golden.decoder.relative_position_bucket, bidirectional unless causal);
    returns (bias, buckets (L, L))."""
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


def _grouped_query(config, inputs, params):
    """GroupedQueryAttention: Hkv key-value heads; a QK norm, RoPE and the query temperature at
    the tokens' positions (0 … L − 1, or the inputs' ``positions``) on q and k
    (golden.variants.QK_NORMS says which norm runs before RoPE and which after); sinks and the
    output gate when the parameters hold them; ALiBi's or T5's bias (alibi_term,
    relative_term, the table's gradient by bucket_sums); the padding past
    query_seq_lengths neither querying nor attended."""
    c, x = variants.get("grouped_query_attention").config(config), inputs["x"]  # defaults in
    num_heads, kind = c["num_heads"], c["qk_norm"]
    dh = c.get("head_dim") or c["d_in"] // num_heads
    norm = None if kind is None else qk_norm_stage(
        kind, *(None if params.get(n) is None else real(params[n])
                for n in ("q_norm", "k_norm")), number(c["qk_norm_eps"]))
    stages = [norm] if norm is not None and kind != "l2" else []
    settings = rope_settings(c["rope_theta"], c["rope_parameters"], c["partial_rotary_factor"],
                             c["rope_precision"])
    positions = inputs.get("positions")  # (B, L) or (L,): each token's, default its index
    positions = np.arange(x.shape[-2]) if positions is None else np.asarray(positions)
    heads_axis = (slice(None), None) if positions.ndim == 2 else ()  # (B, L) -> (B, 1, L)
    if settings is not None:
        cos, sin = rope_cos_sin(settings, dh, positions)  # (..., L, rd/2)
        stages.append(rope_stage(cos[heads_axis], sin[heads_axis], c["rope_interleaved"]))
    if kind == "l2":  # Llama 4: after RoPE
        stages.append(norm)
    if c.get("query_temperature") is not None:
        t = c["query_temperature"]
        factors = temperature_factors(positions, t["beta"], t["floor_scale"], t["shift"])
        stages.append(temperature_stage(factors[heads_axis][..., None]))  # (L, 1), (B, 1, L, 1)
    lengths = inputs.get("query_seq_lengths")
    train = "dropout_mask" in inputs
    core = {} if c.get("attention_chunk_size") is None else {
        "attention_chunk_size": c["attention_chunk_size"]}
    if c["alibi"] is not None:
        core["bias"] = alibi_term(c, x.shape[-2], dh)
    buckets = None
    if c["relative_attention_num_buckets"] is not None:
        core["bias"], buckets = relative_term(c, x.shape[-2], params["relative_attention_bias"])
    causal = c.get("causal", True)
    y, weights, saved = block_forward(
        x, x, x, params, num_heads=num_heads, kv_heads=c["num_kv_heads"], stages=stages,
        mask=inputs.get("mask"), is_causal=causal, scale=c.get("scale"), softcap=c.get("softcap"),
        local_window_size=sliding_window(c.get("sliding_window"), causal),
        query_seq_lengths=lengths, key_value_seq_lengths=lengths,
        dropout_rate=c.get("dropout", 0.0) if train else 0.0,
        dropout_mask=inputs.get("dropout_mask"), clip=c["clip_qkv"], **core)
    saved["buckets"] = buckets  # T5's, for the table's gradient (block_backward)
    return y, weights, saved


def _multi_head_cross(config, inputs, params):
    """MultiHeadCrossAttention: queries from x, keys and values from the context (its tokens
    past context_lengths not attended), N query heads over Nkv key-value heads, no causality."""
    c = variants.get("multi_head_cross_attention").config(config)  # defaults in
    s = variants.cross_sizes(c)
    context = inputs["context"]
    return block_forward(inputs["x"], context, context, params, num_heads=c["num_heads"],
                         kv_heads=s["num_kv_heads"], mask=inputs.get("mask"),
                         scale=c["scale"], key_value_seq_lengths=inputs.get("context_lengths"))


def _multi_head_cross_backward(saved, d_y, d_weights):
    g = block_backward(saved, d_y, d_weights)
    g["x"], g["context"] = g.pop("x_query"), g.pop("x_key") + g.pop("x_value")
    return g

def latent_rope_stage(k_pe, cos, sin, interleaved, nope) -> Stage:
    """Multi-head latent attention's RoPE, as a Stage on q (..., N, L, nope + rope) and the
    keys' nope part k (..., N, L, nope): q's last rope features turned, and the one rotary key
    head k_pe (..., 1, L, rope), turned, appended to every head's key. Its backward returns
    the gradient of k_pe (summed over the heads it was broadcast to) as "k_pe"."""
    def forward(q, k):
        q_rot = turn(q[..., nope:], cos, sin, interleaved)
        k_rot = np.broadcast_to(turn(k_pe, cos, sin, interleaved),
                                k.shape[:-1] + (k_pe.shape[-1],))
        return (np.concatenate([q[..., :nope], q_rot], axis=-1),
                np.concatenate([k, k_rot], axis=-1), None)

    def backward(saved, g_q, g_k):
        g_q = np.concatenate([g_q[..., :nope], turn(g_q[..., nope:], cos, -sin, interleaved)],
                             axis=-1)
        g_pe = turn(g_k[..., nope:].sum(axis=-3, keepdims=True), cos, -sin, interleaved)
        return g_q, g_k[..., :nope], {"k_pe": g_pe}

    return Stage(forward, backward)


def _split_kv_b(w, heads, nope):
    """W_kv_b (r, N·(nope + Dv)), per head [k_nope | v], -> (W_k (r, N·nope), W_v (r, N·Dv))."""
    w = w.reshape(w.shape[0], heads, -1)  # (r, N, nope + Dv)
    return (w[..., :nope].reshape(w.shape[0], -1), w[..., nope:].reshape(w.shape[0], -1))


def _join_kv_b(g_k, g_v, heads):
    """The inverse of _split_kv_b, for gradients."""
    r = g_k.shape[0]
    return np.concatenate([g_k.reshape(r, heads, -1), g_v.reshape(r, heads, -1)],
                          axis=-1).reshape(r, -1)


def latent_mscale(c):
    """Yarn's mscale(s, mscale_all_dim)², mscale(s, a) = 0.1·a·ln s + 1, by which multi-head
    latent attention multiplies its softmax scale Dk^−1/2 (Hugging Face's yarn_apply_mscale),
    in the reference's arithmetic; None when it does not apply (``scale`` given, no yarn with
    mscale_all_dim, or a factor s ≤ 1)."""
    s = variants.latent_sizes(c)
    if c["scale"] is not None or s["mscale"] is None or s["mscale"][0] <= 1:
        return None
    m = number(0.1) * number(s["mscale"][1]) * np.log(number(s["mscale"][0])) + number(1)
    return m * m


def _latent(config, inputs, params):
    """MultiHeadLatentAttention (DeepSeek-V2/V3's MLA): q from x (or through the low-rank
    W_q_a, RMSNorm q_a_norm, W_q_b), per head [q_nope | q_pe]; x W_kv_a + b_kv_a = [c | k_pe],
    the latent c RMS-normalised (kv_a_norm), W_kv_b making each head's [k_nope | v] from it;
    q_pe and the one key head k_pe turned (RoPE at the tokens' positions), k_pe shared by every
    head; causal attention of [q_nope | q_pe] on [k_nope | k_pe] at the scale Dk^−1/2 ·
    latent_mscale (or ``scale``), out through W_out. The block (block_forward) runs from the
    query input and the latent: its W_key and W_value are W_kv_b's key and value columns, its
    stage the RoPE (latent_rope_stage)."""
    c, x = variants.get("multi_head_latent_attention").config(config), real(inputs["x"])
    p = {n: real(a) for n, a in params.items()}
    heads, nope, r = c["num_heads"], c["qk_nope_head_dim"], c["kv_lora_rank"]
    eps = number(c["rms_norm_eps"])
    q_norm = None
    if "W_q_a" in p:
        x_q, q_norm = _normalize("rms", linear(x, p["W_q_a"], p.get("b_q_a")), p["q_a_norm"], eps)
    else:
        x_q = x
    kv_a = linear(x, p["W_kv_a"], p.get("b_kv_a"))     # (..., L, r + rope)
    latent, kv_norm = _normalize("rms", kv_a[..., :r], p["kv_a_norm"], eps)
    positions = inputs.get("positions")
    positions = np.arange(x.shape[-2]) if positions is None else np.asarray(positions)
    heads_axis = (slice(None), None) if positions.ndim == 2 else ()  # (B, L) -> (B, 1, L)
    cos, sin = rope_cos_sin(variants.latent_rope(c), c["qk_rope_head_dim"], positions)
    k_pe = kv_a[..., None, :, r:]                       # (..., 1, L, rope)
    stage = latent_rope_stage(k_pe, cos[heads_axis], sin[heads_axis], c["rope_interleaved"],
                              nope)
    stages = [stage]
    mscale = latent_mscale(c)  # the scale Dk^−1/2 · m², as q · m² at the core's default scale
    if mscale is not None:
        stages.append(temperature_stage(mscale))
    w_k, w_v = _split_kv_b(p["W_kv_b"], heads, nope)
    block = {"W_query": p.get("W_q_b", p.get("W_query")), "W_key": w_k, "W_value": w_v,
             "W_out": p["W_out"], **({"b_out": p["b_out"]} if "b_out" in p else {})}
    lengths = inputs.get("query_seq_lengths")
    y, weights, saved = block_forward(x_q, latent, latent, block, num_heads=heads,
                                      stages=stages, mask=inputs.get("mask"),
                                      is_causal=c["causal"], scale=c["scale"],
                                      query_seq_lengths=lengths, key_value_seq_lengths=lengths)
    return y, weights, dict(block=saved, x=x, p=p, q_norm=q_norm, kv_norm=kv_norm, r=r,
                            heads=heads)


def _latent_backward(saved, d_y, d_weights):
    p, x, heads = saved["p"], saved["x"], saved["heads"]
    g = block_backward(saved["block"], d_y, d_weights)
    grads = {"W_out": g["W_out"], "W_kv_b": _join_kv_b(g["W_key"], g["W_value"], heads)}
    if "b_out" in g:
        grads["b_out"] = g["b_out"]
    g_c, g_w = _normalize_backward("rms", saved["kv_norm"], g["x_key"] + g["x_value"])
    grads["kv_a_norm"] = unbroadcast(g_w, p["kv_a_norm"].shape)
    g_kv_a = np.concatenate([g_c, g["k_pe"][..., 0, :, :]], axis=-1)  # (..., L, r + rope)
    g_x = linear_backward(x, p["W_kv_a"], g_kv_a, grads,
                          ("W_kv_a", "b_kv_a" if "b_kv_a" in p else None))
    if saved["q_norm"] is None:
        grads["W_query"] = g["W_query"]
        return dict(grads, x=g_x + g["x_query"])
    grads["W_q_b"] = g["W_query"]
    g_a, g_w = _normalize_backward("rms", saved["q_norm"], g["x_query"])
    grads["q_a_norm"] = unbroadcast(g_w, p["q_a_norm"].shape)
    g_x = g_x + linear_backward(x, p["W_q_a"], g_a, grads,
                                ("W_q_a", "b_q_a" if "b_q_a" in p else None))
    return dict(grads, x=g_x)


VARIANTS = {
    "scaled_dot_product_attention": (_sdpa, sdpa_backward),
    "simple_self_attention": (_simple, _simple_backward),
    "self_attention": (_self, _self_backward),
    "causal_self_attention": (_causal, _self_backward),
    "cross_attention": (_cross, _cross_backward),
    "multi_head_attention_wrapper": (_wrapper, _wrapper_backward),
    "multi_head_attention": (_multi_head, _multi_head_backward),
    "grouped_query_attention": (_grouped_query, _multi_head_backward),
    "multi_head_cross_attention": (_multi_head_cross, _multi_head_cross_backward),
    "multi_head_latent_attention": (_latent, _latent_backward),
}

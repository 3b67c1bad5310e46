"""The PyTorch attention core: one function every module calls.

Shape legend: B batch, H heads (Hkv of key and value, G = H / Hkv query heads per kv head),
Lq query length, Lk key length, Dk key width, Dv value width.
Inputs are (B, H, L, D), (H, L, D) or (L, D); masks and biases broadcast to (..., H, Lq, Lk).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from golden.positions import ROPE_BLOCK, rope_tables
from golden.validate import check_attention_args, window

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def scaled_dot_product_attention(
    query, key, value, mask=None, bias=None, *,
    is_causal=False, scale=None, softcap=None, local_window_size=None, query_offset=None,
    query_seq_lengths=None, key_value_seq_lengths=None, dropout_rate=0.0, dropout_mask=None,
    dropout_rng=None, return_weights=False,
):
    """softmax(cap(scale · Q Kᵀ) + bias, over allowed keys) V, cap(s) = c·tanh(s/c) with
    ``softcap`` c (no cap when None).

    key and value may have Hkv heads, H a multiple of Hkv: query head h reads kv head h // G
    (grouped-query and multi-query attention). Key j sits at position j, query i at
    i + ``query_offset`` (an int, or an integer tensor of shape (B,) for (B, H, L, D) inputs).
    Query i may attend key j when all of these allow it: ``mask`` (bool, True = may attend),
    ``is_causal`` (j ≤ the query's position), ``local_window_size`` w or (left, right) (position
    − left ≤ j ≤ position + right, None = unbounded), ``key_value_seq_lengths`` (j < len[b]) and
    ``query_seq_lengths`` (i < len[b]). A query row with no allowed key gives zeros in the
    output and the weights (and zero gradients).
    dropout_mask: bool keep-mask (weights kept are scaled by 1/(1 − dropout_rate)); without it,
    one is drawn with ``dropout_rng`` (a ``torch.Generator``, or the global generator).
    Returns the output (..., H, Lq, Dv), and with ``return_weights`` also the applied weights
    (..., H, Lq, Lk), after masking and dropout, in the query's dtype.

    A forward pass that needs neither the weights, nor dropout, nor softcap, nor gradients
    (inference, or under ``torch.no_grad()``) runs PyTorch's fused ``scaled_dot_product_attention``
    (``enable_gqa`` for grouped heads) with the same allowed set, bias and scale. Otherwise the
    weights are formed explicitly: the fused backward recomputes the weights from a float32
    log-sum-exp, which loses ~|scores|·2⁻²⁴ (3e-5 relative at scores of 1e3), too much for the
    gradient tolerance, and the fused kernel cannot softcap. Both paths are tested.
    """
    shape = check_attention_args(
        query, key, value, mask, bias, scale=scale, softcap=softcap,
        local_window_size=local_window_size, query_offset=query_offset,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        dropout_rate=dropout_rate, dropout_mask=dropout_mask)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    allowed, may_empty = _allowed(shape, mask, is_causal, window(local_window_size), query_offset,
                                  query_seq_lengths, key_value_seq_lengths, query.device)
    if not (return_weights or dropout_rate or softcap or _needs_grad(query, key, value, bias)):
        return _fused(query, key, value, allowed, may_empty, bias, is_causal, scale)
    compute = torch.float32 if query.dtype in _LOW_PRECISION else query.dtype
    # Scores and softmax in at least float32, as JAX's preferred_element_type: low-precision q
    # and k are widened (exactly) before the product, so the scores are never rounded to them.
    scores = scale * _grouped_matmul(query.to(compute), key.to(compute).transpose(-2, -1))
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)  # after scaling, before bias and masks
    if bias is not None:
        scores = scores + bias.to(compute)
    weights = _masked_softmax(scores, allowed, may_empty)  # (..., H, Lq, Lk)
    if dropout_rate > 0.0:
        if dropout_mask is None:
            draw = torch.rand(shape, generator=dropout_rng, device=query.device)
            dropout_mask = draw >= dropout_rate
        weights = torch.where(dropout_mask, weights / (1.0 - dropout_rate), 0.0)
    weights = weights.to(query.dtype)
    out = _grouped_matmul(weights, value)  # (..., H, Lq, Dv)
    return (out, weights) if return_weights else out


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _grouped_matmul(a, b):
    """a (..., H, Lq, X) @ b (..., Hkv, X, Y) → (..., H, Lq, Y), query head h against kv head
    h // G, without repeating b: the G query heads of a kv head are stacked along Lq, so b's
    gradient sums over its group."""
    if a.dim() < 3 or a.shape[-3] == b.shape[-3]:
        return torch.matmul(a, b)
    hkv, (h, lq) = b.shape[-3], a.shape[-3:-1]
    a = a.reshape(a.shape[:-3] + (hkv, (h // hkv) * lq, a.shape[-1]))  # (..., Hkv, G·Lq, X)
    out = torch.matmul(a, b)  # (..., Hkv, G·Lq, Y)
    return out.reshape(out.shape[:-3] + (h, lq, out.shape[-1]))  # (..., H, Lq, Y)


def _allowed(shape, mask, is_causal, sides, offset, q_lengths, kv_lengths, device):
    """(allowed, may_empty): a boolean broadcastable to ``shape`` (..., H, Lq, Lk), True = may
    attend, or None when every key is; ``may_empty`` is False only where no row can be empty
    (nothing, or plain causal with offset 0: row i keeps key 0)."""
    q = torch.arange(shape[-2], device=device)[:, None]  # (Lq, 1)
    k = torch.arange(shape[-1], device=device)  # (Lk,)
    pos = q + _per_batch(offset, device)  # query positions: (Lq, 1), or (B, 1, Lq, 1)
    left, right = sides
    terms = [t for t in (
        mask,
        k <= pos if is_causal else None,
        k >= pos - left if left is not None else None,
        k <= pos + right if right is not None else None,
        q < _per_batch(q_lengths, device) if q_lengths is not None else None,  # (B, 1, Lq, 1)
        k < _per_batch(kv_lengths, device) if kv_lengths is not None else None,  # (B, 1, 1, Lk)
    ) if t is not None]
    allowed = functools.reduce(torch.logical_and, terms) if terms else None
    offset_zero = offset is None or (isinstance(offset, int) and offset == 0)
    return allowed, not (offset_zero and len(terms) == int(bool(is_causal)))


def _per_batch(x, device):
    """An offset or lengths, None (0), an int, or an integer tensor (B,) → (B, 1, 1, 1) (a
    tensor () stays ()), to broadcast against (B, H, Lq, Lk)."""
    if x is None:
        return 0
    if isinstance(x, int):
        return x
    x = x.to(device)
    return x.reshape(-1, 1, 1, 1) if x.dim() else x


def _fused(query, key, value, allowed, may_empty, bias, is_causal, scale):
    """The fused kernel with the same semantics, an all-masked row included (zeros)."""
    grouped = query.dim() > 2 and query.shape[-3] != key.shape[-3]
    kwargs = {"scale": scale, "enable_gqa": True} if grouped else {"scale": scale}
    if bias is None and not may_empty:  # nothing, or plain causal: the kernel's own is_causal
        return F.scaled_dot_product_attention(query, key, value, is_causal=is_causal, **kwargs)
    shape = query.shape[:-1] + key.shape[-2:-1]  # (..., H, Lq, Lk)
    bias = None if bias is None else bias.to(query.dtype).expand(shape)  # a view, no copy
    if allowed is None:  # bias only
        return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, **kwargs)
    live = allowed.any(dim=-1, keepdim=True)  # (..., Lq, 1): rows with an allowed key
    allowed = allowed | ~live  # an empty row attends everywhere, then is zeroed: never NaN
    attn_mask = allowed if bias is None else torch.where(allowed, bias, -math.inf)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, **kwargs)
    return out.masked_fill(~live, 0.0) if may_empty else out


def _masked_softmax(scores, allowed, may_empty):
    """Softmax over keys; masked entries are exactly 0 and, where ``may_empty``, an all-masked
    row is all 0 (and passes back zero gradients)."""
    if allowed is None:
        return torch.softmax(scores, dim=-1)
    weights = torch.softmax(scores.masked_fill(~allowed, torch.finfo(scores.dtype).min), dim=-1)
    return weights * allowed.any(dim=-1, keepdim=True) if may_empty else weights


def rotary_embedding(x, *, theta, interleaved=False, offset=None, max_position=None):
    """Rotary position embedding of x (..., L, Dh): token i (of batch row b) at position
    i + ``offset`` (None: 0; an int; or an integer tensor (B,) for x of shape (B, H, L, Dh)).
    Feature pair i, (i, i + Dh/2) by default ("rotate half", Hugging Face's Llama) or (2i,
    2i + 1) when ``interleaved`` (GPT-J, Meta's Llama), turns by position · θ^(−2i/Dh).

    The angles are exact to a few roundings at any position: cos and sin come from float64
    tables (golden.positions.rope_tables) for positions below ``max_position`` (default L,
    exact without an offset); every position must be below it. The rotation runs in at least
    float32 and is rounded once to x's dtype.
    """
    length, dh = x.shape[-2], x.shape[-1]
    if dh % 2:
        raise ValueError(f"x's last axis Dh should be even for rotary embeddings, got {dh}")
    positions = torch.arange(length, device=x.device)  # (L,)
    offset = _per_batch(offset, x.device)  # 0, an int or (B, 1, 1, 1)
    if torch.is_tensor(offset):
        offset = offset.reshape(-1, *(1,) * (x.dim() - 2))  # (B, 1, 1): against (B, H, L)
    positions = positions + offset  # (L,) or (B, 1, L)
    max_position = length if max_position is None else max_position
    compute = torch.float32 if x.dtype in _LOW_PRECISION else x.dtype
    cos, sin = _rope_cos_sin(positions, theta, dh, max_position, compute, x.device)
    return _turn(x.to(compute), cos, sin, interleaved).to(x.dtype)


def _rope_cos_sin(positions, theta, dh, max_position, dtype, device):
    """cos and sin (..., L, Dh/2) of position · f_i, by angle addition over the tables' rows
    a = position // ROPE_BLOCK and b = position % ROPE_BLOCK."""
    tables = [torch.tensor(t, dtype=dtype, device=device)  # a copy: the tables are shared
              for t in rope_tables(float(theta), dh, max_position)]
    cos_hi, sin_hi, cos_lo, sin_lo = (t[i] for t, i in zip(
        tables, 2 * (positions // ROPE_BLOCK,) + 2 * (positions % ROPE_BLOCK,)))
    return cos_hi * cos_lo - sin_hi * sin_lo, sin_hi * cos_lo + cos_hi * sin_lo


def _turn(x, cos, sin, interleaved):
    """(a, b) -> (a cos − b sin, b cos + a sin) for each feature pair of x (..., L, Dh)."""
    half = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    turned = (a * cos - b * sin, b * cos + a * sin)
    return torch.stack(turned, dim=-1).flatten(-2) if interleaved else torch.cat(turned, dim=-1)

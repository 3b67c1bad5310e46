"""The PyTorch attention core: one function every module calls.

Shape legend: B batch, H heads, Lq query length, Lk key length, Dk key width, Dv value width.
Inputs are (B, H, L, D), (H, L, D) or (L, D); masks and biases broadcast to (..., Lq, Lk).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from golden.validate import check_attention_args

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def scaled_dot_product_attention(
    query, key, value, mask=None, bias=None, *,
    is_causal=False, scale=None, dropout_rate=0.0, dropout_mask=None, dropout_rng=None,
    return_weights=False,
):
    """softmax(scale · Q Kᵀ + bias, over allowed keys) V.

    mask: bool, True = may attend; combined with ``is_causal`` (query i sees keys j ≤ i).
    A query row with no allowed key gives zeros in the output and the weights.
    dropout_mask: bool keep-mask (weights kept are scaled by 1/(1 − dropout_rate)); without it,
    one is drawn with ``dropout_rng`` (a ``torch.Generator``, or the global generator).
    Returns the output (..., Lq, Dv), and with ``return_weights`` also the applied weights
    (..., Lq, Lk), after masking and dropout, in the query's dtype.

    A forward pass that needs neither the weights, nor dropout, nor gradients (inference, or
    under ``torch.no_grad()``) runs PyTorch's fused ``scaled_dot_product_attention`` with the
    same mask, bias and scale. Otherwise the weights are formed explicitly: the fused backward
    recomputes the weights from a float32 log-sum-exp, which loses ~|scores|·2⁻²⁴ (3e-5 relative
    at scores of 1e3), too much for the gradient tolerance. Both paths are tested on the fixtures.
    """
    shape = check_attention_args(query, key, value, mask, bias, scale=scale,
                                 dropout_rate=dropout_rate, dropout_mask=dropout_mask)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    if not (return_weights or dropout_rate or _needs_grad(query, key, value, bias)):
        return _fused(query, key, value, mask, bias, is_causal, scale)
    compute = torch.float32 if query.dtype in _LOW_PRECISION else query.dtype
    # Scores and softmax in at least float32, as JAX's preferred_element_type: low-precision q
    # and k are widened (exactly) before the product, so the scores are never rounded to them.
    scores = scale * torch.matmul(query.to(compute), key.to(compute).transpose(-2, -1))
    if bias is not None:
        scores = scores + bias.to(compute)
    weights = _masked_softmax(scores, _allowed(shape, mask, is_causal, query.device),
                              may_empty=mask is not None)
    if dropout_rate > 0.0:
        if dropout_mask is None:
            draw = torch.rand(shape, generator=dropout_rng, device=query.device)
            dropout_mask = draw >= dropout_rate
        weights = torch.where(dropout_mask, weights / (1.0 - dropout_rate), 0.0)
    weights = weights.to(query.dtype)
    out = torch.matmul(weights, value)  # (..., Lq, Dv)
    return (out, weights) if return_weights else out


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _fused(query, key, value, mask, bias, is_causal, scale):
    """The fused kernel with the same semantics, an all-masked row included (zeros)."""
    if mask is None and bias is None:
        return F.scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale)
    shape = query.shape[:-1] + key.shape[-2:-1]  # (..., Lq, Lk)
    allowed = _allowed(shape, mask, is_causal, query.device)
    bias = None if bias is None else bias.to(query.dtype).expand(shape)  # a view, no copy
    if allowed is None:  # bias only
        return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scale)
    live = allowed.any(dim=-1, keepdim=True)  # (..., Lq, 1): rows with an allowed key
    allowed = allowed | ~live  # an empty row attends everywhere, then is zeroed: never NaN
    attn_mask = allowed if bias is None else torch.where(allowed, bias, -math.inf)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale)
    return out.masked_fill(~live, 0.0)


def _allowed(shape, mask, is_causal, device):
    """Boolean broadcastable to (..., Lq, Lk), or None when every key is allowed."""
    allowed = mask
    if is_causal:
        causal = torch.ones(shape[-2:], dtype=torch.bool, device=device).tril()  # j <= i
        allowed = causal if allowed is None else allowed & causal
    return allowed


def _masked_softmax(scores, allowed, may_empty):
    """Softmax over keys; masked entries are exactly 0 and, where ``may_empty`` (a mask was
    given: a causal row always keeps key 0), an all-masked row is all 0."""
    if allowed is None:
        return torch.softmax(scores, dim=-1)
    weights = torch.softmax(scores.masked_fill(~allowed, torch.finfo(scores.dtype).min), dim=-1)
    return weights * allowed.any(dim=-1, keepdim=True) if may_empty else weights

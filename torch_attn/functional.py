"""The PyTorch attention core: one function every module calls.

Shape legend: B batch, H heads, Lq query length, Lk key length, Dk key width, Dv value width.
Inputs are (B, H, L, D), (H, L, D) or (L, D); masks and biases broadcast to (..., Lq, Lk).
"""

from __future__ import annotations

import math

import torch

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
    """
    shape = check_attention_args(query, key, value, mask, bias, scale=scale,
                                 dropout_rate=dropout_rate, dropout_mask=dropout_mask)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    compute = torch.float32 if query.dtype in _LOW_PRECISION else query.dtype
    scores = scale * torch.matmul(query, key.transpose(-2, -1)).to(compute)  # (..., Lq, Lk)
    if bias is not None:
        scores = scores + bias.to(compute)
    weights = _masked_softmax(scores, _allowed(shape, mask, is_causal, query.device))
    if dropout_rate > 0.0:
        if dropout_mask is None:
            draw = torch.rand(shape, generator=dropout_rng, device=query.device)
            dropout_mask = draw >= dropout_rate
        weights = torch.where(dropout_mask, weights / (1.0 - dropout_rate), 0.0)
    weights = weights.to(query.dtype)
    out = torch.matmul(weights, value)  # (..., Lq, Dv)
    return (out, weights) if return_weights else out


def _allowed(shape, mask, is_causal, device):
    """Boolean broadcastable to (..., Lq, Lk), or None when every key is allowed."""
    allowed = mask
    if is_causal:
        causal = torch.ones(shape[-2:], dtype=torch.bool, device=device).tril()  # j <= i
        allowed = causal if allowed is None else allowed & causal
    return allowed


def _masked_softmax(scores, allowed):
    """Softmax over keys; masked entries are exactly 0 and an all-masked row is all 0."""
    if allowed is None:
        return torch.softmax(scores, dim=-1)
    filled = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return torch.softmax(filled, dim=-1) * allowed.any(dim=-1, keepdim=True)

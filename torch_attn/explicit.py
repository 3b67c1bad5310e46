"""The torch core's "explicit" implementation, and the allowed set every implementation shares.

explicit: the (..., H, Lq, Lk) weights formed (scores and softmax in at least float32), then
the weighted sum of values; autograd differentiates it. ``Where`` turns the allowed-set
arguments into a boolean mask through golden.positions.allowed_terms, the rule JAX's core uses
too, and cuts it into chunks for "row_chunks".

Shape legend: B batch, H heads (Hkv of key and value, G = H / Hkv), Lq query length, Lk key
length, Dk key width, Dv value width.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from golden.positions import allowed_terms

LOW_PRECISION = (torch.float16, torch.bfloat16)


def explicit(query, key, value, allowed, may_empty, bias, scale, softcap, dropout_rate,
             dropout_mask):
    """(output (..., H, Lq, Dv), weights (..., H, Lq, Lk)), the weights formed."""
    compute = torch.float32 if query.dtype in LOW_PRECISION else query.dtype
    # Scores and softmax in at least float32, as JAX's preferred_element_type: low-precision q
    # and k are widened (exactly) before the product, so the scores are never rounded to them.
    scores = scale * grouped_matmul(query.to(compute), key.to(compute).transpose(-2, -1))
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)  # after scaling, before bias and masks
    if bias is not None:
        scores = scores + bias.to(compute)
    weights = masked_softmax(scores, allowed, may_empty)  # (..., H, Lq, Lk)
    if dropout_rate > 0.0:
        weights = torch.where(dropout_mask, weights / (1.0 - dropout_rate), 0.0)
    weights = weights.to(query.dtype)
    return grouped_matmul(weights, value), weights  # (..., H, Lq, Dv)


def draw_dropout_mask(shape, rate, generator, device):
    """A bool dropout mask of ``shape``, True (kept) with probability 1 − rate."""
    return torch.rand(shape, generator=generator, device=device) >= rate


def grouped_matmul(a, b):
    """a (..., H, Lq, X) @ b (..., Hkv, X, Y) → (..., H, Lq, Y), query head h against kv head
    h // G, without repeating b: the G query heads of a kv head are stacked along Lq, so b's
    gradient sums over its group."""
    if a.dim() < 3 or a.shape[-3] == b.shape[-3]:
        return torch.matmul(a, b)
    hkv, (h, lq) = b.shape[-3], a.shape[-3:-1]
    a = a.reshape(a.shape[:-3] + (hkv, (h // hkv) * lq, a.shape[-1]))  # (..., Hkv, G·Lq, X)
    out = torch.matmul(a, b)  # (..., Hkv, G·Lq, Y)
    return out.reshape(out.shape[:-3] + (h, lq, out.shape[-1]))  # (..., H, Lq, Y)


def masked_softmax(scores, allowed, may_empty):
    """Softmax over keys; masked entries are exactly 0 and, where ``may_empty``, an all-masked
    row is all 0 (and passes back zero gradients)."""
    if allowed is None:
        return torch.softmax(scores, dim=-1)
    weights = torch.softmax(scores.masked_fill(~allowed, torch.finfo(scores.dtype).min), dim=-1)
    return weights * allowed.any(dim=-1, keepdim=True) if may_empty else weights


class Where(NamedTuple):
    """The allowed-set arguments other than the mask: is_causal, the window's (left, right),
    query_offset, query_seq_lengths and key_value_seq_lengths."""

    is_causal: bool
    window: tuple
    offset: object
    q_lengths: object
    kv_lengths: object

    def allowed(self, shape, mask, device):
        """(allowed, may_empty): a boolean broadcastable to ``shape`` (..., H, Lq, Lk), True =
        may attend, or None when every key is; ``may_empty`` is False only where no row can be
        empty (nothing, or plain causal with offset 0: row i keeps key 0)."""
        q = torch.arange(shape[-2], device=device)[:, None]  # (Lq, 1)
        k = torch.arange(shape[-1], device=device)  # (Lk,)
        pos = q + per_batch(self.offset, device)  # query positions: (Lq, 1), or (B, 1, Lq, 1)
        q_lengths, kv_lengths = self.q_lengths, self.kv_lengths
        terms = [t for t in [mask] if t is not None] + allowed_terms(
            q, k, pos, is_causal=self.is_causal, window=self.window,
            q_lengths=None if q_lengths is None else per_batch(q_lengths, device),  # (B,1,1,1)
            kv_lengths=None if kv_lengths is None else per_batch(kv_lengths, device))
        allowed = functools.reduce(torch.logical_and, terms) if terms else None
        offset_zero = self.offset is None or (isinstance(self.offset, int) and self.offset == 0)
        return allowed, not (offset_zero and len(terms) == int(bool(self.is_causal)))

    def chunk(self, start, stop, lk, offsets):
        """(k0, k1, the arguments for query rows start:stop against keys k0:k1 alone), given
        the (smallest, largest) query offset: every key a row of the chunk may see under the
        causal and window bounds lies in k0:k1 (non-empty when Lk > 0), and the offset and
        lengths move with the slices (row i of the chunk is query start + i, key j is key
        k0 + j), so the allowed set is the same."""
        (low, high), (left, right) = offsets, self.window
        ahead = [r for r in (0 if self.is_causal else None, right) if r is not None]
        k1 = lk if not ahead else min(lk, stop + high + min(ahead))  # past the last one seen
        k0 = 0 if left is None else min(max(0, start + low - left), max(lk - 1, 0))
        return k0, k1, self._replace(
            offset=(0 if self.offset is None else self.offset) + start - k0,
            q_lengths=_minus(self.q_lengths, start), kv_lengths=_minus(self.kv_lengths, k0))


def per_batch(x, device):
    """An offset or lengths, None (0), an int, or an integer tensor (B,) → (B, 1, 1, 1) (a
    tensor () stays ()), to broadcast against (B, H, Lq, Lk)."""
    if x is None:
        return 0
    if isinstance(x, int):
        return x
    x = x.to(device)
    return x.reshape(-1, 1, 1, 1) if x.dim() else x


def offset_range(offset) -> tuple[int, int]:
    """(smallest, largest) query offset over the batch."""
    if offset is None or isinstance(offset, int):
        return (offset or 0,) * 2
    return int(offset.min()), int(offset.max())


def _minus(lengths, n):
    """Lengths n positions shorter, clamped at 0 (None stays None)."""
    if lengths is None or isinstance(lengths, int):
        return lengths if lengths is None else max(lengths - n, 0)
    return (lengths - n).clamp(min=0)

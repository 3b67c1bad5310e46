"""The torch core's "explicit" implementation, and the allowed set every implementation shares.

explicit: the (..., H, Lq, Lk) weights formed (scores and softmax in at least float32; with
sinks, the head's sink logit as one more column of the softmax, dropped after it), then the
weighted sum of values; autograd differentiates it. ``Where`` turns the allowed-set
arguments into a boolean mask through golden.specification.positions.allowed_terms, the rule JAX's
core uses too, and cuts it into chunks for "row_chunks".

Shape legend: B batch, H heads (Hkv of key and value, G = H / Hkv), Lq query length, Lk key
length, Dk key width, Dv value width.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from golden.specification.positions import allowed_terms

LOW_PRECISION = (torch.float16, torch.bfloat16)


def explicit(query, key, value, allowed, may_empty, bias, scale, softcap, dropout_rate,
             dropout_mask, sinks=None):
    """(output (..., H, Lq, Dv), weights (..., H, Lq, Lk)), the weights formed. ``sinks`` (H,)
    or (): one logit per query head in every row's softmax, taking no value."""
    compute = torch.float32 if query.dtype in LOW_PRECISION else query.dtype
    # Scores and softmax in at least float32, as JAX's preferred_element_type: low-precision q
    # and k are widened (exactly) before the product, so the scores are never rounded to them.
    scores = scale * grouped_matmul(query.to(compute), key.to(compute).transpose(-2, -1))
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)  # after scaling, before bias and masks
    if bias is not None:
        scores = scores + bias.to(compute)
    if sinks is None:
        weights = masked_softmax(scores, allowed, may_empty)  # (..., H, Lq, Lk)
    else:
        weights = sink_softmax(scores, allowed, sinks.to(compute))
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


def sink_softmax(scores, allowed, sinks):
    """Softmax over the keys and the head's sink logit (sinks (H,) or ()), the sink's column
    dropped: softmax([S, s])[..., :-1], as GPT-OSS. Masked entries are exactly 0; a row with
    every key masked gives zeros (the sink takes it all)."""
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    sink = sinks.reshape(sinks.shape + (1, 1)).expand(scores.shape[:-1] + (1,))  # (..., H, Lq, 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return weights if allowed is None else weights * allowed  # exp(min − s) is 0 but for s ≈ min


class Where(NamedTuple):
    """The allowed-set arguments other than the mask: is_causal, the window's (left, right),
    query_offset, query_seq_lengths, key_value_seq_lengths and attention_chunk_size."""

    is_causal: bool
    window: tuple
    offset: object
    q_lengths: object
    kv_lengths: object
    chunk_size: int | None = None  # attention_chunk_size

    def allowed(self, shape, mask, device):
        """(allowed, may_empty): a boolean broadcastable to ``shape`` (..., H, Lq, Lk), True =
        may attend, or None when every key is; ``may_empty`` is False only where no row can be
        empty (nothing, or plain causal with offset 0: row i keeps key 0)."""
        q = torch.arange(shape[-2], device=device)[:, None]  # (Lq, 1)
        k = torch.arange(shape[-1], device=device)  # (Lk,)
        pos = q + per_batch(self.offset, device)  # query positions: (Lq, 1), or (B, 1, Lq, 1)
        q_lengths, kv_lengths = self.q_lengths, self.kv_lengths
        terms = [t for t in [mask] if t is not None] + allowed_terms(
            q, k, pos, is_causal=self.is_causal, window=self.window, chunk=self.chunk_size,
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
        (low, high), (left, right), c = offsets, self.window, self.chunk_size
        ahead = [r for r in (0 if self.is_causal else None, right) if r is not None]
        k1 = lk if not ahead else min(lk, stop + high + min(ahead))  # past the last one seen
        k0 = 0 if left is None else max(0, start + low - left)
        if c is not None:  # the chunks of the rows' positions; k0 a multiple of C, so that
            # key j − k0 and position p − k0 fall in chunks k0 / C apart, as j and p do
            k0, k1 = max(k0, (start + low) // c * c), min(k1, ((stop - 1 + high) // c + 1) * c)
        k0 = min(k0, max(lk - 1, 0))
        k0 = k0 if c is None else k0 // c * c
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

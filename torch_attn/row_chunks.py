"""The torch core's "row_chunks" implementation: the explicit path by chunks of query rows.

Memory O(rows · Lk) with gradients, never all the weights (so it cannot return them). The
queries are cut into chunks of rows, each run through the explicit path on the keys its rows can
see under the causal, window and attention-chunk bounds (the sinks, one logit per head, go whole
to every chunk, and their gradient sums over the chunks); the forward keeps only the inputs and
the output, the backward recomputes each chunk's weights (FlashAttention's recipe, by chunks of
rows, but not its online softmax: that is JAX's "blockwise"). Each row's arithmetic is the
explicit path's, so the errors are the same (the gradients of key, value and bias are summed
over chunks in at least float32).

Shape legend: B batch, H heads (Hkv of key and value), Lq query length, Lk key length, Dk key
width, Dv value width.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from torch_attn import explicit as _explicit_module
from torch_attn.explicit import Where, draw_dropout_mask, offset_range

# A chunk's query rows: block_sizes[0] when given, else as many as keep its weights (B·H·rows·Lk)
# near CHUNK_ELEMENTS, and at least CHUNK_MIN_ROWS. The measurements behind both numbers:
# docs/performance.md, "Why the thresholds are where they are".
CHUNK_ELEMENTS = 2**21
CHUNK_MIN_ROWS = 64


def row_chunks(query, key, value, mask, bias, dropout_mask, where: Where, scale, softcap,
               dropout_rate, generator, rows=None, sinks=None):
    """The output (..., H, Lq, Dv) of _RowChunks, its chunks planned here: ``rows`` query rows
    per chunk (None: chunk_rows)."""
    lq, lk = query.shape[-2], key.shape[-2]
    rows = rows or chunk_rows(query.shape[:-2], lk)
    bounds = [(start, min(start + rows, lq)) for start in range(0, lq, rows)]
    seeds = [None] * len(bounds)
    if dropout_rate > 0.0 and dropout_mask is None:  # a mask per chunk, drawn from its seed
        seeds = torch.randint(2**62, (len(bounds),), generator=generator,
                              device=query.device).tolist()
    offsets = offset_range(where.offset)
    chunks = [_Chunk(start, stop, *where.chunk(start, stop, lk, offsets), seed)
              for (start, stop), seed in zip(bounds, seeds)]
    plan = _Plan(chunks, mask, dropout_mask, scale, softcap, dropout_rate)
    return _RowChunks.apply(query, key, value, bias, sinks, plan)


def chunk_rows(batch_heads, lk) -> int:
    """Query rows per chunk: as many as keep B·H·rows·Lk weights near CHUNK_ELEMENTS, at least
    CHUNK_MIN_ROWS."""
    per_row = math.prod(batch_heads) * max(lk, 1)  # weights of one query row, over B and H
    return max(CHUNK_MIN_ROWS, CHUNK_ELEMENTS // per_row)


class _Chunk(NamedTuple):
    """Query rows start:stop against keys k0:k1, with its allowed-set arguments and the seed
    of its drawn dropout mask (None: none drawn)."""

    start: int
    stop: int
    k0: int
    k1: int
    where: Where
    seed: int | None

    def part(self, x):
        """x's part for this chunk: x[..., start:stop, k0:k1] for x broadcastable to
        (..., Lq, Lk); size-1 (broadcast) axes stay whole; None stays None."""
        if x is None or x.dim() == 0:
            return x
        if x.dim() >= 2 and x.shape[-2] != 1:
            x = x[..., self.start:self.stop, :]
        return x[..., self.k0:self.k1] if x.shape[-1] != 1 else x

    def inputs(self, query, key, value, bias, sinks):
        """The chunk's query (..., H, rows, Dk), key and value (..., Hkv, keys, D) and bias
        (views; None stays None), and the sinks (H,) or (), whole."""
        rows, keys = slice(self.start, self.stop), slice(self.k0, self.k1)
        qkv = [None if x is None else x[..., cut, :]
               for x, cut in zip((query, key, value), (rows, keys, keys))]
        return qkv + [self.part(bias), sinks]


class _Plan(NamedTuple):
    """The chunks and what every chunk shares: the mask and dropout mask (whole), the scale,
    softcap and dropout rate."""

    chunks: list
    mask: object
    dropout_mask: object
    scale: float
    softcap: object
    dropout_rate: float

    def output(self, chunk, query, key, value, bias, sinks):
        """One chunk's output (..., H, rows, Dv): its allowed set and dropout mask, then the
        explicit path."""
        shape = query.shape[:-1] + key.shape[-2:-1]  # (..., H, rows, keys)
        allowed, may_empty = chunk.where.allowed(shape, chunk.part(self.mask), query.device)
        dropout_mask = chunk.part(self.dropout_mask)
        if chunk.seed is not None:
            generator = torch.Generator(device=query.device).manual_seed(chunk.seed)
            dropout_mask = draw_dropout_mask(shape, self.dropout_rate, generator, query.device)
        return _explicit_module.explicit(query, key, value, allowed, may_empty, bias,
                                         self.scale, self.softcap, self.dropout_rate,
                                         dropout_mask, sinks)[0]


class _RowChunks(torch.autograd.Function):
    """The explicit path chunk by chunk of query rows. The forward keeps the inputs and the
    output only; the backward recomputes each chunk's weights and accumulates the gradients
    (in at least float32) into whole-size buffers. Chunks run from the last (the widest key
    range when causal) to the first, so each one's temporaries fit where the last one's were."""

    @staticmethod
    def forward(ctx, query, key, value, bias, sinks, plan):
        ctx.save_for_backward(query, key, value, bias, sinks)
        ctx.plan = plan
        out = query.new_empty(query.shape[:-1] + value.shape[-1:])  # (..., H, Lq, Dv)
        for chunk in reversed(plan.chunks):
            out[..., chunk.start:chunk.stop, :] = plan.output(chunk, *chunk.inputs(
                query, key, value, bias, sinks))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        inputs, plan = ctx.saved_tensors, ctx.plan
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[:5]) if need]
        grads = [None] * 5
        for i in wanted:
            wider = torch.promote_types(inputs[i].dtype, torch.float32)
            grads[i] = torch.zeros(inputs[i].shape, dtype=wider, device=inputs[i].device)
        for chunk in reversed(plan.chunks):
            parts = [x if x is None else x.detach() for x in chunk.inputs(*inputs)]
            with torch.enable_grad():
                for i in wanted:
                    parts[i].requires_grad_()
                out = plan.output(chunk, *parts)
                found = torch.autograd.grad(out, [parts[i] for i in wanted],
                                            d_out[..., chunk.start:chunk.stop, :])
            for i, g in zip(wanted, found):
                chunk.inputs(*grads)[i].add_(g)  # the same slice of the buffer (sinks: whole)
        return (*(g if g is None else g.to(x.dtype) for g, x in zip(grads, inputs)), None)

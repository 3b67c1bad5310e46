"""The PyTorch attention core: one function every module calls.

Shape legend: B batch, H heads (Hkv of key and value, G = H / Hkv query heads per kv head),
Lq query length, Lk key length, Dk key width, Dv value width.
Inputs are (B, H, L, D), (H, L, D) or (L, D); masks and biases broadcast to (..., H, Lq, Lk).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from golden.positions import allowed_terms
from golden.validate import (
    check_attention_args,
    check_flags,
    check_implementation,
    window,
)

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def scaled_dot_product_attention(
    query, key, value, mask=None, bias=None, *,
    is_causal=False, scale=None, softcap=None, local_window_size=None, query_offset=None,
    query_seq_lengths=None, key_value_seq_lengths=None, dropout_rate=0.0, dropout_mask=None,
    dropout_rng=None, implementation=None, return_weights=False,
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

    ``implementation``:
    - "dense": as before the argument existed. A forward pass that needs neither the weights,
      nor dropout, nor softcap, nor gradients (inference, or under ``torch.no_grad()``) runs
      PyTorch's fused ``scaled_dot_product_attention`` (``enable_gqa`` for grouped heads) with
      the same allowed set, bias and scale; otherwise the (..., H, Lq, Lk) weights are formed.
    - "blockwise": memory O(rows · Lk) with gradients, never all the weights (so it cannot
      return them). The queries are cut into chunks of rows (see BLOCKWISE_ELEMENTS), each
      run through the explicit path on the keys its rows can see under the causal and window
      bounds; the forward keeps only the inputs and the output, the backward recomputes each
      chunk's weights (FlashAttention's recipe, by chunks of rows). Every argument keeps its
      meaning and each row's arithmetic is the explicit path's, so the errors are the same
      (the gradients of key, value and bias are summed over chunks in at least float32).
      Differences: a keep-mask drawn from ``dropout_rng`` is drawn chunk by chunk, from seeds
      the generator gives, so it is not the one dense draws from the same generator state;
      and its gradients cannot be differentiated again (no double backward), nor taken by
      ``torch.func`` transforms (use "dense" for either). Its time and memory against dense
      and PyTorch's fused kernel: docs/core.md, "Long sequences".
    - None: "blockwise" when the weights are not returned, would be formed (gradients,
      dropout or softcap) and have at least BLOCKWISE_MIN_ELEMENTS (2²⁴) elements B·H·Lq·Lk;
      "dense" otherwise (the measurements: docs/performance.md).
    PyTorch's fused kernel is not used for gradients: its backward recomputes the weights from
    a float32 log-sum-exp, which loses ~|scores|·2⁻²⁴, and it can neither softcap nor take a
    keep-mask. Measured against the float64 reference (B=1, H=1, D=64, float32, the loss
    Σ O⊙dO, causal or not, L=2048 and 4096), as relative error norms: on normal inputs its
    gradients reach 5.7e-7, near the explicit path's 4.4e-7, but on scores of about 5e2
    (integer q and k, exact in float32) 2.9e-5 to 3.5e-5 for dQ and dK and 9.6e-6 to 1.1e-5
    for dV, against the float32 gradient tolerance of 4e-6 (the explicit path: 4.7e-7 at
    most). "blockwise" is therefore the explicit path, by chunks: its errors there are the
    explicit path's to two digits (4.7e-7 at most).
    """
    _expect_tensors(query=query, key=key, value=value, mask=mask, bias=bias,
                    dropout_mask=dropout_mask)
    check_flags(is_causal=is_causal, return_weights=return_weights)
    check_implementation(implementation, return_weights)
    if dropout_rng is not None and not isinstance(dropout_rng, torch.Generator):
        raise TypeError(f"dropout_rng should be a torch.Generator or None, "
                        f"got {type(dropout_rng).__name__}")
    shape = check_attention_args(
        query, key, value, mask, bias, scale=scale, softcap=softcap,
        local_window_size=local_window_size, query_offset=query_offset,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        dropout_rate=dropout_rate, dropout_mask=dropout_mask)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    explicit = return_weights or dropout_rate or softcap or _needs_grad(query, key, value, bias)
    where = _Where(is_causal, window(local_window_size), query_offset, query_seq_lengths,
                   key_value_seq_lengths)
    if _choose(implementation, shape, explicit, return_weights) == "blockwise":
        rng = (dropout_rate, dropout_rng)
        return _blockwise(query, key, value, mask, bias, dropout_mask, where, scale, softcap, rng)
    allowed, may_empty = where.allowed(shape, mask, query.device)
    if not explicit:
        return _fused(query, key, value, allowed, may_empty, bias, is_causal, scale)
    if dropout_rate > 0.0 and dropout_mask is None:
        dropout_mask = _draw_keep(shape, dropout_rate, dropout_rng, query.device)
    out, weights = _explicit(query, key, value, allowed, may_empty, bias, scale, softcap,
                             dropout_rate, dropout_mask)
    return (out, weights) if return_weights else out


def _expect_tensors(**arrays) -> None:
    """TypeError naming an argument that is given but not a torch.Tensor (a NumPy array, say)."""
    for arg, x in arrays.items():
        if x is not None and not torch.is_tensor(x):
            raise TypeError(f"{arg} should be a torch.Tensor, got {type(x).__name__}")


# None means "blockwise" from this many weights (B·H·Lq·Lk) up. A chunk's query rows:
# BLOCKWISE_ROWS if set (tests use tiny ones), else as many as keep its weights (B·H·rows·Lk)
# near BLOCKWISE_ELEMENTS, and at least BLOCKWISE_MIN_ROWS. The measurements behind the three
# numbers: docs/performance.md, "Why the thresholds are where they are".
BLOCKWISE_MIN_ELEMENTS = 2**24
BLOCKWISE_ROWS = None
BLOCKWISE_ELEMENTS = 2**21
BLOCKWISE_MIN_ROWS = 64


def _choose(implementation, shape, explicit, return_weights) -> str:
    """The implementation None stands for: "blockwise" where it would save forming large
    weights nobody asked for, else "dense"."""
    if implementation is not None:
        return implementation
    large = math.prod(shape) >= BLOCKWISE_MIN_ELEMENTS
    return "blockwise" if explicit and large and not return_weights else "dense"


def _explicit(query, key, value, allowed, may_empty, bias, scale, softcap, rate, keep):
    """(output (..., H, Lq, Dv), weights (..., H, Lq, Lk)), the weights formed."""
    compute = torch.float32 if query.dtype in _LOW_PRECISION else query.dtype
    # Scores and softmax in at least float32, as JAX's preferred_element_type: low-precision q
    # and k are widened (exactly) before the product, so the scores are never rounded to them.
    scores = scale * _grouped_matmul(query.to(compute), key.to(compute).transpose(-2, -1))
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)  # after scaling, before bias and masks
    if bias is not None:
        scores = scores + bias.to(compute)
    weights = _masked_softmax(scores, allowed, may_empty)  # (..., H, Lq, Lk)
    if rate > 0.0:
        weights = torch.where(keep, weights / (1.0 - rate), 0.0)
    weights = weights.to(query.dtype)
    return _grouped_matmul(weights, value), weights  # (..., H, Lq, Dv)


def _draw_keep(shape, rate, generator, device):
    """A bool keep-mask of ``shape``, True with probability 1 − rate."""
    return torch.rand(shape, generator=generator, device=device) >= rate


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


class _Where(NamedTuple):
    """The allowed-set arguments other than the mask: is_causal, the window's (left, right),
    query_offset, query_seq_lengths and key_value_seq_lengths."""

    is_causal: bool
    sides: tuple
    offset: object
    q_lengths: object
    kv_lengths: object

    def allowed(self, shape, mask, device):
        """(allowed, may_empty): a boolean broadcastable to ``shape`` (..., H, Lq, Lk), True =
        may attend, or None when every key is; ``may_empty`` is False only where no row can be
        empty (nothing, or plain causal with offset 0: row i keeps key 0)."""
        q = torch.arange(shape[-2], device=device)[:, None]  # (Lq, 1)
        k = torch.arange(shape[-1], device=device)  # (Lk,)
        pos = q + _per_batch(self.offset, device)  # query positions: (Lq, 1), or (B, 1, Lq, 1)
        q_lengths, kv_lengths = self.q_lengths, self.kv_lengths
        terms = [t for t in [mask] if t is not None] + allowed_terms(
            q, k, pos, is_causal=self.is_causal, window=self.sides,
            q_len=None if q_lengths is None else _per_batch(q_lengths, device),  # (B,1,Lq,1)
            kv_len=None if kv_lengths is None else _per_batch(kv_lengths, device))  # (B,1,1,Lk)
        allowed = functools.reduce(torch.logical_and, terms) if terms else None
        offset_zero = self.offset is None or (isinstance(self.offset, int) and self.offset == 0)
        return allowed, not (offset_zero and len(terms) == int(bool(self.is_causal)))

    def chunk(self, start, stop, lk, offsets):
        """(k0, k1, the arguments for query rows start:stop against keys k0:k1 alone), given
        the (smallest, largest) query offset: every key a row of the chunk may see under the
        causal and window bounds lies in k0:k1 (non-empty when Lk > 0), and the offset and
        lengths move with the slices (row i of the chunk is query start + i, key j is key
        k0 + j), so the allowed set is the same."""
        (low, high), (left, right) = offsets, self.sides
        ahead = [r for r in (0 if self.is_causal else None, right) if r is not None]
        k1 = lk if not ahead else min(lk, stop + high + min(ahead))  # past the last one seen
        k0 = 0 if left is None else min(max(0, start + low - left), max(lk - 1, 0))
        return k0, k1, self._replace(
            offset=(0 if self.offset is None else self.offset) + start - k0,
            q_lengths=_minus(self.q_lengths, start), kv_lengths=_minus(self.kv_lengths, k0))


def _per_batch(x, device):
    """An offset or lengths, None (0), an int, or an integer tensor (B,) → (B, 1, 1, 1) (a
    tensor () stays ()), to broadcast against (B, H, Lq, Lk)."""
    if x is None:
        return 0
    if isinstance(x, int):
        return x
    x = x.to(device)
    return x.reshape(-1, 1, 1, 1) if x.dim() else x


def _offset_range(offset) -> tuple[int, int]:
    """(smallest, largest) query offset over the batch."""
    if offset is None or isinstance(offset, int):
        return (offset or 0,) * 2
    return int(offset.min()), int(offset.max())


def _minus(lengths, n):
    """Lengths n positions shorter, clamped at 0 (None stays None)."""
    if lengths is None or isinstance(lengths, int):
        return lengths if lengths is None else max(lengths - n, 0)
    return (lengths - n).clamp(min=0)


def _blockwise(query, key, value, mask, bias, keep, where, scale, softcap, drop):
    """The output (..., H, Lq, Dv) of _Blockwise, its chunks planned here."""
    (rate, generator), (lq, lk) = drop, (query.shape[-2], key.shape[-2])
    rows = _chunk_rows(query.shape[:-2], lk)
    bounds = [(start, min(start + rows, lq)) for start in range(0, lq, rows)]
    seeds = [None] * len(bounds)
    if rate > 0.0 and keep is None:  # a keep-mask per chunk, drawn (and redrawn) from its seed
        seeds = torch.randint(2**62, (len(bounds),), generator=generator,
                              device=query.device).tolist()
    offsets = _offset_range(where.offset)
    chunks = [_Chunk(start, stop, *where.chunk(start, stop, lk, offsets), seed)
              for (start, stop), seed in zip(bounds, seeds)]
    plan = _Plan(chunks, mask, keep, scale, softcap, rate)
    return _Blockwise.apply(query, key, value, bias, plan)


class _Chunk(NamedTuple):
    """Query rows start:stop against keys k0:k1, with its allowed-set arguments and the seed
    of its drawn keep-mask (None: none drawn)."""

    start: int
    stop: int
    k0: int
    k1: int
    where: _Where
    seed: int | None

    def part(self, x):
        """x's part for this chunk: x[..., start:stop, k0:k1] for x broadcastable to
        (..., Lq, Lk); size-1 (broadcast) axes stay whole; None stays None."""
        if x is None or x.dim() == 0:
            return x
        if x.dim() >= 2 and x.shape[-2] != 1:
            x = x[..., self.start:self.stop, :]
        return x[..., self.k0:self.k1] if x.shape[-1] != 1 else x

    def inputs(self, query, key, value, bias):
        """The chunk's query (..., H, rows, Dk), key and value (..., Hkv, keys, D) and bias
        (views; None stays None)."""
        rows, keys = slice(self.start, self.stop), slice(self.k0, self.k1)
        qkv = [None if x is None else x[..., cut, :]
               for x, cut in zip((query, key, value), (rows, keys, keys))]
        return qkv + [self.part(bias)]


class _Plan(NamedTuple):
    """The chunks and what every chunk shares: the mask and keep-mask (whole), the scale,
    softcap and dropout rate."""

    chunks: list
    mask: object
    keep: object
    scale: float
    softcap: object
    rate: float

    def output(self, chunk, query, key, value, bias):
        """One chunk's output (..., H, rows, Dv): its allowed set and keep-mask, then the
        explicit path."""
        shape = query.shape[:-1] + key.shape[-2:-1]  # (..., H, rows, keys)
        allowed, may_empty = chunk.where.allowed(shape, chunk.part(self.mask), query.device)
        keep = chunk.part(self.keep)
        if chunk.seed is not None:
            generator = torch.Generator(device=query.device).manual_seed(chunk.seed)
            keep = _draw_keep(shape, self.rate, generator, query.device)
        return _explicit(query, key, value, allowed, may_empty, bias, self.scale, self.softcap,
                         self.rate, keep)[0]


class _Blockwise(torch.autograd.Function):
    """The explicit path chunk by chunk of query rows. The forward keeps the inputs and the
    output only; the backward recomputes each chunk's weights and accumulates the gradients
    (in at least float32) into whole-size buffers. Chunks run from the last (the widest key
    range when causal) to the first, so each one's temporaries fit where the last one's were."""

    @staticmethod
    def forward(ctx, query, key, value, bias, plan):
        ctx.save_for_backward(query, key, value, bias)
        ctx.plan = plan
        out = query.new_empty(query.shape[:-1] + value.shape[-1:])  # (..., H, Lq, Dv)
        for chunk in reversed(plan.chunks):
            out[..., chunk.start:chunk.stop, :] = plan.output(chunk, *chunk.inputs(
                query, key, value, bias))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        inputs, plan = ctx.saved_tensors, ctx.plan
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[:4]) if need]
        grads = [None] * 4
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
                chunk.inputs(*grads)[i].add_(g)  # the same slice of the buffer: a view
        return (*(g if g is None else g.to(x.dtype) for g, x in zip(grads, inputs)), None)


def _chunk_rows(batch_heads, lk) -> int:
    """Query rows per chunk: BLOCKWISE_ROWS, or as many as keep B·H·rows·Lk weights near
    BLOCKWISE_ELEMENTS, at least BLOCKWISE_MIN_ROWS."""
    if BLOCKWISE_ROWS is not None:
        return BLOCKWISE_ROWS
    per_row = math.prod(batch_heads) * max(lk, 1)  # weights of one query row, over B and H
    return max(BLOCKWISE_MIN_ROWS, BLOCKWISE_ELEMENTS // per_row)


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
    if attn_mask.dim() < 2:  # the kernel reads a mask's dim -2: (Lk,) or () from an int length
        attn_mask = attn_mask.expand(shape[-2:])  # (Lq, Lk), a view
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, **kwargs)
    return out.masked_fill(~live, 0.0) if may_empty else out


def _masked_softmax(scores, allowed, may_empty):
    """Softmax over keys; masked entries are exactly 0 and, where ``may_empty``, an all-masked
    row is all 0 (and passes back zero gradients)."""
    if allowed is None:
        return torch.softmax(scores, dim=-1)
    weights = torch.softmax(scores.masked_fill(~allowed, torch.finfo(scores.dtype).min), dim=-1)
    return weights * allowed.any(dim=-1, keepdim=True) if may_empty else weights

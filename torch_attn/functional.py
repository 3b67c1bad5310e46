"""The PyTorch attention core: one function every module calls, and its named implementations.

Shape legend: B batch, H heads (Hkv of key and value, G = H / Hkv query heads per kv head),
Lq query length, Lk key length, Dk key width, Dv value width.
Inputs are (B, H, L, D), (H, L, D) or (L, D); masks and biases broadcast to (..., H, Lq, Lk).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from golden.specification.implementations import Asked, Implementation, Registry
from golden.specification.validate import (
    check_attention_args, check_block_sizes, check_flags, check_key_indices, window,
    with_head_axis,
)
from torch_attn.explicit import Where, draw_dropout_mask, explicit
from torch_attn.row_chunks import row_chunks
from torch_attn.sparse import selected_mask, sparse


def scaled_dot_product_attention(
    query, key, value, mask=None, bias=None, *,
    is_causal=False, scale=None, softcap=None, local_window_size=None, attention_chunk_size=None,
    query_offset=None, query_seq_lengths=None, key_value_seq_lengths=None, sinks=None,
    dropout_rate=0.0, dropout_mask=None, dropout_rng=None, implementation=None,
    return_weights=False, block_sizes=None, key_indices=None,
):
    """softmax(cap(scale · Q Kᵀ) + bias, over allowed keys) V, cap(s) = c·tanh(s/c) with
    ``softcap`` c (no cap when None).

    key and value may have Hkv heads, H a multiple of Hkv: query head h reads kv head h // G
    (grouped-query and multi-query attention). Key j sits at position j, query i at
    i + ``query_offset`` (an int, or an integer tensor of shape (B,) for (B, H, L, D) inputs).
    Query i may attend key j when all of these allow it: ``mask`` (bool, True = may attend),
    ``is_causal`` (j ≤ the query's position), ``local_window_size`` w or (left, right) (position
    − left ≤ j ≤ position + right, None = unbounded), ``attention_chunk_size`` C (Llama 4's
    chunked attention: j // C = position // C), ``key_value_seq_lengths`` (j < len[b]) and
    ``query_seq_lengths`` (i < len[b]). A query row with no allowed key gives zeros in the
    output and the weights (and zero gradients).
    sinks: GPT-OSS's attention sinks, one logit per query head ((H,), or () for (Lq, Dk)
    inputs, the query's dtype; differentiable) that joins every row's softmax denominator and
    takes no value: weights = softmax([S, s_h])[..., :-1], so a row's weights sum to less than
    1 and a row with no allowed key still gives zeros. The sink is added after the scale and
    the soft-cap (GPT-OSS has no soft-cap; we never cap the sink) and no mask or bias touches it.
    dropout_mask: bool, True = kept (weights kept are scaled by 1/(1 − dropout_rate)); without it,
    one is drawn with ``dropout_rng`` (a ``torch.Generator``, or the global generator).
    Returns the output (..., H, Lq, Dv), and with ``return_weights`` also the applied weights
    (..., H, Lq, Lk), after masking and dropout, in the query's dtype.

    key_indices: a selection (DeepSeek-V3.2's indexer's top-k): an integer tensor (Lq, k), or
    (B, Lq, k) for (B, H, Lq, Dk) inputs, shared by every head, or one per head, (H', Lq, k) or
    (B, H', Lq, k) with H' = H or 1; values in [0, Lk) (checked: the tensor is read). Query row
    i may attend key j only when j is one of key_indices[..., i, :] and every rule above allows
    it; a repeated index means what it means once. Not differentiable. "sparse" reads only the
    chosen keys; the others take it as the boolean mask it stands for (scattered into
    (..., Lq, Lk) and ANDed into ``mask``).

    ``implementation`` names one of IMPLEMENTATIONS, each the same function of the arguments;
    one that cannot honour an argument raises a ValueError saying why (never a fallback):
    - "explicit": the (..., H, Lq, Lk) weights formed, autograd through them. Takes everything
      but ``block_sizes``.
    - "fused": PyTorch's ``F.scaled_dot_product_attention`` (``enable_gqa`` for grouped heads)
      with the same allowed set, bias and scale, an empty row giving zeros. No weights, no
      softcap, no dropout, no sinks, and no gradients: its backward recomputes the weights from
      a float32 log-sum-exp and errs up to 3.5e-5 on large scores, above the float32 gradient
      tolerance (docs/core.md, "The implementations").
    - "row_chunks": the explicit path by chunks of query rows (torch_attn.row_chunks), memory
      O(rows · Lk) with gradients; ``block_sizes=(rows, None)`` sets the rows per chunk. It
      cannot return the weights; a mask drawn from ``dropout_rng`` is drawn chunk by chunk (not
      the one "explicit" draws from the same generator state); its gradients cannot be
      differentiated again nor taken by ``torch.func`` transforms.
    - "sparse" (torch_attn.sparse): with ``key_indices`` only, the k chosen keys and values of
      each query row gathered (grouped query heads share one gather per kv head), the rules, the
      gathered mask and bias applied to them, the softmax over those k (sinks, soft-cap),
      blocks of query rows, each recomputed in the backward: O(Lq·k) work and memory, never
      an (Lq, Lk) array. ``block_sizes=(rows, None)`` sets the rows per block. No weights,
      no dropout.
    - None: ``choose``, the first of ("sparse" when ``key_indices`` chooses k ≤ Lk /
      SPARSE_UP_TO keys per row) "fused", then ("row_chunks" when B·H·Lq·Lk is above
      ROW_CHUNKS_ABOVE, i.e. from 2²⁴ up) "explicit", that takes the call. The measurements
      behind it: docs/performance.md.
    ``golden.specification.implementations.record()`` collects the name each call ran.
    """
    _expect_tensors(query=query, key=key, value=value, mask=mask, bias=bias,
                    dropout_mask=dropout_mask, sinks=sinks, key_indices=key_indices)
    check_flags(is_causal=is_causal, return_weights=return_weights)
    if dropout_rng is not None and not isinstance(dropout_rng, torch.Generator):
        raise TypeError(f"dropout_rng should be a torch.Generator or None, "
                        f"got {type(dropout_rng).__name__}")
    shape = check_attention_args(
        query, key, value, mask, bias, scale=scale, softcap=softcap,
        local_window_size=local_window_size, query_offset=query_offset,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        dropout_rate=dropout_rate, dropout_mask=dropout_mask, sinks=sinks,
        attention_chunk_size=attention_chunk_size)
    if key_indices is not None:
        check_key_indices(key_indices, query, key)
    block_sizes = check_block_sizes(block_sizes, key_blocks=False)
    asked = Asked(return_weights=bool(return_weights), softcap=softcap is not None,
                  dropout=dropout_rate > 0.0,
                  gradients=_needs_grad(query, key, value, bias, sinks),
                  block_sizes=block_sizes, sinks=sinks is not None,
                  key_indices=key_indices is not None)
    chosen = IMPLEMENTATIONS.select(implementation, asked, choose(
        shape, None if key_indices is None else key_indices.shape[-1]))
    if key_indices is not None and chosen.name != "sparse":  # the mask it stands for
        mask, key_indices = selected_mask(with_head_axis(key_indices, query), mask,
                                          shape[-1]), None
    call = Call(query, key, value, mask, bias, dropout_mask, dropout_rng,
                Where(bool(is_causal), window(local_window_size), query_offset,
                      query_seq_lengths, key_value_seq_lengths, attention_chunk_size),
                1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale),
                None if softcap is None else float(softcap), float(dropout_rate), block_sizes,
                shape, sinks, key_indices)
    out, weights = chosen.run(call)
    return (out, weights) if return_weights else out


class Call(NamedTuple):
    """One call's arguments, checked, as every implementation takes them: ``run(call) ->
    (output, weights | None)``."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: object
    bias: object
    dropout_mask: object
    dropout_rng: object
    where: Where
    scale: float
    softcap: object
    dropout_rate: float
    block_sizes: object
    shape: tuple  # the weights' (..., H, Lq, Lk)
    sinks: object = None  # (H,) or (), or None
    key_indices: object = None  # (..., H'|1, Lq, k) or (Lq, k) for "sparse" alone, or None


def _expect_tensors(**arrays) -> None:
    """TypeError naming an argument that is given but not a torch.Tensor (a NumPy array, say)."""
    for arg, x in arrays.items():
        if x is not None and not torch.is_tensor(x):
            raise TypeError(f"{arg} should be a torch.Tensor, got {type(x).__name__}")


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# None takes row_chunks (when the call needs the weights formed: gradients, dropout or softcap)
# once the weights B·H·Lq·Lk would be more than ROW_CHUNKS_ABOVE elements: from 2²⁴ up, where
# row_chunks measured 0.44× explicit's time (causal) and 0.78× (not). The measurements:
# docs/performance.md, "Why the thresholds are where they are".
ROW_CHUNKS_ABOVE = 2**24 - 1


# None takes "sparse" first when key_indices chooses k ≤ Lk / SPARSE_UP_TO keys per row, else the
# dense choice with the (Lq, Lk) mask the selection stands for. Measured (docs/performance.md, "A
# given selection", 2-core AMD EPYC, k = 2048, D = 128, causal, float32): with 16 query heads on
# one kv head, at Lk = 8k (k = Lk/4) JAX's masked dense forward beat sparse (1.0 s against
# 1.25 s), at 16k (k = Lk/8) sparse beat it (4.2 s against 4.6 s) and reads no (L, L) mask; with
# one head per kv head the masked dense forward stayed 3.5x faster at 16k, but holds that mask
# (256 MiB per batch row there, 4 GiB at 64k). Hence Lk/8.
SPARSE_UP_TO = 8


def takes_sparse(selected, lk, return_weights=False) -> bool:
    """Whether a module hands its indexer's selection to the core as ``key_indices`` (which
    ``implementation=None`` then runs "sparse": k ≤ Lk / SPARSE_UP_TO keys per row, no weights
    asked) rather than as the boolean mask it stands for. Only then: the core reads the
    indices to check their range (a device sync), which the mask path does not."""
    return not return_weights and selected * SPARSE_UP_TO <= lk


def choose(shape, selected=None) -> tuple:
    """The order of preference of ``implementation=None`` for weights of ``shape`` (..., H, Lq,
    Lk), given ``selected`` keys per row (key_indices' k; None without a selection): the first
    that takes the call runs it."""
    sparse = ("sparse",) if selected is not None and selected * SPARSE_UP_TO <= shape[-1] else ()
    if math.prod(shape) > ROW_CHUNKS_ABOVE:
        return sparse + ("fused", "row_chunks", "explicit")
    return sparse + ("fused", "explicit", "row_chunks")


def _run_explicit(call):
    allowed, may_empty = call.where.allowed(call.shape, call.mask, call.query.device)
    dropout_mask = call.dropout_mask
    if call.dropout_rate > 0.0 and dropout_mask is None:
        dropout_mask = draw_dropout_mask(call.shape, call.dropout_rate, call.dropout_rng,
                                         call.query.device)
    return explicit(call.query, call.key, call.value, allowed, may_empty, call.bias, call.scale,
                    call.softcap, call.dropout_rate, dropout_mask, call.sinks)


def _run_fused(call):
    allowed, may_empty = call.where.allowed(call.shape, call.mask, call.query.device)
    return _fused(call.query, call.key, call.value, allowed, may_empty, call.bias,
                  call.where.is_causal, call.scale), None


def _run_row_chunks(call):
    rows = None if call.block_sizes is None else call.block_sizes[0]
    return row_chunks(call.query, call.key, call.value, call.mask, call.bias, call.dropout_mask,
                      call.where, call.scale, call.softcap, call.dropout_rate, call.dropout_rng,
                      rows, call.sinks), None


_NO_BLOCKS = "block_sizes is for 'row_chunks'"


def _explicit_refuses(asked):
    return _NO_BLOCKS if asked.block_sizes is not None else None


def _run_sparse(call):
    rows = None if call.block_sizes is None else call.block_sizes[0]
    return sparse(call.query, call.key, call.value, call.key_indices, call.mask, call.bias,
                  call.where, call.scale, call.softcap, call.sinks, rows), None


def _fused_refuses(asked):
    reasons = [why for why, asks in [
        ("PyTorch's kernel does not return the weights", asked.return_weights),
        ("it cannot soft-cap the scores", asked.softcap),
        ("it draws its own dropout, from neither a dropout_mask nor a torch.Generator",
         asked.dropout),
        ("it has no sink logit (emulating one needs K and V copied with an extra key and a "
         "float (Lq, Lk + 1) mask formed: use 'explicit' or 'row_chunks')", asked.sinks),
        ("its backward loses accuracy on large scores (docs/core.md); use 'explicit' or "
         "'row_chunks' for gradients", asked.gradients),
        (_NO_BLOCKS, asked.block_sizes is not None)] if asks]
    return "; ".join(reasons) or None


def _sparse_refuses(asked):
    reasons = [why for why, asks in [
        ("it needs key_indices (the keys each query row may choose from)",
         not asked.key_indices),
        ("it never forms the (Lq, Lk) weights, which is what keeps its memory O(Lq·k): "
         "return_weights=True needs 'explicit'", asked.return_weights),
        ("a dropout mask is (Lq, Lk): use 'explicit' or 'row_chunks'", asked.dropout)] if asks]
    return "; ".join(reasons) or None


def _row_chunks_refuses(asked):
    if asked.return_weights:
        return ("it never forms all the (Lq, Lk) weights, which is what keeps its memory "
                "O(rows · Lk): return_weights=True needs 'explicit'")
    return None


IMPLEMENTATIONS = Registry(
    "torch",
    Implementation("explicit", _run_explicit, _explicit_refuses),
    Implementation("fused", _run_fused, _fused_refuses),
    Implementation("row_chunks", _run_row_chunks, _row_chunks_refuses),
    Implementation("sparse", _run_sparse, _sparse_refuses),
)


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



"""Shipped runners for the frameworks' own attention functions, ready for the command line:

    attn-parity check --impl golden.runners.recipes:TORCH_SDPA   torch.nn.functional.
                                                                 scaled_dot_product_attention
    attn-parity check --impl golden.runners.recipes:JAX_NN       jax.nn.dot_product_attention
    attn-parity check --impl golden.runners.recipes:FLAX_NNX     flax.nnx.dot_product_attention

Each is ``from_function`` around an adapter that states our keywords in that API's terms: our
tensors are (B, H, L, D) (unbatched (H, L, D) or (L, D)), our boolean mask is True = may attend
(the polarity of all three APIs), ``is_causal`` is top-left aligned (as all three), ``bias`` is
added to the scaled scores, ``scale`` multiplies them, and grouped-query key and value have Hkv
heads, query head h reading kv head h // (H / Hkv) (torch's ``enable_gqa`` and jax.nn's
grouping, both). jax.nn, and Flax through it, need value width = key width: other fixtures are
not supported by them. An adapter takes only the keywords its API can express, so a fixture
that sets another (soft-capping, sinks, chunks, query offsets, a dropout mask; windows and
lengths where the API has no such argument) is *not supported*, never failed. The APIs return
no attention weights: outputs are checked, and gradients of Σ output ⊙ dO.

Most fixtures of the core have value width Dv ≠ key width Dk, which jax.nn (and so Flax's fast
path) refuses; the ``sdpa_dkv_*`` fixtures (golden/specification/cases.py) run every feature at Dk =
Dv.

Shape legend: B batch, H query heads, Hkv key-value heads, Lq query length, Lk key length,
D head width (Dk = Dv for jax.nn and Flax).
"""

from __future__ import annotations

from golden.runners.adapt import NotSupported, from_function

# ---- PyTorch ----------------------------------------------------------------------------------


def torch_sdpa(query, key, value, *, mask=None, bias=None, is_causal=False, scale=None):
    """``F.scaled_dot_product_attention`` on our arguments. SDPA takes one ``attn_mask``
    (boolean, True = may attend, or additive) and refuses ``is_causal`` beside it, so a causal
    flag with a mask or bias becomes a top-left lower-triangular boolean mask, and mask and bias
    together become one additive mask (−inf where the mask forbids). Grouped-query key and value
    go through ``enable_gqa``. A fully masked row gives zeros (torch ≥ 2.5), as ours."""
    import torch
    import torch.nn.functional as F

    lq, lk = query.shape[-2], key.shape[-2]
    if is_causal and (mask is not None or bias is not None):
        causal = torch.ones(lq, lk, dtype=torch.bool).tril()  # (Lq, Lk), top-left aligned
        mask, is_causal = causal if mask is None else mask & causal, False
    if bias is not None and mask is not None:
        bias, mask = bias.masked_fill(~mask, float("-inf")), None
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=bias if bias is not None else mask, is_causal=is_causal,
        scale=scale, enable_gqa=query.ndim > 2 and query.shape[-3] != key.shape[-3])


TORCH_SDPA = from_function(torch_sdpa, "torch", name="torch F.sdpa")


# ---- JAX --------------------------------------------------------------------------------------

def _same_widths(api, key, value):
    """NotSupported unless value width = key width, which jax.nn requires ("value shape should
    be ..." otherwise): the row says so instead of failing."""
    if value.shape[-1] != key.shape[-1]:
        raise NotSupported(f"{api} needs value width = key width, got Dk={key.shape[-1]}, "
                           f"Dv={value.shape[-1]}")


def _heads_last(x):
    """(..., H, L, D) -> (..., L, H, D): jax.nn's and Flax's layout; (L, D) -> (L, 1, D)."""
    import jax.numpy as jnp

    return x[:, None, :] if x.ndim == 2 else jnp.swapaxes(x, -3, -2)


def _heads_back(out, ndim):
    """The inverse of ``_heads_last`` for an output of ``ndim`` dimensions in our layout."""
    import jax.numpy as jnp

    return out[:, 0, :] if ndim == 2 else jnp.swapaxes(out, -3, -2)


def _window(local_window_size, lq, lk):
    """Our window (an int, or [left, right] with None for an unbounded side) as jax.nn's
    (left, right) of ints: an unbounded side is max(Lq, Lk), which excludes nothing."""
    if local_window_size is None or isinstance(local_window_size, int):
        return local_window_size
    wide = max(lq, lk)
    return tuple(wide if side is None else int(side) for side in local_window_size)


def _highest(dtype):
    """The matmul precision to run jax.nn under: HIGHEST for float32 and float64 (JAX's
    default float32 matmul is TF32 on NVIDIA GPUs and one bfloat16 pass on TPUs, and jax.nn's
    fast path takes no ``precision`` argument); for float16 and bfloat16 jax.nn sets its own
    dot algorithm (operands in the dtype, float32 accumulation) and XLA on CPU refuses HIGHEST
    for them, so those keep the default."""
    return "highest" if str(dtype) in ("float32", "float64") else None


def jax_nn(query, key, value, *, mask=None, bias=None, is_causal=False, scale=None,
           local_window_size=None, query_seq_lengths=None, key_value_seq_lengths=None):
    """``jax.nn.dot_product_attention`` on our arguments: the arrays moved to its (B, L, H, D)
    layout and back, mask and bias passed as they are (it broadcasts them to (B, H, Lq, Lk)),
    grouped-query key and value in its native (B, Lk, Hkv, D), our window and lengths in its
    ``local_window_size``, ``query_seq_lengths`` and ``key_value_seq_lengths``. Run under
    ``jax.default_matmul_precision("highest")`` for float32 and float64 (see ``_highest``).
    Its softmax runs in float32 whatever the dtype, and a row with nothing allowed gets its
    large-negative fill, so a uniform average of the values rather than our zeros."""
    import contextlib

    import jax

    _same_widths("jax.nn.dot_product_attention", key, value)
    lq, lk, ndim = query.shape[-2], key.shape[-2], query.ndim
    precision = _highest(query.dtype)
    with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
        out = jax.nn.dot_product_attention(
            _heads_last(query), _heads_last(key), _heads_last(value), bias=bias, mask=mask,
            scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=_window(local_window_size, lq, lk))
    return _heads_back(out, ndim)


JAX_NN = from_function(jax_nn, "jax", name="jax.nn.dot_product_attention")


# ---- Flax -------------------------------------------------------------------------------------

def flax_nnx(query, key, value, *, mask=None, bias=None, is_causal=False, scale=None):
    """``flax.nnx.dot_product_attention`` on our arguments, in its (B, L, H, D) layout. It has
    no ``scale`` argument and always divides the scores by √D, so a scale s is applied by
    multiplying the query by s·√D first: the same maths, one more rounding of the query (within
    the float32 tolerance). Grouped-query key and value pass as they are (Flax 0.12 groups query
    heads itself, as jax.nn). Without dropout and ``module`` Flax calls
    ``jax.nn.dot_product_attention`` and drops its ``precision`` argument, so, as ``jax_nn``,
    it runs under ``jax.default_matmul_precision("highest")`` for float32 and float64."""
    import contextlib

    import jax
    from flax import nnx

    _same_widths("flax.nnx.dot_product_attention (jax.nn's without dropout)", key, value)
    ndim, depth = query.ndim, query.shape[-1]
    if scale is not None:
        query = query * (scale * depth ** 0.5)
    precision = _highest(query.dtype)
    with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
        out = nnx.dot_product_attention(_heads_last(query), _heads_last(key),
                                        _heads_last(value), bias=bias, mask=mask,
                                        is_causal=is_causal)
    return _heads_back(out, ndim)


FLAX_NNX = from_function(flax_nnx, "jax", name="flax.nnx.dot_product_attention")

RECIPES = {"TORCH_SDPA": TORCH_SDPA, "JAX_NN": JAX_NN, "FLAX_NNX": FLAX_NNX}

"""MultiHeadCrossAttention, the twin of torch_attn.modules.cross's: encoder-decoder attention
whose context cache is a pytree made by a compiled call, a later call's context checked against
its fingerprint to 1000 ulps (``_same_fingerprint``) where the values are concrete. Shape legend
as in jax_attn.modules; the class docstring gives its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from golden.specification import variants
from golden.specification.decoder import qk_normalize
from golden.specification.positions import ContextCache, context_fingerprint
from golden.specification.validate import check_context, check_context_inputs, check_same_context
from jax_attn.functional import DEFAULT_PRECISION, scaled_dot_product_attention
from jax_attn.modules.base import _head_mask, _linear, _merge_heads, _Variant, compiled_call


class MultiHeadCrossAttention(_Variant):
    """Encoder-decoder attention as Whisper, BART and T5 write it: N query heads from x over Nkv
    key-value heads (N a multiple of Nkv) from a context of another length and width, no
    causality, and the context's keys and values computed once (``context_cache``).

    Shapes: x (B, Lq, d_in) or (Lq, d_in); context (B, Lc, d_context); q (B, N, Lq, Dh), k and
    v (B, Nkv, Lc, Dh), Dh = ``head_dim`` (default d_in // num_heads); output (B, Lq, d_out)
    (d_out default d_in), weights (B, N, Lq, Lc). ``context_lengths`` (B,): the real tokens of
    each context row (right padding); a query whose row has none gets zero weights.

    Biases: ``qkv_bias`` on the query and value projections, and on the key projection unless
    ``key_bias`` says otherwise (Whisper: qkv_bias=True, key_bias=False; BART: True; T5: none,
    with scale=1.0); ``out_bias`` on out_proj.

    ``qk_norm="rms"`` (Mllama's cross-attention layers, BLT's): after the head split, q (from x)
    and k (from the context) each RMS-normalised over Dh, q / √(mean(q²) + ε) · q_norm and the
    keys' with k_norm (weights (Dh,), ε = ``qk_norm_eps``), computed in at least float32; the
    context cache holds the normed keys. ``softcap`` c (T5Gemma): the scores c·tanh(s/c).

    With ``cache`` (from ``context_cache``, a pytree), the cached keys and values are used and
    ``context`` may be None; if it is given, it must be the context the cache was made from:
    its shape is checked always, its fingerprint
    (golden.specification.positions.context_fingerprint, to
    1000 ulps: XLA may sum in another order in another program) where the values are concrete
    (an eager call; not under the caller's jit, where they are traced).
    """

    variant = "multi_head_cross_attention"

    def __init__(self, d_in, d_context, num_heads, num_kv_heads=None, head_dim=None, d_out=None,
                 qkv_bias=False, key_bias=None, out_bias=False, scale=None, qk_norm=None,
                 qk_norm_eps=1e-6, softcap=None, *, rngs, precision=DEFAULT_PRECISION):
        self._configure(d_in=d_in, d_context=d_context, num_heads=num_heads,
                        num_kv_heads=num_kv_heads, head_dim=head_dim, d_out=d_out,
                        qkv_bias=qkv_bias, key_bias=key_bias, out_bias=out_bias, scale=scale,
                        qk_norm=qk_norm, qk_norm_eps=qk_norm_eps, softcap=softcap)
        sizes = variants.cross_sizes(self.config)
        self.d_in, self.d_context, self.num_heads = d_in, d_context, num_heads
        self.num_kv_heads, self.head_dim = sizes["num_kv_heads"], sizes["head_dim"]
        self.scale, self.precision, self.softcap = scale, precision, softcap
        self.qk_norm, self.qk_norm_eps = qk_norm, qk_norm_eps
        width, kv_width = num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.W_query = _linear(d_in, width, qkv_bias, rngs, precision)
        self.W_key = _linear(d_context, kv_width, sizes["key_bias"], rngs, precision)
        self.W_value = _linear(d_context, kv_width, qkv_bias, rngs, precision)
        self.out_proj = _linear(width, sizes["d_out"], out_bias, rngs, precision)
        starts = variants.vector_starts(self.variant, self.config)  # each at its no-op value
        for n in variants.VARIANTS[self.variant].vectors:  # None where the config has none
            setattr(self, n, nnx.Param(jnp.full(*starts[n])) if n in starts else None)

    def context_cache(self, context, context_lengths=None) -> ContextCache:
        """The context's keys and values (B, Nkv, Lc, Dh), its lengths (B,) int32 (Lc without
        context_lengths) and its fingerprint (B, 4), for later calls."""
        check_context(context, self.d_context, context_lengths)
        return self._context_cache(context, context_lengths)

    @nnx.jit(graph=False)
    def _context_cache(self, context, context_lengths):
        return ContextCache(*self._project_context(context, context_lengths),
                            _fingerprint(context))

    def _project_context(self, context, context_lengths):
        """k, v (B, Nkv, Lc, Dh) of the context and its lengths (B,) int32 (Lc when None)."""
        lengths = (jnp.full(context.shape[:-2], context.shape[-2], jnp.int32)
                   if context_lengths is None else jnp.asarray(context_lengths, jnp.int32))
        return (self._norm(self._split(self.W_key(context)), self.k_norm),
                self._split(self.W_value(context)), lengths)

    def _norm(self, t, weight):
        """t (B, heads, L, Dh) through the QK norm (as it is without one), computed in at least
        float32 and rounded once to t's dtype."""
        if self.qk_norm is None:
            return t
        compute = jnp.promote_types(t.dtype, jnp.float32)
        return qk_normalize(t.astype(compute), self.qk_norm, weight.get_value().astype(compute),
                            self.qk_norm_eps, mean=lambda a: a.mean(-1, keepdims=True),
                            rsqrt=jax.lax.rsqrt).astype(t.dtype)

    def __call__(self, x, context=None, mask=None, *, cache=None, context_lengths=None,
                 return_weights=False):
        check_context_inputs(x, context, self.d_in, self.d_context, mask, context_lengths,
                             heads=self.num_heads, cache=cache, kv_heads=self.num_kv_heads,
                             head_dim=self.head_dim)
        if cache is not None and context is not None and not any(
                isinstance(a, jax.core.Tracer) for a in (context, cache.fingerprint)):
            check_same_context(_same_fingerprint(_fingerprint(context), cache.fingerprint))
        if cache is not None:
            context = None  # the cache's keys and values are used
        return self._attend(x, context, mask, cache=cache, context_lengths=context_lengths,
                            return_weights=return_weights)

    @compiled_call
    def _attend(self, x, context, mask, *, cache, context_lengths, return_weights=False):
        if cache is None:
            k, v, lengths = self._project_context(context, context_lengths)
        else:
            k, v, lengths = cache.key, cache.value, cache.lengths
        q = self._norm(self._split(self.W_query(x)), self.q_norm)  # (B, N, Lq, Dh)
        head_mask = _head_mask(mask, x)  # (B, 1 or N, Lq, Lc)
        o = scaled_dot_product_attention(q, k, v, head_mask, scale=self.scale,
                                         softcap=self.softcap, key_value_seq_lengths=lengths,
                                         return_weights=return_weights, precision=self.precision)
        o, w = o if return_weights else (o, None)
        y = _merge_heads(self.out_proj, o)                     # (B, Lq, d_out)
        return (y, w) if return_weights else y

    def _split(self, y):
        """(B, L, heads·Dh) -> (B, heads, L, Dh)."""
        y = y.reshape(y.shape[:-1] + (-1, self.head_dim))      # (B, L, heads, Dh)
        return jnp.swapaxes(y, -2, -3)


def _fingerprint(context):
    """golden.specification.positions.context_fingerprint of ``context`` in at least float32."""
    compute = jnp.promote_types(context.dtype, jnp.float32)
    return context_fingerprint(jax.lax.stop_gradient(context).astype(compute), jnp.stack)


def _same_fingerprint(a, b) -> bool:
    """Whether two fingerprints (..., 4) agree to 1000 ulps of their largest entry per row: XLA
    may order a sum differently in another program (the cache made under the caller's jit)."""
    a, b = np.asarray(a), np.asarray(b)
    tol = 1000 * np.finfo(a.dtype).eps * np.abs(b).max(axis=-1, keepdims=True)
    return a.shape == b.shape and bool((np.abs(a - b) <= tol).all())

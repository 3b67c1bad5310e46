"""The twins of torch_attn.modules.notebook's classes, the source notebooks' variants:
SimpleSelfAttention, SelfAttention, CausalSelfAttention, CrossAttention,
MultiHeadAttentionWrapper and MultiHeadAttention, each a ``_Variant`` whose ``__call__`` is
compiled (``compiled_call``), the wrapper's heads drawing their dropout keys from one stream
(folded by head). Shape legend as in jax_attn.modules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from golden.specification.validate import check_cross_inputs, check_self_inputs, check_sequence
from jax_attn.functional import DEFAULT_PRECISION, scaled_dot_product_attention
from jax_attn.modules.base import _linear, _merge_heads, _Variant, compiled_call


class SimpleSelfAttention(_Variant):
    """softmax(X Xᵀ) X: no parameters, no scaling; each token's output is a mix of all
    tokens, weighted by raw dot products (the first form tutorials on attention build)."""

    variant = "simple_self_attention"

    def __init__(self, *, rngs=None, precision=DEFAULT_PRECISION):
        self._configure()
        self.precision = precision

    @compiled_call
    def __call__(self, x, mask=None, *, return_weights=False):
        check_self_inputs(x, None, mask)
        return scaled_dot_product_attention(x, x, x, mask, scale=1.0,
                                            return_weights=return_weights,
                                            precision=self.precision)


class SelfAttention(_Variant):
    """One head with trainable query, key and value projections."""

    variant = "self_attention"

    def __init__(self, d_in, d_k, d_v=None, qkv_bias=False, *, rngs, precision=DEFAULT_PRECISION):
        self._configure(d_in=d_in, d_k=d_k, d_v=d_v, qkv_bias=qkv_bias)
        self.d_in, self.d_k = d_in, d_k
        self.d_v = d_k if d_v is None else d_v
        self.precision = precision
        self.W_query = _linear(d_in, d_k, qkv_bias, rngs, precision)
        self.W_key = _linear(d_in, d_k, qkv_bias, rngs, precision)
        self.W_value = _linear(d_in, self.d_v, qkv_bias, rngs, precision)

    def project(self, x):
        """x (B, L, d_in) -> q, k (B, L, d_k) and v (B, L, d_v)."""
        check_sequence("x", x, "d_in", self.d_in)
        return self.W_query(x), self.W_key(x), self.W_value(x)

    @compiled_call
    def __call__(self, x, mask=None, *, return_weights=False):
        check_self_inputs(x, self.d_in, mask)
        q, k, v = self.project(x)
        return scaled_dot_product_attention(q, k, v, mask, return_weights=return_weights,
                                            precision=self.precision)


class CausalSelfAttention(SelfAttention):
    """Self-attention where position i sees positions ≤ i, with dropout on the weights."""

    variant = "causal_self_attention"

    def __init__(self, d_in, d_k, d_v=None, dropout=0.0, qkv_bias=False, *, rngs,
                 precision=DEFAULT_PRECISION):
        super().__init__(d_in, d_k, d_v, qkv_bias, rngs=rngs, precision=precision)
        self._configure(d_in=d_in, d_k=d_k, d_v=d_v, dropout=dropout, qkv_bias=qkv_bias)
        self._init_dropout(dropout, rngs)

    @compiled_call
    def __call__(self, x, mask=None, *, dropout_mask=None, return_weights=False):
        check_self_inputs(x, self.d_in, mask, dropout_mask, rate=self._rate())
        q, k, v = self.project(x)
        return scaled_dot_product_attention(q, k, v, mask, is_causal=True,
                                            dropout_rate=self._rate(), dropout_mask=dropout_mask,
                                            dropout_rng=self._dropout_key(dropout_mask),
                                            return_weights=return_weights,
                                            precision=self.precision)


class CrossAttention(_Variant):
    """Queries from x_q (B, Lq, d_q_in); keys and values from x_kv (B, Lk, d_kv_in), or keys
    from x_kv and values from x_v of the same length."""

    variant = "cross_attention"

    def __init__(self, d_q_in, d_kv_in, d_k, d_v=None, qkv_bias=False, *, rngs,
                 precision=DEFAULT_PRECISION):
        self._configure(d_q_in=d_q_in, d_kv_in=d_kv_in, d_k=d_k, d_v=d_v, qkv_bias=qkv_bias)
        self.d_q_in, self.d_kv_in, self.d_k = d_q_in, d_kv_in, d_k
        self.d_v = d_k if d_v is None else d_v
        self.precision = precision
        self.W_query = _linear(d_q_in, d_k, qkv_bias, rngs, precision)
        self.W_key = _linear(d_kv_in, d_k, qkv_bias, rngs, precision)
        self.W_value = _linear(d_kv_in, self.d_v, qkv_bias, rngs, precision)

    @compiled_call
    def __call__(self, x_q, x_kv, x_v=None, mask=None, *, return_weights=False):
        check_cross_inputs(x_q, x_kv, x_v, self.d_q_in, self.d_kv_in, mask)
        x_v = x_kv if x_v is None else x_v
        q, k, v = self.W_query(x_q), self.W_key(x_kv), self.W_value(x_v)
        return scaled_dot_product_attention(q, k, v, mask, return_weights=return_weights,
                                            precision=self.precision)


class MultiHeadAttentionWrapper(_Variant):
    """num_heads independent single-head modules, outputs concatenated on the feature axis
    (B, L, N·Dh), optionally followed by an output projection; weights (B, N, Lq, Lk)."""

    variant = "multi_head_attention_wrapper"

    def __init__(self, d_in, d_head, num_heads, causal=False, dropout=0.0, qkv_bias=False,
                 out_proj=False, *, rngs, precision=DEFAULT_PRECISION):
        self._configure(d_in=d_in, d_head=d_head, num_heads=num_heads, causal=causal,
                        dropout=dropout, qkv_bias=qkv_bias, out_proj=out_proj)
        self.d_in, self.num_heads, self.causal = d_in, num_heads, causal
        self.precision = precision
        self._init_dropout(dropout, rngs)
        self.heads = nnx.List([SelfAttention(d_in, d_head, qkv_bias=qkv_bias, rngs=rngs,
                                             precision=precision) for _ in range(num_heads)])
        width = num_heads * d_head
        self.out_proj = _linear(width, width, True, rngs, precision) if out_proj else None

    @compiled_call
    def __call__(self, x, mask=None, *, dropout_mask=None, return_weights=False):
        check_self_inputs(x, self.d_in, mask, dropout_mask, heads=self.num_heads, rate=self._rate())
        key = self._dropout_key(dropout_mask)
        if dropout_mask is not None:  # (B, N, Lq, Lk): one dropout mask per head
            dropout_mask = jnp.broadcast_to(dropout_mask, x.shape[:-2] + (self.num_heads,) +
                                            2 * x.shape[-2:-1])
        outs, weights = [], []
        for h, head in enumerate(self.heads):
            q, k, v = head.project(x)
            head_mask = None if dropout_mask is None else dropout_mask[..., h, :, :]
            o = scaled_dot_product_attention(
                q, k, v, mask, is_causal=self.causal, dropout_rate=self._rate(),
                dropout_mask=head_mask,
                dropout_rng=None if key is None else jax.random.fold_in(key, h),
                return_weights=return_weights, precision=self.precision)
            o, w = o if return_weights else (o, None)
            outs.append(o)      # (B, L, Dh)
            weights.append(w)   # (B, Lq, Lk)
        y = jnp.concatenate(outs, axis=-1)  # (B, L, N·Dh)
        if self.out_proj is not None:
            y = self.out_proj(y)
        return (y, jnp.stack(weights, axis=-3)) if return_weights else y


class MultiHeadAttention(_Variant):
    """Fused heads: one projection each for Q, K, V (B, L, d_out) split into N contiguous blocks
    of Dh = d_out / N, attention per head, heads merged, output projection."""

    variant = "multi_head_attention"

    def __init__(self, d_in, d_out, num_heads, causal=False, dropout=0.0, qkv_bias=False,
                 out_bias=True, *, rngs, precision=DEFAULT_PRECISION):
        self._configure(d_in=d_in, d_out=d_out, num_heads=num_heads, causal=causal,
                        dropout=dropout, qkv_bias=qkv_bias, out_bias=out_bias)
        self.d_in, self.d_out, self.num_heads, self.causal = d_in, d_out, num_heads, causal
        self.precision = precision
        self._init_dropout(dropout, rngs)
        self.W_query = _linear(d_in, d_out, qkv_bias, rngs, precision)
        self.W_key = _linear(d_in, d_out, qkv_bias, rngs, precision)
        self.W_value = _linear(d_in, d_out, qkv_bias, rngs, precision)
        self.out_proj = _linear(d_out, d_out, out_bias, rngs, precision)

    def _split(self, y):
        """(B, L, d_out) -> (B, N, L, Dh)."""
        y = y.reshape(y.shape[:-1] + (self.num_heads, -1))  # (B, L, N, Dh)
        return jnp.swapaxes(y, -2, -3)

    @compiled_call
    def __call__(self, x, mask=None, *, dropout_mask=None, return_weights=False):
        check_self_inputs(x, self.d_in, mask, dropout_mask, heads=self.num_heads, rate=self._rate())
        q, k, v = (self._split(proj(x)) for proj in (self.W_query, self.W_key, self.W_value))
        head_mask = None if mask is None else mask[..., None, :, :]  # (B, 1, Lq, Lk)
        o = scaled_dot_product_attention(q, k, v, head_mask, is_causal=self.causal,
                                         dropout_rate=self._rate(), dropout_mask=dropout_mask,
                                         dropout_rng=self._dropout_key(dropout_mask),
                                         return_weights=return_weights, precision=self.precision)
        o, w = o if return_weights else (o, None)
        y = _merge_heads(self.out_proj, o)  # (B, L, d_out)
        return (y, w) if return_weights else y

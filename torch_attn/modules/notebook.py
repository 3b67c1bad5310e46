"""The source notebooks' variants, from the first form tutorials on attention build to fused
heads: SimpleSelfAttention (no parameters), SelfAttention and CausalSelfAttention (one head),
CrossAttention (one head; keys and values from another sequence), MultiHeadAttentionWrapper
(independent heads side by side) and MultiHeadAttention (fused heads). Shape legend as in
torch_attn.modules: B batch, L sequence length (Lq queries, Lk keys), N heads, Dh head width,
d_* feature widths.
"""

from __future__ import annotations

import torch
from torch import nn

from golden.specification.validate import check_cross_inputs, check_self_inputs, check_sequence
from torch_attn.functional import scaled_dot_product_attention
from torch_attn.modules.base import _config, _dropout_rate


class SimpleSelfAttention(nn.Module):
    """softmax(X Xᵀ) X: no parameters, no scaling; each token's output is a mix of all
    tokens, weighted by raw dot products (the first form tutorials on attention build)."""

    variant = "simple_self_attention"

    def __init__(self):
        super().__init__()
        self.config = _config(self.variant)

    def forward(self, x, mask=None, *, return_weights=False):
        check_self_inputs(x, None, mask)
        return scaled_dot_product_attention(x, x, x, mask, scale=1.0,
                                            return_weights=return_weights)


class SelfAttention(nn.Module):
    """One head with trainable query, key and value projections."""

    variant = "self_attention"

    def __init__(self, d_in, d_k, d_v=None, qkv_bias=False):
        super().__init__()
        self.config = _config(self.variant, d_in=d_in, d_k=d_k, d_v=d_v, qkv_bias=qkv_bias)
        self.d_in, self.d_k = d_in, d_k
        self.d_v = d_k if d_v is None else d_v
        self.W_query = nn.Linear(d_in, d_k, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_k, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, self.d_v, bias=qkv_bias)

    def project(self, x):
        """x (B, L, d_in) -> q, k (B, L, d_k) and v (B, L, d_v)."""
        check_sequence("x", x, "d_in", self.d_in)
        return self.W_query(x), self.W_key(x), self.W_value(x)

    def forward(self, x, mask=None, *, return_weights=False):
        check_self_inputs(x, self.d_in, mask)
        q, k, v = self.project(x)
        return scaled_dot_product_attention(q, k, v, mask, return_weights=return_weights)


class CausalSelfAttention(SelfAttention):
    """Self-attention where position i sees positions ≤ i, with dropout on the weights."""

    variant = "causal_self_attention"

    def __init__(self, d_in, d_k, d_v=None, dropout=0.0, qkv_bias=False):
        super().__init__(d_in, d_k, d_v, qkv_bias)
        self.config = _config(self.variant, d_in=d_in, d_k=d_k, d_v=d_v, dropout=dropout,
                              qkv_bias=qkv_bias)
        self.dropout = dropout

    def forward(self, x, mask=None, *, dropout_mask=None, return_weights=False):
        rate = _dropout_rate(self)
        check_self_inputs(x, self.d_in, mask, dropout_mask, rate=rate)
        q, k, v = self.project(x)
        return scaled_dot_product_attention(q, k, v, mask, is_causal=True, dropout_rate=rate,
                                            dropout_mask=dropout_mask,
                                            return_weights=return_weights)


class CrossAttention(nn.Module):
    """Queries from x_q (B, Lq, d_q_in); keys and values from x_kv (B, Lk, d_kv_in), or keys
    from x_kv and values from x_v of the same length."""

    variant = "cross_attention"

    def __init__(self, d_q_in, d_kv_in, d_k, d_v=None, qkv_bias=False):
        super().__init__()
        self.config = _config(self.variant, d_q_in=d_q_in, d_kv_in=d_kv_in, d_k=d_k, d_v=d_v,
                              qkv_bias=qkv_bias)
        self.d_q_in, self.d_kv_in, self.d_k = d_q_in, d_kv_in, d_k
        self.d_v = d_k if d_v is None else d_v
        self.W_query = nn.Linear(d_q_in, d_k, bias=qkv_bias)
        self.W_key = nn.Linear(d_kv_in, d_k, bias=qkv_bias)
        self.W_value = nn.Linear(d_kv_in, self.d_v, bias=qkv_bias)

    def forward(self, x_q, x_kv, x_v=None, mask=None, *, return_weights=False):
        check_cross_inputs(x_q, x_kv, x_v, self.d_q_in, self.d_kv_in, mask)
        x_v = x_kv if x_v is None else x_v
        q, k, v = self.W_query(x_q), self.W_key(x_kv), self.W_value(x_v)
        return scaled_dot_product_attention(q, k, v, mask, return_weights=return_weights)


class MultiHeadAttentionWrapper(nn.Module):
    """num_heads independent single-head modules, outputs concatenated on the feature axis
    (B, L, N·Dh), optionally followed by an output projection; weights (B, N, Lq, Lk)."""

    variant = "multi_head_attention_wrapper"

    def __init__(self, d_in, d_head, num_heads, causal=False, dropout=0.0, qkv_bias=False,
                 out_proj=False):
        super().__init__()
        self.config = _config(self.variant, d_in=d_in, d_head=d_head, num_heads=num_heads,
                              causal=causal, dropout=dropout, qkv_bias=qkv_bias, out_proj=out_proj)
        self.d_in, self.num_heads, self.causal, self.dropout = d_in, num_heads, causal, dropout
        self.heads = nn.ModuleList(
            [SelfAttention(d_in, d_head, qkv_bias=qkv_bias) for _ in range(num_heads)])
        width = num_heads * d_head
        self.out_proj = nn.Linear(width, width) if out_proj else None

    def forward(self, x, mask=None, *, dropout_mask=None, return_weights=False):
        rate = _dropout_rate(self)
        check_self_inputs(x, self.d_in, mask, dropout_mask, heads=self.num_heads, rate=rate)
        outs, weights = [], []
        if dropout_mask is not None:  # (B, N, Lq, Lk): one dropout mask per head
            dropout_mask = dropout_mask.expand(x.shape[:-2] + (self.num_heads,) +
                                               2 * x.shape[-2:-1])
        for h, head in enumerate(self.heads):
            q, k, v = head.project(x)
            head_mask = None if dropout_mask is None else dropout_mask[..., h, :, :]
            o = scaled_dot_product_attention(q, k, v, mask, is_causal=self.causal,
                                             dropout_rate=rate, dropout_mask=head_mask,
                                             return_weights=return_weights)
            o, w = o if return_weights else (o, None)
            outs.append(o)      # (B, L, Dh)
            weights.append(w)   # (B, Lq, Lk)
        y = torch.cat(outs, dim=-1)  # (B, L, N·Dh)
        if self.out_proj is not None:
            y = self.out_proj(y)
        return (y, torch.stack(weights, dim=-3)) if return_weights else y


class MultiHeadAttention(nn.Module):
    """Fused heads: one projection each for Q, K, V (B, L, d_out) split into N contiguous blocks
    of Dh = d_out / N, attention per head, heads merged, output projection."""

    variant = "multi_head_attention"

    def __init__(self, d_in, d_out, num_heads, causal=False, dropout=0.0, qkv_bias=False,
                 out_bias=True):
        super().__init__()
        self.config = _config(self.variant, d_in=d_in, d_out=d_out, num_heads=num_heads,
                              causal=causal, dropout=dropout, qkv_bias=qkv_bias, out_bias=out_bias)
        self.d_in, self.d_out, self.num_heads = d_in, d_out, num_heads
        self.causal, self.dropout = causal, dropout
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out, bias=out_bias)

    def _split(self, y):
        """(B, L, d_out) -> (B, N, L, Dh)."""
        return y.unflatten(-1, (self.num_heads, -1)).transpose(-2, -3)

    def forward(self, x, mask=None, *, dropout_mask=None, return_weights=False):
        rate = _dropout_rate(self)
        check_self_inputs(x, self.d_in, mask, dropout_mask, heads=self.num_heads, rate=rate)
        q, k, v = (self._split(proj(x)) for proj in (self.W_query, self.W_key, self.W_value))
        head_mask = None if mask is None else mask.unsqueeze(-3)  # (B, 1, Lq, Lk)
        o = scaled_dot_product_attention(q, k, v, head_mask, is_causal=self.causal,
                                         dropout_rate=rate, dropout_mask=dropout_mask,
                                         return_weights=return_weights)
        o, w = o if return_weights else (o, None)
        y = self.out_proj(o.transpose(-2, -3).flatten(-2))  # (B, L, N·Dh) -> (B, L, d_out)
        return (y, w) if return_weights else y

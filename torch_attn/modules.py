"""PyTorch attention variants. Each computes attention through
``torch_attn.scaled_dot_product_attention``; they differ only in how they make q, k, v and what
they do with the result.

Shape legend: B batch, L sequence length (Lq queries, Lk keys), N heads, Dh head width,
d_* feature widths. Inputs are (B, L, d) or (L, d). Masks are bool, True = may attend, and
broadcast to (B, Lq, Lk); multi-head modules apply them to every head.
Parameters are ``nn.Linear`` layers named W_query, W_key, W_value (and out_proj).
"""

from __future__ import annotations

import torch
from torch import nn

from golden import variants
from golden.decoder import (
    alibi_bias,
    alibi_slopes,
    bucket_table,
    qk_normalize,
    relative_bias,
    sliding_window,
    temperature,
    weight_broadcast,
)
from golden.positions import (
    ContextCache,
    KVCache,
    LatentCache,
    check_fits,
    context_fingerprint,
)
from golden.validate import (
    cache_shape,
    check_context,
    check_context_inputs,
    check_cross_inputs,
    check_decoder_inputs,
    check_flags,
    check_latent_inputs,
    check_same_context,
    check_self_inputs,
    check_sequence,
    rope_arguments,
    rope_settings,
)
from golden.variants import VARIANTS
from torch_attn.explicit import LOW_PRECISION
from torch_attn.functional import scaled_dot_product_attention
from torch_attn.rotary import rotary_embedding

__all__ = ["CausalSelfAttention", "CrossAttention", "GroupedQueryAttention", "MultiHeadAttention",
           "MultiHeadAttentionWrapper", "MultiHeadCrossAttention",
           "MultiHeadLatentAttention", "SelfAttention", "SimpleSelfAttention"]


def _config(variant, **given) -> dict:
    """The constructor arguments, checked against the variant's description (golden.variants)."""
    return VARIANTS[variant].config(given)


def _dropout_rate(module) -> float:
    return module.dropout if module.training else 0.0


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


class GroupedQueryAttention(nn.Module):
    """Decoder attention as Llama, Mistral, Qwen, Gemma and their 2025–26 successors write it
    (docs/modules.md lists which families load exactly): N query heads sharing Nkv key-value
    heads (N a multiple of Nkv; Nkv = N is multi-head, Nkv = 1 multi-query attention), rotary
    embeddings on q and k (``rope_theta``; Hugging Face's ``rope_parameters`` scaling, the
    ``partial_rotary_factor`` of features turned, ``rope_precision`` "exact" or "hf": see
    rotary_embedding), causal by default, and a functional KV cache.

    Shapes: x (B, L, d_in) or (L, d_in); q (B, N, L, Dh), k and v (B, Nkv, L, Dh), Dh =
    ``head_dim`` (default d_in // num_heads); output (B, L, d_out), weights (B, N, L, Lk) with
    Lk = L, or the cache's max_length M. ``query_seq_lengths`` (B,): the real tokens of each row
    (right padding); a padding token neither queries (its row of the weights is zero, its output
    row is the output bias) nor is attended, and is not written to a cache.

    Options, in Hugging Face's terms: ``sliding_window`` W (a query sees W keys, itself
    included: the core's window (W − 1, 0)); ``qk_norm`` (golden.variants.QK_NORMS: "rms"
    Qwen3, "rms_one_plus" Gemma 3, "rms_across_heads" OLMo 2, "layer" Cohere, "l2" Llama 4,
    with ``qk_norm_eps``); ``sinks`` (GPT-OSS: a learned logit per head in every softmax);
    ``attention_chunk_size`` C (Llama 4: a query sees the keys of its own chunk of C
    positions); ``query_temperature`` {"beta", "floor_scale", "shift"} (Llama 4's NoPE layers:
    q · (1 + β·ln(1 + ⌊(p + shift)/F⌋))); ``output_gate`` (Qwen3-Next: the heads' output times
    σ(x W_gate + b_gate) before out_proj); ``alibi`` ("bloom", "mpt" with
    ``alibi_bias_max``, "falcon") and T5's ``relative_attention_num_buckets`` (a learned bias
    per bucket of key − query distance, ``relative_attention_max_distance``); ``clip_qkv`` c
    (MPT, OLMo: q, k and v clamped to [−c, c] after their projections).

    With ``cache`` (from ``init_cache``), token i of row b is at position
    cache.lengths[b] + i: its key and value are written there, it attends the cached keys and
    this call's (bottom-right causal), RoPE turns it by that position, and the call returns
    (output, new cache); the cache given is left as it was. Tokens that do not fit in
    max_length are dropped, as in jax_attn: they are not written nor counted, and their output
    rows are those of padding; query_seq_lengths are clipped to [0, L]. ``strict=True`` raises
    ValueError instead (golden.positions.check_fits; it reads the lengths: a device sync).
    """

    variant = "grouped_query_attention"

    def __init__(self, d_in, num_heads, num_kv_heads, head_dim=None, d_out=None, qkv_bias=False,
                 out_bias=False, causal=True, scale=None, softcap=None, sliding_window=None,
                 rope_theta=None, rope_interleaved=False, dropout=0.0, qk_norm=None,
                 qk_norm_eps=1e-6, sinks=False, attention_chunk_size=None,
                 query_temperature=None, output_gate=False, rope_parameters=None,
                 partial_rotary_factor=1.0, rope_precision="exact", alibi=None,
                 alibi_bias_max=8, relative_attention_num_buckets=None,
                 relative_attention_max_distance=128, clip_qkv=None):
        super().__init__()
        self.config = _config(self.variant, d_in=d_in, num_heads=num_heads,
                              num_kv_heads=num_kv_heads, head_dim=head_dim, d_out=d_out,
                              qkv_bias=qkv_bias, out_bias=out_bias, causal=causal, scale=scale,
                              softcap=softcap, sliding_window=sliding_window,
                              rope_theta=rope_theta, rope_interleaved=rope_interleaved,
                              dropout=dropout, qk_norm=qk_norm, qk_norm_eps=qk_norm_eps,
                              sinks=sinks, attention_chunk_size=attention_chunk_size,
                              query_temperature=query_temperature, output_gate=output_gate,
                              rope_parameters=rope_parameters,
                              partial_rotary_factor=partial_rotary_factor,
                              rope_precision=rope_precision, alibi=alibi,
                              alibi_bias_max=alibi_bias_max,
                              relative_attention_num_buckets=relative_attention_num_buckets,
                              relative_attention_max_distance=relative_attention_max_distance,
                              clip_qkv=clip_qkv)
        self.clip_qkv = clip_qkv
        self.rotary = rope_settings(rope_theta, rope_parameters, partial_rotary_factor,
                                    rope_precision)  # None without RoPE
        self.d_in, self.num_heads, self.num_kv_heads = d_in, num_heads, num_kv_heads
        self.head_dim = variants.head_dim(self.config)
        self.causal, self.scale, self.softcap = causal, scale, softcap
        self.sliding_window, self.dropout = sliding_window, dropout
        self.rope_theta, self.rope_interleaved = rope_theta, rope_interleaved
        self.qk_norm, self.qk_norm_eps = qk_norm, qk_norm_eps
        self.attention_chunk_size, self.query_temperature = attention_chunk_size, query_temperature
        self.alibi = alibi
        self.alibi_slopes = None if alibi is None else tuple(
            alibi_slopes(num_heads, alibi, alibi_bias_max).tolist())  # (N,), float64 values
        width = num_heads * self.head_dim
        self.W_query = nn.Linear(d_in, width, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, num_kv_heads * self.head_dim, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, num_kv_heads * self.head_dim, bias=qkv_bias)
        self.W_gate = nn.Linear(d_in, width, bias=qkv_bias) if output_gate else None
        self.out_proj = nn.Linear(width, d_in if d_out is None else d_out, bias=out_bias)
        shapes = variants.VARIANTS[self.variant].shapes(self.config)
        start = 0.0 if qk_norm == "rms_one_plus" else 1.0  # the weight that changes nothing
        self.buckets = (relative_attention_num_buckets, relative_attention_max_distance)
        self.q_norm, self.k_norm, self.sinks, self.relative_attention_bias = (
            nn.Parameter(torch.full(shapes[n], start if n.endswith("norm") else 0.0))
            if n in shapes else None
            for n in ("q_norm", "k_norm", "sinks", "relative_attention_bias"))

    def init_cache(self, batch_size, max_length, dtype=None) -> KVCache:
        """An empty cache: key and value zeros (B, Nkv, max_length, Dh) in ``dtype`` (default the
        parameters'), lengths zeros (B,) int32, on the parameters' device."""
        shape = cache_shape(batch_size, max_length, self.num_kv_heads, self.head_dim)
        dtype = self.W_query.weight.dtype if dtype is None else dtype
        device = self.W_query.weight.device
        return KVCache(torch.zeros(shape, dtype=dtype, device=device),
                       torch.zeros(shape, dtype=dtype, device=device),
                       torch.zeros(batch_size, dtype=torch.int32, device=device))

    def forward(self, x, mask=None, *, cache=None, query_seq_lengths=None, positions=None,
                dropout_mask=None, return_weights=False, strict=False):
        rate = _dropout_rate(self)
        check_decoder_inputs(x, self.d_in, mask, dropout_mask, query_seq_lengths,
                             heads=self.num_heads, rate=rate, cache=cache,
                             kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                             positions=positions)
        check_flags(strict=strict)
        if strict and cache is not None:  # reads the lengths: a device sync
            new = x.shape[-2] if query_seq_lengths is None else query_seq_lengths
            check_fits(cache.lengths.cpu().numpy(), torch.as_tensor(new).cpu().numpy(),
                       cache.key.shape[2], x.shape[-2])
        q, k, v = (self._clip(p(x)) for p in (self.W_query, self.W_key, self.W_value))
        if self.qk_norm == "rms_across_heads":  # OLMo 2: before the head split
            q, k = self._norm(q, self.q_norm), self._norm(k, self.k_norm)
        q = self._split(q, self.num_heads)                     # (B, N, L, Dh)
        k = self._split(k, self.num_kv_heads)                  # (B, Nkv, L, Dh)
        v = self._split(v, self.num_kv_heads)
        if self.qk_norm in ("rms", "rms_one_plus", "layer"):  # per head, before RoPE
            q, k = self._norm(q, self.q_norm), self._norm(k, self.k_norm)
        offset, q_lengths, kv_lengths = None, query_seq_lengths, query_seq_lengths
        if cache is not None:
            offset, q_lengths, kv_lengths = _cache_positions(cache, x.shape[1], query_seq_lengths)
        if self.rotary is not None:
            bound = x.shape[-2] if cache is None else cache.key.shape[2] + x.shape[1]
            q, k = (rotary_embedding(t, interleaved=self.rope_interleaved, offset=offset,
                                     positions=positions, max_position=bound,
                                     **rope_arguments(self.rotary)) for t in (q, k))
        if self.qk_norm == "l2":  # Llama 4: after RoPE
            q, k = self._norm(q, None), self._norm(k, None)
        if self.query_temperature is not None:
            q = self._temperature(q, offset, positions)
        if cache is not None:
            cache = _append(cache, k, v, q_lengths)
            k, v = cache.key, cache.value                     # (B, Nkv, M, Dh)
        head_mask = None if mask is None else mask.unsqueeze(-3)  # (B, 1, L, Lk)
        extra = {n: a for n, a in (("sinks", self.sinks),
                                   ("attention_chunk_size", self.attention_chunk_size))
                 if a is not None}
        bias = self._position_bias(q, k.shape[-2], offset)
        o = scaled_dot_product_attention(
            q, k, v, head_mask, bias, is_causal=self.causal, scale=self.scale,
            softcap=self.softcap,
            local_window_size=sliding_window(self.sliding_window, self.causal),
            query_offset=offset, query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
            dropout_rate=rate, dropout_mask=dropout_mask, return_weights=return_weights,
            **extra)
        o, w = o if return_weights else (o, None)
        merged = o.transpose(-2, -3).flatten(-2)  # (B, L, N·Dh)
        if self.W_gate is not None:
            merged = merged * torch.sigmoid(self.W_gate(x))
        y = self.out_proj(merged)  # (B, L, d_out)
        out = (y, w) if return_weights else y
        return out if cache is None else (out, cache)

    def _clip(self, y):
        """MPT's and OLMo's clip_qkv: a projection clamped to [−c, c] (None: as it is)."""
        return y if self.clip_qkv is None else y.clamp(-self.clip_qkv, self.clip_qkv)

    def _split(self, y, heads):
        """(B, L, heads·Dh) -> (B, heads, L, Dh)."""
        return y.unflatten(-1, (heads, self.head_dim)).transpose(-2, -3)

    def _norm(self, t, weight):
        """The QK norm of t, computed in at least float32 and rounded once to t's dtype."""
        compute = torch.float32 if t.dtype in LOW_PRECISION else t.dtype
        w = None if weight is None else weight_broadcast(self.qk_norm, weight.to(compute))
        return qk_normalize(t.to(compute), self.qk_norm, w, self.qk_norm_eps,
                            mean=lambda a: a.mean(-1, keepdim=True),
                            rsqrt=torch.rsqrt).to(t.dtype)

    def _position_bias(self, q, keys, offset):
        """ALiBi's or T5's score bias (N, L, Lk), or (B, N, L, Lk) with a cache (query i at
        p = offset + i), in at least float32; None without. Both read the distance j − p in
        token order, as the mask (``positions`` move RoPE and the temperature, not these: on
        the pairs a left-padded or packed row attends, the two differ by a constant per
        sequence). ALiBi: m_h · (j − p), Falcon's added before the scale (times the scale,
        default 1/√Dh). T5: the learned table at the bucket of j − p."""
        if self.alibi is None and self.relative_attention_bias is None:
            return None
        compute = torch.float32 if q.dtype in LOW_PRECISION else q.dtype
        pos = torch.arange(q.shape[-2], device=q.device)[:, None]  # (L, 1)
        if offset is not None:
            pos = pos + offset[:, None, None]  # (B, L, 1)
        distance = torch.arange(keys, device=q.device) - pos  # (..., L, Lk)
        if self.relative_attention_bias is not None:
            span = keys + q.shape[-2]  # every distance j − p lies in [−span, span]
            table = torch.as_tensor(bucket_table(span, not self.causal, *self.buckets),
                                    device=q.device)
            return relative_bias(self.relative_attention_bias.to(compute), table[distance + span],
                                 moveaxis=torch.movedim)
        slopes = torch.tensor(self.alibi_slopes, dtype=compute, device=q.device)
        bias = alibi_bias(slopes, distance.to(compute))
        if self.alibi == "falcon":
            bias = bias * (self.head_dim ** -0.5 if self.scale is None else self.scale)
        return bias

    def _temperature(self, q, offset, positions):
        """q times the query temperature at each token's position (``positions``, or index +
        offset)."""
        compute = torch.float32 if q.dtype in LOW_PRECISION else q.dtype
        if positions is None:
            positions = torch.arange(q.shape[-2], device=q.device)  # (L,)
            if offset is not None:
                positions = positions + offset[:, None]  # (B, L)
        positions = positions.to(q.device)
        t = self.query_temperature
        factors = temperature(positions, t["beta"], t["floor_scale"], t["shift"],
                              log1p=lambda n: torch.log1p(n.to(compute)))
        factors = factors[..., None] if factors.dim() == 1 else factors[:, None, :, None]
        return (q.to(compute) * factors).to(q.dtype)  # (L, 1) or (B, 1, L, 1)



class MultiHeadCrossAttention(nn.Module):
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

    With ``cache`` (from ``context_cache``), the cached keys and values are used and
    ``context`` may be None; if it is given, it must be the context the cache was made from
    (its shape, and its fingerprint: golden.positions.context_fingerprint), else ValueError.
    """

    variant = "multi_head_cross_attention"

    def __init__(self, d_in, d_context, num_heads, num_kv_heads=None, head_dim=None, d_out=None,
                 qkv_bias=False, key_bias=None, out_bias=False, scale=None):
        super().__init__()
        self.config = _config(self.variant, d_in=d_in, d_context=d_context, num_heads=num_heads,
                              num_kv_heads=num_kv_heads, head_dim=head_dim, d_out=d_out,
                              qkv_bias=qkv_bias, key_bias=key_bias, out_bias=out_bias,
                              scale=scale)
        sizes = variants.cross_sizes(self.config)
        self.d_in, self.d_context, self.num_heads = d_in, d_context, num_heads
        self.num_kv_heads, self.head_dim = sizes["num_kv_heads"], sizes["head_dim"]
        self.scale = scale
        width, kv_width = num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.W_query = nn.Linear(d_in, width, bias=qkv_bias)
        self.W_key = nn.Linear(d_context, kv_width, bias=sizes["key_bias"])
        self.W_value = nn.Linear(d_context, kv_width, bias=qkv_bias)
        self.out_proj = nn.Linear(width, sizes["d_out"], bias=out_bias)

    def context_cache(self, context, context_lengths=None) -> ContextCache:
        """The context's keys and values (B, Nkv, Lc, Dh), its lengths (B,) int32 (Lc without
        context_lengths) and its fingerprint (B, 4), for later calls."""
        check_context(context, self.d_context, context_lengths)
        return ContextCache(*self._project_context(context, context_lengths),
                            _fingerprint(context))

    def forward(self, x, context=None, mask=None, *, cache=None, context_lengths=None,
                return_weights=False):
        check_context_inputs(x, context, self.d_in, self.d_context, mask, context_lengths,
                             heads=self.num_heads, cache=cache, kv_heads=self.num_kv_heads,
                             head_dim=self.head_dim)
        if cache is None:
            k, v, lengths = self._project_context(context, context_lengths)
        else:
            if context is not None:
                check_same_context(torch.equal(_fingerprint(context), cache.fingerprint))
            k, v, lengths = cache.key, cache.value, cache.lengths
        q = self._split(self.W_query(x))                       # (B, N, Lq, Dh)
        head_mask = None if mask is None else mask.unsqueeze(-3)  # (B, 1, Lq, Lc)
        o = scaled_dot_product_attention(q, k, v, head_mask, scale=self.scale,
                                         key_value_seq_lengths=lengths,
                                         return_weights=return_weights)
        o, w = o if return_weights else (o, None)
        y = self.out_proj(o.transpose(-2, -3).flatten(-2))     # (B, Lq, N·Dh) -> (B, Lq, d_out)
        return (y, w) if return_weights else y

    def _project_context(self, context, context_lengths):
        """k, v (B, Nkv, Lc, Dh) of the context and its lengths (B,) int32 (Lc when None)."""
        lengths = (torch.full(context.shape[:-2], context.shape[-2], dtype=torch.int32,
                              device=context.device)
                   if context_lengths is None else context_lengths.to(torch.int32))
        return self._split(self.W_key(context)), self._split(self.W_value(context)), lengths

    def _split(self, y):
        """(B, L, heads·Dh) -> (B, heads, L, Dh)."""
        return y.unflatten(-1, (-1, self.head_dim)).transpose(-2, -3)


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention (MLA) as DeepSeek-V2/V3 and Kimi K2 write it (transformers'
    DeepseekV3Attention): keys and values made per head from one small latent per token, which
    is all a cache holds.

    Shapes: x (B, L, d_in) or (L, d_in); r = kv_lora_rank, Dn = qk_nope_head_dim, Dr =
    qk_rope_head_dim, Dk = Dn + Dr, Dv = v_head_dim. q = x W_query, or with ``q_lora_rank`` R
    RMSNorm(x W_q_a + b_q_a) W_q_b (q_a_norm), (B, N, L, Dk), each head [q_nope | q_pe];
    x W_kv_a + b_kv_a = [c | k_pe] (B, L, r + Dr); the latent c RMS-normalised (kv_a_norm) and
    W_kv_b (no bias) make each head's [k_nope (Dn) | v (Dv)]; q_pe and the one rotary key head
    k_pe turned by RoPE (``rope_interleaved``: pairs (2i, 2i + 1), DeepSeek's layout; else
    "rotate half"), k_pe shared by every head; causal attention of [q_nope | q_pe] on
    [k_nope | k_pe], scale Dk^−1/2 times yarn's mscale(s, mscale_all_dim)² (golden.variants.
    latent_scale) unless ``scale`` is given; out_proj (N·Dv -> d_out). ``attention_bias`` puts
    biases on W_q_a, W_kv_a and out_proj, as Hugging Face's. Output (B, L, d_out), weights
    (B, N, L, Lk), Lk = L or the cache's max_length M. ``query_seq_lengths`` and ``positions``
    as GroupedQueryAttention's.

    With ``cache`` (from ``init_cache``, golden.positions.LatentCache) the call appends each
    token's normalised latent c and rotated k_pe at position cache.lengths[b] + i and returns
    (output, new cache); what does not fit in max_length is dropped, as GroupedQueryAttention
    drops it. ``absorb=True`` computes the same attention without making per-head keys and
    values (vLLM's and SGLang's decode): W_kv_b's key half folded into the query, q_lat =
    q_nope W_kb per head (B, N, L, r), scores [q_lat | q_pe] · [c | k_pe] on the one latent
    "head" (the core's multi-query attention), weights · c (B, N, L, r) then W_kv_b's value
    half per head.
    """

    variant = "multi_head_latent_attention"

    def __init__(self, d_in, num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                 v_head_dim, q_lora_rank=None, d_out=None, attention_bias=False,
                 rms_norm_eps=1e-6, rope_theta=None, rope_parameters=None, rope_interleaved=True,
                 causal=True, scale=None):
        super().__init__()
        self.config = _config(self.variant, d_in=d_in, num_heads=num_heads,
                              kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
                              qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
                              q_lora_rank=q_lora_rank, d_out=d_out, attention_bias=attention_bias,
                              rms_norm_eps=rms_norm_eps, rope_theta=rope_theta,
                              rope_parameters=rope_parameters, rope_interleaved=rope_interleaved,
                              causal=causal, scale=scale)
        sizes = variants.latent_sizes(self.config)
        self.rotary = variants.latent_rope(self.config)
        self.scale = variants.latent_scale(self.config)
        self.d_in, self.num_heads, self.kv_lora_rank = d_in, num_heads, kv_lora_rank
        self.nope, self.rope, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rms_norm_eps, self.rope_interleaved, self.causal = (rms_norm_eps, rope_interleaved,
                                                                 causal)
        qk, bias = sizes["qk_head_dim"], attention_bias
        lora = q_lora_rank is not None
        self.W_query = None if lora else nn.Linear(d_in, num_heads * qk, bias=False)
        self.W_q_a = nn.Linear(d_in, q_lora_rank, bias=bias) if lora else None
        self.q_a_norm = nn.Parameter(torch.ones(q_lora_rank)) if lora else None
        self.W_q_b = nn.Linear(q_lora_rank, num_heads * qk, bias=False) if lora else None
        self.W_kv_a = nn.Linear(d_in, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_norm = nn.Parameter(torch.ones(kv_lora_rank))
        self.W_kv_b = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim),
                                bias=False)
        self.out_proj = nn.Linear(num_heads * v_head_dim, sizes["d_out"], bias=bias)

    def init_cache(self, batch_size, max_length, dtype=None) -> LatentCache:
        """An empty cache: latent zeros (B, max_length, kv_lora_rank), rope_key zeros (B,
        max_length, qk_rope_head_dim) in ``dtype`` (default the parameters'), lengths zeros
        (B,) int32, on the parameters' device."""
        cache_shape(batch_size, max_length, 1, 1)  # checks the sizes
        dtype = self.W_kv_a.weight.dtype if dtype is None else dtype
        device = self.W_kv_a.weight.device
        return LatentCache(
            torch.zeros(batch_size, max_length, self.kv_lora_rank, dtype=dtype, device=device),
            torch.zeros(batch_size, max_length, self.rope, dtype=dtype, device=device),
            torch.zeros(batch_size, dtype=torch.int32, device=device))

    def cache_bytes_per_token(self, dtype=None) -> int:
        """Bytes the cache holds per token and layer: (kv_lora_rank + qk_rope_head_dim) ·
        itemsize of ``dtype`` (default the parameters'), whatever num_heads."""
        dtype = self.W_kv_a.weight.dtype if dtype is None else dtype
        return (self.kv_lora_rank + self.rope) * torch.empty((), dtype=dtype).element_size()

    def forward(self, x, mask=None, *, cache=None, query_seq_lengths=None, positions=None,
                return_weights=False, absorb=False):
        check_latent_inputs(x, self.d_in, mask, query_seq_lengths, heads=self.num_heads,
                            positions=positions, cache=cache, kv_lora_rank=self.kv_lora_rank,
                            rope_dim=self.rope)
        check_flags(absorb=absorb)
        q = self._split(self._query(x), self.nope + self.rope)  # (B, N, L, Dk)
        kv_a = self.W_kv_a(x)                                    # (B, L, r + Dr)
        latent = self._norm(kv_a[..., :self.kv_lora_rank], self.kv_a_norm)  # (B, L, r)
        k_pe = kv_a[..., None, :, self.kv_lora_rank:]            # (B, 1, L, Dr)
        offset, q_lengths, kv_lengths = None, query_seq_lengths, query_seq_lengths
        if cache is not None:
            held = _as_kv(cache)
            offset, q_lengths, kv_lengths = _cache_positions(held, x.shape[1], query_seq_lengths)
        bound = x.shape[-2] if cache is None else cache.latent.shape[1] + x.shape[1]
        q_pe, k_pe = (rotary_embedding(t, interleaved=self.rope_interleaved, offset=offset,
                                       positions=positions, max_position=bound,
                                       **rope_arguments(self.rotary))
                      for t in (q[..., self.nope:], k_pe))
        latent = latent.unsqueeze(-3)                            # (B, 1, L, r)
        if cache is not None:
            held = _append(held, latent, k_pe, q_lengths)
            latent, k_pe = held.key, held.value                  # (B, 1, M, r), (B, 1, M, Dr)
            cache = LatentCache(latent[:, 0], k_pe[:, 0], held.lengths)
        head_mask = None if mask is None else mask.unsqueeze(-3)  # (B, 1, L, Lk)
        attend = self._absorbed if absorb else self._expanded
        o = attend(q[..., :self.nope], q_pe, latent, k_pe, head_mask, offset, q_lengths,
                   kv_lengths, return_weights)                   # (B, N, L, Dv)
        o, w = o if return_weights else (o, None)
        y = self.out_proj(o.transpose(-2, -3).flatten(-2))       # (B, L, N·Dv) -> (B, L, d_out)
        out = (y, w) if return_weights else y
        return out if cache is None else (out, cache)

    def _expanded(self, q_nope, q_pe, latent, k_pe, mask, offset, q_lengths, kv_lengths,
                  return_weights):
        """Per-head keys [k_nope | k_pe] (B, N, Lk, Dk) and values (B, N, Lk, Dv) from the
        latent (B, 1, Lk, r) through W_kv_b, then the core."""
        kv = self._split(self.W_kv_b(latent[..., 0, :, :]), self.nope + self.v_head_dim)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        k = torch.cat([k_nope, k_pe.expand(k_nope.shape[:-1] + (self.rope,))], -1)
        q = torch.cat([q_nope, q_pe], -1)
        return scaled_dot_product_attention(
            q, k, v, mask, is_causal=self.causal, scale=self.scale, query_offset=offset,
            query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
            return_weights=return_weights)

    def _absorbed(self, q_nope, q_pe, latent, k_pe, mask, offset, q_lengths, kv_lengths,
                  return_weights):
        """W_kv_b's key half W_kb (r, N, Dn) folded into the query, q_lat (B, N, L, r); the
        core on one key-value head, keys [c | k_pe] (B, 1, Lk, r + Dr), values c; the result
        (B, N, L, r) through W_kv_b's value half W_vb (r, N, Dv)."""
        w = self.W_kv_b.weight.T.unflatten(-1, (self.num_heads, -1))  # (r, N, Dn + Dv)
        w_kb, w_vb = w[..., :self.nope], w[..., self.nope:]
        q_lat = torch.einsum("...nld,rnd->...nlr", q_nope, w_kb)
        o = scaled_dot_product_attention(
            torch.cat([q_lat, q_pe], -1), torch.cat([latent, k_pe], -1), latent, mask,
            is_causal=self.causal, scale=self.scale, query_offset=offset,
            query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
            return_weights=return_weights)
        o, w_ = o if return_weights else (o, None)
        o = torch.einsum("...nlr,rnv->...nlv", o, w_vb)
        return (o, w_) if return_weights else o

    def _query(self, x):
        """(B, L, N·Dk): x W_query, or RMSNorm(x W_q_a + b_q_a) W_q_b."""
        if self.W_query is not None:
            return self.W_query(x)
        return self.W_q_b(self._norm(self.W_q_a(x), self.q_a_norm))

    def _split(self, y, width):
        """(B, L, N·width) -> (B, N, L, width)."""
        return y.unflatten(-1, (self.num_heads, width)).transpose(-2, -3)

    def _norm(self, t, weight):
        """RMSNorm of t times ``weight``, computed in at least float32, rounded once to t's
        dtype."""
        compute = torch.float32 if t.dtype in LOW_PRECISION else t.dtype
        return qk_normalize(t.to(compute), "rms", weight.to(compute), self.rms_norm_eps,
                            mean=lambda a: a.mean(-1, keepdim=True),
                            rsqrt=torch.rsqrt).to(t.dtype)


def _as_kv(cache) -> KVCache:
    """A LatentCache seen as a KVCache of one head (B, 1, M, ·), for _cache_positions and
    _append (shared with GroupedQueryAttention)."""
    return KVCache(cache.latent.unsqueeze(1), cache.rope_key.unsqueeze(1), cache.lengths)


def _fingerprint(context):
    """golden.positions.context_fingerprint of ``context`` in at least float32."""
    compute = torch.float32 if context.dtype in LOW_PRECISION else context.dtype
    return context_fingerprint(context.detach().to(compute), torch.stack)

def _cache_positions(cache, length, query_seq_lengths):
    """(query offset, query lengths, key lengths) of a call of ``length`` tokens appended to
    ``cache``: row b's tokens at lengths[b] + i, the real ones (i < query_seq_lengths[b],
    clipped to [0, L]) counted, and of those only the ones that fit in max_length (as
    jax_attn's; ``strict=True`` raises instead, golden.positions.check_fits)."""
    held, room = cache.lengths, cache.key.shape[2]
    new = (torch.full_like(held, length) if query_seq_lengths is None
           else query_seq_lengths.to(held.device, held.dtype).clamp(0, length))
    new = torch.minimum(new, room - held)  # what does not fit is dropped
    return held, new, held + new


def _append(cache, k, v, new) -> KVCache:
    """A new cache: row b's first new[b] keys and values of this call (B, Nkv, L, Dh) written
    after its lengths[b] held ones (the cache given is not changed)."""
    b, length = k.shape[0], k.shape[2]
    i = torch.arange(length, device=k.device)
    real = i < new[:, None]                                       # (B, L)
    rows = torch.arange(b, device=k.device)[:, None].expand(b, length)[real]
    pos = (cache.lengths[:, None] + i)[real]                      # (n,) each
    key, value = cache.key.clone(), cache.value.clone()
    key[rows, :, pos] = k.transpose(1, 2)[real]                   # (n, Nkv, Dh)
    value[rows, :, pos] = v.transpose(1, 2)[real]
    return KVCache(key, value, (cache.lengths + new).to(cache.lengths.dtype))

"""GroupedQueryAttention, the twin of torch_attn.modules.grouped_query's: the decoder family and
its options, with a KV cache that is a pytree written by one scatter (``_cache_positions`` and
``_append``, which MultiHeadLatentAttention's latent cache shares) and ``strict`` read on the
host outside the compiled call. Shape legend as in jax_attn.modules; the class docstring gives
its own.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from golden.specification import variants
from golden.specification.decoder import (
    alibi_slopes, bucket_table, qk_normalize, refuse_renamed, sinusoid_table,
    timing_table, weight_broadcast,
)
from golden.specification.decoder import sliding_window as core_window
from golden.specification.outputs import (gate_has_bias, gate_kind, gated_output,
                                          normalized_output)
from golden.specification.positions import (ROPE_BLOCK, KVCache, MergedCache, check_fits,
                                            merged_allowed)
from golden.specification.validate import (
    cache_shape, check_decoder_inputs, check_flags, check_positive_or_none, rope_arguments,
    rope_axis_count,
    rope_settings,
)
from golden.specification.variants import VARIANTS
from jax_attn.functional import DEFAULT_PRECISION, scaled_dot_product_attention
from jax_attn.modules.base import (_head_mask, _linear, _merge_heads, _query_temperature,
                                   _Variant)
from jax_attn.rotary import rotary_embedding


class GroupedQueryAttention(_Variant):
    """The attention of Llama, Mistral, Qwen and Gemma: N query heads sharing Nkv key-value heads
    (N a multiple of Nkv; Nkv = N is multi-head, Nkv = 1 multi-query attention), rotary
    embeddings on q and k (``rope_theta``; Hugging Face's ``rope_parameters`` scaling, the
    ``partial_rotary_factor`` of features turned, ``rope_precision`` "exact" or "hf": see
    rotary_embedding), causal by default, and a functional KV cache.

    Shapes: x (B, L, d_in) or (L, d_in); q (B, N, L, Dh), k and v (B, Nkv, L, Dh), Dh =
    ``head_dim`` (default d_in // num_heads); output (B, L, d_out), weights (B, N, L, Lk) with
    Lk = L, or the cache's max_length M. ``query_seq_lengths`` (B,): the real tokens of each row
    (right padding); a padding token neither queries (its row of the weights is zero, its output
    row is the output bias) nor is attended, and is not written to a cache.

    Options: as torch_attn.GroupedQueryAttention's (docs/modules.md), ``clip_qkv`` c included
    (MPT, OLMo: q, k and v clamped to [−c, c] after their projections), and
    ``relative_positions="transformer_xl"`` (Transformer-XL's relative positional attention:
    bias_u, bias_v (N, Dh), W_pos (d_in, N·Dh); ``_relative``), ``"shaw"`` with
    ``relative_max_distance`` M (Shaw's relative key embeddings: relative_key_table (2M + 1,
    Dh) shared by the heads; ``_shaw``) or ``"conformer_timing"`` (the USM Conformer's, Gemma
    3n's and Gemma 4's audio attention: per_dim_scale (Dh,), W_pos, ``key_scale``;
    ``_conformer``), each term inside the soft cap (the core's distance_query and
    distance_keys); ``input_norm="layer"`` (LayerNorm of x before the projections,
    input_norm_weight and input_norm_bias (d_in,), ε = ``input_norm_eps``).

    With ``cache`` (from ``init_cache``, a pytree), token i of row b is at position
    cache.lengths[b] + i: its key and value are written there (a scatter, in place when the
    caller's jit donates the cache), it attends the cached keys and this call's (bottom-right
    causal), RoPE turns it by that position, and the call returns (output, new cache). The
    lengths are traced, so a decode step compiles once per max_length. Tokens that do not fit
    in max_length are dropped, as in torch_attn: they are not written nor counted, and their
    output rows are those of padding; query_seq_lengths are clipped to [0, L]. ``strict=True``
    raises ValueError instead (golden.specification.positions.check_fits), reading the lengths on
    the host: a device sync, and impossible on traced lengths (under jit it raises saying so).

    ``kv_shared=True``: no keys or values of its own (no W_key, b_key, W_value, b_value,
    k_norm); called with ``cache=`` the storing layer's cache as its call on the same tokens
    returned it, read and never written, as torch_attn.GroupedQueryAttention's (its docstring);
    without a cache, and in ``init_cache``, it raises ValueError.
    """

    variant = "grouped_query_attention"

    def __new__(cls, *args, **kwargs):
        refuse_renamed(kwargs)  # an argument of before sliding_window: its replacement named
        return super().__new__(cls)

    def __init__(self, d_in, num_heads, num_kv_heads, head_dim=None, d_out=None, qkv_bias=False,
                 out_bias=False, causal=True, scale=None, softcap=None, sliding_window=None,
                 rope_theta=None, rope_interleaved=False, dropout=0.0, qk_norm=None,
                 qk_norm_eps=1e-6, sinks=False, attention_chunk_size=None,
                 query_temperature=None, output_gate=False, rope_parameters=None,
                 partial_rotary_factor=1.0, rope_precision="exact", alibi=None,
                 alibi_bias_max=8, relative_attention_num_buckets=None,
                 relative_attention_max_distance=128, relative_attention_buckets="t5",
                 clip_qkv=None, v_norm=False, k_eq_v=False, relative_positions=None,
                 relative_max_distance=None, input_norm=None, input_norm_eps=1e-5,
                 key_scale=None, output_norm=None, output_norm_eps=1e-6, gate_bias=None,
                 v_head_dim=None, value_scale=None, clip_qkv_after_norm=False, kv_shared=False,
                 merged_context=False, *, rngs, precision=DEFAULT_PRECISION):
        self._configure(d_in=d_in, num_heads=num_heads, num_kv_heads=num_kv_heads,
                        head_dim=head_dim, d_out=d_out, qkv_bias=qkv_bias, out_bias=out_bias,
                        causal=causal, scale=scale, softcap=softcap,
                        sliding_window=sliding_window, rope_theta=rope_theta,
                        rope_interleaved=rope_interleaved, dropout=dropout, qk_norm=qk_norm,
                        qk_norm_eps=qk_norm_eps, sinks=sinks,
                        attention_chunk_size=attention_chunk_size,
                        query_temperature=query_temperature, output_gate=output_gate,
                        rope_parameters=rope_parameters,
                        partial_rotary_factor=partial_rotary_factor, rope_precision=rope_precision,
                        alibi=alibi, alibi_bias_max=alibi_bias_max,
                        relative_attention_num_buckets=relative_attention_num_buckets,
                        relative_attention_max_distance=relative_attention_max_distance,
                        relative_attention_buckets=relative_attention_buckets,
                        clip_qkv=clip_qkv, v_norm=v_norm, k_eq_v=k_eq_v,
                        relative_positions=relative_positions,
                        relative_max_distance=relative_max_distance,
                        input_norm=input_norm, input_norm_eps=input_norm_eps,
                        key_scale=key_scale, output_norm=output_norm,
                        output_norm_eps=output_norm_eps, gate_bias=gate_bias,
                        v_head_dim=v_head_dim, value_scale=value_scale,
                        clip_qkv_after_norm=clip_qkv_after_norm, kv_shared=kv_shared,
                        merged_context=merged_context)
        self.merged_context = merged_context  # static, and its window W (an int, or None)
        self.merged_window = sliding_window if merged_context else None
        self.clip_qkv, self.v_norm, self.kv_shared = clip_qkv, v_norm, kv_shared
        self.clip_after_norm = clip_qkv_after_norm  # OLMoE: q and k clamped after their norm
        self.rotary = rope_settings(rope_theta, rope_parameters, partial_rotary_factor,
                                    rope_precision)  # None without RoPE; hashable (static)
        self.d_in, self.num_heads, self.num_kv_heads = d_in, num_heads, num_kv_heads
        self.head_dim = variants.head_dim(self.config)
        self.v_head_dim, self.value_scale = variants.value_dim(self.config), value_scale
        self.causal, self.scale, self.softcap = causal, scale, softcap
        self.local_window_size = core_window(sliding_window, causal)
        self.rope_theta, self.rope_interleaved = rope_theta, rope_interleaved
        self.qk_norm, self.qk_norm_eps = qk_norm, qk_norm_eps
        self.attention_chunk_size = attention_chunk_size
        self.alibi, self.relative_positions, self.key_scale = alibi, relative_positions, key_scale
        self.alibi_slopes = None if alibi is None else tuple(
            alibi_slopes(num_heads, alibi, alibi_bias_max).tolist())  # (N,): static, hashable
        self.query_temperature = (None if query_temperature is None else tuple(
            sorted(query_temperature.items())))  # static: hashable
        self.precision = precision
        self._init_dropout(dropout, rngs)
        width, kv_width = num_heads * self.head_dim, num_kv_heads * self.head_dim
        self.W_query = _linear(d_in, width, qkv_bias, rngs, precision)
        self.W_key = (None if kv_shared  # kv_shared: the storing layer's keys, from its cache
                      else _linear(d_in, kv_width, qkv_bias, rngs, precision))
        self.W_value = (None if k_eq_v or kv_shared  # k_eq_v (Gemma 4): V is K's projection
                        else _linear(d_in, num_kv_heads * self.v_head_dim, qkv_bias, rngs,
                                     precision))
        values = num_heads * self.v_head_dim  # N·Dv: the heads' output
        self.gate = gate_kind(output_gate)  # (activation, per head) or None: static
        self.output_norm, self.output_norm_eps = output_norm, output_norm_eps
        self.W_gate = None if self.gate is None else _linear(
            d_in, num_heads if self.gate[1] else values, gate_has_bias(self.config), rngs,
            precision)
        self.out_proj = _linear(values, d_in if d_out is None else d_out, out_bias, rngs,
                                precision)
        self.W_pos = (_linear(d_in, width, False, rngs, precision)
                      if relative_positions in ("transformer_xl", "conformer_timing") else None)
        self.buckets = (relative_attention_num_buckets, relative_attention_max_distance,
                        relative_attention_buckets)
        self.input_norm_eps = input_norm_eps  # Granite's pre_norm: LayerNorm(d_in)
        starts = variants.vector_starts(self.variant, self.config)  # each at its no-op value
        for n in VARIANTS[self.variant].vectors:  # None where the config has none
            setattr(self, n, nnx.Param(jnp.full(*starts[n])) if n in starts else None)

    def init_cache(self, batch_size, max_length, dtype=None) -> KVCache:
        """An empty cache: key and value zeros (B, Nkv, max_length, Dh) in ``dtype`` (default the
        parameters'), lengths zeros (B,) int32. A ``kv_shared`` module has no keys of its own to
        cache: it raises ValueError (make the storing layer's)."""
        _refuse_own_cache(self.kv_shared)
        shape = cache_shape(batch_size, max_length, self.num_kv_heads, self.head_dim)
        dtype = self.W_query.kernel.get_value().dtype if dtype is None else dtype
        kind = MergedCache if self.merged_context else KVCache  # merged: no context yet
        return kind(jnp.zeros(shape, dtype), jnp.zeros(shape[:-1] + (self.v_head_dim,), dtype),
                    jnp.zeros((batch_size,), jnp.int32))

    def __call__(self, x, mask=None, *, cache=None, query_seq_lengths=None, positions=None,
                 dropout_mask=None, return_weights=False, strict=False, max_position=None,
                 context=None, context_mask=None):
        check_flags(strict=strict)
        check_positive_or_none("max_position", max_position)
        if strict and cache is not None and not self.kv_shared:  # kv_shared writes nothing
            self._check_fits(x, cache, query_seq_lengths, dropout_mask, mask, context,
                             context_mask)
        if max_position is None and positions is not None and not isinstance(
                positions, jax.core.Tracer):  # the positions' own reach, read on the host
            max_position = int(np.max(np.abs(np.asarray(positions)))) + 1
        if max_position is not None:  # whole blocks of the tables: one program per block count
            max_position = -(-int(max_position) // ROPE_BLOCK) * ROPE_BLOCK
        return self._call(x, mask, cache=cache, query_seq_lengths=query_seq_lengths,
                          positions=positions, dropout_mask=dropout_mask,
                          return_weights=return_weights, max_position=max_position,
                          context=context, context_mask=context_mask)

    def _check_fits(self, x, cache, query_seq_lengths, dropout_mask, mask, context,
                    context_mask):
        """strict=True: the lengths read on the host (as torch does), ValueError when the call's
        tokens do not fit (golden.specification.positions.check_fits); impossible on traced
        lengths."""
        check_decoder_inputs(x, self.d_in, mask, dropout_mask, query_seq_lengths,
                             heads=self.num_heads, rate=self._rate(), cache=cache,
                             kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                             value_dim=self.v_head_dim, merged=self.merged_context,
                             context=context, context_mask=context_mask)
        new = x.shape[-2] if query_seq_lengths is None else query_seq_lengths
        if any(isinstance(a, jax.core.Tracer) for a in (cache.lengths, new)):
            raise ValueError("strict=True reads the cache's lengths on the host, but they are "
                             "traced here (under jit): call the module outside jit, or pass "
                             "strict=False (tokens that do not fit are then dropped)")
        check_fits(np.asarray(cache.lengths), np.asarray(new), cache.key.shape[2], x.shape[-2])

    @nnx.jit(graph=False, static_argnames=("return_weights", "max_position"))
    def _call(self, x, mask=None, *, cache=None, query_seq_lengths=None, positions=None,
              dropout_mask=None, return_weights=False, max_position=None, context=None,
              context_mask=None):
        rate = self._rate()
        check_decoder_inputs(x, self.d_in, mask, dropout_mask, query_seq_lengths,
                             heads=self.num_heads, rate=rate, cache=cache,
                             kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                             value_dim=self.v_head_dim,
                             positions=positions, axes=rope_axis_count(self.rotary),
                             temperature=self.query_temperature is not None,
                             kv_shared=self.kv_shared, merged=self.merged_context,
                             context=context, context_mask=context_mask)
        if positions is not None and positions.ndim == 2 and x.ndim == 2:  # unbatched (A, L)
            positions = positions[:, None]  # -> (3, 1, L): one row per axis against (N, L, Dh)
        if self.input_norm_weight is not None:  # Granite Speech's pre_norm
            x = self._input_norm(x)
        q = self.W_query(x)
        k = None if self.kv_shared else self.W_key(x)  # kv_shared: k and v read from the cache
        v = None if self.kv_shared else self._clip(  # k_eq_v: K's projection
            k if self.W_value is None else self.W_value(x))
        if not self.clip_after_norm:
            q, k = self._clip(q), self._clip(k)
        if self.qk_norm == "rms_across_heads":  # OLMo 2: before the head split
            q, k = self._normed(q, k)
        q = self._split(q, self.num_heads)                     # (B, N, L, Dh)
        k = self._split(k, self.num_kv_heads)                  # (B, Nkv, L, Dh)
        v = self._split(v, self.num_kv_heads)
        if self.value_scale is not None:  # MiMo-V2-Flash: the values times a constant
            v = v * self.value_scale
        if self.v_norm:  # Gemma 4: each value head RMS-normalised, no weight
            v = self._norm(v, None, kind="l2")
        if self.qk_norm in ("rms", "rms_one_plus", "layer", "layer_with_bias"):  # per head
            q, k = self._normed(q, k)
        offset, q_lengths, kv_lengths = None, query_seq_lengths, query_seq_lengths
        if cache is not None:
            positions_of = _shared_positions if self.kv_shared else _cache_positions
            offset, q_lengths, kv_lengths = positions_of(cache, x.shape[1], query_seq_lengths)
        if self.rotary is not None:
            bound = x.shape[-2] if cache is None else cache.key.shape[2] + x.shape[1]
            bound = max(bound, max_position or 0)  # positions past the call's tokens (video)
            q, k = (None if t is None else rotary_embedding(
                t, interleaved=self.rope_interleaved, offset=offset, positions=positions,
                max_position=bound, **rope_arguments(self.rotary)) for t in (q, k))
        if self.qk_norm in variants.AFTER_ROPE:  # Llama 4's, HunYuan's: after RoPE
            q, k = self._norm(q, self.q_norm), self._norm(k, self.k_norm)
        if self.query_temperature is not None:
            q = self._temperature(q, offset, positions)
        if self.merged_context:  # T5Gemma 2's decoder: one softmax over x's and the context's
            return self._merged(x, q, k, v, (context, context_mask), _head_mask(mask, x),
                                cache, (offset, q_lengths, kv_lengths),
                                (rate, dropout_mask, return_weights))
        if cache is not None:  # kv_shared: the storing layer's cache read, not written
            cache = cache if self.kv_shared else _append(cache, k, v, q_lengths)
            k, v = cache.key, cache.value                     # (B, Nkv, M, Dh)
        head_mask = _head_mask(mask, x)  # (B, 1 or N, L, Lk)
        relative, scale = {}, self.scale
        if self.relative_positions == "conformer_timing":  # the core takes q̃, scale κ
            q, relative = self._conformer(q, k.shape[-2])
            scale = 1.0 if self.key_scale is None else self.key_scale
        elif self.W_pos is not None:  # Transformer-XL: the core takes q + u, the position term
            q, relative = self._relative(q, k.shape[-2])
        if self.relative_key_table is not None:  # Shaw's: the position term, per block
            relative = self._shaw(q)
        o = scaled_dot_product_attention(
            q, k, v, head_mask, distance_bias=self._position_bias(q, k.shape[-2]), **relative,
            is_causal=self.causal, scale=scale, softcap=self.softcap,
            local_window_size=self.local_window_size, query_offset=offset,
            query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths, dropout_rate=rate,
            dropout_mask=dropout_mask, dropout_rng=self._dropout_key(dropout_mask),
            return_weights=return_weights, precision=self.precision, **self._extra())
        o, w = o if return_weights else (o, None)
        y = _merge_heads(self.out_proj, o, lambda m: self._output(m, x))  # (B, L, d_out)
        out = (y, w) if return_weights else y
        return out if cache is None else (out, cache)

    def _merged(self, x, q, k, v, context, head_mask, cache, lengths, run):
        """merged_context's attention, as torch_attn's: q (B, N, L, Dh) over [k ; k_c] and [v ;
        v_c], k_c and v_c the context's (B, Nkv, Lc, Dh) through W_key (k_norm, no RoPE) and
        W_value, or the cache's when context is None; the mask (merged_allowed) and the given
        one cover the L or M self keys, then the Lc context's; the cache a MergedCache. The
        keys are concatenated (one (L, Lk + Lc) mask): the core's "explicit" path's size."""
        (context, context_mask), (offset, q_lengths, kv_lengths) = context, lengths
        rate, dropout_mask, return_weights = run
        if context is None:
            k_c, v_c, context_mask = cache.context_key, cache.context_value, cache.context_mask
        else:
            k_c = self._split(self.W_key(context), self.num_kv_heads)  # (B, Nkv, Lc, Dh)
            k_c = self._norm(k_c, self.k_norm) if self.qk_norm is not None else k_c
            v_c = self._split(self.W_value(context), self.num_kv_heads)
            context_mask = (jnp.ones(context.shape[:-1], bool) if context_mask is None
                            else context_mask)
        if cache is not None:
            held = _append(KVCache(cache.key, cache.value, cache.lengths), k, v, q_lengths)
            cache = MergedCache(held.key, held.value, held.lengths, k_c, v_c, context_mask)
            k, v = held.key, held.value                         # (B, Nkv, M, Dh)
        allowed = merged_allowed(q.shape[-2], k.shape[-2], offset, kv_lengths, context_mask,
                                 self.merged_window, xp=jnp)  # (B, 1, L, Lk + Lc)
        if head_mask is not None:
            allowed = allowed & head_mask
        o = scaled_dot_product_attention(
            q, jnp.concatenate([k, k_c], -2), jnp.concatenate([v, v_c], -2), allowed,
            scale=self.scale, softcap=self.softcap, query_seq_lengths=q_lengths,
            dropout_rate=rate, dropout_mask=dropout_mask,
            dropout_rng=self._dropout_key(dropout_mask), return_weights=return_weights,
            precision=self.precision)
        o, w = o if return_weights else (o, None)
        y = _merge_heads(self.out_proj, o, lambda m: m)  # (B, L, d_out)
        out = (y, w) if return_weights else y
        return out if cache is None else (out, cache)

    def _output(self, merged, x):
        """The heads' output merged (B, L, N·Dh) through the output norm (in at least float32,
        rounded once) and the gate (golden.specification.outputs): σ in merged's dtype, softplus
        in at least float32 (as Hugging Face's Laguna)."""
        compute = jnp.promote_types(merged.dtype, jnp.float32)
        if self.output_norm is not None:
            w = (None if self.output_norm_weight is None
                 else self.output_norm_weight.get_value().astype(compute))
            merged = normalized_output(merged.astype(compute), self.output_norm, w,
                                       self.output_norm_eps, self.num_heads,
                                       mean=lambda a: a.mean(-1, keepdims=True),
                                       rsqrt=jax.lax.rsqrt).astype(merged.dtype)
        if self.W_gate is None:
            return merged
        return gated_output(merged, self.W_gate(x), self.gate, self.num_heads,
                            sigmoid=jax.nn.sigmoid, softplus=lambda z: jax.nn.softplus(
                                z.astype(compute)).astype(z.dtype))

    def _normed(self, q, k):
        """q and k through their QK norm before RoPE, then clamped with clip_qkv_after_norm."""
        q = self._norm(q, self.q_norm, bias=self.q_norm_bias)  # Chameleon's: with a bias
        k = self._norm(k, self.k_norm, bias=self.k_norm_bias)
        return (self._clip(q), self._clip(k)) if self.clip_after_norm else (q, k)

    def _clip(self, y):
        """MPT's and OLMo's clip_qkv: a projection clamped to [−c, c] (None: as it is; a
        kv_shared module's absent keys stay None)."""
        return y if self.clip_qkv is None or y is None else jnp.clip(y, -self.clip_qkv, self.clip_qkv)

    def _split(self, y, heads):
        """(B, L, heads·Dh) -> (B, heads, L, Dh) (the values' Dv alike; None stays None)."""
        if y is None:
            return None
        y = y.reshape(y.shape[:-1] + (heads, -1))  # (B, L, heads, Dh)
        return jnp.swapaxes(y, -2, -3)

    def _extra(self) -> dict:
        """The core's sinks and attention_chunk_size, when the module has them."""
        extra = {"sinks": None if self.sinks is None else self.sinks.get_value(),
                 "attention_chunk_size": self.attention_chunk_size}
        return {n: a for n, a in extra.items() if a is not None}

    def _norm(self, t, weight, kind=None, bias=None):
        """The QK norm of t (or ``kind``, "l2" for the value norm), plus ``bias`` when given
        ("layer_with_bias"), computed in at least float32 and rounded once to t's dtype (a
        kv_shared module's absent keys: None)."""
        if t is None:
            return None
        compute = jnp.promote_types(t.dtype, jnp.float32)
        w = None if weight is None else weight_broadcast(self.qk_norm,
                                                         weight.get_value().astype(compute))
        b = None if bias is None else weight_broadcast(self.qk_norm,
                                                       bias.get_value().astype(compute))
        return qk_normalize(t.astype(compute), kind or self.qk_norm, w, self.qk_norm_eps,
                            mean=lambda a: a.mean(-1, keepdims=True), rsqrt=jax.lax.rsqrt,
                            bias=b).astype(t.dtype)

    def _position_bias(self, q, keys):
        """ALiBi's or T5's bias as the core's ``distance_bias`` (N, 2S + 1), S = L + Lk (every
        distance j − p of the call, query i at p = i + offset, lies in −S … S), in at least
        float32; None without. The core forms it per block ("blockwise": O(L) memory) or as
        (L, Lk) terms ("explicit"). Both read the distance j − p in token order, as the mask
        (``positions`` move RoPE and the temperature, not these: on the pairs a left-padded or
        packed row attends, the two differ by a constant per sequence). ALiBi: m_h · (j − p),
        Falcon's added before the scale (times the scale, default 1/√Dh). T5: the learned
        table at the bucket of j − p (the buckets of every distance tabulated on the host)."""
        if self.alibi is None and self.relative_attention_bias is None:
            return None
        compute = jnp.promote_types(q.dtype, jnp.float32)
        span = keys + q.shape[-2]
        if self.relative_attention_bias is not None:
            table = bucket_table(span, not self.causal, *self.buckets)  # (2S + 1,) NumPy
            return self.relative_attention_bias.get_value().astype(compute)[table].T
        distance = jnp.arange(-span, span + 1, dtype=compute)  # (2S + 1,)
        bias = jnp.asarray(self.alibi_slopes, compute)[:, None] * distance  # (N, 2S + 1)
        if self.alibi == "falcon":
            bias = bias * (self.head_dim ** -0.5 if self.scale is None else self.scale)
        return bias

    def _relative(self, q, keys):
        """Transformer-XL's relative positions, as torch_attn's: the core's query q + u, and
        its ``distance_query`` scale · (q + v) (..., N, L, Dh) and ``distance_keys`` e =
        split(R W_pos) (N, 2S + 1, Dh) over the distances −S … S, S = Lk − 1, R the sinusoidal
        table (golden.specification.decoder.sinusoid_table) in the parameters' dtype, both in
        at least float32: the core adds (scale · (q_i + v))·e[S + j − p_i], query i at p_i =
        offset + i and key j in token order, per block in "blockwise" (O(L) memory)."""
        compute = jnp.promote_types(q.dtype, jnp.float32)
        scale = self.head_dim ** -0.5 if self.scale is None else self.scale
        qv = q.astype(compute) + self.bias_v.get_value().astype(compute)[:, None, :]
        u = self.bias_u.get_value().astype(q.dtype)[:, None, :]
        return q + u, {"distance_query": qv * scale,
                       "distance_keys": self._projected(sinusoid_table, keys, compute)}

    def _projected(self, table, keys, compute):
        """e = split(T W_pos) (N, 2S + 1, Dh) in ``compute`` over the distances −S … S, S = Lk −
        1: T (2S + 1, d_in) the ``table`` (golden.specification.decoder's sinusoid_table or
        timing_table) in the parameters' dtype."""
        t = jnp.asarray(table(self.d_in, keys - 1), self.W_pos.kernel.get_value().dtype)
        e = self.W_pos(t).astype(compute).reshape(2 * keys - 1, self.num_heads, -1)
        return jnp.swapaxes(e, 0, 1)  # (2S + 1, N, Dh) -> (N, 2S + 1, Dh)

    def _input_norm(self, x):
        """LayerNorm of x (..., L, d_in) over d_in, times input_norm_weight plus input_norm_bias,
        in at least float32 and rounded once to x's dtype."""
        compute = jnp.promote_types(x.dtype, jnp.float32)
        y = qk_normalize(x.astype(compute), "layer",
                         self.input_norm_weight.get_value().astype(compute), self.input_norm_eps,
                         mean=lambda a: a.mean(-1, keepdims=True), rsqrt=jax.lax.rsqrt)
        return (y + self.input_norm_bias.get_value().astype(compute)).astype(x.dtype)

    def _shaw(self, q):
        """Shaw's relative positions, as torch_attn's: the core's ``distance_query`` scale · q
        (..., N, L, Dh) and ``distance_keys`` the relative_key_table E (2M + 1, Dh) reversed,
        one for every head (N, 2M + 1, Dh), both in at least float32: the core adds (scale ·
        q_i)·E[M + clip(p_i − j, −M, M)] (row M + clip(j − p_i) of E reversed), query i at p_i
        = offset + i and key j in token order, per block in "blockwise": no (L, Lk) bias."""
        compute = jnp.promote_types(q.dtype, jnp.float32)
        table = self.relative_key_table.get_value().astype(compute)[::-1]  # key − query order
        scale = self.head_dim ** -0.5 if self.scale is None else self.scale
        return {"distance_query": q.astype(compute) * scale,
                "distance_keys": jnp.broadcast_to(table, (self.num_heads,) + table.shape)}

    def _conformer(self, q, keys):
        """The USM Conformer's relative positions (Gemma 3n's and Gemma 4's audio attention), as
        torch_attn's: the core's query q̃ = q ⊙ scale · softplus(per_dim_scale) / ln 2 (in q's
        dtype), its ``distance_query`` q̃ and ``distance_keys`` e = split(timing W_pos) (N,
        2S + 1, Dh) over the distances −S … S, S = Lk − 1, timing the signal of
        golden.specification.decoder.timing_table in the parameters' dtype, both in at least
        float32: the core adds q̃_i·e[S + j − p_i] to its raw scores (inside the cap), query i
        at p_i = offset + i and key j in token order, per block in "blockwise" (O(L)
        memory)."""
        compute = jnp.promote_types(q.dtype, jnp.float32)
        scale = self.head_dim ** -0.5 if self.scale is None else self.scale
        factor = jax.nn.softplus(self.per_dim_scale.get_value().astype(compute)) * (
            scale / math.log(2.0))  # (Dh,)
        q = (q.astype(compute) * factor).astype(q.dtype)
        return q, {"distance_query": q.astype(compute),
                   "distance_keys": self._projected(timing_table, keys, compute)}

    def _temperature(self, q, offset, positions):
        """q times the query temperature at each token's position (_query_temperature)."""
        return _query_temperature(self, q, offset, positions)


def _cache_positions(cache, length, query_seq_lengths):
    """(query offset, query lengths, key lengths) of a call of ``length`` tokens appended to
    ``cache``: row b's tokens at lengths[b] + i, the real ones (i < query_seq_lengths[b],
    clipped to [0, L]) counted, and of those only the ones that fit in max_length."""
    held, room = cache.lengths, cache.key.shape[2]
    new = (jnp.full_like(held, length) if query_seq_lengths is None
           else jnp.clip(query_seq_lengths.astype(held.dtype), 0, length))
    new = jnp.clip(new, 0, room - held)  # what does not fit is dropped
    return held, new, held + new


def _shared_positions(cache, length, query_seq_lengths):
    """(query offset, query lengths, key lengths) of a kv_shared call of ``length`` tokens on
    the storing layer's ``cache`` as its call on the same tokens returned it, as torch_attn's:
    row b's new[b] real tokens (query_seq_lengths clipped to [0, L], or L; at most lengths[b])
    at lengths[b] − new[b] + i, every held key 0 … lengths[b] − 1 attended."""
    held = cache.lengths
    new = (jnp.full_like(held, length) if query_seq_lengths is None
           else jnp.clip(query_seq_lengths.astype(held.dtype), 0, length))
    new = jnp.minimum(new, held)
    return held - new, new, held


def _refuse_own_cache(kv_shared):
    """init_cache of a kv_shared module: ValueError (it has no keys of its own)."""
    if kv_shared:
        raise ValueError("init_cache: a module with kv_shared=True has no keys or values of its "
                         "own to cache; make the storing layer's (store.init_cache) and pass it, "
                         "as the storing layer's call returned it, as cache=")


def _append(cache, k, v, new) -> KVCache:
    """A new cache: row b's first new[b] keys and values of this call (B, Nkv, L, Dh) written
    after its lengths[b] held ones, by one scatter; the others go to position M, out of range,
    and are dropped."""
    length, room = k.shape[2], cache.key.shape[2]
    i = jnp.arange(length)
    pos = jnp.where(i < new[:, None], cache.lengths[:, None] + i, room)  # (B, L)
    rows = jnp.arange(k.shape[0])[:, None]                               # (B, 1)
    key = cache.key.at[rows, :, pos].set(jnp.swapaxes(k, 1, 2), mode="drop")  # (B, L, Nkv, Dh)
    value = cache.value.at[rows, :, pos].set(jnp.swapaxes(v, 1, 2), mode="drop")
    return KVCache(key, value, cache.lengths + new)

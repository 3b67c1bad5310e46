"""GroupedQueryAttention, the twin of torch_attn.modules.grouped_query's: the decoder family and
its options, with a KV cache that is a pytree written by one scatter (``_cache_positions`` and
``_append``, which MultiHeadLatentAttention's latent cache shares) and ``strict`` read on the
host outside the compiled call; with ``index_blocks`` MiniMax M3's or Qwen4-Exp's block indexer
chooses the keys each query attends (``_blocks``). Shape legend as in jax_attn.modules; the
class docstring gives its own.
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
from golden.specification.indexer import (block_key_shape, check_index_cache,
                                          check_index_mask, check_key_indices,
                                          refuse_selection)
from golden.specification.outputs import (gate_has_bias, gate_kind, gated_output,
                                          normalized_output)
from golden.specification.positions import (ROPE_BLOCK, KVCache, MergedCache, check_fits,
                                            merged_allowed)
from golden.specification.validate import (
    cache_shape, check_cache, check_decoder_inputs, check_flags, check_positive_or_none,
    rope_arguments, rope_axis_count, rope_settings, rotary_dims,
)
from golden.specification.variants import VARIANTS
from jax_attn.functional import DEFAULT_PRECISION, scaled_dot_product_attention, takes_sparse
from jax_attn.modules.base import (_head_mask, _linear, _merge_heads, _query_temperature,
                                   _Variant, selection_allowed)
from jax_attn.rotary import rotary_embedding
from jax_attn.sparse import selected_mask


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

    The block indexer (``index_blocks`` "max", MiniMax M3's, or "mean", Qwen4-Exp's, and the
    other ``index_*`` options; golden.specification.indexer has the maths and the one selection
    rule, golden.reference.indexer the float64 reference): its parameters W_index_q (d_in,
    H_I·D_I), W_index_k (d_in, D_I) (``nnx.Linear``, no bias) and index_q_norm, index_k_norm
    (D_I,), in the neutral layout of export_params and load_params. Each query keeps whole
    blocks of b keys, chosen without gradient (``lax.stop_gradient``: the indexer's parameters
    get zero gradients) among the keys it may see (its mask, causal, the window, the chunks, the
    lengths), equal scores won by the lowest block index (stable sorts); the projections in x's
    dtype, norms, RoPE (the layer's, rotate-half, on the first rd features) and scores in at
    least float32. The choice reaches the core as its key_indices ("sparse") when it keeps k ≤
    Lk / SPARSE_UP_TO keys a row and no weights are asked (jax_attn.functional.takes_sparse),
    else as a mask ANDed into the call's: "max" one per KV group, repeated to its query heads
    (B, N, Lq, ·); "mean" one for every head (B, 1, Lq, ·). ``key_indices`` gives the choice
    instead (the indexer not run): "max" (B, N, Lq, k), k = min(index_topk_blocks · b, Lk),
    "mean" (B, Lq, k), k = min(index_topk_blocks · b + b − 1, Lk)
    (golden.specification.indexer.block_key_shape); ``return_key_indices=True`` appends
    the choice used, int32, to what the call returns: ``(y, key_indices)``, ``(y, weights,
    key_indices)`` with ``return_weights``. With a cache, ``index_key`` (B, M, D_I) holds each
    token's indexer key at its key's slot ("max": normed and turned; "mean": raw, pooled per
    query) and the choice runs over every held key; "mean" then takes no ``positions`` (a
    block's key turns at its first key's position, which the cache does not hold).
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
                 merged_context=False, index_blocks=None, index_heads=None, index_head_dim=None,
                 index_block_size=None, index_topk_blocks=None, index_local_blocks=0,
                 index_norm_eps=1e-6, *, rngs, precision=DEFAULT_PRECISION):
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
                        merged_context=merged_context, index_blocks=index_blocks,
                        index_heads=index_heads, index_head_dim=index_head_dim,
                        index_block_size=index_block_size, index_topk_blocks=index_topk_blocks,
                        index_local_blocks=index_local_blocks, index_norm_eps=index_norm_eps)
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
        self._init_blocks(rngs)

    def _init_blocks(self, rngs) -> None:
        """The block indexer's settings (static) and projections W_index_q (d_in, H_I·D_I),
        W_index_k (d_in, D_I) (no bias); None without index_blocks (its vectors index_q_norm,
        index_k_norm are made with the others)."""
        c = self.config
        self.index_blocks = c.get("index_blocks")
        self.index_heads, self.index_head_dim = c.get("index_heads"), c.get("index_head_dim")
        self.index_block_size = c.get("index_block_size")
        self.index_topk_blocks = c.get("index_topk_blocks")
        self.index_local_blocks = c.get("index_local_blocks", 0)
        self.index_norm_eps = c.get("index_norm_eps", 1e-6)
        self.index_rotary = (None if self.index_blocks is None  # rd, the features turned
                             else rotary_dims(self.head_dim, self.rotary))
        shapes = VARIANTS[self.variant].shapes(c)
        for n in ("W_index_q", "W_index_k"):
            setattr(self, n, None if n not in shapes else _linear(*shapes[n], False, rngs,
                                                                  self.precision))

    def init_cache(self, batch_size, max_length, dtype=None) -> KVCache:
        """An empty cache: key and value zeros (B, Nkv, max_length, Dh) in ``dtype`` (default the
        parameters'), lengths zeros (B,) int32; with index_blocks index_key zeros (B,
        max_length, index_head_dim). A ``kv_shared`` module has no keys of its own to cache: it
        raises ValueError (make the storing layer's)."""
        _refuse_own_cache(self.kv_shared)
        shape = cache_shape(batch_size, max_length, self.num_kv_heads, self.head_dim)
        dtype = self.W_query.kernel.get_value().dtype if dtype is None else dtype
        kind = MergedCache if self.merged_context else KVCache  # merged: no context yet
        cache = kind(jnp.zeros(shape, dtype), jnp.zeros(shape[:-1] + (self.v_head_dim,), dtype),
                     jnp.zeros((batch_size,), jnp.int32))
        if self.index_blocks is None:
            return cache
        return cache._replace(index_key=jnp.zeros((batch_size, max_length,
                                                   self.index_head_dim), dtype))

    def __call__(self, x, mask=None, *, cache=None, query_seq_lengths=None, positions=None,
                 dropout_mask=None, return_weights=False, strict=False, max_position=None,
                 context=None, context_mask=None, key_indices=None, return_key_indices=False):
        check_flags(strict=strict, return_key_indices=return_key_indices)
        check_positive_or_none("max_position", max_position)
        self._check_blocks(x, mask, cache, positions, key_indices, return_key_indices)
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
                          context=context, context_mask=context_mask, key_indices=key_indices,
                          return_key_indices=return_key_indices)

    def _check_blocks(self, x, mask, cache, positions, key_indices, return_key_indices) -> None:
        """The block indexer's arguments, on the host (shapes only, and a given selection's
        values when concrete): none without index_blocks; a mask with no head axis (or one of
        size 1); positions of one axis, and none with a cache for "mean" (the cached blocks'
        first keys' positions are not held); ``key_indices`` integers of block_key_shape's
        shape in [0, Lk)."""
        if self.index_blocks is None:
            refuse_selection("index_blocks", key_indices, return_key_indices)
            return
        lead = tuple(np.shape(x))[:-2]
        check_index_mask(mask, lead, "index_blocks")
        if positions is not None and np.ndim(positions) == np.ndim(x):
            raise ValueError(f"positions should be (L,) or (B, L) with index_blocks (the indexer "
                             f"turns by one position per token), got multimodal positions of "
                             f"shape {tuple(np.shape(positions))}")
        if positions is not None and cache is not None and self.index_blocks == "mean":
            raise ValueError(f"positions should be None with index_blocks = 'mean' and a "
                             f"cache (a block's key turns at its first key's position, which "
                             f"the cache does not hold: its slots are the positions), got shape "
                             f"{tuple(np.shape(positions))}")
        if key_indices is None:
            return
        lq = np.shape(x)[-2]
        lk = lq if cache is None else check_cache(cache, x, self.num_kv_heads, self.head_dim,
                                                  self.v_head_dim)
        want = block_key_shape(self.config, lead + (self.num_heads, lq, lk))
        if isinstance(key_indices, jax.core.Tracer):  # shape and dtype only: values unknown
            key_indices = np.broadcast_to(np.zeros((), key_indices.dtype), key_indices.shape)
        check_key_indices(key_indices, want[:-2], lq, lk, want[-1])

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

    @nnx.jit(graph=False, static_argnames=("return_weights", "max_position",
                                           "return_key_indices"))
    def _call(self, x, mask=None, *, cache=None, query_seq_lengths=None, positions=None,
              dropout_mask=None, return_weights=False, max_position=None, context=None,
              context_mask=None, key_indices=None, return_key_indices=False):
        rate = self._rate()
        check_decoder_inputs(x, self.d_in, mask, dropout_mask, query_seq_lengths,
                             heads=self.num_heads, rate=rate, cache=cache,
                             kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                             value_dim=self.v_head_dim,
                             positions=positions, axes=rope_axis_count(self.rotary),
                             temperature=self.query_temperature is not None,
                             kv_shared=self.kv_shared, merged=self.merged_context,
                             context=context, context_mask=context_mask)
        if cache is not None and self.index_blocks is not None:
            check_index_cache(cache, self.index_head_dim, x.dtype, option="index_blocks")
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
        bound = x.shape[-2] if cache is None else cache.key.shape[2] + x.shape[1]
        bound = max(bound, max_position or 0)  # positions past the call's tokens (video)
        if self.rotary is not None:
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
        before = cache  # the call's cache (the block indexer's keys appended to it below)
        if cache is not None:  # kv_shared: the storing layer's cache read, not written
            cache = cache if self.kv_shared else _append(cache, k, v, q_lengths)
            k, v = cache.key, cache.value                     # (B, Nkv, M, Dh)
        head_mask = _head_mask(mask, x)  # (B, 1 or N, L, Lk)
        chosen = {}  # the block indexer's choice as the core's key_indices, when sparse pays
        if self.index_blocks is not None:  # else ANDed into the mask
            key_indices, cache = self._blocks(
                x, mask, (before, cache), key_indices,
                (offset, positions, bound, q_lengths, kv_lengths))
            core = key_indices if self.index_blocks == "max" else key_indices[..., None, :, :]
            if takes_sparse(key_indices.shape[-1], k.shape[-2], return_weights):
                chosen = {"key_indices": core}  # "max" (B, N, Lq, k), "mean" (B, 1, Lq, k)
            else:  # (B, N or 1, Lq, Lk)
                head_mask = selected_mask(core, head_mask, k.shape[-2])
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
            return_weights=return_weights, precision=self.precision, **self._extra(), **chosen)
        o, w = o if return_weights else (o, None)
        y = _merge_heads(self.out_proj, o, lambda m: self._output(m, x))  # (B, L, d_out)
        out = ((y, w) if return_weights else (y,)) + (
            (key_indices,) if return_key_indices else ())
        out = out if len(out) > 1 else y
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
        if self.clip_qkv is None or y is None:
            return y
        return jnp.clip(y, -self.clip_qkv, self.clip_qkv)

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

    # ---- the block indexer (MiniMax M3's "max", Qwen4-Exp's "mean") ---------------------------

    def _blocks(self, x, mask, caches, key_indices, where):
        """(key_indices int32, "max" (B, N, Lq, k), "mean" (B, Lq, k); the cache): the given or
        chosen keys (the reference's block_keys), the indexer's keys appended to the cache's
        index_key at their tokens' slots. The caller ANDs the choice into the core's mask as the
        reference's _block_mask, or hands it to the core as key_indices. No gradient reaches the
        indexer (lax.stop_gradient)."""
        (before, cache), (offset, positions, bound, q_lengths, kv_lengths) = caches, where
        x = jax.lax.stop_gradient(x)
        pos = positions
        if pos is None:
            pos = jnp.arange(x.shape[-2])                            # (L,)
            pos = pos if offset is None else pos + offset[:, None]  # (B, L)
        pos = jnp.asarray(pos, jnp.int32)
        keys = self._index_key(x, pos, bound)                        # (B, L, D_I)
        if before is not None:
            keys = _append_rows(before.index_key, keys, before.lengths, q_lengths)
            cache = cache._replace(index_key=keys)                   # (B, M, D_I)
        if key_indices is None:
            lk = keys.shape[-2]
            allowed = self._allowed(mask, x.shape[:-2] + (x.shape[-2], lk), offset, q_lengths,
                                    kv_lengths)                      # (B, Lq, Lk)
            q = self._index_query(x, pos, bound)                     # (B, H_I, Lq, D_I)
            if self.index_blocks == "max":
                key_indices = jnp.repeat(self._max_blocks(q, keys, allowed, pos),
                                         self.num_heads // self.index_heads, axis=-3)
            else:
                key_pos = pos if before is None else jnp.arange(lk)  # (B, Lk) or (M,)
                key_indices = self._mean_blocks(q, keys, allowed, key_pos, bound)
        return jax.lax.stop_gradient(jnp.asarray(key_indices, jnp.int32)), cache

    def _index_query(self, x, pos, bound):
        """q^I (B, H_I, L, D_I) = RMS(x W_index_q)·index_q_norm per head, turned at ``pos``."""
        q = self.W_index_q(x)                                        # (B, L, H_I·D_I)
        q = q.reshape(q.shape[:-1] + (self.index_heads, self.index_head_dim))
        q = self._index_norm(jnp.swapaxes(q, -2, -3), self.index_q_norm)  # (B, H_I, L, D_I)
        return self._index_turn(q, pos[..., None, :], bound)

    def _index_key(self, x, pos, bound):
        """The indexer's keys (B, L, D_I) as the cache holds them: "max" RMS(x W_index_k)·
        index_k_norm turned at ``pos``, "mean" x W_index_k raw (pooled per query later)."""
        k = self.W_index_k(x)
        if self.index_blocks == "max":
            k = self._index_turn(self._index_norm(k, self.index_k_norm), pos, bound)
        return jax.lax.stop_gradient(k)

    def _index_norm(self, t, weight):
        """RMSNorm of t over its last axis times ``weight`` (ε index_norm_eps), in at least
        float32, rounded once to t's dtype."""
        compute = jnp.promote_types(t.dtype, jnp.float32)
        return qk_normalize(t.astype(compute), "rms", weight.get_value().astype(compute),
                            self.index_norm_eps, mean=lambda a: a.mean(-1, keepdims=True),
                            rsqrt=jax.lax.rsqrt).astype(t.dtype)

    def _index_turn(self, t, pos, bound):
        """t (..., D_I) with its first rd features turned by the layer's RoPE (rotate-half) at
        the integer positions ``pos`` (broadcast to t's (...)): every vector as one token of a
        flat sequence (P, Dh), its rd features first and zeros after (rotary_embedding turns
        the first rd of Dh)."""
        rd, shape = self.index_rotary, t.shape
        flat = t.reshape(-1, shape[-1])                              # (P, D_I)
        wide = jnp.concatenate([flat[:, :rd], jnp.zeros((flat.shape[0], self.head_dim - rd),
                                                        t.dtype)], -1)  # (P, Dh)
        turned = rotary_embedding(wide, positions=jnp.broadcast_to(pos, shape[:-1]).reshape(-1),
                                  max_position=bound, **rope_arguments(self.rotary))
        return jnp.concatenate([turned[:, :rd], flat[:, rd:]], -1).reshape(shape)

    def _allowed(self, mask, shape, offset, q_lengths, kv_lengths):
        """selection_allowed with the layer's causality, sliding window and chunks."""
        return selection_allowed(mask, shape, offset, q_lengths, kv_lengths,
                                 causal=self.causal,
                                 window=self.local_window_size or (None, None),
                                 chunk=self.attention_chunk_size)

    def _max_blocks(self, q, k, allowed, pos):
        """MiniMax M3's choice (B, H_I, Lq, k), k = min(index_topk_blocks · b, Lk)
        (golden.reference.indexer.max_block_keys): block m's score the max of q·k over its keys
        the query may see (in at least float32; the keys it may not see at the least score of
        all, as the reference); the index_local_blocks blocks q_b, q_b − 1, … (q_b = pos // b,
        clipped at 0) kept, then the best blocks with a visible key."""
        b, n, lk = self.index_block_size, self.index_topk_blocks, k.shape[-2]
        blocks = -(-lk // b)
        compute = jnp.promote_types(q.dtype, jnp.float32)
        s = jnp.einsum("...htd,...sd->...hts", q.astype(compute), k.astype(compute),
                       precision=self.precision)                     # (B, H_I, Lq, Lk)
        low = s.min()  # below every score: the reference's fill for keys not seen
        seen = allowed[..., None, :, :]                              # (B, 1, Lq, Lk)
        pad = [(0, 0)] * (s.ndim - 1) + [(0, blocks * b - lk)]
        s = jnp.pad(jnp.where(seen, s, low), pad, constant_values=low)
        scores = s.reshape(s.shape[:-1] + (blocks, b)).max(-1)      # (B, H_I, Lq, M)
        seen = jnp.pad(seen, pad)
        has = seen.reshape(seen.shape[:-1] + (blocks, b)).any(-1)    # (B, 1, Lq, M)
        q_block = jnp.broadcast_to(pos, allowed.shape[:-1])[..., None] // b  # (B, Lq, 1)
        local = jnp.zeros(allowed.shape[:-1] + (blocks,), bool)     # (B, Lq, M)
        for i in range(self.index_local_blocks):
            local = local | (jnp.arange(blocks) == jnp.clip(q_block - i, 0, blocks - 1))
        local = jnp.broadcast_to(local[..., None, :, :], scores.shape)
        eligible = has | local
        order = _order(scores, local, eligible)[..., :min(n, blocks)]   # (B, H_I, Lq, n')
        taken = jnp.take_along_axis(eligible, order, axis=-1)
        slots = (order[..., None] * b + jnp.arange(b)).reshape(order.shape[:-1] + (-1,))
        valid = jnp.repeat(taken, b, axis=-1) & (slots < lk)        # (B, H_I, Lq, n'·b)
        return _compact(slots, valid, min(n * b, lk))

    def _mean_blocks(self, q, raw, allowed, key_pos, bound):
        """Qwen4-Exp's choice (B, Lq, k), k = min(index_topk_blocks · b + b − 1, Lk)
        (golden.reference.indexer.mean_block_keys): each query's visible keys, in order, cut
        into complete blocks of b (C of them at most, C = Lk // b; vis (B, Lq, Lk) the visible
        keys first), each block's raw keys summed in order (a loop of b steps, each over every
        block and query) and divided by b, normed, turned at its first key's position
        ``key_pos`` and scored Σ_h ReLU(q·key)/√D_I (in at least float32); the best
        index_topk_blocks blocks kept, and the tail."""
        b, n, lk = self.index_block_size, self.index_topk_blocks, raw.shape[-2]
        count = allowed.sum(-1)                                      # (B, Lq)
        complete = count // b
        vis = jnp.argsort(~allowed, axis=-1, stable=True)           # (B, Lq, Lk)
        most = lk // b
        slots, valid = [], []
        if most:  # a row may hold a complete block
            compute = jnp.promote_types(q.dtype, jnp.float32)
            raw = raw.astype(compute)[..., None, :, :]               # (B, 1, Lk, D_I)
            starts = jnp.arange(most) * b                            # (C,)

            def add(r, total):  # each block's r-th key, every block at once, in order
                at = jnp.take(vis, starts + r, axis=-1)              # (B, Lq, C)
                return total + jnp.take_along_axis(raw, at[..., None], axis=-2)
            pooled = jax.lax.fori_loop(0, b, add, jnp.zeros(
                vis.shape[:-1] + (most, raw.shape[-1]), compute)) / b  # (B, Lq, C, D_I)
            first = jnp.take_along_axis(jnp.broadcast_to(key_pos[..., None, :], allowed.shape),
                                        vis[..., 0:most * b:b], axis=-1)  # (B, Lq, C)
            keys = self._index_turn(self._index_norm(pooled, self.index_k_norm), first, bound)
            dot = jnp.einsum("...htd,...tcd->...thc", q.astype(compute), keys,
                             precision=self.precision)               # (B, Lq, H_I, C)
            scores = jnp.where(dot > 0, dot, 0).sum(-2) * (1 / np.sqrt(q.shape[-1]))
            eligible = jnp.arange(most) < complete[..., None]        # (B, Lq, C)
            order = _order(scores, jnp.zeros_like(eligible), eligible)[..., :min(n, most)]
            at = (order[..., None] * b + jnp.arange(b)).reshape(order.shape[:-1] + (-1,))
            slots.append(jnp.take_along_axis(vis, at, axis=-1))      # (B, Lq, n'·b)
            valid.append(jnp.repeat(jnp.take_along_axis(eligible, order, axis=-1), b, axis=-1))
        tail = complete[..., None] * b + jnp.arange(b - 1)          # (B, Lq, b − 1)
        slots.append(jnp.take_along_axis(vis, jnp.minimum(tail, lk - 1), axis=-1))
        valid.append(tail < count[..., None])
        return _compact(jnp.concatenate(slots, -1), jnp.concatenate(valid, -1),
                        min(n * b + b - 1, lk))


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


def _append_rows(held, new, lengths, count):
    """``held`` (B, M, D) with row b's first count[b] of ``new`` (B, L, D) written after its
    lengths[b] tokens, by one scatter (as _append; those that do not fit are dropped)."""
    i = jnp.arange(new.shape[1])
    pos = jnp.where(i < count[:, None], lengths[:, None] + i, held.shape[1])  # (B, L)
    rows = jnp.arange(new.shape[0])[:, None]                                 # (B, 1)
    return held.at[rows, pos].set(new.astype(held.dtype), mode="drop")


def _order(scores, kept, eligible):
    """Block indices (..., M) in the order they are taken (golden.reference.indexer._order): the
    ``kept`` ones first, then the ``eligible`` ones, each by score, highest first, equal scores
    by lowest index, then the rest. Two stable sorts: by score (the others tied at 0), then by
    rank."""
    by_score = jnp.argsort(jnp.where(eligible, -scores, 0), axis=-1, stable=True)
    rank = jnp.where(kept, 0, jnp.where(eligible, 1, 2))
    ranked = jnp.take_along_axis(rank, by_score, axis=-1)
    return jnp.take_along_axis(by_score, jnp.argsort(ranked, axis=-1, stable=True), axis=-1)


def _compact(slots, valid, k):
    """key_indices (..., k) int32: the ``valid`` ones of ``slots`` (..., S) in order, the rest
    of the k places repeating the first (0 if none) (golden.reference.indexer._fill)."""
    order = jnp.argsort(~valid, axis=-1, stable=True)[..., :k]
    slots = jnp.take_along_axis(slots, order, axis=-1)
    valid = jnp.take_along_axis(valid, order, axis=-1)
    first = jnp.where(valid[..., :1], slots[..., :1], 0)
    return jnp.where(valid, slots, first).astype(jnp.int32)

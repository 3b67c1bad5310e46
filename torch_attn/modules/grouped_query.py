"""GroupedQueryAttention, the decoder family (Llama, Mistral, Qwen, Gemma and their successors):
query heads over fewer key-value heads, RoPE, the QK norms, sinks, chunks, the query
temperature, the output gate, ALiBi, T5's buckets and Transformer-XL's relative positions, and
its functional KV cache:
``_cache_positions`` and ``_append``, which MultiHeadLatentAttention's latent cache shares.
Shape legend as in torch_attn.modules; the class docstring gives its own (Nkv key-value heads,
M the cache's max_length).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from golden.specification import variants
from golden.specification.decoder import (
    alibi_bias, alibi_slopes, bucket_table, qk_normalize, refuse_renamed, relative_bias,
    sinusoid_table, sliding_window, timing_table, weight_broadcast,
)
from golden.specification.indexer import (block_key_shape, check_index_cache,
                                          check_index_mask, check_key_indices,
                                          refuse_selection)
from golden.specification.outputs import (gate_has_bias, gate_kind, gated_output,
                                          normalized_output)
from golden.specification.positions import (KVCache, MergedCache, check_fits, distance_index,
                                            merged_allowed, rope_turn)
from golden.specification.validate import (
    cache_shape, check_decoder_inputs, check_flags, check_positive_or_none, rope_arguments,
    rope_axis_count,
    rope_settings, rotary_dims, window,
)
from torch_attn.block_indexer import max_block_keys, mean_block_keys
from torch_attn.explicit import LOW_PRECISION, Where, grouped_matmul
from torch_attn.functional import scaled_dot_product_attention, takes_sparse
from torch_attn.modules.base import _config, _dropout_rate, _head_mask, _query_temperature
from torch_attn.rotary import rotary_cos_sin, rotary_embedding
from torch_attn.sparse import selected_mask


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
    included: the core's window (W − 1, 0)); ``qk_norm`` (golden.specification.variants.QK_NORMS:
    "rms" Qwen3, "rms_one_plus" Gemma 3, "rms_across_heads" OLMo 2, "layer" Cohere,
    "layer_with_bias" Chameleon (its biases q_norm_bias, k_norm_bias), "l2" Llama 4, with
    ``qk_norm_eps``); ``sinks`` (GPT-OSS: a learned logit per head in every softmax);
    ``attention_chunk_size`` C (Llama 4: a query sees the keys of its own chunk of C positions);
    ``query_temperature`` {"beta", "floor_scale", "shift"} (Llama 4's NoPE layers: q · (1 + β·ln(1 +
    ⌊(p + shift)/F⌋))); ``output_gate`` (Qwen3-Next: the heads' output times σ(x W_gate + b_gate)
    before out_proj); ``alibi`` ("bloom", "mpt" with ``alibi_bias_max``, "falcon") and T5's
    ``relative_attention_num_buckets`` (a learned bias per bucket of key − query distance,
    ``relative_attention_max_distance``; ``relative_attention_buckets`` "t5" or Phi-4 audio's
    "clipped" / "clipped_symmetric" distances, golden.specification.decoder.
    relative_position_bucket); ``clip_qkv`` c (MPT, OLMo: q, k and v clamped to [−c, c]
    after their projections); ``v_norm`` (Gemma 4: each value head v / √(mean(v²) + ε), no
    weight, ε = ``qk_norm_eps``; the cache holds the normed values); ``k_eq_v`` (Gemma 4's full
    layers: no value projection, the values are the key projection's heads, before k's norm and
    RoPE: with ``v_norm``, V = the weightless norm of x W_key);
    ``relative_positions="transformer_xl"`` (Transformer-XL's, as NVIDIA's FastConformer
    encoders have it: Parakeet, Canary; learned bias_u and bias_v (N, Dh) and W_pos (d_in,
    N·Dh), scores scale · ((q_i + u)·k_j + (q_i + v)·r(j − p)), r(d) the head's slice of W_pos
    applied to the sinusoidal encoding of the distance query − key = −d,
    golden.specification.decoder.sinusoid_table; q after RoPE, the QK norm and the temperature);
    ``relative_positions="shaw"`` with ``relative_max_distance`` M (Shaw et al.'s relative key
    embeddings, as IBM's Granite Speech Conformer has them: one learned relative_key_table E
    (2M + 1, Dh) shared by the heads, the scores gain scale · q_i·E[M + clip(p − j, −M, M)],
    query at p, key j; Granite's blocks of C frames are ``attention_chunk_size`` C with
    ``causal=False``); ``input_norm="layer"`` (Granite Speech's pre_norm inside its attention:
    LayerNorm of x over d_in, input_norm_weight and input_norm_bias (d_in,), ε =
    ``input_norm_eps``, before every projection);
    ``relative_positions="conformer_timing"`` (the USM Conformer's, as Gemma 3n's and Gemma 4's
    audio encoders have it: learned per_dim_scale w (Dh,) and W_pos (d_in, N·Dh), q̃ = q ⊙ scale ·
    softplus(w)/ln 2, scores κ q̃_i·k_j + q̃_i·E(p − j), E(t) the head's slice of W_pos applied to
    the timing signal of the query − key distance t, golden.specification.decoder.timing_table;
    ``key_scale`` κ, Gemma 4's ln(1 + e)/ln 2, default 1; with ``causal=False`` a
    ``sliding_window`` pair (left, right) is its context: keys p − left … p + right). Either
    relative term (these two, Transformer-XL's, Shaw's) is part of the raw scores, inside the
    ``softcap`` (``_inside_cap``). The output stage and the options of issue 42
    (golden.specification.outputs, .temperature; docs/modules.md's table): ``output_gate`` also
    "sigmoid_per_head", "softplus", "softplus_per_head", with ``gate_bias``; ``output_norm``
    "rms" (over N·Dh, output_norm_weight) or "rms_per_head" before the gate;
    ``query_temperature`` of kind "power", "log" or "learned" (temperature_scale,
    temperature_bias); ``qk_norm="rms_after_rope"``; ``v_head_dim`` Dv and ``value_scale``;
    ``clip_qkv_after_norm`` (OLMoE).

    With ``cache`` (from ``init_cache``), token i of row b is at position
    cache.lengths[b] + i: its key and value are written there, it attends the cached keys and
    this call's (bottom-right causal), RoPE turns it by that position, and the call returns
    (output, new cache); the cache given is left as it was. Tokens that do not fit in
    max_length are dropped, as in jax_attn: they are not written nor counted, and their output
    rows are those of padding; query_seq_lengths are clipped to [0, L]. ``strict=True`` raises
    ValueError instead (golden.specification.positions.check_fits; it reads the lengths: a device
    sync). Explicit ``positions`` may reach past the call's tokens (a video's multimodal
    positions): RoPE's tables then reach their largest + 1 (read on the host: a device sync), or
    ``max_position`` when larger.

    ``kv_shared=True`` (Gemma 4's and Gemma 3n's last ``num_kv_shared_layers`` layers): no W_key,
    b_key, W_value, b_value nor k_norm; the module attends with another, storing layer's keys and
    values. It must be called with ``cache=`` the storing layer's cache as that layer's call on
    the same tokens returned it (``_, kv = store(x, cache=kv)``; for a forward without
    decoding, ``kv = store.init_cache(B, L)`` first), which it reads and never writes: its new
    queries (query_seq_lengths clipped, or L) sit at lengths − new + i and see keys 0 …
    lengths − 1; it returns (output, the same cache). Without a cache it raises ValueError, and
    so does ``init_cache``. k_eq_v, v_norm and value_scale describe the storing layer and are
    refused here; num_kv_heads, head_dim and v_head_dim are checked against the cache's shape.
    ``strict`` checks nothing for it (it writes nothing).

    ``merged_context=True`` (T5Gemma 2's decoder, T5Gemma2MergedAttention): the call takes
    ``context`` (B, Lc, d_in) and ``context_mask`` (B, Lc) bool (True = a real token; None: all
    real); the context's keys k_norm(split(context W_key + b_key)) (no RoPE) and its values
    split(context W_value + b_value) follow x's own keys and values, and ONE softmax runs over
    the L (or M) + Lc keys: self key j of query i at p when j ≤ p, p − j < W (sliding_window)
    and j is held, context key t when context_mask[t] (golden.specification.positions.
    merged_allowed); ``mask``, ``dropout_mask`` and the weights are (B, N, L, L or M + Lc).
    ``init_cache`` then gives a MergedCache: the first call given ``context`` stores the
    context's keys, values and mask in it (Hugging Face's cross-attention cache), later calls
    may omit ``context`` and read them. Causal only; options without a tested meaning here are
    refused (golden.specification.variants.MERGED_IDLE).

    ``index_blocks`` (issue 44 part 4; the options and the rule are golden.specification.
    indexer's, the maths golden.reference.indexer's): each query attends whole blocks of
    ``index_block_size`` b keys chosen by a small scorer, ``index_topk_blocks`` of them.
    "max" (MiniMax M3): q^I = RMS(x W_index_q) · index_q_norm (B, H_I, L, D_I), k^I =
    RMS(x W_index_k) · index_k_norm (B, L, D_I), both turned by the layer's RoPE (rotate-half,
    its rotary features, at the tokens' positions); a block's score the max of q^I · k^I over
    its keys the query may see; ``index_local_blocks`` blocks at the query's own position kept
    first; one choice per KV group (H_I = Nkv), repeated to its query heads. "mean" (Qwen4-Exp):
    each query's visible keys cut into complete blocks of b, each block's key RMS(mean of its
    x W_index_k) · index_k_norm turned at its first key's position, scored Σ_h ReLU(q^I · key)
    / √D_I, the best kept and the tail (the last < b visible keys); one choice for every head.
    Equal scores: the lowest block index (stable sorts). The choice runs under no_grad (its
    parameters get no gradient), in at least float32, among the keys each query may see (the
    mask, causal, window, chunk, lengths), vectorised (torch_attn.block_indexer), and reaches
    the core as its key_indices ("sparse") when it keeps k ≤ Lk / SPARSE_UP_TO keys a row and
    no weights are asked (torch_attn.functional.takes_sparse), else as its mask ANDed with the
    chosen keys. ``key_indices=`` gives the choice instead,
    ``return_key_indices=True`` returns it (forward). The cache keeps the indexer's keys as
    ``index_key`` (B, M, D_I): "max" normed and turned, "mean" raw (so "mean" with a cache
    takes no explicit ``positions``: a block's first key is at its slot). Not built beside
    ``kv_shared`` or ``merged_context``.
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
                 index_norm_eps=1e-6):
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
                              index_block_size=index_block_size,
                              index_topk_blocks=index_topk_blocks,
                              index_local_blocks=index_local_blocks,
                              index_norm_eps=index_norm_eps)
        self.merged_context = merged_context
        self.clip_qkv, self.v_norm, self.kv_shared = clip_qkv, v_norm, kv_shared
        self.clip_after_norm = clip_qkv_after_norm  # OLMoE: q and k clamped after their norm
        self.rotary = rope_settings(rope_theta, rope_parameters, partial_rotary_factor,
                                    rope_precision)  # None without RoPE
        self.d_in, self.num_heads, self.num_kv_heads = d_in, num_heads, num_kv_heads
        self.head_dim = variants.head_dim(self.config)
        self.v_head_dim, self.value_scale = variants.value_dim(self.config), value_scale
        self.causal, self.scale, self.softcap = causal, scale, softcap
        self.sliding_window, self.dropout = sliding_window, dropout
        self.rope_theta, self.rope_interleaved = rope_theta, rope_interleaved
        self.qk_norm, self.qk_norm_eps = qk_norm, qk_norm_eps
        self.attention_chunk_size, self.query_temperature = attention_chunk_size, query_temperature
        self.alibi, self.relative_positions, self.key_scale = alibi, relative_positions, key_scale
        self.alibi_slopes = None if alibi is None else tuple(
            alibi_slopes(num_heads, alibi, alibi_bias_max).tolist())  # (N,), float64 values
        width = num_heads * self.head_dim
        self.W_query = nn.Linear(d_in, width, bias=qkv_bias)
        self.W_key = None if kv_shared else nn.Linear(  # kv_shared: the storing layer's keys
            d_in, num_kv_heads * self.head_dim, bias=qkv_bias)
        self.W_value = None if k_eq_v or kv_shared else nn.Linear(  # k_eq_v: V is K's projection
            d_in, num_kv_heads * self.v_head_dim, bias=qkv_bias)
        values = num_heads * self.v_head_dim  # N·Dv: the heads' output
        self.gate = gate_kind(output_gate)  # (activation, per head) or None
        self.output_norm, self.output_norm_eps = output_norm, output_norm_eps
        self.W_gate = None if self.gate is None else nn.Linear(
            d_in, num_heads if self.gate[1] else values, bias=gate_has_bias(self.config))
        self.out_proj = nn.Linear(values, d_in if d_out is None else d_out, bias=out_bias)
        self.W_pos = (nn.Linear(d_in, width, bias=False)
                      if relative_positions in ("transformer_xl", "conformer_timing") else None)
        self.buckets = (relative_attention_num_buckets, relative_attention_max_distance,
                        relative_attention_buckets)
        self.input_norm_eps = input_norm_eps  # Granite's pre_norm: LayerNorm(d_in)
        starts = variants.vector_starts(self.variant, self.config)  # each at its no-op value
        for n in variants.VARIANTS[self.variant].vectors:  # None where the config has none
            setattr(self, n, nn.Parameter(torch.full(*starts[n])) if n in starts else None)
        shapes = variants.get(self.variant).shapes(self.config)  # the block indexer's, if any
        for n in ("W_index_q", "W_index_k"):
            setattr(self, n, nn.Linear(*shapes[n], bias=False) if n in shapes else None)
        self.index_blocks = index_blocks  # its options are self.config's

    def init_cache(self, batch_size, max_length, dtype=None) -> KVCache:
        """An empty cache: key and value zeros (B, Nkv, max_length, Dh) in ``dtype`` (default the
        parameters'), lengths zeros (B,) int32, on the parameters' device; with the block indexer
        (``index_blocks``) also index_key zeros (B, max_length, index_head_dim) (its keys: "max"
        normed and turned, "mean" raw), else None. A ``kv_shared`` module has no keys of its
        own to cache: it raises ValueError (make the storing layer's)."""
        _refuse_own_cache(self.kv_shared)
        shape = cache_shape(batch_size, max_length, self.num_kv_heads, self.head_dim)
        dtype = self.W_query.weight.dtype if dtype is None else dtype
        device = self.W_query.weight.device
        kind = MergedCache if self.merged_context else KVCache  # merged: no context yet
        cache = kind(torch.zeros(shape, dtype=dtype, device=device),
                     torch.zeros(shape[:-1] + (self.v_head_dim,), dtype=dtype, device=device),
                     torch.zeros(batch_size, dtype=torch.int32, device=device))
        if self.W_index_k is None:
            return cache
        return cache._replace(index_key=torch.zeros(
            batch_size, max_length, self.W_index_k.out_features, dtype=dtype, device=device))

    def forward(self, x, mask=None, *, cache=None, query_seq_lengths=None, positions=None,
                dropout_mask=None, return_weights=False, strict=False, max_position=None,
                context=None, context_mask=None, key_indices=None, return_key_indices=False):
        """The layer (see the class docstring). With the block indexer (``index_blocks``):
        ``key_indices`` gives the keys each query attends (the indexer is not run: the
        given-selection mode), integers in [0, Lk) of shape (B, N, Lq, k) for "max" (k =
        min(index_topk_blocks · b, Lk)) or (B, Lq, k) for "mean" (k = min(index_topk_blocks
        · b + b − 1, Lk)), unbatched without B; ``return_key_indices=True`` appends the keys
        used, int32, to what is returned: (y, key_indices) or (y, weights, key_indices), then
        (that, cache) with a cache."""
        rate = _dropout_rate(self)
        check_decoder_inputs(x, self.d_in, mask, dropout_mask, query_seq_lengths,
                             heads=self.num_heads, rate=rate, cache=cache,
                             kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                             value_dim=self.v_head_dim,
                             positions=positions, axes=rope_axis_count(self.rotary),
                             temperature=self.query_temperature is not None,
                             kv_shared=self.kv_shared, merged=self.merged_context,
                             context=context, context_mask=context_mask)
        check_flags(strict=strict, return_key_indices=return_key_indices)
        self._check_block_call(x, mask, cache, positions, key_indices, return_key_indices)
        if positions is not None and positions.ndim == 2 and x.ndim == 2:  # unbatched (A, L)
            positions = positions[:, None]  # -> (3, 1, L): one row per axis against (N, L, Dh)
        check_positive_or_none("max_position", max_position)
        if strict and cache is not None and not self.kv_shared:  # reads the lengths: a sync
            new = x.shape[-2] if query_seq_lengths is None else query_seq_lengths
            check_fits(cache.lengths.cpu().numpy(), torch.as_tensor(new).cpu().numpy(),
                       cache.key.shape[2], x.shape[-2])
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
        bound = None  # RoPE's tables reach (0 … bound − 1)
        if self.rotary is not None:
            bound = x.shape[-2] if cache is None else cache.key.shape[2] + x.shape[1]
            if positions is not None:  # positions past the call's tokens (video): a host read
                bound = max(bound, int(positions.abs().max()) + 1)
            bound = max(bound, max_position or 0)
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
        index = None
        if self.index_blocks is not None:  # no gradient reaches the indexer
            with torch.no_grad():
                index = self._index_inputs(x, offset, positions, bound)
        if cache is not None:  # kv_shared: the storing layer's cache read, not written
            cache = cache if self.kv_shared else _append(
                cache, k, v, q_lengths, None if index is None else index[1])
            k, v = cache.key, cache.value                     # (B, Nkv, M, Dh)
        head_mask = _head_mask(mask, x)  # (B, 1 or N, L, Lk)
        extra = {n: a for n, a in (("sinks", self.sinks),
                                   ("attention_chunk_size", self.attention_chunk_size))
                 if a is not None}
        if index is not None:
            if key_indices is None:
                with torch.no_grad():
                    key_indices = self._block_keys(index, cache, head_mask, offset,
                                                   (q_lengths, kv_lengths), bound)
            if takes_sparse(key_indices.shape[-1], k.shape[-2], return_weights):
                # the core's key_indices, (B, N, L, k) per query head or (B, 1, L, k) shared
                extra["key_indices"] = (key_indices if self.index_blocks == "max"
                                        else key_indices.unsqueeze(-3))
            else:
                head_mask = self._block_mask(head_mask, key_indices, k.shape[-2])
        bias, scale = self._position_bias(q, k.shape[-2], offset), self.scale
        if self.relative_positions == "conformer_timing":  # the core takes q̃, scale κ
            q, term = self._conformer(q, k.shape[-2], offset)
            scale = 1.0 if self.key_scale is None else self.key_scale
            bias = self._inside_cap(q, k, term, scale)
        elif self.W_pos is not None:  # Transformer-XL: the core takes q + u, the position term
            q, term = self._relative(q, k.shape[-2], offset)
            bias = self._inside_cap(q, k, term, self.scale)
        if self.relative_key_table is not None:  # Shaw's: the position term, inside the cap
            bias = self._inside_cap(q, k, self._shaw(q, k.shape[-2], offset), self.scale)
        o = scaled_dot_product_attention(
            q, k, v, head_mask, bias, is_causal=self.causal, scale=scale,
            softcap=self.softcap,
            local_window_size=sliding_window(self.sliding_window, self.causal),
            query_offset=offset, query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
            dropout_rate=rate, dropout_mask=dropout_mask, return_weights=return_weights,
            **extra)
        o, w = o if return_weights else (o, None)
        y = self.out_proj(self._output(o.transpose(-2, -3).flatten(-2), x))  # (B, L, d_out)
        out = (y, w) if return_weights else y
        if return_key_indices:
            out = (*(out if return_weights else (out,)), key_indices.to(torch.int32))
        return out if cache is None else (out, cache)

    # ---- the block indexer (golden.reference.indexer's; no gradient through any of it) ----

    def _check_block_call(self, x, mask, cache, positions, key_indices, return_key_indices):
        """ValueError for a block-indexer argument without the indexer; with it, for
        multimodal positions, a mask with several heads, a cache without index_key, "mean"
        with a cache and explicit positions, or given key_indices of another shape, dtype or
        range (read on the host: a device sync, in the given-selection mode only)."""
        if self.index_blocks is None:
            refuse_selection("index_blocks", key_indices, return_key_indices)
            return
        lead, lk = tuple(x.shape[:-2]), x.shape[-2]
        if positions is not None and positions.ndim == x.ndim:
            raise ValueError("positions should be (L,) or (B, L) with index_blocks (the indexer "
                             "turns by one position per token), got multimodal positions of "
                             f"shape {tuple(positions.shape)}")
        check_index_mask(mask, lead, "index_blocks")
        if cache is not None:
            check_index_cache(cache, self.W_index_k.out_features, x.dtype, "index_blocks")
            lk = cache.key.shape[2]
            if self.index_blocks == "mean" and positions is not None:
                raise ValueError(f"positions should be None with index_blocks = 'mean' and a "
                                 f"cache (a block's key turns at its first key's position, "
                                 f"which the cache does not hold: its slots are the "
                                 f"positions), got shape {tuple(positions.shape)}")
        if key_indices is not None:
            if not isinstance(key_indices, torch.Tensor):
                raise ValueError(f"key_indices should be a torch.Tensor, got "
                                 f"{type(key_indices).__name__}")
            want = block_key_shape(self.config, lead + (self.num_heads, x.shape[-2], lk))
            check_key_indices(key_indices.detach().cpu(), want[:-2], want[-2], lk, want[-1])

    def _index_inputs(self, x, offset, positions, bound):
        """(q^I (..., H_I, L, D_I), this call's indexer keys (..., L, D_I), the tokens'
        positions (L,) or (B, L)); q^I and the keys in x's dtype: q^I = RMS(x W_index_q) ·
        index_q_norm turned at the tokens' positions; the keys "max" RMS(x W_index_k) ·
        index_k_norm turned there (what the cache holds), "mean" x W_index_k (pooled per
        query: _block_keys)."""
        c = self.config
        if positions is not None:  # as RoPE reads them: the cache's offset not added
            at = positions.to(x.device)                                 # (L,) or (B, L)
        else:
            at = torch.arange(x.shape[-2], device=x.device)
            at = at if offset is None else at + offset[:, None]         # (L,) or (B, L)
        q = self.W_index_q(x).unflatten(-1, (c["index_heads"], c["index_head_dim"]))
        q = self._index_rms(q.transpose(-2, -3), self.index_q_norm)  # (..., H_I, L, D_I)
        q = self._index_turn(q, at.unsqueeze(-2) if at.dim() > 1 else at, bound)
        k = self.W_index_k(x)                                           # (..., L, D_I)
        if self.index_blocks == "max":
            k = self._index_turn(self._index_rms(k, self.index_k_norm), at, bound)
        return q, k, at

    def _block_keys(self, index, cache, head_mask, offset, lengths, bound):
        """The block indexer's choice (torch_attn.block_indexer): key_indices (..., N, Lq, k)
        for "max" (each KV group's choice for its query heads), (..., Lq, k) for "mean", among
        the keys each query may see (``head_mask`` (..., 1, Lq, Lk) or None, causal, window,
        chunk, lengths), over every key held (the cache's index_key, or this call's); scores
        in at least float32."""
        q, keys, at = index
        c = self.config
        b, n = c["index_block_size"], c["index_topk_blocks"]
        keys = keys if cache is None else cache.index_key               # (..., Lk, D_I)
        lead, lq, lk = tuple(q.shape[:-3]), q.shape[-2], keys.shape[-2]
        where = Where(bool(self.causal), window(sliding_window(self.sliding_window, self.causal)),
                      offset, *lengths, self.attention_chunk_size)
        allowed, _ = where.allowed((lq, lk), head_mask, q.device)       # (..., 1, Lq, Lk)
        allowed = (torch.ones(lead + (lq, lk), dtype=torch.bool, device=q.device)
                   if allowed is None else allowed.expand(lead + (1, lq, lk))[..., 0, :, :])
        compute = torch.float32 if q.dtype in LOW_PRECISION else q.dtype
        q, keys = q.to(compute), keys.to(compute)
        if self.index_blocks == "max":
            chosen = max_block_keys(q, keys.unsqueeze(-3), allowed, at // b, b, n,
                                    c["index_local_blocks"])            # (..., H_I, Lq, k)
            return chosen.repeat_interleave(self.num_heads // c["index_heads"], dim=-3)
        key_at = at if cache is None else torch.arange(lk, device=q.device)

        def block_key(pooled, first):  # RMS-normed, turned at the block's first key
            return self._index_turn(self._index_rms(pooled, self.index_k_norm), first, bound)
        return mean_block_keys(q, keys, allowed, key_at, block_key, b, n)

    def _block_mask(self, head_mask, key_indices, lk):
        """The core's mask: ``head_mask`` (..., 1 or N, Lq, Lk) or None AND the chosen keys,
        "max" per query head (..., N, Lq, Lk), "mean" one for all (..., 1, Lq, Lk)
        (golden.reference.modules._block_mask)."""
        if self.index_blocks == "mean":
            key_indices = key_indices.unsqueeze(-3)
        device = key_indices.device if head_mask is None else head_mask.device
        return selected_mask(key_indices.to(device), head_mask, lk)

    def _index_rms(self, t, weight):
        """RMSNorm of t (..., D_I) times ``weight`` (index_norm_eps), in at least float32,
        rounded once to t's dtype."""
        compute = torch.float32 if t.dtype in LOW_PRECISION else t.dtype
        return qk_normalize(t.to(compute), "rms", weight.to(compute),
                            self.config["index_norm_eps"], mean=lambda a: a.mean(-1, keepdim=True),
                            rsqrt=torch.rsqrt).to(t.dtype)

    def _index_turn(self, t, at, bound):
        """t (..., D_I) with its first rd features (the layer's rotary features) turned by the
        layer's RoPE, rotate-half pairs, at positions ``at`` (broadcast against t's leading
        axes), in at least float32 and rounded once (precision "hf": in t's dtype, as
        rotary_embedding)."""
        compute = torch.float32 if t.dtype in LOW_PRECISION else t.dtype
        cos, sin = rotary_cos_sin(self.rotary, rotary_dims(self.head_dim, self.rotary), at,
                                  bound, compute)
        if dict(self.rotary)["precision"] == "hf":
            cos, sin, compute = cos.to(t.dtype), sin.to(t.dtype), t.dtype
        return rope_turn(t.to(compute), cos, sin, False, stack=torch.stack,
                         concat=torch.cat).to(t.dtype)

    def _merged(self, x, q, k, v, context, head_mask, cache, lengths, run):
        """merged_context's attention (T5Gemma 2's T5Gemma2MergedAttention): q (B, N, L, Dh)
        over [k ; k_c] and [v ; v_c], k_c and v_c the context's (B, Nkv, Lc, Dh) through W_key
        (k_norm, no RoPE) and W_value, or the cache's when context is None. The mask
        (merged_allowed) and the given one cover the L or M self keys, then the Lc context's;
        the cache is a MergedCache (the context's keys stored by the call that gave it)."""
        (context, context_mask), (offset, q_lengths, kv_lengths) = context, lengths
        rate, dropout_mask, return_weights = run
        if context is None:
            k_c, v_c, context_mask = cache.context_key, cache.context_value, cache.context_mask
        else:
            k_c = self._split(self.W_key(context), self.num_kv_heads)  # (B, Nkv, Lc, Dh)
            k_c = self._norm(k_c, self.k_norm) if self.qk_norm is not None else k_c
            v_c = self._split(self.W_value(context), self.num_kv_heads)
            context_mask = (torch.ones(context.shape[:-1], dtype=torch.bool,
                                       device=context.device)
                            if context_mask is None else context_mask)
        if cache is not None:
            held = _append(KVCache(cache.key, cache.value, cache.lengths), k, v, q_lengths)
            cache = MergedCache(held.key, held.value, held.lengths, k_c, v_c, context_mask)
            k, v = held.key, held.value                         # (B, Nkv, M, Dh)
        allowed = merged_allowed(q.shape[-2], k.shape[-2], offset, kv_lengths, context_mask,
                                 self.sliding_window, xp=torch)  # (B, 1, L, Lk + Lc)
        if head_mask is not None:
            allowed = allowed & head_mask
        o = scaled_dot_product_attention(
            q, torch.cat([k, k_c], dim=-2), torch.cat([v, v_c], dim=-2), allowed,
            scale=self.scale, softcap=self.softcap, query_seq_lengths=q_lengths,
            dropout_rate=rate, dropout_mask=dropout_mask, return_weights=return_weights)
        o, w = o if return_weights else (o, None)
        y = self.out_proj(o.transpose(-2, -3).flatten(-2))       # (B, L, d_out)
        out = (y, w) if return_weights else y
        return out if cache is None else (out, cache)

    def _output(self, merged, x):
        """The heads' output merged (B, L, N·Dh) through the output norm (in at least float32,
        rounded once) and the gate (golden.specification.outputs): σ in merged's dtype, softplus
        in at least float32 (as Hugging Face's Laguna), stable as max(z, 0) + log(1 + e^−|z|)."""
        compute = torch.float32 if merged.dtype in LOW_PRECISION else merged.dtype
        if self.output_norm is not None:
            w = None if self.output_norm_weight is None else self.output_norm_weight.to(compute)
            merged = normalized_output(merged.to(compute), self.output_norm, w,
                                       self.output_norm_eps, self.num_heads,
                                       mean=lambda a: a.mean(-1, keepdim=True),
                                       rsqrt=torch.rsqrt).to(merged.dtype)
        if self.W_gate is None:
            return merged
        return gated_output(merged, self.W_gate(x), self.gate, self.num_heads,
                            sigmoid=torch.sigmoid, softplus=lambda z: (
                                z.to(compute).clamp(min=0) + torch.log1p(
                                    torch.exp(-z.to(compute).abs()))).to(z.dtype))

    def _normed(self, q, k):
        """q and k through their QK norm before RoPE, then clamped with clip_qkv_after_norm."""
        q = self._norm(q, self.q_norm, bias=self.q_norm_bias)  # Chameleon's: with a bias
        k = self._norm(k, self.k_norm, bias=self.k_norm_bias)
        return (self._clip(q), self._clip(k)) if self.clip_after_norm else (q, k)

    def _clip(self, y):
        """MPT's and OLMo's clip_qkv: a projection clamped to [−c, c] (None: as it is; a
        kv_shared module's absent keys stay None)."""
        return y if self.clip_qkv is None or y is None else y.clamp(-self.clip_qkv, self.clip_qkv)

    def _split(self, y, heads):
        """(B, L, heads·Dh) -> (B, heads, L, Dh) (the values' Dv alike; None stays None)."""
        return None if y is None else y.unflatten(-1, (heads, -1)).transpose(-2, -3)

    def _norm(self, t, weight, kind=None, bias=None):
        """The QK norm of t (or ``kind``, "l2" for the value norm), plus ``bias`` when given
        ("layer_with_bias"), computed in at least float32 and rounded once to t's dtype (a
        kv_shared module's absent keys: None)."""
        if t is None:
            return None
        compute = torch.float32 if t.dtype in LOW_PRECISION else t.dtype
        w = None if weight is None else weight_broadcast(self.qk_norm, weight.to(compute))
        b = None if bias is None else weight_broadcast(self.qk_norm, bias.to(compute))
        return qk_normalize(t.to(compute), kind or self.qk_norm, w, self.qk_norm_eps,
                            mean=lambda a: a.mean(-1, keepdim=True), rsqrt=torch.rsqrt,
                            bias=b).to(t.dtype)

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

    def _relative(self, q, keys, offset):
        """Transformer-XL's relative positions: (the core's query q + u, its bias (..., N, L,
        Lk)) for query i at p = offset + i and key j, in token order (as ALiBi's): the bias is
        scale · (q_i + v)·e[S + j − p], e = split(R W_pos) (N, 2S + 1, Dh) over the distances
        −S … S, S = Lk − 1 (farther ones take the nearest end), R the sinusoidal table
        (golden.specification.decoder.sinusoid_table) in the parameters' dtype; the product and
        the bias in at least float32. As Hugging Face's rel_shift, without its (2L − 1)-wide
        padding: the (..., L, 2S + 1) products gathered at each key's distance."""
        compute = torch.float32 if q.dtype in LOW_PRECISION else q.dtype
        e = self._projected(sinusoid_table, keys, compute, q.device)  # (N, 2S + 1, Dh)
        scale = self.head_dim ** -0.5 if self.scale is None else self.scale
        qv = q.to(compute) + self.bias_v.to(compute)[:, None, :]  # (..., N, L, Dh)
        products = (qv @ e.transpose(-1, -2)) * scale  # (..., N, L, 2S + 1)
        return q + self.bias_u.to(q.dtype)[:, None, :], self._at_distances(products, keys,
                                                                              offset)

    def _projected(self, table, keys, compute, device):
        """e = split(T W_pos) (N, 2S + 1, Dh) in ``compute`` over the distances −S … S, S = Lk −
        1: T (2S + 1, d_in) the ``table`` (golden.specification.decoder's sinusoid_table or
        timing_table) in the parameters' dtype."""
        t = torch.tensor(table(self.d_in, keys - 1), device=device, dtype=self.W_pos.weight.dtype)
        e = self.W_pos(t).to(compute).unflatten(-1, (self.num_heads, self.head_dim))
        return e.transpose(0, 1)  # (2S + 1, N, Dh) -> (N, 2S + 1, Dh)

    def _conformer(self, q, keys, offset):
        """The USM Conformer's relative positions (Gemma 3n's and Gemma 4's audio attention):
        (the core's query q̃ = q ⊙ scale · softplus(per_dim_scale) / ln 2, its position term
        (..., N, L, Lk) q̃_i·e[S + j − p]) for query i at p = offset + i and key j in token
        order, e = split(timing W_pos) (N, 2S + 1, Dh) over the distances −S … S, S = Lk − 1,
        timing the signal of golden.specification.decoder.timing_table in the parameters'
        dtype; q̃ in q's dtype, the product in at least float32."""
        compute = torch.float32 if q.dtype in LOW_PRECISION else q.dtype
        e = self._projected(timing_table, keys, compute, q.device)  # (N, 2S + 1, Dh)
        scale = self.head_dim ** -0.5 if self.scale is None else self.scale
        factor = torch.nn.functional.softplus(self.per_dim_scale.to(compute)) * (
            scale / math.log(2.0))  # (Dh,)
        q = (q.to(compute) * factor).to(q.dtype)
        products = q.to(compute) @ e.transpose(-1, -2)  # (..., N, L, 2S + 1)
        return q, self._at_distances(products, keys, offset)

    def _at_distances(self, products, keys, offset):
        """Each key's entry of ``products`` (..., N, L, 2S + 1), S = Lk − 1: (..., N, L, Lk),
        query i at p = offset + i and key j read at S + j − p."""
        pos = torch.arange(products.shape[-2], device=products.device)[:, None]  # (L, 1)
        if offset is not None:
            pos = pos + offset[:, None, None]  # (B, L, 1)
        index = distance_index(products.shape[-1], torch.arange(keys, device=products.device),
                               pos)
        index = index.unsqueeze(-3).expand(products.shape[:-1] + (keys,))  # (..., N, L, Lk)
        return products.gather(-1, index)

    def _inside_cap(self, q, k, term, scale):
        """The core's bias that puts the relative positions' ``term`` (..., N, L, Lk) inside
        its soft cap c: cap(A + T) − cap(A), A = scale · q kᵀ as the core forms it, so that the
        core's cap(A) + bias is cap(A + T) (rounding apart: the core forms A again). Without a
        cap, the term itself. torch's core has no term before its cap (JAX's distance_query
        and distance_keys are one): the module forms the (L, Lk) scores once more instead."""
        if self.softcap is None:
            return term
        compute = term.dtype
        scale = self.head_dim ** -0.5 if scale is None else scale
        a = scale * grouped_matmul(q.to(compute), k.to(compute).transpose(-2, -1))
        c = self.softcap
        return c * torch.tanh((a + term) / c) - c * torch.tanh(a / c)

    def _input_norm(self, x):
        """LayerNorm of x (..., L, d_in) over d_in, times input_norm_weight plus input_norm_bias,
        in at least float32 and rounded once to x's dtype."""
        compute = torch.float32 if x.dtype in LOW_PRECISION else x.dtype
        y = qk_normalize(x.to(compute), "layer", self.input_norm_weight.to(compute),
                         self.input_norm_eps, mean=lambda a: a.mean(-1, keepdim=True),
                         rsqrt=torch.rsqrt)
        return (y + self.input_norm_bias.to(compute)).to(x.dtype)

    def _shaw(self, q, keys, offset):
        """Shaw's relative positions: the core's bias (..., N, L, Lk) scale · q_i·E[M +
        clip(p − j, −M, M)] for query i at p = offset + i and key j in token order, E the
        relative_key_table (2M + 1, Dh) shared by every head (row M + t: query − key = t); the
        products (..., N, L, 2M + 1) in at least float32, gathered at each key's distance
        (the table reversed: row M + clip(j − p) of E[::-1] is E's at p − j)."""
        compute = torch.float32 if q.dtype in LOW_PRECISION else q.dtype
        table = self.relative_key_table.to(compute).flip(0)  # (2M + 1, Dh): key − query order
        scale = self.head_dim ** -0.5 if self.scale is None else self.scale
        products = (q.to(compute) @ table.T) * scale  # (..., N, L, 2M + 1)
        pos = torch.arange(q.shape[-2], device=q.device)[:, None]  # (L, 1)
        if offset is not None:
            pos = pos + offset[:, None, None]  # (B, L, 1)
        index = distance_index(table.shape[0], torch.arange(keys, device=q.device), pos)
        index = index.unsqueeze(-3).expand(products.shape[:-1] + (keys,))  # (..., N, L, Lk)
        return products.gather(-1, index)

    def _temperature(self, q, offset, positions):
        """q times the query temperature at each token's position (_query_temperature)."""
        return _query_temperature(self, q, offset, positions)


def _cache_positions(cache, length, query_seq_lengths):
    """(query offset, query lengths, key lengths) of a call of ``length`` tokens appended to
    ``cache``: row b's tokens at lengths[b] + i, the real ones (i < query_seq_lengths[b],
    clipped to [0, L]) counted, and of those only the ones that fit in max_length (as
    jax_attn's; ``strict=True`` raises instead, golden.specification.positions.check_fits)."""
    held, room = cache.lengths, cache.key.shape[2]
    new = (torch.full_like(held, length) if query_seq_lengths is None
           else query_seq_lengths.to(held.device, held.dtype).clamp(0, length))
    new = torch.minimum(new, room - held)  # what does not fit is dropped
    return held, new, held + new


def _shared_positions(cache, length, query_seq_lengths):
    """(query offset, query lengths, key lengths) of a kv_shared call of ``length`` tokens on
    the storing layer's ``cache`` as its call on the same tokens returned it: row b's new[b]
    real tokens (query_seq_lengths clipped to [0, L], or L; at most lengths[b]) are its last
    ones, at lengths[b] − new[b] + i, and every held key 0 … lengths[b] − 1 is attended. Tokens
    the storing call dropped (a full cache) cannot be told apart here: call it strict."""
    held = cache.lengths
    new = (torch.full_like(held, length) if query_seq_lengths is None
           else query_seq_lengths.to(held.device, held.dtype).clamp(0, length))
    new = torch.minimum(new, held)
    return held - new, new, held


def _refuse_own_cache(kv_shared):
    """init_cache of a kv_shared module: ValueError (it has no keys of its own)."""
    if kv_shared:
        raise ValueError("init_cache: a module with kv_shared=True has no keys or values of its "
                         "own to cache; make the storing layer's (store.init_cache) and pass it, "
                         "as the storing layer's call returned it, as cache=")


def _append(cache, k, v, new, index_key=None) -> KVCache:
    """A new cache: row b's first new[b] keys and values of this call (B, Nkv, L, Dh) written
    after its lengths[b] held ones (the cache given is not changed), and its block indexer's
    keys ``index_key`` (B, L, D_I) at the same slots of cache.index_key when given (else the
    cache's index_key as it is)."""
    b, length = k.shape[0], k.shape[2]
    i = torch.arange(length, device=k.device)
    real = i < new[:, None]                                       # (B, L)
    rows = torch.arange(b, device=k.device)[:, None].expand(b, length)[real]
    pos = (cache.lengths[:, None] + i)[real]                      # (n,) each
    key, value = cache.key.clone(), cache.value.clone()
    key[rows, :, pos] = k.transpose(1, 2)[real]                   # (n, Nkv, Dh)
    value[rows, :, pos] = v.transpose(1, 2)[real]
    held = getattr(cache, "index_key", None)
    if index_key is not None:
        held = held.clone()
        held[rows, pos] = index_key.to(held.dtype)[real]          # (n, D_I)
    return KVCache(key, value, (cache.lengths + new).to(cache.lengths.dtype), held)

"""MultiHeadLatentAttention (MLA), the twin of torch_attn.modules.latent's, whose class docstring
gives the maths: its latent cache a pytree, appended to with GroupedQueryAttention's
``_cache_positions`` and ``_append`` (the latent seen as one key-value head), and ``absorb`` a
compiled program of its own; with ``index_topk`` a learned indexer (DeepSeek-V3.2's and its
relatives', golden.specification.indexer) chooses the keys each query attends. Shape legend as
in jax_attn.modules; H_I indexer heads, D_I their width, k the keys kept per query.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from golden.specification import variants
from golden.specification.decoder import qk_normalize
from golden.specification.decoder import sliding_window as sliding_window_pair
from golden.specification.indexer import (check_index_cache, check_index_mask, check_key_indices,
                                          refuse_selection, require_given)
from golden.specification.outputs import gate_kind, gated_output
from golden.specification.positions import KVCache, LatentCache
from golden.specification.temperature import learned_temperature
from golden.specification.validate import (
    cache_shape, check_flags, check_latent_cache, check_latent_inputs, rope_arguments,
)
from jax_attn.functional import DEFAULT_PRECISION, scaled_dot_product_attention, takes_sparse
from jax_attn.modules.base import (_head_mask, _linear, _merge_heads, _query_temperature,
                                   _Variant, selection_allowed)
from jax_attn.modules.grouped_query import _append, _append_rows, _cache_positions
from jax_attn.rotary import rotary_embedding
from jax_attn.sparse import selected_mask
from jax_attn.sharding import explicit_spec


class MultiHeadLatentAttention(_Variant):
    """Multi-head latent attention (MLA) as DeepSeek-V2/V3 and Kimi K2 write it (transformers'
    DeepseekV3Attention): keys and values made per head from one small latent per token, which
    is all a cache holds. The twin of torch_attn's (its docstring gives the maths): the same
    arguments, plus ``rngs`` and ``precision`` (every dot, projections and the absorbed
    products included).

    With ``cache`` (from ``init_cache``, golden.specification.positions.LatentCache, a pytree) the
    call appends each token's normalised latent and rotated k_pe (a scatter; the lengths traced, so
    a decode step compiles once per max_length) and returns (output, new cache). ``absorb=True``
    folds W_kv_b into the query and the output (static: its own compiled program).

    The learned indexer (``index_topk`` and the other ``index_*`` options,
    golden.specification.indexer, where the maths and the one selection rule are): its
    parameters W_index_q, W_index_k, W_index_weights (``nnx.Linear``, no bias) and the vectors
    index_k_norm, index_k_norm_bias (index_q_norm, index_q_norm_bias; index_temperature_scale,
    index_temperature_bias where the options ask), in the neutral layout of export_params and
    load_params. Its scores are computed in at least float32 (q^I and k^I made in the parameters'
    dtype, as Hugging Face's), without gradient (``lax.stop_gradient``: the indexer's parameters
    get zero gradients, the choice is a constant to the attention); each query keeps the
    k = min(index_topk, Lk) best keys it may see, equal scores won by the lowest key index
    (``lax.top_k`` on the scores with -0.0 made 0.0 and the keys it may not see at -inf, which
    also fills a row seeing fewer than k keys with its unseen keys, lowest index first). The
    chosen keys reach the core as its key_indices ("sparse") when they are k ≤ Lk /
    SPARSE_UP_TO a row and no weights are asked (jax_attn.functional.takes_sparse), else as a
    boolean mask ANDed into the call's (``_selection_mask``).
    ``key_indices`` (B, Lq, k) int (k = min(index_topk, Lk), Lk = L, or the cache's max_length
    M) gives the selection instead (no scores computed); ``return_key_indices=True`` appends the
    selection used, int32 (B, Lq, k), to what the call returns: ``(y, key_indices)``, ``(y,
    weights, key_indices)`` with ``return_weights``. The cache then holds each token's indexer key
    k^I (after its LayerNorm and RoPE) in ``index_key`` (B, M, D_I).
    """

    variant = "multi_head_latent_attention"

    def __init__(self, d_in, num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                 v_head_dim, q_lora_rank=None, d_out=None, attention_bias=False,
                 rms_norm_eps=1e-6, rope_theta=None, rope_parameters=None, rope_interleaved=True,
                 causal=True, scale=None, query_temperature=None, rope=True, sinks=False,
                 output_gate=False, rope_key_norm=False, query_latent="normed",
                 sliding_window=None, index_topk=None, index_heads=None, index_head_dim=None,
                 index_rope="half", index_rope_dims="first", index_query="latent",
                 index_temperature=False, index_scale="scores", index_norm_eps=1e-6,
                 index_select="tokens", *, rngs,
                 precision=DEFAULT_PRECISION):
        self._configure(d_in=d_in, num_heads=num_heads, kv_lora_rank=kv_lora_rank,
                        qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
                        v_head_dim=v_head_dim, q_lora_rank=q_lora_rank, d_out=d_out,
                        attention_bias=attention_bias, rms_norm_eps=rms_norm_eps,
                        rope_theta=rope_theta, rope_parameters=rope_parameters,
                        rope_interleaved=rope_interleaved, causal=causal, scale=scale,
                        query_temperature=query_temperature, rope=rope, sinks=sinks,
                        output_gate=output_gate, rope_key_norm=rope_key_norm,
                        query_latent=query_latent, sliding_window=sliding_window,
                        index_topk=index_topk, index_heads=index_heads,
                        index_head_dim=index_head_dim, index_rope=index_rope,
                        index_rope_dims=index_rope_dims, index_query=index_query,
                        index_temperature=index_temperature, index_scale=index_scale,
                        index_norm_eps=index_norm_eps, index_select=index_select)
        sizes = variants.latent_sizes(self.config)
        self.rotary = variants.latent_rope(self.config)  # hashable (static)
        self.scale = variants.latent_scale(self.config)
        self.d_in, self.num_heads, self.kv_lora_rank = d_in, num_heads, kv_lora_rank
        self.nope, self.rope, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rms_norm_eps, self.rope_interleaved, self.causal = (rms_norm_eps, rope_interleaved,
                                                                 causal)
        self.precision = precision
        qk, bias = sizes["qk_head_dim"], attention_bias
        lora = q_lora_rank is not None
        self.W_query = None if lora else _linear(d_in, num_heads * qk, False, rngs, precision)
        self.W_q_a = _linear(d_in, q_lora_rank, bias, rngs, precision) if lora else None
        self.q_a_norm = nnx.Param(jnp.ones((q_lora_rank,))) if lora else None
        shapes = variants.get(self.variant).shapes(self.config)  # W_q_b's, W_gate's inputs
        self.both = query_latent == "normed_and_raw"  # AXK2's [RMSNorm(c_q) | c_q]: static
        self.window = sliding_window_pair(sliding_window, causal)  # the core's (left, right)
        self.W_q_b = _linear(*shapes["W_q_b"], False, rngs, precision) if lora else None
        self.W_kv_a = _linear(d_in, kv_lora_rank + qk_rope_head_dim, bias, rngs, precision)
        self.kv_a_norm = nnx.Param(jnp.ones((kv_lora_rank,)))
        self.W_kv_b = _linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), False,
                              rngs, precision)
        self.out_proj = _linear(num_heads * v_head_dim, sizes["d_out"], bias, rngs, precision)
        self.use_rope = rope  # False: q_pe and k_pe not turned (Kimi Linear)
        self.query_temperature = (None if query_temperature is None else tuple(
            sorted(query_temperature.items())))  # Mistral Small 4's, after RoPE; static
        starts = variants.vector_starts(self.variant, self.config)  # the learned kind's
        for n in ("temperature_scale", "temperature_bias", "sinks",  # sinks: HY-V4's
                  "k_pe_norm",  # dots3's RMSNorm of the shared rotary key
                  "index_k_norm", "index_k_norm_bias", "index_q_norm", "index_q_norm_bias",
                  "index_temperature_scale", "index_temperature_bias"):  # the indexer's
            setattr(self, n, nnx.Param(jnp.full(*starts[n])) if n in starts else None)
        self._init_indexer(rngs, shapes)
        self.gate = gate_kind(output_gate)  # (activation, per head) or None: static
        self.W_gate = None if self.gate is None else _linear(*shapes["W_gate"], False, rngs,
                                                             precision)

    def _init_indexer(self, rngs, shapes) -> None:
        """The learned indexer's settings (static) and projections (of the variant's
        ``shapes``); None without index_topk."""
        c = self.config
        self.index_topk, self.index_heads, self.index_head_dim = (
            c["index_topk"], c["index_heads"], c["index_head_dim"])
        self.index_options = tuple((n, c[n]) for n in (  # static
            "index_rope", "index_rope_dims", "index_query", "index_temperature", "index_scale",
            "index_norm_eps"))
        p = self.precision
        for n in ("W_index_q", "W_index_k", "W_index_weights"):
            setattr(self, n, None if n not in shapes else _linear(*shapes[n], False, rngs, p))

    def init_cache(self, batch_size, max_length, dtype=None) -> LatentCache:
        """An empty cache: latent zeros (B, max_length, kv_lora_rank), rope_key zeros (B,
        max_length, qk_rope_head_dim) in ``dtype`` (default the parameters'), lengths zeros
        (B,) int32; with a learned indexer index_key zeros (B, max_length, index_head_dim)."""
        cache_shape(batch_size, max_length, 1, 1)  # checks the sizes
        dtype = self.W_kv_a.kernel.get_value().dtype if dtype is None else dtype
        index_key = None if self.W_index_k is None else jnp.zeros(
            (batch_size, max_length, self.index_head_dim), dtype)
        return LatentCache(jnp.zeros((batch_size, max_length, self.kv_lora_rank), dtype),
                           jnp.zeros((batch_size, max_length, self.rope), dtype),
                           jnp.zeros((batch_size,), jnp.int32), index_key)

    def cache_bytes_per_token(self, dtype=None) -> int:
        """Bytes the cache holds per token and layer: (kv_lora_rank + qk_rope_head_dim
        [+ index_head_dim with a learned indexer]) · itemsize of ``dtype`` (default the
        parameters'), whatever num_heads."""
        dtype = self.W_kv_a.kernel.get_value().dtype if dtype is None else dtype
        width = self.kv_lora_rank + self.rope + (self.index_head_dim or 0)
        return width * jnp.dtype(dtype).itemsize

    def __call__(self, x, mask=None, *, cache=None, query_seq_lengths=None, positions=None,
                 return_weights=False, absorb=False, key_indices=None,
                 return_key_indices=False):
        check_flags(absorb=absorb, return_key_indices=return_key_indices)
        self._check_selection(x, mask, cache, key_indices, return_key_indices)
        return self._call(x, mask, cache=cache, query_seq_lengths=query_seq_lengths,
                          positions=positions, return_weights=return_weights, absorb=absorb,
                          key_indices=key_indices, return_key_indices=return_key_indices)

    def _check_selection(self, x, mask, cache, key_indices, return_key_indices) -> None:
        """The indexer's arguments: none without index_topk; a mask with no head axis (or one
        of size 1); ``key_indices`` integers (B, Lq, k) (their range too when concrete)."""
        if self.index_topk is None:
            refuse_selection("index_topk", key_indices, return_key_indices)
            return
        require_given(self.config, key_indices)  # a "shared" layer chooses nothing itself
        lead = tuple(np.shape(x))[:-2]
        check_index_mask(mask, lead)
        if key_indices is None:
            return
        lq = np.shape(x)[-2]
        lk = lq if cache is None else check_latent_cache(cache, x, self.kv_lora_rank, self.rope)
        if isinstance(key_indices, jax.core.Tracer):  # shape and dtype only: values unknown
            key_indices = np.broadcast_to(np.zeros((), key_indices.dtype), key_indices.shape)
        check_key_indices(key_indices, lead, lq, lk, min(self.index_topk, lk))

    @nnx.jit(graph=False, static_argnames=("return_weights", "absorb", "return_key_indices"))
    def _call(self, x, mask=None, *, cache=None, query_seq_lengths=None, positions=None,
              return_weights=False, absorb=False, key_indices=None, return_key_indices=False):
        check_latent_inputs(x, self.d_in, mask, query_seq_lengths, heads=self.num_heads,
                            positions=positions, cache=cache, kv_lora_rank=self.kv_lora_rank,
                            rope_dim=self.rope)
        if cache is not None and self.W_index_k is not None:
            check_index_cache(cache, self.index_head_dim, x.dtype)
        q, q_resid, q_in = self._query(x)
        q = self._split(q, self.nope + self.rope)                # (B, N, L, Dk)
        kv_a = self.W_kv_a(x)                                    # (B, L, r + Dr)
        latent = self._norm(kv_a[..., :self.kv_lora_rank], self.kv_a_norm)  # (B, L, r)
        k_pe = kv_a[..., None, :, self.kv_lora_rank:]            # (B, 1, L, Dr)
        if self.k_pe_norm is not None:  # dots3's: RMS-normalised before RoPE
            k_pe = self._norm(k_pe, self.k_pe_norm)
        offset, q_lengths, kv_lengths = None, query_seq_lengths, query_seq_lengths
        if cache is not None:
            held = _as_kv(cache)
            offset, q_lengths, kv_lengths = _cache_positions(held, x.shape[1], query_seq_lengths)
        bound = x.shape[-2] if cache is None else cache.latent.shape[1] + x.shape[1]
        q_pe, k_pe = (rotary_embedding(t, interleaved=self.rope_interleaved, offset=offset,
                                       positions=positions, max_position=bound,
                                       **rope_arguments(self.rotary))
                      for t in (q[..., self.nope:], k_pe)) if self.use_rope else (
            q[..., self.nope:], k_pe)
        q_nope = q[..., :self.nope]
        if self.query_temperature is not None:  # both parts of q, at the tokens' positions
            q_nope, q_pe = (_query_temperature(self, t, offset, positions)
                            for t in (q_nope, q_pe))
        latent = latent[..., None, :, :]                         # (B, 1, L, r)
        before = cache  # the call's cache (the indexer's keys appended to it below)
        if cache is not None:
            held = _append(held, latent, k_pe, q_lengths)
            latent, k_pe = held.key, held.value                  # (B, 1, M, r), (B, 1, M, Dr)
            cache = LatentCache(latent[:, 0], k_pe[:, 0], held.lengths)
        head_mask = _head_mask(mask, x)  # (B, 1 or N, L, Lk)
        chosen = None  # the selection as the core's key_indices, when sparse pays
        if self.index_topk is not None:  # the learned indexer's choice, a mask or key_indices
            index_key = None  # (index_select "given": no indexer of its own)
            if self.W_index_k is not None:
                index_key = self._index_key(x, offset, positions, bound)  # (B, L, D_I)
                if before is not None:
                    index_key = _append_rows(before.index_key, index_key, before.lengths,
                                             q_lengths)
                    cache = cache._replace(index_key=index_key)  # (B, M, D_I)
            if key_indices is None:
                key_indices = self._choose(x, q_resid, index_key, mask, offset, positions,
                                           bound, q_lengths, kv_lengths)
            key_indices = jnp.asarray(key_indices, jnp.int32)
            lk = latent.shape[-2]
            if takes_sparse(key_indices.shape[-1], lk, return_weights):
                chosen = key_indices[..., None, :, :]            # the core's (B, 1, L, k)
            else:
                head_mask = self._selection_mask(head_mask, key_indices, lk)
        attend = self._absorbed if absorb else self._expanded
        o = attend(q_nope, q_pe, latent, k_pe, head_mask, offset, q_lengths,
                   kv_lengths, return_weights, chosen)           # (B, N, L, Dv)
        o, w = o if return_weights else (o, None)
        y = _merge_heads(self.out_proj, o, None if self.W_gate is None else (  # (B, L, d_out)
            lambda merged: self._gated(merged, q_in if self.both else x)))
        out = ((y, w) if return_weights else (y,)) + (
            (key_indices,) if return_key_indices else ())
        out = out if len(out) > 1 else y
        return out if cache is None else (out, cache)

    def _choose(self, x, q_resid, index_key, mask, offset, positions, bound, q_lengths,
                kv_lengths):
        """key_indices (B, Lq, k) int32, k = min(index_topk, Lk): each query's best keys
        among those it may see (golden.specification.indexer's rule), the indexer's scores
        against ``index_key`` (B, Lk, D_I)."""
        lk = index_key.shape[-2]
        scores = self._index_scores(x, q_resid, index_key, offset, positions, bound)
        allowed = self._allowed(mask, scores.shape, offset, q_lengths, kv_lengths)
        return _select_keys(scores, allowed, min(self.index_topk, lk))

    def _allowed(self, mask, shape, offset, q_lengths, kv_lengths):
        """selection_allowed with the layer's causality (no window)."""
        return selection_allowed(mask, shape, offset, q_lengths, kv_lengths, causal=self.causal)

    def _selection_mask(self, mask, key_indices, lk):
        """The call's mask (B, 1 or N, Lq, Lk) or None AND the chosen keys, True at
        ``key_indices`` (B, Lq, k), as a boolean mask (the reference's and Hugging Face's eager
        path), where the core's sparse implementation would not pay (__call__)."""
        return selected_mask(key_indices[..., None, :, :], mask, lk)  # (B, 1 or N, Lq, Lk)

    def _index_key(self, x, offset, positions, bound):
        """k^I (B, L, D_I) = RoPE(LayerNorm(x W_index_k)), no gradient."""
        x = jax.lax.stop_gradient(x)
        k = self._layer_norm(self.W_index_k(x), self.index_k_norm, self.index_k_norm_bias)
        k = self._index_rope(k[..., None, :, :], offset, positions, bound)[..., 0, :, :]
        return jax.lax.stop_gradient(k)

    def _index_scores(self, x, q_resid, index_key, offset, positions, bound):
        """I (B, Lq, Lk) = Σ_h w[t, h] · H_I^−1/2 · ReLU(D_I^−1/2 · q^I[t, h] · k^I[s]) (or
        D_I^−1/2 on w: index_scale "weights"), in at least float32, in the reference's order;
        q^I from the query's latent or LayerNorm(x), times the temperature, turned."""
        o = dict(self.index_options)
        h, d = self.index_heads, self.index_head_dim
        x, q_resid = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_resid)
        source = q_resid if o["index_query"] == "latent" else self._layer_norm(
            x, self.index_q_norm, self.index_q_norm_bias)
        q = self.W_index_q(source)                               # (B, L, H_I·D_I)
        q = jnp.swapaxes(q.reshape(q.shape[:-1] + (h, d)), -2, -3)  # (B, H_I, L, D_I)
        if o["index_temperature"]:  # Mistral Large 4's, before RoPE
            q = self._index_temperature(q, offset, positions)
        q = self._index_rope(q, offset, positions, bound)
        compute = jnp.promote_types(x.dtype, jnp.float32)
        dot = jnp.einsum("...htd,...sd->...hts", q.astype(compute), index_key.astype(compute),
                         precision=self.precision)              # (B, H_I, Lq, Lk)
        w = self.W_index_weights(x).astype(compute) * (1 / np.sqrt(h))  # (B, Lq, H_I)
        if o["index_scale"] == "scores":  # DeepSeek-V3.2: on q·k, before the ReLU
            dot = dot * (1 / np.sqrt(d))
        else:  # HY-V4: on the head weights
            w = w * (1 / np.sqrt(d))
        relu = jnp.where(dot > 0, dot, 0)
        scores = jnp.einsum("...th,...hts->...ts", w, relu, precision=self.precision)
        return jax.lax.stop_gradient(scores)

    def _index_rope(self, t, offset, positions, bound):
        """t (B, H, L, D_I) with its first or last qk_rope_head_dim features turned
        (index_rope: rotate-half or interleaved pairs; None: t itself)."""
        o = dict(self.index_options)
        if o["index_rope"] is None:
            return t
        d, r = t.shape[-1], self.rope
        start = 0 if o["index_rope_dims"] == "first" else d - r
        turned = rotary_embedding(t[..., start:start + r],
                                  interleaved=o["index_rope"] == "interleaved", offset=offset,
                                  positions=positions, max_position=bound,
                                  **rope_arguments(self.rotary))
        return jnp.concatenate([t[..., :start], turned, t[..., start + r:]], -1)

    def _index_temperature(self, q, offset, positions):
        """q^I (B, H_I, L, D_I) times index_temperature_scale[h] · ln(p + 1) +
        index_temperature_bias[h] at each token's position p, in at least float32, rounded
        once."""
        compute = jnp.promote_types(q.dtype, jnp.float32)
        if positions is None:
            positions = jnp.arange(q.shape[-2])                  # (L,)
            if offset is not None:
                positions = positions + offset[:, None]          # (B, L)
        factors = learned_temperature(
            positions, self.index_temperature_scale.get_value().astype(compute),
            self.index_temperature_bias.get_value().astype(compute),
            real=lambda n: n.astype(compute), log1p=jnp.log1p)  # (H_I, L) or (B, H_I, L)
        return (q.astype(compute) * factors[..., None]).astype(q.dtype)

    def _layer_norm(self, t, weight, bias):
        """LayerNorm of t over its last axis with ``weight`` and ``bias`` (the indexer's, ε
        index_norm_eps), in at least float32, rounded once to t's dtype."""
        compute = jnp.promote_types(t.dtype, jnp.float32)
        eps = dict(self.index_options)["index_norm_eps"]
        return qk_normalize(t.astype(compute), "layer_with_bias",
                            weight.get_value().astype(compute), eps,
                            mean=lambda a: a.mean(-1, keepdims=True), rsqrt=jax.lax.rsqrt,
                            bias=bias.get_value().astype(compute)).astype(t.dtype)

    def _expanded(self, q_nope, q_pe, latent, k_pe, mask, offset, q_lengths, kv_lengths,
                  return_weights, chosen=None):
        """Per-head keys [k_nope | k_pe] (B, N, Lk, Dk) and values (B, N, Lk, Dv) from the
        latent (B, 1, Lk, r) through W_kv_b, then the core."""
        kv = self._split(self.W_kv_b(latent[..., 0, :, :]), self.nope + self.v_head_dim)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        # the one rotary key head for every head, placed as k_nope's heads (under explicit mesh
        # axes, jax_attn.sharding: split by head; elsewhere the partitioner decides)
        spec = explicit_spec(k_nope)
        k_pe = jnp.broadcast_to(k_pe, k_nope.shape[:-1] + (self.rope,),
                                out_sharding=None if spec is None else jax.typeof(k_nope).sharding)
        k = jnp.concatenate([k_nope, k_pe], -1)
        return scaled_dot_product_attention(
            jnp.concatenate([q_nope, q_pe], -1), k, v, mask, is_causal=self.causal,
            scale=self.scale, local_window_size=self.window, query_offset=offset,
            query_seq_lengths=q_lengths,
            key_value_seq_lengths=kv_lengths, return_weights=return_weights,
            precision=self.precision, key_indices=chosen, **self._sinks())

    def _absorbed(self, q_nope, q_pe, latent, k_pe, mask, offset, q_lengths, kv_lengths,
                  return_weights, chosen=None):
        """W_kv_b's key half W_kb (r, N, Dn) folded into the query, q_lat (B, N, L, r); the
        core on one key-value head, keys [c | k_pe] (B, 1, Lk, r + Dr), values c; the result
        (B, N, L, r) through W_kv_b's value half W_vb (r, N, Dv)."""
        w = self.W_kv_b.kernel.get_value()
        w = w.reshape(w.shape[0], self.num_heads, -1)            # (r, N, Dn + Dv)
        w_kb, w_vb = w[..., :self.nope], w[..., self.nope:]
        q_lat = jnp.einsum("...nld,rnd->...nlr", q_nope, w_kb, precision=self.precision)
        o = scaled_dot_product_attention(
            jnp.concatenate([q_lat, q_pe], -1), jnp.concatenate([latent, k_pe], -1), latent,
            mask, is_causal=self.causal, scale=self.scale, local_window_size=self.window,
            query_offset=offset, query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
            return_weights=return_weights, precision=self.precision, key_indices=chosen,
            **self._sinks())
        o, w_ = o if return_weights else (o, None)
        o = jnp.einsum("...nlr,rnv->...nlv", o, w_vb, precision=self.precision)
        return (o, w_) if return_weights else o

    def _sinks(self) -> dict:
        """The core's ``sinks`` (N,) when the module has them (one per query head, on the
        absorbed path's one latent "head" too)."""
        return {} if self.sinks is None else {"sinks": self.sinks.get_value()}

    def _gated(self, merged, x):
        """The heads' output merged (B, L, N·Dv) times act(x W_gate), as torch_attn's."""
        compute = jnp.promote_types(merged.dtype, jnp.float32)
        return gated_output(merged, self.W_gate(x), self.gate, self.num_heads,
                            sigmoid=jax.nn.sigmoid, softplus=lambda z: jax.nn.softplus(
                                z.astype(compute)).astype(z.dtype))

    def _query(self, x):
        """(q (B, L, N·Dk), q_resid, q_in): x W_query, None, None; or q_in W_q_b, the query's
        latent q_resid = RMSNorm(c_q), c_q = x W_q_a + b_q_a (B, L, q_lora_rank), and q_in =
        q_resid (``query_latent`` "normed_and_raw": [q_resid | c_q], AXK2's)."""
        if self.W_query is not None:
            return self.W_query(x), None, None
        c_q = self.W_q_a(x)
        q_resid = self._norm(c_q, self.q_a_norm)
        q_in = jnp.concatenate([q_resid, c_q], -1) if self.both else q_resid
        return self.W_q_b(q_in), q_resid, q_in

    def _split(self, y, width):
        """(B, L, N·width) -> (B, N, L, width)."""
        y = y.reshape(y.shape[:-1] + (self.num_heads, width))  # (B, L, N, width)
        return jnp.swapaxes(y, -2, -3)

    def _norm(self, t, weight):
        """RMSNorm of t times ``weight``, computed in at least float32, rounded once to t's
        dtype."""
        compute = jnp.promote_types(t.dtype, jnp.float32)
        return qk_normalize(t.astype(compute), "rms", weight.get_value().astype(compute),
                            self.rms_norm_eps, mean=lambda a: a.mean(-1, keepdims=True),
                            rsqrt=jax.lax.rsqrt).astype(t.dtype)


def _select_keys(scores, allowed, k):
    """key_indices (..., Lq, k) int32: each row's k highest ``scores`` (..., Lq, Lk) among its
    ``allowed`` keys, best first, equal scores won by the lowest key index, then the keys it
    may not see, lowest index first (golden.reference.indexer.select_keys's rule): ``lax.top_k``
    orders equal values by index, but -0.0 before 0.0, so zeros are made 0.0 first (by a
    select: XLA folds x + 0.0 away), and the unseen keys are put at -inf."""
    scores = jnp.where(scores == 0, 0, scores)
    return jax.lax.top_k(jnp.where(allowed, scores, -jnp.inf), k)[1]


def _as_kv(cache) -> KVCache:
    """A LatentCache seen as a KVCache of one head (B, 1, M, ·), for _cache_positions and
    _append (shared with GroupedQueryAttention)."""
    return KVCache(cache.latent[:, None], cache.rope_key[:, None], cache.lengths)

"""MultiHeadLatentAttention (MLA), the twin of torch_attn.modules.latent's, whose class docstring
gives the maths: its latent cache a pytree, appended to with GroupedQueryAttention's
``_cache_positions`` and ``_append`` (the latent seen as one key-value head), and ``absorb`` a
compiled program of its own. Shape legend as in jax_attn.modules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from golden.specification import variants
from golden.specification.decoder import qk_normalize
from golden.specification.outputs import gate_kind, gated_output
from golden.specification.positions import KVCache, LatentCache
from golden.specification.validate import (
    cache_shape, check_flags, check_latent_inputs, rope_arguments,
)
from jax_attn.functional import DEFAULT_PRECISION, scaled_dot_product_attention
from jax_attn.modules.base import (_head_mask, _linear, _merge_heads, _query_temperature,
                                   _Variant)
from jax_attn.modules.grouped_query import _append, _cache_positions
from jax_attn.rotary import rotary_embedding
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
    """

    variant = "multi_head_latent_attention"

    def __init__(self, d_in, num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                 v_head_dim, q_lora_rank=None, d_out=None, attention_bias=False,
                 rms_norm_eps=1e-6, rope_theta=None, rope_parameters=None, rope_interleaved=True,
                 causal=True, scale=None, query_temperature=None, rope=True, sinks=False,
                 output_gate=False, index_topk=None, index_heads=None, index_head_dim=None,
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
                        output_gate=output_gate,
                        index_topk=index_topk, index_heads=index_heads,
                        index_head_dim=index_head_dim, index_rope=index_rope,
                        index_rope_dims=index_rope_dims, index_query=index_query,
                        index_temperature=index_temperature, index_scale=index_scale,
                        index_norm_eps=index_norm_eps, index_select=index_select)
        if index_topk is not None:  # issue 44: the indexer is golden.reference's alone so far
            raise NotImplementedError("index_topk: jax_attn's MultiHeadLatentAttention has no "
                                      "learned indexer yet (golden.reference.indexer has it)")
        self.W_index_q = self.W_index_k = self.W_index_weights = None
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
        self.W_q_b = _linear(q_lora_rank, num_heads * qk, False, rngs, precision) if lora else None
        self.W_kv_a = _linear(d_in, kv_lora_rank + qk_rope_head_dim, bias, rngs, precision)
        self.kv_a_norm = nnx.Param(jnp.ones((kv_lora_rank,)))
        self.W_kv_b = _linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), False,
                              rngs, precision)
        self.out_proj = _linear(num_heads * v_head_dim, sizes["d_out"], bias, rngs, precision)
        self.use_rope = rope  # False: q_pe and k_pe not turned (Kimi Linear)
        self.query_temperature = (None if query_temperature is None else tuple(
            sorted(query_temperature.items())))  # Mistral Small 4's, after RoPE; static
        starts = variants.vector_starts(self.variant, self.config)  # the learned kind's
        for n in ("temperature_scale", "temperature_bias", "sinks"):  # sinks: HY-V4's
            setattr(self, n, nnx.Param(jnp.full(*starts[n])) if n in starts else None)
        self.gate = gate_kind(output_gate)  # (activation, per head) or None: static
        self.W_gate = None if self.gate is None else _linear(
            d_in, num_heads if self.gate[1] else num_heads * v_head_dim, False, rngs, precision)

    def init_cache(self, batch_size, max_length, dtype=None) -> LatentCache:
        """An empty cache: latent zeros (B, max_length, kv_lora_rank), rope_key zeros (B,
        max_length, qk_rope_head_dim) in ``dtype`` (default the parameters'), lengths zeros
        (B,) int32."""
        cache_shape(batch_size, max_length, 1, 1)  # checks the sizes
        dtype = self.W_kv_a.kernel.get_value().dtype if dtype is None else dtype
        return LatentCache(jnp.zeros((batch_size, max_length, self.kv_lora_rank), dtype),
                           jnp.zeros((batch_size, max_length, self.rope), dtype),
                           jnp.zeros((batch_size,), jnp.int32))

    def cache_bytes_per_token(self, dtype=None) -> int:
        """Bytes the cache holds per token and layer: (kv_lora_rank + qk_rope_head_dim) ·
        itemsize of ``dtype`` (default the parameters'), whatever num_heads."""
        dtype = self.W_kv_a.kernel.get_value().dtype if dtype is None else dtype
        return (self.kv_lora_rank + self.rope) * jnp.dtype(dtype).itemsize

    def __call__(self, x, mask=None, *, cache=None, query_seq_lengths=None, positions=None,
                 return_weights=False, absorb=False):
        check_flags(absorb=absorb)
        return self._call(x, mask, cache=cache, query_seq_lengths=query_seq_lengths,
                          positions=positions, return_weights=return_weights, absorb=absorb)

    @nnx.jit(graph=False, static_argnames=("return_weights", "absorb"))
    def _call(self, x, mask=None, *, cache=None, query_seq_lengths=None, positions=None,
              return_weights=False, absorb=False):
        check_latent_inputs(x, self.d_in, mask, query_seq_lengths, heads=self.num_heads,
                            positions=positions, cache=cache, kv_lora_rank=self.kv_lora_rank,
                            rope_dim=self.rope)
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
                      for t in (q[..., self.nope:], k_pe)) if self.use_rope else (
            q[..., self.nope:], k_pe)
        q_nope = q[..., :self.nope]
        if self.query_temperature is not None:  # both parts of q, at the tokens' positions
            q_nope, q_pe = (_query_temperature(self, t, offset, positions)
                            for t in (q_nope, q_pe))
        latent = latent[..., None, :, :]                         # (B, 1, L, r)
        if cache is not None:
            held = _append(held, latent, k_pe, q_lengths)
            latent, k_pe = held.key, held.value                  # (B, 1, M, r), (B, 1, M, Dr)
            cache = LatentCache(latent[:, 0], k_pe[:, 0], held.lengths)
        head_mask = _head_mask(mask, x)  # (B, 1 or N, L, Lk)
        attend = self._absorbed if absorb else self._expanded
        o = attend(q_nope, q_pe, latent, k_pe, head_mask, offset, q_lengths,
                   kv_lengths, return_weights)                   # (B, N, L, Dv)
        o, w = o if return_weights else (o, None)
        y = _merge_heads(self.out_proj, o, None if self.W_gate is None else (  # (B, L, d_out)
            lambda merged: self._gated(merged, x)))
        out = (y, w) if return_weights else y
        return out if cache is None else (out, cache)

    def _expanded(self, q_nope, q_pe, latent, k_pe, mask, offset, q_lengths, kv_lengths,
                  return_weights):
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
            scale=self.scale, query_offset=offset, query_seq_lengths=q_lengths,
            key_value_seq_lengths=kv_lengths, return_weights=return_weights,
            precision=self.precision, **self._sinks())

    def _absorbed(self, q_nope, q_pe, latent, k_pe, mask, offset, q_lengths, kv_lengths,
                  return_weights):
        """W_kv_b's key half W_kb (r, N, Dn) folded into the query, q_lat (B, N, L, r); the
        core on one key-value head, keys [c | k_pe] (B, 1, Lk, r + Dr), values c; the result
        (B, N, L, r) through W_kv_b's value half W_vb (r, N, Dv)."""
        w = self.W_kv_b.kernel.get_value()
        w = w.reshape(w.shape[0], self.num_heads, -1)            # (r, N, Dn + Dv)
        w_kb, w_vb = w[..., :self.nope], w[..., self.nope:]
        q_lat = jnp.einsum("...nld,rnd->...nlr", q_nope, w_kb, precision=self.precision)
        o = scaled_dot_product_attention(
            jnp.concatenate([q_lat, q_pe], -1), jnp.concatenate([latent, k_pe], -1), latent,
            mask, is_causal=self.causal, scale=self.scale, query_offset=offset,
            query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
            return_weights=return_weights, precision=self.precision, **self._sinks())
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
        """(B, L, N·Dk): x W_query, or RMSNorm(x W_q_a + b_q_a) W_q_b."""
        if self.W_query is not None:
            return self.W_query(x)
        return self.W_q_b(self._norm(self.W_q_a(x), self.q_a_norm))

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


def _as_kv(cache) -> KVCache:
    """A LatentCache seen as a KVCache of one head (B, 1, M, ·), for _cache_positions and
    _append (shared with GroupedQueryAttention)."""
    return KVCache(cache.latent[:, None], cache.rope_key[:, None], cache.lengths)

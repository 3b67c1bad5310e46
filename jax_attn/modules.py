"""Flax NNX attention variants, twins of ``torch_attn.modules``. Each computes attention through
``jax_attn.scaled_dot_product_attention``; they differ only in how they make q, k, v and what
they do with the result.

Shape legend: B batch, L sequence length (Lq queries, Lk keys), N heads, Dh head width,
d_* feature widths. Inputs are (B, L, d) or (L, d). Masks are bool, True = may attend, and
broadcast to (B, Lq, Lk); multi-head modules apply them to every head.
Parameters are ``nnx.Linear`` layers named W_query, W_key, W_value (and out_proj); their kernels
are already in the neutral (in, out) layout. Dropout is active unless ``deterministic`` is True
(``module.eval()``); it draws from the ``dropout`` stream of the ``rngs`` given at construction.
The constructors take the PyTorch twin's arguments plus ``rngs`` and ``precision`` (keyword-only;
``precision`` reaches every dot, projections included).

Execution: every ``__call__`` is plain code from the projections to the core, compiled with
``nnx.jit(graph=False)``: an eager call runs one compiled program (the module's arrays traced,
its settings static), and whatever the call changes in the module (the dropout stream's counter)
is written back. Inside a caller's ``nnx.jit``, ``nnx.grad``, ``nnx.vmap`` or optax step the
inner ``jit`` is inlined and NNX carries the same updates through.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from golden import variants
from golden.decoder import (
    alibi_slopes,
    bucket_table,
    qk_normalize,
    temperature,
    weight_broadcast,
)
from golden.decoder import sliding_window as core_window
from golden.positions import ContextCache, KVCache, LatentCache, check_fits, context_fingerprint
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
from jax_attn.functional import DEFAULT_PRECISION, scaled_dot_product_attention
from jax_attn.rotary import rotary_embedding
from jax_attn.sharding import explicit_spec

__all__ = ["CausalSelfAttention", "CrossAttention", "GroupedQueryAttention", "MultiHeadAttention",
           "MultiHeadAttentionWrapper", "MultiHeadCrossAttention",
           "MultiHeadLatentAttention", "SelfAttention", "SimpleSelfAttention"]

# Compiles a module's __call__: the module is a pytree (graph=False, the fast path: no shared
# submodules here), ``return_weights`` changes the program's outputs, so it is static.
compiled_call = nnx.jit(graph=False, static_argnames="return_weights")


def _check_rngs(rngs) -> None:
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"rngs should be a flax.nnx.Rngs (nnx.Rngs(seed)), got "
                        f"{type(rngs).__name__}")


def _linear(d_in, d_out, bias, rngs, precision):
    _check_rngs(rngs)
    return nnx.Linear(d_in, d_out, use_bias=bias, precision=precision, rngs=rngs)


class _Variant(nnx.Module):
    """What every variant shares: its checked configuration and its dropout stream."""

    variant: str
    dropout = 0.0

    def _configure(self, **given) -> None:
        """Check the constructor arguments (golden.variants); kept as a hashable tuple, because
        a module's plain attributes are static under jit."""
        self._config = tuple((n, variants.freeze(v))
                             for n, v in VARIANTS[self.variant].config(given).items())

    @property
    def config(self) -> dict:
        """The constructor arguments (what ``build`` needs besides the parameters)."""
        return {n: variants.thaw(v) for n, v in self._config}

    def _init_dropout(self, dropout, rngs):
        self.dropout = dropout
        self.deterministic = False
        self.seed_dropout(rngs)

    def seed_dropout(self, rngs) -> None:
        """A fresh dropout stream forked from ``rngs`` (none when dropout is 0)."""
        _check_rngs(rngs)
        self.dropout_rngs = rngs["dropout"].fork() if self.dropout > 0 else nnx.data(None)

    def _rate(self) -> float:
        return 0.0 if getattr(self, "deterministic", True) else self.dropout

    def _dropout_key(self, dropout_mask):
        """A fresh key from the dropout stream when dropout is active and no dropout mask is
        given, else None."""
        return self.dropout_rngs() if self._rate() > 0 and dropout_mask is None else None


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
    (MPT, OLMo: q, k and v clamped to [−c, c] after their projections).

    With ``cache`` (from ``init_cache``, a pytree), token i of row b is at position
    cache.lengths[b] + i: its key and value are written there (a scatter, in place when the
    caller's jit donates the cache), it attends the cached keys and this call's (bottom-right
    causal), RoPE turns it by that position, and the call returns (output, new cache). The
    lengths are traced, so a decode step compiles once per max_length. Tokens that do not fit
    in max_length are dropped, as in torch_attn: they are not written nor counted, and their
    output rows are those of padding; query_seq_lengths are clipped to [0, L]. ``strict=True``
    raises ValueError instead (golden.positions.check_fits), reading the lengths on the host: a
    device sync, and impossible on traced lengths (under jit it raises saying so).
    """

    variant = "grouped_query_attention"

    def __init__(self, d_in, num_heads, num_kv_heads, head_dim=None, d_out=None, qkv_bias=False,
                 out_bias=False, causal=True, scale=None, softcap=None, sliding_window=None,
                 rope_theta=None, rope_interleaved=False, dropout=0.0, qk_norm=None,
                 qk_norm_eps=1e-6, sinks=False, attention_chunk_size=None,
                 query_temperature=None, output_gate=False, rope_parameters=None,
                 partial_rotary_factor=1.0, rope_precision="exact", alibi=None,
                 alibi_bias_max=8, relative_attention_num_buckets=None,
                 relative_attention_max_distance=128, clip_qkv=None, *, rngs,
                 precision=DEFAULT_PRECISION):
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
                        clip_qkv=clip_qkv)
        self.clip_qkv = clip_qkv
        self.rotary = rope_settings(rope_theta, rope_parameters, partial_rotary_factor,
                                    rope_precision)  # None without RoPE; hashable (static)
        self.d_in, self.num_heads, self.num_kv_heads = d_in, num_heads, num_kv_heads
        self.head_dim = variants.head_dim(self.config)
        self.causal, self.scale, self.softcap = causal, scale, softcap
        self.local_window_size = core_window(sliding_window, causal)
        self.rope_theta, self.rope_interleaved = rope_theta, rope_interleaved
        self.qk_norm, self.qk_norm_eps = qk_norm, qk_norm_eps
        self.attention_chunk_size = attention_chunk_size
        self.alibi = alibi
        self.alibi_slopes = None if alibi is None else tuple(
            alibi_slopes(num_heads, alibi, alibi_bias_max).tolist())  # (N,): static, hashable
        self.query_temperature = (None if query_temperature is None else tuple(
            query_temperature[n] for n in variants.TEMPERATURE_FIELDS))  # static: hashable
        self.precision = precision
        self._init_dropout(dropout, rngs)
        width, kv_width = num_heads * self.head_dim, num_kv_heads * self.head_dim
        self.W_query = _linear(d_in, width, qkv_bias, rngs, precision)
        self.W_key = _linear(d_in, kv_width, qkv_bias, rngs, precision)
        self.W_value = _linear(d_in, kv_width, qkv_bias, rngs, precision)
        self.W_gate = _linear(d_in, width, qkv_bias, rngs, precision) if output_gate else None
        self.out_proj = _linear(width, d_in if d_out is None else d_out, out_bias, rngs, precision)
        shapes = VARIANTS[self.variant].shapes(self.config)
        start = 0.0 if qk_norm == "rms_one_plus" else 1.0  # the weight that changes nothing
        self.buckets = (relative_attention_num_buckets, relative_attention_max_distance)
        self.q_norm, self.k_norm, self.sinks, self.relative_attention_bias = (
            nnx.Param(jnp.full(shapes[n], start if n.endswith("norm") else 0.0))
            if n in shapes else None
            for n in ("q_norm", "k_norm", "sinks", "relative_attention_bias"))

    def init_cache(self, batch_size, max_length, dtype=None) -> KVCache:
        """An empty cache: key and value zeros (B, Nkv, max_length, Dh) in ``dtype`` (default the
        parameters'), lengths zeros (B,) int32."""
        shape = cache_shape(batch_size, max_length, self.num_kv_heads, self.head_dim)
        dtype = self.W_query.kernel.get_value().dtype if dtype is None else dtype
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                       jnp.zeros((batch_size,), jnp.int32))

    def __call__(self, x, mask=None, *, cache=None, query_seq_lengths=None, positions=None,
                 dropout_mask=None, return_weights=False, strict=False):
        check_flags(strict=strict)
        if strict and cache is not None:
            self._check_fits(x, cache, query_seq_lengths, dropout_mask, mask)
        return self._call(x, mask, cache=cache, query_seq_lengths=query_seq_lengths,
                          positions=positions, dropout_mask=dropout_mask,
                          return_weights=return_weights)

    def _check_fits(self, x, cache, query_seq_lengths, dropout_mask, mask):
        """strict=True: the lengths read on the host (as torch does), ValueError when the call's
        tokens do not fit (golden.positions.check_fits); impossible on traced lengths."""
        check_decoder_inputs(x, self.d_in, mask, dropout_mask, query_seq_lengths,
                             heads=self.num_heads, rate=self._rate(), cache=cache,
                             kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        new = x.shape[-2] if query_seq_lengths is None else query_seq_lengths
        if any(isinstance(a, jax.core.Tracer) for a in (cache.lengths, new)):
            raise ValueError("strict=True reads the cache's lengths on the host, but they are "
                             "traced here (under jit): call the module outside jit, or pass "
                             "strict=False (tokens that do not fit are then dropped)")
        check_fits(np.asarray(cache.lengths), np.asarray(new), cache.key.shape[2], x.shape[-2])

    @compiled_call
    def _call(self, x, mask=None, *, cache=None, query_seq_lengths=None, positions=None,
              dropout_mask=None, return_weights=False):
        rate = self._rate()
        check_decoder_inputs(x, self.d_in, mask, dropout_mask, query_seq_lengths,
                             heads=self.num_heads, rate=rate, cache=cache,
                             kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                             positions=positions)
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
        head_mask = None if mask is None else mask[..., None, :, :]  # (B, 1, L, Lk)
        o = scaled_dot_product_attention(
            q, k, v, head_mask, distance_bias=self._position_bias(q, k.shape[-2]),
            is_causal=self.causal, scale=self.scale, softcap=self.softcap,
            local_window_size=self.local_window_size, query_offset=offset,
            query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths, dropout_rate=rate,
            dropout_mask=dropout_mask, dropout_rng=self._dropout_key(dropout_mask),
            return_weights=return_weights, precision=self.precision, **self._extra())
        o, w = o if return_weights else (o, None)
        gate = None if self.W_gate is None else jax.nn.sigmoid(self.W_gate(x))  # (B, L, N·Dh)
        y = _merge_heads(self.out_proj, o, gate)  # (B, L, d_out)
        out = (y, w) if return_weights else y
        return out if cache is None else (out, cache)

    def _clip(self, y):
        """MPT's and OLMo's clip_qkv: a projection clamped to [−c, c] (None: as it is)."""
        return y if self.clip_qkv is None else jnp.clip(y, -self.clip_qkv, self.clip_qkv)

    def _split(self, y, heads):
        """(B, L, heads·Dh) -> (B, heads, L, Dh)."""
        y = y.reshape(y.shape[:-1] + (heads, self.head_dim))  # (B, L, heads, Dh)
        return jnp.swapaxes(y, -2, -3)

    def _extra(self) -> dict:
        """The core's sinks and attention_chunk_size, when the module has them."""
        extra = {"sinks": None if self.sinks is None else self.sinks.get_value(),
                 "attention_chunk_size": self.attention_chunk_size}
        return {n: a for n, a in extra.items() if a is not None}

    def _norm(self, t, weight):
        """The QK norm of t, computed in at least float32 and rounded once to t's dtype."""
        compute = jnp.promote_types(t.dtype, jnp.float32)
        w = None if weight is None else weight_broadcast(self.qk_norm,
                                                         weight.get_value().astype(compute))
        return qk_normalize(t.astype(compute), self.qk_norm, w, self.qk_norm_eps,
                            mean=lambda a: a.mean(-1, keepdims=True),
                            rsqrt=jax.lax.rsqrt).astype(t.dtype)

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

    def _temperature(self, q, offset, positions):
        """q times the query temperature at each token's position (``positions``, or index +
        offset)."""
        compute = jnp.promote_types(q.dtype, jnp.float32)
        if positions is None:
            positions = jnp.arange(q.shape[-2])  # (L,)
            if offset is not None:
                positions = positions + offset[:, None]  # (B, L)
        factors = temperature(positions, *self.query_temperature,
                              log1p=lambda n: jnp.log1p(n.astype(compute)))
        factors = factors[..., None] if factors.ndim == 1 else factors[:, None, :, None]
        return (q.astype(compute) * factors).astype(q.dtype)  # (L, 1) or (B, 1, L, 1)



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

    With ``cache`` (from ``context_cache``, a pytree), the cached keys and values are used and
    ``context`` may be None; if it is given, it must be the context the cache was made from:
    its shape is checked always, its fingerprint (golden.positions.context_fingerprint, to
    1000 ulps: XLA may sum in another order in another program) where the values are concrete
    (an eager call; not under the caller's jit, where they are traced).
    """

    variant = "multi_head_cross_attention"

    def __init__(self, d_in, d_context, num_heads, num_kv_heads=None, head_dim=None, d_out=None,
                 qkv_bias=False, key_bias=None, out_bias=False, scale=None, *, rngs,
                 precision=DEFAULT_PRECISION):
        self._configure(d_in=d_in, d_context=d_context, num_heads=num_heads,
                        num_kv_heads=num_kv_heads, head_dim=head_dim, d_out=d_out,
                        qkv_bias=qkv_bias, key_bias=key_bias, out_bias=out_bias, scale=scale)
        sizes = variants.cross_sizes(self.config)
        self.d_in, self.d_context, self.num_heads = d_in, d_context, num_heads
        self.num_kv_heads, self.head_dim = sizes["num_kv_heads"], sizes["head_dim"]
        self.scale, self.precision = scale, precision
        width, kv_width = num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.W_query = _linear(d_in, width, qkv_bias, rngs, precision)
        self.W_key = _linear(d_context, kv_width, sizes["key_bias"], rngs, precision)
        self.W_value = _linear(d_context, kv_width, qkv_bias, rngs, precision)
        self.out_proj = _linear(width, sizes["d_out"], out_bias, rngs, precision)

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
        return self._split(self.W_key(context)), self._split(self.W_value(context)), lengths

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
        q = self._split(self.W_query(x))                       # (B, N, Lq, Dh)
        head_mask = None if mask is None else mask[..., None, :, :]  # (B, 1, Lq, Lc)
        o = scaled_dot_product_attention(q, k, v, head_mask, scale=self.scale,
                                         key_value_seq_lengths=lengths,
                                         return_weights=return_weights, precision=self.precision)
        o, w = o if return_weights else (o, None)
        y = _merge_heads(self.out_proj, o)                     # (B, Lq, d_out)
        return (y, w) if return_weights else y

    def _split(self, y):
        """(B, L, heads·Dh) -> (B, heads, L, Dh)."""
        y = y.reshape(y.shape[:-1] + (-1, self.head_dim))      # (B, L, heads, Dh)
        return jnp.swapaxes(y, -2, -3)


class MultiHeadLatentAttention(_Variant):
    """Multi-head latent attention (MLA) as DeepSeek-V2/V3 and Kimi K2 write it (transformers'
    DeepseekV3Attention): keys and values made per head from one small latent per token, which
    is all a cache holds. The twin of torch_attn's (its docstring gives the maths): the same
    arguments, plus ``rngs`` and ``precision`` (every dot, projections and the absorbed
    products included).

    With ``cache`` (from ``init_cache``, golden.positions.LatentCache, a pytree) the call
    appends each token's normalised latent and rotated k_pe (a scatter; the lengths traced, so a
    decode step compiles once per max_length) and returns (output, new cache). ``absorb=True``
    folds W_kv_b into the query and the output (static: its own compiled program).
    """

    variant = "multi_head_latent_attention"

    def __init__(self, d_in, num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                 v_head_dim, q_lora_rank=None, d_out=None, attention_bias=False,
                 rms_norm_eps=1e-6, rope_theta=None, rope_parameters=None, rope_interleaved=True,
                 causal=True, scale=None, *, rngs, precision=DEFAULT_PRECISION):
        self._configure(d_in=d_in, num_heads=num_heads, kv_lora_rank=kv_lora_rank,
                        qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
                        v_head_dim=v_head_dim, q_lora_rank=q_lora_rank, d_out=d_out,
                        attention_bias=attention_bias, rms_norm_eps=rms_norm_eps,
                        rope_theta=rope_theta, rope_parameters=rope_parameters,
                        rope_interleaved=rope_interleaved, causal=causal, scale=scale)
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
                      for t in (q[..., self.nope:], k_pe))
        latent = latent[..., None, :, :]                         # (B, 1, L, r)
        if cache is not None:
            held = _append(held, latent, k_pe, q_lengths)
            latent, k_pe = held.key, held.value                  # (B, 1, M, r), (B, 1, M, Dr)
            cache = LatentCache(latent[:, 0], k_pe[:, 0], held.lengths)
        head_mask = None if mask is None else mask[..., None, :, :]  # (B, 1, L, Lk)
        attend = self._absorbed if absorb else self._expanded
        o = attend(q[..., :self.nope], q_pe, latent, k_pe, head_mask, offset, q_lengths,
                   kv_lengths, return_weights)                   # (B, N, L, Dv)
        o, w = o if return_weights else (o, None)
        y = _merge_heads(self.out_proj, o)                       # (B, L, d_out)
        out = (y, w) if return_weights else y
        return out if cache is None else (out, cache)

    def _expanded(self, q_nope, q_pe, latent, k_pe, mask, offset, q_lengths, kv_lengths,
                  return_weights):
        """Per-head keys [k_nope | k_pe] (B, N, Lk, Dk) and values (B, N, Lk, Dv) from the
        latent (B, 1, Lk, r) through W_kv_b, then the core."""
        kv = self._split(self.W_kv_b(latent[..., 0, :, :]), self.nope + self.v_head_dim)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, k_nope.shape[:-1] + (self.rope,))],
                            -1)
        return scaled_dot_product_attention(
            jnp.concatenate([q_nope, q_pe], -1), k, v, mask, is_causal=self.causal,
            scale=self.scale, query_offset=offset, query_seq_lengths=q_lengths,
            key_value_seq_lengths=kv_lengths, return_weights=return_weights,
            precision=self.precision)

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
            return_weights=return_weights, precision=self.precision)
        o, w_ = o if return_weights else (o, None)
        o = jnp.einsum("...nlr,rnv->...nlv", o, w_vb, precision=self.precision)
        return (o, w_) if return_weights else o

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


def _fingerprint(context):
    """golden.positions.context_fingerprint of ``context`` in at least float32."""
    compute = jnp.promote_types(context.dtype, jnp.float32)
    return context_fingerprint(jax.lax.stop_gradient(context).astype(compute), jnp.stack)


def _same_fingerprint(a, b) -> bool:
    """Whether two fingerprints (..., 4) agree to 1000 ulps of their largest entry per row: XLA
    may order a sum differently in another program (the cache made under the caller's jit)."""
    a, b = np.asarray(a), np.asarray(b)
    tol = 1000 * np.finfo(a.dtype).eps * np.abs(b).max(axis=-1, keepdims=True)
    return a.shape == b.shape and bool((np.abs(a - b) <= tol).all())

def _merge_heads(out_proj, o, gate=None):
    """out_proj of the heads' outputs o (B, N, L, Dh) side by side, (B, L, N·Dh) -> (B, L, d_out),
    times ``gate`` (B, L, N·Dh) first when given. With the heads split over a mesh axis
    (jax_attn.sharding: out_proj row-parallel) the product sums over devices, and explicit mesh
    axes ask where its result lies: as o's batch and length, the features whole on every device
    (the all-reduce Megatron's layout implies)."""
    merged = jnp.swapaxes(o, -2, -3)  # (B, L, N, Dh)
    merged = merged.reshape(merged.shape[:-2] + (-1,))  # (B, L, N·Dh)
    if gate is not None:
        merged = merged * gate
    spec = explicit_spec(merged)
    out = None if spec is None else jax.typeof(merged).sharding.update(
        spec=jax.sharding.PartitionSpec(*spec[:-1], None))  # on merged's (abstract) mesh
    return out_proj(merged, out_sharding=out)


def _cache_positions(cache, length, query_seq_lengths):
    """(query offset, query lengths, key lengths) of a call of ``length`` tokens appended to
    ``cache``: row b's tokens at lengths[b] + i, the real ones (i < query_seq_lengths[b],
    clipped to [0, L]) counted, and of those only the ones that fit in max_length."""
    held, room = cache.lengths, cache.key.shape[2]
    new = (jnp.full_like(held, length) if query_seq_lengths is None
           else jnp.clip(query_seq_lengths.astype(held.dtype), 0, length))
    new = jnp.clip(new, 0, room - held)  # what does not fit is dropped
    return held, new, held + new


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

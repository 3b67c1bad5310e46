"""A third implementation of every variant, in plain NumPy, run through the harness by
``tests/test_impl.py`` (and ``attn-parity check --impl tests.port_numpy:RUNNER``).

Written from the README's definitions, not from ``golden.reference`` nor either framework:

    scores   s = cap(scale · Q Kᵀ + T) + bias,  cap(s) = c·tanh(s/c) with softcap c (none if
             None), T a module's relative position term (Transformer-XL's, the Conformer's)
    allowed  mask (True = may attend) ∧ causal (key j ≤ query position p = i + query_offset)
             ∧ window (p − left ≤ j ≤ p + right) ∧ chunk (j // C = p // C)
             ∧ j < key_value_seq_lengths[b] ∧ i < query_seq_lengths[b]
    weights  softmax of s over the allowed keys (a row with none: zeros), times keep / (1 − p);
             with sinks, head h's logit s_h joins each row's softmax and its column is dropped
    output   weights V

Everything runs in the inputs' dtype (float32 or float64); only RoPE's angles are float64, as
the project's own are, rounded once to that dtype. One mistake can be planted by overriding one
hook of :class:`Attention` (the test's mutants).

Shape legend: B batch, H query heads, Hkv key/value heads, G = H / Hkv, Lq query length,
Lk key length, L sequence length, Dk key width, Dv value width, N module heads, Nkv module
key/value heads, Dh head width, d_* feature widths.
"""

from __future__ import annotations

import inspect
import math

import numpy as np

from golden.specification import variants
from golden.specification.decoder import alibi_slopes, relative_position_bucket
from golden.specification.positions import rope_frequencies
from golden.runners.adapt import combine, from_function, from_module
from golden.specification.validate import rope_settings

CORE = "scaled_dot_product_attention"


class Attention:
    """The attention core as a NumPy object; :meth:`sdpa` is the function the harness runs."""

    # ---- hooks: one line each, the places a mutant overrides ----

    def default_scale(self, dk: int) -> float:
        """The scale when none is given: 1/√Dk."""
        return 1.0 / math.sqrt(dk)

    def user_mask(self, mask):
        """The caller's boolean mask as "may attend"."""
        return mask

    def causal_bound(self, position, lq: int, lk: int):
        """The last key position a query at ``position`` may see (top-left aligned)."""
        return position

    def dropout_scale(self, rate: float) -> float:
        """The factor on kept weights."""
        return 1.0 / (1.0 - rate)

    def softmax(self, scores, allowed):
        """Softmax over the allowed keys of each row (..., Lq, Lk); a row with none: zeros."""
        filled = np.where(allowed, scores, -np.inf)
        top = filled.max(axis=-1, keepdims=True)
        top = np.where(np.isfinite(top), top, 0)
        e = np.where(allowed, np.exp(filled - top), 0)
        total = e.sum(axis=-1, keepdims=True)
        return e / np.where(total > 0, total, 1)

    # ---- the core ----

    def sdpa(self, query, key, value, mask=None, bias=None, *, is_causal=False, scale=None,
             softcap=None, local_window_size=None, attention_chunk_size=None, query_offset=None,
             query_seq_lengths=None, key_value_seq_lengths=None, sinks=None, dropout_rate=0.0,
             dropout_mask=None, return_weights=False, position_term=None):
        """query (..., H, Lq, Dk), key (..., Hkv, Lk, Dk), value (..., Hkv, Lk, Dv) ->
        output (..., H, Lq, Dv) [, weights (..., H, Lq, Lk)]; (Lq, Dk) inputs work too.
        ``position_term`` (..., H, Lq, Lk): added before the cap."""
        scale = self.default_scale(query.shape[-1]) if scale is None else float(scale)
        scores = _grouped(query, np.swapaxes(key, -1, -2)) * scale  # (..., H, Lq, Lk)
        if position_term is not None:
            scores = scores + position_term
        if softcap is not None:
            scores = softcap * np.tanh(scores / softcap)  # after scaling, before bias and masks
        if bias is not None:
            scores = scores + bias
        allowed = self.allowed(scores.shape, mask, is_causal, local_window_size, query_offset,
                               query_seq_lengths, key_value_seq_lengths, attention_chunk_size)
        if sinks is None:
            weights = self.softmax(scores, allowed)
        else:  # softmax over [S, s_h], always allowed, then the sink's column dropped
            column = np.broadcast_to(np.reshape(sinks, np.shape(sinks) + (1, 1)),
                                     scores.shape[:-1] + (1,))
            every = np.concatenate([np.broadcast_to(allowed, scores.shape),
                                    np.ones(column.shape, bool)], axis=-1)
            weights = self.softmax(np.concatenate([scores, column], -1), every)[..., :-1]
        if dropout_mask is not None:
            weights = weights * dropout_mask * self.dropout_scale(dropout_rate)
        out = _grouped(weights, value)
        return (out, weights) if return_weights else out

    def allowed(self, shape, mask, is_causal, window, offset, q_lengths, kv_lengths,
                chunk=None):
        """Boolean (..., H, Lq, Lk): which key each query row may attend."""
        lq, lk = shape[-2:]
        i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]  # (Lq, 1), (1, Lk)
        position = i + _per_batch(offset, len(shape))  # (Lq, 1) or (B, 1, Lq, 1)
        allowed = np.ones(shape, dtype=bool)
        if mask is not None:
            allowed = allowed & self.user_mask(mask)
        if is_causal:
            allowed = allowed & (j <= self.causal_bound(position, lq, lk))
        left, right = _window(window)
        if left is not None:
            allowed = allowed & (j >= position - left)
        if right is not None:
            allowed = allowed & (j <= position + right)
        if chunk is not None:
            allowed = allowed & (j // chunk == position // chunk)
        if kv_lengths is not None:
            allowed = allowed & (j < _per_batch(kv_lengths, len(shape)))
        if q_lengths is not None:
            allowed = allowed & (i < _per_batch(q_lengths, len(shape)))
        return allowed


def _grouped(a, b):
    """a (..., H, M, K) @ b (..., Hkv, K, P) -> (..., H, M, P), query head h reading b's head
    h // G; a plain matmul when the heads agree (or there is no head axis)."""
    if a.ndim < 3 or a.shape[-3] == b.shape[-3]:
        return a @ b
    h, hkv = a.shape[-3], b.shape[-3]
    a = a.reshape(a.shape[:-3] + (hkv, h // hkv) + a.shape[-2:])  # (..., Hkv, G, M, K)
    out = a @ b[..., :, None, :, :]                                # (..., Hkv, G, M, P)
    return out.reshape(out.shape[:-4] + (h,) + out.shape[-2:])


def _per_batch(a, ndim):
    """0 for None, an int for a 0-d array, else (B,) reshaped to (B, 1, …) of ``ndim`` axes."""
    if a is None:
        return 0
    a = np.asarray(a)
    return int(a) if a.ndim == 0 else a.reshape((-1,) + (1,) * (ndim - 1))


def _window(w):
    """(left, right) from None, an int w (w, w), or a (left, right) pair (None: unbounded)."""
    if w is None:
        return None, None
    return (w, w) if isinstance(w, int) else tuple(w)


sdpa = Attention().sdpa  # the correct core as a function


# ---- the modules ------------------------------------------------------------------------------

class Linear:
    """y = x Wᵀ + b, torch's layout: weight (out, in), bias (out,) or None."""

    def __init__(self, d_in, d_out, bias=True):
        self.weight = np.zeros((d_out, d_in))
        self.bias = np.zeros(d_out) if bias else None

    def __call__(self, x):  # (..., in) -> (..., out)
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


class Module:
    """What every variant shares: the core it calls, training mode, its weight mapping."""

    layers: dict = {}  # neutral role -> attribute holding a Linear

    def __init__(self, core=None):
        self.core = core or Attention()
        self.training = True

    def train(self):
        self.training = True

    def eval(self):
        self.training = False

    def rate(self, dropout_mask) -> float:
        """The dropout rate in force: the configured one when training with a keep-mask."""
        return getattr(self, "dropout", 0.0) if self.training and dropout_mask is not None else 0.0

    def keep(self, dropout_mask):
        return dropout_mask if self.training else None

    def mapping(self) -> dict:
        """{neutral name: (attribute path, rule)}: each Linear's weight transposed."""
        table = {}
        for role, attr in self.layers.items():
            layer = getattr(self, attr)
            if layer is None:
                continue
            table[f"W_{role}"] = (f"{attr}.weight", "T")
            if layer.bias is not None:
                table[f"b_{role}"] = (f"{attr}.bias", "")
        return table


QKV = {"query": "q_proj", "key": "k_proj", "value": "v_proj"}


class SimpleSelfAttention(Module):
    """softmax(X Xᵀ) X, unscaled; x (..., L, d) -> (..., L, d), weights (..., L, L)."""

    def __call__(self, x, mask=None, *, return_weights=False):
        return self.core.sdpa(x, x, x, mask, scale=1.0, return_weights=return_weights)


class SelfAttention(Module):
    """One head: x (..., L, d_in) -> (..., L, d_v), weights (..., L, L)."""

    layers = QKV
    causal = False

    def __init__(self, d_in, d_k, d_v=None, qkv_bias=False, *, core=None):
        super().__init__(core)
        d_v = d_k if d_v is None else d_v
        self.q_proj, self.k_proj = Linear(d_in, d_k, qkv_bias), Linear(d_in, d_k, qkv_bias)
        self.v_proj = Linear(d_in, d_v, qkv_bias)

    def __call__(self, x, mask=None, *, dropout_mask=None, return_weights=False):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.core.sdpa(q, k, v, mask, is_causal=self.causal,
                              dropout_rate=self.rate(dropout_mask),
                              dropout_mask=self.keep(dropout_mask), return_weights=return_weights)


class CausalSelfAttention(SelfAttention):
    """SelfAttention with the causal mask and dropout on the weights."""

    causal = True

    def __init__(self, d_in, d_k, d_v=None, dropout=0.0, qkv_bias=False, *, core=None):
        super().__init__(d_in, d_k, d_v, qkv_bias, core=core)
        self.dropout = dropout


class CrossAttention(Module):
    """x_q (..., Lq, d_q_in), x_kv (..., Lk, d_kv_in) -> (..., Lq, d_v), weights (..., Lq, Lk)."""

    layers = QKV

    def __init__(self, d_q_in, d_kv_in, d_k, d_v=None, qkv_bias=False, *, core=None):
        super().__init__(core)
        d_v = d_k if d_v is None else d_v
        self.q_proj, self.k_proj = Linear(d_q_in, d_k, qkv_bias), Linear(d_kv_in, d_k, qkv_bias)
        self.v_proj = Linear(d_kv_in, d_v, qkv_bias)

    def __call__(self, x_q, x_kv, x_v=None, mask=None, *, return_weights=False):
        q, k = self.q_proj(x_q), self.k_proj(x_kv)
        v = self.v_proj(x_kv if x_v is None else x_v)
        return self.core.sdpa(q, k, v, mask, return_weights=return_weights)


def _temperature_factors(module, positions):
    """The module's query temperature at each position p, (..., 1 or N, L, 1): Llama 4's 1 +
    β ln(1 + ⌊(p + shift) / F⌋), Beam's (1 + (p + 1)/n)^α, Inkling's 1 + α ln(max((p + 1)/n,
    1)), Mistral Large 4's s_h ln(p + 1) + b_h."""
    t = module.temperature
    kind = t.get("kind", "llama4")
    if kind == "llama4":
        f = 1 + t["beta"] * np.log1p((positions + t["shift"]) // t["floor_scale"])
    elif kind == "power":
        f = (1 + (positions + 1) / t["length"]) ** t["alpha"]
    elif kind == "log":
        f = 1 + t["alpha"] * np.log(np.maximum((positions + 1) / t["length"], 1))
    else:  # positions (..., 1, L): the heads' axis is the 1
        f = (module.temperature_scale[:, None] * np.log(positions + 1.0)
             + module.temperature_bias[:, None])
    return f[..., None]


def _split(y, heads):
    """(..., L, heads·Dh) -> (..., heads, L, Dh)."""
    return np.swapaxes(y.reshape(y.shape[:-1] + (heads, -1)), -2, -3)


def _merge(o):
    """(..., N, L, Dh) -> (..., L, N·Dh)."""
    o = np.swapaxes(o, -2, -3)
    return o.reshape(o.shape[:-2] + (-1,))


def _head_mask(mask):
    """(..., Lq, Lk) -> (..., 1, Lq, Lk): the same mask for every head."""
    return None if mask is None else mask[..., None, :, :]


class MultiHeadAttentionWrapper(Module):
    """N independent heads, stacked per head torch-style: query_heads (N, Dh, d_in), biases
    (N, Dh); outputs concatenated (..., L, N·Dh), then out_proj when asked."""

    def __init__(self, d_in, d_head, num_heads, causal=False, dropout=0.0, qkv_bias=False,
                 out_proj=False, *, core=None):
        super().__init__(core)
        self.causal, self.dropout = causal, dropout
        for role in ("query", "key", "value"):
            setattr(self, f"{role}_heads", np.zeros((num_heads, d_head, d_in)))
            setattr(self, f"{role}_bias", np.zeros((num_heads, d_head)) if qkv_bias else None)
        width = num_heads * d_head
        self.out_proj = Linear(width, width) if out_proj else None

    def project(self, x, role):
        """x (..., L, d_in) -> (..., N, L, Dh) through every head's projection."""
        y = np.einsum("...ld,nhd->...nlh", x, getattr(self, f"{role}_heads"))
        bias = getattr(self, f"{role}_bias")
        return y if bias is None else y + bias[:, None, :]

    def __call__(self, x, mask=None, *, dropout_mask=None, return_weights=False):
        q, k, v = (self.project(x, role) for role in ("query", "key", "value"))
        o, w = self.core.sdpa(q, k, v, _head_mask(mask), is_causal=self.causal,
                              dropout_rate=self.rate(dropout_mask),
                              dropout_mask=self.keep(dropout_mask), return_weights=True)
        y = _merge(o)
        if self.out_proj is not None:
            y = self.out_proj(y)
        return (y, w) if return_weights else y

    def mapping(self) -> dict:
        table = {}
        for role in ("query", "key", "value"):
            table[f"W_{role}"] = (f"{role}_heads", "transpose(0,2,1)")
            if getattr(self, f"{role}_bias") is not None:
                table[f"b_{role}"] = (f"{role}_bias", "")
        if self.out_proj is not None:
            table.update({"W_out": ("out_proj.weight", "T"), "b_out": ("out_proj.bias", "")})
        return table


class MultiHeadAttention(Module):
    """Fused heads: x (..., L, d_in) -> (..., L, d_out), weights (..., N, L, L)."""

    layers = {**QKV, "out": "out_proj"}

    def __init__(self, d_in, d_out, num_heads, causal=False, dropout=0.0, qkv_bias=False,
                 out_bias=True, *, core=None):
        super().__init__(core)
        self.num_heads, self.causal, self.dropout = num_heads, causal, dropout
        self.q_proj, self.k_proj, self.v_proj = (Linear(d_in, d_out, qkv_bias) for _ in "qkv")
        self.out_proj = Linear(d_out, d_out, out_bias)

    def __call__(self, x, mask=None, *, dropout_mask=None, return_weights=False):
        q, k, v = (_split(p(x), self.num_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        o, w = self.core.sdpa(q, k, v, _head_mask(mask), is_causal=self.causal,
                              dropout_rate=self.rate(dropout_mask),
                              dropout_mask=self.keep(dropout_mask), return_weights=True)
        y = self.out_proj(_merge(o))
        return (y, w) if return_weights else y


class GroupedQueryAttention(Module):
    """N query heads over Nkv key/value heads, RoPE, causal by default:
    x (..., L, d_in) -> (..., L, d_out), weights (..., N, L, L)."""

    layers = {**QKV, "out": "out_proj", "gate": "gate_proj", "pos": "pos_proj",
              "index_q": "index_q_proj", "index_k": "index_k_proj"}

    def __init__(self, d_in, num_heads, num_kv_heads, head_dim=None, d_out=None, qkv_bias=False,
                 out_bias=False, causal=True, scale=None, softcap=None, sliding_window=None,
                 rope_theta=None, rope_interleaved=False, dropout=0.0, qk_norm=None,
                 qk_norm_eps=1e-6, sinks=False, attention_chunk_size=None,
                 query_temperature=None, output_gate=False, rope_parameters=None,
                 partial_rotary_factor=1.0, rope_precision="exact", alibi=None,
                 alibi_bias_max=8, relative_attention_num_buckets=None,
                 relative_attention_max_distance=128, relative_attention_buckets="t5",
                 clip_qkv=None, v_norm=False, relative_positions=None, k_eq_v=False,
                 relative_max_distance=None, input_norm=None, input_norm_eps=1e-5,
                 key_scale=None, output_norm=None, output_norm_eps=1e-6, gate_bias=None,
                 v_head_dim=None, value_scale=None, clip_qkv_after_norm=False,
                 merged_context=False, index_blocks=None, index_heads=None,
                 index_head_dim=None, index_block_size=None, index_topk_blocks=None,
                 index_local_blocks=0, index_norm_eps=1e-6, *, core=None):
        super().__init__(core)
        self.merged_context, self.sliding_window = merged_context, sliding_window
        dh = d_in // num_heads if head_dim is None else head_dim
        self.dh, self.index_blocks = dh, index_blocks  # the block indexer (MiniMax M3, Qwen4-Exp)
        self.index = (index_heads, index_head_dim, index_block_size, index_topk_blocks,
                      index_local_blocks, index_norm_eps)
        on = index_blocks is not None
        self.index_q_proj = Linear(d_in, index_heads * index_head_dim, False) if on else None
        self.index_k_proj = Linear(d_in, index_head_dim, False) if on else None
        self.index_q_norm, self.index_k_norm = ((np.ones(index_head_dim) if on else None)
                                                for _ in "qk")
        projected = relative_positions in ("transformer_xl", "conformer_timing")
        self.pos_proj = Linear(d_in, num_heads * dh, False) if projected else None
        xl = relative_positions == "transformer_xl"
        self.bias_u, self.bias_v = (np.zeros((num_heads, dh)) if xl else None for _ in "uv")
        self.per_dim_scale = np.zeros(dh) if relative_positions == "conformer_timing" else None
        self.key_scale = 1.0 if key_scale is None else key_scale
        self.relative_key_table = (np.zeros((2 * relative_max_distance + 1, dh))
                                   if relative_positions == "shaw" else None)
        self.input_norm_weight, self.input_norm_bias = (
            (np.ones(d_in), np.zeros(d_in)) if input_norm else (None, None))
        self.input_norm_eps = input_norm_eps
        self.relative_scale = dh ** -0.5 if scale is None else scale
        self.slopes = None if alibi is None else alibi_slopes(num_heads, alibi, alibi_bias_max)
        if alibi == "falcon":  # Falcon: ALiBi added before the scale
            self.slopes = self.slopes * (dh ** -0.5 if scale is None else scale)
        self.buckets = (not causal, relative_attention_num_buckets,
                        relative_attention_max_distance, relative_attention_buckets)
        self.relative_attention_bias = (None if relative_attention_num_buckets is None else
                                        np.zeros((relative_attention_num_buckets, num_heads)))
        self.qk_norm, self.eps, self.temperature = qk_norm, qk_norm_eps, query_temperature
        learned = query_temperature is not None and query_temperature.get("kind") == "learned"
        self.temperature_scale, self.temperature_bias = (
            (np.zeros(num_heads), np.ones(num_heads)) if learned else (None, None))
        self.clip, self.v_norm, self.clip_after_norm = clip_qkv, v_norm, clip_qkv_after_norm
        shapes = {"rms": lambda n: (dh,), "rms_one_plus": lambda n: (dh,),
                  "rms_after_rope": lambda n: (dh,),
                  "rms_across_heads": lambda n: (n * dh,), "layer": lambda n: (n, dh),
                  "layer_with_bias": lambda n: (n, dh)}
        self.q_norm, self.k_norm = (np.zeros(shapes[qk_norm](n)) if qk_norm in shapes else None
                                    for n in (num_heads, num_kv_heads))
        self.q_norm_bias, self.k_norm_bias = (  # Chameleon's: a bias per head
            np.zeros((n, dh)) if qk_norm == "layer_with_bias" else None
            for n in (num_heads, num_kv_heads))
        gate = "sigmoid" if output_gate is True else output_gate  # False: none
        self.gate_softplus = bool(gate) and gate.startswith("softplus")
        self.gate_per_head = bool(gate) and gate.endswith("per_head")
        dv = dh if v_head_dim is None else v_head_dim  # the values' head width
        self.value_scale = value_scale
        self.gate_proj = (Linear(d_in, num_heads if self.gate_per_head else num_heads * dv,
                                 qkv_bias if gate_bias is None else gate_bias)
                          if gate else None)
        self.output_norm, self.output_norm_eps = output_norm, output_norm_eps
        self.output_norm_weight = np.ones(num_heads * dv) if output_norm == "rms" else None
        self.rope_settings = rope_settings(rope_theta, rope_parameters, partial_rotary_factor)
        self.heads, self.kv_heads = num_heads, num_kv_heads
        if isinstance(sliding_window, (tuple, list)):  # (left, right): the window as it is
            window = tuple(sliding_window)
        else:
            window = None if sliding_window is None else (  # W keys, the query's own included
                sliding_window - 1, 0 if causal else sliding_window - 1)
        self.attend = dict(is_causal=causal, scale=scale, softcap=softcap,
                           local_window_size=window, attention_chunk_size=attention_chunk_size)
        self.sinks = np.zeros(num_heads) if sinks else None
        self.rope_theta, self.rope_interleaved, self.dropout = rope_theta, rope_interleaved, dropout
        self.q_proj = Linear(d_in, num_heads * dh, qkv_bias)
        self.k_proj = Linear(d_in, num_kv_heads * dh, qkv_bias)
        self.v_proj = Linear(d_in, num_kv_heads * dv, qkv_bias)
        if k_eq_v:  # Gemma 4's full layers: the values are the key projection's
            self.v_proj = None
        self.out_proj = Linear(num_heads * dv, d_in if d_out is None else d_out, out_bias)

    def __call__(self, x, mask=None, *, query_seq_lengths=None, positions=None,
                 dropout_mask=None, return_weights=False, context=None, context_mask=None):
        positions = np.arange(x.shape[-2]) if positions is None else np.asarray(positions)
        if positions.ndim == x.ndim:  # multimodal RoPE: (3, B, L), one row per axis
            positions = positions[..., None, :]  # (3, B, 1, L): the same for every head
        elif positions.ndim == 2:
            positions = positions[:, None]  # (B, L) -> (B, 1, L): the same for every head
        if self.input_norm_weight is not None:  # Granite's pre_norm: LayerNorm over d_in
            centred = x - x.mean(-1, keepdims=True)
            x = centred / np.sqrt((centred * centred).mean(-1, keepdims=True)
                                  + self.input_norm_eps).astype(x.dtype)
            x = x * self.input_norm_weight.astype(x.dtype) + self.input_norm_bias.astype(x.dtype)
        q, k = self.q_proj(x), self.k_proj(x)
        v = k if self.v_proj is None else self.v_proj(x)
        if self.clip is not None:  # MPT's and OLMo's clip_qkv (OLMoE's: q and k after the norm)
            v = np.clip(v, -self.clip, self.clip)
            if not self.clip_after_norm:
                q, k = (np.clip(t, -self.clip, self.clip) for t in (q, k))
        if self.qk_norm == "rms_across_heads":  # OLMo 2: over all heads, before the split
            q, k = self.norm(q, self.q_norm), self.norm(k, self.k_norm)
            if self.clip_after_norm:
                q, k = (np.clip(t, -self.clip, self.clip) for t in (q, k))
        q = _split(q, self.heads)                   # (..., N, L, Dh)
        k = _split(k, self.kv_heads)                # (..., Nkv, L, Dh)
        v = _split(v, self.kv_heads)
        if self.value_scale is not None:  # MiMo-V2-Flash: the values times a constant
            v = v * self.value_scale
        if self.v_norm:  # Gemma 4: v / √(mean(v²) + ε) per head, no weight
            v = v / np.sqrt((v * v).mean(-1, keepdims=True) + self.eps).astype(v.dtype)
        if self.qk_norm in ("rms", "rms_one_plus", "layer", "layer_with_bias"):
            q = self.norm(q, self.q_norm, self.q_norm_bias)
            k = self.norm(k, self.k_norm, self.k_norm_bias)
            if self.clip_after_norm:
                q, k = (np.clip(t, -self.clip, self.clip) for t in (q, k))
        if self.rope_settings is not None:
            q, k = (rope(t, self.rope_settings, self.rope_interleaved, positions,
                         multi=positions.ndim == x.ndim + 1) for t in (q, k))
        if self.qk_norm in ("l2", "rms_after_rope"):  # Llama 4, HunYuan: after RoPE
            q, k = self.norm(q, self.q_norm), self.norm(k, self.k_norm)
        if self.temperature is not None:
            q = q * self.temperature_factors(positions).astype(x.dtype)
        bias = None
        if self.slopes is not None:  # ALiBi: m_h · (j − i), key j and query i in token order
            length = x.shape[-2]
            bias = (self.slopes[:, None, None] * (np.arange(length) - np.arange(length)[:, None])
                    ).astype(q.dtype)  # (N, L, L)
        if self.relative_attention_bias is not None:  # T5: the table at the bucket of j − i
            length = x.shape[-2]
            buckets = relative_position_bucket(np.arange(length) - np.arange(length)[:, None],
                                               *self.buckets)  # (L, L)
            bias = np.moveaxis(self.relative_attention_bias[buckets], -1, 0).astype(q.dtype)
        term, attend = None, self.attend
        if self.per_dim_scale is not None:  # Conformer: q̃ · κk + q̃ · W_pos timing(i − j)
            scale = self.attend["scale"]  # the core's default when None, on q̃
            scale = self.core.default_scale(q.shape[-1]) if scale is None else scale
            q = q * (scale * np.log1p(np.exp(self.per_dim_scale)) / np.log(2.0)).astype(q.dtype)
            term = self.conformer(q)
            attend = dict(self.attend, scale=self.key_scale)
        elif self.pos_proj is not None:  # Transformer-XL: q + u · k, q + v · W_pos R(i − j)
            term = self.transformer_xl(q + self.bias_v[:, None, :].astype(q.dtype))
            q = q + self.bias_u[:, None, :].astype(q.dtype)
        if self.relative_key_table is not None:  # Shaw: q_i · E[M + clip(i − j, −M, M)]
            term = self.shaw(q)
        if self.merged_context:  # T5Gemma 2: [k ; k_c], [v ; v_c], one softmax
            return self.merged(x, q, k, v, context, context_mask, mask, query_seq_lengths,
                               dropout_mask, return_weights)
        head_mask = _head_mask(mask)
        if self.index_blocks is not None:  # the keys the block indexer chose, AND the mask
            chosen = self.blocks(x, positions, mask, query_seq_lengths)  # (..., N | 1, L, L)
            head_mask = chosen if mask is None else head_mask & chosen
        o, w = self.core.sdpa(q, k, v, head_mask, bias, **attend, position_term=term,
                              query_seq_lengths=query_seq_lengths,
                              key_value_seq_lengths=query_seq_lengths,
                              sinks=None if self.sinks is None else self.sinks.astype(q.dtype),
                              dropout_rate=self.rate(dropout_mask),
                              dropout_mask=self.keep(dropout_mask), return_weights=True)
        if self.output_norm == "rms_per_head":  # Muse Spark: each head / its RMS, no weight
            o = o / np.sqrt((o * o).mean(-1, keepdims=True) + self.output_norm_eps).astype(o.dtype)
        merged = _merge(o)
        if self.output_norm == "rms":  # BitNet: over all heads' features, times a weight
            merged = merged / np.sqrt((merged * merged).mean(-1, keepdims=True)
                                      + self.output_norm_eps).astype(merged.dtype)
            merged = merged * self.output_norm_weight.astype(merged.dtype)
        if self.gate_proj is not None:  # Qwen3-Next: times σ(x W_gate + b_gate); Laguna softplus
            z = self.gate_proj(x)
            a = np.logaddexp(z, 0).astype(z.dtype) if self.gate_softplus else 1 / (1 + np.exp(-z))
            if self.gate_per_head:  # one value per head: (..., L, N) -> each head's Dh features
                a = np.repeat(a, merged.shape[-1] // self.heads, axis=-1)
            merged = merged * a
        y = self.out_proj(merged)
        return (y, w) if return_weights else y

    def merged(self, x, q, k, v, context, context_mask, mask, lengths, dropout_mask,
               return_weights):
        """T5Gemma 2's merged attention: the context's keys k_c = k_norm(split(c W_k)) (no RoPE)
        and values split(c W_v) after x's; self key j of query i when j ≤ i, i − j < W and j <
        the row's length, context key t when context_mask[t]; the given mask over both."""
        k_c, v_c = _split(self.k_proj(context), self.kv_heads), _split(self.v_proj(context),
                                                                       self.kv_heads)
        if self.qk_norm is not None:
            k_c = self.norm(k_c, self.k_norm)
        length, lc = x.shape[-2], context.shape[-2]
        i, j = np.arange(length)[:, None], np.arange(length)
        own = (j <= i) & ((i - j < self.sliding_window) if self.sliding_window else True)
        own = np.broadcast_to(own, x.shape[:-2] + (length, length))
        if lengths is not None:
            own = own & (j < np.asarray(lengths)[..., None, None])
        real = np.ones(context.shape[:-1], bool) if context_mask is None else context_mask
        allowed = np.concatenate([own, np.broadcast_to(real[..., None, :], own.shape[:-1] + (lc,))],
                                 -1)[..., None, :, :]
        if mask is not None:
            allowed = allowed & _head_mask(mask)
        o, w = self.core.sdpa(q, np.concatenate([k, k_c], -2), np.concatenate([v, v_c], -2),
                              allowed, scale=self.attend["scale"],
                              softcap=self.attend["softcap"], query_seq_lengths=lengths,
                              dropout_rate=self.rate(dropout_mask),
                              dropout_mask=self.keep(dropout_mask), return_weights=True)
        y = self.out_proj(_merge(o))
        return (y, w) if return_weights else y

    def index_rope(self, t, positions):
        """t (..., L, D_I) with its first rd features turned as the layer's heads' are."""
        rd = self.rope_settings and int(self.dh * dict(self.rope_settings)["partial_rotary_factor"])
        wide = np.zeros(t.shape[:-1] + (self.dh,))
        wide[..., :rd] = t[..., :rd]
        return np.concatenate([rope(wide, self.rope_settings, False, positions)[..., :rd],
                               t[..., rd:]], -1)

    def blocks(self, x, positions, mask, lengths):
        """Boolean (..., N, L, L) ("max") or (..., 1, L, L) ("mean"): the keys each query's
        blocks hold (golden.specification.indexer), chosen among those it may see."""
        h, d, b, n, local, eps = self.index
        length = x.shape[-2]
        i, j = np.arange(length)[:, None], np.arange(length)
        seen = np.broadcast_to(j <= i, x.shape[:-2] + (length, length))
        if lengths is not None:
            ln = np.asarray(lengths)[..., None, None]
            seen = seen & (i < ln) & (j < ln)
        if mask is not None:
            seen = seen & np.asarray(mask).reshape(seen.shape)
        rms = lambda t, w: t / np.sqrt((t * t).mean(-1, keepdims=True) + eps) * w
        pos = np.broadcast_to(positions.reshape(positions.shape[:-2] + positions.shape[-1:])
                              if positions.ndim == 3 else positions, x.shape[:-1])
        qi = rms(np.moveaxis(self.index_q_proj(x).reshape(x.shape[:-1] + (h, d)), -2, -3),
                 self.index_q_norm)                                  # (..., H_I, L, D_I)
        qi = self.index_rope(qi, pos[..., None, :])
        ki = self.index_k_proj(x)                                   # (..., L, D_I)
        if self.index_blocks == "max":
            ki = self.index_rope(rms(ki, self.index_k_norm), pos)
            s = np.where(seen[..., None, :, :], qi @ np.swapaxes(ki, -1, -2)[..., None, :, :],
                         -np.inf)                                    # (..., H_I, L, L)
            blocks = -(-length // b)
            padded = np.full(s.shape[:-1] + (blocks * b,), -np.inf)
            padded[..., :length] = s
            score = padded.reshape(s.shape[:-1] + (blocks, b)).max(-1)  # (..., H_I, L, M)
            qb = pos[..., None, :, None] // b
            near = (qb - np.arange(blocks) >= 0) & (qb - np.arange(blocks) < local)
            near |= (np.arange(blocks) == 0) & (qb - local + 1 <= 0)  # the clip at block 0
            score = np.where(near, np.inf, score)
            order = np.argsort(-score, axis=-1, kind="stable")[..., :n]
            top = np.take_along_axis(score, order, -1) > -np.inf
            keep = np.zeros(score.shape, bool)
            np.put_along_axis(keep, order, top, -1)
            keep = np.repeat(keep, b, -1)[..., :length]              # (..., H_I, L, L)
            return np.repeat(keep, self.heads // h, axis=-3)
        keep = np.zeros(seen.shape, bool)
        for idx in np.ndindex(seen.shape[:-1]):                     # one query at a time
            row, vis = idx[:-1], np.flatnonzero(seen[idx])
            c = len(vis) // b
            keep[idx + (vis[c * b:],)] = True                        # the tail
            if c == 0:
                continue
            groups = vis[:c * b].reshape(c, b)
            key = rms(ki[row][groups].mean(-2), self.index_k_norm)  # (C, D_I)
            key = self.index_rope(key, pos[row][groups[:, 0]])
            score = np.maximum(qi[row][:, idx[-1]] @ key.T, 0).sum(0) / np.sqrt(d)
            best = np.argsort(-score, kind="stable")[:n]
            keep[idx + (groups[best].ravel(),)] = True
        return keep[..., None, :, :]

    def transformer_xl(self, qv):
        """scale · (q_i + v)·r_ij (..., N, L, L), r_ij head n's slice of W_pos R(i − j), R(t) =
        (sin tω_0, cos tω_0, sin tω_1, …), ω_k = 10000^(−2k/d_in): every pair's own row."""
        length, width = qv.shape[-2], self.pos_proj.weight.shape[1]
        t = np.arange(length)[:, None] - np.arange(length)  # (L, L): query i − key j
        angles = t[..., None] * 10000.0 ** -(np.arange(0, width, 2) / width)  # (L, L, d/2)
        table = np.stack([np.sin(angles), np.cos(angles)], -1).reshape(length, length, width)
        keys = _split(self.pos_proj(table.astype(qv.dtype)), qv.shape[-3])  # (L, N, L, Dh)
        return (self.relative_scale * np.einsum("...nid,injd->...nij", qv, keys)).astype(qv.dtype)

    def shaw(self, q):
        """scale · q_i·E[M + clip(i − j, −M, M)] (..., N, L, L), E the relative_key_table
        (2M + 1, Dh): every pair's own row."""
        length, span = q.shape[-2], (self.relative_key_table.shape[0] - 1) // 2
        t = np.clip(np.arange(length)[:, None] - np.arange(length), -span, span)  # (L, L)
        rows = self.relative_key_table[t + span].astype(q.dtype)  # (L, L, Dh)
        return (self.relative_scale * np.einsum("...nid,ijd->...nij", q, rows)).astype(q.dtype)

    def conformer(self, qt):
        """q̃_i·E_ij (..., N, L, L), E_ij head n's slice of W_pos timing(i − j), timing(t) =
        (sin tι_0 … sin tι_{n−1}, cos tι_0 … cos tι_{n−1}), ι_k = e^(−k ln(10⁴)/max(n − 1, 1)),
        n = d_in / 2: every pair's own row."""
        length, width = qt.shape[-2], self.pos_proj.weight.shape[1]
        n = width // 2
        t = np.arange(length)[:, None] - np.arange(length)  # (L, L): query i − key j
        angles = t[..., None] * np.exp(-np.arange(n) * np.log(1e4) / max(n - 1, 1))
        table = np.concatenate([np.sin(angles), np.cos(angles)], -1)  # (L, L, d_in)
        keys = _split(self.pos_proj(table.astype(qt.dtype)), qt.shape[-3])  # (L, N, L, Dh)
        return np.einsum("...nid,injd->...nij", qt, keys).astype(qt.dtype)

    def temperature_factors(self, positions):
        return _temperature_factors(self, positions)

    def norm(self, t, weight, bias=None):
        """The QK norm over t's last axis: (t − mean) / √(mean((t − mean)²) + ε) for LayerNorm,
        t / √(mean(t²) + ε) otherwise; times the weight (1 + weight for Gemma's); plus the
        bias (Chameleon's, per head)."""
        if self.qk_norm in ("layer", "layer_with_bias"):
            t = t - t.mean(-1, keepdims=True)
            weight = weight[:, None, :]  # (N, Dh) against (..., N, L, Dh)
        t = t / np.sqrt((t * t).mean(-1, keepdims=True) + self.eps).astype(t.dtype)
        if weight is None:
            return t
        t = t * (1 + weight if self.qk_norm == "rms_one_plus" else weight).astype(t.dtype)
        return t if bias is None else t + bias[:, None, :].astype(t.dtype)

    def mapping(self) -> dict:
        table = super().mapping()
        table.update({n: (n, "") for n in ("q_norm", "k_norm", "q_norm_bias", "k_norm_bias",
                                           "sinks", "relative_attention_bias",
                                           "bias_u", "bias_v", "relative_key_table",
                                           "input_norm_weight", "input_norm_bias",
                                           "per_dim_scale", "output_norm_weight",
                                           "temperature_scale", "temperature_bias",
                                           "index_q_norm", "index_k_norm")
                      if getattr(self, n) is not None})
        return table


class MultiHeadCrossAttention(Module):
    """N query heads from x over Nkv key/value heads from a context, never causal:
    x (..., Lq, d_in), context (..., Lc, d_context) -> (..., Lq, d_out), weights
    (..., N, Lq, Lc); context tokens past context_lengths are not attended."""

    layers = {**QKV, "out": "out_proj"}

    def __init__(self, d_in, d_context, num_heads, num_kv_heads=None, head_dim=None, d_out=None,
                 qkv_bias=False, key_bias=None, out_bias=False, scale=None, qk_norm=None,
                 qk_norm_eps=1e-6, softcap=None, *, core=None):
        super().__init__(core)
        dh = d_in // num_heads if head_dim is None else head_dim
        kv = (num_heads if num_kv_heads is None else num_kv_heads) * dh
        self.heads, self.kv_heads, self.scale = num_heads, kv // dh, scale
        self.softcap, self.eps = softcap, qk_norm_eps
        self.q_norm, self.k_norm = ((np.ones(dh), np.ones(dh)) if qk_norm == "rms"
                                    else (None, None))
        self.q_proj = Linear(d_in, num_heads * dh, qkv_bias)
        self.k_proj = Linear(d_context, kv, qkv_bias if key_bias is None else key_bias)
        self.v_proj = Linear(d_context, kv, qkv_bias)
        self.out_proj = Linear(num_heads * dh, d_in if d_out is None else d_out, out_bias)

    def __call__(self, x, context, mask=None, *, context_lengths=None, return_weights=False):
        q = _split(self.q_proj(x), self.heads)                 # (..., N, Lq, Dh)
        k = _split(self.k_proj(context), self.kv_heads)        # (..., Nkv, Lc, Dh)
        v = _split(self.v_proj(context), self.kv_heads)
        if self.q_norm is not None:  # Mllama's: RMSNorm per head, q from x, k from the context
            q, k = self.rms(q, self.q_norm), self.rms(k, self.k_norm)
        o, w = self.core.sdpa(q, k, v, _head_mask(mask), scale=self.scale, softcap=self.softcap,
                              key_value_seq_lengths=context_lengths, return_weights=True)
        y = self.out_proj(_merge(o))
        return (y, w) if return_weights else y

    def rms(self, t, weight):
        """t / √(mean(t²) + ε) over the last axis, times weight (Dh,)."""
        return t / np.sqrt((t * t).mean(-1, keepdims=True) + self.eps) * weight.astype(t.dtype)

    def mapping(self) -> dict:
        table = super().mapping()
        table.update({n: (n, "") for n in ("q_norm", "k_norm") if getattr(self, n) is not None})
        return table

class MultiHeadLatentAttention(Module):
    """DeepSeek's multi-head latent attention, as transformers' DeepseekV3Attention reads:
    q = x W_q (or RMSNorm(x W_qa + b) W_qb), each head [q_nope | q_pe]; x W_kva + b = [c | k_pe],
    c RMS-normalised, c W_kvb = each head's [k_nope | v]; RoPE on q_pe and on the one k_pe every
    head shares; causal, scale (nope + rope)^−1/2 (the core's default) times yarn's
    (0.1·mscale_all_dim·ln s + 1)², applied to q.
    x (..., L, d_in) -> (..., L, d_out), weights (..., N, L, L)."""

    layers = {"query": "q_proj", "q_a": "q_a_proj", "q_b": "q_b_proj",
              "kv_a": "kv_a_proj_with_mqa", "kv_b": "kv_b_proj", "out": "o_proj",
              "gate": "gate_proj", "index_q": "index_q_proj", "index_k": "index_k_proj",
              "index_weights": "index_weights_proj"}
    index_vectors = ("index_k_norm", "index_k_norm_bias", "index_q_norm", "index_q_norm_bias",
                     "index_temperature_scale", "index_temperature_bias")

    def __init__(self, d_in, num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                 v_head_dim, q_lora_rank=None, d_out=None, attention_bias=False,
                 rms_norm_eps=1e-6, rope_theta=None, rope_parameters=None, rope_interleaved=True,
                 causal=True, scale=None, query_temperature=None, rope=True, sinks=False,
                 output_gate=False, rope_key_norm=False, query_latent="normed",
                 sliding_window=None, index_topk=None, index_heads=None, index_head_dim=None,
                 index_rope="half", index_rope_dims="first", index_query="latent",
                 index_temperature=False, index_scale="scores", index_norm_eps=1e-6,
                 index_select="tokens", *, core=None):
        super().__init__(core)
        self.both = query_latent == "normed_and_raw"  # AXK2's [RMSNorm(c_q) | c_q]
        self.window = sliding_window  # dots.3-note's: W keys, the query's own included
        self.k_pe_norm = np.ones(qk_rope_head_dim) if rope_key_norm else None  # dots3's
        self.index = None if index_topk is None else dict(  # DeepSeek-V3.2's indexer
            topk=index_topk, heads=index_heads, dim=index_head_dim, rope=index_rope,
            last=index_rope_dims == "last", layer_norm=index_query == "layer_norm",
            on_weights=index_scale == "weights", eps=index_norm_eps)
        on = self.index is not None
        width = d_in if index_query == "layer_norm" else q_lora_rank
        self.index_q_proj = Linear(width, index_heads * index_head_dim, False) if on else None
        self.index_k_proj = Linear(d_in, index_head_dim, False) if on else None
        self.index_weights_proj = Linear(d_in, index_heads, False) if on else None
        self.index_k_norm = np.ones(index_head_dim) if on else None
        self.index_k_norm_bias = np.zeros(index_head_dim) if on else None
        q_norm = on and index_query == "layer_norm"  # Mistral Large 4's LayerNorm(x)
        self.index_q_norm = np.ones(d_in) if q_norm else None
        self.index_q_norm_bias = np.zeros(d_in) if q_norm else None
        learned = on and index_temperature  # Mistral Large 4's per-head temperature
        self.index_temperature_scale = np.zeros(index_heads) if learned else None
        self.index_temperature_bias = np.ones(index_heads) if learned else None
        self.sinks = np.zeros(num_heads) if sinks else None  # HY-V4's
        gate = "sigmoid" if output_gate is True else output_gate  # False: none
        self.gate_softplus = bool(gate) and gate.startswith("softplus")
        self.gate_per_head = bool(gate) and gate.endswith("per_head")
        self.gate_proj = (Linear(2 * q_lora_rank if self.both else d_in,
                                 num_heads if self.gate_per_head else num_heads * v_head_dim,
                                 False) if gate else None)
        dk, bias = qk_nope_head_dim + qk_rope_head_dim, attention_bias
        self.temperature, self.use_rope = query_temperature, rope
        learned = query_temperature is not None and query_temperature.get("kind") == "learned"
        self.temperature_scale, self.temperature_bias = (
            (np.zeros(num_heads), np.ones(num_heads)) if learned else (None, None))
        self.rope_dim = qk_rope_head_dim
        self.heads, self.rank, self.nope, self.eps = (num_heads, kv_lora_rank, qk_nope_head_dim,
                                                      rms_norm_eps)
        self.causal, self.interleaved = causal, rope_interleaved
        if rope_theta is None and "rope_theta" not in (rope_parameters or {}):
            rope_theta = 10000.0
        self.rope_settings = rope_settings(rope_theta, rope_parameters)
        self.scale, self.mscale, fields = scale, 1.0, dict(self.rope_settings)
        if scale is None and fields["rope_type"] == "yarn" and fields.get("mscale_all_dim") and (
                fields["factor"] > 1):  # the core's default scale, the query times mscale²
            self.mscale = (0.1 * fields["mscale_all_dim"] * math.log(fields["factor"]) + 1) ** 2
        lora = q_lora_rank is not None
        self.q_proj = None if lora else Linear(d_in, num_heads * dk, False)
        self.q_a_proj = Linear(d_in, q_lora_rank, bias) if lora else None
        self.q_a_norm = np.ones(q_lora_rank) if lora else None
        self.q_b_proj = (Linear((2 if self.both else 1) * q_lora_rank, num_heads * dk, False)
                         if lora else None)
        self.kv_a_proj_with_mqa = Linear(d_in, kv_lora_rank + qk_rope_head_dim, bias)
        self.kv_a_norm = np.ones(kv_lora_rank)
        self.kv_b_proj = Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), False)
        self.o_proj = Linear(num_heads * v_head_dim, d_in if d_out is None else d_out, bias)

    def __call__(self, x, mask=None, *, query_seq_lengths=None, positions=None,
                 return_weights=False):
        positions = np.arange(x.shape[-2]) if positions is None else np.asarray(positions)
        if positions.ndim == 2:
            positions = positions[:, None]  # (B, L) -> (B, 1, L): the same for every head
        q_resid, gate_in = None, x
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            c_q = self.q_a_proj(x)
            q_resid = self.rms(c_q, self.q_a_norm)
            if self.both:  # AXK2: the query and its gate read [RMSNorm(c_q) | c_q]
                gate_in = np.concatenate([q_resid, c_q], axis=-1)
            q = self.q_b_proj(gate_in if self.both else q_resid)
        q = _split(q, self.heads)                                   # (..., N, L, Dk)
        if self.index is not None:  # the attention sees only the keys the indexer chose
            chosen = self.chosen_keys(x, q_resid, mask, query_seq_lengths, positions)
            mask = chosen if mask is None else mask & (
                chosen[..., None, :, :] if mask.ndim == x.ndim + 1 else chosen)
        kv_a = self.kv_a_proj_with_mqa(x)
        c = self.rms(kv_a[..., :self.rank], self.kv_a_norm)          # (..., L, r)
        k_pe = kv_a[..., None, :, self.rank:]                        # (..., 1, L, Dr)
        if self.k_pe_norm is not None:  # dots3: RMSNorm of the shared rotary key, then RoPE
            k_pe = self.rms(k_pe, self.k_pe_norm)
        if self.use_rope:
            k_pe = rope(k_pe, self.rope_settings, self.interleaved, positions)
        kv = _split(self.kv_b_proj(c), self.heads)                  # (..., N, L, Dn + Dv)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        if self.use_rope:
            q = np.concatenate([q[..., :self.nope], rope(q[..., self.nope:], self.rope_settings,
                                                         self.interleaved, positions)], axis=-1)
        q = q * np.asarray(self.mscale, q.dtype)
        if self.temperature is not None:  # Mistral Small 4's (Llama 4's, shift 0)
            q = q * _temperature_factors(self, positions).astype(q.dtype)
        k = np.concatenate([k_nope, np.broadcast_to(k_pe, k_nope.shape[:-1] + k_pe.shape[-1:])],
                           axis=-1)
        w_ = self.window
        window = None if w_ is None else tuple(w_) if isinstance(w_, (tuple, list)) else (
            w_ - 1, 0 if self.causal else w_ - 1)  # W keys, the query's own included
        o, w = self.core.sdpa(q, k, v, _head_mask(mask), is_causal=self.causal, scale=self.scale,
                              local_window_size=window, query_seq_lengths=query_seq_lengths,
                              key_value_seq_lengths=query_seq_lengths, return_weights=True,
                              sinks=None if self.sinks is None else self.sinks.astype(q.dtype))
        merged = _merge(o)
        if self.gate_proj is not None:  # HY-V4: times σ(x W_gate); Ling 3.0 one per head
            z = self.gate_proj(gate_in)
            a = np.logaddexp(z, 0).astype(z.dtype) if self.gate_softplus else 1 / (1 + np.exp(-z))
            if self.gate_per_head:  # one value per head: (..., L, N) -> each head's Dv features
                a = np.repeat(a, merged.shape[-1] // self.heads, axis=-1)
            merged = merged * a
        y = self.o_proj(merged)
        return (y, w) if return_weights else y

    def rms(self, t, weight):
        """t / √(mean(t²) + ε) times the weight, over the last axis."""
        return t / np.sqrt((t * t).mean(-1, keepdims=True) + self.eps).astype(t.dtype) * (
            weight.astype(t.dtype))

    def index_rope(self, t, positions):
        """RoPE on t (..., N, L, D)'s first or last qk_rope_head_dim features."""
        r = self.rope_dim
        if self.index["rope"] is None:
            return t
        inter = self.index["rope"] == "interleaved"
        if self.index["last"]:
            return np.concatenate([t[..., :-r], rope(t[..., -r:], self.rope_settings, inter,
                                                     positions)], axis=-1)
        return np.concatenate([rope(t[..., :r], self.rope_settings, inter, positions),
                               t[..., r:]], axis=-1)

    def index_scores(self, x, q_resid, positions):
        """I (..., Lq, Lk) = Σ_h w_h H^−1/2 ReLU(D^−1/2 q_h · k), in x's dtype."""
        ix, dt = self.index, x.dtype
        h, d = ix["heads"], ix["dim"]
        if ix["layer_norm"]:
            q_resid = _layer_norm(x, self.index_q_norm, self.index_q_norm_bias, ix["eps"])
        q = _split(self.index_q_proj(q_resid), h)                     # (..., H, L, D)
        if self.index_temperature_scale is not None:  # (s_h ln(p + 1) + b_h), before RoPE
            logs = np.log(np.asarray(positions, np.float64) + 1)[..., None]   # (..., 1, L, 1)
            q = q * (self.index_temperature_scale[:, None, None] * logs
                     + self.index_temperature_bias[:, None, None]).astype(dt)
        q = self.index_rope(q, positions)
        k = _layer_norm(self.index_k_proj(x), self.index_k_norm, self.index_k_norm_bias,
                        ix["eps"])[..., None, :, :]                   # (..., 1, L, D)
        k = self.index_rope(k, positions)
        dot = q @ np.swapaxes(k, -1, -2)                              # (..., H, Lq, Lk)
        w = self.index_weights_proj(x) * dt.type(h ** -0.5)           # (..., L, H)
        if ix["on_weights"]:  # HY-V4: D^−1/2 on the head weights
            w = w * dt.type(d ** -0.5)
        else:
            dot = dot * dt.type(d ** -0.5)
        return np.einsum("...ht,...hts->...ts", np.swapaxes(w, -1, -2), np.maximum(dot, 0))

    def chosen_keys(self, x, q_resid, mask, lengths, positions):
        """Boolean (..., Lq, Lk): each query's top min(index_topk, Lk) keys among those it may
        see (mask, causal, lengths), ties to the lower index, rows seeing fewer filled with
        the lowest unseen."""
        scores = self.index_scores(x, q_resid, positions)
        lq = lk = x.shape[-2]
        seen = np.broadcast_to(np.tril(np.ones((lq, lk), bool)) if self.causal
                               else np.ones((lq, lk), bool), scores.shape).copy()
        if lengths is not None:
            n = np.asarray(lengths)[..., None, None]
            seen &= (np.arange(lk) < n) & (np.arange(lq)[:, None] < n)
        if mask is not None:
            seen &= mask[..., 0, :, :] if mask.ndim == x.ndim + 1 else mask
        k, chosen = min(self.index["topk"], lk), np.zeros(scores.shape, bool)
        for row in np.ndindex(scores.shape[:-1]):
            s, ok = scores[row], seen[row]
            best = sorted(range(lk), key=lambda j: (not ok[j], -s[j] if ok[j] else 0, j))[:k]
            chosen[row + (best,)] = True
        return chosen

    def mapping(self) -> dict:
        table = super().mapping()
        table.update({n: (n, "") for n in ("q_a_norm", "kv_a_norm", "k_pe_norm",
                                           "temperature_scale",
                                           "temperature_bias", "sinks", *self.index_vectors)
                      if getattr(self, n) is not None})
        return table


def _layer_norm(t, weight, bias, eps):
    """(t − mean) / √(var + ε) · weight + bias over the last axis (torch.nn.LayerNorm)."""
    c = t - t.mean(-1, keepdims=True)
    return c / np.sqrt((c * c).mean(-1, keepdims=True) + eps).astype(t.dtype) * (
        weight.astype(t.dtype)) + bias.astype(t.dtype)


def rope(x, settings, interleaved, positions, multi=False):
    """Rotary embedding of x (..., L, Dh), token i at positions[..., i]: feature pair k of the first
    rd, (k, k + rd/2) or (2k, 2k + 1) when ``interleaved``, turns by i·f_k
    (golden.specification.positions' float64 frequencies, Hugging Face's rope_types), cos and sin
    times the attention factor; the other features pass. Angles, cos and sin in float64, rounded
    once to x's dtype; the turn in x's dtype. Proportional RoPE pairs the whole head (rd = Dh).
    ``multi``: positions (3, ..., L), and pair k's angle is its axis's position times f_k: with
    mrope_section (t, h, w), the first t pairs the temporal axis, the next h the height, the
    last w the width; interleaved, pair k the height's when k % 3 == 1 and k < 3h, the width's
    when k % 3 == 2 and k < 3w, else the temporal's. With mrope_temporal_last the temporal pairs
    come last: the first h the height, the next w the width, the last t the temporal axis;
    interleaved, pair k the height's when k is even and k < 2h, the width's when k is odd and
    k < 2w, else the temporal's (ERNIE 4.5 VL). Axial (rope_type "axial"): A equal sections of
    pairs, section a the axis a's (its frequencies times axial_scale[a], in rope_frequencies),
    each axis's block of features turned alone with axial_pairs "blocks". Negative positions
    (DINOv3's patch centres) turn the other way: p · f_k as it stands."""
    dh, s = x.shape[-1], dict(settings)
    rd = dh if s["rope_type"] == "proportional" else int(dh * s["partial_rotary_factor"])
    f, m = rope_frequencies(settings, rd, int(positions.max()) + 1)
    angles = positions[..., None] * f  # (L, rd/2), or (B, 1, L, rd/2); ([3,] ...) with multi
    if multi and s["rope_type"] == "axial":  # A equal sections, section a turned by axis a
        axis = [k // (rd // 2 // s["axial_axes"]) for k in range(rd // 2)]
        angles = np.stack([angles[axis[k], ..., k] for k in range(rd // 2)], axis=-1)
    elif multi:
        t, h, w = s["mrope_section"]
        last = s.get("mrope_temporal_last")
        if s.get("mrope_interleaved") and last:
            axis = [1 if k % 2 == 0 and k < 2 * h else 2 if k % 2 == 1 and k < 2 * w else 0
                    for k in range(rd // 2)]
        elif s.get("mrope_interleaved"):
            axis = [1 if k % 3 == 1 and k < 3 * h else 2 if k % 3 == 2 and k < 3 * w else 0
                    for k in range(rd // 2)]
        elif last:
            axis = [1] * h + [2] * w + [0] * t
        else:
            axis = [0] * t + [1] * h + [2] * w
        angles = np.stack([angles[axis[k], ..., k] for k in range(rd // 2)], axis=-1)
    cos, sin = (m * np.cos(angles)).astype(x.dtype), (m * np.sin(angles)).astype(x.dtype)
    x, rest = x[..., :rd], x[..., rd:]
    if s.get("axial_pairs") == "blocks":  # Gemma 4: each axis's block of rd/A turned alone
        n = rd // 2 // s["axial_axes"]
        return np.concatenate([_turn(x[..., 2 * n * a:2 * n * (a + 1)],
                                     cos[..., n * a:n * (a + 1)], sin[..., n * a:n * (a + 1)],
                                     interleaved) for a in range(s["axial_axes"])] + [rest],
                              axis=-1)
    return np.concatenate([_turn(x, cos, sin, interleaved), rest], axis=-1)


def _turn(x, cos, sin, interleaved):
    """x's pairs, (k, k + w/2) or (2k, 2k + 1), turned by (cos, sin)."""
    half = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    turned = (a * cos - b * sin, b * cos + a * sin)
    if interleaved:
        return np.stack(turned, axis=-1).reshape(x.shape)
    return np.concatenate(turned, axis=-1)


# ---- the recurrent token mixers (issue 43): no attention, no weights returned ----------------
# Written from golden.specification.recurrent's formulas: a state S (Dk, Dv) per head carried
# token by token (the loop over t is the definition), everything in x's dtype. mask (..., L)
# bool, True = a real token: padded tokens' x zeroed at the input.

def _sigmoid(z):
    return 1 / (1 + np.exp(-z))


def _silu(z):
    return z * _sigmoid(z)


def _softplus(z):
    return np.logaddexp(0, z).astype(z.dtype)


def _heads(y, heads):
    """(..., L, H·D) -> (..., L, H, D)."""
    return y.reshape(y.shape[:-1] + (heads, y.shape[-1] // heads))


def _rms(o, eps):
    """o / √(mean o² + ε) over the last axis."""
    return o / np.sqrt((o * o).mean(axis=-1, keepdims=True) + eps)


def _causal_conv(u, w):
    """y_t[c] = Σ_i w[c, i] u_{t−K+1+i}[c], zeros before the first token: u (..., L, C), w (C,
    K)."""
    k, length = w.shape[-1], u.shape[-2]
    padded = np.concatenate([np.zeros(u.shape[:-2] + (k - 1, u.shape[-1]), u.dtype), u], -2)
    return sum(padded[..., i:i + length, :] * w[:, i] for i in range(k))


class _Recurrent(Module):
    """What the three mixers share: the masked input, the projections, the recurrence."""

    vectors: tuple = ()

    def mapping(self) -> dict:
        table = super().mapping()
        table.update({n: (n, "") for n in self.vectors})
        return table

    def masked(self, x, mask):
        """x with padded tokens zeroed; the mask read through the core's hook (a real token is
        one that may be attended), so that a planted mask mistake reaches the mixers too."""
        return x if mask is None else x * self.core.user_mask(mask)[..., None].astype(x.dtype)

    def project(self, x, role):
        """x W_role, or (x W_role_a) W_role_b where the module holds the low-rank pair."""
        if getattr(self, f"{role}_proj", None) is not None:
            return getattr(self, f"{role}_proj")(x)
        return getattr(self, f"{role}_b_proj")(getattr(self, f"{role}_a_proj")(x))

    def delta_rule(self, q, k, v, decay, beta):
        """o (..., L, H, Dv): S′ = decay_t ⊙ S, S = S′ + k_t ⊗ β_t (v_t − S′ᵀ k_t), o_t = Sᵀ q_t;
        q, k (..., L, H, Dk), v (..., L, H, Dv), decay (..., L, H, Dk) (or (..., L, H, 1)),
        beta (..., L, H)."""
        s = np.zeros(q.shape[:-3] + q.shape[-2:] + v.shape[-1:], q.dtype)  # (..., H, Dk, Dv)
        out = []
        for t in range(q.shape[-3]):
            s = decay[..., t, :, :, None] * s
            recalled = np.einsum("...kv,...k->...v", s, k[..., t, :, :])
            delta = beta[..., t, :, None] * (v[..., t, :, :] - recalled)
            s = s + k[..., t, :, :, None] * delta[..., None, :]
            out.append(np.einsum("...kv,...k->...v", s, q[..., t, :, :]))
        return np.stack(out, axis=-3)

    def convolved(self, x, heads):
        """SiLU of each causal convolution, q̂ and k̂ L2-normalised (q̂ times Dk^−1/2): q, k
        (..., L, Hk, Dk), v (..., L, Hv, Dv)."""
        hk, hv = heads
        q, k, v = (_silu(_causal_conv(getattr(self, f"{r}_proj")(x), getattr(self, f"conv_{r}")))
                   for r in ("query", "key", "value"))
        q, k, v = _heads(q, hk), _heads(k, hk), _heads(v, hv)
        eps = self.l2norm_eps
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + eps) / np.sqrt(q.shape[-1])
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + eps)
        return q, k, v


class GatedDeltaNet(_Recurrent):
    """x (..., L, d_in), mask (..., L) -> (..., L, d_out): golden.specification.recurrent's
    gated_delta_net, one decay per value head."""

    layers = {"query": "query_proj", "key": "key_proj", "value": "value_proj",
              "gate": "gate_proj", "beta": "beta_proj", "decay": "decay_proj", "out": "out_proj"}
    vectors = ("conv_query", "conv_key", "conv_value", "A_log", "dt_bias", "norm_weight")

    def __init__(self, d_in, num_k_heads, num_v_heads, head_k_dim, head_v_dim, d_out=None,
                 conv_kernel=4, norm_eps=1e-6, l2norm_eps=1e-6, allow_neg_eigval=False, *,
                 core=None):
        super().__init__(core)
        hk, hv, dk, dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.heads, self.norm_eps, self.l2norm_eps = (hk, hv), norm_eps, l2norm_eps
        self.beta_factor = 2.0 if allow_neg_eigval else 1.0
        self.query_proj, self.key_proj = Linear(d_in, hk * dk, False), Linear(d_in, hk * dk, False)
        self.value_proj, self.gate_proj = (Linear(d_in, hv * dv, False),
                                           Linear(d_in, hv * dv, False))
        self.beta_proj, self.decay_proj = Linear(d_in, hv, False), Linear(d_in, hv, False)
        self.out_proj = Linear(hv * dv, d_in if d_out is None else d_out, False)
        self.conv_query, self.conv_key = (np.zeros((hk * dk, conv_kernel)) for _ in range(2))
        self.conv_value = np.zeros((hv * dv, conv_kernel))
        self.A_log, self.dt_bias, self.norm_weight = np.zeros(hv), np.zeros(hv), np.zeros(dv)

    def __call__(self, x, mask=None):
        x = self.masked(x, mask)
        hk, hv = self.heads
        q, k, v = self.convolved(x, self.heads)
        q, k = (np.repeat(a, hv // hk, axis=-2) for a in (q, k))  # value head h: key h // G
        beta = self.beta_factor * _sigmoid(self.beta_proj(x))  # (..., L, Hv)
        g = -np.exp(self.A_log) * _softplus(self.decay_proj(x) + self.dt_bias)
        o = self.delta_rule(q, k, v, np.exp(g)[..., None], beta)  # (..., L, Hv, Dv)
        gated = _rms(o, self.norm_eps) * self.norm_weight * _silu(_heads(self.gate_proj(x), hv))
        return self.out_proj(gated.reshape(gated.shape[:-2] + (-1,)))


class KimiDeltaAttention(_Recurrent):
    """x (..., L, d_in), mask (..., L) -> (..., L, d_out): kimi_delta_attention, the decay per
    key channel (softplus, or λ σ(·) bounded), low-rank decay and gate projections, a σ gate."""

    layers = {"query": "query_proj", "key": "key_proj", "value": "value_proj",
              "beta": "beta_proj", "decay": "decay_proj", "decay_a": "decay_a_proj",
              "decay_b": "decay_b_proj", "gate": "gate_proj", "gate_a": "gate_a_proj",
              "gate_b": "gate_b_proj", "out": "out_proj"}
    vectors = ("conv_query", "conv_key", "conv_value", "A_log", "dt_bias", "norm_weight")

    def __init__(self, d_in, num_heads, head_dim, d_out=None, conv_kernel=4, norm_eps=1e-6,
                 l2norm_eps=1e-6, decay_rank=None, gate_rank=None, forget_gate="softplus",
                 decay_lower_bound=None, *, core=None):
        super().__init__(core)
        h, d, width = num_heads, head_dim, num_heads * head_dim
        self.heads, self.norm_eps, self.l2norm_eps = (h, h), norm_eps, l2norm_eps
        self.forget_gate, self.bound = forget_gate, decay_lower_bound
        for role in ("query", "key", "value"):
            setattr(self, f"{role}_proj", Linear(d_in, width, False))
            setattr(self, f"conv_{role}", np.zeros((width, conv_kernel)))
        self.beta_proj = Linear(d_in, h, False)
        for role, rank in (("decay", decay_rank), ("gate", gate_rank)):
            full = None if rank is not None else Linear(d_in, width, False)
            setattr(self, f"{role}_proj", full)
            setattr(self, f"{role}_a_proj", None if full else Linear(d_in, rank, False))
            setattr(self, f"{role}_b_proj", None if full else Linear(rank, width, False))
        self.out_proj = Linear(width, d_in if d_out is None else d_out, False)
        self.A_log, self.dt_bias, self.norm_weight = np.zeros(h), np.zeros(width), np.zeros(d)

    def __call__(self, x, mask=None):
        x = self.masked(x, mask)
        h = self.heads[0]
        q, k, v = self.convolved(x, self.heads)
        f = _heads(self.project(x, "decay") + self.dt_bias, h)  # (..., L, H, D)
        rate = np.exp(self.A_log)[:, None]
        if self.forget_gate == "softplus":
            g = -rate * _softplus(f)
        else:
            g = self.bound * _sigmoid(rate * f)
        o = self.delta_rule(q, k, v, np.exp(g), _sigmoid(self.beta_proj(x)))
        gated = _rms(o, self.norm_eps) * self.norm_weight * _sigmoid(
            _heads(self.project(x, "gate"), h))
        return self.out_proj(gated.reshape(gated.shape[:-2] + (-1,)))


class LightningAttention(_Recurrent):
    """x (..., L, d_in), mask (..., L) -> (..., L, d_out): lightning_attention, MiniMax's
    S_t = e^{−slope_h} S_{t−1} + k_t ⊗ v_t, o_t = S_tᵀ q_t, SiLU q, k, v, the RMSNorm over all
    heads gated by σ. ``block_size`` changes nothing here (one token at a time)."""

    layers = {"query": "query_proj", "key": "key_proj", "value": "value_proj",
              "gate": "gate_proj", "out": "out_proj"}
    vectors = ("norm_weight", "slope")

    def __init__(self, d_in, num_heads, head_dim, d_out=None, norm_eps=1e-6, block_size=256, *,
                 core=None):
        super().__init__(core)
        width = num_heads * head_dim
        self.heads, self.norm_eps = num_heads, norm_eps
        for role in ("query", "key", "value", "gate"):
            setattr(self, f"{role}_proj", Linear(d_in, width, False))
        self.out_proj = Linear(width, d_in if d_out is None else d_out, False)
        self.norm_weight, self.slope = np.zeros(width), np.zeros(num_heads)

    def __call__(self, x, mask=None):
        x = self.masked(x, mask)
        q, k, v = (_heads(_silu(getattr(self, f"{r}_proj")(x)), self.heads)
                   for r in ("query", "key", "value"))
        s = np.zeros(q.shape[:-3] + q.shape[-2:] + v.shape[-1:], q.dtype)  # (..., H, Dk, Dv)
        decay, out = np.exp(-self.slope)[:, None, None], []
        for t in range(q.shape[-3]):
            s = decay * s + k[..., t, :, :, None] * v[..., t, :, None, :]
            out.append(np.einsum("...kv,...k->...v", s, q[..., t, :, :]))
        o = np.stack(out, axis=-3)
        merged = o.reshape(o.shape[:-2] + (-1,))  # (..., L, H·D)
        normed = _rms(merged, self.norm_eps) * self.norm_weight
        return self.out_proj(_sigmoid(self.gate_proj(x)) * normed)


MODULES = {
    "gated_delta_net": GatedDeltaNet,
    "kimi_delta_attention": KimiDeltaAttention,
    "lightning_attention": LightningAttention,
    "simple_self_attention": SimpleSelfAttention,
    "self_attention": SelfAttention,
    "causal_self_attention": CausalSelfAttention,
    "cross_attention": CrossAttention,
    "multi_head_attention_wrapper": MultiHeadAttentionWrapper,
    "multi_head_attention": MultiHeadAttention,
    "grouped_query_attention": GroupedQueryAttention,
    "multi_head_cross_attention": MultiHeadCrossAttention,
    "multi_head_latent_attention": MultiHeadLatentAttention,
}


def build(variant, config, core=None):
    """The NumPy module of a variant (weights zero until set), None for one it lacks or for an
    option it does not implement (a configuration value other than the default of an argument
    its class does not take)."""
    cls = MODULES.get(variant)
    if cls is None:
        return None
    defaults = {a.name: a.default for a in variants.lookup(variant).args}
    takes = inspect.signature(cls).parameters
    if any(n not in takes and v != defaults[n] for n, v in config.items()):
        return None
    return cls(**{n: v for n, v in config.items() if n in takes}, core=core)


def mapping(variant, config) -> dict:
    """{neutral name: (attribute path, rule)} of the module ``build`` makes."""
    return build(variant, config).mapping()


def runner(core=None, table=mapping):
    """One runner for the whole suite: the core's fixtures through ``core.sdpa``, the modules'
    through ``build`` with ``table`` (a mapping function)."""
    core = core or Attention()
    functional = from_function(core.sdpa, "numpy", name="numpy-port")
    modules = from_module(lambda variant, config: build(variant, config, core), "numpy",
                          mapping=table, name="numpy-port-modules")
    return combine(functional, modules, name="numpy-port")


RUNNER = runner()

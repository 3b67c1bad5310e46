"""Gated delta-rule linear attention in JAX (issue 43): the functional core ``gated_delta_rule``
with its named implementations, and the Flax NNX module ``GatedDeltaNet`` over it.

The mixer is described in golden.specification.recurrent (arguments, neutral parameters, inputs,
the cache) and written plainly in float64 in golden.reference.delta_rule; this is its twin of
torch_attn.recurrent.

Shape legend: B batch, L tokens, H heads (the value heads Hv; Hk key heads, each serving Hv/Hk
value heads), Dk and Dv the key and value widths, C = 2·Hk·Dk + Hv·Dv the convolution's
channels, K its width, T the chunk size, N = ⌈L/T⌉ chunks. Per head the state S is (Dk, Dv):
    S′_t = e^{g_t} S_{t−1};  S_t = S′_t + k_t ⊗ β_t (v_t − S′_tᵀ k_t);  o_t = S_tᵀ q_t

Implementations (``DELTA_RULE_IMPLEMENTATIONS``; ``implementation=None``: "recurrent" for
L = 1, "chunked" otherwise):
    recurrent  one token at a time (``lax.scan`` over L); its autodiff keeps every S_t, so its
               gradient's memory is O(L·Dk·Dv)
    chunked    the WY/UT form (Hugging Face's ``torch_chunk_gated_delta_rule``, FLA's): within
               a chunk of T tokens the T updates solved as one unit lower-triangular system,
               ``lax.scan`` over chunks carrying S; L not a multiple of T is padded with
               g = 0, β = 0, k = q = v = 0 (as HF pads), which leave S unchanged. Its
               ``jax.custom_vjp`` keeps only the inputs and the N chunk-boundary states and
               recomputes each chunk's forward in reverse chunk order: O(L) memory.
Both compute in the inputs' dtype when it is float32 or float64, in float32 otherwise (state
and gates in float32, as FLA); every product at ``Precision.HIGHEST``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from golden.specification import recurrent
from golden.specification.implementations import ran
from golden.specification.recurrent import RecurrentCache
from golden.specification.variants import freeze, thaw

HIGHEST = jax.lax.Precision.HIGHEST
FRAMEWORK = "jax"


def _dot(spec, *operands):
    return jnp.einsum(spec, *operands, precision=HIGHEST)


# ---- one head -----------------------------------------------------------------------------------

def _recurrent_head(q, k, v, g, beta, state):
    """(o (L, Dv), S_L (Dk, Dv)) token by token, for q, k (L, Dk), v (L, Dv), g, beta (L,),
    S_0 ``state`` (Dk, Dv)."""
    def step(s, token):
        qt, kt, vt, gt, bt = token
        s = s * jnp.exp(gt)  # S′_t
        delta = bt * (vt - _dot("kv,k->v", s, kt))  # β_t (v_t − S′_tᵀ k_t)   (Dv,)
        s = s + kt[:, None] * delta[None, :]
        return s, _dot("kv,k->v", s, qt)
    final, o = lax.scan(step, state, (q, k, v, g, beta))
    return o, final


def _chunk(state, q, k, v, g, beta):
    """(o (T, Dv), S after the chunk) of one chunk of T tokens from ``state`` S (Dk, Dv), in the
    WY/UT form: with Γ_i = Σ_{j≤i} g_j and D_ij = e^{Γ_i − Γ_j} (j ≤ i, else 0),
        (I + strict_lower((β k) kᵀ ⊙ D)) [U | W] = [β v | β k e^Γ]
        V̂ = U − W S;   o = (q e^Γ) S + ((q kᵀ) ⊙ D) V̂;   S′ = e^{Γ_T} S + (k e^{Γ_T − Γ})ᵀ V̂."""
    t = q.shape[0]
    cum = jnp.cumsum(g)  # Γ (T,)
    lower = jnp.tril(jnp.ones((t, t), bool))
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, cum[:, None] - cum[None, :], 0)), 0)
    k_beta = k * beta[:, None]  # (T, Dk)
    system = jnp.eye(t, dtype=q.dtype) + jnp.tril(_dot("ik,jk->ij", k_beta, k) * decay, -1)
    rhs = jnp.concatenate([v * beta[:, None], k_beta * jnp.exp(cum)[:, None]], axis=-1)
    solved = jax.scipy.linalg.solve_triangular(system, rhs, lower=True, unit_diagonal=True)
    u, w = solved[:, :v.shape[-1]], solved[:, v.shape[-1]:]  # (T, Dv), (T, Dk)
    fresh = u - _dot("ik,kv->iv", w, state)  # V̂ (T, Dv)
    o = (_dot("ik,kv->iv", q * jnp.exp(cum)[:, None], state)
         + _dot("ij,jv->iv", _dot("ik,jk->ij", q, k) * decay, fresh))
    new = (state * jnp.exp(cum[-1])
           + _dot("ik,iv->kv", k * jnp.exp(cum[-1] - cum)[:, None], fresh))
    return o, new


@jax.custom_vjp
def _chunk_scan(state, q, k, v, g, beta):
    """(o (N, T, Dv), S_final) of chunked inputs q, k (N, T, Dk), v (N, T, Dv), g, beta (N, T)."""
    (o, final), _ = _chunk_scan_fwd(state, q, k, v, g, beta)
    return o, final


def _chunk_scan_fwd(state, q, k, v, g, beta):
    def step(s, chunk):
        o, new = _chunk(s, *chunk)
        return new, (o, s)  # s: the state entering the chunk
    final, (o, starts) = lax.scan(step, state, (q, k, v, g, beta))
    return (o, final), (starts, q, k, v, g, beta)  # residuals: inputs, N boundary states


def _chunk_scan_bwd(residuals, cotangents):
    starts, q, k, v, g, beta = residuals
    d_o, d_final = cotangents

    def step(d_s, chunk):
        start, qc, kc, vc, gc, bc, d_oc = chunk
        _, pullback = jax.vjp(_chunk, start, qc, kc, vc, gc, bc)  # the chunk recomputed
        d_start, *d_inputs = pullback((d_oc, d_s))
        return d_start, tuple(d_inputs)
    d_state, d_inputs = lax.scan(step, d_final, (starts, q, k, v, g, beta, d_o), reverse=True)
    return (d_state, *d_inputs)


_chunk_scan.defvjp(_chunk_scan_fwd, _chunk_scan_bwd)


def _chunked_head(q, k, v, g, beta, state, chunk_size):
    """As ``_recurrent_head``, by chunks of ``chunk_size`` tokens (the last padded)."""
    length = q.shape[0]
    pad = -length % chunk_size
    tokens = [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in (q, k, v, g, beta)]
    chunks = [a.reshape((-1, chunk_size) + a.shape[1:]) for a in tokens]  # (N, T, ...)
    o, final = _chunk_scan(state, *chunks)
    return o.reshape((-1, v.shape[-1]))[:length], final  # (L, Dv)


DELTA_RULE_IMPLEMENTATIONS = {
    "recurrent": lambda q, k, v, g, beta, state, chunk_size: _recurrent_head(
        q, k, v, g, beta, state),
    "chunked": _chunked_head,
}


# ---- the functional core ------------------------------------------------------------------------

def compute_dtype(dtype):
    """The dtype the delta rule runs in: float32 and float64 as they are, float32 for the rest."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _check_choice(implementation, chunk_size):
    """ValueError unless ``implementation`` is None or a registered name and ``chunk_size`` a
    positive int."""
    if implementation is not None and implementation not in DELTA_RULE_IMPLEMENTATIONS:
        raise ValueError(f"implementation should be None or one of "
                         f"{', '.join(map(repr, DELTA_RULE_IMPLEMENTATIONS))}, got "
                         f"{implementation!r}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size should be a positive int, got {chunk_size!r}")


def _check_core(q, k, v, g, beta, initial_state, implementation, chunk_size):
    _check_choice(implementation, chunk_size)
    if q.ndim != 4:
        raise ValueError(f"q shape should be (B, H, L, Dk), got {tuple(q.shape)}")
    b, h, length, dk = q.shape
    want = {"k": (k, (b, h, length, dk)), "v": (v, (b, h, length, v.shape[-1])),
            "g": (g, (b, h, length)), "beta": (beta, (b, h, length))}
    if initial_state is not None:
        want["initial_state"] = (initial_state, (b, h, dk, v.shape[-1]))
    for name, (a, shape) in want.items():
        if tuple(a.shape) != shape:
            raise ValueError(f"{name} shape should be {shape}, got {tuple(a.shape)}")


def gated_delta_rule(q, k, v, g, beta, *, initial_state=None, implementation=None,
                     chunk_size=64):
    """The gated delta rule over L tokens: (o (B, H, L, Dv), final_state (B, H, Dk, Dv)).

    q, k (B, H, L, Dk): already L2-normalised, q already scaled by Dk^−1/2, both repeated to the
    value heads; v (B, H, L, Dv); g (B, H, L) the log-decay (≤ 0); beta (B, H, L).
    ``initial_state`` S_0 (B, H, Dk, Dv) (None: zeros). ``implementation``: a name of
    ``DELTA_RULE_IMPLEMENTATIONS`` or None ("recurrent" for L = 1, else "chunked"); the one
    that runs is recorded (golden.specification.implementations.record). The result and the
    state are in the compute dtype (``compute_dtype`` of q's)."""
    _check_core(q, k, v, g, beta, initial_state, implementation, chunk_size)
    if implementation is None:
        implementation = "recurrent" if q.shape[-2] == 1 else "chunked"
    ran(FRAMEWORK, implementation)
    dtype = compute_dtype(q.dtype)
    if initial_state is None:
        initial_state = jnp.zeros(q.shape[:2] + (q.shape[-1], v.shape[-1]), dtype)
    return _core(*(a.astype(dtype) for a in (q, k, v, g, beta, initial_state)),
                 implementation=implementation, chunk_size=chunk_size)


@jax.jit(static_argnames=("implementation", "chunk_size"))
def _core(q, k, v, g, beta, state, *, implementation, chunk_size):
    head = DELTA_RULE_IMPLEMENTATIONS[implementation]
    per_batch = jax.vmap(jax.vmap(head, in_axes=(0,) * 6 + (None,)), in_axes=(0,) * 6 + (None,))
    return per_batch(q, k, v, g, beta, state, chunk_size)


# ---- the module ---------------------------------------------------------------------------------

def _silu(z):
    return z * jax.nn.sigmoid(z)


def _causal_conv(u, w, held):
    """(y (B, L, C), the last K − 1 inputs (B, K − 1, C)): y_t[c] = Σ_i w[c, i] u_{t−K+1+i}[c]
    over ``held`` (B, K − 1, C) (the inputs before the first token) then u (B, L, C)."""
    kernel, length = w.shape[-1], u.shape[-2]
    padded = jnp.concatenate([held, u], axis=-2)  # (B, K − 1 + L, C)
    y = sum(padded[:, i:i + length, :] * w[:, i] for i in range(kernel))
    return y, padded[:, padded.shape[1] - (kernel - 1):, :]


def _l2_normalize(a, eps):
    return a * lax.rsqrt(jnp.sum(a * a, axis=-1, keepdims=True) + eps)


def _heads(y, heads):
    """(B, L, H·D) -> (B, H, L, D)."""
    return jnp.swapaxes(y.reshape(y.shape[:-1] + (heads, -1)), 1, 2)


class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo hybrid; golden.specification.recurrent): a
    causal depthwise convolution and SiLU on the query, key and value projections, per-head
    L2-normalised q and k, the gated delta rule (``gated_delta_rule``) with β = σ(x W_beta)
    (2σ with ``allow_neg_eigval``) and g = −e^{A_log} softplus(x W_decay + dt_bias), then
    RMSNorm(o)·norm_weight ⊙ SiLU(x W_gate) through out_proj.

    Parameters: W_query, W_key, W_value, W_gate, W_beta, W_decay, out_proj (``nnx.Linear``, no
    bias, kernels (in, out)); conv_query, conv_key, conv_value (channels, K), A_log, dt_bias
    (Hv,), norm_weight (Dv,) as ``nnx.Param``. Cast them (``nnx.update``) for another dtype;
    float64 needs ``jax.enable_x64``.

    Call: x (B, L, d_in) or (L, d_in), ``mask`` (B, L) bool, True = a real token (padded
    tokens' x zeroed); returns y (B, L, d_out), or (y, new cache) with ``cache`` (a
    RecurrentCache from ``init_cache``: the call continues from its convolution inputs and
    state). ``implementation`` and ``chunk_size`` go to ``gated_delta_rule``.
    """

    variant = "gated_delta_net"

    def __init__(self, d_in, num_k_heads, num_v_heads, head_k_dim, head_v_dim, d_out=None,
                 conv_kernel=4, norm_eps=1e-6, l2norm_eps=1e-6, allow_neg_eigval=False, *,
                 rngs, precision=HIGHEST):
        described = recurrent.get(self.variant)
        config = described.config(dict(
            d_in=d_in, num_k_heads=num_k_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim,
            head_v_dim=head_v_dim, d_out=d_out, conv_kernel=conv_kernel, norm_eps=norm_eps,
            l2norm_eps=l2norm_eps, allow_neg_eigval=allow_neg_eigval))
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs should be a flax.nnx.Rngs (nnx.Rngs(seed)), got "
                            f"{type(rngs).__name__}")
        self._config = tuple((n, freeze(v)) for n, v in config.items())  # static under jit
        shapes = described.shapes(config)
        for role, name in described.layers.items():
            d_from, d_to = shapes[f"W_{role}"]
            setattr(self, name, nnx.Linear(d_from, d_to, use_bias=False, precision=precision,
                                           rngs=rngs))
        for name in ("conv_query", "conv_key", "conv_value"):  # PyTorch's Conv1d default
            bound = 1 / np.sqrt(conv_kernel)
            setattr(self, name, nnx.Param(jax.random.uniform(
                rngs.params(), shapes[name], jnp.float32, -bound, bound)))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(  # HF: A ~ U(0, 16)
            rngs.params(), (num_v_heads,), jnp.float32, 1.0, 16.0)))
        self.dt_bias = nnx.Param(jnp.ones((num_v_heads,), jnp.float32))
        self.norm_weight = nnx.Param(jnp.ones((head_v_dim,), jnp.float32))

    @property
    def config(self) -> dict:
        """The constructor arguments, complete (what ``build`` needs besides the parameters)."""
        return {n: thaw(v) for n, v in self._config}

    def init_cache(self, batch_size, max_length) -> RecurrentCache:
        """A RecurrentCache of zeros: conv (B, K − 1, C) in the projections' dtype, state
        (B, Hv, Dk, Dv) in the compute dtype (float32, or float64 for a float64 module),
        lengths (B,) int32. ``max_length`` bounds the tokens the cache may take (checked on
        the host by the call when the lengths are concrete)."""
        shapes = recurrent.cache_shapes(self.config, batch_size)
        if not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length should be a positive int, got {max_length!r}")
        self.max_length = max_length  # static: what the calls with a cache may reach
        dtype = self.W_query.kernel.get_value().dtype
        return RecurrentCache(jnp.zeros(shapes["conv"], dtype),
                              jnp.zeros(shapes["state"], compute_dtype(dtype)),
                              jnp.zeros(shapes["lengths"], jnp.int32))

    def __call__(self, x, mask=None, *, cache=None, implementation=None, chunk_size=64):
        described = recurrent.get(self.variant)
        described.check_inputs(self.config, {"x": x, "mask": mask})
        lead = tuple(x.shape[:-2])
        if cache is not None:
            recurrent.check_cache(self.config, cache, lead)
            self._check_fits(cache, x.shape[-2])
        _check_choice(implementation, chunk_size)
        if not lead:  # unbatched: a batch of one
            x = x[None]
            mask = None if mask is None else mask[None]
            cache = None if cache is None else RecurrentCache(*(a[None] for a in cache))
        y, new = self._call(x, mask, cache, implementation=implementation,
                            chunk_size=chunk_size)
        if not lead:
            y, new = y[0], RecurrentCache(*(a[0] for a in new))
        return y if cache is None else (y, new)

    def _check_fits(self, cache, length):
        limit = getattr(self, "max_length", None)
        if limit is None or isinstance(cache.lengths, jax.core.Tracer):
            return
        reach = int(np.max(np.asarray(cache.lengths), initial=0)) + length
        if reach > limit:
            raise ValueError(f"cache max_length is {limit} (init_cache), but this call of "
                             f"{length} tokens would reach {reach}")

    @nnx.jit(graph=False, static_argnames=("implementation", "chunk_size"))
    def _call(self, x, mask, cache, *, implementation, chunk_size):
        c = self.config
        hk, hv, dk, dv = c["num_k_heads"], c["num_v_heads"], c["head_k_dim"], c["head_v_dim"]
        if mask is not None:
            x = x * mask[..., None].astype(x.dtype)
        dtype = compute_dtype(x.dtype)
        u = jnp.concatenate([self.W_query(x), self.W_key(x), self.W_value(x)], axis=-1)
        held = (jnp.zeros(x.shape[:1] + (c["conv_kernel"] - 1, u.shape[-1]), u.dtype)
                if cache is None else cache.conv.astype(u.dtype))
        w = jnp.concatenate([p.get_value() for p in
                             (self.conv_query, self.conv_key, self.conv_value)], axis=0)
        pre, kept = _causal_conv(u.astype(dtype), w.astype(dtype), held.astype(dtype))
        act = _silu(pre)  # (B, L, C)
        q_end, k_end = hk * dk, 2 * hk * dk
        eps = c["l2norm_eps"]
        q = _l2_normalize(_heads(act[..., :q_end], hk), eps) * (dk ** -0.5)
        k = _l2_normalize(_heads(act[..., q_end:k_end], hk), eps)
        v = _heads(act[..., k_end:], hv)
        q, k = (jnp.repeat(a, hv // hk, axis=1) for a in (q, k))  # value head h: key h // group
        beta = jax.nn.sigmoid(jnp.swapaxes(self.W_beta(x).astype(dtype), 1, 2))  # (B, Hv, L)
        if c["allow_neg_eigval"]:
            beta = 2 * beta
        decay_in = self.W_decay(x).astype(dtype) + self.dt_bias.get_value().astype(dtype)
        g = -jnp.exp(self.A_log.get_value().astype(dtype))[:, None] * jax.nn.softplus(
            jnp.swapaxes(decay_in, 1, 2))  # (B, Hv, L)
        state = None if cache is None else cache.state
        o, final = gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                    implementation=implementation, chunk_size=chunk_size)
        z = _heads(self.W_gate(x), hv).astype(dtype)  # (B, Hv, L, Dv)
        normed = o * lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + c["norm_eps"])
        out = normed * self.norm_weight.get_value().astype(dtype) * _silu(z)
        merged = jnp.swapaxes(out, 1, 2).reshape(x.shape[:2] + (hv * dv,)).astype(x.dtype)
        y = self.out_proj(merged)
        lengths = (jnp.zeros(x.shape[:1], jnp.int32) if cache is None else cache.lengths)
        new = RecurrentCache(kept.astype(u.dtype), final.astype(
            final.dtype if cache is None else cache.state.dtype), lengths + x.shape[1])
        return y, new

"""The recurrent token mixers in JAX (issue 43), Flax NNX modules over the functional cores of
jax_attn.delta_rule (re-exported here): ``GatedDeltaNet`` and ``KimiDeltaAttention`` over
``gated_delta_rule`` (a decay per head, or per key channel), ``LightningAttention`` over
``lightning_rule``.

The mixers are described in golden.specification.recurrent (arguments, neutral parameters,
inputs, the cache) and written plainly in float64 in golden.reference.delta_rule; these are the
twins of torch_attn.recurrent's.

Shape legend: B batch, L tokens, H heads (the value heads Hv; Hk key heads, each serving Hv/Hk
value heads), Dk and Dv the key and value widths, C the projected channels (2·Hk·Dk + Hv·Dv),
K the convolution's width. All three share the call (x, mask, cache, implementation), the
RecurrentCache (lightning attention: a convolution of width 0, conv (B, 0, C)) and the input
masking; the delta-rule pair share the convolution, the L2 normalisation and the output norm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from golden.specification import recurrent
from golden.specification.recurrent import RecurrentCache
from golden.specification.variants import freeze, thaw
from jax_attn.delta_rule import (  # noqa: F401  (public here: jax_attn.recurrent.<name>)
    DELTA_RULE_IMPLEMENTATIONS,
    HIGHEST,
    LIGHTNING_IMPLEMENTATIONS,
    _check_choice,
    compute_dtype,
    gated_delta_rule,
    lightning_rule,
)


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


def _rms(a, eps):
    return a * lax.rsqrt(jnp.mean(a * a, axis=-1, keepdims=True) + eps)


def _heads(y, heads):
    """(B, L, H·D) -> (B, H, L, D)."""
    return jnp.swapaxes(y.reshape(y.shape[:-1] + (heads, -1)), 1, 2)


def _merge(y):
    """(B, H, L, D) -> (B, L, H·D)."""
    return jnp.swapaxes(y, 1, 2).reshape(y.shape[:1] + y.shape[2:3] + (-1,))


def _conv_init(rngs, shape, kernel):
    """PyTorch's Conv1d default: U(±K^−1/2)."""
    bound = 1 / np.sqrt(kernel)
    return nnx.Param(jax.random.uniform(rngs.params(), shape, jnp.float32, -bound, bound))


class _Mixer(nnx.Module):
    """What the recurrent mixers share: the configuration (checked by its description), the
    projections (``nnx.Linear``, no bias, kernels (in, out); a low-rank one as two), the cache,
    and the call's checks and unbatching. A subclass sets ``variant`` and defines ``_call(x,
    mask, cache, *, implementation, size) -> (y, new cache)`` on a batch."""

    variant = ""

    def _setup(self, config, rngs, precision):
        """The checked configuration (kept static) and one ``nnx.Linear`` per projection of the
        description that the configuration has (the others None); returns the shapes."""
        described = recurrent.get(self.variant)
        config = described.config(config)
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs should be a flax.nnx.Rngs (nnx.Rngs(seed)), got "
                            f"{type(rngs).__name__}")
        self._config = tuple((n, freeze(v)) for n, v in config.items())  # static under jit
        shapes = described.shapes(config)
        for role, name in described.layers.items():
            shape = shapes.get(f"W_{role}")
            setattr(self, name, None if shape is None else nnx.Linear(
                *shape, use_bias=False, precision=precision, rngs=rngs))
        return shapes

    def _project(self, role, x):
        """x W_role, or (x W_role_a) W_role_b where the projection is low-rank."""
        layer = getattr(self, f"W_{role}")
        if layer is not None:
            return layer(x)
        return getattr(self, f"W_{role}_b")(getattr(self, f"W_{role}_a")(x))

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

    def _checked_call(self, x, mask, cache, implementation, size, registry, size_name):
        recurrent.get(self.variant).check_inputs(self.config, {"x": x, "mask": mask})
        lead = tuple(x.shape[:-2])
        if cache is not None:
            recurrent.check_cache(self.config, cache, lead)
            self._check_fits(cache, x.shape[-2])
        _check_choice(implementation, size, registry, size_name)
        if not lead:  # unbatched: a batch of one
            x = x[None]
            mask = None if mask is None else mask[None]
            cache = None if cache is None else RecurrentCache(*(a[None] for a in cache))
        y, new = self._call(x, mask, cache, implementation=implementation, size=size)
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

    def _new_cache(self, cache, x, kept, final):
        """The RecurrentCache after x: the convolution's inputs ``kept``, the state ``final``
        (in the given cache's dtype), the lengths advanced by L."""
        lengths = jnp.zeros(x.shape[:1], jnp.int32) if cache is None else cache.lengths
        state_dtype = final.dtype if cache is None else cache.state.dtype
        return RecurrentCache(kept, final.astype(state_dtype), lengths + x.shape[1])


class _DeltaMixer(_Mixer):
    """The delta-rule mixers' shared call: x masked, q, k, v through the causal convolution and
    SiLU, q and k L2-normalised per head (q scaled by Dk^−1/2, both repeated to the value
    heads), ``gated_delta_rule`` with the subclass's β (``_beta``) and log-decay (``_decay``),
    then RMSNorm(o)·norm_weight ⊙ act(gate) (``_gate``) through out_proj."""

    def _conv_params(self, shapes, kernel, rngs):
        for name in ("conv_query", "conv_key", "conv_value"):
            setattr(self, name, _conv_init(rngs, shapes[name], kernel))

    def __call__(self, x, mask=None, *, cache=None, implementation=None, chunk_size=64):
        return self._checked_call(x, mask, cache, implementation, chunk_size,
                                  DELTA_RULE_IMPLEMENTATIONS, "chunk_size")

    @nnx.jit(graph=False, static_argnames=("implementation", "size"))
    def _call(self, x, mask, cache, *, implementation, size):
        c = self.config
        hk, hv, dk, dv = recurrent.sizes(c)
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
        state = None if cache is None else cache.state
        o, final = gated_delta_rule(q, k, v, self._decay(x, dtype), self._beta(beta),
                                    initial_state=state, implementation=implementation,
                                    chunk_size=size)
        out = (_rms(o, c["norm_eps"]) * self.norm_weight.get_value().astype(dtype)
               * self._gate(_heads(self._project("gate", x), hv).astype(dtype)))
        y = self.out_proj(_merge(out).astype(x.dtype))
        return y, self._new_cache(cache, x, kept.astype(u.dtype), final)


class GatedDeltaNet(_DeltaMixer):
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
        shapes = self._setup(dict(
            d_in=d_in, num_k_heads=num_k_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim,
            head_v_dim=head_v_dim, d_out=d_out, conv_kernel=conv_kernel, norm_eps=norm_eps,
            l2norm_eps=l2norm_eps, allow_neg_eigval=allow_neg_eigval), rngs, precision)
        self._conv_params(shapes, conv_kernel, rngs)
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(  # HF: A ~ U(0, 16)
            rngs.params(), (num_v_heads,), jnp.float32, 1.0, 16.0)))
        self.dt_bias = nnx.Param(jnp.ones((num_v_heads,), jnp.float32))
        self.norm_weight = nnx.Param(jnp.ones((head_v_dim,), jnp.float32))

    def _beta(self, sig):
        return 2 * sig if self.config["allow_neg_eigval"] else sig

    def _decay(self, x, dtype):
        """g = −e^{A_log} softplus(x W_decay + dt_bias), (B, Hv, L)."""
        decay_in = self.W_decay(x).astype(dtype) + self.dt_bias.get_value().astype(dtype)
        return -jnp.exp(self.A_log.get_value().astype(dtype))[:, None] * jax.nn.softplus(
            jnp.swapaxes(decay_in, 1, 2))

    def _gate(self, z):
        return _silu(z)


class KimiDeltaAttention(_DeltaMixer):
    """Kimi Delta Attention (Kimi Linear, GLM-5.3-Flash, Ling 3.0;
    golden.specification.recurrent): Gated DeltaNet's layer with H heads of D (no grouping), a
    decay per key channel, f = x W_decay (or (x W_decay_a) W_decay_b with ``decay_rank``),
        g = −e^{A_log_h} softplus(f + dt_bias)            ``forget_gate`` "softplus"
        g = λ σ(e^{A_log_h} (f + dt_bias)), λ < 0          "bounded_sigmoid", λ =
                                                            ``decay_lower_bound``
    (B, H, L, D), β = σ(x W_beta), and the output RMSNorm(o)·norm_weight ⊙ σ(x W_gate) (W_gate
    low-rank with ``gate_rank``) through out_proj.

    Parameters: W_query, W_key, W_value, W_beta, W_decay or W_decay_a and W_decay_b, W_gate or
    W_gate_a and W_gate_b, out_proj (``nnx.Linear``, no bias); conv_query, conv_key,
    conv_value (H·D, K), A_log (H,), dt_bias (H·D,), norm_weight (D,) as ``nnx.Param``. The
    call and the cache are GatedDeltaNet's.
    """

    variant = "kimi_delta_attention"

    def __init__(self, d_in, num_heads, head_dim, d_out=None, conv_kernel=4, norm_eps=1e-6,
                 l2norm_eps=1e-6, decay_rank=None, gate_rank=None, forget_gate="softplus",
                 decay_lower_bound=None, *, rngs, precision=HIGHEST):
        shapes = self._setup(dict(
            d_in=d_in, num_heads=num_heads, head_dim=head_dim, d_out=d_out,
            conv_kernel=conv_kernel, norm_eps=norm_eps, l2norm_eps=l2norm_eps,
            decay_rank=decay_rank, gate_rank=gate_rank, forget_gate=forget_gate,
            decay_lower_bound=decay_lower_bound), rngs, precision)
        self._conv_params(shapes, conv_kernel, rngs)
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(
            rngs.params(), (num_heads,), jnp.float32, 1.0, 16.0)))
        self.dt_bias = nnx.Param(jnp.ones((num_heads * head_dim,), jnp.float32))
        self.norm_weight = nnx.Param(jnp.ones((head_dim,), jnp.float32))

    def _beta(self, sig):
        return sig

    def _decay(self, x, dtype):
        """g per key channel (B, H, L, D) by ``forget_gate``."""
        c = self.config
        u = _heads(self._project("decay", x).astype(dtype)
                   + self.dt_bias.get_value().astype(dtype), c["num_heads"])
        rate = jnp.exp(self.A_log.get_value().astype(dtype))[:, None, None]
        if c["forget_gate"] == "softplus":
            return -rate * jax.nn.softplus(u)
        return c["decay_lower_bound"] * jax.nn.sigmoid(rate * u)

    def _gate(self, z):
        return jax.nn.sigmoid(z)


class LightningAttention(_Mixer):
    """Lightning attention (MiniMax-Text-01 / M1's linear layers;
    golden.specification.recurrent): q, k, v = SiLU(x W_query), SiLU(x W_key), SiLU(x W_value)
    (no convolution, no normalisation), per head S_t = e^{−slope_h} S_{t−1} + k_t ⊗ v_t and
    o_t = S_tᵀ q_t (``lightning_rule``), then σ(x W_gate) ⊙ RMSNorm_{H·D}(merge(o))·norm_weight
    through out_proj.

    Parameters: W_query, W_key, W_value, W_gate, out_proj (``nnx.Linear``, no bias);
    norm_weight (H·D,), slope (H,) as ``nnx.Param``. ``block_size``: the chunked
    implementation's block length (the function does not depend on it).

    Call: as GatedDeltaNet's, with ``block_size`` (None: the configuration's) in place of
    ``chunk_size``, as torch_attn's; its RecurrentCache's conv is (B, 0, 3·H·D) (no
    convolution), state (B, H, D, D).
    """

    variant = "lightning_attention"

    def __init__(self, d_in, num_heads, head_dim, d_out=None, norm_eps=1e-6, block_size=256, *,
                 rngs, precision=HIGHEST):
        self._setup(dict(d_in=d_in, num_heads=num_heads, head_dim=head_dim, d_out=d_out,
                         norm_eps=norm_eps, block_size=block_size), rngs, precision)
        self.norm_weight = nnx.Param(jnp.ones((num_heads * head_dim,), jnp.float32))
        self.slope = nnx.Param(  # MiniMax's slope_rate of a first layer: 2^{−8(h+1)/H}
            2.0 ** (-8.0 * jnp.arange(1, num_heads + 1, dtype=jnp.float32) / num_heads))

    def __call__(self, x, mask=None, *, cache=None, implementation=None, block_size=None):
        size = self.config["block_size"] if block_size is None else block_size
        return self._checked_call(x, mask, cache, implementation, size,
                                  LIGHTNING_IMPLEMENTATIONS, "block_size")

    @nnx.jit(graph=False, static_argnames=("implementation", "size"))
    def _call(self, x, mask, cache, *, implementation, size):
        c = self.config
        if mask is not None:
            x = x * mask[..., None].astype(x.dtype)
        dtype = compute_dtype(x.dtype)
        q, k, v = (_heads(_silu(self._project(role, x).astype(dtype)), c["num_heads"])
                   for role in ("query", "key", "value"))  # (B, H, L, D)
        state = None if cache is None else cache.state
        o, final = lightning_rule(q, k, v, self.slope.get_value().astype(dtype),
                                  initial_state=state, implementation=implementation,
                                  block_size=size)
        out = (jax.nn.sigmoid(self._project("gate", x).astype(dtype))
               * _rms(_merge(o), c["norm_eps"]) * self.norm_weight.get_value().astype(dtype))
        y = self.out_proj(out.astype(x.dtype))
        width = 3 * c["num_heads"] * c["head_dim"]
        kept = (jnp.zeros(x.shape[:1] + (0, width), x.dtype) if cache is None
                else cache.conv)
        return y, self._new_cache(cache, x, kept, final)

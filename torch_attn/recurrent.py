"""Gated delta-rule linear attention in PyTorch (issue 43): the functional core
``gated_delta_rule`` with its implementations, and the ``GatedDeltaNet`` module over it.

The mixer is described in golden.specification.recurrent (arguments, neutral parameters, the
maths); golden.reference.delta_rule is its float64 reference. Shape legend: B batch, L tokens,
H (= Hv) value heads, Hk key heads, Dk and Dv the key and value widths, K the convolution's
width, C = 2·Hk·Dk + Hv·Dv its channels, N = ⌈L / chunk_size⌉ chunks of T = chunk_size tokens.
Per head, with the state S (Dk, Dv):
    S′_t = e^{g_t} S_{t−1};  S_t = S′_t + k_t ⊗ β_t (v_t − S′_tᵀ k_t);  o_t = S_tᵀ q_t

The core computes in q's dtype when it is float32 or float64 and in float32 for bfloat16 and
float16 inputs (state and gates in float32, as flash-linear-attention does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from golden.specification import implementations, recurrent
from golden.specification.recurrent import RecurrentCache

LOW_PRECISION = (torch.float16, torch.bfloat16)


def _compute_dtype(t):
    return torch.float32 if t.dtype in LOW_PRECISION else t.dtype


# ---- the core ----------------------------------------------------------------------------------

def _recurrent(q, k, v, g, beta, state, chunk_size):
    """One token at a time (the definition): o (B, H, L, Dv), S_L (B, H, Dk, Dv)."""
    outs = []
    for t in range(q.shape[-2]):
        state = state * g[..., t].exp()[..., None, None]  # S′_t
        recalled = torch.einsum("bhkv,bhk->bhv", state, k[..., t, :])  # S′_tᵀ k_t
        delta = beta[..., t, None] * (v[..., t, :] - recalled)
        state = state + k[..., t, :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[..., t, :]))
    return torch.stack(outs, dim=-2), state


def _chunked(q, k, v, g, beta, state, chunk_size):
    """The WY / UT form over chunks of T tokens (transformers' torch_chunk_gated_delta_rule,
    flash-linear-attention's chunk_gated_delta_rule): within a chunk, with Γ_ij = e^{G_i − G_j}
    (i ≥ j, G the cumulative log-decay from the chunk's start) and A = I + tril(diag(β) K Kᵀ ⊙
    Γ, −1), the corrections are U = A⁻¹(β ⊙ V) − A⁻¹(β ⊙ e^G ⊙ K) S; then O = (e^G ⊙ Q) S +
    (Q Kᵀ ⊙ Γ) U and S ← e^{G_T} S + (e^{G_T − G} ⊙ K)ᵀ U. L not a multiple of T: the last
    chunk is padded with g = 0, β = 0, k = 0 (and q = v = 0), which leave S unchanged."""
    length, size = q.shape[-2], chunk_size
    pad = -length % size
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    q, k, v = (t.reshape(t.shape[:2] + (-1, size, t.shape[-1])) for t in (q, k, v))  # (B,H,N,T,D)
    g, beta = (t.reshape(t.shape[:2] + (-1, size)) for t in (g, beta))  # (B, H, N, T)
    cum = g.cumsum(dim=-1)  # G (B, H, N, T)
    lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    gamma = torch.where(lower, cum[..., :, None] - cum[..., None, :], -torch.inf).exp()  # Γ
    k_beta = k * beta[..., None]
    system = torch.eye(size, dtype=q.dtype, device=q.device) + (
        (k_beta @ k.transpose(-1, -2)) * gamma).tril(-1)  # A (B, H, N, T, T)
    new_values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False,
                                               unitriangular=True)  # (B, H, N, T, Dv)
    recall = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                           unitriangular=True)  # (B, H, N, T, Dk)
    within = (q @ k.transpose(-1, -2)) * gamma  # (B, H, N, T, T)
    q_read = q * cum.exp()[..., None]
    k_write = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # (B, H, N, 1, 1)
    outs = []
    for n in range(q.shape[2]):
        u = new_values[:, :, n] - recall[:, :, n] @ state  # (B, H, T, Dv)
        outs.append(q_read[:, :, n] @ state + within[:, :, n] @ u)
        state = state * chunk_decay[:, :, n] + k_write[:, :, n].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2).flatten(2, 3)  # (B, H, N·T, Dv)
    return o[:, :, :length], state


DELTA_RULE_IMPLEMENTATIONS = {"recurrent": _recurrent, "chunked": _chunked}


def _choose(implementation, length) -> str:
    """The implementation a call runs: ``implementation``, or for None "recurrent" at L = 1
    and "chunked" otherwise."""
    if implementation is None:
        return "recurrent" if length == 1 else "chunked"
    if not isinstance(implementation, str) or implementation not in DELTA_RULE_IMPLEMENTATIONS:
        names = ", ".join(repr(n) for n in DELTA_RULE_IMPLEMENTATIONS)
        raise ValueError(f"implementation should be None or one of {names}, got "
                         f"{implementation!r}")
    return implementation


def gated_delta_rule(q, k, v, g, beta, *, initial_state=None, implementation=None,
                     chunk_size=64):
    """(o (B, H, L, Dv), final state (B, H, Dk, Dv)) of the gated delta rule.

    q, k (B, H, L, Dk): already L2-normalised (q also scaled by Dk^−1/2) and repeated to the
    value heads; v (B, H, L, Dv); g (B, H, L) the log-decay (≤ 0); beta (B, H, L);
    initial_state (B, H, Dk, Dv) or None (zeros). ``implementation``: "recurrent" (one token at
    a time), "chunked" (the WY / UT form over chunks of ``chunk_size``) or None ("recurrent"
    for L = 1, "chunked" otherwise); the one that ran is noted in
    golden.specification.implementations.record() as ("torch", name). Computes in q's dtype
    (float32 for bfloat16 and float16); o is returned in v's dtype, the state in the compute
    dtype."""
    recurrent.check_delta_rule_inputs(q, k, v, g, beta, initial_state, chunk_size)
    name = _choose(implementation, q.shape[-2])
    compute = _compute_dtype(q)
    if initial_state is None:
        initial_state = q.new_zeros(q.shape[:2] + (q.shape[-1], v.shape[-1]), dtype=compute)
    arrays = (t.to(compute) for t in (q, k, v, g, beta, initial_state))
    implementations.ran("torch", name)
    o, state = DELTA_RULE_IMPLEMENTATIONS[name](*arrays, chunk_size)
    return o.to(v.dtype), state


# ---- the module --------------------------------------------------------------------------------

def _softplus(z):
    """ln(1 + e^z) without overflow and without torch's threshold (exact where it is linear)."""
    return z.clamp(min=0) + torch.log1p(torch.exp(-z.abs()))


def _heads(t, heads):
    """(B, L, H·D) -> (B, H, L, D)."""
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def _l2_normalize(t, eps):
    return t * torch.rsqrt((t * t).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet (Qwen3-Next, Qwen3.5/3.6, OLMo hybrid): gated delta-rule linear attention
    with a causal depthwise convolution, golden.specification.recurrent's ``gated_delta_net``.

    Parameters: linear layers W_query, W_key (d_in → Hk·Dk), W_value, W_gate (d_in → Hv·Dv),
    W_beta, W_decay (d_in → Hv), out_proj (Hv·Dv → d_out), none with a bias; plain arrays
    conv_query, conv_key (Hk·Dk, K), conv_value (Hv·Dv, K), A_log, dt_bias (Hv,), norm_weight
    (Dv,). Call ``module(x, mask=None, *, cache=None, implementation=None, chunk_size=64)``:
    x (B, L, d_in) or (L, d_in), mask (B, L) bool, True = a real token (padded tokens' x
    zeroed at the input); returns y (B, L, d_out), or (y, new cache) when a RecurrentCache is
    given; ``implementation`` and ``chunk_size`` as ``gated_delta_rule`` takes them.

    Dtypes: the projections in x's dtype; the convolution, gates, normalisations, the delta
    rule and the gated RMSNorm in x's dtype if float32 or float64, else in float32, the
    result rounded once to x's dtype before out_proj."""

    variant = "gated_delta_net"

    def __init__(self, d_in, num_k_heads, num_v_heads, head_k_dim, head_v_dim, d_out=None,
                 conv_kernel=4, norm_eps=1e-6, l2norm_eps=1e-6, allow_neg_eigval=False):
        super().__init__()
        self.config = recurrent.get(self.variant).config(dict(
            d_in=d_in, num_k_heads=num_k_heads, num_v_heads=num_v_heads,
            head_k_dim=head_k_dim, head_v_dim=head_v_dim, d_out=d_out,
            conv_kernel=conv_kernel, norm_eps=norm_eps, l2norm_eps=l2norm_eps,
            allow_neg_eigval=allow_neg_eigval))
        shapes = recurrent.get(self.variant).shapes(self.config)
        for name in ("W_query", "W_key", "W_value", "W_gate", "W_beta", "W_decay"):
            setattr(self, name, nn.Linear(*shapes[name], bias=False))
        self.out_proj = nn.Linear(*shapes["W_out"], bias=False)
        bound = conv_kernel ** -0.5  # nn.Conv1d's default, depthwise
        for name in ("conv_query", "conv_key", "conv_value"):
            setattr(self, name, nn.Parameter(torch.empty(shapes[name]).uniform_(-bound, bound)))
        self.A_log = nn.Parameter(torch.empty(num_v_heads).uniform_(1, 16).log())  # as HF
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.norm_weight = nn.Parameter(torch.ones(head_v_dim))

    def init_cache(self, batch_size, max_length) -> RecurrentCache:
        """A cache of zeros for ``batch_size`` rows: conv (B, K − 1, C) in the parameters'
        dtype, state (B, Hv, Dk, Dv) in float32 (float64 for a float64 module), lengths (B,)
        int32, on the parameters' device. ``max_length`` bounds the tokens the cache may take:
        kept by the module, as JAX's twin does (the RecurrentCache has no field for it), and
        checked by each call with a cache against the cache's lengths (read on the host)."""
        for name, n in (("batch_size", batch_size), ("max_length", max_length)):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"{name} should be a positive int, got {n!r}")
        self.max_length = max_length
        shapes = recurrent.cache_shapes(self.config, batch_size)
        weight = self.W_query.weight
        state_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        return RecurrentCache(
            torch.zeros(shapes["conv"], dtype=weight.dtype, device=weight.device),
            torch.zeros(shapes["state"], dtype=state_dtype, device=weight.device),
            torch.zeros(shapes["lengths"], dtype=torch.int32, device=weight.device))

    def forward(self, x, mask=None, *, cache=None, implementation=None, chunk_size=64):
        recurrent.get(self.variant).check_inputs(self.config, {"x": x, "mask": mask})
        if cache is not None:
            recurrent.check_cache(self.config, cache, tuple(x.shape[:-2]))
            recurrent.check_cache_dtypes(cache)
            self._check_fits(cache, x.shape[-2])
        _choose(implementation, 2)  # an unknown name refused before any work
        single = x.dim() == 2
        if single:  # (L, d_in) -> (1, L, d_in), and the cache and mask alike
            x = x[None]
            mask = None if mask is None else mask[None]
            cache = None if cache is None else RecurrentCache(*(t[None] for t in cache))
        y, new = self._mix(x, mask, cache, implementation, chunk_size)
        if single:
            y = y[0]
            new = None if new is None else RecurrentCache(*(t[0] for t in new))
        return y if cache is None else (y, new)

    def _check_fits(self, cache, length):
        """ValueError when a row would pass init_cache's max_length (a host read)."""
        limit = getattr(self, "max_length", None)
        if limit is None:
            return
        reach = int(cache.lengths.max()) + length if cache.lengths.numel() else length
        if reach > limit:
            raise ValueError(f"cache max_length is {limit} (init_cache), but this call of "
                             f"{length} tokens would reach {reach}")

    def _mix(self, x, mask, cache, implementation, chunk_size):
        """(y (B, L, d_out), the new cache or None) for batched x (B, L, d_in)."""
        c = self.config
        hk, hv, width = c["num_k_heads"], c["num_v_heads"], c["conv_kernel"]
        if mask is not None:
            x = x * mask[..., None].to(x.dtype)
        compute = _compute_dtype(x)
        u = torch.cat([self.W_query(x), self.W_key(x), self.W_value(x)], dim=-1)  # (B, L, C)
        held = (u.new_zeros(u.shape[0], width - 1, u.shape[-1]) if cache is None
                else cache.conv.to(u.dtype))
        q, k, v = self._convolve(torch.cat([held, u], dim=1), compute)
        q = _l2_normalize(q, c["l2norm_eps"]) * c["head_k_dim"] ** -0.5
        k = _l2_normalize(k, c["l2norm_eps"])
        q, k = (t.repeat_interleave(hv // hk, dim=1) for t in (q, k))  # value head h: h // group
        beta = torch.sigmoid(self.W_beta(x).to(compute)).transpose(1, 2)  # (B, Hv, L)
        if c["allow_neg_eigval"]:
            beta = 2 * beta
        g = -self.A_log.to(compute).exp()[:, None] * _softplus(
            self.W_decay(x).to(compute).transpose(1, 2) + self.dt_bias.to(compute)[:, None])
        o, state = gated_delta_rule(q, k, v, g, beta, implementation=implementation,
                                    initial_state=None if cache is None else cache.state,
                                    chunk_size=chunk_size)
        y = self.out_proj(self._gated_norm(o, x).to(x.dtype))
        if cache is None:
            return y, None
        padded = torch.cat([held, u], dim=1)
        conv = padded[:, padded.shape[1] - (width - 1):]  # the last K − 1 inputs
        return y, RecurrentCache(conv.to(cache.conv.dtype), state.to(cache.state.dtype),
                                 cache.lengths + x.shape[1])

    def _convolve(self, padded, compute):
        """SiLU of the causal depthwise convolution over ``padded`` (B, K − 1 + L, C), as q, k
        (B, Hk, L, Dk) and v (B, Hv, L, Dv) in ``compute``."""
        c, width = self.config, self.config["conv_kernel"]
        w = torch.cat([self.conv_query, self.conv_key, self.conv_value]).to(compute)  # (C, K)
        length = padded.shape[1] - (width - 1)
        padded = padded.to(compute)
        pre = sum(padded[:, i:i + length] * w[:, i] for i in range(width))  # (B, L, C)
        widths = [c["num_k_heads"] * c["head_k_dim"]] * 2 + [c["num_v_heads"] * c["head_v_dim"]]
        q, k, v = F.silu(pre).split(widths, dim=-1)
        return (_heads(q, c["num_k_heads"]), _heads(k, c["num_k_heads"]),
                _heads(v, c["num_v_heads"]))

    def _gated_norm(self, o, x):
        """RMSNorm(o) · norm_weight ⊙ SiLU(x W_gate), heads merged: (B, L, Hv·Dv), in o's
        dtype (the compute dtype)."""
        z = _heads(self.W_gate(x), self.config["num_v_heads"]).to(o.dtype)
        unit = o * torch.rsqrt(o.pow(2).mean(dim=-1, keepdim=True) + self.config["norm_eps"])
        return (unit * self.norm_weight.to(o.dtype) * F.silu(z)).transpose(1, 2).flatten(2)

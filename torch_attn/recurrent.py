"""Linear attention in PyTorch (issue 43): the delta-rule core ``gated_delta_rule`` (a decay per
head, Gated DeltaNet, or per key channel, Kimi Delta Attention) and lightning attention's
``lightning_rule``, each with its registry of implementations, and the ``GatedDeltaNet``,
``KimiDeltaAttention`` and ``LightningAttention`` modules over them.

The mixers are described in golden.specification.recurrent (arguments, neutral parameters, the
maths); golden.reference.delta_rule is their float64 reference. Shape legend: B batch, L tokens,
H (= Hv) value heads, Hk key heads, Dk and Dv the key and value widths, K the convolution's
width, C = 2·Hk·Dk + Hv·Dv its channels, N = ⌈L / chunk_size⌉ chunks of T = chunk_size tokens.
Per head, with the state S (Dk, Dv) and the decay a_t = e^{g_t} (a number, or (Dk,) per key
channel, scaling S's rows):
    S′_t = a_t ⊙ S_{t−1};  S_t = S′_t + k_t ⊗ β_t (v_t − S′_tᵀ k_t);  o_t = S_tᵀ q_t
and lightning attention's S_t = e^{−slope} S_{t−1} + k_t ⊗ v_t, o_t = S_tᵀ q_t.

The cores compute in q's dtype when it is float32 or float64 and in float32 for bfloat16 and
float16 inputs (state and gates in float32, as flash-linear-attention does).
"""

from __future__ import annotations

import contextlib
import contextvars

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
    """One token at a time (the definition): o (B, H, L, Dv), S_L (B, H, Dk, Dv); the decay
    e^{g_t} one per head (g (B, H, L)) or per key channel (g (B, H, L, Dk))."""
    decay = g.exp()[..., None] if g.dim() == 4 else g.exp()[..., None, None]  # per Dk or head
    outs = []
    for t in range(q.shape[-2]):
        state = state * decay[:, :, t]  # S′_t
        recalled = torch.einsum("bhkv,bhk->bhv", state, k[..., t, :])  # S′_tᵀ k_t
        delta = beta[..., t, None] * (v[..., t, :] - recalled)
        state = state + k[..., t, :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[..., t, :]))
    return torch.stack(outs, dim=-2), state


def _chunked(q, k, v, g, beta, state, chunk_size):
    """The WY / UT form over chunks of T tokens (transformers' torch_chunk_gated_delta_rule and
    chunk_kimi_delta_attention, flash-linear-attention's chunk_gated_delta_rule / chunk_kda):
    within a chunk, with G the cumulative log-decay from the chunk's start (per head, or per key
    channel) and (X ⋆ Y)_ij = Σ_d X_id Y_jd e^{G_id − G_jd} for j ≤ i, 0 above
    (``_decayed_products``), A = I + diag(β)(K ⋆ K) strictly below the diagonal; the
    corrections are U = A⁻¹(β ⊙ V) − A⁻¹(β ⊙ e^G ⊙ K) S; then O = (e^G ⊙ Q) S + (Q ⋆ K) U and
    S ← e^{G_T} S + (e^{G_T − G} ⊙ K)ᵀ U. L not a multiple of T: the last chunk is padded
    with g = 0, β = 0, k = 0 (and q = v = 0), which leave S unchanged. Every exponent taken is
    ≤ 0 (no overflow at any decay). G and its differences are formed in float64 whatever the
    compute dtype (except on Apple's MPS, which has no float64), each factor e^(·) then
    rounded to it once: in float32 a difference of two cumulative sums of size |G| errs by
    u·|G|, which e^(·) turns into a relative error of the same size (ten times the
    recurrence's float32 error on Kimi Linear's checkpoint)."""
    length, size = q.shape[-2], chunk_size
    pad = -length % size
    g = g if g.dim() == 4 else g[..., None]  # (B, H, L, Dk) or (B, H, L, 1): one per head
    q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
    beta = F.pad(beta, (0, pad))
    q, k, v, g = (t.reshape(t.shape[:2] + (-1, size, t.shape[-1])) for t in (q, k, v, g))
    beta = beta.reshape(beta.shape[:2] + (-1, size))  # (B, H, N, T)
    # float64 where the device has it (Apple's MPS has none: there, the compute dtype)
    wide = q.dtype if _HF_DECAYS.get() or q.device.type == "mps" else torch.float64
    cum = g.to(wide).cumsum(dim=-2)  # G (B, H, N, T, Dk or 1), in float64
    exp = (lambda t: t.exp().to(q.dtype))  # a factor e^(·), rounded once
    k_beta = k * beta[..., None]
    written, within = _decayed_products(cum, (k_beta, k), (q, k))  # (B, H, N, T, T)
    system = torch.eye(size, dtype=q.dtype, device=q.device) + written.tril(-1)  # A
    new_values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False,
                                               unitriangular=True)  # (B, H, N, T, Dv)
    recall = torch.linalg.solve_triangular(system, k_beta * exp(cum), upper=False,
                                           unitriangular=True)  # (B, H, N, T, Dk)
    q_read = q * exp(cum)
    k_write = k * exp(cum[..., -1:, :] - cum)
    chunk_decay = exp(cum[..., -1, :])[..., None]  # (B, H, N, Dk or 1, 1)
    outs = []
    for n in range(q.shape[2]):
        u = new_values[:, :, n] - recall[:, :, n] @ state  # (B, H, T, Dv)
        outs.append(q_read[:, :, n] @ state + within[:, :, n] @ u)
        state = state * chunk_decay[:, :, n] + k_write[:, :, n].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2).flatten(2, 3)  # (B, H, N·T, Dv)
    return o[:, :, :length], state


SUB_CHUNK = 16  # the per-channel products' sub-chunk, as flash-linear-attention's chunk_kda
# HF's arithmetic for the decays (``hf_decay_arithmetic``): G and its differences formed in the
# compute dtype, as transformers' and flash-linear-attention's chunked kernels form them.
_HF_DECAYS = contextvars.ContextVar("hf_decays", default=False)


@contextlib.contextmanager
def hf_decay_arithmetic():
    """Inside, the "chunked" implementation forms the cumulative log-decay G and its differences
    in the compute dtype (float32 for a float32 call), as Hugging Face's chunked kernels do,
    instead of float64: what a checker measuring HF's own float32 error needs as HF's peer
    (golden.verifier.linear). Not for computing with: the result is less accurate."""
    token = _HF_DECAYS.set(True)
    try:
        yield
    finally:
        _HF_DECAYS.reset(token)


def _decayed_products(cum, *pairs):
    """[M (..., T, T) for each (a, b) of ``pairs``], M_ij = Σ_d a_id b_jd e^{G_id − G_jd} for
    j ≤ i, 0 above, for a, b (..., T, D) and G = ``cum`` (..., T, D), or (..., T, 1) for one
    decay per head (then M = (a bᵀ) ⊙ Γ); the decay factors computed once for all pairs. Per
    channel, never e^{G} and e^{−G} apart (e^{−G} overflows when the decay is strong): within
    a sub-chunk of s tokens the differences G_i − G_j themselves (s × s × D, as transformers'
    chunk_kimi_delta_attention does for the whole chunk); across sub-chunks through the
    query's sub-chunk start r, e^{G_i − G_r} e^{G_r − G_j}, both factors ≤ 1. ``cum`` may be
    wider than a and b (float64: ``_chunked``): each factor is rounded to their dtype."""
    size, dtype = cum.shape[-2], pairs[0][0].dtype
    if cum.shape[-1] == 1:  # one decay per head
        lower = torch.ones(size, size, dtype=torch.bool, device=cum.device).tril()
        gamma = torch.where(lower, cum[..., :, None, 0] - cum[..., None, :, 0],
                            -torch.inf).exp().to(dtype)
        return [(a @ b.transpose(-1, -2)) * gamma for a, b in pairs]
    s = max(d for d in range(1, min(SUB_CHUNK, size) + 1) if size % d == 0)
    n = size // s
    cum = cum.unflatten(-2, (n, s))  # (..., n, s, D)
    keep = torch.ones(s, s, dtype=torch.bool, device=cum.device).tril()
    diff = cum[..., :, None, :] - cum[..., None, :, :]  # (..., n, s_i, s_j, D)
    decay = torch.where(keep[..., None], diff, -torch.inf).exp().to(dtype)
    start = cum[..., :, :1, :]  # G_r (..., n, 1, D): each sub-chunk's first token
    read = (cum - start).exp().to(dtype)  # e^{G_i − G_r} (..., n, s, D)
    before = torch.ones(n, n, dtype=torch.bool, device=cum.device).tril(-1)  # b < a
    cross = start[..., :, None, :, :] - cum[..., None, :, :, :]  # (..., n_a, n_b, s, D)
    written = torch.where(before[:, :, None, None], cross, -torch.inf).exp().to(dtype)
    eye = torch.eye(n, dtype=dtype, device=cum.device)  # written: e^{G_r − G_j}
    out = []
    for a, b in pairs:
        a, b = a.unflatten(-2, (n, s)), b.unflatten(-2, (n, s))  # (..., n, s, D)
        diag = (a[..., :, None, :] * b[..., None, :, :] * decay).sum(dim=-1)  # (..., n, s, s)
        full = torch.einsum("...aid,...abjd->...aibj", a * read, b[..., None, :, :, :] * written)
        full = full + torch.einsum("...aij,ab->...aibj", diag, eye)  # (..., n, s, n, s)
        out.append(full.reshape(full.shape[:-4] + (size, size)))
    return out


DELTA_RULE_IMPLEMENTATIONS = {"recurrent": _recurrent, "chunked": _chunked}


def _choose(implementation, length, registry=DELTA_RULE_IMPLEMENTATIONS) -> str:
    """The implementation a call runs: ``implementation``, or for None "recurrent" at L = 1
    and "chunked" otherwise."""
    if implementation is None:
        return "recurrent" if length == 1 else "chunked"
    if not isinstance(implementation, str) or implementation not in registry:
        names = ", ".join(repr(n) for n in registry)
        raise ValueError(f"implementation should be None or one of {names}, got "
                         f"{implementation!r}")
    return implementation


def gated_delta_rule(q, k, v, g, beta, *, initial_state=None, implementation=None,
                     chunk_size=64):
    """(o (B, H, L, Dv), final state (B, H, Dk, Dv)) of the gated delta rule.

    q, k (B, H, L, Dk): already L2-normalised (q also scaled by Dk^−1/2) and repeated to the
    value heads; v (B, H, L, Dv); g the log-decay (≤ 0), one per head (B, H, L) or per key
    channel (B, H, L, Dk) (Kimi Delta Attention); beta (B, H, L);
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


# ---- lightning attention's core ---------------------------------------------------------------

def _lightning_recurrent(q, k, v, slope, state, block_size):
    """One token at a time: S_t = e^{−s} S_{t−1} + k_t ⊗ v_t, o_t = S_tᵀ q_t (s = slope_h)."""
    decay = (-slope).exp()[:, None, None]  # (H, 1, 1)
    outs = []
    for t in range(q.shape[-2]):
        state = state * decay + k[..., t, :, None] * v[..., t, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[..., t, :]))
    return torch.stack(outs, dim=-2), state


def _lightning_chunked(q, k, v, slope, state, block_size):
    """MiniMax's block form over blocks of T tokens (the last may be shorter), i the position in
    the block: O = (Q Kᵀ ⊙ D) V + (Q ⊙ e^{−s(i+1)}) S with D_ij = e^{−s(i−j)} for i ≥ j (0
    above); S ← e^{−sT} S + (K ⊙ e^{−s(T−1−i)})ᵀ V."""
    rate = slope[:, None, None]  # (H, 1, 1)
    outs = []
    for start in range(0, q.shape[-2], block_size):
        qb, kb, vb = (t[..., start:start + block_size, :] for t in (q, k, v))  # (B, H, T, D)
        size = qb.shape[-2]
        i = torch.arange(size, dtype=q.dtype, device=q.device)[:, None]  # (T, 1)
        lag = i - i.T  # i − j (T, T)
        within = torch.where(lag >= 0, -rate * lag, -torch.inf).exp()  # D (H, T, T)
        outs.append(((qb @ kb.transpose(-1, -2)) * within) @ vb
                    + (qb * (-rate * (i + 1)).exp()) @ state)
        state = (state * (-rate * size).exp()
                 + (kb * (-rate * (size - 1 - i)).exp()).transpose(-1, -2) @ vb)
    return torch.cat(outs, dim=-2), state


LIGHTNING_IMPLEMENTATIONS = {"recurrent": _lightning_recurrent, "chunked": _lightning_chunked}


def lightning_rule(q, k, v, slope, *, initial_state=None, implementation=None,
                   block_size=256):
    """(o (B, H, L, Dv), final state (B, H, Dk, Dv)) of lightning attention's recurrence,
    S_t = e^{−slope_h} S_{t−1} + k_t ⊗ v_t, o_t = S_tᵀ q_t (o_t = Σ_{s≤t} e^{−slope_h (t−s)}
    (q_t·k_s) v_s plus the decayed initial state's S_0ᵀ q_t e^{−slope_h (t+1)}).

    q, k (B, H, L, Dk), v (B, H, L, Dv), slope (H,) the decay rate per head (≥ 0 for a
    decay), initial_state (B, H, Dk, Dv) or None (zeros). ``implementation``: "recurrent",
    "chunked" (MiniMax's block form over blocks of ``block_size``) or None ("recurrent" for
    L = 1, "chunked" otherwise), recorded as ``gated_delta_rule`` records it; dtypes as
    ``gated_delta_rule``'s."""
    recurrent.check_lightning_inputs(q, k, v, slope, initial_state, block_size)
    name = _choose(implementation, q.shape[-2], LIGHTNING_IMPLEMENTATIONS)
    compute = _compute_dtype(q)
    if initial_state is None:
        initial_state = q.new_zeros(q.shape[:2] + (q.shape[-1], v.shape[-1]), dtype=compute)
    arrays = (t.to(compute) for t in (q, k, v, slope, initial_state))
    implementations.ran("torch", name)
    o, state = LIGHTNING_IMPLEMENTATIONS[name](*arrays, block_size)
    return o.to(v.dtype), state


# ---- the modules -------------------------------------------------------------------------------

def _softplus(z):
    """ln(1 + e^z) without overflow and without torch's threshold (exact where it is linear)."""
    return z.clamp(min=0) + torch.log1p(torch.exp(-z.abs()))


def _heads(t, heads):
    """(B, L, H·D) -> (B, H, L, D)."""
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def _l2_normalize(t, eps):
    return t * torch.rsqrt((t * t).sum(dim=-1, keepdim=True) + eps)


class _RecurrentMixer(nn.Module):
    """What every recurrent mixer shares: the configuration from its description, the cache, the
    call's checks and its unbatched form. A subclass gives ``_mix(x, mask, cache,
    implementation, size)`` for batched x."""

    variant = ""
    registry = DELTA_RULE_IMPLEMENTATIONS

    def _configure(self, **config):
        described = recurrent.get(self.variant)
        self.config = described.config(config)
        return described.shapes(self.config)

    def init_cache(self, batch_size, max_length) -> RecurrentCache:
        """A cache of zeros for ``batch_size`` rows: conv (B, K − 1, C) in the parameters'
        dtype (K − 1 = 0 without a convolution), state (B, Hv, Dk, Dv) in float32 (float64 for
        a float64 module), lengths (B,) int32, on the parameters' device. ``max_length`` bounds
        the tokens the cache may take: kept by the module, as JAX's twin does (the
        RecurrentCache has no field for it), and checked by each call with a cache against the
        cache's lengths (read on the host)."""
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

    def _call(self, x, mask, cache, implementation, size):
        recurrent.get(self.variant).check_inputs(self.config, {"x": x, "mask": mask})
        if cache is not None:
            recurrent.check_cache(self.config, cache, tuple(x.shape[:-2]))
            recurrent.check_cache_dtypes(cache)
            self._check_fits(cache, x.shape[-2])
        _choose(implementation, 2, self.registry)  # an unknown name refused before any work
        single = x.dim() == 2
        if single:  # (L, d_in) -> (1, L, d_in), and the cache and mask alike
            x = x[None]
            mask = None if mask is None else mask[None]
            cache = None if cache is None else RecurrentCache(*(t[None] for t in cache))
        y, new = self._mix(x, mask, cache, implementation, size)
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

    def _project(self, x, name):
        """x W_name, or low-rank (x W_name_a) W_name_b where W_name is None."""
        full = getattr(self, name)
        if full is not None:
            return full(x)
        return getattr(self, f"{name}_b")(getattr(self, f"{name}_a")(x))


class _DeltaMixer(_RecurrentMixer):
    """The delta-rule mixers (Gated DeltaNet, Kimi Delta Attention): convolution, L2-normalised
    q and k, the delta rule, a gated RMSNorm per head. A subclass gives ``_gates(x, compute)``
    -> (g, beta) and ``output_gate`` (SiLU or σ)."""

    output_gate = staticmethod(F.silu)

    def forward(self, x, mask=None, *, cache=None, implementation=None, chunk_size=64):
        return self._call(x, mask, cache, implementation, chunk_size)

    def _make_layers(self, shapes, conv_kernel):
        """The linear layers (neutral (in, out) shapes; a low-rank pair W_name_a, W_name_b where
        the shapes have one, with W_name None, else the pair None) and the convolution's
        weights."""
        for name in ("W_query", "W_key", "W_value", "W_gate", "W_beta", "W_decay", "W_out"):
            pairs = [n for n in (f"{name}_a", f"{name}_b") if n in shapes]
            attribute = "out_proj" if name == "W_out" else name
            setattr(self, attribute, None if pairs else nn.Linear(*shapes[name], bias=False))
            if name in ("W_decay", "W_gate"):  # the layer paths the description names
                for n in (f"{name}_a", f"{name}_b"):
                    setattr(self, n, nn.Linear(*shapes[n], bias=False) if pairs else None)
        bound = conv_kernel ** -0.5  # nn.Conv1d's default, depthwise
        for name in ("conv_query", "conv_key", "conv_value"):
            setattr(self, name, nn.Parameter(torch.empty(shapes[name]).uniform_(-bound, bound)))

    def _mix(self, x, mask, cache, implementation, chunk_size):
        """(y (B, L, d_out), the new cache or None) for batched x (B, L, d_in)."""
        c = self.config
        hk, hv, dk, _ = recurrent.sizes(c)
        width = c["conv_kernel"]
        if mask is not None:
            x = x * mask[..., None].to(x.dtype)
        compute = _compute_dtype(x)
        u = torch.cat([self.W_query(x), self.W_key(x), self.W_value(x)], dim=-1)  # (B, L, C)
        held = (u.new_zeros(u.shape[0], width - 1, u.shape[-1]) if cache is None
                else cache.conv.to(u.dtype))
        padded = torch.cat([held, u], dim=1)
        q, k, v = self._convolve(padded, compute)
        q = _l2_normalize(q, c["l2norm_eps"]) * dk ** -0.5
        k = _l2_normalize(k, c["l2norm_eps"])
        q, k = (t.repeat_interleave(hv // hk, dim=1) for t in (q, k))  # value head h: h // group
        g, beta = self._gates(x, compute)
        o, state = gated_delta_rule(q, k, v, g, beta, implementation=implementation,
                                    initial_state=None if cache is None else cache.state,
                                    chunk_size=chunk_size)
        y = self.out_proj(self._gated_norm(o, x).to(x.dtype))
        if cache is None:
            return y, None
        conv = padded[:, padded.shape[1] - (width - 1):]  # the last K − 1 inputs
        return y, RecurrentCache(conv.to(cache.conv.dtype), state.to(cache.state.dtype),
                                 cache.lengths + x.shape[1])

    def _convolve(self, padded, compute):
        """SiLU of the causal depthwise convolution over ``padded`` (B, K − 1 + L, C), as q, k
        (B, Hk, L, Dk) and v (B, Hv, L, Dv) in ``compute``."""
        hk, hv, dk, dv = recurrent.sizes(self.config)
        width = self.config["conv_kernel"]
        w = torch.cat([self.conv_query, self.conv_key, self.conv_value]).to(compute)  # (C, K)
        length = padded.shape[1] - (width - 1)
        padded = padded.to(compute)
        pre = sum(padded[:, i:i + length] * w[:, i] for i in range(width))  # (B, L, C)
        q, k, v = F.silu(pre).split([hk * dk, hk * dk, hv * dv], dim=-1)
        return _heads(q, hk), _heads(k, hk), _heads(v, hv)

    def _gated_norm(self, o, x):
        """RMSNorm(o) · norm_weight ⊙ gate(x W_gate), heads merged: (B, L, Hv·Dv), in o's
        dtype (the compute dtype)."""
        hv = recurrent.sizes(self.config)[1]
        z = _heads(self._project(x, "W_gate"), hv).to(o.dtype)
        unit = o * torch.rsqrt(o.pow(2).mean(dim=-1, keepdim=True) + self.config["norm_eps"])
        gated = unit * self.norm_weight.to(o.dtype) * self.output_gate(z)  # (B, Hv, L, Dv)
        return gated.transpose(1, 2).flatten(2)


class GatedDeltaNet(_DeltaMixer):
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
        shapes = self._configure(
            d_in=d_in, num_k_heads=num_k_heads, num_v_heads=num_v_heads,
            head_k_dim=head_k_dim, head_v_dim=head_v_dim, d_out=d_out,
            conv_kernel=conv_kernel, norm_eps=norm_eps, l2norm_eps=l2norm_eps,
            allow_neg_eigval=allow_neg_eigval)
        self._make_layers(shapes, conv_kernel)
        self.A_log = nn.Parameter(torch.empty(num_v_heads).uniform_(1, 16).log())  # as HF
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.norm_weight = nn.Parameter(torch.ones(head_v_dim))

    def _gates(self, x, compute):
        """g = −e^{A_log} softplus(x W_decay + dt_bias), β = σ(x W_beta) (2σ with
        allow_neg_eigval), each (B, Hv, L)."""
        beta = torch.sigmoid(self.W_beta(x).to(compute)).transpose(1, 2)  # (B, Hv, L)
        if self.config["allow_neg_eigval"]:
            beta = 2 * beta
        g = -self.A_log.to(compute).exp()[:, None] * _softplus(
            self.W_decay(x).to(compute).transpose(1, 2) + self.dt_bias.to(compute)[:, None])
        return g, beta


class KimiDeltaAttention(_DeltaMixer):
    """Kimi Delta Attention (Kimi Linear, GLM-5.3-Flash, Ling 3.0): the delta rule with a decay
    per key channel, golden.specification.recurrent's ``kimi_delta_attention``; H heads of D.

    Parameters: linear layers W_query, W_key, W_value (d_in → H·D), W_beta (d_in → H),
    W_decay (d_in → H·D; or W_decay_a (d_in → decay_rank) then W_decay_b, W_decay None),
    W_gate (likewise, rank gate_rank), out_proj (H·D → d_out), no biases; plain arrays
    conv_query, conv_key, conv_value (H·D, K), A_log (H,), dt_bias (H·D,), norm_weight (D,).
    The decay, with f = x W_decay + dt_bias per channel: g = −e^{A_log} softplus(f)
    (forget_gate "softplus") or λ σ(e^{A_log} f), λ = decay_lower_bound ("bounded_sigmoid");
    β = σ(x W_beta); the output RMSNorm(o) · norm_weight ⊙ σ(x W_gate). The call, the cache and
    the dtypes as GatedDeltaNet's."""

    variant = "kimi_delta_attention"
    output_gate = staticmethod(torch.sigmoid)

    def __init__(self, d_in, num_heads, head_dim, d_out=None, conv_kernel=4, norm_eps=1e-6,
                 l2norm_eps=1e-6, decay_rank=None, gate_rank=None, forget_gate="softplus",
                 decay_lower_bound=None):
        super().__init__()
        shapes = self._configure(
            d_in=d_in, num_heads=num_heads, head_dim=head_dim, d_out=d_out,
            conv_kernel=conv_kernel, norm_eps=norm_eps, l2norm_eps=l2norm_eps,
            decay_rank=decay_rank, gate_rank=gate_rank, forget_gate=forget_gate,
            decay_lower_bound=decay_lower_bound)
        self._make_layers(shapes, conv_kernel)
        self.A_log = nn.Parameter(torch.empty(num_heads).uniform_(1, 16).log())  # as HF
        self.dt_bias = nn.Parameter(torch.ones(num_heads * head_dim))
        self.norm_weight = nn.Parameter(torch.ones(head_dim))

    def _gates(self, x, compute):
        """g (B, H, L, D) per key channel, β (B, H, L)."""
        c = self.config
        beta = torch.sigmoid(self.W_beta(x).to(compute)).transpose(1, 2)  # (B, H, L)
        f = _heads(self._project(x, "W_decay").to(compute) + self.dt_bias.to(compute),
                   c["num_heads"])  # (B, H, L, D)
        rate = self.A_log.to(compute).exp()[:, None, None]
        if c["forget_gate"] == "softplus":
            return -rate * _softplus(f), beta
        return c["decay_lower_bound"] * torch.sigmoid(rate * f), beta


class LightningAttention(_RecurrentMixer):
    """Lightning attention (MiniMax-Text-01 / M1's linear layers): linear attention with a fixed
    decay per head, golden.specification.recurrent's ``lightning_attention``; H heads of D.

    Parameters: linear layers W_query, W_key, W_value, W_gate (d_in → H·D), out_proj (H·D →
    d_out), no biases; plain arrays norm_weight (H·D,), slope (H,). q, k, v = SiLU(x W_*)
    (no normalisation, no scale), ``lightning_rule``, y = (σ(x W_gate) ⊙ RMSNorm_{H·D}(o) ·
    norm_weight) W_out. Call ``module(x, mask=None, *, cache=None, implementation=None,
    block_size=None)``, as GatedDeltaNet's with ``block_size`` (None: the configuration's) for
    ``lightning_rule``; the cache's conv has width 0 (no convolution), its state (B, H, D,
    D). Dtypes as GatedDeltaNet's."""

    variant = "lightning_attention"
    registry = LIGHTNING_IMPLEMENTATIONS

    def __init__(self, d_in, num_heads, head_dim, d_out=None, norm_eps=1e-6, block_size=256):
        super().__init__()
        shapes = self._configure(d_in=d_in, num_heads=num_heads, head_dim=head_dim,
                                 d_out=d_out, norm_eps=norm_eps, block_size=block_size)
        for name in ("W_query", "W_key", "W_value", "W_gate"):
            setattr(self, name, nn.Linear(*shapes[name], bias=False))
        self.out_proj = nn.Linear(*shapes["W_out"], bias=False)
        self.norm_weight = nn.Parameter(torch.ones(num_heads * head_dim))
        self.slope = nn.Parameter(  # MiniMax's slopes for a single layer: 2^{−8(h+1)/H}
            2.0 ** (-8.0 * torch.arange(1, num_heads + 1) / num_heads))

    def forward(self, x, mask=None, *, cache=None, implementation=None, block_size=None):
        return self._call(x, mask, cache, implementation,
                          self.config["block_size"] if block_size is None else block_size)

    def _mix(self, x, mask, cache, implementation, block_size):
        """(y (B, L, d_out), the new cache or None) for batched x (B, L, d_in)."""
        h = self.config["num_heads"]
        if mask is not None:
            x = x * mask[..., None].to(x.dtype)
        compute = _compute_dtype(x)
        q, k, v = (_heads(F.silu(layer(x).to(compute)), h)
                   for layer in (self.W_query, self.W_key, self.W_value))  # (B, H, L, D)
        o, state = lightning_rule(q, k, v, self.slope, implementation=implementation,
                                  initial_state=None if cache is None else cache.state,
                                  block_size=block_size)
        merged = o.transpose(1, 2).flatten(2)  # (B, L, H·D)
        unit = merged * torch.rsqrt(merged.pow(2).mean(dim=-1, keepdim=True)
                                    + self.config["norm_eps"])
        gate = torch.sigmoid(self.W_gate(x).to(compute))
        y = self.out_proj((gate * unit * self.norm_weight.to(compute)).to(x.dtype))
        if cache is None:
            return y, None
        return y, RecurrentCache(cache.conv, state.to(cache.state.dtype),
                                 cache.lengths + x.shape[1])

"""The recurrent mixers' functional cores in JAX (issue 43): the gated delta rule with a decay per
head or per key channel (``gated_delta_rule``: Gated DeltaNet, Kimi Delta Attention) and lightning
attention's decayed sum (``lightning_rule``: MiniMax), each with its named implementations. The
modules over them are in jax_attn.recurrent, which re-exports these names.

Shape legend: B batch, L tokens, H heads, Dk and Dv the key and value widths, T the chunk (block)
size, N = ⌈L/T⌉ chunks. Per head the state S is (Dk, Dv):
    delta rule   S′_t = diag(e^{g_t}) S_{t−1};  S_t = S′_t + k_t ⊗ β_t (v_t − S′_tᵀ k_t);
                 o_t = S_tᵀ q_t, with g_t one number per head or (Dk,) per key channel
    lightning    S_t = e^{−s} S_{t−1} + k_t ⊗ v_t;  o_t = S_tᵀ q_t, s the head's slope

Implementations (``DELTA_RULE_IMPLEMENTATIONS``, ``LIGHTNING_IMPLEMENTATIONS``;
``implementation=None``: "recurrent" for L = 1, "chunked" otherwise):
    recurrent  one token at a time (``lax.scan`` over L); its autodiff keeps every S_t, so its
               gradient's memory is O(L·Dk·Dv)
    chunked    delta rule: the WY/UT form (Hugging Face's ``torch_chunk_gated_delta_rule`` and
               ``chunk_kimi_delta_attention``, FLA's): within a chunk the T updates solved as
               one unit lower-triangular system; with a decay per key channel the within-chunk
               decays e^{Γ_i − Γ_j} per channel, a (T, T, Dk) array as HF's (never e^{−Γ}
               alone, which overflows for strong decays), each exponent summed over its own
               segment rather than as a difference of cumulative sums (accurate dg in float32).
               lightning: MiniMax's block form, intra-block (Q Kᵀ ⊙ D) V with D_ij = e^{−s(i−j)}
               (i ≥ j), inter-block (Q ⊙ e^{−s(i+1)}) S, S ← e^{−sT} S + (K ⊙ e^{−s(T−1−i)})ᵀ V.
               Both: ``lax.scan`` over chunks carrying S (the delta rule: every chunk's
               state-free part side by side on an accelerator, one chunk at a time on a CPU,
               ``chunks_at_once``); L not a multiple of T padded with
               tokens that leave S unchanged (g = 0, β = 0, k = q = v = 0; lightning: no decay
               step on a padded token); a ``jax.custom_vjp`` keeps only the inputs and the N
               chunk-boundary states and recomputes each chunk in reverse order: O(L) memory.
Both compute in the inputs' dtype when it is float32 or float64, in float32 otherwise (state
and gates in float32, as FLA); every product at ``Precision.HIGHEST``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from golden.specification.implementations import ran

HIGHEST = jax.lax.Precision.HIGHEST
FRAMEWORK = "jax"


def _dot(spec, *operands):
    return jnp.einsum(spec, *operands, precision=HIGHEST)


def _per_key(a):
    """A decay per token (T,) or per token and key channel (T, Dk), broadcastable to (T, Dk)."""
    return a if a.ndim == 2 else a[:, None]


def _on_state(a):
    """One token's decay, () or (Dk,), broadcastable to a state (Dk, Dv)."""
    return a[..., None]


# ---- one head: the delta rule -------------------------------------------------------------------

def _recurrent_head(q, k, v, g, beta, state):
    """(o (L, Dv), S_L (Dk, Dv)) token by token, for q, k (L, Dk), v (L, Dv), g (L,) or (L, Dk),
    beta (L,), S_0 ``state`` (Dk, Dv)."""
    def step(s, token):
        qt, kt, vt, gt, bt = token
        s = s * _on_state(jnp.exp(gt))  # S′_t
        delta = bt * (vt - _dot("kv,k->v", s, kt))  # β_t (v_t − S′_tᵀ k_t)   (Dv,)
        s = s + kt[:, None] * delta[None, :]
        return s, _dot("kv,k->v", s, qt)
    final, o = lax.scan(step, state, (q, k, v, g, beta))
    return o, final


def _segment_sums(g):
    """Σ_{j<m≤i} g′_m at [i, j] (0 for i ≤ j), (T + 1, T + 1) or (T + 1, T + 1, Dk), of g′ = [0,
    g_1 … g_T]: each exponent summed over its own segment (Mamba-2's stable segsum), never as a
    difference Γ_i − Γ_j of two large cumulative sums, whose rounding (|Γ| u, Γ reaching −320 in
    a chunk of strong decays) would swamp the short segments that carry the gradient of g."""
    t = g.shape[0] + 1
    padded = jnp.concatenate([jnp.zeros_like(g[:1]), g])  # g′ (T + 1, …)
    strict = jnp.tril(jnp.ones((t, t), bool), -1)  # [m, j]: m > j
    strict = strict.reshape(strict.shape + (1,) * (g.ndim - 1))
    # The running sum down each column as a product with the lower-triangular ones (the same
    # summands, each multiplied by 1 or 0 exactly): XLA's CPU cumsum of (T + 1, T + 1) blocks
    # took twice as long as this product.
    ones = jnp.tril(jnp.ones((t, t), g.dtype))
    return _dot("im,mj...->ij...", ones, jnp.where(strict, padded[:, None], 0))


def _decayed_scores(a, b, inner):
    """(a bᵀ) ⊙ D for a (R·T, Dk) (R blocks of T rows, each scored alike), b (T, Dk) and D_ij =
    e^{Γ_i − Γ_j} for j ≤ i (0 above), ``inner`` the segment sums Γ_i − Γ_j (T, T) per head,
    or Σ_c a_ic b_jc e^{Γ_ic − Γ_jc} for ``inner`` (T, T, Dk) per key channel (HF's (T, T, Dk)
    decay mask: every exponent ≤ 0 where kept). (R·T, T)."""
    t = b.shape[0]
    blocks = a.reshape(-1, t, a.shape[-1])  # (R, T, Dk): one product for the R blocks
    lower = jnp.tril(jnp.ones((t, t), bool))
    if inner.ndim == 2:
        out = _dot("rik,jk->rij", blocks, b) * jnp.where(lower, jnp.exp(inner), 0)
    else:
        out = _dot("rik,jk,ijk->rij", blocks, b, jnp.where(lower[:, :, None], jnp.exp(inner), 0))
    return out.reshape(a.shape[0], t)


def _unit_lower_inverse(m):
    """The inverse of a unit lower-triangular (T, T) matrix, by blocks: from the 1 × 1 diagonal
    blocks up, each pair of diagonal blocks A, B (inverses known) with the block C below A joins
    into [[A, 0], [C, B]]⁻¹ = [[A⁻¹, 0], [−B⁻¹ C A⁻¹, B⁻¹]], all pairs of a level at once
    (log2 T levels of matrix products; T padded with the identity to a power of two). The same
    arithmetic as forward substitution grouped into products: XLA's CPU triangular solve, a
    loop of small steps, took most of the chunked form's time (0.18 s for 16 chunks of 64
    against 256 right-hand sides on this project's 2-core host)."""
    t = m.shape[-1]
    size = 1 << max(t - 1, 0).bit_length()
    if size != t:
        m = jnp.pad(m, [(0, size - t)] * 2) + jnp.diag(
            jnp.concatenate([jnp.zeros(t, m.dtype), jnp.ones(size - t, m.dtype)]))
    blocks = jnp.ones((size, 1, 1), m.dtype)  # the inverses of the diagonal blocks (n, s, s)
    s = 1
    while s < size:
        n = size // (2 * s)
        grid = m.reshape(n, 2, s, n, 2, s)[:, 1, :, :, 0, :]  # (n, s, n, s): block rows × columns
        below = jnp.moveaxis(jnp.diagonal(grid, axis1=0, axis2=2), -1, 0)  # each pair's C (n, s, s)
        upper, lower = blocks[0::2], blocks[1::2]  # A⁻¹, B⁻¹ (n, s, s)
        corner = -_dot("nab,nbc,ncd->nad", lower, below, upper)
        zero = jnp.zeros_like(corner)
        blocks = jnp.concatenate([jnp.concatenate([upper, zero], axis=2),
                                  jnp.concatenate([corner, lower], axis=2)], axis=1)
        s *= 2
    return blocks[0, :t, :t]


def _chunk_local(q, k, v, g, beta):
    """What one chunk of T tokens computes without the state, for q, k (T, Dk), v (T, Dv), g (T,)
    or (T, Dk), beta (T,): with Γ_i = Σ_{j≤i} g_j (per head or per key channel), D as
    ``_decayed_scores`` and every exponent a segment sum (``_segment_sums``), the WY/UT form's
        (I + strict_lower((β k) kᵀ ⊙ D)) [U | W] = [β v | β k ⊙ e^Γ],
    returned as (U (T, Dv), W (T, Dk), q ⊙ e^Γ (T, Dk), (q kᵀ) ⊙ D (T, T), k ⊙ e^{Γ_T − Γ}
    (T, Dk), e^{Γ_T} () or (Dk,)). From the state S entering the chunk (``_chunks_core``):
        V̂ = U − W S;   o = (q ⊙ e^Γ) S + ((q kᵀ) ⊙ D) V̂;
        S′ = diag(e^{Γ_T}) S + (k ⊙ e^{Γ_T − Γ})ᵀ V̂."""
    t = q.shape[0]
    seg = _segment_sums(g)
    cum, tail, inner = seg[1:, 0], seg[-1, 1:], seg[1:, 1:]  # Γ, Γ_T − Γ (T, …); (T, T, …)
    k_beta = k * beta[:, None]  # (T, Dk)
    system = jnp.eye(t, dtype=q.dtype) + jnp.tril(_decayed_scores(k_beta, k, inner), -1)
    rhs = jnp.concatenate([v * beta[:, None], k_beta * _per_key(jnp.exp(cum))], axis=-1)
    solved = _dot("ij,jc->ic", _unit_lower_inverse(system), rhs)
    u, w = solved[:, :v.shape[-1]], solved[:, v.shape[-1]:]  # (T, Dv), (T, Dk)
    return (u, w, q * _per_key(jnp.exp(cum)), _decayed_scores(q, k, inner),
            k * _per_key(jnp.exp(tail)), jnp.exp(cum[-1]))


# ---- chunks with boundary states only ----------------------------------------------------------

def _boundary_scan(chunk):
    """``run(state, chunks)``: (o (N, T, …), S_final) of ``chunk(state, *inputs) -> (o, S′)``
    scanned over ``chunks`` (a tuple of (N, …) arrays), with a custom VJP whose residuals are the
    inputs and the N states entering each chunk; the backward recomputes each chunk's forward in
    reverse chunk order."""
    @jax.custom_vjp
    def run(state, chunks):
        (o, final), _ = forward(state, chunks)
        return o, final

    def forward(state, chunks):
        def step(s, inputs):
            o, new = chunk(s, *inputs)
            return new, (o, s)  # s: the state entering the chunk
        final, (o, starts) = lax.scan(step, state, chunks)
        return (o, final), (starts, chunks)

    def backward(residuals, cotangents):
        starts, chunks = residuals
        d_o, d_final = cotangents

        def step(d_s, inputs):
            start, chunk_inputs, d_oc = inputs
            _, pullback = jax.vjp(chunk, start, *chunk_inputs)  # the chunk recomputed
            d_start, *d_inputs = pullback((d_oc, d_s))
            return d_start, tuple(d_inputs)
        d_state, d_chunks = lax.scan(step, d_final, (starts, chunks, d_o), reverse=True)
        return d_state, d_chunks

    run.defvjp(forward, backward)
    return run


def _in_chunks(arrays, chunk_size):
    """Each (L, …) array zero-padded to N·T tokens and reshaped (N, T, …)."""
    pad = -arrays[0].shape[0] % chunk_size
    padded = [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in arrays]
    return tuple(a.reshape((-1, chunk_size) + a.shape[1:]) for a in padded)


_all_chunks_local = jax.vmap(_chunk_local)  # (N, T, …) inputs: every chunk at once


def _propagate(state, u, w, k_decayed, decay):
    """The one serial step across chunks: S_{n+1} = diag(e^{Γ_T}) S_n + (k ⊙ e^{Γ_T − Γ})ᵀ
    (U − W S_n) over the N chunks of ``_chunk_local``'s outputs, from S_0 ``state``. Returns
    (the states entering each chunk (N, Dk, Dv), V̂ (N, T, Dv), S_N)."""
    def step(s, chunk):
        u_n, w_n, kd_n, decay_n = chunk
        fresh = u_n - _dot("ik,kv->iv", w_n, s)
        return s * _on_state(decay_n) + _dot("ik,iv->kv", kd_n, fresh), (s, fresh)
    final, (starts, fresh) = lax.scan(step, state, (u, w, k_decayed, decay))
    return starts, fresh, final


@jax.custom_vjp
def _chunks_core(state, chunks):
    """(o (N, T, Dv), S_N) of the delta rule over ``chunks`` (q, k, v, g, beta, each (N, T, …))
    from ``state`` S_0: every chunk's state-free part (``_chunk_local``) computed for all chunks
    at once, then only the state carried across chunks one after another (``_propagate``), then
    every chunk's output at once. The custom VJP keeps the inputs and the N states entering the
    chunks (O(L) memory, no per-token state); its backward recomputes the state-free part for
    all chunks at once, carries the state's cotangent back across the chunks one after another,
    and pulls the rest back through the state-free part for all chunks at once."""
    return _chunks_forward(state, chunks)[0]


def _chunks_forward(state, chunks):
    u, w, q_decayed, scores, k_decayed, decay = _all_chunks_local(*chunks)
    starts, fresh, final = _propagate(state, u, w, k_decayed, decay)
    o = _dot("nik,nkv->niv", q_decayed, starts) + _dot("nij,njv->niv", scores, fresh)
    return (o, final), (starts, chunks)


def _chunks_backward(residuals, cotangents):
    starts, chunks = residuals
    d_o, d_final = cotangents
    local, pullback = jax.vjp(_all_chunks_local, *chunks)
    u, w, q_decayed, scores, k_decayed, decay = local
    fresh = u - _dot("nik,nkv->niv", w, starts)  # V̂, again for all chunks at once
    # o = (q ⊙ e^Γ) S_n + ((q kᵀ) ⊙ D) V̂: the terms that need no later state.
    d_q_decayed = _dot("niv,nkv->nik", d_o, starts)
    d_scores = _dot("niv,njv->nij", d_o, fresh)
    d_fresh_o = _dot("nij,niv->njv", scores, d_o)
    d_start_o = _dot("nik,niv->nkv", q_decayed, d_o)

    def step(d_after, chunk):  # d_after: the cotangent of S_{n+1}, the state chunk n leaves
        w_n, kd_n, decay_n, d_fresh_n, d_start_n = chunk
        d_fresh_n = d_fresh_n + _dot("ik,kv->iv", kd_n, d_after)
        d_start = (d_start_n + d_after * _on_state(decay_n)
                   - _dot("ik,iv->kv", w_n, d_fresh_n))
        return d_start, (d_after, d_fresh_n)
    d_state, (d_after, d_fresh) = lax.scan(
        step, d_final, (w, k_decayed, decay, d_fresh_o, d_start_o), reverse=True)
    d_w = -_dot("niv,nkv->nik", d_fresh, starts)
    d_k_decayed = _dot("niv,nkv->nik", fresh, d_after)
    d_decay = (d_after * starts).sum(-1)  # (N, Dk): per key channel
    if decay.ndim == 1:
        d_decay = d_decay.sum(-1)  # (N,): one per head
    return d_state, pullback((d_fresh, d_w, d_q_decayed, d_scores, d_k_decayed, d_decay))


_chunks_core.defvjp(_chunks_forward, _chunks_backward)


@jax.custom_vjp
def _grouped_core(state, groups):
    """``_chunks_core`` over M groups of G chunks (``groups``: q, k, v, g, beta, each (M, G, T,
    …)) one group after another: the chunk-parallel work of a group is G chunks wide, not N.
    The same arithmetic chunk by chunk; the residuals are again the inputs and the states
    entering each chunk."""
    return _grouped_forward(state, groups)[0]


def _grouped_forward(state, groups):
    def step(s, group):
        (o, new), (starts, _) = _chunks_forward(s, group)
        return new, (o, starts)
    final, (o, starts) = lax.scan(step, state, groups)
    return (o, final), (starts, groups)


def _grouped_backward(residuals, cotangents):
    starts, groups = residuals
    d_o, d_final = cotangents

    def step(d_after, inputs):
        starts_m, group, d_o_m = inputs
        d_state, d_group = _chunks_backward((starts_m, group), (d_o_m, d_after))
        return d_state, d_group
    d_state, d_groups = lax.scan(step, d_final, (starts, groups, d_o), reverse=True)
    return d_state, d_groups


_grouped_core.defvjp(_grouped_forward, _grouped_backward)


def _chunked_head(q, k, v, g, beta, state, chunk_size, group=None):
    """As ``_recurrent_head``, by chunks of ``chunk_size`` tokens (the last padded), ``group``
    chunks at a time (None: all at once)."""
    chunks = _in_chunks((q, k, v, g, beta), chunk_size)
    n = chunks[0].shape[0]
    if group is None or group >= n:
        o, final = _chunks_core(state, chunks)
    else:  # whole padded chunks leave S unchanged, as padded tokens do
        groups = _in_chunks(chunks, group)
        o, final = _grouped_core(state, groups)
        o = o.reshape((-1,) + o.shape[2:])[:n]
    return o.reshape((-1, v.shape[-1]))[:q.shape[0]], final  # (L, Dv)


DELTA_RULE_IMPLEMENTATIONS = {
    "recurrent": lambda q, k, v, g, beta, state, chunk_size, group=None: _recurrent_head(
        q, k, v, g, beta, state),
    "chunked": _chunked_head,
}


# ---- one head: lightning attention --------------------------------------------------------------

def _lightning_recurrent_head(q, k, v, slope, state):
    """(o (L, Dv), S_L) token by token: S_t = e^{−s} S_{t−1} + k_t ⊗ v_t, o_t = S_tᵀ q_t."""
    decay = jnp.exp(-slope)

    def step(s, token):
        qt, kt, vt = token
        s = s * decay + kt[:, None] * vt[None, :]
        return s, _dot("kv,k->v", s, qt)
    final, o = lax.scan(step, state, (q, k, v))
    return o, final


def _block(state, q, k, v, slope, real):
    """(o (T, Dv), S after the block) of one block of T tokens from ``state`` S (Dk, Dv), with
    n_i = Σ_{j≤i} real_j the decay steps taken by token i (i + 1 in a whole block; a padded
    token, ``real`` 0, takes none):
        o = (Q ⊙ e^{−s n}) S + (Q Kᵀ ⊙ D) V,  D_ij = e^{−s(n_i − n_j)} (j ≤ i, else 0)
        S′ = e^{−s n_T} S + (K ⊙ e^{−s(n_T − n)})ᵀ V."""
    t = q.shape[0]
    steps = jnp.cumsum(real)  # n (T,): whole numbers, exact
    lower = jnp.tril(jnp.ones((t, t), bool))
    gap = jnp.where(lower, steps[:, None] - steps[None, :], 0)
    decay = jnp.where(lower, jnp.exp(-slope * gap), 0)
    o = (_dot("ik,kv->iv", q * jnp.exp(-slope * steps)[:, None], state)
         + _dot("ij,jv->iv", _dot("ik,jk->ij", q, k) * decay, v))
    new = (state * jnp.exp(-slope * steps[-1])
           + _dot("ik,iv->kv", k * jnp.exp(-slope * (steps[-1] - steps))[:, None], v))
    return o, new


_block_scan = _boundary_scan(_block)


def _lightning_chunked_head(q, k, v, slope, state, block_size):
    """As ``_lightning_recurrent_head``, by blocks of ``block_size`` tokens (the last padded)."""
    real = jnp.ones(q.shape[:1], q.dtype)
    q_, k_, v_, real_ = _in_chunks((q, k, v, real), block_size)
    slopes = jnp.broadcast_to(slope, real_.shape[:1])  # (N,): one per block, summed by autodiff
    o, final = _block_scan(state, (q_, k_, v_, slopes, lax.stop_gradient(real_)))
    return o.reshape((-1, v.shape[-1]))[:q.shape[0]], final  # (L, Dv)


LIGHTNING_IMPLEMENTATIONS = {
    "recurrent": lambda q, k, v, slope, state, block_size: _lightning_recurrent_head(
        q, k, v, slope, state),
    "chunked": _lightning_chunked_head,
}


# ---- the functional cores -----------------------------------------------------------------------

def compute_dtype(dtype):
    """The dtype the recurrences run in: float32 and float64 as they are, float32 for the rest."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _check_choice(implementation, size, registry=None, size_name="chunk_size"):
    """ValueError unless ``implementation`` is None or a name of ``registry`` (default
    DELTA_RULE_IMPLEMENTATIONS) and ``size`` a positive int."""
    registry = DELTA_RULE_IMPLEMENTATIONS if registry is None else registry
    if implementation is not None and implementation not in registry:
        raise ValueError(f"implementation should be None or one of "
                         f"{', '.join(map(repr, registry))}, got {implementation!r}")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{size_name} should be a positive int, got {size!r}")


def _check_shapes(want):
    """ValueError naming the first array of ``want`` {name: (array, letters, shape or shapes)}
    whose shape is not (one of) the expected."""
    for name, (a, letters, shapes) in want.items():
        shapes = shapes if isinstance(shapes, list) else [shapes]
        if tuple(a.shape) not in shapes:
            expected = " or ".join(map(str, shapes))
            raise ValueError(f"{name} shape should be {letters} = {expected}, got "
                             f"{tuple(a.shape)}")


def _check_core(q, k, v, g, beta, initial_state, implementation, chunk_size):
    _check_choice(implementation, chunk_size)
    if q.ndim != 4:
        raise ValueError(f"q shape should be (B, H, L, Dk), got {tuple(q.shape)}")
    b, h, length, dk = q.shape
    dv = v.shape[-1]
    want = {"k": (k, "(B, H, L, Dk)", (b, h, length, dk)),
            "v": (v, "(B, H, L, Dv)", (b, h, length, dv)),
            "g": (g, "(B, H, L) or (B, H, L, Dk)", [(b, h, length), (b, h, length, dk)]),
            "beta": (beta, "(B, H, L)", (b, h, length))}
    if initial_state is not None:
        want["initial_state"] = (initial_state, "(B, H, Dk, Dv)", (b, h, dk, dv))
    _check_shapes(want)


def _default(implementation, length):
    return ("recurrent" if length == 1 else "chunked") if implementation is None \
        else implementation


def gated_delta_rule(q, k, v, g, beta, *, initial_state=None, implementation=None,
                     chunk_size=64):
    """The gated delta rule over L tokens: (o (B, H, L, Dv), final_state (B, H, Dk, Dv)).

    q, k (B, H, L, Dk): already L2-normalised, q already scaled by Dk^−1/2, both repeated to the
    value heads; v (B, H, L, Dv); g the log-decay (≤ 0), (B, H, L) one per head (Gated
    DeltaNet) or (B, H, L, Dk) one per key channel (Kimi Delta Attention); beta (B, H, L).
    ``initial_state`` S_0 (B, H, Dk, Dv) (None: zeros). ``implementation``: a name of
    ``DELTA_RULE_IMPLEMENTATIONS`` or None ("recurrent" for L = 1, else "chunked"); the one
    that runs is recorded (golden.specification.implementations.record). The result and the
    state are in the compute dtype (``compute_dtype`` of q's)."""
    _check_core(q, k, v, g, beta, initial_state, implementation, chunk_size)
    implementation = _default(implementation, q.shape[-2])
    ran(FRAMEWORK, implementation)
    dtype = compute_dtype(q.dtype)
    if initial_state is None:
        initial_state = jnp.zeros(q.shape[:2] + (q.shape[-1], v.shape[-1]), dtype)
    return _core(*(a.astype(dtype) for a in (q, k, v, g, beta, initial_state)),
                 implementation=implementation, chunk_size=chunk_size)


def chunks_at_once():
    """How many chunks the chunked form computes side by side (``_chunked_head``'s ``group``):
    all of them (None) on an accelerator; one at a time on a CPU, every head of the batch side
    by side. On a CPU XLA's batched products of many small matrices slow down several times once
    their operands outgrow the cache: B 1, H 16, D 128, L 4096, all 64 chunks at once took 328 ms
    for the forward, one at a time 125 ms (2, 4, 8, 16 at a time: 160–201 ms); forward+backward
    770 against 526 ms (2 at a time 471 ms); one head 14.1 against 6.6 ms; B 4, 1220 against
    587 ms (bench/results/linear/ has the section's rows). On an H200 the other way round: one
    at a time 2.1–3.4 times slower (bench/results/h200-2026-11-28-issue44b/grouping.json)."""
    return 1 if jax.default_backend() == "cpu" else None


def _core(q, k, v, g, beta, state, *, implementation, chunk_size):
    return _core_jit(q, k, v, g, beta, state, implementation=implementation,
                     chunk_size=chunk_size, group=chunks_at_once())


@jax.jit(static_argnames=("implementation", "chunk_size", "group"))
def _core_jit(q, k, v, g, beta, state, *, implementation, chunk_size, group):
    head = DELTA_RULE_IMPLEMENTATIONS[implementation]
    fixed = (None, None)  # chunk_size, group
    per_batch = jax.vmap(jax.vmap(head, in_axes=(0,) * 6 + fixed), in_axes=(0,) * 6 + fixed)
    return per_batch(q, k, v, g, beta, state, chunk_size, group)


def lightning_rule(q, k, v, slope, *, initial_state=None, implementation=None, block_size=256):
    """Lightning attention's decayed sum over L tokens: (o (B, H, L, Dv), final_state (B, H, Dk,
    Dv)), S_t = e^{−slope_h} S_{t−1} + k_t ⊗ v_t, o_t = S_tᵀ q_t.

    q, k (B, H, L, Dk) and v (B, H, L, Dv) as they enter (no normalisation, no scale); slope
    (H,) the per-head decay rate (> 0 decays). ``initial_state`` S_0 (B, H, Dk, Dv) (None:
    zeros). ``implementation``: a name of ``LIGHTNING_IMPLEMENTATIONS`` or None ("recurrent"
    for L = 1, else "chunked", blocks of ``block_size`` tokens); the one that runs is recorded.
    The result and the state are in the compute dtype (``compute_dtype`` of q's)."""
    _check_choice(implementation, block_size, LIGHTNING_IMPLEMENTATIONS, "block_size")
    if q.ndim != 4:
        raise ValueError(f"q shape should be (B, H, L, Dk), got {tuple(q.shape)}")
    b, h, length, dk = q.shape
    dv = v.shape[-1]
    want = {"k": (k, "(B, H, L, Dk)", (b, h, length, dk)),
            "v": (v, "(B, H, L, Dv)", (b, h, length, dv)), "slope": (slope, "(H,)", (h,))}
    if initial_state is not None:
        want["initial_state"] = (initial_state, "(B, H, Dk, Dv)", (b, h, dk, dv))
    _check_shapes(want)
    implementation = _default(implementation, length)
    ran(FRAMEWORK, implementation)
    dtype = compute_dtype(q.dtype)
    if initial_state is None:
        initial_state = jnp.zeros((b, h, dk, dv), dtype)
    return _lightning_core(*(a.astype(dtype) for a in (q, k, v, slope, initial_state)),
                           implementation=implementation, block_size=block_size)


@jax.jit(static_argnames=("implementation", "block_size"))
def _lightning_core(q, k, v, slope, state, *, implementation, block_size):
    head = LIGHTNING_IMPLEMENTATIONS[implementation]
    per_head = jax.vmap(head, in_axes=(0, 0, 0, 0, 0, None))
    per_batch = jax.vmap(per_head, in_axes=(0, 0, 0, None, 0, None))
    return per_batch(q, k, v, slope, state, block_size)

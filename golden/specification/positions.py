"""Token positions, shared by both frameworks: the KV cache's layout, and the rotary
embeddings' angle tables and arithmetic (written once for both: the twins' ``rotary`` modules
only convert the tables and choose the compute dtype), and Hugging Face's rope_parameters
(the frequencies and attention factor of each rope_type in float64, and ``hf_inv_freq``, HF's
own float32 operations for ``precision="hf"``). NumPy only (the bottom layer); the reference
computes its angles on its own (golden.reference.rope_frequencies, exact arithmetic), and uses
``hf_inv_freq`` only for "hf", which is HF's arithmetic by definition.

Shape legend: B batch, Hkv key-value heads, M the cache's max_length, Dh head width, L the
tokens of one call.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np


class KVCache(NamedTuple):
    """A functional KV cache, the same fields and layout in torch and JAX (a pytree in JAX).

    key, value: (B, Hkv, M, Dh), row b's first ``lengths[b]`` positions hold its tokens' keys and
    values (already rotated when the module uses RoPE); lengths: (B,) int32, tokens held per row;
    index_key: (B, M, index_head_dim), a block indexer's keys (GroupedQueryAttention's
    index_blocks: "max" its keys normed and turned, "mean" its raw keys x W_index_k, pooled at
    each query), None without one. A call never changes the cache it is given: it returns a
    new one.
    """

    key: Any
    value: Any
    lengths: Any
    index_key: Any = None


class MergedCache(NamedTuple):
    """GroupedQueryAttention's cache with ``merged_context=True`` (T5Gemma 2's decoder): a
    KVCache's key, value (B, Hkv, M, Dh) and lengths (B,) for the decoder's own tokens, and the
    context's keys and values (B, Hkv, Lc, Dh) (its k_norm applied, no RoPE) with its
    context_mask (B, Lc) bool, computed by the first call given ``context`` (prefill, as Hugging
    Face's cross-attention cache) and read by the calls without; None before that call. The same
    fields in torch and JAX (a pytree in JAX)."""

    key: Any
    value: Any
    lengths: Any
    context_key: Any = None
    context_value: Any = None
    context_mask: Any = None


class LatentCache(NamedTuple):
    """MultiHeadLatentAttention's cache (DeepSeek-V2/V3's MLA), the same fields in torch and
    JAX (a pytree in JAX): per token, not per head, what the keys and values are made from.

    latent: (B, M, kv_lora_rank), the normalised latent c_kv (after kv_a_layernorm, before
    kv_b_proj); rope_key: (B, M, qk_rope_head_dim), the one rotary key head shared by every
    query head, already rotated; lengths: (B,) int32, tokens held per row; index_key: (B, M,
    index_head_dim), the learned indexer's keys k^I after RoPE (Hugging Face's
    DynamicIndexedLayer), None without an indexer (index_topk). A call never changes the cache
    it is given: it returns a new one.
    """

    latent: Any
    rope_key: Any
    lengths: Any
    index_key: Any = None


class ContextCache(NamedTuple):
    """A cross-attention module's keys and values of one context, computed once and reused by
    every later call (the same fields in torch and JAX; a pytree in JAX).

    key, value: (B, Nkv, Lc, Dh), already projected; lengths: (B,) int32, the real tokens of each
    row (right padding; Lc without context_lengths); fingerprint: (B, 4) of the context
    (``context_fingerprint``), so that a call given another context with this cache raises
    instead of mixing them. Unbatched: the same without B.
    """

    key: Any
    value: Any
    lengths: Any
    fingerprint: Any


def context_fingerprint(context, stack):
    """(..., 4): Σ c, Σ c², and the sums of products of neighbours along Lc and along d_context
    of a context (..., Lc, d_context) in its own dtype (at least float32: the caller's): equal
    contexts give equal fingerprints, and a different context (other values, another order)
    almost surely not. ``stack``: the framework's stack(list, axis)."""
    c, axes = context, (-2, -1)
    return stack([c.sum(axis=axes), (c * c).sum(axis=axes),
                  (c[..., 1:, :] * c[..., :-1, :]).sum(axis=axes),
                  (c[..., :, 1:] * c[..., :, :-1]).sum(axis=axes)], -1)


# RoPE angles p·f_i, f_i = θ^(−2i/Dh), for integer positions p = ROPE_BLOCK·a + b (0 ≤ b <
# ROPE_BLOCK): cos and sin of a·ROPE_BLOCK·f_i and of b·f_i are tabulated in float64 and rounded
# once to the compute dtype; the angle-addition formulas combine them. The error is a few units
# of roundoff at every position, where the usual float32 recipe (the angle p·f_i formed in
# float32) errs by about p·2⁻²⁴ radians. Two small tables instead of one row per position: a
# cache of 128k positions needs 512 + 256 rows, not 131,072.
ROPE_BLOCK = 256


def rope_frequencies(settings, rd, seq_len=None) -> tuple:
    """(f (rd/2,) float64, attention factor m) of ``settings``
    (golden.specification.validate.rope_settings)
    for rd rotated features, as Hugging Face's rope_type defines them, written in float64 (HF
    forms them in float32). ``seq_len``: the call's largest position + 1, read by longrope
    (long_factor past original_max_position_embeddings) and dynamic (θ' past it)."""
    s = dict(settings)
    kind, theta, s_ = s["rope_type"], s["rope_theta"], s.get("factor")
    exponent = np.arange(0, rd, 2, dtype=np.float64) / rd
    l0 = s.get("original_max_position_embeddings")
    if kind == "dynamic" and seq_len is not None and seq_len > l0:
        ratio = s_ * seq_len / s["original_max_position_embeddings"] - (s_ - 1)
        theta = theta * ratio ** (rd / (rd - 2))
    f = theta ** -exponent
    m = 1.0
    if kind == "linear":
        f = f / s_
    elif kind == "llama3":
        f = _llama3(f, s)
    elif kind == "yarn":
        f, m = _yarn(f, s, rd, theta)
    elif kind == "longrope":
        long = seq_len is not None and seq_len > s["original_max_position_embeddings"]
        f = f / np.asarray(s["long_factor" if long else "short_factor"], dtype=np.float64)
        m = _longrope_factor(s)
    elif kind == "proportional":  # rd = Dh; the pairs past ⌊p·Dh/2⌋ do not turn
        f = np.where(np.arange(rd // 2) < proportional_pairs(s, rd), f, 0.0) / s_
    elif kind == "axial":  # section a's pair m: θ^(−2(A·m + o_a)/rd) · axial_scale[a]
        f = theta ** -(2 * axial_exponents(s, rd) / rd) * axial_multipliers(s, rd)
    if s.get("frequency_log_scale") is not None:  # Mistral Large 4's learned α: f·e^α
        f = f * np.exp(np.asarray(s["frequency_log_scale"], dtype=np.float64))
    return f, m


def axial_multipliers(s, rd):
    """(rd/2,) float64: axial_scale[a] for each pair of section a (rope_axes), the scale of its
    axis's frequencies; ones without axial_scale. DINOv3: 2π/H on the rows' pairs, 2π/W on the
    columns' (its angle 2π · c · f at the patch centre c = (2i + 1 − H)/H, our integer
    position 2i + 1 − H times f · 2π/H)."""
    scale = s.get("axial_scale")
    if scale is None:
        return np.ones(rd // 2)
    return np.asarray(scale, dtype=np.float64)[rope_axes(s, rd)]


def axial_exponents(s, rd):
    """(rd/2,) int: A·m + o_a, where axial RoPE's pair j (section a = j // n, m = j % n, n =
    rd/(2A) pairs per axis) takes its frequency θ^(−2(A·m + o_a)/rd): o_a = 0 when every axis
    shares the same n frequencies (axial_frequencies "shared": HF's inv_freq over Dh/2 for two
    axes), o_a = a when the 1-D RoPE's rd/2 are dealt to the axes in turn ("split", Pixtral)."""
    count, pair = s["axial_axes"], np.arange(rd // 2)
    section, m = pair // (rd // 2 // count), pair % (rd // 2 // count)
    return count * m + (section if s["axial_frequencies"] == "split" else 0)


def proportional_pairs(s, head_dim) -> int:
    """Proportional RoPE's turning pairs, int(p · Dh // 2) as Hugging Face counts them
    (_compute_proportional_rope_parameters), p the rotary fraction; the other pairs' frequency
    is 0."""
    return int(s["partial_rotary_factor"] * head_dim // 2)


def _llama3(f, s):
    """Llama 3.1: wavelengths 2π/f above L0/low_freq_factor divided by the factor, below
    L0/high_freq_factor kept, between them a linear blend in L0/wavelength."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    l0 = s["original_max_position_embeddings"]
    wavelength = 2 * math.pi / f
    smooth = (l0 / wavelength - low) / (high - low)
    blended = (1 - smooth) * f / factor + smooth * f
    return np.where(wavelength > l0 / low, f / factor,
                    np.where(wavelength < l0 / high, f, blended))


def yarn_attention_factor(s) -> float:
    """YaRN's m: attention_factor, or mscale(s, mscale) / mscale(s, mscale_all_dim) when both
    are given (DeepSeek), or 0.1 · ln s + 1, where mscale(s, a) = 0.1 · a · ln s + 1 (1 for
    s ≤ 1)."""
    def mscale(scale, a=1.0):
        return 1.0 if scale <= 1 else 0.1 * a * math.log(scale) + 1.0
    if s["attention_factor"] is not None:
        return s["attention_factor"]
    if s["mscale"] and s["mscale_all_dim"]:
        return mscale(s["factor"], s["mscale"]) / mscale(s["factor"], s["mscale_all_dim"])
    return mscale(s["factor"])


def yarn_ramp(s, rd, theta) -> tuple:
    """YaRN's correction range (low, high) in pair indices: the pairs turning beta_fast and
    beta_slow times within L0, floored and ceiled when ``truncate``, clipped to [0, rd − 1]."""
    l0 = s["original_max_position_embeddings"]

    def dim(rotations):
        return rd * math.log(l0 / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim(s["beta_fast"]), dim(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rd - 1)
    return low, (high + 0.001 if low == high else high)


def _yarn(f, s, rd, theta):
    """YaRN: f/s (interpolated) for the pairs past the ramp, f (extrapolated) before it, a
    linear ramp between; m as yarn_attention_factor."""
    low, high = yarn_ramp(s, rd, theta)
    ramp = np.clip((np.arange(rd // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    return f / s["factor"] * ramp + f * (1 - ramp), yarn_attention_factor(s)


def _longrope_factor(s) -> float:
    """LongRoPE's m: attention_factor, or √(1 + ln s / ln L0) (1 for s ≤ 1)."""
    if s["attention_factor"] is not None:
        return s["attention_factor"]
    factor, l0 = s["factor"], s["original_max_position_embeddings"]
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(l0))


def call_dependent(settings) -> bool:
    """Whether the frequencies depend on the call's largest position (longrope, dynamic): then a
    KV-cache decode does not equal the full forward (as in Hugging Face)."""
    return dict(settings)["rope_type"] in ("longrope", "dynamic")


@lru_cache(maxsize=64)
def rope_tables(frequencies: tuple, factor: float, positions: int) -> tuple:
    """(cos_hi, sin_hi, cos_lo, sin_lo), float64: the hi tables (⌈positions / ROPE_BLOCK⌉,
    rd/2) at a·ROPE_BLOCK, times the attention factor m (so that the combined cos and sin carry
    it with no extra rounding), the lo tables (ROPE_BLOCK, rd/2) at b. Read-only (shared)."""
    f = np.asarray(frequencies, dtype=np.float64)
    hi = np.arange(-(-positions // ROPE_BLOCK), dtype=np.float64)[:, None] * ROPE_BLOCK * f
    lo = np.arange(ROPE_BLOCK, dtype=np.float64)[:, None] * f
    tables = (factor * np.cos(hi), factor * np.sin(hi), np.cos(lo), np.sin(lo))
    for t in tables:
        t.flags.writeable = False
    return tables


def settings_tables(settings, rd, positions, seq_len=None) -> tuple:
    """rope_tables of ``settings`` for rd rotated features (seq_len: as rope_frequencies)."""
    f, m = rope_frequencies(settings, rd, seq_len)
    return rope_tables(tuple(f.tolist()), float(m), positions)


def hf_inv_freq(settings, rd, array, seq_len=None):
    """Hugging Face's float32 (inv_freq, attention factor), by its own operations in its order,
    on the caller's framework: ``array(values)`` makes a float32 array of it (torch: HF's own
    bits on the same machine; JAX and NumPy: their float32 power may differ in the last bit).
    ``seq_len``: the call's largest position + 1 (longrope: a Python int; dynamic: an int, or
    a float32 scalar of the framework, as HF's float32 θ' takes it). With frequency_log_scale
    α: the type's inv_freq times e^α in float32 (Mistral Large 4's rotary embedding)."""
    inv, factor = _hf_type_inv_freq(settings, rd, array, seq_len)
    alpha = dict(settings).get("frequency_log_scale")
    if alpha is not None:
        alpha = array(np.asarray(alpha))  # float32: torch's exp is HF's; NumPy's otherwise
        inv = inv * (alpha.exp() if hasattr(alpha, "exp") else np.exp(alpha))
    return inv, factor


def _hf_type_inv_freq(settings, rd, array, seq_len=None):
    """hf_inv_freq of the rope_type alone."""
    s = dict(settings)
    kind, base, factor = s["rope_type"], s["rope_theta"], s.get("factor")
    l0 = s.get("original_max_position_embeddings")
    exponents = array(np.arange(0, rd, 2)) / rd  # HF: arange(0, dim, 2).float() / dim
    if kind == "dynamic" and seq_len is not None:
        seq = max(seq_len, l0) if isinstance(seq_len, int) else seq_len + (l0 - seq_len) * (
            seq_len < l0)
        base = base * (factor * seq / l0 - (factor - 1)) ** (rd / (rd - 2))
    if kind == "yarn":
        pos_freqs = base ** exponents
        low, high = yarn_ramp(s, rd, base)
        ramp = (array(np.arange(rd // 2)) - low) / (high - low)
        ramp = ramp * (ramp > 0) * (ramp < 1) + 1.0 * (ramp >= 1)  # clamp to [0, 1]
        extrapolation = 1 - ramp
        inv = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
        return inv, yarn_attention_factor(s)
    if kind == "longrope":
        long = seq_len is not None and seq_len > l0
        ext = array(np.asarray(s["long_factor" if long else "short_factor"]))
        return 1.0 / (ext * base ** exponents), _longrope_factor(s)
    if kind == "axial":  # 1/θ^(2k/rd) at k = A·m + o_a; HF's shared 1/θ^(2m/(rd/A)) has the
        return (1.0 / (base ** exponents))[axial_exponents(s, rd)], 1.0  # same float32 exponent
    inv = 1.0 / (base ** exponents)
    if kind == "proportional":  # HF: the turning pairs' inv_freq, zeros after, / factor
        turning = np.arange(rd // 2) < proportional_pairs(s, rd)
        return inv * array(turning.astype(np.float64)) / factor, 1.0
    if kind == "linear":
        inv = inv / factor
    elif kind == "llama3":
        low_f, high_f = s["low_freq_factor"], s["high_freq_factor"]
        wavelength = 2 * math.pi / inv
        scaled = _select(wavelength > l0 / low_f, inv / factor, inv)
        smooth = (l0 / wavelength - low_f) / (high_f - low_f)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        inv = _select((wavelength >= l0 / high_f) & (wavelength <= l0 / low_f), smoothed, scaled)
    return inv, 1.0


def _select(condition, a, b):
    """where(condition, a, b) by arithmetic (exact for finite a and b): the same code for any
    framework's arrays."""
    return a * condition + b * (~condition)


def rope_cos_sin(tables, positions):
    """cos and sin (..., L, Dh/2) of position · f_i from ``rope_tables`` (already arrays of the
    caller's framework and dtype), by angle addition over the rows a = |position| // ROPE_BLOCK
    and b = |position| % ROPE_BLOCK; a negative position's sin negated (cos(−t) = cos t,
    sin(−t) = −sin t: exact). ``positions``: an integer array of the same framework, |p| below
    the tables' reach. Only indexing, ``abs``, ``*``, ``+`` and ``−``: the same code for torch,
    JAX and NumPy."""
    magnitude = abs(positions)
    hi, lo = magnitude // ROPE_BLOCK, magnitude % ROPE_BLOCK
    cos_hi, sin_hi, cos_lo, sin_lo = tables[0][hi], tables[1][hi], tables[2][lo], tables[3][lo]
    sin = sin_hi * cos_lo + cos_hi * sin_lo
    negative = (positions < 0)[..., None]  # (..., L, 1): sin − 2 sin = −sin exactly
    return cos_hi * cos_lo - sin_hi * sin_lo, sin - 2 * sin * negative


def rope_axes(settings, rd):
    """(rd/2,) int: the axis of multimodal positions (3, ..., L) whose position turns each pair,
    None for a 1-D RoPE. Hugging Face's layouts of ``mrope_section`` (s_t, s_h, s_w), which
    sums to rd/2:
        chunked (Qwen2-VL, GLM-4V)   pairs 0 … s_t − 1 the temporal axis, the next s_h the
                                     height, the last s_w the width
        interleaved (Qwen3-VL,       pair j the height if j ≡ 1 (mod 3) and j < 3 s_h, the width
        mrope_interleaved=True)      if j ≡ 2 (mod 3) and j < 3 s_w, else the temporal axis
    and with ``mrope_temporal_last`` the temporal pairs after the spatial ones:
        chunked                      pairs 0 … s_h − 1 the height, the next s_w the width, the
                                     last s_t the temporal axis
        interleaved (ERNIE 4.5 VL,   pair j the height if j is even and j < 2 s_h, the width if
        s_h = s_w)                   j is odd and j < 2 s_w, else the temporal axis
    Each pair keeps its own frequency f_j (ERNIE's pre-permuted inv_freq is undone by its
    recomposition). An axial RoPE's (rope_type "axial", vision towers): A = axial_axes equal
    sections in order, pairs 0 … rd/2A − 1 axis 0 (the patch's row for Qwen-VL, Pixtral,
    Gemma 4), ... The pairing (rotate-half or interleaved features) is another setting: the
    map is by pair."""
    s = dict(settings) if settings is not None else {}
    if s.get("rope_type") == "axial":  # A equal sections, in order
        return np.arange(rd // 2) // (rd // 2 // s["axial_axes"])
    section = s.get("mrope_section")
    if section is None:
        return None
    pair = np.arange(rd // 2)
    last = bool(s.get("mrope_temporal_last", False))
    if not s.get("mrope_interleaved", False):
        order = [1, 2, 0] if last else [0, 1, 2]
        return np.repeat(order, [section[a] for a in order])
    cycle, residues = (2, (0, 1)) if last else (3, (1, 2))  # of the height's, the width's pairs
    axes = np.zeros(rd // 2, dtype=np.int64)
    for axis, residue in zip((1, 2), residues):
        axes[(pair % cycle == residue) & (pair < cycle * section[axis])] = axis
    return axes


def mix_axes(values, axes, pick):
    """(..., L, rd/2) from ``values`` (A, ..., L, rd/2), the cos or sin of each axis's
    positions: pair j from axis axes[j] (rope_axes), a selection (exact: the same values).
    ``pick(values, index)`` is the framework's gather along the first axis at ``index``, a
    NumPy int64 array (1, 1, ..., rd/2) to broadcast against values' other axes
    (jnp.take_along_axis; torch.gather on the index expanded). A gather, not a one-hot product
    summed over the axes: XLA's CPU compiler made that reduction 1.7–2.3 times the 1-D RoPE's
    whole time (docs/performance.md, "Positions in more than one dimension")."""
    index = np.asarray(axes, dtype=np.int64).reshape((1,) * (len(values.shape) - 1) + (-1,))
    return pick(values, index)[0]


def rope_blocks(settings) -> int:
    """In how many blocks of features the pairs turn: an axial RoPE's A with axial_pairs
    "blocks" (Gemma 4: each axis rotate-half within its own rd/A features), else 1."""
    s = dict(settings) if settings is not None else {}
    return s["axial_axes"] if s.get("axial_pairs") == "blocks" else 1


def rope_turn(x, cos, sin, interleaved, *, stack, concat, blocks=1):
    """The first rd = 2 · cos.shape[-1] features of x (..., L, Dh) turned pair by pair, (a, b)
    -> (a cos − b sin, b cos + a sin), the pairs (i, i + rd/2) ("rotate half") or, with
    ``interleaved``, (2i, 2i + 1); the other Dh − rd features passed through (partial rotary).
    ``blocks`` k > 1 (rope_blocks): the rd features as k blocks of rd/k, the pairs of block
    b's turn (cos, sin)[..., b·rd/2k: (b + 1)·rd/2k] paired within it the same way.
    ``stack(arrays, axis)`` and ``concat(arrays, axis)`` are the framework's (torch.stack/
    torch.cat, jnp.stack/jnp.concatenate)."""
    half = cos.shape[-1]
    if blocks > 1:
        rot, rest = x[..., :2 * half], x[..., 2 * half:]
        split = tuple(rot.shape[:-1]) + (blocks, 2 * half // blocks)
        cut = tuple(cos.shape[:-1]) + (blocks, half // blocks)
        turned = rope_turn(rot.reshape(split), cos.reshape(cut), sin.reshape(cut), interleaved,
                           stack=stack, concat=concat).reshape(rot.shape)
        return turned if rest.shape[-1] == 0 else concat((turned, rest), -1)
    rot, rest = x[..., :2 * half], x[..., 2 * half:]
    a, b = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :half], rot[..., half:])
    turned = (a * cos - b * sin, b * cos + a * sin)
    if interleaved:
        turned = stack(turned, -1).reshape(rot.shape)  # (..., L, rd/2, 2) -> (..., L, rd)
    else:
        turned = concat(turned, -1)
    return turned if rest.shape[-1] == 0 else concat((turned, rest), -1)


def check_fits(held, new, room, length) -> None:
    """The strict mode of both twins' GroupedQueryAttention (``strict=True``): ValueError unless
    each row's new tokens ``new`` (its query_seq_lengths, or L) are in [0, L] and fit beside the
    ``held`` ones within max_length ``room``. ``held`` and ``new`` are read on the host (NumPy).
    Without it both twins drop what does not fit: neither written nor counted, its output rows
    those of padding."""
    held = np.asarray(held).reshape(-1)
    new = np.broadcast_to(np.asarray(new), held.shape)
    if ((new < 0) | (new > length)).any():
        raise ValueError(f"query_seq_lengths should be in [0, L = {length}], got {new.tolist()}")
    if (held + new > room).any():
        raise ValueError(f"cache is full: rows holding {held.tolist()} tokens cannot take "
                         f"{new.tolist()} more within max_length M = {room}")


def distance_index(entries, key, pos):
    """Where each key − query distance reads a distance table of ``entries`` = 2S + 1:
    S + clip(key − pos, −S, S), for integer key and query positions of any framework
    (broadcast together)."""
    span = (entries - 1) // 2
    return (key - pos).clip(-span, span) + span


def distance_terms(distance_bias, key, pos):
    """The bias at each key − query distance: ``distance_bias`` (..., 2S + 1) at
    ``distance_index``."""
    return distance_bias[..., distance_index(distance_bias.shape[-1], key, pos)]


def allowed_terms(row, key, pos, *, is_causal, window, chunk=None, q_lengths=None,
                  kv_lengths=None, key_start=0) -> list:
    """The conditions whose AND is the allowed set, for the twins' implementations
    (the reference states the same rule on its own, golden.reference.allowed_positions): query
    ``row`` i at position ``pos`` (= i + offset) may attend key position ``key`` j when
    j ≤ pos (``is_causal``), pos − left ≤ j ≤ pos + right (``window`` = (left, right), None
    for an unbounded side), j // C = pos // C (``chunk`` C, Llama 4's attention_chunk_size),
    j < ``kv_lengths`` and i < ``q_lengths``. Integer arrays of any framework, shaped to
    broadcast against each other; a condition whose argument is None is left out.
    ``key_start``: where key and pos count from when they are relative to a block of keys
    (JAX's ring): chunks are of absolute positions, key_start + j."""
    left, right = window
    terms = [key <= pos if is_causal else None,
             key >= pos - left if left is not None else None,
             key <= pos + right if right is not None else None,
             (key + key_start) // chunk == (pos + key_start) // chunk if chunk is not None
             else None,
             key < kv_lengths if kv_lengths is not None else None,
             row < q_lengths if q_lengths is not None else None]
    return [t for t in terms if t is not None]


def merged_allowed(length, keys, offset, kv_lengths, context_mask, window, *, xp):
    """merged_context's mask (..., 1, L, Lk + Lc) bool, in torch or jax.numpy (``xp``): query i
    at p = offset + i (i without a cache) sees self key j when j ≤ p, p − j < W (the
    ``sliding_window``, None: no limit) and j < kv_lengths (None: every key), and context key t
    when context_mask[..., t] (..., Lc) is True. The same meaning as golden.reference.merged's
    merged_allowed, written once for both twins."""
    device = {"device": context_mask.device} if xp.__name__ == "torch" else {}
    pos = xp.arange(length, **device)[:, None]                          # (L, 1)
    if offset is not None:
        pos = pos + offset[..., None, None]                              # (B, L, 1)
    j = xp.arange(keys, **device)                                       # (Lk,)
    own = j <= pos
    if window is not None:
        own = own & (pos - j < window)
    if kv_lengths is not None:
        own = own & (j < kv_lengths[..., None, None])
    lead = tuple(context_mask.shape[:-1])
    own = xp.broadcast_to(own, lead + (length, keys))
    theirs = xp.broadcast_to(context_mask[..., None, :], lead + (length, context_mask.shape[-1]))
    cat = xp.cat if xp.__name__ == "torch" else xp.concatenate
    return cat([own, theirs], -1)[..., None, :, :]

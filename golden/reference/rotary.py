"""Rotary position embedding (RoPE): the frequencies of every Hugging Face rope_type, the
angles and their cos and sin, and the turn of a head's features pair by pair.

Shape legend: L sequence length, Dh head width, rd = int(Dh · partial_rotary_factor) rotated
features (rd/2 pairs); the other Dh − rd features pass through. Float64, or exact inside
golden.reference.arithmetic.exact_arithmetic().
"""

from __future__ import annotations

import math

import numpy as np

from golden.specification import exact
from golden.specification.positions import hf_inv_freq, proportional_pairs, rope_axes
from golden.reference.arithmetic import number, number_type, real
from golden.specification.validate import rope_settings, rotary_dims


def _power(base, exponent):
    """base^exponent for base > 0: NumPy's power in float64; exp(exponent · ln base) inside
    exact_arithmetic(), where only integer powers exist."""
    if number_type() is None:
        return base ** exponent
    return np.exp(np.log(base) * exponent)


def _pi():
    real_type = number_type()
    return np.pi if real_type is None else exact.pi(real_type)


def rope_frequencies(settings, rd, seq_len=None):
    """(f (rd/2,), attention factor m) of RoPE ``settings``
    (golden.specification.validate.rope_settings)
    for rd rotated features, Hugging Face's rope_types written out (it forms them in float32):
        default   f_i = θ^(−2i/rd)
        linear    f_i / s
        dynamic   θ replaced by θ · (s · seq / L0 − (s − 1))^(rd / (rd − 2)) when seq > L0
        llama3    wavelength λ = 2π / f: λ > L0 / low: f / s; λ < L0 / high: f; between,
                  (1 − a) f / s + a f with a = (L0 / λ − low) / (high − low)
        yarn      r = clip((i − lo) / (hi − lo), 0, 1): f / s · r + f · (1 − r), lo and hi
                  the pairs turning beta_fast and beta_slow times within L0 (floored and
                  ceiled when truncate); m = attention_factor, or mscale(s, mscale) /
                  mscale(s, mscale_all_dim), or 0.1 ln s + 1
        longrope  f_i / long_factor_i when seq > L0, else / short_factor_i; m =
                  attention_factor or √(1 + ln s / ln L0)
        proportional  rd = Dh (the whole head): f_i / s for i < ⌊p · Dh / 2⌋ (p the rotary
                  fraction), 0 beyond
        axial     A sections of n = rd/2A pairs (one per position axis): section a's pair m
                  θ^(−2(A·m + o_a)/rd), o_a = 0 ("shared"), or a ("split": Pixtral), times
                  axial_scale[a] when given (DINOv3: 2π/H, 2π/W)
    then, with frequency_log_scale α (any type: Mistral Large 4's learned scales), f_i · e^{α_i}
    with s the factor, L0 original_max_position_embeddings, seq the call's largest position
    + 1. Float64, or exact inside exact_arithmetic()."""
    s = dict(settings)
    kind, theta, l0 = s["rope_type"], number(s["rope_theta"]), s.get(
        "original_max_position_embeddings")
    factor = None if s.get("factor") is None else number(s["factor"])
    exponent = 2 * np.arange(rd // 2) / number(rd)  # 2i / rd
    one, m = number(1), number(1)
    if kind == "dynamic" and seq_len is not None and seq_len > l0:
        theta = theta * _power(factor * seq_len / l0 - (factor - one), number(rd) / (rd - 2))
    f = _power(theta, -exponent)
    if kind == "linear":
        f = f / factor
    elif kind == "llama3":
        low, high = number(s["low_freq_factor"]), number(s["high_freq_factor"])
        wavelength = 2 * _pi() / f
        a = (l0 / wavelength - low) / (high - low)
        f = np.where(wavelength > l0 / low, f / factor,
                     np.where(wavelength < l0 / high, f, (one - a) * f / factor + a * f))
    elif kind == "yarn":
        f, m = _yarn(s, f, rd, theta, factor)
    elif kind == "longrope":
        long = seq_len is not None and seq_len > l0
        f = f / real(np.asarray(s["long_factor" if long else "short_factor"], np.float64))
        m = (number(s["attention_factor"]) if s["attention_factor"] is not None
             else one if factor <= 1 else np.sqrt(one + np.log(factor) / np.log(number(l0))))
    elif kind == "proportional":  # rd = Dh: pair i turns when i < ⌊p · Dh / 2⌋, else not
        f = np.where(np.arange(rd // 2) < proportional_pairs(s, rd), f, number(0)) / factor
    elif kind == "axial":  # section a = i // n (n = rd/2A), m = i % n: θ^(−2(A·m + o_a)/rd)
        n = rd // 2 // s["axial_axes"]
        k = s["axial_axes"] * (np.arange(rd // 2) % n)
        if s["axial_frequencies"] == "split":  # the 1-D frequencies dealt to the axes in turn
            k = k + np.arange(rd // 2) // n
        f = _power(theta, -(2 * k / number(rd)))
        if s["axial_scale"] is not None:  # section a's frequencies times axial_scale[a]
            f = f * real(np.asarray(s["axial_scale"], np.float64))[np.arange(rd // 2) // n]
    if s.get("frequency_log_scale") is not None:  # Mistral Large 4's learned α: f_i · e^{α_i}
        f = f * np.exp(real(np.asarray(s["frequency_log_scale"], np.float64)))
    return f, m


def _yarn(s, f, rd, theta, factor):
    """YaRN's frequencies and attention factor (rope_frequencies)."""
    one, l0 = number(1), s["original_max_position_embeddings"]

    def correction(rotations):  # the pair index turning ``rotations`` times within L0
        return rd * np.log(l0 / (number(rotations) * 2 * _pi())) / (2 * np.log(theta))
    lo, hi = correction(s["beta_fast"]), correction(s["beta_slow"])
    if s["truncate"]:
        lo, hi = number(math.floor(lo)), number(math.ceil(hi))
    lo, hi = max(lo, number(0)), min(hi, number(rd - 1))
    hi = hi + number(0.001) if lo == hi else hi
    r = (np.arange(rd // 2) - lo) / (hi - lo)
    r = np.where(r < 0, number(0), np.where(r > 1, one, r))
    f = f / factor * r + f * (one - r)

    def mscale(a):
        return one if factor <= 1 else number(0.1) * number(a) * np.log(factor) + one
    if s["attention_factor"] is not None:
        return f, number(s["attention_factor"])
    if s["mscale"] and s["mscale_all_dim"]:
        return f, mscale(s["mscale"]) / mscale(s["mscale_all_dim"])
    return f, mscale(1.0)


def rope_angles(positions, head_dim, theta, rope_parameters=None, partial_rotary_factor=1.0):
    """(..., L, rd/2): position p times frequency f_i (rope_frequencies; θ^(−2i/Dh) by default,
    inside exact_arithmetic() exp(−2i · ln θ / Dh), the exponent a decimal too), for
    ``positions`` an int L (p = 0 … L − 1) or an integer array (..., L); rd = int(Dh ·
    partial_rotary_factor). The attention factor is rope_frequencies'."""
    settings = rope_settings(theta, rope_parameters, partial_rotary_factor)
    positions = np.arange(positions) if np.ndim(positions) == 0 else np.asarray(positions)
    rd = rotary_dims(head_dim, settings)
    f, _ = rope_frequencies(settings, rd, int(positions.max()) + 1)
    return positions[..., None] * f


def rope_cos_sin(settings, head_dim, positions, multi=False):
    """(cos, sin) (..., L, rd/2) times the attention factor, for integer ``positions``
    (..., L): exact (or float64), or with settings' precision "hf" Hugging Face's float32
    arithmetic (golden.specification.positions.hf_inv_freq in NumPy float32; np.cos in float32 is
    NumPy's, whose last bit depends on the CPU: no fixture uses it). ``multi``: ``positions``
    are (3, ..., L), one row per axis of a multimodal RoPE, and pair i takes the cos and sin of
    its axis's position (golden.specification.positions.rope_axes: chunked or interleaved
    sections, the temporal pairs first or, with mrope_temporal_last, last), at its own
    frequency f_i."""
    rd = rotary_dims(head_dim, settings)
    seq_len = int(np.max(positions)) + 1
    if dict(settings)["precision"] == "hf":
        inv, m = hf_inv_freq(settings, rd, lambda v: np.asarray(v, np.float32), seq_len)
        angles = np.asarray(positions, np.float32)[..., None] * inv
        cos, sin = (real((t(angles) * np.float32(m)).astype(np.float64)) for t in (np.cos,
                                                                                  np.sin))
    else:
        f, m = rope_frequencies(settings, rd, seq_len)
        angles = positions[..., None] * f
        cos, sin = m * np.cos(angles), m * np.sin(angles)
    if multi:  # pair i's values from axis a(i): picked, (3, ..., L, rd/2) -> (..., L, rd/2)
        pick = rope_axes(settings, rd)
        cos, sin = (t[pick, ..., np.arange(rd // 2)] for t in (cos, sin))  # (rd/2, ..., L)
        cos, sin = (np.moveaxis(t, 0, -1) for t in (cos, sin))
    return cos, sin


def turn(x, cos, sin, interleaved, blocks=1):
    """The first rd = 2 · cos.shape[-1] features of x (..., L, Dh) turned pair by pair by
    (cos, sin) (..., L, rd/2): the pair (i, i + rd/2) ("rotate half", interleaved=False) or
    (2i, 2i + 1) (interleaved=True), (a, b) -> (a cos − b sin, b cos + a sin); the other
    Dh − rd features passed through (partial rotary). ``blocks`` k > 1 (an axial RoPE's
    "blocks" pairing, Gemma 4): block b of the rd features, rd/k wide, turned alone by pairs
    b·rd/2k … (b + 1)·rd/2k − 1, paired within itself the same way."""
    half = cos.shape[-1]
    if blocks > 1:
        width, n = 2 * half // blocks, half // blocks
        parts = [turn(x[..., b * width:(b + 1) * width], cos[..., b * n:(b + 1) * n],
                      sin[..., b * n:(b + 1) * n], interleaved) for b in range(blocks)]
        return np.concatenate(parts + [x[..., 2 * half:]], axis=-1)
    rot, rest = x[..., :2 * half], x[..., 2 * half:]
    a, b = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :half], rot[..., half:])
    turned = (a * cos - b * sin, b * cos + a * sin)
    if interleaved:
        turned = np.stack(turned, axis=-1).reshape(rot.shape)  # (..., L, rd/2, 2) -> (..., rd)
    else:
        turned = np.concatenate(turned, axis=-1)
    return np.concatenate([turned, rest], axis=-1)


def rotate(x, angles, interleaved, factor=None):
    """Rotary embedding of x (..., L, Dh) by angles (..., L, rd/2) (turn), cos and sin times
    ``factor`` (the attention factor) when given."""
    cos, sin = np.cos(angles), np.sin(angles)
    if factor is not None:
        cos, sin = factor * cos, factor * sin
    return turn(x, cos, sin, interleaved)

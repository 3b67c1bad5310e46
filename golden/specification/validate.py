"""Framework-neutral argument checks shared by the reference, ``torch_attn`` and ``jax_attn``.

The checks read only ``.shape`` and ``.dtype``, so NumPy, PyTorch and JAX arrays all pass through
the same code and raise the same ``ValueError`` messages.

Shape legend: B batch, H heads (Hkv of key and value), Lq query length, Lk key length, Dk key
width, Dv value width.

Why one room of about 800 lines: every check here is called by the reference and by both twins,
and they must raise the same message for the same bad input; kept together, a check and the
messages its siblings word alike are read at once. A quarter of it is RoPE's settings and
positions (``rope_settings``, ``rotary_dims``, ``multi_axis`` for multimodal and axial RoPE),
which ``check_rotary`` and ``check_decoder_inputs`` share with the rest; it is the first part to
move into a room of its own when this one grows again. A new mixer's checks go in a room of
their own beside it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import numpy as np

# The dtypes everything here runs at: fixtures, the command line, the runners. FLOAT_DTYPES, the
# same set by width, is what argument messages list.
DTYPES = ("float32", "float64", "bfloat16", "float16")
FLOAT_DTYPES = tuple(sorted(DTYPES, key=("float16", "bfloat16", "float32", "float64").index))
_LEAD = {2: (), 3: ("H",), 4: ("B", "H")}


def dtype_name(dtype) -> str:
    """'float32' for numpy, JAX and torch dtypes alike."""
    try:
        return _dtype_names(dtype)
    except TypeError:  # an unhashable stand-in for a dtype
        return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=256)
def _dtype_names(dtype) -> str:
    """dtype_name's memo: str() of a NumPy dtype takes about 5 us, and an eager call of the
    JAX core names its arrays' dtypes about ten times."""
    return str(dtype).removeprefix("torch.")


def _fmt(dims) -> str:
    return "(" + ", ".join(str(d) for d in dims) + (",)" if len(dims) == 1 else ")")


def _expect_array(arg, x) -> None:
    """Raise TypeError unless ``x`` has a shape and a dtype (a NumPy, torch or JAX array)."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{arg} should be an array (NumPy, torch or JAX), got {type(x).__name__}")


def _expect_shape(arg, got, letters, want) -> None:
    """Raise unless ``got`` matches ``want`` (None = any size) position by position."""
    ok = len(got) == len(want) and all(w is None or w == g for w, g in zip(want, got))
    if not ok:
        shown = ["?" if w is None else w for w in want]
        raise ValueError(f"{arg} shape should be {_fmt(letters)} = {_fmt(shown)}, got {_fmt(got)}")


def _expect_float(arg, x, like=None, whose="the query's") -> None:
    name = dtype_name(x.dtype)
    if like is None and name not in FLOAT_DTYPES:
        raise ValueError(f"{arg} dtype should be one of {', '.join(FLOAT_DTYPES)}, got {name}")
    if like is not None and name != like:
        raise ValueError(f"{arg} dtype should be {like} ({whose}), got {name}")


def _expect_broadcastable(arg, x, letters, target, kind) -> None:
    _expect_array(arg, x)
    name = dtype_name(x.dtype)
    if kind == "bool" and name != "bool":
        raise ValueError(f"{arg} dtype should be bool (True = may attend), got {name}")
    if kind == "float" and name not in FLOAT_DTYPES:
        raise ValueError(f"{arg} dtype should be one of {', '.join(FLOAT_DTYPES)}, got {name}")
    got = tuple(x.shape)
    fits = len(got) <= len(target) and all(
        g in (1, t) for g, t in zip(reversed(got), reversed(target))
    )
    if not fits:
        raise ValueError(
            f"{arg} shape should broadcast to {_fmt(letters)} = {_fmt(target)}, got {_fmt(got)}"
        )


def check_attention_args(
    query, key, value, mask=None, bias=None, *, scale=None, softcap=None, local_window_size=None,
    query_offset=None, query_seq_lengths=None, key_value_seq_lengths=None, dropout_rate=0.0,
    dropout_mask=None, sinks=None, attention_chunk_size=None,
) -> tuple[int, ...]:
    """Validate the core's arguments; return the weights' shape (..., H, Lq, Lk).

    key and value may have Hkv heads where the query has H, H a multiple of Hkv (grouped-query
    attention). Offsets and lengths are integers: a Python int, or an integer array of the batch
    shape ((B,) for rank-4 inputs, () otherwise); only a Python int's value is checked here, so
    that no framework array is read back from its device. ``sinks``: one float logit per query
    head, (H,) for inputs with a head axis, () for unbatched (Lq, Dk) ones, in the query's
    dtype; ``attention_chunk_size``: None or an int ≥ 1.
    """
    for arg, x in (("query", query), ("key", key), ("value", value)):
        _expect_array(arg, x)
    q_shape, rank = tuple(query.shape), len(query.shape)
    if rank not in _LEAD:
        raise ValueError(
            "query should have rank 2, 3 or 4: (Lq, Dk), (H, Lq, Dk) or (B, H, Lq, Dk), "
            f"got shape {_fmt(q_shape)}"
        )
    _expect_float("query", query)
    lead, dk = _LEAD[rank], q_shape[-1]
    kv_lead = tuple("Hkv" if n == "H" else n for n in lead)
    kv_want = q_shape[:-2] if rank < 3 else q_shape[:-3] + (None,)
    _expect_shape("key", tuple(key.shape), kv_lead + ("Lk", "Dk"), kv_want + (None, dk))
    lk = key.shape[-2]
    _expect_shape("value", tuple(value.shape), kv_lead + ("Lk", "Dv"),
                  tuple(key.shape[:-2]) + (lk, None))
    if rank >= 3 and q_shape[-3] % key.shape[-3]:
        raise ValueError(f"key and value heads Hkv should divide the query's H = {q_shape[-3]}, "
                         f"got Hkv = {key.shape[-3]}")
    q_dtype = dtype_name(query.dtype)
    _expect_float("key", key, like=q_dtype)
    _expect_float("value", value, like=q_dtype)
    letters, target = lead + ("Lq", "Lk"), q_shape[:-1] + (lk,)
    if mask is not None:
        _expect_broadcastable("mask", mask, letters, target, "bool")
    if bias is not None:
        _expect_broadcastable("bias", bias, letters, target, "float")
    check_scale("scale", scale)
    check_positive_or_none("softcap", softcap)
    window(local_window_size)
    check_chunk_size("attention_chunk_size", attention_chunk_size)
    if sinks is not None:
        _expect_array("sinks", sinks)
        heads = q_shape[-3:-2]  # (H,), or () unbatched
        _expect_shape("sinks", tuple(sinks.shape), ("H",) if heads else (), heads)
        _expect_float("sinks", sinks, like=q_dtype)
    batch = q_shape[:1] if rank == 4 else ()
    for arg, x in (("query_offset", query_offset), ("query_seq_lengths", query_seq_lengths),
                   ("key_value_seq_lengths", key_value_seq_lengths)):
        if x is not None:
            _expect_integers(arg, x, batch, "B" if batch else None)
    check_rate("dropout_rate", dropout_rate)
    if dropout_mask is not None:
        if dropout_rate == 0.0:
            raise ValueError("dropout_mask was given but dropout_rate is 0.0; set dropout_rate")
        _expect_broadcastable("dropout_mask", dropout_mask, letters, target, "bool")
    return target


def check_distance_bias(distance_bias, query) -> None:
    """The JAX core's ``distance_bias``: a float vector per query head, (D,) for (Lq, Dk)
    queries, (H, D) for (H, Lq, Dk), (H, D) or (B, H, D) for (B, H, Lq, Dk), D = 2S + 1 odd."""
    _expect_array("distance_bias", distance_bias)
    q_shape = tuple(query.shape)
    heads = q_shape[-3:-2]  # (H,), or () unbatched
    got = tuple(distance_bias.shape)
    letters = ("H", "D") if heads else ("D",)
    if len(q_shape) == 4 and len(got) == 3:
        letters, heads = ("B",) + letters, q_shape[:1] + heads
    _expect_shape("distance_bias", got, letters, heads + (None,))
    if got[-1] % 2 == 0:
        raise ValueError(f"distance_bias's last axis D should be odd (2S + 1: distances −S … S), "
                         f"got D = {got[-1]}")
    _expect_float("distance_bias", distance_bias)


def check_distance_product(distance_query, distance_keys, query) -> None:
    """The JAX core's ``distance_query`` and ``distance_keys``, both or neither: a vector per
    query row (…, Lq, Dr) and a table of vectors over distances (…, D, Dr), D = 2S + 1 odd, each
    (Lq, Dr) and (D, Dr) for (Lq, Dk) queries, (H, …) for (H, Lq, Dk), (H, …) or (B, H, …) for
    (B, H, Lq, Dk); one width Dr."""
    if (distance_query is None) != (distance_keys is None):
        given, missing = (("distance_query", "distance_keys") if distance_keys is None
                          else ("distance_keys", "distance_query"))
        raise ValueError(f"{missing} should be given with {given} (their product is the bias), "
                         f"got None")
    if distance_query is None:
        return
    q_shape = tuple(query.shape)
    for arg, x, rows in (("distance_query", distance_query, q_shape[-2]),
                         ("distance_keys", distance_keys, None)):
        _expect_array(arg, x)
        heads, letters = q_shape[-3:-2], ("H",) if len(q_shape) > 2 else ()
        if len(q_shape) == 4 and len(x.shape) == 4:
            heads, letters = q_shape[:2], ("B", "H")
        width = distance_query.shape[-1] if arg == "distance_keys" else None
        _expect_shape(arg, tuple(x.shape), letters + ("Lq" if rows else "D", "Dr"),
                      heads + (rows, width))
        _expect_float(arg, x)
    if distance_keys.shape[-2] % 2 == 0:
        raise ValueError(f"distance_keys's axis D should be odd (2S + 1: distances −S … S), "
                         f"got D = {distance_keys.shape[-2]}")


def check_key_indices(key_indices, query, key) -> None:
    """The core's ``key_indices``: the keys each query row may choose from, an integer array
    shared by every head, (Lq, k) for (Lq, Dk) or (H, Lq, Dk) queries and (B, Lq, k) for
    (B, H, Lq, Dk) ones, or one per head, (H', Lq, k) or (B, H', Lq, k) with H' = H or 1;
    k ≥ 1. Its values must lie in [0, Lk): checked where they can be read without a trace (a
    NumPy array, a torch tensor, a JAX array outside jit)."""
    _expect_array("key_indices", key_indices)
    q_shape, got = tuple(query.shape), tuple(key_indices.shape)
    batch, heads, lq = q_shape[:-3], q_shape[-3:-2], q_shape[-2]
    shared, letters = batch + (lq, None), ("B",) * len(batch) + ("Lq", "k")
    if heads and len(got) == len(shared) + 1:
        want = batch + ((got[len(batch)] if got[len(batch)] in (1,) + heads else heads[0]),
                        lq, None)
        _expect_shape("key_indices", got, letters[:-2] + ("H",) + letters[-2:], want)
    else:
        _expect_shape("key_indices", got, letters, shared)
    name = dtype_name(key_indices.dtype)
    if not name.startswith(("int", "uint")):
        raise ValueError(f"key_indices dtype should be an integer type, got {name}")
    if got[-1] < 1:
        raise ValueError(f"key_indices's last axis k should be at least 1, got k = {got[-1]}")
    values = _concrete(key_indices)
    lk = key.shape[-2]
    if values is not None and values.size and (values.min() < 0 or values.max() >= lk):
        bad = values.min() if values.min() < 0 else values.max()
        raise ValueError(f"key_indices values should lie in [0, Lk) = [0, {lk}), got {bad}")


def _concrete(x):
    """``x``'s values as a NumPy array, or None when they cannot be read without a trace (a
    JAX tracer)."""
    if hasattr(x, "detach"):  # a torch tensor: read back from its device
        return x.detach().cpu().numpy()
    try:
        return np.asarray(x)
    except TypeError:  # jax.errors.TracerArrayConversionError and its kin are TypeErrors
        return None


def with_head_axis(key_indices, query):
    """``key_indices`` with a head axis: (..., H'|1, Lq, k) to broadcast against (..., H, Lq, k),
    the shared (B, Lq, k) or (Lq, k) of a query with heads given a head axis of size 1
    (``reshape`` alone: NumPy, torch and JAX alike)."""
    shape = tuple(key_indices.shape)
    if len(query.shape) >= 3 and len(shape) == len(query.shape) - 1:
        return key_indices.reshape(shape[:-2] + (1,) + shape[-2:])
    return key_indices


def _real_number(x) -> bool:
    """A Python or NumPy int or float, not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_scale(arg, s) -> None:
    """None or a finite number (the core's ``scale`` and a constructor's alike)."""
    if s is not None and not (_real_number(s) and math.isfinite(s)):
        raise ValueError(f"{arg} should be a finite number or None, got {s!r}")


def check_rate(arg, p) -> None:
    """A dropout rate in [0, 1)."""
    if not (_real_number(p) and 0.0 <= p < 1.0):
        raise ValueError(f"{arg} should be in [0, 1), got {p!r}")


def check_chunk_size(arg, c) -> None:
    """None or an int ≥ 1 (Llama 4's attention_chunk_size)."""
    if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
        raise ValueError(f"{arg} should be None or an int ≥ 1, got {c!r}")


def check_positive_or_none(arg, c) -> None:
    """None or a finite number > 0 (a soft-cap, a RoPE base θ)."""
    if c is not None and not (_real_number(c) and math.isfinite(c) and c > 0):
        raise ValueError(f"{arg} should be a positive number or None, got {c!r}")


def check_rotary(x, theta, rope_parameters=None, partial_rotary_factor=1.0, precision="exact",
                 positions=None):
    """rotary_embedding's x (an array; its Dh is checked where it is used), θ (a finite number
    > 0, or None when rope_parameters holds it), the other settings (rope_settings) and the
    explicit ``positions``: integers shaped (L,), (B, L) against x (B, H, L, Dh), or
    broadcasting to x's (..., L). Returns the settings (rope_settings)."""
    _expect_array("x", x)
    if not (isinstance(rope_parameters, Mapping) and "rope_theta" in rope_parameters):
        if not (_real_number(theta) and math.isfinite(theta) and theta > 0):
            raise ValueError(f"theta should be a positive number, got {theta!r}")
    settings = rope_settings(theta, rope_parameters, partial_rotary_factor, precision)
    if positions is not None:
        _expect_array("positions", positions)
        lead, length = tuple(x.shape[:-2]), x.shape[-2]
        shape = tuple(positions.shape)
        axes = multi_axis(settings, positions, x.shape)
        fits = _positions_fit(shape[1:] if axes else shape, lead, length)
        if not fits or dtype_name(positions.dtype) not in ("int32", "int64", "int16", "uint8"):
            forms = "(L,), (B, L) or (..., L)"
            if has_axes(settings):
                forms += (f", or ({rope_axis_count(settings)}, ...) of these (one row per "
                          f"position axis)")
            raise ValueError(f"positions should be integers shaped {forms} against x's "
                             f"{lead + (length, x.shape[-1])} (L = {length}), got "
                             f"{dtype_name(positions.dtype)} {shape}")
    return settings


def rope_axis_count(settings) -> int | None:
    """The position axes of checked RoPE ``settings`` (rope_settings; None: no RoPE): MROPE_AXES
    for a multimodal RoPE (mrope_section), ``axial_axes`` for an axial one, None for a 1-D
    RoPE (positions of one axis)."""
    s = {} if settings is None else dict(settings)
    if "mrope_section" in s:
        return MROPE_AXES
    return s.get("axial_axes")


def has_axes(settings) -> bool:
    """Whether checked RoPE ``settings`` take positions of several axes (multimodal or axial)."""
    return rope_axis_count(settings) is not None


def _positions_fit(shape, lead, length) -> bool:
    """Whether one axis's positions ``shape`` fits x's (lead..., L, Dh): (L,), (B, L) against
    (B, H, L, Dh), or broadcasting to (lead..., L)."""
    return shape[-1:] == (length,) and (
        len(shape) == 1 or (len(lead) == 2 and shape == (lead[0], length))
        or _broadcasts(shape, lead + (length,)))


def multi_axis(settings, positions, x_shape) -> bool:
    """Whether ``positions`` (an array) hold one row per axis of a multimodal or axial RoPE
    against x of ``x_shape`` (..., L, Dh): the settings have A = rope_axis_count axes and the
    positions a leading axis of A over one axis's form ((L,), (B, L), (..., L)). Without that
    axis every axis is the token's position (a multimodal RoPE's text). ValueError when both
    readings fit (positions (3, L) against x (3, H, L, Dh): three rows' positions, or one row's
    three axes?)."""
    shape, count = tuple(positions.shape), rope_axis_count(settings)
    if count is None or len(shape) < 2 or shape[0] != count:
        return False
    lead, length = tuple(x_shape[:-2]), x_shape[-2]
    if len(lead) == 2 and shape[1:] == (lead[0], length):
        return True  # Hugging Face's (A, B, L) against (B, H, L, Dh)
    if _positions_fit(shape, lead, length) and _positions_fit(shape[1:], lead, length):
        raise ValueError(f"positions {shape} against x {tuple(x_shape)} with {count} position "
                         f"axes are ambiguous: give ({count}, B, L) for each axis's positions, "
                         f"or one row's positions repeated on a leading axis of {count}")
    return _positions_fit(shape[1:], lead, length)


def _broadcasts(shape, target) -> bool:
    """Whether ``shape`` broadcasts to ``target`` (same rank or fewer axes)."""
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(shape[::-1], target[::-1]))


# Hugging Face's rope_parameters, per rope_type: (required fields, optional fields with their
# defaults). Every type also takes rope_type, rope_theta and partial_rotary_factor. Two fields
# HF reads from the model's config instead are fields here: dynamic's original_max_position_
# embeddings (HF: config.max_position_embeddings), and longrope's factor (HF: config.
# max_position_embeddings / original_max_position_embeddings when the dict has none).
ROPE_TYPES = {
    "default": ((), {}),
    "linear": (("factor",), {}),
    "dynamic": (("factor", "original_max_position_embeddings"), {}),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"), {}),
    "yarn": (("factor", "original_max_position_embeddings"),
             {"attention_factor": None, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": None,
              "mscale_all_dim": None, "truncate": True}),
    "longrope": (("short_factor", "long_factor", "original_max_position_embeddings"),
                 {"factor": None, "attention_factor": None}),
    # Gemma 4's full layers, LFM3: over the whole head, the first ⌊p·Dh/2⌋ pairs turning.
    "proportional": ((), {"factor": 1.0}),
    # Vision towers (Qwen-VL, Pixtral, Llama 4, Gemma 4, DINOv3): positions (A, ..., L), one
    # row per axis (the patch's row and column); the rd/2 pairs in A sections, section a turned
    # by axis a (golden.specification.positions.rope_frequencies, rope_axes, rope_blocks), its
    # frequencies times axial_scale[a] (None: 1 on every axis; DINOv3: 2π/H and 2π/W).
    "axial": ((), {"axial_axes": 2, "axial_frequencies": "shared", "axial_pairs": "half",
                   "axial_scale": None}),
}
ROPE_PRECISIONS = ("exact", "hf")
# Multimodal RoPE (Qwen2-VL's and Qwen3-VL's rope_parameters, any rope_type): positions of shape
# (3, ..., L), one row per axis (temporal, height, width), each pair's angle read from one axis
# (golden.specification.positions.rope_axes). Given only when present: a 1-D RoPE's settings
# carry none of the fields. mrope_temporal_last (ours: ERNIE 4.5 VL's layout, which HF writes
# in its rotary embedding, not its config) puts the temporal pairs after the spatial ones.
MROPE_FIELDS = ("mrope_section", "mrope_interleaved", "mrope_temporal_last")
# Taken by every rope_type: each rotated pair's frequency times e^{α_i}, α the field's rd/2
# numbers (Mistral Large 4's learned "LeRoPE" rotary_emb.alpha, applied after the type's own
# scaling, as its rotary embedding does).
SCALE_FIELDS = ("frequency_log_scale",)
MROPE_AXES = 3
# Axial RoPE's two choices: "shared": every axis the same rd/(2A) frequencies θ^(−2m·A/rd)
# (Qwen-VL, Gemma 4, Llama 4), "split": the 1-D RoPE's rd/2 dealt to the axes in turn (Pixtral);
# "half": the rotated width's own pairing (rotate-half, or rope_interleaved), "blocks": each
# axis rotate-half within its own block of rd/A features (Gemma 4).
AXIAL_CHOICES = {"axial_frequencies": ("shared", "split"), "axial_pairs": ("half", "blocks")}


def _rope_field(name, value) -> None:
    """One field of rope_parameters: ValueError naming it, what it expects and what it got."""
    where = f"rope_parameters['{name}']"
    if name == "original_max_position_embeddings":
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"{where} should be a positive int, got {value!r}")
    elif name == "truncate":
        check_flags(**{where: value})
    elif name in ("short_factor", "long_factor"):
        if not (isinstance(value, (list, tuple)) and value
                and all(_real_number(v) and math.isfinite(v) and v > 0 for v in value)):
            raise ValueError(f"{where} should be a list of positive numbers (one per rotated "
                             f"pair), got {value!r}")
    elif name == "frequency_log_scale":
        if not (isinstance(value, (list, tuple)) and value
                and all(_real_number(v) and math.isfinite(v) for v in value)):
            raise ValueError(f"{where} should be a list of finite numbers (one log-scale per "
                             f"rotated pair), got {value!r}")
    elif name == "mrope_section":
        if not (isinstance(value, (list, tuple)) and len(value) == MROPE_AXES
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                        for v in value) and sum(value) > 0):
            raise ValueError(f"{where} should be {MROPE_AXES} non-negative ints (the rotated "
                             f"pairs of the temporal, height and width axes), got {value!r}")
    elif name in ("mrope_interleaved", "mrope_temporal_last"):
        check_flags(**{where: value})
    elif name == "axial_axes":
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 2):
            raise ValueError(f"{where} should be an int ≥ 2 (the position axes, 2 for a "
                             f"patch's row and column), got {value!r}")
    elif name == "axial_scale":
        if value is not None and not (isinstance(value, (list, tuple)) and value and all(
                _real_number(v) and math.isfinite(v) and v > 0 for v in value)):
            raise ValueError(f"{where} should be None or a list of positive numbers (one "
                             f"multiplier of the frequencies per position axis), got {value!r}")
    elif name in AXIAL_CHOICES:
        if value not in AXIAL_CHOICES[name]:
            raise ValueError(f"{where} should be one of {', '.join(AXIAL_CHOICES[name])}, got "
                             f"{value!r}")
    elif name in ("mscale", "mscale_all_dim"):
        if value is not None and not (_real_number(value) and math.isfinite(value)):
            raise ValueError(f"{where} should be a number or None, got {value!r}")
    elif value is not None or name not in ("attention_factor", "factor"):
        if not (_real_number(value) and math.isfinite(value) and value > 0):
            raise ValueError(f"{where} should be a positive number, got {value!r}")


def rope_settings(rope_theta=None, rope_parameters=None, partial_rotary_factor=1.0,
                  rope_precision="exact"):
    """The checked RoPE settings as a hashable tuple of (field, value) pairs (lists as tuples),
    every field of the type present, defaults filled in; None when there is no RoPE (no θ
    anywhere). θ and the rotary fraction may be given as arguments or inside the dict, as
    Hugging Face 5.x puts them; given in both places they must agree."""
    if rope_parameters is not None and not isinstance(rope_parameters, Mapping):
        raise ValueError(f"rope_parameters should be a dict (Hugging Face's rope_parameters) or "
                         f"None, got {type(rope_parameters).__name__}")
    if rope_precision not in ROPE_PRECISIONS:
        raise ValueError(f"rope_precision should be one of {', '.join(ROPE_PRECISIONS)}, "
                         f"got {rope_precision!r}")
    given = dict(rope_parameters or {})
    kind = given.pop("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_parameters['rope_type'] should be one of "
                         f"{', '.join(ROPE_TYPES)}, got {kind!r}")
    required, optional = ROPE_TYPES[kind]
    known = (("rope_theta", "partial_rotary_factor") + required + tuple(optional) + MROPE_FIELDS
             + SCALE_FIELDS)
    for name in given:
        if name not in known:
            raise ValueError(f"rope_parameters has an unknown field {name!r} for rope_type "
                             f"{kind!r}; it takes rope_type, {', '.join(known)}")
    for name in required:
        if name not in given:
            raise ValueError(f"rope_parameters['{name}'] is required by rope_type {kind!r} "
                             f"(it takes rope_type, {', '.join(known)})")
    theta = _given_once("rope_theta", rope_theta, given.pop("rope_theta", None), None)
    fraction = _given_once("partial_rotary_factor", partial_rotary_factor,
                           given.pop("partial_rotary_factor", None), 1.0)
    if theta is None:
        if rope_parameters is not None or fraction != 1.0:
            raise ValueError("rope_theta should be given (as rope_theta or inside "
                             "rope_parameters) with rope_parameters or partial_rotary_factor, "
                             "got None")
        return None
    check_positive_or_none("rope_theta", theta)
    if not (_real_number(fraction) and 0 < fraction <= 1):
        raise ValueError(f"partial_rotary_factor should be a number in (0, 1], got {fraction!r}")
    fields = {**optional, **given}
    for name, value in fields.items():
        _rope_field(name, value)
    if kind == "axial" and "mrope_section" in fields:
        raise ValueError("rope_parameters['mrope_section'] is a multimodal RoPE's; an axial "
                         "RoPE's sections are its axial_axes equal ones, got mrope_section "
                         f"{list(fields['mrope_section'])} with rope_type 'axial'")
    _check_mrope_layout(fields)
    if kind == "axial":
        _check_axial_scale(fields, rope_precision)
    if kind == "llama3" and not fields["high_freq_factor"] > fields["low_freq_factor"]:
        raise ValueError(f"rope_parameters['high_freq_factor'] should be greater than "
                         f"low_freq_factor = {fields['low_freq_factor']}, got "
                         f"{fields['high_freq_factor']}")
    if kind == "longrope" and fields["factor"] is None and fields["attention_factor"] is None:
        raise ValueError("rope_parameters['factor'] is required by rope_type 'longrope' without "
                         "attention_factor (Hugging Face's max_position_embeddings / "
                         "original_max_position_embeddings), got None")
    fields = {n: tuple(v) if isinstance(v, list) else v for n, v in sorted(fields.items())}
    return (("rope_type", kind), ("rope_theta", float(theta)),
            ("partial_rotary_factor", float(fraction)), ("precision", rope_precision),
            *fields.items())


def _check_axial_scale(fields, rope_precision) -> None:
    """axial_scale: one multiplier per axis; not with precision "hf" (HF's float32 arithmetic
    of a scaled axial RoPE, DINOv3's patch-centre coordinates, is not reproduced)."""
    scale = fields["axial_scale"]
    if scale is None:
        return
    if len(scale) != fields["axial_axes"]:
        raise ValueError(f"rope_parameters['axial_scale'] should have axial_axes = "
                         f"{fields['axial_axes']} numbers (one per position axis), got "
                         f"{len(scale)}: {list(scale)}")
    if rope_precision == "hf":
        raise ValueError(f"rope_precision should be 'exact' with rope_parameters['axial_scale'] "
                         f"(Hugging Face's float32 arithmetic of a scaled axial RoPE, DINOv3's "
                         f"patch-centre coordinates, is not reproduced), got {rope_precision!r}")


def _check_mrope_layout(fields) -> None:
    """The layout flags need mrope_section; interleaved with the temporal pairs last alternates
    height and width pairs, so their sections must be equal (as in ERNIE 4.5 VL)."""
    for flag in ("mrope_interleaved", "mrope_temporal_last"):
        if flag in fields and "mrope_section" not in fields:
            raise ValueError(f"rope_parameters['{flag}'] needs mrope_section (the pairs of "
                             f"each axis), got no mrope_section")
    if fields.get("mrope_interleaved") and fields.get("mrope_temporal_last"):
        _, h, w = fields["mrope_section"]
        if h != w:
            raise ValueError(f"rope_parameters['mrope_section'] should have equal height and "
                             f"width sections with mrope_interleaved and mrope_temporal_last "
                             f"(their pairs alternate), got {list(fields['mrope_section'])}")


def rope_arguments(settings) -> dict:
    """rotary_embedding's keyword arguments (theta, rope_parameters, partial_rotary_factor,
    precision) for checked ``settings`` (rope_settings)."""
    fields = dict(settings)
    return {"theta": fields.pop("rope_theta"), "precision": fields.pop("precision"),
            "partial_rotary_factor": fields.pop("partial_rotary_factor"),
            "rope_parameters": fields}


def _given_once(name, argument, field, default):
    """A setting given as an argument or as a rope_parameters field: ValueError if both differ."""
    if field is None:
        return argument
    if argument not in (None, default) and argument != field:
        raise ValueError(f"{name} is given twice and they differ: {name} = {argument!r}, "
                         f"rope_parameters['{name}'] = {field!r}")
    return field


def rotary_dims(head_dim, settings) -> int:
    """rd = int(Dh · partial_rotary_factor), the rotated features of each head (the first rd):
    ValueError unless even, ≥ 2, and matching longrope's per-pair factors (and > 2 for the
    dynamic type, whose θ' has the exponent rd / (rd − 2)). Proportional RoPE pairs the whole
    head, rd = Dh (its rotary fraction says how many pairs turn:
    golden.specification.positions.rope_frequencies)."""
    s = dict(settings)
    whole = s["rope_type"] == "proportional"
    rd = head_dim if whole else int(head_dim * s["partial_rotary_factor"])
    if rd < 2 or rd % 2:
        raise ValueError(f"the rotated width int(head_dim · partial_rotary_factor) should be even "
                         f"and at least 2, got int({head_dim} · {s['partial_rotary_factor']}) "
                         f"= {rd}")
    if s["rope_type"] == "dynamic" and rd == 2:
        raise ValueError("the rotated width should be at least 4 for rope_type 'dynamic' "
                         "(θ' has the exponent rd / (rd − 2)), got 2")
    if s["rope_type"] == "axial" and (rd // 2) % s["axial_axes"]:
        raise ValueError(f"the rotated pairs rd / 2 = {rd // 2} should be a multiple of "
                         f"rope_parameters['axial_axes'] = {s['axial_axes']} (each axis an equal "
                         f"section), got int({head_dim} · {s['partial_rotary_factor']}) = {rd}")
    if "mrope_section" in s and sum(s["mrope_section"]) != rd // 2:
        raise ValueError(f"rope_parameters['mrope_section'] should sum to the rotated pairs rd / "
                         f"2 = {rd // 2}, got {list(s['mrope_section'])} (sum "
                         f"{sum(s['mrope_section'])})")
    for name in ("short_factor", "long_factor", "frequency_log_scale"):
        if name in s and len(s[name]) != rd // 2:
            raise ValueError(f"rope_parameters['{name}'] should have rd / 2 = {rd // 2} numbers "
                             f"(one per rotated pair), got {len(s[name])}")
    return rd


def check_flags(**flags) -> None:
    """Each flag True or False (NumPy's bool too): a string or None is not a flag."""
    for arg, b in flags.items():
        if not isinstance(b, bool) and type(b).__name__ not in ("bool", "bool_"):
            raise ValueError(f"{arg} should be True or False, got {b!r}")


def window(local_window_size) -> tuple:
    """(left, right) of a sliding window, each None (unbounded) or an int ≥ 0; an int w means
    (w, w), None means no window."""
    w = local_window_size
    pair = (w, w) if isinstance(w, int) and not isinstance(w, bool) else w
    ok = w is None or (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(
        s is None or (isinstance(s, int) and not isinstance(s, bool) and s >= 0) for s in pair))
    if not ok:
        raise ValueError("local_window_size should be None, an int ≥ 0 or a pair (left, right) "
                         f"of ints ≥ 0 or None, got {w!r}")
    return (None, None) if w is None else tuple(pair)


def _expect_integers(arg, x, batch, letter) -> None:
    """A Python int ≥ 0, or an integer array of shape ``batch``."""
    if isinstance(x, bool) or (isinstance(x, int) and x < 0):
        raise ValueError(f"{arg} should be an int ≥ 0 or an integer array, got {x!r}")
    if isinstance(x, int):
        return
    name = dtype_name(getattr(x, "dtype", type(x).__name__))
    if not name.startswith(("int", "uint")):
        raise ValueError(f"{arg} dtype should be an integer type, got {name}")
    if tuple(x.shape) != tuple(batch):
        letters = (letter,) if letter else ()
        raise ValueError(f"{arg} shape should be {_fmt(letters)} = {_fmt(batch)}, "
                         f"got {_fmt(tuple(x.shape))}")


def check_sequence(arg, x, width_name, width, lead=None) -> tuple[int, ...]:
    """A module input (B, L, d) or (L, d) with d = width; ``lead`` = the batch shape it must share.

    Returns the leading (batch) shape.
    """
    _expect_array(arg, x)
    shape = tuple(x.shape)
    if len(shape) not in (2, 3):
        raise ValueError(f"{arg} should have rank 2 or 3: (L, {width_name}) or "
                         f"(B, L, {width_name}), got shape {_fmt(shape)}")
    _expect_float(arg, x)
    letters = ("B", "L", width_name) if len(shape) == 3 else ("L", width_name)
    want = (None, None, width) if len(shape) == 3 else (None, width)
    if lead is not None:
        letters = ("B", "L", width_name) if lead else ("L", width_name)
        want = tuple(lead) + (None, width)
    _expect_shape(arg, shape, letters, want)
    return shape[:-2]


def check_self_inputs(x, d_in, mask=None, dropout_mask=None, *, heads=None, rate=0.0):
    """A self-attention module's input x (B, L, d_in) or (L, d_in) (d_in None: any width), its
    mask and its dropout mask (see check_module_masks). Returns the weights' shape."""
    lead = check_sequence("x", x, "d_in", d_in)
    return check_module_masks(lead, x.shape[-2], x.shape[-2], mask, dropout_mask, heads, rate)


def check_cross_inputs(x_q, x_kv, x_v, d_q_in, d_kv_in, mask=None):
    """Cross attention: x_q (B, Lq, d_q_in), x_kv (B, Lk, d_kv_in), x_v (None or x_kv's shape)
    and a mask broadcastable to (B, Lq, Lk). Returns the weights' shape (B, Lq, Lk)."""
    lead = check_sequence("x_q", x_q, "d_q_in", d_q_in)
    check_sequence("x_kv", x_kv, "d_kv_in", d_kv_in, lead=lead)
    if x_v is not None:
        _expect_array("x_v", x_v)
    if x_v is not None and tuple(x_v.shape) != tuple(x_kv.shape):
        raise ValueError(f"x_v shape should equal x_kv's {tuple(x_kv.shape)}, "
                         f"got {tuple(x_v.shape)}")
    return check_module_masks(lead, x_q.shape[-2], x_kv.shape[-2], mask)


def check_context_inputs(x, context, d_in, d_context, mask=None, context_lengths=None, *,
                         heads, cache=None, kv_heads=None, head_dim=None):
    """MultiHeadCrossAttention's call: x (B, Lq, d_in) or (Lq, d_in); the context (B, Lc,
    d_context) unless a cache (a golden.specification.positions.ContextCache) holds its keys and
    values, and then, if given too, of the cache's shape (its values are compared by the module);
    the context's real lengths (B,) integers, never with a cache (it holds them); a mask
    broadcastable to (B, Lq, Lc). Returns the weights' shape (B, N, Lq, Lc)."""
    lead = check_sequence("x", x, "d_in", d_in)
    if cache is None and context is None:
        raise ValueError("context should be an array (B, Lc, d_context) when no cache is given, "
                         "got None")
    if context_lengths is not None and cache is not None:
        raise ValueError("context_lengths should be None with a cache (the cache holds the "
                         "lengths it was made with), got an array")
    if context is not None:
        check_context(context, d_context, context_lengths, lead)
    lc = None if context is None else context.shape[-2]
    if cache is not None:
        lc = check_context_cache(cache, x, context, lc, kv_heads, head_dim)
    return check_module_masks(lead, x.shape[-2], lc, mask, heads=heads, head_axis=True)


def check_context(context, d_context, context_lengths=None, lead=None) -> tuple:
    """A context (B, Lc, d_context) or (Lc, d_context), batched like ``lead`` when given, and
    its real lengths: integers of its batch shape. Returns the batch shape."""
    lead = check_sequence("context", context, "d_context", d_context, lead=lead)
    if context_lengths is not None:
        _expect_integers("context_lengths", context_lengths, lead, "B" if lead else None)
    return lead


def check_context_cache(cache, x, context, lc, kv_heads, head_dim) -> int:
    """A ContextCache for x: key and value (B, Nkv, Lc, Dh) in x's dtype, lengths (B,) integers,
    fingerprint (B, 4); Lc the context's length when one is given. Returns Lc."""
    fields = ("key", "value", "lengths", "fingerprint")
    if not all(hasattr(cache, f) for f in fields):
        raise ValueError("cache should be a ContextCache (key, value, lengths, fingerprint) from "
                         f"context_cache, got {type(cache).__name__}")
    for name in fields:
        _expect_array(f"cache.{name}", getattr(cache, name))
    lead = tuple(x.shape[:-2])
    letters = ("B",) * len(lead) + ("Nkv", "Lc", "Dh")
    _expect_shape("cache.key", tuple(cache.key.shape), letters, lead + (kv_heads, None, head_dim))
    held = cache.key.shape[-2]
    if lc is not None and lc != held:
        raise ValueError(f"context length Lc should be the cache's {held}, got {lc}; make a new "
                         "cache with context_cache(context)")
    _expect_shape("cache.value", tuple(cache.value.shape), letters, lead + (kv_heads, held,
                                                                           head_dim))
    _expect_integers("cache.lengths", cache.lengths, lead, "B" if lead else None)
    _expect_shape("cache.fingerprint", tuple(cache.fingerprint.shape),
                  ("B",) * len(lead) + ("4",), lead + (4,))
    for name in ("key", "value"):
        _expect_float(f"cache.{name}", getattr(cache, name), like=dtype_name(x.dtype),
                      whose="x's")
    return held


def check_same_context(same: bool) -> None:
    """Raise unless the context given with a cache is the one the cache was made from."""
    if not same:
        raise ValueError("context should be the one the cache was made from (its fingerprint "
                         "differs); make a new cache with context_cache(context), or pass "
                         "context=None to use the cached one")


def check_module_masks(lead, lq, lk, mask, dropout_mask=None, heads=None, rate=0.0,
                       head_axis=False):
    """A module's mask against (B, Lq, Lk), or with ``head_axis`` (the multi-head modules that
    take one) also against (B, N, Lq, Lk) (``heads`` N); its dropout mask against its weights
    (B, [N,] Lq, Lk).

    ``lead`` is the batch shape (empty when unbatched), ``heads`` N for multi-head modules and
    ``rate`` the dropout rate in force (0 in eval mode). Returns the weights' shape.
    """
    batch = ("B",) * len(lead)
    head = () if heads is None else (heads,)
    weights = tuple(lead) + head + (lq, lk)
    if mask is not None and head_axis and len(mask.shape) == len(lead) + 3:
        # a head axis, 1 or N (Hugging Face's 4-D boolean masks (B, 1, Lq, Lk))
        _expect_broadcastable("mask", mask, batch + ("N", "Lq", "Lk"), weights, "bool")
    elif mask is not None:
        _expect_broadcastable("mask", mask, batch + ("Lq", "Lk"), tuple(lead) + (lq, lk), "bool")
    if dropout_mask is None:
        return weights
    if rate == 0.0:
        raise ValueError("dropout_mask was given but dropout is inactive (eval mode or "
                         "dropout=0.0); train a module built with dropout > 0")
    _expect_broadcastable("dropout_mask", dropout_mask, batch + ("N",) * len(head) + ("Lq", "Lk"),
                          weights, "bool")
    return weights


def check_decoder_inputs(x, d_in, mask=None, dropout_mask=None, query_seq_lengths=None, *,
                         heads, rate=0.0, cache=None, kv_heads=None, head_dim=None,
                         positions=None, axes=None, temperature=False, value_dim=None,
                         kv_shared=False, merged=False, context=None, context_mask=None):
    """GroupedQueryAttention's call: x (B, L, d_in) or (L, d_in); query_seq_lengths an integer
    array of the batch shape ((B,), or () unbatched); positions integers (B, L) or (L,), or with
    ``axes`` A (the module's RoPE is multimodal or axial: validate.rope_axis_count) also (A, B,
    L) or (A, L), one row per axis, but not with a query ``temperature`` (which axis's position
    would scale it?). Without a cache the keys are x's L tokens; with one (a
    golden.specification.positions.KVCache, see check_cache) they are its max_length positions
    M, and x must be batched like it (its values ``value_dim`` wide, default head_dim). A
    ``kv_shared`` module (no keys of its own) must be given the storing layer's cache. A
    ``merged`` module (merged_context=True, T5Gemma 2's decoder) also attends a context (B, Lc,
    d_in) with context_mask (B, Lc) bool (check_merged_context): the weights, the mask and the
    dropout mask then cover L or M self keys followed by the Lc context keys. Returns the
    weights' shape (B, H, L, L or M (+ Lc))."""
    if kv_shared and cache is None:
        raise ValueError("cache should be the storing layer's KVCache with kv_shared=True (as "
                         "its call on the same tokens returned it; for a forward without "
                         "decoding, its call with cache=store.init_cache(B, L)): the module has "
                         "no key or value projection of its own, got None")
    lead = check_sequence("x", x, "d_in", d_in)
    if query_seq_lengths is not None:
        _expect_integers("query_seq_lengths", query_seq_lengths, lead, "B" if lead else None)
    if positions is not None:  # each token's position: (B, L), or (L,) unbatched
        _expect_array("positions", positions)
        _expect_integers("positions", positions, tuple(positions.shape), None)  # the dtype
        want = tuple(lead) + tuple(x.shape[-2:-1])
        multi = axes is not None and tuple(positions.shape) == (axes,) + want
        if tuple(positions.shape) != want and not multi:
            form = "(B, L)" if lead else "(L,)"
            multi_form = f"({axes}, B, L)" if lead else f"({axes}, L)"
            other = (f" or {multi_form} = {_fmt((axes,) + want)} (one row per position axis)"
                     if axes is not None else "")
            raise ValueError(f"positions shape should be {form} = {_fmt(want)}{other}, got "
                             f"{_fmt(tuple(positions.shape))}")
        if multi and temperature:
            raise ValueError(f"positions of shape {_fmt(tuple(positions.shape))} (one row per "
                             f"position axis) with query_temperature: no family says which "
                             f"axis's position scales the query; give (B, L)")
    lk = x.shape[-2]
    if cache is not None:
        lk = check_cache(cache, x, kv_heads, head_dim, value_dim)
    lk += check_merged_context(merged, x, context, context_mask, cache, lead)
    return check_module_masks(lead, x.shape[-2], lk, mask, dropout_mask, heads, rate,
                              head_axis=True)


def check_merged_context(merged, x, context, context_mask, cache, lead) -> int:
    """merged_context's inputs (T5Gemma 2's merged self- and cross-attention): context (B, Lc,
    d_in) or (Lc, d_in), batched like x, and context_mask (B, Lc) or (Lc,) bool (True = a real
    token, attended), or None (every token real). The context may be None only with a cache
    that holds its keys (cache.context_key not None). Without merged_context both must be None.
    Returns Lc (0 without merged_context)."""
    if not merged:
        for arg, a in (("context", context), ("context_mask", context_mask)):
            if a is not None:
                raise ValueError(f"{arg} should be None without merged_context=True (only the "
                                 f"merged attention attends a context), got an array")
        return 0
    if context is None:
        held = None if cache is None else getattr(cache, "context_key", None)
        if held is None:
            raise ValueError("context should be given with merged_context=True (the encoder "
                             "states, (B, Lc, d_in)) unless the cache holds its keys and values, "
                             "got None")
        if context_mask is not None:
            raise ValueError("context_mask should be None when context is None (the cache's "
                             "context_mask is used), got an array")
        return held.shape[-2]
    d_in = x.shape[-1]
    check_sequence("context", context, "d_in", d_in, lead=lead)
    lc = context.shape[-2]
    if context_mask is not None:
        _expect_array("context_mask", context_mask)
        if dtype_name(context_mask.dtype) != "bool":
            raise ValueError(f"context_mask dtype should be bool (True = a real context token), "
                             f"got {dtype_name(context_mask.dtype)}")
        letters = ("B", "Lc") if lead else ("Lc",)
        _expect_shape("context_mask", tuple(context_mask.shape), letters, tuple(lead) + (lc,))
    return lc


def cache_shape(batch_size, max_length, kv_heads, head_dim) -> tuple:
    """The shape (B, Hkv, M, Dh) of a new cache's key and value, its sizes checked."""
    for name, n in (("batch_size", batch_size), ("max_length", max_length)):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"{name} should be a positive int, got {n!r}")
    return (batch_size, kv_heads, max_length, head_dim)


def check_cache(cache, x, kv_heads, head_dim, value_dim=None) -> int:
    """A KV cache for x (B, L, d_in): key (B, Hkv, M, Dh) and value (B, Hkv, M, Dv) (Dv =
    ``value_dim``, default Dh) in x's dtype, lengths (B,) integers, L ≤ M. Returns M. Only
    shapes and dtypes are read (never the lengths' values)."""
    _expect_cache(cache)
    if len(x.shape) != 3:
        raise ValueError(f"x shape should be (B, L, d_in) with a cache, got {_fmt(tuple(x.shape))}")
    b = x.shape[0]
    _expect_shape("cache.key", tuple(cache.key.shape), ("B", "Hkv", "M", "Dh"),
                  (b, kv_heads, None, head_dim))
    m = cache.key.shape[2]
    dv = head_dim if value_dim is None else value_dim
    _expect_shape("cache.value", tuple(cache.value.shape),
                  ("B", "Hkv", "M", "Dh" if dv == head_dim else "Dv"), (b, kv_heads, m, dv))
    return _cache_takes(cache, ("key", "value"), x, m)


def check_latent_inputs(x, d_in, mask=None, query_seq_lengths=None, *, heads, positions=None,
                        cache=None, kv_lora_rank=None, rope_dim=None):
    """MultiHeadLatentAttention's call: as GroupedQueryAttention's (check_decoder_inputs), the
    cache a golden.specification.positions.LatentCache (check_latent_cache). Returns the weights'
    shape
    (B, N, L, L or M)."""
    lead = check_sequence("x", x, "d_in", d_in)
    check_decoder_inputs(x, d_in, None, None, query_seq_lengths, heads=heads,
                         positions=positions)
    lk = x.shape[-2] if cache is None else check_latent_cache(cache, x, kv_lora_rank, rope_dim)
    return check_module_masks(lead, x.shape[-2], lk, mask, heads=heads, head_axis=True)


LATENT_FIELDS = ("latent", "rope_key", "lengths")


def check_latent_cache(cache, x, kv_lora_rank, rope_dim) -> int:
    """A latent cache for x (B, L, d_in): latent (B, M, kv_lora_rank) and rope_key (B, M,
    qk_rope_head_dim) in x's dtype, lengths (B,) integers, L ≤ M. Returns M. Only shapes and
    dtypes are read (never the lengths' values)."""
    if not all(hasattr(cache, f) for f in LATENT_FIELDS):
        raise ValueError("cache should be a LatentCache (latent, rope_key, lengths) from "
                         f"init_cache, got {type(cache).__name__}")
    for name in LATENT_FIELDS:
        _expect_array(f"cache.{name}", getattr(cache, name))
    if len(x.shape) != 3:
        raise ValueError(f"x shape should be (B, L, d_in) with a cache, got {_fmt(tuple(x.shape))}")
    b = x.shape[0]
    _expect_shape("cache.latent", tuple(cache.latent.shape), ("B", "M", "kv_lora_rank"),
                  (b, None, kv_lora_rank))
    m = cache.latent.shape[1]
    _expect_shape("cache.rope_key", tuple(cache.rope_key.shape), ("B", "M", "qk_rope_head_dim"),
                  (b, m, rope_dim))
    return _cache_takes(cache, ("latent", "rope_key"), x, m)


def _cache_takes(cache, arrays, x, m) -> int:
    """What every cache checks last, its shapes read: lengths (B,) integers, ``arrays`` in x's
    dtype, x's length L at most the cache's max_length M. Returns M."""
    b, length = x.shape[0], x.shape[1]
    _expect_integers("cache.lengths", cache.lengths, (b,), "B")
    for name in arrays:
        _expect_float(f"cache.{name}", getattr(cache, name), like=dtype_name(x.dtype),
                      whose="x's")
    if length > m:
        raise ValueError(f"x length L should be at most the cache's max_length M = {m}, "
                         f"got {length}")
    return m


def _expect_cache(cache) -> None:
    if not all(hasattr(cache, f) for f in ("key", "value", "lengths")):
        raise ValueError("cache should be a KVCache (key, value, lengths) from init_cache, got "
                         f"{type(cache).__name__}")
    for name in ("key", "value", "lengths"):
        _expect_array(f"cache.{name}", getattr(cache, name))


def check_kv_cache(cache) -> None:
    """A KV cache on its own (export_cache, load_cache): key (B, Hkv, M, Dh) and value (B, Hkv,
    M, Dv) (Dv = Dh but for a module's v_head_dim) (and a block indexer's index_key (B, M,
    index_head_dim) when it holds one) of one float dtype, lengths (B,) integers."""
    _expect_cache(cache)
    shape = tuple(cache.key.shape)
    if len(shape) != 4:
        raise ValueError(f"cache.key shape should be (B, Hkv, M, Dh), got {_fmt(shape)}")
    _expect_shape("cache.value", tuple(cache.value.shape), ("B", "Hkv", "M", "Dv"),
                  shape[:3] + (None,))
    _expect_float("cache.key", cache.key)
    _expect_float("cache.value", cache.value, like=dtype_name(cache.key.dtype),
                  whose="cache.key's")
    index_key = getattr(cache, "index_key", None)
    if index_key is not None:  # a block indexer's keys (B, M, index_head_dim)
        _expect_array("cache.index_key", index_key)
        _expect_shape("cache.index_key", tuple(index_key.shape), ("B", "M", "index_head_dim"),
                      (shape[0], shape[2], None))
        _expect_float("cache.index_key", index_key, like=dtype_name(cache.key.dtype),
                      whose="cache.key's")
    _expect_integers("cache.lengths", cache.lengths, shape[:1], "B")


def check_latent_fields(cache) -> None:
    """A latent cache on its own (export_cache, load_cache): latent (B, M, kv_lora_rank) and
    rope_key (B, M, qk_rope_head_dim) (and a learned indexer's index_key (B, M,
    index_head_dim) when it holds one) of one float dtype, lengths (B,) integers."""
    shape = tuple(cache.latent.shape)
    if len(shape) != 3:
        raise ValueError(f"cache.latent shape should be (B, M, kv_lora_rank), got {_fmt(shape)}")
    _expect_shape("cache.rope_key", tuple(cache.rope_key.shape), ("B", "M", "qk_rope_head_dim"),
                  shape[:2] + (None,))
    _expect_float("cache.latent", cache.latent)
    _expect_float("cache.rope_key", cache.rope_key, like=dtype_name(cache.latent.dtype),
                  whose="cache.latent's")
    index_key = getattr(cache, "index_key", None)
    if index_key is not None:  # a learned indexer's keys (B, M, index_head_dim)
        _expect_array("cache.index_key", index_key)
        _expect_shape("cache.index_key", tuple(index_key.shape), ("B", "M", "index_head_dim"),
                      shape[:2] + (None,))
        _expect_float("cache.index_key", index_key, like=dtype_name(cache.latent.dtype),
                      whose="cache.latent's")
    _expect_integers("cache.lengths", cache.lengths, shape[:1], "B")


def check_any_cache(cache) -> tuple:
    """export_cache's and load_cache's argument: a KVCache (check_kv_cache) or a LatentCache
    (check_latent_fields), told apart by its fields. Returns the field names, lengths last."""
    if all(hasattr(cache, f) for f in LATENT_FIELDS):
        for name in LATENT_FIELDS:
            _expect_array(f"cache.{name}", getattr(cache, name))
        check_latent_fields(cache)
        return LATENT_FIELDS
    if not all(hasattr(cache, f) for f in ("key", "value", "lengths")):
        raise ValueError("cache should be a KVCache (key, value, lengths) or a LatentCache "
                         f"(latent, rope_key, lengths) from init_cache, got {type(cache).__name__}")
    check_kv_cache(cache)
    return ("key", "value", "lengths")


def check_build_args(variant, config, params) -> None:
    """``build``'s arguments: a variant's name, a configuration dict and a params dict."""
    if not isinstance(variant, str):
        raise TypeError(f"variant should be a variant's name (a str), got {type(variant).__name__}")
    if not isinstance(config, Mapping):
        raise TypeError(f"config should be a dict of constructor arguments, got "
                        f"{type(config).__name__}")
    check_param_arrays(params)


def check_param_arrays(params) -> None:
    """A dict {neutral name: array} (``load_params``); names and shapes are checked against the
    module's configuration by golden.specification.variants."""
    if not isinstance(params, Mapping):
        raise TypeError(f"params should be a dict {{name: array}} in the neutral layout, got "
                        f"{type(params).__name__}")
    for name, a in params.items():
        _expect_array(f"parameter {name}", a)


def check_block_sizes(block_sizes, key_blocks=True):
    """``block_sizes`` as a tuple (None stays None): (block_q, block_k), positive ints, or
    without ``key_blocks`` (torch's row_chunks, whose chunks take every key their rows can see)
    (rows, None)."""
    if block_sizes is None:
        return None
    pair = isinstance(block_sizes, (tuple, list)) and len(block_sizes) == 2
    positive = lambda n: isinstance(n, int) and not isinstance(n, bool) and n > 0  # noqa: E731
    if key_blocks and pair and all(positive(n) for n in block_sizes):
        return tuple(block_sizes)
    if not key_blocks and pair and positive(block_sizes[0]) and block_sizes[1] is None:
        return tuple(block_sizes)
    want = ("(block_q, block_k) of positive ints" if key_blocks
            else "(rows, None), rows a positive int")
    raise ValueError(f"block_sizes should be None or a pair {want}, got {block_sizes!r}")

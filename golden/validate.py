"""Framework-neutral argument checks shared by the reference, ``torch_attn`` and ``jax_attn``.

The checks read only ``.shape`` and ``.dtype``, so NumPy, PyTorch and JAX arrays all pass through
the same code and raise the same ``ValueError`` messages.

Shape legend: B batch, H heads, Lq query length, Lk key length, Dk key width, Dv value width.
"""

from __future__ import annotations

import math

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_LEAD = {2: (), 3: ("H",), 4: ("B", "H")}


def dtype_name(dtype) -> str:
    """'float32' for numpy, JAX and torch dtypes alike."""
    return str(dtype).removeprefix("torch.")


def _fmt(dims) -> str:
    return "(" + ", ".join(str(d) for d in dims) + (",)" if len(dims) == 1 else ")")


def _expect_shape(arg, got, letters, want) -> None:
    """Raise unless ``got`` matches ``want`` (None = any size) position by position."""
    ok = len(got) == len(want) and all(w is None or w == g for w, g in zip(want, got))
    if not ok:
        shown = ["?" if w is None else w for w in want]
        raise ValueError(f"{arg} shape should be {_fmt(letters)} = {_fmt(shown)}, got {_fmt(got)}")


def _expect_float(arg, x, like=None) -> None:
    name = dtype_name(x.dtype)
    if like is None and name not in FLOAT_DTYPES:
        raise ValueError(f"{arg} dtype should be one of {', '.join(FLOAT_DTYPES)}, got {name}")
    if like is not None and name != like:
        raise ValueError(f"{arg} dtype should be {like} (the query's), got {name}")


def _expect_broadcastable(arg, x, letters, target, kind) -> None:
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
    query, key, value, mask=None, bias=None, *, scale=None, dropout_rate=0.0, dropout_mask=None
) -> tuple[int, ...]:
    """Validate the core's arguments; return the weights' shape (..., Lq, Lk)."""
    q_shape, rank = tuple(query.shape), len(query.shape)
    if rank not in _LEAD:
        raise ValueError(
            "query should have rank 2, 3 or 4: (Lq, Dk), (H, Lq, Dk) or (B, H, Lq, Dk), "
            f"got shape {_fmt(q_shape)}"
        )
    _expect_float("query", query)
    lead, dk = _LEAD[rank], q_shape[-1]
    _expect_shape("key", tuple(key.shape), lead + ("Lk", "Dk"), q_shape[:-2] + (None, dk))
    lk = key.shape[-2]
    _expect_shape("value", tuple(value.shape), lead + ("Lk", "Dv"), q_shape[:-2] + (lk, None))
    q_dtype = dtype_name(query.dtype)
    _expect_float("key", key, like=q_dtype)
    _expect_float("value", value, like=q_dtype)
    letters, target = lead + ("Lq", "Lk"), q_shape[:-1] + (lk,)
    if mask is not None:
        _expect_broadcastable("mask", mask, letters, target, "bool")
    if bias is not None:
        _expect_broadcastable("bias", bias, letters, target, "float")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale should be a finite number or None, got {scale!r}")
    if not (isinstance(dropout_rate, (int, float)) and 0.0 <= dropout_rate < 1.0):
        raise ValueError(f"dropout_rate should be in [0, 1), got {dropout_rate!r}")
    if dropout_mask is not None:
        if dropout_rate == 0.0:
            raise ValueError("dropout_mask was given but dropout_rate is 0.0; set dropout_rate")
        _expect_broadcastable("dropout_mask", dropout_mask, letters, target, "bool")
    return target


def check_sequence(arg, x, width_name, width, lead=None) -> tuple[int, ...]:
    """A module input (B, L, d) or (L, d) with d = width; ``lead`` = the batch shape it must share.

    Returns the leading (batch) shape.
    """
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
    mask and its keep-mask (see check_module_masks). Returns the weights' shape."""
    lead = check_sequence("x", x, "d_in", d_in)
    return check_module_masks(lead, x.shape[-2], x.shape[-2], mask, dropout_mask, heads, rate)


def check_cross_inputs(x_q, x_kv, x_v, d_q_in, d_kv_in, mask=None):
    """Cross attention: x_q (B, Lq, d_q_in), x_kv (B, Lk, d_kv_in), x_v (None or x_kv's shape)
    and a mask broadcastable to (B, Lq, Lk). Returns the weights' shape (B, Lq, Lk)."""
    lead = check_sequence("x_q", x_q, "d_q_in", d_q_in)
    check_sequence("x_kv", x_kv, "d_kv_in", d_kv_in, lead=lead)
    if x_v is not None and tuple(x_v.shape) != tuple(x_kv.shape):
        raise ValueError(f"x_v shape should equal x_kv's {tuple(x_kv.shape)}, "
                         f"got {tuple(x_v.shape)}")
    return check_module_masks(lead, x_q.shape[-2], x_kv.shape[-2], mask)


def check_module_masks(lead, lq, lk, mask, dropout_mask=None, heads=None, rate=0.0):
    """A module's mask against (B, Lq, Lk); its keep-mask against its weights (B, [N,] Lq, Lk).

    ``lead`` is the batch shape (empty when unbatched), ``heads`` N for multi-head modules and
    ``rate`` the dropout rate in force (0 in eval mode). Returns the weights' shape.
    """
    batch = ("B",) * len(lead)
    head = () if heads is None else (heads,)
    weights = tuple(lead) + head + (lq, lk)
    if mask is not None:
        _expect_broadcastable("mask", mask, batch + ("Lq", "Lk"), tuple(lead) + (lq, lk), "bool")
    if dropout_mask is None:
        return weights
    if rate == 0.0:
        raise ValueError("dropout_mask was given but dropout is inactive (eval mode or "
                         "dropout=0.0); train a module built with dropout > 0")
    _expect_broadcastable("dropout_mask", dropout_mask, batch + ("N",) * len(head) + ("Lq", "Lk"),
                          weights, "bool")
    return weights

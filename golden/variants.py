"""What every attention variant is, independent of any framework: its name, its constructor's
arguments and their checks, and its parameters' names and shapes in the neutral layout.

Neutral layout: a projection is y = x W + b with W of shape (in, out) and b of shape (out,).
Multi-head projections keep the heads as contiguous blocks of the output axis (head h owns
columns h·Dh … (h+1)·Dh − 1); the wrapper's independent heads are stacked on a leading axis.
"""

from __future__ import annotations

SDPA = "scaled_dot_product_attention"

CLASS_NAMES = {
    "simple_self_attention": "SimpleSelfAttention",
    "self_attention": "SelfAttention",
    "causal_self_attention": "CausalSelfAttention",
    "cross_attention": "CrossAttention",
    "multi_head_attention_wrapper": "MultiHeadAttentionWrapper",
    "multi_head_attention": "MultiHeadAttention",
}


POSITIONAL = {SDPA: ("query", "key", "value", "mask", "bias"),
              "cross_attention": ("x_q", "x_kv", "x_v", "mask")}


def call_args(variant: str, inputs: dict):
    """(positional arguments, keyword arguments) for calling a variant on a fixture's inputs."""
    names = POSITIONAL.get(variant, ("x", "mask"))
    args = [inputs.get(n) for n in names]
    while args and args[-1] is None:
        args.pop()
    kwargs = {n: a for n, a in inputs.items() if n not in names}
    return args, kwargs


def _positive(**sizes) -> None:
    for name, n in sizes.items():
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"{name} should be a positive int, got {n!r}")


def _rate(dropout) -> None:
    if not (isinstance(dropout, (int, float)) and 0.0 <= dropout < 1.0):
        raise ValueError(f"dropout should be in [0, 1), got {dropout!r}")


def _qkv(prefix_shape, d_q_in, d_kv_in, d_k, d_v, qkv_bias):
    """Shapes of the query, key and value projections (weights, then biases)."""
    shapes = {"W_query": prefix_shape + (d_q_in, d_k), "W_key": prefix_shape + (d_kv_in, d_k),
              "W_value": prefix_shape + (d_kv_in, d_v)}
    if qkv_bias:
        shapes.update({"b_query": prefix_shape + (d_k,), "b_key": prefix_shape + (d_k,),
                       "b_value": prefix_shape + (d_v,)})
    return shapes


def param_shapes(variant: str, config: dict) -> dict:
    """Check a variant's configuration; return {parameter name: shape} in the neutral layout."""
    c = dict(config)
    if variant in (SDPA, "simple_self_attention"):
        return {}
    if variant in ("self_attention", "causal_self_attention"):
        d_v = c.get("d_v") or c["d_k"]
        _positive(d_in=c["d_in"], d_k=c["d_k"], d_v=d_v)
        _rate(c.get("dropout", 0.0))
        return _qkv((), c["d_in"], c["d_in"], c["d_k"], d_v, c.get("qkv_bias", False))
    if variant == "cross_attention":
        d_v = c.get("d_v") or c["d_k"]
        _positive(d_q_in=c["d_q_in"], d_kv_in=c["d_kv_in"], d_k=c["d_k"], d_v=d_v)
        return _qkv((), c["d_q_in"], c["d_kv_in"], c["d_k"], d_v, c.get("qkv_bias", False))
    if variant == "multi_head_attention_wrapper":
        n, d_in, d_head = c["num_heads"], c["d_in"], c["d_head"]
        _positive(d_in=d_in, d_head=d_head, num_heads=n)
        _rate(c.get("dropout", 0.0))
        shapes = _qkv((n,), d_in, d_in, d_head, d_head, c.get("qkv_bias", False))
        if c.get("out_proj", False):
            shapes.update({"W_out": (n * d_head, n * d_head), "b_out": (n * d_head,)})
        return shapes
    if variant == "multi_head_attention":
        n, d_in, d_out = c["num_heads"], c["d_in"], c["d_out"]
        _positive(d_in=d_in, d_out=d_out, num_heads=n)
        if d_out % n:
            raise ValueError(f"d_out should be divisible by num_heads = {n}, got {d_out}")
        _rate(c.get("dropout", 0.0))
        shapes = _qkv((), d_in, d_in, d_out, d_out, c.get("qkv_bias", False))
        shapes["W_out"] = (d_out, d_out)
        if c.get("out_bias", True):
            shapes["b_out"] = (d_out,)
        return shapes
    raise ValueError(f"variant should be one of {', '.join([SDPA, *CLASS_NAMES])}, got {variant!r}")


def check_params(variant: str, config: dict, params: dict) -> None:
    """Raise ValueError naming a missing, unexpected or wrongly shaped parameter."""
    want = param_shapes(variant, config)
    for name in sorted(set(want) - set(params)):
        raise ValueError(f"parameter {name} is missing: expected shape {want[name]}")
    for name in sorted(set(params) - set(want)):
        raise ValueError(f"parameter {name} is unexpected for {variant} with config {config}")
    for name, shape in want.items():
        got = tuple(params[name].shape)
        if got != tuple(shape):
            raise ValueError(f"parameter {name} shape should be {tuple(shape)}, got {got}")

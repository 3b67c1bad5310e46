"""What every attention variant is, independent of any framework: its name, its constructor's
arguments and their checks, and its parameters' names and shapes in the neutral layout.

Neutral layout: a projection is y = x W + b with W of shape (in, out) and b of shape (out,).
Multi-head projections keep the heads as contiguous blocks of the output axis (head h owns
columns h·Dh … (h+1)·Dh − 1); the wrapper's independent heads are stacked on a leading axis.
"""

from __future__ import annotations

import numpy as np

from golden.validate import FLOAT_DTYPES, dtype_name

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
        if dtype_name(params[name].dtype) not in FLOAT_DTYPES:
            raise ValueError(f"parameter {name} dtype should be one of {', '.join(FLOAT_DTYPES)}, "
                             f"got {dtype_name(params[name].dtype)}")


# ---- Walking a module's projections: the twins name their layers alike -----------------------

ROLES = ("query", "key", "value")


def projections(module) -> dict:
    """{role: [layer, ...]} for a module of either framework: W_query, W_key, W_value (one layer,
    or one per head in the wrapper's ``heads``) and ``out_proj`` under the role "out"."""
    if getattr(module, "variant", None) not in CLASS_NAMES:
        raise ValueError(f"module should be a torch_attn or jax_attn variant, "
                         f"got {type(module).__name__}")
    if module.variant == "multi_head_attention_wrapper":
        found = {r: [getattr(h, f"W_{r}") for h in module.heads] for r in ROLES}
    else:
        found = {r: [getattr(module, f"W_{r}")] for r in ROLES if hasattr(module, f"W_{r}")}
    if getattr(module, "out_proj", None) is not None:
        found["out"] = [module.out_proj]
    return found


def _stacked(module, role) -> bool:
    """The wrapper's per-head layers are stacked on a leading axis; everything else is one."""
    return module.variant == "multi_head_attention_wrapper" and role != "out"


def export_layers(module, weight, bias) -> dict:
    """Neutral-layout parameters: ``weight(layer)`` gives W as (in, out), ``bias(layer)`` gives
    b or None; per-head arrays of the wrapper are stacked."""
    out = {}
    for role, layers in projections(module).items():
        pick = np.stack if _stacked(module, role) else (lambda arrays: arrays[0])
        out[f"W_{role}"] = pick([weight(layer) for layer in layers])
        biases = [bias(layer) for layer in layers]
        if biases[0] is not None:
            out[f"b_{role}"] = pick(biases)
    return out


def load_layers(module, params, set_weight, set_bias) -> None:
    """Check ``params`` against the module's configuration, then hand each layer its slice:
    ``set_weight(layer, W (in, out))`` and ``set_bias(layer, b)``."""
    layers_by_role = projections(module)
    check_params(module.variant, module.config, params)
    for role, layers in layers_by_role.items():
        for i, layer in enumerate(layers):
            pick = (lambda a: np.asarray(a)[i]) if _stacked(module, role) else np.asarray
            set_weight(layer, pick(params[f"W_{role}"]))
            if f"b_{role}" in params:
                set_bias(layer, pick(params[f"b_{role}"]))

"""The variant modules: reference gradients against finite differences, the two frameworks
against each other on random weights, exact weight round trips, twin signatures, train/eval,
and bad configuration, input and parameters."""

from __future__ import annotations

import inspect
import re

import jax
import numpy as np
import pytest
import torch
from flax import nnx

import jax_attn
import torch_attn
from golden import reference
from golden.cases import CASES
from golden.regenerate import build as build_fixture
from golden.tolerances import compare
from golden.variants import CLASS_NAMES, call_args
from tests.conftest import DTYPES, FRAMEWORKS, fresh_rng

FIRST_CASE = {}
for _case in CASES:
    FIRST_CASE.setdefault(_case.variant, _case)
MODULE_CASES = [FIRST_CASE[v] for v in CLASS_NAMES]
CONFIGS = {  # random-weight configurations, every size different
    "simple_self_attention": {},
    "self_attention": dict(d_in=5, d_k=4, d_v=6, qkv_bias=True),
    "causal_self_attention": dict(d_in=5, d_k=3, d_v=4, dropout=0.3),
    "cross_attention": dict(d_q_in=5, d_kv_in=3, d_k=4, d_v=6, qkv_bias=True),
    "multi_head_attention_wrapper": dict(d_in=5, d_head=2, num_heads=3, causal=True,
                                         dropout=0.1, qkv_bias=True, out_proj=True),
    "multi_head_attention": dict(d_in=5, d_out=12, num_heads=3, causal=True, dropout=0.2,
                                 qkv_bias=True, out_bias=True),
}


def random_inputs(variant, rng, dtype="float64", batch=(2,)):
    if variant == "cross_attention":
        return {"x_q": rng.standard_normal(batch + (6, 5)).astype(dtype),
                "x_kv": rng.standard_normal(batch + (7, 3)).astype(dtype),
                "mask": rng.random(batch + (6, 7)) < 0.8}
    d_in = CONFIGS[variant].get("d_in", 4)
    return {"x": rng.standard_normal(batch + (7, d_in)).astype(dtype),
            "mask": rng.random(batch + (7, 7)) < 0.8}


def make(framework, variant, config, seed=0):
    cls = getattr(torch_attn if framework == "torch" else jax_attn, CLASS_NAMES[variant])
    if framework == "torch":
        torch.manual_seed(seed)
        return cls(**config)
    return cls(**config, rngs=nnx.Rngs(seed))


def run_module(framework, module, inputs, dtype):
    """(output, weights) as float64 NumPy, module in eval mode."""
    module.eval()
    with jax.enable_x64(dtype == "float64"):
        if framework == "torch":
            conv = {n: torch.from_numpy(a) for n, a in inputs.items()}
        else:
            conv = {n: jax.numpy.asarray(a) for n, a in inputs.items()}
        args, kwargs = call_args(module.variant, conv)
        y, w = module(*args, **kwargs, return_weights=True)
        to_np = (lambda t: t.detach().numpy()) if framework == "torch" else np.asarray
        return to_np(y).astype(np.float64), to_np(w).astype(np.float64)


# ---- reference gradients ----------------------------------------------------------------------

def _loss(case, inputs, params, cot):
    out, w, _ = reference.VARIANTS[case.variant][0](case.config, inputs, params)
    return np.sum(out * cot["output"]) + np.sum(w * cot["weights"])


@pytest.mark.parametrize("case", MODULE_CASES, ids=lambda c: c.name)
def test_reference_module_gradients_match_finite_differences(case):
    f = build_fixture(case)
    inputs = {n: a.astype(np.float64) if a.dtype.kind == "f" else a for n, a in f.inputs.items()}
    params = {n: a.astype(np.float64) for n, a in f.params.items()}
    cot = {n: a.astype(np.float64) for n, a in f.cotangents.items()}
    h = 1e-6
    for group in (inputs, params):
        for name in [n for n, a in group.items() if a.dtype.kind == "f"]:
            numeric = np.zeros_like(group[name])
            for idx in np.ndindex(group[name].shape):
                orig = group[name][idx]
                group[name][idx] = orig + h
                plus = _loss(case, inputs, params, cot)
                group[name][idx] = orig - h
                minus = _loss(case, inputs, params, cot)
                group[name][idx] = orig
                numeric[idx] = (plus - minus) / (2 * h)
            np.testing.assert_allclose(f.grads[name], numeric, rtol=1e-6, atol=1e-7,
                                       err_msg=f"{case.name} {name}")


# ---- framework against framework --------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("source", FRAMEWORKS)
@pytest.mark.parametrize("variant", list(CLASS_NAMES))
def test_module_built_from_other_framework_agrees(variant, source, dtype):
    rng, seed = fresh_rng()
    target = "jax" if source == "torch" else "torch"
    origin = make(source, variant, CONFIGS[variant], seed)
    export = (torch_attn if source == "torch" else jax_attn).export_params(origin)
    params = {n: a.astype(dtype) for n, a in export.items()}
    with jax.enable_x64(dtype == "float64"):
        lib = jax_attn if target == "jax" else torch_attn
        twin = lib.build(variant, CONFIGS[variant], params)
        if source == "torch" and dtype == "float64":
            origin = origin.double()
        inputs = random_inputs(variant, rng, dtype)
        ref = reference.VARIANTS[variant][0](CONFIGS[variant], inputs, params)
        a = run_module(source, origin, inputs, dtype)
        b = run_module(target, twin, inputs, dtype)
    for i, what in enumerate(("output", "weights")):
        assert compare(a[i], ref[i], dtype).ok, f"{source} {what} vs reference, seed {seed}"
        assert compare(b[i], ref[i], dtype).ok, f"{target} {what} vs reference, seed {seed}"
        assert compare(a[i], b[i], dtype).ok, f"{source} vs {target} {what}, seed {seed}"


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("variant", list(CLASS_NAMES))
def test_params_round_trip_exactly(framework, variant):
    rng, seed = fresh_rng()
    lib = torch_attn if framework == "torch" else jax_attn
    params = {n: rng.standard_normal(a.shape).astype(np.float32) for n, a in
              lib.export_params(make(framework, variant, CONFIGS[variant])).items()}
    back = lib.export_params(lib.build(variant, CONFIGS[variant], params))
    assert back.keys() == params.keys()
    for n in params:
        assert back[n].dtype == params[n].dtype and np.array_equal(back[n], params[n]), n


def test_neutral_layout_is_x_times_w():
    # y = x W with W (in, out): a module whose W_value picks input feature 0 for output 1.
    w = np.zeros((3, 2), dtype=np.float32)
    w[0, 1] = 1.0
    params = {"W_query": np.zeros((3, 2), np.float32), "W_key": np.zeros((3, 2), np.float32),
              "W_value": w}
    x = np.array([[2.0, 5.0, 7.0], [4.0, 5.0, 7.0]], dtype=np.float32)
    for lib, conv in ((torch_attn, torch.from_numpy), (jax_attn, jax.numpy.asarray)):
        out = np.asarray(lib.build("self_attention", {"d_in": 3, "d_k": 2}, params)(conv(x))
                         .tolist())
        np.testing.assert_array_equal(out, [[0, 3], [0, 3]])  # uniform weights: mean of x[:, 0]


# ---- signatures -------------------------------------------------------------------------------

def _params(fn, drop=()):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()
            if p.name not in drop]


@pytest.mark.parametrize("name", list(CLASS_NAMES.values()))
def test_twin_class_signatures(name):
    t, j = getattr(torch_attn, name), getattr(jax_attn, name)
    assert _params(t.__init__) == _params(j.__init__, drop=("rngs", "precision"))
    assert _params(t.forward) == _params(j.__call__)
    extra = inspect.signature(j.__init__).parameters
    assert all(extra[n].kind is inspect.Parameter.KEYWORD_ONLY for n in ("rngs", "precision"))
    assert _params(torch_attn.build) == _params(jax_attn.build, drop=("rngs",))


# ---- train and eval ---------------------------------------------------------------------------

@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("variant", ["causal_self_attention", "multi_head_attention_wrapper",
                                     "multi_head_attention"])
def test_dropout_only_in_training(framework, variant):
    rng, seed = fresh_rng()
    config = {**CONFIGS[variant], "dropout": 0.5}
    module = make(framework, variant, config, seed)
    x = random_inputs(variant, rng, "float32")["x"]
    x = torch.from_numpy(x) if framework == "torch" else jax.numpy.asarray(x)
    module.eval()
    a, b = np.asarray(module(x).tolist()), np.asarray(module(x).tolist())
    assert np.array_equal(a, b)
    module.train()
    c, d = np.asarray(module(x).tolist()), np.asarray(module(x).tolist())
    assert not np.allclose(c, a) and not np.allclose(c, d), f"seed {seed}"


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_keep_mask_in_eval_mode_is_an_error(framework):
    module = make(framework, "multi_head_attention", CONFIGS["multi_head_attention"])
    module.eval()
    x, keep = np.ones((2, 7, 5), np.float32), np.ones((2, 3, 7, 7), bool)
    conv = torch.from_numpy if framework == "torch" else jax.numpy.asarray
    with pytest.raises(ValueError, match="dropout_mask was given but dropout is inactive"):
        module(conv(x), dropout_mask=conv(keep))


# ---- bad configuration, input and parameters --------------------------------------------------

BAD_CONFIG = [
    ("MultiHeadAttention", dict(d_in=4, d_out=10, num_heads=3),
     "d_out should be divisible by num_heads = 3, got 10"),
    ("MultiHeadAttention", dict(d_in=4, d_out=6, num_heads=0),
     "num_heads should be a positive int, got 0"),
    ("SelfAttention", dict(d_in=0, d_k=4), "d_in should be a positive int, got 0"),
    ("SelfAttention", dict(d_in=3, d_k=4, d_v=-2), "d_v should be a positive int, got -2"),
    ("CrossAttention", dict(d_q_in=3, d_kv_in=2.5, d_k=4),
     "d_kv_in should be a positive int, got 2.5"),
    ("CausalSelfAttention", dict(d_in=3, d_k=4, dropout=1.0),
     "dropout should be in [0, 1), got 1.0"),
    ("MultiHeadAttentionWrapper", dict(d_in=3, d_head=-1, num_heads=2),
     "d_head should be a positive int, got -1"),
]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("cls, config, message", BAD_CONFIG, ids=[m for *_, m in BAD_CONFIG])
def test_bad_configuration(framework, cls, config, message):
    kw = {} if framework == "torch" else {"rngs": nnx.Rngs(0)}
    with pytest.raises(ValueError, match=re.escape(message)):
        getattr(torch_attn if framework == "torch" else jax_attn, cls)(**config, **kw)


BAD_INPUT = [
    ("multi_head_attention", {"x": (2, 7, 4)},
     "x shape should be (B, L, d_in) = (?, ?, 5), got (2, 7, 4)"),
    ("multi_head_attention", {"x": (7, 4)}, "x shape should be (L, d_in) = (?, 5), got (7, 4)"),
    ("self_attention", {"x": (1, 2, 7, 5)},
     "x should have rank 2 or 3: (L, d_in) or (B, L, d_in), got shape (1, 2, 7, 5)"),
    ("simple_self_attention", {"x": (5,)},
     "x should have rank 2 or 3: (L, d_in) or (B, L, d_in), got shape (5,)"),
    ("causal_self_attention", {"x": (2, 7, 5), "mask": (2, 7, 6)},
     "mask shape should broadcast to (B, Lq, Lk) = (2, 7, 7), got (2, 7, 6)"),
    ("multi_head_attention_wrapper", {"x": (2, 7, 5), "mask": (2, 3, 7, 7)},
     "mask shape should broadcast to (B, Lq, Lk) = (2, 7, 7), got (2, 3, 7, 7)"),
    ("cross_attention", {"x_q": (2, 6, 5), "x_kv": (3, 7, 3)},
     "x_kv shape should be (B, L, d_kv_in) = (2, ?, 3), got (3, 7, 3)"),
    ("cross_attention", {"x_q": (2, 6, 5), "x_kv": (2, 7, 3), "x_v": (2, 6, 3)},
     "x_v shape should equal x_kv's (2, 7, 3), got (2, 6, 3)"),
    ("cross_attention", {"x_q": (2, 6, 5), "x_kv": (2, 7, 3), "mask": (2, 7, 6)},
     "mask shape should broadcast to (B, Lq, Lk) = (2, 6, 7), got (2, 7, 6)"),
    ("multi_head_attention", {"x": (2, 7, 5), "dropout_mask": (2, 7, 7)},
     "dropout_mask shape should broadcast to (B, N, Lq, Lk) = (2, 3, 7, 7), got (2, 7, 7)"),
]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("variant, shapes, message", BAD_INPUT, ids=[m[:50] for *_, m in BAD_INPUT])
def test_bad_input(framework, variant, shapes, message):
    module = make(framework, variant, CONFIGS[variant])
    module.train()
    conv = torch.from_numpy if framework == "torch" else jax.numpy.asarray
    arrays = {n: conv(np.ones(s, bool if "mask" in n else np.float32)) for n, s in shapes.items()}
    args, kwargs = call_args(variant, arrays)
    with pytest.raises(ValueError, match=re.escape(message)):
        module(*args, **kwargs)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bad_params_are_named(framework):
    lib = torch_attn if framework == "torch" else jax_attn
    config = CONFIGS["multi_head_attention"]
    good = lib.export_params(make(framework, "multi_head_attention", config))
    cases = [({k: v for k, v in good.items() if k != "W_key"},
              "parameter W_key is missing: expected shape (5, 12)"),
             ({**good, "W_extra": good["W_key"]}, "parameter W_extra is unexpected"),
             ({**good, "b_out": good["b_out"][:-1]},
              "parameter b_out shape should be (12,), got (11,)"),
             ({**good, "W_out": good["W_out"].astype(np.int32)},
              "parameter W_out dtype should be one of float16, bfloat16, float32, float64, "
              "got int32")]
    for params, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            lib.build("multi_head_attention", config, params)
    with pytest.raises(ValueError, match="variant should be one of .*got 'flash_attention'"):
        lib.build("flash_attention", config, good)


@pytest.mark.parametrize("variant", ["multi_head_attention_wrapper", "multi_head_attention"])
def test_keep_mask_broadcast_over_heads(variant):
    # A keep-mask without a head axis applies to every head, in both frameworks and the reference.
    rng, seed = fresh_rng()
    params = jax_attn.export_params(make("jax", variant, CONFIGS[variant], seed))
    x = rng.standard_normal((2, 7, 5))
    keep = rng.random((7, 7)) < 0.7
    ref, _, _ = reference.VARIANTS[variant][0](CONFIGS[variant], {"x": x, "dropout_mask": keep},
                                               params)
    with jax.enable_x64(True):
        for lib, conv in ((torch_attn, torch.from_numpy), (jax_attn, jax.numpy.asarray)):
            module = lib.build(variant, CONFIGS[variant],
                               {n: a.astype(np.float64) for n, a in params.items()})
            module.train()
            out = module(conv(x), dropout_mask=conv(keep))
            out = out.detach().numpy() if lib is torch_attn else np.asarray(out)
            assert compare(out, ref, "float64").ok, f"{lib.__name__}, seed {seed}"

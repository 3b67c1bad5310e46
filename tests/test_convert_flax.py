"""Flax's own attention modules <-> ours (jax_attn.convert, golden.convert): random weights with
non-zero biases drawn into ``flax.nnx.MultiHeadAttention`` and linen's
``MultiHeadDotProductAttention``, converted, and run against the float64 reference and our
module (output, attention weights, the gradients of x and of every parameter, a boolean mask
and causal); exact round trips; copies; what cannot be represented.

Measured on this machine over 48 runs (8 seeds, the 3 shapes below, masked with and without
causal), relative to the array's scale (max |a − e| / max |e|) against the float64 reference:
nnx's default path (``jax.nn.dot_product_attention``, float32 softmax) in float64 reaches 1.0e-7
on outputs and 7.2e-7 on gradients (W_query; b_query 6.3e-7, W_key 5.2e-7, x 4.7e-7), i.e.
float32 accuracy, and is held to the float32 table; with ``sow_weights=True`` (softmax in
float64) 3.5e-16 (output), 3.5e-16 (weights), 2.2e-15 (gradients), within the float64 table.
In float32 both paths pass the float32 table: outputs 2.1e-7, weights 1.5e-7, gradients 9.5e-7
(default path) and 7.5e-7 (sow). Linen computes in the input's dtype throughout: 2.5e-16
(output) and 1.6e-15 (gradients) in float64; 1.4e-7 and 3.3e-7 in float32.

Shape legend: B batch, L length, E input width, E_out output width, H heads, Hkv key-value
heads, Dh head width; every size distinct.
"""

from __future__ import annotations

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_attn
from golden.specification import variants
from golden.harness.check import compare_all
from golden.convert import flax_mha_to_neutral
from jax_attn import convert
from tests.helpers import JAX, fresh_rng, random_cotangents, reference_fixture

B, L, E = 2, 5, 7
# (id, H, Hkv, Dh, E_out, variant it converts to)
SHAPES = [("mha", 3, 3, 4, 12, "multi_head_attention"),
          ("out_width", 3, 3, 4, 10, "grouped_query_attention"),  # E_out ≠ H·Dh
          ("kv_groups", 4, 2, 3, 6, "grouped_query_attention")]   # Hkv < H
JDTYPE = {"float32": jnp.float32, "float64": jnp.float64}


def _exact(rng, shape, scale=0.5):
    """Random float64 values exact in float32, so one draw serves both dtypes."""
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(np.float64)


def _redraw(tree, rng, dtype) -> dict:
    """Fresh values for a Flax parameter tree {role: {"kernel", "bias"}}: kernels at Flax's
    initial scale, 1/√fan_in, biases at 0.5 (non-zero). Larger weights make larger gradients,
    and the float32 rounding noise of the key bias's gradient (zero by structure, judged by an
    absolute bound: golden.specification.tolerances) grows with them."""
    def draw(role, name, a):
        fan_in = np.prod(a.shape[:2] if role == "out" else a.shape[:1])
        return jnp.asarray(_exact(rng, a.shape, 0.5 if name == "bias" else fan_in ** -0.5),
                           JDTYPE[dtype])
    return {r: {n: draw(r, n, a) for n, a in part.items()} for r, part in tree.items()}


def _nnx_mha(shape, rng, dtype, **kw):
    """An nnx.MultiHeadAttention of ``shape`` with every parameter redrawn (biases non-zero)."""
    _, h, hkv, dh, e_out, _ = shape
    mha = nnx.MultiHeadAttention(h, E, qkv_features=h * dh, out_features=e_out,
                                 num_kv_heads=hkv, decode=False, param_dtype=JDTYPE[dtype],
                                 rngs=nnx.Rngs(0), **kw)
    state = nnx.state(mha, nnx.Param)
    nnx.replace_by_pure_dict(state, _redraw(nnx.to_pure_dict(state), rng, dtype))
    nnx.update(mha, state)
    return mha


def _arrays(rng, shape):
    """x (B, L, E), a bool mask (B, L, L) with the diagonal kept (no empty row under causal),
    cotangents dO (B, L, E_out) and dA (B, H, L, L)."""
    _, h, _, _, e_out, _ = shape
    mask = rng.random((B, L, L)) < 0.7
    mask[:, np.arange(L), np.arange(L)] = True
    return {"x": _exact(rng, (B, L, E), 1.0), "mask": mask}, random_cotangents(
        rng, (B, L, e_out), (B, h, L, L))


def _numpy(a):
    return np.asarray(a).astype(np.float64)


def nnx_run(mha, arrays, cot, *, causal, sow, dtype) -> dict:
    """A runner result (golden.runners) of ``mha``: output, the gradients of x and of every
    parameter (neutral layout), and with ``sow`` (``sow_weights=True``: Flax's explicit path)
    the weights and the gradients of Σ out ⊙ dO + Σ weights ⊙ dA; without, Flax's default path,
    which gives no weights: gradients of Σ out ⊙ dO."""
    x, mask = jnp.asarray(arrays["x"], JDTYPE[dtype]), jnp.asarray(arrays["mask"])[:, None]
    d_out, d_w = (jnp.asarray(cot[n], JDTYPE[dtype]) for n in ("output", "weights"))
    graphdef, params, rest = nnx.split(mha, nnx.Param, ...)

    @jax.jit
    def run(params, x):
        def loss(params, x):
            m = nnx.merge(graphdef, params, rest)
            if not sow:
                y = m(x, mask=mask, is_causal=causal)
                return jnp.sum(y * d_out), (y, None)
            y, sown = nnx.capture(m, nnx.Intermediate)(x, mask=mask, is_causal=causal,
                                                       sow_weights=True)
            w = sown["attention_weights"][0]  # (B, H, L, L)
            return jnp.sum(y * d_out) + jnp.sum(w * d_w), (y, w)
        return jax.grad(loss, argnums=(0, 1), has_aux=True)(params, x)

    (g_params, g_x), (y, w) = run(params, x)
    _, _, grads = flax_mha_to_neutral(nnx.to_pure_dict(g_params))  # gradients convert alike
    result = {"output": _numpy(y), "grads": {"x": _numpy(g_x)} | {
        n: _numpy(g) for n, g in grads.items()}, "loss": "both" if sow else "output"}
    if sow:
        result["weights"] = _numpy(w)
    return result


@pytest.mark.parametrize(("shape", "causal"), [(SHAPES[0], True), (SHAPES[1], False),
                                               (SHAPES[2], True)],
                         ids=["mha-mask_causal", "out_width-mask", "kv_groups-mask_causal"])
def test_nnx_mha_matches_ours_float64(shape, causal):
    rng, seed = fresh_rng()
    arrays, cot = _arrays(rng, shape)
    with jax.enable_x64(True):
        mha = _nnx_mha(shape, rng, "float64")
        variant, config, params = convert.from_nnx_mha(mha, causal=causal)
        assert variant == shape[-1] and config["causal"] is causal
        fixture = reference_fixture(variant, config, arrays, params, cot, "float64")
        ours = JAX.run_with_grads(jax_attn.build(variant, config, params), fixture, "float64")
        explicit = nnx_run(mha, arrays, cot, causal=causal, sow=True, dtype="float64")
        fast = nnx_run(mha, arrays, cot, causal=causal, sow=False, dtype="float64")
    for name, result in (("ours", ours), ("nnx sow_weights=True", explicit)):
        comps = compare_all(fixture, result, "float64")
        assert set(comps) == {"output", "weights", "grad x", *(f"grad {n}" for n in params)}
        bad = {what: c for what, c in comps.items() if not c.ok}
        assert not bad, f"{name}, seed {seed}: {bad}"
    for what in ("output", "weights", "x", *params):  # nnx's explicit path against ours
        a = explicit[what] if what in explicit else explicit["grads"][what]
        e = ours[what] if what in ours else ours["grads"][what]
        scale = 1.0 if what in fixture.zero else np.abs(e).max()  # zero: rounding noise
        assert np.abs(a - e).max() <= 1e-12 * scale, (what, seed)
    # The default path's softmax runs in float32 even under x64 (jax.nn.dot_product_attention):
    # its float64 run is as good as a float32 one (the float32 table), not better.
    comps = compare_all(fixture, fast, "float64")
    assert comps["output"].max_rel > 1e-12, (comps["output"], seed)  # else: say so in README
    bad = {w: c for w, c in compare_all(fixture, fast, "float32").items() if not c.ok}
    assert not bad, f"nnx default path, seed {seed}: {bad}"


@pytest.mark.parametrize("shape", SHAPES[::2], ids=[s[0] for s in SHAPES[::2]])
def test_nnx_mha_float32_within_the_table(shape):
    rng, seed = fresh_rng()
    arrays, cot = _arrays(rng, shape)
    mha = _nnx_mha(shape, rng, "float32")
    variant, config, params = convert.from_nnx_mha(mha, causal=True)
    fixture = reference_fixture(variant, config, arrays, params, cot, "float32")
    for sow in (False, True):
        result = nnx_run(mha, arrays, cot, causal=True, sow=sow, dtype="float32")
        bad = {w: c for w, c in compare_all(fixture, result, "float32").items() if not c.ok}
        assert not bad, f"sow_weights={sow}, seed {seed}: {bad}"


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_nnx_round_trip_is_exact(shape):
    rng, _ = fresh_rng()
    with jax.enable_x64(True):
        mha = _nnx_mha(shape, rng, "float64")
        variant, config, params = convert.from_nnx_mha(mha)
        ours = jax_attn.build(variant, config, params)          # through our module, too
        back = convert.to_nnx_mha(variant, config, jax_attn.export_params(ours))
        before, after = (nnx.to_pure_dict(nnx.state(m, nnx.Param)) for m in (mha, back))
    assert jax.tree.structure(before) == jax.tree.structure(after)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        assert a.dtype == b.dtype == jnp.float64 and np.array_equal(a, b)
    assert (back.num_heads, back.num_kv_heads, back.out_features) == (shape[1], shape[2],
                                                                      shape[4])


def test_nnx_settings_carry_over():
    rng, _ = fresh_rng()
    mha = _nnx_mha(SHAPES[0], rng, "float32", dropout_rate=0.25, use_bias=False)
    variant, config, params = convert.from_nnx_mha(mha)
    assert (config["dropout"], config["qkv_bias"], config["out_bias"]) == (0.25, False, False)
    assert not any(n.startswith("b_") for n in params)
    back = convert.to_nnx_mha(variant, config, params, rngs=nnx.Rngs(3))
    assert back.dropout_rate == 0.25 and not back.use_bias and back.rngs is not None
    x = jnp.asarray(rng.standard_normal((B, L, E)), jnp.float32)
    y1, y2 = back(x, deterministic=False), back(x, deterministic=False)  # its stream advances
    assert y1.shape == (B, L, 12) and not np.array_equal(y1, y2)


def test_ours_with_an_output_bias_alone_gets_zero_qkv_biases():
    """Our MultiHeadAttention's default (qkv_bias=False, out_bias=True) has no Flax twin with
    one use_bias: zero biases are the same function, and come back as zeros."""
    with jax.enable_x64(True):
        ours = jax_attn.MultiHeadAttention(E, 12, num_heads=3, causal=True, rngs=nnx.Rngs(1))
        JAX.cast(ours, jnp.float64)
        variant, config, params = "multi_head_attention", ours.config, jax_attn.export_params(ours)
        mha = convert.to_nnx_mha(variant, config, params)
        x = jnp.asarray(np.random.default_rng(0).standard_normal((B, L, E)))
        y_ours = np.asarray(ours(x))
        y_nnx = np.asarray(nnx.capture(mha, nnx.Intermediate)(x, is_causal=True,
                                                              sow_weights=True)[0])
        _, config_back, params_back = convert.from_nnx_mha(mha, causal=True)
    assert np.abs(y_nnx - y_ours).max() <= 1e-12 * np.abs(y_ours).max()
    assert config_back["qkv_bias"] and not any(params_back[f"b_{r}"].any()
                                               for r in ("query", "key", "value"))
    assert all(np.array_equal(params_back[n], params[n]) for n in params)


def test_linen_matches_ours_and_round_trips():
    rng, seed = fresh_rng()
    h, dh, e_out = 3, 4, 10
    arrays, _ = _arrays(rng, ("", h, h, dh, e_out, ""))
    mask = jnp.asarray(np.tril(arrays["mask"]))[:, None]  # causal, through the mask
    with jax.enable_x64(True):
        module = linen.MultiHeadDotProductAttention(num_heads=h, qkv_features=h * dh,
                                                    out_features=e_out, param_dtype=jnp.float64)
        x = jnp.asarray(arrays["x"])
        variables = module.init(jax.random.key(0), x)
        variables = {"params": _redraw(variables["params"], rng, "float64")}
        variant, config, params = convert.from_linen_mha(variables, causal=True)
        ours = jax_attn.build(variant, config, params)
        y_ours = np.asarray(ours(x, jnp.asarray(arrays["mask"])))
        y_linen = np.asarray(module.apply(variables, x, mask=mask))
        module_back, variables_back = convert.to_linen_mha(variant, config, params)
        y_back = np.asarray(module_back.apply(variables_back, x, mask=mask))
    assert variant == "grouped_query_attention" and config["d_out"] == e_out
    # linen computes in the input's dtype throughout: float64 rounding only.
    assert np.abs(y_linen - y_ours).max() <= 1e-12 * np.abs(y_ours).max(), seed
    assert np.array_equal(y_back, y_linen)
    assert jax.tree.structure(variables_back) == jax.tree.structure(variables)
    for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(variables_back)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    # The inner dict converts as the whole variables do.
    assert all(np.array_equal(a, params[n]) for n, a in
               convert.from_linen_mha(variables["params"], causal=True)[2].items())


def test_linen_float32_within_the_table():
    rng, seed = fresh_rng()
    shape = SHAPES[0]
    arrays, cot = _arrays(rng, shape)
    module = linen.MultiHeadDotProductAttention(num_heads=3, qkv_features=12, out_features=12)
    x = jnp.asarray(arrays["x"], jnp.float32)
    variables = {"params": _redraw(module.init(jax.random.key(0), x)["params"], rng, "float32")}
    variant, config, params = convert.from_linen_mha(variables, causal=True)
    fixture = reference_fixture(variant, config, arrays, params, cot, "float32")
    mask = jnp.asarray(np.tril(arrays["mask"]))[:, None]
    d_out = jnp.asarray(cot["output"])

    @jax.jit
    def run(variables, x):
        def loss(variables, x):
            y = module.apply(variables, x, mask=mask)
            return jnp.sum(y * d_out), y
        return jax.grad(loss, argnums=(0, 1), has_aux=True)(variables, x)

    (g_vars, g_x), y = run(variables, x)
    grads = convert.from_linen_mha(g_vars)[2]
    result = {"output": _numpy(y), "loss": "output",
              "grads": {"x": _numpy(g_x)} | {n: _numpy(g) for n, g in grads.items()}}
    bad = {w: c for w, c in compare_all(fixture, result, "float32").items() if not c.ok}
    assert not bad, f"seed {seed}: {bad}"


def test_exports_are_copies():
    rng, _ = fresh_rng()
    mha = _nnx_mha(SHAPES[2], rng, "float32")
    kernel = np.array(mha.query.kernel.get_value())
    variant, config, params = convert.from_nnx_mha(mha)
    params["W_query"][...] = 0.0                      # the module keeps its weights
    assert np.array_equal(mha.query.kernel.get_value(), kernel)
    params["W_query"] = kernel.reshape(E, -1).copy()
    back = convert.to_nnx_mha(variant, config, params)
    params["W_query"][...] = 0.0                      # the new module took a copy
    assert np.array_equal(back.query.kernel.get_value(), kernel)
    variables = {"params": nnx.to_pure_dict(nnx.state(mha, nnx.Param))}
    linen_params = convert.from_linen_mha(variables)[2]
    linen_params["W_key"][...] = 0.0
    assert np.asarray(variables["params"]["key"]["kernel"]).any()


def _zeros(variant, config):
    """Parameters of the right shapes, for the checks that come before any arithmetic."""
    return {n: np.zeros(shape, np.float32)
            for n, shape in variants.get(variant).param_shapes(config).items()}


def test_what_flax_and_ours_cannot_share():
    with pytest.raises(ValueError, match="normalize_qk should be False"):
        convert.from_nnx_mha(nnx.eval_shape(lambda: nnx.MultiHeadAttention(
            2, 4, normalize_qk=True, decode=False, rngs=nnx.Rngs(0))))
    with pytest.raises(ValueError, match="in_kv_features should equal in_features = 4 .*, got 6"):
        convert.from_nnx_mha(nnx.eval_shape(lambda: nnx.MultiHeadAttention(
            2, 4, in_kv_features=6, decode=False, rngs=nnx.Rngs(0))))
    with pytest.raises(ValueError, match="mha should be a flax.nnx.MultiHeadAttention, got "
                                         "MultiHeadDotProductAttention"):
        convert.from_nnx_mha(linen.MultiHeadDotProductAttention(num_heads=2))
    tree = {"params": {r: {"kernel": np.zeros((4, 2, 2))} for r in ("query", "key", "value")}}
    tree["params"].update(out={"kernel": np.zeros((2, 2, 4))}, query_ln={"scale": np.ones(2)})
    with pytest.raises(ValueError, match="normalize_qk should be False"):
        convert.from_linen_mha(tree)
    del tree["params"]["query_ln"], tree["params"]["key"]["kernel"]
    with pytest.raises(ValueError, match=r"key.kernel should be in the tree, got \[\]"):
        convert.from_linen_mha(tree)
    gqa = "grouped_query_attention"
    config = dict(d_in=8, num_heads=4, num_kv_heads=2, rope_theta=10000.0)
    with pytest.raises(ValueError, match="rope_theta should be None .* got 10000.0"):
        convert.to_nnx_mha(gqa, config, _zeros(gqa, config))
    config = dict(config, rope_theta=None)
    for option, value in (("qk_norm", "rms"), ("sliding_window", 3), ("output_gate", True)):
        with pytest.raises(ValueError, match=f"{option} should be (None|False) for Flax's "
                                             f"MultiHeadAttention, .* got {value!r}"):
            convert.to_nnx_mha(gqa, dict(config, **{option: value}),
                               _zeros(gqa, dict(config, **{option: value})))
    with pytest.raises(ValueError, match="num_kv_heads should equal num_heads = 4 .* got 2"):
        convert.to_linen_mha(gqa, config, _zeros(gqa, config))
    with pytest.raises(ValueError, match=r"scale should be None or 1/√Dh = 0.7071.* got 0.25"):
        convert.to_nnx_mha(gqa, dict(config, scale=0.25), _zeros(gqa, config))
    one = dict(d_in=4, d_k=3)
    with pytest.raises(ValueError, match="variant should be multi_head_attention or "
                                         "grouped_query_attention .* got 'self_attention'"):
        convert.to_nnx_mha("self_attention", one, _zeros("self_attention", one))
    params = _zeros(gqa, config)
    del params["W_out"]
    with pytest.raises(ValueError, match=r"parameter W_out is missing: expected shape \(8, 8\)"):
        convert.to_nnx_mha(gqa, config, params)

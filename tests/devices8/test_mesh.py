"""Batch and heads sharded over a 2 × 4 mesh ("data" × "model") of 8 virtual CPU devices.

Every sharded run is compared with the same computation on one device: outputs and gradients
(inputs, parameters), float64 to 1e-12 and float32 to golden.specification.tolerances' table; the
output and gradients keep the expected NamedSharding; and the compiled program is read for
collectives. Both kinds of mesh: "explicit" (jax.make_mesh's default axes, JAX's current default)
and "auto" (a classic Mesh). Shapes are small and all different (B=4, H=8, Lq=24, Lk=40, Dk=6,
Dv=10, so that a gathered array's shape says what it is).

Shape legend: B batch, H query heads, Hkv key-value heads, Lq/Lk query/key length, Dk/Dv
key/value width, L module sequence length, d_* feature widths.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_attn
from golden.specification import variants
from golden.reference import ZERO_GRADS
from golden.specification.tolerances import compare
from jax_attn import functional
from jax_attn.sharding import BATCH, HEADS, layer_specs, shard_module
from tests.helpers import fresh_rng, matrix, one

B, H, LQ, LK, DK, DV = 4, 8, 24, 40, 6, 10
DATA, MODEL = 2, 4  # the mesh's shape
KINDS = ("explicit", "auto")
COLLECTIVE = re.compile(r"= (\S+) (all-gather|all-reduce|all-to-all|collective-permute|"
                        r"reduce-scatter)(?:-start)?\(")


@functools.cache
def _mesh(kind):
    axis_types = (AxisType.Explicit if kind == "explicit" else AxisType.Auto,) * 2
    return jax.make_mesh((DATA, MODEL), ("data", "model"), axis_types=axis_types)


@pytest.fixture(params=KINDS)
def mesh(request):
    return _mesh(request.param)


def _collectives(text):
    """[(op, result type)] of the collectives in a compiled program's text."""
    return [(m.group(2), m.group(1)) for m in COLLECTIVE.finditer(text)]


def _dims(shape_text) -> set:
    """The dimensions of an HLO result type such as f32[2,4,40,6]{3,2,1,0}."""
    return {int(n) for n in re.findall(r"\d+", shape_text.split("[", 1)[1].split("]")[0])}


def _equal(actual, expected, dtype, kind="value", terms=1, zero=False):
    """float64: within 1e-12 of the single-device result (relative to its scale); float32: the
    tolerance table's bound for ``kind`` (``terms`` and ``zero`` as
    golden.specification.tolerances.compare:
    the partial sums of a parameter's gradient, and a gradient zero by structure)."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if dtype == "float64":
        np.testing.assert_allclose(a, e, rtol=1e-12, atol=1e-12 * max(1.0, np.abs(e).max()))
    else:
        found = compare(a, e, dtype, kind, terms=terms, zero=zero)
        assert found.ok, found


def _sharded_like(x, mesh, spec):
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (x.sharding, spec)


# ---- the core ---------------------------------------------------------------------------------

# name: (dtype, Hkv, key/value spec, settings, {extra: (shape, spec)}). Key and value are split
# over "model" with the query when n = 4 divides Hkv, else replicated over it.
CORE_CASES = {
    "explicit_mask_bias_weights": ("float64", H, HEADS, dict(is_causal=True, return_weights=True),
                                {"mask": ((B, H, LQ, LK), HEADS),
                                 "bias": ((1, H, LQ, LK), P(None, "model"))}),
    "explicit_gqa_softcap_window_lengths": (
        "float32", 4, HEADS, dict(softcap=5.0, local_window_size=(9, 3)),
        {"query_offset": ((B,), BATCH), "query_seq_lengths": ((B,), BATCH),
         "key_value_seq_lengths": ((B,), BATCH)}),
    "explicit_gqa_kv_replicated": ("float64", 2, BATCH, dict(is_causal=True),
                                {"mask": ((B, 1, LQ, LK), BATCH)}),
    "explicit_mqa_dropout": ("float32", 1, BATCH, dict(dropout_rate=0.25),
                          {"bias": ((B, 1, LQ, LK), BATCH)}),
    "blockwise_gqa_lengths_mask": (
        "float64", 4, HEADS, dict(is_causal=True, implementation="blockwise",
                                  block_sizes=(16, 16)),
        {"mask": ((B, 1, LQ, LK), BATCH), "query_offset": ((B,), BATCH),
         "key_value_seq_lengths": ((B,), BATCH)}),
    "blockwise_kv_replicated_bias_keep": (
        "float32", 2, BATCH, dict(local_window_size=(None, 4), dropout_rate=0.2,
                                  implementation="blockwise", block_sizes=(16, 16)),
        {"bias": ((B, H, LQ, LK), HEADS), "dropout_mask": ((B, H, LQ, LK), HEADS)}),
}


def _core_arrays(rng, dtype, hkv, extras):
    arrays = {"query": rng.standard_normal((B, H, LQ, DK)),
              "key": rng.standard_normal((B, hkv, LK, DK)),
              "value": rng.standard_normal((B, hkv, LK, DV))}
    for name, (shape, _) in extras.items():
        if name in ("mask", "dropout_mask"):
            arrays[name] = rng.random(shape) < 0.8
        elif name == "bias":
            arrays[name] = rng.standard_normal(shape)
        else:  # offsets and lengths
            arrays[name] = rng.integers(1 if "length" in name else 0, LK, shape).astype(np.int32)
    return {n: a.astype(dtype) if a.dtype.kind == "f" else a for n, a in arrays.items()}


def _core_run(arrays, cot, settings):
    """(output, weights or None, gradients of Σ output ⊙ cot for every float array), jitted."""
    floats = [n for n, a in arrays.items() if jnp.issubdtype(a.dtype, jnp.floating)]
    drawn = settings.get("dropout_rate") and "dropout_mask" not in arrays
    rng = jax.random.key(7) if drawn else None

    @jax.jit
    def run(arrays, cot):
        def loss(fl):
            res = jax_attn.scaled_dot_product_attention(**{**arrays, **fl}, dropout_rng=rng,
                                                        **settings)
            out, weights = res if settings.get("return_weights") else (res, None)
            return jnp.sum(out * cot), (out, weights)
        grads, (out, weights) = jax.grad(loss, has_aux=True)({n: arrays[n] for n in floats})
        return out, weights, grads
    return run, run(arrays, cot)


@functools.cache
def _core_reference(name):
    """(seed, arrays, dO, single-device output, weights, gradients) of a case, computed once
    for both mesh kinds."""
    dtype, hkv, _, settings, extras = CORE_CASES[name]
    rng, seed = fresh_rng()
    with jax.enable_x64(dtype == "float64"):
        arrays = _core_arrays(rng, dtype, hkv, extras)
        cot = rng.standard_normal((B, H, LQ, DV)).astype(dtype)
        _, result = _core_run({n: jax.device_put(a) for n, a in arrays.items()},
                              jax.device_put(cot), settings)
    return seed, arrays, cot, *result


# Each case on both mesh kinds, in the whole matrix: each compiles the core on 8 devices, and
# the quick suite keeps tests/devices8 to one ring (test_ring.py) and one sharded module
# (test_module_sharded_equals_one_device, below).
@matrix
@pytest.mark.parametrize("kind, name", [pytest.param(k, n, id=f"{k}-{n}") for n in CORE_CASES
                                        for k in KINDS])
def test_core_sharded_equals_one_device(kind, name):
    mesh = _mesh(kind)
    dtype, hkv, kv_spec, settings, extras = CORE_CASES[name]
    seed, arrays, cot, out1, w1, g1 = _core_reference(name)
    specs = {"query": HEADS, "key": kv_spec, "value": kv_spec,
             **{n: spec for n, (_, spec) in extras.items()}}
    with jax.enable_x64(dtype == "float64"):
        put = {n: jax.device_put(a, NamedSharding(mesh, specs[n])) for n, a in arrays.items()}
        cot = jax.device_put(cot, NamedSharding(mesh, HEADS))
        run, (out, w, grads) = _core_run(put, cot, settings)
        text = run.lower(put, cot).compile().as_text()
    _equal(out, out1, dtype)
    if w is not None:
        _equal(w, w1, dtype, "weights")
        _sharded_like(w, mesh, HEADS)
    for n, g in grads.items():
        _equal(g, g1[n], dtype, "grad")
        _sharded_like(g, mesh, specs[n])  # each gradient lies as its input
    _sharded_like(out, mesh, HEADS)
    shared_bias = "bias" in extras and extras["bias"][0][0] == 1  # (1, H, Lq, Lk)
    for op, shape in _collectives(text):
        # The forward and the backward of q, k, v split alike need no collective. Three are
        # expected: with key and value replicated over "model", the backward gathers (and sums)
        # dK and dV, which have no query axis; a bias shared by the batch rows gets its
        # gradient summed over "data" (only over the keys the rows can see: explicit's causal
        # tile there is 24 of the 40 keys); with per-row loop bounds (offsets, lengths) the
        # blockwise path's vmapped loops agree on their trip count, a bool all-reduced per loop.
        kv_grad = op == "all-gather" and kv_spec == BATCH and LQ not in _dims(shape)
        bias_grad = op == "all-reduce" and shared_bias and LQ in _dims(shape)
        loop_bound = op == "all-reduce" and shape == "pred[]"
        assert kv_grad or bias_grad or loop_bound, f"{name}, {mesh}: {op} {shape}, seed {seed}"


def test_the_collective_reader_sees_an_all_gather(mesh):
    # The check above finds collectives in the compiled text: a program that must gather the
    # query (its heads replicated in the result) shows one.
    q = jax.device_put(np.ones((B, H, LQ, DK), np.float32), NamedSharding(mesh, HEADS))
    text = jax.jit(lambda q: jax.sharding.reshard(q, NamedSharding(mesh, BATCH))
                   if mesh.axis_types[0] == AxisType.Explicit
                   else jax.lax.with_sharding_constraint(q, NamedSharding(mesh, BATCH))
                   ).lower(q).compile().as_text()
    assert [op for op, _ in _collectives(text)] == ["all-gather"]


@matrix  # a program compiled on 8 devices: the whole matrix (see above)
def test_sharded_arrays_skip_the_cpu_chunks(mesh, monkeypatch):
    # At these scores (B·H·Lq·Lk = 2²¹) CPU runs one device's (batch, head) pairs in chunks
    # (lax.map); sharded arrays take the one vmap, so that nothing is gathered, and agree.
    shape = (B, H, 256, DK)
    assert functional.heads_per_step(shape, shape) == functional.CPU_HEADS_PER_STEP
    chunked = []
    real = functional._vmap_chunks
    monkeypatch.setattr(functional, "_vmap_chunks",
                        lambda *a, **k: chunked.append(1) or real(*a, **k))
    jax.clear_caches()  # so that the core is traced again, with the spy
    rng, seed = fresh_rng()
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    one = jax_attn.scaled_dot_product_attention(*map(jax.device_put, (q, k, v)), is_causal=True)
    assert chunked == [1]  # one device, concrete arrays: the chunks, as before
    put = [jax.device_put(x, NamedSharding(mesh, HEADS)) for x in (q, k, v)]
    out = jax_attn.scaled_dot_product_attention(*put, is_causal=True)
    assert chunked == [1]
    _equal(out, one, "float32")
    _sharded_like(out, mesh, HEADS)
    text = jax.jit(lambda *a: jax_attn.scaled_dot_product_attention(*a, is_causal=True)).lower(
        *put).compile().as_text()
    assert _collectives(text) == [], f"seed {seed}"


def test_a_head_layout_that_would_gather_the_query_is_refused(mesh):
    # H = 12 over 4 devices gives each 3 query heads; with Hkv = 3 (groups of 4) they straddle
    # key-value heads, and XLA would gather the query (measured: the output came back with its
    # heads replicated). Eagerly both mesh kinds show the sharding; under jit, explicit axes do.
    q = jax.device_put(np.ones((B, 12, LQ, DK), np.float32), NamedSharding(mesh, HEADS))
    k = jax.device_put(np.ones((B, 3, LK, DK), np.float32), NamedSharding(mesh, BATCH))
    message = (r"key and value heads should be sharded as the query's \(over \('model',\)\), or "
               r"replicated with Hkv dividing or a multiple of the query's 4 head shards, got "
               r"Hkv = 3 sharded over \(\) for H = 12")
    with pytest.raises(ValueError, match=message):
        jax_attn.scaled_dot_product_attention(q, k, k)
    if mesh.axis_types[0] == AxisType.Explicit:
        with pytest.raises(ValueError, match=message):
            jax.jit(jax_attn.scaled_dot_product_attention)(q, k, k)


# ---- the modules ------------------------------------------------------------------------------

# Every variant with parameters; the head-parallel ones with 8 heads (4 devices hold 2 each),
# GroupedQueryAttention also with 2 key-value heads (its key and value projections replicated).
MODULE_CASES = {
    "self_attention": ("float64", dict(d_in=6, d_k=5, d_v=7, qkv_bias=True)),
    "causal_self_attention": ("float32", dict(d_in=6, d_k=5, d_v=7)),
    "cross_attention": ("float32", dict(d_q_in=6, d_kv_in=3, d_k=5, d_v=7, qkv_bias=True)),
    "multi_head_attention_wrapper": ("float64", dict(d_in=6, d_head=3, num_heads=4, causal=True,
                                                     qkv_bias=True, out_proj=True)),
    "multi_head_attention": ("float64", dict(d_in=6, d_out=16, num_heads=8, causal=True,
                                             qkv_bias=True)),
    "grouped_query_attention": ("float32", dict(d_in=6, num_heads=8, num_kv_heads=4, head_dim=2,
                                                d_out=5, qkv_bias=True, out_bias=True,
                                                rope_theta=100.0)),
    "grouped_query_attention-kv_replicated": (
        "float64", dict(d_in=6, num_heads=8, num_kv_heads=2, head_dim=3, d_out=5, qkv_bias=True,
                        softcap=10.0, sliding_window=4)),
    "grouped_query_attention-options": (  # issue 23's: norms, gate, temperature, sinks, chunks
        "float64", dict(d_in=6, num_heads=8, num_kv_heads=4, head_dim=2, d_out=5, qkv_bias=True,
                        qk_norm="layer", output_gate=True, rope_theta=100.0, sinks=True,
                        attention_chunk_size=3,
                        query_temperature={"beta": 0.5, "floor_scale": 2, "shift": 1})),
    "grouped_query_attention-outputs": (  # issue 42's: a gate per head, a norm over the heads
        "float64", dict(d_in=6, num_heads=8, num_kv_heads=4, head_dim=2, d_out=5, qkv_bias=True,
                        output_gate="softplus_per_head", output_norm="rms",
                        qk_norm="rms_after_rope", rope_theta=100.0)),
    # issue 42's leftover: latent attention by head, its down projections and norms replicated
    "multi_head_latent_attention": (
        "float64", dict(d_in=6, num_heads=8, kv_lora_rank=5, qk_nope_head_dim=2,
                        qk_rope_head_dim=4, v_head_dim=3, q_lora_rank=7, d_out=5,
                        attention_bias=True, rope_theta=100.0)),
    "multi_head_latent_attention-no_lora": (
        "float32", dict(d_in=6, num_heads=8, kv_lora_rank=5, qk_nope_head_dim=2,
                        qk_rope_head_dim=4, v_head_dim=3, d_out=5, rope_theta=100.0,
                        rope_interleaved=False)),
}
HEAD_PARALLEL = {"multi_head_attention", "grouped_query_attention", "multi_head_latent_attention"}


def _module_inputs(variant, config, rng, dtype):
    """Fresh inputs (B, L, width) for ``config``, L = 7 (Lq = 6, Lk = 7 for cross-attention),
    and a bool mask (B, Lq, Lk)."""
    keyed = any(i.side == "key" for i in variant.inputs)
    lengths = {"query": 6 if keyed else 7, "key": 7}
    arrays = {i.name: rng.standard_normal((B, lengths[i.side], config[i.width])).astype(dtype)
              for i in variant.inputs if not i.optional}
    arrays["mask"] = rng.random((B, lengths["query"], lengths["key"])) < 0.8
    return arrays


def _module_run(module, arrays, seed, text=False):
    """(output, {name or parameter path: gradient} of Σ output ⊙ dO for the float inputs and
    the parameters, dO drawn from ``seed`` inside the program, and with ``text`` the compiled
    forward's text), jitted."""
    variant = variants.get(module.variant)
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    floats = {n: a for n, a in arrays.items() if jnp.issubdtype(a.dtype, jnp.floating)}
    others = {n: a for n, a in arrays.items() if n not in floats}

    def forward(floats, others, params, rest):
        args, kwargs = variant.call_args({**others, **floats})
        return nnx.merge(graphdef, params, rest)(*args, **kwargs)

    def loss(floats, others, params, rest):
        out = forward(floats, others, params, rest)
        return jnp.sum(out * jax.random.normal(jax.random.key(seed), out.shape, out.dtype)), out

    run = jax.jit(jax.grad(loss, argnums=(0, 2), has_aux=True))
    (g_in, g_params), out = run(floats, others, params, rest)
    grads = {**g_in, **{".".join(map(str, p)): v.get_value()
                        for p, v in nnx.to_flat_state(g_params)}}
    program = jax.jit(forward).lower(floats, others, params, rest) if text else None
    return out, grads, program and program.compile().as_text()


@functools.cache
def _module_reference(case):
    """(seed, parameters, inputs, single-device output, gradients) of a case, computed once for
    both mesh kinds; random neutral-layout parameters (build draws nothing, so compiles no
    initialiser)."""
    dtype, config = MODULE_CASES[case]
    variant = variants.get(case.split("-")[0])
    rng, seed = fresh_rng()
    params = {n: (rng.standard_normal(shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1))
              .astype(dtype) for n, shape in variant.param_shapes(config).items()}  # W (…, in, out)
    arrays = _module_inputs(variant, config, rng, dtype)
    if "num_kv_heads" in config:  # GroupedQueryAttention: right padding too
        arrays["query_seq_lengths"] = rng.integers(1, 8, (B,)).astype(np.int32)
    with jax.enable_x64(dtype == "float64"):
        out, grads, _ = _module_run(_build(variant.name, config, params),
                                    {n: jax.device_put(a) for n, a in arrays.items()}, seed)
    return seed, params, arrays, out, grads


def _build(name, config, params):
    module = jax_attn.build(name, config, params)
    module.eval()  # no dropout
    return module


def _module_params():
    """Every module case on both mesh kinds in the whole matrix (ATTN_PARITY_MATRIX=1); in the
    quick suite one, head-parallel grouped-query attention with issue 23's options (norms,
    gate, temperature, sinks, chunks) on explicit axes: each sharded compilation costs
    seconds here."""
    return one([pytest.param(kind, case, id=f"{kind}-{case}") for case in MODULE_CASES
                for kind in KINDS], "explicit-grouped_query_attention-options")


@pytest.mark.parametrize("kind, case", _module_params())
def test_module_sharded_equals_one_device(kind, case):
    mesh = _mesh(kind)
    dtype, config = MODULE_CASES[case]
    name = case.split("-")[0]
    seed, params, arrays, out1, g1 = _module_reference(case)
    with jax.enable_x64(dtype == "float64"):
        module = shard_module(_build(name, config, params), mesh)
        put = {n: jax.device_put(a, NamedSharding(mesh, BATCH)) for n, a in arrays.items()}
        out, grads, text = _module_run(module, put, seed, text=True)
    _equal(out, out1, dtype)
    _sharded_like(out, mesh, BATCH)
    zero = set() if config.get("rope_theta") else {"W_key.bias"}  # b_key: zero by structure
    assert {"b_key"} == ZERO_GRADS
    terms = B * arrays["mask"].shape[-2] * arrays["mask"].shape[-1]  # a parameter's sum: B·Lq·Lk
    for n, g in grads.items():
        _equal(g, g1[n], dtype, "grad", terms=1 if n in arrays else terms,
               zero=any(n.endswith(z) for z in zero))
    specs = layer_specs(module, mesh)
    for (path, what), spec in specs.items():  # the parameters where the layout puts them
        param = getattr(dict(nnx.iter_graph(module))[tuple(_path(path))], what)
        _sharded_like(param.get_value(), mesh, spec)
    split = name in HEAD_PARALLEL
    assert (specs.get(("out_proj", "kernel")) == P("model", None)) == split
    # The forward's one collective: the row-parallel output projection's all-reduce of
    # (B / 2, L, d_out) over "model"; modules without heads to split have none. An output norm
    # over all heads (BitNet's) adds one more: the all-reduce of each token's sum of squares
    # (B / 2, L), its heads on several devices.
    local_out = f"[{B // DATA},{','.join(map(str, out.shape[1:]))}]"
    statistics = f"[{B // DATA},{out.shape[1]}]" if config.get("output_norm") == "rms" else None
    found = _collectives(text)
    assert all(op == "all-reduce" and (local_out in shape or statistics and shape.endswith(
        statistics + "{1,0}")) for op, shape in found), found
    assert sum(local_out in shape for _, shape in found) == split, found
    assert bool(found) == split, f"{case} on {mesh}: {found}, seed {seed}"


def _path(dotted):
    """"heads.0.W_query" -> ("heads", 0, "W_query"): the path as nnx.iter_graph gives it."""
    return [int(p) if p.isdigit() else p for p in dotted.split(".")]


def test_layer_specs_are_megatrons(mesh):
    config = dict(d_in=6, num_heads=8, num_kv_heads=2, head_dim=3, qkv_bias=True, out_bias=True)
    shapes = variants.get("grouped_query_attention").param_shapes(config)
    gqa = _build("grouped_query_attention", config,
                 {n: np.ones(shape, np.float32) for n, shape in shapes.items()})
    specs = layer_specs(gqa, mesh)
    assert specs == {
        ("W_query", "kernel"): P(None, "model"), ("W_query", "bias"): P("model"),  # column
        ("W_key", "kernel"): P(), ("W_key", "bias"): P(),  # 2 kv heads for 4 devices: whole
        ("W_value", "kernel"): P(), ("W_value", "bias"): P(),
        ("out_proj", "kernel"): P("model", None), ("out_proj", "bias"): P()}  # row
    assert all(s == P() for s in layer_specs(gqa, mesh, model=None).values())  # data parallel
    shard_module(gqa, mesh)
    read = nnx.get_partition_spec(nnx.state(gqa))  # Flax reads the layout back
    assert read["W_query"]["kernel"].get_value() == P(None, "model")


def test_latent_attention_is_split_by_head(mesh):
    """MultiHeadLatentAttention: the per-head projections W_q_b and W_kv_b column-parallel,
    out_proj row-parallel; the down projections W_q_a and W_kv_a (latent and rope part) and the
    latents' norms, which every head reads whole, replicated."""
    config = dict(d_in=6, num_heads=8, kv_lora_rank=5, qk_nope_head_dim=2, qk_rope_head_dim=4,
                  v_head_dim=3, q_lora_rank=7, attention_bias=True, rope_theta=100.0)
    shapes = variants.get("multi_head_latent_attention").param_shapes(config)
    mla = _build("multi_head_latent_attention", config,
                 {n: np.ones(shape, np.float32) for n, shape in shapes.items()})
    assert layer_specs(mla, mesh) == {
        ("W_q_a", "kernel"): P(), ("W_q_a", "bias"): P(),
        ("W_q_b", "kernel"): P(None, "model"),
        ("W_kv_a", "kernel"): P(), ("W_kv_a", "bias"): P(),
        ("W_kv_b", "kernel"): P(None, "model"),
        ("out_proj", "kernel"): P("model", None), ("out_proj", "bias"): P()}
    shard_module(mla, mesh)
    read = nnx.get_partition_spec(nnx.state(mla))
    assert read["W_kv_b"]["kernel"].get_value() == P(None, "model")
    for norm in ("q_a_norm", "kv_a_norm"):
        _sharded_like(getattr(mla, norm).get_value(), mesh, P())


@matrix  # a program compiled on 8 devices: the whole matrix (see above)
@pytest.mark.parametrize("kind", KINDS)
def test_latent_attention_absorbed_sharded_equals_one_device(kind):
    """absorb=True on the layout above (W_kv_b's halves read per head from its column-split
    kernel): the one-device output at float64, and the forward's one all-reduce."""
    mesh = _mesh(kind)
    config = MODULE_CASES["multi_head_latent_attention"][1]
    rng, seed = fresh_rng()
    params = {n: rng.standard_normal(shape) / np.sqrt(shape[0])
              for n, shape in variants.get("multi_head_latent_attention").param_shapes(
                  config).items()}
    x = rng.standard_normal((B, 7, config["d_in"]))
    step = jax.jit(lambda m, x: m(x, absorb=True))
    with jax.enable_x64(True):
        one = step(_build("multi_head_latent_attention", config, params), jax.device_put(x))
        module = shard_module(_build("multi_head_latent_attention", config, params), mesh)
        put = jax.device_put(x, NamedSharding(mesh, BATCH))
        out = step(module, put)
        found = _collectives(step.lower(module, put).compile().as_text())
    _equal(out, one, "float64")
    _sharded_like(out, mesh, BATCH)
    assert [op for op, _ in found] == ["all-reduce"], f"{found}, seed {seed}"


def _abstract(cls, *args, **kwargs):
    """A module's structure without weights (nnx.eval_shape draws nothing, compiles nothing):
    enough for the checks, which run before any array moves."""
    return nnx.eval_shape(lambda: cls(*args, **kwargs, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("make, mesh, model, message", [
    (lambda: _abstract(jax_attn.MultiHeadAttention, 6, 12, 6), "explicit", "model",
     "num_heads should be a multiple of the size of mesh axis 'model', 4, to split "
     "MultiHeadAttention by head, got 6"),
    (lambda: _abstract(jax_attn.GroupedQueryAttention, 6, 12, 3, head_dim=2), "auto", "model",
     "num_kv_heads should divide or be a multiple of the size of mesh axis 'model', 4, got 3"),
    (lambda: _abstract(jax_attn.MultiHeadLatentAttention, 6, 6, 5, 2, 4, 3), "auto", "model",
     "num_heads should be a multiple of the size of mesh axis 'model', 4, to split "
     "MultiHeadLatentAttention by head, got 6"),
    (lambda: _abstract(jax_attn.SelfAttention, 6, 5), "explicit", "heads",
     r"model should be one of the mesh's axes \('data', 'model'\) or None, got 'heads'"),
    (lambda: _abstract(jax_attn.SelfAttention, 6, 5), "a mesh", "model",
     r"mesh should be a jax.sharding.Mesh \(jax.make_mesh\), got str"),
    (object, "auto", "model",
     r"module should be a jax_attn variant \(a flax.nnx.Module\), got builtins.object"),
])
def test_shard_module_bad_input(make, mesh, model, message):
    with pytest.raises(ValueError, match=message):
        shard_module(make(), _mesh(mesh) if mesh in KINDS else mesh, model=model)

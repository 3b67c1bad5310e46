"""Ring attention (jax_attn.ring_attention) on 8 virtual CPU devices: the sequence sharded over
a mesh axis gives the single-device core's output and gradients (float64 to 1e-12, float32 by
the tolerance table) in each layout, causal or not, with GQA and MQA, soft-capping, windows,
offsets, lengths and Lq ≠ Lk, on a mesh of 8 and on 2 × 4 meshes (auto and explicit axes) that
shard the batch or the heads too; attention sinks and chunks (dL/dsinks summed over devices,
blocks outside the chunks skipped); keys past the lengths are never read; the compiled programs
move K and V by collective-permutes, gather nothing, and send exactly the bytes of
bench/ring_comm.py's formula; the zig-zag layout gives every device the same causal work; bad
arguments.

Shape legend: B batch, H query heads, Hkv key-value heads, L sequence length (Lq, Lk), Dk key
width, Dv value width, P devices along the sequence.
"""

from __future__ import annotations

import importlib.util
import math
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jax_attn
from golden.specification import decoder
from golden.specification.tolerances import compare
from jax_attn import ring
from tests.helpers import count_compiles, fresh_rng, matrix, one

B, H, HKV, L, DK, DV = 2, 4, 2, 64, 8, 6  # G = 2; zig-zag chunks of L / 16 = 4 on 8 devices
ROOT = Path(__file__).resolve().parents[2]


def _mesh(axes, explicit=False):
    """A mesh of the first devices, {name: size} in order: a classic Mesh (auto axes), or
    jax.make_mesh's (explicit axes, JAX's default)."""
    sizes = tuple(axes.values())
    if explicit:
        return jax.make_mesh(sizes, tuple(axes), devices=jax.devices()[:math.prod(sizes)])
    return Mesh(np.array(jax.devices()[:math.prod(sizes)]).reshape(sizes), tuple(axes))


def _inputs(rng, lq=L, lk=L, heads=(H, HKV), dv=DV):
    """q (B, H, Lq, Dk), k (B, Hkv, Lk, Dk), v (B, Hkv, Lk, Dv), float64 NumPy."""
    return [rng.standard_normal(s) for s in
            ((B, heads[0], lq, DK), (B, heads[1], lk, DK), (B, heads[1], lk, dv))]


def _program(fn):
    """jit of (q, k, v, positions, dO) -> (output, (dQ, dK, dV)) of Σ O ⊙ dO, the positions
    (offsets, lengths) traced."""
    def run(qkv, positions, d_out):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **positions), *qkv)
        return out, vjp(d_out)
    return jax.jit(run)


# (mesh, ring_attention's own arguments, the core's arguments, input shapes)
CASES = {
    "contiguous_mha": ({"seq": 8}, dict(layout="contiguous"), dict(scale=0.6),
                       dict(heads=(H, H))),
    # batch row 1's keys past its length 40 are NaN for the ring (whole chunks of 4 and blocks
    # of 2): a block read that should have been skipped poisons the output
    "zigzag_causal_softcap_window_offsets_lengths": (
        {"seq": 8}, dict(block_sizes=(2, 3)),
        dict(is_causal=True, softcap=2.0, local_window_size=(13, 2), query_offset=[3, 0],
             query_seq_lengths=[60, 64], key_value_seq_lengths=[64, 40]), {}),
    "contiguous_cross_window_mqa": (
        {"seq": 8}, dict(layout="contiguous"),
        dict(local_window_size=(5, 9), query_offset=[16, 30], key_value_seq_lengths=[56, 64]),
        dict(lq=32, heads=(H, 1))),
    "zigzag_ordered_causal_window": ({"seq": 8}, dict(layout="zigzag_ordered"),
                                     dict(is_causal=True, local_window_size=(20, 0)), {}),
    "data2_seq4_zigzag_causal_lengths": (
        {"data": 2, "seq": 4}, dict(batch_axis="data"),
        dict(is_causal=True, softcap=5.0, key_value_seq_lengths=[64, 24]), {}),
    "heads2_seq4_contiguous_causal_offsets": (
        {"heads": 2, "seq": 4}, dict(layout="contiguous", head_axis="heads", block_sizes=(4, 4)),
        dict(is_causal=True, query_offset=[0, 7]), {}),
}
FLOAT32_CASES = ("zigzag_causal_softcap_window_offsets_lengths",)
EXPLICIT_AXES = ("heads2_seq4_contiguous_causal_offsets",)  # a jax.make_mesh mesh


def _case(name, dtype, rng):
    """The ring's and the dense core's (output, grads) on one case, as float64 NumPy, and the
    ring's compiled program as text."""
    axes, ring_kw, core_kw, shapes = CASES[name]
    mesh = _mesh(axes, explicit=name in EXPLICIT_AXES)
    host = _inputs(rng, **shapes)
    d_out = rng.standard_normal(host[0].shape[:-1] + host[2].shape[-1:])
    positions = {n: np.array(x, "int32") for n, x in core_kw.items() if isinstance(x, list)}
    settings = {n: x for n, x in core_kw.items() if n not in positions}
    with jax.enable_x64(True):
        reference = _program(partial(jax_attn.scaled_dot_product_attention,
                                     implementation="explicit", **settings))(
            [jnp.asarray(x) for x in host], positions, jnp.asarray(d_out))
    given = [x.copy() for x in host] + [d_out]
    if "key_value_seq_lengths" in positions:
        for x in given[1:3]:
            x[1, :, positions["key_value_seq_lengths"][1]:] = np.nan
    ordered = ring_kw.get("layout") == "zigzag_ordered"
    order = ring.zigzag_order(L, axes["seq"]) if ordered else None
    if ordered:  # the tokens in zig-zag order, the output and gradients ordered back
        given = [x[:, :, order] for x in given]
    spec = PartitionSpec(ring_kw.get("batch_axis"), ring_kw.get("head_axis"), "seq", None)
    with jax.enable_x64(dtype == "float64"), jax.set_mesh(mesh):  # explicit axes need it
        fn = _program(partial(jax_attn.ring_attention, mesh=mesh, **ring_kw, **settings))
        arrays = [jnp.asarray(x, dtype) for x in given]
        if len(axes) > 1:  # global arrays already sharded as the ring takes them
            arrays = [jax.device_put(x, NamedSharding(mesh, spec)) for x in arrays]
        args = (arrays[:3], positions, arrays[3])
        compiled = fn.lower(*args).compile()
        out, grads = compiled(*args)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4), out.sharding
    back = (lambda x: x[:, :, np.argsort(order)]) if ordered else (lambda x: x)
    got = jax.tree.map(lambda x: back(np.asarray(x, np.float64)), (out, grads))
    return got, jax.tree.map(lambda x: np.asarray(x, np.float64), reference), compiled.as_text()


def _pairs(got, expected):
    (out, (dq, dk, dv)), (out_e, (dq_e, dk_e, dv_e)) = got, expected
    return [("output", "value", out, out_e), ("grad query", "grad", dq, dq_e),
            ("grad key", "grad", dk, dk_e), ("grad value", "grad", dv, dv_e)]


# One case in the quick suite (the zig-zag ring with the most of the core's arguments: causal,
# soft-cap, window, offsets, lengths), every case in the whole matrix: each compiles a ring on
# 8 devices, seconds apiece, and the quick suite keeps tests/devices8 to one ring and one
# sharded module (tests/devices8/test_mesh.py); the other ring tests below compile too and
# run in the whole matrix.
@pytest.mark.parametrize("name", one([pytest.param(n, id=n) for n in CASES],
                                     "zigzag_causal_softcap_window_offsets_lengths"))
def test_matches_single_device_float64(name):
    # The same maths as the single-device core in another order (per chunk, per ring step):
    # float64 agrees to rounding. The reference is the dense path, which shares no code with
    # the ring's blockwise pieces.
    rng, seed = fresh_rng()
    got, expected, hlo = _case(name, "float64", rng)
    for what, _, a, e in _pairs(got, expected):
        assert a.shape == e.shape, what
        np.testing.assert_allclose(a, e, rtol=1e-12, atol=1e-13, err_msg=f"{what}, seed {seed}")
    # The program moves K and V round the ring and never gathers them on one device.
    assert "collective-permute" in hlo
    assert "all-gather" not in hlo and "all-to-all" not in hlo


@matrix  # a ring compiled on 8 devices: the whole matrix (see above)
@pytest.mark.parametrize("name", FLOAT32_CASES)
def test_matches_single_device_float32(name):
    # float32 ring against the float64 single-device result, by the tolerance table (the
    # reference here is the JAX core in float64, which test_fixtures holds to the NumPy one).
    rng, seed = fresh_rng()
    got, expected, _ = _case(name, "float32", rng)
    comps = {what: compare(a, e, "float32", kind) for what, kind, a, e in _pairs(got, expected)}
    bad = {what: c for what, c in comps.items() if not c.ok}
    assert not bad, f"seed {seed}: {bad}"


@matrix  # a ring compiled on 8 devices: the whole matrix (see above)
def test_new_offsets_and_lengths_do_not_recompile():
    rng, _ = fresh_rng()
    q, k, v = (jnp.asarray(x, "float32") for x in _inputs(rng, dv=DK))
    mesh = _mesh({"seq": 8})
    call = lambda offset, length: jax_attn.ring_attention(  # noqa: E731
        q, k, v, mesh=mesh, layout="contiguous", is_causal=True, query_offset=offset,
        key_value_seq_lengths=length)
    jax.block_until_ready(call(jnp.array([0, 3]), jnp.array([64, 50])))
    with count_compiles() as compiles:
        jax.block_until_ready(call(jnp.array([5, 9]), jnp.array([33, 64])))
    assert compiles == [], compiles


# ---- attention sinks and chunks -----------------------------------------------------------------

SINK_CASES = {  # (mesh, ring_attention's own arguments, the core's arguments)
    # chunks of 12 straddle the zig-zag chunks of 4 and the blocks: key_start matters
    "zigzag_causal_chunks_offsets_softcap": (
        {"seq": 8}, dict(block_sizes=(2, 3)),
        dict(is_causal=True, attention_chunk_size=12, query_offset=[3, 0], softcap=2.0)),
    "heads2_seq4_contiguous_chunks_lengths": (
        {"heads": 2, "seq": 4}, dict(layout="contiguous", head_axis="heads"),
        dict(attention_chunk_size=8, key_value_seq_lengths=[64, 21])),
}


@matrix  # a ring compiled on 8 devices: the whole matrix (see above)
@pytest.mark.parametrize("name", SINK_CASES)
def test_sinks_and_chunks_match_single_device(name):
    # Sinks (H,) start every row's online softmax on each device; dL/dsinks sums every
    # device's rows (sharded with the heads over head_axis). Chunk bounds use global positions.
    rng, seed = fresh_rng()
    axes, ring_kw, core_kw = SINK_CASES[name]
    mesh = _mesh(axes)
    q, k, v = _inputs(rng)
    sinks, d_out = rng.standard_normal(H), rng.standard_normal((B, H, L, DV))
    kw = {n: np.array(x, "int32") if isinstance(x, list) else x for n, x in core_kw.items()}

    def grads(fn):
        def loss(q, k, v, sinks):
            return jnp.sum(fn(q, k, v, sinks=sinks, **kw) * d_out)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)

    with jax.enable_x64(True):
        core = grads(partial(jax_attn.scaled_dot_product_attention, implementation="explicit"))
        with jax.set_mesh(mesh):
            ringed = grads(partial(jax_attn.ring_attention, mesh=mesh, **ring_kw))
    for what, a, e in zip(("loss", "query", "key", "value", "sinks"),
                          (ringed[0], *ringed[1]), (core[0], *core[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-12, atol=1e-13,
                                   err_msg=f"{what}, seed {seed}")


@pytest.mark.parametrize("is_causal, per_head", [(False, 16), (True, 10)])
def test_chunks_of_one_device_keep_the_work_on_it(is_causal, per_head):
    # Contiguous slices of L / P = 8 tokens and chunks of 8: every device's queries see its own
    # keys only, so the K/V blocks from the other devices are skipped by index: per head, the
    # n² = 16 blocks of 2 × 2 of its own pair (n(n+1)/2 = 10 causal), none of the 7 others.
    mesh, heads = _mesh({"seq": 8}), B * H
    q, k = jax.ShapeDtypeStruct((B, H, L, DK), jnp.float32), jax.ShapeDtypeStruct(
        (B, HKV, L, DK), jnp.float32)
    count = ring.blocks_per_device(q, k, k, mesh=mesh, layout="contiguous", is_causal=is_causal,
                                   attention_chunk_size=8, block_sizes=(2, 2))
    np.testing.assert_array_equal(np.asarray(count), heads * per_head)


# ---- a bias of distance only: ALiBi and T5's buckets ---------------------------------------------

def _alibi(rows, span):
    """ALiBi's table m_h · d (H, 2S + 1), d = −S … S, BLOOM's slopes; with ``rows`` B, one per
    batch row (B, H, 2S + 1), the slopes of row b times b + 1 (a table the batch does not
    share)."""
    table = decoder.alibi_slopes(H, "bloom")[:, None] * np.arange(-span, span + 1)
    return table if rows is None else np.stack([(b + 1) * table for b in range(rows)])


def _t5(rng, bidirectional, span):
    """T5's table (H, 2S + 1): random learned biases (32 buckets, H) at the bucket of each
    distance −S … S (max_distance 24): far distances share buckets, and an S below the
    sequence's clips the farthest pairs to the table's ends."""
    learned = rng.standard_normal((32, H))
    return learned[decoder.bucket_table(span, bidirectional, 32, 24)].T


# (mesh, ring_attention's own arguments, the core's arguments, input shapes, the table)
DISTANCE_CASES = {
    # S = Lq + Lk: no distance clipped; offsets move every row's distances
    "zigzag_alibi_causal_offsets": (
        {"seq": 8}, dict(block_sizes=(2, 3)),
        dict(is_causal=True, softcap=2.0, query_offset=[3, 0]), {},
        lambda rng: _alibi(None, 2 * L)),
    # S = 20 < L: pairs farther apart read the table's ends (their gradients summed there)
    "contiguous_t5_bidirectional_cross": (
        {"seq": 8}, dict(layout="contiguous"), dict(query_offset=[16, 30]), dict(lq=32),
        lambda rng: _t5(rng, True, 20)),
    "zigzag_ordered_t5_causal_lengths": (
        {"seq": 8}, dict(layout="zigzag_ordered"),
        dict(is_causal=True, key_value_seq_lengths=[64, 40]), {},
        lambda rng: _t5(rng, False, 20)),
    # a table per batch row (B, H, 2S + 1), sharded with the batch
    "data2_seq4_alibi_per_row_causal": (
        {"data": 2, "seq": 4}, dict(batch_axis="data"), dict(is_causal=True), {},
        lambda rng: _alibi(B, 2 * L)),
    # a shared table (H, 2S + 1): its gradient sums the batch's devices too
    "data2_seq4_t5_shared_window": (
        {"data": 2, "seq": 4}, dict(batch_axis="data"), dict(local_window_size=(9, 30)), {},
        lambda rng: _t5(rng, True, 20)),
    "heads2_seq4_alibi_causal_offsets": (
        {"heads": 2, "seq": 4}, dict(layout="contiguous", head_axis="heads", block_sizes=(4, 4)),
        dict(is_causal=True, query_offset=[0, 7]), {}, lambda rng: _alibi(None, 2 * L)),
}


def _distance_case(name, dtype, rng):
    """The ring's and the one-device explicit core's (output, (dQ, dK, dV, d(distance_bias)))
    of Σ O ⊙ dO on one case, as float64 NumPy, and the ring's compiled program."""
    axes, ring_kw, core_kw, shapes, make = DISTANCE_CASES[name]
    mesh = _mesh(axes)
    host = _inputs(rng, **shapes) + [make(rng)]
    d_out = rng.standard_normal(host[0].shape[:-1] + host[2].shape[-1:])
    kw = {n: np.array(x, "int32") if isinstance(x, list) else x for n, x in core_kw.items()}
    ordered = ring_kw.get("layout") == "zigzag_ordered"
    order = ring.zigzag_order(L, axes["seq"]) if ordered else slice(None)
    back = np.argsort(order) if ordered else slice(None)

    def program(fn, d_out):  # (q, k, v, table) -> (output, vjp of Σ output ⊙ dO)
        def run(*args):
            out, vjp = jax.vjp(lambda q, k, v, t: fn(q, k, v, distance_bias=t, **kw), *args)
            return out, vjp(jnp.asarray(d_out, out.dtype))
        return jax.jit(run)

    with jax.enable_x64(True):
        core = program(partial(jax_attn.scaled_dot_product_attention, implementation="explicit"),
                       d_out)(*host)
    given = [x[:, :, order] for x in host[:3]] + host[3:]  # the tokens in the ring's order
    with jax.enable_x64(dtype == "float64"):
        step = program(partial(jax_attn.ring_attention, mesh=mesh, **ring_kw),
                       d_out[:, :, order])
        args = [jnp.asarray(x, dtype) for x in given]
        compiled = step.lower(*args).compile()
        out, grads = compiled(*args)
    d_table = grads[3]
    out, *grads = (np.asarray(x, np.float64)[:, :, back] for x in (out, *grads[:3]))  # natural
    got = jax.tree.map(lambda x: np.asarray(x, np.float64), (out, (*grads, d_table)))
    return got, jax.tree.map(lambda x: np.asarray(x, np.float64), core), compiled.as_text()


DISTANCE_NAMES = ("output", "query", "key", "value", "distance_bias")


@matrix  # a ring compiled on 8 devices: the whole matrix (see above)
@pytest.mark.parametrize("name", DISTANCE_CASES)
def test_distance_bias_matches_single_device_float64(name):
    # Each pair of chunks reads the table at its global distances (its shifted positions):
    # the one-device explicit core's output and gradients to rounding, d(distance_bias) summed
    # over every device's rows. The table travels whole with the heads: nothing is gathered.
    rng, seed = fresh_rng()
    (out, grads), (out_e, grads_e), hlo = _distance_case(name, "float64", rng)
    for what, a, e in zip(DISTANCE_NAMES, (out, *grads), (out_e, *grads_e)):
        assert a.shape == e.shape, what
        np.testing.assert_allclose(a, e, rtol=1e-12, atol=1e-12, err_msg=f"{what}, seed {seed}")
    assert np.abs(grads_e[3]).max() > 1e-3  # the table's gradient is not trivially zero
    assert "collective-permute" in hlo
    assert "all-gather" not in hlo and "all-to-all" not in hlo


@matrix  # a ring compiled on 8 devices: the whole matrix (see above)
@pytest.mark.parametrize("name", DISTANCE_CASES)
def test_distance_bias_matches_single_device_float32(name):
    # The float32 ring against the float64 one-device core, by the tolerance table.
    rng, seed = fresh_rng()
    (out, grads), (out_e, grads_e), _ = _distance_case(name, "float32", rng)
    comps = {"output": compare(out, out_e, "float32", "value")}
    comps.update({f"grad {what}": compare(a, e, "float32", "grad")
                  for what, a, e in zip(DISTANCE_NAMES[1:], grads, grads_e)})
    bad = {what: c for what, c in comps.items() if not c.ok}
    assert not bad, f"seed {seed}: {bad}"


@matrix  # a ring compiled on 8 devices: the whole matrix (see above)
def test_distance_bias_moves_the_output():
    # The bias reaches the ring: without it the output is far from the biased one.
    rng, _ = fresh_rng()
    q, k, v = (jnp.asarray(x, "float32") for x in _inputs(rng))
    mesh, table = _mesh({"seq": 8}), jnp.asarray(_alibi(None, 2 * L), "float32")
    with_bias, without = (np.asarray(jax_attn.ring_attention(q, k, v, mesh=mesh, is_causal=True,
                                                             distance_bias=t))
                          for t in (table, None))
    assert np.abs(with_bias - without).max() > 0.1


# ---- the compiled program: what it sends -------------------------------------------------------

def _bench():
    """bench/ring_comm.py as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("ring_comm", ROOT / "bench" / "ring_comm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _output_and_grads(f):
    """(q, k, v, dO) -> (O, (dQ, dK, dV)) of Σ O ⊙ dO: a training step needs both (without O
    the output's way back from the zig-zag layout would be dead code)."""
    def run(q, k, v, d_out):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(d_out)
    return run


@matrix  # a ring compiled on 8 devices: the whole matrix (see above)
@pytest.mark.parametrize("layout", ["zigzag", "zigzag_ordered"])
def test_compiled_program_sends_the_formulas_bytes(layout):
    # Read from the compiled forward and forward+backward programs: every collective-permute's
    # bytes, times its loop's trip count, per sending device. The ring's (pairs i -> i + 1) must
    # be P − 1 K/V blocks forward, and P − 1 K/V blocks plus P float32 dK/dV blocks backward;
    # the zig-zag moves as the formula says, and none for zigzag_ordered; nothing gathered,
    # all-to-all'd or all-reduced.
    bench, p = _bench(), 8
    mesh = _mesh({"seq": p})
    x = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    q, k, d_out = x(B, H, L, DK), x(B, HKV, L, DK), x(B, H, L, DK)  # Dv = Dk = D
    f = partial(jax_attn.ring_attention, mesh=mesh, layout=layout, is_causal=True)
    formula = bench.paper(B, H, HKV, L, DK, p, "float32")
    programs = {"forward": (jax.jit(f), (q, k, k)),
                "backward": (jax.jit(_output_and_grads(f)), (q, k, k, d_out))}
    for what, (fn, args) in programs.items():
        sent = bench.collective_bytes(fn.lower(*args).compile().as_text(), p)
        on_ring = sum(size * times for _, size, times, is_ring in sent["ops"] if is_ring)
        ring_bytes = formula["ring_fwd"] + (formula["ring_bwd"] if what == "backward" else 0)
        moves = 0 if layout == "zigzag_ordered" else formula["zigzag_fwd"] * (
            2 if what == "backward" else 1)
        assert on_ring == ring_bytes, (what, sent["ops"])
        assert max(sent["sent"]) - on_ring == moves, (what, sent["ops"])
        assert sent["gathers"] == 0, what
        assert any(times == p - 1 and is_ring for _, _, times, is_ring in sent["ops"]), what


# ---- how the work is spread --------------------------------------------------------------------

@matrix  # a ring compiled on 8 devices: the whole matrix (see above)
def test_zigzag_gives_every_device_the_same_causal_work():
    # Blocks of 2 × 2 scores the forward computes per device (blockwise.visited: the loop
    # bounds the forward runs). Zig-zag, chunks of c = L/2P = 4, n = 2 blocks a side: step 0
    # computes the two diagonal pairs (n(n+1)/2 each) and one full pair (n²), every other step
    # two full pairs; contiguous, chunks of L/P = 8, n = 4: device d computes its diagonal
    # pair and d full pairs. Times B·H heads.
    mesh, heads = _mesh({"seq": 8}), B * H
    q, k = jax.ShapeDtypeStruct((B, H, L, DK), jnp.float32), jax.ShapeDtypeStruct(
        (B, HKV, L, DK), jnp.float32)
    count = lambda layout: np.asarray(ring.blocks_per_device(  # noqa: E731
        q, k, k, mesh=mesh, layout=layout, is_causal=True, block_sizes=(2, 2)))
    n = 2
    np.testing.assert_array_equal(count("zigzag"), heads * (n * (n + 1) + n * n + 7 * 2 * n * n))
    n = 4
    np.testing.assert_array_equal(count("contiguous"),
                                  heads * (n * (n + 1) // 2 + np.arange(8) * n * n))


# ---- bad arguments -----------------------------------------------------------------------------

def _struct(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


BAD = [  # (arguments changed from a valid call, the message expected)
    (dict(mask=np.ones((L, L), bool)), r"ring_attention takes no mask .* got an array of shape "
                                       r"\(64, 64\)"),
    (dict(bias=np.zeros((L, L), "float32")), r"takes no bias"),
    (dict(dropout_rate=0.1), r"no dropout: dropout_rate should be 0.0, got 0.1"),
    (dict(query=_struct(H, L, DK), key=_struct(HKV, L, DK), value=_struct(HKV, L, DV)),
     r"query should have rank 4, \(B, H, Lq, Dk\), for ring_attention, got shape \(4, 64, 8\)"),
    (dict(query=_struct(B, H, 60, DK)),
     r"query length Lq should be a multiple of 2·P = 16 \(layout 'zigzag', P = 8 devices on "
     r"axis 'seq'\), got 60"),
    (dict(key=_struct(B, HKV, 36, DK), value=_struct(B, HKV, 36, DV), layout="contiguous"),
     r"key length Lk should be a multiple of P = 8 \(layout 'contiguous'.*got 36"),
    (dict(axis="sequence"), r"axis should be one of the mesh's axes \('seq',\), got 'sequence'"),
    (dict(batch_axis="seq"), r"should be different mesh axes, got 'seq', 'seq', None"),
    (dict(mesh={"data": 2, "seq": 4}, batch_axis="data", query=_struct(3, H, L, DK),
          key=_struct(3, HKV, L, DK), value=_struct(3, HKV, L, DV)),
     r"query batch B should be a multiple of the 2 devices on axis 'data', got 3"),
    (dict(mesh={"heads": 4, "seq": 2}, head_axis="heads"),
     r"key heads Hkv should be a multiple of the 4 devices on axis 'heads', got 2"),
    (dict(layout="striped"),
     r"layout should be one of 'zigzag', 'contiguous', 'zigzag_ordered', got 'striped'"),
    (dict(key=_struct(B, HKV, L, 5)), r"key shape should be \(B, Hkv, Lk, Dk\) = \(2, \?, \?, 8\)"),
    (dict(softcap=0), r"softcap should be a positive number or None, got 0"),
    (dict(block_sizes=(0, 4)), r"block_sizes should be None or a pair"),
    (dict(sinks=_struct(HKV)), r"sinks shape should be \(H,\) = \(4,\), got \(2,\)"),
    (dict(attention_chunk_size=0), r"attention_chunk_size should be None or an int ≥ 1, got 0"),
    (dict(distance_bias=_struct(HKV, 129)),
     r"distance_bias shape should be \(H, D\) = \(4, \?\), got \(2, 129\)"),
    (dict(distance_bias=_struct(H, 128)),
     r"distance_bias's last axis D should be odd .* got D = 128"),
]


@pytest.mark.parametrize("change, message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_arguments_name_what_was_expected(change, message):
    args = dict(query=_struct(B, H, L, DK), key=_struct(B, HKV, L, DK),
                value=_struct(B, HKV, L, DV), mesh={"seq": 8})
    args.update(change)
    args["mesh"] = _mesh(args["mesh"])
    with pytest.raises(ValueError, match=message):
        jax_attn.ring_attention(**args)


def test_a_mesh_that_is_not_one_is_a_type_error():
    with pytest.raises(TypeError, match=r"mesh should be a jax.sharding.Mesh, got dict"):
        jax_attn.ring_attention(_struct(B, H, L, DK), _struct(B, HKV, L, DK),
                                _struct(B, HKV, L, DV), mesh={"seq": 8})

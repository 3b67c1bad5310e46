"""The JAX core's speed-minded paths compute the same function: "explicit"'s query tiles (each
block of query rows against only the keys the causal bound, window or chunks let it see), and
implementation=None's split passes (the chosen forward, "blockwise"'s gradient)."""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import golden
import jax_attn
from golden import reference, runners
from golden.specification import variants
from golden.specification.implementations import record
from golden.reference import allowed_positions
from golden.specification.tolerances import compare, compare_terms
from jax_attn import blockwise, explicit, functional
from tests.helpers import JAX, fixture_of, fixture_sweep, fresh_rng, sweep
from tests.test_blockwise import _grads

SDPA_FIXTURES = [n for n in golden.names() if fixture_of(n).variant == variants.SDPA]


def _static(is_causal=False, window=(None, None), chunk=None):
    return blockwise.Static(1.0, is_causal, None, window, 0.0, None, 1, 1, chunk_size=chunk)


@pytest.fixture(autouse=True)
def split_at_any_size(monkeypatch):
    """The split passes at these tests' tiny sizes too (implementation=None splits above
    functional.SPLIT_ABOVE scores; test_split_only_above_its_threshold keeps the real one)."""
    monkeypatch.setattr(functional, "SPLIT_ABOVE", 0)


@pytest.fixture
def tiny_tiles(monkeypatch):
    """Tiles of 2 query rows, used whenever they skip anything, so the fixtures' 5–9 rows span
    several; traced programs are dropped before and after (the tile size is read at trace time)."""
    monkeypatch.setattr(explicit, "TILE_ROWS", (2, 2))
    monkeypatch.setattr(explicit, "TILED_AT_MOST", 1.0)
    jax.clear_caches()
    yield
    jax.clear_caches()


@pytest.mark.parametrize("lq, lk", [(5, 5), (7, 5), (5, 9), (9, 9), (1, 6), (30, 17)])
@pytest.mark.parametrize("rules", [dict(is_causal=True), dict(window=(2, 0)), dict(window=(1, 3)),
                                   dict(window=(None, 1)), dict(chunk=3),
                                   dict(is_causal=True, window=(3, None), chunk=4),
                                   dict(window=(0, 0))])
def test_tiles_cover_every_allowed_key_and_each_row_once(monkeypatch, lq, lk, rules):
    monkeypatch.setattr(explicit, "TILE_ROWS", (2, 2))
    found = explicit.tiles(lq, lk, None, _static(**rules))
    rows = [r for a, b, _, _ in found for r in range(a, b)]
    assert rows == list(range(lq))  # in order, each once
    allowed = allowed_positions((lq, lk), is_causal=rules.get("is_causal", False),
                                local_window_size=rules.get("window"),
                                attention_chunk_size=rules.get("chunk"))
    for a, b, lo, hi in found:
        assert 0 <= lo < hi <= lk
        outside = np.ones(lk, bool)
        outside[lo:hi] = False
        assert not allowed[a:b, outside].any(), (a, b, lo, hi)


def test_tiles_skip_the_masked_half_and_only_with_static_positions():
    causal = _static(is_causal=True)
    assert explicit.tiles(1024, 1024, None, causal) == [(0, 256, 0, 256), (256, 512, 0, 512),
                                                        (512, 768, 0, 768), (768, 1024, 0, 1024)]
    assert explicit.tiles(512, 512, None, causal) == [(0, 128, 0, 128), (128, 256, 0, 256),
                                                      (256, 384, 0, 384), (384, 512, 0, 512)]
    assert explicit.tiles(256, 1024, None, causal) == [(0, 128, 0, 128), (128, 256, 0, 256)]
    # top-left aligned: 3/16 of the scores
    assert explicit.tiles(1024, 1024, jnp.int32(3), causal) == [(0, 1024, 0, 1024)]  # traced
    assert explicit.tiles(1024, 1024, None, _static()) == [(0, 1024, 0, 1024)]  # nothing to skip
    assert explicit.tiles(160, 160, None, causal) == [(0, 160, 0, 160)]  # one tile, all keys
    assert explicit.tiles(300, 300, None, causal) == [(0, 150, 0, 150), (150, 300, 0, 300)]


# One dtype each keeps the file fast: float64 (1e-13) for the forward and its weights, float32
# (the tightest test of the backward's arithmetic, as in tests/test_blockwise.py) for the split.
def _fixture_sweep(dtype):
    """Every core fixture at ``dtype``: a covering few in the quick suite (tests/helpers.py
    ``sweep``), all in the whole matrix."""
    return fixture_sweep([(n, dtype) for n in SDPA_FIXTURES])


@pytest.mark.parametrize("name, dtype", _fixture_sweep("float64"))
def test_tiled_explicit_matches_reference(tiny_tiles, name, dtype):
    fixture = golden.load(name)
    config = variants.get(fixture.variant).config(fixture.config)
    with jax.enable_x64(dtype == "float64"):
        out, weights = jax_attn.scaled_dot_product_attention(
            **JAX.arrays(fixture.inputs, dtype), **config, implementation="explicit",
            return_weights=True)
        comps = {"output": compare(JAX.numpy(out), fixture.expected["output"], dtype),
                 "weights": compare(JAX.numpy(weights), fixture.expected["weights"], dtype)}
    bad = {what: c for what, c in comps.items() if not c.ok}
    assert not bad, f"tiled explicit {dtype} {name}: {bad}"


def test_tiled_program_never_forms_the_whole_causal_matrix():
    x = jax.ShapeDtypeStruct((1, 2, 1024, 8), jnp.float32)
    text = jax.jit(partial(jax_attn.scaled_dot_product_attention, is_causal=True,
                           implementation="explicit")).lower(x, x, x).as_text()
    shapes = set(re.findall(r"tensor<(?:\d+x)*(\d+x\d+)xf32>", text))
    assert "256x256" in shapes and "1024x1024" not in shapes
    full = jax.jit(partial(jax_attn.scaled_dot_product_attention,
                           implementation="explicit")).lower(x, x, x).as_text()
    assert "1024x1024xf32" in full  # the same check sees the whole matrix when it is formed


def _grad_program(length, **kw):
    x = jax.ShapeDtypeStruct((1, 2, length, 8), jnp.float32)
    loss = lambda q, k, v: jnp.sum(jax_attn.scaled_dot_product_attention(q, k, v, **kw))  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).as_text()


def test_split_backward_is_unrolled_only_with_static_positions_and_small_blocks():
    """The split backward's blocks are straight-line code when the positions are static and
    (Lq', Lk') is at most blockwise.UNROLL_AT_MOST entries; a traced offset or a longer
    sequence keeps the loops."""
    assert "while" not in _grad_program(1024, is_causal=True)
    assert "while" not in _grad_program(512)
    assert "while" in _grad_program(512, is_causal=True, query_offset=0)
    assert "while" in _grad_program(2048, is_causal=True)  # blockwise, (Lq', Lk') > 2^20


@pytest.mark.parametrize("name, dtype", _fixture_sweep("float32"))
def test_split_passes_match_reference(tiny_tiles, name, dtype):
    """implementation=None's gradients (explicit's tiled forward saving the statistics,
    blockwise's backward) against the reference, on every core fixture. The gradients are
    held to compare_terms (the table, or failing it the same bounds relative to the size of
    the terms each element sums): the backward recomputes each score from q and k, and on
    sdpa_large_logits (scores of about 3e3, so an ulp of one is 2.4e-4) the forward's and the
    backward's products round apart on an AVX2 host (AMD EPYC, Zen 3 class, 2026-11-25: query
    and key gradients max 8.7e-6, 1.7-3x the table's elementwise bound), as they did not on
    the AVX-512 host before it. "large logits' large operands" is one of compare_terms' cases."""
    fixture = golden.load(name)
    config = variants.get(fixture.variant).config(fixture.config)
    expected = runners.run_reference(fixture, weights_cotangent=False)["grads"]
    sizes = _term_sizes(fixture)
    with jax.enable_x64(dtype == "float64"), record() as ran:
        out, grads = _grads(jax_attn.scaled_dot_product_attention,
                            JAX.arrays(fixture.inputs, dtype),
                            jnp.asarray(fixture.cotangents["output"], "float32"), **config)
    assert ran == [("jax", "explicit"), ("jax", "blockwise")]
    comps = {"output": compare(out, fixture.expected["output"], dtype)}
    terms = {n: fixture.expected["weights"].size // fixture.inputs[n].size
             for n in ("bias", "sinks") if n in grads}
    comps.update({f"grad {n}": compare_terms(g, expected[n], sizes[n], dtype, "grad",
                                             terms=terms.get(n, 1))
                  for n, g in grads.items()})
    bad = {what: c for what, c in comps.items() if not c.ok}
    assert not bad, f"split passes {dtype} {name}: {bad}"


def _term_sizes(fixture):
    """golden.reference.sdpa_term_sizes of the fixture's gradients of Σ O ⊙ dO (float64)."""
    inputs = {n: (a.astype(np.float64) if a.dtype.kind == "f" else a)
              for n, a in fixture.inputs.items()}
    forward, _ = reference.VARIANTS[fixture.variant]
    _, weights, saved = forward(fixture.config, inputs, fixture.params)
    return reference.sdpa_term_sizes(saved, fixture.cotangents["output"].astype(np.float64),
                                     np.zeros_like(weights))


def _loss(implementation, **kw):
    def loss(q, k, v, bias):
        out = jax_attn.scaled_dot_product_attention(q, k, v, bias=bias,
                                                    implementation=implementation, **kw)
        return jnp.sum(jnp.sin(out))
    return loss


@pytest.mark.parametrize("kw", [dict(), dict(is_causal=True, local_window_size=(4, None)),
                                dict(sinks=True), dict(dropout_mask=True),
                                dict(dropout_rate=0.5)])
def test_none_runs_the_chosen_forward_and_differentiates_with_blockwise(kw):
    rng, seed = fresh_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((2, 4, 12, 8)), jnp.float32) for _ in range(3))
    bias = jnp.asarray(rng.standard_normal((4, 12, 12)), jnp.float32)
    if kw.get("sinks"):
        kw = dict(sinks=jnp.asarray(rng.standard_normal(4), jnp.float32))
    if kw.get("dropout_mask"):
        kw = dict(dropout_rate=0.5, dropout_mask=jnp.asarray(rng.random((2, 4, 12, 12)) < 0.5))
    elif "dropout_rate" in kw:
        kw = dict(kw, dropout_rng=jax.random.key(seed))  # explicit draws the same mask
    with record() as ran:
        out = jax_attn.scaled_dot_product_attention(q, k, v, bias=bias, **kw)
    explicit_out = jax_attn.scaled_dot_product_attention(q, k, v, bias=bias,
                                                         implementation="explicit", **kw)
    assert ran == [("jax", "explicit")]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(explicit_out))  # the same program
    with record() as ran:
        grads = jax.grad(_loss(None, **kw), argnums=(0, 1, 2, 3))(q, k, v, bias)
    assert ran == [("jax", "explicit"), ("jax", "blockwise")]
    jax_ad = jax.grad(_loss("explicit", **kw), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for g, s in zip(grads, jax_ad):
        np.testing.assert_allclose(np.asarray(g), np.asarray(s), atol=2e-6, rtol=1e-5,
                                   err_msg=f"seed {seed}")


SPLIT_RULES = [dict(is_causal=True), dict(local_window_size=(None, 1)),
               dict(attention_chunk_size=4), dict(is_causal=True, local_window_size=(2, None))]
SPLIT_EXTRAS = ["bias", "kv_lengths", "sinks", "dropout_mask", "distance_bias", "mask"]
# Each rule and each extra at least once in the quick suite, every pair in the whole matrix.
SPLIT_CASES = [(e, i) for e in SPLIT_EXTRAS for i in range(len(SPLIT_RULES))]


@pytest.mark.parametrize("extra, rules", sweep(
    [pytest.param(e, SPLIT_RULES[i], id=f"{e}-rules{i}") for e, i in SPLIT_CASES],
    [{("extra", e), ("rules", i)} for e, i in SPLIT_CASES]))
def test_split_backward_over_only_the_keys_some_tile_sees(tiny_tiles, rules, extra):
    """Where no query row sees the last keys (Lq = 6 of Lk = 16 here), the split backward runs
    on the keys the tiles see and pads the rest of dK, dV and d(bias) with zeros: against JAX's
    own derivative of explicit, with each extra that is sliced or shifted with the keys."""
    rng, seed = fresh_rng()
    lq, lk = 6, 16
    static = _static(rules.get("is_causal", False), rules.get("local_window_size", (None, None)),
                     rules.get("attention_chunk_size"))
    found = explicit.tiles(lq, lk, None, static)
    assert max(hi for *_, hi in found) < lk  # the cut this test is about
    q = jnp.asarray(rng.standard_normal((2, 3, lq, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 3, lk, 8)), jnp.float32) for _ in range(2))
    shape = (3, lq, lk) if extra == "bias" else (1, 1, lk)  # else a bias over keys
    bias = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    kw = dict(rules)
    if extra == "kv_lengths":
        kw["key_value_seq_lengths"] = jnp.asarray([3, 16], jnp.int32)
    elif extra == "sinks":
        kw["sinks"] = jnp.asarray(rng.standard_normal(3), jnp.float32)
    elif extra == "dropout_mask":
        kw.update(dropout_rate=0.5, dropout_mask=jnp.asarray(rng.random((2, 3, lq, lk)) < 0.5))
    elif extra == "distance_bias":
        kw["distance_bias"] = jnp.asarray(rng.standard_normal((3, 2 * 5 + 1)), jnp.float32)
    elif extra == "mask":
        kw["mask"] = jnp.asarray(rng.random((2, 1, lq, lk)) < 0.7)
    with record() as ran:
        grads = jax.grad(_loss(None, **kw), argnums=(0, 1, 2, 3))(q, k, v, bias)
    assert ran == [("jax", "explicit"), ("jax", "blockwise")]
    jax_ad = jax.grad(_loss("explicit", **kw), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for name, g, s in zip("qkvb", grads, jax_ad):
        np.testing.assert_allclose(np.asarray(g), np.asarray(s), atol=2e-6, rtol=1e-5,
                                   err_msg=f"d{name}, seed {seed}")


def test_split_backward_of_one_query_on_one_key_keeps_the_bias_shape():
    """Causal with one query (static positions): the tile sees key 0 alone, so the backward
    runs on one key; a bias over all the keys still gets a gradient of its own shape."""
    rng, seed = fresh_rng()
    q = jnp.asarray(rng.standard_normal((2, 3, 1, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 3, 9, 8)), jnp.float32) for _ in range(2))
    bias = jnp.asarray(rng.standard_normal((1, 1, 9)), jnp.float32)
    grads = jax.grad(_loss(None, is_causal=True), argnums=(0, 1, 2, 3))(q, k, v, bias)
    jax_ad = jax.grad(_loss("explicit", is_causal=True), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for name, g, s in zip("qkvb", grads, jax_ad):
        assert g.shape == s.shape, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(s), atol=2e-6, rtol=1e-5,
                                   err_msg=f"d{name}, seed {seed}")


@pytest.mark.parametrize("lq, lk, kw, split", [
    (128, 128, dict(), False),  # 4·8·128² = 2^19 (the bench's L = 128 rows)
    (512, 512, dict(), True),  # 2^23
    (512, 512, dict(is_causal=True), True),  # its two tiles cover 3/4: 3·2^21
    (256, 1024, dict(), True),  # 2^23
    (256, 1024, dict(is_causal=True), False),  # one tile of 256 keys: 2^21
])
def test_split_only_above_its_threshold(monkeypatch, lq, lk, kw, split):
    """implementation=None differentiates explicit with blockwise's backward only when explicit
    forms more than functional.SPLIT_ABOVE = 2^22 scores over all heads (B = 4, H = 8 here),
    counted in its tiles; else JAX's derivative (record lists explicit alone)."""
    monkeypatch.undo()  # the real threshold
    assert functional.SPLIT_ABOVE == 2**22
    q, kv = (jax.ShapeDtypeStruct((4, 8, n, 8), jnp.float32) for n in (lq, lk))
    loss = lambda q, k: jnp.sum(jax_attn.scaled_dot_product_attention(q, k, k, **kw))  # noqa: E731
    jax.clear_caches()  # record() sees what is traced
    with record() as ran:
        jax.jit(jax.grad(loss)).lower(q, kv)
    assert ran == [("jax", "explicit")] + ([("jax", "blockwise")] if split else [])


def test_no_split_where_the_weights_are_asked_for():
    """Blockwise never forms the weights: explicit's own (JAX's) gradient."""
    rng, _ = fresh_rng()
    q = jnp.asarray(rng.standard_normal((2, 12, 8)), jnp.float32)

    def loss(q):
        out, weights = jax_attn.scaled_dot_product_attention(q, q, q, return_weights=True)
        return jnp.sum(jnp.sin(out)) + jnp.sum(weights ** 2)

    with record() as ran:
        grad = jax.grad(loss)(q)
    assert ran == [("jax", "explicit")]
    assert np.isfinite(np.asarray(grad)).all()


def test_forward_mode_needs_explicit_by_name():
    """The split passes are a custom_vjp (reverse mode only); explicit by name keeps JAX's own
    derivative, so jax.jvp works there and agrees with the reverse-mode gradient."""
    rng, seed = fresh_rng()
    q = jnp.asarray(rng.standard_normal((2, 6, 4)), jnp.float32)
    t = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def f(implementation):
        return lambda q: jnp.sum(jnp.sin(jax_attn.scaled_dot_product_attention(
            q, q, q, is_causal=True, implementation=implementation)))

    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(f(None), (q,), (t,))
    _, tangent = jax.jvp(f("explicit"), (q,), (t,))
    reverse = jnp.sum(jax.grad(f(None))(q) * t)
    np.testing.assert_allclose(float(tangent), float(reverse), rtol=1e-4, atol=1e-5,
                               err_msg=f"seed {seed}")


F32, BF16 = jnp.float32, jnp.bfloat16


@pytest.mark.parametrize("lq, lk, dtype, kw, forward, differentiated", [
    (256, 256, F32, dict(), "explicit", "explicit"),  # 2^16 < 2^18; 2^21 scores: JAX's
    (512, 512, F32, dict(), "blockwise", "explicit+blockwise"),  # 2^18
    (256, 1024, F32, dict(), "blockwise", "explicit+blockwise"),
    (512, 512, BF16, dict(), "explicit", "explicit+blockwise"),  # bfloat16: explicit's
    (512, 512, F32, dict(is_causal=True), "explicit", "explicit+blockwise"),  # tiled
    (512, 512, F32, dict(mask=True), "explicit", "explicit+blockwise"),  # not plain
    (2048, 2048, F32, dict(is_causal=True), "blockwise", "blockwise"),  # blocks of 512
    (2048, 2048, BF16, dict(is_causal=True), "explicit", "blockwise"),  # 2^22, bfloat16
    (4096, 4096, BF16, dict(is_causal=True), "blockwise", "blockwise"),  # 2^24 > 2^22
    (2048, 2048, F32, dict(), "blockwise", "blockwise"),  # no tiles
    (2048, 2048, F32, dict(is_causal=True, local_window_size=(300, 0)), "blockwise",
     "blockwise"),  # not plain
    (2048, 2048, BF16, dict(is_causal=True, mask=True), "blockwise", "blockwise"),
])
def test_the_forward_none_runs_undifferentiated(monkeypatch, lq, lk, dtype, kw, forward,
                                                differentiated):
    """implementation=None's forward when the call is not differentiated is the faster one
    measured (functional.forward_passes); differentiated, the split passes or blockwise's
    custom_vjp as before. B = 4, H = 8; record() names what was traced."""
    monkeypatch.undo()  # the real SPLIT_ABOVE
    q, kv = (jax.ShapeDtypeStruct((4, 8, n, 8), dtype) for n in (lq, lk))
    masks = [jax.ShapeDtypeStruct((lq, lk), jnp.bool_)] if kw.pop("mask", False) else []

    def f(q, k, *mask):
        return jnp.sum(jax_attn.scaled_dot_product_attention(q, k, k, *mask, **kw)
                       .astype(jnp.float32))

    for call, expected in ((jax.jit(f), forward), (jax.jit(jax.grad(f)), differentiated)):
        jax.clear_caches()  # record() sees what is traced
        with record() as ran:
            call.lower(q, kv, *masks)
        assert "+".join(name for _, name in ran) == expected


BLOCKWISE_512 = dict(implementation="blockwise", block_sizes=(512, 512))


@pytest.mark.parametrize("length, is_causal, dtype, same_as, differentiated", [
    (512, False, F32, dict(implementation="blockwise"), None),  # split passes differentiated
    (2048, True, F32, BLOCKWISE_512, BLOCKWISE_512),  # functional.CAUSAL_BLOCK_SIZES
    (2048, True, BF16, dict(implementation="explicit"), BLOCKWISE_512),  # tiles, then blockwise
    (4096, True, F32, BLOCKWISE_512, BLOCKWISE_512),  # 2^24: still blocks of 512
    (4160, True, F32, dict(implementation="blockwise"), dict(implementation="blockwise")),
])
def test_none_runs_the_same_programs_as_the_named_ones(length, is_causal, dtype, same_as,
                                                       differentiated):
    """Not differentiated, None's output is the named forward's (the same program);
    differentiated, its gradients are blockwise's own, in the same blocks, where blockwise's
    forward is kept (causal L = 2048 to 4096 in blocks of 512, past 2^24 of 1024) and the
    split passes' (agreeing with JAX's derivative of explicit) where explicit's is (L = 512)."""
    rng, seed = fresh_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((1, 2, length, 8)), dtype) for _ in range(3))
    kw = dict(is_causal=is_causal)
    out = jax_attn.scaled_dot_product_attention(q, k, v, **kw)
    named = jax_attn.scaled_dot_product_attention(q, k, v, **same_as, **kw)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(named, np.float32),
                                  err_msg=f"seed {seed}")

    def loss(**named):
        return lambda q, k, v: jnp.sum(jnp.sin(jax_attn.scaled_dot_product_attention(
            q, k, v, **named, **kw).astype(jnp.float32)))

    grads = jax.grad(loss(), argnums=(0, 1, 2))(q, k, v)
    if differentiated:  # blockwise's forward and backward, as by name
        for g, b in zip(grads, jax.grad(loss(**differentiated), argnums=(0, 1, 2))(q, k, v)):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(b, np.float32),
                                          err_msg=f"seed {seed}")
    else:
        jax_ad = jax.grad(loss(implementation="explicit"), argnums=(0, 1, 2))(q, k, v)
        for name, g, s in zip("qkv", grads, jax_ad):
            np.testing.assert_allclose(np.asarray(g), np.asarray(s), atol=2e-6, rtol=1e-5,
                                       err_msg=f"d{name}, seed {seed}")


def test_passes_refuse_a_blockwise_forward_with_drawn_dropout():
    """Each implementation draws its own dropout mask, so the passes stay explicit's there."""
    static = blockwise.Static(1.0, False, None, (None, None), 0.5, None, 8, 8)
    q = jnp.zeros((8, 4), jnp.float32)
    with pytest.raises(ValueError, match=r"passes should be \('explicit', 'explicit'\) when "
                                         r"dropout is drawn, got \('blockwise', 'explicit'\)"):
        explicit.attend_split(q, q, q, None, None, None, None, None, None, None,
                              static=static, passes=("blockwise", "explicit"))


def _divides(fn, *args):
    """The shapes of the float divisions in fn's lowered program."""
    text = jax.jit(fn).lower(*args).as_text()
    return set(re.findall(r"stablehlo\.divide .* : tensor<([0-9x]+)xf32>", text))


def test_explicit_divides_last_only_when_not_differentiated():
    """Not differentiated, explicit's float32 output is (exp(S − m) V) / l: no (Lq, Lk) array
    is divided. Differentiated (reverse or forward mode), it is (exp(S − m) / l) V, whose
    weights are divided; the two outputs agree to float32 rounding, and forward mode (the
    custom_jvp) agrees with reverse mode."""
    rng, seed = fresh_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((2, 3, 12, 8)), jnp.float32) for _ in range(3))
    t = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def f(q):
        return jax_attn.scaled_dot_product_attention(q, k, v, implementation="explicit")

    assert "2x3x12x12" not in _divides(f, q)
    assert "2x3x12x12" in _divides(lambda q: jax.vjp(f, q)[1](q)[0], q)
    plain, (differentiated, _) = f(q), jax.jvp(f, (q,), (t,))
    assert compare(plain, differentiated, "float32").ok, f"seed {seed}"
    tangent = jax.jvp(lambda q: jnp.sum(jnp.sin(f(q))), (q,), (t,))[1]
    reverse = jnp.sum(jax.grad(lambda q: jnp.sum(jnp.sin(f(q))))(q) * t)
    np.testing.assert_allclose(float(tangent), float(reverse), rtol=1e-4, atol=1e-5,
                               err_msg=f"seed {seed}")


def _dot_operand_types(fn, *args):
    """The element types of the operands of every product in fn's lowered program."""
    text = jax.jit(fn).lower(*args).as_text()
    pairs = re.findall(r"stablehlo\.dot_general .* : \(tensor<[0-9x]+x(\w+)>, "
                       r"tensor<[0-9x]+x(\w+)>\)", text)
    assert pairs, "no product found in the program"
    return {t for pair in pairs for t in pair}


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the float32 products are CPU-only")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_explicit_half_products_run_in_float32_on_cpu(dtype, monkeypatch):
    """On CPU a bfloat16 or float16 explicit call multiplies float32 copies of its operands (q,
    k; the weights rounded to the dtype, v), forward and backward: no product of half-precision
    operands is left in its program. The products of half-precision numbers are exact in
    float32, so the output is the half-precision products' to within one unit in the last place
    (the order of the float32 sums may differ)."""
    rng, seed = fresh_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((2, 3, 12, 8)), dtype) for _ in range(3))

    def f(q):
        return jax_attn.scaled_dot_product_attention(q, k, v, implementation="explicit")

    def grad(q):
        return jax.grad(lambda q: jnp.sum(f(q).astype(jnp.float32) ** 2))(q)

    assert _dot_operand_types(f, q) == {"f32"}
    assert _dot_operand_types(grad, q) == {"f32"}
    wide, wide_grad = np.asarray(f(q), np.float64), np.asarray(grad(q), np.float64)
    monkeypatch.setattr(explicit, "wide_products", lambda dtype: False)
    jax.clear_caches()
    assert _dot_operand_types(f, q) == {dtype.replace("loat", "")[:4]}  # bf16 or f16
    half, half_grad = np.asarray(f(q), np.float64), np.asarray(grad(q), np.float64)
    ulp = np.spacing(np.abs(half).astype(dtype).astype(np.float32)).astype(np.float64)
    ulp *= 2.0 ** (np.finfo(np.float32).nmant - jnp.finfo(dtype).nmant)
    assert np.all(np.abs(wide - half) <= ulp), f"seed {seed}"
    assert compare(wide_grad, half_grad, dtype, "grad").ok, f"seed {seed}"


def test_half_products_widen_only_half_dtypes_on_cpu(monkeypatch):
    # float32 and float64 keep their products as they are, and an accelerator keeps its
    # half-precision products (its matrix units run them natively).
    assert [explicit.wide_products(d) for d in ("bfloat16", "float16", "float32", "float64")] \
        == [jax.default_backend() == "cpu"] * 2 + [False, False]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not explicit.wide_products("bfloat16") and not explicit.wide_products("float16")

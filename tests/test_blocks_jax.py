"""jax_attn's GroupedQueryAttention with the block indexer (issue 44 part 4: MiniMax M3's "max",
Qwen4-Exp's "mean"; the options, the maths and the one selection rule are
golden.specification.indexer's, the float64 reference golden.reference.indexer's and
golden.reference.modules._block_mask): the gqa_blocks_* fixtures through the runner's own
computation (outputs, weights, every gradient) and their stored choice, the choice equal to the
reference's on random float64 draws whose kept and dropped block scores are clearly apart (the
least gap printed), exact ties won by the lowest block index, the given-selection mode, no
gradient into the indexer, decoding from the cache (its index_key) equal to the full forward,
the cache exported and loaded, a caller's jit, and bad calls refused by name.

Shape legend: B batch, L tokens, H heads, H_I indexer heads, D_I their width, b the block size,
M the cache's max_length, k the keys kept per query.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import golden
import jax_attn
from golden import reference
from golden.harness.check import compare_all
from golden.reference.core import allowed_positions
from golden.reference.indexer import _rms, max_block_scores
from golden.reference.rotary import rope_cos_sin, turn
from golden.runners import jax_runner
from golden.specification import variants
from golden.specification.decoder import sliding_window
from golden.specification.indexer import BLOCK_PARAMS, block_key_shape
from golden.specification.tolerances import compare
from golden.specification.validate import rope_settings
from tests.helpers import TWINS, count_compiles, matrix
from tests.test_indexer_blocks import FAMILIES as BLOCK_FAMILIES
from tests.test_indexer_blocks import draw_family as _draw

J = TWINS["jax"]
GQA = "grouped_query_attention"
FIXTURES = ["gqa_blocks_minimax_m3", "gqa_blocks_minimax_m3_unbatched", "gqa_blocks_qwen4_exp",
            "gqa_blocks_qwen4_exp_unbatched"]
# the two families' settings, tests/test_indexer_blocks.py's (against Hugging Face's modules):
# "max" keeps 3 blocks of 3 (one local), "mean" 3 blocks of 2 and a tail of at most 1
FAMILIES = BLOCK_FAMILIES
# every fixture at both its dtypes; the unbatched ones' float32 runs (the batched fixtures' code
# at the other dtype: 2 compilations of ~2 s each) in the whole matrix only
FIXTURE_RUNS = [pytest.param(n, d, id=f"{n}-{d}", marks=matrix if n.endswith("_unbatched")
                             and d == "float32" else ()) for n in FIXTURES
                for d in ("float32", "float64")]
CLEAR = 1e-9  # a gap float64's scores cannot cross (their error ~1e-15 of the largest)


def _build(c, p, dtype="float64"):
    return J.build(GQA, c, {n: np.asarray(a, dtype) for n, a in p.items()})


def _allowed(c, x, mask=None, lengths=None):
    """The keys each query may see (*lead, L, L), as the reference's _block_mask reads them."""
    c = variants.get(GQA).config(c)
    lead, length = x.shape[:-2], x.shape[-2]
    return allowed_positions(lead + (length, length), mask, c["causal"],
                             local_window_size=sliding_window(c["sliding_window"], c["causal"]),
                             attention_chunk_size=c["attention_chunk_size"],
                             query_seq_lengths=lengths, key_value_seq_lengths=lengths)


def _gaps(c, p, x, allowed, positions):
    """Every choice's relative gap between the last kept and the first dropped block score
    (one per query and indexer head for "max", per query for "mean"; only where a block is
    dropped), from the reference's own pieces, written out query by query."""
    c = variants.get(GQA).config(c)
    h, d, b, n = (c[k] for k in ("index_heads", "index_head_dim", "index_block_size",
                                 "index_topk_blocks"))
    eps = c["index_norm_eps"]
    settings = rope_settings(c["rope_theta"], c["rope_parameters"], c["partial_rotary_factor"],
                             c["rope_precision"])
    positions = np.broadcast_to(positions, x.shape[:-1])
    cos, sin = rope_cos_sin(settings, c["head_dim"], positions)
    q = _rms((x @ p["W_index_q"]).reshape(x.shape[:-1] + (h, d)), p["index_q_norm"], eps)
    q = turn(q, cos[..., None, :], sin[..., None, :], False)         # (..., L, H_I, D_I)
    raw, gaps = x @ p["W_index_k"], []
    if c["index_blocks"] == "max":
        k = turn(_rms(raw, p["index_k_norm"], eps), cos, sin, False)
        scores, has = max_block_scores(q, k, allowed, b)              # (..., H_I, L, M)
        blocks = scores.shape[-1]
        for idx in np.ndindex(scores.shape[:-1]):
            row, t = idx[:-2], idx[-1]
            local = {min(max(positions[row + (t,)] // b - i, 0), blocks - 1)
                     for i in range(c["index_local_blocks"])}
            rest = sorted((s for m, s in enumerate(scores[idx])
                           if m not in local and has[row + (0, t, m)]), reverse=True)
            slots = n - len(local)
            if 0 < slots < len(rest):
                hi, lo = rest[slots - 1], rest[slots]
                gaps.append((hi - lo) / max(abs(hi), abs(lo)))
        return np.array(gaps)
    for idx in np.ndindex(x.shape[:-1]):                              # (..., t)
        row = idx[:-1]
        visible = np.flatnonzero(allowed[idx])
        groups = visible[:len(visible) // b * b].reshape(-1, b)
        if len(groups) <= n:
            continue
        pooled = raw[row][groups].sum(-2) / b
        at = rope_cos_sin(settings, c["head_dim"], positions[row][groups[:, 0]])
        keys = turn(_rms(pooled, p["index_k_norm"], eps), *at, False)
        dot = q[idx] @ keys.T                                         # (H_I, C)
        s = np.sort(np.maximum(dot, 0).sum(0) / np.sqrt(d))[::-1]
        if s[n - 1] == 0:  # a tie of ReLU's zeros, won by index: clear if no dot is near 0
            gaps.append(np.inf if np.abs(dot).min() > CLEAR * np.abs(dot).max() else 0.0)
            continue
        gaps.append((s[n - 1] - s[n]) / s[n - 1])
    return np.array(gaps)


def _call(module, x, **inputs):
    """(y, key_indices) as NumPy of the module's call on float64 NumPy inputs."""
    y, keys = module(J.array(x), **{n: J.array(a) for n, a in inputs.items()},
                     return_key_indices=True)
    return J.numpy(y), np.asarray(keys)


# ---- the fixtures -------------------------------------------------------------------------

@pytest.mark.parametrize("name, dtype", FIXTURE_RUNS)
def test_fixture_and_its_choice(name, dtype):
    """The runner's computation (jax_runner.run_module: forward and jax.grad of the fixture's
    loss) within the fixture's
    tolerances, every gradient but the indexer's (which gets none); the module's own choice the
    stored one, which is the reference's block_keys on the fixture's inputs (the fixtures' gaps
    are >= 1e-3, far above float32's error)."""
    f = golden.load(name)
    assert f.config["index_blocks"] in ("max", "mean") and dtype in f.dtypes
    _, _, saved = reference.pair(GQA)[0](f.config, f.inputs, f.params)
    np.testing.assert_array_equal(saved["key_indices"], f.expected["key_indices"])
    with J.float64(dtype == "float64"):
        module = _build(f.config, f.params, dtype)
        result = jax_runner.run_module(module, f, dtype)
        assert set(result["grads"]) == set(f.grads)
        assert not set(result["grads"]) & set(BLOCK_PARAMS)
        bad = {w: c for w, c in compare_all(f, result, dtype).items() if not c.ok}
        assert not bad, bad
        args, kwargs = variants.get(GQA).call_args(
            {n: J.array(a, dtype) for n, a in f.inputs.items()})
        y, keys = module(*args, **kwargs, return_key_indices=True)
        assert keys.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(keys), f.expected["key_indices"])
        assert compare(J.numpy(y), f.expected["output"], dtype).ok


# ---- random draws against the reference at float64 ----------------------------------------

SETTINGS = {  # (extra config, the call's inputs beyond x) for (rng, L)
    "lengths": lambda rng, n: ({}, {"query_seq_lengths": np.array([n, n - 5], np.int32)}),
    "mask": lambda rng, n: ({}, {"mask": (rng.random((2, n, n)) < 0.8) | np.eye(n, dtype=bool)}),
    "positions": lambda rng, n: ({}, {"positions": np.maximum(np.arange(n) - [[3], [0]], 0)}),
    "window": lambda rng, n: ({"sliding_window": 13, "attention_chunk_size": 16}, {}),
    "unbatched": lambda rng, n: ({}, {}),
}


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("family", FAMILIES)
def test_choice_and_output_equal_the_references(family, setting):
    """L = 20, well above the kept keys (9 or 7): the choice matters on most rows; every kept
    and dropped block score is clearly apart (CLEAR, the least gap printed), and the twin's
    key_indices equal the reference's exactly, its output within float64's tolerance."""
    lead = () if setting == "unbatched" else (2,)
    c, p, x, rng = _draw(family, 40, lead=lead)
    config, inputs = SETTINGS[setting](rng, x.shape[-2])
    c = {**c, **config}
    y_ref, _, saved = reference.pair(GQA)[0](c, {"x": x, **inputs}, p)
    with J.float64():
        y, keys = _call(_build(c, p), x, **inputs)
    allowed = _allowed(c, x, inputs.get("mask"), inputs.get("query_seq_lengths"))
    gaps = _gaps(c, p, x, allowed, inputs.get("positions", np.arange(x.shape[-2])))
    print(f"{family} {setting}: {len(gaps)} choices that drop a block, least gap "
          f"{gaps.min():.1e}, {np.isinf(gaps).sum()} ties of ReLU's zeros")
    assert len(gaps) >= 8 * np.prod(lead, dtype=int), "the choice never mattered"
    assert gaps.min() > CLEAR
    assert keys.shape == saved["key_indices"].shape
    np.testing.assert_array_equal(keys, saved["key_indices"])
    assert compare(y, y_ref, "float64").ok


@pytest.mark.parametrize("family", FAMILIES)
def test_equal_scores_go_to_the_lowest_block_index(family):
    """W_index_q = 0 (every score 0) or W_index_k = 0 (every key 0): every block ties, so the
    lowest blocks win ("max": after the local one), as the reference; by hand, the last query
    (position 19) of row 0 (no key masked) keeps "max" blocks 6 (local: keys 18, 19), 0 and 1,
    "mean" blocks 0, 1 and 2 (no tail: 20 keys seen); the other slots repeat the first key."""
    c, p, x, rng = _draw(family, 41)
    mask = (rng.random((2, 20, 20)) < 0.7) | np.eye(20, dtype=bool)
    mask[0] = True
    for zero in ("W_index_q", "W_index_k"):
        tied = {**p, zero: np.zeros_like(p[zero])}
        _, _, saved = reference.pair(GQA)[0](c, {"x": x, "mask": mask}, tied)
        with J.float64():
            _, keys = _call(_build(c, tied), x, mask=mask)
        np.testing.assert_array_equal(keys, saved["key_indices"])
        last = keys[0, ..., -1, :]                  # (H, k) or (k,)
        want = [18, 19, 0, 1, 2, 3, 4, 5, 18] if family == "max" else [0, 1, 2, 3, 4, 5, 0]
        np.testing.assert_array_equal(last, np.broadcast_to(want, last.shape))


def test_a_local_block_the_query_cannot_see_scores_the_least_of_all():
    """"max" with two local blocks, the mask hiding block 5 (keys 15 … 17) from query 19:
    block 5 is kept (local) with no key seen, and scores the least score of all (the
    reference's fill), so with every score 0 (W_index_q = 0) it ties with the rest and comes
    first by index: blocks 5, 6, then 0 (not 6, 0, 5 as a score of −inf would order them)."""
    c, p, x, _ = _draw("max", 48, index_local_blocks=2)
    p["W_index_q"] = np.zeros_like(p["W_index_q"])
    mask = np.ones((2, 20, 20), bool)
    mask[:, 19, 15:18] = False
    _, _, saved = reference.pair(GQA)[0](c, {"x": x, "mask": mask}, p)
    with J.float64():
        _, keys = _call(_build(c, p), x, mask=mask)
    np.testing.assert_array_equal(keys, saved["key_indices"])
    np.testing.assert_array_equal(keys[..., 19, :], np.broadcast_to(
        [15, 16, 17, 18, 19, 0, 1, 2, 15], (2, 4, 9)))


# ---- the given selection -------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_a_given_selection_replaces_the_indexer(family):
    """The reference's key_indices given reproduce the module's own choice's output and
    weights exactly; another selection (the first k keys) changes them; the keys returned are
    int32 of block_key_shape's shape, appended after the weights."""
    c, p, x, _ = _draw(family, 42)
    _, _, saved = reference.pair(GQA)[0](c, {"x": x}, p)
    with J.float64():
        module = _build(c, p)
        y, w, keys = module(J.array(x), return_weights=True, return_key_indices=True)
        assert keys.dtype == jnp.int32
        assert keys.shape == block_key_shape(variants.get(GQA).config(c), w.shape)
        given_y, given_w = module(J.array(x), return_weights=True,
                                  key_indices=J.array(saved["key_indices"]))
        first = np.broadcast_to(np.arange(keys.shape[-1], dtype=np.int32), keys.shape)
        far = module(J.array(x), key_indices=J.array(first))
    np.testing.assert_array_equal(np.asarray(given_y), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(given_w), np.asarray(w))
    assert not compare(J.numpy(far), J.numpy(y), "float64").ok


# ---- gradients -----------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_equal_the_references_with_the_choice_constant(family):
    """jax.grad of Σ y ⊙ dy + Σ weights ⊙ dw through nnx, with a mask: x's and every other
    parameter's gradient equal the reference's backward (the chosen keys a constant mask) at
    float64's tolerance; the indexer's parameters get exact zeros."""
    c, p, x, rng = _draw(family, 43)
    mask = (rng.random((2, 20, 20)) < 0.85) | np.eye(20, dtype=bool)
    forward, backward = reference.pair(GQA)
    y, w, saved = forward(c, {"x": x, "mask": mask}, p)
    assert (~reference.selected_mask(saved["key_indices"], 20) & np.tril(mask)[:, None]).any()
    dy, dw = rng.standard_normal(y.shape), rng.standard_normal(w.shape)
    want = backward(saved, dy, dw)
    with J.float64():
        graphdef, params, rest = nnx.split(_build(c, p), nnx.Param, ...)

        def loss(x, params):
            out, weights = nnx.merge(graphdef, params, rest)(x, J.array(mask),
                                                             return_weights=True)
            return (out * dy).sum() + (weights * dw).sum()

        g_x, g_params = jax.grad(loss, argnums=(0, 1))(J.array(x), params)
        got = jax_attn.export_params(nnx.merge(graphdef, g_params, rest))
    assert set(got) == set(want) - {"x"} | set(BLOCK_PARAMS)
    for n in BLOCK_PARAMS:
        assert not np.asarray(got[n]).any(), n
    for n, g in want.items():
        a = np.asarray(g_x) if n == "x" else got[n]
        assert compare(a, g, "float64", "grad").ok, n


# ---- decoding from the cache ---------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_equals_the_full_forward(family):
    """Prefill ragged prompts (5 and 8 tokens of 16: the choice drops blocks from the first
    steps), then one token a step, the cache exported and loaded midway: every output equals
    the full forward's at float64 (summation orders apart); index_key holds each token's
    indexer key ("max": normed and turned, as the module's own keys; "mean": raw) and zeros
    past a row's length; the step compiles once."""
    c, p, x, _ = _draw(family, 44, length=16)
    length, room = 16, 19
    with J.float64():
        module = _build(c, p)
        full, _ = _call(module, x)
        prompt = np.array([5, 8])
        (y, keys), cache = module(J.array(x[:, :8]), cache=module.init_cache(2, room),
                                  query_seq_lengths=J.array(prompt.astype(np.int32)),
                                  return_key_indices=True)
        assert keys.shape == block_key_shape(variants.get(GQA).config(c), (2, 4, 8, room))
        held = np.asarray(cache.index_key)
        assert held.shape == (2, room, c["index_head_dim"]) and not held[0, 5:].any()
        raw = x[0, :5] @ p["W_index_k"]
        if family == "mean":
            assert np.abs(held[0, :5] - raw).max() <= 1e-14 * np.abs(raw).max()
        else:  # normed: not the raw keys, of the norm's size
            assert np.abs(held[0, :5] - raw).max() > 1e-3
        out = np.full(full.shape, np.nan)
        for r in range(2):
            out[r, :prompt[r]] = np.asarray(y)[r, :prompt[r]]
        pos, steps = prompt.copy(), 0
        while (pos < length).any():
            if (pos == 11).any():  # midway: the cache through NumPy and back
                cache = jax_attn.load_cache(jax_attn.export_cache(cache))
            new = (pos < length).astype(np.int32)
            step = x[np.arange(2), np.minimum(pos, length - 1)][:, None]
            with count_compiles() as compiled:
                y, cache = module(J.array(step), cache=cache, query_seq_lengths=J.array(new))
            assert steps == 0 or not [f for f in compiled if "_call" in f], compiled
            steps += 1
            out[new == 1, pos[new == 1]] = np.asarray(y)[new == 1, 0]
            pos = pos + new
    assert compare(out, full, "float64").ok
    assert np.asarray(cache.lengths).tolist() == [length, length]


def test_the_cache_holds_the_index_keys_and_travels():
    """init_cache makes index_key zeros (B, M, D_I) with index_blocks only; export_cache gives
    it as NumPy in a KVCache, load_cache brings it back unchanged (bfloat16 as float32)."""
    c, p, x, _ = _draw("max", 45, length=6)
    with J.float64():
        module = _build(c, p)
        assert _build(*_dense(c, p)).init_cache(2, 8).index_key is None
        _, cache = module(J.array(x), cache=module.init_cache(2, 8))
        exported = jax_attn.export_cache(cache)
        assert type(exported).__name__ == "KVCache"
        assert isinstance(exported.index_key, np.ndarray)
        assert exported.index_key.shape == (2, 8, 5) and exported.index_key[:, :6].any()
        back = jax_attn.load_cache(exported)
    np.testing.assert_array_equal(np.asarray(back.index_key), np.asarray(cache.index_key))
    low = jax_attn.export_cache(jax_attn.load_cache(exported, jnp.bfloat16))
    assert low.index_key.dtype == np.float32


# ---- a caller's jit ------------------------------------------------------------------------

def test_under_a_callers_jit_with_traced_positions_and_selection():
    """Under nnx.jit the positions and a given selection are traced (no host reads): the
    choice and the output equal the eager call's; a selection of the wrong shape is still
    refused by name."""
    c, p, x, _ = _draw("max", 46, length=12)
    positions = np.maximum(np.arange(12) - [[2], [0]], 0)
    with J.float64():
        module = _build(c, p)
        y, keys = module(J.array(x), positions=J.array(positions), return_key_indices=True)

        @nnx.jit
        def call(m, x, positions, keys):
            chosen = m(x, positions=positions, max_position=12, return_key_indices=True)[1]
            return m(x, positions=positions, max_position=12, key_indices=keys), chosen

        again, chosen = call(module, J.array(x), J.array(positions), keys)
        np.testing.assert_array_equal(np.asarray(chosen), np.asarray(keys))
        np.testing.assert_array_equal(np.asarray(again), np.asarray(y))
        with pytest.raises(ValueError, match="key_indices shape should be"):
            call(module, J.array(x), J.array(positions), keys[..., :4])


# ---- bad settings and calls ----------------------------------------------------------------

def _dense(c, p):
    return ({n: v for n, v in c.items() if not n.startswith("index_")},
            {n: a for n, a in p.items() if "index" not in n})


@pytest.mark.parametrize("given, match", [
    (dict(index_heads=4), "index_heads should be num_kv_heads = 2 with index_blocks = 'max'"),
    (dict(index_local_blocks=4), "index_local_blocks should be at most index_topk_blocks = 3"),
    (dict(index_head_dim=3), "index_head_dim should be at least the layer's rotary features"),
    (dict(rope_interleaved=True), "index_blocks should be None without rotate-half RoPE"),
    (dict(index_blocks=None), "index_heads should be None without index_blocks"),
    (dict(merged_context=True), "merged_context should be False with index_blocks = 'max'"),
    (dict(kv_shared=True), "kv_shared should be False with index_blocks = 'max'"),
])
def test_bad_settings_are_refused_by_name(given, match):
    with pytest.raises(ValueError, match=match):
        J.make(GQA, {**FAMILIES["max"], **given})


def test_bad_calls_are_refused_by_name():
    c, p, x, _ = _draw("max", 47, length=8)
    cm, pm, _, _ = _draw("mean", 47, length=8)
    with J.float64():
        module, mean = _build(c, p), _build(cm, pm)
        xj = J.array(x)
        for keys, match in [  # "max": (B, H, Lq, k), k = min(3 · 3, 8)
            (np.zeros((2, 8, 8), np.int32), r"key_indices shape should be \(B, Lq, k\) = "
                                            r"\(2, 4, 8, 8\), got \(2, 8, 8\)"),
            (np.zeros((2, 4, 8, 8), np.float32), "key_indices dtype should be an integer "
                                                 "type, got float32"),
            (np.full((2, 4, 8, 8), 8, np.int32), r"key_indices should lie in \[0, Lk\) = "
                                                 r"\[0, 8\), got values in \[8, 8\]"),
            (np.full((2, 4, 8, 8), -1, np.int32), r"key_indices should lie in \[0, Lk\)"),
        ]:
            with pytest.raises(ValueError, match=match):
                module(xj, key_indices=J.array(keys))
        with pytest.raises(ValueError, match=r"key_indices shape should be \(B, Lq, k\) = "
                                             r"\(2, 8, 7\), got \(2, 4, 8, 7\)"):  # "mean"
            mean(xj, key_indices=jnp.zeros((2, 4, 8, 7), jnp.int32))
        with pytest.raises(ValueError, match=r"key_indices shape should be \(B, Lq, k\) = "
                                             r"\(2, 4, 8, 9\), got \(2, 4, 8, 8\)"):  # Lk = M
            module(xj, cache=module.init_cache(2, 10), key_indices=jnp.zeros((2, 4, 8, 8), int))
        with pytest.raises(ValueError, match=r"mask should have no head axis, or one of size "
                                             r"1, with index_blocks .*got shape \(2, 4, 8, 8\)"):
            module(xj, jnp.ones((2, 4, 8, 8), bool))
        module(xj, jnp.ones((2, 1, 8, 8), bool))  # a head axis of 1: one set for all heads
        with pytest.raises(ValueError, match=r"positions should be \(L,\) or \(B, L\) with "
                                             r"index_blocks .*shape \(3, 2, 8\)"):
            module(xj, positions=jnp.zeros((3, 2, 8), jnp.int32))
        with pytest.raises(ValueError, match=r"positions should be None with index_blocks = "
                                             r"'mean' and a cache .*got shape \(2, 8\)"):
            mean(xj, cache=mean.init_cache(2, 10), positions=jnp.zeros((2, 8), int))
        module(xj, cache=module.init_cache(2, 10), positions=jnp.zeros((2, 8), int))  # "max"
        old = module.init_cache(2, 10)._replace(index_key=None)
        with pytest.raises(ValueError, match=r"cache.index_key should be an array of shape "
                                             r"\(B, M, index_head_dim\) = \(2, 10, 5\) with "
                                             r"index_blocks"):
            module(xj, cache=old)
        wrong = module.init_cache(2, 10)._replace(index_key=jnp.zeros((2, 10, 4)))
        with pytest.raises(ValueError, match=r"cache.index_key should be \(B, M, "
                                             r"index_head_dim\) = \(2, 10, 5\) in x's dtype "
                                             r"float64, got \(2, 10, 4\) float64"):
            module(xj, cache=wrong)
        with pytest.raises(ValueError, match="return_key_indices should be True or False"):
            module(xj, return_key_indices="yes")
        dense = _build(*_dense(c, p))
        assert dense.W_index_q is None and dense.index_k_norm is None
        with pytest.raises(ValueError, match="key_indices should be None without "
                                             "index_blocks"):
            dense(xj, key_indices=jnp.zeros((2, 4, 8, 8), jnp.int32))
        with pytest.raises(ValueError, match="return_key_indices should be False without "
                                             "index_blocks"):
            dense(xj, return_key_indices=True)

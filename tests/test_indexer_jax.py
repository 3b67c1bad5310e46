"""jax_attn's MultiHeadLatentAttention with the learned indexer (issue 44; the options, the maths
and the one selection rule are golden.specification.indexer's, the float64 reference
golden.reference.indexer's): the fixtures' choice and the given-selection mode, exact ties and
signed zeros won by the lowest key index, the choice equal to the reference's at float64 and to
float64's at float32 wherever the k-th and (k+1)-th scores are clearly apart (the near-ties
counted), gradients equal to the reference's with the choice a constant (the indexer's own
parameters get zeros), decoding from the cache (its index_key) equal to the full forward, the
cache exported and loaded, bad calls refused by name, traced selections under a caller's jit,
and Hugging Face's DeepseekV32Attention at float64.

Shape legend: B batch, L tokens, M the cache's max_length, k the keys kept per query, H_I
indexer heads, D_I their width.
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
from golden.reference.core import allowed_positions
from golden.specification import variants
from golden.specification.indexer import INDEX_PARAMS
from golden.specification.tolerances import TOLERANCES, compare
from jax_attn.modules.latent import _select_keys
from tests.helpers import TWINS, count_compiles, missing_option, score_gaps
from tests.test_indexer_reference import FIXTURES, KINDS, MLA, _scores, _setup

J = TWINS["jax"]
EXACT = 1e-12  # float64 against float64, summation orders apart (test_latent_attention's bound)


def _build(c, p, dtype="float64"):
    return J.build(MLA, c, {n: np.asarray(a, dtype) for n, a in p.items()})


def _chosen(module, x, **kw):
    """(y, key_indices) as NumPy: y float64, key_indices int."""
    y, keys = module(J.array(x, module.W_kv_a.kernel.get_value().dtype), **kw,
                     return_key_indices=True)
    return J.numpy(y), np.asarray(keys)


def _allowed(c, x, mask=None, lengths=None):
    lead, length = x.shape[:-2], x.shape[-2]
    return allowed_positions(lead + (length, length), mask, c["causal"],
                             query_seq_lengths=lengths, key_value_seq_lengths=lengths)


def _same_keys(a, b, allowed):
    """Rows where key sets a and b (..., Lq, k) agree on the keys each row may see."""
    rows = np.zeros(a.shape[:-1], bool)
    for row in np.ndindex(a.shape[:-1]):
        ok = allowed[row]
        rows[row] = ({j for j in a[row] if ok[j]} == {j for j in b[row] if ok[j]})
    return rows


# ---- the fixtures -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_choice_and_given_selection(name, dtype):
    """The twin runs the indexer's fixtures (no longer skipped), chooses their stored keys at
    both dtypes (the fixtures' gaps are >= 1e-3, far above float32's error), and given those
    keys (no indexer run) reproduces the fixture's output; another choice moves it."""
    f = golden.load(name)
    assert missing_option("jax", f) is None
    with J.float64(dtype == "float64"):
        module = J.build(MLA, f.config, {n: np.asarray(a, dtype) for n, a in f.params.items()})
        args, kwargs = variants.get(MLA).call_args(
            {n: J.array(a, dtype) for n, a in f.inputs.items()})
        y, keys = module(*args, **kwargs, return_key_indices=True)
        assert keys.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(keys), f.expected["key_indices"])
        given = module(*args, **kwargs, key_indices=J.array(f.expected["key_indices"]))
        assert compare(J.numpy(y), f.expected["output"], dtype).ok
        assert compare(J.numpy(given), f.expected["output"], dtype).ok
        other = f.expected["key_indices"][..., ::-1].copy()
        other[..., 0] = (other[..., 0] + 1) % f.inputs["x"].shape[-2]  # one key changed a row
        moved = module(*args, **kwargs, key_indices=J.array(other))
        assert not compare(J.numpy(moved), f.expected["output"], dtype).ok


# ---- the tie rule -------------------------------------------------------------------------

def test_equal_scores_go_to_the_lowest_key_index():
    """lax.top_k on the scores with the unseen keys at -inf: equal scores by index, a row that
    sees fewer than k keys filled with its unseen keys by index, -0.0 equal to 0.0 (top_k alone
    puts 0.0 first); the reference's select_keys on the same rows, exactly."""
    scores = np.array([[3.0, 1.0, 3.0, 2.0, 3.0, 0.0],
                       [0.0, -0.0, 0.0, -0.0, 0.0, 0.0],
                       [1.0, 5.0, 5.0, 5.0, 1.0, 1.0],
                       [-0.0, 1.0, 0.0, -1.0, -0.0, 2.0],
                       [3.0, 1.0, 3.0, 2.0, 3.0, 0.0]])
    allowed = np.array([[True] * 6, [True] * 6, [True, False, True, True, True, False],
                        [True] * 6, [True, False, False, True, False, False]])
    want = [[0, 2, 4], [0, 1, 2], [2, 3, 0], [5, 1, 0], [0, 3, 1]]
    np.testing.assert_array_equal(reference.select_keys(scores, allowed, 3), want)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = jax.jit(_select_keys, static_argnums=2)(jnp.asarray(scores, dtype), allowed, 3)
        np.testing.assert_array_equal(np.asarray(got), want)
    assert np.asarray(jax.lax.top_k(jnp.array([-0.0, 0.0]), 1)[1]) == [1]  # why zeros are made 0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lk, k", [(100, 7), (5000, 2048)])
def test_many_random_ties_follow_the_rule(lk, k, dtype):
    """Rows of Lk scores drawn from a few integers (most of them tied, a third of the zeros
    -0.0), a tenth of the keys unseen and one row seeing only k // 2: _select_keys equals the
    reference's select_keys (two stable sorts) exactly, k up to DeepSeek-V3.2's 2048."""
    rng = np.random.default_rng(lk)
    scores = rng.integers(-3, 4, (6, lk)) * (rng.random((6, lk)) < 0.5) * 1.0
    scores = np.where(rng.random((6, lk)) < 0.3, -0.0, scores)
    allowed = rng.random((6, lk)) < 0.9
    allowed[0] = np.arange(lk) < k // 2
    got = jax.jit(_select_keys, static_argnums=2)(jnp.asarray(scores, dtype), allowed, k)
    np.testing.assert_array_equal(np.asarray(got), reference.select_keys(scores, allowed, k))


@pytest.mark.parametrize("kind", ["deepseek_v32", "hy_v4"])
def test_a_module_whose_scores_all_tie_keeps_the_first_keys(kind):
    """index_k_norm and its bias 0 make every k^I 0, every score Σ_h w·ReLU(0) a signed zero
    (-0.0 where w < 0): each row keeps its first k keys it may see, as the reference chooses."""
    c, p, x, _ = _setup(kind, 890, length=9)
    p = {**p, "index_k_norm": 0 * p["index_k_norm"], "index_k_norm_bias": 0 * p["index_k_norm"],
         "W_index_weights": -np.abs(p["W_index_weights"])}
    lengths = np.array([9, 6], np.int32)
    with J.float64():
        _, keys = _chosen(_build(c, p), x, query_seq_lengths=J.array(lengths))
    _, _, saved = reference.pair(MLA)[0](c, {"x": x, "query_seq_lengths": lengths}, p)
    np.testing.assert_array_equal(keys, saved["key_indices"])
    np.testing.assert_array_equal(keys[0, -1], np.arange(5))  # 9 keys seen: the first 5


# ---- the choice against the reference and across dtypes ------------------------------------

SETTINGS = {  # the call's inputs beyond x: none, a mask, padding, positions
    "plain": lambda rng, b, length: {},
    "mask": lambda rng, b, length: {"mask": rng.random((b, length, length)) < 0.8},
    "lengths": lambda rng, b, length: {"query_seq_lengths": np.array([length, length - 4],
                                                                     np.int32)},
    "positions": lambda rng, b, length: {"positions": np.arange(length) + np.array([[3], [1]])},
}


def _case(kind, setting, seed, length=13):
    c, p, x, rng = _setup(kind, seed, length=length)
    return c, p, x, SETTINGS[setting](rng, 2, length)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("kind", KINDS)
def test_choice_and_output_equal_the_reference_at_float64(kind, setting):
    c, p, x, inputs = _case(kind, setting, 891)
    y_ref, _, saved = reference.pair(MLA)[0](c, {"x": x, **inputs}, p)
    with J.float64():
        y, keys = _chosen(_build(c, p), x, **{n: J.array(a) for n, a in inputs.items()})
    positions = inputs.get("positions", np.arange(x.shape[-2]))
    allowed = _allowed(c, x, inputs.get("mask"), inputs.get("query_seq_lengths"))
    gaps = score_gaps(_scores(c, p, x, positions), allowed, 5)
    assert (gaps < np.inf).sum() >= 10, "the choice never mattered"
    clear = gaps > 1e-9  # float64's error on the scores is ~1e-15 of the largest
    assert clear.all(), f"{(~clear).sum()} float64 near-ties"
    np.testing.assert_array_equal(keys, saved["key_indices"])
    assert np.abs(y - y_ref).max() <= EXACT * np.abs(y_ref).max()


@pytest.mark.parametrize("kind", KINDS)
def test_float32_chooses_float64s_keys_where_the_gap_is_clear(kind):
    """float32's choice equals float64's on every row whose k-th and (k+1)-th scores are
    further apart than NEAR = 1e-4 of its largest (float32's error on them is ~1e-6); the
    near-ties are counted (printed) and may go either way, but only among keys whose float64
    scores lie within NEAR of the k-th; where every row agrees, the outputs agree to float32's
    tolerance."""
    near_band = 1e-4
    c, p, x, inputs = _case(kind, "lengths", 892, length=24)
    calls = {n: J.array(a) for n, a in inputs.items()}
    with J.float64():
        y64, keys64 = _chosen(_build(c, p), x, **calls)
    y32, keys32 = _chosen(_build(c, p, "float32"), x, **calls)
    allowed = _allowed(c, x, None, inputs["query_seq_lengths"])
    scores = _scores(c, p, x, np.arange(24))
    gaps = score_gaps(scores, allowed, 5)
    clear, same = gaps > near_band, _same_keys(keys32, keys64, allowed)
    assert same[clear].all(), np.argwhere(clear & ~same)
    matters = gaps < np.inf
    assert matters.sum() >= 20 and clear[matters].mean() >= 0.8
    for row in np.argwhere(~same):
        row = tuple(row)
        v, big = np.sort(scores[row][allowed[row]])[::-1], np.abs(scores[row]).max()
        for j in set(keys32[row]) ^ set(keys64[row]):
            if allowed[row][j]:
                assert abs(scores[row][j] - v[4]) <= near_band * big, (row, j)
    print(f"{kind}: {int((~clear).sum())} near-ties of {int(matters.sum())} rows where the "
          f"choice matters, {int((~same).sum())} chosen otherwise at float32")
    if same.all():
        assert compare(y32, y64, "float32").ok


# ---- gradients -------------------------------------------------------------------------------

@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_equal_the_references_with_the_choice_constant(kind, absorb):
    """jax.grad of Σ y ⊙ dy + Σ weights ⊙ dw through nnx: x's and every parameter's gradient
    equal the reference's backward (which treats the chosen keys as a constant mask) at
    float64; the indexer's own parameters get exact zeros."""
    c, p, x, inputs = _case(kind, "mask", 893, length=11)
    mask = inputs["mask"]
    forward, backward = reference.pair(MLA)
    y, w, saved = forward(c, {"x": x, "mask": mask}, p)
    rng = np.random.default_rng(7)
    dy, dw = rng.standard_normal(y.shape), rng.standard_normal(w.shape)
    want = backward(saved, dy, dw)
    with J.float64():
        module = _build(c, p)
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)

        def loss(x, params):
            out, weights = nnx.merge(graphdef, params, rest)(x, J.array(mask), absorb=absorb,
                                                             return_weights=True)
            return (out * dy).sum() + (weights * dw).sum()

        g_x, g_params = jax.grad(loss, argnums=(0, 1))(J.array(x), params)
        got = jax_attn.export_params(nnx.merge(graphdef, g_params, rest))
    got = {n: np.asarray(g) for n, g in got.items()}
    assert set(got) == set(want) - {"x"} | {n for n in INDEX_PARAMS if n in p}
    for n in INDEX_PARAMS:
        if n in got:
            assert not got[n].any(), n
    for n, g in want.items():
        a = np.asarray(g_x) if n == "x" else got[n]
        assert np.abs(a - g).max() <= 1e-10 * max(np.abs(g).max(), 1e-300), n


# ---- decoding from the cache ---------------------------------------------------------------

B, L, M = 2, 12, 15


@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_decoding_equals_the_full_forward(kind, absorb):
    """Prefill ragged prompts (5 and 7 tokens, L = 12 > index_topk = 5, so the selection
    matters from the first step), then one token a step, the cache exported and loaded midway:
    every output equals the full forward's at float64; the cache's index_key holds each
    token's k^I (its rows beyond a row's length zeros); the step compiles once."""
    c, p, x, _ = _setup(kind, 894, length=L)
    with J.float64():
        module = _build(c, p)
        full, keys = _chosen(module, x)
        prompt = np.array([5, 7])
        out = np.full(full.shape, np.nan)
        (y, _), cache = module(J.array(x[:, :7]), cache=module.init_cache(B, M),
                               query_seq_lengths=J.array(prompt.astype(np.int32)),
                               absorb=absorb, return_key_indices=True)
        assert cache.index_key.shape == (B, M, c["index_head_dim"])
        held = np.asarray(cache.index_key)
        assert not held[0, 5:].any() and held[0, :5].all(axis=-1).any()
        for r in range(B):
            out[r, :prompt[r]] = np.asarray(y)[r, :prompt[r]]
        pos, steps = prompt.copy(), 0
        while (pos < L).any():
            if (pos == 9).any():  # midway: the cache through NumPy and back
                cache = jax_attn.load_cache(jax_attn.export_cache(cache))
            new = (pos < L).astype(np.int32)
            step = x[np.arange(B), np.minimum(pos, L - 1)][:, None]
            with count_compiles() as compiled:
                (y, chosen), cache = module(J.array(step), cache=cache,
                                            query_seq_lengths=J.array(new), absorb=absorb,
                                            return_key_indices=True)
            assert steps == 0 or not [f for f in compiled if "_call" in f], compiled
            steps += 1
            assert chosen.shape == (B, 1, 5)
            out[new == 1, pos[new == 1]] = np.asarray(y)[new == 1, 0]
            pos = pos + new
    assert np.abs(out - full).max() <= EXACT * np.abs(full).max()
    assert int(np.asarray(cache.lengths).min()) == L


def test_the_cache_holds_the_index_keys_and_travels():
    c, p, x, _ = _setup("glm5", 895, length=6)
    with J.float64():
        module = _build(c, p)
        assert module.cache_bytes_per_token() == 8 * (4 + 4 + 6)
        _, cache = module(J.array(x), cache=module.init_cache(2, 8))
        exported = jax_attn.export_cache(cache)
        assert isinstance(exported.index_key, np.ndarray)
        assert exported.index_key.shape == (2, 8, 6)
        back = jax_attn.load_cache(exported)
    np.testing.assert_array_equal(np.asarray(back.index_key), np.asarray(cache.index_key))
    bf16 = jax_attn.export_cache(jax_attn.load_cache(exported, jnp.bfloat16))
    assert bf16.index_key.dtype == np.float32


# ---- bad calls -----------------------------------------------------------------------------

def test_bad_calls_are_refused_by_name():
    c, p, x, _ = _setup("deepseek_v32", 896, length=8)
    with J.float64():
        module = _build(c, p)
        xj = J.array(x)
        for keys, match in [
            (np.zeros((2, 8, 4), np.int32), r"key_indices shape should be \(B, Lq, k\) = "
                                            r"\(2, 8, 5\), got \(2, 8, 4\)"),
            (np.zeros((2, 8, 5), np.float32), "key_indices dtype should be an integer type, "
                                              "got float32"),
            (np.full((2, 8, 5), 8, np.int32), r"key_indices should lie in \[0, Lk\) = "
                                              r"\[0, 8\), got values in \[8, 8\]"),
            (np.full((2, 8, 5), -1, np.int32), r"key_indices should lie in \[0, Lk\)"),
        ]:
            with pytest.raises(ValueError, match=match):
                module(xj, key_indices=J.array(keys))
        with pytest.raises(ValueError, match="mask should have no head axis, or one of size 1, "
                                             "with index_topk"):
            module(xj, jnp.ones((2, 3, 8, 8), bool))
        with pytest.raises(ValueError, match=r"key_indices shape should be \(B, Lq, k\) = "
                                             r"\(2, 8, 5\), got \(2, 8, 3\)"):
            module(xj, cache=module.init_cache(2, 10), key_indices=jnp.zeros((2, 8, 3), int))
        old = module.init_cache(2, 10)._replace(index_key=None)
        with pytest.raises(ValueError, match="cache.index_key should be an array"):
            module(xj, cache=old)
        wrong = module.init_cache(2, 10)._replace(index_key=jnp.zeros((2, 10, 4)))
        with pytest.raises(ValueError, match=r"cache.index_key should be \(B, M, "
                                             r"index_head_dim\) = \(2, 10, 6\) in x's dtype "
                                             r"float64, got \(2, 10, 4\) float64"):
            module(xj, cache=wrong)
        with pytest.raises(ValueError, match="return_key_indices should be True or False"):
            module(xj, return_key_indices="yes")
        dense = _build({n: v for n, v in c.items() if not n.startswith("index_")},
                       {n: a for n, a in p.items() if "index" not in n})
        with pytest.raises(ValueError, match="key_indices should be None without index_topk"):
            dense(xj, key_indices=jnp.zeros((2, 8, 5), jnp.int32))
        with pytest.raises(ValueError, match="return_key_indices should be False without "
                                             "index_topk"):
            dense(xj, return_key_indices=True)


def test_a_traced_selection_under_a_callers_jit():
    """Under nnx.jit the given key_indices are traced: their shape and dtype are checked, the
    call compiles and equals the eager one."""
    c, p, x, _ = _setup("deepseek_v32", 897, length=8)
    with J.float64():
        module = _build(c, p)
        y, keys = module(J.array(x), return_key_indices=True)

        @nnx.jit
        def call(m, x, keys):
            return m(x, key_indices=keys)

        np.testing.assert_array_equal(np.asarray(call(module, J.array(x), keys)),
                                      np.asarray(y))
        with pytest.raises(ValueError, match="key_indices shape should be"):
            call(module, J.array(x), keys[..., :4])


# ---- Hugging Face's DeepSeek-V3.2 at float64 -----------------------------------------------

@pytest.mark.parametrize("length", [12, 4])  # above and below index_topk = 5
def test_hugging_face_deepseek_v32_at_float64(length):
    """HF's DeepseekV32Attention (tests/hf_harness.py indexer_hf_case: its indexer's scores in
    float32, as it computes them in a float64 model) against the twin at float64 built from the
    same parameters: HF's keys on every row whose k-th and (k+1)-th scores are clearly apart
    (1e-4 of the largest); given HF's own choice, the output within float64's bound; with our
    own choice where every row is clear, the output and the input gradient too; with L > k,
    another choice (the first k keys) moves the output far."""
    torch = pytest.importorskip("torch")
    from tests.hf_harness import indexer_hf_case, indexer_hf_rope

    layer, config, params = indexer_hf_case(44, topk=5)
    c = variants.get(MLA).config(config)
    rng = np.random.default_rng(100 + length)
    x = rng.standard_normal((2, length, 6))
    dy = rng.standard_normal((2, length, 6))
    emb = indexer_hf_rope(config, length, 2)
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))[None, None].repeat(
        2, 1, 1, 1)
    x_hf = torch.tensor(x, requires_grad=True)
    hf_y = layer(x_hf, emb, causal)[0]
    (hf_y * torch.tensor(dy)).sum().backward()
    hf_out, hf_grad = hf_y.detach().numpy(), x_hf.grad.numpy()
    with torch.no_grad():
        q_resid = layer.q_a_layernorm(layer.q_a_proj(x_hf))
        hf_keys = layer.indexer(x_hf, q_resid, emb, causal[:, 0], None).numpy()
    with J.float64():
        module = _build(c, params)
        ours, keys = _chosen(module, x)
        given = J.numpy(module(J.array(x), key_indices=J.array(hf_keys)))
        grad = np.asarray(jax.grad(lambda xx: (module(xx) * dy).sum())(J.array(x)))
    allowed = _allowed(c, x)
    gaps = score_gaps(_scores(c, params, x, np.arange(length)), allowed, 5)
    clear, same = gaps > 1e-4, _same_keys(keys, hf_keys, allowed)
    assert same[clear].all() and clear.mean() >= 0.9
    bound = TOLERANCES[("float64", "value")].rel_norm
    assert np.linalg.norm(given - hf_out) <= bound * np.linalg.norm(hf_out)
    if clear.all():
        assert np.linalg.norm(ours - hf_out) <= bound * np.linalg.norm(hf_out)
        g_bound = TOLERANCES[("float64", "grad")].rel_norm
        assert np.linalg.norm(grad - hf_grad) <= g_bound * np.linalg.norm(hf_grad)
    if length > 5:  # the setting undone moves far: the choice matters here
        first = np.broadcast_to(np.arange(5, dtype=np.int32), hf_keys.shape)  # keys 0 … 4
        with J.float64():
            far = J.numpy(module(J.array(x), key_indices=J.array(first)))
        assert np.linalg.norm(far - hf_out) > 1e-3 * np.linalg.norm(hf_out)

"""Cross-layer KV sharing (``kv_shared=True``: Gemma 4's and Gemma 3n's last
``num_kv_shared_layers`` layers): a reusing module R, called with the cache its storing module S
returned on the same tokens, is the ordinary GroupedQueryAttention built with R's query and
output parameters and S's key and value parameters (and S's v_norm, k_eq_v), in both twins,
float64: the full forward (sliding and full layers, Gemma 4's QK norms and value norm on S),
decoding token by token (S then R at each step), right padding, a cache moved from torch to
JAX, JAX under nnx.jit, and the bad calls named. The reference and the fixtures cover the
ordinary module this one equals; tests/test_hf_import.py checks the pair against HF's model.

Shape legend: B batch, L tokens, M the cache's max_length, N query heads, Nkv key-value heads,
Dh head width.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import torch_attn
from golden.specification import variants
from tests.helpers import JAX, TWINS, fresh_rng

B, L, D_IN, N, NKV, DH = 2, 7, 10, 4, 2, 6
GQA = "grouped_query_attention"
EXACT = 1e-12  # float64: the same operations in the same order, bar the cache's padding

STORE = dict(d_in=D_IN, num_heads=N, num_kv_heads=NKV, head_dim=DH, d_out=5, qkv_bias=True,
             out_bias=True, scale=1.0, rope_theta=100.0, qk_norm="rms", v_norm=True)
LAYERS = {"sliding": dict(STORE, sliding_window=3),
          "full": dict(STORE, k_eq_v=True, rope_parameters={  # Gemma 4's full layers
              "rope_type": "proportional", "partial_rotary_factor": 0.5})}
QUERY_SIDE = ("W_query", "b_query", "q_norm", "W_out", "b_out")


def _reuse(config):
    """The reusing layer's configuration: the storing layer's, its key and value settings off."""
    return {**{n: v for n, v in config.items() if n not in ("v_norm", "k_eq_v")},
            "kv_shared": True}


def _params(config, rng):
    """Random neutral-layout parameters of a configuration: N(0, 1/fan_in) weights, N(0, 1)
    biases and norm weights."""
    shapes = variants.get(GQA).param_shapes(config)
    return {n: rng.standard_normal(s) / (np.sqrt(s[0]) if n.startswith("W_") else 1)
            for n, s in shapes.items()}


def _three(twin, layer, rng):
    """(S, R, O): the storing module, the reusing one (its own query and output parameters) and
    the ordinary one with R's query and output parameters and S's key and value parameters."""
    config = LAYERS[layer]
    store, own = _params(config, rng), _params(config, rng)
    reuse = {n: a for n, a in own.items() if n in QUERY_SIDE}
    ordinary = {**store, **reuse}
    built = [twin.build(GQA, c, p) for c, p in
             ((config, store), (_reuse(config), reuse), (config, ordinary))]
    for m in built:
        m.eval()
    return built


def _call(twin, module, x, **kw):
    kw = {n: twin.array(np.asarray(a, np.int32)) if n == "query_seq_lengths" else a
          for n, a in kw.items()}
    out = module(twin.array(x), **kw)
    return (twin.numpy(out[0]), out[1]) if "cache" in kw else twin.numpy(out)


def _pair(twin, store, reuse, x, cache, **kw):
    """S then R on the same tokens: R's output and S's new cache."""
    _, cache = _call(twin, store, x, cache=cache, **kw)
    y, same = _call(twin, reuse, x, cache=cache, **kw)
    for kept, given in zip(same, cache):  # read, never written (JAX's jit returns copies)
        np.testing.assert_array_equal(np.asarray(twin.numpy(kept)), np.asarray(twin.numpy(given)))
    return y, cache


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("room", [0, 3], ids=["M=L", "M=L+3"])
def test_reusing_layer_is_the_ordinary_one_with_the_storing_layers_keys(twin, layer, room):
    rng, seed = fresh_rng()
    x = rng.standard_normal((B, L, D_IN))
    with twin.float64():
        store, reuse, ordinary = _three(twin, layer, rng)
        want = _call(twin, ordinary, x)
        got, cache = _pair(twin, store, reuse, x, store.init_cache(B, L + room))
    assert np.abs(got - want).max() <= EXACT, f"seed {seed}"
    np.testing.assert_array_equal(np.asarray(cache.lengths), [L, L])
    assert np.abs(want).max() > 0.1  # a real output, not a row of zeros


@pytest.mark.parametrize("layer", list(LAYERS))
def test_decoding_store_then_reuse_equals_the_full_forward(twin, layer):
    # A ragged prefill (rows of 2 and 5 tokens, right-padded), then one token per row per step,
    # S then R at each step, against the ordinary module's full forward.
    rng, seed = fresh_rng()
    x = rng.standard_normal((B, L, D_IN))
    prompt = np.array([2, 5])
    with twin.float64():
        store, reuse, ordinary = _three(twin, layer, rng)
        full = _call(twin, ordinary, x)
        out = np.full((B, L, 5), np.nan)
        y, cache = _pair(twin, store, reuse, x[:, :5], store.init_cache(B, L + 2),
                         query_seq_lengths=prompt)
        for r in range(B):
            out[r, :prompt[r]] = y[r, :prompt[r]]
        for step in range(L - prompt.min()):
            pos = prompt + step
            live = pos < L
            token = x[np.arange(B), np.minimum(pos, L - 1)][:, None]  # (B, 1, d_in)
            y, cache = _pair(twin, store, reuse, token, cache, query_seq_lengths=live)
            out[live, pos[live]] = y[live, 0]
    assert np.abs(out - full).max() <= EXACT, f"seed {seed}"
    np.testing.assert_array_equal(np.asarray(cache.lengths), [L, L])


def test_right_padding_is_the_ordinary_modules(twin):
    rng, seed = fresh_rng()
    x = rng.standard_normal((B, L, D_IN))
    lengths = [L, 4]
    with twin.float64():
        store, reuse, ordinary = _three(twin, "sliding", rng)
        want = _call(twin, ordinary, x, query_seq_lengths=lengths)
        got, cache = _pair(twin, store, reuse, x, store.init_cache(B, L),
                           query_seq_lengths=lengths)
        b_out = twin.numpy(reuse.out_proj.bias)
    assert np.abs(got - want).max() <= EXACT, f"seed {seed}"
    np.testing.assert_allclose(got[1, 4:], np.broadcast_to(b_out, (L - 4, 5)), rtol=0,
                               atol=EXACT)  # padding: the output bias
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)


def test_a_cache_stored_in_torch_is_reused_in_jax():
    rng, seed = fresh_rng()
    torch_twin = TWINS["torch"]
    config = LAYERS["full"]
    store_p, own = _params(config, rng), _params(config, rng)
    reuse_p = {n: a for n, a in own.items() if n in QUERY_SIDE}
    x = rng.standard_normal((B, L, D_IN))
    with torch_twin.float64(), JAX.float64():
        store = torch_twin.build(GQA, config, store_p)
        reuse_t, reuse_j = (t.build(GQA, _reuse(config), reuse_p) for t in (torch_twin, JAX))
        _, cache = _call(torch_twin, store, x, cache=store.init_cache(B, L + 1))
        want, _ = _call(torch_twin, reuse_t, x, cache=cache)
        moved = JAX.lib.load_cache(torch_attn.export_cache(cache))
        got, _ = _call(JAX, reuse_j, x, cache=moved)
    assert np.abs(got - want).max() <= EXACT, f"seed {seed}"


def test_jax_under_nnx_jit_is_the_eager_call():
    rng, seed = fresh_rng()
    x = rng.standard_normal((B, L, D_IN))

    @nnx.jit
    def pair(store, reuse, x, cache):
        _, cache = store(x, cache=cache)
        return reuse(x, cache=cache)

    with JAX.float64():
        store, reuse, ordinary = _three(JAX, "sliding", rng)
        want = _call(JAX, ordinary, x)
        y, cache = pair(store, reuse, JAX.array(x), store.init_cache(B, L))
    assert np.abs(JAX.numpy(y) - want).max() <= EXACT, f"seed {seed}"
    np.testing.assert_array_equal(np.asarray(cache.lengths), [L, L])


def test_the_reusing_layer_has_no_key_or_value_parameters():
    shapes = variants.get(GQA).param_shapes(_reuse(LAYERS["sliding"]))
    assert sorted(shapes) == sorted(QUERY_SIDE)
    assert shapes["q_norm"] == (DH,)


# ---- bad calls, named -------------------------------------------------------------------------

def test_without_a_cache_it_says_why(twin):
    rng, _ = fresh_rng()
    with twin.float64():
        _, reuse, _ = _three(twin, "sliding", rng)
        with pytest.raises(ValueError, match=r"cache should be the storing layer's KVCache with "
                                             r"kv_shared=True .* got None"):
            reuse(twin.array(rng.standard_normal((B, L, D_IN))))
        with pytest.raises(ValueError, match=r"init_cache: a module with kv_shared=True has no "
                                             r"keys or values of its own"):
            reuse.init_cache(B, L)


def test_a_cache_of_another_shape_is_named(twin):
    rng, _ = fresh_rng()
    other = dict(LAYERS["sliding"], head_dim=8)  # a storing layer of wider heads
    with twin.float64():
        _, reuse, _ = _three(twin, "sliding", rng)
        store = twin.build(GQA, other, _params(other, rng))
        _, cache = _call(twin, store, rng.standard_normal((B, L, D_IN)),
                         cache=store.init_cache(B, L))
        with pytest.raises(ValueError, match=r"cache.key shape should be \(B, Hkv, M, Dh\) = "
                                             r"\(2, 2, \?, 6\), got \(2, 2, 7, 8\)"):
            reuse(twin.array(rng.standard_normal((B, L, D_IN))), cache=cache)


@pytest.mark.parametrize("setting, value", [("v_norm", True), ("k_eq_v", True),
                                            ("value_scale", 0.5)])
def test_the_storing_layers_settings_are_refused(twin, setting, value):
    config = dict(_reuse(LAYERS["sliding"]), **{setting: value})
    with pytest.raises(ValueError, match=rf"{setting} should be (False|None) with kv_shared=True "
                                         rf".* got {value}"):
        twin.make(GQA, config)


def test_key_parameters_given_to_a_reusing_layer_are_unexpected(twin):
    rng, _ = fresh_rng()
    config = LAYERS["sliding"]
    with pytest.raises(ValueError, match="got an unexpected W_key"):
        twin.build(GQA, _reuse(config), _params(config, rng))

"""GroupedQueryAttention beyond the golden fixtures: KV-cache decoding equals the full forward
(float64, both frameworks, ragged batches, sliding windows, across frameworks), the JAX step
compiles once and updates the cache by a scatter, a cache is never changed behind the caller's
back, tokens past max_length (dropped by both twins alike, or ValueError in both with
strict=True), the two RoPE conventions and
the permutation between them, RoPE's accuracy at long positions, PyTorch's and JAX's own kernels
on the module's core call, and errors.

Shape legend: B batch, L tokens, M the cache's max_length, N query heads, Nkv key-value heads,
Dh head width, d_in input width.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax import nnx

import jax_attn
import torch_attn
from golden import reference
from golden.specification.tolerances import UNIT_ROUNDOFF, compare
from tests.helpers import JAX, TWINS, count_compiles, fresh_rng, kind, other, sweep

GQA = "grouped_query_attention"
D_IN = 5
# Rotate-half RoPE, 6 query heads on 2 key-value heads, every dimension a different size.
CONFIG = dict(d_in=D_IN, num_heads=6, num_kv_heads=2, head_dim=4, d_out=3, qkv_bias=True,
              out_bias=True, rope_theta=100.0)
DECODE_CONFIGS = {
    "gqa_rope": CONFIG,
    "mqa_interleaved_window_softcap": dict(CONFIG, num_kv_heads=1, rope_interleaved=True,
                                           sliding_window=4, softcap=2.0, scale=0.7),
    "mha_no_rope": dict(CONFIG, num_kv_heads=6, rope_theta=None),
    # issue 23's options: the temperature reads each token's position (index + cache length)
    "qk_layer_gate_temperature": dict(CONFIG, qk_norm="layer", output_gate=True,
                                      query_temperature={"beta": 0.5, "floor_scale": 2,
                                                         "shift": 1}),
    "qk_across_heads_window": dict(CONFIG, qk_norm="rms_across_heads", sliding_window=3),
    "qk_l2_interleaved_nope_temperature": dict(
        CONFIG, qk_norm="l2", rope_theta=None,
        query_temperature={"beta": 0.3, "floor_scale": 3, "shift": 0}),
    "qk_rms_one_plus": dict(CONFIG, qk_norm="rms_one_plus", rope_interleaved=True),
    "sinks_window": dict(CONFIG, sinks=True, sliding_window=3),
    "chunks_l2": dict(CONFIG, attention_chunk_size=3, qk_norm="l2"),
    "every_option": dict(CONFIG, head_dim=8, qk_norm="rms_one_plus", sinks=True,
                         attention_chunk_size=4, sliding_window=3, output_gate=True,
                         rope_interleaved=True, partial_rotary_factor=0.5,
                         rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                          "original_max_position_embeddings": 5},
                         query_temperature={"beta": 0.2, "floor_scale": 4, "shift": 0}),
    # Hugging Face's rope_types whose frequencies do not depend on the call, and partial
    # rotary (longrope and dynamic decode as HF does instead: tests/test_rope_scaling.py)
    "llama3": dict(CONFIG, head_dim=8, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "yarn_partial": dict(CONFIG, head_dim=8, partial_rotary_factor=0.75, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 6,
        "mscale": 1.0, "mscale_all_dim": 0.5}),
    "linear_partial_interleaved": dict(CONFIG, head_dim=6, rope_interleaved=True,
                                       partial_rotary_factor=0.67,
                                       rope_parameters={"rope_type": "linear", "factor": 2.0}),
    # issue 24's ALiBi: the bias m_h · (j − p) at the cache's positions
    "alibi_bloom": dict(CONFIG, rope_theta=None, alibi="bloom"),
    "alibi_mpt_bias_max_window": dict(CONFIG, rope_theta=None, alibi="mpt", alibi_bias_max=6,
                                      sliding_window=4),
    "alibi_falcon_mqa_softcap_scale": dict(CONFIG, num_kv_heads=1, rope_theta=None,
                                           alibi="falcon", softcap=2.0, scale=0.7),
    "alibi_bloom_sinks_rope_gate": dict(CONFIG, alibi="bloom", sinks=True, output_gate=True),
    # issue 42's: the temperature's other kinds at the cache's positions, the output stage
    "temperature_power_nope_head_gate_norm": dict(
        CONFIG, rope_theta=None, query_temperature={"kind": "power", "alpha": 0.5, "length": 2},
        output_gate="softplus_per_head", gate_bias=False, output_norm="rms"),
    "temperature_learned_norm_after_rope": dict(
        CONFIG, query_temperature={"kind": "learned"}, qk_norm="rms_after_rope",
        output_norm="rms_per_head", output_gate="sigmoid_per_head"),
    "value_width_scale_sinks": dict(CONFIG, v_head_dim=5, value_scale=0.5, sinks=True,
                                    sliding_window=3, output_gate=True),
    "temperature_log_window": dict(
        CONFIG, query_temperature={"kind": "log", "alpha": 0.6, "length": 3}, sliding_window=4),
    "alibi_mpt_clip_qkv": dict(CONFIG, rope_theta=None, alibi="mpt", clip_qkv=0.5),
    # and T5's buckets of j − p, past max_distance too (9 tokens)
    "t5_buckets": dict(CONFIG, rope_theta=None, scale=1.0, relative_attention_num_buckets=8,
                       relative_attention_max_distance=6),
    "t5_buckets_rope_window": dict(CONFIG, scale=1.0, sliding_window=5,
                                   relative_attention_num_buckets=5,
                                   relative_attention_max_distance=3),
}
EXACT = 1e-12  # float64: decoding and the full forward differ only in summation order


def _params(config, rng, dtype="float64"):
    """Random neutral-layout parameters: N(0, 1/fan_in) weights, N(0, 1) biases."""
    module = torch_attn.GroupedQueryAttention(**config)
    return {n: (rng.standard_normal(a.shape) / (np.sqrt(a.shape[0]) if n.startswith("W_") else 1)
                ).astype(dtype) for n, a in torch_attn.export_params(module).items()}


def _built(twin, config, params):
    module = twin.build(GQA, config, params)
    module.eval()  # NNX's eval() returns None
    return module


def _call(twin, module, x, **kw):
    """The module on NumPy arrays (lengths as int32), outputs as float64 NumPy."""
    kw = {n: twin.array(np.asarray(a, np.int32)) if n == "query_seq_lengths" else a
          for n, a in kw.items()}
    out = module(twin.array(x), **kw)
    if "cache" in kw:
        return twin.numpy(out[0]), out[1]
    return twin.numpy(out)


def _decode(twin, module, x, prompt, max_length, cache=None):
    """Prefill row b's first prompt[b] tokens (right-padded to max(prompt)), then feed each row
    its next token one step at a time (a row with none left gets a padding token, length 0).
    Returns the outputs at every position (B, L, d_out) and the final cache."""
    b, length = x.shape[:2]
    out = np.full((b, length, CONFIG["d_out"]), np.nan)
    cache = module.init_cache(b, max_length) if cache is None else cache
    width = max(prompt)
    y, cache = _call(twin, module, x[:, :width], cache=cache, query_seq_lengths=prompt)
    for r in range(b):
        out[r, :prompt[r]] = y[r, :prompt[r]]
    for step in range(length - min(prompt)):
        pos = np.array(prompt) + step
        live = pos < length
        token = x[np.arange(b), np.minimum(pos, length - 1)][:, None]  # (B, 1, d_in)
        y, cache = _call(twin, module, token, cache=cache, query_seq_lengths=live)
        out[live, pos[live]] = y[live, 0]
    return out, cache


# ---- decoding equals the full forward ---------------------------------------------------------

# A covering few in the quick suite (every option with its kind of value at least once;
# tests/helpers.py ``sweep``), every configuration in the whole matrix.
@pytest.mark.parametrize("name", sweep(
    [pytest.param(n, id=n) for n in DECODE_CONFIGS],
    [{(k, kind(v)) for k, v in c.items()} for c in DECODE_CONFIGS.values()]))
def test_decoding_equals_full_forward(twin, name):
    rng, seed = fresh_rng()
    config = DECODE_CONFIGS[name]
    x = rng.standard_normal((2, 9, D_IN))
    with twin.float64():
        module = _built(twin, config, _params(config, rng))
        full = _call(twin, module, x)
        steps, cache = _decode(twin, module, x, prompt=[4, 4], max_length=12)
    assert np.abs(steps - full).max() <= EXACT, f"seed {seed}"
    np.testing.assert_array_equal(np.asarray(cache.lengths), [9, 9])


def test_decoding_a_ragged_batch_equals_each_rows_full_forward(twin):
    # Prompts of 2, 6 and 4 tokens, right-padded in one prefill; then one token per row per step.
    rng, seed = fresh_rng()
    x = rng.standard_normal((3, 8, D_IN))
    config = dict(CONFIG, sliding_window=5)
    with twin.float64():
        module = _built(twin, config, _params(config, rng))
        full = _call(twin, module, x)
        steps, cache = _decode(twin, module, x, prompt=[2, 6, 4], max_length=10)
    assert np.abs(steps - full).max() <= EXACT, f"seed {seed}"
    np.testing.assert_array_equal(np.asarray(cache.lengths), [8, 8, 8])


def test_full_forward_of_right_padded_rows_equals_the_unpadded_rows(twin):
    # query_seq_lengths without a cache: padding neither queries nor is attended (bidirectional
    # here, where causality alone would not hide it); padded rows give the output bias.
    rng, seed = fresh_rng()
    config = dict(CONFIG, causal=False)
    x = rng.standard_normal((2, 7, D_IN))
    with twin.float64():
        module = _built(twin, config, _params(config, rng))
        padded = _call(twin, module, x, query_seq_lengths=[7, 4])
        alone = _call(twin, module, x[1:, :4])
        b_out = twin.numpy(module.out_proj.bias)
    assert np.abs(padded[1, :4] - alone[0]).max() <= EXACT, f"seed {seed}"
    np.testing.assert_allclose(padded[1, 4:], np.broadcast_to(b_out, (3, 3)), rtol=0, atol=EXACT)


@pytest.mark.parametrize("config", [CONFIG, dict(CONFIG, v_head_dim=5, value_scale=0.5)],
                         ids=["plain", "value_width"])  # MiMo-V2-Flash's: values 5 wide
@pytest.mark.parametrize("start", list(TWINS))
def test_a_cache_filled_in_one_framework_continues_in_the_other(start, config):
    rng, seed = fresh_rng()
    first, second = TWINS[start], other(TWINS[start])
    params = _params(config, rng)
    x = rng.standard_normal((2, 9, D_IN))
    with first.float64(), second.float64():
        a, b = _built(first, config, params), _built(second, config, params)
        full = _call(first, a, x)
        head, cache = _decode(first, a, x[:, :6], prompt=[3, 5], max_length=12)
        moved = second.lib.load_cache(first.lib.export_cache(cache))
        out = np.concatenate([head, np.zeros((2, 3, CONFIG["d_out"]))], axis=1)
        for i in range(6, 9):
            y, moved = _call(second, b, x[:, i:i + 1], cache=moved)
            out[:, i] = y[:, 0]
    assert np.abs(out - full).max() <= EXACT, f"seed {seed}"


def test_exported_cache_is_a_numpy_copy(twin):
    rng, _ = fresh_rng()
    module = _built(twin, CONFIG, _params(CONFIG, rng, "float32"))
    _, cache = _call(twin, module, rng.standard_normal((2, 3, D_IN)).astype(np.float32),
                     cache=module.init_cache(2, 5))
    exported = twin.lib.export_cache(cache)
    assert all(isinstance(a, np.ndarray) for a in exported[:3]) and exported.index_key is None
    assert exported.lengths.dtype == np.int32 and exported.key.dtype == np.float32
    before = twin.numpy(cache.key).copy()
    exported.key[...] = 7.0  # writing to the export changes nothing in the framework's cache
    np.testing.assert_array_equal(twin.numpy(cache.key), before)


# ---- the cache: functional, compiled once, scattered, bounded ---------------------------------

def test_a_call_never_changes_the_cache_it_is_given(twin):
    rng, _ = fresh_rng()
    module = _built(twin, CONFIG, _params(CONFIG, rng, "float32"))
    _, cache = _call(twin, module, rng.standard_normal((2, 3, D_IN)).astype(np.float32),
                     cache=module.init_cache(2, 6))
    before = [np.array(twin.numpy(a)) for a in cache]
    _, new = _call(twin, module, rng.standard_normal((2, 2, D_IN)).astype(np.float32),
                   cache=cache)
    for a, b in zip(cache, before):
        np.testing.assert_array_equal(twin.numpy(a), b)
    np.testing.assert_array_equal(twin.numpy(new.lengths), [5, 5])
    if twin.name == "torch":  # new storage, not a view of the old
        assert new.key.data_ptr() != cache.key.data_ptr()


def test_jax_decode_step_compiles_once_and_scatters():
    rng, _ = fresh_rng()
    module = _built(JAX, CONFIG, _params(CONFIG, rng, "float32"))
    tokens = [JAX.array(rng.standard_normal((2, 1, D_IN)).astype(np.float32)) for _ in range(6)]
    _, cache = module(JAX.array(rng.standard_normal((2, 4, D_IN)).astype(np.float32)),
                      cache=module.init_cache(2, 16))
    _, cache = module(tokens[0], cache=cache)  # the first step compiles the step's program
    with count_compiles() as compiled:
        for t in tokens[1:]:
            _, cache = module(t, cache=cache)
    assert compiled == []
    np.testing.assert_array_equal(np.asarray(cache.lengths), [10, 10])

    @nnx.jit
    def step(m, x, c):  # a caller's own jit around the module
        return m(x, cache=c)

    with count_compiles() as compiled:
        for t in tokens:
            _, cache = step(module, t, cache)
    assert len(compiled) == 1, compiled
    program = str(jax.make_jaxpr(lambda x, c: module(x, cache=c))(tokens[0], cache))
    assert "scatter" in program and "callback" not in program


def test_strict_tokens_past_max_length_are_an_error(twin):
    """strict=True: the lengths read on the host, the same ValueError in both twins."""
    rng, _ = fresh_rng()
    module = _built(twin, CONFIG, _params(CONFIG, rng, "float32"))
    x = rng.standard_normal((2, 3, D_IN)).astype(np.float32)
    _, cache = _call(twin, module, x, cache=module.init_cache(2, 5), query_seq_lengths=[3, 1])
    with pytest.raises(ValueError, match=r"cache is full: rows holding \[3, 1\] tokens cannot "
                                         r"take \[3, 3\] more within max_length M = 5"):
        _call(twin, module, x, cache=cache, strict=True)
    _, cache = _call(twin, module, x, cache=cache, query_seq_lengths=[2, 3], strict=True)  # full
    np.testing.assert_array_equal(twin.numpy(cache.lengths), [5, 4])
    with pytest.raises(ValueError, match=r"query_seq_lengths should be in \[0, L = 3\]"):
        _call(twin, module, x, cache=module.init_cache(2, 5), query_seq_lengths=[4, 1],
              strict=True)


def test_jax_strict_under_jit_says_it_cannot_check():
    rng, _ = fresh_rng()
    module = _built(JAX, CONFIG, _params(CONFIG, rng, "float32"))
    x = jnp.asarray(rng.standard_normal((2, 3, D_IN)).astype(np.float32))
    step = jax.jit(lambda x, c: module(x, cache=c, strict=True))
    with pytest.raises(ValueError, match="strict=True reads the cache's lengths on the host, "
                                         "but they are traced here"):
        step(x, module.init_cache(2, 5))


def test_tokens_past_max_length_are_dropped_as_padding_in_both_twins():
    # The default in both twins (JAX has no host sync to check under jit; torch does the same):
    # what does not fit is neither written nor counted, its output rows are those of padding,
    # the output bias, and both twins agree.
    rng, seed = fresh_rng()
    params = _params(CONFIG, rng, "float64")
    x = rng.standard_normal((2, 3, D_IN))
    results = {}
    for twin in TWINS.values():
        with twin.float64():
            module = _built(twin, CONFIG, params)
            _, cache = _call(twin, module, x, cache=module.init_cache(2, 5),
                             query_seq_lengths=[3, 1])
            over, full = _call(twin, module, x, cache=cache)
            fits, expected = _call(twin, module, x, cache=cache, query_seq_lengths=[2, 3])
            np.testing.assert_array_equal(twin.numpy(full.lengths), [5, 4])
            for a, b in zip(full, expected):
                np.testing.assert_array_equal(twin.numpy(a), twin.numpy(b))
            np.testing.assert_array_equal(over[0, :2], fits[0, :2])
            np.testing.assert_allclose(over[0, 2], params["b_out"], rtol=0, atol=1e-12,
                                       err_msg=f"{twin.name}, seed {seed}")
            clipped, _ = _call(twin, module, x, cache=module.init_cache(2, 5),
                               query_seq_lengths=[4, 1])  # 4 > L = 3: clipped to 3
            results[twin.name] = (over, twin.numpy(full.key), clipped)
    for a, b in zip(results["torch"], results["jax"]):
        np.testing.assert_allclose(a, b, rtol=EXACT, atol=EXACT, err_msg=f"seed {seed}")


# ---- rotary embeddings ------------------------------------------------------------------------

def _half_from_interleaved(params, num_heads, num_kv_heads, dh):
    """Meta's interleaved RoPE weights -> rotate-half weights (Hugging Face's conversion): within
    each head, output feature 2i goes to i and 2i + 1 to i + Dh/2, for W_query and W_key and
    their biases."""
    order = np.concatenate([np.arange(0, dh, 2), np.arange(1, dh, 2)])  # new j <- old order[j]
    out = dict(params)
    for name, heads in (("query", num_heads), ("key", num_kv_heads)):
        cols = (np.arange(heads)[:, None] * dh + order).reshape(-1)
        out[f"W_{name}"] = params[f"W_{name}"][:, cols]
        if f"b_{name}" in params:
            out[f"b_{name}"] = params[f"b_{name}"][cols]
    return out


def test_rope_conventions_differ_by_the_permutation_of_q_and_k_features(twin):
    rng, seed = fresh_rng()
    interleaved = dict(CONFIG, rope_interleaved=True)
    params = _params(interleaved, rng)
    permuted = _half_from_interleaved(params, 6, 2, 4)
    x = rng.standard_normal((2, 7, D_IN))
    forward = reference.VARIANTS[GQA][0]
    want = forward(interleaved, {"x": x}, params)[0]
    assert np.abs(forward(CONFIG, {"x": x}, permuted)[0] - want).max() <= EXACT
    assert np.abs(forward(CONFIG, {"x": x}, params)[0] - want).max() > 1e-3  # they do differ
    with twin.float64():
        a = _call(twin, _built(twin, interleaved, params), x)
        b = _call(twin, _built(twin, CONFIG, permuted), x)
    assert max(np.abs(a - want).max(), np.abs(b - want).max()) <= EXACT, f"seed {seed}"


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rotary_embedding_is_exact_to_a_few_roundings_at_long_positions(twin, interleaved):
    # Positions up to 2^20 + 7 in float32: the angle tables keep the error within a few units
    # of roundoff, where the angle p·f formed in float32 (the common recipe) errs by ~p·2^-24.
    rng, seed = fresh_rng()
    x = rng.standard_normal((2, 3, 8, 64)).astype(np.float32)
    offset = np.array([2**20, 70_001], dtype=np.int32)
    f = 10000.0 ** (-np.arange(0, 64, 2) / 64)
    angles = (offset[:, None] + np.arange(8))[:, None, :, None] * f  # (B, 1, L, Dh/2) float64
    want = reference.rotate(x.astype(np.float64), angles, interleaved)
    got = twin.numpy(twin.lib.rotary_embedding(twin.array(x), theta=10000.0,
                                               interleaved=interleaved,
                                               offset=twin.array(offset),
                                               max_position=2**20 + 8))
    error = np.abs(got - want).max() / np.abs(x).max()
    assert error <= 4 * UNIT_ROUNDOFF["float32"], f"seed {seed}: {error:.2e}"
    naive = (offset[:, None] + np.arange(8)).astype(np.float32)[:, None, :, None] * f.astype(
        np.float32)  # the float32 recipe's angles
    naive_error = np.abs(reference.rotate(x.astype(np.float64), naive.astype(np.float64),
                                          interleaved) - want).max() / np.abs(x).max()
    assert naive_error > 100 * error  # why the tables: ~1e-2 against ~1e-7


# ---- the frameworks' own kernels on the module's core call ------------------------------------

def _rotated_qkv(params, x, config):
    """The module's q (B, N, L, Dh), k and v (B, Nkv, L, Dh), RoPE applied, float64 NumPy."""
    split = lambda y, n: np.swapaxes(y.reshape(y.shape[:-1] + (n, 4)), 1, 2)  # noqa: E731
    q, k, v = (split(reference.linear(x, params[f"W_{n}"], params.get(f"b_{n}")), h)
               for n, h in (("query", 6), ("key", 2), ("value", 2)))
    angles = reference.rope_angles(x.shape[1], 4, config["rope_theta"])
    return reference.rotate(q, angles, False), reference.rotate(k, angles, False), v


def test_torch_and_jax_kernels_agree_with_the_module_core_call():
    # Where their semantics overlap (GQA, causal, a left window, a scale): PyTorch's
    # scaled_dot_product_attention(enable_gqa=True) and jax.nn.dot_product_attention, float64.
    rng, seed = fresh_rng()
    config = dict(CONFIG, sliding_window=3, scale=0.6)
    params, x = _params(config, rng), rng.standard_normal((2, 7, D_IN))
    q, k, v = _rotated_qkv(params, x, config)
    window = np.tril(np.ones((7, 7), bool)) & np.triu(np.ones((7, 7), bool), -2)
    ours = {n: TWINS[n].numpy(TWINS[n].sdpa(*(TWINS[n].array(a) for a in (q, k, v)),
                                            is_causal=True, local_window_size=(2, 0), scale=0.6))
            for n in ("torch",)}
    with jax.enable_x64(True):
        ours["jax"] = np.asarray(jax_attn.scaled_dot_product_attention(
            *(jnp.asarray(a) for a in (q, k, v)), is_causal=True, local_window_size=(2, 0),
            scale=0.6))
        peer_jax = np.swapaxes(np.asarray(jax.nn.dot_product_attention(
            *(jnp.asarray(np.swapaxes(a, 1, 2)) for a in (q, k, v)), scale=0.6, is_causal=True,
            local_window_size=(2, 0), implementation="xla")), 1, 2)
    peer_torch = F.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, v)), attn_mask=torch.from_numpy(window),
        scale=0.6, enable_gqa=True).numpy()
    for name, out in ours.items():
        assert np.abs(out - peer_torch).max() <= EXACT, f"{name}, seed {seed}"
    # jax.nn's softmax always runs in float32 ("always carried out in fp32", its source), even
    # for float64 inputs: it agrees to float32's tolerance only (2e-7 seen)
    assert compare(peer_jax, peer_torch, "float32").ok, f"seed {seed}"
    # and the module's output is that core call, projected out
    merged = np.swapaxes(peer_torch, 1, 2).reshape(2, 7, 24)
    want = reference.linear(merged, params["W_out"], params["b_out"])
    with JAX.float64():
        got = _call(JAX, _built(JAX, config, params), x)
    assert np.abs(got - want).max() <= EXACT, f"seed {seed}"


# ---- errors and signatures --------------------------------------------------------------------

def test_twin_cache_signatures():
    for name in ("init_cache",):
        t = inspect.signature(getattr(torch_attn.GroupedQueryAttention, name))
        j = inspect.signature(getattr(jax_attn.GroupedQueryAttention, name))
        assert list(t.parameters) == list(j.parameters)
    for name in ("export_cache", "load_cache"):
        assert hasattr(torch_attn, name) and hasattr(jax_attn, name)
    assert torch_attn.KVCache is jax_attn.KVCache
    assert torch_attn.KVCache._fields == ("key", "value", "lengths", "index_key")


@pytest.mark.parametrize("change, message", [
    (dict(num_kv_heads=4), r"num_kv_heads should divide num_heads = 6, got 4"),
    (dict(head_dim=3), r"head_dim should be even with rotary embeddings \(rope_theta\), got 3"),
    (dict(rope_theta=-1.0), r"rope_theta should be a positive number or None, got -1.0"),
    (dict(d_in=4, num_heads=6, head_dim=None),
     r"head_dim should be given when d_in < num_heads"),
    (dict(sliding_window=0), r"sliding_window should be a positive int, got 0"),
])
def test_bad_configuration(twin, change, message):
    with pytest.raises(ValueError, match=message):
        twin.make(GQA, dict(CONFIG, **change))


def test_bad_cache(twin):
    rng, _ = fresh_rng()
    module = _built(twin, CONFIG, _params(CONFIG, rng, "float32"))
    x = rng.standard_normal((2, 3, D_IN)).astype(np.float32)
    cache = module.init_cache(2, 4)
    low = module.init_cache(2, 4, dtype=torch.bfloat16 if twin.name == "torch" else jnp.bfloat16)
    cases = [
        (cache._replace(key=cache.value[:, :1]),
         r"cache.key shape should be \(B, Hkv, M, Dh\) = \(2, 2, \?, 4\), got \(2, 1, 4, 4\)"),
        (cache._replace(value=cache.value[..., :3]),
         r"cache.value shape should be \(B, Hkv, M, Dh\) = \(2, 2, 4, 4\), got \(2, 2, 4, 3\)"),
        (cache._replace(lengths=cache.lengths[:1]),
         r"cache.lengths shape should be \(B,\) = \(2,\), got \(1,\)"),
        (low, r"cache.key dtype should be float32 \(x's\), got bfloat16"),
        ((1, 2), r"cache should be a KVCache \(key, value, lengths\) from init_cache, got tuple"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            module(twin.array(x), cache=bad)
    with pytest.raises(ValueError, match=r"x shape should be \(B, L, d_in\) with a cache"):
        module(twin.array(x[0]), cache=cache)
    with pytest.raises(ValueError, match=r"x length L should be at most the cache's max_length "
                                         r"M = 2, got 3"):
        module(twin.array(x), cache=module.init_cache(2, 2))
    with pytest.raises(ValueError, match=r"max_length should be a positive int, got 0"):
        module.init_cache(2, 0)
    with pytest.raises(ValueError, match=r"query_seq_lengths shape should be \(B,\) = \(2,\)"):
        module(twin.array(x), query_seq_lengths=twin.array(np.array([3], np.int32)))


# ---- positions: left padding and packed sequences ---------------------------------------------

# Everything that reads a position (RoPE scaled by llama3, the query temperature) or a token's
# order (causal, Hugging Face's window, a QK norm beside them).
POSITIONED = dict(CONFIG, qk_norm="rms", sliding_window=4, head_dim=8, rope_parameters={
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 4},
    query_temperature={"beta": 0.5, "floor_scale": 2, "shift": 1})


def _rows_alone(twin, module, x, real):
    """Each row's real tokens (``real`` (B, L) bool) through the module alone, unpadded, as
    one full causal forward: a list of (n_b, d_out)."""
    return [_call(twin, module, x[b:b + 1, real[b]])[0] for b in range(x.shape[0])]


def test_left_padded_prompts_decode_like_unpadded_ones(twin):
    """Row 0: 3 padding tokens, then a 5-token prompt; row 1: an 8-token prompt; then 3 tokens
    each, one at a time. positions = cumsum(real) − 1 and a mask hiding the padding's cache
    slots: every real token's output equals its row's unpadded full forward to 1e-12."""
    rng, seed = fresh_rng()
    pad, prompt, steps, room = 3, 8, 3, 16
    x = rng.standard_normal((2, prompt + steps, D_IN))
    real = np.ones((2, prompt + steps), bool)
    real[0, :pad] = False
    positions = np.maximum(np.cumsum(real, axis=1) - 1, 0).astype(np.int32)
    slots = np.zeros((2, room), bool)
    slots[:, :prompt + steps] = real  # the cache slot of each token: its index
    with twin.float64():
        module = _built(twin, POSITIONED, _params(POSITIONED, rng))
        alone = _rows_alone(twin, module, x, real)
        mask = np.broadcast_to(slots[:, None], (2, prompt, room))
        y, cache = module(twin.array(x[:, :prompt]), twin.array(mask),
                          cache=module.init_cache(2, room),
                          positions=twin.array(positions[:, :prompt]))
        outputs = [twin.numpy(y)]
        for t in range(prompt, prompt + steps):
            y, cache = module(twin.array(x[:, t:t + 1]), twin.array(slots[:, None]),
                              cache=cache, positions=twin.array(positions[:, t:t + 1]))
            outputs.append(twin.numpy(y))
    decoded = np.concatenate(outputs, axis=1)
    for b in range(2):
        assert np.abs(decoded[b, real[b]] - alone[b]).max() <= EXACT, (b, seed)
    # without the positions, the padded row is another function (RoPE counts the padding)
    with twin.float64():
        shifted = twin.numpy(module(twin.array(x[:, :prompt]), twin.array(
            np.broadcast_to(real[:, None, :prompt], (2, prompt, prompt)))))
    assert np.abs(shifted[0, pad:] - alone[0][:prompt - pad]).max() > 1e-6, seed


def test_packed_sequences_compute_each_sequence_alone(twin):
    """Two sequences of 3 and 5 tokens packed in one row (positions restarting at 0, a
    block-diagonal mask): each equals its own forward to 1e-12."""
    rng, seed = fresh_rng()
    x = rng.standard_normal((1, 8, D_IN))
    segment = np.array([0, 0, 0, 1, 1, 1, 1, 1])
    positions = np.array([[0, 1, 2, 0, 1, 2, 3, 4]], np.int32)
    mask = (segment[:, None] == segment[None, :])[None]  # (1, L, L): its own sequence only
    with twin.float64():
        module = _built(twin, POSITIONED, _params(POSITIONED, rng))
        packed = twin.numpy(module(twin.array(x), twin.array(mask),
                                   positions=twin.array(positions)))
        apart = [_call(twin, module, x[:, segment == s])[0] for s in (0, 1)]
    for s in (0, 1):
        assert np.abs(packed[0, segment == s] - apart[s]).max() <= EXACT, (s, seed)

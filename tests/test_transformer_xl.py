"""Transformer-XL's relative positional attention in GroupedQueryAttention
(``relative_positions="transformer_xl"``: bias_u, bias_v (N, Dh), W_pos (d_in, N·Dh)) against
transformers' own ParakeetEncoderAttention and ParakeetEncoderRelPositionalEncoding, float64:
the sinusoidal table against HF's (float32) and by hand, our distance index against HF's
``_rel_shift``, both twins against the attention module given our float64 table (output, and
in torch the gradients of x and the parameters), decoding with a KV cache, a
left-padded row, a long sequence through JAX's blockwise path, and bad settings; the JAX core's
``distance_query`` and ``distance_keys`` (the term as blockwise forms it, block by block)
against the bias they stand for, never formed whole, and their checks. The whole encoder's
layers, converted by from_hf, are tests/test_hf_import_speech.py's.

Where HF has a float32 step: its table (ω, the angles t·ω, sin and cos in float32, cast to the
model's dtype), and its eager softmax (float32, as Llama's; run here with "sdpa", float64).
Given our float64 table instead, HF's module has none: it agrees to 1e-12.

Shape legend: B batch, L length, D model width (d_in), N heads, Dh head width, S = L − 1.
"""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_attn
from golden import reference
from golden.specification.decoder import sinusoid_table
from golden.specification.positions import distance_index
from tests.helpers import JAX, TWINS, decoded, fresh_rng, long_blockwise_against_torch

transformers = pytest.importorskip("transformers")

from transformers.models.parakeet import modeling_parakeet  # noqa: E402

B, L, D, N, DH = 2, 7, 12, 3, 5
GQA = "grouped_query_attention"
EXACT = 1e-12
XL = "transformer_xl"


def _hf_table(width, length):
    """HF's position embeddings (2L − 1, width) as its encoder makes them (float32, cast to
    float64)."""
    config = transformers.ParakeetEncoderConfig(hidden_size=width, num_attention_heads=1)
    encoding = modeling_parakeet.ParakeetEncoderRelPositionalEncoding(config)
    return encoding(torch.zeros(1, length, width, dtype=torch.float64))[0].numpy()


def test_sinusoid_table_is_hugging_faces_to_float32s_level():
    # HF's angle t·ω is a float32 product of float32 ω (each within a few float32 roundings,
    # relative), then float32 sin and cos: |ours − HF| ≤ 2⁻²⁴ (2 + 3|t|), t = query − key.
    length, width = 1000, 16
    ours, theirs = sinusoid_table(width, length - 1), _hf_table(width, length)
    t = np.arange(length - 1, -length, -1)[:, None]  # HF's rows: t = L − 1 … −(L − 1)
    assert ours.shape == theirs.shape == (2 * length - 1, width)
    assert np.all(np.abs(ours - theirs) <= 2.0**-24 * (2 + 3 * np.abs(t)))
    assert np.abs(ours - theirs).max() > 1e-6  # the float32 angles are visible far out


def test_sinusoid_table_by_hand():
    # width 4: ω = (1, 10000^(−1/2) = 0.01); row S + d holds R(−d).
    table = sinusoid_table(4, 2)
    np.testing.assert_array_equal(table[2], [0.0, 1.0, 0.0, 1.0])  # d = 0
    np.testing.assert_allclose(table[1], [np.sin(1), np.cos(1), np.sin(0.01), np.cos(0.01)],
                               rtol=1e-15)  # d = −1: t = 1
    np.testing.assert_allclose(table[4], [np.sin(-2), np.cos(2), np.sin(-0.02), np.cos(0.02)],
                               rtol=1e-15)  # d = 2: t = −2


def test_distance_index_is_hfs_rel_shift():
    # HF's matrix_bd (B, N, L, 2L − 1), shifted and cut to (B, N, L, L), is our gather of
    # the same products at S + j − i.
    rng = np.random.default_rng(0)
    raw = torch.from_numpy(rng.standard_normal((B, N, L, 2 * L - 1)))
    attention = modeling_parakeet.ParakeetEncoderAttention(
        transformers.ParakeetEncoderConfig(hidden_size=D, num_attention_heads=N), layer_idx=0)
    theirs = attention._rel_shift(raw)[..., :L].numpy()
    index = distance_index(2 * L - 1, np.arange(L)[None, :], np.arange(L)[:, None])
    np.testing.assert_array_equal(np.take_along_axis(raw.numpy(), np.broadcast_to(
        index, (B, N, L, L)), axis=-1), theirs)


def _parakeet(rng):
    """HF's attention (float64, sdpa: its eager softmax is float32; random weights and biases)
    and its conversion."""
    config = transformers.ParakeetEncoderConfig(hidden_size=D, num_attention_heads=N,
                                                attention_dropout=0.0)
    config._attn_implementation = "sdpa"
    hf = modeling_parakeet.ParakeetEncoderAttention(config, layer_idx=0).double().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)) * 0.5))
    linear = lambda m: m.weight.detach().numpy().T.copy()  # noqa: E731
    params = {"W_query": linear(hf.q_proj), "W_key": linear(hf.k_proj),
              "W_value": linear(hf.v_proj), "W_out": linear(hf.o_proj),
              "W_pos": linear(hf.relative_k_proj),
              "bias_u": hf.bias_u.detach().numpy().copy(),
              "bias_v": hf.bias_v.detach().numpy().copy()}
    params.update({f"b_{r}": getattr(hf, m).bias.detach().numpy().copy() for r, m in (
        ("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj"), ("out", "o_proj"))})
    ours = dict(d_in=D, num_heads=N, num_kv_heads=N, qkv_bias=True, out_bias=True,
                causal=False, relative_positions=XL)
    return hf, ours, params


def _hf_mask(lengths):
    """HF's encoder mask (B, 1, L, L): both tokens real."""
    real = np.arange(L)[None, :] < np.asarray(lengths)[:, None]  # (B, L)
    return torch.from_numpy(real[:, None, :, None] & real[:, None, None, :])


@pytest.mark.parametrize("framework", list(TWINS))
def test_module_matches_parakeet_attention(framework):
    # HF's module given our float64 table (no float32 step left) on right-padded rows: the
    # real rows' output to 1e-12; in torch the gradients of x and of the parameters (HF's
    # padded rows, which attend nothing, are its own: no cotangent there).
    twin, (rng, seed) = TWINS[framework], fresh_rng()
    hf, config, params = _parakeet(rng)
    lengths = np.array([L, 4])
    x = rng.standard_normal((B, L, D))
    dy = rng.standard_normal((B, L, D)) * (np.arange(L)[None, :, None] < lengths[:, None, None])
    xt = torch.from_numpy(x).requires_grad_()
    table = torch.from_numpy(np.array(sinusoid_table(D, L - 1)))[None].expand(B, -1, -1)
    y, _ = hf(xt, table, attention_mask=_hf_mask(lengths))
    (y * torch.from_numpy(dy)).sum().backward()
    with twin.float64():
        module = twin.build(GQA, config, params)
        module.eval()
        ours_x = twin.array(x)
        if framework == "torch":
            ours_x.requires_grad_()
        out = module(ours_x, query_seq_lengths=twin.array(lengths.astype(np.int32)))
    real = np.arange(L)[None, :] < lengths[:, None]  # (B, L)
    y = y.detach().numpy()[real]
    assert np.abs(twin.numpy(out)[real] - y).max() <= EXACT * np.abs(y).max(), f"seed {seed}"
    if framework == "torch":
        (out * torch.from_numpy(dy)).sum().backward()
        assert np.abs(ours_x.grad.numpy() - xt.grad.numpy()).max() <= EXACT * np.abs(
            xt.grad.numpy()).max(), f"seed {seed}: x"
        theirs = {"W_pos": hf.relative_k_proj.weight.grad.numpy().T,
                  "bias_u": hf.bias_u.grad.numpy(), "bias_v": hf.bias_v.grad.numpy(),
                  "W_query": hf.q_proj.weight.grad.numpy().T, "b_out": hf.o_proj.bias.grad}
        ours = {"W_pos": module.W_pos.weight.grad.numpy().T, "bias_u": module.bias_u.grad,
                "bias_v": module.bias_v.grad, "W_query": module.W_query.weight.grad.numpy().T,
                "b_out": module.out_proj.bias.grad}
        for name, g in theirs.items():
            g, mine = np.asarray(g), np.asarray(ours[name])
            assert np.abs(mine - g).max() <= EXACT * np.abs(g).max(), f"seed {seed}: {name}"


@pytest.mark.parametrize("framework", list(TWINS))
def test_decoding_equals_the_full_forward(framework):
    # Causal, with a cache: token i at position cache length + i reads e at S + j − p, as in
    # the full forward; prefill of 4 then one token at a time, float64, 1e-12.
    twin, (rng, seed) = TWINS[framework], fresh_rng()
    config = dict(d_in=6, num_heads=4, num_kv_heads=2, head_dim=4, d_out=5, qkv_bias=True,
                  relative_positions=XL, rope_theta=50.0)
    x = rng.standard_normal((B, L, 6))
    with twin.float64():
        made = twin.make(GQA, config)
        params = {n: rng.standard_normal(np.shape(a)) for n, a in twin.export(made).items()}
        module = twin.build(GQA, config, params)
        module.eval()
        full = twin.numpy(module(twin.array(x)))
        steps = decoded(twin, module, x, 4)
    assert np.abs(steps - full).max() <= EXACT, f"seed {seed}"


@pytest.mark.parametrize("framework", list(TWINS))
def test_left_padded_row_equals_the_sequence_alone(framework):
    # The distances are in token order (as ALiBi's): among a left-padded row's real tokens they
    # are those of the sequence alone, and the mask hides the pads.
    twin, (rng, seed) = TWINS[framework], fresh_rng()
    config = dict(d_in=6, num_heads=2, num_kv_heads=2, head_dim=4, d_out=3, causal=False,
                  relative_positions=XL)
    pad = 3
    x = rng.standard_normal((1, L, 6))
    allowed = np.ones((L, L), bool) & (np.arange(L) >= pad)  # (L, L): pads hidden
    with twin.float64():
        made = twin.make(GQA, config)
        params = {n: rng.standard_normal(np.shape(a)) for n, a in twin.export(made).items()}
        module = twin.build(GQA, config, params)
        module.eval()
        padded = twin.numpy(module(twin.array(x), twin.array(allowed[None])))
        alone = twin.numpy(module(twin.array(x[:, pad:])))
    assert np.abs(padded[:, pad:] - alone).max() <= EXACT, f"seed {seed}"


def test_a_long_sequence_runs_blockwise_and_equals_torch():
    # L = 1100 > 1024: the JAX core takes "blockwise", which forms the position term block by
    # block (distance_query, distance_keys); torch forms the (N, L, L) bias. Float64, 1e-12.
    out, expected, ran, seed = long_blockwise_against_torch(
        dict(d_in=4, num_heads=3, num_kv_heads=1, head_dim=2, d_out=2, causal=False,
             relative_positions=XL))
    assert ("jax", "blockwise") in ran
    assert np.abs(out - expected).max() <= EXACT * np.abs(expected).max(), f"seed {seed}"


@pytest.mark.parametrize("change, message", [
    (dict(relative_positions="rotary"),
     r"relative_positions should be None or one of 'transformer_xl', 'shaw', 'conformer_timing', "
     r"got 'rotary'"),
    (dict(relative_positions=XL, d_in=5),
     r"d_in should be even with relative_positions \(the sinusoidal table's sin and cos "
     r"pairs\), got 5"),
    (dict(relative_positions=XL, alibi="bloom"),
     r"alibi should be None with relative_positions \(one position bias\), got 'bloom'"),
    (dict(relative_positions=XL, relative_attention_num_buckets=8, causal=False),
     r"relative_attention_num_buckets should be None with relative_positions \(one position "
     r"bias\), got 8"),
])
@pytest.mark.parametrize("framework", list(TWINS))
def test_bad_relative_positions_settings(framework, change, message):
    with pytest.raises(ValueError, match=message):
        TWINS[framework].make(GQA, dict(dict(d_in=6, num_heads=2, num_kv_heads=2, head_dim=4),
                                        **change))


# ---- the JAX core's distance_query and distance_keys ----------------------------------------

CB, CH, CHKV, CLQ, CLK, CD, CDR = 2, 4, 2, 7, 9, 3, 5  # the core's sizes, every one distinct


def _materialised(query, keys, offset, lk):
    """distance_query (B, H, Lq, Dr) and distance_keys (H, 2S + 1, Dr) as the (B, H, Lq, Lk)
    bias they stand for, by NumPy loops: row i of batch b at i + offset[b], key j, entry
    S + clip(j − position, −S, S)."""
    span = (keys.shape[1] - 1) // 2
    out = np.empty(query.shape[:3] + (lk,))
    for b, h, i, j in np.ndindex(out.shape):
        d = span + min(max(j - (i + offset[b]), -span), span)
        out[b, h, i, j] = query[b, h, i] @ keys[h, d]
    return out


@pytest.mark.parametrize("implementation", ["explicit", "blockwise"])
@pytest.mark.parametrize("span", [3, CLQ + CLK])  # 3: most distances take an end of the table
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_distance_product_equals_the_term_it_stands_for(implementation, span, softcap):
    # Output and every gradient equal the float64 reference core's with the (B, H, Lq, Lk)
    # term as its position_term (part of R: inside the cap); the query's and the table's
    # gradients those of the term pushed through its definition.
    rng, seed = fresh_rng()
    arrays = {n: rng.standard_normal(s) for n, s in (
        ("query", (CB, CH, CLQ, CD)), ("key", (CB, CHKV, CLK, CD)),
        ("value", (CB, CHKV, CLK, 6)), ("distance_query", (CB, CH, CLQ, CDR)),
        ("distance_keys", (CH, 2 * span + 1, CDR)))}
    offset = np.array([0, 5], "int32")
    settings = dict(query_offset=offset, key_value_seq_lengths=np.array([CLK, 6], "int32"),
                    is_causal=True, local_window_size=(6, None), softcap=softcap)
    kw = {"block_sizes": (2, 3)} if implementation == "blockwise" else {}
    d_out = rng.standard_normal((CB, CH, CLQ, 6))
    term = _materialised(arrays["distance_query"], arrays["distance_keys"], offset, CLK)
    with JAX.float64():
        def loss(names, fn, **given):
            def f(*xs):
                return jnp.sum(fn(**dict(zip(names, xs)), **settings) * d_out)
            return jax.value_and_grad(f, argnums=tuple(range(len(names))))(
                *(jnp.asarray(given[n]) for n in names))
        names = list(arrays)
        value, grads = loss(names, partial(jax_attn.scaled_dot_product_attention,
                                           implementation=implementation, **kw), **arrays)
        value = float(value)
        grads = {n: np.asarray(g) for n, g in zip(names, grads)}
    plain = {n: arrays[n] for n in ("query", "key", "value")}
    out, weights, saved = reference.sdpa_forward(**plain, position_term=term, **settings)
    ref = float(np.sum(out * d_out))
    ref_grads = reference.sdpa_backward(saved, d_out, np.zeros_like(weights))
    assert abs(value - ref) <= 1e-12 * abs(ref), f"seed {seed}"
    for n in ("query", "key", "value"):
        np.testing.assert_allclose(grads[n], ref_grads[n], rtol=0, atol=1e-12,
                                   err_msg=f"{n}, seed {seed}")
    g_bias, index = ref_grads["position_term"], np.zeros((CB, CLQ, CLK), int)
    for b, i, j in np.ndindex(index.shape):
        index[b, i, j] = span + min(max(j - (i + offset[b]), -span), span)
    keys = arrays["distance_keys"]
    want_query = np.einsum("bhij,hbijd->bhid", g_bias, keys[:, index])
    want_keys = np.zeros_like(keys)
    for b, h, i, j in np.ndindex(g_bias.shape):
        want_keys[h, index[b, i, j]] += g_bias[b, h, i, j] * arrays["distance_query"][b, h, i]
    np.testing.assert_allclose(grads["distance_query"], want_query, rtol=0, atol=1e-12,
                               err_msg=f"seed {seed}")
    np.testing.assert_allclose(grads["distance_keys"], want_keys, rtol=0, atol=1e-12,
                               err_msg=f"seed {seed}")


def test_distance_product_is_never_formed_as_scores():
    # The blockwise program holds the query's vectors (Lq, Dr), the table (2S + 1, Dr) and one
    # block's products with its band of distances (Bq, Bq + Bk − 1), never (Lq, Lk) nor
    # (Lq, 2S + 1).
    lq, lk, d, dr = 64, 96, 8, 4
    q = jax.ShapeDtypeStruct((1, 2, lq, d), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 2, lk, d), jnp.float32)
    query = jax.ShapeDtypeStruct((1, 2, lq, dr), jnp.float32)
    keys = jax.ShapeDtypeStruct((2, 2 * lk - 1, dr), jnp.float32)

    def loss(q, k, v, query, keys):
        return jnp.sum(jax_attn.scaled_dot_product_attention(
            q, k, v, distance_query=query, distance_keys=keys, implementation="blockwise",
            block_sizes=(16, 32)))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(q, k, k, query,
                                                                    keys).as_text()
    sizes = [int(np.prod([int(n) for n in dims.split("x")[:-1]]))
             for dims in re.findall(r"tensor<((?:\d+x)+)\w+>", text)]
    assert "stablehlo.while" in text
    assert max(sizes) <= 2 * max(16 * 32, lk * d, (2 * lk - 1) * dr) < lq * lk, max(sizes)


@pytest.mark.parametrize("given, match", [
    (dict(distance_query=(CB, CH, CLQ, CDR)),
     r"distance_keys should be given with distance_query \(their product is the bias\), got "
     r"None"),
    (dict(distance_query=(CB, CH, CLQ, CDR), distance_keys=(CH, 8, CDR)),
     r"distance_keys's axis D should be odd \(2S \+ 1: distances −S … S\), got D = 8"),
    (dict(distance_query=(CB, CH, CLQ + 1, CDR), distance_keys=(CH, 9, CDR)),
     r"distance_query shape should be \(B, H, Lq, Dr\) = \(2, 4, 7, \?\), got \(2, 4, 8, 5\)"),
    (dict(distance_query=(CH, CLQ, CDR), distance_keys=(CH, 9, CDR + 1)),
     r"distance_keys shape should be \(H, D, Dr\) = \(4, \?, 5\), got \(4, 9, 6\)"),
])
def test_bad_distance_product(given, match):
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal(s), jnp.float32)
            for s in ((CB, CH, CLQ, CD), (CB, CHKV, CLK, CD)))
    with pytest.raises(ValueError, match=match):
        jax_attn.scaled_dot_product_attention(q, k, k, **{n: jnp.zeros(s) for n, s in
                                                          given.items()})

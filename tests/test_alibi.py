"""ALiBi in GroupedQueryAttention (``alibi`` "bloom", "mpt" or "falcon", ``alibi_bias_max``)
against transformers' own code, float64: the slopes against HF's functions for every head count
to 70 (``_get_alibi_slopes``, ``build_mpt_alibi_tensor``, Falcon's ``build_alibi_tensor``), a few
by hand, and our torch and JAX modules against BloomAttention, MptAttention and FalconAttention
(eager, multi-query) themselves, fed HF's own alibi tensors and masks, with their fused
query_key_value mapped to our neutral parameters here: output, weights, and (torch) the
gradients of x and every parameter.

Where HF has a float32 step: its slopes are float32 (bfloat16 for Falcon); they are powers of
two, exact, when the exponents are integers (N ≤ 8 heads with alibi_bias_max = 8), and round
otherwise (MPT's alibi_bias_max = 6 here). BLOOM and MPT take the softmax in float32 (a float64
model is downcast there); Falcon's eager softmax is float64. The form of the bias differs and
does not matter: BLOOM and Falcon add m_h · j, MPT m_h · (j − (Lk − 1)), ours m_h · (j − p),
the same up to a constant per row, which softmax removes.

Shape legend: B batch, L length, D model width, N heads, Dh head width; every size distinct.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from golden.specification.decoder import alibi_slopes
from tests.helpers import TWINS, fresh_rng, long_blockwise_against_torch
from torch_attn.params import export_grads

transformers = pytest.importorskip("transformers")

from transformers.models.bloom import modeling_bloom  # noqa: E402
from transformers.models.falcon import modeling_falcon  # noqa: E402
from transformers.models.mpt import modeling_mpt  # noqa: E402

from tests.hf_harness import draw_parameters  # noqa: E402

B, L, N, DH = 3, 7, 6, 4
D = N * DH  # 24: HF's families have Dh = D / N
GQA = "grouped_query_attention"
FLOAT32_LEVEL = 1e-6  # BLOOM's and MPT's float32 softmax (and MPT's float32 slopes)
# Their gradients go through HF's float32 softmax backward too, whose cancellation adds to it:
# over 150 seeds per family the largest relative error was 2.5e-6 (BLOOM; MPT 1.6e-6), the
# medians 4e-7, and 1e-6 failed about 2 % of the runs. Hence 4x.
FLOAT32_GRADIENT = 4 * FLOAT32_LEVEL
EXACT = 1e-12


def _hf_bloom_slopes(n):
    return modeling_bloom._get_alibi_slopes(n, "cpu").double().numpy()


def _hf_mpt_slopes(n, bias_max):
    # (N, 1, L) of m_h · (j − (L − 1)): the slopes are the column j = L − 2, negated
    return -modeling_mpt.build_mpt_alibi_tensor(n, 2, bias_max)[:, 0, 0].double().numpy()


def _hf_falcon_slopes(n):
    # (N, 1, L) of m_h · j for a mask of ones: column j = 1
    ones = torch.ones(1, 2, dtype=torch.long)
    return modeling_falcon.build_alibi_tensor(ones, n, torch.float64)[:, 0, 1].numpy()


@pytest.mark.parametrize("n", range(1, 71))
def test_slopes_are_hugging_faces(n):
    exact = n <= 8  # integer exponents: powers of two in float32 and float64 alike
    for ours, theirs in ((alibi_slopes(n, "bloom"), _hf_bloom_slopes(n)),
                         (alibi_slopes(n, "mpt"), _hf_mpt_slopes(n, 8)),
                         (alibi_slopes(n, "mpt", 6), _hf_mpt_slopes(n, 6))):
        assert ours.shape == (n,) and ours.dtype == np.float64
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=0)  # HF's float32
    np.testing.assert_array_equal(alibi_slopes(n, "falcon"), _hf_falcon_slopes(n))  # bfloat16
    if exact:
        np.testing.assert_array_equal(alibi_slopes(n, "bloom"), _hf_bloom_slopes(n))
        np.testing.assert_array_equal(alibi_slopes(n, "mpt"), _hf_mpt_slopes(n, 8))


def test_slopes_by_hand():
    # BLOOM, N = 3: P = 2 gives 2^−4, 2^−8; one more head, the odd power of 2^−2: 2^−2.
    np.testing.assert_array_equal(alibi_slopes(3, "bloom"), [1 / 16, 1 / 256, 1 / 4])
    # BLOOM, N = 6: P = 4 gives 2^−2 … 2^−8, then 2^−1, 2^−3 (the odd powers of 2^−1).
    np.testing.assert_array_equal(alibi_slopes(6, "bloom"), 2.0 ** -np.array([2, 4, 6, 8, 1, 3]))
    # MPT, N = 4, alibi_bias_max 4: 2^−(h · 4 / 4).
    np.testing.assert_array_equal(alibi_slopes(4, "mpt", 4), [1 / 2, 1 / 4, 1 / 8, 1 / 16])
    # MPT, N = 3, max 8: P = 4 gives 2^−2, 2^−4, 2^−6, 2^−8; odd-indexed first, then even: 3 kept.
    np.testing.assert_array_equal(alibi_slopes(3, "mpt"), [1 / 16, 1 / 256, 1 / 4])
    # Falcon rounds to bfloat16 (8 significant bits): 2^−1/4 = 0.8408964… -> 0.83984375.
    assert alibi_slopes(32, "falcon")[0] == 0.83984375


# ---- the modules against HF's attention classes ------------------------------------------------

def _randomize(module, rng):
    draw_parameters(module, rng)


def _causal_additive(batch=B):
    """HF's additive causal mask (B, 1, L, L): 0 where allowed, float64's min elsewhere."""
    allowed = torch.ones(L, L, dtype=torch.bool).tril()
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(allowed, zero, torch.finfo(torch.float64).min).expand(batch, 1, L, L)


def _neutral(weight, bias, layout):
    """A fused query_key_value (out, D) and bias (out,) as neutral W_* (D, ·) and b_*: "bloom"
    per head [q_h, k_h, v_h] (view (N, 3, Dh)); "mpt" [q, k, v] by thirds; "falcon" multi-query
    [q_0 … q_{N−1}, k, v] (view (N + 2, Dh))."""
    w = weight.detach().numpy()
    b = None if bias is None else bias.detach().numpy()
    if layout == "bloom":
        parts = [w.reshape(N, 3, DH, D)[:, t].reshape(N * DH, D) for t in range(3)]
        bparts = None if b is None else [b.reshape(N, 3, DH)[:, t].reshape(-1) for t in range(3)]
    else:
        cuts = [0, D, 2 * D, 3 * D] if layout == "mpt" else [0, D, D + DH, D + 2 * DH]
        parts = [w[cuts[t]:cuts[t + 1]] for t in range(3)]
        bparts = None if b is None else [b[cuts[t]:cuts[t + 1]] for t in range(3)]
    params = {f"W_{n}": p.T.copy() for n, p in zip(("query", "key", "value"), parts)}
    if bparts is not None:
        params.update({f"b_{n}": p.copy() for n, p in zip(("query", "key", "value"), bparts)})
    return params


def _bloom(rng, x):
    config = modeling_bloom.BloomConfig(hidden_size=D, n_head=N, attention_dropout=0.0,
                                        hidden_dropout=0.0)
    hf = modeling_bloom.BloomAttention(config, layer_idx=0).double().eval()
    _randomize(hf, rng)
    alibi = modeling_bloom.build_alibi_tensor(torch.ones(B, L, dtype=torch.long), N,
                                              torch.float64)  # (B·N, 1, L): m_h · j
    y, w = hf(x, torch.zeros_like(x), alibi, _causal_additive(), output_attentions=True)
    params = _neutral(hf.query_key_value.weight, hf.query_key_value.bias, "bloom")
    params.update(W_out=hf.dense.weight.detach().numpy().T.copy(),
                  b_out=hf.dense.bias.detach().numpy().copy())
    ours = dict(d_in=D, num_heads=N, num_kv_heads=N, qkv_bias=True, out_bias=True, alibi="bloom")
    return ours, params, y, w, FLOAT32_LEVEL, hf


def _mpt(rng, x, bias_max, clip_qkv=None):
    config = modeling_mpt.MptConfig(d_model=D, n_heads=N, max_seq_len=L,
                                    attn_config={"alibi_bias_max": bias_max,
                                                 "clip_qkv": clip_qkv})
    hf = modeling_mpt.MptAttention(config, layer_idx=0).double().eval()
    _randomize(hf, rng)
    bias = modeling_mpt.build_mpt_alibi_tensor(N, L, bias_max).double()  # (N, 1, L)
    masked = ~torch.ones(L, L, dtype=torch.bool).tril()  # MPT's mask: True = masked out
    y, w = hf(x, bias, attention_mask=masked)
    params = _neutral(hf.Wqkv.weight, None, "mpt")
    params["W_out"] = hf.out_proj.weight.detach().numpy().T.copy()
    ours = dict(d_in=D, num_heads=N, num_kv_heads=N, alibi="mpt", alibi_bias_max=bias_max,
                clip_qkv=clip_qkv)
    return ours, params, y, w, FLOAT32_LEVEL, hf


def _falcon(rng, x):
    config = modeling_falcon.FalconConfig(hidden_size=D, num_attention_heads=N, alibi=True,
                                          multi_query=True, new_decoder_architecture=False,
                                          bias=True, attention_dropout=0.0, hidden_dropout=0.0,
                                          attn_implementation="eager")
    hf = modeling_falcon.FalconAttention(config, layer_idx=0).double().eval()
    _randomize(hf, rng)
    alibi = modeling_falcon.build_alibi_tensor(torch.ones(B, L, dtype=torch.long), N,
                                               torch.float64)  # (B·N, 1, L): bf16(m_h) · j
    # eager: (q kᵀ + alibi) / √Dh, then the mask added (here the plain causal one)
    y, w = hf(x, alibi, _causal_additive(), output_attentions=True)
    params = _neutral(hf.query_key_value.weight, hf.query_key_value.bias, "falcon")
    params.update(W_out=hf.dense.weight.detach().numpy().T.copy(),
                  b_out=hf.dense.bias.detach().numpy().copy())
    ours = dict(d_in=D, num_heads=N, num_kv_heads=1, qkv_bias=True, out_bias=True,
                alibi="falcon")
    return ours, params, y, w, EXACT, hf


FAMILIES = {"bloom": _bloom, "mpt_bias_max_8": lambda rng, x: _mpt(rng, x, 8),
            "mpt_bias_max_6": lambda rng, x: _mpt(rng, x, 6),
            "mpt_clip_qkv": lambda rng, x: _mpt(rng, x, 8, clip_qkv=3.0),  # ~1/5 clipped here
            "falcon_multi_query": _falcon}


def _rel(actual, expected):
    return np.abs(actual - expected).max() / np.abs(expected).max()


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("framework", list(TWINS))
def test_module_matches_transformers(family, framework):
    twin = TWINS[framework]
    rng, seed = fresh_rng()
    x = rng.standard_normal((B, L, D))
    with torch.no_grad():
        config, params, y, w, level, _ = FAMILIES[family](rng, torch.from_numpy(x))
    with twin.float64():
        module = twin.build(GQA, config, params)
        module.eval()
        out, weights = module(twin.array(x), return_weights=True)
    y, w = y.numpy(), w.reshape(B, N, L, L).numpy()
    assert _rel(twin.numpy(out), y) <= level, f"{family} seed {seed}: output"
    assert np.abs(twin.numpy(weights) - w).max() <= level, f"{family} seed {seed}: weights"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gradients_match_transformers(family):
    # The gradients of Σ y ⊙ dO with respect to x and every parameter: HF's module by autograd,
    # its fused weights' gradients mapped to ours as the weights are (_neutral), against the
    # torch twin's, float64, at the family's level.
    rng, seed = fresh_rng()
    x = rng.standard_normal((B, L, D))
    d_out = torch.from_numpy(rng.standard_normal((B, L, D)))
    xt = torch.from_numpy(x).requires_grad_()
    config, params, y, _, level, hf = FAMILIES[family](rng, xt)
    level = FLOAT32_GRADIENT if level == FLOAT32_LEVEL else level
    (y * d_out).sum().backward()
    layout = {"bloom": "bloom", "falcon_multi_query": "falcon"}.get(family, "mpt")
    fused = hf.Wqkv if layout == "mpt" else hf.query_key_value
    out = hf.out_proj if layout == "mpt" else hf.dense
    theirs = _neutral(fused.weight.grad, fused.bias.grad if fused.bias is not None else None,
                      layout)
    theirs["W_out"] = out.weight.grad.numpy().T
    if out.bias is not None:
        theirs["b_out"] = out.bias.grad.numpy()
    twin = TWINS["torch"]
    with twin.float64():
        module = twin.build(GQA, config, params)
        module.eval()
        ours_x = torch.from_numpy(x).requires_grad_()
        (module(ours_x) * d_out).sum().backward()
    assert _rel(ours_x.grad.numpy(), xt.grad.numpy()) <= level, f"{family} seed {seed}: x"
    ours = export_grads(module)
    assert set(ours) == set(theirs), family
    for name, g in theirs.items():
        if name == "b_key":  # zero by structure (softmax ignores a constant per row)
            assert np.abs(ours[name]).max() <= 1e-12 * np.abs(ours["W_key"]).max()
            continue
        assert _rel(ours[name], g) <= level, f"{family} seed {seed}: {name}"


# ---- properties and errors ---------------------------------------------------------------------

@pytest.mark.parametrize("framework", list(TWINS))
def test_left_padded_row_equals_the_sequence_alone(framework):
    # ALiBi reads token order (as the mask does), RoPE the positions: on the pairs a left-padded
    # row attends, key − query is the same in both, so the row computes as its sequence alone.
    twin, (rng, seed) = TWINS[framework], fresh_rng()
    config = dict(d_in=5, num_heads=6, num_kv_heads=2, head_dim=4, d_out=3, rope_theta=100.0,
                  alibi="bloom")
    pad = 3
    x = rng.standard_normal((1, L, 5))
    allowed = np.tril(np.ones((L, L), bool)) & (np.arange(L) >= pad)  # (L, L): pads hidden
    positions = np.maximum(np.arange(L) - pad, 0)[None].astype(np.int32)  # (1, L)
    with twin.float64():
        module = twin.make(GQA, config)
        module.eval()
        params = {n: rng.standard_normal(np.shape(a)) for n, a in twin.export(module).items()}
        module = twin.build(GQA, config, params)
        module.eval()
        padded = twin.numpy(module(twin.array(x), twin.array(allowed[None]),
                                   positions=twin.array(positions)))
        alone = twin.numpy(module(twin.array(x[:, pad:])))
    assert np.abs(padded[:, pad:] - alone).max() <= EXACT, f"seed {seed}"


@pytest.mark.parametrize("change, message", [
    (dict(alibi="t5"), r"alibi should be None or one of 'bloom', 'mpt', 'falcon', got 't5'"),
    (dict(alibi="mpt", alibi_bias_max=0), r"alibi_bias_max should be a positive number, got 0"),
    (dict(alibi="bloom", alibi_bias_max=4),
     r"alibi_bias_max should be 8 \(its default\) unless alibi is 'mpt', got 4 with alibi = "
     r"'bloom'"),
])
@pytest.mark.parametrize("framework", list(TWINS))
def test_bad_alibi_settings(framework, change, message):
    with pytest.raises(ValueError, match=message):
        TWINS[framework].make(GQA, dict(d_in=5, num_heads=6, num_kv_heads=2, head_dim=4,
                                            **change))


@pytest.mark.parametrize("bias", [dict(alibi="mpt"), dict(alibi="falcon", causal=False),
                                  dict(relative_attention_num_buckets=16, causal=False)])
def test_a_long_sequence_runs_blockwise_and_equals_torch(bias):
    # L = 1100 > 1024: the JAX core takes "blockwise", which gathers the position bias per block
    # from a (N, 2S + 1) table (the core's distance_bias), never an (N, L, L) array; torch adds
    # the bias it forms. Float64, output at 1e-12.
    out, expected, ran, seed = long_blockwise_against_torch(
        dict(d_in=5, num_heads=3, num_kv_heads=1, head_dim=4, d_out=2, **bias))
    assert ("jax", "blockwise") in ran
    assert np.abs(out - expected).max() <= EXACT, f"seed {seed}"

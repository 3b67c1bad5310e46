"""The PyTorch twin of Gated DeltaNet (issue 43, torch_attn.recurrent) against the float64
reference (golden.reference.delta_rule): forward and gradients, "recurrent" against "chunked",
float32 and bfloat16 within a bound growing with L, prefill then decode through the cache, the
cache's export and load, bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_attn
from golden.reference.delta_rule import MIXERS
from golden.specification import implementations, recurrent
from golden.specification.recurrent import RecurrentCache
from golden.specification.tolerances import compare
from golden.specification.tolerances import RECURRENT_TOLERANCES as RECURRENT
from tests.helpers import fresh_rng
from tests.recurrent_checks import assert_low_precision_within_bound, torch_output, x_terms
from torch_attn.params import export_grads
from torch_attn.recurrent import DELTA_RULE_IMPLEMENTATIONS, gated_delta_rule

GDN = "gated_delta_net"
SAMPLE = recurrent.get(GDN).sample  # d_in 5, Hk 2, Hv 4, Dk 3, Dv 6, d_out 7, K 3


def _params(rng, config, scale=0.5):
    shapes = recurrent.get(GDN).param_shapes(config)
    return {n: rng.standard_normal(s) * scale for n, s in shapes.items()}


def _padded_mask(batch, length, pad):
    mask = np.ones((batch, length), bool)
    mask[-1, :pad] = False  # the last row left-padded
    return mask


@pytest.fixture(autouse=True)
def _float64_default():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


# ---- against the reference ------------------------------------------------------------------

@pytest.mark.parametrize("neg", [False, True], ids=["beta", "beta-2sigma"])
@pytest.mark.parametrize("implementation", sorted(DELTA_RULE_IMPLEMENTATIONS))
def test_module_equals_the_reference_forward_and_gradients(implementation, neg):
    rng, seed = fresh_rng()
    config = dict(SAMPLE, allow_neg_eigval=neg)
    params = _params(rng, config)
    x, mask = rng.standard_normal((2, 9, config["d_in"])), _padded_mask(2, 9, 3)
    forward, backward = MIXERS[GDN]
    y, _, saved = forward(config, {"x": x, "mask": mask}, params)
    dy = rng.standard_normal(y.shape)
    expected = backward(saved, dy)
    module = torch_attn.build(GDN, config, params)
    xt = torch.tensor(x, requires_grad=True)
    with implementations.record() as ran:
        out = module(xt, torch.tensor(mask), implementation=implementation)
    assert ran == [("torch", implementation)]  # the path under test ran
    assert compare(out.detach().numpy(), y, "float64").ok, f"seed {seed}"
    (out * torch.tensor(dy)).sum().backward()
    got = {**export_grads(module), "x": xt.grad.numpy()}
    assert sorted(got) == sorted(expected)
    for name, g in expected.items():  # a parameter's gradient sums over B·L positions
        terms = x_terms(params, config["d_in"], x.shape[1]) if name == "x" else x.size
        c = compare(got[name], g, "float64", "grad", terms=terms)
        assert c.ok, f"{name} {c}, seed {seed}"


def test_unbatched_equals_one_row():
    rng, seed = fresh_rng()
    module = torch_attn.build(GDN, SAMPLE, _params(rng, SAMPLE))
    x = torch.tensor(rng.standard_normal((6, SAMPLE["d_in"])))
    y = module(x)
    expected = MIXERS[GDN][0](SAMPLE, {"x": x.numpy()}, torch_attn.export_params(module))[0]
    assert y.shape == (6, 7) and compare(y.detach().numpy(), expected, "float64").ok, seed


# ---- the implementations against each other ---------------------------------------------------

def _core_inputs(rng, length, heads=3, dk=4, dv=5, neg=False):
    """q, k L2-normalised (q scaled), v, g ≤ 0, beta in (0, 1) or (0, 2), a random state."""
    def unit(a):
        return a / np.linalg.norm(a, axis=-1, keepdims=True)
    q = unit(rng.standard_normal((2, heads, length, dk))) * dk ** -0.5
    k = unit(rng.standard_normal((2, heads, length, dk)))
    v = rng.standard_normal((2, heads, length, dv))
    g = -rng.uniform(0.0, 0.5, (2, heads, length))
    beta = rng.uniform(0.0, 2.0 if neg else 1.0, (2, heads, length))
    state = rng.standard_normal((2, heads, dk, dv))
    return [torch.tensor(a) for a in (q, k, v, g, beta, state)]


@pytest.mark.parametrize("chunk_size", [64, 16])
@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 130])
def test_recurrent_equals_chunked(length, chunk_size):
    rng, seed = fresh_rng()
    for neg in (False, True):
        *arrays, state = _core_inputs(rng, length, neg=neg)
        o_r, s_r = gated_delta_rule(*arrays, initial_state=state, implementation="recurrent")
        o_c, s_c = gated_delta_rule(*arrays, initial_state=state, implementation="chunked",
                                    chunk_size=chunk_size)
        assert compare(o_c.numpy(), o_r.numpy(), "float64", table=RECURRENT).ok, \
            f"o, neg {neg}, seed {seed}"
        assert compare(s_c.numpy(), s_r.numpy(), "float64", table=RECURRENT).ok, \
            f"S, neg {neg}, seed {seed}"


def test_the_core_equals_the_reference_recurrence():
    from golden.reference.delta_rule import delta_rule
    rng, seed = fresh_rng()
    q, k, v, g, beta, state = _core_inputs(rng, 20)
    o, states = delta_rule(*(a.numpy() for a in (q, k, v)), np.exp(g.numpy()), beta.numpy(),
                           state.numpy())
    for name in DELTA_RULE_IMPLEMENTATIONS:
        got, final = gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                      implementation=name, chunk_size=8)
        assert compare(got.numpy(), o, "float64").ok, f"{name}, seed {seed}"
        assert compare(final.numpy(), states[-1], "float64").ok, f"{name}, seed {seed}"


@pytest.mark.parametrize("neg", [False, True], ids=["beta", "beta-2sigma"])
def test_module_recurrent_equals_chunked_with_left_padding(neg):
    rng, seed = fresh_rng()
    config = dict(SAMPLE, allow_neg_eigval=neg)
    module = torch_attn.build(GDN, config, _params(rng, config))
    x = torch.tensor(rng.standard_normal((3, 70, config["d_in"])))
    mask = torch.tensor(_padded_mask(3, 70, 11))
    with torch.no_grad():
        a = module(x, mask, implementation="recurrent")
        b = module(x, mask, implementation="chunked")
        c = module(x, mask, implementation="chunked", chunk_size=16)
    assert compare(b.numpy(), a.numpy(), "float64", table=RECURRENT).ok, f"seed {seed}"
    assert compare(c.numpy(), a.numpy(), "float64", table=RECURRENT).ok, f"chunk 16, seed {seed}"


def test_the_default_implementation():
    rng, _ = fresh_rng()
    arrays = _core_inputs(rng, 5)[:5]
    for length, name in ((1, "recurrent"), (5, "chunked")):
        with implementations.record() as ran:
            gated_delta_rule(*(a[:, :, :length] for a in arrays))
        assert ran == [("torch", name)]


# ---- float32 and bfloat16 -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_low_precision_error_within_a_bound_growing_with_length(dtype):
    # golden.specification.tolerances.DELTA_RULE_BOUNDS: u·(a + c·√L) on the relative error
    # norm, 4x that relative to max|e| elementwise. Inputs and weights on the dtype's grid, so
    # the error is the arithmetic alone. Seen for torch on this machine (7 seeds, this config,
    # A_log in [−3, 0] and [−8, −4]), the largest (rel. norm, elementwise) in u at L = 64, 256,
    # 1024: float32 (6.5, 15), (6.7, 33), (6.5, 19) (both implementations within 1u of each
    # other); bfloat16 (1.4, 2.3), (1.2, 2.1), (1.2, 2.5). No growth with L seen.
    rng, seed = fresh_rng()
    config = dict(d_in=24, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8,
                  d_out=20, conv_kernel=4)
    shapes = recurrent.get(GDN).param_shapes(config)
    params = {n: rng.standard_normal(s) / (s[0] ** 0.5 if n.startswith("W_") else 1)
              for n, s in shapes.items()}
    params["A_log"] = rng.uniform(-8.0, 0.0, shapes["A_log"])  # slow and fast decays
    low = getattr(torch, dtype)

    def grid(a):
        return torch.tensor(a).to(low).double().numpy()
    params = {n: grid(a) for n, a in params.items()}
    module = torch_attn.build(GDN, config, params).to(low)
    assert_low_precision_within_bound(
        lambda x: torch_output(module, x, dtype),
        lambda x: MIXERS[GDN][0](config, {"x": x}, params)[0],
        lambda length: grid(rng.standard_normal((2, length, config["d_in"]))), dtype, seed)


# ---- the cache -----------------------------------------------------------------------------

@pytest.mark.parametrize("prefill", [1, 4, 9])
def test_prefill_then_decode_equals_the_full_forward(prefill):
    rng, seed = fresh_rng()
    module = torch_attn.build(GDN, SAMPLE, _params(rng, SAMPLE))
    length = 13
    x = torch.tensor(rng.standard_normal((3, length, SAMPLE["d_in"])))
    mask = torch.tensor(_padded_mask(3, length, 3))
    with torch.no_grad():
        full = module(x, mask)
        cache = module.init_cache(3, length)
        with implementations.record() as ran:
            first, cache = module(x[:, :prefill], mask[:, :prefill], cache=cache)
        outs = [first]
        for t in range(prefill, length):
            y, cache = module(x[:, t:t + 1], mask[:, t:t + 1], cache=cache)
            outs.append(y)
    assert ran == [("torch", "chunked" if prefill > 1 else "recurrent")]
    assert compare(torch.cat(outs, dim=1).numpy(), full.numpy(), "float64").ok, f"seed {seed}"
    assert cache.lengths.tolist() == [length] * 3 and cache.lengths.dtype == torch.int32
    with pytest.raises(ValueError, match="cache max_length is 13 .* would reach 14"):
        module(x[:, :1], cache=cache)


def test_a_call_returns_a_new_cache_and_leaves_the_old_one():
    rng, _ = fresh_rng()
    module = torch_attn.build(GDN, SAMPLE, _params(rng, SAMPLE))
    cache = module.init_cache(2, 8)
    assert cache.conv.shape == (2, 2, 2 * 2 * 3 + 4 * 6) and cache.state.dtype == torch.float64
    x = torch.tensor(rng.standard_normal((2, 3, SAMPLE["d_in"])))
    _, new = module(x, cache=cache)
    assert not cache.conv.any() and not cache.state.any() and not cache.lengths.any()
    assert new.state.abs().sum() > 0 and new.lengths.tolist() == [3, 3]


def test_a_float32_module_keeps_a_float32_state_and_a_bfloat16_one_too():
    for dtype in (torch.float32, torch.bfloat16):
        module = torch_attn.GatedDeltaNet(**SAMPLE).to(dtype)
        cache = module.init_cache(2, 4)
        assert cache.conv.dtype == dtype and cache.state.dtype == torch.float32
        _, new = module(torch.randn(2, 2, SAMPLE["d_in"], dtype=dtype), cache=cache)
        assert new.conv.dtype == dtype and new.state.dtype == torch.float32


def test_the_cache_exports_and_loads_back_equal_and_a_copy():
    rng, _ = fresh_rng()
    module = torch_attn.build(GDN, SAMPLE, _params(rng, SAMPLE))
    x = torch.tensor(rng.standard_normal((2, 5, SAMPLE["d_in"])))
    with torch.no_grad():
        _, cache = module(x, cache=module.init_cache(2, 9))
    exported = torch_attn.export_cache(cache)
    assert isinstance(exported, RecurrentCache)
    assert all(isinstance(a, np.ndarray) for a in exported)
    loaded = torch_attn.load_cache(exported)
    for a, b, c in zip(cache, exported, loaded):
        np.testing.assert_array_equal(a.numpy(), b)
        np.testing.assert_array_equal(c.numpy(), b)
        assert c.dtype == a.dtype
    exported.state[...] = 7.0  # neither the loaded cache nor the module's shares its memory
    assert not (loaded.state == 7).any() and not (cache.state == 7).any()
    loaded.conv.zero_()
    assert exported.conv.any()
    y_a, _ = module(x[:, :1], cache=cache)
    y_b, _ = module(x[:, :1], cache=torch_attn.load_cache(torch_attn.export_cache(cache)))
    np.testing.assert_array_equal(y_a.detach().numpy(), y_b.detach().numpy())


# ---- build, export, load --------------------------------------------------------------------

def test_build_export_round_trip_is_a_copy():
    rng, _ = fresh_rng()
    params = _params(rng, SAMPLE)
    module = torch_attn.build(GDN, SAMPLE, params)
    assert isinstance(module, torch_attn.GatedDeltaNet)
    exported = torch_attn.export_params(module)
    assert sorted(exported) == sorted(params)
    for n, a in params.items():
        np.testing.assert_array_equal(exported[n], a)
    exported["A_log"][...] = 0.0
    exported["W_query"][...] = 0.0
    assert module.A_log.abs().sum() > 0 and module.W_query.weight.abs().sum() > 0
    other = torch_attn.GatedDeltaNet(**SAMPLE)
    torch_attn.load_params(other, params)
    x = torch.tensor(rng.standard_normal((2, 4, SAMPLE["d_in"])))
    np.testing.assert_array_equal(other(x).detach().numpy(), module(x).detach().numpy())


# ---- bad inputs -----------------------------------------------------------------------------

def test_bad_inputs_are_refused_by_name():
    module = torch_attn.GatedDeltaNet(**SAMPLE)
    x = torch.randn(2, 4, SAMPLE["d_in"])
    with pytest.raises(ValueError, match=r"x shape should be .*d_in.*got"):
        module(torch.randn(2, 4, SAMPLE["d_in"] + 1))
    with pytest.raises(ValueError, match="mask dtype should be bool.*got float"):
        module(x, torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"mask shape should be \(2, 4\).*got \(2, 5\)"):
        module(x, torch.ones(2, 5, dtype=torch.bool))
    other = torch_attn.GatedDeltaNet(**dict(SAMPLE, conv_kernel=4)).init_cache(2, 8)
    with pytest.raises(ValueError, match=r"cache.conv shape should be \(2, 2, 36\).*got "
                                         r"\(2, 3, 36\)"):
        module(x, cache=other)
    with pytest.raises(ValueError, match=r"cache.state shape should be \(2, 4, 3, 6\)"):
        module(x, cache=module.init_cache(3, 8)._replace(conv=torch.zeros(2, 2, 36),
                                                         lengths=torch.zeros(2, dtype=int)))
    with pytest.raises(ValueError, match="implementation should be None or one of "
                                         "'recurrent', 'chunked', got 'fused'"):
        module(x, implementation="fused")
    with pytest.raises(ValueError, match="cache should be a RecurrentCache"):
        module(x, cache=torch_attn.KVCache(x, x, x))
    with pytest.raises(ValueError, match="cache.lengths dtype should be an integer dtype"):
        module(x, cache=module.init_cache(2, 8)._replace(lengths=torch.zeros(2)))
    with pytest.raises(ValueError, match="max_length should be a positive int, got 0"):
        module.init_cache(2, 0)
    q = torch.randn(2, 3, 4, 5)
    with pytest.raises(ValueError, match=r"g shape should be \(B, H, L\) or \(B, H, L, Dk\) "
                                         r"= \(2, 3, 4\), got \(2, 3\)"):
        gated_delta_rule(q, q, q, q[..., 0, 0], q[..., 0])
    with pytest.raises(ValueError, match=r"g shape should be \(B, H, L\) or \(B, H, L, Dk\) "
                                         r"= \(2, 3, 4, 5\), got \(2, 3, 4, 2\)"):
        gated_delta_rule(q, q, q, q[..., :2], q[..., 0])
    with pytest.raises(ValueError, match="chunk_size should be a positive int, got 0"):
        gated_delta_rule(q, q, q, q[..., 0], q[..., 0], chunk_size=0)


# ---- against transformers' own module -----------------------------------------------------

def _qwen3_5_pair(rng):
    """(HF's Qwen3_5GatedDeltaNet at float64 with random weights, the neutral parameters and
    configuration of ours holding them, HF's config for its cache): the mapping of in_proj_qkv
    ([q; k; v] rows), conv1d (C, 1, K), in_proj_z/b/a, norm, out_proj."""
    q35 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    from transformers import Qwen3_5TextConfig
    hf_config = Qwen3_5TextConfig(
        hidden_size=10, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=3,
        linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=1,
        layer_types=["linear_attention"], rms_norm_eps=1e-6, num_attention_heads=2,
        num_key_value_heads=1, head_dim=4)
    hf = q35.Qwen3_5GatedDeltaNet(hf_config, 0).double()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.tensor(rng.standard_normal(p.shape) * 0.5))
    def t(p):
        return p.detach().numpy().copy()
    w, conv, kd = t(hf.in_proj_qkv.weight), t(hf.conv1d.weight)[:, 0], 2 * 3
    params = {"W_query": w[:kd].T, "W_key": w[kd:2 * kd].T, "W_value": w[2 * kd:].T,
              "W_gate": t(hf.in_proj_z.weight).T, "W_beta": t(hf.in_proj_b.weight).T,
              "W_decay": t(hf.in_proj_a.weight).T, "W_out": t(hf.out_proj.weight).T,
              "conv_query": conv[:kd], "conv_key": conv[kd:2 * kd], "conv_value": conv[2 * kd:],
              "A_log": t(hf.A_log), "dt_bias": t(hf.dt_bias), "norm_weight": t(hf.norm.weight)}
    config = dict(d_in=10, num_k_heads=2, num_v_heads=4, head_k_dim=3, head_v_dim=6,
                  conv_kernel=4)
    return hf, params, config, hf_config


def test_module_equals_transformers_qwen3_5_with_left_padding():
    # HF runs the delta rule in float32 even in a float64 model (torch_chunk_gated_delta_rule
    # casts), so its float32 steps are the floor: measured at L = 70 over 4 seeds, relative
    # error norm 6.0e-7 to 8.0e-7 for the output and 2.9e-6 for the input gradient. Bounds 5x.
    rng, seed = fresh_rng()
    hf, params, config, _ = _qwen3_5_pair(rng)
    ours = torch_attn.build(GDN, config, params)
    x = rng.standard_normal((2, 70, 10))
    mask = torch.tensor(_padded_mask(2, 70, 5))
    dy = torch.tensor(rng.standard_normal((2, 70, 10)))
    x_hf, x_ours = (torch.tensor(x, requires_grad=True) for _ in range(2))
    y_hf, y_ours = hf(x_hf, attention_mask=mask), ours(x_ours, mask)
    (y_hf * dy).sum().backward()
    (y_ours * dy).sum().backward()

    def rel(a, b):
        return float((a - b).detach().norm() / b.detach().norm())
    assert rel(y_hf, y_ours) <= 4e-6, f"seed {seed}"
    assert rel(x_hf.grad, x_ours.grad) <= 1.5e-5, f"seed {seed}"
    swapped = torch_attn.build(GDN, config, {**params, "W_beta": params["W_decay"],
                                             "W_decay": params["W_beta"]})
    assert rel(y_hf, swapped(x_ours, mask)) > 1e-2  # a mapping undone moves far


def test_decode_equals_transformers_qwen3_5_through_both_caches():
    # HF's prefill (its chunked rule) then one token at a time (its recurrent rule, its conv
    # update) through its DynamicCache, against ours through the RecurrentCache, left padding.
    # HF's float32 delta rule is the floor: seen 1e-7 relative error norm; bound as above.
    from transformers.cache_utils import DynamicCache
    rng, seed = fresh_rng()
    hf, params, config, hf_config = _qwen3_5_pair(rng)
    ours = torch_attn.build(GDN, config, params)
    x = torch.tensor(rng.standard_normal((2, 12, 10)))
    mask = torch.tensor(_padded_mask(2, 12, 3))
    hf_cache, cache = DynamicCache(config=hf_config), ours.init_cache(2, 12)
    with torch.no_grad():
        hf_out = [hf(x[:, :5], cache_params=hf_cache, attention_mask=mask[:, :5])]
        first, cache = ours(x[:, :5], mask[:, :5], cache=cache)
        out = [first]
        for t in range(5, 12):
            hf_out.append(hf(x[:, t:t + 1], cache_params=hf_cache,
                             attention_mask=mask[:, t:t + 1]))
            y, cache = ours(x[:, t:t + 1], mask[:, t:t + 1], cache=cache)
            out.append(y)
    a, b = torch.cat(hf_out, dim=1), torch.cat(out, dim=1)
    assert float((a - b).norm() / b.norm()) <= 4e-6, f"seed {seed}"

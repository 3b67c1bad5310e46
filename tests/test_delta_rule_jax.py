"""The JAX twin of Gated DeltaNet (issue 43, jax_attn.recurrent): the module against the float64
reference (golden.reference.delta_rule) forward and gradients through nnx.grad, both
implementations; "recurrent" against "chunked" (its own custom_vjp included); the chunked
backward's residuals O(L); float32 and bfloat16 errors against the reference; prefill then
decoding through the cache; export and load; bad inputs; Hugging Face's Qwen3NextGatedDeltaNet
(its parameters read into the neutral layout here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_attn
from golden.reference.delta_rule import MIXERS
from golden.specification import recurrent
from golden.specification.implementations import record
from golden.specification.recurrent import RecurrentCache
from golden.specification.tolerances import compare, delta_rule_bound
from golden.specification.tolerances import RECURRENT_TOLERANCES as RECURRENT
from jax_attn.recurrent import DELTA_RULE_IMPLEMENTATIONS, gated_delta_rule
from tests.helpers import fresh_rng, matrix
from tests.recurrent_checks import assert_low_precision_within_bound, jax_output, x_terms

GDN = "gated_delta_net"
SPEC = recurrent.get(GDN)
IMPLEMENTATIONS = tuple(DELTA_RULE_IMPLEMENTATIONS)
# The quick suite runs the first of each list; the whole matrix (ATTN_PARITY_MATRIX=1) every one.
QUICK_LENGTHS = {(65, 16), (130, 64)}  # a padded last chunk; several whole chunks


def _quick_first(values, ids=None):
    return [pytest.param(v, id=None if ids is None else ids[i], marks=() if i == 0 else matrix)
            for i, v in enumerate(values)]


def _params(rng, config, scale=0.5):
    return {n: rng.standard_normal(s) * scale for n, s in SPEC.param_shapes(config).items()}


def _padded(batch, length, pad):
    """A mask (B, L) whose last row is left-padded by ``pad`` tokens."""
    mask = np.ones((batch, length), bool)
    mask[-1, :pad] = False
    return mask


def _reference(config, x, mask, params):
    return MIXERS[GDN][0](config, {"x": x, "mask": mask}, params)


def _module_grads(module, x, mask, dy, **call):
    """(y, {"x" and every neutral parameter: gradient of Σ y ⊙ dy}) through nnx.grad."""
    def loss(m, xx):
        return jnp.sum(m(xx, mask, **call) * dy)
    grads, d_x = nnx.grad(loss, argnums=(0, 1))(module, x)
    held = jax_attn.export_params(nnx.merge(nnx.graphdef(module), grads))
    return module(x, mask, **call), {"x": np.asarray(d_x), **held}


@pytest.mark.parametrize("implementation", _quick_first(("chunked", "recurrent")))
def test_module_matches_reference_float64(implementation):
    # 7 tokens in chunks of 3 (the last padded), the second row left-padded by 2; the output,
    # the input's and every parameter's gradient at the float64 rows of the table (a
    # parameter's gradient sums B·L terms).
    rng, seed = fresh_rng()
    config = dict(SPEC.sample)
    with jax.enable_x64(True):
        params = _params(rng, config)
        x, mask = rng.standard_normal((2, 7, config["d_in"])), _padded(2, 7, 2)
        expected, _, saved = _reference(config, x, mask, params)
        dy = rng.standard_normal(expected.shape)
        want = MIXERS[GDN][1](saved, dy)
        module = jax_attn.build(GDN, config, params)
        y, grads = _module_grads(module, jnp.asarray(x), jnp.asarray(mask), jnp.asarray(dy),
                                 implementation=implementation, chunk_size=3)
    assert y.dtype == jnp.float64
    assert compare(y, expected, "float64").ok, seed
    assert set(grads) == set(want)
    for name, g in grads.items():
        terms = x_terms(params, config["d_in"], 7) if name == "x" else 2 * 7
        assert compare(g, want[name], "float64", "grad", terms=terms).ok, (name, seed)


def _core_inputs(rng, b, h, length, dk, dv, neg=True):
    unit = rng.standard_normal((b, h, length, dk))
    q = unit / np.linalg.norm(unit, axis=-1, keepdims=True) * dk ** -0.5
    k = rng.standard_normal((b, h, length, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((b, h, length, dv))
    g = -np.log1p(np.exp(rng.standard_normal((b, h, length))))  # −softplus: log-decays < 0
    beta = rng.uniform(0, 2 if neg else 1, (b, h, length))
    state = rng.standard_normal((b, h, dk, dv))
    return [jnp.asarray(a) for a in (q, k, v, g, beta, state)]


@pytest.mark.parametrize("length, chunk_size", [
    pytest.param(n, t, id=f"{n}-{t}", marks=() if (n, t) in QUICK_LENGTHS else matrix)
    for t in (64, 16) for n in (1, 5, 63, 64, 65, 130)])
def test_recurrent_equals_chunked_float64(length, chunk_size):
    # From a random initial state, β in (0, 2) (allow_neg_eigval's range): the outputs, the
    # final state and every input's gradient (the chunked custom_vjp against the recurrent
    # scan's autodiff).
    rng, seed = fresh_rng()
    with jax.enable_x64(True):
        *inputs, state = _core_inputs(rng, 2, 3, length, 4, 5)
        d_o, d_s = (jnp.asarray(rng.standard_normal(s)) for s in ((2, 3, length, 5), state.shape))
        results = {}
        for name in IMPLEMENTATIONS:
            def loss(*a, name=name):
                o, final = gated_delta_rule(*a[:5], initial_state=a[5], implementation=name,
                                            chunk_size=chunk_size)
                return jnp.sum(o * d_o) + jnp.sum(final * d_s), (o, final)
            grads, outs = jax.grad(loss, argnums=tuple(range(6)), has_aux=True)(*inputs, state)
            results[name] = (*outs, *grads)
    for got, want in zip(results["chunked"], results["recurrent"]):
        assert compare(got, want, "float64", "grad", terms=length).ok, seed


@pytest.mark.parametrize("per_channel", [False, True], ids=("per-head", "per-channel"))
def test_chunks_side_by_side_or_in_groups_agree_float64(per_channel):
    # The chunked form runs its chunks all at once on an accelerator and one at a time on a CPU
    # (jax_attn.delta_rule.chunks_at_once); both groupings, and groups of 3 chunks of which the
    # last is padded (7 chunks of 4), against the recurrent scan: outputs, final state and every
    # input's gradient. The CPU suite would otherwise never run the accelerators' grouping.
    from jax_attn import delta_rule
    assert delta_rule.chunks_at_once() == (1 if jax.default_backend() == "cpu" else None)
    rng, seed = fresh_rng()
    length = 26
    with jax.enable_x64(True):
        *inputs, state = _core_inputs(rng, 2, 3, length, 4, 5)
        if per_channel:
            inputs[3] = -jnp.asarray(np.log1p(np.exp(rng.standard_normal((2, 3, length, 4)))))
        d_o, d_s = (jnp.asarray(rng.standard_normal(s)) for s in ((2, 3, length, 5), state.shape))
        results = {}
        for name, group in (("recurrent", None), ("chunked", None), ("chunked", 1),
                            ("chunked", 3)):
            def loss(*a, name=name, group=group):
                o, final = delta_rule._core_jit(*a, implementation=name, chunk_size=4,
                                                group=group)
                return jnp.sum(o * d_o) + jnp.sum(final * d_s), (o, final)
            grads, outs = jax.grad(loss, argnums=tuple(range(6)), has_aux=True)(*inputs, state)
            results[name, group] = (*outs, *grads)
    want = results["recurrent", None]
    for group in (None, 1, 3):
        for got, expected in zip(results["chunked", group], want):
            assert compare(got, expected, "float64", "grad", terms=length).ok, (group, seed)


@pytest.mark.parametrize("neg", _quick_first((True, False), ids=("beta-2sigma", "beta")))
def test_module_implementations_agree_with_left_padding(neg):
    rng, seed = fresh_rng()
    config = dict(SPEC.sample, allow_neg_eigval=neg)
    with jax.enable_x64(True):
        module = jax_attn.build(GDN, config, _params(rng, config))
        x = jnp.asarray(rng.standard_normal((2, 11, config["d_in"])))
        mask = jnp.asarray(_padded(2, 11, 4))
        y = {n: module(x, mask, implementation=n, chunk_size=4) for n in IMPLEMENTATIONS}
        expected = _reference(config, np.asarray(x), np.asarray(mask),
                              jax_attn.export_params(module))[0]
    assert compare(y["chunked"], y["recurrent"], "float64", table=RECURRENT).ok, seed
    assert compare(y["chunked"], expected, "float64", table=RECURRENT).ok, seed


def test_chunked_backward_keeps_chunk_states_only():
    # The residuals jax.vjp keeps (the leaves of its pullback) for L = 256 in chunks of 16:
    # each smaller than one head's per-token states L·Dk·Dv, and in all O(L); the recurrent
    # scan's autodiff, by contrast, keeps an array of every S_t (so the check can fail).
    rng, _ = fresh_rng()
    b, h, length, dk, dv = 1, 2, 256, 8, 8
    *inputs, _ = _core_inputs(rng, b, h, length, dk, dv)
    per_token = b * h * length * dk * dv

    def residuals(name):
        _, pullback = jax.vjp(lambda *a: gated_delta_rule(*a, implementation=name,
                                                          chunk_size=16)[0], *inputs)
        return [leaf.shape for leaf in jax.tree.leaves(pullback)]
    chunked = residuals("chunked")
    assert chunked and max(int(np.prod(s)) for s in chunked) <= per_token // 8, chunked
    assert sum(int(np.prod(s)) for s in chunked) <= 8 * b * h * length * (dk + dv), chunked
    assert max(int(np.prod(s)) for s in residuals("recurrent")) >= per_token


@pytest.mark.parametrize("dtype", _quick_first(("float32", "bfloat16")))
def test_low_precision_error_against_reference(dtype):
    # One configuration, L = 64, 256, 1024, parameters and inputs on the dtype's grid (the
    # arithmetic alone): the output's relative error norm and its largest error relative to
    # max |y| within golden.specification.tolerances.delta_rule_bound (its numbers there).
    rng, seed = fresh_rng()
    config = dict(d_in=16, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8,
                  d_out=12, conv_kernel=4)

    def on_grid(a):
        return np.asarray(jnp.asarray(a, dtype).astype(jnp.float32), np.float64)
    params = {n: on_grid(a) for n, a in _params(rng, config, 0.3).items()}
    module = jax_attn.build(GDN, config, {n: a.astype(np.float32) for n, a in params.items()})
    nnx.update(module, jax.tree.map(lambda a: a.astype(dtype), nnx.state(module, nnx.Param)))
    x_all = on_grid(rng.standard_normal((1, 1024, 16)))
    assert_low_precision_within_bound(
        lambda x: jax_output(module, x, dtype), lambda x: _reference(config, x, None, params)[0],
        lambda length: x_all[:, :length], dtype, seed)


def test_prefill_then_decode_through_the_cache_float64():
    # 6 tokens prefilled (chunked, chunks of 4), then 5 one at a time (recurrent), the second
    # row left-padded by 3: the outputs equal the full forward's; each cache exported and
    # loaded back equals it and shares no memory with it.
    rng, seed = fresh_rng()
    config = dict(SPEC.sample)
    with jax.enable_x64(True):
        module = jax_attn.build(GDN, config, _params(rng, config))
        x = jnp.asarray(rng.standard_normal((2, 11, config["d_in"])))
        mask = jnp.asarray(_padded(2, 11, 3))
        full = module(x, mask)
        cache = module.init_cache(2, 16)
        assert cache.state.dtype == jnp.float64 and cache.conv.shape == (2, 2, 36)
        with record() as ran:
            y, cache = module(x[:, :6], mask[:, :6], cache=cache, chunk_size=4)
        outs = [y]
        with record() as ran_step:  # a compiled call records when traced: the first step
            for t in range(6, 11):
                exported = jax_attn.export_cache(cache)
                assert isinstance(exported, RecurrentCache)
                loaded = jax_attn.load_cache(exported)
                for a, b in zip(loaded, cache):
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
                exported.state[...] = 0  # a copy: the module's cache unchanged
                assert np.abs(np.asarray(loaded.state)).max() > 0
                y, cache = module(x[:, t:t + 1], mask[:, t:t + 1], cache=loaded)
                outs.append(y)
        np.testing.assert_array_equal(np.asarray(cache.lengths), [11, 11])
    assert [n for _, n in ran] == ["chunked"] and [n for _, n in ran_step] == ["recurrent"]
    assert compare(jnp.concatenate(outs, axis=1), full, "float64").ok, seed
    with pytest.raises(ValueError, match="max_length is 16"):
        module(jnp.zeros((2, 6, config["d_in"])), cache=cache)


def test_module_jits_and_unbatched_inputs():
    # Under a caller's nnx.jit the module equals its eager call; (L, d_in) equals a batch of 1.
    rng, _ = fresh_rng()
    config = dict(SPEC.sample)
    module = jax_attn.build(GDN, config, _params(rng, config))
    x = jnp.asarray(rng.standard_normal((3, 9, config["d_in"])), jnp.float32)
    jitted = nnx.jit(lambda m, xx: m(xx))(module, x)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(module(x)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(module(x[0])), np.asarray(module(x[:1])[0]),
                               rtol=1e-6, atol=1e-6)


def test_build_export_load_round_trip_copies():
    rng, _ = fresh_rng()
    config = dict(SPEC.sample)
    params = {n: a.astype(np.float32) for n, a in _params(rng, config).items()}
    module = jax_attn.build(GDN, config, params)
    out = jax_attn.export_params(module)
    assert set(out) == set(params)
    for name in params:
        np.testing.assert_array_equal(out[name], params[name])
    params["W_query"][...] = 0  # the module holds copies, and exports copies
    out["A_log"][...] = 0
    again = jax_attn.export_params(module)
    assert np.abs(again["W_query"]).max() > 0 and np.abs(again["A_log"]).max() > 0
    assert module.config == SPEC.config(config)


def test_default_implementation_is_recorded():
    rng, _ = fresh_rng()
    *inputs, _ = _core_inputs(rng, 1, 2, 3, 4, 5)
    for length, name in ((1, "recurrent"), (3, "chunked")):
        with record() as ran:
            gated_delta_rule(*(a[:, :, :length] for a in inputs))
        assert ran == [("jax", name)]


def test_bad_inputs_name_the_argument():
    rng, _ = fresh_rng()
    config = dict(SPEC.sample)
    module = jax_attn.build(GDN, config, _params(rng, config))
    x = jnp.zeros((2, 4, config["d_in"]))
    with pytest.raises(ValueError, match=r"x .*\(B, L, d_in\)"):
        module(jnp.zeros((2, 4, config["d_in"] + 1)))
    with pytest.raises(ValueError, match="mask dtype should be bool"):
        module(x, jnp.ones((2, 4)))
    with pytest.raises(ValueError, match=r"mask shape should be \(2, 4\)"):
        module(x, jnp.ones((2, 5), bool))
    cache = module.init_cache(3, 8)
    with pytest.raises(ValueError, match=r"cache.conv shape should be \(2, 2, 36\)"):
        module(x, cache=cache)
    with pytest.raises(ValueError, match=r"cache.state shape should be"):
        module(x, cache=module.init_cache(2, 8)._replace(state=jnp.zeros((2, 4, 3, 5))))
    with pytest.raises(ValueError, match="cache should be a RecurrentCache"):
        module(x, cache=(cache.conv, cache.state, cache.lengths))
    with pytest.raises(ValueError, match="implementation should be None or one of 'recurrent'"):
        module(x, implementation="fused")
    with pytest.raises(ValueError, match="chunk_size should be a positive int"):
        module(x, chunk_size=0)
    with pytest.raises(ValueError, match="max_length should be a positive int"):
        module.init_cache(2, 0)


def _from_qwen3_next(module, hk, hv, dk, dv):
    """Neutral parameters of Hugging Face's Qwen3NextGatedDeltaNet: in_proj_qkvz's rows are per
    key head [q (Dk) | k (Dk) | v (g·Dv) | z (g·Dv)], in_proj_ba's [b (g) | a (g)], g = Hv/Hk;
    conv1d's channels [q | k | v]."""
    g = hv // hk
    w = module.in_proj_qkvz.weight.detach().numpy()
    w = w.reshape(hk, 2 * dk + 2 * g * dv, -1)  # (Hk, rows, d_in)
    ba = module.in_proj_ba.weight.detach().numpy().reshape(hk, 2 * g, -1)
    conv = module.conv1d.weight.detach().numpy()[:, 0, :]  # (C, K)

    def cols(rows):
        return rows.reshape(-1, rows.shape[-1]).T  # (d_in, heads·width)
    return {"W_query": cols(w[:, :dk]), "W_key": cols(w[:, dk:2 * dk]),
            "W_value": cols(w[:, 2 * dk:2 * dk + g * dv]), "W_gate": cols(w[:, 2 * dk + g * dv:]),
            "W_beta": cols(ba[:, :g]), "W_decay": cols(ba[:, g:]),
            "W_out": module.out_proj.weight.detach().numpy().T,
            "conv_query": conv[:hk * dk], "conv_key": conv[hk * dk:2 * hk * dk],
            "conv_value": conv[2 * hk * dk:], "A_log": module.A_log.detach().numpy(),
            "dt_bias": module.dt_bias.detach().numpy(),
            "norm_weight": module.norm.weight.detach().numpy()}


@matrix
def test_against_hugging_face_qwen3_next():
    # HF's own module (a tiny random float64 Qwen3-Next config, its torch fallback kernels),
    # 100 tokens, a left-padded row: HF runs the delta rule in float32 even for a float64
    # model, so ours (float64) is held to the float32 bound of the table; seen 3.6e-7 = 6u at
    # L = 100 (1.0e-7 at L = 7). allow_neg_eigval (β = 2σ, which Qwen3-Next lacks) moves it
    # far outside.
    torch = pytest.importorskip("torch")
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig
    rng, seed = fresh_rng()
    torch.manual_seed(seed)
    hk, hv, dk, dv, d, kernel, length = 2, 4, 8, 6, 16, 4, 100
    hf_config = Qwen3NextConfig(
        hidden_size=d, linear_num_key_heads=hk, linear_num_value_heads=hv,
        linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=kernel,
        rms_norm_eps=1e-6, num_hidden_layers=1, layer_types=["linear_attention"])
    hf = qwen3_next.Qwen3NextGatedDeltaNet(hf_config, 0).double()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    params = _from_qwen3_next(hf, hk, hv, dk, dv)
    config = dict(d_in=d, num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv,
                  conv_kernel=kernel)
    x, mask = rng.standard_normal((2, length, d)), _padded(2, length, 3)
    with torch.no_grad():
        theirs = hf(torch.tensor(x), attention_mask=torch.tensor(mask.astype(np.int64))).numpy()
    bound = delta_rule_bound("float32", length)
    with jax.enable_x64(True):
        for neg in (False, True):
            module = jax_attn.build(GDN, dict(config, allow_neg_eigval=neg), params)
            ours = np.asarray(module(jnp.asarray(x), jnp.asarray(mask)))
            rel_norm = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
            assert (rel_norm <= bound) != neg, (neg, rel_norm, seed)

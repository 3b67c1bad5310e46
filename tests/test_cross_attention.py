"""MultiHeadCrossAttention beyond the golden fixtures: decoding with the context's keys and
values cached (ContextCache) equals the full computation (float64, both frameworks, padded
contexts, under the caller's jit too), a cache refuses another context, and the module against
transformers' own encoder-decoder attention (WhisperAttention and BartAttention as the decoder's
encoder_attn, T5Attention as its EncDecAttention; float64: output, weights, and the gradients
of x, the context and every parameter, 1e-12), with their state dicts mapped to the neutral
layout, and SigLIP's attention pooling head (its probe querying the tokens through
torch.nn.MultiheadAttention; output and weights, 1e-12).

Shape legend: B batch, Lq query tokens, Lc context tokens, N query heads, Nkv key-value heads,
Dh head width, d_in and d_context the widths of x and the context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch
from flax import nnx

import torch_attn
from golden.harness.check import compare_all
from tests.helpers import JAX, fresh_rng, random_cotangents, reference_fixture

MHCA = "multi_head_cross_attention"
# Every size distinct: B=2, Lq=5, Lc=9, d_in=7, d_context=11, N=6, Nkv=3, Dh=4, d_out=10.
CONFIG = dict(d_in=7, d_context=11, num_heads=6, num_kv_heads=3, head_dim=4, d_out=10,
              qkv_bias=True, key_bias=False, out_bias=True)
B, LQ, LC = 2, 5, 9
EXACT = 1e-12  # float64: the cached and the full computation differ only in summation order


def _params(config, rng, dtype="float64"):
    """Random neutral-layout parameters: N(0, 1/fan_in) weights, N(0, 1) biases."""
    module = torch_attn.MultiHeadCrossAttention(**config)
    return {n: (rng.standard_normal(a.shape) / (np.sqrt(a.shape[0]) if n.startswith("W_") else 1)
                ).astype(dtype) for n, a in torch_attn.export_params(module).items()}


def _inputs(rng):
    x = rng.standard_normal((B, LQ, CONFIG["d_in"]))
    context = rng.standard_normal((B, LC, CONFIG["d_context"]))
    return x, context, np.array([LC, 4], np.int32)


# ---- decoding with the cached context equals the full computation ---------------------------

@pytest.mark.parametrize("config", [CONFIG, dict(CONFIG, num_kv_heads=1, scale=1.0,
                                                 qkv_bias=False, key_bias=None),
                                    dict(CONFIG, qk_norm="rms", softcap=1.5)],
                         ids=["whisper_gqa", "t5_mqa", "qk_norm_softcap"])  # the cache: normed k
def test_decoding_with_a_cached_context_equals_the_full_computation(twin, config):
    rng, seed = fresh_rng()
    x, context, lengths = _inputs(rng)
    mask = rng.random((B, LQ, LC)) < 0.8
    with twin.float64():
        module = twin.build(MHCA, config, _params(config, rng))
        xs, ctx, lens, m = (twin.array(a) for a in (x, context, lengths, mask))
        full, full_w = (twin.numpy(a) for a in module(xs, ctx, m, context_lengths=lens,
                                                       return_weights=True))
        cache = module.context_cache(ctx, lens)
        for i in range(LQ):  # one query token at a time, the context given or not
            given = ctx if i % 2 else None
            y, w = module(xs[:, i:i + 1], given, m[:, i:i + 1], cache=cache,
                          return_weights=True)
            assert np.abs(twin.numpy(y)[:, 0] - full[:, i]).max() <= EXACT, f"seed {seed}"
            assert np.abs(twin.numpy(w)[:, :, 0] - full_w[:, :, i]).max() <= EXACT, seed
    assert not full_w[1, ..., 4:].any(), "padding attended"
    np.testing.assert_array_equal(twin.numpy(cache.lengths), lengths)
    assert twin.numpy(cache.key).shape == (B, config.get("num_kv_heads") or 6, LC, 4)


def test_jax_cache_made_and_used_under_jit():
    """The cache is a pytree: made inside the caller's nnx.jit and used there (the fingerprint
    check needs concrete values: an eager call made with it still checks it)."""
    rng, seed = fresh_rng()
    x, context, lengths = _inputs(rng)
    with JAX.float64():
        module = JAX.build(MHCA, CONFIG, _params(CONFIG, rng))
        xs, ctx, lens = (JAX.array(a) for a in (x, context, lengths))
        full = JAX.numpy(module(xs, ctx, context_lengths=lens))

        @nnx.jit
        def step(module, x, context, lengths):
            cache = module.context_cache(context, lengths)
            return module(x, context, cache=cache), cache

        y, cache = step(module, xs, ctx, lens)
        assert np.abs(JAX.numpy(y) - full).max() <= EXACT, f"seed {seed}"
        assert np.abs(JAX.numpy(module(xs, ctx, cache=cache)) - full).max() <= EXACT, seed
        with pytest.raises(ValueError, match="context should be the one the cache was made"):
            module(xs, ctx.at[1, 2, 3].add(1e-3), cache=cache)


def test_context_gradient_flows_through_the_cache(twin):
    """A cache made inside the differentiated function carries the context's gradient."""
    rng, _ = fresh_rng()
    x, context, lengths = _inputs(rng)
    cot = random_cotangents(rng, (B, LQ, CONFIG["d_out"]), (B, 6, LQ, LC))
    cot["weights"] = np.zeros_like(cot["weights"])  # the loss below reads the output only
    params = _params(CONFIG, rng)
    fixture = reference_fixture(MHCA, CONFIG, {"x": x, "context": context,
                                               "context_lengths": lengths}, params, cot, "float64")
    with twin.float64():
        module = twin.build(MHCA, CONFIG, params)
        grad = _context_grad(twin, module, x, context, lengths, cot["output"])
    assert np.abs(grad - fixture.grads["context"]).max() <= 1e-12 * np.abs(grad).max()


def _context_grad(twin, module, x, context, lengths, d_out):
    """d Σ (y ⊙ d_out) / d context, y = module(x, cache=module.context_cache(context))."""
    if twin.name == "torch":
        ctx = torch.from_numpy(context).requires_grad_()
        y = module(torch.from_numpy(x), cache=module.context_cache(ctx, torch.from_numpy(lengths)))
        (y * torch.from_numpy(d_out.astype(np.float64))).sum().backward()
        return ctx.grad.numpy()
    import jax
    import jax.numpy as jnp

    def loss(ctx):
        cache = module.context_cache(ctx, jnp.asarray(lengths))
        return (module(jnp.asarray(x), cache=cache) * d_out.astype(np.float64)).sum()
    return np.asarray(jax.grad(loss)(jnp.asarray(context)))


# ---- a cache refuses another context -----------------------------------------------------------

def _cache_errors(twin):
    rng, _ = fresh_rng()
    x, context, lengths = _inputs(rng)
    module = twin.build(MHCA, CONFIG, _params(CONFIG, rng, "float32"))
    xs, ctx = twin.array(x, "float32"), twin.array(context, "float32")
    cache = module.context_cache(ctx)
    other = twin.array(np.roll(context, 1, axis=1), "float32")  # the same values, reordered
    shorter = twin.array(context[:, :6], "float32")
    other_kv = twin.build(MHCA, dict(CONFIG, num_kv_heads=2), _params(
        dict(CONFIG, num_kv_heads=2), rng, "float32")).context_cache(ctx)
    return [
        (lambda: module(xs, other, cache=cache),
         r"context should be the one the cache was made from \(its fingerprint differs\)"),
        (lambda: module(xs, shorter, cache=cache),
         r"context length Lc should be the cache's 9, got 6"),
        (lambda: module(xs, ctx, cache=cache, context_lengths=twin.array(lengths)),
         "context_lengths should be None with a cache"),
        (lambda: module(xs), r"context should be an array \(B, Lc, d_context\) when no cache"),
        (lambda: module(xs, cache=other_kv),
         r"cache.key shape should be \(B, Nkv, Lc, Dh\) = \(2, 3, \?, 4\), got \(2, 2, 9, 4\)"),
        (lambda: module(xs, cache=(1, 2)), "cache should be a ContextCache"),
        (lambda: module.context_cache(ctx, twin.array(np.ones(3, np.int32))),
         r"context_lengths shape should be \(B,\) = \(2,\), got \(3,\)"),
        (lambda: module(xs, twin.array(context[..., :5], "float32")),
         r"context shape should be \(B, L, d_context\) = \(2, \?, 11\), got \(2, 9, 5\)"),
    ]


@pytest.mark.parametrize("index", range(8))
def test_bad_calls_name_the_argument(twin, index):
    call, message = _cache_errors(twin)[index]
    with pytest.raises(ValueError, match=message):
        call()


def test_the_same_context_with_its_cache_is_accepted(twin):
    rng, _ = fresh_rng()
    x, context, _ = _inputs(rng)
    module = twin.build(MHCA, CONFIG, _params(CONFIG, rng, "float32"))
    xs, ctx = twin.array(x, "float32"), twin.array(context, "float32")
    np.testing.assert_array_equal(twin.numpy(module(xs, ctx, cache=module.context_cache(ctx))),
                                  twin.numpy(module(xs, ctx)))


# ---- against transformers' encoder-decoder attention, float64 ------------------------------

transformers = pytest.importorskip("transformers")

from transformers.models.bart import modeling_bart  # noqa: E402
from transformers.models.t5 import modeling_t5  # noqa: E402
from transformers.models.whisper import modeling_whisper  # noqa: E402

from tests.hf_harness import draw_parameters  # noqa: E402

D, H, HF_LQ, HF_LC, T5_DH = 12, 3, 5, 7, 5  # Dh = 4 (T5: d_kv = 5); B = 2; every size distinct
BART_NAMES = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "out": "out_proj"}


def _encoder_attn(config_class, cls):
    """Whisper's or BART's decoder encoder_attn, D wide with H heads."""
    config = config_class(d_model=D, decoder_attention_heads=H)
    config._attn_implementation = "eager"  # it returns the weights
    return cls(D, H, is_decoder=True, config=config, layer_idx=0)


def _t5():
    """T5's decoder cross-attention (EncDecAttention): no relative bias, no biases, scale 1,
    inner width N·d_kv = 15 ≠ d_model."""
    config = transformers.T5Config(d_model=D, num_heads=H, d_kv=T5_DH, is_decoder=True)
    config._attn_implementation = "eager"
    return modeling_t5.T5Attention(config, has_relative_attention_bias=False, layer_idx=0)


@dataclass(frozen=True)
class Family:
    """HF's cross-attention module, its layers' names by our role, our configuration, and
    which of its outputs are (y, weights)."""

    hf: Callable
    names: dict
    ours: dict
    outputs: tuple = (0, 1)


FAMILIES = {
    "whisper": Family(lambda: _encoder_attn(transformers.WhisperConfig,
                                            modeling_whisper.WhisperAttention), BART_NAMES,
                      dict(d_in=D, d_context=D, num_heads=H, qkv_bias=True, key_bias=False,
                           out_bias=True)),
    "bart": Family(lambda: _encoder_attn(transformers.BartConfig, modeling_bart.BartAttention),
                   BART_NAMES, dict(d_in=D, d_context=D, num_heads=H, qkv_bias=True,
                                    out_bias=True)),
    "t5": Family(_t5, {"query": "q", "key": "k", "value": "v", "out": "o"},
                 dict(d_in=D, d_context=D, num_heads=H, head_dim=T5_DH, scale=1.0), (0, 2)),
}


def _neutral(hf, names):
    """The state dict as neutral parameters: W (in, out) = Linear weight transposed."""
    sd = {n: t.detach().numpy().copy() for n, t in hf.state_dict().items()}
    params = {f"W_{ours}": sd[f"{theirs}.weight"].T for ours, theirs in names.items()}
    params.update({f"b_{ours}": sd[f"{theirs}.bias"] for ours, theirs in names.items()
                   if f"{theirs}.bias" in sd})
    return params


def _hf_run(family, rng):
    """HF's output, weights and gradients (x, context, neutral parameters) of Σ y ⊙ dO +
    Σ A ⊙ dA on a padded context (lengths [7, 4]), with the reference's fixture on the same."""
    family = FAMILIES[family]
    hf = family.hf().double().eval()
    draw_parameters(hf, rng)
    x, context = rng.standard_normal((2, HF_LQ, D)), rng.standard_normal((2, HF_LC, D))
    lengths = np.array([HF_LC, 4], np.int32)
    cot = random_cotangents(rng, (2, HF_LQ, D), (2, H, HF_LQ, HF_LC))
    padding = np.arange(HF_LC)[None, :] >= lengths[:, None]                    # (B, Lc)
    additive = np.where(padding, torch.finfo(torch.float64).min, 0.0)[:, None, None, :]
    xt, ct = (torch.from_numpy(a).requires_grad_() for a in (x, context))
    mask = torch.from_numpy(additive)
    out = (hf(xt, key_value_states=ct, mask=mask) if family is FAMILIES["t5"] else
           hf(xt, key_value_states=ct, attention_mask=mask, output_attentions=True))
    y, w = (out[i] for i in family.outputs)
    loss = ((y * torch.from_numpy(cot["output"].astype(np.float64))).sum()
            + (w * torch.from_numpy(cot["weights"].astype(np.float64))).sum())
    loss.backward()
    grads = {"x": xt.grad.numpy(), "context": ct.grad.numpy()}
    named = {theirs: ours for ours, theirs in family.names.items()}
    for name, p in hf.named_parameters():
        layer, kind = name.split(".")
        grad = p.grad.numpy()
        grads[f"{'W' if kind == 'weight' else 'b'}_{named[layer]}"] = (
            grad.T if kind == "weight" else grad)
    params = _neutral(hf, family.names)
    fixture = reference_fixture(MHCA, family.ours, {"x": x, "context": context,
                                                         "context_lengths": lengths},
                                params, cot, "float64")
    return dict(hf=hf, output=y.detach().numpy(), weights=w.detach().numpy(), grads=grads,
                params=params, fixture=fixture)


def rel(actual, expected):
    """max |actual − expected| / max |expected|."""
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reference_matches_transformers(family):
    """The float64 reference against HF's module: output, weights, and the gradients of x,
    the context and every parameter, to 1e-12 relative (HF scales q before the product)."""
    rng, seed = fresh_rng()
    run = _hf_run(family, rng)
    f = run["fixture"]
    assert ("b_key" in run["params"]) == (family == "bart")
    errors = {"output": rel(f.expected["output"], run["output"]),
              "weights": rel(f.expected["weights"], run["weights"])}
    assert set(f.grads) == set(run["grads"])
    errors.update({f"grad {n}": rel(f.grads[n], g) for n, g in run["grads"].items()
                   if n not in f.zero})
    assert all(e <= 1e-12 for e in errors.values()), (errors, seed)
    for n in f.zero:  # b_key (BART): zero by structure; HF's is rounding residue
        assert np.abs(run["grads"][n]).max() <= 1e-12 * np.abs(run["grads"]["W_key"]).max()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_twins_built_from_transformers_weights(twin, family):
    """Our modules built from HF's mapped weights: output, weights and every gradient against
    the reference (float64 tolerances), and the output against HF's to 1e-12."""
    rng, seed = fresh_rng()
    run = _hf_run(family, rng)
    f = run["fixture"]
    with twin.float64():
        module = twin.build(MHCA, FAMILIES[family].ours, run["params"])
        result = twin.run_with_grads(module, f, "float64")
    comps = compare_all(f, result, "float64")
    assert set(comps) == {"output", "weights", "grad x", "grad context",
                          *(f"grad {n}" for n in run["params"])}
    bad = {what: c for what, c in comps.items() if not c.ok}
    assert not bad, f"{twin.name}, seed {seed}: {bad}"
    assert rel(result["output"], run["output"]) <= 1e-12, seed


def test_whisper_decoding_with_its_cross_attention_cache(twin):
    """Whisper's encoder_attn decoding one query token at a time with an EncoderDecoderCache
    (the context's keys and values computed on the first call, is_updated, then reused, even
    though the context is passed again; no padding) against ours with a ContextCache, float64,
    ≤ 1e-12."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    rng, seed = fresh_rng()
    run = _hf_run("whisper", rng)
    hf, f = run["hf"], run["fixture"]
    x, context = (torch.from_numpy(f.inputs[n]) for n in ("x", "context"))
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    with torch.no_grad():
        hf_steps = [hf(x[:, i:i + 1], key_value_states=context, past_key_values=cache)[0]
                    for i in range(HF_LQ)]
    assert cache.is_updated[0]
    with twin.float64():
        module = twin.build(MHCA, FAMILIES["whisper"].ours, run["params"])
        ours = module.context_cache(twin.array(f.inputs["context"]))
        for i, expected in enumerate(hf_steps):
            y = twin.numpy(module(twin.array(f.inputs["x"][:, i:i + 1]), cache=ours))
            assert rel(y, expected.numpy()) <= 1e-12, (i, seed)


def test_siglip_pooling_head_attention(twin):
    """SigLIP's MultiheadAttentionPoolingHead: a learned probe (1, 1, D) repeated over the batch
    queries the image tokens through torch.nn.MultiheadAttention (batch_first, biases on every
    projection, in_proj_weight stacking q, k, v). Ours, with its weights mapped and the probe as
    x, equals its output and per-head weights at 1e-12 (float64); a padded context here is
    nn.MultiheadAttention's key_padding_mask (True = blocked) and our context_lengths."""
    from transformers.models.siglip import modeling_siglip
    rng, seed = fresh_rng()
    config = transformers.SiglipVisionConfig(hidden_size=D, num_attention_heads=H,
                                             intermediate_size=2 * D)
    head = modeling_siglip.SiglipMultiheadAttentionPoolingHead(config).double().eval()
    draw_parameters(head, rng)
    attention = head.attention
    tokens = rng.standard_normal((2, HF_LC, D))
    lengths = np.array([HF_LC, 3], np.int32)
    probe = head.probe.repeat(2, 1, 1)  # (B, 1, D), as the head's forward does
    ctx = torch.from_numpy(tokens)
    blocked = torch.from_numpy(np.arange(HF_LC)[None, :] >= lengths[:, None])
    with torch.no_grad():
        y, w = attention(probe, ctx, ctx, key_padding_mask=blocked, average_attn_weights=False)
    w_qkv = attention.in_proj_weight.detach().numpy()
    b_qkv = attention.in_proj_bias.detach().numpy()
    params = {f"W_{n}": w_qkv[i * D:(i + 1) * D].T.copy() for i, n in
              enumerate(("query", "key", "value"))}
    params.update({f"b_{n}": b_qkv[i * D:(i + 1) * D].copy() for i, n in
                   enumerate(("query", "key", "value"))})
    params.update(W_out=attention.out_proj.weight.detach().numpy().T.copy(),
                  b_out=attention.out_proj.bias.detach().numpy().copy())
    ours = dict(d_in=D, d_context=D, num_heads=H, qkv_bias=True, out_bias=True)
    with twin.float64():
        module = twin.build(MHCA, ours, params)
        out, weights = module(twin.array(probe.detach().numpy()), twin.array(tokens),
                              context_lengths=twin.array(lengths), return_weights=True)
    assert rel(twin.numpy(out), y.numpy()) <= 1e-12, seed
    assert np.abs(twin.numpy(weights) - w.numpy()).max() <= 1e-12, seed

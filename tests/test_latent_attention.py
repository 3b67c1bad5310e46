"""MultiHeadLatentAttention beyond the golden fixtures: decoding from the latent cache (token by
token and in chunks of 2 and 3, ragged prompts) equals the full forward in float64 for the plain
and the absorbed path in both frameworks; the cache holds the normalised latent and the rotated
k_pe, nothing per head; the absorbed path equals the plain one, gradients included; the JAX
decode step compiles once; the cache's bytes per token against GroupedQueryAttention's.

Shape legend: B batch, L tokens, M the cache's max_length, N heads, r kv_lora_rank, Dn
qk_nope_head_dim, Dr qk_rope_head_dim, Dv v_head_dim, d_in input width.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from flax import nnx

import jax_attn
import torch_attn
from golden import reference
from golden.specification import variants
from golden.specification.positions import LatentCache
from tests.helpers import JAX, TWINS, count_compiles, fresh_rng, other, sweep

MLA = "multi_head_latent_attention"
B, L, M = 2, 10, 13
# Every size distinct: d_in 5, N 3, r 7, Dn 6, Dr 4, Dv 11, q_lora_rank 9, d_out 8.
CONFIG = dict(d_in=5, num_heads=3, kv_lora_rank=7, qk_nope_head_dim=6, qk_rope_head_dim=4,
              v_head_dim=11, q_lora_rank=9, d_out=8, attention_bias=True, rope_theta=100.0)
CONFIGS = {
    "q_lora_interleaved": CONFIG,
    "no_lora_rotate_half": dict(CONFIG, q_lora_rank=None, attention_bias=False,
                                rope_interleaved=False),
    "yarn_mscale_all_dim": dict(CONFIG, rope_theta=None, rope_parameters={
        "rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,
        "original_max_position_embeddings": 4, "mscale": 1.0, "mscale_all_dim": 0.8}),
    # issue 42: the query temperature at the cache's positions (Mistral Small 4's, learned)
    "temperature": dict(CONFIG, query_temperature={"beta": 0.6, "floor_scale": 2, "shift": 0}),
    "temperature_learned": dict(CONFIG, q_lora_rank=None, query_temperature={"kind": "learned"}),
    "nope": dict(CONFIG, rope_theta=None, rope=False),  # Kimi Linear's
    # issue 42: HY-V4's gate per feature (from x, not the query's latent) with sinks; Ling 3.0's
    # gate per head (bailing_hybrid's MLA layers, no q_lora)
    "gate_sinks_hy_v4": dict(CONFIG, rope_interleaved=False, sinks=True, output_gate="sigmoid"),
    "gate_per_head_ling": dict(CONFIG, q_lora_rank=None, attention_bias=False,
                               output_gate="sigmoid_per_head"),
    # issue 44: dots3's RMSNorm of the shared rotary key before RoPE, with its per-head gate;
    # AXK2's query and gate reading [RMSNorm(c_q) | c_q]
    "rope_key_norm_dots3": dict(CONFIG, rope_key_norm=True, output_gate="sigmoid_per_head"),
    "query_latent_axk2": dict(CONFIG, query_latent="normed_and_raw", output_gate="sigmoid"),
    # dots.3-note's windowed layers: W = 3 keys, the query's own included (L = 10 past it)
    "window_dots3": dict(CONFIG, sliding_window=3, rope_key_norm=True),
}
# float64: decoding and the full forward differ only in summation order (GroupedQueryAttention's
# decode tests use the same bound); plain and absorbed in the order of their products.
EXACT = 1e-12


def _params(config, rng):
    """Random float64 neutral parameters: N(0, 1/fan_in) weights, N(0, 1) biases, the norms'
    weights 1 + N(0, 0.3²)."""
    shapes = variants.get(MLA).param_shapes(config)
    return {n: (1 + 0.3 * rng.standard_normal(s) if n.endswith("_norm") else
                rng.standard_normal(s) / (np.sqrt(s[0]) if n.startswith("W_") else 1))
            for n, s in shapes.items()}


def _call(twin, module, x, **kw):
    """The module on NumPy arrays (lengths int32), outputs as float64 NumPy (and the cache)."""
    kw = {n: twin.array(np.asarray(a, np.int32)) if n == "query_seq_lengths" else a
          for n, a in kw.items()}
    out = module(twin.array(x), **kw)
    return (twin.numpy(out[0]), out[1]) if "cache" in kw else twin.numpy(out)


def _decode(twin, module, x, prompt, chunks, absorb):
    """Prefill row b's first prompt[b] tokens (right-padded), then feed each row its next
    tokens ``chunks[step % len(chunks)]`` at a time (fewer, padded, at its end). Returns the
    outputs at every position (B, L, d_out) and the final cache."""
    b, length = x.shape[:2]
    out = np.full((b, length, CONFIG["d_out"]), np.nan)
    cache = module.init_cache(b, M)
    y, cache = _call(twin, module, x[:, :max(prompt)], cache=cache, query_seq_lengths=prompt,
                     absorb=absorb)
    pos = np.array(prompt)
    for r in range(b):
        out[r, :pos[r]] = y[r, :pos[r]]
    step = 0
    while (pos < length).any():
        k = chunks[step % len(chunks)]
        new = np.clip(length - pos, 0, k)                       # (B,)
        idx = np.minimum(pos[:, None] + np.arange(k), length - 1)  # (B, k)
        y, cache = _call(twin, module, x[np.arange(b)[:, None], idx], cache=cache,
                         query_seq_lengths=new, absorb=absorb)
        for r in range(b):
            out[r, pos[r]:pos[r] + new[r]] = y[r, :new[r]]
        pos, step = pos + new, step + 1
    return out, cache


def _held(config, params, x):
    """What the cache should hold for x (B, L, d_in), derived by hand in float64: the latent
    c = RMSNorm(x W_kv_a + b_kv_a)[..., :r] · kv_a_norm and k_pe turned by RoPE at 0 … L − 1
    (the reference's turn and angles)."""
    c = variants.get(MLA).config(config)
    r = c["kv_lora_rank"]
    kv_a = x @ params["W_kv_a"] + params.get("b_kv_a", 0.0)
    latent = kv_a[..., :r]
    latent = latent / np.sqrt((latent ** 2).mean(-1, keepdims=True) + c["rms_norm_eps"])
    cos, sin = reference.rope_cos_sin(variants.latent_rope(c), c["qk_rope_head_dim"],
                                      np.arange(x.shape[1]))
    k_pe = kv_a[..., r:]
    if c["rope_key_norm"]:  # dots3's: RMS-normalised, times k_pe_norm, before RoPE
        k_pe = k_pe / np.sqrt((k_pe ** 2).mean(-1, keepdims=True) + c["rms_norm_eps"]) * (
            params["k_pe_norm"])
    k_pe = reference.turn(k_pe, cos, sin, c["rope_interleaved"]) if c["rope"] else (
        k_pe)  # Kimi Linear's: not turned
    return latent * params["kv_a_norm"], k_pe


def rel(actual, expected):
    """max |actual − expected| / max |expected|."""
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


# ---- decoding from the latent cache equals the full forward ---------------------------------

# Every configuration × way of feeding × path in the whole matrix; in the quick suite a covering
# few, which hold each configuration, each way of feeding and each path at least once.
DECODES = [(n, c, a) for n in CONFIGS for c in ((1,), (2, 3)) for a in (False, True)]


@pytest.mark.parametrize("name, chunks, absorb", sweep(
    [pytest.param(n, c, a, id=f"{n}-{'token_by_token' if c == (1,) else 'chunks_2_3'}-"
                  f"{'absorbed' if a else 'plain'}") for n, c, a in DECODES],
    [{("name", n), ("chunks", c), ("absorb", a)} for n, c, a in DECODES]))
def test_decoding_equals_full_forward(twin, name, chunks, absorb):
    rng, seed = fresh_rng()
    config = CONFIGS[name]
    params = _params(config, rng)
    x = rng.standard_normal((B, L, config["d_in"]))
    with twin.float64():
        module = twin.build(MLA, config, params)
        full = _call(twin, module, x)
        steps, cache = _decode(twin, module, x, prompt=[3, 5], chunks=chunks, absorb=absorb)
    expected, _, _ = reference.VARIANTS[MLA][0](config, {"x": x}, params)
    assert rel(full, expected) <= EXACT, f"seed {seed}"
    assert np.abs(steps - full).max() <= EXACT, f"seed {seed}"
    # the cache: per token the normalised latent and the rotated k_pe, nothing per head
    assert isinstance(cache, twin.lib.LatentCache)
    assert tuple(cache.latent.shape) == (B, M, config["kv_lora_rank"])
    assert tuple(cache.rope_key.shape) == (B, M, config["qk_rope_head_dim"])
    np.testing.assert_array_equal(np.asarray(cache.lengths), [L, L])
    latent, k_pe = _held(config, params, x)
    assert np.abs(twin.numpy(cache.latent)[:, :L] - latent).max() <= EXACT, f"seed {seed}"
    assert np.abs(twin.numpy(cache.rope_key)[:, :L] - k_pe).max() <= EXACT, f"seed {seed}"
    assert not twin.numpy(cache.latent)[:, L:].any() and not twin.numpy(cache.rope_key)[
        :, L:].any()


def test_tokens_past_max_length_are_dropped_alike(twin):
    """A cache of M = 5 holding 4 tokens takes 1 of a 3-token chunk: that token's output is the
    full forward's, the 2 dropped are padding rows (the output bias), the lengths stop at M, and
    both paths agree, as GroupedQueryAttention drops them."""
    rng, seed = fresh_rng()
    params = _params(CONFIG, rng)
    x = rng.standard_normal((B, 7, CONFIG["d_in"]))
    with twin.float64():
        module = twin.build(MLA, CONFIG, params)
        full = _call(twin, module, x[:, :5])
        for absorb in (False, True):
            _, cache = _call(twin, module, x[:, :4], cache=module.init_cache(B, 5), absorb=absorb)
            y, cache = _call(twin, module, x[:, 4:7], cache=cache, absorb=absorb)
            np.testing.assert_array_equal(np.asarray(cache.lengths), [5, 5])
            assert np.abs(y[:, 0] - full[:, 4]).max() <= EXACT, (absorb, seed)
            np.testing.assert_allclose(y[:, 1:], np.broadcast_to(params["b_out"], y[:, 1:].shape),
                                       rtol=0, atol=EXACT)


# ---- the absorbed path is the plain one ------------------------------------------------------

def _grads_torch(module, x, dy, dw, absorb):
    xt = torch.tensor(x, requires_grad=True)
    y, w = module(xt, return_weights=True, absorb=absorb)
    ((y * torch.from_numpy(dy)).sum() + (w * torch.from_numpy(dw)).sum()).backward()
    grads = torch_attn.params.export_grads(module)
    return y.detach().numpy(), w.detach().numpy(), dict(grads, x=xt.grad.numpy())


def _grads_jax(module, x, dy, dw, absorb):
    def loss(m, x):
        y, w = m(x, return_weights=True, absorb=absorb)
        return (y * dy).sum() + (w * dw).sum(), (y, w)

    graphdef, _, rest = nnx.split(module, nnx.Param, ...)
    (_, (y, w)), (g_module, g_x) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        module, JAX.array(x))
    grads = jax_attn.export_params(nnx.merge(graphdef, g_module, rest))
    return JAX.numpy(y), JAX.numpy(w), dict(grads, x=JAX.numpy(g_x))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_absorbed_equals_plain_with_gradients(twin, name):
    """Output, weights and every gradient (x and each parameter) of both paths, against the
    float64 reference's forward and analytic backward."""
    rng, seed = fresh_rng()
    config = CONFIGS[name]
    params = _params(config, rng)
    x = rng.standard_normal((B, L, config["d_in"]))
    forward, backward = reference.VARIANTS[MLA]
    y_ref, w_ref, saved = forward(config, {"x": x}, params)
    dy, dw = rng.standard_normal(y_ref.shape), rng.standard_normal(w_ref.shape)
    g_ref = backward(saved, dy, dw)
    run = _grads_torch if twin.name == "torch" else _grads_jax
    with twin.float64():
        for absorb in (False, True):
            y, w, grads = run(twin.build(MLA, config, params), x, dy, dw, absorb)
            assert set(grads) == set(g_ref) == {"x", *params}
            errors = {n: rel(grads[n], g_ref[n]) for n in g_ref}
            errors.update(output=rel(y, y_ref), weights=rel(w, w_ref))
            assert max(errors.values()) <= EXACT, (absorb, errors, seed)


def test_absorbed_path_makes_no_per_head_keys():
    """The absorbed JAX program never forms a (B, N, Lk, ·) key or value: the core runs on one
    latent head (its key (B, 1, M, r + Dr)); the plain one expands W_kv_b over the cache."""
    rng, _ = fresh_rng()
    module = JAX.build(MLA, CONFIG, {n: a.astype(np.float32)
                                     for n, a in _params(CONFIG, rng).items()})
    x = JAX.array(rng.standard_normal((B, 1, 5)).astype(np.float32))
    cache = module.init_cache(B, M)
    n, r, dr = CONFIG["num_heads"], CONFIG["kv_lora_rank"], CONFIG["qk_rope_head_dim"]
    per_head_key = f"f32[{B},{n},{M},{CONFIG['qk_nope_head_dim'] + dr}]"
    latent_key = f"f32[{B},1,{M},{r + dr}]"
    plain, absorbed = (str(jax.make_jaxpr(lambda x, c, a=a: module(x, cache=c, absorb=a))(
        x, cache)) for a in (False, True))
    assert per_head_key in plain and latent_key not in plain
    assert latent_key in absorbed and per_head_key not in absorbed


def test_jax_decode_step_compiles_once_and_scatters():
    rng, _ = fresh_rng()
    module = JAX.build(MLA, CONFIG, {n: a.astype(np.float32)
                                     for n, a in _params(CONFIG, rng).items()})
    tokens = [JAX.array(rng.standard_normal((B, 1, 5)).astype(np.float32)) for _ in range(5)]
    _, cache = module(JAX.array(rng.standard_normal((B, 4, 5)).astype(np.float32)),
                      cache=module.init_cache(B, 16))
    for absorb in (False, True):
        _, cache = module(tokens[0], cache=cache, absorb=absorb)  # compiles this step's program
        with count_compiles() as compiled:
            for t in tokens[1:]:
                _, cache = module(t, cache=cache, absorb=absorb)
        assert compiled == [], absorb
    np.testing.assert_array_equal(np.asarray(cache.lengths), [4 + 2 * len(tokens)] * B)

    @nnx.jit(static_argnames="absorb")
    def step(m, x, c, absorb):  # a caller's own jit around the module
        return m(x, cache=c, absorb=absorb)

    for absorb in (False, True):
        cache = module.init_cache(B, 16)
        with count_compiles() as compiled:
            for t in tokens:
                _, cache = step(module, t, cache, absorb)
        assert len(compiled) == 1, (absorb, compiled)
        np.testing.assert_array_equal(np.asarray(cache.lengths), [len(tokens)] * B)
        program = str(jax.make_jaxpr(lambda x, c, a=absorb: module(x, cache=c, absorb=a))(
            tokens[0], cache))
        assert "scatter" in program and "callback" not in program


# ---- what the cache costs ---------------------------------------------------------------------

# DeepSeek-V3's attention shapes scaled down by 8 in width (r 512 -> 64, Dr 64 -> 8, Dn 128 ->
# 16, Dv 128 -> 16, N 128 -> 16), d_in 7168 / 8 = 896.
WIDE = dict(d_in=896, num_heads=16, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_bytes_per_token(twin, dtype):
    """(r + Dr) · itemsize per token and layer, counted by hand, and what init_cache allocates;
    GroupedQueryAttention of the same d_in and heads (Dh = d_in / N = 56) holds 2 · Nkv · Dh
    values per token: 1,792 with Nkv = N (multi-head), 224 with Nkv = 2, against MLA's 72."""
    itemsize = {"float32": 4, "bfloat16": 2}[dtype]
    dt = twin.adapter.dtype(dtype)
    mla = twin.make(MLA, WIDE)
    assert mla.cache_bytes_per_token(dt) == (64 + 8) * itemsize
    cache = mla.init_cache(3, 11, dt)
    held = sum(_nbytes(a) for a in (cache.latent, cache.rope_key))
    assert held == 3 * 11 * mla.cache_bytes_per_token(dt)
    for kv_heads, values in ((16, 2 * 16 * 56), (2, 2 * 2 * 56)):
        gqa = twin.make("grouped_query_attention", dict(d_in=896, num_heads=16,
                                                        num_kv_heads=kv_heads))
        kv = gqa.init_cache(3, 11, dt)
        gqa_bytes = sum(_nbytes(a) for a in (kv.key, kv.value)) // (3 * 11)
        assert gqa_bytes == values * itemsize
        assert gqa_bytes / mla.cache_bytes_per_token(dt) == values / 72


def _nbytes(a) -> int:
    """Bytes an array allocates (torch or JAX)."""
    return a.numel() * a.element_size() if torch.is_tensor(a) else a.nbytes


# ---- a latent cache between the frameworks: export_cache, load_cache --------------------------

@pytest.mark.parametrize("absorb", [False, True], ids=["plain", "absorbed"])
@pytest.mark.parametrize("name", ["q_lora_interleaved", "no_lora_rotate_half"])
@pytest.mark.parametrize("start", list(TWINS))
def test_a_latent_cache_filled_in_one_framework_continues_in_the_other(start, name, absorb):
    """Ragged prompts (3 and 5 tokens) prefilled in one framework, the cache exported (NumPy)
    and loaded into the other, the rest decoded there token by token: the first framework's full
    forward at float64."""
    rng, seed = fresh_rng()
    config = CONFIGS[name]
    first, second = TWINS[start], other(TWINS[start])
    params = _params(config, rng)
    x = rng.standard_normal((B, L, config["d_in"]))
    pos = np.array([3, 5])
    with first.float64(), second.float64():
        a, b = first.build(MLA, config, params), second.build(MLA, config, params)
        full = _call(first, a, x)
        head, cache = _call(first, a, x[:, :5], cache=a.init_cache(B, M),
                            query_seq_lengths=pos, absorb=absorb)
        exported = first.lib.export_cache(cache)
        moved = second.lib.load_cache(exported)
        out = np.full((B, L, config["d_out"]), np.nan)
        for r in range(B):
            out[r, :pos[r]] = head[r, :pos[r]]
        while (pos < L).any():  # one token a step; a finished row is padding
            new = (pos < L).astype(np.int32)
            y, moved = _call(second, b, x[np.arange(B), np.minimum(pos, L - 1)][:, None],
                             cache=moved, query_seq_lengths=new, absorb=absorb)
            out[new == 1, pos[new == 1]] = y[new == 1, 0]
            pos = pos + new
    assert type(exported) is LatentCache and isinstance(moved, second.lib.LatentCache)
    assert all(isinstance(f, np.ndarray) for f in exported[:3])
    assert exported.index_key is None  # no learned indexer here (tests/test_indexer_*.py)
    assert rel(full, reference.VARIANTS[MLA][0](config, {"x": x}, params)[0]) <= EXACT
    assert np.abs(out - full).max() <= EXACT, f"seed {seed}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_exported_latent_cache_is_numpy_in_float32_or_wider(twin, dtype):
    """bfloat16 fields export as float32 (exactly: every bfloat16 is a float32), lengths int32;
    ``load_cache(dtype=...)`` gives the fields that dtype and the same values."""
    rng, _ = fresh_rng()
    params = {n: a.astype(np.float32) for n, a in _params(CONFIG, rng).items()}
    module = twin.build(MLA, CONFIG, params)
    dt = twin.adapter.dtype(dtype)
    _, cache = module(twin.array(rng.standard_normal((B, 4, CONFIG["d_in"])), "float32"),
                      cache=module.init_cache(B, M))
    cast = (lambda a: a.to(dt)) if twin.name == "torch" else (lambda a: a.astype(dt))
    cache = type(cache)(cast(cache.latent), cast(cache.rope_key), cache.lengths)
    exported = twin.lib.export_cache(cache)
    assert (exported.latent.dtype, exported.rope_key.dtype, exported.lengths.dtype) == (
        np.float32, np.float32, np.int32)
    np.testing.assert_array_equal(exported.latent, twin.numpy(cache.latent))
    np.testing.assert_array_equal(exported.lengths, [4, 4])
    loaded = twin.lib.load_cache(exported, dtype=dt)
    assert loaded.latent.dtype == dt and loaded.rope_key.dtype == dt
    np.testing.assert_array_equal(twin.numpy(loaded.rope_key), twin.numpy(cache.rope_key))


# ---- against transformers' DeepseekV3Attention -------------------------------------------------
#
# HF's module in float64 (``.double()``, sdpa: float64 on the CPU), random weights copied into
# ours, fed cos and sin computed in float64 from golden.specification.positions' frequencies (times
# the yarn
# attention factor, as HF's rotary embedding multiplies them). One float32 step remains inside
# it: DeepseekV3RMSNorm casts to float32 (q_a_layernorm, kv_a_layernorm). Unpatched, the
# agreement is at float32 level: the relative error (max |ours − HF| / max |HF|, output, x's
# gradient and every parameter's) lies in (1e-12, 1e-6), below float32 rounding's reach and
# above float64's. With the norm patched to compute in its input's dtype, nothing is float32 and
# everything agrees to 1e-12: the norm is what limits the agreement. HF's attention norms use
# eps 1e-6 whatever config.rms_norm_eps says (DeepseekV3RMSNorm's default): ours is given 1e-6.
# Measured with transformers 5.23.0 (the reference; 20 seeds per case, output and every gradient
# but b_out's): with HF's norm, relative errors from 1.2e-8 to 4.6e-7; with it in float64, at
# most 6.6e-15.

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: E402

FLOAT32_LEVEL = (1e-12, 1e-6)  # (above, below), as tests/test_hf_decoders.py
HF_CASES = {  # our configuration; HF's follows from it (_hf_config)
    "q_lora_interleaved": CONFIG,
    "no_lora_rotate_half": dict(CONFIG, q_lora_rank=None, rope_interleaved=False),
    "yarn_mscale_all_dim": CONFIGS["yarn_mscale_all_dim"],
    "yarn_mscale_all_dim_rotate_half": dict(CONFIGS["yarn_mscale_all_dim"],
                                            rope_interleaved=False, q_lora_rank=None),
}
HF_NAMES = {"W_query": "q_proj", "W_q_a": "q_a_proj", "W_q_b": "q_b_proj",
            "W_kv_a": "kv_a_proj_with_mqa", "W_kv_b": "kv_b_proj", "W_out": "o_proj",
            "q_a_norm": "q_a_layernorm", "kv_a_norm": "kv_a_layernorm"}


def _hf_config(config):
    c = variants.get(MLA).config(config)
    rope = dict(variants.latent_rope(c))
    rope.pop("precision"), rope.pop("partial_rotary_factor")
    hf = transformers.DeepseekV3Config(
        hidden_size=c["d_in"], num_attention_heads=c["num_heads"],
        num_key_value_heads=c["num_heads"], q_lora_rank=c["q_lora_rank"],
        kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"],
        attention_bias=c["attention_bias"], rope_interleave=c["rope_interleaved"],
        rope_parameters=rope)
    hf._attn_implementation = "sdpa"
    return hf


def _hf_module(config, rng):
    """HF's DeepseekV3Attention of ``config`` (d_out = d_in: HF has no other) in float64 with
    random weights, and those weights as our neutral parameters."""
    hf = modeling_deepseek_v3.DeepseekV3Attention(_hf_config(config), 0).double().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            scale = 1 / np.sqrt(p.shape[1]) if p.dim() == 2 else 1.0
            base = 1.0 if "layernorm" in name else 0.0
            p.copy_(torch.from_numpy(base + scale * rng.standard_normal(tuple(p.shape))))
    sd = {n: t.detach().numpy().copy() for n, t in hf.state_dict().items()}
    params = {}
    for ours, theirs in HF_NAMES.items():
        if f"{theirs}.weight" in sd:
            w = sd[f"{theirs}.weight"]
            params[ours] = w if ours.endswith("_norm") else w.T
            if f"{theirs}.bias" in sd:
                params["b" + ours[1:]] = sd[f"{theirs}.bias"]
    return hf, params


def _hf_cos_sin(config, positions):
    """(cos, sin) (1, L, Dr) float64 in HF's layout, cat(angles, angles), times the attention
    factor: golden.specification.positions' float64 frequencies."""
    from golden.specification.positions import rope_frequencies
    c = variants.get(MLA).config(config)
    f, m = rope_frequencies(variants.latent_rope(c), c["qk_rope_head_dim"])
    angles = np.asarray(positions)[:, None] * f
    emb = np.concatenate([angles, angles], -1)
    return tuple(torch.from_numpy(m * t(emb))[None] for t in (np.cos, np.sin))


def _hf_grads(hf, x, dy):
    """HF's output and the gradients of Σ y ⊙ dy, in our names and layout."""
    xt = torch.tensor(x, requires_grad=True)
    y = hf(xt, _hf_cos_sin(_ours_of(hf), np.arange(x.shape[1])), None)[0]
    (y * torch.from_numpy(dy)).sum().backward()
    grads = {"x": xt.grad.numpy()}
    for ours, theirs in HF_NAMES.items():
        layer = getattr(hf, theirs)
        if layer is None:
            continue
        g = layer.weight.grad.numpy()
        grads[ours] = g if ours.endswith("_norm") else g.T
        if getattr(layer, "bias", None) is not None:
            grads["b" + ours[1:]] = layer.bias.grad.numpy()
    return y.detach().numpy(), grads


def _ours_of(hf):
    """Our configuration of HF's module (its config read back)."""
    c = hf.config
    return dict(d_in=c.hidden_size, num_heads=c.num_attention_heads,
                kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                q_lora_rank=c.q_lora_rank, attention_bias=c.attention_bias,
                rope_interleaved=c.rope_interleave, rope_parameters=dict(c.rope_parameters))


def _float64_norm(self, h):
    """DeepseekV3RMSNorm without its float32 cast."""
    return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True)
                                          + self.variance_epsilon))


# Each case and each norm once in the quick suite, every pair in the whole matrix.
@pytest.mark.parametrize("name, float32_norm", sweep(
    [pytest.param(n, f, id=f"{n}-{'hf_norm' if f else 'float64_norm'}")
     for n in HF_CASES for f in (True, False)],
    [{("name", n), ("norm", f)} for n in HF_CASES for f in (True, False)]))
def test_matches_transformers(name, float32_norm, monkeypatch):
    """The reference's output, x's gradient and every parameter's, and both twins' (plain and
    absorbed), against DeepseekV3Attention's: at float32 level with HF's float32 RMSNorm (but
    b_out's gradient, Σ dy, which no norm reaches), to 1e-12 without it; HF's scaling
    (yarn_apply_mscale) is ours to the last bits."""
    if not float32_norm:
        monkeypatch.setattr(modeling_deepseek_v3.DeepseekV3RMSNorm, "forward", _float64_norm)
    rng, seed = fresh_rng()
    config = dict(HF_CASES[name], d_out=None)
    hf, params = _hf_module(config, rng)
    assert abs(hf.scaling - variants.latent_scale(variants.get(MLA).config(config))) <= (
        2e-16 * hf.scaling)
    x = rng.standard_normal((B, L, config["d_in"]))
    y_hf, g_hf = _hf_grads(hf, x, dy := rng.standard_normal((B, L, config["d_in"])))
    y_ref, w_ref, saved = reference.VARIANTS[MLA][0](config, {"x": x}, params)
    g_ref = reference.VARIANTS[MLA][1](saved, dy, np.zeros_like(w_ref))
    assert set(g_ref) == set(g_hf) == {"x", *params}
    errors = {"reference output": rel(y_ref, y_hf),
              **{f"reference grad {n}": rel(g_ref[n], g_hf[n]) for n in g_hf}}
    for twin in TWINS.values():
        run = _grads_torch if twin.name == "torch" else _grads_jax
        with twin.float64():
            for absorb in (False, True):
                y, _, grads = run(twin.build(MLA, config, params), x, dy, np.zeros_like(w_ref),
                                  absorb)
                errors[f"{twin.name} {absorb} output"] = rel(y, y_hf)
                errors.update({f"{twin.name} {absorb} grad {n}": rel(grads[n], g_hf[n])
                               for n in g_hf})
    if float32_norm:
        low, high = FLOAT32_LEVEL
        # b_out's gradient is Σ dy over the positions, which no norm touches: exact anyway
        bad = {what: e for what, e in errors.items() if not (
            e <= EXACT if what.endswith("grad b_out") else low < e < high)}
    else:
        bad = {what: e for what, e in errors.items() if e > EXACT}
    assert not bad, (bad, seed)


def test_hf_attention_norms_ignore_rms_norm_eps():
    """DeepseekV3Attention's q_a_layernorm and kv_a_layernorm keep DeepseekV3RMSNorm's default
    eps 1e-6 whatever config.rms_norm_eps is (the decoder layer's norms read it): ours takes
    rms_norm_eps as the attention's own, default 1e-6."""
    hf_config = _hf_config(CONFIG)
    hf_config.rms_norm_eps = 1e-3
    hf = modeling_deepseek_v3.DeepseekV3Attention(hf_config, 0)
    assert hf.q_a_layernorm.variance_epsilon == hf.kv_a_layernorm.variance_epsilon == 1e-6
    assert variants.get(MLA).config(CONFIG)["rms_norm_eps"] == 1e-6


def _deinterleave(a):
    """Our interleaved rotated pairs (a0, b0, a1, b1, …) in HF's output layout (a0, a1, …, b0,
    b1, …): apply_rotary_pos_emb_interleave returns the turned pairs as two halves."""
    return np.concatenate([a[..., 0::2], a[..., 1::2]], -1)


@pytest.mark.parametrize("name", ["q_lora_interleaved", "no_lora_rotate_half"])
def test_decoding_matches_transformers_dynamic_cache(twin, name, monkeypatch):
    """A 4-token prefill then one token at a time: our outputs (plain and absorbed) equal HF's
    with its DynamicCache step by step, and our cache holds what HF's does: its latent, and its
    rotated k_rot (in HF's half layout when interleaved). HF's norm in float64 (as above), so
    1e-12."""
    monkeypatch.setattr(modeling_deepseek_v3.DeepseekV3RMSNorm, "forward", _float64_norm)
    rng, seed = fresh_rng()
    config = dict(HF_CASES[name], d_out=None)
    hf, params = _hf_module(config, rng)
    x = rng.standard_normal((1, 8, config["d_in"]))
    past = transformers.DynamicCache()
    outs = []
    with torch.no_grad():
        for start, stop in [(0, 4)] + [(i, i + 1) for i in range(4, 8)]:
            outs.append(hf(torch.from_numpy(x[:, start:stop]),
                           _hf_cos_sin(config, np.arange(start, stop)), None,
                           past_key_values=past)[0].numpy())
    y_hf = np.concatenate(outs, 1)
    hf_latent, hf_rot = (t[:, 0].numpy() for t in (past.layers[0].keys, past.layers[0].values))
    with twin.float64():
        module = twin.build(MLA, config, params)
        for absorb in (False, True):
            cache, outs = module.init_cache(1, 9), []
            for start, stop in [(0, 4)] + [(i, i + 1) for i in range(4, 8)]:
                y, cache = _call(twin, module, x[:, start:stop], cache=cache, absorb=absorb)
                outs.append(y)
            assert rel(np.concatenate(outs, 1), y_hf) <= EXACT, (absorb, seed)
    rot = twin.numpy(cache.rope_key)[:, :8]
    assert rel(twin.numpy(cache.latent)[:, :8], hf_latent) <= EXACT, seed
    interleaved = variants.get(MLA).config(config)["rope_interleaved"]
    assert rel(_deinterleave(rot) if interleaved else rot, hf_rot) <= EXACT, seed


# ---- issue 42: the output gate and sinks --------------------------------------------------------

@pytest.mark.parametrize("option, value, message", [
    ("output_gate", "tanh", "output_gate should be False, True (= 'sigmoid') or one of 'sigmoid', "
                            "'sigmoid_per_head', 'softplus', 'softplus_per_head', got 'tanh'"),
    ("sinks", 1, "sinks should be True or False"),
    # issue 44's options
    ("rope_key_norm", "yes", "rope_key_norm should be True or False"),
    ("query_latent", "raw", "query_latent should be one of 'normed', 'normed_and_raw', got 'raw'"),
    ("sliding_window", 0, "sliding_window should be"),
])
def test_gate_and_sinks_are_validated_by_name(twin, option, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        twin.make(MLA, dict(CONFIG, **{option: value}))


@pytest.mark.parametrize("change, message", [
    ({"q_lora_rank": None, "query_latent": "normed_and_raw"},
     "query_latent should be 'normed' without q_lora_rank (there is no query latent c_q to read "
     "raw), got 'normed_and_raw'"),
    ({"sliding_window": 3, "index_topk": 2, "index_heads": 2, "index_head_dim": 4},
     "sliding_window should be None with index_topk"),
])
def test_issue_44_options_that_do_not_fit_are_refused_by_name(twin, change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        twin.make(MLA, dict(CONFIG, **change))


@pytest.mark.parametrize("output_gate, width", [("sigmoid", 3 * 11), ("sigmoid_per_head", 3),
                                                (False, None)])
def test_gate_and_sinks_parameters(twin, output_gate, width):
    """W_gate (d_in, N·Dv) per feature, (d_in, N) per head, no bias whatever attention_bias;
    sinks (N,), built at 0 (no sink's weight changes nothing but the softmax's sum)."""
    config = dict(CONFIG, sinks=True, output_gate=output_gate)
    shapes = variants.get(MLA).param_shapes(config)
    assert shapes["sinks"] == (3,) and "b_gate" not in shapes
    assert shapes.get("W_gate") == (None if width is None else (CONFIG["d_in"], width))
    params = twin.export(twin.make(MLA, config))
    np.testing.assert_array_equal(params["sinks"], np.zeros(3))
    assert set(params) == set(shapes)


def test_gate_reads_x_not_the_query_latent():
    """With q_lora_rank the gate's input is x (HY-V4's gate_proj(hidden_states)), not the query's
    latent: the reference's gate values are σ(x W_gate) by hand, and the output is the ungated
    heads' output times them through W_out."""
    rng, seed = fresh_rng()
    config = CONFIGS["gate_sinks_hy_v4"]
    params = _params(config, rng)
    x = rng.standard_normal((B, L, config["d_in"]))
    y, _, saved = reference.VARIANTS[MLA][0](config, {"x": x}, params)
    ungated, gate = saved["block"]["gate"][:2]               # (B, L, N·Dv) each
    np.testing.assert_allclose(gate, 1 / (1 + np.exp(-(x @ params["W_gate"]))), rtol=1e-14,
                               atol=0, err_msg=f"seed {seed}")
    assert rel(y, (ungated * gate) @ params["W_out"] + params["b_out"]) <= EXACT, seed


# ---- HY-V4's own HYV4Attention, its indexer keeping every key (L ≤ index_topk) -----------------
#
# HY-V4 (models/hy_v4) is MLA with gate_proj (N·v_head_dim, from hidden_states), sinks (GPT-OSS's
# eager attention) and DSA's lightning indexer choosing index_topk keys per query (issue 44:
# refused as a family). With L ≤ index_topk the indexer keeps every key, so the module is exactly
# our latent attention with output_gate="sigmoid", sinks=True, rotate-half RoPE. HF's RMSNorm
# computes in float32: patched to its input's dtype (as above), everything agrees to 1e-12.

from transformers.models.hy_v4 import modeling_hy_v4  # noqa: E402

HY_V4 = dict(d_in=5, num_heads=3, kv_lora_rank=7, qk_nope_head_dim=6, qk_rope_head_dim=4,
             v_head_dim=11, q_lora_rank=9, rope_theta=100.0, rope_interleaved=False, sinks=True,
             output_gate="sigmoid")


def _hy_v4_module(rng, index_topk):
    """HF's HYV4Attention (layer 0: a full indexer) in float64, eager (its sinks), random
    weights and sinks, and our neutral parameters of it."""
    c = variants.get(MLA).config(HY_V4)
    hf_config = modeling_hy_v4.HYV4Config(
        hidden_size=c["d_in"], num_attention_heads=c["num_heads"], q_lora_rank=c["q_lora_rank"],
        kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"], num_hidden_layers=1,
        index_topk=index_topk, index_head_dim=8, index_n_heads=2, vocab_size=16,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]})
    hf_config._attn_implementation = "eager"
    hf = modeling_hy_v4.HYV4Attention(hf_config, 0).double().eval()
    assert hf.indexer is not None and hf.indexer.index_topk == index_topk
    with torch.no_grad():
        for name, p in hf.named_parameters():
            scale = 1 / np.sqrt(p.shape[1]) if p.dim() == 2 else 1.0
            base = 1.0 if "layernorm" in name or "norm.weight" in name else 0.0
            p.copy_(torch.from_numpy(base + scale * rng.standard_normal(tuple(p.shape))))
    sd = {n: t.detach().numpy().copy() for n, t in hf.state_dict().items()}
    names = dict(HF_NAMES, W_gate="gate_proj")
    params = {ours: (sd[f"{theirs}.weight"] if ours.endswith("_norm") else
                     sd[f"{theirs}.weight"].T)
              for ours, theirs in names.items() if f"{theirs}.weight" in sd}
    params["sinks"] = sd["sinks"]
    return hf, params, names


def _hy_v4_run(hf, x, dy, names):
    """HF's output and the gradients of Σ y ⊙ dy in our names (x, every parameter, sinks), with
    a causal additive mask (B, 1, L, L)."""
    xt = torch.tensor(x, requires_grad=True)
    length = x.shape[1]
    causal = np.where(np.tril(np.ones((length, length), bool)), 0.0, np.finfo(np.float64).min)
    mask = torch.from_numpy(np.broadcast_to(causal, (x.shape[0], 1, length, length)).copy())
    y = hf(xt, _hf_cos_sin(HY_V4, np.arange(length)), mask)[0]
    (y * torch.from_numpy(dy)).sum().backward()
    grads = {"x": xt.grad.numpy(), "sinks": hf.sinks.grad.numpy()}
    for ours, theirs in names.items():
        layer = getattr(hf, theirs, None)
        if layer is not None:
            g = layer.weight.grad.numpy()
            grads[ours] = g if ours.endswith("_norm") else g.T
    return y.detach().numpy(), grads


def test_matches_hy_v4_attention_with_every_key_kept(monkeypatch):
    """HF's HYV4Attention with index_topk = L (its indexer keeps every allowed key): the
    reference's output and every gradient (x, W_gate, sinks, each weight), and both twins'
    (plain and absorbed), equal HF's to 1e-12 with its RMSNorm in float64 (measured: 6e-16
    output, 1e-15 gradients); the gate undone (output_gate=False) or the sinks (sinks=False)
    moves the output far from HF's; and with index_topk = 3 < L HF's output is another."""
    monkeypatch.setattr(modeling_hy_v4.HYV4RMSNorm, "forward", _float64_norm)
    rng, seed = fresh_rng()
    hf, params, names = _hy_v4_module(rng, index_topk=L)
    x = rng.standard_normal((B, L, HY_V4["d_in"]))
    y_hf, g_hf = _hy_v4_run(hf, x, dy := rng.standard_normal((B, L, HY_V4["d_in"])), names)
    forward, backward = reference.VARIANTS[MLA]
    y_ref, w_ref, saved = forward(HY_V4, {"x": x}, params)
    g_ref = backward(saved, dy, np.zeros_like(w_ref))
    assert set(g_ref) == set(g_hf) == {"x", *params}
    errors = {"reference output": rel(y_ref, y_hf),
              **{f"reference grad {n}": rel(g_ref[n], g_hf[n]) for n in g_hf}}
    for twin in TWINS.values():
        run = _grads_torch if twin.name == "torch" else _grads_jax
        with twin.float64():
            for absorb in (False, True):
                y, _, grads = run(twin.build(MLA, HY_V4, params), x, dy, np.zeros_like(w_ref),
                                  absorb)
                errors[f"{twin.name} {absorb} output"] = rel(y, y_hf)
                errors.update({f"{twin.name} {absorb} grad {n}": rel(grads[n], g_hf[n])
                               for n in g_hf})
    bad = {what: e for what, e in errors.items() if e > EXACT}
    assert not bad, (bad, seed)
    undone, _, _ = forward(dict(HY_V4, output_gate=False), {"x": x},
                           {n: a for n, a in params.items() if n != "W_gate"})
    no_sinks, _, _ = forward(dict(HY_V4, sinks=False), {"x": x},
                             {n: a for n, a in params.items() if n != "sinks"})
    assert rel(undone, y_hf) > 0.1 and rel(no_sinks, y_hf) > 0.1, seed
    # the premise: with index_topk < L the indexer drops keys and HY-V4 is no longer ours
    hf_sparse, _, _ = _hy_v4_module(rng, index_topk=3)
    hf_sparse.load_state_dict(hf.state_dict())  # the same weights
    assert rel(_hy_v4_run(hf_sparse, x, dy, names)[0], y_hf) > 0.01, seed


# ---- issue 44: a "shared" layer (index_select "given") takes the previous layer's choice -------

SHARED = dict(CONFIG, index_topk=3, index_select="given")  # GLM-5's indexer_types "shared"
FULL = dict(CONFIG, index_topk=3, index_heads=2, index_head_dim=4)  # a layer with its own


def _causal_choice(rng, batch, length, k):
    """key_indices (B, L, k): each query's k best of random scores among its causal keys (rows
    seeing fewer fill with unseen keys, as every implementation does)."""
    scores = rng.standard_normal((batch, length, length))
    allowed = np.broadcast_to(np.tril(np.ones((length, length), bool)), scores.shape)
    return reference.select_keys(scores, allowed, k)


def test_a_shared_layer_takes_the_given_choice_and_has_no_indexer(twin):
    rng, seed = fresh_rng()
    params = _params(SHARED, rng)
    assert not any(n.startswith(("W_index", "index_")) for n in params)
    x = rng.standard_normal((B, L, CONFIG["d_in"]))
    chosen = _causal_choice(rng, B, L, 3)
    expected = reference.VARIANTS[MLA][0](SHARED, {"x": x, "key_indices": chosen}, params)[0]
    full_params = {**_params(FULL, rng), **params}  # the same attention, an indexer beside
    with twin.float64():
        module = twin.build(MLA, SHARED, params)
        given = twin.array(chosen.astype(np.int32))
        got = twin.numpy(module(twin.array(x), key_indices=given))
        with_indexer = twin.numpy(twin.build(MLA, FULL, full_params)(twin.array(x),
                                                                      key_indices=given))
        with pytest.raises(ValueError, match="key_indices should be given with "
                                             "index_select='given'"):
            module(twin.array(x))
    assert rel(got, expected) <= EXACT, f"seed {seed}"
    assert np.abs(got - with_indexer).max() == 0, f"seed {seed}"  # the attention alone
    # the choice matters: every key allowed gives another output
    assert rel(got, reference.VARIANTS[MLA][0](CONFIG, {"x": x}, params)[0]) > 1e-3, seed


def test_a_shared_layer_decodes_with_the_given_choice(twin):
    rng, seed = fresh_rng()
    params = _params(SHARED, rng)
    x = rng.standard_normal((B, L, CONFIG["d_in"]))
    chosen = _causal_choice(rng, B, L, 3).astype(np.int32)
    with twin.float64():
        module = twin.build(MLA, SHARED, params)
        full = twin.numpy(module(twin.array(x), key_indices=twin.array(chosen)))
        cache = module.init_cache(B, M)
        assert cache.index_key is None  # no indexer keys to keep
        out, cache = module(twin.array(x[:, :4]), key_indices=twin.array(chosen[:, :4]),
                            cache=cache)
        steps = [twin.numpy(out)]
        for t in range(4, L):
            out, cache = module(twin.array(x[:, t:t + 1]),
                                key_indices=twin.array(chosen[:, t:t + 1]), cache=cache)
            steps.append(twin.numpy(out))
    assert np.abs(np.concatenate(steps, axis=1) - full).max() <= EXACT, f"seed {seed}"


@pytest.mark.parametrize("option, value", [("index_heads", 2), ("index_rope", "interleaved")])
def test_a_shared_layer_refuses_indexer_options_by_name(twin, option, value):
    with pytest.raises(ValueError, match=f"{option} should be .* with index_select='given'"):
        twin.make(MLA, dict(SHARED, **{option: value}))

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
from golden import reference, variants
from tests.helpers import JAX, count_compiles, fresh_rng

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
    k_pe = reference.turn(kv_a[..., r:], cos, sin, c["rope_interleaved"])
    return latent * params["kv_a_norm"], k_pe


def rel(actual, expected):
    """max |actual − expected| / max |expected|."""
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


# ---- decoding from the latent cache equals the full forward ---------------------------------

@pytest.mark.parametrize("absorb", [False, True], ids=["plain", "absorbed"])
@pytest.mark.parametrize("chunks", [(1,), (2, 3)], ids=["token_by_token", "chunks_2_3"])
@pytest.mark.parametrize("name", list(CONFIGS))
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


def test_jax_decode_step_compiles_once():
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

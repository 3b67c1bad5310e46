"""RoPE of 2025–26 models against transformers' own rotary embeddings: every rope_type of
Hugging Face's rope_parameters (default, linear, dynamic, llama3, yarn incl. DeepSeek-V3's
mscale, longrope of Phi-3), partial rotary (GPT-NeoX, StableLM, GLM's interleaved), the "hf"
precision mode, explicit positions, decoding with the call-dependent types as HF decodes, and
bad settings.

What is compared, and at which level:
- frequencies: ours (float64; the reference's exact ones equal them) against HF's inv_freq,
  which HF forms in float32: at float32's level (4·2⁻²⁴ relative); attention factors to 1e-15;
- rotation: HF's own apply_rotary_pos_emb fed float64 cos/sin of HF's own frequencies against
  the reference's turn of the same cos/sin: 1e-12 (conventions, pass-through, factor);
- the twins' rotary_embedding (float64) against HF's whole float64 model, whose angles are
  float32: float32's level (exact mode, 1e-6 of |x| at positions < 9; 2.1e-7 seen, longrope);
  ``precision="hf"``: torch 1e-12 (HF's own operations on the same machine: 0 seen), JAX
  float32's level (1e-6; 7.3e-8 seen).

Shape legend: B batch, H heads, L tokens, Dh head width, rd rotated features.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from golden import reference
from golden.specification.positions import rope_frequencies
from golden.specification.validate import rope_settings, rotary_dims
from tests.helpers import JAX, TWINS, count_compiles, fresh_rng
from torch_attn import export_params as torch_attn_export

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: E402
from transformers.models.glm import modeling_glm  # noqa: E402
from transformers.models.gpt_neox import modeling_gpt_neox  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.phi3 import modeling_phi3  # noqa: E402
from transformers.models.stablelm import modeling_stablelm  # noqa: E402

F32 = 4 * 2.0**-24
EXACT = 1e-12


def _llama(rope_parameters, **kw):
    return transformers.LlamaConfig(hidden_size=24, num_attention_heads=3, head_dim=8,
                                    rope_parameters=rope_parameters, **kw), modeling_llama


# name: (config, its modeling module (RotaryEmbedding, apply_rotary_pos_emb), interleaved,
# the fields our dict adds that HF reads from the config elsewhere)
HF_CASES = {
    "default": (*_llama({"rope_type": "default", "rope_theta": 100.0}), False, {}),
    "linear": (*_llama({"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.5}), False, {}),
    "dynamic": (*_llama({"rope_type": "dynamic", "rope_theta": 100.0, "factor": 3.0},
                        max_position_embeddings=5), False,
                {"original_max_position_embeddings": 5}),
    "llama3": (*_llama({"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64}, max_position_embeddings=512),
               False, {}),
    "yarn": (*_llama({"rope_type": "yarn", "rope_theta": 50.0, "factor": 2.0,
                      "original_max_position_embeddings": 12, "beta_fast": 8.0,
                      "beta_slow": 2.0}, max_position_embeddings=24), False, {}),
    "yarn_deepseek_v3": (transformers.DeepseekV3Config(
        hidden_size=32, num_attention_heads=4, qk_rope_head_dim=8, max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "truncate": False,
                         "mscale": 1.0, "mscale_all_dim": 0.8}), modeling_deepseek_v3, False,
        {}),
    "longrope_phi3": (transformers.Phi3Config(
        hidden_size=24, num_attention_heads=4, max_position_embeddings=24,
        original_max_position_embeddings=6,
        rope_parameters={"rope_type": "longrope", "rope_theta": 500.0,
                         "short_factor": [1.0, 1.25, 2.0], "long_factor": [1.5, 3.0, 5.0]}),
        modeling_phi3, False, {"factor": 24 / 6}),
    # Gemma 4's full layers: the whole head paired, a quarter of the pairs turning, /factor.
    "proportional": (transformers.LlamaConfig(
        hidden_size=48, num_attention_heads=3, head_dim=16,
        rope_parameters={"rope_type": "proportional", "rope_theta": 100.0,
                         "partial_rotary_factor": 0.25, "factor": 2.0}), modeling_llama, False,
        {}),
    "partial_gpt_neox": (transformers.GPTNeoXConfig(hidden_size=32, num_attention_heads=2,
                                                    rotary_pct=0.25, rotary_emb_base=1000),
                         modeling_gpt_neox, False, {}),
    "partial_stablelm": (transformers.StableLmConfig(hidden_size=48, num_attention_heads=4,
                                                     partial_rotary_factor=0.5),
                         modeling_stablelm, False, {}),
    "partial_interleaved_glm": (transformers.GlmConfig(hidden_size=48, num_attention_heads=4,
                                                       head_dim=12, partial_rotary_factor=0.5),
                                modeling_glm, True, {}),
}


def _stablelm_apply(q, k, cos, sin):
    """StableLmAttention.forward's split of the rotated features, then its apply_rotary_pos_emb
    (GPT-NeoX and GLM split inside theirs)."""
    rd = cos.shape[-1]
    q_rot, k_rot = modeling_stablelm.apply_rotary_pos_emb(q[..., :rd], k[..., :rd], cos, sin)
    return torch.cat([q_rot, q[..., rd:]], -1), torch.cat([k_rot, k[..., rd:]], -1)


def _hf(name):
    """(HF's rotary embedding in float64, its apply_rotary_pos_emb, our rope_parameters, Dh,
    interleaved)."""
    config, modeling, interleaved, extra = HF_CASES[name]
    rotary_class = next(getattr(modeling, n) for n in dir(modeling) if n.endswith(
        "RotaryEmbedding") and not n.startswith("_"))
    rotary = rotary_class(config).double()
    dh = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    apply = _stablelm_apply if modeling is modeling_stablelm else modeling.apply_rotary_pos_emb
    return rotary, apply, {**config.rope_parameters, **extra}, dh, interleaved


def _hf_rotate(rotary, apply, q, k, positions):
    """HF's pipeline in a float64 model: its cos and sin (angles in float32), then its apply."""
    cos, sin = rotary(q, torch.as_tensor(positions)[None])  # (1, L, rd)
    return apply(q, k, cos, sin)


def _qk(rng, dh, length=9):
    q = torch.from_numpy(rng.standard_normal((2, 3, length, dh)))
    k = torch.from_numpy(rng.standard_normal((2, 1, length, dh)))
    return q, k


@pytest.mark.parametrize("name", list(HF_CASES))
def test_frequencies_and_attention_factor_match_hf(name):
    rotary, _, params, dh, _ = _hf(name)
    settings = rope_settings(None, params)
    rd = rotary_dims(dh, settings)
    rotary(torch.zeros(1, dtype=torch.float64), torch.arange(9)[None])  # long/dynamic: seq 9
    f, m = rope_frequencies(settings, rd, 9)
    hf = rotary.inv_freq.double().numpy()
    assert np.all(np.abs(f - hf) <= F32 * np.abs(hf)), (f, hf)  # zeros exactly (proportional)
    assert abs(m - rotary.attention_scaling) <= 1e-15
    exact_f, exact_m = reference.rope_frequencies(settings, rd, 9)
    with reference.exact_arithmetic():
        oracle_f, oracle_m = reference.rope_frequencies(settings, rd, 9)
    np.testing.assert_allclose(exact_f, f, rtol=1e-15, atol=0)
    np.testing.assert_allclose(np.asarray(oracle_f, np.float64), f, rtol=4e-16, atol=0)
    assert abs(float(oracle_m) - m) <= 4e-16 and abs(exact_m - m) <= 4e-16


@pytest.mark.parametrize("kind", ["default", "yarn"])
def test_learned_frequency_scales_match_mistral_large4(kind):
    # Mistral Large 4's rotary embedding scales each pair's frequency by e^α, α a learned
    # buffer: frequency_log_scale. Ours in float64 (spec and reference, exact too) within
    # float32's rounding of HF's; hf_inv_freq on torch is HF's float32 inv_freq · exp(α) bit
    # for bit; α = 0 changes nothing.
    from transformers.models.mistral_large4 import modeling_mistral_large4 as hf
    rng, seed = fresh_rng()
    rope = {"rope_type": "default", "rope_theta": 100.0} if kind == "default" else {
        "rope_type": "yarn", "rope_theta": 50.0, "factor": 4.0,
        "original_max_position_embeddings": 12, "attention_factor": 1.0}
    config = transformers.MistralLarge4TextConfig(
        hidden_size=16, num_attention_heads=2, qk_rope_head_dim=8, head_dim=8,
        max_position_embeddings=48, rope_parameters=rope, num_hidden_layers=1)
    rotary = hf.MistralLarge4TextRotaryEmbedding(config)
    alpha = (0.3 * rng.standard_normal(4)).astype(np.float32)
    rotary.alpha.copy_(torch.from_numpy(alpha))
    settings = rope_settings(None, {**rope, "frequency_log_scale": alpha.tolist()})
    theirs = (rotary.inv_freq.float() * rotary.alpha.float().exp())
    f, _ = rope_frequencies(settings, 8)
    assert np.all(np.abs(f - theirs.double().numpy()) <= F32 * f), seed
    from golden.specification.positions import hf_inv_freq
    ours32, _ = hf_inv_freq(settings, 8, lambda v: torch.tensor(np.asarray(v),
                                                                dtype=torch.float32))
    assert torch.equal(ours32, theirs), seed
    exact_f, _ = reference.rope_frequencies(settings, 8)
    with reference.exact_arithmetic():
        oracle_f, _ = reference.rope_frequencies(settings, 8)
    np.testing.assert_allclose(exact_f, f, rtol=1e-15, atol=0)
    np.testing.assert_allclose(np.asarray(oracle_f, np.float64), f, rtol=4e-16, atol=0)
    plain, _ = rope_frequencies(rope_settings(None, {**rope, "frequency_log_scale": [0.0] * 4}),
                                8)
    np.testing.assert_array_equal(plain, rope_frequencies(rope_settings(None, rope), 8)[0])


@pytest.mark.parametrize("name", list(HF_CASES))
def test_rotation_matches_hf_given_its_frequencies(name):
    # HF's apply_rotary_pos_emb on float64 cos and sin of its own inv_freq, against the
    # reference's turn of the same: conventions, the pass-through part and the factor.
    rng, seed = fresh_rng()
    rotary, apply, _, dh, interleaved = _hf(name)
    q, k = _qk(rng, dh)
    angles = np.arange(9)[:, None] * rotary.inv_freq.double().numpy()  # (L, rd/2)
    m = rotary.attention_scaling
    emb = torch.from_numpy(np.concatenate([angles, angles], -1))[None]  # HF's (1, L, rd)
    want = apply(q, k, emb.cos() * m, emb.sin() * m)
    got = [reference.turn(t.numpy(), m * np.cos(angles), m * np.sin(angles), interleaved)
           for t in (q, k)]
    for g, w in zip(got, want):
        assert np.abs(g - w.numpy()).max() <= EXACT, f"seed {seed}"


@pytest.mark.parametrize("name", list(HF_CASES))
def test_twins_match_hf(twin, name):
    rng, seed = fresh_rng()
    rotary, apply, params, dh, interleaved = _hf(name)
    q, k = _qk(rng, dh)
    want = _hf_rotate(rotary, apply, q, k, np.arange(9))
    for precision, bound in (("exact", 1e-6), ("hf", EXACT if twin.name == "torch" else 1e-6)):
        with twin.float64():
            got = [twin.numpy(twin.lib.rotary_embedding(twin.array(t.numpy()), theta=None,
                                                        interleaved=interleaved,
                                                        rope_parameters=params,
                                                        precision=precision))
                   for t in (q, k)]
        for g, w in zip(got, want):
            error = np.abs(g - w.numpy()).max() / np.abs(w.numpy()).max()
            assert error <= bound, f"{precision}, seed {seed}: {error:.2e}"


def test_hf_precision_reproduces_hf_float32_angles_at_long_positions(twin):
    # Llama's default RoPE, Dh = 128, θ = 10,000, in a float64 model: HF's cos errs by about
    # p·2⁻²⁴ (its angle p·f formed in float32); precision="hf" makes the same error on purpose,
    # "exact" does not. Measured on this machine, max |cos| difference from HF's float64 model
    # at positions 4,095 and 131,071 (θ = 500,000: 7.4e-5 and 3.4e-3 for "exact"):
    #     "exact"  1.36e-4 and 4.15e-3 (HF's own error: ours is the exact cos to 4e-12)
    #     "hf"     0 and 0 (torch: HF's operations); 6.0e-8 and 3.0e-8 (JAX: float32 cos)
    config = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128,
                                      rope_parameters={"rope_type": "default",
                                                       "rope_theta": 10000.0})
    rotary = modeling_llama.LlamaRotaryEmbedding(config).double()
    positions = np.array([4095, 131071])
    x = np.concatenate([np.ones((1, 2, 64)), np.zeros((1, 2, 64))], -1)  # out[..., :64] = cos
    hf_cos = rotary(torch.from_numpy(x), torch.as_tensor(positions)[None])[0][0, :, :64].numpy()
    exact_cos = np.cos(positions[:, None] * 10000.0 ** (-np.arange(0, 128, 2) / 128))
    errors = {}
    for precision in ("exact", "hf"):
        with twin.float64():
            out = twin.numpy(twin.lib.rotary_embedding(
                twin.array(x), theta=10000.0, precision=precision,
                positions=twin.array(positions), max_position=131072))
        errors[precision] = np.abs(out[0, :, :64] - hf_cos).max(axis=-1)  # per position
    hf_error = np.abs(exact_cos - hf_cos).max(axis=-1)
    assert hf_error[0] > 5e-5 and hf_error[1] > 2e-3, hf_error  # HF's float32 angles
    np.testing.assert_allclose(errors["exact"], hf_error, rtol=1e-6)  # exact: HF's error
    assert errors["hf"].max() <= (EXACT if twin.name == "torch" else 4 * F32), errors


# ---- explicit positions -----------------------------------------------------------------------

def test_explicit_positions_left_padding(twin):
    # Left padding: positions = cumsum(mask) − 1 per row (B, L), partial interleaved yarn;
    # against the reference's turn at those positions, float64.
    rng, seed = fresh_rng()
    params = {"rope_type": "yarn", "rope_theta": 50.0, "factor": 2.0,
              "original_max_position_embeddings": 12}
    mask = np.array([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)  # (B, L)
    x = rng.standard_normal((2, 3, 7, 10))
    settings = rope_settings(None, params, 0.8)
    cos, sin = reference.rope_cos_sin(settings, 10, positions[:, None])  # (B, 1, L, rd/2)
    want = reference.turn(x, cos, sin, True)
    with twin.float64():
        got = twin.numpy(twin.lib.rotary_embedding(
            twin.array(x), theta=None, rope_parameters=params, partial_rotary_factor=0.8,
            interleaved=True, positions=twin.array(positions)))
        shifted = twin.numpy(twin.lib.rotary_embedding(
            twin.array(x), theta=None, rope_parameters=params, partial_rotary_factor=0.8,
            interleaved=True, offset=twin.array(np.array([3, 5], np.int32)), max_position=12))
        explicit = twin.numpy(twin.lib.rotary_embedding(
            twin.array(x), theta=None, rope_parameters=params, partial_rotary_factor=0.8,
            interleaved=True, positions=twin.array(np.array([[3], [5]]) + np.arange(7))))
    assert np.abs(got - want).max() <= EXACT, f"seed {seed}"
    assert np.abs(shifted - explicit).max() <= EXACT, f"seed {seed}"


# ---- decoding with the call-dependent types, as Hugging Face decodes -------------------------

def _hf_decode(name, params, x, prefill):
    """HF's decoding of GroupedQueryAttention's attention in float64 (its rotary object kept
    across calls, as its dynamic_rope_update needs): prefill ``prefill`` tokens, then one at a
    time; each call's q and k turned by that call's cos and sin, keys kept turned. Returns the
    attention output (B, N, L, Dh)."""
    rotary, apply, _, dh, _ = _hf(name)
    keys, values, outs = [], [], []
    q_all, k_all, v_all = (torch.from_numpy(a) for a in x)
    spans = [(0, prefill)] + [(i, i + 1) for i in range(prefill, q_all.shape[2])]
    for start, stop in spans:
        q, k = _hf_rotate(rotary, apply, q_all[:, :, start:stop], k_all[:, :, start:stop],
                          np.arange(start, stop))
        keys.append(k)
        values.append(v_all[:, :, start:stop])
        key, value = torch.cat(keys, 2), torch.cat(values, 2)
        allowed = torch.arange(stop)[None] <= torch.arange(start, stop)[:, None]
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q, key, value, attn_mask=allowed, enable_gqa=True))
    return torch.cat(outs, 2).numpy()


@pytest.mark.parametrize("name", ["dynamic", "longrope_phi3"])
def test_call_dependent_decoding_follows_hf(name):
    # longrope and dynamic turn each call's keys by that call's frequencies, so a cached decode
    # differs from the full forward, in HF as here: torch's GroupedQueryAttention with
    # rope_precision="hf" decodes as HF's rotary embedding does, to 1e-12 in float64.
    rng, seed = fresh_rng()
    _, _, params, dh, _ = _hf(name)
    config = dict(d_in=5, num_heads=4, num_kv_heads=2, head_dim=dh, d_out=3,
                  rope_parameters=params, rope_precision="hf")
    module = TWINS["torch"].make("grouped_query_attention", config).double().eval()
    x = torch.from_numpy(rng.standard_normal((2, 9, 5)))
    split = lambda y, n: y.unflatten(-1, (n, dh)).transpose(1, 2).detach()  # noqa: E731
    with torch.no_grad():
        qkv = [split(p(x), n).numpy() for p, n in
               ((module.W_query, 4), (module.W_key, 2), (module.W_value, 2))]
        want = _hf_decode(name, params, qkv, prefill=4)
        want = module.out_proj(torch.from_numpy(want).transpose(1, 2).flatten(-2)).numpy()
        cache = module.init_cache(2, 12)
        y, cache = module(x[:, :4], cache=cache)
        steps = [y]
        for i in range(4, 9):
            y, cache = module(x[:, i:i + 1], cache=cache)
            steps.append(y)
        full = module(x).numpy()
    got = torch.cat(steps, 1).numpy()
    assert np.abs(got - want).max() <= EXACT, f"seed {seed}"
    assert np.abs(got - full).max() > 1e-6  # the full forward turns every key as position 8's
    jax_twin = JAX  # the same decode compiled, the largest position traced
    with jax_twin.float64():
        twin_module = jax_twin.build("grouped_query_attention", config,
                                     torch_attn_export(module))
        xs = jax_twin.array(x.numpy())
        y, cache = twin_module(xs[:, :4], cache=twin_module.init_cache(2, 12))
        steps = [jax_twin.numpy(y)]
        y, cache = twin_module(xs[:, 4:5], cache=cache)  # the step's one compilation
        steps.append(jax_twin.numpy(y))
        with count_compiles() as compiled:  # positions 5 … 8, past L0 or not: traced
            for i in range(5, 9):
                y, cache = twin_module(xs[:, i:i + 1], cache=cache)
                steps.append(jax_twin.numpy(y))
    assert compiled == [], compiled
    assert np.abs(np.concatenate(steps, 1) - want).max() <= 1e-6, f"seed {seed}"  # float32 cos


def test_jax_dynamic_ntk_in_the_program_float64_and_float32():
    # Dynamic NTK's θ' depends on the traced largest position: JAX forms its angles in the
    # program, in float64 under x64 (against torch's host-built float64 tables: 1e-12 at
    # positions near 5,000) and in float32 without it, whose angle p·f errs by about p·2⁻²⁴
    # (bounded here by 4·p·2⁻²⁴ relative to |x|; torch, exact tables, is within float32's few
    # roundings). Measured, relative to |x|: 1.2e-13 (x64) and 4.1e-5 (float32; torch's float32
    # 8.1e-8).
    rng, seed = fresh_rng()
    params = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0,
              "original_max_position_embeddings": 2048}
    x = rng.standard_normal((2, 3, 5, 16))
    positions = np.arange(5) + 4990
    want = TWINS["torch"].lib.rotary_embedding(torch.from_numpy(x), theta=None,
                                               rope_parameters=params,
                                               positions=torch.from_numpy(positions)).numpy()
    step = JAX.lib.rotary_embedding
    with JAX.float64():
        wide = np.asarray(jax.jit(lambda a, p: step(a, theta=None, rope_parameters=params,
                                                    positions=p, max_position=5000))(
            JAX.array(x), JAX.array(positions)))
    narrow = np.asarray(jax.jit(lambda a, p: step(a, theta=None, rope_parameters=params,
                                                  positions=p, max_position=5000))(
        JAX.array(x.astype(np.float32)), JAX.array(positions.astype(np.int32))))
    scale = np.abs(x).max()
    assert np.abs(wide - want).max() / scale <= EXACT, f"seed {seed}"
    assert np.abs(narrow - want).max() / scale <= 4 * 5000 * 2.0**-24, f"seed {seed}"


def test_reference_hf_precision_is_hf_float32(twin):
    # The reference's rope_precision="hf" (HF's float32 operations in NumPy, whose float32
    # power and cos may differ from torch's in the last bit) against each twin's, float64
    # GroupedQueryAttention with yarn and partial rotary: float32's level.
    rng, seed = fresh_rng()
    config = dict(d_in=5, num_heads=4, num_kv_heads=2, head_dim=8, d_out=3,
                  partial_rotary_factor=0.75, rope_precision="hf",
                  rope_parameters={"rope_type": "yarn", "rope_theta": 50.0, "factor": 2.0,
                                   "original_max_position_embeddings": 12})
    module = TWINS["torch"].make("grouped_query_attention", config)
    params = {n: a.astype(np.float64) for n, a in torch_attn_export(module).items()}
    x = rng.standard_normal((2, 9, 5))
    want = reference.VARIANTS["grouped_query_attention"][0](
        TWINS["torch"].lib.build("grouped_query_attention", config, params).config,
        {"x": x}, params)[0]
    with twin.float64():
        built = twin.build("grouped_query_attention", config, params)
        built.eval()
        got = twin.numpy(built(twin.array(x)))
    assert np.abs(got - want).max() <= 1e-6, f"seed {seed}"


# ---- bad settings -----------------------------------------------------------------------------

BAD = [
    (dict(rope_parameters={"rope_type": "ntk"}),
     r"rope_parameters\['rope_type'\] should be one of default, linear, dynamic, llama3, "
     r"yarn, longrope, proportional, axial, got 'ntk'"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "beta": 1}),
     r"rope_parameters has an unknown field 'beta' for rope_type 'linear'; it takes "
     r"rope_type, rope_theta, partial_rotary_factor, factor"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}),
     r"rope_parameters\['low_freq_factor'\] is required by rope_type 'llama3'"),
    (dict(rope_parameters={"rope_type": "linear", "factor": -2.0}),
     r"rope_parameters\['factor'\] should be a positive number, got -2.0"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0,
                           "original_max_position_embeddings": 8, "truncate": "no"}),
     r"rope_parameters\['truncate'\] should be True or False, got 'no'"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0,
                           "original_max_position_embeddings": 8.5}),
     r"rope_parameters\['original_max_position_embeddings'\] should be a positive int, "
     r"got 8.5"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                           "high_freq_factor": 1.0, "original_max_position_embeddings": 8}),
     r"rope_parameters\['high_freq_factor'\] should be greater than low_freq_factor = 4.0, "
     r"got 1.0"),
    (dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0, 2.0],
                           "long_factor": [1.0, 2.0], "original_max_position_embeddings": 4,
                           "factor": 2.0}),
     r"rope_parameters\['short_factor'\] should have rd / 2 = 3 numbers \(one per rotated "
     r"pair\), got 2"),
    (dict(rope_parameters={"frequency_log_scale": [0.1, 0.2]}),
     r"rope_parameters\['frequency_log_scale'\] should have rd / 2 = 3 numbers \(one per "
     r"rotated pair\), got 2"),
    (dict(rope_parameters={"frequency_log_scale": [0.1, float("inf"), 0.0]}),
     r"rope_parameters\['frequency_log_scale'\] should be a list of finite numbers"),
    (dict(rope_parameters={"rope_theta": 50.0}),
     r"rope_theta is given twice and they differ: rope_theta = 100.0, "
     r"rope_parameters\['rope_theta'\] = 50.0"),
    (dict(partial_rotary_factor=0.5),
     r"the rotated width int\(head_dim · partial_rotary_factor\) should be even and at least "
     r"2, got int\(6 · 0.5\) = 3"),
    (dict(partial_rotary_factor=1.5),
     r"partial_rotary_factor should be a number in \(0, 1\], got 1.5"),
    (dict(precision="float32"), r"rope_precision should be one of exact, hf, got 'float32'"),
    (dict(rope_parameters=[("rope_type", "linear")]),
     r"rope_parameters should be a dict \(Hugging Face's rope_parameters\) or None, got list"),
]


@pytest.mark.parametrize("change, message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_settings_name_the_field(twin, change, message):
    x = twin.array(np.ones((2, 3, 4, 6)))
    with pytest.raises(ValueError, match=message):
        twin.lib.rotary_embedding(x, **{"theta": 100.0, **change})
    config = dict(d_in=5, num_heads=2, num_kv_heads=1, head_dim=6, rope_theta=100.0)
    config.update({("rope_precision" if n == "precision" else n): v for n, v in change.items()})
    with pytest.raises(ValueError, match=message):
        twin.make("grouped_query_attention", config)


def test_bad_positions(twin):
    x = twin.array(np.ones((2, 3, 4, 6)))
    with pytest.raises(ValueError, match=r"positions should be integers shaped \(L,\), \(B, L\) "
                                         r"or \(\.\.\., L\) against x's \(2, 3, 4, 6\) "
                                         r"\(L = 4\), got int32 \(2, 5\)"):
        twin.lib.rotary_embedding(x, theta=10.0,
                                  positions=twin.array(np.zeros((2, 5), np.int32)))


def test_converters_refuse_what_they_cannot_carry(twin):
    # RoPE given only inside rope_parameters still has no place in torch's or Flax's
    # MultiheadAttention, and to_llama cannot move the pairs of a partial rotary module.
    config = dict(d_in=8, num_heads=2, num_kv_heads=2, rope_parameters={"rope_theta": 100.0})
    module = twin.make("grouped_query_attention", config)
    convert = twin.lib.convert
    to_mha = convert.to_torch_mha if twin.name == "torch" else convert.to_nnx_mha
    args = (module,) if twin.name == "torch" else ("grouped_query_attention", module.config,
                                                   twin.lib.export_params(module))
    with pytest.raises(ValueError, match=r"rope_parameters should be None .*got"):
        to_mha(*args)
    partial = twin.make("grouped_query_attention", dict(config, partial_rotary_factor=0.5,
                                                        rope_interleaved=True))
    with pytest.raises(ValueError, match=r"interleaved should be the module's rope_interleaved "
                                         r"= True with partial rotary \(only 2 of Dh = 4 "
                                         r"features turn\), got False"):
        convert.to_llama(partial)
    assert set(convert.to_llama(partial, interleaved=True)) >= {"q_proj.weight"}


def test_proportional_is_not_partial_rotary(twin):
    """Proportional RoPE pairs the whole head (i, i + Dh/2) at θ^(−2i/Dh) and stops the pairs
    past ⌊p·Dh/2⌋; partial rotary with the same p turns the first p·Dh features at
    θ^(−2i/(p·Dh)): far apart. Its frequencies' zeros leave those pairs as they are."""
    rng, seed = fresh_rng()
    x = rng.standard_normal((2, 3, 9, 16))
    kw = dict(theta=100.0, partial_rotary_factor=0.25)
    with twin.float64():
        ours = twin.numpy(twin.lib.rotary_embedding(twin.array(x), rope_parameters={
            "rope_type": "proportional"}, **kw))
        partial = twin.numpy(twin.lib.rotary_embedding(twin.array(x), **kw))
    assert np.abs(ours - partial).max() > 0.1, seed
    pairs = np.r_[2:8, 10:16]  # pairs 2 … 7 (and their partners i + 8) do not turn
    np.testing.assert_array_equal(ours[..., pairs], x[..., pairs], err_msg=f"seed {seed}")


def test_jax_positions_past_the_tables_are_nan_not_another_angle():
    """Traced positions cannot be checked against max_position: one past the tables' whole
    blocks of 256 would read a clamped row, another angle. It gives NaN instead; the others are
    unchanged."""
    import jax.numpy as jnp

    from jax_attn.rotary import rotary_embedding

    rng, seed = fresh_rng()
    x = jnp.asarray(rng.standard_normal((1, 2, 5, 8)), jnp.float32)
    positions = jnp.asarray([0, 1, 255, 256, 511])
    out = np.asarray(jax.jit(lambda x, p: rotary_embedding(
        x, theta=100.0, positions=p, max_position=3))(x, positions))
    assert np.isnan(out[..., 3:, :]).all() and not np.isnan(out[..., :3, :]).any(), seed
    wide = np.asarray(rotary_embedding(x, theta=100.0, positions=positions, max_position=512))
    # One compiled program against the eager calls: float32's level, not the same bits.
    np.testing.assert_allclose(out[..., :3, :], wide[..., :3, :], rtol=0,
                               atol=F32 * float(jnp.abs(x).max()), err_msg=f"seed {seed}")
    assert not np.isnan(wide).any(), seed  # 256 and 511 are within two blocks

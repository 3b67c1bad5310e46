"""GroupedQueryAttention against transformers' own attention classes of seven decoder families,
float64: each Hugging Face module (``.double()``, sdpa, which computes in float64 on the CPU)
with random weights, fed cos/sin (Llama 4: ``freqs_cis``) computed in float64 from the exact
angles position · θ^(−2i/Dh); its state dict mapped to our neutral parameters by a small helper
per family written here; our torch and JAX modules built from them. Each run is also checked
against the float64 reference (golden.reference, output, weights and every gradient, to the
float64 tolerances), so "ours = reference" holds at float64 and what is measured against HF
is HF's own rounding.

Where HF has a float32 step inside (for a float64 model a *downcast*): its QK norms compute in
float32 (Qwen3, Gemma 3, OLMo 2, Cohere, Llama 4's L2 norm, Qwen3-Next), Cohere's and Llama 4's
RoPE round q and k to float32 before turning them, and Llama 4's / Ministral 3's query
temperature is formed in float32 (Ministral 3's from integer ``position_ids``; given float64
positions it is float64 and nothing is float32). There the agreement is at float32 level, and
the tests assert that the relative error (max |ours − HF| / max |HF|) lies in (1e-12, 1e-6):
below float32 rounding's reach, and above float64's, so the float32 step is what limits it.
Without one, they assert ≤ 1e-12.

Measured on this machine with transformers 5.23.0 (200 seeds each; torch, JAX and the
reference alike, as they agree to ~1e-15): the largest relative error against HF's output
    Qwen3 (rms)                       5.6e-8      Llama 4, RoPE layer (l2)      1.1e-7
    Gemma 3, sliding window (1 + w)   1.6e-7      Llama 4, NoPE + temperature   2.1e-8
    OLMo 2 (rms across heads)         6.2e-8      Ministral 3, int positions    2.7e-8
    Cohere (layer, interleaved)       1.2e-7      Ministral 3, float64 pos.     1.4e-15
    Qwen3-Next (1 + w, output gate)   1.6e-7 (with partial rotary, 30 seeds: 1.2e-7)
    GPT-OSS sliding-window layer (sinks; eager, float64 throughout; 30 seeds)   7.2e-16
and Gemma 3's eager weights (float32 softmax) 1.8e-7; the smallest error of any family with a
float32 step, 7.1e-10 (Qwen3).

What HF does that one might not expect, pinned here: Gemma 3's ``sliding_window`` W (keys
kv > q − W: W keys including the query) lives only in the mask the model builds
(masking_utils); its attention module under sdpa or eager ignores it, so it is passed the mask.
The core's ``local_window_size=W`` is W + 1 keys (the trap). Qwen3-Next's q/k norm is
RMSNorm · (1 + w) (weight initialised to zeros), like Gemma 3's. Llama 4's ``no_rope_layers[i]``
is 1 where layer i *uses* RoPE; its temperature reads positions p + 1 (shift 1), Ministral 3's
p (shift 0). Llama 4's RoPE layers are its "chunked_attention" layers, but like the window the
chunking is the model's mask (create_chunked_causal_mask), so these modules run plain causal.

Shape legend: B batch, L length, D model width, H query heads, Hkv key-value heads, Dh head
width; every size distinct.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch

from golden import reference
from golden.harness.check import compare_all
from golden.specification.decoder import sliding_window
from tests.helpers import TWINS, fresh_rng, random_cotangents, reference_fixture, sweep

transformers = pytest.importorskip("transformers")

from transformers import masking_utils  # noqa: E402
from transformers.models.cohere import modeling_cohere  # noqa: E402
from transformers.models.gemma3 import modeling_gemma3  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: E402
from transformers.models.llama4 import modeling_llama4  # noqa: E402
from transformers.models.ministral3 import modeling_ministral3  # noqa: E402
from transformers.models.olmo import modeling_olmo  # noqa: E402
from transformers.models.olmo2 import modeling_olmo2  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next  # noqa: E402

B, L, D, H, HKV, DH, THETA = 3, 7, 8, 4, 2, 6, 100.0
GQA = "grouped_query_attention"
WINDOW = 3          # Gemma 3's sliding_window: W keys, the query's own included
PRE_ATTN = 10       # Gemma 3's query_pre_attn_scalar: scale 10^−1/2, not Dh^−1/2
FLOOR, BETA = 3, 0.3  # the query temperature's floor_scale and β: floors 0, 1, 2 within L
CLIP = 0.5  # OLMo's clip_qkv: about 70 % of the projected entries clamped with these weights
FLOAT32_LEVEL = (1e-12, 1e-6)  # (above, below): an error float32 rounding makes, not float64's
SIZES = dict(d_in=D, num_heads=H, num_kv_heads=HKV, head_dim=DH)
PARTIAL = 0.67        # Qwen3-Next's partial_rotary_factor here: 4 of Dh = 6 features turn


# ---- inputs HF's attention modules take: float64 positions -----------------------------------

def _angles(rd=DH):
    """(L, rd/2) float64: position p times θ^(−2i/rd) (rd < Dh: partial rotary)."""
    return np.arange(L)[:, None] * THETA ** (-np.arange(0, rd, 2) / rd)


def rotate_half_cos_sin(rd=DH):
    """(cos, sin), each (1, L, rd): the angles repeated as two halves (Llama's layout)."""
    emb = np.concatenate([_angles(rd)] * 2, -1)
    return tuple(torch.from_numpy(f(emb))[None] for f in (np.cos, np.sin))


def half_cos_sin():
    """(cos, sin), each (1, L, Dh/2): the angles once (GPT-OSS's layout, turning the halves)."""
    return tuple(torch.from_numpy(f(_angles()))[None] for f in (np.cos, np.sin))


def interleaved_cos_sin():
    """(cos, sin), each (1, L, Dh): each angle repeated twice in place (Cohere's layout)."""
    emb = np.repeat(_angles(), 2, axis=-1)
    return tuple(torch.from_numpy(f(emb))[None] for f in (np.cos, np.sin))


def freqs_cis():
    """(1, L, Dh/2) complex128: e^(i·angle), Llama 4's complex RoPE on pairs (2i, 2i + 1)."""
    angles = torch.from_numpy(_angles())[None]
    return torch.polar(torch.ones_like(angles), angles)


def hf_window_mask(window):
    """(L, L) bool of masking_utils' own sliding-window causal mask function, evaluated on the
    (q, kv) grid: True = may attend."""
    q, kv = torch.arange(L)[:, None], torch.arange(L)[None, :]
    fn = masking_utils.sliding_window_causal_mask_function(window)
    return fn(torch.tensor(0), torch.tensor(0), q, kv).expand(L, L)


def additive(allowed):
    """A boolean mask (L, L) as HF's additive float64 mask (1, 1, L, L): 0 or the dtype's min."""
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(allowed, zero, torch.finfo(torch.float64).min)[None, None]


# ---- state dicts -> our neutral parameters: W (in, out) = Linear weight transposed -----------

def _numpy(state_dict):
    return {n: t.detach().numpy().copy() for n, t in state_dict.items()}


def projections(sd):
    """W_query, W_key, W_value, W_out (and the biases) of q/k/v/o_proj: the heads are already
    contiguous blocks of the output features."""
    names = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "out": "o_proj"}
    params = {f"W_{ours}": sd[f"{hf}.weight"].T for ours, hf in names.items()}
    params.update({f"b_{ours}": sd[f"{hf}.bias"] for ours, hf in names.items()
                   if f"{hf}.bias" in sd})
    return params


def with_qk_norms(sd):
    """Projections and the norms' weights as they are: (Dh,) per head (Qwen3, Gemma 3's w of
    1 + w), (N·Dh,) across heads (OLMo 2), (N, Dh) per head (Cohere's LayerNorm)."""
    return {**projections(sd), "q_norm": sd["q_norm.weight"], "k_norm": sd["k_norm.weight"]}


def qwen3_next_to_neutral(sd):
    """q_proj's output is per head [query (Dh) | gate (Dh)]: (N·2·Dh, D) -> (N, 2, Dh, D), split,
    each back to (N·Dh, D) and transposed; the biases alike."""
    params = with_qk_norms(sd)
    w = sd["q_proj.weight"].reshape(H, 2, DH, D)
    params["W_query"], params["W_gate"] = (w[:, i].reshape(H * DH, D).T for i in (0, 1))
    if "q_proj.bias" in sd:
        b = sd["q_proj.bias"].reshape(H, 2, DH)
        params["b_query"], params["b_gate"] = (b[:, i].reshape(H * DH) for i in (0, 1))
    return params


# ---- the families ---------------------------------------------------------------------------

def hf_config(config_class, **kw):
    """A tiny float64-ready configuration of ``config_class``, sdpa attention."""
    config = config_class(hidden_size=D, num_attention_heads=H, num_key_value_heads=HKV,
                          head_dim=DH, **kw)
    config._attn_implementation = "sdpa"
    return config


def _positions(dtype):
    return torch.arange(L, dtype=dtype)[None]  # (1, L)


@dataclass(frozen=True)
class Family:
    """One decoder family's attention: HF's module (float64, sdpa, weights to be randomised),
    its state dict mapped to ours, our configuration beyond the sizes, how HF's module is
    called on x (positions and mask fed in float64), and the float32 step inside HF, if any."""

    hf: Callable
    to_neutral: Callable
    ours: dict
    call: Callable
    float32: str | None


def _ministral3():
    return modeling_ministral3.Ministral3Attention(hf_config(
        transformers.Ministral3Config, rope_parameters={
            "rope_type": "default", "rope_theta": THETA, "llama_4_scaling_beta": BETA,
            "original_max_position_embeddings": FLOOR}), 0)


def _gpt_oss():
    """GPT-OSS's sliding-window layer; eager, its only attention with sinks, whose softmax runs
    in the logits' dtype (float64 here: no float32 step)."""
    config = hf_config(transformers.GptOssConfig, num_hidden_layers=1, attention_bias=True,
                       layer_types=["sliding_attention"], sliding_window=WINDOW)
    config._attn_implementation = "eager"
    return modeling_gpt_oss.GptOssAttention(config, 0)


def _llama4(no_rope_layers):
    config = hf_config(transformers.Llama4TextConfig, num_hidden_layers=1, attention_bias=True,
                       no_rope_layers=no_rope_layers, use_qk_norm=True,
                       attn_temperature_tuning=True, floor_scale=FLOOR, attn_scale=BETA)
    return modeling_llama4.Llama4TextAttention(config, 0)


MINISTRAL3 = dict(rope_theta=THETA, query_temperature={"beta": BETA, "floor_scale": FLOOR,
                                                       "shift": 0})
FAMILIES = {
    "qwen3": Family(
        lambda: modeling_qwen3.Qwen3Attention(hf_config(
            transformers.Qwen3Config, attention_bias=True, rms_norm_eps=1e-6), 0),
        with_qk_norms, dict(qkv_bias=True, out_bias=True, rope_theta=THETA, qk_norm="rms",
                            qk_norm_eps=1e-6),
        lambda hf, x: hf(x, rotate_half_cos_sin(), None)[0], "Qwen3RMSNorm in float32"),
    "gemma3_sliding": Family(
        lambda: modeling_gemma3.Gemma3Attention(hf_config(
            transformers.Gemma3TextConfig, num_hidden_layers=1,
            layer_types=["sliding_attention"], sliding_window=WINDOW,
            query_pre_attn_scalar=PRE_ATTN, rms_norm_eps=1e-6), 0),
        with_qk_norms, dict(scale=PRE_ATTN ** -0.5, sliding_window=WINDOW, rope_theta=THETA,
                            qk_norm="rms_one_plus", qk_norm_eps=1e-6),
        lambda hf, x: hf(x, rotate_half_cos_sin(), additive(hf_window_mask(WINDOW)))[0],
        "Gemma3RMSNorm in float32"),
    "gpt_oss_sliding": Family(
        _gpt_oss, lambda sd: {**projections(sd), "sinks": sd["sinks"]},
        dict(qkv_bias=True, out_bias=True, rope_theta=THETA, sinks=True, sliding_window=WINDOW),
        lambda hf, x: hf(x, half_cos_sin(), additive(hf_window_mask(WINDOW)))[0], None),
    "olmo2": Family(
        lambda: modeling_olmo2.Olmo2Attention(hf_config(
            transformers.Olmo2Config, attention_bias=True, rms_norm_eps=1e-6), 0),
        with_qk_norms, dict(qkv_bias=True, out_bias=True, rope_theta=THETA,
                            qk_norm="rms_across_heads", qk_norm_eps=1e-6),
        lambda hf, x: hf(x, rotate_half_cos_sin(), None)[0], "Olmo2RMSNorm in float32"),
    "olmo_clip_qkv": Family(  # OLMo (1): q, k and v clamped to [−c, c] after their projections
        lambda: modeling_olmo.OlmoAttention(hf_config(
            transformers.OlmoConfig, attention_bias=False, clip_qkv=CLIP), 0),
        projections, dict(rope_theta=THETA, clip_qkv=CLIP),
        lambda hf, x: hf(x, rotate_half_cos_sin(), None)[0], None),
    "cohere": Family(
        lambda: modeling_cohere.CohereAttention(hf_config(
            transformers.CohereConfig, use_qk_norm=True, layer_norm_eps=1e-5), 0),
        with_qk_norms, dict(rope_theta=THETA, rope_interleaved=True, qk_norm="layer",
                            qk_norm_eps=1e-5),
        lambda hf, x: hf(x, interleaved_cos_sin(), None)[0],
        "CohereLayerNorm and apply_rotary_pos_emb in float32"),
    "llama4_rope": Family(
        lambda: _llama4(no_rope_layers=[1]), projections,
        dict(qkv_bias=True, out_bias=True, rope_theta=THETA, rope_interleaved=True,
             qk_norm="l2", qk_norm_eps=1e-5),
        lambda hf, x: hf(x, freqs_cis(), None)[0], "apply_rotary_emb and L2Norm in float32"),
    "llama4_nope": Family(
        lambda: _llama4(no_rope_layers=[0]), projections,
        dict(qkv_bias=True, out_bias=True, query_temperature={
            "beta": BETA, "floor_scale": FLOOR, "shift": 1}),
        lambda hf, x: hf(x, None, None)[0], "the temperature in float32"),
    "ministral3": Family(
        _ministral3, projections, MINISTRAL3,
        lambda hf, x: hf(x, rotate_half_cos_sin(), None, _positions(torch.int64))[0],
        "the temperature in float32 (integer position_ids / F)"),
    "ministral3_float64_positions": Family(
        _ministral3, projections, MINISTRAL3,
        lambda hf, x: hf(x, rotate_half_cos_sin(), None, _positions(torch.float64))[0], None),
    "qwen3_next": Family(
        # partial rotary: rd = int(Dh · 0.67) = 4 of Dh = 6 features turn (0.25 in its
        # checkpoints, which have Dh = 256)
        lambda: modeling_qwen3_next.Qwen3NextAttention(hf_config(
            transformers.Qwen3NextConfig, num_hidden_layers=1, layer_types=["full_attention"],
            attention_bias=True, rms_norm_eps=1e-6, partial_rotary_factor=PARTIAL), 0),
        qwen3_next_to_neutral, dict(qkv_bias=True, out_bias=True, rope_theta=THETA,
                                    qk_norm="rms_one_plus", qk_norm_eps=1e-6,
                                    output_gate=True, partial_rotary_factor=PARTIAL),
        lambda hf, x: hf(x, rotate_half_cos_sin(int(DH * PARTIAL)), None)[0],
        "Qwen3NextRMSNorm in float32"),
}


# ---- running ours --------------------------------------------------------------------------

def _randomize(module, rng, scale=0.5):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)) * scale))
    return module.eval()


def rel(actual, expected):
    """max |actual − expected| / max |expected|."""
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


@dataclass
class Run:
    """A family's HF module with random weights, our configuration and the mapped parameters,
    the input x (B, L, D), HF's output, and the float64 reference's fixture on the same."""

    hf: torch.nn.Module
    config: dict
    params: dict
    x: np.ndarray
    expected: np.ndarray
    fixture: object


def family_run(name, rng) -> Run:
    family = FAMILIES[name]
    hf = _randomize(family.hf().double(), rng)
    params = family.to_neutral(_numpy(hf.state_dict()))
    config = dict(SIZES, **family.ours)
    x = rng.standard_normal((B, L, D))
    with torch.no_grad():
        expected = family.call(hf, torch.from_numpy(x)).numpy()
    cot = random_cotangents(rng, (B, L, D), (B, H, L, L))
    fixture = reference_fixture(GQA, config, {"x": x}, params, cot, "float64")
    return Run(hf, config, params, x, expected, fixture)


def run_ours(twin, run, config=None):
    """(output, weights) of the twin's GroupedQueryAttention built from the mapped parameters
    (``config``: another configuration than the family's), float64, called on x."""
    with twin.float64():
        module = twin.build(GQA, run.config if config is None else config, run.params)
        return twin.run(module, {"x": run.x})


def run_with_grads(twin, run, seed):
    """The twin's run of its module on the reference's fixture (output, weights, every
    gradient), checked against the float64 reference to the float64 tolerances
    (golden.harness.check.compare_all)."""
    with twin.float64():
        result = twin.run_with_grads(twin.build(GQA, run.config, run.params), run.fixture,
                                     "float64")
    comps = compare_all(run.fixture, result, "float64")
    assert set(comps) == {"output", "weights", "grad x", *(f"grad {n}" for n in run.params)}
    bad = {what: c for what, c in comps.items() if not c.ok}
    assert not bad, f"{twin.name}, seed {seed}: {bad}"
    return result


def check_level(family, errors, seed):
    """Relative errors against HF at float32 level (1e-12, 1e-6) where HF has a float32 step
    inside, ≤ 1e-12 where it has none."""
    if family.float32 is None:
        assert all(e <= 1e-12 for e in errors.values()), (errors, seed)
    else:
        low, high = FLOAT32_LEVEL
        assert all(low < e < high for e in errors.values()), (family.float32, errors, seed)


# ---- the tests ------------------------------------------------------------------------------

# Every family in both twins in the whole matrix; in the quick suite each family in one twin, in
# turn (tests/helpers.py ``sweep``).
CASES = sweep([pytest.param(name, fw, id=f"{name}-{fw}") for name in FAMILIES for fw in TWINS],
              [{("family", name), ("framework", fw)} for name in FAMILIES for fw in TWINS])


@pytest.mark.parametrize("name, framework", CASES)
def test_family_matches_transformers(name, framework):
    """Ours against the float64 reference (output, weights, every gradient), and ours and the
    reference against HF's module: at float32 level where HF has a float32 step inside, to
    1e-12 where it has none."""
    rng, seed = fresh_rng()
    run = family_run(name, rng)
    result = run_with_grads(TWINS[framework], run, seed)
    check_level(FAMILIES[name], {"ours": rel(result["output"], run.expected),
                                 "reference": rel(run.fixture.expected["output"],
                                                  run.expected)}, seed)


def test_gemma3_sliding_window_means_what_hugging_faces_does():
    """sliding_window=W is masking_utils' sliding-window causal mask for W (the allowed sets
    equal; HF's eager weights vanish exactly where ours do); the core's local_window_size=W
    is another function (W + 1 keys), and HF's attention module ignores its own
    sliding_window without the model's mask."""
    allowed = hf_window_mask(WINDOW).numpy()
    ours = reference.allowed_positions((L, L), is_causal=True,
                                       local_window_size=sliding_window(WINDOW, True))
    trap = reference.allowed_positions((L, L), is_causal=True, local_window_size=WINDOW)
    assert np.array_equal(ours, allowed) and allowed.sum(-1).max() == WINDOW
    assert not np.array_equal(trap, allowed) and trap.sum(-1).max() == WINDOW + 1

    rng, seed = fresh_rng()
    run = family_run("gemma3_sliding", rng)
    x = torch.from_numpy(run.x)
    run.hf.config._attn_implementation = "eager"  # read at every call: weights, float32 softmax
    with torch.no_grad():
        out_eager, w_eager = (t.numpy() for t in run.hf(x, rotate_half_cos_sin(),
                                                        additive(torch.from_numpy(allowed))))
        no_mask = run.hf(x, rotate_half_cos_sin(), None)[0].numpy()
    assert rel(no_mask, run.expected) > 1e-3, seed  # the window is the mask's, not the module's
    q, k, v = (rng.standard_normal((B, H, L, DH)) for _ in range(3))
    for twin in TWINS.values():
        out, weights = run_ours(twin, run)
        assert np.array_equal(weights == 0, np.broadcast_to(~allowed, weights.shape))
        assert np.array_equal(w_eager == 0, weights == 0), (twin.name, seed)
        assert FLOAT32_LEVEL[0] < rel(weights, w_eager) < FLOAT32_LEVEL[1], (twin.name, seed)
        assert rel(out, out_eager) < FLOAT32_LEVEL[1], (twin.name, seed)
        # the core: local_window_size=(W − 1, 0) is HF's W, local_window_size=W is not
        with twin.float64():
            qkv = [twin.array(a) for a in (q, k, v)]
            hf_mask = twin.numpy(twin.sdpa(*qkv, twin.array(allowed), is_causal=True))
            window = twin.numpy(twin.sdpa(*qkv, is_causal=True,
                                          local_window_size=sliding_window(WINDOW, True)))
            wrong = twin.numpy(twin.sdpa(*qkv, is_causal=True, local_window_size=WINDOW))
        assert rel(window, hf_mask) <= 1e-12, (twin.name, seed)
        assert rel(wrong, hf_mask) > 1e-3, (twin.name, seed)


def test_qwen3_next_norm_is_one_plus_weight():
    """Qwen3-Next's q/k RMSNorm multiplies by 1 + w (its weight starts at zeros), as Gemma 3's:
    our "rms_one_plus"; read as "rms" (Qwen3's w) the same weights give another function."""
    fresh = FAMILIES["qwen3_next"].hf()
    assert not fresh.q_norm.weight.any() and not fresh.k_norm.weight.any()
    rng, seed = fresh_rng()
    run = family_run("qwen3_next", rng)
    out, _ = run_ours(TWINS["torch"], run, dict(run.config, qk_norm="rms"))
    assert rel(out, run.expected) > 1e-3, seed


def test_llama4_layer_kinds():
    """no_rope_layers[i] = 1 means layer i uses RoPE (and, with use_qk_norm, the L2 norm)."""
    rope, nope = _llama4(no_rope_layers=[1]), _llama4(no_rope_layers=[0])
    assert rope.use_rope and hasattr(rope, "qk_norm")
    assert not nope.use_rope and not hasattr(nope, "qk_norm")


@pytest.mark.parametrize("name", ["llama4_nope", "ministral3", "ministral3_float64_positions"])
def test_query_temperature_eagerly(name):
    """The temperature families' forward in both twins, called eagerly (outside the runners'
    jit), against HF; and the other shift against HF: Llama 4 reads
    ⌊(p + 1) / F⌋, Ministral 3 ⌊p / F⌋, and the two differ at p = 2 and 5 (F = 3)."""
    rng, seed = fresh_rng()
    run = family_run(name, rng)
    t = run.config["query_temperature"]
    other = dict(run.config, query_temperature=dict(t, shift=1 - t["shift"]))
    for twin in TWINS.values():
        out, weights = run_ours(twin, run)
        assert rel(out, run.fixture.expected["output"]) <= 1e-12, (twin.name, seed)
        assert rel(weights, run.fixture.expected["weights"]) <= 1e-12, (twin.name, seed)
        check_level(FAMILIES[name], {twin.name: rel(out, run.expected)}, seed)
        assert rel(run_ours(twin, run, other)[0], run.expected) > 1e-3, (twin.name, seed)

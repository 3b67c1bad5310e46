"""The speech encoders' attention layers (golden.hf.speech: Transformer-XL's relative positions,
NVIDIA's FastConformer; Shaw's in blocks, IBM's Granite Speech), converted by
``golden.convert.from_hf``, against transformers' own
models at float64: a tiny Parakeet encoder (the encoder of Parakeet CTC/RNN-T/TDT, Canary and
Cohere ASR) and a tiny Nemotron ASR streaming encoder (its chunked_limited mask the model's
own), each on two rows of audio features padded to one length (HF's attention mask), each
layer's attention input, mask and output captured from the model's own forward; both twins on
the real rows; the input gradient against HF's; each layer without its relative positions far
from HF's; a round trip to_hf(from_hf(...)) exact; the verifier reading a composite's encoder.

Level: FLOAT32_LEVEL (1e-6 relative to the largest output), HF's position table being float32
(its entries off by up to 2⁻²⁴ (2 + 3|t|) ≈ 1.7e-6 at distance t, |t| ≤ L − 1 = 9 here:
tests/test_transformer_xl.py). Measured over 200 seeds of each family: outputs at most 1.0e-7
(median 9e-9), input gradients (60 seeds) at most 1.0e-7; without the relative positions at
least 5e-2. Given our float64 table in its place, HF's layer agrees to EXACT (1e-12): the table
is its only float32 step (sdpa; eager's softmax would be another).

Granite Speech (granite_speech_encoder, granite_speech_plus_encoder, granite_speech5_encoder):
each attention module alone, given the encoder's attention_dists, at L = 8 frames in blocks of
C = 3 (the last block partial, right-padded by HF), float64 with no float32 step in HF: both
twins to EXACT (measured over 20 seeds at most 8.4e-16), the input gradient to EXACT; Shaw's
term, the blocks, and the first two's pre_norm (our input_norm) each undone: at least 9e-2.

Shape legend: B batch, T feature frames, F mel bins, L encoder frames (T / 2), D width.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import math
import types

import numpy as np
import pytest
import torch

import golden.convert
from golden.specification.decoder import sinusoid_table, timing_table
from tests.helpers import TWINS, fresh_rng

transformers = pytest.importorskip("transformers")
from tests.hf_harness import (EXACT, FLOAT32_LEVEL, assert_gives_back,  # noqa: E402
                              draw_parameters, rel, state_dict)

B, T, F, D, N = 2, 20, 8, 12, 3
LENGTHS = np.array([T, 13])  # feature frames per row: row 1 padded
SMALL = dict(hidden_size=D, num_attention_heads=N, num_hidden_layers=2, intermediate_size=16,
             num_mel_bins=F, subsampling_factor=2, subsampling_conv_channels=2,
             conv_kernel_size=3, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
             layerdrop=0.0, attention_bias=True)
# The model_types tested here (tests/test_hf_import.py's census and docs/hf.md's table read it):
# the encoder's config class and its tiny settings. Nemotron's chunked_limited mask: chunks of
# lookahead + 1 = 2 frames, and the sliding_window − 1 = 3 frames before (one chunk).
XL_FAMILIES = {
    "parakeet_encoder": ("ParakeetEncoderConfig", "ParakeetEncoder", SMALL),
    "nemotron_asr_streaming_encoder": (
        "NemotronAsrStreamingEncoderConfig", "NemotronAsrStreamingEncoder",
        dict(SMALL, sliding_window=4, default_num_lookahead_tokens=1)),
}
# Granite Speech (Shaw's relative positions in blocks of C = 3 frames, M = 5 ≥ C): the config
# class, the module (in its modeling file), its tiny settings; tested on the attention module
# alone, given the encoder's attention_dists.
GC, GM, GL, GN, GDH = 3, 5, 8, 3, 4  # block, table's reach, frames (not a multiple of C), heads
GRANITE_FAMILIES = {
    "granite_speech_encoder": (
        "GraniteSpeechEncoderConfig", "granite_speech", "GraniteSpeechConformerAttention",
        dict(hidden_dim=D, num_heads=GN, dim_head=GDH, context_size=GC, max_pos_emb=GM,
             dropout=0.0)),
    "granite_speech_plus_encoder": (
        "GraniteSpeechPlusEncoderConfig", "granite_speech_plus",
        "GraniteSpeechPlusConformerAttention",
        dict(hidden_dim=D, num_heads=GN, dim_head=GDH, context_size=GC, max_pos_emb=GM,
             dropout=0.0)),
    "granite_speech5_encoder": (
        "GraniteSpeech5EncoderConfig", "granite_speech5", "GraniteSpeech5EncoderAttention",
        dict(hidden_size=D, num_attention_heads=GN, head_dim=GDH, context_size=GC,
             max_position_embeddings=GM, attention_dropout=0.0)),
}


def _model(mt, rng):
    """The tiny encoder, float64, sdpa, every parameter drawn N(0, 0.5²)."""
    config_class, model_class, kw = XL_FAMILIES[mt]
    config = getattr(transformers, config_class)(**kw)
    config._attn_implementation = "sdpa"
    model = getattr(transformers, model_class)(config).double().eval()
    draw_parameters(model, rng)
    return config, model


def _layers(model, rng):
    """Each layer's attention call (args, kwargs), input x, mask (B, L, L) bool and output
    (B, L, D), from one forward of the encoder on two padded rows of features."""
    seen = {}

    def hooks(i, attention):
        def before(module, args, kwargs):
            seen[i] = {"call": (args, dict(kwargs)), "x": kwargs["hidden_states"].numpy().copy(),
                       "mask": kwargs["attention_mask"][:, 0].numpy().copy()}

        def after(module, args, output):
            seen[i]["y"] = output[0].detach().numpy().copy()
        return (attention.register_forward_pre_hook(before, with_kwargs=True),
                attention.register_forward_hook(after))
    handles = [h for i, layer in enumerate(model.layers) for h in hooks(i, layer.self_attn)]
    features = rng.standard_normal((B, T, F))
    frames = (np.arange(T)[None, :] < LENGTHS[:, None]).astype(np.int64)
    try:
        with torch.no_grad():
            model(torch.from_numpy(features), attention_mask=torch.from_numpy(frames))
    finally:
        for h in handles:
            h.remove()
    return seen


def _real(mask):
    """(B, L) bool: the frames that attend something (HF's padded frames attend nothing)."""
    return mask.any(axis=-1)


def _ours(twin, config, sd, x, mask, **change):
    variant, ours, params = golden.convert.from_hf(config.to_dict(), sd)
    ours = dict(ours, **change)
    if ours.get("relative_positions") is None:
        params = {n: a for n, a in params.items() if n not in ("W_pos", "bias_u", "bias_v")}
    with twin.float64():
        module = twin.build(variant, ours, params)
        return twin.numpy(module(twin.array(x), twin.array(mask)))


@pytest.mark.parametrize("twin", sorted(TWINS))
@pytest.mark.parametrize("mt", sorted(XL_FAMILIES))
def test_encoder_layers_equal_hfs(mt, twin):
    rng, seed = fresh_rng()
    config, model = _model(mt, rng)
    t = TWINS[twin]
    for i, s in _layers(model, rng).items():
        real = _real(s["mask"])
        assert not real.all() and real.any(axis=1).all()  # a padded row, no empty one
        if mt == "nemotron_asr_streaming_encoder":  # the chunked_limited mask bites
            assert not s["mask"][0].all()
        sd = state_dict(model.layers[i].self_attn)
        out = _ours(t, config, sd, s["x"], s["mask"])
        assert rel(out[real], s["y"][real]) < FLOAT32_LEVEL, (mt, i, seed)
        if twin == "torch":  # without its relative positions the layer is far from HF's
            far = _ours(t, config, sd, s["x"], s["mask"], relative_positions=None)
            assert rel(far[real], s["y"][real]) > 1e3 * FLOAT32_LEVEL, (mt, i, seed)


@pytest.mark.parametrize("mt", sorted(XL_FAMILIES))
def test_hfs_layer_given_a_float64_table_agrees_to_float64(mt):
    """HF's layer called again as its model called it, with our float64 table
    (golden.specification.decoder.sinusoid_table) as its position embeddings: equal to the
    torch twin's to EXACT, so HF's float32 table is the whole of FLOAT32_LEVEL."""
    rng, seed = fresh_rng()
    config, model = _model(mt, rng)
    s = _layers(model, rng)[0]
    args, kwargs = s["call"]
    length = s["x"].shape[1]
    table = torch.from_numpy(np.array(sinusoid_table(D, length - 1)))[None].expand(B, -1, -1)
    with torch.no_grad():
        y = model.layers[0].self_attn(*args, **dict(kwargs, position_embeddings=table))[0]
    real = _real(s["mask"])
    ours = _ours(TWINS["torch"], config, state_dict(model.layers[0].self_attn), s["x"],
                 s["mask"])
    assert rel(ours[real], y.numpy()[real]) < EXACT, (mt, seed)
    assert rel(ours[real], s["y"][real]) > EXACT  # the float32 table, seen


@pytest.mark.parametrize("mt", sorted(XL_FAMILIES))
def test_encoder_input_gradient_equals_hfs(mt):
    """dL/dx of Σ out ⊙ dO over the real frames for layer 1: HF's attention called again as its
    model called it, against the torch twin's (the JAX twin's gradients against the torch
    twin's are tests/test_fixtures.py's)."""
    rng, seed = fresh_rng()
    config, model = _model(mt, rng)
    s = _layers(model, rng)[1]
    args, kwargs = s["call"]
    d_out = rng.standard_normal(s["y"].shape) * _real(s["mask"])[..., None]
    x = torch.from_numpy(s["x"].copy()).requires_grad_()
    y = model.layers[1].self_attn(*args, **dict(kwargs, hidden_states=x))[0]
    (y * torch.from_numpy(d_out)).sum().backward()
    variant, ours, params = golden.convert.from_hf(config.to_dict(),
                                                   state_dict(model.layers[1].self_attn))
    twin = TWINS["torch"]
    with twin.float64():
        module = twin.build(variant, ours, params)
        ours_x = torch.from_numpy(s["x"].copy()).requires_grad_()
        (module(ours_x, torch.from_numpy(s["mask"])) * torch.from_numpy(d_out)).sum().backward()
    assert rel(ours_x.grad.numpy(), x.grad.numpy()) < FLOAT32_LEVEL, (mt, seed)


@pytest.mark.parametrize("mt", sorted(XL_FAMILIES))
def test_round_trip_gives_back_the_arrays(mt):
    rng = np.random.default_rng(0)
    config, model = _model(mt, rng)
    sd = state_dict(model.layers[0].self_attn)
    variant, ours, params = golden.convert.from_hf(config.to_dict(), sd)
    assert ours["relative_positions"] == "transformer_xl" and ours["causal"] is False
    assert set(params) >= {"W_pos", "bias_u", "bias_v", "b_query", "b_out"}
    back = golden.convert.to_hf(variant, ours, params)
    assert_gives_back(sd, back)


def test_settings_hf_does_not_build_are_refused():
    config = transformers.ParakeetEncoderConfig(**SMALL).to_dict()
    config["num_key_value_heads"] = 1
    with pytest.raises(ValueError, match=r"model_type 'parakeet_encoder': num_key_value_heads "
                                         r"should be num_attention_heads = 3"):
        golden.convert.from_hf(config, {})


def test_the_checkpoint_verifier_reads_a_speech_checkpoints_encoder(tmp_path):
    """attn-parity hf checks the encoders (tests/test_hf_speech_command.py): a Parakeet CTC
    config is read as its encoder_config, the tower it converts."""
    import json

    from golden.verifier.layout import read_config
    encoder = {"model_type": "parakeet_encoder", "hidden_size": D, "num_attention_heads": N}
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "parakeet_ctc", "encoder_config": encoder}))
    assert read_config(tmp_path) == encoder


# ---- Granite Speech: Shaw's relative positions in blocks -------------------------------------

def _granite(mt, rng):
    """HF's attention module (float64, sdpa; every parameter drawn N(0, 0.5²)), its config, and
    how to call it on x (B, L, D) with the real frames' lengths (B,): Granite Speech 5 takes
    the encoder's padding mask, the earlier two none (their rows whole)."""
    config_class, modeling, module_class, kw = GRANITE_FAMILIES[mt]
    config = getattr(transformers, config_class)(**kw)
    config._attn_implementation = "sdpa"
    module = importlib.import_module(f"transformers.models.{modeling}.modeling_{modeling}")
    five = mt == "granite_speech5_encoder"
    cls = getattr(module, module_class)
    hf = (cls(config, layer_idx=0) if five else cls(config)).double().eval()
    draw_parameters(hf, rng)
    seq = torch.arange(GC)
    dists = torch.clamp(seq[:, None] - seq[None, :], -GC, GC) + GM  # the encoder's

    def call(x, lengths):
        if not five:
            return hf(x, attention_dists=dists)
        mask = torch.from_numpy(np.arange(x.shape[1])[None, :] < lengths[:, None])
        return hf(x, position_embeddings=dists, attention_mask=mask)[0]
    return config, hf, call


def _granite_lengths(mt):
    """The real frames of each row: Granite Speech 5's second row padded."""
    return np.array([GL, 6 if mt == "granite_speech5_encoder" else GL])


def _granite_ours(twin, config, sd, x, lengths, **change):
    variant, ours, params = golden.convert.from_hf(config.to_dict(), sd)
    ours = dict(ours, **change)
    if ours.get("relative_positions") is None:
        ours.pop("relative_max_distance")
        params = {n: a for n, a in params.items() if n != "relative_key_table"}
    if ours.get("input_norm") is None:
        ours.pop("input_norm_eps", None)
        params = {n: a for n, a in params.items() if not n.startswith("input_norm")}
    with twin.float64():
        module = twin.build(variant, ours, params)
        module.eval()
        return twin.numpy(module(twin.array(x), query_seq_lengths=twin.array(
            lengths.astype(np.int32))))


@pytest.mark.parametrize("twin", sorted(TWINS))
@pytest.mark.parametrize("mt", sorted(GRANITE_FAMILIES))
def test_granite_attention_equals_hfs(mt, twin):
    # L = 8 frames: blocks of 3 (the last one 2, right-padded by HF), float64 throughout (no
    # float32 step: sdpa, LayerNorm and the table in float64): EXACT on the real frames. Each
    # of Shaw's term, the blocks and (granite_speech(_plus)) the pre_norm undone: far beyond.
    rng, seed = fresh_rng()
    config, hf, call = _granite(mt, rng)
    lengths = _granite_lengths(mt)
    x = rng.standard_normal((B, GL, D))
    with torch.no_grad():
        y = call(torch.from_numpy(x), lengths).numpy()
    real = np.arange(GL)[None, :] < lengths[:, None]  # (B, L)
    sd = state_dict(hf)
    t = TWINS[twin]
    out = _granite_ours(t, config, sd, x, lengths)
    assert rel(out[real], y[real]) < EXACT, (mt, seed)
    if twin == "torch":
        undone = [dict(relative_positions=None), dict(attention_chunk_size=None)]
        if mt != "granite_speech5_encoder":
            undone.append(dict(input_norm=None))
        for change in undone:
            far = _granite_ours(t, config, sd, x, lengths, **change)
            assert rel(far[real], y[real]) > 1e3 * FLOAT32_LEVEL, (mt, change, seed)


@pytest.mark.parametrize("mt", sorted(GRANITE_FAMILIES))
def test_granite_input_gradient_equals_hfs(mt):
    """dL/dx of Σ out ⊙ dO over the real frames through HF's module and the torch twin's,
    float64 (the JAX twin's gradients against the reference are tests/test_shaw.py's)."""
    rng, seed = fresh_rng()
    config, hf, call = _granite(mt, rng)
    lengths = _granite_lengths(mt)
    x = rng.standard_normal((B, GL, D))
    d_out = rng.standard_normal((B, GL, D)) * (np.arange(GL)[None, :, None]
                                               < lengths[:, None, None])
    theirs = torch.from_numpy(x.copy()).requires_grad_()
    (call(theirs, lengths) * torch.from_numpy(d_out)).sum().backward()
    variant, ours, params = golden.convert.from_hf(config.to_dict(), state_dict(hf))
    twin = TWINS["torch"]
    with twin.float64():
        module = twin.build(variant, ours, params)
        mine = torch.from_numpy(x.copy()).requires_grad_()
        out = module(mine, query_seq_lengths=torch.from_numpy(lengths.astype(np.int32)))
        (out * torch.from_numpy(d_out)).sum().backward()
    assert rel(mine.grad.numpy(), theirs.grad.numpy()) < EXACT, (mt, seed)


@pytest.mark.parametrize("mt", sorted(GRANITE_FAMILIES))
def test_granite_round_trip_gives_back_the_arrays(mt):
    config, hf, _ = _granite(mt, np.random.default_rng(0))
    sd = state_dict(hf)
    variant, ours, params = golden.convert.from_hf(config.to_dict(), sd)
    assert ours["relative_positions"] == "shaw" and ours["causal"] is False
    assert (ours["attention_chunk_size"], ours["relative_max_distance"]) == (GC, GM)
    assert params["relative_key_table"].shape == (2 * GM + 1, GDH)
    back = golden.convert.to_hf(variant, ours, params)
    assert_gives_back(sd, back)


@pytest.mark.parametrize("mt, change, match", [
    ("granite_speech_encoder", dict(context_size=GM + 1),
     r"model_type 'granite_speech_encoder': context_size should be in \(0, max_pos_emb = 5\] "
     r"\(HF's check\), got 6"),
    ("granite_speech5_encoder", dict(num_key_value_heads=1),
     r"model_type 'granite_speech5_encoder': num_key_value_heads should be "
     r"num_attention_heads = 3 \(HF's k_proj and v_proj have N heads\), got 1"),
])
def test_granite_settings_hf_does_not_build_are_refused(mt, change, match):
    config, hf, _ = _granite(mt, np.random.default_rng(0))
    with pytest.raises(ValueError, match=match):
        golden.convert.from_hf(dict(config.to_dict(), **change), state_dict(hf))


# ---- Gemma 3n's and Gemma 4's audio attention (relative_positions="conformer_timing") ---------
#
# Against transformers' own modules (Gemma3nAudioConformerAttention's attn and post;
# Gemma4AudioAttention, given the mask and position table its model makes), T = 17 frames: blocks
# of W = 4 (five, the last partial), P = 3 (Gemma 3n: context left 4) or 4 (Gemma 4: left 5)
# keys back, Gemma 3n with F = 2 ahead or none; row 1 padded to 10 frames.
# HF's float32 steps: Gemma 3n's timing signal, its q_scale buffer (Dh^−1/2 / softplus(0) as a
# float32 tensor) and its softmax (dtype=torch.float32), measured against ours at float64 up to
# 1.6e-7 over 40 seeds (FLOAT32_LEVEL); Gemma 4 runs the whole attention in float32 (q, k, v
# .float(): a float64 model fails in its own key product, float32 keys against float64 queries),
# so its float32 module against our float64 one: up to 7.1e-7 over 40 seeds, held to
# GEMMA4_FLOAT32. With those steps in float64 (the table ours, q_scale exact, .float() and the
# softmax's dtype left out: float64_steps), both agree to EXACT.

CT_T, CT_D, CT_N, CT_LENGTHS = 17, 12, 3, np.array([17, 10])
GEMMA4_FLOAT32 = 4e-6  # HF's Gemma 4 audio attention is float32 throughout: 7.1e-7 seen
CONFORMER = {
    "gemma3n_audio": ("Gemma3nAudioConfig", "Gemma3nAudioConformerAttention",
                      dict(hidden_size=CT_D, conf_num_attention_heads=CT_N,
                           conf_attention_chunk_size=4, conf_attention_context_left=4,
                           conf_attention_context_right=2)),
    "gemma4_audio": ("Gemma4AudioConfig", "Gemma4AudioAttention",
                     dict(hidden_size=CT_D, num_attention_heads=CT_N, attention_chunk_size=4,
                          attention_context_left=5, attention_context_right=0)),
}
# every model_type tested here (docs/hf.md's table reads it)
FAMILIES = {**XL_FAMILIES, **GRANITE_FAMILIES, **CONFORMER}
CT_REAL = np.arange(CT_T)[None, :] < CT_LENGTHS[:, None]  # (B, T)


@contextlib.contextmanager
def float64_steps():
    """HF's float32 casts left out for float64 tensors: softmax's dtype= and Tensor.float()."""
    softmax, to_float = torch.nn.functional.softmax, torch.Tensor.float
    torch.nn.functional.softmax = lambda x, dim=None, dtype=None, **kw: softmax(x, dim=dim, **kw)
    torch.Tensor.float = lambda t, *a, **k: t if t.dtype == torch.float64 else to_float(t, *a,
                                                                                       **k)
    try:
        yield
    finally:
        torch.nn.functional.softmax, torch.Tensor.float = softmax, to_float


def _conformer(mt, rng, **change):
    """HF's module (float64, parameters N(0, 0.5²)) and its config."""
    config_class, module_class, kw = CONFORMER[mt]
    config = getattr(transformers, config_class)(**dict(kw, **change))
    module = getattr(importlib.import_module(f"transformers.models.{mt[:-6]}.modeling_{mt[:-6]}"),
                     module_class)
    hf = (module(config) if mt == "gemma3n_audio" else module(config, 0)).double().eval()
    draw_parameters(hf, rng)
    return config, hf


def _gemma4_inputs(config, exact):
    """Gemma4AudioModel's blocked mask (B, 1, U, W, C) of the padded rows and its position
    table (C//2 + 1, D), as its forward makes them (ours, float64, when ``exact``)."""
    from transformers.models.gemma4 import modeling_gemma4 as m4
    left, right = config.attention_context_left, config.attention_context_right
    q, k = torch.arange(CT_T)[:, None], torch.arange(CT_T)[None, :]
    allowed = (m4.sliding_window_mask_function((left - 1, right))(0, 0, q, k)[None]
               & torch.from_numpy(CT_REAL)[:, None, :])  # (B, T, T), keys padded
    mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(
        ~allowed, torch.finfo(torch.float64).min)[:, None]
    blocked = m4.Gemma4AudioModel._convert_4d_mask_to_blocked_5d(
        types.SimpleNamespace(config=config), mask)
    if exact:
        back = left - 1
        return blocked, torch.from_numpy(np.array(timing_table(CT_D, back)[:back + 1]))
    table = m4.Gemma4AudioRelPositionalEncoding(config)(torch.zeros(1, CT_T, CT_D))
    return blocked, table


def _hf_call(mt, config, hf, x, exact):
    """HF's output (B, T, D) of the attention on x (a tensor) with the right-padded rows."""
    if mt == "gemma3n_audio":
        context = contextlib.nullcontext()
        if exact:
            emb = hf.attn.relative_position_embedding
            hf.attn.q_scale.fill_((CT_D // CT_N) ** -0.5 / math.log(2))
            span = max(emb.max_backward, emb.max_forward)
            rows = np.array(timing_table(CT_D, span))[span - emb.max_backward:
                                                      span + emb.max_forward + 1]
            emb._get_timing_signal_1d_pos = lambda pos, dtype: torch.from_numpy(rows)[None]
            context = float64_steps()
        with context:
            heads = hf.attn(x, torch.from_numpy(~CT_REAL))  # (B, T, N, Dh)
            return hf.post(heads.reshape(B, CT_T, -1))
    blocked, table = _gemma4_inputs(config, exact)
    if exact:
        with float64_steps():
            return hf(x, table, blocked)[0]
    hf32 = copy.deepcopy(hf).float()
    return hf32(x.float(), table.float(), blocked.float())[0].double()


def _ours_ct(twin, config, sd, x, change=None, params_change=None):
    variant, ours, params = golden.convert.from_hf(config.to_dict(), sd)
    ours, params = dict(ours, **(change or {})), dict(params, **(params_change or {}))
    with twin.float64():
        module = twin.build(variant, ours, params)
        out = module(twin.array(x), query_seq_lengths=twin.array(CT_LENGTHS.astype(np.int32)))
        return module, out


@pytest.mark.parametrize("exact", [False, True], ids=["hf-as-is", "float64-steps"])
@pytest.mark.parametrize("twin", sorted(TWINS))
@pytest.mark.parametrize("mt, change", [("gemma3n_audio", {}),
                                        ("gemma3n_audio", dict(conf_attention_context_right=0)),
                                        ("gemma4_audio", {})])
def test_gemma_audio_attention_equals_hfs(mt, change, twin, exact):
    rng, seed = fresh_rng()
    config, hf = _conformer(mt, rng, **change)
    x = rng.standard_normal((B, CT_T, CT_D))
    with torch.no_grad():
        y = _hf_call(mt, config, hf, torch.from_numpy(x), exact).numpy()
    t = TWINS[twin]
    out = t.numpy(_ours_ct(t, config, state_dict(hf), x)[1])
    bound = EXACT if exact else FLOAT32_LEVEL if mt == "gemma3n_audio" else GEMMA4_FLOAT32
    assert rel(out[CT_REAL], y[CT_REAL]) < bound, (mt, change, seed)


@pytest.mark.parametrize("mt", sorted(CONFORMER))
def test_gemma_audio_input_gradient_equals_hfs(mt):
    """dL/dx of Σ out ⊙ dO over the real frames, HF's module with its float32 steps in
    float64 against the torch twin's, to EXACT."""
    rng, seed = fresh_rng()
    config, hf = _conformer(mt, rng)
    x = rng.standard_normal((B, CT_T, CT_D))
    d_out = rng.standard_normal(x.shape) * CT_REAL[..., None]
    xt = torch.from_numpy(x.copy()).requires_grad_()
    (_hf_call(mt, config, hf, xt, True) * torch.from_numpy(d_out)).sum().backward()
    twin = TWINS["torch"]
    variant, ours, params = golden.convert.from_hf(config.to_dict(), state_dict(hf))
    with twin.float64():
        module = twin.build(variant, ours, params)
        ours_x = torch.from_numpy(x.copy()).requires_grad_()
        out = module(ours_x, query_seq_lengths=torch.from_numpy(CT_LENGTHS))
        (out * torch.from_numpy(d_out)).sum().backward()
    assert rel(ours_x.grad.numpy(), xt.grad.numpy()) < EXACT, (mt, seed)


@pytest.mark.parametrize("mt, undo", [
    (mt, undo) for mt in sorted(CONFORMER)
    for undo in ("no relative term", "no per_dim_scale", "cap outside", "no key scale")
    if not (undo == "no key scale" and mt == "gemma3n_audio")])  # Gemma 3n has no key scale
def test_gemma_audio_setting_undone_moves_far(mt, undo):
    """Each part undone (W_pos zero: no relative term; per_dim_scale zero: softplus(0)/ln 2 =
    1; the term added after the cap, not inside; Gemma 4's key scale left out) moves the
    torch twin far from HF's (float64 steps), each by more than 1e3 · EXACT."""
    rng, seed = fresh_rng()
    config, hf = _conformer(mt, rng, **({"conf_attention_logit_cap": 1.0}
                                        if mt == "gemma3n_audio" else
                                        {"attention_logit_cap": 1.0}))  # a cap that bites
    x = rng.standard_normal((B, CT_T, CT_D))
    with torch.no_grad():
        y = _hf_call(mt, config, hf, torch.from_numpy(x), True).numpy()
    sd, twin = state_dict(hf), TWINS["torch"]
    change, params = {}, {}
    if undo == "no relative term":
        params = {"W_pos": np.zeros((CT_D, CT_D))}
    elif undo == "no per_dim_scale":
        params = {"per_dim_scale": np.zeros(CT_D // CT_N)}
    elif undo == "no key scale":
        change = {"key_scale": None}
    module, out = _ours_ct(twin, config, sd, x)
    assert rel(out.detach().numpy()[CT_REAL], y[CT_REAL]) < EXACT, (mt, seed)
    if undo == "cap outside":  # the term as a bias after the cap
        with twin.float64():
            module._inside_cap = lambda q, k, term, scale: term
            far = module(torch.from_numpy(x), query_seq_lengths=torch.from_numpy(CT_LENGTHS))
    else:
        far = _ours_ct(twin, config, sd, x, change, params)[1]
    assert rel(far.detach().numpy()[CT_REAL], y[CT_REAL]) > 1e3 * EXACT, (mt, undo, seed)


@pytest.mark.parametrize("mt", sorted(CONFORMER))
def test_gemma_audio_round_trip_gives_back_the_attention_arrays(mt):
    """Gemma 3n's norms (the Conformer block's) and Gemma 4's infinite clip bounds are not
    ours: every other array comes back exactly."""
    config, hf = _conformer(mt, np.random.default_rng(0))
    sd = state_dict(hf)
    variant, ours, params = golden.convert.from_hf(config.to_dict(), sd)
    assert ours["relative_positions"] == "conformer_timing"
    assert set(params) == {"W_query", "W_key", "W_value", "W_out", "W_pos", "per_dim_scale"}
    back = golden.convert.to_hf(variant, ours, params)
    left = {n for n in sd if n not in back}
    assert left == ({"pre_attn_norm.weight", "post_norm.weight"} if mt == "gemma3n_audio" else
                    {f"{m}.{b}" for m in ("q_proj", "k_proj", "v_proj", "post")
                     for b in ("input_min", "input_max", "output_min", "output_max")})
    for name, a in back.items():
        np.testing.assert_array_equal(a, sd[name])


def test_gemma3n_audio_window_from_its_context():
    config, hf = _conformer("gemma3n_audio", np.random.default_rng(0))
    base, sd = config.to_dict(), state_dict(hf)
    _, ours, _ = golden.convert.from_hf(base, sd)
    assert (ours["causal"], ours["sliding_window"], ours["softcap"]) == (False, (3, 2), 50.0)
    _, ours, _ = golden.convert.from_hf(dict(base, conf_attention_context_right=0), sd)
    assert (ours["causal"], ours["sliding_window"]) == (True, 4)
    assert "key_scale" not in ours


@pytest.mark.parametrize("change, match", [
    (dict(attention_context_right=1), r"attention_context_right should be 0"),
    (dict(attention_chunk_size=8), r"attention_context_right should be 0 and .* got "
                                   r"attention_chunk_size = 8, attention_context_left = 5"),
])
def test_gemma4_audio_settings_its_table_misreads_are_refused(change, match):
    config = transformers.Gemma4AudioConfig(**dict(CONFORMER["gemma4_audio"][2], **change))
    with pytest.raises(ValueError, match=r"model_type 'gemma4_audio': " + match):
        golden.convert.from_hf(config.to_dict(), {})


def test_gemma4_audio_finite_clip_bounds_are_refused():
    config, hf = _conformer("gemma4_audio", np.random.default_rng(0))
    sd = state_dict(hf)
    sd["k_proj.output_max"] = np.array(3.0)
    with pytest.raises(ValueError, match=r"model_type 'gemma4_audio': k_proj.output_max should "
                                         r"be infinite \(a clip bound of Gemma4ClippableLinear"):
        golden.convert.from_hf(config.to_dict(), sd)


# ---- issue 42: speech and audio models whose attention is a supported one's ------------------
#
# Each tiny model (float64, sdpa, parameters N(0, 0.5²)) run on its own inputs, each attention
# layer's input and output captured (tests/hf_harness.captured): Whisper-like audio towers
# (Qwen2-Audio's, Voxtral's, Audio Flamingo 3's: no float32 step, EXACT), rotary encoders (LASR,
# GLM-ASR: HF's float32 RoPE angles, FLOAT32_LEVEL; with rope_precision="hf" EXACT), Kyutai's
# STT decoder (its sliding_window 4 < L not applied by HF's model, nor by ours), and the
# encoder-decoders Moonshine (partial interleaved RoPE, cross-attention) and Dia (scale 1, GQA
# self- and cross-attention; its cross-attention, called with positional arguments, checked as
# the module alone). Measured over 20 seeds, the torch twin's worst relative error: the
# Whisper-like towers 5.5e-16; with HF's float32 angles left as they are (rope_precision=
# "exact") LASR 8.8e-8, GLM-ASR 1.1e-7, Kyutai 1.1e-7, Moonshine 2.6e-7, Dia 8.5e-8 (under
# FLOAT32_LEVEL), with rope_precision="hf" at most 7.4e-16 (EXACT); each setting undone at
# least 2.7e-2 (Moonshine's interleaved pairs) away.

from tests.hf_harness import (Family as HFamily, attention_of, called_with,  # noqa: E402
                              captured, undone)
from tests.helpers import matrix, sweep  # noqa: E402

SL = 9  # frames (tokens) of the attention


def _audio_features(mel, frames, time_last=True):
    def inputs(config, rng):
        shape = (B, mel(config), frames) if time_last else (B, frames, mel(config))
        return {"input_features": rng.standard_normal(shape)}
    return inputs


def _encoder_layers(model, i):
    return model.layers[i].self_attn


def _seq2seq_layers(module, cross):
    def of(model, layer):
        kind, i = layer
        stack = (model.encoder if kind == "encoder" else model.decoder).layers[i]
        return getattr(stack, cross if kind == "cross" else module)
    return of


def _moonshine_inputs(config, rng):
    # 384 samples: its convolutions (64/3/3 wide, strides 64, 3, 2) leave 9 encoder frames
    return {"input_values": rng.standard_normal((B, 384 + 64 * 6 * 8)),
            "decoder_input_ids": rng.integers(0, 32, (B, SL))}


def _dia_inputs(config, rng):
    return {"input_ids": rng.integers(0, 256, (B, 7)),
            "decoder_input_ids": rng.integers(0, 16, (B, SL, 2))}


WHISPER_LIKE = dict(num_hidden_layers=2, intermediate_size=16, num_mel_bins=4,
                    max_source_positions=SL, hidden_size=12, num_attention_heads=3)
# model_type -> (tiny model, layers, bound at rope_precision="exact"); every size distinct
AUDIO_42 = {
    "qwen2_audio_encoder": HFamily("Qwen2AudioEncoderConfig", dict(
        d_model=12, encoder_attention_heads=3, encoder_layers=2, encoder_ffn_dim=16,
        num_mel_bins=4, max_source_positions=SL), layers=(0, 1), attention_of=_encoder_layers,
        inputs=_audio_features(lambda c: c.num_mel_bins, 2 * SL), model="Qwen2AudioEncoder"),
    "voxtral_encoder": HFamily("VoxtralEncoderConfig", WHISPER_LIKE, layers=(0, 1),
                               attention_of=_encoder_layers, model="VoxtralEncoder",
                               inputs=_audio_features(lambda c: c.num_mel_bins, 2 * SL)),
    "audioflamingo3_encoder": HFamily(
        "AudioFlamingo3EncoderConfig", WHISPER_LIKE, layers=(0, 1), attention_of=_encoder_layers,
        model="AudioFlamingo3Encoder",
        inputs=lambda c, rng: {"input_features": rng.standard_normal((B, 4, 2 * SL)),
                               "input_features_mask": np.ones((B, 2 * SL), np.int64)}),
    # LASR: GQA (4 heads, 2 KV), head width 5 ≠ D / N, q/k/v/o biases; 41 frames to 9
    "lasr_encoder": HFamily("LasrEncoderConfig", dict(
        hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=6,
        num_hidden_layers=2, intermediate_size=8, num_mel_bins=4, subsampling_conv_channels=4,
        subsampling_conv_kernel_size=3, conv_kernel_size=3, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0}), layers=(0, 1),
        attention_of=_encoder_layers, model="LasrEncoder",
        inputs=_audio_features(lambda c: c.num_mel_bins, 39, time_last=False)),
    # GLM-ASR: GQA, half of each head (6 of 12) turned, rotate-half pairs; k_proj no bias
    "glmasr_encoder": HFamily("GlmAsrEncoderConfig", dict(
        hidden_size=24, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
        intermediate_size=8, num_mel_bins=4, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                         "partial_rotary_factor": 0.5}), layers=(0, 1),
        attention_of=_encoder_layers, model="GlmAsrEncoder",
        inputs=_audio_features(lambda c: c.num_mel_bins, 2 * SL - 1)),
    "kyutai_speech_to_text": HFamily("KyutaiSpeechToTextConfig", dict(
        hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=6,
        num_hidden_layers=2, ffn_dim=16, vocab_size=20, codebook_vocab_size=9, num_codebooks=2,
        audio_bos_token_id=8, audio_pad_token_id=5, pad_token_id=3, bos_token_id=4,
        sliding_window=4, max_position_embeddings=64, codec_config={"model_type": "mimi"},
        rope_parameters={"rope_type": "default", "rope_theta": 100.0}), layers=(0, 1),
        model="KyutaiSpeechToTextModel",
        inputs=lambda c, rng: {"input_ids": rng.integers(0, 8, (B, SL, 3))}),
    # Moonshine: 3 heads of 20 (18 features turned: 0.9), q/k/v biases, head width padded to
    # 24 by HF (zeros: no change)
    "moonshine": HFamily("MoonshineConfig", dict(
        hidden_size=60, encoder_num_attention_heads=3, decoder_num_attention_heads=3,
        encoder_num_hidden_layers=2, decoder_num_hidden_layers=2, intermediate_size=8,
        vocab_size=32, attention_bias=True, pad_head_dim_to_multiple_of=8,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                         "partial_rotary_factor": 0.9}),
        layers=(("encoder", 0), ("encoder", 1), ("decoder", 1), ("cross", 0), ("cross", 1)),
        attention_of=_seq2seq_layers("self_attn", "encoder_attn"), model="MoonshineModel",
        inputs=_moonshine_inputs),
    # Dia: encoder 3 heads of 4 over 12, decoder 4 heads (2 KV) of 6 over 16, cross 4 heads
    # (2 KV) of 5 over the encoder's 12; scale 1 everywhere
    "dia": HFamily("DiaConfig", dict(
        encoder_config=dict(hidden_size=12, num_attention_heads=3, num_key_value_heads=3,
                            head_dim=4, num_hidden_layers=2, intermediate_size=8,
                            rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
        decoder_config=dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=6, cross_num_attention_heads=4, cross_num_key_value_heads=2,
                            cross_head_dim=5, cross_hidden_size=12, num_hidden_layers=2,
                            intermediate_size=8, num_channels=2, vocab_size=16,
                            pad_token_id=13, eos_token_id=12, bos_token_id=14,
                            rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
        delay_pattern=[0, 1]),
        layers=(("encoder", 0), ("encoder", 1), ("decoder", 1)),
        attention_of=_seq2seq_layers("self_attention", "cross_attention"), model="DiaModel",
        inputs=_dia_inputs),
}
FAMILIES.update(AUDIO_42)
# each family's distinctive settings undone, (layer, our settings changed)
AUDIO_DISTINCT = {
    "qwen2_audio_encoder": [(0, {"causal": True}), (1, {"qkv_bias": False, "out_bias": False})],
    "voxtral_encoder": [(1, {"causal": True})],
    "audioflamingo3_encoder": [(0, {"causal": True})],
    "lasr_encoder": [(0, {"causal": True}), (1, {"rope_parameters": None})],
    "glmasr_encoder": [(0, {"causal": True}), (1, {"partial_rotary_factor": None})],
    "kyutai_speech_to_text": [(1, {"sliding_window": 4}), (0, {"rope_parameters": None})],
    "moonshine": [(("encoder", 0), {"causal": True}), (("encoder", 1),
                                                      {"rope_interleaved": None}),
                  (("decoder", 1), {"partial_rotary_factor": None}),
                  (("cross", 1), {"qkv_bias": False})],
    "dia": [(("encoder", 0), {"scale": None}), (("decoder", 1), {"causal": False})],
}
ROPE_42 = {"lasr_encoder", "glmasr_encoder", "kyutai_speech_to_text", "moonshine", "dia"}


def _audio_model(name, rng):
    family = AUDIO_42[name]
    config = getattr(transformers, family.config)(**family.kw)
    config._attn_implementation = "sdpa"
    model = getattr(transformers, family.model)(config).double().eval()
    draw_parameters(model, rng)
    return config, model


def _layer(layer):
    return layer if isinstance(layer, tuple) else (None, layer)


def _audio_captured(name, rng, **kw):
    config, model = _audio_model(name, rng)
    family = AUDIO_42[name]
    seen = captured(family, model, family.layers, family.inputs(config, rng), **kw)
    return config, model, seen


def _audio_ours(twin, variant, ours, params, x, *context):
    with twin.float64():
        module = twin.build(variant, ours, params)
        module.eval()
        return twin.numpy(module(twin.array(x), *(twin.array(c) for c in context)))


# the quick suite: a covering few (each family's config fields and settings undone at least
# once: tests/helpers.py sweep); the whole matrix every one
AUDIO_PARAMS = sweep([pytest.param(n, id=n) for n in AUDIO_42],
                     [{("field", k) for k in AUDIO_42[n].kw}
                      | {("undone", k) for _, c in AUDIO_DISTINCT[n] for k in c}
                      | {("kind", _layer(layer)[0]) for layer in AUDIO_42[n].layers}
                      for n in AUDIO_42])


@pytest.mark.parametrize("twin", sorted(TWINS))
@pytest.mark.parametrize("name", AUDIO_PARAMS)
def test_audio_layers_equal_the_models_own_attention(name, twin):
    rng, seed = fresh_rng()
    config, model, seen = _audio_captured(name, rng)
    t = TWINS[twin]
    for layer in AUDIO_42[name].layers:
        kind, i = _layer(layer)
        sd = state_dict(attention_of(AUDIO_42[name], model, layer))
        x, expected, *context = seen[layer]
        assert len(context) == (kind == "cross")
        for precision in ("exact", "hf") if name in ROPE_42 and kind != "cross" else ("exact",):
            variant, ours, params = golden.convert.from_hf(
                config.to_dict(), sd, layer_idx=i, kind=kind, rope_precision=precision)
            error = rel(_audio_ours(t, variant, ours, params, x, *context), expected)
            exact = precision == "hf" and twin == "torch" or name not in ROPE_42 or (
                kind == "cross")
            assert error <= (EXACT if exact else FLOAT32_LEVEL), (name, layer, precision,
                                                                  error, seed)


@pytest.mark.parametrize("name", list(AUDIO_42))
def test_audio_round_trip_gives_back_the_arrays(name):
    rng = np.random.default_rng(0)
    config, model = _audio_model(name, rng)
    layers = AUDIO_42[name].layers + ((("cross", 0),) if name == "dia" else ())
    for layer in layers:
        kind, i = _layer(layer)
        sd = state_dict(attention_of(AUDIO_42[name], model, layer))
        result = golden.convert.from_hf(config.to_dict(), sd, layer_idx=i, kind=kind)
        assert_gives_back(sd, golden.convert.to_hf(*result))


@pytest.mark.parametrize("name", AUDIO_PARAMS)
def test_audio_distinctive_setting_undone_moves_far(name):
    rng, seed = fresh_rng()
    config, model, seen = _audio_captured(name, rng)
    twin = TWINS["torch"]
    for layer, change in AUDIO_DISTINCT[name]:
        kind, i = _layer(layer)
        variant, ours, params = golden.convert.from_hf(
            config.to_dict(), state_dict(attention_of(AUDIO_42[name], model, layer)),
            layer_idx=i, kind=kind)
        changed, kept = undone(variant, ours, params, change)
        x, expected, *context = seen[layer]
        out = _audio_ours(twin, variant, changed, kept, x, *context)
        assert rel(out, expected) > 1e3 * FLOAT32_LEVEL, (name, layer, change, seed)


@pytest.mark.parametrize("name", AUDIO_PARAMS)
def test_audio_input_gradient_equals_hfs(name):
    """dL/dx of Σ out ⊙ dO (and dL/dcontext for a cross-attention) of each layer, HF's module
    called again as its model called it, against the torch twin's, with HF's RoPE angles
    (rope_precision="hf"): EXACT."""
    rng, seed = fresh_rng()
    calls = {}
    config, model, seen = _audio_captured(name, rng, calls=calls)
    twin = TWINS["torch"]
    for layer in AUDIO_42[name].layers:
        kind, i = _layer(layer)
        hf = attention_of(AUDIO_42[name], model, layer)
        drawn = [rng.standard_normal(a.shape) for a in (seen[layer][0], *seen[layer][2:])]
        d_out = torch.from_numpy(rng.standard_normal(seen[layer][1].shape))
        theirs = [torch.from_numpy(a).requires_grad_() for a in drawn]
        args, kwargs = called_with(calls[layer], theirs[0])
        if kind == "cross":
            kwargs = dict(kwargs, key_value_states=theirs[1])
        kwargs.pop("past_key_values", None)
        out = hf(*args, **kwargs)[0]
        (out * d_out).sum().backward()
        variant, ours, params = golden.convert.from_hf(
            config.to_dict(), state_dict(hf), layer_idx=i, kind=kind,
            rope_precision="hf" if name in ROPE_42 and kind != "cross" else "exact")
        mine = [torch.from_numpy(a.copy()).requires_grad_() for a in drawn]
        with twin.float64():
            module = twin.build(variant, ours, params)
            module.eval()
            (module(*mine) * d_out).sum().backward()
        for what, a, b in zip(("x", "context"), mine, theirs):
            assert rel(a.grad.numpy(), b.grad.numpy()) <= EXACT, (name, layer, what, seed)


def test_dias_cross_attention_equals_hfs_module():
    """Dia's DiaCrossAttention (GQA: 4 heads, 2 KV, of 5 features; the encoder's 12 wide
    context; scale 1), called alone on drawn x and context: both twins to EXACT, the input and
    context gradients through the torch twin to EXACT; with our default scale Dh^−1/2 far."""
    from transformers.models.dia.modeling_dia import DiaCrossAttention
    rng, seed = fresh_rng()
    config, model = _audio_model("dia", rng)
    hf = model.decoder.layers[0].cross_attention
    assert isinstance(hf, DiaCrossAttention)
    x, context = rng.standard_normal((B, SL, 16)), rng.standard_normal((B, 7, 12))
    theirs = [torch.from_numpy(a.copy()).requires_grad_() for a in (x, context)]
    y = hf(*theirs)[0]
    d_out = torch.from_numpy(rng.standard_normal(y.shape))
    (y * d_out).sum().backward()
    variant, ours, params = golden.convert.from_hf(config.to_dict(), state_dict(hf),
                                                   kind="cross")
    assert (ours["num_kv_heads"], ours["head_dim"], ours["scale"]) == (2, 5, 1.0)
    for t in TWINS.values():
        out = _audio_ours(t, variant, ours, params, x, context)
        assert rel(out, y.detach().numpy()) <= EXACT, (t.name, seed)
    twin = TWINS["torch"]
    mine = [torch.from_numpy(a.copy()).requires_grad_() for a in (x, context)]
    with twin.float64():
        (twin.build(variant, ours, params)(*mine) * d_out).sum().backward()
    for a, b in zip(mine, theirs):
        assert rel(a.grad.numpy(), b.grad.numpy()) <= EXACT, seed
    changed, kept = undone(variant, ours, params, {"scale": None})
    far = _audio_ours(twin, variant, changed, kept, x, context)
    assert rel(far, y.detach().numpy()) > 1e3 * FLOAT32_LEVEL, seed


# the JAX twin's repeats of a kind in the whole matrix (issue 39: the quick suite's time)
DECODING = [pytest.param(n, k, t, id=f"{n}-{t}", marks=(matrix,) if t == "jax" and n != "moonshine"
                         else ()) for n, k in [("moonshine", ("decoder", "cross")),
                                               ("dia", ("decoder",)),
                                               ("kyutai_speech_to_text", (None,))]
            for t in sorted(TWINS)]


@pytest.mark.parametrize("name, kinds, twin", DECODING)
def test_audio_decoders_decode_with_our_caches(name, kinds, twin):
    """The decoder's last layer decodes as HF's forward computed it: a prefill of 4 tokens,
    then one at a time with our KV cache (a cross-attention with a ContextCache of the
    encoder's output)."""
    rng, seed = fresh_rng()
    config, model, seen = _audio_captured(name, rng)
    t = twin = TWINS[twin]
    for kind in kinds:
        layer = 1 if kind is None else (kind, 1)
        variant, ours, params = golden.convert.from_hf(
            config.to_dict(), state_dict(attention_of(AUDIO_42[name], model, layer)),
            layer_idx=1, kind=kind, rope_precision="hf" if kind != "cross" else "exact")
        x, expected, *context = seen[layer]
        with t.float64():
            module = t.build(variant, ours, params)
            module.eval()
            if kind == "cross":
                cache = module.context_cache(t.array(context[0]))
                steps = [t.numpy(module(t.array(x[:, i:i + 1]), cache=cache))
                         for i in range(SL)]
            else:
                y, cache = module(t.array(x[:, :4]), cache=module.init_cache(B, SL))
                steps = [t.numpy(y)]
                for i in range(4, SL):
                    y, cache = module(t.array(x[:, i:i + 1]), cache=cache)
                    steps.append(t.numpy(y))
        bound = EXACT if twin.name == "torch" or kind == "cross" else FLOAT32_LEVEL
        assert rel(np.concatenate(steps, axis=1), expected) <= bound, (name, kind, seed)


@pytest.mark.parametrize("config, match", [
    (dict(decoder_num_key_value_heads=1),
     r"model_type 'moonshine': encoder_num_attention_heads, .* should be equal"),
    (dict(encoder_num_attention_heads=2, encoder_num_key_value_heads=2),
     r"model_type 'moonshine': .* should be equal"),
])
def test_moonshine_head_counts_hf_mixes_are_refused(config, match):
    base = transformers.MoonshineConfig(**AUDIO_42["moonshine"].kw).to_dict()
    with pytest.raises(ValueError, match=match):
        golden.convert.from_hf(dict(base, **config), {}, kind="encoder")


def test_fun_asr_nanos_encoder_is_refused_by_name():
    config = transformers.FunAsrNanoEncoderConfig().to_dict()
    with pytest.raises(ValueError, match=r"model_type 'fun_asr_nano_encoder' is not supported: "
                                         r"Fun-ASR-Nano's SAN-M attention adds an FSMN"):
        golden.convert.from_hf(config, {})


def test_glmasrs_key_bias_is_zeros_and_a_non_zero_one_refused():
    config, model = _audio_model("glmasr_encoder", np.random.default_rng(0))
    variant, ours, params = golden.convert.from_hf(config.to_dict(),
                                                   state_dict(model.layers[0].self_attn))
    assert not params["b_key"].any()
    params["b_key"] = params["b_key"] + 1.0
    with pytest.raises(ValueError, match=r"model_type 'glmasr_encoder': b_key should be zeros"):
        golden.convert.to_hf(variant, ours, params)


@pytest.mark.parametrize("name, twin", [
    pytest.param(n, t, id=f"{n}-{t}", marks=(matrix,) if t == "jax" and n != "lasr_encoder"
                 else ())
    for n in ("kyutai_speech_to_text", "audioflamingo3_encoder", "lasr_encoder")
    for t in sorted(TWINS)])
def test_audio_padded_rows_equal_the_models_own_attention(name, twin):
    """Padding given to HF's model as its own mask: Kyutai's decoder left-padded (row 1's first
    3 tokens; position_ids counting the real tokens, as generate passes them), Audio Flamingo
    3's and LASR's encoders right-padded (row 1's last frames: input_features_mask /
    attention_mask); ours given the padding as a mask of keys (B, L, L) and the same positions:
    the real rows agree (rope_precision="hf": EXACT through the torch twin)."""
    rng, seed = fresh_rng()
    twin = TWINS[twin]
    config, model = _audio_model(name, rng)
    family = AUDIO_42[name]
    inputs = family.inputs(config, rng)
    real = np.ones((B, SL), np.int64)
    kw, positions = {}, None
    if name == "kyutai_speech_to_text":
        real[1, :3] = 0
        positions = np.maximum(np.cumsum(real, axis=1) - 1, 0)
        kw = dict(attention_mask=torch.from_numpy(real),
                  position_ids=torch.from_numpy(positions))
    elif name == "audioflamingo3_encoder":
        real[1, 6:] = 0  # 12 of 18 features real: 6 frames
        inputs["input_features_mask"] = np.repeat(real, 2, axis=1)
    else:  # LASR: 39 features, row 1's first 27 real: ((27 − 3)//2 + 1 − 3)//2 + 1 = 6 frames
        real[1, 6:] = 0
        kw = dict(attention_mask=torch.from_numpy(
            (np.arange(39)[None, :] < np.array([[39], [27]])).astype(np.int64)))
    seen = captured(family, model, family.layers, inputs, **kw)
    keys = np.broadcast_to(real.astype(bool)[:, None, :], (B, SL, SL))
    rows = real.astype(bool)
    for i in family.layers:
        x, expected = seen[i]
        variant, ours, params = golden.convert.from_hf(
            config.to_dict(), state_dict(attention_of(family, model, i)), layer_idx=i,
            rope_precision="hf" if name in ROPE_42 else "exact")
        with twin.float64():
            module = twin.build(variant, ours, params)
            module.eval()
            out = twin.numpy(module(twin.array(x), twin.array(keys.copy()), positions=(
                None if positions is None else twin.array(positions.astype(np.int32)))))
        bound = EXACT if twin.name == "torch" or name not in ROPE_42 else FLOAT32_LEVEL
        assert rel(out[rows], expected[rows]) <= bound, (name, i, seed)

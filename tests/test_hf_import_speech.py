"""The speech encoders' attention layers (golden.hf.speech: Transformer-XL's relative positions,
NVIDIA's FastConformer; Shaw's in blocks, IBM's Granite Speech), converted by
``golden.convert.from_hf``, against transformers' own
models at float64: a tiny Parakeet encoder (the encoder of Parakeet CTC/RNN-T/TDT, Canary and
Cohere ASR) and a tiny Nemotron ASR streaming encoder (its chunked_limited mask the model's
own), each on two rows of audio features padded to one length (HF's attention mask), each
layer's attention input, mask and output captured from the model's own forward; both twins on
the real rows; the input gradient against HF's; each layer without its relative positions far
from HF's; a round trip to_hf(from_hf(...)) exact; the verifier refusing the encoders by name.

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

import importlib

import numpy as np
import pytest
import torch

import golden.convert
from golden.specification.decoder import sinusoid_table
from tests.helpers import TWINS, fresh_rng

transformers = pytest.importorskip("transformers")
from tests.hf_harness import EXACT, FLOAT32_LEVEL, rel, state_dict  # noqa: E402

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
FAMILIES = {**XL_FAMILIES, **GRANITE_FAMILIES}


def _model(mt, rng):
    """The tiny encoder, float64, sdpa, every parameter drawn N(0, 0.5²)."""
    config_class, model_class, kw = XL_FAMILIES[mt]
    config = getattr(transformers, config_class)(**kw)
    config._attn_implementation = "sdpa"
    model = getattr(transformers, model_class)(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)) * 0.5))
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
    assert set(back) == set(sd)
    for name, a in sd.items():
        np.testing.assert_array_equal(back[name], a)
        assert not np.shares_memory(back[name], a)


def test_settings_hf_does_not_build_are_refused():
    config = transformers.ParakeetEncoderConfig(**SMALL).to_dict()
    config["num_key_value_heads"] = 1
    with pytest.raises(ValueError, match=r"model_type 'parakeet_encoder': num_key_value_heads "
                                         r"should be num_attention_heads = 3"):
        golden.convert.from_hf(config, {})


def test_the_checkpoint_verifier_refuses_a_speech_encoder_by_name(tmp_path):
    """attn-parity hf draws hidden states alone: a speech encoder's checkpoint is refused with
    the reason, not run without its position embeddings."""
    import json

    from golden.verifier.checkpoint import CheckpointError
    from golden.verifier.layout import read_config
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "parakeet_encoder", "hidden_size": D, "num_attention_heads": N}))
    with pytest.raises(CheckpointError, match="'parakeet_encoder': attn-parity hf does not check "
                                              "speech encoders"):
        read_config(tmp_path)


def test_a_speech_checkpoint_is_refused_by_attn_parity_hf_with_why(tmp_path):
    """attn-parity hf draws no relative position table: a Parakeet CTC checkpoint (its
    encoder_config the tower) is refused with the reason, not run without it."""
    import json

    from golden.verifier.checkpoint import CheckpointError
    from golden.verifier.layout import read_config
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "parakeet_ctc", "encoder_config": {"model_type": "parakeet_encoder"}}))
    with pytest.raises(CheckpointError, match="'parakeet_encoder': attn-parity hf does not "
                                              "check speech encoders yet"):
        read_config(tmp_path)


@pytest.mark.parametrize("mt", ["gemma3n_audio", "gemma4_audio"])
def test_the_speech_encoders_not_expressed_yet_are_refused_with_why(mt):
    with pytest.raises(ValueError, match=rf"model_type '{mt}' is not supported: its attention"):
        golden.convert.from_hf({"model_type": mt}, {})


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
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)) * 0.5))
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
    assert set(back) == set(sd)
    for name, a in sd.items():
        np.testing.assert_array_equal(back[name], a)
        assert not np.shares_memory(back[name], a)


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


def test_the_checkpoint_verifier_refuses_granite_speech_by_name(tmp_path):
    import json

    from golden.verifier.checkpoint import CheckpointError
    from golden.verifier.layout import read_config
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "granite_speech5_encoder", "hidden_size": D, "num_attention_heads": GN}))
    with pytest.raises(CheckpointError, match="'granite_speech5_encoder': attn-parity hf does "
                                              "not check speech encoders yet"):
        read_config(tmp_path)

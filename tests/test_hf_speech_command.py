"""``attn-parity hf DIR`` on tiny speech-encoder checkpoints written by transformers' own
``save_pretrained`` (float32, random weights): every attention layer converted and checked by
the twins against the float64 reference and by HF's own encoder, given features that its
subsampling takes to the frames drawn (golden.verifier.speech), so that its position table and
masks are its own; each family's distinctive setting noted as exercised; a wrong conversion
(or a wrong mask) failing HF's rows alone; the verifier's length and mask rules against HF's.

Shape legend: B batch, T feature frames, L encoder frames (the attention's).
"""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest
import torch

from golden import hf
from golden.verifier import check as hf_check
from golden.verifier import speech
from tests.helpers import matrix, sweep

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

XL = dict(hidden_size=12, num_attention_heads=3, num_hidden_layers=2, intermediate_size=16,
          num_mel_bins=8, subsampling_factor=4, subsampling_conv_channels=2, dropout=0.0,
          attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0, attention_bias=True)
# Nemotron's chunked_limited mask: chunks of lookahead + 1 = 3 frames, (7 − 1) // 3 = 2 back.
NEMOTRON = dict(XL, sliding_window=7, default_num_lookahead_tokens=2)
# Granite Speech: blocks of C = 3 frames (M = 5), drawn on 8 frames: two whole and one of 2.
GRANITE = dict(hidden_dim=12, num_heads=3, dim_head=4, context_size=3, max_pos_emb=5,
               num_layers=2, input_dim=6, output_dim=5, feedforward_mult=2, conv_kernel_size=3,
               dropout=0.0)
GRANITE5 = dict(hidden_size=12, num_attention_heads=3, num_key_value_heads=3, head_dim=4,
                context_size=3, max_position_embeddings=5, num_hidden_layers=2,
                intermediate_size=16, num_mel_bins=4, vocab_size=7, conv_kernel_size=3,
                subsample_layers=[0])
# The USM Conformer: blocks of W = 4 queries, P = 3 keys back (Gemma 4: its mask one fewer), F
# ahead (Gemma 3n: 2), drawn on W + P + F + 1 frames.
GEMMA3N = dict(hidden_size=12, conf_num_attention_heads=3, conf_num_hidden_layers=2,
               conf_attention_chunk_size=4, conf_attention_context_left=4,
               conf_attention_context_right=2, input_feat_size=8, sscp_conv_channel_size=[4, 2],
               conf_conv_kernel_size=3)
GEMMA4 = dict(hidden_size=12, num_attention_heads=3, num_hidden_layers=2,
              attention_chunk_size=4, attention_context_left=4, attention_context_right=0,
              subsampling_conv_channels=[8, 2], output_proj_dims=6, conv_kernel_size=3)
# Phi-4-multimodal's audio encoder: a bias per distance clipped at ±3, on 8 frames.
PHI4 = dict(hidden_size=12, intermediate_size=16, num_blocks=2, num_attention_heads=3,
            ext_pw_out_channel=12, depthwise_separable_out_channel=12, nemo_conv_channels=4,
            input_size=8, time_reduction=2, kernel_size=3, bias_max_distance=3,
            dropout_rate=0.0)
PHI4_NOTE = "relative position biases (clipped at ±3): exercised (on 8 frames"
BLOCKS = "blocks of context_size 3: exercised (on 8 frames: 2 whole blocks and a partial one of 2)"
# Issue 42's audio towers: Whisper-like (Audio Flamingo 3's drawn on its max_source_positions
# 6 frames), LASR's and GLM-ASR's with RoPE (GQA; GLM-ASR half of each head turned)
WHISPER_LIKE = dict(num_hidden_layers=2, intermediate_size=16, num_mel_bins=4,
                    max_source_positions=6, hidden_size=12, num_attention_heads=3)
LASR = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=6,
            num_hidden_layers=2, intermediate_size=8, num_mel_bins=4, subsampling_conv_channels=4,
            subsampling_conv_kernel_size=3, conv_kernel_size=3, attention_bias=True)
GLMASR = dict(hidden_size=24, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
              intermediate_size=8, num_mel_bins=4)
ROPE_NOTE = "RoPE over the frames: exercised"
# name: (the model's class, its config class, its config (a composite's encoder_config), the
# encoder's model_type, the notes its report must have, each a prefix)
CHECKPOINTS = {
    "parakeet_encoder": ("ParakeetEncoder", "ParakeetEncoderConfig", XL, "parakeet_encoder",
                         ["Transformer-XL relative positions: exercised"]),
    "parakeet_ctc": ("ParakeetForCTC", "ParakeetCTCConfig", {"encoder_config": XL},
                     "parakeet_encoder", ["Transformer-XL relative positions: exercised"]),
    "nemotron_asr_streaming_encoder": (
        "NemotronAsrStreamingEncoder", "NemotronAsrStreamingEncoderConfig", NEMOTRON,
        "nemotron_asr_streaming_encoder",
        ["Transformer-XL relative positions: exercised",
         "chunked_limited mask (chunks of 3 frames, 2 back; sliding_window 7, lookahead 2): "
         "exercised (on 13 frames"]),
    "granite_speech_encoder": ("granite_speech.GraniteSpeechCTCEncoder",
                               "GraniteSpeechEncoderConfig", GRANITE, "granite_speech_encoder",
                               [BLOCKS]),
    "granite_speech_plus_encoder": (
        "granite_speech_plus.GraniteSpeechPlusCTCEncoder", "GraniteSpeechPlusEncoderConfig",
        GRANITE, "granite_speech_plus_encoder", [BLOCKS]),
    "granite_speech5_ctc": ("GraniteSpeech5ForCTC", "GraniteSpeech5CTCConfig",
                            {"encoder_config": GRANITE5, "vocab_size": 7},
                            "granite_speech5_encoder", [BLOCKS]),
    "gemma3n_audio": ("Gemma3nAudioEncoder", "Gemma3nAudioConfig", GEMMA3N, "gemma3n_audio",
                      ["local attention in blocks of 4 (3 frames back, 2 ahead of a block): "
                       "exercised (on 10 frames"]),
    "gemma4_audio": ("gemma4.Gemma4AudioModel", "Gemma4AudioConfig", GEMMA4, "gemma4_audio",
                     ["local attention in blocks of 4 (3 frames back, 0 ahead of a block): "
                      "exercised (on 8 frames"]),
    "phi4_multimodal_audio": ("Phi4MultimodalAudioModel", "Phi4MultimodalAudioConfig", PHI4,
                              "phi4_multimodal_audio", [PHI4_NOTE]),
    "phi4_multimodal_audio_chunked": (
        "Phi4MultimodalAudioModel", "Phi4MultimodalAudioConfig",
        dict(PHI4, chunk_size=3, left_chunk=1), "phi4_multimodal_audio",
        [PHI4_NOTE, "streaming chunks (chunk_size 3, left_chunk 1): not exercised"]),
    "qwen2_audio_encoder": ("Qwen2AudioEncoder", "Qwen2AudioEncoderConfig", dict(
        d_model=12, encoder_attention_heads=3, encoder_layers=2, encoder_ffn_dim=16,
        num_mel_bins=4, max_source_positions=6), "qwen2_audio_encoder", []),
    "voxtral_encoder": ("VoxtralEncoder", "VoxtralEncoderConfig", WHISPER_LIKE,
                        "voxtral_encoder", []),
    "audioflamingo3_encoder": ("AudioFlamingo3Encoder", "AudioFlamingo3EncoderConfig",
                               WHISPER_LIKE, "audioflamingo3_encoder",
                               ["its encoder's fixed length: drawn on max_source_positions = 6"]),
    "lasr_ctc": ("LasrForCTC", "LasrCTCConfig", {"encoder_config": LASR}, "lasr_encoder",
                 [ROPE_NOTE]),
    "glmasr_encoder": ("GlmAsrEncoder", "GlmAsrEncoderConfig", GLMASR, "glmasr_encoder",
                       [ROPE_NOTE]),
}
# issue 42's in the whole matrix but for a covering two (LASR's RoPE under a CTC config, Audio
# Flamingo 3's fixed length)
MATRIX_ONLY = ("qwen2_audio_encoder", "voxtral_encoder", "glmasr_encoder")


def _class(name):
    """A transformers class: "Name" at its top, or "module.Name" in its modeling file."""
    if "." not in name:
        return getattr(transformers, name)
    module, cls = name.split(".")
    return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"),
                   cls)


def _checkpoint(name, directory, seed=0):
    model_class, config_class, kw = CHECKPOINTS[name][:3]
    model = _class(model_class)(getattr(transformers, config_class)(**kw))
    rng = np.random.default_rng(seed)
    with torch.no_grad():  # weights N(0, 1/fan_in), as trained checkpoints' are scaled
        for p in model.parameters():
            scale = 1 / np.sqrt(p.shape[-1]) if p.dim() == 2 else 0.5
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32)
                                     * scale))
    model.save_pretrained(directory)
    return directory


def _run(directory):
    return hf_check.run(directory, frameworks=["torch", "jax"], log=lambda row: None)


def _failed(report):
    return {(r["fixture"], r["implementation"]) for r in report["rows"] if r["status"] == "fail"}


def _layers(name):
    kw = CHECKPOINTS[name][2]
    kw = kw.get("encoder_config", kw)
    n = next(kw[k] for k in ("num_hidden_layers", "num_layers", "conf_num_hidden_layers",
                             "num_blocks", "encoder_layers") if k in kw)
    return {f"encoder layer {i} (attention)" for i in range(n)}


@pytest.mark.parametrize("name", [pytest.param(n, marks=(matrix,) if n in MATRIX_ONLY else ())
                                  for n in sorted(CHECKPOINTS)])
def test_every_speech_layer_passes(name, tmp_path):
    report = _run(_checkpoint(name, tmp_path))
    rows, layers = report["rows"], _layers(name)
    assert report["checkpoint"]["model_type"] == CHECKPOINTS[name][3]
    assert {r["fixture"] for r in rows} == layers
    assert report["summary"]["ok"], [r for r in rows if r["status"] != "pass"]
    mt = CHECKPOINTS[name][3]  # HF's rows at float64 too where its attention has no float32 step
    dtypes = ("float32", "float64") if hf.FAMILIES[mt].hf_float64 else ("float32",)
    hf_rows = {(r["fixture"], r["dtype"]) for r in rows if r["implementation"] == "hf"
               and r["status"] == "pass"}
    assert hf_rows == {(n, d) for n in layers for d in dtypes}
    for note in CHECKPOINTS[name][4]:
        assert any(n.startswith(note) for n in report["checkpoint"]["exercised"]), note
        assert all(any(n.startswith(note) for n in r["exercised"]) for r in rows), note


def test_a_wrong_transformer_xl_conversion_fails_on_hfs_row(tmp_path, monkeypatch):
    """Parakeet's bias_u and bias_v swapped: the twins agree with the reference (both use the
    converted arrays), HF's own encoder does not."""
    directory = _checkpoint("parakeet_ctc", tmp_path)
    family = hf.FAMILIES["parakeet_encoder"]

    def swapped(sd, ours):
        params = family.to_neutral(sd, ours)
        return dict(params, bias_u=params["bias_v"], bias_v=params["bias_u"])

    monkeypatch.setitem(hf.FAMILIES, "parakeet_encoder",
                        dataclasses.replace(family, to_neutral=swapped))
    assert _failed(_run(directory)) == {(n, "hf") for n in _layers("parakeet_ctc")}


def test_nemotron_without_the_models_mask_fails_on_hfs_row(tmp_path, monkeypatch):
    """Our module given no mask where HF's model applies its chunked_limited one: HF's rows
    fail (the mask bites on the frames drawn), the twins still agree with the reference."""
    name = "nemotron_asr_streaming_encoder"
    directory = _checkpoint(name, tmp_path)
    monkeypatch.setitem(speech.ENCODERS, name, dataclasses.replace(
        speech.ENCODERS[name], mask=lambda c, length: None))
    assert _failed(_run(directory)) == {(n, "hf") for n in _layers(name)}


@pytest.mark.parametrize("mt", ["granite_speech_encoder", "granite_speech5_encoder"])
def test_granite_without_its_blocks_fails_on_hfs_row(mt, tmp_path, monkeypatch):
    """A conversion that drops Granite's blocks (attention over all 8 frames, not within blocks
    of 3): HF's rows fail, at float32 and float64, the twins still agree with the reference."""
    name = mt if mt != "granite_speech5_encoder" else "granite_speech5_ctc"
    directory = _checkpoint(name, tmp_path)
    family = hf.FAMILIES[mt]

    def unblocked(c, layer_idx, sd):
        return dict(family.settings(c, layer_idx, sd), attention_chunk_size=None)

    monkeypatch.setitem(hf.FAMILIES, mt, dataclasses.replace(family, settings=unblocked))
    report = _run(directory)
    assert _failed(report) == {(n, "hf") for n in _layers(name)}
    assert {r["dtype"] for r in report["rows"] if r["status"] == "fail"} == {"float32",
                                                                           "float64"}


@pytest.mark.parametrize("mt", ["gemma3n_audio", "gemma4_audio"])
def test_a_gemma_audio_window_one_wider_fails_on_hfs_row(mt, tmp_path, monkeypatch):
    """One more key in the window than HF's model allows (Gemma 3n: one more ahead; Gemma 4:
    the block's P keys back rather than its mask's P − 1): HF's rows fail, the twins agree."""
    directory = _checkpoint(mt, tmp_path)
    family = hf.FAMILIES[mt]

    def wider(c, layer_idx, sd):
        ours = family.settings(c, layer_idx, sd)
        w = ours["sliding_window"]
        return dict(ours, sliding_window=(w[0], w[1] + 1) if isinstance(w, tuple) else w + 1)

    monkeypatch.setitem(hf.FAMILIES, mt, dataclasses.replace(family, settings=wider))
    assert _failed(_run(directory)) == {(n, "hf") for n in _layers(mt)}


def test_phi4_with_its_table_reversed_fails_on_hfs_row(tmp_path, monkeypatch):
    """The encoder's table of position biases read upside down (the bias of distance d taken
    from −d's row): HF's rows fail at float32 and float64, the twins agree with the
    reference. So the table beside the stack reaches both sides, and the distances bite."""
    name = "phi4_multimodal_audio"
    directory = _checkpoint(name, tmp_path)
    family = hf.FAMILIES[name]

    def reversed_table(sd, ours):
        params = family.to_neutral(sd, ours)
        return dict(params, relative_attention_bias=params["relative_attention_bias"][::-1])

    monkeypatch.setitem(hf.FAMILIES, name, dataclasses.replace(family,
                                                              to_neutral=reversed_table))
    report = _run(directory)
    assert _failed(report) == {(n, "hf") for n in _layers(name)}
    assert {r["dtype"] for r in report["rows"] if r["status"] == "fail"} == {"float32",
                                                                           "float64"}


@pytest.mark.parametrize("length, left, right", [(13, 6, 2), (20, 70, 13), (9, 0, 0),
                                                 (11, 5, 3), (7, -1, 1), (16, 4, 0)])
def test_the_verifiers_chunked_limited_mask_is_hfs(length, left, right):
    from transformers.models.nemotron_asr_streaming import modeling_nemotron_asr_streaming as m
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    theirs = m.chunked_limited_mask_function(left, right)(0, 0, q, k).numpy()
    np.testing.assert_array_equal(speech.chunked_limited(length, left, right), theirs)


# Each family and each factor once in the quick suite (a covering few: three of the six, each
# a tiny checkpoint checked end to end, seconds apiece), every pair in the whole matrix.
SUBSAMPLED = sweep([pytest.param(f, n, id=f"{f}-{n}") for n in
                    ("parakeet_encoder", "nemotron_asr_streaming_encoder") for f in (2, 4, 8)],
                   [{("name", n), ("factor", f)} for n in
                    ("parakeet_encoder", "nemotron_asr_streaming_encoder") for f in (2, 4, 8)])


@pytest.mark.parametrize("factor, name", SUBSAMPLED)
def test_the_features_drawn_are_subsampled_to_the_frames_drawn(name, factor):
    """feature_frames(model, L): HF's subsampling module turns T frames into L, T − 1 into
    fewer, for every L up to 40."""
    model_class, config_class, kw = CHECKPOINTS[name][:3]
    config = getattr(transformers, config_class)(**dict(kw, subsampling_factor=factor))
    model = getattr(transformers, model_class)(config).eval()
    for length in range(1, 41):
        t = speech.feature_frames(model, length)
        with torch.no_grad():
            out = [model.subsampling(torch.zeros(1, n, config.num_mel_bins)).shape[1]
                   for n in (t - 1, t) if n > 0]
        assert out[-1] == length and (t == 1 or out[0] < length), (length, t, out)


def test_a_granite_speech_checkpoint_is_checked_tower_by_tower(tmp_path):
    """Granite Speech (a granite text tower, its Conformer encoder, a Q-Former projector) made
    with save_pretrained: its text layer and both encoder layers are checked, every row
    passing, and the projector is named in the notes as not checked."""
    from tests.hf_harness import BASE
    config = transformers.GraniteSpeechConfig(
        text_config=dict(BASE, model_type="granite", num_hidden_layers=1),
        encoder_config=GRANITE, downsample_rate=2, window_size=4,
        projector_config=dict(hidden_size=12, encoder_hidden_size=12, num_hidden_layers=1,
                              num_attention_heads=2, intermediate_size=8,
                              cross_attention_frequency=1))
    transformers.GraniteSpeechForConditionalGeneration(config).save_pretrained(tmp_path)
    report = _run(tmp_path)
    assert {r["fixture"] for r in report["rows"]} == {"layer 0 (attention)",
                                                      *_layers("granite_speech_encoder")}
    assert report["summary"]["ok"], [r for r in report["rows"] if r["status"] == "fail"]
    assert {r["fixture"] for r in report["rows"]
            if r["implementation"] == "hf" and r["status"] == "pass"} == {
        "layer 0 (attention)", *_layers("granite_speech_encoder")}
    assert report["checkpoint"]["notes"] == [
        "projector_config (blip_2_qformer): not checked: its attention is not converted"]


@matrix
def test_glmasr_with_its_whole_head_turned_fails_on_hfs_row(tmp_path, monkeypatch):
    """GLM-ASR converted with RoPE over the whole head (its partial_rotary_factor 0.5 dropped):
    HF's rows fail, the twins still agree with the reference."""
    mt = "glmasr_encoder"
    directory = _checkpoint(mt, tmp_path)
    family = hf.FAMILIES[mt]

    def whole(c, layer_idx, sd):
        ours = family.settings(c, layer_idx, sd)
        rope = {k: v for k, v in ours["rope_parameters"].items() if k != "partial_rotary_factor"}
        return dict(ours, rope_parameters=rope)

    monkeypatch.setitem(hf.FAMILIES, mt, dataclasses.replace(family, settings=whole))
    assert _failed(_run(directory)) == {(n, "hf") for n in _layers(mt)}


# Issue 42's audio-language composites (golden.hf.speech.COMPOSITES): model_type -> (config
# class, the towers' model_types, the notes' sub-configs); Qwen2-Audio in the quick suite.
AUDIO_COMPOSITES = {
    "qwen2_audio": ("Qwen2AudioConfig", "qwen2", dict(
        d_model=12, encoder_attention_heads=3, encoder_layers=2, encoder_ffn_dim=16,
        num_mel_bins=4, max_source_positions=6, model_type="qwen2_audio_encoder"), ()),
    "voxtral": ("VoxtralConfig", "llama", dict(WHISPER_LIKE, model_type="voxtral_encoder"), ()),
    "audioflamingo3": ("AudioFlamingo3Config", "qwen2",
                       dict(WHISPER_LIKE, model_type="audioflamingo3_encoder"), ()),
    "glmasr": ("GlmAsrConfig", "llama", dict(GLMASR, model_type="glmasr_encoder"), ()),
    "fun_asr_nano": ("FunAsrNanoConfig", "qwen3", dict(
        hidden_size=12, num_attention_heads=3, num_hidden_layers=2, intermediate_size=8,
        num_mel_bins=2, num_stacked_frames=2, num_timestamp_prediction_layers=1,
        fsmn_kernel_size=3, model_type="fun_asr_nano_encoder"),
        ("adaptor_config", "audio_config")),
}


@pytest.mark.parametrize("mt", [pytest.param(m, marks=() if m == "qwen2_audio" else (matrix,))
                                for m in AUDIO_COMPOSITES])
def test_an_audio_language_checkpoint_is_checked_tower_by_tower(mt, tmp_path):
    """Each audio-language composite made with save_pretrained: both text layers and, where
    its kind is converted, both audio-tower layers checked, every row passing, HF's own
    module's among them; a tower not converted (Fun-ASR-Nano's SAN-M encoder, its adaptor)
    named in the notes and none of its layers read."""
    from tests.hf_harness import BASE
    config_class, text, audio, notes = AUDIO_COMPOSITES[mt]
    kw = dict(text_config=dict(BASE, model_type=text, num_hidden_layers=2), audio_config=audio)
    if mt == "fun_asr_nano":
        kw["adaptor_config"] = dict(hidden_size=BASE["hidden_size"], num_attention_heads=2,
                                    intermediate_size=BASE["hidden_size"] // 4,
                                    num_hidden_layers=1, projector_hidden_size=8)
    config = getattr(transformers, config_class)(**kw)
    getattr(transformers, config_class.replace("Config", "ForConditionalGeneration"))(
        config).save_pretrained(tmp_path)
    report = _run(tmp_path)
    names = {r["fixture"] for r in report["rows"]}
    audio_layers = set() if notes else _layers_of(2)
    assert {n.split(" (")[0] for n in names} == {"layer 0", "layer 1",
                                                  *(n.split(" (")[0] for n in audio_layers)}
    assert audio_layers <= names, names
    assert report["summary"]["ok"], [r for r in report["rows"] if r["status"] == "fail"]
    assert {r["fixture"] for r in report["rows"]
            if r["implementation"] == "hf" and r["status"] == "pass"} == names
    noted = [n for n in report["checkpoint"]["notes"] if ": not checked: " in n]
    assert sorted(n.split(" (")[0] for n in noted) == sorted(notes), noted


def _layers_of(n):
    return {f"encoder layer {i} (attention)" for i in range(n)}

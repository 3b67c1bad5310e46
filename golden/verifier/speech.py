"""Speech encoders in the checkpoint verifier: how each is drawn and how HF's model is given its
input, in one table (``ENCODERS``), read by golden.verifier.exercise (the length, the mask our
module takes, the notes) and golden.verifier.model (HF's one-layer encoder's inputs).

HF's speech encoder subsamples its input features (convolutions of stride s, a factor of 4 or
8 in time) and builds its length-dependent inputs to the attention (the relative position
table, its masks) from the subsampled length, while the verifier's hook replaces the
attention's input with the fixture's x of L frames. The features are drawn so that the
subsampled length is exactly L: the fewest feature frames T that the model's own length rule
(its ``_get_subsampling_output_length``, the convolutions' arithmetic) takes to L; the hook then
checks that the attention's input has x's shape. So every table and mask is the one HF's model
makes for L frames, by its own code, with nothing of it rebuilt here (recomputing the kwargs
from x in the hook would need each family's own modules called by hand, the very code under
test); what the model makes from the features' values is replaced with x.

A family's entry: ``needs(c, least, max_length) -> (length, notes)``, the frames its settings
need (at least ``least``, the length other settings need) and the report's notes on them; ``mask(c, length) -> (L, L) bool | None``, the mask the model
puts on its attention, given to our module alike (None: none); ``inputs(model, b, length,
dtype) -> {name: tensor}``, the one-layer model's inputs for b rows of L frames (zeros: the
attention's input is replaced); ``owns``: config fields that are the model's mask, not a
setting of ours (golden.verifier.exercise does not read them as a window or chunk);
``one_layer(c) -> c``: the config HF's one-layer model is built with, where it is not the
layer's own (golden.verifier.model.layer_only); ``fixed_length``: the encoder takes the length
its ``needs`` gives and no other (drawn at it whatever a composite's other towers need).

- parakeet_encoder (the encoder of parakeet_ctc, _rnnt, _tdt, canary, cohere_asr): no mask
  without padding; the position table of 2L − 1 distances the encoder's own.
- nemotron_asr_streaming_encoder: its chunked_limited mask (``chunked_limited``: chunks of
  lookahead + 1 frames, ⌊(sliding_window − 1) / chunk⌋ chunks back; lookahead the config's
  default_num_lookahead_tokens, given to the model as num_lookahead_tokens): at least the
  frames of back + 2 chunks and one more, so that a query sees neither a chunk ahead nor one
  too far back.
- granite_speech_encoder, granite_speech_plus_encoder, granite_speech5_encoder: no
  subsampling before the first layer (a one-layer model's: Granite Speech 5's subsampling
  blocks halve the frames after their attention), so L frames of the input width; blocks of
  context_size C: more than C frames and not a multiple of C (whole blocks and a partial one).
- gemma3n_audio, gemma4_audio (the USM Conformer): a local window of P keys back and F ahead
  computed in blocks of W queries: more than W + P + F frames. Their subsampling has no length
  method: its two convolutions' arithmetic in time is written here (``_gemma3n_frames``,
  ``_gemma4_frames``), and the hook's shape check holds it to the model's. Gemma 3n's
  audio_mel_mask all False (no frame padded); Gemma 4's model makes its blocked 5-D mask
  (B, 1, U, W, C) of the window itself, which our module's window (golden.hf.speech) is.
- phi4_multimodal_audio: its subsampling (stride-2 convolutions, time_reduction in all) takes
  T = L · time_reduction frames to L; its table of position biases the encoder's (Stack.
  beside), loaded into the one-layer model. Its streaming chunks (chunk_size > 0) are the
  model's mask, which its encoder adds to the scores as +1 (allowed) / +0 (blocked) instead of
  blocking (golden.hf.speech): the one-layer model is built with chunk_size −1 (no chunks), the
  caller's mask being ours, and the report says the chunks are not exercised.

- lasr_encoder (LASR / MedASR): two convolutions (its ``_get_subsampling_output_length``), its
  RoPE's positions the encoder's own 0 … L − 1; glmasr_encoder (GLM-ASR): a Whisper-like front
  end (⌊(T − 1) / 2⌋ + 1 frames, ``_whisper_frames``), features (B, F, T); no mask in either.
- audioflamingo3_encoder: Whisper's front end and a position table of max_source_positions M
  rows added to the frames: drawn on exactly M frames (2M features, all real:
  input_features_mask ones). Qwen2-Audio's and Voxtral's towers are not here: their attention
  takes nothing of the length (no mask, no positions), so the verifier's default (Whisper's: the
  config's 2M features, the attention's input replaced) runs them at any L.

Shape legend: B batch, T feature frames, F mel bins, L encoder frames (the attention's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Encoder:
    needs: Callable
    mask: Callable
    inputs: Callable
    owns: tuple = ()
    one_layer: Callable | None = None
    fixed_length: bool = False


def feature_frames(model, length, rule=None) -> int:
    """The fewest feature frames T that the model's subsampling takes to ``length`` frames:
    ``rule(model, T (n,) int64 tensor) -> frames (n,)``, by default the model's own
    ``_get_subsampling_output_length``; ValueError when no T up to 16 (L + 2) does."""
    import torch

    candidates = torch.arange(1, 16 * (length + 2))
    out = (rule(model, candidates) if rule is not None
           else model._get_subsampling_output_length(candidates))
    hit = (out == length).nonzero()
    if len(hit) == 0:
        raise ValueError(f"length should be reached by {type(model).__name__}'s subsampling, "
                         f"got {length}")
    return int(candidates[hit[0, 0]])


def _features(model, b, length, dtype, rule=None, width=None):
    """(B, T, F) zero features subsampled to L frames (F the config's num_mel_bins, or
    ``width``)."""
    import torch
    t = feature_frames(model, length, rule)
    return torch.zeros((b, t, width or model.config.num_mel_bins), dtype=dtype)


def _xl_needs(c, least, max_length):
    return least, ["Transformer-XL relative positions: exercised (HF's encoder given features "
               "subsampled to the frames drawn: its own position table of 2L − 1 distances)"]


def _parakeet_inputs(model, b, length, dtype):
    return {"input_features": _features(model, b, length, dtype)}


def chunked_limited(length, left, right) -> np.ndarray:
    """(L, L) bool, True = may attend: Nemotron's chunked_limited mask (HF's
    chunked_limited_mask_function): chunks of right + 1 frames, a query sees its own chunk and
    the ⌊left / (right + 1)⌋ before it (all before it when left < 0)."""
    chunk = right + 1
    back = left // chunk if left >= 0 else 10_000
    index = np.arange(length) // chunk
    diff = index[:, None] - index[None, :]
    return (diff >= 0) & (diff <= back)


def _nemotron_context(c):
    """(left, right): the left context sliding_window − 1, the lookahead (the config's
    default_num_lookahead_tokens), as the model resolves them."""
    return int(c["sliding_window"]) - 1, int(c["default_num_lookahead_tokens"])


def _nemotron_needs(c, least, max_length):
    left, right = _nemotron_context(c)
    chunk = right + 1
    back = left // chunk
    need = max(least, (back + 2) * chunk + 1)
    reached = "exercised" if need <= max_length else "partly exercised"
    return min(need, max_length), _xl_needs(c, least, max_length)[1] + [
        f"chunked_limited mask (chunks of {chunk} frames, {back} back; sliding_window "
        f"{c['sliding_window']}, lookahead {right}): {reached} (on {min(need, max_length)} "
        f"frames or more: the model's mask, ours given the same)"]


def _nemotron_mask(c, length):
    return chunked_limited(length, *_nemotron_context(c))


def _nemotron_inputs(model, b, length, dtype):
    return {"input_features": _features(model, b, length, dtype),
            "num_lookahead_tokens": int(model.config.default_num_lookahead_tokens)}


def _granite_needs(c, least, max_length):
    """More frames than one block of context_size C and not a multiple of C: whole blocks and
    a partial last one (which HF right-pads and masks)."""
    block = int(c["context_size"])
    need = max(least, block + 1)
    need += need % block == 0
    if need > max_length:
        return least, [f"blocks of context_size {block}: not exercised (more than one block "
                       f"needs {block + 1} frames, over --max-length {max_length})"]
    whole, part = divmod(need, block)
    return need, [f"blocks of context_size {block}: exercised (on {need} frames: {whole} whole "
                  f"block{'s' if whole > 1 else ''} and a partial one of {part})"]


def _unsubsampled(name):
    """The inputs of an encoder that keeps its frames (Granite Speech's: its input_linear
    alone before the layers): L frames of its input width."""
    def inputs(model, b, length, dtype):
        import torch
        return {name: torch.zeros((b, length, model.input_linear.in_features), dtype=dtype)}
    return inputs


# ---- the USM Conformer: Gemma 3n's and Gemma 4's audio encoders ------------------------------

def _usm(c, gemma3n):
    """(W, P, F) of the USM Conformer: blocks of W queries, P keys back, F ahead, as HF's
    attention has them (Gemma 4's mask then takes one fewer back: golden.hf.speech)."""
    prefix = "conf_" if gemma3n else ""
    w, left = c[f"{prefix}attention_chunk_size"], c[f"{prefix}attention_context_left"]
    return int(w), max(0, int(left) - 1), int(c[f"{prefix}attention_context_right"])


def _usm_needs(gemma3n):
    def needs(c, least, max_length):
        w, back, ahead = _usm(c, gemma3n)
        need = max(least, w + back + ahead + 1)
        what = f"local attention in blocks of {w} ({back} frames back, {ahead} ahead of a block)"
        if need > max_length:
            return least, [f"{what}: not exercised ({need} frames are over --max-length "
                           f"{max_length})"]
        return need, [f"{what}: exercised (on {need} frames: more than a block and its "
                      f"context, W + P + F = {w + back + ahead})"]
    return needs


def _gemma3n_frames(model, t):
    """Gemma 3n's two convolutions in time: kernel k, stride s, padded k − 1 after."""
    for (k, _), (s, _) in zip(model.config.sscp_conv_kernel_size,
                              model.config.sscp_conv_stride_size):
        t = (t + (k - 1) - k) // s + 1
    return t


def _gemma3n_inputs(model, b, length, dtype):
    import torch
    mel = _features(model, b, length, dtype, _gemma3n_frames, model.config.input_feat_size)
    return {"audio_mel": mel, "audio_mel_mask": torch.zeros(mel.shape[:2], dtype=torch.bool)}


def _gemma4_frames(model, t):
    """Gemma 4's two convolutions in time: kernel 3, stride 2, padding 1."""
    for _ in range(2):
        t = (t + 2 - 3) // 2 + 1
    return t


def _gemma4_inputs(model, b, length, dtype):
    width = 4 * (model.config.subsampling_conv_channels[0] // 4)  # to c₀ // 4 after both
    return {"input_features": _features(model, b, length, dtype, _gemma4_frames, width)}


# ---- Phi-4-multimodal's audio encoder -----------------------------------------------------------

def _phi4_needs(c, least, max_length):
    notes = [f"relative position biases (clipped at ±{c['bias_max_distance']}): "
             f"{'exercised' if least > c['bias_max_distance'] else 'partly exercised'} (on "
             f"{least} frames: the encoder's own table, loaded into HF's model)"]
    if int(c.get("chunk_size", -1)) > 0:
        notes.append(f"streaming chunks (chunk_size {c['chunk_size']}, left_chunk "
                     f"{c.get('left_chunk')}): not exercised (the model's mask, which HF's "
                     f"encoder adds to the scores as +1 / +0 instead of blocking: HF's "
                     f"one-layer model is built without chunks)")
    return least, notes


def _phi4_frames(model, t):
    """Phi-4's subsampling in time: stride-2 convolutions (kernel 3, padding 1), ⌈T / 2⌉
    each, time_reduction in all."""
    for _ in range(int(model.config.time_reduction).bit_length() - 1):
        t = (t + 1) // 2
    return t


def _phi4_inputs(model, b, length, dtype):
    return {"hidden_states": _features(model, b, length, dtype, _phi4_frames,
                                       model.config.input_size), "mask": None}


# ---- issue 42's audio towers -------------------------------------------------------------------

def _rope_needs(c, least, max_length):
    return least, ["RoPE over the frames: exercised (HF's encoder given features subsampled to "
                   "the frames drawn: its own positions 0 … L − 1)"]


def _whisper_frames(model, t):
    """A Whisper-like front end in time: conv1 (kernel 3, padding 1), conv2 (kernel 3, stride
    2, padding 1): ⌊(T − 1) / 2⌋ + 1."""
    return (t - 1) // 2 + 1


def _glmasr_inputs(model, b, length, dtype):
    import torch
    t = feature_frames(model, length, _whisper_frames)
    return {"input_features": torch.zeros((b, model.config.num_mel_bins, t), dtype=dtype)}


def _fixed_needs(c, least, max_length):
    """Audio Flamingo 3's encoder adds its position table of max_source_positions = M rows to
    the frames: it takes exactly M frames (2M features)."""
    m = int(c["max_source_positions"])
    reach = "" if m <= max_length else f" (over --max-length {max_length}: its only length)"
    return m, [f"its encoder's fixed length: drawn on max_source_positions = {m} frames{reach}"]


def _audioflamingo3_inputs(model, b, length, dtype):
    import torch
    t = 2 * length
    return {"input_features": torch.zeros((b, model.config.num_mel_bins, t), dtype=dtype),
            "input_features_mask": torch.ones((b, t), dtype=torch.long)}


ENCODERS = {
    "parakeet_encoder": Encoder(_xl_needs, lambda c, length: None, _parakeet_inputs),
    "nemotron_asr_streaming_encoder": Encoder(_nemotron_needs, _nemotron_mask, _nemotron_inputs,
                                              owns=("sliding_window",)),
    **{mt: Encoder(_granite_needs, lambda c, length: None, _unsubsampled("hidden_states"))
       for mt in ("granite_speech_encoder", "granite_speech_plus_encoder")},
    "granite_speech5_encoder": Encoder(_granite_needs, lambda c, length: None,
                                       _unsubsampled("input_features")),
    "gemma3n_audio": Encoder(_usm_needs(True), lambda c, length: None, _gemma3n_inputs),
    "gemma4_audio": Encoder(_usm_needs(False), lambda c, length: None, _gemma4_inputs,
                            owns=("attention_chunk_size",)),
    "phi4_multimodal_audio": Encoder(_phi4_needs, lambda c, length: None, _phi4_inputs,
                                     owns=("chunk_size",),
                                     one_layer=lambda c: dict(c, chunk_size=-1)),
    "lasr_encoder": Encoder(_rope_needs, lambda c, length: None, _parakeet_inputs),
    "glmasr_encoder": Encoder(_rope_needs, lambda c, length: None, _glmasr_inputs),
    "audioflamingo3_encoder": Encoder(_fixed_needs, lambda c, length: None,
                                      _audioflamingo3_inputs, fixed_length=True),
}


def encoder(config) -> Encoder | None:
    """The entry of a speech encoder's config (a dict, or HF's config object), None for a
    model that is not one."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    return ENCODERS.get(get("model_type"))

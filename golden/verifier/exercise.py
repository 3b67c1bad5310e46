"""Inputs that exercise every setting of a checkpoint that acts only past some length or
position.

Eight drawn tokens prove nothing about a 512-key sliding window: with fewer tokens than the
window, windowed and full attention compute the same thing, and so would a converter that got
the window wrong. The lengths are read from the checkpoint's own config (Hugging Face's
fields, not our conversion of them, which is what is under test), and HF's own module, given
the same config, is the judge:

- a sliding window of W keys (``sliding_window``) or chunks of C (``attention_chunk_size``):
  at least W + 3 (C + 3) tokens, so that the last queries see fewer keys than causal attention
  would. Where that is longer than ``max_length``, a scaled copy: the config with the window
  (chunk) set to ``SCALED``, converted by us and given to HF's module alike, on SCALED + 3
  tokens; the output says so.
- Llama 4's query temperature (``attn_temperature_tuning``), 1 + β·ln(1 + ⌊(p + 1)/F⌋), is 1
  before position F − 1 (F = ``floor_scale``): at least F + 1 tokens, or a scaled copy.
- T5's relative position buckets: max_distance + 2 tokens (the logarithmic buckets and the
  last, shared one), at most ``max_length``.
- a RoPE scaling that switches past a length (``longrope``'s long factors, ``dynamic``'s NTK
  rescaling, past ``original_max_position_embeddings`` S, or ``max_position_embeddings``): a
  second input for each such layer whose positions run from S − L/2 past S (the first keeps
  0 … L − 1: both sides of the switch are reached).
- multimodal RoPE (a vision-language model's text tower, whose family's HF model takes
  positions (3, B, L)): text with text positions would turn every pair alike, as the 1-D RoPE
  does; its input holds an image of 2 × 2 tokens after two text tokens, as ``get_rope_index``
  places one (``image_positions``): its height and width rows differ from its temporal one.
- axial RoPE (a vision tower): one image, one batch row, drawn as the tower's own table entry
  says (golden.verifier.towers: a Qwen-VL-like tower's m × 2m patches in merge-block order,
  Pixtral's, Gemma 4's, Llama 4's); HF's model is given the image, and computes the positions
  itself.

- a hybrid's linear-attention layers (golden.hf.LINEAR): HF computes them in chunks (64 tokens
  in its chunked delta rule, ``torch_chunk_gated_delta_rule`` and Kimi's ``chunk_kda``;
  MiniMax's ``block_size``), and so do our twins' "chunked" implementation: at least a chunk
  and 3 tokens, so that the state crosses a chunk's boundary (at most ``max_length``). Two
  batch rows, the second left-padded by ``PADDED`` tokens as HF's ``attention_mask`` says
  (the mixers zero a padded token's input: the state must not see it).

Every layer is drawn at one length, the longest any setting needs, so that layers of one
configuration share their compiled programs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from golden.hf import FAMILIES, LINEAR
from golden.hf.linear import LINEAR as LINEAR_TYPE
from golden.verifier.speech import encoder
from golden.verifier.towers import tower

BASE_LENGTH = 8   # the drawn inputs' length when no setting needs more
MAX_LENGTH = 640  # the longest input drawn (``attn-parity hf --max-length``)
SCALED = 6        # a window, chunk or temperature step set in a scaled copy of the config
SWITCHES = ("longrope", "dynamic")  # RoPE scalings that change past a length
POSITIONED = ("grouped_query_attention", "multi_head_latent_attention")  # take positions
HF_CHUNK = 64  # the chunk of HF's chunked delta rule (torch_chunk_gated_delta_rule, chunk_kda)
PADDED = 3     # the left padding of a linear-attention layer's second row


@dataclass
class Exercise:
    """One input for a layer: the config it converts with (the checkpoint's, or a scaled copy),
    its length, its positions (None: 0 … L − 1), the suffix of its rows' name, how each
    length-dependent setting of the layer is reached, its batch rows (None: check.batch's;
    a vision tower's image: 1) and its mask (L, L) bool (None: none; Qwen2.5-VL's windows)."""

    config: dict
    length: int
    positions: np.ndarray | None = None
    suffix: str = ""
    notes: list = field(default_factory=list)
    rows: int | None = None
    mask: np.ndarray | None = None


def _window_layer(c, i):
    types = c.get("layer_types")
    if isinstance(types, list) and i < len(types):
        return types[i] == "sliding_attention"
    return c.get("use_sliding_window", True) is not False


def _linear_layer(c, i):
    types = c.get("layer_types")
    return isinstance(types, list) and i < len(types) and types[i] == LINEAR_TYPE


def linear_chunk(config) -> int | None:
    """The chunk HF computes the config's linear-attention layers in (MiniMax's block_size,
    else HF_CHUNK); None for a config without such layers that we convert."""
    types = config.get("layer_types")
    if config.get("model_type") not in LINEAR or not isinstance(types, list) \
            or LINEAR_TYPE not in types:
        return None
    return int(config.get("block_size") or HF_CHUNK)


def _chunk_layer(c, i):
    types = c.get("layer_types")
    return not isinstance(types, list) or i >= len(types) or types[i] == "chunked_attention"


# (the HF config field, the tokens needed beyond its value, which layers it acts on, whether
# the config turns it on)
LENGTHS = (("sliding_window", 3, _window_layer, lambda c: True),
           ("attention_chunk_size", 3, _chunk_layer, lambda c: True),
           ("floor_scale", 1, lambda c, i: True, lambda c: bool(c.get("attn_temperature_tuning"))))


@dataclass
class Plan:
    """A stack's config as drawn (scaled where needed), the length it needs, and per setting
    (field, note, which layers)."""

    config: dict
    length: int
    settings: list


def plan(config, max_length=MAX_LENGTH) -> Plan:
    """What a stack's config needs to be exercised (see the module's docstring)."""
    c, length, settings = dict(config), BASE_LENGTH, []
    speech = encoder(config)
    for name, past, acts_on, on in LENGTHS:
        value = config.get(name)
        if speech is not None and name in speech.owns:  # the model's mask, not ours
            continue
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0 and on(c)):
            continue
        if value + past <= max_length:
            length = max(length, value + past)
            note = f"{name} {value}: exercised (on {value + past} tokens or more)"
        else:
            c[name], length = SCALED, max(length, SCALED + past)
            note = (f"{name} {value}: exercised as {SCALED} (on {SCALED + past} tokens or "
                    f"more; {value + past} tokens are over --max-length {max_length}: a copy "
                    f"of the config with {name} = {SCALED}, given to both)")
        settings.append((name, note, acts_on))
    distance = config.get("relative_attention_max_distance")
    if config.get("relative_attention_num_buckets") and isinstance(distance, int):
        reach = min(distance + 2, max_length)
        length = max(length, reach)
        settings.append(("relative_attention_max_distance",
                         f"relative buckets (max_distance {distance}): "
                         f"{'exercised' if distance + 2 <= max_length else 'partly exercised'}"
                         f" (on {reach} tokens or more)", lambda c, i: True))
    chunk = linear_chunk(config)
    if chunk is not None:
        reach = min(chunk + 3, max_length)
        length = max(length, reach)
        settings.append(("linear_chunk", f"linear attention in chunks of {chunk} (HF's chunked "
                         f"form, our 'chunked'): "
                         f"{'exercised' if chunk + 3 <= max_length else 'not crossed'} (on "
                         f"{reach} tokens or more; a chunk's boundary crossed from {chunk + 1}"
                         f"); left padding: the second row's first {PADDED} tokens",
                         _linear_layer))
    if speech is not None:  # golden.verifier.speech: the encoder's own needs
        length, notes = speech.needs(config, length, max_length)
        settings += [("speech", note, lambda c, i: True) for note in notes]
    return Plan(c, length, settings)


def exercises(layer, stack_plan, length) -> list[Exercise]:
    """The inputs of one layer (a golden.verifier.preflight.Layer) at ``length`` tokens: one, and a
    second with shifted positions where its RoPE scaling switches past a length."""
    c, i = stack_plan.config, layer.index
    notes = [note for name, note, acts_on in stack_plan.settings
             if acts_on(c, i) and not (name == "relative_attention_max_distance"
                                        and layer.stack.kind == "cross")]
    if layer.settings.get("dropout"):
        notes.append(f"dropout {layer.settings['dropout']}: not exercised (inference mode, as "
                     f"HF's module runs)")
    if _axes(layer) == 2:
        return [_vision_exercise(layer, c, notes)]
    if layer.stack.linear:  # two rows, the second left-padded (HF's attention_mask)
        mask = np.ones((2, length), bool)
        mask[1, :PADDED] = False
        return [Exercise(c, length, notes=notes, rows=2, mask=mask)]
    speech = encoder(c)
    first = Exercise(c, length, notes=notes,
                     mask=None if speech is None else speech.mask(c, length))
    if _axes(layer) == 3:
        first.positions = image_positions(length)
        notes.append("multimodal RoPE: exercised (an image of 2 × 2 tokens at 2–5, its height "
                      "and width rows other than its temporal one)")
    switch = _switch(c, i)
    if switch is None or layer.variant not in POSITIONED:
        return [first]
    kind, at = switch
    if length > at:  # 0 … L − 1 cross it already; no input of L tokens stays below it
        first.notes.append(f"RoPE {kind} switch at {at}: exercised past it only (the inputs "
                           f"are longer)")
        return [first]
    positions = np.arange(length, dtype=np.int64) + (at - length // 2)
    first.notes.append(f"RoPE {kind} switch at {at}: exercised below it (positions from 0) "
                       f"and past it (positions from {positions[0]})")
    return [first, Exercise(c, length, positions, f" @ positions {positions[0]}-{positions[-1]}",
                            list(first.notes))]


def image_positions(length) -> np.ndarray:
    """(3, L) int64: two text tokens, an image of 2 × 2 tokens (temporal 2, rows 2–3, columns
    2–3), then text from 4 on, every axis alike: Hugging Face's get_rope_index for such a
    prompt (the text after an image starts at the largest position so far + 1)."""
    t = np.concatenate([[0, 1, 2, 2, 2, 2], np.arange(4, length - 2)])
    h = np.concatenate([[0, 1, 2, 2, 3, 3], np.arange(4, length - 2)])
    w = np.concatenate([[0, 1, 2, 3, 2, 3], np.arange(4, length - 2)])
    return np.stack([t, h, w])[:, :length].astype(np.int64)


def _axes(layer) -> int:
    """The rows of positions the layer's family's HF model takes (Family.position_axes)."""
    entry = FAMILIES.get(layer.config.get("model_type"))
    return getattr(entry, "position_axes", 1) if layer.variant in POSITIONED else 1


def _vision_exercise(layer, c, notes) -> Exercise:
    """One image, one batch row, its positions (2, L) as the tower's model makes them
    (golden.verifier.towers: each tower's own drawing); a windowed layer (Qwen2.5-VL's, not in
    fullatt_block_indexes) under its windows' block mask, as the model computes them."""
    image = tower(c).draw(c)
    notes = list(notes) + [f"axial RoPE: exercised (one image of {image.rows} × {image.cols} "
                           f"patches, each turned by its row and column)"]
    mask = None
    if image.windows is not None and layer.index not in c.get("fullatt_block_indexes", ()):
        mask = image.windows[:, None] == image.windows[None, :]
        notes.append(f"Qwen2.5-VL's windows: exercised (the image spans "
                     f"{len(np.unique(image.windows))} windows, its patches in window order)")
    return Exercise(c, image.positions.shape[1], image.positions.astype(np.int64),
                    notes=notes, rows=1, mask=mask)


def _switch(c, layer_idx):
    """(rope_type, the length past which it switches) of the layer's RoPE scaling, where it
    switches (HF's fields: the layer type's entry of a per-type rope_parameters)."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    types = c.get("layer_types")
    if isinstance(types, list) and layer_idx < len(types) and isinstance(rope.get(types[layer_idx]),
                                                                          Mapping):
        rope = rope[types[layer_idx]]
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in SWITCHES or (kind == "dynamic" and rope.get("alpha")):
        return None  # HunYuan's "dynamic" with a fixed alpha: one θ at every length (ntk_alpha)
    at = (rope.get("original_max_position_embeddings")
          or c.get("original_max_position_embeddings") or c.get("max_position_embeddings"))
    return (kind, int(at)) if at else None

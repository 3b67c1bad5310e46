"""Inputs that exercise every setting of a layer that acts only past some length or position.

Eight drawn tokens prove nothing about a 512-key sliding window: with fewer tokens than the
window, windowed and full attention compute the same thing, and so would a converter that got
the window wrong. ``exercises(config, ours, max_length)`` gives, for one layer, the inputs
(their length, and positions where they matter) that reach each such setting, and says how:

- a sliding window of W keys (``sliding_window``) or chunks of C (``attention_chunk_size``):
  L = W + 3 (C + 3) tokens, so that the last queries see fewer keys than causal attention
  would. Where that is longer than ``max_length``, a scaled copy: the checkpoint's config with
  the window (chunk) set to ``SCALED`` (our converter and HF's module both given the copy),
  on L = SCALED + 3 tokens; the output says so.
- Llama 4's query temperature, 1 + β·ln(1 + ⌊(p + 1)/F⌋), is 1 below position F − 1: reached
  on L = F + 1 tokens, or on a scaled copy with F = ``SCALED``.
- a RoPE scaling that switches past a length (``longrope``'s long factors, ``dynamic``'s NTK
  rescaling, both past ``original_max_position_embeddings`` S): a second input whose
  positions run from S − L/2 past S (the first keeps 0 ... L − 1: both sides of the switch).
- T5's relative position buckets: L = max_distance + 2, so that the logarithmic buckets and
  the last, shared one are reached.

A scaled copy changes the checkpoint's config field and converts again; if the conversion does
not carry the new value through (it does not read that field), the setting is reported as not
exercised rather than as passing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from golden.hf import expected_state

BASE_LENGTH = 8   # the drawn inputs' length when no setting needs more
MAX_LENGTH = 640  # the longest input drawn (``attn-parity hf --max-length``)
SCALED = 6        # a window, chunk or temperature step set in a scaled copy of the config
PAST = 3          # tokens drawn beyond a window or chunk
SWITCHES = ("longrope", "dynamic")  # RoPE scalings that change past a length


@dataclass
class Exercise:
    """One input for a layer: the config it converts with (the checkpoint's, or a scaled copy),
    the length, the positions (None: 0 ... L − 1), the suffix of its rows' name, and notes on
    how each length-dependent setting is reached."""

    config: dict
    length: int
    positions: np.ndarray | None = None
    suffix: str = ""
    notes: list = field(default_factory=list)


# (our setting, the HF config field that sets it, what reaching it takes, its value in ours)
def _window(ours):
    return ours.get("sliding_window")


def _chunk(ours):
    return ours.get("attention_chunk_size")


def _floor(ours):
    t = ours.get("query_temperature")
    return t.get("floor_scale") if isinstance(t, dict) else None


LENGTHS = (("sliding_window", "sliding_window", _window, PAST),
           ("attention_chunk_size", "attention_chunk_size", _chunk, PAST),
           ("query temperature floor_scale", "floor_scale", _floor, 1))


def exercises(config, stack, layer, max_length=MAX_LENGTH, length=BASE_LENGTH
              ) -> list[Exercise]:
    """The inputs for ``layer`` (a golden.hf_preflight.Layer), at least ``length`` tokens: one,
    and a second with shifted positions for a RoPE scaling that switches past a length."""
    ours = layer.settings
    c, notes = dict(config), []
    for name, hf_field, value_of, past in LENGTHS:
        value = value_of(ours)
        if value is None:
            continue
        if value + past <= max_length:
            length = max(length, value + past)
            notes.append(f"{name} {value}: exercised (on {value + past} tokens or more)")
            continue
        scaled = dict(c, **{hf_field: SCALED})
        if value_of(_settings(scaled, stack, layer)) != SCALED:
            notes.append(f"{name} {value}: NOT exercised ({value + past} tokens are over "
                         f"--max-length {max_length}, and the conversion does not read "
                         f"{hf_field} to scale it)")
            continue
        c, length = scaled, max(length, SCALED + past)
        notes.append(f"{name} {value}: exercised as {SCALED} (on {SCALED + past} tokens or "
                     f"more; {value + past} tokens are over --max-length {max_length}: a copy of "
                     f"the config with {hf_field} = {SCALED})")
    buckets = ours.get("relative_attention_num_buckets")
    if buckets:
        reach = ours.get("relative_attention_max_distance", 128) + 2
        length = max(length, min(reach, max_length))
        notes.append(f"relative buckets (max_distance {reach - 2}): "
                     + ("exercised" if reach <= max_length else "partly exercised")
                     + f" (on {min(reach, max_length)} tokens or more)")
    if ours.get("dropout"):
        notes.append(f"dropout {ours['dropout']}: not exercised (the layer runs in inference "
                     f"mode, as HF's does)")
    first = Exercise(c, length, notes=notes)
    switch = _switch(ours)
    if switch is None:
        return [first]
    kind, at = switch
    positions = np.arange(length, dtype=np.int64) + max(at - length // 2, 0)
    first.notes.append(f"RoPE {kind} switch at {at}: exercised below it (positions from 0) "
                       f"and past it (positions from {positions[0]})")
    return [first, Exercise(c, length, positions, f" @ positions {positions[0]}-{positions[-1]}",
                            list(first.notes))]


def _switch(ours):
    """(rope_type, the length past which it switches) of a RoPE scaling that switches."""
    rope = ours.get("rope_parameters") or {}
    kind = rope.get("rope_type")
    if kind in SWITCHES and rope.get("original_max_position_embeddings"):
        return kind, int(rope["original_max_position_embeddings"])
    return None


def _settings(config, stack, layer) -> dict:
    """Our settings of the layer converted from ``config`` (its keys only)."""
    placeholders = {k: None for k in layer.keys}
    try:
        return expected_state(config, placeholders, layer_idx=layer.index, kind=stack.kind)[1]
    except ValueError:
        return {}

"""The conversion: ``FAMILIES`` (every kind's table: golden.hf.decoders, fused, encoders,
latent, vision, speech, hybrids, cross, blocks), the family lookup (a model_type's entry, an
encoder-decoder's ``kind``), and the API: ``from_hf``, ``to_hf``, ``expected_state`` (golden.hf's docstring says
what each takes).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from golden.specification import recurrent, variants
from golden.hf import (blocks, cross, decoders, encoders, fused, hybrids, latent, linear, speech,
                       vision)
from golden.hf.family import Family, HFConfig, Kinds, _as_dict
from golden.specification.mapping import _numpy


def _tables(*tables) -> dict:
    """One dict of the kinds' tables; a model_type in two of them is a mistake, named."""
    families = {}
    for table in tables:
        twice = set(families) & set(table)
        if twice:
            raise ValueError(f"model_type should be in one kind's table, got "
                             f"{', '.join(sorted(twice))} in two")
        families.update(table)
    return families


# model_type -> Family, or Kinds for a model_type with several attentions (an encoder-decoder)
FAMILIES: dict[str, Family | Kinds] = _tables(decoders.FAMILIES, fused.FAMILIES,
                                              encoders.FAMILIES, latent.FAMILIES,
                                              vision.FAMILIES, speech.FAMILIES,
                                              hybrids.FAMILIES, cross.FAMILIES,
                                              blocks.FAMILIES)
# Composite model_types (not converted themselves: from_hf takes a tower's own config): their
# towers' sub-configs and key prefixes, {model_type: {sub-config: key prefix}}.
COMPOSITES: dict[str, dict[str, str]] = {**encoders.COMPOSITES, **vision.COMPOSITES,
                                          **speech.COMPOSITES}
# model_types refused by name: {model_type: why}.
REFUSED: dict[str, str] = {**decoders.REFUSED, **vision.REFUSED, **speech.REFUSED,
                           **cross.REFUSED, **latent.REFUSED}


# model_type -> the Family of its linear-attention layers (golden.hf.linear: layer_types
# "linear_attention"; the model_type's FAMILIES entry, if any, converts its other layers).
LINEAR: dict[str, Family] = dict(linear.FAMILIES)


_spec = variants.lookup  # an attention variant's description or a recurrent mixer's


# ---- the family lookup --------------------------------------------------------------------------

def _family(mt) -> Family:
    if mt in REFUSED:
        raise ValueError(f"model_type {mt!r} is not supported: {REFUSED[mt]}")
    if mt not in FAMILIES:
        raise ValueError(f"model_type {mt!r} is not supported; supported: "
                         f"{', '.join(sorted(FAMILIES))}")
    return FAMILIES[mt]


def _kind(entry, mt, kind) -> Family:
    if not isinstance(entry, Kinds):
        if kind is not None:
            raise ValueError(f"model_type {mt!r}: kind should be None (one kind of attention "
                             f"converts), got {kind!r}")
        return entry
    if kind not in entry:
        raise ValueError(f"model_type {mt!r} has several attentions per layer: kind should be "
                         f"{' or '.join(map(repr, entry))}, got {kind!r}")
    return entry[kind]


def _kind_of_variant(entry, mt, variant, kind) -> Family:
    if not isinstance(entry, Kinds) or kind is not None:
        return _kind(entry, mt, kind)
    return next((f for f in entry.values() if f.variant == variant), next(iter(entry.values())))


# ---- the API ------------------------------------------------------------------------------------

def _resolve(config, state_dict, layer_idx, kind, rope_precision):
    """(model_type, Family, our configuration, the state dict) of a layer, checked: the
    settings come from the config and from which keys the state dict has (its arrays are not
    read, except by a family's ``call_site``, which gives the state dict as the layer computes
    with it: Zamba 2's adapters folded)."""
    c = _as_dict(config)
    mt = c.get("model_type")
    if not isinstance(layer_idx, int) or isinstance(layer_idx, bool) or layer_idx < 0:
        raise ValueError(f"layer_idx should be an int >= 0, got {layer_idx!r}")
    if mt in LINEAR and linear.is_linear(c, layer_idx):  # a hybrid's linear-attention layer
        family = _kind(LINEAR[mt], mt, kind)
    else:
        family = _kind(_family(mt), mt, kind)
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"state_dict should be a mapping of names to arrays, got "
                         f"{type(state_dict).__name__}")
    for name, (accepted, why) in family.unsupported.items():
        if c.get(name) not in accepted:
            raise ValueError(f"model_type {mt!r}: {name} = {c.get(name)!r} is not supported "
                             f"({why})")
    if family.call_site is not None:  # the arrays as this layer computes with them
        state_dict = family.call_site(c, layer_idx, state_dict)
    ours = family.settings(c, layer_idx, state_dict)
    takes = {a.name for a in _spec(family.variant).args}
    if rope_precision != "exact" and ("rope_parameters" in ours or "rope_theta" in ours):
        if "rope_precision" not in takes:
            raise ValueError(f"rope_precision should be 'exact' for model_type {mt!r} "
                             f"({family.variant} has only exact angles), got "
                             f"{rope_precision!r}")
        ours["rope_precision"] = rope_precision
    try:
        _spec(family.variant).config(ours)
    except (ValueError, TypeError) as e:
        raise ValueError(f"model_type {mt!r}: {e}") from None
    return mt, family, ours, state_dict


def expected_state(config, state_dict, *, layer_idx=0, kind=None) -> tuple[str, dict, dict]:
    """(variant, our configuration, {state-dict key: shape}) of a layer as ``from_hf`` would
    convert it: the keys and shapes of the arrays the config implies, from the config and
    which keys ``state_dict`` has (its values are not read: anything will do). Checking a
    checkpoint's headers against these before reading its arrays finds a missing key or a
    wrong shape without reading a byte of data."""
    mt, family, ours, _ = _resolve(config, state_dict, layer_idx, kind, "exact")
    spec = _spec(family.variant)
    full = spec.config(ours)
    key = (mt, kind, repr(sorted(full.items())))
    if key not in _SHAPES:  # placeholders of one byte an element, laid out by from_neutral
        zeros = {n: np.zeros(s, np.int8) for n, s in spec.shapes(full).items()}
        _SHAPES[key] = {k: tuple(a.shape) for k, a in family.from_neutral(zeros, full).items()}
    return family.variant, ours, dict(_SHAPES[key])


_SHAPES: dict = {}


def from_hf(config, state_dict, *, layer_idx=0, kind=None, rope_precision="exact"):
    """(variant, config, params) of one attention layer of a Hugging Face checkpoint: see
    golden.hf's docstring. ``kind`` says which attention of an encoder-decoder's layer
    ("encoder", "decoder" or "cross", see ``Kinds``); None for the families with one attention.
    ``rope_precision="hf"`` asks for HF's float32 RoPE angles (to compare with HF itself;
    "exact": float64 angles rounded once)."""
    mt, family, ours, state_dict = _resolve(config, state_dict, layer_idx, kind,
                                            rope_precision)
    params = family.to_neutral(state_dict, ours)
    spec = _spec(family.variant)
    shapes = spec.shapes(spec.config(ours))
    for name, shape in shapes.items():
        if name not in params:
            raise ValueError(f"model_type {mt!r}: no array for {name} (shape {shape})")
        if tuple(params[name].shape) != tuple(shape):
            raise ValueError(f"model_type {mt!r}: {name} should have shape {tuple(shape)} from "
                             f"the config, got {tuple(params[name].shape)}")
    extra = set(params) - set(shapes)
    if extra:
        raise ValueError(f"model_type {mt!r}: arrays the configuration has no place for: "
                         f"{', '.join(sorted(extra))}")
    return family.variant, HFConfig(ours, mt, kind), params


def to_hf(variant, config, params, *, model_type=None) -> dict:
    """The attention module's state dict (NumPy copies, the family's names and layouts) from
    our variant, configuration and parameters; ``model_type`` defaults to the one ``from_hf``
    recorded in ``config``."""
    mt = model_type if model_type is not None else getattr(config, "model_type", None)
    if mt is None:
        raise ValueError("model_type should be given (config did not come from from_hf), "
                         "got None")
    if variant in recurrent.MIXERS:  # a hybrid's linear-attention layer
        if mt not in LINEAR:
            raise ValueError(f"variant {variant!r} has no layers in model_type {mt!r}; the "
                             f"model_types with linear-attention layers: {', '.join(LINEAR)}")
        family = LINEAR[mt]
    else:
        family = _kind_of_variant(_family(mt), mt, variant, getattr(config, "kind", None))
    if variant != family.variant:
        raise ValueError(f"variant should be {family.variant!r} for model_type {mt!r}, got "
                         f"{variant!r}")
    ours = _spec(variant).config(dict(config))
    return family.from_neutral({n: _numpy(a) for n, a in params.items()}, ours)

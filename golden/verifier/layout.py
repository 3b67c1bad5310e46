"""Where a Hugging Face checkpoint's attention modules sit: each family's stacks of layers in
the state dict's keys (``LAYOUTS``), composite models' towers (``COMPOSITES``), the layers a
config implies (``expected_layers``), and the config read from ``config.json``.

A family's attention modules sit in one or more stacks: a decoder's ``layers.N.self_attn``;
T5's encoder self-attention, decoder self-attention and cross-attention, each converted with
its ``kind``; a composite CLIP's or SigLIP's two towers, each with its sub-config.

A hybrid model's ``linear_attention`` layers (``golden.hf.LINEAR``: Gated DeltaNet, Kimi Delta
Attention, lightning attention) sit in a stack of their own (``Stack.linear``, the family's
entry of ``golden.hf.LINEAR`` names it: ``layers.N.linear_attn``, or ``layers.N.self_attn``
beside the softmax layers'); a model_type whose linear layers convert but whose softmax layers
do not (Kimi Linear's latent attention, OLMo hybrid's) is read for its linear layers alone, the
others named in the notes.

Each family states its own in its entry of ``golden.hf.FAMILIES`` (``Family``'s or
``Kinds``' ``stacks``, ``hf_float64``, ``model_class``, ``own_index``); the tables below are
derived from those entries once, at import, and this module keeps only the reading of them.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from golden.hf import COMPOSITES, FAMILIES, LINEAR, REFUSED, Stack, _layer_type
from golden.hf.hybrids import layer_kinds
from golden.hf.linear import LINEAR as LINEAR_TYPE
from golden.hf.vision import OPTIONAL_TOWERS, UNREAD_TOWERS
from golden.verifier.checkpoint import CheckpointError

__all__ = ["COMPOSITES", "COUNTS", "FLOAT64", "LAYOUTS", "LINEAR_LAYOUTS", "MODELS", "OWN_INDEX",
           "Stack", "attention_layers", "expected_layers", "is_attention", "layer_count",
           "layer_name", "layouts", "other_kind", "other_layers",
           "read_config", "stacks", "unread_towers"]

# {model_type: (Stack, ...)}: where each family's attention modules sit in a checkpoint's keys
# (the layer number is the stack's index); a composite model (COMPOSITES, {model_type:
# {sub-config: key prefix}}) has each tower's under its prefix. A family without stacks (a
# Kinds that states none) is not here: the command refuses it by name.
LAYOUTS = {mt: entry.stacks for mt, entry in FAMILIES.items() if entry.stacks}
# {model_type: (Stack, ...)}: where a hybrid's linear-attention modules sit (each Stack.linear).
LINEAR_LAYOUTS = {mt: entry.stacks for mt, entry in LINEAR.items()}
# The families whose HF attention has no float32 step: their HF rows run at float64 too.
FLOAT64 = tuple(mt for mt, entry in FAMILIES.items() if entry.hf_float64)
# {model_type: transformers class name} of the configs AutoModel does not take.
MODELS = {mt: entry.model_class for mt, entry in FAMILIES.items() if entry.model_class}
# Families whose attention module reads its layer index (GPT-2): in the one-layer model it is
# built again with the layer's own index.
OWN_INDEX = tuple(mt for mt, entry in FAMILIES.items() if entry.own_index)


# transformers writes a float JSON has no literal for as {"__float__": "Infinity"} (Mamba-2's
# time_step_limit (0.0, inf)) and reads it back so.
SPECIAL_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def _special_floats(obj):
    """``obj`` with transformers' {"__float__": name} objects read as the floats they name."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in SPECIAL_FLOATS:
            return SPECIAL_FLOATS[obj["__float__"]]
        return {k: _special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_special_floats(v) for v in obj]
    return obj


def read_config(directory) -> dict:
    path = Path(directory) / "config.json"
    try:
        config = _special_floats(json.loads(path.read_text()))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: not JSON ({e})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{path}: should be a transformers config with a model_type")
    if config["model_type"] in COMPOSITES:
        for sub in COMPOSITES[config["model_type"]]:
            if config.get(sub) is None and sub in OPTIONAL_TOWERS.get(config["model_type"], ()):
                continue  # a tower this model does not have
            if not isinstance(config.get(sub), dict):
                raise CheckpointError(f"{path}: model_type {config['model_type']!r} is a "
                                      f"composite model: its {sub} should be a dict (the "
                                      f"tower's config), got {config.get(sub)!r}")
            if sub == "text_config" or _unconverted(config[sub]) is None:
                _supported(config[sub], config["model_type"])
            # else: a tower of a kind we do not convert (LLaVA's with another vision
            # encoder): not read, and unread_towers says so
        return config
    for sub in ("text_config", "decoder", "encoder_config"):  # composites: the tower they convert
        if config["model_type"] not in FAMILIES and isinstance(config.get(sub), dict):
            config = config[sub]
    _supported(config)
    return config


def layouts(mt) -> tuple:
    """The model_type's stacks: its softmax attention's (LAYOUTS), then its linear-attention
    layers' (LINEAR_LAYOUTS)."""
    return LAYOUTS.get(mt, ()) + LINEAR_LAYOUTS.get(mt, ())


def _unconverted(tower) -> str | None:
    """Why a tower's config is not converted (its model_type unknown, refused, or its
    family's checkpoints not read yet), None when it is."""
    mt = tower.get("model_type")
    entry = FAMILIES.get(mt)
    if entry is not None:
        return entry.unverified or None
    if mt in LINEAR:  # its linear-attention layers alone
        return None
    return REFUSED.get(mt, "its attention is not converted")


def _supported(config, composite=None):
    known = set(FAMILIES) | set(LINEAR)
    if composite is not None and config.get("model_type") not in known:
        raise CheckpointError(f"model_type {composite!r}: its text tower's model_type "
                              f"{config.get('model_type')!r} is not supported "
                              f"({_unconverted(config)}); supported: "
                              f"{', '.join(sorted(known))}")
    if config.get("model_type") not in known:
        raise CheckpointError(f"model_type {config.get('model_type')!r} is not supported; "
                              f"supported: {', '.join(sorted(known))}")
    if config["model_type"] in ("bert", "roberta") and config.get("add_cross_attention"):
        raise CheckpointError(f"model_type {config['model_type']!r}: add_cross_attention = "
                              f"True: its crossattention layers are not converted (from_hf "
                              f"reads its self-attention only), so not every layer would be "
                              f"checked")
    entry = FAMILIES.get(config["model_type"])
    if entry is not None and entry.unverified:
        raise CheckpointError(f"model_type {config['model_type']!r}: {entry.unverified}")
    if not layouts(config["model_type"]):
        raise CheckpointError(f"model_type {config['model_type']!r}: attn-parity hf does not "
                              f"know where its attention modules sit (it reads "
                              f"{', '.join(sorted(set(LAYOUTS) | set(LINEAR_LAYOUTS)))})")


def stacks(config) -> list:
    """[(the config the stack converts with, Stack)]: a composite model's towers each with
    its own sub-config and key prefix."""
    if config["model_type"] not in COMPOSITES:
        return [(config, stack) for stack in layouts(config["model_type"])]
    return [(config[sub], replace(stack, within=within, label=stack.label or _tower_label(sub)))
            for sub, within in COMPOSITES[config["model_type"]].items()
            if config.get(sub) is not None  # an optional tower left out (OPTIONAL_TOWERS)
            and _unconverted(config[sub]) is None  # not converted: unread_towers' note
            for stack in layouts(config[sub]["model_type"])]


def _tower_label(sub) -> str:
    """The rows' label of a composite's tower whose stack has none of its own: "" for the text
    tower, else the sub-config's name ("vision_config": "vision"), so that two towers' layers
    never share a row's name (a LLaVA's DINOv2 tower beside its text tower)."""
    return "" if sub == "text_config" else sub.removesuffix("_config")


def unread_towers(config) -> list[str]:
    """The report's notes on a composite model's towers that are not read (Gemma 4's audio
    encoder, InternVL's vision tower, Idefics 2's perceiver): each sub-config that COMPOSITES
    does not list or whose model_type is not converted, with why."""
    read = COMPOSITES.get(config["model_type"])
    if read is None:
        return []
    notes = []
    for sub, tower in config.items():
        if not isinstance(tower, dict) or "model_type" not in tower:
            continue
        why = _unconverted(tower)
        if sub not in read and why is None:  # a converted kind, not where it sits
            why = UNREAD_TOWERS.get((config["model_type"], sub), "its attention is not converted")
        if why is not None:
            notes.append(f"{sub} ({tower['model_type']}): not checked: {why}")
    return notes


def attention_layers(stack, keys) -> dict:
    """{layer index: key prefix of its attention module} of the stack, from the checkpoint's
    keys (empty when the checkpoint has no such stack: T5EncoderModel's has no decoder)."""
    pattern = stack.pattern()
    layers = {}
    for key in keys:
        m = pattern.match(key)
        if m:
            layers.setdefault(int(m.group(2)), m.group(1))
    return dict(sorted(layers.items()))


# The config fields that count a stack's layers, first found first: by kind (an encoder-
# decoder's), else a decoder's or an encoder's own (GPT-2's n_layer, MPT's n_layers).
COUNTS = {"encoder": ("encoder_layers", "num_layers"),
          "decoder": ("decoder_layers", "num_decoder_layers", "num_layers"),
          "cross": ("decoder_layers", "num_decoder_layers", "num_layers"),
          None: ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "depth")}


def layer_count(config, stack) -> tuple[str, int] | None:
    """(the config field, its value): how many layers the stack has, as the config says."""
    for field in COUNTS[stack.kind]:
        if isinstance(config.get(field), int) and not isinstance(config[field], bool):
            return field, config[field]
    return None


def is_attention(layer_type) -> bool:
    """Whether a ``layer_types`` entry is a softmax attention layer ("full_attention",
    "sliding_attention", "chunked_attention", a hybrid model's "hybrid" layer with attention
    beside its Mamba, MiniMax M3's "minimax_m3_sparse" with its block indexer; not Qwen3-Next's
    or a hybrid's Mamba "linear_attention", nor RecurrentGemma's "recurrent", Nemotron-H's
    "mlp" or "moe")."""
    return (isinstance(layer_type, str) and (layer_type.endswith("attention")
                                             or layer_type in ("hybrid", "minimax_m3_sparse"))
            and not layer_type.startswith("linear"))


def _types(config, stack) -> list:
    """Each layer's kind as the config says: a hybrid model's from its own fields
    (golden.hf.hybrids.layer_kinds), else ``layer_types`` (a decoder's); [] when it says
    none."""
    if stack.kind not in (None, "decoder"):
        return []
    kinds = layer_kinds(config) if stack.kind is None else None
    types = kinds if kinds is not None else config.get("layer_types")
    return types if isinstance(types, list) else []


def _linear(config, types, i) -> bool:
    """Whether layer ``i`` is a linear-attention layer the model_type converts (LINEAR)."""
    return config.get("model_type") in LINEAR and i < len(types) and types[i] == LINEAR_TYPE



def other_layers(config, stack) -> dict:
    """{kind: [layer index, ...]} of the stack's layers the config says are not softmax
    attention (a hybrid's Mamba, RG-LRU, MLP or MoE layers; linear_attention where the
    model_type's are not converted): the report names them, unchecked. A linear stack names
    the softmax layers where its model_type has no softmax stack (their attention is not
    converted: Kimi Linear's latent attention)."""
    others, types = {}, _types(config, stack)
    if stack.linear:
        if config.get("model_type") in LAYOUTS:
            return {}
        for i, kind in enumerate(types):
            if kind != LINEAR_TYPE:
                others.setdefault(str(kind), []).append(i)
        return others
    for i, kind in enumerate(types):
        if not is_attention(kind) and not _linear(config, types, i):
            others.setdefault(str(kind), []).append(i)
    return others


def other_kind(config, stack) -> set[int]:
    """The indices of the layers of the other stack of a hybrid model (its linear-attention
    layers for a softmax stack, and the reverse): neither checked here nor beyond the
    count."""
    types = _types(config, stack)
    return {i for i in range(len(types)) if _linear(config, types, i) != stack.linear}


def expected_layers(config, stack) -> list[int] | None:
    """The indices of the stack's attention layers that the config implies (its layer count,
    less the layers its ``layer_types`` says are not softmax attention; of a linear stack,
    its ``linear_attention`` layers); None when the config gives no count."""
    count = layer_count(config, stack)
    if count is None:
        return None
    types = _types(config, stack)
    if stack.linear:
        return [i for i in range(count[1]) if _linear(config, types, i)]
    return [i for i in range(count[1]) if i >= len(types) or is_attention(types[i])]


def layer_name(config, stack, layer_idx) -> str:
    """The rows' name of a layer: "layer 3 (sliding_attention)", "decoder layer 1 (cross)",
    "vision layer 0 (attention)"."""
    types = _types(config, stack) if layer_kinds(config) is not None else []
    kind = stack.kind or (types[layer_idx] if layer_idx < len(types) else
                          _layer_type(config, layer_idx)) or "attention"
    return f"{stack.label + ' ' if stack.label else ''}layer {layer_idx} ({kind})"



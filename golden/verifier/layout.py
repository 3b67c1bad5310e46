"""Where a Hugging Face checkpoint's attention modules sit: each family's stacks of layers in
the state dict's keys (``LAYOUTS``), composite models' towers (``COMPOSITES``), the layers a
config implies (``expected_layers``), and the config read from ``config.json``.

A family's attention modules sit in one or more stacks: a decoder's ``layers.N.self_attn``;
T5's encoder self-attention, decoder self-attention and cross-attention, each converted with
its ``kind``; a composite CLIP's or SigLIP's two towers, each with its sub-config.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from golden.hf import FAMILIES, T5_TABLE, _layer_type
from golden.verifier.checkpoint import CheckpointError


@dataclass(frozen=True)
class Stack:
    """One stack of attention modules in a checkpoint's keys, e.g. "model.layers.3.self_attn.
    q_proj.weight" is ``Stack("layers", "self_attn")``'s layer 3 (any prefix before the stack,
    ``within`` required just before it: a composite model's "text_model."). ``kind``:
    from_hf's (None for a family with one kind); ``output``: the submodule whose output is the
    attention's when not the module's own; ``shared``: layer 0's array the later layers of the
    stack are converted with (T5's position bias table); ``label`` begins the rows' names;
    ``renames``: (the file's, the module's) key prefixes where transformers saves the module's
    arrays under older names (ViT), and ``in_model`` (stack, module) where the module sits in
    transformers' model when not where the file's keys say."""

    stack: str
    module: str
    kind: str | None = None
    output: str | None = None
    shared: str | None = None
    label: str = ""
    within: str = ""
    renames: tuple = ()
    in_model: tuple | None = None

    def rename(self, key):
        """The module's name of a state-dict key of the file."""
        for old, new in self.renames:
            if key.startswith(old):
                return new + key[len(old):]
        return key

    def file_name(self, key):
        """The file's name of a module's state-dict key (``rename`` undone)."""
        for old, new in self.renames:
            if key.startswith(new):
                return old + key[len(new):]
        return key

    def pattern(self, layer=r"\d+"):
        """A key's match: group 1 the module's prefix (with its dot), group 2 the layer."""
        return re.compile(rf"^(.*?(?:^|\.){re.escape(self.within + self.stack)}\.({layer})\."
                          rf"{re.escape(self.module)}\.)")


# Where each family's attention modules sit in a checkpoint's keys (the layer number is the
# stack's index); a composite model (COMPOSITES) has each tower's under its prefix.
DECODERS = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_next", "starcoder2",
            "granite", "smollm3", "olmo", "olmo2", "gemma2", "gemma3_text", "cohere", "gpt_oss",
            "llama4_text", "deepseek_v3", "phi3", "stablelm")


def _seq2seq(stack, module, cross):
    """Whisper's and BART's (encoder and decoder "layers"), T5's ("block") three stacks."""
    shared = T5_TABLE if stack == "block" else None
    return (Stack(f"encoder.{stack}", module, "encoder", shared=shared, label="encoder"),
            Stack(f"decoder.{stack}", module, "decoder", shared=shared, label="decoder"),
            Stack(f"decoder.{stack}", cross, "cross", label="decoder"))


LAYOUTS = {**{mt: (Stack("layers", "self_attn"),) for mt in DECODERS},
           "gpt2": (Stack("h", "attn"),), "gpt_neox": (Stack("layers", "attention"),),
           "falcon": (Stack("h", "self_attention"),), "mpt": (Stack("blocks", "attn"),),
           # BLOOM adds the residual inside its attention: ours is the output of its dense
           "bloom": (Stack("h", "self_attention", output="dense"),),
           # BERT's LayerNorm(dense(a) + x) after it is not attention: ours is dense's output
           **{mt: (Stack("encoder.layer", "attention", output="output.dense"),)
              for mt in ("bert", "roberta")},
           # ViT's modules (5.x) are q_proj ... o_proj on layers.N.attention; save_pretrained
           # writes (as every published checkpoint has) the 4.x names of the same arrays
           "vit": (Stack("encoder.layer", "attention", in_model=("layers", "attention"),
                         renames=(("attention.query.", "q_proj."), ("attention.key.", "k_proj."),
                                  ("attention.value.", "v_proj."), ("output.dense.", "o_proj."))),),
           **{f"{m}_{t}_model": (Stack("encoder.layers", "self_attn", label=t),)
              for m in ("clip", "siglip") for t in ("text", "vision")},
           "whisper": _seq2seq("layers", "self_attn", "encoder_attn"),
           "bart": _seq2seq("layers", "self_attn", "encoder_attn"),
           "t5": _seq2seq("block", "layer.0.SelfAttention", "layer.1.EncDecAttention")}
# Composite models: their towers' sub-configs and the towers' key prefixes.
COMPOSITES = {mt: {"text_config": "text_model.", "vision_config": "vision_model."}
              for mt in ("clip", "siglip")}
# The families whose HF attention has no float32 step (no RoPE, ALiBi or float32 norm): their
# HF rows run at float64 too.
FLOAT64 = ("bert", "roberta", "vit", "clip_text_model", "clip_vision_model",
           "siglip_text_model", "siglip_vision_model", "whisper", "bart", "t5")
# The transformers class of a config AutoModel does not take.
MODELS = {"siglip_text_model": "SiglipTextModel"}
# Families whose attention module reads its index in the whole model beyond layer_types (GPT-2's
# scale_attn_by_inverse_layer_idx: GPT2Attention's scaling is divided by layer_idx + 1): in the
# one-layer model it is built again with the layer's own index.
OWN_INDEX = ("gpt2",)


def read_config(directory) -> dict:
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: not JSON ({e})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{path}: should be a transformers config with a model_type")
    if config["model_type"] in COMPOSITES:
        for sub in COMPOSITES[config["model_type"]]:
            _supported(config.get(sub) if isinstance(config.get(sub), dict) else {})
        return config
    for sub in ("text_config", "decoder"):  # composite models: the decoder's own config
        if config["model_type"] not in FAMILIES and isinstance(config.get(sub), dict):
            config = config[sub]
    _supported(config)
    return config


def _supported(config):
    if config.get("model_type") not in FAMILIES:
        raise CheckpointError(f"model_type {config.get('model_type')!r} is not supported; "
                              f"supported: {', '.join(sorted(FAMILIES))}")
    if config["model_type"] in ("bert", "roberta") and config.get("add_cross_attention"):
        raise CheckpointError(f"model_type {config['model_type']!r}: add_cross_attention = "
                              f"True: its crossattention layers are not converted (from_hf "
                              f"reads its self-attention only), so not every layer would be "
                              f"checked")
    if config["model_type"] not in LAYOUTS:
        raise CheckpointError(f"model_type {config['model_type']!r}: attn-parity hf does not "
                              f"know where its attention modules sit (it reads "
                              f"{', '.join(sorted(LAYOUTS))})")


def stacks(config) -> list:
    """[(the config the stack converts with, Stack)]: a composite model's towers each with
    its own sub-config and key prefix."""
    if config["model_type"] not in COMPOSITES:
        return [(config, stack) for stack in LAYOUTS[config["model_type"]]]
    return [(config[sub], replace(stack, within=within))
            for sub, within in COMPOSITES[config["model_type"]].items()
            for stack in LAYOUTS[config[sub]["model_type"]]]


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
          None: ("num_hidden_layers", "n_layer", "n_layers", "num_layers")}


def layer_count(config, stack) -> tuple[str, int] | None:
    """(the config field, its value): how many layers the stack has, as the config says."""
    for field in COUNTS[stack.kind]:
        if isinstance(config.get(field), int) and not isinstance(config[field], bool):
            return field, config[field]
    return None


def is_attention(layer_type) -> bool:
    """Whether a ``layer_types`` entry is a softmax attention layer ("full_attention",
    "sliding_attention", "chunked_attention"; not Qwen3-Next's "linear_attention")."""
    return (isinstance(layer_type, str) and layer_type.endswith("attention")
            and not layer_type.startswith("linear"))


def expected_layers(config, stack) -> list[int] | None:
    """The indices of the stack's attention layers that the config implies (its layer count,
    less the layers its ``layer_types`` says are not softmax attention); None when the config
    gives no count."""
    count = layer_count(config, stack)
    if count is None:
        return None
    types = config.get("layer_types") if stack.kind in (None, "decoder") else None
    types = types if isinstance(types, list) else []
    return [i for i in range(count[1]) if i >= len(types) or is_attention(types[i])]


def layer_name(config, stack, layer_idx) -> str:
    """The rows' name of a layer: "layer 3 (sliding_attention)", "decoder layer 1 (cross)",
    "vision layer 0 (attention)"."""
    kind = stack.kind or _layer_type(config, layer_idx) or "attention"
    return f"{stack.label + ' ' if stack.label else ''}layer {layer_idx} ({kind})"



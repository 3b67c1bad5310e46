"""``attn-parity hf DIR``: every attention layer of a local Hugging Face checkpoint, converted
(golden.hf.from_hf) and checked.

It reads ``DIR/config.json`` and the ``*.safetensors`` files with the safetensors package's
NumPy API (torch is not needed to read them, nothing is unpickled), one layer at a time (only
that layer's arrays are read: memory is bounded by a layer). A family's attention modules sit
in one or more stacks (``LAYOUTS``: a decoder's ``layers.N.self_attn``; T5's encoder
self-attention, decoder self-attention and cross-attention, each converted with its ``kind``;
a composite CLIP's or SigLIP's two towers, each with its sub-config). For each layer it builds
an in-memory fixture on drawn inputs x (B, L, D), and a cross-attention's context (B, LC, D):
the float64 reference's output, weights and gradients with the layer's weights. Then, as
``attn-parity check`` does, each installed twin runs it at float32 and float64 against the
tolerance table, and, when transformers and torch are installed, the checkpoint's own Hugging
Face attention module does too (a one-layer model of the same configuration holding this
layer's weights, the attention's input replaced by x, an encoder-decoder given the context as
its encoder's output, its output read by a hook, so the model's own masks, positions and
position bias are used): at float32, and at float64 too for the families with no float32
step in HF (``FLOAT64``; the others compute RoPE's angles, ALiBi's slopes or norms in float32).

Exit status: 0 when every row passed, 1 when any failed, 2 for a directory that cannot be
read (no config.json, a corrupt or foreign safetensors file, a model_type or setting we do
not convert: the message names it).
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from golden import check, reference, variants
from golden.fixture import Fixture
from golden.hf import FAMILIES, T5_TABLE, _layer_type, from_hf
from golden.runners import FRAMEWORKS

B, L, LC = 2, 8, 5  # the drawn inputs' batch, length and (cross-attention) context length


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


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read or converted."""


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


class Arrays:
    """The checkpoint's arrays by key, read lazily from its safetensors files (NumPy)."""

    def __init__(self, directory):
        from safetensors import SafetensorError, safe_open

        files = sorted(Path(directory).glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{directory}: no *.safetensors file (pickled checkpoints "
                                  f"are not read)")
        self._open, self._where = {}, {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="np")
                keys = list(handle.keys())
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
            self._open[path] = handle
            self._where.update({k: path for k in keys})
        self._error = SafetensorError

    def keys(self):
        return self._where.keys()

    def get(self, key) -> np.ndarray:
        path = self._where[key]
        try:
            handle = self._open[path]
            if handle.get_slice(key).get_dtype() == "BF16":  # NumPy has no bfloat16
                return _bfloat16(path, key)
            return handle.get_tensor(key)
        except (self._error, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: {key} cannot be read ({e})") from None


def _bfloat16(path, key) -> np.ndarray:
    """A BF16 array of a safetensors file as float32 (exact: bfloat16 is float32's upper 16
    bits), read from the file's own header (8-byte length, JSON, then the data)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        entry = header[key]
        begin, end = entry["data_offsets"]
        count = int(np.prod(entry["shape"], dtype=np.int64))
        if end - begin != 2 * count:
            raise ValueError(f"{key}: {end - begin} bytes for {count} bfloat16 values")
        f.seek(8 + size + begin)
        raw = np.frombuffer(f.read(end - begin), dtype="<u2")
        if raw.size != count:
            raise ValueError(f"{key}: the file ends before its data")
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(entry["shape"])


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


def plan(config, keys) -> list:
    """[(config, Stack, its layers)] of every stack of the family the checkpoint has."""
    found = [(c, stack, attention_layers(stack, keys)) for c, stack in stacks(config)]
    if not any(layers for _, _, layers in found):
        forms = " or ".join(f"'...{s.within}{s.stack}.N.{s.module}.*'" for _, s, _ in found)
        raise CheckpointError(f"no attention layer found: no key of the form {forms} "
                              f"(model_type {config['model_type']!r})")
    return [entry for entry in found if entry[2]]


def layer_state(arrays, stack, layers, layer_idx) -> dict:
    """The layer's attention state dict (keys as the module names them), with layer 0's
    shared array where the stack shares one and the layer has none of its own."""
    prefix = layers[layer_idx]
    state_dict = {stack.rename(k[len(prefix):]): arrays.get(k) for k in arrays.keys()
                  if k.startswith(prefix)}
    if stack.shared and stack.shared not in state_dict and 0 in layers:
        key = layers[0] + stack.shared
        if key in arrays.keys():
            state_dict[stack.shared] = arrays.get(key)
    return state_dict


def layer_name(config, stack, layer_idx) -> str:
    """The rows' name of a layer: "layer 3 (sliding_attention)", "decoder layer 1 (cross)",
    "vision layer 0 (attention)"."""
    kind = stack.kind or _layer_type(config, layer_idx) or "attention"
    return f"{stack.label + ' ' if stack.label else ''}layer {layer_idx} ({kind})"


def _drawn(rng, shape):
    return rng.standard_normal(shape).astype(np.float32).astype(np.float64)


def layer_fixture(config, stack, layer_idx, state_dict, rng) -> Fixture:
    """The layer's converted weights on drawn inputs (x (B, L, D), and a cross-attention's
    context (B, LC, D)), with the float64 reference's results."""
    variant, ours, params = from_hf(config, state_dict, layer_idx=layer_idx, kind=stack.kind)
    params = {n: np.asarray(a, np.float64) for n, a in params.items()}
    spec = variants.VARIANTS[variant]
    full = spec.config(dict(ours))
    inputs = {i.name: _drawn(rng, (B, L if i.side == "query" else LC, full[i.width]))
              for i in spec.inputs if not i.optional}
    forward, backward = reference.VARIANTS[variant]
    out, weights, saved = forward(dict(ours), inputs, params)
    cot = {"output": _drawn(rng, out.shape), "weights": _drawn(rng, weights.shape)}
    grads = backward(saved, cot["output"], cot["weights"])
    return Fixture(name=layer_name(config, stack, layer_idx), variant=variant, seed=0,
                   config=dict(ours), inputs=inputs, dtypes=["float32", "float64"],
                   params=params, cotangents=cot, expected={"output": out, "weights": weights},
                   grads=grads, zero=reference.zero_grads(dict(ours), grads))


def hf_runner(config, stack, layer_idx, state_dict):
    """A runner of the checkpoint's own HF attention module for this layer: float32, and
    float64 too for the FLOAT64 families."""
    from golden.runners.adapt import NotSupported, Runner

    def run(fixture, dtype):
        if dtype != "float32" and config["model_type"] not in FLOAT64:
            raise NotSupported("HF computes RoPE's angles (or ALiBi's slopes, norms) in "
                               "float32: compared at float32")
        return {"output": _hf_output(config, stack, state_dict, fixture.inputs, dtype,
                                     layer_idx),
                "dtype": dtype}

    return Runner("hf", "torch", run)


VOCAB = 8  # the one-layer model's: its tokens are all 0
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "num_decoder_layers", "encoder_layers",
                "decoder_layers")


def _one_layer_config(config):
    """The config with one layer in each stack (the layer's own settings at index 0)."""
    import transformers

    c = dict(config)
    pad = c.get("pad_token_id")  # RoBERTa's positions need it; the input's tokens are 0
    c.update(pad_token_id=pad if isinstance(pad, int) and 0 < pad < VOCAB else None,
             bos_token_id=None, eos_token_id=None,
             max_window_layers=0 if c.get("max_window_layers") else None)
    c = {k: v for k, v in c.items() if v is not None or k in ("pad_token_id",)}
    model_type = c.pop("model_type")
    names = getattr(transformers.CONFIG_MAPPING[model_type], "attribute_map", {})
    for count in LAYER_COUNTS:
        if count in c or count == "num_hidden_layers":
            c[names.get(count, count)] = 1  # GPT-2's n_layer, ...
    c[names.get("vocab_size", "vocab_size")] = VOCAB
    return transformers.AutoConfig.for_model(model_type, **c)


def _layer_only(config, layer_idx):
    """The config as layer ``layer_idx`` sees it: its entries of layer_types and
    no_rope_layers."""
    c = dict(config)
    for key in ("layer_types", "no_rope_layers"):
        if isinstance(c.get(key), list):
            c[key] = [c[key][layer_idx]]
    return c


class _Stop(Exception):
    """Raised by the output hook: the attention's output is read, the rest need not run."""


def _one_layer_model(config, dtype):
    import transformers

    hf_config = _one_layer_config(config)
    hf_config._experts_implementation = "eager"
    make = (getattr(transformers, MODELS[config["model_type"]])
            if config["model_type"] in MODELS else transformers.AutoModel.from_config)
    for attention in ("sdpa", "eager"):
        hf_config._attn_implementation = attention
        try:
            return make(hf_config).to(dtype).eval()
        except ValueError:  # this family has no sdpa path
            continue
    raise CheckpointError(f"model_type {config['model_type']!r}: transformers builds no model")


def _model_inputs(model, stack, inputs, dtype) -> dict:
    """The one-layer model's inputs, zeros (the attention's input is replaced): token ids of
    the drawn length, an image or features of the config's size; an encoder-decoder's decoder
    tokens and, for a decoder's attention, in place of its encoder's output the drawn context
    (or zeros)."""
    import torch

    c = model.config
    main = model.main_input_name
    shapes = {"input_ids": lambda: (B, L),
              "pixel_values": lambda: (B, c.num_channels, c.image_size, c.image_size),
              "input_features": lambda: (B, c.num_mel_bins, 2 * c.max_source_positions)}
    given = {main: torch.zeros(shapes[main](), dtype=torch.long if main == "input_ids" else dtype)}
    if "use_cache" in inspect.signature(model.forward).parameters:
        given["use_cache"] = False
    if getattr(c, "is_encoder_decoder", False):
        given["decoder_input_ids"] = torch.zeros((B, L), dtype=torch.long)
    if getattr(c, "is_encoder_decoder", False) and stack.kind != "encoder":
        context = inputs.get("context", np.zeros((B, LC, inputs["x"].shape[-1])))
        given["encoder_outputs"] = (torch.from_numpy(np.asarray(context)).to(dtype),)
    return given


def _hf_output(config, stack, state_dict, inputs, dtype_name, layer_idx=0):
    """The HF attention module's output on the fixture's inputs: a one-layer model of the
    config, the layer's weights loaded into its attention, x fed in place of the attention's
    input by a pre-hook (a cross-attention's context is the encoder output the model is
    given), the output read by a hook, which ends the forward there."""
    import torch

    dtype = getattr(torch, dtype_name)
    model = _one_layer_model(config, dtype)
    where = stack.in_model or (stack.stack, stack.module)
    attn = _module(model, Stack(*where))
    if config["model_type"] in OWN_INDEX:  # built again with the layer's own index
        name = next(n for n, m in model.named_modules() if m is attn)
        parent, _, child = name.rpartition(".")
        attn = type(attn)(model.config, layer_idx=layer_idx).to(dtype).eval()
        setattr(model.get_submodule(parent), child, attn)
    own = attn.state_dict()
    missing = sorted(set(own) - set(state_dict))
    if missing:
        raise CheckpointError(f"{stack.stack}.N.{stack.module}: the checkpoint has no "
                              f"{', '.join(missing)}")
    attn.load_state_dict({k: torch.from_numpy(np.asarray(state_dict[k])).to(dtype)
                          for k in own}, strict=True)
    fed = torch.from_numpy(np.asarray(inputs["x"])).to(dtype)
    seen = {}

    def feed(mod, args, kwargs):
        if "hidden_states" in kwargs:
            return args, dict(kwargs, hidden_states=fed)
        return (fed,) + tuple(args[1:]), kwargs

    def read(mod, args, kwargs, out):
        out = out if isinstance(out, torch.Tensor) else out[0]
        seen["out"] = out.detach().numpy().astype(np.float64)
        raise _Stop

    read_from = attn if stack.output is None else attn.get_submodule(stack.output)
    handles = [attn.register_forward_pre_hook(feed, with_kwargs=True),
               read_from.register_forward_hook(read, with_kwargs=True)]
    try:
        with torch.no_grad():
            model(**_model_inputs(model, stack, inputs, dtype))
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    if "out" not in seen:
        raise RuntimeError(f"the one-layer model's forward did not run its {stack.module}")
    return seen["out"]


def _module(model, stack):
    """The one-layer model's attention module of the stack (its layer 0)."""
    pattern = stack.pattern("0")
    found = [m for name, m in model.named_modules()
             if (match := pattern.match(name + ".")) and match.group(1) == name + "."]
    if len(found) != 1:
        raise CheckpointError(f"the one-layer {type(model).__name__} has "
                              f"{len(found)} modules '...{stack.stack}.0.{stack.module}'")
    return found[0]


def _hf_available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def run(directory, *, frameworks=(), with_hf=True, log=print, progress=None, seed=0,
        weights=None) -> dict:
    """The report (golden.report's format) of every attention layer of the checkpoint;
    ``weights``, a dict, receives each layer's attention weights for the HTML page."""
    config = read_config(directory)
    arrays = Arrays(directory)
    rng = np.random.default_rng(seed)
    with_hf = with_hf and _hf_available()
    report = None
    for c, stack, layers, layer_idx in _bar(plan(config, arrays.keys()), progress):
        state_dict = layer_state(arrays, stack, layers, layer_idx)
        try:
            fixture = layer_fixture(c, stack, layer_idx, state_dict, rng)
        except ValueError as e:
            raise CheckpointError(f"{layer_name(c, stack, layer_idx)}: {e}") from None
        impls = ([hf_runner(_layer_only(c, layer_idx), stack, layer_idx, state_dict)]
                 if with_hf else [])
        part = check.run([fixture], frameworks=list(frameworks) or list(FRAMEWORKS), impls=impls,
                         regeneration=False, weights=weights, progress=False)
        for row in part["rows"]:
            row["model_type"] = c["model_type"]
            log(row)
        if report is None:
            report = part
        else:
            report["rows"] += part["rows"]
            report["implementations"] = sorted(set(report["implementations"])
                                               | set(part["implementations"]))
    report["command"] = f"attn-parity hf {directory}"
    report["summary"] = check._summary(report, sum(r["seconds"] for r in report["rows"]))
    return report


def _bar(stacks_found, progress):
    """(config, stack, layers, layer index) of every layer of every stack, with a progress bar
    on a terminal."""
    every = [(c, stack, layers, i) for c, stack, layers in stacks_found for i in layers]
    if progress is False or not sys.stderr.isatty():
        return every
    try:
        from tqdm import tqdm
    except ImportError:
        return every
    return tqdm(every, desc="layers", unit="layer", file=sys.stderr)


def _line(row) -> str:
    rel = "—" if row["max_rel"] is None else f"{row['max_rel']:.1e}"
    reason = f"  ({row['reason']})" if row["reason"] and row["status"] != "pass" else ""
    label = row["implementation"] + (f" {row['core']}" if row["core"] else "")
    return (f"{row['model_type']:<12} {row['fixture']:<28} {label:<22} "
            f"{row['dtype']:<8} {rel:>8}  {row['status']}{reason}")


def main(args) -> int:
    weights = {} if args.html else None
    try:
        report = run(args.directory, frameworks=args.framework, with_hf=not args.no_hf,
                     log=lambda row: print(_line(row)), weights=weights)
    except CheckpointError as e:
        print(f"attn-parity hf: error: {e}", file=sys.stderr)
        return 2
    s = report["summary"]
    print(f"{s['passed']} passed, {s['failed'] + s['errors']} failed"
          + (f" ({s['not_supported']} not supported)" if s["not_supported"] else ""))
    check._write_reports(report, weights, args.json, args.junit, args.html, None, print)
    return 0 if s["ok"] else 1


def add_arguments(parser) -> None:
    parser.add_argument("directory", help="a local checkpoint: config.json and *.safetensors")
    parser.add_argument("--framework", action="append", choices=FRAMEWORKS, default=[],
                        help="only this framework (repeatable; default: all installed)")
    parser.add_argument("--no-hf", action="store_true",
                        help="do not run the checkpoint's own transformers modules")
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON")
    parser.add_argument("--junit", metavar="FILE", help="write the report as JUnit XML")
    parser.add_argument("--html", metavar="DIR", help="write an HTML page")


def _cli(argv=None) -> int:  # python -m golden.hf_check DIR
    parser = argparse.ArgumentParser(prog="attn-parity hf", description=__doc__)
    add_arguments(parser)
    return main(parser.parse_args(argv))

"""The checkpoint's own Hugging Face attention module, run on a layer fixture's inputs: the
``hf`` rows of ``attn-parity hf``.

A one-layer model of the layer's configuration holds the layer's weights in its attention; the
attention's input is replaced by the fixture's x (a cross-attention's key_value_states are the
drawn context, given to the model as its encoder's output; a decoder's positions, where the
fixture has them, are the model's ``position_ids``), and its output is read by a hook, so the
model's own masks, positions and position bias are used. One model is built per configuration
and dtype and reused for every layer that shares them (``Models``); transformers' messages
about these internal models (their token ids, ...) are silenced: they are not the user's.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import warnings

import numpy as np

from golden.verifier.checkpoint import CheckpointError
from golden.verifier.layout import COUNTS, FLOAT64, MODELS, OWN_INDEX, Stack
from golden.verifier.speech import encoder
from golden.verifier.towers import tower

VOCAB = 8  # the one-layer model's: its tokens are all 0
# Every field that counts a stack's layers (golden.verifier.layout.COUNTS): each set to 1.
LAYER_COUNTS = tuple(dict.fromkeys(field for fields in COUNTS.values() for field in fields))
# Config fields of the checkpoint that the one-layer model must not take: quantisation (the
# weights it gets are already dequantised, in float).
# A backbone's stage selection (DINOv3's) names the checkpoint's stages: the one-layer model
# derives its own.
DROPPED = ("quantization_config", "out_features", "out_indices", "stage_names")


def available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def quiet():
    """transformers' logging and Python warnings silenced (around the tool's own models)."""
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(level)


def check_config(config, log) -> None:
    """Build transformers' config of the checkpoint once, its warnings (about the user's
    config) passed to ``log``; a config transformers refuses is a CheckpointError."""
    import transformers

    logger = logging.getLogger("transformers")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    handlers, logger.handlers = logger.handlers, [handler]  # said once, by log
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c = {k: v for k, v in config.items() if k not in DROPPED}
            transformers.AutoConfig.for_model(c.pop("model_type"), **c)
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"config.json: transformers refuses it "
                              f"({type(e).__name__}: {e})") from None
    finally:
        logger.handlers = handlers
    for message in dict.fromkeys(seen + [str(w.message) for w in caught]):
        log(f"warning: config.json (transformers says): {message.strip()}")


def runner(models, config, stack, layer_idx, state_dict, seen=None, positions=None):
    """A runner of the checkpoint's own HF attention module for this layer: float32, and
    float64 too for the FLOAT64 families; ``seen`` (a dict) keeps each dtype's output;
    ``positions`` (A, L), the exercise's own rows per axis, given to HF's model whatever the
    conversion made of them (a multimodal text tower's)."""
    from golden.runners.adapt import NotSupported, Runner

    def run(fixture, dtype):
        if dtype != "float32" and config["model_type"] not in FLOAT64:
            raise NotSupported(FLOAT32_ONLY)
        inputs = fixture.inputs
        if positions is not None and np.ndim(positions) == 2:
            rows = np.asarray(inputs["x"]).shape[0]
            inputs = dict(inputs, positions=np.repeat(np.asarray(positions)[:, None], rows, 1))
        output = models.output(config, stack, state_dict, inputs, dtype, layer_idx)
        if seen is not None:
            seen[dtype] = output
        return {"output": output, "dtype": dtype}

    return Runner("hf", "torch", run)


FLOAT32_ONLY = ("HF computes RoPE's angles (or ALiBi's slopes, norms) in float32: compared at "
                "float32")


def layer_only(config, layer_idx):
    """The config as layer ``layer_idx`` sees it: its entries of layer_types, no_rope_layers,
    indexer_types, mlp_layer_types (EXAONE-MoE, Mellum: dense or sparse), layer_rope_theta
    (Granite SWA), kv_source_layers [0] (Mistral Large 4: its own latents),
    num_attention_heads_per_layer (Laguna) and Gemma 3n's per-layer intermediate_size and
    activation_sparsity_pattern,
    whether it is one of Qwen2.5-VL's full layers or Molmo 2's rope_scaling_layers, its
    per_layer_config (Gemma 4, Step 3.5), no num_kv_shared_layers (the one layer keeps its k and
    v); no DeepStack outputs; a speech encoder's own changes
    (golden.verifier.speech); a one-layer model given a second
    layer of the other kind, never run, where the config wants both (BOTH_KINDS_REQUIRED)."""
    c = dict(config)
    for key in ("layer_types", "no_rope_layers", "mlp_layer_types", "layer_rope_theta",
                "layers_block_type",  # Nemotron-H's, Zamba's kinds
                "indexer_types",  # GLM-5's, HY-V4's, Mistral Large 4's full or shared indexers
                "num_attention_heads_per_layer",  # Laguna's heads
                "intermediate_size", "activation_sparsity_pattern"):  # Gemma 3n's, per layer
        if isinstance(c.get(key), list):
            c[key] = [c[key][layer_idx]]
    c.update(_hybrid_one_layer(c))
    if isinstance(c.get("kv_source_layers"), list):  # Mistral Large 4's: the layer owns its
        c["kv_source_layers"] = [0]  # latents (one reading another's is not converted)
    if isinstance(c.get("rope_scaling_layers"), list):  # Molmo 2's scaled RoPE
        c["rope_scaling_layers"] = [0] if layer_idx in c["rope_scaling_layers"] else []
    if isinstance(c.get("fullatt_block_indexes"), list):  # Qwen2.5-VL's full (not windowed)
        c["fullatt_block_indexes"] = [0] if layer_idx in c["fullatt_block_indexes"] else []
    if isinstance(c.get("deepstack_visual_indexes"), list):  # Qwen3-VL's, past the one layer
        c["deepstack_visual_indexes"] = []
    speech = encoder(c)
    if speech is not None and speech.one_layer is not None:  # golden.verifier.speech
        c = speech.one_layer(c)
    if c.get("num_kv_shared_layers"):  # Gemma 4's sharing: the one layer computes its own k, v
        c["num_kv_shared_layers"] = 0
    if isinstance(c.get("per_layer_config"), dict):  # Gemma 4's overrides, as layer 0's
        layer = c["per_layer_config"].get(str(layer_idx), c["per_layer_config"].get(layer_idx))
        c["per_layer_config"] = {} if layer is None else {"0": layer}
        if c.get("model_type") == "gemma4_text" and c.get("layer_types") == [
                "sliding_attention"]:  # HF's Gemma 4 makes a last layer full: a second,
            c["layer_types"] = ["sliding_attention", "full_attention"]  # never run
    if c.get("model_type") in BOTH_KINDS_REQUIRED:  # its config refuses a model without each
        kind = (c.get("layer_types") or [None])[0]  # kind: a second layer, never run
        if kind in ("linear_attention", "full_attention"):
            c["layer_types"] = [kind, "full_attention" if kind == "linear_attention"
                                else "linear_attention"]
    return c


# The families whose config wants at least one attention layer and one linear-attention layer
# (OLMo hybrid's validate_architecture): a one-layer model gets a second of the other kind,
# never run.
BOTH_KINDS_REQUIRED = ("olmo_hybrid",)


def _hybrid_one_layer(c) -> dict:
    """The fields that make a hybrid model's one layer an attention layer where its config
    derives the kinds from the layer's index (golden.hf.hybrids): Jamba's period and offset,
    Bamba's attn_layer_indices, RecurrentGemma's block_types; Nemotron-H's one attention
    mixer (a legacy hybrid_override_pattern dropped)."""
    mt = c.get("model_type")
    if mt == "jamba":
        return dict(attn_layer_period=1, attn_layer_offset=0)
    if mt == "bamba":
        return dict(attn_layer_indices=[0])
    if mt == "recurrent_gemma":
        return dict(block_types=["attention"])
    if mt == "nemotron_h":
        c.pop("hybrid_override_pattern", None)
        return dict(layers_block_type=["full_attention"])
    return {}


def _one_layer_config(config):
    """The config with one layer in each stack (the layer's own settings at index 0)."""
    import transformers

    c = {k: v for k, v in config.items() if k not in DROPPED}
    # RoBERTa's positions need it; the input's tokens are 0. One outside the one-layer model's
    # vocabulary becomes VOCAB − 1, a token never drawn (ModernBERT's decoder takes no None)
    pad = c.get("pad_token_id")
    c.update(pad_token_id=(pad if 0 < pad < VOCAB else VOCAB - 1) if isinstance(pad, int)
             else None,
             bos_token_id=None, eos_token_id=None,
             max_window_layers=0 if c.get("max_window_layers") else None)
    c = {k: v for k, v in c.items() if v is not None or k in KEPT_NONE}
    model_type = c.pop("model_type")
    names = getattr(transformers.CONFIG_MAPPING[model_type], "attribute_map", {})
    layers = len(c["layer_types"]) if isinstance(c.get("layer_types"), list) else 1
    for count in LAYER_COUNTS:
        if count in c or count == "num_hidden_layers":
            c[names.get(count, count)] = layers  # GPT-2's n_layer, ... (1, or layer_only's)
    c[names.get("vocab_size", "vocab_size")] = VOCAB
    return transformers.AutoConfig.for_model(model_type, **c)


# Config fields whose None is a setting, not "the default": kept in the one-layer config (a
# latent attention's q_lora_rank None is a plain q_proj, the class default a q LoRA).
KEPT_NONE = ("pad_token_id", "q_lora_rank")


class _Stop(Exception):
    """Raised by the output hook: the attention's output is read, the rest need not run."""


class Models:
    """One-layer models by (configuration, dtype, layer index where the family reads it),
    built once each."""

    def __init__(self):
        self._built = {}

    def attention(self, config, stack, dtype, layer_idx):
        """(model, its attention module) for the layer's configuration."""
        own = config["model_type"] in OWN_INDEX
        key = (json.dumps(config, sort_keys=True, default=str), str(dtype),
               layer_idx if own else 0, stack)
        if key not in self._built:
            with quiet():
                model = _one_layer_model(config, dtype)
                where = stack.in_model or (stack.stack, stack.module)
                attn = _module(model, Stack(*where))
                if own:  # built again with the layer's own index
                    name = next(n for n, m in model.named_modules() if m is attn)
                    parent, _, child = name.rpartition(".")
                    attn = _floats_to(type(attn)(model.config, layer_idx=layer_idx),
                                      dtype).eval()
                    setattr(model.get_submodule(parent), child, attn)
            self._built[key] = model, attn
        return self._built[key]

    def output(self, config, stack, state_dict, inputs, dtype_name, layer_idx=0):
        """The HF attention module's output on the fixture's inputs: the layer's weights
        loaded into the one-layer model's attention, x fed in place of the attention's input
        by a pre-hook, the output read by a hook, which ends the forward there."""
        return self._run(config, stack, state_dict, inputs, dtype_name, layer_idx)[0]

    def gradient(self, config, stack, state_dict, inputs, cotangent, dtype_name, layer_idx=0):
        """(output, dL/dx) of L = Σ output ⊙ ``cotangent`` through the HF attention module
        (torch's autograd), fed and read as ``output`` does."""
        return self._run(config, stack, state_dict, inputs, dtype_name, layer_idx,
                         cotangent=cotangent)

    def decoded(self, config, stack, state_dict, inputs, prefill, dtype_name, layer_idx=0):
        """The HF attention module's output through the model's own cached decoding: x's first
        ``prefill`` tokens in one call, then one token per call, each with the model's cache
        (the one its forward makes with use_cache=True, read from the attention's arguments)
        and the attention_mask of the tokens so far, as ``generate`` gives them."""
        return self._run(config, stack, state_dict, inputs, dtype_name, layer_idx,
                         prefill=prefill)[0]

    def _run(self, config, stack, state_dict, inputs, dtype_name, layer_idx, cotangent=None,
             prefill=None):
        import torch

        dtype = getattr(torch, dtype_name)
        model, attn = self.attention(config, stack, dtype, layer_idx)
        own = attn.state_dict()
        missing = sorted(set(own) - set(state_dict))
        if missing:
            raise CheckpointError(f"{stack.stack}.N.{stack.module}: the checkpoint has no "
                                  f"{', '.join(missing)}")
        attn.load_state_dict({k: torch.from_numpy(np.asarray(state_dict[k])).to(dtype)
                              for k in own}, strict=True)
        with torch.no_grad():  # the model's arrays beside the stack (Phi-4's position table,
            for name in stack.beside:  # Mistral Large 4's RoPE scales, a buffer)
                held = (model.get_parameter(name) if name in dict(model.named_parameters())
                        else model.get_buffer(name))
                held.copy_(torch.from_numpy(np.asarray(state_dict[name])))
        whole = torch.from_numpy(np.asarray(inputs["x"])).to(dtype)
        if cotangent is not None:
            whole.requires_grad_(True)
        fed = {"x": whole}
        if "key_indices" in inputs:  # a "shared" indexer layer: the previous layer's choice,
            fed["topk"] = torch.from_numpy(np.asarray(inputs["key_indices"]))  # HF's argument
        seen = {}
        speech = encoder(model.config) is not None
        from transformers import Cache

        def feed(mod, args, kwargs):  # a Qwen-VL tower's attention takes (L, D): x's one row
            given = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            x = fed["x"][0] if given.dim() == fed["x"].dim() - 1 else fed["x"]
            if speech and given.shape != x.shape:  # its tables and masks are for its length
                raise RuntimeError(f"the one-layer encoder's attention input should have x's "
                                   f"shape {tuple(x.shape)} (golden.verifier.speech), got "
                                   f"{tuple(given.shape)}")
            seen["cache"] = next((a for a in (*args, *kwargs.values())
                                  if isinstance(a, Cache)), None)
            if "topk" in fed:
                kwargs = dict(kwargs, prev_topk_indices=fed["topk"])
            if "hidden_states" in kwargs:
                return args, dict(kwargs, hidden_states=x)
            return (x,) + tuple(args[1:]), kwargs

        def read(mod, args, kwargs, out):
            out = out if isinstance(out, torch.Tensor) else out[0]
            seen["out"] = out[None] if out.dim() == fed["x"].dim() - 1 else out
            raise _Stop

        def forward(x, given):
            fed["x"] = x
            seen.pop("out", None)
            try:
                with torch.set_grad_enabled(cotangent is not None), quiet():
                    model(**given)
            except _Stop:
                pass
            if "out" not in seen:
                raise RuntimeError(f"the one-layer model's forward did not run its "
                                   f"{stack.module}")
            return seen["out"]

        read_from = attn if stack.output is None else attn.get_submodule(stack.output)
        feed_at = attn if stack.input is None else attn.get_submodule(stack.input)
        handles = [feed_at.register_forward_pre_hook(feed, with_kwargs=True),
                   read_from.register_forward_hook(read, with_kwargs=True)]
        try:
            if prefill is not None:
                out = self._decode(model, stack, inputs, dtype, prefill, whole, forward, seen)
            else:
                out = forward(whole, _model_inputs(model, stack, inputs, dtype))
            grad = None
            if cotangent is not None:
                cot = torch.from_numpy(np.asarray(cotangent)).to(dtype)
                grad, = torch.autograd.grad(out, whole, cot)
                grad = grad.numpy().astype(np.float64)
        finally:
            for h in handles:
                h.remove()
        return out.detach().numpy().astype(np.float64), grad

    @staticmethod
    def _decode(model, stack, inputs, dtype, prefill, whole, forward, seen):
        """The outputs of ``decoded``'s calls, joined along L."""
        import torch

        length, pieces, cache = whole.shape[1], [], None
        mask = np.asarray(inputs.get("attention_mask", np.ones(whole.shape[:2], bool)))
        for start, stop in [(0, prefill), *((t, t + 1) for t in range(prefill, length))]:
            given = _model_inputs(model, stack, {"x": inputs["x"][:, start:stop],
                                                 "attention_mask": mask[:, :stop]}, dtype)
            given.update(use_cache=True, past_key_values=cache)
            if "position_ids" in inspect.signature(model.forward).parameters:  # a cache of
                given["position_ids"] = torch.arange(start, stop)[None]  # linear layers alone
                # has no length to count them from (get_seq_length)
            pieces.append(forward(whole[:, start:stop], given))
            cache = seen["cache"]
            if cache is None:
                raise RuntimeError(f"the one-layer {type(model).__name__} gave its "
                                   f"{stack.module} no cache with use_cache=True")
        return torch.cat(pieces, dim=1)


def _one_layer_model(config, dtype):
    import transformers

    hf_config = _one_layer_config(config)
    hf_config._experts_implementation = "eager"
    make = (_class(MODELS[config["model_type"]]) if config["model_type"] in MODELS
            else transformers.AutoModel.from_config)
    for attention in ("sdpa", "eager"):
        hf_config._attn_implementation = attention
        try:
            with _no_init():  # the attention's weights are loaded; the rest is never read
                return _floats_to(make(hf_config), dtype).eval()
        except ValueError:  # this family has no sdpa path
            continue
    raise CheckpointError(f"model_type {config['model_type']!r}: transformers builds no model")


def _floats_to(module, dtype):
    """The module with its floating-point parameters and buffers in ``dtype``, the others as
    they are: ``Module.to(dtype)`` would also cast a complex buffer to the real dtype, dropping
    its imaginary part (Llama 4's vision freqs_ci)."""
    return module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)


def _class(name):
    """A transformers class: "Name" at its top, or "module.Name" in transformers.models.module's
    modeling_module (the vision towers' models, which it does not export)."""
    import importlib

    import transformers

    if "." not in name:
        return getattr(transformers, name)
    module, cls = name.split(".")
    return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)


def _no_init():
    """transformers' context that skips drawing the initial weights (2 s for an MLP of a 1B
    model's width), where it has one."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


def _model_inputs(model, stack, inputs, dtype) -> dict:
    """The one-layer model's inputs, zeros (the attention's input is replaced): token ids of
    x's length, an image or features of the config's size (SigLIP 2: x's L patches, one row
    of them; a vision tower with axial RoPE: the one image of the positions, as
    golden.verifier.towers gives it; a speech encoder: features its subsampling takes to x's
    L frames, as golden.verifier.speech gives them); a decoder's positions as its
    position_ids; a linear-attention layer's padding (B, L) as its attention_mask; an
    encoder-decoder's decoder tokens and, for a decoder's attention, in place
    of its encoder's output the drawn context (or zeros)."""
    import torch

    c = model.config
    b, length = inputs["x"].shape[:2]
    speech = encoder(c)
    if speech is not None:  # features subsampled to L frames (golden.verifier.speech)
        return speech.inputs(model, b, length, dtype)
    vision = tower(c)
    if vision is not None and "positions" in inputs:  # one image (golden.verifier.towers)
        return vision.inputs(c, b, length, np.asarray(inputs["positions"]), dtype)
    main = model.main_input_name
    shapes = {"input_ids": lambda: (b, length),
              "pixel_values": lambda: (b, c.num_channels, c.image_size, c.image_size),
              "input_features": lambda: (b, c.num_mel_bins, 2 * c.max_source_positions)}
    given = {main: torch.zeros(shapes[main](), dtype=torch.long if main == "input_ids" else dtype)
             } if not hasattr(c, "num_patches") else {  # SigLIP 2: x's L patches, flattened,
        "pixel_values": torch.zeros((b, length, c.num_channels * c.patch_size ** 2),  # all real
                                    dtype=dtype),
        "pixel_attention_mask": torch.ones((b, length), dtype=torch.long),
        "spatial_shapes": torch.tensor([[1, length]] * b)}
    if "use_cache" in inspect.signature(model.forward).parameters:
        given["use_cache"] = False
    if "positions" in inputs:  # (B, L), or (A, B, L) for a multimodal text tower
        positions = np.asarray(inputs["positions"])
        if positions.ndim < 3:
            positions = np.broadcast_to(positions, (b, length))
        given["position_ids"] = torch.from_numpy(np.array(positions, np.int64))
    if "attention_mask" in inputs:  # (B, L) bool, True = a real token: a linear layer's
        given["attention_mask"] = torch.from_numpy(np.asarray(inputs["attention_mask"],
                                                              np.int64))
    if getattr(c, "is_encoder_decoder", False):
        given["decoder_input_ids"] = torch.zeros((b, length), dtype=torch.long)
    if getattr(c, "is_encoder_decoder", False) and stack.kind != "encoder":
        context = inputs.get("context", np.zeros((b, 5, inputs["x"].shape[-1])))
        given["encoder_outputs"] = (torch.from_numpy(np.asarray(context)).to(dtype),)
    return given


def _module(model, stack):
    """The one-layer model's attention module of the stack (its layer 0)."""
    pattern = stack.pattern("0")
    found = [m for name, m in model.named_modules()
             if (match := pattern.match(name + ".")) and match.group(1) == name + "."]
    if len(found) != 1:
        raise CheckpointError(f"the one-layer {type(model).__name__} has "
                              f"{len(found)} modules '...{stack.stack}.0.{stack.module}'")
    return found[0]

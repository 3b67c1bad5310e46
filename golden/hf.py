"""Hugging Face attention checkpoints <-> our variants: ``from_hf`` and ``to_hf``, NumPy only.

``from_hf(config, state_dict, *, layer_idx=0) -> (variant, config, params)``: ``config`` is a
transformers config's ``to_dict()`` (or an object with ``to_dict()``; for composite models the
text or decoder sub-config's), ``state_dict`` the attention module's own state dict (keys as
its ``state_dict()`` names them, arrays of NumPy, torch or JAX), ``layer_idx`` the layer the
weights come from (sliding or full, RoPE or NoPE, local or global θ). The result goes straight
into ``torch_attn.build(*result)`` and ``jax_attn.build(*result)``. ``to_hf(variant, config,
params)`` gives back the same arrays under the family's names (a round trip is exact); the
config ``from_hf`` returns remembers its ``model_type`` (``HFConfig``), or pass
``model_type=``.

A family, or a setting of one, that we do not express is a ValueError naming the
``model_type`` and the setting, never a module that computes something else. The families and
what each maps: ``FAMILIES`` (docs/hf.md has the table, checked against the tests).

Layouts: ``nn.Linear`` weights are (out, in), ours (in, out): transposed both ways, copies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from golden import variants
from golden.convert import _numpy

GQA = "grouped_query_attention"
ROLES = ("query", "key", "value", "out")
LLAMA_NAMES = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "out": "o_proj"}


class HFConfig(dict):
    """Our module's configuration (a plain dict to ``build``), remembering the Hugging Face
    ``model_type`` it came from, which ``to_hf`` reads to name the arrays."""

    def __init__(self, settings, model_type):
        super().__init__(settings)
        self.model_type = model_type


@dataclass(frozen=True)
class Family:
    """How one ``model_type``'s attention maps to ours.

    settings(c, layer_idx) -> our configuration from the HF config dict ``c``;
    to_neutral(sd, ours) -> our parameters from the state dict (NumPy copies);
    from_neutral(params, ours) -> the state dict from our parameters.
    ``unsupported``: HF config fields whose non-default value we refuse, each with the value(s)
    we accept and why (checked before anything else)."""

    variant: str
    settings: Callable
    to_neutral: Callable
    from_neutral: Callable
    unsupported: dict = field(default_factory=dict)


# ---- the configuration --------------------------------------------------------------------------

def _as_dict(config) -> dict:
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise ValueError(f"config should be a transformers config's to_dict() (a dict) or an "
                         f"object with to_dict(), got {type(config).__name__}")
    return dict(config)


def _layer_type(c, layer_idx) -> str | None:
    """``layer_types[layer_idx]`` ("full_attention", "sliding_attention", "chunked_attention",
    ...) when the config lists them, else None."""
    types = c.get("layer_types")
    if types is None:
        return None
    if not 0 <= layer_idx < len(types):
        raise ValueError(f"layer_idx should be in [0, {len(types)}) (the config's layer_types), "
                         f"got {layer_idx}")
    return types[layer_idx]


def _sizes(c) -> dict:
    n = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or n
    dh = c.get("head_dim") or c["hidden_size"] // n
    return dict(d_in=c["hidden_size"], num_heads=n, num_kv_heads=kv, head_dim=dh)


def _rope(c, layer_type, mt) -> dict:
    """rope_parameters as our module takes them (θ and the rotary fraction inside, as HF 5.x
    puts them), original_max_position_embeddings filled from max_position_embeddings where the
    type needs it and HF falls back to it; a per-layer-type dict (Gemma 3) resolved."""
    rope = c.get("rope_parameters")
    if rope is None:
        theta = c.get("rope_theta")
        return {} if theta is None else {"rope_theta": float(theta)}
    if layer_type is not None and layer_type in rope and isinstance(rope[layer_type], Mapping):
        rope = rope[layer_type]
    rope = dict(rope)
    kind = rope.get("rope_type", "default")
    if kind not in variants_rope_types():
        raise ValueError(f"model_type {mt!r}: rope_parameters['rope_type'] = {kind!r} is not "
                         f"supported (we take {', '.join(variants_rope_types())})")
    needs = ("yarn", "longrope", "dynamic", "llama3")
    if kind in needs and "original_max_position_embeddings" not in rope:
        source = c.get("original_max_position_embeddings") or c.get("max_position_embeddings")
        rope["original_max_position_embeddings"] = int(source)
    if "partial_rotary_factor" not in rope and c.get("partial_rotary_factor") is not None:
        rope["partial_rotary_factor"] = c["partial_rotary_factor"]
    return {"rope_parameters": rope}


def variants_rope_types() -> tuple:
    from golden.validate import ROPE_TYPES
    return tuple(ROPE_TYPES)


# ---- the state dict -----------------------------------------------------------------------------

def _read(sd, key, mt):
    if key not in sd:
        raise ValueError(f"model_type {mt!r}: the state dict has no {key!r} (it has "
                         f"{', '.join(sorted(sd)) or 'nothing'})")
    return _numpy(sd[key])


def _linears_to_neutral(sd, names, mt) -> dict:
    """W_role (in, out) = weight.T and b_role of each role's nn.Linear, copies."""
    params = {}
    for role, name in names.items():
        params[f"W_{role}"] = np.ascontiguousarray(_read(sd, f"{name}.weight", mt).T)
        if f"{name}.bias" in sd:
            params[f"b_{role}"] = _numpy(sd[f"{name}.bias"])
    return params


def _neutral_to_linears(params, names) -> dict:
    sd = {}
    for role, name in names.items():
        sd[f"{name}.weight"] = np.ascontiguousarray(np.asarray(params[f"W_{role}"]).T)
        if f"b_{role}" in params:
            sd[f"{name}.bias"] = np.array(params[f"b_{role}"])
    return sd


def _bias_flags(sd, names, mt) -> dict:
    """qkv_bias and out_bias from which of q, k, v, o have a bias in the checkpoint (q, k, v
    all or none: one with and one without is not a setting we express here)."""
    has = {role: f"{names[role]}.bias" in sd for role in ROLES if role in names}
    qkv = {has[r] for r in ("query", "key", "value")}
    if len(qkv) > 1:
        raise ValueError(f"model_type {mt!r}: q, k and v should all have a bias or none, got "
                         f"{', '.join(f'{names[r]}: {has[r]}' for r in ('query', 'key', 'value'))}")
    return dict(qkv_bias=qkv.pop(), out_bias=has.get("out", False))


# ---- decoders with q_proj, k_proj, v_proj, o_proj ----------------------------------------------

def _decoder_settings(c, layer_idx, *, mt, sd_names=LLAMA_NAMES) -> dict:
    """The settings every Llama-like decoder shares: sizes, RoPE, the sliding window of its
    sliding layers (all layers when there are no layer_types), dropout."""
    layer_type = _layer_type(c, layer_idx)
    ours = {**_sizes(c), **_rope(c, layer_type, mt)}
    window = c.get("sliding_window")
    sliding = layer_type == "sliding_attention" if layer_type is not None else (
        window is not None and c.get("use_sliding_window", True))
    if sliding and window is not None:
        ours["sliding_window"] = int(window)
    if c.get("attention_dropout"):
        ours["dropout"] = float(c["attention_dropout"])
    return ours


def _qk_norm_entries(sd, mt, q="q_norm.weight", k="k_norm.weight") -> dict:
    return {"q_norm": _read(sd, q, mt), "k_norm": _read(sd, k, mt)}


def _llama_like(mt, extra=None, norms=None, to_extra=None, from_extra=None, **family) -> Family:
    """A family with LLAMA_NAMES' projections; ``extra(c, layer_idx, ours)`` adds its settings;
    ``norms`` the q/k norm state-dict keys (copied as q_norm, k_norm); ``to_extra`` and
    ``from_extra`` move more arrays (sinks, a gate)."""

    def settings(c, layer_idx, sd):
        ours = _decoder_settings(c, layer_idx, mt=mt)
        ours.update(_bias_flags(sd, LLAMA_NAMES, mt))
        if extra is not None:
            extra(c, layer_idx, ours)
        return ours

    def to_neutral(sd, ours):
        params = _linears_to_neutral(sd, LLAMA_NAMES, mt)
        if norms is not None and ours.get("qk_norm") not in (None, "l2"):
            params.update(_qk_norm_entries(sd, mt, *norms))
        if to_extra is not None:
            params = to_extra(sd, ours, params)
        return params

    def from_neutral(params, ours):
        sd = _neutral_to_linears(params, LLAMA_NAMES)
        if norms is not None and "q_norm" in params:
            sd[norms[0]], sd[norms[1]] = np.array(params["q_norm"]), np.array(params["k_norm"])
        if from_extra is not None:
            sd = from_extra(params, ours, sd)
        return sd

    return Family(GQA, settings, to_neutral, from_neutral, **family)


def _gemma(c, layer_idx, ours):
    ours["scale"] = float(c["query_pre_attn_scalar"]) ** -0.5
    if c.get("attn_logit_softcapping") is not None:
        ours["softcap"] = float(c["attn_logit_softcapping"])


def _gemma3(c, layer_idx, ours):
    _gemma(c, layer_idx, ours)
    ours.update(qk_norm="rms_one_plus", qk_norm_eps=float(c["rms_norm_eps"]))


def _qwen3(c, layer_idx, ours):
    ours.update(qk_norm="rms", qk_norm_eps=float(c["rms_norm_eps"]))


def _olmo2(c, layer_idx, ours):
    ours.update(qk_norm="rms_across_heads", qk_norm_eps=float(c["rms_norm_eps"]))


def _olmo(c, layer_idx, ours):
    if c.get("clip_qkv") is not None:
        ours["clip_qkv"] = float(c["clip_qkv"])


def _cohere(c, layer_idx, ours):
    ours["rope_interleaved"] = True
    if c.get("use_qk_norm"):
        ours.update(qk_norm="layer", qk_norm_eps=float(c["layer_norm_eps"]))


def _granite(c, layer_idx, ours):
    ours["scale"] = float(c["attention_multiplier"])


def _nope(c, layer_idx, ours):
    """SmolLM3 and Llama 4: no_rope_layers[layer] == 0 is a NoPE layer."""
    flags = c.get("no_rope_layers")
    if flags is not None and not flags[layer_idx]:
        ours.pop("rope_parameters", None)
        ours.pop("rope_theta", None)
        return True
    return False


def _smollm3(c, layer_idx, ours):
    _nope(c, layer_idx, ours)


def _llama4(c, layer_idx, ours):
    ours["rope_interleaved"] = True  # complex pairs (2i, 2i + 1)
    if _layer_type(c, layer_idx) == "chunked_attention":
        ours["attention_chunk_size"] = int(c["attention_chunk_size"])
    if _nope(c, layer_idx, ours):
        ours.pop("rope_interleaved")
        if c.get("attn_temperature_tuning"):
            ours["query_temperature"] = {"beta": float(c["attn_scale"]),
                                         "floor_scale": int(c["floor_scale"]), "shift": 1}
    elif c.get("use_qk_norm"):
        ours.update(qk_norm="l2", qk_norm_eps=float(c["rms_norm_eps"]))


def _gpt_oss(c, layer_idx, ours):
    ours["sinks"] = True


def _sinks_in(sd, ours, params):
    params["sinks"] = _read(sd, "sinks", "gpt_oss")
    return params


def _sinks_out(params, ours, sd):
    sd["sinks"] = np.array(params["sinks"])
    return sd


def _qwen3_next(c, layer_idx, ours):
    if _layer_type(c, layer_idx) != "full_attention":
        raise ValueError(f"model_type 'qwen3_next': layer {layer_idx} is a "
                         f"{_layer_type(c, layer_idx)!r} layer (Gated DeltaNet, not softmax "
                         f"attention); only its full_attention layers convert")
    ours.update(qk_norm="rms_one_plus", qk_norm_eps=float(c["rms_norm_eps"]), output_gate=True)


def _gate_split(sd, ours, params):
    """q_proj's output is per head [query (Dh) | gate (Dh)]: split into W_query and W_gate."""
    n, dh = ours["num_heads"], ours["head_dim"]
    w = params["W_query"]  # (d_in, N·2·Dh)
    w = w.reshape(w.shape[0], n, 2, dh)
    params["W_query"], params["W_gate"] = (np.ascontiguousarray(
        w[:, :, i].reshape(w.shape[0], n * dh)) for i in (0, 1))
    if "b_query" in params:
        b = params["b_query"].reshape(n, 2, dh)
        params["b_query"], params["b_gate"] = (b[:, i].reshape(n * dh).copy() for i in (0, 1))
    return params


def _gate_join(params, ours, sd):
    n, dh = ours["num_heads"], ours["head_dim"]
    q, g = (np.asarray(params[n_]).T.reshape(n, 1, dh, -1) for n_ in ("W_query", "W_gate"))
    sd["q_proj.weight"] = np.concatenate([q, g], axis=1).reshape(n * 2 * dh, -1)
    if "b_query" in params:
        qb, gb = (np.asarray(params[n_]).reshape(n, 1, dh) for n_ in ("b_query", "b_gate"))
        sd["q_proj.bias"] = np.concatenate([qb, gb], axis=1).reshape(-1)
    return sd


FAMILIES: dict[str, Family] = {
    "llama": _llama_like("llama"),
    "mistral": _llama_like("mistral"),
    "mixtral": _llama_like("mixtral"),
    "qwen2": _llama_like("qwen2"),
    "starcoder2": _llama_like("starcoder2"),
    "granite": _llama_like("granite", _granite),
    "smollm3": _llama_like("smollm3", _smollm3),
    "olmo": _llama_like("olmo", _olmo),
    "qwen3": _llama_like("qwen3", _qwen3, norms=("q_norm.weight", "k_norm.weight")),
    "olmo2": _llama_like("olmo2", _olmo2, norms=("q_norm.weight", "k_norm.weight")),
    "gemma2": _llama_like("gemma2", _gemma),
    "gemma3_text": _llama_like("gemma3_text", _gemma3, norms=("q_norm.weight",
                                                                "k_norm.weight")),
    "cohere": _llama_like("cohere", _cohere, norms=("q_norm.weight", "k_norm.weight")),
    "gpt_oss": _llama_like("gpt_oss", _gpt_oss, to_extra=_sinks_in, from_extra=_sinks_out),
    "llama4_text": _llama_like("llama4_text", _llama4),
    "qwen3_next": _llama_like("qwen3_next", _qwen3_next,
                              norms=("q_norm.weight", "k_norm.weight"),
                              to_extra=_gate_split, from_extra=_gate_join),
}


# ---- the API ------------------------------------------------------------------------------------

def _family(mt) -> Family:
    if mt not in FAMILIES:
        raise ValueError(f"model_type {mt!r} is not supported; supported: "
                         f"{', '.join(sorted(FAMILIES))}")
    return FAMILIES[mt]


def from_hf(config, state_dict, *, layer_idx=0):
    """(variant, config, params) of one attention layer of a Hugging Face checkpoint: see the
    module's docstring."""
    c = _as_dict(config)
    mt = c.get("model_type")
    family = _family(mt)
    if not isinstance(layer_idx, int) or isinstance(layer_idx, bool) or layer_idx < 0:
        raise ValueError(f"layer_idx should be an int >= 0, got {layer_idx!r}")
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"state_dict should be a mapping of names to arrays, got "
                         f"{type(state_dict).__name__}")
    for name, (accepted, why) in family.unsupported.items():
        if c.get(name) not in accepted:
            raise ValueError(f"model_type {mt!r}: {name} = {c.get(name)!r} is not supported "
                             f"({why})")
    ours = family.settings(c, layer_idx, state_dict)
    try:
        variants.VARIANTS[family.variant].config(ours)
    except (ValueError, TypeError) as e:
        raise ValueError(f"model_type {mt!r}: {e}") from None
    params = family.to_neutral(state_dict, ours)
    shapes = variants.VARIANTS[family.variant].shapes(variants.VARIANTS[family.variant]
                                                      .config(ours))
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
    return family.variant, HFConfig(ours, mt), params


def to_hf(variant, config, params, *, model_type=None) -> dict:
    """The attention module's state dict (NumPy copies, the family's names and layouts) from
    our variant, configuration and parameters; ``model_type`` defaults to the one ``from_hf``
    recorded in ``config``."""
    mt = model_type if model_type is not None else getattr(config, "model_type", None)
    if mt is None:
        raise ValueError("model_type should be given (config did not come from from_hf), "
                         "got None")
    family = _family(mt)
    if variant != family.variant:
        raise ValueError(f"variant should be {family.variant!r} for model_type {mt!r}, got "
                         f"{variant!r}")
    ours = variants.VARIANTS[variant].config(dict(config))
    return family.from_neutral({n: _numpy(a) for n, a in params.items()}, ours)

"""Hugging Face attention checkpoints <-> our variants: ``from_hf`` and ``to_hf``, NumPy only.

``from_hf(config, state_dict, *, layer_idx=0, kind=None) -> (variant, config, params)``:
``config`` is a transformers config's ``to_dict()`` (or an object with ``to_dict()``; for
composite models the text or decoder sub-config's), ``state_dict`` the attention module's own
state dict (keys as its ``state_dict()`` names them, arrays of NumPy, torch or JAX),
``layer_idx`` the layer the weights come from (sliding or full, RoPE or NoPE, local or global
θ), ``kind`` which attention of an encoder-decoder's layer ("encoder", "decoder", "cross":
Whisper, BART, T5; None elsewhere; see the section at the end). The result goes straight into
``torch_attn.build(*result)`` and ``jax_attn.build(*result)``. ``to_hf(variant, config,
params)`` gives back the same arrays under the family's names (a round trip is exact); the
config ``from_hf`` returns remembers its ``model_type`` and ``kind`` (``HFConfig``), or pass
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
    ``model_type`` it came from, which ``to_hf`` reads to name the arrays (and the ``kind`` of
    attention, for a model_type with several: see ``Kinds``)."""

    def __init__(self, settings, model_type, kind=None):
        super().__init__(settings)
        self.model_type = model_type
        self.kind = kind


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


FAMILIES: dict[str, Family | Kinds] = {  # Kinds: see the end
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


# ---- fused projections (one matrix for q, k, v) and GPT-2's Conv1D; per-head LayerNorms -------
# Phi-3, GPT-NeoX, Falcon, BLOOM, MPT and GPT-2 keep q, k and v in one projection; two layouts
# cover them all, as rows of the fused (out, D) weight:
#   "thirds":  [q (N·Dh); k (Nkv·Dh); v (Nkv·Dh)]                       Phi-3, MPT, GPT-2
#   "grouped": per key-value group g, [q_{g·G} … q_{g·G+G−1}, k_g, v_g], G = N / Nkv heads each
#              (view (Nkv, G + 2, Dh)): Falcon's new_decoder_architecture; multi-query is Nkv = 1
#              (view (N + 2, Dh)); BLOOM, GPT-NeoX and Falcon's multi-head are Nkv = N
#              (view (N, 3, Dh), per head [q_h, k_h, v_h]).
# GPT-2's Conv1D stores its weight (in, out), already ours; nn.Linear (out, in) is transposed.
# Dropout (training only) is on the attention weights, as each family drops them; GPT-2's
# resid_pdrop and BLOOM's hidden_dropout act on the module's output and are the caller's.

def _fused_rows(layout, n, nkv, dh) -> tuple:
    """The fused weight's rows holding q, k and v, three index arrays of N·Dh, Nkv·Dh, Nkv·Dh."""
    if layout == "thirds":
        rows = np.arange((n + 2 * nkv) * dh)
        return rows[:n * dh], rows[n * dh:(n + nkv) * dh], rows[(n + nkv) * dh:]
    rows = np.arange((n + 2 * nkv) * dh).reshape(nkv, n // nkv + 2, dh)  # (Nkv, G + 2, Dh)
    return rows[:, :-2].reshape(-1), rows[:, -2].reshape(-1), rows[:, -1].reshape(-1)


def _weight(sd, name, conv1d, mt) -> np.ndarray:
    """A projection's weight as (in, out), a copy."""
    w = _read(sd, f"{name}.weight", mt)
    return np.ascontiguousarray(w if conv1d else w.T)


def _fused_family(mt, settings, layout, fused, out, *, conv1d=False, **family) -> Family:
    """A family whose q, k and v come from one projection ``fused`` in ``layout`` (above) and
    whose output projection is ``out``; ``settings(c, layer_idx)`` -> our configuration
    (sizes included), qkv_bias and out_bias read from which biases the state dict has."""

    def our_settings(c, layer_idx, sd):
        ours = settings(c, layer_idx)
        ours.update(qkv_bias=f"{fused}.bias" in sd, out_bias=f"{out}.bias" in sd)
        return ours

    def rows(ours):
        return _fused_rows(layout, ours["num_heads"], ours["num_kv_heads"], ours["head_dim"])

    def to_neutral(sd, ours):
        w = _weight(sd, fused, conv1d, mt)  # (D, rows)
        want = (ours["num_heads"] + 2 * ours["num_kv_heads"]) * ours["head_dim"]
        if w.shape[1] != want:
            raise ValueError(f"model_type {mt!r}: {fused}.weight should have {want} outputs "
                             f"((N + 2·Nkv)·Dh from the config), got shape "
                             f"{tuple(_read(sd, f'{fused}.weight', mt).shape)}")
        params = {"W_out": _weight(sd, out, conv1d, mt)}
        for role, r in zip(("query", "key", "value"), rows(ours)):
            params[f"W_{role}"] = np.ascontiguousarray(w[:, r])
            if f"{fused}.bias" in sd:
                params[f"b_{role}"] = _read(sd, f"{fused}.bias", mt)[r].copy()
        if f"{out}.bias" in sd:
            params["b_out"] = _read(sd, f"{out}.bias", mt)
        return params

    def from_neutral(params, ours):
        r = rows(ours)
        d_in = np.asarray(params["W_query"]).shape[0]
        w = np.empty((d_in, sum(len(i) for i in r)), np.asarray(params["W_query"]).dtype)
        for role, i in zip(("query", "key", "value"), r):
            w[:, i] = params[f"W_{role}"]
        sd = {f"{fused}.weight": w if conv1d else np.ascontiguousarray(w.T),
              f"{out}.weight": np.array(params["W_out"]) if conv1d else np.ascontiguousarray(
                  np.asarray(params["W_out"]).T)}
        if "b_query" in params:
            b = np.empty(w.shape[1], np.asarray(params["b_query"]).dtype)
            for role, i in zip(("query", "key", "value"), r):
                b[i] = params[f"b_{role}"]
            sd[f"{fused}.bias"] = b
        if "b_out" in params:
            sd[f"{out}.bias"] = np.array(params["b_out"])
        return sd

    return Family(GQA, our_settings, to_neutral, from_neutral, **family)


def _heads(c, n, mt, kv=None) -> dict:
    """Sizes of a family whose head width is D / N whatever else the config says."""
    d = c["hidden_size"] if "hidden_size" in c else c.get("n_embd", c.get("d_model"))
    if d % n:
        raise ValueError(f"model_type {mt!r}: hidden_size = {d} should be a multiple of the "
                         f"{n} heads")
    return dict(d_in=d, num_heads=n, num_kv_heads=n if kv is None else kv, head_dim=d // n)


def _dropout(c, ours, name="attention_dropout"):
    if c.get(name):
        ours["dropout"] = float(c[name])
    return ours


def _phi3(c, layer_idx):
    ours = _decoder_settings(c, layer_idx, mt="phi3")
    rope = ours.get("rope_parameters", {})
    if rope.get("rope_type") == "longrope" and rope.get("factor") is None:
        # HF: max_position_embeddings / original_max_position_embeddings when the dict has none
        rope["factor"] = c["max_position_embeddings"] / rope["original_max_position_embeddings"]
    return ours


def _gpt_neox(c, layer_idx):
    ours = {**_heads(c, c["num_attention_heads"], "gpt_neox"), **_rope(c, None, "gpt_neox")}
    return _dropout(c, ours)


def _falcon_kv_heads(c) -> int:
    """Falcon's key-value heads: num_kv_heads with new_decoder_architecture, 1 with
    multi_query, else one per head."""
    if c.get("new_decoder_architecture"):
        return c["num_kv_heads"]
    return 1 if c.get("multi_query", True) else c["num_attention_heads"]


def _falcon(c, layer_idx):
    ours = _heads(c, c["num_attention_heads"], "falcon", _falcon_kv_heads(c))
    if not c.get("alibi"):  # FalconAttention drops its weights only on the ALiBi path
        return {**ours, **_rope(c, None, "falcon")}
    ours["alibi"] = "falcon"  # (q kᵀ + m_h · j) / √Dh, bfloat16 slopes
    return _dropout(c, ours)


def _bloom(c, layer_idx):
    return _dropout(c, dict(_heads(c, c["n_head"], "bloom"), alibi="bloom"))


def _mpt(c, layer_idx):
    a = dict(c.get("attn_config") or {})
    refuse = {"attn_type": ("multihead_attention", "transformers' MptAttention has no "
                            "multi-query projection"),
              "qk_ln": (False, "transformers' MptAttention leaves out MosaicML's q/k LayerNorm"),
              "prefix_lm": (False, "a bidirectional prefix is not causal attention"),
              "alibi": (True, "transformers' MptModel adds ALiBi whatever the config says"),
              "alibi_bias_max": (8, "transformers' MptModel builds its ALiBi with 8 whatever "
                                 "the config says, MosaicML's code with this value: the "
                                 "checkpoint's meaning is ambiguous")}
    for name, (accepted, why) in refuse.items():
        if a.get(name, accepted) != accepted:
            raise ValueError(f"model_type 'mpt': attn_config['{name}'] = {a[name]!r} is not "
                             f"supported ({why})")
    ours = dict(_heads(c, c["n_heads"], "mpt"), alibi="mpt")
    if a.get("clip_qkv"):
        ours["clip_qkv"] = float(a["clip_qkv"])
    if a.get("softmax_scale") is not None:
        ours["scale"] = float(a["softmax_scale"])
    return _dropout(a, ours, "attn_pdrop")


def _gpt2(c, layer_idx):
    ours = _heads(c, c["n_head"], "gpt2")
    scale = ours["head_dim"] ** -0.5 if c.get("scale_attn_weights", True) else 1.0
    if c.get("scale_attn_by_inverse_layer_idx"):
        scale /= float(layer_idx + 1)
    ours["scale"] = scale  # GPT2Attention's scaling, the same float
    return _dropout(c, ours, "attn_pdrop")


def _stablelm(c, layer_idx, ours):
    ours.update(_heads(c, c["num_attention_heads"], "stablelm",
                       c.get("num_key_value_heads") or c["num_attention_heads"]))
    if c.get("qk_layernorm"):
        ours.update(qk_norm="layer", qk_norm_eps=float(c["layer_norm_eps"]))


def _per_head_norms_in(sd, ours, params):
    """StableLM's q_layernorm.norms.{h}.weight (Dh,) for each head, stacked to (N, Dh)."""
    if ours.get("qk_norm") == "layer":
        for ours_name, hf_name, heads in (("q_norm", "q_layernorm", ours["num_heads"]),
                                          ("k_norm", "k_layernorm", ours["num_kv_heads"])):
            params[ours_name] = np.stack([_read(sd, f"{hf_name}.norms.{h}.weight", "stablelm")
                                          for h in range(heads)])
    return params


def _per_head_norms_out(params, ours, sd):
    for ours_name, hf_name in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
        if ours_name in params:
            for h, w in enumerate(np.asarray(params[ours_name])):
                sd[f"{hf_name}.norms.{h}.weight"] = np.array(w)
    return sd


FAMILIES.update({
    "phi3": _fused_family("phi3", _phi3, "thirds", "qkv_proj", "o_proj"),
    "stablelm": _llama_like("stablelm", _stablelm, to_extra=_per_head_norms_in,
                            from_extra=_per_head_norms_out),
    "gpt_neox": _fused_family("gpt_neox", _gpt_neox, "grouped", "query_key_value", "dense"),
    "falcon": _fused_family("falcon", _falcon, "grouped", "query_key_value", "dense"),
    "bloom": _fused_family("bloom", _bloom, "grouped", "query_key_value", "dense"),
    "mpt": _fused_family("mpt", _mpt, "thirds", "Wqkv", "out_proj"),
    "gpt2": _fused_family("gpt2", _gpt2, "thirds", "c_attn", "c_proj", conv1d=True),
})


# ---- the API ------------------------------------------------------------------------------------

def _family(mt) -> Family:
    if mt not in FAMILIES:
        raise ValueError(f"model_type {mt!r} is not supported; supported: "
                         f"{', '.join(sorted(FAMILIES))}")
    return FAMILIES[mt]


def _resolve(config, state_dict, layer_idx, kind, rope_precision):
    """(model_type, Family, our configuration) of a layer, checked: the settings come from the
    config and from which keys the state dict has (its arrays are not read)."""
    c = _as_dict(config)
    mt = c.get("model_type")
    family = _kind(_family(mt), mt, kind)
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
    takes = {a.name for a in variants.VARIANTS[family.variant].args}
    if rope_precision != "exact" and ("rope_parameters" in ours or "rope_theta" in ours):
        if "rope_precision" not in takes:
            raise ValueError(f"rope_precision should be 'exact' for model_type {mt!r} "
                             f"({family.variant} has only exact angles), got "
                             f"{rope_precision!r}")
        ours["rope_precision"] = rope_precision
    try:
        variants.VARIANTS[family.variant].config(ours)
    except (ValueError, TypeError) as e:
        raise ValueError(f"model_type {mt!r}: {e}") from None
    return mt, family, ours


def expected_state(config, state_dict, *, layer_idx=0, kind=None) -> tuple[str, dict, dict]:
    """(variant, our configuration, {state-dict key: shape}) of a layer as ``from_hf`` would
    convert it: the keys and shapes of the arrays the config implies, from the config and
    which keys ``state_dict`` has (its values are not read: anything will do). Checking a
    checkpoint's headers against these before reading its arrays finds a missing key or a
    wrong shape without reading a byte of data."""
    mt, family, ours = _resolve(config, state_dict, layer_idx, kind, "exact")
    spec = variants.VARIANTS[family.variant]
    full = spec.config(ours)
    key = (mt, kind, repr(sorted(full.items())))
    if key not in _SHAPES:  # placeholders of one byte an element, laid out by from_neutral
        zeros = {n: np.zeros(s, np.int8) for n, s in spec.shapes(full).items()}
        _SHAPES[key] = {k: tuple(a.shape) for k, a in family.from_neutral(zeros, full).items()}
    return family.variant, ours, dict(_SHAPES[key])


_SHAPES: dict = {}


def from_hf(config, state_dict, *, layer_idx=0, kind=None, rope_precision="exact"):
    """(variant, config, params) of one attention layer of a Hugging Face checkpoint: see the
    module's docstring. ``kind`` says which attention of an encoder-decoder's layer ("encoder",
    "decoder" or "cross", see ``Kinds``); None for the families with one attention.
    ``rope_precision="hf"`` asks for HF's float32 RoPE angles (to compare with HF itself;
    "exact": float64 angles rounded once)."""
    mt, family, ours = _resolve(config, state_dict, layer_idx, kind, rope_precision)
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
    return family.variant, HFConfig(ours, mt, kind), params


def to_hf(variant, config, params, *, model_type=None) -> dict:
    """The attention module's state dict (NumPy copies, the family's names and layouts) from
    our variant, configuration and parameters; ``model_type`` defaults to the one ``from_hf``
    recorded in ``config``."""
    mt = model_type if model_type is not None else getattr(config, "model_type", None)
    if mt is None:
        raise ValueError("model_type should be given (config did not come from from_hf), "
                         "got None")
    family = _kind_of_variant(_family(mt), mt, variant, getattr(config, "kind", None))
    if variant != family.variant:
        raise ValueError(f"variant should be {family.variant!r} for model_type {mt!r}, got "
                         f"{variant!r}")
    ours = variants.VARIANTS[variant].config(dict(config))
    return family.from_neutral({n: _numpy(a) for n, a in params.items()}, ours)


# ---- encoders, encoder-decoders and vision towers (issue 25, step 2) ---------------------------
#
# Which arrays and which output. BERT and RoBERTa: the state dict of ``layer.attention``
# (``self.query``, ``self.key``, ``self.value``, ``output.dense``); its ``output.LayerNorm.*``
# belong to the residual block after the attention (LayerNorm(dense(a) + x)) and are not read
# (to_hf does not give them): our module's output is ``output.dense``'s. ViT (5.x: ``q_proj`` ...
# ``o_proj`` on ``layer.attention``), CLIP and SigLIP (``self_attn``: ``q_proj`` ... ``out_proj``)
# compute exactly the attention. Whisper, BART and T5 have three attentions: ``kind="encoder"``
# (the encoder's self-attention, bidirectional), ``"decoder"`` (the decoder's, causal) and
# ``"cross"`` (the decoder's ``encoder_attn`` / ``EncDecAttention``, our
# MultiHeadCrossAttention); ``layer_idx`` counts the layers of that stack. Composite configs
# (``clip``, ``siglip``) are not read: pass their ``text_config`` or ``vision_config``
# (``clip_text_model``, ``clip_vision_model``, ``siglip_text_model``, ``siglip_vision_model``).
#
# Whisper's self-attention has no key bias (k_proj bias=False), our GroupedQueryAttention q, k
# and v biases all or none: ``b_key`` is zeros, which changes nothing (k + 0 = k exactly; and
# any b_key adds q·b_key, the same for every key of a query row, which softmax removes), so
# to_hf leaves it out whatever it holds. Its cross-attention is key_bias=False as it is.
#
# T5 computes its relative position bias in layer 0 of each stack (``relative_attention_bias``,
# (K, N)) and passes it to the later layers, whose state dicts have no table: for layer_idx > 0
# put layer 0's ``relative_attention_bias.weight`` (of the same stack) into the state dict;
# each of our modules holds its own copy, and to_hf gives it back under that name. T5's
# cross-attention has no table (a ``relative_attention_bias.weight`` some checkpoints store for
# it is unused by transformers and not read here).
#
# Dropout on the attention weights (attention_probs_dropout_prob, attention_dropout,
# dropout_rate) becomes GroupedQueryAttention's ``dropout`` (training only); our
# MultiHeadCrossAttention has none, so a cross-attention with a non-zero rate is refused
# (set it to 0.0: in inference HF's dropout is off too).

MHCA = "multi_head_cross_attention"
KINDS = ("encoder", "decoder", "cross")
BERT_NAMES = {"query": "self.query", "key": "self.key", "value": "self.value",
              "out": "output.dense"}
OUT_PROJ_NAMES = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "out": "out_proj"}
T5_NAMES = {"query": "q", "key": "k", "value": "v", "out": "o"}
T5_TABLE = "relative_attention_bias.weight"


class Kinds(dict):
    """A model_type with several attentions (an encoder-decoder): kind ("encoder", "decoder",
    "cross") -> Family; from_hf's ``kind=`` chooses, to_hf reads it from the config (or, given
    a plain dict, takes the kind whose variant it is: the encoder's and the decoder's
    self-attention name their arrays alike)."""


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


def _self_family(mt, names, *, width, heads, causal=False, dropout=None, head_dim=None,
                 zero_key_bias=False, relative=False, unsupported=None) -> Family:
    """A bidirectional (or causal) self-attention with separate q, k, v, out linears: sizes
    from the config fields ``width`` and ``heads`` (Dh = width // N unless ``head_dim(c)``),
    biases from the state dict; ``causal`` a bool or ``causal(c)``; ``dropout`` the config
    field of the weights' dropout; ``zero_key_bias``: k has no bias where q and v have one
    (Whisper); ``relative``: T5's scale 1 and bucketed bias table."""

    def settings(c, layer_idx, sd):
        n, d = int(c[heads]), int(c[width])
        ours = dict(d_in=d, num_heads=n, num_kv_heads=n,
                    head_dim=int(head_dim(c)) if head_dim is not None else d // n,
                    causal=bool(causal(c) if callable(causal) else causal))
        if zero_key_bias:
            if f"{names['key']}.bias" in sd:
                raise ValueError(f"model_type {mt!r}: {names['key']} should have no bias, got "
                                 f"{names['key']}.bias")
            ours.update(qkv_bias=f"{names['query']}.bias" in sd,
                        out_bias=f"{names['out']}.bias" in sd)
        else:
            ours.update(_bias_flags(sd, names, mt))
        if dropout is not None and c.get(dropout):
            ours["dropout"] = float(c[dropout])
        if relative:
            ours.update(scale=1.0,
                        relative_attention_num_buckets=int(c["relative_attention_num_buckets"]),
                        relative_attention_max_distance=int(c["relative_attention_max_distance"]))
            if T5_TABLE not in sd:
                raise ValueError(f"model_type {mt!r}: the state dict has no {T5_TABLE!r}: T5 "
                                 f"computes the position bias in layer 0 of each stack and "
                                 f"shares it; for layer {layer_idx} put layer 0's table (of the "
                                 f"same stack) into the state dict under that name")
        return ours

    def to_neutral(sd, ours):
        params = _linears_to_neutral(sd, names, mt)
        if zero_key_bias and ours["qkv_bias"]:
            params["b_key"] = np.zeros(params["W_key"].shape[1], params["W_key"].dtype)
        if relative:
            params["relative_attention_bias"] = _read(sd, T5_TABLE, mt)
        return params

    def from_neutral(params, ours):
        keep = {n: a for n, a in params.items()
                if not (zero_key_bias and n == "b_key") and n != "relative_attention_bias"}
        sd = _neutral_to_linears(keep, names)
        if "relative_attention_bias" in params:
            sd[T5_TABLE] = np.array(params["relative_attention_bias"])
        return sd

    return Family(GQA, settings, to_neutral, from_neutral, dict(unsupported or {}))


def _cross_family(mt, names, *, width, heads, head_dim=None, scale=None, dropout) -> Family:
    """The decoder's attention over the encoder's output: MultiHeadCrossAttention, d_context =
    d_in = ``width``; q and v have biases or not alike, k may differ (key_bias)."""

    def settings(c, layer_idx, sd):
        if c.get(dropout):
            raise ValueError(f"model_type {mt!r}: {dropout} = {c[dropout]!r} is not supported "
                             f"for the cross-attention (MultiHeadCrossAttention has no dropout; "
                             f"set it to 0.0, as in inference, where HF's is off too)")
        has = {role: f"{names[role]}.bias" in sd for role in ROLES}
        if has["query"] != has["value"]:
            raise ValueError(f"model_type {mt!r}: q and v should both have a bias or neither, "
                             f"got {names['query']}: {has['query']}, {names['value']}: "
                             f"{has['value']}")
        n, d = int(c[heads]), int(c[width])
        ours = dict(d_in=d, d_context=d, num_heads=n,
                    head_dim=int(head_dim(c)) if head_dim is not None else d // n,
                    qkv_bias=has["query"], out_bias=has["out"])
        if has["key"] != has["query"]:
            ours["key_bias"] = has["key"]
        if scale is not None:
            ours["scale"] = scale
        return ours

    return Family(MHCA, settings, lambda sd, ours: _linears_to_neutral(sd, names, mt),
                  lambda params, ours: _neutral_to_linears(params, names))


def _encoder_decoder(mt, names, *, zero_key_bias=False) -> Kinds:
    """Whisper and BART: encoder_attention_heads and decoder_attention_heads over d_model."""
    common = dict(width="d_model", dropout="attention_dropout", zero_key_bias=zero_key_bias)
    return Kinds(encoder=_self_family(mt, names, heads="encoder_attention_heads", **common),
                 decoder=_self_family(mt, names, heads="decoder_attention_heads", causal=True,
                                      **common),
                 cross=_cross_family(mt, names, width="d_model", heads="decoder_attention_heads",
                                     dropout="attention_dropout"))


def _t5() -> Kinds:
    common = dict(width="d_model", heads="num_heads", head_dim=lambda c: c["d_kv"])
    return Kinds(encoder=_self_family("t5", T5_NAMES, dropout="dropout_rate", relative=True,
                                      **common),
                 decoder=_self_family("t5", T5_NAMES, dropout="dropout_rate", relative=True,
                                      causal=True, **common),
                 cross=_cross_family("t5", T5_NAMES, scale=1.0, dropout="dropout_rate",
                                     **common))


def _bert(mt) -> Family:
    return _self_family(mt, BERT_NAMES, width="hidden_size", heads="num_attention_heads",
                        causal=lambda c: c.get("is_decoder", False),
                        dropout="attention_probs_dropout_prob", unsupported={
                            "position_embedding_type": ((None, "absolute"), "relative_key and "
                                                        "relative_key_query scores are not "
                                                        "expressed")})


def _tower(mt, causal) -> Family:
    """CLIP's and SigLIP's text and vision transformers: CLIPAttention, SiglipAttention."""
    return _self_family(mt, OUT_PROJ_NAMES, width="hidden_size", heads="num_attention_heads",
                        causal=causal, dropout="attention_dropout")


FAMILIES.update({
    "bert": _bert("bert"),
    "roberta": _bert("roberta"),
    "vit": _self_family("vit", LLAMA_NAMES, width="hidden_size", heads="num_attention_heads",
                        dropout="attention_probs_dropout_prob",
                        head_dim=lambda c: c.get("head_dim") or (c["hidden_size"]
                                                                 // c["num_attention_heads"])),
    "clip_text_model": _tower("clip_text_model", causal=True),
    "clip_vision_model": _tower("clip_vision_model", causal=False),
    "siglip_text_model": _tower("siglip_text_model", causal=False),
    "siglip_vision_model": _tower("siglip_vision_model", causal=False),
    "whisper": _encoder_decoder("whisper", OUT_PROJ_NAMES, zero_key_bias=True),
    "bart": _encoder_decoder("bart", OUT_PROJ_NAMES),
    "t5": _t5(),
})


# ---- multi-head latent attention: DeepSeek-V3 (Kimi K2's checkpoints are this model_type) ---

MLA = "multi_head_latent_attention"
MLA_NAMES = {"W_query": "q_proj", "W_q_a": "q_a_proj", "W_q_b": "q_b_proj",
             "W_kv_a": "kv_a_proj_with_mqa", "W_kv_b": "kv_b_proj", "W_out": "o_proj"}
MLA_NORMS = {"q_a_norm": "q_a_layernorm.weight", "kv_a_norm": "kv_a_layernorm.weight"}


def _deepseek_settings(c, layer_idx, sd):
    mt = "deepseek_v3"
    n = c["num_attention_heads"]
    if (c.get("num_key_value_heads") or n) != n:
        raise ValueError(f"model_type {mt!r}: num_key_value_heads should equal "
                         f"num_attention_heads = {n} (latent attention expands one latent to "
                         f"every head), got {c['num_key_value_heads']}")
    rope = _rope(c, None, mt)
    ours = dict(d_in=c["hidden_size"], num_heads=n, kv_lora_rank=c["kv_lora_rank"],
                qk_nope_head_dim=c["qk_nope_head_dim"], qk_rope_head_dim=c["qk_rope_head_dim"],
                v_head_dim=c["v_head_dim"], q_lora_rank=c.get("q_lora_rank"),
                attention_bias=bool(c.get("attention_bias", False)),
                # DeepseekV3Attention builds its two norms with RMSNorm's default eps, 1e-6,
                # whatever config.rms_norm_eps says: what HF computes is what we convert
                rms_norm_eps=1e-6, rope_interleaved=bool(c.get("rope_interleave", True)),
                **rope)
    return ours


def _deepseek_to_neutral(sd, ours):
    params = {}
    for name, hf_name in MLA_NAMES.items():
        if f"{hf_name}.weight" in sd:
            params[name] = np.ascontiguousarray(_read(sd, f"{hf_name}.weight", "deepseek_v3").T)
            if f"{hf_name}.bias" in sd:
                params["b" + name[1:]] = _numpy(sd[f"{hf_name}.bias"])
    for name, key in MLA_NORMS.items():
        if key in sd:
            params[name] = _numpy(sd[key])
    return params


def _deepseek_from_neutral(params, ours):
    sd = {}
    for name, hf_name in MLA_NAMES.items():
        if name in params:
            sd[f"{hf_name}.weight"] = np.ascontiguousarray(np.asarray(params[name]).T)
            if "b" + name[1:] in params:
                sd[f"{hf_name}.bias"] = np.array(params["b" + name[1:]])
    for name, key in MLA_NORMS.items():
        if name in params:
            sd[key] = np.array(params[name])
    return sd


FAMILIES.update({
    "deepseek_v3": Family(MLA, _deepseek_settings, _deepseek_to_neutral, _deepseek_from_neutral),
})

"""The softmax attention layers of hybrid models, whose other layers are Mamba (or RG-LRU)
recurrences: Falcon-H1, Jamba, Bamba, Granite 4 (granitemoehybrid), Nemotron-H, Zamba, Zamba 2
and RecurrentGemma; and Ling 3.0 (bailing_hybrid), whose softmax layers are latent attention
with a σ gate per head and whose others are Kimi Delta Attention (gated linear attention,
converted by golden.hf.linear). Each Mamba hybrid's attention is Llama's shape (q_proj, k_proj, v_proj, o_proj)
with what it changes (no RoPE, a scale, a width in and out, a local window); each config says
in its own words which layers are attention (``_block_kinds``), and ``from_hf`` of any other
layer is a ValueError naming the layer's kind, as Qwen3-Next's linear_attention layers are.
``layer_kinds`` gives the checkpoint verifier the same answer for every layer.

Every layer index here is the layer's position among all the model's layers (HF's attention
modules are built with it, and the configs count with it).

Shape legend: D (= d_in) the model's width, N query heads, Nkv key-value heads, Dh head width,
r an adapter's rank.
"""

from __future__ import annotations

import numpy as np

from golden.hf.family import (GQA, LLAMA_NAMES, Family, Stack, _bias_flags, _decoder_settings,
                              _linears_to_neutral, _neutral_to_linears, _read)
from golden.hf.latent import (MLA, _deepseek_from_neutral, _deepseek_to_neutral,
                              _latent_settings)

# HF's legacy names of a layer's kind (transformers' configuration_utils remaps them so) and
# Nemotron-H's hybrid_override_pattern characters.
_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}
_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
# Each family's kind of a layer that is softmax attention, and what its other layers are.
ATTENTION = {"full_attention", "sliding_attention", "hybrid"}
OTHERS = {"linear_attention": "Mamba, not softmax attention",
          "recurrent": "RG-LRU recurrence, not softmax attention",
          "moe": "a mixture of experts, no attention", "mlp": "an MLP, no attention"}
# A family whose kind of layer is another thing than OTHERS says: {model_type: {kind: what}}.
OTHERS_OF = {"bailing_hybrid": {"linear_attention": "Kimi Delta Attention, gated linear "
                                                    "attention, not softmax attention"}}


def _count(c, mt) -> int:
    n = c.get("num_hidden_layers")
    if not isinstance(n, int):
        raise ValueError(f"model_type {mt!r}: num_hidden_layers should be an int, got {n!r}")
    return n


def _block_kinds(c, mt) -> list:
    """Each layer's kind as HF's config derives it: "full_attention", "sliding_attention" or
    "hybrid" (Zamba's Mamba layer with the shared attention block before it, Falcon-H1's
    attention beside its Mamba) for the layers with softmax attention; "linear_attention"
    (Mamba), "recurrent", "moe", "mlp" for the others."""
    if mt == "falcon_h1":  # attention and Mamba side by side in every layer
        return ["hybrid"] * _count(c, mt)
    if mt == "jamba":
        period, offset = int(c.get("attn_layer_period", 8)), int(c.get("attn_layer_offset", 4))
        return ["full_attention" if i % period == offset else "linear_attention"
                for i in range(_count(c, mt))]
    if mt == "bamba":
        indices = c.get("attn_layer_indices") or []
        return ["full_attention" if i in indices else "linear_attention"
                for i in range(_count(c, mt))]
    if mt == "recurrent_gemma":  # block_types repeated over the layers; attention is local
        types = list(c.get("block_types") or ("recurrent", "recurrent", "attention"))
        return ["sliding_attention" if t == "attention" else t
                for t in (types * _count(c, mt))[:_count(c, mt)]]
    if mt == "nemotron_h" and c.get("layers_block_type") is None and c.get(
            "hybrid_override_pattern") is not None:
        return [_PATTERN[ch] for ch in c["hybrid_override_pattern"]]
    key = "layer_types" if mt in ("granitemoehybrid", "bailing_hybrid") else "layers_block_type"
    types = c.get(key)
    if types is None and mt == "zamba":  # HF's default: two Mamba layers, then the period's
        period, offset = int(c.get("attn_layer_period", 6)), int(c.get("attn_layer_offset", 4))
        types = ["linear_attention"] * 2 + ["hybrid"] + [
            "hybrid" if i % period == offset else "linear_attention"
            for i in range(_count(c, mt) - 3)]
    if not isinstance(types, list):
        raise ValueError(f"model_type {mt!r}: {key} should be a list of each layer's kind, "
                         f"got {types!r}")
    return [_LEGACY.get(t, t) for t in types]


def layer_kinds(c) -> list | None:
    """Each layer's kind (``_block_kinds``) of a hybrid family's config dict, None for a
    model_type not of this table: the checkpoint verifier checks the layers whose kind is in
    ``ATTENTION`` and names the others."""
    mt = c.get("model_type")
    return _block_kinds(c, mt) if mt in FAMILIES else None


def _attention_layer(c, layer_idx, mt) -> str:
    """Layer ``layer_idx``'s kind, a ValueError naming it where it is not softmax attention."""
    kinds = _block_kinds(c, mt)
    if not 0 <= layer_idx < len(kinds):
        raise ValueError(f"layer_idx should be in [0, {len(kinds)}) (model_type {mt!r}'s "
                         f"layers), got {layer_idx}")
    kind = kinds[layer_idx]
    if kind not in ATTENTION:
        attention = [i for i, k in enumerate(kinds) if k in ATTENTION]
        what = {**OTHERS, **OTHERS_OF.get(mt, {})}.get(kind, "not softmax attention")
        raise ValueError(f"model_type {mt!r}: layer {layer_idx} is a {kind!r} layer ({what}); "
                         f"only its attention layers convert ({', '.join(map(str, attention)) or 'none'})")
    return kind


def _no_rope(ours):
    ours.pop("rope_parameters", None)
    ours.pop("rope_theta", None)


def _falcon_h1(c, layer_idx, ours):
    """Falcon-H1: Llama's attention with the keys multiplied by key_multiplier before RoPE
    (RoPE is linear, so the scores are multiplied by it: our scale Dh^-1/2·key_multiplier).
    attention_in_multiplier and attention_out_multiplier scale the attention module's input
    and output in HF's decoder layer, outside the module (as its norms are): not the module's,
    so not converted."""
    ours.pop("sliding_window", None)
    ours["scale"] = ours["head_dim"] ** -0.5 * float(c.get("key_multiplier", 1.0))


def _no_positions(c, layer_idx, ours):
    """Jamba, Nemotron-H: Llama's projections, no RoPE (HF's attention takes no positions), a
    causal mask, no window."""
    _no_rope(ours)
    ours.pop("sliding_window", None)


def _bamba(c, layer_idx, ours):
    """Bamba: Llama's attention, RoPE on the first partial_rotary_factor of each head (0.5,
    which HF's config sets itself), no window."""
    ours.pop("sliding_window", None)


def _granitemoehybrid(c, layer_idx, ours):
    """Granite 4: Granite's scale (attention_multiplier); RoPE only with
    position_embedding_type "rope" (HF's default None: NoPE, its model passes no positions);
    no window."""
    ours.pop("sliding_window", None)
    ours["scale"] = float(c["attention_multiplier"])
    if c.get("position_embedding_type") != "rope":
        _no_rope(ours)


def _recurrent_gemma(c, layer_idx, ours):
    """RecurrentGemma (Griffin): local attention within attention_window_size keys (HF's
    sliding_window), RoPE on the first half of each head (partial_rotary_factor 0.5 by HF's
    config), multi-query (num_key_value_heads 1 in the published models), o_proj with a bias;
    HF's rotary embedding takes the default rope_type only."""
    ours["sliding_window"] = int(c["attention_window_size"])
    rope = ours["rope_parameters"]
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"model_type 'recurrent_gemma': rope_parameters['rope_type'] = "
                         f"{rope['rope_type']!r} is not supported (HF's RecurrentGemma takes "
                         f"'default' only)")


def _zamba(c, ours):
    """Zamba and Zamba 2's shared attention block: its input is the concatenation of the
    hidden state and the original embedding, (B, L, 2D) (attention_hidden_size), its output
    (B, L, D); head width attention_head_dim (2D / N by HF's config); HF scales the scores by
    (Dh / 2)^-1/2; no window."""
    ours.pop("sliding_window", None)
    ours.update(d_in=int(c["attention_hidden_size"]), d_out=int(c["hidden_size"]),
                head_dim=int(c["attention_head_dim"]))
    ours["scale"] = (ours["head_dim"] / 2) ** -0.5


def _zamba1(c, layer_idx, ours):
    _zamba(c, ours)
    _no_rope(ours)


def _zamba2(c, layer_idx, ours):
    """Zamba 2: Zamba's block; RoPE over the whole head only with use_mem_rope (HF's rotary
    width is head_dim, which its config maps to attention_head_dim)."""
    _zamba(c, ours)
    if not c.get("use_mem_rope"):
        _no_rope(ours)


def _hybrid(mt, extra, **family) -> Family:
    """A hybrid family's attention layers: LLAMA_NAMES' projections, the shared decoder
    settings with the family's ``extra``, any other layer refused by name."""

    def settings(c, layer_idx, sd):
        _attention_layer(c, layer_idx, mt)
        ours = _decoder_settings(c, layer_idx, mt=mt)
        ours.update(_bias_flags(sd, LLAMA_NAMES, mt))
        extra(c, layer_idx, ours)
        return ours

    def to_neutral(sd, ours):
        return _linears_to_neutral(sd, LLAMA_NAMES, mt)

    def from_neutral(params, ours):
        return _neutral_to_linears(params, LLAMA_NAMES)

    return Family(GQA, settings, to_neutral, from_neutral, **family)


ADAPTERS = {"q_proj": "linear_q_adapter_list", "k_proj": "linear_k_adapter_list",
            "v_proj": "linear_v_adapter_list"}


def _zamba2_call_site(c, layer_idx, sd):
    """Zamba 2's shared block as hybrid layer ``layer_idx`` computes with it. With
    use_shared_attention_adapter HF adds to q, k and v, at the call site of the j-th hybrid
    layer, the low-rank term W1_j (2D, r) · W0_j (r, 2D) · x: a linear map added to a linear
    map, so the layer's q_proj.weight is q_proj.weight + W1_j · W0_j (and so for k and v),
    the same function of x (summed in another order: float64 rounding apart). The adapters
    of the other call sites are dropped; to_hf gives back the folded projections."""
    _attention_layer(c, layer_idx, "zamba2")
    full, sd = sd, {k: v for k, v in sd.items() if not k.startswith(tuple(ADAPTERS.values()))}
    if not c.get("use_shared_attention_adapter"):
        return sd
    j = [i for i, k in enumerate(_block_kinds(c, "zamba2")) if k == "hybrid"].index(layer_idx)
    for proj, name in ADAPTERS.items():
        down = _read(full, f"{name}.{j}.0.weight", "zamba2")  # (r, 2D)
        up = _read(full, f"{name}.{j}.1.weight", "zamba2")  # (2D, r)
        sd[f"{proj}.weight"] = _read(sd, f"{proj}.weight", "zamba2") + up @ down
    return sd


def _bailing_settings(c, layer_idx, sd):
    """Ling 3.0 (bailing_hybrid)'s softmax layers (BailingHybridAttention): DeepSeek-V3's latent
    attention without a q LoRA (q_proj), its pairs always interleaved
    (apply_rotary_pos_emb_interleave; the config has no rope_interleave), and the output times
    σ(x g_proj) per head (g_proj D -> N, no bias): output_gate="sigmoid_per_head"."""
    mt = "bailing_hybrid"
    _attention_layer(c, layer_idx, mt)
    ours = _latent_settings(mt, interleaved=True)({**c, "q_lora_rank": None}, layer_idx, sd)
    ours["output_gate"] = "sigmoid_per_head"
    return ours


def _bailing_to_neutral(sd, ours):
    params = _deepseek_to_neutral(sd, ours)
    params["W_gate"] = _read(sd, "g_proj.weight", "bailing_hybrid").T.copy()  # (D, N)
    return params


def _bailing_from_neutral(params, ours):
    sd = _deepseek_from_neutral(params, ours)
    sd["g_proj.weight"] = np.ascontiguousarray(np.asarray(params["W_gate"]).T)  # (N, D)
    return sd


FAMILIES: dict[str, Family] = {
    "falcon_h1": _hybrid("falcon_h1", _falcon_h1),
    "jamba": _hybrid("jamba", _no_positions),
    "bamba": _hybrid("bamba", _bamba),
    "granitemoehybrid": _hybrid("granitemoehybrid", _granitemoehybrid),
    # Nemotron-H keeps each layer's one mixer (Mamba-2, attention, MLP or MoE) at
    # layers.N.mixer
    "nemotron_h": _hybrid("nemotron_h", _no_positions, stacks=(Stack("layers", "mixer"),)),
    "zamba": _hybrid("zamba", _zamba1, stacks=(Stack("layers", "shared_transf.self_attn"),),
                     unverified="attn-parity hf does not check Zamba checkpoints yet: its "
                                "shared attention block is saved once (the other hybrid "
                                "layers' copies are tied to it) and its one-layer model has "
                                "not been run"),
    "zamba2": _hybrid("zamba2", _zamba2, call_site=_zamba2_call_site,
                      stacks=(Stack("layers", "shared_transformer.self_attn"),),
                      unverified="attn-parity hf does not check Zamba 2 checkpoints yet: its "
                                 "shared blocks are saved once and each hybrid layer's "
                                 "adapters sit at that layer's index in the block's lists, "
                                 "which a one-layer model does not have"),
    # RecurrentGemma keeps each layer's temporal block (attention or RG-LRU) at
    # layers.N.temporal_block
    "recurrent_gemma": _hybrid("recurrent_gemma", _recurrent_gemma,
                               stacks=(Stack("layers", "temporal_block"),),
                               model_class="RecurrentGemmaModel"),
    # Ling 3.0: its full_attention layers are latent attention with a σ gate per head (its
    # linear_attention layers: golden.hf.linear). Its files keep Ling's own names, which
    # transformers renames on loading (conversion_mapping's "bailing_hybrid"):
    # layers.N.attention (the module's self_attn), its dense (o_proj)
    "bailing_hybrid": Family(MLA, _bailing_settings, _bailing_to_neutral, _bailing_from_neutral,
                             stacks=(Stack("layers", "attention", in_model=("layers", "self_attn"),
                                           renames=(("dense.", "o_proj."),)),)),
}



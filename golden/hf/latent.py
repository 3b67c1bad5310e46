"""Multi-head latent attention: DeepSeek-V3 (Kimi K2's checkpoints are this model_type) and the
model types whose attention is its own after mapping config fields, one entry of ``FAMILIES``
each. Keys and values come from a low-rank latent (``kv_a_proj_with_mqa``, its RMSNorm,
``kv_b_proj``), queries from ``q_proj`` or, with a ``q_lora_rank``, from ``q_a_proj``, its
RMSNorm and ``q_b_proj``; our MultiHeadLatentAttention holds the same arrays, transposed to
(in, out). What differs between the entries is the pairing of RoPE's features (interleaved
(2i, 2i + 1) or rotate-half (i, i + Dr/2)) and LongCat-Flash's two scalings, folded. The
checkpoint keeps the attention at ``layers.N.self_attn`` (the Family's default ``stacks``),
LongCat-Flash's two per layer at ``layers.N.self_attn.0`` and ``.1``.

Shape legend: D (= d_in) the model's width, N heads, r kv_lora_rank, r_q q_lora_rank, Dr
qk_rope_head_dim.
"""

from __future__ import annotations

import numpy as np

from golden.hf.family import Family, LayerNotSupported, Stack, _read, _rope, llama4_scaling
from golden.specification import variants
from golden.specification.mapping import _numpy

MLA = "multi_head_latent_attention"
MLA_NAMES = {"W_query": "q_proj", "W_q_a": "q_a_proj", "W_q_b": "q_b_proj",
             "W_kv_a": "kv_a_proj_with_mqa", "W_kv_b": "kv_b_proj", "W_out": "o_proj"}
MLA_NORMS = {"q_a_norm": "q_a_layernorm.weight", "kv_a_norm": "kv_a_layernorm.weight"}


def _kimi_linear_settings(c, layer_idx, sd):
    """Kimi Linear's softmax layers (KimiLinearAttention; its linear layers are golden.hf.linear's
    Kimi Delta Attention): DeepSeek-V3's latent attention with no RoPE at all (its rotary key
    head and q's rotary features enter the scores unturned: ``rope=False``), no q LoRA when
    q_lora_rank is None, the norms' eps 1e-6 (KimiLinearRMSNorm's default)."""
    mt = "kimi_linear"
    ours = _latent_settings(mt)({**c, "head_dim": None}, layer_idx, sd)
    for name in ("rope_parameters", "rope_theta", "rope_interleaved"):
        ours.pop(name, None)
    ours["rope"] = False
    return ours


def _latent_settings(mt, interleaved=None):
    """The settings function of a DeepSeek-V3-like model_type ``mt``: its pairs interleaved as
    the config's ``rope_interleave`` says (default True), or always (True) or never (False)
    whatever it says, as ``interleaved`` fixes them (HF's attention of that family reads no
    field)."""

    def settings(c, layer_idx, sd):
        n = c["num_attention_heads"]
        if (c.get("num_key_value_heads") or n) != n:
            raise ValueError(f"model_type {mt!r}: num_key_value_heads should equal "
                             f"num_attention_heads = {n} (latent attention expands one latent "
                             f"to every head), got {c['num_key_value_heads']}")
        rope_dim = c["qk_rope_head_dim"]
        if c.get("head_dim") is not None and c["head_dim"] != rope_dim:
            raise ValueError(f"model_type {mt!r}: head_dim should equal qk_rope_head_dim = "
                             f"{rope_dim} (HF's rotary embedding makes head_dim angles, its "
                             f"attention turns qk_rope_head_dim features), got {c['head_dim']}")
        pairs = bool(c.get("rope_interleave", True)) if interleaved is None else interleaved
        return dict(d_in=c["hidden_size"], num_heads=n, kv_lora_rank=c["kv_lora_rank"],
                    qk_nope_head_dim=c["qk_nope_head_dim"], qk_rope_head_dim=rope_dim,
                    v_head_dim=c["v_head_dim"], q_lora_rank=c.get("q_lora_rank"),
                    attention_bias=bool(c.get("attention_bias", False)),
                    # DeepseekV3Attention (and those built on it) makes its two norms with
                    # RMSNorm's default eps, 1e-6, whatever config.rms_norm_eps says: what HF
                    # computes is what we convert
                    rms_norm_eps=1e-6, rope_interleaved=pairs, **_rope(c, None, mt))
    return settings


_deepseek_settings = _latent_settings("deepseek_v3")


def _mistral4_settings(c, layer_idx, sd):
    """Mistral Small 4 (mistral4): DeepSeek-V3's attention (rope_interleave read) with Llama 4's
    query temperature 1 + β·ln(1 + ⌊p / F⌋) after RoPE (β rope_parameters'
    llama_4_scaling_beta, F its original_max_position_embeddings, no shift); HF's head_dim is
    Dn + Dr and its rotary fraction Dr / head_dim, which turn Dr features, as ours."""
    mt = "mistral4"
    rope = dict(c.get("rope_parameters") or {})
    temperature = llama4_scaling(rope, mt)
    dh = c.get("head_dim") or c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    fraction = rope.pop("partial_rotary_factor", None)
    if int(dh * (1.0 if fraction is None else fraction)) != c["qk_rope_head_dim"]:
        raise ValueError(f"model_type {mt!r}: head_dim · rope_parameters['partial_rotary_factor'] "
                         f"should be qk_rope_head_dim = {c['qk_rope_head_dim']} (HF's rotary "
                         f"embedding makes that many angles), got {dh} · {fraction!r}")
    for name in ("type", "max_position_embeddings", "llama_4_scaling_beta"):
        rope.pop(name, None)
    ours = _latent_settings(mt)({**c, "head_dim": None, "rope_parameters": rope}, layer_idx, sd)
    ours["query_temperature"] = temperature
    return ours


def _lora_scales(ours) -> tuple:
    """(s_q, s_kv) = (√(D / r_q), √(D / r)) from our settings (d_in, q_lora_rank,
    kv_lora_rank): the scales LongCat-Flash (mla_scale_q_lora, mla_scale_kv_lora) and
    dots.3-note (q_lora_scale, kv_lora_scale) put on their normalised latents, the same floats.
    HF multiplies a normalised latent w ⊙ n(c) by s, which is n(c) times the weight w·s (one
    rounding each way: to_hf's w·s / s is w to the last bit or next to it)."""
    return ((ours["d_in"] / ours["q_lora_rank"]) ** 0.5,
            (ours["d_in"] / ours["kv_lora_rank"]) ** 0.5)


def _longcat_settings(c, layer_idx, sd):
    """LongCat-Flash: DeepSeek-V3's attention, always a q LoRA and interleaved pairs, its query
    (both parts) times s_q: every score times s_q, so ours is HF's scaling (yarn mscale
    included) times s_q. Its normalised latent times s_kv is folded into kv_a_norm's weight
    (``_longcat_to_neutral``)."""
    mt = "longcat_flash"
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    if c.get("qk_head_dim") is not None and c["qk_head_dim"] != qk:
        raise ValueError(f"model_type {mt!r}: qk_head_dim should be qk_nope_head_dim + "
                         f"qk_rope_head_dim = {qk} (HF's q_b_proj makes that many features a "
                         f"head, its attention views them as qk_head_dim), got "
                         f"{c['qk_head_dim']}")
    ours = _latent_settings(mt, interleaved=True)(c, layer_idx, sd)
    scaling = variants.latent_scale(variants.get(MLA).config(ours))
    ours["scale"] = scaling * _lora_scales(ours)[0]
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


def _longcat_to_neutral(sd, ours):
    params = _deepseek_to_neutral(sd, ours)
    params["kv_a_norm"] = params["kv_a_norm"] * _lora_scales(ours)[1]
    return params


def _longcat_from_neutral(params, ours):
    sd = _deepseek_from_neutral(params, ours)
    sd["kv_a_layernorm.weight"] = sd["kv_a_layernorm.weight"] / _lora_scales(ours)[1]
    return sd


# The lightning indexer's arrays (DeepseekV32Indexer, at the attention's ``indexer.``): ours,
# Hugging Face's; the projections (out, in) there, (in, out) here.
INDEXER_NAMES = {"W_index_q": "indexer.wq_b", "W_index_k": "indexer.wk",
                 "W_index_weights": "indexer.weights_proj"}
INDEXER_NORMS = {"index_k_norm": "indexer.k_norm.weight",
                 "index_k_norm_bias": "indexer.k_norm.bias"}


def _shared_indexer(mt, c, layer_idx) -> bool:
    """Whether layer ``layer_idx`` is an indexer_types "shared" layer (GLM-5's, HY-V4's, Mistral
    Large 4's: no indexer of its own, the previous full layer's top-k choice reused; ours
    index_select "given", the choice passed as key_indices); ValueError for a kind that is
    neither "full" nor "shared"."""
    types = c.get("indexer_types")
    kind = "full" if types is None else types[layer_idx]
    if kind not in ("full", "shared"):
        raise ValueError(f"model_type {mt!r}: indexer_types[{layer_idx}] should be 'full' or "
                         f"'shared', got {kind!r}")
    return kind == "shared"


def _given(ours) -> bool:
    """Whether our settings are a "shared" layer's (index_select "given": no indexer arrays)."""
    return ours.get("index_select") == "given"


def _has_indexer(ours) -> bool:
    """Whether the layer holds indexer arrays: index_topk, and not a "shared" layer's (a
    dots.3-note full layer has none either)."""
    return ours.get("index_topk") is not None and not _given(ours)


def _indexer_settings(mt, index_rope, interleaved=True):
    """DeepSeek-V3.2's latent attention (its MLA RoPE always interleaved, whatever
    rope_interleave says: DeepseekV32Attention calls apply_rotary_pos_emb_interleave) with its
    lightning indexer (DeepseekV32Indexer): index_topk, index_n_heads, index_head_dim from the
    config; the indexer's query from the query latent (a q LoRA required: wq_b reads it), its
    RoPE on the first qk_rope_head_dim features, ``index_rope`` pairs ("half": DeepSeek-V3.2;
    "interleaved": GLM-5's GlmMoeDsaIndexer), D_I^−1/2 on the scores, the key's LayerNorm eps
    1e-6 (nn.LayerNorm(index_head_dim, eps=1e-6)). GLM-5's layers marked "shared" in
    indexer_types reuse the previous layer's choice: index_select "given", no indexer (each
    call passes the choice as key_indices)."""

    def settings(c, layer_idx, sd):
        if _shared_indexer(mt, c, layer_idx):
            ours = _latent_settings(mt, interleaved=interleaved)(c, layer_idx, sd)
            ours.update(index_topk=int(c["index_topk"]), index_select="given")
            return ours
        if not c.get("q_lora_rank"):
            raise ValueError(f"model_type {mt!r}: q_lora_rank should be a positive int (the "
                             f"indexer's wq_b reads the query latent), got "
                             f"{c.get('q_lora_rank')!r}")
        ours = _latent_settings(mt, interleaved=interleaved)(c, layer_idx, sd)
        ours.update(index_topk=int(c["index_topk"]), index_heads=int(c["index_n_heads"]),
                    index_head_dim=int(c["index_head_dim"]), index_rope=index_rope,
                    index_rope_dims="first", index_query="latent", index_scale="scores",
                    index_norm_eps=1e-6)
        return ours
    return settings


def _hy_v4_settings(c, layer_idx, sd):
    """HY-V4 (HYV4Attention, GLM-5's layer and DeepSeek-V3.2's indexer, its "shared" layers
    refused as GLM-5's): the attention's RoPE rotate-half (apply_rotary_pos_emb, whatever
    rope_interleave says), per-head sinks (s_aux), the output gated per feature by σ(x W_g)
    (gate_proj, H·Dv, no bias); the indexer's RoPE rotate-half on the *last* qk_rope_head_dim
    features of q^I and k^I (HYV4Indexer's "flipped" split), D_I^−1/2 on the head weights
    (weights · H_I^−1/2 · softmax_scale, the scores unscaled), its key's LayerNorm eps the
    config's rms_norm_eps."""
    ours = _indexer_settings("hy_v4", "half", interleaved=False)(c, layer_idx, sd)
    if not _given(ours):
        ours.update(index_rope_dims="last", index_scale="weights",
                    index_norm_eps=float(c["rms_norm_eps"]))
    ours.update(sinks=True, output_gate="sigmoid")
    return ours


# Mistral Large 4's learned RoPE scales (its rotary embedding's alpha buffer: the model's, beside
# the layers; from_hf reads it from the layer's state dict under this name, attn-parity hf
# from the checkpoint's model.rotary_emb.alpha)
ROPE_ALPHA = "rotary_emb.alpha"
# Mistral Large 4's arrays beyond DeepSeek-V3.2's: ours, Hugging Face's.
MISTRAL_LARGE4_NAMES = {"temperature_scale": "softmax_scaling.scale",
                        "temperature_bias": "softmax_scaling.bias",
                        "index_q_norm": "indexer.q_input_norm.weight",
                        "index_q_norm_bias": "indexer.q_input_norm.bias",
                        "index_temperature_scale": "indexer.softmax_scaling.scale",
                        "index_temperature_bias": "indexer.softmax_scaling.bias"}


# (the file's, the module's) names of Mistral Large 4's checkpoints (transformers' conversion
# mapping renames them on loading; layers.N.attention is the model's layers.N.self_attn)
MISTRAL_LARGE4_FILE = (("wq.", "q_proj."), ("wkv_a_with_mqa.", "kv_a_proj_with_mqa."),
                       ("kv_a_norm.", "kv_a_layernorm."), ("wkv_b.", "kv_b_proj."),
                       ("ssmax_scaling.s", "softmax_scaling.scale"),
                       ("ssmax_scaling.b", "softmax_scaling.bias"),
                       ("indexer.ssmax_scaling.s", "indexer.softmax_scaling.scale"),
                       ("indexer.ssmax_scaling.b", "indexer.softmax_scaling.bias"),
                       ("lerope.alpha", ROPE_ALPHA),  # the composite's files: its RoPE scales
                       ("wo.", "o_proj."))  # and its output projection


def _mistral_large4_settings(c, layer_idx, sd):
    """Mistral Large 4's text attention (MistralLarge4TextAttention): DeepSeek-V3's latent
    attention without a q LoRA (q_proj), its pairs always interleaved, Mistral's learned query
    temperature s_h·ln(p + 1) + b_h on the whole query after RoPE (softmax_scaling), and the
    indexer (MistralLarge4TextIndexer): q^I from LayerNorm(x) (q_input_norm, ε 1e-6, with its
    bias) through wq_b, its own learned temperature before RoPE, interleaved RoPE on the first
    qk_rope_head_dim features, D_I^−1/2 on the scores, the key's LayerNorm ε 1e-6; the
    latent's RMSNorm ε rms_norm_eps (not DeepSeek-V3's fixed 1e-6). RoPE (yarn
    by default) with the model's learned per-pair scales e^α ("LeRoPE": rotary_emb.alpha,
    ``ROPE_ALPHA`` in the state dict, required: frequency_log_scale when not all 0). Refused by
    name: its NoPE layers (no_rope_layers 0: no rotary key head, which ours has) and layers
    that read another layer's latents (kv_source_layers); its indexer's "shared" layers take
    the previous layer's choice (index_select "given"), as GLM-5's."""
    mt = "mistral_large4_text"
    nope = c.get("no_rope_layers")
    if nope is not None and not nope[layer_idx]:
        raise LayerNotSupported(f"model_type {mt!r}: layer {layer_idx} is a NoPE layer "
                                f"(no_rope_layers 0: its queries and keys have no rotary part, "
                                f"which MultiHeadLatentAttention requires); its RoPE layers "
                                f"are supported")
    source = c.get("kv_source_layers")
    if source is not None and source[layer_idx] != layer_idx:
        raise LayerNotSupported(f"model_type {mt!r}: layer {layer_idx} attends layer "
                                f"{source[layer_idx]}'s latent cache (kv_source_layers), which "
                                f"is not supported: one layer alone cannot be checked")
    shared = _shared_indexer(mt, c, layer_idx)
    ours = _latent_settings(mt, interleaved=True)({**c, "head_dim": None}, layer_idx, sd)
    ours["rms_norm_eps"] = float(c["rms_norm_eps"])  # its kv_a_layernorm's (DeepSeek's: 1e-6)
    held = sd.get(ROPE_ALPHA)
    if held is None:
        _read(sd, ROPE_ALPHA, mt)  # the error naming it
    # (expected_state passes placeholders, whose values are not read: α changes no shape)
    alpha = np.asarray(held, np.float64).reshape(-1) if hasattr(held, "__array__") else None
    if alpha is not None and np.any(alpha != 0):
        if "rope_parameters" not in ours:
            ours["rope_parameters"] = {"rope_theta": ours.pop("rope_theta")}
        ours["rope_parameters"]["frequency_log_scale"] = [float(a) for a in alpha]
    ours.update(query_temperature={"kind": "learned"}, index_topk=int(c["index_topk"]))
    if shared:  # the previous full layer's choice, given
        ours["index_select"] = "given"
        return ours
    ours.update(index_heads=int(c["index_n_heads"]), index_head_dim=int(c["index_head_dim"]),
                index_rope="interleaved", index_rope_dims="first", index_query="layer_norm",
                index_temperature=True, index_scale="scores", index_norm_eps=1e-6)
    return ours


def _mistral_large4_names(ours) -> dict:
    """MISTRAL_LARGE4_NAMES, without the indexer's on a "shared" layer."""
    return {n: k for n, k in MISTRAL_LARGE4_NAMES.items()
            if not (_given(ours) and n.startswith("index_"))}


def _mistral_large4_to_neutral(sd, ours):
    params = _indexer_to_neutral(sd, ours)
    for name, key in _mistral_large4_names(ours).items():
        params[name] = _read(sd, key, "mistral_large4_text")
    return params


def _mistral_large4_from_neutral(params, ours):
    sd = _indexer_from_neutral(params, ours)
    for name, key in _mistral_large4_names(ours).items():
        sd[key] = np.array(params[name])
    rope = ours.get("rope_parameters") or {}
    alpha = rope.get("frequency_log_scale")
    sd[ROPE_ALPHA] = (np.zeros(ours["qk_rope_head_dim"] // 2) if alpha is None
                      else np.asarray(alpha, dtype=np.float64))
    return sd


# HY-V4's arrays beyond DeepSeek-V3.2's: ours, Hugging Face's (the gate (out, in) there).
HY_V4_NAMES = {"W_gate": "gate_proj.weight", "sinks": "sinks"}


def _hy_v4_to_neutral(sd, ours):
    params = _indexer_to_neutral(sd, ours)
    params["W_gate"] = np.ascontiguousarray(_read(sd, HY_V4_NAMES["W_gate"], "hy_v4").T)
    params["sinks"] = _read(sd, HY_V4_NAMES["sinks"], "hy_v4")
    return params


def _hy_v4_from_neutral(params, ours):
    sd = _indexer_from_neutral(params, ours)
    sd[HY_V4_NAMES["W_gate"]] = np.ascontiguousarray(np.asarray(params["W_gate"]).T)
    sd[HY_V4_NAMES["sinks"]] = np.array(params["sinks"])
    return sd


def _indexer_to_neutral(sd, ours):
    params, mt = _deepseek_to_neutral(sd, ours), getattr(ours, "model_type", "deepseek_v32")
    if not _has_indexer(ours):
        return params
    for name, hf_name in INDEXER_NAMES.items():
        params[name] = np.ascontiguousarray(_read(sd, f"{hf_name}.weight", mt).T)
    for name, key in INDEXER_NORMS.items():
        params[name] = _read(sd, key, mt)
    return params


def _indexer_from_neutral(params, ours):
    sd = _deepseek_from_neutral(params, ours)
    if not _has_indexer(ours):
        return sd
    for name, hf_name in INDEXER_NAMES.items():
        sd[f"{hf_name}.weight"] = np.ascontiguousarray(np.asarray(params[name]).T)
    for name, key in INDEXER_NORMS.items():
        sd[key] = np.array(params[name])
    return sd


# A.X-K2's fused query and gate (AXK2Attention): q_gate_proj (N·(Dk + Dv), 2·r_q) reads
# [RMSNorm(c_q) | c_q], each head's rows [q (Dk) | gate (Dv)]; ours W_q_b and W_gate, (2·r_q, ·).
AXK2_FUSED = "q_gate_proj.weight"


def _axk2_settings(c, layer_idx, sd):
    """A.X-K2 (AXK2Attention): DeepSeek-V3.2's latent attention and indexer (interleaved MLA
    pairs, the indexer's rotate-half on its first features, D_I^−1/2 on the scores), always a q
    LoRA, without q_b_proj: one q_gate_proj makes the query and an output gate per feature
    from [RMSNorm(c_q) | c_q] (``query_latent`` "normed_and_raw", ``output_gate`` "sigmoid";
    HF takes the σ in float32); the indexer's query reads RMSNorm(c_q)."""
    ours = _indexer_settings("axk2", "half", interleaved=True)(c, layer_idx, sd)
    ours.update(query_latent="normed_and_raw", output_gate="sigmoid")
    return ours


def _axk2_heads(ours) -> tuple:
    """(N, Dk, Dv) of A.X-K2's fused rows."""
    return (ours["num_heads"], ours["qk_nope_head_dim"] + ours["qk_rope_head_dim"],
            ours["v_head_dim"])


def _axk2_to_neutral(sd, ours):
    params = _indexer_to_neutral(sd, ours)
    n, dk, dv = _axk2_heads(ours)
    fused = _read(sd, AXK2_FUSED, "axk2")                     # (N·(Dk + Dv), 2·r_q)
    expected = (n * (dk + dv), 2 * ours["q_lora_rank"])
    if fused.shape != expected:
        raise ValueError(f"model_type 'axk2': {AXK2_FUSED} should be {expected} (N·(Dk + Dv), "
                         f"2·q_lora_rank), got {fused.shape}")
    rows = fused.reshape(n, dk + dv, -1)
    params["W_q_b"] = np.ascontiguousarray(rows[:, :dk].reshape(n * dk, -1).T)
    params["W_gate"] = np.ascontiguousarray(rows[:, dk:].reshape(n * dv, -1).T)
    return params


def _axk2_from_neutral(params, ours):
    sd = _indexer_from_neutral({n: a for n, a in params.items() if n not in (
        "W_q_b", "W_gate")}, ours)
    n, dk, dv = _axk2_heads(ours)
    q = np.asarray(params["W_q_b"]).T.reshape(n, dk, -1)
    gate = np.asarray(params["W_gate"]).T.reshape(n, dv, -1)
    sd[AXK2_FUSED] = np.ascontiguousarray(np.concatenate([q, gate], axis=1).reshape(
        n * (dk + dv), -1))
    return sd


# dots.3-note's text attention (Dots3NoteTextAttention): its layers' sizes from per_layer_config
# (keyed by the layer's index in config.json), its RoPE per layer type.
def _dots3_layer(c, layer_idx) -> tuple:
    """(the config with layer ``layer_idx``'s per_layer_config entries applied, its layer
    type)."""
    types = c.get("layer_types") or []
    kind = types[layer_idx] if layer_idx < len(types) else "indexed_attention"
    per = c.get("per_layer_config") or {}
    own = per.get(str(layer_idx), per.get(layer_idx, {}))
    return {**c, **(own.to_dict() if hasattr(own, "to_dict") else dict(own))}, kind


def _dots3_settings(c, layer_idx, sd):
    """dots.3-note's text attention: DeepSeek-V3.2's latent attention (interleaved MLA pairs)
    and GLM-5's indexer (interleaved indexer RoPE on the first features, D_I^−1/2 on the
    scores, the key's LayerNorm ε 1e-6) on its "indexed_attention" layers, none on its
    "full_attention" and "sliding_attention" ones (the latter in a window of sliding_window
    keys, the query's own included); every norm's ε the config's rms_norm_eps; the shared rotary key
    RMS-normalised before RoPE (k_rope_only_layernorm: ``rope_key_norm``); an output gate per
    head σ(x W_g) (g_proj); the normalised latents times √(D / r_q) and √(D / r) (HF's
    q_lora_scale, kv_lora_scale) folded into q_a_norm's and kv_a_norm's weights (the
    indexer's query reads the scaled one, as HF's); RoPE θ of the layer's type; each layer's
    sizes its per_layer_config entry's (the windowed layers' own heads and ranks)."""
    mt = "dots3_note_text"
    c, kind = _dots3_layer(c, layer_idx)
    if kind not in ("indexed_attention", "full_attention", "sliding_attention"):
        raise ValueError(f"model_type {mt!r}: layer_types[{layer_idx}] should be "
                         f"'indexed_attention', 'full_attention' or 'sliding_attention', got "
                         f"{kind!r}")
    rope = dict((c.get("rope_parameters") or {}).get(kind, c.get("rope_parameters")) or {})
    fraction = rope.pop("partial_rotary_factor", None)
    dh = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    if fraction is not None and int(dh * fraction) != c["qk_rope_head_dim"]:
        raise ValueError(f"model_type {mt!r}: head_dim · rope_parameters[{kind!r}]"
                         f"['partial_rotary_factor'] should be qk_rope_head_dim = "
                         f"{c['qk_rope_head_dim']} (HF's rotary embedding makes that many "
                         f"angles), got {dh} · {fraction!r}")
    flat = {**c, "head_dim": None, "rope_parameters": rope or None}
    if kind == "indexed_attention":
        ours = _indexer_settings(mt, "interleaved", interleaved=True)(flat, layer_idx, sd)
    else:
        ours = _latent_settings(mt, interleaved=True)(flat, layer_idx, sd)
    ours.update(rms_norm_eps=float(c["rms_norm_eps"]), rope_key_norm=True,
                output_gate="sigmoid_per_head")
    if kind == "sliding_attention":  # W keys, the query's own included (HF's sliding mask)
        ours["sliding_window"] = int(c["sliding_window"])
    return ours


DOTS3_NAMES = {"k_pe_norm": "k_rope_only_layernorm.weight"}  # and its gate, g_proj


def _dots3_to_neutral(sd, ours):
    mt = "dots3_note_text"
    params = _indexer_to_neutral(sd, ours)
    s_q, s_kv = _lora_scales(ours)
    params["q_a_norm"] = params["q_a_norm"] * s_q
    params["kv_a_norm"] = params["kv_a_norm"] * s_kv
    params["k_pe_norm"] = _read(sd, DOTS3_NAMES["k_pe_norm"], mt)
    params["W_gate"] = np.ascontiguousarray(_read(sd, "g_proj.weight", mt).T)
    return params


def _dots3_from_neutral(params, ours):
    sd = _indexer_from_neutral(params, ours)
    s_q, s_kv = _lora_scales(ours)
    sd["q_a_layernorm.weight"] = sd["q_a_layernorm.weight"] / s_q
    sd["kv_a_layernorm.weight"] = sd["kv_a_layernorm.weight"] / s_kv
    sd[DOTS3_NAMES["k_pe_norm"]] = np.array(params["k_pe_norm"])
    sd["g_proj.weight"] = np.ascontiguousarray(np.asarray(params["W_gate"]).T)
    return sd


# Issue 44's composites: from_hf takes a tower's config (attn-parity hf reads their checkpoints,
# golden.hf.vision.COMPOSITES).


def _composite(text):
    return (f"it is a composite model: from_hf converts one tower, so pass its text_config "
            f"(model_type {text!r}); attn-parity hf reads the composite's checkpoint")


REFUSED = {
    # DeepSeek V4 (DeepseekV4Attention): its indexer scores keys compressed by learned pooling
    # (the CSA and HCA compressors), K = V from one KV head, the output turned back by an
    # inverse RoPE and projected by a grouped low-rank o_proj, with sinks: none of it is ours
    "deepseek_v4": "DeepSeek V4's compressed sparse attention (its CSA/HCA key compressors, "
                   "K = V on one key-value head, the inverse RoPE on the output, a grouped "
                   "low-rank output projection) is not MultiHeadLatentAttention's",
    "mistral_large4": _composite("mistral_large4_text"),
    "minimax_m3_vl": _composite("minimax_m3_vl_text"),
    "qwen4_exp": _composite("qwen4_exp_text"),
    "dots3_note": _composite("dots3_note_text"),
}


def _mla(settings, to_neutral=_deepseek_to_neutral, from_neutral=_deepseek_from_neutral,
         **family) -> Family:
    return Family(MLA, settings, to_neutral, from_neutral, **family)


FAMILIES: dict[str, Family] = {
    "deepseek_v3": _mla(_deepseek_settings),
    # Issue 42's latent attentions. DeepSeek-V2: complex RoPE, its pairs (2i, 2i + 1), in
    # float32; MiniCPM3: Llama's rotate-half pairs (i, i + Dr/2); both whatever the config says.
    "deepseek_v2": _mla(_latent_settings("deepseek_v2", interleaved=True)),
    "minicpm3": _mla(_latent_settings("minicpm3", interleaved=False)),
    "kimi_linear": _mla(_kimi_linear_settings),
    # DeepseekV3Attention itself (A.X-K1's always with a q LoRA): rope_interleave read
    **{mt: _mla(_latent_settings(mt)) for mt in ("glm4_moe_lite", "youtu", "axk1")},
    # Issue 44's learned sparse selection: DeepSeek-V3.2 and GLM-5 (its "full" layers)
    "deepseek_v32": _mla(_indexer_settings("deepseek_v32", "half"), _indexer_to_neutral,
                         _indexer_from_neutral),
    "glm_moe_dsa": _mla(_indexer_settings("glm_moe_dsa", "interleaved"), _indexer_to_neutral,
                        _indexer_from_neutral),
    # HY-V4's checkpoints name its gate linear_gate and its sinks learnable_sink_param (HF
    # renames them when loading)
    # Mistral Large 4's text model: its RoPE's learned scales beside the layers; its files
    # keep Mistral's own names, which transformers renames on loading
    "mistral_large4_text": _mla(_mistral_large4_settings, _mistral_large4_to_neutral,
                                _mistral_large4_from_neutral, stacks=(Stack(
                                    "layers", "attention", in_model=("layers", "self_attn"),
                                    beside=(ROPE_ALPHA,), renames=MISTRAL_LARGE4_FILE),)),
    "hy_v4": _mla(_hy_v4_settings, _hy_v4_to_neutral, _hy_v4_from_neutral, stacks=(Stack(
        "layers", "self_attn", renames=(("linear_gate", "gate_proj"),
                                        ("learnable_sink_param", "sinks"))),)),
    # A.X-K2: the query and its gate from [RMSNorm(c_q) | c_q]; dots.3-note: the rotary key
    # normalised, a gate per head, the latents' scales folded, its windowed layers' sizes
    "axk2": _mla(_axk2_settings, _axk2_to_neutral, _axk2_from_neutral, stacks=(Stack(
        "layers", "self_attn", renames=(("q_b_proj.", "q_gate_proj."),)),)),  # its files' name
    "dots3_note_text": _mla(_dots3_settings, _dots3_to_neutral, _dots3_from_neutral),
    # Mistral Small 4: with Llama 4's query temperature
    "mistral4": _mla(_mistral4_settings, model_class="Mistral4Model"),
    "longcat_flash": _mla(_longcat_settings, _longcat_to_neutral, _longcat_from_neutral,
                          stacks=(Stack("layers", "self_attn.0"),
                                  Stack("layers", "self_attn.1")),
                          unverified="attn-parity hf does not check LongCat-Flash checkpoints "
                                     "yet: its config's num_hidden_layers is 2 · num_layers (two "
                                     "attentions a layer), and the verifier's one-layer config "
                                     "sets both to 1, which leaves LongcatFlashModel no layer"),
}

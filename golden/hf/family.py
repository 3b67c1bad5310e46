"""What a Hugging Face family is, and the helpers its entries share: the ``Family`` type (a
model_type's settings and array layout, both ways, and where a checkpoint keeps its attention:
``Stack``), ``Kinds`` (an encoder-decoder's several attentions), ``HFConfig`` (our
configuration remembering its model_type), and the readers of an HF config (sizes, RoPE, layer
types, the settings every Llama-like decoder shares) and of a state dict (arrays as NumPy
copies, ``nn.Linear`` weights transposed, bias flags). NumPy only.

Layouts: ``nn.Linear`` weights are (out, in), ours (in, out): transposed both ways, copies.
Shape legend: D (= d_in) the model's width, N query heads, Nkv key-value heads, Dh head width.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from golden.specification.mapping import _numpy
from golden.specification.validate import MROPE_FIELDS

GQA = "grouped_query_attention"
ROLES = ("query", "key", "value", "out")
LLAMA_NAMES = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "out": "o_proj"}


# A Stack's ``within`` for keys at the checkpoint's root ("layers.N.", "model.layers.N."), not
# under any tower's prefix.
ROOT = "^"


class LayerNotSupported(ValueError):
    """A layer of a supported model_type that the conversion refuses for its kind, named with
    why (Mistral Large 4's NoPE and KV-sharing layers): from_hf raises it as any ValueError;
    attn-parity hf notes the layer as not checked and checks the model's other layers."""


class HFConfig(dict):
    """Our module's configuration (a plain dict to ``build``), remembering the Hugging Face
    ``model_type`` it came from, which ``to_hf`` reads to name the arrays (and the ``kind`` of
    attention, for a model_type with several: see ``Kinds``)."""

    def __init__(self, settings, model_type, kind=None):
        super().__init__(settings)
        self.model_type = model_type
        self.kind = kind


@dataclass(frozen=True)
class Stack:
    """One stack of attention modules in a checkpoint's keys, e.g. "model.layers.3.self_attn.
    q_proj.weight" is ``Stack("layers", "self_attn")``'s layer 3 (any prefix before the stack,
    ``within`` required before it, whole segments, not necessarily next to it: a composite
    model's tower, "text_model.", "language_model."). ``kind``:
    from_hf's (None for a family with one kind); ``output``: the submodule whose output is the
    attention's when not the module's own; ``shared``: layer 0's array the later layers of the
    stack are converted with (T5's position bias table); ``label`` begins the rows' names;
    ``renames``: (the file's, the module's) key prefixes where transformers saves the module's
    arrays under older names (ViT), and ``in_model`` (stack, module) where the module sits in
    transformers' model when not where the file's keys say; ``input``: the submodule whose
    input is the attention's when not the module's own (Gemma 3n's ``attn``, after its
    Conformer block's norm); ``beside``: arrays of the model beside the stack (keys at the
    stack's own prefix, e.g. "encoder." before "encoders.N."), each layer converted with them
    under the same names and HF's one-layer model given them (Phi-4's audio encoder's table of
    position biases); ``joined``: ((the module's key, (the file's keys, ...)), ...), arrays the
    module holds as one that the file keeps apart, joined along their first axis as
    transformers' loading does (its ``Concatenate(dim=0)``: OLMo hybrid's and Kimi's q, k and v
    convolutions); ``linear``: the stack holds the config's ``linear_attention`` layers (a
    hybrid's recurrent mixers, golden.hf.linear), not its softmax attention."""

    stack: str
    module: str
    kind: str | None = None
    output: str | None = None
    shared: str | None = None
    label: str = ""
    within: str = ""
    renames: tuple = ()
    in_model: tuple | None = None
    input: str | None = None
    beside: tuple = ()
    joined: tuple = ()
    linear: bool = False

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
        """A key's match: group 1 the module's prefix (with its dot), group 2 the layer;
        ``within`` anywhere in the prefix before the stack, whole segments ("language_model."
        in "language_model.model.layers.3." and in "model.language_model.layers.3."); ``ROOT``:
        the stack at the key's start, or after "model." (a composite whose text tower's keys
        have no prefix of their own, Mistral Large 4's, beside towers that do)."""
        if self.within == ROOT:
            return re.compile(rf"^((?:model\.)?{re.escape(self.stack)}\.({layer})\."
                              rf"{re.escape(self.module)}\.)")
        within = rf"{re.escape(self.within)}(?:.*\.)?" if self.within else ""
        return re.compile(rf"^(.*?(?:^|\.){within}{re.escape(self.stack)}\.({layer})\."
                          rf"{re.escape(self.module)}\.)")

    def form(self) -> str:
        """The keys' form, as messages show it: "...layers.N.self_attn.*",
        "...language_model.[...]layers.N.self_attn.*"."""
        if self.within == ROOT:
            return f"{self.stack}.N.{self.module}.*"
        within = f"{self.within}[...]" if self.within else ""
        return f"...{within}{self.stack}.N.{self.module}.*"


# A decoder's one stack, "model.layers.N.self_attn" (Llama's and most decoders' since): the
# stacks of a Family that states none.
DECODER_STACKS = (Stack("layers", "self_attn"),)


@dataclass(frozen=True)
class Family:
    """How one ``model_type``'s attention maps to ours, and where the checkpoint verifier
    (``attn-parity hf``, golden.verifier) finds and runs it.

    settings(c, layer_idx, sd) -> our configuration from the HF config dict ``c`` (and which
    keys the state dict ``sd`` has);
    to_neutral(sd, ours) -> our parameters from the state dict (NumPy copies);
    from_neutral(params, ours) -> the state dict from our parameters.
    ``unsupported``: HF config fields whose non-default value we refuse, each with the value(s)
    we accept and why (checked before anything else).

    For the verifier, which reads them from ``FAMILIES``' entries (a Family inside a ``Kinds``
    leaves them at their defaults: the Kinds holds its model_type's):
    ``stacks``: a tuple of ``Stack``, where the attention modules sit in the checkpoint's keys
    (default ``DECODER_STACKS``, a decoder's ``layers.N.self_attn``);
    ``hf_float64``: HF's attention has no float32 step (no RoPE, ALiBi or float32 norm), so
    the verifier's HF rows run at float64 too;
    ``model_class``: the transformers class (a name, e.g. "SiglipTextModel") that builds the
    model of a config AutoModel does not take; None: AutoModel's;
    ``own_index``: the HF module reads its index in the whole model beyond layer_types (GPT-2):
    in the verifier's one-layer model it is built again with the layer's own index;
    ``position_axes``: the rows of the positions HF's model takes, 3 for a multimodal text
    tower ((3, B, L) position_ids: the verifier draws an image's span), 2 for a vision tower
    with axial RoPE (the verifier draws one image), 1 for a 1-D RoPE; ``unverified``: why the
    verifier does not check this family yet (it refuses a checkpoint of it with this reason),
    None when it does; ``call_site(c, layer_idx, sd) -> sd``: the module's state dict as layer
    ``layer_idx`` computes with it, where one module serves several layers differently (Zamba
    2's shared block, each call site's adapters folded into its projections); None: ``sd``
    itself."""

    variant: str
    settings: Callable
    to_neutral: Callable
    from_neutral: Callable
    unsupported: dict = field(default_factory=dict)
    stacks: tuple = DECODER_STACKS
    hf_float64: bool = False
    model_class: str | None = None
    own_index: bool = False
    position_axes: int = 1
    unverified: str | None = None
    call_site: Callable | None = None


class Kinds(dict):
    """A model_type with several attentions (an encoder-decoder): kind ("encoder", "decoder",
    "cross") -> Family; from_hf's ``kind=`` chooses, to_hf reads it from the config (or, given
    a plain dict, takes the kind whose variant it is: the encoder's and the decoder's
    self-attention name their arrays alike).

    ``stacks``, ``hf_float64``, ``model_class``, ``own_index``: the model_type's, as a
    ``Family``'s, given by keyword (``Kinds(encoder=..., decoder=..., cross=..., stacks=...)``);
    each Stack names its ``kind``. No default stacks: ``()`` is a model_type whose modules the
    verifier does not know where to find."""

    def __init__(self, *kinds, stacks=(), hf_float64=False, model_class=None, own_index=False,
                 **named):
        super().__init__(*kinds, **named)
        self.stacks = stacks
        self.hf_float64 = hf_float64
        self.model_class = model_class
        self.own_index = own_index
        self.position_axes = 1
        self.unverified = None


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
    if rope is None and isinstance(c.get("rope_scaling"), Mapping):
        rope = _legacy_rope(c)
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
    for name in MROPE_FIELDS:  # HF's 1-D families ignore them where a config carries them;
        rope.pop(name, None)  # a multimodal family's entry puts them back (decoders._mrope)
    return {"rope_parameters": rope}


def llama4_scaling(rope, mt) -> dict:
    """Our query_temperature of Ministral 3's and Mistral 4's Llama 4 scaling, 1 + β·ln(1 +
    ⌊p / F⌋) (no shift), from HF's rope_parameters: β its llama_4_scaling_beta, F its
    original_max_position_embeddings; refused by name without them."""
    beta, floor = rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
    if beta is None or floor is None:
        raise ValueError(f"model_type {mt!r}: rope_parameters should give llama_4_scaling_beta "
                         f"and original_max_position_embeddings (HF's attention scales the "
                         f"queries by 1 + β·ln(1 + ⌊p / F⌋) with them), got {beta!r} and "
                         f"{floor!r}")
    return {"beta": float(beta), "floor_scale": int(floor), "shift": 0}


def _legacy_rope(c) -> dict:
    """rope_parameters from a config.json of before transformers 5, as transformers 5 reads it:
    its ``rope_scaling`` dict, "type" renamed "rope_type" (default "default"), θ from the
    top-level ``rope_theta``; the vision-language configs' "mrope" type is "default" with its
    mrope_section (Qwen2VLTextConfig's own rule)."""
    rope = dict(c["rope_scaling"])
    kind = rope.pop("type", None)
    rope.setdefault("rope_type", kind or "default")
    if rope["rope_type"] == "mrope":
        rope["rope_type"] = "default"
    if c.get("rope_theta") is not None:
        rope.setdefault("rope_theta", c["rope_theta"])
    return rope


def variants_rope_types() -> tuple:
    from golden.specification.validate import ROPE_TYPES
    return tuple(ROPE_TYPES)


def _heads(c, n, mt, kv=None) -> dict:
    """Sizes of a family whose head width is D / N whatever else the config says."""
    d = c["hidden_size"] if "hidden_size" in c else c.get("n_embd", c.get("d_model"))
    if d % n:
        raise ValueError(f"model_type {mt!r}: hidden_size = {d} should be a multiple of the "
                         f"{n} heads")
    return dict(d_in=d, num_heads=n, num_kv_heads=n if kv is None else kv, head_dim=d // n)


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
    return _dropout(c, ours)


def _dropout(c, ours, name="attention_dropout"):
    """``ours`` with HF's dropout of the attention weights (the config field ``name``) as our
    ``dropout`` where it is not zero."""
    if c.get(name):
        ours["dropout"] = float(c[name])
    return ours


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
    qkv = {has[r] for r in ("query", "key", "value") if r in has}  # no value: Gemma 4's K = V
    if len(qkv) > 1:
        raise ValueError(f"model_type {mt!r}: q, k and v should all have a bias or none, got "
                         f"{', '.join(f'{names[r]}: {has[r]}' for r in ROLES[:3] if r in has)}")
    return dict(qkv_bias=qkv.pop(), out_bias=has.get("out", False))


# ---- settings several kinds of decoder share -----------------------------------------------

def _qwen3(c, layer_idx, ours):
    ours.update(qk_norm="rms", qk_norm_eps=float(c["rms_norm_eps"]))


def _whole_head(mt, ours):
    """HF's rotary embedding of these towers turns the whole head: its default frequencies
    ignore partial_rotary_factor, and its apply_rotary_pos_emb has no slice for the others'."""
    fraction = ours["rope_parameters"].get("partial_rotary_factor", 1.0)
    if fraction != 1.0:
        raise ValueError(f"model_type {mt!r}: rope_parameters['partial_rotary_factor'] = "
                         f"{fraction!r} is not supported (HF's attention of this family turns "
                         f"the whole head whatever it says)")


def _no_window(ours, fixed_dropout=False):
    """A family whose HF attention has no sliding window whatever the config's sliding_window
    says (and, with ``fixed_dropout``, an attention dropout of 0 whatever attention_dropout
    says): both dropped, as HF ignores them."""
    ours.pop("sliding_window", None)
    if fixed_dropout:
        ours.pop("dropout", None)

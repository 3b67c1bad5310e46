"""Other libraries' attention weights <-> the neutral layout (golden.specification.variants), NumPy
only.

Two families, each both ways, exact (arrays are only moved, never recomputed) and returning
copies, never views of the caller's arrays:

* Flax's ``MultiHeadAttention`` (``flax.nnx``, whose ``nnx.to_pure_dict(nnx.state(mha,
  nnx.Param))`` is such a tree) and ``flax.linen.MultiHeadDotProductAttention`` (its
  ``variables["params"]``): ``{"query": {"kernel": (E, H, Dh), "bias": (H, Dh)}, "key" and
  "value": {"kernel": (E, Hkv, Dh), "bias": (Hkv, Dh)}, "out": {"kernel": (H, Dh, E_out),
  "bias": (E_out,)}}``. ``flax_mha_to_neutral``, ``neutral_to_flax_mha`` and
  ``flax_mha_settings`` (the Flax module's sizes).
* Llama-style checkpoints (Hugging Face's ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
  Meta's ``wq``, ``wk``, ``wv``, ``wo``): ``nn.Linear`` weights (out, in), transposed to the
  neutral (in, out); biases where a model has them (Qwen's q, k, v). ``llama_to_neutral``,
  ``neutral_to_llama`` and ``llama_config``, with the rotary-embedding pair permutation
  between Meta's interleaved pairs and Hugging Face's rotate-half pairs (``rope_permute``,
  ``rope_unpermute``; ``permute_qk`` applies it to neutral parameters).

The framework wrappers (``jax_attn.convert``) build modules from what these return. Arrays may
be NumPy, JAX or torch (a torch tensor is read through ``.detach().cpu().numpy()``, bfloat16
as float32, exactly, since NumPy has no bfloat16); what comes back is NumPy.

Shape legend: E (= d_in) input width, E_out (= d_out) output width, H query heads, Hkv
key-value heads, Dh head width.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from golden import hf
from golden.specification.mapping import _numpy
from golden.specification.validate import rope_settings, rotary_dims
from golden.specification.variants import VARIANTS, check_defaults, head_dim

HF_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj")  # Hugging Face's Llama, Mistral, Qwen, Gemma
META_NAMES = ("wq", "wk", "wv", "wo")                  # Meta's original Llama checkpoints
ROLES = ("query", "key", "value", "out")
GQA, MHA = "grouped_query_attention", "multi_head_attention"


# ---- rotary embeddings: interleaved pairs <-> rotate-half pairs ------------------------------

def _per_head(w, heads, name) -> int:
    """Dh of an array whose first axis is ``heads`` blocks of Dh rows, Dh even."""
    if not isinstance(heads, int) or isinstance(heads, bool):
        raise TypeError(f"heads should be a positive int, got {type(heads).__name__} {heads!r}")
    rows = w.shape[0] if w.ndim else 0
    if heads <= 0 or rows % heads or (rows // heads) % 2:
        raise ValueError(f"{name} first axis should be heads·Dh = {heads}·Dh with Dh even, got "
                         f"shape {tuple(w.shape)}")
    return rows // heads


def rope_permute(w, heads):
    """Interleaved RoPE pairs -> rotate-half pairs, on the first (output) axis of an (out, in)
    weight or an (out,) bias holding ``heads`` heads of Dh rows: within each head row 2i moves
    to i and row 2i + 1 to i + Dh/2, as ``permute`` of Hugging Face's
    ``convert_llama_weights_to_hf.py`` (``w.view(heads, Dh // 2, 2, in).transpose(1, 2)``).

    Apply it to q and k alike (weights and biases), never to v or o: each score is a sum over a
    head's features, q·k = Σ_j q_j k_j, unchanged when q and k are permuted the same way, and
    the interleaved rotation of a pair (2i, 2i + 1) is the rotate-half rotation of (i, i + Dh/2)
    after the move, so RoPE(Pq)·RoPE(Pk) = P·RoPE_interleaved(q) · P·RoPE_interleaved(k). The
    weights and the output do not change; v and o are never rotated.
    """
    w = _numpy(w)
    dh = _per_head(w, heads, "w")
    rest = w.shape[1:]
    return np.array(w.reshape((heads, dh // 2, 2) + rest).swapaxes(1, 2).reshape(w.shape))


def rope_unpermute(w, heads):
    """The inverse of ``rope_permute``: rotate-half pairs -> interleaved pairs (Hugging Face's
    layout back to Meta's): row i moves to 2i and row i + Dh/2 to 2i + 1, within each head."""
    w = _numpy(w)
    dh = _per_head(w, heads, "w")
    rest = w.shape[1:]
    return np.array(w.reshape((heads, 2, dh // 2) + rest).swapaxes(1, 2).reshape(w.shape))


def permute_qk(params, num_heads, *, inverse=False) -> dict:
    """Neutral parameters with the query and key columns (and their biases) moved by
    ``rope_permute`` (``inverse``: ``rope_unpermute``), the others copied: the parameters of a
    ``rope_interleaved=True`` GroupedQueryAttention become those of the same function with
    ``rope_interleaved=False`` (``inverse`` the other way)."""
    params = {n: _numpy(a) for n, a in params.items()}
    dh = _head_dim(params, num_heads)
    move = rope_unpermute if inverse else rope_permute
    for role, heads in (("query", num_heads), ("key", params["W_key"].shape[1] // dh)):
        params[f"W_{role}"] = move(params[f"W_{role}"].T, heads).T.copy()  # (in, out)
        if f"b_{role}" in params:
            params[f"b_{role}"] = move(params[f"b_{role}"], heads)
    return params


def _head_dim(params, num_heads) -> int:
    width = params["W_query"].shape[1]
    if num_heads <= 0 or width % num_heads:
        raise ValueError(f"num_heads should divide W_query's width {width}, got {num_heads}")
    return width // num_heads


# ---- Llama-style checkpoints ------------------------------------------------------------------

def _read(state_dict, key, want=None):
    """state_dict[key] as NumPy, its shape checked against ``want`` (None: any size)."""
    if key not in state_dict:
        near = sorted(k for k in state_dict if k.rpartition(".")[0] == key.rpartition(".")[0])
        raise ValueError(f"state_dict should hold {key!r}, got {near or sorted(state_dict)[:8]}")
    return _shaped(key, _numpy(state_dict[key]), want)


def _shaped(key, a, want):
    if want is not None and (a.ndim != len(want) or
                             any(w is not None and w != s for w, s in zip(want, a.shape))):
        shown = ", ".join("?" if w is None else str(w) for w in want)
        raise ValueError(f"{key} shape should be ({shown}), got {tuple(a.shape)}")
    return a


def llama_to_neutral(state_dict, *, num_heads, num_kv_heads=None, head_dim=None, prefix="",
                     names=HF_NAMES, interleaved=False) -> dict:
    """Neutral GroupedQueryAttention parameters from one attention layer of a Llama-style state
    dict: ``W_query = {prefix}q_proj.weight.T`` (in, out), ... ``W_out = o_proj.weight.T``, and
    ``b_*`` from the ``.bias`` entries where there are some (q, k and v together, o alone).

    ``prefix`` selects the layer (``"model.layers.0.self_attn."``), ``names`` the projections
    (``META_NAMES`` for Meta's ``wq``, ``wk``, ``wv``, ``wo``). ``head_dim`` defaults to
    q_proj's rows / num_heads and ``num_kv_heads`` to k_proj's rows / head_dim; given, they
    are checked. ``interleaved=True``: the checkpoint pairs RoPE features interleaved (Meta's
    original layout); q and k are moved to rotate-half order by ``rope_permute``. Either way
    the result goes with ``rope_interleaved=False`` (``llama_config``). (Meta's weights loaded
    with ``interleaved=False`` and built with ``rope_interleaved=True`` compute the same.)
    """
    if not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"num_heads should be a positive int, got {num_heads!r}")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict should be a mapping of names to arrays (a model's "
                        f"state_dict()), got {type(state_dict).__name__}")
    q, k, v, o = (f"{prefix}{n}" for n in names)
    wq = _read(state_dict, f"{q}.weight", (None, None))
    d_in = wq.shape[1]
    head_dim = wq.shape[0] // num_heads if head_dim is None else head_dim
    _shaped(f"{q}.weight", wq, (num_heads * head_dim, d_in))
    wk = _read(state_dict, f"{k}.weight", (None, d_in))
    num_kv_heads = wk.shape[0] // max(head_dim, 1) if num_kv_heads is None else num_kv_heads
    kv = (num_kv_heads * head_dim, d_in)
    wk, wv = _shaped(f"{k}.weight", wk, kv), _read(state_dict, f"{v}.weight", kv)
    wo = _read(state_dict, f"{o}.weight", (None, num_heads * head_dim))
    has = [f"{p}.bias" in state_dict for p in (q, k, v)]
    if any(has) and not all(has):
        raise ValueError(f"{q}.bias, {k}.bias and {v}.bias should be all present or all "
                         f"absent, got {[f'{p}.bias' for p, h in zip((q, k, v), has) if h]}")
    biases = {}
    if all(has):
        biases = {"b_query": _read(state_dict, f"{q}.bias", wq.shape[:1]),
                  "b_key": _read(state_dict, f"{k}.bias", kv[:1]),
                  "b_value": _read(state_dict, f"{v}.bias", kv[:1])}
    if f"{o}.bias" in state_dict:
        biases["b_out"] = _read(state_dict, f"{o}.bias", wo.shape[:1])
    params = {"W_query": wq.T.copy(), "W_key": wk.T.copy(), "W_value": wv.T.copy(),
              "W_out": wo.T.copy(), **biases}  # (in, out)
    return permute_qk(params, num_heads) if interleaved else params


def neutral_to_llama(params, *, num_heads, prefix="", names=HF_NAMES, interleaved=False,
                     rope_interleaved=False) -> dict:
    """The inverse of ``llama_to_neutral``: ``{prefix}q_proj.weight`` (out, in) = W_query.T,
    ..., and ``.bias`` entries for the biases present, as NumPy copies; q and k in rotate-half
    order, or with ``interleaved=True`` in Meta's interleaved order. ``rope_interleaved`` is the
    order ``params`` are in: that of the module they come from (its ``rope_interleaved``).
    Head sizes come from the shapes: Dh = W_query's width / num_heads, Hkv = W_key's / Dh."""
    params = {n: _numpy(a) for n, a in params.items()}
    _head_dim(params, num_heads)
    if interleaved != rope_interleaved:  # rope_permute to rotate-half, or back
        params = permute_qk(params, num_heads, inverse=interleaved)
    out = {}
    for name, role in zip(names, ROLES):
        out[f"{prefix}{name}.weight"] = params[f"W_{role}"].T.copy()  # (out, in)
        if f"b_{role}" in params:
            out[f"{prefix}{name}.bias"] = params[f"b_{role}"].copy()
    return out


def check_pair_move(config, interleaved) -> None:
    """ValueError when ``to_llama`` would have to move RoPE pairs (``interleaved`` differs from
    the module's ``rope_interleaved``) of a partial rotary module: rope_permute moves pairs
    across the whole head, where only the first rd features turn."""
    settings = rope_settings(config["rope_theta"], config.get("rope_parameters"),
                             config.get("partial_rotary_factor", 1.0))
    dh = head_dim(config)
    if interleaved != config["rope_interleaved"] and settings is not None and rotary_dims(
            dh, settings) < dh:
        raise ValueError(f"interleaved should be the module's rope_interleaved = "
                         f"{config['rope_interleaved']} with partial rotary (only "
                         f"{rotary_dims(dh, settings)} of Dh = {dh} features turn), got "
                         f"{interleaved}")


def llama_from_hf(state_dict, *, num_heads, rope_theta, num_kv_heads=None, head_dim=None,
                  prefix="", names=HF_NAMES, interleaved=False, sliding_window=None):
    """(variant, config, params) of ``from_llama``: one Llama-style layer read by
    ``llama_to_neutral`` (its ``prefix``, Meta's ``names``, interleaved pairs moved to
    rotate-half, the shapes checked), put back under Hugging Face's names, and converted by
    ``from_hf`` with the config those arguments describe (model_type "llama", or "mistral"
    with a ``sliding_window``): the same conversion as any Llama checkpoint's."""
    params = llama_to_neutral(state_dict, num_heads=num_heads, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, prefix=prefix, names=names,
                              interleaved=interleaved)
    dh = _head_dim(params, num_heads)
    config = {"model_type": "llama" if sliding_window is None else "mistral",
              "hidden_size": params["W_query"].shape[0], "num_attention_heads": num_heads,
              "num_key_value_heads": params["W_key"].shape[1] // dh, "head_dim": dh,
              "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
              "sliding_window": sliding_window}
    if params["W_out"].shape[1] != config["hidden_size"]:
        raise ValueError(f"{prefix}{names[3]}.weight should map N·Dh = {num_heads * dh} "
                         f"features back to the model's width {config['hidden_size']}, got "
                         f"{params['W_out'].shape[1]} outputs")
    variant, ours, params = from_hf(config, neutral_to_llama(params, num_heads=num_heads))
    # from_llama's configuration as it always was (llama_config's): θ as rope_theta, d_out given
    ours = VARIANTS[variant].config({**{k: v for k, v in ours.items() if k != "rope_parameters"},
                                     "rope_theta": rope_theta, "d_out": config["hidden_size"]})
    return variant, ours, params


def llama_config(params, *, num_heads, rope_theta, sliding_window=None) -> dict:
    """The complete GroupedQueryAttention configuration for Llama-style neutral parameters:
    sizes from their shapes, ``qkv_bias``/``out_bias`` from the biases present, causal,
    rotate-half RoPE with ``rope_theta`` (the model's config.json ``rope_theta``), and the
    config's ``sliding_window`` (Mistral's; Hugging Face's meaning, W keys including the
    query's own)."""
    dh = _head_dim(params, num_heads)
    return VARIANTS[GQA].config(dict(
        d_in=params["W_query"].shape[0], num_heads=num_heads,
        num_kv_heads=params["W_key"].shape[1] // dh, head_dim=dh, d_out=params["W_out"].shape[1],
        qkv_bias="b_query" in params, out_bias="b_out" in params, rope_theta=rope_theta,
        sliding_window=sliding_window))


# ---- Flax MultiHeadAttention ------------------------------------------------------------------

def _tree_part(tree, role, field, ndim):
    part = tree[role].get(field) if isinstance(tree.get(role), dict) else None
    if part is None:
        return None
    a = _numpy(part)
    if a.ndim != ndim:
        raise ValueError(f"{role}.{field} should have {ndim} axes, got shape {tuple(a.shape)}")
    return a


def flax_mha_to_neutral(tree, *, causal=False, dropout=0.0):
    """(variant, config, params) of our module computing what a Flax MultiHeadAttention with
    these parameters computes (called with ``is_causal=causal``; ``dropout`` its rate).

    ``tree`` is linen's ``variables`` (or its ``"params"``) or NNX's pure dict of the
    parameters. The variant is ``multi_head_attention`` when it can hold them (Hkv = H and
    E_out = H·Dh), else ``grouped_query_attention`` (no RoPE, ``causal`` as given). One
    ``use_bias`` covers the four projections: ``qkv_bias = out_bias``. What no variant
    represents raises ValueError: ``normalize_qk`` (its layer norms), keys and values of another
    width than the queries (``in_kv_features``)."""
    tree = tree.get("params", tree) if isinstance(tree, dict) else tree
    if not isinstance(tree, dict):
        raise ValueError(f"tree should be a dict of Flax MultiHeadAttention parameters, got "
                         f"{type(tree).__name__}")
    extra = sorted(set(tree) - set(ROLES))
    if {"query_ln", "key_ln"} & set(extra):
        raise ValueError("normalize_qk should be False: the layer norms of q and k "
                         f"({', '.join(extra)}) have no counterpart in our variants")
    if extra or not set(ROLES) <= set(tree):
        raise ValueError(f"tree should have the parameters {', '.join(ROLES)}, got "
                         f"{', '.join(sorted(tree))}")
    q, k, v, o = (_tree_part(tree, r, "kernel", 3) for r in ROLES)
    for role, kernel in zip(ROLES, (q, k, v, o)):
        if kernel is None:
            raise ValueError(f"{role}.kernel should be in the tree, got "
                             f"{sorted(tree[role]) if isinstance(tree[role], dict) else None}")
    (e, h, dh), hkv, e_out = q.shape, k.shape[1], o.shape[2]
    if k.shape[0] != e:
        raise ValueError(f"key.kernel shape should be (E, Hkv, Dh) = ({e}, ?, {dh}) with the "
                         f"queries' width E (our self-attention variants take one input: "
                         f"in_kv_features = in_features), got {k.shape}")
    for name, got, want in (("key.kernel", k.shape, (e, hkv, dh)),
                            ("value.kernel", v.shape, (e, hkv, dh)),
                            ("out.kernel", o.shape, (h, dh, e_out))):
        if got != want:
            raise ValueError(f"{name} shape should be {want}, got {got}")
    params = {"W_query": q.reshape(e, h * dh), "W_key": k.reshape(e, hkv * dh),
              "W_value": v.reshape(e, hkv * dh), "W_out": o.reshape(h * dh, e_out)}
    biases = {r: _tree_part(tree, r, "bias", 1 if r == "out" else 2) for r in ROLES}
    use_bias = biases["query"] is not None
    if any((b is not None) != use_bias for b in biases.values()):
        raise ValueError(f"bias should be present in all of {', '.join(ROLES)} or in none, "
                         f"got it in {[r for r, b in biases.items() if b is not None]}")
    if use_bias:
        params.update({f"b_{r}": b.reshape(-1) for r, b in biases.items()})
    if hkv == h and e_out == h * dh:
        variant, given = MHA, dict(d_in=e, d_out=e_out, num_heads=h)
    else:
        variant, given = GQA, dict(d_in=e, num_heads=h, num_kv_heads=hkv, head_dim=dh,
                                   d_out=e_out)
    config = VARIANTS[variant].config(dict(given, causal=causal, dropout=dropout,
                                           qkv_bias=use_bias, out_bias=use_bias))
    VARIANTS[variant].check_params(config, params)
    return variant, config, params


# GroupedQueryAttention's arguments a plain multi-head module expresses (Flax's MultiHeadAttention,
# torch.nn.MultiheadAttention; scale only as 1/√Dh): every other must be at its default
MHA_SETTINGS = ("d_in", "num_heads", "num_kv_heads", "head_dim", "d_out", "qkv_bias",
                     "out_bias", "causal", "scale", "dropout")


def flax_mha_settings(variant, config) -> dict:
    """The sizes of the Flax MultiHeadAttention that holds ``variant``'s parameters: num_heads,
    in_features, qkv_features, out_features, num_kv_heads, dropout_rate, use_bias. Our settings
    that Flax's module has no counterpart for raise ValueError; ``causal`` is Flax's call
    argument ``is_causal``, not a setting."""
    if variant not in (MHA, GQA):
        raise ValueError(f"variant should be {MHA} or {GQA} for Flax's MultiHeadAttention, "
                         f"got {variant!r}")
    c = VARIANTS[variant].config(config)
    if variant == MHA:
        h, hkv, dh, e_out = c["num_heads"], c["num_heads"], c["d_out"] // c["num_heads"], c["d_out"]
    else:
        h, hkv, dh = c["num_heads"], c["num_kv_heads"], head_dim(c)
        e_out = c["d_in"] if c["d_out"] is None else c["d_out"]
        check_defaults(variant, c, MHA_SETTINGS, "Flax's MultiHeadAttention")
        if c["scale"] is not None and c["scale"] != dh ** -0.5:
            raise ValueError(f"scale should be None or 1/√Dh = {dh ** -0.5!r} for Flax's "
                             f"MultiHeadAttention, got {c['scale']!r}")
    return dict(num_heads=h, in_features=c["d_in"], qkv_features=h * dh, out_features=e_out,
                num_kv_heads=hkv, dropout_rate=c["dropout"],
                use_bias=bool(c["qkv_bias"] or c["out_bias"]))


def neutral_to_flax_mha(variant, config, params) -> dict:
    """The inverse of ``flax_mha_to_neutral``: the Flax parameter tree ``{"query": {"kernel":
    (E, H, Dh), "bias": (H, Dh)}, ..., "out": {"kernel": (H, Dh, E_out), "bias": (E_out,)}}``
    (NumPy copies; linen's variables are ``{"params": tree}``). Flax has one ``use_bias`` for
    the four projections: when only some of ours have biases (our MultiHeadAttention's default
    is an output bias alone), the others get zero biases, which compute exactly the same (x W +
    0 = x W), and come back as zeros."""
    settings = flax_mha_settings(variant, config)
    VARIANTS[variant].check_params(VARIANTS[variant].config(config), params)
    params = {n: _numpy(a) for n, a in params.items()}
    h, hkv = settings["num_heads"], settings["num_kv_heads"]
    e, dh = settings["in_features"], settings["qkv_features"] // h
    heads = {"query": h, "key": hkv, "value": hkv}
    tree = {r: {"kernel": params[f"W_{r}"].reshape(e, n, dh)} for r, n in heads.items()}
    tree["out"] = {"kernel": params["W_out"].reshape(h, dh, settings["out_features"])}
    if settings["use_bias"]:
        for r in ROLES:
            w = params[f"W_{r}"]
            b = params.get(f"b_{r}", np.zeros(w.shape[1], w.dtype))
            tree[r]["bias"] = b.reshape(tree[r]["kernel"].shape[1:] if r != "out" else (-1,))
    return tree


def from_hf(config, state_dict, *, layer_idx=0, **options):
    """(variant, config, params) of one attention layer of a Hugging Face checkpoint, for
    ``torch_attn.build`` and ``jax_attn.build``: golden.hf.from_hf (the families, their
    settings and the options are there: ``kind`` chooses an encoder-decoder's attention,
    ``rope_precision``)."""
    return hf.from_hf(config, state_dict, layer_idx=layer_idx, **options)


def to_hf(variant, config, params, *, model_type=None) -> dict:
    """The Hugging Face attention module's state dict (NumPy copies) from our variant, config
    and params: golden.hf.to_hf."""
    return hf.to_hf(variant, config, params, model_type=model_type)

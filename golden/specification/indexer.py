"""The learned indexer of multi-head latent attention (DeepSeek-V3.2's "lightning indexer" and
its relatives), its settings checked and its parameters' shapes; the maths is
golden.reference.indexer's.

For every query t the indexer scores every key s it may see and keeps the top k:

    q^I = (query input) W_index_q, (..., L, H_I, D_I);  k^I = LayerNorm(x W_index_k), (..., L, D_I)
    RoPE on qk_rope_head_dim features of both (rotate-half or interleaved; the first or the last)
    w = x W_index_weights, (..., L, H_I)
    I[t, s] = Σ_h w[t, h] · H_I^−1/2 · ReLU(D_I^−1/2 · q^I[t, h] · k^I[s])

and latent attention then attends only the chosen keys (allowed = its mask AND chosen). The
indexer has no gradient (Hugging Face runs it under torch.no_grad): its parameters get none.

The options (constructor arguments of MultiHeadLatentAttention, all inert without index_topk):
    index_topk        k, the keys kept per query (Hugging Face's index_topk); None: no indexer
    index_heads       H_I (index_n_heads)
    index_head_dim    D_I (index_head_dim)
    index_rope        "half" (rotate-half pairs (i, i + r/2): DeepSeek-V3.2, HY-V4),
                      "interleaved" (pairs (2i, 2i + 1): GLM-5, Mistral Large 4) or None (no
                      rotation: Mistral Large 4's layers without RoPE)
    index_rope_dims   "first" (the first qk_rope_head_dim features turned: DeepSeek-V3.2) or
                      "last" (HY-V4)
    index_query       "latent" (q^I from the query's latent q_resid = RMSNorm(x W_q_a):
                      DeepSeek-V3.2) or "layer_norm" (from LayerNorm(x) with a bias, weights
                      index_q_norm, index_q_norm_bias: Mistral Large 4, which has no q_lora)
    index_temperature Mistral Large 4's learned per-head temperature on q^I before RoPE:
                      q^I[t, h] · (index_temperature_scale[h] · ln(p_t + 1) +
                      index_temperature_bias[h])
    index_scale       where D_I^−1/2 is applied: "scores" (on q·k, before the ReLU:
                      DeepSeek-V3.2) or "weights" (on w: HY-V4); equal in exact arithmetic (ReLU(a·x) =
                      a·ReLU(x), a > 0), rounded differently
    index_norm_eps    ε of the indexer's LayerNorms (1e-6; HY-V4's is its rms_norm_eps)
    index_select      "tokens" (the top-k keys); "blocks" (MiniMax M3's max-pooled key blocks
                      with local blocks, Qwen4-Exp's pooled rotated blocks) is refused by name:
                      not built yet

The selection rule (one, in every implementation): among the keys a query may see (its mask,
causal, lengths), the k = min(index_topk, Lk) highest scores, equal scores won by the lowest key
index; a row that sees fewer than k keys fills its remaining slots with the keys it may not
see, lowest index first (harmless: the attention's own mask still excludes them). The result,
key_indices (..., Lq, k) int, lists each row's keys best first.

Shape legend: L tokens (Lq queries, Lk keys), H_I indexer heads, D_I indexer head width,
d_in the model width, q_lora the query latent's width.
"""

from __future__ import annotations

import numpy as np

INDEX_ROPES = ("half", "interleaved", None)
INDEX_ROPE_DIMS = ("first", "last")
INDEX_QUERIES = ("latent", "layer_norm")
INDEX_SCALES = ("scores", "weights")
INDEX_SELECTS = ("tokens",)
REFUSED_SELECTS = {"blocks": "MiniMax M3's max-pooled key blocks with local blocks and "
                             "Qwen4-Exp's pooled rotated blocks are not built yet (issue 44)"}

# (name, default) of every indexer option, in the constructor's order after output_gate
INDEX_DEFAULTS = (("index_topk", None), ("index_heads", None), ("index_head_dim", None),
                  ("index_rope", "half"), ("index_rope_dims", "first"),
                  ("index_query", "latent"), ("index_temperature", False),
                  ("index_scale", "scores"), ("index_norm_eps", 1e-6),
                  ("index_select", "tokens"))

# The parameters only the indexer reads: they have no gradient.
INDEX_PARAMS = ("W_index_q", "W_index_k", "index_k_norm", "index_k_norm_bias",
                "W_index_weights", "index_q_norm", "index_q_norm_bias",
                "index_temperature_scale", "index_temperature_bias")


def _one_of(name, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} should be one of {', '.join(map(repr, allowed))}, "
                         f"got {value!r}")


def check_index_rope(name, value) -> None:
    _one_of(name, value, INDEX_ROPES)


def check_index_rope_dims(name, value) -> None:
    _one_of(name, value, INDEX_ROPE_DIMS)


def check_index_query(name, value) -> None:
    _one_of(name, value, INDEX_QUERIES)


def check_index_scale(name, value) -> None:
    _one_of(name, value, INDEX_SCALES)


def check_index_select(name, value) -> None:
    if value in REFUSED_SELECTS:
        raise ValueError(f"{name} should be 'tokens' (the top-k keys), got {value!r}: "
                         f"{REFUSED_SELECTS[value]}")
    _one_of(name, value, INDEX_SELECTS)


def index_shapes(c) -> dict:
    """The indexer's parameters (neutral layout, W (in, out)) for a full MultiHeadLatentAttention
    configuration ``c``, {} without index_topk; ValueError naming a setting that does not fit
    the others."""
    if c["index_topk"] is None:
        for name, default in INDEX_DEFAULTS[1:]:
            if c[name] != default:
                raise ValueError(f"{name} should be {default!r} without index_topk (no "
                                 f"indexer), got {c[name]!r}")
        return {}
    for name in ("index_heads", "index_head_dim"):
        if c[name] is None:
            raise ValueError(f"{name} should be a positive int with index_topk = "
                             f"{c['index_topk']}, got None")
    h, d, rope = c["index_heads"], c["index_head_dim"], c["qk_rope_head_dim"]
    if c["index_rope"] is not None and not c["rope"]:
        raise ValueError(f"index_rope should be None with rope=False (no rotary embedding in "
                         f"the layer), got {c['index_rope']!r}")
    if c["index_rope"] is not None and rope > d:
        raise ValueError(f"index_head_dim should be at least qk_rope_head_dim = {rope} (the "
                         f"indexer turns that many of its features), got {d}")
    if c["index_query"] == "latent" and c["q_lora_rank"] is None:
        raise ValueError("index_query should be 'layer_norm' without q_lora_rank (there is no "
                         "query latent to read), got 'latent'")
    width = c["q_lora_rank"] if c["index_query"] == "latent" else c["d_in"]
    shapes = {"W_index_q": (width, h * d), "W_index_k": (c["d_in"], d),
              "index_k_norm": (d,), "index_k_norm_bias": (d,),
              "W_index_weights": (c["d_in"], h)}
    if c["index_query"] == "layer_norm":
        shapes.update({"index_q_norm": (c["d_in"],), "index_q_norm_bias": (c["d_in"],)})
    if c["index_temperature"]:
        shapes.update({"index_temperature_scale": (h,), "index_temperature_bias": (h,)})
    return shapes


def check_index_mask(mask, lead) -> None:
    """The indexer chooses one set of keys for every head (Hugging Face reads
    attention_mask[:, 0]): a mask with a head axis must have it of size 1."""
    if mask is not None and np.ndim(mask) == len(lead) + 3 and np.shape(mask)[-3] != 1:
        raise ValueError(f"mask should have no head axis, or one of size 1, with index_topk (the "
                         f"indexer chooses the same keys for every head), got shape "
                         f"{tuple(np.shape(mask))}")


def check_key_indices(key_indices, lead, lq, lk, k) -> None:
    """A given selection: integers (*lead, Lq, k) in [0, Lk)."""
    a = np.asarray(key_indices)
    want = tuple(lead) + (lq, k)
    if a.shape != want:
        raise ValueError(f"key_indices shape should be (B, Lq, k) = {want}, got {a.shape}")
    if a.dtype.kind not in "iu":
        raise ValueError(f"key_indices dtype should be an integer type, got {a.dtype}")
    if a.size and (a.min() < 0 or a.max() >= lk):
        raise ValueError(f"key_indices should lie in [0, Lk) = [0, {lk}), got values in "
                         f"[{a.min()}, {a.max()}]")


def check_index_cache(cache, index_dim, dtype) -> None:
    """A LatentCache for a layer with the indexer: index_key (B, M, D_I) beside its latent
    (B, M, kv_lora_rank), in x's ``dtype``."""
    held = getattr(cache, "index_key", None)
    want = tuple(cache.latent.shape[:2]) + (index_dim,)
    if held is None:
        raise ValueError(f"cache.index_key should be an array of shape (B, M, index_head_dim) = "
                         f"{want} with index_topk (the indexer's keys: init_cache makes it), "
                         f"got None")
    if tuple(held.shape) != want or held.dtype != dtype:
        raise ValueError(f"cache.index_key should be (B, M, index_head_dim) = {want} in x's "
                         f"dtype {dtype}, got {tuple(held.shape)} {held.dtype}")

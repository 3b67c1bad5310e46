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
                      DeepSeek-V3.2) or "weights" (on w: HY-V4); equal in exact arithmetic
                      (ReLU(a·x) = a·ReLU(x), a > 0), rounded differently
    index_norm_eps    ε of the indexer's LayerNorms (1e-6; HY-V4's is its rms_norm_eps)
    index_select      "tokens" (the top-k keys); "given" (GLM-5's, HY-V4's and Mistral Large
                      4's indexer_types "shared" layers: no indexer of its own, no parameters,
                      every other index_* option at its default; each call passes key_indices,
                      the previous full layer's choice, which that layer's
                      return_key_indices=True gives); "blocks" is refused by name here: MiniMax
                      M3's and Qwen4-Exp's block selection sits on grouped-query (softmax)
                      attention, not latent attention: GroupedQueryAttention's index_blocks

The selection rule (one, in every implementation): among the keys a query may see (its mask,
causal, lengths), the k = min(index_topk, Lk) highest scores, equal scores won by the lowest key
index; a row that sees fewer than k keys fills its remaining slots with the keys it may not
see, lowest index first (harmless: the attention's own mask still excludes them). The result,
key_indices (..., Lq, k) int, lists each row's keys best first.

Block selection (issue 44 part 4), options of GroupedQueryAttention (all inert without
index_blocks). Both families put it on ordinary GQA softmax attention (transformers 5.23.0:
MiniMaxM3VLAttention(MiniMaxM2Attention), Qwen4ExpTextAttention(Qwen3_5Attention)); each query
keeps whole blocks of b consecutive keys:
    index_blocks        None (no indexer), "max" or "mean", the family's scorer:
      "max"   MiniMax M3 (MiniMaxM3VLIndexer): q^I = RMS(x W_index_q)·index_q_norm, (L, H_I, D_I),
              k^I = RMS(x W_index_k)·index_k_norm, (L, D_I), both turned by the layer's RoPE
              (rotate-half, its rotary features); token scores S[h, t, j] = q^I[t, h]·k^I[j] (no
              scale), those of keys t may not see dropped (Hugging Face drops only the
              future, by position: the same under right padding; under another mask it pools
              keys the mask hides, ours does not); block m = keys m·b … m·b + b − 1 (by key
              index); its score the max of its keys' (a block with none: not eligible); the
              index_local_blocks blocks q_b, q_b − 1, … (q_b = position_t // b, clipped at 0)
              always kept; then the highest-scoring eligible blocks, index_topk_blocks in all.
              One choice per indexer head: H_I = num_kv_heads, each KV group's query heads
              attend their group's blocks.
      "mean"  Qwen4-Exp (Qwen4ExpTextQSAIndexer): q^I = RMS(x W_index_q)·index_q_norm turned at
              its position; the raw keys x W_index_k; for query t, the keys it may see, in
              order, cut into complete blocks of b (the last < b of them, the tail, always
              kept); a block's key = RMS(mean of its raw keys)·index_k_norm turned at its first
              token's position; its score Σ_h ReLU(q^I[t, h]·key) / √D_I; the index_topk_blocks
              highest-scoring blocks kept, and the tail. One choice for all heads.
    index_heads, index_head_dim   H_I, D_I (D_I at least the layer's rotary features)
    index_block_size    b (MiniMax index_block_size; Qwen4-Exp indexer_compress_ratio)
    index_topk_blocks   blocks kept (MiniMax index_topk_blocks, local ones included; Qwen4-Exp
                        indexer_budget / indexer_compress_ratio)
    index_local_blocks  MiniMax's local blocks (≤ index_topk_blocks); 0 with "mean" (refused
                        otherwise: Qwen4-Exp keeps its tail instead, not built for "mean")
    index_norm_eps      ε of the indexer's two RMSNorms (their weights are the multipliers:
                        Hugging Face's Gemma-style 1 + w is converted on import)
Equal block scores: the lowest block index wins (as for tokens; torch.topk in Hugging Face's
may break a tie otherwise, e.g. Qwen4-Exp's blocks whose every ReLU is 0). The choice expanded to
key_indices (..., [H,] Lq, k): the chosen blocks' keys best block first, each block's in index
order (then the tail), the rest of the k slots repeating the row's first chosen key (key 0 if
it chose none); k = min(index_topk_blocks · b, Lk) ("max", per query head) or
min(index_topk_blocks · b + b − 1, Lk) ("mean", shared). The attention then sees only the keys
its mask allows AND the chosen ones; no gradient through the choice (the chosen keys are
integers; Hugging Face's indexer parameters get none, and neither do ours).

Shape legend: L tokens (Lq queries, Lk keys), H_I indexer heads, D_I indexer head width,
d_in the model width, q_lora the query latent's width, b the block size.
"""

from __future__ import annotations

import numpy as np

INDEX_ROPES = ("half", "interleaved", None)
INDEX_ROPE_DIMS = ("first", "last")
INDEX_QUERIES = ("latent", "layer_norm")
INDEX_SCALES = ("scores", "weights")
INDEX_SELECTS = ("tokens", "given")
REFUSED_SELECTS = {"blocks": "MiniMax M3's and Qwen4-Exp's block selection sits on "
                             "grouped-query attention: GroupedQueryAttention's index_blocks"}
INDEX_BLOCKS = ("max", "mean", None)

# (name, default) of every block-selection option of GroupedQueryAttention, in its order
BLOCK_DEFAULTS = (("index_blocks", None), ("index_heads", None), ("index_head_dim", None),
                  ("index_block_size", None), ("index_topk_blocks", None),
                  ("index_local_blocks", 0), ("index_norm_eps", 1e-6))
# The parameters only the block indexer reads: they have no gradient.
BLOCK_PARAMS = ("W_index_q", "W_index_k", "index_q_norm", "index_k_norm")

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


def _check_inert(c, defaults) -> None:
    """ValueError naming the first option of ``defaults`` ((switch, default) first, then the
    options it turns on) that ``c`` sets while the switch is off."""
    switch = defaults[0][0]
    for name, default in defaults[1:]:
        if c[name] != default:
            raise ValueError(f"{name} should be {default!r} without {switch} (no indexer), "
                             f"got {c[name]!r}")


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
        raise ValueError(f"{name} should be 'tokens' (the top-k keys) or 'given' (the previous "
                         f"layer's), got {value!r}: {REFUSED_SELECTS[value]}")
    _one_of(name, value, INDEX_SELECTS)


def check_index_blocks(name, value) -> None:
    _one_of(name, value, INDEX_BLOCKS)


def check_local_blocks(name, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} should be an int ≥ 0, got {value!r}")


def block_shapes(c, rotary) -> dict:
    """The block indexer's parameters for a full GroupedQueryAttention configuration ``c`` whose
    RoPE turns ``rotary`` features (0 without RoPE), {} without index_blocks; ValueError naming
    a setting that does not fit the others. Options not in ``c`` take their defaults."""
    c = {**dict(BLOCK_DEFAULTS), **c}
    if c["index_blocks"] is None:
        _check_inert(c, BLOCK_DEFAULTS)
        return {}
    for name in ("index_heads", "index_head_dim", "index_block_size", "index_topk_blocks"):
        if c[name] is None:
            raise ValueError(f"{name} should be a positive int with index_blocks = "
                             f"{c['index_blocks']!r}, got None")
    h, d, kind = c["index_heads"], c["index_head_dim"], c["index_blocks"]
    if rotary == 0 or c["rope_interleaved"]:
        raise ValueError(f"index_blocks should be None without rotate-half RoPE (both families "
                         f"turn the indexer by the layer's rotate-half RoPE), got {kind!r} with "
                         f"rope_theta = {c['rope_theta']!r}, rope_interleaved = "
                         f"{c['rope_interleaved']!r}")
    rope = c.get("rope_parameters") or {}
    if rope.get("rope_type") == "axial" or "mrope_section" in rope:
        raise ValueError(f"index_blocks should be None with a multi-axis RoPE (the indexer turns "
                         f"by one position per token, rotate-half), got {kind!r} with "
                         f"rope_parameters = {dict(rope)!r}")
    if rotary > d:
        raise ValueError(f"index_head_dim should be at least the layer's rotary features = "
                         f"{rotary} (the indexer turns that many), got {d}")
    if kind == "max" and h != c["num_kv_heads"]:
        raise ValueError(f"index_heads should be num_kv_heads = {c['num_kv_heads']} with "
                         f"index_blocks = 'max' (one choice per KV group), got {h}")
    if kind == "max" and c["index_local_blocks"] > c["index_topk_blocks"]:
        raise ValueError(f"index_local_blocks should be at most index_topk_blocks = "
                         f"{c['index_topk_blocks']} (the local blocks are among those kept), "
                         f"got {c['index_local_blocks']}")
    for name in ("kv_shared", "merged_context"):  # the reference has neither: not built
        if c.get(name):
            raise ValueError(f"{name} should be False with index_blocks = {kind!r} (a block "
                             f"indexer beside another layer's keys or a context: not built), "
                             f"got True")
    if kind == "mean" and c["index_local_blocks"] != 0:
        raise ValueError(f"index_local_blocks should be 0 with index_blocks = 'mean' (Qwen4-Exp "
                         f"keeps its tail, not local blocks: not built), got "
                         f"{c['index_local_blocks']}")
    return {"W_index_q": (c["d_in"], h * d), "W_index_k": (c["d_in"], d),
            "index_q_norm": (d,), "index_k_norm": (d,)}


def block_key_shape(c, weights_shape) -> tuple:
    """The shape of a block indexer's key_indices for a full configuration ``c`` and attention
    weights (..., H, Lq, Lk): (..., H, Lq, k) for "max", (..., Lq, k) for "mean", k =
    min(index_topk_blocks · b, Lk) or min(index_topk_blocks · b + b − 1, Lk)."""
    b, n, lk = c["index_block_size"], c["index_topk_blocks"], weights_shape[-1]
    if c["index_blocks"] == "max":
        return tuple(weights_shape[:-1]) + (min(n * b, lk),)
    return tuple(weights_shape[:-3]) + (weights_shape[-2], min(n * b + b - 1, lk))


def index_shapes(c) -> dict:
    """The indexer's parameters (neutral layout, W (in, out)) for a full MultiHeadLatentAttention
    configuration ``c``, {} without index_topk; ValueError naming a setting that does not fit
    the others."""
    if c["index_topk"] is None:
        _check_inert(c, INDEX_DEFAULTS)
        return {}
    if c["index_select"] == "given":  # a "shared" layer: the previous layer's choice
        for name, default in INDEX_DEFAULTS[1:-1]:
            if c[name] != default:
                raise ValueError(f"{name} should be {default!r} with index_select='given' (the "
                                 f"layer has no indexer of its own: it takes the previous "
                                 f"layer's choice), got {c[name]!r}")
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


def check_index_mask(mask, lead, option="index_topk") -> None:
    """The indexer chooses among the keys one mask lets a query see (Hugging Face reads
    attention_mask[:, 0]): a mask with a head axis must have it of size 1. ``option`` names
    the indexer's setting (index_topk, or GroupedQueryAttention's index_blocks)."""
    if mask is not None and np.ndim(mask) == len(lead) + 3 and np.shape(mask)[-3] != 1:
        raise ValueError(f"mask should have no head axis, or one of size 1, with {option} (the "
                         f"indexer chooses among the keys one mask lets each query see), got "
                         f"shape {tuple(np.shape(mask))}")


def require_given(config, key_indices) -> None:
    """A layer of index_select "given" chooses nothing itself: ValueError when a call gives no
    key_indices."""
    if config["index_select"] == "given" and key_indices is None:
        raise ValueError("key_indices should be given with index_select='given' (the layer takes "
                         "the previous layer's choice: that layer's return_key_indices=True "
                         "gives it), got None")


def refuse_selection(option, key_indices, return_key_indices) -> None:
    """A layer without an indexer (``option``, index_topk or index_blocks, None) takes neither
    a given selection nor returns one: ValueError naming the argument."""
    if key_indices is not None:
        raise ValueError(f"key_indices should be None without {option} (no indexer), got an "
                         f"array")
    if return_key_indices:
        raise ValueError(f"return_key_indices should be False without {option} (no indexer), "
                         f"got True")


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


def check_index_cache(cache, index_dim, dtype, option="index_topk") -> None:
    """A cache for a layer with an indexer: index_key (B, M, D_I) beside a LatentCache's latent
    (B, M, kv_lora_rank) or a KVCache's key (B, Hkv, M, Dh), in x's ``dtype``. ``option``
    names the indexer's setting (index_topk, or GroupedQueryAttention's index_blocks)."""
    held = getattr(cache, "index_key", None)
    lead = (tuple(cache.latent.shape[:2]) if hasattr(cache, "latent")
            else (cache.key.shape[0], cache.key.shape[2]))
    want = lead + (index_dim,)
    if held is None:
        raise ValueError(f"cache.index_key should be an array of shape (B, M, index_head_dim) = "
                         f"{want} with {option} (the indexer's keys: init_cache makes it), "
                         f"got None")
    if tuple(held.shape) != want or held.dtype != dtype:
        raise ValueError(f"cache.index_key should be (B, M, index_head_dim) = {want} in x's "
                         f"dtype {dtype}, got {tuple(held.shape)} {held.dtype}")

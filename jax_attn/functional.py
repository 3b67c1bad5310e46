"""The JAX attention core: written for one head, vmapped over heads and batch, jitted.

Shape legend: B batch, H query heads, Hkv key-value heads, G = H / Hkv query heads per key-value
head, Lq query length, Lk key length, Dk key width, Dv value width.
Inputs are (B, H, L, D), (H, L, D) or (L, D); key and value may have Hkv heads where the query
has H (grouped-query attention: query head h reads key-value head h // G). Masks and biases
broadcast to (..., H, Lq, Lk). Every dot takes ``precision`` (default HIGHEST: full float32 on
GPU and TPU too).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from golden.specification.implementations import Asked, Implementation, Registry, ran_instead
from golden.specification.validate import (
    check_attention_args,
    check_block_sizes,
    check_distance_bias,
    check_distance_product,
    check_flags,
    check_key_indices,
    window,
    with_head_axis,
)
from jax_attn import accelerators, blockwise, explicit, sparse, splash
from jax_attn.sharding import (
    check_head_sharding,
    explicit_spec,
    heads_as_query,
    on_mesh,
    on_one_device,
)

DEFAULT_PRECISION = jax.lax.Precision.HIGHEST
NO_WINDOW = explicit.NO_WINDOW


def scaled_dot_product_attention(
    query, key, value, mask=None, bias=None, *,
    is_causal=False, scale=None, softcap=None, local_window_size=None, attention_chunk_size=None,
    query_offset=None, query_seq_lengths=None, key_value_seq_lengths=None, sinks=None,
    dropout_rate=0.0, dropout_mask=None, dropout_rng=None, implementation=None,
    return_weights=False, block_sizes=None, key_indices=None, precision=DEFAULT_PRECISION,
    distance_bias=None, distance_query=None, distance_keys=None,
):
    """softmax(c · tanh(scale · Q Kᵀ / c) + bias, over allowed keys) V (without ``softcap`` c:
    scale · Q Kᵀ + bias).

    key and value may have Hkv heads, H a multiple of Hkv (query head h reads kv head h // G).
    Key j sits at position j, query row i at i + ``query_offset`` (an int, or an integer array
    (B,) for rank-4 inputs, () otherwise). Row i may attend key j when ``mask`` (bool, True = may
    attend) allows it, j ≤ its position (``is_causal``), position − left ≤ j ≤ position + right
    (``local_window_size`` w or (left, right), a side None = unbounded), j // C = position // C
    (``attention_chunk_size`` C, Llama 4's chunked attention), j < the batch's
    ``key_value_seq_lengths`` and i < its ``query_seq_lengths``. A query row with no allowed key
    gives zeros in the output and the weights. ``is_causal``, ``softcap``, the window and the
    chunk size are static (one compilation each); offsets and lengths are traced (a growing
    offset does not recompile).
    sinks: GPT-OSS's attention sinks, one logit per query head ((H,), or () for (Lq, Dk)
    inputs, the query's dtype; traced and differentiable) that joins every row's softmax
    denominator and takes no value: weights = softmax([S, s_h])[..., :-1], so a row's weights
    sum to less than 1 and a row with no allowed key still gives zeros. The sink is added after
    the scale and the soft-cap (GPT-OSS has no soft-cap; we never cap the sink) and no mask or
    bias touches it. "blockwise" starts each row's online softmax from it (m = s_h, l = 1)
    and gives its gradient from the saved log-sum-exp.
    distance_bias: a bias that depends only on key position − query position d (ALiBi's
    m_h · d, T5's buckets), added as ``bias`` is: (H, 2S + 1) or (B, H, 2S + 1) ((2S + 1,)
    for (Lq, Dk) inputs), any float dtype, entry S + d for d in −S … S (a farther d takes the
    nearest end); traced and differentiable. "explicit" forms its (Lq, Lk) terms; "blockwise"
    gathers each block's, so a long sequence's bias costs O(L) memory, not O(Lq·Lk). The
    twins' modules build it (jax_attn.modules.GroupedQueryAttention's alibi and T5 buckets).
    distance_query, distance_keys: a term of the raw scores that is each query row's product
    with a table of vectors over key − query distances (the relative positions' term:
    Transformer-XL's (q_i + v)·W_pos R(i − j) times the scale, the USM Conformer's q̃_i·E(i − j):
    jax_attn.modules.GroupedQueryAttention's relative_positions), added to scale · Q Kᵀ before
    the soft cap (c · tanh((scale · Q Kᵀ + T) / c), as Gemma 3n's and Gemma 4's audio encoders
    cap the sum; ``bias`` and distance_bias come after it): distance_query (H, Lq, Dr) or
    (B, H, Lq, Dr), distance_keys (H, 2S + 1, Dr) or (B, H, 2S + 1, Dr) ((Lq, Dr) and
    (2S + 1, Dr) for (Lq, Dk) inputs), both or neither, any float dtypes; the term of query
    row i and key j is distance_query[i] · distance_keys[S +
    clip(j − p_i, −S, S)], p_i = i + query_offset; traced and differentiable. "explicit" forms
    the (Lq, 2S + 1) products and gathers each key's; "blockwise" forms each block's products
    with the Bq + Bk − 1 distances it spans and never an (Lq, Lk) or (Lq, 2S + 1) array, so the
    term costs O(L·Dr) memory.
    dropout_mask: bool, True = kept (weights kept are scaled by 1/(1 − dropout_rate)); without it,
    one is drawn from ``dropout_rng`` (a ``jax.random`` key), which is then required.
    key_indices: a selection (DeepSeek-V3.2's indexer's top-k): an integer array (Lq, k), or
    (B, Lq, k) for (B, H, Lq, Dk) inputs, shared by every head, or one per head, (H', Lq, k) or
    (B, H', Lq, k) with H' = H or 1; values in [0, Lk) (checked where concrete; under jit an
    index outside chooses nothing); traced. Query row i may attend key j only when j is one of
    key_indices[..., i, :] and every rule above allows it; a repeated index means what it means
    once. Not differentiable. "sparse" reads only the chosen keys; "explicit" and "blockwise"
    take it as the boolean mask it stands for (jax_attn.sparse.selected_mask: an (..., Lq, Lk)
    array, so blockwise's memory is then O(Lq·Lk) bits); the accelerator kernels refuse it.
    Returns the output (..., H, Lq, Dv), and with ``return_weights`` also the applied weights
    (..., H, Lq, Lk), after masking and dropout, in the query's dtype.

    ``implementation`` names one of IMPLEMENTATIONS, each the same function of the arguments;
    one that cannot honour an argument raises a ValueError saying why (never a fallback):
    - "explicit" (jax_attn.explicit): each head's (Lq, Lk) weights formed (with static
      positions, in tiles of query rows against only the keys the causal bound, the window or
      the chunks let them see). Takes everything but ``block_sizes``.
    - "blockwise" (jax_attn.blockwise): FlashAttention-2's online softmax and a backward of its
      own that recomputes each block from the saved log-sum-exp, memory O(L); key blocks wholly
      outside the causal bound, the window or the lengths are skipped by index. It never forms
      the weights, so it cannot return them. ``block_sizes``: (Bq, Bk), its largest query and
      key blocks, static ints (default blockwise.DEFAULT_BLOCK_SIZES = (1024, 1024)); each
      length is split into the fewest blocks of at most that size, evenly, the last one masked
      where ragged.
    - "sparse" (jax_attn.sparse): with ``key_indices`` only, each row's k chosen keys and values
      gathered (the G query heads of a kv head share one gather when the selection has no
      head axis), the rules, the mask and the bias taken at those keys, the softmax over the k
      (scale, soft-cap, sinks), by blocks of query rows, and a backward of its own that
      recomputes each block from the saved log-sum-exp: memory O(Lq·k) plus one block's
      gathered keys and values, never an (Lq, Lk) array. ``block_sizes``: (Bq, Bk), Bq the rows
      per block (default sparse.default_rows: 2¹⁶ // k), Bk unused. No weights, no dropout, no
      distance terms.
    - "cudnn" (jax_attn.accelerators): cuDNN's fused flash attention through
      ``jax.nn.dot_product_attention(implementation="cudnn")``, on an NVIDIA GPU, float16 and
      bfloat16, Dk = Dv: mask, bias, is_causal, scale, GQA, a window (left, 0) or causal, the
      lengths; refuses the rest (jax_attn.accelerators.cudnn_refuses).
    - "pallas" (jax_attn.accelerators): the Pallas flash kernel (pallas.ops.gpu.attention),
      Dk = Dv, is_causal and scale only; compiled on a GPU (float16, bfloat16), Pallas's
      interpret mode on a CPU.
    - "splash" (jax_attn.splash): the TPU splash-attention kernel
      (pallas.ops.tpu.splash_attention), float32 and bfloat16, lengths multiples of 128:
      is_causal, scale, softcap, a window, attention_chunk_size with is_causal, the lengths,
      sinks, GQA; compiled on a TPU, Pallas's interpret mode elsewhere
      (jax_attn.splash.splash_refuses).
    - None: ``choose``, "sparse" first when ``key_indices`` chooses k ≤ Lk / SPARSE_UP_TO keys
      per row; then "blockwise" first when one head's Lq·Lk is above BLOCKWISE_ABOVE = 2²⁰
      (L > 1024 for Lq = Lk; on a GPU GPU_BLOCKWISE_ABOVE = 2²⁴, L > 4096), else "explicit"
      first, and on a GPU "cudnn" then "pallas", on a TPU "splash", before both; the first that
      takes the call runs it. "explicit" chosen so, without the weights and forming more than
      SPLIT_ABOVE = 2²² scores over all heads (B·H·Lq·Lk, or what its causal, window or chunk
      tiles cover), is differentiated with blockwise's backward from the statistics its forward
      saves (explicit.attend_split; record() then lists "blockwise" too); with fewer, by JAX.
      Where that split applies, or "blockwise" is chosen, the forward that runs when the call is
      not differentiated is the faster of the two measured for it (``forward_passes``:
      blockwise's for untiled float32 explicit from Lq·Lk = 2¹⁸, explicit's causal tiles for
      bfloat16 blockwise up to Lq·Lk = 2²²); record() names that one, and, when the call is
      differentiated, the forward and backward that ran instead. Its blockwise takes blocks of
      CAUSAL_BLOCK_SIZES = (512, 512) for a causal call without other extras up to Lq·Lk = 2²⁴
      (``none_blocks``). The measurements: docs/performance.md (a CPU's; a GPU's, an H200's, in
      its "GPU" section; no TPU's).
    ``golden.specification.implementations.record()`` collects the name each call ran (when traced).
    Dropout drawn from ``dropout_rng`` differs between the implementations for the same key:
    explicit draws one (..., H, Lq, Lk) mask, blockwise draws each block's mask from
    fold_in(fold_in(fold_in(key, b·H + h), query block), key block) so that its backward
    regenerates it; both keep each weight with probability 1 − dropout_rate. A ``dropout_mask``
    gives both the same result.
    Arrays sharded over a jax.sharding.Mesh (batch over one axis, heads over another) run
    unchanged, each device computing its own heads, and the output keeps the query's sharding;
    jax_attn.sharding gives the specs.
    """
    check_attention_args(query, key, value, mask, bias, scale=scale, softcap=softcap,
                         local_window_size=local_window_size, query_offset=query_offset,
                         query_seq_lengths=query_seq_lengths,
                         key_value_seq_lengths=key_value_seq_lengths,
                         dropout_rate=dropout_rate, dropout_mask=dropout_mask, sinks=sinks,
                         attention_chunk_size=attention_chunk_size)
    if distance_bias is not None:
        check_distance_bias(distance_bias, query)
    check_distance_product(distance_query, distance_keys, query)
    if key_indices is not None:
        check_key_indices(key_indices, query, key)
    check_flags(is_causal=is_causal, return_weights=return_weights)
    block_sizes = check_block_sizes(block_sizes)
    asked = _asked(query, key, value, mask, bias, is_causal=is_causal, softcap=softcap,
                   local_window_size=local_window_size, query_offset=query_offset,
                   lengths=(query_seq_lengths, key_value_seq_lengths), sinks=sinks,
                   dropout_rate=dropout_rate, return_weights=return_weights,
                   block_sizes=block_sizes, chunk_size=attention_chunk_size,
                   distance_bias=distance_bias, distance_keys=distance_keys,
                   key_indices=key_indices)
    selected = None if key_indices is None else key_indices.shape[-1]
    chosen = IMPLEMENTATIONS.select(implementation, asked,
                                    choose(query.shape, key.shape, asked.platform, selected))
    if key_indices is not None and chosen.name != "sparse":  # the mask it stands for
        mask = sparse.selected_mask(with_head_axis(key_indices, query), mask, key.shape[-2])
        key_indices = None
    passes = None if implementation is not None else forward_passes(
        chosen.name, asked, query, key, query_offset, is_causal, local_window_size,
        attention_chunk_size)
    if passes is not None and passes[0] != chosen.name:  # the forward that runs undifferentiated
        ran_instead("jax", passes[0], chosen.name)
    if dropout_rate > 0.0 and dropout_mask is None and dropout_rng is None:
        raise ValueError("dropout_rng should be a jax.random key when dropout_rate > 0 and no "
                         "dropout_mask is given, got None")
    if dropout_rng is not None and not _is_key(dropout_rng):
        raise TypeError(f"dropout_rng should be a jax.random key (jax.random.key(seed)) or None, "
                        f"got {type(dropout_rng).__name__}")
    if dropout_rate == 0.0:
        dropout_rng = None
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    batch = query.shape[:1] if query.ndim == 4 else ()  # the offsets' and lengths' shape
    positions = (batch_int32(x, batch) for x in
                 (query_offset, query_seq_lengths, key_value_seq_lengths))
    if chosen.whole:  # an accelerator kernel: the whole call, its refusals checked above
        q_lengths, kv_lengths = (batch_int32(x, batch) for x in
                                 (query_seq_lengths, key_value_seq_lengths))
        out = chosen.run(query, key, value, mask, bias, q_lengths, kv_lengths, sinks,
                         scale=scale, is_causal=bool(is_causal),
                         window=window(local_window_size),
                         softcap=None if softcap is None else float(softcap),
                         chunk_size=attention_chunk_size)
        return out
    check_head_sharding(query, key)
    spec = explicit_spec(query)  # None unless on a mesh with explicit axes
    key, value = (heads_as_query(query, x, spec) for x in (key, value))
    one_device = on_one_device(query, key, value)
    attention = on_mesh(_attention, query, spec, return_weights)
    if key_indices is not None:  # (..., H'|1, Lq, k)
        key_indices = jnp.asarray(with_head_axis(key_indices, query), dtype=jnp.int32)
        one_device = False  # no chunks of heads: a head's gathered keys are O(Lq·k)
    out, weights = attention(query, key, value, mask, bias, dropout_mask, dropout_rng,
                             *positions, sinks, distance_bias, distance_query, distance_keys,
                             key_indices, scale=scale,
                             is_causal=bool(is_causal),
                             softcap=None if softcap is None else float(softcap),
                             window=window(local_window_size),
                             chunk_size=attention_chunk_size,
                             dropout_rate=float(dropout_rate), precision=precision,
                             return_weights=bool(return_weights),
                             chunk=heads_per_step(query.shape, key.shape) if one_device else None,
                             implementation=chosen.name,
                             block_sizes=block_sizes or (
                                 (sparse.default_rows(query.shape[-2], selected), 1)
                                 if chosen.name == "sparse" else
                                 none_blocks(implementation, asked, query, key)),
                             passes=passes)
    return (out, weights) if return_weights else out


# implementation=None's "explicit" is differentiated with "blockwise"'s backward when the scores
# explicit would keep for JAX's derivative (every head's, in its query tiles) are more than
# SPLIT_ABOVE: below it (L = 128; causal Lq = 256 of Lk = 1024) JAX's derivative, reading the
# kept weights, beat the backward that recomputes them; above it (L >= 512) the split passes
# were 1.1-1.7x faster (docs/performance.md, "Why the thresholds are where they are").
SPLIT_ABOVE = 2**22


def _split_passes(name, asked, kept) -> bool:
    """Whether implementation=None's "explicit" is differentiated with "blockwise"'s backward
    (jax_attn.explicit.attend_split): where the weights are not asked for and explicit would
    keep more than SPLIT_ABOVE scores (``kept``, every head's, in its tiles). On a CPU JAX's
    derivative of explicit, through its head-chunked loop, is 2-4x slower at L = 512-1024
    (docs/performance.md, "Where the CPU time goes")."""
    return (name == "explicit" and kept > SPLIT_ABOVE
            and IMPLEMENTATIONS.refuses("blockwise", asked) is None)


# implementation=None's forward when it is not differentiated (forward_passes), and its blocks
# for causal blockwise (none_blocks), measured on a CPU at B=4, H=8, D=64 without masks, biases
# or other extras (docs/performance.md, "Why the thresholds are where they are"): blockwise's
# forward, one block per head, is 6-10 % faster than explicit's untiled one in float32 from
# Lq·Lk = 2**18 (L = 512; equal at L = 256; slower in bfloat16); causal, blocks of 512 were
# 11-18 % faster than blocks of 1024 forward and forward+backward up to L = 4096 (B = 1, H = 4
# and 8 too), equal at L = 8192, 2-4 % slower at L = 16384 with one head, and at L = 2048 8 %
# faster than explicit's causal tiles in float32; in bfloat16 the tiles were 22 % faster.
FORWARD_BLOCKWISE_FROM = 2**18
FORWARD_TILES_UP_TO = 2**22
CAUSAL_BLOCK_SIZES = (512, 512)
CAUSAL_BLOCKS_UP_TO = 2**24


def _plain(asked) -> bool:
    """No mask, bias, soft-cap, sinks, lengths, offset, window, chunks, distance bias, dropout,
    block sizes, weights or mesh: the calls the thresholds above were measured on."""
    return asked._replace(platform="", dtype="", lengths=(), widths=(), heads=(),
                          causal=False) == Asked()


def none_blocks(implementation, asked, query, key) -> tuple:
    """The blocks blockwise runs in when the call names none: CAUSAL_BLOCK_SIZES for
    implementation=None's plain causal calls with Lq·Lk at most CAUSAL_BLOCKS_UP_TO, else
    blockwise.DEFAULT_BLOCK_SIZES."""
    small = query.shape[-2] * key.shape[-2] <= CAUSAL_BLOCKS_UP_TO
    if implementation is None and asked.causal and _plain(asked) and small:
        return CAUSAL_BLOCK_SIZES
    return blockwise.DEFAULT_BLOCK_SIZES


def forward_passes(name, asked, query, key, query_offset, is_causal, local_window_size,
                   chunk_size):
    """For implementation=None's choice ``name``: None (JAX differentiates it, or it is
    blockwise's custom_vjp alone), or (the forward run when the call is not differentiated,
    the forward whose statistics blockwise's backward reads when it is) for
    jax_attn.explicit.attend_split:
    - "explicit" forming more than SPLIT_ABOVE scores (_split_passes): its own forward under
      differentiation; when not, blockwise's where the call is plain (_plain), not causal,
      float32, and Lq·Lk is at least FORWARD_BLOCKWISE_FROM.
    - "blockwise": explicit's causal tiles when not differentiated where the call is plain,
      causal and bfloat16 and Lq·Lk is at most FORWARD_TILES_UP_TO; blockwise's own forward
      under differentiation."""
    lq, lk = query.shape[-2], key.shape[-2]
    found = _tiles(query, key, query_offset, is_causal, local_window_size, chunk_size)
    dtype = jnp.dtype(query.dtype)
    if name == "explicit":
        kept = math.prod(query.shape[:-2]) * sum((b - a) * (hi - lo) for a, b, lo, hi in found)
        if not _split_passes(name, asked, kept):
            return None
        blocks = (_plain(asked) and not is_causal and dtype == jnp.float32
                  and lq * lk >= FORWARD_BLOCKWISE_FROM)
        return ("blockwise" if blocks else "explicit", "explicit")
    if (name == "blockwise" and _plain(asked) and is_causal and len(found) > 1
            and dtype == jnp.bfloat16 and lq * lk <= FORWARD_TILES_UP_TO):
        return ("explicit", "blockwise")
    return None


def _tiles(query, key, query_offset, is_causal, local_window_size, chunk_size) -> list:
    """explicit's query tiles for these arguments (jax_attn.explicit.tiles): one for the whole
    (Lq, Lk) when none apply."""
    static = blockwise.Static(1.0, bool(is_causal), None, window(local_window_size), 0.0, None,
                              1, 1, chunk_size=chunk_size)
    return explicit.tiles(query.shape[-2], key.shape[-2], query_offset, static)


def _asked(query, key, value, mask, bias, *, is_causal, softcap, local_window_size, query_offset,
           lengths, sinks, dropout_rate, return_weights, block_sizes, chunk_size,
           distance_bias, distance_keys=None, key_indices=None) -> Asked:
    """What the call asks of an implementation (golden.specification.implementations.Asked)."""
    return Asked(return_weights=bool(return_weights), softcap=softcap is not None,
                 dropout=dropout_rate > 0.0, block_sizes=block_sizes, sinks=sinks is not None,
                 platform=_platform(query), dtype=jnp.dtype(query.dtype).name,
                 lengths=(query.shape[-2], key.shape[-2]),
                 widths=(key.shape[-1], value.shape[-1]),
                 heads=(query.shape[-3] if query.ndim > 2 else 1,
                        key.shape[-3] if key.ndim > 2 else 1),
                 mask=mask is not None, bias=bias is not None, causal=bool(is_causal),
                 window=window(local_window_size),
                 seq_lengths=any(x is not None for x in lengths),
                 offset=query_offset is not None, chunk=chunk_size is not None,
                 distance_bias=distance_bias is not None,
                 distance_keys=distance_keys is not None,
                 key_indices=key_indices is not None,
                 sharded=explicit_spec(query) is not None)


def _platform(x) -> str:
    """The platform x lives on ("cpu", "gpu", "tpu"): its devices' when it is a concrete array,
    else (traced, a NumPy array) the default backend's."""
    try:
        return next(iter(x.devices())).platform
    except (AttributeError, TypeError, RuntimeError, jax.errors.ConcretizationTypeError):
        return jax.default_backend()


def _is_key(rng) -> bool:
    """A typed key (jax.random.key) or a raw uint32 one (jax.random.PRNGKey), traced or not."""
    dtype = getattr(rng, "dtype", None)
    if dtype is None:
        return False
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) or (
        dtype == jnp.uint32 and len(rng.shape) >= 1)


def batch_int32(x, batch):
    """An offset or lengths (Python int or integer array) as an int32 array of shape ``batch``:
    traced by the jitted core, so a new value does not recompile."""
    return None if x is None else jnp.broadcast_to(jnp.asarray(x, dtype=jnp.int32), batch)


# Heads per step on CPU: the one-head core is vmapped over chunks of this many (batch, head)
# pairs and the chunks run in sequence (``lax.map(..., batch_size=...)``), so one chunk's scores
# stay in cache. Below about 8 MiB of float32 scores one vmap over every head is as fast and
# compiles in half the time, so chunks start at CPU_CHUNK_MIN_SCORES score elements; the
# measurements behind both numbers: docs/performance.md, "Why the thresholds are where they
# are". Accelerators take the plain vmap over heads and batch.
CPU_HEADS_PER_STEP = 2
CPU_CHUNK_MIN_SCORES = 2**21


def heads_per_step(q_shape, k_shape):
    """The chunk size for these shapes on the default backend (None: one vmap over all)."""
    scores = math.prod(q_shape[:-1]) * k_shape[-2]  # (..., Lq, Lk) elements
    large = scores >= CPU_CHUNK_MIN_SCORES and math.prod(q_shape[:-2]) > CPU_HEADS_PER_STEP
    return CPU_HEADS_PER_STEP if jax.default_backend() == "cpu" and large else None


# None takes blockwise first once one head's scores Lq·Lk are more than BLOCKWISE_ABOVE; the
# measurements (forward and forward + backward, several block shapes and lengths, on a CPU):
# docs/performance.md, "Why the thresholds are where they are". Below it, explicit's forward is
# differentiated with blockwise's backward (_split_passes).
BLOCKWISE_ABOVE = 2**20
# On a GPU, where the accelerators refuse a call (float32, soft-cap, sinks, ...), explicit first
# up to Lq·Lk = 2²⁴: on an H200 at L = 4096 (B4 H16 D128 bfloat16) explicit ran 3.6-5.5× faster
# forward and 1.9-2.0× forward+backward than blockwise (docs/performance.md, "GPU"; at L = 16384
# explicit's weights do not fit, and above 2²⁴ nothing between was measured). A differentiated
# call there runs explicit's forward with blockwise's backward (_split_passes), not measured on
# a GPU as such: its forward is the faster one, its backward blockwise's as before.
GPU_BLOCKWISE_ABOVE = 2**24


ACCELERATORS = {"gpu": ("cudnn", "pallas"), "tpu": ("splash",)}  # preferred there, in order
# None takes "sparse" first when key_indices chooses k ≤ Lk / SPARSE_UP_TO keys per row, else the
# dense choice with the (Lq, Lk) mask the selection stands for. Measured (docs/performance.md, "A
# given selection", 2-core AMD EPYC, k = 2048, D = 128, causal, float32): with 16 query heads on
# one kv head, at Lk = 8k (k = Lk/4) JAX's masked dense forward beat sparse (1.0 s against
# 1.25 s), at 16k (k = Lk/8) sparse beat it (4.2 s against 4.6 s) and reads no (L, L) mask; with
# one head per kv head the masked dense forward stayed 3.5x faster at 16k, but holds that mask
# (256 MiB per batch row there, 4 GiB at 64k). Hence Lk/8.
SPARSE_UP_TO = 8


def takes_sparse(selected, lk, return_weights=False) -> bool:
    """Whether a module hands its indexer's selection to the core as ``key_indices`` (which
    ``implementation=None`` then runs "sparse": k ≤ Lk / SPARSE_UP_TO keys per row, no weights
    asked) rather than as the boolean mask it stands for (static: shapes only)."""
    return not return_weights and selected * SPARSE_UP_TO <= lk


def choose(q_shape, k_shape, platform=None, selected=None) -> tuple:
    """The order of preference of ``implementation=None`` for these shapes on ``platform``
    (default: the default backend): the first that takes the call runs it. On a GPU the
    accelerator kernels come first ("cudnn", then "pallas"), on a TPU "splash", each taking
    only the calls it can (dtypes, lengths, no weights, ...: their refusals), then the
    portable order; on a CPU the portable order alone ("pallas" and "splash" on a CPU are
    interpret mode: only when asked for by name). The portable order: "blockwise" first above
    BLOCKWISE_ABOVE (a GPU: GPU_BLOCKWISE_ABOVE) of one head's Lq·Lk, else "explicit" first.
    With ``selected`` keys per row (key_indices' k) at most Lk / SPARSE_UP_TO, "sparse" comes
    before all (the accelerators refuse a selection)."""
    platform = platform or jax.default_backend()
    if selected is not None and selected * SPARSE_UP_TO <= k_shape[-2]:
        return ("sparse",) + choose(q_shape, k_shape, platform)
    above = GPU_BLOCKWISE_ABOVE if platform == "gpu" else BLOCKWISE_ABOVE
    portable = (("blockwise", "explicit") if q_shape[-2] * k_shape[-2] > above
                else ("explicit", "blockwise"))
    return ACCELERATORS.get(platform, ()) + portable



def _explicit_refuses(asked):
    return "block_sizes is for 'blockwise'" if asked.block_sizes is not None else None


def _blockwise_refuses(asked):
    if asked.return_weights:
        return ("it never forms the (Lq, Lk) weights, which is what keeps its memory O(L): "
                "return_weights=True needs 'explicit'")
    return None


def _sparse_refuses(asked):
    reasons = [why for why, asks in [
        ("it needs key_indices (the keys each query row may choose from)",
         not asked.key_indices),
        ("it never forms the (Lq, Lk) weights, which is what keeps its memory O(Lq·k): "
         "return_weights=True needs 'explicit'", asked.return_weights),
        ("a dropout mask is (Lq, Lk): use 'explicit' or 'blockwise'", asked.dropout),
        ("it takes no distance_bias, distance_query or distance_keys: use 'explicit' or "
         "'blockwise'", asked.distance_bias or asked.distance_keys)] if asks]
    return "; ".join(reasons) or None


# Each implementation runs one head: run(q, k, v, mask, bias, dropout_mask, rng, offset,
# q_lengths, kv_lengths, sink, distance_bias, distance_query, distance_keys, *, static) ->
# (output, weights | None); the core vmaps it.
IMPLEMENTATIONS = Registry(
    "jax",
    Implementation("explicit", explicit.attend, _explicit_refuses),
    Implementation("blockwise", blockwise.attend, _blockwise_refuses),
    Implementation("sparse", sparse.attend, _sparse_refuses, grouped=True),
    Implementation("cudnn", accelerators.cudnn, accelerators.cudnn_refuses, whole=True),
    Implementation("pallas", accelerators.pallas, accelerators.pallas_refuses, whole=True),
    Implementation("splash", splash.splash, splash.splash_refuses, whole=True),
)


@partial(jax.jit, static_argnames=("scale", "is_causal", "softcap", "window", "dropout_rate",
                                   "precision", "return_weights", "chunk", "implementation",
                                   "block_sizes", "chunk_size", "passes"))
def _attention(query, key, value, mask, bias, dropout_mask, rng, offset=None, q_lengths=None,
               kv_lengths=None, sinks=None, distance_bias=None, distance_query=None,
               distance_keys=None, key_indices=None, *, scale, is_causal, dropout_rate,
               precision, return_weights, softcap=None, window=NO_WINDOW, chunk_size=None,
               chunk=None, implementation="explicit", block_sizes=blockwise.DEFAULT_BLOCK_SIZES,
               passes=None):
    """Lift to (B, Hkv, G, ...), vmap the implementation's one-head core over G (key and value
    not mapped), Hkv and B, drop the added axes. offset, q_lengths, kv_lengths: int arrays (B,)
    or (), or None. ``passes``: None, or the (forward, differentiated forward) pair of
    explicit.attend_split (forward_passes) for "explicit" or "blockwise" alike. "explicit"
    draws one dropout mask for every head here; "blockwise" draws its own from rng, one stream
    per (batch, head), block by block."""
    lead = query.shape[:-2]
    shape = lead + (query.shape[-2], key.shape[-2])  # (..., H, Lq, Lk)
    blocks = implementation == "blockwise"
    if dropout_rate > 0.0 and dropout_mask is None and not blocks:
        dropout_mask = jax.random.bernoulli(rng, 1.0 - dropout_rate, shape)
    q, k, v = (_lift(x) for x in (query, key, value))  # (B, H, Lq, Dk), (B, Hkv, Lk, D)
    groups = q.shape[1] // k.shape[1]  # G
    q = q.reshape(q.shape[:1] + (k.shape[1], groups) + q.shape[2:])  # (B, Hkv, G, Lq, Dk)
    extras = tuple(None if x is None else _group(_lift(x), groups)
                   for x in (mask, bias, dropout_mask))  # (B|1, Hkv|1, G|1, Lq|1, Lk|1)
    extras += tuple(None if x is None else x.reshape((x.shape[:1] or (1,)) + (1, 1))
                    for x in (offset, q_lengths, kv_lengths))  # (B|1, 1, 1)
    extras += (None if sinks is None else sinks.reshape((1,) + q.shape[1:3]),)  # (1, Hkv, G)
    extras += (None if distance_bias is None else distance_bias.reshape(
        (distance_bias.shape[:-2] or (1,)) + q.shape[1:3] + distance_bias.shape[-1:]),)
    # (B|1, Hkv, G, 2S + 1)
    extras += tuple(None if x is None else _group(_lift(x), groups)
                    for x in (distance_query, distance_keys))  # (B|1, Hkv, G, Lq | 2S + 1, Dr)
    drawn = blocks and dropout_rate > 0.0 and dropout_mask is None
    extras += (jnp.arange(math.prod(q.shape[:3]), dtype=jnp.int32).reshape(q.shape[:3])
               if drawn else None,)  # (B, Hkv, G): the head's dropout stream
    extras += (None if key_indices is None else _group(_lift(key_indices), groups),)
    # (B|1, Hkv|1, G|1, Lq, k): "sparse"'s selection

    static = blockwise.Static(scale, is_causal, softcap, window, dropout_rate, precision,
                              *block_sizes, chunk_size=chunk_size)

    attend = (IMPLEMENTATIONS[implementation].run if passes is None else
              partial(explicit.attend_split, passes=passes))

    def one(q, k, v, mask, bias, dropout_mask, offset, q_lengths, kv_lengths, sink, distance,
            distance_query, distance_keys, stream, indices):
        head_rng = None if stream is None else jax.random.fold_in(rng, stream)
        selection = {} if indices is None else {"key_indices": indices}  # "sparse" alone
        out, weights = attend(q, k, v, mask, bias, dropout_mask, head_rng, offset, q_lengths,
                              kv_lengths, sink, distance, distance_query, distance_keys,
                              static=static, **selection)
        return (out, weights) if return_weights else (out, None)  # weights only when asked for

    grouped = passes is None and IMPLEMENTATIONS[implementation].grouped
    copies = implementation == "blockwise" or passes is not None  # _over_groups says why
    run = (partial(_vmap_all, grouped=grouped, copies=copies) if chunk is None else
           partial(_vmap_chunks, chunk=chunk, copies=copies))
    out, weights = run(one, q, k, v, extras)  # (B, Hkv, G, Lq, Dv), (B, Hkv, G, Lq, Lk)
    return out.reshape(lead + out.shape[-2:]), (weights.reshape(shape) if return_weights else None)


def _lift(x):
    """(…, L, D) -> (B|1, H|1, L, D): missing leading axes become size 1."""
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _group(x, groups):
    """(B|1, H|1, Lq, Lk) -> (B|1, Hkv|1, G|1, Lq, Lk): head h = kv head h // G, member h % G."""
    heads = (1, 1) if x.shape[1] == 1 else (x.shape[1] // groups, groups)
    return x.reshape(x.shape[:1] + heads + x.shape[2:])


def _vmap_all(one, q, k, v, extras, grouped=False, copies=False):
    """vmap over G with k and v not mapped (never copied per query head; G = 1 is not
    vmapped: _over_groups), then over Hkv, then B; size-1 axes of the extras are not mapped.
    ``grouped``: ``one`` takes a kv head's G query heads at once (the registry's
    Implementation.grouped), the extras keeping their G|1 axis first. ``copies``: see
    _over_groups."""
    if not grouped:
        one = _over_groups(one, extras, q.shape[2], copies)
    for axis in (1, 0):  # Hkv, B
        one = _mapped(one, extras, axis, kv=True)
    return one(q, k, v, *_squeezed(extras, 2 if grouped else 3))


def _over_groups(one, extras, groups, copies=False):
    """``one`` vmapped over the G query heads of a kv head (k and v not mapped), or for G = 1
    called on the single head: a vmap over a size-1 axis leaves it in the scores, which
    XLA:CPU then copies into a new layout between the two products (3 programs' steps where the
    naive einsum has 1: docs/performance.md). ``copies``: k and v broadcast to the G heads and
    mapped, for the implementations whose backward is a custom VJP ("blockwise", and explicit's
    forward with blockwise's backward): with k and v not mapped, their gradients came out wrong
    whenever the forward and the backward were compiled as one program with a constant
    cotangent (jax.jit of jax.grad of out.sum(); JAX 0.10.2 on a CPU: errors of order 1 and
    garbage up to 1e30, different at each compilation, at L = 64 and more with G = 2 or 4;
    right with a drawn cotangent, and when each pass was its own program): tests/
    test_jax_execution.py's regression test. Cause not found; the copies are what G separate
    heads would cost."""
    if groups > 1 and copies:
        mapped = _mapped(one, extras, 2, kv=True)

        def heads(q, k, v, *rest):
            return mapped(q, *(jnp.broadcast_to(x, (groups,) + x.shape) for x in (k, v)), *rest)
        return heads
    if groups > 1:
        return _mapped(one, extras, 2, kv=False)

    def single(q, k, v, *rest):  # every extra has G = 1, so none is mapped over it
        out, weights = one(q[0], k, v, *rest)
        return out[None], None if weights is None else weights[None]
    return single


def _vmap_chunks(one, q, k, v, extras, chunk, copies=False):
    """The B·Hkv (batch, kv head) pairs, each with its G query heads (vmapped, k and v not
    mapped), ``max(1, chunk // G)`` pairs at a time: vmapped within, sequential across; a group
    of more than ``chunk`` query heads is itself taken ``chunk`` heads at a time, so a step's
    scores stay as small as without groups. The extras are indexed per pair, never copied."""
    b, hkv, g = q.shape[:3]
    per_group = _over_groups(one, extras, g, copies)

    def group_in_steps(qn, kn, vn, picked):
        """A group larger than a chunk: its query heads ``chunk`` at a time, k and v shared."""
        def head(args):
            qh, h = args
            return one(qh, kn, vn, *[None if x is None else x[h if x.shape[0] > 1 else 0]
                                     for x in picked])
        return jax.lax.map(head, (qn, jnp.arange(g)), batch_size=chunk)

    def pair(args):  # pair n = i·Hkv + j: batch i, kv head j
        qn, kn, vn, n = args
        i, j = n // hkv, n % hkv
        picked = [None if x is None else x[i if x.shape[0] > 1 else 0, j if x.shape[1] > 1 else 0]
                  for x in extras]  # (G|1, ...)
        if g > chunk:
            return group_in_steps(qn, kn, vn, picked)
        return per_group(qn, kn, vn, *_squeezed(picked, 1))

    flat = tuple(x.reshape((b * hkv,) + x.shape[2:]) for x in (q, k, v))  # (B·Hkv, [G,] L, D)
    out, weights = jax.lax.map(pair, flat + (jnp.arange(b * hkv),), batch_size=max(1, chunk // g))
    unflat = lambda x: None if x is None else x.reshape((b, hkv) + x.shape[1:])  # noqa: E731
    return unflat(out), unflat(weights)


def _mapped(fn, extras, axis, kv):
    """fn vmapped over one axis (0 of q; of k and v when ``kv``; of the extras whose ``axis`` is
    not of size 1, these extras having their size-1 leading axes squeezed)."""
    kv_axis = 0 if kv else None
    axes = tuple(None if x is None or x.shape[axis] == 1 else 0 for x in extras)
    return jax.vmap(fn, in_axes=(0, kv_axis, kv_axis) + axes)


def _squeezed(extras, lead):
    """The extras without their size-1 axes among the first ``lead`` (those not mapped)."""
    return [None if x is None else x.reshape(
        tuple(n for i, n in enumerate(x.shape) if i >= lead or n > 1)) for x in extras]

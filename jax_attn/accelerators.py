"""The JAX core's accelerator implementations: kernels that take the whole call, each behind
the registry (jax_attn.functional.IMPLEMENTATIONS) with the reasons it refuses a call.

- "cudnn": cuDNN's fused flash attention, ``jax.nn.dot_product_attention(...,
  implementation="cudnn")``, on NVIDIA GPUs, float16 and bfloat16 only.
- "pallas": the Pallas flash-attention kernel ``jax.experimental.pallas.ops.gpu.attention.mha``
  (Triton), compiled on an NVIDIA GPU, run in Pallas's interpret mode elsewhere (a CPU: slow,
  for validating the mapping, never chosen automatically).

Both compute the core's function of the arguments they take: our arrays are (B, H, L, D)
(unbatched (H, L, D) or (L, D)), theirs (B, L, H, D); a row with no allowed key gives zeros
here as in the core (cuDNN's and jax.nn's large-negative fill would average the values), set
after the kernel from a closed form of the allowed keys (no (Lq, Lk) array beyond the mask's).
What each refuses is read from the installed JAX's source (0.10): jax.nn's cuDNN path
(jax/_src/nn/functions.py, jax/_src/cudnn/fused_attention_stablehlo.py: check_layout,
check_is_flash_attention) and the Pallas kernel's ``mha``.

Shape legend: B batch, H query heads, Hkv key-value heads, G = H / Hkv, Lq query length,
Lk key length, D = Dk = Dv head width (both kernels need Dk = Dv).
"""

from __future__ import annotations

from functools import partial, reduce

import jax
import jax.numpy as jnp

from golden.specification.positions import allowed_terms

HALF = ("float16", "bfloat16")
# The Pallas kernel's default query and key blocks (BlockSizes.get_default()): a length must be
# at most this or a multiple of it.
PALLAS_BLOCK = 128


def _common_refusal(asked, name) -> str | None:
    """What neither kernel takes: the arguments only the portable implementations have."""
    taken_elsewhere = [
        (asked.return_weights, "return_weights=True (it never forms the weights)"),
        (asked.softcap, "softcap"), (asked.sinks, "sinks"), (asked.dropout, "dropout"),
        (asked.offset, "query_offset"), (asked.chunk, "attention_chunk_size"),
        (asked.distance_bias, "distance_bias"),
        (asked.distance_keys, "distance_query and distance_keys"),
        (asked.key_indices, "key_indices (a selection: 'sparse' reads it)"),
        (asked.block_sizes is not None, "block_sizes (for 'blockwise')"),
        (asked.sharded, "arrays on a mesh with explicit axes")]
    given = [what for flag, what in taken_elsewhere if flag]
    if given:
        return f"{name} takes no {', '.join(given)}: 'explicit' or 'blockwise' does"
    if asked.widths and asked.widths[0] != asked.widths[1]:
        return (f"{name} needs value width = key width, got Dk={asked.widths[0]}, "
                f"Dv={asked.widths[1]}")
    return None


def cudnn_refuses(asked) -> str | None:
    """Why cuDNN's fused attention (through jax.nn) cannot run this call, or None."""
    reason = _common_refusal(asked, "cuDNN")
    if reason:
        return reason
    if asked.platform != "gpu":
        return f"cuDNN runs on an NVIDIA GPU, and this call runs on {asked.platform or '?'}"
    if asked.dtype not in HALF:
        return f"cuDNN's flash attention takes float16 or bfloat16, got {asked.dtype or '?'}"
    width, widest = (asked.widths[0] if asked.widths else None), cuda_head_max()
    if widest is None:
        return "cuDNN needs a CUDA GPU, and this GPU reports no compute capability"
    if width is not None and (width % 8 or width > widest):
        return (f"cuDNN needs a head width that is a multiple of 8 and at most {widest} (256 "
                f"from compute capability 9.0 on, else 128), got {width}")
    if asked.window != (None, None) and not (asked.causal or asked.window[1] == 0):
        return (f"cuDNN's sliding window has no right side (jax maps only (left, 0) or a "
                f"causal window), got local_window_size {asked.window} without is_causal")
    if (asked.bias or asked.mask) and asked.lengths and any(n % 2 for n in asked.lengths):
        return (f"cuDNN's backward with a bias (a mask becomes one) needs even lengths, and JAX "
                f"cannot tell at the call whether it will be differentiated: got Lq, Lk = "
                f"{asked.lengths}")
    if asked.causal and asked.lengths and asked.lengths[0] != asked.lengths[1]:
        return (f"is_causal with Lq ≠ Lk: cuDNN's causal alignment (top-left, as ours, or "
                f"bottom-right) is not yet verified on a GPU, got Lq, Lk = {asked.lengths}")
    return None


def cuda_head_max() -> int | None:
    """The widest head cuDNN's flash attention takes on this machine's first GPU (jax's
    check_is_flash_attention: 256 from compute capability 9.0, Hopper, on, else 128); None
    when no GPU reports a compute capability (no CUDA GPU). Asked only on a GPU call."""
    try:
        capability = jax.devices("gpu")[0].compute_capability
        major = int(str(capability).split(".")[0])
    except (RuntimeError, IndexError, AttributeError, ValueError):
        return None
    return 256 if major >= 9 else 128


def pallas_refuses(asked) -> str | None:
    """Why the Pallas flash kernel cannot run this call, or None (on a CPU it runs in Pallas's
    interpret mode)."""
    reason = _common_refusal(asked, "the Pallas flash kernel")
    if reason:
        return reason
    given = [what for flag, what in [
        (asked.mask, "mask"), (asked.bias, "bias"), (asked.window != (None, None),
                                                     "local_window_size"),
        (asked.seq_lengths, "query_seq_lengths or key_value_seq_lengths")] if flag]
    if given:
        return f"the Pallas flash kernel takes no {', '.join(given)}: only is_causal and scale"
    if asked.platform == "tpu":
        return "the TPU kernel (pallas.ops.tpu.flash_attention) is not wired in yet"
    if asked.dtype == "float64":
        return ("the Pallas flash kernel accumulates in float32 (its loop carries float32 even "
                "in interpret mode): float64 needs 'explicit' or 'blockwise'")
    if asked.platform == "gpu" and asked.dtype not in HALF:
        return (f"on a GPU the Pallas kernel's dots run float32 at TF32, not precision HIGHEST: "
                f"it takes float16 or bfloat16 there, got {asked.dtype or '?'}")
    if asked.lengths:
        bad = [n for n in asked.lengths if n > PALLAS_BLOCK and n % PALLAS_BLOCK]
        if bad:
            return (f"the Pallas flash kernel needs each length ≤ {PALLAS_BLOCK} or a multiple "
                    f"of {PALLAS_BLOCK}, got Lq, Lk = {asked.lengths}")
        if asked.causal and asked.lengths[0] > asked.lengths[1]:
            return (f"the Pallas kernel's causal loop runs past the keys when Lq > Lk, got "
                    f"Lq, Lk = {asked.lengths}")
    return None


# ---- the calls ----------------------------------------------------------------------------------

def _lift(x):
    """(…, L, D) -> (B|1, H|1, L, D)."""
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _full(x, lq, lk):
    """A mask or bias broadcast to (…, H|1, Lq, Lk) lifted to 4-D with its last two axes full
    (cuDNN's bias must be (B|1, H|1, Lq, Lk))."""
    x = _lift(x)
    return jnp.broadcast_to(x, x.shape[:2] + (lq, lk))


def _lengths(x, batch):
    """Our per-batch lengths (int32 (B,) or ()) as jax.nn's int32 (B,), or None."""
    return None if x is None else jnp.broadcast_to(x.astype(jnp.int32), (batch,))


def rows_allowed(lq, lk, mask, q_lengths, kv_lengths, *, is_causal, window, chunk=None):
    """(B|1, H|1, Lq) bool: whether query row i (at position i) has any allowed key; None
    when every row has one. Without a mask in closed form (row i's keys are lo … hi, lo ≤ hi
    and lo < its batch's key length, i < its query length; chunks of C keep lo … hi inside
    i's chunk): nothing of size Lq·Lk. With a mask (B|1, H|1, Lq, Lk), the mask AND the same
    terms as the core (golden.specification.positions)."""
    left, right = window
    if mask is not None:
        row, key = jnp.arange(lq)[:, None], jnp.arange(lk)[None, :]  # (Lq, 1), (1, Lk)
        per_batch = [None if x is None else x[:, None, None, None]
                     for x in (q_lengths, kv_lengths)]  # (B, 1, 1, 1)
        terms = [mask] + allowed_terms(row, key, row, is_causal=is_causal, window=window,
                                       chunk=chunk, q_lengths=per_batch[0],
                                       kv_lengths=per_batch[1])
        return reduce(jnp.logical_and, terms).any(axis=-1)
    if q_lengths is None and kv_lengths is None and left is None and chunk is None:
        return None  # lo = 0 ≤ hi for every row
    row = jnp.arange(lq)  # (Lq,)
    lo = jnp.zeros_like(row) if left is None else jnp.maximum(row - left, 0)
    hi = jnp.full_like(row, lk - 1)
    if right is not None:
        hi = jnp.minimum(hi, row + right)
    if is_causal:
        hi = jnp.minimum(hi, row)
    if chunk is not None:
        start = row // chunk * chunk  # (Lq,): the first position of row i's chunk
        lo, hi = jnp.maximum(lo, start), jnp.minimum(hi, start + chunk - 1)
    ok = (lo <= hi)[None, None, :]  # (1, 1, Lq)
    if kv_lengths is not None:
        ok = ok & (lo[None, :] < kv_lengths[:, None])[:, None, :]  # (B, 1, Lq)
    if q_lengths is not None:
        ok = ok & (row[None, :] < q_lengths[:, None])[:, None, :]  # (B, 1, Lq)
    return ok


def _zero_empty_rows(out, lq, lk, mask, q_lengths, kv_lengths, *, is_causal, window,
                     chunk=None):
    """out (B, H, Lq, D) with zeros in every row that has no allowed key (as the core)."""
    ok = rows_allowed(lq, lk, mask, q_lengths, kv_lengths, is_causal=is_causal, window=window,
                      chunk=chunk)
    return out if ok is None else jnp.where(ok[..., None], out, jnp.zeros((), out.dtype))


def jax_nn_call(query, key, value, mask=None, bias=None, q_lengths=None, kv_lengths=None, *,
                scale, is_causal, window, implementation="cudnn"):
    """The core's call as ``jax.nn.dot_product_attention(..., implementation=implementation)``:
    (B, H, L, D) moved to its (B, L, H, D) and back; GQA key and value as they are (Hkv heads,
    its grouping is ours: query head h reads kv head h // G); mask and bias with their last
    two axes full (Lq, Lk), the bias in the query's dtype (cuDNN adds it there); the window
    ``(left, right)``: a right side of 0 or a causal call becomes causal with (left, 0) (cuDNN's
    one window), an unbounded left side max(Lq, Lk); lengths as int32 (B,). Rows with no
    allowed key are zeroed afterwards. ``implementation=None`` runs jax.nn's XLA path: the
    same mapping, checkable on a CPU (tests/test_accelerators.py)."""
    q, k, v = (_lift(x) for x in (query, key, value))  # (B, H, Lq, D), (B, Hkv, Lk, D)
    lq, lk, batch = q.shape[2], k.shape[2], q.shape[0]
    left, right = window
    causal = bool(is_causal) or right == 0
    if causal and left is not None:
        local = (left, 0)
    elif left is not None or (right is not None and right < max(lq, lk)):
        local = (max(lq, lk) if left is None else left, max(lq, lk) if right is None else right)
    else:
        local = None
    mask4 = None if mask is None else _full(mask, lq, lk)  # (B|1, H|1, Lq, Lk)
    bias4 = None if bias is None else _full(bias, lq, lk).astype(q.dtype)
    ql, kl = _lengths(q_lengths, batch), _lengths(kv_lengths, batch)
    out = jax.nn.dot_product_attention(
        *(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), bias=bias4, mask=mask4, scale=scale,
        is_causal=causal, query_seq_lengths=ql, key_value_seq_lengths=kl,
        local_window_size=local, implementation=implementation)  # (B, Lq, H, D)
    out = _zero_empty_rows(jnp.swapaxes(out, 1, 2), lq, lk, mask4, ql, kl, is_causal=causal,
                           window=(left, 0) if causal and left is not None else window)
    return out.reshape(query.shape[:-1] + value.shape[-1:])


@partial(jax.jit, static_argnames=("scale", "is_causal", "window", "softcap", "chunk_size"))
def cudnn(query, key, value, mask=None, bias=None, q_lengths=None, kv_lengths=None, sinks=None,
          *, scale, is_causal, window, softcap=None, chunk_size=None):
    """The "cudnn" implementation: ``jax_nn_call`` with implementation="cudnn" (sinks,
    softcap and chunk_size are refused before: cudnn_refuses)."""
    del sinks, softcap, chunk_size
    return jax_nn_call(query, key, value, mask, bias, q_lengths, kv_lengths, scale=scale,
                       is_causal=is_causal, window=window, implementation="cudnn")


@partial(jax.jit, static_argnames=("scale", "is_causal", "window", "softcap", "chunk_size"))
def pallas(query, key, value, mask=None, bias=None, q_lengths=None, kv_lengths=None, sinks=None,
           *, scale, is_causal, window, softcap=None, chunk_size=None):
    """The "pallas" implementation: ``mha`` on (B, L, H, D), GQA key and value repeated to H
    heads (the kernel reads head h of each; G copies of key and value), interpret mode off a
    GPU. mask, bias, window and lengths are refused before (pallas_refuses)."""
    from jax.experimental.pallas.ops.gpu import attention

    del mask, bias, q_lengths, kv_lengths, window, sinks, softcap, chunk_size
    q, k, v = (_lift(x) for x in (query, key, value))  # (B, H, Lq, D), (B, Hkv, Lk, D)
    groups = q.shape[1] // k.shape[1]  # G
    k, v = (jnp.repeat(x, groups, axis=1) if groups > 1 else x for x in (k, v))  # (B, H, Lk, D)
    out = attention.mha(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), None, sm_scale=scale,
                        causal=bool(is_causal), interpret=jax.default_backend() != "gpu")
    return jnp.swapaxes(out, 1, 2).reshape(query.shape[:-1] + value.shape[-1:])

"""What a fixture stores of a reference run: each value rounded once to float64, and the
gradients that are zero by structure (zero_grads, zero_elements) stored as exact zeros.

Shape legend: Hkv key-value heads, Dh head width; b_key's gradient is (Hkv·Dh,).
"""

from __future__ import annotations

import numpy as np

from golden.specification import exact
from golden.specification.validate import rope_settings, rotary_dims


# Gradients that are zero in exact arithmetic, whatever the inputs, because softmax is unchanged
# by a constant added to a row of scores:
# - the key projection's bias adds q_i · b_key to every score of query row i. Not with rotary
#   embeddings (the bias is rotated by each key's position, so the shift is no longer constant
#   along the row), nor with soft-capping (tanh bends a constant shift differently per key),
#   nor with a QK norm (the bias is normalised with the rest of k);
# - a score bias that is broadcast along the key axis (its last axis of size 1, or 0-d).
# Neither with sinks: a sink's logit is not shifted with its row, so the shift moves weight
# between the keys and the sink.
# Computed, they are rounding residue; fixtures store exact zeros and list the names (meta
# "zero"), which are checked against an absolute bound instead of a relative one.
ZERO_GRADS = {"b_key"}


def zero_grads(config, grads) -> list:
    """The names among ``grads`` that are zero by structure for this configuration, sorted."""
    names = set()
    rope = config.get("rope_theta") is not None or "rope_theta" in (
        config.get("rope_parameters") or {})
    if "sinks" in grads:
        return []
    if not rope and not config.get("softcap") and not config.get("qk_norm"):
        names |= set(grads) & ZERO_GRADS
    bias = grads.get("bias")
    if bias is not None and (np.ndim(bias) == 0 or np.shape(bias)[-1] == 1):
        names.add("bias")
    return sorted(names)


def zero_elements(config):
    """Boolean (Hkv·Dh,) or None: the elements of b_key's gradient that are zero by structure
    although the whole is not (zero_grads). With partial rotary (GroupedQueryAttention) the key
    bias's features that are not turned add a constant to each row of scores, as the whole
    b_key does without RoPE: their gradient is zero, stored as zeros, not residue (no soft-cap,
    which bends a constant shift, no QK norm, no sinks: see zero_grads)."""
    shifts = not (config.get("softcap") or config.get("qk_norm") or config.get("sinks"))
    settings = None if "num_kv_heads" not in config or not shifts else rope_settings(
        config.get("rope_theta"), config.get("rope_parameters"),
        config.get("partial_rotary_factor", 1.0))
    if settings is None:
        return None
    dh = config.get("head_dim") or config["d_in"] // config["num_heads"]
    passed = np.tile(np.arange(dh) >= rotary_dims(dh, settings), config["num_kv_heads"])
    return passed if passed.any() else None


def stored(config, output, weights, grads):
    """What a fixture stores of a forward and backward: (output, weights, grads, zero) as
    float64, each value rounded once (golden.specification.exact.to_float64, exact for float64
    input), the gradients named in ``zero`` (zero_grads) exact zeros; weights None (a recurrent
    mixer's) stays None."""
    grads = {n: exact.to_float64(g) for n, g in grads.items()}
    zero = zero_grads(config, grads)
    for n in zero:
        grads[n] = np.zeros_like(grads[n])
    passed = zero_elements(config)
    if passed is not None and "b_key" in grads:
        grads["b_key"] = np.where(passed, 0.0, grads["b_key"])
    weights = None if weights is None else exact.to_float64(weights)  # a mixer has none
    return exact.to_float64(output), weights, grads, zero

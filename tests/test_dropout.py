"""Drawn dropout, in the core and in every module with dropout, in both frameworks: the keep-mask
is seen through the returned weights.

Without a mask every softmax weight is > 0 (the inputs are of small scale, so no score is large
enough for a weight to underflow), so a returned weight is 0 exactly where dropout dropped it;
under causal masking only the positions a query may see are observed. Checked, with binomial
bounds of SIGMAS standard deviations: the keep rate is 1 − p; kept weights are the un-dropped
ones times 1/(1 − p) and the output applies exactly the returned weights; the masks of
neighbouring batch elements, heads, query rows and keys agree at the rate of independent draws,
p² + (1 − p)², not 1 (a mask shared by the batch or the heads agrees everywhere); the same
generator state or key draws the same mask, another seed another one, and torch's core draws from
``dropout_rng``, never from the global generator.

Shape legend: B batch, H (N) heads, Lq query length, Lk key length, Dk key width, Dv value width.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from golden import reference
from golden.specification.tolerances import compare
from tests.helpers import DROPOUT_MODULES, by_name, fresh_rng, main_input

P = 0.3  # the dropout rate: not 1/2, so that a mask keeping with probability p is caught too
SIGMAS = 5  # a binomial check fails by chance with probability < 1e-6
AGREE = P**2 + (1 - P) ** 2  # two independent keep decisions agree (0.58)
B, H, LQ, LK, DK, DV = 2, 3, 24, 48, 4, 5  # 1152 positions per (batch, head) slice
L = 48  # module sequence length: 1176 positions a causal row may see per slice


def _assert_rate(hits, n, expected, what, seed):
    """hits ∈ [0, 1] is a fraction of n independent trials of probability ``expected``."""
    bound = SIGMAS * math.sqrt(expected * (1 - expected) / n)
    assert abs(hits - expected) <= bound, (f"{what}: {hits:.4f} of {n}, expected {expected:.4f} "
                                           f"± {bound:.4f}, seed {seed}")


def _assert_drawn(weights, plain, out, expected_out, dtype, seed):
    """Train-mode ``weights`` against the un-dropped ``plain`` weights of the same call (both
    (..., Lq, Lk)): keep rate, 1/(1 − p) scaling, the output applying exactly the returned
    weights, and independence along every axis."""
    live = plain != 0  # the positions a query may see
    kept = weights != 0
    assert not (kept & ~live).any(), f"a weight appeared where none may be, seed {seed}"
    _assert_rate(kept[live].mean(), live.sum(), 1 - P, "keep rate", seed)
    assert compare(weights[kept], plain[kept] / (1 - P), dtype).ok, \
        f"kept weights are not the un-dropped ones times 1/(1 − p), seed {seed}"
    assert compare(out, expected_out(kept), dtype).ok, \
        f"the output does not apply the returned weights, seed {seed}"
    axes = ("batch", "head")[:kept.ndim - 2] + ("query", "key")
    for axis, name in enumerate(axes):
        n = kept.shape[axis]
        a, b = (np.take(kept, range(i, n - 1 + i), axis) for i in (0, 1))
        both = np.take(live, range(n - 1), axis) & np.take(live, range(1, n), axis)
        _assert_rate((a == b)[both].mean(), both.sum(), AGREE,
                     f"neighbouring {name} slices agree", seed)


def _small_normal(rng, shape, dtype="float32"):
    """Inputs of scale 0.3: moderate scores, every softmax weight far from underflow."""
    return (0.3 * rng.standard_normal(shape)).astype(dtype)


# ---- the core ---------------------------------------------------------------------------------

def _core_inputs(rng):
    return [_small_normal(rng, s) for s in [(B, H, LQ, DK), (B, H, LK, DK), (B, H, LK, DV)]]


def test_core_drawn_dropout_rate_scale_and_independence(twin):
    rng, seed = fresh_rng()
    q, k, v = _core_inputs(rng)
    args = [twin.array(a) for a in (q, k, v)]
    _, plain = twin.sdpa(*args, return_weights=True)
    out, weights = twin.sdpa(*args, dropout_rate=P, dropout_rng=twin.dropout_rng(seed),
                             return_weights=True)
    plain = twin.numpy(plain)
    assert (plain > 0).all(), f"a weight underflowed: the keep-mask is not observable, seed {seed}"

    def expected_out(kept):
        return reference.scaled_dot_product_attention(q, k, v, dropout_rate=P,
                                                      dropout_mask=kept)[0]

    _assert_drawn(twin.numpy(weights), plain, twin.numpy(out), expected_out, "float32", seed)


def test_core_mask_comes_from_dropout_rng_only(twin):
    # torch: the same generator state draws the same mask whatever the global generator holds,
    # and another seed another mask under the same global state. JAX: a key draws its mask.
    rng, seed = fresh_rng()
    args = [twin.array(a) for a in _core_inputs(rng)]

    def kept(rng_seed, global_seed):
        torch.manual_seed(global_seed)  # the global torch generator, which must not matter
        _, weights = twin.sdpa(*args, dropout_rate=P, dropout_rng=twin.dropout_rng(rng_seed),
                               return_weights=True)
        return twin.numpy(weights) != 0

    first = kept(seed, 1)
    assert np.array_equal(first, kept(seed, 2)), \
        f"the same dropout_rng drew another mask after the global seed changed, seed {seed}"
    assert np.array_equal(first, kept(seed, 1)), f"seed {seed}"
    assert not np.array_equal(first, kept(seed + 1, 1)), \
        f"another dropout_rng drew the same mask, seed {seed}"


# ---- the modules ------------------------------------------------------------------------------

def _config(variant):
    """The sample configuration with dropout P and, where the variant has the choice, no causal
    masking (more positions to observe)."""
    config = {**variant.sample, "dropout": P}
    return {**config, "causal": False} if "causal" in config else config


def _x(variant, rng):
    return {main_input(variant): _small_normal(rng, (B, L, variant.sample["d_in"]))}


@pytest.mark.parametrize("variant", by_name(DROPOUT_MODULES))
def test_module_drawn_dropout_rate_scale_and_independence(twin, variant):
    # Modules draw their own keep-mask in training mode (torch: the global generator, seeded by
    # twin.make; JAX: the module's dropout stream): (B, N, Lq, Lk) per head, or (B, Lq, Lk).
    rng, seed = fresh_rng()
    config, x = _config(variant), _x(variant, rng)
    module = twin.make(variant.name, config, seed)
    module.eval()
    _, plain = twin.run(module, x)
    module.train()
    out, weights = twin.run(module, x)
    visible = np.tri(L, dtype=bool)  # every module sees at least its causal positions
    assert (plain[..., visible] > 0).all(), f"a weight underflowed, seed {seed}"
    params = twin.export(module)

    def expected_out(kept):
        return reference.VARIANTS[variant.name][0](config, {**x, "dropout_mask": kept}, params)[0]

    _assert_drawn(weights, plain, out, expected_out, "float32", seed)


@pytest.mark.parametrize("variant", by_name(DROPOUT_MODULES))
def test_module_mask_reproducible_from_seed(twin, variant):
    # twin.make(seed) seeds torch's global generator before constructing, and gives the JAX
    # module nnx.Rngs(seed): two modules made from one seed draw the same first mask, another
    # seed another one, and a module's successive calls draw fresh masks.
    rng, seed = fresh_rng()
    config, x = _config(variant), _x(variant, rng)

    def masks(module_seed, calls=1):
        module = twin.make(variant.name, config, module_seed)
        module.train()
        return [twin.run(module, x)[1] != 0 for _ in range(calls)]

    first, second = masks(seed, calls=2)
    assert np.array_equal(first, masks(seed)[0]), f"the same seed drew another mask, seed {seed}"
    assert not np.array_equal(first, masks(seed + 1)[0]), \
        f"another seed drew the same mask, seed {seed}"
    assert not np.array_equal(first, second), f"two calls drew the same mask, seed {seed}"

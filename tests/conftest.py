"""Shared test helpers. Nothing here enables JAX float64 globally: float64 runs use
``jax.enable_x64(True)`` as a context, so float32 tests see the default configuration."""

from __future__ import annotations

import numpy as np
import pytest

import golden

FRAMEWORKS = ("torch", "jax")
DTYPES = ("float32", "float64")


def fresh_rng():
    """A generator seeded from fresh entropy; the seed goes into failure messages."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return np.random.default_rng(seed), seed


def sdpa(framework):
    if framework == "torch":
        from torch_attn import scaled_dot_product_attention
    else:
        from jax_attn import scaled_dot_product_attention
    return scaled_dot_product_attention


def to_framework(framework, array, dtype=None):
    """A NumPy array as a tensor of the framework (float arrays cast to ``dtype``)."""
    array = np.asarray(array)
    if dtype is not None and array.dtype.kind == "f":
        array = array.astype(dtype)
    if framework == "torch":
        import torch

        return torch.from_numpy(np.ascontiguousarray(array))
    import jax.numpy as jnp

    return jnp.asarray(array)


@pytest.fixture(params=golden.names())
def fixture_name(request):
    return request.param

"""Data crossing into or out of a module is copied, never aliased: an export is a snapshot of the
weights (training afterwards does not change it, writing into it does not change the module), a
load takes a copy of the caller's arrays, and so do the KV cache's export and load.

Every module variant with parameters, in both frameworks (the ``twin`` fixture).
"""

from __future__ import annotations

import numpy as np
import pytest

from golden.specification import variants
from tests.helpers import by_name, has_params

WITH_PARAMS = [v for v in variants.MODULES if has_params(v)]


def _params(variant, rng):
    shapes = variant.param_shapes(variant.sample)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def _torch_step(module):
    import torch

    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)  # in place, as an optimizer step is


def _jax_step(module):
    from flax import nnx

    for _, v in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        v.set_value(v.get_value() + 1.0)


def _step(twin, module):
    (_torch_step if twin.name == "torch" else _jax_step)(module)


@pytest.mark.parametrize("variant", by_name(WITH_PARAMS))
def test_an_export_is_a_snapshot_and_writing_into_it_changes_nothing(twin, variant):
    rng = np.random.default_rng(0)
    module = twin.lib.build(variant.name, variant.sample, _params(variant, rng))
    exported = twin.lib.export_params(module)
    before = {n: a.copy() for n, a in exported.items()}
    _step(twin, module)  # the module trains: the snapshot stays
    trained = twin.lib.export_params(module)
    for name, a in exported.items():
        np.testing.assert_array_equal(a, before[name], err_msg=name)
        assert a.flags.writeable and not np.shares_memory(a, trained[name]), name
    for a in exported.values():
        a[...] = 7.0  # writing into the export: the module is untouched
    for name, a in twin.lib.export_params(module).items():
        np.testing.assert_array_equal(a, trained[name], err_msg=name)


@pytest.mark.parametrize("variant", by_name(WITH_PARAMS))
def test_a_load_copies_the_callers_arrays(twin, variant):
    params = _params(variant, np.random.default_rng(1))
    kept = {n: a.copy() for n, a in params.items()}
    module = twin.lib.build(variant.name, variant.sample, params)
    for a in params.values():
        a[...] = -3.0  # the caller reuses their buffers
    for name, a in twin.lib.export_params(module).items():
        np.testing.assert_array_equal(a, kept[name], err_msg=name)
    loaded = {n: a.copy() for n, a in kept.items()}
    twin.lib.load_params(module, loaded)
    for a in loaded.values():
        a *= 2.0
    for name, a in twin.lib.export_params(module).items():
        np.testing.assert_array_equal(a, kept[name], err_msg=name)


def _held(cache) -> list:
    """A cache's arrays: its fields less those it does not hold (a LatentCache's index_key
    without a learned indexer is None)."""
    return [a for a in cache if a is not None]


@pytest.mark.parametrize("name", ["grouped_query_attention", "multi_head_latent_attention"])
def test_a_cache_export_and_load_copy(twin, name):  # a KVCache, and MLA's LatentCache
    variant = variants.get(name)
    params = _params(variant, np.random.default_rng(2))
    module = twin.lib.build(variant.name, variant.sample, params)
    x = twin.arrays({"x": np.random.default_rng(3).standard_normal((2, 3, 5))}, "float32")["x"]
    _, cache = module(x, cache=module.init_cache(2, 8))
    exported = twin.lib.export_cache(cache)
    snapshot = [np.array(a) for a in _held(exported)]
    for a in _held(exported):
        a[...] = 0  # writing into the export leaves the live cache alone
    again = twin.lib.export_cache(cache)
    for a, b in zip(_held(again), snapshot, strict=True):
        np.testing.assert_array_equal(a, b)
    arrays = [np.array(a) for a in snapshot]
    loaded = twin.lib.load_cache(type(cache)(*arrays))
    for a in arrays:
        a[...] = 9  # the caller reuses the arrays they loaded from
    for a, b in zip(_held(twin.lib.export_cache(loaded)), snapshot, strict=True):
        np.testing.assert_array_equal(a, b)

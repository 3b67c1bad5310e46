"""splash.sharded on a 2 × 2 × 2 mesh ("data" × "model" × "seq") of 8 virtual CPU devices: the
batch, the heads and the query rows split (make_splash_mha's head_shards and q_seq_shards, under
shard_map, in Pallas's interpret mode), against the core's "explicit" on one device: output and
every gradient to golden.specification.tolerances' float32 table, the output split as the query;
and the core's "splash" refusing arrays on a mesh with explicit axes.

Shape legend: B batch, H query heads, Hkv key-value heads, Lq/Lk query/key length, D head width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_attn
from golden.specification.tolerances import compare
from jax_attn import splash
from tests.helpers import fresh_rng, matrix

B, H, HKV, LQ, LK, D = 2, 4, 2, 256, 128, 8
KEYWORDS = {"is_causal": True, "softcap": 2.0,
            "sinks": np.array([0.5, -1.0, 2.0, 0.0], np.float32)}


@functools.cache
def _mesh(kind):
    axis_types = (AxisType.Explicit if kind == "explicit" else AxisType.Auto,) * 3
    return jax.make_mesh((2, 2, 2), ("data", "model", "seq"), axis_types=axis_types)


# Compiled on 8 devices (interpret mode): the whole matrix, as the rest of tests/devices8 but one
# ring and one sharded module (tests/devices8/test_ring.py, test_mesh.py).
@matrix
@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_sharded_splash_equals_the_core_on_one_device(kind):
    rng, seed = fresh_rng()
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((B, H, LQ, D), (B, HKV, LK, D), (B, HKV, LK, D)))
    cot = jnp.asarray(rng.standard_normal((B, H, LQ, D)), jnp.float32)
    lengths = {"query_seq_lengths": jnp.array([256, 90]),
               "key_value_seq_lengths": jnp.array([100, 128])}
    mesh = _mesh(kind)

    def loss(run):
        def value(q, k, v):
            out = run(q, k, v, **KEYWORDS, **lengths)
            return (out * cot).sum(), out
        return jax.value_and_grad(value, argnums=(0, 1, 2), has_aux=True)

    on_mesh = functools.partial(splash.sharded, mesh=mesh, batch_axis="data",
                                head_axis="model", seq_axis="seq")
    with jax.set_mesh(mesh):
        (_, out), grads = loss(on_mesh)(q, k, v)
    (_, want), want_grads = loss(functools.partial(
        jax_attn.scaled_dot_product_attention, implementation="explicit"))(q, k, v)
    assert out.sharding.spec[:3] == P("data", "model", "seq")[:3]
    assert compare(out, want, "float32").ok, seed
    for name, g, w in zip("qkv", grads, want_grads):
        assert compare(g, w, "float32", "grad").ok, (name, seed)


def test_the_core_refuses_splash_on_a_mesh_with_explicit_axes():
    mesh = _mesh("explicit")
    q = jax.device_put(jnp.ones((B, H, LQ, D)), NamedSharding(mesh, P("data", "model")))
    with jax.set_mesh(mesh), pytest.raises(
            ValueError, match="splash takes no arrays on a mesh with explicit axes"):
        jax_attn.scaled_dot_product_attention(q, q, q, implementation="splash")


@pytest.mark.parametrize("shapes, axes, message", [
    (((B, 3, LQ, D), (B, 3, LK, D)), ("data", "model", None),
     "H should be a multiple of the size of mesh axis 'model', 2, got 3"),
    (((B, H, LQ, D), (B, 1, LK, D)), ("data", "model", None),
     "Hkv should be a multiple of the size of mesh axis 'model', 2, got 1"),
    (((B, H, 128, D), (B, HKV, LK, D)), (None, None, "seq"),
     "Lq / (size of mesh axis 'seq') should be a multiple of 128"),
    (((H, LQ, D), (HKV, LK, D)), (None, None, None), "query should have rank 4"),
])
def test_sharded_bad_input_names_the_argument(shapes, axes, message):
    q, k = (jnp.ones(s) for s in shapes)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        splash.sharded(q, k, k, mesh=_mesh("auto"), batch_axis=axes[0], head_axis=axes[1],
                       seq_axis=axes[2])

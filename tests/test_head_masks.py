"""Masks with a head axis: the multi-head modules take (B, 1, Lq, Lk) (Hugging Face's 4-D
boolean masks, True = may attend) as the (B, Lq, Lk) mask it broadcasts, and (B, N, Lq, Lk)
as one mask per head, equal to the float64 reference given the same; a head axis of another
size is refused by name.

Shape legend: B batch, N heads, L length, Lc context length, D model width.
"""

from __future__ import annotations

import numpy as np
import pytest

from golden import reference
from golden.specification import variants
from tests.helpers import TWINS, fresh_rng

EXACT = 1e-12
B, L, D = 2, 7, 5
MODULES = {
    "grouped_query_attention": dict(d_in=D, num_heads=4, num_kv_heads=2, head_dim=4, d_out=3,
                                    rope_theta=100.0),
    "multi_head_latent_attention": dict(d_in=D, num_heads=3, kv_lora_rank=7,
                                        qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=3),
}
HEADS = {"grouped_query_attention": 4, "multi_head_latent_attention": 3}


def _params(rng, name):
    v = variants.get(name)
    return {n: rng.standard_normal(s) * 0.5 for n, s in v.shapes(v.config(MODULES[name])).items()}


@pytest.mark.parametrize("name", sorted(MODULES))
@pytest.mark.parametrize("framework", sorted(TWINS))
def test_a_head_axis_of_one_is_the_plain_mask(framework, name):
    twin, (rng, seed) = TWINS[framework], fresh_rng()
    params = _params(rng, name)
    x = rng.standard_normal((B, L, D))
    mask = rng.random((B, L, L)) < 0.7
    with twin.float64():
        module = twin.build(name, MODULES[name], params)
        plain = twin.numpy(module(twin.array(x), twin.array(mask)))
        hf = twin.numpy(module(twin.array(x), twin.array(mask[:, None])))
    np.testing.assert_array_equal(hf, plain, err_msg=f"seed {seed}")


@pytest.mark.parametrize("framework", sorted(TWINS))
def test_a_mask_per_head_equals_the_reference(framework):
    name = "grouped_query_attention"
    twin, (rng, seed) = TWINS[framework], fresh_rng()
    params = _params(rng, name)
    x = rng.standard_normal((B, L, D))
    mask = rng.random((B, 4, L, L)) < 0.6
    expected, weights, _ = reference.VARIANTS[name][0](MODULES[name], {"x": x, "mask": mask},
                                                        params)
    with twin.float64():
        module = twin.build(name, MODULES[name], params)
        out, w = module(twin.array(x), twin.array(mask), return_weights=True)
    assert np.abs(twin.numpy(out) - expected).max() <= EXACT, f"seed {seed}"
    assert np.abs(twin.numpy(w) - weights).max() <= EXACT, f"seed {seed}"
    # each head's weights are zero where its own mask blocks (causal on top)
    blocked = ~mask | ~np.tril(np.ones((L, L), bool))
    assert np.all(twin.numpy(w)[blocked] == 0), f"seed {seed}"


@pytest.mark.parametrize("framework", sorted(TWINS))
def test_a_head_axis_of_another_size_is_refused(framework):
    module = TWINS[framework].make("grouped_query_attention",
                                   MODULES["grouped_query_attention"])
    x = np.zeros((B, L, D), np.float32)
    with pytest.raises(ValueError, match=r"mask shape should broadcast to \(B, N, Lq, Lk\) = "
                                         r"\(2, 4, 7, 7\), got \(2, 3, 7, 7\)"):
        module(TWINS[framework].array(x), TWINS[framework].array(np.ones((B, 3, L, L), bool)))

"""The modules' learned selections through the core's sparse implementation (issue 44): a
latent layer's token indexer and a grouped-query layer's block indexers hand their choice to
the core as ``key_indices`` when it keeps k ≤ Lk / SPARSE_UP_TO keys a row (and no weights
are asked), which ``implementation=None`` then runs "sparse" (reading only the chosen keys);
above that, or with ``return_weights``, as the boolean mask it stands for. Both ways equal the
float64 reference; the core records which ran.
"""

from __future__ import annotations

import numpy as np
import pytest

from golden import reference
from golden.harness.regenerate import draw_params
from golden.specification import variants
from golden.specification.implementations import record
from golden.specification.tolerances import compare
from tests.helpers import fresh_rng

MLA = "multi_head_latent_attention"
GQA = "grouped_query_attention"
CASES = {  # (variant, configuration, keys kept a row k): k·8 ≤ L = 40 for every one
    "token": (MLA, dict(d_in=6, num_heads=3, kv_lora_rank=4, qk_nope_head_dim=2,
                        qk_rope_head_dim=4, v_head_dim=5, q_lora_rank=7, rope_theta=100.0,
                        index_topk=4, index_heads=4, index_head_dim=6), 4),
    "max": (GQA, dict(d_in=6, num_heads=4, num_kv_heads=2, head_dim=6, rope_theta=100.0,
                      index_blocks="max", index_heads=2, index_head_dim=6, index_block_size=2,
                      index_topk_blocks=2, index_local_blocks=1), 4),
    "mean": (GQA, dict(d_in=6, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=100.0,
                       partial_rotary_factor=0.25, index_blocks="mean", index_heads=3,
                       index_head_dim=4, index_block_size=2, index_topk_blocks=2), 5),
    # HY-V4's layer: sinks and a gate beside the selection; a window and a soft cap beside it
    "token-sinks": (MLA, dict(d_in=6, num_heads=3, kv_lora_rank=4, qk_nope_head_dim=2,
                              qk_rope_head_dim=4, v_head_dim=5, q_lora_rank=7, rope_theta=100.0,
                              rope_interleaved=False, sinks=True, output_gate="sigmoid",
                              index_topk=4, index_heads=4, index_head_dim=6,
                              index_rope_dims="last", index_scale="weights"), 4),
    "max-window": (GQA, dict(d_in=6, num_heads=4, num_kv_heads=2, head_dim=6, rope_theta=100.0,
                             sliding_window=9, softcap=3.0, index_blocks="max", index_heads=2,
                             index_head_dim=6, index_block_size=2, index_topk_blocks=2,
                             index_local_blocks=1), 4),
}
L = 40


def _run(twin, variant, config, params, x, **call):
    """The twin's float64 output (and what its core ran) on x."""
    with twin.float64(), record() as ran:
        module = twin.build(variant, config, params)
        out = module(twin.array(x), **call)
    out = out[0] if isinstance(out, tuple) else out
    return twin.numpy(out), {name for framework, name in ran}


@pytest.mark.parametrize("kind", list(CASES))
def test_a_selection_of_few_keys_runs_sparse_and_equals_the_reference(twin, kind):
    variant, config, k = CASES[kind]
    assert k * 8 <= L
    rng, seed = fresh_rng()
    config = variants.get(variant).config(config)
    params = {n: a.astype(np.float64) for n, a in draw_params(variant, config, rng).items()}
    x = rng.standard_normal((2, L, config["d_in"]))
    want = reference.pair(variant)[0](config, {"x": x}, params)[0]
    out, ran = _run(twin, variant, config, params, x)
    assert ran == {"sparse"}, ran
    assert compare(out, want, "float64").ok, seed
    dense, ran = _run(twin, variant, config, params, x, return_weights=True)  # the mask's way
    assert "sparse" not in ran, ran
    assert compare(dense, want, "float64").ok, seed
    short, ran = _run(twin, variant, config, params, x[:, :k * 8 - 1])  # k above Lk / 8
    assert "sparse" not in ran, ran

"""T5's relative position buckets in GroupedQueryAttention (``relative_attention_num_buckets``,
``relative_attention_max_distance``; a learned ``relative_attention_bias`` (num_buckets, N);
bidirectional unless causal; T5 has no 1/√Dh: ``scale=1.0``) against transformers' own
T5Attention, float64: the buckets against ``T5Attention._relative_position_bucket`` for every
distance in ±3000 (equal: the same float32 operations in the same order), and our torch and JAX
modules against T5Attention itself (eager, whose softmax is float64 in 5.23), output, weights
and, in torch, the gradient with respect to the table.

Shape legend: B batch, L length, D model width, N heads, Dh head width (T5's d_kv).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from golden.specification.decoder import relative_position_bucket
from tests.helpers import TWINS, fresh_rng

transformers = pytest.importorskip("transformers")

from transformers.models.t5 import modeling_t5  # noqa: E402

B, L, D, N, DH = 2, 11, 7, 3, 4
GQA = "grouped_query_attention"
EXACT = 1e-12
# (causal, num_buckets, max_distance): distances up to 10 reach the log buckets and the cap
SETTINGS = [(True, 6, 8), (False, 10, 9), (False, 32, 128), (True, 9, 5)]


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance",
                         [(32, 128), (16, 20), (8, 9), (6, 50), (40, 1000), (4, 3), (10, 100)])
def test_buckets_are_hugging_faces(bidirectional, num_buckets, max_distance):
    d = np.arange(-3000, 3001)
    theirs = modeling_t5.T5Attention._relative_position_bucket(
        torch.from_numpy(d), bidirectional=bidirectional, num_buckets=num_buckets,
        max_distance=max_distance).numpy()
    np.testing.assert_array_equal(
        relative_position_bucket(d, bidirectional, num_buckets, max_distance), theirs)


def test_buckets_by_hand():
    # Causal, 8 buckets, max_distance 16: 4 exact (0 … 3), then 4 + ⌊ln(d/4)/ln 4 · 4⌋ to 7;
    # keys after the query in bucket 0.
    d = np.array([3, 1, 0, -1, -3, -4, -5, -7, -8, -15, -16, -100])
    np.testing.assert_array_equal(relative_position_bucket(d, False, 8, 16),
                                  [0, 0, 0, 1, 3, 4, 4, 5, 6, 7, 7, 7])
    # Bidirectional, 8 buckets: 4 a side, 2 exact, keys after the query offset by 4.
    np.testing.assert_array_equal(relative_position_bucket(np.array([-2, -1, 0, 1, 2]),
                                                           True, 8, 16), [2, 1, 0, 5, 6])


def _t5(rng, causal, num_buckets, max_distance):
    config = modeling_t5.T5Config(d_model=D, d_kv=DH, num_heads=N, is_decoder=causal,
                                  relative_attention_num_buckets=num_buckets,
                                  relative_attention_max_distance=max_distance, dropout_rate=0.0,
                                  attn_implementation="eager")
    hf = modeling_t5.T5Attention(config, has_relative_attention_bias=True,
                                 layer_idx=0).double().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)) * 0.5))
    params = {"W_query": hf.q.weight, "W_key": hf.k.weight, "W_value": hf.v.weight,
              "W_out": hf.o.weight}
    params = {n: w.detach().numpy().T.copy() for n, w in params.items()}
    params["relative_attention_bias"] = hf.relative_attention_bias.weight.detach().numpy().copy()
    ours = dict(d_in=D, num_heads=N, num_kv_heads=N, head_dim=DH, d_out=D, causal=causal,
                scale=1.0, relative_attention_num_buckets=num_buckets,
                relative_attention_max_distance=max_distance)
    return hf, ours, params


def _hf_mask(causal):
    """T5's decoder gets its causal mask from the model (additive, (B, 1, L, L)); the encoder
    none."""
    if not causal:
        return None
    allowed = torch.ones(L, L, dtype=torch.bool).tril()
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(allowed, zero, torch.finfo(torch.float64).min).expand(B, 1, L, L)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("framework", list(TWINS))
def test_module_matches_t5_attention(framework, setting):
    twin, (rng, seed) = TWINS[framework], fresh_rng()
    hf, config, params = _t5(rng, *setting)
    x = rng.standard_normal((B, L, D))
    dy = rng.standard_normal((B, L, D))
    xt = torch.from_numpy(x)
    y, _, w = hf(xt, mask=_hf_mask(setting[0]))
    (y * torch.from_numpy(dy)).sum().backward()
    with twin.float64():
        module = twin.build(GQA, config, params)
        module.eval()
        out, weights = module(twin.array(x), return_weights=True)
    y, w = y.detach().numpy(), w.detach().numpy()
    assert np.abs(twin.numpy(out) - y).max() <= EXACT * np.abs(y).max(), f"seed {seed}"
    assert np.abs(twin.numpy(weights) - w).max() <= EXACT, f"seed {seed}"
    if framework == "torch":  # the table's gradient: HF's embedding against ours
        (out * torch.from_numpy(dy)).sum().backward()
        ours = module.relative_attention_bias.grad.numpy()
        theirs = hf.relative_attention_bias.weight.grad.numpy()
        assert np.abs(ours - theirs).max() <= EXACT * np.abs(theirs).max(), f"seed {seed}"


@pytest.mark.parametrize("change, message", [
    (dict(relative_attention_num_buckets=0),
     r"relative_attention_num_buckets should be a positive int, got 0"),
    (dict(relative_attention_num_buckets=3, causal=False),
     r"relative_attention_num_buckets should be at least 4 \(bidirectional\), got 3"),
    (dict(relative_attention_num_buckets=8, relative_attention_max_distance=2),
     r"relative_attention_max_distance should exceed the 4 exact buckets, got 2"),
    (dict(relative_attention_max_distance=64),
     r"relative_attention_max_distance should be 128 \(its default\) unless "
     r"relative_attention_num_buckets is set, got 64"),
    (dict(relative_attention_num_buckets=8, alibi="bloom"),
     r"alibi should be None with relative_attention_num_buckets \(one position bias\), "
     r"got 'bloom'"),
    (dict(relative_attention_num_buckets=8, relative_attention_buckets="clip"),
     r"relative_attention_buckets should be one of 't5', 'clipped', 'clipped_symmetric', got "
     r"'clip'"),
    (dict(relative_attention_buckets="clipped"),
     r"relative_attention_buckets should be 't5' \(its default\) unless "
     r"relative_attention_num_buckets is set, got 'clipped'"),
    (dict(relative_attention_num_buckets=8, relative_attention_max_distance=3,
          relative_attention_buckets="clipped"),
     r"relative_attention_num_buckets should be 6 with relative_attention_buckets='clipped' "
     r"\(relative_attention_max_distance 3: one bucket per clipped distance\), got 8"),
    (dict(relative_attention_num_buckets=6, relative_attention_max_distance=3,
          relative_attention_buckets="clipped_symmetric"),
     r"relative_attention_num_buckets should be 3 with relative_attention_buckets="
     r"'clipped_symmetric'"),
])
@pytest.mark.parametrize("framework", list(TWINS))
def test_bad_bucket_settings(framework, change, message):
    with pytest.raises(ValueError, match=message):
        TWINS[framework].make(GQA, dict(d_in=5, num_heads=6, num_kv_heads=2, head_dim=4,
                                        **change))

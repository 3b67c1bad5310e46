"""Phi-4-multimodal's audio encoder (golden.hf.speech, model_type ``phi4_multimodal_audio``):
its attention layers converted by ``golden.convert.from_hf`` (our ``relative_attention_buckets``
"clipped": a learned bias per key − query distance clipped to [−M, M − 1]), against
transformers' own float64 model: each layer's input captured from the encoder's forward on two
rows of features, one padded; both twins; the input gradient; the layer without its position
bias far from HF's; a round trip to_hf(from_hf(...)) exact; the bucket rules against HF's
Phi4MultimodalAudioRelativeAttentionBias index by index (attn-parity hf on its checkpoints:
tests/test_hf_speech_command.py).

HF's encoder hands each layer ``hs_mask + bias`` with ``hs_mask`` boolean (tested below): an
allowed key gets +1 and a padded one +0, not −∞. On the unpadded row that is a constant per row,
which softmax removes; on the padded row HF's model attends the padding, so that row is compared
with HF's layer given the mask it means (−∞ where blocked) beside the same bias.

Level: EXACT (1e-12 relative to the largest output): no step of HF's layer is float32 at
float64 but its eager softmax's upcast, a no-op there (the sdpa path is float64 throughout).

Shape legend: B batch, T feature frames, F features, L encoder frames (T / time_reduction),
D width, N heads, M bias_max_distance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import golden.convert
from golden.hf.speech import PHI4_TABLE
from golden.specification.decoder import relative_position_bucket
from tests.helpers import TWINS, fresh_rng

transformers = pytest.importorskip("transformers")
from tests.hf_harness import (EXACT, assert_gives_back, draw_parameters, rel,  # noqa: E402
                              state_dict)

B, T, F, D, N, M = 2, 20, 8, 12, 3, 3
LENGTHS = np.array([T, 13])  # feature frames per row: row 1 padded
SMALL = dict(hidden_size=D, intermediate_size=16, num_blocks=2, num_attention_heads=N,
             ext_pw_out_channel=D, depthwise_separable_out_channel=D, nemo_conv_channels=4,
             input_size=F, time_reduction=2, kernel_size=3, bias_max_distance=M,
             dropout_rate=0.0)
# The model_type tested here (docs/hf.md's table reads it): its config and model classes and
# tiny settings.
FAMILIES = {"phi4_multimodal_audio": ("Phi4MultimodalAudioConfig", "Phi4MultimodalAudioModel",
                                      SMALL)}


def _model(rng, **change):
    """The tiny encoder, float64, every parameter drawn N(0, 0.5²)."""
    config_class, model_class, kw = FAMILIES["phi4_multimodal_audio"]
    config = getattr(transformers, config_class)(**dict(kw, **change))
    model = getattr(transformers, model_class)(config).double().eval()
    draw_parameters(model, rng)
    return config, model


def _layers(model, rng):
    """Each layer's attention input x (B, L, D), the scores' addend HF's encoder passes it
    (B, N, L, L) and its output, from one forward on two rows of features, row 1 padded."""
    seen = {}

    def hooks(i, attention):
        def before(module, args):
            seen[i] = {"x": args[0].detach().numpy().copy(), "added": args[1].detach().clone()}

        def after(module, args, output):
            seen[i]["y"] = output.detach().numpy().copy()
        return (attention.register_forward_pre_hook(before),
                attention.register_forward_hook(after))
    handles = [h for i, layer in enumerate(model.encoders) for h in hooks(i, layer.self_attn)]
    features = torch.from_numpy(rng.standard_normal((B, T, F)))
    frames = torch.from_numpy(np.arange(T)[None, :] < LENGTHS[:, None])
    try:
        with torch.no_grad():
            model(features, frames)
    finally:
        for h in handles:
            h.remove()
    return seen


def _sd(model, i):
    """Layer i's attention state dict with the encoder's table put in (from_hf's input)."""
    sd = state_dict(model.encoders[i].self_attn)
    sd[PHI4_TABLE] = model.relative_attention_bias_layer.bias_values.weight.detach().numpy().copy()
    return sd


def _ours(twin, config, sd, x, mask=None, **change):
    variant, ours, params = golden.convert.from_hf(config.to_dict(), sd)
    ours = dict(ours, **change)
    if ours.get("relative_attention_num_buckets") is None:
        params = {n: a for n, a in params.items() if n != "relative_attention_bias"}
    with twin.float64():
        module = twin.build(variant, ours, params)
        return twin.numpy(module(twin.array(x), None if mask is None else twin.array(mask)))


def _frames(model, length):
    """(B, L) bool: the encoder frames of each row that are not padding (HF's subsampled
    lengths: ⌈frames / time_reduction⌉)."""
    kept = -(-LENGTHS // model.config.time_reduction)
    return np.arange(length)[None, :] < kept[:, None]


def test_hfs_encoder_adds_its_boolean_mask_to_the_scores():
    """What the module docstring says of HF's encoder: each layer is handed the table's bias
    plus hs_mask as 0 / 1, so a padded key gets +0, not −∞."""
    rng, seed = fresh_rng()
    config, model = _model(rng)
    s = _layers(model, rng)[0]
    with torch.no_grad():
        table = model.relative_attention_bias_layer(torch.from_numpy(s["x"])).numpy()
    real = _frames(model, s["x"].shape[1])
    expected = table + real[:, None, None, :].astype(np.float64)
    np.testing.assert_array_equal(s["added"].numpy(), expected)


@pytest.mark.parametrize("twin", sorted(TWINS))
def test_encoder_layers_equal_hfs(twin):
    """Row 0 (no padding): ours against HF's model as it ran. Row 1 (padded): ours under the
    frames mask against HF's layer given the bias and −∞ at the padded keys."""
    rng, seed = fresh_rng()
    config, model = _model(rng)
    t = TWINS[twin]
    for i, s in _layers(model, rng).items():
        length = s["x"].shape[1]
        assert length > 2 * M  # distances past M on both sides: the clipping bites
        real = _frames(model, length)
        assert real[0].all() and not real[1].all()
        mask = np.broadcast_to(real[:, None, :], (B, length, length)).copy()
        out = _ours(t, config, _sd(model, i), s["x"], mask)
        assert rel(out[0], s["y"][0]) < EXACT, (i, seed)
        blocked = torch.from_numpy(np.where(mask, 0.0, -np.inf)[:, None])
        with torch.no_grad():
            x = torch.from_numpy(s["x"])
            theirs = model.encoders[i].self_attn(x, model.relative_attention_bias_layer(x) +
                                                 blocked)
        y1 = theirs.numpy()[1][real[1]]
        assert rel(out[1][real[1]], y1) < EXACT, (i, seed)
        if twin == "torch":  # without its position bias the layer is far from HF's
            far = _ours(t, config, _sd(model, i), s["x"], mask,
                        relative_attention_num_buckets=None, relative_attention_max_distance=128,
                        relative_attention_buckets="t5")
            assert rel(far[0], s["y"][0]) > 1e6 * EXACT, (i, seed)


def test_encoder_input_gradient_equals_hfs():
    """dL/dx of Σ out ⊙ dO on the unpadded row, HF's layer called as its model called it,
    against the torch twin's (the JAX twin's gradients: tests/test_fixtures.py's)."""
    rng, seed = fresh_rng()
    config, model = _model(rng)
    s = _layers(model, rng)[1]
    x = torch.from_numpy(s["x"][:1].copy()).requires_grad_()
    d_out = rng.standard_normal(s["y"][:1].shape)
    (model.encoders[1].self_attn(x, s["added"][:1]) * torch.from_numpy(d_out)).sum().backward()
    variant, ours, params = golden.convert.from_hf(config.to_dict(), _sd(model, 1))
    twin = TWINS["torch"]
    with twin.float64():
        module = twin.build(variant, ours, params)
        ours_x = torch.from_numpy(s["x"][:1].copy()).requires_grad_()
        (module(ours_x) * torch.from_numpy(d_out)).sum().backward()
    assert rel(ours_x.grad.numpy(), x.grad.numpy()) < EXACT, seed


@pytest.mark.parametrize("symmetric", [False, True])
def test_buckets_are_hfs_index_by_index(symmetric):
    """relative_position_bucket's clipped rules against the index HF's
    Phi4MultimodalAudioRelativeAttentionBias reads its table at, for every distance of L = M
    (the symmetric table has M rows: HF's clip reaches −M only past that, and then HF fails)
    and, asymmetric, of L = 4M."""
    from transformers.models.phi4_multimodal import modeling_phi4_multimodal as hf
    config = transformers.Phi4MultimodalAudioConfig(**dict(SMALL, bias_symmetric=symmetric))
    layer = hf.Phi4MultimodalAudioRelativeAttentionBias(config).double()
    rows = layer.bias_values.weight.shape[0]
    with torch.no_grad():  # row r of the table holds r in every head: the bias is the index
        layer.bias_values.weight.copy_(torch.arange(rows, dtype=torch.float64)[:, None])
    for length in (M,) if symmetric else (M, 4 * M):
        index = layer(torch.zeros(1, length, D))[0, 0].detach().numpy().astype(np.int64)
        distance = np.arange(length)[None, :] - np.arange(length)[:, None]
        rule = "clipped_symmetric" if symmetric else "clipped"
        np.testing.assert_array_equal(relative_position_bucket(distance, True, rows, M, rule),
                                      index)
    if symmetric:  # one more frame: distance −M, row M of M rows
        with pytest.raises(IndexError):
            layer(torch.zeros(1, M + 1, D))


@pytest.mark.parametrize("symmetric", [False, True])
def test_round_trip_gives_back_the_arrays(symmetric):
    rng = np.random.default_rng(0)
    config, model = _model(rng, bias_symmetric=symmetric)
    sd = _sd(model, 0)
    variant, ours, params = golden.convert.from_hf(config.to_dict(), sd)
    assert ours["relative_attention_buckets"] == ("clipped_symmetric" if symmetric else
                                                  "clipped")
    assert ours["relative_attention_num_buckets"] == (M if symmetric else 2 * M)
    assert ours["causal"] is False and ours["qkv_bias"] and ours["out_bias"]
    back = golden.convert.to_hf(variant, ours, params)
    assert_gives_back(sd, back)


def test_a_layer_without_the_encoders_table_is_refused_with_why():
    config, model = _model(np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"model_type 'phi4_multimodal_audio': the state dict "
                                         r"has no 'relative_attention_bias_layer\.bias_values\."
                                         r"weight': the encoder holds one table"):
        golden.convert.from_hf(config.to_dict(), state_dict(model.encoders[0].self_attn))

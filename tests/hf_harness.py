"""The harness of tests/test_hf_import*.py: a tiny Hugging Face model of a family (float64,
random weights), its attention layers' inputs and outputs captured from the model's own
forward, and their state dicts as NumPy.

Shape legend: B batch, L tokens, D model width, N heads, Nkv key-value heads, Dh head width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import transformers

B, L, D, N, NKV, DH = 2, 9, 16, 4, 2, 6
EXACT = 1e-12        # float64 against float64
FLOAT32_LEVEL = 1e-6  # relative: a float32 step inside HF (its RoPE angles, norms)


@dataclass(frozen=True)
class Family:
    """A tiny configuration of one family (``config`` the class, ``kw`` beyond the sizes),
    the layers to check (one of each kind), and HF's float32 steps besides RoPE's angles
    (None: none, so rope_precision="hf" agrees to EXACT)."""

    config: str
    kw: dict = field(default_factory=dict)
    layers: tuple = (0,)
    float32: str | None = None
    attention: str = "sdpa"  # eager's softmax is float32 in most families
    attention_of: Callable | None = None  # (model, layer) -> the attention module; default
    # model.layers[layer].self_attn


BASE = dict(hidden_size=D, num_attention_heads=N, num_key_value_heads=NKV, head_dim=DH,
            intermediate_size=32, vocab_size=64, max_position_embeddings=64)


def build_model(family, rng):
    """The tiny base model, float64, sdpa attention (or the family's), every parameter drawn
    N(0, 0.5²) (norm weights, biases and sinks included)."""
    config = getattr(transformers, family.config)(**{**BASE, **family.kw})
    config._attn_implementation = family.attention
    config._experts_implementation = "eager"  # the grouped kernels take no float64
    model = transformers.AutoModel.from_config(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)) * 0.5))
    return config, model


def attention_of(family, model, i):
    """Layer i's attention module (the family's attention_of, else model.layers[i].self_attn)."""
    if family.attention_of is not None:
        return family.attention_of(model, i)
    return model.layers[i].self_attn


def captured(family, model, layers, ids, **kw):
    """Each layer's attention input (B, L, D) and output, from one forward of the model on
    token ids ``ids`` (``kw`` to the model: attention_mask, position_ids, ...)."""
    seen = {}

    def hook(i):
        def record(module, args, kwargs, output):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            seen[i] = (x.detach().numpy().copy(), output[0].detach().numpy().copy())
        return record

    handles = [attention_of(family, model, i).register_forward_hook(hook(i), with_kwargs=True)
               for i in layers]
    try:
        with torch.no_grad():
            model(input_ids=torch.from_numpy(ids), **kw)
    finally:
        for h in handles:
            h.remove()
    return seen


def state_dict(module):
    return {n: t.detach().numpy().copy() for n, t in module.state_dict().items()}


def rel(actual, expected):
    return float(np.abs(actual - expected).max() / np.abs(expected).max())



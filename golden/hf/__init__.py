"""Hugging Face attention checkpoints <-> our variants: ``from_hf`` and ``to_hf``, NumPy only.

``from_hf(config, state_dict, *, layer_idx=0, kind=None) -> (variant, config, params)``:
``config`` is a transformers config's ``to_dict()`` (or an object with ``to_dict()``; for
composite models the text or decoder sub-config's), ``state_dict`` the attention module's own
state dict (keys as its ``state_dict()`` names them, arrays of NumPy, torch or JAX),
``layer_idx`` the layer the weights come from (sliding or full, RoPE or NoPE, local or global
θ), ``kind`` which attention of an encoder-decoder's layer ("encoder", "decoder", "cross":
Whisper, BART, T5; None elsewhere; see golden.hf.encoders). The result goes straight into
``torch_attn.build(*result)`` and ``jax_attn.build(*result)``. ``to_hf(variant, config,
params)`` gives back the same arrays under the family's names (a round trip is exact); the
config ``from_hf`` returns remembers its ``model_type`` and ``kind`` (``HFConfig``), or pass
``model_type=``.

``kv_source(config, layer_idx)``: for Gemma 4's cross-layer KV sharing (num_kv_shared_layers),
the index of the layer whose cache a reusing layer (``kv_shared=True``) is called with; None
for a layer that computes its own keys and values.

A family, or a setting of one, that we do not express is a ValueError naming the
``model_type`` and the setting, never a module that computes something else. The families and
what each maps: ``FAMILIES`` (docs/hf.md has the table, checked against the tests).

The rooms of the importer, each importing only those above it (NumPy only):
    family     what a family is (``Family``, ``Kinds``, ``HFConfig``; ``Stack``, where a
               checkpoint keeps its attention modules) and the helpers its entries share:
               reading an HF config and a state dict
    text_towers  the multimodal (MRoPE) text towers' settings, for decoders' entries
    gemma      Gemma 4's and Gemma 3n's text attention (per-layer widths, K = V, the value
               norm, cross-layer KV sharing: ``kv_source``), for decoders' entries
    decoders   decoders of the Llama shape (q_proj, k_proj, v_proj, o_proj): a table of
               ``_llama_like`` entries
    fused      one projection for q, k and v (Phi-3, GPT-NeoX, Falcon, BLOOM, MPT, GPT-2): a
               table of ``_fused_family`` entries
    encoders   encoders, encoder-decoders (``Kinds``) and vision towers (BERT, ViT, CLIP,
               SigLIP, DINOv2, Whisper, BART, T5), the RoPE text encoders (ModernBERT, GTE,
               ...); their ``COMPOSITES``, CLIP's and SigLIP's towers
    latent     multi-head latent attention (DeepSeek-V3)
    vision     vision towers with axial 2-D RoPE (Qwen-VL and kin, Pixtral, Llama 4, Gemma 4);
               its ``COMPOSITES``, the vision-language models' towers
    hybrids    the softmax attention layers of hybrid (Mamba, RG-LRU) models: Falcon-H1,
               Jamba, Bamba, Granite 4, Nemotron-H, Zamba, Zamba 2, RecurrentGemma
    speech     speech encoders with Transformer-XL's relative positions (Parakeet's
               FastConformer: Parakeet, Canary, Cohere ASR, Nemotron ASR streaming), Shaw's
               (Granite Speech) and the USM Conformer's (Gemma 3n, Gemma 4); Whisper-like and
               rotary audio towers, Moonshine, Dia, Kyutai STT; its ``COMPOSITES``, the
               speech-language models' towers
    cross      cross-attention with a QK norm or a soft cap: Mllama's text model, T5Gemma
               (``Kinds``); T5Gemma 2 and Mllama's vision tower refused
    blocks     grouped-query attention with a learned block indexer (MiniMax M3, Qwen4-Exp),
               on decoders' helpers
    linear     the linear-attention layers of hybrid models (gated delta rule: Qwen3-Next,
               Qwen3.5, OLMo hybrid) as recurrent mixers (golden.specification.recurrent);
               ``LINEAR``: model_type -> the Family of its "linear_attention" layers
    convert    ``FAMILIES`` (the kinds' tables), ``LINEAR``, ``COMPOSITES``, ``REFUSED``, the
               lookup, ``from_hf``, ``to_hf``,
               ``expected_state``
A new family is one entry in its kind's table (and a room of its own for a new kind, its
table added to ``convert.FAMILIES``): how it converts, and what the checkpoint verifier needs,
which reads it from the entry (``Family``'s ``stacks``, ``hf_float64``, ``model_class``,
``own_index``, ``position_axes``, ``unverified``; a ``Kinds``' own).

The checkpoint verifier (``attn-parity hf DIR``), which imports the twins and transformers, is
a room of its own above the harness: ``golden.verifier``; its ``layout`` derives its tables
from ``FAMILIES`` and ``COMPOSITES``.
"""

from __future__ import annotations

from golden.hf.convert import (COMPOSITES, FAMILIES, LINEAR, REFUSED, expected_state, from_hf,
                               to_hf)
from golden.hf.gemma import kv_source
from golden.hf.encoders import MHCA, T5_TABLE
from golden.hf.family import GQA, Family, HFConfig, Kinds, Stack, _layer_type
from golden.hf.latent import MLA

__all__ = ["COMPOSITES", "FAMILIES", "GQA", "LINEAR", "MHCA", "MLA", "REFUSED", "T5_TABLE", "Family", "HFConfig",
           "Kinds", "Stack", "expected_state", "from_hf", "kv_source", "to_hf"]

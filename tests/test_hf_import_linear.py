"""The linear-attention layers of hybrid models (issue 43, golden.hf.linear): each family's
Gated DeltaNet module, in a tiny float64 model of Hugging Face's own, against our float64
reference converted by ``golden.convert.from_hf`` (the module's own state dict as HF names it),
on the layer's captured input from the model's forward, with left padding; ``to_hf`` giving the
state dict back; each family's distinctive setting undone moving the output far; both twins
built from the same conversion, decoding through their caches; gradients; a cache moving between
the frameworks.

HF computes the delta rule and the gated norm in float32 even in a float64 model
(``torch_chunk_gated_delta_rule`` casts to float32): its float32 error grows with the length,
so the bound is DELTA_FLOAT32(L), KDA_FLOAT32(L) for Kimi Delta Attention (measured, in
golden.specification.tolerances)."""

from __future__ import annotations

import numpy as np
import pytest

import golden.convert
from golden.reference.delta_rule import MIXERS as REFERENCE
from golden.specification.tolerances import HF_GRADIENT_FACTOR, delta_float32, kda_float32

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from tests.hf_harness import (B, BASE, Family, assert_gives_back, attention_of,  # noqa: E402
                              build_model, captured, rel, state_dict)
from tests.helpers import fresh_rng, matrix  # noqa: E402


# HF's float32 floors (their measurements and reasons beside them in tolerances.py)
DELTA_FLOAT32, KDA_FLOAT32 = delta_float32, kda_float32


def floor(mt, length):
    """HF's float32 floor for the family ``mt`` at ``length`` tokens."""
    return (KDA_FLOAT32 if mt in KDA_FAMILIES else DELTA_FLOAT32)(length)


LINEAR_KW = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=4,
                 linear_value_head_dim=6, linear_conv_kernel_dim=3)


KDA_KW = dict(linear_num_heads=2, linear_head_dim=4, linear_conv_kernel_dim=3,
              num_key_value_heads=4, num_hidden_layers=2, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, layer_types=["linear_attention", "full_attention"])


def _linear_attn(model, i):
    return model.layers[i].linear_attn


FAMILIES = {
    "qwen3_next": Family("Qwen3NextConfig", dict(
        LINEAR_KW, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8, head_dim=8,
        shared_expert_intermediate_size=8), layers=(0,), attention_of=_linear_attn),
    "qwen3_5_text": Family("Qwen3_5TextConfig", dict(
        LINEAR_KW, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
        layers=(0,), attention_of=_linear_attn),
    "qwen3_5_moe_text": Family("Qwen3_5MoeTextConfig", dict(
        LINEAR_KW, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
        shared_expert_intermediate_size=8), layers=(0,), attention_of=_linear_attn),
    # Qwen4-Exp: Qwen3.5's linear layer (its softmax layer is indexed: tests/test_hf_import.py)
    "qwen4_exp_text": Family("Qwen4ExpTextConfig", dict(
        LINEAR_KW, num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"],
        num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8, head_dim=8,
        shared_expert_intermediate_size=8, indexer_n_heads=2, indexer_kv_heads=1,
        indexer_head_dim=8, indexer_budget=4, indexer_compress_ratio=2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2), layers=(0,), attention_of=_linear_attn),
    "olmo_hybrid": Family("OlmoHybridConfig", dict(
        LINEAR_KW, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        linear_allow_neg_eigval=True, pad_token_id=0, eos_token_id=1, bos_token_id=2),
        layers=(0,), attention_of=_linear_attn),
    # Kimi Delta Attention: the linear layer sits at layers.N.self_attn
    "kimi_linear": Family("KimiLinearConfig", dict(
        KDA_KW, num_experts=2, num_experts_per_token=1, moe_intermediate_size=8,
        q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
        v_head_dim=4), layers=(0,)),
    "glm5_next_text": Family("Glm5NextTextConfig", dict(
        KDA_KW, n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
        q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=0, v_head_dim=4,
        index_n_heads=2, index_head_dim=8, index_topk=16, index_kpool=16,
        layer_types=["linear_attention", "indexed_attention"], linear_lower_bound=-3.0),
        layers=(0,)),
    "bailing_hybrid": Family("BailingHybridConfig", dict(
        KDA_KW, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8, q_lora_rank=8,
        kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
        kda_safe_gate=True, kda_lower_bound=-3.0), layers=(0,)),
    # lightning attention in blocks of 4 (HF's block form crossed at L = 9 too), its decays
    # those of layer 0 of 2
    "minimax": Family("MiniMaxConfig", dict(
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], block_size=4,
        num_local_experts=2, num_experts_per_tok=1), layers=(0,)),
}
KDA_FAMILIES = ("kimi_linear", "glm5_next_text", "bailing_hybrid")
VARIANT = {**{mt: "kimi_delta_attention" for mt in KDA_FAMILIES},
           "minimax": "lightning_attention"}
# each family's setting undone: the module converted with it changed moves the output far
UNDONE = {"olmo_hybrid": {"allow_neg_eigval": False}, "qwen3_next": {"norm_eps": 1.0},
          "qwen3_5_text": {"norm_eps": 1.0}, "qwen3_5_moe_text": {"norm_eps": 1.0},
          "qwen4_exp_text": {"norm_eps": 1.0},
          "kimi_linear": {"forget_gate": "bounded_sigmoid", "decay_lower_bound": -3.0},
          "glm5_next_text": {"forget_gate": "softplus", "decay_lower_bound": None},
          "bailing_hybrid": {"forget_gate": "softplus", "decay_lower_bound": None},
          "minimax": {"norm_eps": 1.0}}


def _run(family, length, rng):
    config, model = build_model(family, rng)
    ids = rng.integers(1, BASE["vocab_size"], (B, length))
    mask = np.ones((B, length), bool)
    mask[1, :3] = False  # left padding, as HF's attention_mask
    seen = captured(family, model, family.layers, ids,
                    attention_mask=torch.from_numpy(mask.astype(np.int64)))
    sd = state_dict(attention_of(family, model, family.layers[0]))
    return config, sd, seen[family.layers[0]], mask


@pytest.mark.parametrize("mt", FAMILIES)
@pytest.mark.parametrize("length", [9, 100])  # within one of HF's chunks of 64, and past it
def test_linear_layer_matches_hugging_faces_module(mt, length):
    rng, seed = fresh_rng()
    config, sd, (x, expected), mask = _run(FAMILIES[mt], length, rng)
    variant, ours, params = golden.convert.from_hf(config, sd, layer_idx=0)
    assert variant == VARIANT.get(mt, "gated_delta_net")
    y, _, _ = REFERENCE[variant][0](dict(ours), {"x": x, "mask": mask}, params)
    bound = floor(mt, length)
    error = rel(y, expected)
    assert error <= bound, (mt, length, error, seed)
    back = golden.convert.to_hf(variant, ours, params)
    if mt == "minimax":  # its decay tables written back in float64 from the slopes: HF's are
        for name in ("query_decay", "key_decay", "diagonal_decay"):  # formed in float32
            np.testing.assert_allclose(back.pop(name), sd.pop(name), rtol=1e-6, atol=1e-30)
    assert_gives_back(sd, back)
    far, _, _ = REFERENCE[variant][0]({**dict(ours), **UNDONE[mt]}, {"x": x, "mask": mask},
                                      params)
    assert rel(far, expected) > 1e3 * bound, (mt, seed)


def test_the_attention_layers_of_a_hybrid_still_convert_as_attention():
    rng, _ = fresh_rng()
    family = FAMILIES["qwen3_next"]
    config, model = build_model(family, rng)
    variant, _, _ = golden.convert.from_hf(config, state_dict(model.layers[1].self_attn),
                                           layer_idx=1)
    assert variant == "grouped_query_attention"


def _lib(twin):
    import jax_attn
    import torch_attn
    return torch_attn if twin.name == "torch" else jax_attn


@pytest.mark.parametrize("mt", FAMILIES)
def test_twins_match_hugging_faces_module_and_decode_as_its_forward(twin, mt):
    # Our twin built from from_hf's result, on the layer's captured input (left padding), equals
    # HF's module at its float32 floor past one of HF's chunks; prefill (chunked) of the first
    # 70 tokens then one token at a time (recurrent) through the RecurrentCache gives the same.
    from golden.specification import recurrent
    length = 100
    rng, seed = fresh_rng()
    config, sd, (x, expected), mask = _run(FAMILIES[mt], length, rng)
    variant, ours, params = golden.convert.from_hf(config, sd, layer_idx=0)
    if not hasattr(_lib(twin), recurrent.get(variant).class_name):
        pytest.skip(f"{twin.name} has no {recurrent.get(variant).class_name} yet")
    with twin.float64():
        module = twin.build(variant, ours, params)
        y = twin.numpy(module(twin.array(x), twin.array(mask)))
        assert rel(y, expected) <= floor(mt, length), (mt, rel(y, expected), seed)
        cache = module.init_cache(B, length)
        pieces = []
        for start, stop in [(0, 70), *((t, t + 1) for t in range(70, length))]:
            out, cache = module(twin.array(x[:, start:stop]), twin.array(mask[:, start:stop]),
                                cache=cache)
            pieces.append(twin.numpy(out))
    decoded = np.concatenate(pieces, axis=1)
    assert rel(decoded, expected) <= floor(mt, length), (mt, rel(decoded, expected), seed)


# one family of each mixer in the quick suite (per twin), every family in the whole matrix
QUICK_GRADIENTS = {("torch", "qwen3_next"), ("jax", "kimi_linear"), ("torch", "minimax")}


@pytest.mark.parametrize("framework, mt", [
    pytest.param(f, mt, marks=() if (f, mt) in QUICK_GRADIENTS else (matrix,))
    for f in ("torch", "jax") for mt in FAMILIES])
def test_input_gradient_through_the_twins_matches_hfs(framework, mt):
    # dL/dx of Σ y ⊙ dy through HF's module (its float32 recurrence) and through our twin at
    # float64, on 40 tokens with left padding: within 10 times the family's float32 floor (a
    # gradient runs the recurrence twice, forward and back).
    import jax
    import jax_attn
    import torch_attn
    rng, seed = fresh_rng()
    family = FAMILIES[mt]
    config, model = build_model(family, rng)
    hf = attention_of(family, model, 0)
    length = 40
    x = rng.standard_normal((B, length, BASE["hidden_size"]))
    mask = np.ones((B, length), bool)
    mask[1, :3] = False
    dy = rng.standard_normal((B, length, BASE["hidden_size"]))
    xt = torch.from_numpy(x).requires_grad_(True)
    extra = {"position_embeddings": None} if mt == "minimax" else {}  # lightning takes none
    out = hf(xt, attention_mask=torch.from_numpy(mask), **extra)
    out = out[0] if isinstance(out, tuple) else out
    (out * torch.from_numpy(dy)).sum().backward()
    variant, ours, params = golden.convert.from_hf(config, state_dict(hf), layer_idx=0)
    if framework == "torch":
        module = torch_attn.build(variant, dict(ours), params).double()
        xo = torch.from_numpy(x).requires_grad_(True)
        (module(xo, torch.from_numpy(mask)) * torch.from_numpy(dy)).sum().backward()
        grad = xo.grad.numpy()
    else:
        with jax.enable_x64(True):
            module = jax_attn.build(variant, dict(ours), params)
            grad = np.asarray(jax.grad(lambda a: (module(a, mask) * dy).sum())(
                jax.numpy.asarray(x)))
    error = rel(grad, xt.grad.numpy())
    assert error <= HF_GRADIENT_FACTOR * floor(mt, length), (mt, error, seed)


@pytest.mark.parametrize("first", ["torch", "jax"])
def test_a_cache_moves_between_frameworks(first):
    # GatedDeltaNet: a prefill of 70 tokens in one framework, its RecurrentCache exported and
    # loaded into the other, which decodes the next 5 tokens one at a time: equal to the full
    # forward at float64.
    import jax
    import jax_attn
    import torch_attn
    rng, seed = fresh_rng()
    config, sd, (x, _), mask = _run(FAMILIES["olmo_hybrid"], 75, rng)
    variant, ours, params = golden.convert.from_hf(config, sd, layer_idx=0)
    with jax.enable_x64(True):
        built = {"torch": torch_attn.build(variant, dict(ours), params).double(),
                 "jax": jax_attn.build(variant, dict(ours), params)}
        arrays = {"torch": lambda a: torch.from_numpy(np.asarray(a)),
                  "jax": lambda a: jax.numpy.asarray(a)}
        second = "jax" if first == "torch" else "torch"
        lib = {"torch": torch_attn, "jax": jax_attn}
        full = np.asarray(built[first](arrays[first](x), arrays[first](mask)).detach()
                          if first == "torch" else built[first](arrays[first](x),
                                                                arrays[first](mask)))
        _, cache = built[first](arrays[first](x[:, :70]), arrays[first](mask[:, :70]),
                                cache=built[first].init_cache(B, 75))
        cache = lib[second].load_cache(lib[first].export_cache(cache))
        built[second].init_cache(B, 75)  # the module's own bound on the tokens it takes
        pieces = []
        for t in range(70, 75):
            out, cache = built[second](arrays[second](x[:, t:t + 1]),
                                       arrays[second](mask[:, t:t + 1]), cache=cache)
            pieces.append(np.asarray(out.detach() if second == "torch" else out))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full[:, 70:], rtol=1e-11,
                               atol=1e-13, err_msg=f"seed {seed}")

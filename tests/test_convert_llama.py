"""Llama-style checkpoints <-> GroupedQueryAttention (golden.convert, jax_attn.convert): Hugging
Face's attention written out in float64 (and ``transformers``' own ``LlamaAttention`` where it
is installed) against the float64 reference and both twins built from ``llama_to_neutral``,
output, weights and every gradient, GQA, with and without biases; Meta's interleaved RoPE
layout through ``rope_permute``; exact round trips; copies; bad checkpoints.

Measured on this machine with transformers 5.23.0 (``LlamaAttention(...).double()``, 10
seeds, relative to the array's scale): its ``sdpa`` attention fed float64 cos/sin agrees with
ours to 3.9e-16; its ``eager`` attention, whose softmax runs in float32, to 7.8e-8 (output) and
1.8e-7 (weights); its own ``LlamaRotaryEmbedding`` (angles formed in float32) to 9.3e-8 on 7
positions, an error that grows with the position (README, "Rotary embeddings").

Shape legend: B batch, L length, D model width, H query heads, Hkv key-value heads, Dh head
width; every size distinct.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from torch import nn

import torch_attn
from golden.harness.check import compare_all
from golden.convert import (
    HF_NAMES,
    META_NAMES,
    llama_config,
    llama_to_neutral,
    neutral_to_llama,
    permute_qk,
    rope_permute,
    rope_unpermute,
)
from jax_attn import convert
from tests.helpers import JAX, TWINS, fresh_rng, random_cotangents, reference_fixture

B, L, D, H, HKV, DH, THETA = 3, 7, 10, 4, 2, 6, 100.0
GQA = "grouped_query_attention"
PREFIX = "model.layers.0.self_attn."
BIASES = {"none": (False, False), "qkv": (True, False), "all": (True, True)}  # Llama, Qwen2,
# Llama with attention_bias=True


def rotate_half(t):
    return torch.cat((-t[..., DH // 2:], t[..., :DH // 2]), dim=-1)


class LlamaAttention(nn.Module):
    """Hugging Face's LlamaAttention written out, float64 throughout (angles included):
    rotate-half RoPE, repeat_kv, a causal softmax, and a boolean mask (True = may attend)."""

    def __init__(self, qkv_bias, o_bias):
        super().__init__()
        linear = lambda i, o, b: nn.Linear(i, o, bias=b, dtype=torch.float64)  # noqa: E731
        self.q_proj, self.o_proj = linear(D, H * DH, qkv_bias), linear(H * DH, D, o_bias)
        self.k_proj, self.v_proj = linear(D, HKV * DH, qkv_bias), linear(D, HKV * DH, qkv_bias)

    def forward(self, x, mask):
        q = self.q_proj(x).view(B, L, H, DH).transpose(1, 2)           # (B, H, L, Dh)
        k, v = (p(x).view(B, L, HKV, DH).transpose(1, 2) for p in (self.k_proj, self.v_proj))
        inv_freq = THETA ** (-torch.arange(0, DH, 2, dtype=torch.float64) / DH)
        emb = torch.arange(L, dtype=torch.float64)[:, None] * inv_freq   # (L, Dh/2)
        cos, sin = torch.cat((emb, emb), -1).cos(), torch.cat((emb, emb), -1).sin()
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(H // HKV, dim=1), v.repeat_interleave(H // HKV, dim=1)
        allowed = torch.ones(L, L, dtype=torch.bool).tril() & mask[:, None]  # (B, 1, L, L)
        w = (q @ k.transpose(-1, -2) / DH ** 0.5).masked_fill(~allowed, -torch.inf).softmax(-1)
        return self.o_proj((w @ v).transpose(1, 2).reshape(B, L, H * DH)), w


def _randomize(module, rng, scale=0.5):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)) * scale))
    return module


def _arrays(rng):
    mask = rng.random((B, L, L)) < 0.7
    mask[:, np.arange(L), np.arange(L)] = True  # no empty row
    arrays = {"x": rng.standard_normal((B, L, D)), "mask": mask}
    return arrays, {n: a.astype(np.float64) for n, a in random_cotangents(
        rng, (B, L, D), (B, H, L, L)).items()}


def _llama_run(llama, arrays, cot) -> dict:
    """A runner result for the written-out module: its gradients mapped to the neutral layout by
    the same llama_to_neutral (a layout move, so gradients convert like weights)."""
    x = torch.tensor(arrays["x"], requires_grad=True)
    llama.zero_grad(set_to_none=True)
    out, w = llama(x, torch.from_numpy(arrays["mask"]))
    ((out * torch.from_numpy(cot["output"])).sum() + (w * torch.from_numpy(cot["weights"])).sum()
     ).backward()
    grads = llama_to_neutral({n: p.grad for n, p in llama.named_parameters()}, num_heads=H)
    return {"output": out.detach().numpy(), "weights": w.detach().numpy(),
            "grads": {"x": x.grad.numpy(), **grads}}


def _close(a, e, what):
    assert np.abs(a - e).max() <= 1e-12 * np.abs(e).max(), what


@pytest.mark.parametrize("biases", list(BIASES))
def test_llama_checkpoint_matches_ours_in_both_frameworks(biases):
    rng, seed = fresh_rng()
    llama = _randomize(LlamaAttention(*BIASES[biases]), rng)
    state_dict = {PREFIX + n: t for n, t in llama.state_dict().items()}  # torch tensors
    params = llama_to_neutral(state_dict, num_heads=H, prefix=PREFIX)
    config = llama_config(params, num_heads=H, rope_theta=THETA)
    assert (config["num_kv_heads"], config["head_dim"], config["d_out"]) == (HKV, DH, D)
    assert (config["qkv_bias"], config["out_bias"]) == BIASES[biases]
    arrays, cot = _arrays(rng)
    fixture = reference_fixture(GQA, config, arrays, params, cot, "float64")
    results = {"llama": _llama_run(llama, arrays, cot),
               "torch": TWINS["torch"].run_with_grads(torch_attn.build(GQA, config, params),
                                                      fixture, "float64")}
    with jax.enable_x64(True):
        module = convert.from_llama(state_dict, num_heads=H, rope_theta=THETA, prefix=PREFIX)
        assert module.config == config
        results["jax"] = JAX.run_with_grads(module, fixture, "float64")
    for name, result in results.items():
        comps = compare_all(fixture, result, "float64")
        assert set(comps) == {"output", "weights", "grad x", *(f"grad {n}" for n in params)}
        bad = {what: c for what, c in comps.items() if not c.ok}
        assert not bad, f"{name}, seed {seed}: {bad}"
    for name in ("torch", "jax"):  # directly against Hugging Face's, to 1e-12
        for what in ("output", "weights"):
            _close(results[name][what], results["llama"][what], (name, what, seed))


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_mistral_sliding_window_in_hugging_faces_meaning(framework):
    """from_llama(sliding_window=W) is Mistral's window: each query sees W keys, its own
    included (Hugging Face's kv_idx > q_idx − W), to 1e-12 against the written-out attention."""
    rng, seed = fresh_rng()
    llama, window = _randomize(LlamaAttention(False, False), rng), 3
    arrays, _ = _arrays(rng)
    row, key = np.arange(L)[:, None], np.arange(L)
    mask = np.broadcast_to(key > row - window, (B, L, L))
    with torch.no_grad():
        want = llama(torch.from_numpy(arrays["x"]), torch.from_numpy(mask.copy()))[0].numpy()
    twin = TWINS[framework]
    with twin.float64():
        converters = torch_attn.convert if framework == "torch" else convert
        module = converters.from_llama(llama.state_dict(), num_heads=H, rope_theta=THETA,
                                       sliding_window=window)
        assert module.config["sliding_window"] == window
        got = twin.numpy(module(twin.array(arrays["x"])))
    _close(got, want, (framework, seed))


def test_transformers_llama_attention():
    """transformers' own LlamaAttention, where it is installed (not a project dependency): its
    sdpa attention fed float64 cos/sin against the reference, gradients included; its eager
    attention (float32 softmax) and its own rotary table (float32 angles) measured; and our
    modules' weights written back into it."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    rng, seed = fresh_rng()
    d = 12  # transformers wants hidden_size divisible by the heads
    emb = np.arange(L)[:, None] * THETA ** (-np.arange(0, DH, 2) / DH)  # float64 angles
    cos_sin = tuple(torch.from_numpy(np.concatenate([f(emb)] * 2, -1))[None]
                    for f in (np.cos, np.sin))
    hf = {}
    for impl in ("sdpa", "eager"):  # a config each: the module reads it at every call
        config = transformers.LlamaConfig(hidden_size=d, num_attention_heads=H,
                                          num_key_value_heads=HKV, head_dim=DH,
                                          rope_theta=THETA, attention_bias=True)
        config._attn_implementation = impl
        hf[impl] = _randomize(modeling_llama.LlamaAttention(config, layer_idx=0).double(),
                              np.random.default_rng(seed))  # the same weights for both
    state_dict = hf["sdpa"].state_dict()
    params = llama_to_neutral(state_dict, num_heads=H)
    ours_config = llama_config(params, num_heads=H, rope_theta=THETA)
    arrays = {"x": rng.standard_normal((B, L, d))}
    cot = {n: a.astype(np.float64)
           for n, a in random_cotangents(rng, (B, L, d), (B, H, L, L)).items()}
    fixture = reference_fixture(GQA, ours_config, arrays, params, cot, "float64")
    x = torch.tensor(arrays["x"], requires_grad=True)
    out, _ = hf["sdpa"](x, cos_sin)  # causal: is_causal when no mask is given
    (out * torch.from_numpy(cot["output"])).sum().backward()
    grads = llama_to_neutral({n: p.grad for n, p in hf["sdpa"].named_parameters()},
                             num_heads=H)
    result = {"output": out.detach().numpy(), "loss": "output",
              "grads": {"x": x.grad.numpy(), **grads}}
    bad = {w: c for w, c in compare_all(fixture, result, "float64").items() if not c.ok}
    assert not bad, f"seed {seed}: {bad}"

    y, w = fixture.expected["output"], fixture.expected["weights"]
    causal = torch.full((L, L), -torch.inf, dtype=torch.float64).triu(1)[None, None]
    rope = modeling_llama.LlamaRotaryEmbedding(config)(x, torch.arange(L)[None])
    with torch.no_grad():
        y_eager, w_eager = (t.numpy() for t in hf["eager"](x, cos_sin, attention_mask=causal))
        y_rope = hf["eager"](x, rope, attention_mask=causal)[0].numpy()
    rel = {name: np.abs(a - e).max() / np.abs(e).max()
           for name, a, e in (("eager", y_eager, y), ("eager weights", w_eager, w),
                              ("rope", y_rope, y))}
    assert all(1e-12 < r < 1e-6 for r in rel.values()), (rel, seed)  # float32 steps inside
    with jax.enable_x64(True):  # and back: our JAX module's weights load into transformers'
        module = convert.from_llama(state_dict, num_heads=H, rope_theta=THETA)
        mine = {n: torch.from_numpy(a) for n, a in convert.to_llama(module).items()}
    hf["eager"].load_state_dict(mine, strict=True)
    assert all(torch.equal(t, hf["eager"].state_dict()[n]) for n, t in state_dict.items())


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_meta_interleaved_checkpoint(framework):
    """Meta's layout (wq, wk, wv, wo, interleaved RoPE pairs) read two ways: unpermuted with
    rope_interleaved=True, or permuted to rotate-half with rope_interleaved=False: the same
    function; and without either, a different one (the trap)."""
    rng, seed = fresh_rng()
    meta = {f"layers.0.attention.{n}.weight": rng.standard_normal(s) / 3 for n, s in zip(
        META_NAMES, ((H * DH, D), (HKV * DH, D), (HKV * DH, D), (D, H * DH)))}
    read = dict(num_heads=H, prefix="layers.0.attention.", names=META_NAMES)
    as_is, permuted = (llama_to_neutral(meta, interleaved=i, **read) for i in (False, True))
    config = llama_config(as_is, num_heads=H, rope_theta=THETA)
    twin = TWINS[framework]
    arrays = {"x": rng.standard_normal((B, L, D))}
    with twin.float64():
        runs = {name: twin.run(twin.build(GQA, dict(config, rope_interleaved=i), p), arrays)
                for name, i, p in (("meta", True, as_is), ("hf", False, permuted),
                                   ("trap", False, as_is))}
        if framework == "jax":  # to_llama writes either layout, whatever the module's
            meta_module = convert.from_llama(meta, interleaved=False, rope_theta=THETA, **read)
            assert meta_module.config["rope_interleaved"] is False  # from_llama: rotate-half
            interleaved = JAX.build(GQA, dict(config, rope_interleaved=True), as_is)
            back = convert.to_llama(interleaved, prefix=read["prefix"], names=META_NAMES,
                                    interleaved=True)
            assert back.keys() == meta.keys()
            assert all(np.array_equal(back[n], meta[n]) for n in meta)
            hf = convert.to_llama(interleaved)
            assert all(np.array_equal(hf[n], a) for n, a in neutral_to_llama(
                permuted, num_heads=H).items())
    for what in (0, 1):  # output, weights
        _close(runs["hf"][what], runs["meta"][what], (what, seed))
    assert np.abs(runs["trap"][0] - runs["meta"][0]).max() > 1e-3 * np.abs(runs["meta"][0]).max()


def test_rope_permute_is_hugging_faces_permute_and_inverts():
    assert rope_permute(np.arange(8), 1).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]  # 2i -> i
    assert rope_unpermute(np.arange(8), 1).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert rope_permute(np.arange(8), 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]  # per head
    rng, _ = fresh_rng()
    w = torch.from_numpy(rng.standard_normal((H * DH, D)))

    def permute(w, heads):  # convert_llama_weights_to_hf.py
        return w.view(heads, DH // 2, 2, D).transpose(1, 2).reshape(heads * DH, D)

    assert np.array_equal(rope_permute(w, H), permute(w, H).numpy())
    for a in (w.numpy(), w.numpy()[:, 0]):  # a weight (out, in) and a bias (out,)
        assert np.array_equal(rope_unpermute(rope_permute(a, H), H), a)
        assert np.array_equal(rope_permute(rope_unpermute(a, H), H), a)
    params = {"W_query": rng.standard_normal((D, H * DH)), "W_key": rng.standard_normal(
        (D, HKV * DH)), "b_key": rng.standard_normal(HKV * DH), "W_value": np.ones((D, 12))}
    moved = permute_qk(params, H)
    assert np.array_equal(moved["W_key"], rope_permute(params["W_key"].T, HKV).T)
    assert np.array_equal(moved["b_key"], rope_permute(params["b_key"], HKV))
    assert np.array_equal(moved["W_value"], params["W_value"])  # v (and o) never move
    back = permute_qk(moved, H, inverse=True)
    assert all(np.array_equal(back[n], params[n]) for n in params)


@pytest.mark.parametrize("names", [HF_NAMES, META_NAMES], ids=["hf", "meta"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
def test_round_trips_are_exact(names, interleaved):
    rng, _ = fresh_rng()
    shapes = dict(zip(names, ((H * DH, D), (HKV * DH, D), (HKV * DH, D), (D, H * DH))))
    sd = {f"p.{n}.weight": rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    sd.update({f"p.{n}.bias": rng.standard_normal(s[0]).astype(np.float32)
               for n, s in shapes.items()})
    read = dict(num_heads=H, prefix="p.", names=names, interleaved=interleaved)
    params = llama_to_neutral(sd, num_kv_heads=HKV, head_dim=DH, **read)
    back = neutral_to_llama(params, **{k: v for k, v in read.items()})
    assert back.keys() == sd.keys()
    assert all(back[n].dtype == np.float32 and np.array_equal(back[n], sd[n]) for n in sd)
    again = llama_to_neutral(back, **read)
    assert all(np.array_equal(again[n], params[n]) for n in params)
    # torch's bfloat16, which NumPy lacks, arrives as float32, exactly
    bf16 = {n: torch.from_numpy(a).to(torch.bfloat16) for n, a in sd.items()}
    got = llama_to_neutral(bf16, **read)
    assert got["W_query"].dtype == np.float32
    assert np.array_equal(got["W_out"], bf16["p." + names[3] + ".weight"].float().numpy().T)


def test_results_are_copies():
    rng, _ = fresh_rng()
    llama = _randomize(LlamaAttention(True, True), rng)
    sd = llama.state_dict()
    q = sd["q_proj.weight"].clone()
    params = llama_to_neutral(sd, num_heads=H)
    params["W_query"][...] = 0.0                  # the checkpoint's tensors are untouched
    assert torch.equal(llama.q_proj.weight.detach(), q)
    with torch.no_grad():
        llama.k_proj.weight.zero_()               # nor do they show through the result
    assert params["W_key"].any()
    back = neutral_to_llama(params, num_heads=H)
    back["k_proj.weight"][...] = 1.0
    assert params["W_key"].any() and not (params["W_key"] == 1.0).all()
    w = rng.standard_normal((H * DH, D))
    moved = rope_permute(w, H)
    moved[...] = 0.0
    assert w.any() and not np.shares_memory(rope_unpermute(w, H), w)
    with jax.enable_x64(True):
        module = convert.from_llama(sd, num_heads=H, rope_theta=THETA)
        exported = convert.to_llama(module)
        exported["q_proj.weight"][...] = 0.0
        assert np.asarray(module.W_query.kernel.get_value()).any()


def test_bad_checkpoints():
    rng, _ = fresh_rng()
    sd = {f"{n}.weight": rng.standard_normal(s) for n, s in zip(
        HF_NAMES, ((H * DH, D), (HKV * DH, D), (HKV * DH, D), (D, H * DH)))}
    with pytest.raises(ValueError, match="state_dict should hold 'model.q_proj.weight'"):
        llama_to_neutral(sd, num_heads=H, prefix="model.")
    with pytest.raises(ValueError, match=r"k_proj.weight shape should be \(18, 10\), got "
                                         r"\(12, 10\)"):
        llama_to_neutral(sd, num_heads=H, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"q_proj.weight shape should be \(20, 10\), got "
                                         r"\(24, 10\)"):
        llama_to_neutral(sd, num_heads=H, head_dim=5)
    with pytest.raises(ValueError, match="q_proj.bias, k_proj.bias and v_proj.bias should be "
                                         "all present or all absent, got \\['q_proj.bias'\\]"):
        llama_to_neutral({**sd, "q_proj.bias": np.zeros(H * DH)}, num_heads=H)
    with pytest.raises(ValueError, match="num_heads should be a positive int, got 0"):
        llama_to_neutral(sd, num_heads=0)
    with pytest.raises(ValueError, match=r"w first axis should be heads·Dh = 5·Dh with Dh "
                                         r"even, got shape \(24, 10\)"):
        rope_permute(sd["q_proj.weight"], 5)
    with pytest.raises(ValueError, match="num_heads should divide W_query's width 24, got 5"):
        neutral_to_llama(llama_to_neutral(sd, num_heads=H), num_heads=5)


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
def test_from_llama_and_to_llama_are_twins(interleaved):
    """torch_attn.convert and jax_attn.convert build the same module from one checkpoint, and
    give the checkpoint back bit for bit."""
    import jax

    import jax_attn

    rng, seed = fresh_rng()
    shapes = dict(zip(HF_NAMES, ((H * DH, D), (HKV * DH, D), (HKV * DH, D), (D, H * DH))))
    sd = {f"{n}.weight": rng.standard_normal(s) / np.sqrt(s[1]) for n, s in shapes.items()}
    read = dict(num_heads=H, rope_theta=100.0, interleaved=interleaved)
    ours_torch = torch_attn.convert.from_llama(sd, **read).double().eval()
    x = rng.standard_normal((2, 6, D))
    with jax.enable_x64(True):
        ours_jax = jax_attn.convert.from_llama(sd, **read)
        out_jax = np.asarray(ours_jax(jax.numpy.asarray(x)))
        back_jax = jax_attn.convert.to_llama(ours_jax, interleaved=interleaved)
    out_torch = ours_torch(torch.from_numpy(x)).detach().numpy()
    assert np.abs(out_torch - out_jax).max() <= 1e-12 * max(1, np.abs(out_jax).max()), seed
    for back in (torch_attn.convert.to_llama(ours_torch, interleaved=interleaved), back_jax):
        assert back.keys() == sd.keys()
        assert all(np.array_equal(back[n], sd[n]) for n in sd), seed
    with pytest.raises(ValueError, match="module should be a torch_attn.GroupedQueryAttention"):
        torch_attn.convert.to_llama(torch_attn.MultiHeadAttention(4, 6, num_heads=2))

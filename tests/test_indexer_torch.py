"""torch_attn's MultiHeadLatentAttention with the learned indexer (issue 44; the maths is
golden.reference.indexer's): the mla_indexer_* fixtures and their stored choice, the one tie
rule on exact ties, the float32 choice against float64's (near-ties counted), gradients against
the reference's with the choice held constant (none for the indexer's parameters), decoding with
the indexer's key cache against the full forward, bad calls refused by name, and Hugging Face's
DeepseekV32Attention at float64 (forward, choice, input gradients).

Shape legend: B batch, L tokens, k the keys kept per query (index_topk), D_I the indexer's
head width.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import golden
import torch_attn
from golden import reference
from golden.harness.check import compare_all
from golden.harness.regenerate import draw_params
from golden.runners import torch_runner
from golden.specification import variants
from golden.specification.tolerances import TOLERANCES, compare
from tests.hf_harness import indexer_hf_case, indexer_hf_rope
from tests.helpers import fixture_of, missing_option, score_gaps
from torch_attn.modules.latent import select_keys
from torch_attn.params import export_grads

MLA = "multi_head_latent_attention"
BASE = dict(d_in=6, num_heads=3, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=4,
            v_head_dim=5, q_lora_rank=7, rope_theta=100.0, index_topk=5, index_heads=4,
            index_head_dim=6)
KINDS = {  # one of each family's settings (as tests/test_indexer_reference.py's)
    "deepseek_v32": {},
    "glm5": dict(index_rope="interleaved"),
    "hy_v4": dict(index_rope_dims="last", index_scale="weights", index_norm_eps=1e-5,
                  sinks=True, output_gate="sigmoid", rope_interleaved=False),
    "mistral_large4": dict(q_lora_rank=None, index_query="layer_norm", index_temperature=True,
                           index_rope="interleaved", query_temperature={"kind": "learned"}),
}
FIXTURES = [n for n in golden.names() if fixture_of(n).config.get("index_topk") is not None]
F64 = torch.float64


def _case(kind, seed, length=11, lead=(2,)):
    """(config, float64 params, x (*lead, L, d_in), rng) of one family's settings."""
    c = variants.get(MLA).config({**BASE, **KINDS[kind]})
    rng = np.random.default_rng(seed)
    p = {n: a.astype(np.float64) for n, a in draw_params(MLA, c, rng).items()}
    return c, p, rng.standard_normal(lead + (length, c["d_in"])), rng


def _module(c, p, dtype=F64):
    return torch_attn.build(MLA, c, p).to(dtype)


def _reference_scores(c, p, x):
    """The reference's scores (*lead, L, L) and the causal allowed set, positions 0 … L − 1."""
    from golden.reference.block import linear
    from golden.reference.norms import normalize
    from golden.reference.rotary import rope_cos_sin

    positions = np.arange(x.shape[-2])
    cos, sin = rope_cos_sin(variants.latent_rope(c), c["qk_rope_head_dim"], positions)
    q_resid = None if "W_q_a" not in p else normalize(
        "rms", linear(x, p["W_q_a"], None), p["q_a_norm"], c["rms_norm_eps"])[0]
    scores = reference.index_scores(c, x, q_resid, positions, cos, sin, p)
    allowed = np.broadcast_to(np.tril(np.ones((x.shape[-2],) * 2, bool)), scores.shape)
    return scores, allowed


# ---- the fixtures ------------------------------------------------------------------------------

def test_the_fixtures_run_in_torch_not_skipped():
    assert len(FIXTURES) == 4
    for name in FIXTURES:
        assert missing_option("torch", golden.load(name)) is None, name


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_and_its_choice(name, dtype):
    """The runner's result within the fixture's tolerances (every gradient, none for the
    indexer's parameters); the module's own choice equal to the stored one (the fixtures' gaps
    are >= 1e-3, far above float32's error); the stored choice given back (no indexer run)
    gives the same output bit for bit."""
    f = golden.load(name)
    result = torch_runner.run_fixture(f, dtype)
    assert set(result["grads"]) == set(f.grads)
    assert not any(n in result["grads"] for n in f.params if "index" in n)
    bad = {w: c for w, c in compare_all(f, result, dtype).items() if not c.ok}
    assert not bad, bad
    module = torch_runner._prepared(f, dtype, train=False)[0]
    inputs = {n: torch.tensor(a) for n, a in f.inputs.items()}
    if "x" in inputs:
        inputs["x"] = inputs["x"].to(module.W_kv_a.weight.dtype)
    args, kwargs = variants.lookup(f.variant).call_args(inputs)
    with torch.no_grad():
        y, chosen = module(*args, **kwargs, return_key_indices=True)
        given = module(*args, **kwargs, key_indices=torch.tensor(f.expected["key_indices"]))
    assert chosen.dtype == torch.int32
    np.testing.assert_array_equal(chosen.numpy(), f.expected["key_indices"])
    assert torch.equal(y, given)
    assert compare(y.numpy(), f.expected["output"], dtype).ok


# ---- the tie rule ------------------------------------------------------------------------------

def test_equal_scores_go_to_the_lowest_key_index():
    """select_keys on exact ties (torch.topk promises no order among them) against the
    reference's rule, by hand and on many random small integers."""
    scores = torch.tensor([[3.0, 1.0, 3.0, 2.0, 3.0, 0.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                           [1.0, 5.0, 5.0, 5.0, 1.0, 1.0],
                           [3.0, 1.0, 3.0, 2.0, 3.0, 0.0]], dtype=F64)
    allowed = torch.tensor([[True] * 6, [True] * 6, [True, False, True, True, True, False],
                            [True, False, False, True, False, False]])  # 2 allowed < k = 3
    want = [[0, 2, 4], [0, 1, 2], [2, 3, 0], [0, 3, 1]]
    assert select_keys(scores, allowed, 3).tolist() == want
    np.testing.assert_array_equal(reference.select_keys(scores.numpy(), allowed.numpy(), 3),
                                  want)
    rng = np.random.default_rng(0)
    many = rng.integers(-2, 3, (40, 9, 17)).astype(np.float64)  # every row full of ties
    ok = rng.random(many.shape) < 0.7
    for dtype in (torch.float32, F64):
        got = select_keys(torch.tensor(many, dtype=dtype), torch.tensor(ok), 6)
        np.testing.assert_array_equal(got.numpy(), reference.select_keys(many, ok, 6))


def test_a_module_whose_scores_all_tie_keeps_the_first_keys():
    """With W_index_weights 0 every score is exactly 0: each query keeps its first k keys it
    may see (k = 5: keys 0 … 4 from query 4 on), the rest filled with the unseen ones by index."""
    c, p, x, _ = _case("deepseek_v32", 1, length=9)
    p["W_index_weights"] = np.zeros_like(p["W_index_weights"])
    _, chosen = _module(c, p)(torch.tensor(x), return_key_indices=True)
    want = np.broadcast_to(np.arange(5), (2, 9, 5))
    np.testing.assert_array_equal(chosen.numpy(), want)


# ---- the choice against the reference, float32 against float64 ----------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_the_choice_equals_the_references(kind):
    """Fresh inputs, L = 13 > k = 5: the float64 module chooses the reference's keys on every
    row (the reference computes the same float64 sums in another order: a row whose two scores
    fall within 1e-12 is a near-tie and is not compared; there must be few)."""
    c, p, x, _ = _case(kind, 10, length=13)
    _, chosen = _module(c, p)(torch.tensor(x), return_key_indices=True)
    forward, _ = reference.pair(MLA)
    _, _, saved = forward(c, {"x": x}, p)
    scores, allowed = _reference_scores(c, p, x)
    gaps = score_gaps(scores, allowed, 5)
    clear = gaps > 1e-12
    assert clear.sum() >= 0.9 * clear.size
    np.testing.assert_array_equal(chosen.numpy()[clear], saved["key_indices"][clear])


@pytest.mark.parametrize("kind", KINDS)
def test_float32_chooses_as_float64_where_the_gap_is_clear(kind):
    """The float32 module (scores in float32, as Hugging Face's) keeps float64's keys on every
    row whose k-th and (k+1)-th scores are apart by more than 1e-4 of the row's largest (far
    above float32's error of ~1e-6 on them); rows closer than that are counted, and few."""
    c, p, x, _ = _case(kind, 20, length=24, lead=(3,))
    _, wide = _module(c, p)(torch.tensor(x), return_key_indices=True)
    _, narrow = _module(c, p, torch.float32)(torch.tensor(x, dtype=torch.float32),
                                             return_key_indices=True)
    scores, allowed = _reference_scores(c, p, x)
    gaps = score_gaps(scores, allowed, 5)
    clear = gaps > 1e-4
    near = int((~clear).sum())
    assert near <= 0.1 * clear.size, f"{near} near-ties of {clear.size} rows"
    np.testing.assert_array_equal(np.sort(narrow.numpy()[clear], -1),
                                  np.sort(wide.numpy()[clear], -1))
    differ = (np.sort(narrow.numpy(), -1) != np.sort(wide.numpy(), -1)).any(-1)
    assert not (differ & clear).any()


# ---- gradients ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_gradients_equal_the_references_with_the_choice_constant(kind):
    """float64: the output, the weights and the gradient of Σ y ⊙ dy + Σ w ⊙ dw for x and
    every parameter against the reference's (whose backward holds the choice constant); the
    indexer's parameters get no gradient (None)."""
    c, p, x, rng = _case(kind, 30, length=10)
    mask = rng.random((2, 10, 10)) < 0.85
    module = _module(c, p)
    xt = torch.tensor(x, requires_grad=True)
    y, w = module(xt, torch.tensor(mask), return_weights=True)
    dy, dw = rng.standard_normal(y.shape), rng.standard_normal(w.shape)
    ((y * torch.tensor(dy)).sum() + (w * torch.tensor(dw)).sum()).backward()
    forward, backward = reference.pair(MLA)
    y0, w0, saved = forward(c, {"x": x, "mask": mask}, p)
    g0 = backward(saved, dy, dw)
    assert not reference.selected_mask(saved["key_indices"], 10)[:, 5:].all()
    assert compare(y.detach().numpy(), y0, "float64").ok
    assert compare(w.detach().numpy(), w0, "float64", "weights").ok
    grads = {**export_grads(module), "x": xt.grad.numpy()}
    assert set(grads) == set(g0) and not any("index" in n for n in grads)
    for n, g in g0.items():
        assert compare(grads[n], g, "float64", "grad").ok, n
    for n, t in module.named_parameters():
        assert (t.grad is None) == ("index" in n), n


# ---- decoding with the indexer's key cache ----------------------------------------------------

@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_prefill_then_decode_equals_the_full_forward(kind, absorb):
    """L = 12 > k = 5, rows of 12 and 9 real tokens: 7 tokens at once, then one at a time
    through the cache (index_key kept beside the latent, moved through export_cache and
    load_cache once), equal to the full forward at float64's floor, the same keys chosen."""
    c, p, x, _ = _case(kind, 40, length=12)
    module = _module(c, p)
    lengths = torch.tensor([12, 9], dtype=torch.int32)
    with torch.no_grad():
        full, chosen = module(torch.tensor(x), query_seq_lengths=lengths,
                              return_key_indices=True)
        cache = module.init_cache(2, 14)
        assert cache.index_key.shape == (2, 14, 6)
        ys, keys, done = [], [], torch.zeros(2, dtype=torch.int32)
        for start, stop in [(0, 7)] + [(t, t + 1) for t in range(7, 12)]:
            new = (lengths - start).clamp(0, stop - start).to(torch.int32)
            (y, k), cache = module(torch.tensor(x[:, start:stop]), cache=cache,
                                   query_seq_lengths=new, return_key_indices=True,
                                   absorb=absorb)
            ys.append(y)
            keys.append(k)
            if start == 7:
                moved = torch_attn.export_cache(cache)
                assert isinstance(moved.index_key, np.ndarray)
                cache = torch_attn.load_cache(moved)
                assert torch.equal(cache.index_key, torch.tensor(moved.index_key))
            done = done + new
    assert done.tolist() == [12, 9]
    stepped = torch.cat(ys, 1).numpy()
    for b, n in enumerate(lengths.tolist()):  # the real tokens
        assert compare(stepped[b, :n], full[b, :n].numpy(), "float64").ok, b
        np.testing.assert_array_equal(torch.cat(keys, 1)[b, :n].numpy(), chosen[b, :n].numpy())
    assert not (np.sort(chosen[:, 6:].numpy(), -1) == np.arange(5)).all()  # not all the first


def test_a_cache_without_index_key_is_refused():
    c, p, x, _ = _case("deepseek_v32", 2, length=4)
    module = _module(c, p)
    cache = module.init_cache(2, 6)
    with pytest.raises(ValueError, match=r"cache.index_key should be an array of shape "
                                         r"\(B, M, index_head_dim\) = \(2, 6, 6\) with "
                                         r"index_topk .* got None"):
        module(torch.tensor(x), cache=cache._replace(index_key=None))
    with pytest.raises(ValueError, match=r"cache.index_key should be \(B, M, index_head_dim\) "
                                         r"= \(2, 6, 6\) in x's dtype torch.float64, got "
                                         r"\(2, 6, 5\)"):
        module(torch.tensor(x), cache=cache._replace(index_key=cache.index_key[..., :5]))
    assert module.cache_bytes_per_token() == (4 + 4 + 6) * 8


# ---- bad calls ---------------------------------------------------------------------------------

@pytest.mark.parametrize("key_indices, match", [
    (torch.zeros(2, 8, 4, dtype=torch.int64),
     r"key_indices shape should be \(B, Lq, k\) = \(2, 8, 5\), got \(2, 8, 4\)"),
    (torch.zeros(2, 8, 5), "key_indices dtype should be an integer type, got float32"),
    (torch.full((2, 8, 5), 8), r"key_indices should lie in \[0, Lk\) = \[0, 8\), got values "
                               r"in \[8, 8\]"),
    (torch.full((2, 8, 5), -1), r"key_indices should lie in \[0, Lk\) = \[0, 8\)"),
    (np.zeros((2, 8, 5), np.int64), "key_indices should be a torch.Tensor, got ndarray"),
])
def test_bad_key_indices_are_refused_by_name(key_indices, match):
    c, p, x, _ = _case("deepseek_v32", 3, length=8)
    with pytest.raises(ValueError, match=match):
        _module(c, p)(torch.tensor(x), key_indices=key_indices)


def test_indexer_arguments_without_the_indexer_and_head_masks_are_refused():
    c, p, x, _ = _case("deepseek_v32", 4, length=8)
    with pytest.raises(ValueError, match="mask should have no head axis, or one of size 1, "
                                         "with index_topk"):
        _module(c, p)(torch.tensor(x), torch.ones(2, 3, 8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="return_key_indices should be True or False, got 1"):
        _module(c, p)(torch.tensor(x), return_key_indices=1)
    dense = {n: v for n, v in c.items() if not n.startswith("index_")}
    plain = _module(dense, {n: a for n, a in p.items() if "index" not in n})
    with pytest.raises(ValueError, match="key_indices should be None without index_topk"):
        plain(torch.tensor(x), key_indices=torch.zeros(2, 8, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="return_key_indices should be False without "
                                         "index_topk"):
        plain(torch.tensor(x), return_key_indices=True)
    assert plain.init_cache(2, 9).index_key is None


# ---- Hugging Face's DeepSeek-V3.2 at float64 --------------------------------------------------

@pytest.mark.parametrize("length", [12, 4])  # above and below index_topk = 5
def test_hugging_face_deepseek_v32_at_float64(length):
    """HF's DeepseekV32Attention (tests/hf_harness.indexer_hf_case) against ours built from
    the same parameters: the same keys on every row whose scores are clearly apart (HF scores
    in float32), the output given HF's own choice within float64's tolerance (and our own
    choice where every row is clear), the input gradient likewise (HF's indexer runs under
    no_grad, ours too); with L > k, the layer without the indexer differs far."""
    layer, config, params = indexer_hf_case(44, topk=5)
    ours = _module(config, params)
    rng = np.random.default_rng(100 + length)
    x = rng.standard_normal((2, length, 6))
    emb = indexer_hf_rope(config, length, 2)
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))[None, None].repeat(
        2, 1, 1, 1)
    dy = torch.tensor(rng.standard_normal((2, length, 6)))
    x_hf, x_ours = torch.tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
    hf_out = layer(x_hf, emb, causal)[0]
    (hf_out * dy).sum().backward()
    with torch.no_grad():
        q_resid = layer.q_a_layernorm(layer.q_a_proj(x_hf))
        hf_keys = layer.indexer(x_hf, q_resid, emb, causal[:, 0], None)
    y, chosen = ours(x_ours, return_key_indices=True)
    (y * dy).sum().backward()
    c = variants.get(MLA).config(config)
    scores, allowed = _reference_scores(c, params, x)
    k = min(5, length)
    clear = score_gaps(scores, allowed, k) > 1e-4
    assert clear.sum() >= 0.9 * clear.size
    for row in zip(*np.nonzero(clear)):
        ok = allowed[row]
        mine, theirs = set(chosen[row].tolist()), set(hf_keys[row].tolist())
        assert {j for j in mine if ok[j]} == {j for j in theirs if ok[j]}, row
    bound = TOLERANCES[("float64", "value")].rel_norm
    with torch.no_grad():
        given = ours(torch.tensor(x), key_indices=hf_keys)
    assert torch.linalg.norm(given - hf_out) <= bound * torch.linalg.norm(hf_out)
    if clear.all():
        assert torch.linalg.norm(y - hf_out) <= bound * torch.linalg.norm(hf_out)
        g_bound = TOLERANCES[("float64", "grad")].rel_norm
        assert torch.linalg.norm(x_ours.grad - x_hf.grad) <= g_bound * torch.linalg.norm(
            x_hf.grad)
    if length > k:  # the setting undone moves far: without the indexer, another output
        dense = {n: v for n, v in config.items() if not n.startswith("index_")}
        far = _module(dense, {n: a for n, a in params.items() if "index" not in n})
        with torch.no_grad():
            assert torch.linalg.norm(far(torch.tensor(x)) - hf_out) > 1e-3 * torch.linalg.norm(
                hf_out)
